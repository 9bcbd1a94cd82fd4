//! The dataset cache: a staged dataset kept on node-local disk across jobs, so that the next job
//! staging the same unchanged dataset gets hardlinks instead of a copy.
//!
//! Opt-in per source prefix (`stage.cache_prefixes`), for directories only. An entry is keyed by
//! the canonical source path and holds the data tree and the manifest of the source it was made
//! from (each entry's path, kind, size, mode, mtime, device, inode and symlink target). A stage
//! through the cache:
//!
//! 1. walks the source in a child with the job user's credentials, opening every file: a
//!    manifest exists only if that user can read all of it, so the cache never hands data to a
//!    user who could not have copied it;
//! 2. takes the entry's lock shared; if the entry's manifest equals the user's, it is served as
//!    is. Otherwise, under the exclusive lock, root builds a new entry in `tmp/` (files unchanged
//!    since the old entry are hardlinked from it, the others copied from the source, each checked
//!    to be the very inode the user's walk opened), syncs it and renames it into place: an entry
//!    is complete or absent, never half-written;
//! 3. hardlinks the entry's files into the destination. Directories and symlinks there are the
//!    user's; the files stay root's, with the source's group and permission bits made read-only
//!    (never wider: a 0640 file is 0440 there, a 0600 one 0400), so a job can read, delete or
//!    replace its copy but never write into the shared one, and the link lets read it whom the
//!    source let read it. A file the user could read only as its owner (root owns the entry's)
//!    is copied instead, as across filesystems: reflinked or copied, the user's, with the
//!    source's mode;
//! 4. evicts least-recently-used entries beyond `stage.cache_max_bytes`, never one that a stage
//!    holds locked.
//!
//! Layout under `stage.cache_dir` (0700, root's):
//!
//! ```text
//! entries/<key>/data/...        the dataset tree
//! entries/<key>/manifest.json   the source's manifest when the entry was made
//! entries/<key>/meta.json       source path and bytes, read by eviction
//! locks/<key>.lock              shared while served, exclusive while filled or evicted
//! tmp/<key>.<pid>.<nanos>/      an entry being filled; a killed fill's is removed by the next
//!                               holder of the key's exclusive lock
//! ```
//!
//! An entry's last use is its directory's mtime.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::Ordering;
use std::time::{Instant, SystemTime};

use serde::{Deserialize, Serialize};

use super::{
    Kind, Options, Report, StageError, as_user, fsops, open_source, parallel,
    progress::with_progress, tree, walk,
};
use berth_sys::UserIds;

mod link;
use self::link::{link_into, verify};

/// Where the cache lives and what it covers (`[stage] cache_*`).
#[derive(Clone, Debug, PartialEq)]
pub struct CacheOptions {
    pub dir: PathBuf,
    /// Sources under these directories are cached; others are copied.
    pub prefixes: Vec<PathBuf>,
    /// Least-recently-used entries are evicted beyond this many bytes (file sizes).
    pub max_bytes: u64,
}

impl CacheOptions {
    /// The canonical path of `source` when it is a directory under one of the prefixes.
    pub fn covers(&self, source: &Path) -> Option<PathBuf> {
        let canon = std::fs::canonicalize(source).ok()?;
        if !canon.is_dir() {
            return None;
        }
        self.prefixes
            .iter()
            .any(|p| {
                canon.starts_with(p) || std::fs::canonicalize(p).is_ok_and(|p| canon.starts_with(p))
            })
            .then_some(canon)
    }
}

/// One source entry as the user's walk saw it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Item {
    rel: PathBuf,
    kind: Kind,
    size: u64,
    mode: u32,
    /// The owning group, which the entry's file keeps (0 in a manifest from before it was kept).
    #[serde(default)]
    gid: u32,
    mtime: (i64, i64),
    dev: u64,
    ino: u64,
    target: Option<PathBuf>,
}

