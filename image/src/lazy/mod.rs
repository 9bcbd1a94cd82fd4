//! Lazily loaded images: a container of a big image starts before the image is on the node.
//!
//! The lazy form of an image is its squashfs (what `berth export` writes) cut into fixed chunks,
//! each with its sha256 in an index, published to a registry as an OCI artifact
//! ([`ARTIFACT_TYPE`]): a manifest whose layers are the squashfs blob and the index blob
//! ([`publish`]). On a node, [`LazyMount::open`] fetches that manifest with the user's
//! credentials (a user reaches only images they may pull), then serves the squashfs through a
//! FUSE file system of berth's own ([`fuse`]) whose reads fetch the missing chunks with `Range`
//! GETs, verify each against the index before a byte is returned, and keep them in a sparse
//! cache file under the store root, so a later run reads locally. The squashfs is loop-mounted
//! from that file read-only (nosuid, nodev), as a `.sqsh` image is, and becomes the container's
//! overlay lower.
//!
//! The chunk cache is shared by every user whose run names the same index, so no run may change
//! what another verified (DESIGN.md, "Privilege model"): it is named by the digest of the
//! verified index blob (`lazy/<index hex>.data`, a byte per chunk in `.map`), not by the squashfs
//! blob's, since anyone can publish another index naming the same blob with other chunks or
//! another size. The index fixes every chunk's sha256 and the file's size, so all that is ever
//! written into a cache is bytes that index verified: both files are made whole-sized under a
//! temporary name and linked into place (never truncated or resized), a chunk is written only
//! into a slot its map marks missing, and a marked chunk that does not verify fails the read
//! rather than being fetched and written again.
//!
//! Lifetime: for `berth run`, the FUSE server is threads of the `berth run` process that
//! mounted it; the mounts are that run's own (`<squashfs.mount_dir>/lazy/<pid>-<n>/`) and go when
//! it ends. Containers that outlive the process that made them (`berth create`, Slurm steps) use
//! the node's server of the image instead ([`server`]: one root process per index, mounted at
//! `<squashfs.mount_dir>/lazy/<index hex>/`, stopped by `berth gc` once no container uses it).
//! The chunk cache stays, shared-locked while a mount uses it; `berth images gc --unused-for`
//! removes the caches no one holds (`store::gc`). A chunk fetch has
//! `registry.lazy_read_deadline_s`; after one fails, missing chunks fail at once for that long,
//! so a reader of a stalled registry gets EIO within a bound rather than a deadline per chunk.
//!
//! Fan-out (`crate::peers`): before the registry, a missing run of chunks is asked of the
//! cluster peers that hold this index's cache (the controller's catalog, looked up again every
//! [`PEER_REFRESH`], or the peers a pre-warm names). A peer's answer is verified chunk by chunk
//! against this index before any of it is written or returned: one that does not match is
//! refused (said, in one line) and the next peer, then the registry, is asked. A peer gets one
//! try of at most [`PEER_DEADLINE_S`] (within `registry.lazy_read_deadline_s`); one that fails
//! so is not asked again for `registry.lazy_read_deadline_s`, so a dead or stalled peer costs a
//! reader that bound once, not per chunk. [`warm`] (the agent's pre-warm of `lazy:REF`) fills
//! the whole cache that way, through its planned parent, which serves each chunk as soon as its
//! own warm verified it: a tree of nodes then asks the registry for each chunk once.

pub mod fuse;
pub mod prefetch;
pub mod server;

use std::fs::File;
use std::io::Read;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use nix::fcntl::OFlag;
use nix::mount::{MntFlags, MsFlags};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::config::Settings;
use crate::registry::Client;
use crate::registry::lazy::LazySource;
use crate::{ImageError, RegistryRef};

/// Marks a cache file being made (see the store's [`LAZY_TMP_MARK`](crate::store::LAZY_TMP_MARK)).
pub use crate::store::LAZY_TMP_MARK as TMP_MARK;

/// The `artifactType` of a lazy image's manifest.
pub const ARTIFACT_TYPE: &str = "application/vnd.berth.lazy.v1";
/// Media type of the squashfs blob.
pub const SQUASHFS_TYPE: &str = "application/vnd.berth.squashfs.v1";
/// Media type of the chunk index blob.
pub const INDEX_TYPE: &str = "application/vnd.berth.lazy.index.v1+json";
const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const EMPTY_TYPE: &str = "application/vnd.oci.empty.v1+json";
/// The chunk size `berth lazy publish` uses unless told otherwise.
pub const DEFAULT_CHUNK: u64 = 1 << 20;
/// An index larger than this is refused (16 MiB: 250,000 chunks, 250 GB at 1 MiB).
const INDEX_LIMIT: u64 = 16 << 20;
/// Consecutive missing chunks fetched by one `Range` GET at most.
const MAX_RUN: u64 = 16;
/// FUSE threads per lazy image: the loop device asks for several reads at once.
const FUSE_THREADS: usize = 4;
/// Seconds one request to a cluster peer may take (one try): a peer waits for a chunk its own
/// pre-warm is fetching, and a pre-warm's child asks its parent right behind it.
pub const PEER_DEADLINE_S: u64 = 10;
/// How often the holders of an index are looked up again while a mount reads: nodes that
/// started reading after this one become sources.
const PEER_REFRESH: std::time::Duration = std::time::Duration::from_secs(30);
/// How long a pre-warm's parent that does not hold the chunks asked for yet is asked again.
const PARENT_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// The chunk index: the sha256 of every `chunk_size` bytes of the squashfs blob.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Index {
    /// The squashfs blob's digest.
    pub blob: String,
    pub size: u64,
    pub chunk_size: u64,
    /// Hex sha256 of each chunk, in order (the last may be short).
    pub chunks: Vec<String>,
}

