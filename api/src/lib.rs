//! The requests and responses that berth's node agent (`berth agent`), admin CLI (`berth
//! cluster`) and cluster controller (`berth-controller`) exchange as JSON over HTTP. Both sides
//! build against this crate so that a field renamed on one side fails to compile on the other.
//!
//! Every request proves that its sender holds the cluster's shared key (the content of the key
//! file, like munge.key) and every answer that its server does, without the key ever being sent:
//! see [`auth`]. The controller answers 401 to a request without a valid proof.

pub mod auth;

use serde::{Deserialize, Serialize};

/// The header a follower sets on its 421 answer: the leader's API address, when it knows it.
pub const LEADER_HEADER: &str = "x-berth-leader";

/// The HTTP status a follower answers a leader-only request with (421 Misdirected Request),
/// its body a [`NotLeader`].
pub const NOT_LEADER_STATUS: u16 = 421;

/// The most bytes a key file may hold.
pub const KEY_MAX: usize = 4096;

/// What one health check found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    Fail,
    /// The check could not say (it timed out, its source was unreadable): never drains.
    Unknown,
}

/// How a failing check is acted on: hard drains on its first failure, soft after two in a row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Hard,
    Soft,
}

/// One check's result in a heartbeat.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckResult {
    pub name: String,
    pub status: Status,
    pub severity: Severity,
    /// Whether a drain for this check may be lifted after passes (a missing GPU that came
    /// back may; an XID or an uncorrectable ECC error needs an admin).
    pub recoverable: bool,
    /// One line: what was seen.
    pub message: String,
}

/// What a daemon check found (issue 17): `not-configured` is not `down` (a cluster without
/// slurmdbd, a node whose agent is told not to look).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DaemonState {
    Up,
    Down,
    /// The check could not say (it timed out, its tool is missing).
    Unknown,
    NotConfigured,
}

impl DaemonState {
    pub fn word(self) -> &'static str {
        match self {
            DaemonState::Up => "up",
            DaemonState::Down => "down",
            DaemonState::Unknown => "unknown",
            DaemonState::NotConfigured => "not configured",
        }
    }
}

/// One daemon's state: on a node `slurmd` and `munge` (the agent's checks, in its heartbeat);
/// on the controller `slurmctld` (the primary), `slurmctld-backup`, `slurmdbd`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DaemonReport {
    pub daemon: String,
    pub state: DaemonState,
    /// One line: what was seen.
    pub message: String,
}

/// What an agent posts to `POST /v1/heartbeat`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// Slurm's name of the node.
    pub node: String,
    /// The kernel's boot id (`/proc/sys/kernel/random/boot_id`): a new one is a reboot.
    pub boot_id: String,
    /// berth's version on the node.
    pub version: String,
    pub checks: Vec<CheckResult>,
    /// Other versions that matter to an admin comparing nodes: `kernel`, `nvidia-driver`.
    #[serde(default)]
    pub versions: std::collections::BTreeMap<String, String>,
    /// Digests of the images in the node's store.
    #[serde(default)]
    pub images: Vec<String>,
    /// What ended jobs left behind, one line each (`container <id>`: a container whose berth
    /// process died, with its cgroup and state; `scratch <job>`: the scratch of a job that
    /// is no longer running; `mount <digest>`: an image mounted that no container uses).
    #[serde(default)]
    pub leftovers: Vec<String>,
    /// Why this heartbeat was sent before its interval: `change` when a check's status
    /// changed since the last heartbeat the controller took.
    #[serde(default)]
    pub cause: Option<String>,
    /// The node's Slurm daemons (slurmd, munge). Agents before issue 17 send none.
    #[serde(default)]
    pub daemons: Vec<DaemonReport>,
    /// Where the node serves the image blobs it keeps to other nodes (`peers.advertise`).
    #[serde(default)]
    pub peer: Option<String>,
    /// The node's stored registry images: canonical reference → manifest digest.
    #[serde(default)]
    pub refs: std::collections::BTreeMap<String, String>,
    /// Where the rollout step the leader ordered stands (issue 31); agents before it send none.
    #[serde(default)]
    pub step_report: Option<StepReport>,
}

/// The most bytes of a step's output an agent reports and the controller keeps (its tail).
pub const STEP_OUTPUT_MAX: usize = 4096;

