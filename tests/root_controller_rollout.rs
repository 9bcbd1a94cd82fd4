//! Rolling maintenance driven by the controller (issue 31) against the real Slurm of
//! `integration/slurm/` (`start.sh --nodes 4`, four slurmd on this host), one real `berth
//! agent` per node and real `berth-controller`s (one, or three on loopback). Each node's
//! "upgrade" is a script the test writes: it logs when it starts and ends (with the jobs squeue
//! shows on its node), and fails on the nodes the test marks. What is asserted is what the
//! log, `sinfo -R` and `berth cluster rollout status` show: at most one node out at a time, a
//! job never killed and delaying only its node, a failure stopping the rollout with its reason
//! and touching no other node, pause/resume/abort, an admin's drain skipped, a command killed
//! midway counted failed, a reboot done by its new boot id, and a leader killed mid-rollout
//! with no node run twice.
//!
//! Every process started here is killed by PID when its guard drops (the Slurm cluster is
//! stopped by stop.sh); none inherits the test's stdout or stderr. Jobs run as the test user.

mod common;

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{BERTH, berth_bin, test_user};
use serde_json::Value;

const KEY: &str = "test-cluster-key-rollout-0123456789";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Kills and reaps its process when dropped.
struct Proc {
    child: Child,
}

impl Proc {
    fn kill(&mut self) {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.child.id()).unwrap());
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The Slurm test cluster: stopped (stop.sh, by the PIDs in its pid files) when dropped.
struct Slurm {
    state: PathBuf,
    conf: PathBuf,
    nodes: Vec<String>,
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

/// The controller under test: `$BERTH_TEST_CONTROLLER_BIN`, else the one built next to berth.
fn controller_bin() -> PathBuf {
    if let Ok(b) = std::env::var("BERTH_TEST_CONTROLLER_BIN") {
        return PathBuf::from(b);
    }
    let bin = Path::new(BERTH).with_file_name("berth-controller");
    if !bin.exists() {
        let target = Path::new(BERTH).parent().unwrap().parent().unwrap();
        let out = Command::new(env!("CARGO"))
            .args(["build", "-p", "berth-controller"])
            .env("CARGO_TARGET_DIR", target)
            .current_dir(repo())
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
    }
    bin
}

/// Four slurmd; `slot` keeps the ports of this file's tests apart from each other's.
fn start_slurm(dir: &Path, slot: u32) -> Slurm {
    let berth = PathBuf::from(BERTH);
    let plugin = build_plugin(berth.parent().unwrap());
    let state = dir.join("slurm");
    let port = 24000 + (std::process::id() % 200) * 24 + slot * 6;
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
    };
    let out = Command::new("bash")
        .arg(repo().join("integration/slurm/start.sh"))
        .arg("--state")
        .arg(&state)
        .args(["--nodes", "4"])
        .arg("--plugin")
        .arg(&plugin)
        .arg("--berth")
        .arg(&berth)
        .arg("--berth-config")
        .arg(&berth_config)
        .arg("--no-prolog")
        .env("BERTH_SLURM_PORT", port.to_string())
        .stdin(Stdio::null())
        .output()
        .expect("running integration/slurm/start.sh");
    assert!(
        out.status.success(),
        "integration/slurm/start.sh --nodes 4 failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let names = slurm_out(&slurm.conf, "sinfo", &["-h", "-N", "-o", "%N"]);
    slurm.nodes = names.lines().map(|l| l.trim().to_string()).collect();
    slurm.nodes.sort();
    slurm.nodes.dedup();
    assert_eq!(slurm.nodes.len(), 4, "{names}");
    slurm
}

fn slurm_out(conf: &Path, cmd: &str, args: &[&str]) -> String {
    let out = Command::new("timeout")
        .args(["-k", "5", "30", cmd])
        .args(args)
        .env("SLURM_CONF", conf)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "{cmd} {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

impl Slurm {
    /// `sinfo -R`: node → reason.
    fn reasons(&self) -> BTreeMap<String, String> {
        slurm_out(&self.conf, "sinfo", &["-R", "-N", "-h", "-o", "%N|%E"])
            .lines()
            .filter_map(|l| l.split_once('|'))
            .map(|(n, r)| (n.trim().to_string(), r.trim().to_string()))
            .collect()
    }

    fn state(&self, node: &str) -> String {
        slurm_out(&self.conf, "sinfo", &["-h", "-N", "-n", node, "-o", "%T"])
            .lines()
            .next()
            .unwrap_or("")
            .trim()
            .to_string()
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
    std::fs::write(path, text).unwrap();
}

fn executable(path: &Path, text: &str) {
    write(path, text);
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// Waits (bounded) for `cond`; `why()` says what was seen.
fn wait_for(what: &str, secs: u64, mut cond: impl FnMut() -> bool, why: impl Fn() -> String) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        if cond() {
            return;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    panic!("timed out after {secs} s waiting for {what}: {}", why());
}

/// The test's cluster: Slurm, controllers, agents, the upgrade script and its log.
// Fields drop in this order: the agents and controllers, then Slurm (stop.sh reads the pid
// files under `dir`), then `dir` itself, last.
struct Rig {
    controllers: Vec<Option<Proc>>,
    agents: BTreeMap<String, Proc>,
    slurm: Slurm,
    addrs: Vec<String>,
    /// Copies of the binaries under test: a build of the shared target directory replacing
    /// them meanwhile changes nothing here.
    berth: PathBuf,
    controller_bin: PathBuf,
    dir: tempfile::TempDir,
}

impl Rig {
    fn new(controllers: usize, slot: u32) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let slurm = start_slurm(d, slot);
        write(&d.join("key"), &format!("{KEY}\n"));
        std::fs::set_permissions(d.join("key"), std::fs::Permissions::from_mode(0o600)).unwrap();
        let addrs: Vec<String> = (0..controllers)
            .map(|_| format!("127.0.0.1:{}", free_port()))
            .collect();
        // The upgrade: logs its start (with the jobs on its node) and end; fails where marked;
        // sleeps as long as `sleep` says.
        executable(
            &d.join("upgrade.sh"),
            &format!(
                "#!/bin/sh\nd={d}\njobs=$(squeue -h -w \"$BERTH_NODE\" -o %A | wc -l)\n\
                 echo \"start $BERTH_NODE $BERTH_ROLLOUT jobs=$jobs $(date +%s.%N)\" >> $d/runs.log\n\
                 echo \"upgrading slurmd on $BERTH_NODE\"\n\
                 if [ -e $d/fail-$BERTH_NODE ]; then\n\
                   echo \"dpkg: error processing package slurmd\" >&2\n\
                   echo \"end $BERTH_NODE $BERTH_ROLLOUT failed $(date +%s.%N)\" >> $d/runs.log\n\
                   exit 7\nfi\n\
                 sleep $(cat $d/sleep 2>/dev/null || echo 1)\n\
                 echo \"end $BERTH_NODE $BERTH_ROLLOUT ok $(date +%s.%N)\" >> $d/runs.log\n",
                d = d.display()
            ),
        );
        let berth = d.join("berth");
        std::fs::copy(berth_bin(), &berth).unwrap();
        let controller = d.join("berth-controller");
        std::fs::copy(controller_bin(), &controller).unwrap();
        let mut rig = Self {
            dir,
            slurm,
            addrs,
            controllers: Vec::new(),
            agents: BTreeMap::new(),
            berth,
            controller_bin: controller,
        };
        for i in 0..controllers {
            let p = rig.controller(i);
            rig.controllers.push(Some(p));
        }
        for n in rig.slurm.nodes.clone() {
            let a = rig.agent(&n);
            rig.agents.insert(n, a);
        }
        rig
    }

    fn d(&self) -> &Path {
        self.dir.path()
    }

    fn controller(&self, i: usize) -> Proc {
        let d = self.d();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(d.join(format!("controller-{}.log", i + 1)))
            .unwrap();
        let mut cmd = Command::new(&self.controller_bin);
        cmd.arg("serve")
            .args(["--id", &(i + 1).to_string(), "--listen", &self.addrs[i]])
            .args(["--reconcile-interval-ms", "200"])
            .arg("--data-dir")
            .arg(d.join(format!("data-{}", i + 1)))
            .arg("--key-file")
            .arg(d.join("key"))
            .args(["--sinfo", "sinfo", "--scontrol", "scontrol"])
            .env("SLURM_CONF", &self.slurm.conf)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        if self.addrs.len() > 1 {
            for (j, a) in self.addrs.iter().enumerate() {
                cmd.arg("--peer").arg(format!("{}={a}", j + 1));
            }
        }
        Proc {
            child: cmd.spawn().unwrap(),
        }
    }

    /// Node `node`'s agent configuration: its own host tree, record directory and boot id
    /// file, the test cluster's slurmd pid file and munge socket, the reboot a script.
    fn agent_config(&self, node: &str) -> PathBuf {
        let d = self.d();
        let host = d.join(format!("host-{node}"));
        write(&host.join("sys/devices/system/cpu/online"), "0-1\n");
        write(&host.join("sys/devices/system/node/node0/cpulist"), "0-1\n");
        let boot = d.join(format!("boot-{node}"));
        if !boot.exists() {
            write(&boot, "11111111-1111-1111-1111-111111111111\n");
        }
        executable(
            &d.join(format!("reboot-{node}.sh")),
            &format!(
                "#!/bin/sh\necho \"reboot {node} $(date +%s.%N)\" >> {d}/runs.log\n\
                 cat /proc/sys/kernel/random/uuid > {boot}\n",
                d = d.display(),
                boot = boot.display()
            ),
        );
        let controllers: Vec<String> = self.addrs.iter().map(|a| format!("\"{a}\"")).collect();
        let path = d.join(format!("agent-{node}.toml"));
        write(
            &path,
            &format!(
                "[topology]\nhost_root = \"{host}\"\n\
                 [runtime]\nstate_dir = \"{d}/agent-run\"\n[store]\nroot = \"{d}/agent-store\"\n\
                 [scratch]\nroot = \"{d}/agent-scratch\"\n\
                 [agent]\ncontrollers = [{c}]\nkey_file = \"{d}/key\"\ninterval_ms = 300\n\
                 check_interval_ms = 100\nmetrics_listen = \"\"\nnode_name = \"{node}\"\n\
                 slurmd_pid_file = \"{s}/run/slurmd-{node}.pid\"\nmunge_socket = \"{s}/munge/munge.socket\"\n\
                 rollout_dir = \"{d}/rollout-{node}\"\nboot_id_file = \"{boot}\"\n\
                 reboot_command = \"{d}/reboot-{node}.sh\"\n",
                host = host.display(),
                c = controllers.join(", "),
                d = d.display(),
                s = self.slurm.state.display(),
                boot = boot.display(),
            ),
        );
        path
    }

    fn agent(&self, node: &str) -> Proc {
        let config = self.agent_config(node);
        let log = std::fs::File::create(self.d().join(format!("agent-{node}.log"))).unwrap();
        Proc {
            child: Command::new(&self.berth)
                .arg("--config")
                .arg(config)
                .arg("agent")
                .env("SLURM_CONF", &self.slurm.conf)
                .env("BERTH_LOG", "warn")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .unwrap(),
        }
    }

    /// `berth cluster ARGS` as the admin (root), through the first node's configuration.
    fn cli(&self, args: &[&str]) -> Output {
        Command::new(&self.berth)
            .arg("--config")
            .arg(self.d().join(format!("agent-{}.toml", self.slurm.nodes[0])))
            .arg("cluster")
            .args(args)
            .env("SLURM_CONF", &self.slurm.conf)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    fn cli_ok(&self, args: &[&str]) -> String {
        let out = self.cli(args);
        assert!(
            out.status.success(),
            "berth cluster {args:?}: {out:?}\n{}",
            self.seen()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn status(&self) -> Option<Value> {
        let out = self.cli(&["rollout", "status", "--json"]);
        out.status
            .success()
            .then(|| serde_json::from_slice(&out.stdout).ok())
            .flatten()
    }

    /// Waits for the last rollout to reach `state`; returns its status.
    fn wait_state(&self, state: &str, secs: u64) -> Value {
        let mut last = None;
        wait_for(
            &format!("the rollout {state}"),
            secs,
            || {
                last = self.status();
                last.as_ref().is_some_and(|s| s["state"] == state)
            },
            || self.seen(),
        );
        last.unwrap()
    }

    fn log(&self) -> Vec<String> {
        std::fs::read_to_string(self.d().join("runs.log"))
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// The upgrade's starts, as (node, rollout).
    fn starts(&self) -> Vec<(String, String)> {
        self.log()
            .iter()
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                (f.first() == Some(&"start")).then(|| (f[1].to_string(), f[2].to_string()))
            })
            .collect()
    }

    fn seen(&self) -> String {
        let d = self.d();
        let mut s = format!(
            "runs.log:\n{}\nsinfo -R: {:?}\nstatus: {}\n",
            self.log().join("\n"),
            self.slurm.reasons(),
            String::from_utf8_lossy(&self.cli(&["rollout", "status"]).stdout)
        );
        for i in 0..self.addrs.len() {
            let log = std::fs::read_to_string(d.join(format!("controller-{}.log", i + 1)))
                .unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(15).collect();
            s.push_str(&format!(
                "controller {} log (last lines, newest first): {tail:?}\n",
                i + 1
            ));
        }
        s
    }
}

/// The most upgrades running at once, from the log's start and end lines.
fn most_at_once(log: &[String]) -> usize {
    let (mut now, mut most) = (0usize, 0usize);
    for l in log {
        if l.starts_with("start ") {
            now += 1;
            most = most.max(now);
        } else if l.starts_with("end ") {
            now = now.saturating_sub(1);
        }
    }
    most
}

fn step<'a>(status: &'a Value, node: &str) -> &'a Value {
    status["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["node"] == node)
        .unwrap_or_else(|| panic!("no step of {node} in {status}"))
}

/// A time in a log line (its last field).
fn at(line: &str) -> f64 {
    line.split_whitespace().last().unwrap().parse().unwrap()
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn one_node_at_a_time_a_job_delays_only_its_node_and_an_admin_drain_is_skipped() {
    let rig = Rig::new(1, 0);
    let [busy, a, b, admin] = [0, 1, 2, 3].map(|i| rig.slurm.nodes[i].clone());
    let conf = &rig.slurm.conf;
    // An admin drains a node in Slurm, outside berth.
    slurm_out(
        conf,
        "scontrol",
        &[
            "update",
            &format!("NodeName={admin}"),
            "State=DRAIN",
            "Reason=rma ticket 42",
        ],
    );
    // The user's job on `busy`: it writes `done` when it ends of itself.
    let (uid, gid, _) = test_user();
    let udir = tempfile::Builder::new()
        .prefix("berth-rollout-user")
        .tempdir_in("/tmp")
        .unwrap();
    std::fs::set_permissions(udir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    nix::unistd::chown(
        udir.path(),
        Some(nix::unistd::Uid::from_raw(uid)),
        Some(nix::unistd::Gid::from_raw(gid)),
    )
    .unwrap();
    let done = udir.path().join("done");
    let out = Command::new("runuser")
        .args(["-u", "berthtest", "--", "sbatch", "--parsable", "-N1"])
        .arg(format!("--nodelist={busy}"))
        .arg("--output=/dev/null")
        .arg(format!("--wrap=sleep 12; echo done > {}", done.display()))
        .env("SLURM_CONF", conf)
        .current_dir(udir.path())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "sbatch: {out:?}");
    let job = String::from_utf8_lossy(&out.stdout).trim().to_string();
    wait_for(
        "the job running",
        30,
        || slurm_out(conf, "squeue", &["-h", "-j", &job, "-o", "%T"]).trim() == "RUNNING",
        || slurm_out(conf, "squeue", &[]),
    );
    // Every agent has reported (a node no agent reported from would be skipped).
    wait_for(
        "the four agents registered",
        60,
        || {
            let out = rig.cli(&["nodes", "--json"]);
            serde_json::from_slice::<Value>(&out.stdout)
                .is_ok_and(|v| v.as_array().is_some_and(|a| a.len() == 4))
        },
        || rig.seen(),
    );
    let upgrade = rig.d().join("upgrade.sh");
    let plan = [
        "--command",
        upgrade.to_str().unwrap(),
        "--max-unavailable",
        "1",
        "--gate-passes",
        "2",
        "--timeout-s",
        "120",
    ];
    // The dry run: idle nodes first, the busy one last, the admin's drain skipped.
    let mut args = vec!["rollout", "dry-run"];
    args.extend(plan);
    let dry = rig.cli_ok(&args);
    assert!(dry.contains(&format!("batch 1: {a}\n")), "{dry}");
    assert!(dry.contains(&format!("batch 2: {b}\n")), "{dry}");
    assert!(dry.contains(&format!("batch 3: {busy}\n")), "{dry}");
    assert!(
        dry.contains(&format!("skipped: {admin} (drained before the rollout")),
        "{dry}"
    );
    // Four out at once overall makes one batch; one per partition (all are the harness's
    // "debug") makes them one at a time again.
    let wide: Vec<&str> = plan
        .iter()
        .map(|a| if *a == "1" { "4" } else { a })
        .collect();
    let mut args = vec!["rollout", "dry-run"];
    args.extend(&wide);
    let dry = rig.cli_ok(&args);
    assert!(dry.contains(&format!("batch 1: {a},{b},{busy}\n")), "{dry}");
    args.extend(["--max-unavailable-per-partition", "1"]);
    let dry = rig.cli_ok(&args);
    assert!(
        dry.contains("at most out at once per partition: debug 1"),
        "{dry}"
    );
    for (i, n) in [&a, &b, &busy].iter().enumerate() {
        assert!(dry.contains(&format!("batch {}: {n}\n", i + 1)), "{dry}");
    }
    assert!(
        rig.log().is_empty(),
        "a dry run ran something: {:?}",
        rig.log()
    );

    let mut args = vec!["rollout", "start"];
    args.extend(plan);
    rig.cli_ok(&args);
    // While it runs: never two nodes out at once in Slurm.
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut most_drained = 0;
    while Instant::now() < deadline {
        let out = rig
            .slurm
            .reasons()
            .values()
            .filter(|r| r.starts_with("berth rollout"))
            .count();
        most_drained = most_drained.max(out);
        if rig.status().is_some_and(|s| s["state"] == "done") {
            break;
        }
        std::thread::sleep(Duration::from_millis(150));
    }
    let status = rig.wait_state("done", 5);
    assert!(most_drained <= 1, "{most_drained} nodes drained at once");
    let log = rig.log();
    assert_eq!(most_at_once(&log), 1, "{log:?}");
    // Each node once, the admin's never; the busy node last, after its job ended by itself.
    let starts = rig.starts();
    let order: Vec<&str> = starts.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        order,
        vec![a.as_str(), b.as_str(), busy.as_str()],
        "{log:?}"
    );
    assert_eq!(std::fs::read_to_string(&done).unwrap(), "done\n");
    let job_end = std::fs::metadata(&done)
        .unwrap()
        .modified()
        .unwrap()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let line = |what: &str, node: &str| {
        log.iter()
            .find(|l| l.starts_with(&format!("{what} {node} ")))
            .unwrap_or_else(|| panic!("no {what} of {node}: {log:?}"))
            .clone()
    };
    assert!(line("start", &busy).contains(" jobs=0 "), "{log:?}");
    assert!(at(&line("start", &busy)) >= job_end, "{log:?}");
    // The job delayed only its node: the others were done before it ended.
    assert!(at(&line("end", &b)) < job_end, "{log:?} job end {job_end}");
    for n in [&busy, &a, &b] {
        assert_eq!(step(&status, n)["phase"], "done", "{status}");
    }
    assert_eq!(step(&status, &admin)["phase"], "skipped", "{status}");
    // Back in service; the admin's drain as it was.
    wait_for(
        "the nodes resumed",
        30,
        || {
            let r = rig.slurm.reasons();
            r.len() == 1 && r.get(&admin).map(String::as_str) == Some("rma ticket 42")
        },
        || rig.seen(),
    );
    // The output, per node; the rollout's metrics.
    let one = rig.cli_ok(&["rollout", "status", "--node", &busy]);
    assert!(
        one.contains(&format!("upgrading slurmd on {busy}")),
        "{one}"
    );
    let metrics = ureq::get(&format!("http://{}/metrics", rig.addrs[0]))
        .call()
        .unwrap()
        .body_mut()
        .read_to_string()
        .unwrap();
    assert!(
        metrics.contains("berth_controller_rollout_nodes{rollout=\"1\",phase=\"done\"} 3"),
        "{metrics}"
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_failure_stops_the_rollout_pause_resume_abort_a_killed_command_and_a_reboot() {
    let mut rig = Rig::new(1, 1);
    let [n1, n2, n3, n4] = [0, 1, 2, 3].map(|i| rig.slurm.nodes[i].clone());
    let d = rig.d().to_path_buf();
    let upgrade = d.join("upgrade.sh");
    let upgrade = upgrade.to_str().unwrap();
    wait_for(
        "the four agents registered",
        60,
        || {
            let out = rig.cli(&["nodes", "--json"]);
            serde_json::from_slice::<Value>(&out.stdout)
                .is_ok_and(|v| v.as_array().is_some_and(|a| a.len() == 4))
        },
        || rig.seen(),
    );

    // 1. The second node's upgrade fails: the rollout stops, that node stays drained with why,
    // the nodes after it are untouched.
    write(&d.join(format!("fail-{n2}")), "");
    rig.cli_ok(&[
        "rollout",
        "start",
        "--command",
        upgrade,
        "--gate-passes",
        "1",
    ]);
    let st = rig.wait_state("failed", 90);
    assert_eq!(step(&st, &n1)["phase"], "done", "{st}");
    assert_eq!(step(&st, &n2)["phase"], "failed", "{st}");
    assert_eq!(step(&st, &n2)["exit"], 7, "{st}");
    assert_eq!(step(&st, &n3)["phase"], "waiting", "{st}");
    assert!(st["stopped"].as_str().unwrap().contains(&n2), "{st}");
    let starts = rig.starts();
    assert_eq!(
        starts.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>(),
        vec![n1.clone(), n2.clone()],
        "{}",
        rig.seen()
    );
    wait_for(
        "the failed node drained with its reason, the others not",
        30,
        || {
            let r = rig.slurm.reasons();
            r.len() == 1
                && r.get(&n2).is_some_and(|x| {
                    x.starts_with("berth rollout 1: the command exited with status 7")
                })
        },
        || rig.seen(),
    );
    for n in [&n3, &n4] {
        assert_eq!(rig.slurm.state(n), "idle", "{}", rig.seen());
    }
    let out = rig.cli_ok(&["rollout", "status", "--node", &n2]);
    assert!(
        out.contains("dpkg: error processing package slurmd"),
        "{out}"
    );
    std::fs::remove_file(d.join(format!("fail-{n2}"))).unwrap();

    // 2. Pause: no node starts while paused (one in progress finishes); resume goes on.
    write(&d.join("sleep"), "2");
    let pair = format!("{n3},{n4}");
    rig.cli_ok(&[
        "rollout",
        "start",
        "--nodes",
        &pair,
        "--command",
        upgrade,
        "--gate-passes",
        "1",
    ]);
    rig.cli_ok(&["rollout", "pause"]);
    wait_for(
        "the paused rollout with nothing in progress",
        60,
        || {
            rig.status().is_some_and(|s| {
                s["state"] == "paused"
                    && s["steps"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .all(|x| ["waiting", "done"].contains(&x["phase"].as_str().unwrap()))
            })
        },
        || rig.seen(),
    );
    let ran = rig.starts().iter().filter(|(_, r)| r == "2").count();
    assert!(ran <= 1, "{}", rig.seen());
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        rig.starts().iter().filter(|(_, r)| r == "2").count(),
        ran,
        "a node started while paused: {}",
        rig.seen()
    );
    rig.cli_ok(&["rollout", "resume"]);
    rig.wait_state("done", 60);
    let mut two: Vec<String> = rig
        .starts()
        .into_iter()
        .filter(|(_, r)| r == "2")
        .map(|(n, _)| n)
        .collect();
    two.sort();
    assert_eq!(two, vec![n3.clone(), n4.clone()], "{}", rig.seen());

    // 3. Abort while the first node runs: it finishes, the other never starts.
    write(&d.join("sleep"), "4");
    rig.cli_ok(&[
        "rollout",
        "start",
        "--nodes",
        &pair,
        "--command",
        upgrade,
        "--gate-passes",
        "1",
    ]);
    wait_for(
        "rollout 3's first node running",
        60,
        || rig.starts().iter().any(|(_, r)| r == "3"),
        || rig.seen(),
    );
    rig.cli_ok(&["rollout", "abort"]);
    let st = rig.wait_state("aborted", 60);
    wait_for(
        "the aborted rollout's node finished",
        60,
        || {
            rig.status().is_some_and(|s| {
                s["ended_unix_ms"].is_u64()
                    && s["steps"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|x| x["phase"] == "done")
            })
        },
        || rig.seen(),
    );
    let three: Vec<String> = rig
        .starts()
        .into_iter()
        .filter(|(_, r)| r == "3")
        .map(|(n, _)| n)
        .collect();
    assert_eq!(three.len(), 1, "{}", rig.seen());
    let other = if three[0] == n3 { &n4 } else { &n3 };
    let st2 = rig.status().unwrap();
    assert_eq!(step(&st2, other)["phase"], "skipped", "{st} {st2}");
    wait_for(
        "both back in service",
        30,
        || {
            let r = rig.slurm.reasons();
            !r.contains_key(&n3) && !r.contains_key(&n4)
        },
        || rig.seen(),
    );

    // 4. The agent dies while its command runs; restarted, it reports the step failed as
    // killed midway and does not run it again.
    write(&d.join("sleep"), "30");
    rig.cli_ok(&[
        "rollout",
        "start",
        "--nodes",
        &n3,
        "--command",
        upgrade,
        "--gate-passes",
        "1",
    ]);
    wait_for(
        "rollout 4's node running",
        60,
        || rig.starts().iter().any(|(_, r)| r == "4"),
        || rig.seen(),
    );
    rig.agents.get_mut(&n3).unwrap().kill();
    let again = rig.agent(&n3);
    rig.agents.insert(n3.clone(), again);
    let st = rig.wait_state("failed", 60);
    let why = step(&st, &n3)["reason"].as_str().unwrap().to_string();
    assert!(why.starts_with("killed midway"), "{st}");
    assert_eq!(
        rig.starts().iter().filter(|(_, r)| r == "4").count(),
        1,
        "{}",
        rig.seen()
    );
    wait_for(
        "the killed node drained as killed midway",
        30,
        || {
            rig.slurm
                .reasons()
                .get(&n3)
                .is_some_and(|r| r.starts_with("berth rollout 4: killed midway"))
        },
        || rig.seen(),
    );

    // 5. A reboot: done once the agent reports a new boot id, then the gate.
    let boot = |n: &str| {
        let out = rig.cli(&["nodes", "--json"]);
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        v.as_array()
            .unwrap()
            .iter()
            .find(|x| x["node"] == n)
            .unwrap()["boot_id"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let before = boot(&n4);
    rig.cli_ok(&[
        "rollout",
        "start",
        "--nodes",
        &n4,
        "--reboot",
        "--gate-passes",
        "2",
    ]);
    let st = rig.wait_state("done", 60);
    assert_eq!(step(&st, &n4)["phase"], "done", "{st}");
    assert_ne!(boot(&n4), before);
    let reboots = rig
        .log()
        .iter()
        .filter(|l| l.starts_with("reboot "))
        .count();
    assert_eq!(reboots, 1, "{}", rig.seen());
    wait_for(
        "the rebooted node back in service",
        30,
        || !rig.slurm.reasons().contains_key(&n4),
        || rig.seen(),
    );
    assert_eq!(rig.slurm.state(&n1), "idle");

    // 6. The admin's gate check: the node waits at its gate until the check exits 0.
    let ok_file = rig.d().join("gate-ok");
    let check = format!(
        "echo waiting for the burn-in; test -e {}",
        ok_file.display()
    );
    rig.cli_ok(&[
        "rollout",
        "start",
        "--nodes",
        &n1,
        "--command",
        "true",
        "--gate-passes",
        "2",
        "--gate-command",
        &check,
    ]);
    wait_for(
        "the node at its gate",
        60,
        || {
            rig.status()
                .is_some_and(|s| step(&s, &n1)["phase"] == "gating")
        },
        || rig.seen(),
    );
    std::thread::sleep(Duration::from_secs(4));
    let st = rig.status().unwrap();
    assert_eq!(
        step(&st, &n1)["phase"],
        "gating",
        "resumed before the admin check passed: {st}"
    );
    assert!(
        rig.cli_ok(&["rollout", "status"])
            .contains(&format!("admin gate check: {check}")),
        "{st}"
    );
    std::fs::write(&ok_file, "").unwrap();
    let st = rig.wait_state("done", 60);
    assert_eq!(step(&st, &n1)["phase"], "done", "{st}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn three_controllers_the_leader_killed_mid_rollout_no_node_runs_twice() {
    let mut rig = Rig::new(3, 2);
    let d = rig.d().to_path_buf();
    let upgrade = d.join("upgrade.sh");
    wait_for(
        "the four agents registered",
        60,
        || {
            let out = rig.cli(&["nodes", "--json"]);
            serde_json::from_slice::<Value>(&out.stdout)
                .is_ok_and(|v| v.as_array().is_some_and(|a| a.len() == 4))
        },
        || rig.seen(),
    );
    write(&d.join("sleep"), "3");
    rig.cli_ok(&[
        "rollout",
        "start",
        "--command",
        upgrade.to_str().unwrap(),
        "--gate-passes",
        "1",
    ]);
    // Mid-rollout: the second node's upgrade is running.
    wait_for(
        "the second node's upgrade running",
        90,
        || {
            let log = rig.log();
            log.iter().filter(|l| l.starts_with("start ")).count() == 2
                && log.last().is_some_and(|l| l.starts_with("start "))
        },
        || rig.seen(),
    );
    let out = rig.cli_ok(&["status", "--json"]);
    let v: Value = serde_json::from_str(&out).unwrap();
    let leader = usize::try_from(v["leader"].as_u64().unwrap()).unwrap() - 1;
    rig.controllers[leader].as_mut().unwrap().kill();
    rig.controllers[leader] = None;
    let st = rig.wait_state("done", 120);
    let mut nodes: Vec<String> = rig.starts().into_iter().map(|(n, _)| n).collect();
    nodes.sort();
    assert_eq!(
        nodes,
        rig.slurm.nodes,
        "a node ran twice or not at all: {}",
        rig.seen()
    );
    assert_eq!(most_at_once(&rig.log()), 1, "{}", rig.seen());
    for n in &rig.slurm.nodes {
        assert_eq!(step(&st, n)["phase"], "done", "{st}");
    }
    let after = rig.cli_ok(&["status", "--json"]);
    let v: Value = serde_json::from_str(&after).unwrap();
    assert_ne!(
        v["leader"].as_u64(),
        Some(u64::try_from(leader + 1).unwrap()),
        "{after}"
    );
    wait_for(
        "every node back in service",
        30,
        || rig.slurm.reasons().is_empty(),
        || rig.seen(),
    );
}
