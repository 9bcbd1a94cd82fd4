//! `berth-controller sim`: simulated agents against running controllers, for load and failover
//! measurements. Each agent sends a heartbeat every interval (spread evenly, so N agents at
//! interval I make N/I heartbeats a second), following a follower's 421 to the leader like
//! `berth agent`; a given share of them report a failing hard check. Prints one JSON summary:
//! heartbeats sent and failed, latency p50/p99, the most heartbeats any agent missed in a row,
//! and the leader terms seen.
//!
//! With [`RolloutSim`] (`--rollout-per-node-ms`) it drives a rollout (issue 31) instead: once
//! every agent has registered it starts one over every node, and each agent answers its step's
//! order by reporting it running, then done after the per-node time (at once, as `berth agent`
//! does when a step ends); the summary holds the rollout's wall time against the ideal
//! (batches × per-node time).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use berth_api::{CheckResult, Heartbeat, HeartbeatReply, NotLeader, Severity, Status};

pub struct SimOptions {
    pub controllers: Vec<String>,
    pub key: berth_api::auth::Key,
    pub agents: usize,
    pub interval: Duration,
    pub failing_percent: u32,
    pub duration: Duration,
    pub threads: usize,
    /// When the failing share starts failing (until then every agent passes); at that moment
    /// each failing agent sends at once, as `berth agent` does when a check changes status.
    pub fail_after: Duration,
    /// Drive a rollout instead of steady heartbeats.
    pub rollout: Option<RolloutSim>,
}

/// A simulated rollout: every node's step takes `per_node`.
pub struct RolloutSim {
    pub per_node: Duration,
    pub max_unavailable: String,
    pub gate_passes: u32,
}

#[derive(Default)]
struct Tally {
    latencies_us: Vec<u64>,
    failed: u64,
    max_missed_in_row: u64,
    terms: std::collections::BTreeSet<u64>,
}

fn send(agent: &ureq::Agent, o: &SimOptions, leader: &mut usize, body: &[u8]) -> Option<u64> {
    let mut addr = o.controllers[*leader % o.controllers.len()].clone();
    for _ in 0..(o.controllers.len() + 2) {
        let url = format!("http://{addr}/v1/heartbeat");
        let signed = berth_api::auth::sign_request(&o.key, "POST", "/v1/heartbeat", body).ok()?;
        let r = agent
            .post(&url)
            .header(berth_api::auth::AUTH_HEADER, &signed.header)
            .content_type("application/json")
            .send(body);
        match r {
            Ok(mut resp) => {
                let status = resp.status().as_u16();
                let proof = resp
                    .headers()
                    .get(berth_api::auth::PROOF_HEADER)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string);
                let bytes = resp.body_mut().read_to_vec().ok()?;
                berth_api::auth::verify_answer(
                    &o.key,
                    proof.as_deref(),
                    &signed.nonce,
                    status,
                    &berth_api::auth::body_tag(&bytes),
                )
                .ok()?;
                if status == 200 {
                    return serde_json::from_slice::<HeartbeatReply>(&bytes)
                        .ok()
                        .map(|r| r.term);
                }
                match serde_json::from_slice::<NotLeader>(&bytes)
                    .ok()
                    .and_then(|n| n.leader)
                {
                    Some(l) if status == berth_api::NOT_LEADER_STATUS => {
                        *leader = o.controllers.iter().position(|c| *c == l).unwrap_or(0);
                        addr = l;
                    }
                    _ => {
                        *leader += 1;
                        addr = o.controllers[*leader % o.controllers.len()].clone();
                    }
                }
            }
            Err(_) => {
                *leader += 1;
                addr = o.controllers[*leader % o.controllers.len()].clone();
            }
        }
    }
    None
}

