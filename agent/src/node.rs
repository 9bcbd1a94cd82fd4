//! `berth agent`: the node agent. Runs berth's health checks (what `berth health` runs, under
//! `topology.host_root`) every `agent.interval_ms` (jittered), posts each round as a heartbeat
//! to the cluster controller, and serves its own `/metrics`. A rollout step the leader orders in
//! a heartbeat answer is run (at most once) and reported by crate::rollout. Synchronous
//! (`ureq`, threads): no async runtime on nodes. The controller is never in the job path: with
//! it down, the agent keeps checking and retrying, and Slurm, the Prolog/Epilog and `berth gc`
//! work as before.
//!
//! The configuration file is read again every round, so a changed threshold or expected GPU
//! count takes effect without a restart (a file that no longer parses keeps the last one).
//!
//! Also home of [`Client`], the controller client `berth cluster` shares: it sends the shared
//! key, tries each configured controller, and follows a follower's answer to the leader.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use berth_api::{
    CheckResult, DaemonReport, DaemonState, Heartbeat, HeartbeatReply, Severity, Status,
};

use berth_config::Config;
use berth_node::health::{XidWindow, report};
use berth_node::source::Source;
use berth_topology::kmsg;

use crate::AgentError;
use crate::client::Client;

/// Severity and whether the check's drain may lift by itself, by berth health's check names.
fn classify(name: &str) -> (Severity, bool) {
    match name {
        // A GPU that fell off the bus may come back (a reset, a reseat): recoverable.
        "gpu-count" => (Severity::Hard, true),
        // Hardware faults an admin must look at.
        "ecc" | "retired-pages" | "xid" => (Severity::Hard, false),
        // Links and ports flap; two in a row drain, passes resume.
        _ => (Severity::Soft, true),
    }
}

/// One round of checks as heartbeat results.
fn checks(config: &Config, xid_after: Option<u64>) -> Vec<CheckResult> {
    let window = xid_after.map_or(XidWindow::None, XidWindow::After);
    match report(config, &Source::default(), None, None, window, false) {
        Ok(r) => r
            .checks
            .iter()
            .map(|c| {
                let (severity, recoverable) = classify(c.name);
                CheckResult {
                    name: c.name.to_string(),
                    status: if c.ok { Status::Ok } else { Status::Fail },
                    severity,
                    recoverable,
                    message: c.detail.clone(),
                }
            })
            .collect(),
        // The node could not be read at all: say so, without draining for it.
        Err(e) => vec![CheckResult {
            name: "health".into(),
            status: Status::Unknown,
            severity: Severity::Soft,
            recoverable: true,
            message: e.to_string(),
        }],
    }
}

fn kmsg_seq(config: &Config) -> Option<u64> {
    let host = berth_node::source::host(&Source::default(), config);
    kmsg::read(&host.path("/dev/kmsg"))
        .ok()
        .and_then(|r| kmsg::last_seq(&r))
}

/// The most bytes read from one small /proc or /sys file, and the most names listed from one
/// directory for a heartbeat.
const SMALL_FILE: u64 = 4096;
const LIST_MAX: usize = 1000;

/// How often the inventory (versions, images, leftovers) is gathered: it changes slowly, and
/// judging scratch asks slurmctld (`squeue`), which a thousand nodes must not do every second.
const INVENTORY_EVERY: Duration = Duration::from_secs(60);

fn small_file(path: &Path) -> Option<String> {
    let mut s = String::new();
    std::fs::File::open(path)
        .ok()?
        .take(SMALL_FILE)
        .read_to_string(&mut s)
        .ok()?;
    Some(s.trim().to_string())
}

/// The boot id (`agent.boot_id_file`), read every round: a rollout's reboot step waits for a
/// new one.
fn boot_id(config: &Config) -> String {
    small_file(&config.agent.boot_id_file).unwrap_or_default()
}

/// What a heartbeat says besides the checks, gathered in the same timed round.
#[derive(Clone, Debug, Default, PartialEq)]
struct Inventory {
    versions: std::collections::BTreeMap<String, String>,
    images: Vec<String>,
    leftovers: Vec<String>,
    /// Stored registry images by reference, for the image catalog (crate::peer).
    refs: std::collections::BTreeMap<String, String>,
}

