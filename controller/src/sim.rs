//! `berth-controller sim`: simulated agents against running controllers, for load and failover
//! measurements. Each agent sends a heartbeat every interval (spread evenly, so N agents at
//! interval I make N/I heartbeats a second), following a follower's 421 to the leader like
//! `berth agent`; a given share of them report a failing hard check. Prints one JSON summary:
//! heartbeats sent and failed, latency p50/p99, the most heartbeats any agent missed in a row,
//! and the leader terms seen.

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
