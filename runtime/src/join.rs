//! Runs a command inside a held container: joins its namespaces and cgroup, becomes the
//! container's user, and execs — what `berth exec` and the Slurm tasks of a step do.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, Instant};

use nix::fcntl::{OFlag, open};
use nix::sched::{CloneFlags, setns};
use nix::sys::signal::{SigSet, SigmaskHow, sigprocmask};
use nix::sys::signal::{Signal, kill};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::stat::Mode;
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};

use super::{
    Exit, MaskGuard, Options, RuntimeError, SetupError, clone, exec, forwarded_signals, init,
    moveroot, report, state, sys, wait,
};
use berth_cgroup::Cgroup;

/// Namespaces a joining process enters, in order, with the flag setns needs. The PID
/// namespace comes first: it only applies to children, which is what runs the command. The user
/// namespace (of a remapped container) comes last: joining it ends the host's privileges that
/// the other joins need.
const NAMESPACES: [(&str, CloneFlags); 7] = [
    ("pid", CloneFlags::CLONE_NEWPID),
    ("mnt", CloneFlags::CLONE_NEWNS),
    ("cgroup", CloneFlags::CLONE_NEWCGROUP),
    ("ipc", CloneFlags::CLONE_NEWIPC),
    ("uts", CloneFlags::CLONE_NEWUTS),
    ("net", CloneFlags::CLONE_NEWNET),
    ("user", CloneFlags::CLONE_NEWUSER),
];

/// The namespaces of a held container that differ from this process's, as (name, path) — what a
/// joining process must enter (a shared network namespace is not re-entered).
pub fn namespaces_to_join(init_pid: i32) -> BTreeMap<String, String> {
    let ino = |path: &str| {
        std::fs::metadata(path)
            .ok()
            .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
    };
    NAMESPACES
        .iter()
        .filter(|(name, _)| *name != "pid")
        .filter_map(|(name, _)| {
            let theirs = format!("/proc/{init_pid}/ns/{name}");
            let ours = format!("/proc/self/ns/{name}");
            (ino(&theirs)? != ino(&ours)?).then(|| (name.to_string(), theirs))
        })
        .collect()
}

/// Finds a live held container by id.
pub fn held(
    opts: &Options,
    id: &str,
) -> Result<(state::Record, oci_spec::runtime::Spec), RuntimeError> {
    let missing = || RuntimeError::NoContainer(id.to_string());
    let (record, spec) = state::load(&opts.state_dir, id).ok_or_else(missing)?;
    let spec = spec.ok_or_else(missing)?;
    if record.init_pid <= 0 || !state::owner_alive(&record) {
        return Err(missing());
    }
    Ok((record, spec))
}

/// A process started in a held container.
struct Spawned {
    pid: nix::unistd::Pid,
    /// Why it failed before its program ran, if it did.
    setup_error: Option<SetupError>,
    _restore: MaskGuard,
}

