//! Registry failures, each one line naming the image and registry and saying what to do.

use super::*;

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
    /// The last source was a mirror and the registry itself is not to be tried.
    #[error(
        "{source} (registry mirror {mirror} of {origin}; registry.mirrors.\"{origin}\" has \
         fallback = false, so {origin} itself was not tried)"
    )]
    Mirror {
        mirror: String,
        origin: String,
        source: Box<RegistryError>,
    },
    /// Another layer of the same pull failed first.
    #[error("pull aborted")]
    Aborted,
}

impl From<RegistryError> for ImageError {
    fn from(e: RegistryError) -> Self {
        ImageError::Registry(e.to_string())
    }
}
