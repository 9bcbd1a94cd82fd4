//! Builds the container's root inside its new mount namespace: an overlay of the image over a
//! tmpfs upper layer, the Spec's mounts, a minimal /dev, masked /proc paths, then pivot_root.
//! Every mount lives only in the container's namespace, so the kernel drops them all when the
//! container's last process exits: nothing to unmount on the host, even after a crash.

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use nix::fcntl::{OFlag, open};
use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::sys::stat::{Mode, SFlag, makedev, mknodat};
use nix::unistd::{Gid, Uid, chdir, fchownat, pivot_root, symlinkat};
use oci_spec::runtime::{LinuxDeviceType, Spec};

use super::SetupError;
use super::mounts::{self, ensure_in_root, fd_path, overlay_escape};
use berth_sys::privfs;

/// /proc and /sys paths hidden from containers, as docker and runc hide them.
pub const MASKED_PATHS: [&str; 10] = [
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
];

/// /proc paths made read-only: writable by uid 0 without any capability (sysrq-trigger!).
pub const READONLY_PATHS: [&str; 5] = [
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
];

fn sys(what: String) -> impl FnOnce(nix::errno::Errno) -> SetupError {
    move |e| SetupError::new(format!("{what}: {e}"))
}

/// Lays out the root under `work` (a per-container directory) and pivots into it. `layers` are
/// the image's layers (`lowers`, topmost first), opened and cloned by the parent
/// ([`mounts::open_layers`]), idmapped in a remapped container (`idmapped`) unless the image is a
/// directory the user unpacked as themselves, or when the parent idmapped them for a user's
/// writable container (`userns::user_layer_ids`); `trees` the Spec's bind sources
/// ([`mounts::open_sources`]).
// Long by design: the root is built in the one order the kernel allows (the overlay, the Spec's
// mounts beneath it, /dev, the masks, pivot_root), each step commented where it happens.
pub fn setup(
    spec: &Spec,
    lowers: &[PathBuf],
    layers: &[mounts::Tree],
    idmapped: bool,
    work: &Path,
    trees: &[Option<mounts::Tree>],
) -> Result<(), SetupError> {
    // Nothing mounted from here on may reach the host's mount table.
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(sys(
        "making / private in the container's mount namespace".into()
    ))?;
    mount(
        Some("tmpfs"),
        work,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=700"),
    )
    .map_err(sys(format!(
        "mounting the upper-layer tmpfs on {}",
        work.display()
    )))?;
    let merged = work.join("merged");
    for dir in ["upper", "work", "merged"] {
        std::fs::create_dir(work.join(dir))
            .map_err(|e| SetupError::new(format!("creating {}: {e}", work.join(dir).display())))?;
    }
    // Each layer is attached at a short name under `work` and named relative to it, as docker's
    // overlay2 does: the overlay's options must fit in one page (NGC images have 40 layers and
    // more), and the overlay takes only layers mounted in this namespace.
    let short = attach_layers(layers, work)?;
    if !idmapped && layers.first().is_some_and(mounts::Tree::idmapped) {
        // A user's writable container whose layers show the image's root files as the user's
        // (`userns::user_layer_ids`): the merged root directory (the upper one) is the user's
        // too, or nothing could be made at the top level. The user's, not the top layer's owner:
        // `userns::idmapped_user_of` tells such a container by its `/` being its user's.
        give_to_user(spec, &work.join("upper"))?;
    }
    if let (Some(top), true) = (short.first(), idmapped) {
        // The merged root directory is the upper one: it must belong to whoever the image's
        // root directory belongs to through the idmapping, or without one (the user's own
        // directory image) on the host: the remapped user, or that user could not create
        // anything at the top level.
        let meta = std::fs::metadata(top)
            .map_err(|e| SetupError::new(format!("reading {}: {e}", top.display())))?;
        let upper = work.join("upper");
        std::os::unix::fs::chown(
            &upper,
            Some(std::os::unix::fs::MetadataExt::uid(&meta)),
            Some(std::os::unix::fs::MetadataExt::gid(&meta)),
        )
        .map_err(|e| {
            SetupError::new(format!(
                "giving {} to the remapped user: {e}",
                upper.display()
            ))
        })?;
    }
    // Relative to the working directory of the mount(2) call.
    chdir(work).map_err(sys(format!("entering {}", work.display())))?;
    let lowerdir = short
        .iter()
        .filter_map(|p| p.file_name())
        .map(|n| overlay_escape(Path::new(n)))
        .collect::<Vec<_>>()
        .join(":");
    let data = format!(
        "lowerdir={lowerdir},upperdir={},workdir={}",
        overlay_escape(&work.join("upper")),
        overlay_escape(&work.join("work"))
    );
    mount(
        Some("overlay"),
        &merged,
        Some("overlay"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(data.as_str()),
    )
    .map_err(sys(format!(
        "mounting the overlay of {} (is it a directory on a filesystem overlayfs accepts?)",
        lowers
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )))?;

    let root = open(
        &merged,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(sys(format!("opening {}", merged.display())))?;
    // Mount points are created only in the overlay and in the mounts berth makes below.
    let mut made = mounts::Made::default();
    made.add(root.as_fd()).map_err(sys(
        "finding the mount id of the container root (Linux 5.8 or later)".into(),
    ))?;

    for (m, tree) in spec
        .mounts()
        .as_deref()
        .unwrap_or_default()
        .iter()
        .zip(trees)
    {
        let typ = m.typ().as_deref().unwrap_or("bind");
        let source = m.source().clone().unwrap_or_else(|| PathBuf::from(typ));
        check_mount_point(&root, m.destination(), typ)?;
        mounts::apply(
            &root,
            m.destination(),
            typ,
            &source,
            m.options().as_deref().unwrap_or_default(),
            tree.as_ref(),
            &mut made,
        )?;
    }
    let linux = spec.linux().as_ref();
    create_devices(
        &root,
        &made,
        linux
            .and_then(|l| l.devices().as_deref())
            .unwrap_or_default(),
    )?;
    if let Some(name) = spec.hostname() {
        let file = work.join("hostname");
        std::fs::write(&file, format!("{name}\n"))
            .map_err(|e| SetupError::new(format!("writing {}: {e}", file.display())))?;
        mounts::apply(
            &root,
            Path::new("/etc/hostname"),
            "bind",
            &file,
            &["bind".into(), "ro".into(), "nosuid".into(), "nodev".into()],
            None,
            &mut made,
        )?;
    }
    mask_paths(&root)?;

    chdir(&merged).map_err(sys(format!("entering {}", merged.display())))?;
    // pivot_root(".", ".") stacks the old root on the new one; detaching it leaves only the
    // container's tree, without needing a directory for the old root inside the image.
    match pivot_root(".", ".") {
        Ok(()) => {
            umount2(".", MntFlags::MNT_DETACH).map_err(sys("detaching the host root".into()))?;
            chdir("/").map_err(sys("entering /".into()))?;
        }
        // The host root is the initramfs (rootfs), which pivot_root cannot move: move the
        // container root onto it instead, as runc and crun do.
        Err(nix::errno::Errno::EINVAL) => super::moveroot::move_root(&merged, work)?,
        Err(e) => return Err(sys("pivot_root into the container root".into())(e)),
    }
    add_user_entries(spec)?;
    if spec.root().as_ref().and_then(|r| r.readonly()) == Some(true) {
        mount(
            None::<&str>,
            "/",
            None::<&str>,
            MsFlags::MS_REMOUNT
                | MsFlags::MS_BIND
                | MsFlags::MS_RDONLY
                | MsFlags::MS_NOSUID
                | MsFlags::MS_NODEV,
            None::<&str>,
        )
        .map_err(sys("making the root read-only".into()))?;
    }
    Ok(())
}

/// Gives `upper` (the overlay's upper root directory, in the container's private tmpfs) to the
/// Spec's user and primary group.
fn give_to_user(spec: &Spec, upper: &Path) -> Result<(), SetupError> {
    let user = spec
        .process()
        .as_ref()
        .ok_or_else(|| SetupError::new("the spec has no process".into()))?
        .user();
    std::os::unix::fs::chown(upper, Some(user.uid()), Some(user.gid())).map_err(|e| {
        SetupError::new(format!(
            "giving {} to uid {}: {e}",
            upper.display(),
            user.uid()
        ))
    })
}

/// Refuses a mount point that would hide the container's root, or a kernel filesystem's place
/// (`/proc`, `/sys`, `/dev`, ...) that the image made a symlink or a file: an image whose `sys`
/// is a symlink to `/` got sysfs over its root, and then "command not found" (127) said nothing
/// of why. A bind may follow the image's symlinks (within the root: `/home` -> `/var/home`), but
/// never onto the root itself.
fn check_mount_point(root: &OwnedFd, dst: &Path, typ: &str) -> Result<(), SetupError> {
    use std::os::unix::fs::MetadataExt;
    let stat = |fd: &OwnedFd| std::fs::File::from(fd.try_clone()?).metadata();
    let root_meta =
        stat(root).map_err(|e| SetupError::new(format!("reading the container root: {e}")))?;
    if berth_spec::parse::is_root(dst) {
        return Err(SetupError::new(format!(
            "refusing to mount {typ} on {}: it would hide the container's root filesystem",
            dst.display()
        )));
    }
    let kernel_fs = typ != "bind";
    if kernel_fs {
        // No symlink anywhere on the way, the last component included (O_PATH|O_NOFOLLOW opens
        // a final symlink itself: its type says so).
        // (privfs::open_beneath adds O_NOCTTY, which openat2 refuses with O_PATH.)
        let how = nix::fcntl::OpenHow::new()
            .flags(OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
            .resolve(
                nix::fcntl::ResolveFlag::RESOLVE_BENEATH
                    | nix::fcntl::ResolveFlag::RESOLVE_NO_SYMLINKS,
            );
        let rel = dst.strip_prefix("/").unwrap_or(dst);
        match nix::fcntl::openat2(root.as_fd(), rel, how).map_err(std::io::Error::from) {
            Ok(fd) => {
                let meta = stat(&fd).map_err(|e| {
                    SetupError::new(format!("reading the mount point {}: {e}", dst.display()))
                })?;
                if !meta.is_dir() {
                    return Err(SetupError::new(format!(
                        "the image's {} is a {}, not a directory: berth mounts {typ} there; \
                         fix the image (remove it or make it a directory)",
                        dst.display(),
                        if meta.file_type().is_symlink() {
                            "symlink"
                        } else {
                            "file"
                        }
                    )));
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                return Err(SetupError::new(format!(
                    "a directory above {} in the image is a symlink: berth mounts {typ} there \
                     only on real directories; fix the image",
                    dst.display()
                )));
            }
            // Anything else is for the mount itself to report.
            Err(_) => {}
        }
    }
    let how = nix::fcntl::OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_CLOEXEC)
        .resolve(
            nix::fcntl::ResolveFlag::RESOLVE_IN_ROOT
                | nix::fcntl::ResolveFlag::RESOLVE_NO_MAGICLINKS,
        );
    let rel = dst.strip_prefix("/").unwrap_or(dst);
    if let Ok(fd) = nix::fcntl::openat2(root.as_fd(), rel, how)
        && let Ok(meta) = stat(&fd)
        && meta.dev() == root_meta.dev()
        && meta.ino() == root_meta.ino()
    {
        return Err(SetupError::new(format!(
            "refusing to mount {typ} on {}: in the image it leads to / (a symlink), and the \
             mount would hide the container's root filesystem; fix the image or mount elsewhere",
            dst.display()
        )));
    }
    Ok(())
}

/// Attaches each layer at `work`/lN (in the container's mount namespace only) and returns those
/// paths, topmost first like the layers.
fn attach_layers(layers: &[mounts::Tree], work: &Path) -> Result<Vec<PathBuf>, SetupError> {
    let mut out = Vec::with_capacity(layers.len());
    for (i, layer) in layers.iter().enumerate() {
        let at = work.join(format!("l{i}"));
        std::fs::create_dir(&at)
            .map_err(|e| SetupError::new(format!("creating {}: {e}", at.display())))?;
        let target = open(
            &at,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(sys(format!("opening {}", at.display())))?;
        layer
            .attach(&target)
            .map_err(sys(format!("attaching image layer {i}")))?;
        out.push(at);
    }
    Ok(out)
}

fn create_devices(
    root: &OwnedFd,
    made: &mounts::Made,
    devices: &[oci_spec::runtime::LinuxDevice],
) -> Result<(), SetupError> {
    for dev in devices {
        let path = dev.path();
        let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
            continue;
        };
        let dir = ensure_in_root(root, parent, false, made)?;
        let dir = open(
            &fd_path(&dir),
            OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(sys(format!("opening {}", parent.display())))?;
        let kind = match dev.typ() {
            LinuxDeviceType::B => SFlag::S_IFBLK,
            _ => SFlag::S_IFCHR,
        };
        let mode = Mode::from_bits_truncate(dev.file_mode().unwrap_or(0o600));
        let fail = |e| SetupError::new(format!("creating device {}: {e}", path.display()));
        let number = |n: i64| {
            u64::try_from(n).map_err(|_| {
                SetupError::new(format!(
                    "creating device {}: negative device number {n}",
                    path.display()
                ))
            })
        };
        let rdev = makedev(number(dev.major())?, number(dev.minor())?);
        mknodat(dir.as_fd(), name, kind, mode, rdev).map_err(fail)?;
        // mknod applies the umask; the Spec's mode is what the container must see.
        nix::sys::stat::fchmodat(
            dir.as_fd(),
            name,
            mode,
            nix::sys::stat::FchmodatFlags::NoFollowSymlink,
        )
        .or_else(|e| {
            if e == nix::errno::Errno::EOPNOTSUPP {
                nix::sys::stat::fchmodat(
                    dir.as_fd(),
                    name,
                    mode,
                    nix::sys::stat::FchmodatFlags::FollowSymlink,
                )
            } else {
                Err(e)
            }
        })
        .map_err(fail)?;
        fchownat(
            dir.as_fd(),
            name,
            dev.uid().map(Uid::from_raw),
            dev.gid().map(Gid::from_raw),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(fail)?;
    }
    let dev = ensure_in_root(root, Path::new("/dev"), false, made)?;
    let dev = open(
        &fd_path(&dev),
        OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(sys("opening /dev".into()))?;
    for (name, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ] {
        match symlinkat(target, dev.as_fd(), name) {
            Ok(()) | Err(nix::errno::Errno::EEXIST) => {}
            Err(e) => return Err(SetupError::new(format!("creating /dev/{name}: {e}"))),
        }
    }
    Ok(())
}

fn mask_paths(root: &OwnedFd) -> Result<(), SetupError> {
    // Beneath the root, following no symlink: only the kernel's own /proc and /sys entries are
    // masked, never what a symlink (of the image, or of /proc itself) points to.
    let open_existing = |path: &str| mounts::path_beneath(root, Path::new(path)).ok();
    for path in MASKED_PATHS {
        let Some(fd) = open_existing(path) else {
            continue;
        };
        let target = fd_path(&fd);
        let is_dir = std::fs::metadata(&target)
            .map(|m| m.is_dir())
            .unwrap_or(false);
        let result = if is_dir {
            mount(
                Some("tmpfs"),
                &target,
                Some("tmpfs"),
                MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
                Some("size=0"),
            )
        } else {
            mount(
                Some("/dev/null"),
                &target,
                None::<&str>,
                MsFlags::MS_BIND,
                None::<&str>,
            )
        };
        result.map_err(sys(format!("masking {path}")))?;
    }
    for path in READONLY_PATHS {
        let Some(fd) = open_existing(path) else {
            continue;
        };
        let target = fd_path(&fd);
        mount(
            Some(&target),
            &target,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REC,
            None::<&str>,
        )
        .map_err(sys(format!("binding {path}")))?;
        let fd = open_existing(path).ok_or_else(|| SetupError::new(format!("reopening {path}")))?;
        mount(
            None::<&str>,
            &fd_path(&fd),
            None::<&str>,
            MsFlags::MS_REMOUNT
                | MsFlags::MS_BIND
                | MsFlags::MS_RDONLY
                | MsFlags::MS_NOSUID
                | MsFlags::MS_NODEV
                | MsFlags::MS_NOEXEC,
            None::<&str>,
        )
        .map_err(sys(format!("making {path} read-only")))?;
    }
    Ok(())
}

/// Makes the container's user known to the image: appends it to /etc/passwd and its primary
/// group to /etc/group when missing, as Enroot and Pyxis do, so tools that look the user up
/// (`id`, `whoami`, ssh, MPI launchers) work. Runs as root after pivot_root, on files the image
/// (or a user) made: each is opened beneath the container's `/` without following a symlink or
/// crossing a mount (a host file or directory bound there is never written), must be a regular
/// file of bounded size, and is written through the fd that was read; the writes land in the
/// tmpfs upper layer. A database that is missing or not such a file is left as it is.
fn add_user_entries(spec: &Spec) -> Result<(), SetupError> {
    let Some(process) = spec.process() else {
        return Ok(());
    };
    let user = process.user();
    let annotations = spec.annotations().clone().unwrap_or_default();
    let uid = user.uid();
    let gid = user.gid();
    let name = user
        .username()
        .clone()
        .unwrap_or_else(|| format!("user{uid}"));
    let home = annotations
        .get(berth_spec::HOME_ANNOTATION)
        .cloned()
        .unwrap_or_else(|| "/".into());
    let group = annotations
        .get(berth_spec::GROUP_NAME_ANNOTATION)
        .cloned()
        .unwrap_or_else(|| format!("group{gid}"));
    let root = open(
        "/",
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(sys("opening the container root".into()))?;
    append_missing(
        &root,
        "etc/passwd",
        2,
        uid,
        &format!("{name}:x:{uid}:{gid}::{home}:/bin/sh"),
    )?;
    append_missing(&root, "etc/group", 2, gid, &format!("{group}:x:{gid}:"))
}

/// Whether a line of the database `text` has `id` in field `field` (0-based, `:`-separated).
fn has_id(text: &[u8], field: usize, id: u32) -> bool {
    let id = id.to_string();
    text.split(|&b| b == b'\n')
        .any(|l| l.split(|&b| b == b':').nth(field) == Some(id.as_bytes()))
}

/// The most of a user database berth reads: far above any real one, far below harm.
const DATABASE_LIMIT: u64 = 16 << 20;

/// Appends `line` to the colon-separated database `rel` (beneath `root`) unless an entry has `id`
/// in field `field`. Leaves a database alone (logged at debug) that cannot be opened safely, is
/// not a regular file or is larger than [`DATABASE_LIMIT`].
fn append_missing(
    root: &OwnedFd,
    rel: &str,
    field: usize,
    id: u32,
    line: &str,
) -> Result<(), SetupError> {
    let leave = |why: &dyn std::fmt::Display| {
        tracing::debug!("leaving the image's /{rel} as it is: {why}");
        Ok(())
    };
    // Read-write when the root allows it: one fd, read then appended to.
    let flags = OFlag::O_NONBLOCK | OFlag::O_NOCTTY;
    let (mut file, writable) =
        match privfs::open_beneath(root, Path::new(rel), flags | OFlag::O_RDWR, 0, true) {
            Ok(fd) => (std::fs::File::from(fd), true),
            Err(e) if e.raw_os_error() == Some(libc::EROFS) => {
                match privfs::open_beneath(root, Path::new(rel), flags | OFlag::O_RDONLY, 0, true) {
                    Ok(fd) => (std::fs::File::from(fd), false),
                    Err(e) => return leave(&e),
                }
            }
            Err(e) => return leave(&e),
        };
    match file.metadata() {
        Ok(m) if m.is_file() => {}
        Ok(_) => return leave(&"not a regular file"),
        Err(e) => return leave(&e),
    }
    // Bytes, not text: a database with a name in Latin-1 (not UTF-8) still gets the user, and
    // the append lands exactly at the end of what was read.
    let text = match privfs::read_bounded(&mut file, DATABASE_LIMIT) {
        Ok(bytes) => bytes,
        Err(e) => return leave(&e),
    };
    if has_id(&text, field, id) {
        return Ok(());
    }
    if !writable {
        // A read-only image root keeps the image's database as it is.
        return Ok(());
    }
    let sep = if text.is_empty() || text.ends_with(b"\n") {
        ""
    } else {
        "\n"
    };
    // At the end of what was read: the file is ours alone (the tmpfs upper layer), nobody
    // appends in between.
    let end = text.len() as u64;
    std::os::unix::fs::FileExt::write_all_at(&file, format!("{sep}{line}\n").as_bytes(), end)
        .map_err(|e| SetupError::new(format!("adding the user to /{rel}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_found_in_databases_that_are_not_utf8() {
        let db = b"root:x:0:0::/root:/bin/sh\njos\xe9:x:1000:1000::/home/jos\xe9:/bin/sh\n";
        assert!(has_id(db, 2, 0));
        assert!(has_id(db, 2, 1000));
        assert!(!has_id(db, 2, 1001));
        assert!(!has_id(b"", 2, 0));
    }
}
