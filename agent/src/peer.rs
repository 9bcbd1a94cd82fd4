//! The node side of image pre-warm: `berth agent` serves the verified blobs its store keeps to
//! other nodes and takes pre-warm requests (on `peers.listen`); every berth process that
//! imports asks the cluster controller's catalog which nodes to fetch blobs from first
//! (`berth_image::peers` does the fetching and the verifying).
//!
//! What is served, on `peers.listen`, each request signed with the cluster key and each answer to
//! one proving this node holds it too (berth_api::auth, as for the controller; 401 without; the
//! proof of a blob answer covers its digest and Content-Length):
//! - `GET`/`HEAD /v2/<name>/blobs/sha256:<hex>`: a blob of the store's blob cache, whole or from
//!   `Range: bytes=N-`. `<name>` is ignored; the digest must be exactly `sha256:` and 64 lower
//!   case hex digits, and only then names a file (`blobs/sha256/<hex>`, opened without following
//!   links). The cache holds only blobs whose digest was checked before they were published, so
//!   nothing but verified image blobs can be read, and only by digest. While this node warms
//!   an image, a blob it is still downloading is served as it grows (`blobs/tmp/`, named by
//!   digest and size; the reader checks the digest, as for every source), and a blob it has not
//!   started yet is waited for (up to [`BLOB_WAIT`]): a pre-warm's children fetch through their
//!   parent at its pace instead of after it. At most
//!   `peers.max_uploads` transfers at once; more wait for a slot, up to 20 s, then get 503 (the
//!   client retries with backoff, then moves to its next source).
//! - `GET /v2/<name>/lazy/<chunk size>/sha256:<hex>` with `Range: bytes=A-B`: bytes of the
//!   lazy image chunk cache of index `<hex>` (`<store>/lazy/<hex>.data`, opened without following
//!   links), only when A and B+1 are on chunk bounds (or B the last byte) and its map marks
//!   every chunk they cover verified (404 otherwise; while a warm runs here, waited for up to
//!   [`CHUNK_WAIT`], as a blob is). The reader verifies each chunk against its own index.
//!   Counted among the `peers.max_uploads` transfers, as blobs are.
//! - `POST /v1/warm` ([`berth_api::WarmRequest`]): imports the reference into the store as
//!   root, fetching blobs from the named peers before the registry; answers when done. A
//!   `lazy:REF` fills the node's chunk cache of that lazy image instead
//!   (`berth_image::lazy::warm`), its chunks from the named peers first.
//!
//! Bounds, so that connections without the key (idle, or a byte every few seconds) cannot keep
//! keyed ones out: at most `peers.max_uploads` + [`EXTRA_CONNECTIONS`] connections, half of
//! them from one address; a connection is unauthenticated until its request head verified, and
//! one that is not after [`HEAD_DEADLINE`] is closed; when a cap is reached a new connection
//! closes the oldest unauthenticated one (none left: the new one is closed). A warm's body is
//! at most [`BODY_MAX`] bytes and read only once the head verified.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Seek, Write};
use std::net::{IpAddr, Shutdown, TcpListener, TcpStream};
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use berth_api::auth::{self, Key, ReplayCache};
use berth_api::{CatalogNode, WarmReply, WarmRequest};

use berth_config::Config;
use berth_image::Reference;
use berth_image::peers::{self, BlobCache};

use crate::AgentError;

/// The most bytes of a request head, and of a warm request's body.
const HEAD_MAX: usize = 16 * 1024;
const BODY_MAX: u64 = 64 * 1024;
/// Connections handled at once beyond the uploads (warm requests, refusals).
const EXTRA_CONNECTIONS: usize = 64;
/// How long a connection may take to send a request head that verifies.
const HEAD_DEADLINE: Duration = Duration::from_secs(5);
/// Peers an import asks before the registry, from the catalog.
const LOOKUP_PEERS: usize = 3;

/// The cluster key, when a controller is configured and this process may read the key file.
fn cluster_key(config: &Config) -> Option<Key> {
    if config.agent.controllers.is_empty() {
        return None;
    }
    crate::client::read_key(&config.agent.key_file)
        .ok()
        .map(|k| Key::new(&k))
}

/// Sets up this process's imports to use peers: ask the controller's catalog (when
/// `peers.lookup`), keep blobs for serving (when this node serves, `peers.listen`). Does nothing
/// where no controller is configured or the key is unreadable (not root): imports then go to
/// the registry as always.
pub fn install(config: &Config) {
    let Some(key) = cluster_key(config) else {
        return;
    };
    let serves = !config.peers.listen.is_empty();
    let lookup: Option<Box<peers::Lookup>> = config.peers.lookup.then(|| {
        let config = config.clone();
        let key = key.clone();
        Box::new(move |k: &str| lookup(&config, &key, k)) as Box<peers::Lookup>
    });
    peers::configure(
        key,
        serves.then_some(config.store.root.as_path()),
        config.peers.cache_bytes,
        lookup,
    );
}

/// GETs `path` from the controllers (following a follower to the leader once), all within
/// `timeout`: an import never waits longer for its peers than that.
fn ask_controllers(config: &Config, key: &Key, path: &str, timeout: Duration) -> Option<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    let get = |addr: &str| -> Option<(u16, Vec<u8>)> {
        let left = deadline.checked_duration_since(Instant::now())?;
        let agent = crate::client::agent(left);
        crate::client::call(&agent, key, addr, path, None, 16 << 20)
            .inspect_err(|e| tracing::warn!("the image catalog: {e}"))
            .ok()
    };
    for addr in &config.agent.controllers {
        match get(addr) {
            Some((200, body)) => return Some(body),
            Some((s, body)) if s == berth_api::NOT_LEADER_STATUS => {
                let leader = serde_json::from_slice::<berth_api::NotLeader>(&body)
                    .ok()
                    .and_then(|n| n.leader)?;
                if let Some((200, body)) = get(&leader) {
                    return Some(body);
                }
            }
            _ => {}
        }
    }
    None
}

