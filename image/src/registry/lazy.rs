//! The registry side of lazily loaded images (`crate::lazy`): the lazy form's manifest, its
//! small blobs, byte ranges of its squashfs blob (`Range: bytes=A-B`), and publishing it (the
//! distribution spec's monolithic upload: POST, then PUT with the digest; then a manifest PUT).
//! Every request goes with the user's credentials, as a pull does, and under an import's
//! deadline and minimum rate (super::limits).
//!
//! Chunks also come from cluster peers (`crate::peers`): `GET /v2/<name>/lazy/<chunk size>/
//! sha256:<index hex>` with `Range: bytes=A-B`, signed with the cluster key, never with the
//! user's login; the peer answers only with chunks its cache of that index holds verified, and
//! the caller verifies them again against its own index.

use std::io::Read;

use ureq::http::StatusCode;

use super::http::{Method, Target};
use super::limits::{Metered, Slow};
use super::{Client, check_digest, manifest_url};
use crate::ImageError;
use crate::RegistryRef;
use crate::registry::RegistryError;

/// Where a lazy image's blobs are read from: the source its manifest came from.
#[derive(Clone, Debug)]
pub struct LazySource {
    target: Target,
}

impl LazySource {
    /// `REGISTRY/REPOSITORY:TAG`, as messages name the image.
    pub fn image(&self) -> &str {
        &self.target.image
    }

    /// The host asked (a registry, a mirror or a cluster peer), for messages.
    pub fn host(&self) -> &str {
        &self.target.registry
    }
}

/// A manifest as the registry sent it.
#[derive(Clone, Debug)]
pub struct RawManifest {
    pub body: Vec<u8>,
    pub content_type: Option<String>,
}

fn protocol(t: &Target, detail: String) -> ImageError {
    ImageError::Registry(RegistryError::Protocol {
        image: t.image.clone(),
        registry: t.registry.clone(),
        detail,
    })
}

impl Client {
    /// The manifest `r` names, fetched with the user's credentials from the first source (mirrors
    /// first) that has it: a user who could not pull `r` gets the pull's error here.
    pub fn lazy_manifest(
        &self,
        r: &RegistryRef,
        accept: &str,
    ) -> Result<(LazySource, RawManifest), ImageError> {
        let mut last = None;
        for t in self.sources(r) {
            let url = manifest_url(&self.transport, &t, r);
            let answer = self
                .transport
                .send(&t, Method::Get, &url, Some(accept), None, None)
                .and_then(|resp| match resp.status() {
                    s if s.is_success() => {
                        let content_type = resp
                            .headers()
                            .get("content-type")
                            .and_then(|v| v.to_str().ok())
                            .map(str::to_string);
                        let body = self.transport.read_document(&t, resp)?;
                        Ok(RawManifest { body, content_type })
                    }
                    StatusCode::NOT_FOUND => Err(ImageError::Registry(RegistryError::NotFound {
                        image: t.image.clone(),
                        detail: format!("{} has no such manifest", t.registry),
                    })),
                    s => Err(protocol(&t, format!("manifest GET answered {s}"))),
                });
            match answer {
                Ok(m) => return Ok((LazySource { target: t }, m)),
                Err(e) if Self::is_final(&e) => return Err(e),
                Err(e) => last = Some(Self::last_error(&t, e)),
            }
        }
        Err(last.unwrap_or_else(|| {
            ImageError::Registry(RegistryError::NotFound {
                image: r.image_name(),
                detail: "no source to ask".into(),
            })
        }))
    }

    /// Gives each later request `registry.lazy_read_deadline_s` from when it is sent, rather
    /// than what is left of the import's deadline: a lazy image's chunks are fetched for as long
    /// as its container runs, and a reader waits on each one (a stall becomes EIO in that time).
    pub fn deadline_per_request(&self) {
        self.transport.limits.per_request();
    }

    /// Bytes `start..start + len` of the blob `digest`: a `Range` GET. A registry that ignores
    /// `Range` (200) is read up to the range and the rest of its answer dropped.
    pub fn lazy_range(
        &self,
        src: &LazySource,
        digest: &str,
        start: u64,
        len: u64,
    ) -> Result<Vec<u8>, ImageError> {
        check_digest(&src.target, digest)?;
        let url = format!("{}blobs/{digest}", self.transport.repo_url(&src.target));
        self.range_get(&src.target, &url, digest, start, len)
    }

