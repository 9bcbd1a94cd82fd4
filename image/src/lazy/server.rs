//! The node's lazy image servers: one root process per lazy image (keyed by the sha256 of its
//! verified index) per node, `berth lazy serve`, which holds the image's FUSE file and its
//! squashfs loop mount at `<squashfs.mount_dir>/lazy/<index hex>/root` for every container of
//! that image on the node: `berth create` and Slurm steps, whose containers outlive the berth
//! process that made them (`berth run` keeps its own mount in its own process, super::LazyMount).
//!
//! A container's berth first fetches the image's manifest and index with its user's credentials
//! ([`attach`]): a user reaches only images they may pull, and a container is given the server
//! of exactly the index its user fetched. Under `<runtime.state_dir>/lazy/` (root's, 0700), per
//! index `<hex>`:
//! - `<hex>.lock`: held exclusively while a server is started or stopped;
//! - `<hex>.use`: a shared lock per container using the server, taken before the container is
//!   made and inherited by its init (which never execs), so it lasts exactly as long as the
//!   container; `berth gc` stops a server only when it can lock this exclusively;
//! - `<hex>.pid`: the server's pid, exclusively locked by the server for its whole life (a
//!   lock that can be taken means the server is gone, whatever the file says);
//! - `<hex>.log`: the server's stderr.
//!
//! The server is started detached: forked twice (its parent exits at once, so it is nobody's
//! child), in a session of its own, and moved into `<cgroup root>/lazy` first, out of the Slurm
//! step's cgroup (a `scancel` of the step that started it kills that cgroup). It says `ready`
//! (or its error, one line) on its stdout once the squashfs is mounted, and serves until
//! SIGTERM, when it unmounts (lazily) and exits.
//!
//! Its chunk fetches go with the credentials of the user whose container started it; every
//! other container's user fetched the same index with their own first, and every chunk is
//! verified against that index before a byte is served (super, "chunk cache"). So that user's
//! logins going bad fails the server's later fetches (EIO) for every container of the image
//! until it is started anew: what is read never changes, whether it can be read does.
//!
//! Limit: a server that dies (killed, or the node's OOM killer) cannot be replaced under the
//! containers that use it: their squashfs reads from its FUSE connection, which ends with it
//! (no FUSE_DEV_IOC_CLONE fd passing): what they had read stays in the page cache, anything
//! else fails with EIO. The next container of the image starts a new server (the chunk cache
//! is kept); the old mounts stay with the containers that hold them.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use nix::mount::MntFlags;
use nix::sys::signal::{SigSet, Signal};

use super::{LazyMount, Verified, lazy_err};
use crate::config::Settings;
use crate::{ImageError, RegistryRef};

/// The config file berth was started with, passed on to the servers it starts (set by the
/// command line once it read it).
pub static CONFIG_PATH: OnceLock<PathBuf> = OnceLock::new();

/// How long a starting server may take to mount its image (its first chunks come from the
/// registry, each within `registry.lazy_read_deadline_s`).
const START_TIMEOUT: Duration = Duration::from_secs(180);
/// How long `berth gc` waits for a server it asked to stop (SIGTERM), then after SIGKILL.
const STOP_WAIT: Duration = Duration::from_secs(10);

/// Where the node's servers are.
#[derive(Clone, Debug)]
pub struct Node {
    /// `<runtime.state_dir>/lazy`: the servers' locks, pid files and logs.
    pub run_dir: PathBuf,
    /// The cgroup a server moves itself into (`<cgroup root>/lazy`); `None`: it stays where it
    /// was started.
    pub cgroup: Option<PathBuf>,
}

impl Node {
    fn file(&self, hex: &str, ext: &str) -> PathBuf {
        self.run_dir.join(format!("{hex}.{ext}"))
    }
}

