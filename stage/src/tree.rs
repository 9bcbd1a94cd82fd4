//! Removing and measuring trees a user controls (a job's scratch, a retained scratch, a dataset
//! cache's leftovers) as root, by fd only (DESIGN.md, "Privilege model"). A user with a live
//! process can rename anything in such a tree at any moment, swapping a directory for a symlink
//! to somewhere else: every directory here is opened with `O_NOFOLLOW | O_DIRECTORY` from the fd
//! of its parent, and every removal is an `unlinkat` of one name in a directory opened that way.
//! A name that turned into a symlink is unlinked as a symlink, never followed; no mode is ever
//! changed by path; a mount point inside the tree is refused, never walked into. Each directory
//! is taken from the user (root's, 0700, by its fd) before it is listed, so a user's live process
//! cannot keep a removal going by adding entries.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::OwnedFd;

use super::fsops;

/// Directories held open at once by one removal; deeper ones are moved up to the tree's top
/// (by fd, within the tree) and emptied from there, so any depth is removed with few fds.
const MAX_OPEN: usize = 64;
/// How often one removal retries names the user keeps changing under it before giving up.
const MAX_RETRIES: usize = 100_000;

fn unlinkat(dir: &OwnedFd, name: &CStr, flags: libc::c_int) -> io::Result<()> {
    let flags = if flags & libc::AT_REMOVEDIR != 0 {
        nix::unistd::UnlinkatFlags::RemoveDir
    } else {
        nix::unistd::UnlinkatFlags::NoRemoveDir
    };
    nix::unistd::unlinkat(dir, name, flags).map_err(io::Error::from)
}

/// Opens the directory `name` in `dir`, never through a symlink.
pub fn open_dir_at(dir: &OwnedFd, name: &CStr) -> io::Result<OwnedFd> {
    use nix::fcntl::OFlag;
    nix::fcntl::openat(
        dir,
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(io::Error::from)
}

/// The names in the open directory `dir` (without `.` and `..`).
pub fn list(dir: &OwnedFd) -> io::Result<Vec<CString>> {
    // Dir takes over the fd (a fresh one: reading moves its offset).
    let mut d = nix::dir::Dir::from_fd(open_dir_at(dir, c".")?)?;
    let mut names = Vec::new();
    for item in d.iter() {
        let item = item?;
        let name = item.file_name();
        if !matches!(name.to_bytes(), b"." | b"..") {
            names.push(name.to_owned());
        }
    }
    Ok(names)
}

fn changing() -> io::Error {
    io::Error::other("it kept changing while it was being removed; try again")
}

/// Removes `name` in `dir` if it is not a directory (a symlink, whatever it points to, is
/// removed itself); a directory is opened (never through a symlink) and returned, to be emptied.
/// `None`: nothing is left to do (removed, or gone).
fn enter(dir: &OwnedFd, name: &CStr, dev: u64) -> io::Result<Option<OwnedFd>> {
    for _ in 0..MAX_RETRIES {
        let unlink_err = match unlinkat(dir, name, 0) {
            Ok(()) => return Ok(None),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(None),
            // A directory (EISDIR; EPERM on some filesystems).
            Err(e) if matches!(e.raw_os_error(), Some(libc::EISDIR | libc::EPERM)) => e,
            Err(e) => return Err(e),
        };
        match open_dir_at(dir, name) {
            Ok(fd) => {
                let st = fsops::fstat(&fd)?;
                if st.st_dev != dev {
                    return Err(io::Error::other(
                        "a mount point is inside it: unmount it and try again",
                    ));
                }
                let me = nix::unistd::geteuid().as_raw();
                if me == 0 {
                    // Taken from the user before it is listed: no process of theirs (another
                    // job, a cwd inside) can add entries to it any more, so the removal ends.
                    fsops::fchown(&fd, 0, 0)?;
                    fsops::fchmod(&fd, 0o700)?;
                } else if st.st_mode & 0o700 != 0o700 && st.st_uid == me {
                    // Another caller (a test as itself) makes its own read-only directory
                    // writable, on the fd it opened.
                    fsops::fchmod(&fd, (st.st_mode & 0o7777) | 0o700)?;
                }
                return Ok(Some(fd));
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(None),
            // Swapped for a symlink or a file since the unlink: unlink that instead.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP)) => continue,
            Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => {
                if unlink_err.raw_os_error() == Some(libc::EPERM) {
                    return Err(unlink_err);
                }
                continue;
            }
            Err(e) => return Err(e),
        }
    }
    Err(changing())
}

/// A directory being emptied: its fd, its name in its parent, the names still to remove.
struct Frame {
    fd: OwnedFd,
    name: CString,
    names: Vec<CString>,
}

/// Removes `name` in the open directory `parent` and, if it is a directory, everything in it,
/// by fd only (see the module's header). A missing `name` is no error.
pub fn remove_at(parent: &OwnedFd, name: &CStr) -> io::Result<()> {
    let dev = fsops::fstat(parent)?.st_dev;
    let mut retries = 0usize;
    let mut aside = 0u64;
    'top: loop {
        let Some(fd) = enter(parent, name, dev)? else {
            return Ok(());
        };
        let names = list(&fd)?;
        let mut stack = vec![Frame {
            fd,
            name: name.to_owned(),
            names,
        }];
        while let Some(f) = stack.last_mut() {
            if let Some(n) = f.names.pop() {
                let Some(fd) = enter(&f.fd, &n, dev)? else {
                    continue;
                };
                if stack.len() >= MAX_OPEN {
                    // Too deep to hold every level open: move it to the top of the tree under a
                    // fresh name, and empty it from there.
                    drop(fd);
                    let top = &stack[0].fd;
                    let to = loop {
                        aside += 1;
                        let to = CString::new(format!(".berth-removing-{aside}"))
                            .expect("no NUL in the name");
                        // RENAME_NOREPLACE never replaces what is there.
                        let r = nix::fcntl::renameat2(
                            &stack[stack.len() - 1].fd,
                            n.as_c_str(),
                            top,
                            to.as_c_str(),
                            nix::fcntl::RenameFlags::RENAME_NOREPLACE,
                        )
                        .map_err(io::Error::from);
                        match r {
                            Ok(()) => break Some(to),
                            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => continue,
                            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => break None,
                            Err(e) => return Err(e),
                        }
                    };
                    if let Some(to) = to {
                        stack[0].names.push(to);
                    }
                    continue;
                }
                let names = list(&fd)?;
                stack.push(Frame { fd, name: n, names });
                continue;
            }
            let f = stack.pop().expect("a frame");
            let outer = stack.last().map_or(parent, |p| &p.fd);
            match unlinkat(outer, &f.name, libc::AT_REMOVEDIR) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                // Something new in it, or another entry under its name now (the user renamed
                // things meanwhile): the name is handled again from the start.
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::ENOTEMPTY | libc::EEXIST | libc::ENOTDIR)
                    ) =>
                {
                    retries += 1;
                    if retries > MAX_RETRIES {
                        return Err(changing());
                    }
                    match stack.last_mut() {
                        Some(p) => p.names.push(f.name),
                        None => continue 'top,
                    }
                }
                Err(e) => return Err(e),
            }
        }
        return Ok(());
    }
}

