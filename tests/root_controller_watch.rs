//! Fleet operations on the real Slurm of `integration/slurm/` (issue 17): the daemon watch (an
//! agent's slurmd and munge checks, the leader's slurmctld/slurmdbd checks) seen in
//! `berth cluster status` and `/metrics`; the fast slurmctld takeover on a primary and a backup
//! slurmctld, each on a "head node" of its own (`start.sh --ha`: network and UTS namespaces),
//! with three controllers (head1, head2, and this host as the login node); and the audit of the
//! leftovers of ended jobs against `squeue`.
//!
//! Every process started here is killed by PID when its guard drops; the Slurm cluster (and its
//! namespaces) by stop.sh. Timings are printed; the bounds asserted are far above them and far
//! below what Slurm alone takes (SlurmctldTimeout, 120 s), so a broken takeover fails.

mod common;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::BERTH;
use serde_json::Value;

const KEY: &str = "test-cluster-key-watch-0123456789";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Kills and reaps its process when dropped, with the process group it leads (every `Proc` is
/// spawned as one: a controller killed alone would leave its sinfo or scontrol running, and
/// one in a head node's namespace would keep that namespace alive).
struct Proc {
    child: Child,
}

impl Proc {
    fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).unwrap()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(self.pid()),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = self.child.wait();
    }
}

fn signal(pid: i32, sig: nix::sys::signal::Signal) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig);
}

/// The Slurm test cluster: stopped (stop.sh, by the PIDs in its pid files) when dropped.
struct Slurm {
    state: PathBuf,
    conf: PathBuf,
    nodes: Vec<String>,
    /// start.sh --ha's DIR/etc/ha.env.
    ha: std::collections::BTreeMap<String, String>,
}

