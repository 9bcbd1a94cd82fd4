//! Root tier: node access through pam_berth.so (issue 28), with a real OpenSSH server on a real
//! one-host Slurm of this file's own (integration/slurm/start.sh --contain, its own state
//! directory and ports, started once per test binary, stopped at exit), and for the node-name
//! test a second one with two slurmd on this host (start.sh --nodes 2) and an sshd per node. sshd
//! runs on a free loopback port with its own host key and configuration, in a private mount
//! namespace where the test's PAM stack is bound over /etc/pam.d/sshd: the host's PAM files are
//! never touched.
//! Run by integration/test.sh as root:
//! `cargo test --test root_pam -- --ignored --test-threads=1`.
//!
//! `BERTH_TEST_PAM=none` puts pam_permit.so where the module goes, to show each test failing
//! without it; `BERTH_TEST_PAM=/path/libpam_berth.so` loads another build of the module (an older
//! one, to show a test failing without the change it covers).

mod common;

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::*;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Distinct from the other root test files' clusters (another hash input), per checkout.
fn checkout_hash() -> u32 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    std::hash::Hash::hash(&(env!("CARGO_MANIFEST_DIR"), "root_pam"), &mut h);
    u32::try_from(std::hash::Hasher::finish(&h) & u64::from(u32::MAX)).unwrap()
}

fn state_path() -> PathBuf {
    PathBuf::from(format!("/tmp/berth-root-pam-{:08x}", checkout_hash()))
}

/// How long the module waits for Slurm before `action_generic_failure` (deny) applies.
const SLURM_TIMEOUT_MS: u64 = 3000;

struct Cluster {
    state: PathBuf,
    conf: PathBuf,
    /// The Slurm name of the one node.
    node: String,
    /// A directory every user can use as the working directory of sbatch.
    cwd: PathBuf,
    /// sshd's loopback port.
    ssh_port: u16,
    /// The client's private key, authorized for every test user and root.
    key: PathBuf,
}

/// The sshd listeners this process started, stopped at exit.
static SSHD_PIDS: std::sync::Mutex<Vec<u32>> = std::sync::Mutex::new(Vec::new());

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Two consecutive free TCP ports on the loopback (slurmctld's and slurmd's).
fn free_port_pair() -> u16 {
    for _ in 0..50 {
        let p = free_port();
        if p < 65000 && std::net::TcpListener::bind(("0.0.0.0", p + 1)).is_ok() {
            return p;
        }
    }
    panic!("no two consecutive free ports found");
}

fn build(package: &str, profile_dir: &Path) {
    let mut build = Command::new(env!("CARGO"));
    build.args(["build", "-p", package]);
    if profile_dir.file_name().and_then(|n| n.to_str()) == Some("release") {
        build.arg("--release");
    }
    let status = build
        .current_dir(repo())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("running cargo");
    assert!(status.success(), "cargo build -p {package} failed");
}

fn cluster() -> &'static Cluster {
    static CLUSTER: OnceLock<Cluster> = OnceLock::new();
    CLUSTER.get_or_init(|| {
        let profile_dir = Path::new(BERTH).parent().unwrap().to_path_buf();
        build("berth-spank", &profile_dir);
        build("berth-pam", &profile_dir);
        let state = state_path();
        let berth_config = PathBuf::from(format!("{}.toml", state.display()));
        std::fs::write(
            &berth_config,
            format!(
                "[cgroup]\nroot = \"{}-pam\"\n[runtime]\nstate_dir = \"{s}/berth/state\"\n\
                 [squashfs]\nmount_dir = \"{s}/berth/images\"\n\
                 [scratch]\nroot = \"{s}/berth/scratch\"\n",
                cgroup_root(),
                s = state.display(),
            ),
        )
        .unwrap();
        extern "C" fn stop_all() {
            let pids = SSHD_PIDS.lock().map(|p| p.clone()).unwrap_or_default();
            for pid in pids {
                // SAFETY: killing an sshd listener this process started.
                unsafe { libc::kill(i32::try_from(pid).unwrap_or(0), libc::SIGTERM) };
            }
            for state in [state_path(), two_nodes_state()] {
                let _ = Command::new("bash")
                    .arg(repo().join("integration/slurm/stop.sh"))
                    .arg("--state")
                    .arg(state)
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status();
            }
        }
        // SAFETY: registering a plain function to run at process exit.
        unsafe { libc::atexit(stop_all) };
        let out = Command::new("bash")
            .arg(repo().join("integration/slurm/start.sh"))
            .arg("--state")
            .arg(&state)
            .arg("--plugin")
            .arg(profile_dir.join("libspank_berth.so"))
            .arg("--berth")
            .arg(berth_bin())
            .arg("--berth-config")
            .arg(&berth_config)
            .arg("--contain")
            .env("BERTH_SLURM_PORT", free_port_pair().to_string())
            .stdin(Stdio::null())
            .output()
            .expect("running integration/slurm/start.sh");
        assert!(
            out.status.success(),
            "integration/slurm/start.sh failed:\n{}{}",
            stdout(&out),
            stderr(&out)
        );
        let conf = state.join("etc/slurm.conf");
        let node = std::fs::read_to_string(&conf)
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("# nodes: ").map(str::to_string))
            .expect("slurm.conf names its nodes");
        let cwd = state.join("cwd");
        std::fs::create_dir_all(&cwd).unwrap();
        std::fs::set_permissions(&cwd, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let module = module_line(
            &profile_dir,
            &format!(
                "nodename={node} slurm_conf={} state_dir={} timeout_ms={SLURM_TIMEOUT_MS}",
                conf.display(),
                state.join("berth/state").display()
            ),
        );
        let (ssh_port, key) = start_sshd(&state.join("ssh"), &module);
        Cluster {
            state,
            conf,
            node,
            cwd,
            ssh_port,
            key,
        }
    })
}