pub fn run(o: SimOptions) -> serde_json::Value {
    if o.rollout.is_some() {
        return rollout::run(o);
    }
    let o = Arc::new(o);
    let tally = Arc::new(Mutex::new(Tally::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let threads = o.threads.clamp(1, o.agents.max(1));
    let start = Instant::now();
    let mut handles = Vec::new();
    for t in 0..threads {
        let (o, tally, stop) = (o.clone(), tally.clone(), stop.clone());
        handles.push(std::thread::spawn(move || {
            let local = agents(&o, t, threads, start, &stop);
            let mut all = tally.lock().unwrap_or_else(|p| p.into_inner());
            all.latencies_us.extend(local.latencies_us);
            all.failed += local.failed;
            all.max_missed_in_row = all.max_missed_in_row.max(local.max_missed_in_row);
            all.terms.extend(local.terms);
        }));
    }
    for h in handles {
        let _ = h.join();
    }
    let mut all = tally.lock().unwrap_or_else(|p| p.into_inner());
    all.latencies_us.sort_unstable();
    // The nearest-rank percentile, `permille` of the sorted latencies.
    let pct = |permille: usize| -> f64 {
        let n = all.latencies_us.len();
        if n == 0 {
            return 0.0;
        }
        let i = ((n - 1) * permille + 500) / 1000;
        Duration::from_micros(all.latencies_us[i]).as_secs_f64() * 1000.0
    };
    let started_unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
        - start.elapsed().as_secs_f64();
    serde_json::json!({
        "agents": o.agents,
        "failing_percent": o.failing_percent,
        "failing_since_unix": started_unix + o.fail_after.as_secs_f64(),
        "interval_ms": u64::try_from(o.interval.as_millis()).unwrap_or(u64::MAX),
        "seconds": start.elapsed().as_secs_f64(),
        "heartbeats": all.latencies_us.len(),
        "failed": all.failed,
        "latency_ms_p50": pct(500),
        "latency_ms_p99": pct(990),
        "max_missed_in_a_row": all.max_missed_in_row,
        "terms_seen": all.terms.iter().collect::<Vec<_>>(),
    })
}

/// The agents `t`, `t + threads`, … of the simulation, on one thread, until the duration ends.
fn agents(o: &SimOptions, t: usize, threads: usize, start: Instant, stop: &AtomicBool) -> Tally {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(2)))
        .build()
        .into();
    let mine: Vec<usize> = (t..o.agents).step_by(threads).collect();
    let mut missed = vec![0u64; mine.len()];
    let mut leader = 0usize;
    let mut local = Tally::default();
    let mut round = 0u64;
    let fails = |a: usize| (a as u64 * 100) < u64::from(o.failing_percent) * o.agents as u64;
    let mut flipped = o.failing_percent == 0;
    while start.elapsed() < o.duration && !stop.load(Ordering::Relaxed) {
        for (k, &a) in mine.iter().enumerate() {
            // Agent a's slot in the round: spread over the interval.
            let due =
                o.interval.mul_f64(round as f64) + o.interval.mul_f64(a as f64 / o.agents as f64);
            // Wake for the flip too: the change goes out at once, not at the slot.
            let due = if flipped { due } else { due.min(o.fail_after) };
            if let Some(wait) = due.checked_sub(start.elapsed()) {
                std::thread::sleep(wait);
            }
            if start.elapsed() >= o.duration {
                break;
            }
            let mut burst: Vec<usize> = Vec::new();
            if !flipped && start.elapsed() >= o.fail_after {
                flipped = true;
                burst.extend(mine.iter().copied().filter(|a| fails(*a)));
            }
            burst.push(a);
            for a in burst {
                let hb = heartbeat(a, flipped && fails(a));
                let body = serde_json::to_vec(&hb).expect("serializes");
                let t0 = Instant::now();
                match send(&agent, o, &mut leader, &body) {
                    Some(term) => {
                        local
                            .latencies_us
                            .push(u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX));
                        local.terms.insert(term);
                        missed[k] = 0;
                    }
                    None => {
                        local.failed += 1;
                        missed[k] += 1;
                        local.max_missed_in_row = local.max_missed_in_row.max(missed[k]);
                    }
                }
            }
        }
        round += 1;
    }
    local
}

/// Agent `a`'s heartbeat: one hard GPU check, failing or not.
fn heartbeat(a: usize, failing: bool) -> Heartbeat {
    Heartbeat {
        node: format!("sim{a:05}"),
        boot_id: "sim".into(),
        version: "sim".into(),
        checks: vec![CheckResult {
            name: "gpu-count".into(),
            status: if failing { Status::Fail } else { Status::Ok },
            severity: Severity::Hard,
            recoverable: true,
            message: if failing {
                "7 of 8".into()
            } else {
                "8 of 8".into()
            },
        }],
        daemons: Vec::new(),
        versions: Default::default(),
        images: Vec::new(),
        leftovers: Vec::new(),
        cause: None,
        peer: None,
        refs: Default::default(),
        step_report: None,
    }
}

mod rollout {
    use super::*;
    use berth_api::{RolloutRequest, RolloutView, StepOrder, StepReport, StepState};

