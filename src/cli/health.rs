//! `berth health`: is this node fit to run jobs? Exit 0 when it is; exit 1 with one line saying
//! why not (fit for `scontrol update nodename=... state=drain reason="..."`) when it is not.

use std::path::PathBuf;

use clap::Args;

use super::Failure;
use super::topo::Source;
use crate::config::Config;
use crate::node::health as node_health;
pub use crate::node::health::XidWindow;

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
    let report = node_health::report(
        config,
        &args.source.lib(),
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
