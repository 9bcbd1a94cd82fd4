//! Listing, removing and garbage-collecting stored images. Removal runs under the store's
//! exclusive lock (no import is running), never touches an image whose "in use" lock is held,
//! and removes layers once no image record references them. gc's choice of victims is a pure
//! function ([`plan`]) of the images' sizes, last use and in-use state.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use super::fs::{self, LockMode};
use super::{RefRecord, Store, digest_hex};
use crate::store::StoreError;
use crate::{Digest, Image, ImageError, Rootfs};

/// One stored image as `berth images ls` / `inspect` show it.
#[derive(Clone, Debug)]
pub struct Entry {
    pub image: Image,
    /// Canonical references recorded for it.
    pub references: Vec<String>,
    /// Disk use of its layers (or its squashfs file).
    pub size: u64,
    pub last_used: SystemTime,
    pub in_use: bool,
}

/// What a user named on the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Selector {
    /// An image by digest.
    Digest(Digest),
    /// A reference record (canonical text) and the image it points to.
    Reference(String, Digest),
}

/// What `remove` did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Removed {
    /// Only the reference was removed; other references keep the image.
    Untagged(String),
    /// The image and all its references were removed.
    Image {
        digest: Digest,
        references: Vec<String>,
        layers: usize,
    },
}

/// Which images gc removes, beyond garbage (dead workspaces, unreferenced layers).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcPolicy {
    /// Remove least recently used images until the store holds at most this many bytes.
    pub max_size: Option<u64>,
    /// Remove images not used for this long.
    pub unused_for: Option<Duration>,
}

#[derive(Clone, Debug, Default)]
pub struct GcReport {
    /// Removed images (digest, references, size), in removal order.
    pub removed: Vec<(Digest, Vec<String>, u64)>,
    pub layers_removed: usize,
    pub bytes_freed: u64,
    pub workspaces_removed: usize,
    /// Lazy images' chunk caches removed (`--unused-for`), and their bytes on disk (counted in
    /// `bytes_freed` too).
    pub lazy_caches_removed: usize,
    pub lazy_bytes_freed: u64,
    /// Images gc would have removed but that are in use.
    pub kept_in_use: Vec<Digest>,
    /// Store size after gc (layers and files referenced by images).
    pub size_after: u64,
}

/// Parses `90s`, `30m`, `12h`, `7d`, `2w` (a bare number is seconds).
pub fn parse_duration(text: &str) -> Result<Duration, ImageError> {
    let bad = || ImageError::Duration(text.to_string());
    let t = text.trim();
    let (digits, unit) = match t.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => (&t[..i], &t[i..]),
        None => (t, "s"),
    };
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let secs = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86400,
        "w" => 7 * 86400,
        _ => return Err(bad()),
    };
    n.checked_mul(secs).map(Duration::from_secs).ok_or_else(bad)
}

/// An image as gc weighs it.
#[derive(Clone, Debug)]
pub(crate) struct Candidate {
    pub digest: Digest,
    /// Layer names (diff_id hex) it uses.
    pub layers: Vec<String>,
    /// Bytes it holds outside layers (a squashfs file inside the store).
    pub own_bytes: u64,
    pub last_used: SystemTime,
    pub in_use: bool,
}

