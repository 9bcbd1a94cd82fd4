//! The node-wide mounts of squashfs images: each image is loop-mounted once, read-only, nosuid,
//! nodev, at `<mount_dir>/<digest hex>` in the host's mount namespace, and every container of it
//! uses that directory as its overlay lower layer. Mounting is idempotent and safe between
//! processes (a `flock` per image, and `/proc/self/mountinfo` tells whether it is mounted);
//! `unmount_unused` unmounts what no container uses (gc, Slurm epilog), after which the loop
//! device detaches itself (autoclear) once the last overlay on it is gone.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::mount::{MntFlags, MsFlags};

use super::loopdev::{LoopDevice, LoopError, Method};
use super::squashfs::probe_squashfs_magic;
use super::{ImageError, Rootfs};

/// Why a stored squashfs image could not be mounted or unmounted; callers get it as
/// [`ImageError::Mount`].
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("image digest {0:?} is not sha256:<64 hex digits>")]
    Digest(String),
    #[error("{0}: this image is stored as layer directories, not as a squashfs")]
    StoredAsLayers(String),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{path} is already a {fstype} mount, not this image's squashfs; unmount it or set another [squashfs] mount_dir"
    )]
    Occupied { path: PathBuf, fstype: String },
    #[error("attaching {file} to a loop device: {source}")]
    Loop { file: PathBuf, source: LoopError },
    #[error("mounting the squashfs of {file} (byte {offset}) on {target}: {errno}{hint}")]
    Mount {
        file: PathBuf,
        offset: u64,
        target: PathBuf,
        errno: Errno,
        hint: &'static str,
    },
    #[error("unmounting {target}: {errno}")]
    Unmount { target: PathBuf, errno: Errno },
}

/// The hex part of a `sha256:<hex>` digest, checked: it becomes a directory name.
pub fn digest_hex(digest: &str) -> Result<&str, ImageError> {
    let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
    if hex.len() == 64
        && hex
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        Ok(hex)
    } else {
        Err(MountError::Digest(digest.to_string()).into())
    }
}

/// One line of /proc/self/mountinfo, the fields berth needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    pub mount_point: PathBuf,
    /// Per-mount options (`ro,nosuid,nodev,relatime`).
    pub options: String,
    pub fstype: String,
    pub source: String,
}

/// Undoes mountinfo's octal escapes (`\040` for a space).
fn unescape(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    use std::os::unix::ffi::OsStringExt;
    std::ffi::OsString::from_vec(out)
        .into_string()
        .unwrap_or_else(|s| s.to_string_lossy().into_owned())
}

/// Parses /proc/PID/mountinfo, in mount order.
pub fn parse_mountinfo(text: &str) -> Vec<MountEntry> {
    text.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let l: Vec<&str> = left.split(' ').collect();
            let r: Vec<&str> = right.split(' ').collect();
            Some(MountEntry {
                mount_point: PathBuf::from(unescape(l.get(4)?)),
                options: l.get(5)?.to_string(),
                fstype: r.first()?.to_string(),
                source: unescape(r.get(1)?),
            })
        })
        .collect()
}

fn mounts() -> Result<Vec<MountEntry>, ImageError> {
    let path = "/proc/self/mountinfo";
    let text = std::fs::read_to_string(path).map_err(|source| MountError::Io {
        what: "reading",
        path: path.into(),
        source,
    })?;
    Ok(parse_mountinfo(&text))
}

/// The topmost mount at `path`, if any.
pub fn mounted_at(path: &Path) -> Result<Option<MountEntry>, ImageError> {
    Ok(mounts()?.into_iter().rev().find(|m| m.mount_point == path))
}

