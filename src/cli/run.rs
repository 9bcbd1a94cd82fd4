//! `berth run`: run one command in a new container and exit with its status.

use std::io::IsTerminal;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::Failure;
use crate::config::Config;
use crate::image::store::human_size;
use crate::privfs;
use crate::runtime::{self, Exit, Outcome};
use crate::slurm::container::{host_files, options};
use crate::spec::{self, HostDevice, Limits, Net, Request, parse};

/// Run a command in a new container
///
/// IMAGE, as podman and docker take it, is the first positional argument when neither --image
/// nor --rootfs is given; everything after it is the command (`berth run ubuntu:24.04 ls -l`).
/// With --image or --rootfs every positional argument is the command (`berth run --rootfs DIR
/// -- ls -l`, the `--` optional). The command runs in new mount, PID, UTS, IPC and cgroup namespaces, on an overlay of the root
/// filesystem (writes go to a tmpfs and vanish at exit), as the given user with no capabilities
/// and no_new_privs, in its own cgroup v2 with the requested limits. berth exits with the
/// command's status, 128+N when signal N ended it, 137 when the memory limit's OOM killer did,
/// 124 on --timeout, 126/127 when the command cannot be executed or is not found, 125 when the
/// container cannot be set up and 2 for invalid arguments.
#[derive(Debug, Args)]
#[command(override_usage = "berth run [OPTIONS] IMAGE [CMD [ARG]...]
       berth run [OPTIONS] --image REF [--] [CMD [ARG]...]
       berth run [OPTIONS] --rootfs DIR [--] CMD [ARG]...")]
pub struct RunArgs {
    #[command(flatten)]
    pub container: ContainerArgs,

    /// Kill the container after this many seconds and exit 124
    #[arg(long, value_name = "SECONDS", value_parser = super::values::seconds)]
    pub timeout: Option<String>,

    /// IMAGE when neither --image nor --rootfs is given (any REF --image takes), then the
    /// command and its arguments [default with an image: the image's Entrypoint + Cmd]
    #[arg(trailing_var_arg = true, value_name = "IMAGE|CMD")]
    pub command: Vec<String>,
}

impl RunArgs {
    /// Applies the positional rule: without --image and --rootfs, the first positional argument
    /// is the image and the rest the command.
    pub fn take_positional_image(&mut self) {
        let c = &mut self.container;
        if c.image.is_none() && c.rootfs.is_none() && !self.command.is_empty() {
            c.image = Some(self.command.remove(0));
        }
    }
}

/// What a container is made of: shared by `run` and `create`.
#[derive(Debug, Args)]
pub struct ContainerArgs {
    /// Root filesystem directory (never modified: the container writes to an overlay)
    #[arg(long, value_name = "DIR", conflicts_with = "image")]
    pub rootfs: Option<PathBuf>,

    /// Image to run, imported into the node's store once: [USER@][REGISTRY#]IMAGE[:TAG],
    /// docker://REGISTRY/IMAGE[:TAG], FILE.sqsh, FILE.sif, oci:DIR, oci-archive:FILE,
    /// docker-archive:FILE, podman://IMAGE; its Env, WorkingDir, User, Entrypoint and Cmd apply
    #[arg(long, value_name = "REF")]
    pub image: Option<String>,

    /// Run the image's Entrypoint with CMD as its arguments (without CMD, Entrypoint + Cmd run)
    #[arg(long)]
    pub entrypoint: bool,

    /// Platform to pick from a multi-platform image (amd64, arm64, ...) [default: the host's]
    #[arg(long, value_name = "ARCH")]
    pub arch: Option<String>,

    /// Bind-mount a host path (nosuid,nodev; rw unless :ro)
    #[arg(long = "mount", value_name = "SRC:DST[:ro|rw]", value_parser = super::values::mount)]
    pub mounts: Vec<String>,

    /// Set an environment variable; KEY alone passes the caller's value
    #[arg(short, long = "env", value_name = "KEY=VAL", value_parser = super::values::env)]
    pub env: Vec<String>,

    /// Working directory inside the container [default: /]
    #[arg(short, long, value_name = "DIR", value_parser = super::values::workdir_parser())]
    pub workdir: Option<PathBuf>,

