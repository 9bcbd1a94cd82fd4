//! The controller's HTTP API (agents, the admin CLI, peers' Raft RPCs), its metrics, and the
//! leader's services over the shared [`App`]: the reconciler that applies committed decisions
//! to Slurm, the image catalog (`catalog`), the watch on Slurm's daemons (`watch`,
//! `watch_metrics`) and the rollout driver (`rollout`).
//!
//! Every request must prove it holds the shared key (berth_api::auth; 401 otherwise), and every
//! answer to one proves this controller holds it too; only `GET /metrics` is open, read-only, to
//! Prometheus. Connections are bounded and timed by listen.rs. Leader-only requests (heartbeats,
//! admin commands) get 421 with the leader's address from a follower. Heartbeats stay in the
//! leader's memory; a heartbeat that changes a node's verdict or counters becomes a Raft entry
//! before anything acts on it. The reconciler confirms leadership with a quorum
//! (`ensure_linearizable`) before every `scontrol` call, so a deposed leader calls nothing.

use std::collections::{BTreeMap, HashMap};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{Request, State as AxState};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use berth_api::{
    ClusterStatus, DrainRequest, ErrorReply, Heartbeat, HeartbeatReply, NodeView, NotLeader,
    ResumeRequest,
};
use openraft::error::{ClientWriteError, RaftError};
use openraft::raft::{AppendEntriesRequest, InstallSnapshotRequest, VoteRequest};
use openraft::{BasicNode, Raft, ServerState};
use sha2::{Digest, Sha256};

use crate::error::ControllerError;
use crate::node::{Desired, DrainedBy};
use crate::state::{Command, PREFIX, State};
use crate::store::Store;
use crate::{Settings, TypeConfig};

/// What the leader keeps of a node's last heartbeat (memory only, never replicated).
#[derive(Clone, Debug)]
pub(crate) struct Beat {
    at: Instant,
    versions: BTreeMap<String, String>,
    images: Vec<String>,
    pub(crate) leftovers: Vec<String>,
    pub(crate) daemons: Vec<berth_api::DaemonReport>,
}

pub(crate) mod catalog;
mod metrics;
mod rollout;
mod watch;
mod watch_metrics;
use self::metrics::metrics;

pub struct App {
    pub s: Settings,
    key: berth_api::auth::Key,
    /// Nonces of requests verified within the clock skew window.
    seen: berth_api::auth::ReplayCache,
    pub(crate) raft: Raft<TypeConfig>,
    pub(crate) store: Store,
    voters: BTreeMap<u64, BasicNode>,
    /// Last heartbeat per node: the leader's memory only.
    beats: Mutex<HashMap<String, Beat>>,
    /// When this controller last became leader.
    leader_since: Mutex<Option<Instant>>,
    leader_changes: AtomicU64,
    scontrol_calls: AtomicU64,
    scontrol_failures: AtomicU64,
    /// Heartbeats agents sent early because a check changed status.
    change_beats: AtomicU64,
    /// The watch on Slurm's daemons (server/watch.rs).
    pub(crate) watch: watch::Watch,
    /// `scontrol takeover` calls that succeeded on this controller.
    pub(crate) takeovers_run: AtomicU64,
    /// Which nodes hold which images, from heartbeats (the leader's memory).
    pub catalog: catalog::Catalog,
    /// Rollout gate passes counted from heartbeats (server/rollout.rs).
    rollout_gate: rollout::Gate,
    /// Wakes the reconciler before its interval (a rollout's drain or resume).
    reconcile_now: tokio::sync::Notify,
    /// Wakes the rollout driver before its interval (Slurm changed, a gate passed).
    rollout_now: tokio::sync::Notify,
}

type Shared = Arc<App>;

