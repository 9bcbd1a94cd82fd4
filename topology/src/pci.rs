//! PCI devices from sysfs (`/sys/bus/pci/devices/*`): identity, NUMA node, local CPUs, link speed
//! and width, and the chain of bridges from the root complex down to the device, which is what
//! distances (PIX/PXB/PHB/NODE/SYS) are computed from.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::{CpuSet, Host, TopologyError, list_dir, read_attr};

/// A PCI address, `domain:bus:device.function`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Bdf {
    pub domain: u32,
    pub bus: u8,
    pub device: u8,
    pub function: u8,
}

impl Bdf {
    /// The address without its function, as the NVIDIA kernel log writes it (`0000:1b:00`).
    pub fn slot(&self) -> String {
        format!("{:04x}:{:02x}:{:02x}", self.domain, self.bus, self.device)
    }
}

impl FromStr for Bdf {
    type Err = crate::TopologyError;

    /// Accepts `0000:1b:00.0`, NVML's `00000000:1B:00.0` and the domain-less `1b:00.0`.
    fn from_str(s: &str) -> Result<Self, crate::TopologyError> {
        let bad = || {
            crate::TopologyError::Value(format!(
                "'{s}' is not a PCI address (domain:bus:device.function)"
            ))
        };
        let (rest, function) = s.trim().rsplit_once('.').ok_or_else(bad)?;
        let parts: Vec<&str> = rest.split(':').collect();
        let (domain, bus, device) = match parts.as_slice() {
            [d, b, dev] => (*d, *b, *dev),
            [b, dev] => ("0", *b, *dev),
            _ => return Err(bad()),
        };
        let hex = |t: &str, max: u32| {
            u32::from_str_radix(t, 16)
                .ok()
                .filter(|v| *v <= max && !t.is_empty() && t.len() <= 8)
                .ok_or_else(bad)
        };
        Ok(Bdf {
            domain: hex(domain, 0xffff_ffff)?,
            bus: u8::try_from(hex(bus, 0xff)?).map_err(|_| bad())?,
            device: u8::try_from(hex(device, 0x1f)?).map_err(|_| bad())?,
            function: u8::try_from(hex(function, 0x7)?).map_err(|_| bad())?,
        })
    }
}

impl fmt::Display for Bdf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

impl Serialize for Bdf {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Bdf {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// Speed and width of a PCIe link; `None` where sysfs has no value (e.g. "Unknown").
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LinkState {
    /// GT/s per lane (2.5, 5, 8, 16, 32, 64).
    pub speed_gts: Option<f32>,
    pub width: Option<u32>,
}

impl fmt::Display for LinkState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.speed_gts {
            Some(s) => write!(f, "{s} GT/s")?,
            None => f.write_str("? GT/s")?,
        }
        match self.width {
            Some(w) => write!(f, " x{w}"),
            None => f.write_str(" x?"),
        }
    }
}

/// PCI base class 0x06 subclass 0x04: a PCI-to-PCI bridge (root and switch ports).
pub const CLASS_BRIDGE: u32 = 0x0604;

/// One PCI function as sysfs shows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PciDevice {
    pub bdf: Bdf,
    /// The 24-bit class code (0x030200 is a 3D controller).
    pub class: u32,
    pub vendor: u16,
    pub device: u16,
    pub subsystem_vendor: Option<u16>,
    pub subsystem_device: Option<u16>,
    /// `None` when the kernel reports -1 (no NUMA information).
    pub numa_node: Option<u32>,
    pub local_cpus: Option<CpuSet>,
    pub current_link: LinkState,
    pub max_link: LinkState,
    /// The sysfs directory above the first bridge, e.g. `pci0000:15` (one per host bridge).
    pub root: String,
    /// The bridges from the root port down to the device's parent.
    pub chain: Vec<Bdf>,
    pub driver: Option<String>,
}

impl PciDevice {
    /// Whether the device is a PCI-to-PCI bridge (a root port or a switch port).
    pub fn is_bridge(&self) -> bool {
        self.class >> 8 == CLASS_BRIDGE
    }

    /// The device's parent bridge, if any.
    pub fn parent(&self) -> Option<Bdf> {
        self.chain.last().copied()
    }
}

/// A 16-bit PCI id (vendor, device); `None` for a value that is not one.
fn id16(v: u32) -> Option<u16> {
    u16::try_from(v).ok()
}

fn hex_attr(dir: &Path, name: &str) -> Option<u32> {
    let text = read_attr(&dir.join(name))?;
    u32::from_str_radix(text.trim_start_matches("0x"), 16).ok()
}

