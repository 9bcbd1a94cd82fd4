//! The controller's `/metrics`: Prometheus text of the cluster's state as this controller sees
//! it (its Raft role, the nodes, decisions, the watch on Slurm's daemons).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::extract::State as AxState;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use openraft::{BasicNode, RaftMetrics, ServerState};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::{App, Beat, Shared, error};
use crate::state::State;

pub(super) async fn metrics(AxState(app): AxState<Shared>, _h: HeaderMap) -> Response {
    let m = app.raft.metrics().borrow().clone();
    let state = app.store.lock().state.clone();
    let is_leader = m.state == ServerState::Leader;
    let mut reg = Registry::with_prefix("berth_controller");
    raft_metrics(&app, &m, &mut reg);
    state_metrics(&state, &mut reg);
    super::watch_metrics::register(&app, &state, is_leader, &mut reg);
    super::rollout::metrics(&state, &mut reg);
    if is_leader {
        leader_metrics(&app, &state, &mut reg);
    }
    let mut text = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut text, &reg) {
        return error(StatusCode::INTERNAL_SERVER_ERROR, format!("metrics: {e}"));
    }
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        prometheus_text(&text),
    )
        .into_response()
}

fn set_gauge(reg: &mut Registry, name: &str, help: &str, value: i64) {
    let g: Gauge = Gauge::default();
    g.set(value);
    reg.register(name, help, g);
}

fn set_counter(reg: &mut Registry, name: &str, help: &str, value: &AtomicU64) {
    let c: Counter = Counter::default();
    c.inc_by(value.load(Ordering::Relaxed));
    reg.register(name, help, c);
}

fn count(n: usize) -> i64 {
    n.try_into().unwrap_or(i64::MAX)
}

/// This controller's Raft role and the calls it made to Slurm.
fn raft_metrics(app: &App, m: &RaftMetrics<u64, BasicNode>, reg: &mut Registry) {
    set_gauge(
        reg,
        "is_leader",
        "1 on the Raft leader",
        i64::from(m.state == ServerState::Leader),
    );
    set_gauge(
        reg,
        "leader_id",
        "The Raft id of the leader this controller knows; 0 when it knows none",
        m.current_leader.map_or(0, gauge),
    );
    set_gauge(reg, "term", "The Raft term", gauge(m.current_term));
    set_counter(
        reg,
        "leader_changes",
        "Leader changes seen",
        &app.leader_changes,
    );
    set_counter(
        reg,
        "scontrol_calls",
        "scontrol update calls made",
        &app.scontrol_calls,
    );
    set_counter(
        reg,
        "change_heartbeats",
        "Heartbeats agents sent before their interval because a check changed status",
        &app.change_beats,
    );
    set_counter(
        reg,
        "scontrol_failures",
        "scontrol update calls that failed",
        &app.scontrol_failures,
    );
}

/// The replicated state: nodes by desired state, drain and resume totals, the breaker.
fn state_metrics(state: &State, reg: &mut Registry) {
    let nodes = Family::<Vec<(String, String)>, Gauge>::default();
    for desired in ["up", "drained"] {
        nodes
            .get_or_create(&vec![("desired".into(), desired.into())])
            .set(count(
                state
                    .nodes
                    .values()
                    .filter(|n| n.desired.word() == desired)
                    .count(),
            ));
    }
    reg.register("nodes", "Nodes by desired state", nodes);
    for (name, help, map) in [
        ("drains", "Automatic drains by check", &state.totals.drains),
        (
            "resumes",
            "Automatic resumes by check",
            &state.totals.resumes,
        ),
        (
            "suppressed_drains",
            "Drains the circuit breaker held back, by check",
            &state.totals.suppressed,
        ),
    ] {
        let fam = Family::<Vec<(String, String)>, Counter>::default();
        for (check, n) in map {
            fam.get_or_create(&vec![("check".into(), check.clone())])
                .inc_by(*n);
        }
        reg.register(name, help, fam);
    }
    set_gauge(
        reg,
        "breaker_tripped",
        "1 while the circuit breaker holds drains back",
        i64::from(state.breaker.tripped),
    );
}

/// What only the leader knows: the heartbeats it received.
fn leader_metrics(app: &App, state: &State, reg: &mut Registry) {
    let beats = app.beats.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let age = Family::<Vec<(String, String)>, Gauge<f64, AtomicU64>>::default();
    let left = Family::<Vec<(String, String)>, Gauge>::default();
    for (node, b) in &beats {
        age.get_or_create(&vec![("node".into(), node.clone())])
            .set(b.at.elapsed().as_secs_f64());
        left.get_or_create(&vec![("node".into(), node.clone())])
            .set(count(b.leftovers.len()));
    }
    reg.register(
        "leftovers",
        "Leftovers of ended jobs (containers, scratch) each node reported last",
        left,
    );
    reg.register(
        "heartbeat_age_seconds",
        "Seconds since each node's last heartbeat",
        age,
    );
    set_gauge(
        reg,
        "nodes_lost",
        "Nodes without a heartbeat for 3 intervals (an alert, never a drain)",
        count(lost_nodes(app, state, &beats)),
    );
}

/// OpenMetrics text (what prometheus-client writes) as Prometheus' text format 0.0.4, which
/// every scraper and `promtool check metrics` read: a counter's HELP and TYPE name its samples
/// (`x_total`, not `x`), and there is no `# EOF`.
pub(super) fn prometheus_text(open: &str) -> String {
    let counters: std::collections::HashSet<&str> = open
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(open.len());
    for line in open.lines() {
        if line == "# EOF" {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        match meta {
            Some((p, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                if counters.contains(name) {
                    out.push_str(&format!("{p}{name}_total {tail}\n"));
                } else {
                    out.push_str(line);
                    out.push('\n');
                }
            }
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

/// Nodes silent for 3 heartbeat intervals; a new leader judges none until it has led that long.
pub(super) fn lost_nodes(app: &App, state: &State, beats: &HashMap<String, Beat>) -> usize {
    let grace = Duration::from_secs(app.s.heartbeat_interval_s.max(1) * 3);
    let since = *app.leader_since.lock().unwrap_or_else(|p| p.into_inner());
    if since.is_none_or(|t| t.elapsed() < grace) {
        return 0;
    }
    state
        .nodes
        .keys()
        .filter(|n| beats.get(*n).is_none_or(|b| b.at.elapsed() >= grace))
        .count()
}

/// A count or id as a gauge's value (i64), saturating: a metric must never wrap negative.
pub(super) fn gauge(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}
