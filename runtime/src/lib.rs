//! Executes an OCI Spec: cgroup, namespaces, root filesystem, user, exec, wait and cleanup.
//! It decides nothing about what the container is; `spec/` did that.

mod clone;
mod exec;
mod hooks;
mod init;
pub mod join;
pub mod mounts;
mod moveroot;
mod report;
mod rootfs;
pub mod state;
pub mod userns;

use std::collections::BTreeMap;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{SigSet, SigmaskHow, Signal, kill, sigprocmask};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::Pid;
use oci_spec::runtime::{LinuxNamespaceType, Spec};

use berth_cgroup::{self as cgroup, Cgroup, CgroupError, Hierarchy, Stats};

pub use init::FORWARDED;

/// Why a container could not be started or waited for.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error(
        "creating the container state directory under {path}: {source} (check runtime.state_dir in the config)"
    )]
    State {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what}: {errno}")]
    Sys { what: &'static str, errno: Errno },
    #[error("{0}")]
    Setup(SetupError),
    #[error("the spec is incomplete: {0}")]
    Spec(&'static str),
    #[error("no running container '{0}' (see `berth ps`)")]
    NoContainer(String),
    /// The image's entrypoint (`--container-entrypoint`) failed or timed out.
    #[error("{0}")]
    Entrypoint(String),
    /// What was given as a root filesystem is not a usable directory.
    #[error("root filesystem {}: {why}", berth_sys::text::elide(&.path.to_string_lossy()))]
    Rootfs { path: PathBuf, why: String },
}

impl RuntimeError {
    /// Exit status berth uses for this failure: the shell's 126/127 for the command, 125 for
    /// everything else (as docker and podman do).
    pub fn exit_code(&self) -> i32 {
        match self {
            RuntimeError::Setup(e) => e.code,
            _ => 125,
        }
    }
}

/// An error inside the container before the command runs, with berth's exit code for it.
#[derive(Debug)]
pub struct SetupError {
    pub code: i32,
    pub message: String,
}

impl SetupError {
    pub fn new(message: String) -> Self {
        Self { code: 125, message }
    }
    pub fn with_code(code: i32, message: String) -> Self {
        Self { code, message }
    }
}

impl std::fmt::Display for SetupError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// Host paths and policies the runtime needs (from the config).
#[derive(Clone, Debug)]
pub struct Options {
    pub cgroup_root: PathBuf,
    pub state_dir: PathBuf,
    pub timeout: Option<Duration>,
    pub kill_timeout: Duration,
    /// Bind a block device the user names as a mount source (the config's
    /// `runtime.mount_block_devices`); off, such a source is refused in one line.
    pub block_device_mounts: bool,
    /// Run a non-root user's container that is not remapped in a user namespace mapping the
    /// user and their groups to themselves (`runtime.user_namespace`), as Pyxis does.
    pub user_namespace: bool,
}

/// How the command ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exit {
    Code(i32),
    Signal(i32),
    /// The memory limit's OOM killer ended it.
    OutOfMemory,
    TimedOut,
}

impl Exit {
    /// The status berth exits with: the command's, 128+N for signal N, 137 for an OOM kill,
    /// 124 for a timeout (as timeout(1)).
    pub fn code(self) -> i32 {
        match self {
            Exit::Code(c) => c,
            Exit::Signal(s) => 128 + s,
            Exit::OutOfMemory => 137,
            Exit::TimedOut => 124,
        }
    }
}

#[derive(Debug)]
pub struct Outcome {
    pub exit: Exit,
    pub stats: Stats,
    /// Setup stages in order: cgroup, mounts (inside the container), exec.
    pub timings: Vec<(String, Duration)>,
    pub elapsed: Duration,
}

/// What the container's init does once the root is ready.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Run the Spec's command and exit with it (`berth run`).
    Run,
    /// Hold the namespaces open with no command until the container is removed, so that other
    /// processes can join it (a Slurm step's tasks, `berth exec`). Outlives the berth process.
    Hold,
}

