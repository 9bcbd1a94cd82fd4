//! The job's start and end on a node (Slurm's Prolog and Epilog, run by slurmd as root with the
//! job in Slurm's environment: SLURM_JOB_ID, SLURM_JOB_UID, SPANK_BERTH_IMAGE, ...), and the
//! housekeeping both do.
//!
//! A failing Prolog or Epilog drains the node (Slurm 22.05), so they fail only for the node's
//! problems. A user's problem fails the job instead: a stage-in that fails is recorded next to
//! the scratch, and the SPANK plugin fails every step of the job with that line; a stage-out
//! that fails keeps the scratch in the retention area and tells the user in the job's error
//! file. Lines meant for Slurm's logs go to `say` (the binary writes them to stderr and syslog).

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use berth_runtime::{self as runtime, state};

use crate::SlurmError;
use crate::config::Config;
use crate::container::{Held, options};
use berth_image::lazy::server::Attached;

/// Where a Prolog's or Epilog's lines for Slurm go.
pub type Say<'a> = &'a dyn Fn(&str);

/// How the Epilog ended when it did its work: the node is fit, or not, with the one-line reason
/// Slurm shows as the drain reason.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    Fit,
    Unfit(String),
}

/// The job this Prolog/Epilog runs for.
fn job_id() -> Result<String, SlurmError> {
    match std::env::var("SLURM_JOB_ID") {
        Ok(id) if !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit()) => Ok(id),
        _ => Err(SlurmError::input(
            "SLURM_JOB_ID is not set: berth prolog/epilog run from Slurm's Prolog/Epilog",
        )),
    }
}

/// The Prolog: the job's scratch (and its stage-in), housekeeping, the job's image fetched
/// ahead of its first step, the kernel log's mark for the Epilog's health checks.
pub fn prolog(config: &Config, say: Say<'_>) -> Result<(), SlurmError> {
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
        let dir = berth_stage::scratch::create(
            &config.scratch.root,
            &job,
            uid,
            gid,
            config.scratch.cap_bytes,
        )
        .map_err(|e| SlurmError::host(format!("job {job}: scratch: {e}")))?;
        tracing::info!("job {job}: scratch {}", dir.display());
        if let Some(text) = spank_env("SPANK_BERTH_STAGE_IN") {
            // Steps start only after the Prolog: the data is there before the first one.
            let user = berth_sys::user::by_id(uid, gid);
            let result = berth_stage::job::parse_in(&text).and_then(|requests| {
                berth_stage::job::stage_in(
                    &user,
                    &dir,
                    &requests,
                    &config.stage.options(),
                    config.scratch.cap_bytes,
                )
            });
            match result {
                Ok(reports) => {
                    for r in reports {
                        tracing::info!("job {job}: {}", r.summary());
                    }
                }
                Err(e) => {
                    let line = format!("berth: job {job}: {e}");
                    say(&line);
                    berth_stage::scratch::record_failure(&config.scratch.root, &job, &line)
                        .map_err(|e| SlurmError::host(format!("job {job}: {e}")))?;
                }
            }
        }
    }
    housekeeping(config, Some(&job), say);
    if let Ok(image) = std::env::var("SPANK_BERTH_IMAGE")
        && !image.is_empty()
    {
        // Fetching early saves the first step the wait. A failure here must not drain the
        // node: the step tries again and reports it to the user. The import has the Prolog's
        // own deadline (registry.prolog_import_deadline_s), below Slurm's PrologEpilogTimeout:
        // a registry that trickles must not keep the Prolog until slurmd kills it and drains
        // the node.
        let mut in_prolog = config.clone();
        in_prolog.registry.in_prolog = true;
        match ids {
            Some((uid, gid)) => {
                let user = berth_sys::user::by_id(uid, gid);
                let image = crate::lazy::site_form(&image, &in_prolog, &user).unwrap_or(image);
                match crate::container::resolve(&image, &in_prolog, &user, None) {
                    Ok(resolved) => {
                        tracing::info!(
                            "job {job}: image {image} ready ({})",
                            resolved.digest.as_deref().unwrap_or("a directory")
                        );
                        if let Some(Held::LazyShared(attached)) = &resolved.in_use {
                            prefetch(&job, &image, attached, config);
                        }
                    }
                    Err(e) => say(&format!("berth: job {job}: preparing image {image}: {}", e)),
                }
            }
            None => say(&format!(
                "berth: job {job}: SLURM_JOB_UID/SLURM_JOB_GID missing; image {image} not prepared"
            )),
        }
    }
    health_mark(&job, config, say);
    Ok(())
}

