//! The SPANK entry points Slurm calls, per context:
//!
//! - srun (local), sbatch/salloc (allocator): register the options, fill unset ones from the
//!   environment, and pass the image and the staging requests to the Prolog and Epilog
//!   (`SPANK_BERTH_IMAGE`, `SPANK_BERTH_STAGE_IN`, `SPANK_BERTH_STAGE_OUT`).
//! - slurmstepd (remote), once per step and node: `user_init` fails the step when the job's
//!   stage-in failed (the Prolog left the reason next to the scratch), sets BERTH_SCRATCH for
//!   steps without a container, and for a container runs `berth step create` and opens
//!   the namespaces it reports; in each task, `task_init_privileged` (root) replaces the task's
//!   environment and `task_init` applies the task's rank plan (`--container-bind=closest`:
//!   variables, CPU affinity, memory policy), joins the namespaces and enters the working
//!   directory; when the last local task has ended (`task_exit`), or at the latest in `exit`,
//!   `berth step destroy` removes the container.
//!
//! Every entry point catches panics (none may unwind into Slurm) and reports failures as one
//! `berth: …` line, which srun prints on the user's terminal.

use std::ffi::{OsString, c_char, c_int};
use std::os::fd::OwnedFd;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Mutex, MutexGuard};

use crate::SpankError;
use crate::config::PluginConfig;
use crate::ffi::{self, Context, spank_t};
use crate::io_text;
use crate::join;
use crate::options::{FLAGS, Options};
use crate::request::{self, Created, Namespace, Step};
use crate::runner::{self, Invocation};

// The plugin's identity, as SPANK_PLUGIN(berth, 1) would declare it: slurmstepd checks that
// plugin_version's major.minor equal its own.
#[allow(non_upper_case_globals)]
#[unsafe(no_mangle)]
pub static plugin_name: [u8; 6] = *b"berth\0";
#[allow(non_upper_case_globals)]
#[unsafe(no_mangle)]
pub static plugin_type: [u8; 6] = *b"spank\0";
#[allow(non_upper_case_globals)]
#[unsafe(no_mangle)]
pub static plugin_version: u32 = ffi::SLURM_VERSION_NUMBER;
#[allow(non_upper_case_globals)]
#[unsafe(no_mangle)]
pub static spank_plugin_version: u32 = 1;

/// What the plugin knows about the current process's job step.
struct State {
    config: PluginConfig,
    options: Options,
    /// slurmstepd: this step gets a container.
    enabled: bool,
    step: Option<Step>,
    /// `berth step create` ran (successfully or not), so `berth step destroy` must run.
    create_ran: bool,
    /// `berth step destroy` ran.
    destroyed: bool,
    /// The node this slurmstepd runs on, as sent in the create request.
    node: Option<String>,
    /// The protocol version of berth's create answer (0: no answer): `--node` is passed to
    /// `berth step destroy` only when berth speaks protocol 2 or later.
    berth_protocol: u32,
    /// Local tasks that ended (slurmstepd).
    tasks_exited: u32,
    /// The line already shown for a failed `user_init`; the tasks fail with it.
    failure: Option<String>,
    container: Option<Container>,
}

struct Container {
    namespaces: Vec<(Namespace, OwnedFd)>,
    env: Vec<String>,
    cwd: String,
    /// Printed by the node's first task, whose stderr reaches srun.
    entrypoint_log: Option<String>,
    /// `--container-bind=closest`: each local task's CPUs, memory and variables.
    bind: Option<berth_proto::answer::Binding>,
    /// The step joined an existing container.
    attached: bool,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

fn state() -> MutexGuard<'static, Option<State>> {
    // A panic while holding the lock leaves consistent data (every update is a single store).
    STATE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// How an entry point fails: with a line for the user, or quietly when the line was shown
/// already.
enum Fail {
    Line(SpankError),
    Quiet,
}

impl From<SpankError> for Fail {
    fn from(line: SpankError) -> Self {
        Fail::Line(line)
    }
}

/// Runs an entry point, turning a failure into a logged line and -1, and a panic too.
fn guard(what: &str, f: impl FnOnce() -> Result<(), Fail>) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => 0,
        Ok(Err(Fail::Line(line))) => {
            ffi::log_error(line.to_string());
            -1
        }
        Ok(Err(Fail::Quiet)) => -1,
        Err(panic) => {
            let msg = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            ffi::log_error(format!(
                "berth: internal error in the SPANK plugin's {what}: {msg}: please report it"
            ));
            -1
        }
    }
}

