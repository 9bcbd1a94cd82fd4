//! The store's file-system primitives: flock-based locks, the per-process temporary workspace
//! (under the store's `tmp/`, so publishing is a rename on the same file system), atomic file
//! writes and disk-use measurement.
//!
//! Crash safety: every partial entry lives in a workspace `tmp/<id>/` whose owner holds an
//! exclusive flock on `tmp/<id>.lock` for its whole life. The kernel drops the lock when the
//! owner dies (kill -9 included), so a later import or gc that can take the lock knows the
//! workspace is garbage and removes it. Nothing in `tmp/` is ever taken as complete.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{self, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

/// How a lock is taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LockMode {
    Shared,
    Exclusive,
}

/// Opens (creating) `path` and locks it. With `wait` false, returns `Ok(None)` when another
/// process holds a conflicting lock. Lock files may be deleted by gc (under the store's
/// exclusive lock); the loop makes sure the lock held is on the file that is at `path` now.
pub(crate) fn lock(path: &Path, mode: LockMode, wait: bool) -> io::Result<Option<File>> {
    loop {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        let locked = match (mode, wait) {
            (LockMode::Shared, true) => file.lock_shared().map(|_| true),
            (LockMode::Exclusive, true) => file.lock().map(|_| true),
            (LockMode::Shared, false) => try_result(file.try_lock_shared()),
            (LockMode::Exclusive, false) => try_result(file.try_lock()),
        }?;
        if !locked {
            return Ok(None);
        }
        match std::fs::metadata(path) {
            Ok(m) if same_file(&file, &m)? => return Ok(Some(file)),
            // Removed or replaced while we waited: lock the current file instead.
            Ok(_) => continue,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        }
    }
}

fn try_result(r: Result<(), TryLockError>) -> io::Result<bool> {
    match r {
        Ok(()) => Ok(true),
        Err(TryLockError::WouldBlock) => Ok(false),
        Err(TryLockError::Error(e)) => Err(e),
    }
}

fn same_file(file: &File, meta: &std::fs::Metadata) -> io::Result<bool> {
    let m = file.metadata()?;
    Ok(m.ino() == meta.ino() && m.dev() == meta.dev())
}

/// Whether someone holds a lock on `path` (a shared "in use" lock): tries an exclusive lock and
/// returns it when free, so the caller can act while no one can start using it.
pub(crate) fn try_exclusive(path: &Path) -> io::Result<Option<File>> {
    lock(path, LockMode::Exclusive, false)
}

/// A private temporary directory in the store's `tmp/`, alive as long as this value (and its
/// lock) is. Everything staged by this process goes in here.
#[derive(Debug)]
pub(crate) struct Workspace {
    dir: PathBuf,
    lock_path: PathBuf,
    _lock: File,
    counter: AtomicU64,
}

impl Workspace {
    pub fn create(tmp: &Path) -> io::Result<Self> {
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let id = format!("{}-{nanos:x}", std::process::id());
        let lock_path = tmp.join(format!("{id}.lock"));
        let fresh = tmp.join(format!("{id}.lock.new"));
        // Locked under a name cleaners ignore, then renamed: a cleaner never sees an unlocked
        // workspace lock of a live process.
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&fresh)?;
        lock.lock()?;
        std::fs::rename(&fresh, &lock_path)?;
        let dir = tmp.join(&id);
        if let Err(e) = std::fs::create_dir(&dir) {
            let _ = std::fs::remove_file(&lock_path);
            return Err(e);
        }
        Ok(Self {
            dir,
            lock_path,
            _lock: lock,
            counter: AtomicU64::new(0),
        })
    }

    /// A new, unused path in the workspace.
    pub fn path(&self, prefix: &str) -> PathBuf {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        self.dir.join(format!("{prefix}-{n}"))
    }
}

impl Drop for Workspace {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::fs::remove_file(&self.lock_path);
    }
}

/// Removes the workspaces of processes that died; returns how many.
pub(crate) fn clean_tmp(tmp: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return 0;
    };
    let mut names: Vec<String> = entries
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let mut removed = 0;
    for name in &names {
        let path = tmp.join(name);
        if let Some(id) = name.strip_suffix(".lock") {
            // Taking the lock proves its owner is gone.
            if let Ok(Some(_held)) = try_exclusive(&path) {
                let _ = std::fs::remove_dir_all(tmp.join(id));
                let _ = std::fs::remove_file(&path);
                removed += 1;
            }
        } else if name.ends_with(".lock.new") {
            let old = std::fs::metadata(&path)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age > Duration::from_secs(3600));
            if old {
                let _ = std::fs::remove_file(&path);
            }
        } else if !names.contains(&format!("{name}.lock"))
            && !tmp.join(format!("{name}.lock")).exists()
        {
            // A workspace's lock is created before it and removed after it: a workspace
            // without one belongs to a dead process.
            let _ = std::fs::remove_dir_all(&path).or_else(|_| std::fs::remove_file(&path));
            removed += 1;
        }
    }
    removed
}

