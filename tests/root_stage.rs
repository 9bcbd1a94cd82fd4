//! Root tier: staging with a real non-root user's credentials, on real directories and a real
//! full filesystem (a 1 MiB tmpfs), and a stage killed half-way then resumed.

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use berth::stage::{self, scratch};
use common::{get_xattr, set_xattr, test_user};

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

/// A command run as the test user, with its primary group only.
fn as_test_user() -> Command {
    let (uid, gid, _) = test_user();
    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid", &uid.to_string(), "--regid", &gid.to_string()])
        .arg("--clear-groups");
    cmd
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
    for d in 0u8..5 {
        std::fs::create_dir_all(src.join(format!("d{d}"))).unwrap();
        for f in 0usize..20 {
            std::fs::write(
                src.join(format!("d{d}/f{f}")),
                vec![d ^ f.to_le_bytes()[0]; 4096 + f],
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
    let _guard = small_tmpfs(&mnt, 0o755);
    let dest = scratch_for_user(&mnt);
    let src = w.path().join("src");
    std::fs::create_dir(&src).unwrap();
    std::fs::write(src.join("big"), vec![1u8; 3 << 20]).unwrap();
    let o = stage_in(
        &format!("{}:ds", src.display()),
        &dest,
        &["--user", "berthtest"],
    );
    refused_for_space(
        &o,
        "needs 3145728 bytes",
        "available (free space)",
        &dest.join("ds/big"),
    );
}

/// `o` failed in one line saying `needed` and `limit`, before `file` was written or the
/// destination marked complete.
fn refused_for_space(o: &Output, needed: &str, limit: &str, file: &Path) {
    assert!(!o.status.success());
    let err = common::stderr(o);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains(needed) && err.contains(limit), "{err}");
    assert!(stage::status(file.parent().unwrap()).is_none());
    assert!(!file.exists(), "copied before checking space");
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
            .map(|j| (j.wrapping_mul(31) >> 7).to_le_bytes()[0] ^ i)
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
    let ok = as_test_user().args(["sh", "-c", &script]).status().unwrap();
    assert!(ok.success());
    scratch::remove(&root, "77").unwrap();
    assert!(!dir.exists());
    // A directory left there is never handed to another job's user (nor a failure, which
    // would drain the node): it is removed and made anew, that user's and empty.
    std::fs::create_dir_all(dir.join("left")).unwrap();
    std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).unwrap();
    let again = scratch::create(&root, "77", 0, 0, None).unwrap();
    let meta = std::fs::metadata(&again).unwrap();
    assert_eq!((meta.uid(), meta.mode() & 0o7777), (0, 0o700));
    assert_eq!(std::fs::read_dir(&again).unwrap().count(), 0);
    scratch::remove(&root, "77").unwrap();
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn scratch_and_retention_made_under_a_umask_of_077_are_reachable_by_the_user() {
    let w = workdir();
    // Missing parents too: the Prolog creates what the config names.
    let root = w.path().join("local/scratch");
    let area = w.path().join("kept/retained");
    let (uid, gid, _) = test_user();
    // The root tier runs one test at a time: the process's umask is this test's alone.
    // SAFETY: umask only changes this process's file mode creation mask.
    let before = unsafe { libc::umask(0o077) };
    let made = (|| -> Result<PathBuf, String> {
        let dir = scratch::create(&root, "88", uid, gid, None).map_err(|e| e.to_string())?;
        std::fs::write(dir.join("result"), "r").map_err(|e| e.to_string())?;
        stage::retain::retain(&root, "88", &area, 1_000).map_err(|e| e.to_string())
    })();
    // SAFETY: as above.
    unsafe { libc::umask(before) };
    let kept = made.unwrap();
    for (dir, mode) in [
        (w.path().join("local"), 0o755),
        (root.clone(), 0o755),
        (w.path().join("kept"), 0o755),
        (area.clone(), 0o711),
    ] {
        let m = std::fs::metadata(&dir).unwrap().mode() & 0o7777;
        assert_eq!(m, mode, "{}: {m:o}", dir.display());
    }
    // The user reaches the job's directory through them (before: EACCES at the 0700 root).
    let ls = as_test_user().arg("ls").arg(&kept).output().unwrap();
    assert_eq!(common::stdout(&ls), "result\n", "{}", common::stderr(&ls));
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_level_of_more_directories_than_open_files_allowed_is_staged() {
    // 300 directories side by side (as a dataset of 1,000 classes has), with at most 64 open
    // files: the walk must not hold a directory open per directory of a level.
    let w = workdir();
    let src = w.path().join("classes");
    for i in 0..300 {
        let d = src.join(format!("c{i:03}"));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("x"), i.to_string()).unwrap();
    }
    let to = w.path().join("scratch");
    let limited = |extra: &[&str]| {
        let mut cmd = common::berth(&["stage", "in", src.to_str().unwrap(), "--to"]);
        cmd.arg(&to).args(extra);
        // SAFETY: setrlimit is async-signal-safe.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                let lim = libc::rlimit {
                    rlim_cur: 64,
                    rlim_max: 64,
                };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            })
        };
        cmd.output().unwrap()
    };
    let first = limited(&[]);
    assert!(first.status.success(), "{}", common::stderr(&first));
    assert_eq!(copied(&first), 300);
    // The re-stage compares every entry with the destination, under the same limit.
    let again = limited(&[]);
    assert!(again.status.success(), "{}", common::stderr(&again));
    assert_eq!(copied(&again), 0);
}