/// A container's use of a node's lazy image server.
#[derive(Debug)]
pub struct Attached {
    /// The squashfs's mount point: the container's overlay lower.
    pub root: PathBuf,
    /// The squashfs blob's digest.
    pub digest: String,
    /// The sha256 of the image's index, in hex (the server's key).
    pub index_hex: String,
    pub config: oci_spec::image::ImageConfiguration,
    /// The shared lock on `<hex>.use`: the container's init inherits it.
    _use: File,
}

fn io_err(what: &str, path: &Path, e: std::io::Error) -> ImageError {
    lazy_err(format!("{what} {}: {e}", path.display()))
}

/// Opens (creating) `path`, root's 0600, and locks it; `Ok(None)` when `wait` is false and
/// another process holds a conflicting lock.
fn lock(path: &Path, exclusive: bool, wait: bool) -> Result<Option<File>, ImageError> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| io_err("opening", path, e))?;
    let got = match (exclusive, wait) {
        (true, true) => file.lock().map(|()| true),
        (false, true) => file.lock_shared().map(|()| true),
        (true, false) => try_lock(file.try_lock()),
        (false, false) => try_lock(file.try_lock_shared()),
    }
    .map_err(|e| io_err("locking", path, e))?;
    Ok(got.then_some(file))
}

fn try_lock(r: Result<(), std::fs::TryLockError>) -> std::io::Result<bool> {
    match r {
        Ok(()) => Ok(true),
        Err(std::fs::TryLockError::WouldBlock) => Ok(false),
        Err(std::fs::TryLockError::Error(e)) => Err(e),
    }
}

fn run_dir(node: &Node) -> Result<(), ImageError> {
    berth_sys::privfs::root_dir(&node.run_dir, 0o700)
        .map(drop)
        .map_err(|e| lazy_err(e.to_string()))
}

/// The mount directory of the server of `hex`.
fn mount_dir(config: &Settings<'_>, hex: &str) -> PathBuf {
    config.squashfs.mount_dir.join("lazy").join(hex)
}

/// Whether `dir` is a mount point (another device than its parent's).
fn is_mount(dir: &Path) -> bool {
    let (Ok(d), Some(Ok(p))) = (
        std::fs::symlink_metadata(dir),
        dir.parent().map(std::fs::symlink_metadata),
    ) else {
        return false;
    };
    d.dev() != p.dev()
}

/// Detaches what a gone server left at `dir` (`root`, then `fuse`) and removes the directories.
fn clear_mounts(dir: &Path) {
    for sub in ["root", "fuse"] {
        let _ = nix::mount::umount2(&dir.join(sub), MntFlags::MNT_DETACH);
        let _ = std::fs::remove_dir(dir.join(sub));
    }
    let _ = std::fs::remove_dir(dir);
}

/// Whether the server of `hex` is alive (holds its pid file's lock).
fn alive(node: &Node, hex: &str) -> Result<bool, ImageError> {
    Ok(lock(&node.file(hex, "pid"), true, false)?.is_none())
}

/// Gives a container of the lazy image `reference` (`docker://…`, parsed as `r`) of the user
/// `uid` (home `home`) the node's server of that image, starting it when none runs: see the
/// module header.
pub fn attach(
    reference: &str,
    r: &RegistryRef,
    config: &Settings<'_>,
    uid: u32,
    home: Option<&Path>,
    node: &Node,
) -> Result<Attached, ImageError> {
    let v = Verified::fetch(r, config, uid, home)?;
    let hex = v.index_hex.clone();
    let image = v.image.clone();
    let digest = v.index.blob.clone();
    run_dir(node)?;
    let start = lock(&node.file(&hex, "lock"), true, true)?;
    let use_lock = lock(&node.file(&hex, "use"), false, true)?;
    let dir = mount_dir(config, &hex);
    let root = dir.join("root");
    if !alive(node, &hex)? || !is_mount(&root) {
        if alive(node, &hex)? {
            stop(node, &hex);
        }
        clear_mounts(&dir);
        spawn(reference, &hex, uid, home, node)?;
    }
    drop(start);
    let file_path = dir.join("fuse").join(super::fuse::FILE_NAME);
    let file = File::open(&file_path).map_err(|e| {
        lazy_err(format!(
            "lazy image {image}: opening {} of its server: {e}",
            file_path.display()
        ))
    })?;
    let read = berth_sys::privfs::fd_path(&file);
    let files = crate::squashfs::SquashfsFiles::open(&read, 0)?;
    let image_config = crate::squashfs::image_config(crate::synth::enroot(
        &files,
        config.squashfs.enroot_entrypoint,
    ));
    Ok(Attached {
        root,
        digest,
        index_hex: hex,
        config: image_config,
        _use: use_lock.ok_or_else(|| lazy_err("the use lock was not taken"))?,
    })
}

