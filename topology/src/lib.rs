//! The node's GPU, NIC and CPU topology: what is where (discovered from sysfs, procfs and NVML),
//! how far apart it is (`nvidia-smi topo -m` distances), which GPU pairs with which NIC and NUMA
//! node, the per-rank plans that pin each MPI/NCCL rank to its GPU, NIC and cores, the device
//! edits that give a container exactly its GPUs and HCAs (berth's own and CDI), and the node
//! health checks Prolog/Epilog run.
//!
//! Every host path is read through a [`Host`], whose root is `/` in production and a fixture tree
//! in tests, so discovery and planning are tested on node layouts this machine does not have.
//! Deciding is pure (`plan`, `inject::plan`, `cdi`); doing (`bind`) is a thin layer.

pub mod bind;
pub mod cdi;
pub mod cpu;
pub mod cpuset;
pub mod distance;
pub mod gpu;
pub mod health;
pub mod inject;
pub mod job;
pub mod kmsg;
pub mod ldcache;
pub mod nccl;
pub mod node;
pub mod pci;
pub mod plan;
pub mod rdma;
pub mod render;
pub mod step;

/// Faithful sysfs trees of the GPU machines this host lacks, for tests here and in berth.
#[cfg(any(test, feature = "fixtures"))]
pub mod fixture;

use std::path::{Path, PathBuf};

pub use cpuset::CpuSet;
pub use distance::Link;
pub use node::{Gpu, Nic, NicRole, Node};
pub use pci::Bdf;
pub use plan::{NodePlan, RankPlan};

/// The host whose topology is read: `/` in production, a fixture tree in tests. Paths under it
/// are the host's absolute paths (`/sys/...`, `/proc/...`, `/dev/...`, `/etc/ld.so.cache`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Host {
    root: PathBuf,
}

impl Host {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Whether this is the running system itself (so its own process state applies).
    pub fn is_live(&self) -> bool {
        self.root == Path::new("/")
    }

    /// The path of the host's absolute path `abs` under the root.
    pub fn path(&self, abs: impl AsRef<Path>) -> PathBuf {
        let abs = abs.as_ref();
        self.root.join(abs.strip_prefix("/").unwrap_or(abs))
    }

    /// `/sys/<rel>` under the root.
    pub fn sys(&self, rel: &str) -> PathBuf {
        self.path("/sys").join(rel)
    }

    /// `/proc/<rel>` under the root.
    pub fn proc(&self, rel: &str) -> PathBuf {
        self.path("/proc").join(rel)
    }

    /// The host path (as the host sees it, starting with `/`) of a path under the root.
    pub fn host_path(&self, under_root: &Path) -> Option<PathBuf> {
        under_root
            .strip_prefix(&self.root)
            .ok()
            .map(|rel| Path::new("/").join(rel))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    #[error("reading {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("writing {}: {source}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {what}", path.display())]
    Parse { path: PathBuf, what: String },
    #[error("NVML recording {}: {what}", path.display())]
    Recording { path: PathBuf, what: String },
    #[error("{var}={value}: {why}")]
    Job {
        var: String,
        value: String,
        why: String,
    },
    #[error("{0}")]
    Plan(String),
    /// What the caller asked that the node or the step cannot be (`--tasks 0`, a rank not in
    /// the step): bad input.
    #[error("{0}")]
    Input(String),
    /// A value that is not what it claims (a CPU list, a PCI address, a CDI spec's field).
    #[error("{0}")]
    Value(String),
    #[error("{what}: {source}")]
    Sys {
        what: String,
        source: nix::errno::Errno,
    },
    #[error("CDI spec {}: {what}", path.display())]
    CdiSpec { path: PathBuf, what: String },
    #[error("CDI device '{name}': {what}")]
    CdiDevice { name: String, what: String },
    #[error("loader cache {}: {what}", path.display())]
    LdCache { path: PathBuf, what: String },
    #[error("editing the container spec: {0}")]
    Oci(#[from] oci_spec::OciSpecError),
}

/// The trimmed contents of a small sysfs/procfs file; `None` when it does not exist or cannot be
/// read (sysfs attributes vanish with hot-unplug and some read as EINVAL when unsupported).
pub(crate) fn read_attr(path: &Path) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}

/// The sorted entry names of a directory; empty when it does not exist.
pub(crate) fn list_dir(path: &Path) -> Result<Vec<String>, TopologyError> {
    match std::fs::read_dir(path) {
        Ok(entries) => {
            let mut names: Vec<String> = entries
                .flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_string))
                .collect();
            names.sort();
            Ok(names)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(source) => Err(TopologyError::Read {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Writes `bytes` to `path` through a temporary file in the same directory and a rename.
pub(crate) fn atomic_write(path: &Path, bytes: &[u8]) -> Result<(), TopologyError> {
    let err = |source| TopologyError::Write {
        path: path.to_path_buf(),
        source,
    };
    let name = path.file_name().ok_or_else(|| {
        err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a file name",
        ))
    })?;
    let tmp = path.with_file_name(format!(
        ".{}.tmp.{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| {
        use std::io::Write as _;
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(err)?;
    Ok(())
}

/// Shell-style matching of `*` and `?`, for NIC and port patterns in the configuration.
pub(crate) fn glob_match(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    let (mut pi, mut ti) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ti));
            pi += 1;
        } else if let Some((sp, st)) = star {
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_paths_stay_under_the_root() {
        let h = Host::new("/tmp/fx");
        assert_eq!(h.path("/sys/bus"), PathBuf::from("/tmp/fx/sys/bus"));
        assert_eq!(h.sys("class/net"), PathBuf::from("/tmp/fx/sys/class/net"));
        assert_eq!(
            h.host_path(Path::new("/tmp/fx/usr/lib/libcuda.so.1")),
            Some(PathBuf::from("/usr/lib/libcuda.so.1"))
        );
        assert!(!h.is_live());
        assert!(Host::new("/").is_live());
    }

    #[test]
    fn globs() {
        assert!(glob_match("mlx5_*", "mlx5_10"));
        assert!(glob_match("mlx5_?", "mlx5_1"));
        assert!(!glob_match("mlx5_?", "mlx5_10"));
        assert!(glob_match("0000:2a:00.*", "0000:2a:00.1"));
        assert!(glob_match("*", ""));
        assert!(!glob_match("eth0", "eth01"));
        assert!(glob_match("*a*b", "xxaybb"));
    }
}

#[cfg(test)]
mod scenarios;
