//! Importing any image reference into the store, and finding the stored image a user may run:
//! the one place that joins the registry client, archives, squashfs/SIF and the store.

use std::fs::File;
use std::path::{Path, PathBuf};

use nix::fcntl::OFlag;

use super::local::{FileStamp, Opened};
use super::reference::reference_key;
use super::registry::{self, ProgressMode, PullOptions};
use super::squashfs::{self, InspectOptions};
use super::store::{COMPRESSED_GROWTH, Progress, Store};
use super::{Image, ImageError, Reference, Rootfs};
use crate::config::Settings;
use crate::store::StoreError;

/// Who asks for an image: credentials come from this user's home, and a private image in the
/// cache is only handed out once the registry confirms this user's access.
#[derive(Debug)]
pub struct Requester<'a> {
    pub uid: u32,
    pub home: Option<&'a Path>,
    /// `--arch` for multi-platform images; the host's when `None`.
    pub arch: Option<String>,
}

fn client(config: &Settings<'_>, who: &Requester<'_>) -> Result<registry::Client, ImageError> {
    // A user without a home directory simply has no credentials files.
    let home = who.home.filter(|h| h.is_dir());
    // Acting for another user, berth's own environment ($ENROOT_CONFIG_PATH, …) is not theirs;
    // their files are read as them.
    registry::Client::for_uid(config.registry, who.uid, home)
}

/// Imports `reference` into `store` (a no-op when the store has it), contacting the registry for
/// registry references to learn the current digest of a tag.
pub fn import(
    store: &Store,
    reference: &Reference,
    config: &Settings<'_>,
    who: &Requester<'_>,
    progress: Progress<'_>,
) -> Result<Image, ImageError> {
    let opened = if super::local::is_local_path(reference) {
        Some(Opened::open(reference, None)?)
    } else {
        None
    };
    import_opened(store, reference, opened.as_ref(), config, who, progress)
}

/// [`import`] of a local image already opened as the user who named it (`opened`, required for
/// local references): root reads only through that fd.
pub fn import_opened(
    store: &Store,
    reference: &Reference,
    opened: Option<&Opened>,
    config: &Settings<'_>,
    who: &Requester<'_>,
    progress: Progress<'_>,
) -> Result<Image, ImageError> {
    import_unchecked(store, reference, opened, config, who, progress)
        .and_then(|image| check_usable(image, config, who))
}

/// Refuses an image a container cannot use, whenever its config is read for one (imported or
/// found stored): an `Env` past `store.max_env_entries`/`max_env_bytes` (a hostile image costs
/// one line, not minutes of CPU merging its environment), or layers built for another
/// architecture than the host's or `--arch`'s (archives and layouts as registries; a squashfs
/// says nothing of its architecture).
pub fn check_usable(
    image: Image,
    config: &Settings<'_>,
    who: &Requester<'_>,
) -> Result<Image, ImageError> {
    if let Some(env) = image
        .config
        .config()
        .as_ref()
        .and_then(|c| c.env().as_ref())
    {
        config
            .store
            .env_limits()
            .check(&format!("image {}: its config", image.digest), env)
            .map_err(|e| ImageError::Format(e.to_string()))?;
    }
    if matches!(image.rootfs, Rootfs::Layers(_)) {
        let want = match &who.arch {
            Some(a) => registry::manifest::Wanted::parse(a).map_err(|e| {
                ImageError::Format(format!(
                    "--arch: {}",
                    berth_sys::text::elide(&e.to_string())
                ))
            })?,
            None => registry::manifest::Wanted::host(),
        };
        registry::check_architecture(&image.config, &want, who.arch.is_some()).map_err(|e| {
            ImageError::Format(format!("image {}: {e}", reference_key(&image.source)))
        })?;
    }
    Ok(image)
}

