//! Data staging: copies a dataset (a directory tree or one file) from shared storage into a
//! job's node-local scratch, or results back out, fast and safely.
//!
//! A stage is planned, then applied. The plan walks the source without following symlinks (level
//! by level: the directories listed in parallel, then their entries statted in runs spread over
//! the workers) and compares each entry with the destination by size and mtime as it is
//! statted; unchanged files are not copied again, so a re-stage of an unchanged dataset
//! only reads metadata, and writes nothing at all when the destination's marker says it is
//! complete. The apply phase copies with a pool of worker threads (`copy_file_range` for small
//! files; large files split into chunks copied in parallel, written with O_DIRECT), keeps modes
//! and mtimes, recreates symlinks as symlinks, and resolves every
//! destination path beneath the destination root (`openat2 RESOLVE_BENEATH`). A completion marker
//! is written last: a tree without it is never taken as complete, and staging again resumes
//! (files whose size and mtime already match are skipped; a file's mtime is set only once all its
//! bytes are written).
//!
//! [`stage_as`] runs the whole stage in a child process that has taken the job user's
//! credentials, so a user can never stage what that user cannot read. A source under one of the
//! cache's prefixes goes through the dataset cache instead ([`cache`]): the user's child only
//! walks and opens the source, and root links the cached copy into the destination.

// TODO(lint wall): being reworked in parallel; fixed on merge
#![allow(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_possible_wrap,
    clippy::cast_lossless,
    clippy::ptr_as_ptr,
    clippy::assertions_on_result_states
)]

pub mod cache;
mod fsops;
pub mod job;
pub mod retain;
pub mod scratch;
pub(crate) mod tree;

use std::ffi::CString;
use std::io::{IsTerminal, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::spec::user::UserIds;

/// What a failed extended-attribute copy says it was doing.
const XATTRS_OP: &str = "copy the user.* extended attributes (stage.xattrs) to";

/// The completion marker, written last in the destination root.
pub const MARKER: &str = ".berth-staged";
const MARKER_TMP: &str = ".berth-staged.tmp";

#[derive(Debug, thiserror::Error)]
pub enum StageError {
    #[error("staging: cannot read {path}: {source}{hint}", hint = access_hint(source))]
    Source {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("staging: cannot {op} {path}: {source}{hint}", hint = space_hint(source))]
    Dest {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "staging into {dest}: needs {needed} bytes, {available} available ({limit}); free space or stage less"
    )]
    NoSpace {
        dest: PathBuf,
        needed: u64,
        available: u64,
        limit: &'static str,
    },
    #[error("dataset cache: cannot {op} {path}: {source}{hint}", hint = space_hint(source))]
    Cache {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("staging: {path} differs from its source after copying (--verify); stage it again")]
    Verify { path: PathBuf },
    #[error("staging: {path}: {message}")]
    Conflict { path: PathBuf, message: String },
    #[error("dataset cache: {0}")]
    CacheDir(crate::privfs::PrivfsError),
    #[error("staging as uid {uid}: {message}")]
    Credentials { uid: u32, message: String },
    /// A failure reported by the staging child, already one line.
    #[error("{0}")]
    Child(String),
}

fn access_hint(e: &std::io::Error) -> &'static str {
    if e.kind() == std::io::ErrorKind::PermissionDenied {
        " (staging runs as the job's user, who must be able to read the source)"
    } else {
        ""
    }
}

fn space_hint(e: &std::io::Error) -> &'static str {
    match e.raw_os_error() {
        Some(libc::ENOSPC) => " (the destination is full: free space or stage less)",
        Some(libc::EDQUOT) => " (disk quota exceeded)",
        Some(libc::ELOOP | libc::EXDEV) => " (a symlink in the destination path: refused)",
        _ => "",
    }
}

/// How a stage runs.
#[derive(Clone, Debug)]
pub struct Options {
    /// Copy threads (at least 1).
    pub workers: usize,
    /// Files larger than this are split into chunks of this size, copied in parallel.
    pub chunk_size: u64,
    /// Hash every file on both sides after copying (xxh3) and fail on a difference.
    pub verify: bool,
    /// Copy the `user.*` extended attributes of files and directories.
    pub xattrs: bool,
    /// Bytes the destination may still take (a per-job scratch cap), besides its free space.
    pub cap: Option<u64>,
    /// Progress: a live line on a TTY, else a log line every `progress_interval`.
    pub progress: bool,
    pub progress_interval: Duration,
    /// The dataset cache, for [`stage_as`] run by root; `None`: every stage copies.
    pub cache: Option<cache::CacheOptions>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            workers: 16,
            chunk_size: 64 << 20,
            verify: false,
            xattrs: false,
            cap: None,
            progress: false,
            progress_interval: Duration::from_secs(10),
            cache: None,
        }
    }
}

/// How a stage put the files into the destination.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum How {
    /// Copied from the source (the plain engine).
    #[default]
    Copied,
    /// Hardlinked from the dataset cache: no data written.
    LinkedFromCache,
    /// Cloned from the cache (FICLONE): the cache is on another filesystem that shares extents.
    ReflinkedFromCache,
    /// Copied from the cache: on another filesystem without reflinks.
    CopiedFromCache,
}

impl std::fmt::Display for How {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            How::Copied => "copied",
            How::LinkedFromCache => "linked from cache",
            How::ReflinkedFromCache => "reflinked from cache",
            How::CopiedFromCache => "copied from cache",
        })
    }
}

/// What a stage did.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub source: PathBuf,
    pub dest: PathBuf,
    pub how: How,
    /// Regular files in the source.
    pub files: u64,
    /// Files read from the source (into the destination, or into the cache).
    pub files_copied: u64,
    /// Files the destination already had.
    pub files_unchanged: u64,
    /// Files put into the destination from the cache.
    pub files_from_cache: u64,
    pub dirs: u64,
    pub symlinks: u64,
    /// Sockets, FIFOs and devices: never staged.
    pub skipped_special: u64,
    pub bytes: u64,
    pub bytes_copied: u64,
    pub seconds: f64,
    pub verified: bool,
}

