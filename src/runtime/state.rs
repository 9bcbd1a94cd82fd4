//! Per-container state directories under the configured state dir, and reclaiming what a berth
//! killed with SIGKILL left behind: its cgroup and its directory (its mounts died with the
//! container's mount namespace).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::cgroup::Cgroup;

#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Record {
    pub id: String,
    /// The berth process that owns the container, identified by pid and start time so a reused
    /// pid is not mistaken for it.
    pub owner_pid: i32,
    pub owner_start: u64,
    pub cgroup: PathBuf,
    /// The container's init (its namespaces are /proc/PID/ns/*); 0 before it started.
    #[serde(default)]
    pub init_pid: i32,
    /// What the container belongs to: `job`, `step`, `name`, `uid`, ...
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// A container's state directory; removed on drop unless kept.
pub struct StateDir {
    pub path: PathBuf,
    keep: bool,
}

impl StateDir {
    pub fn create(state_dir: &Path, record: &Record) -> std::io::Result<Self> {
        std::fs::create_dir_all(state_dir)?;
        let path = state_dir.join(&record.id);
        std::fs::create_dir(&path)?;
        let dir = StateDir { path, keep: false };
        std::fs::create_dir(dir.work())?;
        write_json(&dir.path.join("state.json"), record)?;
        Ok(dir)
    }

    /// Rewrites the record and stores the Spec (what joining processes run as).
    pub fn save(&self, record: &Record, spec: &oci_spec::runtime::Spec) -> std::io::Result<()> {
        write_json(&self.path.join("config.json"), spec)?;
        write_json(&self.path.join("state.json"), record)
    }

    /// Rewrites the record alone (once init's pid is known).
    pub fn save_record(&self, record: &Record) -> std::io::Result<()> {
        write_json(&self.path.join("state.json"), record)
    }

    /// Leaves the directory in place when this value is dropped.
    pub fn keep(mut self) {
        self.keep = true;
    }

    /// Where init mounts the tmpfs that holds the overlay's upper layer.
    pub fn work(&self) -> PathBuf {
        self.path.join("work")
    }
}

impl Drop for StateDir {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Writes JSON under a temporary name and renames it, so readers never see half a file.
fn write_json(path: &Path, value: &impl Serialize) -> std::io::Result<()> {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(
        &tmp,
        serde_json::to_vec(value).map_err(std::io::Error::other)?,
    )?;
    std::fs::rename(&tmp, path)
}

/// Replaces the Spec stored for the held container `id` (its environment after the image's
/// entrypoint ran, say).
pub fn save_spec(
    state_dir: &Path,
    id: &str,
    spec: &oci_spec::runtime::Spec,
) -> std::io::Result<()> {
    write_json(&state_dir.join(id).join("config.json"), spec)
}

/// A container's record and Spec (the Spec only for held containers).
pub fn load(state_dir: &Path, id: &str) -> Option<(Record, Option<oci_spec::runtime::Spec>)> {
    if id.is_empty() || id.contains('/') || id.starts_with('.') {
        return None;
    }
    let dir = state_dir.join(id);
    let record = serde_json::from_slice(&std::fs::read(dir.join("state.json")).ok()?).ok()?;
    let spec = std::fs::read(dir.join("config.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    Some((record, spec))
}

/// Every container record in the state directory.
pub fn list(state_dir: &Path) -> Vec<Record> {
    let Ok(entries) = std::fs::read_dir(state_dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let bytes = std::fs::read(e.path().join("state.json")).ok()?;
            serde_json::from_slice(&bytes).ok()
        })
        .collect()
}

/// Start time of a process in clock ticks since boot (field 22 of /proc/PID/stat).
pub fn process_start(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses; fields resume after the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split(' ').nth(19)?.parse().ok()
}

/// Whether the berth that wrote `record` is still running.
pub fn owner_alive(record: &Record) -> bool {
    process_start(record.owner_pid) == Some(record.owner_start)
}

/// Reclaims the containers of dead berth processes; returns the ids reclaimed.
pub fn reclaim(state_dir: &Path, kill_timeout: Duration) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(state_dir) else {
        return Vec::new();
    };
    let mut done = Vec::new();
    for entry in entries.flatten() {
        let dir = entry.path();
        let Ok(bytes) = std::fs::read(dir.join("state.json")) else {
            continue;
        };
        let Ok(record) = serde_json::from_slice::<Record>(&bytes) else {
            continue;
        };
        // A record still being written by a starting berth has its owner alive too.
        if owner_alive(&record) {
            continue;
        }
        let cgroup = Cgroup::at(record.cgroup.clone());
        if cgroup.path().exists() {
            let _ = cgroup.kill();
            let _ = cgroup.wait_empty(kill_timeout);
            if cgroup.remove().is_err() {
                tracing::warn!(
                    "cannot remove leftover cgroup {}; will retry",
                    cgroup.path().display()
                );
                continue;
            }
        }
        if std::fs::remove_dir_all(&dir).is_ok() {
            tracing::debug!("reclaimed leftover container {}", record.id);
            done.push(record.id);
        }
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_process_is_alive_and_a_stale_record_is_not() {
        let me = std::process::id() as i32;
        let start = process_start(me).unwrap();
        let mut rec = Record {
            id: "x".into(),
            owner_pid: me,
            owner_start: start,
            cgroup: "/nonexistent".into(),
            init_pid: 0,
            labels: Default::default(),
        };
        assert!(owner_alive(&rec));
        rec.owner_start += 1;
        assert!(!owner_alive(&rec));
    }

    #[test]
    fn reclaim_removes_dead_owners_only() {
        let dir = tempfile::tempdir().unwrap();
        let me = std::process::id() as i32;
        let live = Record {
            id: "live".into(),
            owner_pid: me,
            owner_start: process_start(me).unwrap(),
            cgroup: dir.path().join("no-cgroup-live"),
            init_pid: 0,
            labels: Default::default(),
        };
        let dead = Record {
            id: "dead".into(),
            owner_start: 1,
            cgroup: dir.path().join("no-cgroup-dead"),
            ..live_clone(&live)
        };
        let a = StateDir::create(dir.path(), &live).unwrap();
        let b = StateDir::create(dir.path(), &dead).unwrap();
        std::mem::forget(b);
        assert_eq!(reclaim(dir.path(), Duration::from_millis(10)), vec!["dead"]);
        assert!(a.path.exists());
        assert!(!dir.path().join("dead").exists());
    }

    fn live_clone(r: &Record) -> Record {
        Record {
            id: r.id.clone(),
            owner_pid: r.owner_pid,
            owner_start: r.owner_start,
            cgroup: r.cgroup.clone(),
            init_pid: r.init_pid,
            labels: r.labels.clone(),
        }
    }
}
