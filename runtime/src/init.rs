//! The container's first process (PID 1 of its PID namespace). It builds the root, drops every
//! privilege, forks the command, then only reaps zombies and forwards signals until the command
//! exits, and exits with the command's status. Its exit tears down the namespace.

use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::mount::MsFlags;
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

/// The most of /proc/self/mountinfo berth reads: thousands of mounts fit many times over.
const MOUNTINFO_LIMIT: u64 = 64 << 20;

/// Moves the container root mounted at `merged` (the working directory) onto `/` and chroots
/// into it: what runc and crun do when `pivot_root` fails with EINVAL because the host root is
/// the initramfs itself (rootfs cannot be moved, so diskless nodes booted without a tmpfs root
/// cannot pivot). Called in the container's private mount namespace, as root, after the root is
/// complete (proc, sys, dev, masks).
///
/// The isolation stays what pivot_root gives:
/// - Every host mount is detached, so the namespace holds only rootfs (which can never be
///   unmounted) below the container's mounts; `/proc/self/mountinfo` inside shows none of them.
/// - rootfs' own files are covered, reachable only by walking `..` above the process root, which
///   needs a second `chroot`: the command has no capability (CAP_SYS_CHROOT included), and it
///   cannot get one in a user namespace of its own because the root is not the top of the
///   namespace's root: between rootfs and the container sits an empty tmpfs (`top`), with the
///   container mounted on a directory of it, so the kernel counts every process in it as
///   chrooted and refuses it new user namespaces (`current_chrooted()` in create_user_ns). A
///   process that joins the namespace lands on that tmpfs and enters the container's root
///   through `/proc/<init>/root` ([`enter_root`]).
pub(super) fn move_root(merged: &Path, work: &Path) -> Result<(), SetupError> {
    let fail = |what: String| move |e: Errno| SetupError::new(format!("{what}: {e}"));
    // Before anything moves: rootfs' root, and the host mounts on it (each with the mounts on
    // top of it), opened beneath that root without following symlinks, so that no path a user
    // can rename (a FUSE mount in a home directory) leads the detaching anywhere else.
    let rootfs = nix::fcntl::open(
        "/",
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(fail("opening the host root".into()))?;
    let mut host = Vec::new();
    for rel in host_mounts()? {
        match super::mounts::path_beneath(&rootfs, &rel) {
            Ok(fd) => host.push((rel, fd)),
            // Gone or replaced since mountinfo was read: nothing of the host to detach there.
            Err(Errno::ENOENT | Errno::ELOOP | Errno::EXDEV | Errno::ENOTDIR) => {}
            Err(e) => {
                return Err(SetupError::new(format!(
                    "opening the host mount /{}: {e}",
                    rel.display()
                )));
            }
        }
    }
    let top = work.join("top");
    std::fs::create_dir(&top)
        .map_err(|e| SetupError::new(format!("creating {}: {e}", top.display())))?;
    nix::mount::mount(
        Some("tmpfs"),
        &top,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some("mode=755,size=16k,nr_inodes=4"),
    )
    .map_err(fail(format!("mounting a tmpfs on {}", top.display())))?;
    let place = top.join("root");
    std::fs::create_dir(&place)
        .map_err(|e| SetupError::new(format!("creating {}: {e}", place.display())))?;
    // The working directory is the container root's mount: it follows the moves.
    nix::mount::mount(
        Some(merged),
        &place,
        None::<&str>,
        MsFlags::MS_MOVE,
        None::<&str>,
    )
    .map_err(fail("moving the container root under its tmpfs".into()))?;
    nix::mount::mount(
        Some(&top),
        "/",
        None::<&str>,
        MsFlags::MS_MOVE,
        None::<&str>,
    )
    .map_err(fail(
        "moving the container root onto / (the host root is the initramfs)".into(),
    ))?;
    nix::unistd::chroot(".").map_err(fail("chroot into the container root".into()))?;
    nix::unistd::chdir("/").map_err(fail("entering /".into()))?;
    // Detached through the container's /proc: the fds reach mounts no path inside does.
    for (rel, fd) in &host {
        let path = berth_sys::privfs::fd_path(fd);
        match nix::mount::umount2(&path, nix::mount::MntFlags::MNT_DETACH) {
            // Not a mount's root any more (replaced since mountinfo was read).
            Ok(()) | Err(Errno::EINVAL) => {}
            Err(e) => {
                return Err(SetupError::new(format!(
                    "detaching the host mount /{} from the container's namespace through {}: {e} (the container needs /proc)",
                    rel.display(),
                    path.display()
                )));
            }
        }
    }
    Ok(())
}

/// The mounts directly on the root mount of this namespace (rootfs), relative to `/`, from
/// /proc/self/mountinfo (`ID PARENT MAJ:MIN ROOT MOUNTPOINT ...`). Detaching one detaches every
/// mount on top of and beneath it.
fn host_mounts() -> Result<Vec<PathBuf>, SetupError> {
    let fail =
        |e: &dyn std::fmt::Display| SetupError::new(format!("reading /proc/self/mountinfo: {e}"));
    let mut file = std::fs::File::open("/proc/self/mountinfo").map_err(|e| fail(&e))?;
    let text = berth_sys::privfs::read_bounded(&mut file, MOUNTINFO_LIMIT).map_err(|e| fail(&e))?;
    let entries: Vec<(&[u8], &[u8], Vec<u8>)> = text
        .split(|&b| b == b'\n')
        .filter_map(|line| {
            let mut f = line.split(|&b| b == b' ');
            let id = f.next()?;
            let parent = f.next()?;
            Some((id, parent, unescape(f.nth(2)?)))
        })
        .collect();
    // The root mount: on `/`, its own parent (rootfs) or its parent outside this namespace.
    let root = entries
        .iter()
        .find(|(id, parent, point)| {
            point == b"/" && (id == parent || !entries.iter().any(|(other, _, _)| other == parent))
        })
        .map(|(id, _, _)| *id)
        .ok_or_else(|| fail(&"no root mount listed"))?;
    Ok(entries
        .iter()
        .filter(|(id, parent, _)| *parent == root && *id != root)
        .filter_map(|(_, _, point)| point.strip_prefix(b"/").filter(|rel| !rel.is_empty()))
        .map(|rel| PathBuf::from(std::ffi::OsString::from_vec(rel.to_vec())))
        .collect())
}

/// Undoes mountinfo's octal escapes (`\040` for a space, `\011`, `\012`, `\134`).
fn unescape(field: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(field.len());
    let mut i = 0;
    while i < field.len() {
        let octal = field
            .get(i + 1..i + 4)
            .filter(|d| field[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(d) => {
                out.push(d.iter().fold(0u8, |v, c| v.wrapping_mul(8) + (c - b'0')));
                i += 4;
            }
            None => {
                out.push(field[i]);
                i += 1;
            }
        }
    }
    out
}

/// Makes `root` (an fd of `/proc/<init>/root`, opened before joining) the root and working
/// directory of a process that joined the container's mount namespace: setns puts it on the
/// namespace's top mount, which is the container root after pivot_root but the tmpfs below it
/// after [`move_root`].
pub(super) fn enter_root(root: &OwnedFd) -> Result<(), SetupError> {
    nix::unistd::fchdir(root)
        .and_then(|()| nix::unistd::chroot("."))
        .and_then(|()| nix::unistd::chdir("/"))
        .map_err(|e| SetupError::new(format!("entering the container's root: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape(br"/a\040b\011c\134d"), b"/a b\tc\\d");
        assert_eq!(unescape(br"/plain"), b"/plain");
        assert_eq!(unescape(br"/trailing\04"), br"/trailing\04");
        assert_eq!(unescape(br"\9999"), br"\9999");
    }
}
