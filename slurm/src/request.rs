//! A step's container request as the SPANK plugin sends it (Pyxis options, job identity, job
//! environment), and the pure translation into a container [`Request`](berth_spec::Request).

use std::path::PathBuf;

use super::{env, mounts};
use crate::SlurmError;
use berth_spec::image::ImageDefaults;
use berth_spec::{BindMount, Net, Request, UserIds};
use berth_topology::TopologyError;
use berth_topology::bind::MemPolicy;
use berth_topology::job::{self, Job};
use berth_topology::plan::{BindMode, NodePlan};

pub use berth_proto::answer::{Binding as TaskBinding, RankBinding};
pub use berth_proto::step::{Options, PluginConfig, Scope, StepRequest};

/// What berth derives from a [`StepRequest`] with its own configuration and topology.
pub trait StepExt {
    /// `--container-bind`, else `default` (`topology.bind`).
    fn bind_mode(&self, default: BindMode) -> Result<BindMode, SlurmError>;
    /// The step's GPUs and tasks on this node as topology plans them.
    fn topology_job(&self) -> Result<Job, TopologyError>;
}

impl StepExt for StepRequest {
    fn bind_mode(&self, default: BindMode) -> Result<BindMode, SlurmError> {
        match self.options.container_bind.as_deref() {
            None => Ok(default),
            Some("closest") => Ok(BindMode::Closest),
            Some("none") => Ok(BindMode::None),
            Some(other) => Err(SlurmError::Input(format!(
                "invalid --container-bind '{other}': use closest or none"
            ))),
        }
    }

    /// The GPUs from the job's environment (SLURM_STEP_GPUS, SLURM_JOB_GPUS,
    /// CUDA_VISIBLE_DEVICES), the task count from slurmstepd (the environment's per-node lists
    /// describe the job, not always the step).
    fn topology_job(&self) -> Result<Job, TopologyError> {
        let pairs = env::pairs(&self.job_env);
        let get = |key: &str| {
            pairs
                .iter()
                .rev()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.clone())
        };
        let mut job = job::from_env(&get)?;
        if self.local_task_count > 0 {
            job.tasks = self.local_task_count;
            job.tasks_from = Some("the step's local task count".into());
        }
        // One plan serves every task; each picks its own rank by SLURM_LOCALID.
        job.local_id = None;
        Ok(job)
    }
}

/// What each local task of a step is pinned to (`--container-bind=closest`), in the protocol's
/// terms: part of the answer of `berth step create`, applied by the SPANK plugin in each task.
pub fn binding(plan: &NodePlan, memory_policy: MemPolicy) -> TaskBinding {
    use berth_proto::answer::MemPolicy as Wire;
    TaskBinding {
        memory_policy: match memory_policy {
            MemPolicy::Bind => Wire::Bind,
            MemPolicy::Preferred => Wire::Preferred,
            MemPolicy::None => Wire::None,
        },
        ranks: plan
            .ranks
            .iter()
            .map(|r| RankBinding {
                rank: r.rank,
                cpus: r.cpus.iter().collect(),
                mems: r.mems.iter().collect(),
                env: r.env.iter().map(|(k, v)| format!("{k}={v}")).collect(),
            })
            .collect(),
    }
}

/// `--container-name=NAME[:MODE]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NameMode {
    /// Use the named container if it exists, else create it.
    Auto,
    /// Create it; fail if it exists.
    Create,
    /// Use it; fail if it does not exist.
    Exec,
}

pub fn parse_name(text: &str) -> Result<(String, NameMode), SlurmError> {
    let (name, mode) = match text.split_once(':') {
        Some((n, m)) => (n, m),
        None => (text, "auto"),
    };
    let mode = match mode {
        // Pyxis's no_exec starts a container that exists but is in use anew, on its
        // filesystem, instead of joining it; a berth named container's filesystem lives as long
        // as its namespaces, so joining is the nearest: like auto, it never fails for a missing
        // container (mapping it to exec did).
        "auto" | "no_exec" => NameMode::Auto,
        "create" => NameMode::Create,
        "exec" => NameMode::Exec,
        other => {
            return Err(SlurmError::Input(format!(
                "invalid --container-name '{text}': unknown mode '{other}' (use auto, create, exec or no_exec)"
            )));
        }
    };
    let valid = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if !valid {
        return Err(SlurmError::Input(format!(
            "invalid --container-name '{text}': use letters, digits, '-', '_' and '.'"
        )));
    }
    Ok((name.to_string(), mode))
}

