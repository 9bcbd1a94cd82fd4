//! The protocol with the berth binary: the JSON request `berth step create` reads on stdin, the
//! JSON object it prints on stdout (the namespaces to join, the tasks' environment and working
//! directory), and the one-line error it prints on stderr when it fails.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::{Map, Value};

pub use berth_proto::answer::Created;
use berth_proto::step::{Options, PluginConfig as WirePluginConfig, StepRequest};

use crate::SpankError;
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

/// The request for `berth step create` in the protocol's current version, with the node this
/// slurmstepd runs on (from the job's environment); `to_json` gives the document to send.
pub fn create_request(
    step: &Step,
    options: &Map<String, Value>,
    config: &PluginConfig,
    job_env: &[String],
) -> Result<StepRequest, SpankError> {
    let options = Options::from_json(Value::Object(options.clone()))?;
    let mut request = StepRequest::new(step.job_id.into(), step.step_id.into(), step.uid, step.gid);
    request.local_task_count = step.local_task_count;
    request.options = options;
    request.plugin = WirePluginConfig {
        container_scope: config.container_scope,
        execute_entrypoint: config.execute_entrypoint,
        sbatch_support: config.sbatch_support,
    };
    request.job_env = job_env.to_vec();
    request.node = request.node_name();
    Ok(request)
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

/// The namespaces of berth's answer with their paths, in joining order.
pub fn join_order(created: &Created) -> Result<Vec<(Namespace, &str)>, SpankError> {
    let mut list = Vec::new();
    for (key, path) in &created.namespaces {
        let ns = Namespace::from_key(key).ok_or_else(|| SpankError::Namespace(key.clone()))?;
        list.push((ns, path.as_str()));
    }
    list.sort();
    Ok(list)
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
    use berth_proto::answer::{MemPolicy, import_failed};

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
        let env = [env, vec!["SLURM_TOPOLOGY_ADDR=n1".to_string()]].concat();
        let json: Value = serde_json::from_str(
            &create_request(&step(), &options, &config, &env)
                .unwrap()
                .to_json(),
        )
        .unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "protocol": berth_proto::VERSION, "node": "n1",
                "job_id": 12, "step_id": 0, "uid": 1000, "gid": 1000, "local_task_count": 2,
                "options": {"container-image": "busybox", "container-writable": false},
                "plugin": {"container_scope": "global", "execute_entrypoint": false, "sbatch_support": true},
                "job_env": ["SLURM_JOB_ID=12", "A=b=c", "SLURM_TOPOLOGY_ADDR=n1"],
            })
        );
        // Pyxis's runtime_path is accepted in plugstack.conf but berth has its own directories.
        let config = PluginConfig {
            runtime_path: Some("/run/pyxis".into()),
            ..PluginConfig::default()
        };
        let json: Value = serde_json::from_str(
            &create_request(&step(), &options, &config, &env)
                .unwrap()
                .to_json(),
        )
        .unwrap();
        assert_eq!(json["plugin"].as_object().unwrap().len(), 3);
        // An option the protocol does not define is the plugin's bug, named before berth runs.
        options.insert("container-nonsense".into(), true.into());
        let e = create_request(&step(), &options, &config, &env)
            .unwrap_err()
            .to_string();
        assert!(e.contains("container-nonsense"), "{e}");
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
        let order: Vec<&str> = join_order(&c)
            .unwrap()
            .iter()
            .map(|(n, _)| n.key())
            .collect();
        assert_eq!(order, ["cgroup", "ipc", "uts", "net", "mnt", "user"]);
        assert_eq!(join_order(&c).unwrap()[4].1, "/proc/4242/ns/mnt");
        let pid_ns = GOOD
            .replacen("\"extra\": 1", "\"extra\": 1, \"x\": 2", 1)
            .replacen(
                "\"user\": \"/proc/4242/ns/user\"",
                "\"user\": \"/proc/4242/ns/user\", \"pid\": \"/p\"",
                1,
            );
        let c = Created::parse(pid_ns.as_bytes()).unwrap();
        let e = join_order(&c).unwrap_err().to_string();
        assert!(
            e.contains("namespace 'pid', which a task cannot join"),
            "{e}"
        );
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
