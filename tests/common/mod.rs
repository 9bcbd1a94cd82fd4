//! Helpers shared by the root-tier tests: the berth binary with a test configuration, and a
//! busybox root filesystem built once per target directory.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

pub const BERTH: &str = env!("CARGO_BIN_EXE_berth");

/// The binary under test: this build's, or `$BERTH_TEST_BIN` (an older build, to show that a
/// test fails without the fix it covers).
pub fn berth_bin() -> String {
    std::env::var("BERTH_TEST_BIN").unwrap_or_else(|_| BERTH.to_string())
}

/// The host's cgroup2 mount here is /sys/fs/cgroup/unified (hybrid layout); tests use a subtree
/// of their own per checkout, so that two checkouts testing at once don't see each other's
/// containers.
pub fn cgroup_root() -> &'static str {
    static ROOT: OnceLock<String> = OnceLock::new();
    ROOT.get_or_init(|| {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        std::hash::Hash::hash(env!("CARGO_MANIFEST_DIR"), &mut h);
        format!(
            "/sys/fs/cgroup/unified/berth-test-{:08x}",
            u32::try_from(std::hash::Hasher::finish(&h) & u64::from(u32::MAX)).unwrap()
        )
    })
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn work_dir() -> PathBuf {
    let dir = repo().join("target").join("root-tier");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A busybox rootfs, built by integration/busybox-rootfs.sh on first use.
pub fn rootfs() -> &'static Path {
    static ROOTFS: OnceLock<PathBuf> = OnceLock::new();
    ROOTFS.get_or_init(|| {
        let dest = work_dir().join("busybox-rootfs");
        let status = Command::new("bash")
            .arg(repo().join("integration/busybox-rootfs.sh"))
            .arg(&dest)
            .status()
            .expect("running integration/busybox-rootfs.sh");
        assert!(status.success(), "building the busybox rootfs failed");
        dest
    })
}

pub fn state_dir() -> PathBuf {
    work_dir().join("state")
}

/// The config file the tests run berth with.
pub fn config() -> &'static Path {
    static CONFIG: OnceLock<PathBuf> = OnceLock::new();
    CONFIG.get_or_init(|| {
        let path = work_dir().join("berth.toml");
        std::fs::write(
            &path,
            format!(
                "[cgroup]\nroot = \"{}\"\n[runtime]\nstate_dir = \"{}\"\n[store]\nroot = \"{}\"\n\
                 [squashfs]\nmount_dir = \"{}\"\n[scratch]\nroot = \"{}\"\n",
                cgroup_root(),
                state_dir().display(),
                work_dir().join("store").display(),
                work_dir().join("images").display(),
                work_dir().join("scratch").display()
            ),
        )
        .unwrap();
        path
    })
}

/// `berth --config <test config> ARGS...`
pub fn berth(args: &[&str]) -> Command {
    let mut cmd = Command::new(berth_bin());
    cmd.arg("--config").arg(config()).args(args);
    cmd
}

/// `berth step create` with `json` on stdin, as the SPANK plugin runs it.
pub fn step_create(json: &str) -> Output {
    step_create_with(config(), json)
}

/// [`step_create`] with another berth config file.
pub fn step_create_with(config: &Path, json: &str) -> Output {
    use std::io::Write;
    let mut child = Command::new(berth_bin())
        .arg("--config")
        .arg(config)
        .args(["step", "create"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(json.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

/// `out` (a command's stdout) as JSON, or a panic showing it.
pub fn json(out: &str) -> serde_json::Value {
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"))
}

/// `berth run --rootfs <busybox> EXTRA... -- sh -c SCRIPT`
pub fn run_sh(extra: &[&str], script: &str) -> Output {
    let rootfs = rootfs().to_str().unwrap().to_string();
    let mut args = vec!["run", "--rootfs", &rootfs];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", "sh", "-c", script]);
    berth(&args).output().expect("running berth")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts success and returns stdout.
pub fn ok(o: Output) -> String {
    assert!(
        o.status.success(),
        "berth failed: {:?}\nstdout: {}\nstderr: {}",
        o.status,
        stdout(&o),
        stderr(&o)
    );
    stdout(&o)
}

/// Container cgroups currently under the test root.
pub fn leftover_cgroups() -> Vec<String> {
    std::fs::read_dir(cgroup_root())
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.path().is_dir())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Container directories in the test state directory (those with a state.json; other verbs
/// keep files of their own there, such as `berth health`'s job marks).
pub fn container_state_dirs() -> Vec<PathBuf> {
    std::fs::read_dir(state_dir())
        .map(|r| {
            r.flatten()
                .map(|e| e.path())
                .filter(|p| p.join("state.json").exists())
                .collect()
        })
        .unwrap_or_default()
}

/// Mount entries of this (host) mount namespace that mention `needle`.
pub fn host_mounts_with(needle: &str) -> Vec<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter(|l| l.contains(needle))
        .map(String::from)
        .collect()
}

/// A host user for the tests, created once with a supplementary group.
pub fn test_user() -> (u32, u32, u32) {
    static USER: OnceLock<(u32, u32, u32)> = OnceLock::new();
    *USER.get_or_init(|| {
        let run = |args: &[&str]| {
            let _ = Command::new(args[0]).args(&args[1..]).output();
        };
        run(&["groupadd", "-f", "berthtest-extra"]);
        if Command::new("id")
            .arg("berthtest")
            .output()
            .map(|o| !o.status.success())
            .unwrap_or(true)
        {
            run(&[
                "useradd",
                "-M",
                "-s",
                "/bin/sh",
                "-G",
                "berthtest-extra",
                "berthtest",
            ]);
        }
        let id = |flag: &str, who: &str| -> u32 {
            let out = Command::new("id").arg(flag).arg(who).output().unwrap();
            assert!(
                out.status.success(),
                "test user berthtest missing (useradd failed?)"
            );
            String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
        };
        let extra = String::from_utf8_lossy(
            &Command::new("getent")
                .args(["group", "berthtest-extra"])
                .output()
                .unwrap()
                .stdout,
        )
        .split(':')
        .nth(2)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
        (id("-u", "berthtest"), id("-g", "berthtest"), extra)
    })
}

/// Sets the extended attribute `name` of `path` (not following a symlink there).
pub fn set_xattr(path: &Path, name: &str, value: &[u8]) {
    let (p, n) = (c_path(path), std::ffi::CString::new(name).unwrap());
    // SAFETY: NUL-terminated path and name; `value` is valid for its length.
    let rc = unsafe {
        libc::lsetxattr(
            p.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    assert_eq!(
        rc,
        0,
        "setxattr {name} on {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
}

/// The value of the extended attribute `name` of `path` (not following a symlink there), if it
/// has one.
pub fn get_xattr(path: &Path, name: &str) -> Option<Vec<u8>> {
    let (p, n) = (c_path(path), std::ffi::CString::new(name).unwrap());
    let mut buf = vec![0u8; 256];
    // SAFETY: NUL-terminated path and name; `buf` is writable for its length.
    let rc = unsafe { libc::lgetxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    usize::try_from(rc).ok().map(|n| buf[..n].to_vec())
}

fn c_path(path: &Path) -> std::ffi::CString {
    std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap()
}
