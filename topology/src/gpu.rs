//! NVIDIA GPUs: what the kernel driver shows in procfs (device minor, UUID), and the details only
//! NVML knows (NVLink peers, ECC, retired pages, remapped rows, PCIe generation), behind one
//! trait with two backends: [`Nvml`], which loads `libnvidia-ml.so.1` at run time, and
//! [`Recorded`], a JSON snapshot (what `berth topo nvml` prints) that tests and other machines
//! replay. A node without the driver yields [`GpuUnavailable::NoDriver`] and discovery goes on
//! from sysfs alone.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{Bdf, Host, TopologyError, list_dir, read_attr};

/// What the driver's procfs shows for one GPU (`/proc/driver/nvidia/gpus/<BDF>/information`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcGpu {
    pub bdf: Bdf,
    /// N of `/dev/nvidiaN`.
    pub minor: Option<u32>,
    pub uuid: Option<String>,
    pub model: Option<String>,
}

/// The loaded kernel driver, from /proc/driver/nvidia.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcDriver {
    pub version: Option<String>,
    pub gpus: Vec<ProcGpu>,
}

/// The loaded kernel driver; `None` when no NVIDIA driver is loaded.
pub fn proc_driver(host: &Host) -> Result<Option<ProcDriver>, TopologyError> {
    let dir = host.proc("driver/nvidia");
    if !dir.is_dir() {
        return Ok(None);
    }
    // "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024"
    let version = read_attr(&dir.join("version")).and_then(|v| {
        let line = v.lines().next()?.to_string();
        let after = line.split("Kernel Module").nth(1)?;
        after.split_whitespace().next().map(str::to_string)
    });
    let mut gpus = Vec::new();
    for name in list_dir(&dir.join("gpus"))? {
        let Ok(bdf) = name.parse::<Bdf>() else {
            continue;
        };
        let info = read_attr(&dir.join("gpus").join(&name).join("information")).unwrap_or_default();
        let field = |key: &str| {
            info.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                (k.trim() == key).then(|| v.trim().to_string())
            })
        };
        gpus.push(ProcGpu {
            bdf,
            minor: field("Device Minor").and_then(|m| m.parse().ok()),
            uuid: field("GPU UUID").filter(|u| u.starts_with("GPU-")),
            model: field("Model"),
        });
    }
    Ok(Some(ProcDriver { version, gpus }))
}

/// The character-device majors the NVIDIA driver registered, from `/proc/devices`:
/// (`nvidia-frontend` or `nvidia`, `nvidia-uvm`, `nvidia-caps`).
pub fn proc_majors(host: &Host) -> NvidiaMajors {
    let text = std::fs::read_to_string(host.proc("devices")).unwrap_or_default();
    let mut m = NvidiaMajors::default();
    let mut in_char = false;
    for line in text.lines() {
        if line.starts_with("Character devices") {
            in_char = true;
            continue;
        }
        if line.starts_with("Block devices") {
            in_char = false;
        }
        let mut parts = line.split_whitespace();
        let (Some(num), Some(name)) = (parts.next(), parts.next()) else {
            continue;
        };
        let Ok(num) = num.parse::<u32>() else {
            continue;
        };
        if !in_char {
            continue;
        }
        match name {
            "nvidia-frontend" | "nvidia" => m.frontend = Some(num),
            "nvidia-uvm" => m.uvm = Some(num),
            "nvidia-caps" => m.caps = Some(num),
            _ => {}
        }
    }
    m
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NvidiaMajors {
    pub frontend: Option<u32>,
    pub uvm: Option<u32>,
    pub caps: Option<u32>,
}

/// What is at the far end of an NVLink.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NvLinkRemote {
    Gpu,
    Switch,
    Cpu,
    Unknown,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvLinkInfo {
    pub link: u32,
    pub active: bool,
    pub remote_bus_id: Option<Bdf>,
    pub remote: NvLinkRemote,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ecc {
    pub enabled: bool,
    /// Uncorrectable (double-bit) errors since the driver loaded.
    pub uncorrected_volatile: u64,
    pub corrected_volatile: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemappedRows {
    pub correctable: u64,
    pub uncorrectable: u64,
    /// A remap waits for a GPU reset.
    pub pending: bool,
    /// A remap failed: the GPU needs service.
    pub failure: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PcieState {
    pub generation: Option<u32>,
    pub max_generation: Option<u32>,
    pub width: Option<u32>,
    pub max_width: Option<u32>,
}

/// One GPU as NVML reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvmlGpu {
    pub index: u32,
    pub bus_id: Bdf,
    pub uuid: String,
    pub name: String,
    #[serde(default)]
    pub minor: Option<u32>,
    #[serde(default)]
    pub memory_total_bytes: Option<u64>,
    #[serde(default)]
    pub compute_capability: Option<String>,
    #[serde(default)]
    pub ecc: Option<Ecc>,
    #[serde(default)]
    pub retired_pages_pending: Option<bool>,
    #[serde(default)]
    pub remapped_rows: Option<RemappedRows>,
    #[serde(default)]
    pub pcie: Option<PcieState>,
    #[serde(default)]
    pub nvlinks: Vec<NvLinkInfo>,
}

/// Everything NVML said about the node at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvmlSnapshot {
    pub driver_version: Option<String>,
    /// As NVML encodes it: 12040 is CUDA 12.4.
    pub cuda_driver_version: Option<i32>,
    pub gpus: Vec<NvmlGpu>,
    /// GPUs NVML counts but could not open ("GPU 3: GPU is lost"); the others are listed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<String>,
}

/// Why NVML gave nothing.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "detail", rename_all = "kebab-case")]
pub enum GpuUnavailable {
    /// No driver or no NVML library on this node: a normal state for CPU nodes.
    NoDriver(String),
    /// The driver is there but NVML failed.
    Failed(String),
}

impl std::fmt::Display for GpuUnavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GpuUnavailable::NoDriver(d) => write!(f, "no NVIDIA driver ({d})"),
            GpuUnavailable::Failed(d) => write!(f, "NVML failed: {d}"),
        }
    }
}

