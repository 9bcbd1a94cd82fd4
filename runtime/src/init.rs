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

use super::{SetupError, exec, hooks, report, rootfs};
use berth_sys::seccomp;

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
    /// The kernel started init in its cgroup (clone3): the parent sends no start byte.
    pub in_cgroup: bool,
    /// Where setup errors and timings go; closed on the command's exec.
    pub report: OwnedFd,
    /// Hold the namespaces with no command (`runtime::Mode::Hold`).
    pub hold: bool,
    /// The user namespaces of a remapped container.
    pub remap: Option<&'a Remap>,
    /// The user namespace of a container that is not remapped (`runtime::own_user_namespace`),
    /// joined last as a remapped container's is.
    pub own_userns: Option<&'a OwnedFd>,
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
    let parent_gone = || SetupError::new("berth exited before the container started".into());
    if args.in_cgroup {
        // Already in the cgroup: nothing to wait for (a wait would cost a round trip through the
        // scheduler on every start). A parent that died before the parent-death signal was set
        // has closed its end of the lifeline; one that dies later kills us with the signal.
        let mut fds = [PollFd::new(args.lifeline.as_fd(), PollFlags::POLLIN)];
        if poll(&mut fds, PollTimeout::ZERO).is_ok_and(|n| n > 0) {
            return Err(parent_gone());
        }
    } else {
        let mut byte = [0u8; 1];
        if nix::unistd::read(&args.lifeline, &mut byte) != Ok(1) {
            return Err(parent_gone());
        }
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
    if args.remap.is_some() {
        hooks::apt_sandbox_as_root()?;
    }
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
    } else if let Some(own) = args.own_userns {
        nix::sched::setns(own, CloneFlags::CLONE_NEWUSER)
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
            // After drop_privileges (our own setresuid must not be faked, and no_new_privs is
            // set), right before the exec: see `seccomp` for why this grants nothing.
            let filtered = match args.remap {
                Some(_) => fake_id_calls(),
                None => Ok(()),
            };
            let err = match filtered {
                Ok(()) => start_command(&cwd, &argv, &env),
                Err(e) => e,
            };
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
    drop_bounding_set().map_err(|e| fail("clearing the capability bounding set", &e))?;
    caps::clear(None, caps::CapSet::Ambient).map_err(|e| fail("clearing capabilities", &e))?;
    let gid = Gid::from_raw(user.gid());
    setresgid(gid, gid, gid).map_err(|e| fail("setting gid", &e))?;
    let uid = Uid::from_raw(user.uid());
    setresuid(uid, uid, uid).map_err(|e| fail("setting uid", &e))?;
    // Leaving uid 0 clears the effective and permitted sets already; staying uid 0 (--user 0)
    // does not. One capset empties all three.
    clear_capabilities().map_err(|e| fail("clearing capabilities", &e))?;
    nix::sys::prctl::set_no_new_privs().map_err(|e| fail("setting no_new_privs", &e))?;
    Ok(())
}

/// Drops every capability the kernel knows from the bounding set: one PR_CAPBSET_DROP each,
/// without reading the set first, until the kernel answers EINVAL (past its last capability, so
/// capabilities newer than the `caps` crate's list go too).
fn drop_bounding_set() -> Result<(), Errno> {
    let zero: libc::c_ulong = 0;
    for cap in 0..64u32 {
        let arg = libc::c_ulong::from(cap);
        // SAFETY: prctl(PR_CAPBSET_DROP, cap) only changes this process's bounding set; every
        // argument is passed as the unsigned long the kernel reads.
        if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, arg, zero, zero, zero) } != 0 {
            return match Errno::last() {
                Errno::EINVAL if cap > 0 => Ok(()),
                e => Err(e),
            };
        }
    }
    Ok(())
}

/// Empties the effective, permitted and inheritable sets in one capset(2).
fn clear_capabilities() -> Result<(), Errno> {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: libc::c_int,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    /// _LINUX_CAPABILITY_VERSION_3: two 32-bit words per set.
    const VERSION_3: u32 = 0x2008_0522;
    let mut header = Header {
        version: VERSION_3,
        pid: 0,
    };
    let data = [Data::default(); 2];
    // SAFETY: capset with a valid version-3 header and the two data words it reads.
    let ret = unsafe { libc::syscall(libc::SYS_capset, &mut header as *mut Header, data.as_ptr()) };
    if ret != 0 {
        return Err(Errno::last());
    }
    Ok(())
}

/// Installs the remap-root seccomp filter (`seccomp`) on this process, whose user and
/// no_new_privs are already set: for a remapped container's command and every process that
/// joins it.
pub(super) fn fake_id_calls() -> Result<(), SetupError> {
    seccomp::install().map_err(|e| {
        SetupError::new(format!(
            "installing the remap-root seccomp filter (chown and setuid calls that report \
             success): {e} (a kernel without CONFIG_SECCOMP_FILTER cannot run remapped containers)"
        ))
    })
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
            let sig = info.ssi_signo.cast_signed();
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
            Ok(Some(info)) if info.ssi_signo.cast_signed() == libc::SIGCHLD => {
                while let Ok(status) = waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                    if status == WaitStatus::StillAlive {
                        break;
                    }
                }
            }
            Ok(Some(info))
                if [libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGQUIT]
                    .contains(&(info.ssi_signo.cast_signed())) =>
            {
                return 0;
            }
            Ok(_) | Err(Errno::EINTR) | Err(Errno::EAGAIN) => {}
            Err(_) => return 125,
        }
    }
}

/// IFF_UP as ifreq's flags field holds it.
#[expect(clippy::cast_possible_truncation, reason = "IFF_UP is 1")]
const IFF_UP: libc::c_short = libc::IFF_UP as libc::c_short;

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
        *dst = libc::c_char::from_ne_bytes([*src]);
    }
    // SAFETY: SIOCGIFFLAGS fills `req.ifr_ifru.ifru_flags` for the named interface.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) } < 0 {
        return Err(fail(Errno::last()));
    }
    // SAFETY: the union's flags member was just set by the kernel.
    unsafe { req.ifr_ifru.ifru_flags |= IFF_UP };
    // SAFETY: SIOCSIFFLAGS reads `req` for the named interface.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) } < 0 {
        return Err(fail(Errno::last()));
    }
    Ok(())
}
