//! The cluster's network (issue 26): the attacker is a local user who takes a port berth named
//! but is not holding (a departed agent's, a controller's address), or floods a real berth server
//! with connections that never prove the key. The key must never reach the attacker, its answers
//! must be refused, and keyed clients must still get through.
//!
//! Controllers are `berth-controller` beside the berth under test (`$BERTH_TEST_CONTROLLER_BIN`
//! for an older build). The attacker's listeners and floods are Python, run as the attacker,
//! bounded in time; every process started here is killed by PID when its guard drops.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::*;

const KEY: &str = "test-network-key-0123456789abcdef";

/// Kills and reaps its process (and the process group it leads) when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let pid = i32::try_from(self.0.id()).unwrap();
        // SAFETY: signalling a process group this test started and leads.
        unsafe { libc::kill(-pid, libc::SIGKILL) };
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn controller_bin() -> PathBuf {
    std::env::var_os("BERTH_TEST_CONTROLLER_BIN").map_or_else(
        || Path::new(BERTH).with_file_name("berth-controller"),
        PathBuf::from,
    )
}

/// The key file, root's and 0600 (a key others can read is refused).
fn key_file(dir: &Path) -> PathBuf {
    let key = dir.join("cluster.key");
    std::fs::write(&key, format!("{KEY}\n")).unwrap();
    chmod(&key, 0o600);
    key
}

/// A berth.toml whose `[agent]` names `controllers`, plus `extra`.
fn node_config(dir: &Path, controllers: &[String], extra: &str) -> PathBuf {
    let list: Vec<String> = controllers.iter().map(|c| format!("\"{c}\"")).collect();
    let path = dir.join("berth.toml");
    std::fs::write(
        &path,
        format!(
            "[cgroup]\nroot = \"{cg}\"\n[runtime]\nstate_dir = \"{d}/state\"\n\
             [store]\nroot = \"{d}/store\"\n[squashfs]\nmount_dir = \"{d}/mnt\"\n\
             [scratch]\nroot = \"{d}/scratch\"\n\
             [agent]\ncontrollers = [{}]\nkey_file = \"{}\"\nmetrics_listen = \"\"\n\
             node_name = \"n1\"\ninterval_ms = 500\n{extra}",
            list.join(", "),
            dir.join("cluster.key").display(),
            cg = cgroup_root(),
            d = dir.display(),
        ),
    )
    .unwrap();
    path
}

/// Python run as the attacker in its own process group, `args` after the script.
fn attacker_python(script: &str, args: &[String]) -> Proc {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new("/usr/bin/python3");
    cmd.arg("-c").arg(script).args(args);
    as_uid(&mut cmd, attacker())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0);
    Proc(cmd.spawn().unwrap())
}

fn wait_for(what: &str, secs: u64, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        if cond() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("timed out after {secs} s waiting for {what}");
}

/// The attacker's listener on `port`: records every byte it gets into `record` and answers each
/// request with a 200 and a plausible body (no proof of the key: it has none).
const FAKE_SERVER: &str = r#"
import socket, sys, threading, time
port, record = int(sys.argv[1]), sys.argv[2]
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", port)); s.listen(64)
open(record + ".ready", "w").close()
body = b'{"id":1,"leader":1,"leader_addr":null,"term":9,"applied":1,"voters":[1],"nodes":0,"drained":0,"breaker_tripped":false,"suppressed":0,"state_hash":"x"}'
def serve(c):
    c.settimeout(5)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = c.recv(65536)
            if not chunk: break
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        n = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"): n = int(line.split(b":")[1])
        while len(rest) < n:
            chunk = c.recv(65536)
            if not chunk: break
            rest += chunk
        with open(record, "ab") as f: f.write(head + b"\r\n\r\n" + rest)
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
    except Exception: pass
    c.close()
end = time.time() + 60
s.settimeout(1)
while time.time() < end:
    try: c, _ = s.accept()
    except socket.timeout: continue
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"#;