/// A container whose init has finished setting up; the guards undo everything on drop.
struct Started {
    id: String,
    pid: Pid,
    pidfd: std::os::fd::OwnedFd,
    sfd: SignalFd,
    lifeline: std::os::fd::OwnedFd,
    cg: CgroupGuard,
    state: state::StateDir,
    record: state::Record,
    child: ChildGuard,
    _mask: MaskGuard,
    timings: Vec<(String, Duration)>,
}

/// Creates the cgroup and namespaces, starts init and waits until it has set up the root (and,
/// in `Mode::Run`, exec'd the command).
// Long by design: the start sequence in its order (cgroup, clone3, the record, init's report),
// each failure unwinding exactly what came before it.
fn start(
    spec: &Spec,
    lowers: &[PathBuf],
    opts: &Options,
    mode: Mode,
    labels: &BTreeMap<String, String>,
) -> Result<Started, RuntimeError> {
    let started = Instant::now();
    let reclaimed = state::reclaim(&opts.state_dir, opts.kill_timeout);
    if !reclaimed.is_empty() {
        tracing::info!("reclaimed {} leftover container(s)", reclaimed.len());
    }
    let linux = spec
        .linux()
        .as_ref()
        .ok_or(RuntimeError::Spec("no linux section"))?;
    let resources = linux.resources().clone().unwrap_or_default();
    // Bind sources are opened now, in the host's mount namespace and before the container
    // exists: those the user named with the user's credentials. Init attaches what was opened.
    let trees = mounts::open_sources(spec, &host_user(spec, linux)?, opts.block_device_mounts)
        .map_err(RuntimeError::Setup)?;

    let id = new_id();
    let hierarchy = Hierarchy::open(&opts.cgroup_root, &cgroup::required_controllers(&resources))?;
    let me = nix::unistd::getpid().as_raw();
    let mut record = state::Record {
        id: id.clone(),
        owner_pid: me,
        owner_start: state::process_start(me).unwrap_or(0),
        cgroup: hierarchy.root().join(&id),
        init_pid: 0,
        labels: state::with_uid(labels, spec),
    };
    let state = state::StateDir::create(&opts.state_dir, &record).map_err(|source| {
        RuntimeError::State {
            path: opts.state_dir.clone(),
            source,
        }
    })?;
    let cg = CgroupGuard {
        cgroup: hierarchy.create(&id)?,
        kill_timeout: opts.kill_timeout,
    };
    cg.cgroup.apply(&cgroup::plan_writes(&resources)?)?;
    cg.cgroup
        .set_device_filter(resources.devices().as_deref().unwrap_or_default())?;
    let cg_fd = cg.cgroup.open_fd()?;
    let mut timings = vec![("cgroup".to_string(), started.elapsed())];

    let flags = namespace_flags(spec);
    let remap = remap_namespaces(linux)?;
    let own_userns = match &remap {
        None if opts.user_namespace => own_user_namespace(spec),
        _ => None,
    };
    let layers = match &remap {
        // A directory image the user unpacked as themselves is already theirs, and so the
        // remapped root's: through the idmapping its files (the user's own id, which the mapping
        // leaves out) would become nobody's, where not even root can make a mount point.
        Some(r) if image_root_is_roots(lowers) => {
            mounts::open_layers(lowers, Some(r.layers.as_fd()))
        }
        Some(_) => mounts::open_layers(lowers, None),
        None => user_layers(spec, lowers),
    }
    .map_err(RuntimeError::Setup)?;
    let (report_r, report_w) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(sys("creating a pipe"))?;
    let (life_r, life_w) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(sys("creating a pipe"))?;
    let forwarded = forwarded_signals();
    let mut old_mask = SigSet::empty();
    sigprocmask(SigmaskHow::SIG_BLOCK, Some(&forwarded), Some(&mut old_mask))
        .map_err(sys("blocking signals"))?;
    let mask = MaskGuard(old_mask);

    let clone_at = Instant::now();
    let (pid, in_cgroup) = match clone::clone_into(flags, cg_fd.as_fd())
        .map_err(sys("creating the container's namespaces (clone3)"))?
    {
        clone::Forked::Child { in_cgroup } => {
            drop(report_r);
            drop(life_w);
            init::main(init::InitArgs {
                spec,
                lowers,
                work: state.work(),
                layers: &layers,
                trees: &trees,
                lifeline: life_r,
                in_cgroup,
                report: report_w,
                hold: mode == Mode::Hold,
                remap: remap.as_ref(),
                own_userns: own_userns.as_ref(),
            })
        }
        clone::Forked::Parent { pid, in_cgroup } => (pid, in_cgroup),
    };
    drop(report_w);
    drop(life_r);
    let child = ChildGuard(pid);
    if !in_cgroup {
        // Init waits for this byte only when the kernel could not start it in the cgroup.
        cg.cgroup.add_process(pid.as_raw())?;
        nix::unistd::write(&life_w, b"g").map_err(sys("starting the container"))?;
    }
    let pidfd = clone::pidfd_open(pid).map_err(sys("opening a pidfd for the container"))?;
    let sfd = SignalFd::with_flags(&forwarded, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)
        .map_err(sys("creating a signalfd"))?;
    record.init_pid = pid.as_raw();
    // `berth export` and `berth ps` find the container's init here. Written while init sets up
    // the root (on another CPU), not after: off the path to the command's exec.
    state
        .save_record(&record)
        .map_err(|source| RuntimeError::State {
            path: state.path.clone(),
            source,
        })?;

    let mut inside = Duration::ZERO;
    for msg in report::receive_all(report_r) {
        match msg {
            report::Received::Timing(stage, d) => {
                inside += d;
                timings.push((stage, d));
            }
            report::Received::Error(code, message) => {
                return Err(RuntimeError::Setup(SetupError::with_code(code, message)));
            }
        }
    }
    timings.push((
        "exec".to_string(),
        clone_at.elapsed().saturating_sub(inside),
    ));
    Ok(Started {
        id,
        pid,
        pidfd,
        sfd,
        lifeline: life_w,
        cg,
        state,
        record,
        child,
        _mask: mask,
        timings,
    })
}

