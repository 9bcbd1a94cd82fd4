//! The agent's side of a rollout step (issue 31): the leader's order rides the heartbeat
//! answer; the agent runs it at most once and reports how it stands in its next heartbeats.
//!
//! At most once: before starting step `<rollout>` the agent creates its record
//! (`agent.rollout_dir/step-<rollout>-<node>.json`, root only, created exclusively and synced),
//! and every later order of the same step is answered from that record, never run again: a
//! new leader that finds the step `running` in the Raft log gets the record's outcome. A
//! record still saying `running` with no step of this process behind it is a command killed
//! midway (the agent restarted, the node crashed): it is finished as failed with that reason
//! (a reboot step's record with a new boot id is the reboot done). The command runs as
//! `sh -c COMMAND` in a process group of its own, killed whole at its timeout; the last
//! [`STEP_OUTPUT_MAX`] bytes of its stdout and stderr go with the report.

use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use berth_api::{STEP_OUTPUT_MAX, StepAction, StepOrder, StepReport, StepState};
use berth_config::AgentConfig;
use serde::{Deserialize, Serialize};

use crate::AgentError;

/// This agent's version, recorded with each step it starts.
const VERSION: &str = env!("CARGO_PKG_VERSION");

/// A step as the agent recorded it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub rollout: u64,
    pub node: String,
    pub action: StepAction,
    /// The boot id when it started: a reboot is done when it changed.
    pub boot_id: String,
    pub started_unix: u64,
    pub state: StepState,
    pub reason: Option<String>,
    pub exit: Option<i32>,
    pub output: String,
    /// The command's process group and its leader's start time (/proc/PID/stat field 22):
    /// what a restarted agent kills of a command it finds left running.
    #[serde(default)]
    pub pgid: Option<(i32, u64)>,
    /// The agent's version when it started the step: a restart on another version mid-step is
    /// the step's own upgrade of berth taking effect.
    #[serde(default)]
    pub agent_version: String,
}

impl Record {
    fn report(&self) -> StepReport {
        StepReport {
            rollout: self.rollout,
            state: self.state,
            reason: self.reason.clone(),
            exit: self.exit,
            output: self.output.clone(),
            gate: None,
        }
    }
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub fn record_path(dir: &Path, rollout: u64, node: &str) -> PathBuf {
    dir.join(format!("step-{rollout}-{node}.json"))
}

fn read_record(path: &Path) -> Result<Record, AgentError> {
    let mut text = String::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(64 << 10).read_to_string(&mut text))
        .map_err(|e| {
            AgentError::host(format!(
                "reading the rollout record {}: {e}",
                path.display()
            ))
        })?;
    serde_json::from_str(&text).map_err(|e| {
        AgentError::host(format!(
            "the rollout record {} does not parse: {e}; an admin must look (the step is not run again)",
            path.display()
        ))
    })
}

/// Writes the record's final state: a new file renamed over the old, synced.
fn finish_record(path: &Path, r: &Record) -> Result<(), AgentError> {
    let tmp = path.with_extension("tmp");
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(&serde_json::to_vec(r).expect("a record serializes"))?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        sync_dir(path)
    };
    write().map_err(|e| {
        AgentError::host(format!(
            "writing the rollout record {}: {e}",
            path.display()
        ))
    })
}

fn sync_dir(path: &Path) -> std::io::Result<()> {
    match path.parent() {
        Some(d) => std::fs::File::open(d)?.sync_all(),
        None => Ok(()),
    }
}

/// Creates the record of a step about to start; `Ok(false)` when one exists (never run twice).
fn create_record(path: &Path, r: &Record) -> Result<bool, AgentError> {
    let dir = path.parent().unwrap_or(Path::new("/"));
    let fail = |e: std::io::Error| {
        AgentError::host(format!(
            "creating the rollout record {}: {e} (agent.rollout_dir)",
            path.display()
        ))
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(fail)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(fail)?;
    let mut f = match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Ok(false),
        Err(e) => return Err(fail(e)),
    };
    f.write_all(&serde_json::to_vec(r).expect("a record serializes"))
        .and_then(|()| f.sync_all())
        .and_then(|()| sync_dir(path))
        .map_err(fail)?;
    Ok(true)
}

