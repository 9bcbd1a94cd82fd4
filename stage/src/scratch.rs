//! Per-job scratch directories under a node-local root: created for the job user before the
//! job, measured against a per-job cap while staging, and removed after it even when the job
//! left read-only trees behind, or later ([`reclaim`]) when no Epilog ran. Next to a scratch,
//! root-owned, the Prolog records why the job's stage-in failed, for the plugin to fail its
//! steps with ([`record_failure`]).
//!
//! The scratch root is a directory berth relies on ([`berth_sys::privfs::root_dir`]: root's all the
//! way from `/`, 0755, refused in one line otherwise), and everything in it is done by fd beneath
//! the root's fd: a job's directory is made there by root and given to the user; whatever the
//! user left or swapped in is removed without following a symlink ([`super::tree`]).

use std::ffi::CString;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use super::{fsops, tree};
use crate::StageError;

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> StageError + 'a {
    move |source| StageError::ScratchIo {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// The scratch directory of `job_id` under `root`.
pub fn path(root: &Path, job_id: &str) -> Result<PathBuf, StageError> {
    if job_id.is_empty()
        || job_id == "."
        || job_id == ".."
        || job_id.contains('/')
        || job_id.contains('\0')
    {
        return Err(StageError::BadJobId(job_id.to_string()));
    }
    Ok(root.join(job_id))
}

fn c_name(name: &str) -> Result<CString, StageError> {
    CString::new(name).map_err(|_| StageError::BadJobId(name.to_string()))
}

/// Opens the scratch root, making it (root's, 0755) if missing; refuses one that another user
/// owns or could change, or a symlink, in one line.
pub fn open_root(root: &Path) -> Result<OwnedFd, StageError> {
    berth_sys::privfs::root_dir(root, 0o755).map_err(StageError::ScratchRoot)
}

/// Creates `root/job_id`, mode 0700, owned by `uid:gid`, made by root beneath the root's fd. A
/// directory already there of this very user and group is kept (a Prolog run twice for one job
/// does not lose data); anything else left there (another user's directory, a file, a symlink)
/// is removed without being followed and made anew: never handed over, never a failure. `cap`
/// is not enforced by the filesystem; staging checks it ([`remaining`]).
pub fn create(
    root: &Path,
    job_id: &str,
    uid: u32,
    gid: u32,
    _cap: Option<u64>,
) -> Result<PathBuf, StageError> {
    // Two Prologs of one job on one host (several slurmd, or a Prolog run again while the
    // first is still busy) race here: one may see the other's directory half made (root's,
    // before its chown) and replace it, so the other's open or mkdir misses. Each step is
    // safe to repeat, and the loser then finds the directory the winner finished.
    let mut attempt = 0;
    loop {
        match create_once(root, job_id, uid, gid) {
            Err(StageError::ScratchIo { source, .. })
                if attempt < 3
                    && matches!(source.raw_os_error(), Some(libc::ENOENT | libc::EEXIST)) =>
            {
                attempt += 1;
            }
            other => return other,
        }
    }
}

fn create_once(root: &Path, job_id: &str, uid: u32, gid: u32) -> Result<PathBuf, StageError> {
    let dir = path(root, job_id)?;
    let name = c_name(job_id)?;
    let rfd = open_root(root)?;
    let kept = match fsops::lstat_at(&rfd, &name).map_err(io("inspect", &dir))? {
        Some(st)
            if st.st_mode & libc::S_IFMT == libc::S_IFDIR
                && (st.st_uid, st.st_gid) == (uid, gid) =>
        {
            true
        }
        Some(_) => {
            tree::remove_at(&rfd, &name).map_err(io("remove the leftover", &dir))?;
            false
        }
        None => false,
    };
    let mut adopt = false;
    if !kept {
        let mode = nix::sys::stat::Mode::from_bits_retain(0o700);
        if let Err(e) = nix::sys::stat::mkdirat(&rfd, name.as_c_str(), mode) {
            let e = std::io::Error::from(e);
            // Another Prolog of this job made it between our look and mkdir (two slurmd of one
            // host, or a Prolog run twice at once): the directory is then root's or already
            // the user's, and only root can make either in the root-owned scratch root.
            if e.raw_os_error() != Some(libc::EEXIST) {
                return Err(io("create", &dir)(e));
            }
            adopt = true;
        }
    }
    let fd = tree::open_dir_at(&rfd, &name).map_err(io("open", &dir))?;
    if adopt {
        let st = fsops::fstat(&fd).map_err(io("inspect", &dir))?;
        let owner = (st.st_uid, st.st_gid);
        if owner != (0, 0) && owner != (uid, gid) {
            return Err(io("take", &dir)(std::io::Error::other(format!(
                "made meanwhile and owned by {}:{}, not root or the job's user",
                owner.0, owner.1
            ))));
        }
    }
    if !kept {
        fsops::fchown(&fd, uid, gid).map_err(io("chown", &dir))?;
    }
    fsops::fchmod(&fd, 0o700).map_err(io("chmod", &dir))?;
    Ok(dir)
}

/// Removes `root/job_id` and everything in it, by fd beneath the root and without following a
/// symlink, whatever the job renamed meanwhile; a missing directory is not an error.
pub fn remove(root: &Path, job_id: &str) -> Result<(), StageError> {
    let dir = path(root, job_id)?;
    let name = c_name(job_id)?;
    if matches!(std::fs::symlink_metadata(root), Err(e) if e.kind() == std::io::ErrorKind::NotFound)
    {
        return Ok(());
    }
    let rfd = open_root(root)?;
    tree::remove_at(&rfd, &name).map_err(io("remove", &dir))
}

/// Moves the scratch of `job_id` aside, within the root, as `<job>.kept-<now>` (out of the way of
/// [`reclaim`], which takes only job ids); returns where it is.
pub fn set_aside(root: &Path, job_id: &str, now: u64) -> Result<PathBuf, StageError> {
    let from = c_name(path(root, job_id).map(|_| job_id)?)?;
    let to_name = format!("{job_id}.kept-{now}");
    let to = c_name(&to_name)?;
    let rfd = open_root(root)?;
    nix::fcntl::renameat2(
        &rfd,
        from.as_c_str(),
        &rfd,
        to.as_c_str(),
        nix::fcntl::RenameFlags::RENAME_NOREPLACE,
    )
    .map_err(|e| io("move aside", &root.join(job_id))(e.into()))?;
    Ok(root.join(to_name))
}

/// Bytes used by the files under `dir` (allocated blocks), walked by fd without following a
/// symlink. `dir` is a job's scratch (under the root-owned scratch root) or a directory the
/// caller named.
pub fn usage(dir: &Path) -> Result<u64, StageError> {
    let fd = nix::fcntl::open(
        dir,
        nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_DIRECTORY | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(|e| io("list", dir)(e.into()))?;
    tree::usage_at(&fd).map_err(io("measure", dir))
}

/// What a scratch directory may still take under a per-job cap: pass it as
/// [`super::Options::cap`].
pub fn remaining(dir: &Path, cap: u64) -> Result<u64, StageError> {
    Ok(cap.saturating_sub(usage(dir)?))
}

/// Where the Prolog records a failed stage-in of `job_id`: a root-owned file beside the scratch
/// (the spank plugin reads it by the same rule).
pub fn failure_path(root: &Path, job_id: &str) -> Result<PathBuf, StageError> {
    Ok(path(root, job_id)?.with_file_name(format!("{job_id}.stage-in-failed")))
}

fn failure_name(job_id: &str) -> Result<CString, StageError> {
    path(Path::new("/"), job_id)?;
    c_name(&format!("{job_id}.stage-in-failed"))
}

/// Records `line` as the reason the job's stage-in failed; written whole or not at all, by fd
/// beneath the scratch root.
pub fn record_failure(root: &Path, job_id: &str, line: &str) -> Result<(), StageError> {
    let dest = failure_path(root, job_id)?;
    let name = failure_name(job_id)?;
    let tmp = c_name(&format!("{job_id}.stage-in-failed.tmp"))?;
    let rfd = open_root(root)?;
    let _ = tree::remove_at(&rfd, &tmp);
    let fd = fsops::open_at(
        &rfd,
        &tmp,
        libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
        0o644,
    )
    .map_err(io("write", &dest))?;
    std::fs::File::from(fd)
        .write_all(format!("{line}\n").as_bytes())
        .map_err(io("write", &dest))?;
    nix::fcntl::renameat(&rfd, tmp.as_c_str(), &rfd, name.as_c_str())
        .map_err(|e| io("rename", &dest)(e.into()))
}

/// The recorded reason the job's stage-in failed, if it did (one line, read bounded).
pub fn failure(root: &Path, job_id: &str) -> Option<String> {
    let name = failure_name(job_id).ok()?;
    let rfd = berth_sys::privfs::root_dir(root, 0o755).ok()?;
    let fd = fsops::open_at(&rfd, &name, libc::O_RDONLY | libc::O_NONBLOCK, 0).ok()?;
    let mut file = std::fs::File::from(fd);
    let text = berth_sys::privfs::read_bounded(&mut file, 64 * 1024).ok()?;
    Some(String::from_utf8_lossy(&text).trim_end().to_string())
}

/// Removes the job's stage-in failure record; none is no error.
pub fn clear_failure(root: &Path, job_id: &str) -> Result<(), StageError> {
    let p = failure_path(root, job_id)?;
    let name = failure_name(job_id)?;
    if matches!(std::fs::symlink_metadata(root), Err(e) if e.kind() == std::io::ErrorKind::NotFound)
    {
        return Ok(());
    }
    let rfd = open_root(root)?;
    tree::remove_at(&rfd, &name).map_err(io("remove", &p))
}

/// Removes the scratch (and failure record) of every job under `root` that `live` says is not
/// running: what jobs left when their Epilog never ran (slurmd killed, node rebooted). Only
/// names that are job ids are touched. Returns the job ids reclaimed.
pub fn reclaim(root: &Path, live: impl Fn(&str) -> bool) -> Result<Vec<String>, StageError> {
    let mut reclaimed = Vec::new();
    if matches!(std::fs::symlink_metadata(root), Err(e) if e.kind() == std::io::ErrorKind::NotFound)
    {
        return Ok(reclaimed);
    }
    let rfd = open_root(root)?;
    for name in tree::list(&rfd).map_err(io("list", root))? {
        let name = name.to_string_lossy().into_owned();
        let job = name.strip_suffix(".stage-in-failed").unwrap_or(&name);
        if job.is_empty() || !job.bytes().all(|b| b.is_ascii_digit()) || live(job) {
            continue;
        }
        if job == name {
            remove(root, job)?;
            reclaimed.push(name);
        } else {
            clear_failure(root, job)?;
        }
    }
    Ok(reclaimed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    #[test]
    fn job_ids_cannot_leave_the_root() {
        let root = Path::new("/scratch");
        assert_eq!(path(root, "123").unwrap(), Path::new("/scratch/123"));
        for bad in ["", ".", "..", "../etc", "a/b"] {
            assert!(path(root, bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn remove_empties_read_only_trees_without_following_symlinks() {
        let tmp = tempfile::tempdir().unwrap();
        let outside = tmp.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("keep"), b"x").unwrap();
        let uid = nix::unistd::Uid::current().as_raw();
        let gid = nix::unistd::Gid::current().as_raw();
        let root = tmp.path().join("root");
        let dir = create(&root, "42", uid, gid, None).unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o7777, 0o700);
        std::fs::create_dir_all(dir.join("a/b")).unwrap();
        std::fs::write(dir.join("a/b/f"), b"data").unwrap();
        std::os::unix::fs::symlink(&outside, dir.join("a/link")).unwrap();
        std::fs::set_permissions(dir.join("a/b"), std::fs::Permissions::from_mode(0o500)).unwrap();
        std::fs::set_permissions(dir.join("a"), std::fs::Permissions::from_mode(0o500)).unwrap();
        assert!(usage(&dir).unwrap() > 0);
        remove(&root, "42").unwrap();
        assert!(!dir.exists());
        assert!(outside.join("keep").exists());
        remove(&root, "42").unwrap();
    }

    #[test]
    fn reclaim_removes_only_scratch_of_jobs_that_are_not_live() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        let uid = nix::unistd::Uid::current().as_raw();
        let gid = nix::unistd::Gid::current().as_raw();
        for job in ["7", "8", "9"] {
            let d = create(root, job, uid, gid, None).unwrap();
            std::fs::write(d.join("result"), b"r").unwrap();
        }
        record_failure(root, "8", "berth: job 8: stage-in failed").unwrap();
        record_failure(root, "9", "berth: job 9: stage-in failed").unwrap();
        assert_eq!(failure(root, "8").unwrap(), "berth: job 8: stage-in failed");
        std::fs::create_dir(root.join("retained")).unwrap();
        let mut got = reclaim(root, |job| job == "9").unwrap();
        got.sort();
        assert_eq!(got, ["7", "8"]);
        assert!(!root.join("7").exists() && !root.join("8").exists());
        assert!(failure(root, "8").is_none());
        assert!(
            root.join("9/result").exists(),
            "a live job's scratch was removed"
        );
        assert!(failure(root, "9").is_some());
        assert!(root.join("retained").exists(), "not a job id");
        clear_failure(root, "9").unwrap();
        clear_failure(root, "9").unwrap();
        assert!(
            reclaim(&root.join("missing"), |_| false)
                .unwrap()
                .is_empty()
        );
    }
}
