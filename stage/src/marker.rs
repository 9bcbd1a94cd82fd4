//! The completion marker: written last, read to know whether a destination is completely staged.

use std::io::Write;
use std::os::fd::OwnedFd;
use std::path::Path;

use super::{MARKER, MARKER_TMP, Marker, fsops};

/// Reads the completion marker of a staged tree: `None` when the tree is not (or not yet)
/// completely staged.
pub fn status(dest: &Path) -> Option<Marker> {
    let fd = nix::fcntl::open(
        dest,
        nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_DIRECTORY | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .ok()?;
    read_marker(&fd)
}

/// The most a completion marker may hold: a path and a few numbers.
const MARKER_MAX: u64 = 64 * 1024;

/// The completion marker in the open destination root, if a valid one is there.
/// A regular file only (never a symlink, never blocking on a FIFO), read bounded.
pub(super) fn read_marker(root: &OwnedFd) -> Option<Marker> {
    let fd = fsops::open_beneath(
        root,
        Path::new(MARKER),
        libc::O_RDONLY | libc::O_NONBLOCK,
        0,
    )
    .ok()?;
    let mut file = std::fs::File::from(fd);
    if !file.metadata().ok()?.is_file() {
        return None;
    }
    let text = berth_sys::privfs::read_bounded(&mut file, MARKER_MAX).ok()?;
    serde_json::from_slice(&text).ok()
}

pub(super) fn write_marker(root: &OwnedFd, marker: &Marker) -> std::io::Result<()> {
    let fd = fsops::open_beneath(
        root,
        Path::new(MARKER_TMP),
        libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC,
        0o644,
    )?;
    let mut f = std::fs::File::from(fd);
    f.write_all(&serde_json::to_vec_pretty(marker).map_err(std::io::Error::other)?)?;
    f.sync_all()?;
    let tmp = std::ffi::CString::new(MARKER_TMP).expect("no NUL");
    let fin = std::ffi::CString::new(MARKER).expect("no NUL");
    nix::fcntl::renameat(root, tmp.as_c_str(), root, fin.as_c_str()).map_err(std::io::Error::from)
}