/// The tail of `b`, at most `max` bytes, as text.
fn tail(b: &[u8], max: usize) -> String {
    let from = b.len().saturating_sub(max);
    let s = String::from_utf8_lossy(&b[from..]).into_owned();
    // A cut multibyte character shows as U+FFFD: trim to the byte bound again.
    let mut start = s.len().saturating_sub(max);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    s[start..].to_string()
}

/// How a command ended.
struct Ended {
    exit: Option<i32>,
    timed_out: bool,
    output: String,
}

/// The start time of process `pid` (field 22 of /proc/PID/stat), to tell it from a later
/// process given the same pid.
fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(") ")?;
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Runs `sh -c command` as this (root) process, in a process group of its own, at most
/// `timeout` (then the whole group is killed); stdout and stderr's last bytes kept. `started`
/// gets the group's id once it runs.
fn run_command(
    command: &str,
    timeout: Duration,
    env: &[(&str, String)],
    started: &dyn Fn(i32),
) -> Result<Ended, String> {
    let (mut reader, writer) = std::io::pipe().map_err(|e| format!("a pipe: {e}"))?;
    let writer2 = writer.try_clone().map_err(|e| format!("a pipe: {e}"))?;
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(command)
        .stdin(Stdio::null())
        .stdout(writer)
        .stderr(writer2)
        .process_group(0);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().map_err(|e| format!("running sh -c: {e}"))?;
    started(i32::try_from(child.id()).unwrap_or(-1));
    // The pipe's write ends live on in the child only: the reader sees EOF when it (and its
    // children) closed them.
    drop(cmd);
    let out = Arc::new(Mutex::new(Vec::new()));
    let o = out.clone();
    let reading = std::thread::spawn(move || {
        let mut buf = [0u8; 8192];
        loop {
            match reader.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let mut v = o.lock().unwrap_or_else(|p| p.into_inner());
                    v.extend_from_slice(&buf[..n]);
                    if v.len() > 2 * STEP_OUTPUT_MAX {
                        let cut = v.len() - STEP_OUTPUT_MAX;
                        v.drain(..cut);
                    }
                }
            }
        }
    });
    let deadline = Instant::now() + timeout;
    let mut timed_out = false;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if Instant::now() >= deadline => {
                timed_out = true;
                let pgid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap_or(-1));
                let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
                break child.wait().ok();
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(_) => break None,
        }
    };
    // A background child still holding the pipe: its group is killed so the read ends.
    if !reading.is_finished() {
        std::thread::sleep(Duration::from_millis(200));
        if !reading.is_finished() {
            let pgid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap_or(-1));
            let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
        }
    }
    let _ = reading.join();
    let bytes = out.lock().unwrap_or_else(|p| p.into_inner()).clone();
    Ok(Ended {
        exit: status.and_then(|s| s.code()),
        timed_out,
        output: tail(&bytes, STEP_OUTPUT_MAX),
    })
}

/// The agent's steps: the order it was last given and the step this process runs.
#[derive(Debug, Default)]
pub struct Steps {
    order: Option<StepOrder>,
    /// The step this process started: its rollout and its outcome once it ended.
    mine: Option<(u64, Arc<Mutex<Option<Record>>>)>,
    /// Set when a step ended: the next heartbeat goes at once.
    due: Arc<AtomicBool>,
    /// The admin's gate check of the step at its gate, and its last result.
    gate: Option<Gate>,
}

/// A rollout's admin gate check on this node: run again every [`GATE_EVERY`] while ordered,
/// one run at a time, its last result reported with the step.
#[derive(Debug)]
struct Gate {
    rollout: u64,
    command: String,
    last: Arc<Mutex<Option<berth_api::GateCheck>>>,
    running: Arc<AtomicBool>,
    started: Option<Instant>,
}

