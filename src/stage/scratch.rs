//! Per-job scratch directories under a node-local root: created for the job user before the
//! job, measured against a per-job cap while staging, and removed after it even when the job
//! left read-only trees behind, or later ([`reclaim`]) when no Epilog ran. Next to a scratch,
//! root-owned, the Prolog records why the job's stage-in failed, for the plugin to fail its
//! steps with ([`record_failure`]).

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum ScratchError {
    #[error("scratch: cannot {op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("scratch: job id {0:?} is not a plain name")]
    BadJobId(String),
    #[error("scratch: {path} exists and is not a directory owned by uid {uid}; remove it")]
    Foreign { path: PathBuf, uid: u32 },
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> ScratchError + 'a {
    move |source| ScratchError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// The scratch directory of `job_id` under `root`.
pub fn path(root: &Path, job_id: &str) -> Result<PathBuf, ScratchError> {
    if job_id.is_empty()
        || job_id == "."
        || job_id == ".."
        || job_id.contains('/')
        || job_id.contains('\0')
    {
        return Err(ScratchError::BadJobId(job_id.to_string()));
    }
    Ok(root.join(job_id))
}

/// Creates `root/job_id`, mode 0700, owned by `uid:gid` (the root itself is made 0755 and owned
/// by whoever creates it). An existing directory already owned by the user is kept: a Prolog run
/// twice for one job does not lose data. `cap` is not enforced by the filesystem; staging checks
/// it ([`remaining`]).
pub fn create(
    root: &Path,
    job_id: &str,
    uid: u32,
    gid: u32,
    _cap: Option<u64>,
) -> Result<PathBuf, ScratchError> {
    let dir = path(root, job_id)?;
    create_dirs(root, 0o755).map_err(io("create", root))?;
    match std::fs::create_dir(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let meta = std::fs::symlink_metadata(&dir).map_err(io("inspect", &dir))?;
            if !meta.is_dir() || meta.uid() != uid {
                return Err(ScratchError::Foreign { path: dir, uid });
            }
        }
        Err(e) => return Err(io("create", &dir)(e)),
    }
    std::os::unix::fs::lchown(&dir, Some(uid), Some(gid)).map_err(io("chown", &dir))?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
        .map_err(io("chmod", &dir))?;
    Ok(dir)
}

/// Creates `dir` and its missing parents, each with `mode` whatever the umask: under a
/// Prolog's umask of 077 they were made 0700, and no user could reach a job's directory below.
/// Existing directories are left as the admin made them.
pub(crate) fn create_dirs(dir: &Path, mode: u32) -> std::io::Result<()> {
    let missing: Vec<&Path> = dir
        .ancestors()
        .take_while(|a| !a.as_os_str().is_empty() && !a.is_dir())
        .collect();
    for d in missing.into_iter().rev() {
        match std::fs::create_dir(d) {
            Ok(()) => std::fs::set_permissions(d, std::fs::Permissions::from_mode(mode))?,
            // Another Prolog made it meanwhile.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Removes `root/job_id` and everything in it. Directories the job made read-only are made
/// writable first; symlinks are removed, never followed; a missing directory is not an error.
pub fn remove(root: &Path, job_id: &str) -> Result<(), ScratchError> {
    let dir = path(root, job_id)?;
    match std::fs::symlink_metadata(&dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io("inspect", &dir)(e)),
        Ok(m) if !m.is_dir() => return std::fs::remove_file(&dir).map_err(io("remove", &dir)),
        Ok(_) => {}
    }
    remove_tree(&dir)
}

pub(crate) fn remove_tree(dir: &Path) -> Result<(), ScratchError> {
    // u+rwx so that it can be listed and emptied; the tree may have been left 0500 by the job.
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .map_err(io("chmod", dir))?;
    for item in std::fs::read_dir(dir).map_err(io("list", dir))? {
        let item = item.map_err(io("list", dir))?;
        let p = item.path();
        // file_type() does not follow symlinks: a symlink to a directory is unlinked, not walked.
        if item.file_type().map_err(io("inspect", &p))?.is_dir() {
            remove_tree(&p)?;
        } else {
            std::fs::remove_file(&p).map_err(io("remove", &p))?;
        }
    }
    std::fs::remove_dir(dir).map_err(io("remove", dir))
}

/// Bytes used by the files under `dir` (allocated blocks, not following symlinks).
pub fn usage(dir: &Path) -> Result<u64, ScratchError> {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for item in std::fs::read_dir(&d).map_err(io("list", &d))? {
            let item = item.map_err(io("list", &d))?;
            let meta = item.metadata().map_err(io("inspect", &item.path()))?;
            total += meta.blocks() * 512;
            if meta.is_dir() {
                stack.push(item.path());
            }
        }
    }
    Ok(total)
}

/// What a scratch directory may still take under a per-job cap: pass it as
/// [`super::Options::cap`].
pub fn remaining(dir: &Path, cap: u64) -> Result<u64, ScratchError> {
    Ok(cap.saturating_sub(usage(dir)?))
}

/// Where the Prolog records a failed stage-in of `job_id`: a root-owned file beside the scratch
/// (the spank plugin reads it by the same rule).
pub fn failure_path(root: &Path, job_id: &str) -> Result<PathBuf, ScratchError> {
    Ok(path(root, job_id)?.with_file_name(format!("{job_id}.stage-in-failed")))
}

/// Records `line` as the reason the job's stage-in failed; written whole or not at all.
pub fn record_failure(root: &Path, job_id: &str, line: &str) -> Result<(), ScratchError> {
    let dest = failure_path(root, job_id)?;
    let tmp = dest.with_extension("tmp");
    std::fs::write(&tmp, format!("{line}\n")).map_err(io("write", &tmp))?;
    std::fs::rename(&tmp, &dest).map_err(io("rename", &dest))
}

/// The recorded reason the job's stage-in failed, if it did.
pub fn failure(root: &Path, job_id: &str) -> Option<String> {
    let text = std::fs::read_to_string(failure_path(root, job_id).ok()?).ok()?;
    Some(text.trim_end().to_string())
}

/// Removes the job's stage-in failure record; none is no error.
pub fn clear_failure(root: &Path, job_id: &str) -> Result<(), ScratchError> {
    let p = failure_path(root, job_id)?;
    match std::fs::remove_file(&p) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io("remove", &p)(e)),
        _ => Ok(()),
    }
}

/// Removes the scratch (and failure record) of every job under `root` that `live` says is not
/// running: what jobs left when their Epilog never ran (slurmd killed, node rebooted). Only
/// names that are job ids are touched. Returns the job ids reclaimed.
pub fn reclaim(root: &Path, live: impl Fn(&str) -> bool) -> Result<Vec<String>, ScratchError> {
    let mut reclaimed = Vec::new();
    let entries = match std::fs::read_dir(root) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(reclaimed),
        other => other.map_err(io("list", root))?,
    };
    for item in entries {
        let item = item.map_err(io("list", root))?;
        let name = item.file_name().to_string_lossy().into_owned();
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
