//! The leader's side of rolling maintenance (issue 31; the rules are in crate::rollout): the
//! API (`/v1/rollout…`), the heartbeat's part (the order to a node whose step runs, the agent's
//! report committed, gate passes counted), the driver that asks Slurm how the nodes are and
//! commits what `rollout::decide` says, and the rollout's metrics.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State as AxState;
use axum::http::StatusCode;
use axum::http::Uri;
use axum::response::{IntoResponse, Response};
use berth_api::{
    DaemonState, Heartbeat, RolloutControl, RolloutRequest, StepAction, StepOrder, StepState,
};
use prometheus_client::registry::Registry;

use super::{App, Shared, error, json_body, now_ms, run_tool};
use crate::node::Desired;
use crate::rollout::{self, Cmd, Op, Phase, Plan, SlurmNow};
use crate::state::{Command, State};

/// Gate passes in a row by node, for the rollout they count towards (the leader's memory: a
/// new leader counts afresh, which only delays a resume).
#[derive(Default)]
pub struct Gate {
    passes: std::sync::Mutex<HashMap<String, (u64, u32)>>,
}

impl Gate {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (u64, u32)>> {
        self.passes.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn of(&self, id: u64) -> HashMap<String, u32> {
        self.lock()
            .iter()
            .filter(|(_, (r, _))| *r == id)
            .map(|(n, (_, p))| (n.clone(), *p))
            .collect()
    }

