//! Small files berth writes into a container's root so that the image's own tools work in it, as
//! Enroot's hooks do. Each runs in init as root after the root is built (`rootfs::setup`), on a
//! tree the image and the user control: every path is opened beneath the container's `/` with
//! `privfs::open_beneath` (no symlink followed, no mount crossed, so a directory bound from the
//! host is never written), a new file is created exclusively (anything in the way: left alone),
//! and what is written lands in the tmpfs upper layer, never in the image.

use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use nix::fcntl::{OFlag, open};
use nix::sys::stat::Mode;

use super::SetupError;
use berth_sys::privfs;

/// Where the apt setting goes, and its name: after the image's own files (apt reads the
/// directory in order, the last setting wins).
const APT_CONF_DIR: &str = "etc/apt/apt.conf.d";
pub const APT_CONF_NAME: &str = "99berth-remap-root";

/// What the apt hook writes: Enroot's 10-aptfix hook's setting.
pub const APT_CONF: &str = "\
// Written by berth for a remapped-root container (--remap-root, --container-remap-root), as
// Enroot does: the namespace maps only the user, so apt's download sandbox cannot switch to
// _apt; it runs as the container's root (the user) instead. Only in this container's writable
// layer, not in the image.
APT::Sandbox::User \"root\";
";

/// For a remapped container whose image has /etc/apt/apt.conf.d: makes apt run its downloads as
/// root ([`APT_CONF`]), or `apt-get update` fails with "setgroups 65534 failed". Leaves the
/// root as it is (logged at debug) when the directory is missing, is reached through a symlink
/// or another mount, or the file's name is taken; fails only when writing the new file fails.
/// The file belongs to the directory's owner (the image's root through the idmapping: the
/// container's root), so that the container's root can change it.
pub fn apt_sandbox_as_root() -> Result<(), SetupError> {
    let leave = |why: &dyn std::fmt::Display| {
        tracing::debug!("no apt setting for the remapped root in /{APT_CONF_DIR}: {why}");
        Ok(())
    };
    let root = open(
        "/",
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| SetupError::new(format!("opening the container root: {e}")))?;
    let dir = match privfs::open_beneath(
        &root,
        Path::new(APT_CONF_DIR),
        OFlag::O_RDONLY | OFlag::O_DIRECTORY,
        0,
        true,
    ) {
        Ok(fd) => fd,
        Err(e) => return leave(&e),
    };
    let owner = match std::fs::File::from(
        dir.try_clone()
            .map_err(|e| SetupError::new(format!("duplicating an fd: {e}")))?,
    )
    .metadata()
    {
        Ok(m) => m,
        Err(e) => return leave(&e),
    };
    let file = match privfs::open_beneath(
        dir.as_fd(),
        Path::new(APT_CONF_NAME),
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL,
        0o644,
        true,
    ) {
        Ok(fd) => fd,
        // A read-only root (EROFS) or anything already there (EEXIST, a symlink included):
        // the image's apt stays as it is.
        Err(e) => return leave(&e),
    };
    let fail = |e: &dyn std::fmt::Display| {
        SetupError::new(format!(
            "writing /{APT_CONF_DIR}/{APT_CONF_NAME} in the container: {e}"
        ))
    };
    nix::unistd::fchown(
        &file,
        Some(nix::unistd::Uid::from_raw(owner.uid())),
        Some(nix::unistd::Gid::from_raw(owner.gid())),
    )
    .map_err(|e| fail(&e))?;
    std::fs::File::from(file)
        .write_all(APT_CONF.as_bytes())
        .map_err(|e| fail(&e))
}
