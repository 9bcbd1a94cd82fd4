//! One snapshot of the node: CPUs and NUMA nodes, GPUs (sysfs + driver procfs + NVML) and RDMA
//! NICs, each NIC classified as compute, storage or excluded, plus the distances between them.

use std::collections::BTreeMap;

use serde::Serialize;

use super::cpu::{self, Cpus};
use super::distance::{self, Link};
use super::gpu::{self, GpuBackend, GpuUnavailable, NvmlGpu};
use super::pci::{self, Bdf, PciDevice};
use super::rdma::{self, RdmaDevice};
use super::{CpuSet, Host, TopologyError, glob_match};

pub const NVIDIA_VENDOR: u16 = 0x10de;

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Gpu {
    /// NVML's index (PCI bus order), which Slurm's GPU ids and CUDA use.
    pub index: u32,
    pub bdf: Bdf,
    /// N of `/dev/nvidiaN`; `None` without the driver.
    pub minor: Option<u32>,
    pub uuid: Option<String>,
    pub model: Option<String>,
    pub numa: Option<u32>,
    pub local_cpus: Option<CpuSet>,
    pub pci: PciDevice,
    pub nvml: Option<NvmlGpu>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NicRole {
    /// Carries MPI/NCCL traffic: paired with GPUs and given to ranks.
    Compute,
    /// Storage or other traffic: left out of NCCL_IB_HCA and ranks.
    Storage,
    /// Ignored (configuration, or not a PCI device).
    Excluded,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Nic {
    pub name: String,
    pub bdf: Option<Bdf>,
    pub numa: Option<u32>,
    pub role: NicRole,
    /// Why the NIC has its role, for `berth topo`.
    pub role_reason: String,
    pub device: RdmaDevice,
    pub pci: Option<PciDevice>,
}

impl Nic {
    /// The ports a rank should use: the active ones, else port 1.
    pub fn ports(&self) -> Vec<u32> {
        let active: Vec<u32> = self
            .device
            .ports
            .iter()
            .filter(|p| p.is_active())
            .map(|p| p.num)
            .collect();
        if active.is_empty() { vec![1] } else { active }
    }

    fn matches(&self, pattern: &str) -> bool {
        glob_match(pattern, &self.name)
            || self.device.netdevs.iter().any(|n| glob_match(pattern, n))
            || self
                .bdf
                .is_some_and(|b| glob_match(pattern, &b.to_string()))
    }
}

/// Which NICs are compute NICs, from the configuration (`topology.compute_nics` and
/// `topology.exclude_nics`: globs on the device name, a netdev name or the PCI address).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NicPolicy {
    pub compute: Vec<String>,
    pub exclude: Vec<String>,
}

/// The NVIDIA driver as the node shows it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Driver {
    /// The kernel module's version from /proc/driver/nvidia/version; `None` when not loaded.
    pub kernel_module: Option<String>,
    #[serde(serialize_with = "nvml_status")]
    pub nvml: Result<NvmlInfo, GpuUnavailable>,
}

