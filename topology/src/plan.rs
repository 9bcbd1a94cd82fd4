//! Pairing and per-rank plans. Each GPU of the node is paired with its closest compute NIC;
//! a step's GPUs are dealt to its local ranks in bus order; each rank gets its GPUs, their NICs,
//! and a fair slice of whole cores on its GPUs' NUMA nodes (ranks sharing a node split it), with
//! memory on those nodes. The plan is pure data: `berth topo plan` prints it, `bind` applies it
//! to a process, and the SPANK plugin hands it to each task.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::distance::Link;
use super::job::{GpuId, Job};
use super::node::{Gpu, Nic, Node};
use super::{Bdf, CpuSet, TopologyError};

/// Whether tasks are pinned (`--container-bind`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum BindMode {
    /// Each task gets its GPU's closest NIC and a slice of cores on the GPU's NUMA node.
    #[default]
    Closest,
    /// Leave placement to Slurm.
    None,
}

/// How ranks see GPU numbers in CUDA_VISIBLE_DEVICES.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Numbering {
    /// 0..n-1 over the step's GPUs in bus order: what a process sees inside a berth container
    /// (or a device cgroup) that holds only the step's GPUs.
    #[default]
    Allocated,
    /// The node's NVML indices: bare metal without device constraint.
    Host,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlanOptions {
    pub numbering: Numbering,
    /// CPUs the step may use (its cpuset); `None`: every online CPU.
    pub allowed_cpus: Option<CpuSet>,
    /// NUMA nodes the step may allocate on; `None`: every node.
    pub allowed_mems: Option<CpuSet>,
    /// Where the NCCL topology file is (added as NCCL_TOPO_FILE).
    pub nccl_topo_file: Option<PathBuf>,
}

/// A GPU paired with its closest compute NIC.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Pair {
    pub gpu: u32,
    pub bdf: Bdf,
    pub nic: Option<String>,
    pub link: Option<Link>,
    pub numa: Option<u32>,
}

