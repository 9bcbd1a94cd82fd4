//! Turns OCI mount entries into mount(2) calls, and creates mount points inside the container root
//! without ever following a symlink out of it (the root filesystem comes from an untrusted image)
//! and never inside a tree bound from the host (DESIGN.md, "Privilege model"). Bind sources are
//! opened before the container's namespaces exist, a source the user named with the user's
//! credentials, and init attaches those opened trees: no path is resolved again as root.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag, openat2};
use nix::mount::{MsFlags, mount};
use nix::sys::stat::{Mode, mkdirat};
use oci_spec::runtime::Spec;

use super::SetupError;
use berth_spec::{USER_SOURCE_OPTION, UserIds};
use berth_sys::privfs;

/// mount(2) flags and filesystem data of an OCI option list.
#[derive(Debug, PartialEq, Eq)]
pub struct MountOptions {
    pub flags: MsFlags,
    /// Filesystem-specific options (mode=, size=, ...), passed as mount(2)'s data.
    pub data: String,
}

impl MountOptions {
    pub fn parse(options: &[String]) -> Self {
        let mut flags = MsFlags::empty();
        let mut data = Vec::new();
        for opt in options {
            match opt.as_str() {
                "ro" => flags |= MsFlags::MS_RDONLY,
                "rw" => flags &= !MsFlags::MS_RDONLY,
                "nosuid" => flags |= MsFlags::MS_NOSUID,
                "nodev" => flags |= MsFlags::MS_NODEV,
                "noexec" => flags |= MsFlags::MS_NOEXEC,
                "strictatime" => flags |= MsFlags::MS_STRICTATIME,
                "relatime" => flags |= MsFlags::MS_RELATIME,
                "noatime" => flags |= MsFlags::MS_NOATIME,
                "bind" => flags |= MsFlags::MS_BIND,
                "rbind" => flags |= MsFlags::MS_BIND | MsFlags::MS_REC,
                // Options for berth itself (USER_SOURCE_OPTION), never for the kernel.
                other if other.starts_with("x-") => {}
                other => data.push(other),
            }
        }
        Self {
            flags,
            data: data.join(","),
        }
    }

    fn is_bind(&self) -> bool {
        self.flags.contains(MsFlags::MS_BIND)
    }
}

/// An fd that `syscall()` returned (an int widened to a long).
#[expect(
    clippy::cast_possible_truncation,
    reason = "the kernel's fds are ints, widened to syscall()'s long"
)]
fn raw_fd(ret: libc::c_long) -> std::os::fd::RawFd {
    ret as std::os::fd::RawFd
}

pub use berth_sys::mount::{overlay_escape, path_beneath};
pub use berth_sys::privfs::fd_path;

fn in_root(path: &Path) -> PathBuf {
    path.components()
        .filter(|c| matches!(c, Component::Normal(_)))
        .collect()
}

