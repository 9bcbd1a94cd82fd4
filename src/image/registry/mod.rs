//! The OCI distribution (registry v2) client: resolves a reference to one platform's manifest,
//! fetches and verifies its config, and streams every layer into a [`LayerSink`] — download,
//! sha256 of the compressed blob, decompression (gzip, zstd or none) and extraction in one pass,
//! several layers at once. A layer is published only when both its blob digest (checked here)
//! and its diff_id (checked by the sink) match.
//!
//! Blocking I/O on std threads (ureq with rustls): a pull is a handful of long transfers, and
//! keeping an async runtime out of berth keeps it out of code that later forks into namespaces.

pub mod auth;
mod blob;
mod http;
pub mod manifest;
mod progress;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use oci_spec::image::ImageConfiguration;
use ureq::http::StatusCode;

pub use self::auth::{Credentials, Login};
use self::http::{Method, Target, Transport};
use self::manifest::{Descriptor, Manifest, Wanted};
pub use self::progress::ProgressMode;
use super::{ImageError, LayerSink, RegistryRef, StagedLayer};
use crate::config::RegistryConfig;

/// Registry failures, each one line naming the image and registry and saying what to do.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error(
        "pulling {image}: {registry} requires a login: add 'machine {host} login USER password \
         PASS' to {files}"
    )]
    CredentialsRequired {
        image: String,
        registry: String,
        host: String,
        files: String,
    },
    #[error(
        "pulling {image}: {registry} rejected the login '{login}' from {}: check the \
         credentials in that file", file.display()
    )]
    LoginRejected {
        image: String,
        registry: String,
        login: String,
        file: PathBuf,
    },
    #[error(
        "pulling {image}: no login '{user}' for {registry} in {files}: add one or drop '{user}@'"
    )]
    NoSuchLogin {
        image: String,
        registry: String,
        user: String,
        files: String,
    },
    #[error("image {image} not found: {detail}")]
    NotFound { image: String, detail: String },
    #[error("pulling {image}: {registry} has no blob {digest} that the manifest lists")]
    BlobMissing {
        image: String,
        registry: String,
        digest: String,
    },
    #[error("pulling {image}: TLS connection to {registry} failed: {detail}; {hint}")]
    Tls {
        image: String,
        registry: String,
        detail: String,
        hint: String,
    },
    #[error(
        "pulling {image}: {registry} unreachable after {attempts} attempt(s): {detail}; check \
         the registry and network, then retry"
    )]
    Unreachable {
        image: String,
        registry: String,
        attempts: u32,
        detail: String,
    },
    /// The registry answered, with a server error (5xx) or 429, every time it was asked.
    #[error(
        "pulling {image}: {registry} answered {status}{said} to each of {attempts} attempt(s): \
         the registry failed, not the network; retry later or ask its administrators"
    )]
    ServerError {
        image: String,
        registry: String,
        attempts: u32,
        status: String,
        said: String,
    },
    #[error(
        "pulling {image}: {what} {expected} from {registry} has sha256 {actual} ({size} bytes): \
         the registry served corrupt data; nothing was stored"
    )]
    DigestMismatch {
        image: String,
        registry: String,
        what: &'static str,
        expected: String,
        actual: String,
        size: u64,
    },
    #[error("pulling {image}: unexpected answer from {registry}: {detail}")]
    Protocol {
        image: String,
        registry: String,
        detail: String,
    },
    #[error("pulling {image}: {detail}")]
    Image { image: String, detail: String },
    #[error("image {image} has no {want} variant (it has {have}): choose one with --arch")]
    NoPlatform {
        image: String,
        want: String,
        have: String,
    },
    #[error("pulling {image}: storing layer {digest}: {source}")]
    Layer {
        image: String,
        digest: String,
        source: ImageError,
    },
    #[error("registry configuration: {detail}")]
    Config { detail: String },
    /// Another layer of the same pull failed first.
    #[error("pull aborted")]
    Aborted,
}

impl From<RegistryError> for ImageError {
    fn from(e: RegistryError) -> Self {
        ImageError::Registry(e.to_string())
    }
}

/// What to pull besides the reference.
#[derive(Clone, Debug, Default)]
pub struct PullOptions {
    /// `--arch`: the platform to pick from a multi-platform image; the host's when `None`.
    pub arch: Option<String>,
    pub progress: ProgressMode,
}

