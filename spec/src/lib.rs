//! Builds the OCI runtime `Spec` that describes a container, from what the job asked for.
//! Pure: nothing here touches the host, so every decision is unit-tested. `runtime/` executes it.

pub mod env;
pub mod image;
pub mod parse;

use std::path::{Path, PathBuf};

use oci_spec::runtime::{
    LinuxBuilder, LinuxCapabilitiesBuilder, LinuxCpuBuilder, LinuxDevice, LinuxDeviceBuilder,
    LinuxDeviceCgroup, LinuxDeviceCgroupBuilder, LinuxDeviceType, LinuxIdMapping,
    LinuxIdMappingBuilder, LinuxMemoryBuilder, LinuxNamespaceBuilder, LinuxNamespaceType,
    LinuxPidsBuilder, LinuxResources, LinuxResourcesBuilder, Mount, MountBuilder, ProcessBuilder,
    RootBuilder, Spec, SpecBuilder, UserBuilder,
};

pub use berth_sys::UserIds;
pub use parse::BindMount;

/// Spec annotations carrying the user's primary group name and home directory, for the entries
/// the runtime adds to the container's /etc/group and /etc/passwd.
pub const GROUP_NAME_ANNOTATION: &str = "io.berth.user.group-name";
pub const HOME_ANNOTATION: &str = "io.berth.user.home";

/// Mount option marking a bind mount whose source the user named (`--mount`,
/// `--container-mounts`, the home, the job's scratch): the runtime opens that source with the
/// user's credentials and mounts what it opened, never the path as root. Never given to the kernel.
pub const USER_SOURCE_OPTION: &str = "x-berth.user-source";

/// The CFS period berth uses for `--cpus`, as docker and runc do.
pub const CPU_PERIOD_US: u64 = 100_000;

/// PATH for the command when the job sets none: Debian's default for root and users alike, so
/// images whose binaries live in sbin work for everyone.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("invalid size '{}': use bytes or a number with k, M, G or T (e.g. 512M)", berth_sys::text::elide(.0))]
    Size(String),
    #[error("invalid CPU count '{}': use a positive number such as 0.5 or 2", berth_sys::text::elide(.0))]
    Cpus(String),
    #[error("invalid CPU list '{}': use numbers and ranges such as 0-3,8", berth_sys::text::elide(.0))]
    CpuList(String),
    #[error("invalid mount '{}': {}", berth_sys::text::elide(.0), berth_sys::text::elide(.1))]
    Mount(String, String),
    #[error("invalid environment variable '{}': use KEY=VALUE", berth_sys::text::elide(.0))]
    Env(String),
    /// An environment over `[store] max_env_entries` or `max_env_bytes`.
    #[error("{0}")]
    EnvLimit(String),
    #[error("invalid hostname '{}': use up to 64 letters, digits, '-' and '.'", berth_sys::text::elide(.0))]
    Hostname(String),
    #[error("--memory-swap needs --memory: swap is granted on top of the memory limit")]
    SwapWithoutMemory,
    #[error("building the container spec: {0}")]
    Oci(#[from] oci_spec::OciSpecError),
}

/// Network setup of a container.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Net {
    /// Share the host's network namespace.
    #[default]
    Host,
    /// A new network namespace with only `lo`, up.
    None,
}

/// A device node of the host to expose in the container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostDevice {
    pub path: PathBuf,
    pub block: bool,
    pub major: i64,
    pub minor: i64,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
}

/// Resource limits; `None` leaves the kernel default.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    pub memory: Option<u64>,
    /// Swap allowed on top of `memory` (what memory.swap.max holds).
    pub memory_swap: Option<u64>,
    /// CFS quota in µs per [`CPU_PERIOD_US`].
    pub cpu_quota: Option<i64>,
    pub cpuset: Option<String>,
    pub pids: Option<i64>,
}

