//! The protocol between berth's SPANK plugin and the berth binary, one definition for both
//! sides: the request `berth step create` reads on stdin ([`step`]), the answer it prints
//! ([`answer`]) and Pyxis's `--container-mounts` syntax ([`mounts`]).
//!
//! Both sides carry [`VERSION`]. slurmd loads a new plugin while an older berth may still be
//! installed (or the reverse, during a rolling upgrade), so each side accepts the other's
//! version one apart and refuses anything further with one line naming both versions. A new
//! version only adds fields with defaults, so that an older reader can ignore what it does not
//! know and a newer reader can fill in what an older writer left out.

pub mod answer;
pub mod mounts;
pub mod step;

/// The protocol this build speaks. 1 is the unversioned protocol of the plugins and berths
/// before the field existed (a message without `protocol` is version 1); 2 added `protocol`,
/// `node` in the request and `--node` for `berth step destroy`.
pub const VERSION: u32 = 2;

/// Versions this build works with: its own and one either side.
pub fn compatible(other: u32) -> bool {
    other >= 1 && other.abs_diff(VERSION) <= 1
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    /// The other side's version is more than one apart from ours.
    #[error(
        "the {peer} speaks protocol {theirs} and this {me} speaks {ours} (it works with {low} to {high}): install a berth and a berth SPANK plugin from the same release, or one release apart"
    )]
    Version {
        peer: &'static str,
        me: &'static str,
        theirs: u32,
        ours: u32,
        low: u32,
        high: u32,
    },
    /// The message is not what the protocol describes.
    #[error("{0}")]
    Invalid(String),
    /// A `--container-mounts` entry that is not Pyxis's syntax, or a path the step cannot name.
    #[error("{0}")]
    Mount(String),
}

impl ProtoError {
    pub(crate) fn version(peer: &'static str, me: &'static str, theirs: u32) -> Self {
        ProtoError::Version {
            peer,
            me,
            theirs,
            ours: VERSION,
            low: VERSION.saturating_sub(1).max(1),
            high: VERSION + 1,
        }
    }
}

/// The `protocol` of a message (1 when absent: a writer from before versioning), read before
/// the rest so that a message of an incompatible version is refused for its version, not for a
/// field it may not have.
pub(crate) fn version_of(value: &serde_json::Value) -> Result<u32, ProtoError> {
    match value.get("protocol") {
        None => Ok(1),
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| ProtoError::Invalid(format!("protocol {v} is not a version number"))),
    }
}

/// Deserializes `value` as a `T` written by a peer of `version`: fields this build does not
/// know are an error from a peer of our version or older (a bug or a typo on that side), and
/// are returned, to be reported and ignored, from a newer one (what it added since).
pub(crate) fn from_peer<T: serde::de::DeserializeOwned>(
    value: serde_json::Value,
    version: u32,
) -> Result<(T, Vec<String>), ProtoError> {
    let mut unknown = Vec::new();
    let parsed: T = serde_ignored::deserialize(value, |path| unknown.push(path.to_string()))
        .map_err(|e| ProtoError::Invalid(e.to_string()))?;
    if version <= VERSION && !unknown.is_empty() {
        return Err(ProtoError::Invalid(format!(
            "unknown field{} {}",
            if unknown.len() == 1 { "" } else { "s" },
            berth_sys::text::list(&unknown, "none")
        )));
    }
    Ok((parsed, unknown))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_one_apart_are_compatible() {
        assert!(compatible(VERSION));
        assert!(compatible(VERSION - 1));
        assert!(compatible(VERSION + 1));
        assert!(!compatible(VERSION + 2));
        assert!(!compatible(0));
        let e = ProtoError::version("SPANK plugin", "berth", 7).to_string();
        assert!(
            e.starts_with(&format!(
                "the SPANK plugin speaks protocol 7 and this berth speaks {VERSION} (it works with {} to {})",
                VERSION - 1,
                VERSION + 1
            )),
            "{e}"
        );
    }

    #[test]
    fn a_missing_version_is_one_and_a_bad_one_is_named() {
        assert_eq!(version_of(&serde_json::json!({})).unwrap(), 1);
        assert_eq!(version_of(&serde_json::json!({"protocol": 3})).unwrap(), 3);
        for bad in [
            serde_json::json!({"protocol": "2"}),
            serde_json::json!({"protocol": -1}),
            serde_json::json!({"protocol": 1u64 << 40}),
        ] {
            let e = version_of(&bad).unwrap_err().to_string();
            assert!(e.contains("is not a version number"), "{e}");
        }
    }
}