/// The module's PAM line with `args`: this build's, `BERTH_TEST_PAM`'s, or pam_permit.so.
fn module_line(profile_dir: &Path, args: &str) -> String {
    match std::env::var("BERTH_TEST_PAM").as_deref() {
        Ok("none") => "pam_permit.so".to_string(),
        Ok(path) if path.starts_with('/') => format!("{path} {args}"),
        _ => format!("{} {args}", profile_dir.join("libpam_berth.so").display()),
    }
}

/// sshd on a free loopback port, with a PAM stack of `module` in the account and session stacks
/// bound over /etc/pam.d/sshd in a mount namespace of its own; its files in `dir`. Returns the
/// port and the client's key.
fn start_sshd(dir: &Path, module: &str) -> (u16, PathBuf) {
    let keys = dir.join("keys");
    std::fs::create_dir_all(&keys).unwrap();
    for name in ["host_key", "client_key"] {
        let _ = std::fs::remove_file(dir.join(name));
        let out = Command::new("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", ""])
            .arg("-f")
            .arg(dir.join(name))
            .output()
            .expect("running ssh-keygen (apt-get install openssh-client)");
        assert!(out.status.success(), "ssh-keygen: {}", stderr(&out));
    }
    let public = std::fs::read(dir.join("client_key.pub")).unwrap();
    for user in ["root", "berthtest", OTHER] {
        std::fs::write(keys.join(user), &public).unwrap();
    }
    let pam = dir.join("pam");
    std::fs::write(
        &pam,
        format!(
            "auth required pam_deny.so\naccount required {module}\nsession required {module}\n"
        ),
    )
    .unwrap();
    let port = free_port();
    let config = dir.join("sshd_config");
    std::fs::write(
        &config,
        format!(
            "ListenAddress 127.0.0.1\nHostKey {d}/host_key\nPidFile {d}/sshd.pid\nUsePAM yes\n\
             AuthorizedKeysFile {d}/keys/%u\nPasswordAuthentication no\n\
             KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n\
             StrictModes no\nSubsystem sftp internal-sftp\n",
            d = dir.display()
        ),
    )
    .unwrap();
    std::fs::create_dir_all("/run/sshd").unwrap();
    let log = std::fs::File::create(dir.join("sshd.log")).unwrap();
    let child = Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c"])
        .arg("mount --bind \"$1\" /etc/pam.d/sshd && exec /usr/sbin/sshd -D -e -p \"$2\" -f \"$3\"")
        .arg("sh")
        .arg(&pam)
        .arg(port.to_string())
        .arg(&config)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("starting sshd (apt-get install openssh-server)");
    SSHD_PIDS.lock().unwrap().push(child.id());
    // Runs until the atexit handler stops it; the test binary's exit reaps it.
    std::mem::forget(child);
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "sshd did not listen on port {port}: {}",
            std::fs::read_to_string(dir.join("sshd.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    (port, dir.join("client_key"))
}

/// A second non-root user, whose jobs berthtest must never reach.
const OTHER: &str = "berthpam2";

fn other_user() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let exists = Command::new("id")
            .arg(OTHER)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap()
            .success();
        if !exists {
            let out = Command::new("useradd")
                .args(["-M", "-s", "/bin/sh", OTHER])
                .output()
                .unwrap();
            assert!(out.status.success(), "useradd: {}", stderr(&out));
        }
    });
}