pub async fn serve(
    s: Settings,
    key: String,
    raft: Raft<TypeConfig>,
    store: Store,
    voters: BTreeMap<u64, BasicNode>,
    listener: tokio::net::TcpListener,
) -> anyhow::Result<()> {
    let app = Arc::new(App {
        key: berth_api::auth::Key::new(&key),
        seen: berth_api::auth::ReplayCache::default(),
        watch: watch::Watch::new(&s),
        takeovers_run: AtomicU64::new(0),
        s,
        raft,
        store,
        voters,
        beats: Mutex::default(),
        leader_since: Mutex::default(),
        leader_changes: AtomicU64::new(0),
        scontrol_calls: AtomicU64::new(0),
        scontrol_failures: AtomicU64::new(0),
        change_beats: AtomicU64::new(0),
        catalog: catalog::Catalog::default(),
        rollout_gate: rollout::Gate::default(),
        reconcile_now: tokio::sync::Notify::new(),
        rollout_now: tokio::sync::Notify::new(),
    });
    tokio::spawn(watch_leader(app.clone()));
    tokio::spawn(reconcile_loop(app.clone()));
    tokio::spawn(watch::run(app.clone()));
    tokio::spawn(rollout::run(app.clone()));
    let router = Router::new()
        .route("/raft/append", post(raft_append))
        .route("/raft/vote", post(raft_vote))
        .route("/raft/snapshot", post(raft_snapshot))
        .route("/v1/heartbeat", post(heartbeat))
        .route("/v1/status", get(status))
        .route("/v1/nodes", get(nodes))
        .route("/v1/drain", post(drain))
        .route("/v1/resume", post(resume))
        .route("/v1/breaker/reset", post(breaker_reset))
        .route("/v1/slurm", get(slurm))
        .route("/v1/catalog", get(catalog::get))
        .route("/v1/rollout", get(rollout::get))
        .route("/v1/rollout/start", post(rollout::start))
        .route("/v1/rollout/pause", post(rollout::pause))
        .route("/v1/rollout/resume", post(rollout::resume))
        .route("/v1/rollout/abort", post(rollout::abort))
        .route("/metrics", get(metrics))
        .layer(middleware::from_fn_with_state(app.clone(), auth))
        .with_state(app);
    crate::listen::serve(listener, router).await;
    Ok(())
}

/// The most bytes of a request body: a Raft RPC (entries, a snapshot), anything else.
const RAFT_BODY_MAX: usize = 64 << 20;
const BODY_MAX: usize = 1 << 20;
/// How long a verified request's body may take to arrive.
const BODY_DEADLINE: Duration = Duration::from_secs(30);

/// Verifies a request's proof of the key from its head, before its body is read (an
/// unauthenticated client gets nothing buffered), then its body against the signed hash, and
/// signs the answer. `GET /metrics` needs no key.
async fn auth(AxState(app): AxState<Shared>, req: Request, next: Next) -> Response {
    use axum::body::{Body, to_bytes};
    use berth_api::auth;
    if req.method() == axum::http::Method::GET && req.uri().path() == "/metrics" {
        return next.run(req).await;
    }
    let (parts, body) = req.into_parts();
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let header = parts
        .headers
        .get(auth::AUTH_HEADER)
        .and_then(|v| v.to_str().ok());
    let verified = match auth::verify_request(
        &app.key,
        header,
        parts.method.as_str(),
        path,
        auth::now(),
        &app.seen,
    ) {
        Ok(v) => v,
        Err(e) => return error(StatusCode::UNAUTHORIZED, format!("{path}: {e}")),
    };
    if let Some(conn) = parts.extensions.get::<Arc<crate::listen::Conn>>() {
        conn.authenticated();
    }
    let limit = if parts.uri.path().starts_with("/raft/") {
        RAFT_BODY_MAX
    } else {
        BODY_MAX
    };
    let bytes = match tokio::time::timeout(BODY_DEADLINE, to_bytes(body, limit)).await {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => {
            return error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("{path}: the body (at most {limit} bytes): {e}"),
            );
        }
        Err(_) => {
            return error(
                StatusCode::REQUEST_TIMEOUT,
                format!("{path}: the body did not arrive within {BODY_DEADLINE:?}"),
            );
        }
    };
    if let Err(e) = verified.check_body(&bytes) {
        return error(StatusCode::UNAUTHORIZED, format!("{path}: {e}"));
    }
    let resp = next
        .run(Request::from_parts(parts, Body::from(bytes)))
        .await;
    let (mut head, body) = resp.into_parts();
    // The answers are JSON built in memory: collecting them costs nothing new.
    let bytes = to_bytes(body, usize::MAX).await.unwrap_or_default();
    let proof = auth::sign_answer(
        &app.key,
        &verified.nonce,
        head.status.as_u16(),
        &auth::body_tag(&bytes),
    );
    if let Ok(v) = proof.parse() {
        head.headers.insert(auth::PROOF_HEADER, v);
    }
    Response::from_parts(head, Body::from(bytes))
}