impl Index {
    /// Builds the index of `file` (read once).
    pub fn of(file: &mut dyn Read, chunk_size: u64) -> std::io::Result<Index> {
        let cs = usize::try_from(chunk_size)
            .map_err(|_| std::io::Error::other("chunk size too large"))?;
        let mut whole = Sha256::new();
        let mut chunks = Vec::new();
        let mut buf = vec![0u8; cs];
        let mut size = 0u64;
        loop {
            let mut got = 0;
            while got < cs {
                let n = file.read(&mut buf[got..])?;
                if n == 0 {
                    break;
                }
                got += n;
            }
            if got == 0 {
                break;
            }
            whole.update(&buf[..got]);
            chunks.push(hex(&Sha256::digest(&buf[..got])));
            size += got as u64;
            if got < cs {
                break;
            }
        }
        Ok(Index {
            blob: format!("sha256:{}", hex(&whole.finalize())),
            size,
            chunk_size,
            chunks,
        })
    }

    /// Whether the index is whole: as many chunks as the size needs, each a sha256.
    fn check(&self) -> Result<(), ImageError> {
        if self.chunk_size < 4096 || self.chunk_size > (64 << 20) {
            return Err(ImageError::Detail(format!(
                "chunk size {} out of 4 KiB..64 MiB",
                self.chunk_size
            )));
        }
        if self.chunks.len() as u64 != self.size.div_ceil(self.chunk_size) {
            return Err(ImageError::Detail(format!(
                "{} chunks for {} bytes of {}-byte chunks",
                self.chunks.len(),
                self.size,
                self.chunk_size
            )));
        }
        if let Some(bad) = self
            .chunks
            .iter()
            .find(|c| c.len() != 64 || !c.bytes().all(|b| b.is_ascii_hexdigit()))
        {
            return Err(ImageError::Detail(format!(
                "'{}' is not a sha256",
                berth_sys::text::elide(bad)
            )));
        }
        Ok(())
    }
}

fn hex(bytes: &[u8]) -> String {
    crate::squashfs::hex(bytes)
}

fn lazy_err(msg: impl Into<String>) -> ImageError {
    ImageError::Lazy(msg.into())
}

#[derive(Serialize, Deserialize)]
struct Descriptor {
    #[serde(rename = "mediaType")]
    media_type: String,
    digest: String,
    size: u64,
}

#[derive(Serialize, Deserialize)]
struct ArtifactManifest {
    #[serde(rename = "schemaVersion")]
    schema_version: u32,
    #[serde(rename = "mediaType", default)]
    media_type: Option<String>,
    #[serde(rename = "artifactType", default)]
    artifact_type: Option<String>,
    config: Descriptor,
    layers: Vec<Descriptor>,
}

/// What [`publish`] pushed.
#[derive(Clone, Debug)]
pub struct Published {
    pub manifest_digest: String,
    pub index: Index,
    /// Whether the squashfs blob was uploaded (false: the registry had it).
    pub uploaded: bool,
}

/// `berth lazy publish`: publishes the squashfs `file` as the lazy image `reference` (a registry
/// image by tag, `docker://REGISTRY/REPO:TAG`) with the credentials of the user running berth,
/// whose home is `home`. Returns the reference parsed and what was pushed.
pub fn publish_to(
    file: &Path,
    reference: &str,
    chunk_size: u64,
    registry: &crate::config::RegistryConfig,
    home: Option<&Path>,
) -> Result<(RegistryRef, Published), ImageError> {
    let r = match crate::reference::parse(reference)? {
        crate::Reference::Registry(r) if r.digest.is_none() => r,
        _ => {
            return Err(ImageError::Reference(
                reference.to_string(),
                "a lazy image is published to a registry by tag: give docker://REGISTRY/REPO:TAG"
                    .into(),
            ));
        }
    };
    let client = Client::new(registry, home)?;
    let published = publish(file, &r, chunk_size, &client)?;
    Ok((r, published))
}

/// Publishes the squashfs `file` as the lazy image `r` (chunks of `chunk_size` bytes), with
/// the credentials of the user running berth.
pub fn publish(
    file: &Path,
    r: &RegistryRef,
    chunk_size: u64,
    client: &Client,
) -> Result<Published, ImageError> {
    let io = |source| ImageError::Io {
        path: file.to_path_buf(),
        source,
    };
    crate::squashfs::probe_squashfs_magic(file, 0)?;
    let mut f = File::open(file).map_err(io)?;
    let index = Index::of(&mut f, chunk_size).map_err(io)?;
    let index_json = serde_json::to_vec(&index)
        .map_err(|e| lazy_err(format!("encoding the index of {}: {e}", file.display())))?;
    let index_digest = format!("sha256:{}", hex(&Sha256::digest(&index_json)));
    let mut f = File::open(file).map_err(io)?;
    let uploaded = client.lazy_push_blob(r, &index.blob, index.size, &mut f)?;
    client.lazy_push_blob(
        r,
        &index_digest,
        index_json.len() as u64,
        &mut index_json.as_slice(),
    )?;
    let empty = b"{}";
    let empty_digest = format!("sha256:{}", hex(&Sha256::digest(empty)));
    client.lazy_push_blob(r, &empty_digest, 2, &mut empty.as_slice())?;
    let manifest = ArtifactManifest {
        schema_version: 2,
        media_type: Some(OCI_MANIFEST.into()),
        artifact_type: Some(ARTIFACT_TYPE.into()),
        config: Descriptor {
            media_type: EMPTY_TYPE.into(),
            digest: empty_digest,
            size: 2,
        },
        layers: vec![
            Descriptor {
                media_type: SQUASHFS_TYPE.into(),
                digest: index.blob.clone(),
                size: index.size,
            },
            Descriptor {
                media_type: INDEX_TYPE.into(),
                digest: index_digest,
                size: index_json.len() as u64,
            },
        ],
    };
    let body = serde_json::to_vec(&manifest)
        .map_err(|e| lazy_err(format!("encoding the manifest: {e}")))?;
    let tag = r.tag.as_deref().unwrap_or(crate::reference::DEFAULT_TAG);
    let manifest_digest = client.lazy_push_manifest(r, tag, OCI_MANIFEST, &body)?;
    Ok(Published {
        manifest_digest,
        index,
        uploaded,
    })
}

