//! Node health for Prolog and Epilog: GPU count against what the node should have, uncorrectable
//! ECC errors, pending page retirement or row remapping, XID events during the job, RDMA ports
//! that are not ACTIVE, and PCIe links trained below what both ends support. Pure: it judges a
//! [`Node`] snapshot and kernel-log XIDs; the report's one-line reason is what Slurm shows as
//! the drain reason.

use serde::Serialize;

use super::TopologyError;
use super::glob_match;
use super::gpu::GpuUnavailable;
use super::kmsg::Xid;
use super::node::{NicRole, Node};
use super::pci::{LinkState, PciDevice};

/// The XIDs that mean the GPU or node needs attention (not an application's fault): 48 double
/// bit ECC, 61/62 internal micro-controller halt, 64 row remap failure, 74 NVLink error, 79
/// fallen off the bus, 92 high single-bit ECC rate, 95 uncontained ECC, 119/120 GSP errors,
/// 140 unrecovered ECC.
pub const DEFAULT_XID_DRAIN: [u32; 11] = [48, 61, 62, 64, 74, 79, 92, 95, 119, 120, 140];

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    /// GPUs the node must have; `None`: as many as the PCI bus shows.
    pub expected_gpus: Option<u32>,
    pub xid_drain: Vec<u32>,
    /// `mlx5_1:2` or `mlx5_1` (globs): ports that may be down.
    pub ignore_ports: Vec<String>,
    /// GPUs lower their PCIe speed when idle, so only their width is checked unless this is set.
    pub check_gpu_link_speed: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            expected_gpus: None,
            xid_drain: DEFAULT_XID_DRAIN.to_vec(),
            ignore_ports: Vec::new(),
            check_gpu_link_speed: false,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub ok: bool,
    /// What was seen; for a failed check, the problems.
    pub detail: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Report {
    pub healthy: bool,
    /// One line for Slurm's drain reason; `None` when healthy.
    pub reason: Option<String>,
    pub problems: Vec<String>,
    pub checks: Vec<Check>,
}

/// The most a reason line holds before "(+N more)".
const REASON_MAX: usize = 200;

