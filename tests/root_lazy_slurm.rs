//! Root tier: lazily loaded images in Slurm steps (issue 30) — `srun --container-image=lazy:REF`
//! on a real one-host Slurm of this file's own (integration/slurm/start.sh, its own state
//! directory and ports) against the loopback registry, through a proxy of this file's that can
//! stall. The node's lazy image server (image::lazy::server), started by the job's Prolog: one
//! process and one mount shared by the steps of two users, kept for the other when one step is
//! cancelled, stopped by `berth gc` once no container uses it; every task of a step, named
//! containers and `--container-save` on a lazy image; a second index of the same blob changes
//! nothing a running container reads; a registry that stalls mid-read gives the reader EIO
//! within `registry.lazy_read_deadline_s`; `registry.lazy_tag_suffix` runs a plain reference's
//! published lazy form (a step and `berth run`), and without it the image is imported whole;
//! the Prolog's prefetch caches the chunks of what the image's command starts and few others;
//! `srun -N2` on a second cluster of two slurmd, each node's own server serving it; a killed
//! server's containers get EIO and the next container a new server.
//! Run as root: `cargo test --test root_lazy_slurm -- --ignored --test-threads=1`
//! (`BERTH_TEST_BIN`, `BERTH_TEST_PLUGIN`: an older berth and SPANK plugin).

mod common;
#[path = "../integration/registry/harness.rs"]
mod harness;

use std::io::{BufRead, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use common::*;

/// The stall test's bound (`registry.lazy_read_deadline_s` of this cluster's berth).
const READ_DEADLINE_S: u64 = 3;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn state_path() -> PathBuf {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    std::hash::Hash::hash(&(env!("CARGO_MANIFEST_DIR"), "root_lazy_slurm"), &mut h);
    let hash = std::hash::Hasher::finish(&h) & u64::from(u32::MAX);
    PathBuf::from(format!("/tmp/berth-root-lazy-slurm-{hash:08x}"))
}

/// A proxy to the registry that, while `stalled`, forwards nothing more on any connection (new
/// or kept alive) and keeps it open: a registry gone silent mid-transfer.
struct Stall {
    port: u16,
    stalled: Arc<AtomicBool>,
}

impl Stall {
    fn start(upstream: u16) -> Stall {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let stalled = Arc::new(AtomicBool::new(false));
        let flag = stalled.clone();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
                    continue;
                };
                for (mut from, mut to) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    let flag = flag.clone();
                    std::thread::spawn(move || {
                        let mut buf = vec![0u8; 64 * 1024];
                        loop {
                            let n = match from.read(&mut buf) {
                                Ok(0) | Err(_) => break,
                                Ok(n) => n,
                            };
                            while flag.load(Ordering::Relaxed) {
                                std::thread::sleep(Duration::from_millis(100));
                            }
                            if to.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                        let _ = to.shutdown(Shutdown::Write);
                    });
                }
            }
        });
        Stall { port, stalled }
    }

    fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

struct Cluster {
    conf: PathBuf,
    cwd: PathBuf,
    berth_config: PathBuf,
    mount_dir: PathBuf,
    /// `lazy:docker://…/t/lazy:1` through the stalling proxy.
    image: String,
    /// Another image (other noise, its own index and cache) for the stall.
    stall_image: String,
    stall: Stall,
    big_md5: String,
    /// The squashfs published as `t/lazy:1`, and the registry's `HOST:PORT`.
    sqsh: PathBuf,
    registry: String,
    /// berth's configuration with `registry.lazy_tag_suffix = "-lazy"` (the cluster's), and
    /// without it.
    config_on: String,
    config_off: String,
    /// `docker://…/t/auto:1`: an image pushed whole, whose lazy form is `t/auto:1-lazy`.
    auto_image: String,
    /// `lazy:docker://…/t/pre:1` (uncompressed, so a file's bytes are found in the squashfs),
    /// its squashfs, and the node's store.
    pre_image: String,
    pre_sqsh: PathBuf,
    /// `t/pre:1`'s squashfs published again in 512 KiB chunks (`lazy:docker://…/t/restart:1`)
    /// for the server restart test, and the md5 of its `/zz-noise.bin`.
    restart_image: String,
    pre_md5: String,
    store: PathBuf,
}

static REGISTRY_PID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

fn free_port_pair() -> u16 {
    for _ in 0..50 {
        let p = harness::free_port();
        if p < 65000 && std::net::TcpListener::bind(("0.0.0.0", p + 1)).is_ok() {
            return p;
        }
    }
    panic!("no two consecutive free ports found");
}

/// A squashfs of busybox, `hello.txt` and 24 MiB of noise (`seed`); returns it and the noise's md5.
fn squashfs(dir: &Path, name: &str, seed: u64) -> (PathBuf, String) {
    squashfs_with(dir, name, seed, ("big.bin", 24 << 20), &[], "")
}