/// Everything a job asks of one container, already validated and resolved against the host.
#[derive(Clone, Debug, Default)]
pub struct Request {
    /// The root filesystem directory (the container sees it through an overlay, never writes it).
    pub rootfs: PathBuf,
    pub args: Vec<String>,
    /// Applied in order after berth's defaults; a later key replaces an earlier one.
    pub env: Vec<(String, String)>,
    pub workdir: Option<PathBuf>,
    pub user: UserIds,
    pub hostname: Option<String>,
    pub mounts: Vec<BindMount>,
    /// Empty tmpfs mounts (Pyxis's `tmpfs` mount source).
    pub tmpfs: Vec<PathBuf>,
    pub devices: Vec<HostDevice>,
    pub limits: Limits,
    pub net: Net,
    pub readonly: bool,
    /// Stay in the host's PID namespace: processes that join the container later (a Slurm
    /// step's tasks) cannot enter a PID namespace, and /proc must show them.
    pub share_pids: bool,
    pub terminal: bool,
    /// Host files bind-mounted read-only at the same path (/etc/hosts, /etc/resolv.conf, ...),
    /// only those that exist on the host.
    pub host_files: Vec<PathBuf>,
    /// TERM of the caller, passed on when a terminal is attached.
    pub term: Option<String>,
    /// Run as root of a user namespace that maps root to the user (Pyxis's
    /// `--container-remap-root`, `enroot start --root`): the image's root-owned files appear as
    /// the user's, and the user has no privilege on the host it did not have.
    pub remap_root: bool,
    /// Host cgroup directories shown read-only at /sys/fs/cgroup instead of the container's own
    /// cgroup (a Slurm step's cgroups, whose limits are Slurm's): a destination of
    /// /sys/fs/cgroup itself, or several under it (on a host with cgroup v1 hierarchies).
    pub cgroup_view: Vec<BindMount>,
}

/// (path, major, minor, mode) of the device nodes every container gets, as runc and docker give.
const DEFAULT_DEVICES: [(&str, i64, i64); 6] = [
    ("/dev/null", 1, 3),
    ("/dev/zero", 1, 5),
    ("/dev/full", 1, 7),
    ("/dev/random", 1, 8),
    ("/dev/urandom", 1, 9),
    ("/dev/tty", 5, 0),
];

