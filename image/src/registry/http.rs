//! HTTP to one registry: TLS roots, plain HTTP only where configured, authentication (anonymous,
//! Basic, Bearer tokens following the `WWW-Authenticate` challenge, cached per repository for the
//! pull), and retries with exponential backoff on server errors and dropped connections.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ureq::http::{Response, StatusCode};
use ureq::tls::{Certificate, PemItem, RootCerts, TlsConfig};

use super::ImageError;
use super::auth::{self, Challenge, Credentials, Login};
use crate::config::RegistryConfig;
use crate::registry::RegistryError;

/// System CA bundles, first readable one wins (Debian, RHEL, SUSE, Alpine/macOS layouts).
const SYSTEM_BUNDLES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/ssl/cert.pem",
];

/// Error bodies longer than this are not read.
const ERROR_BODY_LIMIT: u64 = 64 * 1024;
/// Manifests and configs larger than this are refused.
pub const DOCUMENT_LIMIT: u64 = 8 * 1024 * 1024;
/// Backoff never grows past this.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

pub type Resp = Response<ureq::Body>;

/// What a request is for: the image and registry named in its errors.
#[derive(Clone, Debug)]
pub struct Target {
    pub registry: String,
    pub repository: String,
    /// `REGISTRY/REPOSITORY:TAG`, as error messages name the image.
    pub image: String,
    /// The `USER@` of the reference.
    pub user: Option<String>,
    /// For a mirror (`registry` is then the mirror's host): the registry it stands in for.
    pub mirror_of: Option<String>,
}

pub struct Transport {
    agent: ureq::Agent,
    insecure: Vec<String>,
    pub retries: u32,
    backoff: Duration,
    credentials: Credentials,
    /// `Authorization` header per repository (`registry/repository`), set once a challenge was
    /// answered; reused by every request of the pull, renewed when a token expires.
    auth_cache: Mutex<HashMap<String, String>>,
    /// Whether any request of this client sent a user's login.
    used_login: AtomicBool,
    /// The import's deadline and minimum rate (super::limits).
    pub limits: super::limits::Limits,
    /// Cluster peers (crate::peers): plain HTTP, each request signed with the cluster key and
    /// each answer checked for the peer's proof of it (berth_api::auth).
    peers: Mutex<HashMap<String, berth_api::auth::Key>>,
}

/// Without the credentials and the cached `Authorization` headers: a debug line or a log must
/// never show a user's login.
impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transport")
            .field("insecure", &self.insecure)
            .field("retries", &self.retries)
            .field("backoff", &self.backoff)
            .finish_non_exhaustive()
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Method {
    Get,
    Head,
}

impl Transport {
    pub fn new(config: &RegistryConfig, credentials: Credentials) -> Result<Self, ImageError> {
        let roots = load_roots(&config.ca_files)?;
        let tls = TlsConfig::builder().root_certs(roots).build();
        let agent_config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .tls_config(tls)
            .timeout_connect(Some(Duration::from_secs(config.connect_timeout_s.max(1))))
            .timeout_per_read(Some(Duration::from_secs(config.read_timeout_s.max(1))))
            .timeout_per_write(Some(Duration::from_secs(config.read_timeout_s.max(1))))
            .max_idle_connections_per_host(config.parallel_downloads.max(1) + 2)
            .user_agent(concat!("berth/", env!("CARGO_PKG_VERSION")))
            .build();
        Ok(Self {
            agent: agent_config.into(),
            insecure: config.insecure.clone(),
            retries: config.retries.max(1),
            backoff: Duration::from_millis(config.retry_backoff_ms),
            credentials,
            auth_cache: Mutex::new(HashMap::new()),
            used_login: AtomicBool::new(false),
            limits: super::limits::Limits::new(config),
            peers: Mutex::new(HashMap::new()),
        })
    }

    /// Makes `host` a cluster peer: asked in plain HTTP, requests signed with `key`.
    pub fn add_peer(&self, host: &str, key: &berth_api::auth::Key) {
        self.peers
            .lock()
            .expect("peers")
            .insert(host.to_string(), key.clone());
    }

    fn peer_key(&self, host: &str) -> Option<berth_api::auth::Key> {
        self.peers.lock().expect("peers").get(host).cloned()
    }