    pub fn clear(&self) {
        self.lock().clear();
    }
}

/// How soon a node in a rollout step beats again (HeartbeatReply::next_beat_ms): its order and
/// its gate passes do not wait a whole heartbeat interval.
const FAST_BEAT_MS: u64 = 250;

/// What a heartbeat needs of the node's step in the live rollout.
struct Mine {
    id: u64,
    phase: Phase,
    action: StepAction,
    timeout_s: u64,
    boot_before: String,
    gate_passes: u32,
    gate_command: Option<String>,
    /// Waiting and among the next `max_unavailable` to start: its order will not wait a whole
    /// heartbeat interval either.
    next_in_line: bool,
}

fn mine(state: &State, node: &str) -> Option<Mine> {
    let r = state.rollouts.live()?;
    let s = r.steps.get(node)?;
    Some(Mine {
        id: r.id,
        phase: s.phase,
        action: r.plan.action.clone(),
        timeout_s: r.plan.timeout_s,
        boot_before: s.boot_before.clone(),
        gate_passes: r.plan.gate_passes,
        gate_command: r.plan.gate_command.clone(),
        next_in_line: s.phase == Phase::Waiting
            && r.status == rollout::Status::Running
            && r.plan
                .nodes
                .iter()
                .filter(|n| r.steps.get(*n).is_some_and(|x| x.phase == Phase::Waiting))
                .take(usize::try_from(r.plan.max_unavailable).unwrap_or(usize::MAX))
                .any(|n| n == node),
    })
}

/// Whether a heartbeat passes the health gate: every check passing, no node daemon down or
/// unknown, and after a reboot a new boot id.
pub fn gate_ok(hb: &Heartbeat, boot_before: &str, action: &StepAction) -> bool {
    hb.checks.iter().all(|c| c.status == berth_api::Status::Ok)
        && hb
            .daemons
            .iter()
            .all(|d| matches!(d.state, DaemonState::Up | DaemonState::NotConfigured))
        && (*action != StepAction::Reboot || hb.boot_id != boot_before)
}

/// The heartbeat's part: commits the agent's outcome of a running step, counts gate passes,
/// and answers the order while the step runs, with how soon to beat again while in a step.
// The error is the HTTP answer itself, built once and returned as is.
#[allow(clippy::result_large_err)]
pub async fn on_heartbeat(
    app: &App,
    hb: &Heartbeat,
) -> Result<(Option<StepOrder>, Option<u64>), Response> {
    let Some(m) = mine(&app.store.lock().state, &hb.node) else {
        return Ok((None, None));
    };
    let fast = (m.phase.in_flight() || m.next_in_line).then_some(FAST_BEAT_MS);
    step(app, hb, m).await.map(|o| (o, fast))
}

#[allow(clippy::result_large_err)]
async fn step(app: &App, hb: &Heartbeat, m: Mine) -> Result<Option<StepOrder>, Response> {
    match m.phase {
        Phase::Running => {
            if let Some(rep) = &hb.step_report
                && rep.rollout == m.id
                && rep.state != StepState::Running
            {
                let cmd = Cmd::Report {
                    id: m.id,
                    node: hb.node.clone(),
                    report: rep.clone(),
                    now_ms: now_ms(),
                };
                app.write(Command::Rollout(cmd)).await?;
                return Ok(None);
            }
            Ok(Some(StepOrder {
                rollout: m.id,
                action: m.action,
                timeout_s: m.timeout_s,
                gate_command: None,
            }))
        }
        Phase::Gating => {
            // The admin's check: its last run on the node, for this rollout, exited 0.
            let admin = hb
                .step_report
                .as_ref()
                .filter(|r| r.rollout == m.id)
                .and_then(|r| r.gate.as_ref());
            if let (Some(g), Some(_)) = (admin, &m.gate_command)
                && !g.ok
            {
                tracing::info!(
                    "rollout {}: {}'s admin gate check: {}",
                    m.id,
                    hb.node,
                    g.message
                );
            }
            let admin_ok = m.gate_command.is_none() || admin.is_some_and(|g| g.ok);
            let ok = gate_ok(hb, &m.boot_before, &m.action) && admin_ok;
            let mut g = app.rollout_gate.lock();
            let e = g.entry(hb.node.clone()).or_insert((m.id, 0));
            if e.0 != m.id {
                *e = (m.id, 0);
            }
            e.1 = if ok { e.1.saturating_add(1) } else { 0 };
            if e.1 >= m.gate_passes {
                app.rollout_now.notify_one();
            }
            // The agent runs the admin's check while this order stands.
            Ok(m.gate_command.map(|c| StepOrder {
                rollout: m.id,
                action: m.action,
                timeout_s: m.timeout_s,
                gate_command: Some(c),
            }))
        }
        _ => Ok(None),
    }
}

/// `sinfo -h -N -o %N|%T|%E` → node → (state, reason).
fn parse_states(text: &str) -> BTreeMap<String, (String, String)> {
    text.lines()
        .filter_map(|l| {
            let mut f = l.splitn(3, '|');
            let n = f.next()?.trim();
            let st = f.next()?.trim().to_ascii_lowercase();
            let reason = f.next().unwrap_or("").trim();
            (!n.is_empty()).then(|| {
                (
                    n.to_string(),
                    (st, if reason == "none" { "" } else { reason }.to_string()),
                )
            })
        })
        .collect()
}

/// `sinfo -h -N -o %N|%R` → node → its partitions (a node of several has a line for each).
fn parse_partitions(text: &str) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for l in text.lines() {
        if let Some((n, p)) = l.split_once('|')
            && !n.trim().is_empty()
            && !p.trim().is_empty()
        {
            let parts = out.entry(n.trim().to_string()).or_default();
            if !parts.iter().any(|x| x == p.trim()) {
                parts.push(p.trim().to_string());
            }
        }
    }
    out
}

