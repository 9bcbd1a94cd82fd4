//! The node-wide mounts of squashfs images: each image is loop-mounted once, read-only, nosuid,
//! nodev, at `<mount_dir>/<digest hex>` in the host's mount namespace, and every container of it
//! uses that directory as its overlay lower layer. Mounting is idempotent and safe between
//! processes (a `flock` per image, and `/proc/self/mountinfo` tells whether it is mounted);
//! `unmount_unused` unmounts what no container uses (gc, Slurm epilog), after which the loop
//! device detaches itself (autoclear) once the last overlay on it is gone.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::mount::{MntFlags, MsFlags};

use super::loopdev::{LoopDevice, LoopError};
use super::squashfs::{SquashfsError, probe_squashfs_magic};
use super::{ImageError, Rootfs};

#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("image digest {0:?} is not sha256:<64 hex digits>")]
    Digest(String),
    #[error("{0}: this image is stored as layer directories, not as a squashfs")]
    NotSquashfs(String),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{path} is already a {fstype} mount, not this image's squashfs; unmount it or set another [squashfs] mount_dir"
    )]
    Occupied { path: PathBuf, fstype: String },
    #[error("attaching {file} to a loop device: {source}")]
    Loop { file: PathBuf, source: LoopError },
    #[error("mounting the squashfs of {file} (byte {offset}) on {target}: {errno}{hint}")]
    Mount {
        file: PathBuf,
        offset: u64,
        target: PathBuf,
        errno: Errno,
        hint: &'static str,
    },
    #[error("unmounting {target}: {errno}")]
    Unmount { target: PathBuf, errno: Errno },
    #[error(transparent)]
    Squashfs(#[from] SquashfsError),
}

impl From<MountError> for ImageError {
    fn from(e: MountError) -> Self {
        match e {
            MountError::Squashfs(s) => s.into(),
            other => ImageError::Store(other.to_string()),
        }
    }
}

/// The hex part of a `sha256:<hex>` digest, checked: it becomes a directory name.
pub fn digest_hex(digest: &str) -> Result<&str, MountError> {
    let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
    if hex.len() == 64
        && hex
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        Ok(hex)
    } else {
        Err(MountError::Digest(digest.to_string()))
    }
}

/// One line of /proc/self/mountinfo, the fields berth needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    pub mount_point: PathBuf,
    /// Per-mount options (`ro,nosuid,nodev,relatime`).
    pub options: String,
    pub fstype: String,
    pub source: String,
}

/// Undoes mountinfo's octal escapes (`\040` for a space).
fn unescape(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    use std::os::unix::ffi::OsStringExt;
    std::ffi::OsString::from_vec(out)
        .into_string()
        .unwrap_or_else(|s| s.to_string_lossy().into_owned())
}

/// Parses /proc/PID/mountinfo, in mount order.
pub fn parse_mountinfo(text: &str) -> Vec<MountEntry> {
    text.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let l: Vec<&str> = left.split(' ').collect();
            let r: Vec<&str> = right.split(' ').collect();
            Some(MountEntry {
                mount_point: PathBuf::from(unescape(l.get(4)?)),
                options: l.get(5)?.to_string(),
                fstype: r.first()?.to_string(),
                source: unescape(r.get(1)?),
            })
        })
        .collect()
}

fn mounts() -> Result<Vec<MountEntry>, MountError> {
    let path = "/proc/self/mountinfo";
    let text = std::fs::read_to_string(path).map_err(|source| MountError::Io {
        what: "reading",
        path: path.into(),
        source,
    })?;
    Ok(parse_mountinfo(&text))
}

/// The topmost mount at `path`, if any.
pub fn mounted_at(path: &Path) -> Result<Option<MountEntry>, MountError> {
    Ok(mounts()?.into_iter().rev().find(|m| m.mount_point == path))
}

/// An exclusive `flock` on one image's lock file, released on drop.
struct ImageLock(#[allow(dead_code)] File);

fn lock(mount_root: &Path, hex: &str) -> Result<ImageLock, MountError> {
    let path = mount_root.join(format!(".lock-{hex}"));
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(&path)
        .map_err(|source| MountError::Io {
            what: "opening the lock",
            path: path.clone(),
            source,
        })?;
    loop {
        // SAFETY: flock on a file descriptor this function owns.
        match Errno::result(unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) }) {
            Ok(_) => return Ok(ImageLock(file)),
            Err(Errno::EINTR) => continue,
            Err(e) => {
                return Err(MountError::Io {
                    what: "locking",
                    path,
                    source: e.into(),
                });
            }
        }
    }
}

/// The mount directory itself, created if needed and resolved (mountinfo shows real paths).
fn root_dir(mount_root: &Path) -> Result<PathBuf, MountError> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(mount_root)
        .map_err(|source| MountError::Io {
            what: "creating",
            path: mount_root.to_path_buf(),
            source,
        })?;
    std::fs::canonicalize(mount_root).map_err(|source| MountError::Io {
        what: "resolving",
        path: mount_root.to_path_buf(),
        source,
    })
}

/// Mounts a squashfs image once per node (see the module doc); returns its mount point, the
/// overlay lower layer for its containers. `digest` names the mount: callers guarantee it is
/// the digest of this file's content (the store's entries are immutable).
pub fn mount_shared(
    digest: &str,
    rootfs: &Rootfs,
    mount_root: &Path,
) -> Result<PathBuf, MountError> {
    match rootfs {
        Rootfs::Squashfs { file, offset, size } => {
            mount_shared_at(digest, file, *offset, *size, mount_root)
        }
        Rootfs::Layers(_) => Err(MountError::NotSquashfs(digest.to_string())),
    }
}

