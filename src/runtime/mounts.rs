//! Turns OCI mount entries into mount(2) calls, and creates mount points inside the container root
//! without ever following a symlink out of it (the root filesystem comes from an untrusted image).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag, openat2};
use nix::mount::{MsFlags, mount};
use nix::sys::stat::{Mode, mkdirat};

use super::SetupError;

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

/// The `/proc/self/fd/N` path through which mount(2) reaches an already-resolved target.
pub fn fd_path(fd: &impl AsRawFd) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

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

/// Opens (creating when missing) `path` inside `root` as an O_PATH fd: a directory, or an empty
/// file when `file` is set. Symlinks are resolved as if `root` were `/`.
pub fn ensure_in_root(root: &OwnedFd, path: &Path, file: bool) -> Result<OwnedFd, SetupError> {
    let rel = in_root(path);
    let err = |what: &str, e: Errno| SetupError::new(format!("{what} {}: {e}", path.display()));
    let mut so_far = PathBuf::new();
    let mut parent = open_in_root(root, Path::new("."), OFlag::O_PATH | OFlag::O_DIRECTORY)
        .map_err(|e| err("opening the container root for", e))?;
    let count = rel.components().count();
    for (i, comp) in rel.components().enumerate() {
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
                if want_file {
                    let how = OpenHow::new()
                        .flags(OFlag::O_CREAT | OFlag::O_WRONLY | OFlag::O_CLOEXEC)
                        .mode(Mode::from_bits_truncate(0o644))
                        .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_SYMLINKS);
                    openat2(parent.as_fd(), comp.as_os_str(), how)
                        .map_err(|e| err("creating mount point", e))?;
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

/// A copy of a host mount tree, taken with open_tree(2) before the container's own mounts exist,
/// so a recursive bind never drags them along; attached later with move_mount(2).
pub struct Tree(OwnedFd);

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

impl Tree {
    /// Clones the mount tree at `source` (recursively with `recursive`) and applies `options`'
    /// ro/nosuid/nodev/noexec to every mount in it. `Ok(None)` when the kernel lacks the new mount
    /// API (before 5.12): the caller falls back to mount(MS_BIND).
    pub fn clone(source: &Path, options: &[String]) -> Result<Option<Tree>, SetupError> {
        let opts = MountOptions::parse(options);
        let fail =
            |what: &str, e: Errno| SetupError::new(format!("{what} {}: {e}", source.display()));
        let path = std::ffi::CString::new(source.as_os_str().as_encoded_bytes())
            .map_err(|_| SetupError::new(format!("{}: path contains NUL", source.display())))?;
        let mut flags = OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint;
        let recursive = opts.flags.contains(MsFlags::MS_REC);
        if recursive {
            flags |= libc::AT_RECURSIVE as libc::c_uint;
        }
        // SAFETY: open_tree with a valid NUL-terminated path; returns a new fd or -1.
        let fd =
            unsafe { libc::syscall(libc::SYS_open_tree, libc::AT_FDCWD, path.as_ptr(), flags) };
        if fd < 0 {
            return match Errno::last() {
                Errno::ENOSYS => Ok(None),
                e => Err(fail("cloning the mount of", e)),
            };
        }
        // SAFETY: the kernel just returned this fd and nothing else owns it.
        let tree = Tree(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) });
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
        if attr_set != 0 {
            tree.set_attr(attr_set, 0, recursive)
                .map_err(|e| fail("setting mount flags on", e))?;
        }
        Ok(Some(tree))
    }

    /// A copy of the mount at `source` (not of the mounts below it) whose files' owners are
    /// translated through the mapping of the user namespace `userns` (an idmapped mount):
    /// a remapped container's image, whose root-owned files must belong to the mapped user.
    pub fn idmapped(source: &Path, userns: BorrowedFd<'_>) -> Result<Tree, SetupError> {
        let fail = |what: &str, e: Errno| {
            SetupError::new(format!(
                "{what} {}: {e} (--remap-root needs idmapped mounts: Linux 5.12 or later, and \
                 a filesystem that supports them)",
                source.display()
            ))
        };
        let path = std::ffi::CString::new(source.as_os_str().as_encoded_bytes())
            .map_err(|_| SetupError::new(format!("{}: path contains NUL", source.display())))?;
        let flags = OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint;
        // SAFETY: open_tree with a valid NUL-terminated path; returns a new fd or -1.
        let fd =
            unsafe { libc::syscall(libc::SYS_open_tree, libc::AT_FDCWD, path.as_ptr(), flags) };
        if fd < 0 {
            return Err(fail("cloning the mount of", Errno::last()));
        }
        // SAFETY: the kernel just returned this fd and nothing else owns it.
        let tree = Tree(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) });
        tree.set_attr(MOUNT_ATTR_IDMAP, userns.as_raw_fd() as u64, false)
            .map_err(|e| fail("idmapping", e))?;
        Ok(tree)
    }

    fn set_attr(&self, attr_set: u64, userns_fd: u64, recursive: bool) -> Result<(), Errno> {
        let attr = MountAttr {
            attr_set,
            attr_clr: 0,
            propagation: 0,
            userns_fd,
        };
        let at = libc::AT_EMPTY_PATH | if recursive { libc::AT_RECURSIVE } else { 0 };
        // SAFETY: mount_setattr on the detached tree's fd with an empty path and a valid
        // `struct mount_attr` of the size passed.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_mount_setattr,
                self.0.as_raw_fd(),
                c"".as_ptr(),
                at as libc::c_uint,
                &attr as *const MountAttr,
                std::mem::size_of::<MountAttr>(),
            )
        };
        if ret < 0 { Err(Errno::last()) } else { Ok(()) }
    }

    /// Attaches the tree at `target` (an O_PATH fd of the mount point).
    pub fn attach(&self, target: &OwnedFd) -> Result<(), Errno> {
        // SAFETY: move_mount between two fds with empty paths, both valid for the call.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_move_mount,
                self.0.as_raw_fd(),
                c"".as_ptr(),
                target.as_raw_fd(),
                c"".as_ptr(),
                MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH,
            )
        };
        if ret < 0 { Err(Errno::last()) } else { Ok(()) }
    }
}

/// Makes one OCI mount at `destination` inside `root`. A bind mount uses `tree` when the
/// source was cloned beforehand with [`Tree::clone`].
pub fn apply(
    root: &OwnedFd,
    destination: &Path,
    typ: &str,
    source: &Path,
    options: &[String],
    tree: Option<&Tree>,
) -> Result<(), SetupError> {
    let opts = MountOptions::parse(options);
    let bind = opts.is_bind() || typ == "bind";
    let source_is_file = bind && source.metadata().map(|m| !m.is_dir()).unwrap_or(false);
    let target = ensure_in_root(root, destination, source_is_file)?;
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
            let target = ensure_in_root(root, destination, source_is_file)?;
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
        assert!(ensure_in_root(&root, Path::new("/evil/x"), false).is_err());
        ensure_in_root(&root, Path::new("/slash/w"), false).unwrap();
        ensure_in_root(&root, Path::new("/etc/up/y/z"), false).unwrap();
        ensure_in_root(&root, Path::new("/etc/hosts"), true).unwrap();
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