/// A pulled image: every layer is in the store.
#[derive(Clone, Debug)]
pub struct Pulled {
    /// Digest of the image manifest (the chosen platform's, for a multi-platform image).
    pub manifest_digest: String,
    /// Digest of the index or manifest list the image was chosen from, if any.
    pub index_digest: Option<String>,
    pub config_digest: String,
    pub config: ImageConfiguration,
    /// The store's layer directories, bottom layer first.
    pub layers: Vec<PathBuf>,
    /// No login was sent: the image is public, any user may be given it from the cache.
    pub anonymous: bool,
}

/// An image whose manifest and config have been fetched and checked; its layers not yet.
#[derive(Clone, Debug)]
pub struct Resolved {
    target: Target,
    pub manifest_digest: String,
    pub index_digest: Option<String>,
    pub config_digest: String,
    pub config: ImageConfiguration,
    layers: Vec<Descriptor>,
    diff_ids: Vec<String>,
}

impl Resolved {
    /// Compressed bytes of all layers, as the manifest lists them.
    pub fn download_size(&self) -> u64 {
        self.layers.iter().map(|l| l.size).sum()
    }

    /// Layers the manifest lists (checked against `store.max_layers` before any is fetched).
    pub fn layer_count(&self) -> usize {
        self.layers.len()
    }
}

/// A registry client for one user (whose credentials it reads) and one pull or check.
pub struct Client {
    transport: Transport,
    parallel: usize,
}

impl Client {
    /// `user_home` is the home of the user the image is pulled for: `~` in
    /// `registry.credentials` and Enroot's default credentials path resolve there.
    pub fn new(config: &RegistryConfig, user_home: Option<&Path>) -> Result<Self, RegistryError> {
        let enroot_dir = std::env::var_os("ENROOT_CONFIG_PATH").map(PathBuf::from);
        Self::with_enroot_config(config, user_home, enroot_dir.as_deref())
    }

    /// [`Client::new`] with the user's `$ENROOT_CONFIG_PATH` given explicitly (berth acting
    /// for another user must not take it from its own environment).
    pub fn with_enroot_config(
        config: &RegistryConfig,
        user_home: Option<&Path>,
        enroot_config_path: Option<&Path>,
    ) -> Result<Self, RegistryError> {
        let files = auth::credential_files(
            &config.credentials,
            config.enroot_credentials,
            enroot_config_path,
            user_home,
        );
        let credentials = Credentials::load(files, user_home)
            .map_err(|detail| RegistryError::Config { detail })?;
        Ok(Self {
            transport: Transport::new(config, credentials)?,
            parallel: config.parallel_downloads.max(1),
        })
    }