/// What a rollout step does on its node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "kind")]
pub enum StepAction {
    /// `sh -c COMMAND` as root.
    Command { command: String },
    /// The agent's reboot command (`agent.reboot_command`); done once a new boot id is seen.
    Reboot,
}

/// The leader's order to a node's agent, repeated in every heartbeat answer until the agent
/// reports the step ended. The agent runs a step at most once (its record, `agent.rollout_dir`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepOrder {
    pub rollout: u64,
    pub action: StepAction,
    /// The command is killed after this long (a reboot must show a new boot id by then).
    pub timeout_s: u64,
    /// Sent once the step is done and the node is at its health gate: the admin's check
    /// (`sh -c`, as root), which must exit 0 too before the node resumes.
    #[serde(default)]
    pub gate_command: Option<String>,
}

/// The last run of a rollout's admin gate check on a node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GateCheck {
    pub ok: bool,
    /// How it ended and its output's last line, bounded.
    pub message: String,
}

/// Where a step stands on its node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StepState {
    Running,
    Ok,
    Failed,
}

/// The agent's account of the step it was ordered, from its record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepReport {
    pub rollout: u64,
    pub state: StepState,
    /// Why it failed (or how it ended), one line.
    #[serde(default)]
    pub reason: Option<String>,
    #[serde(default)]
    pub exit: Option<i32>,
    /// The last [`STEP_OUTPUT_MAX`] bytes of its stdout and stderr.
    #[serde(default)]
    pub output: String,
    /// The admin gate check's last run, while the node is at its gate.
    #[serde(default)]
    pub gate: Option<GateCheck>,
}

/// One node in the image catalog (`GET /v1/catalog`, the leader's memory of heartbeats).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CatalogNode {
    pub node: String,
    /// Where it serves blobs; `None` when it serves none.
    pub peer: Option<String>,
    /// Canonical reference → manifest digest of its stored registry images.
    pub refs: std::collections::BTreeMap<String, String>,
    /// Seconds since its last heartbeat.
    pub age_s: f64,
}

/// `POST /v1/warm` to a node's agent (on `peers.listen`): import `reference`, fetching blobs
/// from `peers` (in order) before the registry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WarmRequest {
    pub reference: String,
    pub peers: Vec<String>,
}

/// The agent's answer to a warm: the image's digest, or why it failed (one line).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WarmReply {
    pub node: String,
    pub digest: Option<String>,
    pub error: Option<String>,
    pub seconds: f64,
}

/// The controller's answer to a heartbeat.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeartbeatReply {
    /// The leader's Raft term.
    pub term: u64,
    /// The node's desired state after this heartbeat: `up` or `drained`.
    pub desired: String,
    /// A rollout step for this node to run (or report on); controllers before issue 31 send none.
    #[serde(default)]
    pub step: Option<StepOrder>,
    /// Send the next heartbeat within this many milliseconds (a node in a rollout step: its
    /// order and its health gate do not wait a whole interval).
    #[serde(default)]
    pub next_beat_ms: Option<u64>,
}

/// A follower's answer to a request only the leader serves.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NotLeader {
    /// The leader's API address (`host:port`), when the follower knows one.
    pub leader: Option<String>,
}

/// `POST /v1/drain`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainRequest {
    pub node: String,
    pub reason: String,
}

/// `POST /v1/resume`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResumeRequest {
    pub node: String,
}

/// One node as the controller sees it (`GET /v1/nodes`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeView {
    pub node: String,
    /// `up` or `drained`.
    pub desired: String,
    /// The drain reason, when drained.
    pub reason: Option<String>,
    /// Who drained it: `berth` or `admin`.
    pub drained_by: Option<String>,
    pub boot_id: String,
    pub version: String,
    /// Failing checks, `name: message`.
    pub failing: Vec<String>,
    /// Checks that could not say (timed out, unreadable), `name: message`: never a drain.
    #[serde(default)]
    pub unknown: Vec<String>,
    /// From the last heartbeat (the leader's memory; empty on a follower): other versions,
    /// stored image digests, leftovers of ended jobs.
    #[serde(default)]
    pub versions: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    pub images: Vec<String>,
    #[serde(default)]
    pub leftovers: Vec<String>,
    /// Seconds since the leader last heard from the node; `None` when it has not since it
    /// became leader.
    pub heartbeat_age_s: Option<f64>,
    /// A drain the circuit breaker held back.
    pub suppressed: Option<String>,
    /// The node's Slurm daemons from its last heartbeat (the leader's memory).
    #[serde(default)]
    pub daemons: Vec<DaemonReport>,
    /// The leftovers the leader confirmed as of ended jobs (`squeue` no longer runs their job,
    /// or they belong to none), each `LEFTOVER (AGE s)`, the age since the leader first saw it.
    #[serde(default)]
    pub orphaned: Vec<String>,
}

