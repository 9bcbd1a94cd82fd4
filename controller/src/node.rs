//! A node's replicated record: what it should be in Slurm and who decided it, its checks'
//! verdicts, and the counters the drain/resume rules keep. The state machine (state.rs) and the
//! rolling maintenances (rollout.rs) both change it.

use std::collections::BTreeMap;

use berth_api::{Severity, Status};
use serde::{Deserialize, Serialize};

/// What a node should be in Slurm.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Desired {
    Up,
    Drained { reason: String, by: DrainedBy },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DrainedBy {
    Berth,
    Admin,
    /// A rollout's drain (issue 31): only the rollout, or an admin, lifts it.
    Rollout,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckState {
    pub status: Status,
    pub severity: Severity,
    pub recoverable: bool,
    pub message: String,
    /// Failures in a row, counted up to the soft threshold.
    pub fails: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeState {
    pub boot_id: String,
    pub version: String,
    pub checks: BTreeMap<String, CheckState>,
    pub desired: Desired,
    /// Heartbeats in a row with every check passing, while berth holds the node drained.
    pub passes: u32,
    /// Whether berth's drain may be lifted by passes (every check it drained for can recover).
    pub recoverable: bool,
    /// When berth drained the node, within the flapping window.
    pub drains_ms: Vec<u64>,
    /// A drain the breaker held back (its reason).
    pub suppressed: Option<String>,
    /// The reason of an admin's drain the admin lifted with `berth cluster resume`: the
    /// reconciler may lift that reason in Slurm too.
    pub resume_reason: Option<String>,
}

impl NodeState {
    pub(crate) fn new(boot_id: String, version: String) -> Self {
        Self {
            boot_id,
            version,
            checks: BTreeMap::new(),
            desired: Desired::Up,
            passes: 0,
            recoverable: true,
            drains_ms: Vec::new(),
            suppressed: None,
            resume_reason: None,
        }
    }
}

impl Desired {
    pub fn word(&self) -> &'static str {
        match self {
            Desired::Up => "up",
            Desired::Drained { .. } => "drained",
        }
    }
}
