//! `spank_berth.so`: the Slurm SPANK plugin that gives srun, sbatch and salloc Pyxis's
//! `--container-*` options and runs each job step in a berth container.
//!
//! The plugin is thin on purpose: it collects the options, runs the `berth` binary as a
//! subprocess to build the step's container (`berth step create`, JSON on stdin and stdout), and
//! moves each task into the container's namespaces. Image import, mounts and cgroups happen in
//! berth, so a bug there cannot take slurmstepd down. See `plugin` for which callback does what.
//!
//! The pure parts (option table and values, plugstack.conf arguments, the JSON protocol, the
//! subprocess runner, the capability handling) are unit-tested; the SPANK glue (`ffi`, `plugin`)
//! needs Slurm's symbols and is tested end to end on a real Slurm (tests/root_slurm.rs).

pub mod config;
pub mod error;
mod join;
/// berth's own parser of `--container-mounts`, from the protocol crate both sides share: the
/// plugin checks entries one by one and leaves the rest of it to berth.
use berth_proto::mounts;
pub mod options;
mod pin;
pub mod request;
mod runner;

#[cfg(not(test))]
mod ffi;
#[cfg(not(test))]
mod plugin;

pub use error::SpankError;

/// An I/O error as a user reads it: "No such file or directory", without Rust's
/// " (os error 2)" suffix.
pub(crate) fn io_text(e: &std::io::Error) -> String {
    let text = e.to_string();
    match text.rfind(" (os error ") {
        Some(i) if text.ends_with(')') => text[..i].to_string(),
        _ => text,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn io_text_drops_the_os_error_suffix() {
        let e = std::io::Error::from_raw_os_error(2);
        assert_eq!(super::io_text(&e), "No such file or directory");
        let e = std::io::Error::other("plain");
        assert_eq!(super::io_text(&e), "plain");
    }
}
