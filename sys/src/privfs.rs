//! Privileged file work on paths a user can influence (DESIGN.md, "Privilege model"): opening what
//! a user names with that user's credentials, walking trees an image or a user controls without
//! following symlinks, bounded reads, and making and checking the directories berth relies on.

use std::ffi::OsStr;
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag, openat2};
use nix::sys::stat::Mode;

use crate::{SysError, UserIds};

const ROOT_DIR_HINT: &str = "berth keeps its files only in directories that root owns and no other user can change: remove it (or fix its owner and mode) and retry, or configure another path in /etc/berth/berth.toml";

/// Runs `f` with `user`'s uid, gid and groups on a thread of its own, so that the kernel checks
/// exactly what the user could do; the rest of the process keeps root's credentials. Linux keeps
/// credentials per thread: the raw syscalls change only this thread's (glibc's wrappers would
/// change every thread's). A caller that is not root can act only as itself.
pub fn as_user<T: Send>(user: &UserIds, f: impl FnOnce() -> T + Send) -> std::io::Result<T> {
    let euid = nix::unistd::geteuid().as_raw();
    if euid != 0 {
        if euid != user.uid {
            return Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!("only root can act as uid {} (you are uid {euid})", user.uid),
            ));
        }
        return Ok(f());
    }
    let groups: Vec<libc::gid_t> = user.groups.clone();
    let (uid, gid) = (user.uid, user.gid);
    std::thread::scope(|s| {
        s.spawn(move || {
            // SAFETY: raw credential syscalls with valid arguments; they change only this
            // thread's credentials, which die with it.
            let r = unsafe {
                if libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) != 0
                    || libc::syscall(libc::SYS_setresgid, gid, gid, gid) != 0
                    || libc::syscall(libc::SYS_setresuid, uid, uid, uid) != 0
                {
                    Err(std::io::Error::last_os_error())
                } else {
                    Ok(())
                }
            };
            r.map(|()| f())
        })
        .join()
        .unwrap_or_else(|_| {
            Err(std::io::Error::other(
                "a thread acting as the user panicked",
            ))
        })
    })
}

/// Opens `path` as `user` (see [`as_user`]): the kernel checks the user's permissions on every
/// component, and root then works on the returned fd, never on the path again. `O_CLOEXEC` and
/// `O_NOCTTY` are always added; add `O_NONBLOCK` where a FIFO must not block the open.
pub fn open_as_user(path: &Path, user: &UserIds, flags: OFlag) -> std::io::Result<OwnedFd> {
    let flags = flags | OFlag::O_CLOEXEC | OFlag::O_NOCTTY;
    as_user(user, || {
        nix::fcntl::open(path, flags, Mode::empty()).map_err(std::io::Error::from)
    })?
}

/// What a user names as something to read (an image, a mount source, a stage source): opened for
/// reading as the user, so it is a directory the user can list or a file the user can read.
/// Never blocks on a FIFO.
pub fn open_readable_as_user(path: &Path, user: &UserIds) -> std::io::Result<File> {
    readable(open_as_user(
        path,
        user,
        OFlag::O_RDONLY | OFlag::O_NONBLOCK,
    )?)
}

/// [`open_readable_as_user`]'s checks of what a user's thread opened `O_RDONLY | O_NONBLOCK`.
pub fn readable(fd: OwnedFd) -> std::io::Result<File> {
    let file = File::from(fd);
    let kind = file.metadata()?.file_type();
    if !kind.is_dir() && !kind.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file or directory",
        ));
    }
    // Regular files ignore O_NONBLOCK; clearing it keeps later readers from surprises.
    nix::fcntl::fcntl(&file, nix::fcntl::FcntlArg::F_SETFL(OFlag::empty()))?;
    Ok(file)
}

/// The path through which root reaches an open fd (`/proc/self/fd/N`): a bind mount or `open` of
/// it gets exactly the opened file, whatever has since been renamed or swapped at its old path.
pub fn fd_path(fd: &impl AsRawFd) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

