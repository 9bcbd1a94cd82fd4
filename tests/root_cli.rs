//! Root tier: the command line's habits against the real binary, kernel and store: `berth run
//! IMAGE CMD`, `berth pull`, flag values refused before any image is fetched, the `--json`
//! listings checked against what exists, verbs that need root refusing another user in one
//! line, `--version` with the commit.

mod common;

use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::{berth, berth_bin, config, ok, rootfs, stderr, stdout, test_user};

const IGNORE: &str = "root tier: run by integration/test.sh";
const _: &str = IGNORE;

/// A world-traversable temporary directory (the test user enters it).
fn workdir() -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("berth-cli-")
        .tempdir_in("/var/tmp")
        .unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

/// The busybox root as an Enroot squashfs image, with a marker file to tell it apart.
fn busybox_sqsh(dir: &Path, marker: &str) -> PathBuf {
    let tree = dir.join("tree");
    let st = Command::new("cp")
        .arg("-a")
        .arg(rootfs())
        .arg(&tree)
        .status()
        .unwrap();
    assert!(st.success());
    std::fs::write(tree.join("marker"), marker).unwrap();
    let out = dir.join("image.sqsh");
    let o = Command::new("mksquashfs")
        .arg(&tree)
        .arg(&out)
        .args(["-comp", "zstd", "-quiet", "-no-progress", "-noappend"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(o.status.success(), "mksquashfs: {}", stderr(&o));
    out
}

fn run(args: &[&str]) -> Output {
    berth(args).stdin(Stdio::null()).output().unwrap()
}

/// berth as the test user, primary group only (setpriv), with the test config.
fn as_user(args: &[&str]) -> Output {
    let (uid, gid, _) = test_user();
    Command::new("setpriv")
        .args(["--reuid", &uid.to_string(), "--regid", &gid.to_string()])
        .arg("--clear-groups")
        .arg(berth_bin())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// Exit 2 and exactly one line on stderr that contains `needle`; nothing on stdout.
fn refused_in_one_line(o: &Output, needle: &str) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    assert_eq!(err.lines().count(), 1, "not one line: {err}");
    assert!(err.starts_with("berth: ") && err.contains(needle), "{err}");
    assert_eq!(stdout(o), "");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn run_takes_the_image_as_first_positional_like_podman() {
    let dir = workdir();
    let sqsh = busybox_sqsh(dir.path(), "positional");
    let s = sqsh.to_str().unwrap();
    // No --image, no --rootfs: IMAGE CMD...; the command's own flags stay the command's.
    let out = ok(run(&[
        "run",
        "--hostname",
        "pos",
        s,
        "sh",
        "-c",
        "cat /marker; hostname",
    ]));
    assert_eq!(out, "positionalpos\n");
    let out = ok(run(&["run", s, "echo", "-n", "--memory", "5Q"]));
    assert_eq!(out, "--memory 5Q");
    // With --image or --rootfs every positional is the command, with `--` or without.
    let out = ok(run(&["run", "--image", s, "--", "cat", "/marker"]));
    assert_eq!(out, "positional");
    let out = ok(run(&["run", "--image", s, "cat", "/marker"]));
    assert_eq!(out, "positional");
    let r = rootfs().to_str().unwrap();
    assert_eq!(ok(run(&["run", "--rootfs", r, "echo", "a", "b"])), "a b\n");
    assert_eq!(ok(run(&["run", "--rootfs", r, "--", "echo", "c"])), "c\n");
    ok(run(&["images", "rm", s]));
    // Nothing to run, said in one line.
    refused_in_one_line(&run(&["run", "--memory", "64M"]), "no image");
    refused_in_one_line(&run(&["run", "--rootfs", r]), "no command given");
    refused_in_one_line(
        &run(&["run", "--rootfs", r, "--entrypoint", "--", "true"]),
        "--entrypoint",
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn pull_is_import() {
    let dir = workdir();
    let sqsh = busybox_sqsh(dir.path(), "pull");
    let s = sqsh.to_str().unwrap();
    // The first import does the work; then import and pull both find it, and say so alike.
    let first = ok(run(&["pull", s]));
    assert!(first.starts_with("sha256:"), "{first}");
    let imported = run(&["import", s]);
    let pulled = run(&["pull", s]);
    assert_eq!(
        (stdout(&pulled), stderr(&pulled), pulled.status.code()),
        (stdout(&imported), stderr(&imported), Some(0))
    );
    assert_eq!(stdout(&pulled), first);
    ok(run(&["images", "rm", first.trim()]));
    let help = ok(run(&["--help"]));
    assert!(
        help.lines()
            .any(|l| l.trim_start().starts_with("import") && l.contains("alias: pull")),
        "{help}"
    );
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn bad_values_fail_in_the_parser_before_any_image_is_fetched() {
    // A registry that counts the connections of a berth that went looking for the image (and
    // closes them: such a berth fails at once instead of waiting for an answer).
    let registry = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = registry.local_addr().unwrap();
    let image = format!("docker://{addr}/nothing:latest");
    let seen = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let counter = {
        let (seen, stop) = (seen.clone(), stop.clone());
        std::thread::spawn(move || {
            for conn in registry.incoming() {
                if stop.load(std::sync::atomic::Ordering::SeqCst) {
                    break;
                }
                drop(conn);
                seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        })
    };
    for (flag, value) in [
        ("--memory", "5Q"),
        ("--memory-swap", "-"),
        ("--cpus", "lots"),
        ("--cpuset", "3-1"),
        ("--pids", "0"),
        ("--timeout", "never"),
        ("--mount", "relative:/x"),
        ("--gpus", "0-x"),
        ("--device", "/etc/passwd"),
        ("--hostname", "a b"),
        ("--workdir", "relative/dir"),
    ] {
        let arg = format!("{flag}={value}");
        let mut cases = vec![
            vec!["run", &arg, "--image", &image, "--", "true"],
            vec!["run", &arg, &image, "true"],
        ];
        if flag != "--timeout" {
            cases.push(vec!["create", &arg, &image]);
        }
        for args in cases {
            let o = run(&args);
            refused_in_one_line(&o, &format!("berth: {flag}"));
        }
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    drop(std::net::TcpStream::connect(addr));
    counter.join().unwrap();
    assert_eq!(
        seen.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "berth connected to the registry before refusing a bad value"
    );
    let o = run(&["images", "gc", "--max-size", "5Q"]);
    refused_in_one_line(&o, "--max-size: invalid size '5Q'");
    let o = run(&["images", "gc", "--unused-for", "7y"]);
    refused_in_one_line(&o, "--unused-for: invalid duration '7y'");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn json_listings_match_what_exists() {
    let dir = workdir();
    // images ls --json: the imported image with its digest, reference, size and last use.
    let sqsh = busybox_sqsh(dir.path(), "json");
    let digest = ok(run(&["import", sqsh.to_str().unwrap()]));
    let digest = digest.trim();
    let list: serde_json::Value =
        serde_json::from_str(&ok(run(&["images", "ls", "--json"]))).unwrap();
    let entry = list
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["digest"] == digest)
        .unwrap_or_else(|| panic!("{digest} missing from images ls --json: {list}"));
    let table = ok(run(&["images", "ls"]));
    for r in entry["references"].as_array().unwrap() {
        assert!(table.contains(r.as_str().unwrap()), "{r} not in:\n{table}");
    }
    let inspect: serde_json::Value =
        serde_json::from_str(&ok(run(&["images", "inspect", digest]))).unwrap();
    assert_eq!(entry["size"], inspect["size"]);
    assert!(entry["size"].as_u64().unwrap() > 0);
    assert_eq!(entry["in_use"], false);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let last_used = entry["last_used"].as_u64().unwrap();
    assert!(last_used <= now && now - last_used < 3600, "{entry}");
    assert!(
        entry["source"].as_str().unwrap().contains("image.sqsh"),
        "{entry}"
    );

    // ps --json: a held container, as it is.
    let created = ok(run(&[
        "create",
        "--rootfs",
        rootfs().to_str().unwrap(),
        "--name",
        "cli-json",
    ]));
    let id = created.trim().to_string();
    let ps = run(&["ps", "--json"]);
    ok(run(&["rm", &id]));
    let ps: serde_json::Value = serde_json::from_str(&ok(ps)).unwrap();
    let c = ps
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == id.as_str())
        .unwrap_or_else(|| panic!("{id} missing from ps --json: {ps}"));
    assert_eq!(c["uid"], 0);
    assert_eq!(c["name"], "cli-json");
    assert_eq!(c["labels"]["name"], "cli-json");
    assert!(c["init_pid"].as_i64().unwrap() > 1, "{c}");
    assert!(c["owner_pid"].is_i64(), "{c}");
    assert!(
        c["cgroup"].as_str().unwrap().ends_with(&id),
        "cgroup of {id}: {c}"
    );

    // stage status --json: a staged tree, and one that is not.
    let src = dir.path().join("data");
    std::fs::create_dir(&src).unwrap();
    std::fs::write(src.join("a"), "12345").unwrap();
    std::fs::write(src.join("b"), "678").unwrap();
    let to = dir.path().join("scratch");
    std::fs::create_dir(&to).unwrap();
    let mut cmd = berth(&["stage", "in", src.to_str().unwrap(), "--to"]);
    ok(cmd.arg(&to).stdin(Stdio::null()).output().unwrap());
    let staged = to.join("data");
    let o = run(&["stage", "status", "--json", staged.to_str().unwrap()]);
    let v: serde_json::Value = serde_json::from_str(&ok(o)).unwrap();
    assert_eq!(v["dir"], staged.to_str().unwrap());
    assert_eq!(v["complete"], true);
    assert_eq!(v["files"], 2);
    assert_eq!(v["bytes"], 8);
    assert_eq!(v["source"], src.to_str().unwrap());
    assert_eq!(v["verified"], false);
    assert!(v["completed_at"].as_u64().unwrap() <= now + 3600);
    let o = run(&["stage", "status", "--json", src.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["complete"], false);
    assert!(v["files"].is_null() && v["source"].is_null(), "{v}");
    // images verify --json: a squashfs image has no layers to check.
    let o = run(&["images", "verify", "--json", digest]);
    let v: serde_json::Value = serde_json::from_str(&ok(o)).unwrap();
    assert_eq!(v[0]["digest"], digest);
    assert_eq!(v[0]["references"], entry["references"]);
    assert_eq!(v[0]["status"], "not-verifiable");
    assert_eq!(v[0]["layers"], serde_json::json!([]));
    ok(run(&["images", "rm", digest]));
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn verbs_that_need_root_tell_a_user_in_one_line_before_touching_anything() {
    let dir = workdir();
    let missing = dir.path().join("no-such.toml");
    let r = rootfs().to_str().unwrap();
    let cfg = config().to_str().unwrap();
    // In the test's own directory: a refused export must not leave a file anywhere shared.
    let out = dir.path().join("x.sqsh").to_str().unwrap().to_string();
    for (args, line) in [
        (vec!["run", "--rootfs", r, "--", "true"], "run needs root"),
        (vec!["run", "busybox", "true"], "run needs root"),
        (vec!["create", "--rootfs", r], "create needs root"),
        (vec!["gc"], "gc needs root"),
        (vec!["import", "busybox"], "import needs root"),
        (vec!["pull", "busybox"], "pull needs root"),
        (vec!["images", "ls"], "images ls needs root"),
        (vec!["images", "gc"], "images gc needs root"),
        (
            vec!["export", "abc", "-o", out.as_str()],
            "export needs root",
        ),
        (
            vec!["health", "--job-start"],
            "health --job-start needs root",
        ),
        (vec!["cdi", "generate"], "cdi generate needs root"),
    ] {
        // With the test config, and with a config that does not exist: the refusal comes
        // before the config is read.
        for c in [cfg, missing.to_str().unwrap()] {
            let mut full = vec!["--config", c];
            full.extend(&args);
            let o = as_user(&full);
            refused_in_one_line(&o, line);
            assert!(stderr(&o).contains("(you are uid "), "{}", stderr(&o));
        }
    }
    assert!(!Path::new(&out).exists(), "a refused export left {out}");
    // exec and rm look the container up first: a missing one, like another user's, is not
    // there (root_security checks the two read alike).
    let o = as_user(&["--config", cfg, "exec", "no-such-c", "--", "true"]);
    refused_in_one_line(&o, "no container 'no-such-c'");
    // What works as a user keeps working.
    let ps = as_user(&["--config", cfg, "ps", "--json"]);
    serde_json::from_str::<serde_json::Value>(&ok(ps)).unwrap();
    ok(as_user(&["--config", cfg, "ps"]));
    ok(as_user(&["--help"]));
    ok(as_user(&["run", "--help"]));
    ok(as_user(&["--version"]));
    ok(as_user(&["--config", cfg, "topo"]));
    let o = as_user(&["--config", cfg, "stage", "status", "--json", "/"]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let (uid, gid, _) = test_user();
    let mine = dir.path().join("mine");
    std::fs::create_dir(&mine).unwrap();
    std::os::unix::fs::chown(&mine, Some(uid), Some(gid)).unwrap();
    let out = mine.join("mine.sqsh");
    ok(as_user(&[
        "--config",
        cfg,
        "export",
        "--rootfs",
        r,
        "-o",
        out.to_str().unwrap(),
    ]));
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn version_names_the_commit() {
    let out = ok(run(&["--version"]));
    let line = out.trim_end();
    let prefix = format!("berth {} (commit ", env!("CARGO_PKG_VERSION"));
    let commit = line
        .strip_prefix(&prefix)
        .and_then(|r| r.strip_suffix(')'))
        .unwrap_or_else(|| panic!("no commit in: {out}"));
    let repo = env!("CARGO_MANIFEST_DIR");
    if Path::new(repo).join(".git").exists() {
        // A commit of this repository (HEAD may have moved on since the build).
        let o = Command::new("git")
            .args(["-C", repo, "cat-file", "-t", commit])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert_eq!(stdout(&o).trim(), "commit", "{commit}: {}", stderr(&o));
    } else {
        assert_eq!(commit, "unknown");
    }
}