fn open_in_root(root: &OwnedFd, rel: &Path, flags: OFlag) -> nix::Result<OwnedFd> {
    let how = OpenHow::new()
        .flags(flags | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    openat2(root.as_fd(), rel, how)
}

/// The mounts berth itself made in the container (its overlay root, /dev, /proc, tmpfs, ...), by
/// mount id. Root creates mount points only inside these: a tree bound from the host (a user's
/// directory, a host file) is shown to the container, never written by root.
#[derive(Debug, Default)]
pub struct Made(Vec<u64>);

impl Made {
    /// Records the mount `fd` is on as one of berth's.
    pub fn add(&mut self, fd: BorrowedFd<'_>) -> Result<(), Errno> {
        let id = mount_id(fd)?;
        if !self.0.contains(&id) {
            self.0.push(id);
        }
        Ok(())
    }

    fn contains(&self, fd: BorrowedFd<'_>) -> Result<bool, Errno> {
        Ok(self.0.contains(&mount_id(fd)?))
    }
}

/// The id of the mount `fd` is on (statx's STATX_MNT_ID, Linux 5.8).
fn mount_id(fd: BorrowedFd<'_>) -> Result<u64, Errno> {
    // SAFETY: all-zero is a valid `struct statx`.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: statx on a valid fd with an empty path and AT_EMPTY_PATH, writing into `st`.
    let ret = unsafe {
        libc::statx(
            fd.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW,
            libc::STATX_MNT_ID,
            &mut st,
        )
    };
    if ret != 0 {
        return Err(Errno::last());
    }
    if st.stx_mask & libc::STATX_MNT_ID == 0 {
        return Err(Errno::ENOSYS);
    }
    Ok(st.stx_mnt_id)
}

/// Why a block device is refused as a mount source, for the one-line error.
pub const BLOCK_DEVICE_REFUSED: &str = "a block device of the host, which berth binds only where \
     runtime.mount_block_devices = true in berth.toml: ask the admin, or bind a file or directory";

/// Opens a mount source `user` named (`--mount`, `--container-mounts`), as that user: a directory
/// the user can list or a file the user can read (never blocking on a FIFO), or a device node the
/// user may open for reading or writing, as the kernel's access check says (the node is not
/// opened, so no driver acts for it). A block device only with `block_devices` (the config's
/// `runtime.mount_block_devices`). A device is returned as an `O_PATH` fd: a bind of it needs
/// nothing more, and whether the container may open it is decided there, by the node's mode, the
/// host mount's `nodev` and the container's device cgroup.
pub fn open_source_as_user(
    source: &Path,
    user: &UserIds,
    block_devices: bool,
) -> std::io::Result<OwnedFd> {
    let opened = privfs::as_user(user, || open_as_caller(source, block_devices))?;
    checked(opened)
}

/// [`open_source_as_user`]'s opens, in a thread that already holds the user's credentials: the
/// source and whether it is a device node.
fn open_as_caller(source: &Path, block_devices: bool) -> std::io::Result<(OwnedFd, bool)> {
    let fd = nix::fcntl::open(source, OFlag::O_PATH | OFlag::O_CLOEXEC, Mode::empty())?;
    let kind = nix::sys::stat::fstat(&fd)?.st_mode & libc::S_IFMT;
    if kind != libc::S_IFCHR && kind != libc::S_IFBLK {
        let flags = OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC | OFlag::O_NOCTTY;
        return Ok((nix::fcntl::open(source, flags, Mode::empty())?, false));
    }
    if kind == libc::S_IFBLK && !block_devices {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            BLOCK_DEVICE_REFUSED,
        ));
    }
    if may_access(&fd, libc::R_OK).is_err() {
        may_access(&fd, libc::W_OK)?;
    }
    Ok((fd, true))
}

/// A device as opened; anything else must be a directory the user can list or a file the user
/// can read ([`privfs::readable`]).
fn checked(opened: std::io::Result<(OwnedFd, bool)>) -> std::io::Result<OwnedFd> {
    match opened? {
        (fd, true) => Ok(fd),
        (fd, false) => privfs::readable(fd).map(OwnedFd::from),
    }
}

/// Whether [`open_source_as_user`] refused a block device (not a permission of the user's).
pub fn is_block_refusal(e: &std::io::Error) -> bool {
    e.get_ref()
        .is_some_and(|inner| inner.to_string() == BLOCK_DEVICE_REFUSED)
}

/// The kernel's access check of the calling thread's credentials on an open fd (faccessat2 with
/// AT_EMPTY_PATH, Linux 5.8).
fn may_access(fd: &OwnedFd, mode: libc::c_int) -> std::io::Result<()> {
    // SAFETY: faccessat2 on a valid fd with an empty NUL-terminated path; it reads nothing else.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_faccessat2,
            fd.as_raw_fd(),
            c"".as_ptr(),
            mode,
            libc::AT_EMPTY_PATH,
        )
    };
    if ret == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Opens (creating when missing) `path` inside `root` as an O_PATH fd: a directory, or an empty
