//! Root tier: what a careless or hostile user types or builds (issue 14, points 1, 2, 6, 7 and
//! 12) gives one line and leaves nothing behind: timeouts past the clock, huge environments,
//! registries that drop the config or answer 500, images of another architecture, mounts onto
//! `/` (by `--mount` or an image's symlink), a passwd that is not UTF-8, 100 KB arguments, a
//! failed stage's directories, and squashfs mounts of rewritten image files.
//!
//! Each test runs the binary under test (`BERTH_TEST_BIN` for an older build) with a config of
//! its own under target/root-tier/input/<test>. The registry is a small HTTP server in this
//! process, serving an image built from the busybox rootfs.
//!
//! Run alone: `cargo test --test root_input -- --ignored --test-threads=1`.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use common::{berth_bin, cgroup_root, rootfs, stderr, stdout};
use sha2::{Digest, Sha256};

/// A fresh directory for one test, with a berth.toml whose `[registry]`/`[store]` tail is
/// `extra`.
fn setup(name: &str, extra: &str) -> (PathBuf, PathBuf) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("target/root-tier/input")
        .join(name);
    if dir.exists() {
        // Whatever an earlier run left mounted there goes first.
        for line in common::host_mounts_with(dir.to_str().unwrap()) {
            if let Some(target) = line.split(' ').nth(4) {
                let _ = Command::new("umount").arg("-l").arg(target).status();
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("berth.toml");
    std::fs::write(
        &config,
        format!(
            "[cgroup]\nroot = \"{}\"\n[runtime]\nstate_dir = \"{}\"\n[squashfs]\nmount_dir = \
             \"{}\"\n[scratch]\nroot = \"{}\"\n{extra}",
            cgroup_root(),
            dir.join("state").display(),
            dir.join("mnt").display(),
            dir.join("scratch").display(),
        ),
    )
    .unwrap();
    (dir, config)
}

/// The store line every config needs (apart so a test can add keys to `[store]`).
fn store(dir_name: &str, keys: &str) -> String {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("target/root-tier/input")
        .join(dir_name);
    format!(
        "[store]\nroot = \"{}\"\n{keys}",
        dir.join("store").display()
    )
}

fn berth(config: &Path, args: &[&str]) -> Output {
    Command::new(berth_bin())
        .arg("--config")
        .arg(config)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn rootfs_str() -> String {
    rootfs().to_str().unwrap().to_string()
}

/// One line on stderr (the last), and the exit status.
fn said(o: &Output) -> (i32, String) {
    let err = stderr(o);
    (
        o.status.code().unwrap_or(-1),
        err.lines().last().unwrap_or("").to_string(),
    )
}

/// A copy of the busybox rootfs to change.
fn rootfs_copy(dir: &Path) -> PathBuf {
    let copy = dir.join("rootfs");
    let ok = Command::new("cp")
        .arg("-a")
        .arg(rootfs())
        .arg(&copy)
        .status()
        .unwrap()
        .success();
    assert!(ok, "copying the busybox rootfs");
    copy
}

// ---------------------------------------------------------------------------------------------
// A registry in this process: enough of the distribution API for berth's pulls.

fn sha(bytes: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(bytes))
}

/// The busybox rootfs as one uncompressed layer, built once.
fn layer() -> &'static (Vec<u8>, String) {
    static LAYER: OnceLock<(Vec<u8>, String)> = OnceLock::new();
    LAYER.get_or_init(|| {
        let mut b = tar::Builder::new(Vec::new());
        b.follow_symlinks(false);
        b.append_dir_all(".", rootfs()).unwrap();
        let bytes = b.into_inner().unwrap();
        let digest = sha(&bytes);
        (bytes, digest)
    })
}

#[derive(Default)]
struct Served {
    blobs: HashMap<String, Vec<u8>>,
    /// repository:tag -> manifest
    manifests: HashMap<String, Vec<u8>>,
}

struct Registry {
    port: u16,
    served: Arc<Mutex<Served>>,
    /// Cut the connection midway through the next config blob's body.
    drop_config: Arc<AtomicBool>,
    /// Answer everything with 500.
    fail: Arc<AtomicBool>,
    config_gets: Arc<AtomicUsize>,
}

impl Registry {
    fn start() -> Registry {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let r = Registry {
            port,
            served: Arc::default(),
            drop_config: Arc::default(),
            fail: Arc::default(),
            config_gets: Arc::default(),
        };
        let (served, drop_config, fail, gets) = (
            r.served.clone(),
            r.drop_config.clone(),
            r.fail.clone(),
            r.config_gets.clone(),
        );
        // Ends with the test process; serves one connection at a time.
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let _ = serve(conn, &served, &drop_config, &fail, &gets);
            }
        });
        r
    }

    fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Adds `repo:1`: the busybox layer with a config of `architecture` and `env`.
    fn image(&self, repo: &str, architecture: &str, env: &[String]) {
        let (layer, layer_digest) = layer();
        let config = serde_json::json!({
            "architecture": architecture,
            "os": "linux",
            "config": {"Env": env},
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        })
        .to_string()
        .into_bytes();
        let manifest = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": sha(&config),
                "size": config.len(),
            },
            "layers": [{
                "mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": layer_digest,
                "size": layer.len(),
            }],
        })
        .to_string()
        .into_bytes();
        let mut s = self.served.lock().unwrap();
        s.blobs.insert(sha(&config), config);
        s.blobs.insert(layer_digest.clone(), layer.clone());
        s.manifests.insert(format!("{repo}:1"), manifest);
    }

    fn reference(&self, repo: &str) -> String {
        format!("{}#{repo}:1", self.host())
    }

    fn config_lines(&self) -> String {
        format!(
            "[registry]\ninsecure = [\"{}\"]\nretries = 3\nretry_backoff_ms = 10\n",
            self.host()
        )
    }
}