/// One `scontrol takeover` the leader decided, as committed to the Raft log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TakeoverView {
    /// When it was decided (Unix milliseconds, the leader's clock).
    pub at_unix_ms: u64,
    /// The deciding leader's Raft id and term.
    pub by: u64,
    pub term: u64,
    /// The backup slurmctld told to take over.
    pub backup: String,
    /// Why, one line (the failed pings).
    pub reason: String,
    /// What `scontrol takeover` answered; `None` until the leader recorded it.
    pub outcome: Option<String>,
}

/// `GET /v1/slurm` (the leader): Slurm's daemons as the controller and the agents see them,
/// the takeovers decided, and the leftovers of ended jobs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SlurmView {
    /// slurmctld (primary), slurmctld-backup, slurmdbd, by the leader's checks.
    pub daemons: Vec<DaemonReport>,
    /// Seconds since the primary slurmctld last wrote its heartbeat file in StateSaveLocation;
    /// `None` when it cannot be read from here.
    pub ctld_heartbeat_age_s: Option<f64>,
    /// Failed pings of the primary in a row.
    pub primary_fails: u32,
    /// Whether the leader would take over (a backup is configured and takeover is enabled).
    pub takeover_armed: bool,
    /// The last takeovers, oldest first.
    pub takeovers: Vec<TakeoverView>,
    pub takeovers_total: u64,
    /// Node daemons not up, `node: daemon: state: message`.
    pub node_daemons_down: Vec<String>,
    /// Leftovers of ended jobs, `node: leftover (AGE s)`.
    pub orphaned: Vec<String>,
}

/// `GET /v1/status`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterStatus {
    /// The controller that answered.
    pub id: u64,
    pub leader: Option<u64>,
    pub leader_addr: Option<String>,
    pub term: u64,
    /// Raft index of the last applied entry.
    pub applied: u64,
    pub voters: Vec<u64>,
    pub nodes: usize,
    pub drained: usize,
    pub breaker_tripped: bool,
    /// Drains held back by the breaker since its last reset.
    pub suppressed: u64,
    /// A hash of the replicated state, equal on replicas that applied the same entries.
    pub state_hash: String,
}

/// `POST /v1/rollout/start` (`berth cluster rollout start|dry-run`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutRequest {
    /// A Slurm hostlist (`gpu[001-064]`); with `partition` unset too: every node.
    pub nodes: Option<String>,
    pub partition: Option<String>,
    /// Run `sh -c COMMAND` as root on each node; `None` with `reboot`.
    pub command: Option<String>,
    pub reboot: bool,
    /// Per node: the command is killed after this long; a reboot, and the health gate after
    /// it, must pass within it too.
    pub timeout_s: u64,
    /// At most this many nodes out of service at once: `N` or `P%` of the rollout's nodes.
    pub max_unavailable: String,
    /// At most this many nodes of each partition out of service at once: `N`, or `P%` of the
    /// rollout's nodes in that partition; `None`: only `max_unavailable`.
    #[serde(default)]
    pub max_unavailable_per_partition: Option<String>,
    /// The admin's own check for the health gate (`sh -c`, as root, on the node): the node
    /// resumes only once it exits 0 too.
    #[serde(default)]
    pub gate_command: Option<String>,
    /// `None`: wait for a node's jobs to end, however long. `Some(s)`: a node still running jobs
    /// `s` seconds after its drain is skipped (resumed, left for a later rollout).
    pub deadline_s: Option<u64>,
    /// Heartbeats in a row with every check passing and the daemons up before a node resumes.
    pub gate_passes: u32,
    /// Failed nodes that stop the rollout.
    pub failure_threshold: u32,
    /// Include nodes drained (by an admin or by health) before the rollout.
    pub include_drained: bool,
    /// Only plan: answer the batches, commit nothing.
    pub dry_run: bool,
}

/// `POST /v1/rollout/{pause,resume,abort}`: the rollout in progress, or `id`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutControl {
    pub id: Option<u64>,
}