/// An exclusive `flock` on one image's lock file, released on drop.
struct ImageLock(#[allow(dead_code)] File);

fn lock(mount_root: &Path, hex: &str) -> Result<ImageLock, ImageError> {
    let path = mount_root.join(format!(".lock-{hex}"));
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(&path)
        .map_err(|source| MountError::Io {
            what: "opening the lock",
            path: path.clone(),
            source,
        })?;
    loop {
        // SAFETY: flock on a file descriptor this function owns.
        match Errno::result(unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) }) {
            Ok(_) => return Ok(ImageLock(file)),
            Err(Errno::EINTR) => continue,
            Err(e) => {
                return Err(MountError::Io {
                    what: "locking",
                    path,
                    source: e.into(),
                }
                .into());
            }
        }
    }
}

/// The mount directory itself, created if needed and resolved (mountinfo shows real paths). Run
/// as root, it must be root's all the way from `/` and is kept 0700: the mounts under it hold
/// private images, which other users must not read on the host (containers reach them through
/// overlays root mounts, which this does not hinder).
fn root_dir(mount_root: &Path) -> Result<PathBuf, ImageError> {
    if nix::unistd::geteuid().is_root() {
        berth_sys::privfs::root_dir(mount_root, 0o700).map_err(|e| MountError::Io {
            what: "checking",
            path: mount_root.to_path_buf(),
            source: std::io::Error::other(e.to_string()),
        })?;
    } else {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(mount_root)
            .map_err(|source| MountError::Io {
                what: "creating",
                path: mount_root.to_path_buf(),
                source,
            })?;
    }
    std::fs::canonicalize(mount_root).map_err(|source| {
        ImageError::from(MountError::Io {
            what: "resolving",
            path: mount_root.to_path_buf(),
            source,
        })
    })
}

/// The directory of one user's own mounts, `<mount_dir>/u<uid>`, root's and 0700 like its parent.
fn user_dir(root: &Path, uid: u32) -> Result<PathBuf, ImageError> {
    let dir = root.join(format!("u{uid}"));
    if nix::unistd::geteuid().is_root() {
        berth_sys::privfs::root_dir(&dir, 0o700).map_err(|e| MountError::Io {
            what: "checking",
            path: dir.clone(),
            source: std::io::Error::other(e.to_string()),
        })?;
    } else {
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(source) => {
                return Err(MountError::Io {
                    what: "creating",
                    path: dir,
                    source,
                }
                .into());
            }
        }
    }
    Ok(dir)
}

/// Whether the opened `file` may back a mount shared by every user: no user but root can change
/// it (root owns it, it is not group- or other-writable) nor what its path leads to (every
/// directory above it is root's and not writable by others but with the sticky bit). Checked on
/// the fd, and its path's directories, which must still lead to that very file.
pub fn shareable(file: &File) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = file.metadata() else {
        return false;
    };
    if meta.uid() != 0 || meta.mode() & 0o022 != 0 || !meta.is_file() {
        return false;
    }
    let Ok(path) = std::fs::read_link(berth_sys::privfs::fd_path(file)) else {
        return false;
    };
    let same = std::fs::symlink_metadata(&path)
        .is_ok_and(|m| m.dev() == meta.dev() && m.ino() == meta.ino());
    if !same || !path.is_absolute() {
        return false;
    }
    path.ancestors().skip(1).all(|dir| {
        std::fs::symlink_metadata(dir).is_ok_and(|m| {
            m.is_dir() && m.uid() == 0 && (m.mode() & 0o022 == 0 || m.mode() & libc::S_ISVTX != 0)
        })
    })
}

/// Whether the loop device `source` (`/dev/loopN`) reads a file no user but root can change.
fn trusted_backing(source: &str) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Some((file, _)) =
        super::loopdev::number(Path::new(source)).and_then(super::loopdev::backing)
    else {
        return false;
    };
    std::fs::symlink_metadata(&file)
        .is_ok_and(|m| m.is_file() && m.uid() == 0 && m.mode() & 0o022 == 0)
}