// ---- The dataset cache ----

/// A config with the dataset cache on for `prefix`, its cache under `w`.
fn cache_config(w: &Path, prefix: &Path, max_bytes: u64) -> PathBuf {
    cache_config_at(w, &w.join("cache"), prefix, max_bytes)
}

fn cache_config_at(w: &Path, cache: &Path, prefix: &Path, max_bytes: u64) -> PathBuf {
    let cfg = w.join("berth.toml");
    std::fs::write(
        &cfg,
        format!(
            "[stage]\ncache_dir = \"{}\"\ncache_prefixes = [\"{}\"]\ncache_max_bytes = {max_bytes}\n\
             [scratch]\nroot = \"{}\"\n",
            cache.display(),
            prefix.display(),
            w.join("scratch").display()
        ),
    )
    .unwrap();
    cfg
}

fn stage_cached(cfg: &Path, src: &Path, to: &Path, user: &str) -> Output {
    Command::new(common::BERTH)
        .arg("--config")
        .arg(cfg)
        .args(["stage", "in"])
        .arg(format!("{}:ds", src.display()))
        .arg("--to")
        .arg(to)
        .args(["--user", user])
        .output()
        .unwrap()
}

/// The summary line's numbers: (copied, unchanged, from cache).
fn counts(o: &Output) -> (u64, u64, u64) {
    let err = common::stderr(o);
    assert!(o.status.success(), "{err}");
    let line = err.lines().find(|l| l.starts_with("staged ")).unwrap();
    let inner = line
        .split(" files (")
        .nth(1)
        .unwrap()
        .split(')')
        .next()
        .unwrap();
    let n: Vec<u64> = inner
        .split(", ")
        .map(|p| p.split(' ').next().unwrap().parse().unwrap())
        .collect();
    (n[0], n[1], n[2])
}

/// The cache's entry directory for the (canonical) source `src`, if any.
fn entry_of(w: &Path, src: &Path) -> Option<PathBuf> {
    let src = std::fs::canonicalize(src).unwrap();
    std::fs::read_dir(w.join("cache/entries"))
        .ok()?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            std::fs::read(p.join("meta.json")).is_ok_and(|b| {
                serde_json::from_slice::<serde_json::Value>(&b).unwrap()["source"]
                    == src.to_str().unwrap()
            })
        })
}

fn dataset(dir: &Path, files: usize, size: usize) {
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    for f in 0..files {
        let rel = if f % 2 == 0 {
            format!("f{f}")
        } else {
            format!("sub/f{f}")
        };
        std::fs::write(dir.join(rel), vec![f.to_le_bytes()[0]; size + f]).unwrap();
    }
    std::os::unix::fs::symlink("f0", dir.join("link")).unwrap();
}

