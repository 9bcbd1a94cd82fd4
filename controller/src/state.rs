//! The replicated state machine: node registrations, check verdicts and the drain/resume
//! decisions they lead to, and the rolling maintenances (`Command::Rollout`, rollout.rs). Every replica applies the same committed [`Command`]s with
//! [`State::apply`] and so reaches the same state; the decision rules live here, as pure
//! functions of the state and the command (time comes in the command, stamped by the leader
//! that proposed it), so that they are the same on every replica and testable without Raft.
//!
//! Rules (issue 16, Behaviour 2-4):
//! - a hard check drains on its first failure, a soft one after `soft_fails` in a row;
//!   `unknown` never drains;
//! - reason `berth: <check>: <short phrase>`;
//! - a node berth drained is resumed after `resume_passes` heartbeats in a row where every
//!   check passed, only if every check it was drained for can recover; an admin's drain is
//!   never resumed or overwritten by berth;
//! - more than `flap_drains` drains of one node within an hour leave it drained as
//!   `berth: flapping` (until an admin resumes it);
//! - at most max(`breaker_min`, `breaker_percent` % of the nodes) automatic drains per
//!   `breaker_window`; beyond that a drain is counted and held back until `breaker reset`.

use std::collections::BTreeMap;

use berth_api::{CheckResult, Severity, Status};

use crate::node::{CheckState, Desired, DrainedBy, NodeState};
use serde::{Deserialize, Serialize};

/// The reason prefix of every drain berth decides; only such drains does berth lift.
pub const PREFIX: &str = "berth:";

/// The most characters of a drain reason (Slurm shows about 20 in `sinfo -R`; the check name
/// comes first so those say what failed).
const REASON_MAX: usize = 80;

/// The decision rules' thresholds. Replicated with every verdict so replicas agree even when
/// their configuration files differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rules {
    pub soft_fails: u32,
    pub resume_passes: u32,
    pub flap_drains: u32,
    pub flap_window_ms: u64,
    pub breaker_min: u32,
    pub breaker_percent: u32,
    pub breaker_window_ms: u64,
}

impl Default for Rules {
    fn default() -> Self {
        Self {
            soft_fails: 2,
            resume_passes: 3,
            flap_drains: 3,
            flap_window_ms: 3_600_000,
            breaker_min: 2,
            breaker_percent: 10,
            breaker_window_ms: 600_000,
        }
    }
}

/// A change to the replicated state, committed to the Raft log before it takes effect.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// A node's first heartbeat, or its first after a reboot or an upgrade.
    Register {
        node: String,
        boot_id: String,
        version: String,
    },
    /// A heartbeat's check results that change the node's verdict or counters.
    Verdict {
        node: String,
        checks: Vec<CheckResult>,
        now_ms: u64,
        rules: Rules,
    },
    /// `berth cluster drain NODE --reason R`.
    AdminDrain { node: String, reason: String },
    /// `berth cluster resume NODE`.
    AdminResume { node: String },
    /// `berth cluster breaker reset`.
    BreakerReset,
    /// The leader decided to tell the backup slurmctld to take over (issue 17): committed
    /// before `scontrol takeover` runs, so only a leader with a quorum acts, and every
    /// takeover is on record with its reason.
    Takeover(crate::takeover::Decided),
    /// What `scontrol takeover` answered, for the takeover decided last.
    TakeoverOutcome { outcome: String },
    /// A rolling maintenance's plan or one node's move through it (rollout.rs).
    Rollout(crate::rollout::Cmd),
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Breaker {
    /// When the automatic drains of the current window were decided.
    pub drains_ms: Vec<u64>,
    /// Drains held back since the last reset.
    pub suppressed: u64,
    pub tripped: bool,
}

/// Counters by check, for metrics (monotonic, replicated).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Totals {
    pub drains: BTreeMap<String, u64>,
    pub resumes: BTreeMap<String, u64>,
    pub suppressed: BTreeMap<String, u64>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct State {
    pub nodes: BTreeMap<String, NodeState>,
    pub breaker: Breaker,
    pub totals: Totals,
    /// The slurmctld takeovers decided (a state written before issue 17 has none).
    #[serde(default)]
    pub takeovers: crate::takeover::Record,
    /// Rolling maintenance (issue 31; a state written before it has none).
    #[serde(default)]
    pub rollouts: crate::rollout::Rollouts,
}

/// What applying a command answers the proposer.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reply {
    /// The node's desired state afterwards: `up` or `drained`.
    pub desired: String,
    /// The rollout a rollout command applied to (0: none).
    #[serde(default)]
    pub rollout: u64,
}

/// `berth: <check>: <phrase>`, cut to [`REASON_MAX`] characters on one line.
pub fn reason(check: &str, message: &str) -> String {
    let line: String = message
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let full = format!("{PREFIX} {check}: {}", line.trim());
    full.chars().take(REASON_MAX).collect()
}