fn berth_line(msg: impl std::fmt::Display) -> SpankError {
    SpankError::Step(format!("berth: {msg}"))
}

/// # Safety
/// Called by Slurm with a valid handle and `ac` plugstack.conf arguments in `av`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn slurm_spank_init(sp: spank_t, ac: c_int, av: *mut *mut c_char) -> c_int {
    guard("init", || {
        let config = PluginConfig::parse(&ffi::args(ac, av)).map_err(berth_line)?;
        let register = match ffi::context() {
            Context::Local | Context::Remote => true,
            // sbatch_support=0 keeps the container options from sbatch/salloc, not the staging
            // ones, which are the job's.
            Context::Allocator => true,
            _ => false,
        };
        let container_options = ffi::context() != Context::Allocator || config.sbatch_support;
        *state() = Some(State {
            config,
            options: Options::default(),
            enabled: false,
            step: None,
            create_ran: false,
            destroyed: false,
            node: None,
            berth_protocol: 0,
            tasks_exited: 0,
            failure: None,
            container: None,
        });
        if register {
            for (i, flag) in (0..).zip(FLAGS.iter()) {
                if flag.key.is_container() && !container_options {
                    continue;
                }
                ffi::register_option(sp, flag.name, flag.arginfo, flag.usage, i, option_callback)
                    .map_err(|e| {
                    berth_line(format!(
                        "cannot register --{}: {e}: another plugin in plugstack.conf (Pyxis?) \
                         may define it; keep one of them",
                        flag.name.to_string_lossy()
                    ))
                })?;
            }
        }
        Ok(())
    })
}

/// Called by Slurm for each `--container-*` option, with `val` = its index in `FLAGS`.
unsafe extern "C" fn option_callback(val: c_int, optarg: *const c_char, _remote: c_int) -> c_int {
    guard("option callback", || {
        let arg = if optarg.is_null() {
            None
        } else {
            // SAFETY: Slurm passes a NUL-terminated argument or NULL.
            Some(
                unsafe { std::ffi::CStr::from_ptr(optarg) }
                    .to_string_lossy()
                    .into_owned(),
            )
        };
        let mut guard = state();
        let Some(st) = guard.as_mut() else {
            return Ok(());
        };
        st.options
            .apply_flag(usize::try_from(val).unwrap_or(usize::MAX), arg.as_deref())
            .map_err(berth_line)?;
        Ok(())
    })
}

/// # Safety
/// Called by Slurm with a valid handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn slurm_spank_init_post_opt(
    sp: spank_t,
    _ac: c_int,
    _av: *mut *mut c_char,
) -> c_int {
    guard("init_post_opt", || {
        let ctx = ffi::context();
        let mut guard = state();
        let Some(st) = guard.as_mut() else {
            return Ok(());
        };
        match ctx {
            Context::Local | Context::Allocator => {
                if ctx == Context::Allocator && !st.config.sbatch_support {
                    // Only the staging options were registered: take only those.
                    st.options
                        .apply_env(|k| {
                            std::env::var(k)
                                .ok()
                                .filter(|_| k.starts_with("BERTH_STAGE_"))
                        })
                        .map_err(berth_line)?;
                    pass_stage_env(sp, &st.options);
                    return Ok(());
                }
                st.options
                    .apply_env(|k| std::env::var(k).ok())
                    .map_err(berth_line)?;
                for line in st.options.ignored() {
                    ffi::log_user(berth_line(line).to_string());
                }
                if let Some(image) = &st.options.image
                    // A relative path is the step's working directory's, which the Prolog does
                    // not know.
                    && !image.starts_with('.')
                {
                    // The Prolog (`berth prolog`) imports it before the step starts. Inside an
                    // existing allocation the Prolog has already run and this is refused.
                    if let Err(e) = ffi::job_control_setenv(sp, "BERTH_IMAGE", image) {
                        ffi::log_debug(format!("berth: BERTH_IMAGE not passed to the Prolog: {e}"));
                    }
                }
                pass_stage_env(sp, &st.options);
                Ok(())
            }
            Context::Remote => remote_post_opt(sp, st),
            _ => Ok(()),
        }
    })
}

