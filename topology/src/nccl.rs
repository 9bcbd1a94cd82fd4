//! An NCCL topology file (NCCL_TOPO_FILE) from the host's view of the node: CPUs (NUMA nodes)
//! holding the PCIe switches (upstream ports, as NCCL models them) that hold the GPUs and compute
//! NICs. NCCL loads it before its own detection and fills in what it leaves out (GPU numbers,
//! NVLinks, NIC properties): those depend on what the process sees, which inside a container
//! differs from the host, so the file carries only the PCIe tree and the CPU affinities.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::Path;

use super::distance::switches;
use super::node::Node;
use super::pci::{Bdf, PciDevice};
use super::{CpuSet, TopologyError};

#[derive(Default)]
struct Tree {
    children: BTreeMap<Bdf, Tree>,
}

impl Tree {
    fn insert(&mut self, path: &[Bdf]) {
        if let Some((first, rest)) = path.split_first() {
            self.children.entry(*first).or_default().insert(rest);
        }
    }
}

fn speed(s: Option<f32>) -> String {
    // The spellings NCCL's table knows: "2.5 GT/s PCIe", "5.0 GT/s PCIe", ..., "32.0 GT/s PCIe".
    match s {
        Some(v) => format!("{v:.1} GT/s PCIe"),
        None => "Unknown".into(),
    }
}

fn pci_attrs(d: &PciDevice) -> String {
    format!(
        "busid=\"{}\" class=\"0x{:06x}\" vendor=\"0x{:04x}\" device=\"0x{:04x}\" subsystem_vendor=\"0x{:04x}\" subsystem_device=\"0x{:04x}\" link_speed=\"{}\" link_width=\"{}\"",
        d.bdf,
        d.class,
        d.vendor,
        d.device,
        d.subsystem_vendor.unwrap_or(0),
        d.subsystem_device.unwrap_or(0),
        speed(d.max_link.speed_gts.or(d.current_link.speed_gts)),
        d.max_link.width.or(d.current_link.width).unwrap_or(0),
    )
}

fn emit(out: &mut String, tree: &Tree, devices: &BTreeMap<Bdf, &PciDevice>, depth: usize) {
    for (bdf, sub) in &tree.children {
        let pad = "  ".repeat(depth);
        let Some(d) = devices.get(bdf) else {
            // A bridge sysfs did not show: NCCL reads it from sysfs itself.
            emit(out, sub, devices, depth);
            continue;
        };
        if sub.children.is_empty() {
            let _ = writeln!(out, "{pad}<pci {}/>", pci_attrs(d));
        } else {
            let _ = writeln!(out, "{pad}<pci {}>", pci_attrs(d));
            emit(out, sub, devices, depth + 1);
            let _ = writeln!(out, "{pad}</pci>");
        }
    }
}

/// The topology file for the node's GPUs and compute NICs.
pub fn topology_xml(node: &Node) -> String {
    let mut devices: BTreeMap<Bdf, &PciDevice> =
        node.bridges.iter().map(|(b, d)| (*b, d)).collect();
    let mut by_numa: BTreeMap<u32, Tree> = BTreeMap::new();
    let endpoints = node.gpus.iter().map(|g| (&g.pci, g.numa)).chain(
        node.compute_nics()
            .filter_map(|n| n.pci.as_ref().map(|p| (p, n.numa))),
    );
    for (dev, numa) in endpoints {
        devices.insert(dev.bdf, dev);
        let mut path: Vec<Bdf> = switches(dev);
        path.reverse();
        path.push(dev.bdf);
        by_numa.entry(numa.unwrap_or(0)).or_default().insert(&path);
    }
    let mut out = String::from("<system version=\"1\">\n");
    for (numa, tree) in &by_numa {
        let cpus = node
            .cpus
            .node(*numa)
            .map(|n| n.cpus.clone())
            .unwrap_or_else(|| node.cpus.online.clone());
        let groups = node
            .cpus
            .online
            .iter()
            .max()
            .map(|m| m as usize / 32 + 1)
            .unwrap_or(1);
        let _ = writeln!(
            out,
            "  <cpu numaid=\"{numa}\" affinity=\"{}\" arch=\"{}\">",
            affinity(&cpus, groups),
            std::env::consts::ARCH
        );
        emit(&mut out, tree, &devices, 2);
        out.push_str("  </cpu>\n");
    }
    out.push_str("</system>\n");
    out
}

fn affinity(cpus: &CpuSet, groups: usize) -> String {
    cpus.to_mask(groups)
}

/// Writes the file atomically (a reader never sees half of it).
pub fn write(node: &Node, path: &Path) -> Result<(), TopologyError> {
    super::atomic_write(path, topology_xml(node).as_bytes())
}