/// Builds the Spec for a request.
// Long by design: every field of the Spec, and every default that bears on security (mounts
// nosuid/nodev, capabilities, masked paths, no_new_privs), is set in this one place to be
// reviewed together.
pub fn build(req: &Request) -> Result<Spec, SpecError> {
    if req.limits.memory_swap.is_some() && req.limits.memory.is_none() {
        return Err(SpecError::SwapWithoutMemory);
    }
    let mut namespaces = vec![
        LinuxNamespaceType::Mount,
        LinuxNamespaceType::Ipc,
        LinuxNamespaceType::Uts,
        LinuxNamespaceType::Cgroup,
    ];
    if !req.share_pids {
        namespaces.push(LinuxNamespaceType::Pid);
    }
    if req.net == Net::None {
        namespaces.push(LinuxNamespaceType::Network);
    }
    let remap = req.remap_root && req.user.uid != 0;
    if remap {
        namespaces.push(LinuxNamespaceType::User);
    }
    let namespaces = namespaces
        .into_iter()
        .map(|typ| LinuxNamespaceBuilder::default().typ(typ).build())
        .collect::<Result<Vec<_>, _>>()?;

    let mut devices = DEFAULT_DEVICES
        .iter()
        .map(|&(path, major, minor)| {
            LinuxDeviceBuilder::default()
                .path(path)
                .typ(LinuxDeviceType::C)
                .major(major)
                .minor(minor)
                .file_mode(0o666u32)
                .uid(0u32)
                .gid(0u32)
                .build()
        })
        .collect::<Result<Vec<_>, _>>()?;
    for dev in &req.devices {
        devices.push(
            LinuxDeviceBuilder::default()
                .path(dev.path.clone())
                .typ(if dev.block {
                    LinuxDeviceType::B
                } else {
                    LinuxDeviceType::C
                })
                .major(dev.major)
                .minor(dev.minor)
                .file_mode(dev.mode)
                .uid(dev.uid)
                .gid(dev.gid)
                .build()?,
        );
    }

    let mut linux = LinuxBuilder::default();
    if remap {
        let (uids, gids) = remap_mappings(&req.user)?;
        linux = linux.uid_mappings(uids).gid_mappings(gids);
    }
    let linux = linux
        .namespaces(namespaces)
        .resources(resources(&req.limits, &devices)?)
        .devices(devices)
        .rootfs_propagation("rprivate")
        .build()?;

    let none = oci_spec::runtime::Capabilities::new;
    let no_caps = LinuxCapabilitiesBuilder::default()
        .bounding(none())
        .effective(none())
        .inheritable(none())
        .permitted(none())
        .ambient(none())
        .build()?;
    let mut user = if remap {
        // Root inside; the supplementary groups keep their ids (mapped to themselves).
        UserBuilder::default()
            .uid(0u32)
            .gid(0u32)
            .additional_gids(supplementary(&req.user))
            .username("root")
    } else {
        UserBuilder::default()
            .uid(req.user.uid)
            .gid(req.user.gid)
            .additional_gids(req.user.groups.clone())
    };
    if let (false, Some(name)) = (remap, &req.user.name) {
        user = user.username(name.clone());
    }
    let user = user.build()?;
    let process = ProcessBuilder::default()
        .terminal(req.terminal)
        .user(user)
        .args(req.args.clone())
        .env(environment(req))
        .cwd(req.workdir.clone().unwrap_or_else(|| PathBuf::from("/")))
        .capabilities(no_caps)
        .no_new_privileges(true)
        .build()?;

    let mut spec = SpecBuilder::default()
        .version("1.2.0")
        .root(
            RootBuilder::default()
                .path(req.rootfs.clone())
                .readonly(req.readonly)
                .build()?,
        )
        .process(process)
        .mounts(mounts(req)?)
        .linux(linux)
        .build()?;
    // oci-spec's defaults carry a hostname of their own; the container keeps the host's unless
    // one was asked for.
    spec.set_hostname(req.hostname.clone());
    let mut annotations = std::collections::HashMap::new();
    if let Some(group) = &req.user.group_name {
        annotations.insert(GROUP_NAME_ANNOTATION.to_string(), group.clone());
    }
    if let Some(home) = &req.user.home {
        annotations.insert(HOME_ANNOTATION.to_string(), home.display().to_string());
    }
    spec.set_annotations(Some(annotations));
    Ok(spec)
}

/// The user's groups other than its primary one and root's, which a remapped container maps to
/// themselves so that the user keeps its group access.
fn supplementary(user: &UserIds) -> Vec<u32> {
    let mut groups: Vec<u32> = user
        .groups
        .iter()
        .copied()
        .filter(|&g| g != user.gid && g != 0)
        .collect();
    groups.sort_unstable();
    groups.dedup();
    groups
}

/// A remapped container's id mappings: its root is the user (uid and primary gid), and each
/// supplementary group is itself.
fn remap_mappings(user: &UserIds) -> Result<(Vec<LinuxIdMapping>, Vec<LinuxIdMapping>), SpecError> {
    let map = |inside: u32, outside: u32| {
        LinuxIdMappingBuilder::default()
            .container_id(inside)
            .host_id(outside)
            .size(1u32)
            .build()
    };
    let uids = vec![map(0, user.uid)?];
    let mut gids = vec![map(0, user.gid)?];
    for g in supplementary(user) {
        gids.push(map(g, g)?);
    }
    Ok((uids, gids))
}

