//! Manifests as registries serve them: OCI image manifests and indexes, Docker v2 schema 2
//! manifests and manifest lists (same JSON shape, other media types), and the choice of one
//! platform's manifest from an index.

use serde::Deserialize;

use crate::ImageError;

pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
const DOCKER_SCHEMA1: &str = "application/vnd.docker.distribution.manifest.v1";

/// Every manifest type berth reads, for `Accept`: registry 2.8 answers 404 for an OCI manifest
/// and down-converts Docker ones to schema 1 unless its type is listed.
pub const ACCEPT: &str = "application/vnd.oci.image.index.v1+json, \
application/vnd.oci.image.manifest.v1+json, \
application/vnd.docker.distribution.manifest.list.v2+json, \
application/vnd.docker.distribution.manifest.v2+json";

/// A content descriptor (config, layer, or one entry of an index).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    #[serde(default)]
    pub media_type: Option<String>,
    pub digest: String,
    pub size: u64,
    #[serde(default)]
    pub platform: Option<Platform>,
    /// Foreign (non-distributable) layers are fetched from these URLs instead.
    #[serde(default)]
    pub urls: Option<Vec<String>>,
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct Platform {
    pub architecture: String,
    pub os: String,
    #[serde(default)]
    pub variant: Option<String>,
}

impl std::fmt::Display for Platform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.os, self.architecture)?;
        if let Some(v) = &self.variant {
            write!(f, "/{v}")?;
        }
        Ok(())
    }
}

/// The JSON shape shared by every manifest type; which fields are present tells them apart.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawManifest {
    #[serde(default)]
    schema_version: Option<u32>,
    #[serde(default)]
    media_type: Option<String>,
    #[serde(default)]
    config: Option<Descriptor>,
    #[serde(default)]
    layers: Option<Vec<Descriptor>>,
    #[serde(default)]
    manifests: Option<Vec<Descriptor>>,
}

/// A parsed manifest document.
#[derive(Debug, PartialEq)]
pub enum Manifest {
    /// An OCI index or Docker manifest list.
    Index(Vec<Descriptor>),
    /// One image: its config blob and layers, bottom first.
    Image {
        config: Descriptor,
        layers: Vec<Descriptor>,
    },
}

/// Parses a manifest body; `content_type` is the response's Content-Type (umoci and some
/// registries omit `mediaType` in the body).
pub fn parse(body: &[u8], content_type: Option<&str>) -> Result<Manifest, ImageError> {
    let raw: RawManifest = serde_json::from_slice(body)
        .map_err(|e| ImageError::Detail(format!("manifest is not valid JSON: {e}")))?;
    let media_type = raw
        .media_type
        .as_deref()
        .or(content_type)
        .map(|t| t.split(';').next().unwrap_or_default().trim().to_string());
    if raw.schema_version == Some(1)
        || media_type
            .as_deref()
            .is_some_and(|t| t.starts_with(DOCKER_SCHEMA1))
    {
        return Err(ImageError::Detail(
            "Docker schema 1 manifests are not supported (re-push the image with a \
                    current client)"
                .to_string(),
        ));
    }
    let is_index = matches!(media_type.as_deref(), Some(OCI_INDEX | DOCKER_LIST))
        || (raw.manifests.is_some() && raw.layers.is_none());
    if is_index {
        return Ok(Manifest::Index(raw.manifests.unwrap_or_default()));
    }
    match (raw.config, raw.layers) {
        (Some(config), Some(layers)) => Ok(Manifest::Image { config, layers }),
        _ => Err(ImageError::Detail(format!(
            "manifest of type {} has no config or layers",
            media_type.as_deref().unwrap_or("(none)")
        ))),
    }
}

/// The platform berth wants from an index: `linux/<arch>[/<variant>]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Wanted {
    pub architecture: String,
    pub variant: Option<String>,
}

impl Wanted {
    /// The machine berth runs on.
    pub fn host() -> Self {
        Self::parse(std::env::consts::ARCH).unwrap_or(Self {
            architecture: std::env::consts::ARCH.to_string(),
            variant: None,
        })
    }

