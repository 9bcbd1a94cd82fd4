//! RDMA devices (InfiniBand and RoCE HCAs) from `/sys/class/infiniband`: their PCI function,
//! ports (state, rate, link layer), network interfaces, and the character devices a process needs
//! to use them (`/dev/infiniband/uverbsN`, `/dev/infiniband/rdma_cm`).

use serde::{Deserialize, Serialize};

use super::{Bdf, Host, TopologyError, list_dir, read_attr};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Port {
    pub num: u32,
    /// "ACTIVE", "DOWN", "INIT", "ARMED" (without the kernel's numeric prefix).
    pub state: String,
    /// "LinkUp", "Disabled", "Polling", ...
    pub phys_state: String,
    /// e.g. "400 Gb/sec (4X NDR)".
    pub rate: String,
    /// "InfiniBand" or "Ethernet" (RoCE).
    pub link_layer: String,
    pub netdev: Option<String>,
}

impl Port {
    pub fn is_active(&self) -> bool {
        self.state == "ACTIVE"
    }
}

/// A character device as `major:minor`, from a sysfs `dev` attribute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DevNum {
    pub major: u32,
    pub minor: u32,
}

impl DevNum {
    pub fn parse(text: &str) -> Option<Self> {
        let (a, b) = text.trim().split_once(':')?;
        Some(Self {
            major: a.parse().ok()?,
            minor: b.parse().ok()?,
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaDevice {
    /// The verbs device name, e.g. `mlx5_0`.
    pub name: String,
    pub bdf: Option<Bdf>,
    pub node_guid: Option<String>,
    /// e.g. "MT4129" (ConnectX-7).
    pub hca_type: Option<String>,
    pub fw_ver: Option<String>,
    pub ports: Vec<Port>,
    pub netdevs: Vec<String>,
    /// `uverbsN` and its device number.
    pub uverbs: Option<(String, DevNum)>,
}

fn strip_state(text: String) -> String {
    // "4: ACTIVE" -> "ACTIVE", "5: LinkUp" -> "LinkUp"
    match text.split_once(':') {
        Some((n, rest)) if n.trim().parse::<u32>().is_ok() => rest.trim().to_string(),
        _ => text,
    }
}

/// The `uverbsN` device of each verbs device, from `/sys/class/infiniband_verbs`.
fn uverbs_devices(host: &Host) -> Result<Vec<(String, String, DevNum)>, TopologyError> {
    let dir = host.sys("class/infiniband_verbs");
    let mut out = Vec::new();
    for name in list_dir(&dir)? {
        if !name.starts_with("uverbs") {
            continue;
        }
        let (Some(ibdev), Some(dev)) = (
            read_attr(&dir.join(&name).join("ibdev")),
            read_attr(&dir.join(&name).join("dev")).and_then(|d| DevNum::parse(&d)),
        ) else {
            continue;
        };
        out.push((ibdev, name, dev));
    }
    Ok(out)
}

/// Every RDMA device, by name.
pub fn scan(host: &Host) -> Result<Vec<RdmaDevice>, TopologyError> {
    let class = host.sys("class/infiniband");
    let uverbs = uverbs_devices(host)?;
    let mut out = Vec::new();
    for name in list_dir(&class)? {
        let dir = class.join(&name);
        let bdf = std::fs::canonicalize(dir.join("device"))
            .ok()
            .and_then(|p| p.file_name()?.to_str()?.parse::<Bdf>().ok());
        let net_dir = dir.join("device/net");
        let netdevs = list_dir(&net_dir)?;
        let mut ports = Vec::new();
        for p in list_dir(&dir.join("ports"))? {
            let Ok(num) = p.parse::<u32>() else {
                continue;
            };
            let pd = dir.join("ports").join(&p);
            let netdev = read_attr(&pd.join("gid_attrs/ndevs/0"))
                .filter(|n| !n.is_empty())
                .or_else(|| {
                    netdevs
                        .iter()
                        .find(|nd| {
                            read_attr(&net_dir.join(nd).join("dev_port"))
                                .and_then(|d| d.parse::<u32>().ok())
                                .map(|d| d + 1)
                                .unwrap_or(1)
                                == num
                        })
                        .cloned()
                });
            ports.push(Port {
                num,
                state: read_attr(&pd.join("state"))
                    .map(strip_state)
                    .unwrap_or_else(|| "UNKNOWN".into()),
                phys_state: read_attr(&pd.join("phys_state"))
                    .map(strip_state)
                    .unwrap_or_else(|| "UNKNOWN".into()),
                rate: read_attr(&pd.join("rate")).unwrap_or_default(),
                link_layer: read_attr(&pd.join("link_layer")).unwrap_or_default(),
                netdev,
            });
        }
        ports.sort_by_key(|p| p.num);
        out.push(RdmaDevice {
            uverbs: uverbs
                .iter()
                .find(|(ib, _, _)| *ib == name)
                .map(|(_, u, d)| (u.clone(), *d)),
            name,
            bdf,
            node_guid: read_attr(&dir.join("node_guid")),
            hca_type: read_attr(&dir.join("hca_type")),
            fw_ver: read_attr(&dir.join("fw_ver")),
            ports,
            netdevs,
        });
    }
    Ok(out)
}

/// `/dev/infiniband/rdma_cm`'s device number, from `/sys/class/misc/rdma_cm/dev`.
pub fn rdma_cm(host: &Host) -> Option<DevNum> {
    read_attr(&host.sys("class/misc/rdma_cm/dev")).and_then(|d| DevNum::parse(&d))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_lose_their_number() {
        assert_eq!(strip_state("4: ACTIVE".into()), "ACTIVE");
        assert_eq!(strip_state("5: LinkUp".into()), "LinkUp");
        assert_eq!(strip_state("ACTIVE".into()), "ACTIVE");
        assert_eq!(
            DevNum::parse("231:192\n"),
            Some(DevNum {
                major: 231,
                minor: 192
            })
        );
        assert_eq!(DevNum::parse("x"), None);
    }
}
