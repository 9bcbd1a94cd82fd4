//! berth's configuration: `/etc/berth/berth.toml` (or `--config FILE` / `BERTH_CONFIG`). Every key
//! is optional; the defaults below are the single place they are defined, and
//! `configs/berth.toml` documents each one.

use std::path::{Path, PathBuf};

use serde::Deserialize;

pub use berth_image::config::{
    Compression, MirrorConfig, RegistryConfig, SquashfsConfig, StoreConfig,
};

mod host_software;

/// What can go wrong loading the configuration: both are the admin's input to fix.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// berth.toml does not parse, or names what berth does not know.
    #[error("config {}: {message}", path.display())]
    Parse { path: PathBuf, message: String },
    #[error("reading config {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
}

pub const DEFAULT_PATH: &str = "/etc/berth/berth.toml";

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub cgroup: CgroupConfig,
    pub runtime: RuntimeConfig,
    pub registry: RegistryConfig,
    pub store: StoreConfig,
    pub squashfs: SquashfsConfig,
    pub topology: TopologyConfig,
    pub stage: StageConfig,
    pub scratch: ScratchConfig,
    pub log: LogConfig,
    /// `[controller]`: read by `berth-controller` (its own crate checks the fields).
    pub controller: toml::Table,
    pub agent: AgentConfig,
    pub peers: PeersConfig,
    pub host_software: HostSoftwareConfig,
}

/// `[host_software]`: the node's own software a container may ask for (berth_node::hostsw).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct HostSoftwareConfig {
    /// Every Slurm step gets the host's Slurm client unless it says `--no-container-slurm`.
    pub slurm: bool,
    /// What `--container-slurm` binds read-only, each `PATH` or `SOURCE:DESTINATION` (absolute):
    /// the client binaries, their libraries and plugins, slurm.conf's directory, munged's socket
    /// directory. Missing ones are skipped; a directory holding a key is refused. `*` and `?`
    /// match in any component of a PATH.
    pub slurm_paths: Vec<String>,
    /// Every step gets Lmod and the module trees unless it says `--no-container-modules`.
    pub modules: bool,
    /// What `--container-modules` binds read-only (as `slurm_paths`): Lmod, the Lua it runs on,
    /// the module trees and the software their modules point to. `*` and `?` match in any
    /// component of a PATH.
    pub module_paths: Vec<String>,
    /// Every step gets the host's MPI unless it says `--container-mpi=image`.
    pub mpi: bool,
    /// The host's MPI libraries and the libraries they load, each bound read-only under its
    /// own name into the container's berth_node::mpi::LIB_DIR (first in LD_LIBRARY_PATH); `PATH`
    /// with `*` and `?` as `slurm_paths`.
    pub mpi_libraries: Vec<String>,
    /// What else the host's MPI needs, bound read-only at its own path (as `slurm_paths`): its
    /// plugin trees, configuration files and help texts.
    pub mpi_paths: Vec<String>,
}

impl Default for HostSoftwareConfig {
    fn default() -> Self {
        Self {
            slurm: false,
            slurm_paths: host_software::default_slurm_paths(),
            modules: false,
            module_paths: host_software::default_module_paths(),
            mpi: false,
            mpi_libraries: host_software::default_mpi_libraries(),
            mpi_paths: host_software::default_mpi_paths(),
        }
    }
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
        self.root.clone().unwrap_or_else(berth_cgroup::default_root)
    }
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct RuntimeConfig {
    /// Where running containers keep their state (one directory each); a tmpfs is best.
    pub state_dir: PathBuf,
    /// Seconds to wait for a killed container's processes to be gone before giving up.
    pub kill_timeout_s: u64,
    /// Seconds the image's entrypoint may take before it runs its arguments (Slurm steps with
    /// `--container-entrypoint`).
    pub entrypoint_timeout_s: u64,
    /// Namespaces (`ipc`, `uts`) every Slurm step's container has of its own, on top of
    /// those its `--container-unshare` names. Empty (Pyxis's behaviour): the host's.
    pub step_unshare: Vec<String>,
    /// Bind a block device of the host that a user names as a mount source (and may open). Off:
    /// refused in one line; a character device the user may open is always bound.
    pub mount_block_devices: bool,
    /// A container of a user (not root) made without remap-root runs in a user namespace that
    /// maps the user and their groups to themselves, as Pyxis's do (`/proc/self/uid_map` is
    /// `UID UID 1`; root's files show as nobody's). Off: the host's user namespace.
    pub user_namespace: bool,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            state_dir: PathBuf::from("/run/berth"),
            kill_timeout_s: 10,
            entrypoint_timeout_s: 60,
            step_unshare: Vec::new(),
            mount_block_devices: false,
            user_namespace: true,
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
    pub bind: berth_topology::plan::BindMode,
    /// How a pinned task's memory follows its NUMA nodes: `bind`, `preferred` or `none`.
    pub memory_policy: berth_topology::bind::MemPolicy,
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
    /// `berth epilog` runs the health checks and fails (draining the node) when they fail.
    pub epilog_health: bool,
    /// CDI spec directories, lowest priority first.
    pub cdi_dirs: Vec<PathBuf>,
}

