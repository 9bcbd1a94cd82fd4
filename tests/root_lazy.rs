//! Root tier: lazily loaded images (image::lazy) against the loopback registry — `berth lazy
//! publish` of a squashfs, `berth run --image lazy:REF` through berth's FUSE server and a loop
//! mount, fetching only the chunks the container reads (the `Range` requests a logging proxy
//! saw), reading them locally the next time, and refusing a chunk the registry changed. Run as
//! root: `cargo test --test root_lazy -- --ignored --test-threads=1`.

mod common;
#[path = "../integration/registry/harness.rs"]
mod harness;

use std::path::PathBuf;
use std::process::{Command, Output};

use common::*;
use harness::{Mode, Proxy, Registry};

/// A registry, a logging proxy in front of it, and a berth config whose store and mounts are
/// this test's own (a cold cache), trusting both in plain HTTP.
struct Fixture {
    dir: tempfile::TempDir,
    registry: Registry,
    proxy: Proxy,
    config: PathBuf,
    /// The squashfs published, and its noise file's md5 (as `md5sum` prints it).
    sqsh: PathBuf,
    big_md5: String,
}

impl Fixture {
    fn new() -> Self {
        Self::with(&Mode::Plain, "")
    }

    /// A registry in `mode`; `registry_extra` goes into the config's `[registry]`.
    fn with(mode: &Mode, registry_extra: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let registry = Registry::start(
            mode,
            &dir.path().join("storage"),
            &dir.path().join("registry"),
        );
        let proxy = Proxy::start(registry.port, 1 << 40);
        let config = dir.path().join("berth.toml");
        std::fs::write(
            &config,
            format!(
                "[cgroup]\nroot = \"{}\"\n[runtime]\nstate_dir = \"{}\"\n[store]\nroot = \"{}\"\n\
                 [squashfs]\nmount_dir = \"{}\"\n[registry]\ninsecure = [\"{}\", \"{}\"]\n{registry_extra}",
                cgroup_root(),
                state_dir().display(),
                dir.path().join("store").display(),
                dir.path().join("images").display(),
                registry.host(),
                proxy.host()
            ),
        )
        .unwrap();
        // busybox, a small file and 24 MiB of noise (incompressible: its chunks stay its own).
        let tree = dir.path().join("tree");
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
        let big = harness::noise(24 << 20, 7);
        std::fs::write(tree.join("big.bin"), &big).unwrap();
        let md5 = Command::new("md5sum")
            .arg(tree.join("big.bin"))
            .output()
            .unwrap();
        let big_md5 = String::from_utf8_lossy(&md5.stdout)
            .split(' ')
            .next()
            .unwrap()
            .to_string();
        let sqsh = dir.path().join("image.sqsh");
        let o = Command::new("mksquashfs")
            .arg(&tree)
            .arg(&sqsh)
            .args(["-noappend", "-quiet", "-no-progress"])
            .output()
            .expect("mksquashfs (apt-get install squashfs-tools)");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        Fixture {
            dir,
            registry,
            proxy,
            config,
            sqsh,
            big_md5,
        }
    }

    fn berth(&self, args: &[&str]) -> Output {
        Command::new(berth_bin())
            .arg("--config")
            .arg(&self.config)
            .args(args)
            .output()
            .unwrap()
    }

    /// Publishes the squashfs straight to the registry as `t/lazy:TAG`; returns its blob digest.
    fn publish(&self, tag: &str) -> String {
        let reference = format!("docker://{}/t/lazy:{tag}", self.registry.host());
        let sqsh = self.sqsh.to_str().unwrap();
        let out = ok(self.berth(&["lazy", "publish", sqsh, &reference]));
        out.split(' ').nth(1).unwrap().to_string()
    }

    /// `berth run --image lazy:…` through the proxy.
    fn run(&self, tag: &str, script: &str) -> Output {
        self.run_as(&[], tag, script)
    }

    /// [`Fixture::run`] with more flags (`--user`).
    fn run_as(&self, flags: &[&str], tag: &str, script: &str) -> Output {
        let image = format!("lazy:docker://{}/t/lazy:{tag}", self.proxy.host());
        let mut args = vec!["run", "--image", &image];
        args.extend_from_slice(flags);
        args.extend_from_slice(&["--", "/bin/sh", "-c", script]);
        self.berth(&args)
    }