/// Peers that hold the catalog key `key` (an image's canonical reference, a lazy image's
/// index) by the catalog, freshest first, this node left out.
fn lookup(config: &Config, cluster_key: &Key, key: &str) -> Vec<String> {
    let timeout = Duration::from_millis(config.peers.lookup_timeout_ms.max(100));
    let path = format!("/v1/catalog?ref={}", percent_encode(key));
    let Some(body) = ask_controllers(config, cluster_key, &path, timeout) else {
        tracing::debug!("no catalog from the controller: the registry only");
        return Vec::new();
    };
    let Ok(nodes) = serde_json::from_slice::<Vec<CatalogNode>>(&body) else {
        return Vec::new();
    };
    let me = advertise(config);
    choose(&nodes, key, me.as_deref())
}

/// Everything but unreserved URI characters as `%XX`.
fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// The holders of `key` that serve, freshest heartbeat first, without `me`.
fn choose(nodes: &[CatalogNode], key: &str, me: Option<&str>) -> Vec<String> {
    let mut holders: Vec<&CatalogNode> = nodes
        .iter()
        .filter(|n| n.refs.contains_key(key))
        .filter(|n| n.peer.is_some() && n.peer.as_deref() != me)
        .collect();
    holders.sort_by(|a, b| a.age_s.total_cmp(&b.age_s));
    holders
        .into_iter()
        .filter_map(|n| n.peer.clone())
        .take(LOOKUP_PEERS)
        .collect()
}

/// Where other nodes reach this one's blob server: `peers.advertise`, else `peers.listen` with
/// an unspecified host replaced by the host name; `None` when it serves nothing.
pub fn advertise(config: &Config) -> Option<String> {
    if config.peers.listen.is_empty() {
        return None;
    }
    if !config.peers.advertise.is_empty() {
        return Some(config.peers.advertise.clone());
    }
    let l = &config.peers.listen;
    match l.rsplit_once(':') {
        Some((host, port)) if host.is_empty() || host == "0.0.0.0" || host == "[::]" => {
            let h = nix::unistd::gethostname().ok()?;
            Some(format!("{}:{port}", h.to_string_lossy()))
        }
        _ => Some(l.clone()),
    }
}

/// The stored registry images for a heartbeat: canonical reference → manifest digest; and the
/// lazy images' chunk caches: `lazy:sha256:<index hex>` → `sha256:<index hex>`
/// (`berth_image::peers::lazy_key`), so that readers of the same index find this node.
pub fn refs(config: &Config) -> std::collections::BTreeMap<String, String> {
    let mut out = std::collections::BTreeMap::new();
    let lazy = config.store.root.join("lazy");
    *LAZY_DIR.lock().unwrap_or_else(|p| p.into_inner()) = Some((lazy.clone(), mtime(&lazy)));
    if !config.peers.listen.is_empty()
        && let Ok(rd) = std::fs::read_dir(&lazy)
    {
        for e in rd.flatten() {
            let name = e.file_name();
            let Some(hex) = name.to_str().and_then(|n| n.strip_suffix(".map")) else {
                continue;
            };
            let digest = format!("sha256:{hex}");
            if peers::digest_hex(&digest).is_some() && out.len() < 1000 {
                out.insert(peers::lazy_key(hex), digest);
            }
        }
    }
    if !config.store.root.join("refs").is_dir() {
        return out;
    }
    let Ok(store) = berth_image::store::Store::open(&config.store) else {
        return out;
    };
    for e in store.list() {
        for r in e.references.iter().filter(|r| r.starts_with("docker://")) {
            if out.len() < 1000 {
                out.insert(r.clone(), e.image.digest.clone());
            }
        }
    }
    out
}

/// Set when a warm changed the store: the next agent round gathers its inventory at once, so
/// the catalog learns of the image within a heartbeat.
static INVENTORY_DUE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The lazy chunk caches' directory and its modification time when the inventory was last
/// gathered: a new cache (a `berth run` of another lazy image here) changes it.
static LAZY_DIR: Mutex<Option<(std::path::PathBuf, Option<std::time::SystemTime>)>> =
    Mutex::new(None);

fn mtime(dir: &std::path::Path) -> Option<std::time::SystemTime> {
    std::fs::metadata(dir).and_then(|m| m.modified()).ok()
}

/// Whether the inventory should be gathered now (and clears the mark): a warm changed the
/// store, or a lazy chunk cache appeared, so the catalog learns of it within a heartbeat.
pub fn inventory_due() -> bool {
    let lazy_changed = LAZY_DIR
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
        .is_some_and(|(dir, seen)| mtime(dir) != *seen);
    INVENTORY_DUE.swap(false, Ordering::AcqRel) || lazy_changed
}

/// Counts transfers in progress. A transfer past the bound waits for a slot (in arrival order
/// of the wake-ups) for at most [`UPLOAD_WAIT`], so the transfers a node serves are queued, not
/// refused; only one that waited that long gets 503.
struct Uploads {
    now: Mutex<usize>,
    freed: std::sync::Condvar,
    max: usize,
}

