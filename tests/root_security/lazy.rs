//! Security tests: lazy images and registries a user controls. A lazy image's chunk cache is
//! shared by every run of the same index, so another index naming the same squashfs blob (which
//! anyone can publish to a registry of their own) must never change the chunks a victim's running
//! container reads, nor the size of its cache file; and a registry that trickles bytes must not
//! hold an import (the Slurm Prolog's among them) past its deadline and minimum rate.

use super::*;

#[path = "../../integration/registry/harness.rs"]
mod harness;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

const MIB: usize = 1 << 20;

fn ids((uid, gid): (u32, u32)) -> String {
    format!("{uid}:{gid}")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A berth config of the test's own (store, mounts, scratch) trusting `insecure` in plain HTTP,
/// with `registry_extra` lines in `[registry]`.
fn write_config(dir: &Path, insecure: &[String], registry_extra: &str) -> PathBuf {
    let config = dir.join("berth.toml");
    let list = insecure
        .iter()
        .map(|h| format!("\"{h}\""))
        .collect::<Vec<_>>()
        .join(", ");
    std::fs::write(
        &config,
        format!(
            "[cgroup]\nroot = \"{}\"\n[runtime]\nstate_dir = \"{}\"\n[store]\nroot = \"{}\"\n\
             [squashfs]\nmount_dir = \"{}\"\n[scratch]\nroot = \"{}\"\n[registry]\n\
             insecure = [{list}]\n{registry_extra}",
            cgroup_root(),
            state_dir().display(),
            dir.join("store").display(),
            dir.join("images").display(),
            dir.join("scratch").display(),
        ),
    )
    .unwrap();
    config
}

fn berth_with(config: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(berth_bin());
    cmd.arg("--config").arg(config).args(args);
    cmd
}

/// Every file of the store's chunk caches: name, size and sha256 of its bytes.
fn caches(store: &Path) -> Vec<(String, u64, String)> {
    let mut out: Vec<_> = std::fs::read_dir(store.join("lazy"))
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let bytes = std::fs::read(e.path()).unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                bytes.len() as u64,
                hex(&Sha256::digest(&bytes)),
            )
        })
        .collect();
    out.sort();
    out
}

/// The victim's `berth run` of a lazy image, waiting on stdin between its reads; its stdin is
/// closed and it is waited for (killed if it does not end) on drop, also when an assertion
/// fails first.
struct Victim {
    child: Child,
    stdin: Option<ChildStdin>,
    out: BufReader<ChildStdout>,
}

impl Victim {
    fn line(&mut self) -> String {
        let mut line = String::new();
        self.out.read_line(&mut line).unwrap();
        line
    }

    /// Lets the container go on to its next read; returns the line it prints.
    fn next(&mut self) -> String {
        let stdin = self.stdin.as_mut().unwrap();
        stdin.write_all(b"\n").unwrap();
        stdin.flush().unwrap();
        self.line()
    }
}

impl Drop for Victim {
    fn drop(&mut self) {
        drop(self.stdin.take());
        for _ in 0..300 {
            if self.child.try_wait().unwrap().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The lazy form's manifest, as `berth lazy publish` writes it, naming `blob` (`size` bytes)
/// and the index blob `index` (`index_size` bytes).
fn lazy_manifest(blob: &str, size: usize, index: &str, index_size: usize) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": harness::OCI_MANIFEST,
        "artifactType": "application/vnd.berth.lazy.v1",
        "config": {
            "mediaType": "application/vnd.oci.empty.v1+json",
            "digest": harness::sha256(b"{}"),
            "size": 2
        },
        "layers": [
            {"mediaType": "application/vnd.berth.squashfs.v1", "digest": blob, "size": size},
            {"mediaType": "application/vnd.berth.lazy.index.v1+json", "digest": index,
             "size": index_size}
        ]
    }))
    .unwrap()
}