/// [`squashfs`] with the noise file `noise` (name, bytes), mksquashfs's `options`, and `/form`
/// holding `form` (when not empty).
fn squashfs_with(
    dir: &Path,
    name: &str,
    seed: u64,
    noise: (&str, usize),
    options: &[&str],
    form: &str,
) -> (PathBuf, String) {
    let tree = dir.join(format!("{name}-tree"));
    let _ = std::fs::remove_dir_all(&tree);
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
    std::fs::write(tree.join(noise.0), harness::noise(noise.1, seed)).unwrap();
    if !form.is_empty() {
        std::fs::write(tree.join("form"), form).unwrap();
    }
    let md5 = Command::new("md5sum")
        .arg(tree.join(noise.0))
        .output()
        .unwrap();
    let md5 = stdout(&md5).split(' ').next().unwrap().to_string();
    let sqsh = dir.join(format!("{name}.sqsh"));
    let o = Command::new("mksquashfs")
        .arg(&tree)
        .arg(&sqsh)
        .args(["-noappend", "-quiet", "-no-progress"])
        .args(options)
        .output()
        .expect("mksquashfs");
    assert!(o.status.success(), "{}", stderr(&o));
    (sqsh, md5)
}

fn cluster() -> &'static Cluster {
    static CLUSTER: OnceLock<Cluster> = OnceLock::new();
    CLUSTER.get_or_init(|| {
        let berth = PathBuf::from(berth_bin());
        let built = PathBuf::from(BERTH);
        let profile_dir = built.parent().unwrap();
        let status = Command::new(env!("CARGO"))
            .args(["build", "-p", "berth-spank"])
            .current_dir(repo())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("running cargo");
        assert!(status.success(), "building the SPANK plugin failed");
        let plugin = std::env::var_os("BERTH_TEST_PLUGIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| profile_dir.join("libspank_berth.so"));

        let state = state_path();
        let work = PathBuf::from(format!("{}-work", state.display()));
        let _ = std::fs::remove_dir_all(&work);
        std::fs::create_dir_all(&work).unwrap();
        let registry = harness::Registry::start(
            &harness::Mode::Plain,
            &work.join("registry/storage"),
            &work.join("registry"),
        );
        let stall = Stall::start(registry.port);
        let mount_dir = state.join("berth/images");
        let berth_config = PathBuf::from(format!("{}.toml", state.display()));
        // An older berth (BERTH_TEST_BIN) knows no such key and would refuse the whole config;
        // without it, what it says is its refusal of the lazy image itself.
        let deadline = if std::env::var_os("BERTH_TEST_BIN").is_some() {
            String::new()
        } else {
            format!("lazy_read_deadline_s = {READ_DEADLINE_S}\n")
        };
        let config_text = |deadline: &str| {
            format!(
                "[cgroup]\nroot = \"{}-lazy-slurm\"\n[runtime]\nstate_dir = \"{s}/berth/state\"\n\
                 [store]\nroot = \"{s}/berth/store\"\n[squashfs]\nmount_dir = \"{}\"\n\
                 [scratch]\nroot = \"{s}/berth/scratch\"\n\
                 [registry]\ninsecure = [\"{}\", \"{}\"]\n{deadline}",
                cgroup_root(),
                mount_dir.display(),
                registry.host(),
                stall.host(),
                s = state.display(),
            )
        };
        let config_off = config_text(&deadline);
        // The site option (as the deadline: unknown to an older berth, which would refuse the
        // config; without it, that berth imports the plain reference whole).
        let config_on = if deadline.is_empty() {
            config_off.clone()
        } else {
            config_text(&format!("{deadline}lazy_tag_suffix = \"-lazy\"\n"))
        };
        std::fs::write(&berth_config, &config_on).unwrap();
        let publish_as = |sqsh: &Path, name: &str| {
            let reference = format!("docker://{}/{name}", registry.host());
            ok(Command::new(&berth)
                .arg("--config")
                .arg(&berth_config)
                .args(["lazy", "publish", sqsh.to_str().unwrap(), &reference])
                .output()
                .unwrap());
        };
        // t/auto:1 pushed whole (its /form says so), its lazy form beside it as t/auto:1-lazy.
        let mut entries = harness::busybox_entries("linux/amd64");
        entries.push(harness::Entry::File(
            "form".into(),
            b"full\n".to_vec(),
            0o644,
        ));
        harness::Uploader::new(&registry.host(), None).image(
            "t/auto",
            Some("1"),
            "amd64",
            vec![harness::blob_of(
                harness::tar_of(&entries),
                harness::Compression::Gzip,
                false,
            )],
            false,
        );
        let (auto_sqsh, _) = squashfs_with(&work, "auto", 9, ("big.bin", 4 << 20), &[], "lazy\n");
        publish_as(&auto_sqsh, "t/auto:1-lazy");
        // For the Prolog's prefetch: 64 MiB of noise no command reads, data uncompressed, after
        // /bin in the squashfs (its files are stored in name order), so that busybox's chunks
        // are neither the superblock's nor the tables' at the end, which mounting reads.
        let uncompressed = ["-noI", "-noD", "-noF", "-noX", "-no-fragments"];
        let noise = ("zz-noise.bin", 64 << 20);
        let (pre_sqsh, pre_md5) = squashfs_with(&work, "pre", 10, noise, &uncompressed, "pre\n");
        publish_as(&pre_sqsh, "t/pre:1");
        // The same squashfs in 512 KiB chunks: another index, so a cache and servers of its own
        // (for the server restart test; the registry has the blob already).
        ok(Command::new(&berth)
            .arg("--config")
            .arg(&berth_config)
            .args(["lazy", "publish", "--chunk-kib", "512"])
            .arg(&pre_sqsh)
            .arg(format!("docker://{}/t/restart:1", registry.host()))
            .output()
            .unwrap());
        let publish = |sqsh: &Path, tag: &str| {
            let reference = format!("docker://{}/t/lazy:{tag}", registry.host());
            ok(Command::new(&berth)
                .arg("--config")
                .arg(&berth_config)
                .args(["lazy", "publish", sqsh.to_str().unwrap(), &reference])
                .output()
                .unwrap());
        };
        let (sqsh, big_md5) = squashfs(&work, "image", 7);
        publish(&sqsh, "1");
        let (stall_sqsh, _) = squashfs(&work, "stall", 8);
        publish(&stall_sqsh, "stall");
        let registry_host = registry.host();
        REGISTRY_PID.store(registry.pid().unwrap_or(0), Ordering::Relaxed);
        std::mem::forget(registry);
        extern "C" fn stop_cluster() {
            let pid = REGISTRY_PID.load(Ordering::Relaxed);
            if pid > 0 {
                // SAFETY: killing the registry this process started.
                unsafe { libc::kill(i32::try_from(pid).unwrap(), libc::SIGKILL) };
            }
            let _ = Command::new("bash")
                .arg(repo().join("integration/slurm/stop.sh"))
                .arg("--state")
                .arg(state_path())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
        // SAFETY: registering a plain function to run at process exit.
        unsafe { libc::atexit(stop_cluster) };
        let out = Command::new("bash")
            .arg(repo().join("integration/slurm/start.sh"))
            .arg("--state")
            .arg(&state)
            .arg("--plugin")
            .arg(&plugin)
            .arg("--berth")
            .arg(&berth)
            .arg("--berth-config")
            .arg(&berth_config)
            .env("BERTH_SLURM_PORT", free_port_pair().to_string())
            .stdin(Stdio::null())
            .output()
            .expect("running integration/slurm/start.sh");
        assert!(
            out.status.success(),
            "integration/slurm/start.sh failed:\n{}{}",
            stdout(&out),
            stderr(&out)
        );
        let cwd = state.join("cwd");
        std::fs::create_dir_all(&cwd).unwrap();
        std::fs::set_permissions(&cwd, std::fs::Permissions::from_mode(0o1777)).unwrap();
        Cluster {
            conf: state.join("etc/slurm.conf"),
            cwd,
            berth_config,
            mount_dir,
            image: format!("lazy:docker://{}/t/lazy:1", stall.host()),
            stall_image: format!("lazy:docker://{}/t/lazy:stall", stall.host()),
            stall,
            big_md5,
            sqsh,
            auto_image: format!("docker://{registry_host}/t/auto:1"),
            pre_image: format!("lazy:docker://{registry_host}/t/pre:1"),
            pre_sqsh,
            pre_md5,
            restart_image: format!("lazy:docker://{registry_host}/t/restart:1"),
            store: state.join("berth/store"),
            registry: registry_host,
            config_on,
            config_off,
        }
    })
}

/// A user of these tests (made once), without a home of their own.
fn user(name: &str) -> String {
    if !Command::new("id")
        .arg(name)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap()
        .success()
    {
        let out = Command::new("useradd")
            .args(["-M", "-s", "/bin/sh", "-d", "/nonexistent", name])
            .output()
            .unwrap();
        assert!(out.status.success(), "useradd: {}", stderr(&out));
    }
    name.to_string()
}

/// A Slurm client command as `who` (runuser keeps SLURM_CONF), from the shared directory.
fn slurm_as(who: &str, cmd: &str, args: &[&str]) -> Command {
    let c = cluster();
    let mut command = Command::new("runuser");
    command
        .args(["-u", &user(who), "--", cmd])
        .args(args)
        .env("SLURM_CONF", &c.conf)
        .env_remove("BERTH_CONTAINER_IMAGE")
        .env_remove("PYXIS_CONTAINER_IMAGE")
        .env("PWD", &c.cwd)
        .current_dir(&c.cwd)
        .stdin(Stdio::null());
    command
}

fn slurm_root(cmd: &str, args: &[&str]) -> Output {
    Command::new(cmd)
        .args(args)
        .env("SLURM_CONF", &cluster().conf)
        .output()
        .unwrap()
}

fn berth_root(args: &[&str]) -> Output {
    Command::new(berth_bin())
        .arg("--config")
        .arg(&cluster().berth_config)
        .args(args)
        .output()
        .unwrap()
}

/// A step started in the background, its stdout lines read as they come.
struct Step {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Step {
    fn start(who: &str, args: &[&str]) -> Step {
        Step::start_with(who, "srun", args)
    }

    /// Waits (at most `secs`) for a line containing `text`.
    fn wait_for(&mut self, text: &str, secs: u64) {
        let until = Instant::now() + Duration::from_secs(secs);
        while !self.seen.iter().any(|l| l.contains(text)) {
            let left = until.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => self.seen.push(l),
                Err(_) => panic!("no '{text}' within {secs} s; saw {:?}", self.seen),
            }
        }
    }

    /// Waits (at most `secs`) for srun to end; returns every line it printed.
    fn finish(mut self, secs: u64) -> Vec<String> {
        let until = Instant::now() + Duration::from_secs(secs);
        while self.child.try_wait().unwrap().is_none() {
            if Instant::now() > until {
                let _ = self.child.kill();
                panic!("srun did not end within {secs} s; saw {:?}", self.seen);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(2)) {
            self.seen.push(l);
        }
        std::mem::take(&mut self.seen)
    }
}

impl Drop for Step {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The pids of the node's lazy image servers of `t/lazy:1` (`berth … lazy serve …`).
fn servers() -> Vec<u32> {
    servers_of("/t/lazy:1")
}

/// The pids of the node's lazy image servers of the reference ending with `name`.
fn servers_of(name: &str) -> Vec<u32> {
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let words: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
        if words.windows(2).any(|w| w == [&b"lazy"[..], &b"serve"[..]])
            && words.iter().any(|w| w.ends_with(name.as_bytes()))
        {
            pids.push(pid);
        }
    }
    pids
}

/// The mounts of the servers (`<mount_dir>/lazy/<hex>/{fuse,root}`) in this namespace (the
/// stall test's server has none left when its step has ended: see its end).
fn server_mounts() -> Vec<String> {
    let lazy = cluster().mount_dir.join("lazy");
    host_mounts_with(lazy.to_str().unwrap())
}

fn job_of(who: &str) -> Vec<String> {
    let o = slurm_root("squeue", &["-h", "-u", who, "-o", "%i"]);
    stdout(&o).split_whitespace().map(str::to_string).collect()
}

/// Waits (at most `secs`) until `cond` holds.
fn eventually(secs: u64, what: &str, cond: impl Fn() -> bool) {
    let until = Instant::now() + Duration::from_secs(secs);
    while !cond() {
        assert!(Instant::now() < until, "{what}: not within {secs} s");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
#[ignore = "root tier"]
fn steps_of_two_users_share_one_server_which_a_cancel_leaves_and_gc_stops() {
    let c = cluster();
    let img = format!("--container-image={}", c.image);
    // A: holds its container until cancelled.
    let mut a = Step::start(
        "berthlazy",
        &[&img, "sh", "-c", "cat /hello.txt; exec sleep 300"],
    );
    a.wait_for("lazy hello", 120);
    let first = servers();
    assert_eq!(first.len(), 1, "{first:?}");
    // The job's Prolog pre-imported the image (srun passes it as SPANK_BERTH_IMAGE): it started
    // the server, with its own environment, before the step's container was made.
    let env = std::fs::read(format!("/proc/{}/environ", first[0])).unwrap();
    assert!(
        env.split(|b| *b == 0)
            .any(|w| w == b"SLURM_SCRIPT_CONTEXT=prolog_slurmd"),
        "the server was not started by the Prolog"
    );
    // B, another user: the same server; its read of the whole image comes after A is gone.
    let go = c.cwd.join("lazy-b-go");
    let _ = std::fs::remove_file(&go);
    let mounts = format!("--container-mounts={}", c.cwd.display());
    let script = format!(
        "cat /hello.txt; while [ ! -e {g} ] && [ $((n+=1)) -lt 600 ]; do sleep 0.2; done; \
         md5sum /big.bin",
        g = go.display()
    );
    let mut b = Step::start("berthlazy2", &[&img, &mounts, "sh", "-c", &script]);
    b.wait_for("lazy hello", 120);
    assert_eq!(servers(), first, "a second server for the same image");
    let mounts = server_mounts();
    assert_eq!(
        mounts.len(),
        2,
        "one FUSE and one squashfs mount: {mounts:#?}"
    );

    let jobs = job_of("berthlazy");
    assert_eq!(jobs.len(), 1, "{jobs:?}");
    assert!(slurm_root("scancel", &[&jobs[0]]).status.success());
    a.finish(60);
    // A's Epilog has run by the time its job has left the queue.
    eventually(60, "the cancelled job to leave the queue", || {
        job_of("berthlazy").is_empty()
    });
    assert_eq!(
        servers(),
        first,
        "cancelling A's step ended the server B uses"
    );
    std::fs::write(&go, "").unwrap();
    let said = b.finish(120);
    assert!(
        said.iter().any(|l| l.starts_with(&c.big_md5)),
        "B read the image wrong after A's cancel: {said:?}"
    );

    // A step ended inside a job that still runs: its server stays until berth gc.
    let marker = c.cwd.join("lazy-gc-go");
    let _ = std::fs::remove_file(&marker);
    let script = format!(
        "srun {img} cat /hello.txt; echo step-done; while [ ! -e {m} ] && [ $((n+=1)) -lt 600 ]; do sleep 0.2; done",
        m = marker.display()
    );
    let mut job = Step::start_with("berthlazy", "salloc", &["-n1", "sh", "-c", &script]);
    job.wait_for("step-done", 120);
    let now = servers();
    assert_eq!(now.len(), 1, "{now:?}");
    let gc = berth_root(&["gc"]);
    assert!(gc.status.success(), "{}", stderr(&gc));
    assert!(
        stdout(&gc).contains("stopped the lazy image server of index sha256:"),
        "{}",
        stdout(&gc)
    );
    assert!(servers().is_empty(), "{:?}", servers());
    assert!(server_mounts().is_empty(), "{:#?}", server_mounts());
    std::fs::write(&marker, "").unwrap();
    job.finish(60);
}

impl Step {
    fn start_with(who: &str, cmd: &str, args: &[&str]) -> Step {
        Step::spawn(slurm_as(who, cmd, args))
    }

    fn spawn(mut command: Command) -> Step {
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        Step {
            child,
            lines,
            seen: Vec::new(),
        }
    }
}

#[test]
#[ignore = "root tier"]
fn a_lazy_image_serves_every_task_named_containers_across_steps_and_container_save() {
    let c = cluster();
    let img = format!("--container-image={}", c.image);
    let saved = c.cwd.join("lazy-saved.sqsh");
    let _ = std::fs::remove_file(&saved);
    let script = format!(
        "srun -n2 {img} cat /hello.txt\n\
         srun -n1 {img} --container-name=lz sh -c 'echo kept > /kept'\n\
         srun -n1 --container-name=lz sh -c 'cat /kept /hello.txt'\n\
         srun -n1 {img} --container-save={s} sh -c 'echo saved > /saved'\n\
         srun -n1 --container-image={s} sh -c 'cat /saved /hello.txt'\n",
        s = saved.display()
    );
    let out = slurm_as("berthlazy", "salloc", &["-n2", "sh", "-c", &script])
        .output()
        .unwrap();
    let text = stdout(&out);
    assert!(out.status.success(), "{text}\n{}", stderr(&out));
    assert_eq!(
        text,
        "lazy hello\nlazy hello\nkept\nlazy hello\nsaved\nlazy hello\n",
        "{}",
        stderr(&out)
    );
}

#[test]
#[ignore = "root tier"]
fn a_registry_that_stalls_mid_read_gives_eio_within_the_bound() {
    let c = cluster();
    let img = format!("--container-image={}", c.stall_image);
    let go = c.cwd.join("lazy-stall-go");
    let _ = std::fs::remove_file(&go);
    // Mounted and started; then the registry goes silent before the big file is read.
    let script = format!(
        "cat /hello.txt; while [ ! -e {g} ] && [ $((n+=1)) -lt 600 ]; do sleep 0.1; done; \
         s=$(date +%s); md5sum /big.bin; echo \"rc=$? took=$(( $(date +%s) - s ))\"",
        g = go.display()
    );
    let mut step = Step::start(
        "berthlazy",
        &[
            &img,
            &format!("--container-mounts={}", c.cwd.display()),
            "sh",
            "-c",
            &script,
        ],
    );
    step.wait_for("lazy hello", 120);
    c.stall.stalled.store(true, Ordering::Relaxed);
    struct Unstall<'a>(&'a AtomicBool);
    impl Drop for Unstall<'_> {
        fn drop(&mut self) {
            self.0.store(false, Ordering::Relaxed);
        }
    }
    let _unstall = Unstall(&c.stall.stalled);
    std::fs::write(&go, "").unwrap();
    let said = step.finish(120);
    let last = said.last().cloned().unwrap_or_default();
    let (rc, took) = last
        .strip_prefix("rc=")
        .and_then(|r| r.split_once(" took="))
        .unwrap_or_else(|| panic!("{said:?}"));
    assert_ne!(
        rc, "0",
        "the read succeeded with the registry stalled: {said:?}"
    );
    let took: u64 = took.parse().unwrap();
    eprintln!("the stalled read: {said:?}");
    // The kernel may ask a few chunks in turn, each failing after the deadline: bounded.
    assert!(
        took < 10 * READ_DEADLINE_S,
        "the reader waited {took} s (registry.lazy_read_deadline_s = {READ_DEADLINE_S}): {said:?}"
    );
    assert!(!said.iter().any(|l| l.starts_with(&c.big_md5)), "{said:?}");
}

#[test]
#[ignore = "root tier"]
fn a_second_index_of_the_same_blob_does_not_change_what_a_running_container_reads() {
    use berth::image::lazy;
    let c = cluster();
    // Another index of t/lazy:1's squashfs blob, one chunk in the middle of big.bin claimed to
    // be other bytes: published by anyone who may push to the repository, as t/lazy:evil.
    let mut file = std::fs::File::open(&c.sqsh).unwrap();
    let mut index = lazy::Index::of(&mut file, lazy::DEFAULT_CHUNK).unwrap();
    let k = index.chunks.len() / 2;
    index.chunks[k] = harness::sha256(b"someone else's bytes")
        .trim_start_matches("sha256:")
        .to_string();
    let up = harness::Uploader::new(&c.registry, None);
    let index_json = serde_json::to_vec(&index).unwrap();
    let index_digest = up.blob("t/lazy", &index_json);
    let empty = up.blob("t/lazy", b"{}");
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "artifactType": lazy::ARTIFACT_TYPE,
        "config": {"mediaType": "application/vnd.oci.empty.v1+json", "digest": empty, "size": 2},
        "layers": [
            {"mediaType": lazy::SQUASHFS_TYPE, "digest": index.blob, "size": index.size},
            {"mediaType": lazy::INDEX_TYPE, "digest": index_digest, "size": index_json.len()},
        ],
    });
    up.manifest(
        "t/lazy",
        "evil",
        "application/vnd.oci.image.manifest.v1+json",
        &serde_json::to_vec(&manifest).unwrap(),
    );

    // A runs t/lazy:1 and reads the whole of big.bin only after the other index was served.
    let go = c.cwd.join("lazy-evil-go");
    let _ = std::fs::remove_file(&go);
    let mounts = format!("--container-mounts={}", c.cwd.display());
    let script = format!(
        "cat /hello.txt; while [ ! -e {g} ] && [ $((n+=1)) -lt 600 ]; do sleep 0.2; done; \
         md5sum /big.bin",
        g = go.display()
    );
    let img = format!("--container-image={}", c.image);
    let mut a = Step::start("berthlazy", &[&img, &mounts, "sh", "-c", &script]);
    a.wait_for("lazy hello", 120);
    let evil = format!(
        "--container-image={}",
        c.image.strip_suffix(":1").unwrap().to_string() + ":evil"
    );
    let b = slurm_as(
        "berthlazy2",
        "srun",
        &[&evil, "sh", "-c", "cat /hello.txt; md5sum /big.bin"],
    )
    .output()
    .unwrap();
    // The other index's own server and cache: its claim about chunk k reaches no one, its
    // reader included (the registry's bytes do not match it).
    assert_eq!(stdout(&b), "lazy hello\n", "{}", stderr(&b));
    assert!(!b.status.success());
    let now = servers();
    let ps = |pids: &[u32]| {
        let list: Vec<String> = pids.iter().map(u32::to_string).collect();
        stdout(
            &Command::new("ps")
                .args(["-o", "pid,ppid,lstart,args", "-p", &list.join(",")])
                .output()
                .unwrap(),
        )
    };
    assert_eq!(now.len(), 1, "{}", ps(&now));
    std::fs::write(&go, "").unwrap();
    let said = a.finish(120);
    assert!(
        said.iter().any(|l| l.starts_with(&c.big_md5)),
        "A's read changed after another index of its blob was served: {said:?}"
    );
}

