//! The few syscalls the engine makes on the destination, each resolved beneath the destination's
//! root directory (`openat2` with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`): a symlink planted in
//! the destination, or a `..` in a path, cannot make berth write outside it.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::{Mode, UtimensatFlags};
use nix::sys::time::TimeSpec;
use nix::unistd::{Gid, Uid, UnlinkatFlags};

/// The `std::io::Error` of a failed nix call: the same raw OS error the libc call returned.
fn os(e: Errno) -> io::Error {
    io::Error::from(e)
}

/// Open flags as given (`libc::O_*` bits), every bit kept.
fn oflag(flags: i32) -> OFlag {
    OFlag::from_bits_retain(flags)
}

/// A file mode as given, every bit kept.
fn mode_of(mode: u32) -> Mode {
    Mode::from_bits_retain(mode)
}

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
    let mut how = OpenHow::new()
        .flags(oflag(flags | libc::O_CLOEXEC))
        .resolve(
            ResolveFlag::RESOLVE_BENEATH
                | ResolveFlag::RESOLVE_NO_SYMLINKS
                | ResolveFlag::RESOLVE_NO_MAGICLINKS,
        );
    if flags & libc::O_CREAT != 0 {
        how = how.mode(mode_of(mode));
    }
    loop {
        match nix::fcntl::openat2(root, path.as_c_str(), how) {
            Ok(fd) => return Ok(fd),
            // openat2 returns EAGAIN when a concurrent rename raced the RESOLVE_BENEATH check.
            Err(Errno::EAGAIN) => continue,
            Err(e) => return Err(os(e)),
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
    nix::sys::stat::fstat(fd).map_err(os)
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
    nix::sys::stat::mkdirat(&dir, name.as_c_str(), mode_of(mode)).map_err(os)
}

/// Removes the non-directory `rel` beneath `root` (a missing entry is not an error).
pub fn unlink_beneath(root: &OwnedFd, rel: &Path) -> io::Result<()> {
    let (dir, name) = parent_beneath(root, rel)?;
    unlink_at(&dir, &name)
}

/// Removes the directory `rel` beneath `root` if it is empty; `Ok(false)` when it is not
/// there, not empty or not a directory. The parent is opened without following a symlink and
/// the name removed from it (unlinkat with AT_REMOVEDIR never follows a final symlink either).
pub fn rmdir_beneath(root: &OwnedFd, rel: &Path) -> io::Result<bool> {
    let (dir, name) = parent_beneath(root, rel)?;
    match nix::unistd::unlinkat(&dir, name.as_c_str(), UnlinkatFlags::RemoveDir) {
        Ok(()) => Ok(true),
        Err(Errno::ENOENT | Errno::ENOTEMPTY | Errno::EEXIST | Errno::ENOTDIR) => Ok(false),
        Err(e) => Err(os(e)),
    }
}

pub fn symlink_beneath(root: &OwnedFd, target: &Path, rel: &Path) -> io::Result<()> {
    let (dir, name) = parent_beneath(root, rel)?;
    symlinkat(target, &dir, &name)
}

/// `symlinkat(target, dir, name)`: the link `name` in `dir`, never following anything.
fn symlinkat(target: &Path, dir: &OwnedFd, name: &CStr) -> io::Result<()> {
    let target = CString::new(target.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    nix::unistd::symlinkat(target.as_c_str(), dir, name).map_err(os)
}

/// The `(atime, mtime)` pair for a source mtime.
fn timespecs(mtime: (i64, i64)) -> (TimeSpec, TimeSpec) {
    let t = TimeSpec::new(mtime.0 as libc::time_t, mtime.1 as libc::c_long);
    // atime is set to the source's mtime too: the source's atime is not worth a syscall.
    (t, t)
}

/// Sets the mtime of `name` itself in `dir` (a symlink is not followed).
fn set_mtime_at(dir: &OwnedFd, name: &CStr, mtime: (i64, i64)) -> io::Result<()> {
    let (atime, mtime) = timespecs(mtime);
    nix::sys::stat::utimensat(dir, name, &atime, &mtime, UtimensatFlags::NoFollowSymlink)
        .map_err(os)
}

/// Sets the mtime of `rel` itself (a symlink is not followed).
pub fn set_mtime_beneath(root: &OwnedFd, rel: &Path, mtime: (i64, i64)) -> io::Result<()> {
    let (dir, name) = parent_beneath(root, rel)?;
    set_mtime_at(&dir, &name, mtime)
}

pub fn set_mtime_fd(fd: &OwnedFd, mtime: (i64, i64)) -> io::Result<()> {
    let (atime, mtime) = timespecs(mtime);
    nix::sys::stat::futimens(fd, &atime, &mtime).map_err(os)
}

pub fn fchmod(fd: &OwnedFd, mode: u32) -> io::Result<()> {
    nix::sys::stat::fchmod(fd, mode_of(mode)).map_err(os)
}

/// Copies the `user.*` extended attributes of `src` to `dst`. Only that namespace: the others
/// need privilege (`trusted.*`, `security.*`: a file capability must never be handed on) or carry
/// access rules meant for the source's filesystem (ACLs). A destination that keeps no extended
/// attributes fails with EOPNOTSUPP.
pub fn copy_xattrs(src: &OwnedFd, dst: &OwnedFd) -> io::Result<()> {
    // nix has no xattr calls: flistxattr, fgetxattr and fsetxattr stay raw.
    let names = xattr_buf(|buf| {
        // SAFETY: `src` is open; `buf` is valid for `buf.len()` bytes (with length 0 the call
        // only returns the size).
        unsafe { libc::flistxattr(src.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) }
    })?;
    for name in names.split(|&b| b == 0).filter(|n| n.starts_with(b"user.")) {
        let name = CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
        let value = match xattr_buf(|buf| {
            // SAFETY: as above; `name` is a valid C string.
            unsafe {
                libc::fgetxattr(
                    src.as_raw_fd(),
                    name.as_ptr(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                )
            }
        }) {
            Ok(v) => v,
            // Removed since it was listed.
            Err(e) if e.raw_os_error() == Some(libc::ENODATA) => continue,
            Err(e) => return Err(e),
        };
        // nix has no xattr calls.
        // SAFETY: `dst` is open; `name` a valid C string; `value` valid for its length.
        check(unsafe {
            libc::fsetxattr(
                dst.as_raw_fd(),
                name.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                0,
            )
        })?;
    }
    Ok(())
}

/// `v` as a file offset: beyond `off_t` (2^63 - 1, the kernel's limit on a file's size) it is
/// EOVERFLOW, as the kernel says of such an offset.
fn file_offset(v: u64) -> io::Result<libc::off_t> {
    libc::off_t::try_from(v).map_err(|_| io::Error::from_raw_os_error(libc::EOVERFLOW))
}

/// `n` bytes, at most `cap` (a buffer's length): what one call moves of what is left.
fn bounded(n: u64, cap: usize) -> usize {
    usize::try_from(n).map_or(cap, |n| n.min(cap))
}

/// Calls a size-returning xattr call with a buffer of the right size (asking for it first;
/// again if it grew in between).
fn xattr_buf(mut call: impl FnMut(&mut [u8]) -> libc::ssize_t) -> io::Result<Vec<u8>> {
    loop {
        let n = call(&mut []);
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut buf = vec![0u8; n.unsigned_abs()];
        let got = call(&mut buf);
        if got >= 0 {
            buf.truncate(got.unsigned_abs());
            return Ok(buf);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ERANGE) {
            return Err(e);
        }
    }
}

pub fn syncfs(fd: &OwnedFd) -> io::Result<()> {
    nix::unistd::syncfs(fd).map_err(os)
}

/// Bytes an unprivileged writer may still use on the filesystem holding `fd`.
pub fn available_bytes(fd: &OwnedFd) -> io::Result<u64> {
    let st = nix::sys::statvfs::fstatvfs(fd).map_err(os)?;
    Ok(st.blocks_available() as u64 * st.fragment_size() as u64)
}

/// Copies `len` bytes at `offset` from `src` to `dst`: `copy_file_range` (in-kernel, a reflink on
/// filesystems that share extents), else `pread`/`pwrite` when the kernel cannot (another
/// filesystem on old kernels, FUSE/NFS without support, special files).
pub fn copy_range(
    src: &OwnedFd,
    dst: &OwnedFd,
    offset: u64,
    len: u64,
    way: &CopyWay,
) -> io::Result<()> {
    if way.read_write.load(Ordering::Relaxed) {
        return copy_range_rw(src, dst, offset, len);
    }
    let mut done = 0u64;
    while done < len {
        let mut off_in = file_offset(offset + done)?;
        let mut off_out = off_in;
        let want = bounded(len - done, 1 << 30);
        let n = match nix::fcntl::copy_file_range(
            src,
            Some(&mut off_in),
            dst,
            Some(&mut off_out),
            want,
        ) {
            Ok(n) => n,
            Err(
                Errno::EXDEV | Errno::EOPNOTSUPP | Errno::EINVAL | Errno::ENOSYS | Errno::EPERM,
            ) if done == 0 => {
                way.read_write.store(true, Ordering::Relaxed);
                return copy_range_rw(src, dst, offset, len);
            }
            Err(e) => return Err(os(e)),
        };
        if n == 0 {
            return Err(shrunk());
        }
        done += n as u64;
    }
    Ok(())
}

/// How a stage's copies go between its pair of filesystems, learned from the first copy: once
/// `copy_file_range` is refused (EXDEV between most filesystems, EOPNOTSUPP, ...), every later
/// file is read and written directly instead of paying a failed call first.
#[derive(Debug, Default)]
pub struct CopyWay {
    read_write: AtomicBool,
    /// The filesystems cannot share extents (FICLONERANGE refused): large ranges are copied.
    no_clone: AtomicBool,
}

fn shrunk() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "the source file shrank while it was being staged",
    )
}

thread_local! {
    /// Each copy thread's buffer for read/write copies, kept between files.
    static RW_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn copy_range_rw(src: &OwnedFd, dst: &OwnedFd, offset: u64, len: u64) -> io::Result<()> {
    // Large buffers: fewer syscalls, and full pages for the destination's page cache.
    const MAX: usize = 4 << 20;
    RW_BUF.with_borrow_mut(|buf| {
        let size = bounded(len, MAX).max(1);
        if buf.len() < size {
            buf.resize(size, 0);
        }
        let mut done = 0u64;
        while done < len {
            let want = bounded(len - done, buf.len());
            let at = file_offset(offset + done)?;
            let n = retrying(|| nix::sys::uio::pread(src, &mut buf[..want], at))?;
            if n == 0 {
                return Err(shrunk());
            }
            let mut put = 0;
            while put < n {
                let at = file_offset(offset + done + put as u64)?;
                let rest = &buf[put..n];
                match retrying(|| nix::sys::uio::pwrite(dst, rest, at))? {
                    0 => return Err(io::Error::from(io::ErrorKind::WriteZero)),
                    w => put += w,
                }
            }
            done += n as u64;
        }
        Ok(())
    })
}

/// Runs a read or write call again when a signal interrupted it.
fn retrying(mut call: impl FnMut() -> nix::Result<usize>) -> io::Result<usize> {
    loop {
        match call() {
            Err(Errno::EINTR) => continue,
            other => return other.map_err(os),
        }
    }
}

pub fn fchown(fd: &OwnedFd, uid: u32, gid: u32) -> io::Result<()> {
    nix::unistd::fchown(fd, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid))).map_err(os)
}