/// Hands the staging requests to the Prolog and Epilog.
fn pass_stage_env(sp: spank_t, options: &Options) {
    for (name, value) in options.stage_env() {
        // Refused inside an existing allocation, whose Prolog has run: a batch script's srun
        // inherits the job's staging options, so this is no error.
        if let Err(e) = ffi::job_control_setenv(sp, name, &value) {
            ffi::log_debug(format!(
                "berth: {name} not passed to the Prolog/Epilog: {e}"
            ));
        }
    }
}

fn remote_post_opt(sp: spank_t, st: &mut State) -> Result<(), Fail> {
    st.options
        .apply_env(|k| ffi::getenv(sp, k))
        .map_err(berth_line)?;
    if !st.options.enabled() {
        return Ok(());
    }
    let item = |item, what: &str| {
        ffi::get_u32(sp, item)
            .map_err(|e| berth_line(format!("cannot read the step's {what}: {e}")))
    };
    let step_id = item(ffi::S_JOB_STEPID, "id")?;
    let wanted = match step_id {
        ffi::SLURM_EXTERN_CONT | ffi::SLURM_INTERACTIVE_STEP => false,
        ffi::SLURM_BATCH_SCRIPT => st.config.sbatch_support,
        _ => true,
    };
    if !wanted {
        return Ok(());
    }
    st.step = Some(Step {
        job_id: item(ffi::S_JOB_ID, "job id")?,
        step_id,
        uid: item(ffi::S_JOB_UID, "uid")?,
        gid: item(ffi::S_JOB_GID, "gid")?,
        local_task_count: item(ffi::S_JOB_LOCAL_TASK_COUNT, "local task count")?,
    });
    st.enabled = true;
    Ok(())
}

/// # Safety
/// Called by Slurm with a valid handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn slurm_spank_user_init(
    sp: spank_t,
    _ac: c_int,
    _av: *mut *mut c_char,
) -> c_int {
    guard("user_init", || {
        let mut guard = state();
        let Some(st) = guard.as_mut() else {
            return Ok(());
        };
        if st.failure.is_some() {
            return Ok(());
        }
        match job_scratch(sp, st) {
            Ok(()) => {}
            Err(line) => {
                ffi::log_error(&line);
                st.failure = Some(line.to_string());
                return Ok(());
            }
        }
        if !st.enabled || st.container.is_some() || st.create_ran {
            return Ok(());
        }
        match create(sp, st) {
            Ok(container) => {
                if container.attached && !st.options.mounts.is_empty() {
                    // As Pyxis warns: the mounts of a container are those it was made with.
                    ffi::log_error(berth_line(
                        "warning: ignoring --container-mounts: the step joins an existing \
                         container, whose mounts were set when it was made",
                    ));
                }
                st.container = Some(container);
                Ok(())
            }
            Err(line) => {
                // Slurm 22.05 reports a failed user_init to srun but srun still exits 0
                // (SchedMD bug 7573): show the line now, and fail every task with it in
                // task_init_privileged, which does make srun exit non-zero.
                ffi::log_error(&line);
                st.failure = Some(line.to_string());
                Ok(())
            }
        }
    })
}

/// The job's scratch, for every step but the extern one: the reason its stage-in failed (the
/// step fails with it), else BERTH_SCRATCH for a step without a container (a container gets
/// its own path from berth).
fn job_scratch(sp: spank_t, st: &mut State) -> Result<(), SpankError> {
    let item = |item, what: &str| {
        ffi::get_u32(sp, item)
            .map_err(|e| berth_line(format!("cannot read the step's {what}: {e}")))
    };
    let step_id = item(ffi::S_JOB_STEPID, "id")?;
    if step_id == ffi::SLURM_EXTERN_CONT {
        return Ok(());
    }
    let job = item(ffi::S_JOB_ID, "job id")?;
    let root = crate::config::job_scratch_root(st.config.config.as_deref()).map_err(berth_line)?;
    // Written by `berth prolog` (root-owned, next to the user's scratch): one line.
    let failed = root.join(format!("{job}.stage-in-failed"));
    if let Ok(line) = std::fs::read_to_string(&failed) {
        return Err(SpankError::Step(line.trim_end().to_string()));
    }
    let dir = root.join(job.to_string());
    if !st.enabled && dir.is_dir() {
        ffi::setenv(sp, "BERTH_SCRATCH", &dir.to_string_lossy())
            .map_err(|e| berth_line(format!("cannot set BERTH_SCRATCH for the step: {e}")))?;
    }
    Ok(())
}

