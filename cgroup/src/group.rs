//! One container's cgroup: applying limits, moving processes in, checking whether anything still
//! runs in it, and removing it. Killing lives in `kill.rs`, statistics in `stats.rs`, the device
//! filter in `devices/`.

use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::thread::sleep;
use std::time::Duration;

use super::{CgroupError, CgroupWrite, files};

/// A cgroup v2 directory. Holding one does not keep the directory alive; every method works on
/// the path as it is now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cgroup {
    path: PathBuf,
}

/// `rmdir` answers EBUSY while the last killed tasks finish exiting; this is how long to retry.
const REMOVE_RETRIES: u32 = 50;
const REMOVE_RETRY_DELAY: Duration = Duration::from_millis(20);

/// A process that was just forked (kernel state TASK_NEW) cannot be moved yet and the write
/// fails with EINVAL; runc retries the same way.
const ADD_RETRIES: u32 = 5;
const ADD_RETRY_DELAY: Duration = Duration::from_millis(30);

impl Cgroup {
    /// The cgroup at `path`, which need not exist yet.
    pub fn at(path: PathBuf) -> Cgroup {
        Cgroup { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Perform the planned interface-file writes, in order; stops at the first failure.
    pub fn apply(&self, writes: &[CgroupWrite]) -> Result<(), CgroupError> {
        for w in writes {
            files::write(&self.path.join(w.file), &w.value)?;
        }
        Ok(())
    }

    /// A directory fd of the cgroup, for `clone3(CLONE_INTO_CGROUP)` and BPF attach.
    pub fn open_fd(&self) -> Result<OwnedFd, CgroupError> {
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
            .open(&self.path)
            .map(OwnedFd::from)
            .map_err(|e| {
                CgroupError::io(
                    "open",
                    &self.path,
                    e,
                    "check the cgroup exists (was it removed?)",
                )
            })
    }

    /// Move process `pid` (and all its threads) into this cgroup.
    pub fn add_process(&self, pid: i32) -> Result<(), CgroupError> {
        // Writing 0 moves the writer itself: never what a caller of this function means.
        if pid <= 0 {
            return Err(CgroupError::InvalidPid {
                pid,
                path: self.path.clone(),
            });
        }
        let file = self.path.join("cgroup.procs");
        let value = pid.to_string();
        let mut attempt = 0;
        loop {
            match files::write(&file, &value) {
                Err(CgroupError::Write { source, .. })
                    if source.raw_os_error() == Some(libc::EINVAL) && attempt < ADD_RETRIES =>
                {
                    attempt += 1;
                    sleep(ADD_RETRY_DELAY);
                }
                other => return other,
            }
        }
    }

    /// Whether any process runs in this cgroup or below it (`populated` in cgroup.events).
    pub fn is_populated(&self) -> Result<bool, CgroupError> {
        let path = self.path.join("cgroup.events");
        let content = files::read(&path, "check the cgroup exists")?;
        parse_populated(&content).ok_or_else(|| {
            CgroupError::io(
                "parse",
                path,
                io::Error::new(io::ErrorKind::InvalidData, "no 'populated' line"),
                "this does not look like a cgroup v2 directory",
            )
        })
    }

    /// Remove this cgroup and every cgroup below it, deepest first. A cgroup that is already
    /// gone counts as removed; EBUSY (tasks still exiting) is retried briefly.
    pub fn remove(&self) -> Result<(), CgroupError> {
        remove_tree(&self.path)
    }
}

pub(crate) fn parse_populated(events: &str) -> Option<bool> {
    match files::keyed_u64(events, "populated")? {
        0 => Some(false),
        _ => Some(true),
    }
}

/// The child cgroup directories of `dir` (empty when `dir` is gone).
pub(crate) fn child_dirs(dir: &Path) -> Result<Vec<PathBuf>, CgroupError> {
    let hint = "check the cgroup is readable";
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if files::is_not_found(&e) => return Ok(Vec::new()),
        Err(e) => return Err(CgroupError::io("list", dir, e, hint)),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = match entry {
            Ok(e) => e,
            Err(e) if files::is_not_found(&e) => continue,
            Err(e) => return Err(CgroupError::io("list", dir, e, hint)),
        };
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            out.push(entry.path());
        }
    }
    Ok(out)
}

fn remove_tree(dir: &Path) -> Result<(), CgroupError> {
    // Most cgroups have no children: one rmdir, without listing the directory first.
    match std::fs::remove_dir(dir) {
        Ok(()) => return Ok(()),
        Err(e) if files::is_not_found(&e) => return Ok(()),
        Err(_) => {}
    }
    for child in child_dirs(dir)? {
        remove_tree(&child)?;
    }
    let mut attempt = 0;
    loop {
        match std::fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if files::is_not_found(&e) => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                if attempt >= REMOVE_RETRIES {
                    return Err(CgroupError::Busy {
                        path: dir.to_path_buf(),
                    });
                }
                attempt += 1;
                sleep(REMOVE_RETRY_DELAY);
            }
            Err(e) => {
                return Err(CgroupError::io(
                    "remove cgroup",
                    dir,
                    e,
                    "run berth as root and check the path is a cgroup directory",
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn populated_parsing() {
        assert_eq!(parse_populated("populated 1\nfrozen 0\n"), Some(true));
        assert_eq!(parse_populated("populated 0\nfrozen 1\n"), Some(false));
        assert_eq!(parse_populated("frozen 0\n"), None);
    }

    #[test]
    fn apply_writes_in_order_and_names_the_failing_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("pids.max"), "").unwrap();
        let cg = Cgroup::at(dir.path().to_path_buf());
        cg.apply(&[CgroupWrite {
            file: "pids.max",
            value: "10".into(),
        }])
        .unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.path().join("pids.max")).unwrap(),
            "10"
        );
        let err = cg
            .apply(&[CgroupWrite {
                file: "memory.max",
                value: "1000".into(),
            }])
            .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("memory.max") && msg.contains("'1000'"),
            "{msg}"
        );
    }

    #[test]
    fn add_process_refuses_self_and_nonsense_pids() {
        let dir = tempfile::tempdir().unwrap();
        let cg = Cgroup::at(dir.path().to_path_buf());
        for pid in [0, -1, i32::MIN] {
            assert!(matches!(
                cg.add_process(pid),
                Err(CgroupError::InvalidPid { .. })
            ));
        }
    }

    #[test]
    fn remove_of_a_missing_cgroup_is_success() {
        let dir = tempfile::tempdir().unwrap();
        Cgroup::at(dir.path().join("gone")).remove().unwrap();
    }

    #[test]
    fn remove_goes_deepest_first() {
        // Plain directories stand in for cgroups: rmdir order is what is tested.
        let dir = tempfile::tempdir().unwrap();
        let top = dir.path().join("c");
        std::fs::create_dir_all(top.join("a/b")).unwrap();
        std::fs::create_dir_all(top.join("d")).unwrap();
        Cgroup::at(top.clone()).remove().unwrap();
        assert!(!top.exists());
    }

    #[test]
    fn open_fd_of_a_missing_cgroup_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = Cgroup::at(dir.path().join("nope")).open_fd().unwrap_err();
        assert!(err.to_string().contains("nope"), "{err}");
        Cgroup::at(dir.path().to_path_buf()).open_fd().unwrap();
    }
}
