//! Builds fixture host trees (sysfs, procfs, /dev stand-ins, loader cache) in a tempdir, the way
//! the kernel lays them out: PCI devices nested under their bridges with `/sys/bus/pci/devices`
//! symlinks, RDMA class devices linking back to their PCI function, CPU and NUMA directories,
//! and the NVIDIA driver's procfs. Four GPU layouts and a CPU node are defined here so tests
//! show nothing is hard-coded to one machine.

use std::collections::BTreeMap;
use std::path::Path;

use super::Host;
use super::gpu::{Ecc, NvLinkInfo, NvLinkRemote, NvmlGpu, NvmlSnapshot, PcieState, RemappedRows};
use super::pci::Bdf;

#[derive(Debug)]
pub struct Fixture {
    pub dir: tempfile::TempDir,
    /// Each PCI device's directory relative to sys/devices.
    paths: BTreeMap<Bdf, String>,
    /// The NUMA node of each host bridge (`pci0000:15`).
    roots: BTreeMap<String, i32>,
    /// CPUs of each NUMA node, for local_cpulist.
    node_cpus: BTreeMap<i32, String>,
}

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

fn symlink(target: &str, link: &Path) {
    std::fs::create_dir_all(link.parent().unwrap()).unwrap();
    let _ = std::fs::remove_file(link);
    std::os::unix::fs::symlink(target, link).unwrap();
}

/// Attributes of a PCI function.
#[derive(Clone, Copy, Debug)]
pub struct Pci {
    pub class: u32,
    pub vendor: u16,
    pub device: u16,
    /// GT/s and width, current and max.
    pub link: (f32, u32),
    pub max: (f32, u32),
}

pub const BRIDGE: Pci = Pci {
    class: 0x060400,
    vendor: 0x1000,
    device: 0xc030,
    link: (32.0, 16),
    max: (32.0, 16),
};
pub const H100: Pci = Pci {
    class: 0x030200,
    vendor: 0x10de,
    device: 0x2330,
    link: (32.0, 16),
    max: (32.0, 16),
};
pub const A100: Pci = Pci {
    class: 0x030200,
    vendor: 0x10de,
    device: 0x20b5,
    link: (16.0, 16),
    max: (16.0, 16),
};
pub const CX7: Pci = Pci {
    class: 0x020700,
    vendor: 0x15b3,
    device: 0x1021,
    link: (32.0, 16),
    max: (32.0, 16),
};
pub const CX6: Pci = Pci {
    class: 0x020700,
    vendor: 0x15b3,
    device: 0x101b,
    link: (16.0, 16),
    max: (16.0, 16),
};
pub const ETH: Pci = Pci {
    class: 0x020000,
    vendor: 0x8086,
    device: 0x1533,
    link: (2.5, 1),
    max: (2.5, 1),
};
pub const NVSWITCH: Pci = Pci {
    class: 0x068000,
    vendor: 0x10de,
    device: 0x22a3,
    link: (8.0, 2),
    max: (8.0, 2),
};

