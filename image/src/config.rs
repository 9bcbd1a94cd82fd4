//! The image sections of berth.toml (`[registry]`, `[store]`, `[squashfs]`): what an import and
//! the store need, read by the binary's configuration and passed down as [`Settings`].

use std::path::PathBuf;

use serde::Deserialize;

use crate::ImageError;

/// The image sections of the node's configuration, borrowed from it.
#[derive(Clone, Copy, Debug)]
pub struct Settings<'a> {
    pub registry: &'a RegistryConfig,
    pub store: &'a StoreConfig,
    pub squashfs: &'a SquashfsConfig,
}

/// How images are pulled from OCI distribution registries (`image::registry`).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct RegistryConfig {
    /// berth's own netrc-style credentials file (`machine HOST login USER password PASS`); `~`
    /// is the home of the user who asked for the image. Read before Enroot's file.
    pub credentials: String,
    /// Also read Enroot's credentials file, `$ENROOT_CONFIG_PATH/.credentials`
    /// (default `~/.config/enroot/.credentials`), so Pyxis users keep their logins.
    pub enroot_credentials: bool,
    /// PEM files of extra certificate authorities trusted for registries, on top of the system's.
    pub ca_files: Vec<PathBuf>,
    /// Registries (`HOST[:PORT]`, exactly as in image references) spoken to over plain HTTP.
    /// Every other registry must use TLS.
    pub insecure: Vec<String>,
    /// Layers downloaded at once per image.
    pub parallel_downloads: usize,
    /// Seconds to wait for a TCP (and TLS) connection.
    pub connect_timeout_s: u64,
    /// Seconds a response may stall (no byte received) before the transfer is retried.
    pub read_timeout_s: u64,
    /// Attempts per request on server errors (5xx, 429) and dropped connections; a dropped layer
    /// download resumes where it stopped.
    pub retries: u32,
    /// Delay before the first retry in milliseconds; it doubles with each further attempt.
    pub retry_backoff_ms: u64,
    /// Also read the user's docker and podman login files (`$REGISTRY_AUTH_FILE` or
    /// `$XDG_RUNTIME_DIR/containers/auth.json`, `~/.config/containers/auth.json`,
    /// `$DOCKER_CONFIG/config.json` or `~/.docker/config.json`), after the netrc files.
    pub auth_files: bool,
    /// Mirrors per registry (`HOST[:PORT]` as in image references, `docker.io` for Docker Hub),
    /// tried in order before the registry itself.
    pub mirrors: std::collections::BTreeMap<String, MirrorConfig>,
    /// Seconds an import from a registry may take in all (`berth import`, `berth run`, a step):
    /// past it, it fails in one line. A lazy image's chunk fetches each get this much.
    pub import_deadline_s: u64,
    /// The import's deadline in the Slurm Prolog (`berth prolog`), when smaller: keep it below
    /// slurm.conf's PrologEpilogTimeout less what stage-in and cleanup take. The first step
    /// imports what the Prolog did not finish.
    pub prolog_import_deadline_s: u64,
    /// Bytes per second every transfer of an import must average over each
    /// `min_rate_window_s` spent waiting on the network (a registry trickling a byte every few
    /// seconds never trips `read_timeout_s`); 0: no minimum.
    pub min_rate_bytes_per_s: u64,
    pub min_rate_window_s: u64,
    /// Seconds one chunk fetch of a lazy image (`lazy:REF`) may take, retries included: past
    /// it the container's read fails with EIO (a registry that stalls never hangs a reader).
    pub lazy_read_deadline_s: u64,
    /// Non-empty: a registry image `REPO:TAG` whose lazy form is published as
    /// `REPO:TAG<suffix>` (`berth lazy publish`) is run lazily by Slurm steps, the Prolog,
    /// `berth run` and `berth create`; "" (the default): images are imported whole.
    pub lazy_tag_suffix: String,
    /// Set by the Prolog (never read from berth.toml): `prolog_import_deadline_s` applies.
    #[serde(skip)]
    pub in_prolog: bool,
}

/// `[registry.mirrors."HOST"]`: where images of one registry are pulled from first.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct MirrorConfig {
    /// `HOST[:PORT][/PREFIX]`, in order: `mirror.example/dockerhub` serves `library/ubuntu` as
    /// `dockerhub/library/ubuntu`. Plain HTTP only where the mirror's host is in `insecure`.
    pub mirrors: Vec<String>,
    /// Pull from the registry itself when every mirror failed; `false` for air-gapped sites.
    pub fallback: bool,
}

impl Default for MirrorConfig {
    fn default() -> Self {
        Self {
            mirrors: Vec::new(),
            fallback: true,
        }
    }
}

