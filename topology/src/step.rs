//! A job step's plan on this node, as `berth topo plan`/`exec` make it: the job from Slurm's
//! environment with the caller's overrides, the CPUs the step may use, the NCCL topology file,
//! and one rank of the plan.

use std::path::PathBuf;

use crate::job::{self, Job};
use crate::node::Node;
use crate::plan::{self, NodePlan, Numbering, PlanOptions, RankPlan};
use crate::{CpuSet, Host, TopologyError, cpu, nccl};

/// What the caller says instead of the job's environment.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    /// The step's GPUs (indexes, GPU-UUIDs, PCI addresses).
    pub gpus: Option<String>,
    /// Ranks on this node.
    pub tasks: Option<u32>,
    /// The CPUs the step may use, instead of the process's cpuset.
    pub cpus: Option<String>,
    pub numbering: Numbering,
    /// Where to write the node's NCCL topology file (and point NCCL_TOPO_FILE).
    pub nccl_topo_file: Option<PathBuf>,
}

/// The job from `get` (the environment) with `o`'s overrides.
pub fn job(o: &Overrides, get: &dyn Fn(&str) -> Option<String>) -> Result<Job, TopologyError> {
    let mut job = job::from_env(get)?;
    if let Some(list) = &o.gpus {
        job.gpus = Some(job::parse_gpus("--gpus", list)?);
        job.gpus_from = Some("--gpus".into());
    }
    if let Some(n) = o.tasks {
        if n == 0 {
            return Err(TopologyError::Input(
                "--tasks 0: a step needs at least one rank".into(),
            ));
        }
        job.tasks = n;
        job.tasks_from = Some("--tasks".into());
    }
    Ok(job)
}

/// Plans the step on `node`; writes the NCCL topology file when asked.
pub fn plan(host: &Host, node: &Node, o: &Overrides, job: &Job) -> Result<NodePlan, TopologyError> {
    let (step_cpus, step_mems) = if host.is_live() {
        cpu::step_cpuset(host)
    } else {
        (None, None)
    };
    let allowed_cpus = match &o.cpus {
        Some(list) => {
            Some(CpuSet::parse(list).map_err(|e| TopologyError::Input(format!("--cpus: {e}")))?)
        }
        None => step_cpus,
    };
    if let Some(path) = &o.nccl_topo_file {
        nccl::write(node, path)?;
    }
    plan::plan(
        node,
        job,
        &PlanOptions {
            numbering: o.numbering,
            allowed_cpus,
            allowed_mems: step_mems,
            nccl_topo_file: o.nccl_topo_file.clone(),
        },
    )
}

/// Rank `rank` of the plan, or why it is not on this node.
pub fn rank(plan: &NodePlan, rank: u32) -> Result<&RankPlan, TopologyError> {
    plan.ranks.iter().find(|r| r.rank == rank).ok_or_else(|| {
        TopologyError::Input(format!(
            "rank {rank} is not in the step: it has {} rank(s) on this node (SLURM_LOCALID, --rank, --tasks)",
            plan.ranks.len()
        ))
    })
}