/// One RDMA port: state, rate, link layer.
pub type PortSpec = (&'static str, &'static str, &'static str);
pub const NDR: PortSpec = ("4: ACTIVE", "400 Gb/sec (4X NDR)", "InfiniBand");
pub const HDR: PortSpec = ("4: ACTIVE", "200 Gb/sec (4X HDR)", "InfiniBand");
pub const ETH200: PortSpec = ("4: ACTIVE", "200 Gb/sec (4X HDR)", "Ethernet");
pub const ETH25: PortSpec = ("4: ACTIVE", "25 Gb/sec (1X EDR)", "Ethernet");

impl Default for Fixture {
    fn default() -> Self {
        Self::new()
    }
}

impl Fixture {
    pub fn new() -> Self {
        let f = Self {
            // A tmpfs when there is one: fixtures are thousands of small files.
            dir: tempfile::tempdir_in("/dev/shm")
                .or_else(|_| tempfile::tempdir())
                .unwrap(),
            paths: BTreeMap::new(),
            roots: BTreeMap::new(),
            node_cpus: BTreeMap::new(),
        };
        std::fs::create_dir_all(f.root().join("sys/devices")).unwrap();
        std::fs::create_dir_all(f.root().join("sys/bus/pci/devices")).unwrap();
        std::fs::create_dir_all(f.root().join("proc")).unwrap();
        std::fs::create_dir_all(f.root().join("dev")).unwrap();
        f
    }

    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    pub fn host(&self) -> Host {
        Host::new(self.root())
    }

    pub fn write(&self, rel: &str, text: &str) {
        write(&self.root().join(rel), text);
    }

    /// CPUs: `nodes[i]` is node i's CPU list; `siblings(cpu)` its core's threads;
    /// `package(cpu)` its socket. Distances are 10 local, 21 remote.
    pub fn cpus(
        &mut self,
        nodes: &[&str],
        siblings: &dyn Fn(u32) -> String,
        package: &dyn Fn(u32) -> u32,
    ) {
        let mut all = super::CpuSet::new();
        for (i, list) in nodes.iter().enumerate() {
            let set = super::CpuSet::parse(list).unwrap();
            all = all.union(&set);
            let dist: Vec<String> = (0..nodes.len())
                .map(|j| if i == j { "10" } else { "21" }.to_string())
                .collect();
            self.write(
                &format!("sys/devices/system/node/node{i}/cpulist"),
                &format!("{list}\n"),
            );
            self.write(
                &format!("sys/devices/system/node/node{i}/distance"),
                &format!("{}\n", dist.join(" ")),
            );
            self.node_cpus
                .insert(i32::try_from(i).unwrap(), list.to_string());
        }
        self.write(
            "sys/devices/system/node/online",
            &format!("0-{}\n", nodes.len() - 1),
        );
        self.write("sys/devices/system/cpu/online", &format!("{all}\n"));
        for cpu in all.iter() {
            let t = format!("sys/devices/system/cpu/cpu{cpu}/topology");
            self.write(
                &format!("{t}/thread_siblings_list"),
                &format!("{}\n", siblings(cpu)),
            );
            self.write(
                &format!("{t}/physical_package_id"),
                &format!("{}\n", package(cpu)),
            );
        }
    }

    /// A host bridge `pci<domain>:<bus>` on NUMA node `numa`.
    pub fn root_complex(&mut self, name: &str, numa: i32) {
        std::fs::create_dir_all(self.root().join("sys/devices").join(name)).unwrap();
        self.roots.insert(name.to_string(), numa);
    }

    /// A PCI function at `path` (`pci0000:15/0000:15:01.0/.../0000:18:00.0`, relative to
    /// sys/devices). Missing bridges on the way are created as PCIe switch ports.
    pub fn pci(&mut self, path: &str, attrs: Pci) -> Bdf {
        let parts: Vec<&str> = path.split('/').collect();
        let root = parts[0];
        let numa = *self.roots.get(root).unwrap_or(&-1);
        for i in 1..parts.len() {
            let bdf: Bdf = parts[i].parse().unwrap();
            if self.paths.contains_key(&bdf) {
                continue;
            }
            let this = if i == parts.len() - 1 { attrs } else { BRIDGE };
            let rel = parts[..=i].join("/");
            let dir = self.root().join("sys/devices").join(&rel);
            std::fs::create_dir_all(&dir).unwrap();
            let w = |name: &str, text: String| write(&dir.join(name), &format!("{text}\n"));
            w("class", format!("0x{:06x}", this.class));
            w("vendor", format!("0x{:04x}", this.vendor));
            w("device", format!("0x{:04x}", this.device));
            w("subsystem_vendor", format!("0x{:04x}", this.vendor));
            w("subsystem_device", "0x0000".into());
            w("numa_node", numa.to_string());
            if let Some(cpus) = self.node_cpus.get(&numa) {
                w("local_cpulist", cpus.clone());
            }
            w(
                "current_link_speed",
                format!("{:.1} GT/s PCIe", this.link.0),
            );
            w("current_link_width", this.link.1.to_string());
            w("max_link_speed", format!("{:.1} GT/s PCIe", this.max.0));
            w("max_link_width", this.max.1.to_string());
            symlink(
                &format!("../../../devices/{rel}"),
                &self.root().join("sys/bus/pci/devices").join(parts[i]),
            );
            self.paths.insert(bdf, rel);
        }
        path.rsplit('/').next().unwrap().parse().unwrap()
    }

    /// Rewrites an attribute of a PCI function (a degraded link, ...).
    pub fn pci_attr(&self, bdf: Bdf, name: &str, text: &str) {
        let rel = &self.paths[&bdf];
        self.write(&format!("sys/devices/{rel}/{name}"), &format!("{text}\n"));
    }

    /// An RDMA device on PCI function `bdf`, with `netdev` (port i gets `netdev` for a single
    /// port) and `/dev/infiniband/uverbs<uverbs>` = 231:(192+uverbs).
    pub fn rdma(&mut self, name: &str, bdf: Bdf, ports: &[PortSpec], netdev: &str, uverbs: u32) {
        let pci_rel = self.paths[&bdf].clone();
        let ib_rel = format!("{pci_rel}/infiniband/{name}");
        let ib = format!("sys/devices/{ib_rel}");
        self.write(
            &format!("{ib}/node_guid"),
            &format!("b83f:d203:00{:02x}:{:04x}\n", bdf.bus, uverbs),
        );
        self.write(&format!("{ib}/hca_type"), "MT4129\n");
        self.write(&format!("{ib}/fw_ver"), "28.39.1002\n");
        for (i, (state, rate, layer)) in ports.iter().enumerate() {
            let p = format!("{ib}/ports/{}", i + 1);
            self.write(&format!("{p}/state"), &format!("{state}\n"));
            let phys = if state.contains("ACTIVE") {
                "5: LinkUp"
            } else {
                "3: Disabled"
            };
            self.write(&format!("{p}/phys_state"), &format!("{phys}\n"));
            self.write(&format!("{p}/rate"), &format!("{rate}\n"));
            self.write(&format!("{p}/link_layer"), &format!("{layer}\n"));
        }
        symlink("../..", &self.root().join(&ib).join("device"));
        symlink(
            &format!("../../devices/{ib_rel}"),
            &self.root().join("sys/class/infiniband").join(name),
        );
        self.write(
            &format!("sys/devices/{pci_rel}/net/{netdev}/dev_port"),
            "0\n",
        );
        let uv = format!("sys/class/infiniband_verbs/uverbs{uverbs}");
        self.write(&format!("{uv}/ibdev"), &format!("{name}\n"));
        self.write(&format!("{uv}/dev"), &format!("231:{}\n", 192 + uverbs));
    }

    /// The NVIDIA kernel driver with `gpus` as (PCI function, device minor, UUID).
    pub fn nvidia_driver(&self, gpus: &[(Bdf, u32, String)], model: &str) {
        self.write(
            "proc/driver/nvidia/version",
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n",
        );
        for (bdf, minor, uuid) in gpus {
            self.write(
                &format!("proc/driver/nvidia/gpus/{bdf}/information"),
                &format!(
                    "Model: \t\t {model}\nIRQ:   \t\t 156\nGPU UUID: \t {uuid}\nVideo BIOS: \t 96.00.74.00.01\nBus Type: \t PCIe\nDMA Size: \t 52 bits\nDMA Mask: \t 0xfffffffffffff\nBus Location: \t {bdf}\nDevice Minor: \t {minor}\nGPU Excluded:\t No\n"
                ),
            );
        }
        self.write(
            "proc/devices",
            "Character devices:\n  1 mem\n 10 misc\n195 nvidia-frontend\n231 infiniband_verbs\n234 nvidia-caps\n235 nvidia-uvm\n\nBlock devices:\n  8 sd\n",
        );
    }

    pub fn rdma_cm(&self) {
        self.write("sys/class/misc/rdma_cm/dev", "10:58\n");
    }

    /// The NVIDIA driver's user-space files: a host ld.so.cache listing `libs` as (name, path,
    /// the file the path links to, if it is a symlink; the flags are the native ones unless
    /// the name ends in `:32`), the library files, and tools in /usr/bin.
    pub fn driver_files(&self, libs: &[(&str, &str, Option<&str>)], bins: &[&str]) {
        let mut entries = Vec::new();
        for (key, path, target) in libs {
            let file = self.root().join(path.trim_start_matches('/'));
            std::fs::create_dir_all(file.parent().unwrap()).unwrap();
            match target {
                Some(t) => {
                    write(&file.with_file_name(t), &format!("stand-in {t}\n"));
                    symlink(t, &file);
                }
                None => write(&file, &format!("stand-in {key}\n")),
            }
            entries.push(match key.strip_suffix(":32") {
                Some(k) => super::ldcache::Entry {
                    flags: super::ldcache::FLAG_ELF_LIBC6,
                    ..super::ldcache::Entry::native(k, path)
                },
                None => super::ldcache::Entry::native(key, path),
            });
        }
        std::fs::create_dir_all(self.root().join("etc")).unwrap();
        std::fs::write(
            self.root().join("etc/ld.so.cache"),
            super::ldcache::write(&entries),
        )
        .unwrap();
        for b in bins {
            self.write(&format!("usr/bin/{b}"), "#!/bin/sh\n");
        }
    }

    /// The driver files of a 550.54.15 install, as Debian lays them out.
    pub fn nvidia_files(&self) {
        const L: &str = "/usr/lib/x86_64-linux-gnu";
        self.driver_files(
            &[
                (
                    "libcuda.so.1",
                    &format!("{L}/libcuda.so.1"),
                    Some("libcuda.so.550.54.15"),
                ),
                (
                    "libcuda.so",
                    &format!("{L}/libcuda.so"),
                    Some("libcuda.so.1"),
                ),
                (
                    "libnvidia-ml.so.1",
                    &format!("{L}/libnvidia-ml.so.1"),
                    Some("libnvidia-ml.so.550.54.15"),
                ),
                (
                    "libnvidia-ptxjitcompiler.so.1",
                    &format!("{L}/libnvidia-ptxjitcompiler.so.1"),
                    Some("libnvidia-ptxjitcompiler.so.550.54.15"),
                ),
                (
                    "libcuda.so.1:32",
                    "/usr/lib/i386-linux-gnu/libcuda.so.1",
                    None,
                ),
                ("libz.so.1", &format!("{L}/libz.so.1"), None),
                (
                    "libcudart.so.12",
                    "/usr/local/cuda/lib64/libcudart.so.12",
                    None,
                ),
            ],
            &["nvidia-smi", "nvidia-debugdump"],
        );
    }
}

/// A fixture's index as the u32 the topology types take (fixtures have a handful of devices).
fn idx(i: usize) -> u32 {
    u32::try_from(i).unwrap()
}

pub fn uuid(i: u32) -> String {
    format!("GPU-{i:08x}-0000-4000-8000-00000000000{i:x}")
}

fn nvml_gpu(
    index: u32,
    bus: Bdf,
    name: &str,
    nvlinks: Vec<NvLinkInfo>,
    pcie: (u32, u32),
) -> NvmlGpu {
    NvmlGpu {
        index,
        bus_id: bus,
        uuid: uuid(index),
        name: name.into(),
        minor: Some(index),
        memory_total_bytes: Some(85_520_809_984),
        compute_capability: Some("9.0".into()),
        ecc: Some(Ecc {
            enabled: true,
            uncorrected_volatile: 0,
            corrected_volatile: 0,
        }),
        retired_pages_pending: Some(false),
        remapped_rows: Some(RemappedRows::default()),
        pcie: Some(PcieState {
            generation: Some(pcie.0),
            max_generation: Some(pcie.0),
            width: Some(pcie.1),
            max_width: Some(pcie.1),
        }),
        nvlinks,
    }
}

pub fn bdf(s: &str) -> Bdf {
    s.parse().unwrap()
}

/// A DGX H100-like node: 2 sockets of 56 cores × 2 threads (NUMA 0: 0-55,112-167; NUMA 1:
/// 56-111,168-223); 8 H100 GPUs, each with a ConnectX-7 on its PCIe switch three buses below it
/// (GPU 1b ↔ NIC 18 ... GPU df ↔ NIC dc); two dual-port storage NICs on root ports (mlx5_1/2 on
/// socket 0, mlx5_7/8 on socket 1); an Ethernet management NIC without RDMA; NVSwitches.
pub fn dgx_h100() -> (Fixture, NvmlSnapshot) {
    let mut f = Fixture::new();
    f.cpus(
        &["0-55,112-167", "56-111,168-223"],
        &|c| format!("{},{}", c % 112, c % 112 + 112),
        &|c| u32::from((c % 112) >= 56),
    );
    let gpu_buses: [u8; 8] = [0x1b, 0x43, 0x52, 0x61, 0x9d, 0xc3, 0xd1, 0xdf];
    let nic_names = [
        "mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_9", "mlx5_10", "mlx5_11",
    ];
    let mut gpus = Vec::new();
    let mut nvml = Vec::new();
    let switches: Vec<Bdf> = (0..4)
        .map(|i| bdf(&format!("0000:0{}:00.0", i + 5)))
        .collect();
    f.root_complex("pci0000:00", 0);
    f.pci("pci0000:00/0000:00:1c.0/0000:01:00.0", ETH);
    for s in &switches {
        f.pci(&format!("pci0000:00/0000:00:04.0/{s}"), NVSWITCH);
    }
    for (i, &b) in gpu_buses.iter().enumerate() {
        let r = b - 6;
        let numa = i32::from(i >= 4);
        let rc = format!("pci0000:{r:02x}");
        f.root_complex(&rc, numa);
        let rp = format!("{rc}/0000:{r:02x}:01.0/0000:{:02x}:00.0", r + 1);
        let nic = f.pci(
            &format!("{rp}/0000:{:02x}:00.0/0000:{:02x}:00.0", r + 2, r + 3),
            CX7,
        );
        let gpu = f.pci(
            &format!(
                "{rp}/0000:{:02x}:01.0/0000:{:02x}:00.0/0000:{:02x}:00.0/0000:{b:02x}:00.0",
                r + 2,
                r + 4,
                r + 5
            ),
            H100,
        );
        let uverbs: u32 = nic_names[i][5..].parse().unwrap();
        f.rdma(
            nic_names[i],
            nic,
            &[NDR],
            &format!("ibp{}s0", r + 3),
            uverbs,
        );
        gpus.push((gpu, idx(i), uuid(idx(i))));
        let links = (0..18)
            .map(|l| NvLinkInfo {
                link: l,
                active: true,
                remote_bus_id: Some(switches[l as usize % 4]),
                remote: NvLinkRemote::Switch,
            })
            .collect();
        nvml.push(nvml_gpu(
            idx(i),
            gpu,
            "NVIDIA H100 80GB HBM3",
            links,
            (5, 16),
        ));
    }
    for (rc, bus, numa, names) in [
        ("pci0000:29", 0x2a, 0, ["mlx5_1", "mlx5_2"]),
        ("pci0000:aa", 0xab, 1, ["mlx5_7", "mlx5_8"]),
    ] {
        f.root_complex(rc, numa);
        for (func, name) in names.iter().enumerate() {
            let nic = f.pci(
                &format!("{rc}/0000:{:02x}:01.0/0000:{bus:02x}:00.{func}", bus - 1),
                CX7,
            );
            let uverbs: u32 = name[5..].parse().unwrap();
            f.rdma(
                name,
                nic,
                &[ETH200],
                &format!("enp{bus}s0f{func}np{func}"),
                uverbs,
            );
        }
    }
    f.nvidia_driver(&gpus, "NVIDIA H100 80GB HBM3");
    f.rdma_cm();
    (
        f,
        NvmlSnapshot {
            driver_version: Some("550.54.15".into()),
            cuda_driver_version: Some(12040),
            gpus: nvml,
            errors: vec![],
        },
    )
}

/// A PCIe box where every NIC is PIX with its GPUs: two sockets of 16 cores without SMT
/// (0-15, 16-31), each with one PCIe switch holding two A100s and one ConnectX-6; the GPU pairs
/// are joined by NVLink bridges (12 links).
pub fn pix_box() -> (Fixture, NvmlSnapshot) {
    let mut f = Fixture::new();
    f.cpus(&["0-15", "16-31"], &|c| c.to_string(), &|c| {
        u32::from(c >= 16)
    });
    let mut gpus = Vec::new();
    let mut buses = Vec::new();
    for (numa, r, nic_name) in [(0, 0x10u8, "mlx5_0"), (1, 0x80u8, "mlx5_1")] {
        let rc = format!("pci0000:{r:02x}");
        f.root_complex(&rc, numa);
        let sw = format!("{rc}/0000:{r:02x}:01.0/0000:{:02x}:00.0", r + 1);
        for d in 0..2u8 {
            let g = f.pci(
                &format!("{sw}/0000:{:02x}:0{d}.0/0000:{:02x}:00.0", r + 2, r + 3 + d),
                A100,
            );
            buses.push(g);
        }
        let nic = f.pci(
            &format!("{sw}/0000:{:02x}:02.0/0000:{:02x}:00.0", r + 2, r + 5),
            CX6,
        );
        f.rdma(
            nic_name,
            nic,
            &[HDR],
            &format!("ibp{}s0", r + 5),
            u32::try_from(numa).unwrap(),
        );
    }
    let mut nvml = Vec::new();
    for (i, &b) in buses.iter().enumerate() {
        gpus.push((b, idx(i), uuid(idx(i))));
        let peer = buses[i ^ 1];
        let links = (0..12)
            .map(|l| NvLinkInfo {
                link: l,
                active: true,
                remote_bus_id: Some(peer),
                remote: NvLinkRemote::Gpu,
            })
            .collect();
        nvml.push(nvml_gpu(idx(i), b, "NVIDIA A100 80GB PCIe", links, (4, 16)));
    }
    f.nvidia_driver(&gpus, "NVIDIA A100 80GB PCIe");
    f.rdma_cm();
    (
        f,
        NvmlSnapshot {
            driver_version: Some("550.54.15".into()),
            cuda_driver_version: Some(12040),
            gpus: nvml,
            errors: vec![],
        },
    )
}

/// A 4-GPU PCIe box with its NICs on one socket: two sockets of 8 cores × 2 threads numbered
/// side by side (core k = CPUs 2k, 2k+1); each GPU on its own root port (GPUs 0, 1 on socket 0,
/// GPUs 2, 3 on socket 1) with device minors out of bus order (2, 3, 0, 1); two InfiniBand NICs
/// on socket 0 next to GPUs 0 and 1 (PHB), and a RoCE management NIC (`eno1np0`) on socket 0.
/// The driver's procfs is there but NVML is not (no recording).
pub fn pcie_box() -> Fixture {
    let mut f = Fixture::new();
    f.cpus(
        &["0-15", "16-31"],
        &|c| format!("{},{}", c & !1, c | 1),
        &|c| u32::from(c >= 16),
    );
    let mut gpus = Vec::new();
    let minors = [2, 3, 0, 1];
    for (i, r) in [0x00u8, 0x40, 0x80, 0xc0].into_iter().enumerate() {
        let rc = format!("pci0000:{r:02x}");
        f.root_complex(&rc, i32::from(i >= 2));
        let g = f.pci(
            &format!("{rc}/0000:{r:02x}:01.0/0000:{:02x}:00.0", r + 1),
            A100,
        );
        gpus.push((g, minors[i], uuid(idx(i))));
    }
    let ib0 = f.pci("pci0000:00/0000:00:02.0/0000:02:00.0", CX6);
    f.rdma("mlx5_0", ib0, &[HDR], "ibp2s0", 0);
    let ib1 = f.pci("pci0000:40/0000:40:02.0/0000:42:00.0", CX6);
    f.rdma("mlx5_1", ib1, &[HDR], "ibp66s0", 1);
    let mgmt = f.pci("pci0000:00/0000:00:03.0/0000:03:00.0", CX6);
    f.rdma("mlx5_2", mgmt, &[ETH25], "eno1np0", 2);
    f.nvidia_driver(&gpus, "NVIDIA A100 80GB PCIe");
    f.rdma_cm();
    f
}

/// A node where only some GPUs share a switch with a NIC: two sockets of 16 cores × 2 threads
/// (NUMA 0: 0-15,32-47; NUMA 1: 16-31,48-63). Socket 0 has one PCIe switch holding GPUs 0 and
/// 1 and an InfiniBand ConnectX-7 (`mlx5_0`, PIX with both), plus a RoCE storage NIC
/// (`mlx5_1`, `ens3np0`) on a root port of its own; socket 1 has GPUs 2 and 3 and a second
/// InfiniBand ConnectX-7 (`mlx5_2`) each on a root port of the same host bridge (PHB). No NVML.
pub fn mixed_box() -> Fixture {
    let mut f = Fixture::new();
    f.cpus(
        &["0-15,32-47", "16-31,48-63"],
        &|c| format!("{},{}", c % 32, c % 32 + 32),
        &|c| u32::from((c % 32) >= 16),
    );
    f.root_complex("pci0000:00", 0);
    let sw = "pci0000:00/0000:00:01.0/0000:01:00.0";
    let g0 = f.pci(&format!("{sw}/0000:02:00.0/0000:03:00.0"), A100);
    let g1 = f.pci(&format!("{sw}/0000:02:01.0/0000:04:00.0"), A100);
    let ib0 = f.pci(&format!("{sw}/0000:02:02.0/0000:05:00.0"), CX7);
    f.rdma("mlx5_0", ib0, &[NDR], "ibp5s0", 0);
    let storage = f.pci("pci0000:00/0000:00:03.0/0000:06:00.0", CX6);
    f.rdma("mlx5_1", storage, &[ETH200], "ens3np0", 1);
    f.root_complex("pci0000:80", 1);
    let g2 = f.pci("pci0000:80/0000:80:01.0/0000:81:00.0", A100);
    let g3 = f.pci("pci0000:80/0000:80:02.0/0000:82:00.0", A100);
    let ib1 = f.pci("pci0000:80/0000:80:03.0/0000:83:00.0", CX7);
    f.rdma("mlx5_2", ib1, &[NDR], "ibp131s0", 2);
    let gpus: Vec<(Bdf, u32, String)> = [g0, g1, g2, g3]
        .into_iter()
        .enumerate()
        .map(|(i, b)| (b, idx(i), uuid(idx(i))))
        .collect();
    f.nvidia_driver(&gpus, "NVIDIA A100 80GB PCIe");
    f.rdma_cm();
    f
}

/// A CPU node: two NUMA nodes of 4 cores × 2 threads (0-3,8-11 and 4-7,12-15), one InfiniBand
/// NIC on node 1, no GPU and no NVIDIA driver.
pub fn cpu_node() -> Fixture {
    let mut f = Fixture::new();
    f.cpus(
        &["0-3,8-11", "4-7,12-15"],
        &|c| format!("{},{}", c % 8, c % 8 + 8),
        &|c| u32::from(c % 8 >= 4),
    );
    f.root_complex("pci0000:00", 0);
    f.pci("pci0000:00/0000:00:1f.6", ETH);
    f.root_complex("pci0000:80", 1);
    let nic = f.pci("pci0000:80/0000:80:01.0/0000:81:00.0", CX6);
    f.rdma("mlx5_0", nic, &[HDR], "ibp129s0", 0);
    f.rdma_cm();
    f
}

/// The DGX H100-like fixture and the node berth discovers on it (default NIC policy).
pub fn dgx_h100_node() -> (Fixture, super::node::Node) {
    let (f, snap) = dgx_h100();
    let node = super::node::discover(
        &f.host(),
        &super::gpu::Recorded::new(snap),
        &super::node::NicPolicy::default(),
    )
    .expect("the DGX fixture is a valid node");
    (f, node)
}