/// Directory entry names, at most [`LIST_MAX`], sorted; none when the directory is missing.
fn dir_names(dir: &Path) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .take(LIST_MAX)
                .filter_map(|e| e.file_name().to_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

/// Jobs Slurm still runs (or has not finished), by id; `None` when squeue cannot answer.
fn live_jobs() -> Option<Vec<String>> {
    let out = std::process::Command::new("squeue")
        .args(["-h", "-a", "-t", "all", "-o", "%A %T"])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    const ACTIVE: [&str; 6] = [
        "PENDING",
        "RUNNING",
        "SUSPENDED",
        "COMPLETING",
        "CONFIGURING",
        "STOPPED",
    ];
    Some(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_once(' '))
            .filter(|(_, state)| ACTIVE.contains(&state.trim()))
            .map(|(id, _)| id.to_string())
            .collect(),
    )
}

/// Versions (kernel, NVIDIA driver from the host tree), stored image digests (the names of the
/// store's image records; the store is not opened, so nothing is created), and leftovers:
/// containers whose berth process died and scratch directories of jobs Slurm no longer runs
/// (what `berth gc` and the next Prolog reclaim). Read-only; the directories read are root's.
fn inventory(config: &Config) -> Inventory {
    let host = berth_node::source::host(&Source::default(), config);
    let mut versions = std::collections::BTreeMap::new();
    if let Some(v) = small_file(Path::new("/proc/sys/kernel/osrelease")) {
        versions.insert("kernel".to_string(), v);
    }
    if let Some(v) = small_file(&host.path("/sys/module/nvidia/version")) {
        versions.insert("nvidia-driver".to_string(), v);
    }
    let images = dir_names(&config.store.root.join("images"))
        .iter()
        .filter_map(|n| n.strip_suffix(".json"))
        .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        .map(|h| format!("sha256:{h}"))
        .collect();
    let mut leftovers = Vec::new();
    let root = nix::unistd::geteuid().is_root();
    let records = if root && config.runtime.state_dir.is_dir() {
        berth_runtime::state::list(&config.runtime.state_dir)
    } else {
        Vec::new()
    };
    for r in records
        .iter()
        .filter(|r| !berth_runtime::state::owner_alive(r))
    {
        // The job it belonged to, so the controller can check with squeue that it ended.
        match r.labels.get("job") {
            Some(job) => leftovers.push(format!("container {} job {job}", r.id)),
            None => leftovers.push(format!("container {}", r.id)),
        }
    }
    if root {
        // A container's cgroup (named by its id) with no record left: its berth died before
        // removing it.
        for id in dir_names(&config.cgroup.root())
            .into_iter()
            .filter(|n| n.len() == 12 && n.bytes().all(|b| b.is_ascii_hexdigit()))
            .filter(|n| !records.iter().any(|r| &r.id == n))
        {
            leftovers.push(format!("cgroup {id}"));
        }
        // An image mount no container uses (the Epilog and `berth gc` release them).
        if let Ok(store) = berth_image::store::Store::open(&config.store) {
            for digest in
                berth_image::mount::unused_mounts(&config.squashfs.mount_dir, |d| store.in_use(d))
            {
                leftovers.push(format!("mount {digest}"));
            }
        }
    }
    let scratch: Vec<String> = dir_names(&config.scratch.root)
        .into_iter()
        .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        .collect();
    // Slurm is asked only when there is scratch to judge; without an answer none is a leftover.
    if !scratch.is_empty()
        && let Some(live) = live_jobs()
    {
        for job in scratch.iter().filter(|j| !live.contains(j)) {
            leftovers.push(format!("scratch {job}"));
        }
    }
    leftovers.sort();
    Inventory {
        versions,
        images,
        leftovers,
        refs: crate::peer::refs(config),
    }
}

/// One round's findings.
struct Round {
    checks: Vec<CheckResult>,
    /// slurmd and munge (daemons.rs).
    daemons: Vec<DaemonReport>,
    inventory: Inventory,
    /// Where the kernel log stood after the checks: the next round judges later XIDs only.
    kmsg_seq: Option<u64>,
}