    /// `--arch` values: `amd64`, `x86_64`, `arm64`, `aarch64`, `arm64/v8`, `linux/arm/v7`, …
    pub fn parse(text: &str) -> Result<Self, ImageError> {
        let text = text.strip_prefix("linux/").unwrap_or(text);
        let (arch, variant) = match text.split_once('/') {
            Some((a, v)) => (a, Some(v.to_string())),
            None => (text, None),
        };
        let architecture = match arch {
            "x86_64" | "x86-64" => "amd64",
            "aarch64" => "arm64",
            "i386" | "i686" => "386",
            "powerpc64le" => "ppc64le",
            "riscv64gc" => "riscv64",
            a => a,
        };
        if architecture.is_empty()
            || !architecture.bytes().all(|b| b.is_ascii_alphanumeric())
            || variant
                .as_deref()
                .is_some_and(|v| v.is_empty() || v.contains('/'))
        {
            return Err(ImageError::Detail(format!(
                "'{text}' is not an architecture (expected e.g. amd64, arm64, arm64/v8)"
            )));
        }
        Ok(Self {
            architecture: architecture.to_string(),
            variant,
        })
    }
}

impl std::fmt::Display for Wanted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "linux/{}", self.architecture)?;
        if let Some(v) = &self.variant {
            write!(f, "/{v}")?;
        }
        Ok(())
    }
}

/// The variant an architecture has when an index entry names none.
fn default_variant(architecture: &str) -> Option<&'static str> {
    match architecture {
        "arm64" => Some("v8"),
        "arm" => Some("v7"),
        _ => None,
    }
}

/// Picks the entry for `want` from an index: linux, same architecture; the wanted variant when
/// one is asked for (an entry without variant has its architecture's default one), otherwise an
/// entry without variant or with the default one before any other.
pub fn select<'a>(entries: &'a [Descriptor], want: &Wanted) -> Option<&'a Descriptor> {
    let candidates: Vec<&Descriptor> = entries
        .iter()
        .filter(|d| {
            d.platform
                .as_ref()
                .is_some_and(|p| p.os == "linux" && p.architecture == want.architecture)
        })
        .collect();
    let variant_of = |d: &Descriptor| {
        let p = d.platform.as_ref().expect("filtered on platform");
        p.variant
            .clone()
            .or_else(|| default_variant(&p.architecture).map(str::to_string))
    };
    match &want.variant {
        Some(v) => candidates
            .into_iter()
            .find(|d| variant_of(d).as_deref() == Some(v.as_str())),
        None => {
            let default = default_variant(&want.architecture).map(str::to_string);
            candidates
                .iter()
                .find(|d| {
                    let p = d.platform.as_ref().expect("filtered on platform");
                    p.variant.is_none() || variant_of(d) == default
                })
                .or(candidates.first())
                .copied()
        }
    }
}