/// The squashfs blob of a lazy image, served chunk by chunk (the FUSE file's bytes).
struct Chunks {
    image: String,
    client: Client,
    source: LazySource,
    index: Index,
    /// `lazy/<index hex>.data` under the store root, for messages.
    cache_name: String,
    data: File,
    map: File,
    /// Free bytes the cache's file system keeps (`store.reserve_bytes`): a chunk that would
    /// take it below is not cached, and its read fails.
    reserve: u64,
    /// Per chunk: 0 missing, 1 verified by this process, 2 in the cache file, not yet verified,
    /// 3 refused (the registry's bytes did not match): not asked for again, 4 claimed by a
    /// thread that is verifying or fetching it.
    state: Vec<AtomicU8>,
    /// Held while chunks are claimed or released (state 4): one fetch of a chunk at a time,
    /// fetches of different chunks in parallel.
    fetch: Mutex<()>,
    /// Signalled when claimed chunks are done (or released).
    fetched_one: std::sync::Condvar,
    fetched: AtomicU64,
    /// Cluster peers asked before the registry; `None`: peers are not set up here.
    peers: Option<Peers>,
    /// Bytes fetched from peers (verified).
    from_peers: AtomicU64,
    /// Reads of the FUSE file served, and their bytes (for -v).
    reads: AtomicU64,
    read_bytes: AtomicU64,
    /// The first failure, said again when the mount or the run fails.
    failure: Mutex<Option<String>>,
    /// Whether `failure` was returned as the mount's error (then the drop does not say it).
    reported: std::sync::atomic::AtomicBool,
    /// Until when a missing chunk fails at once, without asking the registry, after a fetch
    /// failed (`registry.lazy_read_deadline_s` from that failure), with that failure's line: a
    /// reader walking a file asks chunk after chunk, and waiting out the deadline on each would
    /// hold it (in the kernel, unkillable) for the whole file.
    down: Mutex<Option<(std::time::Instant, String)>>,
    down_for: std::time::Duration,
}

impl std::fmt::Debug for Chunks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chunks")
            .field("image", &self.image)
            .field("blob", &self.index.blob)
            .finish_non_exhaustive()
    }
}

impl Chunks {
    fn range(&self, i: u64) -> (u64, u64) {
        let start = i * self.index.chunk_size;
        (start, (start + self.index.chunk_size).min(self.index.size))
    }

    fn fail(&self, msg: String) -> ImageError {
        let mut f = self.failure.lock().expect("failure");
        if f.is_none() {
            *f = Some(msg.clone());
        }
        lazy_err(msg)
    }

    fn state(&self, i: u64) -> u8 {
        usize::try_from(i)
            .ok()
            .and_then(|i| self.state.get(i))
            .map_or(0, |s| s.load(Ordering::Acquire))
    }

    fn set_state(&self, i: u64, v: u8) {
        if let Some(s) = usize::try_from(i).ok().and_then(|i| self.state.get(i)) {
            s.store(v, Ordering::Release);
        }
    }

    fn matches(&self, i: u64, bytes: &[u8]) -> bool {
        usize::try_from(i)
            .ok()
            .and_then(|i| self.index.chunks.get(i))
            .is_some_and(|want| *want == hex(&Sha256::digest(bytes)))
    }

    /// Checks a chunk the map marks cached against the index. One that does not match is not
    /// fetched and written again (a marked slot is never rewritten in place, another run may be
    /// reading it): the read fails, in one line, until the cache is removed.
    fn check_cached(&self, i: u64) -> Result<(), ImageError> {
        let (s, e) = self.range(i);
        let mut buf = vec![0u8; usize::try_from(e - s).unwrap_or(0)];
        if self.data.read_exact_at(&mut buf, s).is_ok() && self.matches(i, &buf) {
            return Ok(());
        }
        Err(self.fail(format!(
            "lazy image {}: cached chunk {i} (bytes {s}-{}) in {} does not match its index: the \
             node's chunk cache is damaged; remove it with berth images gc --unused-for 0s once \
             no run uses it",
            self.image,
            e - 1,
            self.cache_name
        )))
    }

    /// Fails, in one line, when writing `bytes` more into the cache would leave less than the
    /// store's reserve free: the image's size is what its publisher (or a registry that lies)
    /// says, and a container reading all of it must not fill the node's disk for every user.
    fn check_room(&self, bytes: u64) -> Result<(), ImageError> {
        if self.reserve == 0 {
            return Ok(());
        }
        let st = nix::sys::statvfs::fstatvfs(&self.data).map_err(|e| {
            self.fail(format!(
                "lazy image {}: the chunk cache's file system: {e}",
                self.image
            ))
        })?;
        let free = st.blocks_available().saturating_mul(st.fragment_size());
        if free >= self.reserve.saturating_add(bytes) {
            return Ok(());
        }
        Err(self.fail(format!(
            "lazy image {}: the node's image store has {} free, and caching {} more would go \
             below store.reserve_bytes ({}): the read fails; free space (berth images gc \
             --unused-for DURATION removes unused chunk caches) or import the image whole",
            self.image,
            crate::store::human_size(free),
            crate::store::human_size(bytes),
            crate::store::human_size(self.reserve)
        )))
    }

    /// Makes chunks `first..=last` present and verified: cached ones are checked once, missing
    /// ones fetched (consecutive ones by one request), verified and written to the cache. A
    /// chunk is claimed (state 4) by one thread at a time; others wait for it, and take it up
    /// themselves if that thread failed for a reason other than a mismatch.
    fn ensure(&self, first: u64, last: u64) -> Result<(), ImageError> {
        loop {
            if (first..=last).all(|i| self.state(i) == 1) {
                return Ok(());
            }
            let mut claims = self.fetch.lock().expect("fetch");
            let mut mine = Vec::new();
            let mut theirs = false;
            for i in first..=last {
                match self.state(i) {
                    1 => {}
                    3 => {
                        let said = self.failure.lock().expect("failure").clone();
                        return Err(lazy_err(said.unwrap_or_default()));
                    }
                    4 => theirs = true,
                    s => {
                        self.set_state(i, 4);
                        mine.push((i, s));
                    }
                }
            }
            if mine.is_empty() {
                if theirs {
                    claims = self.fetched_one.wait(claims).expect("fetch");
                }
                drop(claims);
                continue;
            }
            drop(claims);
            let done = self.complete(&mine);
            // Whatever this thread claimed and did not finish is free again (or refused).
            let _claims = self.fetch.lock().expect("fetch");
            for (i, _) in &mine {
                if self.state(*i) == 4 {
                    self.set_state(*i, 0);
                }
            }
            self.fetched_one.notify_all();
            done?;
        }
    }