/// Opens `rel` inside the directory `dir` with `openat2`: never leaves `dir`, follows no symlink
/// (nor magic link), and with `same_mount` crosses no mount point. For trees an image or a user
/// controls, where root must not be steered elsewhere.
pub fn open_beneath(
    dir: impl AsFd,
    rel: &Path,
    flags: OFlag,
    mode: u32,
    same_mount: bool,
) -> std::io::Result<OwnedFd> {
    let mut resolve = ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS;
    if same_mount {
        resolve |= ResolveFlag::RESOLVE_NO_XDEV;
    }
    let how = OpenHow::new()
        .flags(flags | OFlag::O_CLOEXEC | OFlag::O_NOCTTY | OFlag::O_NOFOLLOW)
        .mode(Mode::from_bits_truncate(mode))
        .resolve(resolve);
    let rel = rel.strip_prefix("/").unwrap_or(rel);
    let rel = if rel.as_os_str().is_empty() {
        Path::new(".")
    } else {
        rel
    };
    openat2(dir, rel, how).map_err(std::io::Error::from)
}

/// Reads at most `limit` bytes; more is an error (`InvalidData`), never an unbounded allocation.
pub fn read_bounded(file: &mut File, limit: u64) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::new();
    file.take(limit + 1).read_to_end(&mut out)?;
    if out.len() as u64 > limit {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("larger than {limit} bytes"),
        ));
    }
    Ok(out)
}

/// Makes sure `path` is a directory berth can rely on and opens it: it and every directory above
/// it are owned by root, none can be changed by another user (group/other-writable only with the
/// sticky bit, as `/tmp`), and it is not a symlink. Missing directories are made (root's, the last
/// with `mode`, those above it 0755); a root-owned one of another mode gets `mode`. Anything else
/// is refused in one line, never used.
pub fn root_dir(path: &Path, mode: u32) -> Result<OwnedFd, SysError> {
    let io = |what, p: &Path| {
        let p = p.to_path_buf();
        move |source| SysError::Io {
            what,
            path: p,
            source,
        }
    };
    if !path.is_absolute() {
        return Err(SysError::Unsafe {
            path: path.to_path_buf(),
            what: "is not an absolute path".into(),
            hint: ROOT_DIR_HINT,
        });
    }
    // Directories above: resolve the existing part once (root-owned symlinks such as /var/run are
    // fine), then walk it from `/` by fd, refusing what another user could change.
    let parent = path.parent().unwrap_or(Path::new("/"));
    let mut existing = parent.to_path_buf();
    let mut missing: Vec<&OsStr> = Vec::new();
    while std::fs::symlink_metadata(&existing).is_err() {
        match (existing.file_name(), existing.parent()) {
            (Some(_), Some(up)) => existing = up.to_path_buf(),
            _ => break,
        }
    }
    let canonical = std::fs::canonicalize(&existing).map_err(io("resolving", &existing))?;
    for c in parent
        .strip_prefix(&existing)
        .unwrap_or(Path::new(""))
        .components()
    {
        if let Component::Normal(n) = c {
            missing.push(n);
        }
    }
    let name = path.file_name().ok_or_else(|| SysError::Unsafe {
        path: path.to_path_buf(),
        what: "has no final name".into(),
        hint: ROOT_DIR_HINT,
    })?;
    let open_dir = |dir: &OwnedFd, n: &OsStr| {
        nix::fcntl::openat(
            dir,
            n,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(std::io::Error::from)
    };
    let mut here = PathBuf::from("/");
    let mut fd: OwnedFd = nix::fcntl::open(
        "/",
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io("opening", &here)(e.into()))?;
    check_dir(&fd, &here, false)?;
    let names: Vec<&OsStr> = canonical
        .components()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n),
            _ => None,
        })
        .chain(missing)
        .collect();
    for n in names {
        here.push(n);
        fd = match open_dir(&fd, n) {
            Ok(f) => f,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                make_dir(&fd, n, 0o755).map_err(io("creating", &here))?;
                open_dir(&fd, n).map_err(io("opening", &here))?
            }
            Err(e) => return Err(refusal_or_io(&fd, n, &here, e)),
        };
        check_dir(&fd, &here, false)?;
    }
    here.push(name);
    let dir = match open_dir(&fd, name) {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
            make_dir(&fd, name, mode).map_err(io("creating", &here))?;
            open_dir(&fd, name).map_err(io("opening", &here))?
        }
        Err(e) => return Err(refusal_or_io(&fd, name, &here, e)),
    };
    check_dir(&dir, &here, true)?;
    let file = File::from(dir);
    if file.metadata().map_err(io("reading", &here))?.mode() & 0o7777 != mode {
        file.set_permissions(std::fs::Permissions::from_mode(mode))
            .map_err(io("setting the mode of", &here))?;
    }
    Ok(OwnedFd::from(file))
}