    /// Starts `berth run --image lazy:…` of `script`, which prints `lazy hello` first, and
    /// returns once it has: the image is mounted and the container running.
    fn start_run(&self, tag: &str, script: &str) -> std::process::Child {
        let image = format!("lazy:docker://{}/t/lazy:{tag}", self.proxy.host());
        let mut child = Command::new(berth_bin())
            .arg("--config")
            .arg(&self.config)
            .args(["run", "--image", &image, "--", "/bin/sh", "-c", script])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        assert_eq!(line, "lazy hello\n");
        child
    }

    /// The bytes asked for by `Range` GETs of `digest` that the proxy has seen.
    fn ranged_bytes(&self, digest: &str) -> u64 {
        let mut total = 0;
        let mut of_blob = false;
        for text in self.proxy.requests.lock().unwrap().iter() {
            for line in text.lines() {
                if line.starts_with("GET ") {
                    of_blob = line.contains(&format!("/blobs/{digest}"));
                }
                let lower = line.to_ascii_lowercase();
                if of_blob && let Some(r) = lower.strip_prefix("range: bytes=") {
                    let (a, b) = r.trim().split_once('-').unwrap();
                    total += b.parse::<u64>().unwrap() - a.parse::<u64>().unwrap() + 1;
                }
            }
        }
        total
    }

    fn unmounted(&self) {
        let here = self.dir.path().to_str().unwrap();
        assert!(
            host_mounts_with(here).is_empty(),
            "mounts left: {:?}",
            host_mounts_with(here)
        );
    }
}