/// A source tree's state: the cache serves an entry only for an identical manifest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Manifest {
    source: PathBuf,
    /// A directory before its contents; the first item is the root.
    items: Vec<Item>,
    /// The entry holds the `user.*` extended attributes (`stage.xattrs`): an entry made without
    /// them is not served to a stage that asks for them, nor the other way round.
    #[serde(default)]
    xattrs: bool,
    /// How the entry's files were made ([`ENTRY_FORMAT`]): an entry of another format is
    /// neither served nor linked from, so that no file an older berth made 0444 outlives it.
    #[serde(default)]
    format: u32,
}

/// The format of the entries this berth makes: 1 keeps the source's group and permission bits
/// (read-only); entries without a format made every file readable by all.
const ENTRY_FORMAT: u32 = 1;

impl Manifest {
    fn bytes(&self) -> u64 {
        self.files().map(|i| i.size).sum()
    }

    fn files(&self) -> impl Iterator<Item = &Item> {
        self.items.iter().filter(|i| i.kind == Kind::File)
    }
}

/// For each item of `new`: whether the old entry holds the same file (same inode, size, mtime
/// and mode at the source), so that the new entry can hardlink it instead of copying.
fn reusable(old: Option<&Manifest>, new: &Manifest) -> Vec<bool> {
    let old: HashMap<&Path, &Item> = old
        .filter(|m| m.xattrs == new.xattrs && m.format == new.format)
        .map(|m| m.files().map(|i| (i.rel.as_path(), i)).collect())
        .unwrap_or_default();
    new.items
        .iter()
        .map(|i| {
            i.kind == Kind::File
                && old.get(i.rel.as_path()).is_some_and(|o| {
                    (o.size, o.mtime, o.mode, o.gid, o.dev, o.ino)
                        == (i.size, i.mtime, i.mode, i.gid, i.dev, i.ino)
                })
        })
        .collect()
}

/// What eviction knows of an entry.
#[derive(Clone, Debug, PartialEq)]
struct EntryInfo {
    key: String,
    bytes: u64,
    last_use: SystemTime,
    /// Locked by a stage (or a fill): never evicted.
    busy: bool,
}

/// The entries to evict, least recently used first, until the rest fits in `max` bytes.
fn victims(entries: &[EntryInfo], max: u64) -> Vec<&EntryInfo> {
    let mut total: u64 = entries.iter().map(|e| e.bytes).sum();
    let mut order: Vec<&EntryInfo> = entries.iter().filter(|e| !e.busy).collect();
    order.sort_by_key(|e| e.last_use);
    let mut out = Vec::new();
    for e in order {
        if total <= max {
            break;
        }
        total -= e.bytes;
        out.push(e);
    }
    out
}

/// Mode of a cached file (root's, in the source's group): the source's permission bits without
/// the write bits (no job may write into a shared entry) and without setuid, setgid and sticky,
/// never wider than the source's. A link to it lets read it whom the source let read it (its
/// group, others), and no one else: the source's owner reads it through a copy of their own.
/// With an access ACL the group bits are the ACL's mask, not the group's: they are dropped.
fn cache_mode(mode: u32, acl: bool) -> u32 {
    let mode = mode & 0o555;
    if acl { mode & !0o070 } else { mode }
}

/// Whether `user` may read a file of `mode` owned by `owner` and `group`, as the kernel decides
/// it from the permission bits: the owner's bits for its owner, the group's for a member, the
/// others' for the rest (root reads anything).
fn may_read(user: &UserIds, (owner, group, mode): (u32, u32, u32)) -> bool {
    let bit = if user.uid == 0 {
        return true;
    } else if user.uid == owner {
        0o400
    } else if user.gid == group || user.groups.contains(&group) {
        0o040
    } else {
        0o004
    };
    mode & bit != 0
}

/// Whether the source file `fd` has an access ACL (beyond its permission bits).
fn has_access_acl(fd: &OwnedFd) -> std::io::Result<bool> {
    use std::os::fd::AsRawFd;
    // nix has no xattr calls.
    // SAFETY: `fd` is open; the name is a valid C string; a null buffer of length 0 asks only
    // for the value's size.
    let n = unsafe {
        libc::fgetxattr(
            fd.as_raw_fd(),
            c"system.posix_acl_access".as_ptr(),
            std::ptr::null_mut(),
            0,
        )
    };
    if n >= 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::ENODATA | libc::EOPNOTSUPP) => Ok(false),
        _ => Err(e),
    }
}

