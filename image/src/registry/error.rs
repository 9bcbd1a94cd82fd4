//! The registry client's failures: one line each, naming the image or registry and what to do;
//! held by [`crate::ImageError::Registry`].

use std::path::PathBuf;

use crate::ImageError;

/// A registry failure (auth, network, missing tag or blob, digest, limits).
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// A registry failure told in words.
    #[error("{0}")]
    Message(String),
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
    Pull { image: String, detail: String },
    #[error("image {image} has no {want} variant (it has {have}): choose one with --arch")]
    NoPlatform {
        image: String,
        want: String,
        have: String,
    },
    #[error("pulling {image}: storing layer {digest}: {source}")]
    PullLayer {
        image: String,
        digest: String,
        source: Box<ImageError>,
    },
    #[error("registry configuration: {detail}")]
    RegistryConfig { detail: String },
    /// The last source was a mirror and the registry itself is not to be tried.
    #[error(
        "{source} (registry mirror {mirror} of {origin}; registry.mirrors.\"{origin}\" has \
         fallback = false, so {origin} itself was not tried)"
    )]
    Mirror {
        mirror: String,
        origin: String,
        source: Box<ImageError>,
    },
    /// Another layer of the same pull failed first.
    #[error("pull aborted")]
    Aborted,
    /// A transfer brought less than `registry.min_rate_bytes_per_s` over a window.
    #[error(
        "registry {registry}: {what}: {bytes} bytes in {secs} s, below the minimum {rate}/s \
         ({key}); check the registry or raise the limit"
    )]
    TooSlow {
        registry: String,
        what: String,
        bytes: u64,
        secs: u64,
        rate: String,
        key: &'static str,
    },
    /// The import's overall deadline passed.
    #[error(
        "registry {registry}: {what}: the import did not finish within its deadline of {secs} s \
         ({key}); check the registry or raise the limit"
    )]
    DeadlinePassed {
        registry: String,
        what: String,
        secs: u64,
        key: &'static str,
    },
}