fn serve(
    mut conn: TcpStream,
    served: &Mutex<Served>,
    drop_config: &AtomicBool,
    fail: &AtomicBool,
    config_gets: &AtomicUsize,
) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h == "\r\n" {
            break;
        }
    }
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let respond = |conn: &mut TcpStream, status: &str, ctype: &str, body: &[u8], cut: bool| {
        let head = format!(
            "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\n\
             Docker-Content-Digest: {}\r\nConnection: close\r\n\r\n",
            body.len(),
            sha(body)
        );
        conn.write_all(head.as_bytes())?;
        if method != "HEAD" {
            let n = if cut { body.len() / 2 } else { body.len() };
            conn.write_all(&body[..n])?;
        }
        conn.flush()
    };
    if fail.load(Ordering::Relaxed) {
        let body = br#"{"errors":[{"code":"UNKNOWN","message":"database on fire"}]}"#;
        return respond(
            &mut conn,
            "500 Internal Server Error",
            "application/json",
            body,
            false,
        );
    }
    let s = served.lock().unwrap();
    if path == "/v2/" {
        return respond(&mut conn, "200 OK", "application/json", b"{}", false);
    }
    if let Some((repo, tag)) = path
        .strip_prefix("/v2/")
        .and_then(|p| p.split_once("/manifests/"))
    {
        let key = format!("{repo}:{tag}");
        let found = s.manifests.get(&key).or_else(|| {
            s.manifests
                .values()
                .find(|m| sha(m) == tag && key.starts_with(repo))
        });
        return match found {
            Some(m) => respond(
                &mut conn,
                "200 OK",
                "application/vnd.oci.image.manifest.v1+json",
                m,
                false,
            ),
            None => respond(
                &mut conn,
                "404 Not Found",
                "application/json",
                br#"{"errors":[{"code":"MANIFEST_UNKNOWN","message":"no"}]}"#,
                false,
            ),
        };
    }
    if let Some((_, digest)) = path.split_once("/blobs/") {
        return match s.blobs.get(digest) {
            Some(b) => {
                let is_config = b.starts_with(b"{");
                if is_config {
                    config_gets.fetch_add(1, Ordering::Relaxed);
                }
                let cut = is_config && drop_config.swap(false, Ordering::Relaxed);
                respond(&mut conn, "200 OK", "application/octet-stream", b, cut)
            }
            None => respond(&mut conn, "404 Not Found", "application/json", b"{}", false),
        };
    }
    respond(&mut conn, "404 Not Found", "application/json", b"{}", false)
}