    /// Verifies the claimed cached chunks and fetches the claimed missing ones.
    fn complete(&self, mine: &[(u64, u8)]) -> Result<(), ImageError> {
        let mut missing = Vec::new();
        for &(i, was) in mine {
            if was == 2 {
                self.check_cached(i)?;
                self.set_state(i, 1);
                continue;
            }
            missing.push(i);
        }
        let mut k = 0;
        while k < missing.len() {
            let mut n = 1;
            while k + n < missing.len()
                && missing[k + n] == missing[k] + n as u64
                && (n as u64) < MAX_RUN
            {
                n += 1;
            }
            self.fetch_run(missing[k], missing[k + n - 1])?;
            k += n;
        }
        Ok(())
    }

    /// The bytes of chunk `i` within `bytes`, a run starting at byte `start`.
    fn slice<'a>(&self, bytes: &'a [u8], start: u64, i: u64) -> &'a [u8] {
        let (s, e) = self.range(i);
        bytes
            .get(usize::try_from(s - start).unwrap_or(0)..usize::try_from(e - start).unwrap_or(0))
            .unwrap_or_default()
    }

    /// Chunks `a..=b` (bytes `start..end`) from the first peer that serves them all matching
    /// the index; `None` when none does.
    fn fetch_from_peers(&self, a: u64, b: u64, start: u64, end: u64) -> Option<Vec<u8>> {
        let peers = self.peers.as_ref()?;
        for (k, src) in peers.sources().into_iter().enumerate() {
            let ask = || {
                peers.client.lazy_peer_range(
                    &src,
                    &peers.index_digest,
                    self.index.chunk_size,
                    start,
                    end - start,
                )
            };
            let mut got = ask();
            // A pre-warm's planned parent is started with it and serves each chunk once its own
            // warm has it, but its warm's request may reach it after this one's first ask: its
            // "not held" is asked again for a while (once it never came, not again).
            let since = std::time::Instant::now();
            while k == 0
                && peers.named
                && matches!(&got, Err(e) if not_held(e))
                && !peers.parent_waited_out.load(Ordering::Relaxed)
            {
                if since.elapsed() >= PARENT_WAIT {
                    peers.parent_waited_out.store(true, Ordering::Relaxed);
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
                got = ask();
            }
            match got {
                Ok(bytes) => {
                    if let Some(i) =
                        (a..=b).find(|i| !self.matches(*i, self.slice(&bytes, start, *i)))
                    {
                        tracing::warn!(
                            "lazy image {}: cluster peer {} served chunk {i} not matching its \
                             index (corrupt data): refused, asking the next source",
                            self.image,
                            src.host()
                        );
                        continue;
                    }
                    self.from_peers.fetch_add(end - start, Ordering::Relaxed);
                    return Some(bytes);
                }
                // It holds the index but not all of these chunks (yet).
                Err(e) if not_held(&e) => {}
                Err(e) => {
                    tracing::warn!(
                        "lazy image {}: cluster peer {}: {e}; not asked again for {} s",
                        self.image,
                        src.host(),
                        self.down_for.as_secs()
                    );
                    peers.down(src.host(), self.down_for);
                }
            }
        }
        None
    }

    fn fetch_run(&self, a: u64, b: u64) -> Result<(), ImageError> {
        let (start, _) = self.range(a);
        let (_, end) = self.range(b);
        let (bytes, verified) = match self.fetch_from_peers(a, b, start, end) {
            Some(bytes) => (bytes, true),
            None => {
                if let Some((until, said)) = self.down.lock().expect("down").as_ref()
                    && std::time::Instant::now() < *until
                {
                    return Err(lazy_err(said.clone()));
                }
                let bytes = self
                    .client
                    .lazy_range(&self.source, &self.index.blob, start, end - start)
                    .map_err(|e| {
                        let said = e.to_string();
                        *self.down.lock().expect("down") =
                            Some((std::time::Instant::now() + self.down_for, said.clone()));
                        self.fail(said)
                    })?;
                self.fetched.fetch_add(end - start, Ordering::Relaxed);
                (bytes, false)
            }
        };
        for i in a..=b {
            let (s, e) = self.range(i);
            let slice = self.slice(&bytes, start, i);
            if !verified && !self.matches(i, slice) {
                self.set_state(i, 3);
                return Err(self.fail(format!(
                    "lazy image {}: chunk {i} (bytes {s}-{}) of blob {} from the registry does not \
                     match its index: the registry's copy is corrupt or was changed; publish the \
                     image again (berth lazy publish)",
                    self.image,
                    e - 1,
                    self.index.blob
                )));
            }
            let cache_io = |e: std::io::Error| {
                self.fail(format!(
                    "lazy image {}: writing the chunk cache: {e}",
                    self.image
                ))
            };
            // Another run of the same index may have cached it meanwhile: its bytes were
            // verified against the same sha256, and a marked slot is never written again.
            let mut mark = [0u8];
            self.map.read_exact_at(&mut mark, i).map_err(cache_io)?;
            if mark[0] == 1 {
                self.check_cached(i)?;
                self.set_state(i, 1);
                continue;
            }
            self.check_room(e - s)?;
            self.data.write_all_at(slice, s).map_err(cache_io)?;
            self.map.write_all_at(&[1], i).map_err(cache_io)?;
            self.set_state(i, 1);
        }
        Ok(())
    }
}

/// Whether a peer's answer said it does not hold the chunks asked for (404).
fn not_held(e: &ImageError) -> bool {
    matches!(
        e,
        ImageError::Registry(crate::registry::RegistryError::BlobMissing { .. })
    )
}

/// The cluster peers a mount asks for chunks (module header, "Fan-out").
struct Peers {
    /// Requests to peers: one try each, within [`PEER_DEADLINE_S`].
    client: Client,
    r: RegistryRef,
    index_hex: String,
    /// `sha256:<index hex>`: what peers are asked for.
    index_digest: String,
    /// Named by a pre-warm: never looked up again.
    named: bool,
    /// The first named peer (a pre-warm's parent) never had chunks it was waited for.
    parent_waited_out: std::sync::atomic::AtomicBool,
    list: Mutex<PeerList>,
}

