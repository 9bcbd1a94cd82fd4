//! The lowest layer of berth: privileged file work on paths users influence ([`privfs`]), the
//! identity a command runs as ([`UserIds`]) and its lookup in the host's user database
//! ([`user`]), deadlines from user-chosen durations ([`time`]) and how errors quote user input
//! ([`text`]), user namespaces with chosen mappings ([`userns`]) and the small helpers of the new
//! mount API both the image and the runtime use ([`mount`]). Every other berth crate may use it;
//! it uses none.

pub mod mount;
pub mod privfs;
pub mod seccomp;
pub mod text;
pub mod time;
pub mod user;
pub mod userns;

use std::path::PathBuf;

/// What the lowest layer can fail at: a path berth relies on that is not safe, I/O on one, a user
/// namespace that cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum SysError {
    #[error("{path}: {what}; {hint}")]
    Unsafe {
        path: PathBuf,
        what: String,
        hint: &'static str,
    },
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "creating a user namespace: unshare(CLONE_NEWUSER) failed (user namespaces disabled? see user.max_user_namespaces)"
    )]
    Unshare,
    #[error("{what}: {detail}")]
    Userns { what: &'static str, detail: String },
    #[error(
        "unknown user '{}': no such user on this host (use a name or uid from the host's passwd database)",
        text::elide(.0)
    )]
    UnknownUser(String),
    #[error("unknown group '{}': no such group on this host", text::elide(.0))]
    UnknownGroup(String),
}

/// The identity a container's command runs as.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UserIds {
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (may include `gid`).
    pub groups: Vec<u32>,
    pub home: Option<PathBuf>,
    /// The host's names for the user and its primary group, written into the container's
    /// /etc/passwd and /etc/group when the image lacks them.
    pub name: Option<String>,
    pub group_name: Option<String>,
}
