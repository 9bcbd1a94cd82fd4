//! Answers of the host-software checks kept per node in `<state_dir>/host-sw/<key>`, given back
//! while every file they were read from is as it was: a step's start then stats a few files
//! (each opened beneath its root, following no symlink) instead of reading megabytes of them —
//! the host's libc.so.6, and the image's, from a squashfs that is decompressed anew at every
//! mount. A file is "as it was" when its inode, size, mtime, ctime and type are (a user can set
//! a file's mtime, not its ctime); not its device, which changes with each mount of a squashfs
//! image. A store image's layer, mounted at a path named by its content's digest, is in the key
//! by that path and nothing beneath it is checked again; any other root (a user's directory
//! image, attached at another path for each container) by its device and inode, its files
//! checked at each recall. Only root writes here: the directory is berth's, 0700, checked.

use std::fs::File;
use std::hash::{Hash, Hasher};
use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// The directory of the answers, in the state directory.
pub(crate) const DIR: &str = "host-sw";

/// The most bytes of an answer's file read back.
const MEMO_MAX: u64 = 64 << 10;

/// How recent a change keeps an answer from being kept, in nanoseconds.
const RACY_NS: i128 = 1_000_000_000;

/// What a file is, as far as an answer read from it cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Sig {
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
    mode: u32,
}

impl Sig {
    fn of(st: &nix::sys::stat::FileStat) -> Sig {
        Sig {
            ino: st.st_ino,
            size: u64::try_from(st.st_size).unwrap_or(0),
            mtime: (st.st_mtime, st.st_mtime_nsec),
            ctime: (st.st_ctime, st.st_ctime_nsec),
            mode: st.st_mode & libc::S_IFMT,
        }
    }

    pub(crate) fn of_meta(m: &std::fs::Metadata) -> Sig {
        Sig {
            ino: m.ino(),
            size: m.size(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
            mode: m.mode() & libc::S_IFMT,
        }
    }

    fn text(sig: Option<Sig>) -> String {
        match sig {
            Some(s) => format!(
                "{}:{}:{}.{}:{}.{}:{:o}",
                s.ino, s.size, s.mtime.0, s.mtime.1, s.ctime.0, s.ctime.1, s.mode
            ),
            None => "-".to_string(),
        }
    }
}

/// The signature of an opened file (taken before it is read: a change while it is read then
/// shows as a changed file at the next recall).
pub(crate) fn sig_of(fd: impl AsFd) -> Option<Sig> {
    nix::sys::stat::fstat(fd).ok().map(|st| Sig::of(&st))
}

/// The signature of `rel` beneath `root` (O_PATH, no symlink followed: a symlink is itself);
/// `None` when nothing is there or the root is not open.
pub(crate) fn sig_beneath(root: Option<&File>, rel: &Path) -> Option<Sig> {
    use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
    // openat2 takes no flag beside these with O_PATH (privfs::open_beneath adds O_NOCTTY).
    let how = OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS);
    let rel = rel.strip_prefix("/").unwrap_or(rel);
    sig_of(nix::fcntl::openat2(root?, rel, how).ok()?)
}

/// The signature of the host's `path`, symlinks followed as a bind of it follows them: for the
/// paths the site's configuration names (no user's or image's path ever comes here).
pub(crate) fn sig_host(path: &Path) -> Option<Sig> {
    std::fs::metadata(path).ok().map(|m| Sig::of_meta(&m))
}

/// The root index a host path ([`Inputs::note_host`]) is kept under.
const HOST: usize = usize::MAX;

/// The files an answer was read from: (index of the root, path beneath it, signature); none
/// of a root that cannot change ([`fixed_roots`]).
#[derive(Debug, Default)]
pub(crate) struct Inputs {
    list: Vec<(usize, String, Option<Sig>)>,
    fixed: Vec<bool>,
}

impl Inputs {
    /// Inputs beneath roots of which those `fixed` marks are not noted.
    pub(crate) fn new(fixed: Vec<bool>) -> Inputs {
        Inputs {
            list: Vec::new(),
            fixed,
        }
    }

