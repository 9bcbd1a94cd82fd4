//! How far apart two devices are, in the terms of `nvidia-smi topo -m` and NCCL:
//!
//! - `NV#`: # NVLinks between two GPUs (directly or through NVSwitches)
//! - `PIX`: at most one PCIe switch between them
//! - `PXB`: several PCIe switches, without crossing a host bridge
//! - `PHB`: through a PCIe host bridge (the CPU's root complex)
//! - `NODE`: between host bridges of one NUMA node
//! - `SYS`: across NUMA nodes (the SMP interconnect)
//!
//! PCIe switches are found as NCCL finds them: walking up the sysfs path two levels at a time
//! (a switch is an upstream port with its downstream ports), stopping at the root complex.

use std::cmp::Ordering;
use std::fmt;

use serde::{Serialize, Serializer};

use super::gpu::{NvLinkRemote, NvmlGpu};
use super::pci::{Bdf, PciDevice};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Link {
    /// The device itself.
    X,
    Nv(u32),
    Pix,
    Pxb,
    Phb,
    Node,
    Sys,
}

impl Link {
    fn rank(&self) -> (u32, u32) {
        match self {
            Link::X => (0, 0),
            // More links is closer.
            Link::Nv(n) => (1, u32::MAX - n),
            Link::Pix => (2, 0),
            Link::Pxb => (3, 0),
            Link::Phb => (4, 0),
            Link::Node => (5, 0),
            Link::Sys => (6, 0),
        }
    }

    /// Whether the path stays below the CPU (PIX or PXB, or NVLink): where GPUDirect RDMA
    /// runs at full speed.
    pub fn below_cpu(&self) -> bool {
        matches!(self, Link::X | Link::Nv(_) | Link::Pix | Link::Pxb)
    }
}

impl Ord for Link {
    fn cmp(&self, other: &Self) -> Ordering {
        self.rank().cmp(&other.rank())
    }
}

impl PartialOrd for Link {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Display for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Link::X => f.write_str("X"),
            Link::Nv(n) => write!(f, "NV{n}"),
            Link::Pix => f.write_str("PIX"),
            Link::Pxb => f.write_str("PXB"),
            Link::Phb => f.write_str("PHB"),
            Link::Node => f.write_str("NODE"),
            Link::Sys => f.write_str("SYS"),
        }
    }
}

impl Serialize for Link {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

/// The PCIe switches above a device, nearest first, each named by its upstream port.
pub fn switches(dev: &PciDevice) -> Vec<Bdf> {
    let mut out = Vec::new();
    let mut i = dev.chain.len();
    while i >= 2 {
        i -= 2;
        out.push(dev.chain[i]);
    }
    out
}

/// The PCIe distance between two devices; `numa_*` are their NUMA nodes (inferred when sysfs
/// has none).
pub fn pci(a: &PciDevice, numa_a: Option<u32>, b: &PciDevice, numa_b: Option<u32>) -> Link {
    if a.bdf == b.bdf {
        return Link::X;
    }
    if a.root != b.root {
        return if numa_a == numa_b {
            Link::Node
        } else {
            Link::Sys
        };
    }
    let (sa, sb) = (switches(a), switches(b));
    for (i, s) in sa.iter().enumerate() {
        if let Some(j) = sb.iter().position(|t| t == s) {
            return if i == 0 && j == 0 {
                Link::Pix
            } else {
                Link::Pxb
            };
        }
    }
    Link::Phb
}

/// NVLinks between two GPUs: direct links, or, when both reach NVSwitches, the smaller of their
/// switch link counts (every GPU on an NVSwitch fabric reaches every other at that width).
#[expect(
    clippy::cast_possible_truncation,
    reason = "counts a GPU's NVLinks: NVML reports at most NVML_NVLINK_MAX_LINKS (18)"
)]
pub fn nvlinks(a: &NvmlGpu, b: &NvmlGpu) -> u32 {
    let direct = a
        .nvlinks
        .iter()
        .filter(|l| l.active && l.remote_bus_id == Some(b.bus_id))
        .count() as u32;
    if direct > 0 {
        return direct;
    }
    let to_switch = |g: &NvmlGpu| {
        g.nvlinks
            .iter()
            .filter(|l| l.active && l.remote == NvLinkRemote::Switch)
            .count() as u32
    };
    to_switch(a).min(to_switch(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closeness_orders_links() {
        let mut v = [
            Link::Sys,
            Link::Pix,
            Link::Nv(2),
            Link::Node,
            Link::Nv(18),
            Link::Phb,
            Link::Pxb,
        ];
        v.sort();
        let names: Vec<String> = v.iter().map(|l| l.to_string()).collect();
        assert_eq!(names, ["NV18", "NV2", "PIX", "PXB", "PHB", "NODE", "SYS"]);
        assert!(Link::Pxb.below_cpu() && !Link::Phb.below_cpu());
    }
}