/// file when `file` is set. Symlinks are resolved as if `root` were `/`, so nothing outside it is
/// reached; a missing component is created only on a mount of `made`, never in a tree bound from
/// the host, wherever a symlink in the image led.
pub fn ensure_in_root(
    root: &OwnedFd,
    path: &Path,
    file: bool,
    made: &Made,
) -> Result<OwnedFd, SetupError> {
    let rel = in_root(path);
    let err = |what: &str, e: Errno| SetupError::new(format!("{what} {}: {e}", path.display()));
    // Usually the mount point exists (the image's /proc, /dev, ...): one openat2 of the whole
    // path, resolved exactly as the walk below resolves its last step, instead of one per
    // component. The walk is for what must be created.
    if !rel.as_os_str().is_empty() {
        let flags = if file {
            OFlag::O_PATH
        } else {
            OFlag::O_PATH | OFlag::O_DIRECTORY
        };
        if let Ok(fd) = open_in_root(root, &rel, flags) {
            return Ok(fd);
        }
    }
    let mut so_far = PathBuf::new();
    let mut parent = open_in_root(root, Path::new("."), OFlag::O_PATH | OFlag::O_DIRECTORY)
        .map_err(|e| err("opening the container root for", e))?;
    let count = rel.components().count();
    for (i, comp) in rel.components().enumerate() {
        let above = so_far.clone();
        so_far.push(comp);
        let last = i + 1 == count;
        let want_file = last && file;
        let dir_flag = if want_file {
            OFlag::empty()
        } else {
            OFlag::O_DIRECTORY
        };
        match open_in_root(root, &so_far, OFlag::O_PATH | dir_flag) {
            Ok(fd) => parent = fd,
            Err(Errno::ENOENT) => {
                let ours = made
                    .contains(parent.as_fd())
                    .map_err(|e| err("finding the mount of the mount point", e))?;
                if !ours {
                    return Err(SetupError::new(format!(
                        "cannot create the mount point {}: /{} is a directory bound from the \
                         host, in which berth creates nothing; mount at a path that exists there \
                         or outside it",
                        path.display(),
                        above.display()
                    )));
                }
                if want_file {
                    let how = OpenHow::new()
                        .flags(OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_WRONLY | OFlag::O_CLOEXEC)
                        .mode(Mode::from_bits_truncate(0o644))
                        .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS);
                    match openat2(parent.as_fd(), comp.as_os_str(), how) {
                        Ok(_) | Err(Errno::EEXIST) => {}
                        Err(e) => return Err(err("creating mount point", e)),
                    }
                } else {
                    match mkdirat(
                        parent.as_fd(),
                        comp.as_os_str(),
                        Mode::from_bits_truncate(0o755),
                    ) {
                        Ok(()) | Err(Errno::EEXIST) => {}
                        Err(e) => return Err(err("creating mount point", e)),
                    }
                }
                parent = open_in_root(root, &so_far, OFlag::O_PATH | dir_flag)
                    .map_err(|e| err("opening mount point", e))?;
            }
            Err(e) => return Err(err("opening mount point", e)),
        }
    }
    Ok(parent)
}

/// A copy of a host mount tree, taken with open_tree(2) on an opened source before the
/// container's namespaces exist, so neither a path swapped since nor the container's own mounts
/// can end up in it; attached in the container with move_mount(2).
#[derive(Debug)]
pub struct Tree {
    fd: OwnedFd,
    is_dir: bool,
    /// Cloned as an idmapped mount (an image layer of a remapped or a user's writable container).
    idmapped: bool,
}

const OPEN_TREE_CLONE: libc::c_uint = 1;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;
const MOVE_MOUNT_T_EMPTY_PATH: libc::c_uint = 0x40;
const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_NOSUID: u64 = 0x2;
const MOUNT_ATTR_NODEV: u64 = 0x4;
const MOUNT_ATTR_NOEXEC: u64 = 0x8;
const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;