fn error(code: StatusCode, msg: impl Into<String>) -> Response {
    (code, Json(ErrorReply { error: msg.into() })).into_response()
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl App {
    fn leader(&self) -> (Option<u64>, Option<String>) {
        let m = self.raft.metrics().borrow().clone();
        let addr = m.current_leader.and_then(|l| {
            m.membership_config
                .membership()
                .get_node(&l)
                .map(|n| n.addr.clone())
                .or_else(|| self.voters.get(&l).map(|n| n.addr.clone()))
        });
        (m.current_leader, addr)
    }

    pub(crate) fn not_leader(&self) -> Response {
        let (_, addr) = self.leader();
        let mut r = (
            StatusCode::from_u16(berth_api::NOT_LEADER_STATUS).expect("421 is a status"),
            Json(NotLeader {
                leader: addr.clone(),
            }),
        )
            .into_response();
        if let Some(a) = addr.and_then(|a| a.parse().ok()) {
            r.headers_mut().insert(berth_api::LEADER_HEADER, a);
        }
        r
    }

    pub(crate) fn is_leader_now(&self) -> bool {
        self.raft.metrics().borrow().state == ServerState::Leader
    }

    /// Commits a command; a follower's or deposed leader's answer is 421.
    // The error is the HTTP answer itself, built once and returned as is.
    #[allow(clippy::result_large_err)]
    async fn write(&self, cmd: Command) -> Result<crate::state::Reply, Response> {
        match self.raft.client_write(cmd).await {
            Ok(r) => Ok(r.data),
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(_))) => {
                Err(self.not_leader())
            }
            Err(e) => Err(error(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("committing to the Raft log failed: {e}; retry"),
            )),
        }
    }
}

#[allow(clippy::result_large_err)]
fn json_body<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, Response> {
    serde_json::from_slice(body).map_err(|e| error(StatusCode::BAD_REQUEST, format!("body: {e}")))
}

async fn raft_append(AxState(app): AxState<Shared>, body: Bytes) -> Response {
    let req: AppendEntriesRequest<TypeConfig> = match json_body(&body) {
        Ok(r) => r,
        Err(e) => return e,
    };
    Json(app.raft.append_entries(req).await).into_response()
}

async fn raft_vote(AxState(app): AxState<Shared>, body: Bytes) -> Response {
    let req: VoteRequest<u64> = match json_body(&body) {
        Ok(r) => r,
        Err(e) => return e,
    };
    Json(app.raft.vote(req).await).into_response()
}

async fn raft_snapshot(AxState(app): AxState<Shared>, body: Bytes) -> Response {
    let req: InstallSnapshotRequest<TypeConfig> = match json_body(&body) {
        Ok(r) => r,
        Err(e) => return e,
    };
    Json(app.raft.install_snapshot(req).await).into_response()
}

async fn heartbeat(AxState(app): AxState<Shared>, Json(hb): Json<Heartbeat>) -> Response {
    if !app.is_leader_now() {
        return app.not_leader();
    }
    if hb.node.is_empty() || hb.node.len() > 256 || hb.node.contains(char::is_whitespace) {
        return error(
            StatusCode::BAD_REQUEST,
            "node: a Slurm node name, no spaces",
        );
    }
    app.beats.lock().unwrap_or_else(|p| p.into_inner()).insert(
        hb.node.clone(),
        Beat {
            at: Instant::now(),
            versions: hb.versions.clone(),
            images: hb.images.clone(),
            leftovers: hb.leftovers.clone(),
            daemons: hb.daemons.clone(),
        },
    );
    app.catalog.record(&hb);
    if hb.cause.as_deref() == Some("change") {
        app.change_beats.fetch_add(1, Ordering::Relaxed);
    }
    let known = app
        .store
        .lock()
        .state
        .nodes
        .get(&hb.node)
        .map(|n| (n.boot_id.clone(), n.version.clone()));
    if known.as_ref() != Some(&(hb.boot_id.clone(), hb.version.clone())) {
        let cmd = Command::Register {
            node: hb.node.clone(),
            boot_id: hb.boot_id.clone(),
            version: hb.version.clone(),
        };
        if let Err(r) = app.write(cmd).await {
            return r;
        }
    }
    let (step, next_beat_ms) = match rollout::on_heartbeat(&app, &hb).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let cmd = Command::Verdict {
        node: hb.node.clone(),
        checks: hb.checks,
        now_ms: now_ms(),
        rules: app.s.rules(),
    };
    let changes = app.store.lock().state.changes(&cmd);
    let desired = if changes {
        match app.write(cmd).await {
            Ok(r) => r.desired,
            Err(r) => return r,
        }
    } else {
        app.store
            .lock()
            .state
            .nodes
            .get(&hb.node)
            .map_or("up", |n| n.desired.word())
            .to_string()
    };
    Json(HeartbeatReply {
        term: app.raft.metrics().borrow().current_term,
        desired,
        step,
        next_beat_ms,
    })
    .into_response()
}

