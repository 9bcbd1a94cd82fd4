//! The container of a Slurm job step, as the SPANK plugin asks for it from slurmstepd: made
//! (or found, for a named container) from the versioned request, and removed when the step ends.

use std::collections::BTreeMap;

use berth_proto::answer::Created as Answer;
use berth_runtime::{self as runtime, state};
use berth_spec as spec;
use berth_topology::job::Job;
use berth_topology::plan::{self, BindMode, PlanOptions};
use berth_topology::{Host, Node, cpu, inject};

use crate::SlurmError;
use crate::config::Config;
use crate::container::{Description, host_files, options};
use crate::request::{
    self as slurm_step, NameMode, Scope, StepExt, StepRequest, TaskBinding, parse_name, to_request,
};

/// A request from the plugin, read: what this berth did not know of a newer plugin's request is
/// in `ignored` (the caller logs it once it knows the job).
pub use berth_proto::step::Parsed;

/// Reads the plugin's request (JSON, as `berth step create` gets it on stdin).
pub fn parse(text: &str) -> Result<Parsed, SlurmError> {
    StepRequest::parse(text)
        .map_err(|e| SlurmError::input(format!("invalid step request from the SPANK plugin: {e}")))
}

fn label(labels: &BTreeMap<String, String>, key: &str) -> String {
    labels.get(key).cloned().unwrap_or_default()
}

/// Whether a container belongs to `node`: one made on it, or without a node (made by a berth
/// or plugin that did not know it), or any when the node is unknown.
pub fn on_node(labels: &BTreeMap<String, String>, node: Option<&str>) -> bool {
    match (node, labels.get("node")) {
        (Some(want), Some(have)) => want == have,
        _ => true,
    }
}

/// Makes the step's container (or finds the named one it joins) and says how tasks join it.
pub fn create(config: &Config, parsed: Parsed) -> Result<Answer, SlurmError> {
    let step = parsed.request;
    if !parsed.ignored.is_empty() {
        tracing::warn!(
            "the SPANK plugin speaks protocol {} (this berth {}): ignored what this berth does not know: {}",
            step.protocol,
            berth_proto::VERSION,
            berth_sys::text::list(&parsed.ignored, "none")
        );
    }
    let node = step.node_name();
    let bind = step.bind_mode(config.topology.bind)?;
    let opts = options(config, None);
    let mut labels = BTreeMap::from([
        ("job".to_string(), step.job_id.to_string()),
        ("step".to_string(), step.step_id.to_string()),
        ("uid".to_string(), step.uid.to_string()),
    ]);
    if let Some(node) = &node {
        labels.insert("node".into(), node.clone());
    }
    if let Some(name_opt) = &step.options.container_name {
        let (name, mode) = parse_name(name_opt)?;
        if let Some(record) = named(&step, config, node.as_deref(), &name, mode)? {
            return join_named(&step, config, &record, &name, bind);
        }
        labels.insert("name".into(), name);
        let scope = match step.plugin.container_scope {
            Scope::Job => "job",
            Scope::Global => "global",
        };
        labels.insert("scope".into(), scope.into());
    }
    if let Some(save_text) = &step.options.container_save {
        let save = save_target(&step, save_text)?;
        labels.insert("save".into(), save.display().to_string());
        labels.insert("gid".into(), step.gid.to_string());
    }
    let image_text = step.options.container_image.as_deref().ok_or_else(|| {
        SlurmError::input("no --container-image given (and no existing --container-name to use)")
    })?;
    let image_text = image_on_host(&step, image_text)?;
    let user = berth_sys::user::by_id(step.uid, step.gid);
    let image_text = crate::lazy::site_form(&image_text, config, &user).unwrap_or(image_text);
    let image = crate::container::resolve(&image_text, config, &user, None)
        .map_err(|e| SlurmError::ImageUnavailable(Box::new(e.into())))?;
    let mut req = request(&step, config, &user, &image)?;
    if step
        .options
        .container_slurm
        .unwrap_or(config.host_software.slurm)
    {
        let what = "--container-slurm";
        req.mounts
            .extend(crate::hostsw::slurm_binds(config, &image.lowers, what)?);
    }
    if step
        .options
        .container_modules
        .unwrap_or(config.host_software.modules)
    {
        let what = "--container-modules";
        req.mounts
            .extend(crate::hostsw::module_binds(config, &image.lowers, what)?);
    }
    let mpi = match step.options.container_mpi.as_deref() {
        Some(choice) => crate::mpi::parse_choice(choice, "--container-mpi")?,
        None => config.host_software.mpi,
    };
    if mpi {
        let what = "--container-mpi=host";
        req.mounts
            .extend(crate::mpi::mpi_binds(config, &image.lowers, what)?);
        crate::mpi::with_library_path(&mut req.env);
    }
    let mut spec = spec::build(&req).map_err(|e| SlurmError::input(e.to_string()))?;
    slurm_step::adjust_spec(&step, &mut spec, &config.runtime.step_unshare)?;
    let topo = StepTopology::discover(&step, config)?;
    let binding = topo.binding(bind, config)?;
    // Kept until the container exists: its /etc/ld.so.cache is a bind of this file.
    let _loader_cache = topo.inject_devices(&mut spec, &image.lowers, config)?;
    if let Some(digest) = &image.digest {
        labels.insert("image".into(), digest.clone());
    }
    let created =
        runtime::create(&spec, &image.lowers, &opts, &labels).map_err(SlurmError::Runtime)?;
    let use_entrypoint = step
        .options
        .container_entrypoint
        .unwrap_or(step.plugin.execute_entrypoint);
    let entrypoint = step_entrypoint(&image.defaults.entrypoint, &image.lowers);
    let mut log = None;
    if use_entrypoint && !entrypoint.is_empty() {
        match entrypoint_run(config, &created.id, &entrypoint, &mut spec) {
            Ok(output) => {
                if step.options.container_entrypoint_log == Some(true) {
                    log = Some(output);
                }
            }
            Err(e) => {
                let _ = runtime::remove(&opts, &created.id);
                return Err(e);
            }
        }
    }
    let mut description = Description::new(&created, &spec);
    description.entrypoint_log = log;
    Ok(answer(&description, binding, false))
}