/// How long a request for a blob this node does not hold waits for it while a warm runs here
/// (the warm may not have reached it yet). With [`UPLOAD_WAIT`] under the client's read timeout.
const BLOB_WAIT: Duration = Duration::from_secs(30);
/// A blob served as it downloads whose file has not grown for this long is given up: the
/// connection closes early and the reader resumes from its next source.
const STALL: Duration = Duration::from_secs(30);
/// How often a waiting request looks again.
const POLL: Duration = Duration::from_millis(50);
/// How long a request for lazy chunks this node does not hold waits for them while a warm
/// runs here: within the reader's bound on one peer (`berth_image::lazy::PEER_DEADLINE_S`).
const CHUNK_WAIT: Duration = Duration::from_secs(8);

/// How long a transfer waits for a slot before 503: well under the client's read timeout
/// (registry.read_timeout_s, 60 s by default), which runs while it waits for the headers.
const UPLOAD_WAIT: Duration = Duration::from_secs(20);

struct Slot<'a>(&'a Uploads);

impl Uploads {
    fn new(max: usize) -> Self {
        Self {
            now: Mutex::new(0),
            freed: std::sync::Condvar::new(),
            max: max.max(1),
        }
    }

    /// A slot, waiting up to `wait` for one; also returns how many transfers run with it.
    fn take(&self, wait: Duration) -> Option<(Slot<'_>, usize)> {
        let deadline = Instant::now() + wait;
        let mut now = self.now.lock().unwrap_or_else(|p| p.into_inner());
        while *now >= self.max {
            let left = deadline.checked_duration_since(Instant::now())?;
            now = self
                .freed
                .wait_timeout(now, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        *now += 1;
        Some((Slot(self), *now))
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        let mut now = self.0.now.lock().unwrap_or_else(|p| p.into_inner());
        *now = now.saturating_sub(1);
        self.0.freed.notify_one();
    }
}

struct Server {
    node: String,
    key: Key,
    /// Nonces of the requests verified within the clock skew window.
    seen: ReplayCache,
    cache: Option<BlobCache>,
    config: Config,
    uploads: Uploads,
    conns: Conns,
    /// One warm at a time: they share the node's disk and network.
    warming: Mutex<()>,
    /// Warms running or waiting here: requests for blobs not held yet wait while there are.
    warms: AtomicUsize,
}

/// A blob found for a request: kept (verified), or still downloading (to `tmp`).
enum Found {
    Kept(std::fs::File),
    Growing {
        file: std::fs::File,
        size: u64,
        tmp: std::path::PathBuf,
        kept: std::path::PathBuf,
    },
}

/// The answer to a transfer that waited [`UPLOAD_WAIT`] for a `peers.max_uploads` slot in vain.
fn busy(conn: &mut TcpStream, proof: Option<&Proof>) -> std::io::Result<()> {
    respond(
        conn,
        proof,
        "503 Service Unavailable",
        "Retry-After: 1\r\n",
        b"serving as many transfers as peers.max_uploads allows, for too long\n",
    )
}

/// Opens `path` for reading without following a link.
fn open_nofollow(path: &std::path::Path) -> Option<std::fs::File> {
    std::fs::File::options()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .ok()
}

/// Starts the blob server and warm endpoint on `peers.listen` (nothing when it is "").
pub fn serve(config: &Config, node: &str) -> Result<(), AgentError> {
    if config.peers.listen.is_empty() {
        return Ok(());
    }
    let key = cluster_key(config).ok_or_else(|| {
        AgentError::input(format!(
            "peers.listen is set but the cluster key {} cannot be read",
            config.agent.key_file.display()
        ))
    })?;
    let listener = TcpListener::bind(&config.peers.listen).map_err(|e| {
        AgentError::host(format!(
            "listening on {} for peers: {e}; set peers.listen (\"\": serve none)",
            config.peers.listen
        ))
    })?;
    let max = config.peers.max_uploads.max(1) + EXTRA_CONNECTIONS;
    let server = Arc::new(Server {
        node: node.to_string(),
        key,
        seen: ReplayCache::default(),
        cache: BlobCache::open(&config.store.root, config.peers.cache_bytes.max(1)),
        config: config.clone(),
        uploads: Uploads::new(config.peers.max_uploads),
        conns: Conns::new(max, max / 2),
        warming: Mutex::new(()),
        warms: AtomicUsize::new(0),
    });
    let reaper = server.clone();
    std::thread::spawn(move || {
        loop {
            std::thread::sleep(Duration::from_millis(250));
            reaper.conns.close_late(HEAD_DEADLINE);
        }
    });
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let conn = match conn {
                Ok(c) => c,
                Err(e) => {
                    // EMFILE and the like: wait for descriptors to free up, do not spin.
                    tracing::warn!("peers: accepting a connection: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            let s = server.clone();
            let Some((id, authenticated)) = s.conns.admit(&conn) else {
                continue;
            };
            std::thread::spawn(move || {
                if let Err(e) = s.handle(conn, &authenticated) {
                    tracing::debug!("peer connection: {e}");
                }
                s.conns.remove(id);
            });
        }
    });
    Ok(())
}

/// One open connection: where from, since when, whether its request verified, and a handle to
/// close it with.
struct Open {
    ip: IpAddr,
    since: Instant,
    authenticated: Arc<AtomicBool>,
    stream: TcpStream,
}

/// The open connections, by arrival (the first unauthenticated one is the oldest).
struct Conns {
    open: Mutex<BTreeMap<u64, Open>>,
    next: AtomicU64,
    max: usize,
    per_address: usize,
}

impl Conns {
    fn new(max: usize, per_address: usize) -> Self {
        Self {
            open: Mutex::new(BTreeMap::new()),
            next: AtomicU64::new(0),
            max: max.max(1),
            per_address: per_address.max(1),
        }
    }

    /// Registers `conn`, closing the oldest unauthenticated connection (of its address, for
    /// the per-address cap) when a cap is reached; `None` when there is no room for it.
    fn admit(&self, conn: &TcpStream) -> Option<(u64, Arc<AtomicBool>)> {
        let ip = conn.peer_addr().ok()?.ip();
        let stream = conn.try_clone().ok()?;
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let from_ip = open.values().filter(|o| o.ip == ip).count();
        if from_ip >= self.per_address && !Self::evict(&mut open, Some(ip)) {
            return None;
        }
        if open.len() >= self.max && !Self::evict(&mut open, None) {
            return None;
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let authenticated = Arc::new(AtomicBool::new(false));
        open.insert(
            id,
            Open {
                ip,
                since: Instant::now(),
                authenticated: authenticated.clone(),
                stream,
            },
        );
        Some((id, authenticated))
    }

    fn evict(open: &mut BTreeMap<u64, Open>, ip: Option<IpAddr>) -> bool {
        let victim = open
            .iter()
            .find(|(_, o)| {
                !o.authenticated.load(Ordering::Acquire) && ip.is_none_or(|ip| o.ip == ip)
            })
            .map(|(id, _)| *id);
        match victim.and_then(|id| open.remove(&id)) {
            Some(o) => {
                // Its thread's read returns at once; the thread then ends and frees its place.
                let _ = o.stream.shutdown(Shutdown::Both);
                true
            }
            None => false,
        }
    }

    /// Closes the connections that sent no verified request head within `deadline`.
    fn close_late(&self, deadline: Duration) {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        open.retain(|_, o| {
            let late = !o.authenticated.load(Ordering::Acquire) && o.since.elapsed() >= deadline;
            if late {
                let _ = o.stream.shutdown(Shutdown::Both);
            }
            !late
        });
    }

    fn remove(&self, id: u64) {
        self.open
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
    }
}

/// How an answer to a verified request proves this node holds the key.
struct Proof<'a> {
    key: &'a Key,
    nonce: &'a str,
    /// For a blob path: the digest, and the proof covers it and the Content-Length.
    digest: Option<&'a str>,
}

impl Proof<'_> {
    fn header(&self, status: &str, body_len: u64, body: &[u8]) -> String {
        let code = status
            .split(' ')
            .next()
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let tag = match self.digest {
            Some(d) => auth::blob_tag(d, body_len),
            None => auth::body_tag(body),
        };
        format!(
            "{}: {}\r\n",
            auth::PROOF_HEADER,
            auth::sign_answer(self.key, self.nonce, code, &tag)
        )
    }
}

/// A parsed request head.
#[derive(Debug, Default, PartialEq)]
struct Head {
    method: String,
    path: String,
    auth: Option<String>,
    range_from: Option<u64>,
    /// The last byte of a `bytes=A-B` range (lazy chunks only).
    range_to: Option<u64>,
    content_length: u64,
}

fn parse_head(text: &str) -> Option<Head> {
    let mut lines = text.split("\r\n");
    let mut first = lines.next()?.split(' ');
    let mut h = Head {
        method: first.next()?.to_string(),
        path: first.next()?.to_string(),
        ..Head::default()
    };
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        match name.trim().to_ascii_lowercase().as_str() {
            auth::AUTH_HEADER => h.auth = Some(value.to_string()),
            "content-length" => h.content_length = value.parse().ok()?,
            "range" => {
                // Only what the registry client sends: `bytes=N-` (blobs), `bytes=A-B` (lazy
                // chunks), one range.
                let (from, to) = value.strip_prefix("bytes=")?.split_once('-')?;
                h.range_from = Some(from.parse().ok()?);
                if !to.is_empty() {
                    let to: u64 = to.parse().ok()?;
                    if to < h.range_from? {
                        return None;
                    }
                    h.range_to = Some(to);
                }
            }
            _ => {}
        }
    }
    Some(h)
}

