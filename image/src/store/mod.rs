//! The node's image store (`[store] root`, default `/var/lib/berth`), shared by every user and
//! every berth process on the node. Each image is imported once; containers stack its layers.
//!
//! Layout under the root:
//! ```text
//! layers/<hex>/        one extracted layer in overlayfs form, named by its diff_id
//! layers/<hex>.size    its disk use in bytes
//! layers/<hex>.files   what extraction wrote there (record.rs): `berth images verify` checks it
//! layers/<hex>.damaged a mark left by `verify`: the layer is re-extracted by the next import
//!                      (or removed with its images by `gc`)
//! images/<hex>.json    an image record (crate::Image as JSON), named by its digest
//! refs/<hex>.json      reference → digest, named by the sha256 of the canonical reference
//! use/<hex>            "in use" lock of an image (shared flock per running container); its
//!                      mtime is when the image was last used
//! locks/               import locks: store (gc), image-<hex>, layer-<hex>
//! files/               files other sources keep in the store (e.g. squashfs copies)
//! tmp/                 per-process workspaces (see fs.rs); never read as complete entries
//! ```
//!
//! Guarantees:
//! - Publishing is a rename from `tmp/` (same file system) after the data is flushed, so a
//!   reader sees a layer or record whole or not at all; a crash leaves only workspaces in
//!   `tmp/`, removed by the next import or gc.
//! - One import per image digest and per layer at a time, across processes (flock); the
//!   others wait and reuse the result.
//! - Imports hold the store lock shared and gc/rm hold it exclusive, so gc never removes a layer
//!   an import is about to reference; an image whose `use/` lock is held is never removed.

mod copyup;
mod error;
mod fs;
mod gc;
mod layers;
mod verify;

pub use error::StoreError;
pub use gc::{Entry, GcPolicy, GcReport, Removed, Selector, parse_duration};
pub use layers::Staged;
pub(crate) use layers::{dedup_layers, publish_dir};
pub use verify::{LayerCheck, VerifyReport};

use std::fs::File;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use self::fs::{LockMode, Workspace};
use super::{Digest, Image, ImageError, Reference, Rootfs};
use crate::config::StoreConfig;
use crate::local::{FileStamp, is_local_path};
use crate::reference::reference_key;

/// Compressed layers are assumed to grow this much when extracted (gzip and zstd layers of
/// typical images inflate 2–3×), for the free-space check before an import.
pub const COMPRESSED_GROWTH: u64 = 3;

/// Marks a temporary file of a lazy image's chunk cache: `<name>.tmp-<pid>-<n>`, made
/// whole-sized, then linked to its name (crate::lazy). `berth images gc` removes those a crashed
/// run left behind.
pub const LAZY_TMP_MARK: &str = ".tmp-";

/// Progress lines for the user (`berth import` prints them on stderr).
pub type Progress<'a> = &'a (dyn Fn(&str) + Sync);

/// A progress sink that drops everything.
pub fn quiet(_: &str) {}

/// The hex part of a `sha256:<64 hex>` digest; anything else is refused (digests become file
/// names, so this is what keeps them inside the store).
pub fn digest_hex(digest: &str) -> Result<&str, ImageError> {
    digest
        .strip_prefix("sha256:")
        .filter(|h| {
            h.len() == 64
                && h.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        })
        .ok_or_else(|| ImageError::Store(StoreError::BadDigest(digest.to_string())))
}

/// `12.3 MiB`
pub fn human_size(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// `refs/<sha256(key)>.json`
#[derive(Clone, Debug, Serialize, Deserialize)]
struct RefRecord {
    reference: String,
    source: Reference,
    digest: Digest,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    file: Option<FileStamp>,
}

/// A held "in use" mark on an image: while it lives, gc and rm leave the image alone. Dropping
/// it records the time as the image's last use.
#[derive(Debug)]
pub struct InUse {
    file: File,
    digest: Digest,
}

impl InUse {
    pub fn digest(&self) -> &str {
        &self.digest
    }
}

impl Drop for InUse {
    fn drop(&mut self) {
        let _ = self.file.set_modified(SystemTime::now());
    }
}

/// Bounds on what imports write (`[store]` keys of the same names).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    pub max_layers: usize,
    pub max_layer_bytes: u64,
    pub max_image_bytes: u64,
    pub reserve_bytes: u64,
}