fn key(canon: &Path) -> String {
    use sha2::Digest;
    use std::os::unix::ffi::OsStrExt;
    let digest = sha2::Sha256::digest(canon.as_os_str().as_bytes());
    digest[..16].iter().map(|b| format!("{b:02x}")).collect()
}

/// The user's walk of the source: every directory listed and every file opened with the user's
/// credentials (the read check), symlink targets read.
fn survey(source: &Path, workers: usize) -> Result<Manifest, StageError> {
    let plan = walk(source, None, workers)?;
    let targets: Vec<OnceLock<PathBuf>> = plan.entries.iter().map(|_| OnceLock::new()).collect();
    parallel(plan.entries.len(), workers, |i| {
        let e = &plan.entries[i];
        let path = source.join(&e.rel);
        match e.kind {
            Kind::File => drop(open_source(&path)?),
            Kind::Symlink => {
                let t = std::fs::read_link(&path)
                    .map_err(|source| StageError::Source { path, source })?;
                let _ = targets[i].set(t);
            }
            Kind::Dir => {}
        }
        Ok(())
    })?;
    let items = plan
        .entries
        .into_iter()
        .zip(targets)
        .map(|(e, t)| Item {
            rel: e.rel,
            kind: e.kind,
            size: e.size,
            mode: e.mode,
            gid: e.gid,
            mtime: e.mtime,
            dev: e.dev,
            ino: e.ino,
            target: t.into_inner(),
        })
        .collect();
    Ok(Manifest {
        source: source.to_path_buf(),
        items,
        xattrs: false,
        format: ENTRY_FORMAT,
    })
}

