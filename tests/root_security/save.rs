//! Security tests: saving a container (`berth export ID`, `--container-save` at a step's end)
//! reads the container and nothing else. The attacker's process in the container swaps a file
//! for a symlink to a host file (or for a FIFO) while root saves; the saved image must never hold
//! the host file, and a save must end within its deadline.

#[allow(unused_imports)]
use super::*;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A host file only root may read (0600), with a text no image holds.
fn host_secret(dir: &Path) -> (PathBuf, String) {
    let secret = dir.join("secret");
    let text = format!(
        "host-secret-{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    std::fs::write(&secret, &text).unwrap();
    chmod(&secret, 0o600);
    (secret, text)
}

/// The tier's config with uncompressed saves (so the output can be searched for the secret) and
/// a short save deadline, if given.
fn save_config(dir: &Path, timeout_s: Option<u64>) -> PathBuf {
    let deadline = timeout_s.map_or(String::new(), |t| format!("export_timeout_s = {t}\n"));
    let text = std::fs::read_to_string(config()).unwrap().replace(
        "[squashfs]\n",
        &format!("[squashfs]\ncompression = \"none\"\n{deadline}"),
    );
    let path = dir.join("berth.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// A running container of the attacker's, stopped (SIGTERM, as Slurm ends a step) on drop.
struct Running {
    berth: Child,
    id: String,
    /// A host pid of the attacker's process in the container.
    pid: u32,
}

impl Drop for Running {
    fn drop(&mut self) {
        // SAFETY: signalling the berth run this test started and has not reaped.
        unsafe { libc::kill(i32::try_from(self.berth.id()).unwrap(), libc::SIGTERM) };
        let _ = self.berth.wait();
    }
}

fn state_ids() -> Vec<String> {
    std::fs::read_dir(state_dir())
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().into_string().unwrap())
                .collect()
        })
        .unwrap_or_default()
}

fn uid_of(pid: &str) -> Option<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
}

/// `berth run` as root of the busybox rootfs for the attacker (`extra` flags), running `script`
/// and then sleeping; returns once the script has written /w/ready.
fn start(cfg: &Path, extra: &[&str], script: &str) -> Running {
    let before = state_ids();
    let uid = attacker().0.to_string();
    let mut args = vec![
        "run",
        "--rootfs",
        rootfs().to_str().unwrap(),
        "--user",
        &uid,
    ];
    args.extend_from_slice(extra);
    let script = format!("{script}\necho ok > /w/ready; exec sleep 600");
    args.extend_from_slice(&["--", "sh", "-c", &script]);
    let berth = Command::new(berth_bin())
        .arg("--config")
        .arg(cfg)
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut running = Running {
        berth,
        id: String::new(),
        pid: 0,
    };
    let start = Instant::now();
    loop {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the container did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
        let Some(id) = state_ids().into_iter().find(|n| !before.contains(n)) else {
            continue;
        };
        let Ok(record) = std::fs::read(state_dir().join(&id).join("state.json")) else {
            continue;
        };
        let record: serde_json::Value = serde_json::from_slice(&record).unwrap();
        let procs = Path::new(record["cgroup"].as_str().unwrap()).join("cgroup.procs");
        let procs = std::fs::read_to_string(procs).unwrap_or_default();
        // The attacker's command (host uid; a remapped container's root is the attacker), not
        // berth's init, which the attacker may not inspect.
        let Some(pid) = procs
            .lines()
            .find(|p| {
                uid_of(p) == Some(attacker().0)
                    && std::fs::read_to_string(format!("/proc/{p}/comm"))
                        .is_ok_and(|c| c.trim() == "sleep")
            })
            .and_then(|p| p.parse().ok())
        else {
            continue;
        };
        if std::fs::metadata(format!("/proc/{pid}/root/w/ready")).is_ok() {
            running.id = id;
            running.pid = pid;
            return running;
        }
    }
}

