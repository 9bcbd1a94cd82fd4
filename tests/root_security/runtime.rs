//! Security tests: runtime. Root's work inside the container root (the user entries in the
//! image's /etc/passwd and /etc/group, mount points) never reaches a file outside it, and a mount
//! source is what the user could open, never what a path pointed to when root looked again.

#[allow(unused_imports)]
use super::*;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A file's bytes as text, for failure messages.
fn text_of(path: &Path) -> String {
    String::from_utf8_lossy(&std::fs::read(path).unwrap()).into_owned()
}

/// A copy of the busybox rootfs that the test may change, root's and readable by everyone.
fn own_rootfs(dir: &Path) -> PathBuf {
    let r = dir.join("rootfs");
    let o = Command::new("cp")
        .arg("-a")
        .arg(rootfs())
        .arg(&r)
        .output()
        .unwrap();
    assert!(o.status.success(), "cp -a rootfs: {}", stderr(&o));
    chmod(&r, 0o755);
    r
}

/// A rootfs whose etc/passwd (and etc/group) is a symlink to `target`.
fn rootfs_with_passwd_link(dir: &Path, target: &str) -> PathBuf {
    let r = own_rootfs(dir);
    for db in ["etc/passwd", "etc/group"] {
        let _ = std::fs::remove_file(r.join(db));
        std::os::unix::fs::symlink(target, r.join(db)).unwrap();
    }
    r
}

fn attacker_uid() -> String {
    attacker().0.to_string()
}

/// A host directory with a root-owned 0644 `notes` file that the attacker can read, not write.
fn host_notes(dir: &Path) -> (PathBuf, PathBuf, String) {
    let host = dir.join("victimdir");
    std::fs::create_dir(&host).unwrap();
    chmod(&host, 0o755);
    let notes = host.join("notes");
    let text = "root:x:0:0:root:/root:/bin/sh\nthe victim's notes\n".to_string();
    std::fs::write(&notes, &text).unwrap();
    chmod(&notes, 0o644);
    (host, notes, text)
}

/// A step request for the attacker, as the SPANK plugin sends it.
fn step_request(job: u32, image: &Path, mounts: &str, extra: &str) -> String {
    let (uid, gid) = attacker();
    format!(
        r#"{{"job_id": {job}, "step_id": 0, "uid": {uid}, "gid": {gid},
            "options": {{"container-image": "{}", "container-mounts": "{mounts}"{extra}}}}}"#,
        image.display()
    )
}

fn step_destroy(job: u32) {
    let _ = berth(&[
        "step",
        "destroy",
        "--job-id",
        &job.to_string(),
        "--step-id",
        "0",
    ])
    .stdin(Stdio::null())
    .output();
}

