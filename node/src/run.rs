//! `berth run` and `berth create`: the container a user's flags describe, checked on the host as
//! that user (the image, bind sources, device nodes), its Spec with the GPUs' and CDI devices'
//! edits, and the run that holds the image's lease for as long as the container lives.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use berth_runtime::{Outcome, state};
use berth_spec::{self as spec, BindMount, HostDevice, Limits, Net, Request};
use berth_sys::privfs;
use berth_sys::text::elide;

use crate::NodeError;
use crate::container::{Description, Resolved, host_files, options, resolve};
use berth_config::Config;

/// The flags of `berth run`/`berth create`, parsed (values checked for form; nothing on the host
/// looked at yet).
#[derive(Debug, Default)]
pub struct Flags {
    pub rootfs: Option<PathBuf>,
    pub image: Option<String>,
    /// `--entrypoint`: the command goes after the image's Entrypoint.
    pub entrypoint: bool,
    pub arch: Option<String>,
    /// `--user` as given.
    pub user: Option<String>,
    /// Each `--mount` as given and parsed.
    pub mounts: Vec<(String, BindMount)>,
    pub env: Vec<(String, String)>,
    pub workdir: Option<PathBuf>,
    pub hostname: Option<String>,
    pub limits: Limits,
    /// `--device`: device node paths and CDI names.
    pub devices: Vec<String>,
    pub gpus: Option<String>,
    pub net: Net,
    pub readonly: bool,
    pub remap_root: bool,
    /// `--slurm` / `--no-slurm`; unset: `host_software.slurm`.
    pub slurm: Option<bool>,
    /// `--modules` / `--no-modules`; unset: `host_software.modules`.
    pub modules: Option<bool>,
    /// `--mpi=host` (true) / `--mpi=image`; unset: `host_software.mpi`.
    pub mpi: Option<bool>,
}

/// A container request and the image it stacks (whose in-use mark lives as long as it).
#[derive(Debug)]
pub struct Prepared {
    pub request: Request,
    pub image: Resolved,
    /// CDI devices (`vendor.com/class=name`) to apply to the Spec.
    pub cdi: Vec<String>,
    /// `--gpus`.
    pub gpus: Option<String>,
}

