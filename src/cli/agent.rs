//! `berth agent`: the node agent (`berth_agent::node`).

use std::path::{Path, PathBuf};

use clap::Args;

use super::Failure;
use crate::config::Config;

/// Run the node agent: health checks on an interval, heartbeats to the cluster controller
///
/// Checks are those of `berth health`; XIDs count once, in the round that first sees them.
/// Heartbeats go to agent.controllers (any of them: a follower names the leader). Serves
/// Prometheus metrics on agent.metrics_listen.
#[derive(Debug, Args)]
pub struct AgentArgs {
    /// Run one round (check, heartbeat) and exit: 0 when the controller took it
    #[arg(long)]
    pub once: bool,

    /// This node's Slurm name [default: agent.node_name, or the short host name]
    #[arg(long, value_name = "NAME")]
    pub node: Option<String>,
}

pub fn execute(args: &AgentArgs, config: &Config, config_path: &Path) -> Result<i32, Failure> {
    Ok(berth_agent::node::run(
        config,
        config_path,
        args.node.as_deref(),
        args.once,
    )?)
}

/// The configuration file the agent reads again each round.
pub fn config_path(explicit: Option<&Path>) -> PathBuf {
    explicit
        .map(Path::to_path_buf)
        .or_else(|| std::env::var_os("BERTH_CONFIG").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(crate::config::DEFAULT_PATH))
}