/// `struct mount_attr` of mount_setattr(2).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// Opens the source of every bind mount of `spec` and clones its mount tree, in the calling
/// (host's) mount namespace, before the container's exists: a source the user named (marked with
/// [`USER_SOURCE_OPTION`]) as `user`, who must be able to read or list it; berth's own sources
/// (host files, cgroup views, the loader cache, GPU files) as root. One entry per Spec mount,
/// `None` for the mounts that are not binds.
pub fn open_sources(
    spec: &Spec,
    user: &UserIds,
    block_devices: bool,
) -> Result<Vec<Option<Tree>>, SetupError> {
    let mounts = spec.mounts().as_deref().unwrap_or_default();
    let kind = |m: &oci_spec::runtime::Mount| {
        let options = m.options().as_deref().unwrap_or_default();
        let is_bind = m.typ().as_deref() == Some("bind")
            || options.iter().any(|o| o == "bind" || o == "rbind");
        (is_bind, options.iter().any(|o| o == USER_SOURCE_OPTION))
    };
    // Every source the user named, opened in one thread with the user's credentials (a
    // thread started and joined per source cost a step with many host-software binds ms).
    let named: Vec<&Path> = mounts
        .iter()
        .filter(|m| kind(m) == (true, true))
        .filter_map(|m| m.source().as_deref())
        .collect();
    let mut opened = if named.is_empty() {
        Vec::new()
    } else {
        privfs::as_user(user, || {
            named
                .iter()
                .map(|src| open_as_caller(src, block_devices))
                .collect::<Vec<_>>()
        })
        .map_err(|e| SetupError::new(format!("opening mount sources as uid {}: {e}", user.uid)))?
    }
    .into_iter();
    let mut trees = Vec::new();
    for m in mounts {
        let options = m.options().as_deref().unwrap_or_default();
        trees.push(match (kind(m), m.source()) {
            ((true, true), Some(src)) => {
                let fd = checked(
                    opened
                        .next()
                        .unwrap_or_else(|| Err(std::io::Error::other("not opened"))),
                )
                .map_err(|e| user_source_error(src, user, &e))?;
                Some(Tree::from_source(src, fd, options)?)
            }
            ((true, false), Some(src)) => Some(Tree::open(src, options, None, block_devices)?),
            ((false, true), _) => {
                return Err(SetupError::new(format!(
                    "the mount on {} has a user's source but is not a bind mount",
                    m.destination().display()
                )));
            }
            _ => None,
        });
    }
    Ok(trees)
}

/// Why a source the user named cannot be bound, in one line.
fn user_source_error(source: &Path, user: &UserIds, e: &std::io::Error) -> SetupError {
    if is_block_refusal(e) {
        return SetupError::new(format!("mount source {}: {e}", source.display()));
    }
    SetupError::new(format!(
        "mount source {}: uid {} cannot read it ({e}); give a file or directory the user can \
         read, or a character device the user may open",
        source.display(),
        user.uid
    ))
}

/// Opens each image layer (`lowers`, topmost first) and clones its mount (the layer alone, not
/// the mounts below it), in the host's mount namespace before the container's exists: the overlay
/// takes only layers mounted in its own namespace, and a layer named `/proc/self/fd/N` (a
/// directory the user opened) is reachable only from here. With `idmap` (the user namespace of a
/// remapped container's layers, or of a user's writable one: `userns::user_layer_ids`), each
/// clone is an idmapped mount: the image's root-owned files belong to the mapped user. Only the
/// image's layers are ever idmapped, never a bind source ([`open_sources`]).
pub fn open_layers(
    lowers: &[PathBuf],
    idmap: Option<BorrowedFd<'_>>,
) -> Result<Vec<Tree>, SetupError> {
    let mut out = Vec::with_capacity(lowers.len());
    for lower in lowers {
        let fd = nix::fcntl::open(
            lower.as_path(),
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| SetupError::new(format!("opening image layer {}: {e}", lower.display())))?;
        let tree = Tree::clone_fd(&fd, true, &[], idmap).map_err(|(what, e)| {
            let hint = if idmap.is_some() {
                " (idmapped image layers, for --remap-root and users' writable containers, need \
                 Linux 5.12 or later and a filesystem that supports them)"
            } else {
                ""
            };
            SetupError::new(format!("{what} image layer {}: {e}{hint}", lower.display()))
        })?;
        out.push(tree);
    }
    Ok(out)
}