/// The digest a blob path names: `/v2/<name>/blobs/<digest>`, `<name>` not empty.
fn blob_digest(path: &str) -> Option<&str> {
    let rest = path.strip_prefix("/v2/")?;
    let (name, digest) = rest.rsplit_once("/blobs/")?;
    (!name.is_empty() && peers::digest_hex(digest).is_some()).then_some(digest)
}

/// The chunk size and index digest a lazy chunk path names:
/// `/v2/<name>/lazy/<chunk size>/sha256:<hex>`, `<name>` not empty, the size in 4 KiB..64 MiB.
fn lazy_target(path: &str) -> Option<(u64, &str)> {
    let rest = path.strip_prefix("/v2/")?;
    let (name, tail) = rest.rsplit_once("/lazy/")?;
    let (size, digest) = tail.split_once('/')?;
    let size: u64 = size.parse().ok()?;
    (!name.is_empty() && (4096..=64 << 20).contains(&size) && peers::digest_hex(digest).is_some())
        .then_some((size, digest))
}

/// The chunks `first..=last` that bytes `from..=to` of a lazy chunk cache are, when the cache
/// (`size` bytes, `marks` chunks) is of `chunk`-byte chunks and both ends are on chunk bounds
/// (or the end of the file): a reader asks only for whole chunks, which it can verify.
fn chunk_span(size: u64, marks: u64, chunk: u64, from: u64, to: u64) -> Option<(u64, u64)> {
    let on_bound = |b: u64| b.is_multiple_of(chunk) || b == size;
    (chunk > 0
        && marks == size.div_ceil(chunk)
        && from <= to
        && to < size
        && on_bound(from)
        && on_bound(to + 1))
    .then(|| (from / chunk, to / chunk))
}