impl Default for TopologyConfig {
    fn default() -> Self {
        Self {
            host_root: PathBuf::from("/"),
            nvml_library: PathBuf::from("libnvidia-ml.so.1"),
            bind: berth_topology::plan::BindMode::Closest,
            memory_policy: berth_topology::bind::MemPolicy::Bind,
            compute_nics: Vec::new(),
            exclude_nics: Vec::new(),
            expected_gpus: None,
            ignore_ports: Vec::new(),
            xid_drain: berth_topology::health::DEFAULT_XID_DRAIN.to_vec(),
            check_gpu_link_speed: false,
            epilog_health: true,
            cdi_dirs: vec![PathBuf::from("/etc/cdi"), PathBuf::from("/var/run/cdi")],
        }
    }
}

/// `[agent]`: `berth agent` on every node, and the controllers `berth cluster` asks.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AgentConfig {
    /// The cluster controllers' API addresses (`host:port`); any of them, a follower names the
    /// leader. Empty: `berth agent` and `berth cluster` refuse to start.
    pub controllers: Vec<String>,
    /// The shared key file (the same content on every node and controller).
    pub key_file: PathBuf,
    /// Milliseconds between two heartbeats.
    pub interval_ms: u64,
    /// Milliseconds between two rounds of health checks (at most interval_ms): a check whose
    /// status changed is sent at once, not at the next heartbeat.
    pub check_interval_ms: u64,
    /// A round of checks not done in this many milliseconds reports its checks `unknown`
    /// (which never drains).
    pub check_timeout_ms: u64,
    /// Each wait is the interval plus or minus half this percentage of it, at random.
    pub jitter_percent: u32,
    /// Where the agent serves `/metrics`; empty: nowhere.
    pub metrics_listen: String,
    /// This node's Slurm name; unset: the short host name.
    pub node_name: Option<String>,
    /// slurmd's pid file (slurm.conf's SlurmdPidFile): slurmd is up when the process it names
    /// is a running slurmd. Empty: slurmd is not checked (reported not configured).
    pub slurmd_pid_file: PathBuf,
    /// Whether to check munge with a `munge -n | unmunge` round trip.
    pub check_munge: bool,
    /// munged's socket for that round trip; empty: munge's default.
    pub munge_socket: PathBuf,
    /// Where the agent records the rollout steps it started (root only): a step is run once.
    pub rollout_dir: PathBuf,
    /// What a rollout's reboot step runs (`sh -c`).
    pub reboot_command: String,
    /// The boot id a heartbeat reports (a new one is a reboot).
    pub boot_id_file: PathBuf,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            controllers: Vec::new(),
            key_file: PathBuf::from("/etc/berth/cluster.key"),
            interval_ms: 5000,
            check_interval_ms: 1000,
            check_timeout_ms: 10_000,
            jitter_percent: 20,
            metrics_listen: "0.0.0.0:6821".into(),
            node_name: None,
            slurmd_pid_file: PathBuf::from("/run/slurmd.pid"),
            check_munge: true,
            munge_socket: PathBuf::new(),
            rollout_dir: PathBuf::from("/var/lib/berth/rollout"),
            reboot_command: "systemctl reboot".into(),
            boot_id_file: PathBuf::from("/proc/sys/kernel/random/boot_id"),
        }
    }
}