    /// Run as this host user (name or uid) and group, with the user's supplementary groups
    /// [default: the invoking user]
    #[arg(short, long, value_name = "UID[:GID]")]
    pub user: Option<String>,

    /// Be root inside the container, in a user namespace that maps root to the user (as
    /// `enroot start --root` and Pyxis's --container-remap-root): the image's root-owned files
    /// appear as the user's, so e.g. `apt-get install` works in the container's writable layer;
    /// no privilege on the host is gained
    #[arg(long)]
    pub remap_root: bool,

    /// Hostname inside the container (also written to its /etc/hostname) [default: the host's]
    #[arg(long, value_name = "NAME", value_parser = super::values::hostname)]
    pub hostname: Option<String>,

    /// Memory limit (memory.max), e.g. 512M or 4G
    #[arg(short, long, value_name = "SIZE", value_parser = super::values::size)]
    pub memory: Option<String>,

    /// Swap allowed on top of --memory (memory.swap.max)
    #[arg(long, value_name = "SIZE", value_parser = super::values::size)]
    pub memory_swap: Option<String>,

    /// CPU time limit in CPUs, e.g. 0.5 (cpu.max)
    #[arg(long, value_name = "N", value_parser = super::values::cpus)]
    pub cpus: Option<String>,

    /// CPUs the container may run on, e.g. 0-3,8 (cpuset.cpus)
    #[arg(long, value_name = "LIST", value_parser = super::values::cpu_list)]
    pub cpuset: Option<String>,

    /// Maximum number of tasks (pids.max)
    #[arg(
        long,
        value_name = "N",
        allow_negative_numbers = true,
        value_parser = super::values::pids
    )]
    pub pids: Option<String>,

    /// Expose a host device node (under /dev) and allow it in the device filter, or apply a CDI
    /// device (`vendor.com/class=name`, from the specs in topology.cdi_dirs)
    #[arg(long = "device", value_name = "PATH|CDI-NAME", value_parser = super::values::device)]
    pub devices: Vec<String>,

    /// GPUs to give the container: all, none, indexes (0,2), UUIDs or PCI addresses; their
    /// device nodes, the driver's libraries and tools, and the paired RDMA NICs are injected
    #[arg(long, value_name = "LIST", value_parser = super::values::gpus)]
    pub gpus: Option<String>,

    /// Network: share the host's, or a new namespace with only loopback
    #[arg(long, value_enum, default_value_t = Net::Host)]
    pub net: Net,

    /// Mount the root filesystem read-only
    #[arg(long)]
    pub readonly: bool,
}

fn flag<T>(
    name: &str,
    value: &Option<String>,
    f: impl Fn(&str) -> Result<T, spec::SpecError>,
) -> Result<Option<T>, Failure> {
    value
        .as_deref()
        .map(|v| f(v).map_err(|e| Failure::input(format!("--{name}: {e}"))))
        .transpose()
}

/// Validates the arguments against the host and builds the request.
/// A container request and the image it stacks (whose in-use mark lives as long as it).
#[derive(Debug)]
pub struct Prepared {
    pub request: Request,
    pub image: crate::slurm::container::Resolved,
    /// CDI devices (`vendor.com/class=name`) to apply to the Spec.
    pub cdi: Vec<String>,
    /// `--gpus`.
    pub gpus: Option<String>,
}

impl Prepared {
    /// The container's Spec: the request's, with the GPUs' and CDI devices' edits applied. The
    /// returned file (a loader cache with the driver's libraries) must live until the container
    /// has started.
    pub fn spec(
        &self,
        config: &Config,
    ) -> Result<(oci_spec::runtime::Spec, Option<tempfile::NamedTempFile>), Failure> {
        let mut spec = spec::build(&self.request).map_err(|e| Failure::input(e.to_string()))?;
        let cache = match &self.gpus {
            Some(list) => self.inject_gpus(&mut spec, list, config)?,
            None => None,
        };
        if !self.cdi.is_empty() {
            let applied = crate::topology::cdi::apply_names(
                &mut spec,
                &self.cdi,
                &config.topology.cdi_dirs,
                &crate::topology::Host::new("/"),
            )
            .map_err(|e| Failure::input(format!("--device: {e}")))?;
            if applied.hooks > 0 {
                eprintln!(
                    "berth: --device: {} CDI hook(s) ignored: berth does not run OCI hooks",
                    applied.hooks
                );
            }
        }
        Ok((spec, cache))
    }

