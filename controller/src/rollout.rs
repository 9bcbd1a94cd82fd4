//! Rolling maintenance (issue 31): a plan of nodes, an action (a command each node's agent runs
//! as root, or a reboot), how many nodes may be out of service at once, and a health gate;
//! each node's progress through its step. The plan and every step's move are Raft entries
//! ([`Cmd`], applied by [`apply`]), so a rollout survives the leader's death and goes on under
//! the next one. What to do next is [`decide`], a pure function of the replicated state and
//! what the leader sees now (Slurm's node states, gate passes counted from heartbeats), so it
//! is the same rule on any leader and testable without Raft or Slurm.
//!
//! A node's step: `waiting` → `draining` (Slurm drain, reason `berth rollout <id>`, until
//! Slurm reports it drained with no job) → `running` (the order rides the node's heartbeat
//! answers; the agent records that it started the step before starting it and answers from
//! that record ever after, so a step is run at most once, even across a failover or an agent
//! restart) → `gating` (a reboot: a new boot id first; then `gate_passes` heartbeats in a row
//! with every check passing and the daemons up) → `done` (resumed). A failed command, a step
//! with no outcome within its timeout, or a gate not passed within it, is `failed`: the node
//! stays drained as `berth rollout <id>: <why>`, and once `failure_threshold` nodes failed no
//! new node starts (those in progress finish). Nodes already drained before the rollout are
//! `skipped` unless the plan includes them.

use std::collections::{BTreeMap, HashMap};

use berth_api::{StepAction, StepReport, StepState};
use serde::{Deserialize, Serialize};

use crate::node::{Desired, DrainedBy, NodeState};

/// The reason prefix of a rollout's drains (`berth rollout <id>`).
pub const PREFIX: &str = "berth rollout ";
/// Rollouts kept in the state (the newest; older ones are dropped).
const KEEP: usize = 20;
/// The most characters of a failed node's drain reason.
const REASON_MAX: usize = 80;
/// How long past its timeout a running step may take to report: the agent kills the command at
/// the timeout and says so; only an agent that says nothing is failed for it.
const REPORT_GRACE_MS: u64 = 30_000;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// The nodes, in the order they are taken.
    pub nodes: Vec<String>,
    /// How they were chosen, in words (`partition debug`, `gpu[1-4]`, `all`).
    pub selection: String,
    pub action: StepAction,
    pub timeout_s: u64,
    pub max_unavailable: u32,
    pub deadline_s: Option<u64>,
    pub gate_passes: u32,
    pub failure_threshold: u32,
    /// Per partition, at most this many of its nodes out of service at once (on top of
    /// `max_unavailable`); a node of several partitions counts in each.
    #[serde(default)]
    pub partition_limits: BTreeMap<String, u32>,
    /// The partitions of each node, as Slurm listed them when the plan was made.
    #[serde(default)]
    pub partitions: BTreeMap<String, Vec<String>>,
    /// The admin's own gate check (`sh -c` on the node, as root): it must exit 0 too.
    #[serde(default)]
    pub gate_command: Option<String>,
}

impl Plan {
    /// Whether `node` may leave service with `out` (partition → nodes out now) as it is.
    fn partition_room(&self, node: &str, out: &BTreeMap<&str, u32>) -> bool {
        self.partitions.get(node).is_none_or(|parts| {
            parts.iter().all(|p| {
                self.partition_limits
                    .get(p)
                    .is_none_or(|limit| out.get(p.as_str()).copied().unwrap_or(0) < *limit)
            })
        })
    }

    /// Counts `node` as out of service in each of its partitions.
    fn count_out<'a>(&'a self, node: &str, out: &mut BTreeMap<&'a str, u32>) {
        for p in self.partitions.get(node).into_iter().flatten() {
            *out.entry(p.as_str()).or_insert(0) += 1;
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    Waiting,
    Draining,
    Running,
    Gating,
    Done,
    Failed,
    Skipped,
}

impl Phase {
    pub fn word(self) -> &'static str {
        match self {
            Phase::Waiting => "waiting",
            Phase::Draining => "draining",
            Phase::Running => "running",
            Phase::Gating => "gating",
            Phase::Done => "done",
            Phase::Failed => "failed",
            Phase::Skipped => "skipped",
        }
    }

    /// Out of service because of the rollout: counts against max unavailable.
    pub fn in_flight(self) -> bool {
        matches!(self, Phase::Draining | Phase::Running | Phase::Gating)
    }

