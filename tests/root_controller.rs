//! The cluster controller (issue 16) end to end on loopback: real `berth-controller`
//! processes (1 or 3, each with its own redb file), real `berth agent` rounds whose health comes
//! from a fixture host tree (`topology.host_root`, `topology.expected_gpus`), and a fake Slurm:
//! `sinfo`/`scontrol` scripts that keep node states in files and log every `scontrol` call with
//! the calling controller's id and Raft term.
//!
//! Faults: `kill -9` of the leader (a new leader, committed decisions kept, replicas' state
//! hashes equal), SIGSTOP of the leader (it makes no `scontrol` call, before or after SIGCONT).
//! Every process started here is killed by PID when its guard drops; none inherits the test's
//! stdout or stderr.

mod common;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::BERTH;
use serde_json::Value;

const KEY: &str = "test-cluster-key-0123456789";

/// Kills and reaps its process when dropped.
struct Proc {
    child: Child,
}

impl Proc {
    fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).unwrap()
    }
    fn signal(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), sig).unwrap();
    }
    /// Whether the process still runs (one that exited is a zombie until reaped).
    fn alive(&self) -> bool {
        std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).is_ok_and(|st| {
            st.rsplit_once(") ")
                .is_some_and(|(_, rest)| !rest.starts_with('Z') && !rest.starts_with('X'))
        })
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // A stopped process must be continued to die of SIGKILL promptly; both are harmless
        // on one already gone.
        let pid = nix::unistd::Pid::from_raw(self.pid());
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT);
        let _ = self.child.wait();
    }
}

/// The controller binary, built next to berth's (integration/test.sh builds the workspace).
fn controller_bin() -> PathBuf {
    let bin = Path::new(BERTH).with_file_name("berth-controller");
    if !bin.exists() {
        let target = Path::new(BERTH).parent().unwrap().parent().unwrap();
        let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args(["build", "-p", "berth-controller"])
            .env("CARGO_TARGET_DIR", target)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
    }
    bin
}

