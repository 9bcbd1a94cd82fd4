//! A step's container request as the SPANK plugin sends it (Pyxis options, job identity, job
//! environment), and the pure translation into a container [`Request`](crate::spec::Request).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{env, mounts};
use crate::spec::image::ImageDefaults;
use crate::spec::{BindMount, Net, Request, UserIds};
use crate::topology::TopologyError;
use crate::topology::bind::MemPolicy;
use crate::topology::job::{self, Job};
use crate::topology::plan::{BindMode, NodePlan};

/// What `berth step create` reads on stdin.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepRequest {
    pub job_id: u64,
    pub step_id: u64,
    pub uid: u32,
    pub gid: u32,
    #[serde(default)]
    pub local_task_count: u32,
    #[serde(default)]
    pub options: Options,
    #[serde(default)]
    pub plugin: PluginConfig,
    #[serde(default)]
    pub job_env: Vec<String>,
}

impl StepRequest {
    /// `--container-bind`, else `default` (`topology.bind`).
    pub fn bind_mode(&self, default: BindMode) -> Result<BindMode, String> {
        match self.options.container_bind.as_deref() {
            None => Ok(default),
            Some("closest") => Ok(BindMode::Closest),
            Some("none") => Ok(BindMode::None),
            Some(other) => Err(format!(
                "invalid --container-bind '{other}': use closest or none"
            )),
        }
    }

    /// The step's GPUs and tasks on this node as topology plans them: the GPUs from the job's
    /// environment (SLURM_STEP_GPUS, SLURM_JOB_GPUS, CUDA_VISIBLE_DEVICES), the task count
    /// from slurmstepd (the environment's per-node lists describe the job, not always the step).
    pub fn topology_job(&self) -> Result<Job, TopologyError> {
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

/// What each local task of a step is pinned to (`--container-bind=closest`): part of the answer
/// of `berth step create`, applied by the SPANK plugin in each task.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TaskBinding {
    pub memory_policy: MemPolicy,
    pub ranks: Vec<RankBinding>,
}

/// One local rank's CPUs, NUMA nodes and variables (CUDA_VISIBLE_DEVICES, UCX_NET_DEVICES,
/// NCCL_IB_HCA, ...).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RankBinding {
    pub rank: u32,
    pub cpus: Vec<u32>,
    pub mems: Vec<u32>,
    pub env: Vec<String>,
}

pub fn binding(plan: &NodePlan, memory_policy: MemPolicy) -> TaskBinding {
    TaskBinding {
        memory_policy,
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

/// The Pyxis options that were set (flags or their environment variables).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Options {
    pub container_image: Option<String>,
    pub container_mounts: Option<String>,
    pub container_workdir: Option<String>,
    pub container_name: Option<String>,
    pub container_save: Option<String>,
    pub container_mount_home: Option<bool>,
    pub container_remap_root: Option<bool>,
    pub container_entrypoint: Option<bool>,
    pub container_entrypoint_log: Option<bool>,
    pub container_writable: Option<bool>,
    pub container_readonly: Option<bool>,
    pub container_env: Option<String>,
    pub container_unshare: Option<String>,
    /// `closest` or `none`; unset: `topology.bind`.
    pub container_bind: Option<String>,
}

#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// Named containers live until the job ends (the Epilog removes them).
    #[default]
    Job,
    /// Named containers outlive the job, per user.
    Global,
}

/// plugstack.conf settings that shape a step.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PluginConfig {
    pub container_scope: Scope,
    pub execute_entrypoint: bool,
    pub sbatch_support: bool,
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

pub fn parse_name(text: &str) -> Result<(String, NameMode), String> {
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
            return Err(format!(
                "invalid --container-name '{text}': unknown mode '{other}' (use auto, create, exec or no_exec)"
            ));
        }
    };
    let valid = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if !valid {
        return Err(format!(
            "invalid --container-name '{text}': use letters, digits, '-', '_' and '.'"
        ));
    }
    Ok((name.to_string(), mode))
}

