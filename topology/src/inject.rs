//! What a container needs to use exactly its GPUs and HCAs, as a pure [`Plan`]: device nodes
//! (`/dev/nvidiaN` of the allocated GPUs, `nvidiactl`, `nvidia-uvm`, `nvidia-uvm-tools`,
//! `nvidia-modeset`, `nvidia-caps/*`, `/dev/infiniband/uverbsN` of the selected HCAs and
//! `rdma_cm`), read-only binds of the driver's user-space libraries (found through the host's
//! loader cache) and tools, the entries the container's loader cache needs, and environment
//! variables. [`apply`] writes a plan into an OCI Spec (devices, the cgroup device allow-list,
//! mounts, env); [`container_loader_cache`] builds the container's `/etc/ld.so.cache`.
//!
//! Device numbers come from the host's device node when it exists, else from what the driver
//! registered (`/proc/devices`, sysfs `dev` files), so the container gets a node even where the
//! host never created one.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use oci_spec::runtime::{
    LinuxBuilder, LinuxDeviceBuilder, LinuxDeviceCgroup, LinuxDeviceCgroupBuilder, LinuxDeviceType,
    MountBuilder, Spec,
};
use serde::Serialize;

use super::gpu::{self, NvidiaMajors};
use super::ldcache::{self, Entry};
use super::node::Node;
use super::{Host, TopologyError, rdma};

/// The frontend major the NVIDIA driver always registers.
const NVIDIA_MAJOR: u32 = 195;
const NVIDIACTL_MINOR: u32 = 255;
const MODESET_MINOR: u32 = 254;

/// A character device node for the container, at the same path as on the host.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DeviceNode {
    pub path: PathBuf,
    pub major: i64,
    pub minor: i64,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
}

/// A read-only bind of a host file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Bind {
    pub source: PathBuf,
    pub destination: PathBuf,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Plan {
    pub devices: Vec<DeviceNode>,
    pub mounts: Vec<Bind>,
    pub env: Vec<(String, String)>,
    /// Loader-cache entries for the bound libraries (name → path in the container).
    #[serde(skip)]
    pub libraries: Vec<Entry>,
    pub warnings: Vec<String>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.devices.is_empty() && self.mounts.is_empty() && self.env.is_empty()
    }

    /// One allow rule per device node, for the cgroup v2 device filter.
    pub fn device_rules(&self) -> Result<Vec<LinuxDeviceCgroup>, TopologyError> {
        self.devices
            .iter()
            .map(|d| {
                LinuxDeviceCgroupBuilder::default()
                    .allow(true)
                    .typ(LinuxDeviceType::C)
                    .major(d.major)
                    .minor(d.minor)
                    .access("rwm")
                    .build()
                    .map_err(TopologyError::from)
            })
            .collect()
    }
}

/// The driver files a container gets: library names (matched against loader-cache names, e.g.
/// `libcuda.so` matches `libcuda.so` and `libcuda.so.1`) and tools (found in the host's bin dirs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverFiles {
    pub libraries: Vec<String>,
    pub binaries: Vec<String>,
}

impl Default for DriverFiles {
    /// The "compute" and "utility" capabilities of the NVIDIA container toolkit.
    fn default() -> Self {
        let l = [
            "libcuda.so",
            "libcudadebugger.so",
            "libnvidia-ml.so",
            "libnvidia-cfg.so",
            "libnvidia-nvvm.so",
            "libnvidia-ptxjitcompiler.so",
            "libnvidia-gpucomp.so",
            "libnvidia-allocator.so",
            "libnvidia-opencl.so",
            "libnvidia-pkcs11.so",
            "libnvidia-pkcs11-openssl3.so",
            "libnvidia-nscq.so",
        ];
        let b = [
            "nvidia-smi",
            "nvidia-debugdump",
            "nvidia-persistenced",
            "nvidia-cuda-mps-control",
            "nvidia-cuda-mps-server",
        ];
        Self {
            libraries: l.iter().map(|s| s.to_string()).collect(),
            binaries: b.iter().map(|s| s.to_string()).collect(),
        }
    }
}

const BIN_DIRS: [&str; 5] = ["/usr/bin", "/usr/sbin", "/bin", "/sbin", "/usr/local/bin"];