/// How often the admin gate check runs while the node waits at its gate.
const GATE_EVERY: Duration = Duration::from_secs(2);
/// How long one run of it may take.
const GATE_TIMEOUT: Duration = Duration::from_secs(60);

impl Gate {
    /// Starts a run unless one runs or the last started less than GATE_EVERY ago.
    fn kick(&mut self, node: &str) {
        if self.running.load(Ordering::Relaxed)
            || self.started.is_some_and(|t| t.elapsed() < GATE_EVERY)
        {
            return;
        }
        self.started = Some(Instant::now());
        self.running.store(true, Ordering::Relaxed);
        let (command, last, running) = (
            self.command.clone(),
            self.last.clone(),
            self.running.clone(),
        );
        let env = vec![
            ("BERTH_ROLLOUT", self.rollout.to_string()),
            ("BERTH_NODE", node.to_string()),
        ];
        std::thread::spawn(move || {
            let check = match run_command(&command, GATE_TIMEOUT, &env, &|_| {}) {
                Err(why) => berth_api::GateCheck {
                    ok: false,
                    message: why,
                },
                Ok(e) => {
                    let line = e.output.lines().last().unwrap_or_default().to_string();
                    let how = match (e.timed_out, e.exit) {
                        (true, _) => format!("timed out after {} s", GATE_TIMEOUT.as_secs()),
                        (false, Some(c)) => format!("exit status {c}"),
                        (false, None) => "killed by a signal".to_string(),
                    };
                    berth_api::GateCheck {
                        ok: !e.timed_out && e.exit == Some(0),
                        message: tail(format!("{how}: {line}").as_bytes(), 300),
                    }
                }
            };
            *last.lock().unwrap_or_else(|p| p.into_inner()) = Some(check);
            running.store(false, Ordering::Relaxed);
        });
    }
}

impl Steps {
    /// Whether a heartbeat should go now (a step ended, or an order was answered).
    pub fn due(&self) -> bool {
        self.due.swap(false, Ordering::Relaxed)
    }

    /// Takes the leader's order from a heartbeat answer (`None`: no step for this node now):
    /// starts it unless it has a record.
    pub fn order(&mut self, order: Option<StepOrder>, cfg: &AgentConfig, node: &str, boot: &str) {
        let Some(order) = order else {
            self.order = None;
            return;
        };
        if self.order.as_ref() != Some(&order) {
            self.due.store(true, Ordering::Relaxed);
        }
        self.order = Some(order.clone());
        match &order.gate_command {
            Some(c)
                if self
                    .gate
                    .as_ref()
                    .is_none_or(|g| g.rollout != order.rollout || g.command != *c) =>
            {
                self.gate = Some(Gate {
                    rollout: order.rollout,
                    command: c.clone(),
                    last: Arc::default(),
                    running: Arc::default(),
                    started: None,
                });
            }
            Some(_) => {}
            None => self.gate = None,
        }
        if self
            .mine
            .as_ref()
            .is_some_and(|(id, _)| *id == order.rollout)
        {
            return;
        }
        let path = record_path(&cfg.rollout_dir, order.rollout, node);
        let rec = Record {
            rollout: order.rollout,
            node: node.to_string(),
            action: order.action.clone(),
            boot_id: boot.to_string(),
            started_unix: now_unix(),
            state: StepState::Running,
            reason: None,
            exit: None,
            output: String::new(),
            pgid: None,
            agent_version: VERSION.to_string(),
        };
        match create_record(&path, &rec) {
            Ok(true) => {}
            // Recorded before: answered from the record (report()), never run again.
            Ok(false) => return,
            Err(e) => {
                tracing::warn!("rollout {}: {e}", order.rollout);
                return;
            }
        }
        let outcome = Arc::new(Mutex::new(None));
        self.mine = Some((order.rollout, outcome.clone()));
        let (command, what) = match &order.action {
            StepAction::Command { command } => (command.clone(), "the command"),
            StepAction::Reboot => (cfg.reboot_command.clone(), "the reboot command"),
        };
        let due = self.due.clone();
        let env = vec![
            ("BERTH_ROLLOUT", order.rollout.to_string()),
            ("BERTH_NODE", node.to_string()),
        ];
        let timeout = Duration::from_secs(order.timeout_s.max(1));
        std::thread::spawn(move || {
            let mut r = rec;
            let noted = |pgid: i32| {
                let mut with = r.clone();
                with.pgid = start_time(pgid).map(|t| (pgid, t));
                if let Err(e) = finish_record(&path, &with) {
                    tracing::warn!("{e}");
                }
            };
            let ran = run_command(&command, timeout, &env, &noted);
            match ran {
                Err(why) => {
                    r.state = StepState::Failed;
                    r.reason = Some(why);
                }
                Ok(e) => {
                    r.exit = e.exit;
                    r.output = e.output;
                    let reboot = r.action == StepAction::Reboot;
                    if e.timed_out {
                        r.state = StepState::Failed;
                        r.reason = Some(format!(
                            "{what} timed out after {} s (killed)",
                            timeout.as_secs()
                        ));
                    } else if e.exit != Some(0) {
                        r.state = StepState::Failed;
                        r.reason = Some(match e.exit {
                            Some(c) => format!("{what} exited with status {c}"),
                            None => format!("{what} was killed by a signal"),
                        });
                    } else if reboot {
                        // Issued: done when the boot id changes (report()).
                        return;
                    } else {
                        r.state = StepState::Ok;
                        r.reason = Some("exit status 0".into());
                    }
                }
            }
            if let Err(e) = finish_record(&path, &r) {
                tracing::warn!("{e}");
            }
            *outcome.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
            due.store(true, Ordering::Relaxed);
        });
    }