    fn inject_gpus(
        &self,
        spec: &mut oci_spec::runtime::Spec,
        list: &str,
        config: &Config,
    ) -> Result<Option<tempfile::NamedTempFile>, Failure> {
        use crate::topology::inject;
        let (host, node) = super::topo::discover(&Default::default(), config)?;
        // The error quotes the list: a long one is elided there.
        let plan = inject::for_gpus(&host, &node, list, &inject::DriverFiles::default())
            .map_err(|e| Failure::input(e.to_string().replace(list, &super::elide(list))))?;
        Ok(crate::slurm::container::inject_gpus(
            spec,
            &plan,
            &self.image.lowers,
            config,
            "--gpus",
            true,
        )?)
    }
}

/// `--env KEY=VALUE`, or `--env KEY` for the caller's value of KEY.
fn env_flags(flags: &[String]) -> Result<Vec<(String, String)>, Failure> {
    let mut cli_env = Vec::new();
    for text in flags {
        if !text.contains('=') && !text.is_empty() {
            match std::env::var(text) {
                Ok(v) => cli_env.push((text.clone(), v)),
                Err(_) => {
                    return Err(Failure::input(format!(
                        "--env {}: not set in the caller's environment (use KEY=VALUE)",
                        super::elide(text)
                    )));
                }
            }
        } else {
            cli_env.push(parse::env_pair(text).map_err(|e| Failure::input(format!("--env: {e}")))?);
        }
    }
    Ok(cli_env)
}

/// The image's layers and defaults: a `--rootfs` directory as it is, or `--image` resolved (and
/// imported) for the user the container runs as.
fn image(
    args: &ContainerArgs,
    config: &Config,
    caller: &spec::UserIds,
    hold: bool,
) -> Result<crate::slurm::container::Resolved, Failure> {
    Ok(match (&args.rootfs, &args.image) {
        (Some(_), _) if args.entrypoint => {
            return Err(Failure::input(
                "--entrypoint applies to an image's Entrypoint; a --rootfs directory has none: \
                 drop --entrypoint and give the command",
            ));
        }
        (Some(_), _) if args.arch.is_some() => {
            return Err(Failure::input(
                "--arch applies to --image (the platform to pick from an image); a --rootfs \
                 directory is run as it is: drop --arch",
            ));
        }
        (Some(dir), _) => {
            runtime::check_rootfs(dir)?;
            // Absolute, so the overlay's lowerdir does not depend on the working directory.
            let dir = std::fs::canonicalize(dir).map_err(|e| {
                Failure::input(format!(
                    "root filesystem {}: {e}",
                    super::elide(&dir.to_string_lossy())
                ))
            })?;
            crate::slurm::container::Resolved {
                lowers: vec![dir],
                defaults: Default::default(),
                digest: None,
                in_use: None,
            }
        }
        (None, Some(text)) => {
            // An image path is opened as the user the container runs as (`--user`): root reads
            // no image for that user that the user could not read.
            let reader = match &args.user {
                Some(u) => {
                    spec::user::resolve(u).map_err(|e| Failure::input(format!("--user: {e}")))?
                }
                None => caller.clone(),
            };
            match text.strip_prefix("lazy:") {
                Some(_) if hold => {
                    return Err(Failure::input(
                        "a lazy image (lazy:REF) serves berth run only: its FUSE server lives in \
                         that process, and a held container outlives it",
                    ));
                }
                Some(rest) => crate::slurm::container::resolve_lazy(rest, config, &reader)?,
                None => crate::slurm::container::resolve(text, config, &reader, args.arch.clone())?,
            }
        }
        (None, None) => return Err(Failure::input("give --rootfs DIR or --image REF")),
    })
}

