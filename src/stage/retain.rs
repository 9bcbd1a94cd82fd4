//! The retention area: where the Epilog moves a job's scratch when its stage-out failed, so
//! results are never silently deleted, and where each kept scratch expires after a configured
//! number of days. Entries are named `<job id>-<unix time of the move>`; the time in the name,
//! not a timestamp the user could change, decides expiry.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use super::scratch::{self, ScratchError};

#[derive(Debug, thiserror::Error)]
pub enum RetainError {
    #[error("retention: cannot {op} {path}: {source}{hint}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
        hint: &'static str,
    },
    #[error(transparent)]
    Scratch(#[from] ScratchError),
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> RetainError + 'a {
    move |source| {
        let hint = if source.raw_os_error() == Some(libc::EXDEV) {
            " (scratch.retention_dir must be on the scratch root's filesystem)"
        } else {
            ""
        };
        RetainError::Io {
            op,
            path: path.to_path_buf(),
            source,
            hint,
        }
    }
}

/// Moves the scratch of `job_id` under `root` into `dir` as `<job id>-<now>` (a rename, so
/// nothing is copied) and returns its new path. `dir` is made root-owned 0711: a user reaches
/// the scratch whose path they were told, but cannot list other jobs'.
pub fn retain(root: &Path, job_id: &str, dir: &Path, now: u64) -> Result<PathBuf, RetainError> {
    let from = scratch::path(root, job_id)?;
    scratch::create_dirs(dir, 0o755).map_err(io("create", dir))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))
        .map_err(io("chmod", dir))?;
    let to = dir.join(format!("{job_id}-{now}"));
    std::fs::rename(&from, &to).map_err(io("move the job's scratch into", dir))?;
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

/// Removes the entries of `dir` retained `days` days or more before `now`; returns them.
pub fn expire(dir: &Path, days: u64, now: u64) -> Result<Vec<PathBuf>, RetainError> {
    let mut removed = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(removed),
        other => other.map_err(io("list", dir))?,
    };
    for item in entries {
        let item = item.map_err(io("list", dir))?;
        let name = item.file_name().to_string_lossy().into_owned();
        let Some(at) = retained_at(&name) else {
            continue;
        };
        if at.saturating_add(days.saturating_mul(86_400)) <= now {
            let p = item.path();
            if item.file_type().map_err(io("inspect", &p))?.is_dir() {
                scratch::remove_tree(&p)?;
            } else {
                std::fs::remove_file(&p).map_err(io("remove", &p))?;
            }
            removed.push(p);
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

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
