//! The protocol with the berth binary: the JSON request `berth step create` reads on stdin, the
//! JSON object it prints on stdout (the namespaces to join, the tasks' environment and working
//! directory), and the one-line error it prints on stderr when it fails.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::config::PluginConfig;

/// The identity of the step on this node, from `spank_get_item`.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Step {
    pub job_id: u32,
    pub step_id: u32,
    pub uid: u32,
    pub gid: u32,
    pub local_task_count: u32,
}

#[derive(Debug, Serialize)]
struct PluginSettings {
    container_scope: &'static str,
    execute_entrypoint: bool,
    sbatch_support: bool,
}

#[derive(Debug, Serialize)]
struct CreateRequest<'a> {
    #[serde(flatten)]
    step: &'a Step,
    options: &'a Map<String, Value>,
    plugin: PluginSettings,
    job_env: &'a [String],
}

/// The request for `berth step create`, as one JSON document.
pub fn create_request(
    step: &Step,
    options: &Map<String, Value>,
    config: &PluginConfig,
    job_env: &[String],
) -> String {
    let request = CreateRequest {
        step,
        options,
        plugin: PluginSettings {
            container_scope: config.container_scope.as_str(),
            execute_entrypoint: config.execute_entrypoint,
            sbatch_support: config.sbatch_support,
        },
        job_env,
    };
    serde_json::to_string(&request).expect("the request is plain data")
}

/// A namespace a task joins, in the order the task joins them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Namespace {
    // Order matters: every namespace but the user one is joined while the task still has the
    // host's capabilities (which count in every user namespace below the host's); the user
    // namespace comes last because joining it replaces the task's capabilities with those of
    // that namespace. Mount comes after cgroup so /proc/self/cgroup is read in the new view.
    Cgroup,
    Ipc,
    Uts,
    Net,
    Mnt,
    User,
}

impl Namespace {
    fn from_key(key: &str) -> Option<Self> {
        Some(match key {
            "cgroup" => Namespace::Cgroup,
            "ipc" => Namespace::Ipc,
            "uts" => Namespace::Uts,
            "net" => Namespace::Net,
            "mnt" => Namespace::Mnt,
            "user" => Namespace::User,
            _ => return None,
        })
    }

    pub fn key(self) -> &'static str {
        match self {
            Namespace::Cgroup => "cgroup",
            Namespace::Ipc => "ipc",
            Namespace::Uts => "uts",
            Namespace::Net => "net",
            Namespace::Mnt => "mnt",
            Namespace::User => "user",
        }
    }

    /// The `CLONE_NEW*` flag `setns` checks the file against.
    pub fn clone_flag(self) -> i32 {
        match self {
            Namespace::Cgroup => libc::CLONE_NEWCGROUP,
            Namespace::Ipc => libc::CLONE_NEWIPC,
            Namespace::Uts => libc::CLONE_NEWUTS,
            Namespace::Net => libc::CLONE_NEWNET,
            Namespace::Mnt => libc::CLONE_NEWNS,
            Namespace::User => libc::CLONE_NEWUSER,
        }
    }
}

/// What `berth step create` printed on success.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct Created {
    pub id: String,
    pub pid: i32,
    pub namespaces: BTreeMap<String, String>,
    pub env: Vec<String>,
    pub cwd: String,
    /// What the image's entrypoint printed (`--container-entrypoint-log`).
    #[serde(default)]
    pub entrypoint_log: Option<String>,
    /// With `--container-bind=closest`: what each local task is pinned to. Absent from an
    /// older berth's answer.
    #[serde(default)]
    pub bind: Option<Binding>,
    /// The step joined an existing container (a named one, or another step's by
    /// `JOBID.STEPID`), whose mounts were set when it was made.
    #[serde(default)]
    pub attached: bool,
}