/// `--memory`, `--memory-swap`, `--cpus`, `--cpuset` and `--pids`.
fn resource_limits(args: &ContainerArgs) -> Result<Limits, Failure> {
    Ok(Limits {
        memory: flag("memory", &args.memory, parse::size)?,
        memory_swap: flag("memory-swap", &args.memory_swap, parse::size)?,
        cpu_quota: flag("cpus", &args.cpus, |v| parse::cpus(v, spec::CPU_PERIOD_US))?,
        cpuset: flag("cpuset", &args.cpuset, parse::cpu_list)?,
        pids: flag("pids", &args.pids, |v| {
            v.parse::<i64>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| spec::SpecError::Size(v.to_string()))
        })
        .map_err(|_| {
            Failure::input(format!(
                "--pids {}: use a positive number of tasks",
                super::elide(args.pids.as_deref().unwrap_or_default())
            ))
        })?,
    })
}

/// Validates the arguments against the host, resolves the image and builds the request.
pub fn request(
    args: &ContainerArgs,
    command: &[String],
    config: &Config,
    hold: bool,
) -> Result<Prepared, Failure> {
    if args.rootfs.is_none() && args.image.is_none() {
        return Err(Failure::input(
            "no image: give IMAGE (berth run IMAGE CMD...), --image REF or --rootfs DIR",
        ));
    }
    let mut mounts = Vec::new();
    for text in &args.mounts {
        let m = parse::bind_mount(text).map_err(|e| Failure::input(format!("--mount: {e}")))?;
        mounts.push((text, m));
    }
    let cli_env = env_flags(&args.env)?;
    if let Some(dir) = &args.workdir
        && (!dir.is_absolute() || dir.as_os_str().len() >= libc::PATH_MAX as usize)
    {
        return Err(Failure::input(format!(
            "--workdir {}: must be an absolute path, shorter than PATH_MAX",
            super::elide(&dir.to_string_lossy())
        )));
    }
    let caller = spec::user::current().map_err(|e| Failure::input(e.to_string()))?;
    let image = image(args, config, &caller, hold)?;
    let user = match (&args.user, &image.defaults.user) {
        (Some(text), _) => {
            spec::user::resolve(text).map_err(|e| Failure::input(format!("--user: {e}")))?
        }
        // An image's User applies when root starts it, as with docker; an unprivileged caller
        // always runs as itself.
        (None, Some(text)) if caller.uid == 0 => image_user(text)?,
        (None, _) => caller,
    };
    // What the user could open, as the user: root's view of a source never decides. This early
    // look only words the refusal; the runtime opens each source again as the user and mounts
    // what it opened, so a path swapped in between gains nothing.
    let mounts = mounts
        .into_iter()
        .map(
            |(text, m)| match privfs::open_readable_as_user(&m.source, &user) {
                Ok(_) => Ok(m),
                Err(e) => Err(Failure::input(format!(
                    "--mount {}: uid {} cannot read the source {}: {e}",
                    super::elide(text),
                    user.uid,
                    super::elide(&m.source.to_string_lossy())
                ))),
            },
        )
        .collect::<Result<Vec<_>, _>>()?;
    let env_limits = config.store.env_limits();
    env_limits
        .check("--env", &cli_env)
        .map_err(|e| Failure::input(e.to_string()))?;
    let mut env = image.defaults.env.clone();
    env.extend(cli_env);
    env_limits
        .check(
            "the container's environment (the image's Env and --env)",
            &env,
        )
        .map_err(|e| Failure::input(e.to_string()))?;
    let args_line = if args.image.is_some() {
        image.defaults.command_line(command, args.entrypoint)
    } else {
        command.to_vec()
    };
    if args_line.is_empty() && !hold {
        return Err(Failure::input(if args.rootfs.is_some() {
            "no command given: a --rootfs directory needs one (berth run --rootfs DIR -- CMD)"
        } else {
            "no command given, and the image defines no Entrypoint or Cmd"
        }));
    }
    let limits = resource_limits(args)?;
    let (cdi, paths): (Vec<String>, Vec<String>) = args
        .devices
        .iter()
        .cloned()
        .partition(|d| crate::topology::cdi::is_qualified(d));
    let devices = paths
        .iter()
        .map(|p| host_device(&PathBuf::from(p), &user))
        .collect::<Result<Vec<_>, _>>()?;
    let terminal = std::io::stdin().is_terminal();
    let request = Request {
        rootfs: image.lowers[0].clone(),
        args: args_line,
        env,
        workdir: args
            .workdir
            .clone()
            .or_else(|| image.defaults.workdir.clone()),
        user,
        hostname: flag("hostname", &args.hostname, parse::hostname)?,
        mounts,
        tmpfs: Vec::new(),
        devices,
        limits,
        net: args.net,
        readonly: args.readonly,
        share_pids: false,
        terminal,
        host_files: host_files(),
        term: std::env::var("TERM").ok(),
        remap_root: args.remap_root,
        cgroup_view: Vec::new(),
    };
    Ok(Prepared {
        request,
        image,
        cdi,
        gpus: args.gpus.clone(),
    })
}

