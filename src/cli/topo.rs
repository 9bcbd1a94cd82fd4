//! `berth topo`: the node's GPU/NIC/CPU topology, per-rank plans for the job step in the
//! environment, pinning a command to its rank, and NVML snapshots.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;

use clap::{Args, Subcommand};

use super::Failure;
use crate::config::Config;
use crate::node::source as node_source;
use crate::topology::bind::{self, MemPolicy};
use crate::topology::job::Job;
use crate::topology::node::Node;
use crate::topology::plan::{NodePlan, Numbering};
use crate::topology::{Host, render, step};

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
    #[arg(long, value_name = "LIST", value_parser = super::values::gpu_list)]
    pub gpus: Option<String>,

    /// Ranks on this node [default: from the environment]
    #[arg(long, value_name = "N")]
    pub tasks: Option<u32>,

    /// The CPUs the step may use [default: the process's cpuset on the live host]
    #[arg(long, value_name = "LIST", value_parser = super::values::cpu_set)]
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

impl Source {
    pub fn lib(&self) -> node_source::Source {
        node_source::Source {
            host_root: self.host_root.clone(),
            nvml_record: self.nvml_record.clone(),
        }
    }
}

fn json<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_string_pretty(value).expect("topology values serialize")
}

impl JobArgs {
    fn overrides(&self) -> step::Overrides {
        step::Overrides {
            gpus: self.gpus.clone(),
            tasks: self.tasks,
            cpus: self.cpus.clone(),
            numbering: self.numbering,
            nccl_topo_file: self.nccl_topo_file.clone(),
        }
    }

    /// The step's plan on this node and the job it was made for.
    fn plan(&self, host: &Host, node: &Node) -> Result<(Job, NodePlan), Failure> {
        let o = self.overrides();
        let job = step::job(&o, &|k| std::env::var(k).ok())?;
        let plan = step::plan(host, node, &o, &job)?;
        Ok((job, plan))
    }
}

pub fn execute(args: &TopoArgs, config: &Config) -> Result<i32, Failure> {
    if let Some(TopoCommand::Exec(e)) = &args.command {
        return exec(args, e, config);
    }
    let (text, code) = output(args, config)?;
    out!("{text}");
    Ok(code)
}