fn state_hash(state: &State) -> String {
    let bytes = serde_json::to_vec(state).expect("the state serializes");
    let d = Sha256::digest(&bytes);
    d.iter().map(|b| format!("{b:02x}")).collect()
}

async fn status(AxState(app): AxState<Shared>) -> Response {
    let m = app.raft.metrics().borrow().clone();
    let (leader, leader_addr) = app.leader();
    let machine = app.store.lock().clone();
    let st = &machine.state;
    Json(ClusterStatus {
        id: app.s.id,
        leader,
        leader_addr,
        term: m.current_term,
        applied: m.last_applied.map_or(0, |l| l.index),
        voters: m.membership_config.membership().voter_ids().collect(),
        nodes: st.nodes.len(),
        drained: st
            .nodes
            .values()
            .filter(|n| matches!(n.desired, Desired::Drained { .. }))
            .count(),
        breaker_tripped: st.breaker.tripped,
        suppressed: st.breaker.suppressed,
        state_hash: state_hash(st),
    })
    .into_response()
}

async fn nodes(AxState(app): AxState<Shared>) -> Response {
    let state = app.store.lock().state.clone();
    let beats = app.beats.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let leader = app.is_leader_now();
    let orphaned = if leader {
        watch::orphaned(&app, &beats)
    } else {
        BTreeMap::new()
    };
    let out: Vec<NodeView> = state
        .nodes
        .iter()
        .map(|(name, n)| {
            let beat = beats.get(name).filter(|_| leader);
            let (reason, by) = match &n.desired {
                Desired::Up => (None, None),
                Desired::Drained { reason, by } => (
                    Some(reason.clone()),
                    Some(match by {
                        DrainedBy::Berth => "berth".to_string(),
                        DrainedBy::Admin => "admin".to_string(),
                        DrainedBy::Rollout => "rollout".to_string(),
                    }),
                ),
            };
            NodeView {
                node: name.clone(),
                desired: n.desired.word().into(),
                reason,
                drained_by: by,
                boot_id: n.boot_id.clone(),
                version: n.version.clone(),
                failing: n
                    .checks
                    .iter()
                    .filter(|(_, c)| c.status == berth_api::Status::Fail)
                    .map(|(k, c)| format!("{k}: {}", c.message))
                    .collect(),
                unknown: n
                    .checks
                    .iter()
                    .filter(|(_, c)| c.status == berth_api::Status::Unknown)
                    .map(|(k, c)| format!("{k}: {}", c.message))
                    .collect(),
                versions: beat.map(|b| b.versions.clone()).unwrap_or_default(),
                images: beat.map(|b| b.images.clone()).unwrap_or_default(),
                leftovers: beat.map(|b| b.leftovers.clone()).unwrap_or_default(),
                heartbeat_age_s: beat.map(|b| b.at.elapsed().as_secs_f64()),
                suppressed: n.suppressed.clone(),
                daemons: beat.map(|b| b.daemons.clone()).unwrap_or_default(),
                orphaned: orphaned
                    .get(name)
                    .map(|ls| {
                        ls.iter()
                            .map(|(l, age)| format!("{l} ({age:.0} s)"))
                            .collect()
                    })
                    .unwrap_or_default(),
            }
        })
        .collect();
    Json(out).into_response()
}