    /// One signed request to the leader (following 421s); its status and body.
    fn request(
        agent: &ureq::Agent,
        o: &SimOptions,
        leader: &mut usize,
        path: &str,
        body: Option<&[u8]>,
    ) -> Option<(u16, Vec<u8>)> {
        let mut addr = o.controllers[*leader % o.controllers.len()].clone();
        for _ in 0..(o.controllers.len() + 2) {
            let url = format!("http://{addr}{path}");
            let method = if body.is_some() { "POST" } else { "GET" };
            let signed =
                berth_api::auth::sign_request(&o.key, method, path, body.unwrap_or_default())
                    .ok()?;
            let r = match body {
                Some(b) => agent
                    .post(&url)
                    .header(berth_api::auth::AUTH_HEADER, &signed.header)
                    .content_type("application/json")
                    .send(b),
                None => agent
                    .get(&url)
                    .header(berth_api::auth::AUTH_HEADER, &signed.header)
                    .call(),
            };
            let next = match r {
                Ok(mut resp) => {
                    let status = resp.status().as_u16();
                    let bytes = resp
                        .body_mut()
                        .with_config()
                        .limit(64 << 20)
                        .read_to_vec()
                        .ok()?;
                    if status != berth_api::NOT_LEADER_STATUS {
                        return Some((status, bytes));
                    }
                    serde_json::from_slice::<NotLeader>(&bytes)
                        .ok()
                        .and_then(|n| n.leader)
                }
                Err(_) => None,
            };
            match next {
                Some(l) => {
                    *leader = o.controllers.iter().position(|c| *c == l).unwrap_or(0);
                    addr = l;
                }
                None => {
                    *leader += 1;
                    addr = o.controllers[*leader % o.controllers.len()].clone();
                }
            }
        }
        None
    }

    /// One simulated agent in a rollout.
    struct Sim {
        a: usize,
        next_beat: Instant,
        /// The step ordered, and when the agent first saw it.
        order: Option<(StepOrder, Instant)>,
        /// Whether its ended step was reported.
        reported: bool,
    }