/// `ssh user@127.0.0.1 cmd` to the test's sshd, as root's client with the test key.
fn ssh_command(user: &str, cmd: &str) -> Command {
    let mut command = client("ssh", "-p");
    command.arg(format!("{user}@127.0.0.1")).arg(cmd);
    command
}

/// `program` (ssh or sftp) with the test key and options, ending with `port_flag PORT`.
fn client(program: &str, port_flag: &str) -> Command {
    let c = cluster();
    client_to(program, port_flag, c.ssh_port, &c.key)
}

/// `program` to the sshd on `port` with `key`.
fn client_to(program: &str, port_flag: &str, port: u16, key: &Path) -> Command {
    let mut command = Command::new("timeout");
    command
        .args(["60", program, "-i"])
        .arg(key)
        .args([
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "BatchMode=yes",
            "-o",
            "ConnectTimeout=20",
            port_flag,
        ])
        .arg(port.to_string())
        .stdin(Stdio::null());
    command
}

fn ssh(user: &str, cmd: &str) -> Output {
    ssh_command(user, cmd).output().expect("running ssh")
}

/// A running batch job of `user`, cancelled on drop.
struct Job {
    id: String,
}

impl Job {
    fn start(user: &str) -> Job {
        Job::start_with(user, &[])
    }