/// The namespaces a step's container has of its own besides the mount and cgroup ones.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Unshare {
    pub net: bool,
    pub ipc: bool,
    pub uts: bool,
}

/// `--container-unshare` on top of the site's default (`runtime.step_unshare`: ipc, uts). As in Pyxis, a
/// step shares the host's network, IPC and UTS namespaces unless one of them names it.
pub fn unshare(o: &Options, site_default: &[String]) -> Result<Unshare, SlurmError> {
    let mut out = Unshare::default();
    let given = o.container_unshare.as_deref().unwrap_or("");
    let from_site = site_default.iter().map(|s| (s.as_str(), true));
    let from_user = given.split(',').map(|s| (s.trim(), false));
    for (what, site) in from_site.chain(from_user).filter(|(s, _)| !s.is_empty()) {
        match what {
            "net" if !site => out.net = true,
            "ipc" => out.ipc = true,
            "uts" => out.uts = true,
            other if site => {
                return Err(SlurmError::Input(format!(
                    "invalid runtime.step_unshare entry '{other}' in berth.toml: use ipc or uts"
                )));
            }
            other => {
                return Err(SlurmError::Input(format!(
                    "invalid --container-unshare '{other}': unknown namespace (use net, ipc or uts)"
                )));
            }
        }
    }
    Ok(out)
}

/// What the spec built from [`to_request`] still needs for a step: the host's IPC and UTS
/// namespaces unless unshared (with the host's IPC, the container's own mqueue mount would show
/// the host's queues from a namespace it may not mount in: it is left out), and the mount flags
/// of `--container-mounts` beyond read-only (`noexec`, atime flags, tmpfs options).
pub fn adjust_spec(
    step: &StepRequest,
    spec: &mut oci_spec::runtime::Spec,
    site_unshare: &[String],
) -> Result<(), SlurmError> {
    use oci_spec::runtime::LinuxNamespaceType;
    let u = unshare(&step.options, site_unshare)?;
    if let Some(linux) = spec.linux_mut()
        && let Some(list) = linux.namespaces_mut()
    {
        list.retain(|ns| match ns.typ() {
            LinuxNamespaceType::Ipc => u.ipc,
            LinuxNamespaceType::Uts => u.uts,
            _ => true,
        });
    }
    let cwd = step.cwd();
    let user_mounts = mounts::parse_in(
        step.options.container_mounts.as_deref().unwrap_or(""),
        cwd.as_deref(),
    )?;
    let Some(list) = spec.mounts_mut() else {
        return Ok(());
    };
    if !u.ipc {
        list.retain(|m| m.destination() != std::path::Path::new("/dev/mqueue"));
    }
    unmount(list, &user_mounts);
    for m in user_mounts {
        let (destination, flags, tmpfs) = match m {
            mounts::Mount::Bind {
                destination, flags, ..
            } => (destination, flags, false),
            mounts::Mount::Tmpfs { destination, flags } => (destination, flags, true),
            mounts::Mount::Umount { .. } => continue,
        };
        if flags.is_empty() {
            continue;
        }
        // The last mount on this destination is this entry's (later entries win, as in order).
        let Some(target) = list.iter_mut().rev().find(|s| {
            s.destination() == &destination && (s.typ().as_deref() == Some("tmpfs")) == tmpfs
        }) else {
            continue;
        };
        let mut options = target.options().clone().unwrap_or_default();
        for flag in flags {
            let key = flag.split('=').next().unwrap_or(&flag).to_string();
            options.retain(|o| o.split('=').next() != Some(key.as_str()));
            options.push(flag);
        }
        target.set_options(Some(options));
    }
    Ok(())
}