/// Runs the container described by `spec` over the root filesystem layers `lowers` (topmost
/// first) to completion.
pub fn run(spec: &Spec, lowers: &[PathBuf], opts: &Options) -> Result<Outcome, RuntimeError> {
    let begun = Instant::now();
    let c = start(spec, lowers, opts, Mode::Run, &BTreeMap::new())?;
    let deadline = opts.timeout.map(berth_sys::time::deadline_after);
    let status = wait(c.pid, &c.pidfd, &c.sfd, deadline)?;
    std::mem::forget(c.child);
    drop(c.lifeline);
    let cgroup = &c.cg.cgroup;
    // Init was the PID namespace's first process: its exit killed and reaped every process in
    // the namespace, so the cgroup is normally empty now (one read of cgroup.events says so).
    // What else is there (a process moved in from outside) is killed.
    if status.is_none() || !cgroup.wait_empty(Duration::ZERO)? {
        cgroup.kill()?;
        cgroup.wait_empty(opts.kill_timeout)?;
    }
    let stats = cgroup.stats();
    drop(c.cg);
    drop(c.state);
    let exit = match status {
        None => Exit::TimedOut,
        Some(_) if stats.oom_kills.unwrap_or(0) > 0 => Exit::OutOfMemory,
        Some(WaitStatus::Exited(_, code)) => Exit::Code(code),
        Some(WaitStatus::Signaled(_, sig, _)) => Exit::Signal(sig as i32),
        Some(_) => Exit::Code(125),
    };
    Ok(Outcome {
        exit,
        stats,
        timings: c.timings,
        elapsed: begun.elapsed(),
    })
}

/// A container left running in `Mode::Hold`.
#[derive(Clone, Debug)]
pub struct Created {
    pub id: String,
    /// The container's init, whose /proc/PID/ns/* other processes join.
    pub pid: i32,
    pub timings: Vec<(String, Duration)>,
}