/// Judges the node. `xids` are the kernel-log XIDs of the window being checked, or why they
/// could not be read (then the check is skipped and says so).
// Long by design: five independent checks, each a commented block adding to one report in the
// order `berth health` prints them; apart, that order would live in a sixth place.
pub fn check(node: &Node, xids: Result<&[Xid], &TopologyError>, opts: &Options) -> Report {
    let mut checks = Vec::new();
    let mut add = |name: &'static str, problems: Vec<String>, ok_detail: String| {
        checks.push(Check {
            name,
            ok: problems.is_empty(),
            detail: if problems.is_empty() {
                ok_detail
            } else {
                problems.join("; ")
            },
        });
        problems
    };
    let label = |i: u32| {
        node.gpu(i)
            .map(|g| format!("GPU {} ({})", g.index, g.bdf))
            .unwrap_or_else(|| format!("GPU {i}"))
    };
    let mut problems = Vec::new();

    // GPU count and driver.
    let mut p = Vec::new();
    let on_bus = u32::try_from(node.gpus.len()).unwrap_or(u32::MAX);
    if let Some(e) = opts.expected_gpus
        && on_bus != e
    {
        p.push(format!("{on_bus} of {e} GPUs on the PCI bus"));
    }
    if on_bus > 0 || opts.expected_gpus.is_some_and(|e| e > 0) {
        match &node.driver.nvml {
            Ok(info) => {
                for e in &info.errors {
                    p.push(format!("NVML: {e}"));
                }
                for g in node.gpus.iter().filter(|g| g.nvml.is_none()) {
                    p.push(format!(
                        "{} is on the PCI bus but NVML cannot see it",
                        label(g.index)
                    ));
                }
            }
            Err(GpuUnavailable::NoDriver(d)) => p.push(format!(
                "{on_bus} NVIDIA GPUs but NVML cannot load ({d}): install or load the NVIDIA driver"
            )),
            Err(GpuUnavailable::Failed(d)) => p.push(format!("NVML failed: {d}")),
        }
    }
    let visible = node.gpus.iter().filter(|g| g.nvml.is_some()).count();
    problems.extend(add(
        "gpu-count",
        p,
        format!(
            "{on_bus} on the PCI bus, {visible} seen by NVML{}",
            opts.expected_gpus
                .map(|e| format!(", {e} expected"))
                .unwrap_or_default()
        ),
    ));

    // Memory errors.
    let mut ecc = Vec::new();
    let mut pages = Vec::new();
    for g in &node.gpus {
        let Some(n) = &g.nvml else { continue };
        if let Some(e) = &n.ecc
            && e.uncorrected_volatile > 0
        {
            ecc.push(format!(
                "{}: {} uncorrectable ECC errors",
                label(g.index),
                e.uncorrected_volatile
            ));
        }
        if n.retired_pages_pending == Some(true) {
            pages.push(format!(
                "{}: page retirement pending: reset the GPU",
                label(g.index)
            ));
        }
        if let Some(r) = &n.remapped_rows {
            if r.failure {
                pages.push(format!(
                    "{}: row remapping failed: the GPU needs service",
                    label(g.index)
                ));
            } else if r.pending {
                pages.push(format!(
                    "{}: row remapping pending: reset the GPU",
                    label(g.index)
                ));
            }
        }
    }
    problems.extend(add("ecc", ecc, "no uncorrectable errors".into()));
    problems.extend(add("retired-pages", pages, "nothing pending".into()));

    // XIDs.
    match xids {
        Ok(list) => {
            let bad: Vec<String> = list
                .iter()
                .filter(|x| opts.xid_drain.contains(&x.code))
                .map(|x| {
                    let gpu = node
                        .gpus
                        .iter()
                        .find(|g| g.bdf.slot() == x.slot)
                        .map(|g| label(g.index))
                        .unwrap_or_else(|| format!("GPU {}", x.slot));
                    format!("{gpu}: Xid {}", x.code)
                })
                .collect();
            let others = list.len() - bad.len();
            problems.extend(add(
                "xid",
                bad,
                format!("{} XIDs in the window, none that drains", others),
            ));
        }
        Err(why) => {
            add("xid", Vec::new(), format!("not checked: {why}"));
        }
    }

    // RDMA ports.
    let mut ports = Vec::new();
    let mut seen = 0;
    for n in node.nics.iter().filter(|n| n.role != NicRole::Excluded) {
        for port in &n.device.ports {
            seen += 1;
            let id = format!("{}:{}", n.name, port.num);
            if port.is_active()
                || opts
                    .ignore_ports
                    .iter()
                    .any(|p| glob_match(p, &id) || glob_match(p, &n.name))
            {
                continue;
            }
            ports.push(format!(
                "{} port {}: {} ({})",
                n.name, port.num, port.state, port.phys_state
            ));
        }
    }
    problems.extend(add("nic-ports", ports, format!("{seen} ports ACTIVE")));

    // PCIe links.
    let mut links = Vec::new();
    let parent = |d: &PciDevice| d.parent().and_then(|b| node.bridges.get(&b));
    let mut judge = |what: String, d: &PciDevice, speed: bool| {
        let want = expected_link(d, parent(d));
        let have = d.current_link;
        let narrow = matches!((have.width, want.width), (Some(h), Some(w)) if h < w);
        let slow =
            speed && matches!((have.speed_gts, want.speed_gts), (Some(h), Some(w)) if h + 0.01 < w);
        if narrow || slow {
            links.push(format!("{what}: PCIe link {have}, expected {want}"));
        }
    };
    for g in &node.gpus {
        judge(label(g.index), &g.pci, opts.check_gpu_link_speed);
    }
    for n in node.nics.iter().filter(|n| n.role != NicRole::Excluded) {
        if let Some(p) = &n.pci {
            judge(format!("{} ({})", n.name, p.bdf), p, true);
        }
    }
    problems.extend(add(
        "pcie-links",
        links,
        "every GPU and NIC link at its expected width and speed".into(),
    ));

    let reason = (!problems.is_empty()).then(|| reason_line(&problems));
    Report {
        healthy: problems.is_empty(),
        reason,
        problems,
        checks,
    }
}

