//! The request `berth step create` reads on stdin: the step's identity on this node, the Pyxis
//! options that were set, the plugin's plugstack.conf settings and the job's environment.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::{ProtoError, VERSION};

/// What the plugin sends for a step.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct StepRequest {
    /// The sender's protocol version; absent (1) from plugins before versioning.
    #[serde(default = "one")]
    pub protocol: u32,
    pub job_id: u64,
    pub step_id: u64,
    pub uid: u32,
    pub gid: u32,
    /// The Slurm node this step runs on (slurmd's name, which a host running several slurmd
    /// does not share between them). Since protocol 2; otherwise taken from the job's
    /// environment ([`StepRequest::node_name`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    #[serde(default)]
    pub local_task_count: u32,
    #[serde(default)]
    pub options: Options,
    #[serde(default)]
    pub plugin: PluginConfig,
    #[serde(default)]
    pub job_env: Vec<String>,
}

fn one() -> u32 {
    1
}

/// The Pyxis options that were set (flags or their environment variables).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub struct Options {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container_image: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container_mounts: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container_workdir: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container_name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container_save: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container_mount_home: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container_remap_root: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container_entrypoint: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container_entrypoint_log: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container_writable: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container_readonly: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container_env: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container_unshare: Option<String>,
    /// `closest` or `none`; unset: `topology.bind`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container_bind: Option<String>,
    /// The host's Slurm client inside (`--container-slurm`); unset: `host_software.slurm`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container_slurm: Option<bool>,
    /// Lmod and the site's module trees inside (`--container-modules`); unset:
    /// `host_software.modules`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container_modules: Option<bool>,
    /// `host` (the node's MPI bound in) or `image`; unset: `host_software.mpi`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container_mpi: Option<String>,
}

#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// Named containers live until the job ends (the Epilog removes them).
    #[default]
    Job,
    /// Named containers outlive the job, per user.
    Global,
}

impl Scope {
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Job => "job",
            Scope::Global => "global",
        }
    }
}

/// plugstack.conf settings that shape a step.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(default)]
pub struct PluginConfig {
    pub container_scope: Scope,
    pub execute_entrypoint: bool,
    pub sbatch_support: bool,
}

impl Options {
    /// Options from a JSON object keyed by flag name (`container-image`, …): every key must be
    /// one this version defines.
    pub fn from_json(value: serde_json::Value) -> Result<Self, ProtoError> {
        let options: Self = crate::from_peer(value, VERSION).map(|(options, _)| options)?;
        options.check_text()?;
        Ok(options)
    }

    /// Refuses, in one line, an option holding a control character: a name or a path with a
    /// newline would forge a row of `berth ps` (names and save paths become labels) or a line
    /// of the logs, and no image, path or list needs one.
    pub fn check_text(&self) -> Result<(), ProtoError> {
        let text = [
            ("--container-image", &self.container_image),
            ("--container-mounts", &self.container_mounts),
            ("--container-workdir", &self.container_workdir),
            ("--container-name", &self.container_name),
            ("--container-save", &self.container_save),
            ("--container-env", &self.container_env),
            ("--container-unshare", &self.container_unshare),
            ("--container-bind", &self.container_bind),
        ];
        for (flag, value) in text {
            if let Some(line) = value
                .as_deref()
                .and_then(|v| berth_sys::text::refuse_control(flag, v))
            {
                return Err(ProtoError::Invalid(line));
            }
        }
        Ok(())
    }
}

/// A request read by [`StepRequest::parse`], with what a newer plugin sent that this build
/// does not know (ignored; the caller reports it).
#[derive(Debug)]
pub struct Parsed {
    pub request: StepRequest,
    pub ignored: Vec<String>,
}

impl StepRequest {
    /// A request of this build's version.
    pub fn new(job_id: u64, step_id: u64, uid: u32, gid: u32) -> Self {
        StepRequest {
            protocol: VERSION,
            job_id,
            step_id,
            uid,
            gid,
            ..Default::default()
        }
    }