/// Runs rounds of checks on a thread of their own, so that a check that hangs (a GPU driver
/// that stopped answering, a stuck file system under the host tree) cannot stop heartbeats: a
/// round not done within the timeout reports its checks `unknown`, which never drains. While a
/// round hangs no other starts (threads do not pile up); its late result is dropped.
struct Checker {
    timeout: Duration,
    pending: Option<std::sync::mpsc::Receiver<Round>>,
}

impl Checker {
    fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            pending: None,
        }
    }

    /// Runs `work` with the timeout; `None` when it (or a round before it) has not finished.
    fn run(&mut self, work: impl FnOnce() -> Round + Send + 'static) -> Option<Round> {
        let rx = match self.pending.take() {
            Some(rx) => rx,
            None => {
                let (tx, rx) = std::sync::mpsc::sync_channel(1);
                std::thread::spawn(move || {
                    let _ = tx.send(work());
                });
                rx
            }
        };
        match rx.recv_timeout(self.timeout) {
            Ok(r) => Some(r),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                self.pending = Some(rx);
                None
            }
            // The round's thread died (a panic): nothing to wait for.
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => None,
        }
    }
}

/// The checks of a round that did not finish: the names last seen (or `health`), `unknown`.
fn timed_out(last: &[CheckResult], timeout: Duration) -> Vec<CheckResult> {
    let message = format!(
        "the checks did not finish within {} ms (agent.check_timeout_ms)",
        timeout.as_millis()
    );
    if last.is_empty() {
        return vec![CheckResult {
            name: "health".into(),
            status: Status::Unknown,
            severity: Severity::Soft,
            recoverable: true,
            message,
        }];
    }
    last.iter()
        .map(|c| CheckResult {
            status: Status::Unknown,
            message: message.clone(),
            ..c.clone()
        })
        .collect()
}

/// Each check's and daemon's name and status: a heartbeat goes out at once when these change.
fn statuses(checks: &[CheckResult], daemons: &[DaemonReport]) -> Vec<(String, String)> {
    checks
        .iter()
        .map(|c| (c.name.clone(), format!("{:?}", c.status)))
        .chain(
            daemons
                .iter()
                .map(|d| (format!("daemon {}", d.daemon), d.state.word().to_string())),
        )
        .collect()
}

fn node_name(name: Option<&str>, config: &Config) -> Result<String, AgentError> {
    if let Some(n) = name
        .map(str::to_string)
        .or_else(|| config.agent.node_name.clone())
    {
        return Ok(n);
    }
    let h = nix::unistd::gethostname().map_err(|e| {
        AgentError::host(format!("reading the host name: {e}; set agent.node_name"))
    })?;
    let h = h.to_string_lossy();
    Ok(h.split('.').next().unwrap_or(&h).to_string())
}

/// What `/metrics` shows, updated by the check loop.
#[derive(Default)]
struct Metrics {
    checks: Mutex<Vec<CheckResult>>,
    daemons: Mutex<Vec<DaemonReport>>,
    leftovers: Mutex<usize>,
    sent: AtomicU64,
    /// Heartbeats sent before their interval because a check's status changed.
    changes: AtomicU64,
    failed: AtomicU64,
    last_ok_unix: AtomicU64,
    term: AtomicU64,
}