/// `--container-image` as berth resolves it: a path starting with `.` (`./x.sqsh`, `../img`) is
/// the step's working directory's, as Pyxis takes it (and as `--container-save` is); anything
/// else as given.
fn image_on_host(step: &StepRequest, text: &str) -> Result<String, SlurmError> {
    if !text.starts_with('.') {
        return Ok(text.to_string());
    }
    step.host_path(text)
        .map(|p| p.display().to_string())
        .map_err(|e| SlurmError::input(format!("--container-image={text}: {e}")))
}

/// The running container `--container-name=NAME[:MODE]` names for this step's user on this node
/// (with the job's scope, or Pyxis's `JOBID.STEPID` for another step's unnamed one), or `None`
/// when one is to be made; the mode's refusals (`create` of an existing one, `exec` of none).
fn named(
    step: &StepRequest,
    config: &Config,
    node: Option<&str>,
    name: &str,
    mode: NameMode,
) -> Result<Option<state::Record>, SlurmError> {
    let records = state::list(&config.runtime.state_dir);
    let mine = |r: &state::Record| {
        state::owner_alive(r)
            && label(&r.labels, "uid") == step.uid.to_string()
            && on_node(&r.labels, node)
    };
    let existing = records
        .iter()
        .position(|r| {
            mine(r)
                && label(&r.labels, "name") == name
                && (step.plugin.container_scope == Scope::Global
                    || label(&r.labels, "job") == step.job_id.to_string())
        })
        // Pyxis's `JOBID.STEPID`: the unnamed container of a running step of this job.
        .or_else(|| {
            let (job, stepid) = step_ids(name)?;
            (job == step.job_id).then_some(())?;
            records.iter().position(|r| {
                mine(r)
                    && !r.labels.contains_key("name")
                    && label(&r.labels, "job") == job.to_string()
                    && label(&r.labels, "step") == stepid.to_string()
            })
        });
    match (existing, mode) {
        (Some(_), NameMode::Create) => Err(SlurmError::input(format!(
            "container '{name}' exists already (--container-name={name}:create)"
        ))),
        (None, NameMode::Exec) => Err(SlurmError::input(format!(
            "no container named '{name}' (--container-name={name}:exec needs one)"
        ))),
        (Some(i), NameMode::Exec) if !in_use(records[i].init_pid) => {
            Err(SlurmError::input(format!(
                "container '{name}' is not running: none of its steps runs now, and \
                 --container-name={name}:exec only joins a running container (as in Pyxis); \
                 use --container-name={name} to run in it anyway"
            )))
        }
        (existing, _) => Ok(existing.and_then(|i| records.into_iter().nth(i))),
    }
}