/// Starts `berth lazy serve` for `hex` and waits for its `ready`.
fn spawn(
    reference: &str,
    hex: &str,
    uid: u32,
    home: Option<&Path>,
    node: &Node,
) -> Result<(), ImageError> {
    use std::os::unix::fs::OpenOptionsExt;
    let exe = std::env::current_exe()
        .map_err(|e| lazy_err(format!("finding berth's own executable: {e}")))?;
    let log_path = node.file(hex, "log");
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(&log_path)
        .map_err(|e| io_err("opening", &log_path, e))?;
    let mut cmd = std::process::Command::new(&exe);
    if let Some(c) = CONFIG_PATH.get() {
        cmd.arg("--config").arg(c);
    }
    cmd.args(["lazy", "serve", "--index", hex, "--uid", &uid.to_string()]);
    if let Some(h) = home {
        cmd.arg("--home").arg(h);
    }
    cmd.arg(reference)
        .current_dir("/")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(log);
    // SAFETY: between fork and exec only async-signal-safe calls (setsid, fork, _exit): the
    // child starts a session of its own and forks again; the middle process exits at once, so
    // the server is nobody's child and outlives the process that started it.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            match libc::fork() {
                -1 => Err(std::io::Error::last_os_error()),
                0 => Ok(()),
                _ => libc::_exit(0),
            }
        });
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| lazy_err(format!("starting {} lazy serve: {e}", exe.display())))?;
    let out = child.stdout.take();
    let _ = child.wait();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        if let Some(out) = out {
            let _ = std::io::BufReader::new(out).read_line(&mut line);
        }
        let _ = tx.send(line);
    });
    let line = rx.recv_timeout(START_TIMEOUT).map_err(|_| {
        lazy_err(format!(
            "the lazy image server of index sha256:{hex} did not mount the image within {} s; \
             see {}",
            START_TIMEOUT.as_secs(),
            log_path.display()
        ))
    })?;
    match line.trim_end() {
        "ready" => Ok(()),
        "" => Err(lazy_err(format!(
            "the lazy image server of index sha256:{hex} ended before it was ready; see {}",
            log_path.display()
        ))),
        said => Err(lazy_err(said.to_string())),
    }
}

/// What `berth lazy serve` is given.
#[derive(Clone, Debug)]
pub struct ServeArgs {
    pub reference: String,
    pub index_hex: String,
    pub uid: u32,
    pub home: Option<PathBuf>,
}

/// `berth lazy serve`: mounts the lazy image for its index and serves it until SIGTERM, saying
/// `ready` or the error on stdout (the starting berth's pipe). See the module header.
pub fn serve(args: &ServeArgs, config: &Settings<'_>, node: &Node) -> Result<(), ImageError> {
    let signals = {
        let mut s = SigSet::empty();
        for sig in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP] {
            s.add(sig);
        }
        s
    };
    // Blocked before any thread starts, so every thread inherits the mask and only sigwait
    // below takes them.
    signals
        .thread_block()
        .map_err(|e| lazy_err(format!("blocking signals: {e}")))?;
    let started = start(args, config, node);
    let mut stdout = std::io::stdout();
    let said = match &started {
        Ok(_) => "ready".to_string(),
        Err(e) => e.to_string(),
    };
    let _ = writeln!(stdout, "{said}");
    let _ = stdout.flush();
    // The starting berth may be gone; nothing more is said there.
    if let Ok(null) = File::options().write(true).open("/dev/null") {
        let _ = nix::unistd::dup2_stdout(&null);
    }
    let (mount, pid_lock) = started?;
    tracing::info!(
        "serving lazy image {} (index sha256:{}) at {}",
        args.reference,
        args.index_hex,
        mount.root.display()
    );
    let sig = signals.wait();
    tracing::info!("stopping ({sig:?})");
    drop(mount);
    let _ = std::fs::remove_file(node.file(&args.index_hex, "pid"));
    drop(pid_lock);
    Ok(())
}

