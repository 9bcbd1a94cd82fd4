//! berth's configuration: `/etc/berth/berth.toml` (or `--config FILE` / `BERTH_CONFIG`). Every key
//! is optional; the defaults below are the single place they are defined, and
//! `configs/berth.toml` documents each one.

use std::path::{Path, PathBuf};

use serde::Deserialize;

pub const DEFAULT_PATH: &str = "/etc/berth/berth.toml";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config {path}: {message}")]
    Parse { path: PathBuf, message: String },
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub cgroup: CgroupConfig,
    pub runtime: RuntimeConfig,
    pub registry: RegistryConfig,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct CgroupConfig {
    /// The delegated cgroup v2 directory under which berth creates one cgroup per container;
    /// `None` means `berth` under the host's cgroup2 mount (see `cgroup::default_root`).
    pub root: Option<PathBuf>,
}

impl CgroupConfig {
    pub fn root(&self) -> PathBuf {
        self.root
            .clone()
            .unwrap_or_else(crate::cgroup::default_root)
    }
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct RuntimeConfig {
    /// Where running containers keep their state (one directory each); a tmpfs is best.
    pub state_dir: PathBuf,
    /// Seconds to wait for a killed container's processes to be gone before giving up.
    pub kill_timeout_s: u64,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            state_dir: PathBuf::from("/run/berth"),
            kill_timeout_s: 10,
        }
    }
}

/// How images are pulled from OCI distribution registries (`image::registry`).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct RegistryConfig {
    /// berth's own netrc-style credentials file (`machine HOST login USER password PASS`); `~`
    /// is the home of the user who asked for the image. Read before Enroot's file.
    pub credentials: String,
    /// Also read Enroot's credentials file, `$ENROOT_CONFIG_PATH/.credentials`
    /// (default `~/.config/enroot/.credentials`), so Pyxis users keep their logins.
    pub enroot_credentials: bool,
    /// PEM files of extra certificate authorities trusted for registries, on top of the system's.
    pub ca_files: Vec<PathBuf>,
    /// Registries (`HOST[:PORT]`, exactly as in image references) spoken to over plain HTTP.
    /// Every other registry must use TLS.
    pub insecure: Vec<String>,
    /// Layers downloaded at once per image.
    pub parallel_downloads: usize,
    /// Seconds to wait for a TCP (and TLS) connection.
    pub connect_timeout_s: u64,
    /// Seconds a response may stall (no byte received) before the transfer is retried.
    pub read_timeout_s: u64,
    /// Attempts per request on server errors (5xx, 429) and dropped connections; a dropped layer
    /// download resumes where it stopped.
    pub retries: u32,
    /// Delay before the first retry in milliseconds; it doubles with each further attempt.
    pub retry_backoff_ms: u64,
}

impl Default for RegistryConfig {
    fn default() -> Self {
        Self {
            credentials: "~/.config/berth/credentials".to_string(),
            enroot_credentials: true,
            ca_files: Vec::new(),
            insecure: Vec::new(),
            parallel_downloads: 8,
            connect_timeout_s: 30,
            read_timeout_s: 60,
            retries: 5,
            retry_backoff_ms: 500,
        }
    }
}

impl Config {
    /// Loads `path`; when `path` is the default location and absent, the defaults apply.
    pub fn load(path: &Path, explicit: bool) -> Result<Self, ConfigError> {
        match std::fs::read_to_string(path) {
            Ok(text) => Self::parse(&text).map_err(|message| ConfigError::Parse {
                path: path.to_path_buf(),
                message,
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !explicit => Ok(Self::default()),
            Err(source) => Err(ConfigError::Read {
                path: path.to_path_buf(),
                source,
            }),
        }
    }

    pub fn parse(text: &str) -> Result<Self, String> {
        toml::from_str(text).map_err(|e| e.message().to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_config_parses_to_the_defaults() {
        let shipped = include_str!("../configs/berth.toml");
        assert_eq!(Config::parse(shipped).unwrap(), Config::default());
    }

    #[test]
    fn partial_config_keeps_other_defaults() {
        let c = Config::parse("[cgroup]\nroot = \"/sys/fs/cgroup/unified/berth\"\n").unwrap();
        assert_eq!(
            c.cgroup.root(),
            PathBuf::from("/sys/fs/cgroup/unified/berth")
        );
        assert_eq!(c.runtime, RuntimeConfig::default());
    }

    #[test]
    fn unknown_keys_are_rejected() {
        let err = Config::parse("[cgroup]\nrot = \"/x\"\n").unwrap_err();
        assert!(err.contains("rot"), "{err}");
    }

    #[test]
    fn missing_default_file_means_defaults_but_explicit_is_an_error() {
        let missing = Path::new("/nonexistent/berth.toml");
        assert_eq!(Config::load(missing, false).unwrap(), Config::default());
        assert!(Config::load(missing, true).is_err());
    }
}