impl Default for RegistryConfig {
    fn default() -> Self {
        Self {
            credentials: "~/.config/berth/credentials".to_string(),
            enroot_credentials: true,
            ca_files: Vec::new(),
            insecure: Vec::new(),
            parallel_downloads: 8,
            connect_timeout_s: 30,
            read_timeout_s: 60,
            retries: 5,
            retry_backoff_ms: 500,
            auth_files: true,
            mirrors: std::collections::BTreeMap::new(),
            import_deadline_s: 1800,
            prolog_import_deadline_s: 300,
            min_rate_bytes_per_s: 4096,
            min_rate_window_s: 30,
            lazy_read_deadline_s: 30,
            lazy_tag_suffix: String::new(),
            in_prolog: false,
        }
    }
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct StoreConfig {
    /// The node's image store (layers, image records, references), shared by all users.
    pub root: PathBuf,
    /// Layers an archive or layout import decompresses and extracts at once.
    pub parallel_layers: usize,
    /// Most `Env` entries an image config, a command line or a step may give a container.
    pub max_env_entries: usize,
    /// Most bytes (`KEY=VALUE`, all entries together) of such an environment.
    pub max_env_bytes: u64,
    /// Most layers an image may have (overlayfs stacks about 500 lower layers at most).
    pub max_layers: usize,
    /// Most uncompressed bytes of one layer (a small gzip layer can expand a thousandfold).
    pub max_layer_bytes: u64,
    /// Most uncompressed bytes of all layers of one image together.
    pub max_image_bytes: u64,
    /// Free bytes an import leaves on the store's file system: extraction stops before.
    pub reserve_bytes: u64,
}

impl StoreConfig {
    /// The bounds `store.max_env_entries` and `store.max_env_bytes` put on an environment.
    pub fn env_limits(&self) -> berth_spec::env::EnvLimits {
        berth_spec::env::EnvLimits {
            max_entries: self.max_env_entries,
            max_bytes: self.max_env_bytes,
        }
    }
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            root: PathBuf::from("/var/lib/berth"),
            parallel_layers: 4,
            max_env_entries: berth_spec::env::DEFAULT_MAX_ENTRIES,
            max_env_bytes: berth_spec::env::DEFAULT_MAX_BYTES,
            max_layers: 500,
            max_layer_bytes: 64 << 30,
            max_image_bytes: 128 << 30,
            reserve_bytes: 1 << 30,
        }
    }
}

/// Squashfs and SIF images: where they are mounted, and how `berth export` compresses.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct SquashfsConfig {
    /// Where squashfs and SIF images are loop-mounted, once per node: one directory per image
    /// digest, used as the overlay lower layer of every container of that image.
    pub mount_dir: PathBuf,
    /// mksquashfs compression for `berth export`.
    pub compression: Compression,
    /// Compression level for zstd (1-22) and gzip (1-9); the other compressors have none.
    pub compression_level: u32,
    /// Run an Enroot image's /etc/rc as its entrypoint (what Pyxis --container-entrypoint does).
    pub enroot_entrypoint: bool,
    /// Seconds a save (`berth export` of a container, `--container-save` at a step's end) may
    /// take before mksquashfs is killed and the save fails: a step's end never waits on the
    /// user's files without limit (a FIFO swapped in for a file would block a read forever).
    pub export_timeout_s: u64,
}

impl Default for SquashfsConfig {
    fn default() -> Self {
        Self {
            mount_dir: PathBuf::from("/run/berth/images"),
            compression: Compression::Zstd,
            compression_level: 3,
            enroot_entrypoint: false,
            export_timeout_s: 1800,
        }
    }
}

impl SquashfsConfig {
    /// Checks values serde cannot: the level's range for the compressor, a save's deadline.
    pub fn check(&self) -> Result<(), ImageError> {
        if self.export_timeout_s == 0 {
            return Err(ImageError::Setting(
                "squashfs.export_timeout_s is 0: give the seconds a save may take (default 1800)"
                    .into(),
            ));
        }
        if let Some(range) = self.compression.levels()
            && !range.contains(&self.compression_level)
        {
            return Err(ImageError::CompressionLevel {
                level: self.compression_level,
                compressor: self.compression.name(),
                min: *range.start(),
                max: *range.end(),
            });
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    Zstd,
    Gzip,
    Lz4,
    Xz,
    Lzo,
    /// Uncompressed: fastest to write and read, largest.
    None,
}

impl Compression {
    /// The name mksquashfs knows it by.
    pub fn name(self) -> &'static str {
        match self {
            Compression::Zstd => "zstd",
            Compression::Gzip => "gzip",
            Compression::Lz4 => "lz4",
            Compression::Xz => "xz",
            Compression::Lzo => "lzo",
            Compression::None => "none",
        }
    }

    /// The levels `-Xcompression-level` accepts, for compressors whose level berth sets.
    pub fn levels(self) -> Option<std::ops::RangeInclusive<u32>> {
        match self {
            Compression::Zstd => Some(1..=22),
            Compression::Gzip => Some(1..=9),
            _ => None,
        }
    }

    pub fn takes_level(self) -> bool {
        self.levels().is_some()
    }
}