    /// Reads a request from a plugin of any version this build works with.
    pub fn parse(text: &str) -> Result<Parsed, ProtoError> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| ProtoError::Invalid(e.to_string()))?;
        if !value.is_object() {
            return Err(ProtoError::Invalid(
                "the request is not a JSON object".into(),
            ));
        }
        let version = crate::version_of(&value)?;
        if !crate::compatible(version) {
            return Err(ProtoError::version("SPANK plugin", "berth", version));
        }
        let (request, ignored) = crate::from_peer::<StepRequest>(value, version)?;
        request.check_text()?;
        Ok(Parsed { request, ignored })
    }

    /// Refuses an option ([`Options::check_text`]) or a job environment variable whose name
    /// holds a control character, in one line saying which: the variable could not be set as
    /// named in the container (an `A\nB=1` was dropped), and its name would break the lines it
    /// is shown on. Values may hold any character (exported shell functions hold newlines).
    pub fn check_text(&self) -> Result<(), ProtoError> {
        self.options.check_text()?;
        for entry in &self.job_env {
            let name = entry.split_once('=').map_or(entry.as_str(), |(k, _)| k);
            if berth_sys::text::control_char(name).is_some()
                && let Some(line) =
                    berth_sys::text::refuse_control("the job's environment variable", name)
            {
                return Err(ProtoError::Invalid(format!(
                    "{line}: unset or rename it before srun"
                )));
            }
        }
        Ok(())
    }

    /// The request as one JSON document.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    fn env_value(&self, key: &str) -> Option<&str> {
        // Later entries win, as getenv sees them.
        self.job_env
            .iter()
            .rev()
            .filter_map(|e| e.split_once('='))
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v)
    }

    /// The step's node: [`StepRequest::node`], else from the job's environment
    /// ([`node_from_env`]).
    pub fn node_name(&self) -> Option<String> {
        self.node
            .clone()
            .filter(|n| plain_name(n))
            .or_else(|| node_from_env(&|k| self.env_value(k).map(str::to_string)))
    }

    /// The step's working directory on the host, against which relative `--container-mounts`
    /// sources and `--container-save` paths are taken (Pyxis's rule): `PWD` of the job's
    /// environment (what the shell that ran srun exports, following its `cd`s; Slurm passes it
    /// on unchanged), else `SLURM_SUBMIT_DIR` (srun's directory when it started). SPANK tells
    /// no step's working directory, so `srun --chdir` is not seen.
    pub fn cwd(&self) -> Option<PathBuf> {
        ["PWD", "SLURM_SUBMIT_DIR"].iter().find_map(|key| {
            self.env_value(key)
                .map(PathBuf::from)
                .filter(|p| p.is_absolute())
        })
    }

    /// `path` (`--container-save`) made absolute against [`StepRequest::cwd`].
    pub fn host_path(&self, path: &str) -> Result<PathBuf, ProtoError> {
        if path.starts_with('/') {
            return Ok(PathBuf::from(path));
        }
        let cwd = self.cwd().ok_or_else(|| {
            ProtoError::Mount(format!(
                "'{path}' is relative and the step's working directory is unknown: give an absolute path"
            ))
        })?;
        let mut out = cwd;
        for c in path.split('/').filter(|c| !c.is_empty() && *c != ".") {
            out.push(c);
        }
        Ok(out)
    }
}

/// A node name usable as one path component and label value (on one line of `berth ps`).
fn plain_name(node: &str) -> bool {
    !node.is_empty()
        && node != "."
        && node != ".."
        && node.len() <= 255
        && !node.contains('/')
        && berth_sys::text::control_char(node).is_none()
}

