//! `berth health`: is this node fit to run jobs? Exit 0 when it is; exit 1 with one line saying
//! why not (fit for `scontrol update nodename=... state=drain reason="..."`) when it is not.

use std::path::{Path, PathBuf};

use clap::Args;

use super::Failure;
use super::topo::{Source, discover};
use crate::config::Config;
use crate::runtime::state;
use crate::topology::health::{self, Options, Report};
use crate::topology::kmsg;

/// Check GPUs, NICs and PCIe links; exit 1 with a one-line reason when the node should drain
///
/// Checks: GPU count (against --expect-gpus or topology.expected_gpus, and NVML against the PCI
/// bus), uncorrectable ECC errors, pending page retirement or row remapping, XIDs from the
/// kernel log (those in topology.xid_drain), RDMA ports not ACTIVE, and GPU/NIC PCIe links
/// below what both ends support. In a Prolog, --job-start notes where the kernel log stands;
/// in the Epilog, --job-end checks the XIDs logged since.
#[derive(Debug, Args)]
pub struct HealthArgs {
    #[command(flatten)]
    pub source: Source,

    /// Print the report as JSON
    #[arg(long)]
    pub json: bool,

    /// GPUs the node must have [default: topology.expected_gpus]
    #[arg(long, value_name = "N")]
    pub expect_gpus: Option<u32>,

    /// Kernel log to read XIDs from [default: /dev/kmsg under the host root]
    #[arg(long, value_name = "FILE")]
    pub kmsg: Option<PathBuf>,

    /// Check the XIDs logged after this kernel-log sequence number
    #[arg(long, value_name = "SEQ", conflicts_with_all = ["all_xids", "job_end"])]
    pub xid_after: Option<u64>,

    /// Check every XID still in the kernel log
    #[arg(long, conflicts_with = "job_end")]
    pub all_xids: bool,

    /// (Prolog) remember where the kernel log stands for SLURM_JOB_ID
    #[arg(long, conflicts_with = "job_end")]
    pub job_start: bool,

    /// (Epilog) check the XIDs logged since --job-start of SLURM_JOB_ID, then forget the mark
    #[arg(long)]
    pub job_end: bool,
}

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

fn marks_dir(config: &Config) -> Result<std::os::fd::OwnedFd, Failure> {
    state::private_dir(&config.runtime.state_dir, MARKS).map_err(|e| {
        Failure::system(format!(
            "berth health: the state directory for job marks: {e}"
        ))
    })
}

fn job_id() -> Result<String, Failure> {
    match std::env::var("SLURM_JOB_ID") {
        Ok(id) if !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit()) => Ok(id),
        _ => Err(Failure::input(
            "--job-start/--job-end need SLURM_JOB_ID: run them from Slurm's Prolog/Epilog",
        )),
    }
}

/// Remembers where the kernel log stands for `job` (the last record's sequence number).
fn write_mark(config: &Config, job: &str, records: Option<&[kmsg::Record]>) -> Result<(), Failure> {
    let seq = records.and_then(kmsg::last_seq).unwrap_or(0);
    let dir = marks_dir(config)?;
    let name = mark_name(job);
    state::write_at(&dir, &name, format!("{seq}\n").as_bytes(), 0o600).map_err(|e| {
        Failure::system(format!(
            "writing {}: {e}",
            config.runtime.state_dir.join(MARKS).join(&name).display()
        ))
    })
}

/// (Prolog) Notes where the kernel log stands for SLURM_JOB_ID, so that the Epilog judges
/// only the XIDs logged while the job ran; reads the log only, not the node.
pub fn mark_job_start(config: &Config) -> Result<(), Failure> {
    let job = job_id()?;
    let host = super::topo::host(&Source::default(), config);
    let records = kmsg::read(&host.path("/dev/kmsg")).ok();
    write_mark(config, &job, records.as_deref())
}

