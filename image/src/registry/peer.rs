//! Cluster peers as blob sources of a pull (see `crate::peers`): which peers, and the
//! image config fetched from them before the registry.

use super::http::Target;
use super::manifest::Descriptor;
use super::{Client, ImageError, RegistryRef, target, warn_source_failed};

impl Client {
    /// The peers to ask for `r`'s blobs, as sources like mirrors (plain HTTP, requests signed
    /// with the cluster key, never the user's login); none when this process has no peers set up.
    pub(super) fn peer_targets(&self, r: &RegistryRef) -> Vec<Target> {
        let Some((hosts, key)) = crate::peers::peers_for(r) else {
            return Vec::new();
        };
        let origin = target(r);
        hosts
            .into_iter()
            .map(|host| {
                self.transport.add_peer(&host, &key);
                Target {
                    registry: host,
                    repository: origin.repository.clone(),
                    image: origin.image.clone(),
                    user: None,
                    mirror_of: Some(format!("{} (cluster peer)", r.registry)),
                }
            })
            .collect()
    }

    /// The config blob from the first peer that serves it intact, else from `t`; kept for
    /// peers when this process keeps blobs.
    pub(super) fn fetch_config_peers_first(
        &self,
        peers: &[Target],
        t: &Target,
        d: &Descriptor,
    ) -> Result<Vec<u8>, ImageError> {
        for (i, p) in peers.iter().enumerate() {
            match self.fetch_config(p, d) {
                Ok(body) => {
                    self.keep_config(d, &body);
                    return Ok(body);
                }
                Err(e) => warn_source_failed(p, peers.get(i + 1).unwrap_or(t), &e),
            }
        }
        let body = self.fetch_config(t, d)?;
        self.keep_config(d, &body);
        Ok(body)
    }

    fn keep_config(&self, d: &Descriptor, body: &[u8]) {
        if let Some(k) = &self.keep {
            k.put(&d.digest, body);
        }
    }
}