/// Makes one directory with exactly `mode`, whatever the umask.
fn make_dir(parent: &OwnedFd, name: &OsStr, mode: u32) -> std::io::Result<()> {
    match nix::sys::stat::mkdirat(parent, name, Mode::from_bits_truncate(mode)) {
        Ok(()) | Err(Errno::EEXIST) => {}
        Err(e) => return Err(e.into()),
    }
    let fd = nix::fcntl::openat(
        parent,
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    nix::sys::stat::fchmod(&fd, Mode::from_bits_truncate(mode))?;
    Ok(())
}

/// Turns a failed no-follow open of a directory into the one-line refusal it stands for.
fn refusal_or_io(parent: &OwnedFd, name: &OsStr, path: &Path, e: std::io::Error) -> SysError {
    let st = nix::sys::stat::fstatat(parent, name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW);
    let what = match st {
        Ok(st) if st.st_mode & libc::S_IFMT == libc::S_IFLNK => {
            format!("is a symlink (owned by uid {})", st.st_uid)
        }
        Ok(_) if e.raw_os_error() == Some(libc::ENOTDIR) => "is not a directory".to_string(),
        _ => {
            return SysError::Io {
                what: "opening",
                path: path.to_path_buf(),
                source: e,
            };
        }
    };
    SysError::Unsafe {
        path: path.to_path_buf(),
        what,
        hint: ROOT_DIR_HINT,
    }
}

/// Refuses a directory another user owns or could change. `last`: the directory itself, whose
/// mode berth sets, so only its owner matters.
fn check_dir(fd: &OwnedFd, path: &Path, last: bool) -> Result<(), SysError> {
    let st = nix::sys::stat::fstat(fd).map_err(|e| SysError::Io {
        what: "reading",
        path: path.to_path_buf(),
        source: e.into(),
    })?;
    let what = if st.st_uid != 0 {
        format!("is owned by uid {}, not root", st.st_uid)
    } else if !last && st.st_mode & 0o022 != 0 && st.st_mode & libc::S_ISVTX == 0 {
        format!(
            "can be changed by users other than root (mode {:04o})",
            st.st_mode & 0o7777
        )
    } else {
        return Ok(());
    };
    Err(SysError::Unsafe {
        path: path.to_path_buf(),
        what,
        hint: ROOT_DIR_HINT,
    })
}

/// A name for one path component: no `/`, not `.` or `..`, not empty.
pub fn is_plain_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.as_bytes().contains(&b'/')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_reads_refuse_more_than_the_limit() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, b"0123456789").unwrap();
        assert_eq!(
            read_bounded(&mut File::open(&p).unwrap(), 10).unwrap(),
            b"0123456789"
        );
        let e = read_bounded(&mut File::open(&p).unwrap(), 9).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
    }

    #[test]
    fn open_beneath_follows_no_symlink_and_never_leaves_the_directory() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("etc")).unwrap();
        std::fs::write(dir.path().join("etc/real"), b"x").unwrap();
        std::os::unix::fs::symlink("real", dir.path().join("etc/link")).unwrap();
        std::os::unix::fs::symlink("/etc", dir.path().join("up")).unwrap();
        let d = File::open(dir.path()).unwrap();
        let ro = OFlag::O_RDONLY;
        open_beneath(&d, Path::new("etc/real"), ro, 0, false).unwrap();
        open_beneath(&d, Path::new("/etc/real"), ro, 0, false).unwrap();
        for bad in ["etc/link", "up/passwd", "../x", "etc/../../x"] {
            assert!(
                open_beneath(&d, Path::new(bad), ro, 0, false).is_err(),
                "{bad} was opened"
            );
        }
    }

    #[test]
    fn plain_names() {
        assert!(is_plain_name("abc"));
        for bad in ["", ".", "..", "a/b"] {
            assert!(!is_plain_name(bad));
        }
    }
}