    /// A job with more sbatch options (`--container-image=…`).
    fn start_with(user: &str, options: &[&str]) -> Job {
        let c = cluster();
        let out = Command::new("runuser")
            .args(["-u", user, "--", "sbatch", "--parsable"])
            .args(options)
            .args(["--wrap", "sleep 600"])
            .env("SLURM_CONF", &c.conf)
            .current_dir(&c.cwd)
            .stdin(Stdio::null())
            .output()
            .expect("running sbatch");
        assert!(out.status.success(), "sbatch: {}", stderr(&out));
        let job = Job {
            id: stdout(&out).trim().to_string(),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let out = Command::new("squeue")
                .args(["-h", "-o", "%T", "-j", &job.id])
                .env("SLURM_CONF", &c.conf)
                .output()
                .unwrap();
            if stdout(&out).trim() == "RUNNING" {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "job {} not running after 60 s: {}",
                job.id,
                stdout(&out)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        job
    }

    fn cancel(&self) {
        let _ = Command::new("scancel")
            .arg(&self.id)
            .env("SLURM_CONF", &cluster().conf)
            .status();
    }

    /// The cgroup path (v1, freezer) of this job's extern step.
    fn extern_step(&self) -> String {
        format!("/job_{}/step_extern", self.id)
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        self.cancel();
    }
}

fn refusal(c: &Cluster) -> String {
    format!(
        "berth: access denied: you have no running job on {}",
        c.node
    )
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_user_without_a_job_is_refused_with_one_line() {
    let c = cluster();
    let _ = test_user();
    let out = ssh("berthtest", "echo in");
    assert!(
        !out.status.success() && !stdout(&out).contains("in"),
        "logged in without a job: {}{}",
        stdout(&out),
        stderr(&out)
    );
    assert_eq!(
        stderr(&out).matches(&refusal(c)).count(),
        1,
        "stderr: {}",
        stderr(&out)
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_session_runs_in_the_jobs_extern_step_and_ends_with_the_job() {
    let _ = test_user();
    let job = Job::start("berthtest");
    let out = ssh("berthtest", "cat /proc/self/cgroup");
    assert!(out.status.success(), "login refused: {}", stderr(&out));
    let freezer = stdout(&out)
        .lines()
        .find(|l| l.contains(":freezer:"))
        .unwrap_or_default()
        .to_string();
    assert!(
        freezer.ends_with(&job.extern_step()),
        "not in job {}'s extern step: {}",
        job.id,
        stdout(&out)
    );

    let mut session: Child = ssh_command("berthtest", "echo in; exec sleep 300")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(session.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert_eq!(first.trim(), "in");
    job.cancel();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = session.try_wait().unwrap() {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = session.kill();
            let _ = session.wait();
            panic!("the ssh session outlived job {} by 30 s", job.id);
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(!status.success(), "the session ended normally: {status}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn root_is_let_in_without_a_job_and_not_adopted() {
    let _ = cluster();
    let out = ssh("root", "id -u; cat /proc/self/cgroup");
    assert!(out.status.success(), "root refused: {}", stderr(&out));
    let text = stdout(&out);
    assert_eq!(text.lines().next(), Some("0"), "{text}");
    assert!(!text.contains("step_extern"), "{text}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn another_users_job_is_never_joined() {
    let c = cluster();
    let _ = test_user();
    other_user();
    let theirs = Job::start(OTHER);
    let out = ssh("berthtest", "cat /proc/self/cgroup");
    assert!(
        !out.status.success(),
        "let in on another user's job {}: {}",
        theirs.id,
        stdout(&out)
    );
    assert!(stderr(&out).contains(&refusal(c)), "{}", stderr(&out));

    // With a job of one's own beside theirs (theirs is not the newest here, but may be
    // any order), the session is in one's own job.
    let mine = Job::start("berthtest");
    let out = ssh("berthtest", "cat /proc/self/cgroup");
    assert!(out.status.success(), "login refused: {}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains(&mine.extern_step()), "{text}");
    assert!(!text.contains(&theirs.extern_step()), "{text}");
}

/// SIGCONTs slurmctld on drop, so a failed assertion leaves Slurm running.
struct Stopped(i32);

impl Drop for Stopped {
    fn drop(&mut self) {
        // SAFETY: resuming the slurmctld this file's cluster started.
        unsafe { libc::kill(self.0, libc::SIGCONT) };
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_stopped_slurm_denies_within_the_timeout() {
    let c = cluster();
    let _ = test_user();
    // A job of the user's own: what refuses the login is Slurm's silence, not a missing job.
    let job = Job::start("berthtest");
    let pid: i32 = std::fs::read_to_string(c.state.join("run/slurmctld.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // SAFETY: stopping the slurmctld this file's cluster started; Stopped resumes it.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let stopped = Stopped(pid);
    let started = Instant::now();
    let out = ssh("berthtest", "echo in");
    let took = started.elapsed();
    drop(stopped);
    assert!(
        !out.status.success() && !stdout(&out).contains("in"),
        "let in while Slurm did not answer (job {}): {}",
        job.id,
        stderr(&out)
    );
    assert!(
        stderr(&out).contains(&format!(
            "berth: access denied: cannot tell whether you have a job on {}",
            c.node
        )),
        "{}",
        stderr(&out)
    );
    // The module's deadline plus sshd's and the client's own work.
    assert!(
        took < Duration::from_millis(SLURM_TIMEOUT_MS) + Duration::from_secs(10),
        "the refusal took {took:?}"
    );
}

/// What the test image's /etc/os-release says (integration/busybox-rootfs.sh).
const IMAGE_OS: &str = "berth test image (busybox)";

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_session_lands_in_the_jobs_container_without_privileges() {
    let _ = test_user();
    let image = format!("--container-image={}", rootfs().display());
    let job = Job::start_with("berthtest", &[&image, "--container-name=dev"]);
    let out = ssh(
        "berthtest",
        "cat /etc/os-release; grep -E '^(NoNewPrivs|CapEff|CapPrm)' /proc/self/status; \
         cat /proc/self/cgroup",
    );
    assert!(out.status.success(), "login refused: {}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains(IMAGE_OS), "not in the container: {text}");
    assert!(text.contains("NoNewPrivs:\t1"), "{text}");
    assert!(text.contains("CapEff:\t0000000000000000"), "{text}");
    assert!(text.contains("CapPrm:\t0000000000000000"), "{text}");
    assert!(text.contains(&job.extern_step()), "{text}");

    // An interactive login (a pty, no command): its first line names the job and container.
    // The input goes in only after the first line: the pty echoes whatever comes before.
    let mut login = client("ssh", "-p")
        .arg("-tt")
        .arg("berthtest@127.0.0.1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(login.stdout.take().unwrap());
    let mut first = String::new();
    while first.trim().is_empty() {
        first.clear();
        if lines.read_line(&mut first).unwrap() == 0 {
            break;
        }
    }
    {
        use std::io::Write;
        let mut input = login.stdin.take().unwrap();
        input.write_all(b"tty; exit\n").unwrap();
    }
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut lines, &mut rest).unwrap();
    let _ = login.wait();
    assert_eq!(
        first.trim(),
        format!("berth: job {}, container dev", job.id),
        "{first}{rest}"
    );
    assert!(rest.contains("/dev/pts/"), "{rest}");

    // sftp (sshd's internal-sftp) reads the container's files.
    let dir = cluster().state.join("sftp");
    std::fs::create_dir_all(&dir).unwrap();
    let got = dir.join("os-release");
    let _ = std::fs::remove_file(&got);
    let batch = dir.join("batch");
    std::fs::write(&batch, format!("get /etc/os-release {}\n", got.display())).unwrap();
    let out = client("sftp", "-P")
        .arg("-b")
        .arg(&batch)
        .arg("berthtest@127.0.0.1")
        .output()
        .unwrap();
    assert!(out.status.success(), "sftp: {}", stderr(&out));
    let fetched = std::fs::read_to_string(&got).unwrap();
    assert!(fetched.contains(IMAGE_OS), "{fetched}");

    // Port forwarding (what VS Code Remote-SSH needs): the network is still the node's.
    let service = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let target = service.local_addr().unwrap().port();
    std::thread::spawn(move || {
        if let Ok((mut conn, _)) = service.accept() {
            use std::io::Write;
            let _ = conn.write_all(b"forwarded\n");
        }
    });
    let local = free_port();
    let mut forward = client("ssh", "-p")
        .args(["-N", "-L", &format!("{local}:127.0.0.1:{target}")])
        .arg("berthtest@127.0.0.1")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut got = String::new();
    while got.is_empty() && Instant::now() < deadline {
        if let Ok(conn) = std::net::TcpStream::connect(("127.0.0.1", local)) {
            let _ = BufReader::new(conn).read_line(&mut got);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = forward.kill();
    let _ = forward.wait();
    assert_eq!(got.trim(), "forwarded");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn another_users_container_is_never_entered() {
    let _ = test_user();
    other_user();
    let image = format!("--container-image={}", rootfs().display());
    let theirs = Job::start_with(OTHER, &[&image, "--container-name=dev"]);
    let mine = Job::start("berthtest");
    let out = ssh("berthtest", "cat /etc/os-release /proc/self/cgroup");
    assert!(out.status.success(), "login refused: {}", stderr(&out));
    let text = stdout(&out);
    assert!(
        !text.contains(IMAGE_OS),
        "in job {}'s container: {text}",
        theirs.id
    );
    assert!(text.contains(&mine.extern_step()), "{text}");
}

/// The test's client key as a file of `user`'s own (ssh refuses a key others can read), for an ssh
/// client that runs as that user.
fn key_of(user: &str) -> PathBuf {
    let c = cluster();
    let key = c.state.join(format!("ssh/key.{user}"));
    std::fs::copy(&c.key, &key).unwrap();
    let out = Command::new("chown").arg(user).arg(&key).output().unwrap();
    assert!(out.status.success(), "chown: {}", stderr(&out));
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    key
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn two_jobs_the_one_the_ssh_client_runs_in_else_the_newest() {
    let c = cluster();
    let _ = test_user();
    let older = Job::start("berthtest");
    let newer = Job::start("berthtest");
    // From outside both (root's client, not in a job): the newest.
    let out = ssh("berthtest", "cat /proc/self/cgroup");
    assert!(out.status.success(), "login refused: {}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains(&newer.extern_step()) && !text.contains(&older.extern_step()),
        "not in the newest job {}: {text}",
        newer.id
    );
    // The client runs in the older job (a step of it, as the user): the older job.
    let key = key_of("berthtest");
    let out = Command::new("runuser")
        .args([
            "-u",
            "berthtest",
            "--",
            "srun",
            "-Q",
            "--overlap",
            "--jobid",
        ])
        .arg(&older.id)
        .args(["timeout", "60", "ssh", "-i"])
        .arg(&key)
        .args([
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "BatchMode=yes",
            "-o",
            "LogLevel=ERROR",
            "-p",
        ])
        .arg(c.ssh_port.to_string())
        .args(["berthtest@127.0.0.1", "cat /proc/self/cgroup"])
        .env("SLURM_CONF", &c.conf)
        .current_dir(&c.cwd)
        .stdin(Stdio::null())
        .output()
        .expect("running srun");
    assert!(
        out.status.success(),
        "login from job {} refused: {}",
        older.id,
        stderr(&out)
    );
    let text = stdout(&out);
    assert!(
        text.contains(&older.extern_step()) && !text.contains(&newer.extern_step()),
        "not in job {}, where the ssh client runs: {text}",
        older.id
    );
}

/// The mount namespace (`readlink /proc/PID/ns/mnt`) of the live container named `name` of `job`,
/// from berth's state (root's), once its init runs; panics after 60 s.
fn container_mnt_ns(job: &Job, name: &str) -> String {
    let state = cluster().state.join("berth/state");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        for entry in std::fs::read_dir(&state).into_iter().flatten().flatten() {
            let Ok(text) = std::fs::read_to_string(entry.path().join("state.json")) else {
                continue;
            };
            let Ok(record) = serde_json::from_str::<serde_json::Value>(&text) else {
                continue;
            };
            let labels = &record["labels"];
            if labels["job"] != job.id.as_str() || labels["name"] != name {
                continue;
            }
            let pid = record["init_pid"].as_i64().unwrap_or(0);
            if let (true, Ok(ns)) = (pid > 0, std::fs::read_link(format!("/proc/{pid}/ns/mnt"))) {
                return ns.display().to_string();
            }
        }
        assert!(
            Instant::now() < deadline,
            "no live container {name} of job {} after 60 s",
            job.id
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A step of `job` as `user` running `sleep 600` in a container of its own (`--container-name`),
/// killed on drop.
struct Step(Child);

impl Step {
    fn start(user: &str, job: &Job, options: &[&str]) -> Step {
        let c = cluster();
        let child = Command::new("runuser")
            .args(["-u", user, "--", "srun", "-Q", "--overlap", "--jobid"])
            .arg(&job.id)
            .args(options)
            .args(["sleep", "600"])
            .env("SLURM_CONF", &c.conf)
            .current_dir(&c.cwd)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("running srun");
        Step(child)
    }
}

impl Drop for Step {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// berthtest's home with `~/.config/berth/ssh-container` holding `name`, the user's own; the
/// home is removed on drop when this made it.
struct Choice {
    made: Option<PathBuf>,
    file: PathBuf,
}

impl Choice {
    fn write(name: &str) -> Choice {
        let home = PathBuf::from("/home/berthtest");
        let made = (!home.exists()).then(|| home.clone());
        let dir = home.join(".config/berth");
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("ssh-container");
        std::fs::write(&file, format!("{name}\n")).unwrap();
        let (uid, gid, _) = test_user();
        for p in [&home, &home.join(".config"), &dir, &file] {
            std::os::unix::fs::chown(p, Some(uid), Some(gid)).unwrap();
        }
        Choice { made, file }
    }
}

impl Drop for Choice {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.file);
        if let Some(home) = &self.made {
            let _ = std::fs::remove_dir_all(home);
        }
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_container_of_the_job_is_chosen_by_its_name_in_the_users_config() {
    let _ = test_user();
    let image = format!("--container-image={}", rootfs().display());
    let job = Job::start_with("berthtest", &[&image, "--container-name=pick-dev"]);
    let dev = container_mnt_ns(&job, "pick-dev");
    // A second container of the job, started later: the newest.
    let _tools = Step::start("berthtest", &job, &[&image, "--container-name=pick-tools"]);
    let tools = container_mnt_ns(&job, "pick-tools");
    assert_ne!(dev, tools);
    let out = ssh("berthtest", "readlink /proc/self/ns/mnt");
    assert!(out.status.success(), "login refused: {}", stderr(&out));
    assert_eq!(stdout(&out).trim(), tools, "not in the newest container");

    let choice = Choice::write("pick-dev");
    let out = ssh("berthtest", "readlink /proc/self/ns/mnt");
    assert!(out.status.success(), "login refused: {}", stderr(&out));
    assert_eq!(
        stdout(&out).trim(),
        dev,
        "not in the container named in ~/.config/berth/ssh-container (tools is {tools})"
    );
    // A name no container of the job has: the newest, as without a choice.
    drop(choice);
    let choice = Choice::write("../pick-dev");
    let out = ssh("berthtest", "readlink /proc/self/ns/mnt");
    assert_eq!(stdout(&out).trim(), tools, "{}", stderr(&out));
    // Another user's container by its name: never; the user's own newest.
    drop(choice);
    other_user();
    let theirs_job = Job::start_with(OTHER, &[&image, "--container-name=pick-theirs"]);
    let theirs = container_mnt_ns(&theirs_job, "pick-theirs");
    let _choice = Choice::write("pick-theirs");
    let out = ssh("berthtest", "readlink /proc/self/ns/mnt");
    assert!(out.status.success(), "login refused: {}", stderr(&out));
    assert_ne!(stdout(&out).trim(), theirs, "in {OTHER}'s container");
    assert_eq!(stdout(&out).trim(), tools, "{}", stderr(&out));
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_session_in_a_container_has_the_containers_environment() {
    let _ = test_user();
    let image = format!("--container-image={}", rootfs().display());
    // What the container's process gets from the job (a directory image has no variables).
    let export = "--export=ALL,PATH=/opt/berth-image/bin:/usr/bin:/bin,BERTH_PAM_MARK=in-the-job";
    let job = Job::start_with("berthtest", &[&image, "--container-name=envs", export]);
    let _ = container_mnt_ns(&job, "envs");
    let out = ssh(
        "berthtest",
        "echo \"PATH=$PATH\"; echo \"MARK=$BERTH_PAM_MARK\"; echo \"HOME=$HOME\"; \
         echo \"USER=$USER\"; cat /etc/os-release",
    );
    assert!(out.status.success(), "login refused: {}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains(IMAGE_OS), "not in the container: {text}");
    assert!(
        text.contains("PATH=/opt/berth-image/bin:/usr/bin:/bin\n"),
        "not the container's PATH: {text}"
    );
    assert!(text.contains("MARK=in-the-job\n"), "{text}");
    // The login's own: the user's, not the container's (the job's HOME, root's here).
    assert!(text.contains("HOME=/home/berthtest\n"), "{text}");
    assert!(text.contains("USER=berthtest\n"), "{text}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn sftp_lists_the_images_files_through_internal_sftp() {
    let _ = test_user();
    let only = "berth-pam-image-only";
    let marker = rootfs().join(only);
    if !marker.exists() {
        std::fs::write(&marker, "in the image\n").unwrap();
    }
    assert!(!Path::new("/").join(only).exists());
    let image = format!("--container-image={}", rootfs().display());
    let job = Job::start_with("berthtest", &[&image, "--container-name=files"]);
    let _ = container_mnt_ns(&job, "files");
    let dir = cluster().state.join("sftp");
    std::fs::create_dir_all(&dir).unwrap();
    let batch = dir.join("ls-batch");
    std::fs::write(&batch, "ls -1 /\n").unwrap();
    let out = client("sftp", "-P")
        .arg("-b")
        .arg(&batch)
        .arg("berthtest@127.0.0.1")
        .output()
        .unwrap();
    assert!(out.status.success(), "sftp: {}", stderr(&out));
    assert!(
        stdout(&out).lines().any(|l| l.trim() == format!("/{only}")),
        "the image's file is not listed: {}",
        stdout(&out)
    );
}

fn two_nodes_state() -> PathBuf {
    PathBuf::from(format!("{}-2n", state_path().display()))
}

/// A second cluster of this file: two slurmd on this host (start.sh --nodes 2, nodes n1 and n2 of
/// one host name), and three sshd standing for them: told `nodename=` n1, n2, and not told. Its
/// slurmd track processes without cgroups (start.sh: two slurmd's cgroup v1 trees would meet), so
/// there is no extern step cgroup to join: every stack says action_adopt_failure=allow, and what
/// the tests see is the account decision.
struct TwoNodes {
    conf: PathBuf,
    nodes: [String; 2],
    /// sshd ports: told n1, told n2, not told.
    ports: [u16; 3],
    keys: [PathBuf; 3],
}

/// `n` consecutive free TCP ports (slurmctld's and each slurmd's).
fn free_port_run(n: u16) -> u16 {
    for _ in 0..50 {
        let p = free_port();
        if p < 65000 && (1..n).all(|i| std::net::TcpListener::bind(("0.0.0.0", p + i)).is_ok()) {
            return p;
        }
    }
    panic!("no {n} consecutive free ports found");
}

fn two_nodes() -> &'static TwoNodes {
    static TWO: OnceLock<TwoNodes> = OnceLock::new();
    TWO.get_or_init(|| {
        // The first cluster's set-up builds the plugin and the module and registers the stop.
        let _ = cluster();
        let profile_dir = Path::new(BERTH).parent().unwrap().to_path_buf();
        let state = two_nodes_state();
        let berth_config = PathBuf::from(format!("{}.toml", state.display()));
        std::fs::write(
            &berth_config,
            format!(
                "[cgroup]\nroot = \"{}-pam2\"\n[runtime]\nstate_dir = \"{s}/berth/state\"\n\
                 [squashfs]\nmount_dir = \"{s}/berth/images\"\n\
                 [scratch]\nroot = \"{s}/berth/scratch\"\n",
                cgroup_root(),
                s = state.display(),
            ),
        )
        .unwrap();
        let out = Command::new("bash")
            .arg(repo().join("integration/slurm/start.sh"))
            .arg("--state")
            .arg(&state)
            .args(["--nodes", "2", "--contain"])
            .arg("--plugin")
            .arg(profile_dir.join("libspank_berth.so"))
            .arg("--berth")
            .arg(berth_bin())
            .arg("--berth-config")
            .arg(&berth_config)
            .env("BERTH_SLURM_PORT", free_port_run(3).to_string())
            .stdin(Stdio::null())
            .output()
            .expect("running integration/slurm/start.sh");
        assert!(
            out.status.success(),
            "integration/slurm/start.sh --nodes 2 failed:\n{}{}",
            stdout(&out),
            stderr(&out)
        );
        let conf = state.join("etc/slurm.conf");
        let names: Vec<String> = std::fs::read_to_string(&conf)
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("# nodes: "))
            .expect("slurm.conf names its nodes")
            .split_whitespace()
            .map(str::to_string)
            .collect();
        let nodes: [String; 2] = names.try_into().expect("two nodes");
        let args = |nodename: &str| {
            module_line(
                &profile_dir,
                &format!(
                    "{nodename} slurm_conf={} state_dir={} timeout_ms={SLURM_TIMEOUT_MS} \
                     action_adopt_failure=allow",
                    conf.display(),
                    state.join("berth/state").display()
                ),
            )
        };
        let told1 = start_sshd(
            &state.join("ssh-n1"),
            &args(&format!("nodename={}", nodes[0])),
        );
        let told2 = start_sshd(
            &state.join("ssh-n2"),
            &args(&format!("nodename={}", nodes[1])),
        );
        let host = start_sshd(&state.join("ssh-host"), &args(""));
        TwoNodes {
            conf,
            nodes,
            ports: [told1.0, told2.0, host.0],
            keys: [told1.1, told2.1, host.1],
        }
    })
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_job_on_one_node_does_not_open_another_node_of_the_same_host() {
    let t = two_nodes();
    let _ = test_user();
    let cwd = cluster().cwd.clone();
    let out = Command::new("runuser")
        .args(["-u", "berthtest", "--", "sbatch", "--parsable", "-w"])
        .arg(&t.nodes[0])
        .args(["--wrap", "sleep 600"])
        .env("SLURM_CONF", &t.conf)
        .current_dir(&cwd)
        .stdin(Stdio::null())
        .output()
        .expect("running sbatch");
    assert!(out.status.success(), "sbatch: {}", stderr(&out));
    let id = stdout(&out).trim().to_string();
    struct Cancel<'a>(&'a str, &'a Path);
    impl Drop for Cancel<'_> {
        fn drop(&mut self) {
            let _ = Command::new("scancel")
                .arg(self.0)
                .env("SLURM_CONF", self.1)
                .status();
        }
    }
    let _cancel = Cancel(&id, &t.conf);
    let deadline = Instant::now() + Duration::from_secs(60);
    while stdout(
        &Command::new("squeue")
            .args(["-h", "-o", "%T", "-j", &id])
            .env("SLURM_CONF", &t.conf)
            .output()
            .unwrap(),
    )
    .trim()
        != "RUNNING"
    {
        assert!(Instant::now() < deadline, "job {id} not running after 60 s");
        std::thread::sleep(Duration::from_millis(100));
    }
    let login = |i: usize| {
        client_to("ssh", "-p", t.ports[i], &t.keys[i])
            .args(["berthtest@127.0.0.1", "echo in"])
            .output()
            .unwrap()
    };
    // The node of the job: in.
    let out = login(0);
    assert!(
        out.status.success() && stdout(&out).contains("in"),
        "refused on {}, the node of job {id}: {}",
        t.nodes[0],
        stderr(&out)
    );
    // The other node of the same host: refused, naming it.
    let out = login(1);
    assert!(
        !out.status.success() && !stdout(&out).contains("in"),
        "let in on {} by job {id} on {}: {}",
        t.nodes[1],
        t.nodes[0],
        stdout(&out)
    );
    assert!(
        stderr(&out).contains(&format!(
            "berth: access denied: you have no running job on {}",
            t.nodes[1]
        )),
        "{}",
        stderr(&out)
    );
    // Not told which node it is, on a host of two: it cannot tell, and refuses.
    let out = login(2);
    assert!(
        !out.status.success() && !stdout(&out).contains("in"),
        "let in on a host of two nodes without nodename= (job {id} on {}): {}",
        t.nodes[0],
        stdout(&out)
    );
    assert!(
        stderr(&out).contains("berth: access denied: cannot tell whether you have a job on"),
        "{}",
        stderr(&out)
    );
}
