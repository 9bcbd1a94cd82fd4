//! Security tests: what a user gives berth and what berth shows of it (issue 26, points 6 and
//! 7). A dataset staged through the cache keeps its permission bits (a private file stays
//! private), names, labels and variable names with control characters are refused in one line
//! (none forges a row of `berth ps` or is dropped unseen), and an error about what a registry
//! serves stays one short line however much the registry lists.

use super::*;

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::MetadataExt;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().mode() & 0o7777
}

/// `cat FILE` as `who`: (succeeded, what it printed).
fn cat_as(who: (u32, u32), file: &Path) -> (bool, String) {
    let o = as_uid(Command::new("cat").arg(file), who).output().unwrap();
    (o.status.success(), stdout(&o) + &stderr(&o))
}

/// Asserts `o` failed with exactly one line on stderr that contains each of `words`.
fn refused_in_one_line(o: &Output, words: &[&str]) {
    let err = stderr(o);
    assert!(!o.status.success(), "not refused: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "not one line: {err:?}");
    for w in words {
        assert!(err.contains(w), "{w:?} missing from: {err}");
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_private_file_staged_through_the_dataset_cache_stays_private() {
    let w = workdir("inputs-cache");
    let (vu, vg) = victim();
    // The victim's dataset, in a world-readable directory, with one file only the victim reads.
    let data = w.join("data");
    let src = data.join("set");
    std::fs::create_dir_all(&src).unwrap();
    let secret = format!("the victim's secret {}", std::process::id());
    std::fs::write(src.join("secret.txt"), &secret).unwrap();
    std::fs::write(src.join("public.txt"), "public").unwrap();
    give(&src, (vu, vg));
    chmod(&data, 0o755);
    chmod(&src, 0o755);
    chmod(&src.join("secret.txt"), 0o600);
    chmod(&src.join("public.txt"), 0o644);
    let cache = w.join("cache");
    let cfg = w.join("berth.toml");
    std::fs::write(
        &cfg,
        format!(
            "[stage]\ncache_dir = \"{}\"\ncache_prefixes = [\"{}\"]\n[runtime]\nstate_dir = \
             \"{}\"\n[scratch]\nroot = \"{}\"\n",
            cache.display(),
            data.display(),
            w.join("state").display(),
            w.join("scratch").display()
        ),
    )
    .unwrap();
    // Twice: the first stage fills the cache, the second is served from it. Each into a
    // directory of the victim's that others may list (a project directory), as root stages for
    // a job.
    for run in ["fill", "hit"] {
        let dest = w.join(format!("dest-{run}"));
        std::fs::create_dir(&dest).unwrap();
        give(&dest, (vu, vg));
        chmod(&dest, 0o755);
        let o = Command::new(berth_bin())
            .arg("--config")
            .arg(&cfg)
            .args(["stage", "in"])
            .arg(format!("{}:ds", src.display()))
            .arg("--to")
            .arg(&dest)
            .args(["--user", "berthvictim"])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(o.status.success(), "{run}: {}", stderr(&o));
        let entry = std::fs::read_dir(cache.join("entries"))
            .unwrap()
            .next()
            .expect("a cache entry")
            .unwrap()
            .path()
            .join("data");
        let staged = dest.join("ds/secret.txt");
        // The attacker can reach the directory (public.txt reads) but not the private file.
        let (read, text) = cat_as(attacker(), &dest.join("ds/public.txt"));
        assert!(
            read,
            "{run}: the attacker cannot even list the directory: {text}"
        );
        let (read, text) = cat_as(attacker(), &staged);
        assert!(
            !read && !text.contains(&secret),
            "{run}: the attacker read the victim's 0600 file through the cache: {text}"
        );
        let cached = entry.join("secret.txt");
        assert_eq!(
            std::fs::read_to_string(&cached).unwrap(),
            secret,
            "{run}: the cache holds the file"
        );
        assert_eq!(
            mode(&cached) & 0o077,
            0,
            "{run}: the cache's copy of a 0600 file is {:o}",
            mode(&cached)
        );
        assert_eq!(
            mode(&cached) & 0o222,
            0,
            "{run}: the cache's copy is writable"
        );
        assert_eq!(
            mode(&staged) & 0o077,
            0,
            "{run}: the staged copy of a 0600 file is {:o}",
            mode(&staged)
        );
        // The victim's job still reads its own file.
        let (read, text) = cat_as((vu, vg), &staged);
        assert!(
            read && text == secret,
            "{run}: the victim cannot read it: {text}"
        );
    }
}

/// A held container of the attacker's, removed by root when the test ends.
struct Held(Option<String>);

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(id) = &self.0 {
            let _ = berth(&["rm", id])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn names_and_variables_with_control_characters_are_refused_in_one_line() {
    attacker();
    let rootfs = rootfs().to_str().unwrap().to_string();
    // The name the attacker gives (a site's wrapper passes it on to root's berth create).
    let forged = "forged-row";
    let name = format!("x\n{forged}     0   1  evil");
    let o = berth(&[
        "create",
        "--rootfs",
        &rootfs,
        "--user",
        "berthtest",
        "--name",
        &name,
    ])
    .stdin(Stdio::null())
    .output()
    .unwrap();
    let _held = Held(o.status.success().then(|| stdout(&o).trim().to_string()));
    let ps = stdout(&as_uid(&mut berth(&["ps"]), attacker()).output().unwrap());
    assert!(
        !ps.lines().any(|l| l.starts_with(forged)),
        "a container name forged a row of berth ps:\n{ps}"
    );
    refused_in_one_line(&o, &["--name", "control character"]);
    // The attacker's own command line: refused before anything needs root.
    let o = as_uid(
        &mut berth(&["create", "--rootfs", &rootfs, "--name", &name]),
        attacker(),
    )
    .output()
    .unwrap();
    refused_in_one_line(&o, &["--name", "control character"]);

    // -e with a newline in the name: refused, not run with the variable dropped.
    for who in [None, Some(attacker())] {
        let mut cmd = berth(&[
            "run",
            "--rootfs",
            &rootfs,
            "--user",
            "berthtest",
            "-e",
            "A\nB=1",
            "-e",
            "C=2",
            "--",
            "sh",
            "-c",
            "env",
        ]);
        let o = match who {
            Some(w) => as_uid(&mut cmd, w).output().unwrap(),
            None => cmd.stdin(Stdio::null()).output().unwrap(),
        };
        refused_in_one_line(&o, &["--env", "control character"]);
        assert!(!stdout(&o).contains("C=2"), "it ran: {}", stdout(&o));
    }

    // A step request (the SPANK plugin's, from the attacker's srun): a name, or a variable of
    // the job's environment, with a control character.
    let (au, ag) = attacker();
    for (options, env, words) in [
        (
            r#""container-name": "x\nforged""#,
            r#""PATH=/bin""#,
            &["--container-name", "control character"][..],
        ),
        (
            r#""container-image": "busybox""#,
            r#""PATH=/bin", "A\nB=1""#,
            &["environment variable", "control character"][..],
        ),
    ] {
        let json = format!(
            r#"{{"protocol": 2, "job_id": 926001, "step_id": 0, "uid": {au}, "gid": {ag},
            "options": {{{options}}}, "job_env": [{env}]}}"#
        );
        let o = step_create(&json);
        refused_in_one_line(&o, words);
    }
}

/// A registry on 127.0.0.1 that answers every manifest request with `index` (an OCI image
/// index) and the API check with 200; stopped (its thread joined) on drop. Bounded: at most 64
/// connections, two minutes.
struct Loopback {
    port: u16,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Loopback {
    fn start(index: Vec<u8>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let index = Arc::new(index);
        let thread = std::thread::spawn(move || {
            let start = Instant::now();
            let mut served = 0;
            while !flag.load(Ordering::Relaxed)
                && served < 64
                && start.elapsed() < Duration::from_secs(120)
            {
                match listener.accept() {
                    Ok((stream, _)) => {
                        served += 1;
                        let index = index.clone();
                        std::thread::spawn(move || serve(stream, &index));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        Loopback {
            port,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Loopback {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Answers one connection's requests (keep-alive) until the client closes it or idles 10 s.
fn serve(stream: TcpStream, index: &[u8]) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let mut out = stream.try_clone().unwrap();
    let mut reader = BufReader::new(stream);
    for _ in 0..16 {
        let mut request = String::new();
        if reader.read_line(&mut request).unwrap_or(0) == 0 {
            return;
        }
        loop {
            let mut header = String::new();
            if reader.read_line(&mut header).unwrap_or(0) == 0 || header.trim().is_empty() {
                break;
            }
        }
        let mut parts = request.split_whitespace();
        let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
        let (status, kind, body): (&str, &str, &[u8]) = if path.contains("/manifests/") {
            ("200 OK", "application/vnd.oci.image.index.v1+json", index)
        } else if path == "/v2/" {
            ("200 OK", "application/json", b"{}")
        } else {
            (
                "404 Not Found",
                "application/json",
                br#"{"errors":[{"code":"NAME_UNKNOWN"}]}"#,
            )
        };
        let head = format!(
            "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\n\
             Docker-Distribution-API-Version: registry/2.0\r\n\r\n",
            body.len()
        );
        if out.write_all(head.as_bytes()).is_err()
            || (method != "HEAD" && out.write_all(body).is_err())
        {
            return;
        }
    }
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn an_index_of_twenty_thousand_platforms_gives_a_short_error() {
    let w = workdir("inputs-platforms");
    let digest = format!("sha256:{}", "ab".repeat(32));
    let entries: Vec<String> = (0..20_000)
        .map(|n| {
            format!(
                r#"{{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"{digest}","size":500,"platform":{{"architecture":"arch{n}","os":"linux"}}}}"#
            )
        })
        .collect();
    let index = format!(
        r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[{}]}}"#,
        entries.join(",")
    );
    let registry = Loopback::start(index.into_bytes());
    let host = format!("127.0.0.1:{}", registry.port);
    let cfg = w.join("berth.toml");
    std::fs::write(
        &cfg,
        format!(
            "[registry]\ninsecure = [\"{host}\"]\nretries = 1\n[runtime]\nstate_dir = \"{}\"\n\
             [store]\nroot = \"{}\"\n[squashfs]\nmount_dir = \"{}\"\n",
            w.join("state").display(),
            w.join("store").display(),
            w.join("images").display()
        ),
    )
    .unwrap();
    let o = Command::new(berth_bin())
        .arg("--config")
        .arg(&cfg)
        .args(["import", &format!("{host}#test/many:1")])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = stderr(&o);
    assert!(!o.status.success(), "imported: {err}");
    assert!(
        err.len() < 1024,
        "a {} byte error line: {}…",
        err.len(),
        &err[..err.len().min(300)]
    );
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains("linux/arch0"), "{err}");
    assert!(err.contains("(and 19992 more)"), "{err}");
}