/// Mounts the squashfs at `offset` (`size` bytes) of the opened `file` (opened as the user who
/// named it; `shown` is its name for messages) and returns the mount point, the overlay lower
/// layer of its containers. A file no user but root can change ([`shareable`]) is mounted once
/// per node at `<mount_dir>/<digest hex>` and shared (every user who names it could read a file
/// of that content); any other is the user's own mount at `<mount_dir>/u<uid>/<digest hex>`,
/// never used for another user. The loop device reads the fd, never the path. `digest` must be
/// the digest of the bytes read through `file`.
pub fn mount_opened(
    digest: &str,
    file: &File,
    shown: &Path,
    offset: u64,
    size: u64,
    uid: u32,
    mount_root: &Path,
) -> Result<PathBuf, ImageError> {
    let hex = digest_hex(digest)?;
    let root = root_dir(mount_root)?;
    // A shared mount found in place is reused only if it too is backed by a file root alone can
    // change (one left by an older berth may not be): else this user gets a mount of their own.
    let shared = shareable(file)
        && match mounted_at(&root.join(hex))? {
            Some(m) if m.fstype == "squashfs" => trusted_backing(&m.source),
            _ => true,
        };
    let dir = if shared {
        root.clone()
    } else {
        user_dir(&root, uid)?
    };
    let lock_name = if shared {
        hex.to_string()
    } else {
        format!("u{uid}-{hex}")
    };
    let _lock = lock(&root, &lock_name)?;
    mount_at(file, shown, offset, size, &dir.join(hex))
}

/// Mounts a squashfs image once per node (see the module doc); returns its mount point, the
/// overlay lower layer for its containers. `digest` names the mount: callers guarantee it is
/// the digest of this file's content (the store's entries are immutable). For files berth
/// itself keeps; a file a user names goes through [`mount_opened`].
pub fn mount_shared(
    digest: &str,
    rootfs: &Rootfs,
    mount_root: &Path,
) -> Result<PathBuf, ImageError> {
    match rootfs {
        Rootfs::Squashfs { file, offset, size } => {
            mount_shared_at(digest, file, *offset, *size, mount_root)
        }
        Rootfs::Layers(_) => Err(MountError::StoredAsLayers(digest.to_string()).into()),
    }
}

/// [`mount_shared`] for the squashfs at `offset` (`size` bytes) in `file`, opened by root.
pub fn mount_shared_at(
    digest: &str,
    file: &Path,
    offset: u64,
    size: u64,
    mount_root: &Path,
) -> Result<PathBuf, ImageError> {
    let hex = digest_hex(digest)?;
    let root = root_dir(mount_root)?;
    let _lock = lock(&root, hex)?;
    let opened = File::open(file).map_err(|source| MountError::Io {
        what: "opening",
        path: file.to_path_buf(),
        source,
    })?;
    mount_at(&opened, file, offset, size, &root.join(hex))
}

/// Mounts at `target` unless a squashfs is already mounted there (callers hold its lock).
fn mount_at(
    opened: &File,
    file: &Path,
    offset: u64,
    size: u64,
    target: &Path,
) -> Result<PathBuf, ImageError> {
    let target = target.to_path_buf();
    if let Some(m) = mounted_at(&target)? {
        if m.fstype == "squashfs" {
            tracing::debug!("{} already mounted from {}", target.display(), m.source);
            return Ok(target);
        }
        return Err(MountError::Occupied {
            path: target,
            fstype: m.fstype,
        }
        .into());
    }
    match std::fs::DirBuilder::new().mode(0o700).create(&target) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(source) => {
            return Err(MountError::Io {
                what: "creating",
                path: target,
                source,
            }
            .into());
        }
    }
    // As an import reports it: the caller names the image.
    probe_squashfs_magic(&berth_sys::privfs::fd_path(opened), offset)
        .map_err(ImageError::plain_io)?;
    let device =
        LoopDevice::attach_fd(opened, file, offset, size, Method::Configure).map_err(|source| {
            MountError::Loop {
                file: file.to_path_buf(),
                source,
            }
        })?;
    let flags = MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    if let Err(errno) = nix::mount::mount(
        Some(&device.path),
        &target,
        Some("squashfs"),
        flags,
        None::<&str>,
    ) {
        device.detach();
        let hint = match errno {
            Errno::EPERM => " (mounting needs root)",
            Errno::EINVAL => {
                " (the kernel could not read it: is its compression built into this kernel's squashfs?)"
            }
            _ => "",
        };
        return Err(MountError::Mount {
            file: file.to_path_buf(),
            offset,
            target,
            errno,
            hint,
        }
        .into());
    }
    tracing::debug!(
        "mounted {} (byte {offset}) on {} via {}",
        file.display(),
        target.display(),
        device.path.display()
    );
    // The mount holds the device now; dropping our handle leaves autoclear to detach it.
    drop(device);
    Ok(target)
}