/// What `berth step create` prints on stderr before its error when the image could not be
/// imported (src/cli/step.rs `IMPORT_FAILED_MARKER`).
pub const IMPORT_FAILED_MARKER: &str = "berth-step: image import failed";

/// Whether berth's stderr says the image import failed.
pub fn import_failed(stderr: &[u8]) -> bool {
    String::from_utf8_lossy(stderr)
        .lines()
        .any(|l| l.trim() == IMPORT_FAILED_MARKER)
}

/// Whether `--container-image` names a registry image (Pyxis's "docker image"), not a file.
pub fn is_registry_image(image: &str) -> bool {
    !image.starts_with('/')
        && !image.starts_with('.')
        && ![
            "oci:",
            "oci-archive:",
            "docker-archive:",
            "podman://",
            "dockerd://",
        ]
        .iter()
        .any(|p| image.starts_with(p))
}

/// PMIx's MCA variables that Enroot's Slurm hook derives from what Slurm's PMIx server sets,
/// for clients built against another PMIx: (from, to).
pub const PMIX_MCA_VARS: [(&str, &str); 3] = [
    ("PMIX_SECURITY_MODE", "PMIX_MCA_psec"),
    ("PMIX_GDS_MODULE", "PMIX_MCA_gds"),
    ("PMIX_PTL_MODULE", "PMIX_MCA_ptl"),
];

/// The `(name, value)` pairs to set for PMIx clients: each MCA variable of [`PMIX_MCA_VARS`]
/// the task does not have, from its source when that is set.
pub fn pmix_mca(getenv: impl Fn(&str) -> Option<String>) -> Vec<(&'static str, String)> {
    PMIX_MCA_VARS
        .iter()
        .filter(|(_, to)| getenv(to).is_none())
        .filter_map(|(from, to)| getenv(from).filter(|v| !v.is_empty()).map(|v| (*to, v)))
        .collect()
}

/// How a pinned task's memory follows its NUMA nodes (berth's `topology.memory_policy`).
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum MemPolicy {
    Bind,
    Preferred,
    None,
}

/// The per-local-rank plans of a step.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct Binding {
    pub memory_policy: MemPolicy,
    pub ranks: Vec<RankBinding>,
}

/// One local rank (SLURM_LOCALID): its CPUs, NUMA nodes and variables.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct RankBinding {
    pub rank: u32,
    pub cpus: Vec<u32>,
    pub mems: Vec<u32>,
    pub env: Vec<String>,
}

impl Binding {
    pub fn rank(&self, rank: u32) -> Option<&RankBinding> {
        self.ranks.iter().find(|r| r.rank == rank)
    }
}

/// `berth step create` broke the protocol: the plugin cannot use what it printed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error("berth step create printed no JSON object on stdout ({0})")]
    NotJson(String),
    #[error("berth step create reported namespace '{0}', which a task cannot join")]
    UnknownNamespace(String),
    #[error("berth step create reported the {0} namespace at '{1}', not an absolute path")]
    RelativePath(&'static str, String),
    #[error("berth step create reported the environment entry '{0}', which has no '='")]
    BadEnv(String),
    #[error("berth step create reported the working directory '{0}', not an absolute path")]
    BadCwd(String),
    #[error("berth step create reported no mount namespace: the tasks would run on the host")]
    NoMountNamespace,
}

impl Created {
    /// Parses and checks berth's answer. Only the first JSON value on stdout counts; anything
    /// after it (a stray log line) is ignored.
    pub fn parse(stdout: &[u8]) -> Result<Self, ProtocolError> {
        let mut stream = serde_json::Deserializer::from_slice(stdout).into_iter::<Created>();
        let created = match stream.next() {
            Some(Ok(c)) => c,
            Some(Err(e)) => return Err(ProtocolError::NotJson(e.to_string())),
            None => return Err(ProtocolError::NotJson("stdout was empty".into())),
        };
        created.check()?;
        Ok(created)
    }