fn admin_reply(r: Result<crate::state::Reply, Response>) -> Response {
    match r {
        Ok(r) => Json(r).into_response(),
        Err(r) => r,
    }
}

async fn drain(AxState(app): AxState<Shared>, Json(req): Json<DrainRequest>) -> Response {
    if req.reason.trim().is_empty() || req.reason.contains('\n') {
        return error(StatusCode::BAD_REQUEST, "reason: one line, not empty");
    }
    admin_reply(
        app.write(Command::AdminDrain {
            node: req.node,
            reason: req.reason,
        })
        .await,
    )
}

async fn resume(AxState(app): AxState<Shared>, Json(req): Json<ResumeRequest>) -> Response {
    if !app.store.lock().state.nodes.contains_key(&req.node) {
        return error(
            StatusCode::NOT_FOUND,
            format!("node {}: unknown to the controller", req.node),
        );
    }
    admin_reply(app.write(Command::AdminResume { node: req.node }).await)
}

async fn breaker_reset(AxState(app): AxState<Shared>) -> Response {
    admin_reply(app.write(Command::BreakerReset).await)
}

/// `GET /v1/slurm`: the leader's watch on Slurm (issue 17); 421 from a follower.
async fn slurm(AxState(app): AxState<Shared>) -> Response {
    if !app.is_leader_now() {
        return app.not_leader();
    }
    let beats = app.beats_now();
    Json(watch::view(&app, &beats)).into_response()
}

impl App {
    /// The leader's last heartbeat per node.
    pub(crate) fn beats_now(&self) -> HashMap<String, Beat> {
        self.beats.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

async fn watch_leader(app: Shared) {
    let mut rx = app.raft.metrics();
    let mut last = None;
    loop {
        let m = rx.borrow_and_update().clone();
        if m.current_leader != last {
            if last.is_some() || m.current_leader.is_some() {
                app.leader_changes.fetch_add(1, Ordering::Relaxed);
            }
            last = m.current_leader;
            let mut since = app.leader_since.lock().unwrap_or_else(|p| p.into_inner());
            *since = (m.current_leader == Some(app.s.id)).then(Instant::now);
            if m.current_leader != Some(app.s.id) {
                app.beats.lock().unwrap_or_else(|p| p.into_inner()).clear();
            }
        }
        if rx.changed().await.is_err() {
            return;
        }
    }
}

/// One node as Slurm has it.
#[derive(Debug, PartialEq, Eq)]
struct SlurmNode {
    drained: bool,
    reason: String,
}

/// Parses `sinfo -h -N -o %N|%T|%E`.
fn parse_sinfo(text: &str) -> BTreeMap<String, SlurmNode> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let mut f = line.splitn(3, '|');
        let (Some(name), Some(st), reason) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let reason = reason.unwrap_or("").trim();
        out.insert(
            name.trim().to_string(),
            SlurmNode {
                drained: st.to_ascii_lowercase().contains("drain"),
                reason: if reason == "none" { "" } else { reason }.to_string(),
            },
        );
    }
    out
}

#[derive(Debug, PartialEq, Eq)]
enum Action {
    Drain(String, String),
    Resume(String),
}

/// Whether berth made a drain of this reason: a health drain (`berth: …`) or a rollout's
/// (`berth rollout <id>…`).
fn ours(reason: &str) -> bool {
    reason.starts_with(PREFIX) || reason.starts_with(crate::rollout::PREFIX)
}

/// What to change in Slurm: berth's drains not yet there, and berth's (or an admin's lifted
/// through berth) drains to lift. A drain berth did not make is never touched.
fn plan(state: &State, slurm: &BTreeMap<String, SlurmNode>) -> Vec<Action> {
    let mut out = Vec::new();
    for (name, n) in &state.nodes {
        let Some(sn) = slurm.get(name) else { continue };
        match &n.desired {
            Desired::Drained { reason, .. } => {
                let ours = ours(&sn.reason);
                if !sn.drained || (ours && &sn.reason != reason) {
                    out.push(Action::Drain(name.clone(), reason.clone()));
                }
            }
            Desired::Up => {
                if sn.drained
                    && (ours(&sn.reason) || n.resume_reason.as_deref() == Some(sn.reason.as_str()))
                {
                    out.push(Action::Resume(name.clone()));
                }
            }
        }
    }
    out
}