    /// The cluster peers `hosts` as sources of `r`'s lazy chunks: plain HTTP, each request
    /// signed with `key`.
    pub fn lazy_peers(
        &self,
        r: &RegistryRef,
        hosts: &[String],
        key: &berth_api::auth::Key,
    ) -> Vec<LazySource> {
        let origin = super::target(r);
        hosts
            .iter()
            .map(|host| {
                self.transport.add_peer(host, key);
                LazySource {
                    target: super::http::Target {
                        registry: host.clone(),
                        repository: origin.repository.clone(),
                        image: origin.image.clone(),
                        user: None,
                        mirror_of: Some(format!("{} (cluster peer)", r.registry)),
                    },
                }
            })
            .collect()
    }

    /// Bytes `start..start + len` of the lazy image whose index blob is `index_digest`
    /// (`chunk_size`-byte chunks, `start` and the end on chunk bounds or the end) from the peer
    /// `peer` (a source of [`Client::lazy_peers`]). Not verified here: the caller checks each
    /// chunk against its index.
    pub fn lazy_peer_range(
        &self,
        peer: &LazySource,
        index_digest: &str,
        chunk_size: u64,
        start: u64,
        len: u64,
    ) -> Result<Vec<u8>, ImageError> {
        check_digest(&peer.target, index_digest)?;
        let url = format!(
            "{}lazy/{chunk_size}/{index_digest}",
            self.transport.repo_url(&peer.target)
        );
        self.range_get(&peer.target, &url, index_digest, start, len)
    }

    /// A `Range` GET of `url` (bytes `start..start + len` of `digest`). A source that ignores
    /// `Range` (200) is read up to the range and the rest of its answer dropped.
    fn range_get(
        &self,
        t: &Target,
        url: &str,
        digest: &str,
        start: u64,
        len: u64,
    ) -> Result<Vec<u8>, ImageError> {
        if len == 0 {
            return Ok(Vec::new());
        }
        let range = format!("bytes={start}-{}", start + len - 1);
        let resp = self
            .transport
            .send_range(t, Method::Get, url, None, Some(&range), None)?;
        let skip = match resp.status() {
            StatusCode::PARTIAL_CONTENT => 0,
            StatusCode::OK => start,
            StatusCode::NOT_FOUND => {
                return Err(ImageError::Registry(RegistryError::BlobMissing {
                    image: t.image.clone(),
                    registry: t.registry.clone(),
                    digest: digest.to_string(),
                }));
            }
            s => {
                return Err(protocol(
                    t,
                    format!("blob range GET ({range}) answered {s}"),
                ));
            }
        };
        let mut body = Metered::new(
            resp.into_body().into_reader(),
            self.transport.limits.meter(),
        );
        let io = |e: std::io::Error, slow: Option<Slow>| match slow {
            Some(slow) => slow.error(
                &t.registry,
                &format!("blob {digest} ({range}) of {}", t.image),
            ),
            None => ImageError::Registry(RegistryError::Unreachable {
                registry: t.registry.clone(),
                image: t.image.clone(),
                attempts: 1,
                detail: format!("reading {digest} ({range}): {e}"),
            }),
        };
        if skip > 0 {
            std::io::copy(&mut body.by_ref().take(skip), &mut std::io::sink())
                .map_err(|e| io(e, body.slow))?;
        }
        let mut out = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
        if let Err(e) = body.by_ref().take(len).read_to_end(&mut out) {
            return Err(io(e, body.slow));
        }
        if out.len() as u64 != len {
            return Err(protocol(
                t,
                format!("blob {digest} ({range}) ended after {} bytes", out.len()),
            ));
        }
        Ok(out)
    }

