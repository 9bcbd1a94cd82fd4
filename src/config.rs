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
    pub topology: TopologyConfig,
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

/// `[topology]`: GPU/NIC/CPU discovery, per-rank binding, device injection, CDI and health.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct TopologyConfig {
    /// Where /sys, /proc, /dev and /etc/ld.so.cache are read from (a snapshot or fixture tree
    /// instead of the live host).
    pub host_root: PathBuf,
    /// The NVML library, loaded at run time (a name the loader resolves, or a path).
    pub nvml_library: PathBuf,
    /// Default of the SPANK option `--container-bind`: pin each task to its GPU's NIC and cores
    /// (`closest`) or leave placement to Slurm (`none`).
    pub bind: crate::topology::plan::BindMode,
    /// How a pinned task's memory follows its NUMA nodes: `bind`, `preferred` or `none`.
    pub memory_policy: crate::topology::bind::MemPolicy,
    /// Globs (device name, netdev or PCI address) of the compute NICs; empty: detected (NICs on
    /// a GPU's PCIe switch, or every NIC when none is).
    pub compute_nics: Vec<String>,
    /// Globs of NICs to ignore everywhere (storage, management).
    pub exclude_nics: Vec<String>,
    /// GPUs the node must have (health); unset: as many as the PCI bus shows.
    pub expected_gpus: Option<u32>,
    /// RDMA ports allowed to be down (health), as `mlx5_1:2` or `mlx5_1` globs.
    pub ignore_ports: Vec<String>,
    /// XIDs that make the node unhealthy.
    pub xid_drain: Vec<u32>,
    /// Also check GPU PCIe link speed (GPUs lower it when idle, so only width by default).
    pub check_gpu_link_speed: bool,
    /// CDI spec directories, lowest priority first.
    pub cdi_dirs: Vec<PathBuf>,
}

impl Default for TopologyConfig {
    fn default() -> Self {
        Self {
            host_root: PathBuf::from("/"),
            nvml_library: PathBuf::from("libnvidia-ml.so.1"),
            bind: crate::topology::plan::BindMode::Closest,
            memory_policy: crate::topology::bind::MemPolicy::Bind,
            compute_nics: Vec::new(),
            exclude_nics: Vec::new(),
            expected_gpus: None,
            ignore_ports: Vec::new(),
            xid_drain: crate::topology::health::DEFAULT_XID_DRAIN.to_vec(),
            check_gpu_link_speed: false,
            cdi_dirs: vec![PathBuf::from("/etc/cdi"), PathBuf::from("/var/run/cdi")],
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
    fn topology_section_parses() {
        let c = Config::parse(
            "[topology]\nbind = \"none\"\nmemory_policy = \"preferred\"\nexclude_nics = [\"mlx5_1\", \"eno*\"]\nexpected_gpus = 8\n",
        )
        .unwrap();
        assert_eq!(c.topology.bind, crate::topology::plan::BindMode::None);
        assert_eq!(
            c.topology.memory_policy,
            crate::topology::bind::MemPolicy::Preferred
        );
        assert_eq!(c.topology.exclude_nics, ["mlx5_1", "eno*"]);
        assert_eq!(c.topology.expected_gpus, Some(8));
        assert_eq!(c.topology.cdi_dirs, TopologyConfig::default().cdi_dirs);
        assert!(Config::parse("[topology]\nbind = \"nearest\"\n").is_err());
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