impl State {
    pub fn apply(&mut self, cmd: &Command) -> Reply {
        match cmd {
            Command::Register {
                node,
                boot_id,
                version,
            } => {
                let n = self
                    .nodes
                    .entry(node.clone())
                    .or_insert_with(|| NodeState::new(boot_id.clone(), version.clone()));
                n.boot_id = boot_id.clone();
                n.version = version.clone();
                self.reply(node)
            }
            Command::Verdict {
                node,
                checks,
                now_ms,
                rules,
            } => {
                let total = self.nodes.len().max(1);
                let State {
                    nodes,
                    breaker,
                    totals,
                    ..
                } = self;
                let n = nodes
                    .entry(node.clone())
                    .or_insert_with(|| NodeState::new(String::new(), String::new()));
                verdict(n, breaker, totals, total, checks, *now_ms, rules);
                self.reply(node)
            }
            Command::AdminDrain { node, reason } => {
                let n = self
                    .nodes
                    .entry(node.clone())
                    .or_insert_with(|| NodeState::new(String::new(), String::new()));
                n.desired = Desired::Drained {
                    reason: reason.clone(),
                    by: DrainedBy::Admin,
                };
                n.passes = 0;
                n.suppressed = None;
                n.resume_reason = None;
                self.reply(node)
            }
            Command::AdminResume { node } => {
                if let Some(n) = self.nodes.get_mut(node) {
                    n.resume_reason = match &n.desired {
                        Desired::Drained { reason, .. } => Some(reason.clone()),
                        Desired::Up => n.resume_reason.take(),
                    };
                    n.desired = Desired::Up;
                    n.passes = 0;
                    n.drains_ms.clear();
                    n.suppressed = None;
                    for c in n.checks.values_mut() {
                        c.fails = 0;
                    }
                }
                self.reply(node)
            }
            Command::BreakerReset => {
                self.breaker = Breaker::default();
                for n in self.nodes.values_mut() {
                    n.suppressed = None;
                }
                Reply::default()
            }
            Command::Takeover(d) => {
                self.takeovers.push(d.clone());
                Reply::default()
            }
            Command::TakeoverOutcome { outcome } => {
                self.takeovers.outcome(outcome);
                Reply::default()
            }
            Command::Rollout(c) => Reply {
                rollout: crate::rollout::apply(&mut self.nodes, &mut self.rollouts, c),
                ..Reply::default()
            },
        }
    }

    fn reply(&self, node: &str) -> Reply {
        Reply {
            desired: self
                .nodes
                .get(node)
                .map_or("up", |n| n.desired.word())
                .to_string(),
            rollout: 0,
        }
    }

    /// Whether a verdict would change the node or the breaker: a heartbeat that changes
    /// nothing is not worth a log entry (steady healthy nodes cost no writes).
    pub fn changes(&self, cmd: &Command) -> bool {
        let Command::Verdict {
            node,
            checks,
            now_ms,
            rules,
        } = cmd
        else {
            return true;
        };
        let Some(before) = self.nodes.get(node) else {
            return true;
        };
        let mut n = before.clone();
        let mut breaker = self.breaker.clone();
        let mut totals = Totals::default();
        verdict(
            &mut n,
            &mut breaker,
            &mut totals,
            self.nodes.len().max(1),
            checks,
            *now_ms,
            rules,
        );
        &n != before
            || breaker.suppressed != self.breaker.suppressed
            || breaker.tripped != self.breaker.tripped
    }

    /// The limit of automatic drains per breaker window for this many nodes.
    pub fn breaker_limit(nodes: usize, rules: &Rules) -> usize {
        (rules.breaker_min as usize).max(nodes * rules.breaker_percent as usize / 100)
    }
}

