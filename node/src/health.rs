//! The node's health as the Prolog, Epilog, agent and `berth health` judge it: the checks of
//! `berth_topology::health` on the node as read, with the XIDs of a window of the kernel log
//! (since the job's start, for the Epilog).

use std::path::Path;

use berth_runtime::state;
use berth_topology::health::{self, Options, Report};
use berth_topology::{TopologyError, kmsg};

use crate::NodeError;
use crate::source::{Source, discover};
use berth_config::Config;

/// Which XIDs to judge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XidWindow {
    None,
    All,
    After(u64),
    /// Since the job's --job-start mark.
    Job,
}

/// The Prolog's marks, one per job, in a private subdirectory of the state directory (root's,
/// 0700, checked like the state directory itself: no other user reads or plants them).
const MARKS: &str = "health";

fn mark_name(job: &str) -> String {
    format!("job-{job}.kmsg-seq")
}

fn marks_dir(config: &Config) -> Result<std::os::fd::OwnedFd, NodeError> {
    state::private_dir(&config.runtime.state_dir, MARKS).map_err(|e| {
        NodeError::host(format!(
            "berth health: the state directory for job marks: {e}"
        ))
    })
}

fn job_id() -> Result<String, NodeError> {
    match std::env::var("SLURM_JOB_ID") {
        Ok(id) if !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit()) => Ok(id),
        _ => Err(NodeError::input(
            "--job-start/--job-end need SLURM_JOB_ID: run them from Slurm's Prolog/Epilog",
        )),
    }
}

/// Remembers where the kernel log stands for `job` (the last record's sequence number).
fn write_mark(
    config: &Config,
    job: &str,
    records: Option<&[kmsg::Record]>,
) -> Result<(), NodeError> {
    let seq = records.and_then(kmsg::last_seq).unwrap_or(0);
    let dir = marks_dir(config)?;
    let name = mark_name(job);
    state::write_at(&dir, &name, format!("{seq}\n").as_bytes(), 0o600).map_err(|e| {
        NodeError::host(format!(
            "writing {}: {e}",
            config.runtime.state_dir.join(MARKS).join(&name).display()
        ))
    })
}

pub fn mark_job_start(config: &Config) -> Result<(), NodeError> {
    let job = job_id()?;
    let host = crate::source::host(&Source::default(), config);
    let records = kmsg::read(&host.path("/dev/kmsg")).ok();
    write_mark(config, &job, records.as_deref())
}

/// (Epilog) Whether the node is fit after the job of SLURM_JOB_ID: `Some(reason)`, one line
/// for Slurm's drain reason, when it is not. XIDs count from the Prolog's mark.
pub fn epilog_verdict(config: &Config) -> Result<Option<String>, NodeError> {
    let report = report(
        config,
        &Source::default(),
        None,
        None,
        XidWindow::Job,
        false,
    )?;
    Ok(if report.healthy {
        None
    } else {
        Some(
            report
                .reason
                .unwrap_or_else(|| "unhealthy (berth health --json says why)".into()),
        )
    })
}

/// Runs the checks; with `job_start`, also records the kernel log's position for the job.
pub fn report(
    config: &Config,
    source: &Source,
    expect_gpus: Option<u32>,
    kmsg_path: Option<&Path>,
    window: XidWindow,
    job_start: bool,
) -> Result<Report, NodeError> {
    let (host, node) = discover(source, config)?;
    let kmsg_path = kmsg_path
        .map(Path::to_path_buf)
        .unwrap_or_else(|| host.path("/dev/kmsg"));
    let records = kmsg::read(&kmsg_path);
    let job = if job_start || window == XidWindow::Job {
        Some(job_id()?)
    } else {
        None
    };
    if job_start {
        let job = job.as_deref().expect("set above");
        write_mark(config, job, records.as_deref().ok())?;
    }
    let after = match window {
        XidWindow::None => None,
        XidWindow::All => Some(None),
        XidWindow::After(s) => Some(Some(s)),
        XidWindow::Job => {
            let dir = marks_dir(config)?;
            let name = mark_name(job.as_deref().expect("set above"));
            let seq = state::read_at(&dir, std::ffi::OsStr::new(&name), 64)
                .ok()
                .and_then(|(b, _)| String::from_utf8(b).ok())
                .and_then(|t| t.trim().parse::<u64>().ok());
            let _ = state::remove_at(&dir, &name);
            // Without a mark (no --job-start ran) there is no window to judge.
            seq.map(Some)
        }
    };
    let no_window = TopologyError::Value(
        "no window: use --job-start/--job-end, --xid-after or --all-xids".into(),
    );
    let xids = match (&records, after) {
        (_, None) => Err(&no_window),
        (Ok(r), Some(after)) => Ok(kmsg::xids(r, after)),
        (Err(e), Some(_)) => Err(e),
    };
    let opts = Options {
        expected_gpus: expect_gpus.or(config.topology.expected_gpus),
        xid_drain: config.topology.xid_drain.clone(),
        ignore_ports: config.topology.ignore_ports.clone(),
        check_gpu_link_speed: config.topology.check_gpu_link_speed,
    };
    Ok(health::check(&node, xids.as_deref().map_err(|e| *e), &opts))
}