/// What a link should train to: the lower of the device's and its upstream port's maximum.
fn expected_link(d: &PciDevice, parent: Option<&PciDevice>) -> LinkState {
    let min_f = |a: Option<f32>, b: Option<f32>| match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, y) => x.or(y),
    };
    let min_u = |a: Option<u32>, b: Option<u32>| match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, y) => x.or(y),
    };
    let p = parent.map(|p| p.max_link).unwrap_or_default();
    LinkState {
        speed_gts: min_f(d.max_link.speed_gts, p.speed_gts),
        width: min_u(d.max_link.width, p.width),
    }
}

/// The problems as one line: as many whole ones as fit, then "(+N more)".
fn reason_line(problems: &[String]) -> String {
    let mut line = String::new();
    let mut used = 0;
    for p in problems {
        let next = if line.is_empty() {
            p.clone()
        } else {
            format!("{line}; {p}")
        };
        if used > 0 && next.len() > REASON_MAX {
            break;
        }
        line = next;
        used += 1;
    }
    if used < problems.len() {
        line.push_str(&format!(" (+{} more)", problems.len() - used));
    }
    line.replace('\n', " ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixture;
    use crate::gpu::{NvmlSnapshot, Recorded};
    use crate::kmsg;
    use crate::node::{self, NicPolicy};

    fn node_with(f: &fixture::Fixture, snap: NvmlSnapshot) -> Node {
        node::discover(&f.host(), &Recorded::new(snap), &NicPolicy::default()).unwrap()
    }

    fn run(n: &Node, xids: &[Xid], opts: &Options) -> Report {
        check(n, Ok(xids), opts)
    }

    #[test]
    fn a_healthy_dgx_passes_every_check() {
        let (f, snap) = fixture::dgx_h100();
        let n = node_with(&f, snap);
        let r = run(
            &n,
            &[],
            &Options {
                expected_gpus: Some(8),
                ..Default::default()
            },
        );
        assert!(r.healthy, "{:?}", r.problems);
        assert_eq!(r.reason, None);
        let names: Vec<&str> = r.checks.iter().map(|c| c.name).collect();
        assert_eq!(
            names,
            [
                "gpu-count",
                "ecc",
                "retired-pages",
                "xid",
                "nic-ports",
                "pcie-links"
            ]
        );
        assert_eq!(
            r.checks[0].detail,
            "8 on the PCI bus, 8 seen by NVML, 8 expected"
        );
        assert_eq!(r.checks[4].detail, "12 ports ACTIVE");
    }

    #[test]
    fn each_fault_is_named_in_one_line() {
        let (f, mut snap) = fixture::dgx_h100();
        snap.gpus[1].ecc.as_mut().unwrap().uncorrected_volatile = 2;
        snap.gpus[2].remapped_rows.as_mut().unwrap().pending = true;
        snap.gpus[3].remapped_rows.as_mut().unwrap().failure = true;
        snap.gpus[4].retired_pages_pending = Some(true);
        snap.gpus.remove(7);
        snap.errors.push("GPU 7: GPU is lost".into());
        f.write(
            "sys/devices/pci0000:3d/0000:3d:01.0/0000:3e:00.0/0000:3f:00.0/0000:40:00.0/infiniband/mlx5_3/ports/1/state",
            "1: DOWN\n",
        );
        // GPU 5's link trained at x8; NIC mlx5_9 at 16 GT/s; GPU 6 idles at 2.5 GT/s.
        f.pci_attr(fixture::bdf("0000:c3:00.0"), "current_link_width", "8");
        f.pci_attr(
            fixture::bdf("0000:c0:00.0"),
            "current_link_speed",
            "16.0 GT/s PCIe",
        );
        f.pci_attr(
            fixture::bdf("0000:d1:00.0"),
            "current_link_speed",
            "2.5 GT/s PCIe",
        );
        let n = node_with(&f, snap);
        let log = "4,10,100,-;NVRM: Xid (PCI:0000:1b:00): 79, pid=1, GPU has fallen off the bus.\n\
                   4,11,200,-;NVRM: Xid (PCI:0000:43:00): 13, pid=2, Graphics SM Exception\n";
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("kmsg"), log).unwrap();
        let records = kmsg::read(&dir.path().join("kmsg")).unwrap();
        let xids = kmsg::xids(&records, None);
        let r = run(
            &n,
            &xids,
            &Options {
                expected_gpus: Some(8),
                ..Default::default()
            },
        );
        assert!(!r.healthy);
        assert_eq!(
            r.problems,
            [
                "NVML: GPU 7: GPU is lost",
                "GPU 7 (0000:df:00.0) is on the PCI bus but NVML cannot see it",
                "GPU 1 (0000:43:00.0): 2 uncorrectable ECC errors",
                "GPU 2 (0000:52:00.0): row remapping pending: reset the GPU",
                "GPU 3 (0000:61:00.0): row remapping failed: the GPU needs service",
                "GPU 4 (0000:9d:00.0): page retirement pending: reset the GPU",
                "GPU 0 (0000:1b:00.0): Xid 79",
                "mlx5_3 port 1: DOWN (LinkUp)",
                "GPU 5 (0000:c3:00.0): PCIe link 32 GT/s x8, expected 32 GT/s x16",
                "mlx5_9 (0000:c0:00.0): PCIe link 16 GT/s x16, expected 32 GT/s x16",
            ],
            "Xid 13 is the application's, GPU 6's idle link speed is not a fault"
        );
        let reason = r.reason.unwrap();
        assert!(!reason.contains('\n'));
        assert!(reason.starts_with(
            "NVML: GPU 7: GPU is lost; GPU 7 (0000:df:00.0) is on the PCI bus but NVML cannot see it; GPU 1 (0000:43:00.0): 2 uncorrectable ECC errors; "
        ), "{reason}");
        assert!(reason.ends_with(" (+6 more)"), "{reason}");
        assert!(reason.len() < 260);
        // Checking GPU link speed too flags the idle GPU.
        let strict = check(
            &n,
            Ok(&[]),
            &Options {
                check_gpu_link_speed: true,
                ignore_ports: vec!["mlx5_3:1".into()],
                ..Default::default()
            },
        );
        assert!(strict.problems.contains(
            &"GPU 6 (0000:d1:00.0): PCIe link 2.5 GT/s x16, expected 32 GT/s x16".to_string()
        ));
        assert!(
            !strict.problems.iter().any(|p| p.starts_with("mlx5_3")),
            "ignored port"
        );
    }

    #[test]
    fn gpu_count_and_driver() {
        let (f, snap) = fixture::dgx_h100();
        let n = node_with(&f, snap);
        let r = run(
            &n,
            &[],
            &Options {
                expected_gpus: Some(9),
                ..Default::default()
            },
        );
        assert_eq!(r.reason.as_deref(), Some("8 of 9 GPUs on the PCI bus"));
        let bare =
            node::discover(&f.host(), &Recorded::no_driver(), &NicPolicy::default()).unwrap();
        let r = run(&bare, &[], &Options::default());
        assert_eq!(
            r.reason.as_deref(),
            Some(
                "8 NVIDIA GPUs but NVML cannot load (recorded: no driver): install or load the NVIDIA driver"
            )
        );
        // A CPU node is healthy without a driver; its XIDs may be unreadable.
        let cpu = fixture::cpu_node();
        let n = node::discover(&cpu.host(), &Recorded::no_driver(), &NicPolicy::default()).unwrap();
        let r = check(
            &n,
            Err(&TopologyError::Value(
                "reading /dev/kmsg: permission denied".into(),
            )),
            &Options::default(),
        );
        assert!(r.healthy, "{:?}", r.problems);
        assert_eq!(
            r.checks[3].detail,
            "not checked: reading /dev/kmsg: permission denied"
        );
    }
}
