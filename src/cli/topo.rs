//! `berth topo`: the node's GPU/NIC/CPU topology, per-rank plans for the job step in the
//! environment, pinning a command to its rank, and NVML snapshots.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;

use clap::{Args, Subcommand};

use super::Failure;
use crate::config::Config;
use crate::topology::bind::{self, MemPolicy};
use crate::topology::gpu::{GpuBackend, Nvml, Recorded};
use crate::topology::job::{self, Job};
use crate::topology::node::{self, NicPolicy, Node};
use crate::topology::plan::{self, NodePlan, Numbering, PlanOptions};
use crate::topology::{CpuSet, Host, TopologyError, cpu, nccl, render};

/// Show the node's GPUs, NICs and NUMA nodes, their distances and GPU→NIC→NUMA pairing
///
/// Distances are those of `nvidia-smi topo -m`: NV# (NVLinks), PIX (one PCIe switch), PXB
/// (several switches), PHB (a host bridge), NODE (host bridges of one NUMA node), SYS (across
/// NUMA nodes). Works without GPUs or the NVIDIA driver.
#[derive(Debug, Args)]
pub struct TopoArgs {
    #[command(subcommand)]
    pub command: Option<TopoCommand>,

    #[command(flatten)]
    pub source: Source,

    /// Print JSON instead of text
    #[arg(long, global = true)]
    pub json: bool,
}

/// Where the node is read from.
#[derive(Debug, Args, Clone, Default)]
pub struct Source {
    /// Read /sys, /proc, /dev and /etc/ld.so.cache under DIR instead of the live host
    /// [default: topology.host_root]
    #[arg(long, global = true, value_name = "DIR")]
    pub host_root: Option<PathBuf>,

    /// Use a recorded NVML snapshot (what `berth topo nvml` prints) instead of loading NVML
    #[arg(long, global = true, value_name = "FILE")]
    pub nvml_record: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
pub enum TopoCommand {
    Plan(PlanArgs),
    Exec(ExecArgs),
    Nvml(NvmlArgs),
}

/// The job step's ranks on this node and what each gets
///
/// GPUs come from SLURM_STEP_GPUS, SLURM_JOB_GPUS or CUDA_VISIBLE_DEVICES (every GPU outside
/// Slurm), the number of local ranks from SLURM_STEP_TASKS_PER_NODE, SLURM_NTASKS_PER_NODE or
/// SLURM_TASKS_PER_NODE, this rank from SLURM_LOCALID. Each rank gets its GPUs
/// (CUDA_VISIBLE_DEVICES), their closest compute NICs (UCX_NET_DEVICES), the step's HCAs for
/// NCCL (NCCL_IB_HCA, exact names), and a fair slice of whole cores with memory on its GPUs'
/// NUMA nodes.
#[derive(Debug, Args)]
pub struct PlanArgs {
    #[command(flatten)]
    pub job: JobArgs,

    /// Print only this rank [default: SLURM_LOCALID when set, else every rank]
    #[arg(long, value_name = "N")]
    pub rank: Option<u32>,

    /// Print the rank's variables as KEY=VALUE lines (with BERTH_CPUS and BERTH_MEMS) for a
    /// launcher to export
    #[arg(long)]
    pub env: bool,
}

/// Overrides of what the job's environment says.
#[derive(Debug, Args, Clone, Default)]
pub struct JobArgs {
    /// The step's GPUs: indices, GPU-UUIDs or PCI addresses [default: from the environment]
    #[arg(long, value_name = "LIST")]
    pub gpus: Option<String>,

    /// Ranks on this node [default: from the environment]
    #[arg(long, value_name = "N")]
    pub tasks: Option<u32>,

    /// The CPUs the step may use [default: the process's cpuset on the live host]
    #[arg(long, value_name = "LIST")]
    pub cpus: Option<String>,

