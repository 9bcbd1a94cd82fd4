//! `berth cluster`: the admin's view of and hand on the cluster controller. Asks whichever
//! configured controller answers (agent.controllers); commands that change state go to the
//! leader, found through a follower's answer.

use berth_api::{ClusterStatus, DrainRequest, NodeView, ResumeRequest, SlurmView};
use clap::{Args, Subcommand};

use super::Failure;
use crate::config::Config;
use berth_agent::client::Client;

/// Ask the cluster controller: status, nodes, drain, resume, breaker reset, rollouts
#[derive(Debug, Args)]
pub struct ClusterArgs {
    /// Print the controller's answer as JSON
    #[arg(long, global = true)]
    pub json: bool,

    #[command(subcommand)]
    pub command: ClusterCommand,
}

#[derive(Debug, Subcommand)]
pub enum ClusterCommand {
    /// The controllers' Raft state, a summary of the nodes, and Slurm's daemons, takeovers and
    /// leftovers of ended jobs as the leader sees them
    Status,
    /// Every node the controller knows, its desired state and why
    Nodes,
    /// Drain a node as an admin (berth never resumes or overwrites it)
    Drain {
        node: String,
        /// Slurm's drain reason
        #[arg(long)]
        reason: String,
    },
    /// Lift a node's drain (berth's or an admin's made through berth)
    Resume { node: String },
    /// Put an image on nodes before their jobs need it, fanned out between the nodes
    Prewarm(super::prewarm::PrewarmArgs),
    /// The circuit breaker
    Breaker {
        #[command(subcommand)]
        command: BreakerCommand,
    },
    /// Rolling maintenance: run a command (or reboot) node by node, draining each first and
    /// resuming it once healthy
    Rollout {
        #[command(subcommand)]
        command: RolloutCommand,
    },
}

#[derive(Debug, Subcommand)]
pub enum RolloutCommand {
    /// Start a rollout
    Start(RolloutPlan),
    /// Print the batches a rollout would make; start nothing
    DryRun(RolloutPlan),
    /// The last rollout (or --id): each node's phase with times; --node: its output
    Status {
        #[arg(long)]
        id: Option<u64>,
        /// Only this node's step, with the tail of its command's output
        #[arg(long)]
        node: Option<String>,
    },
    /// Start no more nodes (those in progress finish)
    Pause {
        #[arg(long)]
        id: Option<u64>,
    },
    /// Go on after a pause
    Resume {
        #[arg(long)]
        id: Option<u64>,
    },
    /// Stop: nodes not started stay as they are, draining ones are resumed, running ones finish
    Abort {
        #[arg(long)]
        id: Option<u64>,
    },
}

#[derive(Debug, Args)]
pub struct RolloutPlan {
    /// The nodes: a Slurm hostlist (gpu[001-064]) [default: every node]
    #[arg(long, conflicts_with = "partition")]
    pub nodes: Option<String>,
    /// The nodes of a partition
    #[arg(long)]
    pub partition: Option<String>,
    /// What each node's agent runs as root (sh -c)
    #[arg(long, required_unless_present = "reboot", conflicts_with = "reboot")]
    pub command: Option<String>,
    /// Reboot each node (agent.reboot_command), done when it is back with a new boot id
    #[arg(long)]
    pub reboot: bool,
    /// Per node: the command's limit, and the reboot's and health gate's
    #[arg(long, default_value_t = 1800)]
    pub timeout_s: u64,
    /// Nodes out of service at once: a count or a percentage (10%)
    #[arg(long, default_value = "1")]
    pub max_unavailable: String,
    /// Also at most this many nodes of each partition out at once: a count, or a percentage
    /// of the rollout's nodes in that partition
    #[arg(long, value_name = "N|P%")]
    pub max_unavailable_per_partition: Option<String>,
    /// The admin's own health gate check, run as root on the node (sh -c) after its step:
    /// the node resumes only once it also exits 0
    #[arg(long, value_name = "CMD")]
    pub gate_command: Option<String>,
    /// Skip (resume) a node whose jobs still run this many seconds after its drain
    /// [default: wait for its jobs, however long]
    #[arg(long)]
    pub deadline_s: Option<u64>,
    /// Heartbeats in a row with every check passing and slurmd/munge up before a resume
    #[arg(long, default_value_t = 3)]
    pub gate_passes: u32,
    /// Failed nodes that stop the rollout
    #[arg(long, default_value_t = 1)]
    pub failure_threshold: u32,
    /// Include nodes drained before the rollout (by an admin or by health)
    #[arg(long)]
    pub include_drained: bool,
}