impl Report {
    /// The one-line summary: files, bytes, seconds, GB/s.
    pub fn summary(&self) -> String {
        let rate = if self.seconds > 0.0 {
            self.bytes_copied as f64 / self.seconds / 1e9
        } else {
            0.0
        };
        format!(
            "staged {} -> {} ({}): {} files ({} copied, {} unchanged, {} from cache), {} bytes copied of {}, {:.2} s, {:.2} GB/s{}",
            self.source.display(),
            self.dest.display(),
            self.how,
            self.files,
            self.files_copied,
            self.files_unchanged,
            self.files_from_cache,
            self.bytes_copied,
            self.bytes,
            self.seconds,
            rate,
            if self.verified { ", verified" } else { "" }
        )
    }
}

/// The completion marker's content.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Marker {
    pub source: PathBuf,
    pub files: u64,
    pub bytes: u64,
    /// Seconds since the epoch.
    pub completed_at: u64,
    pub verified: bool,
}

/// Reads the completion marker of a staged tree: `None` when the tree is not (or not yet)
/// completely staged.
pub fn status(dest: &Path) -> Option<Marker> {
    let fd = nix::fcntl::open(
        dest,
        nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_DIRECTORY | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .ok()?;
    read_marker(&fd)
}

/// The most a completion marker may hold: a path and a few numbers.
const MARKER_MAX: u64 = 64 * 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum Kind {
    Dir,
    File,
    Symlink,
}

#[derive(Clone, Debug)]
struct Entry {
    /// Relative to the source root (and to the destination root); empty for the root.
    rel: PathBuf,
    kind: Kind,
    size: u64,
    mode: u32,
    mtime: (i64, i64),
    /// Identify the inode the walk saw, so that a later open can be checked against it.
    dev: u64,
    ino: u64,
}

impl Entry {
    fn from_stat(rel: PathBuf, st: &libc::stat) -> Option<Self> {
        let kind = match st.st_mode & libc::S_IFMT {
            libc::S_IFDIR => Kind::Dir,
            libc::S_IFREG => Kind::File,
            libc::S_IFLNK => Kind::Symlink,
            _ => return None,
        };
        Some(Self {
            rel,
            kind,
            size: st.st_size as u64,
            // setuid/setgid bits are dropped: a staged copy never gains privilege.
            mode: st.st_mode & 0o1777,
            mtime: (st.st_mtime, st.st_mtime_nsec),
            dev: st.st_dev,
            ino: st.st_ino,
        })
    }
}

/// A planned stage: every source entry and which files need copying.
struct Plan {
    source: PathBuf,
    /// `true` when the source is one file, staged into the destination under its own name.
    single_file: bool,
    entries: Vec<Entry>,
    /// Per entry: copy it (it differs from the destination, or there was none to compare with).
    copy: Vec<bool>,
    /// Every directory but the root already has its final mode and mtime in the destination.
    dirs_exact: bool,
    skipped_special: u64,
}

/// Walks `source`; with `dest` (the open destination root and its path), every entry is
/// compared with the destination's by the worker that stats it: one pass, and on a cold cache
/// the reads of both trees are in flight together.
fn walk(
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

fn dest_err(op: &'static str, dest: &Path, rel: &Path, source: std::io::Error) -> StageError {
    StageError::Dest {
        op,
        path: dest.join(rel),
        source,
    }
}

fn c_name(name: &std::ffi::OsStr) -> CString {
    CString::new(name.as_bytes()).expect("a file name has no NUL")
}

/// A source directory of the walk's current level, listed. No descriptor is kept open with it:
/// a level may have more directories than the process may open files.
struct Listed {
    rel: PathBuf,
    /// Its entries' names, sorted.
    names: Vec<CString>,
}

/// Lists the source directory `rel`: its entries' names.
fn list_dir(source: &Path, rel: &Path) -> Result<Listed, StageError> {
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
struct Statted {
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
fn stat_run(
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

fn open_source_dir(path: &Path) -> Result<OwnedFd, StageError> {
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
fn compare(
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
fn sibling_groups<'a>(rels: impl IntoIterator<Item = &'a Path>) -> Vec<(usize, usize)> {
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
fn dir_exact(entry: &Entry, st: &libc::stat, mode: u32) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFDIR
        && st.st_mode & 0o7777 == mode
        && (st.st_mtime, st.st_mtime_nsec) == entry.mtime
}

/// The completion marker in the open destination root, if a valid one is there.
/// A regular file only (never a symlink, never blocking on a FIFO), read bounded.
fn read_marker(root: &OwnedFd) -> Option<Marker> {
    let fd = fsops::open_beneath(
        root,
        Path::new(MARKER),
        libc::O_RDONLY | libc::O_NONBLOCK,
        0,
    )
    .ok()?;
    let mut file = std::fs::File::from(fd);
    if !file.metadata().ok()?.is_file() {
        return None;
    }
    let text = crate::privfs::read_bounded(&mut file, MARKER_MAX).ok()?;
    serde_json::from_slice(&text).ok()
}

fn same(entry: &Entry, st: &libc::stat) -> bool {
    let fmt = st.st_mode & libc::S_IFMT;
    let kind_ok = match entry.kind {
        Kind::File => fmt == libc::S_IFREG,
        Kind::Symlink => fmt == libc::S_IFLNK,
        Kind::Dir => return fmt == libc::S_IFDIR,
    };
    kind_ok && st.st_size as u64 == entry.size && (st.st_mtime, st.st_mtime_nsec) == entry.mtime
}

/// Runs `f(i)` for `i` in `0..n` on `workers` threads; stops at the first error.
fn parallel<F>(n: usize, workers: usize, f: F) -> Result<(), StageError>
where
    F: Fn(usize) -> Result<(), StageError> + Sync,
{
    let next = AtomicUsize::new(0);
    let failed: Mutex<Option<StageError>> = Mutex::new(None);
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        for _ in 0..workers.max(1).min(n.max(1)) {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    if let Err(e) = f(i) {
                        stop.store(true, Ordering::Relaxed);
                        failed
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .get_or_insert(e);
                    }
                }
            });
        }
    });
    match failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

struct Progress {
    files: AtomicU64,
    bytes: AtomicU64,
}

/// Reports `progress` on `out` until `done`: a line rewritten in place every half second on a
/// terminal (`tty`), else a line every `interval`.
fn progress_thread<'s>(
    scope: &'s std::thread::Scope<'s, '_>,
    progress: &'s Progress,
    done: &'s AtomicBool,
    (total_files, total_bytes): (u64, u64),
    interval: Duration,
    tty: bool,
    mut out: impl Write + Send + 's,
) {
    let interval = if tty {
        Duration::from_millis(500)
    } else {
        interval
    };
    scope.spawn(move || {
        let start = Instant::now();
        let mut last = Instant::now();
        while !done.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(100).min(interval));
            if last.elapsed() < interval {
                continue;
            }
            last = Instant::now();
            let (f, b) = (
                progress.files.load(Ordering::Relaxed),
                progress.bytes.load(Ordering::Relaxed),
            );
            let rate = b as f64 / start.elapsed().as_secs_f64();
            let eta = if rate > 0.0 {
                format!("{:.0} s", total_bytes.saturating_sub(b) as f64 / rate)
            } else {
                "?".into()
            };
            let line = format!(
                "staging: {f}/{total_files} files, {:.2}/{:.2} GB, {:.2} GB/s, ETA {eta}",
                b as f64 / 1e9,
                total_bytes as f64 / 1e9,
                rate / 1e9
            );
            // Progress is best effort: a closed stderr does not fail the stage.
            let _ = if tty {
                write!(out, "\r{line}\x1b[K")
            } else {
                writeln!(out, "{line}")
            };
        }
        if tty {
            let _ = write!(out, "\r\x1b[K");
        }
    });
}

