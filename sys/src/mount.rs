//! Small helpers of the mount API that the image store and the runtime both use: overlayfs
//! option quoting and O_PATH fds of mount targets that never follow a symlink.

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag, openat2};

/// Escapes a path for overlayfs's lowerdir/upperdir option syntax, where `,` and `:` separate
/// values and `\` escapes.
pub fn overlay_escape(path: &Path) -> String {
    let mut out = String::new();
    for c in path.to_string_lossy().chars() {
        if matches!(c, '\\' | ',' | ':') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// An O_PATH fd of `rel` beneath `dir` that follows no symlink (nor magic link) and never leaves
/// `dir`: [`crate::privfs::open_beneath`] for O_PATH, which openat2 takes only without the O_NOCTTY that
/// privfs adds.
pub fn path_beneath(dir: impl AsFd, rel: &Path) -> Result<OwnedFd, Errno> {
    let how = OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS);
    let rel = rel.strip_prefix("/").unwrap_or(rel);
    openat2(dir, rel, how)
}