/// `[peers]`: nodes fetch image blobs from each other (`berth_image::peers`, `berth_agent::peer`).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct PeersConfig {
    /// Where `berth agent` serves the blobs the store keeps to other nodes and takes pre-warm
    /// requests; "" serves nothing (and imports keep no blobs).
    pub listen: String,
    /// The address other nodes reach this one's `listen` at; "": `listen` with an unspecified
    /// host replaced by the host name.
    pub advertise: String,
    /// Most compressed blob bytes the store keeps for peers (oldest go first); 0 keeps none.
    pub cache_bytes: u64,
    /// Most blob transfers this node serves at once; more wait their turn (503, retried).
    pub max_uploads: usize,
    /// Imports ask the cluster controller which nodes hold an image's blobs and fetch from them
    /// before the registry.
    pub lookup: bool,
    /// Milliseconds that question may take; the registry is used without an answer.
    pub lookup_timeout_ms: u64,
}

impl Default for PeersConfig {
    fn default() -> Self {
        Self {
            listen: String::new(),
            advertise: String::new(),
            cache_bytes: 20 << 30,
            max_uploads: 8,
            lookup: true,
            lookup_timeout_ms: 2000,
        }
    }
}

/// `[log]`: where the Slurm paths (`berth prolog`, `epilog`, `step`) write their log lines
/// (the berth binary's `log` module).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// stderr (Slurm's logs and the user's srun), syslog/journald, or both.
    pub target: LogTarget,
    /// The least severe level written; `-v`/`-vv` and `$BERTH_LOG` raise it.
    pub level: LogLevel,
    /// The syslog socket (a unix datagram socket: journald and rsyslog listen on /dev/log).
    pub syslog_socket: PathBuf,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            target: LogTarget::Both,
            level: LogLevel::Warn,
            syslog_socket: PathBuf::from("/dev/log"),
        }
    }
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogTarget {
    Stderr,
    Syslog,
    Both,
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

impl LogLevel {
    /// The name `tracing_subscriber::EnvFilter` knows it by.
    pub fn name(self) -> &'static str {
        match self {
            LogLevel::Error => "error",
            LogLevel::Warn => "warn",
            LogLevel::Info => "info",
            LogLevel::Debug => "debug",
            LogLevel::Trace => "trace",
        }
    }
}

