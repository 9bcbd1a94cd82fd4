//! The image store's failures: one line each, naming the image, layer or store path and what to
//! do; held by [`crate::ImageError::Store`].

use std::io;
use std::path::PathBuf;

use crate::ImageError;

/// A store failure (space, locks, corrupt entries, limits, a layer that would not extract).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A store failure told in words.
    #[error("{0}")]
    Message(String),
    #[error("image store {root}: {op}: {source}")]
    StoreIo {
        root: PathBuf,
        op: String,
        source: io::Error,
    },
    #[error(
        "not enough space in the image store {root} for {what}: it needs about {needed} and {free} are free; remove images (berth images gc --max-size SIZE) or give the store more space"
    )]
    NoSpace {
        root: PathBuf,
        what: String,
        needed: String,
        free: String,
    },
    #[error(
        "the image store {root} ran out of space while extracting layer {layer} ({free} free); nothing partial was kept: remove images (berth images gc --max-size SIZE) or give the store more space"
    )]
    FullDuringExtract {
        root: PathBuf,
        layer: String,
        free: String,
    },
    #[error("layer {layer}: {source}")]
    Layer {
        layer: String,
        source: Box<ImageError>,
    },
    #[error(
        "layer {layer}: its content has digest {actual}, not the expected diff_id: the image is corrupt; nothing was kept"
    )]
    DiffIdMismatch { layer: String, actual: String },
    #[error("no image '{0}' in the store (berth images ls lists them)")]
    NotStored(String),
    #[error("image {0} is in use by a running container: stop it first")]
    InUse(String),
    #[error("'{0}' matches several images ({1}): give more of the digest")]
    AmbiguousDigest(String, String),
    #[error("image record {path}: {why}: remove it with berth images rm {digest}")]
    CorruptRecord {
        path: PathBuf,
        digest: String,
        why: String,
    },
    #[error("invalid digest '{0}': expected sha256:<64 hex digits>")]
    BadDigest(String),
    #[error(
        "image {what}: it has {count} layers, more than store.max_layers ({max}) allows (overlayfs stacks about 500): nothing was fetched; flatten the image, or raise store.max_layers in berth.toml"
    )]
    TooManyLayers {
        what: String,
        count: usize,
        max: usize,
    },
    #[error(
        "layer {layer}: it expands to more than store.max_layer_bytes ({max}); nothing partial was kept: raise store.max_layer_bytes in berth.toml if the image is trusted"
    )]
    LayerTooLarge { layer: String, max: String },
    #[error(
        "layer {layer}: the image's layers expand to more than store.max_image_bytes ({max}); nothing partial was kept: raise store.max_image_bytes in berth.toml if the image is trusted"
    )]
    ImageTooLarge { layer: String, max: String },
    #[error(
        "the image store {root}: {what} would leave less than store.reserve_bytes ({reserve}) free on its file system ({free} free); nothing partial was kept: remove images (berth images gc --max-size SIZE), give the store more space, or lower store.reserve_bytes"
    )]
    Reserve {
        root: PathBuf,
        what: String,
        reserve: String,
        free: String,
    },
    #[error("{0}: the target is in neither this layer nor a lower one; the image is broken")]
    HardlinkMissing(String),
}
