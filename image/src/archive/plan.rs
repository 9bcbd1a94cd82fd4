//! What to import from an archive: its index, manifests and config, the platform and name
//! chosen, the layers to stream (OCI layouts and archives, and docker archives).

use std::collections::BTreeMap;
use std::io::Read;

use serde::Deserialize;
use sha2::{Digest as _, Sha256};

use super::blobs::Blobs;
use super::{MAX_JSON, invalid};
use crate::ImageError;
use crate::store::digest_hex;

#[derive(Clone, Debug, Deserialize)]
pub(super) struct Descriptor {
    #[serde(rename = "mediaType", default)]
    pub(super) media_type: String,
    pub(super) digest: String,
    #[serde(default)]
    pub(super) size: Option<u64>,
    #[serde(default)]
    pub(super) annotations: BTreeMap<String, String>,
    #[serde(default)]
    pub(super) platform: Option<Platform>,
}

#[derive(Clone, Debug, Deserialize)]
pub(super) struct Platform {
    #[serde(default)]
    pub(super) architecture: String,
    #[serde(default)]
    pub(super) os: String,
}

#[derive(Debug, Deserialize)]
pub(super) struct Index {
    #[serde(default)]
    pub(super) manifests: Vec<Descriptor>,
}

#[derive(Debug, Deserialize)]
pub(super) struct Manifest {
    pub(super) config: Descriptor,
    #[serde(default)]
    pub(super) layers: Vec<Descriptor>,
}

#[derive(Debug, Deserialize)]
pub(super) struct ConfigRootfs {
    pub(super) rootfs: RootfsJson,
}

#[derive(Debug, Deserialize)]
pub(super) struct RootfsJson {
    #[serde(default)]
    pub(super) diff_ids: Vec<String>,
}

pub(super) const REF_NAME: &str = "org.opencontainers.image.ref.name";

pub(super) fn is_index(media_type: &str) -> bool {
    media_type == "application/vnd.oci.image.index.v1+json"
        || media_type == "application/vnd.docker.distribution.manifest.list.v2+json"
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Compression {
    None,
    Gzip,
    Zstd,
    /// Decided by the first bytes (docker-archive layers carry no media type).
    Sniff,
}

pub(super) fn compression(media_type: &str) -> Option<Compression> {
    let base = media_type
        .strip_prefix("application/")
        .unwrap_or(media_type);
    match base {
        "vnd.oci.image.layer.v1.tar"
        | "vnd.oci.image.layer.nondistributable.v1.tar"
        | "vnd.docker.image.rootfs.diff.tar" => Some(Compression::None),
        "vnd.oci.image.layer.v1.tar+gzip"
        | "vnd.oci.image.layer.nondistributable.v1.tar+gzip"
        | "vnd.docker.image.rootfs.diff.tar.gzip"
        | "vnd.docker.image.rootfs.foreign.diff.tar.gzip" => Some(Compression::Gzip),
        "vnd.oci.image.layer.v1.tar+zstd"
        | "vnd.oci.image.layer.nondistributable.v1.tar+zstd"
        | "vnd.docker.image.rootfs.diff.tar.zstd" => Some(Compression::Zstd),
        _ => None,
    }
}

/// The platform an image index entry must have to run here.
pub(super) fn host_platform() -> (&'static str, &'static str) {
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "powerpc64" => "ppc64le",
        other => other,
    };
    ("linux", arch)
}

/// `busybox` → `busybox:latest`; `docker.io/library/busybox:1` → `busybox:1`; `localhost/x` →
/// `x:latest`: names as people write them compare equal.
pub(super) fn normalise_name(name: &str) -> String {
    let mut n = name;
    for prefix in [
        "docker.io/library/",
        "docker.io/",
        "index.docker.io/library/",
        "localhost/",
    ] {
        if let Some(rest) = n.strip_prefix(prefix) {
            n = rest;
            break;
        }
    }
    let last = n.rsplit('/').next().unwrap_or(n);
    if last.contains(':') || last.contains('@') {
        n.to_string()
    } else {
        format!("{n}:latest")
    }
}

pub(super) fn names_match(have: &str, want: &str) -> bool {
    have == want || normalise_name(have) == normalise_name(want)
}

/// One layer to import: where its blob is and what it must hash to.
#[derive(Clone, Debug)]
pub(super) struct LayerJob {
    pub(super) blob: String,
    /// The compressed blob's digest, when the manifest gives one.
    pub(super) digest: Option<String>,
    pub(super) size: Option<u64>,
    pub(super) compression: Compression,
    pub(super) diff_id: String,
}

#[derive(Debug)]
pub(super) struct Plan {
    pub(super) digest: String,
    pub(super) config: oci_spec::image::ImageConfiguration,
    pub(super) layers: Vec<LayerJob>,
}