/// Runs berth; a failure to start it becomes the one line the user sees.
fn start_berth(inv: &Invocation) -> Result<runner::Outcome, SpankError> {
    runner::run(inv).map_err(|e| {
        berth_line(format!(
            "cannot run {}: {}: check berth= in plugstack.conf",
            inv.program.display(),
            io_text(&e)
        ))
    })
}

/// Runs berth; a failure to start it or a non-zero exit becomes the one line the user sees.
fn run_berth(inv: &Invocation, what: &str) -> Result<runner::Outcome, SpankError> {
    let outcome = start_berth(inv)?;
    if !outcome.status.success() {
        return Err(SpankError::Step(request::failure_line(
            &outcome.stderr,
            what,
            &outcome.describe(),
        )));
    }
    Ok(outcome)
}

fn berth_invocation(config: &PluginConfig, verb: &[&str], stdin: Vec<u8>) -> Invocation {
    let mut args: Vec<OsString> = Vec::new();
    if let Some(c) = &config.config {
        args.push("--config".into());
        args.push(c.into());
    }
    args.extend(verb.iter().map(OsString::from));
    Invocation {
        program: config.berth.clone(),
        args,
        stdin,
        env: Vec::new(),
    }
}

fn create(sp: spank_t, st: &mut State) -> Result<Container, SpankError> {
    let step = st
        .step
        .clone()
        .ok_or_else(|| berth_line("no step information"))?;
    let mut job_env = ffi::job_env(sp)
        .map_err(|e| berth_line(format!("cannot read the job's environment: {e}")))?;
    // Slurm's mpi/pmix plugin sets PMIX_SERVER_TMPDIR in slurmstepd's own environment before
    // user_init; tasks get it (and the other PMIX_* variables) only later, when they start.
    // berth bind-mounts the directory into the container, so PMIx clients reach the server's
    // shared-memory data store: pass it on.
    request::add_missing(
        &mut job_env,
        "PMIX_SERVER_TMPDIR",
        std::env::var("PMIX_SERVER_TMPDIR").ok(),
    );
    let mut options = st.options.clone();
    if step.step_id == ffi::SLURM_BATCH_SCRIPT {
        // slurmstepd executes the batch script from its spool directory on the host: the script
        // must be at the same path inside the container (read-only), as Pyxis does.
        let argv = ffi::job_argv(sp)
            .map_err(|e| berth_line(format!("cannot read the batch script's path: {e}")))?;
        let script = argv
            .first()
            .ok_or_else(|| berth_line("the batch step has no script"))?;
        options.add_batch_script(script).map_err(berth_line)?;
    }
    let request = request::create_request(&step, &options.to_json(), &st.config, &job_env)
        .map_err(berth_line)?;
    st.node = request.node.clone();
    let request = request.to_json();
    if let Some(dir) = &st.config.debug_request_dir {
        let path = dir.join(format!("{}.{}.json", step.job_id, step.step_id));
        if let Err(e) = std::fs::write(&path, &request) {
            ffi::log_info(format!(
                "berth: cannot write {}: {}",
                path.display(),
                io_text(&e)
            ));
        }
    }
    let inv = berth_invocation(&st.config, &["step", "create"], request.into_bytes());
    st.create_ran = true;
    let mut pyxis = PyxisImport::new(sp, st);
    pyxis.before();
    let outcome = start_berth(&inv)?;
    if !outcome.status.success() {
        if berth_proto::answer::import_failed(&outcome.stderr) {
            pyxis.failed();
        }
        return Err(SpankError::Step(request::failure_line(
            &outcome.stderr,
            "step create",
            &outcome.describe(),
        )));
    }
    let created = Created::parse(&outcome.stdout).map_err(berth_line)?;
    if !created.attached {
        pyxis.imported();
    }
    st.berth_protocol = created.protocol;
    let mut namespaces = Vec::new();
    for (ns, path) in request::join_order(&created).map_err(berth_line)? {
        let fd = join::with_root_euid(|| join::open_namespace(path))
            .and_then(|r| r)
            .map_err(|e| {
                berth_line(format!(
                    "cannot open the container's {} namespace {path}: {} (did its holder process {} exit?)",
                    ns.key(),
                    io_text(&e),
                    created.pid
                ))
            })?;
        namespaces.push((ns, fd));
    }
    ffi::log_debug(format!("berth: step container {} ready", created.id));
    Ok(Container {
        namespaces,
        env: created.env,
        cwd: created.cwd,
        entrypoint_log: created.entrypoint_log,
        bind: created.bind,
        attached: created.attached,
    })
}

