//! Serving a cache entry: its files put into the job's destination (hardlinks, or the user's
//! own clones or copies across filesystems and of files a link would not let the user read),
//! its directories and symlinks made the user's.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::SystemTime;

use super::{Item, Manifest, cache_err, cache_mode, may_read, open_dir};
use crate::progress::with_progress;
use crate::{
    Dest, How, Kind, MARKER, Marker, Options, Report, StageError, XATTRS_OP, fsops, hash_fd,
    open_dest, open_source, parallel, sibling_groups, write_marker,
};
use berth_sys::UserIds;

/// Puts the entry's files into `base/rel` for `user`: hardlinks, or clones or copies when the
/// cache is on another filesystem or the cached file's mode would not let `user` read a link. Directories, symlinks and copies are given to the user.
pub(super) fn link_into(
    data_path: &Path,
    m: &Manifest,
    base: &Path,
    rel: &Path,
    user: &UserIds,
    opts: &Options,
) -> Result<Report, StageError> {
    let dest_path = base.join(rel);
    // The destination is the user's: opened (its missing directories made) as the user, then
    // worked on beneath that fd only.
    let dest = berth_sys::privfs::as_user(user, || open_dest(base, rel)).map_err(|e| {
        StageError::Dest {
            op: "open",
            path: dest_path.clone(),
            source: e,
        }
    })??;
    let mut made = Vec::new();
    let result = link_into_dest(data_path, m, &dest_path, user, opts, &dest, &mut made);
    if result.is_err() {
        // The directories this stage made go again, by fd beneath their parents.
        dest.remove_made(&made);
    }
    result
}

/// The error of operation `op` on `rel` in the destination `dest_path`.
fn at(
    dest_path: &Path,
    op: &'static str,
    rel: &Path,
) -> impl FnOnce(std::io::Error) -> StageError + use<> {
    let path = dest_path.join(rel);
    move |source| StageError::Dest { op, path, source }
}

/// [`link_into`] the opened `dest`; the directories it creates are recorded in `made`.
fn link_into_dest(
    data_path: &Path,
    m: &Manifest,
    dest_path: &Path,
    user: &UserIds,
    opts: &Options,
    dest: &Dest,
    made: &mut Vec<PathBuf>,
) -> Result<Report, StageError> {
    let (uid, gid) = (user.uid, user.gid);
    let (root, existed) = (&dest.fd, dest.existed);
    let dest_err = |op, rel: &Path| at(dest_path, op, rel);
    fsops::unlink_beneath(root, Path::new(MARKER))
        .map_err(dest_err("remove", Path::new(MARKER)))?;
    let data = open_dir(data_path).map_err(cache_err("open", data_path))?;
    let groups = sibling_groups(m.items.iter().map(|i| i.rel.as_path()));
    let needed = space(
        m,
        &groups,
        (&data, data_path),
        (root, dest_path),
        user,
        opts,
    )?;

    let mut report = Report {
        source: m.source.clone(),
        dest: dest_path.to_path_buf(),
        ..Report::default()
    };
    report.dirs = make_dirs(m, root, dest_path, (uid, gid), made)?;
    let how = Putting {
        owner: (uid, gid),
        user,
        other_fs: AtomicBool::new(false),
        way: fsops::CopyWay::default(),
        xattrs: m.xattrs,
    };
    let [unchanged, linked, cloned, copied] = put_files(
        m,
        &groups,
        (&data, data_path),
        (root, dest_path),
        &how,
        opts,
        needed,
    )?;
    finish_dirs(m, (&data, data_path), (root, dest_path), uid, existed)?;
    // Links are metadata, committed with the marker's fsync on a journaling filesystem; copied
    // or cloned data must reach the disk before the marker says it is there.
    if copied + cloned > 0 {
        fsops::syncfs(root).map_err(dest_err("sync", Path::new("")))?;
    }
    report.files = m.files().count() as u64;
    report.bytes = m.bytes();
    report.symlinks = m.items.iter().filter(|i| i.kind == Kind::Symlink).count() as u64;
    report.files_unchanged = unchanged;
    report.files_from_cache = linked + cloned + copied;
    report.how = if copied > 0 {
        How::CopiedFromCache
    } else if cloned > 0 {
        How::ReflinkedFromCache
    } else {
        How::LinkedFromCache
    };
    write_marker(
        root,
        &Marker {
            source: m.source.clone(),
            files: report.files,
            bytes: report.bytes,
            completed_at: SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            verified: false,
        },
    )
    .map_err(dest_err("write", Path::new(MARKER)))?;
    fsops::lchown_beneath(root, Path::new(MARKER), uid, gid)
        .map_err(dest_err("chown", Path::new(MARKER)))?;
    Ok(report)
}