fn cache_err(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> StageError + use<> {
    let path = path.to_path_buf();
    move |source| StageError::Cache { op, path, source }
}

struct Cache {
    dir: PathBuf,
    /// The cache directory, checked root's all the way from `/` (no other user can change
    /// anything beneath it, so paths under it stay what they name).
    fd: OwnedFd,
}

impl Cache {
    /// Opens the cache directory, made root's 0700 if missing; one that another user owns or
    /// could change, or a symlink, is refused in one line (it would hand that user every cached
    /// dataset).
    fn open(dir: &Path) -> Result<Self, StageError> {
        let fd = berth_sys::privfs::root_dir(dir, 0o700).map_err(StageError::CacheDir)?;
        for sub in [c"entries", c"locks", c"tmp"] {
            let p = dir.join(sub.to_string_lossy().as_ref());
            let mode = nix::sys::stat::Mode::from_bits_retain(0o700);
            match nix::sys::stat::mkdirat(&fd, sub, mode) {
                Ok(()) | Err(nix::errno::Errno::EEXIST) => {}
                Err(e) => return Err(cache_err("create", &p)(e.into())),
            }
            // A directory, not a symlink in its place.
            tree::open_dir_at(&fd, sub).map_err(cache_err("open", &p))?;
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            fd,
        })
    }

    /// Removes `name` in the cache's `tmp/` and everything in it, by fd.
    fn remove_tmp(&self, name: &std::ffi::OsStr) {
        use std::os::unix::ffi::OsStrExt;
        let Ok(name) = std::ffi::CString::new(name.as_bytes()) else {
            return;
        };
        if let Ok(tmp) = tree::open_dir_at(&self.fd, c"tmp") {
            let _ = tree::remove_at(&tmp, &name);
        }
    }

    fn entry(&self, key: &str) -> PathBuf {
        self.dir.join("entries").join(key)
    }

    /// Locks `key` (waiting); with `exclusive` false, a shared lock.
    fn lock(&self, key: &str, exclusive: bool) -> Result<File, StageError> {
        let path = self.dir.join("locks").join(format!("{key}.lock"));
        let f = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(cache_err("open", &path))?;
        if exclusive { f.lock() } else { f.lock_shared() }.map_err(cache_err("lock", &path))?;
        Ok(f)
    }

    /// Locks `key` exclusively if no one holds it.
    fn try_lock(&self, key: &str) -> Option<File> {
        let path = self.dir.join("locks").join(format!("{key}.lock"));
        let f = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .ok()?;
        f.try_lock().ok().map(|_| f)
    }

    fn manifest(&self, key: &str) -> Option<Manifest> {
        let bytes = std::fs::read(self.entry(key).join("manifest.json")).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    /// Removes what killed fills of `key` left in `tmp/` (the caller holds `key` exclusively:
    /// no live fill of it exists).
    fn clean_tmp(&self, key: &str) {
        let Ok(rd) = std::fs::read_dir(self.dir.join("tmp")) else {
            return;
        };
        let prefix = format!("{key}.");
        for e in rd.flatten() {
            if e.file_name().to_string_lossy().starts_with(&prefix) {
                self.remove_tmp(&e.file_name());
            }
        }
    }

    /// Builds the entry for `m` in `tmp/` and renames it into place; returns the files and bytes
    /// copied from the source. The caller holds `key` exclusively.
    fn fill(
        &self,
        key: &str,
        m: &Manifest,
        old: Option<&Manifest>,
        user: &UserIds,
        opts: &Options,
    ) -> Result<(u64, u64), StageError> {
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let tmp = self
            .dir
            .join("tmp")
            .join(format!("{key}.{}.{nanos}", std::process::id()));
        std::fs::create_dir(&tmp).map_err(cache_err("create", &tmp))?;
        let result = self.fill_in(&tmp, key, m, old, user, opts);
        if result.is_err()
            && let Some(name) = tmp.file_name()
        {
            self.remove_tmp(name);
        }
        result
    }

    fn fill_in(
        &self,
        tmp: &Path,
        key: &str,
        m: &Manifest,
        old: Option<&Manifest>,
        user: &UserIds,
        opts: &Options,
    ) -> Result<(u64, u64), StageError> {
        let data_path = tmp.join("data");
        std::fs::create_dir(&data_path).map_err(cache_err("create", &data_path))?;
        let data = open_dir(&data_path).map_err(cache_err("open", &data_path))?;
        // The source root, checked to be the directory the user's walk listed; everything
        // below is opened beneath it without following symlinks.
        // Opened as the user (root never follows the user's path), then used by fd only.
        let src_root = berth_sys::privfs::open_as_user(
            &m.source,
            user,
            nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_DIRECTORY,
        )
        .map_err(|source| StageError::Source {
            path: m.source.clone(),
            source,
        })?;
        let st = fsops::fstat(&src_root).map_err(cache_err("inspect", &m.source))?;
        let root_item = &m.items[0];
        if (st.st_dev, st.st_ino) != (root_item.dev, root_item.ino) {
            return Err(changed(&m.source));
        }
        let old_data = match old {
            Some(_) => {
                let p = self.entry(key).join("data");
                Some(open_dir(&p).map_err(cache_err("open", &p))?)
            }
            None => None,
        };
        let reuse = reusable(old, m);
        // What is copied from the source must fit the cache's filesystem.
        let (to_copy, bytes_to_copy) = m
            .items
            .iter()
            .zip(&reuse)
            .filter(|(i, r)| i.kind == Kind::File && !**r)
            .fold((0, 0), |(n, b), (i, _)| (n + 1, b + i.size));
        let free = fsops::available_bytes(&data).map_err(cache_err("inspect", &data_path))?;
        if bytes_to_copy > free {
            return Err(StageError::NoSpace {
                dest: self.dir.clone(),
                needed: bytes_to_copy,
                available: free,
                limit: "free space of the dataset cache",
            });
        }
        for i in m.items.iter().filter(|i| i.kind == Kind::Dir) {
            if !i.rel.as_os_str().is_empty() {
                fsops::mkdir_beneath(&data, &i.rel, 0o755)
                    .map_err(cache_err("create", &data_path.join(&i.rel)))?;
            }
            if m.xattrs {
                let flags = libc::O_RDONLY | libc::O_DIRECTORY;
                let src = m.source.join(&i.rel);
                let sfd = fsops::open_beneath(&src_root, &i.rel, flags, 0)
                    .map_err(|source| StageError::Source { path: src, source })?;
                let dfd = fsops::open_beneath(&data, &i.rel, flags, 0)
                    .map_err(cache_err("open", &data_path.join(&i.rel)))?;
                fsops::copy_xattrs(&sfd, &dfd)
                    .map_err(cache_err(super::XATTRS_OP, &data_path.join(&i.rel)))?;
            }
        }
        let way = fsops::CopyWay::default();
        let files = m.files().count() as u64;
        with_progress(opts, (files - to_copy, files), bytes_to_copy, |progress| {
            parallel(m.items.len(), opts.workers, |n| {
                let i = &m.items[n];
                let dest = || data_path.join(&i.rel);
                match i.kind {
                    Kind::Dir => {}
                    Kind::Symlink => {
                        let target = i.target.as_deref().unwrap_or(Path::new(""));
                        fsops::symlink_beneath(&data, target, &i.rel)
                            .map_err(cache_err("create", &dest()))?;
                        fsops::set_mtime_beneath(&data, &i.rel, i.mtime)
                            .map_err(cache_err("set the mtime of", &dest()))?;
                    }
                    Kind::File if reuse[n] => {
                        let od = old_data.as_ref().expect("reuse implies an old entry");
                        fsops::link_beneath(od, &i.rel, &data, &i.rel)
                            .map_err(cache_err("link", &dest()))?;
                    }
                    Kind::File => {
                        fill_file(i, &m.source, &src_root, &data, &data_path, &way, m.xattrs)?;
                        progress.files.fetch_add(1, Ordering::Relaxed);
                        progress.bytes.fetch_add(i.size, Ordering::Relaxed);
                    }
                }
                Ok(())
            })
        })?;
        let write = |name: &str, value: &[u8]| -> Result<(), StageError> {
            let p = tmp.join(name);
            File::create(&p)
                .and_then(|mut f| f.write_all(value))
                .map_err(cache_err("write", &p))
        };
        write(
            "manifest.json",
            &serde_json::to_vec(m)
                .map_err(|e| cache_err("write", tmp)(std::io::Error::other(e)))?,
        )?;
        let meta = serde_json::json!({"source": m.source, "bytes": m.bytes()});
        write("meta.json", meta.to_string().as_bytes())?;
        // The entry's data on disk before it can be found.
        fsops::syncfs(&data).map_err(cache_err("sync", tmp))?;
        self.commit(tmp, key)?;
        Ok((to_copy, bytes_to_copy))
    }

    /// Moves a filled entry into place: atomically replacing an older one (which is then
    /// removed), so that a reader finds the old entry or the new, never neither half.
    fn commit(&self, tmp: &Path, key: &str) -> Result<(), StageError> {
        let entry = self.entry(key);
        if entry.exists() {
            rename_exchange(tmp, &entry).map_err(cache_err("replace", &entry))?;
            if let Some(name) = tmp.file_name() {
                self.remove_tmp(name);
            }
        } else {
            std::fs::rename(tmp, &entry).map_err(cache_err("publish", &entry))?;
        }
        Ok(())
    }

    /// Marks `key` as just used (its directory's mtime).
    fn touch(&self, key: &str) {
        let _ = File::open(self.entry(key)).and_then(|f| f.set_modified(SystemTime::now()));
    }

    /// Evicts least-recently-used entries until the cache holds at most `max` bytes, and removes
    /// the leftovers of killed fills; entries locked by a stage are kept.
    fn evict(&self, max: u64) {
        let mut held: HashMap<String, File> = HashMap::new();
        let mut infos = Vec::new();
        if let Ok(rd) = std::fs::read_dir(self.dir.join("entries")) {
            for e in rd.flatten() {
                let key = e.file_name().to_string_lossy().into_owned();
                let bytes = std::fs::read(e.path().join("meta.json"))
                    .ok()
                    .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
                    .and_then(|v| v["bytes"].as_u64())
                    .unwrap_or(0);
                let last_use = e
                    .metadata()
                    .and_then(|m| m.modified())
                    .unwrap_or(SystemTime::UNIX_EPOCH);
                let lock = self.try_lock(&key);
                let busy = lock.is_none();
                if let Some(l) = lock {
                    held.insert(key.clone(), l);
                }
                infos.push(EntryInfo {
                    key,
                    bytes,
                    last_use,
                    busy,
                });
            }
        }
        for v in victims(&infos, max) {
            let gone = self.dir.join("tmp").join(format!("{}.evicted", v.key));
            if std::fs::rename(self.entry(&v.key), &gone).is_ok() {
                self.remove_tmp(gone.file_name().unwrap_or_default());
                tracing::info!(key = v.key, bytes = v.bytes, "dataset cache: evicted");
            }
        }
        drop(held);
        // Killed fills of keys no one holds now.
        if let Ok(rd) = std::fs::read_dir(self.dir.join("tmp")) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let key = name.split('.').next().unwrap_or_default();
                if let Some(_lock) = self.try_lock(key) {
                    self.remove_tmp(&e.file_name());
                }
            }
        }
    }
}