/// Pyxis's lines about a registry image (`pyxis_messages=1`), where Pyxis prints them: in
/// slurmstepd, `importing docker image: IMAGE` before the import when the job has one task (Pyxis
/// is terse for many), then `imported docker image: IMAGE` or `failed to import docker image`;
/// none when the step joins an existing container (nothing is imported). Whether a named
/// container exists is berth's to know: for one the `importing` line waits for its answer.
struct PyxisImport {
    /// The registry image, when the lines are wanted.
    image: Option<String>,
    /// Pyxis's `importing` line is wanted (the job's total task count is at most one).
    verbose: bool,
    /// The step may join an existing container (it names one).
    may_join: bool,
    importing_shown: bool,
}

impl PyxisImport {
    fn new(sp: spank_t, st: &State) -> Self {
        let image = st
            .options
            .image
            .clone()
            .filter(|i| st.config.pyxis_messages && request::is_registry_image(i));
        // Pyxis reads S_JOB_TOTAL_TASK_COUNT: 0 for the batch step, which counts as one.
        let verbose = ffi::get_u32(sp, ffi::S_JOB_TOTAL_TASK_COUNT).is_ok_and(|n| n <= 1);
        PyxisImport {
            image,
            verbose,
            may_join: st.options.name.is_some(),
            importing_shown: false,
        }
    }

    fn importing(&mut self) {
        if let (Some(image), true, false) = (&self.image, self.verbose, self.importing_shown) {
            ffi::log_user(format!("pyxis: importing docker image: {image}"));
            self.importing_shown = true;
        }
    }

    fn before(&mut self) {
        if !self.may_join {
            self.importing();
        }
    }

    fn imported(&mut self) {
        self.importing();
        if let Some(image) = &self.image {
            ffi::log_user(format!("pyxis: imported docker image: {image}"));
        }
    }

    fn failed(&mut self) {
        self.importing();
        if self.image.is_some() {
            ffi::log_error("pyxis: failed to import docker image");
        }
    }
}

/// # Safety
/// Called by Slurm with a valid handle, in the task's process, as root.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn slurm_spank_task_init_privileged(
    sp: spank_t,
    _ac: c_int,
    _av: *mut *mut c_char,
) -> c_int {
    guard("task_init_privileged", || {
        let guard = state();
        let Some(st) = guard.as_ref() else {
            return Ok(());
        };
        if st.failure.is_some() {
            // Already shown by user_init (srun prints it; in a batch job slurmstepd writes it
            // to the job's error file); failing the task is what makes srun exit non-zero.
            return Err(Fail::Quiet);
        }
        if !st.enabled {
            return Ok(());
        }
        let Some(c) = &st.container else {
            return Err(berth_line("the step's container was not created").into());
        };
        join::keep_caps_across_setuid().map_err(|e| {
            berth_line(format!(
                "cannot keep the capabilities to join the container: {}",
                io_text(&e)
            ))
        })?;
        let current = ffi::job_env(sp)
            .map_err(|e| berth_line(format!("cannot read the task's environment: {e}")))?;
        let (unset, set) = request::env_changes(&current, &c.env);
        for name in unset {
            ffi::unsetenv(sp, &name)
                .map_err(|e| berth_line(format!("cannot unset {name} for the task: {e}")))?;
        }
        for (name, value) in set {
            ffi::setenv(sp, &name, &value)
                .map_err(|e| berth_line(format!("cannot set {name} for the task: {e}")))?;
        }
        Ok(())
    })
}

