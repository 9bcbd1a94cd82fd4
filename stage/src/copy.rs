//! The apply phase: opens the destination, makes its directories, copies the files the plan
//! says differ (in parallel, large files in chunks), then sets directory modes and mtimes,
//! verifies, syncs and writes the marker.

use std::io::Read;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use super::marker::{read_marker, write_marker};
use super::walk::{dir_exact, walk};
use super::{
    Entry, Kind, MARKER, Marker, Options, Plan, Report, StageError, XATTRS_OP, dest_err, fsops,
    parallel, progress,
};

/// The destination of a stage, open: its root directory, and whether it was there before (a
/// directory the stage did not make keeps its mode and owner: only what a stage makes gets the
/// source's modes).
pub(super) struct Dest {
    pub(super) fd: OwnedFd,
    pub(super) existed: bool,
    /// The base directory, and the components of `rel` this stage created in it (parents
    /// first): a failed stage removes them again when they are still empty.
    pub(super) base: OwnedFd,
    pub(super) created: Vec<PathBuf>,
}

impl Dest {
    /// After a failed stage: removes the directories it made, deepest first, those `inside`
    /// the destination (relative to it), then the destination's own components, each only while
    /// empty and each by fd beneath its parent without following a symlink. A failed stage
    /// left empty directories behind otherwise. What cannot be removed stays (logged at debug).
    pub(super) fn remove_made(&self, inside: &[PathBuf]) {
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
pub(super) fn open_dest(base: &Path, rel: &Path) -> Result<Dest, StageError> {
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
pub(super) fn stage_into(
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
    let dirs_exact = dirs_exact(&plan, root, existed, &dest_path)?;

    // Absolute in the report and the marker: `stage status` must name the source whatever the
    // directory it runs in.
    let source_abs = std::path::absolute(source).unwrap_or_else(|_| source.to_path_buf());
    let mut report = tally(&plan, &source_abs, &dest_path);

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
    check_space(root, opts.cap, report.bytes_copied, &dest_path)?;
    make_dirs(&plan, root, existed, &dest_path, made)?;

    let chunk = opts.chunk_size.max(1 << 20);
    let (tasks, chunks_left) = copy_tasks(&plan, root, chunk, &dest_path)?;
    phase(format_args!("{} copy tasks ready", tasks.len()));
    let way = fsops::CopyWay::default();
    progress::with_progress(
        opts,
        (report.files_unchanged, report.files),
        report.bytes_copied,
        |progress| {
            parallel(tasks.len(), opts.workers, |t| {
                let (i, off, len) = tasks[t];
                let e = &plan.entries[i];
                let to = Target {
                    root,
                    dest: &dest_path,
                    src: plan.src_path(&e.rel),
                    entry: e,
                };
                match e.kind {
                    Kind::Symlink => {
                        copy_symlink(&to)?;
                        progress.files.fetch_add(1, Ordering::Relaxed);
                    }
                    Kind::File => {
                        if copy_chunk(&to, (off, len), &chunks_left[i], &way, opts.xattrs)? {
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
    finish_dirs(&plan, root, existed, opts.xattrs, &dest_path)?;

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

impl Plan {
    /// The source path of the entry `rel`.
    fn src_path(&self, rel: &Path) -> PathBuf {
        if self.single_file {
            self.source.clone()
        } else {
            self.source.join(rel)
        }
    }
}

/// Whether every directory already has its final mode and mtime (a completed stage's state);
/// the root's mtime is not the source's: the marker, written last, changed it.
fn dirs_exact(
    plan: &Plan,
    root: &OwnedFd,
    existed: bool,
    dest_path: &Path,
) -> Result<bool, StageError> {
    let mut dirs_exact = plan.dirs_exact;
    if let Some(e) = plan.entries.first().filter(|e| e.kind == Kind::Dir) {
        let st =
            fsops::fstat(root).map_err(|err| dest_err("inspect", dest_path, Path::new(""), err))?;
        let root = Entry {
            mtime: (st.st_mtime, st.st_mtime_nsec),
            ..e.clone()
        };
        // A destination directory that was there keeps its mode: only its contents count.
        dirs_exact &= existed || dir_exact(&root, &st, e.mode | 0o700);
    }
    Ok(dirs_exact)
}

/// The report's counts for `plan`: what the source has and what is to be copied.
fn tally(plan: &Plan, source_abs: &Path, dest_path: &Path) -> Report {
    let mut report = Report {
        source: source_abs.to_path_buf(),
        dest: dest_path.to_path_buf(),
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
    report
}

/// Space: the bytes to copy must fit both the filesystem and the per-job cap.
fn check_space(
    root: &OwnedFd,
    cap: Option<u64>,
    needed: u64,
    dest_path: &Path,
) -> Result<(), StageError> {
    let free = fsops::available_bytes(root)
        .map_err(|e| dest_err("inspect", dest_path, Path::new(""), e))?;
    let (available, limit) = match cap {
        Some(cap) if cap < free => (cap, "per-job scratch cap"),
        _ => (free, "free space"),
    };
    if needed > available {
        return Err(StageError::NoSpace {
            dest: dest_path.to_path_buf(),
            needed,
            available,
            limit,
        });
    }
    Ok(())
}

/// Directories first (parents before children), writable by their owner until the end; those
/// made are recorded in `made`.
fn make_dirs(
    plan: &Plan,
    root: &OwnedFd,
    existed: bool,
    dest_path: &Path,
    made: &mut Vec<PathBuf>,
) -> Result<(), StageError> {
    let dest_err = |op, rel: &Path, source| dest_err(op, dest_path, rel, source);
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
    Ok(())
}

/// A copy task: (entry, offset, length).
type Task = (usize, u64, u64);

/// Tasks: one per small file or symlink, one per chunk of a large file (created and sized here),
/// with the chunks still to copy per entry (0 for a file copied whole).
fn copy_tasks(
    plan: &Plan,
    root: &OwnedFd,
    chunk: u64,
    dest_path: &Path,
) -> Result<(Vec<Task>, Vec<AtomicU64>), StageError> {
    let dest_err = |op, rel: &Path, source| dest_err(op, dest_path, rel, source);
    let mut tasks: Vec<Task> = Vec::new();
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
    Ok((tasks, chunks_left))
}

/// One entry a copy task writes: where it comes from and where it goes.
struct Target<'a> {
    root: &'a OwnedFd,
    dest: &'a Path,
    src: PathBuf,
    entry: &'a Entry,
}

impl Target<'_> {
    fn err(&self, op: &'static str, source: std::io::Error) -> StageError {
        dest_err(op, self.dest, &self.entry.rel, source)
    }
}

/// Recreates a symlink as a symlink, with the source's mtime.
fn copy_symlink(to: &Target) -> Result<(), StageError> {
    let (root, e) = (to.root, to.entry);
    let target = std::fs::read_link(&to.src).map_err(|err| StageError::Source {
        path: to.src.clone(),
        source: err,
    })?;
    remove_nondir(root, &e.rel).map_err(|err| to.err("remove", err))?;
    fsops::symlink_beneath(root, &target, &e.rel).map_err(|err| to.err("create", err))?;
    fsops::set_mtime_beneath(root, &e.rel, e.mtime).map_err(|err| to.err("set the mtime of", err))
}

/// Copies `(off, len)` of a file (the whole file when `chunks_left` is 0); `true` when this
/// completed the file (its mode and mtime set last).
fn copy_chunk(
    to: &Target,
    (off, len): (u64, u64),
    chunks_left: &AtomicU64,
    way: &fsops::CopyWay,
    xattrs: bool,
) -> Result<bool, StageError> {
    let (root, e) = (to.root, to.entry);
    let sfd = open_source(&to.src)?;
    let whole = chunks_left.load(Ordering::Relaxed) == 0;
    let dfd = if whole {
        create_file(root, &e.rel)
    } else {
        fsops::open_beneath(root, &e.rel, libc::O_WRONLY, 0)
    }
    .map_err(|err| to.err("create", err))?;
    fsops::copy_data(&sfd, &dfd, off, len, e.size, way).map_err(|err| match err.kind() {
        std::io::ErrorKind::UnexpectedEof => StageError::Source {
            path: to.src.clone(),
            source: err,
        },
        _ => to.err("write", err),
    })?;
    // The last chunk of a file completes it (mode and mtime set last).
    if !(whole || chunks_left.fetch_sub(1, Ordering::AcqRel) == 1) {
        return Ok(false);
    }
    if xattrs {
        fsops::copy_xattrs(&sfd, &dfd).map_err(|err| to.err(XATTRS_OP, err))?;
    }
    finish_file(&dfd, e).map_err(|err| to.err("set the mode of", err))?;
    Ok(true)
}

/// Directory modes and mtimes last, deepest first: creating entries changed their mtimes.
fn finish_dirs(
    plan: &Plan,
    root: &OwnedFd,
    existed: bool,
    xattrs: bool,
    dest_path: &Path,
) -> Result<(), StageError> {
    let dest_err = |op, rel: &Path, source| dest_err(op, dest_path, rel, source);
    for e in plan.entries.iter().rev().filter(|e| e.kind == Kind::Dir) {
        let fd = fsops::open_beneath(root, &e.rel, libc::O_RDONLY | libc::O_DIRECTORY, 0)
            .map_err(|err| dest_err("open", &e.rel, err))?;
        if xattrs {
            let sfd = open_source(&plan.src_path(&e.rel))?;
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
    Ok(())
}

pub(super) fn open_source(path: &Path) -> Result<OwnedFd, StageError> {
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
pub(super) fn create_file(root: &OwnedFd, rel: &Path) -> std::io::Result<OwnedFd> {
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

pub(super) fn remove_nondir(root: &OwnedFd, rel: &Path) -> std::io::Result<()> {
    fsops::unlink_beneath(root, rel)
}

pub(super) fn finish_file(fd: &OwnedFd, e: &Entry) -> std::io::Result<()> {
    fsops::fchmod(fd, e.mode)?;
    fsops::set_mtime_fd(fd, e.mtime)
}

pub(super) fn hash_fd(fd: OwnedFd) -> std::io::Result<u64> {
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

pub(super) fn verify(
    plan: &Plan,
    root: &OwnedFd,
    dest: &Path,
    workers: usize,
) -> Result<(), StageError> {
    let files: Vec<&Entry> = plan
        .entries
        .iter()
        .filter(|e| e.kind == Kind::File)
        .collect();
    parallel(files.len(), workers, |i| {
        let e = files[i];
        let src = plan.src_path(&e.rel);
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