/// Creates a container that holds its namespaces until [`remove`]; `labels` (job, step, name,
/// uid, ...) are recorded for lookups. The Spec's process is what joining processes run as.
pub fn create(
    spec: &Spec,
    lowers: &[PathBuf],
    opts: &Options,
    labels: &BTreeMap<String, String>,
) -> Result<Created, RuntimeError> {
    let c = start(spec, lowers, opts, Mode::Hold, labels)?;
    let mut record = c.record;
    // The container now lives as long as its init: that is the owner gc checks.
    record.owner_pid = c.pid.as_raw();
    record.owner_start = state::process_start(c.pid.as_raw()).unwrap_or(0);
    c.state
        .save(&record, spec)
        .map_err(|source| RuntimeError::State {
            path: c.state.path.clone(),
            source,
        })?;
    // Detach: the init is reparented to init(1) of the host when berth exits; the guards
    // must not undo the container.
    std::mem::forget(c.child);
    std::mem::forget(c.cg);
    c.state.keep();
    Ok(Created {
        id: c.id,
        pid: record.init_pid,
        timings: c.timings,
    })
}

/// Kills and removes a container by id (idempotent: a missing one is not an error).
pub fn remove(opts: &Options, id: &str) -> Result<bool, RuntimeError> {
    let Some((record, _)) = state::load(&opts.state_dir, id) else {
        return Ok(false);
    };
    let cgroup = Cgroup::at(record.cgroup.clone());
    cgroup.kill()?;
    cgroup.wait_empty(opts.kill_timeout)?;
    cgroup.remove()?;
    state::remove(&opts.state_dir, &record).map_err(|source| RuntimeError::State {
        path: opts.state_dir.clone(),
        source,
    })?;
    Ok(true)
}

fn sys(what: &'static str) -> impl Fn(Errno) -> RuntimeError {
    move |errno| RuntimeError::Sys { what, errno }
}

fn forwarded_signals() -> SigSet {
    let mut set = SigSet::empty();
    for sig in FORWARDED {
        set.add(sig);
    }
    set
}

/// Waits for init, forwarding signals to it; `None` when the deadline passed first.
fn wait(
    pid: Pid,
    pidfd: &std::os::fd::OwnedFd,
    sfd: &SignalFd,
    deadline: Option<Instant>,
) -> Result<Option<WaitStatus>, RuntimeError> {
    loop {
        let timeout = match deadline {
            None => PollTimeout::NONE,
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Ok(None);
                }
                PollTimeout::try_from(
                    i32::try_from(left.as_millis()).map_or(i32::MAX, |ms| ms.min(i32::MAX - 1) + 1),
                )
                .unwrap_or(PollTimeout::MAX)
            }
        };
        let mut fds = [
            PollFd::new(pidfd.as_fd(), PollFlags::POLLIN),
            PollFd::new(sfd.as_fd(), PollFlags::POLLIN),
        ];
        match poll(&mut fds, timeout) {
            Ok(_) | Err(Errno::EINTR) => {}
            Err(errno) => {
                return Err(RuntimeError::Sys {
                    what: "waiting for the container",
                    errno,
                });
            }
        }
        while let Ok(Some(info)) = sfd.read_signal() {
            if let Ok(sig) = Signal::try_from(info.ssi_signo.cast_signed()) {
                let _ = kill(pid, sig);
            }
        }
        if fds[0].any().unwrap_or(false) {
            return match waitpid(pid, None) {
                Ok(status) => Ok(Some(status)),
                Err(errno) => Err(RuntimeError::Sys {
                    what: "waiting for the container",
                    errno,
                }),
            };
        }
    }
}

