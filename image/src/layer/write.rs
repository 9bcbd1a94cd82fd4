//! Writing a layer's entries beneath its directory: parents opened in the layer's root, the last
//! component never followed, whiteouts, hardlinks within the layer, owners, modes, times, xattrs.

use std::ffi::{CStr, CString};
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, OpenHow, ResolveFlag, openat, openat2};
use nix::sys::stat::{
    Mode, SFlag, UtimensatFlags, fchmod, fstatat, futimens, makedev, mkdirat, mknodat, utimensat,
};
use nix::sys::time::TimeSpec;
use nix::unistd::{Gid, Uid, UnlinkatFlags, fchown, fchownat, linkat, symlinkat, unlinkat};

use super::reader::{Kind, TarEntry, TarInput, TarReader};
use super::{Bound, Extracted, RESERVE_CHECK_BYTES, RESERVE_CHECK_ENTRIES};
use crate::ImageError;
use crate::record::ContentHash;

/// Splits an entry name into safe components: no leading `/`, no `.`, never `..`; `refuse`
/// makes the error from why a name is refused.
pub(super) fn components(
    raw: &[u8],
    refuse: impl FnOnce(&str) -> ImageError,
) -> Result<Vec<&[u8]>, ImageError> {
    if raw.contains(&0) {
        return Err(refuse("the name contains a NUL byte"));
    }
    let mut out = Vec::new();
    for c in raw.split(|b| *b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => return Err(refuse("the name has a '..' component")),
            _ => out.push(c),
        }
    }
    Ok(out)
}

pub(super) fn join(comps: &[&[u8]]) -> Vec<u8> {
    comps.join(&b'/')
}

pub(super) fn cstr(bytes: &[u8]) -> CString {
    // Components never contain NUL: `components` refuses such names.
    CString::new(bytes).unwrap_or_default()
}

/// A tar entry's uid or gid as the kernel's 32-bit id; a larger one is refused.
pub(super) fn id32(id: u64, what: &str, rel: &[u8]) -> Result<u32, ImageError> {
    u32::try_from(id).map_err(|_| ImageError::Refused {
        path: String::from_utf8_lossy(rel).into_owned(),
        why: format!("{what} {id} is out of range (ids are 32-bit)"),
    })
}

pub(super) fn io_err(e: Errno) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

pub(super) fn proc_path(fd: BorrowedFd<'_>, name: &[u8]) -> PathBuf {
    let mut p = PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
    if !name.is_empty() {
        p.push(std::ffi::OsStr::from_bytes(name));
    }
    p
}

/// Whether an image may set this extended attribute.
pub(super) fn xattr_allowed(name: &[u8]) -> bool {
    if name.starts_with(b"trusted.overlay.") {
        return false;
    }
    name.starts_with(b"user.")
        || name.starts_with(b"trusted.")
        || name == b"security.capability"
        || name == b"system.posix_acl_access"
        || name == b"system.posix_acl_default"
}