    pub fn run(o: SimOptions) -> serde_json::Value {
        let r = o.rollout.as_ref().expect("rollout options");
        let per_node = r.per_node;
        let http: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(10)))
            .build()
            .into();
        let mut leader = 0usize;
        // Every agent registers first: a node no agent reported from is left out.
        for a in 0..o.agents {
            let body = serde_json::to_vec(&heartbeat(a, false)).expect("serializes");
            let _ = request(&http, &o, &mut leader, "/v1/heartbeat", Some(&body));
        }
        let req = RolloutRequest {
            command: Some("simulated".into()),
            timeout_s: 3600,
            max_unavailable: r.max_unavailable.clone(),
            gate_passes: r.gate_passes,
            failure_threshold: 1,
            ..RolloutRequest::default()
        };
        let body = serde_json::to_vec(&req).expect("serializes");
        let started = request(&http, &o, &mut leader, "/v1/rollout/start", Some(&body));
        let view: Option<RolloutView> = started
            .as_ref()
            .filter(|(s, _)| *s == 200)
            .and_then(|(_, b)| serde_json::from_slice(b).ok());
        let Some(view) = view else {
            let said = started
                .map(|(s, b)| format!("HTTP {s}: {}", String::from_utf8_lossy(&b)))
                .unwrap_or_else(|| "no answer".into());
            return serde_json::json!({ "error": format!("starting the rollout: {said}") });
        };
        let o = Arc::new(o);
        let stop = Arc::new(AtomicBool::new(false));
        let threads = o.threads.clamp(1, o.agents.max(1));
        let start = Instant::now();
        let tally = Arc::new(Mutex::new(Tally::default()));
        let mut handles = Vec::new();
        for t in 0..threads {
            let (o, stop, tally) = (o.clone(), stop.clone(), tally.clone());
            handles.push(std::thread::spawn(move || {
                let local = agents(&o, t, threads, per_node, &stop);
                let mut all = tally.lock().unwrap_or_else(|p| p.into_inner());
                all.latencies_us.extend(local.latencies_us);
                all.failed += local.failed;
            }));
        }
        let mut last = view.clone();
        while start.elapsed() < o.duration {
            std::thread::sleep(Duration::from_millis(500));
            if let Some((200, b)) = request(&http, &o, &mut leader, "/v1/rollout", None)
                && let Ok(v) = serde_json::from_slice::<RolloutView>(&b)
            {
                let ended = v.ended_unix_ms.is_some();
                last = v;
                if ended {
                    break;
                }
            }
        }
        stop.store(true, Ordering::Relaxed);
        for h in handles {
            let _ = h.join();
        }
        let mut all = tally.lock().unwrap_or_else(|p| p.into_inner());
        all.latencies_us.sort_unstable();
        let pct = |permille: usize| -> f64 {
            let n = all.latencies_us.len();
            if n == 0 {
                return 0.0;
            }
            Duration::from_micros(all.latencies_us[((n - 1) * permille + 500) / 1000]).as_secs_f64()
                * 1000.0
        };
        let nodes = last.steps.len();
        let batches = nodes.div_ceil(usize::try_from(last.max_unavailable.max(1)).unwrap_or(1));
        let wall = last
            .ended_unix_ms
            .map(|e| e.saturating_sub(last.created_unix_ms) as f64 / 1000.0);
        let ideal = batches as f64 * per_node.as_secs_f64();
        let done = last.steps.iter().filter(|s| s.phase == "done").count();
        // From a step's start (drained, ordered) to its resume, beyond the per-node time: the
        // order's delivery, the report and the health gate.
        let runs: Vec<f64> = last
            .steps
            .iter()
            .filter_map(|s| Some(s.ended_unix_ms?.saturating_sub(s.started_unix_ms?) as f64))
            .collect();
        let run_overhead = (!runs.is_empty()).then(|| {
            runs.iter().sum::<f64>() / runs.len() as f64 / 1000.0 - per_node.as_secs_f64()
        });
        serde_json::json!({
            "rollout": last.id,
            "state": last.state,
            "nodes": nodes,
            "done": done,
            "max_unavailable": last.max_unavailable,
            "batches": batches,
            "per_node_s": per_node.as_secs_f64(),
            "ideal_s": ideal,
            "wall_s": wall,
            "wall_over_ideal": wall.map(|w| w / ideal),
            "step_overhead_s": run_overhead,
            "interval_ms": u64::try_from(o.interval.as_millis()).unwrap_or(u64::MAX),
            "heartbeats": all.latencies_us.len(),
            "latency_ms_p50": pct(500),
            "latency_ms_p99": pct(990),
            "failed": all.failed,
        })
    }

    /// Agents `t`, `t + threads`, … each beating every interval (spread), and at once when its
    /// step ends or a new order came.
    fn agents(
        o: &SimOptions,
        t: usize,
        threads: usize,
        per_node: Duration,
        stop: &AtomicBool,
    ) -> Tally {
        let http: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(5)))
            .build()
            .into();
        let t0 = Instant::now();
        let mut sims: Vec<Sim> = (t..o.agents)
            .step_by(threads)
            .map(|a| Sim {
                a,
                next_beat: t0 + o.interval.mul_f64(a as f64 / o.agents.max(1) as f64),
                order: None,
                reported: false,
            })
            .collect();
        let mut leader = 0usize;
        let mut local = Tally::default();
        while !stop.load(Ordering::Relaxed) && !sims.is_empty() {
            let due = |s: &Sim| match &s.order {
                Some((_, seen)) if !s.reported => s.next_beat.min(*seen + per_node),
                _ => s.next_beat,
            };
            let (k, when) = sims
                .iter()
                .enumerate()
                .map(|(k, s)| (k, due(s)))
                .min_by_key(|(_, w)| *w)
                .expect("not empty");
            let wait = when.saturating_duration_since(Instant::now());
            if wait > Duration::ZERO {
                std::thread::sleep(wait.min(Duration::from_millis(100)));
                continue;
            }
            let s = &mut sims[k];
            let mut hb = heartbeat(s.a, false);
            hb.step_report = s.order.as_ref().map(|(ord, seen)| {
                let ended = seen.elapsed() >= per_node;
                StepReport {
                    rollout: ord.rollout,
                    state: if ended {
                        StepState::Ok
                    } else {
                        StepState::Running
                    },
                    reason: None,
                    exit: ended.then_some(0),
                    output: String::new(),
                    gate: None,
                }
            });
            let ended_sent = hb
                .step_report
                .as_ref()
                .is_some_and(|r| r.state == StepState::Ok);
            let body = serde_json::to_vec(&hb).expect("serializes");
            let sent = Instant::now();
            // Sent once at its end; later reports ride the regular heartbeats.
            if ended_sent {
                s.reported = true;
            }
            match request(&http, o, &mut leader, "/v1/heartbeat", Some(&body)) {
                Some((200, bytes)) => {
                    local
                        .latencies_us
                        .push(u64::try_from(sent.elapsed().as_micros()).unwrap_or(u64::MAX));
                    let reply: Option<HeartbeatReply> = serde_json::from_slice(&bytes).ok();
                    // As `berth agent`: sooner when the leader asks.
                    let hint = reply.as_ref().and_then(|r| r.next_beat_ms);
                    s.next_beat = Instant::now()
                        + hint.map_or(o.interval, |ms| {
                            o.interval.min(Duration::from_millis(ms.max(100)))
                        });
                    match reply.and_then(|r| r.step) {
                        Some(ord) => {
                            let same = s
                                .order
                                .as_ref()
                                .is_some_and(|(o2, _)| o2.rollout == ord.rollout);
                            if !same {
                                s.order = Some((ord, Instant::now()));
                                s.reported = false;
                            }
                        }
                        None => s.order = None,
                    }
                }
                _ => {
                    local.failed += 1;
                    s.next_beat = Instant::now() + o.interval;
                }
            }
        }
        local
    }
}
