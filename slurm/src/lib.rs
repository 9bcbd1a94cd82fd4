//! The workflows of a berth node: the container of a Slurm job step from the SPANK plugin's
//! request ([`step`]), the job's Prolog and Epilog ([`job`]), the node's health ([`health`]),
//! what every container needs before the runtime makes it ([`container`]: the image, host
//! files, options), the host's own software a container asks for ([`hostsw`], its MPI
//! [`mpi`]), the node's topology source ([`node`]), and the Pyxis-shaped request turned into a
//! container request ([`request`], [`env`], [`cgroup`]). The node's configuration,
//! `/etc/berth/berth.toml`, is the berth-config crate, re-exported as [`config`].

pub mod cgroup;
pub use berth_config as config;
pub mod container;
pub mod env;
mod error;
pub mod export;
pub mod health;
pub mod hostsw;
pub mod job;
pub mod lazy;
pub mod mpi;
pub use berth_proto::mounts;
pub mod node;
pub mod request;
pub mod run;
pub mod step;

pub use error::SlurmError;