/// Whether a process other than berth's holder `holder` is in the holder's mount namespace: a
/// task of a step that runs in the container (tasks join its namespaces, not its cgroup), or
/// one such a step left running.
fn in_use(holder: i32) -> bool {
    let ns = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/mnt")).ok();
    let holder = holder.to_string();
    let Some(theirs) = ns(&holder) else {
        return false;
    };
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|pid| pid.bytes().all(|b| b.is_ascii_digit()) && *pid != holder)
        .any(|pid| ns(&pid).as_ref() == Some(&theirs))
}

/// The answer for a step that joins the existing container `record`, whose mounts and
/// namespaces are that container's, whatever this step's options say.
fn join_named(
    step: &StepRequest,
    config: &Config,
    record: &state::Record,
    name: &str,
    bind: BindMode,
) -> Result<Answer, SlurmError> {
    let (_, spec) = runtime::join::held(&options(config, None), &record.id)?;
    let created = runtime::Created {
        id: record.id.clone(),
        pid: record.init_pid,
        timings: Vec::new(),
    };
    let mut description = Description::new(&created, &spec);
    // Asking for a namespace of its own cannot be granted by joining a container that shares
    // the host's (Pyxis fails too, in these words).
    let asked = slurm_step::unshare(&step.options, &[])?;
    for (wanted, ns, pyxis) in [
        (asked.net, "net", "network"),
        (asked.ipc, "ipc", "IPC"),
        (asked.uts, "uts", "UTS"),
    ] {
        if wanted && !description.namespaces.contains_key(ns) {
            return Err(SlurmError::input(format!(
                "--container-unshare={ns}: container '{name}' is not in a separate {pyxis} \
                 namespace (it was made without --container-unshare={ns}): give a \
                 new --container-name or drop --container-unshare={ns}"
            )));
        }
    }
    remap_of_joining_step(step, record, &spec, name, &mut description)?;
    let topo = StepTopology::discover(step, config)?;
    let binding = topo.binding(bind, config)?;
    Ok(answer(&description, binding, true))
}

/// A joining step's own `--[no-]container-remap-root` (Pyxis applies each step's). A remapped
/// container's tasks are root of its user namespace; a step asking not to be joins every
/// namespace but that one, so its tasks run as the job's user, as in a container made without
/// remapping (the mount and other namespaces stay the container's; the user namespace grants
/// nothing outside it, so leaving it out gives the task less, never more). The reverse cannot
/// be granted: the container's namespaces are not its tasks' to administer, and a user
/// namespace of the step's own would give them root's name without root's rights there
/// (`mount: must be superuser`), so it is refused.
fn remap_of_joining_step(
    step: &StepRequest,
    record: &state::Record,
    spec: &oci_spec::runtime::Spec,
    name: &str,
    description: &mut Description,
) -> Result<(), SlurmError> {
    let as_root = spec.process().as_ref().is_some_and(|p| p.user().uid() == 0);
    let remapped = as_root && record.uid() != 0;
    match step.options.container_remap_root {
        Some(true) if !remapped && step.uid != 0 => Err(SlurmError::input(format!(
            "--container-remap-root: container '{name}' was made without \
             --container-remap-root and a step joining it shares its namespaces, which cannot \
             make its tasks root: give --container-remap-root to the step that makes it, or \
             use a new --container-name"
        ))),
        Some(false) if remapped => {
            description.namespaces.remove("user");
            Ok(())
        }
        _ => Ok(()),
    }
}

/// `--container-save`'s file on the host (a relative path is the step's working directory's, as
/// in Pyxis), checked now that the job's user can write there: a job must not run for hours to
/// lose its container at the end.
fn save_target(step: &StepRequest, save_text: &str) -> Result<std::path::PathBuf, SlurmError> {
    let save = step
        .host_path(save_text)
        .map_err(|e| SlurmError::input(format!("--container-save={save_text}: {e}")))?;
    check_save_target(&save, step.uid, step.gid).map_err(|e| {
        let resolved = if save_text.starts_with('/') {
            String::new()
        } else {
            format!(" ({})", save.display())
        };
        SlurmError::input(format!(
            "--container-save={save_text}: uid {} cannot write it{resolved}: {e}; give a path the job's user can write",
            step.uid,
        ))
    })?;
    Ok(save)
}

