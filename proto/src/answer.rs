//! What `berth step create` prints on stdout when it succeeds (the container's namespaces to
//! join, the tasks' environment and working directory, the per-task pinning), and the marker
//! line it prints on stderr before its error when the image could not be imported.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{ProtoError, VERSION};

/// The answer of `berth step create`.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct Created {
    /// The sender's protocol version; absent (1) from a berth before versioning.
    #[serde(default = "one")]
    pub protocol: u32,
    pub id: String,
    pub pid: i32,
    /// Namespace kind (`mnt`, `uts`, …) → the path of the namespace file to join.
    pub namespaces: BTreeMap<String, String>,
    pub env: Vec<String>,
    pub cwd: String,
    /// What the image's entrypoint printed (`--container-entrypoint-log`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entrypoint_log: Option<String>,
    /// With `--container-bind=closest`: what each local task is pinned to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bind: Option<Binding>,
    /// The step joined an existing container (a named one, or another step's by
    /// `JOBID.STEPID`), whose mounts were set when it was made.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub attached: bool,
}

fn one() -> u32 {
    1
}

/// How a pinned task's memory follows its NUMA nodes (berth's `topology.memory_policy`).
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum MemPolicy {
    Bind,
    Preferred,
    None,
}

/// The per-local-rank plans of a step.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
pub struct Binding {
    pub memory_policy: MemPolicy,
    pub ranks: Vec<RankBinding>,
}

/// One local rank (SLURM_LOCALID): its CPUs, NUMA nodes and variables (CUDA_VISIBLE_DEVICES,
/// UCX_NET_DEVICES, NCCL_IB_HCA, ...).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
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

/// What `berth step create` prints on stderr before its error when the image could not be
/// imported (for the plugin's Pyxis-shaped messages).
pub const IMPORT_FAILED_MARKER: &str = "berth-step: image import failed";

/// Whether berth's stderr says the image import failed.
pub fn import_failed(stderr: &[u8]) -> bool {
    String::from_utf8_lossy(stderr)
        .lines()
        .any(|l| l.trim() == IMPORT_FAILED_MARKER)
}

impl Created {
    /// An answer of this build's version.
    pub fn new(id: String, pid: i32, namespaces: BTreeMap<String, String>) -> Self {
        Created {
            protocol: VERSION,
            id,
            pid,
            namespaces,
            cwd: "/".into(),
            ..Default::default()
        }
    }

    /// Parses and checks berth's answer. Only the first JSON value on stdout counts; anything
    /// after it (a stray log line) is ignored, as are fields this build does not know (an
    /// answer only ever gains optional ones).
    pub fn parse(stdout: &[u8]) -> Result<Self, ProtoError> {
        let mut stream = serde_json::Deserializer::from_slice(stdout).into_iter::<Created>();
        let created = match stream.next() {
            Some(Ok(c)) => c,
            Some(Err(e)) => {
                return Err(ProtoError::Invalid(format!(
                    "berth step create printed no JSON object on stdout ({e})"
                )));
            }
            None => {
                return Err(ProtoError::Invalid(
                    "berth step create printed no JSON object on stdout (stdout was empty)".into(),
                ));
            }
        };
        if !crate::compatible(created.protocol) {
            return Err(ProtoError::version(
                "berth",
                "SPANK plugin",
                created.protocol,
            ));
        }
        created.check()?;
        Ok(created)
    }

    fn check(&self) -> Result<(), ProtoError> {
        let bad_env = |e: &String| !e.contains('=') || e.starts_with('=');
        let bound = self.bind.iter().flat_map(|b| &b.ranks).flat_map(|r| &r.env);
        if let Some(bad) = self.env.iter().chain(bound).find(|e| bad_env(e)) {
            return Err(ProtoError::Invalid(format!(
                "berth step create reported the environment entry '{bad}', which has no '='"
            )));
        }
        if !self.cwd.starts_with('/') {
            return Err(ProtoError::Invalid(format!(
                "berth step create reported the working directory '{}', not an absolute path",
                self.cwd
            )));
        }
        for (key, path) in &self.namespaces {
            if !path.starts_with('/') {
                return Err(ProtoError::Invalid(format!(
                    "berth step create reported the {key} namespace at '{path}', not an absolute path"
                )));
            }
        }
        if !self.namespaces.contains_key("mnt") {
            return Err(ProtoError::Invalid(
                "berth step create reported no mount namespace: the tasks would run on the host"
                    .into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{"id": "c0ffee123456", "pid": 4242,
        "namespaces": {"mnt": "/proc/4242/ns/mnt", "uts": "/proc/4242/ns/uts"},
        "env": ["PATH=/usr/bin:/bin", "SLURM_JOB_ID=12", "EMPTY="], "cwd": "/workdir", "extra": 1}"#;

    #[test]
    fn an_unversioned_answer_is_version_one_and_unknown_fields_are_ignored() {
        let c = Created::parse(format!("{GOOD}\ntrailing log line\n").as_bytes()).unwrap();
        assert_eq!((c.protocol, c.pid, c.cwd.as_str()), (1, 4242, "/workdir"));
        let newer = GOOD.replacen('{', &format!("{{\"protocol\": {}, ", VERSION + 1), 1);
        assert_eq!(
            Created::parse(newer.as_bytes()).unwrap().protocol,
            VERSION + 1
        );
        let far = GOOD.replacen('{', &format!("{{\"protocol\": {}, ", VERSION + 2), 1);
        let e = Created::parse(far.as_bytes()).unwrap_err().to_string();
        assert!(e.starts_with("the berth speaks protocol"), "{e}");
    }

    #[test]
    fn an_answer_round_trips_with_its_version_and_without_empty_optionals() {
        let mut c = Created::new(
            "id".into(),
            7,
            BTreeMap::from([("mnt".into(), "/proc/7/ns/mnt".into())]),
        );
        c.env = vec!["A=1".into()];
        let text = serde_json::to_string(&c).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["protocol"], VERSION);
        for absent in ["bind", "attached", "entrypoint_log"] {
            assert!(v.get(absent).is_none(), "{absent} in {text}");
        }
        assert_eq!(Created::parse(text.as_bytes()).unwrap(), c);
    }

    #[test]
    fn answer_violations_are_named() {
        let cases: &[(&str, &str)] = &[
            ("", "stdout was empty"),
            ("berth: oops", "no JSON object"),
            (r#"{"id":"x"}"#, "missing field"),
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
    fn import_failures_are_told_by_the_marker_line() {
        assert!(import_failed(
            b"berth-step: image import failed\nberth: x\n"
        ));
        assert!(!import_failed(b"berth: x\n"));
    }
}