/// `umount:DST` entries of `--container-mounts`: every mount of `list` at DST or beneath it is
/// left out (Enroot detaches the whole tree there), but those at the destination of a later
/// entry, which mounts it again.
fn unmount(list: &mut Vec<oci_spec::runtime::Mount>, entries: &[mounts::Mount]) {
    for (i, entry) in entries.iter().enumerate() {
        let mounts::Mount::Umount { destination } = entry else {
            continue;
        };
        let later: Vec<&std::path::Path> = entries[i + 1..]
            .iter()
            .filter_map(|m| match m {
                mounts::Mount::Bind { destination, .. }
                | mounts::Mount::Tmpfs { destination, .. } => Some(destination.as_path()),
                mounts::Mount::Umount { .. } => None,
            })
            .collect();
        list.retain(|m| {
            !m.destination().starts_with(destination) || later.contains(&m.destination().as_path())
        });
    }
}

/// The host directory `--container-mount-home` binds, at the same path: the job's `HOME` (as
/// Pyxis, whose Enroot home hook mounts `$HOME`), else the user's home in the passwd database;
/// `None` without either. A `HOME` that is not an absolute path below `/` is refused: it names
/// nothing to mount, and a silent fallback would bind another directory than the job asked for.
pub fn home_to_mount(step: &StepRequest, user: &UserIds) -> Result<Option<PathBuf>, SlurmError> {
    let job_home = env::pairs(&step.job_env)
        .into_iter()
        .rev()
        .find(|(k, _)| k == "HOME")
        .map(|(_, v)| v)
        .filter(|v| !v.is_empty());
    let Some(home) = job_home else {
        return Ok(user.home.clone());
    };
    let path = PathBuf::from(&home);
    let plain = path.is_absolute()
        && !path
            .components()
            .any(|c| c == std::path::Component::ParentDir)
        && path.parent().is_some();
    if !plain {
        return Err(SlurmError::input(format!(
            "--container-mount-home: the job's HOME '{}' is not an absolute path below / \
             without '..': export HOME as your home directory, or drop --container-mount-home",
            berth_sys::text::elide(&home)
        )));
    }
    Ok(Some(path))
}

/// Builds the container request for a step. `lowers`/`image` describe the resolved image;
/// `--container-mount-home` binds [`home_to_mount`]; the runtime opens every source as `user`.
pub fn to_request(
    step: &StepRequest,
    user: UserIds,
    lowers: &[PathBuf],
    image: &ImageDefaults,
    host_files: Vec<PathBuf>,
) -> Result<Request, SlurmError> {
    let o = &step.options;
    let mut binds = Vec::new();
    let mut tmpfs = Vec::new();
    let cwd = step.cwd();
    for m in mounts::parse_in(o.container_mounts.as_deref().unwrap_or(""), cwd.as_deref())? {
        match m {
            mounts::Mount::Bind {
                source,
                destination,
                readonly,
                ..
            } => binds.push(BindMount {
                source,
                destination,
                readonly,
            }),
            mounts::Mount::Tmpfs { destination, .. } => tmpfs.push(destination),
            // Applied to the spec (adjust_spec), where every mount of the container is listed.
            mounts::Mount::Umount { .. } => {}
        }
    }
    for dir in pmix_dirs(step) {
        binds.push(BindMount {
            source: dir.clone(),
            destination: dir,
            readonly: false,
        });
    }
    let remap_root = o.container_remap_root == Some(true);
    if o.container_mount_home == Some(true)
        && let Some(home) = &home_to_mount(step, &user)?
    {
        binds.push(BindMount {
            source: home.clone(),
            destination: home.clone(),
            readonly: false,
        });
        // Enroot mounts the home at the remapped root's home, where root's dotfiles are
        // looked for (`~/.cache/pip`, `~/.bashrc`).
        if remap_root && home != std::path::Path::new("/root") {
            binds.push(BindMount {
                source: home.clone(),
                destination: PathBuf::from("/root"),
                readonly: false,
            });
        }
    }
    let net = if unshare(o, &[])?.net {
        Net::None
    } else {
        Net::Host
    };
    let workdir = match &o.container_workdir {
        // Pyxis hands a relative --container-workdir to the container as is; it is taken here
        // relative to the container's default working directory (the image's, else /).
        Some(w) if !w.starts_with('/') => Some(
            image
                .workdir
                .clone()
                .unwrap_or_else(|| PathBuf::from("/"))
                .join(w),
        ),
        Some(w) => Some(PathBuf::from(w)),
        None => image.workdir.clone(),
    };
    let keep: Vec<String> = o
        .container_env
        .as_deref()
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect();
    let env = env::merge(&env::job_pairs(&step.job_env, &keep), &image.env, &keep);
    let rootfs = lowers
        .first()
        .cloned()
        .ok_or_else(|| SlurmError::input("the image has no root filesystem"))?;
    Ok(Request {
        rootfs,
        args: Vec::new(),
        env,
        workdir,
        user,
        hostname: None,
        mounts: binds,
        tmpfs,
        devices: Vec::new(),
        limits: Default::default(),
        net,
        readonly: o.container_readonly == Some(true) && o.container_writable != Some(true),
        share_pids: true,
        terminal: false,
        host_files,
        term: None,
        remap_root,
        // Filled by the caller, which knows the step's cgroups on this host.
        cgroup_view: Vec::new(),
    })
}