/// A device node at host path `path`: the host's node when it is a character device, else one
/// with the driver's `expected` numbers, else nothing.
fn device_node(host: &Host, path: &str, expected: Option<(u32, u32)>) -> Option<DeviceNode> {
    match std::fs::metadata(host.path(path)) {
        Ok(m) if m.file_type().is_char_device() => {
            return Some(DeviceNode {
                path: PathBuf::from(path),
                major: i64::from(libc::major(m.rdev())),
                minor: i64::from(libc::minor(m.rdev())),
                mode: m.mode() & 0o7777,
                uid: m.uid(),
                gid: m.gid(),
            });
        }
        _ => {}
    }
    expected.map(|(major, minor)| DeviceNode {
        path: PathBuf::from(path),
        major: i64::from(major),
        minor: i64::from(minor),
        mode: 0o666,
        uid: 0,
        gid: 0,
    })
}

/// The host's file for `abs`, resolved through symlinks, if it is a regular file under the root.
fn host_file(host: &Host, abs: &str) -> Option<PathBuf> {
    let real = std::fs::canonicalize(host.path(abs)).ok()?;
    let root = std::fs::canonicalize(host.root()).ok()?;
    (real.starts_with(&root) && real.is_file()).then_some(real)
}

/// Computes what the container needs for node GPUs `gpus` (NVML indices) and HCAs `hcas`.
pub fn plan(
    host: &Host,
    node: &Node,
    gpus: &[u32],
    hcas: &[String],
    files: &DriverFiles,
) -> Result<Plan, TopologyError> {
    let mut p = Plan::default();
    let majors = gpu::proc_majors(host);
    let mut push = |p: &mut Plan, d: Option<DeviceNode>| {
        if let Some(d) = d
            && !p.devices.iter().any(|x| x.path == d.path)
        {
            p.devices.push(d);
        }
    };

    let mut selected = Vec::new();
    for &i in gpus {
        let g = node.gpu(i).ok_or_else(|| {
            TopologyError::Plan(format!(
                "GPU {i} is not on this node (it has {}): pick one `berth topo` lists",
                node.gpus.len()
            ))
        })?;
        if !selected.iter().any(|s: &&super::Gpu| s.index == g.index) {
            selected.push(g);
        }
    }
    selected.sort_by_key(|g| g.index);
    if !selected.is_empty() {
        inject_gpus(host, &selected, majors, &mut p, &mut push)?;
        inject_driver_files(host, files, &mut p);
    }

    for name in hcas {
        let nic = node.nic(name).ok_or_else(|| {
            TopologyError::Plan(format!(
                "HCA {name} is not on this node: pick one `berth topo` lists"
            ))
        })?;
        let Some((uverbs, num)) = &nic.device.uverbs else {
            return Err(TopologyError::Plan(format!(
                "HCA {name} has no uverbs device (is the ib_uverbs module loaded?)"
            )));
        };
        let d = device_node(
            host,
            &format!("/dev/infiniband/{uverbs}"),
            Some((num.major, num.minor)),
        );
        push(&mut p, d);
    }
    if !hcas.is_empty() {
        let cm = rdma::rdma_cm(host).map(|n| (n.major, n.minor));
        match device_node(host, "/dev/infiniband/rdma_cm", cm) {
            Some(d) => push(&mut p, Some(d)),
            None => p
                .warnings
                .push("no /dev/infiniband/rdma_cm (is the rdma_ucm module loaded?)".into()),
        }
    }
    Ok(p)
}

fn inject_gpus(
    host: &Host,
    selected: &[&super::Gpu],
    majors: NvidiaMajors,
    p: &mut Plan,
    push: &mut impl FnMut(&mut Plan, Option<DeviceNode>),
) -> Result<(), TopologyError> {
    let frontend = majors.frontend.unwrap_or(NVIDIA_MAJOR);
    for g in selected {
        let minor = g.minor.ok_or_else(|| {
            TopologyError::Plan(format!(
                "GPU {} ({}) has no device node: the NVIDIA driver is not loaded for it",
                g.index, g.bdf
            ))
        })?;
        push(
            p,
            device_node(
                host,
                &format!("/dev/nvidia{minor}"),
                Some((frontend, minor)),
            ),
        );
    }
    push(
        p,
        device_node(host, "/dev/nvidiactl", Some((frontend, NVIDIACTL_MINOR))),
    );
    push(
        p,
        device_node(host, "/dev/nvidia-uvm", majors.uvm.map(|m| (m, 0))),
    );
    push(
        p,
        device_node(host, "/dev/nvidia-uvm-tools", majors.uvm.map(|m| (m, 1))),
    );
    // The modeset node only exists when nvidia-modeset is loaded; never invent it.
    let modeset = std::fs::metadata(host.path("/dev/nvidia-modeset")).is_ok();
    if modeset {
        push(
            p,
            device_node(host, "/dev/nvidia-modeset", Some((frontend, MODESET_MINOR))),
        );
    }
    if let Ok(names) = super::list_dir(&host.path("/dev/nvidia-caps")) {
        for name in names.iter().filter(|n| n.starts_with("nvidia-cap")) {
            push(
                p,
                device_node(host, &format!("/dev/nvidia-caps/{name}"), None),
            );
        }
    }
    let ids: Vec<String> = selected
        .iter()
        .map(|g| g.uuid.clone().unwrap_or_else(|| g.index.to_string()))
        .collect();
    // Inside the container the GPUs are numbered 0..n-1 in bus order: whatever index the host
    // environment carried would point at GPUs the container does not have.
    p.env
        .push(("CUDA_DEVICE_ORDER".into(), "PCI_BUS_ID".into()));
    p.env.push((
        "CUDA_VISIBLE_DEVICES".into(),
        (0..selected.len())
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(","),
    ));
    p.env.push(("NVIDIA_VISIBLE_DEVICES".into(), ids.join(",")));
    Ok(())
}

