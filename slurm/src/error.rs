//! What can go wrong in berth's node workflows, by kind: the binary maps each kind to its exit
//! status (`src/cli/exit.rs`), so what is bad input and what is the host's failure is decided
//! here, where the workflow knows, and worded once.

use berth_image::ImageError;
use berth_runtime::RuntimeError;
use berth_topology::TopologyError;

#[derive(Debug, thiserror::Error)]
pub enum SlurmError {
    /// Bad input: the plugin's request, an option's value, a path the user named.
    #[error("{0}")]
    Input(String),
    /// The node could not do what was asked (its state directory, a mount, a file of root's).
    #[error("{0}")]
    Host(String),
    /// What the plugin's request says that berth cannot take (a `--container-mounts` entry, a
    /// relative path without a working directory): bad input.
    #[error(transparent)]
    Request(#[from] berth_proto::ProtoError),
    /// What the node's container workflows said (berth-node), kept by kind.
    #[error(transparent)]
    Node(#[from] berth_node::NodeError),
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error(transparent)]
    Topology(#[from] TopologyError),
    /// The step's image could not be had (the plugin words this as Pyxis does).
    #[error(transparent)]
    ImageUnavailable(Box<SlurmError>),
}

impl SlurmError {
    pub fn input(message: impl Into<String>) -> Self {
        Self::Input(message.into())
    }
    pub fn host(message: impl Into<String>) -> Self {
        Self::Host(message.into())
    }
}