/// The container request of a step on `image`: the plugin's options, the job's scratch at
/// `scratch.container_path`, Slurm's cgroup limits at /sys/fs/cgroup; refused when the
/// environment is over the limits or the user cannot read a mount's source.
fn request(
    step: &StepRequest,
    config: &Config,
    user: &berth_spec::UserIds,
    image: &crate::container::Resolved,
) -> Result<berth_spec::Request, SlurmError> {
    let mut req = to_request(
        step,
        user.clone(),
        &image.lowers,
        &image.defaults,
        host_files(),
    )?;
    config
        .store
        .env_limits()
        .check(
            "the step's environment (the job's and the image's)",
            &req.env,
        )
        .map_err(|e| SlurmError::input(e.to_string()))?;
    // The job's scratch (made by the Prolog) appears at scratch.container_path.
    if let Ok(dir) = berth_stage::scratch::path(&config.scratch.root, &step.job_id.to_string())
        && dir.is_dir()
    {
        let inside = config.scratch.container_path.clone();
        req.env
            .push(("BERTH_SCRATCH".into(), inside.display().to_string()));
        req.mounts.push(berth_spec::BindMount {
            source: dir,
            destination: inside,
            readonly: false,
        });
    }
    // Slurm's limits for the step are what programs inside must see at /sys/fs/cgroup.
    req.cgroup_view = crate::cgroup::current_views(step.job_id, step.step_id)
        .into_iter()
        .map(|v| berth_spec::BindMount {
            source: v.host,
            destination: std::path::Path::new("/sys/fs/cgroup").join(v.inside),
            readonly: true,
        })
        .collect();
    // Opened as the user, only to word the refusal: the runtime opens each source again as the
    // user and mounts what it opened, never the path as root.
    let home = match step.options.container_mount_home {
        Some(true) => slurm_step::home_to_mount(step, user)?,
        _ => None,
    };
    for m in &req.mounts {
        if let Err(e) = runtime::mounts::open_source_as_user(
            &m.source,
            user,
            config.runtime.mount_block_devices,
        ) {
            if runtime::mounts::is_block_refusal(&e) {
                return Err(SlurmError::input(format!(
                    "--container-mounts: {} is {e}",
                    m.source.display()
                )));
            }
            let what = if home.as_ref() == Some(&m.source) {
                "--container-mount-home (the job's HOME)"
            } else {
                "--container-mounts"
            };
            return Err(SlurmError::input(mount_refusal(
                what, &m.source, user.uid, &e,
            )));
        }
    }
    Ok(req)
}

/// The one line refusing a mount source the user could not open: a missing one in Pyxis's
/// words (`source path does not exist`), which job scripts grep.
fn mount_refusal(what: &str, source: &std::path::Path, uid: u32, e: &std::io::Error) -> String {
    if e.kind() == std::io::ErrorKind::NotFound {
        return format!(
            "{what}: {}: source path does not exist (as uid {uid} sees it): give an existing path",
            source.display()
        );
    }
    format!("{what}: uid {uid} cannot read {}: {e}", source.display())
}

/// Runs the image's entrypoint in the new container `id` (`--container-entrypoint`) and keeps
/// the environment it set in `spec` (saved, for named containers' later steps); its output.
fn entrypoint_run(
    config: &Config,
    id: &str,
    entrypoint: &[String],
    spec: &mut oci_spec::runtime::Spec,
) -> Result<String, SlurmError> {
    let run = runtime::join::run_entrypoint(
        &options(config, None),
        id,
        entrypoint,
        std::time::Duration::from_secs(config.runtime.entrypoint_timeout_s),
    )
    // The image's entrypoint failing is the job's problem; keeping what it set is the node's.
    .map_err(|e| SlurmError::input(e.to_string()))?;
    if let (Some(env), Some(process)) = (run.env, spec.process_mut()) {
        process.set_env(Some(env));
        state::save_spec(&config.runtime.state_dir, id, spec)
            .map_err(|e| SlurmError::host(format!("saving the entrypoint's environment: {e}")))?;
    }
    Ok(run.output)
}

/// The entrypoint `--container-entrypoint` runs: the image's, or for an image without one that
/// has Enroot's `/etc/rc` (every Enroot image), that script, as `enroot start` runs it.
fn step_entrypoint(image: &[String], lowers: &[std::path::PathBuf]) -> Vec<String> {
    if !image.is_empty() {
        return image.to_vec();
    }
    let rc = berth_image::synth::ENROOT_RC.trim_start_matches('/');
    // Looked at beneath each layer, following none of the image's symlinks.
    let is_file = |layer: &std::path::PathBuf| {
        std::fs::File::open(layer)
            .and_then(|dir| {
                berth_runtime::mounts::path_beneath(&dir, std::path::Path::new(rc))
                    .map_err(std::io::Error::from)
            })
            .and_then(|fd| std::fs::File::from(fd).metadata())
            .is_ok_and(|m| m.is_file())
    };
    if lowers.iter().any(is_file) {
        return vec!["/bin/sh".into(), berth_image::synth::ENROOT_RC.into()];
    }
    Vec::new()
}

