//! The leader's watch on Slurm's own daemons (issue 17): every `watch_interval_ms` it pings the
//! primary and the backup slurmctld (`scontrol ping`, each on its own, bounded by
//! `ping_timeout_ms`), reads the age of the primary's heartbeat file in `StateSaveLocation`,
//! and checks slurmdbd when slurm.conf names one (a TCP connection to
//! `AccountingStorageHost:AccountingStoragePort`; a cluster without slurmdbd reports it
//! `not-configured`, never `down`). It feeds the pings to the takeover trigger (takeover.rs)
//! and runs the takeover it decides; and it audits the leftovers the agents report against
//! `squeue`. What it finds goes to `/metrics`, `GET /v1/slurm` and `berth cluster status`.
//!
//! `scontrol ping` pings every SlurmctldHost in turn, so a hung primary would hold the backup's
//! answer back for MessageTimeout; each controller is pinged with a slurm.conf of its own
//! instead (`<data_dir>/ping-N.conf`: slurm.conf with the other SlurmctldHost lines left
//! out), in parallel.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use berth_api::{DaemonReport, DaemonState, SlurmView, TakeoverView};

use crate::Settings;
use crate::error::ControllerError;
use crate::server::{App, Beat};
use crate::state::Command;
use crate::takeover::{Decided, Ping, Trigger, Verdict};

/// What the leader's watch knows (memory only; a new leader starts afresh).
pub struct Watch {
    inner: Mutex<Inner>,
}

struct Inner {
    trigger: Trigger,
    daemons: Vec<DaemonReport>,
    ctld_heartbeat_age_s: Option<f64>,
    armed: bool,
    /// When the leader first saw each leftover, by node and line.
    first_seen: HashMap<(String, String), Instant>,
    /// Jobs squeue lists as not ended, and when it was asked; `None`: not asked or no answer.
    live: Option<HashSet<String>>,
    live_at: Option<Instant>,
    /// slurm.conf as last read, with the path, mtime and length it was read at: read again only
    /// when one of them changes (a round runs every second).
    conf: Option<ConfRead>,
}

/// One read of slurm.conf.
#[derive(Clone, Debug)]
struct ConfRead {
    path: PathBuf,
    modified: SystemTime,
    len: u64,
    text: std::sync::Arc<String>,
}

/// The most slurm.conf bytes the watch reads (a cluster's node and partition lines included).
const CONF_MAX: u64 = 4 << 20;

/// slurm.conf's text: the one read before when its path, mtime and length are the same, else
/// read again (at most [`CONF_MAX`] bytes). The flag says whether it was read now.
fn read_conf(cached: Option<&ConfRead>, path: &Path) -> Result<(ConfRead, bool), ControllerError> {
    use std::io::Read as _;
    let what = |e: &dyn std::fmt::Display| {
        ControllerError::Conf(format!(
            "cannot read slurm.conf {}: {e} (controller.slurm_conf)",
            path.display()
        ))
    };
    let meta = std::fs::metadata(path).map_err(|e| what(&e))?;
    let modified = meta.modified().map_err(|e| what(&e))?;
    if let Some(c) = cached
        && c.path == path
        && c.modified == modified
        && c.len == meta.len()
    {
        return Ok((c.clone(), false));
    }
    let mut text = String::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(CONF_MAX + 1).read_to_string(&mut text))
        .map_err(|e| what(&e))?;
    if text.len() as u64 > CONF_MAX {
        return Err(what(&format_args!(
            "larger than {} MiB; point controller.slurm_conf at the cluster's slurm.conf",
            CONF_MAX >> 20
        )));
    }
    let read = ConfRead {
        path: path.to_path_buf(),
        modified,
        len: text.len() as u64,
        text: std::sync::Arc::new(text),
    };
    Ok((read, true))
}

/// What the watch needs of slurm.conf.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlurmConf {
    /// SlurmctldHost lines in order (primary first): name and, when given, address.
    pub ctld_hosts: Vec<(String, Option<String>)>,
    pub state_save: Option<PathBuf>,
    /// `host:port` of slurmdbd when AccountingStorageType is accounting_storage/slurmdbd.
    pub slurmdbd: Option<String>,
}