/// Each node's partitions and, per partition, its limit: `spec` of the plan's nodes in it.
async fn partition_limits(
    app: &App,
    nodes: &[String],
    spec: &str,
) -> Result<(BTreeMap<String, u32>, BTreeMap<String, Vec<String>>), String> {
    let term = app.raft.metrics().borrow().current_term;
    let args: Vec<String> = ["-h", "-N", "-o", "%N|%R"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let mut partitions = run_tool(&app.s.sinfo, &args, term, app.s.id)
        .await
        .map(|t| parse_partitions(&t))
        .map_err(|e| format!("{e}; retry"))?;
    partitions.retain(|n, _| nodes.contains(n));
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for p in partitions.values().flatten() {
        *counts.entry(p.clone()).or_insert(0) += 1;
    }
    let mut limits = BTreeMap::new();
    for (p, n) in counts {
        let limit = rollout::max_unavailable(spec, n).map_err(|e| format!("per partition: {e}"))?;
        limits.insert(p, limit);
    }
    Ok((limits, partitions))
}

async fn sinfo(app: &App, extra: &[&str]) -> Result<BTreeMap<String, (String, String)>, String> {
    let mut args: Vec<String> = ["-h", "-N", "-o", "%N|%T|%E"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    let term = app.raft.metrics().borrow().current_term;
    run_tool(&app.s.sinfo, &args, term, app.s.id)
        .await
        .map(|t| parse_states(&t))
        .map_err(|e| e.to_string())
}

/// The nodes a request names, in order.
async fn resolve(app: &App, req: &RolloutRequest) -> Result<(Vec<String>, String), String> {
    let term = app.raft.metrics().borrow().current_term;
    match (&req.nodes, &req.partition) {
        (Some(_), Some(_)) => Err("give a hostlist or a partition, not both".into()),
        (Some(list), None) => {
            let args = vec!["show".to_string(), "hostnames".into(), list.clone()];
            let text = run_tool(&app.s.scontrol, &args, term, app.s.id)
                .await
                .map_err(|e| format!("expanding the hostlist {list:?}: {e}"))?;
            let mut v: Vec<String> = text.lines().map(|l| l.trim().to_string()).collect();
            v.retain(|n| !n.is_empty());
            v.dedup();
            Ok((v, list.clone()))
        }
        (None, Some(p)) => {
            let m = sinfo(app, &["-p", p]).await?;
            Ok((m.into_keys().collect(), format!("partition {p}")))
        }
        (None, None) => Ok((sinfo(app, &[]).await?.into_keys().collect(), "all".into())),
    }
}

/// `POST /v1/rollout/start`: plans the rollout; commits it unless a dry run.
pub async fn start(AxState(app): AxState<Shared>, body: Bytes) -> Response {
    if !app.is_leader_now() {
        return app.not_leader();
    }
    let req: RolloutRequest = match json_body(&body) {
        Ok(r) => r,
        Err(e) => return e,
    };
    let bad = |m: String| error(StatusCode::BAD_REQUEST, m);
    let action = match (&req.command, req.reboot) {
        (Some(c), false) if !c.trim().is_empty() => StepAction::Command { command: c.clone() },
        (None, true) => StepAction::Reboot,
        _ => return bad("give a command or reboot, one of them".into()),
    };
    if req.timeout_s == 0 {
        return bad("timeout: at least 1 s".into());
    }
    let (nodes, selection) = match resolve(&app, &req).await {
        Ok(n) => n,
        Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, format!("{e}; retry")),
    };
    if nodes.is_empty() {
        return bad(format!("{selection}: names no node Slurm knows"));
    }
    let slurm = match sinfo(&app, &[]).await {
        Ok(s) => s,
        Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, format!("{e}; retry")),
    };
    let state = app.store.lock().state.clone();
    if let Some(r) = state.rollouts.live()
        && !req.dry_run
    {
        return error(
            StatusCode::CONFLICT,
            format!(
                "rollout {} is still {}: wait for it, or `berth cluster rollout abort`",
                r.id,
                r.status.word()
            ),
        );
    }
    let mut included = Vec::new();
    let mut skipped = Vec::new();
    for n in nodes {
        let (st, reason) = slurm.get(&n).cloned().unwrap_or_default();
        let berth_drain = state.nodes.get(&n).and_then(|s| match &s.desired {
            Desired::Drained { reason, .. } => Some(reason.clone()),
            Desired::Up => None,
        });
        if !state.nodes.contains_key(&n) {
            skipped.push((n, "no berth agent has reported from it".to_string()));
        } else if !req.include_drained
            && (st.contains("drain") || st.contains("down") || berth_drain.is_some())
        {
            let why = berth_drain.unwrap_or(reason);
            skipped.push((n, format!("drained before the rollout ({st}: {why})")));
        } else {
            included.push(n);
        }
    }
    let max = match rollout::max_unavailable(&req.max_unavailable, included.len()) {
        Ok(m) => m,
        Err(e) => return bad(e),
    };
    let (partition_limits, partitions) = match &req.max_unavailable_per_partition {
        Some(spec) => match partition_limits(&app, &included, spec).await {
            Ok(l) => l,
            Err(e) if e.starts_with("per partition") => return bad(e),
            Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, e),
        },
        None => Default::default(),
    };
    let plan = Plan {
        partition_limits,
        partitions,
        gate_command: req.gate_command.clone().filter(|c| !c.trim().is_empty()),
        nodes: included,
        selection,
        action,
        timeout_s: req.timeout_s,
        max_unavailable: max,
        deadline_s: req.deadline_s,
        gate_passes: req.gate_passes,
        failure_threshold: req.failure_threshold.max(1),
    };
    if req.dry_run {
        let busy: Vec<String> = plan
            .nodes
            .iter()
            .filter(|n| {
                slurm
                    .get(*n)
                    .is_some_and(|(st, _)| ["alloc", "mix", "comp"].iter().any(|w| st.contains(w)))
            })
            .cloned()
            .collect();
        let mut s = State::default();
        rollout::apply(
            &mut s.nodes,
            &mut s.rollouts,
            &Cmd::Start {
                plan: plan.clone(),
                skipped,
                now_ms: now_ms(),
            },
        );
        let Some(r) = s.rollouts.list.first() else {
            return error(StatusCode::INTERNAL_SERVER_ERROR, "planning failed");
        };
        let mut v = rollout::view(r, None);
        v.id = state.rollouts.next_id + 1;
        v.state = "dry-run".into();
        v.batches = rollout::batches(&plan, &busy);
        return Json(v).into_response();
    }
    let cmd = Cmd::Start {
        plan,
        skipped,
        now_ms: now_ms(),
    };
    match app.write(Command::Rollout(cmd)).await {
        Ok(r) if r.rollout == 0 => error(
            StatusCode::CONFLICT,
            "another rollout started meanwhile: see `berth cluster rollout status`",
        ),
        Ok(r) => {
            let state = app.store.lock().state.clone();
            match state.rollouts.get(r.rollout) {
                Some(ro) => Json(rollout::view(ro, None)).into_response(),
                None => error(StatusCode::INTERNAL_SERVER_ERROR, "the rollout vanished"),
            }
        }
        Err(r) => r,
    }
}