/// NVML_NVLINK_MAX_LINKS of the NVML headers (Hopper and Blackwell have 18).
const NVLINK_MAX_LINKS: u32 = 18;

/// A source of GPU details.
pub trait GpuBackend {
    fn snapshot(&self) -> Result<NvmlSnapshot, GpuUnavailable>;
}

/// The live NVML library, loaded at run time from `library` (a name the dynamic loader
/// resolves, or a path).
#[derive(Debug)]
pub struct Nvml {
    pub library: PathBuf,
}

impl Nvml {
    pub fn new(library: impl Into<PathBuf>) -> Self {
        Self {
            library: library.into(),
        }
    }
}

fn nvml_failure(op: &str, e: nvml_wrapper::error::NvmlError) -> GpuUnavailable {
    use nvml_wrapper::error::NvmlError as E;
    match e {
        E::LibloadingError(_) | E::LibraryNotFound | E::DriverNotLoaded => {
            GpuUnavailable::NoDriver(e.to_string())
        }
        other => GpuUnavailable::Failed(format!("{op}: {other}")),
    }
}

impl GpuBackend for Nvml {
    // Long by design: one NVML session, each device's queries in the order of the snapshot's
    // fields, each query's failure handled where it is made.
    fn snapshot(&self) -> Result<NvmlSnapshot, GpuUnavailable> {
        use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError};
        use nvml_wrapper::enum_wrappers::nv_link::IntDeviceType;
        use nvml_wrapper::enums::device::SampleValue;
        use nvml_wrapper::structs::device::FieldId;
        use nvml_wrapper::sys_exports::field_id::{
            NVML_FI_DEV_REMAPPED_COR, NVML_FI_DEV_REMAPPED_FAILURE, NVML_FI_DEV_REMAPPED_PENDING,
            NVML_FI_DEV_REMAPPED_UNC,
        };