/// The `pid` of a `step create` answer, if the step was created.
fn step_pid(o: &Output) -> Option<i64> {
    if !o.status.success() {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(stdout(o).trim()).ok()?;
    v["pid"].as_i64()
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn an_image_passwd_never_leads_root_outside_the_container() {
    let dir = workdir("runtime-passwd-link");
    let image = rootfs_with_passwd_link(&dir, "/data/notes");
    let (host, notes, text) = host_notes(&dir);
    let image_s = image.to_str().unwrap();
    let mount = format!("{}:/data", host.display());
    let uid = attacker_uid();
    for extra in [&[][..], &["--readonly"][..]] {
        let mut args = vec![
            "run", "--rootfs", image_s, "--user", &uid, "--mount", &mount,
        ];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--", "true"]);
        let o = berth(&args).stdin(Stdio::null()).output().unwrap();
        assert_eq!(
            text_of(&notes),
            text,
            "berth run {extra:?} wrote to the host file through the image's etc/passwd; stderr: {}",
            stderr(&o)
        );
        assert!(o.status.success(), "berth run {extra:?}: {}", stderr(&o));
    }
    for (job, extra) in [(4601, ""), (4602, r#", "container-readonly": true"#)] {
        let o = berth_with_stdin(
            &["step", "create"],
            &step_request(job, &image, &format!("{}:/data", host.display()), extra),
        );
        step_destroy(job);
        assert_eq!(
            text_of(&notes),
            text,
            "step create {extra} wrote to the host file through the image's etc/passwd; stderr: {}",
            stderr(&o)
        );
        assert!(o.status.success(), "step create {extra}: {}", stderr(&o));
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn an_endless_image_passwd_is_read_boundedly_and_left_alone() {
    let dir = workdir("runtime-passwd-zero");
    let image = rootfs_with_passwd_link(&dir, "/dev/zero");
    let uid = attacker_uid();
    let mut cmd = berth(&[
        "run",
        "--rootfs",
        image.to_str().unwrap(),
        "--user",
        &uid,
        "--",
        "sh",
        "-c",
        "grep VmHWM /proc/1/status; exit 7",
    ]);
    // An address-space limit (inherited by the container's init) keeps an unbounded read from
    // hurting the machine: it ends in a failed allocation instead.
    // SAFETY: setrlimit is async-signal-safe; the closure touches nothing else.
    unsafe {
        cmd.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 1 << 30,
                rlim_max: 1 << 30,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut e, &mut err);
    }
    let mut out = String::new();
    if let Some(mut o) = child.stdout.take() {
        let _ = std::io::Read::read_to_string(&mut o, &mut out);
    }
    let status = status.expect("berth run did not finish within 60 s");
    assert_eq!(status.code(), Some(7), "stderr: {err}");
    // The container's init (its PID 1) read at most a bounded prefix of the endless file.
    let peak_kb: u64 = out
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no VmHWM of the container's init in {out:?}"));
    assert!(
        peak_kb < 200 * 1024,
        "the container's init grew to {} MiB reading an endless /etc/passwd",
        peak_kb / 1024
    );
}

/// Runs `cmd` TRIES times against a swapper of `a` and `b`; returns the outputs that contain
/// `secret`.
fn race(a: &Path, b: &Path, secret: &str, mut one: impl FnMut(usize) -> String) -> Vec<String> {
    let _swap = swapper(a, b);
    let mut wins = Vec::new();
    for i in 0..TRIES {
        let out = one(i);
        if out.contains(secret) {
            wins.push(out);
        }
    }
    wins
}

/// The attacker's directory with `src`, a symlink to the victim's secret, and `decoy`, a file of
/// the attacker's. The secret is 0644 in the victim's 0700 directory: the directory is what keeps
/// the attacker out, so the secret shows in the container exactly when root mounted it.
fn swap_setup(dir: &Path) -> (PathBuf, PathBuf, &'static str) {
    let vdir = dir.join("victim");
    std::fs::create_dir(&vdir).unwrap();
    let secret = vdir.join("secret");
    let text = "VICTIM-SECRET-7f3a";
    std::fs::write(&secret, text).unwrap();
    chmod(&secret, 0o644);
    chmod(&vdir, 0o700);
    give(&vdir, victim());
    let a = dir.join("attacker");
    std::fs::create_dir(&a).unwrap();
    std::fs::write(a.join("decoy"), "decoy\n").unwrap();
    std::os::unix::fs::symlink(&secret, a.join("src")).unwrap();
    give(&a, attacker());
    (a.join("src"), a.join("decoy"), text)
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_mount_source_swapped_during_the_check_is_never_mounted() {
    let dir = workdir("runtime-mount-swap");
    let (src, decoy, secret) = swap_setup(&dir);
    let mount = format!("{}:/m", src.display());
    let uid = attacker_uid();
    let rootfs = rootfs().to_str().unwrap();
    let started = Instant::now();
    let wins = race(&src, &decoy, secret, |_| {
        let o = berth(&[
            "run", "--rootfs", rootfs, "--user", &uid, "--mount", &mount, "--", "cat", "/m",
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
        stdout(&o) + &stderr(&o)
    });
    assert!(
        wins.is_empty(),
        "{} of {TRIES} runs read the victim's secret (in {:?}): {:?}",
        wins.len(),
        started.elapsed(),
        wins.first()
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_step_mount_source_swapped_during_the_check_is_never_mounted() {
    let dir = workdir("runtime-step-mount-swap");
    let (src, decoy, secret) = swap_setup(&dir);
    let started = Instant::now();
    let wins = race(&src, &decoy, secret, |i| {
        let job = 4700 + u32::try_from(i).unwrap();
        let o = berth_with_stdin(
            &["step", "create"],
            &step_request(job, rootfs(), &format!("{}:/m", src.display()), ""),
        );
        // What the step's tasks would read at /m, read by root through the container's root.
        let seen = step_pid(&o)
            .and_then(|pid| std::fs::read_to_string(format!("/proc/{pid}/root/m")).ok())
            .unwrap_or_default();
        step_destroy(job);
        seen + &stderr(&o)
    });
    assert!(
        wins.is_empty(),
        "{} of {TRIES} steps mounted the victim's secret (in {:?}): {:?}",
        wins.len(),
        started.elapsed(),
        wins.first()
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn mount_points_are_never_made_in_a_mounted_host_directory() {
    let dir = workdir("runtime-mount-point");
    let host = dir.join("host");
    std::fs::create_dir(&host).unwrap();
    chmod(&host, 0o755);
    let other = dir.join("other");
    std::fs::create_dir(&other).unwrap();
    chmod(&other, 0o755);
    let uid = attacker_uid();
    let o = berth(&[
        "run",
        "--rootfs",
        rootfs().to_str().unwrap(),
        "--user",
        &uid,
        "--mount",
        &format!("{}:/data", host.display()),
        "--mount",
        &format!("{}:/data/sub/x", other.display()),
        "--",
        "true",
    ])
    .stdin(Stdio::null())
    .output()
    .unwrap();
    let made: Vec<_> = std::fs::read_dir(&host).unwrap().flatten().collect();
    assert!(
        made.is_empty(),
        "root made {:?} in the host directory {}",
        made.iter().map(|e| e.path()).collect::<Vec<_>>(),
        host.display()
    );
    assert!(
        host_mounts_with(host.to_str().unwrap()).is_empty(),
        "a mount leaked to the host"
    );
    let err = stderr(&o);
    assert!(!o.status.success(), "the run succeeded: {err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("/data/sub/x"), "{err}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_host_file_mounted_over_etc_passwd_is_not_written() {
    let dir = workdir("runtime-passwd-mount");
    let (_, notes, text) = host_notes(&dir);
    let uid = attacker_uid();
    let o = berth(&[
        "run",
        "--rootfs",
        rootfs().to_str().unwrap(),
        "--user",
        &uid,
        "--mount",
        &format!("{}:/etc/passwd", notes.display()),
        "--",
        "true",
    ])
    .stdin(Stdio::null())
    .output()
    .unwrap();
    assert_eq!(
        text_of(&notes),
        text,
        "root appended to the host file mounted over /etc/passwd; stderr: {}",
        stderr(&o)
    );
    assert!(o.status.success(), "{}", stderr(&o));
}
