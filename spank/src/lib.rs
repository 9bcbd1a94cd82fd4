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

mod config;
mod join;
mod options;
mod request;
mod runner;

#[cfg(not(test))]
mod ffi;
#[cfg(not(test))]
mod plugin;