/// Parses the keys the watch needs (case-insensitive, `#` comments, several `Key=Value` on a
/// line); `ControlMachine`/`BackupController` (before Slurm 18.08) count as SlurmctldHost.
pub fn parse_conf(text: &str) -> SlurmConf {
    let mut c = SlurmConf::default();
    let mut acct_type = String::new();
    let mut acct_host: Option<String> = None;
    let mut acct_port = "6819".to_string();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("");
        for tok in line.split_whitespace() {
            let Some((k, v)) = tok.split_once('=') else {
                continue;
            };
            match k.to_ascii_lowercase().as_str() {
                "slurmctldhost" | "controlmachine" | "backupcontroller" => {
                    let (name, addr) = match v.split_once('(') {
                        Some((n, a)) => (n, Some(a.trim_end_matches(')').to_string())),
                        None => (v, None),
                    };
                    c.ctld_hosts.push((name.to_string(), addr));
                }
                "statesavelocation" => c.state_save = Some(PathBuf::from(v)),
                "accountingstoragetype" => acct_type = v.to_ascii_lowercase(),
                "accountingstoragehost" => acct_host = Some(v.to_string()),
                "accountingstorageport" => acct_port = v.to_string(),
                _ => {}
            }
        }
    }
    if acct_type.ends_with("slurmdbd") {
        let host = acct_host
            .or_else(|| {
                c.ctld_hosts
                    .first()
                    .map(|(n, a)| a.clone().unwrap_or(n.clone()))
            })
            .unwrap_or_else(|| "localhost".into());
        c.slurmdbd = Some(format!("{host}:{acct_port}"));
    }
    c
}

