//! Test registry harness for the root tier (included by `tests/root_registry.rs` with `#[path]`):
//! Debian's `docker-registry` (distribution 2.8) on 127.0.0.1 in plain HTTP, htpasswd Basic,
//! TLS (CA + leaf with SAN IP:127.0.0.1, DNS:localhost) and token (Bearer JWT) modes; a tiny
//! token server; a throttling TCP proxy that the tests use to cut transfers; and a builder for
//! test images made from busybox-static with hand-written JSON, pushed by a small uploader of
//! its own (monolithic blob uploads and manifest PUTs, so any media type can be pushed: zstd
//! layers, OCI indexes, Docker manifest lists). Every process and thread it starts is stopped
//! by a drop guard.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use sha2::{Digest as _, Sha256};

pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
pub const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub const DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";

pub fn sha256(bytes: &[u8]) -> String {
    let d = Sha256::digest(bytes);
    format!(
        "sha256:{}",
        d.iter().map(|b| format!("{b:02x}")).collect::<String>()
    )
}

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A free port on 127.0.0.1 (bound and released; the registry binds it right after).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

// ---------------------------------------------------------------------------------------------
// Certificates and keys

pub struct Pki {
    pub dir: PathBuf,
    pub ca_cert: PathBuf,
    pub leaf_cert: PathBuf,
    pub leaf_key: PathBuf,
    /// Self-signed certificate and key that sign Bearer tokens.
    pub token_cert: PathBuf,
    pub token_key: PathBuf,
}