/// Pairs every GPU with a compute NIC: the closest, and among equally close ones the one fewest
/// GPUs use so far (then the lowest PCI address), so GPUs spread over NICs at the same distance.
pub fn pairing(node: &Node) -> Vec<Pair> {
    let nics: Vec<&Nic> = node.compute_nics().collect();
    let mut used = vec![0u32; nics.len()];
    node.gpus
        .iter()
        .map(|g| {
            let best = nics
                .iter()
                .enumerate()
                .filter_map(|(i, n)| node.gpu_nic(g, n).map(|l| (l, used[i], i)))
                .min();
            if let Some((_, _, i)) = best {
                used[i] += 1;
            }
            Pair {
                gpu: g.index,
                bdf: g.bdf,
                nic: best.map(|(_, _, i)| nics[i].name.clone()),
                link: best.map(|(l, _, _)| l),
                numa: g.numa,
            }
        })
        .collect()
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PlanGpu {
    /// NVML index on the node.
    pub index: u32,
    /// The number the rank uses in CUDA_VISIBLE_DEVICES.
    pub visible: u32,
    pub bdf: Bdf,
    pub uuid: Option<String>,
    pub minor: Option<u32>,
    pub numa: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PlanNic {
    pub name: String,
    pub ports: Vec<u32>,
    /// Distance from the rank's GPU it is paired with.
    pub link: Option<Link>,
    pub numa: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RankPlan {
    /// SLURM_LOCALID.
    pub rank: u32,
    pub gpus: Vec<PlanGpu>,
    pub nics: Vec<PlanNic>,
    /// The CPUs the rank runs on (sched_setaffinity / cpuset.cpus).
    pub cpus: CpuSet,
    /// The NUMA nodes it allocates memory on (set_mempolicy / cpuset.mems).
    pub mems: CpuSet,
    /// Variables to set for the rank, in order.
    pub env: Vec<(String, String)>,
}

impl RankPlan {
    pub fn env_value(&self, key: &str) -> Option<&str> {
        self.env
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct NodePlan {
    /// The step's GPUs on this node, in bus order.
    pub gpus: Vec<PlanGpu>,
    /// The compute HCAs NCCL may use (NCCL_IB_HCA, exact names).
    pub hcas: Vec<String>,
    pub ranks: Vec<RankPlan>,
    pub warnings: Vec<String>,
}

/// The GPUs a job names, resolved against the node, deduplicated, in index order.
pub fn allocated_gpus<'a>(node: &'a Node, job: &Job) -> Result<Vec<&'a Gpu>, TopologyError> {
    let Some(ids) = &job.gpus else {
        return Ok(node.gpus.iter().collect());
    };
    let var = job.gpus_from.clone().unwrap_or_else(|| "GPUs".into());
    let value = ids
        .iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let mut out: Vec<&Gpu> = Vec::new();
    for id in ids {
        let found = node.gpus.iter().find(|g| match id {
            GpuId::Index(i) => g.index == *i,
            GpuId::Uuid(u) => g.uuid.as_deref() == Some(u.as_str()),
            GpuId::Bus(b) => g.bdf == *b,
        });
        let Some(g) = found else {
            let have = if node.gpus.is_empty() {
                "it has no GPU".to_string()
            } else {
                format!(
                    "it has GPUs {}",
                    node.gpus.iter().map(|g| g.index).collect::<CpuSet>()
                )
            };
            return Err(TopologyError::Job {
                var,
                value,
                why: format!(
                    "GPU {id} is not on this node ({have}); check the job's GPU allocation and gres.conf"
                ),
            });
        };
        if !out.iter().any(|o| o.bdf == g.bdf) {
            out.push(g);
        }
    }
    out.sort_by_key(|g| g.index);
    Ok(out)
}

/// Element `s` of `k` fair shares of `items`: contiguous chunks whose sizes differ by at most
/// one; when there are fewer items than shares, shares take one item each, round the items.
fn share<T: Clone>(items: &[T], k: usize, s: usize) -> Vec<T> {
    if items.is_empty() || k == 0 {
        return Vec::new();
    }
    if items.len() >= k {
        items[s * items.len() / k..(s + 1) * items.len() / k].to_vec()
    } else {
        vec![items[s * items.len() / k].clone()]
    }
}

/// The CPUs the step may use (its cpuset within the node's online CPUs) and the NUMA nodes that
/// have any of them.
fn step_cpus(node: &Node, opts: &PlanOptions) -> Result<(CpuSet, Vec<u32>), TopologyError> {
    let allowed = match &opts.allowed_cpus {
        Some(a) => a.intersection(&node.cpus.online),
        None => node.cpus.online.clone(),
    };
    if allowed.is_empty() {
        return Err(TopologyError::Plan(format!(
            "the step's CPUs ({}) are none of the node's online CPUs ({})",
            opts.allowed_cpus.clone().unwrap_or_default(),
            node.cpus.online
        )));
    }
    let usable_nodes: Vec<u32> = node
        .cpus
        .numa
        .iter()
        .filter(|n| !n.cpus.intersection(&allowed).is_empty())
        .map(|n| n.id)
        .collect();
    if usable_nodes.is_empty() {
        return Err(TopologyError::Plan(format!(
            "no NUMA node lists the step's CPUs ({allowed}): check /sys/devices/system/node"
        )));
    }

    Ok((allowed, usable_nodes))
}

/// Each rank's home NUMA nodes: those of its GPUs (or a fair share of the usable nodes for a
/// rank without GPUs), the nearest usable node where the step has no CPU on them.
fn rank_homes(
    node: &Node,
    alloc: &[&Gpu],
    rank_gpus: &[Vec<usize>],
    usable_nodes: &[u32],
    warnings: &mut Vec<String>,
) -> Vec<Vec<u32>> {
    let t = rank_gpus.len();
    let mut homes: Vec<Vec<u32>> = Vec::with_capacity(t);
    for (r, gs) in rank_gpus.iter().enumerate() {
        let mut home: Vec<u32> = if gs.is_empty() {
            share(usable_nodes, t, r)
        } else {
            let mut h: Vec<u32> = gs.iter().filter_map(|&i| alloc[i].numa).collect();
            h.sort();
            h.dedup();
            if h.is_empty() {
                warnings.push(format!(
                    "rank {r}: the NUMA node of GPU {} is unknown; the rank shares every node",
                    alloc[gs[0]].index
                ));
                h = usable_nodes.to_vec();
            }
            h
        };
        let usable: Vec<u32> = home
            .iter()
            .copied()
            .filter(|n| usable_nodes.contains(n))
            .collect();
        if usable.is_empty() {
            // The step has no CPU on the GPU's node: run on the nearest node it has.
            let from = home[0];
            let near = usable_nodes
                .iter()
                .copied()
                .min_by_key(|&n| (node.cpus.distance(from, n), n))
                .unwrap_or(usable_nodes[0]);
            warnings.push(format!(
                "rank {r}: the step has no CPU on NUMA node {from}; using node {near}"
            ));
            home = vec![near];
        } else {
            home = usable;
        }
        homes.push(home);
    }

    homes
}

/// Each rank's CPUs: the allowed cores of its home nodes, split among the ranks homed there
/// (hardware threads, where a node has fewer cores than ranks).
fn rank_cpus(node: &Node, allowed: &CpuSet, homes: &[Vec<u32>]) -> Vec<CpuSet> {
    let t = homes.len();
    let mut cpus: Vec<CpuSet> = vec![CpuSet::new(); t];
    for numa in &node.cpus.numa {
        let sharers: Vec<usize> = (0..t).filter(|&r| homes[r].contains(&numa.id)).collect();
        if sharers.is_empty() {
            continue;
        }
        let cores: Vec<CpuSet> = node
            .cpus
            .cores_of(numa.id)
            .into_iter()
            .map(|c| c.threads.intersection(&numa.cpus).intersection(allowed))
            .filter(|c| !c.is_empty())
            .collect();
        // Fewer cores than ranks: split hardware threads instead.
        let units: Vec<CpuSet> = if cores.len() >= sharers.len() {
            cores
        } else {
            numa.cpus
                .intersection(allowed)
                .iter()
                .map(|c| [c].into_iter().collect())
                .collect()
        };
        for (s, &r) in sharers.iter().enumerate() {
            for unit in share(&units, sharers.len(), s) {
                cpus[r] = cpus[r].union(&unit);
            }
        }
    }

    cpus
}

/// The HCAs NCCL may use: the NICs paired with the step's GPUs (all compute NICs for a step
/// without GPUs), in the node's order; every rank gets the same list so that NCCL's view of the
/// node is the same everywhere.
fn step_hcas(node: &Node, alloc: &[&Gpu], compute: &[&Nic], pairs: &[Pair]) -> Vec<String> {
    let mut hcas: Vec<String> = Vec::new();
    if alloc.is_empty() {
        hcas.extend(compute.iter().map(|n| n.name.clone()));
    } else {
        for g in alloc {
            if let Some(name) = pairs
                .iter()
                .find(|p| p.gpu == g.index)
                .and_then(|p| p.nic.clone())
                && !hcas.contains(&name)
            {
                hcas.push(name);
            }
        }
        hcas.sort_by_key(|name| node.nics.iter().position(|n| &n.name == name));
    }
    hcas
}

/// A rank's environment: the GPUs it sees (numbered as `visible`, in PCI bus order) on a node
/// with GPUs, and UCX's devices, its NICs' ports.
fn rank_env(gpu_node: bool, visible: &[u32], nics: &[PlanNic]) -> Vec<(String, String)> {
    let mut env = Vec::new();
    if gpu_node {
        env.push(("CUDA_DEVICE_ORDER".to_string(), "PCI_BUS_ID".to_string()));
        env.push((
            "CUDA_VISIBLE_DEVICES".to_string(),
            visible
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(","),
        ));
    }
    if !nics.is_empty() {
        env.push((
            "UCX_NET_DEVICES".to_string(),
            nics.iter()
                .flat_map(|n| n.ports.iter().map(move |p| format!("{}:{p}", n.name)))
                .collect::<Vec<_>>()
                .join(","),
        ));
    }
    env
}

/// Computes the plan for every local rank of the step.
// A little over the usual length: the per-rank loop keeps the NIC choice and the rank's record
// together, as the pairing rules of the README read.
pub fn plan(node: &Node, job: &Job, opts: &PlanOptions) -> Result<NodePlan, TopologyError> {
    let mut warnings = Vec::new();
    let alloc = allocated_gpus(node, job)?;
    #[expect(
        clippy::cast_possible_truncation,
        reason = "counts the GPUs allocated on one node (a few dozen at most)"
    )]
    let tasks = if job.tasks == 0 {
        alloc.len().max(1) as u32
    } else {
        job.tasks
    };
    let pairs = pairing(node);
    #[expect(
        clippy::cast_possible_truncation,
        reason = "pos indexes the GPUs allocated on one node (a few dozen at most)"
    )]
    let plan_gpu = |g: &Gpu, pos: usize| PlanGpu {
        index: g.index,
        visible: match opts.numbering {
            Numbering::Allocated => pos as u32,
            Numbering::Host => g.index,
        },
        bdf: g.bdf,
        uuid: g.uuid.clone(),
        minor: g.minor,
        numa: g.numa,
    };
    let gpus: Vec<PlanGpu> = alloc
        .iter()
        .enumerate()
        .map(|(i, g)| plan_gpu(g, i))
        .collect();

    let (allowed, usable_nodes) = step_cpus(node, opts)?;

    // GPUs per rank, and each rank's home NUMA nodes.
    let t = tasks as usize;
    let rank_gpus: Vec<Vec<usize>> = (0..t)
        .map(|r| share(&(0..alloc.len()).collect::<Vec<_>>(), t, r))
        .collect();
    let homes = rank_homes(node, &alloc, &rank_gpus, &usable_nodes, &mut warnings);

    let cpus = rank_cpus(node, &allowed, &homes);

    // NICs: the GPUs' pairs; a rank without GPUs takes a compute NIC on its node.
    let compute: Vec<&Nic> = node.compute_nics().collect();
    let plan_nic = |n: &Nic, from: Option<&Gpu>| PlanNic {
        name: n.name.clone(),
        ports: n.ports(),
        link: from.and_then(|g| node.gpu_nic(g, n)),
        numa: n.numa,
    };
    let mut gpuless_seen: Vec<u32> = Vec::new();
    let mut ranks = Vec::with_capacity(t);
    for (rank, r) in (0..tasks).zip(0..t) {
        let my_gpus: Vec<&Gpu> = rank_gpus[r].iter().map(|&i| alloc[i]).collect();
        let mut nics: Vec<PlanNic> = Vec::new();
        if my_gpus.is_empty() {
            let local: Vec<&&Nic> = compute
                .iter()
                .filter(|n| n.numa.is_some_and(|x| homes[r].contains(&x)))
                .collect();
            let pool: Vec<&&Nic> = if local.is_empty() {
                compute.iter().collect()
            } else {
                local
            };
            if !pool.is_empty() {
                let nth = gpuless_seen.iter().filter(|&&h| h == homes[r][0]).count();
                gpuless_seen.push(homes[r][0]);
                nics.push(plan_nic(pool[nth % pool.len()], None));
            }
        } else {
            for g in &my_gpus {
                let paired = pairs
                    .iter()
                    .find(|p| p.gpu == g.index)
                    .and_then(|p| p.nic.as_deref());
                match paired.and_then(|name| node.nic(name)) {
                    Some(n) if !nics.iter().any(|x| x.name == n.name) => {
                        nics.push(plan_nic(n, Some(g)))
                    }
                    Some(_) => {}
                    None if !compute.is_empty() => warnings.push(format!(
                        "rank {r}: GPU {} has no compute NIC reachable over PCIe",
                        g.index
                    )),
                    None => {}
                }
            }
        }

        let mut mems: CpuSet = homes[r].iter().copied().collect();
        if let Some(m) = &opts.allowed_mems {
            let within = mems.intersection(m);
            mems = if within.is_empty() { m.clone() } else { within };
        }

        let visible: Vec<u32> = rank_gpus[r].iter().map(|&i| gpus[i].visible).collect();
        let env = rank_env(!node.gpus.is_empty(), &visible, &nics);
        ranks.push(RankPlan {
            rank,
            gpus: rank_gpus[r].iter().map(|&i| gpus[i].clone()).collect(),
            nics,
            cpus: cpus[r].clone(),
            mems,
            env,
        });
    }

    let hcas = step_hcas(node, &alloc, &compute, &pairs);
    for rank in ranks.iter_mut() {
        if !hcas.is_empty() {
            // '=' makes NCCL match names exactly: without it mlx5_1 would also select mlx5_10.
            rank.env
                .push(("NCCL_IB_HCA".to_string(), format!("={}", hcas.join(","))));
        }
        if let Some(f) = &opts.nccl_topo_file {
            rank.env
                .push(("NCCL_TOPO_FILE".to_string(), f.display().to_string()));
        }
    }
    Ok(NodePlan {
        gpus,
        hcas,
        ranks,
        warnings,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_are_fair_and_contiguous() {
        let items: Vec<u32> = (0..10).collect();
        let parts: Vec<Vec<u32>> = (0..3).map(|s| share(&items, 3, s)).collect();
        assert_eq!(parts, vec![vec![0, 1, 2], vec![3, 4, 5], vec![6, 7, 8, 9]]);
        let few: Vec<Vec<u32>> = (0..4).map(|s| share(&[7, 8], 4, s)).collect();
        assert_eq!(few, vec![vec![7], vec![7], vec![8], vec![8]]);
        assert!(share::<u32>(&[], 2, 0).is_empty());
    }
}
