//! Turns what a user names as an image (`--image`, `--container-image`) into root filesystem
//! layers and the image's defaults.

use std::path::PathBuf;

use super::Failure;
use crate::config::Config;
use crate::spec::UserIds;
use crate::spec::image::ImageDefaults;

/// An image ready to stack: overlay lowers, topmost first, and its config's defaults.
pub struct Resolved {
    pub lowers: Vec<PathBuf>,
    pub defaults: ImageDefaults,
}

/// Resolves an image for `user`. A directory is used as the root filesystem itself (berth's
/// extension to Pyxis's syntax).
pub fn resolve(text: &str, _config: &Config, user: &UserIds) -> Result<Resolved, Failure> {
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
        });
    }
    Err(Failure::input(format!(
        "image {text}: not a directory, and the image store is not built into this berth yet"
    )))
}
