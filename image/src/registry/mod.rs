//! The OCI distribution (registry v2) client: resolves a reference to one platform's manifest,
//! fetches and verifies its config, and streams every layer into a [`LayerSink`] — download,
//! sha256 of the compressed blob, decompression (gzip, zstd or none) and extraction in one pass,
//! several layers at once. A layer is published only when both its blob digest (checked here)
//! and its diff_id (checked by the sink) match.
//!
//! Blocking I/O on std threads (ureq with rustls): a pull is a handful of long transfers, and
//! keeping an async runtime out of berth keeps it out of code that later forks into namespaces.
//!
//! Mirrors (`registry.mirrors`): an image of a registry with mirrors is looked up on each mirror
//! in order, then on the registry itself unless `fallback = false`. Whatever fails on a source
//! (unreachable, no such image, a login refused, a blob whose sha256 is not the digest the
//! manifest names) is said in one warning line naming the mirror, and the next source is tried;
//! layers fetch from the source the manifest came from, falling back the same way.

pub mod auth;
mod blob;
mod error;
mod http;
mod layers;
pub mod lazy;
mod limits;
pub mod manifest;
mod peer;
mod pipeline;
mod progress;

pub use error::RegistryError;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use oci_spec::image::ImageConfiguration;
use ureq::http::StatusCode;

pub use self::auth::{Credentials, Login, UserEnv};
use self::http::{Method, Target, Transport};
use self::manifest::{Descriptor, Manifest, Wanted};
pub use self::progress::ProgressMode;
use super::{ImageError, LayerSink, RegistryRef};
use crate::config::{MirrorConfig, RegistryConfig};
use berth_spec::UserIds;

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
    /// The sources left to fetch layers from if `target` fails (mirrors, then the origin).
    fallbacks: Vec<Target>,
    /// Cluster peers asked for the blobs before `target` (super::peers).
    peers: Vec<Target>,
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
#[derive(Debug)]
pub struct Client {
    transport: Transport,
    parallel: usize,
    /// `registry.mirrors`, keyed by the registry's canonical name ([`mirror_key`]).
    mirrors: BTreeMap<String, Mirrors>,
    /// Where verified blobs are kept for peers, when this process keeps them.
    keep: Option<super::peers::BlobCache>,
}

/// The mirrors of one registry, parsed.
#[derive(Clone, Debug)]
struct Mirrors {
    /// `(HOST[:PORT], PREFIX)`, in order.
    hosts: Vec<(String, String)>,
    fallback: bool,
}

impl Client {
    /// A client for the user running berth, with this process's environment
    /// (`$ENROOT_CONFIG_PATH`, `$REGISTRY_AUTH_FILE`, …). `user_home` is the home of that user:
    /// `~` in `registry.credentials` and the default login files resolve there.
    pub fn new(config: &RegistryConfig, user_home: Option<&Path>) -> Result<Self, ImageError> {
        let user = current_user(user_home)?;
        Self::for_user(config, &user, &UserEnv::of_this_process())
    }

    /// [`Client::new`] with the user's `$ENROOT_CONFIG_PATH` given explicitly and none of the
    /// other variables taken from this process's environment.
    pub fn with_enroot_config(
        config: &RegistryConfig,
        user_home: Option<&Path>,
        enroot_config_path: Option<&Path>,
    ) -> Result<Self, ImageError> {
        let user = current_user(user_home)?;
        let env = UserEnv {
            enroot_config_path: enroot_config_path.map(Path::to_path_buf),
            ..UserEnv::default()
        };
        Self::for_user(config, &user, &env)
    }

    /// A client for the user `uid` (whose home is `home`): berth's own environment when that is
    /// the user running berth, the default file locations for anyone else (berth acting as root
    /// for a job's user must not take that user's paths from its own environment).
    pub fn for_uid(
        config: &RegistryConfig,
        uid: u32,
        home: Option<&Path>,
    ) -> Result<Self, ImageError> {
        if uid == nix::unistd::getuid().as_raw() {
            return Self::new(config, home);
        }
        let pw = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
            .ok()
            .flatten();
        let mut user = match &pw {
            Some(pw) => berth_sys::user::by_id(uid, pw.gid.as_raw()),
            // No passwd entry: the uid alone, in no group that could open anything.
            None => UserIds {
                uid,
                gid: 65534,
                ..UserIds::default()
            },
        };
        user.home = home.map(Path::to_path_buf);
        Self::for_user(config, &user, &UserEnv::default())
    }