    /// The HTTP agent, for the uploads of `berth lazy publish` (super::lazy).
    pub(super) fn agent(&self) -> &ureq::Agent {
        &self.agent
    }

    pub fn used_login(&self) -> bool {
        self.used_login.load(Ordering::Relaxed)
    }

    /// `https://REGISTRY/v2/REPOSITORY/` (or `http://` for a registry listed as insecure).
    pub fn repo_url(&self, t: &Target) -> String {
        let scheme = if self.insecure.iter().any(|i| i == &t.registry)
            || self.peer_key(&t.registry).is_some()
        {
            "http"
        } else {
            "https"
        };
        format!("{scheme}://{}/v2/{}/", t.registry, t.repository)
    }

    /// The delay before retry number `attempt` (1-based).
    pub fn backoff(&self, attempt: u32) -> Duration {
        let factor = 1u32 << attempt.saturating_sub(1).min(16);
        self.backoff.saturating_mul(factor).min(MAX_BACKOFF)
    }

    /// Sends a request, answering authentication challenges and retrying server errors and
    /// dropped connections. Returns any response that is not 401, 429 or 5xx; the caller
    /// interprets 404 and the like. `range_from` asks for the bytes from that offset on.
    pub fn send(
        &self,
        t: &Target,
        method: Method,
        url: &str,
        accept: Option<&str>,
        range_from: Option<u64>,
        abort: Option<&AtomicBool>,
    ) -> Result<Resp, ImageError> {
        let range = range_from.filter(|f| *f > 0).map(|f| format!("bytes={f}-"));
        self.send_range(t, method, url, accept, range.as_deref(), abort)
    }

    /// [`Transport::send`] with any `Range` header value (`bytes=A-B` for a lazy image's chunks).
    pub fn send_range(
        &self,
        t: &Target,
        method: Method,
        url: &str,
        accept: Option<&str>,
        range: Option<&str>,
        abort: Option<&AtomicBool>,
    ) -> Result<Resp, ImageError> {
        let key = format!("{}/{}", t.registry, t.repository);
        let mut answered_challenge = false;
        let mut attempt = 0u32;
        let deadline = self.limits.deadline();
        loop {
            if abort.is_some_and(|a| a.load(Ordering::Relaxed)) {
                return Err(ImageError::Registry(RegistryError::Aborted));
            }
            let left = deadline.check(&t.registry, &super::limits::what(&t.image, url))?;
            let peer = self.peer_key(&t.registry);
            let authorization = if peer.is_some() {
                None
            } else {
                self.auth_cache
                    .lock()
                    .expect("auth cache")
                    .get(&key)
                    .cloned()
            };
            let mut req = match method {
                Method::Get => self.agent.get(url),
                Method::Head => self.agent.head(url),
            };
            if let Some(a) = accept {
                req = req.header("Accept", a);
            }
            if let Some(a) = &authorization {
                req = req.header("Authorization", a);
            }
            if let Some(r) = range {
                req = req.header("Range", r);
            }
            // What is left of the deadline bounds this request, the reading of its body included.
            req = req.config().timeout_global(Some(left)).build();
            let signed = match &peer {
                Some(k) => Some(peer_sign(t, k, method, url)?),
                None => None,
            };
            if let Some(s) = &signed {
                req = req.header(berth_api::auth::AUTH_HEADER, &s.header);
            }
            let answer = req.call();
            if let (Some(k), Some(s), Ok(resp)) = (&peer, &signed, &answer) {
                peer_check(t, k, s, url, resp)?;
            }
            // With `answered`, the error status the registry gave: a registry that answers is
            // not "unreachable", and its own words say more than the status.
            let (failure, answered) = match answer {
                Ok(resp) if resp.status() == StatusCode::UNAUTHORIZED => {
                    if answered_challenge {
                        return Err(self.rejected(t));
                    }
                    let header = self.answer_challenge(t, &resp)?;
                    self.auth_cache
                        .lock()
                        .expect("auth cache")
                        .insert(key.clone(), header);
                    answered_challenge = true;
                    continue;
                }
                Ok(resp)
                    if resp.status().is_server_error()
                        || resp.status() == StatusCode::TOO_MANY_REQUESTS =>
                {
                    let (status, code, message) = error_body(resp);
                    let said = [code, message]
                        .into_iter()
                        .filter(|s| !s.is_empty())
                        .collect::<Vec<_>>()
                        .join(": ");
                    (
                        format!("{} answered {status}", t.registry),
                        Some((status, said)),
                    )
                }
                Ok(resp) => return Ok(resp),
                Err(e) if retryable(&e) => (describe(&e), None),
                Err(e) => return Err(self.transport_error(t, e)),
            };
            attempt += 1;
            if attempt >= self.retries {
                if let Some((status, said)) = answered {
                    return Err(ImageError::Registry(RegistryError::ServerError {
                        registry: t.registry.clone(),
                        image: t.image.clone(),
                        attempts: attempt,
                        status: status.to_string(),
                        said: if said.is_empty() {
                            String::new()
                        } else {
                            format!(" ({})", berth_sys::text::elide(&said))
                        },
                    }));
                }
                return Err(ImageError::Registry(RegistryError::Unreachable {
                    registry: t.registry.clone(),
                    image: t.image.clone(),
                    attempts: attempt,
                    detail: failure,
                }));
            }
            tracing::debug!(%url, attempt, %failure, "retrying");
            std::thread::sleep(self.backoff(attempt));
        }
    }

