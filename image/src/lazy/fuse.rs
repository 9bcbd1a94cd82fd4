//! A minimal FUSE server of berth's own over `/dev/fuse`: one directory holding one read-only
//! file ([`FILE_NAME`]) whose bytes come from a [`Backing`]. Just the requests a loop device on
//! that file needs (INIT, LOOKUP, GETATTR, OPEN, READ, RELEASE, FLUSH, STATFS, DESTROY; ENOSYS
//! for the rest), so no libfuse and no `fusermount`: berth is root and mounts with mount(2).
//!
//! The mount has no `allow_other`: only root (who mounted it) may open the file, so a user
//! cannot read an image they were not given by looking at the mount (the container sees the
//! squashfs mounted from it, never this file).

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::Arc;

use nix::mount::MsFlags;

/// The one file the server shows.
pub const FILE_NAME: &str = "image.sqsh";
/// Largest READ asked for (FUSE_MAX_PAGES with 256 pages).
const MAX_READ: u32 = 1 << 20;
/// Room for one request: a header plus the largest READ or WRITE the kernel may send.
const REQUEST_BUF: usize = (1 << 20) + 4096;

const ROOT_INO: u64 = 1;
const FILE_INO: u64 = 2;

const FUSE_LOOKUP: u32 = 1;
const FUSE_FORGET: u32 = 2;
const FUSE_GETATTR: u32 = 3;
const FUSE_OPEN: u32 = 14;
const FUSE_READ: u32 = 15;
const FUSE_STATFS: u32 = 17;
const FUSE_RELEASE: u32 = 18;
const FUSE_FLUSH: u32 = 25;
const FUSE_INIT: u32 = 26;
const FUSE_OPENDIR: u32 = 27;
const FUSE_RELEASEDIR: u32 = 29;
const FUSE_INTERRUPT: u32 = 36;
const FUSE_DESTROY: u32 = 38;
const FUSE_BATCH_FORGET: u32 = 42;

const FUSE_ASYNC_READ: u32 = 1 << 0;
const FUSE_MAX_PAGES: u32 = 1 << 22;
/// FOPEN_KEEP_CACHE: the file never changes, its page cache may outlive an open.
const FOPEN_KEEP_CACHE: u32 = 1 << 1;
/// FOPEN_NOFLUSH: a close sends no FLUSH. The server's threads live in the process that opens
/// the file (for the loop device and the image's config): a process killed with such a file
/// open closes it in its exit after its threads are gone, and a FLUSH then would wait for an
/// answer forever (an unkillable process holding the mounts). RELEASE is sent without waiting.
const FOPEN_NOFLUSH: u32 = 1 << 5;

/// What serves the file's bytes.
pub trait Backing: Send + Sync {
    fn size(&self) -> u64;
    /// Fills `buf` from `offset` (the caller keeps it within the file); an error becomes EIO.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), crate::ImageError>;
}

/// Mounts a FUSE file system at `target` (read-only, nosuid, nodev) and returns the open
/// `/dev/fuse` it is served on.
pub fn mount(target: &Path) -> std::io::Result<File> {
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")?;
    let options = format!(
        "fd={},rootmode=40000,user_id=0,group_id=0,max_read={MAX_READ}",
        dev.as_raw_fd()
    );
    nix::mount::mount(
        Some("berth-lazy"),
        target,
        Some("fuse.berth-lazy"),
        MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(options.as_str()),
    )?;
    Ok(dev)
}

/// Serves requests from `dev` on `threads` threads until the file system is unmounted.
pub fn serve(
    dev: File,
    backing: Arc<dyn Backing>,
    threads: usize,
) -> Vec<std::thread::JoinHandle<()>> {
    let mut handles = Vec::new();
    for _ in 0..threads.max(1) {
        let Ok(dev) = dev.try_clone() else { break };
        let backing = backing.clone();
        handles.push(std::thread::spawn(move || worker(dev, backing.as_ref())));
    }
    handles
}

fn worker(mut dev: File, backing: &dyn Backing) {
    // No signal for this thread: `berth run` takes SIGTERM, SIGINT and the rest on its main
    // thread (blocked there, read from a signalfd) to pass them to the container and clean up.
    // A thread that left them unblocked took a process-directed SIGTERM itself, whose default
    // action killed berth at once and left the mounts, the cgroup and the state behind.
    let _ = nix::sys::signal::SigSet::all().thread_block();
    let mut buf = vec![0u8; REQUEST_BUF];
    loop {
        let n = match dev.read(&mut buf) {
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR | libc::EAGAIN | libc::ENOENT)
                ) =>
            {
                continue;
            }
            // ENODEV: unmounted. Anything else: nothing more can be served.
            Err(_) => return,
        };
        let Some(reply) = handle(&buf[..n], backing) else {
            continue;
        };
        if dev.write_all(&reply).is_err() {
            // ENOENT: the request was interrupted meanwhile; the kernel forgot it.
            continue;
        }
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4)
        .and_then(|s| s.try_into().ok())
        .map_or(0, u32::from_ne_bytes)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    b.get(at..at + 8)
        .and_then(|s| s.try_into().ok())
        .map_or(0, u64::from_ne_bytes)
}

/// A reply: the 16-byte out header, then the body.
struct Reply(Vec<u8>);

