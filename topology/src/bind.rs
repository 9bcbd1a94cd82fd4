//! Applies a rank's plan to the calling thread (and so to what it execs): CPU affinity and the
//! NUMA memory policy. Both are per-thread and inherited across fork and exec, which is how
//! `berth topo exec` and a task launcher pin a rank before starting it.

use serde::{Deserialize, Serialize};

use super::plan::RankPlan;
use super::{CpuSet, TopologyError};

/// How a rank's memory is tied to its NUMA nodes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum MemPolicy {
    /// Allocate only there (MPOL_BIND).
    #[default]
    Bind,
    /// Prefer those nodes, fall back to others when full (MPOL_PREFERRED_MANY).
    Preferred,
    /// Leave the kernel's default.
    None,
}

const MPOL_DEFAULT: i32 = 0;
const MPOL_PREFERRED: i32 = 1;
const MPOL_BIND: i32 = 2;
const MPOL_PREFERRED_MANY: i32 = 5;

/// The calling thread's CPU affinity.
#[expect(
    clippy::cast_possible_truncation,
    reason = "CpuSet::count() is CPU_SETSIZE (1024)"
)]
pub fn affinity() -> Result<CpuSet, TopologyError> {
    let set = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).map_err(|source| {
        TopologyError::Sys {
            what: "reading the CPU affinity".into(),
            source,
        }
    })?;
    Ok((0..nix::sched::CpuSet::count() as u32)
        .filter(|&c| set.is_set(c as usize).unwrap_or(false))
        .collect())
}

/// Pins the calling thread to `cpus`.
pub fn set_affinity(cpus: &CpuSet) -> Result<(), TopologyError> {
    let mut set = nix::sched::CpuSet::new();
    for c in cpus.iter() {
        set.set(c as usize).map_err(|source| TopologyError::Sys {
            what: format!("CPU {c} is beyond what sched_setaffinity takes"),
            source,
        })?;
    }
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).map_err(|source| {
        TopologyError::Sys {
            what: format!("pinning to CPUs {cpus} (are they in the job's cpuset?)"),
            source,
        }
    })
}

fn nodemask(nodes: &CpuSet) -> Vec<libc::c_ulong> {
    let bits = libc::c_ulong::BITS as usize;
    let words = nodes
        .iter()
        .max()
        .map(|m| m as usize / bits + 1)
        .unwrap_or(1);
    let mut mask = vec![0 as libc::c_ulong; words];
    for n in nodes.iter() {
        mask[n as usize / bits] |= 1 << (n as usize % bits);
    }
    mask
}

fn set_mempolicy(mode: i32, nodes: &CpuSet) -> Result<(), nix::errno::Errno> {
    let mask = nodemask(nodes);
    // The kernel reads maxnode - 1 bits.
    let maxnode = mask.len() * libc::c_ulong::BITS as usize + 1;
    let ptr = if mode == MPOL_DEFAULT {
        std::ptr::null()
    } else {
        mask.as_ptr()
    };
    // SAFETY: set_mempolicy reads `maxnode - 1` bits from `ptr`, which points at `mask`, alive
    // for the call and holding that many bits (or is null for MPOL_DEFAULT).
    let rc = unsafe { libc::syscall(libc::SYS_set_mempolicy, mode, ptr, maxnode) };
    if rc == 0 {
        Ok(())
    } else {
        Err(nix::errno::Errno::last())
    }
}

/// Ties the calling thread's memory to `nodes`.
pub fn set_memory(policy: MemPolicy, nodes: &CpuSet) -> Result<(), TopologyError> {
    let fail = |mode: &str, source| TopologyError::Sys {
        what: format!("setting the memory policy to {mode} on NUMA nodes {nodes}"),
        source,
    };
    if nodes.is_empty() || policy == MemPolicy::None {
        return Ok(());
    }
    match policy {
        MemPolicy::Bind => set_mempolicy(MPOL_BIND, nodes).map_err(|e| fail("bind", e)),
        MemPolicy::Preferred => match set_mempolicy(MPOL_PREFERRED_MANY, nodes) {
            // Kernels before 5.15 know only one preferred node.
            Err(nix::errno::Errno::EINVAL) => {
                let first: CpuSet = nodes.first().into_iter().collect();
                set_mempolicy(MPOL_PREFERRED, &first).map_err(|e| fail("preferred", e))
            }
            other => other.map_err(|e| fail("preferred", e)),
        },
        MemPolicy::None => Ok(()),
    }
}

/// Pins the calling thread as `rank` says: its CPUs, then its memory nodes.
pub fn apply(rank: &RankPlan, policy: MemPolicy) -> Result<(), TopologyError> {
    if !rank.cpus.is_empty() {
        set_affinity(&rank.cpus)?;
    }
    set_memory(policy, &rank.mems)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (mode, nodemask) of the calling thread.
    fn get_mempolicy() -> (i32, libc::c_ulong) {
        let mut mode: libc::c_int = -1;
        let mut mask: [libc::c_ulong; 1] = [0];
        // SAFETY: get_mempolicy writes one int to `mode` and up to 64 bits into `mask`, both
        // alive for the call.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_get_mempolicy,
                &mut mode as *mut libc::c_int,
                mask.as_mut_ptr(),
                65usize,
                std::ptr::null::<libc::c_void>(),
                0usize,
            )
        };
        assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
        (mode, mask[0])
    }

    #[test]
    fn a_rank_plan_pins_this_thread() {
        // Runs in its own thread: affinity and memory policy are per thread.
        std::thread::spawn(|| {
            let before = affinity().unwrap();
            let last = before.iter().max().unwrap();
            let rank = RankPlan {
                rank: 0,
                gpus: vec![],
                nics: vec![],
                cpus: [last].into_iter().collect(),
                mems: [0].into_iter().collect(),
                env: vec![],
            };
            apply(&rank, MemPolicy::Bind).unwrap();
            assert_eq!(affinity().unwrap(), rank.cpus);
            let status = std::fs::read_to_string("/proc/thread-self/status").unwrap();
            let line = status
                .lines()
                .find(|l| l.starts_with("Cpus_allowed_list"))
                .unwrap();
            assert_eq!(line.split_whitespace().last().unwrap(), last.to_string());
            assert_eq!(get_mempolicy(), (MPOL_BIND, 1));
            set_memory(MemPolicy::Preferred, &rank.mems).unwrap();
            let (mode, mask) = get_mempolicy();
            assert!(
                mode == MPOL_PREFERRED_MANY || mode == MPOL_PREFERRED,
                "{mode}"
            );
            assert_eq!(mask, 1);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn impossible_pins_say_what_failed() {
        std::thread::spawn(|| {
            let err = set_affinity(&[4000].into_iter().collect()).unwrap_err();
            assert!(err.to_string().contains("4000"), "{err}");
            let err = set_memory(MemPolicy::Bind, &[63].into_iter().collect()).unwrap_err();
            assert!(err.to_string().contains("NUMA nodes 63"), "{err}");
        })
        .join()
        .unwrap();
    }
}