/// For a Spec with a user namespace: the namespace the container's processes join at the end of
/// setup (the Spec's mappings), and the one its image layers are idmapped through so that the
/// image's root files belong to whoever the container's id 0 is (see `userns`).
fn remap_namespaces(linux: &oci_spec::runtime::Linux) -> Result<Option<init::Remap>, RuntimeError> {
    let wants = linux
        .namespaces()
        .as_deref()
        .unwrap_or_default()
        .iter()
        .any(|n| n.typ() == LinuxNamespaceType::User);
    if !wants {
        return Ok(None);
    }
    let ranges = |m: &Option<Vec<oci_spec::runtime::LinuxIdMapping>>| {
        let ranges: Vec<userns::Range> = m
            .as_deref()
            .unwrap_or_default()
            .iter()
            .map(|m| userns::Range {
                inside: m.container_id(),
                outside: m.host_id(),
                size: m.size(),
            })
            .collect();
        let root = ranges
            .iter()
            .find(|r| r.inside == 0 && r.size >= 1)
            .map(|r| r.outside)
            .ok_or(RuntimeError::Spec(
                "a user namespace needs a mapping of the container's id 0",
            ))?;
        Ok::<_, RuntimeError>((ranges, root))
    };
    let (uids, uid) = ranges(linux.uid_mappings())?;
    let (gids, gid) = ranges(linux.gid_mappings())?;
    let setup = |e: berth_sys::SysError| RuntimeError::Setup(SetupError::new(e.to_string()));
    Ok(Some(init::Remap {
        join: userns::create(&uids, &gids).map_err(setup)?,
        layers: userns::create(&userns::layer_map(uid), &userns::layer_map(gid)).map_err(setup)?,
    }))
}

/// The user namespace a container that is not remapped runs in: its user and groups mapped to
/// themselves (`userns::self_map`), as Pyxis's containers are (`/proc/self/uid_map` is `1000
/// 1000 1`), so the container's processes see only their own ids and root's files as nobody's.
/// It grants nothing: the command holds no capability in it (or anywhere), and every other
/// namespace of the container, made before it, stays the host's user namespace's. Where the
/// kernel makes none (user namespaces off, `user.max_user_namespaces` reached) or the user is in
/// more groups than a gid_map holds, the container runs in the host's, with a warning.
fn own_user_namespace(spec: &Spec) -> Option<std::os::fd::OwnedFd> {
    let user = spec.process().as_ref()?.user();
    let groups = user.additional_gids().clone().unwrap_or_default();
    let Some((uids, gids)) = userns::self_map(user.uid(), user.gid(), &groups) else {
        if user.uid() != 0 {
            tracing::warn!(
                "uid {} is in more groups than a user namespace maps: the container runs in \
                 the host's user namespace",
                user.uid()
            );
        }
        return None;
    };
    userns::create(&uids, &gids)
        .inspect_err(|e| {
            tracing::warn!("the container runs in the host's user namespace: {e}");
        })
        .ok()
}

/// The image layers of a container without a user namespace: idmapped so that the image's root
/// files are the user's in a user's writable container (`userns::user_layer_ids`), as they are.
/// Where the kernel or the layers' filesystem cannot idmap, the container starts with the
/// image's owners as before (and a warning): writes outside the image's root-owned paths keep
/// working.
fn user_layers(spec: &Spec, lowers: &[PathBuf]) -> Result<Vec<mounts::Tree>, SetupError> {
    let Some((uid, gid)) = userns::user_layer_ids(spec) else {
        return mounts::open_layers(lowers, None);
    };
    // Only an image whose root directory is root's (a registry's or a site's image) is
    // idmapped. One the user unpacked as themselves (Enroot's way) already is the user's, and
    // through the idmapping its files (the user's own id, which the mapping leaves out) would
    // become nobody's, where not even root can make a mount point.
    if !image_root_is_roots(lowers) {
        return mounts::open_layers(lowers, None);
    }
    let idmapped = userns::create(&userns::layer_map(uid), &userns::layer_map(gid))
        .map_err(|e| SetupError::new(e.to_string()))
        .and_then(|ns| mounts::open_layers(lowers, Some(ns.as_fd())));
    idmapped.or_else(|e| {
        tracing::warn!(
            "the image's root-owned files stay root's in this writable container (not the \
             user's): {e}"
        );
        mounts::open_layers(lowers, None)
    })
}

