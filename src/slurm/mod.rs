//! Slurm integration: what the SPANK plugin asks for a step (Pyxis-compatible options), turned
//! into a container request, and the job lifecycle of Prolog and Epilog.

pub mod cgroup;
pub mod env;
pub use berth_proto::mounts;
pub mod step;