/// Puts the cluster's berth configuration back when dropped.
struct ConfigBack;

impl Drop for ConfigBack {
    fn drop(&mut self) {
        let c = cluster();
        std::fs::write(&c.berth_config, &c.config_on).unwrap();
    }
}

#[test]
#[ignore = "root tier"]
fn a_plain_reference_runs_lazily_where_the_site_says_and_its_lazy_form_is_published() {
    let c = cluster();
    let img = format!("--container-image={}", c.auto_image);
    // registry.lazy_tag_suffix = "-lazy": t/auto:1-lazy is a lazy image, so the step (and the
    // job's Prolog before it) runs that, served by the node's server of it.
    let go = c.cwd.join("lazy-auto-go");
    let _ = std::fs::remove_file(&go);
    let script = format!(
        "cat /form; echo up; while [ ! -e {g} ] && [ $((n+=1)) -lt 600 ]; do sleep 0.2; done",
        g = go.display()
    );
    let mounts = format!("--container-mounts={}", c.cwd.display());
    let mut on = Step::start("berthlazy", &[&img, &mounts, "sh", "-c", &script]);
    on.wait_for("up", 120);
    assert!(
        on.seen.iter().any(|l| l == "lazy"),
        "the step did not run the lazy form: {:?}",
        on.seen
    );
    let served = servers_of("t/auto:1-lazy");
    assert_eq!(served.len(), 1, "no server of t/auto:1-lazy: {served:?}");
    std::fs::write(&go, "").unwrap();
    on.finish(60);
    let run = |c: &Cluster| {
        berth_root(&[
            "run",
            "--image",
            &c.auto_image,
            "--",
            "/bin/busybox",
            "cat",
            "/form",
        ])
    };
    let lazily = run(c);
    assert_eq!(stdout(&lazily), "lazy\n", "berth run: {}", stderr(&lazily));

    // The option off: the same reference is imported whole, as before.
    let _back = ConfigBack;
    std::fs::write(&c.berth_config, &c.config_off).unwrap();
    let off = slurm_as("berthlazy", "srun", &[&img, "/bin/busybox", "cat", "/form"])
        .output()
        .unwrap();
    assert_eq!(stdout(&off), "full\n", "{}", stderr(&off));
    let whole = run(c);
    assert_eq!(stdout(&whole), "full\n", "berth run: {}", stderr(&whole));
    let images = berth_root(&["images", "ls"]);
    assert!(
        stdout(&images).contains("t/auto:1"),
        "not imported: {}",
        stdout(&images)
    );
}