/// # Safety
/// Called by Slurm with a valid handle, in the task's process, as the job's user.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn slurm_spank_task_init(
    sp: spank_t,
    _ac: c_int,
    _av: *mut *mut c_char,
) -> c_int {
    guard("task_init", || {
        let guard = state();
        let Some(st) = guard.as_ref() else {
            return Ok(());
        };
        let (true, Some(c)) = (st.enabled, &st.container) else {
            return Ok(());
        };
        if let Some(log) = &c.entrypoint_log
            && ffi::get_u32(sp, ffi::S_TASK_ID).is_ok_and(|t| t == 0)
        {
            // This task's stderr is the user's (srun's); slurmstepd's log lines are not.
            use std::io::Write;
            let _ = std::io::stderr().write_all(log.as_bytes());
        }
        pin_task(sp, c)?;
        // As Enroot's Slurm hook: PMIx clients in the image read their MCA variables, which
        // Slurm's PMIx server sets under other names.
        for (name, value) in request::pmix_mca(|k| ffi::getenv(sp, k)) {
            ffi::setenv(sp, name, &value)
                .map_err(|e| berth_line(format!("cannot set {name} for the task: {e}")))?;
        }
        join::enter(&c.namespaces).map_err(berth_line)?;
        // As the job's user, without capabilities: the directory is checked with its rights.
        // `PATH: No such file or directory`, as Pyxis words it and job scripts grep.
        std::env::set_current_dir(&c.cwd).map_err(|e| {
            berth_line(format!(
                "cannot enter the working directory in the container: {}: {}: give an \
                 existing directory as --container-workdir",
                c.cwd,
                io_text(&e)
            ))
        })?;
        Ok(())
    })
}

/// `--container-bind=closest`: sets the task's rank variables (after Slurm's GRES variables,
/// which it replaces), then pins its CPUs and memory (after Slurm's task affinity). A rank berth
/// did not plan keeps Slurm's placement.
fn pin_task(sp: spank_t, c: &Container) -> Result<(), Fail> {
    let Some(bind) = &c.bind else {
        return Ok(());
    };
    let local = ffi::getenv(sp, "SLURM_LOCALID").and_then(|v| v.trim().parse::<u32>().ok());
    let Some(rank) = local.and_then(|r| bind.rank(r)) else {
        ffi::log_info(berth_line(format!(
            "no placement planned for local task {}: leaving it to Slurm",
            local.map_or("?".to_string(), |r| r.to_string())
        )));
        return Ok(());
    };
    for entry in &rank.env {
        // Created::parse checked that every entry has a name and a '='.
        let (name, value) = entry.split_once('=').unwrap_or((entry, ""));
        ffi::setenv(sp, name, value)
            .map_err(|e| berth_line(format!("cannot set {name} for the task: {e}")))?;
    }
    for note in crate::pin::apply(rank, bind.memory_policy).notes {
        ffi::log_info(berth_line(format!("local task {}: {note}", rank.rank)));
    }
    Ok(())
}

/// # Safety
/// Called by Slurm with a valid handle, in slurmstepd, once per local task that ended.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn slurm_spank_task_exit(
    _sp: spank_t,
    _ac: c_int,
    _av: *mut *mut c_char,
) -> c_int {
    guard("task_exit", || {
        let mut guard = state();
        let Some(st) = guard.as_mut() else {
            return Ok(());
        };
        st.tasks_exited += 1;
        let all = st.step.as_ref().map_or(0, |s| s.local_task_count);
        if st.tasks_exited >= all {
            // The container's last task ended: remove it now rather than in `exit`, which
            // Slurm calls only after it has tried to remove the step's cgroups (which the
            // container's holder process, forked from slurmstepd, would keep busy).
            destroy(st)?;
        }
        Ok(())
    })
}

/// # Safety
/// Called by Slurm with a valid handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn slurm_spank_exit(
    _sp: spank_t,
    _ac: c_int,
    _av: *mut *mut c_char,
) -> c_int {
    guard("exit", || {
        let mut guard = state();
        let Some(mut st) = guard.take() else {
            return Ok(());
        };
        if ffi::context() != Context::Remote {
            return Ok(());
        }
        destroy(&mut st)?;
        Ok(())
    })
}

/// Runs `berth step destroy` once, if `berth step create` ran (it may have created part of a
/// container before failing). Named containers are berth's to keep.
fn destroy(st: &mut State) -> Result<(), SpankError> {
    if !st.create_ran || st.destroyed {
        return Ok(());
    }
    st.destroyed = true;
    // Close the namespace descriptors before berth tears the container down.
    st.container = None;
    let Some(step) = &st.step else {
        return Ok(());
    };
    let (job, stepid) = (step.job_id.to_string(), step.step_id.to_string());
    let mut args = vec!["step", "destroy", "--job-id", &job, "--step-id", &stepid];
    // An older berth does not know `--node` (and would fail the destroy on it).
    if let (Some(node), true) = (&st.node, st.berth_protocol >= 2) {
        args.extend(["--node", node]);
    }
    let inv = berth_invocation(&st.config, &args, Vec::new());
    run_berth(&inv, "step destroy")?;
    Ok(())
}