impl Tree {
    /// Opens `source` (as `user` when given: the kernel checks the user's permissions on every
    /// component, whatever the path points to at this instant; see [`open_source_as_user`]) and
    /// clones the mount tree of what was opened (recursively with `rbind`), private, with
    /// `options`' ro/nosuid/nodev/noexec. A device node is bound without adding `nodev`, which
    /// would leave it unopenable: the bind holds that one node and nothing can be made beneath
    /// it, a `nodev` of the host's mount stays, and the device cgroup still decides.
    pub fn open(
        source: &Path,
        options: &[String],
        user: Option<&UserIds>,
        block_devices: bool,
    ) -> Result<Tree, SetupError> {
        let fd: OwnedFd = match user {
            Some(user) => open_source_as_user(source, user, block_devices)
                .map_err(|e| user_source_error(source, user, &e))?,
            None => nix::fcntl::open(source, OFlag::O_PATH | OFlag::O_CLOEXEC, Mode::empty())
                .map_err(|e| SetupError::new(format!("mount source {}: {e}", source.display())))?,
        };
        Self::from_source(source, fd, options)
    }

    /// Clones the mount tree of `fd`, the opened `source`, as [`Tree::open`] does.
    fn from_source(source: &Path, fd: OwnedFd, options: &[String]) -> Result<Tree, SetupError> {
        let st = nix::sys::stat::fstat(&fd)
            .map_err(|e| SetupError::new(format!("mount source {}: {e}", source.display())))?;
        let kind = st.st_mode & libc::S_IFMT;
        let device_options: Vec<String>;
        let options = if kind == libc::S_IFCHR || kind == libc::S_IFBLK {
            device_options = options.iter().filter(|o| *o != "nodev").cloned().collect();
            &device_options
        } else {
            options
        };
        Self::clone_fd(&fd, kind == libc::S_IFDIR, options, None)
            .map_err(|(what, e)| SetupError::new(format!("{what} {}: {e}", source.display())))
    }