/// The platforms an index offers, for the error when none fits: a few, then how many more (an
/// index may list thousands, and the error is one line into srun and the logs).
pub fn platforms(entries: &[Descriptor]) -> String {
    berth_sys::text::list(
        entries
            .iter()
            .filter_map(|d| d.platform.as_ref())
            .filter(|p| p.os != "unknown")
            .map(ToString::to_string),
        "none",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(arch: &str, variant: Option<&str>, n: u8) -> Descriptor {
        Descriptor {
            media_type: Some(OCI_MANIFEST.into()),
            digest: format!("sha256:{}", format!("{n:02x}").repeat(32)),
            size: 1,
            platform: Some(Platform {
                architecture: arch.into(),
                os: "linux".into(),
                variant: variant.map(Into::into),
            }),
            urls: None,
        }
    }

    #[test]
    fn platform_selection() {
        let index = vec![
            Descriptor {
                platform: Some(Platform {
                    architecture: "unknown".into(),
                    os: "unknown".into(),
                    variant: None,
                }),
                ..entry("amd64", None, 9)
            },
            entry("arm", Some("v6"), 1),
            entry("arm", Some("v7"), 2),
            entry("arm64", Some("v8"), 3),
            entry("amd64", None, 4),
            entry("ppc64le", None, 5),
        ];
        let digest_of =
            |w: &str| select(&index, &Wanted::parse(w).unwrap()).map(|d| d.digest.clone());
        assert_eq!(digest_of("amd64"), Some(entry("", None, 4).digest));
        assert_eq!(digest_of("x86_64"), Some(entry("", None, 4).digest));
        assert_eq!(digest_of("arm64"), Some(entry("", None, 3).digest));
        assert_eq!(digest_of("linux/arm64/v8"), Some(entry("", None, 3).digest));
        assert_eq!(digest_of("arm"), Some(entry("", None, 2).digest));
        assert_eq!(digest_of("arm/v6"), Some(entry("", None, 1).digest));
        assert_eq!(digest_of("s390x"), None);
        assert_eq!(digest_of("arm64/v9"), None);
        // An arm64 entry without variant is v8.
        let bare = vec![entry("arm64", None, 7)];
        assert!(select(&bare, &Wanted::parse("arm64/v8").unwrap()).is_some());
        assert_eq!(
            platforms(&index),
            "linux/arm/v6, linux/arm/v7, linux/arm64/v8, linux/amd64, linux/ppc64le"
        );
        // An index of 20000 platforms, none of them wanted: a short line, and how many more.
        let many: Vec<Descriptor> = (0..20_000u32)
            .map(|n| Descriptor {
                platform: Some(Platform {
                    architecture: format!("arch{n}"),
                    os: "linux".into(),
                    variant: None,
                }),
                ..entry("amd64", None, 1)
            })
            .collect();
        assert_eq!(select(&many, &Wanted::parse("amd64").unwrap()), None);
        let have = platforms(&many);
        assert!(have.ends_with("linux/arch7 (and 19992 more)"), "{have}");
        assert!(have.len() < 200, "{have}");
        assert_eq!(platforms(&[]), "none");
        Wanted::parse("").unwrap_err();
        Wanted::parse("arm64/").unwrap_err();
        Wanted::parse("a b").unwrap_err();
    }

    #[test]
    fn random_manifests_never_panic() {
        let seeds: [&[u8]; 4] = [
            br#"{"schemaVersion":2,"config":{"digest":"sha256:aa","size":2},"layers":[]}"#,
            br#"{"manifests":[{"digest":"x","size":1,"platform":{"architecture":"arm64","os":"linux"}}]}"#,
            br#"{"mediaType":"application/vnd.oci.image.index.v1+json"}"#,
            b"[1,2,{}]",
        ];
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for seed in seeds {
            for _ in 0..5_000 {
                let mut doc = seed.to_vec();
                for _ in 0..3 {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    let at = usize::try_from(state % doc.len() as u64).unwrap();
                    doc[at] = (state >> 32).to_le_bytes()[0];
                }
                if let Ok(Manifest::Index(entries)) = parse(&doc, None) {
                    let _ = select(&entries, &Wanted::host());
                    let _ = platforms(&entries);
                }
            }
        }
    }

    #[test]
    fn manifest_kinds() {
        let image = br#"{"schemaVersion":2,"config":{"digest":"sha256:aa","size":2},
            "layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"sha256:bb","size":3}]}"#;
        match parse(image, Some(OCI_MANIFEST)).unwrap() {
            Manifest::Image { config, layers } => {
                assert_eq!(config.size, 2);
                assert_eq!(layers.len(), 1);
            }
            m => panic!("{m:?}"),
        }
        let list = br#"{"schemaVersion":2,"mediaType":"application/vnd.docker.distribution.manifest.list.v2+json",
            "manifests":[{"digest":"sha256:cc","size":5,"platform":{"architecture":"amd64","os":"linux"}}]}"#;
        assert!(matches!(parse(list, None).unwrap(), Manifest::Index(v) if v.len() == 1));
        let schema1 = br#"{"schemaVersion":1,"fsLayers":[]}"#;
        assert!(
            parse(schema1, None)
                .unwrap_err()
                .to_string()
                .contains("schema 1")
        );
        assert!(
            parse(b"{", None)
                .unwrap_err()
                .to_string()
                .contains("not valid JSON")
        );
        assert!(
            parse(b"{}", None)
                .unwrap_err()
                .to_string()
                .contains("no config")
        );
    }
}