    /// Where the ordered step stands, for the next heartbeat: from this process's step while it
    /// runs, else from the record (finishing one this process never ran as killed midway);
    /// at the gate, with the admin gate check's last result (a new run started when due).
    pub fn report(&mut self, cfg: &AgentConfig, node: &str, boot: &str) -> Option<StepReport> {
        let mut report = self.step_report(cfg, node, boot)?;
        if let Some(g) = self.gate.as_mut()
            && g.rollout == report.rollout
        {
            g.kick(node);
            report.gate = g.last.lock().unwrap_or_else(|p| p.into_inner()).clone();
        }
        Some(report)
    }

    fn step_report(&mut self, cfg: &AgentConfig, node: &str, boot: &str) -> Option<StepReport> {
        let order = self.order.clone()?;
        let path = record_path(&cfg.rollout_dir, order.rollout, node);
        if let Some((id, outcome)) = &self.mine
            && *id == order.rollout
        {
            if let Some(r) = outcome.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
                return Some(r.report());
            }
            let reboot_done = order.action == StepAction::Reboot
                && read_record(&path).is_ok_and(|r| r.boot_id != boot);
            if !reboot_done {
                return Some(StepReport {
                    rollout: order.rollout,
                    state: StepState::Running,
                    reason: None,
                    exit: None,
                    output: String::new(),
                    gate: None,
                });
            }
        }
        let mut r = match read_record(&path) {
            Ok(r) => r,
            Err(e) => {
                return Some(StepReport {
                    rollout: order.rollout,
                    state: StepState::Failed,
                    reason: Some(e.to_string()),
                    exit: None,
                    output: String::new(),
                    gate: None,
                });
            }
        };
        if r.state == StepState::Running {
            if r.action == StepAction::Reboot && r.boot_id != boot {
                r.state = StepState::Ok;
                r.reason = Some(format!("rebooted: boot id {} -> {boot}", r.boot_id));
            } else if !r.agent_version.is_empty() && r.agent_version != VERSION {
                // The step upgraded berth and restarted its agent (the unit's KillMode=process
                // left the command to finish): what it was for happened; the gate judges the rest.
                r.state = StepState::Ok;
                r.reason = Some(format!(
                    "the agent restarted on berth {VERSION} (was {}) while the step ran",
                    r.agent_version
                ));
            } else {
                // What is left of it must not go on unseen: its process group is killed.
                let killed = r.pgid.is_some_and(|(pgid, t)| {
                    start_time(pgid) == Some(t)
                        && nix::sys::signal::killpg(
                            nix::unistd::Pid::from_raw(pgid),
                            nix::sys::signal::Signal::SIGKILL,
                        )
                        .is_ok()
                });
                r.state = StepState::Failed;
                r.reason = Some(format!(
                    "killed midway: it started {} s ago and its agent restarted before it ended \
                     (not run again{})",
                    now_unix().saturating_sub(r.started_unix),
                    if killed {
                        "; what was left of it killed"
                    } else {
                        ""
                    }
                ));
            }
            if let Err(e) = finish_record(&path, &r) {
                tracing::warn!("{e}");
            }
        }
        Some(r.report())
    }
}

