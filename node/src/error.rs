//! What can go wrong in the node's container workflows, by kind: the binary maps each kind to
//! its exit status (`src/cli/exit.rs`), so what is bad input and what is the host's failure is
//! decided here, where the workflow knows, and worded once.

use berth_image::ImageError;
use berth_runtime::RuntimeError;
use berth_topology::TopologyError;

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// Bad input: an option's value, a path or an image the user named.
    #[error("{0}")]
    Input(String),
    /// The node could not do what was asked (its state directory, a mount, a file of root's).
    #[error("{0}")]
    Host(String),
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error(transparent)]
    Topology(#[from] TopologyError),
}

impl NodeError {
    pub fn input(message: impl Into<String>) -> Self {
        Self::Input(message.into())
    }
    pub fn host(message: impl Into<String>) -> Self {
        Self::Host(message.into())
    }
}