pub(super) fn set_xattr_fd(fd: BorrowedFd<'_>, name: &CStr, value: &[u8]) -> io::Result<()> {
    // SAFETY: fd is an open descriptor, name is NUL-terminated and value/len describe a valid
    // slice that the kernel only reads.
    let rc = unsafe {
        libc::fsetxattr(
            fd.as_raw_fd(),
            name.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

pub(super) fn set_xattr_nofollow(path: &Path, name: &CStr, value: &[u8]) -> io::Result<()> {
    let path = CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    // SAFETY: path and name are NUL-terminated strings and value/len a valid slice; lsetxattr
    // does not follow the final symlink.
    let rc = unsafe {
        libc::lsetxattr(
            path.as_ptr(),
            name.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

pub(super) struct Extractor {
    pub(super) root: OwnedFd,
    pub(super) is_root: bool,
    /// Directories whose mode and mtime are set at the end (writing children changes mtimes).
    pub(super) dirs: Vec<(Vec<u8>, u32, (i64, u32))>,
    pub(super) out: Extracted,
    pub(super) buf: Vec<u8>,
    /// The last parent directory opened, by relative path. Shared rather than dup'ed: most
    /// entries of a layer land in the directory of the one before, and a dup and its close were
    /// two of a small file's syscalls.
    pub(super) cached: Option<(Vec<u8>, Arc<OwnedFd>)>,
    /// Free bytes the file system keeps, and the bytes and entries written since it was last
    /// checked.
    pub(super) reserve: u64,
    pub(super) unchecked_bytes: u64,
    pub(super) unchecked_entries: u64,
    /// sha256 hex of each regular file written, by inode (hardlinks share it).
    pub(super) digests: std::collections::HashMap<u64, String>,
    /// Hardlinks to targets outside this layer: link path → target path.
    pub(super) pending: std::collections::BTreeMap<Vec<u8>, Vec<u8>>,
}

impl Extractor {
    /// Fails when the file system's free space is below the reserve (checked every few MiB
    /// written and every few entries, so a bomb stops near the reserve, not at ENOSPC).
    pub(super) fn check_reserve(&mut self, written: u64) -> Result<(), ImageError> {
        if self.reserve == 0 {
            return Ok(());
        }
        self.unchecked_bytes += written;
        if written == 0 {
            self.unchecked_entries += 1;
        }
        let every = RESERVE_CHECK_BYTES.min((self.reserve / 4).max(64 << 10));
        if self.unchecked_bytes < every && self.unchecked_entries < RESERVE_CHECK_ENTRIES {
            return Ok(());
        }
        self.unchecked_bytes = 0;
        self.unchecked_entries = 0;
        let st = nix::sys::statvfs::fstatvfs(&self.root)
            .map_err(|e| Self::write_err(b".", "statvfs", io_err(e)))?;
        let free = st.blocks_available() as u64 * st.fragment_size() as u64;
        if free < self.reserve {
            return Err(ImageError::Bound(Bound::Reserve(free)));
        }
        Ok(())
    }

    pub(super) fn refuse(entry: &TarEntry, why: impl Into<String>) -> ImageError {
        ImageError::Refused {
            path: entry.path_lossy(),
            why: why.into(),
        }
    }

    pub(super) fn write_err(path: &[u8], op: &'static str, e: impl Into<io::Error>) -> ImageError {
        ImageError::LayerWrite {
            path: String::from_utf8_lossy(path).into_owned(),
            op,
            source: e.into(),
        }
    }

    pub(super) fn open_in_root(&self, rel: &[u8], flags: OFlag) -> Result<OwnedFd, Errno> {
        if rel.is_empty() {
            return self
                .root
                .try_clone()
                .map_err(|e| Errno::from_raw(e.raw_os_error().unwrap_or(libc::EBADF)));
        }
        let how = OpenHow::new().flags(flags | OFlag::O_CLOEXEC).resolve(
            ResolveFlag::RESOLVE_IN_ROOT
                | ResolveFlag::RESOLVE_NO_MAGICLINKS
                | ResolveFlag::RESOLVE_NO_XDEV,
        );
        openat2(self.root.as_fd(), &cstr(rel)[..], how)
    }

    /// Opens the directory `comps` (relative to the layer, symlinks resolved inside it),
    /// creating missing directories (0755, root-owned) when `create` is set.
    pub(super) fn dir(
        &mut self,
        comps: &[&[u8]],
        create: bool,
    ) -> Result<Arc<OwnedFd>, ImageError> {
        let rel = join(comps);
        if let Some((path, fd)) = &self.cached
            && *path == rel
        {
            return Ok(Arc::clone(fd));
        }
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY;
        let fd = match self.open_in_root(&rel, flags) {
            Ok(fd) => fd,
            Err(Errno::ENOENT) if create => {
                let mut cur = self
                    .open_in_root(b"", flags)
                    .map_err(|e| Self::write_err(b"", "open", io_err(e)))?;
                for i in 0..comps.len() {
                    let prefix = join(&comps[..=i]);
                    cur = match self.open_in_root(&prefix, flags) {
                        Ok(fd) => fd,
                        Err(Errno::ENOENT) => {
                            match mkdirat(
                                cur.as_fd(),
                                &cstr(comps[i])[..],
                                Mode::from_bits_truncate(0o755),
                            ) {
                                Ok(()) | Err(Errno::EEXIST) => {}
                                Err(e) => return Err(Self::write_err(&prefix, "mkdir", io_err(e))),
                            }
                            self.open_in_root(&prefix, flags).map_err(|e| {
                                Self::write_err(&prefix, "open directory", io_err(e))
                            })?
                        }
                        Err(e) => {
                            return Err(Self::write_err(&prefix, "open directory", io_err(e)));
                        }
                    };
                }
                cur
            }
            Err(e) => return Err(Self::write_err(&rel, "open directory", io_err(e))),
        };
        let fd = Arc::new(fd);
        self.cached = Some((rel, Arc::clone(&fd)));
        Ok(fd)
    }

    /// Removes whatever is at `parent/name` unless it is a directory and `keep_dir` is set;
    /// returns whether a directory was kept.
    pub(super) fn clear(
        &mut self,
        parent: &OwnedFd,
        name: &[u8],
        rel: &[u8],
        keep_dir: bool,
    ) -> Result<bool, ImageError> {
        let c = cstr(name);
        match fstatat(parent.as_fd(), &c[..], AtFlags::AT_SYMLINK_NOFOLLOW) {
            Err(Errno::ENOENT) => Ok(false),
            Err(e) => Err(Self::write_err(rel, "stat", io_err(e))),
            Ok(st) if st.st_mode & libc::S_IFMT == libc::S_IFDIR => {
                if keep_dir {
                    return Ok(true);
                }
                // The cached parent may be inside the tree being removed.
                self.cached = None;
                // remove_dir_all never follows symlinks; the parent is pinned by its fd.
                std::fs::remove_dir_all(proc_path(parent.as_fd(), name))
                    .map_err(|e| Self::write_err(rel, "remove directory", e))?;
                Ok(false)
            }
            Ok(_) => {
                // A cached parent may have been resolved through a symlink being replaced.
                self.cached = None;
                unlinkat(parent.as_fd(), &c[..], UnlinkatFlags::NoRemoveDir)
                    .map_err(|e| Self::write_err(rel, "remove", io_err(e)))?;
                Ok(false)
            }
        }
    }

    pub(super) fn chown(
        &self,
        fd: BorrowedFd<'_>,
        name: Option<&[u8]>,
        e: &TarEntry,
        rel: &[u8],
    ) -> Result<(), ImageError> {
        let (uid, gid) = (
            Some(Uid::from_raw(id32(e.uid, "uid", rel)?)),
            Some(Gid::from_raw(id32(e.gid, "gid", rel)?)),
        );
        let r = match name {
            None => fchown(fd, uid, gid),
            Some(n) => fchownat(fd, &cstr(n)[..], uid, gid, AtFlags::AT_SYMLINK_NOFOLLOW),
        };
        match r {
            Ok(()) => Ok(()),
            // Without root, files keep the extracting user as owner (like GNU tar).
            Err(Errno::EPERM) | Err(Errno::EINVAL) if !self.is_root => Ok(()),
            Err(err) => Err(Self::write_err(rel, "chown", io_err(err))),
        }
    }

    pub(super) fn xattrs(
        &mut self,
        e: &TarEntry,
        rel: &[u8],
        set: impl Fn(&CStr, &[u8]) -> io::Result<()>,
    ) {
        for (name, value) in &e.xattrs {
            let shown = String::from_utf8_lossy(name);
            if !xattr_allowed(name) {
                self.out.skipped.push(format!(
                    "{}: extended attribute {shown} (not allowed from images)",
                    String::from_utf8_lossy(rel)
                ));
                continue;
            }
            let Ok(cname) = CString::new(name.clone()) else {
                continue;
            };
            if let Err(err) = set(&cname, value) {
                self.out.skipped.push(format!(
                    "{}: extended attribute {shown}: {err}",
                    String::from_utf8_lossy(rel)
                ));
            }
        }
    }

    // Long by design: one branch per entry type, each with the checks that keep it beneath the
    // layer, side by side so a reviewer sees every type's rules together.
    pub(super) fn entry<I: TarInput>(
        &mut self,
        e: &TarEntry,
        reader: &mut TarReader<I>,
    ) -> Result<(), ImageError> {
        self.check_reserve(0)?;
        let comps = components(&e.path, |why| Self::refuse(e, why))?;
        let rel = join(&comps);
        // A later entry of the same name replaces a pending copied-up hardlink.
        if e.kind != Kind::Hardlink {
            self.pending.remove(&rel);
        }
        let Some((name, parent_comps)) = comps.split_last() else {
            if e.kind == Kind::Dir {
                let root = self.dir(&[], false)?;
                self.chown(root.as_fd(), None, e, b".")?;
                self.xattrs(e, b".", |n, v| set_xattr_fd(root.as_fd(), n, v));
                self.dirs.push((Vec::new(), e.mode, e.mtime));
            } else {
                self.out
                    .skipped
                    .push(format!("'{}': an entry without a name", e.path_lossy()));
            }
            return Ok(());
        };
        let name: &[u8] = name;

        if parent_comps.iter().any(|c| c.starts_with(b".wh..wh.")) {
            self.out
                .skipped
                .push(format!("{}: AUFS metadata", String::from_utf8_lossy(&rel)));
            return Ok(());
        }
        if let Some(target) = name.strip_prefix(b".wh.") {
            if target.is_empty() {
                return Err(Self::refuse(e, "a whiteout without a name"));
            }
            let parent = self.dir(parent_comps, true)?;
            if target == b".wh..opq" {
                set_xattr_fd(parent.as_fd(), c"trusted.overlay.opaque", b"y").map_err(|err| {
                    Self::write_err(
                        &join(parent_comps),
                        "mark opaque (trusted.overlay.opaque)",
                        err,
                    )
                })?;
            } else if target.starts_with(b".wh.") {
                self.out
                    .skipped
                    .push(format!("{}: AUFS metadata", String::from_utf8_lossy(&rel)));
            } else {
                let mut hidden = parent_comps.to_vec();
                hidden.push(target);
                let hidden_rel = join(&hidden);
                self.clear(&parent, target, &hidden_rel, false)?;
                mknodat(
                    parent.as_fd(),
                    &cstr(target)[..],
                    SFlag::S_IFCHR,
                    Mode::empty(),
                    makedev(0, 0),
                )
                .map_err(|err| Self::write_err(&hidden_rel, "create whiteout", io_err(err)))?;
            }
            return Ok(());
        }

        match e.kind {
            Kind::Dir => {
                let parent = self.dir(parent_comps, true)?;
                let kept = self.clear(&parent, name, &rel, true)?;
                if !kept {
                    mkdirat(
                        parent.as_fd(),
                        &cstr(name)[..],
                        Mode::from_bits_truncate(0o700),
                    )
                    .map_err(|err| Self::write_err(&rel, "mkdir", io_err(err)))?;
                }
                let fd = openat(
                    parent.as_fd(),
                    &cstr(name)[..],
                    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                    Mode::empty(),
                )
                .map_err(|err| Self::write_err(&rel, "open directory", io_err(err)))?;
                self.chown(fd.as_fd(), None, e, &rel)?;
                self.xattrs(e, &rel, |n, v| set_xattr_fd(fd.as_fd(), n, v));
                self.dirs.push((rel, e.mode, e.mtime));
                self.out.disk_bytes += 4096;
            }
            Kind::File => {
                let parent = self.dir(parent_comps, true)?;
                let fd = self.create_file(&parent, name, &rel, e.mode)?;
                let mut file = File::from(fd);
                let mut left = e.size;
                let mut hasher = ContentHash::default().hasher();
                let mut flushed = 0;
                while left > 0 {
                    let want = usize::try_from(left)
                        .unwrap_or(usize::MAX)
                        .min(self.buf.len());
                    let n = reader
                        .read_data(&mut self.buf[..want])
                        .map_err(ImageError::in_layer)?;
                    hasher.update(&self.buf[..n]);
                    file.write_all(&self.buf[..n])
                        .map_err(|err| Self::write_err(&rel, "write", err))?;
                    left -= n as u64;
                    self.check_reserve(n as u64)?;
                    if e.size - left - flushed >= WRITEBACK_EVERY {
                        start_writeback(&file, flushed, e.size - left - flushed);
                        flushed = e.size - left;
                    }
                }
                if e.size - flushed >= WRITEBACK_MIN {
                    start_writeback(&file, flushed, e.size - flushed);
                }
                let st = nix::sys::stat::fstat(&file)
                    .map_err(|err| Self::write_err(&rel, "stat", io_err(err)))?;
                self.digests.insert(st.st_ino, hasher.finish());
                // Most files of an image are root's, with a mode the create already gave them:
                // then the chown and chmod are left out (two of a small file's syscalls).
                let owner = (id32(e.uid, "uid", &rel)?, id32(e.gid, "gid", &rel)?);
                let chowned = owner != (st.st_uid, st.st_gid);
                if chowned {
                    self.chown(file.as_fd(), None, e, &rel)?;
                }
                // After chown, which clears setuid/setgid bits and file capabilities.
                if chowned || st.st_mode & 0o7777 != e.mode & 0o7777 {
                    fchmod(file.as_fd(), Mode::from_bits_truncate(e.mode & 0o7777))
                        .map_err(|err| Self::write_err(&rel, "chmod", io_err(err)))?;
                }
                self.xattrs(e, &rel, |n, v| set_xattr_fd(file.as_fd(), n, v));
                let t = timespec(e.mtime);
                futimens(file.as_fd(), &t, &t)
                    .map_err(|err| Self::write_err(&rel, "set times", io_err(err)))?;
                self.out.disk_bytes += e.size.div_ceil(4096) * 4096;
            }
            Kind::Symlink => {
                if e.link.is_empty() || e.link.contains(&0) {
                    return Err(Self::refuse(e, "symlink with an empty or invalid target"));
                }
                let parent = self.dir(parent_comps, true)?;
                self.clear(&parent, name, &rel, false)?;
                symlinkat(&cstr(&e.link)[..], parent.as_fd(), &cstr(name)[..])
                    .map_err(|err| Self::write_err(&rel, "symlink", io_err(err)))?;
                self.chown(parent.as_fd(), Some(name), e, &rel)?;
                if !e.xattrs.is_empty() {
                    let path = proc_path(parent.as_fd(), name);
                    self.xattrs(e, &rel, |n, v| set_xattr_nofollow(&path, n, v));
                }
                let t = timespec(e.mtime);
                utimensat(
                    parent.as_fd(),
                    &cstr(name)[..],
                    &t,
                    &t,
                    UtimensatFlags::NoFollowSymlink,
                )
                .map_err(|err| Self::write_err(&rel, "set times", io_err(err)))?;
            }
            Kind::Hardlink => {
                let target = components(&e.link, |why| {
                    Self::refuse(
                        e,
                        format!(
                            "hardlink target '{}': {why}",
                            String::from_utf8_lossy(&e.link)
                        ),
                    )
                })?;
                let Some((tname, tparent)) = target.split_last() else {
                    return Err(Self::refuse(e, "hardlink without a target"));
                };
                let tjoined = join(&target);
                if tjoined == rel {
                    return Err(Self::refuse(e, "a hardlink to itself"));
                }
                // A link to a name that is itself a link to a lower layer's file.
                if let Some(lower) = self.pending.get(&tjoined).cloned() {
                    let parent = self.dir(parent_comps, true)?;
                    self.clear(&parent, name, &rel, false)?;
                    self.pending.insert(rel, lower);
                    return Ok(());
                }
                let tparent_fd = self.dir(tparent, false).ok();
                let parent = self.dir(parent_comps, true)?;
                let linked = match &tparent_fd {
                    // Cleared only once the target is known to exist in this layer (below).
                    Some(tfd) => {
                        match fstatat(tfd.as_fd(), &cstr(tname)[..], AtFlags::AT_SYMLINK_NOFOLLOW) {
                            Ok(_) => {
                                self.clear(&parent, name, &rel, false)?;
                                let tfd = self
                                    .dir(tparent, false)
                                    .map_err(|_| Self::refuse(e, "hardlink target vanished"))?;
                                match linkat(
                                    tfd.as_fd(),
                                    &cstr(tname)[..],
                                    parent.as_fd(),
                                    &cstr(name)[..],
                                    AtFlags::empty(),
                                ) {
                                    Ok(()) => true,
                                    Err(Errno::ENOENT) => false,
                                    Err(err) => {
                                        return Err(Self::write_err(&rel, "hardlink", io_err(err)));
                                    }
                                }
                            }
                            Err(Errno::ENOENT) => false,
                            Err(err) => return Err(Self::write_err(&rel, "stat", io_err(err))),
                        }
                    }
                    None => false,
                };
                if !linked {
                    // Not in this layer: the store copies it up from the lower layers.
                    self.clear(&parent, name, &rel, false)?;
                    self.pending.insert(rel, tjoined);
                }
            }
            Kind::Char | Kind::Block => self.out.skipped.push(format!(
                "{}: {} device {}:{} (images are mounted nodev; the runtime creates /dev)",
                String::from_utf8_lossy(&rel),
                if e.kind == Kind::Char {
                    "character"
                } else {
                    "block"
                },
                e.dev.0,
                e.dev.1
            )),
            Kind::Fifo => self.out.skipped.push(format!(
                "{}: fifo (not extracted)",
                String::from_utf8_lossy(&rel)
            )),
            Kind::Other(t) => self.out.skipped.push(format!(
                "{}: unknown tar entry type '{}'",
                String::from_utf8_lossy(&rel),
                t as char
            )),
        }
        Ok(())
    }

    /// Creates the regular file `parent/name` (never following a symlink there), replacing
    /// whatever an earlier entry of the layer left at that name. Created with the entry's
    /// permission bits (the staging directory is root's alone; setuid, setgid and sticky bits
    /// come with the chmod after the chown); most names are new, so the create is tried first
    /// and the name cleared only when it exists.
    fn create_file(
        &mut self,
        parent: &OwnedFd,
        name: &[u8],
        rel: &[u8],
        mode: u32,
    ) -> Result<OwnedFd, ImageError> {
        let create = || {
            openat(
                parent.as_fd(),
                &cstr(name)[..],
                OFlag::O_WRONLY
                    | OFlag::O_CREAT
                    | OFlag::O_EXCL
                    | OFlag::O_NOFOLLOW
                    | OFlag::O_CLOEXEC,
                Mode::from_bits_truncate(mode & 0o777),
            )
        };
        match create() {
            Err(Errno::EEXIST) => {
                self.clear(parent, name, rel, false)?;
                create()
            }
            r => r,
        }
        .map_err(|err| Self::write_err(rel, "create", io_err(err)))
    }

    /// Sets directory modes and mtimes, deepest last-written first.
    pub(super) fn finish_dirs(&mut self) -> Result<(), ImageError> {
        self.cached = None;
        let dirs = std::mem::take(&mut self.dirs);
        for (rel, mode, mtime) in dirs.iter().rev() {
            // A later entry may have replaced the directory: then there is nothing to set.
            let Ok(fd) = self.open_in_root(
                rel,
                OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW,
            ) else {
                continue;
            };
            fchmod(fd.as_fd(), Mode::from_bits_truncate(mode & 0o7777))
                .map_err(|err| Self::write_err(rel, "chmod", io_err(err)))?;
            let t = timespec(*mtime);
            futimens(fd.as_fd(), &t, &t)
                .map_err(|err| Self::write_err(rel, "set times", io_err(err)))?;
        }
        Ok(())
    }
}

/// A file's bytes are sent to the disk in runs of this size while it is written...
pub(super) const WRITEBACK_EVERY: u64 = 8 << 20;
/// ...and a file's last run when it is at least this long (smaller files are left to the
/// store's one flush of the layer, which writes them in fewer, larger requests).
pub(super) const WRITEBACK_MIN: u64 = 32 << 10;

/// Starts writing `len` bytes of `file` from `offset` to the disk, without waiting. The store
/// flushes a layer before publishing it; begun here, that writeback overlaps the download and
/// extraction of the rest, and the final flush is left only what was written last (not the
/// whole layer, which at a disk's speed is seconds for a large image). Advisory: an error only
/// means the flush does the work.
pub(super) fn start_writeback(file: &File, offset: u64, len: u64) {
    let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
        return;
    };
    // SAFETY: sync_file_range only reads its integer arguments; the fd is open for the call.
    let _ = unsafe {
        libc::sync_file_range(file.as_raw_fd(), offset, len, libc::SYNC_FILE_RANGE_WRITE)
    };
}

pub(super) fn timespec((secs, nanos): (i64, u32)) -> TimeSpec {
    TimeSpec::new(secs, nanos.into())
}