impl Pki {
    pub fn create(dir: &Path) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let p = |n: &str| dir.join(n);
        run(Command::new("openssl")
            .args([
                "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            ])
            .args(["-subj", "/CN=berth-test-ca"])
            .args(["-addext", "basicConstraints=critical,CA:TRUE"])
            .args(["-addext", "keyUsage=critical,keyCertSign,cRLSign"])
            .arg("-keyout")
            .arg(p("ca.key"))
            .arg("-out")
            .arg(p("ca.crt")));
        run(Command::new("openssl")
            .args([
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-subj",
                "/CN=localhost",
            ])
            .arg("-keyout")
            .arg(p("leaf.key"))
            .arg("-out")
            .arg(p("leaf.csr")));
        std::fs::write(
            p("leaf.ext"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n\
             keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n",
        )
        .unwrap();
        run(Command::new("openssl")
            .args(["x509", "-req", "-days", "2", "-CAcreateserial"])
            .arg("-in")
            .arg(p("leaf.csr"))
            .arg("-CA")
            .arg(p("ca.crt"))
            .arg("-CAkey")
            .arg(p("ca.key"))
            .arg("-extfile")
            .arg(p("leaf.ext"))
            .arg("-out")
            .arg(p("leaf.crt")));
        run(Command::new("openssl")
            .args([
                "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            ])
            .args(["-subj", "/CN=berth-test-token-signer"])
            .arg("-keyout")
            .arg(p("token.key"))
            .arg("-out")
            .arg(p("token.crt")));
        Self {
            dir: dir.to_path_buf(),
            ca_cert: p("ca.crt"),
            leaf_cert: p("leaf.crt"),
            leaf_key: p("leaf.key"),
            token_cert: p("token.crt"),
            token_key: p("token.key"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The registry

#[derive(Clone)]
pub enum Mode {
    Plain,
    /// htpasswd Basic auth with one user.
    Basic {
        user: String,
        password: String,
    },
    Tls {
        cert: PathBuf,
        key: PathBuf,
    },
    /// Bearer tokens from `realm`, signed by the key of `rootcertbundle`.
    Token {
        realm: String,
        service: String,
        issuer: String,
        rootcertbundle: PathBuf,
    },
}

/// A running docker-registry; killed (SIGKILL) and reaped on drop.
pub struct Registry {
    pub port: u16,
    pub storage: PathBuf,
    pub dir: PathBuf,
    config: PathBuf,
    child: Option<Child>,
}

impl Registry {
    /// Starts a registry serving `storage` in `mode`; `dir` holds its config and log.
    pub fn start(mode: &Mode, storage: &Path, dir: &Path) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::create_dir_all(storage).unwrap();
        let port = free_port();
        let mut yaml = format!(
            "version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: true\n\
             storage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\n\
             http:\n  addr: 127.0.0.1:{port}\n",
            storage.display()
        );
        match mode {
            Mode::Plain => {}
            Mode::Tls { cert, key } => yaml.push_str(&format!(
                "  tls:\n    certificate: {}\n    key: {}\n",
                cert.display(),
                key.display()
            )),
            Mode::Basic { user, password } => {
                let out = Command::new("htpasswd")
                    .args(["-Bbn", user, password])
                    .output()
                    .expect("htpasswd (apt-get install apache2-utils)");
                assert!(out.status.success());
                let htpasswd = dir.join("htpasswd");
                std::fs::write(&htpasswd, out.stdout).unwrap();
                yaml.push_str(&format!(
                    "auth:\n  htpasswd:\n    realm: berth-test\n    path: {}\n",
                    htpasswd.display()
                ));
            }
            Mode::Token {
                realm,
                service,
                issuer,
                rootcertbundle,
            } => yaml.push_str(&format!(
                "auth:\n  token:\n    realm: {realm}\n    service: {service}\n    issuer: \
                 {issuer}\n    rootcertbundle: {}\n",
                rootcertbundle.display()
            )),
        }
        let config = dir.join("config.yml");
        std::fs::write(&config, yaml).unwrap();
        let mut r = Self {
            port,
            storage: storage.to_path_buf(),
            dir: dir.to_path_buf(),
            config,
            child: None,
        };
        r.spawn();
        r
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("registry.log"))
            .unwrap();
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&self.config)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("docker-registry (apt-get install docker-registry)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "docker-registry exited ({status}): {}",
                    std::fs::read_to_string(self.dir.join("registry.log")).unwrap_or_default()
                );
            }
            assert!(
                Instant::now() < deadline,
                "docker-registry not ready in 10 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `127.0.0.1:PORT`, as image references name it.
    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kills the registry (SIGKILL: like a crash).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port, config and storage.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.kill();
    }
}

// ---------------------------------------------------------------------------------------------
// Token server

/// A Bearer token server on 127.0.0.1: `GET /token?service=…&scope=…` answers
/// `{"token": JWT, "access_token": JWT}`, the JWT signed RS256 with `key` and carrying `cert` in
/// its `x5c` header (what distribution's token auth verifies against its rootcertbundle).
/// With `login` set, requests without that Basic login get 401.
pub struct TokenServer {
    pub port: u16,
    pub requests: Arc<Mutex<Vec<TokenRequest>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

#[derive(Clone, Debug)]
pub struct TokenRequest {
    pub service: Option<String>,
    pub scope: Option<String>,
    pub authorization: Option<String>,
}

impl TokenServer {
    pub fn start(
        issuer: &str,
        service: &str,
        cert: &Path,
        key: &Path,
        login: Option<(&str, &str)>,
    ) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let der = Command::new("openssl")
            .args(["x509", "-outform", "DER", "-in"])
            .arg(cert)
            .output()
            .unwrap();
        assert!(der.status.success());
        let x5c = base64::engine::general_purpose::STANDARD.encode(der.stdout);
        let want_auth = login.map(|(u, p)| {
            format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(format!("{u}:{p}"))
            )
        });
        let requests = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (issuer, service, key) = (issuer.to_string(), service.to_string(), key.to_path_buf());
        let (reqs, stopping) = (requests.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !stopping.load(Ordering::Relaxed) {
                let mut conn = match listener.accept() {
                    Ok((c, _)) => c,
                    Err(_) => {
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    }
                };
                conn.set_nonblocking(false).unwrap();
                let Some((path, headers)) = read_request(&mut conn) else {
                    continue;
                };
                let query = path.split_once('?').map(|(_, q)| q).unwrap_or_default();
                let param = |name: &str| {
                    query
                        .split('&')
                        .filter_map(|kv| kv.split_once('='))
                        .find(|(k, _)| *k == name)
                        .map(|(_, v)| percent_decode(v))
                };
                let authorization = header(&headers, "authorization");
                let req = TokenRequest {
                    service: param("service"),
                    scope: param("scope"),
                    authorization: authorization.clone(),
                };
                reqs.lock().unwrap().push(req.clone());
                if want_auth.is_some() && authorization != want_auth {
                    let _ = conn.write_all(
                        b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                    );
                    continue;
                }
                let jwt = mint_jwt(&issuer, &service, req.scope.as_deref(), &x5c, &key);
                let body = format!(
                    "{{\"token\":\"{jwt}\",\"access_token\":\"{jwt}\",\"expires_in\":300}}"
                );
                let _ = conn.write_all(
                    format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: \
                         {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    )
                    .as_bytes(),
                );
            }
        });
        Self {
            port,
            requests,
            stop,
            thread: Some(thread),
        }
    }

    pub fn realm(&self) -> String {
        format!("http://127.0.0.1:{}/token", self.port)
    }
}

impl Drop for TokenServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn mint_jwt(issuer: &str, service: &str, scope: Option<&str>, x5c: &str, key: &Path) -> String {
    let b64 = |b: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    // scope = repository:NAME:ACTIONS; grant what was asked.
    let access = scope
        .and_then(|s| {
            let mut parts = s.splitn(3, ':');
            let (typ, name, actions) = (parts.next()?, parts.next()?, parts.next()?);
            let actions: Vec<String> = actions.split(',').map(|a| format!("\"{a}\"")).collect();
            Some(format!(
                "[{{\"type\":\"{typ}\",\"name\":\"{name}\",\"actions\":[{}]}}]",
                actions.join(",")
            ))
        })
        .unwrap_or_else(|| "[]".to_string());
    let header = format!("{{\"typ\":\"JWT\",\"alg\":\"RS256\",\"x5c\":[\"{x5c}\"]}}");
    let claims = format!(
        "{{\"iss\":\"{issuer}\",\"sub\":\"berth-test\",\"aud\":\"{service}\",\"exp\":{},\
         \"nbf\":{},\"iat\":{now},\"jti\":\"{now}-{}\",\"access\":{access}}}",
        now + 300,
        now - 10,
        COUNTER.fetch_add(1, Ordering::Relaxed)
    );
    let signing_input = format!("{}.{}", b64(header.as_bytes()), b64(claims.as_bytes()));
    let mut child = Command::new("openssl")
        .args(["dgst", "-sha256", "-sign"])
        .arg(key)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(signing_input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "openssl dgst -sign failed");
    format!("{signing_input}.{}", b64(&out.stdout))
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

fn read_request(conn: &mut TcpStream) -> Option<(String, Vec<(String, String)>)> {
    conn.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        if conn.read(&mut byte).ok()? == 0 {
            return None;
        }
        buf.push(byte[0]);
    }
    let text = String::from_utf8_lossy(&buf).to_string();
    let mut lines = text.split("\r\n");
    let path = lines.next()?.split_whitespace().nth(1)?.to_string();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Some((path, headers))
}

fn header(headers: &[(String, String)], name: &str) -> Option<String> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.clone())
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let hex = |x: u8| (x as char).to_digit(16);
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2]))
        {
            out.push(u8::try_from(h * 16 + l).unwrap());
            i += 3;
            continue;
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).to_string()
}