// ---------------------------------------------------------------------------------------------
// Point 1: timeouts.

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn timeouts_past_the_clock_are_no_deadline_not_a_panic() {
    let (_dir, config) = setup("timeouts", &store("timeouts", ""));
    for t in [
        "99999999999999999999999999",
        "18446744073709551616",
        "9223372036854775807",
        "1e300",
    ] {
        let o = berth(
            &config,
            &[
                "run",
                "--rootfs",
                &rootfs_str(),
                "--timeout",
                t,
                "--",
                "true",
            ],
        );
        assert_eq!(o.status.code(), Some(0), "--timeout {t}: {}", stderr(&o));
    }
    for t in ["inf", "NaN", "-5", "0"] {
        let flag = format!("--timeout={t}");
        let o = berth(
            &config,
            &["run", "--rootfs", &rootfs_str(), &flag, "--", "true"],
        );
        let (code, line) = said(&o);
        assert_eq!(code, 2, "--timeout {t}: {line}");
        assert!(line.contains("--timeout"), "{line}");
    }
    // Config timeouts past the clock: the container is killed at --timeout and waited for.
    let text = std::fs::read_to_string(&config).unwrap().replace(
        "[runtime]\n",
        "[runtime]\nkill_timeout_s = 18446744073709551615\nentrypoint_timeout_s = 18446744073709551615\n",
    );
    std::fs::write(&config, text).unwrap();
    let o = berth(
        &config,
        &[
            "run",
            "--rootfs",
            &rootfs_str(),
            "--timeout",
            "0.5",
            "--",
            "sleep",
            "30",
        ],
    );
    let (code, line) = said(&o);
    assert_eq!(code, 124, "{line}");
    assert!(line.contains("timed out"), "{line}");
}

