//! berth: runs Slurm job steps (and standalone commands) in containers isolated by cgroup v2 and
//! namespaces. The library holds every piece; `main.rs` only parses the command line.

pub mod cgroup;
pub mod cli;
pub mod config;
pub mod image;
pub mod log;
pub mod privfs;
pub mod runtime;
pub mod slurm;
pub mod spec;
pub mod stage;
pub mod time;
pub mod topology;