/// The chunks (of `chunk` bytes) of `sqsh` that hold the bytes of `file`, stored whole and
/// uncompressed there.
fn chunks_of(sqsh: &Path, file: &Path, chunk: u64) -> std::ops::RangeInclusive<u64> {
    let image = std::fs::read(sqsh).unwrap();
    let want = std::fs::read(file).unwrap();
    let at = image
        .windows(4096)
        .position(|w| w == &want[..4096])
        .expect("the file's bytes in the squashfs (made with -noD)");
    assert_eq!(
        &image[at..at + want.len()],
        &want[..],
        "stored in one piece"
    );
    let (first, last) = (at as u64, (at + want.len() - 1) as u64);
    first / chunk..=last / chunk
}

#[test]
#[ignore = "root tier"]
fn the_prolog_fetches_what_the_entrypoint_reads_and_far_fewer_than_all_chunks() {
    use berth::image::lazy;
    let c = cluster();
    // The cache of t/pre:1's index, fresh: no step of this image ran before.
    let mut file = std::fs::File::open(&c.pre_sqsh).unwrap();
    let index = lazy::Index::of(&mut file, lazy::DEFAULT_CHUNK).unwrap();
    let hex = harness::sha256(&serde_json::to_vec(&index).unwrap())
        .trim_start_matches("sha256:")
        .to_string();
    let map = c.store.join("lazy").join(lazy::cache_names(&hex).1);
    assert!(!map.exists(), "{} used before this test", map.display());
    // The image's command is the shell (no Entrypoint or Cmd): busybox, behind /bin/sh.
    let busybox = rootfs().join("bin/busybox");
    let wanted = chunks_of(&c.pre_sqsh, &busybox, lazy::DEFAULT_CHUNK);

    // An allocation whose Prolog (PrologFlags=Alloc) pre-imports the image; no step runs.
    let marker = c.cwd.join("lazy-prefetch-go");
    let _ = std::fs::remove_file(&marker);
    let script = format!(
        "echo allocated; while [ ! -e {m} ] && [ $((n+=1)) -lt 600 ]; do sleep 0.2; done",
        m = marker.display()
    );
    let img = format!("--container-image={}", c.pre_image);
    let mut job = Step::start_with("berthlazy", "salloc", &[&img, "-n1", "sh", "-c", &script]);
    job.wait_for("allocated", 120);
    let marks = || std::fs::read(&map).unwrap_or_default();
    let has = |m: &[u8], i: u64| m.get(usize::try_from(i).unwrap()) == Some(&1);
    let until = Instant::now() + Duration::from_secs(60);
    while !wanted.clone().all(|i| has(&marks(), i)) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(200));
    }
    // The Prolog has ended once its server is up and the reads are in: let it settle.
    std::thread::sleep(Duration::from_secs(2));
    let m = marks();
    let cached: Vec<u64> = (0..m.len() as u64).filter(|i| has(&m, *i)).collect();
    std::fs::write(&marker, "").unwrap();
    job.finish(60);
    eprintln!(
        "after the Prolog: {} of {} chunks cached, busybox's {wanted:?}: {cached:?}",
        cached.len(),
        m.len()
    );
    assert_eq!(m.len(), index.chunks.len(), "{}", map.display());
    assert!(
        wanted.clone().all(|i| has(&m, i)),
        "the entrypoint's chunks {wanted:?} are not all cached after the Prolog: {cached:?}"
    );
    assert!(
        cached.len() * 8 <= m.len(),
        "the Prolog fetched {} of {} chunks: not a bounded prefetch",
        cached.len(),
        m.len()
    );
}