pub(super) fn blob_path(what: &str, digest: &str) -> Result<String, ImageError> {
    let hex = digest_hex(digest).map_err(|_| {
        invalid(
            what,
            format!("unsupported or invalid blob digest '{digest}' (berth reads sha256 blobs)"),
        )
    })?;
    Ok(format!("blobs/sha256/{hex}"))
}

pub(super) fn read_all(blobs: &dyn Blobs, name: &str, what: &str) -> Result<Vec<u8>, ImageError> {
    if blobs.size(name).is_some_and(|s| s > MAX_JSON) {
        return Err(invalid(
            what,
            format!("'{name}' is too large for a JSON document"),
        ));
    }
    let mut data = Vec::new();
    blobs
        .open(name)?
        .take(MAX_JSON + 1)
        .read_to_end(&mut data)
        .map_err(|e| invalid(what, format!("reading '{name}': {e}")))?;
    if data.len() as u64 > MAX_JSON {
        return Err(invalid(
            what,
            format!("'{name}' is too large for a JSON document"),
        ));
    }
    Ok(data)
}

/// Reads a blob and checks its digest.
pub(super) fn read_blob(
    blobs: &dyn Blobs,
    digest: &str,
    what: &str,
) -> Result<Vec<u8>, ImageError> {
    let data = read_all(blobs, &blob_path(what, digest)?, what)?;
    let actual = format!("sha256:{:x}", Sha256::digest(&data));
    if actual != digest {
        return Err(ImageError::BlobMismatch {
            what: what.to_string(),
            digest: digest.to_string(),
            actual,
        });
    }
    Ok(data)
}

pub(super) fn json<T: serde::de::DeserializeOwned>(
    data: &[u8],
    what: &str,
    doc: &str,
) -> Result<T, ImageError> {
    serde_json::from_slice(data).map_err(|e| invalid(what, format!("{doc} is not valid: {e}")))
}

/// Chooses the manifest of an OCI layout's index.json: by ref name when given, else the only
/// one (or the host platform's when the entries are per-platform).
pub(super) fn choose<'a>(
    manifests: &'a [Descriptor],
    name: Option<&str>,
    what: &str,
) -> Result<&'a Descriptor, ImageError> {
    let names: Vec<&str> = manifests
        .iter()
        .filter_map(|d| d.annotations.get(REF_NAME).map(String::as_str))
        .collect();
    let listed = || berth_sys::text::list(&names, "no named images");
    if let Some(want) = name {
        let exact = manifests
            .iter()
            .find(|d| d.annotations.get(REF_NAME).is_some_and(|n| n == want));
        return exact
            .or_else(|| {
                manifests.iter().find(|d| {
                    d.annotations
                        .get(REF_NAME)
                        .is_some_and(|n| names_match(n, want))
                        || d.annotations
                            .get("io.containerd.image.name")
                            .is_some_and(|n| names_match(n, want))
                })
            })
            .ok_or_else(|| ImageError::NoSuchName {
                what: what.to_string(),
                name: want.to_string(),
                names: listed(),
            });
    }
    match manifests {
        [] => Err(invalid(what, "index.json lists no images")),
        [only] => Ok(only),
        many if names.is_empty() && many.iter().all(|d| d.platform.is_some()) => {
            by_platform(many, what)
        }
        _ => Err(ImageError::AmbiguousName {
            what: what.to_string(),
            names: listed(),
            example: names.first().copied().unwrap_or("NAME").to_string(),
        }),
    }
}

pub(super) fn by_platform<'a>(
    manifests: &'a [Descriptor],
    what: &str,
) -> Result<&'a Descriptor, ImageError> {
    let (os, arch) = host_platform();
    manifests
        .iter()
        .find(|d| {
            d.platform
                .as_ref()
                .is_some_and(|p| p.os == os && p.architecture == arch)
        })
        .ok_or_else(|| {
            let have: Vec<String> = manifests
                .iter()
                .filter_map(|d| {
                    d.platform
                        .as_ref()
                        .map(|p| format!("{}/{}", p.os, p.architecture))
                })
                .collect();
            invalid(
                what,
                format!(
                    "no image for {os}/{arch} (it has: {})",
                    berth_sys::text::list(&have, "none")
                ),
            )
        })
}