/// An image's `User`: numbers are taken as they are (the image may know users the host does
/// not); names must exist on the host.
fn image_user(text: &str) -> Result<spec::UserIds, Failure> {
    let (u, g) = text.split_once(':').unwrap_or((text, ""));
    if let Ok(uid) = u.parse::<u32>() {
        let known = spec::user::by_id(uid, 0);
        let gid = match g.parse::<u32>() {
            Ok(gid) => gid,
            Err(_) if g.is_empty() => known.home.as_ref().map(|_| known.gid).unwrap_or(uid),
            Err(_) => {
                return Err(Failure::input(format!(
                    "the image's User '{}': use numbers, or names that exist on this host",
                    super::elide(text)
                )));
            }
        };
        return Ok(spec::user::by_id(uid, gid));
    }
    spec::user::resolve(text).map_err(|e| {
        Failure::input(format!(
            "the image's User '{}': {e} (or use --user)",
            super::elide(text)
        ))
    })
}

/// A device node the user asked for, opened as the user (the kernel resolves the path with the
/// user's permissions) and described from what was opened; the user must be allowed to read or
/// write it on the host, or the container would give the user a device the host does not.
fn host_device(path: &std::path::Path, user: &spec::UserIds) -> Result<HostDevice, Failure> {
    use nix::fcntl::OFlag;
    let bad = |why: String| {
        Failure::input(format!(
            "--device {}: {why}",
            super::elide(&path.to_string_lossy())
        ))
    };
    if !path.starts_with("/dev/") {
        return Err(bad("must be a device node under /dev".into()));
    }
    let fd = privfs::open_as_user(path, user, OFlag::O_PATH).map_err(|e| bad(e.to_string()))?;
    let meta = std::fs::File::from(fd.try_clone().map_err(|e| bad(e.to_string()))?)
        .metadata()
        .map_err(|e| bad(e.to_string()))?;
    let ft = meta.file_type();
    if !ft.is_char_device() && !ft.is_block_device() {
        return Err(bad("not a character or block device".into()));
    }
    let allowed = privfs::as_user(user, || {
        [libc::R_OK, libc::W_OK].iter().any(|&how| {
            // SAFETY: faccessat2 on a valid fd with an empty path and AT_EMPTY_PATH; it only
            // reads its arguments.
            unsafe {
                libc::syscall(
                    libc::SYS_faccessat2,
                    std::os::fd::AsRawFd::as_raw_fd(&fd),
                    c"".as_ptr(),
                    how,
                    libc::AT_EMPTY_PATH | libc::AT_EACCESS,
                ) == 0
            }
        })
    })
    .map_err(|e| bad(e.to_string()))?;
    if !allowed {
        return Err(bad(format!(
            "uid {} may neither read nor write it on the host",
            user.uid
        )));
    }
    let rdev = meta.rdev();
    Ok(HostDevice {
        path: path.to_path_buf(),
        block: ft.is_block_device(),
        major: i64::from(libc::major(rdev)),
        minor: i64::from(libc::minor(rdev)),
        mode: meta.mode() & 0o7777,
        uid: meta.uid(),
        gid: meta.gid(),
    })
}