fn export(cfg: &Path, id: &str, out: &Path) -> Output {
    Command::new(berth_bin())
        .arg("--config")
        .arg(cfg)
        .args(["export", "-f", id, "-o"])
        .arg(out)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// Whether `needle` occurs in the file at `path`.
fn holds(path: &Path, needle: &str) -> bool {
    let bytes = std::fs::read(path).unwrap_or_default();
    bytes.windows(needle.len()).any(|w| w == needle.as_bytes())
}

/// TRIES saves while the attacker's process in the container swaps /w/f between a file and a
/// symlink to the host secret: none may hold the secret, and the saves must work.
fn no_save_reads_the_host(name: &str, extra: &[&str]) {
    let dir = workdir(name);
    let (secret, text) = host_secret(&dir);
    let cfg = save_config(&dir, None);
    // As long as the secret: mksquashfs reads as many bytes as its scan saw. rename(2) swaps
    // the name atomically, so /w/f is always one or the other.
    let decoy = "d".repeat(text.len());
    let secret = secret.display();
    let running = start(
        &cfg,
        extra,
        &format!(
            // /a, read before /w/f, puts time between mksquashfs's scan and its read of /w/f.
            "mkdir -p /w && printf %s {decoy} > /w/f\n\
             head -c 4000000 /dev/urandom > /a\n\
             (while :; do ln -s {secret} /w/t; mv -f /w/t /w/f; \
                printf %s {decoy} > /w/u; mv -f /w/u /w/f; done) &"
        ),
    );
    let out = dir.join("saved.sqsh");
    let (mut wins, mut saved) = (0, 0);
    let mut last_error = String::new();
    for _ in 0..TRIES {
        let o = export(&cfg, &running.id, &out);
        if o.status.success() {
            saved += 1;
            if holds(&out, &text) {
                wins += 1;
            }
        } else {
            last_error = stderr(&o);
        }
        let _ = std::fs::remove_file(&out);
    }
    assert_eq!(
        wins, 0,
        "{wins} of {TRIES} saves held the host file {secret} (extra flags {extra:?})"
    );
    assert!(
        saved > TRIES / 2,
        "only {saved} of {TRIES} saves worked; last error: {last_error}"
    );
    drop(running);
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_save_never_reads_a_host_file_through_a_swapped_symlink() {
    no_save_reads_the_host("save-symlink", &[]);
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_remapped_save_never_reads_a_host_file_through_a_swapped_symlink() {
    no_save_reads_the_host("save-symlink-remap", &["--remap-root"]);
}

#[test]
#[ignore = "root tier: run by integration/test.sh"]
fn a_fifo_swapped_in_cannot_hold_a_save_past_its_deadline() {
    let dir = workdir("save-fifo");
    let timeout_s = 3;
    let cfg = save_config(&dir, Some(timeout_s));
    let running = start(&cfg, &[], "mkdir -p /w && echo decoy > /w/f && mkfifo /w/p");
    let root = format!("/proc/{}/root/w", running.pid);
    let swap = swapper(&Path::new(&root).join("f"), &Path::new(&root).join("p"));
    let out = dir.join("saved.sqsh");
    let (mut stopped, mut saved) = (0, 0);
    // Each save ends by its deadline; on a hang the test gives up after a bound of its own.
    let bound = Duration::from_secs(timeout_s + 30);
    for _ in 0..30 {
        let mut child = Command::new(berth_bin())
            .arg("--config")
            .arg(&cfg)
            .args(["export", "-f", &running.id, "-o"])
            .arg(&out)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let start = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if start.elapsed() > bound {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "a save hung for {} s on a FIFO swapped in for a file",
                    bound.as_secs()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut err = String::new();
        let _ = std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err);
        if status.success() {
            saved += 1;
        } else {
            assert!(
                err.contains("took longer than") && err.trim().lines().count() == 1,
                "a failed save says why in one line: {err}"
            );
            stopped += 1;
        }
        let _ = std::fs::remove_file(&out);
        if stopped >= 2 {
            break;
        }
    }
    drop(swap);
    // Nothing half-written is left next to the target.
    let left: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(left.is_empty(), "temporary files left: {left:?}");
    assert!(
        stopped + saved > 0,
        "no save finished ({stopped} stopped, {saved} saved)"
    );
    // The container is untouched by the stopped saves.
    std::fs::metadata(format!("/proc/{}/root/w", running.pid))
        .expect("the container still runs after the stopped saves");
    drop(running);
}