/// Chooses the images to remove, in order: first every image unused for `unused_for`, then the
/// least recently used until the total (shared layers counted once) fits `max_size`. Images in
/// use are never chosen; they are returned in the second list when they would have been.
pub(crate) fn plan(
    images: &[Candidate],
    layer_sizes: &BTreeMap<String, u64>,
    policy: &GcPolicy,
    now: SystemTime,
) -> (Vec<Digest>, Vec<Digest>) {
    let mut order: Vec<&Candidate> = images.iter().collect();
    order.sort_by_key(|c| (c.last_used, c.digest.clone()));
    let mut removed: BTreeSet<&str> = BTreeSet::new();
    let mut kept_in_use = Vec::new();
    if let Some(age) = policy.unused_for {
        for c in &order {
            let idle = now.duration_since(c.last_used).unwrap_or_default();
            if idle >= age {
                if c.in_use {
                    kept_in_use.push(c.digest.clone());
                } else {
                    removed.insert(&c.digest);
                }
            }
        }
    }
    let total = |removed: &BTreeSet<&str>| -> u64 {
        let mut layers = BTreeSet::new();
        let mut own = 0;
        for c in images
            .iter()
            .filter(|c| !removed.contains(c.digest.as_str()))
        {
            layers.extend(c.layers.iter());
            own += c.own_bytes;
        }
        own + layers
            .iter()
            .map(|l| layer_sizes.get(*l).copied().unwrap_or(0))
            .sum::<u64>()
    };
    if let Some(max) = policy.max_size {
        for c in &order {
            if total(&removed) <= max {
                break;
            }
            if removed.contains(c.digest.as_str()) {
                continue;
            }
            if c.in_use {
                if !kept_in_use.contains(&c.digest) {
                    kept_in_use.push(c.digest.clone());
                }
                continue;
            }
            removed.insert(&c.digest);
        }
    }
    let chosen = order
        .iter()
        .filter(|c| removed.contains(c.digest.as_str()))
        .map(|c| c.digest.clone())
        .collect();
    (chosen, kept_in_use)
}