/// Reads, through the node's server of the lazy image `attached`, what the job's first step
/// starts (berth_image::lazy::prefetch), so that its chunks are on the node before the step;
/// says what it read and how many of the image's chunks the node now holds. The job's command
/// is not known to the Prolog: the image's Entrypoint and Cmd (else the shell) stand for it.
fn prefetch(job: &str, image: &str, attached: &Attached, config: &Config) {
    use berth_image::lazy::prefetch;
    let command = prefetch::program(&attached.config);
    let path = prefetch::path_of(&attached.config);
    match prefetch::prefetch(
        &attached.root,
        &command,
        path.as_deref(),
        prefetch::BYTES_LIMIT,
    ) {
        Ok(done) => {
            let held = prefetch::cached_chunks(&config.store.root, &attached.index_hex)
                .map(|(have, all)| format!("; the node holds {have} of its {all} chunks"))
                .unwrap_or_default();
            tracing::info!(
                "job {job}: image {image}: prefetched {} of {} file(s) its command {} \
                 starts with ({}){}{held}",
                berth_image::store::human_size(done.bytes),
                done.files.len(),
                command.join(" "),
                done.files.join(", "),
                if done.bounded { ", bounded" } else { "" }
            );
        }
        Err(e) => tracing::warn!("job {job}: image {image}: prefetching: {e}"),
    }
}

/// The Epilog: the job's containers removed, its stage-out, its scratch kept or removed,
/// housekeeping, and the node's health after it.
pub fn epilog(config: &Config, say: Say<'_>) -> Result<Verdict, SlurmError> {
    let job = job_id()?;
    let opts = options(config, None);
    let mut failures = Vec::new();
    // Slurm names the node in the Epilog's environment: where several slurmd share a host and
    // a state directory, each Epilog removes its own node's containers.
    let node = berth_proto::step::node_from_env(&|k| std::env::var(k).ok());
    for record in state::list(&config.runtime.state_dir) {
        let l = &record.labels;
        let of_job = l.get("job") == Some(&job) && crate::step::on_node(l, node.as_deref());
        let global = l.get("scope").map(String::as_str) == Some("global");
        if of_job
            && !global
            && let Err(e) = runtime::remove(&opts, &record.id)
            // Gone meanwhile (another Epilog sharing the state directory, as the slurmd of a
            // multiple-slurmd host do, removed it first): done, not a failure.
            && state::load(&opts.state_dir, &record.id).is_some()
        {
            failures.push(match e {
                runtime::RuntimeError::Setup(s) => s.message,
                other => other.to_string(),
            });
        }
    }
    let reclaimed = state::reclaim(&opts.state_dir, opts.kill_timeout);
    if !reclaimed.is_empty() {
        tracing::info!(
            "job {job}: reclaimed {} leftover container(s)",
            reclaimed.len()
        );
    }
    berth_image::mount::release_unused(&config.image());
    for line in berth_image::lazy::server::stop_unused(
        &config.image(),
        &crate::container::lazy_node(config),
    ) {
        tracing::info!("job {job}: {line}");
    }
    let root = &config.scratch.root;
    let mut keep_scratch = false;
    let stage_in_failed = berth_stage::scratch::failure(root, &job).is_some();
    let env_id = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u32>().ok());
    if let (Some(text), Some(uid), Some(gid), false) = (
        spank_env("SPANK_BERTH_STAGE_OUT"),
        env_id("SLURM_JOB_UID"),
        env_id("SLURM_JOB_GID"),
        stage_in_failed,
    ) && let Ok(dir) = berth_stage::scratch::path(root, &job)
        && std::fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir())
    {
        let user = berth_sys::user::by_id(uid, gid);
        let result = berth_stage::job::parse_out(&text).and_then(|requests| {
            berth_stage::job::stage_out(&user, &dir, &requests, &config.stage.options())
        });
        match result {
            Ok(reports) => {
                for r in reports {
                    tracing::info!("job {job}: {}", r.summary());
                }
            }
            Err(e) => match retain(config, &job, &user, &e.to_string(), say) {
                Ok(()) => keep_scratch = true,
                Err(line) => {
                    // Results are never deleted silently: the scratch stays where it is.
                    keep_scratch = true;
                    failures.push(line.to_string());
                }
            },
        }
    }
    if let Err(e) = berth_stage::scratch::clear_failure(root, &job) {
        failures.push(e.to_string());
    }
    if !keep_scratch && let Err(e) = berth_stage::scratch::remove(root, &job) {
        failures.push(format!("scratch: {e}"));
    }
    housekeeping(config, Some(&job), say);
    if let Some(first) = failures.first() {
        // Slurm shows this line as the node's drain reason.
        return Err(SlurmError::host(format!(
            "job {job}: {} cleanup step(s) failed: {first}",
            failures.len()
        )));
    }
    epilog_health(config)
}

/// `topology.epilog_health`: the node's health after the job; unfit, the Epilog fails with the
/// checks' one-line reason, which Slurm shows as the drain reason.
fn epilog_health(config: &Config) -> Result<Verdict, SlurmError> {
    if !config.topology.epilog_health {
        return Ok(Verdict::Fit);
    }
    Ok(match crate::health::epilog_verdict(config)? {
        None => Verdict::Fit,
        Some(reason) => Verdict::Unfit(reason),
    })
}

/// Notes where the kernel log stands, so that the Epilog's health checks judge only the XIDs
/// of this job. Without the mark they skip XIDs; that is no reason to fail the Prolog.
fn health_mark(job: &str, config: &Config, say: Say<'_>) {
    if config.topology.epilog_health
        && let Err(e) = crate::health::mark_job_start(config)
    {
        say(&format!(
            "berth: job {job}: kernel log mark for the Epilog's health checks: {e}"
        ));
    }
}

