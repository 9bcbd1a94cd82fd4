//! Moving the login into the job's extern step: the cgroups slurmstepd made for the step that
//! `PrologFlags=Contain` starts on every node of a job. Slurm counts the processes there, confines
//! them with the job's limits and kills them with the job.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::PamError;

/// The extern step's cgroup directories of `job` (of `uid`) on `node` under the cgroup mount:
/// one per cgroup v1 hierarchy where Slurm made one (`<ctrl>/slurm[_<node>]/uid_<uid>/job_<job>/
/// step_extern`), or cgroup v2's `slurmstepd.scope/job_<job>/step_extern/user/task_special`
/// (where slurmstepd itself puts adopted processes).
pub fn extern_step_dirs(mount: &Path, node: &str, uid: u32, job: u64) -> Vec<PathBuf> {
    let v2 = [
        mount.join(format!(
            "system.slice/slurmstepd.scope/job_{job}/step_extern/user/task_special"
        )),
        mount.join(format!(
            "system.slice/{node}_slurmstepd.scope/job_{job}/step_extern/user/task_special"
        )),
    ];
    if let Some(dir) = v2.into_iter().find(|d| d.is_dir()) {
        return vec![dir];
    }
    let Ok(hierarchies) = std::fs::read_dir(mount) else {
        return Vec::new();
    };
    let tail = format!("uid_{uid}/job_{job}/step_extern");
    let mut dirs: Vec<PathBuf> = hierarchies
        .flatten()
        .flat_map(|h| {
            let h = h.path();
            [
                h.join(format!("slurm_{node}")).join(&tail),
                h.join("slurm").join(&tail),
            ]
        })
        .filter(|d| d.is_dir())
        .collect();
    dirs.sort();
    dirs
}

/// Moves process `pid` into every directory of `dirs`. Each one's parent must be root's and not
/// writable by others: Slurm gives the step's directory itself to the job's user under cgroup v1
/// (who may make look-alikes inside it), never the job's.
pub fn adopt(dirs: &[PathBuf], job: u64, pid: u32) -> Result<(), PamError> {
    if dirs.is_empty() {
        return Err(PamError::NoExternStep {
            job,
            looked: format!("job_{job}/step_extern"),
        });
    }
    for dir in dirs {
        let parent = dir.parent().unwrap_or(dir);
        let meta = std::fs::symlink_metadata(parent).map_err(|source| PamError::Join {
            path: parent.to_path_buf(),
            source,
        })?;
        if meta.uid() != 0 || !meta.is_dir() || meta.mode() & 0o022 != 0 {
            return Err(PamError::Forged {
                path: parent.to_path_buf(),
            });
        }
        let procs = dir.join("cgroup.procs");
        std::fs::write(&procs, pid.to_string()).map_err(|source| PamError::Join {
            path: procs,
            source,
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v1_hierarchies_are_found_per_controller() {
        let t = tempfile_dir();
        for ctrl in ["freezer", "cpuset"] {
            std::fs::create_dir_all(t.join(ctrl).join("slurm_n1/uid_5/job_7/step_extern")).unwrap();
        }
        std::fs::create_dir_all(t.join("memory/slurm_n1/uid_5/job_8/step_extern")).unwrap();
        std::fs::create_dir_all(t.join("devices/slurm_n1/uid_6/job_7/step_extern")).unwrap();
        let dirs = extern_step_dirs(&t, "n1", 5, 7);
        assert_eq!(
            dirs,
            [
                t.join("cpuset/slurm_n1/uid_5/job_7/step_extern"),
                t.join("freezer/slurm_n1/uid_5/job_7/step_extern")
            ]
        );
        assert!(extern_step_dirs(&t, "n2", 5, 7).is_empty());
        std::fs::remove_dir_all(&t).unwrap();
    }

    #[test]
    fn v2_task_special_wins() {
        let t = tempfile_dir();
        let d = t.join("system.slice/slurmstepd.scope/job_3/step_extern/user/task_special");
        std::fs::create_dir_all(&d).unwrap();
        assert_eq!(extern_step_dirs(&t, "n1", 5, 3), [d]);
        std::fs::remove_dir_all(&t).unwrap();
    }

    #[test]
    fn a_step_under_a_directory_others_may_write_is_refused() {
        let t = tempfile_dir();
        let step = t.join("job_1/step_extern");
        std::fs::create_dir_all(&step).unwrap();
        std::fs::set_permissions(
            t.join("job_1"),
            std::os::unix::fs::PermissionsExt::from_mode(0o777),
        )
        .unwrap();
        let e = adopt(&[step], 1, std::process::id()).unwrap_err();
        assert!(matches!(e, PamError::Forged { .. }), "{e}");
        std::fs::remove_dir_all(&t).unwrap();
    }

    #[test]
    fn no_step_is_an_error_naming_contain() {
        let e = adopt(&[], 4, 1).unwrap_err().to_string();
        assert!(e.contains("PrologFlags=Contain"), "{e}");
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "pam-berth-test-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