fn changed(path: &Path) -> StageError {
    StageError::Conflict {
        path: path.to_path_buf(),
        message: "changed while it was being staged; stage again".into(),
    }
}

/// Copies the file `i` of the source (opened beneath `src_root`) into an entry being filled
/// (`data`), read-only, once it is checked to be the very inode the user's walk opened and
/// unchanged since.
fn fill_file(
    i: &Item,
    source: &Path,
    src_root: &OwnedFd,
    data: &OwnedFd,
    data_path: &Path,
    way: &fsops::CopyWay,
    xattrs: bool,
) -> Result<(), StageError> {
    let src = source.join(&i.rel);
    let dest = data_path.join(&i.rel);
    let src_err = |source| StageError::Source {
        path: src.clone(),
        source,
    };
    let sfd = fsops::open_beneath(src_root, &i.rel, libc::O_RDONLY, 0).map_err(src_err)?;
    let st = fsops::fstat(&sfd).map_err(src_err)?;
    let seen = (
        st.st_dev,
        st.st_ino,
        // A size the kernel reports is never negative.
        st.st_size.cast_unsigned(),
        (st.st_mtime, st.st_mtime_nsec),
    );
    if seen != (i.dev, i.ino, i.size, i.mtime) {
        return Err(changed(&src));
    }
    let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL;
    let dfd =
        fsops::open_beneath(data, &i.rel, flags, 0o600).map_err(cache_err("create", &dest))?;
    fsops::copy_data(&sfd, &dfd, 0, i.size, i.size, way).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => src_err(e),
        _ => cache_err("write", &dest)(e),
    })?;
    if xattrs {
        fsops::copy_xattrs(&sfd, &dfd).map_err(cache_err(super::XATTRS_OP, &dest))?;
    }
    let acl = has_access_acl(&sfd).map_err(src_err)?;
    fsops::fchown(&dfd, 0, i.gid).map_err(cache_err("chown", &dest))?;
    fsops::fchmod(&dfd, cache_mode(i.mode, acl)).map_err(cache_err("chmod", &dest))?;
    fsops::set_mtime_fd(&dfd, i.mtime).map_err(cache_err("set the mtime of", &dest))
}