/// Writes a whole answer; with `proof` (the request verified), signed.
fn respond(
    conn: &mut TcpStream,
    proof: Option<&Proof>,
    status: &str,
    headers: &str,
    body: &[u8],
) -> std::io::Result<()> {
    let proof = proof.map_or(String::new(), |p| p.header(status, body.len() as u64, body));
    write!(
        conn,
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\n{headers}{proof}Connection: close\r\n\r\n",
        body.len()
    )?;
    conn.write_all(body)
}

impl Server {
    fn handle(&self, mut conn: TcpStream, authenticated: &AtomicBool) -> std::io::Result<()> {
        conn.set_read_timeout(Some(Duration::from_secs(10)))?;
        conn.set_write_timeout(Some(Duration::from_secs(60)))?;
        let mut reader = BufReader::new(conn.try_clone()?);
        let mut head = String::new();
        while !head.ends_with("\r\n\r\n") {
            let n = (&mut reader)
                .take((HEAD_MAX - head.len()) as u64)
                .read_line(&mut head)?;
            if n == 0 || head.len() >= HEAD_MAX {
                return respond(&mut conn, None, "400 Bad Request", "", b"bad request\n");
            }
        }
        let Some(h) = parse_head(&head) else {
            return respond(&mut conn, None, "400 Bad Request", "", b"bad request\n");
        };
        let verified = match auth::verify_request(
            &self.key,
            h.auth.as_deref(),
            &h.method,
            &h.path,
            auth::now(),
            &self.seen,
        ) {
            Ok(v) => v,
            Err(e) => {
                let said = format!("{e}\n");
                return respond(&mut conn, None, "401 Unauthorized", "", said.as_bytes());
            }
        };
        authenticated.store(true, Ordering::Release);
        let lazy = lazy_target(&h.path);
        let digest = blob_digest(&h.path).or(lazy.map(|(_, d)| d));
        let proof = Proof {
            key: &self.key,
            nonce: &verified.nonce,
            digest,
        };
        let proof = Some(&proof);
        match (h.method.as_str(), digest, lazy) {
            ("GET", Some(digest), Some((chunk, _))) => {
                self.chunks(&mut conn, proof, &h, chunk, digest)
            }
            ("GET" | "HEAD", Some(_), None) if h.range_to.is_some() => {
                respond(&mut conn, proof, "400 Bad Request", "", b"bad range\n")
            }
            ("GET" | "HEAD", Some(digest), None) => self.blob(&mut conn, proof, &h, digest),
            ("POST", None, _) if h.path == "/v1/warm" => {
                if h.content_length > BODY_MAX {
                    return respond(
                        &mut conn,
                        proof,
                        "413 Payload Too Large",
                        "",
                        b"too large\n",
                    );
                }
                let mut body = Vec::new();
                (&mut reader)
                    .take(h.content_length)
                    .read_to_end(&mut body)?;
                if let Err(e) = verified.check_body(&body) {
                    let said = format!("{e}\n");
                    return respond(&mut conn, proof, "401 Unauthorized", "", said.as_bytes());
                }
                let reply = match serde_json::from_slice::<WarmRequest>(&body) {
                    Ok(req) => self.warm(req),
                    Err(e) => WarmReply {
                        node: self.node.clone(),
                        digest: None,
                        error: Some(format!("the warm request does not parse: {e}")),
                        seconds: 0.0,
                    },
                };
                let json = serde_json::to_vec(&reply).expect("serializes");
                respond(
                    &mut conn,
                    proof,
                    "200 OK",
                    "Content-Type: application/json\r\n",
                    &json,
                )
            }
            _ => respond(&mut conn, proof, "404 Not Found", "", b"not found\n"),
        }
    }

    /// The blob `digest`: kept, else downloading here, else (while a warm runs here) waited
    /// for up to [`BLOB_WAIT`].
    fn find(&self, digest: &str) -> Option<Found> {
        let cache = self.cache.as_ref()?;
        let kept = cache.path(digest)?;
        let deadline = Instant::now() + BLOB_WAIT;
        loop {
            if let Some(file) = open_nofollow(&kept) {
                return Some(Found::Kept(file));
            }
            if let Some((tmp, size)) = cache.in_progress(digest)
                && let Some(file) = open_nofollow(&tmp)
            {
                return Some(Found::Growing {
                    file,
                    size,
                    tmp,
                    kept,
                });
            }
            if self.warms.load(Ordering::Acquire) == 0 || Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(POLL);
        }
    }

    fn blob(
        &self,
        conn: &mut TcpStream,
        proof: Option<&Proof>,
        h: &Head,
        digest: &str,
    ) -> std::io::Result<()> {
        let Some(found) = self.find(digest) else {
            return respond(conn, proof, "404 Not Found", "", b"no such blob\n");
        };
        let size = match &found {
            Found::Kept(file) => file.metadata()?.len(),
            Found::Growing { size, .. } => *size,
        };
        let signed =
            |status: &str, len: u64| proof.map_or(String::new(), |p| p.header(status, len, b""));
        if h.method == "HEAD" {
            let proof = signed("200 OK", size);
            return write!(
                conn,
                "HTTP/1.1 200 OK\r\nContent-Length: {size}\r\nDocker-Content-Digest: {digest}\r\n\
                 Content-Type: application/octet-stream\r\n{proof}Connection: close\r\n\r\n"
            );
        }
        let Some((_slot, running)) = self.uploads.take(UPLOAD_WAIT) else {
            return busy(conn, proof);
        };
        tracing::debug!("serving {digest} ({running} transfers)");
        let from = h.range_from.unwrap_or(0).min(size);
        let (status, range) = if h.range_from.is_some() {
            (
                "206 Partial Content",
                format!(
                    "Content-Range: bytes {from}-{}/{size}\r\n",
                    size.saturating_sub(1)
                ),
            )
        } else {
            ("200 OK", String::new())
        };
        let proof = signed(status, size - from);
        write!(
            conn,
            "HTTP/1.1 {status}\r\nContent-Length: {}\r\n{range}Docker-Content-Digest: {digest}\r\n\
             Content-Type: application/octet-stream\r\n{proof}Connection: close\r\n\r\n",
            size - from
        )?;
        match found {
            Found::Kept(mut file) => {
                file.seek(std::io::SeekFrom::Start(from))?;
                std::io::copy(&mut file.take(size - from), conn)?;
                Ok(())
            }
            Found::Growing {
                file,
                size,
                tmp,
                kept,
            } => follow(file, from, size, &tmp, &kept, conn),
        }
    }