fn start(
    args: &ServeArgs,
    config: &Settings<'_>,
    node: &Node,
) -> Result<(LazyMount, File), ImageError> {
    let hex = &args.index_hex;
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(lazy_err(format!("--index {hex}: not a sha256 in hex")));
    }
    if let Some(cg) = &node.cgroup {
        let dir = cg.join("lazy");
        let procs = dir.join("cgroup.procs");
        std::fs::create_dir_all(&dir)
            .and_then(|()| std::fs::write(&procs, std::process::id().to_string()))
            .map_err(|e| {
                lazy_err(format!(
                    "lazy image server: moving into {}: {e} (a server left in the Slurm step's \
                     cgroup would end with that step)",
                    dir.display()
                ))
            })?;
    }
    run_dir(node)?;
    let pid_path = node.file(hex, "pid");
    let mut pid_lock = lock(&pid_path, true, false)?.ok_or_else(|| {
        lazy_err(format!(
            "a lazy image server of index sha256:{hex} already runs ({})",
            pid_path.display()
        ))
    })?;
    pid_lock
        .set_len(0)
        .and_then(|()| writeln!(pid_lock, "{}", std::process::id()))
        .map_err(|e| io_err("writing", &pid_path, e))?;
    let r = match crate::reference::parse(&args.reference)? {
        crate::Reference::Registry(r) => r,
        _ => {
            return Err(lazy_err(format!(
                "lazy image {}: not a registry image",
                args.reference
            )));
        }
    };
    let v = Verified::fetch(&r, config, args.uid, args.home.as_deref())?;
    if v.index_hex != *hex {
        return Err(lazy_err(format!(
            "lazy image {}: its tag now names index sha256:{}, not sha256:{hex} (published \
             again meanwhile): start the container again",
            v.image, v.index_hex
        )));
    }
    clear_mounts(&mount_dir(config, hex));
    let mount = LazyMount::open_at(v, config, hex)?;
    Ok((mount, pid_lock))
}

/// Asks the server of `hex` to stop (SIGTERM, then SIGKILL) and waits for it to be gone, each
/// for [`STOP_WAIT`]. The caller holds `<hex>.lock`.
fn stop(node: &Node, hex: &str) {
    let pid_path = node.file(hex, "pid");
    let pid = std::fs::read_to_string(&pid_path)
        .ok()
        .and_then(|t| t.trim().parse::<i32>().ok())
        .filter(|p| *p > 1);
    for sig in [Signal::SIGTERM, Signal::SIGKILL] {
        if let Some(pid) = pid {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig);
        }
        let until = Instant::now() + STOP_WAIT;
        while Instant::now() < until {
            if !alive(node, hex).unwrap_or(true) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    tracing::warn!("the lazy image server of index sha256:{hex} did not stop");
}

/// `berth gc` and the Epilog: stops every lazy image server no container uses, and clears what
/// dead ones left; returns a line per server stopped.
pub fn stop_unused(config: &Settings<'_>, node: &Node) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(&node.run_dir) else {
        return Vec::new();
    };
    let mut hexes: Vec<String> = entries
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter_map(|n| n.strip_suffix(".pid").map(str::to_string))
        .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        .collect();
    hexes.sort();
    let mut done = Vec::new();
    for hex in hexes {
        let step = || -> Result<Option<String>, ImageError> {
            // A server being started is about to be used: left alone, and the Epilog does not
            // wait for the start.
            let Some(_start) = lock(&node.file(&hex, "lock"), true, false)? else {
                return Ok(None);
            };
            let Some(_unused) = lock(&node.file(&hex, "use"), true, false)? else {
                return Ok(None);
            };
            let was_alive = alive(node, &hex)?;
            if was_alive {
                stop(node, &hex);
            }
            clear_mounts(&mount_dir(config, &hex));
            let _ = std::fs::remove_file(node.file(&hex, "pid"));
            Ok(was_alive.then(|| format!("stopped the lazy image server of index sha256:{hex}")))
        };
        match step() {
            Ok(Some(line)) => done.push(line),
            Ok(None) => {}
            Err(e) => tracing::warn!("{e}"),
        }
    }
    if let Some(cg) = &node.cgroup {
        remove_cgroup(&cg.join("lazy"), !done.is_empty());
    }
    done
}