/// The layer names (diff_id hex) an image uses.
fn layer_names(image: &Image) -> Vec<String> {
    match &image.rootfs {
        Rootfs::Layers(dirs) => dirs
            .iter()
            .filter_map(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
            .collect(),
        Rootfs::Squashfs { .. } => Vec::new(),
    }
}

impl Store {
    fn images(&self) -> Vec<Image> {
        let mut out = Vec::new();
        let Ok(rd) = std::fs::read_dir(self.dir("images")) else {
            return out;
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(hex) = name.strip_suffix(".json") else {
                continue;
            };
            let digest = format!("sha256:{hex}");
            if digest_hex(&digest).is_err() {
                continue;
            }
            match std::fs::read(e.path()).map(|b| serde_json::from_slice::<Image>(&b)) {
                Ok(Ok(image)) => out.push(image),
                _ => tracing::warn!("unreadable image record {}", e.path().display()),
            }
        }
        out.sort_by(|a, b| a.digest.cmp(&b.digest));
        out
    }

    fn refs(&self) -> Vec<(PathBuf, RefRecord)> {
        let mut out = Vec::new();
        let Ok(rd) = std::fs::read_dir(self.dir("refs")) else {
            return out;
        };
        for e in rd.flatten() {
            if let Ok(Ok(rec)) =
                std::fs::read(e.path()).map(|b| serde_json::from_slice::<RefRecord>(&b))
            {
                out.push((e.path(), rec));
            }
        }
        out.sort_by(|a, b| a.1.reference.cmp(&b.1.reference));
        out
    }

    /// Disk use of a layer, from its size record (measured and recorded when missing).
    fn layer_size(&self, name: &str) -> u64 {
        let dir = self.dir("layers").join(name);
        let record = dir.with_extension("size");
        if let Some(n) = std::fs::read_to_string(&record)
            .ok()
            .and_then(|s| s.trim().parse().ok())
        {
            return n;
        }
        if !dir.is_dir() {
            return 0;
        }
        let n = fs::disk_usage(&dir);
        if let Ok(ws) = self.workspace() {
            let _ = fs::write_atomic(&ws, &record, n.to_string().as_bytes());
        }
        n
    }

    fn own_bytes(&self, image: &Image) -> u64 {
        match &image.rootfs {
            Rootfs::Squashfs { file, .. } if file.starts_with(self.files_dir()) => {
                std::fs::metadata(file).map(|m| m.len()).unwrap_or(0)
            }
            _ => 0,
        }
    }

    fn image_size(&self, image: &Image) -> u64 {
        match &image.rootfs {
            Rootfs::Layers(_) => {
                let names: BTreeSet<String> = layer_names(image).into_iter().collect();
                names.iter().map(|n| self.layer_size(n)).sum()
            }
            Rootfs::Squashfs { size, .. } => *size,
        }
    }

    fn last_used(&self, digest: &str) -> SystemTime {
        let from = |p: Result<PathBuf, ImageError>| {
            p.ok()
                .and_then(|p| std::fs::metadata(p).ok())
                .and_then(|m| m.modified().ok())
        };
        from(self.use_path(digest))
            .or_else(|| from(self.image_path(digest)))
            .unwrap_or(SystemTime::UNIX_EPOCH)
    }

    /// Whether a container holds the image (its in-use lock is taken).
    pub fn in_use(&self, digest: &str) -> bool {
        match self.use_path(digest) {
            Ok(p) if p.exists() => !matches!(fs::try_exclusive(&p), Ok(Some(_))),
            _ => false,
        }
    }

    /// Every stored image with its references, size, last use and in-use state.
    pub fn list(&self) -> Vec<Entry> {
        let refs = self.refs();
        self.images()
            .into_iter()
            .map(|image| Entry {
                references: refs
                    .iter()
                    .filter(|(_, r)| r.digest == image.digest)
                    .map(|(_, r)| r.reference.clone())
                    .collect(),
                size: self.image_size(&image),
                last_used: self.last_used(&image.digest),
                in_use: self.in_use(&image.digest),
                image,
            })
            .collect()
    }

    /// Resolves what a user typed: a recorded reference (canonical text, or parsed by `parse`),
    /// a digest, or a unique prefix of one (at least 4 hex digits, `sha256:` optional).
    pub fn select(
        &self,
        text: &str,
        parse: &dyn Fn(&str) -> Result<crate::Reference, ImageError>,
    ) -> Result<Selector, ImageError> {
        if let Some(rec) = self.read_ref(text) {
            return Ok(Selector::Reference(rec.reference, rec.digest));
        }
        let hex = text.strip_prefix("sha256:").unwrap_or(text);
        if hex.len() >= 4 && hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            let hex = hex.to_ascii_lowercase();
            let matches: Vec<Digest> = self
                .images()
                .into_iter()
                .map(|i| i.digest)
                .filter(|d| d["sha256:".len()..].starts_with(&hex))
                .collect();
            match matches.len() {
                1 => return Ok(Selector::Digest(matches[0].clone())),
                0 => {}
                _ => {
                    let shown: Vec<String> = matches.iter().map(|d| d[..19].to_string()).collect();
                    return Err(ImageError::Store(StoreError::AmbiguousDigest(
                        text.into(),
                        shown.join(", "),
                    )));
                }
            }
        }
        if let Ok(reference) = parse(text) {
            let key = crate::reference::reference_key(&reference);
            if let Some(rec) = self.read_ref(&key) {
                return Ok(Selector::Reference(rec.reference, rec.digest));
            }
            if let crate::Reference::Registry(r) = &reference
                && let Some(d) = &r.digest
                && self.image_path(d).is_ok_and(|p| p.exists())
            {
                return Ok(Selector::Digest(d.clone()));
            }
        }
        Err(ImageError::Store(StoreError::NotStored(text.to_string())))
    }

    /// The entry of a selected image.
    pub fn inspect(&self, sel: &Selector) -> Result<Entry, ImageError> {
        let digest = match sel {
            Selector::Digest(d) | Selector::Reference(_, d) => d,
        };
        self.list()
            .into_iter()
            .find(|e| &e.image.digest == digest)
            .ok_or_else(|| ImageError::Store(StoreError::NotStored(digest.clone())))
    }

    /// Removes a reference (the image too when no other reference keeps it), or an image by
    /// digest with all its references. Refuses an image in use.
    pub fn remove(&self, sel: &Selector) -> Result<Removed, ImageError> {
        let _store = self.lock("store", LockMode::Exclusive)?;
        let refs = self.refs();
        let digest = match sel {
            Selector::Digest(d) => d.clone(),
            Selector::Reference(key, d) => {
                let others = refs
                    .iter()
                    .any(|(_, r)| &r.digest == d && &r.reference != key);
                if others {
                    if let Some((path, _)) = refs.iter().find(|(_, r)| &r.reference == key) {
                        std::fs::remove_file(path)
                            .map_err(|e| self.io("removing a reference", e))?;
                    }
                    return Ok(Removed::Untagged(key.clone()));
                }
                d.clone()
            }
        };
        if self.image_path(&digest).is_ok_and(|p| !p.exists()) {
            // A dangling reference: remove it.
            let mut references = Vec::new();
            for (path, r) in refs.iter().filter(|(_, r)| r.digest == digest) {
                let _ = std::fs::remove_file(path);
                references.push(r.reference.clone());
            }
            if references.is_empty() {
                return Err(ImageError::Store(StoreError::NotStored(digest)));
            }
            return Ok(Removed::Image {
                digest,
                references,
                layers: 0,
            });
        }
        let Some(_unused) = self.claim_unused(&digest)? else {
            return Err(ImageError::Store(StoreError::InUse(digest)));
        };
        let references = self.remove_image(&digest, &refs)?;
        let (layers, _) = self.prune_layers();
        Ok(Removed::Image {
            digest,
            references,
            layers,
        })
    }

    /// Takes the image's in-use lock exclusively if nobody uses it.
    fn claim_unused(&self, digest: &str) -> Result<Option<File>, ImageError> {
        let path = self.use_path(digest)?;
        fs::try_exclusive(&path).map_err(|e| self.io("checking whether an image is in use", e))
    }

    /// Removes an image's references and record (caller holds the store exclusively and the
    /// image's in-use lock); returns the references removed.
    fn remove_image(
        &self,
        digest: &str,
        refs: &[(PathBuf, RefRecord)],
    ) -> Result<Vec<String>, ImageError> {
        let mut references = Vec::new();
        for (path, r) in refs.iter().filter(|(_, r)| r.digest == digest) {
            std::fs::remove_file(path).map_err(|e| self.io("removing a reference", e))?;
            references.push(r.reference.clone());
        }
        let record = self.image_path(digest)?;
        if let Ok(bytes) = std::fs::read(&record)
            && let Ok(image) = serde_json::from_slice::<Image>(&bytes)
            && let Rootfs::Squashfs { file, .. } = &image.rootfs
            && file.starts_with(self.files_dir())
        {
            let _ = std::fs::remove_file(file);
        }
        std::fs::remove_file(&record).map_err(|e| self.io("removing an image record", e))?;
        let _ = std::fs::remove_file(self.use_path(digest)?);
        let _ = std::fs::remove_file(
            self.dir("locks")
                .join(format!("image-{}", digest_hex(digest)?)),
        );
        fs::sync_dir(&self.dir("images")).map_err(|e| self.io("flushing images/", e))?;
        Ok(references)
    }

    /// Removes layers, files and locks no image references (store held exclusively); returns
    /// (layers removed, bytes freed).
    fn prune_layers(&self) -> (usize, u64) {
        let images = self.images();
        let used: BTreeSet<String> = images.iter().flat_map(layer_names).collect();
        let used_files: BTreeSet<PathBuf> = images
            .iter()
            .filter_map(|i| match &i.rootfs {
                Rootfs::Squashfs { file, .. } => Some(file.clone()),
                _ => None,
            })
            .collect();
        let digests: BTreeSet<String> = images
            .iter()
            .filter_map(|i| digest_hex(&i.digest).ok().map(String::from))
            .collect();
        let mut removed = 0;
        let mut freed = 0;
        let layers = self.dir("layers");
        for e in std::fs::read_dir(&layers).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let side = [".size", ".files", ".damaged"]
                .iter()
                .find_map(|x| name.strip_suffix(x));
            let base = side.unwrap_or(&name).to_string();
            if used.contains(&base) {
                continue;
            }
            if side.is_some() {
                if !layers.join(&base).exists() {
                    let _ = std::fs::remove_file(e.path());
                }
                continue;
            }
            let size = self.layer_size(&name);
            // Renamed away first, so the layer disappears at once even if removal is slow.
            let doomed = match self.workspace() {
                Ok(ws) => {
                    let to = ws.path("dead-layer");
                    if std::fs::rename(e.path(), &to).is_ok() {
                        to
                    } else {
                        e.path()
                    }
                }
                Err(_) => e.path(),
            };
            if std::fs::remove_dir_all(&doomed).is_ok() {
                removed += 1;
                freed += size;
                for x in ["size", "files", "damaged"] {
                    let _ = std::fs::remove_file(layers.join(format!("{name}.{x}")));
                }
                let _ = std::fs::remove_file(self.dir("locks").join(format!("layer-{name}")));
            }
        }
        for e in std::fs::read_dir(self.files_dir())
            .into_iter()
            .flatten()
            .flatten()
        {
            if !used_files.contains(&e.path()) {
                freed += e.metadata().map(|m| m.len()).unwrap_or(0);
                let _ =
                    std::fs::remove_file(e.path()).or_else(|_| std::fs::remove_dir_all(e.path()));
            }
        }
        for e in std::fs::read_dir(self.dir("use"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            if !digests.contains(&name)
                && let Ok(Some(_held)) = fs::try_exclusive(&e.path())
            {
                let _ = std::fs::remove_file(e.path());
            }
        }
        for e in std::fs::read_dir(self.dir("locks"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            let stale = match name.split_once('-') {
                Some(("layer", hex)) => !layers.join(hex).exists(),
                Some(("image", hex)) => !digests.contains(hex),
                _ => false,
            };
            if stale {
                let _ = std::fs::remove_file(e.path());
            }
        }
        let _ = fs::sync_dir(&layers);
        (removed, freed)
    }

    /// Removes the chunk caches of lazy images (`lazy/<index>.data` and `.map`, named by the
    /// digest of their chunk index: `crate::lazy`) last used longer than `age` ago and mounted
    /// by no one (a mount holds a shared lock on the map; gc takes the exclusive one without
    /// waiting, and holds it while it removes, data first). Returns the caches removed and
    /// their bytes on disk. A mount that opens the cache as it goes makes a new one. Temporary
    /// files a crashed mount left while making a cache go once older than `age` (and an hour).
    fn prune_lazy_caches(&self, age: Duration) -> (usize, u64) {
        use std::os::unix::fs::MetadataExt;
        let dir_path = self.dir("lazy");
        let Ok(dir) = std::fs::read_dir(&dir_path) else {
            return (0, 0);
        };
        // root's directory (as the mounts make it; a berth run by another user has a store of
        // its own), its files opened beneath it.
        let dir_fd = if nix::unistd::geteuid().is_root() {
            berth_sys::privfs::root_dir(&dir_path, 0o700).ok()
        } else {
            File::open(&dir_path).ok().map(std::os::fd::OwnedFd::from)
        };
        let Some(dir_fd) = dir_fd else {
            return (0, 0);
        };
        let open = |name: &str| {
            berth_sys::privfs::open_beneath(
                &dir_fd,
                std::path::Path::new(name),
                nix::fcntl::OFlag::O_RDONLY,
                0,
                true,
            )
            .map(std::fs::File::from)
        };
        let now = SystemTime::now();
        let (mut removed, mut freed) = (0, 0);
        for e in dir.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.contains(super::LAZY_TMP_MARK) {
                let old = e
                    .metadata()
                    .and_then(|m| m.modified())
                    // A temporary lives for a moment while a mount makes its cache: one an
                    // hour old is a crashed mount's, whatever `age` says.
                    .is_ok_and(|t| {
                        now.duration_since(t).unwrap_or_default()
                            >= age.max(Duration::from_secs(3600))
                    });
                if old {
                    let _ = nix::unistd::unlinkat(
                        &dir_fd,
                        name.as_str(),
                        nix::unistd::UnlinkatFlags::NoRemoveDir,
                    );
                }
                continue;
            }
            let Some(hex) = name.strip_suffix(".map") else {
                continue;
            };
            let Ok(map) = open(&name) else { continue };
            if map.try_lock().is_err() {
                continue;
            }
            let used = map.metadata().and_then(|m| m.modified()).unwrap_or(now);
            if now.duration_since(used).unwrap_or_default() < age {
                continue;
            }
            let data = format!("{hex}.data");
            let bytes = open(&data)
                .and_then(|f| f.metadata())
                .map(|m| m.blocks() * 512)
                .unwrap_or(0)
                + map.metadata().map(|m| m.blocks() * 512).unwrap_or(0);
            let gone = |n: &str| {
                nix::unistd::unlinkat(&dir_fd, n, nix::unistd::UnlinkatFlags::NoRemoveDir).is_ok()
            };
            if gone(&data) | gone(&name) {
                removed += 1;
                freed += bytes;
            }
        }
        (removed, freed)
    }

    /// Removes dead workspaces, unreferenced layers, and the images `policy` selects (least
    /// recently used first), never one in use.
    pub fn gc(&self, policy: &GcPolicy) -> Result<GcReport, ImageError> {
        let _store = self.lock("store", LockMode::Exclusive)?;
        let mut report = GcReport {
            workspaces_removed: fs::clean_tmp(&self.dir("tmp")),
            ..Default::default()
        };
        let images = self.images();
        let mut layer_sizes = BTreeMap::new();
        let candidates: Vec<Candidate> = images
            .iter()
            .map(|i| {
                let layers = layer_names(i);
                for l in &layers {
                    layer_sizes
                        .entry(l.clone())
                        .or_insert_with(|| self.layer_size(l));
                }
                Candidate {
                    digest: i.digest.clone(),
                    layers,
                    own_bytes: self.own_bytes(i),
                    last_used: self.last_used(&i.digest),
                    in_use: self.in_use(&i.digest),
                }
            })
            .collect();
        let (chosen, kept) = plan(&candidates, &layer_sizes, policy, SystemTime::now());
        report.kept_in_use = kept;
        let refs = self.refs();
        for digest in chosen {
            // Re-checked under the lock: a container may have started since the plan.
            let Some(_unused) = self.claim_unused(&digest)? else {
                report.kept_in_use.push(digest);
                continue;
            };
            let size = images
                .iter()
                .find(|i| i.digest == digest)
                .map(|i| self.image_size(i))
                .unwrap_or(0);
            let references = self.remove_image(&digest, &refs)?;
            report.removed.push((digest, references, size));
        }
        // Images with a layer `berth images verify` found damaged: removed, so the next use
        // imports them again (a layer re-extracted replaces the damaged one).
        for image in &images {
            let Rootfs::Layers(dirs) = &image.rootfs else {
                continue;
            };
            if !dirs.iter().any(|d| d.with_extension("damaged").exists())
                || !self.image_path(&image.digest).is_ok_and(|p| p.exists())
            {
                continue;
            }
            let Some(_unused) = self.claim_unused(&image.digest)? else {
                report.kept_in_use.push(image.digest.clone());
                continue;
            };
            let size = self.image_size(image);
            let references = self.remove_image(&image.digest, &refs)?;
            report
                .removed
                .push((image.digest.clone(), references, size));
        }
        // References whose image record is gone.
        for (path, r) in &refs {
            if self.image_path(&r.digest).is_ok_and(|p| !p.exists()) {
                let _ = std::fs::remove_file(path);
            }
        }
        let (layers, freed) = self.prune_layers();
        report.layers_removed = layers;
        report.bytes_freed = freed;
        if let Some(age) = policy.unused_for {
            let (caches, bytes) = self.prune_lazy_caches(age);
            report.lazy_caches_removed = caches;
            report.lazy_bytes_freed = bytes;
            report.bytes_freed += bytes;
        }
        let remaining = self.images();
        let names: BTreeSet<String> = remaining.iter().flat_map(layer_names).collect();
        report.size_after = names.iter().map(|n| self.layer_size(n)).sum::<u64>()
            + remaining.iter().map(|i| self.own_bytes(i)).sum::<u64>();
        Ok(report)
    }
}