/// Applies one heartbeat's check results to a node: the decision rules.
fn verdict(
    n: &mut NodeState,
    breaker: &mut Breaker,
    totals: &mut Totals,
    total_nodes: usize,
    checks: &[CheckResult],
    now_ms: u64,
    rules: &Rules,
) {
    for c in checks {
        let prev = n.checks.get(&c.name).map_or(0, |s| s.fails);
        let fails = match c.status {
            Status::Fail => (prev + 1).min(rules.soft_fails.max(1)),
            Status::Ok => 0,
            // Unknown says nothing either way: the streak neither grows nor breaks.
            Status::Unknown => prev,
        };
        n.checks.insert(
            c.name.clone(),
            CheckState {
                status: c.status,
                severity: c.severity,
                recoverable: c.recoverable,
                message: c.message.clone(),
                fails,
            },
        );
    }
    // A check no longer reported is forgotten (an agent upgraded, a check retired).
    n.checks
        .retain(|name, _| checks.iter().any(|c| &c.name == name));
    let failing: Vec<(&String, &CheckState)> = n
        .checks
        .iter()
        .filter(|(_, s)| {
            s.status == Status::Fail
                && (s.severity == Severity::Hard || s.fails >= rules.soft_fails)
        })
        .collect();
    let all_pass = n.checks.values().all(|s| s.status == Status::Ok);
    match &n.desired {
        Desired::Drained {
            by: DrainedBy::Admin | DrainedBy::Rollout,
            ..
        } => {}
        Desired::Drained {
            by: DrainedBy::Berth,
            reason,
        } => {
            if all_pass && n.recoverable && reason != &format!("{PREFIX} flapping") {
                n.passes = (n.passes + 1).min(rules.resume_passes);
                if n.passes >= rules.resume_passes {
                    let check = check_of(reason);
                    *totals.resumes.entry(check).or_default() += 1;
                    n.desired = Desired::Up;
                    n.passes = 0;
                }
            } else {
                n.passes = 0;
            }
        }
        Desired::Up => {
            n.passes = 0;
            let Some((name, first)) = failing.first() else {
                n.suppressed = None;
                return;
            };
            let name = (*name).clone();
            let recoverable = failing.iter().all(|(_, s)| s.recoverable);
            let mut why = reason(&name, &first.message);
            breaker
                .drains_ms
                .retain(|t| now_ms.saturating_sub(*t) < rules.breaker_window_ms);
            if breaker.drains_ms.len() >= State::breaker_limit(total_nodes, rules) {
                breaker.tripped = true;
                if n.suppressed.is_none() {
                    breaker.suppressed += 1;
                    *totals.suppressed.entry(name).or_default() += 1;
                }
                n.suppressed = Some(why);
                return;
            }
            breaker.drains_ms.push(now_ms);
            n.drains_ms
                .retain(|t| now_ms.saturating_sub(*t) < rules.flap_window_ms);
            n.drains_ms.push(now_ms);
            if n.drains_ms.len() > rules.flap_drains as usize {
                why = format!("{PREFIX} flapping");
            }
            *totals.drains.entry(name).or_default() += 1;
            n.suppressed = None;
            n.recoverable = recoverable;
            n.desired = Desired::Drained {
                reason: why,
                by: DrainedBy::Berth,
            };
        }
    }
}