/// Where the two-slurmd cluster keeps its state.
fn two_node_state() -> PathBuf {
    PathBuf::from(format!("{}-2nodes", state_path().display()))
}

/// A second cluster, of two slurmd on this host (start.sh --nodes 2), with a berth
/// configuration of its own (the first cluster's, its own state, store, mounts and cgroup), for
/// `-N2` steps; started on first use, stopped at exit. Its slurm.conf and berth.toml.
fn two_nodes() -> &'static (PathBuf, PathBuf) {
    static TWO: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    TWO.get_or_init(|| {
        let c = cluster();
        let state = two_node_state();
        let one = format!("{}/", state_path().display());
        // start.sh gives each slurmd a mount namespace binding a state directory of its own
        // over runtime.state_dir, as hosts of their own have: the image mounts go there too
        // (hosts do not share their squashfs.mount_dir either).
        let config = c
            .config_on
            .replace(
                &format!("{one}berth/images"),
                &format!("{}/berth/state/images", state.display()),
            )
            .replace(&one, &format!("{}/", state.display()))
            .replace("-lazy-slurm\"", "-lazy-slurm-2\"");
        let berth_config = PathBuf::from(format!("{}.toml", state.display()));
        std::fs::write(&berth_config, config).unwrap();
        extern "C" fn stop_two() {
            let _ = Command::new("bash")
                .arg(repo().join("integration/slurm/stop.sh"))
                .arg("--state")
                .arg(two_node_state())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
        // SAFETY: registering a plain function to run at process exit.
        unsafe { libc::atexit(stop_two) };
        let plugin = std::env::var_os("BERTH_TEST_PLUGIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| Path::new(BERTH).parent().unwrap().join("libspank_berth.so"));
        // slurmctld's port and one per slurmd, consecutive.
        let port = (0..50)
            .map(|_| free_port_pair())
            .find(|p| std::net::TcpListener::bind(("0.0.0.0", p + 2)).is_ok())
            .expect("three consecutive free ports");
        let out = Command::new("bash")
            .arg(repo().join("integration/slurm/start.sh"))
            .arg("--state")
            .arg(&state)
            .args(["--nodes", "2"])
            .arg("--plugin")
            .arg(&plugin)
            .arg("--berth")
            .arg(berth_bin())
            .arg("--berth-config")
            .arg(&berth_config)
            .env("BERTH_SLURM_PORT", port.to_string())
            .stdin(Stdio::null())
            .output()
            .expect("running integration/slurm/start.sh --nodes 2");
        assert!(
            out.status.success(),
            "integration/slurm/start.sh --nodes 2 failed:\n{}{}",
            stdout(&out),
            stderr(&out)
        );
        (state.join("etc/slurm.conf"), berth_config)
    })
}

/// The live lazy image servers started with the berth configuration `config`: pid and
/// reference.
fn servers_with(config: &Path) -> Vec<(u32, String)> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let words: Vec<String> = cmd
            .split(|b| *b == 0)
            .filter(|w| !w.is_empty())
            .map(|w| String::from_utf8_lossy(w).into_owned())
            .collect();
        if words.windows(2).any(|w| w[0] == "lazy" && w[1] == "serve")
            && words.iter().any(|w| Path::new(w) == config)
        {
            found.push((pid, words.last().cloned().unwrap_or_default()));
        }
    }
    found
}

