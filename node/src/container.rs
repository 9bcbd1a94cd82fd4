//! What every container of a node needs before the runtime makes it: the image a user names
//! (`--image`, `--container-image`) as root filesystem layers and defaults, imported into the
//! node's store when needed; the runtime's options; the host files every container gets; and the
//! description of a made container that joining processes read.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use berth_image::ErrorKind;
use berth_image::import::{self, Requester};
use berth_image::local::Opened;
use berth_image::reference;
use berth_image::store::{InUse, Store};
use berth_spec::UserIds;
use berth_spec::image::ImageDefaults;

use crate::NodeError;
use berth_config::Config;

/// An image ready to stack: overlay lowers, topmost first, and its config's defaults.
#[derive(Debug)]
pub struct Resolved {
    pub lowers: Vec<PathBuf>,
    pub defaults: ImageDefaults,
    pub digest: Option<String>,
    /// Keeps the image from garbage collection (or a directory image attached) while the
    /// container runs.
    pub in_use: Option<Held>,
}

/// What a resolved image holds until its container has started (or ended).
#[derive(Debug)]
pub enum Held {
    /// A stored image marked in use.
    Image(InUse),
    /// A directory image, attached where root alone reaches it.
    Directory(berth_image::mount::DirectoryMount),
    /// A lazily loaded image (`lazy:REF`) of `berth run`: its FUSE and squashfs mounts, this
    /// process's own.
    Lazy(Box<berth_image::lazy::LazyMount>),
    /// A lazily loaded image served by the node's server of it: the use the container's init
    /// inherits (image::lazy::server).
    LazyShared(Box<berth_image::lazy::server::Attached>),
}

/// Resolves an image for `user`. A directory is used as the root filesystem itself (berth's
/// extension to Pyxis's syntax); anything else is an image reference for the store. Whatever
/// names a path on the node (a directory, `.sqsh`, `.sif`, `oci:`, `oci-archive:`,
/// `docker-archive:`) is opened with `user`'s credentials and read by root only through that fd
/// (DESIGN.md, "Privilege model"), so a user reaches no image they could not read themselves,
/// even one the store already holds.
pub fn resolve(
    text: &str,
    config: &Config,
    user: &UserIds,
    arch: Option<String>,
) -> Result<Resolved, NodeError> {
    let path = PathBuf::from(text);
    if path.is_absolute() {
        match berth_sys::privfs::open_readable_as_user(&path, user) {
            Ok(dir) if dir.metadata().is_ok_and(|m| m.is_dir()) => {
                // The overlay gets exactly the directory the user opened, whatever is renamed or
                // swapped at its path meanwhile: a copy of its mount taken from the fd, attached
                // in root's own directory until the container has its own copy.
                let tree = detached_tree(&dir).map_err(|e| {
                    NodeError::host(format!("image {text}: taking the directory's mount: {e}"))
                })?;
                let attached =
                    berth_image::mount::attach_directory(&tree, &path, &config.squashfs.mount_dir)
                        .map_err(|e| NodeError::host(e.to_string()))?;
                return Ok(Resolved {
                    lowers: vec![attached.path().to_path_buf()],
                    defaults: ImageDefaults::default(),
                    digest: None,
                    in_use: Some(Held::Directory(attached)),
                });
            }
            Ok(_) => {}
            Err(e) if path.is_dir() => {
                return Err(NodeError::input(format!(
                    "image {text}: uid {} cannot read this directory ({e}); give an image the job's user can read",
                    user.uid
                )));
            }
            Err(_) => {}
        }
    }
    if let Some(rest) = text.strip_prefix("lazy:") {
        return resolve_lazy_shared(rest, config, user);
    }
    let reference = reference::parse(text).map_err(NodeError::Image)?;
    let opened = if berth_image::local::is_local_path(&reference) {
        Some(Opened::open(&reference, Some(user)).map_err(|e| match e {
            e if e.kind() == ErrorKind::Format => NodeError::Input(e.to_string()),
            other => NodeError::Image(other),
        })?)
    } else {
        None
    };
    let store = Store::open(&config.store).map_err(NodeError::Image)?;
    let who = Requester {
        uid: user.uid,
        home: user.home.as_deref(),
        arch,
    };
    let progress = |line: &str| tracing::info!("{line}");
    let image = import::get_or_import(
        &store,
        &reference,
        opened.as_ref(),
        &config.image(),
        &who,
        &progress,
    )
    .map_err(NodeError::Image)?;
    let in_use = store.use_image(&image.digest).map_err(NodeError::Image)?;
    let lowers = import::lowers(&image, opened.as_ref(), &store, &config.image())
        .map_err(NodeError::Image)?;
    Ok(Resolved {
        lowers,
        defaults: ImageDefaults::from_config(&image.config),
        digest: Some(image.digest),
        in_use: Some(Held::Image(in_use)),
    })
}