struct PeerList {
    sources: Vec<LazySource>,
    looked: std::time::Instant,
    /// Peers not asked until then (they failed).
    down: Vec<(String, std::time::Instant)>,
}

impl Peers {
    /// The peers of the index `index_hex` of `r`, when this process has peers set up.
    fn open(
        r: &RegistryRef,
        index_hex: &str,
        registry: &crate::config::RegistryConfig,
    ) -> Option<Peers> {
        let (hosts, key) = crate::peers::lazy_peers_for(index_hex)?;
        let mut cfg = registry.clone();
        cfg.retries = 1;
        cfg.lazy_read_deadline_s = cfg.lazy_read_deadline_s.clamp(1, PEER_DEADLINE_S);
        cfg.read_timeout_s = cfg.read_timeout_s.clamp(1, PEER_DEADLINE_S);
        cfg.connect_timeout_s = cfg.connect_timeout_s.clamp(1, PEER_DEADLINE_S);
        let client = Client::new(&cfg, None)
            .inspect_err(|e| tracing::warn!("lazy image chunks from peers: {e}; the registry only"))
            .ok()?;
        client.deadline_per_request();
        let sources = client.lazy_peers(r, &hosts, &key);
        Some(Peers {
            client,
            r: r.clone(),
            index_hex: index_hex.to_string(),
            index_digest: format!("sha256:{index_hex}"),
            named: crate::peers::named(),
            parent_waited_out: std::sync::atomic::AtomicBool::new(false),
            list: Mutex::new(PeerList {
                sources,
                looked: std::time::Instant::now(),
                down: Vec::new(),
            }),
        })
    }

    /// The peers to ask now, best first: looked up again once [`PEER_REFRESH`] passed, those
    /// that failed lately left out.
    fn sources(&self) -> Vec<LazySource> {
        let mut list = self.list.lock().expect("peers");
        if !self.named && list.looked.elapsed() >= PEER_REFRESH {
            list.looked = std::time::Instant::now();
            if let Some((hosts, key)) = crate::peers::lazy_peers_for(&self.index_hex) {
                list.sources = self.client.lazy_peers(&self.r, &hosts, &key);
            }
        }
        let now = std::time::Instant::now();
        list.down.retain(|(_, until)| *until > now);
        let down = list.down.clone();
        list.sources
            .iter()
            .filter(|s| !down.iter().any(|(h, _)| h == s.host()))
            .cloned()
            .collect()
    }

    fn down(&self, host: &str, wait: std::time::Duration) {
        let until = std::time::Instant::now() + wait.max(std::time::Duration::from_secs(1));
        self.list
            .lock()
            .expect("peers")
            .down
            .push((host.to_string(), until));
    }
}

/// What [`warm`] did.
#[derive(Clone, Debug)]
pub struct Warmed {
    /// `sha256:<hex>` of the image's index: the node's chunk cache and catalog entry.
    pub index_digest: String,
    pub size: u64,
    /// Bytes fetched from the registry and from peers.
    pub from_registry: u64,
    pub from_peers: u64,
}

/// The agent's pre-warm of `lazy:REF` (`berth cluster prewarm lazy:REF`): fetches the lazy image
/// `r`'s manifest and index as the user `uid` (home `home`), then every chunk into the node's
/// chunk cache, from the peers first (those the pre-warm names: its planned parent, which
/// serves each chunk as soon as it has it), so that the node's containers of the image read
/// locally and its agent serves the chunks to other nodes.
pub fn warm(
    r: &RegistryRef,
    config: &Settings<'_>,
    uid: u32,
    home: Option<&Path>,
) -> Result<Warmed, ImageError> {
    let v = Verified::fetch(r, config, uid, home)?;
    let index_digest = format!("sha256:{}", v.index_hex);
    let chunks = v.open_cache(config)?;
    let n = chunks.index.chunks.len() as u64;
    let mut first = 0;
    while first < n {
        let last = (first + MAX_RUN - 1).min(n - 1);
        chunks.ensure(first, last)?;
        first = last + 1;
    }
    Ok(Warmed {
        index_digest,
        size: chunks.index.size,
        from_registry: chunks.fetched.load(Ordering::Relaxed),
        from_peers: chunks.from_peers.load(Ordering::Relaxed),
    })
}

impl fuse::Backing for Chunks {
    fn size(&self) -> u64 {
        self.index.size
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), ImageError> {
        if buf.is_empty() {
            return Ok(());
        }
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.read_bytes
            .fetch_add(buf.len() as u64, Ordering::Relaxed);
        let cs = self.index.chunk_size;
        let last = offset + buf.len() as u64 - 1;
        self.ensure(offset / cs, last / cs)?;
        self.data.read_exact_at(buf, offset).map_err(|e| {
            self.fail(format!(
                "lazy image {}: reading the chunk cache: {e}",
                self.image
            ))
        })
    }
}

/// A lazy image's manifest and index, fetched with a user's credentials and checked: the index
/// blob matches the digest the manifest names, is within [`INDEX_LIMIT`] and whole, and
/// describes the manifest's squashfs blob.
pub(crate) struct Verified {
    pub(crate) image: String,
    r: RegistryRef,
    client: Client,
    source: LazySource,
    index: Index,
    /// The sha256 of the index blob, in hex: what names the chunk cache and the node's server.
    pub(crate) index_hex: String,
}

