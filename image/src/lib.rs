//! Images: what a container's root filesystem is made of, where it comes from, and the per-node
//! store that imports each image once. Every source (registry, archive, OCI layout, Enroot
//! squashfs, Apptainer SIF, Podman) ends as an [`Image`] in the [`store`]; `berth run --image`
//! stacks its layers (directories or mounted squashfs) as overlay lowers.
//!
//! Who writes what (kept apart so the pieces can be built and tested alone):
//! - `reference`: parsing image references into [`Reference`];
//! - `registry`: the OCI distribution client, feeding layer streams into a [`LayerSink`];
//! - `store`, `layer`, `archive`: the store, tar-layer extraction, archives and OCI layouts;
//! - `sif`, `squashfs`: Apptainer SIF and Enroot squashfs images, loop mounts, export.

pub mod archive;
pub mod config;
pub mod elf;
mod error;
pub mod export;
pub mod import;
pub mod layer;
pub mod lazy;
pub mod local;
pub mod loopdev;
pub mod mount;
pub mod peers;
pub mod record;
pub mod reference;
pub mod registry;
pub mod sif;
pub mod squashfs;
pub mod store;
pub mod synth;

use std::io::Read;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub use error::{ImageError, Kind as ErrorKind};

/// Where an image comes from, as the user wrote it (see `reference::parse`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Reference {
    /// An OCI distribution registry image: Pyxis/Enroot `[USER@][REGISTRY#]IMAGE[:TAG][@DIGEST]`
    /// or `docker://[USER@]REGISTRY/IMAGE[:TAG][@DIGEST]`.
    Registry(RegistryRef),
    /// An Enroot squashfs image file (`.sqsh`, `.squashfs`), absolute path.
    Squashfs(PathBuf),
    /// An Apptainer/Singularity SIF file, absolute path.
    Sif(PathBuf),
    /// `oci:DIR[:REF]`: an OCI image layout directory.
    OciLayout { dir: PathBuf, name: Option<String> },
    /// `oci-archive:FILE[:REF]`: a tar of an OCI image layout.
    OciArchive { file: PathBuf, name: Option<String> },
    /// `docker-archive:FILE[:REF]`: `docker save` / `podman save` output.
    DockerArchive { file: PathBuf, name: Option<String> },
    /// `podman://IMAGE[:TAG]`: the local Podman store.
    Podman(String),
    /// `dockerd://IMAGE[:TAG]`: a local Docker daemon's image.
    Dockerd(String),
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RegistryRef {
    /// Registry host[:port], e.g. `registry-1.docker.io`, `127.0.0.1:5000`, `nvcr.io`.
    pub registry: String,
    /// Repository path, e.g. `library/ubuntu`, `nvidia/pytorch`.
    pub repository: String,
    /// Tag; `latest` when neither tag nor digest was given.
    pub tag: Option<String>,
    /// `sha256:<hex>` when pinned by digest.
    pub digest: Option<String>,
    /// The `USER@` of Pyxis/Enroot syntax: whose credentials to use for this registry.
    pub user: Option<String>,
}

/// A `sha256:<64 hex>` content digest.
pub type Digest = String;

/// What a stored image is made of.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Rootfs {
    /// Extracted layer directories in overlayfs form, bottom layer first.
    Layers(Vec<PathBuf>),
    /// One squashfs filesystem (an Enroot image or a SIF partition) at `offset` in `file`.
    Squashfs {
        file: PathBuf,
        offset: u64,
        size: u64,
    },
}

/// An image in the store, ready to run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Image {
    /// Manifest digest for registry/archive images; the file's sha256 for squashfs and SIF.
    pub digest: Digest,
    /// The reference it was imported from.
    pub source: Reference,
    pub rootfs: Rootfs,
    /// The OCI image config (Env, Entrypoint, Cmd, WorkingDir, User, ...). For squashfs and SIF
    /// images it is synthesised from the files inside (/etc/environment, /etc/rc, runscript).
    pub config: oci_spec::image::ImageConfiguration,
    /// Pulled without credentials: any user may be given it from the cache.
    pub anonymous: bool,
}

/// Receives layers while an image is imported (the store implements it). Called from several
/// threads at once, one layer each.
pub trait LayerSink: Sync {
    /// The store's directory for this layer if it already holds it: the import skips it.
    fn existing_layer(&self, diff_id: &str) -> Option<PathBuf>;
    /// Extracts one uncompressed layer tar into a staging area, hashing the stream; fails if its
    /// sha256 is not `diff_id`. Nothing is visible until the returned layer is published.
    fn stage_layer(
        &self,
        diff_id: &str,
        tar: &mut dyn Read,
    ) -> Result<Box<dyn StagedLayer>, ImageError>;
}

/// A verified, extracted layer not yet visible in the store; dropping it discards it.
pub trait StagedLayer: Send {
    /// Atomically publishes the layer (rename) and returns its directory.
    fn publish(self: Box<Self>) -> Result<PathBuf, ImageError>;
}