async fn control(app: Shared, body: Bytes, op: Op) -> Response {
    let req: RolloutControl = match json_body(&body) {
        Ok(r) => r,
        Err(e) => return e,
    };
    let id = {
        let st = &app.store.lock().state;
        req.id.or_else(|| st.rollouts.live().map(|r| r.id))
    };
    let Some(id) = id else {
        return error(StatusCode::NOT_FOUND, "no rollout in progress");
    };
    let cmd = Cmd::Control {
        id,
        op,
        now_ms: now_ms(),
    };
    match app.write(Command::Rollout(cmd)).await {
        Ok(_) => {
            let state = app.store.lock().state.clone();
            match state.rollouts.get(id) {
                Some(r) => Json(rollout::view(r, None)).into_response(),
                None => error(StatusCode::NOT_FOUND, format!("rollout {id}: unknown")),
            }
        }
        Err(r) => r,
    }
}

pub async fn pause(AxState(app): AxState<Shared>, body: Bytes) -> Response {
    control(app, body, Op::Pause).await
}

pub async fn resume(AxState(app): AxState<Shared>, body: Bytes) -> Response {
    control(app, body, Op::Resume).await
}

pub async fn abort(AxState(app): AxState<Shared>, body: Bytes) -> Response {
    control(app, body, Op::Abort).await
}