    /// GPU numbers in CUDA_VISIBLE_DEVICES: 0..n-1 over the step's GPUs (inside a container or
    /// device cgroup), or the node's indices
    #[arg(long, value_enum, default_value_t = Numbering::Allocated)]
    pub numbering: Numbering,

    /// Write an NCCL topology file for the node here and set NCCL_TOPO_FILE
    #[arg(long, value_name = "FILE")]
    pub nccl_topo_file: Option<PathBuf>,
}

/// Pin this process to one rank's CPUs and memory nodes, set its variables, and run CMD
#[derive(Debug, Args)]
pub struct ExecArgs {
    #[command(flatten)]
    pub job: JobArgs,

    /// The rank to take [default: SLURM_LOCALID, else 0]
    #[arg(long, value_name = "N")]
    pub rank: Option<u32>,

    /// Memory policy on the rank's NUMA nodes [default: topology.memory_policy]
    #[arg(long, value_enum)]
    pub mem_policy: Option<MemPolicy>,

    /// The command and its arguments
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<String>,
}

/// Print what NVML reports (GPUs, NVLinks, ECC, remapped rows, PCIe) as JSON, for
/// --nvml-record elsewhere
#[derive(Debug, Args)]
pub struct NvmlArgs {}

pub fn failure(e: TopologyError) -> Failure {
    match e {
        TopologyError::Job { .. } => Failure::input(e.to_string()),
        other => Failure::system(other.to_string()),
    }
}

/// The host to read, from the flag or the configuration.
pub fn host(source: &Source, config: &Config) -> Host {
    Host::new(
        source
            .host_root
            .clone()
            .unwrap_or_else(|| config.topology.host_root.clone()),
    )
}

/// The GPU backend: a recording, live NVML on the live host, or "no driver" for a snapshot
/// without a recording (live NVML would describe another machine).
pub fn backend(source: &Source, config: &Config) -> Result<Box<dyn GpuBackend>, Failure> {
    if let Some(path) = &source.nvml_record {
        return Ok(Box::new(Recorded::load(path).map_err(failure)?));
    }
    if host(source, config).is_live() {
        Ok(Box::new(Nvml::new(config.topology.nvml_library.clone())))
    } else {
        Ok(Box::new(Recorded::no_driver()))
    }
}

pub fn nic_policy(config: &Config) -> NicPolicy {
    NicPolicy {
        compute: config.topology.compute_nics.clone(),
        exclude: config.topology.exclude_nics.clone(),
    }
}

/// Reads the node.
pub fn discover(source: &Source, config: &Config) -> Result<(Host, Node), Failure> {
    let host = host(source, config);
    let backend = backend(source, config)?;
    let node = node::discover(&host, backend.as_ref(), &nic_policy(config)).map_err(failure)?;
    Ok((host, node))
}

fn json<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_string_pretty(value).expect("topology values serialize")
}

/// The job from the environment with the command line's overrides.
pub fn job(args: &JobArgs) -> Result<Job, Failure> {
    let get = |k: &str| std::env::var(k).ok();
    let mut job = job::from_env(&get).map_err(failure)?;
    if let Some(list) = &args.gpus {
        job.gpus = Some(job::parse_gpus("--gpus", list).map_err(failure)?);
        job.gpus_from = Some("--gpus".into());
    }
    if let Some(n) = args.tasks {
        if n == 0 {
            return Err(Failure::input("--tasks 0: a step needs at least one rank"));
        }
        job.tasks = n;
        job.tasks_from = Some("--tasks".into());
    }
    Ok(job)
}

/// Plans the step; writes the NCCL topology file when asked.
pub fn plan_step(host: &Host, node: &Node, args: &JobArgs, job: &Job) -> Result<NodePlan, Failure> {
    let (step_cpus, step_mems) = if host.is_live() {
        cpu::step_cpuset(host)
    } else {
        (None, None)
    };
    let allowed_cpus = match &args.cpus {
        Some(list) => {
            Some(CpuSet::parse(list).map_err(|e| Failure::input(format!("--cpus: {e}")))?)
        }
        None => step_cpus,
    };
    if let Some(path) = &args.nccl_topo_file {
        nccl::write(node, path).map_err(failure)?;
    }
    plan::plan(
        node,
        job,
        &PlanOptions {
            numbering: args.numbering,
            allowed_cpus,
            allowed_mems: step_mems,
            nccl_topo_file: args.nccl_topo_file.clone(),
        },
    )
    .map_err(failure)
}