/// The directory `rel` beneath `root` (O_PATH), or `None` when there is none: missing, or a file
/// or a symlink in its place.
pub fn open_dir_if_any(root: &OwnedFd, rel: &Path) -> io::Result<Option<OwnedFd>> {
    match open_beneath(root, rel, libc::O_PATH | libc::O_DIRECTORY, 0) {
        Ok(fd) => Ok(Some(fd)),
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::ENOENT | libc::ELOOP | libc::ENOTDIR)
            ) =>
        {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// lstat of the plain name `name` in the open directory `dir` (one syscall: no path walk, and a
/// single component cannot lead through a symlink), or `None` when it does not exist.
pub fn lstat_at(dir: &OwnedFd, name: &CStr) -> io::Result<Option<libc::stat>> {
    match nix::sys::stat::fstatat(dir, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(st) => Ok(Some(st)),
        Err(Errno::ENOENT) => Ok(None),
        Err(e) => Err(os(e)),
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
    // No flags: a symlink at `from` is linked itself, never followed.
    nix::unistd::linkat(
        from_root,
        from.as_c_str(),
        &dir,
        name.as_c_str(),
        AtFlags::empty(),
    )
    .map_err(os)
}

/// Changes the owner of `name` itself in `dir` (a symlink is not followed).
fn lchown_at(dir: &OwnedFd, name: &CStr, uid: u32, gid: u32) -> io::Result<()> {
    nix::unistd::fchownat(
        dir,
        name,
        Some(Uid::from_raw(uid)),
        Some(Gid::from_raw(gid)),
        AtFlags::AT_SYMLINK_NOFOLLOW,
    )
    .map_err(os)
}

/// Changes the owner of `rel` itself beneath `root` (a symlink is not followed).
pub fn lchown_beneath(root: &OwnedFd, rel: &Path, uid: u32, gid: u32) -> io::Result<()> {
    let (dir, name) = parent_beneath(root, rel)?;
    lchown_at(&dir, &name, uid, gid)
}

/// Clones all of `src` into `dst` (FICLONE): shared extents, no data written. Fails with
/// EXDEV or EOPNOTSUPP where the filesystems cannot share extents.
pub fn reflink(src: &OwnedFd, dst: &OwnedFd) -> io::Result<()> {
    // FICLONE is _IOW(0x94, 9, int) in linux/fs.h (0x40049409).
    nix::ioctl_write_int!(ficlone, 0x94, 9);
    // SAFETY: both descriptors are open; FICLONE takes the source descriptor as its argument
    // (by value: no memory is passed).
    unsafe {
        ficlone(
            dst.as_raw_fd(),
            // An fd is never negative: the bits are the descriptor's number.
            nix::sys::ioctl::ioctl_param_type::from(src.as_raw_fd().cast_unsigned()),
        )
    }
    .map(drop)
    .map_err(os)
}

/// Clones `len` bytes at `offset` of `src` to the same offset of `dst` (FICLONERANGE): shared
/// extents, no data written. `offset` must be a multiple of the block size, and so must `len`
/// unless the range ends at the end of `src`.
pub fn reflink_range(src: &OwnedFd, dst: &OwnedFd, offset: u64, len: u64) -> io::Result<()> {
    /// `struct file_clone_range` of linux/fs.h.
    #[repr(C)]
    struct FileCloneRange {
        src_fd: i64,
        src_offset: u64,
        src_length: u64,
        dest_offset: u64,
    }
    // FICLONERANGE is _IOW(0x94, 13, struct file_clone_range) in linux/fs.h (0x4020940d).
    nix::ioctl_write_ptr!(ficlonerange, 0x94, 13, FileCloneRange);
    let range = FileCloneRange {
        src_fd: src.as_raw_fd().into(),
        src_offset: offset,
        src_length: len,
        dest_offset: offset,
    };
    // SAFETY: both descriptors are open; `range` is a valid file_clone_range the kernel only
    // reads, alive for the call.
    unsafe { ficlonerange(dst.as_raw_fd(), &range) }
        .map(drop)
        .map_err(os)
}

/// Below this, a copy goes through `copy_file_range` (the page cache); at or above it, through
/// [`copy_range_direct`].
pub const DIRECT_MIN: u64 = 8 << 20;
const DIRECT_ALIGN: usize = 4096;
const DIRECT_BUF: usize = 8 << 20;

/// Copies `len` bytes at `offset` of a file of `file_size` bytes, choosing the way by size:
/// large ranges are written with O_DIRECT, small ones with `copy_file_range`.
pub fn copy_data(
    src: &OwnedFd,
    dst: &OwnedFd,
    offset: u64,
    len: u64,
    file_size: u64,
    way: &CopyWay,
) -> io::Result<()> {
    if len >= DIRECT_MIN && offset.is_multiple_of(DIRECT_ALIGN as u64) {
        // On a filesystem that shares extents (XFS, Btrfs) a large range is cloned: no data
        // read or written. (Small files get the same from copy_file_range, which clones where
        // it can.)
        if !way.no_clone.load(Ordering::Relaxed) {
            match reflink_range(src, dst, offset, len) {
                Ok(()) => return Ok(()),
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EXDEV | libc::EOPNOTSUPP | libc::ENOTTY | libc::ENOSYS)
                    ) =>
                {
                    way.no_clone.store(true, Ordering::Relaxed)
                }
                // EINVAL: this range cannot be cloned (alignment); it is copied.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                Err(e) => return Err(e),
            }
        }
        copy_range_direct(src, dst, offset, len, file_size, way)
    } else {
        copy_range(src, dst, offset, len, way)
    }
}