impl Verified {
    /// Fetches `r`'s manifest and index as the user `uid` (whose home is `home`): a user who
    /// may not pull `r` gets the pull's error here.
    pub(crate) fn fetch(
        r: &RegistryRef,
        config: &Settings<'_>,
        uid: u32,
        home: Option<&Path>,
    ) -> Result<Verified, ImageError> {
        let image = r.image_name();
        let client = Client::for_uid(config.registry, uid, home)?;
        let (source, raw) = client.lazy_manifest(r, OCI_MANIFEST)?;
        let manifest: ArtifactManifest = serde_json::from_slice(&raw.body).map_err(|e| {
            lazy_err(format!(
                "lazy image {image}: its manifest is not an OCI manifest ({e})"
            ))
        })?;
        if manifest.artifact_type.as_deref() != Some(ARTIFACT_TYPE) {
            return Err(lazy_err(format!(
                "lazy image {image}: not a lazy image (artifactType {}, want {ARTIFACT_TYPE}): \
                 publish one with berth lazy publish, or drop lazy: to pull it whole",
                manifest.artifact_type.as_deref().unwrap_or("none")
            )));
        }
        let layer = |t: &str| {
            manifest
                .layers
                .iter()
                .find(|l| l.media_type == t)
                .ok_or_else(|| {
                    lazy_err(format!("lazy image {image}: its manifest has no {t} layer"))
                })
        };
        let (sqsh, idx) = (layer(SQUASHFS_TYPE)?, layer(INDEX_TYPE)?);
        if idx.size > INDEX_LIMIT {
            return Err(lazy_err(format!(
                "lazy image {image}: its index is {} bytes, more than the {} MiB allowed",
                idx.size,
                INDEX_LIMIT >> 20
            )));
        }
        let index_json = client.lazy_range(&source, &idx.digest, 0, idx.size)?;
        let index_hex = hex(&Sha256::digest(&index_json));
        if format!("sha256:{index_hex}") != idx.digest {
            return Err(lazy_err(format!(
                "lazy image {image}: its index blob does not match its digest {}",
                idx.digest
            )));
        }
        let index: Index = serde_json::from_slice(&index_json)
            .map_err(|e| lazy_err(format!("lazy image {image}: its index is not valid: {e}")))?;
        index
            .check()
            .map_err(|e| lazy_err(format!("lazy image {image}: its index is not valid: {e}")))?;
        if index.blob != sqsh.digest || index.size != sqsh.size {
            return Err(lazy_err(format!(
                "lazy image {image}: its index describes {} ({} bytes), the manifest {} ({} bytes)",
                index.blob, index.size, sqsh.digest, sqsh.size
            )));
        }
        Ok(Verified {
            image,
            r: r.clone(),
            client,
            source,
            index,
            index_hex,
        })
    }

    /// Opens (making it when missing) the chunk cache of this index; each chunk fetch from now
    /// on gets `registry.lazy_read_deadline_s` of its own.
    fn open_cache(self, config: &Settings<'_>) -> Result<Chunks, ImageError> {
        // The manifest and index came within the import's deadline; each chunk fetch, for as
        // long as the container runs, gets one of its own.
        self.client.deadline_per_request();
        let peers = Peers::open(&self.r, &self.index_hex, config.registry);
        let mut chunks = open_cache(
            &self.image,
            self.client,
            self.source,
            self.index,
            &self.index_hex,
            config.store.root.as_path(),
            config.store.reserve_bytes,
        )?;
        chunks.down_for = std::time::Duration::from_secs(config.registry.lazy_read_deadline_s);
        chunks.peers = peers;
        Ok(chunks)
    }
}

/// A lazy image mounted for one run: dropping it unmounts the squashfs and the FUSE file
/// system (the chunk cache stays).
#[derive(Debug)]
pub struct LazyMount {
    /// The squashfs's mount point: the container's overlay lower.
    pub root: PathBuf,
    /// The squashfs blob's digest.
    pub digest: String,
    pub config: oci_spec::image::ImageConfiguration,
    dir: PathBuf,
    chunks: Arc<Chunks>,
}

/// The per-run directory names: unique in this process.
static MOUNTS: AtomicU64 = AtomicU64::new(0);

impl LazyMount {
    /// Mounts the lazy image `r` for the user `uid` (whose home is `home`): see the module doc.
    pub fn open(
        r: &RegistryRef,
        config: &Settings<'_>,
        uid: u32,
        home: Option<&Path>,
    ) -> Result<LazyMount, ImageError> {
        let v = Verified::fetch(r, config, uid, home)?;
        let n = MOUNTS.fetch_add(1, Ordering::Relaxed);
        Self::open_at(v, config, &format!("{}-{n}", std::process::id()))
    }

    /// Mounts the verified image `v` at `<squashfs.mount_dir>/lazy/<name>/`, which must not
    /// exist.
    pub(crate) fn open_at(
        v: Verified,
        config: &Settings<'_>,
        name: &str,
    ) -> Result<LazyMount, ImageError> {
        let image = v.image.clone();
        let chunks = Arc::new(v.open_cache(config)?);
        let digest = chunks.index.blob.clone();
        let parent = config.squashfs.mount_dir.join("lazy");
        berth_sys::privfs::root_dir(&parent, 0o700).map_err(|e| lazy_err(e.to_string()))?;
        let dir = parent.join(name);
        let mount = LazyMount {
            root: dir.join("root"),
            digest,
            config: Default::default(),
            dir,
            chunks,
        };
        mount.mount(&image, config)
    }

    fn mount(mut self, image: &str, config: &Settings<'_>) -> Result<LazyMount, ImageError> {
        let fuse_dir = self.dir.join("fuse");
        for d in [&self.dir, &fuse_dir, &self.root] {
            std::fs::create_dir(d).map_err(|source| ImageError::Io {
                path: d.clone(),
                source,
            })?;
        }
        let dev = fuse::mount(&fuse_dir).map_err(|e| {
            lazy_err(format!(
                "lazy image {image}: mounting its FUSE file system on {}: {e} (berth needs root and /dev/fuse)",
                fuse_dir.display()
            ))
        })?;
        fuse::serve(dev, self.chunks.clone(), FUSE_THREADS);
        let said = |e: String| match self.chunks.failure.lock().expect("failure").clone() {
            Some(f) => {
                self.chunks.reported.store(true, Ordering::Relaxed);
                lazy_err(f)
            }
            None => lazy_err(e),
        };
        let file_path = fuse_dir.join(fuse::FILE_NAME);
        let file = File::open(&file_path).map_err(|e| {
            said(format!(
                "lazy image {image}: opening {}: {e}",
                file_path.display()
            ))
        })?;
        let read = berth_sys::privfs::fd_path(&file);
        crate::squashfs::probe_squashfs_magic(&read, 0).map_err(|e| said(e.to_string()))?;
        let device = crate::loopdev::LoopDevice::attach_fd(
            &file,
            &file_path,
            0,
            self.chunks.index.size,
            crate::loopdev::Method::Configure,
        )
        .map_err(|e| said(format!("lazy image {image}: a loop device: {e}")))?;
        let flags = MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
        if let Err(errno) = nix::mount::mount(
            Some(&device.path),
            &self.root,
            Some("squashfs"),
            flags,
            None::<&str>,
        ) {
            device.detach();
            return Err(said(format!(
                "lazy image {image}: mounting its squashfs: {errno}"
            )));
        }
        // The mount holds the device now; autoclear detaches it when the mount goes.
        drop(device);
        let files =
            crate::squashfs::SquashfsFiles::open(&read, 0).map_err(|e| said(e.to_string()))?;
        self.config = crate::squashfs::image_config(crate::synth::enroot(
            &files,
            config.squashfs.enroot_entrypoint,
        ));
        Ok(self)
    }