    /// Reads a small response body (manifest, config, token, error). A connection dropped
    /// midway is `Unreachable` (callers retry it); a body past [`DOCUMENT_LIMIT`] is the
    /// registry's fault, said so, not retried.
    pub fn read_document(&self, t: &Target, resp: Resp) -> Result<Vec<u8>, ImageError> {
        let reader = resp
            .into_body()
            .into_with_config()
            .limit(DOCUMENT_LIMIT)
            .reader();
        let what = format!("a manifest, config or token of {}", t.image);
        super::limits::read_metered(
            reader,
            self.limits.meter(),
            &t.registry,
            &what,
            |e| match e {
                ureq::Error::BodyExceedsLimit(_) => ImageError::Registry(RegistryError::Protocol {
                    image: t.image.clone(),
                    registry: t.registry.clone(),
                    detail: format!(
                        "a document (manifest, config or token) larger than {} MiB",
                        DOCUMENT_LIMIT >> 20
                    ),
                }),
                e => ImageError::Registry(RegistryError::Unreachable {
                    registry: t.registry.clone(),
                    image: t.image.clone(),
                    attempts: 1,
                    detail: describe(&e),
                }),
            },
        )
    }

    /// Works out the `Authorization` header a 401 asks for.
    pub(super) fn answer_challenge(&self, t: &Target, resp: &Resp) -> Result<String, ImageError> {
        let challenges: Vec<Challenge> = resp
            .headers()
            .get_all("www-authenticate")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .filter_map(auth::parse_challenge)
            .collect();
        let bearer = challenges
            .iter()
            .find(|c| matches!(c, Challenge::Bearer { .. }));
        match bearer.or(challenges.first()) {
            Some(Challenge::Bearer {
                realm,
                service,
                scope,
            }) => self.fetch_token(t, realm, service.as_deref(), scope.as_deref()),
            Some(Challenge::Basic { .. }) => {
                let login = self.login_for(t, &[&t.registry])?;
                match login {
                    Some(l) => {
                        self.used_login.store(true, Ordering::Relaxed);
                        Ok(l.basic_header())
                    }
                    None => Err(self.credentials_required(t)),
                }
            }
            None => Err(ImageError::Registry(RegistryError::Protocol {
                image: t.image.clone(),
                registry: t.registry.clone(),
                detail: "answered 401 without a usable WWW-Authenticate challenge".to_string(),
            })),
        }
    }

    /// The login to use for `hosts` (first match wins); `USER@` without a matching entry is an
    /// error rather than an anonymous pull, since the user asked for that account.
    fn login_for(&self, t: &Target, hosts: &[&str]) -> Result<Option<&Login>, ImageError> {
        let found = hosts
            .iter()
            .find_map(|h| self.credentials.find(h, t.user.as_deref()));
        if found.is_none()
            && let Some(user) = &t.user
        {
            return Err(ImageError::Registry(RegistryError::NoSuchLogin {
                image: t.image.clone(),
                registry: t.registry.clone(),
                user: user.clone(),
                files: self.credentials.files_text(),
            }));
        }
        Ok(found)
    }