/// A directory image's detached mount tree (`tree`, from `open_tree` on the directory the user
/// opened) attached at `<mount_dir>/dirs/<pid>-<n>`, root's and 0700 like its parent: a path in
/// the host's mount table the container's new mount namespace copies, naming exactly the
/// directory the user opened. Unmounted when the returned guard drops (the container has its
/// own copy by then), or by gc once this process is gone.
pub fn attach_directory(
    tree: &impl AsRawFd,
    shown: &Path,
    mount_root: &Path,
) -> Result<DirectoryMount, ImageError> {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let root = root_dir(mount_root)?;
    let dirs = root.join("dirs");
    if nix::unistd::geteuid().is_root() {
        berth_sys::privfs::root_dir(&dirs, 0o700).map_err(|e| MountError::Io {
            what: "checking",
            path: dirs.clone(),
            source: std::io::Error::other(e.to_string()),
        })?;
    }
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let target = dirs.join(format!("{}-{n}", std::process::id()));
    let io = |what, source| MountError::Io {
        what,
        path: target.clone(),
        source,
    };
    match std::fs::DirBuilder::new().mode(0o700).create(&target) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io("creating", e).into()),
    }
    let c_target = std::ffi::CString::new(target.as_os_str().as_encoded_bytes())
        .map_err(|e| io("naming", std::io::Error::other(e)))?;
    const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;
    // SAFETY: move_mount from an fd (empty NUL-terminated path) onto a NUL-terminated path.
    let r = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_FDCWD,
            c_target.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        let _ = std::fs::remove_dir(&target);
        return Err(MountError::Io {
            what: "attaching the directory image",
            path: shown.to_path_buf(),
            source: e,
        }
        .into());
    }
    Ok(DirectoryMount(target))
}

/// A directory image attached by [`attach_directory`]; detached and removed on drop.
#[derive(Debug)]
pub struct DirectoryMount(PathBuf);

impl DirectoryMount {
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for DirectoryMount {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.0, MntFlags::MNT_DETACH);
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// The entries `<pid>-<n>` of `dir` whose process is gone: what a berth process mounted for
/// itself and could not take down (it was killed). A name of another form is left alone.
pub(crate) fn orphans(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|name| {
            name.split_once('-')
                .and_then(|(pid, _)| pid.parse::<u32>().ok())
                .is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists())
        })
        .collect()
}

/// Detaches the directory images of berth processes that are gone (`dirs/<pid>-<n>`).
fn detach_orphan_directories(root: &Path) {
    let dirs = root.join("dirs");
    for name in orphans(&dirs) {
        let path = dirs.join(&name);
        let _ = nix::mount::umount2(&path, MntFlags::MNT_DETACH);
        let _ = std::fs::remove_dir(&path);
    }
}

/// Unmounts the lazy images of `berth run` processes that are gone (killed before their drop
/// ran): `<mount_root>/lazy/<pid>-<n>/{root,fuse}`, by `berth gc` with the other orphans. A pid
/// that is alive again (reused) keeps its directory until it is gone.
fn detach_lazy_orphans(mount_root: &Path) {
    let parent = mount_root.join("lazy");
    for name in orphans(&parent) {
        let dir = parent.join(&name);
        for sub in ["root", "fuse"] {
            let _ = nix::mount::umount2(&dir.join(sub), MntFlags::MNT_DETACH);
            let _ = std::fs::remove_dir(dir.join(sub));
        }
        match std::fs::remove_dir(&dir) {
            Ok(()) => tracing::info!("unmounted the lazy image of gone process {name}"),
            Err(e) => tracing::warn!("removing {}: {e}", dir.display()),
        }
    }
}

