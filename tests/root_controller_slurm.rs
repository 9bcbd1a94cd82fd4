//! The cluster controller against the real Slurm of `integration/slurm/` (issue 16): four slurmd
//! on this host (`start.sh --nodes 4`), one `berth agent` per node, each with a fixture host tree
//! of its own (`topology.host_root`, `topology.expected_gpus` says whether its GPU check fails),
//! and one `berth-controller` that reconciles with the real `sinfo` and applies with the real
//! `scontrol`. What an admin sees in `sinfo -R` is what is asserted: a failing check drains as
//! `berth: <check>: …`, a fixed one is resumed after 3 passes, an admin's drain is never
//! touched, a node drained more than 3 times in an hour stays drained as `berth: flapping`.
//!
//! Every process started here is killed by PID when its guard drops (the Slurm cluster is
//! stopped by stop.sh); none inherits the test's stdout or stderr.

mod common;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::BERTH;

const KEY: &str = "test-cluster-key-slurm-0123456789";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Kills and reaps its process when dropped.
struct Proc {
    child: Child,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.child.id()).unwrap());
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        let _ = self.child.wait();
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

fn controller_bin() -> PathBuf {
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

fn start_slurm(dir: &Path, nodes: usize) -> Slurm {
    let berth = PathBuf::from(BERTH);
    let plugin = build_plugin(berth.parent().unwrap());
    let state = dir.join("slurm");
    let port = 22000 + (std::process::id() % 400) * 8;
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
        .args(["--nodes", &nodes.to_string()])
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
        "integration/slurm/start.sh --nodes {nodes} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let names = slurm_out(&slurm.conf, "sinfo", &["-h", "-N", "-o", "%N"]);
    slurm.nodes = names.lines().map(|l| l.trim().to_string()).collect();
    slurm.nodes.sort();
    slurm.nodes.dedup();
    assert_eq!(slurm.nodes.len(), nodes, "{names}");
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
    /// `sinfo -R`, one line per node: node → reason.
    fn reasons(&self) -> std::collections::BTreeMap<String, String> {
        slurm_out(&self.conf, "sinfo", &["-R", "-N", "-h", "-o", "%N|%E"])
            .lines()
            .filter_map(|l| l.split_once('|'))
            .map(|(n, r)| (n.trim().to_string(), r.trim().to_string()))
            .collect()
    }

    fn reason(&self, node: &str) -> Option<String> {
        self.reasons().remove(node)
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

/// Waits (bounded) for `cond`; `what` and `why()` say what was awaited and what was seen.
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

/// One node's agent configuration: its own fixture host tree, a GPU expected when `failing`
/// (the tree has none: gpu-count, a hard check that can recover, fails).
fn agent_config(dir: &Path, addr: &str, node: &str, failing: bool) -> PathBuf {
    let host = dir.join(format!("host-{node}"));
    write(&host.join("sys/devices/system/cpu/online"), "0-1\n");
    write(&host.join("sys/devices/system/node/node0/cpulist"), "0-1\n");
    let path = dir.join(format!("agent-{node}.toml"));
    let tmp = path.with_extension("tmp");
    write(
        &tmp,
        &format!(
            "[topology]\nhost_root = \"{host}\"\n{gpus}\
             [runtime]\nstate_dir = \"{d}/agent-run\"\n[store]\nroot = \"{d}/agent-store\"\n\
             [scratch]\nroot = \"{d}/agent-scratch\"\n\
             [agent]\ncontrollers = [\"{addr}\"]\nkey_file = \"{d}/key\"\ninterval_ms = 300\n\
             check_interval_ms = 100\nmetrics_listen = \"\"\nnode_name = \"{node}\"\n",
            host = host.display(),
            gpus = if failing { "expected_gpus = 1\n" } else { "" },
            d = dir.display(),
        ),
    );
    // Renamed into place: the running agent rereads it each round and must not see half.
    std::fs::rename(&tmp, &path).unwrap();
    path
}

fn agent(config: &Path) -> Proc {
    let child = Command::new(BERTH)
        .arg("--config")
        .arg(config)
        .arg("agent")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    Proc { child }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn real_agents_drain_resume_and_flap_in_real_slurm_and_leave_admin_drains() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let slurm = start_slurm(d, 4);
    let [fixed, admin, flapping, healthy] = [0, 1, 2, 3].map(|i| slurm.nodes[i].clone());

    write(&d.join("key"), &format!("{KEY}\n"));
    std::fs::set_permissions(
        d.join("key"),
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    let addr = format!("127.0.0.1:{}", free_port());
    // Four nodes allow 2 automatic drains per 10 minutes (the breaker's minimum); flapping
    // takes 4 drains of one node: the breaker is tested elsewhere (root_controller.rs).
    write(
        &d.join("controller.toml"),
        "[controller]\nbreaker_min = 100\n",
    );
    let log = std::fs::File::create(d.join("controller.log")).unwrap();
    let _controller = Proc {
        child: Command::new(controller_bin())
            .arg("--config")
            .arg(d.join("controller.toml"))
            .arg("serve")
            .args(["--listen", &addr, "--reconcile-interval-ms", "200"])
            .arg("--data-dir")
            .arg(d.join("data"))
            .arg("--key-file")
            .arg(d.join("key"))
            .args(["--sinfo", "sinfo", "--scontrol", "scontrol"])
            .env("SLURM_CONF", &slurm.conf)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap(),
    };
    let seen = || {
        format!(
            "sinfo -R: {:?}; controller log: {}",
            slurm.reasons(),
            std::fs::read_to_string(d.join("controller.log")).unwrap_or_default()
        )
    };

    // An admin drains one node in Slurm, outside berth.
    slurm_out(
        &slurm.conf,
        "scontrol",
        &[
            "update",
            &format!("NodeName={admin}"),
            "State=DRAIN",
            "Reason=rma ticket 42",
        ],
    );
    let _agents: Vec<Proc> = [&fixed, &admin, &flapping, &healthy]
        .iter()
        .map(|n| agent(&agent_config(d, &addr, n, false)))
        .collect();

    // A failing check shows in `sinfo -R` as berth's reason; the admin's node fails too, and
    // its drain stays the admin's.
    agent_config(d, &addr, &fixed, true);
    agent_config(d, &addr, &admin, true);
    wait_for(
        "the failing node drained with berth's reason",
        30,
        || {
            slurm
                .reason(&fixed)
                .is_some_and(|r| r.starts_with("berth: gpu-count: "))
        },
        seen,
    );
    // Fixed: resumed after 3 passing rounds.
    agent_config(d, &addr, &fixed, false);
    agent_config(d, &addr, &admin, false);
    wait_for(
        "the fixed node resumed",
        30,
        || slurm.reason(&fixed).is_none() && slurm.state(&fixed) == "idle",
        seen,
    );

    // Flapping: the fourth drain within the hour is `berth: flapping`, and stays.
    for round in 0..4 {
        agent_config(d, &addr, &flapping, true);
        wait_for(
            &format!("drain {} of the flapping node", round + 1),
            30,
            || {
                slurm
                    .reason(&flapping)
                    .is_some_and(|r| r.starts_with("berth: "))
            },
            seen,
        );
        agent_config(d, &addr, &flapping, false);
        if round < 3 {
            wait_for(
                &format!("resume {} of the flapping node", round + 1),
                30,
                || slurm.reason(&flapping).is_none(),
                seen,
            );
        }
    }
    wait_for(
        "the flapping node drained as berth: flapping",
        30,
        || slurm.reason(&flapping).as_deref() == Some("berth: flapping"),
        seen,
    );
    // Passing rounds (more than 3) change none of it.
    std::thread::sleep(Duration::from_millis(3000));
    let reasons = slurm.reasons();
    assert_eq!(
        reasons.get(&flapping).map(String::as_str),
        Some("berth: flapping"),
        "{}",
        seen()
    );
    assert_eq!(
        reasons.get(&admin).map(String::as_str),
        Some("rma ticket 42"),
        "{}",
        seen()
    );
    assert_eq!(reasons.get(&fixed), None, "{}", seen());
    assert_eq!(reasons.get(&healthy), None, "{}", seen());
}