/// `{"available": true, "driver_version": ...}` or `{"available": false, "error": {...}}`.
fn nvml_status<S: serde::Serializer>(
    v: &Result<NvmlInfo, GpuUnavailable>,
    s: S,
) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let mut m = s.serialize_map(None)?;
    match v {
        Ok(info) => {
            m.serialize_entry("available", &true)?;
            m.serialize_entry("driver_version", &info.driver_version)?;
            m.serialize_entry("cuda_driver_version", &info.cuda_driver_version)?;
            m.serialize_entry("errors", &info.errors)?;
        }
        Err(e) => {
            m.serialize_entry("available", &false)?;
            m.serialize_entry("error", &e.to_string())?;
        }
    }
    m.end()
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct NvmlInfo {
    pub driver_version: Option<String>,
    pub cuda_driver_version: Option<i32>,
    /// GPUs NVML could not open.
    pub errors: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Node {
    pub cpus: Cpus,
    /// In index order.
    pub gpus: Vec<Gpu>,
    /// In PCI order (software RDMA devices last).
    pub nics: Vec<Nic>,
    pub driver: Driver,
    /// The bridges on the GPUs' and NICs' PCIe paths.
    pub bridges: BTreeMap<Bdf, PciDevice>,
    /// Things that are odd but do not stop berth (a GPU NVML does not list, ...).
    pub warnings: Vec<String>,
}

impl Node {
    pub fn gpu(&self, index: u32) -> Option<&Gpu> {
        self.gpus.iter().find(|g| g.index == index)
    }

    pub fn nic(&self, name: &str) -> Option<&Nic> {
        self.nics.iter().find(|n| n.name == name)
    }

    pub fn compute_nics(&self) -> impl Iterator<Item = &Nic> {
        self.nics.iter().filter(|n| n.role == NicRole::Compute)
    }

    /// Distance between a GPU and a NIC; `None` for a NIC without PCI information.
    pub fn gpu_nic(&self, g: &Gpu, n: &Nic) -> Option<Link> {
        n.pci
            .as_ref()
            .map(|p| distance::pci(&g.pci, g.numa, p, n.numa))
    }

    pub fn gpu_gpu(&self, a: &Gpu, b: &Gpu) -> Link {
        if a.bdf == b.bdf {
            return Link::X;
        }
        if let (Some(x), Some(y)) = (&a.nvml, &b.nvml) {
            let n = distance::nvlinks(x, y);
            if n > 0 {
                return Link::Nv(n);
            }
        }
        distance::pci(&a.pci, a.numa, &b.pci, b.numa)
    }

    pub fn nic_nic(&self, a: &Nic, b: &Nic) -> Option<Link> {
        match (&a.pci, &b.pci) {
            _ if a.name == b.name => Some(Link::X),
            (Some(x), Some(y)) => Some(distance::pci(x, a.numa, y, b.numa)),
            _ => None,
        }
    }
}

fn numa_of(cpus: &Cpus, dev: &PciDevice) -> Option<u32> {
    dev.numa_node
        .or_else(|| dev.local_cpus.as_ref().and_then(|l| cpus.node_of_cpus(l)))
        .or_else(|| (cpus.numa.len() == 1).then(|| cpus.numa[0].id))
}

/// Whether a PCI function is a GPU: an NVIDIA display controller (VGA 0x0300 or 3D 0x0302).
pub fn is_nvidia_gpu(dev: &PciDevice) -> bool {
    dev.vendor == NVIDIA_VENDOR && dev.class >> 16 == 0x03
}

/// Reads the node.
// Long by design: reads PCI, NVML and the NICs, then joins them in the numbering the comments
// explain; the joins depend on each other's order.
pub fn discover(
    host: &Host,
    backend: &dyn GpuBackend,
    policy: &NicPolicy,
) -> Result<Node, TopologyError> {
    let cpus = cpu::scan(host)?;
    let pci_devices = pci::scan(host)?;
    let proc_driver = gpu::proc_driver(host)?;
    let nvml = backend.snapshot();
    let mut warnings = Vec::new();

    let mut gpus: Vec<Gpu> = Vec::new();
    for dev in pci_devices.values().filter(|d| is_nvidia_gpu(d)) {
        let proc_gpu = proc_driver
            .as_ref()
            .and_then(|d| d.gpus.iter().find(|g| g.bdf == dev.bdf));
        let nvml_gpu = nvml
            .as_ref()
            .ok()
            .and_then(|s| s.gpus.iter().find(|g| g.bus_id == dev.bdf))
            .cloned();
        gpus.push(Gpu {
            index: 0,
            bdf: dev.bdf,
            minor: proc_gpu
                .and_then(|p| p.minor)
                .or(nvml_gpu.as_ref().and_then(|n| n.minor)),
            uuid: nvml_gpu
                .as_ref()
                .map(|n| n.uuid.clone())
                .filter(|u| !u.is_empty())
                .or_else(|| proc_gpu.and_then(|p| p.uuid.clone())),
            model: nvml_gpu
                .as_ref()
                .map(|n| n.name.clone())
                .filter(|n| !n.is_empty())
                .or_else(|| proc_gpu.and_then(|p| p.model.clone())),
            numa: numa_of(&cpus, dev),
            local_cpus: dev.local_cpus.clone(),
            pci: dev.clone(),
            nvml: nvml_gpu,
        });
    }
    // NVML numbers GPUs in PCI bus order, skipping those it cannot see; a GPU on the bus that
    // NVML lacks keeps a number after NVML's, so NVML's (and Slurm's and CUDA's) stay valid.
    let mut next = gpus
        .iter()
        .filter_map(|g| g.nvml.as_ref().map(|n| n.index + 1))
        .max()
        .unwrap_or(0);
    let nvml_ok = nvml.is_ok();
    for g in gpus.iter_mut() {
        match &g.nvml {
            Some(n) => g.index = n.index,
            None => {
                g.index = next;
                next += 1;
                if nvml_ok {
                    warnings.push(format!(
                        "GPU {} is on the PCI bus but NVML does not list it",
                        g.bdf
                    ));
                }
            }
        }
    }
    gpus.sort_by_key(|g| g.index);
    if let Ok(snap) = &nvml {
        for n in &snap.gpus {
            if !gpus.iter().any(|g| g.bdf == n.bus_id) {
                warnings.push(format!(
                    "NVML lists GPU {} at {} that sysfs does not show",
                    n.index, n.bus_id
                ));
            }
        }
    }

    let mut nics: Vec<Nic> = rdma::scan(host)?
        .into_iter()
        .map(|device| {
            let pci = device.bdf.and_then(|b| pci_devices.get(&b)).cloned();
            Nic {
                name: device.name.clone(),
                bdf: device.bdf,
                numa: pci.as_ref().and_then(|p| numa_of(&cpus, p)),
                role: NicRole::Compute,
                role_reason: String::new(),
                device,
                pci,
            }
        })
        .collect();
    nics.sort_by(|a, b| (a.bdf.is_none(), a.bdf, &a.name).cmp(&(b.bdf.is_none(), b.bdf, &b.name)));

    let mut bridges = BTreeMap::new();
    for dev in gpus
        .iter()
        .map(|g| &g.pci)
        .chain(nics.iter().filter_map(|n| n.pci.as_ref()))
    {
        for b in &dev.chain {
            if let Some(p) = pci_devices.get(b) {
                bridges.insert(*b, p.clone());
            }
        }
    }

    let driver = Driver {
        kernel_module: proc_driver.as_ref().and_then(|d| d.version.clone()),
        nvml: nvml.map(|s| NvmlInfo {
            driver_version: s.driver_version,
            cuda_driver_version: s.cuda_driver_version,
            errors: s.errors,
        }),
    };
    let mut node = Node {
        cpus,
        gpus,
        nics,
        driver,
        bridges,
        warnings,
    };
    classify_nics(&mut node, policy);
    Ok(node)
}

/// Gives each NIC its role: configuration first, then detection. Detected compute NICs are
/// those below the CPU (PIX/PXB) from some GPU, where GPUDirect RDMA works. A NIC that is not is
/// storage only when every GPU already has a NIC on its own switch (a DGX: the root-port NICs
/// carry storage); while some GPU has none, such a NIC is the best that GPU can get and stays a
/// compute NIC (a PCIe box whose NICs hang off a socket, or one where only some GPUs share a
/// switch with a NIC). NICs the configuration excludes count for nothing here.
fn classify_nics(node: &mut Node, policy: &NicPolicy) {
    let excluded: Vec<Option<&String>> = node
        .nics
        .iter()
        .map(|n| policy.exclude.iter().find(|p| n.matches(p)))
        .collect();
    let candidate = |i: usize| excluded[i].is_none() && node.nics[i].pci.is_some();
    let near_gpu: Vec<Option<(u32, Link)>> = node
        .nics
        .iter()
        .map(|n| {
            node.gpus
                .iter()
                .filter_map(|g| node.gpu_nic(g, n).map(|l| (g.index, l)))
                .min_by_key(|(_, l)| *l)
        })
        .collect();
    // The first GPU without a candidate NIC below the CPU, if any.
    let lacking = node.gpus.iter().find(|g| {
        !node
            .nics
            .iter()
            .enumerate()
            .any(|(i, n)| candidate(i) && node.gpu_nic(g, n).is_some_and(|l| l.below_cpu()))
    });
    let any_near = (0..node.nics.len())
        .any(|i| candidate(i) && near_gpu[i].is_some_and(|(_, l)| l.below_cpu()));
    let lacking = lacking.map(|g| g.index);
    for (i, (nic, closest)) in node.nics.iter_mut().zip(near_gpu).enumerate() {
        let (role, reason) = if let Some(p) = excluded[i] {
            (NicRole::Excluded, format!("matches exclude_nics '{p}'"))
        } else if nic.pci.is_none() {
            (NicRole::Excluded, "not a PCI device".to_string())
        } else if !policy.compute.is_empty() {
            match policy.compute.iter().find(|p| nic.matches(p)) {
                Some(p) => (NicRole::Compute, format!("matches compute_nics '{p}'")),
                None => (NicRole::Storage, "not in compute_nics".to_string()),
            }
        } else {
            match (closest, lacking) {
                (Some((g, l)), _) if l.below_cpu() => (NicRole::Compute, format!("{l} to GPU {g}")),
                _ if !any_near => (
                    NicRole::Compute,
                    "no NIC shares a PCIe switch with a GPU".to_string(),
                ),
                (_, Some(g)) => (
                    NicRole::Compute,
                    format!("GPU {g} has no NIC on its PCIe switch"),
                ),
                (_, None) => (
                    NicRole::Storage,
                    "not on a GPU's PCIe switch, and every GPU has a NIC on its own".to_string(),
                ),
            }
        };
        nic.role = role;
        nic.role_reason = reason;
    }
}