/// Environment variables through which Slurm's PMIx plugin tells clients where its server's
/// sockets live; the directories are bind-mounted at the same path so ranks in the container
/// reach the server.
/// (PMIX_SYSTEM_TMPDIR is usually /tmp itself and is not mounted: the container has its own.)
const PMIX_DIR_VARS: [&str; 2] = ["PMIX_SERVER_TMPDIR", "SLURM_PMIX_TMPDIR"];

fn pmix_dirs(step: &StepRequest) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    dirs.extend(pmix_app_dir(step));
    for (k, v) in env::pairs(&step.job_env) {
        let dir = PathBuf::from(&v);
        if PMIX_DIR_VARS.contains(&k.as_str())
            && dir.is_absolute()
            && dir.is_dir()
            && !dirs.contains(&dir)
        {
            dirs.push(dir);
        }
    }
    dirs
}

/// The per-step directory Slurm's PMIx plugin makes under its TmpFS for the clients' app
/// (`spmix_appdir_<uid>_<job>.<step>`), looked for where Slurm puts it: TMPDIR of the job, or /tmp.
fn pmix_app_dir(step: &StepRequest) -> Option<PathBuf> {
    let env = env::pairs(&step.job_env);
    let get = |key: &str| env.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone());
    let name = format!("spmix_appdir_{}_{}.{}", step.uid, step.job_id, step.step_id);
    let mut roots = vec![PathBuf::from("/tmp")];
    if let Some(tmp) = get("TMPDIR") {
        roots.insert(0, PathBuf::from(tmp));
    }
    let conf = get("SLURM_CONF").unwrap_or_else(|| "/etc/slurm/slurm.conf".into());
    if let Ok(text) = std::fs::read_to_string(&conf)
        && let Some(tmpfs) = tmpfs_of(&text)
    {
        // slurmstepd puts its own node in SLURM_TOPOLOGY_ADDR (`switch.….node`) before the
        // tasks get SLURMD_NODENAME. Without either, a host running several slurmd (each with
        // its TmpFS/%n) holds one app dir per node for the same step: none is taken rather
        // than another node's (its rank would use that node's PMIx session and fail).
        let node = step.node_name();
        let candidates: Vec<PathBuf> = expand_node(&tmpfs, node.as_deref())
            .into_iter()
            .filter(|r| r.join(&name).is_dir())
            .collect();
        if candidates.len() > 1 {
            return None;
        }
        roots.splice(0..0, candidates);
    }
    roots
        .into_iter()
        .map(|r| r.join(&name))
        .find(|p| p.is_dir())
}

/// slurm.conf's `TmpFS`: where the PMIx plugin puts its per-step directories.
fn tmpfs_of(slurm_conf: &str) -> Option<String> {
    slurm_conf.lines().find_map(|line| {
        let line = line.split('#').next()?.trim();
        let (key, value) = line.split_once('=')?;
        key.trim()
            .eq_ignore_ascii_case("TmpFS")
            .then(|| value.trim().to_string())
    })
}