    /// Bytes fetched from the registry by this mount so far.
    pub fn fetched(&self) -> u64 {
        self.chunks.fetched.load(Ordering::Relaxed)
    }

    /// The first fetch or verification failure, if any.
    pub fn failure(&self) -> Option<String> {
        self.chunks.failure.lock().expect("failure").clone()
    }
}

impl Drop for LazyMount {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.root, MntFlags::MNT_DETACH);
        let fuse_dir = self.dir.join("fuse");
        let _ = nix::mount::umount2(&fuse_dir, MntFlags::MNT_DETACH);
        for d in [&self.root, &fuse_dir, &self.dir] {
            let _ = std::fs::remove_dir(d);
        }
        tracing::info!(
            "lazy image {}: fetched {} of {} bytes from the registry, {} from peers; served {} \
             reads, {} bytes",
            self.chunks.image,
            self.fetched(),
            self.chunks.index.size,
            self.chunks.from_peers.load(Ordering::Relaxed),
            self.chunks.reads.load(Ordering::Relaxed),
            self.chunks.read_bytes.load(Ordering::Relaxed)
        );
        if let Some(f) = self.failure()
            && !self.chunks.reported.load(Ordering::Relaxed)
        {
            tracing::error!("{f}");
        }
    }
}

/// The chunk cache's file names for the index whose sha256 is `index_hex`: its data (the
/// squashfs, sparse) and its map (a byte per chunk, 1 once the chunk is cached and verified).
pub fn cache_names(index_hex: &str) -> (String, String) {
    (format!("{index_hex}.data"), format!("{index_hex}.map"))
}

/// Times a cache is opened again when `berth images gc` removed it while it was being opened.
const OPEN_TRIES: u32 = 5;

/// Opens the file `name` (`len` bytes) beneath `dir`, making it when missing: whole-sized under
/// a temporary name, then linked to `name`, so that no one ever finds it part-made and no
/// opener ever resizes it. Another run making it at once wins the link; its file is used.
fn open_sized(dir: &std::os::fd::OwnedFd, name: &str, len: u64) -> std::io::Result<File> {
    let open = |n: &str, flags: OFlag| {
        // openat2 takes a mode only with O_CREAT.
        let mode = if flags.contains(OFlag::O_CREAT) {
            0o600
        } else {
            0
        };
        berth_sys::privfs::open_beneath(dir.as_fd(), Path::new(n), flags, mode, true)
            .map(File::from)
    };
    match open(name, OFlag::O_RDWR) {
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
        other => return other,
    }
    let tmp = format!(
        "{name}{TMP_MARK}{}-{}",
        std::process::id(),
        MOUNTS.fetch_add(1, Ordering::Relaxed)
    );
    let made = open(&tmp, OFlag::O_RDWR | OFlag::O_CREAT | OFlag::O_EXCL)?;
    let linked = made.set_len(len).and_then(|()| {
        nix::unistd::linkat(dir, tmp.as_str(), dir, name, nix::fcntl::AtFlags::empty())
            .map_err(std::io::Error::from)
    });
    let _ = nix::unistd::unlinkat(dir, tmp.as_str(), nix::unistd::UnlinkatFlags::NoRemoveDir);
    match linked {
        Ok(()) => Ok(made),
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => open(name, OFlag::O_RDWR),
        Err(e) => Err(e),
    }
}