/// Starts `args` (with `env` added to the container's environment) in the held container `id`,
/// as the container's user; returns once the program is exec'd (or failed to be). With `output`,
/// the program's stdout and stderr go there.
fn spawn(
    opts: &Options,
    id: &str,
    args: &[String],
    env: &[(String, String)],
    output: Option<&OwnedFd>,
) -> Result<Spawned, RuntimeError> {
    let (record, spec) = held(opts, id)?;
    let process = spec
        .process()
        .as_ref()
        .ok_or(RuntimeError::Spec("no process"))?;
    let mut environment: Vec<String> = process.env().clone().unwrap_or_default();
    for (k, v) in env {
        environment.retain(|e| e.split_once('=').map(|(key, _)| key) != Some(k.as_str()));
        environment.push(format!("{k}={v}"));
    }
    let argv = init::cstrings(args, "argument").map_err(RuntimeError::Setup)?;
    let envp = init::cstrings(&environment, "environment entry").map_err(RuntimeError::Setup)?;

    let mut fds = Vec::new();
    let joined = namespaces_to_join(record.init_pid);
    for (name, flag) in NAMESPACES {
        if name != "pid" && !joined.contains_key(name) {
            continue;
        }
        let path = format!("/proc/{}/ns/{name}", record.init_pid);
        let fd = open(
            Path::new(&path),
            OFlag::O_RDONLY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(sys("opening the container's namespaces"))?;
        fds.push((fd, flag));
    }
    // Where a joining process must stand after setns: the container's root, which is not the
    // namespace's top mount when the container was moved onto an initramfs root.
    let root = open(
        Path::new(&format!("/proc/{}/root", record.init_pid)),
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(sys("opening the container's root"))?;
    // The pid was checked alive above; re-check now that the namespace fds pin the process, so
    // a pid reused in between cannot be joined.
    if !state::owner_alive(&record) {
        return Err(RuntimeError::NoContainer(id.to_string()));
    }
    let cgroup = Cgroup::at(record.cgroup.clone());
    let cg_fd = cgroup.open_fd()?;
    let (report_r, report_w) =
        nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(sys("creating a pipe"))?;
    let forwarded = forwarded_signals();
    let mut old_mask = SigSet::empty();
    sigprocmask(SigmaskHow::SIG_BLOCK, Some(&forwarded), Some(&mut old_mask))
        .map_err(sys("blocking signals"))?;
    let restore = MaskGuard(old_mask);

    let (pid_ns, rest) = fds
        .split_first()
        .ok_or(RuntimeError::Spec("no pid namespace"))?;
    setns(pid_ns.0.as_fd(), pid_ns.1).map_err(sys("joining the container's PID namespace"))?;
    let forked = clone::clone_into(0, cg_fd.as_fd()).map_err(sys("forking into the container"));
    let (pid, in_cgroup) = match forked? {
        clone::Forked::Child { .. } => {
            drop(report_r);
            if let Some(out) = output {
                for target in [1, 2] {
                    // SAFETY: dup2 onto the standard descriptors of this (child) process.
                    unsafe { libc::dup2(out.as_raw_fd(), target) };
                }
            }
            let err = enter(rest, &root, process, &argv, &envp);
            report::send(&report_w, &report::Message::Error(err.code, err.message));
            // SAFETY: _exit skips the parent's atexit handlers and stdio buffers.
            unsafe { libc::_exit(err.code) }
        }
        clone::Forked::Parent { pid, in_cgroup } => (pid, in_cgroup),
    };
    drop(report_w);
    if !in_cgroup {
        cgroup.add_process(pid.as_raw())?;
    }
    let mut setup_error = None;
    for msg in report::receive_all(report_r) {
        if let report::Received::Error(code, message) = msg {
            setup_error = Some(SetupError::with_code(code, message));
        }
    }
    Ok(Spawned {
        pid,
        setup_error,
        _restore: restore,
    })
}

/// Runs `args` (with `env` added to the container's environment) in the held container `id` and
/// returns how it ended.
pub fn exec(
    opts: &Options,
    id: &str,
    args: &[String],
    env: &[(String, String)],
) -> Result<Exit, RuntimeError> {
    let spawned = spawn(opts, id, args, env, None)?;
    let pid = spawned.pid;
    let pidfd = clone::pidfd_open(pid).map_err(sys("opening a pidfd"))?;
    let sfd = SignalFd::with_flags(
        &forwarded_signals(),
        SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK,
    )
    .map_err(sys("creating a signalfd"))?;
    let status = wait(pid, &pidfd, &sfd, None)?;
    if let Some(err) = spawned.setup_error {
        return Err(RuntimeError::Setup(err));
    }
    Ok(match status {
        Some(WaitStatus::Exited(_, code)) => Exit::Code(code),
        Some(WaitStatus::Signaled(_, sig, _)) => Exit::Signal(sig as i32),
        _ => Exit::Code(125),
    })
}

/// The most of an entrypoint's environment berth reads.
const ENVIRON_LIMIT: u64 = 16 << 20;

/// What the image's entrypoint left behind: the environment it handed to its arguments, and
/// what it printed.
#[derive(Debug)]
pub struct EntrypointRun {
    /// `None` when it ended (with status 0) without running its arguments.
    pub env: Option<Vec<String>>,
    pub output: String,
}

/// Runs the image's `entrypoint` once in the held container `id`, as Pyxis's
/// `--container-entrypoint` does: its arguments are a shell that stops itself, so whatever the
/// entrypoint set up (files, and the environment it `exec "$@"`s with) is in place, and the
/// environment is read from the stopped process before it is killed. Needs /bin/sh in the image.
pub fn run_entrypoint(
    opts: &Options,
    id: &str,
    entrypoint: &[String],
    timeout: Duration,
) -> Result<EntrypointRun, RuntimeError> {
    let mut args = entrypoint.to_vec();
    args.extend(["/bin/sh", "-c", "kill -STOP $$; exit 0"].map(String::from));
    let (out_r, out_w) = nix::unistd::pipe2(OFlag::O_CLOEXEC)
        .map_err(|e| RuntimeError::Entrypoint(format!("creating a pipe: {e}")))?;
    let spawned = spawn(opts, id, &args, &[], Some(&out_w))?;
    drop(out_w);
    // The output is collected while the entrypoint runs, so a chatty one cannot fill the pipe.
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut std::fs::File::from(out_r), &mut text);
        text
    });
    let pid = spawned.pid;
    let deadline = berth_sys::time::deadline_after(timeout);
    let outcome = loop {
        match waitpid(pid, Some(WaitPidFlag::WUNTRACED | WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Ok(WaitStatus::StillAlive) => {
                let _ = kill(pid, Signal::SIGKILL);
                let _ = waitpid(pid, None);
                break Err(RuntimeError::Entrypoint(format!(
                    "the image's entrypoint {} did not run its arguments within {} s (it must \
                     end with `exec \"$@\"`); run without --container-entrypoint",
                    entrypoint.join(" "),
                    timeout.as_secs()
                )));
            }
            Ok(WaitStatus::Stopped(..)) => {
                // Bounded: the entrypoint is the image's, its environment whatever it made.
                let environ = std::fs::File::open(format!("/proc/{pid}/environ"))
                    .and_then(|mut f| berth_sys::privfs::read_bounded(&mut f, ENVIRON_LIMIT));
                let _ = kill(pid, Signal::SIGKILL);
                let _ = waitpid(pid, None);
                break environ
                    .map(|bytes| {
                        Some(
                            bytes
                                .split(|b| *b == 0)
                                .filter(|e| !e.is_empty())
                                .map(|e| String::from_utf8_lossy(e).into_owned())
                                .collect(),
                        )
                    })
                    .map_err(|e| {
                        RuntimeError::Entrypoint(format!(
                            "reading the entrypoint's environment: {e}"
                        ))
                    });
            }
            Ok(WaitStatus::Exited(_, 0)) => break Ok(None),
            Ok(WaitStatus::Exited(_, code)) => {
                break Err(RuntimeError::Entrypoint(format!(
                    "the image's entrypoint {} exited with status {code}",
                    entrypoint.join(" ")
                )));
            }
            Ok(WaitStatus::Signaled(_, sig, _)) => {
                break Err(RuntimeError::Entrypoint(format!(
                    "the image's entrypoint {} was killed by {sig}",
                    entrypoint.join(" ")
                )));
            }
            Ok(_) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => {
                break Err(RuntimeError::Entrypoint(format!(
                    "waiting for the entrypoint: {e}"
                )));
            }
        }
    };
    // The pipe ends once the killed shell is gone, unless the entrypoint left something running
    // in the background that holds it: wait a moment, not for that.
    let grace = Instant::now() + Duration::from_millis(500);
    while !reader.is_finished() && Instant::now() < grace {
        std::thread::sleep(Duration::from_millis(2));
    }
    let output = if reader.is_finished() {
        reader.join().unwrap_or_default()
    } else {
        String::new()
    };
    if let Some(err) = spawned.setup_error {
        return Err(RuntimeError::Entrypoint(format!(
            "running the image's entrypoint: {err}"
        )));
    }
    let env = outcome.map_err(|e| {
        let tail: Vec<&str> = output.lines().rev().take(3).collect();
        if tail.is_empty() {
            e
        } else {
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            RuntimeError::Entrypoint(format!("{e}; it printed: {}", tail.join(" | ")))
        }
    })?;
    Ok(EntrypointRun { env, output })
}