/// Space, before anything is put there: what is not in place yet counts against the job's cap
/// (as the scratch's usage counts every file, links too), and must fit the destination's
/// filesystem when the cache is on another one or some files are copied (links take no room
/// there). With neither, the destination is not inspected twice. Returns the bytes needed (0
/// when not counted).
fn space(
    m: &Manifest,
    groups: &[(usize, usize)],
    (data, data_path): (&OwnedFd, &Path),
    (root, dest_path): (&OwnedFd, &Path),
    user: &UserIds,
    opts: &Options,
) -> Result<u64, StageError> {
    let uid = user.uid;
    let dest_err = |op, rel: &Path| at(dest_path, op, rel);
    let dest_st = fsops::fstat(root).map_err(dest_err("inspect", Path::new("")))?;
    let cache_st = fsops::fstat(data).map_err(cache_err("inspect", data_path))?;
    let copies = m
        .files()
        .any(|i| !may_read(user, (0, i.gid, cache_mode(i.mode, false))));
    let free = if dest_st.st_dev != cache_st.st_dev || copies {
        fsops::available_bytes(root).map_err(dest_err("inspect", Path::new("")))?
    } else {
        u64::MAX
    };
    let (available, limit) = match opts.cap {
        Some(cap) if cap < free => (cap, "per-job scratch cap"),
        _ => (free, "free space"),
    };
    let needed = if available < u64::MAX {
        missing_bytes(
            m,
            groups,
            (data, data_path),
            (root, dest_path),
            uid,
            opts.workers,
        )?
    } else {
        0
    };
    if needed > available {
        return Err(StageError::NoSpace {
            dest: dest_path.to_path_buf(),
            needed,
            available,
            limit,
        });
    }
    Ok(needed)
}

/// The dataset's directories in the destination, parents first: those made (recorded in
/// `made`) are given to the user. Returns how many directories the dataset has.
fn make_dirs(
    m: &Manifest,
    root: &OwnedFd,
    dest_path: &Path,
    (uid, gid): (u32, u32),
    made: &mut Vec<PathBuf>,
) -> Result<u64, StageError> {
    let dest_err = |op, rel: &Path| at(dest_path, op, rel);
    let mut dirs = 0;
    for i in m.items.iter().filter(|i| i.kind == Kind::Dir) {
        dirs += 1;
        if i.rel.as_os_str().is_empty() {
            continue;
        }
        let made_here = match fsops::mkdir_beneath(root, &i.rel, 0o700) {
            Ok(()) => {
                made.push(i.rel.clone());
                true
            }
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                let st = fsops::lstat_beneath(root, &i.rel).map_err(dest_err("inspect", &i.rel))?;
                if st.is_some_and(|st| st.st_mode & libc::S_IFMT != libc::S_IFDIR) {
                    // A file or symlink where the source has a directory: replace it.
                    fsops::unlink_beneath(root, &i.rel).map_err(dest_err("remove", &i.rel))?;
                    fsops::mkdir_beneath(root, &i.rel, 0o700)
                        .map_err(dest_err("create", &i.rel))?;
                    true
                } else {
                    false
                }
            }
            Err(e) => return Err(dest_err("create", &i.rel)(e)),
        };
        if made_here {
            let fd = fsops::open_beneath(root, &i.rel, libc::O_RDONLY | libc::O_DIRECTORY, 0)
                .map_err(dest_err("open", &i.rel))?;
            fsops::fchown(&fd, uid, gid).map_err(dest_err("chown", &i.rel))?;
        }
    }
    Ok(dirs)
}