/// The node of a step from its environment: `SLURMD_NODENAME` (tasks and Prolog/Epilog have
/// it), else the component of `SLURM_TOPOLOGY_ADDR` that `SLURM_TOPOLOGY_ADDR_PATTERN` calls
/// `node` (slurmstepd sets these before the plugin runs, and before SLURMD_NODENAME).
pub fn node_from_env(get: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    if let Some(node) = get("SLURMD_NODENAME").filter(|n| plain_name(n)) {
        return Some(node);
    }
    let addr = get("SLURM_TOPOLOGY_ADDR")?;
    let pattern = get("SLURM_TOPOLOGY_ADDR_PATTERN").unwrap_or_else(|| "node".into());
    let at = pattern.split('.').position(|p| p == "node")?;
    let node = addr.split('.').nth(at)?;
    plain_name(node).then(|| node.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    const V1: &str = r#"{"job_id": 12, "step_id": 0, "uid": 1000, "gid": 1000,
        "local_task_count": 2,
        "options": {"container-image": "busybox", "container-writable": false},
        "plugin": {"container_scope": "global", "execute_entrypoint": false, "sbatch_support": true},
        "job_env": ["SLURM_TOPOLOGY_ADDR=sw1.n7", "SLURM_TOPOLOGY_ADDR_PATTERN=switch.node", "PWD=/home/a"]}"#;

    #[test]
    fn an_unversioned_request_is_version_one_and_reads_as_before() {
        let p = StepRequest::parse(V1).unwrap();
        assert!(p.ignored.is_empty());
        let r = p.request;
        assert_eq!((r.protocol, r.job_id, r.uid), (1, 12, 1000));
        assert_eq!(r.options.container_image.as_deref(), Some("busybox"));
        assert_eq!(r.options.container_writable, Some(false));
        assert_eq!(r.plugin.container_scope, Scope::Global);
        assert_eq!(r.node, None);
        assert_eq!(r.node_name().as_deref(), Some("n7"));
        assert_eq!(r.cwd(), Some(PathBuf::from("/home/a")));
    }

    #[test]
    fn control_characters_in_options_and_variable_names_are_refused_in_one_line() {
        let req = |options: &str, env: &str| {
            format!(
                r#"{{"job_id": 1, "step_id": 0, "uid": 1000, "gid": 1000,
                "options": {{{options}}}, "job_env": [{env}]}}"#
            )
        };
        let refused = |text: String, what: &str| {
            let e = StepRequest::parse(&text).unwrap_err().to_string();
            assert!(!e.contains('\n') && !e.contains('\u{1b}'), "{e}");
            assert!(e.starts_with(what), "{e}");
            assert!(e.contains("control character"), "{e}");
        };
        refused(
            req(r#""container-name": "x\nforged""#, r#""A=1""#),
            "--container-name 'x\\nforged'",
        );
        refused(
            req(r#""container-save": "/tmp/a\rb""#, ""),
            "--container-save '/tmp/a\\rb'",
        );
        refused(
            req(
                r#""container-image": "busybox""#,
                r#""PATH=/bin", "A\nB=1""#,
            ),
            "the job's environment variable 'A\\nB'",
        );
        refused(
            req(r#""container-image": "busybox""#, r#""A\u001b]0;x=1""#),
            "the job's environment variable 'A\\u{1b}]0;x'",
        );
        // Values may hold newlines (bash exports functions so); names anything printable.
        let ok = req(
            r#""container-image": "busybox""#,
            r#""BASH_FUNC_f%%=() {  echo\n}", "PWD=/home/a b""#,
        );
        let r = StepRequest::parse(&ok).unwrap().request;
        assert_eq!(r.job_env.len(), 2);
        Options::from_json(serde_json::json!({"container-workdir": "/a\tb"})).unwrap_err();
        Options::from_json(serde_json::json!({"container-workdir": "/a b"})).unwrap();
    }

    /// V1 with `protocol: version`, an unknown top-level field and an unknown option.
    fn with_unknown(version: u32) -> String {
        V1.replacen(
            r#""container-writable": false"#,
            r#""container-writable": false, "container-future": "x""#,
            1,
        )
        .replacen(
            '{',
            &format!("{{\"protocol\": {version}, \"future\": [1], "),
            1,
        )
    }

    #[test]
    fn unknown_fields_are_errors_up_to_our_version_and_reported_from_a_newer_one() {
        for version in [VERSION - 1, VERSION] {
            let e = StepRequest::parse(&with_unknown(version))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("unknown fields") && e.contains("options.container-future"),
                "{version}: {e}"
            );
        }
        let p = StepRequest::parse(&with_unknown(VERSION + 1)).unwrap();
        assert_eq!(p.request.protocol, VERSION + 1);
        assert_eq!(
            p.request.options.container_image.as_deref(),
            Some("busybox")
        );
        let mut ignored = p.ignored.clone();
        ignored.sort();
        assert_eq!(ignored, ["future", "options.container-future"]);
    }

    #[test]
    fn versions_too_far_apart_are_refused_by_version() {
        for v in [0, VERSION + 2, 99] {
            // Whatever else the message holds: the version is what is wrong.
            let text = format!(r#"{{"protocol": {v}, "whatever": true}}"#);
            let e = StepRequest::parse(&text).unwrap_err();
            assert!(
                matches!(e, ProtoError::Version { theirs, .. } if theirs == v),
                "{e}"
            );
        }
    }

    #[test]
    fn a_request_round_trips_and_says_its_version() {
        let mut r = StepRequest::new(5, 1, 1000, 100);
        r.node = Some("n1".into());
        r.options.container_image = Some("ubuntu".into());
        let text = r.to_json();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["protocol"], VERSION);
        assert_eq!(v["node"], "n1");
        // Unset options are left out, as the unversioned plugin sent them.
        assert_eq!(
            v["options"],
            serde_json::json!({"container-image": "ubuntu"})
        );
        assert_eq!(StepRequest::parse(&text).unwrap().request, r);
    }

    #[test]
    fn node_names_come_from_the_request_then_the_environment() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(
            node_from_env(&env(&[
                ("SLURMD_NODENAME", "a1"),
                ("SLURM_TOPOLOGY_ADDR", "b")
            ])),
            Some("a1".into())
        );
        assert_eq!(
            node_from_env(&env(&[("SLURM_TOPOLOGY_ADDR", "b")])),
            Some("b".into())
        );
        assert_eq!(
            node_from_env(&env(&[
                ("SLURM_TOPOLOGY_ADDR", "s1.s2.c3"),
                ("SLURM_TOPOLOGY_ADDR_PATTERN", "switch.switch.node")
            ])),
            Some("c3".into())
        );
        for bad in ["..", "", "a/b", "n1\nforged", "n\u{1b}1"] {
            let get = move |k: &str| (k == "SLURMD_NODENAME").then(|| bad.to_string());
            assert_eq!(node_from_env(&get), None, "{bad}");
        }
        let mut r = StepRequest::new(1, 0, 1, 1);
        r.node = Some("../x".into());
        r.job_env = vec!["SLURMD_NODENAME=good".into()];
        assert_eq!(r.node_name().as_deref(), Some("good"));
    }
}
