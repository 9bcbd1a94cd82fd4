//! The Container Device Interface: device specs (JSON or YAML, cdiVersion 0.5.0 to 1.1.0) from
//! /etc/cdi and /var/run/cdi, resolved by fully qualified name (`vendor.com/class=name`), their
//! containerEdits applied to an OCI Spec, and `berth cdi generate`'s specs for the node's GPUs
//! and HCAs.
//!
//! Hooks are recorded in the Spec's `hooks` as the spec asks; whether they run is the runtime's
//! business (berth's runtime does not run OCI hooks yet, and [`Applied`] says how many it got).

use std::collections::BTreeMap;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use oci_spec::runtime::{
    HookBuilder, LinuxBuilder, LinuxDeviceBuilder, LinuxDeviceCgroupBuilder, LinuxDeviceType,
    MountBuilder, Spec,
};
use serde::{Deserialize, Serialize};

use super::inject::{self, DriverFiles};
use super::node::{NicRole, Node};
use super::{Host, TopologyError};

/// The spec versions berth reads.
pub const VERSIONS: [&str; 6] = ["0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0"];
/// The version berth writes: the oldest that has everything it uses, so most tools read it.
pub const WRITE_VERSION: &str = "0.5.0";

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CdiSpec {
    pub cdi_version: String,
    pub kind: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    pub devices: Vec<Device>,
    #[serde(default, skip_serializing_if = "ContainerEdits::is_empty")]
    pub container_edits: ContainerEdits,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Device {
    pub name: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    #[serde(default)]
    pub container_edits: ContainerEdits,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerEdits {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hooks: Vec<Hook>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub additional_gids: Vec<u32>,
    /// Not supported by berth: a device that needs it is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intel_rdt: Option<serde_json::Value>,
    /// Not supported by berth: a device that needs it is refused.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub net_devices: Vec<serde_json::Value>,
}

impl ContainerEdits {
    pub fn is_empty(&self) -> bool {
        self == &ContainerEdits::default()
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNode {
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub typ: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub major: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_mode: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permissions: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Hook {
    pub hook_name: String,
    pub path: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<i64>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Mount {
    pub host_path: String,
    pub container_path: String,
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub typ: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}

fn name_ok(s: &str, extra: &[char]) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c) || extra.contains(&c))
}

/// Whether `s` is a fully qualified CDI device name, `vendor.com/class=name`.
pub fn is_qualified(s: &str) -> bool {
    split_name(s).is_some()
}

/// `vendor.com/class=name` as (kind, name).
pub fn split_name(s: &str) -> Option<(&str, &str)> {
    let (kind, name) = s.split_once('=')?;
    let (vendor, class) = kind.split_once('/')?;
    (name_ok(vendor, &[]) && name_ok(class, &[]) && name_ok(name, &[':'])).then_some((kind, name))
}

impl CdiSpec {
    /// Parses JSON or YAML (JSON is YAML, but its errors read better from the JSON parser).
    pub fn parse(text: &str, path: &Path) -> Result<Self, TopologyError> {
        let err = |what: String| TopologyError::CdiSpec {
            path: path.to_path_buf(),
            what,
        };
        let spec: CdiSpec = if path.extension().is_some_and(|e| e == "json") {
            serde_json::from_str(text).map_err(|e| err(e.to_string()))?
        } else {
            serde_norway::from_str(text).map_err(|e| err(e.to_string()))?
        };
        spec.validate().map_err(|e| err(e.to_string()))?;
        Ok(spec)
    }

    fn validate(&self) -> Result<(), TopologyError> {
        if !VERSIONS.contains(&self.cdi_version.as_str()) {
            return Err(TopologyError::Value(format!(
                "cdiVersion '{}' is not supported: berth reads {} to {}",
                self.cdi_version,
                VERSIONS[0],
                VERSIONS[VERSIONS.len() - 1]
            )));
        }
        if !self
            .kind
            .split_once('/')
            .is_some_and(|(v, c)| name_ok(v, &[]) && name_ok(c, &[]))
        {
            return Err(TopologyError::Value(format!(
                "kind '{}' is not vendor.com/class",
                self.kind
            )));
        }
        let mut seen = Vec::new();
        for d in &self.devices {
            if !name_ok(&d.name, &[':']) {
                return Err(TopologyError::Value(format!(
                    "device name '{}' is invalid",
                    d.name
                )));
            }
            if seen.contains(&&d.name) {
                return Err(TopologyError::Value(format!(
                    "device '{}' is defined twice",
                    d.name
                )));
            }
            seen.push(&d.name);
            d.container_edits
                .validate()
                .map_err(|e| TopologyError::Value(format!("device '{}': {e}", d.name)))?;
        }
        self.container_edits.validate()
    }
}

impl ContainerEdits {
    fn validate(&self) -> Result<(), TopologyError> {
        for e in &self.env {
            if e.split_once('=').is_none_or(|(k, _)| k.is_empty()) {
                return Err(TopologyError::Value(format!("env '{e}' is not KEY=VALUE")));
            }
        }
        for d in &self.device_nodes {
            if !d.path.starts_with('/') {
                return Err(TopologyError::Value(format!(
                    "device node path '{}' is not absolute",
                    d.path
                )));
            }
            if let Some(t) = &d.typ
                && !["c", "b", "u", "p"].contains(&t.as_str())
            {
                return Err(TopologyError::Value(format!(
                    "device node {} has type '{t}'",
                    d.path
                )));
            }
        }
        for m in &self.mounts {
            if !m.container_path.starts_with('/') {
                return Err(TopologyError::Value(format!(
                    "mount containerPath '{}' is not absolute",
                    m.container_path
                )));
            }
        }
        for h in &self.hooks {
            if !HOOK_NAMES.contains(&h.hook_name.as_str()) {
                return Err(TopologyError::Value(format!(
                    "hook name '{}' is unknown",
                    h.hook_name
                )));
            }
            if !h.path.starts_with('/') {
                return Err(TopologyError::Value(format!(
                    "hook path '{}' is not absolute",
                    h.path
                )));
            }
        }
        Ok(())
    }
}

const HOOK_NAMES: [&str; 6] = [
    "prestart",
    "createRuntime",
    "createContainer",
    "startContainer",
    "poststart",
    "poststop",
];

/// One device with where it came from.
#[derive(Clone, Debug)]
struct Entry {
    path: PathBuf,
    spec_edits: ContainerEdits,
    device_edits: ContainerEdits,
}

/// A device name as the spec directories define it.
#[derive(Clone, Debug)]
enum Definition {
    Usable(Box<Entry>),
    /// Defined by two spec files of the same directory: nothing but a higher directory resolves
    /// it.
    Conflict {
        first: PathBuf,
        second: PathBuf,
    },
}

impl Definition {
    fn usable(&self) -> Option<&Entry> {
        match self {
            Definition::Usable(e) => Some(e.as_ref()),
            Definition::Conflict { .. } => None,
        }
    }
}

/// Every device of the spec directories; later directories override earlier ones, as the CDI
/// specification orders /etc/cdi before /var/run/cdi.
#[derive(Clone, Debug, Default)]
pub struct Registry {
    /// Qualified name → (directory priority, the device or why it cannot be used).
    devices: BTreeMap<String, (usize, Definition)>,
    /// Spec files that could not be read, with why.
    pub errors: Vec<String>,
}

impl Registry {
    pub fn load(dirs: &[PathBuf]) -> Self {
        let mut r = Registry::default();
        for (priority, dir) in dirs.iter().enumerate() {
            let Ok(names) = super::list_dir(dir) else {
                r.errors.push(format!("{}: cannot list", dir.display()));
                continue;
            };
            for name in names {
                let path = dir.join(&name);
                let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
                if !["json", "yaml", "yml"].contains(&ext) || !path.is_file() {
                    continue;
                }
                let spec = std::fs::read_to_string(&path)
                    .map_err(|e| TopologyError::CdiSpec {
                        path: path.clone(),
                        what: e.to_string(),
                    })
                    .and_then(|t| CdiSpec::parse(&t, &path));
                let spec = match spec {
                    Ok(s) => s,
                    Err(e) => {
                        r.errors.push(e.to_string());
                        continue;
                    }
                };
                for d in &spec.devices {
                    let qualified = format!("{}={}", spec.kind, d.name);
                    let entry = Entry {
                        path: path.clone(),
                        spec_edits: spec.container_edits.clone(),
                        device_edits: d.container_edits.clone(),
                    };
                    let new = match r.devices.get(&qualified) {
                        // Same directory: a conflict nothing but a higher directory resolves.
                        Some((p, Definition::Usable(old))) if *p == priority => {
                            Definition::Conflict {
                                first: old.path.clone(),
                                second: path.clone(),
                            }
                        }
                        Some((p, conflict @ Definition::Conflict { .. })) if *p == priority => {
                            conflict.clone()
                        }
                        _ => Definition::Usable(Box::new(entry)),
                    };
                    r.devices.insert(qualified, (priority, new));
                }
            }
        }
        r
    }

    /// The qualified names of every usable device.
    pub fn names(&self) -> Vec<String> {
        self.devices
            .iter()
            .filter(|(_, (_, d))| d.usable().is_some())
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// Where a device is defined.
    pub fn source(&self, name: &str) -> Option<&Path> {
        self.devices
            .get(name)
            .and_then(|(_, d)| d.usable())
            .map(|e| e.path.as_path())
    }

    /// The edits for devices `names`, spec-wide edits once per spec file, in order.
    pub fn edits(&self, names: &[String]) -> Result<Vec<ContainerEdits>, TopologyError> {
        let mut out = Vec::new();
        let mut specs_done: Vec<PathBuf> = Vec::new();
        for name in names {
            if !is_qualified(name) {
                return Err(TopologyError::CdiDevice {
                    name: name.clone(),
                    what: "not a CDI name: use vendor.com/class=name".into(),
                });
            }
            let entry = match self.devices.get(name) {
                Some((_, Definition::Usable(e))) => e,
                Some((_, Definition::Conflict { first, second })) => {
                    return Err(TopologyError::CdiDevice {
                        name: name.clone(),
                        what: format!(
                            "defined in both {} and {}: remove one of the definitions",
                            first.display(),
                            second.display()
                        ),
                    });
                }
                None => {
                    let mut what = "no CDI spec defines it (`berth cdi list` shows the devices; \
`berth cdi generate` writes specs for this node)"
                        .to_string();
                    if !self.errors.is_empty() {
                        what.push_str(&format!("; unreadable specs: {}", self.errors.join("; ")));
                    }
                    return Err(TopologyError::CdiDevice {
                        name: name.clone(),
                        what,
                    });
                }
            };
            for (what, edits) in [("spec", &entry.spec_edits), ("device", &entry.device_edits)] {
                if edits.intel_rdt.is_some() || !edits.net_devices.is_empty() {
                    return Err(TopologyError::CdiDevice {
                        name: name.clone(),
                        what: format!(
                            "its {what} edits need intelRdt or netDevices, which berth does not support"
                        ),
                    });
                }
            }
            if !specs_done.contains(&entry.path) {
                specs_done.push(entry.path.clone());
                out.push(entry.spec_edits.clone());
            }
            out.push(entry.device_edits.clone());
        }
        Ok(out)
    }
}

/// What applying edits did that the caller should know.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    pub devices: usize,
    pub mounts: usize,
    pub hooks: usize,
}

fn device_type(t: &str) -> LinuxDeviceType {
    match t {
        "b" => LinuxDeviceType::B,
        "u" => LinuxDeviceType::U,
        "p" => LinuxDeviceType::P,
        _ => LinuxDeviceType::C,
    }
}

/// Applies `edits` (from [`Registry::edits`]) to `spec`. Device numbers missing from a spec are
/// read from the host's node (`host` is `/` in production). Mounts get nosuid and nodev, except
/// under /dev.
// Long by design: the edits are applied in the order the CDI specification gives (env, device
// nodes, mounts, hooks), each with its own checks, so a reviewer reads the spec's order here.
pub fn apply(
    spec: &mut Spec,
    edits: &[ContainerEdits],
    host: &Host,
) -> Result<Applied, TopologyError> {
    let mut applied = Applied::default();
    let mut linux = spec
        .linux()
        .clone()
        .unwrap_or(LinuxBuilder::default().build()?);
    let mut devices = linux.devices().clone().unwrap_or_default();
    let mut resources = linux.resources().clone();
    let mut rules = resources.as_ref().and_then(|r| r.devices().clone());
    let mut mounts = spec.mounts().clone().unwrap_or_default();
    let mut process = spec.process().clone().unwrap_or_default();
    let mut env = process.env().clone().unwrap_or_default();
    let mut gids = process.user().additional_gids().clone().unwrap_or_default();
    let mut hooks = spec.hooks().clone().unwrap_or_default();

    for e in edits {
        let pairs: Vec<(String, String)> = e
            .env
            .iter()
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        env = inject::set_env(env, &pairs);

        for d in &e.device_nodes {
            let host_path = d.host_path.clone().unwrap_or_else(|| d.path.clone());
            let meta = std::fs::metadata(host.path(&host_path)).ok();
            let from_host = meta
                .as_ref()
                .filter(|m| m.file_type().is_char_device() || m.file_type().is_block_device());
            let typ = d.typ.clone().unwrap_or_else(|| {
                match from_host {
                    Some(m) if m.file_type().is_block_device() => "b",
                    _ => "c",
                }
                .to_string()
            });
            let (major, minor) = match (d.major, d.minor, from_host) {
                (Some(a), Some(b), _) => (a, b),
                (_, _, Some(m)) => (
                    i64::from(libc::major(m.rdev())),
                    i64::from(libc::minor(m.rdev())),
                ),
                _ => {
                    return Err(TopologyError::CdiDevice {
                        name: d.path.clone(),
                        what: format!(
                            "no major/minor in the spec and {host_path} is not a device node on this host"
                        ),
                    });
                }
            };
            let mode = d
                .file_mode
                .or(from_host.map(|m| m.mode() & 0o7777))
                .unwrap_or(0o666);
            devices.retain(|x| x.path() != Path::new(&d.path));
            devices.push(
                LinuxDeviceBuilder::default()
                    .path(PathBuf::from(&d.path))
                    .typ(device_type(&typ))
                    .major(major)
                    .minor(minor)
                    .file_mode(mode)
                    .uid(d.uid.or(from_host.map(|m| m.uid())).unwrap_or(0))
                    .gid(d.gid.or(from_host.map(|m| m.gid())).unwrap_or(0))
                    .build()?,
            );
            if let Some(rules) = rules.as_mut() {
                rules.push(
                    LinuxDeviceCgroupBuilder::default()
                        .allow(true)
                        .typ(device_type(&typ))
                        .major(major)
                        .minor(minor)
                        .access(d.permissions.clone().unwrap_or_else(|| "rwm".into()))
                        .build()?,
                );
            }
            applied.devices += 1;
        }

        for m in &e.mounts {
            let mut options = m.options.clone();
            for must in ["nosuid", "nodev"] {
                if must == "nodev" && m.container_path.starts_with("/dev/") {
                    continue;
                }
                if !options.iter().any(|o| o == must) {
                    options.push(must.to_string());
                }
            }
            mounts.push(
                MountBuilder::default()
                    .destination(PathBuf::from(&m.container_path))
                    .typ(m.typ.clone().unwrap_or_else(|| "bind".into()))
                    .source(PathBuf::from(&m.host_path))
                    .options(options)
                    .build()?,
            );
            applied.mounts += 1;
        }

        for h in &e.hooks {
            let mut b = HookBuilder::default().path(PathBuf::from(&h.path));
            if !h.args.is_empty() {
                b = b.args(h.args.clone());
            }
            if !h.env.is_empty() {
                b = b.env(h.env.clone());
            }
            if let Some(t) = h.timeout {
                b = b.timeout(t);
            }
            let hook = b.build()?;
            let list = |l: &Option<Vec<oci_spec::runtime::Hook>>| {
                let mut v = l.clone().unwrap_or_default();
                v.push(hook.clone());
                Some(v)
            };
            match h.hook_name.as_str() {
                "prestart" => {
                    let l = list(hooks.prestart());
                    hooks.set_prestart(l);
                }
                "createRuntime" => {
                    let l = list(hooks.create_runtime());
                    hooks.set_create_runtime(l);
                }
                "createContainer" => {
                    let l = list(hooks.create_container());
                    hooks.set_create_container(l);
                }
                "startContainer" => {
                    let l = list(hooks.start_container());
                    hooks.set_start_container(l);
                }
                "poststart" => {
                    let l = list(hooks.poststart());
                    hooks.set_poststart(l);
                }
                _ => {
                    let l = list(hooks.poststop());
                    hooks.set_poststop(l);
                }
            }
            applied.hooks += 1;
        }
        for g in &e.additional_gids {
            if !gids.contains(g) {
                gids.push(*g);
            }
        }
    }

    linux.set_devices(Some(devices));
    if let (Some(res), Some(rules)) = (resources.as_mut(), rules) {
        res.set_devices(Some(rules));
    }
    linux.set_resources(resources);
    spec.set_linux(Some(linux));
    spec.set_mounts(Some(mounts));
    process.set_env(Some(env));
    let mut user = process.user().clone();
    user.set_additional_gids(Some(gids));
    process.set_user(user);
    spec.set_process(Some(process));
    if applied.hooks > 0 {
        spec.set_hooks(Some(hooks));
    }
    Ok(applied)
}

fn cdi_node(d: &inject::DeviceNode) -> DeviceNode {
    DeviceNode {
        path: d.path.display().to_string(),
        major: Some(d.major),
        minor: Some(d.minor),
        file_mode: Some(d.mode),
        typ: Some("c".into()),
        ..Default::default()
    }
}

fn cdi_mount(b: &inject::Bind) -> Mount {
    Mount {
        host_path: b.source.display().to_string(),
        container_path: b.destination.display().to_string(),
        typ: Some("bind".into()),
        options: ["ro", "nosuid", "nodev", "bind"]
            .iter()
            .map(|s| s.to_string())
            .collect(),
    }
}

/// A spec for the node's GPUs: one device per GPU by index and by UUID, and `all`; the control
/// nodes, driver libraries and tools as spec-wide edits. `None` without GPUs.
pub fn generate_gpus(
    host: &Host,
    node: &Node,
    files: &DriverFiles,
    kind: &str,
) -> Result<Option<CdiSpec>, TopologyError> {
    if node.gpus.is_empty() {
        return Ok(None);
    }
    let all: Vec<u32> = node.gpus.iter().map(|g| g.index).collect();
    let plan = inject::plan(host, node, &all, &[], files)?;
    let per_gpu: Vec<(u32, Option<String>, inject::DeviceNode)> = node
        .gpus
        .iter()
        .filter_map(|g| {
            let path = PathBuf::from(format!("/dev/nvidia{}", g.minor?));
            let d = plan.devices.iter().find(|d| d.path == path)?.clone();
            Some((g.index, g.uuid.clone(), d))
        })
        .collect();
    let common: Vec<DeviceNode> = plan
        .devices
        .iter()
        .filter(|d| !per_gpu.iter().any(|(_, _, g)| g.path == d.path))
        .map(cdi_node)
        .collect();
    let mut devices = Vec::new();
    for (index, uuid, d) in &per_gpu {
        let edits = ContainerEdits {
            device_nodes: vec![cdi_node(d)],
            ..Default::default()
        };
        devices.push(Device {
            name: index.to_string(),
            container_edits: edits.clone(),
            ..Default::default()
        });
        if let Some(u) = uuid {
            devices.push(Device {
                name: u.clone(),
                container_edits: edits,
                ..Default::default()
            });
        }
    }
    devices.push(Device {
        name: "all".into(),
        container_edits: ContainerEdits {
            device_nodes: per_gpu.iter().map(|(_, _, d)| cdi_node(d)).collect(),
            ..Default::default()
        },
        ..Default::default()
    });
    Ok(Some(CdiSpec {
        cdi_version: WRITE_VERSION.into(),
        kind: kind.into(),
        annotations: BTreeMap::new(),
        devices,
        container_edits: ContainerEdits {
            device_nodes: common,
            mounts: plan.mounts.iter().map(cdi_mount).collect(),
            ..Default::default()
        },
    }))
}

/// A spec for the node's HCAs: one device per RDMA device that is not excluded, `all` for the
/// compute ones, and rdma_cm spec-wide. `None` without HCAs.
pub fn generate_hcas(
    host: &Host,
    node: &Node,
    kind: &str,
) -> Result<Option<CdiSpec>, TopologyError> {
    let usable: Vec<&super::Nic> = node
        .nics
        .iter()
        .filter(|n| n.role != NicRole::Excluded && n.device.uverbs.is_some())
        .collect();
    if usable.is_empty() {
        return Ok(None);
    }
    let names: Vec<String> = usable.iter().map(|n| n.name.clone()).collect();
    let plan = inject::plan(host, node, &[], &names, &DriverFiles::default())?;
    let node_of = |n: &super::Nic| {
        let (uverbs, _) = n.device.uverbs.as_ref().expect("filtered above");
        let path = PathBuf::from(format!("/dev/infiniband/{uverbs}"));
        plan.devices.iter().find(|d| d.path == path).map(cdi_node)
    };
    let mut devices: Vec<Device> = usable
        .iter()
        .filter_map(|n| {
            Some(Device {
                name: n.name.clone(),
                container_edits: ContainerEdits {
                    device_nodes: vec![node_of(n)?],
                    ..Default::default()
                },
                ..Default::default()
            })
        })
        .collect();
    devices.push(Device {
        name: "all".into(),
        container_edits: ContainerEdits {
            device_nodes: usable
                .iter()
                .filter(|n| n.role == NicRole::Compute)
                .filter_map(|n| node_of(n))
                .collect(),
            ..Default::default()
        },
        ..Default::default()
    });
    let common = plan
        .devices
        .iter()
        .filter(|d| d.path == Path::new("/dev/infiniband/rdma_cm"))
        .map(cdi_node)
        .collect();
    Ok(Some(CdiSpec {
        cdi_version: WRITE_VERSION.into(),
        kind: kind.into(),
        annotations: BTreeMap::new(),
        devices,
        container_edits: ContainerEdits {
            device_nodes: common,
            ..Default::default()
        },
    }))
}

/// Writes a spec as JSON, atomically.
pub fn write(spec: &CdiSpec, path: &Path) -> Result<(), TopologyError> {
    let mut text = serde_json::to_string_pretty(spec).expect("a CDI spec serializes");
    text.push('\n');
    super::atomic_write(path, text.as_bytes())
}

/// The node's specs as `berth cdi generate` writes them: GPUs of kind `gpu_kind` into
/// `berth-gpu.json`, HCAs of kind `hca_kind` into `berth-hca.json`; a node without either
/// has no spec for it. A kind must be `vendor.com/class`.
pub fn generate_node(
    host: &Host,
    node: &Node,
    gpu_kind: &str,
    hca_kind: &str,
) -> Result<Vec<(&'static str, CdiSpec)>, TopologyError> {
    for kind in [gpu_kind, hca_kind] {
        if !is_qualified(&format!("{kind}=x")) {
            return Err(TopologyError::Input(format!(
                "CDI kind '{kind}': use vendor.com/class"
            )));
        }
    }
    let gpus = generate_gpus(host, node, &DriverFiles::default(), gpu_kind)?;
    let hcas = generate_hcas(host, node, hca_kind)?;
    Ok([("berth-gpu.json", gpus), ("berth-hca.json", hcas)]
        .into_iter()
        .filter_map(|(file, spec)| spec.map(|s| (file, s)))
        .collect())
}

/// Writes `specs` into `dir` (made if missing; by default the last of `topology.cdi_dirs`,
/// where runtimes look last, so an admin's own specs in earlier directories win). Returns
/// each file written.
pub fn write_into(
    specs: &[(&'static str, CdiSpec)],
    dir: &Path,
) -> Result<Vec<PathBuf>, TopologyError> {
    std::fs::create_dir_all(dir).map_err(|source| TopologyError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    specs
        .iter()
        .map(|(file, spec)| {
            let path = dir.join(file);
            write(spec, &path).map(|()| path)
        })
        .collect()
}

/// Resolves `names` from `dirs` and applies them to `spec`: what `berth run --device
/// vendor.com/class=name` does.
pub fn apply_names(
    spec: &mut Spec,
    names: &[String],
    dirs: &[PathBuf],
    host: &Host,
) -> Result<Applied, TopologyError> {
    let registry = Registry::load(dirs);
    let edits = registry.edits(names)?;
    apply(spec, &edits, host)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixture;
    use crate::gpu::Recorded;
    use crate::node::{self, NicPolicy};
    use berth_spec::{self as spec, Request, UserIds};

    const NVIDIA_YAML: &str = r#"---
cdiVersion: 0.5.0
kind: nvidia.com/gpu
devices:
- name: "0"
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
      hostPath: /dev/null
- name: all
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
      hostPath: /dev/null
containerEdits:
  env:
  - NVIDIA_VISIBLE_DEVICES=void
  deviceNodes:
  - path: /dev/nvidiactl
    type: c
    major: 195
    minor: 255
    permissions: rw
  hooks:
  - hookName: createContainer
    path: /usr/bin/nvidia-ctk
    args: [nvidia-ctk, hook, update-ldcache, --folder, /usr/lib/x86_64-linux-gnu]
  mounts:
  - hostPath: /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15
    containerPath: /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15
    options: [ro, nosuid, bind]
  additionalGids: [44]
"#;

    fn spec_dir(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (name, text) in files {
            std::fs::write(dir.path().join(name), text).unwrap();
        }
        dir
    }

    fn json_spec(version: &str, kind: &str, device: &str, env: &str) -> String {
        format!(
            r#"{{"cdiVersion": "{version}", "kind": "{kind}", "devices": [{{"name": "{device}", "containerEdits": {{"env": ["{env}"]}}}}]}}"#
        )
    }

    fn base() -> Spec {
        spec::build(&Request {
            rootfs: "/images/x".into(),
            args: vec!["true".into()],
            user: UserIds {
                uid: 1000,
                gid: 1000,
                groups: vec![1000],
                ..Default::default()
            },
            ..Default::default()
        })
        .unwrap()
    }

    #[test]
    fn specs_parse_from_yaml_and_json_and_bad_ones_are_refused() {
        let s = CdiSpec::parse(NVIDIA_YAML, Path::new("/etc/cdi/nvidia.yaml")).unwrap();
        assert_eq!(s.kind, "nvidia.com/gpu");
        assert_eq!(s.devices.len(), 2);
        assert_eq!(s.container_edits.hooks[0].hook_name, "createContainer");
        assert_eq!(s.container_edits.device_nodes[0].major, Some(195));
        for v in VERSIONS {
            let text = json_spec(v, "vendor.com/net", "a", "A=1");
            CdiSpec::parse(&text, Path::new("x.json")).unwrap();
        }
        let bad = |text: &str| {
            CdiSpec::parse(text, Path::new("/etc/cdi/x.json"))
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            bad(&json_spec("0.4.0", "vendor.com/net", "a", "A=1")),
            "CDI spec /etc/cdi/x.json: cdiVersion '0.4.0' is not supported: berth reads 0.5.0 to 1.1.0"
        );
        assert!(bad(&json_spec("0.6.0", "vendor", "a", "A=1")).contains("is not vendor.com/class"));
        assert!(bad(&json_spec("0.6.0", "v.com/c", "-a", "A=1")).contains("device name '-a'"));
        assert!(bad(&json_spec("0.6.0", "v.com/c", "a", "=1")).contains("not KEY=VALUE"));
        assert!(bad("{").starts_with("CDI spec /etc/cdi/x.json: EOF"));
        assert!(is_qualified("nvidia.com/gpu=GPU-1234"));
        assert!(is_qualified("vendor.com/class=0:1"));
        assert!(!is_qualified("/dev/null"));
        assert!(!is_qualified("nvidia.com/gpu"));
    }

    #[test]
    fn later_directories_override_and_same_directory_conflicts() {
        let etc = spec_dir(&[
            ("a.json", &json_spec("0.6.0", "v.com/c", "x", "FROM=etc")),
            ("b.yaml", &json_spec("0.6.0", "v.com/c", "y", "FROM=b")),
            ("c.yml", &json_spec("0.6.0", "v.com/c", "y", "FROM=c")),
            ("bad.json", "{\"cdiVersion\": \"9.9.9\"}"),
            ("notes.txt", "ignored"),
        ]);
        let run = spec_dir(&[("a.json", &json_spec("1.0.0", "v.com/c", "x", "FROM=run"))]);
        let r = Registry::load(&[etc.path().to_path_buf(), run.path().to_path_buf()]);
        assert_eq!(r.names(), ["v.com/c=x"]);
        assert_eq!(
            r.source("v.com/c=x"),
            Some(run.path().join("a.json").as_path())
        );
        assert_eq!(r.errors.len(), 1, "{:?}", r.errors);
        let edits = r.edits(&["v.com/c=x".into()]).unwrap();
        assert_eq!(edits.last().unwrap().env, ["FROM=run"]);
        let err = r.edits(&["v.com/c=y".into()]).unwrap_err().to_string();
        assert!(
            err.starts_with("CDI device 'v.com/c=y': defined in both"),
            "{err}"
        );
        let err = r.edits(&["v.com/c=z".into()]).unwrap_err().to_string();
        assert!(err.contains("no CDI spec defines it"), "{err}");
        assert!(
            err.contains("bad.json"),
            "unreadable specs are named: {err}"
        );
        // A higher directory resolves a lower one's conflict.
        let fix = spec_dir(&[("y.json", &json_spec("1.1.0", "v.com/c", "y", "FROM=fix"))]);
        let r = Registry::load(&[etc.path().to_path_buf(), fix.path().to_path_buf()]);
        assert_eq!(r.edits(&["v.com/c=y".into()]).unwrap()[1].env, ["FROM=fix"]);
    }

    #[test]
    fn edits_apply_to_the_spec() {
        let dir = spec_dir(&[("nvidia.yaml", NVIDIA_YAML)]);
        let mut s = base();
        let applied = apply_names(
            &mut s,
            &["nvidia.com/gpu=0".into()],
            &[dir.path().to_path_buf()],
            &Host::new("/"),
        )
        .unwrap();
        assert_eq!(
            applied,
            Applied {
                devices: 2,
                mounts: 1,
                hooks: 1
            }
        );
        let linux = s.linux().as_ref().unwrap();
        let devs: Vec<String> = linux
            .devices()
            .as_ref()
            .unwrap()
            .iter()
            .filter(|d| d.path().to_string_lossy().starts_with("/dev/nvidia"))
            .map(|d| format!("{} {}:{}", d.path().display(), d.major(), d.minor()))
            .collect();
        assert_eq!(devs, ["/dev/nvidiactl 195:255", "/dev/nvidia0 1:3"]);
        let rules = linux
            .resources()
            .as_ref()
            .unwrap()
            .devices()
            .clone()
            .unwrap();
        let tail: Vec<String> = rules[rules.len() - 2..]
            .iter()
            .map(|r| {
                format!(
                    "{:?} {:?}:{:?} {:?}",
                    r.allow(),
                    r.major(),
                    r.minor(),
                    r.access()
                )
            })
            .collect();
        assert_eq!(
            tail,
            [
                "true Some(195):Some(255) Some(\"rw\")",
                "true Some(1):Some(3) Some(\"rwm\")"
            ]
        );
        let m = s.mounts().as_ref().unwrap().last().unwrap();
        assert_eq!(
            m.options().as_deref().unwrap(),
            ["ro", "nosuid", "bind", "nodev"]
        );
        let p = s.process().as_ref().unwrap();
        assert!(
            p.env()
                .as_ref()
                .unwrap()
                .contains(&"NVIDIA_VISIBLE_DEVICES=void".into())
        );
        assert_eq!(p.user().additional_gids().as_deref(), Some(&[1000, 44][..]));
        let hooks = s
            .hooks()
            .as_ref()
            .unwrap()
            .create_container()
            .clone()
            .unwrap();
        assert_eq!(hooks[0].path(), Path::new("/usr/bin/nvidia-ctk"));
        assert_eq!(hooks[0].args().as_ref().unwrap()[2], "update-ldcache");
    }

    #[test]
    fn unsupported_edits_and_missing_device_numbers_are_refused() {
        let text = r#"{"cdiVersion": "0.6.0", "kind": "v.com/c", "devices": [{"name": "r", "containerEdits": {"intelRdt": {"closID": "x"}}}, {"name": "n", "containerEdits": {"deviceNodes": [{"path": "/dev/berth-none"}]}}]}"#;
        let dir = spec_dir(&[("v.json", text)]);
        let dirs = [dir.path().to_path_buf()];
        let err = apply_names(&mut base(), &["v.com/c=r".into()], &dirs, &Host::new("/"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("intelRdt or netDevices"), "{err}");
        let err = apply_names(&mut base(), &["v.com/c=n".into()], &dirs, &Host::new("/"))
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "CDI device '/dev/berth-none': no major/minor in the spec and /dev/berth-none is not a device node on this host"
        );
    }

    #[test]
    fn generated_specs_resolve_to_exactly_the_asked_gpu() {
        let (f, snap) = fixture::dgx_h100();
        f.nvidia_files();
        let n = node::discover(&f.host(), &Recorded::new(snap), &NicPolicy::default()).unwrap();
        let gpus = generate_gpus(&f.host(), &n, &DriverFiles::default(), "nvidia.com/gpu")
            .unwrap()
            .unwrap();
        let names: Vec<&str> = gpus.devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names.len(), 17);
        assert_eq!(&names[..3], ["0", fixture::uuid(0).as_str(), "1"]);
        assert_eq!(names[16], "all");
        let common: Vec<&str> = gpus
            .container_edits
            .device_nodes
            .iter()
            .map(|d| d.path.as_str())
            .collect();
        assert_eq!(
            common,
            ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
        );
        assert_eq!(gpus.container_edits.mounts.len(), 6);
        let hcas = generate_hcas(&f.host(), &n, "berth.io/hca")
            .unwrap()
            .unwrap();
        assert_eq!(hcas.devices.len(), 13);
        let all = hcas.devices.last().unwrap();
        assert_eq!(
            all.container_edits.device_nodes.len(),
            8,
            "compute NICs only"
        );
        assert_eq!(
            hcas.container_edits.device_nodes[0].path,
            "/dev/infiniband/rdma_cm"
        );

        let dir = tempfile::tempdir().unwrap();
        write(&gpus, &dir.path().join("berth-gpu.json")).unwrap();
        write(&hcas, &dir.path().join("berth-hca.json")).unwrap();
        let r = Registry::load(&[dir.path().to_path_buf()]);
        assert!(r.errors.is_empty(), "{:?}", r.errors);
        assert_eq!(r.names().len(), 30);
        let mut s = base();
        apply(
            &mut s,
            &r.edits(&["nvidia.com/gpu=3".into(), "berth.io/hca=mlx5_5".into()])
                .unwrap(),
            &f.host(),
        )
        .unwrap();
        let devs: Vec<String> = s
            .linux()
            .as_ref()
            .unwrap()
            .devices()
            .as_ref()
            .unwrap()
            .iter()
            .skip(6)
            .map(|d| d.path().display().to_string())
            .collect();
        assert_eq!(
            devs,
            [
                "/dev/nvidiactl",
                "/dev/nvidia-uvm",
                "/dev/nvidia-uvm-tools",
                "/dev/nvidia3",
                "/dev/infiniband/rdma_cm",
                "/dev/infiniband/uverbs5"
            ]
        );
        let cpu = fixture::cpu_node();
        let bare =
            node::discover(&cpu.host(), &Recorded::no_driver(), &NicPolicy::default()).unwrap();
        assert!(
            generate_gpus(
                &cpu.host(),
                &bare,
                &DriverFiles::default(),
                "nvidia.com/gpu"
            )
            .unwrap()
            .is_none()
        );
    }
}