/// Publishes, as the attacker does to a registry of their own, a lazy image `repo:tag` whose
/// index names the squashfs blob `blob` but gives the chunks of `bytes` (what that registry
/// then serves for `blob`), `size` bytes of it.
fn publish_other_index(
    up: &harness::Uploader,
    repo: &str,
    tag: &str,
    blob: &str,
    bytes: &[u8],
    size: usize,
) {
    let chunks: Vec<String> = bytes[..size]
        .chunks(MIB)
        .map(|c| hex(&Sha256::digest(c)))
        .collect();
    let index = serde_json::to_vec(&serde_json::json!({
        "blob": blob,
        "size": size,
        "chunk_size": MIB,
        "chunks": chunks
    }))
    .unwrap();
    let index_digest = up.blob(repo, &index);
    up.blob(repo, b"{}");
    up.manifest(
        repo,
        tag,
        harness::OCI_MANIFEST,
        &lazy_manifest(blob, size, &index_digest, index.len()),
    );
}

#[test]
#[ignore = "root tier"]
fn another_index_of_the_same_blob_never_changes_a_running_victims_lazy_image() {
    let dir = workdir("lazy-other-index");
    let victims = harness::Registry::start(
        &harness::Mode::Plain,
        &dir.join("r1/storage"),
        &dir.join("r1"),
    );
    let attackers = harness::Registry::start(
        &harness::Mode::Plain,
        &dir.join("r2/storage"),
        &dir.join("r2"),
    );
    let config = write_config(&dir, &[victims.host(), attackers.host()], "");
    let store = dir.join("store");

    // The victim's image: busybox, a small file and 8 MiB of noise (its chunks its own).
    let tree = dir.join("tree");
    assert!(
        Command::new("cp")
            .arg("-a")
            .arg(rootfs())
            .arg(&tree)
            .status()
            .unwrap()
            .success()
    );
    std::fs::write(tree.join("hello.txt"), "lazy hello\n").unwrap();
    std::fs::write(tree.join("big.bin"), harness::noise(8 * MIB, 11)).unwrap();
    let sqsh = dir.join("image.sqsh");
    let o = Command::new("mksquashfs")
        .arg(&tree)
        .arg(&sqsh)
        .args(["-noappend", "-quiet", "-no-progress"])
        .output()
        .expect("mksquashfs (apt-get install squashfs-tools)");
    assert!(o.status.success(), "{}", stderr(&o));
    let reference = format!("docker://{}/t/lazy:1", victims.host());
    ok(berth_with(
        &config,
        &["lazy", "publish", sqsh.to_str().unwrap(), &reference],
    )
    .output()
    .unwrap());
    let bytes = std::fs::read(&sqsh).unwrap();
    let blob = harness::sha256(&bytes);

    // The victim's container reads its image, then waits.
    let image = format!("lazy:docker://{}/t/lazy:1", victims.host());
    let script = "cat /hello.txt; md5sum /big.bin; read x; md5sum /big.bin; read x";
    let mut child = berth_with(
        &config,
        &[
            "run",
            "--user",
            &ids(victim()),
            "--image",
            &image,
            "--",
            "sh",
            "-c",
            script,
        ],
    )
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    let mut v = Victim {
        stdin: child.stdin.take(),
        out: BufReader::new(child.stdout.take().unwrap()),
        child,
    };
    assert_eq!(v.line(), "lazy hello\n");
    let md5 = v.line();
    assert!(md5.ends_with("  /big.bin\n"), "{md5}");
    let before = caches(&store);
    assert!(!before.is_empty());

    // The attacker's registry: the same blob digest, other bytes in the middle of big.bin, and
    // an index whose chunk digests are those of the other bytes.
    let mut theirs = bytes.clone();
    for k in 1..7 {
        theirs[k * MIB + 12345] ^= 0xff;
    }
    let up = harness::Uploader::new(&attackers.host(), None);
    assert_eq!(up.blob("a/lazy", &bytes), blob);
    std::fs::write(harness::blob_data_path(&attackers.storage, &blob), &theirs).unwrap();
    publish_other_index(&up, "a/lazy", "chunks", &blob, &theirs, theirs.len());
    publish_other_index(&up, "a/lazy", "small", &blob, &theirs, 2 * MIB);

    // Run as Slurm runs the attacker's job: every chunk of their index read.
    let mine = format!("lazy:docker://{}/a/lazy:chunks", attackers.host());
    let o = berth_with(
        &config,
        &[
            "run",
            "--user",
            &ids(attacker()),
            "--image",
            &mine,
            "--",
            "sh",
            "-c",
            "md5sum /big.bin",
        ],
    )
    .stdin(Stdio::null())
    .output()
    .unwrap();
    eprintln!(
        "attacker's run (other chunks): {}{}",
        stdout(&o),
        stderr(&o)
    );
    assert_eq!(
        caches(&store)
            .into_iter()
            .filter(|c| before.iter().any(|b| b.0 == c.0))
            .collect::<Vec<_>>(),
        before,
        "another index's chunks were written into the victim's cache"
    );
    let small = format!("lazy:docker://{}/a/lazy:small", attackers.host());
    let o = berth_with(
        &config,
        &[
            "run",
            "--user",
            &ids(attacker()),
            "--image",
            &small,
            "--",
            "true",
        ],
    )
    .stdin(Stdio::null())
    .output()
    .unwrap();
    eprintln!(
        "attacker's run (smaller size): {}{}",
        stdout(&o),
        stderr(&o)
    );
    assert_eq!(
        caches(&store)
            .into_iter()
            .filter(|c| before.iter().any(|b| b.0 == c.0))
            .collect::<Vec<_>>(),
        before,
        "another index's size changed the victim's cache"
    );

    // What the victim's container reads again comes from the cache file, not the page cache.
    let _ = Command::new("sync").status();
    std::fs::write("/proc/sys/vm/drop_caches", "3\n").unwrap();
    assert_eq!(v.next(), md5, "the victim's container read other bytes");
    drop(v);
    assert_eq!(
        caches(&store)
            .into_iter()
            .filter(|c| before.iter().any(|b| b.0 == c.0))
            .collect::<Vec<_>>(),
        before
    );
}