/// Puts the files and symlinks into the destination: one task per directory's files, its
/// directory in the cache and in the destination opened once, then a few calls on plain names
/// per file. Returns the files put each way, indexed by `Put`.
fn put_files(
    m: &Manifest,
    groups: &[(usize, usize)],
    (data, data_path): (&OwnedFd, &Path),
    (root, dest_path): (&OwnedFd, &Path),
    how: &Putting,
    opts: &Options,
    needed: u64,
) -> Result<[u64; 4], StageError> {
    let dest_err = |op, rel: &Path| at(dest_path, op, rel);
    let (uid, gid) = how.owner;
    let puts: [AtomicU64; 4] = Default::default();
    let files = m.files().count() as u64;
    with_progress(opts, (0, files), needed, |progress| {
        parallel(groups.len(), opts.workers, |g| {
            let (first, end) = groups[g];
            let parent = m.items[first].rel.parent().unwrap_or(Path::new(""));
            let dir_flags = libc::O_PATH | libc::O_DIRECTORY;
            let cdir = fsops::open_beneath(data, parent, dir_flags, 0)
                .map_err(cache_err("open", &data_path.join(parent)))?;
            let ddir = fsops::open_beneath(root, parent, dir_flags, 0)
                .map_err(dest_err("open", parent))?;
            for i in &m.items[first..end] {
                let name = fsops::name_of(&i.rel).map_err(dest_err("open", &i.rel))?;
                match i.kind {
                    Kind::Dir => {}
                    Kind::Symlink => {
                        let target = i.target.as_deref().unwrap_or(Path::new(""));
                        fsops::unlink_at(&ddir, &name).map_err(dest_err("remove", &i.rel))?;
                        fsops::symlink_at(&ddir, &name, target, Some((uid, gid)), i.mtime)
                            .map_err(dest_err("create", &i.rel))?;
                    }
                    Kind::File => {
                        let put =
                            link_file(i, &name, &cdir, &ddir, how).map_err(|(op, e)| match op {
                                "conflict" => StageError::Conflict {
                                    path: dest_path.join(&i.rel),
                                    message: "a directory where the dataset has a file; remove it"
                                        .into(),
                                },
                                "cache" => cache_err("read", &data_path.join(&i.rel))(e),
                                op => dest_err(op, &i.rel)(e),
                            })?;
                        puts[put as usize].fetch_add(1, Ordering::Relaxed);
                        progress.files.fetch_add(1, Ordering::Relaxed);
                        if put == Put::Copied {
                            progress.bytes.fetch_add(i.size, Ordering::Relaxed);
                        }
                    }
                }
            }
            Ok(())
        })
    })?;
    Ok(puts.map(AtomicU64::into_inner))
}