    fn check(&self) -> Result<(), ProtocolError> {
        self.join_order()?;
        if let Some(bad) = self
            .env
            .iter()
            .find(|e| !e.contains('=') || e.starts_with('='))
        {
            return Err(ProtocolError::BadEnv(bad.clone()));
        }
        if !self.cwd.starts_with('/') {
            return Err(ProtocolError::BadCwd(self.cwd.clone()));
        }
        let bound = self.bind.iter().flat_map(|b| &b.ranks);
        if let Some(bad) = bound
            .flat_map(|r| &r.env)
            .find(|e| !e.contains('=') || e.starts_with('='))
        {
            return Err(ProtocolError::BadEnv(bad.clone()));
        }
        Ok(())
    }

    /// The namespaces to join with their paths, in joining order.
    pub fn join_order(&self) -> Result<Vec<(Namespace, &str)>, ProtocolError> {
        let mut list = Vec::new();
        for (key, path) in &self.namespaces {
            let ns = Namespace::from_key(key)
                .ok_or_else(|| ProtocolError::UnknownNamespace(key.clone()))?;
            if !path.starts_with('/') {
                return Err(ProtocolError::RelativePath(ns.key(), path.clone()));
            }
            list.push((ns, path.as_str()));
        }
        if !list.iter().any(|(ns, _)| *ns == Namespace::Mnt) {
            return Err(ProtocolError::NoMountNamespace);
        }
        list.sort();
        Ok(list)
    }
}

/// Appends `NAME=value` to `env` when `value` is set and `env` has no `NAME` yet.
pub fn add_missing(env: &mut Vec<String>, name: &str, value: Option<String>) {
    let prefix = format!("{name}=");
    if let Some(v) = value
        && !env.iter().any(|e| e.starts_with(&prefix))
    {
        env.push(format!("{prefix}{v}"));
    }
}

/// How to turn the task's environment `current` into `target`: the names to unset (in `current`
/// but not in `target`) and the `(name, value)` pairs to set (new or changed).
pub fn env_changes(current: &[String], target: &[String]) -> (Vec<String>, Vec<(String, String)>) {
    let split = |e: &String| -> Option<(String, String)> {
        e.split_once('=')
            .map(|(k, v)| (k.to_string(), v.to_string()))
    };
    let now: BTreeMap<String, String> = current.iter().filter_map(split).collect();
    // Later entries win, as with execve's duplicate handling in most shells' getenv.
    let want: BTreeMap<String, String> = target.iter().filter_map(split).collect();
    let unset = now
        .keys()
        .filter(|k| !want.contains_key(*k))
        .cloned()
        .collect();
    let set = want
        .into_iter()
        .filter(|(k, v)| now.get(k) != Some(v))
        .collect();
    (unset, set)
}