/// Unmounts the squashfs/SIF images no container uses any more, at the end of a container (a
/// run, a step's destroy, `berth rm`, the Epilog): an image file rewritten at the same path
/// leaves its old version's mount and loop device behind otherwise, one per version, until a
/// manual `berth gc`. Best effort: what fails is logged, the caller's outcome stands.
pub fn release_unused(config: &crate::config::Settings<'_>) {
    let store = match crate::store::Store::open(config.store) {
        Ok(store) => store,
        // No store: nothing can have been mounted from it.
        Err(_) => return,
    };
    match unmount_unused(&config.squashfs.mount_dir, |digest| store.in_use(digest)) {
        Ok(digests) => {
            for d in digests {
                tracing::info!("unmounted image {d}: no container uses it");
            }
        }
        Err(e) => tracing::warn!("unmounting unused images: {e}"),
    }
}

/// The image directories under the (canonical) mount root: (directory, digest hex, lock name)
/// for the shared mounts and each user's own (`u<uid>/`), sorted.
fn image_dirs(root: &Path) -> Result<Vec<(PathBuf, String, String)>, ImageError> {
    let root = root.to_path_buf();
    let entries = std::fs::read_dir(&root).map_err(|source| MountError::Io {
        what: "listing",
        path: root.clone(),
        source,
    })?;
    // (directory, digest hex, lock name): the shared mounts and each user's own (`u<uid>/`).
    let mut names: Vec<(PathBuf, String, String)> = Vec::new();
    for name in entries
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
    {
        if digest_hex(&name).is_ok() {
            names.push((root.clone(), name.clone(), name));
        } else if let Some(uid) = name.strip_prefix('u')
            && !uid.is_empty()
            && uid.bytes().all(|b| b.is_ascii_digit())
        {
            let dir = root.join(&name);
            let Ok(inner) = std::fs::read_dir(&dir) else {
                continue;
            };
            for hex in inner
                .flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| digest_hex(n).is_ok())
            {
                names.push((dir.clone(), hex.clone(), format!("{name}-{hex}")));
            }
        }
    }
    names.sort();
    Ok(names)
}

/// The digests of images mounted under `mount_root` that no container uses (what
/// [`unmount_unused`] would release): leftovers of ended jobs, for `berth agent`'s report. Only
/// looks; unmounts nothing.
pub fn unused_mounts(mount_root: &Path, in_use: impl Fn(&str) -> bool) -> Vec<String> {
    let Ok(root) = std::fs::canonicalize(mount_root) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (dir, hex, _) in image_dirs(&root).unwrap_or_default() {
        let digest = format!("sha256:{hex}");
        let mounted =
            mounted_at(&dir.join(&hex)).is_ok_and(|m| m.is_some_and(|m| m.fstype == "squashfs"));
        if mounted && !in_use(&digest) && !out.contains(&digest) {
            out.push(digest);
        }
    }
    out
}

