//! The plugin's one error type: a value the user gave that berth cannot use, or a task that
//! could not join its container. Each message is the one line the user sees.

use std::io;
use std::path::PathBuf;

use crate::options::Source;

/// What went wrong; the message is the one line the user sees.
#[derive(Debug, thiserror::Error)]
pub enum SpankError {
    // ---- A value a user gave (`options`).
    #[error("--{flag}{origin}: an argument is required")]
    Empty { flag: &'static str, origin: Source },
    #[error("--{flag} given twice with different values ('{first}' and '{second}'): give it once")]
    Conflict {
        flag: &'static str,
        first: String,
        second: String,
    },
    #[error("--{yes} and --{no} both given: give one of them")]
    BothWays { yes: &'static str, no: &'static str },
    #[error("--{flag}{origin}: invalid value '{value}': {hint}")]
    Invalid {
        flag: &'static str,
        origin: Source,
        value: String,
        hint: std::borrow::Cow<'static, str>,
    },
    #[error("${var}: '{value}' is not a boolean: use 1 or 0 (also true/false, yes/no, on/off)")]
    NotBool { var: String, value: String },

    #[error(
        "the batch script path '{0}' cannot be mounted into the container: SlurmdSpoolDir must \
         be an absolute path without ':' or ','"
    )]
    BatchScript(String),

    // ---- The plugin's arguments in plugstack.conf and berth's configuration file, as far as
    // the plugin reads it (`config`).
    /// A plugstack.conf argument berth cannot use: it names it and says what is expected.
    #[error("plugstack.conf argument '{arg}': {hint}")]
    PlugstackArg { arg: String, hint: &'static str },
    #[error("cannot read {}: {}: check config= in plugstack.conf", path.display(), crate::io_text(.source))]
    ConfigRead { path: PathBuf, source: io::Error },
    #[error("{}: {source}", path.display())]
    ConfigFile {
        path: PathBuf,
        source: Box<SpankError>,
    },
    /// berth.toml is not TOML; the parser's message.
    #[error("{0}")]
    ConfigSyntax(String),
    #[error("[scratch] root is not an absolute path")]
    ScratchRoot,

    // ---- The protocol with `berth step create` (`request`).
    #[error("the plugin's options do not fit the protocol: {0}")]
    Protocol(#[from] berth_proto::ProtoError),
    #[error("berth step create reported namespace '{0}', which a task cannot join")]
    Namespace(String),

    // ---- The SPANK API (`ffi`) and the step's container (`plugin`).
    /// A SPANK call Slurm refused: Slurm's text for its error code.
    // (ffi and plugin, which make these two, are not built for unit tests.)
    #[cfg_attr(test, allow(dead_code))]
    #[error("{0}")]
    Slurm(String),
    /// What the plugin tells the user about a step, worded where it happened: `berth: …`, or
    /// the line `berth step create` printed.
    #[cfg_attr(test, allow(dead_code))]
    #[error("{0}")]
    Step(String),

    // ---- Joining the container (`join`).
    #[error(
        "cannot join the container: the task lost CAP_SYS_ADMIN before slurm_spank_task_init \
         (this Slurm version drops capabilities earlier than berth expects): report it with the \
         Slurm version"
    )]
    NoCapability,
    #[error("cannot join the container's {ns} namespace: {}", crate::io_text(.source))]
    Setns { ns: &'static str, source: io::Error },
    #[error("cannot change the task's capabilities: {}", crate::io_text(.0))]
    Caps(io::Error),
    #[error(
        "cannot install the remap-root seccomp filter (chown and setuid calls that report \
         success): {}", crate::io_text(.0)
    )]
    Seccomp(io::Error),
}