/// The command's environment: berth's defaults, then the request's pairs; the last value of a key
/// wins and keeps the key's first position. Linear in the number of pairs (see [`env`]).
fn environment(req: &Request) -> Vec<String> {
    let mut pairs = env::EnvBuilder::with_capacity(req.env.len() + 4);
    pairs.set("PATH", DEFAULT_PATH);
    pairs.set(
        "HOME",
        &req.user
            .home
            .as_ref()
            .map(|h| h.display().to_string())
            .unwrap_or_else(|| "/".into()),
    );
    if let Some(name) = &req.hostname {
        pairs.set("HOSTNAME", name);
    }
    if req.terminal {
        pairs.set("TERM", req.term.as_deref().unwrap_or("xterm"));
    }
    for (k, v) in &req.env {
        pairs.set(k, v);
    }
    pairs
        .into_pairs()
        .into_iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect()
}

fn mount(dst: &str, typ: &str, src: &str, options: &[&str]) -> Result<Mount, SpecError> {
    Ok(MountBuilder::default()
        .destination(dst)
        .typ(typ)
        .source(src)
        .options(options.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .build()?)
}

/// The container's mounts, in the order they are made. Every mount is nosuid and nodev except
/// /dev, which holds the device nodes and only those berth creates (the device filter guards it).
fn mounts(req: &Request) -> Result<Vec<Mount>, SpecError> {
    let mut list = vec![
        mount("/proc", "proc", "proc", &["nosuid", "noexec", "nodev"])?,
        mount(
            "/dev",
            "tmpfs",
            "tmpfs",
            &["nosuid", "strictatime", "mode=755", "size=65536k"],
        )?,
        mount(
            "/dev/pts",
            "devpts",
            "devpts",
            &[
                "nosuid",
                "noexec",
                "newinstance",
                "ptmxmode=0666",
                "mode=0620",
                "gid=5",
            ],
        )?,
        mount(
            "/dev/shm",
            "tmpfs",
            "shm",
            &["nosuid", "noexec", "nodev", "mode=1777"],
        )?,
        mount(
            "/dev/mqueue",
            "mqueue",
            "mqueue",
            &["nosuid", "noexec", "nodev"],
        )?,
        mount(
            "/sys",
            "sysfs",
            "sysfs",
            &["nosuid", "noexec", "nodev", "ro"],
        )?,
    ];
    list.extend(cgroup_mounts(&req.cgroup_view)?);
    list.push(mount(
        "/tmp",
        "tmpfs",
        "tmpfs",
        &["nosuid", "nodev", "mode=1777"],
    )?);
    for file in &req.host_files {
        // With --hostname the runtime writes /etc/hostname itself.
        if req.hostname.is_some() && file.as_os_str() == "/etc/hostname" {
            continue;
        }
        let path = file.display().to_string();
        list.push(mount(
            &path,
            "bind",
            &path,
            &["rbind", "ro", "nosuid", "nodev"],
        )?);
    }
    for m in &req.mounts {
        // Over the root the container's own /proc, /dev, /sys and its command would all be
        // hidden: the command then "is not found" (127), which says nothing of why.
        if parse::is_root(&m.destination) {
            return Err(SpecError::Mount(
                format!("{}:{}", m.source.display(), m.destination.display()),
                parse::ONTO_ROOT.to_string(),
            ));
        }
        let mode = if m.readonly { "ro" } else { "rw" };
        list.push(mount(
            &m.destination.display().to_string(),
            "bind",
            &m.source.display().to_string(),
            &["rbind", mode, "nosuid", "nodev", USER_SOURCE_OPTION],
        )?);
    }
    for dst in &req.tmpfs {
        if parse::is_root(dst) {
            return Err(SpecError::Mount(
                format!("tmpfs:{}", dst.display()),
                parse::ONTO_ROOT.to_string(),
            ));
        }
        list.push(mount(
            &dst.display().to_string(),
            "tmpfs",
            "tmpfs",
            &["nosuid", "nodev", "mode=1777"],
        )?);
    }
    Ok(list)
}

/// /sys/fs/cgroup: the container's own cgroup namespace, or the host directories of `view`.
fn cgroup_mounts(view: &[BindMount]) -> Result<Vec<Mount>, SpecError> {
    const AT: &str = "/sys/fs/cgroup";
    const FLAGS: [&str; 4] = ["nosuid", "noexec", "nodev", "ro"];
    let bind = |m: &BindMount| {
        mount(
            &m.destination.display().to_string(),
            "bind",
            &m.source.display().to_string(),
            &["bind", "nosuid", "noexec", "nodev", "ro"],
        )
    };
    match view {
        [] => Ok(vec![mount(AT, "cgroup2", "cgroup", &FLAGS)?]),
        [one] if one.destination == Path::new(AT) => Ok(vec![bind(one)?]),
        many => {
            let mut list = vec![mount(
                AT,
                "tmpfs",
                "tmpfs",
                &["nosuid", "noexec", "nodev", "mode=755"],
            )?];
            for m in many {
                list.push(bind(m)?);
            }
            Ok(list)
        }
    }
}

/// Cgroup limits and the device allow-list: deny everything, then allow exactly the devices the
/// container has, plus the pty pair (devpts's ptmx and the pts slaves).
/// A byte count as OCI's signed field; one past i64::MAX is refused as the size `given` that led
/// to it.
fn oci_bytes(bytes: u64, given: u64) -> Result<i64, SpecError> {
    i64::try_from(bytes).map_err(|_| SpecError::Size(given.to_string()))
}

fn resources(limits: &Limits, devices: &[LinuxDevice]) -> Result<LinuxResources, SpecError> {
    let rule = |typ, major: Option<i64>, minor: Option<i64>| {
        let mut b = LinuxDeviceCgroupBuilder::default()
            .allow(true)
            .typ(typ)
            .access("rwm");
        if let Some(major) = major {
            b = b.major(major);
        }
        if let Some(minor) = minor {
            b = b.minor(minor);
        }
        b.build()
    };
    let mut rules: Vec<LinuxDeviceCgroup> = vec![
        LinuxDeviceCgroupBuilder::default()
            .allow(false)
            .access("rwm")
            .build()?,
    ];
    for dev in devices {
        rules.push(rule(dev.typ(), Some(dev.major()), Some(dev.minor()))?);
    }
    rules.push(rule(LinuxDeviceType::C, Some(5), Some(2))?);
    rules.push(rule(LinuxDeviceType::C, Some(136), None)?);

    let mut res = LinuxResourcesBuilder::default().devices(rules);
    if let Some(limit) = limits.memory {
        let mut mem = LinuxMemoryBuilder::default().limit(oci_bytes(limit, limit)?);
        if let Some(swap) = limits.memory_swap {
            // OCI's swap is memory plus swap (the cgroup v1 meaning).
            mem = mem.swap(oci_bytes(limit.saturating_add(swap), swap)?);
        }
        res = res.memory(mem.build()?);
    }
    if limits.cpu_quota.is_some() || limits.cpuset.is_some() {
        let mut cpu = LinuxCpuBuilder::default();
        if let Some(quota) = limits.cpu_quota {
            cpu = cpu.quota(quota).period(CPU_PERIOD_US);
        }
        if let Some(set) = &limits.cpuset {
            cpu = cpu.cpus(set.clone());
        }
        res = res.cpu(cpu.build()?);
    }
    if let Some(pids) = limits.pids {
        res = res.pids(LinuxPidsBuilder::default().limit(pids).build()?);
    }
    Ok(res.build()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> Request {
        Request {
            rootfs: "/images/busybox".into(),
            args: vec!["/bin/true".into()],
            user: UserIds {
                uid: 1000,
                gid: 1000,
                groups: vec![1000, 27],
                home: Some("/home/alice".into()),
                ..Default::default()
            },
            host_files: vec!["/etc/hosts".into(), "/etc/hostname".into()],
            ..Default::default()
        }
    }

    fn ns_types(spec: &Spec) -> Vec<LinuxNamespaceType> {
        spec.linux()
            .as_ref()
            .unwrap()
            .namespaces()
            .as_ref()
            .unwrap()
            .iter()
            .map(|n| n.typ())
            .collect()
    }

    #[test]
    fn namespaces_follow_net_mode() {
        let spec = build(&request()).unwrap();
        let types = ns_types(&spec);
        for t in [
            LinuxNamespaceType::Pid,
            LinuxNamespaceType::Mount,
            LinuxNamespaceType::Ipc,
            LinuxNamespaceType::Uts,
            LinuxNamespaceType::Cgroup,
        ] {
            assert!(types.contains(&t), "{t:?} missing");
        }
        assert!(!types.contains(&LinuxNamespaceType::Network));
        let spec = build(&Request {
            net: Net::None,
            ..request()
        })
        .unwrap();
        assert!(ns_types(&spec).contains(&LinuxNamespaceType::Network));
    }

    #[test]
    fn remap_root_maps_root_to_the_user_and_keeps_supplementary_groups() {
        let spec = build(&Request {
            remap_root: true,
            ..request()
        })
        .unwrap();
        let linux = spec.linux().as_ref().unwrap();
        assert!(
            linux
                .namespaces()
                .as_ref()
                .unwrap()
                .iter()
                .any(|n| n.typ() == LinuxNamespaceType::User)
        );
        let triples = |m: &Option<Vec<LinuxIdMapping>>| {
            m.as_ref()
                .unwrap()
                .iter()
                .map(|m| (m.container_id(), m.host_id(), m.size()))
                .collect::<Vec<_>>()
        };
        assert_eq!(triples(linux.uid_mappings()), [(0, 1000, 1)]);
        assert_eq!(triples(linux.gid_mappings()), [(0, 1000, 1), (27, 27, 1)]);
        let user = spec.process().as_ref().unwrap().user();
        assert_eq!((user.uid(), user.gid()), (0, 0));
        assert_eq!(user.additional_gids().as_deref(), Some(&[27][..]));
        // Root asking for it is root already: no namespace.
        let root = build(&Request {
            remap_root: true,
            user: UserIds::default(),
            ..request()
        })
        .unwrap();
        assert!(root.linux().as_ref().unwrap().uid_mappings().is_none());
    }

    #[test]
    fn process_is_unprivileged_user() {
        let spec = build(&request()).unwrap();
        let p = spec.process().as_ref().unwrap();
        assert_eq!(p.user().uid(), 1000);
        assert_eq!(p.user().gid(), 1000);
        assert_eq!(p.user().additional_gids().as_deref(), Some(&[1000, 27][..]));
        assert_eq!(p.no_new_privileges(), Some(true));
        let caps = p.capabilities().as_ref().unwrap();
        for set in [
            caps.bounding(),
            caps.effective(),
            caps.permitted(),
            caps.inheritable(),
            caps.ambient(),
        ] {
            assert!(set.as_ref().unwrap().is_empty());
        }
        assert_eq!(p.cwd(), &PathBuf::from("/"));
    }

    #[test]
    fn every_mount_but_dev_is_nosuid_nodev() {
        let spec = build(&Request {
            mounts: vec![parse::bind_mount("/data:/data:ro").unwrap()],
            ..request()
        })
        .unwrap();
        for m in spec.mounts().as_ref().unwrap() {
            let opts = m.options().as_ref().unwrap();
            assert!(opts.iter().any(|o| o == "nosuid"), "{m:?}");
            if m.destination() != &PathBuf::from("/dev") && m.typ().as_deref() != Some("devpts") {
                assert!(opts.iter().any(|o| o == "nodev"), "{m:?}");
            }
        }
        let data = spec
            .mounts()
            .as_ref()
            .unwrap()
            .iter()
            .find(|m| m.destination() == &PathBuf::from("/data"))
            .unwrap();
        assert!(data.options().as_ref().unwrap().contains(&"ro".to_string()));
        assert_eq!(data.typ().as_deref(), Some("bind"));
        // The user named its source: the runtime opens it as the user. berth's own are not.
        let user_named = |m: &Mount| {
            m.options()
                .as_ref()
                .unwrap()
                .contains(&USER_SOURCE_OPTION.to_string())
        };
        assert!(user_named(data));
        let mounts = spec.mounts().as_ref().unwrap();
        assert_eq!(mounts.iter().filter(|m| user_named(m)).count(), 1);
    }

    #[test]
    fn hostname_replaces_host_etc_hostname() {
        let has_hostname_bind = |spec: &Spec| {
            spec.mounts()
                .as_ref()
                .unwrap()
                .iter()
                .any(|m| m.destination() == &PathBuf::from("/etc/hostname"))
        };
        let plain = build(&request()).unwrap();
        assert!(has_hostname_bind(&plain));
        assert_eq!(plain.hostname(), &None, "the host's hostname must be kept");
        let spec = build(&Request {
            hostname: Some("box".into()),
            ..request()
        })
        .unwrap();
        assert!(!has_hostname_bind(&spec));
        assert_eq!(spec.hostname().as_deref(), Some("box"));
    }

    #[test]
    fn environment_defaults_and_overrides() {
        let spec = build(&Request {
            env: vec![
                ("PATH".into(), "/opt/bin".into()),
                ("FOO".into(), "1".into()),
                ("FOO".into(), "2".into()),
            ],
            ..request()
        })
        .unwrap();
        let env = spec.process().as_ref().unwrap().env().clone().unwrap();
        assert_eq!(env, vec!["PATH=/opt/bin", "HOME=/home/alice", "FOO=2"]);
    }

    #[test]
    fn limits_map_to_resources() {
        let spec = build(&Request {
            limits: Limits {
                memory: Some(32 << 20),
                memory_swap: Some(16 << 20),
                cpu_quota: Some(50_000),
                cpuset: Some("1".into()),
                pids: Some(16),
            },
            ..request()
        })
        .unwrap();
        let res = spec.linux().as_ref().unwrap().resources().as_ref().unwrap();
        let mem = res.memory().as_ref().unwrap();
        assert_eq!(mem.limit(), Some(32 << 20));
        assert_eq!(mem.swap(), Some(48 << 20));
        let cpu = res.cpu().as_ref().unwrap();
        assert_eq!(cpu.quota(), Some(50_000));
        assert_eq!(cpu.period(), Some(CPU_PERIOD_US));
        assert_eq!(cpu.cpus().as_deref(), Some("1"));
        assert_eq!(res.pids().as_ref().unwrap().limit(), 16);
    }

    #[test]
    fn swap_needs_memory() {
        let err = build(&Request {
            limits: Limits {
                memory_swap: Some(1 << 20),
                ..Default::default()
            },
            ..request()
        })
        .unwrap_err();
        assert!(matches!(err, SpecError::SwapWithoutMemory));
    }

    #[test]
    fn device_allow_list_is_deny_then_exact_devices() {
        let spec = build(&Request {
            devices: vec![HostDevice {
                path: "/dev/kmsg".into(),
                block: false,
                major: 1,
                minor: 11,
                mode: 0o644,
                uid: 0,
                gid: 0,
            }],
            ..request()
        })
        .unwrap();
        let linux = spec.linux().as_ref().unwrap();
        let rules = linux
            .resources()
            .as_ref()
            .unwrap()
            .devices()
            .clone()
            .unwrap();
        assert!(!rules[0].allow());
        assert_eq!(rules[0].major(), None);
        let allowed: Vec<(i64, Option<i64>)> = rules[1..]
            .iter()
            .map(|r| (r.major().unwrap(), r.minor()))
            .collect();
        for want in [(1, Some(3)), (1, Some(11)), (5, Some(2)), (136, None)] {
            assert!(allowed.contains(&want), "{want:?} not allowed");
        }
        assert!(
            !allowed.contains(&(1, Some(1))),
            "/dev/mem must not be allowed"
        );
        let paths: Vec<_> = linux
            .devices()
            .as_ref()
            .unwrap()
            .iter()
            .map(|d| d.path().display().to_string())
            .collect();
        assert!(paths.contains(&"/dev/kmsg".to_string()));
        assert!(paths.contains(&"/dev/null".to_string()));
    }
}