/// The one line to show the user when berth failed: its last `berth: …` line on stderr, else its
/// last non-empty line, else what is known about the exit.
pub fn failure_line(stderr: &[u8], verb: &str, exit: &str) -> String {
    let text = String::from_utf8_lossy(stderr);
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    if let Some(line) = lines.iter().rev().find(|l| l.starts_with("berth:")) {
        return line.to_string();
    }
    match lines.last() {
        Some(line) => format!("berth: {line}"),
        None => format!("berth: berth {verb} {exit} without a message"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Scope;

    fn step() -> Step {
        Step {
            job_id: 12,
            step_id: 0,
            uid: 1000,
            gid: 1000,
            local_task_count: 2,
        }
    }

    #[test]
    fn request_has_the_contract_shape() {
        let mut options = Map::new();
        options.insert("container-image".into(), "busybox".into());
        options.insert("container-writable".into(), false.into());
        let config = PluginConfig {
            container_scope: Scope::Global,
            ..PluginConfig::default()
        };
        let env = vec!["SLURM_JOB_ID=12".to_string(), "A=b=c".to_string()];
        let json: Value =
            serde_json::from_str(&create_request(&step(), &options, &config, &env)).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "job_id": 12, "step_id": 0, "uid": 1000, "gid": 1000, "local_task_count": 2,
                "options": {"container-image": "busybox", "container-writable": false},
                "plugin": {"container_scope": "global", "execute_entrypoint": false, "sbatch_support": true},
                "job_env": ["SLURM_JOB_ID=12", "A=b=c"],
            })
        );
        // Pyxis's runtime_path is accepted in plugstack.conf but berth has its own directories.
        let config = PluginConfig {
            runtime_path: Some("/run/pyxis".into()),
            ..PluginConfig::default()
        };
        let json: Value =
            serde_json::from_str(&create_request(&step(), &options, &config, &env)).unwrap();
        assert_eq!(json["plugin"].as_object().unwrap().len(), 3);
    }

    const GOOD: &str = r#"{"id": "c0ffee123456", "pid": 4242,
        "namespaces": {"mnt": "/proc/4242/ns/mnt", "uts": "/proc/4242/ns/uts", "ipc": "/proc/4242/ns/ipc",
                       "cgroup": "/proc/4242/ns/cgroup", "net": "/proc/4242/ns/net", "user": "/proc/4242/ns/user"},
        "env": ["PATH=/usr/bin:/bin", "SLURM_JOB_ID=12", "EMPTY="], "cwd": "/workdir", "extra": 1}"#;

    #[test]
    fn response_parses_and_orders_namespaces_for_joining() {
        let c = Created::parse(format!("{GOOD}\ntrailing log line\n").as_bytes()).unwrap();
        assert_eq!(c.id, "c0ffee123456");
        assert_eq!(c.pid, 4242);
        assert_eq!(c.cwd, "/workdir");
        let order: Vec<&str> = c
            .join_order()
            .unwrap()
            .iter()
            .map(|(n, _)| n.key())
            .collect();
        assert_eq!(order, ["cgroup", "ipc", "uts", "net", "mnt", "user"]);
        assert_eq!(c.join_order().unwrap()[4].1, "/proc/4242/ns/mnt");
    }

    #[test]
    fn response_may_carry_per_rank_bindings() {
        assert_eq!(Created::parse(GOOD.as_bytes()).unwrap().bind, None);
        let with = GOOD.replacen(
            "\"extra\": 1",
            r#""bind": {"memory_policy": "preferred", "ranks": [
                {"rank": 0, "cpus": [2, 3], "mems": [1], "env": ["CUDA_VISIBLE_DEVICES=1"]},
                {"rank": 1, "cpus": [0], "mems": [0], "env": ["NCCL_IB_HCA==mlx5_0"]}]}"#,
            1,
        );
        let bind = Created::parse(with.as_bytes()).unwrap().bind.unwrap();
        assert_eq!(bind.memory_policy, MemPolicy::Preferred);
        let r1 = bind.rank(1).unwrap();
        assert_eq!(
            (r1.cpus.as_slice(), r1.mems.as_slice()),
            (&[0][..], &[0][..])
        );
        assert_eq!(r1.env, ["NCCL_IB_HCA==mlx5_0"]);
        assert!(bind.rank(2).is_none());
        let bad = with.replacen("CUDA_VISIBLE_DEVICES=1", "CUDA_VISIBLE_DEVICES", 1);
        let e = Created::parse(bad.as_bytes()).unwrap_err().to_string();
        assert!(
            e.contains("'CUDA_VISIBLE_DEVICES', which has no '='"),
            "{e}"
        );
    }

    #[test]
    fn response_violations_are_named() {
        let cases: &[(&str, &str)] = &[
            ("", "stdout was empty"),
            ("berth: oops", "no JSON object"),
            (r#"{"id":"x"}"#, "missing field"),
            (
                r#"{"id":"x","pid":1,"namespaces":{"mnt":"/m","pid":"/p"},"env":[],"cwd":"/"}"#,
                "namespace 'pid', which a task cannot join",
            ),
            (
                r#"{"id":"x","pid":1,"namespaces":{"mnt":"proc/1/ns/mnt"},"env":[],"cwd":"/"}"#,
                "not an absolute path",
            ),
            (
                r#"{"id":"x","pid":1,"namespaces":{"uts":"/u"},"env":[],"cwd":"/"}"#,
                "no mount namespace",
            ),
            (
                r#"{"id":"x","pid":1,"namespaces":{"mnt":"/m"},"env":["NOVALUE"],"cwd":"/"}"#,
                "'NOVALUE', which has no '='",
            ),
            (
                r#"{"id":"x","pid":1,"namespaces":{"mnt":"/m"},"env":[],"cwd":"work"}"#,
                "working directory 'work'",
            ),
        ];
        for (stdout, expected) in cases {
            let e = Created::parse(stdout.as_bytes()).unwrap_err().to_string();
            assert!(e.contains(expected), "{stdout}: {e}");
        }
    }

    #[test]
    fn env_changes_unset_removed_and_set_new_or_changed() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let (unset, set) = env_changes(
            &s(&["PATH=/host/bin", "HOME=/root", "SLURM_JOB_ID=1", "ODD"]),
            &s(&["PATH=/usr/bin", "SLURM_JOB_ID=1", "NEW=x=y", "EMPTY="]),
        );
        assert_eq!(unset, ["HOME"]);
        assert_eq!(
            set,
            [
                ("EMPTY".to_string(), String::new()),
                ("NEW".to_string(), "x=y".to_string()),
                ("PATH".to_string(), "/usr/bin".to_string()),
            ]
        );
    }

    #[test]
    fn pmix_mca_variables_come_from_slurms_and_never_override() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(
            pmix_mca(env(&[
                ("PMIX_SECURITY_MODE", "native"),
                ("PMIX_GDS_MODULE", "ds21,ds12,hash")
            ])),
            [
                ("PMIX_MCA_psec", "native".to_string()),
                ("PMIX_MCA_gds", "ds21,ds12,hash".to_string())
            ]
        );
        assert!(
            pmix_mca(env(&[
                ("PMIX_SECURITY_MODE", "native"),
                ("PMIX_MCA_psec", "none")
            ]))
            .is_empty()
        );
        assert!(pmix_mca(env(&[])).is_empty());
    }

    #[test]
    fn import_failures_and_registry_images_are_told_apart() {
        assert!(import_failed(
            b"berth-step: image import failed\nberth: x\n"
        ));
        assert!(!import_failed(b"berth: x\n"));
        assert!(is_registry_image("nvcr.io#nvidia/pytorch:24.01-py3"));
        assert!(is_registry_image("ubuntu"));
        assert!(!is_registry_image("/images/x.sqsh"));
        assert!(!is_registry_image("./x.sqsh"));
        assert!(!is_registry_image("oci-archive:/x.tar"));
    }

    #[test]
    fn add_missing_never_overrides() {
        let mut env = vec!["A=1".to_string()];
        add_missing(&mut env, "A", Some("2".into()));
        add_missing(&mut env, "AB", None);
        add_missing(&mut env, "B", Some("/x/".into()));
        assert_eq!(env, ["A=1", "B=/x/"]);
    }

    #[test]
    fn failure_line_prefers_berths_own_line() {
        assert_eq!(
            failure_line(
                b"debug: x\nberth: image 'nope' not found: check the name\n\n",
                "step create",
                "exited with status 2"
            ),
            "berth: image 'nope' not found: check the name"
        );
        assert_eq!(
            failure_line(
                b"thread 'main' panicked\nnote: backtrace\n",
                "step create",
                "exited with status 101"
            ),
            "berth: note: backtrace"
        );
        assert_eq!(
            failure_line(b"", "step destroy", "was killed by signal 9"),
            "berth: berth step destroy was killed by signal 9 without a message"
        );
    }
}
