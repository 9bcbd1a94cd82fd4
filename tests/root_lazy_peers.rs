//! Lazily loaded images fanned out over cluster peers (issue 30, point 3) on loopback: one real
//! `berth-controller`, real `berth agent`s each with its own store, state and `peers.listen`
//! port, Debian's docker-registry behind the harness's recording proxy (its request log holds
//! every `Range` GET of the squashfs blob), a lazy image published with `berth lazy publish`.
//!
//! - `berth cluster prewarm lazy:REF` on 4 nodes (a tree, fan-out 2): the registry serves each
//!   chunk once across the 4; then every node runs a container reading every file of the image,
//!   all bytes right, nothing more asked of the registry.
//! - On-demand readers: node 1 reads every file from the registry, then one of its cached
//!   chunks is damaged on disk; node 2 reads through the catalog from node 1, refuses the
//!   damaged chunk (said in one line), gets that run from the registry and the rest from node 1;
//!   node 3 reads everything from the peers through its node's lazy image server (`berth
//!   create`, as a Slurm step's container), the registry asked nothing.
//!
//! Every process is killed by PID when its guard drops. Run alone:
//! `cargo test --test root_lazy_peers -- --ignored --test-threads=1`.

mod common;
#[path = "../integration/registry/harness.rs"]
mod harness;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{BERTH, berth_bin};
use harness::{Mode, Proxy, Registry};
use serde_json::Value;

const KEY: &str = "test-lazy-peers-key-0123456789";
/// The noise file: incompressible, so its chunks are its own.
const BIG: usize = 24 << 20;
/// `berth lazy publish`'s default chunk size.
const CHUNK: u64 = 1 << 20;