/// A registry of the attacker's that answers the manifest and config at once and sends a layer
/// one byte every `every`; stops (and its threads end) on drop.
struct Trickle {
    port: u16,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    layer: String,
}

impl Trickle {
    fn start(every: Duration) -> Self {
        let arch = match std::env::consts::ARCH {
            "x86_64" => "amd64",
            "aarch64" => "arm64",
            other => other,
        };
        let layer_bytes = harness::noise(64 * 1024, 3);
        let layer = harness::sha256(&layer_bytes);
        let config = serde_json::to_vec(&serde_json::json!({
            "architecture": arch,
            "os": "linux",
            "config": {},
            "rootfs": {"type": "layers", "diff_ids": [harness::sha256(b"never checked")]}
        }))
        .unwrap();
        let config_digest = harness::sha256(&config);
        let manifest = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": harness::OCI_MANIFEST,
            "config": {"mediaType": harness::OCI_CONFIG, "digest": config_digest,
                       "size": config.len()},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                        "digest": layer, "size": layer_bytes.len()}]
        }))
        .unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let layer_path = format!("/blobs/{layer}");
        let config_path = format!("/blobs/{config_digest}");
        let thread = std::thread::spawn(move || {
            let mut handlers = Vec::new();
            while !stopping.load(Ordering::Relaxed) {
                let Ok((conn, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                let (stop, layer_path, config_path) =
                    (stopping.clone(), layer_path.clone(), config_path.clone());
                let (manifest, config, layer_bytes) =
                    (manifest.clone(), config.clone(), layer_bytes.clone());
                handlers.push(std::thread::spawn(move || {
                    serve(
                        conn,
                        &stop,
                        every,
                        &[
                            ("/manifests/", harness::OCI_MANIFEST, &manifest, false),
                            (&config_path, "application/octet-stream", &config, false),
                            (&layer_path, "application/octet-stream", &layer_bytes, true),
                        ],
                    );
                }));
            }
            for h in handlers {
                let _ = h.join();
            }
        });
        Trickle {
            port,
            stop,
            thread: Some(thread),
            layer,
        }
    }

    fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

impl Drop for Trickle {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Answers one request on `conn` (`Connection: close`): `/v2/`, or the first of `routes`
/// (path suffix, content type, body, trickled) whose suffix the path has; 404 otherwise.
fn serve(
    mut conn: TcpStream,
    stop: &AtomicBool,
    every: Duration,
    routes: &[(&str, &str, &Vec<u8>, bool)],
) {
    conn.set_nonblocking(false).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") && head.len() < 16 * 1024 {
        match conn.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => return,
        }
    }
    let head = String::from_utf8_lossy(&head).to_string();
    let mut words = head.split_whitespace();
    let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let found = routes
        .iter()
        .find(|(suffix, ..)| path.starts_with("/v2/") && path.contains(suffix));
    let (status, kind, body, trickled): (&str, &str, &[u8], bool) = match found {
        Some((_, kind, body, trickled)) => ("200 OK", kind, body, *trickled),
        None if path == "/v2/" => ("200 OK", "application/json", b"{}", false),
        None => (
            "404 Not Found",
            "application/json",
            b"{\"errors\":[]}",
            false,
        ),
    };
    let digest = harness::sha256(body);
    let _ = write!(
        conn,
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\n\
         Docker-Content-Digest: {digest}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    if method == "HEAD" {
        return;
    }
    if !trickled {
        let _ = conn.write_all(body);
        return;
    }
    for b in body {
        if stop.load(Ordering::Relaxed) || conn.write_all(&[*b]).is_err() {
            return;
        }
        let _ = conn.flush();
        // In small steps, so that a stop is seen soon.
        let until = Instant::now() + every;
        while Instant::now() < until && !stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Runs `berth import` of the trickling registry's image with `registry_extra` config lines;
/// returns its stderr and how long it took, or fails the test when it is still going after
/// `bound`.
fn import_from_trickle(
    name: &str,
    registry_extra: &str,
    bound: Duration,
) -> (String, Duration, Trickle, PathBuf) {
    let dir = workdir(name);
    let trickle = Trickle::start(Duration::from_secs(2));
    let config = write_config(&dir, &[trickle.host()], registry_extra);
    let reference = format!("docker://{}/t/slow:1", trickle.host());
    let start = Instant::now();
    let mut child = berth_with(&config, &["import", &reference])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > bound {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "berth import from a registry sending a byte every 2 s still ran after {bound:?}: {}",
                reader.join().unwrap()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let took = start.elapsed();
    assert!(!child.wait().unwrap().success());
    let err = reader.join().unwrap();
    eprintln!("berth import after {took:?}: {err}");
    (err, took, trickle, dir.join("store"))
}

/// Nothing of the image stays in the store: no layer, no image record, no workspace.
fn assert_nothing_kept(store: &Path) {
    for sub in ["layers", "images", "refs", "files", "tmp"] {
        let path = store.join(sub);
        let left: Vec<String> = std::fs::read_dir(&path)
            .map(|d| {
                d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .filter(|n| !n.starts_with('.'))
                    .collect()
            })
            .unwrap_or_default();
        assert!(left.is_empty(), "{} holds {left:?}", path.display());
    }
}

#[test]
#[ignore = "root tier"]
fn a_trickling_registry_fails_an_import_below_the_minimum_rate() {
    // The shipped defaults (4 KiB/s over 30 s of waiting): what protects a node whose admin
    // set nothing.
    let (err, took, trickle, store) =
        import_from_trickle("trickle-rate", "", Duration::from_secs(60));
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(
        lines[0].contains(&format!(
            "registry {}: blob {} of {}/t/slow:1: ",
            trickle.host(),
            trickle.layer,
            trickle.host()
        )) && lines[0].contains(" s, below the minimum 4.0 KiB/s (registry.min_rate_bytes_per_s)"),
        "{err}"
    );
    assert!(took < Duration::from_secs(45), "{took:?}: {err}");
    assert_nothing_kept(&store);
}

#[test]
#[ignore = "root tier"]
fn a_trickling_registry_fails_an_import_at_its_deadline() {
    // No minimum rate: the overall deadline alone ends it.
    let (err, took, trickle, store) = import_from_trickle(
        "trickle-deadline",
        "min_rate_bytes_per_s = 0\nimport_deadline_s = 6\n",
        Duration::from_secs(40),
    );
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(
        lines[0].contains(&format!("registry {}: ", trickle.host()))
            && lines[0].contains("deadline of 6 s (registry.import_deadline_s)"),
        "{err}"
    );
    assert!(took < Duration::from_secs(20), "{took:?}: {err}");
    assert_nothing_kept(&store);
}