/// What `berth topo` (but `exec`) prints, and its exit status.
pub fn output(args: &TopoArgs, config: &Config) -> Result<(String, i32), Failure> {
    let mut out = String::new();
    match &args.command {
        None => {
            let (_, node) = node_source::discover(&args.source.lib(), config)?;
            if args.json {
                out = json(&node) + "\n";
            } else {
                out = render::topology(&node);
            }
        }
        Some(TopoCommand::Nvml(_)) => {
            let backend = node_source::backend(&args.source.lib(), config)?;
            match backend.snapshot() {
                Ok(snap) => out = json(&snap) + "\n",
                Err(e) => return Err(Failure::system(format!("{e}: nothing to record"))),
            }
        }
        Some(TopoCommand::Plan(p)) => {
            if p.env && args.json {
                return Err(Failure::input("--env and --json: pick one output"));
            }
            let (host, node) = node_source::discover(&args.source.lib(), config)?;
            let (job, plan) = p.job.plan(&host, &node)?;
            let only = p.rank.or(job.local_id);
            if p.env {
                let r = step::rank(&plan, only.unwrap_or(0))?;
                for (k, v) in &r.env {
                    out.push_str(&format!("{k}={v}\n"));
                }
                out.push_str(&format!("BERTH_CPUS={}\nBERTH_MEMS={}\n", r.cpus, r.mems));
                return Ok((out, 0));
            }
            out = match (only, args.json) {
                (Some(rank), true) => json(step::rank(&plan, rank)?) + "\n",
                (None, true) => json(&plan) + "\n",
                (Some(rank), false) => render::plan(&NodePlan {
                    ranks: vec![step::rank(&plan, rank)?.clone()],
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
    let (host, node) = node_source::discover(&args.source.lib(), config)?;
    let (job, plan) = e.job.plan(&host, &node)?;
    let rank = step::rank(&plan, e.rank.or(job.local_id).unwrap_or(0))?;
    let policy = e.mem_policy.unwrap_or(config.topology.memory_policy);
    bind::apply(rank, policy).map_err(Failure::from)?;
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::topology::fixture::{self, Fixture};

    /// The DGX fixture with its NVML recording at `<root>/nvml.json`.
    pub(crate) fn dgx() -> (Fixture, Source) {
        let (f, snap) = fixture::dgx_h100();
        f.nvidia_files();
        let rec = f.root().join("nvml.json");
        std::fs::write(&rec, serde_json::to_string(&snap).unwrap()).unwrap();
        let source = Source {
            host_root: Some(f.root().to_path_buf()),
            nvml_record: Some(rec),
        };
        (f, source)
    }

    fn topo(
        source: &Source,
        command: Option<TopoCommand>,
        json: bool,
    ) -> Result<(String, i32), Failure> {
        output(
            &TopoArgs {
                command,
                source: source.clone(),
                json,
            },
            &Config::default(),
        )
    }

    fn plan_cmd(gpus: &str, tasks: u32, rank: Option<u32>, env: bool) -> Option<TopoCommand> {
        Some(TopoCommand::Plan(PlanArgs {
            job: JobArgs {
                gpus: Some(gpus.into()),
                tasks: Some(tasks),
                ..Default::default()
            },
            rank,
            env,
        }))
    }

    #[test]
    fn topo_prints_the_matrix_and_json() {
        let (_f, source) = dgx();
        let (text, code) = topo(&source, None, false).unwrap();
        assert_eq!(code, 0);
        assert!(text.starts_with("       GPU0  GPU1"), "{text}");
        assert!(
            text.contains("NVIDIA driver: 550.54.15 (NVML), CUDA 12.4"),
            "{text}"
        );
        let (json, _) = topo(&source, None, true).unwrap();
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v["gpus"].as_array().unwrap().len(), 8);
        assert_eq!(v["gpus"][5]["bdf"], "0000:c3:00.0");
        assert_eq!(v["nics"][1]["role"], "storage");
        assert_eq!(v["driver"]["nvml"]["available"], true);
        let (rec, _) = topo(&source, Some(TopoCommand::Nvml(NvmlArgs {})), false).unwrap();
        let back: crate::topology::gpu::NvmlSnapshot = serde_json::from_str(&rec).unwrap();
        assert_eq!(back.gpus.len(), 8);
    }

    #[test]
    fn topo_plan_prints_ranks_env_and_json() {
        let (f, source) = dgx();
        let (text, _) = topo(&source, plan_cmd("2,5", 2, None, false), false).unwrap();
        assert_eq!(
            text,
            "GPUs: 2,5; HCAs for NCCL: mlx5_4,mlx5_9; ranks: 2\n\
             rank 0: GPU 2 (0000:52:00.0) -> mlx5_4 (PXB) -> CPUs 0-55,112-167, memory node 0\n  \
             CUDA_DEVICE_ORDER=PCI_BUS_ID\n  CUDA_VISIBLE_DEVICES=0\n  UCX_NET_DEVICES=mlx5_4:1\n  \
             NCCL_IB_HCA==mlx5_4,mlx5_9\n\
             rank 1: GPU 5 (0000:c3:00.0) -> mlx5_9 (PXB) -> CPUs 56-111,168-223, memory node 1\n  \
             CUDA_DEVICE_ORDER=PCI_BUS_ID\n  CUDA_VISIBLE_DEVICES=1\n  UCX_NET_DEVICES=mlx5_9:1\n  \
             NCCL_IB_HCA==mlx5_4,mlx5_9\n"
        );
        let (env, _) = topo(&source, plan_cmd("0-7", 8, Some(6), true), false).unwrap();
        assert_eq!(
            env,
            "CUDA_DEVICE_ORDER=PCI_BUS_ID\nCUDA_VISIBLE_DEVICES=6\nUCX_NET_DEVICES=mlx5_10:1\n\
             NCCL_IB_HCA==mlx5_0,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_9,mlx5_10,mlx5_11\n\
             BERTH_CPUS=84-97,196-209\nBERTH_MEMS=1\n"
        );
        let (json, _) = topo(&source, plan_cmd("0-7", 4, Some(3), false), true).unwrap();
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v["rank"], 3);
        assert_eq!(v["cpus"], "84-111,196-223");
        assert_eq!(v["nics"][1]["name"], "mlx5_11");
        // The NCCL topology file is written and named.
        let file = f.root().join("nccl-topo.xml");
        let cmd = Some(TopoCommand::Plan(PlanArgs {
            job: JobArgs {
                gpus: Some("0".into()),
                tasks: Some(1),
                nccl_topo_file: Some(file.clone()),
                ..Default::default()
            },
            rank: Some(0),
            env: true,
        }));
        let (env, _) = topo(&source, cmd, false).unwrap();
        assert!(env.contains(&format!("NCCL_TOPO_FILE={}\n", file.display())));
        assert!(
            std::fs::read_to_string(&file)
                .unwrap()
                .starts_with("<system version=\"1\">")
        );
    }

    #[test]
    fn topo_plan_refuses_bad_input_with_one_line() {
        let (_f, source) = dgx();
        let err = topo(&source, plan_cmd("0,12", 2, None, false), false).unwrap_err();
        assert_eq!(err.code, 2);
        assert_eq!(
            err.message,
            "--gpus=0,12: GPU 12 is not on this node (it has GPUs 0-7); check the job's GPU allocation and gres.conf"
        );
        let err = topo(&source, plan_cmd("0", 1, Some(3), false), false).unwrap_err();
        assert!(
            err.message
                .starts_with("rank 3 is not in the step: it has 1 rank(s)")
        );
        let err = topo(&source, plan_cmd("0", 0, None, false), false).unwrap_err();
        assert_eq!(err.message, "--tasks 0: a step needs at least one rank");
        let missing = Source {
            nvml_record: Some("/nonexistent/nvml.json".into()),
            ..source
        };
        let err = topo(&missing, None, false).unwrap_err();
        assert_eq!(
            err.message,
            "reading /nonexistent/nvml.json: No such file or directory (os error 2)"
        );
    }

    #[test]
    fn topo_runs_on_this_host() {
        // This machine: no GPU, no NVIDIA driver, virtio devices only.
        let (text, code) = topo(&Source::default(), None, false).unwrap();
        assert_eq!(code, 0);
        assert!(text.contains("NUMA nodes:\n  0: CPUs"), "{text}");
        assert!(text.contains("NVIDIA driver: "), "{text}");
        let (json, _) = topo(&Source::default(), None, true).unwrap();
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert!(v["cpus"]["online"].as_str().is_some());
        let (plan, _) = topo(&Source::default(), plan_cmd("", 1, None, true), false).unwrap();
        assert!(plan.contains("BERTH_CPUS="), "{plan}");
    }
}