/// The line `berth step create` prints on stderr before its error when the image could not be
/// imported: the SPANK plugin then prints Pyxis's "failed to import docker image" line.
pub use berth_proto::answer::IMPORT_FAILED_MARKER;

/// `JOBID.STEPID` (Pyxis's name for a running step's unnamed container).
fn step_ids(name: &str) -> Option<(u64, u64)> {
    let (job, step) = name.split_once('.')?;
    let num = |s: &str| {
        (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse::<u64>().ok())
            .flatten()
    };
    Some((num(job)?, num(step)?))
}

/// `berth step create`'s answer in the protocol's terms: the container, and with
/// `--container-bind=closest` what each local task is pinned to; `attached` when the step
/// joined an existing container (named, or another step's by `JOBID.STEPID`), whose mounts are
/// that container's, whatever `--container-mounts` says.
fn answer(description: &Description, bind: Option<TaskBinding>, attached: bool) -> Answer {
    let mut answer = Answer::new(
        description.id.clone(),
        description.pid,
        description.namespaces.clone(),
    );
    answer.env = description.env.clone();
    answer.cwd = description.cwd.clone();
    answer.entrypoint_log = description.entrypoint_log.clone();
    answer.bind = bind;
    answer.attached = attached;
    answer
}

/// The node as topology sees it and what the step was allocated on it.
struct StepTopology {
    host: Host,
    node: Node,
    job: Job,
}

impl StepTopology {
    fn discover(step: &StepRequest, config: &Config) -> Result<Self, SlurmError> {
        let (host, node) = crate::source::discover(&Default::default(), config)?;
        let mut job = step.topology_job()?;
        // A step has the GPUs Slurm names, never "every GPU"; and a CUDA_VISIBLE_DEVICES the
        // user exported from a GPU machine names nothing on a node without GPUs.
        if job.gpus.is_none()
            || (node.gpus.is_empty() && job.gpus_from.as_deref() == Some("CUDA_VISIBLE_DEVICES"))
        {
            job.gpus = Some(Vec::new());
        }
        Ok(Self { host, node, job })
    }

    /// The per-rank plan for `--container-bind=closest`, within the step's cpuset.
    fn binding(&self, mode: BindMode, config: &Config) -> Result<Option<TaskBinding>, SlurmError> {
        if mode == BindMode::None {
            return Ok(None);
        }
        // The step's cgroup cpuset is this process's (berth runs in slurmstepd's cgroup); on
        // a snapshot host it would describe another machine.
        let (allowed_cpus, allowed_mems) = if self.host.is_live() {
            cpu::step_cpuset(&self.host)
        } else {
            (None, None)
        };
        let plan = plan::plan(
            &self.node,
            &self.job,
            &PlanOptions {
                allowed_cpus,
                allowed_mems,
                ..Default::default()
            },
        )
        .map_err(|e| {
            SlurmError::input(format!(
                "--container-bind=closest: {e}; or run with --container-bind=none"
            ))
        })?;
        for w in &plan.warnings {
            tracing::warn!("--container-bind=closest: {w}");
        }
        Ok(Some(slurm_step::binding(
            &plan,
            config.topology.memory_policy,
        )))
    }

    /// Gives the container the step's GPUs (device nodes, the driver's files, a loader cache
    /// that finds them) and their paired HCAs, and extends its device allow-list by exactly
    /// these; the image's NVIDIA_VISIBLE_DEVICES plays no part. The returned file backs the
    /// container's /etc/ld.so.cache until the container has been created.
    fn inject_devices(
        &self,
        spec: &mut oci_spec::runtime::Spec,
        lowers: &[std::path::PathBuf],
        config: &Config,
    ) -> Result<Option<tempfile::NamedTempFile>, SlurmError> {
        let plan = inject::for_job(
            &self.host,
            &self.node,
            &self.job,
            &inject::DriverFiles::default(),
        )
        .map_err(|e| match e {
            // The job's request is the user's to get right; the node's files are not.
            berth_topology::TopologyError::Job { .. } => {
                SlurmError::input(format!("the step's GPUs: {e}"))
            }
            other => SlurmError::host(format!("the step's GPUs: {other}")),
        })?;
        if plan.is_empty() {
            return Ok(None);
        }
        Ok(crate::container::inject_gpus(
            spec,
            &plan,
            lowers,
            config,
            "the step's GPUs",
            false,
        )?)
    }
}