fn inject_driver_files(host: &Host, files: &DriverFiles, p: &mut Plan) {
    let cache_path = host.path("/etc/ld.so.cache");
    let entries = match std::fs::read(&cache_path) {
        Ok(bytes) => match ldcache::parse(&bytes, &cache_path) {
            Ok(e) => e,
            Err(e) => {
                p.warnings.push(format!("{e}: no driver libraries bound"));
                Vec::new()
            }
        },
        Err(e) => {
            p.warnings.push(format!(
                "reading {}: {e}: no driver libraries bound",
                cache_path.display()
            ));
            Vec::new()
        }
    };
    for e in entries.iter().filter(|e| e.is_native()) {
        let wanted = files.libraries.iter().any(|l| {
            e.key == *l
                || e.key
                    .strip_prefix(l.as_str())
                    .is_some_and(|r| r.starts_with('.'))
        });
        if !wanted {
            continue;
        }
        let Some(source) = host_file(host, &e.value) else {
            p.warnings
                .push(format!("{} => {}: not a file, skipped", e.key, e.value));
            continue;
        };
        let destination = PathBuf::from(&e.value);
        if !p.mounts.iter().any(|m| m.destination == destination) {
            p.mounts.push(Bind {
                source,
                destination,
            });
        }
        p.libraries.push(e.clone());
    }
    if !p.libraries.iter().any(|e| e.key.starts_with("libcuda.so"))
        || !p
            .libraries
            .iter()
            .any(|e| e.key.starts_with("libnvidia-ml.so"))
    {
        p.warnings.push(format!(
            "libcuda or libnvidia-ml is not in {}: CUDA and nvidia-smi will not work in the container",
            cache_path.display()
        ));
    }
    for b in &files.binaries {
        if let Some(source) = BIN_DIRS
            .iter()
            .find_map(|d| host_file(host, &format!("{d}/{b}")))
        {
            p.mounts.push(Bind {
                source,
                destination: PathBuf::from("/usr/bin").join(b),
            });
        }
    }
    for sock in ["/run/nvidia-persistenced/socket"] {
        if std::fs::metadata(host.path(sock)).is_ok_and(|m| m.file_type().is_socket()) {
            p.mounts.push(Bind {
                source: host.path(sock),
                destination: PathBuf::from(sock),
            });
        }
    }
}

/// The plan for a job step's GPUs and HCAs: the GPUs the job names (see
/// [`plan::allocated_gpus`]) and the compute NICs paired with them; a step without GPUs gets
/// every compute NIC, as its ranks' NCCL_IB_HCA says.
pub fn for_job(
    host: &Host,
    node: &Node,
    job: &super::job::Job,
    files: &DriverFiles,
) -> Result<Plan, TopologyError> {
    let gpus: Vec<u32> = super::plan::allocated_gpus(node, job)?
        .iter()
        .map(|g| g.index)
        .collect();
    plan(host, node, &gpus, &hcas_for(node, &gpus), files)
}

