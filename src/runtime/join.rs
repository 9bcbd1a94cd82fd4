//! Runs a command inside a held container: joins its namespaces and cgroup, becomes the
//! container's user, and execs — what `berth exec` and the Slurm tasks of a step do.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use nix::fcntl::{OFlag, open};
use nix::sched::{CloneFlags, setns};
use nix::sys::signal::{SigSet, SigmaskHow, sigprocmask};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::stat::Mode;
use nix::sys::wait::WaitStatus;

use super::{
    Exit, MaskGuard, Options, RuntimeError, SetupError, clone, exec, forwarded_signals, init,
    report, state, sys, wait,
};
use crate::cgroup::Cgroup;

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

/// Runs `args` (with `env` added to the container's environment) in the held container `id` and
/// returns how it ended.
pub fn exec(
    opts: &Options,
    id: &str,
    args: &[String],
    env: &[(String, String)],
) -> Result<Exit, RuntimeError> {
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
    let _restore = MaskGuard(old_mask);

    let (pid_ns, rest) = fds
        .split_first()
        .ok_or(RuntimeError::Spec("no pid namespace"))?;
    setns(pid_ns.0.as_fd(), pid_ns.1).map_err(sys("joining the container's PID namespace"))?;
    let forked = clone::clone_into(0, cg_fd.as_fd()).map_err(sys("forking into the container"));
    let (pid, in_cgroup) = match forked? {
        clone::Forked::Child => {
            drop(report_r);
            let err = enter(rest, process, &argv, &envp);
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
    let pidfd = clone::pidfd_open(pid).map_err(sys("opening a pidfd"))?;
    let sfd = SignalFd::with_flags(&forwarded, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)
        .map_err(sys("creating a signalfd"))?;
    let mut setup_error = None;
    for msg in report::receive_all(report_r) {
        if let report::Received::Error(code, message) = msg {
            setup_error = Some(SetupError::with_code(code, message));
        }
    }
    let status = wait(pid, &pidfd, &sfd, None)?;
    if let Some(err) = setup_error {
        return Err(RuntimeError::Setup(err));
    }
    Ok(match status {
        Some(WaitStatus::Exited(_, code)) => Exit::Code(code),
        Some(WaitStatus::Signaled(_, sig, _)) => Exit::Signal(sig as i32),
        _ => Exit::Code(125),
    })
}

/// In the forked child: enter the remaining namespaces, drop privileges, exec.
fn enter(
    namespaces: &[(OwnedFd, CloneFlags)],
    process: &oci_spec::runtime::Process,
    argv: &[std::ffi::CString],
    envp: &[std::ffi::CString],
) -> SetupError {
    for (fd, flag) in namespaces {
        if let Err(e) = setns(fd.as_fd(), *flag) {
            return SetupError::new(format!("joining the container's namespace ({flag:?}): {e}"));
        }
    }
    if let Err(e) = init::drop_privileges(process) {
        return e;
    }
    let _ = sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None);
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