#[test]
#[ignore = "root tier"]
fn a_lazy_image_runs_on_two_slurmd_by_lazy_ref_and_by_the_site_option() {
    let c = cluster();
    let (conf, berth_config) = two_nodes();
    // Each task says its node and what it read, then holds the step (the job's Epilog would
    // stop the servers) until the servers are looked at.
    let run = |image: &str, what: &str, go: &Path| {
        let _ = std::fs::remove_file(go);
        let script = format!(
            "echo $SLURMD_NODENAME {what}; while [ ! -e {g} ] && [ $((n+=1)) -lt 600 ]; do \
             sleep 0.2; done",
            g = go.display()
        );
        let mut cmd = slurm_as(
            "berthlazy",
            "srun",
            &[
                "-N2",
                "-n2",
                &format!("--container-image={image}"),
                &format!("--container-mounts={}", c.cwd.display()),
                "sh",
                "-c",
                &script,
            ],
        );
        cmd.env("SLURM_CONF", conf);
        let mut step = Step::spawn(cmd);
        let until = Instant::now() + Duration::from_secs(120);
        while step.seen.len() < 2 {
            let left = until.saturating_duration_since(Instant::now());
            match step.lines.recv_timeout(left) {
                Ok(l) => step.seen.push(l),
                Err(_) => panic!("two tasks did not start: {:?}", step.seen),
            }
        }
        let mut lines = step.seen.clone();
        lines.sort();
        (step, lines)
    };
    let nodes_of = |lines: &[String]| {
        lines
            .iter()
            .filter_map(|l| l.split(' ').next().map(str::to_string))
            .collect::<std::collections::BTreeSet<String>>()
    };
    let ns = |pid: u32| std::fs::read_link(format!("/proc/{pid}/ns/mnt")).unwrap();

    // Every task reads the image, on each node.
    let go = c.cwd.join("lazy-two-go");
    let lazy = format!("lazy:docker://{}/t/lazy:1", c.registry);
    let (step, lines) = run(&lazy, "$(cat /hello.txt) $(md5sum /big.bin)", &go);
    assert_eq!(nodes_of(&lines).len(), 2, "not on two nodes: {lines:?}");
    for l in &lines {
        assert!(
            l.contains("lazy hello") && l.contains(&c.big_md5),
            "a task read the image wrong: {lines:?}"
        );
    }
    // Each node's own server (started by its Prolog, in its slurmd's mount namespace).
    let served: Vec<(u32, String)> = servers_with(berth_config)
        .into_iter()
        .filter(|(_, r)| r.ends_with("t/lazy:1"))
        .collect();
    assert_eq!(served.len(), 2, "{served:?}");
    assert_ne!(ns(served[0].0), ns(served[1].0), "{served:?}");
    std::fs::write(&go, "").unwrap();
    step.finish(60);

    // The site option: the plain reference runs lazily on both nodes, each node's server.
    let (step, lines) = run(&c.auto_image, "$(cat /form)", &go);
    assert_eq!(nodes_of(&lines).len(), 2, "not on two nodes: {lines:?}");
    assert!(lines.iter().all(|l| l.ends_with(" lazy")), "{lines:?}");
    let served: Vec<(u32, String)> = servers_with(berth_config)
        .into_iter()
        .filter(|(_, r)| r.ends_with("t/auto:1-lazy"))
        .collect();
    assert_eq!(served.len(), 2, "{served:?}");
    assert_ne!(ns(served[0].0), ns(served[1].0), "{served:?}");
    std::fs::write(&go, "").unwrap();
    step.finish(60);
}

