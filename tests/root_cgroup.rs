//! Root tier for `berth::cgroup`: runs the cgroupfs and `bpf()` layers against the real kernel.
//!
//! The host has a hybrid layout: cgroup2 at /sys/fs/cgroup/unified offers only hugetlb, but its
//! core files (cgroup.procs, cgroup.events, cgroup.kill, cgroup.freeze) and BPF device programs
//! work, which is what these tests use. Controller limits are the VM tier's job.
//!
//! Each test owns `/sys/fs/cgroup/unified/berth-test-<pid>-<name>`, removed by a drop guard even
//! when the test fails. Only children the test forks are ever moved into a test cgroup: moving
//! the test runner itself would let `cgroup.kill` take the whole session down.
//!
//! Run: `cargo test --test root_cgroup -- --ignored --test-threads=1` (as root).

use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use berth::cgroup::{Cgroup, CgroupError, CgroupWrite, Controller, Hierarchy, Stats};
use oci_spec::runtime::{LinuxDeviceCgroup, LinuxDeviceCgroupBuilder, LinuxDeviceType};

const UNIFIED: &str = "/sys/fs/cgroup/unified";

/// A test's private cgroup root, torn down on drop with plain std::fs (not with the code under
/// test, so a bug there cannot leave cgroups behind).
struct TestRoot {
    path: PathBuf,
}

impl TestRoot {
    fn new(name: &str) -> TestRoot {
        let path = Path::new(UNIFIED).join(format!("berth-test-{}-{name}", std::process::id()));
        teardown(&path);
        assert!(
            !path.exists(),
            "leftover {} could not be removed",
            path.display()
        );
        TestRoot { path }
    }
}

impl Drop for TestRoot {
    fn drop(&mut self) {
        teardown(&self.path);
    }
}

fn teardown(path: &Path) {
    if !path.exists() {
        return;
    }
    // cgroup.kill on a subtree holding this process would kill the test runner; refuse.
    if subtree_pids(path).contains(&std::process::id()) {
        eprintln!(
            "NOT cleaning {}: it contains the test process",
            path.display()
        );
        return;
    }
    let _ = std::fs::write(path.join("cgroup.kill"), "1");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !subtree_pids(path).is_empty() && Instant::now() < deadline {
        sleep(Duration::from_millis(10));
    }
    remove_dirs(path);
}

fn subtree_pids(dir: &Path) -> Vec<u32> {
    let mut pids: Vec<u32> = std::fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    for sub in subdirs(dir) {
        pids.extend(subtree_pids(&sub));
    }
    pids
}

fn subdirs(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}

fn remove_dirs(dir: &Path) {
    for sub in subdirs(dir) {
        remove_dirs(&sub);
    }
    for _ in 0..100 {
        if std::fs::remove_dir(dir).is_ok() || !dir.exists() {
            return;
        }
        sleep(Duration::from_millis(10));
    }
    eprintln!("could not remove {}", dir.display());
}

/// A forked child that is killed and reaped if the test bails out early.
struct Kid(Child);