/// What `berth cluster rollout` asks the leader.
#[derive(Clone, Debug)]
pub enum Admin {
    /// Start (or with `dry_run`, only plan) a rollout.
    Start(berth_api::RolloutRequest),
    /// The last rollout (or `id`), with one node's step and output when `node` is given.
    Status {
        id: Option<u64>,
        node: Option<String>,
    },
    Pause(Option<u64>),
    Resume(Option<u64>),
    Abort(Option<u64>),
}

/// Asks the leader (`/v1/rollout…`) and returns the rollout as it answers it.
pub fn admin(
    client: &mut crate::client::Client,
    op: &Admin,
) -> Result<berth_api::RolloutView, AgentError> {
    let control = |id: &Option<u64>| {
        serde_json::to_vec(&berth_api::RolloutControl { id: *id }).expect("serializes")
    };
    let (path, body) = match op {
        Admin::Start(req) => (
            "/v1/rollout/start".to_string(),
            Some(serde_json::to_vec(req).expect("serializes")),
        ),
        Admin::Status { id, node } => {
            let mut q = Vec::new();
            if let Some(id) = id {
                q.push(format!("id={id}"));
            }
            if let Some(n) = node {
                q.push(format!("node={n}"));
            }
            let path = if q.is_empty() {
                "/v1/rollout".to_string()
            } else {
                format!("/v1/rollout?{}", q.join("&"))
            };
            (path, None)
        }
        Admin::Pause(id) => ("/v1/rollout/pause".into(), Some(control(id))),
        Admin::Resume(id) => ("/v1/rollout/resume".into(), Some(control(id))),
        Admin::Abort(id) => ("/v1/rollout/abort".into(), Some(control(id))),
    };
    client.ask_json(&path, body.as_deref(), true)
}

fn when(ms: Option<u64>) -> String {
    ms.map_or_else(
        || "-".into(),
        |ms| {
            let s = ms / 1000;
            format!("{:02}:{:02}:{:02}", (s / 3600) % 24, (s / 60) % 60, s % 60)
        },
    )
}