    /// Notes the host's absolute `path` as [`sig_host`] saw it.
    pub(crate) fn note_host(&mut self, path: &Path, sig: Option<Sig>) {
        self.list
            .push((HOST, path.to_string_lossy().into_owned(), sig));
    }

    pub(crate) fn note(&mut self, root: usize, rel: &Path, sig: Option<Sig>) {
        if !self.fixed.get(root).copied().unwrap_or(false) {
            self.list
                .push((root, rel.to_string_lossy().into_owned(), sig));
        }
    }
}

/// What names each of `roots` (opened as `dirs`) in an answer's key: a fixed root's path (its
/// digest); another's device and inode, which stay when the same directory is attached at
/// another path for each container (a user's directory image).
pub(crate) fn root_ids(roots: &[PathBuf], dirs: &[Option<File>], fixed: &[bool]) -> Vec<String> {
    roots
        .iter()
        .enumerate()
        .map(|(i, root)| {
            if fixed.get(i).copied().unwrap_or(false) {
                return root.display().to_string();
            }
            match dirs
                .get(i)
                .and_then(|d| d.as_ref())
                .map(nix::sys::stat::fstat)
            {
                Some(Ok(st)) => format!("{}:{}", st.st_dev, st.st_ino),
                _ => format!("missing {}", root.display()),
            }
        })
        .collect()
}

/// Which of `roots` cannot change under a kept answer: a squashfs image mounted read-only at
/// `<squashfs.mount_dir>/<sha256 of its content>`, where berth mounts the store's images and
/// the files root names (a user's own file or directory is mounted elsewhere, and checked file
/// by file). Such a root's answer is recalled by its path alone: nothing beneath it is read.
pub(crate) fn fixed_roots(mount_dir: &Path, roots: &[PathBuf]) -> Vec<bool> {
    let mut canonical = None;
    roots
        .iter()
        .map(|root| {
            let digest_named = root.file_name().is_some_and(|n| {
                n.len() == 64 && n.as_encoded_bytes().iter().all(|b| b.is_ascii_hexdigit())
            });
            let Some(parent) = root.parent().filter(|_| digest_named) else {
                return false;
            };
            parent == mount_dir
                || Some(parent)
                    == canonical
                        .get_or_insert_with(|| std::fs::canonicalize(mount_dir).ok())
                        .as_deref()
        })
        .collect()
}

/// One answer's place: `<state_dir>/host-sw/<hash of kind and key>`; `None` when the
/// directory is not usable (then nothing is kept and everything is read each time).
pub(crate) struct Memo {
    file: Option<PathBuf>,
}

impl Memo {
    pub(crate) fn new(state_dir: &Path, kind: &str, key: impl Hash) -> Memo {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (kind, key).hash(&mut h);
        let dir = state_dir.join(DIR);
        let file = own_dir(&dir)
            .map_err(|e| tracing::debug!("{}: {e}: host-software checks not kept", dir.display()))
            .ok()
            .map(|()| dir.join(format!("{kind}-{:016x}", h.finish())));
        Memo { file }
    }

    /// The answer kept, when each file it names is as it was beneath `roots` (opened in the
    /// order of the key's roots).
    pub(crate) fn recall(&self, roots: &[Option<File>]) -> Option<String> {
        let path = self.file.as_ref()?;
        let flags = nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_NOFOLLOW;
        let fd = nix::fcntl::open(path, flags, nix::sys::stat::Mode::empty()).ok()?;
        let text = berth_sys::privfs::read_bounded(&mut File::from(fd), MEMO_MAX).ok()?;
        let text = String::from_utf8(text).ok()?;
        let mut answer = None;
        for line in text.lines() {
            if let Some(a) = line.strip_prefix("answer ") {
                answer = Some(a.to_string());
                continue;
            }
            let mut words = line.strip_prefix("in ")?.splitn(3, ' ');
            let root = words.next()?;
            let sig = words.next()?;
            let rel = Path::new(words.next()?);
            let now = if root == "h" {
                sig_host(rel)
            } else {
                sig_beneath(roots.get(root.parse::<usize>().ok()?)?.as_ref(), rel)
            };
            if Sig::text(now) != sig {
                return None;
            }
        }
        answer
    }