impl Limits {
    pub fn of(config: &StoreConfig) -> Self {
        Self {
            max_layers: config.max_layers,
            max_layer_bytes: config.max_layer_bytes,
            max_image_bytes: config.max_image_bytes,
            reserve_bytes: config.reserve_bytes,
        }
    }
}

/// The image store.
#[derive(Debug)]
pub struct Store {
    root: PathBuf,
    parallel_layers: usize,
    workspace: Mutex<Option<Arc<Workspace>>>,
    limits: Limits,
    /// Bytes extracted by the image import in progress (for `store.max_image_bytes`).
    image_bytes: Mutex<Option<Arc<AtomicU64>>>,
}

impl Store {
    /// Opens the store at `config.root`, creating its directories.
    pub fn open(config: &StoreConfig) -> Result<Self, ImageError> {
        Ok(Self::open_at(&config.root, config.parallel_layers)?.with_limits(Limits::of(config)))
    }

    /// Replaces the bounds (`open_at` takes the defaults of `[store]`).
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    pub fn open_at(root: &Path, parallel_layers: usize) -> Result<Self, ImageError> {
        let store = Self {
            root: root.to_path_buf(),
            parallel_layers: parallel_layers.max(1),
            workspace: Mutex::new(None),
            limits: Limits::of(&StoreConfig::default()),
            image_bytes: Mutex::new(None),
        };
        // Root only: layers hold images' setuid binaries on a file system that is not
        // necessarily nosuid, and private images' files. Containers reach them through overlay
        // mounts made by root, which this does not hinder. Run as root, berth takes the root
        // only if root owns it and every directory above it (privfs::root_dir); a berth run by
        // another user keeps its own store, where it can harm only that user.
        if nix::unistd::geteuid().is_root() {
            berth_sys::privfs::root_dir(root, 0o700)
                .map_err(|e| store.io("checking the store directory", std::io::Error::other(e)))?;
        }
        let mut builder = std::fs::DirBuilder::new();
        builder.recursive(true).mode(0o700);
        builder
            .create(root)
            .map_err(|e| store.io("creating the store directory", e))?;
        for dir in ["layers", "images", "refs", "use", "locks", "files", "tmp"] {
            let path = root.join(dir);
            match std::fs::symlink_metadata(&path) {
                Ok(m) if !m.is_dir() => {
                    return Err(store.io(
                        format!("checking {dir}/"),
                        std::io::Error::other("not a directory (a symlink?): remove it"),
                    ));
                }
                _ => {}
            }
            builder
                .create(&path)
                .map_err(|e| store.io(format!("creating {dir}/"), e))?;
            let meta =
                std::fs::metadata(&path).map_err(|e| store.io(format!("reading {dir}/"), e))?;
            if meta.mode() & 0o077 != 0 {
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o700))
                    .map_err(|e| store.io(format!("making {dir}/ private (mode 0700)"), e))?;
            }
        }
        Ok(store)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn parallel_layers(&self) -> usize {
        self.parallel_layers
    }

    /// Where other sources keep files that belong to the store (removed by gc once no image
    /// references them). Write into it only inside [`Store::import_with`].
    pub fn files_dir(&self) -> PathBuf {
        self.root.join("files")
    }

    fn io(&self, op: impl Into<String>, source: std::io::Error) -> ImageError {
        ImageError::Store(StoreError::StoreIo {
            root: self.root.clone(),
            op: op.into(),
            source,
        })
    }

    fn dir(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }

    /// The directory of layer `diff_id` (whether or not it exists).
    pub fn layer_dir(&self, diff_id: &str) -> Result<PathBuf, ImageError> {
        Ok(self.dir("layers").join(digest_hex(diff_id)?))
    }

    fn image_path(&self, digest: &str) -> Result<PathBuf, ImageError> {
        Ok(self
            .dir("images")
            .join(format!("{}.json", digest_hex(digest)?)))
    }

    fn ref_path(&self, key: &str) -> PathBuf {
        self.dir("refs")
            .join(format!("{:x}.json", Sha256::digest(key.as_bytes())))
    }

    fn use_path(&self, digest: &str) -> Result<PathBuf, ImageError> {
        Ok(self.dir("use").join(digest_hex(digest)?))
    }

    pub(crate) fn workspace(&self) -> Result<Arc<Workspace>, ImageError> {
        let mut slot = self.workspace.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(ws) = slot.as_ref() {
            return Ok(ws.clone());
        }
        let ws = Arc::new(
            Workspace::create(&self.dir("tmp"))
                .map_err(|e| self.io("creating a workspace in tmp/", e))?,
        );
        *slot = Some(ws.clone());
        Ok(ws)
    }

    fn lock(&self, name: &str, mode: LockMode) -> Result<File, ImageError> {
        fs::lock(&self.dir("locks").join(name), mode, true)
            .map_err(|e| self.io(format!("locking locks/{name}"), e))?
            .ok_or_else(|| {
                self.io(
                    format!("locking locks/{name}"),
                    std::io::Error::other("not locked"),
                )
            })
    }

    /// Fails with one line (naming `store.max_layers`) when an image of `count` layers could
    /// never run; call it on the manifest, before fetching anything.
    pub fn check_layers(&self, what: &str, count: usize) -> Result<(), ImageError> {
        if count > self.limits.max_layers {
            return Err(ImageError::Store(StoreError::TooManyLayers {
                what: what.to_string(),
                count,
                max: self.limits.max_layers,
            }));
        }
        Ok(())
    }

    /// Fails with one line when fewer than `needed` bytes (plus `store.reserve_bytes`) are free
    /// in the store.
    pub fn check_space(&self, what: &str, needed: u64) -> Result<(), ImageError> {
        let free = fs::free_bytes(&self.root).map_err(|e| self.io("statvfs", e))?;
        if needed <= free && needed.saturating_add(self.limits.reserve_bytes) > free {
            return Err(ImageError::Store(StoreError::Reserve {
                root: self.root.clone(),
                what: format!("importing {what} (about {})", human_size(needed)),
                reserve: human_size(self.limits.reserve_bytes),
                free: human_size(free),
            }));
        }
        if needed > free {
            return Err(ImageError::Store(StoreError::NoSpace {
                root: self.root.clone(),
                what: what.to_string(),
                needed: human_size(needed),
                free: human_size(free),
            }));
        }
        Ok(())
    }

    fn free_text(&self) -> String {
        fs::free_bytes(&self.root)
            .map(human_size)
            .unwrap_or_else(|_| "unknown".into())
    }

    // -----------------------------------------------------------------------------------------
    // Reading

    /// The image record for `digest`, if the store holds it whole (every layer present).
    pub fn image(&self, digest: &str) -> Option<Image> {
        let path = self.image_path(digest).ok()?;
        let bytes = std::fs::read(&path).ok()?;
        let image: Image = match serde_json::from_slice(&bytes) {
            Ok(i) => i,
            Err(e) => {
                tracing::warn!("image record {}: {e}", path.display());
                return None;
            }
        };
        let complete = match &image.rootfs {
            Rootfs::Layers(dirs) => dirs
                .iter()
                .all(|d| d.is_dir() && !d.with_extension("damaged").exists()),
            Rootfs::Squashfs { file, .. } => file.is_file(),
        };
        complete.then_some(image)
    }

    fn read_ref(&self, key: &str) -> Option<RefRecord> {
        let bytes = std::fs::read(self.ref_path(key)).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    /// The stored image for `reference`: by digest when a registry reference pins one (only an
    /// image pulled from a registry: a digest names no file a user could read), else through the
    /// reference's record. A local reference is found only with the stamp of the file the user
    /// opened for it, equal to the recorded one: a changed or other file is a miss, so its
    /// content gets imported.
    pub fn get(&self, reference: &Reference) -> Option<Image> {
        self.get_stamped(reference, None)
    }

    /// [`Store::get_stamped`] for a local reference opened by this process (tests).
    #[cfg(test)]
    pub(crate) fn get_local(&self, reference: &Reference) -> Option<Image> {
        let opened = crate::local::Opened::open(reference, None).ok()?;
        self.get_stamped(reference, Some(&opened.stamp))
    }

    /// [`Store::get`] with the stamp of the file the user opened for a local reference.
    pub fn get_stamped(&self, reference: &Reference, stamp: Option<&FileStamp>) -> Option<Image> {
        if let Reference::Registry(r) = reference
            && let Some(d) = &r.digest
            && let Some(image) = self.image(d)
            && matches!(image.source, Reference::Registry(_))
        {
            return Some(image);
        }
        let rec = self.read_ref(&reference_key(reference))?;
        if is_local_path(reference) && (rec.file.is_none() || rec.file.as_ref() != stamp) {
            return None;
        }
        self.image(&rec.digest)
    }

    /// [`Store::get`] for user `uid`: an image pulled with credentials (not `anonymous`) is
    /// given to root or to a user for whom `confirm` (e.g. a registry HEAD request with that
    /// user's credentials) says yes. A "no" is a miss, so the caller imports with the user's
    /// own credentials, which then succeeds or fails with the registry's answer.
    pub fn get_for(
        &self,
        reference: &Reference,
        uid: u32,
        confirm: impl FnOnce(&Image) -> Result<bool, ImageError>,
    ) -> Result<Option<Image>, ImageError> {
        self.get_for_stamped(reference, None, uid, confirm)
    }

    /// [`Store::get_for`] with the stamp of the file the user opened for a local reference.
    pub fn get_for_stamped(
        &self,
        reference: &Reference,
        stamp: Option<&FileStamp>,
        uid: u32,
        confirm: impl FnOnce(&Image) -> Result<bool, ImageError>,
    ) -> Result<Option<Image>, ImageError> {
        let Some(image) = self.get_stamped(reference, stamp) else {
            return Ok(None);
        };
        if image.anonymous || uid == 0 || confirm(&image)? {
            Ok(Some(image))
        } else {
            Ok(None)
        }
    }

    /// Marks `digest` in use until the guard is dropped (hold it while a container runs).
    pub fn use_image(&self, digest: &str) -> Result<InUse, ImageError> {
        let path = self.use_path(digest)?;
        if self.image(digest).is_none() {
            return Err(ImageError::Store(StoreError::NotStored(digest.to_string())));
        }
        let file = fs::lock(&path, LockMode::Shared, true)
            .map_err(|e| {
                self.io(
                    format!("locking use/{}", digest_hex(digest).unwrap_or("")),
                    e,
                )
            })?
            .ok_or_else(|| StoreError::NotStored(digest.to_string()))?;
        // gc may have removed the image while we waited for the lock.
        if self.image(digest).is_none() {
            return Err(ImageError::Store(StoreError::NotStored(digest.to_string())));
        }
        let _ = file.set_modified(SystemTime::now());
        Ok(InUse {
            file,
            digest: digest.to_string(),
        })
    }

    fn touch_used(&self, digest: &str) {
        if let Ok(path) = self.use_path(digest)
            && let Ok(f) = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .open(path)
        {
            let _ = f.set_modified(SystemTime::now());
        }
    }

    // -----------------------------------------------------------------------------------------
    // Writing

    fn write_image(&self, ws: &Workspace, image: &Image) -> Result<(), ImageError> {
        let path = self.image_path(&image.digest)?;
        let bytes = serde_json::to_vec_pretty(image)
            .map_err(|e| self.io("encoding an image record", e.into()))?;
        fs::write_atomic(ws, &path, &bytes)
            .map_err(|e| self.write_error("writing an image record", e))
    }

    fn write_ref(
        &self,
        ws: &Workspace,
        reference: &Reference,
        digest: &str,
        stamp: Option<&FileStamp>,
    ) -> Result<(), ImageError> {
        let key = reference_key(reference);
        let rec = RefRecord {
            reference: key.clone(),
            source: reference.clone(),
            digest: digest.to_string(),
            file: stamp.cloned(),
        };
        let bytes = serde_json::to_vec_pretty(&rec)
            .map_err(|e| self.io("encoding a reference", e.into()))?;
        fs::write_atomic(ws, &self.ref_path(&key), &bytes)
            .map_err(|e| self.write_error("writing a reference", e))
    }

    fn write_error(&self, op: &str, e: std::io::Error) -> ImageError {
        if matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT)) {
            ImageError::Store(StoreError::NoSpace {
                root: self.root.clone(),
                what: op.to_string(),
                needed: "a little".into(),
                free: self.free_text(),
            })
        } else {
            self.io(op, e)
        }
    }

    /// Imports image `digest` once: returns the stored image if present; otherwise takes the
    /// image's import lock (waiting for, then reusing, a concurrent import of it), runs `build`
    /// (which stages and publishes the layers through the store's [`LayerSink`]) and records
    /// the result and `reference`. `reference` is recorded as pointing at `digest` in all cases.
    pub fn import_with(
        &self,
        digest: &str,
        reference: &Reference,
        progress: Progress<'_>,
        build: impl FnOnce(&Store) -> Result<Image, ImageError>,
    ) -> Result<Image, ImageError> {
        self.import_stamped(digest, reference, None, progress, build)
    }

    /// [`Store::import_with`] recording `stamp`, the file the user opened for a local reference
    /// (a local reference recorded without one is never found again by [`Store::get_stamped`]).
    pub fn import_stamped(
        &self,
        digest: &str,
        reference: &Reference,
        stamp: Option<&FileStamp>,
        progress: Progress<'_>,
        build: impl FnOnce(&Store) -> Result<Image, ImageError>,
    ) -> Result<Image, ImageError> {
        let hex = digest_hex(digest)?.to_string();
        let _store = self.lock("store", LockMode::Shared)?;
        let cleaned = fs::clean_tmp(&self.dir("tmp"));
        if cleaned > 0 {
            tracing::info!("removed {cleaned} leftover import workspaces");
        }
        let ws = self.workspace()?;
        let done = |image: Image| -> Result<Image, ImageError> {
            self.write_ref(&ws, reference, &image.digest, stamp)?;
            self.touch_used(&image.digest);
            Ok(image)
        };
        // A local file the user opened (`stamp`) is always read: the store holding its digest
        // is no proof that this user could read the layers (the build hashes what it has).
        if stamp.is_none()
            && let Some(image) = self.image(digest)
        {
            progress(&format!("{digest}: already in the store"));
            return done(image);
        }
        let lock_path = self.dir("locks").join(format!("image-{hex}"));
        let _lock = match fs::lock(&lock_path, LockMode::Exclusive, false)
            .map_err(|e| self.io("locking an image", e))?
        {
            Some(l) => l,
            None => {
                progress(&format!(
                    "{digest}: waiting for another import of it to finish"
                ));
                self.lock(&format!("image-{hex}"), LockMode::Exclusive)?
            }
        };
        if stamp.is_none()
            && let Some(image) = self.image(digest)
        {
            progress(&format!(
                "{digest}: imported by another process; reusing it"
            ));
            return done(image);
        }
        let counter = Arc::new(AtomicU64::new(0));
        *self.image_bytes.lock().unwrap_or_else(|p| p.into_inner()) = Some(counter);
        let built = build(self);
        *self.image_bytes.lock().unwrap_or_else(|p| p.into_inner()) = None;
        let mut image = built?;
        if let Rootfs::Layers(dirs) = &image.rootfs {
            self.check_image_bytes(dirs)?;
            image.rootfs = Rootfs::Layers(self.copy_up(dirs.clone())?);
        }
        if image.digest != digest {
            return Err(ImageError::Store(StoreError::Message(format!(
                "internal error: importing {digest} produced an image with digest {}",
                image.digest
            ))));
        }
        self.write_image(&ws, &image)?;
        done(image)
    }

    /// Records an image made by another source (squashfs, SIF) and its reference, replacing an
    /// older record of the same digest.
    pub fn record(&self, image: &Image) -> Result<(), ImageError> {
        let hex = digest_hex(&image.digest)?.to_string();
        let _store = self.lock("store", LockMode::Shared)?;
        let _lock = self.lock(&format!("image-{hex}"), LockMode::Exclusive)?;
        let ws = self.workspace()?;
        // A local source is stamped as this process opens it (see Store::get_stamped).
        let stamp = is_local_path(&image.source)
            .then(|| crate::local::Opened::open(&image.source, None).ok())
            .flatten()
            .map(|o| o.stamp);
        self.write_image(&ws, image)?;
        self.write_ref(&ws, &image.source, &image.digest, stamp.as_ref())?;
        self.touch_used(&image.digest);
        Ok(())
    }
}

#[cfg(test)]
mod tests;