/// The check a berth reason names (`berth: <check>: …`).
fn check_of(reason: &str) -> String {
    reason
        .strip_prefix(PREFIX)
        .unwrap_or(reason)
        .trim()
        .split(':')
        .next()
        .unwrap_or("")
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(name: &str, status: Status, severity: Severity) -> CheckResult {
        CheckResult {
            name: name.into(),
            status,
            severity,
            recoverable: true,
            message: format!("{name} says {status:?}"),
        }
    }

    fn beat(s: &mut State, node: &str, checks: Vec<CheckResult>, now_ms: u64) -> String {
        s.apply(&Command::Verdict {
            node: node.into(),
            checks,
            now_ms,
            rules: Rules::default(),
        })
        .desired
    }

    fn cluster(n: usize) -> State {
        let mut s = State::default();
        for i in 0..n {
            s.apply(&Command::Register {
                node: format!("n{i}"),
                boot_id: "b".into(),
                version: "v".into(),
            });
        }
        s
    }

    fn reason_of(s: &State, node: &str) -> Option<String> {
        match &s.nodes[node].desired {
            Desired::Drained { reason, .. } => Some(reason.clone()),
            Desired::Up => None,
        }
    }

    #[test]
    fn hard_drains_at_once_soft_after_two_unknown_never() {
        let mut s = cluster(30);
        let hard = vec![check("gpu-count", Status::Fail, Severity::Hard)];
        assert_eq!(beat(&mut s, "n0", hard, 1), "drained");
        assert_eq!(
            reason_of(&s, "n0").unwrap(),
            "berth: gpu-count: gpu-count says Fail"
        );
        let soft = || vec![check("nic-ports", Status::Fail, Severity::Soft)];
        assert_eq!(beat(&mut s, "n1", soft(), 1), "up");
        assert_eq!(beat(&mut s, "n1", soft(), 2), "drained");
        // A pass between two failures breaks the streak.
        assert_eq!(beat(&mut s, "n2", soft(), 1), "up");
        let ok = vec![check("nic-ports", Status::Ok, Severity::Soft)];
        assert_eq!(beat(&mut s, "n2", ok, 2), "up");
        assert_eq!(beat(&mut s, "n2", soft(), 3), "up");
        let unknown = || vec![check("xid", Status::Unknown, Severity::Hard)];
        for t in 0..5 {
            assert_eq!(beat(&mut s, "n3", unknown(), t), "up");
        }
    }

    #[test]
    fn resume_after_three_passes_only_recoverable_berth_drains() {
        let mut s = cluster(30);
        let fail = vec![check("gpu-count", Status::Fail, Severity::Hard)];
        let ok = || vec![check("gpu-count", Status::Ok, Severity::Hard)];
        assert_eq!(beat(&mut s, "n0", fail.clone(), 1), "drained");
        assert_eq!(beat(&mut s, "n0", ok(), 2), "drained");
        assert_eq!(beat(&mut s, "n0", ok(), 3), "drained");
        assert_eq!(beat(&mut s, "n0", ok(), 4), "up");
        assert_eq!(s.totals.resumes["gpu-count"], 1);
        // An unrecoverable check's drain stays.
        let mut xid = check("xid", Status::Fail, Severity::Hard);
        xid.recoverable = false;
        assert_eq!(beat(&mut s, "n1", vec![xid], 1), "drained");
        for t in 2..10 {
            let ok = vec![check("xid", Status::Ok, Severity::Hard)];
            assert_eq!(beat(&mut s, "n1", ok, t), "drained");
        }
    }

    #[test]
    fn admin_drain_is_never_touched() {
        let mut s = cluster(30);
        s.apply(&Command::AdminDrain {
            node: "n0".into(),
            reason: "rma ticket 42".into(),
        });
        for t in 0..5 {
            let ok = vec![check("gpu-count", Status::Ok, Severity::Hard)];
            assert_eq!(beat(&mut s, "n0", ok, t), "drained");
            let fail = vec![check("gpu-count", Status::Fail, Severity::Hard)];
            assert_eq!(beat(&mut s, "n0", fail, t), "drained");
        }
        assert_eq!(reason_of(&s, "n0").unwrap(), "rma ticket 42");
        s.apply(&Command::AdminResume { node: "n0".into() });
        assert_eq!(s.nodes["n0"].desired, Desired::Up);
        assert_eq!(
            s.nodes["n0"].resume_reason.as_deref(),
            Some("rma ticket 42")
        );
    }

    #[test]
    fn more_than_three_drains_an_hour_is_flapping() {
        let mut s = cluster(100);
        let mut t = 0;
        for round in 0..4 {
            t += 60_000;
            let fail = vec![check("gpu-count", Status::Fail, Severity::Hard)];
            assert_eq!(beat(&mut s, "n0", fail, t), "drained");
            if round < 3 {
                for _ in 0..3 {
                    t += 1000;
                    let ok = vec![check("gpu-count", Status::Ok, Severity::Hard)];
                    beat(&mut s, "n0", ok, t);
                }
                assert_eq!(s.nodes["n0"].desired, Desired::Up, "round {round}");
            }
        }
        assert_eq!(reason_of(&s, "n0").unwrap(), "berth: flapping");
        for _ in 0..5 {
            t += 1000;
            let ok = vec![check("gpu-count", Status::Ok, Severity::Hard)];
            assert_eq!(beat(&mut s, "n0", ok, t), "drained");
        }
    }

    #[test]
    fn breaker_holds_drains_beyond_the_limit_until_reset() {
        let mut s = cluster(30);
        assert_eq!(State::breaker_limit(30, &Rules::default()), 3);
        assert_eq!(State::breaker_limit(5, &Rules::default()), 2);
        assert_eq!(State::breaker_limit(1000, &Rules::default()), 100);
        let fail = || vec![check("gpu-count", Status::Fail, Severity::Hard)];
        for i in 0..3 {
            assert_eq!(beat(&mut s, &format!("n{i}"), fail(), 1), "drained");
        }
        for i in 3..6 {
            assert_eq!(beat(&mut s, &format!("n{i}"), fail(), 2), "up");
            // The same node held back twice counts once.
            assert_eq!(beat(&mut s, &format!("n{i}"), fail(), 3), "up");
        }
        assert!(s.breaker.tripped);
        assert_eq!(s.breaker.suppressed, 3);
        assert!(s.nodes["n3"].suppressed.is_some());
        s.apply(&Command::BreakerReset);
        assert!(!s.breaker.tripped);
        assert_eq!(beat(&mut s, "n3", fail(), 4), "drained");
        // The window slides: after 10 minutes the limit applies afresh.
        let t = 1 + Rules::default().breaker_window_ms;
        assert_eq!(beat(&mut s, "n6", fail(), t), "drained");
    }

    #[test]
    fn reasons_are_one_short_line() {
        let r = reason("nic-ports", "mlx5_0/1 DOWN\nand more");
        assert_eq!(r, "berth: nic-ports: mlx5_0/1 DOWN and more");
        assert!(reason("x", &"y".repeat(500)).chars().count() <= REASON_MAX);
        assert_eq!(check_of("berth: gpu-count: 7 of 8"), "gpu-count");
    }
}
