//! CPUs, cores with their hyperthread siblings, and NUMA nodes with their CPUs and distances,
//! from `/sys/devices/system/{cpu,node}`.

use serde::{Deserialize, Serialize};

use super::{CpuSet, Host, TopologyError, list_dir, read_attr};

/// A physical core: the hardware threads that share it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Core {
    pub package: u32,
    pub threads: CpuSet,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NumaNode {
    pub id: u32,
    pub cpus: CpuSet,
    /// SLIT distances to every node, in node order (10 = local).
    pub distances: Vec<u32>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cpus {
    pub online: CpuSet,
    /// Ordered by their first thread.
    pub cores: Vec<Core>,
    /// Ordered by id; a kernel without NUMA shows as one node 0 holding every CPU.
    pub numa: Vec<NumaNode>,
}

impl Cpus {
    pub fn node(&self, id: u32) -> Option<&NumaNode> {
        self.numa.iter().find(|n| n.id == id)
    }

    /// The NUMA node whose CPUs are exactly `cpus` (how a device's node is inferred when its
    /// `numa_node` reads -1 but its `local_cpulist` is known).
    pub fn node_of_cpus(&self, cpus: &CpuSet) -> Option<u32> {
        if self.numa.len() == 1 {
            return Some(self.numa[0].id);
        }
        self.numa
            .iter()
            .find(|n| !cpus.is_empty() && n.cpus.is_subset(cpus) && cpus.is_subset(&n.cpus))
            .map(|n| n.id)
    }

    /// The cores whose threads lie on node `id`, in order.
    pub fn cores_of(&self, id: u32) -> Vec<&Core> {
        let Some(node) = self.node(id) else {
            return Vec::new();
        };
        self.cores
            .iter()
            .filter(|c| c.threads.iter().any(|t| node.cpus.contains(t)))
            .collect()
    }

    /// Distance between nodes, 10 for the same node, 20 when unknown.
    pub fn distance(&self, a: u32, b: u32) -> u32 {
        if a == b {
            return 10;
        }
        self.node(a)
            .and_then(|n| n.distances.get(b as usize).copied())
            .unwrap_or(20)
    }
}

/// Reads CPUs, cores and NUMA nodes.
pub fn scan(host: &Host) -> Result<Cpus, TopologyError> {
    let cpu_dir = host.sys("devices/system/cpu");
    let online_path = cpu_dir.join("online");
    let online = match read_attr(&online_path) {
        Some(text) => CpuSet::parse(&text).map_err(|e| TopologyError::Parse {
            path: online_path.clone(),
            what: e.to_string(),
        })?,
        None => list_dir(&cpu_dir)?
            .iter()
            .filter_map(|n| n.strip_prefix("cpu")?.parse::<u32>().ok())
            .collect(),
    };
    let mut cores: Vec<Core> = Vec::new();
    let mut seen = CpuSet::new();
    for cpu in online.iter() {
        if seen.contains(cpu) {
            continue;
        }
        let topo = cpu_dir.join(format!("cpu{cpu}/topology"));
        let siblings = read_attr(&topo.join("thread_siblings_list"))
            .or_else(|| read_attr(&topo.join("core_cpus_list")))
            .and_then(|l| CpuSet::parse(&l).ok())
            .map(|s| s.intersection(&online))
            .filter(|s| s.contains(cpu))
            .unwrap_or_else(|| [cpu].into_iter().collect());
        let package = read_attr(&topo.join("physical_package_id"))
            .and_then(|p| p.parse::<i64>().ok())
            .and_then(|p| u32::try_from(p).ok())
            .unwrap_or(0);
        seen = seen.union(&siblings);
        cores.push(Core {
            package,
            threads: siblings,
        });
    }
    cores.sort_by_key(|c| c.threads.first());

    let node_dir = host.sys("devices/system/node");
    let mut numa = Vec::new();
    for name in list_dir(&node_dir)? {
        let Some(id) = name
            .strip_prefix("node")
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let dir = node_dir.join(&name);
        let list = dir.join("cpulist");
        let cpus = match read_attr(&list) {
            Some(text) => CpuSet::parse(&text).map_err(|e| TopologyError::Parse {
                path: list,
                what: e.to_string(),
            })?,
            None => CpuSet::new(),
        };
        let distances = read_attr(&dir.join("distance"))
            .map(|d| {
                d.split_whitespace()
                    .filter_map(|v| v.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        numa.push(NumaNode {
            id,
            cpus: cpus.intersection(&online),
            distances,
        });
    }
    numa.sort_by_key(|n| n.id);
    if numa.is_empty() {
        numa.push(NumaNode {
            id: 0,
            cpus: online.clone(),
            distances: vec![10],
        });
    }
    Ok(Cpus {
        online,
        cores,
        numa,
    })
}

/// The CPUs and memory nodes this process's job step may use: its cgroup's cpuset (v2, or v1's
/// cpuset controller), else its own affinity from /proc/self/status. A task launcher may have
/// narrowed the affinity to one task's share already; the cgroup holds the whole step's.
pub fn step_cpuset(host: &Host) -> (Option<CpuSet>, Option<CpuSet>) {
    let cgroups = std::fs::read_to_string(host.proc("self/cgroup")).unwrap_or_default();
    let mut dirs = Vec::new();
    for line in cgroups.lines() {
        let mut f = line.splitn(3, ':');
        let (_, controllers, path) = (f.next(), f.next().unwrap_or(""), f.next().unwrap_or(""));
        let path = path.trim_start_matches('/');
        if controllers.is_empty() {
            for base in ["fs/cgroup", "fs/cgroup/unified"] {
                dirs.push((
                    host.sys(base).join(path),
                    "cpuset.cpus.effective",
                    "cpuset.mems.effective",
                ));
            }
        } else if controllers.split(',').any(|c| c == "cpuset") {
            dirs.push((
                host.sys("fs/cgroup/cpuset").join(path),
                "cpuset.effective_cpus",
                "cpuset.effective_mems",
            ));
        }
    }
    for (dir, cpus, mems) in dirs {
        if let Some(c) = read_attr(&dir.join(cpus)).and_then(|t| CpuSet::parse(&t).ok())
            && !c.is_empty()
        {
            let m = read_attr(&dir.join(mems))
                .and_then(|t| CpuSet::parse(&t).ok())
                .filter(|m| !m.is_empty());
            return (Some(c), m);
        }
    }
    let status = std::fs::read_to_string(host.proc("self/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| CpuSet::parse(v.trim_start_matches(':').trim()).ok())
    };
    (field("Cpus_allowed_list"), field("Mems_allowed_list"))
}
