//! berth: runs Slurm job steps (and standalone commands) in containers isolated by cgroup v2 and
//! namespaces. The library holds every piece; `main.rs` only parses the command line.

pub mod cli;
#[cfg(test)]
mod layout_check;
pub mod log;

// The lower crates of the workspace, under the names the rest of berth has always used.
pub use berth_cgroup as cgroup;
pub use berth_config as config;
pub use berth_image as image;
pub use berth_node as node;
pub use berth_runtime as runtime;
pub use berth_slurm as slurm;
pub use berth_spec as spec;
pub use berth_stage as stage;
pub use berth_sys::{privfs, time, user};
pub use berth_topology as topology;