/// `lazy:REF` (`text` is REF): the lazy form `berth lazy publish` made of an image, mounted for
/// this process with `user`'s credentials (image::lazy); its chunks come as the container reads
/// them. For `berth run`: the mounts last as long as this process.
pub fn resolve_lazy(text: &str, config: &Config, user: &UserIds) -> Result<Resolved, NodeError> {
    let r = match reference::parse(text).map_err(NodeError::Image)? {
        berth_image::Reference::Registry(r) => r,
        _ => {
            return Err(NodeError::input(format!(
                "image lazy:{text}: lazy: names a registry image (lazy:docker://REGISTRY/REPO:TAG)"
            )));
        }
    };
    let mount =
        berth_image::lazy::LazyMount::open(&r, &config.image(), user.uid, user.home.as_deref())
            .map_err(NodeError::Image)?;
    Ok(Resolved {
        lowers: vec![mount.root.clone()],
        defaults: ImageDefaults::from_config(&mount.config),
        digest: Some(mount.digest.clone()),
        in_use: Some(Held::Lazy(Box::new(mount))),
    })
}

/// `lazy:REF` for a container that outlives this process (`berth create`, a Slurm step): the
/// node's server of the image, started if none runs, after `user`'s credentials fetched its
/// manifest and index (image::lazy::server).
pub fn resolve_lazy_shared(
    text: &str,
    config: &Config,
    user: &UserIds,
) -> Result<Resolved, NodeError> {
    let r = match reference::parse(text).map_err(NodeError::Image)? {
        berth_image::Reference::Registry(r) => r,
        _ => {
            return Err(NodeError::input(format!(
                "image lazy:{text}: lazy: names a registry image (lazy:docker://REGISTRY/REPO:TAG)"
            )));
        }
    };
    let attached = berth_image::lazy::server::attach(
        text,
        &r,
        &config.image(),
        user.uid,
        user.home.as_deref(),
        &lazy_node(config),
    )
    .map_err(NodeError::Image)?;
    Ok(Resolved {
        lowers: vec![attached.root.clone()],
        defaults: ImageDefaults::from_config(&attached.config),
        digest: Some(attached.digest.clone()),
        in_use: Some(Held::LazyShared(Box::new(attached))),
    })
}

/// Where this node's lazy image servers keep their files, and the cgroup they run in.
pub fn lazy_node(config: &Config) -> berth_image::lazy::server::Node {
    berth_image::lazy::server::Node {
        run_dir: config.runtime.state_dir.join("lazy"),
        cgroup: Some(config.cgroup.root()),
    }
}

/// A detached copy (`open_tree` OPEN_TREE_CLONE) of the mount at the open directory `dir`, rooted
/// at it: taken from the fd, never by a path a user can change.
fn detached_tree(dir: &std::fs::File) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::{AsRawFd, FromRawFd};
    const OPEN_TREE_CLONE: libc::c_uint = 1;
    let flags =
        OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint | libc::AT_EMPTY_PATH as libc::c_uint;
    // SAFETY: open_tree on an open fd with an empty NUL-terminated path; returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_open_tree, dir.as_raw_fd(), c"".as_ptr(), flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(std::io::Error::other)?;
    // SAFETY: the kernel just returned this fd, owned by nobody else.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// Host files every container sees read-only, as docker gives them.
