//! The few syscalls the engine makes on the destination, each resolved beneath the destination's
//! root directory (`openat2` with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`): a symlink planted in
//! the destination, or a `..` in a path, cannot make berth write outside it.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

fn cstr(path: &Path) -> io::Result<CString> {
    // An empty relative path names the root itself.
    let bytes = if path.as_os_str().is_empty() {
        b".".as_slice()
    } else {
        path.as_os_str().as_bytes()
    };
    CString::new(bytes).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// Opens `rel` beneath `root`; never follows a symlink, never leaves `root`.
pub fn open_beneath(root: &OwnedFd, rel: &Path, flags: i32, mode: u32) -> io::Result<OwnedFd> {
    let path = cstr(rel)?;
    // SAFETY: open_how is plain data; all-zero is its documented "no options" value.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (flags | libc::O_CLOEXEC) as u64;
    if flags & libc::O_CREAT != 0 {
        how.mode = mode as u64;
    }
    how.resolve = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS;
    loop {
        // SAFETY: `path` is a valid C string and `how` a properly sized open_how that outlive the
        // call; the kernel returns a new descriptor or -1.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                root.as_raw_fd(),
                path.as_ptr(),
                &how as *const libc::open_how,
                std::mem::size_of::<libc::open_how>(),
            )
        };
        if fd >= 0 {
            // SAFETY: the kernel just handed us this descriptor; nothing else owns it.
            return Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) });
        }
        let err = io::Error::last_os_error();
        // openat2 returns EAGAIN when a concurrent rename raced the RESOLVE_BENEATH check.
        if err.raw_os_error() != Some(libc::EAGAIN) {
            return Err(err);
        }
    }
}

/// The parent directory of `rel` (opened `O_PATH` beneath `root`) and `rel`'s last component.
pub fn parent_beneath(root: &OwnedFd, rel: &Path) -> io::Result<(OwnedFd, CString)> {
    let parent = rel.parent().unwrap_or(Path::new(""));
    let name = rel
        .file_name()
        .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    let dir = open_beneath(root, parent, libc::O_PATH | libc::O_DIRECTORY, 0)?;
    let name =
        CString::new(name.as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    Ok((dir, name))
}

fn check(ret: libc::c_int) -> io::Result<()> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

pub fn fstat(fd: &OwnedFd) -> io::Result<libc::stat> {
    // SAFETY: an all-zero stat is a valid value for fstat to overwrite.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is open and `st` is a valid out pointer.
    check(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) })?;
    Ok(st)
}

/// lstat of `rel` beneath `root`, or `None` when it does not exist.
pub fn lstat_beneath(root: &OwnedFd, rel: &Path) -> io::Result<Option<libc::stat>> {
    match open_beneath(root, rel, libc::O_PATH | libc::O_NOFOLLOW, 0) {
        Ok(fd) => fstat(&fd).map(Some),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

pub fn mkdir_beneath(root: &OwnedFd, rel: &Path, mode: u32) -> io::Result<()> {
    let (dir, name) = parent_beneath(root, rel)?;
    // SAFETY: `dir` is an open directory and `name` a valid C string.
    check(unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), mode) })
}

/// Removes the non-directory `rel` beneath `root` (a missing entry is not an error).
pub fn unlink_beneath(root: &OwnedFd, rel: &Path) -> io::Result<()> {
    let (dir, name) = parent_beneath(root, rel)?;
    // SAFETY: `dir` is an open directory and `name` a valid C string.
    match check(unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), 0) }) {
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        other => other,
    }
}

