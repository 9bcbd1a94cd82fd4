//! The walk: lists and stats the source level by level, comparing each entry with the
//! destination's as it goes, into a [`Plan`].

use std::ffi::CString;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::{Entry, Kind, MARKER, MARKER_TMP, Plan, StageError, c_name, dest_err, fsops, parallel};

/// Walks `source`; with `dest` (the open destination root and its path), every entry is
/// compared with the destination's by the worker that stats it: one pass, and on a cold cache
/// the reads of both trees are in flight together.
pub(super) fn walk(
    source: &Path,
    dest: Option<(&OwnedFd, &Path)>,
    workers: usize,
) -> Result<Plan, StageError> {
    // The source named by the user is followed if it is a symlink; nothing inside it is.
    let st = nix::sys::stat::stat(source).map_err(|e| StageError::Source {
        path: source.to_path_buf(),
        source: e.into(),
    })?;
    let mut plan = Plan {
        source: source.to_path_buf(),
        single_file: false,
        entries: Vec::new(),
        copy: Vec::new(),
        dirs_exact: true,
        skipped_special: 0,
    };
    match st.st_mode & libc::S_IFMT {
        libc::S_IFREG => {
            let name = source.file_name().ok_or_else(|| StageError::Conflict {
                path: source.to_path_buf(),
                message: "not a file name".into(),
            })?;
            let e = Entry::from_stat(name.into(), &st).expect("a regular file");
            let copy = match dest {
                Some((root, path)) => compare(root, &c_name(name), &e, path)?.0,
                None => true,
            };
            plan.single_file = true;
            plan.entries.push(e);
            plan.copy.push(copy);
            return Ok(plan);
        }
        libc::S_IFDIR => {}
        _ => {
            return Err(StageError::Conflict {
                path: source.to_path_buf(),
                message: "neither a directory nor a regular file".into(),
            });
        }
    }
    plan.entries
        .push(Entry::from_stat(PathBuf::new(), &st).expect("a directory"));
    // The root is compared by the caller: its mtime is the marker's, not the source's.
    plan.copy.push(true);
    // Level by level: the level's directories listed in parallel, then their entries statted
    // in runs spread over the workers (on a cold cache every stat is a disk read, and a level
    // of few directories with many entries, such as a dataset's root with hundreds of
    // subdirectories, would otherwise read them one by one). A directory comes before its
    // contents, and the entries of one directory are together, sorted.
    let mut level = vec![PathBuf::new()];
    while !level.is_empty() {
        let listed: Vec<OnceLock<Listed>> = level.iter().map(|_| OnceLock::new()).collect();
        parallel(level.len(), workers, |k| {
            let _ = listed[k].set(list_dir(source, &level[k])?);
            Ok(())
        })?;
        let listed: Vec<Listed> = listed
            .into_iter()
            .filter_map(OnceLock::into_inner)
            .collect();
        let total: usize = listed.iter().map(|d| d.names.len()).sum();
        let run = (total / (workers.max(1) * 4)).clamp(1, 256);
        let runs: Vec<(usize, usize)> = listed
            .iter()
            .enumerate()
            .flat_map(|(k, d)| (0..d.names.len()).step_by(run).map(move |first| (k, first)))
            .collect();
        let statted: Vec<OnceLock<Statted>> = runs.iter().map(|_| OnceLock::new()).collect();
        parallel(runs.len(), workers, |t| {
            let (k, first) = runs[t];
            let dir = &listed[k];
            let names = &dir.names[first..(first + run).min(dir.names.len())];
            let _ = statted[t].set(stat_run(source, dir, names, dest)?);
            Ok(())
        })?;
        let mut next = Vec::new();
        for s in statted.into_iter().filter_map(OnceLock::into_inner) {
            plan.skipped_special += s.special;
            plan.dirs_exact &= s.dirs_exact;
            plan.copy.extend(s.copy);
            next.extend(
                s.children
                    .iter()
                    .filter(|e| e.kind == Kind::Dir)
                    .map(|e| e.rel.clone()),
            );
            plan.entries.extend(s.children);
        }
        level = next;
    }
    Ok(plan)
}

/// A source directory of the walk's current level, listed. No descriptor is kept open with it:
/// a level may have more directories than the process may open files.
pub(super) struct Listed {
    rel: PathBuf,
    /// Its entries' names, sorted.
    names: Vec<CString>,
}