fn pick_rank(plan: &NodePlan, rank: u32) -> Result<&plan::RankPlan, Failure> {
    plan.ranks.iter().find(|r| r.rank == rank).ok_or_else(|| {
        Failure::input(format!(
            "rank {rank} is not in the step: it has {} rank(s) on this node (SLURM_LOCALID, --rank, --tasks)",
            plan.ranks.len()
        ))
    })
}

pub fn execute(args: &TopoArgs, config: &Config) -> Result<i32, Failure> {
    if let Some(TopoCommand::Exec(e)) = &args.command {
        return exec(args, e, config);
    }
    let (text, code) = output(args, config)?;
    print!("{text}");
    Ok(code)
}

/// What `berth topo` (but `exec`) prints, and its exit status.
pub fn output(args: &TopoArgs, config: &Config) -> Result<(String, i32), Failure> {
    let mut out = String::new();
    match &args.command {
        None => {
            let (_, node) = discover(&args.source, config)?;
            if args.json {
                out = json(&node) + "\n";
            } else {
                out = render::topology(&node);
            }
        }
        Some(TopoCommand::Nvml(_)) => {
            let backend = backend(&args.source, config)?;
            match backend.snapshot() {
                Ok(snap) => out = json(&snap) + "\n",
                Err(e) => return Err(Failure::system(format!("{e}: nothing to record"))),
            }
        }
        Some(TopoCommand::Plan(p)) => {
            if p.env && args.json {
                return Err(Failure::input("--env and --json: pick one output"));
            }
            let (host, node) = discover(&args.source, config)?;
            let job = job(&p.job)?;
            let plan = plan_step(&host, &node, &p.job, &job)?;
            let only = p.rank.or(job.local_id);
            if p.env {
                let r = pick_rank(&plan, only.unwrap_or(0))?;
                for (k, v) in &r.env {
                    out.push_str(&format!("{k}={v}\n"));
                }
                out.push_str(&format!("BERTH_CPUS={}\nBERTH_MEMS={}\n", r.cpus, r.mems));
                return Ok((out, 0));
            }
            out = match (only, args.json) {
                (Some(rank), true) => json(pick_rank(&plan, rank)?) + "\n",
                (None, true) => json(&plan) + "\n",
                (Some(rank), false) => render::plan(&NodePlan {
                    ranks: vec![pick_rank(&plan, rank)?.clone()],
                    ..plan.clone()
                }),
                (None, false) => render::plan(&plan),
            };
        }
        Some(TopoCommand::Exec(_)) => unreachable!("exec never returns output"),
    }
    Ok((out, 0))
}

fn exec(args: &TopoArgs, e: &ExecArgs, config: &Config) -> Result<i32, Failure> {
    let (host, node) = discover(&args.source, config)?;
    let job = job(&e.job)?;
    let plan = plan_step(&host, &node, &e.job, &job)?;
    let rank = pick_rank(&plan, e.rank.or(job.local_id).unwrap_or(0))?;
    let policy = e.mem_policy.unwrap_or(config.topology.memory_policy);
    bind::apply(rank, policy).map_err(failure)?;
    let mut cmd = std::process::Command::new(&e.command[0]);
    cmd.args(&e.command[1..]).envs(rank.env.iter().cloned());
    let err = cmd.exec();
    Err(Failure {
        code: if err.kind() == std::io::ErrorKind::NotFound {
            127
        } else {
            126
        },
        message: format!("running {}: {err}", e.command[0]),
    })
}