fn parse_speed(text: &str) -> Option<f32> {
    // "32.0 GT/s PCIe", "8 GT/s", "2.5 GT/s PCIe", "Unknown"
    text.split_whitespace()
        .next()?
        .parse::<f32>()
        .ok()
        .filter(|v| *v > 0.0)
}

fn link(dir: &Path, prefix: &str) -> LinkState {
    LinkState {
        speed_gts: read_attr(&dir.join(format!("{prefix}_link_speed")))
            .as_deref()
            .and_then(parse_speed),
        width: read_attr(&dir.join(format!("{prefix}_link_width")))
            .and_then(|w| w.parse().ok())
            .filter(|w| *w > 0),
    }
}

/// Reads one device from its sysfs directory (already resolved through the bus symlink).
pub fn read_device(host: &Host, bdf: Bdf) -> Result<PciDevice, TopologyError> {
    let bus_link = host.sys("bus/pci/devices").join(bdf.to_string());
    let real = std::fs::canonicalize(&bus_link).map_err(|source| TopologyError::Read {
        path: bus_link.clone(),
        source,
    })?;
    let devices_root = std::fs::canonicalize(host.sys("devices")).unwrap_or(host.sys("devices"));
    let rel = real.strip_prefix(&devices_root).unwrap_or(&real);
    let mut root = String::new();
    let mut chain = Vec::new();
    for comp in rel.components() {
        let name = comp.as_os_str().to_string_lossy();
        match name.parse::<Bdf>() {
            Ok(b) if b == bdf => break,
            Ok(b) => chain.push(b),
            // A non-PCI level (the host bridge `pci0000:15`, or a platform/ACPI node) resets
            // the chain: what counts is the PCI path below the last one.
            Err(_) => {
                root = name.to_string();
                chain.clear();
            }
        }
    }
    let dir = real.as_path();
    let numa_node = read_attr(&dir.join("numa_node"))
        .and_then(|n| n.parse::<i64>().ok())
        .and_then(|n| u32::try_from(n).ok());
    let local_cpus = read_attr(&dir.join("local_cpulist"))
        .and_then(|l| CpuSet::parse(&l).ok())
        .or_else(|| read_attr(&dir.join("local_cpus")).and_then(|m| CpuSet::parse_mask(&m).ok()));
    let driver = std::fs::read_link(dir.join("driver"))
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().to_string()));
    Ok(PciDevice {
        bdf,
        class: hex_attr(dir, "class").unwrap_or(0),
        vendor: hex_attr(dir, "vendor").and_then(id16).unwrap_or(0),
        device: hex_attr(dir, "device").and_then(id16).unwrap_or(0),
        subsystem_vendor: hex_attr(dir, "subsystem_vendor").and_then(id16),
        subsystem_device: hex_attr(dir, "subsystem_device").and_then(id16),
        numa_node,
        local_cpus,
        current_link: link(dir, "current"),
        max_link: link(dir, "max"),
        root,
        chain,
        driver,
    })
}

/// Every PCI function of the host, by address. A host without PCI yields an empty map.
pub fn scan(host: &Host) -> Result<BTreeMap<Bdf, PciDevice>, TopologyError> {
    let mut out = BTreeMap::new();
    for name in list_dir(&host.sys("bus/pci/devices"))? {
        let Ok(bdf) = name.parse::<Bdf>() else {
            continue;
        };
        match read_device(host, bdf) {
            Ok(d) => {
                out.insert(bdf, d);
            }
            // Unplugged while being read: it is gone, not an error.
            Err(TopologyError::Read { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_in_every_spelling() {
        let b: Bdf = "0000:1b:00.0".parse().unwrap();
        assert_eq!(
            b,
            Bdf {
                domain: 0,
                bus: 0x1b,
                device: 0,
                function: 0
            }
        );
        assert_eq!("00000000:1B:00.0".parse::<Bdf>().unwrap(), b);
        assert_eq!("1b:00.0".parse::<Bdf>().unwrap(), b);
        assert_eq!(b.to_string(), "0000:1b:00.0");
        assert_eq!(b.slot(), "0000:1b:00");
        for bad in [
            "",
            "1b:00",
            "0000:1g:00.0",
            "0000:1b:20.0",
            "0000:1b:00.8",
            "x.0",
        ] {
            assert!(bad.parse::<Bdf>().is_err(), "{bad}");
        }
    }

    #[test]
    fn speeds() {
        assert_eq!(parse_speed("32.0 GT/s PCIe"), Some(32.0));
        assert_eq!(parse_speed("2.5 GT/s"), Some(2.5));
        assert_eq!(parse_speed("Unknown"), None);
    }
}
