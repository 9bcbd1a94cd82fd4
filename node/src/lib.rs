//! What a berth node does outside Slurm, for `berth run`/`create`/`export` and for Slurm's steps
//! alike: what every container needs before the runtime makes it ([`container`]: the image,
//! host files, options, GPUs), the container a user's flags describe ([`run`]), a container's
//! or an image's export source ([`export`]), the host's own software a container asks for
//! ([`hostsw`], its MPI [`mpi`]), lazy images by the site's option ([`lazy`]), the node's
//! topology source ([`source`]) and its health ([`health`]). The Slurm side (the step, the
//! Prolog and Epilog) is berth-slurm, above this crate.

pub mod container;
mod error;
pub mod export;
pub mod health;
pub mod hostsw;
pub mod lazy;
pub mod mpi;
pub mod run;
pub mod source;

pub use error::NodeError;