#[test]
#[ignore = "root tier"]
fn a_killed_server_gives_its_containers_eio_and_the_next_container_a_new_server() {
    let c = cluster();
    let img = format!("--container-image={}", c.restart_image);
    let go = c.cwd.join("lazy-restart-go");
    let _ = std::fs::remove_file(&go);
    // A container of the image, started; it reads its big file only after its server died.
    let script = format!(
        "cat /form; while [ ! -e {g} ] && [ $((n+=1)) -lt 600 ]; do sleep 0.2; done; \
         md5sum /zz-noise.bin 2>&1; echo rc=$?",
        g = go.display()
    );
    let mounts = format!("--container-mounts={}", c.cwd.display());
    let mut step = Step::start("berthlazy", &[&img, &mounts, "sh", "-c", &script]);
    step.wait_for("pre", 120);
    let served = servers_of("t/restart:1");
    assert_eq!(served.len(), 1, "{served:?}");
    // The server dies (SIGKILL, as the OOM killer does).
    // SAFETY: kill(2) of the server this test's step started.
    unsafe { libc::kill(i32::try_from(served[0]).unwrap(), libc::SIGKILL) };
    eventually(10, "the killed server to be gone", || {
        servers_of("t/restart:1").is_empty()
    });
    std::fs::write(&go, "").unwrap();
    let start = Instant::now();
    let said = step.finish(120);
    eprintln!("the container's read after its server died: {said:?}");
    assert!(
        start.elapsed() < Duration::from_secs(60),
        "the read hung: {said:?}"
    );
    assert!(
        said.iter().any(|l| l.contains("Input/output error")),
        "no EIO: {said:?}"
    );
    assert_ne!(said.last().map(String::as_str), Some("rc=0"), "{said:?}");
    assert!(!said.iter().any(|l| l.starts_with(&c.pre_md5)), "{said:?}");

    // The next container of the image starts a new server and reads it whole.
    let out = slurm_as("berthlazy", "srun", &[&img, "md5sum", "/zz-noise.bin"])
        .output()
        .unwrap();
    assert!(
        stdout(&out).starts_with(&c.pre_md5),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
}