    /// Bytes of the lazy chunk cache of index `digest` (chunks of `chunk` bytes): see the
    /// module header. The map's mark of a chunk is written after its bytes, so a marked chunk
    /// is whole in the data file.
    fn chunks(
        &self,
        conn: &mut TcpStream,
        proof: Option<&Proof>,
        h: &Head,
        chunk: u64,
        digest: &str,
    ) -> std::io::Result<()> {
        let not_held =
            |conn: &mut TcpStream| respond(conn, proof, "404 Not Found", "", b"no such chunks\n");
        let (Some(from), Some(to), Some(hex)) =
            (h.range_from, h.range_to, peers::digest_hex(digest))
        else {
            return respond(
                conn,
                proof,
                "400 Bad Request",
                "",
                b"give Range: bytes=A-B\n",
            );
        };
        let dir = self.config.store.root.join("lazy");
        let (data_name, map_name) = berth_image::lazy::cache_names(hex);
        let (Some(mut data), Some(map)) = (
            open_nofollow(&dir.join(data_name)),
            open_nofollow(&dir.join(map_name)),
        ) else {
            return not_held(conn);
        };
        let size = data.metadata()?.len();
        let marks = map.metadata()?.len();
        let Some((first, last)) = chunk_span(size, marks, chunk, from, to) else {
            return not_held(conn);
        };
        let mut mark = vec![0u8; usize::try_from(last - first + 1).unwrap_or(0)];
        let deadline = Instant::now() + CHUNK_WAIT;
        loop {
            use std::os::unix::fs::FileExt;
            map.read_exact_at(&mut mark, first)?;
            if mark.iter().all(|m| *m == 1) {
                break;
            }
            if self.warms.load(Ordering::Acquire) == 0 || Instant::now() >= deadline {
                return not_held(conn);
            }
            std::thread::sleep(POLL);
        }
        let Some((_slot, running)) = self.uploads.take(UPLOAD_WAIT) else {
            return busy(conn, proof);
        };
        tracing::debug!(
            "serving chunks {first}-{last} of lazy index {digest} ({running} transfers)"
        );
        let len = to - from + 1;
        let status = "206 Partial Content";
        let proof = proof.map_or(String::new(), |p| p.header(status, len, b""));
        write!(
            conn,
            "HTTP/1.1 {status}\r\nContent-Length: {len}\r\nContent-Range: bytes {from}-{to}/{size}\r\n\
             Content-Type: application/octet-stream\r\n{proof}Connection: close\r\n\r\n"
        )?;
        data.seek(std::io::SeekFrom::Start(from))?;
        std::io::copy(&mut (&mut data).take(len), conn)?;
        Ok(())
    }

    fn warm(&self, req: WarmRequest) -> WarmReply {
        /// Counts the warm out however it ends (a panic in an import included).
        struct Counted<'a>(&'a AtomicUsize);
        impl Drop for Counted<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::AcqRel);
            }
        }
        self.warms.fetch_add(1, Ordering::AcqRel);
        let _counted = Counted(&self.warms);
        self.warm_one(req)
    }

    /// Fills this node's chunk cache of the lazy image `reference`, from `peers` first; returns
    /// its index digest.
    fn warm_lazy(&self, reference: &str, peers: Vec<String>) -> Result<String, AgentError> {
        let Reference::Registry(r) = berth_image::reference::parse(reference)? else {
            return Err(AgentError::input(format!(
                "lazy:{reference}: a lazy image is a registry image"
            )));
        };
        let user = berth_sys::user::current().map_err(|e| AgentError::host(e.to_string()))?;
        let w = peers::with_peers(peers, || {
            berth_image::lazy::warm(&r, &self.config.image(), user.uid, user.home.as_deref())
        })?;
        tracing::info!(
            "lazy image {reference} (index {}): {} bytes, {} from the registry, {} from peers",
            w.index_digest,
            w.size,
            w.from_registry,
            w.from_peers
        );
        Ok(w.index_digest)
    }

    fn warm_one(&self, req: WarmRequest) -> WarmReply {
        let _one = self.warming.lock().unwrap_or_else(|p| p.into_inner());
        let started = Instant::now();
        let result = (|| -> Result<String, AgentError> {
            let peers: Vec<String> = req
                .peers
                .iter()
                .filter(|p| Some(p.as_str()) != advertise(&self.config).as_deref())
                .cloned()
                .collect();
            if let Some(rest) = req.reference.strip_prefix("lazy:") {
                return self.warm_lazy(rest, peers);
            }
            let reference = berth_image::reference::parse(&req.reference)?;
            if !matches!(reference, Reference::Registry(_)) {
                return Err(AgentError::input(format!(
                    "{}: only registry images are pre-warmed",
                    req.reference
                )));
            }
            let store = berth_image::store::Store::open(&self.config.store)?;
            let user = berth_sys::user::current().map_err(|e| AgentError::host(e.to_string()))?;
            let who = berth_image::import::Requester {
                uid: user.uid,
                home: user.home.as_deref(),
                arch: None,
            };
            let image = peers::with_peers(peers, || {
                berth_image::import::import(
                    &store,
                    &reference,
                    &self.config.image(),
                    &who,
                    &berth_image::store::quiet,
                )
            })?;
            Ok(image.digest)
        })();
        let seconds = started.elapsed().as_secs_f64();
        match result {
            Ok(digest) => {
                INVENTORY_DUE.store(true, Ordering::Release);
                tracing::info!("warmed {} ({digest}) in {seconds:.1} s", req.reference);
                WarmReply {
                    node: self.node.clone(),
                    digest: Some(digest),
                    error: None,
                    seconds,
                }
            }
            Err(e) => {
                tracing::warn!("warming {}: {e}", req.reference);
                WarmReply {
                    node: self.node.clone(),
                    digest: None,
                    error: Some(e.to_string()),
                    seconds,
                }
            }
        }
    }
}

