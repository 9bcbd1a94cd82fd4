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

pub mod cache;
mod copy;
mod fsops;
pub mod job;
mod marker;
mod progress;
mod request;
pub mod retain;
pub mod scratch;
pub(crate) mod tree;
mod user;
mod walk;

use self::copy::{Dest, hash_fd, open_dest, open_source};
pub use self::copy::{checksums, stage};
pub use self::marker::status;
use self::marker::write_marker;
pub use self::request::{stage_in, stage_out, stage_user};
pub use self::user::as_user;
pub use self::user::stage_as;
use self::walk::{sibling_groups, walk};

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};

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
    CacheDir(berth_sys::SysError),
    #[error("staging as uid {uid}: {message}")]
    Credentials { uid: u32, message: String },
    /// A failure reported by the staging child, already one line.
    #[error("{0}")]
    Child(String),
    #[error("scratch: cannot {op} {path}: {source}")]
    ScratchIo {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("scratch: job id {0:?} is not a plain name")]
    BadJobId(String),
    #[error("scratch root: {0}")]
    ScratchRoot(berth_sys::SysError),
    #[error("retention: cannot {op} {path}: {source}{hint}")]
    RetainIo {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
        hint: &'static str,
    },
    #[error("retention area: {0}")]
    RetainArea(berth_sys::SysError),
    /// What the caller may not ask for (another user's stage) or named wrongly: bad input.
    #[error("{0}")]
    Refused(String),
    /// One request of a job's staging (`--stage-in`/`--stage-out`) failed.
    #[error("{what}: {source}")]
    Request {
        what: String,
        source: Box<StageError>,
    },
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
    /// The owning group: the dataset cache keeps it on its copy, with the mode.
    gid: u32,
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
            size: st.st_size.cast_unsigned(),
            // setuid/setgid bits are dropped: a staged copy never gains privilege.
            mode: st.st_mode & 0o1777,
            gid: st.st_gid,
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

    /// A source tree: nested dirs, a read-only dir, a 5 MiB file (5 chunks), an empty file,
    /// a relative symlink and one pointing out of the tree.
    fn source(dir: &Path) {
        std::fs::create_dir_all(dir.join("a/b")).unwrap();
        std::fs::create_dir_all(dir.join("ro")).unwrap();
        std::fs::write(dir.join("a/small"), b"hello").unwrap();
        std::fs::write(dir.join("a/b/empty"), b"").unwrap();
        let big: Vec<u8> = (0..5 * (1 << 20) + 123)
            .map(|i| u8::try_from(i * 7 % 251).unwrap())
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
            let data: Vec<u8> = (0..len)
                .map(|i: usize| u8::try_from(i * 13 % 251).unwrap())
                .collect();
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