    fn ended(self) -> bool {
        matches!(self, Phase::Done | Phase::Failed | Phase::Skipped)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Step {
    pub phase: Phase,
    pub since_ms: u64,
    pub started_ms: Option<u64>,
    pub ended_ms: Option<u64>,
    pub reason: Option<String>,
    pub exit: Option<i32>,
    /// The tail of the command's output, as the agent reported it.
    pub output: String,
    /// The node's boot id when its step started: a reboot is done when it changes.
    pub boot_before: String,
    /// Whether the rollout drained the node (it was up): only then does it resume it.
    pub drained_by_us: bool,
}

impl Step {
    fn new(now_ms: u64) -> Self {
        Self {
            phase: Phase::Waiting,
            since_ms: now_ms,
            started_ms: None,
            ended_ms: None,
            reason: None,
            exit: None,
            output: String::new(),
            boot_before: String::new(),
            drained_by_us: false,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Status {
    Running,
    Paused,
    Aborted,
    Failed,
    Done,
}

impl Status {
    pub fn word(self) -> &'static str {
        match self {
            Status::Running => "running",
            Status::Paused => "paused",
            Status::Aborted => "aborted",
            Status::Failed => "failed",
            Status::Done => "done",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rollout {
    pub id: u64,
    pub plan: Plan,
    pub status: Status,
    pub created_ms: u64,
    pub ended_ms: Option<u64>,
    pub failures: u32,
    pub stopped: Option<String>,
    pub steps: BTreeMap<String, Step>,
}

impl Rollout {
    /// Whether any node is still out of service because of it, or more may start.
    pub fn live(&self) -> bool {
        matches!(self.status, Status::Running | Status::Paused)
            || self.steps.values().any(|s| s.phase.in_flight())
    }

    pub fn reason(&self) -> String {
        format!("{PREFIX}{}", self.id)
    }
}

/// Every rollout kept, oldest first, and the id the next one gets.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rollouts {
    pub next_id: u64,
    pub list: Vec<Rollout>,
}

impl Rollouts {
    /// The rollout still in progress (at most one is).
    pub fn live(&self) -> Option<&Rollout> {
        self.list.iter().rev().find(|r| r.live())
    }

    pub fn get(&self, id: u64) -> Option<&Rollout> {
        self.list.iter().find(|r| r.id == id)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Op {
    Pause,
    Resume,
    Abort,
}

/// A rollout's change, committed to the Raft log (inside `state::Command::Rollout`). Each is
/// applied only from the phase it expects, so a leader's repeated or late decision is a no-op.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Cmd {
    /// A new rollout; `skipped` are nodes left out, each with why.
    Start {
        plan: Plan,
        skipped: Vec<(String, String)>,
        now_ms: u64,
    },
    Control {
        id: u64,
        op: Op,
        now_ms: u64,
    },
    /// waiting → draining.
    Drain {
        id: u64,
        nodes: Vec<String>,
        now_ms: u64,
    },
    /// draining → running: Slurm says drained with no job; the agent is told from now on.
    Run {
        id: u64,
        node: String,
        boot_id: String,
        now_ms: u64,
    },
    /// The agent's outcome of a running step.
    Report {
        id: u64,
        node: String,
        report: StepReport,
        now_ms: u64,
    },
    /// gating → done: the gate passed; the node is resumed.
    Pass {
        id: u64,
        node: String,
        now_ms: u64,
    },
    /// Any phase in progress → failed (a timeout, the gate).
    Fail {
        id: u64,
        node: String,
        reason: String,
        now_ms: u64,
    },
    /// draining → skipped (the deadline passed with jobs still running): resumed as it was.
    Skip {
        id: u64,
        node: String,
        reason: String,
        now_ms: u64,
    },
}

fn one_line(s: &str, max: usize) -> String {
    s.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(max)
        .collect::<String>()
        .trim()
        .to_string()
}

/// The tail of `s`, at most `max` bytes, cut on a character boundary.
pub fn tail(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut start = s.len() - max;
    while !s.is_char_boundary(start) {
        start += 1;
    }
    s[start..].to_string()
}

/// Applies a rollout command; the answer is the rollout's id (0: nothing to apply it to).
pub fn apply(nodes: &mut BTreeMap<String, NodeState>, rollouts: &mut Rollouts, cmd: &Cmd) -> u64 {
    if let Cmd::Start {
        plan,
        skipped,
        now_ms,
    } = cmd
    {
        if rollouts.live().is_some() {
            return 0;
        }
        rollouts.next_id += 1;
        let id = rollouts.next_id;
        let mut steps: BTreeMap<String, Step> = plan
            .nodes
            .iter()
            .map(|n| (n.clone(), Step::new(*now_ms)))
            .collect();
        for (n, why) in skipped {
            let mut s = Step::new(*now_ms);
            s.phase = Phase::Skipped;
            s.ended_ms = Some(*now_ms);
            s.reason = Some(why.clone());
            steps.insert(n.clone(), s);
        }
        let mut r = Rollout {
            id,
            plan: plan.clone(),
            status: Status::Running,
            created_ms: *now_ms,
            ended_ms: None,
            failures: 0,
            stopped: None,
            steps,
        };
        settle(&mut r, *now_ms);
        rollouts.list.push(r);
        if rollouts.list.len() > KEEP {
            let drop = rollouts.list.len() - KEEP;
            rollouts.list.drain(..drop);
        }
        return id;
    }
    let id = match cmd {
        Cmd::Start { .. } => unreachable!("handled above"),
        Cmd::Control { id, .. }
        | Cmd::Drain { id, .. }
        | Cmd::Run { id, .. }
        | Cmd::Report { id, .. }
        | Cmd::Pass { id, .. }
        | Cmd::Fail { id, .. }
        | Cmd::Skip { id, .. } => *id,
    };
    let Some(r) = rollouts.list.iter_mut().find(|r| r.id == id) else {
        return 0;
    };
    let reason = r.reason();
    match cmd {
        Cmd::Start { .. } => {}
        Cmd::Control { op, now_ms, .. } => match (op, r.status) {
            (Op::Pause, Status::Running) => r.status = Status::Paused,
            (Op::Resume, Status::Paused) => r.status = Status::Running,
            (Op::Abort, Status::Running | Status::Paused) => {
                r.status = Status::Aborted;
                r.stopped = Some("aborted by an admin".into());
                for (name, s) in r.steps.iter_mut() {
                    match s.phase {
                        Phase::Waiting => {
                            end(s, Phase::Skipped, "aborted before it started", *now_ms);
                        }
                        // No command ran yet: the node goes back to service.
                        Phase::Draining => {
                            if s.drained_by_us {
                                undrain(nodes, name, &reason);
                            }
                            end(s, Phase::Skipped, "aborted while draining", *now_ms);
                        }
                        // A command that started is not undone: it runs to its outcome.
                        _ => {}
                    }
                }
                settle(r, *now_ms);
            }
            _ => {}
        },
        Cmd::Drain {
            nodes: names,
            now_ms,
            ..
        } => {
            if r.status != Status::Running {
                return id;
            }
            for name in names {
                let Some(s) = r.steps.get_mut(name) else {
                    continue;
                };
                if s.phase != Phase::Waiting {
                    continue;
                }
                s.phase = Phase::Draining;
                s.since_ms = *now_ms;
                let n = nodes
                    .entry(name.clone())
                    .or_insert_with(|| NodeState::new(String::new(), String::new()));
                // A node already drained (included by flag) keeps its drain and its reason.
                if n.desired == Desired::Up {
                    n.desired = Desired::Drained {
                        reason: reason.clone(),
                        by: DrainedBy::Rollout,
                    };
                    n.resume_reason = None;
                    s.drained_by_us = true;
                }
            }
        }
        Cmd::Run {
            node,
            boot_id,
            now_ms,
            ..
        } => {
            if let Some(s) = r.steps.get_mut(node)
                && s.phase == Phase::Draining
            {
                s.phase = Phase::Running;
                s.since_ms = *now_ms;
                s.started_ms = Some(*now_ms);
                s.boot_before = boot_id.clone();
            }
        }
        Cmd::Report {
            node,
            report,
            now_ms,
            ..
        } => {
            let Some(s) = r.steps.get_mut(node) else {
                return id;
            };
            if s.phase != Phase::Running || report.rollout != id {
                return id;
            }
            s.output = tail(&report.output, berth_api::STEP_OUTPUT_MAX);
            s.exit = report.exit;
            match report.state {
                StepState::Running => {}
                StepState::Ok => {
                    s.phase = Phase::Gating;
                    s.since_ms = *now_ms;
                    s.reason = report.reason.as_deref().map(|r| one_line(r, 200));
                }
                StepState::Failed => {
                    let why = report
                        .reason
                        .as_deref()
                        .map_or_else(|| "the step failed".to_string(), |r| one_line(r, 200));
                    fail(r, nodes, node, &why, *now_ms);
                }
            }
        }
        Cmd::Pass { node, now_ms, .. } => {
            if let Some(s) = r.steps.get_mut(node)
                && s.phase == Phase::Gating
            {
                if s.drained_by_us {
                    undrain(nodes, node, &reason);
                }
                end(s, Phase::Done, "", *now_ms);
                s.reason = None;
                settle(r, *now_ms);
            }
        }
        Cmd::Fail {
            node,
            reason: why,
            now_ms,
            ..
        } => {
            if r.steps.get(node).is_some_and(|s| s.phase.in_flight()) {
                fail(r, nodes, node, why, *now_ms);
            }
        }
        Cmd::Skip {
            node,
            reason: why,
            now_ms,
            ..
        } => {
            if let Some(s) = r.steps.get_mut(node)
                && s.phase == Phase::Draining
            {
                if s.drained_by_us {
                    undrain(nodes, node, &reason);
                }
                end(s, Phase::Skipped, why, *now_ms);
                settle(r, *now_ms);
            }
        }
    }
    id
}

fn end(s: &mut Step, phase: Phase, why: &str, now_ms: u64) {
    s.phase = phase;
    s.since_ms = now_ms;
    s.ended_ms = Some(now_ms);
    if !why.is_empty() {
        s.reason = Some(why.to_string());
    }
}

/// The node back in service: up, with the rollout's drain for the reconciler to lift.
fn undrain(nodes: &mut BTreeMap<String, NodeState>, node: &str, reason: &str) {
    if let Some(n) = nodes.get_mut(node)
        && matches!(
            n.desired,
            Desired::Drained {
                by: DrainedBy::Rollout,
                ..
            }
        )
    {
        n.desired = Desired::Up;
        n.resume_reason = Some(reason.to_string());
        n.passes = 0;
    }
}

/// The node failed: left drained as `berth rollout <id>: <why>`; the threshold may stop it.
fn fail(r: &mut Rollout, nodes: &mut BTreeMap<String, NodeState>, node: &str, why: &str, now: u64) {
    let reason = one_line(&format!("{}: {why}", r.reason()), REASON_MAX);
    if let Some(s) = r.steps.get_mut(node) {
        end(s, Phase::Failed, why, now);
        if s.drained_by_us
            && let Some(n) = nodes.get_mut(node)
        {
            n.desired = Desired::Drained {
                reason,
                by: DrainedBy::Rollout,
            };
        }
    }
    r.failures += 1;
    if r.failures >= r.plan.failure_threshold.max(1)
        && matches!(r.status, Status::Running | Status::Paused)
    {
        r.status = Status::Failed;
        r.stopped = Some(format!(
            "{} node(s) failed (threshold {}), the first {node}: {why}",
            r.failures,
            r.plan.failure_threshold.max(1)
        ));
    }
    settle(r, now);
}

/// Marks the rollout done when every node ended, and when it stopped with none in flight.
fn settle(r: &mut Rollout, now_ms: u64) {
    if r.steps.values().any(|s| s.phase.in_flight()) {
        return;
    }
    if r.status == Status::Running && r.steps.values().all(|s| s.phase.ended()) {
        r.status = Status::Done;
    }
    if matches!(r.status, Status::Done | Status::Failed | Status::Aborted) && r.ended_ms.is_none() {
        r.ended_ms = Some(now_ms);
    }
}

/// A node as the leader sees it in Slurm now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlurmNow {
    /// sinfo's `%T`, lower case (`idle`, `mixed`, `drained`, `draining`, …).
    pub state: String,
    /// Whether squeue lists a job on it (asked only for nodes draining).
    pub jobs: bool,
    /// sinfo's `%E`, the drain reason.
    pub reason: String,
}

impl SlurmNow {
    fn busy(&self) -> bool {
        self.jobs
            || ["alloc", "mix", "comp", "draining"]
                .iter()
                .any(|w| self.state.contains(w))
    }

    /// Drained in Slurm with nothing running: a command may run.
    fn drained_empty(&self) -> bool {
        self.state.starts_with("drained") && !self.jobs
    }
}

/// What the leader decides now for rollout `r`: the nodes to drain (up to max unavailable,
/// idle nodes before busy ones so a node's jobs delay only that node), the draining nodes to
/// run, and the timeouts, gates and deadlines reached. `passes`: heartbeats in a row that
/// passed the gate, by node (the leader's memory).
pub fn decide(
    r: &Rollout,
    nodes: &BTreeMap<String, NodeState>,
    slurm: &BTreeMap<String, SlurmNow>,
    passes: &HashMap<String, u32>,
    now_ms: u64,
) -> Vec<Cmd> {
    let id = r.id;
    let timeout_ms = r.plan.timeout_s.saturating_mul(1000);
    let mut out = Vec::new();
    for (node, s) in &r.steps {
        let waited = now_ms.saturating_sub(s.since_ms);
        match s.phase {
            Phase::Draining => {
                let now = slurm.get(node).cloned().unwrap_or_default();
                if now.drained_empty() {
                    out.push(Cmd::Run {
                        id,
                        node: node.clone(),
                        boot_id: nodes
                            .get(node)
                            .map_or_else(String::new, |n| n.boot_id.clone()),
                        now_ms,
                    });
                } else if let Some(d) = r.plan.deadline_s
                    && waited > d.saturating_mul(1000)
                {
                    out.push(Cmd::Skip {
                        id,
                        node: node.clone(),
                        reason: format!(
                            "jobs still running {d} s after the drain (the deadline): resumed, \
                             left for a later rollout"
                        ),
                        now_ms,
                    });
                }
            }
            Phase::Running if waited > timeout_ms.saturating_add(REPORT_GRACE_MS) => {
                out.push(Cmd::Fail {
                    id,
                    node: node.clone(),
                    reason: match r.plan.action {
                        StepAction::Reboot => format!(
                            "did not come back with a new boot id within {} s",
                            r.plan.timeout_s
                        ),
                        StepAction::Command { .. } => format!(
                            "no outcome from its agent within {} s (agent down?)",
                            r.plan.timeout_s
                        ),
                    },
                    now_ms,
                });
            }
            Phase::Gating => {
                let rebooted = match r.plan.action {
                    StepAction::Reboot => {
                        nodes.get(node).is_some_and(|n| n.boot_id != s.boot_before)
                    }
                    StepAction::Command { .. } => true,
                };
                if rebooted && passes.get(node).copied().unwrap_or(0) >= r.plan.gate_passes {
                    out.push(Cmd::Pass {
                        id,
                        node: node.clone(),
                        now_ms,
                    });
                } else if waited > timeout_ms {
                    let failing: Vec<String> = nodes
                        .get(node)
                        .map(|n| {
                            n.checks
                                .iter()
                                .filter(|(_, c)| c.status != berth_api::Status::Ok)
                                .map(|(k, c)| format!("{k}: {}", c.message))
                                .collect()
                        })
                        .unwrap_or_default();
                    out.push(Cmd::Fail {
                        id,
                        node: node.clone(),
                        reason: format!(
                            "health gate not passed within {} s{}",
                            r.plan.timeout_s,
                            match (failing.is_empty(), &r.plan.gate_command) {
                                (false, _) => format!(" ({})", failing.join("; ")),
                                (true, Some(c)) => format!(
                                    " (the admin gate check `{c}` did not pass: its last \
                                     result is in the controller's log)"
                                ),
                                (true, None) => String::new(),
                            }
                        ),
                        now_ms,
                    });
                }
            }
            _ => {}
        }
    }
    if r.status == Status::Running {
        // A node done but not yet resumed in Slurm is still out of service.
        let out_nodes: Vec<&String> = r
            .steps
            .iter()
            .filter(|(n, s)| {
                s.phase.in_flight()
                    || (matches!(s.phase, Phase::Done | Phase::Skipped)
                        && s.drained_by_us
                        && slurm
                            .get(*n)
                            .is_some_and(|x| x.state.contains("drain") && x.reason == r.reason()))
            })
            .map(|(n, _)| n)
            .collect();
        let mut out_by_partition = BTreeMap::new();
        for n in &out_nodes {
            r.plan.count_out(n, &mut out_by_partition);
        }
        let room = usize::try_from(r.plan.max_unavailable.max(1))
            .unwrap_or(usize::MAX)
            .saturating_sub(out_nodes.len());
        if room > 0 {
            let waiting: Vec<&String> = r
                .plan
                .nodes
                .iter()
                .filter(|n| r.steps.get(*n).is_some_and(|s| s.phase == Phase::Waiting))
                .collect();
            let (idle, busy): (Vec<&String>, Vec<&String>) = waiting
                .into_iter()
                .partition(|n| slurm.get(*n).is_none_or(|s| !s.busy()));
            let mut next: Vec<String> = Vec::new();
            for n in idle.into_iter().chain(busy) {
                if next.len() == room {
                    break;
                }
                if r.plan.partition_room(n, &out_by_partition) {
                    r.plan.count_out(n, &mut out_by_partition);
                    next.push(n.clone());
                }
            }
            if !next.is_empty() {
                out.push(Cmd::Drain {
                    id,
                    nodes: next,
                    now_ms,
                });
            }
        }
    }
    out
}

/// `N` or `P%` of `total` nodes, at least 1.
pub fn max_unavailable(spec: &str, total: usize) -> Result<u32, String> {
    let spec = spec.trim();
    let bad = || format!("max unavailable {spec:?}: write a count (2) or a percentage (10%)");
    let n = if let Some(p) = spec.strip_suffix('%') {
        let p: u64 = p.trim().parse().map_err(|_| bad())?;
        if p == 0 || p > 100 {
            return Err(bad());
        }
        let total = u64::try_from(total).unwrap_or(u64::MAX);
        (total * p).div_ceil(100)
    } else {
        spec.parse::<u64>().map_err(|_| bad())?
    };
    if n == 0 {
        return Err(bad());
    }
    Ok(u32::try_from(n).unwrap_or(u32::MAX))
}

/// The batches a plan makes when every node takes as long: its nodes in order, idle ones
/// first, `max_unavailable` at a time and no more of a partition than its limit.
pub fn batches(plan: &Plan, busy: &[String]) -> Vec<Vec<String>> {
    let (idle, b): (Vec<&String>, Vec<&String>) =
        plan.nodes.iter().partition(|n| !busy.contains(n));
    let mut left: Vec<&String> = idle.into_iter().chain(b).collect();
    let max = usize::try_from(plan.max_unavailable.max(1)).unwrap_or(usize::MAX);
    let mut out = Vec::new();
    while !left.is_empty() {
        let mut batch: Vec<String> = Vec::new();
        let mut counts = BTreeMap::new();
        left.retain(|n| {
            if batch.len() < max && plan.partition_room(n, &counts) {
                plan.count_out(n, &mut counts);
                batch.push((*n).clone());
                false
            } else {
                true
            }
        });
        if batch.is_empty() {
            // A partition limit of 0 is refused when planning; never loop on one.
            batch.push(left.remove(0).clone());
        }
        out.push(batch);
    }
    out
}

/// The API's view of a rollout; outputs only for `with_output`.
pub fn view(r: &Rollout, with_output: Option<&str>) -> berth_api::RolloutView {
    berth_api::RolloutView {
        id: r.id,
        state: r.status.word().into(),
        action: action_words(&r.plan.action),
        selection: r.plan.selection.clone(),
        max_unavailable: r.plan.max_unavailable,
        partition_limits: r.plan.partition_limits.clone(),
        gate_command: r.plan.gate_command.clone(),
        deadline_s: r.plan.deadline_s,
        gate_passes: r.plan.gate_passes,
        failures: r.failures,
        failure_threshold: r.plan.failure_threshold,
        stopped: r.stopped.clone(),
        created_unix_ms: r.created_ms,
        ended_unix_ms: r.ended_ms,
        steps: r
            .steps
            .iter()
            .filter(|(n, _)| with_output.is_none_or(|w| w == n.as_str()))
            .map(|(n, s)| berth_api::RolloutStepView {
                node: n.clone(),
                phase: s.phase.word().into(),
                since_unix_ms: s.since_ms,
                started_unix_ms: s.started_ms,
                ended_unix_ms: s.ended_ms,
                reason: s.reason.clone(),
                exit: s.exit,
                output: with_output.map(|_| s.output.clone()),
            })
            .collect(),
        batches: Vec::new(),
    }
}

pub fn action_words(a: &StepAction) -> String {
    match a {
        StepAction::Command { command } => format!("sh -c {command:?}"),
        StepAction::Reboot => "reboot".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{Command, State};

    fn plan(nodes: &[&str], max: u32) -> Plan {
        Plan {
            nodes: nodes.iter().map(|n| n.to_string()).collect(),
            selection: "test".into(),
            action: StepAction::Command {
                command: "true".into(),
            },
            timeout_s: 60,
            max_unavailable: max,
            deadline_s: None,
            gate_passes: 2,
            failure_threshold: 1,
            partition_limits: BTreeMap::new(),
            partitions: BTreeMap::new(),
            gate_command: None,
        }
    }

    fn cluster(nodes: &[&str]) -> State {
        let mut s = State::default();
        for n in nodes {
            s.apply(&Command::Register {
                node: n.to_string(),
                boot_id: "b1".into(),
                version: "v".into(),
            });
        }
        s
    }

    fn idle(nodes: &[&str]) -> BTreeMap<String, SlurmNow> {
        nodes
            .iter()
            .map(|n| {
                (
                    n.to_string(),
                    SlurmNow {
                        state: "idle".into(),
                        jobs: false,
                        reason: String::new(),
                    },
                )
            })
            .collect()
    }

    fn run(s: &mut State, c: Cmd) {
        s.apply(&Command::Rollout(c));
    }

    fn live(s: &State) -> &Rollout {
        s.rollouts.live().unwrap()
    }

    fn report(id: u64, state: StepState, reason: Option<&str>) -> StepReport {
        StepReport {
            rollout: id,
            state,
            reason: reason.map(str::to_string),
            exit: Some(i32::from(state == StepState::Failed)),
            output: "x".repeat(10_000),
            gate: None,
        }
    }

    #[test]
    fn one_at_a_time_idle_first_and_a_busy_node_waits_for_its_jobs() {
        let names = ["n0", "n1", "n2", "n3"];
        let mut s = cluster(&names);
        run(
            &mut s,
            Cmd::Start {
                plan: plan(&names, 1),
                skipped: vec![],
                now_ms: 0,
            },
        );
        let mut slurm = idle(&names);
        slurm.get_mut("n0").unwrap().state = "allocated".into();
        let cmds = decide(live(&s), &s.nodes, &slurm, &HashMap::new(), 1);
        // n0 runs a job: n1 goes first.
        assert_eq!(
            cmds,
            vec![Cmd::Drain {
                id: 1,
                nodes: vec!["n1".into()],
                now_ms: 1
            }]
        );
        for c in cmds {
            run(&mut s, c);
        }
        assert_eq!(
            s.nodes["n1"].desired,
            Desired::Drained {
                reason: "berth rollout 1".into(),
                by: DrainedBy::Rollout
            }
        );
        // Not drained in Slurm yet: nothing runs, nothing else starts.
        assert!(decide(live(&s), &s.nodes, &slurm, &HashMap::new(), 2).is_empty());
        slurm.get_mut("n1").unwrap().state = "drained".into();
        let cmds = decide(live(&s), &s.nodes, &slurm, &HashMap::new(), 3);
        assert!(matches!(&cmds[..], [Cmd::Run { node, .. }] if node == "n1"));
        for c in cmds {
            run(&mut s, c);
        }
        assert_eq!(live(&s).steps["n1"].phase, Phase::Running);
        run(
            &mut s,
            Cmd::Report {
                id: 1,
                node: "n1".into(),
                report: report(1, StepState::Ok, None),
                now_ms: 4,
            },
        );
        let st = &live(&s).steps["n1"];
        assert_eq!(st.phase, Phase::Gating);
        assert_eq!(st.output.len(), berth_api::STEP_OUTPUT_MAX);
        // One pass is not the gate's two.
        let mut passes = HashMap::from([("n1".to_string(), 1)]);
        assert!(decide(live(&s), &s.nodes, &slurm, &passes, 5).is_empty());
        passes.insert("n1".into(), 2);
        let cmds = decide(live(&s), &s.nodes, &slurm, &passes, 6);
        assert!(matches!(&cmds[..], [Cmd::Pass { node, .. }] if node == "n1"));
        for c in cmds {
            run(&mut s, c);
        }
        assert_eq!(s.nodes["n1"].desired, Desired::Up);
        assert_eq!(
            s.nodes["n1"].resume_reason.as_deref(),
            Some("berth rollout 1")
        );
        // A report repeated after the step moved on changes nothing.
        let before = s.clone();
        run(
            &mut s,
            Cmd::Report {
                id: 1,
                node: "n1".into(),
                report: report(1, StepState::Failed, Some("late")),
                now_ms: 7,
            },
        );
        assert_eq!(s, before);
        // n1 is out of service until Slurm shows it resumed: nothing starts before.
        slurm.get_mut("n1").unwrap().reason = "berth rollout 1".into();
        assert!(decide(live(&s), &s.nodes, &slurm, &HashMap::new(), 8).is_empty());
        slurm.insert("n1".into(), idle(&["n1"]).remove("n1").unwrap());
        // n2 next, then n3; n0 last, and only once its job ended.
        let cmds = decide(live(&s), &s.nodes, &slurm, &HashMap::new(), 8);
        assert!(matches!(&cmds[..], [Cmd::Drain { nodes, .. }] if nodes == &["n2"]));
    }

    #[test]
    fn a_failure_stops_new_starts_and_leaves_the_node_drained_with_why() {
        let names = ["n0", "n1", "n2", "n3"];
        let mut s = cluster(&names);
        run(
            &mut s,
            Cmd::Start {
                plan: plan(&names, 2),
                skipped: vec![],
                now_ms: 0,
            },
        );
        let mut slurm = idle(&names);
        for c in decide(live(&s), &s.nodes, &slurm, &HashMap::new(), 1) {
            run(&mut s, c);
        }
        for n in ["n0", "n1"] {
            slurm.get_mut(n).unwrap().state = "drained".into();
        }
        for c in decide(live(&s), &s.nodes, &slurm, &HashMap::new(), 2) {
            run(&mut s, c);
        }
        run(
            &mut s,
            Cmd::Report {
                id: 1,
                node: "n0".into(),
                report: report(1, StepState::Failed, Some("exit status 3")),
                now_ms: 3,
            },
        );
        let r = live(&s);
        assert_eq!(r.status, Status::Failed);
        assert_eq!(r.steps["n0"].phase, Phase::Failed);
        assert!(r.stopped.as_deref().unwrap().contains("n0: exit status 3"));
        assert_eq!(
            s.nodes["n0"].desired,
            Desired::Drained {
                reason: "berth rollout 1: exit status 3".into(),
                by: DrainedBy::Rollout
            }
        );
        // n1 still runs to its end; n2 and n3 are never started.
        let cmds = decide(live(&s), &s.nodes, &slurm, &HashMap::new(), 4);
        assert!(cmds.is_empty(), "{cmds:?}");
        run(
            &mut s,
            Cmd::Report {
                id: 1,
                node: "n1".into(),
                report: report(1, StepState::Ok, None),
                now_ms: 5,
            },
        );
        let passes = HashMap::from([("n1".to_string(), 5)]);
        for c in decide(live(&s), &s.nodes, &slurm, &passes, 6) {
            run(&mut s, c);
        }
        assert!(s.rollouts.live().is_none());
        let r = s.rollouts.get(1).unwrap();
        assert_eq!(r.steps["n1"].phase, Phase::Done);
        assert_eq!(r.steps["n2"].phase, Phase::Waiting);
        assert_eq!(r.ended_ms, Some(6));
        assert_eq!(s.nodes["n2"].desired, Desired::Up);
        // Health verdicts never lift a rollout's drain.
        let ok = vec![berth_api::CheckResult {
            name: "gpu-count".into(),
            status: berth_api::Status::Ok,
            severity: berth_api::Severity::Hard,
            recoverable: true,
            message: "ok".into(),
        }];
        for t in 0..5 {
            s.apply(&Command::Verdict {
                node: "n0".into(),
                checks: ok.clone(),
                now_ms: 10 + t,
                rules: crate::state::Rules::default(),
            });
        }
        assert_eq!(s.nodes["n0"].desired.word(), "drained");
    }

    #[test]
    fn pause_resume_abort_deadline_and_timeouts() {
        let names = ["n0", "n1", "n2"];
        let mut s = cluster(&names);
        let mut p = plan(&names, 1);
        p.deadline_s = Some(10);
        p.failure_threshold = 2;
        run(
            &mut s,
            Cmd::Start {
                plan: p,
                skipped: vec![("n9".into(), "drained before the rollout".into())],
                now_ms: 0,
            },
        );
        // A second rollout is refused while one is live.
        run(
            &mut s,
            Cmd::Start {
                plan: plan(&names, 1),
                skipped: vec![],
                now_ms: 0,
            },
        );
        assert_eq!(s.rollouts.list.len(), 1);
        let mut slurm = idle(&names);
        run(
            &mut s,
            Cmd::Control {
                id: 1,
                op: Op::Pause,
                now_ms: 1,
            },
        );
        assert!(decide(live(&s), &s.nodes, &slurm, &HashMap::new(), 2).is_empty());
        run(
            &mut s,
            Cmd::Control {
                id: 1,
                op: Op::Resume,
                now_ms: 3,
            },
        );
        for c in decide(live(&s), &s.nodes, &slurm, &HashMap::new(), 4) {
            run(&mut s, c);
        }
        // Jobs still run on n0 past the deadline: skipped and resumed.
        slurm.get_mut("n0").unwrap().state = "draining".into();
        assert!(decide(live(&s), &s.nodes, &slurm, &HashMap::new(), 10_000).is_empty());
        for c in decide(live(&s), &s.nodes, &slurm, &HashMap::new(), 10_005) {
            run(&mut s, c);
        }
        assert_eq!(live(&s).steps["n0"].phase, Phase::Skipped);
        assert_eq!(s.nodes["n0"].desired, Desired::Up);
        // n1 runs and its agent never answers: failed after the timeout.
        for c in decide(live(&s), &s.nodes, &slurm, &HashMap::new(), 10_006) {
            run(&mut s, c);
        }
        slurm.get_mut("n1").unwrap().state = "drained".into();
        for c in decide(live(&s), &s.nodes, &slurm, &HashMap::new(), 10_007) {
            run(&mut s, c);
        }
        // Past the timeout, within the grace for the agent's own report: nothing yet.
        assert!(decide(live(&s), &s.nodes, &slurm, &HashMap::new(), 80_000).is_empty());
        let cmds = decide(live(&s), &s.nodes, &slurm, &HashMap::new(), 100_100);
        assert!(matches!(&cmds[..], [Cmd::Fail { reason, .. }] if reason.contains("no outcome")));
        for c in cmds {
            run(&mut s, c);
        }
        // Below the threshold (2): the rollout goes on with n2; abort puts it back.
        assert_eq!(live(&s).status, Status::Running);
        for c in decide(live(&s), &s.nodes, &slurm, &HashMap::new(), 100_101) {
            run(&mut s, c);
        }
        assert_eq!(live(&s).steps["n2"].phase, Phase::Draining);
        run(
            &mut s,
            Cmd::Control {
                id: 1,
                op: Op::Abort,
                now_ms: 100_102,
            },
        );
        let r = s.rollouts.get(1).unwrap();
        assert_eq!(r.status, Status::Aborted);
        assert_eq!(r.steps["n2"].phase, Phase::Skipped);
        assert_eq!(r.steps["n9"].phase, Phase::Skipped);
        assert_eq!(s.nodes["n2"].desired, Desired::Up);
        assert!(s.rollouts.live().is_none());
    }

    #[test]
    fn a_reboot_passes_its_gate_only_with_a_new_boot_id() {
        let mut s = cluster(&["n0"]);
        let mut p = plan(&["n0"], 1);
        p.action = StepAction::Reboot;
        run(
            &mut s,
            Cmd::Start {
                plan: p,
                skipped: vec![],
                now_ms: 0,
            },
        );
        let mut slurm = idle(&["n0"]);
        for c in decide(live(&s), &s.nodes, &slurm, &HashMap::new(), 1) {
            run(&mut s, c);
        }
        slurm.get_mut("n0").unwrap().state = "drained".into();
        for c in decide(live(&s), &s.nodes, &slurm, &HashMap::new(), 2) {
            run(&mut s, c);
        }
        assert_eq!(live(&s).steps["n0"].boot_before, "b1");
        run(
            &mut s,
            Cmd::Report {
                id: 1,
                node: "n0".into(),
                report: report(1, StepState::Ok, Some("rebooted")),
                now_ms: 3,
            },
        );
        let passes = HashMap::from([("n0".to_string(), 9)]);
        assert!(decide(live(&s), &s.nodes, &slurm, &passes, 4).is_empty());
        s.apply(&Command::Register {
            node: "n0".into(),
            boot_id: "b2".into(),
            version: "v".into(),
        });
        let cmds = decide(live(&s), &s.nodes, &slurm, &passes, 5);
        assert!(matches!(&cmds[..], [Cmd::Pass { .. }]));
    }

    #[test]
    fn max_unavailable_counts_and_percentages_and_batches() {
        assert_eq!(max_unavailable("1", 4), Ok(1));
        assert_eq!(max_unavailable("10%", 1000), Ok(100));
        assert_eq!(max_unavailable("10%", 4), Ok(1));
        assert_eq!(max_unavailable("50%", 5), Ok(3));
        assert!(max_unavailable("0", 4).unwrap_err().contains("a count"));
        assert!(max_unavailable("x%", 4).unwrap_err().contains("percentage"));
        assert!(max_unavailable("200%", 4).unwrap_err().contains("200%"));
        let n: Vec<&str> = (0..5).map(|i| ["n0", "n1", "n2", "n3", "n4"][i]).collect();
        let b = batches(&plan(&n, 2), &["n0".to_string()]);
        assert_eq!(
            b,
            vec![vec!["n1", "n2"], vec!["n3", "n4"], vec!["n0"]]
                .into_iter()
                .map(|v| v.into_iter().map(String::from).collect::<Vec<_>>())
                .collect::<Vec<_>>()
        );
        assert_eq!(tail("aé", 1), "");
        assert_eq!(tail("abc", 2), "bc");
    }

    /// gpu: g0-g3 (at most 1 out), cpu: c0-c1 (at most 1 out), with 3 out overall.
    fn partitioned() -> (Plan, [&'static str; 6]) {
        let names = ["g0", "g1", "g2", "g3", "c0", "c1"];
        let mut p = plan(&names, 3);
        p.partition_limits = BTreeMap::from([("gpu".to_string(), 1), ("cpu".to_string(), 1)]);
        for n in names {
            let part = if n.starts_with('g') { "gpu" } else { "cpu" };
            p.partitions.insert(n.to_string(), vec![part.to_string()]);
        }
        (p, names)
    }

    #[test]
    fn a_partitions_limit_holds_within_the_overall_one() {
        let (p, names) = partitioned();
        let b = batches(&p, &[]);
        assert_eq!(
            b,
            [vec!["g0", "c0"], vec!["g1", "c1"], vec!["g2"], vec!["g3"]]
                .map(|v| v.into_iter().map(String::from).collect::<Vec<_>>())
        );
        let mut s = cluster(&names);
        run(
            &mut s,
            Cmd::Start {
                plan: p,
                skipped: vec![],
                now_ms: 0,
            },
        );
        let slurm = idle(&names);
        let cmds = decide(live(&s), &s.nodes, &slurm, &HashMap::new(), 1);
        // Room for 3 overall, but one node of each partition.
        assert_eq!(
            cmds,
            vec![Cmd::Drain {
                id: 1,
                nodes: vec!["g0".into(), "c0".into()],
                now_ms: 1
            }]
        );
        for c in cmds {
            run(&mut s, c);
        }
        // While g0 and c0 are out, nothing else of either partition starts.
        assert!(decide(live(&s), &s.nodes, &slurm, &HashMap::new(), 2).is_empty());
    }
}
