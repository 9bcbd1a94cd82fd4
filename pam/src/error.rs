//! The module's one error type. Each message is one line for the system log (the user sees only
//! the access-denied line): what failed, on what, what to do.

use std::path::PathBuf;

/// What went wrong while deciding on or adopting a login.
#[derive(Debug, thiserror::Error)]
pub enum PamError {
    #[error("pam_berth: module argument '{arg}': {hint}")]
    Option { arg: String, hint: &'static str },
    #[error("pam_berth: running {program} failed ({source}): check the module's squeue= argument")]
    Spawn {
        program: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "pam_berth: {program} did not answer within {ms} ms: is slurmctld up? (timeout_ms= sets the limit)"
    )]
    Timeout { program: PathBuf, ms: u64 },
    #[error("pam_berth: {program} failed ({status}): {stderr}")]
    Query {
        program: PathBuf,
        status: String,
        stderr: String,
    },
    #[error("pam_berth: {program} printed a line berth cannot read: '{line}'")]
    Parse { program: PathBuf, line: String },
    #[error(
        "pam_berth: job {job} has no extern step cgroup on this node (looked for {looked}): set PrologFlags=Contain in slurm.conf"
    )]
    NoExternStep { job: u64, looked: String },
    #[error("pam_berth: joining {path} failed ({source}): check the job's cgroup")]
    Join {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "pam_berth: {path} is not root's alone: refusing to adopt into a cgroup a user could have made"
    )]
    Forged { path: PathBuf },
}
