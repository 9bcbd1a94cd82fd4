//! `berth prolog` and `berth epilog`: the job's start and end on a node, run by slurmd as root
//! with the job in Slurm's environment (SLURM_JOB_ID, SLURM_JOB_UID, SPANK_BERTH_IMAGE, ...).

use clap::Args;

use super::Failure;
use super::run::{options, runtime_failure};
use crate::config::Config;
use crate::runtime::{self, state};

/// Prepare the node for a job (Slurm Prolog): fetch the job's image ahead of its first step
#[derive(Debug, Args)]
pub struct PrologArgs {}

/// Clean up after a job (Slurm Epilog): remove its containers and leftovers; exit non-zero with a
/// drain reason when the node is left unhealthy
#[derive(Debug, Args)]
pub struct EpilogArgs {}

/// The job this Prolog/Epilog runs for.
fn job_id() -> Result<String, Failure> {
    match std::env::var("SLURM_JOB_ID") {
        Ok(id) if !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit()) => Ok(id),
        _ => Err(Failure::input(
            "SLURM_JOB_ID is not set: berth prolog/epilog run from Slurm's Prolog/Epilog",
        )),
    }
}

pub fn prolog(_args: &PrologArgs, config: &Config) -> Result<i32, Failure> {
    let job = job_id()?;
    let reclaimed = state::reclaim(
        &config.runtime.state_dir,
        std::time::Duration::from_secs(config.runtime.kill_timeout_s),
    );
    if !reclaimed.is_empty() {
        tracing::info!(
            "job {job}: reclaimed {} leftover container(s)",
            reclaimed.len()
        );
    }
    let env_id = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u32>().ok());
    let ids = env_id("SLURM_JOB_UID").zip(env_id("SLURM_JOB_GID"));
    // The job's node-local scratch: made here, as the job's user, removed by the Epilog. A
    // scratch root that cannot be used is the node's problem, so it fails the Prolog.
    if let Some((uid, gid)) = ids {
        let dir = crate::stage::scratch::create(
            &config.scratch.root,
            &job,
            uid,
            gid,
            config.scratch.cap_bytes,
        )
        .map_err(|e| Failure::system(format!("job {job}: scratch: {e}")))?;
        tracing::info!("job {job}: scratch {}", dir.display());
    }
    if let Ok(image) = std::env::var("SPANK_BERTH_IMAGE")
        && !image.is_empty()
    {
        // Fetching early saves the first step the wait. A failure here must not drain the
        // node: the step tries again and reports it to the user.
        match ids {
            Some((uid, gid)) => {
                let user = crate::spec::user::by_id(uid, gid);
                match super::image::resolve(&image, config, &user, None) {
                    Ok(resolved) => tracing::info!(
                        "job {job}: image {image} ready ({})",
                        resolved.digest.as_deref().unwrap_or("a directory")
                    ),
                    Err(e) => eprintln!("berth: job {job}: preparing image {image}: {}", e.message),
                }
            }
            None => eprintln!(
                "berth: job {job}: SLURM_JOB_UID/SLURM_JOB_GID missing; image {image} not prepared"
            ),
        }
    }
    health_mark(&job, config);
    Ok(0)
}

pub fn epilog(_args: &EpilogArgs, config: &Config) -> Result<i32, Failure> {
    let job = job_id()?;
    let opts = options(config, None);
    let mut failures = Vec::new();
    for record in state::list(&config.runtime.state_dir) {
        let l = &record.labels;
        let of_job = l.get("job") == Some(&job);
        let global = l.get("scope").map(String::as_str) == Some("global");
        if of_job
            && !global
            && let Err(e) = runtime::remove(&opts, &record.id)
        {
            failures.push(runtime_failure(e).message);
        }
    }
    let reclaimed = state::reclaim(&opts.state_dir, opts.kill_timeout);
    if !reclaimed.is_empty() {
        tracing::info!(
            "job {job}: reclaimed {} leftover container(s)",
            reclaimed.len()
        );
    }
    if let Err(e) = crate::stage::scratch::remove(&config.scratch.root, &job) {
        failures.push(format!("scratch: {e}"));
    }
    if let Some(first) = failures.first() {
        // Slurm shows this line as the node's drain reason.
        return Err(Failure::system(format!(
            "job {job}: {} cleanup step(s) failed: {first}",
            failures.len()
        )));
    }
    epilog_health(config)
}

/// `topology.epilog_health`: the node's health after the job; unfit, the Epilog fails with the
/// checks' one-line reason, which Slurm shows as the drain reason.
fn epilog_health(config: &Config) -> Result<i32, Failure> {
    if !config.topology.epilog_health {
        return Ok(0);
    }
    match super::health::epilog_verdict(config)? {
        None => Ok(0),
        Some(reason) => Err(Failure {
            code: 1,
            message: reason,
        }),
    }
}

/// Notes where the kernel log stands, so that the Epilog's health checks judge only the XIDs
/// of this job. Without the mark they skip XIDs; that is no reason to fail the Prolog.
fn health_mark(job: &str, config: &Config) {
    if config.topology.epilog_health
        && let Err(e) = super::health::mark_job_start(config)
    {
        eprintln!(
            "berth: job {job}: kernel log mark for the Epilog's health checks: {}",
            e.message
        );
    }
}