/// `GET /v1/rollout[?id=N][&node=NODE]`: the rollout (the last one by default); with a node,
/// only its step, with its output.
pub async fn get(AxState(app): AxState<Shared>, uri: Uri) -> Response {
    let mut id = None;
    let mut node = None;
    for kv in uri.query().unwrap_or("").split('&') {
        match kv.split_once('=') {
            Some(("id", v)) => match v.parse::<u64>() {
                Ok(v) => id = Some(v),
                Err(_) => return error(StatusCode::BAD_REQUEST, "id: a rollout's number"),
            },
            Some(("node", v)) => node = Some(v.to_string()),
            _ => {}
        }
    }
    let state = app.store.lock().state.clone();
    let r = match id {
        Some(id) => state.rollouts.get(id),
        None => state.rollouts.list.last(),
    };
    match r {
        Some(r) => Json(rollout::view(r, node.as_deref())).into_response(),
        None => error(StatusCode::NOT_FOUND, "no rollout yet"),
    }
}

/// The driver: while a rollout is live, asks Slurm how its nodes are and commits what
/// `rollout::decide` says. Only the leader drives; a follower's loop idles.
pub async fn run(app: Arc<App>) {
    let every = Duration::from_millis(app.s.reconcile_interval_ms.clamp(50, 500));
    loop {
        let _ = tokio::time::timeout(every, app.rollout_now.notified()).await;
        if !app.is_leader_now() {
            app.rollout_gate.clear();
            continue;
        }
        if app.store.lock().state.rollouts.live().is_none() {
            continue;
        }
        if let Err(e) = round(&app).await {
            tracing::warn!("rollout: {e}");
        }
    }
}

async fn round(app: &App) -> Result<(), String> {
    let states = sinfo(app, &[]).await?;
    let Some(r) = app.store.lock().state.rollouts.live().cloned() else {
        return Ok(());
    };
    let mut slurm: BTreeMap<String, SlurmNow> = states
        .into_iter()
        .map(|(n, (state, reason))| {
            (
                n,
                SlurmNow {
                    state,
                    jobs: false,
                    reason,
                },
            )
        })
        .collect();
    // squeue, the belt to sinfo's braces: asked for the draining nodes Slurm calls drained.
    let ready: Vec<String> = r
        .steps
        .iter()
        .filter(|(n, s)| {
            s.phase == Phase::Draining
                && slurm
                    .get(*n)
                    .is_some_and(|x| x.state.starts_with("drained"))
        })
        .map(|(n, _)| n.clone())
        .collect();
    if !ready.is_empty() {
        let term = app.raft.metrics().borrow().current_term;
        let args = |nodes: &str| {
            vec![
                "-h".to_string(),
                "-w".into(),
                nodes.to_string(),
                "-o".into(),
                "%A".into(),
            ]
        };
        let all = run_tool(&app.s.squeue, &args(&ready.join(",")), term, app.s.id)
            .await
            .map_err(|e| e.to_string())?;
        if !all.trim().is_empty() {
            for n in &ready {
                let one = run_tool(&app.s.squeue, &args(n), term, app.s.id)
                    .await
                    .map_err(|e| e.to_string())?;
                if let Some(x) = slurm.get_mut(n) {
                    x.jobs = !one.trim().is_empty();
                }
            }
        }
    }
    // A node that ended makes room: decided again at once, not a round later.
    for _ in 0..2 {
        let passes = app.rollout_gate.of(r.id);
        let cmds = {
            let st = app.store.lock();
            let Some(r) = st.state.rollouts.get(r.id) else {
                return Ok(());
            };
            rollout::decide(r, &st.state.nodes, &slurm, &passes, now_ms())
        };
        let again = cmds
            .iter()
            .any(|c| matches!(c, Cmd::Pass { .. } | Cmd::Skip { .. } | Cmd::Fail { .. }));
        let slurm_too = cmds
            .iter()
            .any(|c| !matches!(c, Cmd::Run { .. } | Cmd::Report { .. }));
        for c in cmds {
            if let Err(resp) = app.write(Command::Rollout(c)).await {
                return Err(format!("committing a step: HTTP {}", resp.status()));
            }
        }
        // A drain or resume goes to Slurm now, not at the next reconcile round.
        if slurm_too {
            app.reconcile_now.notify_one();
        }
        if !again {
            break;
        }
    }
    Ok(())
}