/// `--timeout SECONDS`: a positive number; one too large for the clock is the farthest deadline
/// it can hold (no deadline in practice), never a panic.
fn parse_timeout(text: &Option<String>) -> Result<Option<Duration>, Failure> {
    text.as_deref()
        .map(|t| {
            t.trim()
                .parse::<f64>()
                .ok()
                .and_then(crate::time::duration_from_secs)
                .ok_or_else(|| {
                    Failure::input(format!(
                        "--timeout {}: use a positive number of seconds",
                        super::elide(t)
                    ))
                })
        })
        .transpose()
}

pub fn execute(args: &RunArgs, config: &Config, verbose: bool) -> Result<i32, Failure> {
    // Checked before the image is resolved: a bad value costs nothing.
    let timeout = parse_timeout(&args.timeout)?;
    if args.container.rootfs.is_some() && args.command.is_empty() {
        return Err(Failure::input(
            "no command given: a --rootfs directory needs one (berth run --rootfs DIR -- CMD)",
        ));
    }
    let prepared = request(&args.container, &args.command, config, false)?;
    let memory = prepared.request.limits.memory;
    let (spec, ld_cache) = prepared.spec(config)?;
    let opts = options(config, timeout);
    let outcome = runtime::run(&spec, &prepared.image.lowers, &opts).map_err(Failure::from);
    let leased = prepared.image.in_use.is_some();
    // The image's lease ends with the container: a squashfs no other container uses goes now.
    // A --rootfs directory holds no lease, and leaves no image to unmount: the store is not
    // opened on that path (it cost a walk of the store's directories per run).
    drop(ld_cache);
    drop(prepared);
    if leased {
        crate::image::mount::release_unused(&config.image());
    }
    let outcome = outcome?;
    if verbose {
        eprintln!("berth: {}", timings_line(&outcome));
        eprintln!("berth: {}", summary_line(&outcome));
    }
    match outcome.exit {
        Exit::OutOfMemory => eprintln!(
            "berth: the command ran out of memory: the kernel's OOM killer ended it at the {} limit (--memory)",
            memory.map(human_size).unwrap_or_else(|| "memory".into())
        ),
        Exit::TimedOut => eprintln!(
            "berth: timed out after {} s: the container was killed (--timeout)",
            super::elide(args.timeout.as_deref().unwrap_or("?"))
        ),
        _ => {}
    }
    Ok(outcome.exit.code())
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

fn timings_line(o: &Outcome) -> String {
    let stages: Vec<String> = o
        .timings
        .iter()
        .map(|(stage, d)| format!("{stage} {}", ms(*d)))
        .collect();
    let setup: Duration = o.timings.iter().map(|(_, d)| *d).sum();
    format!("setup: {}; total {}", stages.join(", "), ms(setup))
}

fn summary_line(o: &Outcome) -> String {
    let s = &o.stats;
    let na = || "n/a".to_string();
    format!(
        "exit {} after {}; cpu {}, memory.peak {}, pids.peak {}",
        o.exit.code(),
        ms(o.elapsed),
        s.cpu_usage_usec
            .map(|u| ms(Duration::from_micros(u)))
            .unwrap_or_else(na),
        s.memory_peak.map(human_size).unwrap_or_else(na),
        s.pids_peak.map(|p| p.to_string()).unwrap_or_else(na),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts() {
        assert_eq!(
            parse_timeout(&Some("1.5".into())).unwrap(),
            Some(Duration::from_millis(1500))
        );
        parse_timeout(&Some("0".into())).unwrap_err();
        parse_timeout(&Some("x".into())).unwrap_err();
        for huge in [
            "99999999999999999999999999",
            "18446744073709551616",
            "9223372036854775807",
            "1e308",
        ] {
            assert!(parse_timeout(&Some(huge.into())).unwrap().is_some());
        }
        for bad in ["inf", "NaN", "-1", "1e-300", ""] {
            assert!(parse_timeout(&Some(bad.into())).is_err(), "{bad}");
        }
        let long = "9".repeat(100_000) + "x";
        let Err(e) = parse_timeout(&Some(long)) else {
            panic!("a bad timeout was accepted")
        };
        assert!(e.message.len() < 300, "{}", e.message);
    }
}