impl Reply {
    fn new(unique: u64) -> Self {
        let mut v = Vec::with_capacity(256);
        v.extend_from_slice(&0u32.to_ne_bytes());
        v.extend_from_slice(&0i32.to_ne_bytes());
        v.extend_from_slice(&unique.to_ne_bytes());
        Self(v)
    }
    fn u16(mut self, x: u16) -> Self {
        self.0.extend_from_slice(&x.to_ne_bytes());
        self
    }
    fn u32(mut self, x: u32) -> Self {
        self.0.extend_from_slice(&x.to_ne_bytes());
        self
    }
    fn u64(mut self, x: u64) -> Self {
        self.0.extend_from_slice(&x.to_ne_bytes());
        self
    }
    fn zeros(mut self, n: usize) -> Self {
        self.0.resize(self.0.len() + n, 0);
        self
    }
    fn done(mut self) -> Vec<u8> {
        let len = u32::try_from(self.0.len()).unwrap_or(u32::MAX);
        self.0[..4].copy_from_slice(&len.to_ne_bytes());
        self.0
    }
    fn error(unique: u64, errno: i32) -> Vec<u8> {
        let mut r = Self::new(unique);
        r.0[4..8].copy_from_slice(&(-errno).to_ne_bytes());
        r.done()
    }
    /// `struct fuse_attr` (88 bytes).
    fn attr(self, ino: u64, size: u64) -> Self {
        let (mode, nlink) = if ino == ROOT_INO {
            (libc::S_IFDIR | 0o500, 2)
        } else {
            (libc::S_IFREG | 0o400, 1)
        };
        self.u64(ino)
            .u64(size)
            .u64(size.div_ceil(512))
            .zeros(24) // atime, mtime, ctime
            .zeros(12) // their nanoseconds
            .u32(mode)
            .u32(nlink)
            .u32(0) // uid
            .u32(0) // gid
            .u32(0) // rdev
            .u32(4096) // blksize
            .u32(0) // flags
    }
}

/// Answers one request; `None` for those that take no answer (FORGET, INTERRUPT).
fn handle(req: &[u8], backing: &dyn Backing) -> Option<Vec<u8>> {
    let opcode = u32_at(req, 4);
    let unique = u64_at(req, 8);
    let node = u64_at(req, 16);
    let body = req.get(40..).unwrap_or_default();
    // Attributes never change: the kernel may keep them for a day.
    const VALID_S: u64 = 86_400;
    Some(match opcode {
        FUSE_INIT => {
            let max_readahead = u32_at(body, 8);
            Reply::new(unique)
                .u32(7)
                .u32(31)
                .u32(max_readahead)
                .u32(FUSE_ASYNC_READ | FUSE_MAX_PAGES)
                .u16(16) // max_background
                .u16(12) // congestion_threshold
                .u32(4096) // max_write
                .u32(1) // time_gran
                .u16(u16::try_from(MAX_READ / 4096).unwrap_or(256)) // max_pages
                .u16(0) // map_alignment
                .u32(0) // flags2
                .zeros(28)
                .done()
        }
        FUSE_LOOKUP => {
            let name = body.split(|b| *b == 0).next().unwrap_or_default();
            if node != ROOT_INO || name != FILE_NAME.as_bytes() {
                return Some(Reply::error(unique, libc::ENOENT));
            }
            Reply::new(unique)
                .u64(FILE_INO)
                .u64(0) // generation
                .u64(VALID_S)
                .u64(VALID_S)
                .u32(0)
                .u32(0)
                .attr(FILE_INO, backing.size())
                .done()
        }
        FUSE_GETATTR => {
            let size = if node == FILE_INO { backing.size() } else { 0 };
            Reply::new(unique)
                .u64(VALID_S)
                .u32(0)
                .u32(0)
                .attr(node, size)
                .done()
        }
        FUSE_OPEN => {
            let flags = u32_at(body, 0);
            if node != FILE_INO {
                return Some(Reply::error(unique, libc::EISDIR));
            }
            if flags & 3 != u32::try_from(libc::O_RDONLY).unwrap_or(0) {
                return Some(Reply::error(unique, libc::EROFS));
            }
            Reply::new(unique)
                .u64(0)
                .u32(FOPEN_KEEP_CACHE | FOPEN_NOFLUSH)
                .u32(0)
                .done()
        }
        FUSE_OPENDIR => Reply::new(unique).u64(0).u32(0).u32(0).done(),
        FUSE_READ => {
            let offset = u64_at(body, 8);
            let size = u64::from(u32_at(body, 16).min(MAX_READ));
            if node != FILE_INO {
                return Some(Reply::error(unique, libc::EISDIR));
            }
            let end = offset.saturating_add(size).min(backing.size());
            let len = usize::try_from(end.saturating_sub(offset)).unwrap_or(0);
            let mut r = Reply::new(unique);
            let at = r.0.len();
            r.0.resize(at + len, 0);
            if let Err(e) = backing.read_at(offset, &mut r.0[at..]) {
                // Said once when the image is unmounted (LazyMount's drop): a read is retried.
                tracing::debug!("{e}");
                return Some(Reply::error(unique, libc::EIO));
            }
            r.done()
        }
        FUSE_STATFS => Reply::new(unique)
            .u64(backing.size().div_ceil(4096))
            .zeros(32) // bfree, bavail, files, ffree
            .u32(4096) // bsize
            .u32(255) // namelen
            .u32(4096) // frsize
            .zeros(28)
            .done(),
        // FLUSH: ENOSYS tells the kernel to send none again on this connection (FOPEN_NOFLUSH
        // above already keeps the file's closes from sending it).
        FUSE_FLUSH => Reply::error(unique, libc::ENOSYS),
        FUSE_RELEASE | FUSE_RELEASEDIR | FUSE_DESTROY => Reply::new(unique).done(),
        FUSE_FORGET | FUSE_BATCH_FORGET | FUSE_INTERRUPT => return None,
        _ => Reply::error(unique, libc::ENOSYS),
    })
}
