//! The controller's error type for its library-like modules (the server's reconcile loop, the
//! slurmctld watch): a Slurm tool (sinfo, scontrol, squeue) that could not be run or failed, one
//! line each naming the tool. `main` reports the rest through anyhow.

use std::path::PathBuf;
use std::process::ExitStatus;

/// A Slurm tool that did not give its answer.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error("{} did not finish in {secs} s", path.display())]
    Timeout { path: PathBuf, secs: u64 },
    #[error("{} {}: no answer within {secs} s", path.display(), args.join(" "))]
    NoAnswer {
        path: PathBuf,
        args: Vec<String>,
        secs: u64,
    },
    #[error("running {}: {source}", path.display())]
    Spawn {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} {}: {status}: {stderr}", path.display(), args.join(" "))]
    Failed {
        path: PathBuf,
        args: Vec<String>,
        status: ExitStatus,
        stderr: String,
    },
    /// A tool's failure as the watch words it (the tool, its arguments and what it said).
    #[error("{0}")]
    Tool(String),
    /// slurm.conf could not be read, said with its path and the setting that names it.
    #[error("{0}")]
    Conf(String),
}