/// Unmounts every image under `mount_root` for which `in_use(digest)` is false (`digest` as
/// `sha256:<hex>`), and removes its directory; returns the digests unmounted. An image still
/// busy on the host (a shell inside it) is left mounted and logged.
pub fn unmount_unused(
    mount_root: &Path,
    in_use: impl Fn(&str) -> bool,
) -> Result<Vec<String>, ImageError> {
    let root = match std::fs::canonicalize(mount_root) {
        Ok(root) => root,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(MountError::Io {
                what: "resolving",
                path: mount_root.to_path_buf(),
                source,
            }
            .into());
        }
    };
    detach_orphan_directories(&root);
    detach_lazy_orphans(&root);
    let names = image_dirs(&root)?;
    let mut unmounted = Vec::new();
    for (dir, hex, lock_name) in names {
        let digest = format!("sha256:{hex}");
        if in_use(&digest) {
            continue;
        }
        let _lock = lock(&root, &lock_name)?;
        // Again under the lock: a container may have taken the image between the first look
        // and the lock (it takes its lease before it mounts, under this lock).
        if in_use(&digest) {
            continue;
        }
        let target = dir.join(&hex);
        let mut was_mounted = false;
        while let Some(m) = mounted_at(&target)? {
            if m.fstype != "squashfs" {
                tracing::warn!(
                    "{} is a {} mount, not an image; left alone",
                    target.display(),
                    m.fstype
                );
                break;
            }
            match nix::mount::umount2(&target, MntFlags::empty()) {
                Ok(()) => was_mounted = true,
                Err(Errno::EBUSY) => {
                    tracing::warn!(
                        "{} is busy (a process has a file or directory open in it); left mounted",
                        target.display()
                    );
                    break;
                }
                Err(errno) => return Err(MountError::Unmount { target, errno }.into()),
            }
        }
        if mounted_at(&target)?.is_none() {
            let _ = std::fs::remove_dir(&target);
        }
        if was_mounted && !unmounted.contains(&digest) {
            unmounted.push(digest);
        }
    }
    Ok(unmounted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orphans_are_entries_of_processes_that_are_gone() {
        let d = tempfile::tempdir().unwrap();
        // pid 1 lives; a pid above the kernel's largest (pid_max ≤ 4194304) never does.
        for name in ["1-0", "4194305-0", "4194305-1", "notapid", "12x-0"] {
            std::fs::create_dir(d.path().join(name)).unwrap();
        }
        let mut found = orphans(d.path());
        found.sort();
        assert_eq!(found, ["4194305-0", "4194305-1"]);
        assert!(orphans(&d.path().join("missing")).is_empty());
    }

    #[test]
    fn digests_become_safe_names() {
        let hex = "a".repeat(64);
        assert_eq!(digest_hex(&format!("sha256:{hex}")).unwrap(), hex);
        assert_eq!(digest_hex(&hex).unwrap(), hex);
        for bad in [
            "sha256:../../etc".to_string(),
            format!("sha256:{}", "A".repeat(64)),
            "a".repeat(63),
            format!("sha512:{hex}"),
            String::new(),
        ] {
            assert!(digest_hex(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn mountinfo_lines() {
        let text = "\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n\
310 22 7:3 / /run/berth/images/abc ro,nosuid,nodev,relatime shared:170 - squashfs /dev/loop3 ro,errors=continue\n\
311 22 0:50 / /tmp/with\\040space rw - tmpfs tmpfs rw\n\
garbage\n";
        let m = parse_mountinfo(text);
        assert_eq!(m.len(), 3);
        assert_eq!(m[1].mount_point, PathBuf::from("/run/berth/images/abc"));
        assert_eq!(m[1].options, "ro,nosuid,nodev,relatime");
        assert_eq!(
            (m[1].fstype.as_str(), m[1].source.as_str()),
            ("squashfs", "/dev/loop3")
        );
        assert_eq!(m[2].mount_point, PathBuf::from("/tmp/with space"));
        assert_eq!(unescape("a\\134b\\011"), "a\\b\t");
        assert_eq!(unescape("trail\\04"), "trail\\04");
    }

    #[test]
    fn unmount_unused_on_a_missing_dir_is_a_no_op() {
        assert!(
            unmount_unused(Path::new("/nonexistent/berth-mnt"), |_| false)
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn layer_images_are_not_mounted() {
        let dir = tempfile::tempdir().unwrap();
        let err = mount_shared(
            &format!("sha256:{}", "0".repeat(64)),
            &Rootfs::Layers(vec![]),
            dir.path(),
        )
        .unwrap_err();
        assert!(matches!(
            err,
            ImageError::Mount(MountError::StoredAsLayers(_))
        ));
    }
}