fn import_unchecked(
    store: &Store,
    reference: &Reference,
    opened: Option<&Opened>,
    config: &Settings<'_>,
    who: &Requester<'_>,
    progress: Progress<'_>,
) -> Result<Image, ImageError> {
    match reference {
        Reference::Registry(r) => {
            let client = client(config, who)?;
            let options = PullOptions {
                arch: who.arch.clone(),
                progress: ProgressMode::Auto,
            };
            let resolved = client.resolve(r, &options)?;
            // The config's Env is bounded before any layer is fetched.
            if let Some(env) = resolved
                .config
                .config()
                .as_ref()
                .and_then(|c| c.env().as_ref())
            {
                config
                    .store
                    .env_limits()
                    .check(&format!("image {r}: its config"), env)
                    .map_err(|e| ImageError::Format(e.to_string()))?;
            }
            let digest = resolved.manifest_digest.clone();
            store.check_layers(&r.to_string(), resolved.layer_count())?;
            store.import_with(&digest, reference, progress, |s| {
                s.check_space(
                    &r.to_string(),
                    resolved.download_size().saturating_mul(COMPRESSED_GROWTH),
                )?;
                let pulled = client.fetch(resolved, &options, s)?;
                Ok(Image {
                    digest: pulled.manifest_digest,
                    source: reference.clone(),
                    rootfs: Rootfs::Layers(pulled.layers),
                    config: pulled.config,
                    anonymous: pulled.anonymous,
                })
            })
        }
        Reference::Squashfs(path) | Reference::Sif(path) => {
            let opened = opened.ok_or_else(|| {
                StoreError::Message(format!(
                    "internal error: {} was not opened before import",
                    path.display()
                ))
            })?;
            if let Some(image) = store.get_stamped(reference, Some(&opened.stamp)) {
                return Ok(image);
            }
            let read = opened.fd_path();
            let image = if matches!(reference, Reference::Sif(_)) {
                squashfs::inspect_sif_at(&read, path)?
            } else {
                squashfs::inspect_squashfs_at(
                    &read,
                    path,
                    &InspectOptions {
                        enroot_entrypoint: config.squashfs.enroot_entrypoint,
                    },
                )?
            };
            let digest = image.digest.clone();
            store.import_stamped(&digest, reference, Some(&opened.stamp), progress, |_| {
                Ok(image)
            })
        }
        r if super::local::is_local_path(r) => {
            super::archive::import_opened(store, reference, opened, progress)
        }
        _ => super::archive::import(store, reference, progress),
    }
}

/// The stored image for `reference` that `who` may use, importing it when missing (or when a
/// private cached copy is not confirmed for this user).
///
/// A local reference must come `opened` as the user (see [`Opened::open`]): only the file that
/// user opened is looked up (by its stamp) and read, so a user never gets an image stored from
/// a path they cannot read.
pub fn get_or_import(
    store: &Store,
    reference: &Reference,
    opened: Option<&Opened>,
    config: &Settings<'_>,
    who: &Requester<'_>,
    progress: Progress<'_>,
) -> Result<Image, ImageError> {
    if super::local::is_local_path(reference) && opened.is_none() {
        return Err(ImageError::Store(StoreError::Message(format!(
            "internal error: {} was not opened as uid {}",
            reference_key(reference),
            who.uid
        ))));
    }
    let stamp = opened.map(|o| &o.stamp);
    let cached = store.get_for_stamped(reference, stamp, who.uid, |_| match reference {
        Reference::Registry(r) => Ok(client(config, who)?.check_access(r)?),
        _ => Ok(true),
    })?;
    match cached {
        Some(image) => check_usable(image, config, who),
        None => import_opened(store, reference, opened, config, who, progress),
    }
}

/// The overlay lowers of an image, topmost first: its layer directories, or the mount of its
/// squashfs made from `opened` (the file the user opened for it; a squashfs the store keeps
/// itself, under its `files/`, is opened by root). See [`super::mount::mount_opened`] for which
/// mounts are shared between users.
pub fn lowers(
    image: &Image,
    opened: Option<&Opened>,
    store: &Store,
    config: &Settings<'_>,
) -> Result<Vec<PathBuf>, ImageError> {
    match &image.rootfs {
        Rootfs::Layers(layers) => Ok(layers.iter().rev().cloned().collect()),
        Rootfs::Squashfs { file, offset, size } => {
            let own;
            let opened = match opened {
                Some(o) => o,
                None if file.starts_with(store.files_dir()) => {
                    let fd = nix::fcntl::open(
                        file,
                        OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                        nix::sys::stat::Mode::empty(),
                    )
                    .map_err(|e| ImageError::Io {
                        path: file.clone(),
                        source: e.into(),
                    })?;
                    let f = File::from(fd);
                    let stamp = FileStamp::of_file(&f).map_err(|source| ImageError::Io {
                        path: file.clone(),
                        source,
                    })?;
                    own = Opened {
                        file: f,
                        user: None,
                        stamp,
                    };
                    &own
                }
                None => {
                    return Err(ImageError::Store(StoreError::Message(format!(
                        "image {}: its squashfs {} must be named by its path, opened as the user",
                        image.digest,
                        file.display()
                    ))));
                }
            };
            let dir = super::mount::mount_opened(
                &image.digest,
                &opened.file,
                file,
                *offset,
                *size,
                opened
                    .user
                    .as_ref()
                    .map_or_else(|| nix::unistd::geteuid().as_raw(), |u| u.uid),
                &config.squashfs.mount_dir,
            )
            .map_err(|e| StoreError::Message(e.to_string()))?;
            Ok(vec![dir])
        }
    }
}
