//! The container's first process (PID 1 of its PID namespace). It builds the root, drops every
//! privilege, forks the command, then only reaps zombies and forwards signals until the command
//! exits, and exits with the command's status. Its exit tears down the namespace.

use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::time::Instant;

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sched::{CloneFlags, unshare};
use nix::sys::signal::{SigSet, SigmaskHow, Signal, kill, sigprocmask};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::stat::{Mode, umask};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::{ForkResult, Gid, Pid, Uid, fork, setresgid, setresuid, setsid};
use oci_spec::runtime::{LinuxNamespaceType, Spec};

use super::{SetupError, exec, report, rootfs};

/// Signals berth passes on to the command (SIGKILL and SIGSTOP cannot be caught).
pub const FORWARDED: [Signal; 7] = [
    Signal::SIGTERM,
    Signal::SIGINT,
    Signal::SIGHUP,
    Signal::SIGQUIT,
    Signal::SIGUSR1,
    Signal::SIGUSR2,
    Signal::SIGWINCH,
];

/// What init needs from the parent, all prepared before the clone.
pub struct InitArgs<'a> {
    pub spec: &'a Spec,
    pub lowers: &'a [PathBuf],
    /// Per-container directory for the upper layer (a tmpfs is mounted on it in our namespace).
    pub work: PathBuf,
    /// The image's layers, opened and cloned by the parent (`mounts::open_layers`).
    pub layers: &'a [super::mounts::Tree],
    /// The Spec's bind sources, opened and cloned by the parent (`mounts::open_sources`).
    pub trees: &'a [Option<super::mounts::Tree>],
    /// Readable end of the parent's lifeline: one byte means "you are in the cgroup, go on";
    /// end-of-file means the parent died.
    pub lifeline: OwnedFd,
    /// Where setup errors and timings go; closed on the command's exec.
    pub report: OwnedFd,
    /// Hold the namespaces with no command (`runtime::Mode::Hold`).
    pub hold: bool,
    /// The user namespaces of a remapped container.
    pub remap: Option<&'a Remap>,
}

/// A remapped container's user namespaces (`runtime::userns`).
pub struct Remap {
    /// Joined by init once the root is set up: the command and every process that joins later
    /// see the mapped ids.
    pub join: OwnedFd,
    /// The mapping the image's layers are idmapped with.
    pub layers: OwnedFd,
}

/// Runs init; never returns.
pub fn main(args: InitArgs<'_>) -> ! {
    let code = match run(&args) {
        Ok(code) => code,
        Err(err) => {
            report::send(&args.report, &report::Message::Error(err.code, err.message));
            err.code
        }
    };
    // SAFETY: _exit ends this process without running the parent's atexit handlers or
    // flushing stdio buffers copied from it.
    unsafe { libc::_exit(code) }
}