impl Kid {
    fn sleep() -> Kid {
        Kid(Command::new("sleep")
            .arg("1000")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn sleep"))
    }

    fn pid(&self) -> i32 {
        i32::try_from(self.0.id()).unwrap()
    }

    /// Reap the child (within a few seconds) and return the signal that killed it.
    fn reap_signal(&mut self) -> Option<i32> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(status) = self.0.try_wait().unwrap() {
                return status.signal();
            }
            assert!(
                Instant::now() < deadline,
                "child {} did not exit",
                self.0.id()
            );
            sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Kid {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn rule(
    allow: bool,
    typ: LinuxDeviceType,
    major: Option<i64>,
    minor: Option<i64>,
) -> LinuxDeviceCgroup {
    let mut b = LinuxDeviceCgroupBuilder::default()
        .allow(allow)
        .typ(typ)
        .access("rwm");
    if let Some(m) = major {
        b = b.major(m);
    }
    if let Some(m) = minor {
        b = b.minor(m);
    }
    b.build().unwrap()
}

/// Run `script` with `sh -c` after the shell has moved itself into `cg` (so every device open
/// of the script is checked against the cgroup's filter; the test process never moves).
fn run_in(cg: &Cgroup, script: &str) -> Output {
    let full = format!(
        "echo $$ > '{}/cgroup.procs' || exit 99; {script}",
        cg.path().display()
    );
    Command::new("sh")
        .arg("-c")
        .arg(full)
        .stdin(Stdio::null())
        .output()
        .expect("spawn sh")
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn open_creates_the_root_and_is_idempotent() {
    let t = TestRoot::new("open");
    let h = Hierarchy::open(&t.path, &[]).unwrap();
    assert_eq!(h.root(), t.path);
    assert!(t.path.join("cgroup.procs").exists());
    // A second berth process opening the same root.
    let again = Hierarchy::open(&t.path, &[]).unwrap();
    assert_eq!(again, h);
    assert!(h.children().unwrap().is_empty());
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn open_needing_memory_reports_the_missing_controller() {
    let t = TestRoot::new("nomem");
    let err = Hierarchy::open(&t.path, &[Controller::Memory]).unwrap_err();
    assert!(
        matches!(
            &err,
            CgroupError::MissingController { controller: Controller::Memory, root } if root == &t.path
        ),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!(
            "cgroup controller 'memory' is not available under {}: enable it in the parent's \
             cgroup.subtree_control or point cgroup.root at a delegated cgroup v2 tree",
            t.path.display()
        )
    );
    // Nothing was enabled on the way down.
    let subtree =
        std::fs::read_to_string(Path::new(UNIFIED).join("cgroup.subtree_control")).unwrap();
    assert!(!subtree.contains("memory"));
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn open_outside_cgroup2_fails_with_the_config_hint() {
    let missing = PathBuf::from(format!("/tmp/berth-no-such-{}/berth", std::process::id()));
    let tmp = PathBuf::from("/tmp");
    let v1 = PathBuf::from("/sys/fs/cgroup/pids");
    let file = Path::new(UNIFIED).join("cgroup.procs");
    for root in [&missing, &tmp, &v1, &file] {
        let err = Hierarchy::open(root, &[]).unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(err, CgroupError::NotCgroup2 { .. }),
            "{root:?}: {msg}"
        );
        assert!(msg.contains(&root.display().to_string()), "{msg}");
        assert!(
            msg.contains("set cgroup.root in /etc/berth/berth.toml"),
            "{msg}"
        );
        assert!(!msg.contains('\n'));
    }
    assert!(!missing.exists());
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn lifecycle_of_a_container_cgroup() {
    let t = TestRoot::new("life");
    let h = Hierarchy::open(&t.path, &[]).unwrap();
    let cg = h.create("job-1.0").unwrap();
    assert_eq!(cg.path(), t.path.join("job-1.0"));
    let dup = h.create("job-1.0").unwrap_err().to_string();
    assert!(dup.contains("left over"), "{dup}");
    assert!(matches!(
        h.create("../escape"),
        Err(CgroupError::InvalidName { .. })
    ));
    assert_eq!(h.children().unwrap(), vec![cg.clone()]);

    assert!(!cg.is_populated().unwrap());
    let mut kid = Kid::sleep();
    cg.add_process(kid.pid()).unwrap();
    let procs = std::fs::read_to_string(cg.path().join("cgroup.procs")).unwrap();
    assert_eq!(procs.trim(), kid.pid().to_string());
    assert!(cg.is_populated().unwrap());

    // Populated: waiting times out.
    let start = Instant::now();
    assert!(!cg.wait_empty(Duration::from_millis(150)).unwrap());
    assert!(start.elapsed() >= Duration::from_millis(150));

    // rmdir of a populated cgroup is refused after the retries.
    assert!(matches!(cg.remove(), Err(CgroupError::Busy { .. })));

    cg.kill().unwrap();
    let start = Instant::now();
    assert!(cg.wait_empty(Duration::from_secs(5)).unwrap());
    eprintln!("emptied after kill in {:?}", start.elapsed());
    assert!(!cg.is_populated().unwrap());
    assert_eq!(kid.reap_signal(), Some(libc::SIGKILL));

    cg.remove().unwrap();
    assert!(!cg.path().exists());
    cg.remove().unwrap(); // already gone is success
    cg.kill().unwrap(); // nothing left to kill
    assert!(cg.wait_empty(Duration::from_secs(1)).unwrap());
    assert!(h.children().unwrap().is_empty());
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn wait_empty_wakes_on_exit_without_polling_to_the_deadline() {
    let t = TestRoot::new("wake");
    let h = Hierarchy::open(&t.path, &[]).unwrap();
    let cg = h.create("c").unwrap();
    let kid = Kid::sleep();
    cg.add_process(kid.pid()).unwrap();
    let killer = {
        let pid = kid.pid();
        std::thread::spawn(move || {
            sleep(Duration::from_millis(200));
            // Still unreaped, so the pid cannot have been reused.
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        })
    };
    let start = Instant::now();
    assert!(cg.wait_empty(Duration::from_secs(10)).unwrap());
    let took = start.elapsed();
    killer.join().unwrap();
    assert!(took < Duration::from_secs(2), "took {took:?}");
    drop(kid);
    cg.remove().unwrap();
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn kill_by_signal_empties_a_nested_tree() {
    let t = TestRoot::new("sigkill");
    let h = Hierarchy::open(&t.path, &[]).unwrap();
    let cg = h.create("c").unwrap();
    std::fs::create_dir(cg.path().join("sub")).unwrap();
    let sub = Cgroup::at(cg.path().join("sub"));
    let mut top_kid = Kid::sleep();
    let mut sub_kid = Kid::sleep();
    cg.add_process(top_kid.pid()).unwrap();
    sub.add_process(sub_kid.pid()).unwrap();
    assert!(cg.is_populated().unwrap());

    cg.kill_by_signal().unwrap();
    assert!(cg.wait_empty(Duration::from_secs(5)).unwrap());
    assert_eq!(top_kid.reap_signal(), Some(libc::SIGKILL));
    assert_eq!(sub_kid.reap_signal(), Some(libc::SIGKILL));
    // Thawed again, so the cgroup is usable (and removable) afterwards.
    let freeze = std::fs::read_to_string(cg.path().join("cgroup.freeze")).unwrap();
    assert_eq!(freeze.trim(), "0");

    cg.remove().unwrap();
    assert!(!cg.path().exists());
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn apply_stats_and_open_fd_on_the_hybrid_host() {
    let t = TestRoot::new("apply");
    let h = Hierarchy::open(&t.path, &[]).unwrap();
    let cg = h.create("c").unwrap();

    // A core file every cgroup2 directory has.
    cg.apply(&[CgroupWrite {
        file: "cgroup.max.descendants",
        value: "5".into(),
    }])
    .unwrap();
    let v = std::fs::read_to_string(cg.path().join("cgroup.max.descendants")).unwrap();
    assert_eq!(v.trim(), "5");

    // memory is not enabled here: the write names file, value and errno.
    let err = cg
        .apply(&[CgroupWrite {
            file: "memory.max",
            value: "1048576".into(),
        }])
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("memory.max") && msg.contains("'1048576'"),
        "{msg}"
    );
    assert!(msg.contains("os error 2"), "{msg}");
    assert!(
        !cg.path().join("memory.max").exists(),
        "must not create files"
    );

    // The kernel's own complaint about a bad value.
    let err = cg
        .apply(&[CgroupWrite {
            file: "cgroup.max.depth",
            value: "lots".into(),
        }])
        .unwrap_err();
    assert!(err.to_string().contains("os error 22"), "{err}");

    let kid = Kid::sleep();
    cg.add_process(kid.pid()).unwrap();
    let stats = cg.stats();
    eprintln!("{stats:?}");
    assert!(stats.cpu_usage_usec.is_some(), "cpu.stat is a core file");
    assert_eq!(
        stats,
        Stats {
            cpu_usage_usec: stats.cpu_usage_usec,
            memory_peak: None,
            pids_peak: None,
            oom_kills: None,
        }
    );

    let fd = cg.open_fd().unwrap();
    let meta = std::fs::File::from(fd).metadata().unwrap();
    assert!(meta.is_dir());

    cg.kill().unwrap();
    assert!(cg.wait_empty(Duration::from_secs(5)).unwrap());
    drop(kid);
    cg.remove().unwrap();
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn device_filter_is_enforced_by_the_kernel() {
    let t = TestRoot::new("devices");
    let h = Hierarchy::open(&t.path, &[]).unwrap();
    let cg = h.create("c").unwrap();
    let null = rule(true, LinuxDeviceType::C, Some(1), Some(3));
    let deny_all = rule(false, LinuxDeviceType::A, None, None);
    cg.set_device_filter(&[deny_all.clone(), null.clone()])
        .unwrap();

    let out = run_in(&cg, "exec cat /dev/null");
    assert!(
        out.status.success(),
        "/dev/null must open: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let out = run_in(&cg, "exec head -c1 /dev/zero");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "/dev/zero (c 1:5) must be denied");
    assert!(stderr.contains("Operation not permitted"), "{stderr}");

    let out = run_in(&cg, "exec cat /dev/loop-control");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("Operation not permitted"), "{stderr}");

    // mknod is checked too ('m'): allowed for c 1:3, denied for c 1:5.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let script = format!(
        "mknod '{d}/null' c 1 3 && echo null-ok; exec mknod '{d}/zero' c 1 5",
        d = dir.display()
    );
    let out = run_in(&cg, &script);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stdout.contains("null-ok"), "{stdout} / {stderr}");
    assert!(
        !out.status.success() && stderr.contains("Operation not permitted"),
        "{stderr}"
    );

    // Setting the filter again replaces it: with the old program still attached, the two would
    // be intersected and /dev/zero would stay denied.
    let zero = rule(true, LinuxDeviceType::C, Some(1), Some(5));
    cg.set_device_filter(&[deny_all, null, zero]).unwrap();
    let out = run_in(&cg, "head -c1 /dev/zero > /dev/null && exec cat /dev/null");
    assert!(
        out.status.success(),
        "after replacing, /dev/zero must open: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run_in(&cg, "exec cat /dev/loop-control");
    assert!(!out.status.success(), "loop-control stays denied");

    // Processes outside the cgroup (the test itself) are unaffected.
    let mut buf = [0u8; 1];
    std::fs::File::open("/dev/loop-control")
        .map(drop)
        .unwrap_or_else(|e| panic!("test process lost /dev/loop-control: {e}"));
    std::fs::File::open("/dev/zero")
        .unwrap()
        .read_exact(&mut buf)
        .unwrap();

    assert!(cg.wait_empty(Duration::from_secs(5)).unwrap());
    cg.remove().unwrap();
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn invalid_device_rules_attach_nothing() {
    let t = TestRoot::new("badrules");
    let h = Hierarchy::open(&t.path, &[]).unwrap();
    let cg = h.create("c").unwrap();
    let bad = LinuxDeviceCgroupBuilder::default()
        .allow(true)
        .typ(LinuxDeviceType::C)
        .access("rwx")
        .build()
        .unwrap();
    let err = cg.set_device_filter(&[bad]).unwrap_err();
    assert!(
        matches!(err, CgroupError::InvalidDeviceRule { .. }),
        "{err}"
    );
    // No filter: /dev/zero still opens inside the cgroup.
    let out = run_in(&cg, "head -c1 /dev/zero > /dev/null");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    cg.remove().unwrap();
}

fn access_rule(
    allow: bool,
    typ: LinuxDeviceType,
    major: Option<i64>,
    minor: Option<i64>,
    access: &str,
) -> LinuxDeviceCgroup {
    let mut r = rule(allow, typ, major, minor);
    r.set_access(Some(access.to_string()));
    r
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn partial_deny_and_every_rule_shape_pass_the_verifier() {
    let t = TestRoot::new("shapes");
    let h = Hierarchy::open(&t.path, &[]).unwrap();
    let cg = h.create("c").unwrap();
    use LinuxDeviceType::{A, B, C};
    // Every block shape the builder emits (type check or not, allow with and without an access
    // check, deny, wildcard and fixed numbers), with the allow-all first: a later allow-all
    // would make the builder drop everything before it as unreachable.
    cg.set_device_filter(&[
        access_rule(true, A, None, None, "rwm"),
        access_rule(false, C, Some(1), Some(5), "w"),
        access_rule(true, C, Some(136), None, "rw"),
        access_rule(true, B, None, Some(0), "m"),
        access_rule(false, C, Some(10), Some(200), "rwm"),
        access_rule(true, A, Some(4095), Some(1_048_575), "r"),
    ])
    .unwrap();
    // Read-only open of /dev/zero passes the trailing "deny c 1:5 w"...
    let out = run_in(&cg, "head -c1 /dev/zero > /dev/null");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // ...a write-only open does not...
    let out = run_in(&cg, "exec sh -c ': > /dev/zero'");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "write open of /dev/zero must be denied"
    );
    assert!(
        stderr.contains("Operation not permitted") || stderr.contains("ermission"),
        "{stderr}"
    );
    // ...and neither does read+write, though read alone is allowed by the earlier allow-all.
    let out = run_in(&cg, "exec 3<>/dev/zero");
    assert!(
        !out.status.success(),
        "O_RDWR open of /dev/zero must be denied"
    );
    // /dev/net/tun (c 10:200) is denied outright.
    if Path::new("/dev/net/tun").exists() {
        let out = run_in(&cg, "exec cat /dev/net/tun");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("Operation not permitted"), "{stderr}");
    }
    // Everything else is allowed by the allow-all.
    let out = run_in(&cg, "exec cat /dev/null");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    cg.remove().unwrap();
}
