//! The Slurm side of a berth node: the container of a Slurm job step from the SPANK plugin's
//! request ([`step`]), the job's Prolog and Epilog ([`job`]), and the Pyxis-shaped request turned
//! into a container request ([`request`], [`env`], [`cgroup`]). What every container needs
//! (the image, host files, host software, the node's topology and health) is berth-node's, used
//! here under its module names; the node's configuration, `/etc/berth/berth.toml`, is the
//! berth-config crate, re-exported as [`config`].

pub mod cgroup;
pub use berth_config as config;
pub mod env;
mod error;
pub mod job;
pub use berth_proto::mounts;
pub mod request;
pub mod step;

use berth_node::{container, health, hostsw, lazy, mpi, source};

pub use error::SlurmError;
