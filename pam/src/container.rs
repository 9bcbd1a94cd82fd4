//! Into the job's berth container: its mount, UTS and IPC namespaces, joined by sshd's process
//! for the connection before it forks the session, so the shell, commands, `internal-sftp` and the
//! session's ptys (the container's own devpts) are the container's. The network stays the node's,
//! so port forwarding works as on the host.
//!
//! A container is joined only when berth's root-only state says it belongs to this job and this
//! user, and its init process, checked now, is this user's and in the container's cgroup (a pid
//! reused since is not joined).

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::PamError;

/// The parts of berth's container record (runtime/src/state.rs's `Record`) the module reads.
#[derive(Debug, serde::Deserialize)]
struct Record {
    id: String,
    cgroup: PathBuf,
    #[serde(default)]
    init_pid: i32,
    #[serde(default)]
    labels: BTreeMap<String, String>,
}

/// A container of the user's job on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Container {
    pub id: String,
    /// `--container-name`, when it has one.
    pub name: Option<String>,
    pub init_pid: i32,
    /// The init's start time (clock ticks after boot): the newest is joined.
    start: u64,
}

impl Container {
    /// How the user reads it: the name, else the id.
    pub fn label(&self) -> &str {
        self.name.as_deref().unwrap_or(&self.id)
    }
}

/// Owner and mode checks: root's, writable by no one else.
fn roots(meta: &std::fs::Metadata) -> bool {
    meta.uid() == 0 && meta.mode() & 0o022 == 0
}

/// The newest live container of `job` whose process runs as `uid`, from berth's state
/// directory; None when there is none (or the state cannot be read).
pub fn find(state_dir: &Path, uid: u32, job: u64) -> Option<Container> {
    if !std::fs::symlink_metadata(state_dir).is_ok_and(|m| m.is_dir() && roots(&m)) {
        return None;
    }
    let job = job.to_string();
    let uid_text = uid.to_string();
    std::fs::read_dir(state_dir)
        .ok()?
        .flatten()
        .take(4096)
        .filter(|e| e.file_name() != OsStr::new("users"))
        .filter_map(|e| {
            let dir = e.path();
            let meta = std::fs::symlink_metadata(&dir).ok()?;
            if !meta.is_dir() || !roots(&meta) {
                return None;
            }
            let record = read_record(&dir.join("state.json"))?;
            let label = |k: &str| record.labels.get(k).map(String::as_str);
            if label("job") != Some(job.as_str()) || label("uid") != Some(uid_text.as_str()) {
                return None;
            }
            let start = live_init(record.init_pid, uid, &record.cgroup)?;
            Some(Container {
                name: record.labels.get("name").cloned(),
                id: record.id,
                init_pid: record.init_pid,
                start,
            })
        })
        .max_by(|a, b| a.start.cmp(&b.start).then_with(|| a.id.cmp(&b.id)))
}

fn read_record(path: &Path) -> Option<Record> {
    let file = File::open(path).ok()?;
    let meta = file.metadata().ok()?;
    if !meta.is_file() || !roots(&meta) {
        return None;
    }
    let mut text = Vec::new();
    file.take(1 << 20).read_to_end(&mut text).ok()?;
    serde_json::from_slice(&text).ok()
}

/// The start time of `pid` when it is `uid`'s and in `cgroup` (its cgroup v2 path ends the
/// record's), else None.
fn live_init(pid: i32, uid: u32, cgroup: &Path) -> Option<u64> {
    if pid <= 0 {
        return None;
    }
    let proc = PathBuf::from(format!("/proc/{pid}"));
    let status = std::fs::read_to_string(proc.join("status")).ok()?;
    let real_uid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse::<u32>()
        .ok()?;
    if real_uid != uid {
        return None;
    }
    let cgroups = std::fs::read_to_string(proc.join("cgroup")).ok()?;
    let v2 = cgroups.lines().find_map(|l| l.strip_prefix("0::"))?;
    let inside = v2.trim_start_matches('/');
    if inside.is_empty() || !cgroup.ends_with(inside) {
        return None;
    }
    let stat = std::fs::read_to_string(proc.join("stat")).ok()?;
    // Field 22, counted after the command's closing parenthesis (a name may hold spaces).
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(19)?
        .parse()
        .ok()
}

/// Joins `c`'s IPC, UTS and mount namespaces (all opened before any is joined), moves to its
/// root and sets no_new_privs, which the session's processes inherit.
pub fn join(c: &Container) -> Result<(), PamError> {
    let open = |ns: &str| {
        let path = PathBuf::from(format!("/proc/{}/ns/{ns}", c.init_pid));
        File::open(&path).map_err(|source| PamError::Join { path, source })
    };
    let namespaces = [
        (open("ipc")?, libc::CLONE_NEWIPC),
        (open("uts")?, libc::CLONE_NEWUTS),
        (open("mnt")?, libc::CLONE_NEWNS),
    ];
    for (file, kind) in &namespaces {
        // SAFETY: setns on a namespace fd this function holds open.
        if unsafe { libc::setns(file.as_raw_fd(), *kind) } != 0 {
            return Err(PamError::Join {
                path: PathBuf::from(format!("/proc/{}/ns", c.init_pid)),
                source: std::io::Error::last_os_error(),
            });
        }
    }
    // The old working directory is the host's; the container's root is the session's start.
    std::env::set_current_dir("/").map_err(|source| PamError::Join {
        path: PathBuf::from("/"),
        source,
    })?;
    // SAFETY: prctl with PR_SET_NO_NEW_PRIVS and constant arguments.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(PamError::Join {
            path: PathBuf::from("no_new_privs"),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_dir_others_may_write_is_not_read() {
        let d = std::env::temp_dir().join(format!("pam-berth-state-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::set_permissions(&d, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
        assert_eq!(find(&d, 0, 1), None);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn records_of_another_job_or_user_or_a_dead_init_are_skipped() {
        let d = std::env::temp_dir().join(format!("pam-berth-state2-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::set_permissions(&d, std::os::unix::fs::PermissionsExt::from_mode(0o711)).unwrap();
        // This process stands for a container's init: its own cgroup v2 path is the record's.
        let me = std::process::id();
        let own = std::fs::read_to_string("/proc/self/cgroup").unwrap();
        let v2 = own
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .unwrap()
            .to_string();
        let cgroup = format!("/sys/fs/cgroup{v2}");
        let write = |id: &str, job: &str, uid: &str, pid: u32| {
            let dir = d.join(id);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))
                .unwrap();
            let json = format!(
                r#"{{"id":"{id}","owner_pid":1,"owner_start":1,"cgroup":"{cgroup}","init_pid":{pid},"labels":{{"job":"{job}","uid":"{uid}","name":"dev"}}}}"#
            );
            std::fs::write(dir.join("state.json"), json).unwrap();
        };
        // SAFETY: getuid has no preconditions.
        let uid = unsafe { libc::getuid() };
        write("a", "7", &uid.to_string(), me);
        write("b", "8", &uid.to_string(), me);
        write("c", "7", "4242", me);
        write("d", "7", &uid.to_string(), 0);
        let found = find(&d, uid, 7);
        if v2 != "/" {
            let found = found.unwrap();
            assert_eq!((found.id.as_str(), found.label()), ("a", "dev"));
        }
        assert_eq!(find(&d, uid, 9), None);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