/// In the forked child: enter the remaining namespaces, drop privileges, exec.
fn enter(
    namespaces: &[(OwnedFd, CloneFlags)],
    root: &OwnedFd,
    process: &oci_spec::runtime::Process,
    argv: &[std::ffi::CString],
    envp: &[std::ffi::CString],
) -> SetupError {
    for (fd, flag) in namespaces {
        if let Err(e) = setns(fd.as_fd(), *flag) {
            return SetupError::new(format!("joining the container's namespace ({flag:?}): {e}"));
        }
    }
    if let Err(e) = moveroot::enter_root(root) {
        return e;
    }
    if let Err(e) = init::drop_privileges(process) {
        return e;
    }
    // A remapped container's processes get its seccomp filter, as its command does (init.rs):
    // those that joined its user namespace as its root (not those of a container whose user
    // namespace maps the user to themselves).
    if namespaces
        .iter()
        .any(|(_, f)| *f == CloneFlags::CLONE_NEWUSER)
        && nix::unistd::geteuid().is_root()
        && let Err(e) = init::fake_id_calls()
    {
        return e;
    }
    if let Err(e) = nix::unistd::chdir(process.cwd()) {
        return SetupError::with_code(
            125,
            format!(
                "cannot enter the working directory {} in the container: {e}",
                process.cwd().display()
            ),
        );
    }
    exec::exec(argv, envp)
}
