//! The node as topology reads it: the live host or a snapshot tree, and its GPU backend (live
//! NVML, a recording, or none).

use std::path::PathBuf;

use berth_topology::gpu::{GpuBackend, Nvml, Recorded};
use berth_topology::node::{self, NicPolicy, Node};
use berth_topology::{Host, TopologyError};

use berth_config::Config;

/// Where the node is read from; `Default` is the configured host root with live NVML.
#[derive(Clone, Debug, Default)]
pub struct Source {
    /// A snapshot tree instead of `[topology] host_root`.
    pub host_root: Option<PathBuf>,
    /// A recorded NVML snapshot instead of loading NVML.
    pub nvml_record: Option<PathBuf>,
}

/// The host to read, from the flag or the configuration.
pub fn host(source: &Source, config: &Config) -> Host {
    Host::new(
        source
            .host_root
            .clone()
            .unwrap_or_else(|| config.topology.host_root.clone()),
    )
}

/// The GPU backend: a recording, live NVML on the live host, or "no driver" for a snapshot
/// without a recording (live NVML would describe another machine).
pub fn backend(source: &Source, config: &Config) -> Result<Box<dyn GpuBackend>, TopologyError> {
    if let Some(path) = &source.nvml_record {
        return Ok(Box::new(Recorded::load(path)?));
    }
    if host(source, config).is_live() {
        Ok(Box::new(Nvml::new(config.topology.nvml_library.clone())))
    } else {
        Ok(Box::new(Recorded::no_driver()))
    }
}

pub fn nic_policy(config: &Config) -> NicPolicy {
    NicPolicy {
        compute: config.topology.compute_nics.clone(),
        exclude: config.topology.exclude_nics.clone(),
    }
}

/// Reads the node.
pub fn discover(source: &Source, config: &Config) -> Result<(Host, Node), TopologyError> {
    let host = host(source, config);
    let backend = backend(source, config)?;
    let node = node::discover(&host, backend.as_ref(), &nic_policy(config))?;
    Ok((host, node))
}