/// Checks the flags against the host, resolves (and imports) the image for the user the
/// container runs as and builds the request. `hold` (`berth create`) allows no command.
pub fn prepare(
    flags: Flags,
    command: &[String],
    config: &Config,
    hold: bool,
) -> Result<Prepared, NodeError> {
    let caller = berth_sys::user::current().map_err(|e| NodeError::input(e.to_string()))?;
    let image = image(&flags, config, &caller, hold)?;
    let user = match (&flags.user, &image.defaults.user) {
        (Some(text), _) => {
            berth_sys::user::resolve(text).map_err(|e| NodeError::input(format!("--user: {e}")))?
        }
        // An image's User applies when root starts it, as with docker; an unprivileged caller
        // always runs as itself.
        (None, Some(text)) if caller.uid == 0 => image_user(text)?,
        (None, _) => caller,
    };
    // What the user could open, as the user: root's view of a source never decides. This early
    // look only words the refusal; the runtime opens each source again as the user and mounts
    // what it opened, so a path swapped in between gains nothing.
    let mounts = flags
        .mounts
        .into_iter()
        .map(|(text, m)| {
            match berth_runtime::mounts::open_source_as_user(
                &m.source,
                &user,
                config.runtime.mount_block_devices,
            ) {
                Ok(_) => Ok(m),
                Err(e) if berth_runtime::mounts::is_block_refusal(&e) => {
                    Err(NodeError::input(format!(
                        "--mount {}: the source {} is {e}",
                        elide(&text),
                        elide(&m.source.to_string_lossy())
                    )))
                }
                Err(e) => Err(NodeError::input(format!(
                    "--mount {}: uid {} cannot read the source {}: {e}",
                    elide(&text),
                    user.uid,
                    elide(&m.source.to_string_lossy())
                ))),
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    let env_limits = config.store.env_limits();
    env_limits
        .check("--env", &flags.env)
        .map_err(|e| NodeError::input(e.to_string()))?;
    let mut env = image.defaults.env.clone();
    let slurm = flags.slurm.unwrap_or(config.host_software.slurm);
    if slurm {
        // srun inside needs the job's SLURM_* (SLURM_JOB_ID, SLURM_CONF) as srun outside does.
        env.extend(std::env::vars().filter(|(k, _)| k.starts_with("SLURM_")));
    }
    let modules = flags.modules.unwrap_or(config.host_software.modules);
    if modules {
        env.extend(crate::hostsw::module_env(std::env::vars()));
    }
    env.extend(flags.env);
    let mpi = flags.mpi.unwrap_or(config.host_software.mpi);
    if mpi {
        crate::mpi::with_library_path(&mut env);
    }
    env_limits
        .check(
            "the container's environment (the image's Env and --env)",
            &env,
        )
        .map_err(|e| NodeError::input(e.to_string()))?;
    let args_line = if flags.image.is_some() {
        image.defaults.command_line(command, flags.entrypoint)
    } else {
        command.to_vec()
    };
    if args_line.is_empty() && !hold {
        return Err(NodeError::input(if flags.rootfs.is_some() {
            "no command given: a --rootfs directory needs one (berth run --rootfs DIR -- CMD)"
        } else {
            "no command given, and the image defines no Entrypoint or Cmd"
        }));
    }
    let (cdi, paths): (Vec<String>, Vec<String>) = flags
        .devices
        .into_iter()
        .partition(|d| berth_topology::cdi::is_qualified(d));
    let devices = paths
        .iter()
        .map(|p| host_device(Path::new(p), &user))
        .collect::<Result<Vec<_>, _>>()?;
    let mut mounts = mounts;
    if slurm {
        mounts.extend(crate::hostsw::slurm_binds(
            config,
            &image.lowers,
            "--slurm",
        )?);
    }
    if modules {
        mounts.extend(crate::hostsw::module_binds(
            config,
            &image.lowers,
            "--modules",
        )?);
    }
    if mpi {
        mounts.extend(crate::mpi::mpi_binds(config, &image.lowers, "--mpi=host")?);
    }
    let request = Request {
        rootfs: image.lowers[0].clone(),
        args: args_line,
        env,
        workdir: flags.workdir.or_else(|| image.defaults.workdir.clone()),
        user,
        hostname: flags.hostname,
        mounts,
        tmpfs: Vec::new(),
        devices,
        limits: flags.limits,
        net: flags.net,
        readonly: flags.readonly,
        share_pids: false,
        terminal: std::io::stdin().is_terminal(),
        host_files: host_files(),
        term: std::env::var("TERM").ok(),
        remap_root: flags.remap_root,
        cgroup_view: Vec::new(),
    };
    Ok(Prepared {
        request,
        image,
        cdi,
        gpus: flags.gpus,
    })
}

/// Runs the prepared container to its end. The image's lease ends with the container: a
/// squashfs no other container uses is unmounted before this returns.
pub fn run(
    prepared: Prepared,
    config: &Config,
    timeout: Option<Duration>,
) -> Result<Outcome, NodeError> {
    let (spec, ld_cache) = prepared.spec(config)?;
    let opts = options(config, timeout);
    let outcome = berth_runtime::run(&spec, &prepared.image.lowers, &opts);
    let leased = prepared.image.in_use.is_some();
    // A --rootfs directory holds no lease, and leaves no image to unmount: the store is not
    // opened on that path (it cost a walk of the store's directories per run).
    drop(ld_cache);
    drop(prepared);
    if leased {
        berth_image::mount::release_unused(&config.image());
    }
    Ok(outcome?)
}

/// Creates the prepared container and leaves it up, holding its namespaces, until `berth rm`
/// (`berth create`). Its owner is the user its process runs as, not who created it; `name`, when
/// given, must not name another container of that user.
pub fn create(
    prepared: &Prepared,
    name: Option<&str>,
    config: &Config,
) -> Result<Description, NodeError> {
    let (spec, _ld_cache) = prepared.spec(config)?;
    let mut labels = state::with_uid(&BTreeMap::new(), &spec);
    if let Some(name) = name {
        if state::name_taken(&config.runtime.state_dir, name, state::host_uid(&spec)) {
            return Err(NodeError::input(format!(
                "--name {0}: a container of that name exists (berth rm {0})",
                elide(name)
            )));
        }
        labels.insert("name".to_string(), name.to_string());
    }
    let created = berth_runtime::create(
        &spec,
        &prepared.image.lowers,
        &options(config, None),
        &labels,
    )?;
    Ok(Description::new(&created, &spec))
}

impl Prepared {
    /// The container's Spec: the request's, with the GPUs' and CDI devices' edits applied. The
    /// returned file (a loader cache with the driver's libraries) must live until the container
    /// has started.
    pub fn spec(
        &self,
        config: &Config,
    ) -> Result<(oci_spec::runtime::Spec, Option<tempfile::NamedTempFile>), NodeError> {
        let mut spec = spec::build(&self.request).map_err(|e| NodeError::input(e.to_string()))?;
        let cache = match &self.gpus {
            Some(list) => self.inject_gpus(&mut spec, list, config)?,
            None => None,
        };
        if !self.cdi.is_empty() {
            let applied = berth_topology::cdi::apply_names(
                &mut spec,
                &self.cdi,
                &config.topology.cdi_dirs,
                &berth_topology::Host::new("/"),
            )
            .map_err(|e| NodeError::input(format!("--device: {e}")))?;
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
    ) -> Result<Option<tempfile::NamedTempFile>, NodeError> {
        use berth_topology::inject;
        let (host, node) = crate::source::discover(&Default::default(), config)?;
        // The error quotes the list: a long one is elided there.
        let plan = inject::for_gpus(&host, &node, list, &inject::DriverFiles::default())
            .map_err(|e| NodeError::input(e.to_string().replace(list, &elide(list))))?;
        crate::container::inject_gpus(spec, &plan, &self.image.lowers, config, "--gpus", true)
    }
}

/// The image's layers and defaults: a `--rootfs` directory as it is, or `--image` resolved (and
/// imported) for the user the container runs as.
fn image(
    flags: &Flags,
    config: &Config,
    caller: &spec::UserIds,
    hold: bool,
) -> Result<Resolved, NodeError> {
    Ok(match (&flags.rootfs, &flags.image) {
        (Some(_), _) if flags.entrypoint => {
            return Err(NodeError::input(
                "--entrypoint applies to an image's Entrypoint; a --rootfs directory has none: \
                 drop --entrypoint and give the command",
            ));
        }
        (Some(_), _) if flags.arch.is_some() => {
            return Err(NodeError::input(
                "--arch applies to --image (the platform to pick from an image); a --rootfs \
                 directory is run as it is: drop --arch",
            ));
        }
        (Some(dir), _) => {
            berth_runtime::check_rootfs(dir)?;
            // Absolute, so the overlay's lowerdir does not depend on the working directory.
            let dir = std::fs::canonicalize(dir).map_err(|e| {
                NodeError::input(format!(
                    "root filesystem {}: {e}",
                    elide(&dir.to_string_lossy())
                ))
            })?;
            Resolved {
                lowers: vec![dir],
                defaults: Default::default(),
                digest: None,
                in_use: None,
            }
        }
        (None, Some(text)) => {
            // An image path is opened as the user the container runs as (`--user`): root reads
            // no image for that user that the user could not read.
            let reader = match &flags.user {
                Some(u) => berth_sys::user::resolve(u)
                    .map_err(|e| NodeError::input(format!("--user: {e}")))?,
                None => caller.clone(),
            };
            match text.strip_prefix("lazy:") {
                Some(rest) if hold => crate::container::resolve_lazy_shared(rest, config, &reader)?,
                Some(rest) => crate::container::resolve_lazy(rest, config, &reader)?,
                None => resolve(text, config, &reader, flags.arch.clone())?,
            }
        }
        (None, None) => return Err(NodeError::input("give --rootfs DIR or --image REF")),
    })
}

/// An image's `User`: numbers are taken as they are (the image may know users the host does
/// not); names must exist on the host.
fn image_user(text: &str) -> Result<spec::UserIds, NodeError> {
    let (u, g) = text.split_once(':').unwrap_or((text, ""));
    if let Ok(uid) = u.parse::<u32>() {
        let known = berth_sys::user::by_id(uid, 0);
        let gid = match g.parse::<u32>() {
            Ok(gid) => gid,
            Err(_) if g.is_empty() => known.home.as_ref().map(|_| known.gid).unwrap_or(uid),
            Err(_) => {
                return Err(NodeError::input(format!(
                    "the image's User '{}': use numbers, or names that exist on this host",
                    elide(text)
                )));
            }
        };
        return Ok(berth_sys::user::by_id(uid, gid));
    }
    berth_sys::user::resolve(text).map_err(|e| {
        NodeError::input(format!(
            "the image's User '{}': {e} (or use --user)",
            elide(text)
        ))
    })
}

/// A device node the user asked for, opened as the user (the kernel resolves the path with the
/// user's permissions) and described from what was opened; the user must be allowed to read or
/// write it on the host, or the container would give the user a device the host does not.
fn host_device(path: &Path, user: &spec::UserIds) -> Result<HostDevice, NodeError> {
    use nix::fcntl::OFlag;
    let bad = |why: String| {
        NodeError::input(format!(
            "--device {}: {why}",
            elide(&path.to_string_lossy())
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