    /// A client for `user`, whose login files are read as that user (never as root: see
    /// [`auth`]), found where `env` says.
    pub fn for_user(
        config: &RegistryConfig,
        user: &UserIds,
        env: &UserEnv,
    ) -> Result<Self, ImageError> {
        let files = auth::credential_files(
            &config.credentials,
            config.enroot_credentials,
            config.auth_files,
            env,
            user.uid,
            user.home.as_deref(),
        );
        let credentials = Credentials::load(files, user)?;
        let mirrors = parse_mirrors(&config.mirrors)?;
        Ok(Self {
            transport: Transport::new(config, credentials)?,
            parallel: config.parallel_downloads.max(1),
            mirrors,
            keep: super::peers::cache(),
        })
    }

    /// Where to get `r` from, in order: its registry's mirrors, then the registry itself unless
    /// `fallback = false`.
    fn sources(&self, r: &RegistryRef) -> Vec<Target> {
        let origin = target(r);
        let Some(m) = self.mirrors.get(&mirror_key(&r.registry)) else {
            return vec![origin];
        };
        let mut out: Vec<Target> = m
            .hosts
            .iter()
            .map(|(host, prefix)| Target {
                registry: host.clone(),
                repository: if prefix.is_empty() {
                    r.repository.clone()
                } else {
                    format!("{prefix}/{}", r.repository)
                },
                image: origin.image.clone(),
                // `USER@` names an account of the registry, not of its mirrors.
                user: None,
                mirror_of: Some(r.registry.clone()),
            })
            .collect();
        if m.fallback {
            out.push(origin);
        }
        out
    }

    /// The error to report when `t`, the last source, failed with `e`.
    fn last_error(t: &Target, e: ImageError) -> ImageError {
        match &t.mirror_of {
            Some(origin) => ImageError::Registry(RegistryError::Mirror {
                mirror: t.registry.clone(),
                origin: origin.clone(),
                source: Box::new(e),
            }),
            None => e,
        }
    }

    /// Whether a failure ends the pull rather than sending it to the next source.
    fn is_final(e: &ImageError) -> bool {
        matches!(
            e,
            ImageError::Registry(RegistryError::RegistryConfig { .. })
                | ImageError::Registry(RegistryError::Aborted)
                | ImageError::Registry(RegistryError::PullLayer { .. })
                // The deadline is the import's: no other source has time left either.
                | ImageError::Registry(RegistryError::DeadlinePassed { .. })
        )
    }

    /// Whether the user may read the image: a manifest HEAD with the user's credentials. For
    /// deciding whether a cached private image may be handed to this user.
    /// With mirrors, any source that lets the user read the image decides (the user could pull
    /// it from there).
    pub fn check_access(&self, r: &RegistryRef) -> Result<bool, ImageError> {
        let sources = self.sources(r);
        let mut outcome = None;
        for t in sources {
            match self.check_access_at(t, r) {
                Ok(true) => return Ok(true),
                Ok(false) => outcome = Some(Ok(false)),
                Err(e) => {
                    if outcome.is_none() {
                        outcome = Some(Err(e));
                    }
                }
            }
        }
        outcome.unwrap_or(Ok(false))
    }