/// Sends bytes `from..size` of a blob still being written to `tmp` as they arrive. Ends early
/// (an error: the connection closes short of Content-Length, and the reader resumes from its
/// next source) when the writer gave up: `tmp` gone without the blob kept at `kept`, or no
/// growth for [`STALL`]. A renamed (kept) file is read to its end through the same descriptor.
fn follow(
    mut file: std::fs::File,
    from: u64,
    size: u64,
    tmp: &std::path::Path,
    kept: &std::path::Path,
    conn: &mut impl Write,
) -> std::io::Result<()> {
    let mut pos = from;
    let mut buf = vec![0u8; 256 * 1024];
    let mut grew = Instant::now();
    file.seek(std::io::SeekFrom::Start(pos))?;
    while pos < size {
        let want = usize::try_from(size - pos)
            .unwrap_or(usize::MAX)
            .min(buf.len());
        let n = file.read(&mut buf[..want])?;
        if n > 0 {
            conn.write_all(&buf[..n])?;
            pos += n as u64;
            grew = Instant::now();
            continue;
        }
        let writing = tmp.exists();
        if !writing && !kept.exists() {
            return Err(std::io::Error::other(
                "the download being served was given up",
            ));
        }
        if writing && grew.elapsed() >= STALL {
            return Err(std::io::Error::other("the download being served stalled"));
        }
        if !writing {
            // Kept (renamed) after the read above found nothing: the bytes are all in the file.
            let n = file.read(&mut buf[..want])?;
            if n == 0 {
                return Err(std::io::Error::other(
                    "the kept blob is shorter than its size",
                ));
            }
            conn.write_all(&buf[..n])?;
            pos += n as u64;
            continue;
        }
        std::thread::sleep(POLL);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_blob_paths_with_exact_digests_are_served() {
        let hex = "ab".repeat(32);
        let ok = format!("/v2/library/busybox/blobs/sha256:{hex}");
        assert_eq!(blob_digest(&ok), Some(format!("sha256:{hex}").as_str()));
        for bad in [
            format!("/v2//blobs/sha256:{hex}"),
            format!("/v2/x/blobs/sha256:{hex}/../../etc"),
            "/v2/x/blobs/sha256:../../../etc/shadow".to_string(),
            format!("/v2/x/manifests/sha256:{hex}"),
            format!("/etc/blobs/sha256:{hex}"),
            format!("/v2/x/blobs/sha256:{}", hex.to_uppercase()),
        ] {
            assert_eq!(blob_digest(&bad), None, "{bad}");
        }
    }

    #[test]
    fn only_lazy_paths_with_exact_digests_and_sane_chunk_sizes_are_served() {
        let hex = "cd".repeat(32);
        let d = format!("sha256:{hex}");
        assert_eq!(
            lazy_target(&format!("/v2/t/lazy/lazy/1048576/{d}")),
            Some((1 << 20, d.as_str()))
        );
        for bad in [
            format!("/v2//lazy/1048576/{d}"),
            format!("/v2/t/lazy/1048576/{d}/x"),
            format!("/v2/t/lazy/100/{d}"),
            format!("/v2/t/lazy/{}/{d}", 128u64 << 20),
            "/v2/t/lazy/1048576/sha256:../../../etc/shadow".to_string(),
            format!("/v2/t/blobs/{d}"),
        ] {
            assert_eq!(lazy_target(&bad), None, "{bad}");
        }
    }

    #[test]
    fn heartbeats_name_the_lazy_chunk_caches_and_a_new_one_makes_the_inventory_due() {
        let d = tempfile::tempdir().unwrap();
        let mut config = Config::default();
        config.store.root = d.path().to_path_buf();
        config.peers.listen = "127.0.0.1:1".into();
        let lazy = d.path().join("lazy");
        std::fs::create_dir(&lazy).unwrap();
        let hex = "ef".repeat(32);
        for name in [
            format!("{hex}.map"),
            format!("{hex}.data"),
            "x.map".to_string(),
            format!("{hex}.map.tmp-1-2"),
        ] {
            std::fs::write(lazy.join(name), b"").unwrap();
        }
        let refs = refs(&config);
        assert_eq!(
            refs.into_iter().collect::<Vec<_>>(),
            vec![(peers::lazy_key(&hex), format!("sha256:{hex}"))]
        );
        inventory_due();
        assert!(!inventory_due());
        // A cache made since (its directory changed): the next round gathers again.
        std::thread::sleep(Duration::from_millis(20));
        std::fs::write(lazy.join(format!("{}.map", "01".repeat(32))), b"").unwrap();
        assert!(inventory_due());
        // A node that serves no peers advertises none.
        config.peers.listen.clear();
        assert!(super::refs(&config).is_empty());
    }

    #[test]
    fn only_whole_chunks_of_a_cache_of_that_chunk_size_are_served() {
        let c = 4096;
        // 3 chunks, the last short.
        let size = 2 * c + 100;
        assert_eq!(chunk_span(size, 3, c, 0, c - 1), Some((0, 0)));
        assert_eq!(chunk_span(size, 3, c, c, size - 1), Some((1, 2)));
        assert_eq!(chunk_span(size, 3, c, 0, size - 1), Some((0, 2)));
        for (marks, chunk, from, to) in [
            (3, c, 1, c - 1),         // not from a chunk's start
            (3, c, 0, c),             // into the next chunk
            (3, c, 0, size),          // past the end
            (4, c, 0, c - 1),         // a map of another chunk count
            (3, 2 * c, 0, 2 * c - 1), // another chunk size than the cache's
            (3, c, c, c - 1),         // backwards
        ] {
            assert_eq!(
                chunk_span(size, marks, chunk, from, to),
                None,
                "{marks} {chunk} {from}-{to}"
            );
        }
    }

    #[test]
    fn request_heads_parse_and_odd_ranges_are_refused() {
        let h = parse_head(
            "GET /v2/a/blobs/x HTTP/1.1\r\nX-Berth-Auth: v1 ts=1\r\nRange: bytes=10-\r\n\r\n",
        )
        .unwrap();
        assert_eq!(h.method, "GET");
        assert_eq!(h.auth.as_deref(), Some("v1 ts=1"));
        assert_eq!((h.range_from, h.range_to), (Some(10), None));
        let h = parse_head("GET /x HTTP/1.1\r\nRange: bytes=1-5\r\n\r\n").unwrap();
        assert_eq!((h.range_from, h.range_to), (Some(1), Some(5)));
        for bad in ["bytes=5-1", "bytes=1-5,7-9", "bytes=-5", "items=1-5"] {
            let head = format!("GET /x HTTP/1.1\r\nRange: {bad}\r\n\r\n");
            assert!(parse_head(&head).is_none(), "{bad}");
        }
        assert!(parse_head("GET /x HTTP/1.1\r\nContent-Length: many\r\n\r\n").is_none());
    }

    #[test]
    fn lookup_takes_serving_holders_freshest_first_without_this_node() {
        let n = |node: &str, peer: Option<&str>, has: bool, age: f64| CatalogNode {
            node: node.into(),
            peer: peer.map(str::to_string),
            refs: if has {
                [("docker://r/a:1".to_string(), "sha256:x".to_string())].into()
            } else {
                Default::default()
            },
            age_s: age,
        };
        let nodes = vec![
            n("a", Some("a:1"), true, 9.0),
            n("b", Some("b:1"), true, 1.0),
            n("c", None, true, 0.5),
            n("d", Some("d:1"), false, 0.1),
            n("e", Some("e:1"), true, 0.2),
        ];
        assert_eq!(
            choose(&nodes, "docker://r/a:1", Some("e:1")),
            vec!["b:1".to_string(), "a:1".to_string()]
        );
    }

    #[test]
    fn a_blob_still_downloading_is_sent_as_it_grows_and_cut_short_when_given_up() {
        let d = tempfile::tempdir().unwrap();
        let (tmp, kept) = (d.path().join("tmp"), d.path().join("kept"));
        std::fs::write(&tmp, b"0123").unwrap();
        let writer = {
            let (tmp, kept) = (tmp.clone(), kept.clone());
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(200));
                let mut f = std::fs::OpenOptions::new().append(true).open(&tmp).unwrap();
                f.write_all(b"4567").unwrap();
                std::thread::sleep(Duration::from_millis(200));
                f.write_all(b"89").unwrap();
                std::fs::rename(&tmp, &kept).unwrap();
            })
        };
        let mut out = Vec::new();
        let file = std::fs::File::open(&tmp).unwrap();
        follow(file, 2, 10, &tmp, &kept, &mut out).unwrap();
        writer.join().unwrap();
        assert_eq!(out, b"23456789", "from byte 2, all that came, to the size");
        // The writer gave up (its workspace removed, nothing kept): the stream ends short.
        std::fs::write(&tmp, b"abc").unwrap();
        let file = std::fs::File::open(&tmp).unwrap();
        std::fs::remove_file(&tmp).unwrap();
        let mut out = Vec::new();
        let e = follow(file, 0, 10, &tmp, &d.path().join("none"), &mut out).unwrap_err();
        assert!(e.to_string().contains("given up"), "{e}");
        assert_eq!(out, b"abc");
    }

    #[test]
    fn uploads_are_bounded_and_the_next_waits_for_a_slot() {
        let u = Arc::new(Uploads::new(2));
        let a = u.take(Duration::ZERO).unwrap();
        let _b = u.take(Duration::ZERO).unwrap();
        assert!(u.take(Duration::from_millis(20)).is_none());
        let u2 = u.clone();
        let waiter = std::thread::spawn(move || u2.take(Duration::from_secs(30)).map(|s| s.1));
        std::thread::sleep(Duration::from_millis(50));
        drop(a);
        assert_eq!(waiter.join().unwrap(), Some(2));
    }
}