/// The plan for `berth run --gpus LIST|all|none`: LIST holds node indices, GPU-UUIDs or PCI
/// addresses; the GPUs' paired compute NICs come along.
pub fn for_gpus(
    host: &Host,
    node: &Node,
    list: &str,
    files: &DriverFiles,
) -> Result<Plan, TopologyError> {
    let gpus: Vec<u32> = match list.trim() {
        "all" => node.gpus.iter().map(|g| g.index).collect(),
        "none" | "" => Vec::new(),
        other => {
            let job = super::job::Job {
                gpus: Some(super::job::parse_gpus("--gpus", other)?),
                gpus_from: Some("--gpus".into()),
                tasks: 1,
                tasks_from: None,
                local_id: None,
                in_slurm: false,
            };
            super::plan::allocated_gpus(node, &job)?
                .iter()
                .map(|g| g.index)
                .collect()
        }
    };
    if gpus.is_empty() {
        return Ok(Plan::default());
    }
    plan(host, node, &gpus, &hcas_for(node, &gpus), files)
}

/// The compute NICs paired with `gpus`; every compute NIC when `gpus` is empty.
fn hcas_for(node: &Node, gpus: &[u32]) -> Vec<String> {
    if gpus.is_empty() {
        return node.compute_nics().map(|n| n.name.clone()).collect();
    }
    let mut out: Vec<String> = Vec::new();
    for p in super::plan::pairing(node) {
        if gpus.contains(&p.gpu)
            && let Some(n) = p.nic
            && !out.contains(&n)
        {
            out.push(n);
        }
    }
    out.sort_by_key(|name| node.nics.iter().position(|n| &n.name == name));
    out
}

/// Writes `plan` into `spec`: device nodes into `linux.devices`, an allow rule for each into
/// the device cgroup rules (only when the Spec has rules: a Spec without any allows every
/// device already), read-only nosuid,nodev binds into `mounts`, and the variables into
/// `process.env` (replacing same-named ones, so apply it after the job's environment).
pub fn apply(spec: &mut Spec, plan: &Plan) -> Result<(), TopologyError> {
    let mut linux = spec
        .linux()
        .clone()
        .unwrap_or(LinuxBuilder::default().build()?);
    let mut devices = linux.devices().clone().unwrap_or_default();
    for d in &plan.devices {
        devices.retain(|x| x.path() != &d.path);
        devices.push(
            LinuxDeviceBuilder::default()
                .path(d.path.clone())
                .typ(LinuxDeviceType::C)
                .major(d.major)
                .minor(d.minor)
                .file_mode(d.mode)
                .uid(d.uid)
                .gid(d.gid)
                .build()?,
        );
    }
    linux.set_devices(Some(devices));
    if let Some(mut res) = linux.resources().clone()
        && let Some(mut rules) = res.devices().clone()
    {
        for rule in plan.device_rules()? {
            if !rules.contains(&rule) {
                rules.push(rule);
            }
        }
        res.set_devices(Some(rules));
        linux.set_resources(Some(res));
    }
    spec.set_linux(Some(linux));

    let mut mounts = spec.mounts().clone().unwrap_or_default();
    for b in &plan.mounts {
        mounts.push(read_only_bind(&b.source, &b.destination)?);
    }
    spec.set_mounts(Some(mounts));

    if !plan.env.is_empty() {
        let mut process = spec.process().clone().unwrap_or_default();
        process.set_env(Some(set_env(
            process.env().clone().unwrap_or_default(),
            &plan.env,
        )));
        spec.set_process(Some(process));
    }
    Ok(())
}

/// `KEY=VALUE` list with `pairs` set: a key already there keeps its place and takes the new value.
pub(crate) fn set_env(mut env: Vec<String>, pairs: &[(String, String)]) -> Vec<String> {
    for (k, v) in pairs {
        let entry = format!("{k}={v}");
        match env
            .iter_mut()
            .find(|e| e.split_once('=').map(|(ek, _)| ek) == Some(k.as_str()))
        {
            Some(slot) => *slot = entry,
            None => env.push(entry),
        }
    }
    env
}

pub(crate) fn read_only_bind(
    source: &Path,
    destination: &Path,
) -> Result<oci_spec::runtime::Mount, TopologyError> {
    Ok(MountBuilder::default()
        .destination(destination)
        .typ("bind")
        .source(source)
        .options(
            ["bind", "ro", "nosuid", "nodev"]
                .iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>(),
        )
        .build()?)
}

/// The container's loader cache: the image's (`image`, the bytes of its /etc/ld.so.cache, if
/// any) with the plan's libraries laid over it. An unreadable image cache is replaced by one
/// holding only the plan's libraries, and the returned warning says so.
pub fn container_loader_cache(image: Option<&[u8]>, plan: &Plan) -> (Vec<u8>, Option<String>) {
    let origin = Path::new("/etc/ld.so.cache (image)");
    let (base, warning) = match image.map(|b| ldcache::parse(b, origin)) {
        Some(Ok(entries)) => (entries, None),
        Some(Err(e)) => (
            Vec::new(),
            Some(format!(
                "{e}: the container's cache holds only the driver's libraries"
            )),
        ),
        None => (Vec::new(), None),
    };
    (
        ldcache::write(&ldcache::merge(base, &plan.libraries)),
        warning,
    )
}

