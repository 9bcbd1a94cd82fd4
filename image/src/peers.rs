//! Other nodes as blob sources for registry pulls, and the store's cache of compressed blobs that
//! lets this node be one.
//!
//! A peer is a berth agent that serves the blobs it keeps over the OCI distribution blob API
//! subset (`GET`/`HEAD /v2/<name>/blobs/<digest>`, `berth_agent::peer`). To the registry client a
//! peer is one more mirror, asked for blobs only: the manifest still comes from the registry
//! (it says what a tag means now), then the config and layers are asked of each peer in turn and
//! of the registry last. The client checks every blob's sha256 against the manifest's digest, as
//! it does for a registry, so a peer that serves a wrong byte is refused and the next source is
//! used; a peer that dies mid-transfer is the same as a mirror that does. Requests to a peer are
//! signed with the cluster key and its answers must prove it holds the key too
//! (berth_api::auth): a process that took a departed agent's port is refused the same way.
//!
//! The cache: `<store root>/blobs/sha256/<hex>`, each blob written beside the download (tee of
//! the stream) into `blobs/tmp/<pid>.<seq>.<hex>.<size>` and renamed into place only after the
//! blob's digest matched. Bounded by `peers.cache_bytes`: the oldest (by last write or serve)
//! go first. Root-only directories, like the rest of the store. A blob still downloading can be
//! served as it grows ([`BlobCache::in_progress`]): a pre-warm's child then fetches through its
//! parent at the parent's pace instead of waiting for the whole blob. Those bytes are not yet
//! verified by the server, and need not be: the receiving client checks every blob's digest
//! whoever serves it, and a blob the server's own check refuses is never committed (its
//! readers see the stream end early, and resume from another source).
//!
//! Which peers to ask: [`configure`] installs a lookup (the cluster controller's catalog, see
//! `berth_agent::peer`) used by every registry import of the process, and [`with_peers`] names
//! them explicitly for one import (a pre-warm's planned parent).
//!
//! Lazy images (`crate::lazy`) use the same peers for their chunks: a node advertises each chunk
//! cache it holds under [`lazy_key`] of its index, [`lazy_peers_for`] finds the holders, and the
//! agent serves the chunks its cache's map marks verified. The reader verifies every chunk
//! against its own index, as it verifies a blob against its digest.

use std::cell::RefCell;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest as _, Sha256};

use super::RegistryRef;

/// Finds peers that hold a catalog key (a registry image's canonical reference, or a lazy
/// image's [`lazy_key`]): `host:port` addresses, best first.
pub type Lookup = dyn Fn(&str) -> Vec<String> + Send + Sync;

/// How this process uses peers, set once by [`configure`].
struct Settings {
    /// The cluster key requests to peers are signed with (never sent).
    key: berth_api::auth::Key,
    /// Where the node keeps verified compressed blobs for peers; `None`: keeps none.
    cache: Option<(PathBuf, u64)>,
    lookup: Option<Box<Lookup>>,
}

static SETTINGS: OnceLock<Settings> = OnceLock::new();

thread_local! {
    /// Peers named for the imports this thread runs ([`with_peers`]), instead of the lookup.
    static NAMED: RefCell<Option<Vec<String>>> = const { RefCell::new(None) };
}

/// Sets, once per process, the cluster key requests to peers are signed with, whether registry
/// imports keep their blobs in `store_root`'s cache (`cache_bytes` > 0) and how to find peers.
/// Later calls change nothing.
pub fn configure(
    key: berth_api::auth::Key,
    store_root: Option<&Path>,
    cache_bytes: u64,
    lookup: Option<Box<Lookup>>,
) {
    let _ = SETTINGS.set(Settings {
        key,
        cache: store_root
            .filter(|_| cache_bytes > 0)
            .map(|r| (r.to_path_buf(), cache_bytes)),
        lookup,
    });
}

/// Runs `f` (an import) with `peers` as the blob sources tried before the registry.
pub fn with_peers<T>(peers: Vec<String>, f: impl FnOnce() -> T) -> T {
    let before = NAMED.with(|n| n.replace(Some(peers)));
    let out = f();
    NAMED.with(|n| *n.borrow_mut() = before);
    out
}

/// The peers to ask for `r`'s blobs and the key to sign requests to them with; none when peers
/// are not set up.
pub fn peers_for(r: &RegistryRef) -> Option<(Vec<String>, berth_api::auth::Key)> {
    peers_for_key(&crate::reference::reference_key(
        &crate::Reference::Registry(r.clone()),
    ))
    .filter(|(p, _)| !p.is_empty())
}

/// The catalog key under which a node advertises the chunk cache of the lazy image whose index
/// blob's sha256 is `index_hex`.
pub fn lazy_key(index_hex: &str) -> String {
    format!("lazy:sha256:{index_hex}")
}