impl Config {
    /// The sections the image crate reads.
    pub fn image(&self) -> berth_image::config::Settings<'_> {
        berth_image::config::Settings {
            registry: &self.registry,
            store: &self.store,
            squashfs: &self.squashfs,
        }
    }

    /// Loads `path`; when `path` is the default location and absent, the defaults apply.
    pub fn load(path: &Path, explicit: bool) -> Result<Self, ConfigError> {
        match std::fs::read_to_string(path) {
            Ok(text) => Self::parse(&text).map_err(|e| ConfigError::Parse {
                path: path.to_path_buf(),
                message: e.message().to_string(),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !explicit => Ok(Self::default()),
            Err(source) => Err(ConfigError::Read {
                path: path.to_path_buf(),
                source,
            }),
        }
    }

    pub fn parse(text: &str) -> Result<Self, toml::de::Error> {
        toml::from_str(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_config_parses_to_the_defaults() {
        let shipped = include_str!("../../configs/berth.toml");
        assert_eq!(Config::parse(shipped).unwrap(), Config::default());
    }

    #[test]
    fn the_spank_plugin_knows_the_default_scratch_root() {
        // The plugin reads `[scratch] root` itself and falls back to its own copy of the default.
        let plugin = include_str!("../../spank/src/config.rs");
        let root = ScratchConfig::default().root;
        let line = format!("DEFAULT_SCRATCH_ROOT: &str = \"{}\";", root.display());
        assert!(plugin.contains(&line), "spank/src/config.rs lacks {line}");
        let line = format!("DEFAULT_BERTH_CONFIG: &str = \"{DEFAULT_PATH}\";");
        assert!(plugin.contains(&line), "spank/src/config.rs lacks {line}");
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
    fn the_dataset_cache_is_on_only_with_prefixes() {
        assert_eq!(Config::default().stage.options().cache, None);
        let c = Config::parse(
            "[stage]\ncache_prefixes = [\"/data\"]\ncache_dir = \"/nvme/cache\"\ncache_max_bytes = 5\n",
        )
        .unwrap();
        assert_eq!(
            c.stage.options().cache,
            Some(berth_stage::cache::CacheOptions {
                dir: PathBuf::from("/nvme/cache"),
                prefixes: vec![PathBuf::from("/data")],
                max_bytes: 5,
            })
        );
    }

    #[test]
    fn log_section_parses() {
        let c = Config::parse(
            "[log]\ntarget = \"syslog\"\nlevel = \"info\"\nsyslog_socket = \"/run/x.sock\"\n",
        )
        .unwrap();
        assert_eq!(c.log.target, LogTarget::Syslog);
        assert_eq!(c.log.level, LogLevel::Info);
        assert_eq!(c.log.syslog_socket, PathBuf::from("/run/x.sock"));
        assert_eq!(Config::default().log.target, LogTarget::Both);
        Config::parse("[log]\ntarget = \"file\"\n").unwrap_err();
        Config::parse("[log]\nlevel = \"loud\"\n").unwrap_err();
    }

    #[test]
    fn registry_mirrors_parse() {
        let c = Config::parse(
            "[registry.mirrors.\"docker.io\"]\nmirrors = [\"m.example/hub\", \"m2:5000\"]\n\
             [registry.mirrors.\"ghcr.io\"]\nmirrors = [\"m.example\"]\nfallback = false\n",
        )
        .unwrap();
        let hub = &c.registry.mirrors["docker.io"];
        assert_eq!(hub.mirrors, ["m.example/hub", "m2:5000"]);
        assert!(hub.fallback);
        assert!(!c.registry.mirrors["ghcr.io"].fallback);
        assert!(c.registry.auth_files);
        Config::parse("[registry.mirrors.\"x\"]\nmirror = []\n").unwrap_err();
    }

    #[test]
    fn unknown_keys_are_rejected() {
        let err = Config::parse("[cgroup]\nrot = \"/x\"\n").unwrap_err();
        assert!(err.to_string().contains("rot"), "{err}");
    }

    #[test]
    fn missing_default_file_means_defaults_but_explicit_is_an_error() {
        let missing = Path::new("/nonexistent/berth.toml");
        assert_eq!(Config::load(missing, false).unwrap(), Config::default());
        Config::load(missing, true).unwrap_err();
    }

    #[test]
    fn squashfs_section() {
        let c = Config::parse(
            "[squashfs]\nmount_dir = \"/var/lib/berth/mnt\"\ncompression = \"gzip\"\ncompression_level = 9\n",
        )
        .unwrap();
        assert_eq!(c.squashfs.mount_dir, PathBuf::from("/var/lib/berth/mnt"));
        assert_eq!(c.squashfs.compression, Compression::Gzip);
        c.squashfs.check().unwrap();
        assert!(!c.squashfs.enroot_entrypoint);
        let bad = Config::parse("[squashfs]\ncompression_level = 23\n").unwrap();
        let err = bad.squashfs.check().unwrap_err().to_string();
        assert!(err.contains("zstd takes 1-22"), "{err}");
        let lz4 = Config::parse("[squashfs]\ncompression = \"lz4\"\ncompression_level = 99\n");
        assert!(
            lz4.unwrap().squashfs.check().is_ok(),
            "lz4 has no level to check"
        );
        Config::parse("[squashfs]\ncompression = \"brotli\"\n").unwrap_err();
    }

    #[test]
    fn topology_section_parses() {
        let c = Config::parse(
            "[topology]\nbind = \"none\"\nmemory_policy = \"preferred\"\nexclude_nics = [\"mlx5_1\", \"eno*\"]\nexpected_gpus = 8\n",
        )
        .unwrap();
        assert_eq!(c.topology.bind, berth_topology::plan::BindMode::None);
        assert_eq!(
            c.topology.memory_policy,
            berth_topology::bind::MemPolicy::Preferred
        );
        assert_eq!(c.topology.exclude_nics, ["mlx5_1", "eno*"]);
        assert_eq!(c.topology.expected_gpus, Some(8));
        assert!(c.topology.epilog_health, "on unless turned off");
        assert_eq!(c.topology.cdi_dirs, TopologyConfig::default().cdi_dirs);
        Config::parse("[topology]\nbind = \"nearest\"\n").unwrap_err();
    }
}

/// Data staging (`berth stage`, and stage-in/out from the Prolog/Epilog).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct StageConfig {
    /// Copy threads.
    pub workers: usize,
    /// Files larger than this many MiB are copied in chunks of this size, in parallel.
    pub chunk_mib: u64,
    /// Hash source and destination after every stage (xxh3).
    pub verify: bool,
    /// Copy the `user.*` extended attributes of staged files and directories.
    pub xattrs: bool,
    /// Seconds between progress lines when stderr is not a terminal.
    pub progress_interval_s: u64,
    /// The dataset cache's directory (root's, 0700), on the scratch filesystem so that cached
    /// files can be hardlinked into jobs' scratch.
    pub cache_dir: PathBuf,
    /// Source directories whose datasets are cached; empty: no cache.
    pub cache_prefixes: Vec<PathBuf>,
    /// Least-recently-used entries are evicted beyond this many bytes.
    pub cache_max_bytes: u64,
}

impl Default for StageConfig {
    fn default() -> Self {
        Self {
            workers: 16,
            chunk_mib: 64,
            verify: false,
            xattrs: false,
            progress_interval_s: 10,
            cache_dir: PathBuf::from("/var/tmp/berth-cache"),
            cache_prefixes: Vec::new(),
            cache_max_bytes: 100_000_000_000,
        }
    }
}

impl StageConfig {
    pub fn options(&self) -> berth_stage::Options {
        berth_stage::Options {
            workers: self.workers.max(1),
            chunk_size: self.chunk_mib.max(1) << 20,
            verify: self.verify,
            xattrs: self.xattrs,
            cap: None,
            progress: true,
            progress_interval: std::time::Duration::from_secs(self.progress_interval_s.max(1)),
            cache: (!self.cache_prefixes.is_empty()).then(|| berth_stage::cache::CacheOptions {
                dir: self.cache_dir.clone(),
                prefixes: self.cache_prefixes.clone(),
                max_bytes: self.cache_max_bytes,
            }),
        }
    }
}

/// Per-job scratch directories on node-local storage.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ScratchConfig {
    /// Where each job gets its directory (`<root>/<job id>`), on local NVMe.
    pub root: PathBuf,
    /// The most bytes a job may stage into its scratch; unset: only the free space limits.
    pub cap_bytes: Option<u64>,
    /// Where containers see the job's scratch.
    pub container_path: PathBuf,
    /// Where the Epilog moves a job's scratch when its stage-out fails; unset: `<root>/retained`
    /// (the same filesystem, so the move is a rename).
    pub retention_dir: Option<PathBuf>,
    /// Days a retained scratch is kept before the Prolog, Epilog or `berth gc` removes it.
    pub retention_days: u64,
}

impl Default for ScratchConfig {
    fn default() -> Self {
        Self {
            root: PathBuf::from("/var/tmp/berth-scratch"),
            cap_bytes: None,
            container_path: PathBuf::from("/scratch"),
            retention_dir: None,
            retention_days: 7,
        }
    }
}

impl ScratchConfig {
    /// The retention area: `retention_dir`, or `<root>/retained`.
    pub fn retention_dir(&self) -> PathBuf {
        self.retention_dir
            .clone()
            .unwrap_or_else(|| self.root.join("retained"))
    }
}
