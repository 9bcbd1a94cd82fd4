//! berth's exit statuses, decided in one place from the kind of each library error: 2 for bad
//! input (as a usage error), 1 for an image that could not be had, 125 for the host's failure,
//! and the container's own statuses (126, 127, the command's) passed through.

use berth_agent::AgentError;
use berth_image::{ErrorKind, ImageError};
use berth_runtime::RuntimeError;
use berth_slurm::SlurmError;
use berth_topology::TopologyError;

/// Bad input from the user: flags, paths, the plugin's request.
pub const INPUT: i32 = 2;
/// An image that could not be imported or found (as `enroot import` fails).
pub const IMAGE: i32 = 1;
/// The node could not do what was asked.
pub const HOST: i32 = 125;

/// A failure before or around the container, printed as one line `berth: …`.
#[derive(Debug)]
pub struct Failure {
    pub code: i32,
    pub message: String,
}

impl Failure {
    /// Bad input from the user (flags, paths): exit 2, like a usage error.
    pub fn input(message: impl Into<String>) -> Self {
        Self {
            code: INPUT,
            message: message.into(),
        }
    }
    /// The host could not do what was asked: exit 125.
    pub fn system(message: impl Into<String>) -> Self {
        Self {
            code: HOST,
            message: message.into(),
        }
    }
}

impl From<ImageError> for Failure {
    fn from(e: ImageError) -> Self {
        match e.kind() {
            ErrorKind::Reference => Failure::input(e.to_string()),
            _ => Failure {
                code: IMAGE,
                message: e.to_string(),
            },
        }
    }
}

impl From<RuntimeError> for Failure {
    fn from(e: RuntimeError) -> Self {
        match e {
            // Failed inside the container: its code says how (126 not executable, 127 not
            // found, 125 otherwise), as crun and docker run say it.
            RuntimeError::Setup(s) => Failure {
                code: s.code,
                message: s.message,
            },
            // What the user gave: a root filesystem, an image's entrypoint.
            RuntimeError::Rootfs { .. } | RuntimeError::Entrypoint(_) => {
                Failure::input(e.to_string())
            }
            other => Failure::system(other.to_string()),
        }
    }
}

impl From<TopologyError> for Failure {
    fn from(e: TopologyError) -> Self {
        match e {
            TopologyError::Job { .. } | TopologyError::Input(_) => Failure::input(e.to_string()),
            other => Failure::system(other.to_string()),
        }
    }
}

impl From<berth_node::NodeError> for Failure {
    fn from(e: berth_node::NodeError) -> Self {
        use berth_node::NodeError;
        match e {
            NodeError::Input(m) => Failure::input(m),
            NodeError::Host(m) => Failure::system(m),
            NodeError::Image(e) => e.into(),
            NodeError::Runtime(e) => e.into(),
            NodeError::Topology(e) => e.into(),
        }
    }
}

impl From<SlurmError> for Failure {
    fn from(e: SlurmError) -> Self {
        match e {
            SlurmError::Input(m) => Failure::input(m),
            SlurmError::Request(e) => Failure::input(e.to_string()),
            SlurmError::Host(m) => Failure::system(m),
            SlurmError::Node(e) => e.into(),
            SlurmError::Image(e) => e.into(),
            SlurmError::Runtime(e) => e.into(),
            SlurmError::Topology(e) => e.into(),
            SlurmError::ImageUnavailable(e) => (*e).into(),
        }
    }
}

/// The node's configuration is the admin's input, as a usage error is.
impl From<berth_config::ConfigError> for Failure {
    fn from(e: berth_config::ConfigError) -> Self {
        Failure::input(e.to_string())
    }
}

impl From<berth_stage::StageError> for Failure {
    fn from(e: berth_stage::StageError) -> Self {
        match e {
            berth_stage::StageError::Refused(m) => Failure::input(m),
            other => Failure::system(other.to_string()),
        }
    }
}

impl From<AgentError> for Failure {
    fn from(e: AgentError) -> Self {
        match e {
            AgentError::Input(m) => Failure::input(m),
            AgentError::Host(m) => Failure::system(m),
            e @ AgentError::Spawn { .. } => Failure::system(e.to_string()),
            AgentError::Image(e) => e.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_has_its_status() {
        assert_eq!(Failure::from(SlurmError::input("bad")).code, INPUT);
        assert_eq!(Failure::from(SlurmError::host("state dir")).code, HOST);
        let nested = SlurmError::ImageUnavailable(Box::new(SlurmError::input("unreadable")));
        assert_eq!(Failure::from(nested).code, INPUT);
        let setup = RuntimeError::Setup(berth_runtime::SetupError::with_code(127, "nope".into()));
        assert_eq!(Failure::from(SlurmError::Runtime(setup)).code, 127);
        let refused = berth_stage::StageError::Refused("another user's stage".into());
        assert_eq!(Failure::from(refused).code, INPUT);
        let io = berth_stage::StageError::Verify { path: "/x".into() };
        assert_eq!(Failure::from(io).code, HOST);
        let reference = ImageError::Reference("ubuntu:".into(), "empty tag after ':'".into());
        assert_eq!(Failure::from(reference).code, INPUT);
        let not_stored = crate::image::store::StoreError::NotStored("x".into());
        assert_eq!(Failure::from(ImageError::from(not_stored)).code, IMAGE);
        let unreachable = AgentError::Image(ImageError::Registry(
            crate::image::registry::RegistryError::Unreachable {
                image: "x".into(),
                registry: "r".into(),
                attempts: 1,
                detail: "refused".into(),
            },
        ));
        assert_eq!(Failure::from(unreachable).code, IMAGE);
        assert_eq!(Failure::from(AgentError::host("no controller")).code, HOST);
    }
}