    fn check_access_at(&self, t: Target, r: &RegistryRef) -> Result<bool, ImageError> {
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
            Ok(resp) => Err(ImageError::Registry(RegistryError::Protocol {
                image: t.image,
                registry: t.registry,
                detail: format!("manifest HEAD answered {}", resp.status()),
            })),
            Err(
                ImageError::Registry(RegistryError::CredentialsRequired { .. })
                | ImageError::Registry(RegistryError::LoginRejected { .. })
                | ImageError::Registry(RegistryError::NoSuchLogin { .. }),
            ) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Fetches and checks the manifest (choosing the platform from an index) and the config of
    /// `r`, without downloading layers: the manifest digest says whether the store has the image.
    /// With mirrors, the first source that has it (see the module header).
    pub fn resolve(&self, r: &RegistryRef, options: &PullOptions) -> Result<Resolved, ImageError> {
        let sources = self.sources(r);
        let peers = self.peer_targets(r);
        let mut i = 0;
        loop {
            let t = sources[i].clone();
            match self.resolve_at(t.clone(), r, options, &peers) {
                Ok(mut resolved) => {
                    resolved.fallbacks = sources[i + 1..].to_vec();
                    resolved.peers = peers;
                    return Ok(resolved);
                }
                Err(e) if Self::is_final(&e) => return Err(e),
                Err(e) if i + 1 < sources.len() => {
                    warn_source_failed(&t, &sources[i + 1], &e);
                    i += 1;
                }
                Err(e) => return Err(Self::last_error(&t, e)),
            }
        }
    }

    fn resolve_at(
        &self,
        t: Target,
        r: &RegistryRef,
        options: &PullOptions,
        peers: &[Target],
    ) -> Result<Resolved, ImageError> {
        let want = match &options.arch {
            Some(a) => Wanted::parse(a).map_err(|e| self.image_error(&t, e.to_string()))?,
            None => Wanted::host(),
        };
        let url = manifest_url(&self.transport, &t, r);
        let (body, digest, content_type) = self.fetch_manifest(&t, &url, r.digest.as_deref())?;
        let parsed = manifest::parse(&body, content_type.as_deref())
            .map_err(|e| self.image_error(&t, e.to_string()))?;
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
                    .map_err(|e| self.image_error(&t, e.to_string()))?
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
        let config_bytes = self.fetch_config_peers_first(peers, &t, &config_desc)?;
        let config: ImageConfiguration = serde_json::from_slice(&config_bytes).map_err(|e| {
            self.image_error(
                &t,
                format!("image config {} is invalid: {e}", config_desc.digest),
            )
        })?;
        check_architecture(&config, &want, options.arch.is_some())
            .map_err(|e| self.image_error(&t, e.to_string()))?;
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
            fallbacks: Vec::new(),
            peers: Vec::new(),
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
    ) -> Result<Pulled, ImageError> {
        let r = resolved;
        // Peers first: each blob is verified whoever serves it.
        let mut sources = r.peers.clone();
        sources.push(r.target.clone());
        sources.extend(r.fallbacks.iter().cloned());
        let mut rest = sources.iter();
        let mut target = rest.next().expect("the registry is a source").clone();
        let paths = loop {
            match self.fetch_layers(&target, &r.layers, &r.diff_ids, options.progress, sink) {
                Ok(paths) => break paths,
                Err(e) if Self::is_final(&e) => return Err(e),
                Err(e) => match rest.next() {
                    // Layers already verified stay in the store: the next source is asked only
                    // for the rest, by the same digests.
                    Some(next) => {
                        warn_source_failed(&target, next, &e);
                        target = next.clone();
                    }
                    None => return Err(Self::last_error(&target, e)),
                },
            }
        };
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
    ) -> Result<Pulled, ImageError> {
        let resolved = self.resolve(r, options)?;
        self.fetch(resolved, options, sink)
    }

    fn image_error(&self, t: &Target, detail: String) -> ImageError {
        ImageError::Registry(RegistryError::Pull {
            image: t.image.clone(),
            detail,
        })
    }

    /// GETs a manifest; returns its body, digest and Content-Type. With `pinned` the body must
    /// hash to it.
    fn fetch_manifest(
        &self,
        t: &Target,
        url: &str,
        pinned: Option<&str>,
    ) -> Result<(Vec<u8>, String, Option<String>), ImageError> {
        let (body, content_type) = self.get_document(t, url, Some(manifest::ACCEPT), "manifest")?;
        let digest = blob::sha256_of(&body);
        if let Some(p) = pinned
            && p != digest
        {
            return Err(ImageError::Registry(RegistryError::DigestMismatch {
                image: t.image.clone(),
                registry: t.registry.clone(),
                what: "manifest",
                expected: p.to_string(),
                actual: digest,
                size: body.len() as u64,
            }));
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
    ) -> Result<(Vec<u8>, Option<String>), ImageError> {
        let mut attempt = 0u32;
        loop {
            let resp = self
                .transport
                .send(t, Method::Get, url, accept, None, None)?;
            if what == "config" && resp.status() == StatusCode::NOT_FOUND {
                return Err(ImageError::Registry(RegistryError::BlobMissing {
                    image: t.image.clone(),
                    registry: t.registry.clone(),
                    digest: url.rsplit('/').next().unwrap_or_default().to_string(),
                }));
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
                Err(ImageError::Registry(RegistryError::Unreachable { detail, .. })) => {
                    attempt += 1;
                    if attempt >= self.transport.retries {
                        return Err(ImageError::Registry(RegistryError::Unreachable {
                            image: t.image.clone(),
                            registry: t.registry.clone(),
                            attempts: attempt,
                            detail: format!("reading the {what}: {detail}"),
                        }));
                    }
                    tracing::debug!(%url, attempt, %detail, "retrying a dropped {what}");
                    std::thread::sleep(self.transport.backoff(attempt));
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn fetch_config(&self, t: &Target, d: &Descriptor) -> Result<Vec<u8>, ImageError> {
        let url = format!("{}blobs/{}", self.transport.repo_url(t), d.digest);
        let (body, _) = self.get_document(t, &url, None, "config")?;
        let actual = blob::sha256_of(&body);
        if actual != d.digest {
            return Err(ImageError::Registry(RegistryError::DigestMismatch {
                image: t.image.clone(),
                registry: t.registry.clone(),
                what: "config",
                expected: d.digest.clone(),
                actual,
                size: body.len() as u64,
            }));
        }
        Ok(body)
    }

    fn not_ok(&self, t: &Target, resp: http::Resp, what: &str) -> ImageError {
        let (status, mut code, message) = http::error_body(resp);
        if status == StatusCode::NOT_FOUND && code != "NAME_UNKNOWN" && !self.repository_exists(t) {
            // Registry 2.8 says MANIFEST_UNKNOWN for a missing repository too.
            code = "NAME_UNKNOWN".to_string();
        }
        match (status, code.as_str()) {
            (StatusCode::NOT_FOUND, "NAME_UNKNOWN") => {
                ImageError::Registry(RegistryError::NotFound {
                    image: t.image.clone(),
                    detail: format!(
                        "{} has no repository '{}': check the image name",
                        t.registry, t.repository
                    ),
                })
            }
            (StatusCode::NOT_FOUND, _) => ImageError::Registry(RegistryError::NotFound {
                image: t.image.clone(),
                detail: format!(
                    "{} has no {} for {}: check the tag or digest",
                    t.registry,
                    what,
                    t.image
                        .rsplit_once('/')
                        .map_or(t.image.as_str(), |(_, n)| n)
                ),
            }),
            (StatusCode::FORBIDDEN, _) => ImageError::Registry(RegistryError::Protocol {
                image: t.image.clone(),
                registry: t.registry.clone(),
                detail: format!(
                    "access to the {what} denied ({code} {message}): check that your login may \
                     read this repository"
                ),
            }),
            _ => ImageError::Registry(RegistryError::Protocol {
                image: t.image.clone(),
                registry: t.registry.clone(),
                detail: format!("fetching the {what} answered {status} {code} {message}"),
            }),
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
}

/// Refuses an image whose config says it is built for another architecture than `want` (the
/// host's, or `--arch`'s when `asked`): a single-platform image of another machine would only
/// fail later with "exec format error". One line naming both architectures.
pub fn check_architecture(
    config: &ImageConfiguration,
    want: &manifest::Wanted,
    asked: bool,
) -> Result<(), ImageError> {
    let have = config.architecture().to_string();
    let normal = manifest::Wanted::parse(&have)
        .map(|w| w.architecture)
        .unwrap_or_else(|_| have.clone());
    if have.is_empty() || normal == want.architecture {
        return Ok(());
    }
    let have = berth_sys::text::elide(&have);
    Err(ImageError::Detail(if asked {
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
    }))
}

fn target(r: &RegistryRef) -> Target {
    Target {
        registry: r.registry.clone(),
        repository: r.repository.clone(),
        image: r.image_name(),
        user: r.user.clone(),
        mirror_of: None,
    }
}

/// The user running berth, with `home` as its home.
fn current_user(home: Option<&Path>) -> Result<UserIds, ImageError> {
    let mut user = berth_sys::user::current().map_err(|e| RegistryError::RegistryConfig {
        detail: format!("who is pulling: {e}"),
    })?;
    user.home = home.map(Path::to_path_buf);
    Ok(user)
}

/// One warning line: a source failed and the next is tried.
fn warn_source_failed(failed: &Target, next: &Target, e: &ImageError) {
    let what = match &failed.mirror_of {
        Some(origin) => format!("registry mirror {} of {origin}", failed.registry),
        None => failed.registry.clone(),
    };
    let next = match &next.mirror_of {
        Some(_) => format!("mirror {}", next.registry),
        None => format!("{} itself", next.registry),
    };
    tracing::warn!("{what} failed, trying {next}: {e}");
}

/// The name a registry is known by in `registry.mirrors`: lower case, Docker Hub as `docker.io`
/// whichever of its names a reference used.
fn mirror_key(registry: &str) -> String {
    let r = registry.to_ascii_lowercase();
    if auth::is_docker_hub(&r) || r == "registry.hub.docker.com" {
        "docker.io".to_string()
    } else {
        r
    }
}

/// Checks and splits `registry.mirrors`: each mirror is `HOST[:PORT][/PREFIX]`.
fn parse_mirrors(
    config: &BTreeMap<String, MirrorConfig>,
) -> Result<BTreeMap<String, Mirrors>, ImageError> {
    let mut out = BTreeMap::new();
    for (registry, m) in config {
        let bad = |what: &str, detail: &str| {
            ImageError::Registry(RegistryError::RegistryConfig {
                detail: format!(
                    "registry.mirrors.\"{}\": {what} {detail}",
                    berth_sys::text::elide(registry)
                ),
            })
        };
        if registry.is_empty() || registry.contains(['/', ' ']) {
            return Err(bad(
                "",
                "is not a registry name: write HOST[:PORT], e.g. \"docker.io\"",
            ));
        }
        let mut hosts = Vec::new();
        for mirror in &m.mirrors {
            if mirror.contains("://") {
                return Err(bad(
                    &format!("mirror '{}'", berth_sys::text::elide(mirror)),
                    "has a scheme: write HOST[:PORT][/PREFIX] (HTTPS; list the host in \
                     registry.insecure for plain HTTP)",
                ));
            }
            let (host, prefix) = mirror.split_once('/').unwrap_or((mirror, ""));
            let prefix = prefix.trim_matches('/');
            let plain = |c: char| c.is_ascii_alphanumeric() || "-._:[]".contains(c);
            let prefix_ok = prefix
                .split('/')
                .all(|p| p.is_empty() || p.chars().all(|c| plain(c) && c != ':'))
                && !prefix.split('/').any(|p| p == ".." || p == ".");
            if host.is_empty() || !host.chars().all(plain) || !prefix_ok {
                return Err(bad(
                    &format!("mirror '{}'", berth_sys::text::elide(mirror)),
                    "is not HOST[:PORT][/PREFIX]",
                ));
            }
            hosts.push((host.to_ascii_lowercase(), prefix.to_string()));
        }
        if hosts.is_empty() && !m.fallback {
            return Err(bad(
                "",
                "has no mirrors and fallback = false: no image of it could be pulled",
            ));
        }
        out.insert(
            mirror_key(registry),
            Mirrors {
                hosts,
                fallback: m.fallback,
            },
        );
    }
    Ok(out)
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
fn check_digest(t: &Target, digest: &str) -> Result<(), ImageError> {
    super::reference::check_digest(digest).map_err(|e| {
        ImageError::Registry(RegistryError::Pull {
            image: t.image.clone(),
            detail: e.to_string(),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::layers::decompressor;
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
    fn mirrors_come_first_with_their_prefix_then_the_registry_unless_told_not_to() {
        let mut config = RegistryConfig {
            credentials: String::new(),
            enroot_credentials: false,
            auth_files: false,
            ..RegistryConfig::default()
        };
        config.mirrors.insert(
            "docker.io".into(),
            MirrorConfig {
                mirrors: vec!["Mirror.example/dockerhub/".into(), "10.0.0.5:5000".into()],
                fallback: true,
            },
        );
        config.mirrors.insert(
            "ghcr.io".into(),
            MirrorConfig {
                mirrors: vec!["cache.example".into()],
                fallback: false,
            },
        );
        let client = Client::new(&config, None).unwrap();
        let reference = |text: &str| match super::super::reference::parse(text).unwrap() {
            super::super::Reference::Registry(r) => r,
            other => panic!("{other:?}"),
        };
        let show = |ts: Vec<Target>| -> Vec<String> {
            ts.iter()
                .map(|t| format!("{} {} {:?}", t.registry, t.repository, t.mirror_of))
                .collect()
        };
        assert_eq!(
            show(client.sources(&reference("docker.io/ubuntu:24.04"))),
            [
                "mirror.example dockerhub/library/ubuntu Some(\"registry-1.docker.io\")",
                "10.0.0.5:5000 library/ubuntu Some(\"registry-1.docker.io\")",
                "registry-1.docker.io library/ubuntu None",
            ]
        );
        assert_eq!(
            show(client.sources(&reference("ghcr.io#org/app:1"))),
            ["cache.example org/app Some(\"ghcr.io\")"]
        );
        assert_eq!(
            show(client.sources(&reference("quay.io#org/app:1"))),
            ["quay.io org/app None"]
        );
        let bad = |mirror: &str, fallback: bool| {
            let mut c = config.clone();
            c.mirrors.insert(
                "x.io".into(),
                MirrorConfig {
                    mirrors: vec![mirror.into()],
                    fallback,
                },
            );
            match Client::new(&c, None) {
                Ok(_) => String::new(),
                Err(e) => e.to_string(),
            }
        };
        assert!(bad("https://m.example", true).contains("has a scheme"));
        assert!(bad("m.example/../x", true).contains("not HOST"));
        assert!(bad("m example", true).contains("not HOST"));
        assert_eq!(bad("m.example:5000/a/b", false), "");
        let mut none = config.clone();
        none.mirrors.insert(
            "y.io".into(),
            MirrorConfig {
                mirrors: vec![],
                fallback: false,
            },
        );
        let err = Client::new(&none, None).err().unwrap().to_string();
        assert!(err.contains("no mirrors and fallback = false"), "{err}");
    }

    #[test]
    fn a_mirror_error_names_the_mirror_in_one_line() {
        let e = Client::last_error(
            &Target {
                registry: "127.0.0.1:1".into(),
                repository: "a/b".into(),
                image: "o.example/a/b:1".into(),
                user: None,
                mirror_of: Some("o.example".into()),
            },
            ImageError::Registry(RegistryError::Unreachable {
                image: "o.example/a/b:1".into(),
                registry: "127.0.0.1:1".into(),
                attempts: 2,
                detail: "connection refused".into(),
            }),
        )
        .to_string();
        assert!(!e.contains('\n'), "{e}");
        assert!(
            e.contains("registry mirror 127.0.0.1:1 of o.example"),
            "{e}"
        );
        assert!(e.contains("fallback = false"), "{e}");
    }

    #[test]
    fn errors_convert_to_one_line() {
        let e: ImageError = ImageError::Registry(RegistryError::NotFound {
            image: "127.0.0.1:5000/a/b:nope".into(),
            detail: "127.0.0.1:5000 has no manifest for b:nope: check the tag or digest".into(),
        });
        let text = e.to_string();
        assert!(!text.contains('\n'));
        assert!(text.contains("a/b:nope"), "{text}");
    }
}