impl Metrics {
    fn render(&self) -> String {
        let mut t = String::new();
        t.push_str("# HELP berth_agent_check_ok 1 when the check passed in the last round.\n");
        t.push_str("# TYPE berth_agent_check_ok gauge\n");
        let checks = self
            .checks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for c in &checks {
            let v = i32::from(c.status == Status::Ok);
            t.push_str(&format!(
                "berth_agent_check_ok{{check=\"{}\"}} {v}\n",
                c.name
            ));
        }
        t.push_str(
            "# HELP berth_agent_check_unknown 1 when the check could not say (timed out, unreadable).\n\
             # TYPE berth_agent_check_unknown gauge\n",
        );
        for c in &checks {
            let v = i32::from(c.status == Status::Unknown);
            t.push_str(&format!(
                "berth_agent_check_unknown{{check=\"{}\"}} {v}\n",
                c.name
            ));
        }
        t.push_str(
            "# HELP berth_agent_daemon_up 1 when the node's daemon (slurmd, munge) is up, 0 when down or unknown.\n\
             # TYPE berth_agent_daemon_up gauge\n",
        );
        for d in self
            .daemons
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|d| d.state != DaemonState::NotConfigured)
        {
            t.push_str(&format!(
                "berth_agent_daemon_up{{daemon=\"{}\"}} {}\n",
                d.daemon,
                i32::from(d.state == DaemonState::Up)
            ));
        }
        t.push_str(&format!(
            "# HELP berth_agent_leftovers Leftovers of ended jobs on the node (containers, scratch).\n\
             # TYPE berth_agent_leftovers gauge\n\
             berth_agent_leftovers {}\n",
            *self.leftovers.lock().unwrap_or_else(|p| p.into_inner())
        ));
        let counters = [
            ("heartbeats", "Heartbeats the controller took.", &self.sent),
            (
                "heartbeat_failures",
                "Heartbeats no controller took.",
                &self.failed,
            ),
            (
                "heartbeats_on_change",
                "Heartbeats sent before their interval because a check changed status.",
                &self.changes,
            ),
        ];
        for (name, help, v) in counters {
            t.push_str(&format!(
                "# HELP berth_agent_{name}_total {help}\n# TYPE berth_agent_{name}_total counter\n\
                 berth_agent_{name}_total {}\n",
                v.load(Ordering::Relaxed)
            ));
        }
        t.push_str(&format!(
            "# HELP berth_agent_last_heartbeat_timestamp_seconds When the controller last took a heartbeat.\n\
             # TYPE berth_agent_last_heartbeat_timestamp_seconds gauge\n\
             berth_agent_last_heartbeat_timestamp_seconds {}\n\
             # HELP berth_agent_controller_term The leader's term in its last answer.\n\
             # TYPE berth_agent_controller_term gauge\n\
             berth_agent_controller_term {}\n",
            self.last_ok_unix.load(Ordering::Relaxed),
            self.term.load(Ordering::Relaxed)
        ));
        t
    }
}

/// Serves `GET /metrics` (Prometheus text) on `addr`, one short request per connection.
fn serve_metrics(addr: &str, metrics: Arc<Metrics>) -> Result<(), AgentError> {
    let listener = TcpListener::bind(addr).map_err(|e| {
        AgentError::host(format!(
            "listening on {addr} for metrics: {e}; set agent.metrics_listen (empty: no metrics)"
        ))
    })?;
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let _ = answer(conn, &metrics);
        }
    });
    Ok(())
}

fn answer(mut conn: TcpStream, metrics: &Metrics) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(2)))?;
    conn.set_write_timeout(Some(Duration::from_secs(2)))?;
    let mut buf = [0u8; 2048];
    let n = conn.read(&mut buf)?;
    let head = String::from_utf8_lossy(&buf[..n]);
    let (status, body) = if head.starts_with("GET /metrics ") {
        ("200 OK", metrics.render())
    } else {
        ("404 Not Found", "GET /metrics\n".to_string())
    };
    write!(
        conn,
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )
}

/// Raises the soft limit on open files to the hard limit: the peer server holds a descriptor per
/// transfer and per blob it serves, and the default soft limit (1024) is the first to run out.
fn raise_nofile_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE)
        && soft < hard
        && let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard)
    {
        tracing::warn!("raising the open files limit: {e}");
    }
}

/// A pseudo-random fraction in [0, 1) for jitter (no RNG dependency: time and pid mixed).
fn jitter_fraction(round: u64) -> f64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::from(d.subsec_nanos()));
    let mut x =
        nanos ^ (u64::from(std::process::id()) << 32) ^ round.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    (x % 10_000) as f64 / 10_000.0
}