/// [`mount_shared`] for the squashfs at `offset` (`size` bytes) in `file`.
pub fn mount_shared_at(
    digest: &str,
    file: &Path,
    offset: u64,
    size: u64,
    mount_root: &Path,
) -> Result<PathBuf, MountError> {
    let hex = digest_hex(digest)?;
    let root = root_dir(mount_root)?;
    let _lock = lock(&root, hex)?;
    let target = root.join(hex);
    if let Some(m) = mounted_at(&target)? {
        if m.fstype == "squashfs" {
            tracing::debug!("{} already mounted from {}", target.display(), m.source);
            return Ok(target);
        }
        return Err(MountError::Occupied {
            path: target,
            fstype: m.fstype,
        });
    }
    match std::fs::DirBuilder::new().mode(0o755).create(&target) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(source) => {
            return Err(MountError::Io {
                what: "creating",
                path: target,
                source,
            });
        }
    }
    probe_squashfs_magic(file, offset)?;
    let device = LoopDevice::attach(file, offset, size).map_err(|source| MountError::Loop {
        file: file.to_path_buf(),
        source,
    })?;
    let flags = MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    if let Err(errno) = nix::mount::mount(
        Some(&device.path),
        &target,
        Some("squashfs"),
        flags,
        None::<&str>,
    ) {
        device.detach();
        let hint = match errno {
            Errno::EPERM => " (mounting needs root)",
            Errno::EINVAL => {
                " (the kernel could not read it: is its compression built into this kernel's squashfs?)"
            }
            _ => "",
        };
        return Err(MountError::Mount {
            file: file.to_path_buf(),
            offset,
            target,
            errno,
            hint,
        });
    }
    tracing::debug!(
        "mounted {} (byte {offset}) on {} via {}",
        file.display(),
        target.display(),
        device.path.display()
    );
    // The mount holds the device now; dropping our handle leaves autoclear to detach it.
    drop(device);
    Ok(target)
}

/// Unmounts every image under `mount_root` for which `in_use(digest)` is false (`digest` as
/// `sha256:<hex>`), and removes its directory; returns the digests unmounted. An image still
/// busy on the host (a shell inside it) is left mounted and logged.
pub fn unmount_unused(
    mount_root: &Path,
    in_use: impl Fn(&str) -> bool,
) -> Result<Vec<String>, MountError> {
    let root = match std::fs::canonicalize(mount_root) {
        Ok(root) => root,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(MountError::Io {
                what: "resolving",
                path: mount_root.to_path_buf(),
                source,
            });
        }
    };
    let entries = std::fs::read_dir(&root).map_err(|source| MountError::Io {
        what: "listing",
        path: root.clone(),
        source,
    })?;
    let mut names: Vec<String> = entries
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| digest_hex(n).is_ok())
        .collect();
    names.sort();
    let mut unmounted = Vec::new();
    for hex in names {
        let digest = format!("sha256:{hex}");
        if in_use(&digest) {
            continue;
        }
        let _lock = lock(&root, &hex)?;
        let target = root.join(&hex);
        let mut was_mounted = false;
        while let Some(m) = mounted_at(&target)? {
            if m.fstype != "squashfs" {
                tracing::warn!(
                    "{} is a {} mount, not an image; left alone",
                    target.display(),
                    m.fstype
                );
                break;
            }
            match nix::mount::umount2(&target, MntFlags::empty()) {
                Ok(()) => was_mounted = true,
                Err(Errno::EBUSY) => {
                    tracing::warn!(
                        "{} is busy (a process has a file or directory open in it); left mounted",
                        target.display()
                    );
                    break;
                }
                Err(errno) => return Err(MountError::Unmount { target, errno }),
            }
        }
        if mounted_at(&target)?.is_none() {
            let _ = std::fs::remove_dir(&target);
        }
        if was_mounted {
            unmounted.push(digest);
        }
    }
    Ok(unmounted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_become_safe_names() {
        let hex = "a".repeat(64);
        assert_eq!(digest_hex(&format!("sha256:{hex}")).unwrap(), hex);
        assert_eq!(digest_hex(&hex).unwrap(), hex);
        for bad in [
            "sha256:../../etc".to_string(),
            format!("sha256:{}", "A".repeat(64)),
            "a".repeat(63),
            format!("sha512:{hex}"),
            String::new(),
        ] {
            assert!(digest_hex(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn mountinfo_lines() {
        let text = "\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n\
310 22 7:3 / /run/berth/images/abc ro,nosuid,nodev,relatime shared:170 - squashfs /dev/loop3 ro,errors=continue\n\
311 22 0:50 / /tmp/with\\040space rw - tmpfs tmpfs rw\n\
garbage\n";
        let m = parse_mountinfo(text);
        assert_eq!(m.len(), 3);
        assert_eq!(m[1].mount_point, PathBuf::from("/run/berth/images/abc"));
        assert_eq!(m[1].options, "ro,nosuid,nodev,relatime");
        assert_eq!(
            (m[1].fstype.as_str(), m[1].source.as_str()),
            ("squashfs", "/dev/loop3")
        );
        assert_eq!(m[2].mount_point, PathBuf::from("/tmp/with space"));
        assert_eq!(unescape("a\\134b\\011"), "a\\b\t");
        assert_eq!(unescape("trail\\04"), "trail\\04");
    }

    #[test]
    fn unmount_unused_on_a_missing_dir_is_a_no_op() {
        assert!(
            unmount_unused(Path::new("/nonexistent/berth-mnt"), |_| false)
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn layer_images_are_not_mounted() {
        let dir = tempfile::tempdir().unwrap();
        let err = mount_shared(
            &format!("sha256:{}", "0".repeat(64)),
            &Rootfs::Layers(vec![]),
            dir.path(),
        )
        .unwrap_err();
        assert!(matches!(err, MountError::NotSquashfs(_)));
    }
}