async fn run_tool(
    path: &std::path::Path,
    args: &[String],
    term: u64,
    id: u64,
) -> Result<String, ControllerError> {
    let mut cmd = tokio::process::Command::new(path);
    cmd.args(args)
        .env("BERTH_CONTROLLER_TERM", term.to_string())
        .env("BERTH_CONTROLLER_ID", id.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(30), cmd.output())
        .await
        .map_err(|_| ControllerError::Timeout {
            path: path.to_path_buf(),
            secs: 30,
        })?
        .map_err(|source| ControllerError::Spawn {
            path: path.to_path_buf(),
            source,
        })?;
    if !out.status.success() {
        return Err(ControllerError::Failed {
            path: path.to_path_buf(),
            args: args.to_vec(),
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

async fn reconcile_loop(app: Shared) {
    let every = Duration::from_millis(app.s.reconcile_interval_ms.max(50));
    loop {
        let _ = tokio::time::timeout(every, app.reconcile_now.notified()).await;
        if !app.is_leader_now() {
            continue;
        }
        if let Err(e) = reconcile(&app).await {
            tracing::warn!("reconcile: {e}");
        }
    }
}

/// Confirms with a quorum that this controller still leads, and returns its term.
pub(crate) async fn confirm_leader(app: &App) -> Option<u64> {
    let term = app.raft.metrics().borrow().current_term;
    let confirmed = tokio::time::timeout(Duration::from_secs(2), app.raft.ensure_linearizable())
        .await
        .is_ok_and(|r| r.is_ok());
    let now = app.raft.metrics().borrow().clone();
    (confirmed && now.state == ServerState::Leader && now.current_term == term).then_some(term)
}

/// One `scontrol update` call: the nodes of one action and one reason together.
#[derive(Debug, PartialEq, Eq)]
struct Call {
    nodes: Vec<String>,
    /// `Some(reason)`: drain; `None`: resume.
    drain: Option<String>,
}

impl Call {
    fn args(&self) -> Vec<String> {
        let mut a = vec![
            "update".to_string(),
            format!("NodeName={}", self.nodes.join(",")),
        ];
        match &self.drain {
            Some(reason) => {
                a.push("State=DRAIN".to_string());
                a.push(format!("Reason={reason}"));
            }
            None => a.push("State=RESUME".to_string()),
        }
        a
    }
}

/// Groups actions into calls: every drain of one reason in one call, every resume in one, at
/// most `per_call` nodes each (a command line stays short), drains first (a node that must
/// not take jobs matters more than one idle a little longer).
fn group(actions: Vec<Action>, per_call: usize) -> Vec<Call> {
    let mut drains: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut resumes = Vec::new();
    for a in actions {
        match a {
            Action::Drain(node, reason) => drains.entry(reason).or_default().push(node),
            Action::Resume(node) => resumes.push(node),
        }
    }
    let per_call = per_call.max(1);
    let mut out = Vec::new();
    for (reason, nodes) in drains {
        for chunk in nodes.chunks(per_call) {
            out.push(Call {
                nodes: chunk.to_vec(),
                drain: Some(reason.clone()),
            });
        }
    }
    for chunk in resumes.chunks(per_call) {
        out.push(Call {
            nodes: chunk.to_vec(),
            drain: None,
        });
    }
    out
}

/// The test-only failpoint between commit and apply (`serve --failpoint-file PATH`, a hidden
/// flag no configuration file sets): when PATH exists as the leader is about to apply committed
/// decisions to Slurm, the process exits at once, as a crash would, leaving them committed and
/// not applied for the next leader. It fires once per arming: the controller that fires removes
/// PATH (only one can), so the next leader applies.
fn failpoint(app: &App) {
    if let Some(path) = &app.s.failpoint_file
        && std::fs::remove_file(path).is_ok()
    {
        eprintln!(
            "berth-controller: failpoint {}: exiting between commit and apply",
            path.display()
        );
        // A crash ends the process at once: no exit handlers, no flushing, no waiting for the
        // runtime's threads (std's exit could hang here, on a lock another thread held, and
        // leave a controller that neither serves nor is gone).
        // SAFETY: _exit ends the process; nothing runs after it, so no state is left half-used.
        unsafe { libc::_exit(86) };
    }
}

async fn reconcile(app: &App) -> Result<(), ControllerError> {
    let Some(term) = confirm_leader(app).await else {
        return Ok(());
    };
    let args: Vec<String> = ["-h", "-N", "-o", "%N|%T|%E"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let text = run_tool(&app.s.sinfo, &args, term, app.s.id).await?;
    let slurm = parse_sinfo(&text);
    let state = app.store.lock().state.clone();
    let calls = group(plan(&state, &slurm), app.s.nodes_per_call);
    let gap = Duration::from_millis(app.s.scontrol_interval_ms);
    for (i, call) in calls
        .into_iter()
        .take(app.s.max_updates_per_round.max(1))
        .enumerate()
    {
        // The rate limit: at most one call per scontrol_interval_ms, Slurm's controller
        // serves jobs too.
        if i > 0 {
            tokio::time::sleep(gap).await;
        }
        // Leadership again right before the call: a deposed leader must call nothing.
        if confirm_leader(app).await != Some(term) {
            return Ok(());
        }
        failpoint(app);
        app.scontrol_calls.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = run_tool(&app.s.scontrol, &call.args(), term, app.s.id).await {
            app.scontrol_failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("{e}");
        }
        // A rollout waiting for this drain or resume looks again now.
        app.rollout_now.notify_one();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::metrics::prometheus_text;
    use super::*;
    use crate::state::Command;

    #[test]
    fn sinfo_parses_and_plan_leaves_admin_drains() {
        let slurm = parse_sinfo(
            "n0|idle|none\nn1|drained|berth: gpu-count: 7 of 8\nn2|drained|rma ticket\nn3|mixed|none\n",
        );
        assert!(slurm["n1"].drained && !slurm["n0"].drained);
        assert_eq!(slurm["n0"].reason, "");
        let mut s = State::default();
        for n in ["n0", "n1", "n2", "n3"] {
            s.apply(&Command::Register {
                node: n.into(),
                boot_id: "b".into(),
                version: "v".into(),
            });
        }
        s.apply(&Command::AdminDrain {
            node: "n3".into(),
            reason: "maintenance".into(),
        });
        let p = plan(&s, &slurm);
        // n1 is up in berth's state: its berth drain is lifted; n2's admin drain stays;
        // n3 is drained as the admin asked through berth.
        assert_eq!(
            p,
            vec![
                Action::Resume("n1".into()),
                Action::Drain("n3".into(), "maintenance".into())
            ]
        );
    }

    #[test]
    fn calls_group_by_reason_drains_first_and_split_long_lists() {
        let d = |n: &str, r: &str| Action::Drain(n.into(), r.into());
        let calls = group(
            vec![
                Action::Resume("n9".into()),
                d("n1", "berth: gpu-count: 7 of 8"),
                d("n2", "berth: nic-ports: mlx5_0 down"),
                d("n3", "berth: gpu-count: 7 of 8"),
                d("n4", "berth: gpu-count: 7 of 8"),
                Action::Resume("n8".into()),
            ],
            2,
        );
        let args: Vec<String> = calls.iter().map(|c| c.args().join(" ")).collect();
        assert_eq!(
            args,
            vec![
                "update NodeName=n1,n3 State=DRAIN Reason=berth: gpu-count: 7 of 8",
                "update NodeName=n4 State=DRAIN Reason=berth: gpu-count: 7 of 8",
                "update NodeName=n2 State=DRAIN Reason=berth: nic-ports: mlx5_0 down",
                "update NodeName=n9,n8 State=RESUME",
            ]
        );
    }

    #[test]
    fn metrics_are_prometheus_text() {
        let open = "# HELP x_calls Calls.\n# TYPE x_calls counter\nx_calls_total 3\n\
                    # HELP x_up Up.\n# TYPE x_up gauge\nx_up 1\n# EOF\n";
        assert_eq!(
            prometheus_text(open),
            "# HELP x_calls_total Calls.\n# TYPE x_calls_total counter\nx_calls_total 3\n\
             # HELP x_up Up.\n# TYPE x_up gauge\nx_up 1\n"
        );
    }
}
