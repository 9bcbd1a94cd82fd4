//! The few syscalls the engine makes on the destination, each resolved beneath the destination's
//! root directory (`openat2` with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`): a symlink planted in
//! the destination, or a `..` in a path, cannot make berth write outside it.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

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

/// Removes the directory `rel` beneath `root` if it is empty; `Ok(false)` when it is not
/// there, not empty or not a directory. The parent is opened without following a symlink and
/// the name removed from it (unlinkat with AT_REMOVEDIR never follows a final symlink either).
pub fn rmdir_beneath(root: &OwnedFd, rel: &Path) -> io::Result<bool> {
    let (dir, name) = parent_beneath(root, rel)?;
    // SAFETY: `dir` is an open directory and `name` a valid C string.
    match check(unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), libc::AT_REMOVEDIR) }) {
        Ok(()) => Ok(true),
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::ENOENT | libc::ENOTEMPTY | libc::EEXIST | libc::ENOTDIR)
            ) =>
        {
            Ok(false)
        }
        Err(e) => Err(e),
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

/// Copies the `user.*` extended attributes of `src` to `dst`. Only that namespace: the others
/// need privilege (`trusted.*`, `security.*`: a file capability must never be handed on) or carry
/// access rules meant for the source's filesystem (ACLs). A destination that keeps no extended
/// attributes fails with EOPNOTSUPP.
pub fn copy_xattrs(src: &OwnedFd, dst: &OwnedFd) -> io::Result<()> {
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

/// Calls a size-returning xattr call with a buffer of the right size (asking for it first;
/// again if it grew in between).
fn xattr_buf(mut call: impl FnMut(&mut [u8]) -> libc::ssize_t) -> io::Result<Vec<u8>> {
    loop {
        let n = call(&mut []);
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut buf = vec![0u8; n as usize];
        let got = call(&mut buf);
        if got >= 0 {
            buf.truncate(got as usize);
            return Ok(buf);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ERANGE) {
            return Err(e);
        }
    }
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
                ) if done == 0 => {
                    way.read_write.store(true, Ordering::Relaxed);
                    copy_range_rw(src, dst, offset, len)
                }
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
        let size = (len as usize).clamp(1, MAX);
        if buf.len() < size {
            buf.resize(size, 0);
        }
        let mut done = 0u64;
        while done < len {
            let want = (len - done).min(buf.len() as u64) as usize;
            let at = (offset + done) as libc::off_t;
            // SAFETY: `src` is open and `buf` is writable for `want` bytes.
            let n = retrying(|| unsafe {
                libc::pread(src.as_raw_fd(), buf.as_mut_ptr().cast(), want, at)
            })?;
            if n == 0 {
                return Err(shrunk());
            }
            let mut put = 0;
            while put < n {
                let at = (offset + done) as libc::off_t + put as libc::off_t;
                let rest = &buf[put..n];
                // SAFETY: `dst` is open and `rest` is a valid buffer of its length.
                match retrying(|| unsafe {
                    libc::pwrite(dst.as_raw_fd(), rest.as_ptr().cast(), rest.len(), at)
                })? {
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
fn retrying(mut call: impl FnMut() -> libc::ssize_t) -> io::Result<usize> {
    loop {
        let n = call();
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

pub fn fchown(fd: &OwnedFd, uid: u32, gid: u32) -> io::Result<()> {
    // SAFETY: `fd` is an open descriptor.
    check(unsafe { libc::fchown(fd.as_raw_fd(), uid, gid) })
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
    // _IOW(0x94, 13, struct file_clone_range); the libc crate does not define it.
    const FICLONERANGE: libc::c_ulong = 0x4020_940d;
    let range = FileCloneRange {
        src_fd: src.as_raw_fd().into(),
        src_offset: offset,
        src_length: len,
        dest_offset: offset,
    };
    // SAFETY: both descriptors are open; `range` is a valid file_clone_range the kernel reads.
    check(unsafe { libc::ioctl(dst.as_raw_fd(), FICLONERANGE, &range) })
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

/// A zeroed, page-aligned buffer (O_DIRECT needs aligned memory, offsets and lengths).
struct Aligned {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl Aligned {
    fn new(len: usize) -> Self {
        let layout = std::alloc::Layout::from_size_align(len, DIRECT_ALIGN).expect("valid layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Self { ptr, layout }
    }

    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` points to `layout.size()` initialized bytes owned by this value.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.layout.size()) }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this very layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
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
    // SAFETY: F_GETFL/F_SETFL on an open descriptor have no memory effects.
    let flags = unsafe { libc::fcntl(dst.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(dst.as_raw_fd(), libc::F_SETFL, flags | libc::O_DIRECT) } < 0 {
        return match io::Error::last_os_error().raw_os_error() {
            Some(libc::EINVAL | libc::EOPNOTSUPP) => copy_range(src, dst, offset, len, way),
            _ => Err(io::Error::last_os_error()),
        };
    }
    let direct = std::fs::File::from(dst.try_clone()?);
    // SAFETY: POSIX_FADV_SEQUENTIAL is advice; it has no memory effects.
    unsafe {
        libc::posix_fadvise(
            src.as_raw_fd(),
            offset as libc::off_t,
            len as libc::off_t,
            libc::POSIX_FADV_SEQUENTIAL,
        )
    };
    use std::os::unix::fs::FileExt;
    let src = std::fs::File::from(src.try_clone()?);
    let mut buf = Aligned::new(DIRECT_BUF);
    let buf = buf.as_mut();
    let mut done = 0u64;
    while done < len {
        let want = (len - done).min(DIRECT_BUF as u64) as usize;
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
    // SAFETY: `dir` is open and `name` a valid C string; the kernel returns a new descriptor.
    let fd = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            name.as_ptr(),
            flags | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            mode,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just handed us this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Removes the non-directory `name` in `dir` (a missing one is not an error).
pub fn unlink_at(dir: &OwnedFd, name: &CStr) -> io::Result<()> {
    // SAFETY: `dir` is open and `name` a valid C string.
    match check(unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), 0) }) {
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        other => other,
    }
}

/// Hardlinks `name` in `from` to the same name in `to` (a symlink is linked, not followed).
pub fn link_at(from: &OwnedFd, to: &OwnedFd, name: &CStr) -> io::Result<()> {
    // SAFETY: both descriptors are open directories and `name` a valid C string.
    check(unsafe {
        libc::linkat(
            from.as_raw_fd(),
            name.as_ptr(),
            to.as_raw_fd(),
            name.as_ptr(),
            0,
        )
    })
}

/// Creates the symlink `name` → `target` in `dir`, owned by `uid:gid`, with the mtime `mtime`.
pub fn symlink_at(
    dir: &OwnedFd,
    name: &CStr,
    target: &Path,
    owner: Option<(u32, u32)>,
    mtime: (i64, i64),
) -> io::Result<()> {
    let target = CString::new(target.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `dir` is open; both strings are valid C strings.
    check(unsafe { libc::symlinkat(target.as_ptr(), dir.as_raw_fd(), name.as_ptr()) })?;
    if let Some((uid, gid)) = owner {
        // SAFETY: as above; AT_SYMLINK_NOFOLLOW changes the link itself.
        check(unsafe {
            libc::fchownat(
                dir.as_raw_fd(),
                name.as_ptr(),
                uid,
                gid,
                libc::AT_SYMLINK_NOFOLLOW,
            )
        })?;
    }
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
