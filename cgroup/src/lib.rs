//! cgroup v2 for berth: a delegated subtree ([`Hierarchy`]) under which every container gets its
//! own cgroup ([`Cgroup`]) with resource limits, a BPF device filter, statistics and a reliable
//! kill. Deciding what to write ([`plan_writes`], [`required_controllers`]) is pure; the rest is
//! a thin layer over cgroupfs and the `bpf()` syscall, tested for real in the root tier.
//!
//! Every path comes from the caller (the `cgroup.root` config value), never from a constant, so
//! the same code runs on a pure cgroup v2 host (`/sys/fs/cgroup/...`), on a hybrid host
//! (`/sys/fs/cgroup/unified/...`) and inside a systemd-delegated slice.

mod devices;
mod error;
mod files;
mod group;
mod hierarchy;
mod kill;
mod resources;
mod stats;

use std::fmt;

pub use error::CgroupError;
pub use group::Cgroup;
pub use hierarchy::{Hierarchy, default_root};
pub use resources::{CgroupWrite, plan_writes, required_controllers};
pub use stats::Stats;

/// A cgroup v2 controller that berth enables for its containers. Device control has no
/// controller on v2 (it is a BPF program), so it is not listed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Controller {
    Cpu,
    Cpuset,
    Memory,
    Pids,
    Io,
}

impl Controller {
    #[cfg(test)]
    pub(crate) const ALL: [Controller; 5] = [
        Controller::Cpu,
        Controller::Cpuset,
        Controller::Memory,
        Controller::Pids,
        Controller::Io,
    ];

    /// The name the kernel uses in cgroup.controllers and interface-file prefixes.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Controller::Cpu => "cpu",
            Controller::Cpuset => "cpuset",
            Controller::Memory => "memory",
            Controller::Pids => "pids",
            Controller::Io => "io",
        }
    }
}

impl fmt::Display for Controller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controller_display_is_the_kernel_name() {
        let names: Vec<String> = Controller::ALL.iter().map(ToString::to_string).collect();
        assert_eq!(names, ["cpu", "cpuset", "memory", "pids", "io"]);
    }
}
