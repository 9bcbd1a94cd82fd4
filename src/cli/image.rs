//! Turns what a user names as an image (`--image`, `--container-image`) into root filesystem
//! layers and the image's defaults, importing it into the node's store when needed.

use std::path::PathBuf;

use super::Failure;
use super::import::failure;
use crate::config::Config;
use crate::image::import::{self, Requester};
use crate::image::reference;
use crate::image::store::{InUse, Store};
use crate::spec::UserIds;
use crate::spec::image::ImageDefaults;

/// An image ready to stack: overlay lowers, topmost first, and its config's defaults.
pub struct Resolved {
    pub lowers: Vec<PathBuf>,
    pub defaults: ImageDefaults,
    pub digest: Option<String>,
    /// Keeps the image from garbage collection while the container runs.
    pub in_use: Option<InUse>,
}

/// Resolves an image for `user`. A directory is used as the root filesystem itself (berth's
/// extension to Pyxis's syntax); anything else is an image reference for the store.
pub fn resolve(
    text: &str,
    config: &Config,
    user: &UserIds,
    arch: Option<String>,
) -> Result<Resolved, Failure> {
    let path = PathBuf::from(text);
    if path.is_absolute() && path.is_dir() {
        if !crate::spec::user::can_read(&path, user) {
            return Err(Failure::input(format!(
                "image {text}: uid {} cannot read this directory",
                user.uid
            )));
        }
        let dir = std::fs::canonicalize(&path)
            .map_err(|e| Failure::input(format!("image {text}: {e}")))?;
        return Ok(Resolved {
            lowers: vec![dir],
            defaults: ImageDefaults::default(),
            digest: None,
            in_use: None,
        });
    }
    let reference = reference::parse(text).map_err(failure)?;
    if let crate::image::Reference::Squashfs(p) | crate::image::Reference::Sif(p) = &reference
        && !crate::spec::user::can_read(p, user)
    {
        return Err(Failure::input(format!(
            "image {text}: uid {} cannot read this file (or it does not exist)",
            user.uid
        )));
    }
    let store = Store::open(&config.store).map_err(failure)?;
    let who = Requester {
        uid: user.uid,
        home: user.home.as_deref(),
        arch,
    };
    let progress = |line: &str| tracing::info!("{line}");
    let image =
        import::get_or_import(&store, &reference, config, &who, &progress).map_err(failure)?;
    let in_use = store.use_image(&image.digest).map_err(failure)?;
    let lowers = import::lowers(&image, config).map_err(failure)?;
    Ok(Resolved {
        lowers,
        defaults: ImageDefaults::from_config(&image.config),
        digest: Some(image.digest),
        in_use: Some(in_use),
    })
}
