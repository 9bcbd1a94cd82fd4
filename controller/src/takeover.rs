//! Fast slurmctld takeover (issue 17): when the primary slurmctld fails `takeover_after`
//! pings in a row (one per `watch_interval_ms`) while the backup answers, the Raft leader tells
//! the backup to take over (`scontrol takeover`) instead of leaving it to wait out
//! `SlurmctldTimeout` (120 s by default). This module is the decision, a pure state machine
//! fed one round of pings at a time, and the record of takeovers kept in the replicated state;
//! `server/watch.rs` pings, commits and calls.
//!
//! Rules: never while the primary answers (an answering primary resets the count; a primary
//! that is only slow, a SIGSTOP shorter than the threshold, fails fewer pings than it takes);
//! never without a backup that answers; once per outage (after a takeover the trigger waits
//! for the primary to answer again, which is when Slurm's primary takes control back); a
//! takeover that failed is tried again after another `takeover_after` failed pings. The
//! quorum rule is server/watch.rs's: the decision is committed to the Raft log before the call.

use serde::{Deserialize, Serialize};

/// How many takeovers the replicated state keeps (the count is kept apart).
const KEEP: usize = 50;

/// One ping's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ping {
    Up,
    /// It answered that it is down, or refused the connection.
    Down,
    /// No answer within `ping_timeout_ms`: a hung (stopped) controller or an unreachable host.
    Timeout,
    /// `scontrol` could not be run or said nothing understandable: neither up nor down.
    Unknown,
}

impl Ping {
    pub fn word(self) -> &'static str {
        match self {
            Ping::Up => "up",
            Ping::Down => "down",
            Ping::Timeout => "no answer",
            Ping::Unknown => "unknown",
        }
    }
}

/// A takeover as committed to the Raft log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decided {
    /// The leader's clock when it decided (Unix milliseconds).
    pub at_ms: u64,
    /// The deciding leader's id and term.
    pub by: u64,
    pub term: u64,
    pub backup: String,
    pub reason: String,
    /// What `scontrol takeover` answered (a second entry fills it in).
    #[serde(default)]
    pub outcome: Option<String>,
}

/// The takeovers in the replicated state: the last [`KEEP`] and how many in all.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub last: Vec<Decided>,
    pub total: u64,
}

impl Record {
    pub fn push(&mut self, d: Decided) {
        self.last.push(d);
        if self.last.len() > KEEP {
            self.last.remove(0);
        }
        self.total += 1;
    }

    /// Fills in the outcome of the last takeover decided.
    pub fn outcome(&mut self, outcome: &str) {
        if let Some(d) = self.last.last_mut() {
            d.outcome = Some(outcome.to_string());
        }
    }
}

/// What one round of pings leads to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Wait,
    TakeOver { reason: String },
}

/// The leader's trigger (memory only: a new leader counts afresh, from zero).
#[derive(Clone, Debug)]
pub struct Trigger {
    /// Failed pings of the primary in a row that make a takeover.
    pub after: u32,
    fails: u32,
    /// Set by a takeover that succeeded: none again until the primary answers.
    fired: bool,
}

impl Trigger {
    pub fn new(after: u32) -> Self {
        Self {
            after: after.max(1),
            fails: 0,
            fired: false,
        }
    }

    /// Failed pings of the primary in a row.
    pub fn fails(&self) -> u32 {
        self.fails
    }

    /// One round: the primary's and the backup's answers.
    pub fn observe(&mut self, primary: Ping, backup: Ping) -> Verdict {
        if primary == Ping::Up {
            self.fails = 0;
            self.fired = false;
            return Verdict::Wait;
        }
        self.fails = self.fails.saturating_add(1);
        if self.fired || self.fails < self.after || backup != Ping::Up {
            return Verdict::Wait;
        }
        Verdict::TakeOver {
            reason: format!(
                "primary slurmctld failed {} pings in a row (last: {}); the backup answers",
                self.fails,
                primary.word()
            ),
        }
    }

    /// The takeover's result: done (wait for the primary to come back) or failed (count
    /// afresh, try again after as many failed pings).
    pub fn done(&mut self, ok: bool) {
        if ok {
            self.fired = true;
        } else {
            self.fails = 0;
        }
    }

    /// A primary seen answering right before the call: no takeover, count afresh.
    pub fn primary_answered(&mut self) {
        self.fails = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Ping::*;

    fn takes_over(v: &Verdict) -> bool {
        matches!(v, Verdict::TakeOver { .. })
    }

    #[test]
    fn three_failed_pings_with_the_backup_up_take_over_once() {
        let mut t = Trigger::new(3);
        assert!(!takes_over(&t.observe(Down, Up)));
        assert!(!takes_over(&t.observe(Timeout, Up)));
        let v = t.observe(Down, Up);
        assert!(takes_over(&v), "{v:?}");
        let Verdict::TakeOver { reason } = v else {
            unreachable!()
        };
        assert!(reason.contains("3 pings"), "{reason}");
        t.done(true);
        // Once per outage: the primary stays down, nothing more.
        for _ in 0..10 {
            assert_eq!(t.observe(Down, Up), Verdict::Wait);
        }
        // The primary is back (it takes control back itself); the next outage counts afresh.
        assert_eq!(t.observe(Up, Up), Verdict::Wait);
        assert_eq!(t.observe(Down, Up), Verdict::Wait);
        assert_eq!(t.observe(Down, Up), Verdict::Wait);
        assert!(takes_over(&t.observe(Down, Up)));
    }

    #[test]
    fn an_answering_primary_or_a_silent_backup_never_takes_over() {
        let mut t = Trigger::new(3);
        // Slow, not dead: two failures, then it answers (a SIGSTOP shorter than the threshold).
        for _ in 0..5 {
            assert_eq!(t.observe(Timeout, Up), Verdict::Wait);
            assert_eq!(t.observe(Timeout, Up), Verdict::Wait);
            assert_eq!(t.observe(Up, Up), Verdict::Wait);
        }
        // Both down: nothing to hand over to.
        for b in [Down, Timeout, Unknown] {
            let mut t = Trigger::new(3);
            for _ in 0..10 {
                assert_eq!(t.observe(Down, b), Verdict::Wait);
            }
            // The backup comes back: now.
            assert!(takes_over(&t.observe(Down, Up)));
        }
    }

    #[test]
    fn a_failed_takeover_is_tried_again_after_as_many_failures() {
        let mut t = Trigger::new(2);
        t.observe(Down, Up);
        assert!(takes_over(&t.observe(Down, Up)));
        t.done(false);
        assert_eq!(t.observe(Down, Up), Verdict::Wait);
        assert!(takes_over(&t.observe(Down, Up)));
        t.primary_answered();
        assert_eq!(t.observe(Down, Up), Verdict::Wait);
    }

    #[test]
    fn the_record_keeps_the_last_and_counts_all() {
        let mut r = Record::default();
        for i in 0..(KEEP as u64 + 5) {
            r.push(Decided {
                at_ms: i,
                by: 1,
                term: 1,
                backup: "head2".into(),
                reason: "r".into(),
                outcome: None,
            });
        }
        r.outcome("ok");
        assert_eq!(r.total, KEEP as u64 + 5);
        assert_eq!(r.last.len(), KEEP);
        assert_eq!(r.last[0].at_ms, 5);
        assert_eq!(r.last.last().unwrap().outcome.as_deref(), Some("ok"));
    }
}