fn run(args: &InitArgs<'_>) -> Result<i32, SetupError> {
    let started = Instant::now();
    let _ = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL);
    // What the setup makes (the overlay's upper directory, which is the container's `/`, mount
    // points, /etc/hostname) must have the modes it asks for, not the caller's umask's: under a
    // umask of 077 the container's `/` was 0700 and no user but root could enter it. The
    // command gets the caller's umask back, as a command run by Slurm or a shell does.
    let caller_umask = umask(Mode::from_bits_truncate(0o022));
    let mut byte = [0u8; 1];
    if nix::unistd::read(&args.lifeline, &mut byte) != Ok(1) {
        return Err(SetupError::new(
            "berth exited before the container started".into(),
        ));
    }
    // Our own session: the host terminal's job-control signals reach berth, which forwards them
    // once, instead of hitting the command directly as well.
    let _ = setsid();
    // The cgroup namespace is rooted where we are now, inside the container's cgroup, so its
    // limits appear at /sys/fs/cgroup.
    unshare(CloneFlags::CLONE_NEWCGROUP)
        .map_err(|e| SetupError::new(format!("creating the cgroup namespace: {e}")))?;
    let spec = args.spec;
    let linux = spec.linux().as_ref();
    let has_netns = linux
        .and_then(|l| l.namespaces().as_ref())
        .is_some_and(|ns| ns.iter().any(|n| n.typ() == LinuxNamespaceType::Network));

    rootfs::setup(
        spec,
        args.lowers,
        args.layers,
        args.remap.is_some(),
        &args.work,
        args.trees,
    )?;
    if let Some(name) = spec.hostname() {
        nix::unistd::sethostname(name)
            .map_err(|e| SetupError::new(format!("setting the hostname to {name}: {e}")))?;
    }
    if has_netns {
        loopback_up()?;
    }
    let process = spec
        .process()
        .as_ref()
        .ok_or_else(|| SetupError::new("the spec has no process".into()))?;
    let argv = cstrings(process.args().as_deref().unwrap_or_default(), "argument")?;
    let env = cstrings(
        process.env().as_deref().unwrap_or_default(),
        "environment entry",
    )?;
    let cwd = process.cwd().clone();
    if let Some(remap) = args.remap {
        // Last: everything above needed the host's privileges, which count in this namespace
        // too but no longer in the host's once we are in it.
        nix::sched::setns(&remap.join, CloneFlags::CLONE_NEWUSER)
            .map_err(|e| SetupError::new(format!("joining the container's user namespace: {e}")))?;
    }
    drop_privileges(process)?;
    report::send(
        &args.report,
        &report::Message::Timing("mounts", started.elapsed()),
    );

    let sfd = signal_fd()?;
    if args.hold {
        // The container outlives the berth that made it: no parent-death signal, and none of
        // berth's pipes (a caller reading berth's stdout to the end must not wait for us).
        let _ = nix::sys::prctl::set_pdeathsig(None);
        detach_stdio()?;
        // SAFETY: closing our copy of the fd, which is not used again; the parent sees
        // end-of-file and knows the container is ready.
        unsafe { libc::close(args.report.as_raw_fd()) };
        return Ok(hold(&sfd));
    }
    // SAFETY: this process is single-threaded (the runtime never starts threads), so the child
    // may run arbitrary code until it execs.
    match unsafe { fork() }.map_err(|e| SetupError::new(format!("forking the command: {e}")))? {
        ForkResult::Child => {
            umask(caller_umask);
            let err = start_command(&cwd, &argv, &env);
            report::send(&args.report, &report::Message::Error(err.code, err.message));
            // SAFETY: see `main`.
            unsafe { libc::_exit(err.code) }
        }
        ForkResult::Parent { child } => {
            // Only the command's copy of the report pipe may remain, so that the parent sees
            // end-of-file exactly when the command has exec'd (or failed to).
            // SAFETY: closing our copy of the fd; `args.report` is not used again in this process.
            unsafe { libc::close(args.report.as_raw_fd()) };
            Ok(supervise(child, &sfd, &args.lifeline))
        }
    }
}

pub(super) fn cstrings(items: &[String], what: &str) -> Result<Vec<CString>, SetupError> {
    items
        .iter()
        .map(|s| {
            CString::new(s.as_bytes()).map_err(|_| {
                SetupError::with_code(125, format!("{what} contains a NUL byte: {s:?}"))
            })
        })
        .collect()
}

fn start_command(cwd: &std::path::Path, argv: &[CString], env: &[CString]) -> SetupError {
    if let Err(e) = nix::unistd::chdir(cwd) {
        return SetupError::with_code(
            125,
            format!(
                "cannot enter the working directory {} in the container: {e}",
                cwd.display()
            ),
        );
    }
    exec::exec(argv, env)
}

/// Switches to the job's user with its groups, no capabilities in any set and no_new_privs, so
/// neither a setuid binary nor file capabilities in the image can raise privileges.
pub(super) fn drop_privileges(process: &oci_spec::runtime::Process) -> Result<(), SetupError> {
    let user = process.user();
    let fail = |what: &str, e: &dyn std::fmt::Display| {
        SetupError::new(format!("{what} for uid {}: {e}", user.uid()))
    };
    let groups: Vec<Gid> = user
        .additional_gids()
        .as_deref()
        .unwrap_or_default()
        .iter()
        .map(|g| Gid::from_raw(*g))
        .collect();
    nix::unistd::setgroups(&groups).map_err(|e| fail("setting groups", &e))?;
    for set in [
        caps::CapSet::Bounding,
        caps::CapSet::Inheritable,
        caps::CapSet::Ambient,
    ] {
        caps::clear(None, set).map_err(|e| fail("clearing capabilities", &e))?;
    }
    let gid = Gid::from_raw(user.gid());
    setresgid(gid, gid, gid).map_err(|e| fail("setting gid", &e))?;
    let uid = Uid::from_raw(user.uid());
    setresuid(uid, uid, uid).map_err(|e| fail("setting uid", &e))?;
    // Leaving uid 0 clears these already; staying uid 0 (--user 0) does not.
    for set in [caps::CapSet::Effective, caps::CapSet::Permitted] {
        caps::clear(None, set).map_err(|e| fail("clearing capabilities", &e))?;
    }
    nix::sys::prctl::set_no_new_privs().map_err(|e| fail("setting no_new_privs", &e))?;
    Ok(())
}