/// Runs `f` with progress counters, reported while it runs when `opts.progress` asks for it:
/// `files` is (already done, total), `bytes` the total to copy.
fn with_progress<R>(
    opts: &Options,
    files: (u64, u64),
    bytes: u64,
    f: impl FnOnce(&Progress) -> R,
) -> R {
    let progress = Progress {
        files: AtomicU64::new(files.0),
        bytes: AtomicU64::new(0),
    };
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        if opts.progress {
            let err = std::io::stderr();
            let tty = err.is_terminal();
            let totals = (files.1, bytes);
            progress_thread(
                s,
                &progress,
                &done,
                totals,
                opts.progress_interval,
                tty,
                err,
            );
        }
        let r = f(&progress);
        done.store(true, Ordering::Relaxed);
        r
    })
}

/// The destination of a stage, open: its root directory, and whether it was there before (a
/// directory the stage did not make keeps its mode and owner: only what a stage makes gets the
/// source's modes).
struct Dest {
    fd: OwnedFd,
    existed: bool,
    /// The base directory, and the components of `rel` this stage created in it (parents
    /// first): a failed stage removes them again when they are still empty.
    base: OwnedFd,
    created: Vec<PathBuf>,
}

impl Dest {
    /// After a failed stage: removes the directories it made, deepest first, those `inside`
    /// the destination (relative to it), then the destination's own components, each only while
    /// empty and each by fd beneath its parent without following a symlink. A failed stage
    /// left empty directories behind otherwise. What cannot be removed stays (logged at debug).
    fn remove_made(&self, inside: &[PathBuf]) {
        let dirs = inside
            .iter()
            .rev()
            .map(|r| (&self.fd, r))
            .chain(self.created.iter().rev().map(|r| (&self.base, r)));
        for (root, rel) in dirs {
            if let Err(e) = fsops::rmdir_beneath(root, rel) {
                tracing::debug!("leaving {} of a failed stage: {e}", rel.display());
            }
        }
    }
}

/// Opens (creating each missing component beneath `base`) the directory `base/rel`, with the
/// caller's credentials: `base` is the job's scratch or a directory the user named, and is
/// opened as whoever stages (the user's child, or the user's thread for the dataset cache); `rel`
/// may not leave it.
fn open_dest(base: &Path, rel: &Path) -> Result<Dest, StageError> {
    let dest_err = |op, source| StageError::Dest {
        op,
        path: base.join(rel),
        source,
    };
    let mut existed = true;
    if !base.is_dir() {
        std::fs::create_dir_all(base).map_err(|e| dest_err("create", e))?;
        existed = false;
    }
    let base_fd = fsops::open_beneath(
        &std::fs::File::open(base)
            .map_err(|e| dest_err("open", e))?
            .into(),
        Path::new(""),
        libc::O_RDONLY | libc::O_DIRECTORY,
        0,
    )
    .map_err(|e| dest_err("open", e))?;
    let mut sofar = PathBuf::new();
    let mut created = Vec::new();
    for comp in rel.components() {
        match comp {
            std::path::Component::Normal(c) => sofar.push(c),
            std::path::Component::CurDir => continue,
            _ => {
                return Err(StageError::Conflict {
                    path: rel.to_path_buf(),
                    message: "a destination must be a relative path without '..'".into(),
                });
            }
        }
        match fsops::mkdir_beneath(&base_fd, &sofar, 0o700) {
            Ok(()) => {
                existed = false;
                created.push(sofar.clone());
            }
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => existed = true,
            Err(e) => return Err(dest_err("create", e)),
        }
    }
    let fd = fsops::open_beneath(&base_fd, &sofar, libc::O_RDONLY | libc::O_DIRECTORY, 0)
        .map_err(|e| dest_err("open", e))?;
    Ok(Dest {
        fd,
        existed,
        base: base_fd,
        created,
    })
}

/// Stages `source` into `base/rel` as the calling process's credentials allow.
pub fn stage(source: &Path, base: &Path, rel: &Path, opts: &Options) -> Result<Report, StageError> {
    let dest = open_dest(base, rel)?;
    let mut made = Vec::new();
    let result = stage_into(source, base, rel, opts, &dest, &mut made);
    if result.is_err() {
        dest.remove_made(&made);
    }
    result
}

