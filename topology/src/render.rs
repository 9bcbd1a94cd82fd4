//! Text for people: the node's distance matrix and GPU→NIC→NUMA pairing (`berth topo`, laid
//! out like `nvidia-smi topo -m`) and per-rank plans (`berth topo plan`). Machines get JSON.

use std::fmt::Write;

use super::node::Node;
use super::plan::{NodePlan, pairing};

fn table(rows: &[Vec<String>]) -> String {
    let cols = rows.iter().map(|r| r.len()).max().unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.len())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for r in rows {
        let line: Vec<String> = r
            .iter()
            .enumerate()
            .map(|(c, s)| format!("{s:<w$}", w = widths[c]))
            .collect();
        let _ = writeln!(out, "{}", line.join("  ").trim_end());
    }
    out
}

/// The matrix, the NIC legend, the pairing and the NUMA nodes.
// Long by design: one text drawn top to bottom, in the layout of `nvidia-smi topo -m`.
pub fn topology(node: &Node) -> String {
    let mut out = String::new();
    let gpus = &node.gpus;
    let nics = &node.nics;
    if !gpus.is_empty() {
        let mut header = vec![String::new()];
        header.extend(gpus.iter().map(|g| format!("GPU{}", g.index)));
        header.extend((0..nics.len()).map(|i| format!("NIC{i}")));
        header.push("CPU Affinity".into());
        header.push("NUMA Affinity".into());
        let mut rows = vec![header];
        let link = |l: Option<super::Link>| l.map(|l| l.to_string()).unwrap_or_else(|| "-".into());
        for g in gpus {
            let mut row = vec![format!("GPU{}", g.index)];
            row.extend(gpus.iter().map(|h| node.gpu_gpu(g, h).to_string()));
            row.extend(nics.iter().map(|n| link(node.gpu_nic(g, n))));
            row.push(
                g.local_cpus
                    .as_ref()
                    .map(|c| c.to_string())
                    .unwrap_or_else(|| "N/A".into()),
            );
            row.push(
                g.numa
                    .map(|n| n.to_string())
                    .unwrap_or_else(|| "N/A".into()),
            );
            rows.push(row);
        }
        for (i, n) in nics.iter().enumerate() {
            let mut row = vec![format!("NIC{i}")];
            row.extend(gpus.iter().map(|g| link(node.gpu_nic(g, n))));
            row.extend(nics.iter().map(|m| link(node.nic_nic(n, m))));
            rows.push(row);
        }
        out.push_str(&table(&rows));
        out.push_str(
            "\nLegend: X = self, NV# = # NVLinks, PIX = at most one PCIe switch, PXB = several PCIe \
switches, PHB = a PCIe host bridge, NODE = between host bridges of a NUMA node, SYS = across NUMA \
nodes\n",
        );
    }
    if !nics.is_empty() {
        out.push_str("\nNICs:\n");
        let mut rows = Vec::new();
        for (i, n) in nics.iter().enumerate() {
            let ports: Vec<String> = n
                .device
                .ports
                .iter()
                .map(|p| {
                    format!(
                        "port {} {} {} {}{}",
                        p.num,
                        p.state,
                        p.rate,
                        p.link_layer,
                        p.netdev
                            .as_ref()
                            .map(|d| format!(" {d}"))
                            .unwrap_or_default()
                    )
                })
                .collect();
            rows.push(vec![
                format!("  NIC{i}"),
                n.name.clone(),
                n.bdf.map(|b| b.to_string()).unwrap_or_else(|| "-".into()),
                format!("{:?}", n.role).to_lowercase(),
                format!("({})", n.role_reason),
                n.numa
                    .map(|x| format!("NUMA {x}"))
                    .unwrap_or_else(|| "NUMA ?".into()),
                ports.join("; "),
            ]);
        }
        out.push_str(&table(&rows));
    }
    if !gpus.is_empty() {
        out.push_str("\nPairing (GPU -> NIC -> NUMA):\n");
        let mut rows = Vec::new();
        for p in pairing(node) {
            let g = node.gpu(p.gpu).expect("pairs come from the node's GPUs");
            rows.push(vec![
                format!("  GPU{}", p.gpu),
                p.bdf.to_string(),
                g.uuid.clone().unwrap_or_else(|| "-".into()),
                format!(
                    "-> {}",
                    match (&p.nic, p.link) {
                        (Some(n), Some(l)) => format!("{n} ({l})"),
                        _ => "no compute NIC".into(),
                    }
                ),
                format!(
                    "-> {}",
                    match p.numa.and_then(|n| node.cpus.node(n)) {
                        Some(n) => format!("NUMA {} (CPUs {})", n.id, n.cpus),
                        None => "NUMA ?".into(),
                    }
                ),
            ]);
        }
        out.push_str(&table(&rows));
    }
    if gpus.is_empty() && nics.is_empty() {
        out.push_str("No GPU and no RDMA NIC on this node.\n");
    }
    out.push_str("\nNUMA nodes:\n");
    for n in &node.cpus.numa {
        let _ = writeln!(
            out,
            "  {}: CPUs {} ({} cores)",
            n.id,
            n.cpus,
            node.cpus.cores_of(n.id).len()
        );
    }
    let _ = write!(out, "\nNVIDIA driver: ");
    match (&node.driver.kernel_module, &node.driver.nvml) {
        (_, Ok(info)) => {
            let _ = writeln!(
                out,
                "{} (NVML), CUDA {}",
                info.driver_version.as_deref().unwrap_or("?"),
                info.cuda_driver_version
                    .map(|v| format!("{}.{}", v / 1000, v % 1000 / 10))
                    .unwrap_or_else(|| "?".into())
            );
        }
        (Some(v), Err(super::gpu::GpuUnavailable::NoDriver(d))) => {
            let _ = writeln!(out, "kernel module {v}; NVML not loadable ({d})");
        }
        (Some(v), Err(e)) => {
            let _ = writeln!(out, "kernel module {v}; {e}");
        }
        (None, Err(e)) => {
            let _ = writeln!(out, "{e}");
        }
    }
    let _ = writeln!(
        out,
        "GPUs: {}; RDMA NICs: {} ({} compute)",
        gpus.len(),
        nics.len(),
        node.compute_nics().count()
    );
    for w in &node.warnings {
        let _ = writeln!(out, "warning: {w}");
    }
    out
}