/// The peers to ask for chunks of the lazy image whose index's sha256 is `index_hex` (maybe
/// none yet), with the key; `None` when peers are not set up. Named peers ([`with_peers`]) come
/// instead of the lookup, as for blobs.
pub fn lazy_peers_for(index_hex: &str) -> Option<(Vec<String>, berth_api::auth::Key)> {
    peers_for_key(&lazy_key(index_hex))
}

/// Whether peers come from [`with_peers`] on this thread (then they are not looked up again).
pub fn named() -> bool {
    NAMED.with(|n| n.borrow().is_some())
}

fn peers_for_key(key: &str) -> Option<(Vec<String>, berth_api::auth::Key)> {
    let s = SETTINGS.get()?;
    let peers = NAMED
        .with(|n| n.borrow().clone())
        .or_else(|| s.lookup.as_ref().map(|l| l(key)))
        .unwrap_or_default();
    Some((peers, s.key.clone()))
}

/// The blob cache registry imports write to, when this process keeps blobs.
pub fn cache() -> Option<BlobCache> {
    let (root, max) = SETTINGS.get()?.cache.as_ref()?;
    BlobCache::open(root, *max)
}

/// The 64 hex digits of `sha256:<hex>`, lower case; `None` for anything else (no path is ever
/// made from a digest that is not exactly this).
pub fn digest_hex(digest: &str) -> Option<&str> {
    let hex = digest.strip_prefix("sha256:")?;
    (hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))).then_some(hex)
}

/// The cache of verified compressed blobs under a store root.
#[derive(Clone, Debug)]
pub struct BlobCache {
    dir: PathBuf,
    tmp: PathBuf,
    max_bytes: u64,
}

static TMP_SEQ: AtomicU64 = AtomicU64::new(0);

impl BlobCache {
    /// The cache of the store at `store_root`, its directories made or checked by
    /// `privfs::root_dir` (root's, mode 0700, nothing above them another user can change: the
    /// agent serves what is in them to the cluster); `None` when they cannot be (caching is
    /// best effort: an import never fails for it).
    pub fn open(store_root: &Path, max_bytes: u64) -> Option<Self> {
        let c = Self::layout(store_root, max_bytes);
        let base = store_root.join("blobs");
        // `blobs` first: root_dir makes missing directories above its target 0755.
        for d in [&base, &c.dir, &c.tmp] {
            if let Err(e) = berth_sys::privfs::root_dir(d, 0o700) {
                tracing::warn!("blob cache {}: {e}; blobs are not kept", d.display());
                return None;
            }
        }
        Some(c)
    }

    fn layout(store_root: &Path, max_bytes: u64) -> Self {
        let base = store_root.join("blobs");
        Self {
            dir: base.join("sha256"),
            tmp: base.join("tmp"),
            max_bytes,
        }
    }

    /// Where blob `digest` is (or would be) kept; `None` for a malformed digest.
    pub fn path(&self, digest: &str) -> Option<PathBuf> {
        digest_hex(digest).map(|h| self.dir.join(h))
    }

    /// Whether the cache holds `digest`.
    pub fn has(&self, digest: &str) -> bool {
        self.path(digest).is_some_and(|p| p.is_file())
    }