    /// Clones the mount of `source` (an opened fd) private, with `options`' flags, idmapped
    /// through the user namespace `idmap` when given.
    fn clone_fd(
        source: &OwnedFd,
        is_dir: bool,
        options: &[String],
        idmap: Option<BorrowedFd<'_>>,
    ) -> Result<Tree, (&'static str, Errno)> {
        let opts = MountOptions::parse(options);
        let mut flags = OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint;
        flags |= libc::AT_EMPTY_PATH as libc::c_uint;
        let recursive = opts.flags.contains(MsFlags::MS_REC);
        if recursive {
            flags |= libc::AT_RECURSIVE as libc::c_uint;
        }
        // SAFETY: open_tree on a valid fd with an empty path and AT_EMPTY_PATH; returns a new
        // fd or -1.
        let fd =
            unsafe { libc::syscall(libc::SYS_open_tree, source.as_raw_fd(), c"".as_ptr(), flags) };
        if fd < 0 {
            return Err((
                "cloning the mount of (open_tree, Linux 5.2 or later)",
                Errno::last(),
            ));
        }
        // SAFETY: the kernel just returned this fd and nothing else owns it.
        let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw_fd(fd)) };
        let tree = Tree {
            fd,
            is_dir,
            idmapped: idmap.is_some(),
        };
        let mut attr_set = 0;
        for (flag, attr) in [
            (MsFlags::MS_RDONLY, MOUNT_ATTR_RDONLY),
            (MsFlags::MS_NOSUID, MOUNT_ATTR_NOSUID),
            (MsFlags::MS_NODEV, MOUNT_ATTR_NODEV),
            (MsFlags::MS_NOEXEC, MOUNT_ATTR_NOEXEC),
        ] {
            if opts.flags.contains(flag) {
                attr_set |= attr;
            }
        }
        let userns = match idmap {
            Some(fd) => {
                attr_set |= MOUNT_ATTR_IDMAP;
                // An open fd is never negative.
                u64::from(fd.as_raw_fd().unsigned_abs())
            }
            None => 0,
        };
        // Private: a clone of a shared host mount would otherwise stay its peer, and what the
        // container mounts inside it would appear on the host.
        tree.set_attr(attr_set, MsFlags::MS_PRIVATE.bits(), userns, recursive)
            .map_err(|e| {
                (
                    "setting mount flags (mount_setattr, Linux 5.12 or later) on",
                    e,
                )
            })?;
        Ok(tree)
    }

    fn set_attr(
        &self,
        attr_set: u64,
        propagation: u64,
        userns_fd: u64,
        recursive: bool,
    ) -> Result<(), Errno> {
        let attr = MountAttr {
            attr_set,
            attr_clr: 0,
            propagation,
            userns_fd,
        };
        let at = libc::AT_EMPTY_PATH | if recursive { libc::AT_RECURSIVE } else { 0 };
        // SAFETY: mount_setattr on the detached tree's fd with an empty path and a valid
        // `struct mount_attr` of the size passed.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_mount_setattr,
                self.fd.as_raw_fd(),
                c"".as_ptr(),
                at.cast_unsigned(),
                &attr as *const MountAttr,
                std::mem::size_of::<MountAttr>(),
            )
        };
        if ret < 0 { Err(Errno::last()) } else { Ok(()) }
    }

    /// Whether the tree is an idmapped mount.
    pub fn idmapped(&self) -> bool {
        self.idmapped
    }

    /// Attaches the tree at `target` (an O_PATH fd of the mount point).
    pub fn attach(&self, target: &OwnedFd) -> Result<(), Errno> {
        // SAFETY: move_mount between two fds with empty paths, both valid for the call.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_move_mount,
                self.fd.as_raw_fd(),
                c"".as_ptr(),
                target.as_raw_fd(),
                c"".as_ptr(),
                MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH,
            )
        };
        if ret < 0 { Err(Errno::last()) } else { Ok(()) }
    }
}