/// One block per rank.
pub fn plan(p: &NodePlan) -> String {
    let mut out = String::new();
    let gpus: Vec<String> = p.gpus.iter().map(|g| g.index.to_string()).collect();
    let _ = writeln!(
        out,
        "GPUs: {}; HCAs for NCCL: {}; ranks: {}",
        if gpus.is_empty() {
            "none".into()
        } else {
            gpus.join(",")
        },
        if p.hcas.is_empty() {
            "none".into()
        } else {
            p.hcas.join(",")
        },
        p.ranks.len()
    );
    for r in &p.ranks {
        let gpus: Vec<String> = r
            .gpus
            .iter()
            .map(|g| format!("GPU {} ({})", g.index, g.bdf))
            .collect();
        let nics: Vec<String> = r
            .nics
            .iter()
            .map(|n| match n.link {
                Some(l) => format!("{} ({l})", n.name),
                None => n.name.clone(),
            })
            .collect();
        let _ = writeln!(
            out,
            "rank {}: {} -> {} -> CPUs {}, memory node {}",
            r.rank,
            if gpus.is_empty() {
                "no GPU".into()
            } else {
                gpus.join(", ")
            },
            if nics.is_empty() {
                "no NIC".into()
            } else {
                nics.join(", ")
            },
            r.cpus,
            r.mems
        );
        for (k, v) in &r.env {
            let _ = writeln!(out, "  {k}={v}");
        }
    }
    for w in &p.warnings {
        let _ = writeln!(out, "warning: {w}");
    }
    out
}