/// slurm.conf with only the `keep`-th SlurmctldHost line (0: the primary), so `scontrol ping`
/// pings that controller alone; relative Include paths made absolute (the copy lives
/// elsewhere).
pub fn conf_for(text: &str, keep: usize, conf_dir: &Path) -> String {
    let mut out = String::with_capacity(text.len());
    let mut seen = 0;
    for line in text.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        let key = first.split('=').next().unwrap_or("").to_ascii_lowercase();
        if matches!(
            key.as_str(),
            "slurmctldhost" | "controlmachine" | "backupcontroller"
        ) {
            seen += 1;
            if seen - 1 != keep {
                continue;
            }
        }
        if key == "include" {
            let mut words = line.split_whitespace();
            let (_, path) = (words.next(), words.next().unwrap_or(""));
            if !path.is_empty() && !path.starts_with('/') {
                out.push_str(&format!("Include {}\n", conf_dir.join(path).display()));
                continue;
            }
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// The slurm.conf the watch reads: controller.slurm_conf, else $SLURM_CONF, else Slurm's
/// default.
pub fn conf_path(s: &Settings) -> PathBuf {
    if !s.slurm_conf.as_os_str().is_empty() {
        return s.slurm_conf.clone();
    }
    std::env::var_os("SLURM_CONF")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/etc/slurm/slurm.conf"))
}

/// What a tool printed: its stdout, whether it exited 0, and why not (one line).
struct ToolOut {
    stdout: String,
    failed: Option<String>,
}

/// Runs `prog args` with SLURM_CONF=`conf`, at most `timeout`; `Err(None)` on the timeout,
/// `Err(Some(why))` when it could not run.
async fn tool(
    prog: &Path,
    args: &[&str],
    conf: &Path,
    timeout: Duration,
) -> Result<ToolOut, Option<String>> {
    let mut cmd = tokio::process::Command::new(prog);
    cmd.args(args)
        .env("SLURM_CONF", conf)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let out = match tokio::time::timeout(timeout, cmd.output()).await {
        Err(_) => return Err(None),
        Ok(Err(e)) => return Err(Some(format!("running {}: {e}", prog.display()))),
        Ok(Ok(o)) => o,
    };
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let failed = (!out.status.success()).then(|| {
        let err = String::from_utf8_lossy(&out.stderr);
        format!(
            "{} {}: {}: {}",
            prog.display(),
            args.join(" "),
            out.status,
            err.lines().next().unwrap_or("").trim()
        )
    });
    Ok(ToolOut { stdout, failed })
}

/// A tool's stdout when it exited 0, else why not.
async fn tool_ok(
    prog: &Path,
    args: &[&str],
    conf: &Path,
    timeout: Duration,
) -> Result<String, ControllerError> {
    match tool(prog, args, conf, timeout).await {
        Ok(ToolOut {
            stdout,
            failed: None,
        }) => Ok(stdout),
        Ok(ToolOut {
            failed: Some(why), ..
        })
        | Err(Some(why)) => Err(ControllerError::Tool(why)),
        Err(None) => Err(ControllerError::NoAnswer {
            path: prog.to_path_buf(),
            args: args.iter().map(|a| a.to_string()).collect(),
            secs: timeout.as_secs(),
        }),
    }
}

/// `scontrol ping` with a slurm.conf naming one controller.
async fn ping(s: &Settings, conf: &Path) -> (Ping, String) {
    let timeout = Duration::from_millis(s.ping_timeout_ms.max(100));
    match tool(&s.scontrol, &["ping"], conf, timeout).await {
        Err(None) => (
            Ping::Timeout,
            format!("no answer within {} ms", timeout.as_millis()),
        ),
        Err(Some(why)) => (Ping::Unknown, why),
        // scontrol ping exits 1 when a controller is down, and still says so on stdout.
        Ok(ToolOut {
            stdout: text,
            failed,
        }) => {
            let line = text
                .lines()
                .find(|l| l.starts_with("Slurmctld("))
                .unwrap_or("")
                .trim()
                .to_string();
            if line.ends_with(" is UP") {
                (Ping::Up, line)
            } else if line.ends_with(" is DOWN") {
                (Ping::Down, line)
            } else {
                (
                    Ping::Unknown,
                    failed.unwrap_or_else(|| "no Slurmctld line".into()),
                )
            }
        }
    }
}

fn report(daemon: &str, state: DaemonState, message: impl Into<String>) -> DaemonReport {
    DaemonReport {
        daemon: daemon.into(),
        state,
        message: message.into(),
    }
}

fn daemon_state(p: Ping) -> DaemonState {
    match p {
        Ping::Up => DaemonState::Up,
        Ping::Down | Ping::Timeout => DaemonState::Down,
        Ping::Unknown => DaemonState::Unknown,
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Watch {
    pub fn new(s: &Settings) -> Self {
        Self {
            inner: Mutex::new(Inner {
                trigger: Trigger::new(s.takeover_after),
                daemons: Vec::new(),
                ctld_heartbeat_age_s: None,
                armed: false,
                first_seen: HashMap::new(),
                live: None,
                live_at: None,
                conf: None,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Forgets what a leader knew: on losing leadership.
    fn reset(&self, s: &Settings) {
        let mut i = self.lock();
        i.trigger = Trigger::new(s.takeover_after);
        i.daemons.clear();
        i.ctld_heartbeat_age_s = None;
        i.first_seen.clear();
        i.live = None;
        i.live_at = None;
        i.conf = None;
    }
}

/// The leader's loop: one round per `watch_interval_ms`; rounds never overlap.
pub async fn run(app: std::sync::Arc<App>) {
    let every = Duration::from_millis(app.s.watch_interval_ms.max(100));
    let mut was_leader = false;
    loop {
        let started = Instant::now();
        let leader = app.is_leader_now();
        if !leader && was_leader {
            app.watch.reset(&app.s);
        }
        was_leader = leader;
        if leader {
            round(&app).await;
            tokio::time::sleep(every.saturating_sub(started.elapsed())).await;
        } else {
            // A new leader starts watching at once (and counting towards a takeover).
            tokio::time::sleep(every.min(Duration::from_millis(100))).await;
        }
    }
}

async fn round(app: &App) {
    let s = &app.s;
    let path = conf_path(s);
    let cached = app.watch.lock().conf.clone();
    let (read, fresh) = match read_conf(cached.as_ref(), &path) {
        Ok(r) => r,
        Err(why) => {
            let mut i = app.watch.lock();
            i.conf = None;
            i.daemons = ["slurmctld", "slurmctld-backup", "slurmdbd"]
                .iter()
                .map(|d| report(d, DaemonState::Unknown, why.to_string()))
                .collect();
            i.armed = false;
            return;
        }
    };
    let text = read.text.clone();
    app.watch.lock().conf = Some(read);
    let conf = parse_conf(&text);
    let mut daemons = Vec::new();
    let name = |i: usize| {
        conf.ctld_hosts
            .get(i)
            .map_or_else(String::new, |(n, _)| n.clone())
    };
    let (primary, backup) = if conf.ctld_hosts.len() >= 2 {
        let dir = path.parent().unwrap_or(Path::new("/"));
        let mut confs = Vec::new();
        for i in 0..2 {
            let p = s.data_dir.join(format!("ping-{}.conf", i + 1));
            // Written when slurm.conf was read (changed, or this leader's first round).
            if (fresh || !p.exists())
                && let Err(e) = std::fs::write(&p, conf_for(&text, i, dir))
            {
                tracing::warn!("writing {}: {e}", p.display());
            }
            confs.push(p);
        }
        let (p, b) = tokio::join!(ping(s, &confs[0]), ping(s, &confs[1]));
        (p, Some(b))
    } else {
        (ping(s, &path).await, None)
    };
    daemons.push(report(
        "slurmctld",
        daemon_state(primary.0),
        format!("{}: {}", name(0), primary.1),
    ));
    daemons.push(match &backup {
        Some(b) => report(
            "slurmctld-backup",
            daemon_state(b.0),
            format!("{}: {}", name(1), b.1),
        ),
        None => report(
            "slurmctld-backup",
            DaemonState::NotConfigured,
            "slurm.conf names one SlurmctldHost",
        ),
    });
    daemons.push(match &conf.slurmdbd {
        None => report(
            "slurmdbd",
            DaemonState::NotConfigured,
            "AccountingStorageType is not accounting_storage/slurmdbd",
        ),
        Some(addr) => {
            let timeout = Duration::from_millis(s.ping_timeout_ms.max(100));
            match tokio::time::timeout(timeout, tokio::net::TcpStream::connect(addr)).await {
                Ok(Ok(_)) => report("slurmdbd", DaemonState::Up, format!("{addr} accepts")),
                Ok(Err(e)) => report("slurmdbd", DaemonState::Down, format!("{addr}: {e}")),
                Err(_) => report(
                    "slurmdbd",
                    DaemonState::Down,
                    format!("{addr}: no answer within {} ms", timeout.as_millis()),
                ),
            }
        }
    });
    // The primary writes StateSaveLocation/heartbeat every SlurmctldTimeout/4 or so.
    let age = conf.state_save.as_ref().and_then(|d| {
        let m = std::fs::metadata(d.join("heartbeat"))
            .ok()?
            .modified()
            .ok()?;
        Some(
            SystemTime::now()
                .duration_since(m)
                .unwrap_or_default()
                .as_secs_f64(),
        )
    });
    let armed = s.takeover && backup.is_some();
    let verdict = {
        let mut i = app.watch.lock();
        i.daemons = daemons;
        i.ctld_heartbeat_age_s = age;
        i.armed = armed;
        if armed {
            let b = backup.as_ref().map_or(Ping::Unknown, |b| b.0);
            i.trigger.observe(primary.0, b)
        } else {
            Verdict::Wait
        }
    };
    if let Verdict::TakeOver { reason } = verdict {
        take_over(app, &path, &conf, &text, &name(1), reason).await;
    }
    audit(app, &path).await;
}

/// Commits the decision (only a leader with a quorum can), checks the primary once more, then
/// runs `scontrol takeover` and commits what it answered.
async fn take_over(
    app: &App,
    conf_path: &Path,
    conf: &SlurmConf,
    text: &str,
    backup: &str,
    reason: String,
) {
    let s = &app.s;
    let Some(term) = crate::server::confirm_leader(app).await else {
        return;
    };
    let decided = Decided {
        at_ms: now_ms(),
        by: s.id,
        term,
        backup: backup.to_string(),
        reason: reason.clone(),
        outcome: None,
    };
    let commit = |cmd: Command| async move {
        tokio::time::timeout(Duration::from_secs(5), app.raft.client_write(cmd))
            .await
            .is_ok_and(|r| r.is_ok())
    };
    if !commit(Command::Takeover(decided)).await {
        tracing::warn!("takeover not committed (no quorum?): not calling scontrol");
        app.watch.lock().trigger.done(false);
        return;
    }
    // Never while the primary answers: one more look, right before the call.
    let dir = conf_path.parent().unwrap_or(Path::new("/"));
    let p1 = s.data_dir.join("ping-1.conf");
    if conf.ctld_hosts.len() >= 2 {
        let _ = std::fs::write(&p1, conf_for(text, 0, dir));
    }
    let (again, line) = ping(s, &p1).await;
    let outcome = if again == Ping::Up {
        app.watch.lock().trigger.primary_answered();
        format!("not run: the primary answered again ({line})")
    } else if crate::server::confirm_leader(app).await != Some(term) {
        app.watch.lock().trigger.done(false);
        "not run: no longer the leader".to_string()
    } else {
        let timeout = Duration::from_secs(10);
        match tool_ok(&s.scontrol, &["takeover"], conf_path, timeout).await {
            Ok(_) => {
                app.watch.lock().trigger.done(true);
                app.takeovers_run
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                format!("scontrol takeover: {backup} took over")
            }
            Err(why) => {
                app.watch.lock().trigger.done(false);
                format!("scontrol takeover failed: {why}")
            }
        }
    };
    tracing::warn!("slurmctld takeover: {reason}: {outcome}");
    if !commit(Command::TakeoverOutcome {
        outcome: outcome.clone(),
    })
    .await
    {
        tracing::warn!("the takeover's outcome was not committed: {outcome}");
    }
}

/// The job a leftover line names, if any: `scratch <job>`, `container <id> job <job>`.
fn leftover_job(line: &str) -> Option<&str> {
    let mut w = line.split_whitespace();
    match w.next()? {
        "scratch" => w.next(),
        "container" => {
            let _id = w.next()?;
            (w.next()? == "job").then(|| w.next()).flatten()
        }
        _ => None,
    }
}

/// Asks squeue which jobs have not ended (every `audit_interval_s`, and only while some
/// leftover names a job).
async fn audit(app: &App, conf: &Path) {
    let s = &app.s;
    let beats = app.beats_now();
    let any_job = beats
        .values()
        .any(|b| b.leftovers.iter().any(|l| leftover_job(l).is_some()));
    let due = app
        .watch
        .lock()
        .live_at
        .is_none_or(|t| t.elapsed() >= Duration::from_secs(s.audit_interval_s.max(1)));
    if !any_job || !due {
        return;
    }
    let args = ["-h", "-a", "-t", "all", "-o", "%A %T"];
    let live = match tool_ok(&s.squeue, &args, conf, Duration::from_secs(10)).await {
        Ok(text) => Some(
            text.lines()
                .filter_map(|l| l.split_once(' '))
                .filter(|(_, st)| {
                    matches!(
                        st.trim(),
                        "PENDING"
                            | "RUNNING"
                            | "SUSPENDED"
                            | "COMPLETING"
                            | "CONFIGURING"
                            | "STOPPED"
                            | "REQUEUED"
                            | "RESIZING"
                    )
                })
                .map(|(id, _)| id.trim().to_string())
                .collect(),
        ),
        Err(e) => {
            tracing::warn!("{e}");
            None
        }
    };
    let mut i = app.watch.lock();
    i.live = live;
    i.live_at = Some(Instant::now());
}

/// Each node's leftovers of ended jobs with their ages (seconds since the leader first saw
/// them): those naming a job squeue no longer lists, and those of no job (cgroups, mounts,
/// containers without a job). While squeue has not answered, only the latter.
pub fn orphaned(app: &App, beats: &HashMap<String, Beat>) -> BTreeMap<String, Vec<(String, f64)>> {
    let mut i = app.watch.lock();
    let now = Instant::now();
    let mut out: BTreeMap<String, Vec<(String, f64)>> = BTreeMap::new();
    let mut keep = HashSet::new();
    for (node, b) in beats {
        for l in &b.leftovers {
            let ended = match leftover_job(l) {
                None => true,
                Some(job) => i.live.as_ref().is_some_and(|live| !live.contains(job)),
            };
            if !ended {
                continue;
            }
            let key = (node.clone(), l.clone());
            let first = *i.first_seen.entry(key.clone()).or_insert(now);
            keep.insert(key);
            out.entry(node.clone())
                .or_default()
                .push((l.clone(), now.duration_since(first).as_secs_f64()));
        }
    }
    i.first_seen.retain(|k, _| keep.contains(k));
    out
}

/// The leader's view for `GET /v1/slurm`.
pub fn view(app: &App, beats: &HashMap<String, Beat>) -> SlurmView {
    let orphans = orphaned(app, beats);
    let record = app.store.lock().state.takeovers.clone();
    let i = app.watch.lock();
    let mut node_daemons_down: Vec<String> = beats
        .iter()
        .flat_map(|(node, b)| {
            b.daemons
                .iter()
                .filter(|d| matches!(d.state, DaemonState::Down | DaemonState::Unknown))
                .map(move |d| format!("{node}: {}: {}: {}", d.daemon, d.state.word(), d.message))
        })
        .collect();
    node_daemons_down.sort();
    SlurmView {
        daemons: i.daemons.clone(),
        ctld_heartbeat_age_s: i.ctld_heartbeat_age_s,
        primary_fails: i.trigger.fails(),
        takeover_armed: i.armed,
        takeovers: record
            .last
            .iter()
            .map(|d| TakeoverView {
                at_unix_ms: d.at_ms,
                by: d.by,
                term: d.term,
                backup: d.backup.clone(),
                reason: d.reason.clone(),
                outcome: d.outcome.clone(),
            })
            .collect(),
        takeovers_total: record.total,
        node_daemons_down,
        orphaned: orphans
            .iter()
            .flat_map(|(node, ls)| {
                ls.iter()
                    .map(move |(l, age)| format!("{node}: {l} ({age:.0} s)"))
            })
            .collect(),
    }
}

/// The leader's daemon states for `/metrics`: (daemon, up) for those configured, and the
/// heartbeat file's age.
pub fn metrics(app: &App) -> (Vec<(String, i64)>, Option<f64>, u32) {
    let i = app.watch.lock();
    let up = i
        .daemons
        .iter()
        .filter(|d| d.state != DaemonState::NotConfigured)
        .map(|d| (d.daemon.clone(), i64::from(d.state == DaemonState::Up)))
        .collect();
    (up, i.ctld_heartbeat_age_s, i.trigger.fails())
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONF: &str = "ClusterName=c\n# SlurmctldHost=old\nSlurmctldHost=head1(10.0.0.2)\n\
        slurmctldhost=head2(10.0.0.3)\nSlurmctldPort=6817\nStateSaveLocation=/var/spool/ctld\n\
        Include extra.conf\nNodeName=n1 NodeAddr=10.0.0.9 CPUs=4\n";

    #[test]
    fn conf_parses_hosts_state_and_slurmdbd() {
        let c = parse_conf(CONF);
        assert_eq!(
            c.ctld_hosts,
            vec![
                ("head1".to_string(), Some("10.0.0.2".to_string())),
                ("head2".to_string(), Some("10.0.0.3".to_string()))
            ]
        );
        assert_eq!(c.state_save, Some(PathBuf::from("/var/spool/ctld")));
        assert_eq!(c.slurmdbd, None);
        let c = parse_conf(
            "ControlMachine=h\nAccountingStorageType=accounting_storage/slurmdbd\n\
             AccountingStorageHost=db1 AccountingStoragePort=7031\n",
        );
        assert_eq!(c.slurmdbd.as_deref(), Some("db1:7031"));
        let c = parse_conf("SlurmctldHost=h\nAccountingStorageType=accounting_storage/slurmdbd\n");
        assert_eq!(c.slurmdbd.as_deref(), Some("h:6819"));
    }

    #[test]
    fn slurm_conf_is_read_again_only_when_it_changed_and_bounded() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("slurm.conf");
        std::fs::write(&p, "SlurmctldHost=a\n").unwrap();
        let (first, fresh) = read_conf(None, &p).unwrap();
        assert!(fresh);
        let (again, fresh) = read_conf(Some(&first), &p).unwrap();
        assert!(!fresh, "unchanged: not read again");
        assert_eq!(*again.text, "SlurmctldHost=a\n");
        std::fs::write(&p, "SlurmctldHost=a\nSlurmctldHost=b\n").unwrap();
        let (changed, fresh) = read_conf(Some(&first), &p).unwrap();
        assert!(fresh, "a new length is read");
        assert!(changed.text.contains("=b"));
        let f = std::fs::File::create(&p).unwrap();
        f.set_len(CONF_MAX + 1).unwrap();
        let e = read_conf(Some(&changed), &p).unwrap_err();
        assert!(e.to_string().contains("larger than 4 MiB"), "{e}");
        read_conf(None, &d.path().join("none")).unwrap_err();
    }

    #[test]
    fn each_ping_conf_names_one_controller() {
        let one = conf_for(CONF, 1, Path::new("/etc/slurm"));
        assert!(!one.contains("head1"), "{one}");
        assert!(one.contains("slurmctldhost=head2(10.0.0.3)"), "{one}");
        assert!(one.contains("# SlurmctldHost=old"), "{one}");
        assert!(one.contains("Include /etc/slurm/extra.conf"), "{one}");
        assert!(one.contains("NodeName=n1"), "{one}");
        let zero = conf_for(CONF, 0, Path::new("/etc/slurm"));
        assert!(zero.contains("head1") && !zero.contains("head2"), "{zero}");
    }

    #[test]
    fn leftovers_name_their_job() {
        assert_eq!(leftover_job("scratch 42"), Some("42"));
        assert_eq!(leftover_job("container 0123456789ab job 7"), Some("7"));
        assert_eq!(leftover_job("container 0123456789ab"), None);
        assert_eq!(leftover_job("cgroup 0123456789ab"), None);
        assert_eq!(leftover_job("mount sha256:00"), None);
    }
}
