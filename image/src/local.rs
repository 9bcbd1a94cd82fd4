//! Image files and directories on the node that a user names (a squashfs, SIF, OCI or Docker
//! archive, OCI layout): whether a reference is one, opening it with that user's credentials
//! ([`Opened`]: root then reads it only through the fd, DESIGN.md "Privilege model"), and the
//! stamp that identifies its content for the store's cache ([`FileStamp`]).

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use nix::fcntl::OFlag;
use serde::{Deserialize, Serialize};

use crate::reference::reference_key;
use crate::{ImageError, Reference};
use berth_sys::UserIds;

/// Whether a reference names a file or directory on the node (opened as the user who names it,
/// see [`Opened`]).
pub fn is_local_path(r: &Reference) -> bool {
    matches!(
        r,
        Reference::Squashfs(_)
            | Reference::Sif(_)
            | Reference::OciArchive { .. }
            | Reference::DockerArchive { .. }
            | Reference::OciLayout { .. }
    )
}

/// What identifies the file a local reference was read from: the file the user opened (its
/// `index.json` for an OCI layout), by `fstat` of that fd. `ctime` changes on every write and no
/// user can set it, so a file patched in place (even with its mtime put back) is a miss.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
    #[serde(default)]
    ctime_ns: i128,
}

impl FileStamp {
    /// The stamp of an open file.
    pub fn of_file(f: &File) -> std::io::Result<Self> {
        let m = f.metadata()?;
        Ok(Self {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
            ctime_ns: i128::from(m.ctime()) * 1_000_000_000 + i128::from(m.ctime_nsec()),
        })
    }
}

/// A local image a user named (a squashfs, SIF, archive or OCI layout directory), opened with
/// that user's credentials (DESIGN.md, "Privilege model"): root reads it only through this fd,
/// never through the path again, and a layout's blobs are opened beneath it as the same user.
#[derive(Debug)]
pub struct Opened {
    /// The file (a directory for an OCI layout).
    pub file: File,
    /// Who opened it; `None`: this process, with its own credentials.
    pub user: Option<UserIds>,
    /// What identifies the content for the store's cache: the file's, or the layout's
    /// `index.json`'s, `fstat`.
    pub stamp: FileStamp,
}

impl Opened {
    /// Opens what `reference` names as `user` (or as this process when `None`). A user who
    /// cannot read it gets one line, whatever the store holds.
    pub fn open(reference: &Reference, user: Option<&UserIds>) -> Result<Opened, ImageError> {
        let what = reference_key(reference);
        let (path, dir) = match reference {
            Reference::Squashfs(p) | Reference::Sif(p) => (p, false),
            Reference::OciArchive { file, .. } | Reference::DockerArchive { file, .. } => {
                (file, false)
            }
            Reference::OciLayout { dir, .. } => (dir, true),
            _ => {
                return Err(ImageError::Format(format!(
                    "internal error: {what} names no local file"
                )));
            }
        };
        let who = match user {
            Some(u) => format!("uid {}", u.uid),
            None => "berth".to_string(),
        };
        let refused = |e: std::io::Error| {
            ImageError::Format(format!(
                "image {what}: {who} cannot open {}: {e}; give a {} the job's user can read",
                path.display(),
                if dir { "directory" } else { "file" }
            ))
        };
        let file = match user {
            Some(u) => berth_sys::privfs::open_readable_as_user(path, u),
            None => berth_sys::privfs::open_as_user(
                path,
                &berth_sys::user::current().unwrap_or_default(),
                OFlag::O_RDONLY | OFlag::O_NONBLOCK,
            )
            .map(File::from),
        }
        .map_err(refused)?;
        let meta = file.metadata().map_err(refused)?;
        if meta.is_dir() != dir || !(meta.is_dir() || meta.is_file()) {
            return Err(ImageError::Format(format!(
                "image {what}: {} is not a {}",
                path.display(),
                if dir {
                    "directory (an OCI image layout)"
                } else {
                    "regular file"
                }
            )));
        }
        nix::fcntl::fcntl(&file, nix::fcntl::FcntlArg::F_SETFL(OFlag::empty()))
            .map_err(|e| refused(e.into()))?;
        let stamp = if dir {
            let open = || {
                berth_sys::privfs::open_beneath(
                    &file,
                    Path::new("index.json"),
                    OFlag::O_RDONLY | OFlag::O_NONBLOCK,
                    0,
                    true,
                )
            };
            let index = match user {
                Some(u) => berth_sys::privfs::as_user(u, open).and_then(|r| r),
                None => open(),
            }
            .map(File::from)
            .map_err(|e| {
                ImageError::Format(format!(
                    "image {what}: {} is not an OCI image layout (no readable index.json: {e})",
                    path.display()
                ))
            })?;
            FileStamp::of_file(&index)
        } else {
            FileStamp::of_file(&file)
        }
        .map_err(refused)?;
        Ok(Opened {
            file,
            user: user.cloned(),
            stamp,
        })
    }

    /// The path through which root reads the opened file (`/proc/self/fd/N`).
    pub fn fd_path(&self) -> PathBuf {
        berth_sys::privfs::fd_path(&self.file)
    }
}