/// (Epilog) Whether the node is fit after the job of SLURM_JOB_ID: `Some(reason)`, one line
/// for Slurm's drain reason, when it is not. XIDs count from the Prolog's mark.
pub fn epilog_verdict(config: &Config) -> Result<Option<String>, Failure> {
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
) -> Result<Report, Failure> {
    let (host, node) = discover(source, config)?;
    let kmsg_path = kmsg_path
        .map(Path::to_path_buf)
        .unwrap_or_else(|| host.path("/dev/kmsg"));
    let records = kmsg::read(&kmsg_path).map_err(|e| e.to_string());
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
    let xids = match (&records, after) {
        (_, None) => Err("no window: use --job-start/--job-end, --xid-after or --all-xids".into()),
        (Ok(r), Some(after)) => Ok(kmsg::xids(r, after)),
        (Err(e), Some(_)) => Err(e.clone()),
    };
    let opts = Options {
        expected_gpus: expect_gpus.or(config.topology.expected_gpus),
        xid_drain: config.topology.xid_drain.clone(),
        ignore_ports: config.topology.ignore_ports.clone(),
        check_gpu_link_speed: config.topology.check_gpu_link_speed,
    };
    Ok(health::check(
        &node,
        xids.as_deref().map_err(|e| e.clone()),
        &opts,
    ))
}

pub fn execute(args: &HealthArgs, config: &Config) -> Result<i32, Failure> {
    let (text, code) = output(args, config)?;
    out!("{text}");
    Ok(code)
}

/// What `berth health` prints, and its exit status: 0 healthy, 1 not.
pub fn output(args: &HealthArgs, config: &Config) -> Result<(String, i32), Failure> {
    let window = if args.job_end {
        XidWindow::Job
    } else if args.all_xids {
        XidWindow::All
    } else if let Some(s) = args.xid_after {
        XidWindow::After(s)
    } else {
        XidWindow::None
    };
    let report = report(
        config,
        &args.source,
        args.expect_gpus,
        args.kmsg.as_deref(),
        window,
        args.job_start,
    )?;
    let text = if args.json {
        serde_json::to_string_pretty(&report).expect("a report serializes") + "\n"
    } else if let Some(reason) = &report.reason {
        format!("{reason}\n")
    } else {
        let summary: Vec<String> = report
            .checks
            .iter()
            .map(|c| format!("{}: {}", c.name, c.detail))
            .collect();
        format!("healthy: {}\n", summary.join("; "))
    };
    Ok((text, if report.healthy { 0 } else { 1 }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::topo::tests::dgx;

    fn args(source: Source, kmsg: PathBuf, all_xids: bool, json: bool) -> HealthArgs {
        HealthArgs {
            source,
            json,
            expect_gpus: Some(8),
            kmsg: Some(kmsg),
            xid_after: None,
            all_xids,
            job_start: false,
            job_end: false,
        }
    }

    #[test]
    fn health_exits_1_with_a_drain_reason() {
        let (f, source) = dgx();
        let log = f.root().join("kmsg");
        std::fs::write(&log, "6,1,10,-;Linux version\n").unwrap();
        let (text, code) = output(
            &args(source.clone(), log.clone(), true, false),
            &Config::default(),
        )
        .unwrap();
        assert_eq!(code, 0, "{text}");
        assert!(
            text.starts_with("healthy: gpu-count: 8 on the PCI bus, 8 seen by NVML, 8 expected;")
        );
        std::fs::write(
            &log,
            "6,1,10,-;Linux version\n4,2,20,-;NVRM: Xid (PCI:0000:d1:00): 74, pid=9, NVLink: fatal error\n",
        )
        .unwrap();
        let (text, code) = output(
            &args(source.clone(), log.clone(), true, false),
            &Config::default(),
        )
        .unwrap();
        assert_eq!((text.as_str(), code), ("GPU 6 (0000:d1:00.0): Xid 74\n", 1));
        // Only XIDs after the given sequence number count.
        let mut a = args(source.clone(), log.clone(), false, true);
        a.xid_after = Some(2);
        let (json, code) = output(&a, &Config::default()).unwrap();
        assert_eq!(code, 0);
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v["healthy"], true);
        assert_eq!(v["checks"][3]["name"], "xid");
    }
}