/// (a) The attacker holds the port `agent.controllers` names (the controller is gone): `berth
/// cluster status` and an agent's heartbeat go to it. Neither may carry the key, and both must
/// refuse the attacker's answer.
#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_user_holding_a_controller_port_gets_no_key_and_its_answers_are_refused() {
    let dir = workdir("network-fake-controller");
    key_file(&dir);
    let port = free_port();
    let record = dir.join("attacker/record");
    std::fs::create_dir_all(record.parent().unwrap()).unwrap();
    give(record.parent().unwrap(), attacker());
    let _fake = attacker_python(
        FAKE_SERVER,
        &[port.to_string(), record.display().to_string()],
    );
    wait_for("the attacker's listener", 10, || {
        record.with_extension("ready").exists()
    });
    let cfg = node_config(&dir, &[format!("127.0.0.1:{port}")], "");

    let status = Command::new(berth_bin())
        .arg("--config")
        .arg(&cfg)
        .args(["cluster", "status"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let agent = Command::new(berth_bin())
        .arg("--config")
        .arg(&cfg)
        .args(["agent", "--once"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let got = std::fs::read(&record).unwrap_or_default();
    let got = String::from_utf8_lossy(&got);
    assert!(
        got.contains("GET /v1/status"),
        "the CLI went to the attacker: {got}"
    );
    assert!(
        got.contains("POST /v1/heartbeat"),
        "the agent went to the attacker: {got}\n{}",
        stderr(&agent)
    );
    assert!(
        !got.contains(KEY),
        "the attacker received the cluster key:\n{got}"
    );
    assert!(
        !status.status.success(),
        "berth cluster status took the attacker's answer: {}",
        stdout(&status)
    );
    let err = stderr(&status);
    assert!(
        err.contains("does not hold the cluster key") && err.trim().lines().count() == 1,
        "one line saying why: {err}"
    );
    assert!(
        !agent.status.success(),
        "the agent's heartbeat took the attacker's answer: {}",
        stderr(&agent)
    );
}

/// Starts a lone controller on `addr` as systemd would without LimitNOFILE (soft limit 1024).
fn start_controller(dir: &Path, addr: &str) -> Proc {
    use std::os::unix::process::CommandExt;
    std::fs::write(dir.join("none.toml"), "[controller]\n").unwrap();
    let mut cmd = Command::new(controller_bin());
    cmd.arg("--config")
        .arg(dir.join("none.toml"))
        .arg("serve")
        .args(["--id", "1", "--listen", addr])
        .arg("--data-dir")
        .arg(dir.join("data"))
        .arg("--key-file")
        .arg(dir.join("cluster.key"))
        .args(["--sinfo", "/bin/true", "--scontrol", "/bin/true"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("controller.log")).unwrap())
        .process_group(0);
    // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let mut lim = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 {
                lim.rlim_cur = lim.rlim_cur.min(1024);
                libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
            }
            Ok(())
        })
    };
    Proc(cmd.spawn().unwrap())
}

/// Holds `count` connections to 127.0.0.1:`port` for `secs`, opening a new one for each the
/// server closes; with `slow`, sends one byte of a request head on each every 2 s.
const FLOOD: &str = r#"
import resource, socket, sys, time
port, count, secs, slow, ready = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5]
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
def conn():
    try:
        c = socket.create_connection(("127.0.0.1", port), timeout=2)
        c.setblocking(False)
        return c
    except Exception:
        return None
socks = [conn() for _ in range(count)]
open(ready, "w").close()
end = time.time() + secs
while time.time() < end:
    for i, c in enumerate(socks):
        alive = c is not None
        if alive:
            try:
                if c.recv(1) == b"": alive = False
            except BlockingIOError: pass
            except Exception: alive = False
        if alive and slow:
            try: c.send(b"G")
            except BlockingIOError: pass
            except Exception: alive = False
        if not alive:
            if c is not None: c.close()
            socks[i] = conn()
    time.sleep(2 if slow else 0.5)
"#;