/// Removes the step's unnamed container (saving it first for `--container-save`); idempotent.
/// `node` limits it to that node's containers where several slurmd share a state directory.
pub fn destroy(
    config: &Config,
    job_id: u64,
    step_id: u64,
    node: Option<&str>,
) -> Result<(), SlurmError> {
    let opts = options(config, None);
    let mut failure = None;
    for record in state::list(&config.runtime.state_dir) {
        let l = &record.labels;
        if label(l, "job") != job_id.to_string()
            || label(l, "step") != step_id.to_string()
            || !on_node(l, node)
        {
            continue;
        }
        if let Some(save) = l.get("save")
            && state::owner_alive(&record)
            && let Err(e) = save_container(&record, save, config)
        {
            failure.get_or_insert(e);
        }
        if !l.contains_key("name") {
            runtime::remove(&opts, &record.id).map_err(SlurmError::Runtime)?;
        }
    }
    berth_image::mount::release_unused(&config.image());
    failure.map_or(Ok(()), Err)
}

/// `--container-save`: the container's root as it is now, as a squashfs at `path`, written
/// with the job user's credentials (root must not write where the user could not).
fn save_container(record: &state::Record, path: &str, config: &Config) -> Result<(), SlurmError> {
    use berth_image::export::{Format, Source, export};
    let fail = |why: String| SlurmError::host(format!("--container-save={path}: {why}"));
    let uid: u32 = label(&record.labels, "uid")
        .parse()
        .map_err(|_| fail("no user".into()))?;
    let gid: u32 = label(&record.labels, "gid")
        .parse()
        .map_err(|_| fail("no group".into()))?;
    let staged = config.runtime.state_dir.join(&record.id).join("save.sqsh");
    export(
        &Source::Container {
            pid: record.init_pid,
        },
        &staged,
        Format::Sqsh,
        &config.squashfs,
    )
    .map_err(|e| fail(e.to_string()))?;
    let result = copy_as_user(&staged, std::path::Path::new(path), uid, gid)
        .map_err(|e| fail(format!("uid {uid} cannot write it: {e}")));
    let _ = std::fs::remove_file(&staged);
    result
}

/// Copies `from` (readable by root) to `to`, opened by a child that has taken the user's
/// identity, under a temporary name renamed into place.
fn copy_as_user(
    from: &std::path::Path,
    to: &std::path::Path,
    uid: u32,
    gid: u32,
) -> Result<(), berth_stage::StageError> {
    let mut source = std::fs::File::open(from).map_err(|e| {
        berth_stage::StageError::Child(format!("cannot read {}: {e}", from.display()))
    })?;
    as_user(uid, gid, || {
        let tmp = to.with_extension("sqsh.berth-tmp");
        let mut out = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        let copied = std::io::copy(&mut source, &mut out).and_then(|_| out.sync_all());
        match copied.and_then(|()| std::fs::rename(&tmp, to)) {
            Ok(()) => Ok(()),
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                Err(e)
            }
        }
    })
}

/// Whether the user can create `to` (a file made and removed next to it, as the user): checked
/// when the step starts, so that a job does not run for hours to lose its container at the end.
fn check_save_target(
    to: &std::path::Path,
    uid: u32,
    gid: u32,
) -> Result<(), berth_stage::StageError> {
    let name = to.file_name().unwrap_or_default().to_string_lossy();
    let probe = to.with_file_name(format!(".{name}.berth-check-{}", std::process::id()));
    as_user(uid, gid, || {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&probe)?;
        std::fs::remove_file(&probe)
    })
}

/// Runs the file operations `f` as the job's user (with its groups), through the staging
/// engine's fork-as-the-user.
fn as_user(
    uid: u32,
    gid: u32,
    f: impl FnOnce() -> std::io::Result<()>,
) -> Result<(), berth_stage::StageError> {
    berth_stage::as_user(&berth_sys::user::by_id(uid, gid), f)
}

#[cfg(test)]
mod tests {
    #[test]
    fn step_ids_are_pyxis_job_dot_step() {
        assert_eq!(super::step_ids("12.0"), Some((12, 0)));
        assert_eq!(super::step_ids("12.x"), None);
        assert_eq!(super::step_ids("dev"), None);
        assert_eq!(super::step_ids("1.2.3"), None);
        assert_eq!(super::step_ids(".1"), None);
    }
}