impl Drop for Slurm {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(repo().join("integration/slurm/stop.sh"))
            .arg("--state")
            .arg(&self.state)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

fn build_plugin(profile_dir: &Path) -> PathBuf {
    let mut build = Command::new(env!("CARGO"));
    build.args(["build", "-p", "berth-spank"]);
    if profile_dir.file_name().and_then(|n| n.to_str()) == Some("release") {
        build.arg("--release");
    }
    let out = build
        .current_dir(repo())
        .stdin(Stdio::null())
        .output()
        .expect("running cargo");
    assert!(out.status.success(), "building the SPANK plugin: {out:?}");
    profile_dir.join("libspank_berth.so")
}

fn controller_bin() -> PathBuf {
    let bin = Path::new(BERTH).with_file_name("berth-controller");
    let target = Path::new(BERTH).parent().unwrap().parent().unwrap();
    let out = Command::new(env!("CARGO"))
        .args(["build", "-p", "berth-controller"])
        .env("CARGO_TARGET_DIR", target)
        .current_dir(repo())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    bin
}

fn start_slurm(dir: &Path, ha: bool) -> Slurm {
    let berth = PathBuf::from(BERTH);
    let plugin = build_plugin(berth.parent().unwrap());
    let state = dir.join("slurm");
    let port = 23000 + (std::process::id() % 400) * 8;
    let berth_config = dir.join("slurm-berth.toml");
    std::fs::write(
        &berth_config,
        format!(
            "[runtime]\nstate_dir = \"{0}/berth/state\"\n[squashfs]\nmount_dir = \"{0}/berth/images\"\n\
             [scratch]\nroot = \"{0}/berth/scratch\"\n",
            state.display()
        ),
    )
    .unwrap();
    let mut slurm = Slurm {
        conf: state.join("etc/slurm.conf"),
        state: state.clone(),
        nodes: Vec::new(),
        ha: Default::default(),
    };
    let mut cmd = Command::new("bash");
    cmd.arg(repo().join("integration/slurm/start.sh"))
        .arg("--state")
        .arg(&state)
        .args(["--nodes", "1"])
        .arg("--plugin")
        .arg(&plugin)
        .arg("--berth")
        .arg(&berth)
        .arg("--berth-config")
        .arg(&berth_config)
        .arg("--no-prolog")
        .env("BERTH_SLURM_PORT", port.to_string());
    if ha {
        cmd.arg("--ha");
    }
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .expect("running integration/slurm/start.sh");
    assert!(
        out.status.success(),
        "integration/slurm/start.sh failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let names = slurm_out(&slurm.conf, "sinfo", &["-h", "-N", "-o", "%N"]);
    slurm.nodes = names.lines().map(|l| l.trim().to_string()).collect();
    slurm.nodes.dedup();
    if ha {
        let env = std::fs::read_to_string(state.join("etc/ha.env")).unwrap();
        slurm.ha = env
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
    }
    slurm
}

fn slurm_cmd(conf: &Path, cmd: &str, args: &[&str], secs: u32) -> std::process::Output {
    Command::new("timeout")
        .args(["-k", "2", &secs.to_string(), cmd])
        .args(args)
        .env("SLURM_CONF", conf)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn slurm_out(conf: &Path, cmd: &str, args: &[&str]) -> String {
    let out = slurm_cmd(conf, cmd, args, 30);
    assert!(out.status.success(), "{cmd} {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

impl Slurm {
    fn ha(&self, key: &str) -> String {
        self.ha
            .get(key)
            .unwrap_or_else(|| panic!("{key} not in ha.env"))
            .clone()
    }

    fn pid_in(&self, file: &Path) -> i32 {
        std::fs::read_to_string(file)
            .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
            .trim()
            .parse()
            .unwrap()
    }

    /// `squeue` state of a job ("" when squeue does not know it or does not answer).
    fn job_state(&self, job: &str) -> String {
        let out = slurm_cmd(&self.conf, "squeue", &["-h", "-j", job, "-o", "%T"], 5);
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// `scontrol show job`'s StartTime of a job.
    fn start_time(&self, job: &str) -> String {
        let out = slurm_out(&self.conf, "scontrol", &["show", "job", job]);
        out.split_whitespace()
            .find_map(|w| w.strip_prefix("StartTime="))
            .unwrap_or("")
            .to_string()
    }

    fn sbatch(&self, secs: u32, script: &str) -> Option<String> {
        let out = slurm_cmd(
            &self.conf,
            "sbatch",
            &["--parsable", "-o", "/dev/null", "--wrap", script],
            secs,
        );
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn private(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// Waits (bounded) for `cond`; `why()` says what was seen when it times out.
fn wait_for(what: &str, secs: u64, mut cond: impl FnMut() -> bool, why: impl Fn() -> String) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        if cond() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("timed out after {secs} s waiting for {what}: {}", why());
}

fn get(addr: &str, path: &str) -> Option<(u16, String)> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_millis(1500)))
        .http_status_as_error(false)
        .build()
        .into();
    let mut r = agent
        .get(&format!("http://{addr}{path}"))
        .header(
            berth_api::auth::AUTH_HEADER,
            &berth_api::auth::sign_request(&berth_api::auth::Key::new(KEY), "GET", path, b"")
                .unwrap()
                .header,
        )
        .call()
        .ok()?;
    let status = r.status().as_u16();
    Some((status, r.body_mut().read_to_string().ok()?))
}

fn get_json(addr: &str, path: &str) -> Option<Value> {
    match get(addr, path)? {
        (200, body) => serde_json::from_str(&body).ok(),
        _ => None,
    }
}

/// One sample's value in a metrics text, by its full name with labels.
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// A controller: `netns` runs it in a head node's network namespace.
fn controller(
    d: &Path,
    id: u64,
    listen: &str,
    peers: &[String],
    conf: &Path,
    netns: Option<&str>,
) -> Proc {
    let log = std::fs::File::options()
        .create(true)
        .append(true)
        .open(d.join(format!("controller{id}.log")))
        .unwrap();
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(controller_bin());
            c
        }
        None => Command::new(controller_bin()),
    };
    cmd.arg("--config")
        .arg(d.join("controller.toml"))
        .arg("serve")
        .args(["--id", &id.to_string(), "--listen", listen])
        .arg("--data-dir")
        .arg(d.join(format!("data{id}")))
        .arg("--key-file")
        .arg(d.join("key"));
    for p in peers {
        cmd.arg("--peer").arg(p);
    }
    let child = std::os::unix::process::CommandExt::process_group(&mut cmd, 0)
        .env("SLURM_CONF", conf)
        .env("BERTH_CONTROLLER_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    Proc { child }
}

fn key(d: &Path) {
    write(&d.join("key"), &format!("{KEY}\n"));
    private(&d.join("key"));
}

fn logs(d: &Path) -> String {
    let mut out = String::new();
    for i in 1..=3 {
        if let Ok(t) = std::fs::read_to_string(d.join(format!("controller{i}.log"))) {
            let tail: Vec<&str> = t.lines().rev().take(15).collect();
            out.push_str(&format!(
                "\n--- controller{i}.log (last lines, newest first):\n{}",
                tail.join("\n")
            ));
        }
    }
    out
}

/// `berth --config CONFIG cluster ARGS`: its stdout.
fn cluster_cli(config: &Path, args: &[&str]) -> String {
    let out = Command::new(BERTH)
        .arg("--config")
        .arg(config)
        .arg("cluster")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The node's daemon state as the leader's `/v1/nodes` has it.
fn node_daemon(addr: &str, node: &str, daemon: &str) -> Option<String> {
    let nodes = get_json(addr, "/v1/nodes")?;
    nodes.as_array()?.iter().find(|n| n["node"] == node)?["daemons"]
        .as_array()?
        .iter()
        .find(|d| d["daemon"] == daemon)
        .map(|d| d["state"].as_str().unwrap_or("").to_string())
}

/// The agent's configuration: slurmd's pid file and munged's socket of the test cluster, its
/// own state and store under `d`, nothing of the host's.
fn agent_config(d: &Path, slurm: &Slurm, addr: &str, node: &str, interval_ms: u64) -> PathBuf {
    let host = d.join("host");
    write(&host.join("sys/devices/system/cpu/online"), "0-1\n");
    write(&host.join("sys/devices/system/node/node0/cpulist"), "0-1\n");
    let path = d.join("agent.toml");
    write(
        &path,
        &format!(
            "[topology]\nhost_root = \"{host}\"\n\
             [runtime]\nstate_dir = \"{d}/agent-run\"\n[store]\nroot = \"{d}/agent-store\"\n\
             [scratch]\nroot = \"{d}/agent-scratch\"\n[cgroup]\nroot = \"{d}/agent-cgroup\"\n\
             [squashfs]\nmount_dir = \"{d}/agent-images\"\n\
             [agent]\ncontrollers = [\"{addr}\"]\nkey_file = \"{d}/key\"\ninterval_ms = {interval_ms}\n\
             check_interval_ms = 200\nmetrics_listen = \"\"\nnode_name = \"{node}\"\n\
             slurmd_pid_file = \"{s}/run/slurmd-{node}.pid\"\nmunge_socket = \"{s}/munge/munge.socket\"\n",
            host = host.display(),
            d = d.display(),
            s = slurm.state.display(),
        ),
    );
    path
}

fn agent(config: &Path, conf: &Path) -> Proc {
    let mut cmd = Command::new(BERTH);
    let child = std::os::unix::process::CommandExt::process_group(&mut cmd, 0)
        .arg("--config")
        .arg(config)
        .arg("agent")
        .env("SLURM_CONF", conf)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    Proc { child }
}

fn munged(slurm: &Slurm) {
    let m = slurm.state.join("munge");
    let out = Command::new("runuser")
        .args(["-u", "munge", "--", "munged", "--force"])
        .arg(format!("--socket={}", m.join("munge.socket").display()))
        .arg(format!("--key-file={}", m.join("munge.key").display()))
        .arg(format!("--pid-file={}", m.join("munged.pid").display()))
        .arg(format!("--log-file={}", m.join("munged.log").display()))
        .arg(format!("--seed-file={}", m.join("munged.seed").display()))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "restarting munged: {out:?}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn daemon_watch_shows_a_stopped_munged_or_slurmd_within_two_heartbeats_and_clears() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let slurm = start_slurm(d, false);
    let node = slurm.nodes[0].clone();
    key(d);
    let addr = format!("127.0.0.1:{}", free_port());
    write(
        &d.join("controller.toml"),
        "[controller]\nwatch_interval_ms = 300\n",
    );
    let _c = controller(d, 1, &addr, &[], &slurm.conf, None);
    let interval_ms = 2000;
    let config = agent_config(d, &slurm, &addr, &node, interval_ms);
    let _agent = agent(&config, &slurm.conf);
    let status = || cluster_cli(&config, &["status"]);
    let seen = || format!("status:\n{}{}", status(), logs(d));

    wait_for(
        "slurmd and munge up, slurmctld up, no backup, no slurmdbd",
        30,
        || {
            let s = status();
            node_daemon(&addr, &node, "munge").as_deref() == Some("up")
                && node_daemon(&addr, &node, "slurmd").as_deref() == Some("up")
                && s.contains("slurmctld:  up")
                && s.contains("slurmctld-backup: not configured")
                && s.contains("slurmdbd:   not configured")
        },
        seen,
    );
    let metrics = || get(&addr, "/metrics").map(|m| m.1).unwrap_or_default();
    let node_up = |daemon: &str| {
        metric(
            &metrics(),
            &format!("berth_controller_node_daemon_up{{node=\"{node}\",daemon=\"{daemon}\"}}"),
        )
    };
    assert_eq!(node_up("munge"), Some(1.0), "{}", metrics());
    assert_eq!(
        metric(
            &metrics(),
            "berth_controller_slurm_daemon_up{daemon=\"slurmctld\"}"
        ),
        Some(1.0)
    );
    // Not configured is no sample at all: no alert can mistake it for down.
    assert!(!metrics().contains("daemon=\"slurmdbd\""), "{}", metrics());

    // munged stops: down in status and metrics within two heartbeat intervals.
    let munged_pid = slurm.pid_in(&slurm.state.join("munge/munged.pid"));
    let t = Instant::now();
    signal(munged_pid, nix::sys::signal::Signal::SIGTERM);
    wait_for(
        "munge down in status and metrics",
        30,
        || status().contains(&format!("{node}: munge: down")) && node_up("munge") == Some(0.0),
        seen,
    );
    let took = t.elapsed();
    println!(
        "munged stopped: seen in `berth cluster status` and /metrics after {:.2} s (heartbeat interval {:.1} s)",
        took.as_secs_f64(),
        interval_ms as f64 / 1000.0
    );
    assert!(
        took < Duration::from_millis(2 * interval_ms),
        "seen after {took:?}, more than two heartbeats"
    );
    munged(&slurm);
    wait_for(
        "munge up again",
        30,
        || !status().contains("munge: down") && node_up("munge") == Some(1.0),
        seen,
    );

    // slurmd stops likewise.
    let slurmd_pid = slurm.pid_in(&slurm.state.join(format!("run/slurmd-{node}.pid")));
    let t = Instant::now();
    signal(slurmd_pid, nix::sys::signal::Signal::SIGTERM);
    wait_for(
        "slurmd down in status and metrics",
        30,
        || status().contains(&format!("{node}: slurmd: down")) && node_up("slurmd") == Some(0.0),
        seen,
    );
    let took = t.elapsed();
    println!(
        "slurmd stopped: seen after {:.2} s (heartbeat interval {:.1} s)",
        took.as_secs_f64(),
        interval_ms as f64 / 1000.0
    );
    assert!(
        took < Duration::from_millis(2 * interval_ms),
        "seen after {took:?}, more than two heartbeats"
    );
    let out = Command::new("slurmd")
        .arg("-f")
        .arg(&slurm.conf)
        .args(["-N", &node])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "restarting slurmd: {out:?}");
    wait_for(
        "slurmd up again",
        30,
        || !status().contains("slurmd: down") && node_up("slurmd") == Some(1.0),
        seen,
    );
    assert!(
        status().contains("slurmd and munge up on every node"),
        "{}",
        seen()
    );
}

/// A container record whose berth died (its owner pid is no process), of job `job` if any.
fn dead_container(state_dir: &Path, id: &str, job: Option<&str>) {
    use std::os::unix::fs::PermissionsExt;
    let dir = state_dir.join(id);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(state_dir, std::fs::Permissions::from_mode(0o711)).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    let labels = match job {
        Some(j) => format!("{{\"job\":\"{j}\",\"uid\":\"0\"}}"),
        None => "{\"uid\":\"0\"}".to_string(),
    };
    std::fs::write(
        dir.join("state.json"),
        format!(
            "{{\"id\":\"{id}\",\"owner_pid\":4194000,\"owner_start\":1,\"cgroup\":\"/nonexistent\",\
             \"init_pid\":0,\"labels\":{labels}}}"
        ),
    )
    .unwrap();
    std::fs::set_permissions(
        dir.join("state.json"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn leftovers_of_ended_jobs_per_squeue_show_as_gauges_and_in_status() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let slurm = start_slurm(d, false);
    let node = slurm.nodes[0].clone();
    key(d);
    let addr = format!("127.0.0.1:{}", free_port());
    write(
        &d.join("controller.toml"),
        "[controller]\nwatch_interval_ms = 300\naudit_interval_s = 1\n",
    );
    let _c = controller(d, 1, &addr, &[], &slurm.conf, None);
    // A running job, and leftovers: a dead container of that job (not yet a leftover of an
    // ended job), one of no job, and the scratch of a job that ended long ago.
    let job = slurm.sbatch(30, "sleep 600").expect("sbatch");
    wait_for(
        "the job running",
        30,
        || slurm.job_state(&job) == "RUNNING",
        || slurm.job_state(&job),
    );
    dead_container(&d.join("agent-run"), "0123456789ab", Some(&job));
    dead_container(&d.join("agent-run"), "ba9876543210", None);
    std::fs::create_dir_all(d.join("agent-scratch/999999")).unwrap();
    let config = agent_config(d, &slurm, &addr, &node, 500);
    let _agent = agent(&config, &slurm.conf);
    let status = || cluster_cli(&config, &["status"]);
    let seen = || {
        format!(
            "status:\n{}\nnodes: {:?}{}",
            status(),
            get_json(&addr, "/v1/nodes"),
            logs(d)
        )
    };
    let orphaned = || {
        get(&addr, "/metrics").and_then(|(_, m)| {
            metric(
                &m,
                &format!("berth_controller_leftovers_orphaned{{node=\"{node}\"}}"),
            )
        })
    };
    wait_for(
        "two leftovers of ended jobs (the container of no job, the old scratch)",
        30,
        || orphaned() == Some(2.0),
        seen,
    );
    let s = status();
    assert!(s.contains("leftovers:  2 of ended jobs"), "{}", seen());
    assert!(s.contains("scratch 999999"), "{s}");
    assert!(s.contains("container ba9876543210"), "{s}");
    assert!(!s.contains("container 0123456789ab"), "{s}");
    // The agent reported all three; the leader held back the one whose job squeue still runs.
    let nodes = get_json(&addr, "/v1/nodes").unwrap();
    let left = nodes[0]["leftovers"].as_array().unwrap();
    assert!(
        left.iter()
            .any(|l| l == &Value::String(format!("container 0123456789ab job {job}"))),
        "{nodes}"
    );
    // The job ends: the leader sees it in squeue (the agent gathers again only in a minute).
    slurm_out(&slurm.conf, "scancel", &[&job]);
    wait_for(
        "the container of the cancelled job counted",
        30,
        || orphaned() == Some(3.0),
        seen,
    );
    assert!(
        status().contains(&format!("container 0123456789ab job {job}")),
        "{}",
        seen()
    );
    let age = get(&addr, "/metrics")
        .and_then(|(_, m)| {
            metric(
                &m,
                &format!("berth_controller_leftover_age_seconds{{node=\"{node}\"}}"),
            )
        })
        .unwrap();
    assert!(age > 0.0, "{age}");
}

/// The persist alert on leftovers (and the daemon alerts) fire after their configured time:
/// `promtool test rules` on configs/berth-alerts.test.yml.
#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn alert_rules_pass_their_promtool_tests() {
    let out = Command::new("promtool")
        .args(["test", "rules"])
        .arg(repo().join("configs/berth-alerts.test.yml"))
        .current_dir(repo().join("configs"))
        .stdin(Stdio::null())
        .output()
        .expect("promtool (integration/setup.sh extracts it from Debian's prometheus package)");
    assert!(
        out.status.success(),
        "promtool test rules: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Three controllers on the two head nodes and this host (the login node), reading the HA
/// cluster's slurm.conf.
struct Controllers {
    addrs: Vec<String>,
    netns: Vec<Option<String>>,
    peers: Vec<String>,
    procs: Vec<Option<Proc>>,
}

impl Controllers {
    fn start(d: &Path, slurm: &Slurm) -> Self {
        key(d);
        write(
            &d.join("controller.toml"),
            "[controller]\nwatch_interval_ms = 1000\nping_timeout_ms = 1000\ntakeover_after = 3\n",
        );
        let port = free_port();
        let addrs = vec![
            format!("{}:{port}", slurm.ha("HA_ADDR1")),
            format!("{}:{port}", slurm.ha("HA_ADDR2")),
            format!("{}:{port}", slurm.ha("HA_HOST_ADDR")),
        ];
        let netns = vec![
            Some(slurm.ha("HA_NETNS1")),
            Some(slurm.ha("HA_NETNS2")),
            None,
        ];
        let peers: Vec<String> = addrs
            .iter()
            .enumerate()
            .map(|(i, a)| format!("{}={a}", i + 1))
            .collect();
        let mut c = Self {
            addrs,
            netns,
            peers,
            procs: Vec::new(),
        };
        for i in 0..3 {
            let p = c.spawn(d, slurm, i);
            c.procs.push(Some(p));
        }
        c
    }

    fn spawn(&self, d: &Path, slurm: &Slurm, i: usize) -> Proc {
        controller(
            d,
            i as u64 + 1,
            &self.addrs[i],
            &self.peers,
            &slurm.conf,
            self.netns[i].as_deref(),
        )
    }

    /// The index of the controller every live one agrees leads.
    fn leader(&self, d: &Path) -> usize {
        let mut found = None;
        wait_for(
            "a leader all live controllers agree on",
            30,
            || {
                let ls: Vec<Option<u64>> = (0..3)
                    .filter(|i| self.procs[*i].is_some())
                    .map(|i| {
                        get_json(&self.addrs[i], "/v1/status").and_then(|s| s["leader"].as_u64())
                    })
                    .collect();
                found = ls[0].filter(|l| ls.iter().all(|x| *x == Some(*l)));
                found.is_some_and(|l| {
                    self.procs
                        .get(usize::try_from(l).unwrap() - 1)
                        .is_some_and(Option::is_some)
                })
            },
            || logs(d),
        );
        usize::try_from(found.unwrap()).unwrap() - 1
    }

    /// Makes controller 0 (head1's) the leader: the leader is stopped until the other two have
    /// elected one of themselves, then started again, until controller 0 is the one elected.
    /// (Restarted at once, a leader whose vote was committed resumes leading its term before the
    /// followers have noticed it was gone.)
    fn leader_on_head1(&mut self, d: &Path, slurm: &Slurm) {
        for _ in 0..20 {
            let l = self.leader(d);
            if l == 0 {
                return;
            }
            println!(
                "controller {} leads; stopping it until another is elected",
                l + 1
            );
            self.procs[l] = None;
            let next = self.leader(d);
            let p = self.spawn(d, slurm, l);
            self.procs[l] = Some(p);
            if next == 0 {
                // Wait until the restarted one follows, so that a quorum stays after head1 dies.
                assert_eq!(self.leader(d), 0, "{}", logs(d));
                return;
            }
        }
        panic!("controller 1 never became the leader{}", logs(d));
    }

    fn slurm_view(&self, d: &Path) -> Value {
        let l = self.leader(d);
        get_json(&self.addrs[l], "/v1/slurm").unwrap_or(Value::Null)
    }
}

/// A running job whose start slurmctld has saved (a kill -9 loses what it had not written to
/// StateSaveLocation yet; a job started a moment before would be started again).
fn running_saved_job(slurm: &Slurm) -> (String, String) {
    let job = slurm.sbatch(30, "sleep 600").expect("sbatch");
    wait_for(
        "the running job",
        30,
        || slurm.job_state(&job) == "RUNNING",
        || slurm.job_state(&job),
    );
    // slurmctld saves job state a little after a change; a kill -9 before that loses the start.
    // The start may have been saved before it was seen here, with no change after it to save
    // again: a change made now (a comment) makes a save that surely holds the running job.
    slurm_out(
        &slurm.conf,
        "scontrol",
        &["update", &format!("jobid={job}"), "comment=saved"],
    );
    let seen = std::time::SystemTime::now();
    let state = slurm.state.join("ctld/job_state");
    wait_for(
        "slurmctld saving the running job",
        30,
        || {
            std::fs::metadata(&state)
                .and_then(|m| m.modified())
                .is_ok_and(|m| m > seen)
        },
        || format!("{}", state.display()),
    );
    let start = slurm.start_time(&job);
    (job, start)
}

/// Kills the primary slurmctld (and `also`, a controller, at the same moment); returns the
/// seconds until a new sbatch was accepted and until that job ran.
fn kill_and_measure(slurm: &Slurm, also: Option<Proc>) -> (f64, f64, String) {
    let pid = slurm.pid_in(Path::new(&slurm.ha("HA_PIDFILE1")));
    let t = Instant::now();
    signal(pid, nix::sys::signal::Signal::SIGKILL);
    drop(also);
    // A client that reaches the backup before it took over sleeps SlurmctldTimeout/2 before
    // trying again (Slurm's rule); each try here is bounded to 1 s instead, as a user would retry.
    let mut job = None;
    while t.elapsed() < Duration::from_secs(90) {
        job = slurm.sbatch(1, "sleep 300");
        if job.is_some() {
            break;
        }
    }
    let job = job.expect("sbatch accepted within 90 s of the kill");
    let accepted = t.elapsed().as_secs_f64();
    while t.elapsed() < Duration::from_secs(120) && slurm.job_state(&job) != "RUNNING" {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        slurm.job_state(&job),
        "RUNNING",
        "the job after the takeover"
    );
    (accepted, t.elapsed().as_secs_f64(), job)
}

fn assert_takeover_recorded(c: &Controllers, d: &Path) -> Value {
    let done = |v: &Value| {
        v["takeovers"]
            .as_array()
            .and_then(|t| t.last())
            .is_some_and(|t| t["outcome"].as_str().is_some())
    };
    wait_for(
        "the takeover committed with its reason and outcome",
        30,
        || done(&c.slurm_view(d)),
        || format!("{}{}", c.slurm_view(d), logs(d)),
    );
    let view = c.slurm_view(d);
    let t = view["takeovers"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert!(
        t["reason"].as_str().unwrap().contains("pings in a row"),
        "{t}"
    );
    assert!(t["outcome"].as_str().unwrap().contains("took over"), "{t}");
    assert_eq!(view["takeovers_total"], 1, "{view}");
    // Every controller applied the same committed record.
    let hashes: Vec<Value> = (0..3)
        .filter(|i| c.procs[*i].is_some())
        .filter_map(|i| get_json(&c.addrs[i], "/v1/status").map(|s| s["state_hash"].clone()))
        .collect();
    assert!(hashes.windows(2).all(|w| w[0] == w[1]), "{hashes:?}");
    t
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn takeover_after_kill_9_of_the_primary_and_none_for_a_short_sigstop() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let slurm = start_slurm(d, true);
    let c = Controllers::start(d, &slurm);
    let leader = c.leader(d);
    wait_for(
        "both slurmctld up in the leader's view, takeover armed",
        30,
        || {
            let v = c.slurm_view(d);
            v["takeover_armed"] == true
                && v["daemons"][0]["state"] == "up"
                && v["daemons"][1]["state"] == "up"
        },
        || format!("{}{}", c.slurm_view(d), logs(d)),
    );
    assert!(c.slurm_view(d)["ctld_heartbeat_age_s"].is_number());
    let (running, started) = running_saved_job(&slurm);

    // Only slow: stopped for less than the threshold (3 pings, 1 s apart), then continued.
    let primary = slurm.pid_in(Path::new(&slurm.ha("HA_PIDFILE1")));
    signal(primary, nix::sys::signal::Signal::SIGSTOP);
    std::thread::sleep(Duration::from_millis(1500));
    signal(primary, nix::sys::signal::Signal::SIGCONT);
    std::thread::sleep(Duration::from_secs(5));
    let v = c.slurm_view(d);
    assert_eq!(
        v["takeovers_total"], 0,
        "a slow primary was taken over: {v}"
    );
    assert_eq!(v["daemons"][0]["state"], "up", "{v}");
    let ping = slurm_out(&slurm.conf, "scontrol", &["ping"]);
    assert!(
        ping.contains("(primary) at") && ping.contains("is UP"),
        "{ping}"
    );

    let (accepted, ran, _) = kill_and_measure(&slurm, None);
    println!(
        "kill -9 of the primary slurmctld (controller leader {} untouched): sbatch accepted after \
         {accepted:.1} s, the new job running after {ran:.1} s (Slurm alone: SlurmctldTimeout, \
         120 s; bench/takeover/run.sh measures it)",
        leader + 1
    );
    let t = assert_takeover_recorded(&c, d);
    println!("takeover record: {t}");
    // Far below Slurm's own 120 s: the backup took over because the leader told it to.
    assert!(ran < 60.0, "the job ran only after {ran:.1} s");
    // The job that ran before is untouched: still running, started when it started.
    assert_eq!(slurm.job_state(&running), "RUNNING");
    assert_eq!(slurm.start_time(&running), started);
    let status = cluster_cli(
        &{
            let p = d.join("cli.toml");
            write(
                &p,
                &format!(
                    "[agent]\ncontrollers = [\"{}\"]\nkey_file = \"{}\"\n",
                    c.addrs[2],
                    d.join("key").display()
                ),
            );
            p
        },
        &["status"],
    );
    assert!(status.contains("takeovers:  1"), "{status}");
    assert!(status.contains("failed 3 pings in a row"), "{status}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn takeover_when_the_primary_and_the_controller_leader_on_its_head_node_die_together() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let slurm = start_slurm(d, true);
    let mut c = Controllers::start(d, &slurm);
    c.leader_on_head1(d, &slurm);
    wait_for(
        "takeover armed",
        30,
        || c.slurm_view(d)["takeover_armed"] == true,
        || logs(d),
    );
    let (running, started) = running_saved_job(&slurm);
    // head1 dies: its slurmctld and its controller, the Raft leader, at the same moment.
    let leader = c.procs[0].take();
    let (accepted, ran, _) = kill_and_measure(&slurm, leader);
    println!(
        "kill -9 of the primary slurmctld and of the controller leader on its head node: sbatch \
         accepted after {accepted:.1} s, the new job running after {ran:.1} s"
    );
    let t = assert_takeover_recorded(&c, d);
    assert_ne!(t["by"], 1, "the dead leader cannot have decided it: {t}");
    println!("takeover record: {t}");
    assert!(ran < 60.0, "the job ran only after {ran:.1} s");
    assert_eq!(slurm.job_state(&running), "RUNNING");
    assert_eq!(slurm.start_time(&running), started);
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_leader_without_quorum_takes_nothing_over_until_the_quorum_is_back() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let slurm = start_slurm(d, true);
    let c = Controllers::start(d, &slurm);
    wait_for(
        "takeover armed",
        30,
        || c.slurm_view(d)["takeover_armed"] == true,
        || logs(d),
    );
    let leader = c.leader(d);
    // The leader's two peers stop: it is a minority of one.
    let others: Vec<i32> = (0..3)
        .filter(|i| *i != leader)
        .map(|i| c.procs[i].as_ref().unwrap().pid())
        .collect();
    for p in &others {
        signal(*p, nix::sys::signal::Signal::SIGSTOP);
    }
    let primary = slurm.pid_in(Path::new(&slurm.ha("HA_PIDFILE1")));
    signal(primary, nix::sys::signal::Signal::SIGKILL);
    // Many more failed pings than the threshold: still no takeover, none committed.
    std::thread::sleep(Duration::from_secs(10));
    let backup_log = std::fs::read_to_string(slurm.ha("HA_LOG2")).unwrap_or_default();
    let took = backup_log.contains("REQUEST_TAKEOVER");
    for p in &others {
        signal(*p, nix::sys::signal::Signal::SIGCONT);
    }
    assert!(
        !took,
        "a leader without quorum ran scontrol takeover:\n{backup_log}{}",
        logs(d)
    );
    // The quorum is back: the takeover follows, committed.
    let t = assert_takeover_recorded(&c, d);
    println!("takeover once the quorum was back: {t}");
    assert!(
        std::fs::read_to_string(slurm.ha("HA_LOG2"))
            .unwrap_or_default()
            .contains("REQUEST_TAKEOVER")
    );
}