/// The directories a TmpFS value may mean on this node: `%n` is the node name, which the job
/// environment does not always carry, so without it every directory where `%n` stands is a
/// candidate (the per-step name that is looked for inside makes a wrong match impossible).
fn expand_node(tmpfs: &str, node: Option<&str>) -> Vec<PathBuf> {
    if !tmpfs.contains("%n") {
        return vec![PathBuf::from(tmpfs)];
    }
    if let Some(n) = node {
        return vec![PathBuf::from(tmpfs.replace("%n", n))];
    }
    let Some((before, after)) = tmpfs.split_once("%n") else {
        return Vec::new();
    };
    let (parent, prefix) = before.rsplit_once('/').unwrap_or(("", before));
    let (suffix, rest) = after.split_once('/').unwrap_or((after, ""));
    let Ok(entries) = std::fs::read_dir(if parent.is_empty() { "/" } else { parent }) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            (name.starts_with(prefix) && name.ends_with(suffix))
                .then(|| PathBuf::from(parent).join(name).join(rest))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(json: &str) -> StepRequest {
        serde_json::from_str(json).unwrap()
    }

    fn user() -> UserIds {
        UserIds {
            uid: 1000,
            gid: 1000,
            groups: vec![1000],
            home: Some("/home/alice".into()),
            ..Default::default()
        }
    }

    #[test]
    fn the_plugin_request_parses() {
        let s = step(
            r#"{"job_id": 12, "step_id": 0, "uid": 1000, "gid": 1000, "local_task_count": 2,
                "options": {"container-image": "/img", "container-mount-home": true,
                            "container-env": "LANG", "container-unshare": "net"},
                "plugin": {"container_scope": "global", "execute_entrypoint": false, "sbatch_support": true},
                "job_env": ["SLURM_JOB_ID=12", "LANG=en_US", "PATH=/host"]}"#,
        );
        assert_eq!(s.plugin.container_scope, Scope::Global);
        let image = ImageDefaults {
            env: vec![
                ("PATH".into(), "/usr/bin".into()),
                ("LANG".into(), "C".into()),
            ],
            workdir: Some("/app".into()),
            ..Default::default()
        };
        let req = to_request(&s, user(), &["/img".into()], &image, vec![]).unwrap();
        assert_eq!(req.net, Net::None);
        assert_eq!(req.workdir, Some(PathBuf::from("/app")));
        assert_eq!(req.mounts[0].source, PathBuf::from("/home/alice"));
        assert!(req.env.contains(&("PATH".into(), "/usr/bin".into())));
        assert!(req.env.contains(&("LANG".into(), "en_US".into())));
        assert!(req.env.contains(&("SLURM_JOB_ID".into(), "12".into())));
    }

    #[test]
    fn unknown_options_and_bad_values_are_refused() {
        // As `berth step create` reads it (the protocol's parser).
        StepRequest::parse(
            r#"{"job_id":1,"step_id":0,"uid":0,"gid":0,"options":{"container-imag":"x"}}"#,
        )
        .unwrap_err();
        let bad = step(
            r#"{"job_id":1,"step_id":0,"uid":0,"gid":0,"options":{"container-unshare":"pid"}}"#,
        );
        let err =
            to_request(&bad, user(), &["/img".into()], &Default::default(), vec![]).unwrap_err();
        assert!(err.to_string().contains("'pid'"), "{err}");
    }

    #[test]
    fn relative_paths_follow_pyxis() {
        let s = step(
            r#"{"job_id":1,"step_id":0,"uid":0,"gid":0,
                "options":{"container-workdir":"sub/dir","container-mounts":"./data:/data,tmpfs:/t:size=1m"},
                "job_env":["SLURM_SUBMIT_DIR=/submit","PWD=/home/alice/run"]}"#,
        );
        let image = ImageDefaults {
            workdir: Some("/app".into()),
            ..Default::default()
        };
        let req = to_request(&s, user(), &["/img".into()], &image, vec![]).unwrap();
        assert_eq!(req.workdir, Some(PathBuf::from("/app/sub/dir")));
        assert_eq!(req.mounts[0].source, PathBuf::from("/home/alice/run/data"));
        let req = to_request(&s, user(), &["/img".into()], &Default::default(), vec![]).unwrap();
        assert_eq!(req.workdir, Some(PathBuf::from("/sub/dir")));
        assert_eq!(
            s.host_path("./out.sqsh").unwrap(),
            PathBuf::from("/home/alice/run/out.sqsh")
        );
        let no_cwd = step(r#"{"job_id":1,"step_id":0,"uid":0,"gid":0}"#);
        assert!(
            no_cwd
                .host_path("out.sqsh")
                .unwrap_err()
                .to_string()
                .contains("absolute")
        );
        assert_eq!(
            no_cwd.host_path("/o.sqsh").unwrap(),
            PathBuf::from("/o.sqsh")
        );
    }

    #[test]
    fn mount_home_binds_the_jobs_home_else_the_passwd_one() {
        let with = |env: &str| {
            step(&format!(
                r#"{{"job_id":1,"step_id":0,"uid":0,"gid":0,
                    "options":{{"container-mount-home":true}},"job_env":[{env}]}}"#
            ))
        };
        let req = to_request(
            &with(r#""HOME=/old","HOME=/tmp/h""#),
            user(),
            &["/img".into()],
            &Default::default(),
            vec![],
        )
        .unwrap();
        assert_eq!(req.mounts[0].source, PathBuf::from("/tmp/h"));
        assert_eq!(req.mounts[0].destination, PathBuf::from("/tmp/h"));
        for unset in ["", r#""HOME=""#] {
            let req = to_request(
                &with(unset),
                user(),
                &["/img".into()],
                &Default::default(),
                vec![],
            )
            .unwrap();
            assert_eq!(req.mounts[0].source, PathBuf::from("/home/alice"));
        }
        for bad in ["HOME=rel", "HOME=/", "HOME=/a/../etc"] {
            let e = to_request(
                &with(&format!("\"{bad}\"")),
                user(),
                &["/img".into()],
                &Default::default(),
                vec![],
            )
            .unwrap_err()
            .to_string();
            assert!(
                e.starts_with("--container-mount-home: the job's HOME"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn umount_entries_leave_out_what_is_mounted_there_but_later_entries() {
        let s = step(
            r#"{"job_id":1,"step_id":0,"uid":0,"gid":0,
                "options":{"container-mounts":"/a:/srv/a,umount:/srv,/b:/srv/b,umount:/dev/shm,umount:/tmp"}}"#,
        );
        let req = to_request(&s, user(), &["/img".into()], &Default::default(), vec![]).unwrap();
        let mut spec = berth_spec::build(&req).unwrap();
        adjust_spec(&s, &mut spec, &[]).unwrap();
        let dsts: Vec<String> = spec
            .mounts()
            .as_ref()
            .unwrap()
            .iter()
            .map(|m| m.destination().display().to_string())
            .collect();
        for gone in ["/srv/a", "/dev/shm", "/tmp"] {
            assert!(!dsts.iter().any(|d| d == gone), "{gone}: {dsts:?}");
        }
        for kept in ["/srv/b", "/proc", "/dev", "/sys"] {
            assert!(dsts.iter().any(|d| d == kept), "{kept}: {dsts:?}");
        }
    }

    #[test]
    fn mount_home_with_remap_root_is_also_roots_home() {
        let s = step(
            r#"{"job_id":1,"step_id":0,"uid":0,"gid":0,
                "options":{"container-mount-home":true,"container-remap-root":true}}"#,
        );
        let req = to_request(&s, user(), &["/img".into()], &Default::default(), vec![]).unwrap();
        let dsts: Vec<_> = req.mounts.iter().map(|m| m.destination.clone()).collect();
        assert_eq!(dsts, [PathBuf::from("/home/alice"), PathBuf::from("/root")]);
        assert!(
            req.mounts
                .iter()
                .all(|m| m.source == std::path::Path::new("/home/alice"))
        );
    }

    #[test]
    fn namespaces_are_the_hosts_unless_unshared_and_mount_flags_apply() {
        use oci_spec::runtime::LinuxNamespaceType as T;
        let kinds = |spec: &oci_spec::runtime::Spec| -> Vec<T> {
            spec.linux()
                .as_ref()
                .unwrap()
                .namespaces()
                .as_ref()
                .unwrap()
                .iter()
                .map(|n| n.typ())
                .collect()
        };
        let s = step(
            r#"{"job_id":1,"step_id":0,"uid":0,"gid":0,
                "options":{"container-mounts":"/data:/d:ro+noexec,tmpfs:/t:size=1m+huge=within_size+mode=700"}}"#,
        );
        let req = to_request(&s, user(), &["/img".into()], &Default::default(), vec![]).unwrap();
        let mut spec = berth_spec::build(&req).unwrap();
        adjust_spec(&s, &mut spec, &[]).unwrap();
        let k = kinds(&spec);
        assert!(
            !k.contains(&T::Ipc) && !k.contains(&T::Uts) && !k.contains(&T::Network),
            "{k:?}"
        );
        let mounts = spec.mounts().as_ref().unwrap();
        assert!(
            !mounts
                .iter()
                .any(|m| m.destination() == std::path::Path::new("/dev/mqueue"))
        );
        let opts = |d: &str| {
            mounts
                .iter()
                .rev()
                .find(|m| m.destination() == std::path::Path::new(d))
                .unwrap()
                .options()
                .clone()
                .unwrap()
        };
        assert!(
            opts("/d").contains(&"noexec".to_string()),
            "{:?}",
            opts("/d")
        );
        assert!(opts("/d").contains(&"ro".to_string()));
        let t = opts("/t");
        for o in ["nosuid", "nodev", "size=1m", "huge=within_size", "mode=700"] {
            assert!(t.contains(&o.to_string()), "{t:?}");
        }
        assert!(!t.contains(&"mode=1777".to_string()), "{t:?}");
        // The site's stricter default, and the user's own request.
        let mut spec = berth_spec::build(&req).unwrap();
        adjust_spec(&s, &mut spec, &["ipc".into(), "uts".into()]).unwrap();
        let k = kinds(&spec);
        assert!(k.contains(&T::Ipc) && k.contains(&T::Uts), "{k:?}");
        let u = step(
            r#"{"job_id":1,"step_id":0,"uid":0,"gid":0,"options":{"container-unshare":"uts,net"}}"#,
        );
        assert_eq!(
            unshare(&u.options, &[]).unwrap(),
            Unshare {
                net: true,
                ipc: false,
                uts: true
            }
        );
        assert!(
            unshare(&u.options, &["pid".into()])
                .unwrap_err()
                .to_string()
                .contains("step_unshare")
        );
    }

    #[test]
    fn pmix_server_directories_are_mounted() {
        let tmp = std::env::temp_dir();
        let t = tmp.display();
        let s = step(&format!(
            r#"{{"job_id":1,"step_id":0,"uid":0,"gid":0,
                "job_env":["PMIX_SERVER_TMPDIR={t}","SLURM_PMIX_TMPDIR={t}","PMIX_RANK=0",
                           "PMIX_SYSTEM_TMPDIR=/nonexistent/x"]}}"#
        ));
        let req = to_request(&s, user(), &["/img".into()], &Default::default(), vec![]).unwrap();
        let sources: Vec<_> = req.mounts.iter().map(|m| m.source.clone()).collect();
        assert_eq!(sources, vec![tmp]);
    }

    #[test]
    fn tmpfs_comes_from_slurm_conf() {
        let conf = "# TmpFS=/wrong\nSlurmdSpoolDir=/var/spool\ntmpfs=/scratch/%n # per node\n";
        assert_eq!(tmpfs_of(conf).as_deref(), Some("/scratch/%n"));
        assert_eq!(tmpfs_of("ClusterName=x\n"), None);
        assert_eq!(
            expand_node("/scratch/%n", Some("n1")),
            vec![PathBuf::from("/scratch/n1")]
        );
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("tmp/node7/x")).unwrap();
        let pattern = format!("{}/tmp/%n", dir.path().display());
        assert_eq!(
            expand_node(&pattern, None),
            vec![dir.path().join("tmp/node7/")]
        );
    }

    #[test]
    fn names_and_modes() {
        assert_eq!(parse_name("dev").unwrap(), ("dev".into(), NameMode::Auto));
        assert_eq!(parse_name("dev:exec").unwrap().1, NameMode::Exec);
        assert_eq!(parse_name("dev:create").unwrap().1, NameMode::Create);
        assert_eq!(parse_name("dev:no_exec").unwrap().1, NameMode::Auto);
        parse_name("dev:bogus").unwrap_err();
        parse_name("a/b").unwrap_err();
        parse_name("").unwrap_err();
    }

    #[test]
    fn container_bind_defaults_to_the_configuration() {
        let s = step(r#"{"job_id":1,"step_id":0,"uid":0,"gid":0}"#);
        assert_eq!(s.bind_mode(BindMode::Closest).unwrap(), BindMode::Closest);
        assert_eq!(s.bind_mode(BindMode::None).unwrap(), BindMode::None);
        let s =
            step(r#"{"job_id":1,"step_id":0,"uid":0,"gid":0,"options":{"container-bind":"none"}}"#);
        assert_eq!(s.bind_mode(BindMode::Closest).unwrap(), BindMode::None);
        let s =
            step(r#"{"job_id":1,"step_id":0,"uid":0,"gid":0,"options":{"container-bind":"near"}}"#);
        assert_eq!(
            s.bind_mode(BindMode::Closest).unwrap_err().to_string(),
            "invalid --container-bind 'near': use closest or none"
        );
    }

    #[test]
    fn the_steps_gpus_come_from_the_job_and_its_tasks_from_slurmstepd() {
        let s = step(
            r#"{"job_id":1,"step_id":0,"uid":0,"gid":0,"local_task_count":3,
                "job_env":["SLURM_JOB_ID=1","SLURM_JOB_GPUS=2,3","SLURM_TASKS_PER_NODE=8",
                           "SLURM_LOCALID=1","CUDA_VISIBLE_DEVICES=0"]}"#,
        );
        let job = s.topology_job().unwrap();
        assert_eq!(
            job.gpus,
            Some(vec![job::GpuId::Index(2), job::GpuId::Index(3)])
        );
        assert_eq!(job.tasks, 3);
        assert_eq!(job.local_id, None);
        let bad = step(
            r#"{"job_id":1,"step_id":0,"uid":0,"gid":0,"job_env":["SLURM_JOB_ID=1","SLURM_STEP_GPUS=x"]}"#,
        );
        assert_eq!(
            bad.topology_job().unwrap_err().to_string(),
            "SLURM_STEP_GPUS=x: 'x' is not a GPU index, GPU-UUID or PCI address"
        );
    }

    #[test]
    fn a_binding_lists_each_ranks_cpus_nodes_and_variables() {
        let (_f, node) = berth_topology::fixture::dgx_h100_node();
        let s = step(
            r#"{"job_id":1,"step_id":0,"uid":0,"gid":0,"local_task_count":2,
                "job_env":["SLURM_JOB_ID=1","SLURM_JOB_GPUS=2,5"]}"#,
        );
        let plan =
            berth_topology::plan::plan(&node, &s.topology_job().unwrap(), &Default::default())
                .unwrap();
        let b = binding(&plan, MemPolicy::Preferred);
        let json = serde_json::to_value(&b).unwrap();
        assert_eq!(json["memory_policy"], "preferred");
        assert_eq!(json["ranks"][1]["rank"], 1);
        assert_eq!(json["ranks"][1]["mems"], serde_json::json!([1]));
        assert_eq!(b.ranks[0].cpus.len(), 112);
        assert_eq!(b.ranks[1].cpus[0], 56);
        assert!(
            b.ranks[1]
                .env
                .contains(&"CUDA_VISIBLE_DEVICES=1".to_string()),
            "{:?}",
            b.ranks[1].env
        );
        assert!(
            b.ranks[0]
                .env
                .contains(&"UCX_NET_DEVICES=mlx5_4:1".to_string())
        );
    }

    #[test]
    fn readonly_unless_writable() {
        let s = step(
            r#"{"job_id":1,"step_id":0,"uid":0,"gid":0,"options":{"container-readonly":true}}"#,
        );
        let req = to_request(&s, user(), &["/img".into()], &Default::default(), vec![]).unwrap();
        assert!(req.readonly);
    }
}
