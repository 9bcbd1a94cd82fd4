//! `berth run`: run one command in a new container and exit with its status.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::Failure;
use crate::config::Config;
use crate::image::store::human_size;
use crate::node::run::Flags;
pub use crate::node::run::Prepared;
use crate::runtime::{Exit, Outcome};
use crate::spec::{Limits, Net, parse};

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
    pub timeout: Option<Duration>,

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
    pub memory: Option<u64>,

    /// Swap allowed on top of --memory (memory.swap.max)
    #[arg(long, value_name = "SIZE", value_parser = super::values::size)]
    pub memory_swap: Option<u64>,

    /// CPU time limit in CPUs, e.g. 0.5 (cpu.max)
    #[arg(long, value_name = "N", value_parser = super::values::cpus)]
    pub cpus: Option<i64>,

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
    pub pids: Option<i64>,

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

    /// The host's Slurm commands inside: the client files host_software.slurm_paths names,
    /// bound read-only, and the caller's SLURM_* environment [default: host_software.slurm]
    #[arg(long)]
    pub slurm: bool,

    /// No host Slurm commands inside, whatever host_software.slurm says
    #[arg(long, conflicts_with = "slurm")]
    pub no_slurm: bool,

    /// Lmod inside: Lmod and the module trees host_software.module_paths names, bound
    /// read-only, and the caller's MODULEPATH, LMOD_* and BASH_ENV, so `module load` works in
    /// bash [default: host_software.modules]
    #[arg(long)]
    pub modules: bool,

    /// No Lmod inside, whatever host_software.modules says
    #[arg(long, conflicts_with = "modules")]
    pub no_modules: bool,

    /// Whose MPI the container's programs run on: host binds the node's MPI
    /// (host_software.mpi_libraries and mpi_paths, read-only, first in LD_LIBRARY_PATH) after
    /// an ABI and glibc check; image keeps the image's [default: host_software.mpi]
    #[arg(long, value_name = "host|image", value_parser = ["host", "image"])]
    pub mpi: Option<String>,
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

/// `--memory`, `--memory-swap`, `--cpus`, `--cpuset` and `--pids`, as clap parsed them.
fn resource_limits(args: &ContainerArgs) -> Limits {
    Limits {
        memory: args.memory,
        memory_swap: args.memory_swap,
        cpu_quota: args.cpus,
        cpuset: args.cpuset.clone(),
        pids: args.pids,
    }
}

/// Parses the flags and hands them to the library, which checks them against the host, resolves
/// the image and builds the request.
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
        mounts.push((text.clone(), m));
    }
    let env = env_flags(&args.env)?;
    let flags = Flags {
        rootfs: args.rootfs.clone(),
        // The site's lazy forms (registry.lazy_tag_suffix), looked up with the caller's logins.
        image: args.image.as_deref().map(|text| {
            crate::node::lazy::site_form_for_caller(text, config).unwrap_or_else(|| text.into())
        }),
        entrypoint: args.entrypoint,
        arch: args.arch.clone(),
        user: args.user.clone(),
        mounts,
        env,
        workdir: args.workdir.clone(),
        hostname: args.hostname.clone(),
        limits: resource_limits(args),
        devices: args.devices.clone(),
        gpus: args.gpus.clone(),
        net: args.net,
        readonly: args.readonly,
        remap_root: args.remap_root,
        slurm: (args.slurm || args.no_slurm).then_some(args.slurm),
        modules: (args.modules || args.no_modules).then_some(args.modules),
        mpi: args.mpi.as_deref().map(|m| m == "host"),
    };
    Ok(crate::node::run::prepare(flags, command, config, hold)?)
}

pub fn execute(args: &RunArgs, config: &Config, verbose: bool) -> Result<i32, Failure> {
    let timeout = args.timeout;
    if args.container.rootfs.is_some() && args.command.is_empty() {
        return Err(Failure::input(
            "no command given: a --rootfs directory needs one (berth run --rootfs DIR -- CMD)",
        ));
    }
    let prepared = request(&args.container, &args.command, config, false)?;
    let memory = prepared.request.limits.memory;
    let outcome = crate::node::run::run(prepared, config, timeout)?;
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
            timeout.map_or(0.0, |t| t.as_secs_f64())
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
        use crate::cli::values::seconds;
        assert_eq!(seconds("1.5").unwrap(), Duration::from_millis(1500));
        seconds("0").unwrap_err();
        seconds("x").unwrap_err();
        for huge in [
            "99999999999999999999999999",
            "18446744073709551616",
            "9223372036854775807",
            "1e308",
        ] {
            seconds(huge).unwrap();
        }
        for bad in ["inf", "NaN", "-1", "1e-300", ""] {
            assert!(seconds(bad).is_err(), "{bad}");
        }
        let long = "9".repeat(100_000) + "x";
        let Err(e) = seconds(&long) else {
            panic!("a bad timeout was accepted")
        };
        assert!(e.len() < 300, "{e}");
    }
}
