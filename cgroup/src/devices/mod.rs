//! The device allow-list of a container. cgroup v2 has no devices controller: access to device
//! nodes is decided by a `BPF_PROG_TYPE_CGROUP_DEVICE` program attached to the cgroup. Split as
//! youki does: `rules` normalizes OCI rules, `emulator` is the reference semantics in plain Rust,
//! `program` compiles rules to BPF (tested against the emulator with a small interpreter), and
//! `bpf` is the only code that talks to the kernel.
//!
//! Semantics: rules are evaluated last-match-wins over a default deny. An allow rule matches a
//! request whose access bits are all within the rule's; a deny rule matches a request that
//! wants any of the rule's bits. berth passes one deny-all rule followed by allow rules.

mod bpf;
#[cfg(test)]
mod emulator;
mod program;
mod rules;

use std::os::fd::AsFd;

use oci_spec::runtime::LinuxDeviceCgroup;

use super::{Cgroup, CgroupError};

impl Cgroup {
    /// Replace the device filter of this cgroup with one built from `rules` (OCI semantics,
    /// last match wins over default deny). Programs attached directly to this cgroup before are
    /// detached after the new one is in place, so access never widens in between; filters
    /// attached to ancestors still apply on top.
    pub fn set_device_filter(&self, rules: &[LinuxDeviceCgroup]) -> Result<(), CgroupError> {
        let rules = rules::parse(rules)?;
        let insns = program::build(&rules);
        let cgroup = self.open_fd()?;
        let err = |op: &'static str, source: std::io::Error| CgroupError::Bpf {
            op,
            path: self.path().to_path_buf(),
            source,
            log: String::new(),
        };

        let prog = bpf::load_device_program(&insns).map_err(|(source, log)| CgroupError::Bpf {
            op: "load",
            path: self.path().to_path_buf(),
            source,
            log,
        })?;
        let old = bpf::attached_programs(cgroup.as_fd()).map_err(|e| err("query", e))?;
        bpf::attach(prog.as_fd(), cgroup.as_fd()).map_err(|e| err("attach", e))?;
        for old_prog in old {
            bpf::detach(old_prog.as_fd(), cgroup.as_fd()).map_err(|e| err("detach old", e))?;
        }
        Ok(())
    }
}