/// A value the SPANK plugin passed with `spank_job_control_setenv`; empty counts as unset.
fn spank_env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// After a failed stage-out (`why`): moves the job's scratch into the retention area and tells
/// the user where, in the job's error file. Err: the line for the node's drain reason, when the
/// scratch could not be moved (it is then left in place).
fn retain(
    config: &Config,
    job: &str,
    user: &berth_spec::UserIds,
    why: &str,
    say: Say<'_>,
) -> Result<(), SlurmError> {
    let scratch = &config.scratch;
    let area = scratch.retention_dir();
    let kept = berth_stage::retain::retain(&scratch.root, job, &area, now()).map_err(|e| {
        // Out of the way of reclaim (which takes only job ids), on the scratch's filesystem.
        let left = berth_stage::scratch::set_aside(&scratch.root, job, now())
            .unwrap_or_else(|_| scratch.root.join(job));
        SlurmError::host(format!(
            "job {job}: {why}; keeping its scratch failed: {e}; it is left in {}",
            left.display()
        ))
    })?;
    let line = format!(
        "berth: job {job}: {why}; your results are kept in {} for {} days: copy them from there",
        kept.display(),
        scratch.retention_days
    );
    say(&line);
    match job_stderr(job) {
        Some(file) => {
            if let Err(e) = append_as(user, &file, &line) {
                say(&format!(
                    "berth: job {job}: cannot tell the user in {}: {e}",
                    file.display()
                ));
            }
        }
        None => say(&format!(
            "berth: job {job}: no error file to tell the user in (not a batch job)"
        )),
    }
    Ok(())
}

/// The job's error file (`StdErr=` of `scontrol show job`), which a batch job has.
fn job_stderr(job: &str) -> Option<PathBuf> {
    let out = std::process::Command::new("scontrol")
        .args(["show", "job", "-o", job])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let value = text
        .split(' ')
        .find_map(|field| field.strip_prefix("StdErr="))?
        .trim();
    value.starts_with('/').then(|| PathBuf::from(value))
}

/// Appends `line` to `file` as `user` (without root's groups), so a path the user chose can
/// never make root write elsewhere.
fn append_as(user: &berth_spec::UserIds, file: &Path, line: &str) -> Result<(), SlurmError> {
    use std::io::Write;
    use std::os::unix::process::CommandExt;
    let mut child = std::process::Command::new("tee")
        .arg("-a")
        .arg(file)
        .uid(user.uid)
        .gid(user.gid)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| SlurmError::host(format!("tee: {e}")))?;
    if let Some(mut stdin) = child.stdin.take() {
        let _ = writeln!(stdin, "{line}");
    }
    let out = child
        .wait_with_output()
        .map_err(|e| SlurmError::host(format!("tee: {e}")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(SlurmError::host(
            String::from_utf8_lossy(&out.stderr).trim(),
        ))
    }
}

/// The job ids slurmctld knows that are not finished (pending, running, completing, ...):
/// their scratch is in use. `None` when Slurm cannot be asked, so nothing is reclaimed.
fn live_jobs() -> Option<Vec<String>> {
    let out = std::process::Command::new("squeue")
        .args(["-h", "-a", "-t", "all", "-o", "%A %T"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    const FINISHED: [&str; 9] = [
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
    ];
    Some(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_once(' '))
            .filter(|(_, state)| !FINISHED.contains(&state.trim()))
            .map(|(id, _)| id.to_string())
            .collect(),
    )
}

/// Reclaims the scratch of jobs that ended without an Epilog and removes expired retained
/// scratch. Never fails: what cannot be done now is done by the next Prolog, Epilog or gc.
/// `current`: the job this runs for, live whatever Slurm says.
pub fn housekeeping(config: &Config, current: Option<&str>, say: Say<'_>) -> Vec<String> {
    let mut done = Vec::new();
    let root = &config.scratch.root;
    // Slurm is asked only when another job's scratch is there; when it cannot answer, every
    // scratch counts as live (never delete the scratch of a running job).
    let live = std::cell::OnceCell::new();
    let is_live = |id: &str| {
        current == Some(id)
            || live
                .get_or_init(live_jobs)
                .as_ref()
                .is_none_or(|l: &Vec<String>| l.iter().any(|j| j == id))
    };
    match berth_stage::scratch::reclaim(root, is_live) {
        Ok(ids) => done.extend(
            ids.into_iter()
                .map(|id| format!("reclaimed the scratch of ended job {id}")),
        ),
        Err(e) => say(&format!("berth: {e}")),
    }
    if let Some(None) = live.get() {
        tracing::info!("squeue failed: the scratch of ended jobs is not reclaimed now");
    }
    let area = config.scratch.retention_dir();
    match berth_stage::retain::expire(&area, config.scratch.retention_days, now()) {
        Ok(paths) => done.extend(
            paths
                .into_iter()
                .map(|p| format!("expired {}", p.display())),
        ),
        Err(e) => say(&format!("berth: {e}")),
    }
    for line in &done {
        tracing::info!("{line}");
    }
    done
}