fn user_scratch(w: &Path, job: &str) -> PathBuf {
    let (uid, gid, _) = test_user();
    scratch::create(&w.join("scratch"), job, uid, gid, None).unwrap()
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn the_cache_serves_a_second_job_by_hardlinks_that_the_job_cannot_write_through() {
    let w = workdir();
    let data = w.path().join("data");
    let src = data.join("set");
    dataset(&src, 10, 5000);
    let cfg = cache_config(w.path(), &data, 1 << 30);
    let job1 = user_scratch(w.path(), "1");
    let o = stage_cached(&cfg, &src, &job1, "berthtest");
    assert_eq!(counts(&o), (10, 0, 10), "{}", common::stderr(&o));
    assert!(common::stderr(&o).contains("(linked from cache)"));

    let job2 = user_scratch(w.path(), "2");
    let o = stage_cached(&cfg, &src, &job2, "berthtest");
    // Nothing read from the source: every file linked from the cache.
    assert_eq!(counts(&o), (0, 0, 10), "{}", common::stderr(&o));
    assert!(common::stderr(&o).contains("0 bytes copied"));
    let entry = entry_of(w.path(), &src).unwrap();
    for f in ["f0", "sub/f1", "f8"] {
        let (a, b) = (
            std::fs::metadata(entry.join("data").join(f)).unwrap(),
            std::fs::metadata(job2.join("ds").join(f)).unwrap(),
        );
        assert_eq!(
            (a.dev(), a.ino()),
            (b.dev(), b.ino()),
            "{f} is not the cached inode"
        );
        assert_eq!(
            (b.uid(), b.mode() & 0o222),
            (0, 0),
            "{f}: root's, read-only"
        );
    }
    assert_eq!(
        stage::checksums(&src).unwrap(),
        stage::checksums(&job2.join("ds")).unwrap()
    );
    let (uid, _, _) = test_user();
    let ds = std::fs::symlink_metadata(job2.join("ds/sub")).unwrap();
    assert_eq!(ds.uid(), uid, "directories are the user's");
    assert!(
        std::fs::symlink_metadata(job2.join("ds/link"))
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert!(stage::status(&job2.join("ds")).is_some());

    // The job (as the user) cannot write into or chmod its linked copy, but can replace it; the
    // cache is untouched either way.
    let f = job2.join("ds/f0");
    let script = format!(
        "echo x >> {f} ; chmod 666 {f} ; truncate -s 0 {f} ; rm -f {f} && echo mine > {f}",
        f = f.display()
    );
    let out = as_test_user().args(["sh", "-c", &script]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(std::fs::read(&f).unwrap(), b"mine\n");
    assert_eq!(
        std::fs::read(entry.join("data/f0")).unwrap(),
        std::fs::read(src.join("f0")).unwrap()
    );
    assert_eq!(
        std::fs::read(job1.join("ds/f0")).unwrap(),
        std::fs::read(src.join("f0")).unwrap()
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_changed_source_file_is_copied_again_and_the_others_stay_linked() {
    let w = workdir();
    let data = w.path().join("data");
    let src = data.join("set");
    dataset(&src, 10, 5000);
    let cfg = cache_config(w.path(), &data, 1 << 30);
    let job1 = user_scratch(w.path(), "1");
    assert_eq!(counts(&stage_cached(&cfg, &src, &job1, "berthtest")).0, 10);
    std::fs::write(src.join("sub/f3"), b"changed").unwrap();
    std::fs::write(src.join("new"), b"added").unwrap();
    let job2 = user_scratch(w.path(), "2");
    let mut cmd = Command::new(common::BERTH);
    cmd.arg("--config").arg(&cfg).args(["stage", "in"]);
    cmd.arg(format!("{}:ds", src.display()))
        .arg("--to")
        .arg(&job2);
    let o = cmd
        .args(["--user", "berthtest", "--verify"])
        .output()
        .unwrap();
    assert_eq!(counts(&o), (2, 0, 11), "{}", common::stderr(&o));
    assert!(
        common::stderr(&o).contains(", verified"),
        "{}",
        common::stderr(&o)
    );
    assert_eq!(std::fs::read(job2.join("ds/sub/f3")).unwrap(), b"changed");
    assert_eq!(
        stage::checksums(&src).unwrap(),
        stage::checksums(&job2.join("ds")).unwrap()
    );
    // Unchanged files are the same inodes as the first job's; the first job's copy of the
    // changed file still holds the old data.
    let ino = |p: PathBuf| std::fs::metadata(p).unwrap().ino();
    assert_eq!(ino(job1.join("ds/f0")), ino(job2.join("ds/f0")));
    assert_ne!(ino(job1.join("ds/sub/f3")), ino(job2.join("ds/sub/f3")));
    assert_eq!(
        std::fs::read(job1.join("ds/sub/f3")).unwrap(),
        vec![3u8; 5003]
    );
    // Staged again into the same scratch: nothing to do.
    let o = stage_cached(&cfg, &src, &job2, "berthtest");
    assert_eq!(counts(&o), (0, 11, 0), "{}", common::stderr(&o));
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_user_who_cannot_read_the_source_is_refused_though_it_is_cached() {
    let w = workdir();
    let data = w.path().join("data");
    let src = data.join("set");
    dataset(&src, 4, 100);
    std::fs::set_permissions(&src, std::fs::Permissions::from_mode(0o700)).unwrap();
    let cfg = cache_config(w.path(), &data, 1 << 30);
    // Root (a user who can read it) fills the cache.
    let rootdir = w.path().join("rootjob");
    assert_eq!(counts(&stage_cached(&cfg, &src, &rootdir, "root")).0, 4);
    assert!(entry_of(w.path(), &src).is_some());
    let job = user_scratch(w.path(), "2");
    let o = stage_cached(&cfg, &src, &job, "berthtest");
    assert!(!o.status.success());
    let err = common::stderr(&o);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("Permission denied"), "{err}");
    assert!(!job.join("ds/f0").exists() && stage::status(&job.join("ds")).is_none());
    // One unreadable file is enough to be refused.
    std::fs::set_permissions(&src, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(src.join("f2"), std::fs::Permissions::from_mode(0o600)).unwrap();
    let o = stage_cached(&cfg, &src, &job, "berthtest");
    assert!(!o.status.success());
    assert!(common::stderr(&o).contains("f2"), "{}", common::stderr(&o));
    assert!(!job.join("ds/f0").exists());
    // Readable again, as when it was cached: served from the cache.
    std::fs::set_permissions(src.join("f2"), std::fs::Permissions::from_mode(0o644)).unwrap();
    let o = stage_cached(&cfg, &src, &job, "berthtest");
    assert_eq!(counts(&o), (0, 0, 4), "{}", common::stderr(&o));
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn the_least_recently_used_entry_is_evicted_under_the_cap() {
    let w = workdir();
    let data = w.path().join("data");
    for s in ["a", "b", "c"] {
        dataset(&data.join(s), 4, 25_000);
    }
    // Each set is ~100 kB: two fit, three do not.
    let cfg = cache_config(w.path(), &data, 250_000);
    let job = user_scratch(w.path(), "1");
    for s in ["a", "b", "a", "c"] {
        let o = stage_cached(&cfg, &data.join(s), &job.join(s), "berthtest");
        assert!(o.status.success(), "{}", common::stderr(&o));
    }
    assert!(entry_of(w.path(), &data.join("a")).is_some());
    assert!(
        entry_of(w.path(), &data.join("b")).is_none(),
        "b was least recently used"
    );
    assert!(entry_of(w.path(), &data.join("c")).is_some());
    // The evicted dataset's staged copy lives on in the job's scratch.
    assert_eq!(
        stage::checksums(&data.join("b")).unwrap(),
        stage::checksums(&job.join("b/ds")).unwrap()
    );
}

fn big_dataset(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    for i in 0..6u8 {
        let data: Vec<u8> = (0..64u32 << 20)
            .map(|j| (j.wrapping_mul(31) >> 7).to_le_bytes()[0] ^ i)
            .collect();
        std::fs::write(dir.join(format!("part{i}")), data).unwrap();
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn concurrent_fills_of_one_entry_copy_it_once() {
    let w = workdir();
    let data = w.path().join("data");
    let src = data.join("set");
    big_dataset(&src);
    let cfg = cache_config(w.path(), &data, 1 << 40);
    let jobs: Vec<PathBuf> = ["1", "2", "3"]
        .iter()
        .map(|j| user_scratch(w.path(), j))
        .collect();
    let children: Vec<_> = jobs
        .iter()
        .map(|j| {
            Command::new(common::BERTH)
                .arg("--config")
                .arg(&cfg)
                .args(["stage", "in"])
                .arg(format!("{}:ds", src.display()))
                .arg("--to")
                .arg(j)
                .args(["--user", "berthtest"])
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let copied: u64 = children
        .into_iter()
        .map(|c| counts(&c.wait_with_output().unwrap()).0)
        .sum();
    assert_eq!(
        copied, 6,
        "the dataset was copied into the cache more than once"
    );
    let sums = stage::checksums(&src).unwrap();
    for j in &jobs {
        assert_eq!(sums, stage::checksums(&j.join("ds")).unwrap());
    }
    assert_eq!(
        std::fs::read_dir(w.path().join("cache/entries"))
            .unwrap()
            .count(),
        1
    );
    assert_eq!(
        std::fs::read_dir(w.path().join("cache/tmp"))
            .unwrap()
            .count(),
        0
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_killed_fill_leaves_no_entry_that_is_served() {
    let w = workdir();
    let data = w.path().join("data");
    let src = data.join("set");
    big_dataset(&src);
    let cfg = cache_config(w.path(), &data, 1 << 40);
    let job = user_scratch(w.path(), "1");
    let mut child = Command::new(common::BERTH)
        .arg("--config")
        .arg(&cfg)
        .args(["stage", "in"])
        .arg(format!("{}:ds", src.display()))
        .arg("--to")
        .arg(&job)
        .args(["--user", "berthtest", "--workers", "1"])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Killed once the fill has written a first file's data.
    let tmp = w.path().join("cache/tmp");
    let start = Instant::now();
    let writing = || {
        std::fs::read_dir(&tmp).is_ok_and(|rd| {
            rd.flatten().any(|e| {
                std::fs::read_dir(e.path().join("data"))
                    .is_ok_and(|d| d.flatten().any(|f| f.metadata().is_ok_and(|m| m.len() > 0)))
            })
        })
    };
    while !writing() && start.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(2));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(writing(), "the fill was not caught in progress");
    assert!(
        entry_of(w.path(), &src).is_none(),
        "a killed fill left an entry"
    );
    assert!(stage::status(&job.join("ds")).is_none());
    // The next stage fills it completely (all 6 files from the source) and clears the leftover.
    let o = stage_cached(&cfg, &src, &job, "berthtest");
    assert_eq!(counts(&o).0, 6, "{}", common::stderr(&o));
    assert_eq!(
        stage::checksums(&src).unwrap(),
        stage::checksums(&job.join("ds")).unwrap()
    );
    assert_eq!(std::fs::read_dir(&tmp).unwrap().count(), 0);
}

/// A 4-file dataset under `w/data` and a config caching it in a directory of /dev/shm, a tmpfs:
/// no hardlinks into /var/tmp, no reflinks either. The cache directory lives as long as the
/// returned handle.
fn dataset_with_a_cache_on_another_filesystem(w: &Path) -> (PathBuf, tempfile::TempDir, PathBuf) {
    let data = w.join("data");
    let src = data.join("set");
    dataset(&src, 4, 3000);
    let cache = tempfile::tempdir_in("/dev/shm").unwrap();
    let cfg = cache_config_at(w, cache.path(), &data, 1 << 30);
    (src, cache, cfg)
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_cache_on_another_filesystem_hands_out_the_users_own_copies() {
    let w = workdir();
    let (src, _cache, cfg) = dataset_with_a_cache_on_another_filesystem(w.path());
    let job = user_scratch(w.path(), "1");
    let o = stage_cached(&cfg, &src, &job, "berthtest");
    assert_eq!(counts(&o), (4, 0, 4), "{}", common::stderr(&o));
    assert!(common::stderr(&o).contains("(copied from cache)"));
    let (uid, _, _) = test_user();
    let (s, d) = (
        std::fs::metadata(src.join("sub/f1")).unwrap(),
        std::fs::metadata(job.join("ds/sub/f1")).unwrap(),
    );
    assert_eq!((d.uid(), d.mode()), (uid, s.mode()));
    assert_eq!(
        stage::checksums(&src).unwrap(),
        stage::checksums(&job.join("ds")).unwrap()
    );
    let job2 = user_scratch(w.path(), "2");
    assert_eq!(
        counts(&stage_cached(&cfg, &src, &job2, "berthtest")),
        (0, 0, 4)
    );
    assert_eq!(
        counts(&stage_cached(&cfg, &src, &job2, "berthtest")),
        (0, 4, 0)
    );
}

/// A 1 MiB tmpfs at `dir` with `mode` (unmounted on drop).
fn small_tmpfs(dir: &Path, mode: u32) -> Mount {
    std::fs::create_dir_all(dir).unwrap();
    let status = Command::new("mount")
        .args([
            "-t",
            "tmpfs",
            "-o",
            &format!("size=1m,mode={mode:o}"),
            "tmpfs",
        ])
        .arg(dir)
        .status()
        .unwrap();
    assert!(status.success());
    Mount(dir.to_path_buf())
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn copies_from_a_cache_on_another_filesystem_stay_within_the_scratch_cap() {
    let w = workdir();
    let (src, _cache, cfg) = dataset_with_a_cache_on_another_filesystem(w.path());
    let mut text = std::fs::read_to_string(&cfg).unwrap();
    text.push_str("cap_bytes = 5000\n");
    std::fs::write(&cfg, text).unwrap();
    let job = user_scratch(w.path(), "1");
    let o = stage_cached(&cfg, &src, &job, "berthtest");
    // 3000 + 3001 + 3002 + 3003 bytes, none of them in place yet.
    let (needed, limit) = ("needs 12006 bytes", "5000 available (per-job scratch cap)");
    refused_for_space(&o, needed, limit, &job.join("ds/f0"));
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_full_cache_filesystem_gives_the_job_a_plain_copy() {
    let w = workdir();
    let data = w.path().join("data");
    let src = data.join("set");
    // 4 files of 400 KB: more than the cache's 1 MiB filesystem holds.
    dataset(&src, 4, 400_000);
    let cache_dir = w.path().join("cache");
    let _guard = small_tmpfs(&cache_dir, 0o700);
    let cfg = cache_config(w.path(), &data, 1 << 30);
    let job = user_scratch(w.path(), "1");
    let o = stage_cached(&cfg, &src, &job, "berthtest");
    let err = common::stderr(&o);
    assert_eq!(counts(&o), (4, 0, 0), "{err}");
    assert!(
        err.contains("no room for") && err.contains("staging without the cache"),
        "{err}"
    );
    assert!(err.contains("(copied)"), "{err}");
    assert_eq!(
        stage::checksums(&src).unwrap(),
        stage::checksums(&job.join("ds")).unwrap()
    );
    assert!(
        entry_of(w.path(), &src).is_none(),
        "a partial entry was kept"
    );
    let left: Vec<_> = std::fs::read_dir(cache_dir.join("tmp")).unwrap().collect();
    assert!(left.is_empty(), "a partial fill was left: {left:?}");
}

/// A dataset with user.* attributes on a file and a directory, and a trusted.* one (root's
/// namespace) that must never be handed on.
fn dataset_with_xattrs(src: &Path) {
    dataset(src, 4, 100);
    set_xattr(&src.join("f0"), "user.origin", b"sensor-7");
    set_xattr(&src.join("sub"), "user.kind", b"shard");
    set_xattr(&src.join("f0"), "trusted.secret", b"root only");
}

/// `got`, staged from [`dataset_with_xattrs`] with `--xattrs`, has its user.* attributes and not
/// the trusted.* one.
fn has_the_user_xattrs_only(got: &Path) {
    assert_eq!(
        get_xattr(&got.join("f0"), "user.origin").as_deref(),
        Some(&b"sensor-7"[..])
    );
    assert_eq!(
        get_xattr(&got.join("sub"), "user.kind").as_deref(),
        Some(&b"shard"[..])
    );
    assert_eq!(get_xattr(&got.join("f0"), "trusted.secret"), None);
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn user_extended_attributes_are_staged_when_asked_and_no_others() {
    let w = workdir();
    let src = w.path().join("src");
    dataset_with_xattrs(&src);
    let dest = scratch_for_user(&w.path().join("scratch"));
    let spec = format!("{}:plain", src.display());
    let o = stage_in(&spec, &dest, &["--user", "berthtest"]);
    assert_eq!(copied(&o), 4, "{}", common::stderr(&o));
    assert_eq!(get_xattr(&dest.join("plain/f0"), "user.origin"), None);

    let spec = format!("{}:attrs", src.display());
    let o = stage_in(&spec, &dest, &["--user", "berthtest", "--xattrs"]);
    assert_eq!(copied(&o), 4, "{}", common::stderr(&o));
    has_the_user_xattrs_only(&dest.join("attrs"));
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn the_cache_keeps_extended_attributes_apart_from_entries_without_them() {
    let w = workdir();
    let data = w.path().join("data");
    let src = data.join("set");
    dataset_with_xattrs(&src);
    let cfg = cache_config(w.path(), &data, 1 << 30);
    let job = user_scratch(w.path(), "1");
    assert_eq!(
        counts(&stage_cached(&cfg, &src, &job, "berthtest")),
        (4, 0, 4)
    );
    assert_eq!(get_xattr(&job.join("ds/f0"), "user.origin"), None);

    // Asking for the attributes: the entry made without them is not served; a new one is made.
    let job2 = user_scratch(w.path(), "2");
    let o = Command::new(common::BERTH)
        .arg("--config")
        .arg(&cfg)
        .args(["stage", "in", "--xattrs", "--user", "berthtest", "--to"])
        .arg(&job2)
        .arg(format!("{}:ds", src.display()))
        .output()
        .unwrap();
    assert_eq!(counts(&o), (4, 0, 4));
    has_the_user_xattrs_only(&job2.join("ds"));
    let entry = entry_of(w.path(), &src).unwrap();
    assert_eq!(get_xattr(&entry.join("data/f0"), "trusted.secret"), None);
}

/// Bytes free on the filesystem holding `path`.
fn free_bytes(path: &Path) -> u64 {
    let st = nix::sys::statvfs::statvfs(path).unwrap();
    st.blocks_free() as u64 * st.fragment_size() as u64
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn on_a_filesystem_that_shares_extents_staging_clones_instead_of_copying() {
    let w = workdir();
    // An XFS (reflinks on, as mkfs.xfs makes it by default) on a sparse file.
    let img = w.path().join("xfs.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(512 << 20)
        .unwrap();
    let mkfs = Command::new("mkfs.xfs")
        .args(["-q", "-m", "reflink=1"])
        .arg(&img)
        .status()
        .expect("mkfs.xfs (apt-get install xfsprogs)");
    assert!(mkfs.success());
    let mnt = w.path().join("xfs");
    std::fs::create_dir(&mnt).unwrap();
    let status = Command::new("mount")
        .args(["-o", "loop"])
        .arg(&img)
        .arg(&mnt)
        .status()
        .unwrap();
    assert!(status.success());
    let _guard = Mount(mnt.clone());
    std::fs::set_permissions(&mnt, std::fs::Permissions::from_mode(0o755)).unwrap();

    // 96 MiB in one file: two 64 MiB chunks (the second one ending at the end of the file), and
    // small files beside it.
    let src = mnt.join("data");
    std::fs::create_dir(&src).unwrap();
    let big: Vec<u8> = (0..96u32 << 20)
        .map(|j| (j.wrapping_mul(131) >> 9).to_le_bytes()[0])
        .collect();
    std::fs::write(src.join("big"), &big).unwrap();
    for i in 0usize..8 {
        std::fs::write(
            src.join(format!("small{i}")),
            vec![i.to_le_bytes()[0]; 5000 + i],
        )
        .unwrap();
    }
    let dest = scratch_for_user(&mnt.join("scratch"));
    Command::new("sync").status().unwrap();
    let before = free_bytes(&mnt);
    let o = stage_in(
        &format!("{}:ds", src.display()),
        &dest,
        &["--user", "berthtest"],
    );
    assert_eq!(copied(&o), 9, "{}", common::stderr(&o));
    Command::new("sync").status().unwrap();
    let used = before.saturating_sub(free_bytes(&mnt));
    assert!(
        used < 8 << 20,
        "staging 96 MiB within one XFS took {used} bytes: copied, not cloned"
    );
    assert_eq!(
        stage::checksums(&src).unwrap(),
        stage::checksums(&dest.join("ds")).unwrap()
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn prologs_of_one_job_racing_for_its_scratch_all_get_it() {
    // Two slurmd on one host (or a Prolog run twice at once) create the same job's scratch at
    // the same moment: every one must end with the user's directory, none with EEXIST (which
    // fails the Prolog and drains the node).
    let w = workdir();
    let root = w.path().join("scratch");
    let (uid, gid, _) = test_user();
    let racers = 4;
    for round in 0..100 {
        let job = format!("race{round}");
        let barrier = std::sync::Barrier::new(racers);
        let results: Vec<Result<PathBuf, String>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..racers)
                .map(|_| {
                    s.spawn(|| {
                        barrier.wait();
                        scratch::create(&root, &job, uid, gid, None).map_err(|e| e.to_string())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for r in &results {
            let dir = r.as_ref().unwrap_or_else(|e| panic!("round {round}: {e}"));
            let meta = std::fs::symlink_metadata(dir).unwrap();
            assert!(meta.is_dir());
            assert_eq!(
                (meta.uid(), meta.gid(), meta.mode() & 0o7777),
                (uid, gid, 0o700),
                "round {round}"
            );
        }
        scratch::remove(&root, &job).unwrap();
    }
}
