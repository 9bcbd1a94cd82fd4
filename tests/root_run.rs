//! Root tier: `berth run` on this host's real kernel — namespaces, overlay, user switch, signals,
//! exit codes, cleanup and cgroup2 tracking. Run by integration/test.sh as root:
//! `cargo test --test root_run -- --ignored --test-threads=1`.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// Path → (mode, uid, gid, size, mtime, symlink target) for every entry under `root`.
fn snapshot(root: &Path) -> BTreeMap<String, String> {
    let mut map = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            let m = std::fs::symlink_metadata(&path).unwrap();
            let link = std::fs::read_link(&path).ok();
            map.insert(
                path.strip_prefix(root).unwrap().display().to_string(),
                format!(
                    "{:o} {} {} {} {} {:?}",
                    m.mode(),
                    m.uid(),
                    m.gid(),
                    m.size(),
                    m.mtime(),
                    link
                ),
            );
            if m.is_dir() {
                stack.push(path);
            }
        }
    }
    map
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn command_sees_its_own_pid_uts_ipc_and_mount_namespaces() {
    let host_ns = |ns: &str| std::fs::read_link(format!("/proc/self/ns/{ns}")).unwrap();
    let out = ok(run_sh(
        &["--hostname", "inside"],
        "echo pid=$$; hostname; cat /proc/1/cmdline | tr '\\0' ' '; echo; ls /proc | grep -c '^[0-9]'; \
         for n in pid uts ipc mnt cgroup net; do echo $n=$(readlink /proc/self/ns/$n); done",
    ));
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines[0], "pid=2",
        "the command is PID 2 under berth's init: {out}"
    );
    assert_eq!(lines[1], "inside");
    assert!(lines[2].contains("berth"), "PID 1 is berth's init: {out}");
    let procs: u32 = lines[3].trim().parse().unwrap();
    assert!(
        procs <= 4,
        "only the container's processes are visible, saw {procs}"
    );
    for ns in ["pid", "uts", "ipc", "mnt", "cgroup"] {
        let line = lines
            .iter()
            .find(|l| l.starts_with(&format!("{ns}=")))
            .unwrap();
        assert_ne!(
            line[ns.len() + 1..],
            *host_ns(if ns == "mnt" { "mnt" } else { ns }).to_string_lossy(),
            "{ns} namespace is the host's"
        );
    }
    let net = lines.iter().find(|l| l.starts_with("net=")).unwrap();
    assert_eq!(
        net[4..],
        *host_ns("net").to_string_lossy(),
        "--net host shares the network"
    );
    let host = nix::unistd::gethostname().unwrap();
    assert_ne!(
        host.to_string_lossy(),
        "inside",
        "the host's hostname changed"
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn net_none_has_only_loopback_up() {
    let out = ok(run_sh(
        &["--net", "none"],
        "cat /proc/net/dev | tail -n +3 | cut -d: -f1; ip link show lo 2>/dev/null | head -1",
    ));
    let ifaces: Vec<&str> = out
        .lines()
        .take_while(|l| !l.contains("<"))
        .map(str::trim)
        .collect();
    assert_eq!(ifaces, vec!["lo"], "{out}");
    assert!(out.contains("UP"), "lo is up: {out}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn rootfs_is_never_modified() {
    let before = snapshot(rootfs());
    let out = ok(run_sh(
        &[],
        "echo new > /newfile && echo x >> /etc/passwd && rm /bin/ls && mkdir -p /usr/new/dir && \
         chmod 700 /etc && rm -rf /var && ln -s /x /bin/dangling && ls /bin/ls 2>&1; echo done",
    ));
    assert!(out.contains("done"), "{out}");
    assert_eq!(before, snapshot(rootfs()), "the rootfs directory changed");
    // And the next container starts from the pristine tree again.
    let out = ok(run_sh(&[], "ls /newfile 2>&1; ls /bin/ls"));
    assert!(out.contains("No such file"), "{out}");
    assert!(out.contains("/bin/ls"), "{out}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn readonly_root_refuses_writes_but_tmp_works() {
    let o = run_sh(
        &["--readonly"],
        "touch /newfile; echo rc=$?; touch /tmp/ok && echo tmp-ok",
    );
    let out = stdout(&o) + &stderr(&o);
    assert!(out.contains("Read-only file system"), "{out}");
    assert!(out.contains("rc=1"), "{out}");
    assert!(out.contains("tmp-ok"), "{out}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn runs_as_the_requested_user_with_groups_and_no_privileges() {
    let (uid, gid, extra) = test_user();
    let out = ok(run_sh(
        &["--user", "berthtest"],
        "id -u; id -g; id -G; grep -E '^(CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs)' /proc/self/status",
    ));
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], uid.to_string());
    assert_eq!(lines[1], gid.to_string());
    assert!(
        lines[2].split(' ').any(|g| g == extra.to_string()),
        "supplementary group missing: {out}"
    );
    for cap in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert!(
            out.contains(&format!("{cap}:\t0000000000000000")),
            "{cap} not empty: {out}"
        );
    }
    assert!(out.contains("NoNewPrivs:\t1"), "{out}");
    // uid 0 inside keeps no capabilities either.
    let out = ok(run_sh(
        &["--user", "0"],
        "grep -E '^(CapEff|CapBnd)' /proc/self/status; cat /etc/shadow 2>&1 | head -1",
    ));
    assert!(out.contains("CapEff:\t0000000000000000"), "{out}");
    assert!(out.contains("CapBnd:\t0000000000000000"), "{out}");
    // Explicit uid:gid.
    let out = ok(run_sh(
        &["--user", &format!("{uid}:{extra}")],
        "id -u; id -g",
    ));
    assert_eq!(out, format!("{uid}\n{extra}\n"));
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn setuid_root_binary_in_the_image_does_not_give_root() {
    let (uid, _, _) = test_user();
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("rootfs");
    let status = Command::new("cp")
        .arg("-a")
        .arg(rootfs())
        .arg(&img)
        .status()
        .unwrap();
    assert!(status.success());
    // busybox picks the applet from its name: a setuid-root copy named `cat`.
    std::fs::create_dir(img.join("opt")).unwrap();
    let suid = img.join("opt/cat");
    std::fs::copy(img.join("bin/busybox"), &suid).unwrap();
    std::os::unix::fs::chown(&suid, Some(0), Some(0)).unwrap();
    std::fs::set_permissions(&suid, std::os::unix::fs::PermissionsExt::from_mode(0o4755)).unwrap();
    let o = Command::new(BERTH)
        .arg("--config")
        .arg(config())
        .args([
            "run",
            "--rootfs",
            img.to_str().unwrap(),
            "--user",
            "berthtest",
            "--",
            "/opt/cat",
            "/proc/self/status",
        ])
        .output()
        .unwrap();
    let status = ok(o);
    let ids = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    assert_eq!(
        ids.split_whitespace().skip(1).collect::<Vec<_>>(),
        vec![uid.to_string(); 4],
        "the setuid bit raised privileges: {ids}"
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn exit_statuses_follow_the_command() {
    let code = |extra: &[&str], script: &str| run_sh(extra, script).status.code().unwrap();
    assert_eq!(code(&[], "exit 0"), 0);
    assert_eq!(code(&[], "exit 7"), 7);
    assert_eq!(code(&[], "kill -TERM $$"), 143);
    assert_eq!(code(&[], "kill -KILL $$"), 137);
    let start = Instant::now();
    let o = run_sh(&["--timeout", "0.5"], "sleep 30");
    assert_eq!(o.status.code(), Some(124));
    assert!(stderr(&o).contains("timed out"), "{}", stderr(&o));
    assert!(start.elapsed() < Duration::from_secs(10));

    let rootfs = rootfs().to_str().unwrap();
    let o = berth(&["run", "--rootfs", rootfs, "--", "no-such-command"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(127));
    assert!(
        stderr(&o).contains("command not found in the container: no-such-command"),
        "{}",
        stderr(&o)
    );
    let o = berth(&["run", "--rootfs", rootfs, "--", "/etc/passwd"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(126));
    assert!(
        stderr(&o).contains("cannot execute /etc/passwd"),
        "{}",
        stderr(&o)
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn signals_are_forwarded_to_the_command() {
    for (sig, name) in [
        (libc::SIGTERM, "TERM"),
        (libc::SIGINT, "INT"),
        (libc::SIGHUP, "HUP"),
        (libc::SIGUSR1, "USR1"),
        (libc::SIGUSR2, "USR2"),
        (libc::SIGQUIT, "QUIT"),
        (libc::SIGWINCH, "WINCH"),
    ] {
        let rootfs = rootfs().to_str().unwrap();
        let script = format!(
            "trap 'echo got-{name}; exit 3' {name}; echo ready; while :; do sleep 0.05; done"
        );
        let mut cmd = berth(&["run", "--rootfs", rootfs, "--", "sh", "-c", &script]);
        // A harness started in the background or under nohup hands its children SIGINT, SIGQUIT
        // or SIGHUP ignored, and a command keeps what it inherits ignored (berth does not reset
        // it, as no exec does), so the shell's trap would never fire: this test wants defaults.
        // SAFETY: between fork and exec only async-signal-safe calls (signal) are made.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                for sig in [libc::SIGINT, libc::SIGQUIT, libc::SIGHUP] {
                    libc::signal(sig, libc::SIG_DFL);
                }
                Ok(())
            })
        };
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdout = child.stdout.take().unwrap();
        let mut buf = [0u8; 6];
        std::io::Read::read_exact(&mut stdout, &mut buf).unwrap();
        assert_eq!(&buf, b"ready\n");
        // SAFETY: signalling the child we spawned.
        unsafe { libc::kill(i32::try_from(child.id()).unwrap(), sig) };
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("SIG{name}: the command did not end within 30 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
        assert_eq!(
            rest.trim(),
            format!("got-{name}"),
            "SIG{name} not delivered"
        );
        assert_eq!(status.code(), Some(3), "SIG{name}");
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_command_writing_into_a_closed_pipe_is_ended_by_sigpipe() {
    // berth's Rust runtime ignores SIGPIPE, and an exec keeps an ignored signal ignored: unless
    // berth restores it, `yes` gets EPIPE (exit 1) instead of dying of SIGPIPE (141).
    let out = run_sh(&[], "(yes; echo \"yes ended $?\" >&2) | head -n 1");
    assert_eq!(stdout(&out).trim(), "y");
    assert!(
        stderr(&out).contains("yes ended 141"),
        "SIGPIPE did not end yes: {}",
        stderr(&out)
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn the_callers_umask_reaches_the_command_and_not_the_containers_setup() {
    test_user();
    let rootfs = rootfs().to_str().unwrap();
    let mut cmd = berth(&[
        "run",
        "--rootfs",
        rootfs,
        "--user",
        "berthtest",
        "--hostname",
        "inside",
        "--",
        "sh",
        "-c",
        "umask; ls -ld / | cut -c1-10; cat /etc/hostname; touch /tmp/f; ls -l /tmp/f | cut -c1-10",
    ]);
    // SAFETY: umask is async-signal-safe.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
            libc::umask(0o077);
            Ok(())
        })
    };
    // Before: `/` (the overlay's upper directory) was made 0700 under this umask and the user
    // could not even enter the working directory.
    let out = ok(cmd.output().unwrap());
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        ["0077", "drwxr-xr-x", "inside", "-rw-------"],
        "{out}"
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn init_reaps_orphans() {
    // Orphans re-parent to init, which must reap them: no zombie piles up while the command runs.
    let out = ok(run_sh(
        &[],
        "for i in 1 2 3 4 5; do sh -c 'sleep 0.01 &' ; done; sleep 0.5; ps -o stat,comm | grep -c '^Z' || true",
    ));
    assert_eq!(out.trim(), "0", "zombies were left: {out}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn nothing_is_left_after_exit() {
    let state = state_dir();
    let o = run_sh(&[], "setsid sleep 31337 & sleep 31337 & echo started");
    assert!(stdout(&o).contains("started"));
    assert!(
        leftover_cgroups().is_empty(),
        "cgroups left: {:?}",
        leftover_cgroups()
    );
    assert!(
        host_mounts_with(state.to_str().unwrap()).is_empty(),
        "mounts left on the host"
    );
    assert!(
        host_mounts_with("overlay")
            .iter()
            .all(|l| !l.contains("berth")),
        "overlay left"
    );
    let entries = container_state_dirs();
    assert!(entries.is_empty(), "state dirs left: {entries:?}");
    let ps = Command::new("pgrep")
        .args(["-f", "^sleep 31337"])
        .output()
        .unwrap();
    assert!(
        stdout(&ps).trim().is_empty(),
        "background processes survived: {}",
        stdout(&ps)
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_killed_berth_leaves_nothing_after_gc() {
    let rootfs = rootfs().to_str().unwrap();
    let mut child = berth(&["run", "--rootfs", rootfs, "--", "sleep", "301"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while leftover_cgroups().is_empty() {
        assert!(Instant::now() < deadline, "container never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(200));
    child.kill().unwrap();
    child.wait().unwrap();
    // The container's init notices its parent died and takes the namespace down.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let ps = Command::new("pgrep")
            .args(["-f", "^sleep 301"])
            .output()
            .unwrap();
        if stdout(&ps).trim().is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "the command outlived berth");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        !leftover_cgroups().is_empty(),
        "expected a leftover cgroup to reclaim"
    );
    let out = ok(berth(&["gc"]).output().unwrap());
    assert!(out.contains("reclaimed"), "{out}");
    assert!(
        leftover_cgroups().is_empty(),
        "gc left cgroups: {:?}",
        leftover_cgroups()
    );
    let entries = container_state_dirs();
    assert!(entries.is_empty(), "gc left state dirs: {entries:?}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn container_processes_are_tracked_in_their_cgroup() {
    let rootfs = rootfs().to_str().unwrap();
    let mut child = berth(&[
        "run",
        "--rootfs",
        rootfs,
        "--",
        "sh",
        "-c",
        "sleep 302 & sleep 302 & cat /proc/self/cgroup; wait",
    ])
    .stdout(Stdio::piped())
    .spawn()
    .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    // Hybrid hosts list their v1 hierarchies first; the v2 line is the one starting "0::".
    let mut reader = std::io::BufReader::new(&mut stdout);
    let mut line = String::new();
    while !line.starts_with("0::") {
        line.clear();
        assert!(std::io::BufRead::read_line(&mut reader, &mut line).unwrap() > 0);
    }
    assert_eq!(
        line, "0::/\n",
        "inside, the cgroup namespace is rooted at the container"
    );
    let cgroups = leftover_cgroups();
    assert_eq!(cgroups.len(), 1);
    let procs = std::fs::read_to_string(
        Path::new(cgroup_root())
            .join(&cgroups[0])
            .join("cgroup.procs"),
    )
    .unwrap();
    assert!(
        procs.lines().count() >= 4,
        "init, sh and two sleeps expected: {procs}"
    );
    // SAFETY: signalling the child we spawned.
    unsafe { libc::kill(i32::try_from(child.id()).unwrap(), libc::SIGTERM) };
    child.wait().unwrap();
    assert!(leftover_cgroups().is_empty());
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn mounts_env_workdir_and_host_files() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("data.txt"), "payload\n").unwrap();
    let src = dir.path().to_str().unwrap();
    let out = ok(run_sh(
        &[
            "--mount",
            &format!("{src}:/data:ro"),
            "--mount",
            &format!("{src}:/rw"),
            "--env",
            "FOO=bar",
            "--env",
            "PATH=/bin",
            "--workdir",
            "/data",
        ],
        "cat data.txt; pwd; echo $FOO $PATH; touch /data/x 2>&1; echo w > /rw/written; \
         grep -c . /etc/hosts >/dev/null && echo hosts; mount | grep -E ' /(data|rw) ' | grep -c nosuid,nodev",
    ));
    assert!(out.contains("payload"), "{out}");
    assert!(out.contains("/data\n"), "{out}");
    assert!(out.contains("bar /bin"), "{out}");
    assert!(
        out.contains("Read-only file system"),
        "ro mount writable: {out}"
    );
    assert!(out.contains("hosts"), "{out}");
    assert!(
        out.trim_end().ends_with('2'),
        "bind mounts must be nosuid,nodev: {out}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("written")).unwrap(),
        "w\n"
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn dev_has_the_minimal_set_and_requested_devices() {
    let out = ok(run_sh(
        &[],
        "ls /dev | tr '\\n' ' '; echo; head -c 4 /dev/urandom | wc -c; echo x > /dev/null && echo null-ok",
    ));
    for dev in [
        "null", "zero", "full", "random", "urandom", "tty", "ptmx", "pts", "shm", "mqueue", "fd",
        "stdin", "stdout", "stderr",
    ] {
        assert!(
            out.split_whitespace().any(|d| d == dev),
            "/dev/{dev} missing: {out}"
        );
    }
    assert!(!out.contains("loop-control"), "host devices leaked: {out}");
    assert!(out.contains("null-ok"));
    let out = ok(run_sh(
        &["--device", "/dev/loop-control"],
        "ls -l /dev/loop-control",
    ));
    assert!(out.starts_with('c'), "{out}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn proc_sys_and_sysrq_are_read_only() {
    let o = run_sh(
        &["--user", "0"],
        "echo x > /proc/sys/kernel/hostname; echo 1 > /proc/sysrq-trigger; \
         echo 1 > /proc/sys/vm/drop_caches; cat /proc/kcore 2>/dev/null | wc -c",
    );
    let all = stdout(&o) + &stderr(&o);
    // Present on most kernels, not on every one (this VM's has no sysrq-trigger or kcore).
    let expected = 2 + usize::from(Path::new("/proc/sysrq-trigger").exists());
    assert_eq!(
        all.matches("Read-only file system").count(),
        expected,
        "{all}"
    );
    assert!(
        stdout(&o).trim().ends_with('0'),
        "/proc/kcore not masked: {all}"
    );
    assert_eq!(
        nix::unistd::gethostname().unwrap().to_string_lossy(),
        String::from_utf8_lossy(&std::fs::read("/proc/sys/kernel/hostname").unwrap()).trim()
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_terminal_is_passed_through() {
    // script(1) gives berth a pseudo-terminal on stdin.
    let cmd = format!(
        "{BERTH} --config {} run --rootfs {} -- sh -c 'test -t 0 && test -t 1 && echo is-a-tty; echo TERM=$TERM'",
        config().display(),
        rootfs().display()
    );
    let o = Command::new("script")
        .args(["-qec", &cmd, "/dev/null"])
        .env("TERM", "xterm-256color")
        .output()
        .unwrap();
    let out = stdout(&o);
    assert!(out.contains("is-a-tty"), "{out}");
    assert!(out.contains("TERM=xterm-256color"), "{out}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn limits_without_the_controller_fail_before_starting() {
    // The host's cgroup2 has only hugetlb: a memory limit cannot be enforced there.
    let o = run_sh(&["--memory", "32M"], "echo should-not-run");
    assert_eq!(o.status.code(), Some(125));
    let err = stderr(&o);
    assert!(!stdout(&o).contains("should-not-run"));
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("memory") && err.contains(cgroup_root()),
        "{err}"
    );
    for (flag, val, ctrl) in [
        ("--pids", "10", "pids"),
        ("--cpus", "0.5", "cpu"),
        ("--cpuset", "0", "cpuset"),
    ] {
        let o = run_sh(&[flag, val], "true");
        assert_eq!(o.status.code(), Some(125));
        assert!(stderr(&o).contains(&format!("'{ctrl}'")), "{}", stderr(&o));
    }
    assert!(leftover_cgroups().is_empty());
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn bad_input_gets_one_line_and_a_distinct_status() {
    let rootfs = rootfs().to_str().unwrap();
    let cases: Vec<(Vec<&str>, i32, &str)> = vec![
        (
            vec!["run", "--rootfs", "/no/such/rootfs", "--", "true"],
            2,
            "/no/such/rootfs",
        ),
        (
            vec!["run", "--rootfs", rootfs, "--memory", "12Q", "--", "true"],
            2,
            "invalid size '12Q'",
        ),
        (
            vec!["run", "--rootfs", rootfs, "--cpuset", "3-1", "--", "true"],
            2,
            "invalid CPU list '3-1'",
        ),
        (
            vec!["run", "--rootfs", rootfs, "--cpus", "zero", "--", "true"],
            2,
            "invalid CPU count 'zero'",
        ),
        (
            vec!["run", "--rootfs", rootfs, "--mount", "/tmp", "--", "true"],
            2,
            "invalid mount '/tmp'",
        ),
        (
            vec![
                "run",
                "--rootfs",
                rootfs,
                "--mount",
                "/no/such/src:/x",
                "--",
                "true",
            ],
            2,
            "/no/such/src",
        ),
        (
            vec![
                "run",
                "--rootfs",
                rootfs,
                "--user",
                "no-such-user-x",
                "--",
                "true",
            ],
            2,
            "unknown user 'no-such-user-x'",
        ),
        (
            vec![
                "run",
                "--rootfs",
                rootfs,
                "--device",
                "/etc/passwd",
                "--",
                "true",
            ],
            2,
            "--device /etc/passwd",
        ),
        (
            vec!["run", "--rootfs", rootfs, "--pids", "-3", "--", "true"],
            2,
            "--pids",
        ),
        (
            vec![
                "run",
                "--rootfs",
                rootfs,
                "--workdir",
                "/no/such/dir",
                "--",
                "true",
            ],
            125,
            "/no/such/dir",
        ),
    ];
    for (args, code, needle) in cases {
        let o = berth(&args).output().unwrap();
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(code), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: not one line: {err}");
        assert!(
            err.starts_with("berth: ") && err.contains(needle),
            "{args:?}: {err}"
        );
    }
    // A cgroup root that does not exist (and cannot be created: its parent is not cgroup2).
    let cfg = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(cfg.path(), "[cgroup]\nroot = \"/nonexistent/berth\"\n").unwrap();
    let o = Command::new(BERTH)
        .arg("--config")
        .arg(cfg.path())
        .args(["run", "--rootfs", rootfs, "--", "true"])
        .output()
        .unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(125), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("/nonexistent/berth"), "{err}");
    assert!(leftover_cgroups().is_empty());
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn device_filter_denies_devices_outside_the_allow_list() {
    // A process that joins the container's cgroup from outside may open /dev/null (allowed) but
    // not /dev/loop-control, even as root with every capability: the BPF filter decides.
    let rootfs = rootfs().to_str().unwrap();
    let mut child = berth(&["run", "--rootfs", rootfs, "--", "sleep", "303"])
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while leftover_cgroups().is_empty() {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(10));
    }
    let cg = Path::new(cgroup_root()).join(&leftover_cgroups()[0]);
    let try_open = |dev: &str| {
        Command::new("sh")
            .arg("-c")
            .arg(format!(
                "echo $$ > {}/cgroup.procs && exec cat {dev} < /dev/null",
                cg.display()
            ))
            .output()
            .unwrap()
    };
    let o = try_open("/dev/null");
    assert!(o.status.success(), "/dev/null denied: {}", stderr(&o));
    let o = try_open("/dev/loop-control");
    assert!(
        stderr(&o).contains("Operation not permitted"),
        "loop-control not denied: {}",
        stderr(&o)
    );
    child.kill().unwrap();
    child.wait().unwrap();
    let _ = berth(&["gc"]).output();
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn read_only_binds_are_read_only_all_the_way_down_and_hide_berths_mounts() {
    let dir = tempfile::tempdir().unwrap();
    let sub = dir.path().join("sub");
    std::fs::create_dir(&sub).unwrap();
    let status = Command::new("mount")
        .args(["-t", "tmpfs", "tmpfs"])
        .arg(&sub)
        .status()
        .unwrap();
    assert!(status.success());
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
        }
    }
    let _guard = Unmount(sub.clone());
    let src = dir.path().to_str().unwrap();
    let o = run_sh(
        &["--mount", &format!("{src}:/data:ro")],
        "touch /data/sub/x 2>&1; mount | grep -c ' /data/sub ' ",
    );
    let out = stdout(&o);
    assert!(
        out.contains("Read-only file system"),
        "submount writable: {out}"
    );
    assert!(
        out.trim_end().ends_with('1'),
        "the submount came along: {out}"
    );
    // Binding a parent of berth's state directory must not show the container's own mounts.
    let state_parent = state_dir().parent().unwrap().to_str().unwrap().to_string();
    let out = ok(run_sh(
        &["--mount", &format!("{state_parent}:/host-state")],
        "mount | grep -c /host-state/ || true",
    ));
    assert_eq!(out.trim(), "0", "berth's mounts leaked into a bind: {out}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn the_user_is_added_to_the_containers_passwd_and_group() {
    let (uid, gid, _) = test_user();
    let before = snapshot(rootfs());
    for extra in [&[][..], &["--readonly"][..]] {
        let mut args = vec!["--user", "berthtest"];
        args.extend_from_slice(extra);
        let out = ok(run_sh(
            &args,
            "id -un; id -gn; grep '^berthtest:' /etc/passwd /etc/group",
        ));
        assert!(out.starts_with("berthtest\nberthtest\n"), "{out}");
        assert!(
            out.contains(&format!("berthtest:x:{uid}:{gid}::/home/berthtest:/bin/sh")),
            "{out}"
        );
    }
    // Users the image knows are not added twice.
    let out = ok(run_sh(&["--user", "0"], "grep -c '^root:' /etc/passwd"));
    assert_eq!(out.trim(), "1");
    assert_eq!(before, snapshot(rootfs()), "the rootfs changed");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn cdi_devices_apply_their_edits() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("test.json"),
        r#"{"cdiVersion": "0.6.0", "kind": "berth.test/dev",
            "devices": [{"name": "loop", "containerEdits": {
                "deviceNodes": [{"path": "/dev/loop-control"}],
                "env": ["BERTH_CDI=loop"]}}],
            "containerEdits": {"env": ["BERTH_CDI_COMMON=1"]}}"#,
    )
    .unwrap();
    let config = dir.path().join("berth.toml");
    let base = std::fs::read_to_string(common::config()).unwrap();
    std::fs::write(
        &config,
        format!(
            "{base}[topology]\ncdi_dirs = [\"{}\"]\n",
            dir.path().display()
        ),
    )
    .unwrap();
    let rootfs = rootfs().to_str().unwrap();
    let o = Command::new(BERTH)
        .arg("--config")
        .arg(&config)
        .args([
            "run",
            "--rootfs",
            rootfs,
            "--device",
            "berth.test/dev=loop",
            "--",
        ])
        .args([
            "sh",
            "-c",
            "ls -l /dev/loop-control; echo $BERTH_CDI $BERTH_CDI_COMMON",
        ])
        .output()
        .unwrap();
    let out = ok(o);
    assert!(
        out.starts_with('c'),
        "the CDI device node is missing: {out}"
    );
    assert!(
        out.contains("loop 1"),
        "the CDI env edits are missing: {out}"
    );
    let o = Command::new(BERTH)
        .arg("--config")
        .arg(&config)
        .args([
            "run",
            "--rootfs",
            rootfs,
            "--device",
            "berth.test/dev=nope",
            "--",
            "true",
        ])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert_eq!(stderr(&o).lines().count(), 1, "{}", stderr(&o));
    assert!(stderr(&o).contains("berth.test/dev=nope"), "{}", stderr(&o));
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn gpus_are_checked_against_the_node() {
    let _ = test_user();
    // This host has no GPU: asking for one is a one-line error; `all` gives a container with no
    // GPU device and a loader cache every user can read.
    let o = run_sh(&["--gpus", "0"], "true");
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert_eq!(stderr(&o).lines().count(), 1, "{}", stderr(&o));
    assert!(stderr(&o).contains("GPU 0"), "{}", stderr(&o));
    let out = ok(run_sh(
        &["--gpus", "all", "--user", "berthtest"],
        "ls /dev | grep -c nvidia; head -c 11 /etc/ld.so.cache",
    ));
    assert!(out.starts_with("0\n"), "{out}");
    assert!(
        out.contains("glibc-ld.so") || out.contains("ld.so-1.7.0"),
        "{out}"
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn remap_root_makes_the_user_root_of_the_image_and_nothing_more() {
    let (uid, gid, extra) = test_user();
    let host = tempfile::tempdir().unwrap();
    let shared = host.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::os::unix::fs::chown(&shared, Some(uid), Some(gid)).unwrap();
    let secret = host.path().join("secret");
    std::fs::write(&secret, "root's\n").unwrap();
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let mount = format!("{}:/shared", shared.display());
    let secret_mount = format!("{}:/secret:ro", secret.display());
    let out = ok(run_sh(
        &["--user", "berthtest", "--remap-root", "--mount", &mount],
        // Root inside, owner of the image's files: writes where only root may; its files on the
        // host belong to the user; root's host files stay out of reach; no capability at all.
        "id -u; id -g; id -G; stat -c '%u %g' /etc /bin/busybox; \
         echo new > /etc/new-file && echo etc-writable; \
         chmod 700 /bin && echo chmod-ok; mkdir /top && echo top-ok; \
         echo out > /shared/out; \
         grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status",
    ));
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(&lines[..2], ["0", "0"], "{out}");
    assert!(
        lines[2].split(' ').any(|g| g == extra.to_string()),
        "the supplementary group is gone: {out}"
    );
    assert_eq!(&lines[3..5], ["0 0", "0 0"], "{out}");
    for needle in [
        "etc-writable",
        "chmod-ok",
        "top-ok",
        "CapEff:\t0000000000000000",
        "CapBnd:\t0000000000000000",
        "NoNewPrivs:\t1",
    ] {
        assert!(out.contains(needle), "{needle} missing: {out}");
    }
    let meta = std::fs::metadata(shared.join("out")).unwrap();
    assert_eq!(
        (
            std::os::unix::fs::MetadataExt::uid(&meta),
            std::os::unix::fs::MetadataExt::gid(&meta)
        ),
        (uid, gid),
        "a file root made in the container is not the user's on the host"
    );
    // Root's host files stay out of reach: a source the user cannot read is never mounted (it
    // used to be mounted, left to its mode inside; now the runtime opens sources as the user).
    let o = run_sh(
        &[
            "--user",
            "berthtest",
            "--remap-root",
            "--mount",
            &secret_mount,
        ],
        "cat /secret",
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("cannot read"), "{}", stderr(&o));
    assert!(!stdout(&o).contains("root's"));
    // The image itself was not changed.
    assert!(!rootfs().join("etc/new-file").exists());
    assert_eq!(
        std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(rootfs().join("etc")).unwrap()),
        0
    );
}

/// Makes a device node (`kind`: 'c' or 'b') at `path` with `mode`, owned by `uid`.
fn mknod(path: &Path, kind: char, major: u32, minor: u32, mode: u32, uid: u32) {
    let status = Command::new("mknod")
        .arg("-m")
        .arg(format!("{mode:o}"))
        .arg(path)
        .arg(kind.to_string())
        .arg(major.to_string())
        .arg(minor.to_string())
        .status()
        .unwrap();
    assert!(status.success(), "mknod {}", path.display());
    std::os::unix::fs::lchown(path, Some(uid), None).unwrap();
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn character_devices_the_user_may_open_bind_and_the_device_cgroup_still_decides() {
    // Issue 27, point 4 (berth run --mount): Pyxis binds character devices; berth binds one the
    // user may open, without nodev on that one node, and the device cgroup still decides.
    let (uid, gid, _) = test_user();
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).unwrap();
    // Major 60 is for local use, never a real driver's: opening these does nothing on the host.
    let not_allowed = dir.path().join("local-char");
    mknod(&not_allowed, 'c', 60, 0, 0o666, uid);
    let root_only = dir.path().join("root-only-char");
    mknod(&root_only, 'c', 60, 1, 0o600, 0);
    let block = dir.path().join("local-block");
    mknod(&block, 'b', 60, 0, 0o666, uid);
    let mount = |src: &Path, dst: &str| format!("{}:{dst}", src.display());
    let out = ok(run_sh(
        &[
            "--user",
            "berthtest",
            "--mount",
            "/dev/null:/null",
            "--mount",
            &mount(&not_allowed, "/local"),
        ],
        "echo discarded > /null && echo wrote-null; wc -c < /null; \
         cat /local 2>&1; stat -c %t:%T /local",
    ));
    assert!(out.contains("wrote-null\n0\n"), "/dev/null bound: {out}");
    // Outside the allow-list (null, zero, full, random, urandom, tty): EPERM from the device
    // cgroup, not EACCES from a nodev mount.
    assert!(
        out.contains("Operation not permitted"),
        "the device cgroup did not decide: {out}"
    );
    assert!(out.contains("3c:0"), "{out}");
    // A node the user may not open, and a block device (runtime.mount_block_devices is off):
    // refused in one line before anything runs.
    for (src, needle) in [(&root_only, "cannot read"), (&block, "block device")] {
        let o = run_sh(
            &["--user", "berthtest", "--mount", &mount(src, "/x")],
            "echo ran",
        );
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{}: {err}", src.display());
        assert_eq!(err.lines().count(), 1, "not one line: {err}");
        assert!(err.contains(needle), "{err}");
        assert!(!stdout(&o).contains("ran"));
    }
    assert!(
        stderr(&run_sh(
            &["--user", "berthtest", "--mount", &mount(&block, "/x")],
            "true"
        ))
        .contains("runtime.mount_block_devices")
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_users_own_directory_image_runs_with_remap_root() {
    // Issue 27, point 9 (berth run --remap-root): a directory image the user unpacked as
    // themselves failed with `creating mount point /etc/hosts: EACCES`.
    let (uid, gid, _) = test_user();
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let image = dir.path().join("image");
    let status = Command::new("cp")
        .arg("-a")
        .arg(rootfs())
        .arg(&image)
        .status()
        .unwrap();
    assert!(status.success());
    let status = Command::new("chown")
        .args(["-R", "-h", &format!("{uid}:{gid}")])
        .arg(&image)
        .status()
        .unwrap();
    assert!(status.success());
    let before = snapshot(&image);
    let o = berth(&[
        "run",
        "--rootfs",
        image.to_str().unwrap(),
        "--user",
        "berthtest",
        "--remap-root",
        "--",
        "sh",
        "-c",
        "id -u; stat -c %u / /etc /bin/busybox; grep -c . /etc/hosts >/dev/null && echo hosts; \
         echo new > /etc/new-file && mkdir /top && echo writes-ok; \
         grep -E '^(CapEff|NoNewPrivs)' /proc/self/status",
    ])
    .output()
    .unwrap();
    let out = stdout(&o);
    assert!(o.status.success(), "{}{out}", stderr(&o));
    let lines: Vec<&str> = out.lines().collect();
    // The user's files are the remapped root's, as Enroot shows an unpacked image.
    assert_eq!(&lines[..4], ["0", "0", "0", "0"], "{out}");
    for needle in [
        "hosts",
        "writes-ok",
        "CapEff:\t0000000000000000",
        "NoNewPrivs:\t1",
    ] {
        assert!(out.contains(needle), "{needle} missing: {out}");
    }
    // The writes stayed in the container's own layer.
    assert_eq!(snapshot(&image), before, "the user's image changed");
}