impl RolloutPlan {
    fn request(&self, dry_run: bool) -> berth_api::RolloutRequest {
        berth_api::RolloutRequest {
            nodes: self.nodes.clone(),
            partition: self.partition.clone(),
            command: self.command.clone(),
            reboot: self.reboot,
            timeout_s: self.timeout_s,
            max_unavailable: self.max_unavailable.clone(),
            max_unavailable_per_partition: self.max_unavailable_per_partition.clone(),
            gate_command: self.gate_command.clone(),
            deadline_s: self.deadline_s,
            gate_passes: self.gate_passes,
            failure_threshold: self.failure_threshold,
            include_drained: self.include_drained,
            dry_run,
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum BreakerCommand {
    /// Let held-back drains through again and start a new window
    Reset,
}

pub fn execute(args: &ClusterArgs, config: &Config) -> Result<i32, Failure> {
    if let ClusterCommand::Prewarm(p) = &args.command {
        return super::prewarm::execute(p, config, args.json);
    }
    let mut client = Client::new(config)?;
    match &args.command {
        ClusterCommand::Status => status(&mut client, args.json)?,
        ClusterCommand::Nodes => nodes(&mut client, args.json)?,
        ClusterCommand::Drain { node, reason } => {
            let body = serde_json::to_vec(&DrainRequest {
                node: node.clone(),
                reason: reason.clone(),
            })
            .expect("serializes");
            let bytes = client.ask("/v1/drain", Some(&body), true)?;
            done(args.json, &bytes, &format!("{node}: drained ({reason})"));
        }
        ClusterCommand::Resume { node } => {
            let body =
                serde_json::to_vec(&ResumeRequest { node: node.clone() }).expect("serializes");
            let bytes = client.ask("/v1/resume", Some(&body), true)?;
            done(args.json, &bytes, &format!("{node}: resumed"));
        }
        ClusterCommand::Prewarm(_) => unreachable!("handled above"),
        ClusterCommand::Rollout { command } => {
            use berth_agent::rollout::Admin;
            let op = match command {
                RolloutCommand::Start(p) => Admin::Start(p.request(false)),
                RolloutCommand::DryRun(p) => Admin::Start(p.request(true)),
                RolloutCommand::Status { id, node } => Admin::Status {
                    id: *id,
                    node: node.clone(),
                },
                RolloutCommand::Pause { id } => Admin::Pause(*id),
                RolloutCommand::Resume { id } => Admin::Resume(*id),
                RolloutCommand::Abort { id } => Admin::Abort(*id),
            };
            let view = berth_agent::rollout::admin(&mut client, &op)?;
            if args.json {
                outln!(
                    "{}",
                    json_of(&serde_json::to_value(&view).expect("serializes"))
                );
            } else {
                for l in berth_agent::rollout::lines(&view) {
                    outln!("{l}");
                }
            }
        }
        ClusterCommand::Breaker {
            command: BreakerCommand::Reset,
        } => {
            let bytes = client.ask("/v1/breaker/reset", Some(b"{}"), true)?;
            done(args.json, &bytes, "breaker reset");
        }
    }
    Ok(0)
}

fn json_of(v: &serde_json::Value) -> String {
    serde_json::to_string_pretty(v).expect("JSON values serialize")
}

/// `berth cluster status`.
fn status(client: &mut Client, json: bool) -> Result<(), Failure> {
    let s: ClusterStatus = client.ask_json("/v1/status", None, false)?;
    // The Slurm part is the leader's; without a leader it is said so, not an error.
    let slurm = client
        .ask_json::<SlurmView>("/v1/slurm", None, true)
        .map_err(|e| e.to_string());
    if json {
        let mut v = serde_json::to_value(&s).expect("serializes");
        v["slurm"] = match &slurm {
            Ok(view) => serde_json::to_value(view).expect("serializes"),
            Err(e) => serde_json::json!({ "error": e }),
        };
        outln!("{}", json_of(&v));
        return Ok(());
    }
    let leader = match (&s.leader, &s.leader_addr) {
        (Some(l), Some(a)) => format!("{l} ({a})"),
        (Some(l), None) => l.to_string(),
        _ => "none".into(),
    };
    let voters: Vec<String> = s.voters.iter().map(u64::to_string).collect();
    let breaker = if s.breaker_tripped {
        "tripped"
    } else {
        "closed"
    };
    let held = if s.suppressed > 0 {
        format!(", {} drains held back", s.suppressed)
    } else {
        String::new()
    };
    outln!("controller: {} (answering)", s.id);
    outln!("leader:     {leader}, term {}", s.term);
    outln!("voters:     {}", voters.join(", "));
    outln!("nodes:      {} ({} drained)", s.nodes, s.drained);
    outln!("breaker:    {breaker}{held}");
    outln!("applied:    {} (state {})", s.applied, &s.state_hash[..12]);
    match &slurm {
        Ok(view) => {
            for l in super::cluster_slurm::lines(view) {
                outln!("{l}");
            }
        }
        Err(e) => outln!("slurm:      unknown ({e})"),
    }
    Ok(())
}

/// `berth cluster nodes`.
fn nodes(client: &mut Client, json: bool) -> Result<(), Failure> {
    let nodes: Vec<NodeView> = client.ask_json("/v1/nodes", None, true)?;
    if json {
        outln!(
            "{}",
            json_of(&serde_json::to_value(&nodes).expect("serializes"))
        );
        return Ok(());
    }
    outln!(
        "{:<20} {:<8} {:>8} {:>5}  REASON",
        "NODE",
        "STATE",
        "HB AGE",
        "LEFT"
    );
    for n in nodes {
        let age = n
            .heartbeat_age_s
            .map_or_else(|| "-".to_string(), |a| format!("{a:.1}s"));
        outln!(
            "{:<20} {:<8} {:>8} {:>5}  {}",
            n.node,
            n.desired,
            age,
            n.leftovers.len(),
            reason(&n)
        );
    }
    Ok(())
}

/// The REASON column: the drain reason (or the one held back by the breaker), then daemons
/// down, leftovers of ended jobs and checks that could not say.
fn reason(n: &NodeView) -> String {
    let mut parts: Vec<String> = n
        .reason
        .clone()
        .or_else(|| n.suppressed.as_ref().map(|s| format!("(held back) {s}")))
        .into_iter()
        .filter(|r| !r.is_empty())
        .collect();
    let down: Vec<String> = n
        .daemons
        .iter()
        .filter(|d| {
            matches!(
                d.state,
                berth_api::DaemonState::Down | berth_api::DaemonState::Unknown
            )
        })
        .map(|d| format!("{} {}", d.daemon, d.state.word()))
        .collect();
    if !down.is_empty() {
        parts.push(format!("[{}]", down.join(", ")));
    }
    if !n.orphaned.is_empty() {
        parts.push(format!("[{} leftover(s) of ended jobs]", n.orphaned.len()));
    }
    // Checks that could not say: never a drain, but an admin wants to know.
    if !n.unknown.is_empty() {
        let names: Vec<&str> = n
            .unknown
            .iter()
            .map(|u| u.split(':').next().unwrap_or(u))
            .collect();
        parts.push(format!("[unknown: {}]", names.join(", ")));
    }
    parts.join(" ")
}

fn done(json: bool, bytes: &[u8], text: &str) {
    if json {
        outln!("{}", String::from_utf8_lossy(bytes).trim());
    } else {
        outln!("{text}");
    }
}