/// Directory modes and mtimes last, deepest first.
fn finish_dirs(
    m: &Manifest,
    (data, data_path): (&OwnedFd, &Path),
    (root, dest_path): (&OwnedFd, &Path),
    uid: u32,
    existed: bool,
) -> Result<(), StageError> {
    let dest_err = |op, rel: &Path| at(dest_path, op, rel);
    for i in m.items.iter().rev().filter(|i| i.kind == Kind::Dir) {
        let flags = libc::O_RDONLY | libc::O_DIRECTORY;
        let fd = fsops::open_beneath(root, &i.rel, flags, 0).map_err(dest_err("open", &i.rel))?;
        // Root changes only the user's directories (those it made were given to the user); a
        // destination directory that was there keeps its mode and mtime.
        let st = fsops::fstat(&fd).map_err(dest_err("inspect", &i.rel))?;
        if st.st_uid != uid {
            continue;
        }
        if m.xattrs {
            let cfd = fsops::open_beneath(data, &i.rel, flags, 0)
                .map_err(cache_err("open", &data_path.join(&i.rel)))?;
            fsops::copy_xattrs(&cfd, &fd).map_err(dest_err(XATTRS_OP, &i.rel))?;
        }
        let root_dir = i.rel.as_os_str().is_empty();
        if root_dir && existed {
            continue;
        }
        fsops::set_mtime_fd(&fd, i.mtime).map_err(dest_err("set the mtime of", &i.rel))?;
        let mode = if root_dir { i.mode | 0o700 } else { i.mode };
        fsops::fchmod(&fd, mode).map_err(dest_err("chmod", &i.rel))?;
    }
    Ok(())
}

/// Bytes of the files of `m` that are not in place in the destination yet (neither the cached
/// inode nor an earlier copy of it), grouped by directory as `groups` says.
fn missing_bytes(
    m: &Manifest,
    groups: &[(usize, usize)],
    (data, data_path): (&OwnedFd, &Path),
    (root, dest_path): (&OwnedFd, &Path),
    uid: u32,
    workers: usize,
) -> Result<u64, StageError> {
    let dest_err = |op, rel: &Path| {
        let path = dest_path.join(rel);
        move |source| StageError::Dest { op, path, source }
    };
    let needed = AtomicU64::new(0);
    parallel(groups.len(), workers, |g| {
        let (first, end) = groups[g];
        let parent = m.items[first].rel.parent().unwrap_or(Path::new(""));
        let dir_flags = libc::O_PATH | libc::O_DIRECTORY;
        let cdir = fsops::open_beneath(data, parent, dir_flags, 0)
            .map_err(cache_err("open", &data_path.join(parent)))?;
        let ddir = fsops::open_dir_if_any(root, parent).map_err(dest_err("open", parent))?;
        for i in m.items[first..end].iter().filter(|i| i.kind == Kind::File) {
            let name = fsops::name_of(&i.rel).map_err(dest_err("open", &i.rel))?;
            let cached = fsops::lstat_at(&cdir, &name)
                .map_err(cache_err("read", &data_path.join(&i.rel)))?;
            let dest = match &ddir {
                Some(d) => fsops::lstat_at(d, &name).map_err(dest_err("inspect", &i.rel))?,
                None => None,
            };
            let there = matches!((&cached, &dest), (Some(c), Some(d)) if in_place(i, c, d, uid));
            if !there {
                needed.fetch_add(i.size, Ordering::Relaxed);
            }
        }
        Ok(())
    })?;
    Ok(needed.into_inner())
}

/// Whether the destination's `dest` already is the cached file `cached` of item `i`: the same
/// inode, or a copy made earlier (cache on another filesystem) that is the user's, by the
/// engine's rule (size and mtime).
fn in_place(i: &Item, cached: &libc::stat, dest: &libc::stat, uid: u32) -> bool {
    (dest.st_dev, dest.st_ino) == (cached.st_dev, cached.st_ino)
        || (dest.st_mode & libc::S_IFMT == libc::S_IFREG
            && dest.st_uid == uid
            && (
                dest.st_size.cast_unsigned(),
                (dest.st_mtime, dest.st_mtime_nsec),
            ) == (i.size, i.mtime))
}

/// How one file got into the destination (in this order, it indexes `link_into`'s counts).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Put {
    Unchanged,
    Linked,
    Cloned,
    Copied,
}

/// How [`link_file`] puts files into one destination.
struct Putting<'a> {
    /// The job's user and group: the owner of copies.
    owner: (u32, u32),
    /// The job's user with its groups: who must be able to read a link.
    user: &'a UserIds,
    /// Set once a hardlink fails with EXDEV: the cache is on another filesystem.
    other_fs: AtomicBool,
    way: fsops::CopyWay,
    /// Copies get the cached file's `user.*` extended attributes.
    xattrs: bool,
}