/// The image's /etc/ld.so.cache from its layers (`lowers`, topmost first, as overlayfs stacks
/// them), read without following a symlink out of a layer. `None` when no layer has one, or the
/// topmost mention is an overlay whiteout.
pub fn read_image_loader_cache(lowers: &[PathBuf]) -> Result<Option<Vec<u8>>, TopologyError> {
    use nix::fcntl::{OFlag, OpenHow, ResolveFlag, openat2};
    use nix::sys::stat::Mode;
    use std::io::Read;
    use std::os::fd::AsRawFd;

    const MAX: u64 = 64 << 20;
    for lower in lowers {
        let dir = nix::fcntl::open(
            lower,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|source| TopologyError::Sys {
            what: format!("opening image layer {}", lower.display()),
            source,
        })?;
        let how = OpenHow::new()
            .flags(OFlag::O_PATH | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW)
            .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
        let fd = match openat2(&dir, "etc/ld.so.cache", how) {
            Ok(fd) => fd,
            Err(nix::errno::Errno::ENOENT) | Err(nix::errno::Errno::ENOTDIR) => continue,
            Err(source) => {
                return Err(TopologyError::Sys {
                    what: format!("opening {}/etc/ld.so.cache", lower.display()),
                    source,
                });
            }
        };
        let path = lower.join("etc/ld.so.cache");
        let meta = nix::sys::stat::fstat(&fd).map_err(|source| TopologyError::Sys {
            what: format!("inspecting {}", path.display()),
            source,
        })?;
        let kind = meta.st_mode & libc::S_IFMT;
        if kind == libc::S_IFCHR && meta.st_rdev == 0 {
            return Ok(None); // an overlay whiteout: deleted in this layer
        }
        if kind != libc::S_IFREG {
            return Ok(None); // a symlink or anything else is not a cache berth reads
        }
        // Reopen the O_PATH descriptor for reading: the file it names, not a path again.
        let mut file =
            std::fs::File::open(format!("/proc/self/fd/{}", fd.as_raw_fd())).map_err(|source| {
                TopologyError::Read {
                    path: path.clone(),
                    source,
                }
            })?;
        let mut bytes = Vec::new();
        file.by_ref()
            .take(MAX)
            .read_to_end(&mut bytes)
            .map_err(|source| TopologyError::Read { path, source })?;
        return Ok(Some(bytes));
    }
    Ok(None)
}