/// [`stage`] into the opened `dest`; the directories it creates inside are recorded in `made`.
fn stage_into(
    source: &Path,
    base: &Path,
    rel: &Path,
    opts: &Options,
    dest: &Dest,
    made: &mut Vec<PathBuf>,
) -> Result<Report, StageError> {
    let start = Instant::now();
    let dest_path = base.join(rel);
    let (root, existed) = (&dest.fd, dest.existed);
    let dest_err = |op, rel: &Path, source| dest_err(op, &dest_path, rel, source);
    // What an earlier complete stage left: if the source is unchanged since, nothing is written.
    let prior = read_marker(root);

    let plan = walk(source, Some((root, &dest_path)), opts.workers)?;
    // When each phase ended, for `-vv`.
    let phase = |what: std::fmt::Arguments| {
        let at = start.elapsed().as_secs_f64();
        tracing::debug!("stage {}: {what} at {at:.3} s", source.display());
    };
    phase(format_args!(
        "walked {} entries and compared them with the destination",
        plan.entries.len()
    ));
    let src_path = |rel: &Path| {
        if plan.single_file {
            plan.source.clone()
        } else {
            plan.source.join(rel)
        }
    };
    // Every directory already has its final mode and mtime (a completed stage's state); the
    // root's mtime is not the source's: the marker, written last, changed it.
    let mut dirs_exact = plan.dirs_exact;
    if let Some(e) = plan.entries.first().filter(|e| e.kind == Kind::Dir) {
        let st = fsops::fstat(root).map_err(|err| dest_err("inspect", Path::new(""), err))?;
        let root = Entry {
            mtime: (st.st_mtime, st.st_mtime_nsec),
            ..e.clone()
        };
        // A destination directory that was there keeps its mode: only its contents count.
        dirs_exact &= existed || dir_exact(&root, &st, e.mode | 0o700);
    }

    // Absolute in the report and the marker: `stage status` must name the source whatever the
    // directory it runs in.
    let source_abs = std::path::absolute(source).unwrap_or_else(|_| source.to_path_buf());
    let mut report = Report {
        source: source_abs.clone(),
        dest: dest_path.clone(),
        skipped_special: plan.skipped_special,
        ..Report::default()
    };
    for (e, &copy) in plan.entries.iter().zip(&plan.copy) {
        match e.kind {
            Kind::Dir => report.dirs += 1,
            Kind::Symlink => report.symlinks += 1,
            Kind::File => {
                report.files += 1;
                report.bytes += e.size;
                if copy {
                    report.files_copied += 1;
                    report.bytes_copied += e.size;
                } else {
                    report.files_unchanged += 1;
                }
            }
        }
    }

    // A completed stage of this very source, and nothing changed since: done, without the
    // syncfs and the marker rewrite (the fixed cost of an unchanged re-stage).
    let unchanged = !opts.verify
        && plan
            .entries
            .iter()
            .zip(&plan.copy)
            .all(|(e, &c)| !c || e.rel.as_os_str().is_empty())
        && dirs_exact
        && prior.is_some_and(|m| {
            (m.source.as_path(), m.files, m.bytes)
                == (source_abs.as_path(), report.files, report.bytes)
        });
    if unchanged {
        report.seconds = start.elapsed().as_secs_f64();
        return Ok(report);
    }
    // A stage in progress is never complete, whatever an earlier stage left.
    fsops::unlink_beneath(root, Path::new(MARKER))
        .map_err(|e| dest_err("remove", Path::new(MARKER), e))?;

    // Space: the bytes to copy must fit both the filesystem and the per-job cap.
    let free = fsops::available_bytes(root).map_err(|e| dest_err("inspect", Path::new(""), e))?;
    let (available, limit) = match opts.cap {
        Some(cap) if cap < free => (cap, "per-job scratch cap"),
        _ => (free, "free space"),
    };
    if report.bytes_copied > available {
        return Err(StageError::NoSpace {
            dest: dest_path,
            needed: report.bytes_copied,
            available,
            limit,
        });
    }

    // Directories first (parents before children), writable by their owner until the end.
    for (e, _) in plan
        .entries
        .iter()
        .zip(&plan.copy)
        .filter(|(e, _)| e.kind == Kind::Dir)
    {
        if e.rel.as_os_str().is_empty() {
            // Made by this stage: writable by its owner until the end. One that was there
            // keeps its mode (as root, `stage out /tmp:/` once left `/` at 0700).
            if !existed {
                fsops::fchmod(root, 0o700).map_err(|err| dest_err("chmod", &e.rel, err))?;
            }
            continue;
        }
        match fsops::mkdir_beneath(root, &e.rel, 0o700) {
            Ok(()) => made.push(e.rel.clone()),
            Err(err) if err.raw_os_error() == Some(libc::EEXIST) => {
                let st = fsops::lstat_beneath(root, &e.rel)
                    .map_err(|err| dest_err("inspect", &e.rel, err))?;
                if st.is_some_and(|st| st.st_mode & libc::S_IFMT != libc::S_IFDIR) {
                    // A file or symlink where the source has a directory: replace it.
                    fsops::unlink_beneath(root, &e.rel)
                        .map_err(|err| dest_err("remove", &e.rel, err))?;
                    fsops::mkdir_beneath(root, &e.rel, 0o700)
                        .map_err(|err| dest_err("create", &e.rel, err))?;
                } else {
                    let fd =
                        fsops::open_beneath(root, &e.rel, libc::O_RDONLY | libc::O_DIRECTORY, 0)
                            .map_err(|err| dest_err("open", &e.rel, err))?;
                    fsops::fchmod(&fd, 0o700).map_err(|err| dest_err("chmod", &e.rel, err))?;
                }
            }
            Err(err) => return Err(dest_err("create", &e.rel, err)),
        }
    }

    // Tasks: one per small file or symlink, one per chunk of a large file.
    let chunk = opts.chunk_size.max(1 << 20);
    let mut tasks: Vec<(usize, u64, u64)> = Vec::new();
    // Chunks still to copy, per entry; 0 for a file copied whole.
    let chunks_left: Vec<AtomicU64> = plan.entries.iter().map(|_| AtomicU64::new(0)).collect();
    for (i, (e, &copy)) in plan.entries.iter().zip(&plan.copy).enumerate() {
        if !copy || e.kind == Kind::Dir {
            continue;
        }
        if e.kind == Kind::File && e.size > chunk {
            let fd = create_file(root, &e.rel).map_err(|err| dest_err("create", &e.rel, err))?;
            // Sized up front so that chunks can be written in any order; the mtime set last
            // marks the file complete.
            std::fs::File::from(fd)
                .set_len(e.size)
                .map_err(|err| dest_err("write", &e.rel, err))?;
            let mut off = 0;
            while off < e.size {
                tasks.push((i, off, chunk.min(e.size - off)));
                off += chunk;
            }
            chunks_left[i].store(e.size.div_ceil(chunk), Ordering::Relaxed);
        } else {
            tasks.push((i, 0, e.size));
        }
    }
    // Large files first (they set the stage's length; small files fill in around them), each
    // file's chunks together so that files complete one after another: a killed stage leaves
    // whole files for the next one to skip. Small files in inode order, which on most
    // filesystems follows their order on disk: fewer seeks when the source is cold (on this
    // project's virtual disks it made no measurable difference).
    tasks.sort_by_key(|t| {
        let e = &plan.entries[t.0];
        (
            std::cmp::Reverse((e.size > chunk).then_some(e.size)),
            e.ino,
            t.1,
        )
    });
    phase(format_args!("{} copy tasks ready", tasks.len()));

    let way = fsops::CopyWay::default();
    with_progress(
        opts,
        (report.files_unchanged, report.files),
        report.bytes_copied,
        |progress| {
            parallel(tasks.len(), opts.workers, |t| {
                let (i, off, len) = tasks[t];
                let e = &plan.entries[i];
                match e.kind {
                    Kind::Symlink => {
                        let src = src_path(&e.rel);
                        let target =
                            std::fs::read_link(&src).map_err(|err| StageError::Source {
                                path: src.clone(),
                                source: err,
                            })?;
                        remove_nondir(root, &e.rel)
                            .map_err(|err| dest_err("remove", &e.rel, err))?;
                        fsops::symlink_beneath(root, &target, &e.rel)
                            .map_err(|err| dest_err("create", &e.rel, err))?;
                        fsops::set_mtime_beneath(root, &e.rel, e.mtime)
                            .map_err(|err| dest_err("set the mtime of", &e.rel, err))?;
                        progress.files.fetch_add(1, Ordering::Relaxed);
                    }
                    Kind::File => {
                        let src = src_path(&e.rel);
                        let sfd = open_source(&src)?;
                        let whole = chunks_left[i].load(Ordering::Relaxed) == 0;
                        let dfd = if whole {
                            create_file(root, &e.rel)
                        } else {
                            fsops::open_beneath(root, &e.rel, libc::O_WRONLY, 0)
                        }
                        .map_err(|err| dest_err("create", &e.rel, err))?;
                        fsops::copy_data(&sfd, &dfd, off, len, e.size, &way).map_err(|err| {
                            match err.kind() {
                                std::io::ErrorKind::UnexpectedEof => StageError::Source {
                                    path: src.clone(),
                                    source: err,
                                },
                                _ => dest_err("write", &e.rel, err),
                            }
                        })?;
                        // The last chunk of a file completes it (mode and mtime set last).
                        if whole || chunks_left[i].fetch_sub(1, Ordering::AcqRel) == 1 {
                            if opts.xattrs {
                                fsops::copy_xattrs(&sfd, &dfd)
                                    .map_err(|err| dest_err(XATTRS_OP, &e.rel, err))?;
                            }
                            finish_file(&dfd, e)
                                .map_err(|err| dest_err("set the mode of", &e.rel, err))?;
                            progress.files.fetch_add(1, Ordering::Relaxed);
                        }
                        progress.bytes.fetch_add(len, Ordering::Relaxed);
                    }
                    Kind::Dir => {}
                }
                Ok(())
            })
        },
    )?;
    phase(format_args!("copied"));
    // Directory modes and mtimes last, deepest first: creating entries changed their mtimes.
    for e in plan.entries.iter().rev().filter(|e| e.kind == Kind::Dir) {
        let fd = fsops::open_beneath(root, &e.rel, libc::O_RDONLY | libc::O_DIRECTORY, 0)
            .map_err(|err| dest_err("open", &e.rel, err))?;
        if opts.xattrs {
            let src = src_path(&e.rel);
            let sfd = open_source(&src)?;
            fsops::copy_xattrs(&sfd, &fd).map_err(|err| dest_err(XATTRS_OP, &e.rel, err))?;
        }
        if existed && e.rel.as_os_str().is_empty() {
            continue;
        }
        fsops::set_mtime_fd(&fd, e.mtime)
            .map_err(|err| dest_err("set the mtime of", &e.rel, err))?;
        // The destination root stays writable by its owner: the marker goes there.
        let mode = if e.rel.as_os_str().is_empty() {
            e.mode | 0o700
        } else {
            e.mode
        };
        fsops::fchmod(&fd, mode).map_err(|err| dest_err("chmod", &e.rel, err))?;
    }

    if opts.verify {
        verify(&plan, root, &dest_path, opts.workers)?;
        report.verified = true;
    }
    // Data on disk before the marker says it is there.
    fsops::syncfs(root).map_err(|e| dest_err("sync", Path::new(""), e))?;
    phase(format_args!("synced"));
    write_marker(
        root,
        &Marker {
            source: source_abs,
            files: report.files,
            bytes: report.bytes,
            completed_at: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            verified: report.verified,
        },
    )
    .map_err(|e| dest_err("write", Path::new(MARKER), e))?;
    report.seconds = start.elapsed().as_secs_f64();
    Ok(report)
}