struct Proc {
    child: Child,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn controller_bin() -> PathBuf {
    if let Ok(b) = std::env::var("BERTH_TEST_CONTROLLER_BIN") {
        return PathBuf::from(b);
    }
    let bin = Path::new(BERTH).with_file_name("berth-controller");
    if !bin.exists() {
        let target = Path::new(BERTH).parent().unwrap().parent().unwrap();
        let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args(["build", "-p", "berth-controller"])
            .env("CARGO_TARGET_DIR", target)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
    }
    bin
}

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

fn signed(method: &str, path: &str, body: &[u8]) -> String {
    let key = berth_api::auth::Key::new(KEY);
    berth_api::auth::sign_request(&key, method, path, body)
        .unwrap()
        .header
}

fn wait_for(what: &str, secs: u64, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !cond() {
        assert!(Instant::now() < deadline, "{what}: not within {secs} s");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn text(o: &[u8]) -> String {
    String::from_utf8_lossy(o).into_owned()
}

struct Cluster {
    dir: tempfile::TempDir,
    controller: String,
    registry: Registry,
    proxy: Proxy,
    /// `lazy:docker://<proxy>/t/lazy:1`.
    image: String,
    /// The squashfs blob's digest and size.
    blob: String,
    size: u64,
    big_md5: String,
    agents: Vec<(String, u16, Option<Proc>)>,
    _controller: Proc,
}

impl Cluster {
    fn start(nodes: usize) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let key = d.join("key");
        write(&key, &format!("{KEY}\n"));
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
            // A Slurm that knows no node: the controller never calls scontrol for these tests.
            for tool in ["sinfo", "scontrol"] {
                write(&d.join(tool), "#!/bin/sh\nexit 0\n");
                std::fs::set_permissions(d.join(tool), std::fs::Permissions::from_mode(0o755))
                    .unwrap();
            }
        }
        write(&d.join("none.toml"), "[controller]\n");
        let controller = format!("127.0.0.1:{}", harness::free_port());
        let log = std::fs::File::create(d.join("controller.log")).unwrap();
        let ctl = Command::new(controller_bin())
            .arg("--config")
            .arg(d.join("none.toml"))
            .args(["serve", "--id", "1", "--listen", &controller])
            .arg("--data-dir")
            .arg(d.join("data"))
            .arg("--key-file")
            .arg(&key)
            .arg("--sinfo")
            .arg(d.join("sinfo"))
            .arg("--scontrol")
            .arg(d.join("scontrol"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let registry = Registry::start(&Mode::Plain, &d.join("reg-storage"), &d.join("reg"));
        let proxy = Proxy::start(registry.port, 1 << 40);
        let mut c = Self {
            image: format!("lazy:docker://{}/t/lazy:1", proxy.host()),
            dir,
            controller,
            registry,
            proxy,
            blob: String::new(),
            size: 0,
            big_md5: String::new(),
            agents: (1..=nodes)
                .map(|i| (format!("n{i}"), harness::free_port(), None))
                .collect(),
            _controller: Proc { child: ctl },
        };
        c.publish();
        for i in 0..nodes {
            c.start_agent(i);
        }
        wait_for("every agent in the catalog", 120, || {
            c.catalog().is_some_and(|v| {
                v.as_array()
                    .is_some_and(|a| a.iter().filter(|n| n["peer"].is_string()).count() == nodes)
            })
        });
        c
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// busybox, a small file and the noise file, as a squashfs published straight to the
    /// registry (not through the proxy, whose log then holds only the nodes' requests).
    fn publish(&mut self) {
        let tree = self.path().join("tree");
        let cp = Command::new("cp")
            .arg("-a")
            .arg(common::rootfs())
            .arg(&tree)
            .status()
            .unwrap();
        assert!(cp.success());
        std::fs::write(tree.join("hello.txt"), "lazy hello\n").unwrap();
        std::fs::write(tree.join("big.bin"), harness::noise(BIG, 11)).unwrap();
        let md5 = Command::new("md5sum")
            .arg(tree.join("big.bin"))
            .output()
            .unwrap();
        self.big_md5 = text(&md5.stdout).split(' ').next().unwrap().to_string();
        let sqsh = self.path().join("image.sqsh");
        let o = Command::new("mksquashfs")
            .arg(&tree)
            .arg(&sqsh)
            .args(["-noappend", "-quiet", "-no-progress"])
            .output()
            .expect("mksquashfs (apt-get install squashfs-tools)");
        assert!(o.status.success(), "{}", text(&o.stderr));
        self.size = std::fs::metadata(&sqsh).unwrap().len();
        let reference = format!("docker://{}/t/lazy:1", self.registry.host());
        let out = self.berth(0, &["lazy", "publish", sqsh.to_str().unwrap(), &reference]);
        assert!(out.status.success(), "publish: {out:?}");
        self.blob = text(&out.stdout).split(' ').nth(1).unwrap().to_string();
        assert!(self.blob.starts_with("sha256:"), "{}", text(&out.stdout));
    }

    /// The configuration of node `i` (its own store, state, mounts, port), for its agent and
    /// for the berth commands run there.
    fn config(&self, i: usize) -> PathBuf {
        let (node, port, _) = &self.agents[i];
        let d = self.path();
        let n = d.join(node);
        let path = d.join(format!("berth-{node}.toml"));
        write(
            &path,
            &format!(
                "[cgroup]\nroot = \"{cg}\"\n[runtime]\nstate_dir = \"{n}/state\"\n\
                 [store]\nroot = \"{n}/store\"\n[squashfs]\nmount_dir = \"{n}/mnt\"\n\
                 [scratch]\nroot = \"{n}/scratch\"\n\
                 [registry]\ninsecure = [\"{proxy}\", \"{reg}\"]\ncredentials = \"\"\n\
                 enroot_credentials = false\nauth_files = false\nretries = 2\n\
                 retry_backoff_ms = 50\nconnect_timeout_s = 5\nread_timeout_s = 9\n\
                 [agent]\ncontrollers = [\"{ctl}\"]\nkey_file = \"{key}\"\ninterval_ms = 300\n\
                 metrics_listen = \"\"\nnode_name = \"{node}\"\n\
                 [peers]\nlisten = \"127.0.0.1:{port}\"\nmax_uploads = 8\n",
                cg = common::cgroup_root(),
                n = n.display(),
                proxy = self.proxy.host(),
                reg = self.registry.host(),
                ctl = self.controller,
                key = d.join("key").display(),
            ),
        );
        path
    }

    fn start_agent(&mut self, i: usize) {
        let cfg = self.config(i);
        let log =
            std::fs::File::create(self.path().join(format!("{}.log", self.agents[i].0))).unwrap();
        let child = Command::new(berth_bin())
            .arg("--config")
            .arg(&cfg)
            .arg("agent")
            .env("BERTH_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let port = self.agents[i].1;
        wait_for("the agent's peer port", 30, || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        self.agents[i].2 = Some(Proc { child });
    }

    fn catalog(&self) -> Option<Value> {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_secs(2)))
            .build()
            .into();
        let mut r = agent
            .get(&format!("http://{}/v1/catalog", self.controller))
            .header(
                berth_api::auth::AUTH_HEADER,
                &signed("GET", "/v1/catalog", b""),
            )
            .call()
            .ok()?;
        serde_json::from_str(&r.body_mut().read_to_string().ok()?).ok()
    }

    /// Whether the catalog lists node `i` as holding a lazy chunk cache.
    fn lists_lazy(&self, i: usize) -> bool {
        let node = &self.agents[i].0;
        self.catalog().is_some_and(|v| {
            v.as_array().is_some_and(|a| {
                a.iter().any(|n| {
                    n["node"] == node.as_str()
                        && n["refs"]
                            .as_object()
                            .is_some_and(|r| r.keys().any(|k| k.starts_with("lazy:sha256:")))
                })
            })
        })
    }

    fn berth(&self, i: usize, args: &[&str]) -> Output {
        Command::new(berth_bin())
            .arg("--config")
            .arg(self.config(i))
            .args(args)
            .env("BERTH_LOG", "info")
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    /// Runs a container of the lazy image on node `i` that reads every file of it and prints
    /// the noise file's md5 and the small file; asserts both right.
    fn read_all(&self, i: usize) -> Output {
        let out = self.berth(
            i,
            &[
                "run",
                "--image",
                &self.image,
                "--",
                "/bin/sh",
                "-c",
                "find / -xdev -type f -exec cat {} + > /dev/null 2>&1; md5sum /big.bin; cat /hello.txt",
            ],
        );
        let stdout = text(&out.stdout);
        assert!(
            out.status.success() && stdout.starts_with(&self.big_md5),
            "n{}: {stdout}\n{}",
            i + 1,
            text(&out.stderr)
        );
        assert!(stdout.ends_with("lazy hello\n"), "{stdout}");
        out
    }

    /// [`Cluster::read_all`] in a container of `berth create` on node `i`, whose image is the
    /// node's lazy image server (`berth lazy serve`); the container removed and the server
    /// stopped after.
    fn read_all_served(&self, i: usize) {
        let create = self.berth(i, &["create", "--image", &self.image]);
        assert!(create.status.success(), "{create:?}");
        let id = text(&create.stdout).trim().to_string();
        struct Rm<'a>(&'a Cluster, usize, String);
        impl Drop for Rm<'_> {
            fn drop(&mut self) {
                let _ = self.0.berth(self.1, &["rm", &self.2]);
                let _ = self.0.berth(self.1, &["gc"]);
            }
        }
        let _rm = Rm(self, i, id.clone());
        let out = self.berth(
            i,
            &[
                "exec",
                &id,
                "--",
                "/bin/sh",
                "-c",
                "find / -xdev -type f -exec cat {} + > /dev/null 2>&1; md5sum /big.bin; cat /hello.txt",
            ],
        );
        let stdout = text(&out.stdout);
        assert!(
            out.status.success() && stdout.starts_with(&self.big_md5),
            "n{}: {stdout}\n{}",
            i + 1,
            text(&out.stderr)
        );
        assert!(stdout.ends_with("lazy hello\n"), "{stdout}");
    }

    /// The byte ranges of the squashfs blob the registry was asked for (through the proxy).
    fn ranges(&self) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut of_blob = false;
        for req in self.proxy.requests.lock().unwrap().iter() {
            for line in req.lines() {
                if line.starts_with("GET ") {
                    of_blob = line.contains(&format!("/blobs/{}", self.blob));
                }
                let lower = line.to_ascii_lowercase();
                if of_blob && let Some(r) = lower.strip_prefix("range: bytes=") {
                    let (a, b) = r.trim().split_once('-').unwrap();
                    out.push((a.parse().unwrap(), b.parse().unwrap()));
                }
            }
        }
        out.sort();
        out
    }

    /// Every agent's log lines about lazy images and peers, for a failure's message.
    fn logs(&self) -> String {
        self.agents
            .iter()
            .map(|(n, _, _)| {
                let log = self.log(n);
                let lines: Vec<&str> = log
                    .lines()
                    .filter(|l| l.contains("lazy") || l.contains("peer") || l.contains("warm"))
                    .collect();
                format!("--- {n}:\n{}", lines.join("\n"))
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn log(&self, node: &str) -> String {
        std::fs::read_to_string(self.path().join(format!("{node}.log"))).unwrap_or_default()
    }

    /// The chunk cache data file of node `i` (one lazy image: one cache).
    fn cache_data(&self, i: usize) -> PathBuf {
        let dir = self.path().join(&self.agents[i].0).join("store/lazy");
        let found: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "data"))
            .collect();
        assert_eq!(found.len(), 1, "{found:?}");
        found[0].clone()
    }
}

#[test]
#[ignore = "root tier"]
fn lazy_prewarm_fans_out_and_the_registry_serves_each_chunk_once() {
    let c = Cluster::start(4);
    let out = c.berth(0, &["cluster", "prewarm", &c.image, "--fanout", "2"]);
    let said = text(&out.stdout);
    assert!(
        out.status.success(),
        "prewarm: {said}\n{}",
        text(&out.stderr)
    );
    assert!(said.contains("4 of 4 nodes hold"), "{said}");
    assert_eq!(
        said.lines()
            .filter(|l| l.contains("warmed from registry"))
            .count(),
        1,
        "{said}"
    );
    // Each byte of the image asked of the registry once, by one node, all of it.
    let ranges = c.ranges();
    let mut next = 0;
    for (a, b) in &ranges {
        assert_eq!(
            *a,
            next,
            "ranges overlap or leave a hole: {ranges:?}\n{said}\n{}",
            c.logs()
        );
        next = b + 1;
    }
    assert_eq!(next, c.size, "{ranges:?}");
    let from_peers = (1..=4)
        .filter(|i| {
            c.log(&format!("n{i}")).contains(&format!(
                " bytes, 0 from the registry, {} from peers",
                c.size
            ))
        })
        .count();
    assert_eq!(from_peers, 3, "three nodes took every chunk from a peer");
    // Every node reads every file locally.
    for i in 0..4 {
        c.read_all(i);
    }
    assert_eq!(c.ranges(), ranges, "a read asked the registry again");
}

#[test]
#[ignore = "root tier"]
fn lazy_readers_take_chunks_from_peers_and_refuse_a_corrupt_one() {
    let c = Cluster::start(3);
    // n1 reads every file from the registry.
    c.read_all(0);
    let first = c.ranges();
    let total = |r: &[(u64, u64)]| r.iter().map(|(a, b)| b - a + 1).sum::<u64>();
    assert!(total(&first) > BIG as u64, "{first:?}");
    wait_for("n1's chunk cache in the catalog", 30, || c.lists_lazy(0));
    // A bad disk on n1: a chunk it read no longer what its map says was verified.
    let data = c.cache_data(0);
    let map = std::fs::read(data.with_extension("map")).unwrap();
    let bad = (3..map.len())
        .find(|i| map[*i] == 1)
        .expect("a chunk n1 read") as u64;
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&data).unwrap();
        f.write_all_at(&[0x5a; 512], bad * CHUNK + 100).unwrap();
    }
    let out = c.read_all(1);
    let err = text(&out.stderr);
    assert!(
        err.contains(&format!("served chunk {bad} not matching its index")),
        "n2 refused n1's damaged chunk: {err}"
    );
    // The run of the damaged chunk came from the registry again; the rest from n1.
    let second = c.ranges();
    let again = total(&second) - total(&first);
    assert!(
        again > 0 && again <= 16 * CHUNK && again < c.size / 2,
        "n2 asked the registry for {again} of {} bytes: {second:?}",
        c.size
    );
    assert!(
        second
            .iter()
            .any(|(a, b)| *a <= 3 * CHUNK && *b >= 4 * CHUNK - 1),
        "{second:?}"
    );
    // n3, through its node's lazy image server (as a Slurm step would): everything from the
    // peers (a damaged chunk of n1 refused, n2's taken).
    wait_for("n2's chunk cache in the catalog", 30, || c.lists_lazy(1));
    c.read_all_served(2);
    assert_eq!(c.ranges(), second, "n3 asked the registry");
}

/// Asks agent `i` to warm `image` from `peers` (addresses), as `berth cluster prewarm` does.
fn warm(c: &Cluster, i: usize, peers: &[String]) -> Value {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(300)))
        .build()
        .into();
    let body = serde_json::json!({"reference": c.image, "peers": peers}).to_string();
    let mut r = agent
        .post(&format!("http://127.0.0.1:{}/v1/warm", c.agents[i].1))
        .header(
            berth_api::auth::AUTH_HEADER,
            &signed("POST", "/v1/warm", body.as_bytes()),
        )
        .content_type("application/json")
        .send(body.as_bytes())
        .unwrap();
    serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap()
}