/// Adds the bind of a generated loader cache (`file`, on the host) at /etc/ld.so.cache.
pub fn mount_loader_cache(spec: &mut Spec, file: &Path) -> Result<(), TopologyError> {
    let mut mounts = spec.mounts().clone().unwrap_or_default();
    mounts.push(read_only_bind(file, Path::new("/etc/ld.so.cache"))?);
    spec.set_mounts(Some(mounts));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixture;
    use crate::gpu::Recorded;
    use crate::node::{self, NicPolicy};
    use berth_spec::{self as spec, Request, UserIds};

    fn dgx() -> (fixture::Fixture, Node) {
        let (f, snap) = fixture::dgx_h100();
        f.nvidia_files();
        let n = node::discover(&f.host(), &Recorded::new(snap), &NicPolicy::default()).unwrap();
        (f, n)
    }

    fn plan_2_5(f: &fixture::Fixture, n: &Node) -> Plan {
        plan(
            &f.host(),
            n,
            &[5, 2],
            &["mlx5_4".to_string(), "mlx5_9".to_string()],
            &DriverFiles::default(),
        )
        .unwrap()
    }

    #[test]
    fn plan_for_gpus_2_and_5_with_their_hcas() {
        let (f, n) = dgx();
        let p = plan_2_5(&f, &n);
        let devs: Vec<String> = p
            .devices
            .iter()
            .map(|d| format!("{} {}:{} {:o}", d.path.display(), d.major, d.minor, d.mode))
            .collect();
        assert_eq!(
            devs,
            [
                "/dev/nvidia2 195:2 666",
                "/dev/nvidia5 195:5 666",
                "/dev/nvidiactl 195:255 666",
                "/dev/nvidia-uvm 235:0 666",
                "/dev/nvidia-uvm-tools 235:1 666",
                "/dev/infiniband/uverbs4 231:196 666",
                "/dev/infiniband/uverbs9 231:201 666",
                "/dev/infiniband/rdma_cm 10:58 666",
            ]
        );
        let root = std::fs::canonicalize(f.root()).unwrap();
        let lib = root.join("usr/lib/x86_64-linux-gnu");
        let mounts: Vec<(PathBuf, String)> = p
            .mounts
            .iter()
            .map(|m| (m.source.clone(), m.destination.display().to_string()))
            .collect();
        assert_eq!(
            mounts,
            [
                (
                    lib.join("libnvidia-ptxjitcompiler.so.550.54.15"),
                    "/usr/lib/x86_64-linux-gnu/libnvidia-ptxjitcompiler.so.1".to_string()
                ),
                (
                    lib.join("libnvidia-ml.so.550.54.15"),
                    "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1".to_string()
                ),
                (
                    lib.join("libcuda.so.550.54.15"),
                    "/usr/lib/x86_64-linux-gnu/libcuda.so.1".to_string()
                ),
                (
                    lib.join("libcuda.so.550.54.15"),
                    "/usr/lib/x86_64-linux-gnu/libcuda.so".to_string()
                ),
                (
                    root.join("usr/bin/nvidia-smi"),
                    "/usr/bin/nvidia-smi".to_string()
                ),
                (
                    root.join("usr/bin/nvidia-debugdump"),
                    "/usr/bin/nvidia-debugdump".to_string()
                ),
            ],
            "32-bit, CUDA toolkit and unrelated libraries stay out"
        );
        assert_eq!(
            p.env,
            [
                ("CUDA_DEVICE_ORDER".to_string(), "PCI_BUS_ID".to_string()),
                ("CUDA_VISIBLE_DEVICES".to_string(), "0,1".to_string()),
                (
                    "NVIDIA_VISIBLE_DEVICES".to_string(),
                    format!("{},{}", fixture::uuid(2), fixture::uuid(5))
                ),
            ]
        );
        let keys: Vec<&str> = p.libraries.iter().map(|e| e.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "libnvidia-ptxjitcompiler.so.1",
                "libnvidia-ml.so.1",
                "libcuda.so.1",
                "libcuda.so"
            ]
        );
        assert!(p.warnings.is_empty(), "{:?}", p.warnings);
    }

    #[test]
    fn bad_requests_say_what_is_wrong() {
        let (f, n) = dgx();
        let err = plan(&f.host(), &n, &[8], &[], &DriverFiles::default()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "GPU 8 is not on this node (it has 8): pick one `berth topo` lists"
        );
        let err = plan(
            &f.host(),
            &n,
            &[],
            &["mlx5_99".into()],
            &DriverFiles::default(),
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .starts_with("HCA mlx5_99 is not on this node")
        );
        // Without the driver a GPU has no device node to give.
        let (f, _) = fixture::dgx_h100();
        std::fs::remove_dir_all(f.root().join("proc/driver")).unwrap();
        let bare =
            node::discover(&f.host(), &Recorded::no_driver(), &NicPolicy::default()).unwrap();
        let err = plan(&f.host(), &bare, &[2], &[], &DriverFiles::default()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "GPU 2 (0000:52:00.0) has no device node: the NVIDIA driver is not loaded for it"
        );
        // No loader cache: devices still, and a warning that CUDA will not work.
        let p = plan(&f.host(), &n, &[0], &[], &DriverFiles::default()).unwrap();
        assert!(p.mounts.is_empty());
        assert!(
            p.warnings
                .iter()
                .any(|w| w.contains("no driver libraries bound"))
        );
    }

    fn base_spec() -> Spec {
        spec::build(&Request {
            rootfs: "/images/cuda".into(),
            args: vec!["nvidia-smi".into()],
            user: UserIds {
                uid: 1000,
                gid: 1000,
                ..Default::default()
            },
            // What Slurm left in the job's environment: host numbers.
            env: vec![("CUDA_VISIBLE_DEVICES".into(), "2,5".into())],
            ..Default::default()
        })
        .unwrap()
    }

    #[test]
    fn apply_adds_devices_allow_rules_read_only_binds_and_env() {
        let (f, n) = dgx();
        let p = plan_2_5(&f, &n);
        let mut s = base_spec();
        let before_rules = s
            .linux()
            .as_ref()
            .unwrap()
            .resources()
            .as_ref()
            .unwrap()
            .devices()
            .clone()
            .unwrap();
        apply(&mut s, &p).unwrap();
        let linux = s.linux().as_ref().unwrap();
        let devices = linux.devices().as_ref().unwrap();
        for d in &p.devices {
            let found = devices.iter().find(|x| x.path() == &d.path).unwrap();
            assert_eq!((found.major(), found.minor()), (d.major, d.minor));
            assert_eq!(found.typ(), LinuxDeviceType::C);
            assert_eq!(found.file_mode(), Some(0o666));
        }
        assert!(devices.iter().any(|x| x.path() == Path::new("/dev/null")));
        let rules = linux
            .resources()
            .as_ref()
            .unwrap()
            .devices()
            .clone()
            .unwrap();
        assert_eq!(
            &rules[..before_rules.len()],
            &before_rules[..],
            "deny-all stays first"
        );
        assert!(!rules[0].allow());
        let added: Vec<(i64, i64, String)> = rules[before_rules.len()..]
            .iter()
            .map(|r| {
                assert!(r.allow());
                (
                    r.major().unwrap(),
                    r.minor().unwrap(),
                    r.access().clone().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            added,
            [
                (195, 2, "rwm".to_string()),
                (195, 5, "rwm".to_string()),
                (195, 255, "rwm".to_string()),
                (235, 0, "rwm".to_string()),
                (235, 1, "rwm".to_string()),
                (231, 196, "rwm".to_string()),
                (231, 201, "rwm".to_string()),
                (10, 58, "rwm".to_string()),
            ],
            "exactly the plan's devices, nothing for the other GPUs"
        );
        let binds: Vec<&oci_spec::runtime::Mount> = s
            .mounts()
            .as_ref()
            .unwrap()
            .iter()
            .filter(|m| {
                m.destination().starts_with("/usr/lib/x86_64-linux-gnu")
                    || m.destination().starts_with("/usr/bin")
            })
            .collect();
        assert_eq!(binds.len(), 6);
        for m in binds {
            assert_eq!(
                m.options().as_deref().unwrap(),
                ["bind", "ro", "nosuid", "nodev"]
            );
        }
        let env = s.process().as_ref().unwrap().env().clone().unwrap();
        assert!(
            env.contains(&"CUDA_VISIBLE_DEVICES=0,1".to_string()),
            "{env:?}"
        );
        assert!(!env.iter().any(|e| e == "CUDA_VISIBLE_DEVICES=2,5"));
        assert_eq!(
            env.iter()
                .filter(|e| e.starts_with("CUDA_VISIBLE_DEVICES="))
                .count(),
            1
        );
        // Applying twice adds no second rule or device.
        let mut again = s.clone();
        apply(&mut again, &p).unwrap();
        let l2 = again.linux().as_ref().unwrap();
        assert_eq!(l2.devices().as_ref().unwrap().len(), devices.len());
        assert_eq!(
            l2.resources()
                .as_ref()
                .unwrap()
                .devices()
                .as_ref()
                .unwrap()
                .len(),
            rules.len()
        );
    }

    #[test]
    fn the_container_loader_cache_lays_the_driver_over_the_image() {
        let (f, n) = dgx();
        let p = plan_2_5(&f, &n);
        let image = ldcache::write(&[
            Entry::native("libc.so.6", "/lib/x86_64-linux-gnu/libc.so.6"),
            Entry::native(
                "libnvidia-ml.so.1",
                "/usr/local/cuda/compat/stubs/libnvidia-ml.so.1",
            ),
        ]);
        let (bytes, warning) = container_loader_cache(Some(&image), &p);
        assert_eq!(warning, None);
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("ld.so.cache");
        std::fs::write(&file, &bytes).unwrap();
        let out = std::process::Command::new("ldconfig")
            .args(["-p", "-C"])
            .arg(&file)
            .output()
            .unwrap();
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(text.starts_with("5 libs found"), "{text}");
        for line in [
            "libnvidia-ml.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
            "libcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1",
            "libcuda.so (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so",
            "libc.so.6 (libc6,x86-64) => /lib/x86_64-linux-gnu/libc.so.6",
        ] {
            assert!(text.contains(line), "{line} missing from:\n{text}");
        }
        assert!(!text.contains("stubs"), "the image's stub gives way");
        let (bytes, warning) = container_loader_cache(Some(b"not a cache"), &p);
        assert!(warning.unwrap().contains("bad magic"));
        assert_eq!(ldcache::parse(&bytes, Path::new("x")).unwrap().len(), 4);
        let mut s = base_spec();
        mount_loader_cache(&mut s, &file).unwrap();
        let m = s.mounts().as_ref().unwrap().last().unwrap();
        assert_eq!(m.destination(), Path::new("/etc/ld.so.cache"));
        assert_eq!(m.source().as_deref(), Some(file.as_path()));
    }

    #[test]
    fn image_caches_are_read_inside_their_layer() {
        let dir = tempfile::tempdir().unwrap();
        let (top, bottom) = (dir.path().join("top"), dir.path().join("bottom"));
        std::fs::create_dir_all(top.join("usr")).unwrap();
        std::fs::create_dir_all(bottom.join("etc")).unwrap();
        std::fs::write(bottom.join("etc/ld.so.cache"), b"bottom").unwrap();
        let layers = [top.clone(), bottom.clone()];
        assert_eq!(
            read_image_loader_cache(&layers).unwrap().as_deref(),
            Some(&b"bottom"[..])
        );
        // A symlink pointing at a host file is not followed out of the layer.
        std::fs::create_dir_all(top.join("etc")).unwrap();
        let secret = dir.path().join("secret");
        std::fs::write(&secret, b"host secret").unwrap();
        std::os::unix::fs::symlink(&secret, top.join("etc/ld.so.cache")).unwrap();
        assert_eq!(read_image_loader_cache(&layers).unwrap(), None);
        // Nor is a symlinked directory.
        std::fs::remove_dir_all(top.join("etc")).unwrap();
        std::os::unix::fs::symlink(dir.path().join("bottom/etc"), top.join("etc")).unwrap();
        let got = read_image_loader_cache(&layers).unwrap();
        assert_ne!(got.as_deref(), Some(&b"host secret"[..]));
        read_image_loader_cache(&[dir.path().join("missing")]).unwrap_err();
        assert_eq!(read_image_loader_cache(&[]).unwrap(), None);
    }

    #[test]
    fn run_flags_and_job_steps_pick_gpus_with_their_nics() {
        let (f, n) = dgx();
        let paths = |p: &Plan| -> Vec<String> {
            p.devices
                .iter()
                .map(|d| d.path.display().to_string())
                .filter(|d| !d.contains("nvidiactl") && !d.contains("uvm"))
                .collect()
        };
        let p = for_gpus(&f.host(), &n, "5,2", &DriverFiles::default()).unwrap();
        assert_eq!(
            paths(&p),
            [
                "/dev/nvidia2",
                "/dev/nvidia5",
                "/dev/infiniband/uverbs4",
                "/dev/infiniband/uverbs9",
                "/dev/infiniband/rdma_cm"
            ]
        );
        let p = for_gpus(&f.host(), &n, &fixture::uuid(7), &DriverFiles::default()).unwrap();
        assert_eq!(
            paths(&p),
            [
                "/dev/nvidia7",
                "/dev/infiniband/uverbs11",
                "/dev/infiniband/rdma_cm"
            ]
        );
        assert_eq!(
            for_gpus(&f.host(), &n, "all", &DriverFiles::default())
                .unwrap()
                .devices
                .len(),
            8 + 3 + 8 + 1
        );
        assert!(
            for_gpus(&f.host(), &n, "none", &DriverFiles::default())
                .unwrap()
                .is_empty()
        );
        let err = for_gpus(&f.host(), &n, "9", &DriverFiles::default()).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("--gpus=9: GPU 9 is not on this node"),
            "{err}"
        );
        // A step without GPUs still gets the compute HCAs for MPI.
        let job = crate::job::Job {
            gpus: Some(vec![]),
            gpus_from: None,
            tasks: 1,
            tasks_from: None,
            local_id: None,
            in_slurm: true,
        };
        let p = for_job(&f.host(), &n, &job, &DriverFiles::default()).unwrap();
        assert_eq!(
            p.devices.len(),
            9,
            "8 compute uverbs and rdma_cm: {:?}",
            p.devices
        );
        assert!(p.env.is_empty());
    }

    #[test]
    fn one_gpu_gets_only_its_own_node_and_no_hca() {
        let (f, n) = dgx();
        let p = plan(&f.host(), &n, &[0], &[], &DriverFiles::default()).unwrap();
        assert!(
            p.devices
                .iter()
                .any(|d| d.path == Path::new("/dev/nvidia0"))
        );
        assert!(
            !p.devices
                .iter()
                .any(|d| d.path.to_string_lossy().starts_with("/dev/nvidia1"))
        );
        assert!(
            !p.devices
                .iter()
                .any(|d| d.path.starts_with("/dev/infiniband"))
        );
    }
}