/// (b) 1,100 idle connections from the attacker to a real controller: a keyed `berth cluster
/// status` still gets its answer, promptly.
#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn idle_connections_without_the_key_do_not_keep_keyed_clients_out_of_the_controller() {
    let dir = workdir("network-controller-flood");
    key_file(&dir);
    let addr = format!("127.0.0.1:{}", free_port());
    let _controller = start_controller(&dir, &addr);
    let cfg = node_config(&dir, std::slice::from_ref(&addr), "");
    let status = || {
        Command::new(berth_bin())
            .arg("--config")
            .arg(&cfg)
            .args(["cluster", "status"])
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    wait_for("the controller to lead", 30, || status().status.success());
    let ready = dir.join("attacker/ready");
    std::fs::create_dir_all(ready.parent().unwrap()).unwrap();
    give(ready.parent().unwrap(), attacker());
    let port = addr.rsplit_once(':').unwrap().1.to_string();
    let _flood = attacker_python(
        FLOOD,
        &[
            port,
            "1100".into(),
            "60".into(),
            "0".into(),
            ready.display().to_string(),
        ],
    );
    wait_for("the attacker's connections", 30, || ready.exists());
    for round in 0..5 {
        let t = Instant::now();
        let out = status();
        assert!(
            out.status.success() && t.elapsed() < Duration::from_secs(10),
            "round {round}: berth cluster status under 1,100 idle connections ({:?}): {}{}\n{}",
            t.elapsed(),
            stdout(&out),
            stderr(&out),
            std::fs::read_to_string(dir.join("controller.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// A keyed `GET` of `path` from the agent at 127.0.0.1:`port`: the body, and whether the answer
/// proved the key. The request also carries the key the old way, so that the old build is
/// judged on its connection limits, not refused for the signature it does not know.
type Fetched = (Vec<u8>, Result<(), String>);

fn keyed_get(port: u16, path: &str) -> Result<Fetched, String> {
    use berth_api::auth;
    let key = auth::Key::new(KEY);
    let signed = auth::sign_request(&key, "GET", path, b"").unwrap();
    let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        c,
        "GET {path} HTTP/1.1\r\nHost: x\r\n{}: {}\r\nAuthorization: Bearer {KEY}\r\n\r\n",
        auth::AUTH_HEADER,
        signed.header
    )
    .map_err(|e| e.to_string())?;
    let mut all = Vec::new();
    c.read_to_end(&mut all).map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&all).to_string();
    let (head, _) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("no answer: {text:?}"))?;
    let body = all[head.len() + 4..].to_vec();
    let status: u16 = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let header = |name: &str| {
        head.lines()
            .find_map(|l| {
                l.split_once(':')
                    .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            })
            .map(|(_, v)| v.trim().to_string())
    };
    if status != 200 {
        return Err(format!("HTTP {status}: {text}"));
    }
    let digest = path.rsplit('/').next().unwrap();
    let proved = auth::verify_answer(
        &key,
        header(auth::PROOF_HEADER).as_deref(),
        &signed.nonce,
        status,
        &auth::blob_tag(digest, body.len() as u64),
    )
    .map_err(|e| e.to_string());
    Ok((body, proved))
}

/// (c) 100 slow-loris connections from the attacker to a real agent's peer server: a keyed blob
/// fetch still gets the blob.
#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn slow_connections_without_the_key_do_not_stop_peer_fetches() {
    use sha2::Digest;
    let dir = workdir("network-peer-loris");
    key_file(&dir);
    let port = free_port();
    let cfg = node_config(
        &dir,
        &["127.0.0.1:1".to_string()],
        &format!("[peers]\nlisten = \"127.0.0.1:{port}\"\nmax_uploads = 8\n"),
    );
    // A blob in the node's cache, as an import leaves it.
    let blob = b"a layer the cluster shares\n".repeat(1000);
    let hex: String = sha2::Sha256::digest(&blob)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let blobs = dir.join("store/blobs");
    std::fs::create_dir_all(blobs.join("sha256")).unwrap();
    std::fs::create_dir_all(blobs.join("tmp")).unwrap();
    for d in [
        dir.join("store"),
        blobs.clone(),
        blobs.join("sha256"),
        blobs.join("tmp"),
    ] {
        chmod(&d, 0o700);
    }
    std::fs::write(blobs.join("sha256").join(&hex), &blob).unwrap();
    let path = format!("/v2/any/blobs/sha256:{hex}");

    let mut cmd = Command::new(berth_bin());
    cmd.arg("--config")
        .arg(&cfg)
        .arg("agent")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("agent.log")).unwrap());
    {
        use std::os::unix::process::CommandExt;
        cmd.process_group(0);
    }
    let _agent = Proc(cmd.spawn().unwrap());
    wait_for("the agent's peer port", 30, || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    let before = keyed_get(port, &path).unwrap();
    assert_eq!(before.0, blob, "before");

    let ready = dir.join("attacker/ready");
    std::fs::create_dir_all(ready.parent().unwrap()).unwrap();
    give(ready.parent().unwrap(), attacker());
    let _loris = attacker_python(
        FLOOD,
        &[
            port.to_string(),
            "100".into(),
            "60".into(),
            "1".into(),
            ready.display().to_string(),
        ],
    );
    wait_for("the attacker's connections", 30, || ready.exists());
    std::thread::sleep(Duration::from_secs(3));
    for round in 0..5 {
        let t = Instant::now();
        let got = keyed_get(port, &path);
        assert!(
            got.as_ref().is_ok_and(|g| g.0 == blob) && t.elapsed() < Duration::from_secs(10),
            "round {round}: a keyed blob fetch under 100 slow connections ({:?}): {:?}\n{}",
            t.elapsed(),
            got.map(|g| g.0.len()),
            std::fs::read_to_string(dir.join("agent.log")).unwrap_or_default()
        );
        assert_eq!(
            got.unwrap().1,
            Ok(()),
            "round {round}: the agent proved the key"
        );
        std::thread::sleep(Duration::from_secs(1));
    }
}