const HOST_FILES: [&str; 3] = ["/etc/hosts", "/etc/resolv.conf", "/etc/hostname"];

/// The host files every container gets read-only, those that exist here.
pub fn host_files() -> Vec<PathBuf> {
    HOST_FILES
        .iter()
        .map(PathBuf::from)
        .filter(|p| p.is_file())
        .collect()
}

/// The runtime's options from the config.
pub fn options(config: &Config, timeout: Option<Duration>) -> berth_runtime::Options {
    berth_runtime::Options {
        cgroup_root: config.cgroup.root(),
        state_dir: config.runtime.state_dir.clone(),
        timeout,
        kill_timeout: Duration::from_secs(config.runtime.kill_timeout_s),
        block_device_mounts: config.runtime.mount_block_devices,
        user_namespace: config.runtime.user_namespace,
    }
}

/// What a joining process needs to know, as `berth create --json` and `berth step create` print it.
#[derive(Debug, Serialize)]
pub struct Description {
    pub id: String,
    pub pid: i32,
    pub namespaces: BTreeMap<String, String>,
    pub env: Vec<String>,
    pub cwd: String,
    /// What the image's entrypoint printed, when it ran and its output was asked for
    /// (`--container-entrypoint-log`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entrypoint_log: Option<String>,
}

impl Description {
    pub fn new(created: &berth_runtime::Created, spec: &oci_spec::runtime::Spec) -> Self {
        let process = spec.process().as_ref();
        Self {
            id: created.id.clone(),
            pid: created.pid,
            namespaces: berth_runtime::join::namespaces_to_join(created.pid),
            env: process.and_then(|p| p.env().clone()).unwrap_or_default(),
            cwd: process
                .map(|p| p.cwd().display().to_string())
                .unwrap_or_else(|| "/".into()),
            entrypoint_log: None,
        }
    }
}

/// Gives the container the GPUs of `plan` (device nodes, the driver's files) and a loader cache
/// that finds the driver's libraries beside the image's own (every user reads it). The returned
/// file
/// backs the container's /etc/ld.so.cache until the container has been created; without driver
/// libraries to add there is none unless `always_cache` (`berth run --gpus` gives one always).
/// `what` names the request in errors and warnings (`--gpus`, "the step's GPUs").
pub fn inject_gpus(
    spec: &mut oci_spec::runtime::Spec,
    plan: &berth_topology::inject::Plan,
    lowers: &[PathBuf],
    config: &Config,
    what: &str,
    always_cache: bool,
) -> Result<Option<tempfile::NamedTempFile>, NodeError> {
    use berth_topology::inject;
    // What fails from here is the node's (its driver files, the state directory), not the job's.
    let fail = |e: &dyn std::fmt::Display| NodeError::host(format!("{what}: {e}"));
    for w in &plan.warnings {
        tracing::warn!("{what}: {w}");
    }
    inject::apply(spec, plan).map_err(|e| fail(&e))?;
    if plan.libraries.is_empty() && !always_cache {
        return Ok(None);
    }
    let image_cache = inject::read_image_loader_cache(lowers).map_err(|e| fail(&e))?;
    let (bytes, warning) = inject::container_loader_cache(image_cache.as_deref(), plan);
    if let Some(w) = warning {
        tracing::warn!("{what}: {w}");
    }
    // The bind mount keeps the file's inode: it may be deleted once the container started.
    // Root's alone (state::open_root): only root can touch the file bind-mounted by path.
    berth_runtime::state::open_root(&config.runtime.state_dir).map_err(|e| fail(&e))?;
    let mut file =
        tempfile::NamedTempFile::new_in(&config.runtime.state_dir).map_err(|e| fail(&e))?;
    std::io::Write::write_all(&mut file, &bytes).map_err(|e| fail(&e))?;
    // Every user of the container reads the loader cache.
    std::fs::set_permissions(
        file.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o644),
    )
    .map_err(|e| fail(&e))?;
    inject::mount_loader_cache(spec, file.path()).map_err(|e| fail(&e))?;
    Ok(Some(file))
}