pub(super) fn oci_plan(
    blobs: &dyn Blobs,
    name: Option<&str>,
    what: &str,
) -> Result<Plan, ImageError> {
    let index: Index = json(&read_all(blobs, "index.json", what)?, what, "index.json")?;
    let mut desc = choose(&index.manifests, name, what)?.clone();
    let mut manifest_bytes = read_blob(blobs, &desc.digest, what)?;
    // Nested indexes (per-platform manifests) down to one manifest.
    for _ in 0..4 {
        let nested = is_index(&desc.media_type)
            || (desc.media_type.is_empty()
                && serde_json::from_slice::<serde_json::Value>(&manifest_bytes)
                    .is_ok_and(|v| v.get("manifests").is_some()));
        if !nested {
            break;
        }
        let index: Index = json(&manifest_bytes, what, "an image index")?;
        desc = by_platform(&index.manifests, what)?.clone();
        manifest_bytes = read_blob(blobs, &desc.digest, what)?;
    }
    let manifest: Manifest = json(&manifest_bytes, what, &format!("manifest {}", desc.digest))?;
    let config_bytes = read_blob(blobs, &manifest.config.digest, what)?;
    let (config, diff_ids) = parse_config(&config_bytes, what)?;
    if diff_ids.len() != manifest.layers.len() {
        return Err(invalid(
            what,
            format!(
                "the manifest lists {} layers but the config {} diff_ids",
                manifest.layers.len(),
                diff_ids.len()
            ),
        ));
    }
    let mut layers = Vec::new();
    for (l, diff_id) in manifest.layers.iter().zip(diff_ids) {
        let compression = compression(&l.media_type).ok_or_else(|| {
            invalid(
                what,
                format!(
                    "layer {} has unsupported media type '{}'",
                    l.digest, l.media_type
                ),
            )
        })?;
        layers.push(LayerJob {
            blob: blob_path(what, &l.digest)?,
            digest: Some(l.digest.clone()),
            size: l.size,
            compression,
            diff_id,
        });
    }
    Ok(Plan {
        digest: desc.digest,
        config,
        layers,
    })
}

pub(super) fn parse_config(
    bytes: &[u8],
    what: &str,
) -> Result<(oci_spec::image::ImageConfiguration, Vec<String>), ImageError> {
    let config: oci_spec::image::ImageConfiguration = json(bytes, what, "the image config")?;
    let rootfs: ConfigRootfs = json(bytes, what, "the image config")?;
    for d in &rootfs.rootfs.diff_ids {
        digest_hex(d)
            .map_err(|_| invalid(what, format!("the config has an invalid diff_id '{d}'")))?;
    }
    Ok((config, rootfs.rootfs.diff_ids))
}

#[derive(Debug, Deserialize)]
pub(super) struct DockerEntry {
    #[serde(rename = "Config")]
    pub(super) config: String,
    #[serde(rename = "RepoTags", default)]
    pub(super) repo_tags: Option<Vec<String>>,
    #[serde(rename = "Layers", default)]
    pub(super) layers: Vec<String>,
}

pub(super) fn docker_plan(
    blobs: &dyn Blobs,
    name: Option<&str>,
    what: &str,
) -> Result<Plan, ImageError> {
    let entries: Vec<DockerEntry> = json(
        &read_all(blobs, "manifest.json", what)?,
        what,
        "manifest.json",
    )?;
    let tags = |e: &DockerEntry| e.repo_tags.clone().unwrap_or_default();
    let all_names: Vec<String> = entries.iter().flat_map(tags).collect();
    let listed = || berth_sys::text::list(&all_names, "no named images");
    let entry = match name {
        Some(n) if n.starts_with('@') => n[1..]
            .parse::<usize>()
            .ok()
            .and_then(|i| entries.get(i))
            .ok_or_else(|| ImageError::NoSuchName {
                what: what.to_string(),
                name: n.to_string(),
                names: format!("@0 to @{}", entries.len().saturating_sub(1)),
            })?,
        Some(n) => entries
            .iter()
            .find(|e| tags(e).iter().any(|t| t == n))
            .or_else(|| {
                entries
                    .iter()
                    .find(|e| tags(e).iter().any(|t| names_match(t, n)))
            })
            .ok_or_else(|| ImageError::NoSuchName {
                what: what.to_string(),
                name: n.to_string(),
                names: listed(),
            })?,
        None => match entries.as_slice() {
            [] => return Err(invalid(what, "manifest.json lists no images")),
            [only] => only,
            _ => {
                return Err(ImageError::AmbiguousName {
                    what: what.to_string(),
                    names: listed(),
                    example: all_names.first().cloned().unwrap_or_else(|| "@0".into()),
                });
            }
        },
    };
    let config_bytes = read_all(blobs, &entry.config, what)?;
    let digest = format!("sha256:{:x}", Sha256::digest(&config_bytes));
    let (config, diff_ids) = parse_config(&config_bytes, what)?;
    if diff_ids.len() != entry.layers.len() {
        return Err(invalid(
            what,
            format!(
                "manifest.json lists {} layers but the config {} diff_ids",
                entry.layers.len(),
                diff_ids.len()
            ),
        ));
    }
    let layers = entry
        .layers
        .iter()
        .zip(diff_ids)
        .map(|(blob, diff_id)| LayerJob {
            blob: blob.clone(),
            digest: None,
            size: blobs.size(blob),
            compression: Compression::Sniff,
            diff_id,
        })
        .collect();
    Ok(Plan {
        digest,
        config,
        layers,
    })
}