/// Builds the container request for a step. `lowers`/`image` describe the resolved image;
/// `home_mount` is the user's home when it is to be mounted (already checked to exist).
pub fn to_request(
    step: &StepRequest,
    user: UserIds,
    lowers: &[PathBuf],
    image: &ImageDefaults,
    host_files: Vec<PathBuf>,
) -> Result<Request, String> {
    let o = &step.options;
    let mut binds = Vec::new();
    let mut tmpfs = Vec::new();
    for m in mounts::parse(o.container_mounts.as_deref().unwrap_or(""))? {
        match m {
            mounts::Mount::Bind {
                source,
                destination,
                readonly,
            } => binds.push(BindMount {
                source,
                destination,
                readonly,
            }),
            mounts::Mount::Tmpfs { destination } => tmpfs.push(destination),
        }
    }
    for dir in pmix_dirs(step) {
        binds.push(BindMount {
            source: dir.clone(),
            destination: dir,
            readonly: false,
        });
    }
    if o.container_mount_home == Some(true)
        && let Some(home) = &user.home
    {
        binds.push(BindMount {
            source: home.clone(),
            destination: home.clone(),
            readonly: false,
        });
    }
    let mut net = Net::Host;
    for what in o
        .container_unshare
        .as_deref()
        .unwrap_or("")
        .split(',')
        .filter(|s| !s.is_empty())
    {
        match what.trim() {
            "net" => net = Net::None,
            // Every step container has its own IPC and UTS namespaces already.
            "ipc" | "uts" => {}
            other => {
                return Err(format!(
                    "invalid --container-unshare '{other}': use net, ipc or uts"
                ));
            }
        }
    }
    let workdir = match &o.container_workdir {
        Some(w) if !w.starts_with('/') => {
            return Err(format!(
                "invalid --container-workdir '{w}': use an absolute path"
            ));
        }
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
    let env = env::merge(&env::pairs(&step.job_env), &image.env, &keep);
    let rootfs = lowers
        .first()
        .cloned()
        .ok_or_else(|| "the image has no root filesystem".to_string())?;
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
        remap_root: o.container_remap_root == Some(true),
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
        let node = get("SLURMD_NODENAME");
        roots.splice(0..0, expand_node(&tmpfs, node.as_deref()));
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
        assert!(
            serde_json::from_str::<StepRequest>(
                r#"{"job_id":1,"step_id":0,"uid":0,"gid":0,"options":{"container-imag":"x"}}"#
            )
            .is_err()
        );
        let bad = step(
            r#"{"job_id":1,"step_id":0,"uid":0,"gid":0,"options":{"container-workdir":"rel"}}"#,
        );
        let err =
            to_request(&bad, user(), &["/img".into()], &Default::default(), vec![]).unwrap_err();
        assert!(err.contains("rel"), "{err}");
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
        assert!(parse_name("dev:bogus").is_err());
        assert!(parse_name("a/b").is_err());
        assert!(parse_name("").is_err());
    }

    #[test]
    fn container_bind_defaults_to_the_configuration() {
        let s = step(r#"{"job_id":1,"step_id":0,"uid":0,"gid":0}"#);
        assert_eq!(s.bind_mode(BindMode::Closest), Ok(BindMode::Closest));
        assert_eq!(s.bind_mode(BindMode::None), Ok(BindMode::None));
        let s =
            step(r#"{"job_id":1,"step_id":0,"uid":0,"gid":0,"options":{"container-bind":"none"}}"#);
        assert_eq!(s.bind_mode(BindMode::Closest), Ok(BindMode::None));
        let s =
            step(r#"{"job_id":1,"step_id":0,"uid":0,"gid":0,"options":{"container-bind":"near"}}"#);
        assert_eq!(
            s.bind_mode(BindMode::Closest).unwrap_err(),
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
        let (_f, node) = crate::topology::scenarios::dgx();
        let s = step(
            r#"{"job_id":1,"step_id":0,"uid":0,"gid":0,"local_task_count":2,
                "job_env":["SLURM_JOB_ID=1","SLURM_JOB_GPUS=2,5"]}"#,
        );
        let plan =
            crate::topology::plan::plan(&node, &s.topology_job().unwrap(), &Default::default())
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