/// The one chunk cache file of the store ending in `ext` (`data` or `map`): caches are named by
/// their index's digest.
fn cache_file(f: &Fixture, ext: &str) -> PathBuf {
    let found: Vec<PathBuf> = std::fs::read_dir(f.dir.path().join("store/lazy"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .collect();
    assert_eq!(found.len(), 1, "{found:?}");
    found[0].clone()
}

fn blob_size(f: &Fixture, digest: &str) -> u64 {
    std::fs::metadata(harness::blob_data_path(&f.registry.storage, digest))
        .unwrap()
        .len()
}

#[test]
#[ignore = "root tier"]
fn lazy_image_runs_fetching_only_what_it_reads() {
    let f = Fixture::new();
    let digest = f.publish("1");
    let size = blob_size(&f, &digest);
    assert!(size > 24 << 20, "{size}");

    let first = f.run("1", "cat /hello.txt");
    assert_eq!(stdout(&first), "lazy hello\n", "{}", stderr(&first));
    assert!(first.status.success());
    let fetched = f.ranged_bytes(&digest);
    assert!(fetched > 0, "no Range request for {digest}");
    assert!(
        fetched < size / 4,
        "a first exec fetched {fetched} of {size} bytes"
    );
    f.unmounted();

    // Again: the chunks come from the node's cache, not the registry.
    let second = f.run("1", "cat /hello.txt");
    assert_eq!(stdout(&second), "lazy hello\n", "{}", stderr(&second));
    assert_eq!(
        f.ranged_bytes(&digest),
        fetched,
        "the second run fetched again"
    );

    // Every byte, fetched on demand, is the image's.
    let whole = f.run("1", "md5sum /big.bin");
    assert!(whole.status.success(), "{}", stderr(&whole));
    assert!(stdout(&whole).starts_with(&f.big_md5), "{}", stdout(&whole));
    assert!(f.ranged_bytes(&digest) >= 24 << 20);
    f.unmounted();
}

#[test]
#[ignore = "root tier"]
fn images_gc_removes_a_chunk_cache_only_when_no_run_holds_it() {
    let f = Fixture::new();
    f.publish("1");
    let gc = || {
        let o = f.berth(&["images", "gc", "--unused-for", "0s"]);
        assert!(o.status.success(), "{}", stderr(&o));
        stderr(&o)
    };

    // A run that is still going holds its cache. Ended from the host's side (the container's
    // /tmp is its own), also when an assertion fails, so that it never outlives the test.
    struct Running(std::process::Child);
    impl Running {
        fn end(&mut self) {
            let _ = Command::new("pkill")
                .args(["-f", "while \\[ ! -e /tmp/lazy-gc-stop \\]"])
                .status();
            let _ = self.0.wait();
        }
    }
    impl Drop for Running {
        fn drop(&mut self) {
            self.end();
        }
    }
    let mut running = Running(f.start_run(
        "1",
        "cat /hello.txt; while [ ! -e /tmp/lazy-gc-stop ]; do sleep 0.1; done",
    ));
    let (map, data) = (cache_file(&f, "map"), cache_file(&f, "data"));
    let said = gc();
    assert!(
        map.exists(),
        "gc removed the cache of a running container: {said}"
    );
    assert!(!said.contains("lazy image chunk caches"), "{said}");
    running.end();
    let said = gc();
    assert!(said.contains("1 lazy image chunk caches"), "{said}");
    assert!(!map.exists() && !data.exists());

    // The next run fetches what it reads again, into a new cache.
    let again = f.run("1", "cat /hello.txt");
    assert_eq!(stdout(&again), "lazy hello\n", "{}", stderr(&again));
    assert!(map.exists());
    f.unmounted();
}

#[test]
#[ignore = "root tier"]
fn a_lazy_image_never_fills_the_store_past_its_reserve() {
    let f = Fixture::new();
    f.publish("1");
    // A reserve larger than any disk: no chunk may be cached, so the squashfs cannot even be
    // mounted (its superblock is a chunk).
    let config = std::fs::read_to_string(&f.config).unwrap();
    std::fs::write(
        &f.config,
        config.replacen(
            "[store]\n",
            "[store]\nreserve_bytes = 1125899906842624\n",
            1,
        ),
    )
    .unwrap();
    let o = f.run("1", "cat /hello.txt");
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(
        err.contains("below store.reserve_bytes (1024.0 TiB)") && err.lines().count() <= 2,
        "{err}"
    );
    let (data, map) = (cache_file(&f, "data"), cache_file(&f, "map"));
    assert_eq!(
        std::os::unix::fs::MetadataExt::blocks(&std::fs::metadata(&data).unwrap()),
        0,
        "bytes were cached past the reserve"
    );
    assert!(std::fs::read(&map).unwrap().iter().all(|m| *m == 0));
    f.unmounted();

    // With the reserve back, the same image runs.
    std::fs::write(&f.config, &config).unwrap();
    let o = f.run("1", "cat /hello.txt");
    assert_eq!(stdout(&o), "lazy hello\n", "{}", stderr(&o));
}

#[test]
#[ignore = "root tier"]
fn lazy_image_refuses_a_tampered_chunk() {
    let f = Fixture::new();
    let digest = f.publish("1");
    let size = blob_size(&f, &digest);
    // A byte in the middle of the blob: inside big.bin, away from the squashfs's tables.
    let data = harness::blob_data_path(&f.registry.storage, &digest);
    let mut bytes = std::fs::read(&data).unwrap();
    let at = usize::try_from(size / 2).unwrap();
    bytes[at] ^= 0xff;
    std::fs::write(&data, &bytes).unwrap();

    let out = f.run("1", "cat /hello.txt; md5sum /big.bin");
    let (o, e) = (stdout(&out), stderr(&out));
    // The untouched chunks still serve; the changed one reaches no one.
    assert!(o.starts_with("lazy hello\n"), "{o}\n{e}");
    assert!(!o.contains(&f.big_md5) && o.lines().count() == 1, "{o}");
    assert!(!out.status.success());
    let said: Vec<&str> = e
        .lines()
        .filter(|l| l.contains("does not match its index"))
        .collect();
    assert_eq!(said.len(), 1, "{e}");
    assert!(
        said[0].contains(&digest) && said[0].contains("berth lazy publish"),
        "{e}"
    );
    f.unmounted();

    // The superblock's chunk changed: the image does not mount, the command does not run.
    let mut bytes = std::fs::read(&data).unwrap();
    bytes[100] ^= 0xff;
    std::fs::write(&data, &bytes).unwrap();
    let store = f.dir.path().join("store/lazy");
    for entry in std::fs::read_dir(&store).unwrap() {
        std::fs::remove_file(entry.unwrap().path()).unwrap();
    }
    let out = f.run("1", "echo ran");
    assert!(!out.status.success());
    assert!(!stdout(&out).contains("ran"));
    let last = stderr(&out);
    assert_eq!(last.lines().count(), 1, "{last}");
    assert!(
        last.starts_with("berth: lazy image")
            && last.contains("chunk 0 ")
            && last.contains("does not match its index"),
        "{last}"
    );
    f.unmounted();
}

#[test]
#[ignore = "root tier"]
fn lazy_refuses_what_is_not_a_lazy_image() {
    let f = Fixture::new();
    harness::Uploader::new(&f.registry.host(), None).image(
        "t/plain",
        Some("1"),
        "amd64",
        vec![harness::blob_of(
            harness::tar_of(&harness::busybox_entries("linux/amd64")),
            harness::Compression::Gzip,
            false,
        )],
        false,
    );
    let image = format!("lazy:docker://{}/t/plain:1", f.registry.host());
    let out = f.berth(&["run", "--image", &image, "--", "/bin/true"]);
    assert!(!out.status.success());
    let e = stderr(&out);
    assert!(
        e.contains("not a lazy image") && e.lines().count() == 1,
        "{e}"
    );

    // Nor is one started for it by berth create.
    let out = f.berth(&["create", "--image", &image]);
    assert!(!out.status.success());
    let e = stderr(&out);
    assert!(
        e.contains("not a lazy image") && e.lines().count() == 1,
        "{e}"
    );

    let file = f.dir.path().join("berth.toml");
    let out = f.berth(&[
        "lazy",
        "publish",
        file.to_str().unwrap(),
        &format!("docker://{}/t/x:1", f.registry.host()),
    ]);
    assert!(!out.status.success());
    assert_eq!(stderr(&out).lines().count(), 1, "{}", stderr(&out));
}

#[test]
#[ignore = "root tier"]
fn a_lazy_image_needs_the_users_own_access() {
    // Root's login (a file in /root, `~` being the requesting user's home); the job's user has
    // none.
    let name = format!(".berth-lazy-credentials-{}", std::process::id());
    let creds = PathBuf::from("/root").join(&name);
    struct Remove(PathBuf);
    impl Drop for Remove {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let _remove = Remove(creds.clone());
    let f = Fixture::with(
        &Mode::Basic {
            user: "alice".into(),
            password: "pw".into(),
        },
        &format!("credentials = \"~/{name}\"\nenroot_credentials = false\n"),
    );
    std::fs::write(
        &creds,
        format!(
            "machine {} login alice password pw\nmachine {} login alice password pw\n",
            f.registry.host(),
            f.proxy.host()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&creds, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let reference = format!("docker://{}/t/lazy:1", f.registry.host());
    let out = Command::new(berth_bin())
        .arg("--config")
        .arg(&f.config)
        .args(["lazy", "publish", f.sqsh.to_str().unwrap(), &reference])
        .env("HOME", "/root")
        .output()
        .unwrap();
    ok(out);
    // Root reads it, so the node's cache holds its first chunks.
    let root = f.run("1", "cat /hello.txt");
    assert_eq!(stdout(&root), "lazy hello\n", "{}", stderr(&root));
    // The job's user cannot pull it: the cached chunks are not theirs to read.
    let (uid, gid, _) = test_user();
    let user = format!("{uid}:{gid}");
    let out = f.run_as(&["--user", &user], "1", "cat /hello.txt");
    assert!(!out.status.success());
    assert!(!stdout(&out).contains("lazy hello"));
    let e = stderr(&out);
    assert_eq!(e.lines().count(), 1, "{e}");
    assert!(e.contains("requires a login"), "{e}");
    f.unmounted();
}

#[test]
#[ignore = "root tier"]
fn berth_gc_unmounts_the_lazy_image_of_a_killed_run() {
    let f = Fixture::new();
    f.publish("1");
    let image = format!("lazy:docker://{}/t/lazy:1", f.proxy.host());
    let mut child = Command::new(berth_bin())
        .arg("--config")
        .arg(&f.config)
        .args(["run", "--image", &image, "--", "/bin/sleep", "20"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let here = f.dir.path().to_str().unwrap().to_string();
    let mut mounted = false;
    for _ in 0..400 {
        if host_mounts_with(&here).len() >= 2 {
            mounted = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(mounted, "the lazy run never mounted its image");
    // SIGKILL: no drop runs, the FUSE server dies with the process, its mounts stay. Killed
    // as soon as the mounts appear, the process may still hold the FUSE file open (its config
    // is read through it): its exit must not wait on its own, dead, server.
    child.kill().unwrap();
    let mut exited = false;
    for _ in 0..200 {
        if child.try_wait().unwrap().is_some() {
            exited = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(
        exited,
        "the killed berth run did not exit within 20 s (its exit waits on its own FUSE server?)"
    );
    assert!(!host_mounts_with(&here).is_empty());
    let gc = f.berth(&["gc"]);
    assert!(gc.status.success(), "{}", stderr(&gc));
    f.unmounted();
    let lazy_dir = f.dir.path().join("images/lazy");
    assert_eq!(std::fs::read_dir(&lazy_dir).unwrap().count(), 0);
}

#[test]
#[ignore = "root tier"]
fn sigterm_to_a_lazy_run_ends_its_container_and_leaves_no_mount() {
    let f = Fixture::new();
    f.publish("1");
    let mut child = f.start_run("1", "cat /hello.txt; exec sleep 600");
    // What scancel or a terminal's ^C sends. The FUSE server's threads must not take it: its
    // default action killed berth outright, and the mounts stayed.
    assert!(
        Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .unwrap()
            .success()
    );
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(143), "{status:?}");
    f.unmounted();
}

/// The pids of the lazy image servers (`berth … lazy serve …`) of `reference`.
fn servers_of(reference: &str) -> Vec<u32> {
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let words: Vec<&[u8]> = cmd.split(|b| *b == 0).filter(|w| !w.is_empty()).collect();
        if words.windows(2).any(|w| w == [&b"lazy"[..], &b"serve"[..]])
            && words.last() == Some(&reference.as_bytes())
        {
            pids.push(pid);
        }
    }
    pids
}

#[test]
#[ignore = "root tier"]
fn berth_create_uses_the_nodes_server_which_gc_stops_after_rm() {
    let f = Fixture::new();
    f.publish("1");
    let reference = format!("docker://{}/t/lazy:1", f.proxy.host());
    let image = format!("lazy:{reference}");
    let id = ok(f.berth(&["create", "--image", &image]))
        .trim()
        .to_string();
    struct Rm<'a>(&'a Fixture, String);
    impl Drop for Rm<'_> {
        fn drop(&mut self) {
            let _ = self.0.berth(&["rm", &self.1]);
            let _ = self.0.berth(&["gc"]);
        }
    }
    let rm = Rm(&f, id.clone());
    // Outlives berth create: the image comes from the node's server, not that process.
    let out = f.berth(&["exec", &id, "--", "cat", "/hello.txt"]);
    assert_eq!(stdout(&out), "lazy hello\n", "{}", stderr(&out));
    let first = servers_of(&reference);
    assert_eq!(first.len(), 1, "{first:?}");
    // A second container of the image: the same server.
    let second = ok(f.berth(&["create", "--image", &image]))
        .trim()
        .to_string();
    let rm2 = Rm(&f, second.clone());
    assert_eq!(servers_of(&reference), first);
    // In use: gc leaves it.
    let gc = ok(f.berth(&["gc"]));
    assert!(!gc.contains("lazy image server"), "{gc}");
    assert_eq!(servers_of(&reference), first);
    ok(f.berth(&["rm", &id]));
    let gc = ok(f.berth(&["gc"]));
    assert!(!gc.contains("lazy image server"), "{gc}");
    let out = f.berth(&["exec", &second, "--", "md5sum", "/big.bin"]);
    assert!(stdout(&out).starts_with(&f.big_md5), "{}", stderr(&out));
    ok(f.berth(&["rm", &second]));
    let gc = ok(f.berth(&["gc"]));
    assert!(
        gc.contains("stopped the lazy image server of index sha256:"),
        "{gc}"
    );
    assert!(servers_of(&reference).is_empty());
    // Its cgroup goes with the last server: none is left beside the containers' (root_run).
    assert!(
        !std::path::Path::new(cgroup_root()).join("lazy").exists(),
        "{:?}",
        leftover_cgroups()
    );
    f.unmounted();
    drop((rm, rm2));
}