    fn fetch_token(
        &self,
        t: &Target,
        realm: &str,
        service: Option<&str>,
        scope: Option<&str>,
    ) -> Result<String, ImageError> {
        let scope = scope
            .map(str::to_string)
            .unwrap_or_else(|| format!("repository:{}:pull", t.repository));
        let mut url = realm.to_string();
        url.push(if url.contains('?') { '&' } else { '?' });
        if let Some(s) = service {
            url.push_str(&format!("service={}&", auth::query_escape(s)));
        }
        url.push_str(&format!("scope={}", auth::query_escape(&scope)));
        let realm_host = auth::url_host(realm).unwrap_or_default();
        let plain_ok = |h: &str| self.insecure.iter().any(|i| i == h);
        if !(realm.starts_with("https://") || plain_ok(realm_host) || plain_ok(&t.registry)) {
            // A login must not travel in clear text to a token server the admin did not list.
            return Err(ImageError::Registry(RegistryError::Protocol {
                image: t.image.clone(),
                registry: t.registry.clone(),
                detail: format!(
                    "its token server {realm} is not HTTPS; list {realm_host} in \
                     registry.insecure if that is intended"
                ),
            }));
        }
        let login = self.login_for(t, &[realm_host, &t.registry])?;
        let protocol = |detail: String| {
            ImageError::Registry(RegistryError::Protocol {
                image: t.image.clone(),
                registry: t.registry.clone(),
                detail,
            })
        };
        let mut attempt = 0u32;
        let deadline = self.limits.deadline();
        let resp = loop {
            let left = deadline.check(realm_host, &format!("a token for {}", t.image))?;
            let answer = match login {
                // docker's identity token is an OAuth2 refresh token: POSTed to the realm
                // (distribution's token spec), never sent as a password.
                Some(Login {
                    identity_token: Some(token),
                    ..
                }) => self
                    .agent
                    .post(realm)
                    .config()
                    .timeout_global(Some(left))
                    .build()
                    .header("Content-Type", "application/x-www-form-urlencoded")
                    .send(refresh_form(token, service, &scope).as_bytes()),
                Some(l) => self
                    .agent
                    .get(&url)
                    .config()
                    .timeout_global(Some(left))
                    .build()
                    .header("Authorization", l.basic_header())
                    .call(),
                None => self
                    .agent
                    .get(&url)
                    .config()
                    .timeout_global(Some(left))
                    .build()
                    .call(),
            };
            let (failure, answered) = match answer {
                Ok(r) if r.status().is_server_error() => (
                    format!("token server {realm} answered {}", r.status()),
                    Some(r.status()),
                ),
                Ok(r) => break r,
                Err(e) if retryable(&e) => (describe(&e), None),
                Err(e) => return Err(self.transport_error(t, e)),
            };
            attempt += 1;
            if let (true, Some(status)) = (attempt >= self.retries, answered) {
                return Err(ImageError::Registry(RegistryError::ServerError {
                    registry: format!("its token server {realm_host}"),
                    image: t.image.clone(),
                    attempts: attempt,
                    status: status.to_string(),
                    said: String::new(),
                }));
            }
            if attempt >= self.retries {
                return Err(ImageError::Registry(RegistryError::Unreachable {
                    registry: realm_host.to_string(),
                    image: t.image.clone(),
                    attempts: attempt,
                    detail: failure,
                }));
            }
            std::thread::sleep(self.backoff(attempt));
        };
        let status = resp.status();
        if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
            return Err(match login {
                Some(l) => self.login_rejected(t, l),
                None => self.credentials_required(t),
            });
        }
        if !status.is_success() {
            return Err(protocol(format!("token server {realm} answered {status}")));
        }
        if login.is_some() {
            self.used_login.store(true, Ordering::Relaxed);
        }
        let body = self.read_document(t, resp)?;
        #[derive(serde::Deserialize)]
        struct TokenResponse {
            token: Option<String>,
            access_token: Option<String>,
        }
        let parsed: TokenResponse = serde_json::from_slice(&body)
            .map_err(|e| protocol(format!("token server {realm} sent invalid JSON: {e}")))?;
        let token = parsed
            .token
            .or(parsed.access_token)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| protocol(format!("token server {realm} sent no token")))?;
        Ok(format!("Bearer {token}"))
    }

    /// A second 401 after the challenge was answered.
    fn rejected(&self, t: &Target) -> ImageError {
        let login = match self.login_for(t, &[&t.registry]) {
            Ok(l) => l,
            Err(e) => return e,
        };
        // A token that came back refused lacks the scope: for an anonymous pull that means
        // "needs credentials", with a login it means the login was refused.
        match login {
            Some(l) if self.used_login() => self.login_rejected(t, l),
            _ => self.credentials_required(t),
        }
    }

    fn login_rejected(&self, t: &Target, l: &Login) -> ImageError {
        ImageError::Registry(RegistryError::LoginRejected {
            image: t.image.clone(),
            registry: t.registry.clone(),
            login: l.login.clone(),
            file: l.file.clone(),
        })
    }

    fn credentials_required(&self, t: &Target) -> ImageError {
        ImageError::Registry(RegistryError::CredentialsRequired {
            image: t.image.clone(),
            registry: t.registry.clone(),
            host: t.registry.clone(),
            files: self.credentials.files_text(),
        })
    }

    pub(super) fn transport_error(&self, t: &Target, e: ureq::Error) -> ImageError {
        match &e {
            _ if tls_failure(&e).is_some() => {
                let detail = describe(&e);
                let plain = matches!(
                    tls_failure(&e),
                    Some(rustls::Error::InvalidMessage(
                        rustls::InvalidMessage::InvalidContentType
                    ))
                ) || detail.contains("corrupt message");
                ImageError::Registry(RegistryError::Tls {
                    image: t.image.clone(),
                    registry: t.registry.clone(),
                    hint: if plain {
                        format!(
                            "the registry does not speak TLS; if {} serves plain HTTP, list it in \
                             registry.insecure in berth.toml",
                            t.registry
                        )
                    } else {
                        "if the registry's certificate comes from a private CA, add that CA's PEM \
                         file to registry.ca_files in berth.toml"
                            .to_string()
                    },
                    detail,
                })
            }
            ureq::Error::Protocol(_) if self.repo_url(t).starts_with("http:") => {
                ImageError::Registry(RegistryError::Protocol {
                    image: t.image.clone(),
                    registry: t.registry.clone(),
                    detail: format!(
                        "{} (it is listed in registry.insecure: does it serve TLS?)",
                        describe(&e)
                    ),
                })
            }
            _ => ImageError::Registry(RegistryError::Unreachable {
                registry: t.registry.clone(),
                image: t.image.clone(),
                attempts: 1,
                detail: describe(&e),
            }),
        }
    }
}

