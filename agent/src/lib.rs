//! `berth agent` and the fleet operations around it: the node's rounds of health and Slurm
//! daemon checks and its heartbeats to the cluster controller ([`node`], [`daemons`]), the
//! controllers' client ([`client`]), the blob server and catalog lookups that let nodes fetch
//! image blobs from each other ([`peer`]), `berth cluster prewarm`'s tree of warms
//! ([`prewarm`]), and the rollout steps the controller orders a node to run ([`rollout`]).

pub mod client;
pub mod daemons;
pub mod node;
pub mod peer;
pub mod prewarm;
pub mod rollout;

/// What the agent's workflows can fail at, by kind (the binary maps kinds to exit statuses).
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The admin's input: the key file, a flag, berth.toml's `[agent]`/`[peers]`.
    #[error("{0}")]
    Input(String),
    /// The node or the cluster could not do it (a controller, a port, the host name).
    #[error("{0}")]
    Host(String),
    #[error(transparent)]
    Image(#[from] berth_image::ImageError),
    /// A program a check runs could not be started (not installed, not executable).
    #[error("running {program}: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
}

impl AgentError {
    pub fn input(message: impl Into<String>) -> Self {
        Self::Input(message.into())
    }
    pub fn host(message: impl Into<String>) -> Self {
        Self::Host(message.into())
    }
}