/// Lists the source directory `rel`: its entries' names.
pub(super) fn list_dir(source: &Path, rel: &Path) -> Result<Listed, StageError> {
    let path = source.join(rel);
    let src_err = |e: std::io::Error| StageError::Source {
        path: path.clone(),
        source: e,
    };
    let mut dir = nix::dir::Dir::open(
        &path,
        nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_DIRECTORY | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(|e| src_err(e.into()))?;
    let mut names = Vec::new();
    for item in dir.iter() {
        let item = item.map_err(|e| src_err(e.into()))?;
        let name = item.file_name();
        if matches!(name.to_bytes(), b"." | b"..")
            || rel.as_os_str().is_empty() && matches!(name.to_str(), Ok(MARKER | MARKER_TMP))
        {
            continue;
        }
        names.push(name.to_owned());
    }
    names.sort_unstable();
    Ok(Listed {
        rel: rel.to_path_buf(),
        names,
    })
}

/// A run of one directory's entries, statted and compared.
pub(super) struct Statted {
    children: Vec<Entry>,
    /// Per child: the destination lacks it or has it differing (or there is no destination).
    copy: Vec<bool>,
    /// Every child directory already has its final mode and mtime in the destination.
    dirs_exact: bool,
    /// Sockets, FIFOs and devices: left out.
    special: u64,
}

/// Stats `names` in the listed directory `dir` (never following a symlink) and compares each
/// with the destination's entry of the same name.
pub(super) fn stat_run(
    source: &Path,
    dir: &Listed,
    names: &[CString],
    dest: Option<(&OwnedFd, &Path)>,
) -> Result<Statted, StageError> {
    let path = source.join(&dir.rel);
    let fd = open_source_dir(&path)?;
    // The destination's directory of the same path; `None` when it has none there (missing, or
    // a file or a symlink in its place): all of it is (re)made.
    let dest = match dest {
        None => None,
        Some((root, dest_path)) => fsops::open_dir_if_any(root, &dir.rel)
            .map_err(|err| dest_err("inspect", dest_path, &dir.rel, err))?
            .map(|fd| (fd, dest_path)),
    };
    let mut out = Statted {
        children: Vec::with_capacity(names.len()),
        copy: Vec::with_capacity(names.len()),
        dirs_exact: true,
        special: 0,
    };
    for name in names {
        let rel = dir.rel.join(std::ffi::OsStr::from_bytes(name.to_bytes()));
        let st = fsops::lstat_at(&fd, name).map_err(|e| StageError::Source {
            path: source.join(&rel),
            source: e,
        })?;
        // Gone since the listing: the source changed under the walk, and there is nothing to
        // stage.
        let Some(st) = st else { continue };
        let Some(e) = Entry::from_stat(rel, &st) else {
            out.special += 1;
            continue;
        };
        let (copy, exact) = match &dest {
            Some((fd, path)) => compare(fd, name, &e, path)?,
            None => (true, false),
        };
        out.copy.push(copy);
        out.dirs_exact &= exact || e.kind != Kind::Dir;
        out.children.push(e);
    }
    Ok(out)
}

pub(super) fn open_source_dir(path: &Path) -> Result<OwnedFd, StageError> {
    nix::fcntl::open(
        path,
        nix::fcntl::OFlag::O_PATH | nix::fcntl::OFlag::O_DIRECTORY | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(|e| StageError::Source {
        path: path.to_path_buf(),
        source: e.into(),
    })
}

/// Compares source entry `e` with `name` in the destination directory `dir`: whether it must be
/// copied, and (for a directory) whether it already has its final mode and mtime.
pub(super) fn compare(
    dir: &OwnedFd,
    name: &std::ffi::CStr,
    e: &Entry,
    dest: &Path,
) -> Result<(bool, bool), StageError> {
    let st = fsops::lstat_at(dir, name).map_err(|err| dest_err("inspect", dest, &e.rel, err))?;
    Ok((
        !st.is_some_and(|st| same(e, &st)),
        st.is_some_and(|st| dir_exact(e, &st, e.mode)),
    ))
}

/// Runs of consecutive paths with one parent directory (the walk lists siblings together), as
/// `(first, end)` index ranges; the root itself (an empty path) belongs to none.
pub(super) fn sibling_groups<'a>(rels: impl IntoIterator<Item = &'a Path>) -> Vec<(usize, usize)> {
    let mut groups: Vec<(usize, usize)> = Vec::new();
    let mut parent: Option<&Path> = None;
    for (i, rel) in rels.into_iter().enumerate() {
        if rel.as_os_str().is_empty() {
            continue;
        }
        match groups.last_mut() {
            Some((_, end)) if *end == i && parent == rel.parent() => *end = i + 1,
            _ => groups.push((i, i + 1)),
        }
        parent = rel.parent();
    }
    groups
}

/// Whether a directory already has its final `mode` and the source's mtime.
pub(super) fn dir_exact(entry: &Entry, st: &libc::stat, mode: u32) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFDIR
        && st.st_mode & 0o7777 == mode
        && (st.st_mtime, st.st_mtime_nsec) == entry.mtime
}

pub(super) fn same(entry: &Entry, st: &libc::stat) -> bool {
    let fmt = st.st_mode & libc::S_IFMT;
    let kind_ok = match entry.kind {
        Kind::File => fmt == libc::S_IFREG,
        Kind::Symlink => fmt == libc::S_IFLNK,
        Kind::Dir => return fmt == libc::S_IFDIR,
    };
    kind_ok
        && st.st_size.cast_unsigned() == entry.size
        && (st.st_mtime, st.st_mtime_nsec) == entry.mtime
}