fn open_dir(path: &Path) -> std::io::Result<OwnedFd> {
    use std::os::unix::fs::OpenOptionsExt;
    File::options()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(path)
        .map(OwnedFd::from)
}

fn rename_exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let ca = std::ffi::CString::new(a.as_os_str().as_bytes())?;
    let cb = std::ffi::CString::new(b.as_os_str().as_bytes())?;
    use nix::fcntl::{AT_FDCWD, RenameFlags};
    nix::fcntl::renameat2(
        AT_FDCWD,
        ca.as_c_str(),
        AT_FDCWD,
        cb.as_c_str(),
        RenameFlags::RENAME_EXCHANGE,
    )
    .map_err(std::io::Error::from)
}

/// Stages the directory `canon` (canonical, under a cache prefix) into `base/rel` for `user`
/// through the cache. Runs as root, single-threaded (it forks the user's walk).
pub(super) fn stage_cached(
    user: &UserIds,
    canon: &Path,
    base: &Path,
    rel: &Path,
    opts: &Options,
    cache: &CacheOptions,
) -> Result<Report, StageError> {
    let start = Instant::now();
    let workers = opts.workers;
    let mut manifest = as_user(user, || survey(canon, workers))?;
    manifest.xattrs = opts.xattrs;
    if manifest.bytes() > cache.max_bytes {
        // Larger than the whole cache: copied as without one.
        return as_user(user, || super::stage(canon, base, rel, opts));
    }
    let c = Cache::open(&cache.dir)?;
    let key = key(canon);
    let mut lock = c.lock(&key, false)?;
    let mut copied = (0, 0);
    if c.manifest(&key).as_ref() != Some(&manifest) {
        drop(lock);
        lock = c.lock(&key, true)?;
        c.clean_tmp(&key);
        // Another stage may have filled it while this one waited.
        let old = c.manifest(&key);
        if old.as_ref() != Some(&manifest) {
            match c.fill(&key, &manifest, old.as_ref(), user, opts) {
                Ok(done) => copied = done,
                // No room in the cache: this job gets a plain copy.
                Err(StageError::NoSpace {
                    needed, available, ..
                }) => {
                    drop(lock);
                    tracing::warn!(
                        "dataset cache {}: no room for {} (needs {needed} bytes, {available} \
                         available); staging without the cache",
                        cache.dir.display(),
                        canon.display()
                    );
                    return as_user(user, || super::stage(canon, base, rel, opts));
                }
                Err(e) => return Err(e),
            }
        }
        // Shared again for the linking (flock converts in place; no one can slip in between
        // since a conversion to shared conflicts with no other holder).
        lock.lock_shared()
            .map_err(cache_err("lock", &c.entry(&key)))?;
    }
    c.touch(&key);
    let mut report = link_into(
        &c.entry(&key).join("data"),
        &manifest,
        base,
        rel,
        user,
        opts,
    )?;
    report.files_copied = copied.0;
    report.bytes_copied = copied.1;
    if opts.verify {
        let dest = base.join(rel);
        as_user(user, || verify(&manifest, &dest))?;
        report.verified = true;
    }
    c.evict(cache.max_bytes);
    drop(lock);
    report.seconds = start.elapsed().as_secs_f64();
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn item(rel: &str, size: u64, mtime: i64, ino: u64) -> Item {
        Item {
            rel: rel.into(),
            kind: Kind::File,
            size,
            mode: 0o644,
            gid: 100,
            mtime: (mtime, 0),
            dev: 1,
            ino,
            target: None,
        }
    }

    fn manifest(items: Vec<Item>) -> Manifest {
        let mut all = vec![Item {
            kind: Kind::Dir,
            ..item("", 0, 0, 1)
        }];
        all.extend(items);
        Manifest {
            source: "/data/set".into(),
            items: all,
            xattrs: false,
            format: ENTRY_FORMAT,
        }
    }

    #[test]
    fn manifests_compare_by_every_field_and_unchanged_files_are_reused() {
        let old = manifest(vec![
            item("a", 10, 5, 2),
            item("b", 20, 5, 3),
            item("c", 30, 5, 4),
        ]);
        assert_eq!(old, old.clone());
        // b rewritten in place (new mtime), c replaced by another inode, d new.
        let new = manifest(vec![
            item("a", 10, 5, 2),
            item("b", 20, 6, 3),
            item("c", 30, 5, 9),
            item("d", 1, 5, 10),
        ]);
        assert_ne!(old, new);
        assert_eq!(
            reusable(Some(&old), &new),
            [false, true, false, false, false]
        );
        assert_eq!(reusable(None, &new), [false; 5]);
        // A mode change alone makes a different manifest, and the file is copied again.
        let mut chmod = old.clone();
        chmod.items[1].mode = 0o600;
        assert_ne!(old, chmod);
        assert!(!reusable(Some(&old), &chmod)[1]);
        // So does a group change (the entry's file keeps the group).
        let mut chgrp = old.clone();
        chgrp.items[1].gid = 0;
        assert_ne!(old, chgrp);
        assert!(!reusable(Some(&old), &chgrp)[1]);
        // An entry of an older format (files made 0444) is never linked from.
        let mut older = old.clone();
        older.format = 0;
        assert_ne!(old, older);
        assert_eq!(reusable(Some(&older), &old), [false; 4]);
        assert_eq!(new.bytes(), 61);
    }

    #[test]
    fn eviction_takes_least_recently_used_first_and_never_a_busy_entry() {
        let t = |s| SystemTime::UNIX_EPOCH + Duration::from_secs(s);
        let e = |key: &str, bytes, last, busy| EntryInfo {
            key: key.into(),
            bytes,
            last_use: t(last),
            busy,
        };
        let entries = vec![
            e("new", 100, 30, false),
            e("old", 100, 10, false),
            e("mid", 100, 20, false),
        ];
        let keys = |v: Vec<&EntryInfo>| v.iter().map(|e| e.key.clone()).collect::<Vec<_>>();
        assert_eq!(keys(victims(&entries, 300)), Vec::<String>::new());
        assert_eq!(keys(victims(&entries, 250)), ["old"]);
        assert_eq!(keys(victims(&entries, 100)), ["old", "mid"]);
        // The oldest is in use: the next ones go instead, and the cap may stay exceeded.
        let busy = vec![
            e("old", 100, 10, true),
            e("mid", 100, 20, false),
            e("new", 100, 30, false),
        ];
        assert_eq!(keys(victims(&busy, 150)), ["mid", "new"]);
        assert_eq!(keys(victims(&busy, 0)), ["mid", "new"]);
    }

    #[test]
    fn cached_files_are_never_writable_nor_wider_than_their_source() {
        assert_eq!(cache_mode(0o644, false), 0o444);
        assert_eq!(cache_mode(0o640, false), 0o440);
        assert_eq!(cache_mode(0o600, false), 0o400);
        assert_eq!(cache_mode(0o700, false), 0o500);
        assert_eq!(cache_mode(0o755, false), 0o555);
        assert_eq!(cache_mode(0o1777, false), 0o555);
        assert_eq!(cache_mode(0o7777, false), 0o555);
        assert_eq!(cache_mode(0o000, false), 0o000);
        // With an ACL the group bits are its mask: dropped.
        assert_eq!(cache_mode(0o640, true), 0o400);
        assert_eq!(cache_mode(0o755, true), 0o505);
        for mode in 0..=0o7777 {
            for acl in [false, true] {
                let m = cache_mode(mode, acl);
                assert_eq!(m & !mode, 0, "{mode:o} widened to {m:o}");
                assert_eq!(m & 0o7222, 0, "{mode:o} gave {m:o}");
            }
        }
    }

    #[test]
    fn a_link_to_a_cached_file_is_readable_as_the_source_was() {
        let user = |uid, gid, groups: &[u32]| UserIds {
            uid,
            gid,
            groups: groups.to_vec(),
            ..UserIds::default()
        };
        let owner = user(1000, 1000, &[1000]);
        let member = user(1001, 1001, &[1001, 500]);
        let other = user(1002, 1002, &[1002]);
        // The entry's files are root's, in the source's group (500).
        let cached = |mode| (0, 500, cache_mode(mode, false));
        // 0600: only a copy of the owner's own; a link serves no one.
        for u in [&owner, &member, &other] {
            assert!(!may_read(u, cached(0o600)), "{}", u.uid);
        }
        // 0640: the group reads the link; others do not.
        assert!(may_read(&member, cached(0o640)));
        assert!(!may_read(&other, cached(0o640)));
        // 0604: the kernel takes the group's bits for a member, and they say no.
        assert!(!may_read(&member, cached(0o604)));
        assert!(may_read(&other, cached(0o604)));
        assert!(may_read(&other, cached(0o644)));
        // The primary group counts as membership.
        assert!(may_read(&user(1003, 500, &[]), cached(0o640)));
        assert!(may_read(&user(0, 0, &[]), cached(0o000)));
    }

    #[test]
    fn keys_differ_by_path_and_are_plain_names() {
        let (a, b) = (key(Path::new("/data/a")), key(Path::new("/data/b")));
        assert_ne!(a, b);
        assert_eq!(a.len(), 32);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
    }
}