    /// Keeps `answer` with the files it was read from (not when a name cannot be written on
    /// one line: an image's odd file name is read each time).
    pub(crate) fn keep(&self, inputs: &Inputs, answer: &str) {
        let Some(path) = &self.file else {
            return;
        };
        if answer.contains('\n') || inputs.list.iter().any(|(_, rel, _)| rel.contains('\n')) {
            return;
        }
        // A file changed within the clock's granularity of the read could change again with
        // the same ctime (racy git's problem): such an answer is read again next time.
        let nanos = |(s, ns): (i64, i64)| i128::from(s) * 1_000_000_000 + i128::from(ns);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i128::try_from(d.as_nanos()).unwrap_or(i128::MAX));
        if inputs
            .list
            .iter()
            .flat_map(|(_, _, s)| s)
            .any(|s| nanos(s.ctime) > now - RACY_NS)
        {
            return;
        }
        let mut text = format!("answer {answer}\n");
        for (root, rel, sig) in &inputs.list {
            let root = if *root == HOST {
                "h".to_string()
            } else {
                root.to_string()
            };
            text.push_str(&format!("in {root} {} {rel}\n", Sig::text(*sig)));
        }
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let written = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .and_then(|()| std::fs::rename(&tmp, path));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            tracing::debug!("keeping {}: {e}", path.display());
        }
    }
}

/// Makes `dir` (0700) unless it exists, and accepts it only as a directory of the effective
/// user's that no one else can write.
pub(crate) fn own_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let meta = std::fs::symlink_metadata(dir)?;
    if !meta.is_dir() || meta.uid() != nix::unistd::geteuid().as_raw() || meta.mode() & 0o022 != 0 {
        return Err(std::io::Error::other(
            "not a directory of berth's that only berth writes",
        ));
    }
    Ok(())
}