fn open_source(path: &Path) -> Result<OwnedFd, StageError> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map(OwnedFd::from)
        .map_err(|source| StageError::Source {
            path: path.to_path_buf(),
            source,
        })
}

/// Creates (truncating) the regular file `rel`, replacing a symlink found in its place.
fn create_file(root: &OwnedFd, rel: &Path) -> std::io::Result<OwnedFd> {
    let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC;
    match fsops::open_beneath(root, rel, flags, 0o600) {
        // ELOOP: a symlink there (never written through); EACCES: a read-only file we own.
        Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::EACCES)) => {
            fsops::unlink_beneath(root, rel)?;
            fsops::open_beneath(root, rel, flags, 0o600)
        }
        other => other,
    }
}

fn remove_nondir(root: &OwnedFd, rel: &Path) -> std::io::Result<()> {
    fsops::unlink_beneath(root, rel)
}

fn finish_file(fd: &OwnedFd, e: &Entry) -> std::io::Result<()> {
    fsops::fchmod(fd, e.mode)?;
    fsops::set_mtime_fd(fd, e.mtime)
}

fn write_marker(root: &OwnedFd, marker: &Marker) -> std::io::Result<()> {
    let fd = fsops::open_beneath(
        root,
        Path::new(MARKER_TMP),
        libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC,
        0o644,
    )?;
    let mut f = std::fs::File::from(fd);
    f.write_all(&serde_json::to_vec_pretty(marker).map_err(std::io::Error::other)?)?;
    f.sync_all()?;
    let tmp = std::ffi::CString::new(MARKER_TMP).expect("no NUL");
    let fin = std::ffi::CString::new(MARKER).expect("no NUL");
    use std::os::fd::AsRawFd;
    // SAFETY: `root` is an open directory; both names are valid C strings of plain file names.
    let r = unsafe {
        libc::renameat(
            root.as_raw_fd(),
            tmp.as_ptr(),
            root.as_raw_fd(),
            fin.as_ptr(),
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn hash_fd(fd: OwnedFd) -> std::io::Result<u64> {
    let mut f = std::fs::File::from(fd);
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            return Ok(h.digest());
        }
        h.update(&buf[..n]);
    }
}

fn verify(plan: &Plan, root: &OwnedFd, dest: &Path, workers: usize) -> Result<(), StageError> {
    let files: Vec<&Entry> = plan
        .entries
        .iter()
        .filter(|e| e.kind == Kind::File)
        .collect();
    parallel(files.len(), workers, |i| {
        let e = files[i];
        let src = if plan.single_file {
            plan.source.clone()
        } else {
            plan.source.join(&e.rel)
        };
        let a = hash_fd(open_source(&src)?).map_err(|source| StageError::Source {
            path: src.clone(),
            source,
        })?;
        let dst_err = |source| StageError::Dest {
            op: "verify",
            path: dest.join(&e.rel),
            source,
        };
        let fd = fsops::open_beneath(root, &e.rel, libc::O_RDONLY, 0).map_err(dst_err)?;
        let b = hash_fd(fd).map_err(dst_err)?;
        if a != b {
            return Err(StageError::Verify {
                path: dest.join(&e.rel),
            });
        }
        Ok(())
    })
}

/// Checksums (xxh3) of every regular file under `dir`, keyed by relative path: for tests and
/// `stage status`.
pub fn checksums(dir: &Path) -> Result<std::collections::BTreeMap<PathBuf, u64>, StageError> {
    let plan = walk(dir, None, Options::default().workers)?;
    let mut out = std::collections::BTreeMap::new();
    for e in plan.entries.iter().filter(|e| e.kind == Kind::File) {
        let path = dir.join(&e.rel);
        let h =
            hash_fd(open_source(&path)?).map_err(|source| StageError::Source { path, source })?;
        out.insert(e.rel.clone(), h);
    }
    Ok(out)
}

/// Runs [`stage`] in a child process with `user`'s uid, gid and groups (when berth runs as
/// root; otherwise as the caller). Call it from a single-threaded process (the Prolog/Epilog and
/// the CLI are): the child starts its own worker threads after the fork. The child dies with
/// its parent (PR_SET_PDEATHSIG), so killing berth stops the copy; staging again resumes it.
///
/// With a cache configured (`opts.cache`) and run by root, a directory under one of the cache's
/// prefixes is staged through the dataset cache ([`cache::stage_cached`]).
pub fn stage_as(
    user: &UserIds,
    source: &Path,
    base: &Path,
    rel: &Path,
    opts: &Options,
) -> Result<Report, StageError> {
    if !nix::unistd::Uid::current().is_root() {
        return stage(source, base, rel, opts);
    }
    // Whether the cache covers the source is looked at as the user: root resolves no path the
    // user named.
    if let Some(cache) = &opts.cache
        && let Some(canon) = crate::privfs::as_user(user, || cache.covers(source))
            .ok()
            .flatten()
    {
        return cache::stage_cached(user, &canon, base, rel, opts, cache);
    }
    as_user(user, || {
        stage(source, base, rel, opts).map_err(|e| e.to_string())
    })
}

/// Runs `f` in a forked child with `user`'s uid, gid and groups and returns its result (the
/// caller must be root and single-threaded; see [`stage_as`]). `berth step` writes
/// `--container-save` through it too.
pub(crate) fn as_user<T, F>(user: &UserIds, f: F) -> Result<T, StageError>
where
    T: Serialize + serde::de::DeserializeOwned,
    F: FnOnce() -> Result<T, String>,
{
    use nix::sys::wait::waitpid;
    use nix::unistd::{ForkResult, Gid, Uid, fork, setgroups, setresgid, setresuid};
    let cred_err = |message: String| StageError::Credentials {
        uid: user.uid,
        message,
    };
    let parent = nix::unistd::getpid();
    let (reader, writer) = nix::unistd::pipe().map_err(|e| cred_err(format!("pipe: {e}")))?;
    // SAFETY: the caller is single-threaded (documented above); the child drops privileges,
    // runs `f`, writes its result to the pipe and exits without returning.
    match unsafe { fork() } {
        Ok(ForkResult::Child) => {
            drop(reader);
            let groups: Vec<Gid> = user.groups.iter().map(|g| Gid::from_raw(*g)).collect();
            let gid = Gid::from_raw(user.gid);
            let uid = Uid::from_raw(user.uid);
            let result: Result<T, String> = setgroups(&groups)
                .and_then(|_| setresgid(gid, gid, gid))
                .and_then(|_| setresuid(uid, uid, uid))
                .map_err(|e| format!("staging as uid {}: dropping privileges: {e}", user.uid))
                .map(|_| {
                    // After the credential change, which clears the parent-death signal; and if
                    // the parent is already gone, nobody waits for this stage.
                    // SAFETY: prctl with PR_SET_PDEATHSIG and a signal number has no memory effects.
                    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
                    // The user must not ptrace this child or reach its pipe through /proc: root
                    // trusts what it reports (the dataset cache serves by its manifest). The
                    // kernel clears the flag on the uid change already; this does not rely on it.
                    // SAFETY: as above.
                    unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0) };
                    if nix::unistd::getppid() != parent {
                        // SAFETY: exiting the child without running the parent's exit handlers.
                        unsafe { libc::_exit(1) }
                    }
                })
                .and_then(|_| f());
            let mut w = std::fs::File::from(writer);
            let ok = result.is_ok();
            let _ = w.write_all(&serde_json::to_vec(&result).unwrap_or_default());
            drop(w);
            // SAFETY: leaving the child without running the parent's exit handlers.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) }
        }
        Ok(ForkResult::Parent { child }) => {
            drop(writer);
            let mut buf = Vec::new();
            let _ = std::fs::File::from(reader).read_to_end(&mut buf);
            let status = waitpid(child, None);
            match serde_json::from_slice::<Result<T, String>>(&buf) {
                Ok(Ok(value)) => Ok(value),
                Ok(Err(message)) => Err(StageError::Child(message)),
                Err(_) => Err(cred_err(format!(
                    "the staging process ended without a result ({status:?})",
                ))),
            }
        }
        Err(e) => Err(cred_err(format!("fork: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn opts() -> Options {
        Options {
            workers: 4,
            chunk_size: 1 << 20,
            ..Options::default()
        }
    }

    /// A writer the test can read back.
    #[derive(Clone, Default)]
    struct Sink(std::sync::Arc<Mutex<Vec<u8>>>);
    impl Write for Sink {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn progress_is_reported_while_work_goes_on_as_lines_or_in_place() {
        for tty in [false, true] {
            let sink = Sink::default();
            let progress = Progress {
                files: AtomicU64::new(3),
                bytes: AtomicU64::new(0),
            };
            let done = AtomicBool::new(false);
            std::thread::scope(|s| {
                let every = Duration::from_millis(20);
                progress_thread(
                    s,
                    &progress,
                    &done,
                    (10, 2_000_000_000),
                    every,
                    tty,
                    sink.clone(),
                );
                progress.files.store(5, Ordering::Relaxed);
                progress.bytes.store(1_000_000_000, Ordering::Relaxed);
                // Long enough for several lines, and for the terminal's half-second period.
                std::thread::sleep(Duration::from_millis(700));
                done.store(true, Ordering::Relaxed);
            });
            let text = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
            assert!(
                text.contains("staging: 5/10 files, 1.00/2.00 GB, "),
                "{text:?}"
            );
            assert!(text.contains(" GB/s, ETA "), "{text:?}");
            if tty {
                assert!(
                    !text.contains('\n') && text.ends_with("\r\x1b[K"),
                    "{text:?}"
                );
            } else {
                assert!(text.lines().count() >= 5, "{text:?}");
            }
        }
    }

    /// A source tree: nested dirs, a read-only dir, a 5 MiB file (5 chunks), an empty file,
    /// a relative symlink and one pointing out of the tree.
    fn source(dir: &Path) {
        std::fs::create_dir_all(dir.join("a/b")).unwrap();
        std::fs::create_dir_all(dir.join("ro")).unwrap();
        std::fs::write(dir.join("a/small"), b"hello").unwrap();
        std::fs::write(dir.join("a/b/empty"), b"").unwrap();
        let big: Vec<u8> = (0..5 * (1 << 20) + 123)
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        std::fs::write(dir.join("big"), &big).unwrap();
        std::fs::write(dir.join("ro/file"), b"ro").unwrap();
        std::fs::set_permissions(dir.join("a/small"), std::fs::Permissions::from_mode(0o640))
            .unwrap();
        std::fs::set_permissions(dir.join("ro"), std::fs::Permissions::from_mode(0o555)).unwrap();
        std::os::unix::fs::symlink("small", dir.join("a/rel")).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", dir.join("escape")).unwrap();
    }

    #[test]
    fn stages_a_tree_then_restages_nothing_then_only_what_changed() {
        let tmp = tempfile::tempdir().unwrap();
        let (src, base) = (tmp.path().join("src"), tmp.path().join("scratch"));
        source(&src);
        let r = stage(
            &src,
            &base,
            Path::new("data"),
            &Options {
                verify: true,
                ..opts()
            },
        )
        .unwrap();
        let dst = base.join("data");
        assert_eq!((r.files, r.files_copied, r.symlinks), (4, 4, 2));
        assert!(r.verified);
        assert_eq!(checksums(&src).unwrap(), checksums(&dst).unwrap());
        // Symlinks are copied as symlinks, targets untouched.
        assert_eq!(
            std::fs::read_link(dst.join("escape")).unwrap(),
            Path::new("/etc/hostname")
        );
        assert!(
            std::fs::symlink_metadata(dst.join("escape"))
                .unwrap()
                .file_type()
                .is_symlink()
        );
        for rel in ["a/small", "big", "ro", "a"] {
            let (s, d) = (
                std::fs::metadata(src.join(rel)).unwrap(),
                std::fs::metadata(dst.join(rel)).unwrap(),
            );
            assert_eq!(s.mode(), d.mode(), "{rel}");
            assert_eq!(
                (s.mtime(), s.mtime_nsec()),
                (d.mtime(), d.mtime_nsec()),
                "{rel}"
            );
        }
        let m = status(&dst).unwrap();
        assert_eq!((m.files, m.source.as_path()), (4, src.as_path()));

        // Unchanged: nothing is written, not even a new marker.
        let marker = |p: &Path| {
            let m = std::fs::metadata(p.join(MARKER)).unwrap();
            (m.ino(), m.mtime(), m.mtime_nsec())
        };
        let before = marker(&dst);
        let again = stage(&src, &base, Path::new("data"), &opts()).unwrap();
        assert_eq!(marker(&dst), before);
        assert_eq!(
            (
                again.files_copied,
                again.files_unchanged,
                again.bytes_copied
            ),
            (0, 4, 0)
        );

        std::fs::write(src.join("a/small"), b"changed!").unwrap();
        let third = stage(&src, &base, Path::new("data"), &opts()).unwrap();
        assert_eq!(third.files_copied, 1);
        assert_eq!(std::fs::read(dst.join("a/small")).unwrap(), b"changed!");
    }

    #[test]
    fn a_directory_of_many_files_is_walked_in_runs_and_compared_whole() {
        let tmp = tempfile::tempdir().unwrap();
        let (src, base) = (tmp.path().join("src"), tmp.path().join("scratch"));
        std::fs::create_dir_all(src.join("sub")).unwrap();
        for i in 0..1000 {
            std::fs::write(src.join(format!("f{i:04}")), i.to_string()).unwrap();
        }
        for name in ["c", "a", "b"] {
            std::fs::write(src.join("sub").join(name), name).unwrap();
        }
        // One worker: the root's 1001 entries are statted in runs of 250.
        let plan = walk(&src, None, 1).unwrap();
        let rels: Vec<_> = plan.entries.iter().map(|e| e.rel.clone()).collect();
        let mut want = vec![PathBuf::new()];
        want.extend((0..1000).map(|i| PathBuf::from(format!("f{i:04}"))));
        want.push("sub".into());
        want.extend(["sub/a", "sub/b", "sub/c"].map(PathBuf::from));
        assert_eq!(rels, want);

        let r = stage(&src, &base, Path::new("d"), &opts()).unwrap();
        assert_eq!((r.files, r.files_copied), (1003, 1003));
        // Changes in the first, a middle and the last run of the big directory, and in sub.
        let dst = base.join("d");
        std::fs::write(src.join("f0000"), "changed").unwrap();
        std::fs::remove_file(dst.join("f0500")).unwrap();
        std::fs::write(dst.join("f0999"), "the job wrote this").unwrap();
        std::fs::write(src.join("sub/b"), "bb").unwrap();
        let r = stage(&src, &base, Path::new("d"), &opts()).unwrap();
        assert_eq!((r.files_copied, r.files_unchanged), (4, 999));
        assert_eq!(checksums(&src).unwrap(), checksums(&dst).unwrap());
    }

    #[test]
    fn a_partial_stage_is_not_complete_and_resumes() {
        let tmp = tempfile::tempdir().unwrap();
        let (src, base) = (tmp.path().join("src"), tmp.path().join("scratch"));
        source(&src);
        stage(&src, &base, Path::new(""), &opts()).unwrap();
        // As a killed stage leaves it: the marker gone, a file truncated with a fresh mtime.
        std::fs::remove_file(base.join(MARKER)).unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(base.join("big"))
            .unwrap()
            .set_len(10)
            .unwrap();
        assert!(status(&base).is_none());
        let r = stage(&src, &base, Path::new(""), &opts()).unwrap();
        assert_eq!(r.files_copied, 1);
        assert_eq!(checksums(&src).unwrap(), checksums(&base).unwrap());
        assert!(status(&base).is_some());
    }

    #[test]
    fn symlinks_in_the_destination_are_never_written_through() {
        let tmp = tempfile::tempdir().unwrap();
        let (src, base, outside) = (
            tmp.path().join("src"),
            tmp.path().join("scratch"),
            tmp.path().join("outside"),
        );
        source(&src);
        std::fs::create_dir_all(&base).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        // The destination's "a" is a symlink out of it, and "big" a symlink to a file outside.
        std::os::unix::fs::symlink(&outside, base.join("a")).unwrap();
        std::fs::write(outside.join("victim"), b"keep").unwrap();
        std::os::unix::fs::symlink(outside.join("victim"), base.join("big")).unwrap();
        stage(&src, &base, Path::new(""), &opts()).unwrap();
        assert_eq!(std::fs::read(outside.join("victim")).unwrap(), b"keep");
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 1);
        assert!(std::fs::symlink_metadata(base.join("a")).unwrap().is_dir());
        assert_eq!(checksums(&src).unwrap(), checksums(&base).unwrap());
        // A destination that names its way out is refused.
        let err = stage(&src, &base, Path::new("../x"), &opts())
            .unwrap_err()
            .to_string();
        assert!(err.contains(".."), "{err}");
    }

    #[test]
    fn a_cap_refuses_before_copying_with_needed_and_available() {
        let tmp = tempfile::tempdir().unwrap();
        let (src, base) = (tmp.path().join("src"), tmp.path().join("scratch"));
        source(&src);
        let err = stage(
            &src,
            &base,
            Path::new(""),
            &Options {
                cap: Some(1000),
                ..opts()
            },
        )
        .unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(
                err,
                StageError::NoSpace {
                    available: 1000,
                    ..
                }
            ),
            "{msg}"
        );
        assert!(
            msg.contains("1000 available") && msg.contains("needs 5243"),
            "{msg}"
        );
        assert!(!base.join("big").exists() && status(&base).is_none());
    }

    #[test]
    fn large_files_are_written_direct_to_the_byte_whole_or_in_chunks() {
        let tmp = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let src = tmp.path().join("src");
        std::fs::create_dir(&src).unwrap();
        // Unaligned sizes: the padded tail must be cut back exactly.
        for (name, len) in [("whole", (9 << 20) + 123), ("chunked", (20 << 20) + 77)] {
            let data: Vec<u8> = (0..len).map(|i: usize| (i * 13 % 251) as u8).collect();
            std::fs::write(src.join(name), data).unwrap();
        }
        for chunk in [64 << 20, 8 << 20] {
            let dst = tmp.path().join(format!("dst{chunk}"));
            let r = stage(
                &src,
                &dst,
                Path::new(""),
                &Options {
                    chunk_size: chunk,
                    ..opts()
                },
            )
            .unwrap();
            assert_eq!(r.files_copied, 2);
            assert_eq!(checksums(&src).unwrap(), checksums(&dst).unwrap());
            for name in ["whole", "chunked"] {
                assert_eq!(
                    std::fs::metadata(src.join(name)).unwrap().len(),
                    std::fs::metadata(dst.join(name)).unwrap().len()
                );
            }
        }
    }

    #[test]
    fn a_single_file_is_staged_under_its_name() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("model.bin");
        std::fs::write(&src, vec![3u8; 3 << 20]).unwrap();
        let r = stage(&src, tmp.path(), Path::new("out"), &opts()).unwrap();
        assert_eq!(r.files_copied, 1);
        assert_eq!(
            std::fs::read(tmp.path().join("out/model.bin")).unwrap(),
            vec![3u8; 3 << 20]
        );
    }

    #[test]
    fn copies_across_filesystems_by_the_read_write_fallback() {
        // /dev/shm (tmpfs) to the temp dir's filesystem: copy_file_range answers EXDEV between
        // filesystems of different types.
        let Ok(src) = tempfile::tempdir_in("/dev/shm") else {
            return;
        };
        let tmp = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        source(src.path());
        let r = stage(
            src.path(),
            tmp.path(),
            Path::new("x"),
            &Options {
                verify: true,
                ..opts()
            },
        )
        .unwrap();
        assert_eq!(r.files_copied, 4);
        assert_eq!(
            checksums(src.path()).unwrap(),
            checksums(&tmp.path().join("x")).unwrap()
        );
    }
}
