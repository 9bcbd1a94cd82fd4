//! The controller's `/metrics`: Prometheus text of the cluster's state as this controller sees
//! it (its Raft role, the nodes, decisions, the watch on Slurm's daemons).

use super::*;

pub(super) async fn metrics(AxState(app): AxState<Shared>, _h: HeaderMap) -> Response {
    let m = app.raft.metrics().borrow().clone();
    let state = app.store.lock().state.clone();
    let mut reg = Registry::with_prefix("berth_controller");
    let leader: Gauge = Gauge::default();
    leader.set(i64::from(m.state == ServerState::Leader));
    reg.register("is_leader", "1 on the Raft leader", leader);
    let leader_id: Gauge = Gauge::default();
    leader_id.set(m.current_leader.map_or(0, gauge));
    reg.register(
        "leader_id",
        "The Raft id of the leader this controller knows; 0 when it knows none",
        leader_id,
    );
    let term: Gauge = Gauge::default();
    term.set(gauge(m.current_term));
    reg.register("term", "The Raft term", term);
    let changes: Counter = Counter::default();
    changes.inc_by(app.leader_changes.load(Ordering::Relaxed));
    reg.register("leader_changes", "Leader changes seen", changes);
    let calls: Counter = Counter::default();
    calls.inc_by(app.scontrol_calls.load(Ordering::Relaxed));
    reg.register("scontrol_calls", "scontrol update calls made", calls);
    let early: Counter = Counter::default();
    early.inc_by(app.change_beats.load(Ordering::Relaxed));
    reg.register(
        "change_heartbeats",
        "Heartbeats agents sent before their interval because a check changed status",
        early,
    );
    let fails: Counter = Counter::default();
    fails.inc_by(app.scontrol_failures.load(Ordering::Relaxed));
    reg.register(
        "scontrol_failures",
        "scontrol update calls that failed",
        fails,
    );
    let nodes = Family::<Vec<(String, String)>, Gauge>::default();
    for desired in ["up", "drained"] {
        nodes
            .get_or_create(&vec![("desired".into(), desired.into())])
            .set(
                state
                    .nodes
                    .values()
                    .filter(|n| n.desired.word() == desired)
                    .count()
                    .try_into()
                    .unwrap_or(i64::MAX),
            );
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
    let tripped: Gauge = Gauge::default();
    tripped.set(i64::from(state.breaker.tripped));
    reg.register(
        "breaker_tripped",
        "1 while the circuit breaker holds drains back",
        tripped,
    );
    crate::watch_metrics::register(&app, &state, m.state == ServerState::Leader, &mut reg);
    if m.state == ServerState::Leader {
        let beats = app.beats.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let age = Family::<Vec<(String, String)>, Gauge<f64, AtomicU64>>::default();
        let left = Family::<Vec<(String, String)>, Gauge>::default();
        for (node, b) in &beats {
            age.get_or_create(&vec![("node".into(), node.clone())])
                .set(b.at.elapsed().as_secs_f64());
            left.get_or_create(&vec![("node".into(), node.clone())])
                .set(b.leftovers.len().try_into().unwrap_or(i64::MAX));
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
        let lost: Gauge = Gauge::default();
        lost.set(
            lost_nodes(&app, &state, &beats)
                .try_into()
                .unwrap_or(i64::MAX),
        );
        reg.register(
            "nodes_lost",
            "Nodes without a heartbeat for 3 intervals (an alert, never a drain)",
            lost,
        );
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