    /// Starts keeping blob `digest` of `size` bytes as it downloads; `None` when it is kept
    /// already, larger than the cache, or cannot be written.
    pub fn begin(&self, digest: &str, size: u64) -> Option<Keeper> {
        let dest = self.path(digest)?;
        if size > self.max_bytes || dest.exists() {
            return None;
        }
        let hex = digest_hex(digest)?;
        // The digest and size in the name let the peer server find and stream it (in_progress).
        let tmp = self.tmp.join(format!(
            "{}.{}.{hex}.{size}",
            std::process::id(),
            TMP_SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .ok()?;
        Some(Keeper {
            file: Some(file),
            tmp,
            dest,
            cache: self.clone(),
        })
    }

    /// The workspace of blob `digest` while a live process downloads it: its path and the
    /// blob's size (from the name [`BlobCache::begin`] gave it).
    pub fn in_progress(&self, digest: &str) -> Option<(PathBuf, u64)> {
        let hex = digest_hex(digest)?;
        std::fs::read_dir(&self.tmp).ok()?.flatten().find_map(|e| {
            let name = e.file_name();
            let mut f = name.to_str()?.split('.');
            let (pid, _seq, h, size) = (f.next()?, f.next()?, f.next()?, f.next()?);
            let size = size.parse().ok()?;
            (h == hex && f.next().is_none() && Path::new("/proc").join(pid).exists())
                .then(|| (e.path(), size))
        })
    }

    /// Keeps a small blob held in memory (an image config) once its sha256 is `digest`.
    pub fn put(&self, digest: &str, bytes: &[u8]) {
        let actual = format!("sha256:{}", hex(&Sha256::digest(bytes)));
        if actual != digest {
            return;
        }
        if let Some(mut k) = self.begin(digest, bytes.len() as u64) {
            k.write(bytes);
            k.commit();
        }
    }

    /// The digests kept, at most `max`.
    pub fn list(&self, max: usize) -> Vec<String> {
        let mut out: Vec<String> = std::fs::read_dir(&self.dir)
            .map(|rd| {
                rd.flatten()
                    .filter_map(|e| e.file_name().to_str().map(|n| format!("sha256:{n}")))
                    .filter(|d| digest_hex(d).is_some())
                    .take(max)
                    .collect()
            })
            .unwrap_or_default();
        out.sort();
        out
    }

    /// Removes the oldest blobs until the cache is within its bound, and workspaces of
    /// processes that are gone.
    fn evict(&self) {
        if let Ok(rd) = std::fs::read_dir(&self.tmp) {
            for e in rd.flatten() {
                let name = e.file_name();
                let pid = name.to_str().and_then(|n| n.split('.').next());
                if pid.is_some_and(|p| !Path::new("/proc").join(p).exists()) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let mut blobs: Vec<(std::time::SystemTime, u64, PathBuf)> = rd
            .flatten()
            .filter_map(|e| {
                let m = e.metadata().ok()?;
                Some((m.modified().ok()?, m.len(), e.path()))
            })
            .collect();
        let mut total: u64 = blobs.iter().map(|b| b.1).sum();
        blobs.sort();
        for (_, len, path) in blobs {
            if total <= self.max_bytes {
                break;
            }
            if std::fs::remove_file(&path).is_ok() {
                total -= len;
            }
        }
    }
}

/// A blob being kept: the bytes of the download, written as they are hashed.
#[derive(Debug)]
pub struct Keeper {
    /// `None` once a write failed: the blob is then not kept.
    file: Option<File>,
    tmp: PathBuf,
    dest: PathBuf,
    cache: BlobCache,
}

impl Keeper {
    /// Appends the next bytes of the blob.
    pub fn write(&mut self, bytes: &[u8]) {
        if let Some(f) = &mut self.file
            && f.write_all(bytes).is_err()
        {
            self.file = None;
        }
    }

    /// Publishes the blob. Call only once the bytes written hashed to the blob's digest.
    pub fn commit(mut self) {
        let Some(f) = self.file.take() else { return };
        if f.sync_data().is_ok() && std::fs::rename(&self.tmp, &self.dest).is_ok() {
            self.cache.evict();
        }
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        // Committed: renamed away already, and this finds nothing.
        let _ = std::fs::remove_file(&self.tmp);
    }
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_well_formed_digests_name_paths() {
        let ok = format!("sha256:{}", "a".repeat(64));
        assert_eq!(digest_hex(&ok), Some("a".repeat(64).as_str()));
        for bad in [
            "sha256:../../etc/passwd".to_string(),
            format!("sha256:{}", "A".repeat(64)),
            format!("sha512:{}", "a".repeat(64)),
            format!("sha256:{}/", "a".repeat(63)),
            "sha256:".to_string(),
        ] {
            assert_eq!(digest_hex(&bad), None, "{bad}");
        }
    }

    #[test]
    fn blobs_are_kept_only_when_verified_and_the_cache_stays_bounded() {
        let d = tempfile::tempdir().unwrap();
        // Not `open`: a test's temporary directory is not root's (root_dir would refuse it).
        let c = BlobCache::layout(d.path(), 10);
        for dir in [&c.dir, &c.tmp] {
            std::fs::create_dir_all(dir).unwrap();
        }
        let blob = b"12345678";
        let digest = format!("sha256:{}", hex(&Sha256::digest(blob)));
        c.put(&format!("sha256:{}", "0".repeat(64)), blob);
        assert!(c.list(10).is_empty(), "a wrong digest is not kept");
        // An uncommitted download leaves nothing.
        let mut k = c.begin(&digest, 8).unwrap();
        k.write(blob);
        drop(k);
        assert!(!c.has(&digest));
        assert_eq!(
            std::fs::read_dir(d.path().join("blobs/tmp"))
                .unwrap()
                .count(),
            0
        );
        // While it downloads the workspace is found by digest, with the blob's size.
        let k = c.begin(&digest, 8).unwrap();
        let (tmp, size) = c.in_progress(&digest).unwrap();
        assert_eq!(
            (tmp.parent().unwrap(), size),
            (d.path().join("blobs/tmp").as_path(), 8)
        );
        assert!(
            c.in_progress(&format!("sha256:{}", "0".repeat(64)))
                .is_none()
        );
        drop(k);
        assert!(c.in_progress(&digest).is_none());
        c.put(&digest, blob);
        assert!(c.has(&digest));
        assert!(c.begin(&digest, 8).is_none(), "kept once");
        let other = b"abcdefgh";
        let other_digest = format!("sha256:{}", hex(&Sha256::digest(other)));
        std::thread::sleep(std::time::Duration::from_millis(20));
        c.put(&other_digest, other);
        // 16 bytes past a bound of 10: the older goes.
        assert_eq!(c.list(10), vec![other_digest]);
        assert!(c.begin(&digest, 11).is_none(), "larger than the cache");
    }
}
