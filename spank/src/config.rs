//! The plugin's arguments from its plugstack.conf line, e.g.
//! `required /usr/lib/x86_64-linux-gnu/slurm-wlm/spank_berth.so berth=/usr/local/bin/berth sbatch_support=1`.
//! The keys are Pyxis's (`runtime_path`, `execute_entrypoint`, `container_scope`,
//! `sbatch_support`) plus berth's own (`berth`, `config`, `debug_request_dir`, `pyxis_messages`).

use std::path::PathBuf;

use crate::SpankError;
use crate::options::parse_bool;

/// Where named containers live: per job (removed by the Epilog) or per user across jobs.
pub use berth_proto::step::Scope;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginConfig {
    /// The berth binary the plugin runs.
    pub berth: PathBuf,
    /// Passed to berth as `--config PATH`.
    pub config: Option<PathBuf>,
    /// Pyxis's runtime directory: accepted so a Pyxis plugstack.conf line works unchanged;
    /// berth's own directories come from berth.toml.
    pub runtime_path: Option<String>,
    pub execute_entrypoint: bool,
    pub container_scope: Scope,
    /// Whether sbatch/salloc accept the options and the batch step gets a container.
    pub sbatch_support: bool,
    /// Test hook for the admin: slurmstepd writes each request to `DIR/JOB.STEP.json`.
    pub debug_request_dir: Option<PathBuf>,
    /// Also print Pyxis's lines (`pyxis: importing docker image: …`, `pyxis: failed to import
    /// docker image`) where a Pyxis user's scripts look for them; berth's own lines stay.
    pub pyxis_messages: bool,
}

pub const DEFAULT_BERTH: &str = "/usr/local/bin/berth";
/// berth's configuration file when plugstack.conf names none (berth-config's `DEFAULT_PATH`).
pub const DEFAULT_BERTH_CONFIG: &str = "/etc/berth/berth.toml";
/// berth's `[scratch] root` default (config/src/lib.rs checks that the two agree).
pub const DEFAULT_SCRATCH_ROOT: &str = "/var/tmp/berth-scratch";

/// The root of the jobs' scratch directories, from berth's configuration file `path` (the
/// `config=` argument; `None`: berth's default file, which may be absent). The error is for the
/// user's line.
pub fn job_scratch_root(path: Option<&std::path::Path>) -> Result<PathBuf, SpankError> {
    let file = path.map_or_else(|| PathBuf::from(DEFAULT_BERTH_CONFIG), PathBuf::from);
    let text = match std::fs::read_to_string(&file) {
        Ok(t) => Some(t),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && path.is_none() => None,
        Err(source) => return Err(SpankError::ConfigRead { path: file, source }),
    };
    scratch_root(text.as_deref()).map_err(|e| SpankError::ConfigFile {
        path: file,
        source: Box::new(e),
    })
}

/// The root of the jobs' scratch directories, `[scratch] root` in berth's configuration text
/// (`None`: no file, berth's defaults). The plugin reads only this key: the scratch of a job is
/// `ROOT/JOB` by berth's rule, so every step can be told where it is without running berth.
pub fn scratch_root(berth_toml: Option<&str>) -> Result<PathBuf, SpankError> {
    let Some(text) = berth_toml else {
        return Ok(PathBuf::from(DEFAULT_SCRATCH_ROOT));
    };
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| SpankError::ConfigSyntax(e.message().to_string()))?;
    match table.get("scratch").and_then(|s| s.get("root")) {
        None => Ok(PathBuf::from(DEFAULT_SCRATCH_ROOT)),
        Some(toml::Value::String(s)) if s.starts_with('/') => Ok(PathBuf::from(s)),
        Some(_) => Err(SpankError::ScratchRoot),
    }
}

impl Default for PluginConfig {
    fn default() -> Self {
        Self {
            berth: PathBuf::from(DEFAULT_BERTH),
            config: None,
            runtime_path: None,
            execute_entrypoint: false,
            container_scope: Scope::Job,
            sbatch_support: true,
            debug_request_dir: None,
            pyxis_messages: false,
        }
    }
}

