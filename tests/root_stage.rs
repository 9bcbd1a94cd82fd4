//! Root tier: staging with a real non-root user's credentials, on real directories and a real
//! full filesystem (a 1 MiB tmpfs), and a stage killed half-way then resumed.

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use berth::stage::{self, scratch};
use common::test_user;

const IGNORE: &str = "root tier: run by integration/test.sh";
const _: &str = IGNORE;

/// A world-traversable temporary directory (tempdir() makes 0700 ones the test user cannot
/// enter).
fn workdir() -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("berth-stage-")
        .tempdir_in("/var/tmp")
        .unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

fn stage_in(spec: &str, to: &Path, extra: &[&str]) -> Output {
    let mut cmd = common::berth(&["stage", "in", spec, "--to"]);
    cmd.arg(to).args(extra);
    cmd.output().unwrap()
}

fn scratch_for_user(root: &Path) -> PathBuf {
    let (uid, gid, _) = test_user();
    scratch::create(root, "1234", uid, gid, None).unwrap()
}

fn copied(o: &Output) -> u64 {
    let err = common::stderr(o);
    let line = err
        .lines()
        .find(|l| l.starts_with("staged "))
        .unwrap_or_else(|| panic!("no summary: {err}"));
    let n = line
        .split(" files (")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap();
    n.parse().unwrap()
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_user_cannot_stage_what_the_user_cannot_read() {
    let w = workdir();
    let dest = scratch_for_user(&w.path().join("scratch"));
    // Another user's (root's) private tree, and /root itself.
    let private = w.path().join("private");
    std::fs::create_dir(&private).unwrap();
    std::fs::write(private.join("secret"), b"secret").unwrap();
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
    for src in [private.to_str().unwrap(), "/root"] {
        let o = stage_in(&format!("{src}:copy"), &dest, &["--user", "berthtest"]);
        assert!(!o.status.success(), "staged {src} as berthtest");
        let err = common::stderr(&o);
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(
            err.contains("Permission denied") && err.contains("job's user"),
            "{err}"
        );
        assert!(stage::status(&dest.join("copy")).is_none());
        assert!(!dest.join("copy/secret").exists());
    }
    // A readable tree is staged, and its copy belongs to the user.
    let public = w.path().join("public");
    std::fs::create_dir(&public).unwrap();
    std::fs::write(public.join("f"), b"data").unwrap();
    let o = stage_in(
        &format!("{}:pub", public.display()),
        &dest,
        &["--user", "berthtest"],
    );
    assert!(o.status.success(), "{}", common::stderr(&o));
    let (uid, _, _) = test_user();
    assert_eq!(std::fs::metadata(dest.join("pub/f")).unwrap().uid(), uid);
    assert!(stage::status(&dest.join("pub")).is_some());
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn symlinks_neither_leak_the_source_nor_redirect_the_destination() {
    let w = workdir();
    let (uid, gid, _) = test_user();
    let dest = scratch_for_user(&w.path().join("scratch"));
    let src = w.path().join("src");
    std::fs::create_dir(&src).unwrap();
    std::fs::write(src.join("f"), b"data").unwrap();
    std::os::unix::fs::symlink("/etc/shadow", src.join("shadow")).unwrap();
    std::os::unix::fs::symlink("/root", src.join("rootdir")).unwrap();
    let o = stage_in(
        &format!("{}:ds", src.display()),
        &dest,
        &["--user", "berthtest"],
    );
    assert!(o.status.success(), "{}", common::stderr(&o));
    for link in ["shadow", "rootdir"] {
        let meta = std::fs::symlink_metadata(dest.join("ds").join(link)).unwrap();
        assert!(meta.file_type().is_symlink(), "{link} was followed");
    }

    // The user plants a symlink in the scratch to a directory of theirs outside it: staging
    // there is refused rather than written through.
    let outside = w.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    std::os::unix::fs::chown(&outside, Some(uid), Some(gid)).unwrap();
    std::os::unix::fs::symlink(&outside, dest.join("evil")).unwrap();
    let o = stage_in(
        &format!("{}:evil", src.display()),
        &dest,
        &["--user", "berthtest"],
    );
    assert!(!o.status.success());
    let err = common::stderr(&o);
    assert!(err.contains("symlink in the destination"), "{err}");
    assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
    let o = stage_in(
        &format!("{}:evil/sub", src.display()),
        &dest,
        &["--user", "berthtest"],
    );
    assert!(!o.status.success());
    assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn restaging_copies_only_what_changed() {
    let w = workdir();
    let dest = scratch_for_user(&w.path().join("scratch"));
    let src = w.path().join("src");
    for d in 0..5 {
        std::fs::create_dir_all(src.join(format!("d{d}"))).unwrap();
        for f in 0..20 {
            std::fs::write(
                src.join(format!("d{d}/f{f}")),
                vec![d as u8 ^ f as u8; 4096 + f],
            )
            .unwrap();
        }
    }
    let spec = format!("{}:ds", src.display());
    let args = ["--user", "berthtest", "--verify"];
    let o = stage_in(&spec, &dest, &args);
    assert!(o.status.success(), "{}", common::stderr(&o));
    assert_eq!(copied(&o), 100);
    let o = stage_in(&spec, &dest, &args);
    assert_eq!(copied(&o), 0, "{}", common::stderr(&o));
    std::fs::write(src.join("d3/f7"), b"new").unwrap();
    std::fs::write(src.join("d0/new"), b"added").unwrap();
    let o = stage_in(&spec, &dest, &args);
    assert_eq!(copied(&o), 2, "{}", common::stderr(&o));
    assert_eq!(
        stage::checksums(&src).unwrap(),
        stage::checksums(&dest.join("ds")).unwrap()
    );
}

/// Unmounts a tmpfs on drop.
struct Mount(PathBuf);
impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_full_destination_fails_in_one_line_without_a_marker() {
    let w = workdir();
    let mnt = w.path().join("small");
    std::fs::create_dir(&mnt).unwrap();
    let status = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs"])
        .arg(&mnt)
        .status()
        .unwrap();
    assert!(status.success());
    let _guard = Mount(mnt.clone());
    let dest = scratch_for_user(&mnt);
    let src = w.path().join("src");
    std::fs::create_dir(&src).unwrap();
    std::fs::write(src.join("big"), vec![1u8; 3 << 20]).unwrap();
    let o = stage_in(
        &format!("{}:ds", src.display()),
        &dest,
        &["--user", "berthtest"],
    );
    assert!(!o.status.success());
    let err = common::stderr(&o);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("needs 3145728 bytes") && err.contains("available (free space)"),
        "{err}"
    );
    assert!(stage::status(&dest.join("ds")).is_none());
    assert!(
        !dest.join("ds/big").exists(),
        "copied before checking space"
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_killed_stage_is_incomplete_and_resumes_to_an_identical_tree() {
    let w = workdir();
    let dest = scratch_for_user(&w.path().join("scratch"));
    let src = w.path().join("src");
    std::fs::create_dir(&src).unwrap();
    // 6 x 96 MiB of distinct data, copied 1 MiB at a time by one worker: slow enough to kill.
    for i in 0..6u8 {
        let data: Vec<u8> = (0..96u32 << 20)
            .map(|j| (j.wrapping_mul(31) >> 7) as u8 ^ i)
            .collect();
        std::fs::write(src.join(format!("part{i}")), data).unwrap();
    }
    let spec = format!("{}:ds", src.display());
    let mut child = common::berth(&[
        "stage",
        "in",
        &spec,
        "--workers",
        "1",
        "--user",
        "berthtest",
        "--to",
    ])
    .arg(&dest)
    .stderr(std::process::Stdio::null())
    .spawn()
    .unwrap();
    let start = Instant::now();
    let ds = dest.join("ds");
    // Killed once a first file is complete (its mtime is the source's, set last).
    let done = |i: u8| {
        let name = format!("part{i}");
        let (s, d) = (
            std::fs::metadata(src.join(&name)).unwrap(),
            std::fs::metadata(ds.join(&name)),
        );
        d.is_ok_and(|d| d.mtime_nsec() == s.mtime_nsec() && d.mtime() == s.mtime())
    };
    while !(0..6).any(done) && start.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        stage::status(&ds).is_none(),
        "a killed stage is marked complete"
    );
    assert_ne!(
        stage::checksums(&src).unwrap(),
        stage::checksums(&ds).unwrap(),
        "killed too late"
    );

    let o = stage_in(&spec, &dest, &["--user", "berthtest"]);
    assert!(o.status.success(), "{}", common::stderr(&o));
    let n = copied(&o);
    assert!((1..6).contains(&n), "resume copied {n} of 6 files");
    assert_eq!(
        stage::checksums(&src).unwrap(),
        stage::checksums(&ds).unwrap()
    );
    assert!(stage::status(&ds).is_some());
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn scratch_is_the_users_and_is_removed_whatever_the_job_left() {
    let w = workdir();
    let root = w.path().join("scratch");
    let (uid, gid, _) = test_user();
    let dir = scratch::create(&root, "77", uid, gid, None).unwrap();
    let meta = std::fs::metadata(&dir).unwrap();
    assert_eq!(
        (meta.uid(), meta.gid(), meta.mode() & 0o7777),
        (uid, gid, 0o700)
    );
    // The job (as the user) leaves a read-only tree.
    let script = format!(
        "mkdir -p {d}/a/b && echo x > {d}/a/b/f && chmod 0500 {d}/a/b {d}/a && chmod 0400 {d}/a/b/f",
        d = dir.display()
    );
    let ok = Command::new("setpriv")
        .args([
            "--reuid",
            &uid.to_string(),
            "--regid",
            &gid.to_string(),
            "--clear-groups",
            "sh",
            "-c",
            &script,
        ])
        .status()
        .unwrap();
    assert!(ok.success());
    // Another user's existing directory is never taken over.
    assert!(scratch::create(&root, "77", 0, 0, None).is_err());
    scratch::remove(&root, "77").unwrap();
    assert!(!dir.exists());
}