/// The last rollout's gauges: nodes by phase, failures, whether it runs.
pub fn metrics(state: &State, reg: &mut Registry) {
    use prometheus_client::metrics::family::Family;
    use prometheus_client::metrics::gauge::Gauge;
    let Some(r) = state.rollouts.list.last() else {
        return;
    };
    let by_phase: Family<Vec<(String, String)>, Gauge> = Family::default();
    for p in [
        Phase::Waiting,
        Phase::Draining,
        Phase::Running,
        Phase::Gating,
        Phase::Done,
        Phase::Failed,
        Phase::Skipped,
    ] {
        let n = r.steps.values().filter(|s| s.phase == p).count();
        by_phase
            .get_or_create(&vec![
                ("rollout".to_string(), r.id.to_string()),
                ("phase".to_string(), p.word().to_string()),
            ])
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }
    reg.register(
        "rollout_nodes",
        "Nodes of the last rollout by phase",
        by_phase,
    );
    let g = |v: i64| {
        let g: Gauge = Gauge::default();
        g.set(v);
        g
    };
    reg.register(
        "rollout_id",
        "The last rollout's id",
        g(i64::try_from(r.id).unwrap_or(i64::MAX)),
    );
    reg.register(
        "rollout_running",
        "1 while the last rollout may start nodes (not paused, stopped or done)",
        g(i64::from(r.status == rollout::Status::Running)),
    );
    reg.register(
        "rollout_failures",
        "Failed nodes of the last rollout",
        g(i64::from(r.failures)),
    );
    let secs = r
        .ended_ms
        .unwrap_or_else(now_ms)
        .saturating_sub(r.created_ms)
        / 1000;
    reg.register(
        "rollout_seconds",
        "How long the last rollout has run (until it ended)",
        g(i64::try_from(secs).unwrap_or(i64::MAX)),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_of_several_partitions_is_in_each() {
        let m = parse_partitions("g1|gpu\ng1|all\nc1|cpu\nc1|cpu\n|x\nbad\n");
        assert_eq!(m["g1"], ["gpu", "all"]);
        assert_eq!(m["c1"], ["cpu"]);
        assert_eq!(m.len(), 2);
    }

    #[test]
    fn sinfo_states_parse_and_the_gate_needs_all_passing_and_a_new_boot() {
        let m = parse_states("n1|idle|none\nn2|drained|berth rollout 1\n\n");
        assert_eq!(m["n1"], ("idle".to_string(), String::new()));
        assert_eq!(m["n2"].1, "berth rollout 1");
        let mut hb = Heartbeat {
            node: "n1".into(),
            boot_id: "b1".into(),
            version: "v".into(),
            checks: vec![berth_api::CheckResult {
                name: "gpu-count".into(),
                status: berth_api::Status::Ok,
                severity: berth_api::Severity::Hard,
                recoverable: true,
                message: "ok".into(),
            }],
            versions: Default::default(),
            images: vec![],
            leftovers: vec![],
            cause: None,
            daemons: vec![berth_api::DaemonReport {
                daemon: "slurmd".into(),
                state: DaemonState::Up,
                message: String::new(),
            }],
            peer: None,
            refs: Default::default(),
            step_report: None,
        };
        let cmd = StepAction::Command {
            command: "true".into(),
        };
        assert!(gate_ok(&hb, "b1", &cmd));
        assert!(!gate_ok(&hb, "b1", &StepAction::Reboot));
        assert!(gate_ok(&hb, "b0", &StepAction::Reboot));
        hb.daemons[0].state = DaemonState::Down;
        assert!(!gate_ok(&hb, "b1", &cmd));
        hb.daemons[0].state = DaemonState::Up;
        hb.checks[0].status = berth_api::Status::Unknown;
        assert!(!gate_ok(&hb, "b1", &cmd));
    }
}