/// Whether the image's root directory (its top layer's) is root's: a registry's or a site's
/// image, whose layers are idmapped so that root's files become the user's. Not one a user
/// unpacked as themselves, which is theirs already.
fn image_root_is_roots(lowers: &[PathBuf]) -> bool {
    lowers
        .first()
        .and_then(|top| std::fs::metadata(top).ok())
        .is_some_and(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
}

/// The host identity the container's process runs as: the Spec's user, through the user
/// namespace's mappings when it has one (a remapped container's root is the user on the host).
fn host_user(
    spec: &Spec,
    linux: &oci_spec::runtime::Linux,
) -> Result<berth_spec::UserIds, RuntimeError> {
    let user = spec
        .process()
        .as_ref()
        .ok_or(RuntimeError::Spec("no process"))?
        .user();
    let remapped = linux
        .namespaces()
        .as_deref()
        .unwrap_or_default()
        .iter()
        .any(|n| n.typ() == LinuxNamespaceType::User);
    // An id the mappings leave out is the overflow id on the host: nobody.
    let map = |m: &Option<Vec<oci_spec::runtime::LinuxIdMapping>>, id: u32| {
        if !remapped {
            return id;
        }
        m.as_deref()
            .unwrap_or_default()
            .iter()
            .find(|m| id >= m.container_id() && id - m.container_id() < m.size())
            .map(|m| m.host_id() + (id - m.container_id()))
            .unwrap_or(65534)
    };
    let uid = map(linux.uid_mappings(), user.uid());
    let gid = map(linux.gid_mappings(), user.gid());
    let mut groups: Vec<u32> = user
        .additional_gids()
        .as_deref()
        .unwrap_or_default()
        .iter()
        .map(|g| map(linux.gid_mappings(), *g))
        .collect();
    if !groups.contains(&gid) {
        groups.push(gid);
    }
    Ok(berth_spec::UserIds {
        uid,
        gid,
        groups,
        ..Default::default()
    })
}

fn namespace_flags(spec: &Spec) -> libc::c_int {
    let mut flags = 0;
    let namespaces = spec
        .linux()
        .as_ref()
        .and_then(|l| l.namespaces().as_deref())
        .unwrap_or_default();
    for ns in namespaces {
        flags |= match ns.typ() {
            LinuxNamespaceType::Pid => libc::CLONE_NEWPID,
            LinuxNamespaceType::Mount => libc::CLONE_NEWNS,
            LinuxNamespaceType::Ipc => libc::CLONE_NEWIPC,
            LinuxNamespaceType::Uts => libc::CLONE_NEWUTS,
            LinuxNamespaceType::Network => libc::CLONE_NEWNET,
            // Unshared by init once it is inside its cgroup, so the namespace is rooted there.
            LinuxNamespaceType::Cgroup => 0,
            _ => 0,
        };
    }
    flags
}

/// A short random container id.
fn new_id() -> String {
    let mut bytes = [0u8; 6];
    // SAFETY: getrandom writes at most `bytes.len()` bytes into the buffer.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if usize::try_from(n).ok() != Some(bytes.len()) {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        #[expect(
            clippy::cast_possible_truncation,
            reason = "only the low bits of the time are wanted: the id only needs to differ"
        )]
        let nanos = nanos as u64;
        bytes.copy_from_slice(&(nanos ^ u64::from(std::process::id())).to_le_bytes()[..6]);
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Kills and removes the container's cgroup on every exit path.
struct CgroupGuard {
    cgroup: Cgroup,
    kill_timeout: Duration,
}

impl Drop for CgroupGuard {
    fn drop(&mut self) {
        if self.cgroup.is_populated().unwrap_or(false) {
            let _ = self.cgroup.kill();
            let _ = self.cgroup.wait_empty(self.kill_timeout);
        }
        if let Err(e) = self.cgroup.remove() {
            tracing::warn!("{e}");
        }
    }
}

/// Reaps init if an error return leaves it behind (the cgroup guard has killed it by then).
struct ChildGuard(Pid);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = kill(self.0, Signal::SIGKILL);
        let _ = waitpid(self.0, None);
    }
}

struct MaskGuard(SigSet);

impl Drop for MaskGuard {
    fn drop(&mut self) {
        let _ = sigprocmask(SigmaskHow::SIG_SETMASK, Some(&self.0), None);
    }
}

/// Whether `path` is an existing directory usable as a root filesystem.
pub fn check_rootfs(path: &Path) -> Result<(), RuntimeError> {
    let why = match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => return Ok(()),
        Ok(_) => "not a directory".to_string(),
        Err(e) => e.to_string(),
    };
    Err(RuntimeError::Rootfs {
        path: path.to_path_buf(),
        why,
    })
}
