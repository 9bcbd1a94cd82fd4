//! `berth prolog` and `berth epilog`: Slurm's Prolog and Epilog (`berth_slurm::job`).

use clap::Args;

use super::Failure;
use crate::config::Config;
// Every line the Prolog/Epilog print for Slurm also goes to syslog (`[log] target`).
use crate::log::eprintln;
use crate::slurm::job::{self, Verdict};

/// Prepare the node for a job (Slurm Prolog): fetch the job's image ahead of its first step
#[derive(Debug, Args)]
pub struct PrologArgs {}

/// Clean up after a job (Slurm Epilog): remove its containers and leftovers; exit non-zero with a
/// drain reason when the node is left unhealthy
#[derive(Debug, Args)]
pub struct EpilogArgs {}

fn say(line: &str) {
    eprintln!("{line}");
}

pub fn prolog(_args: &PrologArgs, config: &Config) -> Result<i32, Failure> {
    job::prolog(config, &say)?;
    Ok(0)
}

pub fn epilog(_args: &EpilogArgs, config: &Config) -> Result<i32, Failure> {
    match job::epilog(config, &say)? {
        Verdict::Fit => Ok(0),
        // Slurm shows the line as the node's drain reason.
        Verdict::Unfit(reason) => Err(Failure {
            code: 1,
            message: reason,
        }),
    }
}

/// Scratch reclaim and retention expiry, for `berth gc`.
pub fn housekeeping(config: &Config) -> Vec<String> {
    job::housekeeping(config, None, &say)
}