// ---------------------------------------------------------------------------------------------
// A throttling TCP proxy

/// Forwards 127.0.0.1:port to `upstream`, sending the answers at most `bytes_per_s` (so a
/// test can act in the middle of a transfer) and recording what passes.
pub struct Proxy {
    pub port: u16,
    /// Bytes sent from upstream to clients.
    pub downstream: Arc<AtomicU64>,
    /// Requests (first line and headers) clients sent.
    pub requests: Arc<Mutex<Vec<String>>>,
    pub connections: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Proxy {
    pub fn start(upstream: u16, bytes_per_s: u64) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let downstream = Arc::new(AtomicU64::new(0));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let connections = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (down, reqs, conns, stopping) = (
            downstream.clone(),
            requests.clone(),
            connections.clone(),
            stop.clone(),
        );
        let thread = std::thread::spawn(move || {
            while !stopping.load(Ordering::Relaxed) {
                let client = match listener.accept() {
                    Ok((c, _)) => c,
                    Err(_) => {
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    }
                };
                conns.fetch_add(1, Ordering::Relaxed);
                client.set_nonblocking(false).unwrap();
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
                    // Upstream down: the client sees its connection closed at once.
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                let (mut c_read, mut s_write) =
                    (client.try_clone().unwrap(), server.try_clone().unwrap());
                let reqs = reqs.clone();
                let stop_up = stopping.clone();
                std::thread::spawn(move || {
                    let mut buf = [0u8; 16 * 1024];
                    c_read
                        .set_read_timeout(Some(Duration::from_millis(200)))
                        .unwrap();
                    while !stop_up.load(Ordering::Relaxed) {
                        match c_read.read(&mut buf) {
                            Ok(0) => break,
                            Ok(n) => {
                                reqs.lock()
                                    .unwrap()
                                    .push(String::from_utf8_lossy(&buf[..n]).to_string());
                                if s_write.write_all(&buf[..n]).is_err() {
                                    break;
                                }
                            }
                            Err(e)
                                if e.kind() == std::io::ErrorKind::WouldBlock
                                    || e.kind() == std::io::ErrorKind::TimedOut => {}
                            Err(_) => break,
                        }
                    }
                    let _ = s_write.shutdown(Shutdown::Write);
                });
                let (mut s_read, mut c_write) = (server, client);
                let down = down.clone();
                let stop_down = stopping.clone();
                std::thread::spawn(move || {
                    let chunk = 64 * 1024;
                    let mut buf = vec![0u8; chunk];
                    let start = Instant::now();
                    let mut sent = 0u64;
                    s_read
                        .set_read_timeout(Some(Duration::from_millis(200)))
                        .unwrap();
                    while !stop_down.load(Ordering::Relaxed) {
                        match s_read.read(&mut buf) {
                            Ok(0) => break,
                            Ok(n) => {
                                if c_write.write_all(&buf[..n]).is_err() {
                                    break;
                                }
                                sent += n as u64;
                                down.fetch_add(n as u64, Ordering::Relaxed);
                                let due = Duration::from_secs_f64(sent as f64 / bytes_per_s as f64);
                                if let Some(wait) = due.checked_sub(start.elapsed()) {
                                    std::thread::sleep(wait);
                                }
                            }
                            Err(e)
                                if e.kind() == std::io::ErrorKind::WouldBlock
                                    || e.kind() == std::io::ErrorKind::TimedOut => {}
                            Err(_) => break,
                        }
                    }
                    let _ = c_write.shutdown(Shutdown::Both);
                });
            }
        });
        Self {
            port,
            downstream,
            requests,
            connections,
            stop,
            thread: Some(thread),
        }
    }

    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Test images

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

/// One entry of a layer tar.
pub enum Entry {
    Dir(&'static str),
    File(String, Vec<u8>, u32),
    Symlink(&'static str, &'static str),
    /// `.wh.NAME` next to NAME: deletes NAME from the layers below.
    Whiteout(&'static str),
    /// `DIR/.wh..wh..opq`: hides everything below DIR in lower layers.
    Opaque(&'static str),
}

/// A layer ready to push.
#[derive(Clone, Debug)]
pub struct Blob {
    pub bytes: Vec<u8>,
    pub digest: String,
    pub diff_id: String,
    pub media_type: String,
}

pub fn tar_of(entries: &[Entry]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let header = |path: &str, kind: tar::EntryType, size: u64, mode: u32| {
        let mut h = tar::Header::new_gnu();
        h.set_path(path).unwrap();
        h.set_entry_type(kind);
        h.set_size(size);
        h.set_mode(mode);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h
    };
    for e in entries {
        match e {
            Entry::Dir(p) => {
                let mut h = header(p, tar::EntryType::Directory, 0, 0o755);
                h.set_cksum();
                b.append(&h, std::io::empty()).unwrap();
            }
            Entry::File(p, data, mode) => {
                let mut h = header(p, tar::EntryType::Regular, data.len() as u64, *mode);
                h.set_cksum();
                b.append(&h, &data[..]).unwrap();
            }
            Entry::Symlink(p, target) => {
                let mut h = header(p, tar::EntryType::Symlink, 0, 0o777);
                h.set_link_name(target).unwrap();
                h.set_cksum();
                b.append(&h, std::io::empty()).unwrap();
            }
            Entry::Whiteout(p) => {
                let path = Path::new(p);
                let name = format!(".wh.{}", path.file_name().unwrap().to_string_lossy());
                let full = path.with_file_name(name);
                let mut h = header(full.to_str().unwrap(), tar::EntryType::Regular, 0, 0o644);
                h.set_cksum();
                b.append(&h, std::io::empty()).unwrap();
            }
            Entry::Opaque(dir) => {
                let full = format!("{dir}/.wh..wh..opq");
                let mut h = header(&full, tar::EntryType::Regular, 0, 0o644);
                h.set_cksum();
                b.append(&h, std::io::empty()).unwrap();
            }
        }
    }
    b.into_inner().unwrap()
}

pub fn blob_of(tar: Vec<u8>, compression: Compression, docker: bool) -> Blob {
    let diff_id = sha256(&tar);
    let (bytes, media_type) = match (compression, docker) {
        (Compression::None, false) => (tar, "application/vnd.oci.image.layer.v1.tar"),
        (Compression::None, true) => (tar, "application/vnd.docker.image.rootfs.diff.tar"),
        (Compression::Gzip, d) => {
            let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            e.write_all(&tar).unwrap();
            let mt = if d {
                "application/vnd.docker.image.rootfs.diff.tar.gzip"
            } else {
                "application/vnd.oci.image.layer.v1.tar+gzip"
            };
            (e.finish().unwrap(), mt)
        }
        (Compression::Zstd, _) => (
            zstd::encode_all(&tar[..], 3).unwrap(),
            "application/vnd.oci.image.layer.v1.tar+zstd",
        ),
    };
    Blob {
        digest: sha256(&bytes),
        bytes,
        diff_id,
        media_type: media_type.to_string(),
    }
}

/// A busybox root filesystem layer: /bin/busybox, /bin/sh, /etc/berth-platform = `platform`.
pub fn busybox_entries(platform: &str) -> Vec<Entry> {
    let busybox =
        std::fs::read("/bin/busybox").expect("/bin/busybox (apt-get install busybox-static)");
    vec![
        Entry::Dir("bin"),
        Entry::File("bin/busybox".into(), busybox, 0o755),
        Entry::Symlink("bin/sh", "busybox"),
        Entry::Symlink("bin/ls", "busybox"),
        Entry::Dir("etc"),
        Entry::File(
            "etc/berth-platform".into(),
            format!("{platform}\n").into_bytes(),
            0o644,
        ),
        Entry::Dir("tmp"),
    ]
}

/// What was pushed for one image manifest.
#[derive(Clone, Debug)]
pub struct Pushed {
    pub manifest_digest: String,
    pub manifest_size: u64,
    pub media_type: String,
    pub config_digest: String,
    pub layers: Vec<Blob>,
}

/// Pushes blobs and manifests over plain HTTP (optionally with a Basic login).
pub struct Uploader {
    pub base: String,
    agent: ureq::Agent,
    auth: Option<String>,
}

impl Uploader {
    pub fn new(host: &str, login: Option<(&str, &str)>) -> Self {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        Self {
            base: format!("http://{host}"),
            agent,
            auth: login.map(|(u, p)| {
                format!(
                    "Basic {}",
                    base64::engine::general_purpose::STANDARD.encode(format!("{u}:{p}"))
                )
            }),
        }
    }

    pub fn blob(&self, repo: &str, bytes: &[u8]) -> String {
        let digest = sha256(bytes);
        let mut post = self
            .agent
            .post(format!("{}/v2/{repo}/blobs/uploads/", self.base));
        if let Some(a) = &self.auth {
            post = post.header("Authorization", a);
        }
        let resp = post.send_empty().unwrap();
        assert_eq!(resp.status(), 202, "starting upload to {repo}");
        let location = resp.headers()["location"].to_str().unwrap().to_string();
        let url = if location.starts_with("http") {
            location
        } else {
            format!("{}{location}", self.base)
        };
        let sep = if url.contains('?') { '&' } else { '?' };
        let mut put = self
            .agent
            .put(format!("{url}{sep}digest={}", digest.replace(':', "%3A")))
            .header("Content-Type", "application/octet-stream");
        if let Some(a) = &self.auth {
            put = put.header("Authorization", a);
        }
        let resp = put.send(bytes).unwrap();
        assert_eq!(resp.status(), 201, "uploading blob {digest} to {repo}");
        digest
    }

    pub fn manifest(&self, repo: &str, reference: &str, media_type: &str, body: &[u8]) -> String {
        let mut put = self
            .agent
            .put(format!("{}/v2/{repo}/manifests/{reference}", self.base))
            .header("Content-Type", media_type);
        if let Some(a) = &self.auth {
            put = put.header("Authorization", a);
        }
        let mut resp = put.send(body).unwrap();
        let status = resp.status();
        let text = resp.body_mut().read_to_string().unwrap_or_default();
        assert_eq!(status, 201, "pushing manifest {repo}:{reference}: {text}");
        sha256(body)
    }

    /// Pushes one image: its layers, a config naming their diff_ids, and the manifest (OCI or
    /// Docker v2 schema 2 media types); tags it with `tag` if given.
    pub fn image(
        &self,
        repo: &str,
        tag: Option<&str>,
        arch: &str,
        layers: Vec<Blob>,
        docker: bool,
    ) -> Pushed {
        for l in &layers {
            self.blob(repo, &l.bytes);
        }
        let diff_ids: Vec<String> = layers
            .iter()
            .map(|l| format!("\"{}\"", l.diff_id))
            .collect();
        let config = format!(
            "{{\"architecture\":\"{arch}\",\"os\":\"linux\",\"config\":{{\"Env\":[\"PATH=/bin\",\
             \"BERTH_TEST=1\"],\"Cmd\":[\"/bin/sh\"],\"WorkingDir\":\"/tmp\"}},\
             \"rootfs\":{{\"type\":\"layers\",\"diff_ids\":[{}]}}}}",
            diff_ids.join(",")
        );
        let config_digest = self.blob(repo, config.as_bytes());
        let (manifest_type, config_type) = if docker {
            (DOCKER_MANIFEST, DOCKER_CONFIG)
        } else {
            (OCI_MANIFEST, OCI_CONFIG)
        };
        let layer_json: Vec<String> = layers
            .iter()
            .map(|l| {
                format!(
                    "{{\"mediaType\":\"{}\",\"digest\":\"{}\",\"size\":{}}}",
                    l.media_type,
                    l.digest,
                    l.bytes.len()
                )
            })
            .collect();
        let manifest = format!(
            "{{\"schemaVersion\":2,\"mediaType\":\"{manifest_type}\",\"config\":{{\"mediaType\":\
             \"{config_type}\",\"digest\":\"{config_digest}\",\"size\":{}}},\"layers\":[{}]}}",
            config.len(),
            layer_json.join(",")
        );
        let reference = tag
            .map(str::to_string)
            .unwrap_or_else(|| sha256(manifest.as_bytes()));
        let manifest_digest = self.manifest(repo, &reference, manifest_type, manifest.as_bytes());
        Pushed {
            manifest_digest,
            manifest_size: manifest.len() as u64,
            media_type: manifest_type.to_string(),
            config_digest,
            layers,
        }
    }

    /// Pushes an OCI index or Docker manifest list of already pushed images, each with its
    /// platform `(architecture, variant)`.
    pub fn index(
        &self,
        repo: &str,
        tag: &str,
        entries: &[(&Pushed, &str, Option<&str>)],
        docker: bool,
    ) -> String {
        let media_type = if docker { DOCKER_LIST } else { OCI_INDEX };
        let items: Vec<String> = entries
            .iter()
            .map(|(p, arch, variant)| {
                let variant = variant
                    .map(|v| format!(",\"variant\":\"{v}\""))
                    .unwrap_or_default();
                format!(
                    "{{\"mediaType\":\"{}\",\"digest\":\"{}\",\"size\":{},\"platform\":\
                     {{\"architecture\":\"{arch}\",\"os\":\"linux\"{variant}}}}}",
                    p.media_type, p.manifest_digest, p.manifest_size
                )
            })
            .collect();
        let body = format!(
            "{{\"schemaVersion\":2,\"mediaType\":\"{media_type}\",\"manifests\":[{}]}}",
            items.join(",")
        );
        self.manifest(repo, tag, media_type, body.as_bytes())
    }
}

/// The path of a blob in a registry's filesystem storage.
pub fn blob_data_path(storage: &Path, digest: &str) -> PathBuf {
    let hex = digest.strip_prefix("sha256:").unwrap();
    storage.join(format!(
        "docker/registry/v2/blobs/sha256/{}/{hex}/data",
        &hex[..2]
    ))
}

/// Deterministic pseudo-random bytes (xorshift): incompressible test data without a crate.
pub fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.extend_from_slice(&state.to_le_bytes());
    }
    out.truncate(len);
    out
}
