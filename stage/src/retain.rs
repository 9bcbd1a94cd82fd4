//! The retention area: where the Epilog moves a job's scratch when its stage-out failed, so
//! results are never silently deleted, and where each kept scratch expires after a configured
//! number of days. Entries are named `<job id>-<unix time of the move>`; the time in the name,
//! not a timestamp the user could change, decides expiry.

use std::ffi::CString;
use std::path::{Path, PathBuf};

use super::scratch;
use super::{fsops, tree};
use crate::StageError;

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> StageError + 'a {
    move |source| {
        let hint = if source.raw_os_error() == Some(libc::EXDEV) {
            " (scratch.retention_dir must be on the scratch root's filesystem)"
        } else {
            ""
        };
        StageError::RetainIo {
            op,
            path: path.to_path_buf(),
            source,
            hint,
        }
    }
}

/// Moves the scratch of `job_id` under `root` into `dir` as `<job id>-<now>` (a rename by fd
/// between the two root-owned directories, so nothing is copied and nothing followed) and
/// returns its new path. `dir` is a directory berth relies on ([`berth_sys::privfs::root_dir`]),
/// root-owned 0711: a user reaches the scratch whose path they were told, but cannot list other
/// jobs'; one another user made, or a symlink, is refused in one line.
pub fn retain(root: &Path, job_id: &str, dir: &Path, now: u64) -> Result<PathBuf, StageError> {
    scratch::path(root, job_id)?;
    let area = berth_sys::privfs::root_dir(dir, 0o711).map_err(StageError::RetainArea)?;
    let rfd = scratch::open_root(root)?;
    let name = format!("{job_id}-{now}");
    let to = dir.join(&name);
    let cname = |s: &str| CString::new(s).map_err(|_| StageError::BadJobId(s.to_string()));
    let (from_c, to_c) = (cname(job_id)?, cname(&name)?);
    // Only a directory is retained: a symlink the job left in its place is not moved.
    match fsops::lstat_at(&rfd, &from_c).map_err(io("inspect", &root.join(job_id)))? {
        Some(st) if st.st_mode & libc::S_IFMT == libc::S_IFDIR => {}
        _ => {
            return Err(io("move the job's scratch into", dir)(
                std::io::Error::from(std::io::ErrorKind::NotFound),
            ));
        }
    }
    nix::fcntl::renameat2(
        &rfd,
        from_c.as_c_str(),
        &area,
        to_c.as_c_str(),
        nix::fcntl::RenameFlags::RENAME_NOREPLACE,
    )
    .map_err(|e| io("move the job's scratch into", dir)(e.into()))?;
    Ok(to)
}

/// When a retained entry's name says it was moved: `<job id>-<unix time>`.
fn retained_at(name: &str) -> Option<u64> {
    let (job, at) = name.rsplit_once('-')?;
    if job.is_empty() || !job.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    at.parse().ok()
}

/// Removes the entries of `dir` retained `days` days or more before `now` (by fd, without
/// following a symlink); returns them.
pub fn expire(dir: &Path, days: u64, now: u64) -> Result<Vec<PathBuf>, StageError> {
    let mut removed = Vec::new();
    if matches!(std::fs::symlink_metadata(dir), Err(e) if e.kind() == std::io::ErrorKind::NotFound)
    {
        return Ok(removed);
    }
    let area = berth_sys::privfs::root_dir(dir, 0o711).map_err(StageError::RetainArea)?;
    for name in tree::list(&area).map_err(io("list", dir))? {
        let text = name.to_string_lossy().into_owned();
        let Some(at) = retained_at(&text) else {
            continue;
        };
        if at.saturating_add(days.saturating_mul(86_400)) <= now {
            let p = dir.join(&text);
            tree::remove_at(&area, &name).map_err(io("remove", &p))?;
            removed.push(p);
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn retained_scratch_moves_whole_and_expires_by_its_name() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("scratch");
        let uid = nix::unistd::Uid::current().as_raw();
        let gid = nix::unistd::Gid::current().as_raw();
        let d = scratch::create(&root, "12", uid, gid, None).unwrap();
        std::fs::create_dir(d.join("results")).unwrap();
        std::fs::write(d.join("results/r"), b"result").unwrap();
        let area = root.join("retained");
        let kept = retain(&root, "12", &area, 1_000_000).unwrap();
        assert_eq!(kept, area.join("12-1000000"));
        assert!(!d.exists());
        assert_eq!(std::fs::read(kept.join("results/r")).unwrap(), b"result");
        assert_eq!(
            std::fs::metadata(&area).unwrap().permissions().mode() & 0o777,
            0o711
        );
        std::fs::create_dir(area.join("not-a-job")).unwrap();
        let day = 86_400;
        assert!(
            expire(&area, 2, 1_000_000 + 2 * day - 1)
                .unwrap()
                .is_empty()
        );
        assert_eq!(
            expire(&area, 2, 1_000_000 + 2 * day).unwrap(),
            std::slice::from_ref(&kept)
        );
        assert!(!kept.exists());
        assert!(area.join("not-a-job").exists());
        assert!(expire(&tmp.path().join("none"), 1, 0).unwrap().is_empty());
        // Nothing to retain: the error names the job's scratch.
        let e = retain(&root, "13", &area, 5).unwrap_err().to_string();
        assert!(
            e.contains("retention: cannot move the job's scratch into"),
            "{e}"
        );
    }

    #[test]
    fn only_job_names_have_a_retention_time() {
        assert_eq!(retained_at("12-1700000000"), Some(1_700_000_000));
        assert_eq!(retained_at("x-1"), None);
        assert_eq!(retained_at("12"), None);
        assert_eq!(retained_at("12-x"), None);
    }
}