// ---------------------------------------------------------------------------------------------
// Point 2: environments.

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn environments_are_bounded_and_merged_last_value_first_position() {
    let r = Registry::start();
    let mut big: Vec<String> = (0..100_000).map(|i| format!("V{i}=x")).collect();
    big.push("PATH=/bin".into());
    r.image("envbig", "amd64", &big);
    let ok: Vec<String> = (0..2_000)
        .map(|i| format!("V{}={i}", i % 1000))
        .chain(["PATH=/bin:/sbin".to_string()])
        .collect();
    r.image("envok", "amd64", &ok);
    let (_dir, config) = setup("env", &format!("{}{}", store("env", ""), r.config_lines()));
    // Within the bounds: one entry per key, the last value, at the key's first position.
    let o = berth(
        &config,
        &[
            "run",
            "--image",
            &r.reference("envok"),
            "--",
            "/bin/sh",
            "-c",
            "env",
        ],
    );
    let out = stdout(&o);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let vars: Vec<&str> = out.lines().filter(|l| l.starts_with('V')).collect();
    assert_eq!(vars.len(), 1000, "{out}");
    assert!(out.contains("V999=1999\n"), "{out}");
    // 100k entries: refused in one line naming the key, before any container.
    let o = berth(
        &config,
        &["run", "--image", &r.reference("envbig"), "--", "true"],
    );
    let (code, line) = said(&o);
    assert_ne!(code, 0, "an image with 100k Env entries ran");
    assert!(line.contains("store.max_env_entries"), "{line}");
    assert_eq!(stderr(&o).lines().count(), 1, "{}", stderr(&o));

    // The command line's environment, bounded by a smaller limit.
    let (_dir, config) = setup(
        "env-cli",
        &store("env-cli", "max_env_entries = 4\nmax_env_bytes = 64\n"),
    );
    let mut args = vec!["run".to_string(), "--rootfs".into(), rootfs_str()];
    for i in 0..5 {
        args.extend(["-e".to_string(), format!("K{i}=v")]);
    }
    args.extend(["--".to_string(), "true".into()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, line) = said(&berth(&config, &args));
    assert_eq!(code, 2, "{line}");
    assert!(line.contains("store.max_env_entries"), "{line}");
    let long = format!("K={}", "v".repeat(100));
    let (code, line) = said(&berth(
        &config,
        &["run", "--rootfs", &rootfs_str(), "-e", &long, "--", "true"],
    ));
    assert_eq!(code, 2, "{line}");
    assert!(line.contains("store.max_env_bytes"), "{line}");
}

// ---------------------------------------------------------------------------------------------
// Point 6: the registry.

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_dropped_config_is_retried_and_a_500_is_the_registrys_answer() {
    let r = Registry::start();
    r.image("drop", "amd64", &["PATH=/bin".to_string()]);
    let (_dir, config) = setup(
        "registry",
        &format!("{}{}", store("registry", ""), r.config_lines()),
    );
    r.drop_config.store(true, Ordering::Relaxed);
    let o = berth(&config, &["import", &r.reference("drop")]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        r.config_gets.load(Ordering::Relaxed) >= 2,
        "config not fetched again"
    );

    r.image("down", "amd64", &["PATH=/bin".to_string()]);
    r.fail.store(true, Ordering::Relaxed);
    let o = berth(&config, &["import", &r.reference("down")]);
    r.fail.store(false, Ordering::Relaxed);
    let (code, line) = said(&o);
    assert_ne!(code, 0);
    assert!(line.contains("answered 500"), "{line}");
    assert!(line.contains("database on fire"), "{line}");
    assert!(!line.contains("unreachable"), "{line}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn an_image_of_another_architecture_is_refused_unless_arch_asks() {
    let r = Registry::start();
    r.image("arm", "arm64", &["PATH=/bin".to_string()]);
    let (_dir, config) = setup(
        "arch",
        &format!("{}{}", store("arch", ""), r.config_lines()),
    );
    let o = berth(
        &config,
        &["run", "--image", &r.reference("arm"), "--", "true"],
    );
    let (code, line) = said(&o);
    assert_ne!(code, 0, "an arm64 image ran on amd64");
    assert!(line.contains("arm64") && line.contains("amd64"), "{line}");
    assert!(line.contains("--arch"), "{line}");
    // Asked for: imported.
    let o = berth(&config, &["import", "--arch", "arm64", &r.reference("arm")]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    // --arch means nothing for a directory.
    let (code, line) = said(&berth(
        &config,
        &[
            "run",
            "--rootfs",
            &rootfs_str(),
            "--arch",
            "arm64",
            "--",
            "true",
        ],
    ));
    assert_eq!(code, 2, "{line}");
    assert!(
        line.contains("--arch") && line.contains("--rootfs"),
        "{line}"
    );
}

// ---------------------------------------------------------------------------------------------
// Point 7: mounts onto /, system directories, passwd bytes, long arguments, failed stages.

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn nothing_is_mounted_over_the_containers_root() {
    let (dir, config) = setup("onto-root", &store("onto-root", ""));
    for spec in ["/tmp:/", "/tmp://", "/tmp:/.:ro"] {
        let (code, line) = said(&berth(
            &config,
            &[
                "run",
                "--rootfs",
                &rootfs_str(),
                "--mount",
                spec,
                "--",
                "true",
            ],
        ));
        assert_eq!(code, 2, "--mount {spec}: {line}");
        assert!(line.contains("DST must not be /"), "{line}");
    }
    let copy = rootfs_copy(&dir);
    let _ = std::fs::remove_dir_all(copy.join("sys"));
    std::os::unix::fs::symlink("/", copy.join("sys")).unwrap();
    let (code, line) = said(&berth(
        &config,
        &["run", "--rootfs", copy.to_str().unwrap(), "--", "true"],
    ));
    assert_eq!(code, 125, "{line}");
    assert!(line.contains("/sys") && line.contains("symlink"), "{line}");
    // A symlink to / as a bind's destination.
    std::fs::remove_file(copy.join("sys")).unwrap();
    std::fs::create_dir(copy.join("sys")).unwrap();
    std::os::unix::fs::symlink("/", copy.join("up")).unwrap();
    let (code, line) = said(&berth(
        &config,
        &[
            "run",
            "--rootfs",
            copy.to_str().unwrap(),
            "--mount",
            "/tmp:/up",
            "--",
            "true",
        ],
    ));
    assert_eq!(code, 125, "{line}");
    assert!(line.contains("/up") && line.contains("root"), "{line}");
    // The repaired image runs.
    std::fs::remove_file(copy.join("up")).unwrap();
    let o = berth(
        &config,
        &["run", "--rootfs", copy.to_str().unwrap(), "--", "true"],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_passwd_that_is_not_utf8_still_gets_the_user() {
    let (uid, _, _) = common::test_user();
    let (dir, config) = setup("passwd", &store("passwd", ""));
    let copy = rootfs_copy(&dir);
    let passwd = copy.join("etc/passwd");
    let _ = std::fs::create_dir_all(copy.join("etc"));
    let mut text = std::fs::read(&passwd).unwrap_or_default();
    text.extend_from_slice(b"jos\xe9:x:4242:4242:Jos\xe9 in Latin-1:/home/jos\xe9:/bin/sh\n");
    std::fs::write(&passwd, &text).unwrap();
    let o = berth(
        &config,
        &[
            "run",
            "--rootfs",
            copy.to_str().unwrap(),
            "--user",
            &uid.to_string(),
            "--",
            "/bin/sh",
            "-c",
            "grep -c ':4242:' /etc/passwd; grep '^berthtest:' /etc/passwd",
        ],
    );
    let out = stdout(&o);
    assert_eq!(o.status.code(), Some(0), "{out} {}", stderr(&o));
    assert!(out.starts_with("1\n"), "the image's entry changed: {out}");
    assert!(out.contains(&format!("berthtest:x:{uid}:")), "{out}");
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn error_lines_elide_long_arguments() {
    let (_dir, config) = setup("elide", &store("elide", ""));
    let huge = "x".repeat(100_000);
    let mount = format!("/{huge}:/x");
    let env = huge.clone();
    let workdir = format!("/{huge}");
    for args in [
        vec!["--memory", huge.as_str()],
        vec!["--mount", mount.as_str()],
        vec!["--timeout", huge.as_str()],
        vec!["--cpus", huge.as_str()],
        vec!["-e", env.as_str()],
        vec!["--user", huge.as_str()],
        vec!["--workdir", workdir.as_str()],
        vec!["--net", huge.as_str()],
    ] {
        let mut all = vec!["run", "--rootfs"];
        let r = rootfs_str();
        all.push(&r);
        all.extend(&args);
        all.extend(["--", "true"]);
        let o = berth(&config, &all);
        let err = stderr(&o);
        assert_ne!(o.status.code(), Some(0), "{}", args[0]);
        assert!(err.len() < 1000, "{}: a {} byte error", args[0], err.len());
        assert!(err.contains("bytes]"), "{err}");
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_failed_stage_leaves_no_directories() {
    let (dir, config) = setup("stage", &store("stage", ""));
    let to = dir.join("to");
    std::fs::create_dir(&to).unwrap();
    let missing = dir.join("missing");
    let spec = format!("{}:a/b/c", missing.display());
    let o = berth(
        &config,
        &["stage", "in", &spec, "--to", to.to_str().unwrap()],
    );
    assert_ne!(o.status.code(), Some(0));
    let left: Vec<_> = std::fs::read_dir(&to).unwrap().flatten().collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    // A directory that was there stays, and a symlink in the way is not followed.
    std::fs::create_dir(to.join("kept")).unwrap();
    let outside = dir.join("outside");
    std::fs::create_dir(&outside).unwrap();
    std::os::unix::fs::symlink(&outside, to.join("link")).unwrap();
    for dst in ["kept/new", "link/new"] {
        let spec = format!("{}:{dst}", missing.display());
        let o = berth(
            &config,
            &["stage", "in", &spec, "--to", to.to_str().unwrap()],
        );
        assert_ne!(o.status.code(), Some(0));
    }
    assert!(to.join("kept").is_dir());
    assert!(std::fs::read_dir(to.join("kept")).unwrap().next().is_none());
    assert!(std::fs::read_dir(&outside).unwrap().next().is_none());
}

// ---------------------------------------------------------------------------------------------
// Point 12: squashfs mounts go with their last container.

/// Loop devices backed by `file` or an earlier file at that path (`(deleted)`).
fn loops_of(file: &Path) -> usize {
    let o = Command::new("losetup")
        .arg("-a")
        .stderr(Stdio::null())
        .output()
        .unwrap();
    let name = file.to_str().unwrap();
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter(|l| l.contains(name))
        .count()
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_rewritten_squashfs_leaves_no_mounts_or_loop_devices() {
    let (dir, config) = setup("rewrite", &store("rewrite", ""));
    let image = dir.join("image.sqsh");
    let mnt = dir.join("mnt");
    for version in 1..=3 {
        let _ = std::fs::remove_file(&image);
        let o = Command::new("mksquashfs")
            .arg(rootfs())
            .arg(&image)
            .args(["-quiet", "-noappend", "-no-progress", "-p"])
            .arg(format!("/version f 644 0 0 echo {version}"))
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(o.status.success(), "mksquashfs: {}", stderr(&o));
        // As a step: created, used, destroyed.
        let o = berth(&config, &["create", "--image", image.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let id = stdout(&o).trim().to_string();
        let o = berth(&config, &["exec", &id, "--", "cat", "/version"]);
        assert_eq!(stdout(&o).trim(), version.to_string(), "{}", stderr(&o));
        let o = berth(&config, &["rm", &id]);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        // And as a run.
        let o = berth(
            &config,
            &[
                "run",
                "--image",
                image.to_str().unwrap(),
                "--",
                "cat",
                "/version",
            ],
        );
        assert_eq!(stdout(&o).trim(), version.to_string(), "{}", stderr(&o));
    }
    let mounts = common::host_mounts_with(mnt.to_str().unwrap());
    assert!(mounts.is_empty(), "left mounted: {mounts:#?}");
    assert_eq!(loops_of(&image), 0, "loop devices left attached");
}