/// Opens (making them when missing) the chunk cache of the index whose sha256 is `index_hex`
/// under `store_root/lazy`: root's directory, files opened beneath it without following
/// symlinks. See the module header for why it is named by the index.
fn open_cache(
    image: &str,
    client: Client,
    source: LazySource,
    index: Index,
    index_hex: &str,
    store_root: &Path,
    reserve: u64,
) -> Result<Chunks, ImageError> {
    use std::os::unix::fs::MetadataExt;
    let dir_path = store_root.join("lazy");
    let dir = berth_sys::privfs::root_dir(&dir_path, 0o700).map_err(|e| lazy_err(e.to_string()))?;
    if index_hex.len() != 64 || !index_hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(lazy_err(format!(
            "lazy image {image}: index digest {index_hex} is not a sha256"
        )));
    }
    let (data_name, map_name) = cache_names(index_hex);
    let n = index.chunks.len() as u64;
    let io = |what: &str, e: std::io::Error| {
        lazy_err(format!(
            "lazy image {image}: the chunk cache {}: {what}: {e}",
            dir_path.join(&data_name).display()
        ))
    };
    let mut tries = 0;
    let (data, map) = loop {
        let data = open_sized(&dir, &data_name, index.size).map_err(|e| io("opening", e))?;
        let map = open_sized(&dir, &map_name, n).map_err(|e| io("opening its map", e))?;
        // Held while the image is mounted (the lock goes with the fd): `berth images gc`
        // removes only caches nobody holds, under the exclusive lock, data first. Files it
        // unlinked before this lock was had are not used: a new cache is made.
        map.lock_shared().map_err(|e| io("locking the map", e))?;
        let linked = |f: &File| f.metadata().is_ok_and(|m| m.nlink() > 0);
        if linked(&data) && linked(&map) {
            break (data, map);
        }
        tries += 1;
        if tries >= OPEN_TRIES {
            return Err(io(
                "opening",
                std::io::Error::other("removed by berth images gc each time it was opened"),
            ));
        }
    };
    // The map's mtime is the cache's last use, which gc ages.
    map.set_modified(std::time::SystemTime::now())
        .map_err(|e| io("marking its use", e))?;
    // The name fixes the size (the index does), and only root writes here: another size is
    // damage, never resized (a run of this index may be reading it).
    let data_len = data.metadata().map_err(|e| io("stat", e))?.len();
    let map_len = map.metadata().map_err(|e| io("stat of its map", e))?.len();
    if data_len != index.size || map_len != n {
        return Err(lazy_err(format!(
            "lazy image {image}: the chunk cache {} is {data_len} bytes with {map_len} marks, not \
             the {} bytes and {n} chunks of its index: it is damaged; remove it with berth images \
             gc --unused-for 0s once no run uses it",
            dir_path.join(&data_name).display(),
            index.size
        )));
    }
    let mut marks = vec![0u8; usize::try_from(n).unwrap_or(0)];
    map.read_exact_at(&mut marks, 0)
        .map_err(|e| io("reading the map", e))?;
    let state = marks
        .iter()
        .map(|m| AtomicU8::new(if *m == 1 { 2 } else { 0 }))
        .collect();
    Ok(Chunks {
        image: image.to_string(),
        client,
        source,
        index,
        cache_name: dir_path.join(&data_name).display().to_string(),
        data,
        map,
        reserve,
        state,
        fetch: Mutex::new(()),
        fetched_one: std::sync::Condvar::new(),
        fetched: AtomicU64::new(0),
        peers: None,
        from_peers: AtomicU64::new(0),
        reads: AtomicU64::new(0),
        read_bytes: AtomicU64::new(0),
        failure: Mutex::new(None),
        reported: std::sync::atomic::AtomicBool::new(false),
        down: Mutex::new(None),
        down_for: std::time::Duration::ZERO,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_that_failed_is_left_out_until_its_time_and_the_others_kept() {
        let registry = crate::config::RegistryConfig::default();
        let client = Client::new(&registry, None).unwrap();
        let crate::Reference::Registry(r) =
            crate::reference::parse("docker://reg.example/t/lazy:1").unwrap()
        else {
            panic!("a registry reference");
        };
        let key = berth_api::auth::Key::new("cluster key");
        let sources = client.lazy_peers(&r, &["a:1".to_string(), "b:2".to_string()], &key);
        let peers = Peers {
            client,
            r,
            index_hex: "a".repeat(64),
            index_digest: format!("sha256:{}", "a".repeat(64)),
            named: true,
            parent_waited_out: std::sync::atomic::AtomicBool::new(false),
            list: Mutex::new(PeerList {
                sources,
                looked: std::time::Instant::now(),
                down: Vec::new(),
            }),
        };
        let hosts = |p: &Peers| {
            p.sources()
                .iter()
                .map(|s| s.host().to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(hosts(&peers), ["a:1", "b:2"]);
        peers.down("a:1", std::time::Duration::from_secs(3600));
        assert_eq!(hosts(&peers), ["b:2"]);
        // Its time past, it is asked again.
        peers.list.lock().unwrap().down[0].1 = std::time::Instant::now();
        assert_eq!(hosts(&peers), ["a:1", "b:2"]);
    }

    #[test]
    fn index_of_bytes() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let idx = Index::of(&mut data.as_slice(), 4096).unwrap();
        assert_eq!(idx.size, 10_000);
        assert_eq!(idx.chunks.len(), 3);
        assert_eq!(idx.chunks[2], hex(&Sha256::digest(&data[8192..])));
        assert_eq!(idx.blob, format!("sha256:{}", hex(&Sha256::digest(&data))));
        idx.check().unwrap();
        let mut short = idx.clone();
        short.chunks.pop();
        assert!(
            short
                .check()
                .unwrap_err()
                .to_string()
                .contains("2 chunks for 10000 bytes")
        );
    }

    #[test]
    fn another_index_of_the_same_blob_gets_a_cache_of_its_own() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let idx = Index::of(&mut data.as_slice(), 4096).unwrap();
        let mut other = idx.clone();
        other.chunks[1] = hex(&Sha256::digest(b"someone else's bytes"));
        let mut shorter = idx.clone();
        shorter.size = 4096;
        shorter.chunks.truncate(1);
        let name = |i: &Index| cache_names(&hex(&Sha256::digest(serde_json::to_vec(i).unwrap())));
        assert_eq!(other.blob, idx.blob);
        assert_ne!(name(&other), name(&idx));
        assert_ne!(name(&shorter), name(&idx));
        assert_eq!(name(&idx), name(&idx.clone()));
    }

    #[test]
    fn a_cache_file_is_made_whole_and_never_resized() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = std::os::fd::OwnedFd::from(File::open(tmp.path()).unwrap());
        let f = open_sized(&dir, "a.data", 1 << 20).unwrap();
        assert_eq!(f.metadata().unwrap().len(), 1 << 20);
        f.write_all_at(b"verified", 4096).unwrap();
        // Opened again with another size (a bug, or another index's claim): the file stays.
        let again = open_sized(&dir, "a.data", 10).unwrap();
        assert_eq!(again.metadata().unwrap().len(), 1 << 20);
        let mut back = [0u8; 8];
        again.read_exact_at(&mut back, 4096).unwrap();
        assert_eq!(&back, b"verified");
        // No temporary is left behind.
        let names: Vec<String> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["a.data"]);
    }

    #[test]
    fn publishing_needs_a_registry_reference_by_tag() {
        let registry = crate::config::RegistryConfig::default();
        for reference in [
            "docker://127.0.0.1:1/repo@sha256:0000000000000000000000000000000000000000000000000000000000000000",
            "/tmp/image.sqsh",
        ] {
            let err = publish_to(
                Path::new("/nonexistent.sqsh"),
                reference,
                1 << 20,
                &registry,
                None,
            )
            .unwrap_err();
            assert!(
                matches!(err, ImageError::Reference(..)),
                "{reference}: {err}"
            );
            assert!(err.to_string().contains("REGISTRY/REPO:TAG"), "{err}");
        }
    }
}
