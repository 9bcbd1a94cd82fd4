//! `berth step create|destroy`: the container of a Slurm job step, asked for by the SPANK plugin
//! in slurmstepd. The request comes as JSON on stdin; the answer is one JSON object on stdout.

use std::io::Read;

use clap::{Args, Subcommand};

use super::Failure;
use crate::config::Config;
use crate::slurm::{SlurmError, step};

/// Containers of Slurm job steps (called by the SPANK plugin)
#[derive(Debug, Args)]
pub struct StepArgs {
    #[command(subcommand)]
    pub command: StepCommand,
}

#[derive(Debug, Subcommand)]
pub enum StepCommand {
    /// Create (or find, for a named container) a step's container; reads the request as JSON on
    /// stdin, prints {id, pid, namespaces, env, cwd[, bind]} as JSON
    Create,
    /// Remove a step's unnamed container (idempotent)
    Destroy(DestroyArgs),
}

#[derive(Debug, Args)]
pub struct DestroyArgs {
    #[arg(long)]
    pub job_id: u64,
    #[arg(long)]
    pub step_id: u64,
    /// The Slurm node the step ran on (its `node` in the create request): only that node's
    /// container is removed where several slurmd share a host and a state directory. Sent by
    /// plugins of protocol 2 and later to a berth that answered with protocol 2 or later.
    #[arg(long)]
    pub node: Option<String>,
}

pub fn execute(args: &StepArgs, config: &Config) -> Result<i32, Failure> {
    match &args.command {
        StepCommand::Create => {
            let mut text = String::new();
            std::io::stdin()
                .read_to_string(&mut text)
                .map_err(|e| Failure::system(format!("reading the step request on stdin: {e}")))?;
            let parsed = step::parse(&text)?;
            crate::log::set_job(
                &parsed.request.job_id.to_string(),
                Some(parsed.request.step_id),
            );
            let answer = step::create(config, parsed).inspect_err(|e| {
                if matches!(e, SlurmError::ImageUnavailable(_)) {
                    // For the plugin's Pyxis-shaped messages (pyxis_messages=1); the error line
                    // follows.
                    eprintln!("{IMPORT_FAILED_MARKER}");
                }
            })?;
            let text = serde_json::to_string(&answer)
                .map_err(|e| Failure::system(format!("writing the answer: {e}")))?;
            outln!("{text}");
            Ok(0)
        }
        StepCommand::Destroy(d) => {
            step::destroy(config, d.job_id, d.step_id, d.node.as_deref())?;
            Ok(0)
        }
    }
}

/// The line `berth step create` prints on stderr before its error when the image could not be
/// imported: the SPANK plugin then prints Pyxis's "failed to import docker image" line.
pub use berth_proto::answer::IMPORT_FAILED_MARKER;