fn signal_fd() -> Result<SignalFd, SetupError> {
    let mut mask = SigSet::empty();
    for sig in FORWARDED {
        mask.add(sig);
    }
    mask.add(Signal::SIGCHLD);
    // Already blocked by the parent before the clone; blocking again is harmless and keeps this
    // function correct on its own.
    sigprocmask(SigmaskHow::SIG_BLOCK, Some(&mask), None)
        .map_err(|e| SetupError::new(format!("blocking signals: {e}")))?;
    SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC)
        .map_err(|e| SetupError::new(format!("creating a signalfd: {e}")))
}

/// Reaps every child, forwards signals to the command, and returns the command's exit code
/// (128+N when a signal N ended it). Returns 137 when the parent died.
fn supervise(command: Pid, sfd: &SignalFd, lifeline: &OwnedFd) -> i32 {
    loop {
        // Reap first: SIGCHLD may have arrived before the signalfd existed.
        loop {
            match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, code)) if pid == command => return code,
                Ok(WaitStatus::Signaled(pid, sig, _)) if pid == command => return 128 + sig as i32,
                Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => break,
                Ok(_) | Err(Errno::EINTR) => continue,
                Err(_) => break,
            }
        }
        let mut fds = [
            PollFd::new(sfd.as_fd(), PollFlags::POLLIN),
            PollFd::new(lifeline.as_fd(), PollFlags::POLLIN),
        ];
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) | Err(Errno::EINTR) => {}
            Err(_) => return 125,
        }
        if fds[1].any().unwrap_or(false) {
            // Parent gone (the lifeline only ever carries the start byte, already read): take the
            // container down rather than leave it unsupervised.
            return 137;
        }
        if let Ok(Some(info)) = sfd.read_signal() {
            let sig = info.ssi_signo as i32;
            if sig != libc::SIGCHLD
                && let Ok(sig) = Signal::try_from(sig)
            {
                let _ = kill(command, sig);
            }
        }
    }
}

fn detach_stdio() -> Result<(), SetupError> {
    let null = nix::fcntl::open(
        "/dev/null",
        nix::fcntl::OFlag::O_RDWR,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(|e| SetupError::new(format!("opening /dev/null in the container: {e}")))?;
    for fd in 0..3 {
        // SAFETY: dup2 onto the standard descriptors, which this process owns.
        unsafe { libc::dup2(null.as_raw_fd(), fd) };
    }
    Ok(())
}

/// Holds the container until told to stop, reaping whatever joined its PID namespace and was
/// orphaned there.
fn hold(sfd: &SignalFd) -> i32 {
    loop {
        match sfd.read_signal() {
            Ok(Some(info)) if info.ssi_signo as i32 == libc::SIGCHLD => {
                while let Ok(status) = waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                    if status == WaitStatus::StillAlive {
                        break;
                    }
                }
            }
            Ok(Some(info))
                if [libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGQUIT]
                    .contains(&(info.ssi_signo as i32)) =>
            {
                return 0;
            }
            Ok(_) | Err(Errno::EINTR) | Err(Errno::EAGAIN) => {}
            Err(_) => return 125,
        }
    }
}

/// Brings `lo` up in a new network namespace (it starts down).
fn loopback_up() -> Result<(), SetupError> {
    let fail = |e: Errno| SetupError::new(format!("bringing up lo in the network namespace: {e}"));
    // SAFETY: plain socket(2); the fd is owned below.
    let sock = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if sock < 0 {
        return Err(fail(Errno::last()));
    }
    // SAFETY: `sock` was just created and is owned by nothing else.
    let sock = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(sock) };
    // SAFETY: ifreq is plain data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS fills `req.ifr_ifru.ifru_flags` for the named interface.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) } < 0 {
        return Err(fail(Errno::last()));
    }
    // SAFETY: the union's flags member was just set by the kernel.
    unsafe { req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short };
    // SAFETY: SIOCSIFFLAGS reads `req` for the named interface.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) } < 0 {
        return Err(fail(Errno::last()));
    }
    Ok(())
}