pub fn symlink_beneath(root: &OwnedFd, target: &Path, rel: &Path) -> io::Result<()> {
    let (dir, name) = parent_beneath(root, rel)?;
    let target = CString::new(target.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `dir` is an open directory; both strings are valid C strings.
    check(unsafe { libc::symlinkat(target.as_ptr(), dir.as_raw_fd(), name.as_ptr()) })
}

fn timespecs(mtime: (i64, i64)) -> [libc::timespec; 2] {
    let t = libc::timespec {
        tv_sec: mtime.0 as libc::time_t,
        tv_nsec: mtime.1 as libc::c_long,
    };
    // atime is set to the source's mtime too: the source's atime is not worth a syscall.
    [t, t]
}

/// Sets the mtime of `rel` itself (a symlink is not followed).
pub fn set_mtime_beneath(root: &OwnedFd, rel: &Path, mtime: (i64, i64)) -> io::Result<()> {
    let (dir, name) = parent_beneath(root, rel)?;
    let ts = timespecs(mtime);
    // SAFETY: `dir` is open, `name` a C string, `ts` two valid timespecs.
    check(unsafe {
        libc::utimensat(
            dir.as_raw_fd(),
            name.as_ptr(),
            ts.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    })
}

pub fn set_mtime_fd(fd: &OwnedFd, mtime: (i64, i64)) -> io::Result<()> {
    let ts = timespecs(mtime);
    // SAFETY: `fd` is open and `ts` two valid timespecs.
    check(unsafe { libc::futimens(fd.as_raw_fd(), ts.as_ptr()) })
}

pub fn fchmod(fd: &OwnedFd, mode: u32) -> io::Result<()> {
    // SAFETY: `fd` is an open descriptor.
    check(unsafe { libc::fchmod(fd.as_raw_fd(), mode) })
}

pub fn syncfs(fd: &OwnedFd) -> io::Result<()> {
    // SAFETY: `fd` is an open descriptor.
    check(unsafe { libc::syncfs(fd.as_raw_fd()) })
}

/// Bytes an unprivileged writer may still use on the filesystem holding `fd`.
pub fn available_bytes(fd: &OwnedFd) -> io::Result<u64> {
    // SAFETY: an all-zero statvfs is a valid value for fstatvfs to overwrite.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is open and `st` a valid out pointer.
    check(unsafe { libc::fstatvfs(fd.as_raw_fd(), &mut st) })?;
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

/// Copies `len` bytes at `offset` from `src` to `dst`: `copy_file_range` (in-kernel, a reflink on
/// filesystems that share extents), else `pread`/`pwrite` when the kernel cannot (another
/// filesystem on old kernels, FUSE/NFS without support, special files).
pub fn copy_range(src: &OwnedFd, dst: &OwnedFd, offset: u64, len: u64) -> io::Result<()> {
    let mut done = 0u64;
    while done < len {
        let mut off_in = (offset + done) as libc::loff_t;
        let mut off_out = off_in;
        let want = (len - done).min(1 << 30) as usize;
        // SAFETY: both descriptors are open; the offsets are valid in/out pointers.
        let n = unsafe {
            libc::copy_file_range(
                src.as_raw_fd(),
                &mut off_in,
                dst.as_raw_fd(),
                &mut off_out,
                want,
                0,
            )
        };
        if n < 0 {
            let err = io::Error::last_os_error();
            return match err.raw_os_error() {
                Some(
                    libc::EXDEV | libc::EOPNOTSUPP | libc::EINVAL | libc::ENOSYS | libc::EPERM,
                ) if done == 0 => copy_range_rw(src, dst, offset, len),
                _ => Err(err),
            };
        }
        if n == 0 {
            return Err(shrunk());
        }
        done += n as u64;
    }
    Ok(())
}

fn shrunk() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "the source file shrank while it was being staged",
    )
}

fn copy_range_rw(src: &OwnedFd, dst: &OwnedFd, offset: u64, len: u64) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    // Large aligned buffers: fewer syscalls, and full pages for the destination's page cache.
    let mut buf = vec![0u8; (len.min(4 << 20)) as usize];
    let src = std::fs::File::from(src.try_clone()?);
    let dst = std::fs::File::from(dst.try_clone()?);
    let mut done = 0u64;
    while done < len {
        let want = (len - done).min(buf.len() as u64) as usize;
        let n = src.read_at(&mut buf[..want], offset + done)?;
        if n == 0 {
            return Err(shrunk());
        }
        dst.write_all_at(&buf[..n], offset + done)?;
        done += n as u64;
    }
    Ok(())
}

pub fn fchown(fd: &OwnedFd, uid: u32, gid: u32) -> io::Result<()> {
    // SAFETY: `fd` is an open descriptor.
    check(unsafe { libc::fchown(fd.as_raw_fd(), uid, gid) })
}

/// lstat of the plain name `name` in the open directory `dir` (one syscall: no path walk, and a
/// single component cannot lead through a symlink), or `None` when it does not exist.
pub fn lstat_at(dir: &OwnedFd, name: &std::ffi::CStr) -> io::Result<Option<libc::stat>> {
    // SAFETY: an all-zero stat is a valid value for fstatat to overwrite.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `dir` is open, `name` a valid C string and `st` a valid out pointer.
    match check(unsafe {
        libc::fstatat(
            dir.as_raw_fd(),
            name.as_ptr(),
            &mut st,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    }) {
        Ok(()) => Ok(Some(st)),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Hardlinks `from` (beneath `from_root`) to `rel` beneath `root`. The source path lies in a
/// tree only root writes (the dataset cache); `rel`'s parent is resolved beneath `root`.
pub fn link_beneath(
    from_root: &OwnedFd,
    from: &Path,
    root: &OwnedFd,
    rel: &Path,
) -> io::Result<()> {
    let (dir, name) = parent_beneath(root, rel)?;
    let from = cstr(from)?;
    // SAFETY: both descriptors are open directories and both names valid C strings; flags 0:
    // a symlink at `from` is linked itself, never followed.
    check(unsafe {
        libc::linkat(
            from_root.as_raw_fd(),
            from.as_ptr(),
            dir.as_raw_fd(),
            name.as_ptr(),
            0,
        )
    })
}

/// Changes the owner of `rel` itself beneath `root` (a symlink is not followed).
pub fn lchown_beneath(root: &OwnedFd, rel: &Path, uid: u32, gid: u32) -> io::Result<()> {
    let (dir, name) = parent_beneath(root, rel)?;
    // SAFETY: `dir` is an open directory and `name` a valid C string.
    check(unsafe {
        libc::fchownat(
            dir.as_raw_fd(),
            name.as_ptr(),
            uid,
            gid,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    })
}

/// Clones all of `src` into `dst` (FICLONE): shared extents, no data written. Fails with
/// EXDEV or EOPNOTSUPP where the filesystems cannot share extents.
pub fn reflink(src: &OwnedFd, dst: &OwnedFd) -> io::Result<()> {
    // _IOW(0x94, 9, int), from linux/fs.h; the libc crate does not define it.
    const FICLONE: libc::c_ulong = 0x4004_9409;
    // SAFETY: both descriptors are open; FICLONE takes the source descriptor as its argument.
    check(unsafe { libc::ioctl(dst.as_raw_fd(), FICLONE, src.as_raw_fd()) })
}