/// Removes the servers' cgroup once none runs there, so that no empty cgroup is left beside
/// the containers'. A server just stopped may still be exiting in it (EBUSY): waited for a
/// little; one that serves keeps it.
fn remove_cgroup(dir: &Path, stopped_any: bool) {
    for _ in 0..40 {
        match std::fs::remove_dir(dir) {
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && stopped_any => {
                std::thread::sleep(Duration::from_millis(50));
            }
            _ => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_lock_is_seen_and_a_dropped_one_is_free() {
        let tmp = tempfile::tempdir().unwrap();
        let node = Node {
            run_dir: tmp.path().to_path_buf(),
            cgroup: None,
        };
        let hex = "a".repeat(64);
        assert!(!alive(&node, &hex).unwrap());
        // Open file descriptions of their own: flock conflicts between them as between
        // processes.
        let held = lock(&node.file(&hex, "pid"), true, false).unwrap();
        assert!(held.is_some());
        assert!(alive(&node, &hex).unwrap());
        drop(held);
        assert!(!alive(&node, &hex).unwrap());
        // A container's shared use keeps gc's exclusive try from succeeding.
        let using = lock(&node.file(&hex, "use"), false, true).unwrap();
        assert!(
            lock(&node.file(&hex, "use"), true, false)
                .unwrap()
                .is_none()
        );
        drop(using);
        assert!(
            lock(&node.file(&hex, "use"), true, false)
                .unwrap()
                .is_some()
        );
    }

    #[test]
    fn gc_clears_what_a_dead_server_left_and_keeps_a_used_one() {
        let tmp = tempfile::tempdir().unwrap();
        let node = Node {
            run_dir: tmp.path().join("run"),
            cgroup: None,
        };
        std::fs::create_dir(&node.run_dir).unwrap();
        let (dead, used) = ("b".repeat(64), "c".repeat(64));
        for h in [&dead, &used] {
            std::fs::write(node.file(h, "pid"), "4194305\n").unwrap();
        }
        let _using = lock(&node.file(&used, "use"), false, true).unwrap();
        let registry = crate::config::RegistryConfig::default();
        let store = crate::config::StoreConfig::default();
        let squashfs = crate::config::SquashfsConfig {
            mount_dir: tmp.path().join("mnt"),
            ..Default::default()
        };
        let config = Settings {
            registry: &registry,
            store: &store,
            squashfs: &squashfs,
        };
        std::fs::create_dir_all(mount_dir(&config, &dead).join("root")).unwrap();
        // Neither ran: nothing is said stopped, the dead one's files go, the used one's stay.
        assert!(stop_unused(&config, &node).is_empty());
        assert!(!node.file(&dead, "pid").exists());
        assert!(!mount_dir(&config, &dead).exists());
        assert!(node.file(&used, "pid").exists());
    }
}
