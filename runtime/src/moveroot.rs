//! The container root on nodes whose host root is the initramfs itself (diskless nodes booted
//! without a tmpfs root), where `pivot_root` fails with EINVAL: the root is moved onto `/`
//! instead ([`move_root`]), and a process joining the container later enters it through
//! `/proc/<init>/root` ([`enter_root`]).

use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::mount::MsFlags;
use nix::sys::stat::Mode;

use super::SetupError;

/// The most of /proc/self/mountinfo berth reads: thousands of mounts fit many times over.
const MOUNTINFO_LIMIT: u64 = 64 << 20;

/// Moves the container root mounted at `merged` (the working directory) onto `/` and chroots
/// into it: what runc and crun do when `pivot_root` fails with EINVAL because the host root is
/// the initramfs itself (rootfs cannot be moved, so diskless nodes booted without a tmpfs root
/// cannot pivot). Called in the container's private mount namespace, as root, after the root is
/// complete (proc, sys, dev, masks).
///
/// The isolation stays what pivot_root gives:
/// - Every host mount is detached, so the namespace holds only rootfs (which can never be
///   unmounted) below the container's mounts; `/proc/self/mountinfo` inside shows none of them.
/// - rootfs' own files are covered, reachable only by walking `..` above the process root, which
///   needs a second `chroot`: the command has no capability (CAP_SYS_CHROOT included), and it
///   cannot get one in a user namespace of its own because the root is not the top of the
///   namespace's root: between rootfs and the container sits an empty tmpfs (`top`), with the
///   container mounted on a directory of it, so the kernel counts every process in it as
///   chrooted and refuses it new user namespaces (`current_chrooted()` in create_user_ns). A
///   process that joins the namespace lands on that tmpfs and enters the container's root
///   through `/proc/<init>/root` ([`enter_root`]).
pub(super) fn move_root(merged: &Path, work: &Path) -> Result<(), SetupError> {
    let fail = |what: String| move |e: Errno| SetupError::new(format!("{what}: {e}"));
    // Before anything moves: rootfs' root, and the host mounts on it (each with the mounts on
    // top of it), opened beneath that root without following symlinks, so that no path a user
    // can rename (a FUSE mount in a home directory) leads the detaching anywhere else.
    let rootfs = nix::fcntl::open(
        "/",
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(fail("opening the host root".into()))?;
    let mut host = Vec::new();
    for rel in host_mounts()? {
        match super::mounts::path_beneath(&rootfs, &rel) {
            Ok(fd) => host.push((rel, fd)),
            // Gone or replaced since mountinfo was read: nothing of the host to detach there.
            Err(Errno::ENOENT | Errno::ELOOP | Errno::EXDEV | Errno::ENOTDIR) => {}
            Err(e) => {
                return Err(SetupError::new(format!(
                    "opening the host mount /{}: {e}",
                    rel.display()
                )));
            }
        }
    }
    let top = work.join("top");
    std::fs::create_dir(&top)
        .map_err(|e| SetupError::new(format!("creating {}: {e}", top.display())))?;
    nix::mount::mount(
        Some("tmpfs"),
        &top,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some("mode=755,size=16k,nr_inodes=4"),
    )
    .map_err(fail(format!("mounting a tmpfs on {}", top.display())))?;
    let place = top.join("root");
    std::fs::create_dir(&place)
        .map_err(|e| SetupError::new(format!("creating {}: {e}", place.display())))?;
    // The working directory is the container root's mount: it follows the moves.
    nix::mount::mount(
        Some(merged),
        &place,
        None::<&str>,
        MsFlags::MS_MOVE,
        None::<&str>,
    )
    .map_err(fail("moving the container root under its tmpfs".into()))?;
    nix::mount::mount(
        Some(&top),
        "/",
        None::<&str>,
        MsFlags::MS_MOVE,
        None::<&str>,
    )
    .map_err(fail(
        "moving the container root onto / (the host root is the initramfs)".into(),
    ))?;
    nix::unistd::chroot(".").map_err(fail("chroot into the container root".into()))?;
    nix::unistd::chdir("/").map_err(fail("entering /".into()))?;
    // Detached through the container's /proc: the fds reach mounts no path inside does.
    for (rel, fd) in &host {
        let path = berth_sys::privfs::fd_path(fd);
        match nix::mount::umount2(&path, nix::mount::MntFlags::MNT_DETACH) {
            // Not a mount's root any more (replaced since mountinfo was read).
            Ok(()) | Err(Errno::EINVAL) => {}
            Err(e) => {
                return Err(SetupError::new(format!(
                    "detaching the host mount /{} from the container's namespace through {}: {e} (the container needs /proc)",
                    rel.display(),
                    path.display()
                )));
            }
        }
    }
    Ok(())
}

/// The mounts directly on the root mount of this namespace (rootfs), relative to `/`, from
/// /proc/self/mountinfo (`ID PARENT MAJ:MIN ROOT MOUNTPOINT ...`). Detaching one detaches every
/// mount on top of and beneath it.
fn host_mounts() -> Result<Vec<PathBuf>, SetupError> {
    let fail =
        |e: &dyn std::fmt::Display| SetupError::new(format!("reading /proc/self/mountinfo: {e}"));
    let mut file = std::fs::File::open("/proc/self/mountinfo").map_err(|e| fail(&e))?;
    let text = berth_sys::privfs::read_bounded(&mut file, MOUNTINFO_LIMIT).map_err(|e| fail(&e))?;
    let entries: Vec<(&[u8], &[u8], Vec<u8>)> = text
        .split(|&b| b == b'\n')
        .filter_map(|line| {
            let mut f = line.split(|&b| b == b' ');
            let id = f.next()?;
            let parent = f.next()?;
            Some((id, parent, unescape(f.nth(2)?)))
        })
        .collect();
    // The root mount: on `/`, its own parent (rootfs) or its parent outside this namespace.
    let root = entries
        .iter()
        .find(|(id, parent, point)| {
            point == b"/" && (id == parent || !entries.iter().any(|(other, _, _)| other == parent))
        })
        .map(|(id, _, _)| *id)
        .ok_or_else(|| fail(&"no root mount listed"))?;
    Ok(entries
        .iter()
        .filter(|(id, parent, _)| *parent == root && *id != root)
        .filter_map(|(_, _, point)| point.strip_prefix(b"/").filter(|rel| !rel.is_empty()))
        .map(|rel| PathBuf::from(std::ffi::OsString::from_vec(rel.to_vec())))
        .collect())
}

/// Undoes mountinfo's octal escapes (`\040` for a space, `\011`, `\012`, `\134`).
fn unescape(field: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(field.len());
    let mut i = 0;
    while i < field.len() {
        let octal = field
            .get(i + 1..i + 4)
            .filter(|d| field[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(d) => {
                out.push(d.iter().fold(0u8, |v, c| v.wrapping_mul(8) + (c - b'0')));
                i += 4;
            }
            None => {
                out.push(field[i]);
                i += 1;
            }
        }
    }
    out
}

/// Makes `root` (an fd of `/proc/<init>/root`, opened before joining) the root and working
/// directory of a process that joined the container's mount namespace: setns puts it on the
/// namespace's top mount, which is the container root after pivot_root but the tmpfs below it
/// after [`move_root`].
pub(super) fn enter_root(root: &OwnedFd) -> Result<(), SetupError> {
    nix::unistd::fchdir(root)
        .and_then(|()| nix::unistd::chroot("."))
        .and_then(|()| nix::unistd::chdir("/"))
        .map_err(|e| SetupError::new(format!("entering the container's root: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape(br"/a\040b\011c\134d"), b"/a b\tc\\d");
        assert_eq!(unescape(br"/plain"), b"/plain");
        assert_eq!(unescape(br"/trailing\04"), br"/trailing\04");
        assert_eq!(unescape(br"\9999"), br"\9999");
    }
}
