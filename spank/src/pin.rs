//! Pinning a task as berth planned it (`--container-bind=closest`): the CPU affinity and NUMA
//! memory policy of the task's process, which its program keeps across `execve`.
//!
//! Done in `task_init`, after Slurm's task plugins have set their own affinity (Slurm calls
//! `task_p_pre_launch` before `spank_task_init`), so berth's placement is the one that stays.
//! The kernel intersects the requested CPUs with the task's cgroup cpuset (what Slurm gave the
//! step) and refuses an empty intersection; the task then keeps Slurm's CPUs.

use std::io;

use berth_proto::answer::{MemPolicy, RankBinding};

const MPOL_PREFERRED: libc::c_int = 1;
const MPOL_BIND: libc::c_int = 2;
const MPOL_PREFERRED_MANY: libc::c_int = 5;

/// What pinning did, in words for the job's log (or why it left something as it was).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Pinned {
    pub notes: Vec<String>,
}

/// `0-3,8` for the log.
pub fn list_text(ids: &[u32]) -> String {
    let mut sorted = ids.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        while i + 1 < sorted.len() && sorted[i + 1] == sorted[i] + 1 {
            i += 1;
        }
        parts.push(if sorted[i] == start {
            start.to_string()
        } else {
            format!("{start}-{}", sorted[i])
        });
        i += 1;
    }
    parts.join(",")
}

/// Pins the calling thread (the task's only one) to the rank's CPUs, then its memory to the
/// rank's NUMA nodes. Neither failure fails the task: placement is an optimisation, and the
/// notes say what was kept.
pub fn apply(rank: &RankBinding, policy: MemPolicy) -> Pinned {
    let mut pinned = Pinned::default();
    if !rank.cpus.is_empty() {
        match set_cpus(&rank.cpus) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => pinned.notes.push(format!(
                "CPUs {} are outside the step's cpuset: keeping Slurm's",
                list_text(&rank.cpus)
            )),
            Err(e) => pinned.notes.push(format!(
                "pinning to CPUs {}: {}: keeping Slurm's",
                list_text(&rank.cpus),
                crate::io_text(&e)
            )),
        }
    }
    if !rank.mems.is_empty()
        && let Err(e) = set_memory(policy, &rank.mems)
    {
        pinned.notes.push(format!(
            "memory policy on NUMA nodes {}: {}: keeping the default",
            list_text(&rank.mems),
            crate::io_text(&e)
        ));
    }
    pinned
}

fn set_cpus(cpus: &[u32]) -> io::Result<()> {
    // SAFETY: an all-zero cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let max = 8 * std::mem::size_of::<libc::cpu_set_t>();
    for &c in cpus {
        let c = c as usize;
        if c >= max {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        // SAFETY: `c` is below the set's size, checked above.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: sched_setaffinity reads `size_of::<cpu_set_t>()` bytes from `set`, alive here.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn set_memory(policy: MemPolicy, nodes: &[u32]) -> io::Result<()> {
    let bits = libc::c_ulong::BITS;
    let words = nodes.iter().max().map_or(1, |m| (m / bits + 1) as usize);
    let mut mask = vec![0 as libc::c_ulong; words];
    for &n in nodes {
        mask[(n / bits) as usize] |= 1 << (n % bits);
    }
    // The kernel reads maxnode - 1 bits.
    let maxnode = mask.len() as libc::c_ulong * libc::c_ulong::from(bits) + 1;
    let call = |mode: libc::c_int, mask: &[libc::c_ulong]| -> io::Result<()> {
        // SAFETY: set_mempolicy reads `maxnode - 1` bits from `mask`, which holds that many
        // and is alive for the call.
        let rc = unsafe { libc::syscall(libc::SYS_set_mempolicy, mode, mask.as_ptr(), maxnode) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    };
    match policy {
        MemPolicy::None => Ok(()),
        MemPolicy::Bind => call(MPOL_BIND, &mask),
        MemPolicy::Preferred => match call(MPOL_PREFERRED_MANY, &mask) {
            // Kernels before 5.15 know one preferred node only.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                let first = nodes.iter().min().copied().unwrap_or(0);
                let mut one = vec![0 as libc::c_ulong; words];
                one[(first / bits) as usize] |= 1 << (first % bits);
                call(MPOL_PREFERRED, &one)
            }
            other => other,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(cpus: &[u32], mems: &[u32]) -> RankBinding {
        RankBinding {
            rank: 0,
            cpus: cpus.to_vec(),
            mems: mems.to_vec(),
            env: Vec::new(),
        }
    }

    fn allowed_cpus() -> String {
        let status = std::fs::read_to_string("/proc/thread-self/status").unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .unwrap()
            .trim()
            .to_string()
    }

    #[test]
    fn lists_read_like_cpusets() {
        assert_eq!(list_text(&[3, 0, 1, 2, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(list_text(&[]), "");
    }

    #[test]
    fn a_rank_is_pinned_and_an_impossible_pin_keeps_what_was() {
        // Its own thread: affinity and memory policy belong to the thread.
        std::thread::spawn(|| {
            let pinned = apply(&rank(&[0], &[0]), MemPolicy::Bind);
            assert_eq!(pinned, Pinned::default());
            assert_eq!(allowed_cpus(), "0");
            // CPU 4000 exists nowhere; NUMA node 63 neither.
            let pinned = apply(&rank(&[4000], &[63]), MemPolicy::Preferred);
            assert_eq!(allowed_cpus(), "0", "the earlier pin stays");
            assert_eq!(pinned.notes.len(), 2, "{:?}", pinned.notes);
            assert!(
                pinned.notes[0].starts_with("CPUs 4000 are outside the step's cpuset"),
                "{:?}",
                pinned.notes
            );
            assert!(
                pinned.notes[1].starts_with("memory policy on NUMA nodes 63: "),
                "{:?}",
                pinned.notes
            );
        })
        .join()
        .unwrap();
    }
}