/// A zeroed, page-aligned buffer (O_DIRECT needs aligned memory, offsets and lengths): a
/// slightly larger vector, used from its first aligned byte.
struct Aligned {
    buf: Vec<u8>,
    start: usize,
    len: usize,
}

impl Aligned {
    fn new(len: usize) -> Self {
        let buf = vec![0u8; len + DIRECT_ALIGN];
        let start = buf.as_ptr().align_offset(DIRECT_ALIGN);
        assert!(start < DIRECT_ALIGN, "a byte buffer can be aligned");
        Self { buf, start, len }
    }

    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.start..self.start + self.len]
    }
}

/// Copies a large range with O_DIRECT writes: the source is read through the page cache (cheap
/// when it is warm, read ahead when it is cold), the destination written straight to the device
/// in large aligned blocks, so that nothing is left dirty for the final sync to flush and the
/// page cache is not filled with a copy nobody has read yet. The last, partial block of the file
/// is written padded and the file cut back to `file_size`. Falls back to [`copy_range`] where
/// the filesystem refuses O_DIRECT (tmpfs).
pub fn copy_range_direct(
    src: &OwnedFd,
    dst: &OwnedFd,
    offset: u64,
    len: u64,
    file_size: u64,
    way: &CopyWay,
) -> io::Result<()> {
    // O_DIRECT is a property of the open file description; the caller's `dst` is its own (one
    // open per copy task).
    use nix::fcntl::FcntlArg;
    let flags = nix::fcntl::fcntl(dst, FcntlArg::F_GETFL).map_err(os)?;
    match nix::fcntl::fcntl(dst, FcntlArg::F_SETFL(oflag(flags | libc::O_DIRECT))) {
        Ok(_) => {}
        Err(Errno::EINVAL | Errno::EOPNOTSUPP) => return copy_range(src, dst, offset, len, way),
        Err(e) => return Err(os(e)),
    }
    let direct = std::fs::File::from(dst.try_clone()?);
    // Advice only: its result does not matter.
    let _ = nix::fcntl::posix_fadvise(
        src,
        file_offset(offset)?,
        file_offset(len)?,
        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_SEQUENTIAL,
    );
    use std::os::unix::fs::FileExt;
    let src = std::fs::File::from(src.try_clone()?);
    let mut buf = Aligned::new(DIRECT_BUF);
    let buf = buf.as_mut();
    let mut done = 0u64;
    while done < len {
        let want = bounded(len - done, DIRECT_BUF);
        // Fill the block completely (a short read mid-file would misalign the next write).
        let mut got = 0;
        while got < want {
            let n = src.read_at(&mut buf[got..want], offset + done + got as u64)?;
            if n == 0 {
                return Err(shrunk());
            }
            got += n;
        }
        let at = offset + done;
        if got.is_multiple_of(DIRECT_ALIGN) {
            direct.write_all_at(&buf[..got], at)?;
        } else {
            // The file's tail: padded to the block size, then cut back.
            let padded = got.next_multiple_of(DIRECT_ALIGN);
            buf[got..padded].fill(0);
            direct.write_all_at(&buf[..padded], at)?;
            direct.set_len(file_size)?;
        }
        done += got as u64;
    }
    Ok(())
}