/// Runs the agent: a round of checks and a heartbeat every interval (one round with `once`),
/// with `/metrics` and the peer blob server; reads `config_path` again each round. `node`:
/// this node's Slurm name (else `agent.node_name`, else the short host name).
pub fn run(
    config: &Config,
    config_path: &Path,
    node: Option<&str>,
    once: bool,
) -> Result<i32, AgentError> {
    let mut config = config.clone();
    let node = node_name(node, &config)?;
    let mut client = Client::new(&config)?;
    let metrics = Arc::new(Metrics::default());
    if !once && !config.agent.metrics_listen.is_empty() {
        serve_metrics(&config.agent.metrics_listen, metrics.clone())?;
    }
    if !once {
        raise_nofile_limit();
        crate::peer::serve(&config, &node)?;
    }
    let mut st = Rounds::new(&config);
    let mut steps = crate::rollout::Steps::default();
    loop {
        let started = Instant::now();
        let results = st.check(&config);
        *metrics.checks.lock().unwrap_or_else(|p| p.into_inner()) = results.clone();
        *metrics.daemons.lock().unwrap_or_else(|p| p.into_inner()) = st.last_daemons.clone();
        *metrics.leftovers.lock().unwrap_or_else(|p| p.into_inner()) = st.inv.leftovers.len();
        let now_statuses = statuses(&results, &st.last_daemons);
        let changed = st
            .sent_statuses
            .as_ref()
            .is_some_and(|s| *s != now_statuses);
        let step_due = steps.due();
        if once || changed || step_due || Instant::now() >= st.next_beat {
            let boot = boot_id(&config);
            let hb = Heartbeat {
                node: node.clone(),
                boot_id: boot.clone(),
                version: env!("CARGO_PKG_VERSION").to_string(),
                checks: results,
                versions: st.inv.versions.clone(),
                images: st.inv.images.clone(),
                leftovers: st.inv.leftovers.clone(),
                cause: changed.then(|| "change".to_string()),
                daemons: st.last_daemons.clone(),
                peer: crate::peer::advertise(&config),
                refs: st.inv.refs.clone(),
                step_report: steps.report(&config.agent, &node, &boot),
            };
            let sent = send(&mut client, &hb, &metrics);
            let mut hint = None;
            match &sent {
                Ok(reply) => {
                    if !once {
                        let order = reply.as_ref().and_then(|r| r.step.clone());
                        steps.order(order, &config.agent, &node, &boot);
                        hint = reply.as_ref().and_then(|r| r.next_beat_ms);
                    }
                    st.sent_statuses = Some(now_statuses);
                    if changed {
                        metrics.changes.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Err(e) => tracing::warn!("heartbeat of {node}: {e}"),
            }
            if once {
                return match sent {
                    Ok(_) => Ok(0),
                    Err(e) => Err(AgentError::host(format!("berth agent: heartbeat: {e}"))),
                };
            }
            st.schedule_beat(&config);
            // A node in a rollout step beats sooner when the leader asks (its order, its gate).
            if let Some(ms) = hint {
                st.next_beat = st
                    .next_beat
                    .min(Instant::now() + Duration::from_millis(ms.max(100)));
            }
        }
        let every = Duration::from_millis(
            config
                .agent
                .check_interval_ms
                .clamp(100, config.agent.interval_ms.max(100)),
        );
        let wait = every
            .saturating_sub(started.elapsed())
            .min(st.next_beat.saturating_duration_since(Instant::now()));
        std::thread::sleep(wait);
        match Config::load(config_path, config_path.exists()) {
            Ok(c) => config = c,
            Err(e) => tracing::warn!("keeping the previous configuration: {e}"),
        }
    }
}

/// What the agent's loop keeps from round to round.
struct Rounds {
    checker: Checker,
    /// Where the kernel log stood after the last round: XIDs count once.
    xid_after: Option<u64>,
    last_checks: Vec<CheckResult>,
    last_daemons: Vec<DaemonReport>,
    inv: Inventory,
    inv_at: Option<Instant>,
    /// When munge was last checked: once per heartbeat interval is enough (slurmd's check, a
    /// pid file and /proc, runs every round).
    munge_at: Option<Instant>,
    /// The statuses the controller last took, and when the next regular heartbeat is due.
    sent_statuses: Option<Vec<(String, String)>>,
    next_beat: Instant,
    beats: u64,
}

impl Rounds {
    fn new(config: &Config) -> Self {
        let mut checker = Checker::new(Duration::from_millis(config.agent.check_timeout_ms.max(1)));
        // Where the kernel log stands now, read within the timeout like the checks.
        let c = config.clone();
        let xid_after = checker
            .run(move || Round {
                checks: Vec::new(),
                daemons: Vec::new(),
                inventory: Inventory::default(),
                kmsg_seq: kmsg_seq(&c),
            })
            .and_then(|r| r.kmsg_seq);
        Self {
            checker,
            xid_after,
            last_checks: Vec::new(),
            last_daemons: Vec::new(),
            inv: Inventory::default(),
            inv_at: None,
            munge_at: None,
            sent_statuses: None,
            next_beat: Instant::now(),
            beats: 0,
        }
    }

    /// One round of checks, daemons and (when due) the inventory, within the check timeout;
    /// the checks' results (the last ones marked timed out when the round did not finish).
    fn check(&mut self, config: &Config) -> Vec<CheckResult> {
        self.checker.timeout = Duration::from_millis(config.agent.check_timeout_ms.max(1));
        let (c, after) = (config.clone(), self.xid_after);
        let gather = self.inv_at.is_none_or(|t| t.elapsed() >= INVENTORY_EVERY)
            || crate::peer::inventory_due();
        let munge_now = self.munge_at.is_none_or(|t| {
            t.elapsed() >= Duration::from_millis(config.agent.interval_ms.max(100))
        });
        let last_munge = self
            .last_daemons
            .iter()
            .find(|d| d.daemon == "munge")
            .cloned();
        match self.checker.run(move || Round {
            checks: checks(&c, after),
            daemons: crate::daemons::check(&c.agent, munge_now, last_munge.as_ref()),
            inventory: if gather {
                inventory(&c)
            } else {
                Inventory::default()
            },
            // XIDs count once: the next round judges only those logged after this one's.
            kmsg_seq: kmsg_seq(&c),
        }) {
            Some(r) => {
                if r.kmsg_seq.is_some() {
                    self.xid_after = r.kmsg_seq;
                }
                if gather {
                    self.inv = r.inventory;
                    self.inv_at = Some(Instant::now());
                }
                self.last_checks = r.checks.clone();
                self.last_daemons = r.daemons;
                if munge_now {
                    self.munge_at = Some(Instant::now());
                }
                r.checks
            }
            None => {
                // The daemons were not looked at this round either: they cannot say.
                for d in &mut self.last_daemons {
                    d.state = DaemonState::Unknown;
                }
                self.munge_at = None;
                timed_out(&self.last_checks, self.checker.timeout)
            }
        }
    }

    /// The next regular heartbeat: one interval on, spread by the jitter so that a cluster's
    /// agents do not beat together.
    fn schedule_beat(&mut self, config: &Config) {
        self.beats += 1;
        let interval = config.agent.interval_ms.max(100) as f64;
        let spread = interval * f64::from(config.agent.jitter_percent.min(100)) / 100.0;
        self.next_beat = Instant::now()
            + Duration::from_secs_f64(
                (interval - spread / 2.0 + spread * jitter_fraction(self.beats)).max(0.0) / 1000.0,
            );
    }
}

/// Posts one heartbeat; counts it in the metrics. Returns the leader's answer (a rollout step
/// it orders, how soon to beat again), when it parses.
fn send(
    client: &mut Client,
    hb: &Heartbeat,
    metrics: &Metrics,
) -> Result<Option<HeartbeatReply>, AgentError> {
    let body = serde_json::to_vec(hb).expect("a heartbeat serializes");
    let sent = match client.request("/v1/heartbeat", Some(&body), true) {
        Ok((_, 200, bytes)) => match serde_json::from_slice::<HeartbeatReply>(&bytes) {
            Ok(r) => {
                metrics.term.store(r.term, Ordering::Relaxed);
                Ok(Some(r))
            }
            Err(_) => Ok(None),
        },
        Ok((addr, status, bytes)) => Err(AgentError::Host(format!(
            "{addr}: HTTP {status}: {}",
            String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).trim()
        ))),
        Err(e) => Err(e),
    };
    match &sent {
        Ok(_) => {
            metrics.sent.fetch_add(1, Ordering::Relaxed);
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            metrics.last_ok_unix.store(now, Ordering::Relaxed);
        }
        Err(_) => {
            metrics.failed.fetch_add(1, Ordering::Relaxed);
        }
    }
    sent
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hard_checks_are_the_gpu_ones_and_hardware_faults_do_not_recover() {
        assert_eq!(classify("gpu-count"), (Severity::Hard, true));
        assert_eq!(classify("xid"), (Severity::Hard, false));
        assert_eq!(classify("ecc"), (Severity::Hard, false));
        assert_eq!(classify("nic-ports"), (Severity::Soft, true));
        assert_eq!(classify("pcie-links"), (Severity::Soft, true));
    }

    #[test]
    fn a_round_that_hangs_reports_unknown_and_starts_no_other() {
        let mut c = Checker::new(Duration::from_millis(100));
        let round = |checks| Round {
            checks,
            daemons: Vec::new(),
            inventory: Inventory::default(),
            kmsg_seq: None,
        };
        let ok = CheckResult {
            name: "gpu-count".into(),
            status: Status::Ok,
            severity: Severity::Hard,
            recoverable: true,
            message: "8 of 8".into(),
        };
        let got = c.run({
            let ok = ok.clone();
            move || round(vec![ok])
        });
        assert_eq!(got.unwrap().checks[0].status, Status::Ok);
        // A round that hangs: no result within the timeout, then its checks are unknown.
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let started = Arc::new(AtomicU64::new(0));
        let s = started.clone();
        assert!(
            c.run(move || {
                s.fetch_add(1, Ordering::SeqCst);
                let _ = wait.recv();
                round(Vec::new())
            })
            .is_none()
        );
        let unknown = timed_out(std::slice::from_ref(&ok), c.timeout);
        assert_eq!(unknown[0].name, "gpu-count");
        assert_eq!(unknown[0].status, Status::Unknown);
        assert_eq!(unknown[0].severity, Severity::Hard);
        assert!(unknown[0].message.contains("check_timeout_ms"));
        assert_eq!(timed_out(&[], c.timeout)[0].name, "health");
        // While it hangs, the next call waits on it instead of starting another round.
        let s = started.clone();
        assert!(
            c.run(move || {
                s.fetch_add(1, Ordering::SeqCst);
                round(Vec::new())
            })
            .is_none()
        );
        assert_eq!(started.load(Ordering::SeqCst), 1);
        release.send(()).unwrap();
        assert!(c.run(move || round(Vec::new())).is_some());
    }

    #[test]
    fn a_status_change_is_a_change_a_new_message_is_not() {
        let mut a = CheckResult {
            name: "nic-ports".into(),
            status: Status::Ok,
            severity: Severity::Soft,
            recoverable: true,
            message: "4 up".into(),
        };
        let mut munge = DaemonReport {
            daemon: "munge".into(),
            state: DaemonState::Up,
            message: "ok".into(),
        };
        let before = statuses(std::slice::from_ref(&a), std::slice::from_ref(&munge));
        a.message = "4 up, 1 ignored".into();
        munge.message = "still ok".into();
        assert_eq!(
            statuses(std::slice::from_ref(&a), std::slice::from_ref(&munge)),
            before
        );
        munge.state = DaemonState::Down;
        assert_ne!(
            statuses(std::slice::from_ref(&a), std::slice::from_ref(&munge)),
            before
        );
        munge.state = DaemonState::Up;
        a.status = Status::Fail;
        assert_ne!(
            statuses(std::slice::from_ref(&a), std::slice::from_ref(&munge)),
            before
        );
    }

    #[test]
    fn jitter_stays_in_range() {
        for r in 0..100 {
            let f = jitter_fraction(r);
            assert!((0.0..1.0).contains(&f));
        }
    }
}