/// Puts the cached file `name` (in `cdir`) into `ddir`: already there (the same inode, or an
/// earlier copy of the same size and mtime), a hardlink, or a clone or copy of the user's own
/// once `other_fs` says hardlinks cannot cross or when the cached file's mode would not let the
/// user read a link (a source file only its owner could read: the entry's is root's). Errors
/// carry the operation that failed.
fn link_file(
    i: &Item,
    name: &std::ffi::CStr,
    cdir: &OwnedFd,
    ddir: &OwnedFd,
    how: &Putting,
) -> Result<Put, (&'static str, std::io::Error)> {
    let ((uid, gid), other_fs) = (how.owner, &how.other_fs);
    let missing = || std::io::Error::from(std::io::ErrorKind::NotFound);
    let cached = fsops::lstat_at(cdir, name)
        .map_err(|e| ("cache", e))?
        .ok_or_else(|| ("cache", missing()))?;
    match fsops::lstat_at(ddir, name).map_err(|e| ("inspect", e))? {
        Some(st) if in_place(i, &cached, &st, uid) => return Ok(Put::Unchanged),
        Some(st) if st.st_mode & libc::S_IFMT == libc::S_IFDIR => {
            return Err(("conflict", missing()));
        }
        Some(_) => fsops::unlink_at(ddir, name).map_err(|e| ("remove", e))?,
        None => {}
    }
    let readable = may_read(
        how.user,
        (cached.st_uid, cached.st_gid, cached.st_mode & 0o7777),
    );
    if readable && !other_fs.load(Ordering::Relaxed) {
        match fsops::link_at(cdir, ddir, name) {
            Ok(()) => return Ok(Put::Linked),
            Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {
                other_fs.store(true, Ordering::Relaxed)
            }
            // EMLINK: this inode's link count is full; this one file is copied.
            Err(e) if e.raw_os_error() == Some(libc::EMLINK) => {}
            Err(e) => return Err(("link", e)),
        }
    }
    // A copy of the user's own: created new (never through what is there), with the source's
    // mode.
    let cfd = fsops::open_at(cdir, name, libc::O_RDONLY, 0).map_err(|e| ("cache", e))?;
    let dfd = fsops::open_at(
        ddir,
        name,
        libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
        0o600,
    )
    .map_err(|e| ("create", e))?;
    fsops::fchown(&dfd, uid, gid).map_err(|e| ("chown", e))?;
    let put = if fsops::reflink(&cfd, &dfd).is_ok() {
        Put::Cloned
    } else {
        fsops::copy_data(&cfd, &dfd, 0, i.size, i.size, &how.way).map_err(|e| ("write", e))?;
        Put::Copied
    };
    if how.xattrs {
        fsops::copy_xattrs(&cfd, &dfd).map_err(|e| (XATTRS_OP, e))?;
    }
    fsops::fchmod(&dfd, i.mode).map_err(|e| ("chmod", e))?;
    fsops::set_mtime_fd(&dfd, i.mtime).map_err(|e| ("set the mtime of", e))?;
    Ok(put)
}

/// Compares every file of `m` at its source and in `dest` by hash (run as the user).
pub(super) fn verify(m: &Manifest, dest: &Path) -> Result<(), StageError> {
    for i in m.files() {
        let (s, d) = (m.source.join(&i.rel), dest.join(&i.rel));
        let hs = hash_fd(open_source(&s)?).map_err(|source| StageError::Source {
            path: s.clone(),
            source,
        })?;
        let hd = hash_fd(open_source(&d)?).map_err(|source| StageError::Source {
            path: d.clone(),
            source,
        })?;
        if hs != hd {
            return Err(StageError::Verify { path: d });
        }
    }
    Ok(())
}