impl PluginConfig {
    pub fn parse<S: AsRef<str>>(args: &[S]) -> Result<Self, SpankError> {
        let mut config = Self::default();
        for arg in args {
            let arg = arg.as_ref();
            let err = |hint| SpankError::PlugstackArg {
                arg: arg.to_string(),
                hint,
            };
            let (key, value) = arg
                .split_once('=')
                .ok_or_else(|| err("expected KEY=VALUE"))?;
            let bool_value = || parse_bool(value).ok_or_else(|| err("expected 0 or 1"));
            let path_value = || {
                if value.starts_with('/') {
                    Ok(PathBuf::from(value))
                } else {
                    Err(err("expected an absolute path"))
                }
            };
            match key {
                "berth" => config.berth = path_value()?,
                "config" => config.config = Some(path_value()?),
                "runtime_path" => config.runtime_path = Some(path_value()?.display().to_string()),
                "debug_request_dir" => config.debug_request_dir = Some(path_value()?),
                "execute_entrypoint" => config.execute_entrypoint = bool_value()?,
                "sbatch_support" => config.sbatch_support = bool_value()?,
                "pyxis_messages" => config.pyxis_messages = bool_value()?,
                "container_scope" => {
                    config.container_scope = match value {
                        "job" => Scope::Job,
                        "global" => Scope::Global,
                        _ => return Err(err("expected job or global")),
                    }
                }
                _ => {
                    return Err(err(
                        "unknown key: expected berth=, config=, runtime_path=, execute_entrypoint=, \
                         container_scope=, sbatch_support=, debug_request_dir= or pyxis_messages=",
                    ));
                }
            }
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_pyxis_and_the_installed_berth() {
        let c = PluginConfig::parse::<&str>(&[]).unwrap();
        assert_eq!(c.berth, PathBuf::from("/usr/local/bin/berth"));
        assert_eq!(c.config, None);
        assert!(!c.execute_entrypoint);
        assert!(c.sbatch_support);
        assert_eq!(c.container_scope, Scope::Job);
    }

    #[test]
    fn every_key_parses() {
        let c = PluginConfig::parse(&[
            "berth=/opt/berth/bin/berth",
            "config=/etc/berth/slurm.toml",
            "runtime_path=/run/pyxis",
            "execute_entrypoint=1",
            "container_scope=global",
            "sbatch_support=0",
            "debug_request_dir=/tmp/req",
            "pyxis_messages=1",
        ])
        .unwrap();
        assert_eq!(c.berth, PathBuf::from("/opt/berth/bin/berth"));
        assert_eq!(c.config, Some(PathBuf::from("/etc/berth/slurm.toml")));
        assert_eq!(c.runtime_path.as_deref(), Some("/run/pyxis"));
        assert!(c.execute_entrypoint);
        assert_eq!(c.container_scope, Scope::Global);
        assert!(!c.sbatch_support);
        assert_eq!(c.debug_request_dir, Some(PathBuf::from("/tmp/req")));
        assert!(c.pyxis_messages);
    }

    #[test]
    fn scratch_root_comes_from_berths_configuration_or_its_default() {
        assert_eq!(
            scratch_root(None).unwrap(),
            PathBuf::from("/var/tmp/berth-scratch")
        );
        assert_eq!(
            scratch_root(Some("[runtime]\nstate_dir = \"/x\"\n")).unwrap(),
            PathBuf::from("/var/tmp/berth-scratch")
        );
        assert_eq!(
            scratch_root(Some("[scratch]\nroot = \"/nvme/scratch\"\n")).unwrap(),
            PathBuf::from("/nvme/scratch")
        );
        scratch_root(Some("[scratch]\nroot = \"rel\"\n")).unwrap_err();
        scratch_root(Some("[scratch\n")).unwrap_err();
        let e = job_scratch_root(Some(std::path::Path::new("/nonexistent/berth.toml")))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("cannot read /nonexistent/berth.toml: "),
            "{e}"
        );
    }

    #[test]
    fn bad_arguments_name_themselves() {
        for (arg, hint) in [
            ("berth", "KEY=VALUE"),
            ("berth=berth", "absolute path"),
            ("sbatch_support=perhaps", "0 or 1"),
            ("container_scope=node", "job or global"),
            ("remap_root=1", "unknown key"),
        ] {
            let e = PluginConfig::parse(&[arg]).unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("plugstack.conf argument '{arg}': ")),
                "{e}"
            );
            assert!(e.contains(hint), "{e}");
        }
    }
}