// Calls on a plain name in an open directory: one component, so nothing to resolve and no
// symlink to follow on the way (the last component is never followed either). The directory
// itself was opened beneath the root.

pub fn name_of(rel: &Path) -> io::Result<CString> {
    let name = rel
        .file_name()
        .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    CString::new(name.as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// Opens `name` in `dir`, never following a symlink there.
pub fn open_at(dir: &OwnedFd, name: &CStr, flags: i32, mode: u32) -> io::Result<OwnedFd> {
    nix::fcntl::openat(
        dir,
        name,
        oflag(flags | libc::O_NOFOLLOW | libc::O_CLOEXEC),
        mode_of(mode),
    )
    .map_err(os)
}

/// Removes the non-directory `name` in `dir` (a missing one is not an error).
pub fn unlink_at(dir: &OwnedFd, name: &CStr) -> io::Result<()> {
    match nix::unistd::unlinkat(dir, name, UnlinkatFlags::NoRemoveDir) {
        Ok(()) | Err(Errno::ENOENT) => Ok(()),
        Err(e) => Err(os(e)),
    }
}

/// Hardlinks `name` in `from` to the same name in `to` (a symlink is linked, not followed).
pub fn link_at(from: &OwnedFd, to: &OwnedFd, name: &CStr) -> io::Result<()> {
    nix::unistd::linkat(from, name, to, name, AtFlags::empty()).map_err(os)
}

/// Creates the symlink `name` → `target` in `dir`, owned by `uid:gid`, with the mtime `mtime`.
pub fn symlink_at(
    dir: &OwnedFd,
    name: &CStr,
    target: &Path,
    owner: Option<(u32, u32)>,
    mtime: (i64, i64),
) -> io::Result<()> {
    symlinkat(target, dir, name)?;
    if let Some((uid, gid)) = owner {
        lchown_at(dir, name, uid, gid)?;
    }
    set_mtime_at(dir, name, mtime)
}
