//! The site option `registry.lazy_tag_suffix`: a registry image whose lazy form is published
//! beside it (`REPO:TAG<suffix>`, as `berth lazy publish` pushes it) is run lazily by Slurm steps,
//! the Prolog, `berth run` and `berth create`, without the user writing `lazy:`. The lookup is
//! one manifest GET with the user's credentials (per mirror tried, as a pull); whatever it
//! finds other than a lazy image (no such tag, another kind of manifest, a registry error)
//! leaves the image to the full import, which says what is wrong with the image itself.

use berth_image::{Reference, reference};
use berth_spec::UserIds;

use berth_config::Config;

const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";

/// The lazy form of the image `text` names, as `lazy:REF` for [`crate::container::resolve`], when
/// the site option is on and the registry holds one the user `user` may pull; `None`: the image
/// is imported as given.
pub fn site_form(text: &str, config: &Config, user: &UserIds) -> Option<String> {
    let lazy = candidate(text, &config.registry.lazy_tag_suffix)?;
    let Ok(Reference::Registry(r)) = reference::parse(&lazy) else {
        return None;
    };
    let found =
        berth_image::registry::Client::for_uid(&config.registry, user.uid, user.home.as_deref())
            .and_then(|client| client.lazy_manifest(&r, OCI_MANIFEST));
    match found {
        Ok((_, raw)) => {
            let kind = oci_spec::image::ImageManifest::from_reader(raw.body.as_slice())
                .ok()
                .and_then(|m| m.artifact_type().as_ref().map(ToString::to_string));
            if kind.as_deref() == Some(berth_image::lazy::ARTIFACT_TYPE) {
                tracing::info!("image {text}: its lazy form {lazy} is published: run lazily");
                Some(format!("lazy:{lazy}"))
            } else {
                tracing::info!("image {text}: {lazy} is not a lazy image: imported whole");
                None
            }
        }
        Err(e) => {
            tracing::info!("image {text}: no lazy form ({e}): imported whole");
            None
        }
    }
}

/// [`site_form`] for the user running berth (`berth run`, `berth create`).
pub fn site_form_for_caller(text: &str, config: &Config) -> Option<String> {
    candidate(text, &config.registry.lazy_tag_suffix)?;
    let caller = berth_sys::user::current().ok()?;
    site_form(text, config, &caller)
}

/// The reference of the lazy form of `text` with the tag suffix `suffix`: a registry image named
/// by tag (the default tag when none is given); not a `lazy:` one, a path, an image named by
/// digest, nor anything when the suffix is empty.
fn candidate(text: &str, suffix: &str) -> Option<String> {
    if suffix.is_empty() || text.starts_with("lazy:") || text.starts_with('/') {
        return None;
    }
    let Ok(Reference::Registry(mut r)) = reference::parse(text) else {
        return None;
    };
    if r.digest.is_some() {
        return None;
    }
    let tag = r
        .tag
        .take()
        .unwrap_or_else(|| reference::DEFAULT_TAG.to_string());
    r.tag = Some(format!("{tag}{suffix}"));
    // The suffix is the site's text: a tag it makes invalid names no lazy form.
    let lazy = r.to_string();
    matches!(reference::parse(&lazy), Ok(Reference::Registry(_))).then_some(lazy)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lazy_form_is_the_tag_with_the_suffix() {
        assert_eq!(
            candidate("docker://127.0.0.1:5000/t/img:1", "-lazy").as_deref(),
            Some("127.0.0.1:5000#t/img:1-lazy")
        );
        assert_eq!(
            candidate("127.0.0.1:5000#t/img", "-lazy").as_deref(),
            Some("127.0.0.1:5000#t/img:latest-lazy")
        );
        let lazy = candidate("docker://127.0.0.1:5000/t/img:1", "-lazy").unwrap();
        let Ok(Reference::Registry(r)) = reference::parse(&lazy) else {
            panic!("{lazy}");
        };
        assert_eq!(r.image_name(), "127.0.0.1:5000/t/img:1-lazy");
    }

    #[test]
    fn nothing_is_looked_up_when_off_or_not_a_tagged_registry_image() {
        let digest = format!("docker://127.0.0.1:5000/t/img@sha256:{}", "0".repeat(64));
        for (text, suffix) in [
            ("docker://127.0.0.1:5000/t/img:1", ""),
            ("lazy:docker://127.0.0.1:5000/t/img:1", "-lazy"),
            ("/tmp/image.sqsh", "-lazy"),
            (digest.as_str(), "-lazy"),
            // A suffix that makes no valid tag.
            ("docker://127.0.0.1:5000/t/img:1", "/x y"),
        ] {
            assert_eq!(candidate(text, suffix), None, "{text} {suffix}");
        }
    }
}