/// The `X-Berth-Auth` header of a request signed with the test cluster's key.
fn signed(method: &str, path: &str, body: &[u8]) -> String {
    let key = berth_api::auth::Key::new(KEY);
    berth_api::auth::sign_request(&key, method, path, body)
        .unwrap()
        .header
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
    use std::os::unix::fs::PermissionsExt;
    write(path, text);
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// Mode 0600: a key file group or others can read is refused.
fn private(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// A test cluster: its directory, the fake Slurm, the controllers.
struct Cluster {
    dir: tempfile::TempDir,
    addrs: Vec<String>,
    controllers: Vec<Option<Proc>>,
    /// Controller i runs as uid `uids[i]` (so a firewall rule can cut it off alone); empty:
    /// as root.
    uids: Vec<u32>,
}

impl Cluster {
    fn new(n: usize, slurm_nodes: &[(&str, &str, &str)]) -> Self {
        Self::with_uids(n, slurm_nodes, Vec::new())
    }

    fn with_uids(n: usize, slurm_nodes: &[(&str, &str, &str)], uids: Vec<u32>) -> Self {
        Self::build(n, slurm_nodes, uids, "")
    }

    /// `toml`: the controllers' `[controller]` settings beyond the flags; every controller runs
    /// with the failpoint file `<dir>/failpoint` (it fires only while that file exists).
    fn build(n: usize, slurm_nodes: &[(&str, &str, &str)], uids: Vec<u32>, toml: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        write(&d.join("key"), &format!("{KEY}\n"));
        private(&d.join("key"));
        // The fake Slurm: one file per node, "STATE|REASON"; scontrol logs "ID TERM ARGS".
        for (name, state, reason) in slurm_nodes {
            write(&d.join("slurm").join(name), &format!("{state}|{reason}\n"));
        }
        executable(
            &d.join("sinfo"),
            &format!(
                "#!/bin/sh\nfor f in {0}/slurm/*; do [ -f \"$f\" ] && printf '%s|%s\\n' \"$(basename \"$f\")\" \"$(cat \"$f\")\"; done\nexit 0\n",
                d.display()
            ),
        );
        executable(
            &d.join("scontrol"),
            &format!(
                r#"#!/bin/sh
echo "$BERTH_CONTROLLER_ID $BERTH_CONTROLLER_TERM $*" >> {0}/calls
nodes=""; state=""; reason=""
for a in "$@"; do
  case "$a" in
    NodeName=*) nodes="${{a#NodeName=}}" ;;
    State=*) state="${{a#State=}}" ;;
    Reason=*) reason="${{a#Reason=}}" ;;
  esac
done
for node in $(echo "$nodes" | tr ',' ' '); do
  case "$state" in
    DRAIN) echo "drained|$reason" > {0}/slurm/$node ;;
    RESUME) echo "idle|none" > {0}/slurm/$node ;;
  esac
done
"#,
                d.display()
            ),
        );
        let addrs: Vec<String> = (0..n)
            .map(|_| format!("127.0.0.1:{}", free_port()))
            .collect();
        write(&d.join("none.toml"), &format!("[controller]\n{toml}"));
        let mut c = Self {
            dir,
            addrs,
            controllers: Vec::new(),
            uids,
        };
        if !c.uids.is_empty() {
            // The controllers' users read the key and the tools, write their data directory,
            // the fake Slurm's state and the call log.
            use std::os::unix::fs::PermissionsExt;
            let mode = |p: &Path, m: u32| {
                std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap()
            };
            let d = c.path().to_path_buf();
            mode(&d, 0o755);
            write(&d.join("calls"), "");
            mode(&d.join("calls"), 0o666);
            mode(&d.join("slurm"), 0o777);
            for (name, _, _) in slurm_nodes {
                mode(&d.join("slurm").join(name), 0o666);
            }
            for (i, uid) in c.uids.iter().enumerate() {
                let data = d.join(format!("data{}", i + 1));
                std::fs::create_dir_all(&data).unwrap();
                std::os::unix::fs::chown(&data, Some(*uid), Some(*uid)).unwrap();
                // Each service user's own copy of the key, 0600: a key file others can read
                // is refused.
                let key = d.join(format!("key{}", i + 1));
                write(&key, &format!("{KEY}\n"));
                private(&key);
                std::os::unix::fs::chown(&key, Some(*uid), Some(*uid)).unwrap();
            }
        }
        for i in 0..n {
            let p = c.start(i);
            c.controllers.push(Some(p));
        }
        c
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Starts controller `i` (id i+1) with its own data directory.
    fn start(&self, i: usize) -> Proc {
        let d = self.path();
        let mut cmd = Command::new(controller_bin());
        cmd.arg("--config")
            .arg(d.join("none.toml"))
            .arg("serve")
            .args(["--id", &(i + 1).to_string(), "--listen", &self.addrs[i]])
            .arg("--data-dir")
            .arg(d.join(format!("data{}", i + 1)))
            .arg("--key-file")
            .arg(if self.uids.is_empty() {
                d.join("key")
            } else {
                d.join(format!("key{}", i + 1))
            })
            .arg("--sinfo")
            .arg(d.join("sinfo"))
            .arg("--scontrol")
            .arg(d.join("scontrol"))
            .args(["--reconcile-interval-ms", "200"]);
        if self.addrs.len() > 1 {
            for (j, a) in self.addrs.iter().enumerate() {
                cmd.arg("--peer").arg(format!("{}={a}", j + 1));
            }
        }
        cmd.arg("--failpoint-file").arg(d.join("failpoint"));
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(d.join(format!("controller{}.log", i + 1)))
            .unwrap();
        if let Some(uid) = self.uids.get(i) {
            use std::os::unix::process::CommandExt;
            cmd.uid(*uid).gid(*uid);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        Proc { child }
    }

    fn get(&self, i: usize, path: &str) -> Option<Value> {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_millis(800)))
            .build()
            .into();
        let mut r = agent
            .get(&format!("http://{}{path}", self.addrs[i]))
            .header(berth_api::auth::AUTH_HEADER, &signed("GET", path, b""))
            .call()
            .ok()?;
        serde_json::from_slice(&r.body_mut().read_to_vec().ok()?).ok()
    }

    fn status(&self, i: usize) -> Option<Value> {
        self.get(i, "/v1/status")
    }

    /// Each controller's status (or why there is none) and the end of its log: the test's
    /// directory is gone once a failing test unwinds.
    fn diagnosis(&self) -> String {
        let mut out = String::new();
        for i in 0..self.addrs.len() {
            let running = self.controllers[i].is_some();
            let status = self.status(i).map_or("no answer".into(), |v| v.to_string());
            let log = std::fs::read_to_string(self.path().join(format!("controller{}.log", i + 1)))
                .unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines[lines.len().saturating_sub(12)..].join("\n    ");
            out += &format!(
                "controller {} (running: {running}): {status}\n    {tail}\n",
                i + 1
            );
        }
        out
    }

    /// Waits (bounded) until every running controller (but `exclude`) names the same leader
    /// in the same term, the leader included; returns its index. (One controller's word alone
    /// may be stale: a leader deposed a moment ago still says it leads.)
    fn leader(&self, exclude: Option<usize>) -> usize {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            // A controller that exits meanwhile (the failpoint) has no say.
            let views: Vec<Option<(u64, u64)>> = (0..self.addrs.len())
                .filter(|i| {
                    Some(*i) != exclude && self.controllers[*i].as_ref().is_some_and(Proc::alive)
                })
                .map(|i| {
                    let s = self.status(i)?;
                    Some((s["leader"].as_u64()?, s["term"].as_u64()?))
                })
                .collect();
            if let Some(Some((l, _))) = views.first()
                && views.iter().all(|v| *v == views[0])
                && Some(usize::try_from(*l).unwrap() - 1) != exclude
            {
                return usize::try_from(*l).unwrap() - 1;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("no leader within 30 s:\n{}", self.diagnosis());
    }

    fn calls(&self) -> Vec<String> {
        std::fs::read_to_string(self.path().join("calls"))
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    fn slurm(&self, node: &str) -> String {
        std::fs::read_to_string(self.path().join("slurm").join(node))
            .unwrap()
            .trim()
            .to_string()
    }

    /// A berth configuration for node `node`: the fixture host, `expected_gpus` when given.
    fn berth_config(&self, node: &str, expected_gpus: Option<u32>) -> PathBuf {
        self.config_with(
            node,
            &Opts {
                expected_gpus,
                ..Opts::default()
            },
        )
    }

    /// A berth configuration for node `node` as `o` says; its fixture host tree is
    /// `host-<node>` when `o.own_host`, else the shared `host`.
    fn config_with(&self, node: &str, o: &Opts) -> PathBuf {
        let host = if o.own_host {
            self.path().join(format!("host-{node}"))
        } else {
            self.path().join("host")
        };
        let online = host.join("sys/devices/system/cpu/online");
        if std::fs::symlink_metadata(&online).is_err() {
            write(&online, "0-1\n");
        }
        write(&host.join("sys/devices/system/node/node0/cpulist"), "0-1\n");
        let mut topology = format!("[topology]\nhost_root = \"{}\"\n", host.display());
        if let Some(n) = o.expected_gpus {
            topology.push_str(&format!("expected_gpus = {n}\n"));
        }
        let controllers: Vec<String> = self.addrs.iter().map(|a| format!("\"{a}\"")).collect();
        let path = self.path().join(format!("berth-{node}.toml"));
        let tmp = path.with_extension("tmp");
        write(
            &tmp,
            &format!(
                "{topology}[agent]\ncontrollers = [{}]\nkey_file = \"{}\"\ninterval_ms = {}\n\
                 metrics_listen = \"{}\"\nnode_name = \"{node}\"\n{}\n{}",
                controllers.join(", "),
                self.path().join("key").display(),
                o.interval_ms.unwrap_or(200),
                o.metrics_listen,
                o.agent,
                o.sections,
            ),
        );
        // Renamed into place: a running agent rereads it each round and must not see half.
        std::fs::rename(&tmp, &path).unwrap();
        path
    }

    /// A long-running agent with the configuration `o`, `path_dir` first in its PATH.
    fn agent_with(&self, node: &str, o: &Opts, path_dir: Option<&Path>) -> Proc {
        let cfg = self.config_with(node, o);
        let mut cmd = Command::new(BERTH);
        cmd.arg("--config").arg(&cfg).arg("agent");
        if let Some(dir) = path_dir {
            let path = std::env::var("PATH").unwrap_or_default();
            cmd.env("PATH", format!("{}:{path}", dir.display()));
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        Proc { child }
    }

    fn node(&self, i: usize, node: &str) -> Option<Value> {
        let nodes = self.get(i, "/v1/nodes")?;
        nodes
            .as_array()?
            .iter()
            .find(|n| n["node"] == node)
            .cloned()
    }

    fn text(&self, addr: &str, path: &str) -> Option<String> {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_millis(800)))
            .build()
            .into();
        let mut r = agent
            .get(&format!("http://{addr}{path}"))
            .header(berth_api::auth::AUTH_HEADER, &signed("GET", path, b""))
            .call()
            .ok()?;
        r.body_mut().read_to_string().ok()
    }

    fn berth(&self, config: &Path, args: &[&str]) -> std::process::Output {
        Command::new(BERTH)
            .arg("--config")
            .arg(config)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    /// One agent round for `node`; asserts the controller took it.
    fn beat(&self, node: &str, expected_gpus: Option<u32>) {
        let cfg = self.berth_config(node, expected_gpus);
        let out = self.berth(&cfg, &["agent", "--once"]);
        assert!(out.status.success(), "{out:?}");
    }

    /// A long-running agent.
    fn agent(&self, node: &str, expected_gpus: Option<u32>) -> Proc {
        let cfg = self.berth_config(node, expected_gpus);
        let child = Command::new(BERTH)
            .arg("--config")
            .arg(&cfg)
            .arg("agent")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        Proc { child }
    }
}

/// What a test node's berth configuration holds besides the defaults.
#[derive(Default)]
struct Opts {
    expected_gpus: Option<u32>,
    own_host: bool,
    interval_ms: Option<u64>,
    metrics_listen: String,
    /// More lines of `[agent]`.
    agent: String,
    /// More sections.
    sections: String,
}

/// The value of a metric line `name` (labels included) in Prometheus text.
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Waits (bounded) for `cond`.
fn wait_for(what: &str, secs: u64, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        if cond() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("timed out after {secs} s waiting for {what}");
}

fn hashes(c: &Cluster) -> Vec<String> {
    (0..c.addrs.len())
        .filter(|i| c.controllers[*i].is_some())
        .filter_map(|i| c.status(i))
        .map(|s| s["state_hash"].as_str().unwrap().to_string())
        .collect()
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn one_controller_drains_a_failing_node_resumes_it_and_leaves_admin_drains() {
    let c = Cluster::new(
        1,
        &[("n1", "idle", "none"), ("n2", "drained", "rma ticket 7")],
    );
    c.leader(None);

    // Without the key: 401, for reads as for writes.
    let plain: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let r = plain
        .get(&format!("http://{}/v1/status", c.addrs[0]))
        .call()
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let r = plain
        .post(&format!("http://{}/v1/heartbeat", c.addrs[0]))
        .header(
            berth_api::auth::AUTH_HEADER,
            &berth_api::auth::sign_request(
                &berth_api::auth::Key::new("wrong"),
                "POST",
                "/v1/heartbeat",
                b"{}",
            )
            .unwrap()
            .header,
        )
        .content_type("application/json")
        .send(&b"{}"[..])
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);

    // n1 misses the GPU its configuration expects: a hard check, drained on the first round.
    let agent = c.agent("n1", Some(1));
    let healthy = c.agent("n2", None);
    wait_for("n1 drained in Slurm", 20, || {
        c.slurm("n1").starts_with("drained|berth: gpu-count: ")
    });
    let drain = c.calls();
    assert!(
        drain
            .iter()
            .any(|l| l.contains("NodeName=n1 State=DRAIN Reason=berth: gpu-count:")),
        "{drain:?}"
    );

    // Fixed (no GPU expected any more): resumed after 3 passing rounds.
    c.berth_config("n1", None);
    wait_for("n1 resumed", 20, || c.slurm("n1") == "idle|none");
    let calls = c.calls();
    assert!(
        calls
            .iter()
            .any(|l| l.ends_with("NodeName=n1 State=RESUME")),
        "{calls:?}"
    );
    let nodes = c.get(0, "/v1/nodes").unwrap();
    assert_eq!(nodes[0]["node"], "n1");
    assert_eq!(nodes[0]["desired"], "up");
    // n2 is healthy but an admin drained it outside berth: never resumed, never rewritten.
    assert_eq!(c.slurm("n2"), "drained|rma ticket 7");
    assert!(
        !calls.iter().any(|l| l.contains("NodeName=n2")),
        "{calls:?}"
    );

    // An admin drain through berth is applied, then left alone although n1's checks pass.
    let cfg = c.berth_config("admin", None);
    let out = c.berth(&cfg, &["cluster", "drain", "n1", "--reason", "bad fan"]);
    assert!(out.status.success(), "{out:?}");
    wait_for("n1 drained as the admin said", 20, || {
        c.slurm("n1") == "drained|bad fan"
    });
    let before = c.calls().len();
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(c.calls().len(), before, "{:?}", c.calls());
    let out = c.berth(&cfg, &["cluster", "nodes", "--json"]);
    assert!(out.status.success(), "{out:?}");
    let nodes: Value = serde_json::from_slice(&out.stdout).unwrap();
    let n1 = nodes
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node"] == "n1")
        .unwrap();
    assert_eq!(n1["drained_by"], "admin");
    // A drain through berth of a node an admin drained in Slurm keeps Slurm's reason.
    let out = c.berth(&cfg, &["cluster", "drain", "n2", "--reason", "other"]);
    assert!(out.status.success(), "{out:?}");
    // The admin's resume through berth lifts the drain berth made for the admin.
    let out = c.berth(&cfg, &["cluster", "resume", "n1"]);
    assert!(out.status.success(), "{out:?}");
    wait_for("n1 resumed by the admin", 20, || {
        c.slurm("n1") == "idle|none"
    });
    std::thread::sleep(Duration::from_millis(1000));
    assert_eq!(c.slurm("n2"), "drained|rma ticket 7");
    assert!(
        !c.calls().iter().any(|l| l.contains("NodeName=n2")),
        "{:?}",
        c.calls()
    );
    let out = c.berth(&cfg, &["cluster", "status"]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("leader:     1 ("),
        "{out:?}"
    );
    drop(agent);
    drop(healthy);
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn three_controllers_survive_kill_9_of_the_leader_with_their_decisions() {
    let mut c = Cluster::new(3, &[("n1", "idle", "none"), ("n2", "idle", "none")]);
    let leader = c.leader(None);
    c.beat("n1", Some(1));
    wait_for("n1 drained", 20, || {
        c.slurm("n1").starts_with("drained|berth:")
    });
    wait_for("replicas agree", 10, || {
        let h = hashes(&c);
        h.len() == 3 && h.iter().all(|x| *x == h[0])
    });

    let killed = Instant::now();
    c.controllers[leader]
        .as_ref()
        .unwrap()
        .signal(nix::sys::signal::Signal::SIGKILL);
    c.controllers[leader] = None;
    let new = c.leader(Some(leader));
    // From the kill until a new leader takes a heartbeat.
    c.beat("n2", None);
    let failover = killed.elapsed();
    eprintln!(
        "failover after kill -9 of controller {}: {failover:?}",
        leader + 1
    );
    assert_ne!(new, leader);
    // The committed drain survived: the new leader has it, and the replicas agree.
    let nodes = c.get(new, "/v1/nodes").unwrap();
    let n1 = nodes
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node"] == "n1")
        .unwrap();
    assert_eq!(n1["desired"], "drained");
    assert!(
        n1["reason"]
            .as_str()
            .unwrap()
            .starts_with("berth: gpu-count: ")
    );
    wait_for("the two replicas agree", 10, || {
        let h = hashes(&c);
        h.len() == 2 && h[0] == h[1]
    });

    // The killed controller restarts on its redb file and catches up.
    c.controllers[leader] = Some(c.start(leader));
    wait_for("all three agree again", 20, || {
        let h = hashes(&c);
        h.len() == 3 && h.iter().all(|x| *x == h[0])
    });
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_stopped_leader_makes_no_scontrol_call() {
    let c = Cluster::new(3, &[("n1", "idle", "none")]);
    let old = c.leader(None);
    // n1 known and up everywhere: a leader with this state that saw n1 drained by berth in
    // Slurm would resume it.
    c.beat("n1", None);
    wait_for("replicas agree", 10, || {
        let h = hashes(&c);
        h.len() == 3 && h.iter().all(|x| *x == h[0])
    });
    let old_id = (old + 1).to_string();
    let old_term = c.status(old).unwrap()["term"].as_u64().unwrap();
    c.controllers[old]
        .as_ref()
        .unwrap()
        .signal(nix::sys::signal::Signal::SIGSTOP);
    let stopped = Instant::now();
    let by_old = |c: &Cluster| {
        c.calls()
            .iter()
            .filter(|l| l.starts_with(&format!("{old_id} ")))
            .count()
    };
    let before = by_old(&c);
    let new = c.leader(Some(old));
    eprintln!(
        "new leader {} {:?} after SIGSTOP of {}",
        new + 1,
        stopped.elapsed(),
        old + 1
    );

    // A decision while the old leader is stopped: the new one applies it, under a higher term.
    c.beat("n1", Some(1));
    wait_for("n1 drained", 20, || {
        c.slurm("n1").starts_with("drained|berth:")
    });
    let calls = c.calls();
    let drain = calls
        .iter()
        .find(|l| l.contains("NodeName=n1 State=DRAIN"))
        .unwrap();
    let mut f = drain.split(' ');
    assert_eq!(f.next(), Some((new + 1).to_string().as_str()), "{calls:?}");
    assert!(
        f.next().unwrap().parse::<u64>().unwrap() > old_term,
        "{calls:?}"
    );

    // Continued, the old leader learns it was deposed and calls nothing, even with Slurm's state
    // now differing from what it last knew.
    c.controllers[old]
        .as_ref()
        .unwrap()
        .signal(nix::sys::signal::Signal::SIGCONT);
    std::thread::sleep(Duration::from_millis(2000));
    assert_eq!(by_old(&c), before, "{:?}", c.calls());
    wait_for("replicas agree after the old leader is back", 10, || {
        let h = hashes(&c);
        h.len() == 3 && h.iter().all(|x| *x == h[0])
    });
    // Every call came from a leader of its term: no term has two callers.
    let mut by_term = std::collections::BTreeMap::<String, String>::new();
    for l in c.calls() {
        let mut f = l.split(' ');
        let (id, term) = (f.next().unwrap().to_string(), f.next().unwrap().to_string());
        let prev = by_term.entry(term).or_insert_with(|| id.clone());
        assert_eq!(*prev, id, "{:?}", c.calls());
    }
}

/// Drops every packet a uid sends on loopback while it lives: that uid's controller is cut off
/// from its peers both ways (its requests and its answers), a minority partition.
struct Partition {
    uid: u32,
}

impl Partition {
    fn rule(&self, op: &str) -> std::process::Output {
        Command::new("iptables")
            .args([op, "OUTPUT", "-o", "lo", "-m", "owner", "--uid-owner"])
            .arg(self.uid.to_string())
            .args(["-j", "DROP"])
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    fn new(uid: u32) -> Self {
        let p = Self { uid };
        let out = p.rule("-A");
        assert!(out.status.success(), "iptables: {out:?}");
        p
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        let _ = self.rule("-D");
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_partitioned_leader_makes_no_scontrol_call() {
    // Users of their own (unique to this test process), so the firewall can single one out.
    let base = 63_000 + (std::process::id() % 500) * 4;
    let c = Cluster::with_uids(3, &[("n1", "idle", "none")], vec![base, base + 1, base + 2]);
    let old = c.leader(None);
    c.beat("n1", None);
    wait_for("replicas agree", 10, || {
        let h = hashes(&c);
        h.len() == 3 && h.iter().all(|x| *x == h[0])
    });
    let old_id = format!("{} ", old + 1);
    let partition = Partition::new(c.uids[old]);
    let new = c.leader(Some(old));
    // The majority drains n1. The old leader, cut off, still has n1 up and would resume it if it
    // trusted its own view of being leader.
    c.beat("n1", Some(1));
    wait_for("n1 drained by the new leader", 30, || {
        c.slurm("n1").starts_with("drained|berth:")
    });
    std::thread::sleep(Duration::from_millis(3000));
    let calls = c.calls();
    assert!(
        calls.iter().all(|l| !l.starts_with(&old_id)),
        "the partitioned leader called scontrol: {calls:?}"
    );
    assert!(
        calls
            .iter()
            .any(|l| l.starts_with(&format!("{} ", new + 1))),
        "{calls:?}"
    );
    drop(partition);
    wait_for("replicas agree after healing", 20, || {
        let h = hashes(&c);
        h.len() == 3 && h.iter().all(|x| *x == h[0])
    });
    assert_eq!(c.slurm("n1").split('|').next(), Some("drained"));
}

/// A squashfs mounted at `<dir>/mnt/<hex>` as berth mounts images, unmounted on drop.
struct LeftMount(PathBuf);

impl LeftMount {
    fn new(dir: &Path, hex: &str) -> Self {
        let src = dir.join("left-image");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(src.join("file"), "x").unwrap();
        let sqsh = dir.join("left.sqsh");
        let made = Command::new("mksquashfs")
            .args([&src, &sqsh])
            .args(["-quiet", "-no-progress", "-noappend"])
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(made.success(), "mksquashfs failed");
        let target = dir.join("mnt").join(hex);
        std::fs::create_dir_all(&target).unwrap();
        let mounted = Command::new("mount")
            .args(["-t", "squashfs", "-o", "loop,ro"])
            .args([&sqsh, &target])
            .status()
            .unwrap();
        assert!(mounted.success(), "mounting {}", target.display());
        LeftMount(target)
    }
}

impl Drop for LeftMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn agent_heartbeats_carry_the_node_changes_go_at_once_and_a_hung_check_is_unknown() {
    let c = Cluster::new(1, &[("n1", "idle", "none"), ("n2", "idle", "none")]);
    c.leader(None);
    let d = c.path();
    // n1's store holds one image; its scratch has a job Slurm no longer runs (the fake squeue
    // knows only job 1).
    let hex = "ab".repeat(32);
    write(&d.join(format!("store/images/{hex}.json")), "{}");
    std::fs::create_dir_all(d.join("scratch/424242")).unwrap();
    executable(&d.join("bin/squeue"), "#!/bin/sh\necho '1 RUNNING'\n");
    // A container's cgroup whose record is gone, and an image left mounted that no container
    // uses (a real squashfs, unmounted when the test ends).
    std::fs::create_dir_all(d.join("cgroup/0123456789ab")).unwrap();
    let mounted = "cd".repeat(32);
    let _mount = LeftMount::new(d, &mounted);
    let sections = format!(
        "[store]\nroot = \"{}\"\n[scratch]\nroot = \"{}\"\n[runtime]\nstate_dir = \"{}\"\n\
         [cgroup]\nroot = \"{}\"\n[squashfs]\nmount_dir = \"{}\"\n",
        d.join("store").display(),
        d.join("scratch").display(),
        d.join("run").display(),
        d.join("cgroup").display(),
        d.join("mnt").display()
    );
    // A heartbeat a minute, checks every 200 ms: only a change sent at once drains n1 soon.
    let slow = |expected_gpus| Opts {
        expected_gpus,
        own_host: true,
        interval_ms: Some(60_000),
        agent: "check_interval_ms = 200\n".into(),
        sections: sections.clone(),
        ..Opts::default()
    };
    let _n1 = c.agent_with("n1", &slow(None), Some(&d.join("bin")));
    wait_for("n1's first heartbeat", 20, || {
        c.node(0, "n1").is_some_and(|n| n["leftovers"].is_array())
    });
    let n1 = c.node(0, "n1").unwrap();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
    assert_eq!(n1["boot_id"], boot.trim(), "{n1}");
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    assert_eq!(n1["versions"]["kernel"], kernel.trim(), "{n1}");
    assert_eq!(
        n1["images"],
        serde_json::json!([format!("sha256:{hex}")]),
        "{n1}"
    );
    assert_eq!(
        n1["leftovers"],
        serde_json::json!([
            "cgroup 0123456789ab",
            format!("mount sha256:{mounted}"),
            "scratch 424242"
        ]),
        "{n1}"
    );
    let metrics = c.text(&c.addrs[0], "/metrics").unwrap();
    assert_eq!(
        metric(&metrics, "berth_controller_leftovers{node=\"n1\"}"),
        Some(3.0),
        "{metrics}"
    );

    // A GPU goes missing: the next check round sees it and sends at once, not a minute later.
    c.config_with("n1", &slow(Some(1)));
    wait_for("n1 drained by a change sent at once", 20, || {
        c.slurm("n1").starts_with("drained|berth: gpu-count: ")
    });
    let metrics = c.text(&c.addrs[0], "/metrics").unwrap();
    assert!(
        metric(&metrics, "berth_controller_change_heartbeats_total").unwrap_or(0.0) >= 1.0,
        "{metrics}"
    );

    // n2's checks hang (a FIFO where sysfs has a file: opening it blocks, like a stuck
    // driver): the round times out, its checks are unknown, heartbeats go on, nothing drains.
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let hung = |expected_gpus| Opts {
        expected_gpus,
        own_host: true,
        interval_ms: Some(300),
        metrics_listen: metrics_addr.clone(),
        agent: "check_interval_ms = 100\ncheck_timeout_ms = 500\n".into(),
        ..Opts::default()
    };
    let _n2 = c.agent_with("n2", &hung(None), None);
    wait_for("n2's checks pass", 20, || {
        c.node(0, "n2").is_some_and(|n| {
            n["failing"].as_array().is_some_and(|f| f.is_empty())
                && n["unknown"].as_array().is_some_and(|f| f.is_empty())
        })
    });
    let online = d.join("host-n2/sys/devices/system/cpu/online");
    let fifo = d.join("host-n2/fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    std::fs::rename(&fifo, &online).unwrap();
    // Were the checks to finish now, gpu-count (hard) would fail and drain n2.
    c.config_with("n2", &hung(Some(1)));
    wait_for("n2's checks unknown", 20, || {
        c.node(0, "n2").is_some_and(|n| {
            n["unknown"].as_array().is_some_and(|u| {
                u.iter().any(|x| {
                    x.as_str().is_some_and(|x| {
                        x.starts_with("gpu-count: ") && x.contains("check_timeout_ms")
                    })
                })
            })
        })
    });
    let beats = |c: &Cluster| {
        let m = c.text(&metrics_addr, "/metrics").unwrap_or_default();
        metric(&m, "berth_agent_heartbeats_total").unwrap_or(0.0)
    };
    let before = beats(&c);
    wait_for("heartbeats while the checks hang", 20, || {
        beats(&c) >= before + 3.0
    });
    let m = c.text(&metrics_addr, "/metrics").unwrap();
    assert_eq!(
        metric(&m, "berth_agent_check_unknown{check=\"gpu-count\"}"),
        Some(1.0),
        "{m}"
    );
    assert_eq!(c.slurm("n2"), "idle|none");
    assert_eq!(c.node(0, "n2").unwrap()["desired"], "up");
    assert!(
        !c.calls().iter().any(|l| l.contains("NodeName=n2")),
        "{:?}",
        c.calls()
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn key_files_others_can_read_or_that_others_own_are_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    write(&key, &format!("{KEY}\n"));
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let data = dir.path().join("data");
    let controller = |key: &Path| {
        Command::new(controller_bin())
            .arg("--config")
            .arg(dir.path().join("none.toml"))
            .arg("serve")
            .args(["--listen", &format!("127.0.0.1:{}", free_port())])
            .arg("--data-dir")
            .arg(&data)
            .arg("--key-file")
            .arg(key)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    write(&dir.path().join("none.toml"), "");
    let out = controller(&key);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{out:?}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("mode 0644") && err.contains("chmod 600"),
        "{err}"
    );
    // The agent and the admin's CLI refuse it the same way.
    let cfg = dir.path().join("berth.toml");
    write(
        &cfg,
        &format!(
            "[agent]\ncontrollers = [\"127.0.0.1:1\"]\nkey_file = \"{}\"\nmetrics_listen = \"\"\n",
            key.display()
        ),
    );
    for args in [&["agent", "--once"][..], &["cluster", "status"][..]] {
        let out = Command::new(BERTH)
            .arg("--config")
            .arg(&cfg)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {out:?}");
        assert!(err.contains("mode 0644"), "{args:?}: {err}");
    }
    // Owned by another user (not root, not the caller): refused although 0600.
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::chown(&key, Some(65534), Some(65534)).unwrap();
    let out = controller(&key);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{out:?}");
    assert!(err.contains("owned by uid 65534"), "{err}");
}

/// A heartbeat straight to controller `i` (the simulator's way: no agent process), its one
/// hard check failing or passing; `Some(status)` when a controller answered.
fn post_beat(c: &Cluster, i: usize, node: &str, ok: bool) -> Option<u16> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(3)))
        .build()
        .into();
    let body = serde_json::json!({
        "node": node, "boot_id": "b", "version": "v",
        "checks": [{"name": "gpu-count", "status": if ok { "ok" } else { "fail" },
                    "severity": "hard", "recoverable": true,
                    "message": if ok { "8 of 8" } else { "7 of 8" }}]
    });
    let body = body.to_string();
    let r = agent
        .post(&format!("http://{}/v1/heartbeat", c.addrs[i]))
        .header(
            berth_api::auth::AUTH_HEADER,
            &signed("POST", "/v1/heartbeat", body.as_bytes()),
        )
        .content_type("application/json")
        .send(body.as_bytes())
        .ok()?;
    Some(r.status().as_u16())
}

/// The controller that exited (the failpoint), with its exit code.
fn exited(c: &mut Cluster) -> Option<(usize, Option<i32>)> {
    (0..c.controllers.len()).find_map(|i| {
        let p = c.controllers[i].as_mut()?;
        p.child.try_wait().unwrap().map(|st| (i, st.code()))
    })
}

/// Sends a heartbeat until a leader commits it (200): a leader that exits at the failpoint
/// while it is in flight leaves its fate unknown, so it goes again to the next leader. The
/// failpoint is disarmed as soon as a controller exited, so the next leader applies.
fn post_until_committed(c: &mut Cluster, node: &str, ok: bool, failpoint: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        let gone = exited(c).map(|(i, _)| i);
        if gone.is_some() {
            let _ = std::fs::remove_file(failpoint);
        }
        let leader = c.leader(gone);
        if post_beat(c, leader, node, ok) == Some(200) {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("no leader committed a heartbeat of {node} within 30 s");
}

/// Nodes drained in the fake Slurm.
fn slurm_drained(c: &Cluster, nodes: &[String]) -> Vec<String> {
    nodes
        .iter()
        .filter(|n| c.slurm(n).starts_with("drained|"))
        .cloned()
        .collect()
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn ten_leader_kills_and_the_commit_apply_failpoint_lose_no_decision() {
    let names: Vec<String> = (1..=12).map(|i| format!("n{i:02}")).collect();
    let slurm: Vec<(&str, &str, &str)> =
        names.iter().map(|n| (n.as_str(), "idle", "none")).collect();
    // Every decision here is wanted: the breaker must not hold drains back.
    let mut c = Cluster::build(3, &slurm, Vec::new(), "breaker_min = 1000\n");
    let failpoint = c.path().join("failpoint");
    // Every node known and healthy.
    let l = c.leader(None);
    for n in &names {
        assert_eq!(post_beat(&c, l, n, true), Some(200));
    }
    let mut expected = std::collections::BTreeSet::new();
    let mut fired = 0;
    for k in 0..10 {
        // Two drains for one reason (one grouped call) and, on odd rounds from 3 on, one resume
        // of a node drained before (3 passes).
        let a = &names[k % names.len()];
        let b = &names[(k + 5) % names.len()];
        // On even rounds the failpoint: the leader exits right before it would apply, maybe
        // while a heartbeat is in flight (then it is sent again until a leader commits it;
        // a failing heartbeat sent twice decides the same).
        let armed = k % 2 == 0;
        if armed {
            write(&failpoint, "");
        }
        for n in [a, b] {
            post_until_committed(&mut c, n, false, &failpoint);
            expected.insert(n.clone());
        }
        if !armed && k >= 3 {
            let r = &names[(k + 9) % names.len()];
            if ![a, b].contains(&r) && expected.contains(r) {
                let leader = c.leader(None);
                for _ in 0..3 {
                    assert_eq!(post_beat(&c, leader, r, true), Some(200), "round {k}");
                }
                expected.remove(r);
            }
        }
        let victim = if armed {
            // The failpoint fires at the leader's next reconciliation.
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut gone = exited(&mut c);
            while gone.is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
                gone = exited(&mut c);
            }
            let _ = std::fs::remove_file(&failpoint);
            match gone {
                Some((i, code)) => {
                    assert_eq!(code, Some(86), "round {k}");
                    fired += 1;
                    i
                }
                None => c.leader(None),
            }
        } else {
            c.leader(None)
        };
        let proc = c.controllers[victim].as_mut().unwrap();
        if proc.child.try_wait().unwrap().is_none() {
            proc.signal(nix::sys::signal::Signal::SIGKILL);
        }
        c.controllers[victim] = None;
        c.leader(Some(victim));
        c.controllers[victim] = Some(c.start(victim));
    }
    assert!(fired >= 3, "the failpoint fired in {fired} of 5 rounds");
    // Healed: all three run. The new leader applies what was committed and not applied.
    c.leader(None);
    let want: Vec<String> = expected.iter().cloned().collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while slurm_drained(&c, &names) != want && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let leader = c.leader(None);
    assert_eq!(
        slurm_drained(&c, &names),
        want,
        "Slurm's drained set is not the committed one after 10 s; the leader's view: {}; calls: {:?}",
        c.get(leader, "/v1/nodes").unwrap_or_default(),
        c.calls()
    );
    wait_for("the replicas' state hashes agree", 5, || {
        let h = hashes(&c);
        h.len() == 3 && h.iter().all(|x| *x == h[0])
    });
    // Grouped: at least one call drained two nodes for one reason.
    let calls = c.calls();
    assert!(
        calls
            .iter()
            .any(|l| l.contains(",n") && l.contains("State=DRAIN Reason=berth: gpu-count: 7 of 8")),
        "{calls:?}"
    );
    // Every call came from the leader of its term: no term has two callers.
    let mut by_term = std::collections::BTreeMap::<String, String>::new();
    for l in &calls {
        let mut f = l.split(' ');
        let (id, term) = (f.next().unwrap().to_string(), f.next().unwrap().to_string());
        let prev = by_term.entry(term).or_insert_with(|| id.clone());
        assert_eq!(*prev, id, "{calls:?}");
    }
}

/// `promtool check metrics` of a metrics text; panics with promtool's words when it refuses.
fn promtool_metrics(what: &str, text: &str) {
    use std::io::Write;
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (integration/setup.sh extracts it from Debian's prometheus package)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics refuses the {what}'s /metrics: {}{}\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn metrics_pass_promtool_and_the_alert_rules_load_and_name_real_metrics() {
    let c = Cluster::new(
        1,
        &[
            ("n1", "idle", "none"),
            ("n2", "idle", "none"),
            ("n3", "idle", "none"),
            ("n4", "idle", "none"),
        ],
    );
    c.leader(None);
    // Three hard failures among four nodes: two drain (the breaker's minimum), one is held back.
    for n in ["n1", "n2", "n3", "n4"] {
        assert_eq!(post_beat(&c, 0, n, true), Some(200));
    }
    for n in ["n1", "n2", "n3"] {
        assert_eq!(post_beat(&c, 0, n, false), Some(200));
    }
    wait_for("two drains applied", 20, || {
        c.slurm("n1").starts_with("drained|") && c.slurm("n2").starts_with("drained|")
    });
    let controller = c.text(&c.addrs[0], "/metrics").unwrap();
    assert_eq!(
        metric(
            &controller,
            "berth_controller_suppressed_drains_total{check=\"gpu-count\"}"
        ),
        Some(1.0),
        "{controller}"
    );
    assert_eq!(
        metric(&controller, "berth_controller_breaker_tripped"),
        Some(1.0)
    );
    promtool_metrics("controller", &controller);

    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let _agent = c.agent_with(
        "n4",
        &Opts {
            metrics_listen: metrics_addr.clone(),
            ..Opts::default()
        },
        None,
    );
    let mut agent = String::new();
    wait_for("the agent's metrics after a heartbeat", 20, || {
        agent = c.text(&metrics_addr, "/metrics").unwrap_or_default();
        metric(&agent, "berth_agent_heartbeats_total").unwrap_or(0.0) >= 1.0
    });
    promtool_metrics("agent", &agent);
    // Again, now that a node reported its daemons (the families of the watch on Slurm).
    let controller = c.text(&c.addrs[0], "/metrics").unwrap();
    promtool_metrics("controller", &controller);

    let rules = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/berth-alerts.yml");
    let out = Command::new("promtool")
        .args(["check", "rules"])
        .arg(&rules)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    // Every metric an alert asks for exists under that name (a rename breaks no alert silently).
    let text = std::fs::read_to_string(&rules).unwrap();
    let mut names: Vec<&str> = text
        .split(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '_'))
        .filter(|w| w.starts_with("berth_controller_") || w.starts_with("berth_agent_"))
        .collect();
    names.sort();
    names.dedup();
    assert!(names.len() >= 6, "{names:?}");
    for name in names {
        let found = controller
            .lines()
            .chain(agent.lines())
            .any(|l| l.starts_with(&format!("# TYPE {name} ")));
        assert!(found, "the alert rules use {name}, which no /metrics has");
    }
}