#[test]
#[ignore = "root tier"]
fn a_stalled_or_dead_peer_costs_one_bound_and_the_next_peer_serves() {
    let c = Cluster::start(2);
    let r = warm(&c, 0, &[]);
    assert!(r["digest"].is_string(), "{r}\n{}", c.logs());
    let ranges = c.ranges();
    // A peer that takes connections and never answers, and one whose port is closed.
    let stall = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let stall_addr = stall.local_addr().unwrap().to_string();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let over = done.clone();
    let held = std::thread::spawn(move || {
        let mut conns = Vec::new();
        stall.set_nonblocking(true).unwrap();
        let until = Instant::now() + Duration::from_secs(60);
        while Instant::now() < until && !over.load(std::sync::atomic::Ordering::Relaxed) {
            if let Ok((conn, _)) = stall.accept() {
                conns.push(conn);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        conns.len()
    });
    let dead = format!("127.0.0.1:{}", harness::free_port());
    let started = Instant::now();
    let r = warm(
        &c,
        1,
        &[stall_addr, dead, format!("127.0.0.1:{}", c.agents[0].1)],
    );
    let took = started.elapsed();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    eprintln!("the warm past a stalled and a dead peer took {took:?}");
    assert!(r["digest"].is_string(), "{r}\n{}", c.logs());
    let log = c.log("n2");
    assert!(
        log.contains(&format!(
            " bytes, 0 from the registry, {} from peers",
            c.size
        )),
        "{}",
        c.logs()
    );
    assert!(log.contains("not asked again"), "{log}");
    // The stalled peer cost one request's bound (lazy::PEER_DEADLINE_S, 10 s), not one per
    // chunk run (2 runs here, 26 chunks).
    assert!(took < Duration::from_secs(25), "the warm took {took:?}");
    assert_eq!(c.ranges(), ranges, "the registry was asked again");
    assert!(held.join().unwrap() >= 1, "the stalled peer was asked");
}