/// A rollout in lines for a terminal: its plan and state, then one line per node (and its
/// output, when the view holds one), or the batches of a dry run.
pub fn lines(v: &berth_api::RolloutView) -> Vec<String> {
    let mut out = vec![
        format!("rollout {}: {} ({})", v.id, v.state, v.action),
        format!(
            "nodes:   {} ({}), at most {} out at once, {}; gate {} passing heartbeats; stops at {} failure(s)",
            v.steps.len(),
            v.selection,
            v.max_unavailable,
            v.deadline_s.map_or_else(
                || "waiting for jobs".to_string(),
                |d| format!("deadline {d} s")
            ),
            v.gate_passes,
            v.failure_threshold
        ),
    ];
    if let Some(c) = &v.gate_command {
        out.push(format!("admin gate check: {c}"));
    }
    if !v.partition_limits.is_empty() {
        let limits: Vec<String> = v
            .partition_limits
            .iter()
            .map(|(p, n)| format!("{p} {n}"))
            .collect();
        out.push(format!(
            "at most out at once per partition: {}",
            limits.join(", ")
        ));
    }
    if let Some(s) = &v.stopped {
        out.push(format!("stopped: {s}"));
    }
    if !v.batches.is_empty() {
        for (i, b) in v.batches.iter().enumerate() {
            out.push(format!("batch {}: {}", i + 1, b.join(",")));
        }
        for s in v.steps.iter().filter(|s| s.phase == "skipped") {
            out.push(format!(
                "skipped: {} ({})",
                s.node,
                s.reason.clone().unwrap_or_default()
            ));
        }
        return out;
    }
    let mut counts: std::collections::BTreeMap<&str, usize> = Default::default();
    for s in &v.steps {
        *counts.entry(s.phase.as_str()).or_default() += 1;
    }
    let counts: Vec<String> = counts.iter().map(|(k, n)| format!("{n} {k}")).collect();
    out.push(format!("steps:   {}", counts.join(", ")));
    out.push(format!(
        "{:<20} {:<9} {:>8} {:>8} {:>5}  REASON",
        "NODE", "PHASE", "STARTED", "ENDED", "EXIT"
    ));
    for s in &v.steps {
        out.push(format!(
            "{:<20} {:<9} {:>8} {:>8} {:>5}  {}",
            s.node,
            s.phase,
            when(s.started_unix_ms),
            when(s.ended_unix_ms),
            s.exit.map_or_else(|| "-".into(), |e| e.to_string()),
            s.reason.clone().unwrap_or_default()
        ));
        if let Some(o) = &s.output {
            out.push(format!(
                "--- output of {} (last {} bytes) ---",
                s.node, STEP_OUTPUT_MAX
            ));
            out.extend(o.lines().map(str::to_string));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(dir: &Path) -> AgentConfig {
        AgentConfig {
            rollout_dir: dir.join("rollout"),
            reboot_command: format!("echo rebooting; touch {}/rebooted", dir.display()),
            ..AgentConfig::default()
        }
    }

    fn order(id: u64, command: &str) -> StepOrder {
        StepOrder {
            rollout: id,
            action: StepAction::Command {
                command: command.into(),
            },
            timeout_s: 5,
            gate_command: None,
        }
    }

    /// Reports until the step leaves `running` (bounded).
    fn settle(s: &mut Steps, c: &AgentConfig, boot: &str) -> StepReport {
        for _ in 0..200 {
            let r = s.report(c, "n1", boot).unwrap();
            if r.state != StepState::Running {
                return r;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the step did not end");
    }

    #[test]
    fn a_step_runs_once_and_later_orders_are_answered_from_its_record() {
        let dir = tempfile::tempdir().unwrap();
        let c = cfg(dir.path());
        let count = dir.path().join("count");
        let cmd = format!(
            "echo ran >> {}; echo out; echo err >&2; exit 3",
            count.display()
        );
        let mut s = Steps::default();
        s.order(Some(order(7, &cmd)), &c, "n1", "b1");
        let r = settle(&mut s, &c, "b1");
        assert_eq!(r.state, StepState::Failed);
        assert_eq!(r.exit, Some(3));
        assert!(r.reason.unwrap().contains("status 3"));
        assert!(r.output.contains("out") && r.output.contains("err"));
        let mode = std::fs::metadata(&c.rollout_dir)
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
        // A new agent (a restart) given the same order runs nothing and reports the record.
        let mut again = Steps::default();
        again.order(Some(order(7, &cmd)), &c, "n1", "b1");
        let r2 = again.report(&c, "n1", "b1").unwrap();
        assert_eq!(r2.state, StepState::Failed);
        assert_eq!(r2.exit, Some(3));
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(std::fs::read_to_string(&count).unwrap(), "ran\n");
    }

    #[test]
    fn a_record_left_running_is_a_command_killed_midway_and_a_reboot_needs_a_new_boot() {
        let dir = tempfile::tempdir().unwrap();
        let c = cfg(dir.path());
        // What an agent killed while its command ran leaves behind: a record saying running,
        // and the command's process group still there.
        let mut left = std::process::Command::new("sleep")
            .arg("100")
            .process_group(0)
            .spawn()
            .unwrap();
        let pgid = i32::try_from(left.id()).unwrap();
        let rec = Record {
            rollout: 3,
            node: "n1".into(),
            action: StepAction::Command {
                command: "sleep 100".into(),
            },
            boot_id: "b1".into(),
            started_unix: now_unix(),
            state: StepState::Running,
            reason: None,
            exit: None,
            output: String::new(),
            pgid: Some((pgid, start_time(pgid).unwrap())),
            agent_version: VERSION.to_string(),
        };
        assert!(create_record(&record_path(&c.rollout_dir, 3, "n1"), &rec).unwrap());
        let mut s = Steps::default();
        s.order(Some(order(3, "sleep 100")), &c, "n1", "b1");
        let r = s.report(&c, "n1", "b1").unwrap();
        assert_eq!(r.state, StepState::Failed);
        assert!(r.reason.unwrap().contains("killed midway"));
        // The leftover command was killed.
        let status = left.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(9)
        );
        // Left running by an agent of another version: the step's own upgrade of berth.
        let upgraded = Record {
            rollout: 5,
            pgid: None,
            agent_version: "0.0.1-old".into(),
            ..rec
        };
        assert!(create_record(&record_path(&c.rollout_dir, 5, "n1"), &upgraded).unwrap());
        let mut s = Steps::default();
        s.order(Some(order(5, "apt-get install berth")), &c, "n1", "b1");
        let r = s.report(&c, "n1", "b1").unwrap();
        assert_eq!(r.state, StepState::Ok);
        assert!(r.reason.unwrap().contains("was 0.0.1-old"));

        let mut s = Steps::default();
        let reboot = StepOrder {
            rollout: 4,
            action: StepAction::Reboot,
            timeout_s: 5,
            gate_command: None,
        };
        s.order(Some(reboot.clone()), &c, "n1", "b1");
        for _ in 0..100 {
            if dir.path().join("rebooted").exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        std::thread::sleep(Duration::from_millis(200));
        // Issued, same boot: still running.
        assert_eq!(s.report(&c, "n1", "b1").unwrap().state, StepState::Running);
        let r = s.report(&c, "n1", "b2").unwrap();
        assert_eq!(r.state, StepState::Ok);
        assert!(r.reason.unwrap().contains("b1 -> b2"));
    }

    #[test]
    fn at_the_gate_the_admin_check_runs_again_until_it_passes_and_its_result_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let c = cfg(dir.path());
        let mut s = Steps::default();
        s.order(Some(order(9, "true")), &c, "n1", "b1");
        assert_eq!(
            settle(&mut s, &c, "b1").gate,
            None,
            "no check before the gate"
        );
        let flag = dir.path().join("healthy");
        let check = format!("echo checking; test -e {}", flag.display());
        let gated = StepOrder {
            gate_command: Some(check),
            ..order(9, "true")
        };
        let gate_after = |s: &mut Steps, want_ok: bool| {
            for _ in 0..200 {
                s.order(Some(gated.clone()), &c, "n1", "b1");
                let r = s.report(&c, "n1", "b1").unwrap();
                assert_eq!(r.state, StepState::Ok, "the step itself is not run again");
                if let Some(g) = r.gate
                    && g.ok == want_ok
                {
                    return g;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            panic!("no gate result ok={want_ok}");
        };
        let g = gate_after(&mut s, false);
        assert_eq!(g.message, "exit status 1: checking");
        std::fs::write(&flag, "").unwrap();
        let g = gate_after(&mut s, true);
        assert_eq!(g.message, "exit status 0: checking");
    }

    #[test]
    fn a_command_past_its_timeout_is_killed_with_its_children() {
        let e = run_command(
            "sleep 30 & sleep 30; echo never",
            Duration::from_millis(300),
            &[],
            &|_| {},
        )
        .unwrap();
        assert!(e.timed_out);
        assert!(!e.output.contains("never"));
        let big = run_command(
            "head -c 10000 /dev/zero | tr '\\0' a; echo END",
            Duration::from_secs(5),
            &[],
            &|_| {},
        )
        .unwrap();
        assert_eq!(big.output.len(), STEP_OUTPUT_MAX);
        assert!(big.output.ends_with("END\n"));
    }
}