/// Signs a request to a cluster peer (berth_api::auth): the cluster key is never sent.
fn peer_sign(
    t: &Target,
    key: &berth_api::auth::Key,
    method: Method,
    url: &str,
) -> Result<berth_api::auth::Signed, ImageError> {
    let path = url
        .split_once("://")
        .and_then(|(_, rest)| rest.find('/').map(|i| &rest[i..]))
        .unwrap_or("/");
    let method = match method {
        Method::Get => "GET",
        Method::Head => "HEAD",
    };
    berth_api::auth::sign_request(key, method, path, b"").map_err(|e| {
        ImageError::Registry(RegistryError::Protocol {
            image: t.image.clone(),
            registry: t.registry.clone(),
            detail: e.to_string(),
        })
    })
}

/// Refuses a peer's answer, whatever its status, unless it proves the peer holds the cluster key:
/// a process that took a departed agent's port gets no say. A blob answer's proof covers the
/// digest and the Content-Length (its bytes are checked against the digest as they come).
fn peer_check(
    t: &Target,
    key: &berth_api::auth::Key,
    signed: &berth_api::auth::Signed,
    url: &str,
    resp: &Resp,
) -> Result<(), ImageError> {
    let header = |name: &str| resp.headers().get(name).and_then(|v| v.to_str().ok());
    let digest = url.rsplit('/').next().unwrap_or_default();
    let length = header("content-length")
        .and_then(|l| l.parse().ok())
        .unwrap_or(0);
    berth_api::auth::verify_answer(
        key,
        header(berth_api::auth::PROOF_HEADER),
        &signed.nonce,
        resp.status().as_u16(),
        &berth_api::auth::blob_tag(digest, length),
    )
    .map_err(|e| {
        tracing::debug!("cluster peer {} failed to authenticate: {e}", t.registry);
        ImageError::Registry(RegistryError::Protocol {
            image: t.image.clone(),
            registry: t.registry.clone(),
            detail: format!("the cluster peer failed to authenticate: {e}"),
        })
    })
}

