//! A container's resource usage as berth reports it after a step: CPU time, peak memory, peak
//! task count and OOM kills. A value is `None` when its file is absent (controller not enabled,
//! e.g. memory and pids on a hybrid host's cgroup2, or a kernel too old for `*.peak`), never a
//! made-up zero.

use std::path::Path;

use super::{Cgroup, files};

/// Resource usage of a cgroup and its descendants.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// `usage_usec` in cpu.stat (present on every cgroup2 directory since Linux 4.15).
    pub cpu_usage_usec: Option<u64>,
    /// memory.peak (Linux 5.19).
    pub memory_peak: Option<u64>,
    /// pids.peak (Linux 6.1).
    pub pids_peak: Option<u64>,
    /// `oom_kill` in memory.events.
    pub oom_kills: Option<u64>,
}

impl Cgroup {
    /// Read the resource summary; missing or unreadable files give `None` fields.
    pub fn stats(&self) -> Stats {
        read_stats(self.path())
    }
}

pub(crate) fn read_stats(dir: &Path) -> Stats {
    let read = |name: &str| files::read_optional(&dir.join(name));
    Stats {
        cpu_usage_usec: read("cpu.stat").and_then(|s| files::keyed_u64(&s, "usage_usec")),
        memory_peak: read("memory.peak").and_then(|s| files::single_u64(&s)),
        pids_peak: read("pids.peak").and_then(|s| files::single_u64(&s)),
        oom_kills: read("memory.events").and_then(|s| files::keyed_u64(&s, "oom_kill")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_files_present() {
        let dir = tempfile::tempdir().unwrap();
        let w = |name: &str, content: &str| std::fs::write(dir.path().join(name), content).unwrap();
        w(
            "cpu.stat",
            "usage_usec 1523\nuser_usec 1000\nsystem_usec 523\nnr_periods 0\n",
        );
        w("memory.peak", "8388608\n");
        w("pids.peak", "7\n");
        w(
            "memory.events",
            "low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\noom_group_kill 0\n",
        );
        assert_eq!(
            Cgroup::at(dir.path().to_path_buf()).stats(),
            Stats {
                cpu_usage_usec: Some(1523),
                memory_peak: Some(8_388_608),
                pids_peak: Some(7),
                oom_kills: Some(1),
            }
        );
    }

    #[test]
    fn missing_files_are_none() {
        // What the host's hybrid cgroup2 offers: cpu.stat only.
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("cpu.stat"), "usage_usec 0\n").unwrap();
        assert_eq!(
            read_stats(dir.path()),
            Stats {
                cpu_usage_usec: Some(0),
                ..Stats::default()
            }
        );
        assert_eq!(read_stats(&dir.path().join("gone")), Stats::default());
    }

    #[test]
    fn garbage_is_none_not_zero() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("memory.peak"), "lots\n").unwrap();
        std::fs::write(dir.path().join("memory.events"), "oom 3\n").unwrap();
        let s = read_stats(dir.path());
        assert_eq!(s.memory_peak, None);
        assert_eq!(s.oom_kills, None);
    }
}
