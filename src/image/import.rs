//! Importing any image reference into the store, and finding the stored image a user may run:
//! the one place that joins the registry client, archives, squashfs/SIF and the store.

use std::path::{Path, PathBuf};

use super::registry::{self, ProgressMode, PullOptions};
use super::squashfs::{self, InspectOptions};
use super::store::{COMPRESSED_GROWTH, Progress, Store};
use super::{Image, ImageError, Reference, Rootfs};
use crate::config::Config;

/// Who asks for an image: credentials come from this user's home, and a private image in the
/// cache is only handed out once the registry confirms this user's access.
pub struct Requester<'a> {
    pub uid: u32,
    pub home: Option<&'a Path>,
    /// `--arch` for multi-platform images; the host's when `None`.
    pub arch: Option<String>,
}

fn client(config: &Config, who: &Requester<'_>) -> Result<registry::Client, ImageError> {
    // A user without a home directory simply has no credentials files.
    let home = who.home.filter(|h| h.is_dir());
    if who.uid == nix::unistd::getuid().as_raw() {
        registry::Client::new(&config.registry, home)
    } else {
        // Acting for another user: berth's own $ENROOT_CONFIG_PATH is not theirs.
        registry::Client::with_enroot_config(&config.registry, home, None)
    }
    .map_err(ImageError::from)
}

/// Imports `reference` into `store` (a no-op when the store has it), contacting the registry for
/// registry references to learn the current digest of a tag.
pub fn import(
    store: &Store,
    reference: &Reference,
    config: &Config,
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
            let digest = resolved.manifest_digest.clone();
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
            if let Some(image) = store.get(reference) {
                return Ok(image);
            }
            let image = if matches!(reference, Reference::Sif(_)) {
                squashfs::inspect_sif(path)?
            } else {
                squashfs::inspect_squashfs_with(
                    path,
                    &InspectOptions {
                        enroot_entrypoint: config.squashfs.enroot_entrypoint,
                    },
                )?
            };
            let digest = image.digest.clone();
            store.import_with(&digest, reference, progress, |_| Ok(image))
        }
        _ => store.import(reference, progress),
    }
}

/// The stored image for `reference` that `who` may use, importing it when missing (or when a
/// private cached copy is not confirmed for this user).
pub fn get_or_import(
    store: &Store,
    reference: &Reference,
    config: &Config,
    who: &Requester<'_>,
    progress: Progress<'_>,
) -> Result<Image, ImageError> {
    let cached = store.get_for(reference, who.uid, |_| match reference {
        Reference::Registry(r) => Ok(client(config, who)?.check_access(r)?),
        _ => Ok(true),
    })?;
    match cached {
        Some(image) => Ok(image),
        None => import(store, reference, config, who, progress),
    }
}

/// The overlay lowers of an image, topmost first: its layer directories, or the shared mount
/// of its squashfs.
pub fn lowers(image: &Image, config: &Config) -> Result<Vec<PathBuf>, ImageError> {
    match &image.rootfs {
        Rootfs::Layers(layers) => Ok(layers.iter().rev().cloned().collect()),
        rootfs @ Rootfs::Squashfs { .. } => {
            let dir = super::mount::mount_shared(&image.digest, rootfs, &config.squashfs.mount_dir)
                .map_err(|e| ImageError::Store(e.to_string()))?;
            Ok(vec![dir])
        }
    }
}