/// The form body that exchanges a refresh (identity) token for an access token.
pub fn refresh_form(token: &str, service: Option<&str>, scope: &str) -> String {
    let mut form = format!(
        "grant_type=refresh_token&client_id=berth&refresh_token={}&scope={}",
        auth::query_escape(token),
        auth::query_escape(scope)
    );
    if let Some(s) = service {
        form.push_str(&format!("&service={}", auth::query_escape(s)));
    }
    form
}

/// The error text of a response that is not what was asked: the registry's first error code
/// and message when it sent the distribution spec's JSON.
pub fn error_body(resp: Resp) -> (StatusCode, String, String) {
    let status = resp.status();
    let body = resp
        .into_body()
        .into_with_config()
        .limit(ERROR_BODY_LIMIT)
        .read_to_vec()
        .unwrap_or_default();
    #[derive(serde::Deserialize)]
    struct Errors {
        errors: Vec<Entry>,
    }
    #[derive(serde::Deserialize)]
    struct Entry {
        code: Option<String>,
        message: Option<String>,
    }
    match serde_json::from_slice::<Errors>(&body) {
        Ok(e) if !e.errors.is_empty() => {
            let first = &e.errors[0];
            (
                status,
                first.code.clone().unwrap_or_default(),
                first.message.clone().unwrap_or_default(),
            )
        }
        _ => (status, String::new(), String::new()),
    }
}

/// The TLS failure inside a transport error: rustls reports handshake failures as io errors,
/// which must not be retried like a dropped connection.
fn tls_failure(e: &ureq::Error) -> Option<&rustls::Error> {
    match e {
        ureq::Error::Rustls(r) => Some(r),
        ureq::Error::Io(io) => io.get_ref()?.downcast_ref::<rustls::Error>(),
        _ => None,
    }
}

fn retryable(e: &ureq::Error) -> bool {
    tls_failure(e).is_none()
        && matches!(
            e,
            ureq::Error::Io(_)
                | ureq::Error::Timeout(_)
                | ureq::Error::ConnectionFailed
                | ureq::Error::BodyStalled
        )
}

/// One line for a transport error (ureq's texts, with the io cause spelled out).
pub fn describe(e: &ureq::Error) -> String {
    match e {
        ureq::Error::Io(io) => io.to_string(),
        ureq::Error::ConnectionFailed => "connection failed".to_string(),
        other => other.to_string(),
    }
}

fn load_roots(extra: &[PathBuf]) -> Result<RootCerts, ImageError> {
    let mut certs: Vec<Certificate<'static>> = Vec::new();
    for bundle in SYSTEM_BUNDLES {
        if let Ok(pem) = std::fs::read(bundle) {
            certs.extend(pem_certs(&pem));
            if !certs.is_empty() {
                break;
            }
        }
    }
    let system = certs.len();
    for file in extra {
        let pem = std::fs::read(file).map_err(|e| RegistryError::RegistryConfig {
            detail: format!("registry.ca_files: {}: {e}", file.display()),
        })?;
        let found = pem_certs(&pem);
        if found.is_empty() {
            return Err(ImageError::Registry(RegistryError::RegistryConfig {
                detail: format!(
                    "registry.ca_files: {} holds no PEM certificate",
                    file.display()
                ),
            }));
        }
        certs.extend(found);
    }
    if certs.is_empty() || (system == 0 && extra.is_empty()) {
        // No system bundle on this host: fall back to the Mozilla roots compiled in.
        return Ok(RootCerts::WebPki);
    }
    Ok(RootCerts::Specific(Arc::new(certs)))
}

fn pem_certs(pem: &[u8]) -> Vec<Certificate<'static>> {
    ureq::tls::parse_pem(pem)
        .filter_map(|item| match item {
            Ok(PemItem::Certificate(c)) => Some(c),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_identity_token_is_exchanged_as_an_oauth2_refresh_token() {
        assert_eq!(
            refresh_form("a+b/c", Some("reg.example"), "repository:x/y:pull"),
            "grant_type=refresh_token&client_id=berth&refresh_token=a%2Bb%2Fc&scope=repository%3Ax%2Fy%3Apull&service=reg.example"
        );
        assert!(!refresh_form("t", None, "s").contains("service="));
    }
}