    /// Whether the user may read the image: a manifest HEAD with the user's credentials. For
    /// deciding whether a cached private image may be handed to this user.
    pub fn check_access(&self, r: &RegistryRef) -> Result<bool, RegistryError> {
        let t = target(r);
        let url = manifest_url(&self.transport, &t, r);
        let result =
            self.transport
                .send(&t, Method::Head, &url, Some(manifest::ACCEPT), None, None);
        match result {
            Ok(resp) if resp.status().is_success() => Ok(true),
            Ok(resp)
                if matches!(
                    resp.status(),
                    StatusCode::FORBIDDEN | StatusCode::NOT_FOUND | StatusCode::UNAUTHORIZED
                ) =>
            {
                Ok(false)
            }
            Ok(resp) => Err(RegistryError::Protocol {
                image: t.image,
                registry: t.registry,
                detail: format!("manifest HEAD answered {}", resp.status()),
            }),
            Err(
                RegistryError::CredentialsRequired { .. }
                | RegistryError::LoginRejected { .. }
                | RegistryError::NoSuchLogin { .. },
            ) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Fetches and checks the manifest (choosing the platform from an index) and the config of
    /// `r`, without downloading layers: the manifest digest says whether the store has the image.
    pub fn resolve(
        &self,
        r: &RegistryRef,
        options: &PullOptions,
    ) -> Result<Resolved, RegistryError> {
        let t = target(r);
        let want = match &options.arch {
            Some(a) => Wanted::parse(a).map_err(|detail| RegistryError::Image {
                image: t.image.clone(),
                detail,
            })?,
            None => Wanted::host(),
        };
        let url = manifest_url(&self.transport, &t, r);
        let (body, digest, content_type) = self.fetch_manifest(&t, &url, r.digest.as_deref())?;
        let parsed = manifest::parse(&body, content_type.as_deref())
            .map_err(|detail| self.image_error(&t, detail))?;
        let (manifest_digest, index_digest, config_desc, layers) = match parsed {
            Manifest::Image { config, layers } => (digest, None, config, layers),
            Manifest::Index(entries) => {
                let chosen =
                    manifest::select(&entries, &want).ok_or_else(|| RegistryError::NoPlatform {
                        image: t.image.clone(),
                        want: want.to_string(),
                        have: manifest::platforms(&entries),
                    })?;
                check_digest(&t, &chosen.digest)?;
                let url = format!("{}manifests/{}", self.transport.repo_url(&t), chosen.digest);
                let (body, child, content_type) =
                    self.fetch_manifest(&t, &url, Some(&chosen.digest))?;
                match manifest::parse(&body, content_type.as_deref())
                    .map_err(|detail| self.image_error(&t, detail))?
                {
                    Manifest::Image { config, layers } => (child, Some(digest), config, layers),
                    Manifest::Index(_) => {
                        return Err(self.image_error(
                            &t,
                            format!("index entry {} is itself an index", chosen.digest),
                        ));
                    }
                }
            }
        };
        check_digest(&t, &config_desc.digest)?;
        for l in &layers {
            check_digest(&t, &l.digest)?;
            if l.media_type
                .as_deref()
                .is_some_and(|m| m.contains("encrypted"))
            {
                return Err(self.image_error(
                    &t,
                    format!(
                        "layer {} is encrypted, which berth does not support",
                        l.digest
                    ),
                ));
            }
        }
        let config_bytes = self.fetch_config(&t, &config_desc)?;
        let config: ImageConfiguration = serde_json::from_slice(&config_bytes).map_err(|e| {
            self.image_error(
                &t,
                format!("image config {} is invalid: {e}", config_desc.digest),
            )
        })?;
        check_architecture(&config, &want, options.arch.is_some())
            .map_err(|detail| self.image_error(&t, detail))?;
        let diff_ids = config.rootfs().diff_ids().clone();
        if diff_ids.len() != layers.len() {
            return Err(self.image_error(
                &t,
                format!(
                    "the manifest lists {} layers but the config {} diff_ids",
                    layers.len(),
                    diff_ids.len()
                ),
            ));
        }
        for d in &diff_ids {
            check_digest(&t, d)?;
        }
        Ok(Resolved {
            target: t,
            manifest_digest,
            index_digest,
            config_digest: config_desc.digest,
            config,
            layers,
            diff_ids,
        })
    }

    /// Downloads the layers of a resolved image into `sink` (skipping those it has).
    pub fn fetch(
        &self,
        resolved: Resolved,
        options: &PullOptions,
        sink: &dyn LayerSink,
    ) -> Result<Pulled, RegistryError> {
        let r = resolved;
        let paths = self.fetch_layers(&r.target, &r.layers, &r.diff_ids, options.progress, sink)?;
        Ok(Pulled {
            manifest_digest: r.manifest_digest,
            index_digest: r.index_digest,
            config_digest: r.config_digest,
            config: r.config,
            layers: paths,
            anonymous: !self.transport.used_login(),
        })
    }

    /// Resolves and downloads an image: [`Client::resolve`] then [`Client::fetch`].
    pub fn pull(
        &self,
        r: &RegistryRef,
        options: &PullOptions,
        sink: &dyn LayerSink,
    ) -> Result<Pulled, RegistryError> {
        let resolved = self.resolve(r, options)?;
        self.fetch(resolved, options, sink)
    }

    fn image_error(&self, t: &Target, detail: String) -> RegistryError {
        RegistryError::Image {
            image: t.image.clone(),
            detail,
        }
    }

    /// GETs a manifest; returns its body, digest and Content-Type. With `pinned` the body must
    /// hash to it.
    fn fetch_manifest(
        &self,
        t: &Target,
        url: &str,
        pinned: Option<&str>,
    ) -> Result<(Vec<u8>, String, Option<String>), RegistryError> {
        let (body, content_type) = self.get_document(t, url, Some(manifest::ACCEPT), "manifest")?;
        let digest = blob::sha256_of(&body);
        if let Some(p) = pinned
            && p != digest
        {
            return Err(RegistryError::DigestMismatch {
                image: t.image.clone(),
                registry: t.registry.clone(),
                what: "manifest",
                expected: p.to_string(),
                actual: digest,
                size: body.len() as u64,
            });
        }
        Ok((body, digest, content_type))
    }

    /// GETs a small document (manifest, config) and reads its body, retrying as layers are
    /// retried when the connection drops while the body is read (`send` retries only until the
    /// headers came). Returns the body and its Content-Type.
    fn get_document(
        &self,
        t: &Target,
        url: &str,
        accept: Option<&str>,
        what: &str,
    ) -> Result<(Vec<u8>, Option<String>), RegistryError> {
        let mut attempt = 0u32;
        loop {
            let resp = self
                .transport
                .send(t, Method::Get, url, accept, None, None)?;
            if what == "config" && resp.status() == StatusCode::NOT_FOUND {
                return Err(RegistryError::BlobMissing {
                    image: t.image.clone(),
                    registry: t.registry.clone(),
                    digest: url.rsplit('/').next().unwrap_or_default().to_string(),
                });
            }
            if !resp.status().is_success() {
                return Err(self.not_ok(t, resp, what));
            }
            let content_type = resp
                .headers()
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            match self.transport.read_document(t, resp) {
                Ok(body) => return Ok((body, content_type)),
                Err(RegistryError::Unreachable { detail, .. }) => {
                    attempt += 1;
                    if attempt >= self.transport.retries {
                        return Err(RegistryError::Unreachable {
                            image: t.image.clone(),
                            registry: t.registry.clone(),
                            attempts: attempt,
                            detail: format!("reading the {what}: {detail}"),
                        });
                    }
                    tracing::debug!(%url, attempt, %detail, "retrying a dropped {what}");
                    std::thread::sleep(self.transport.backoff(attempt));
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn fetch_config(&self, t: &Target, d: &Descriptor) -> Result<Vec<u8>, RegistryError> {
        let url = format!("{}blobs/{}", self.transport.repo_url(t), d.digest);
        let (body, _) = self.get_document(t, &url, None, "config")?;
        let actual = blob::sha256_of(&body);
        if actual != d.digest {
            return Err(RegistryError::DigestMismatch {
                image: t.image.clone(),
                registry: t.registry.clone(),
                what: "config",
                expected: d.digest.clone(),
                actual,
                size: body.len() as u64,
            });
        }
        Ok(body)
    }

    fn not_ok(&self, t: &Target, resp: http::Resp, what: &str) -> RegistryError {
        let (status, mut code, message) = http::error_body(resp);
        if status == StatusCode::NOT_FOUND && code != "NAME_UNKNOWN" && !self.repository_exists(t) {
            // Registry 2.8 says MANIFEST_UNKNOWN for a missing repository too.
            code = "NAME_UNKNOWN".to_string();
        }
        match (status, code.as_str()) {
            (StatusCode::NOT_FOUND, "NAME_UNKNOWN") => RegistryError::NotFound {
                image: t.image.clone(),
                detail: format!(
                    "{} has no repository '{}': check the image name",
                    t.registry, t.repository
                ),
            },
            (StatusCode::NOT_FOUND, _) => RegistryError::NotFound {
                image: t.image.clone(),
                detail: format!(
                    "{} has no {} for {}: check the tag or digest",
                    t.registry,
                    what,
                    t.image
                        .rsplit_once('/')
                        .map_or(t.image.as_str(), |(_, n)| n)
                ),
            },
            (StatusCode::FORBIDDEN, _) => RegistryError::Protocol {
                image: t.image.clone(),
                registry: t.registry.clone(),
                detail: format!(
                    "access to the {what} denied ({code} {message}): check that your login may \
                     read this repository"
                ),
            },
            _ => RegistryError::Protocol {
                image: t.image.clone(),
                registry: t.registry.clone(),
                detail: format!("fetching the {what} answered {status} {code} {message}"),
            },
        }
    }

    /// Whether the repository exists (its tag list is there); `true` when that cannot be told.
    fn repository_exists(&self, t: &Target) -> bool {
        let url = format!("{}tags/list", self.transport.repo_url(t));
        match self.transport.send(t, Method::Get, &url, None, None, None) {
            Ok(resp) => resp.status() != StatusCode::NOT_FOUND,
            Err(_) => true,
        }
    }

    /// Streams every layer the sink lacks into it, `parallel` at once; returns the layer
    /// directories bottom first. On the first failure the other downloads stop; layers already
    /// verified stay published (they are complete and content-addressed).
    fn fetch_layers(
        &self,
        t: &Target,
        layers: &[Descriptor],
        diff_ids: &[String],
        mode: ProgressMode,
        sink: &dyn LayerSink,
    ) -> Result<Vec<PathBuf>, RegistryError> {
        let total: u64 = layers.iter().map(|l| l.size).sum();
        let progress = progress::Progress::new(mode, &t.image, layers.len(), total);
        // The same layer twice in one image (empty layers are common) is fetched once.
        let mut unique: Vec<usize> = Vec::new();
        let mut first_of: HashMap<&str, usize> = HashMap::new();
        let mut done: Vec<Option<PathBuf>> = vec![None; layers.len()];
        for (i, diff_id) in diff_ids.iter().enumerate() {
            if first_of.contains_key(diff_id.as_str()) {
                continue;
            }
            first_of.insert(diff_id, i);
            match sink.existing_layer(diff_id) {
                Some(path) => {
                    progress.skipped(i, &layers[i].digest, layers[i].size);
                    done[i] = Some(path);
                }
                None => unique.push(i),
            }
        }
        let next = AtomicUsize::new(0);
        let abort = AtomicBool::new(false);
        let results: Mutex<Vec<(usize, Result<PathBuf, RegistryError>)>> = Mutex::new(Vec::new());
        let workers = self.parallel.min(unique.len());
        std::thread::scope(|scope| {
            for _ in 0..workers {
                scope.spawn(|| {
                    loop {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&i) = unique.get(k) else { break };
                        if abort.load(Ordering::Relaxed) {
                            break;
                        }
                        let lp = progress.layer(i, &layers[i].digest, layers[i].size);
                        let r = self.fetch_layer(t, &layers[i], &diff_ids[i], sink, &abort, &lp);
                        match &r {
                            Ok(_) => lp.done(),
                            Err(_) => {
                                lp.failed();
                                abort.store(true, Ordering::Relaxed);
                            }
                        }
                        results.lock().expect("results").push((i, r));
                    }
                });
            }
        });
        progress.finish();
        let mut results = results.into_inner().expect("results");
        results.sort_by_key(|(i, _)| *i);
        let mut first_error = None;
        for (i, r) in results {
            match r {
                Ok(path) => done[i] = Some(path),
                Err(RegistryError::Aborted) => {}
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        diff_ids
            .iter()
            .map(|d| {
                done[first_of[d.as_str()]]
                    .clone()
                    .ok_or(RegistryError::Aborted)
            })
            .collect()
    }

    /// Download → sha256 → decompress → sink, in one pass; publish only when the blob's digest
    /// matched too.
    fn fetch_layer(
        &self,
        t: &Target,
        layer: &Descriptor,
        diff_id: &str,
        sink: &dyn LayerSink,
        abort: &AtomicBool,
        lp: &progress::LayerProgress,
    ) -> Result<PathBuf, RegistryError> {
        let on_bytes = |n: u64| lp.inc(n);
        let mut stream = blob::BlobStream::new(
            &self.transport,
            t,
            &layer.digest,
            layer.size,
            abort,
            &on_bytes,
        );
        let staged: Option<Result<Box<dyn StagedLayer>, ImageError>> = {
            let mut buffered = BufReader::with_capacity(1 << 20, &mut stream);
            match buffered.fill_buf() {
                Err(_) => None,
                Ok(head) => {
                    let head = head.get(..4).unwrap_or(head).to_vec();
                    let mut reader = decompressor(&head, buffered);
                    Some(sink.stage_layer(diff_id, &mut reader))
                }
            }
        };
        // A transfer failure explains a sink error (it saw a broken stream): report it first.
        if let Some(e) = stream.failure.take() {
            return Err(e);
        }
        // Read what the extractor left (tar padding, a corrupt tail) so the digest covers the
        // whole blob; a corrupt blob is reported as such even when extraction failed first.
        stream.drain()?;
        let (actual, size) = stream.finish();
        if actual != layer.digest || size != layer.size {
            return Err(RegistryError::DigestMismatch {
                image: t.image.clone(),
                registry: t.registry.clone(),
                what: "layer",
                expected: layer.digest.clone(),
                actual,
                size,
            });
        }
        let layer_error = |source| RegistryError::Layer {
            image: t.image.clone(),
            digest: layer.digest.clone(),
            source,
        };
        match staged {
            Some(Ok(staged)) => staged.publish().map_err(layer_error),
            Some(Err(e)) => Err(layer_error(e)),
            None => Err(RegistryError::Aborted),
        }
    }
}

/// The decompressor for a layer, chosen by its first bytes rather than its media type (some
/// registries and tools mislabel layers; the magic numbers are unambiguous).
fn decompressor<'r, R: BufRead + 'r>(head: &[u8], reader: R) -> Box<dyn Read + 'r> {
    if head.starts_with(&[0x1f, 0x8b]) {
        Box::new(flate2::bufread::MultiGzDecoder::new(reader))
    } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        match zstd::stream::read::Decoder::with_buffer(reader) {
            Ok(d) => Box::new(d),
            Err(e) => Box::new(FailingReader(Some(e))),
        }
    } else {
        Box::new(reader)
    }
}

struct FailingReader(Option<std::io::Error>);

impl Read for FailingReader {
    fn read(&mut self, _: &mut [u8]) -> std::io::Result<usize> {
        Err(self
            .0
            .take()
            .unwrap_or_else(|| std::io::Error::other("decompressor failed")))
    }
}

/// Refuses an image whose config says it is built for another architecture than `want` (the
/// host's, or `--arch`'s when `asked`): a single-platform image of another machine would only
/// fail later with "exec format error". One line naming both architectures.
pub fn check_architecture(
    config: &ImageConfiguration,
    want: &manifest::Wanted,
    asked: bool,
) -> Result<(), String> {
    let have = config.architecture().to_string();
    let normal = manifest::Wanted::parse(&have)
        .map(|w| w.architecture)
        .unwrap_or_else(|_| have.clone());
    if have.is_empty() || normal == want.architecture {
        return Ok(());
    }
    let have = crate::cli::elide(&have);
    Err(if asked {
        format!(
            "the image is built for {have}, not for {} as --arch asks",
            want.architecture
        )
    } else {
        format!(
            "the image is built for {have} and this host is {}; give --arch {have} to use it \
             anyway",
            want.architecture
        )
    })
}

fn target(r: &RegistryRef) -> Target {
    Target {
        registry: r.registry.clone(),
        repository: r.repository.clone(),
        image: r.image_name(),
        user: r.user.clone(),
    }
}

fn manifest_url(transport: &Transport, t: &Target, r: &RegistryRef) -> String {
    let reference = r
        .digest
        .as_deref()
        .or(r.tag.as_deref())
        .unwrap_or(super::reference::DEFAULT_TAG);
    format!("{}manifests/{reference}", transport.repo_url(t))
}

/// Digests from a registry go into URLs and paths: only `sha256:<64 hex>` is accepted.
fn check_digest(t: &Target, digest: &str) -> Result<(), RegistryError> {
    super::reference::check_digest(digest).map_err(|detail| RegistryError::Image {
        image: t.image.clone(),
        detail,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;

    #[test]
    fn decompressor_follows_magic_bytes() {
        let data = b"hello layer".repeat(100);
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&data).unwrap();
        let gz = gz.finish().unwrap();
        let zst = zstd::encode_all(&data[..], 3).unwrap();
        for encoded in [gz, zst, data.clone()] {
            let mut out = Vec::new();
            decompressor(&encoded[..4], &encoded[..])
                .read_to_end(&mut out)
                .unwrap();
            assert_eq!(out, data);
        }
    }

    #[test]
    fn errors_convert_to_one_line() {
        let e: ImageError = RegistryError::NotFound {
            image: "127.0.0.1:5000/a/b:nope".into(),
            detail: "127.0.0.1:5000 has no manifest for b:nope: check the tag or digest".into(),
        }
        .into();
        let text = e.to_string();
        assert!(!text.contains('\n'));
        assert!(text.contains("a/b:nope"), "{text}");
    }
}
