//! One blob download as a byte stream that survives dropped connections.
//!
//! How a dropped layer download resumes (the decision the import's correctness rests on): the
//! decompressor and the store's extractor consume one continuous stream of the blob's bytes, so
//! the interruption must be invisible to them. [`BlobStream`] counts the bytes it has delivered;
//! when a read fails it reopens the blob with `Range: bytes=N-` and carries on from byte N
//! (a server that ignores Range sends the whole blob again and the first N bytes are skipped).
//! The sha256 runs over the delivered bytes in order, so a server that sends different bytes on
//! resume is caught by the final digest check, and the layer is then never published. No temp
//! file and no re-extraction are needed.

use std::io::{self, Read};
use std::sync::atomic::{AtomicBool, Ordering};

use sha2::{Digest as _, Sha256};
use ureq::http::StatusCode;

use super::ImageError;
use super::http::{self, Method, Target, Transport};
use crate::registry::RegistryError;

pub struct BlobStream<'a> {
    transport: &'a Transport,
    target: &'a Target,
    digest: &'a str,
    url: String,
    size: u64,
    /// Bytes delivered to the reader so far (and hashed).
    offset: u64,
    body: Option<ureq::BodyReader<'static>>,
    hasher: Sha256,
    /// Consecutive failed reads without progress.
    failures: u32,
    abort: &'a AtomicBool,
    on_bytes: &'a (dyn Fn(u64) + Sync),
    /// Why the stream failed: the reader above only sees an io::Error, the caller reports this.
    pub failure: Option<ImageError>,
    /// Where the delivered bytes are also written, to keep the blob for peers once verified.
    pub tee: Option<crate::peers::Keeper>,
    /// The minimum rate (super::limits), over the whole blob, resumes included: the time spent
    /// reopening it counts as waiting.
    meter: super::limits::Meter,
}

impl<'a> BlobStream<'a> {
    pub fn new(
        transport: &'a Transport,
        target: &'a Target,
        digest: &'a str,
        size: u64,
        abort: &'a AtomicBool,
        on_bytes: &'a (dyn Fn(u64) + Sync),
    ) -> Self {
        Self {
            url: format!("{}blobs/{digest}", transport.repo_url(target)),
            transport,
            target,
            digest,
            size,
            offset: 0,
            body: None,
            hasher: Sha256::new(),
            failures: 0,
            abort,
            on_bytes,
            failure: None,
            tee: None,
            meter: transport.limits.meter(),
        }
    }

    /// `sha256:<hex>` of the bytes delivered, and how many there were.
    pub fn finish(self) -> (String, u64) {
        (
            format!("sha256:{}", hex(&self.hasher.finalize())),
            self.offset,
        )
    }

    /// Why a read of this stream failed with `e`: the failure it recorded, else `e` itself.
    pub fn failure_of(&mut self, e: &io::Error) -> ImageError {
        self.failure.take().unwrap_or_else(|| {
            ImageError::Registry(RegistryError::Unreachable {
                registry: self.target.registry.clone(),
                image: self.target.image.clone(),
                attempts: 1,
                detail: e.to_string(),
            })
        })
    }

    /// Opens the blob at the current offset.
    fn open(&mut self) -> Result<ureq::BodyReader<'static>, ImageError> {
        let resp = self.transport.send(
            self.target,
            Method::Get,
            &self.url,
            None,
            Some(self.offset),
            Some(self.abort),
        )?;
        let status = resp.status();
        let mut skip = 0;
        if status == StatusCode::PARTIAL_CONTENT {
            let range = resp
                .headers()
                .get("content-range")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string();
            let expected = format!("bytes {}-", self.offset);
            if !range.starts_with(&expected) {
                return Err(ImageError::Registry(RegistryError::Protocol {
                    image: self.target.image.clone(),
                    registry: self.target.registry.clone(),
                    detail: format!(
                        "asked for blob {} from byte {}, got range '{range}'",
                        self.digest, self.offset
                    ),
                }));
            }
        } else if status == StatusCode::OK {
            skip = self.offset;
        } else if status == StatusCode::NOT_FOUND {
            return Err(ImageError::Registry(RegistryError::BlobMissing {
                image: self.target.image.clone(),
                registry: self.target.registry.clone(),
                digest: self.digest.to_string(),
            }));
        } else {
            let (status, code, message) = http::error_body(resp);
            return Err(ImageError::Registry(RegistryError::Protocol {
                image: self.target.image.clone(),
                registry: self.target.registry.clone(),
                detail: format!(
                    "fetching blob {} answered {status} {code} {message}",
                    self.digest
                ),
            }));
        }
        let mut body = resp.into_body().into_reader();
        if skip > 0 {
            let copied = io::copy(&mut (&mut body).take(skip), &mut io::sink())
                .map_err(|e| self.dropped(&e.to_string()))?;
            if copied < skip {
                return Err(self.dropped("connection closed while skipping to the resume point"));
            }
        }
        Ok(body)
    }

    fn dropped(&self, detail: &str) -> ImageError {
        ImageError::Registry(RegistryError::Unreachable {
            registry: self.target.registry.clone(),
            image: self.target.image.clone(),
            attempts: self.failures.max(1),
            detail: format!(
                "blob {} dropped after {} of {} bytes: {detail}",
                self.digest, self.offset, self.size
            ),
        })
    }

    fn fail(&mut self, e: ImageError) -> io::Error {
        let text = e.to_string();
        self.failure = Some(e);
        io::Error::other(text)
    }
}

impl Read for BlobStream<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            if self.abort.load(Ordering::Relaxed) {
                return Err(self.fail(ImageError::Registry(RegistryError::Aborted)));
            }
            let remaining = self.size - self.offset;
            if remaining == 0 || buf.is_empty() {
                // Bytes past the descriptor's size are never read: the digest covers exactly
                // `size` bytes.
                return Ok(0);
            }
            let since = std::time::Instant::now();
            if self.body.is_none() {
                match self.open() {
                    Ok(b) => self.body = Some(b),
                    // `send` already retried the connection: this is final.
                    Err(e) => return Err(self.fail(e)),
                }
            }
            let want = buf
                .len()
                .min(usize::try_from(remaining).unwrap_or(usize::MAX));
            let body = self.body.as_mut().expect("opened above");
            let got = body.read(&mut buf[..want]);
            let n = got.as_ref().map_or(0, |n| *n as u64);
            if let Err(slow) = self.meter.add(n, since.elapsed()) {
                // Final: a resume would only trickle on.
                let what = format!("blob {} of {}", self.digest, self.target.image);
                return Err(self.fail(slow.error(&self.target.registry, &what)));
            }
            let detail = match got {
                Ok(0) => "connection closed early".to_string(),
                Ok(n) => {
                    self.hasher.update(&buf[..n]);
                    if let Some(t) = &mut self.tee {
                        t.write(&buf[..n]);
                    }
                    self.offset += n as u64;
                    self.failures = 0;
                    (self.on_bytes)(n as u64);
                    return Ok(n);
                }
                Err(e) => e.to_string(),
            };
            self.body = None;
            self.failures += 1;
            if self.failures >= self.transport.retries {
                let e = self.dropped(&detail);
                return Err(self.fail(e));
            }
            tracing::debug!(digest = self.digest, offset = self.offset, %detail, "resuming blob");
            std::thread::sleep(self.transport.backoff(self.failures));
        }
    }
}

pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// `sha256:<hex>` of a document held in memory.
pub fn sha256_of(bytes: &[u8]) -> String {
    format!("sha256:{}", hex(&Sha256::digest(bytes)))
}