/// Writes `bytes` to `dest` atomically: a temporary file in `ws`, fsync, rename, fsync of the
/// directory.
pub(crate) fn write_atomic(ws: &Workspace, dest: &Path, bytes: &[u8]) -> io::Result<()> {
    let tmp = ws.path("write");
    let result = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, dest)?;
        sync_dir(dest.parent().unwrap_or(Path::new("/")))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

pub(crate) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Flushes the whole file system holding `path` (one call instead of an fsync per file of an
/// extracted layer).
pub(crate) fn syncfs(path: &Path) -> io::Result<()> {
    let f = File::open(path)?;
    nix::unistd::syncfs(&f).map_err(io::Error::from)
}

/// Swaps `a` and `b` atomically (renameat2 RENAME_EXCHANGE): a reader sees one or the other.
pub(crate) fn exchange(a: &Path, b: &Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let ca = std::ffi::CString::new(a.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let cb = std::ffi::CString::new(b.as_os_str().as_bytes()).map_err(io::Error::other)?;
    // SAFETY: both are valid NUL-terminated strings; renameat2 only reads them.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Disk use of a tree (allocated blocks), not following symlinks.
pub(crate) fn disk_usage(path: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![path.to_path_buf()];
    while let Some(p) = stack.pop() {
        let Ok(m) = std::fs::symlink_metadata(&p) else {
            continue;
        };
        total += m.blocks() * 512;
        if m.is_dir()
            && let Ok(rd) = std::fs::read_dir(&p)
        {
            stack.extend(rd.flatten().map(|e| e.path()));
        }
    }
    total
}

/// Free bytes as unprivileged writers see them (`f_bavail`): berth writes as root, but leaves
/// the blocks reserved for root to the rest of the node.
pub(crate) fn free_bytes(path: &Path) -> io::Result<u64> {
    let st = nix::sys::statvfs::statvfs(path).map_err(io::Error::from)?;
    Ok(st.blocks_available() as u64 * st.fragment_size() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_workspaces_are_cleaned_and_live_ones_kept() {
        let tmp = tempfile::tempdir().unwrap();
        let live = Workspace::create(tmp.path()).unwrap();
        std::fs::write(live.path("x"), b"partial").unwrap();
        // A dead process's workspace: its lock file exists but nobody holds it.
        std::fs::create_dir(tmp.path().join("999-dead")).unwrap();
        std::fs::write(tmp.path().join("999-dead/layer-0"), b"partial").unwrap();
        std::fs::write(tmp.path().join("999-dead.lock"), b"").unwrap();
        // A workspace whose lock is gone entirely.
        std::fs::create_dir(tmp.path().join("998-orphan")).unwrap();
        assert_eq!(clean_tmp(tmp.path()), 2);
        assert!(!tmp.path().join("999-dead").exists());
        assert!(!tmp.path().join("999-dead.lock").exists());
        assert!(!tmp.path().join("998-orphan").exists());
        assert!(live.dir.exists(), "a live workspace is kept");
        let dir = live.dir.clone();
        drop(live);
        assert!(!dir.exists());
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
    }

    #[test]
    fn locks_conflict_between_open_files_and_follow_replaced_files() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("l");
        let a = lock(&p, LockMode::Shared, true).unwrap().unwrap();
        assert!(lock(&p, LockMode::Shared, false).unwrap().is_some());
        assert!(
            try_exclusive(&p).unwrap().is_none(),
            "a shared holder blocks"
        );
        drop(a);
        let x = try_exclusive(&p).unwrap().unwrap();
        std::fs::remove_file(&p).unwrap();
        // The old inode is still locked, but the path is new: the lock goes to the new file.
        assert!(try_exclusive(&p).unwrap().is_some());
        drop(x);
    }

    #[test]
    fn atomic_writes_leave_no_temporary_files() {
        let tmp = tempfile::tempdir().unwrap();
        let ws = Workspace::create(tmp.path()).unwrap();
        let dest = tmp.path().join("rec.json");
        write_atomic(&ws, &dest, b"{}").unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), b"{}");
        assert_eq!(std::fs::read_dir(&ws.dir).unwrap().count(), 0);
    }
}