        let nvml = nvml_wrapper::Nvml::builder()
            .lib_path(self.library.as_os_str())
            .init()
            .map_err(|e| nvml_failure("initializing NVML", e))?;
        let count = nvml
            .device_count()
            .map_err(|e| nvml_failure("counting GPUs", e))?;
        let mut gpus = Vec::new();
        let mut errors = Vec::new();
        for index in 0..count {
            // One sick GPU must not hide the others: note it and go on.
            let dev = match nvml.device_by_index(index) {
                Ok(d) => d,
                Err(e) => {
                    errors.push(format!("GPU {index}: {e}"));
                    continue;
                }
            };
            let bus_id = match dev.pci_info().map(|p| p.bus_id) {
                Ok(id) => match id.parse::<Bdf>() {
                    Ok(b) => b,
                    Err(e) => {
                        errors.push(format!("GPU {index}: bus id {id}: {e}"));
                        continue;
                    }
                },
                Err(e) => {
                    errors.push(format!("GPU {index}: PCI info: {e}"));
                    continue;
                }
            };
            // Optional details: a GPU or driver that does not support one leaves it out.
            let ecc = dev.is_ecc_enabled().ok().map(|mode| Ecc {
                enabled: mode.currently_enabled,
                uncorrected_volatile: dev
                    .total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
                    .unwrap_or(0),
                corrected_volatile: dev
                    .total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile)
                    .unwrap_or(0),
            });
            let fields = dev
                .field_values_for(&[
                    FieldId(NVML_FI_DEV_REMAPPED_COR),
                    FieldId(NVML_FI_DEV_REMAPPED_UNC),
                    FieldId(NVML_FI_DEV_REMAPPED_PENDING),
                    FieldId(NVML_FI_DEV_REMAPPED_FAILURE),
                ])
                .ok()
                .map(|values| {
                    values
                        .into_iter()
                        .map(|v| match v.ok().and_then(|s| s.value.ok()) {
                            Some(SampleValue::U32(n)) => Some(u64::from(n)),
                            Some(SampleValue::U64(n)) => Some(n),
                            Some(SampleValue::I64(n)) => Some(u64::try_from(n).unwrap_or(0)),
                            _ => None,
                        })
                        .collect::<Vec<_>>()
                });
            let remapped_rows = match fields.as_deref() {
                Some([Some(c), Some(u), Some(p), Some(f)]) => Some(RemappedRows {
                    correctable: *c,
                    uncorrectable: *u,
                    pending: *p != 0,
                    failure: *f != 0,
                }),
                _ => None,
            };
            let mut nvlinks = Vec::new();
            for link in 0..NVLINK_MAX_LINKS {
                let l = dev.link_wrapper_for(link);
                // A link the GPU does not have answers "not supported".
                let Ok(active) = l.is_active() else {
                    continue;
                };
                let remote_bus_id = l
                    .remote_pci_info()
                    .ok()
                    .and_then(|p| p.bus_id.parse::<Bdf>().ok());
                let remote = match l.remote_device_type(link) {
                    Ok(IntDeviceType::Gpu) => NvLinkRemote::Gpu,
                    Ok(IntDeviceType::Switch) => NvLinkRemote::Switch,
                    Ok(IntDeviceType::Ibmnpu) => NvLinkRemote::Cpu,
                    _ => NvLinkRemote::Unknown,
                };
                nvlinks.push(NvLinkInfo {
                    link,
                    active,
                    remote_bus_id,
                    remote,
                });
            }
            gpus.push(NvmlGpu {
                index: dev.index().unwrap_or(index),
                bus_id,
                uuid: dev.uuid().unwrap_or_default(),
                name: dev.name().unwrap_or_default(),
                minor: dev.minor_number().ok(),
                memory_total_bytes: dev.memory_info().ok().map(|m| m.total),
                compute_capability: dev
                    .cuda_compute_capability()
                    .ok()
                    .map(|c| format!("{}.{}", c.major, c.minor)),
                ecc,
                retired_pages_pending: dev.are_pages_pending_retired().ok(),
                remapped_rows,
                pcie: Some(PcieState {
                    generation: dev.current_pcie_link_gen().ok(),
                    max_generation: dev.max_pcie_link_gen().ok(),
                    width: dev.current_pcie_link_width().ok(),
                    max_width: dev.max_pcie_link_width().ok(),
                }),
                nvlinks,
            });
        }
        Ok(NvmlSnapshot {
            driver_version: nvml.sys_driver_version().ok(),
            cuda_driver_version: nvml.sys_cuda_driver_version().ok(),
            gpus,
            errors,
        })
    }
}

/// A recorded snapshot: the JSON `berth topo nvml` prints, or "no driver".
#[derive(Debug)]
pub struct Recorded {
    snapshot: Result<NvmlSnapshot, GpuUnavailable>,
}

impl Recorded {
    pub fn new(snapshot: NvmlSnapshot) -> Self {
        Self {
            snapshot: Ok(snapshot),
        }
    }

    /// A node without the NVIDIA driver.
    pub fn no_driver() -> Self {
        Self {
            snapshot: Err(GpuUnavailable::NoDriver("recorded: no driver".into())),
        }
    }

    pub fn load(path: &Path) -> Result<Self, TopologyError> {
        let text = std::fs::read_to_string(path).map_err(|source| TopologyError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let snapshot =
            serde_json::from_str::<NvmlSnapshot>(&text).map_err(|e| TopologyError::Recording {
                path: path.to_path_buf(),
                what: format!("{e}: expected the JSON `berth topo nvml` prints"),
            })?;
        Ok(Self::new(snapshot))
    }
}

impl GpuBackend for Recorded {
    fn snapshot(&self) -> Result<NvmlSnapshot, GpuUnavailable> {
        self.snapshot.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvml_without_a_driver_reports_no_driver() {
        let err = Nvml::new("libnvidia-ml-berth-test-absent.so.1")
            .snapshot()
            .unwrap_err();
        assert!(matches!(err, GpuUnavailable::NoDriver(_)), "{err:?}");
        assert!(err.to_string().starts_with("no NVIDIA driver"), "{err}");
    }

    #[test]
    fn recordings_round_trip_and_bad_ones_say_what_is_wrong() {
        let snap = NvmlSnapshot {
            driver_version: Some("550.54.15".into()),
            cuda_driver_version: Some(12040),
            gpus: vec![NvmlGpu {
                index: 0,
                bus_id: "0000:1b:00.0".parse().unwrap(),
                uuid: "GPU-0".into(),
                name: "NVIDIA H100 80GB HBM3".into(),
                minor: Some(0),
                memory_total_bytes: None,
                compute_capability: Some("9.0".into()),
                ecc: Some(Ecc::default()),
                retired_pages_pending: Some(false),
                remapped_rows: Some(RemappedRows::default()),
                pcie: None,
                nvlinks: vec![],
            }],
            errors: vec![],
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nvml.json");
        std::fs::write(&path, serde_json::to_string(&snap).unwrap()).unwrap();
        assert_eq!(Recorded::load(&path).unwrap().snapshot().unwrap(), snap);
        std::fs::write(&path, "{\"gpus\": 3}").unwrap();
        let err = Recorded::load(&path).err().unwrap().to_string();
        assert!(err.contains("berth topo nvml"), "{err}");
    }
}