/// One node's step in a rollout.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutStepView {
    pub node: String,
    /// `waiting`, `draining` (waiting for its jobs), `running`, `gating`, `done`, `failed`,
    /// `skipped`.
    pub phase: String,
    /// When it entered that phase, when its action started and when it ended (Unix ms).
    pub since_unix_ms: u64,
    pub started_unix_ms: Option<u64>,
    pub ended_unix_ms: Option<u64>,
    pub reason: Option<String>,
    pub exit: Option<i32>,
    /// Its output's tail: only in `GET /v1/rollout?node=NODE`.
    #[serde(default)]
    pub output: Option<String>,
}

/// A rollout as the controller keeps it (`GET /v1/rollout`, the last one) or plans it (a dry
/// run: `batches` filled, nothing committed).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutView {
    pub id: u64,
    /// `running`, `paused`, `aborted`, `failed`, `done`, or `dry-run`.
    pub state: String,
    /// What each node runs, in words.
    pub action: String,
    pub selection: String,
    pub max_unavailable: u32,
    /// Per partition (`--max-unavailable-per-partition`); empty: none.
    #[serde(default)]
    pub partition_limits: std::collections::BTreeMap<String, u32>,
    /// The admin's gate check, if any.
    #[serde(default)]
    pub gate_command: Option<String>,
    pub deadline_s: Option<u64>,
    pub gate_passes: u32,
    pub failures: u32,
    pub failure_threshold: u32,
    /// Why it stopped (failed or aborted).
    pub stopped: Option<String>,
    pub created_unix_ms: u64,
    pub ended_unix_ms: Option<u64>,
    pub steps: Vec<RolloutStepView>,
    /// The planned batches in order (a dry run).
    #[serde(default)]
    pub batches: Vec<Vec<String>>,
}

/// An error answer: one line.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorReply {
    pub error: String,
}

/// Why a key file of owner `uid` and mode `mode` (as `stat` gives them) must not be trusted by a
/// process running as `euid`, in one line; `None` when it may. The key must be a regular file
/// owned by root or by `euid` (a controller's service user) with no permission bits for group
/// or others: a key others can read lets them drain the cluster, one they can write lets them
/// lock every node out. Agents, `berth cluster` and controllers apply the same rule.
pub fn key_file_problem(uid: u32, mode: u32, euid: u32) -> Option<String> {
    const S_IFMT: u32 = 0o170000;
    const S_IFREG: u32 = 0o100000;
    if mode & S_IFMT != S_IFREG {
        return Some("not a regular file: point key_file at a file of its own".into());
    }
    if uid != 0 && uid != euid {
        return Some(format!(
            "owned by uid {uid}, not by root or by this process's user ({euid}): \
             `chown root: FILE` (or the service user's)"
        ));
    }
    if mode & 0o077 != 0 {
        return Some(format!(
            "mode {:04o} lets group or others at it: `chmod 600 FILE`",
            mode & 0o7777
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heartbeats_of_agents_before_the_daemon_watch_still_parse() {
        let old = r#"{"node":"n1","boot_id":"b","version":"0.1.0","checks":[],"leftovers":["scratch 7"]}"#;
        let hb: Heartbeat = serde_json::from_str(old).unwrap();
        assert!(hb.daemons.is_empty());
        assert_eq!(hb.leftovers, vec!["scratch 7"]);
        let new = r#"{"daemon":"slurmdbd","state":"not-configured","message":"none"}"#;
        let d: DaemonReport = serde_json::from_str(new).unwrap();
        assert_eq!(d.state, DaemonState::NotConfigured);
        assert_eq!(d.state.word(), "not configured");
    }

    #[test]
    fn key_files_must_be_private_and_owned_by_root_or_the_user() {
        assert_eq!(key_file_problem(0, 0o100600, 0), None);
        assert_eq!(key_file_problem(0, 0o100400, 500), None);
        assert_eq!(key_file_problem(500, 0o100600, 500), None);
        assert!(key_file_problem(0, 0o100644, 0).unwrap().contains("0644"));
        assert!(
            key_file_problem(0, 0o100640, 0)
                .unwrap()
                .contains("chmod 600")
        );
        assert!(key_file_problem(0, 0o100602, 0).is_some());
        assert!(
            key_file_problem(501, 0o100600, 500)
                .unwrap()
                .contains("uid 501")
        );
        assert!(key_file_problem(501, 0o100600, 0).is_some());
        assert!(
            key_file_problem(0, 0o040700, 0)
                .unwrap()
                .contains("regular")
        );
    }
}
