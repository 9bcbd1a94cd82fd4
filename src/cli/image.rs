//! Turns what a user names as an image (`--image`, `--container-image`) into root filesystem
//! layers and the image's defaults, importing it into the node's store when needed.

use std::path::PathBuf;

use super::Failure;
use super::import::failure;
use crate::config::Config;
use crate::image::ImageError;
use crate::image::import::{self, Opened, Requester};
use crate::image::reference;
use crate::image::store::{self, InUse, Store};
use crate::spec::UserIds;
use crate::spec::image::ImageDefaults;

/// An image ready to stack: overlay lowers, topmost first, and its config's defaults.
#[derive(Debug)]
pub struct Resolved {
    pub lowers: Vec<PathBuf>,
    pub defaults: ImageDefaults,
    pub digest: Option<String>,
    /// Keeps the image from garbage collection (or a directory image attached) while the
    /// container runs.
    pub in_use: Option<Held>,
}

/// What a resolved image holds until its container has started (or ended).
#[derive(Debug)]
pub enum Held {
    /// A stored image marked in use.
    Image(InUse),
    /// A directory image, attached where root alone reaches it.
    Directory(crate::image::mount::DirectoryMount),
}

/// Resolves an image for `user`. A directory is used as the root filesystem itself (berth's
/// extension to Pyxis's syntax); anything else is an image reference for the store. Whatever
/// names a path on the node (a directory, `.sqsh`, `.sif`, `oci:`, `oci-archive:`,
/// `docker-archive:`) is opened with `user`'s credentials and read by root only through that fd
/// (DESIGN.md, "Privilege model"), so a user reaches no image they could not read themselves,
/// even one the store already holds.
pub fn resolve(
    text: &str,
    config: &Config,
    user: &UserIds,
    arch: Option<String>,
) -> Result<Resolved, Failure> {
    let path = PathBuf::from(text);
    if path.is_absolute() {
        match crate::privfs::open_readable_as_user(&path, user) {
            Ok(dir) if dir.metadata().is_ok_and(|m| m.is_dir()) => {
                // The overlay gets exactly the directory the user opened, whatever is renamed or
                // swapped at its path meanwhile: a copy of its mount taken from the fd, attached
                // in root's own directory until the container has its own copy.
                let tree = detached_tree(&dir).map_err(|e| {
                    Failure::system(format!("image {text}: taking the directory's mount: {e}"))
                })?;
                let attached =
                    crate::image::mount::attach_directory(&tree, &path, &config.squashfs.mount_dir)
                        .map_err(|e| Failure::system(e.to_string()))?;
                return Ok(Resolved {
                    lowers: vec![attached.path().to_path_buf()],
                    defaults: ImageDefaults::default(),
                    digest: None,
                    in_use: Some(Held::Directory(attached)),
                });
            }
            Ok(_) => {}
            Err(e) if path.is_dir() => {
                return Err(Failure::input(format!(
                    "image {text}: uid {} cannot read this directory ({e}); give an image the job's user can read",
                    user.uid
                )));
            }
            Err(_) => {}
        }
    }
    let reference = reference::parse(text).map_err(failure)?;
    let opened = if store::is_local_path(&reference) {
        Some(Opened::open(&reference, Some(user)).map_err(|e| match e {
            ImageError::Format(m) => Failure::input(m),
            other => failure(other),
        })?)
    } else {
        None
    };
    let store = Store::open(&config.store).map_err(failure)?;
    let who = Requester {
        uid: user.uid,
        home: user.home.as_deref(),
        arch,
    };
    let progress = |line: &str| tracing::info!("{line}");
    let image = import::get_or_import(
        &store,
        &reference,
        opened.as_ref(),
        &config.image(),
        &who,
        &progress,
    )
    .map_err(failure)?;
    let in_use = store.use_image(&image.digest).map_err(failure)?;
    let lowers =
        import::lowers(&image, opened.as_ref(), &store, &config.image()).map_err(failure)?;
    Ok(Resolved {
        lowers,
        defaults: ImageDefaults::from_config(&image.config),
        digest: Some(image.digest),
        in_use: Some(Held::Image(in_use)),
    })
}

/// A detached copy (`open_tree` OPEN_TREE_CLONE) of the mount at the open directory `dir`, rooted
/// at it: taken from the fd, never by a path a user can change.
fn detached_tree(dir: &std::fs::File) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::{AsRawFd, FromRawFd};
    const OPEN_TREE_CLONE: libc::c_uint = 1;
    let flags =
        OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint | libc::AT_EMPTY_PATH as libc::c_uint;
    // SAFETY: open_tree on an open fd with an empty NUL-terminated path; returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_open_tree, dir.as_raw_fd(), c"".as_ptr(), flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(std::io::Error::other)?;
    // SAFETY: the kernel just returned this fd, owned by nobody else.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}