/// Removes the answers not written or recalled for `max_age` (each is read again when next
/// needed), and the directory once it is empty; returns how many. A node that never kept an
/// answer gets no directory from this.
pub(crate) fn reclaim(state_dir: &Path, max_age: std::time::Duration) -> usize {
    let dir = state_dir.join(DIR);
    if std::fs::symlink_metadata(&dir).is_err() || own_dir(&dir).is_err() {
        return 0;
    }
    let now = std::time::SystemTime::now();
    let mut removed = 0;
    for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        let old = entry
            .metadata()
            .ok()
            .and_then(|m| m.accessed().ok().max(m.modified().ok()))
            .and_then(|t| now.duration_since(t).ok())
            .is_some_and(|age| age > max_age);
        if old && std::fs::remove_file(entry.path()).is_ok() {
            removed += 1;
        }
    }
    // Fails while an answer is kept (or one is being written): the directory stays.
    let _ = std::fs::remove_dir(&dir);
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reclaim_makes_no_directory_and_removes_old_answers_then_the_empty_one() {
        let state = tempfile::tempdir().unwrap();
        let dir = state.path().join(DIR);
        assert_eq!(reclaim(state.path(), std::time::Duration::ZERO), 0);
        assert!(!dir.exists(), "reclaim made {}", dir.display());
        own_dir(&dir).unwrap();
        let (old, fresh) = (dir.join("glibc-old"), dir.join("glibc-fresh"));
        std::fs::write(&old, "x").unwrap();
        std::fs::write(&fresh, "x").unwrap();
        let long_ago = nix::sys::time::TimeSpec::new(1_000_000_000, 0);
        nix::sys::stat::utimensat(
            nix::fcntl::AT_FDCWD,
            &old,
            &long_ago,
            &long_ago,
            nix::sys::stat::UtimensatFlags::NoFollowSymlink,
        )
        .unwrap();
        let day = std::time::Duration::from_secs(86_400);
        assert_eq!(reclaim(state.path(), day), 1);
        assert!(!old.exists() && fresh.exists() && dir.is_dir());
        assert_eq!(reclaim(state.path(), std::time::Duration::ZERO), 1);
        assert!(!dir.exists(), "an empty {} stays", dir.display());
    }

    #[test]
    fn an_answer_is_recalled_only_while_its_files_are_unchanged() {
        let state = tempfile::tempdir().unwrap();
        let root = tempfile::tempdir().unwrap();
        std::fs::write(root.path().join("f"), "one").unwrap();
        let roots = [File::open(root.path()).ok()];
        let memo = Memo::new(state.path(), "t", root.path());
        let note = |inputs: &mut Inputs| {
            let f = File::open(root.path().join("f")).unwrap();
            inputs.note(0, Path::new("f"), sig_of(&f));
            inputs.note(
                0,
                Path::new("absent"),
                sig_beneath(roots[0].as_ref(), Path::new("absent")),
            );
        };
        // Just written: not kept (its ctime could repeat).
        let mut inputs = Inputs::default();
        note(&mut inputs);
        memo.keep(&inputs, "42");
        assert_eq!(memo.recall(&roots), None);
        std::thread::sleep(std::time::Duration::from_millis(1100));
        let mut inputs = Inputs::default();
        note(&mut inputs);
        memo.keep(&inputs, "42");
        assert_eq!(memo.recall(&roots).as_deref(), Some("42"));
        // Another key, another answer.
        assert_eq!(Memo::new(state.path(), "t", "other").recall(&roots), None);
        // A file appearing where none was, or one rewritten in place, voids it.
        std::fs::write(root.path().join("absent"), "").unwrap();
        assert_eq!(memo.recall(&roots), None);
        std::fs::remove_file(root.path().join("absent")).unwrap();
        assert_eq!(memo.recall(&roots).as_deref(), Some("42"));
        std::fs::write(root.path().join("f"), "two").unwrap();
        assert_eq!(memo.recall(&roots), None);
        // A symlink in the root is itself, never what it names.
        std::fs::remove_file(root.path().join("f")).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", root.path().join("f")).unwrap();
        let link = sig_beneath(roots[0].as_ref(), Path::new("f")).unwrap();
        assert_eq!(link.mode, libc::S_IFLNK);
        // A state directory another user could write is not used.
        let open = tempfile::tempdir().unwrap();
        std::fs::create_dir(open.path().join(DIR)).unwrap();
        let perm = std::os::unix::fs::PermissionsExt::from_mode(0o777);
        std::fs::set_permissions(open.path().join(DIR), perm).unwrap();
        assert!(Memo::new(open.path(), "t", 1).file.is_none());
    }

    #[test]
    fn only_digest_named_mounts_of_the_mount_directory_are_fixed() {
        let mounts = tempfile::tempdir().unwrap();
        let hex = "ab".repeat(32);
        let roots = [
            mounts.path().join(&hex),
            mounts.path().join("u1000").join(&hex),
            mounts.path().join("dirs/1-0"),
            mounts.path().join(&hex[1..]),
            PathBuf::from("/"),
        ];
        assert_eq!(
            fixed_roots(mounts.path(), &roots),
            [true, false, false, false, false]
        );
        // Through a symlink to the mount directory too (lowers are its real path).
        let link = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(mounts.path(), link.path().join("m")).unwrap();
        assert_eq!(fixed_roots(&link.path().join("m"), &roots[..1]), [true]);
        // Another root is named by what it is, not where: the same directory through another
        // path has the same key.
        let dirs = [
            File::open(mounts.path()).ok(),
            File::open(link.path().join("m")).ok(),
        ];
        let ids = root_ids(
            &[mounts.path().to_path_buf(), link.path().join("m")],
            &dirs,
            &[false, false],
        );
        assert_eq!(ids[0], ids[1]);
        assert_eq!(
            root_ids(&roots[..1], &[None], &[true]),
            [roots[0].display().to_string()]
        );
        // Nothing beneath a fixed root is noted: its answer is kept at once.
        let mut inputs = Inputs::new(vec![true, false]);
        inputs.note(0, Path::new("usr/lib64/libc.so.6"), None);
        assert!(inputs.list.is_empty());
        inputs.note(1, Path::new("usr/lib64/libc.so.6"), None);
        assert_eq!(inputs.list.len(), 1);
    }
}