/// Makes one OCI mount at `destination` inside `root`. A bind mount attaches `tree` (its source
/// opened by [`open_sources`]); without one, `source` is bound by path, which only berth's own
/// files in the container's private directory may be. A mount that is not a bind is recorded in
/// `made`.
pub fn apply(
    root: &OwnedFd,
    destination: &Path,
    typ: &str,
    source: &Path,
    options: &[String],
    tree: Option<&Tree>,
    made: &mut Made,
) -> Result<(), SetupError> {
    let opts = MountOptions::parse(options);
    let bind = opts.is_bind() || typ == "bind";
    let source_is_file = match (bind, tree) {
        (false, _) => false,
        (true, Some(t)) => !t.is_dir,
        (true, None) => source.metadata().map(|m| !m.is_dir()).unwrap_or(false),
    };
    let target = ensure_in_root(root, destination, source_is_file, made)?;
    let target_path = fd_path(&target);
    let fail = |e: Errno| {
        SetupError::new(format!(
            "mounting {} on {} ({typ}): {e}",
            source.display(),
            destination.display()
        ))
    };
    if let (true, Some(tree)) = (bind, tree) {
        tree.attach(&target).map_err(fail)?;
    } else if bind {
        let rec = opts.flags & MsFlags::MS_REC;
        mount(
            Some(source),
            &target_path,
            None::<&str>,
            MsFlags::MS_BIND | rec,
            None::<&str>,
        )
        .map_err(fail)?;
        let extra = opts.flags - (MsFlags::MS_BIND | MsFlags::MS_REC);
        if !extra.is_empty() {
            // The bind created a new mount; reopen the target so the remount reaches it, not the
            // mount it covers.
            let target = ensure_in_root(root, destination, source_is_file, made)?;
            mount(
                None::<&str>,
                &fd_path(&target),
                None::<&str>,
                MsFlags::MS_REMOUNT | MsFlags::MS_BIND | extra,
                None::<&str>,
            )
            .map_err(fail)?;
        }
    } else {
        let data = (!opts.data.is_empty()).then_some(opts.data.as_str());
        mount(Some(source), &target_path, Some(typ), opts.flags, data).map_err(fail)?;
        let mounted = ensure_in_root(root, destination, false, made)?;
        made.add(mounted.as_fd()).map_err(fail)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(list: &[&str]) -> MountOptions {
        MountOptions::parse(&list.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn options_split_into_flags_and_data() {
        let o = opts(&["nosuid", "strictatime", "mode=755", "size=65536k"]);
        assert_eq!(o.flags, MsFlags::MS_NOSUID | MsFlags::MS_STRICTATIME);
        assert_eq!(o.data, "mode=755,size=65536k");
        let o = opts(&["rbind", "ro", "nosuid", "nodev"]);
        assert!(o.is_bind());
        assert!(o.flags.contains(MsFlags::MS_REC | MsFlags::MS_RDONLY));
        assert_eq!(o.data, "");
        assert!(!opts(&["ro", "rw"]).flags.contains(MsFlags::MS_RDONLY));
    }

    #[test]
    fn overlay_paths_are_escaped() {
        assert_eq!(overlay_escape(Path::new("/a,b:c\\d")), "/a\\,b\\:c\\\\d");
        assert_eq!(overlay_escape(Path::new("/plain")), "/plain");
    }

    #[test]
    fn mount_points_never_leave_the_root() {
        let dir = tempfile::tempdir().unwrap();
        let root_path = dir.path().join("root");
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(root_path.join("etc")).unwrap();
        std::fs::create_dir(&outside).unwrap();
        // An image's symlinks resolve as if the root were `/`: an absolute one to the host's
        // directory is dangling in the root and refused; `..` stops at the root.
        std::os::unix::fs::symlink(&outside, root_path.join("evil")).unwrap();
        std::os::unix::fs::symlink("/", root_path.join("slash")).unwrap();
        std::os::unix::fs::symlink("../../..", root_path.join("etc/up")).unwrap();
        let root = nix::fcntl::open(
            &root_path,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .unwrap();
        let mut made = Made::default();
        made.add(root.as_fd()).unwrap();
        ensure_in_root(&root, Path::new("/evil/x"), false, &made).unwrap_err();
        ensure_in_root(&root, Path::new("/slash/w"), false, &made).unwrap();
        ensure_in_root(&root, Path::new("/etc/up/y/z"), false, &made).unwrap();
        ensure_in_root(&root, Path::new("/etc/hosts"), true, &made).unwrap();
        // Nothing is created on a mount that is not berth's.
        ensure_in_root(&root, Path::new("/new"), false, &Made::default()).unwrap_err();
        assert!(!root_path.join("new").exists());
        assert!(
            !outside.join("x").exists(),
            "escaped through an absolute symlink"
        );
        assert!(root_path.join("w").is_dir());
        assert!(root_path.join("y/z").is_dir());
        assert!(root_path.join("etc/hosts").is_file());
        assert!(!dir.path().join("y").exists());
    }
}