/// Bytes used by the files under the open directory `dir` (allocated blocks), walked by fd
/// without following symlinks.
pub fn usage_at(dir: &OwnedFd) -> io::Result<u64> {
    let mut total = 0u64;
    let mut stack = vec![(open_dir_at(dir, c".")?, None::<Vec<CString>>)];
    loop {
        let depth = stack.len();
        let Some((fd, names)) = stack.last_mut() else {
            break;
        };
        let names = match names {
            Some(n) => n,
            None => names.insert(list(fd)?),
        };
        let Some(n) = names.pop() else {
            stack.pop();
            continue;
        };
        let Some(st) = fsops::lstat_at(fd, &n)? else {
            continue;
        };
        total += st.st_blocks.cast_unsigned() * 512;
        if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
            if depth >= 4 * MAX_OPEN {
                return Err(io::Error::other(format!(
                    "more than {} directory levels",
                    4 * MAX_OPEN
                )));
            }
            match open_dir_at(fd, &n) {
                Ok(sub) => stack.push((sub, None)),
                // Gone or swapped since the stat: not counted.
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ELOOP)) => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn open(p: &std::path::Path) -> OwnedFd {
        std::fs::File::open(p).unwrap().into()
    }

    #[test]
    fn removes_deep_read_only_trees_and_symlinks_without_following_them() {
        let tmp = tempfile::tempdir().unwrap();
        let outside = tmp.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("keep"), b"x").unwrap();
        let top = tmp.path().join("job");
        // Deeper than the directories held open at once.
        let mut deep = top.clone();
        for i in 0..(MAX_OPEN * 3) {
            deep.push(format!("d{i}"));
        }
        std::fs::create_dir_all(&deep).unwrap();
        std::fs::write(deep.join("f"), b"data").unwrap();
        std::os::unix::fs::symlink(&outside, top.join("d0/link")).unwrap();
        std::os::unix::fs::symlink(&outside, deep.join("link")).unwrap();
        std::fs::set_permissions(top.join("d0"), std::fs::Permissions::from_mode(0o500)).unwrap();
        let root = open(tmp.path());
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode();
        let before = mode(&outside);
        assert!(usage_at(&open(&top)).unwrap() > 0);
        remove_at(&root, c"job").unwrap();
        assert!(!top.exists());
        assert!(outside.join("keep").exists());
        assert_eq!(mode(&outside), before);
        // Missing: nothing to do.
        remove_at(&root, c"job").unwrap();
        // A symlink in the removed name itself is removed, not followed.
        std::os::unix::fs::symlink(&outside, tmp.path().join("job")).unwrap();
        remove_at(&root, c"job").unwrap();
        assert!(outside.join("keep").exists());
        std::fs::symlink_metadata(tmp.path().join("job")).unwrap_err();
    }
}