    /// Uploads `size` bytes of `body` as the blob `digest` of `r`'s repository, unless the
    /// registry has it already. Returns whether it was sent.
    pub fn lazy_push_blob(
        &self,
        r: &RegistryRef,
        digest: &str,
        size: u64,
        body: &mut dyn Read,
    ) -> Result<bool, ImageError> {
        let t = super::target(r);
        check_digest(&t, digest)?;
        let repo = self.transport.repo_url(&t);
        let head = self.transport.send(
            &t,
            Method::Head,
            &format!("{repo}blobs/{digest}"),
            None,
            None,
            None,
        )?;
        if head.status().is_success() {
            return Ok(false);
        }
        let (location, auth) = self.start_upload(&t, &format!("{repo}blobs/uploads/"))?;
        let sep = if location.contains('?') { '&' } else { '?' };
        let url = format!("{location}{sep}digest={digest}");
        let mut req = self
            .transport
            .agent()
            .put(&url)
            .header("Content-Type", "application/octet-stream")
            .header("Content-Length", size.to_string());
        if let Some(a) = &auth {
            req = req.header("Authorization", a);
        }
        let resp = req
            .send(ureq::SendBody::from_reader(body))
            .map_err(|e| self.transport.transport_error(&t, e))?;
        if resp.status() != StatusCode::CREATED {
            let (status, code, message) = super::http::error_body(resp);
            return Err(protocol(
                &t,
                format!("uploading {digest} answered {status} {code} {message}"),
            ));
        }
        Ok(true)
    }

    /// POSTs an upload session; returns its absolute URL and the `Authorization` it needed.
    fn start_upload(&self, t: &Target, url: &str) -> Result<(String, Option<String>), ImageError> {
        let mut auth: Option<String> = None;
        for _ in 0..2 {
            let mut req = self.transport.agent().post(url);
            if let Some(a) = &auth {
                req = req.header("Authorization", a);
            }
            let resp = req
                .send_empty()
                .map_err(|e| self.transport.transport_error(t, e))?;
            match resp.status() {
                StatusCode::UNAUTHORIZED if auth.is_none() => {
                    auth = Some(self.transport.answer_challenge(t, &resp)?);
                }
                StatusCode::ACCEPTED => {
                    let location = resp
                        .headers()
                        .get("location")
                        .and_then(|v| v.to_str().ok())
                        .ok_or_else(|| protocol(t, "an upload without a Location".into()))?;
                    let location = if location.starts_with('/') {
                        let base = url.split("/v2/").next().unwrap_or_default();
                        format!("{base}{location}")
                    } else {
                        location.to_string()
                    };
                    return Ok((location, auth));
                }
                _ => {
                    let (status, code, message) = super::http::error_body(resp);
                    return Err(protocol(
                        t,
                        format!("starting an upload answered {status} {code} {message}"),
                    ));
                }
            }
        }
        Err(protocol(
            t,
            "the registry refused the login for an upload (push needs write access)".into(),
        ))
    }

    /// PUTs `body` as the manifest `tag` of `r`'s repository; returns the digest it has there.
    pub fn lazy_push_manifest(
        &self,
        r: &RegistryRef,
        tag: &str,
        media_type: &str,
        body: &[u8],
    ) -> Result<String, ImageError> {
        let t = super::target(r);
        let url = format!("{}manifests/{tag}", self.transport.repo_url(&t));
        let mut auth: Option<String> = None;
        for _ in 0..2 {
            let mut req = self
                .transport
                .agent()
                .put(&url)
                .header("Content-Type", media_type);
            if let Some(a) = &auth {
                req = req.header("Authorization", a);
            }
            let resp = req
                .send(body)
                .map_err(|e| self.transport.transport_error(&t, e))?;
            match resp.status() {
                StatusCode::UNAUTHORIZED if auth.is_none() => {
                    auth = Some(self.transport.answer_challenge(&t, &resp)?);
                }
                StatusCode::CREATED => return Ok(super::blob::sha256_of(body)),
                _ => {
                    let (status, code, message) = super::http::error_body(resp);
                    return Err(protocol(
                        &t,
                        format!("the manifest PUT answered {status} {code} {message}"),
                    ));
                }
            }
        }
        Err(protocol(
            &t,
            "the registry refused the login for a manifest PUT (push needs write access)".into(),
        ))
    }
}
