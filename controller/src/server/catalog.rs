//! The image catalog: which node holds which registry image (canonical reference → manifest
//! digest) and where it serves blobs to other nodes, from the agents' heartbeats. The leader's
//! memory only, like the rest of a heartbeat: a new leader learns it again within one inventory
//! round of the agents. A node that stops heartbeating is dropped after [`STALE_BEATS`]
//! intervals (`controller.heartbeat_interval_s`): its port may by then be held by another
//! process, which importers would otherwise be sent to (they refuse it, as it cannot prove the
//! cluster key, but it costs them a try).
//!
//! `GET /v1/catalog` (leader only) lists it; `berth cluster prewarm` plans from it and imports
//! (the Prolog's too) ask it for peers holding an image before going to the registry.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::State as AxState;
use axum::http::Uri;
use axum::response::{IntoResponse, Response};
use berth_api::{CatalogNode, Heartbeat};

use crate::server::App;

/// Heartbeat intervals without one after which a node leaves the catalog (the lost-node rule).
pub const STALE_BEATS: u64 = 3;

/// Most references kept per node (an inventory lists at most 1000).
const REFS_MAX: usize = 1000;

#[derive(Clone, Debug)]
struct Held {
    at: Instant,
    peer: Option<String>,
    refs: BTreeMap<String, String>,
}

#[derive(Debug, Default)]
pub struct Catalog {
    nodes: Mutex<HashMap<String, Held>>,
}

/// A peer address as agents advertise it: `host:port`, nothing that could be a URL path.
fn plausible_addr(a: &str) -> bool {
    !a.is_empty()
        && a.len() <= 255
        && a.rsplit_once(':')
            .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0))
        && a.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-._:[]".contains(c))
}

impl Catalog {
    /// Takes what a heartbeat says. A heartbeat without an inventory (refs empty and no peer)
    /// between two inventory rounds keeps what the node said last.
    pub fn record(&self, hb: &Heartbeat) {
        let mut nodes = self.nodes.lock().unwrap_or_else(|p| p.into_inner());
        let fresh = hb.peer.is_some() || !hb.refs.is_empty();
        let peer = hb.peer.clone().filter(|a| plausible_addr(a));
        match nodes.get_mut(&hb.node) {
            Some(h) if !fresh => h.at = Instant::now(),
            _ => {
                nodes.insert(
                    hb.node.clone(),
                    Held {
                        at: Instant::now(),
                        peer,
                        refs: hb
                            .refs
                            .iter()
                            .take(REFS_MAX)
                            .map(|(k, v)| (k.clone(), v.clone()))
                            .collect(),
                    },
                );
            }
        }
    }

    /// The nodes heard from within `max_age`; the others are dropped.
    pub fn view(&self, max_age: Duration) -> Vec<CatalogNode> {
        let mut nodes = self.nodes.lock().unwrap_or_else(|p| p.into_inner());
        nodes.retain(|_, h| h.at.elapsed() <= max_age);
        let mut out: Vec<CatalogNode> = nodes
            .iter()
            .map(|(n, h)| CatalogNode {
                node: n.clone(),
                peer: h.peer.clone(),
                refs: h.refs.clone(),
                age_s: h.at.elapsed().as_secs_f64(),
            })
            .collect();
        out.sort_by(|a, b| a.node.cmp(&b.node));
        out
    }
}

/// `GET /v1/catalog[?ref=REF]`: every node, or (with `ref`, percent-encoded canonical
/// reference) only the nodes that hold REF and serve blobs, so that an import on a large
/// cluster gets a short answer.
pub async fn get(AxState(app): AxState<Arc<App>>, uri: Uri) -> Response {
    if !app.is_leader_now() {
        return app.not_leader();
    }
    let wanted = uri.query().and_then(|q| {
        q.split('&')
            .find_map(|kv| kv.strip_prefix("ref="))
            .map(percent_decode)
    });
    let max_age = Duration::from_secs(app.s.heartbeat_interval_s.max(1) * STALE_BEATS);
    let mut view = app.catalog.view(max_age);
    if let Some(r) = wanted {
        view.retain(|n| n.peer.is_some() && n.refs.contains_key(&r));
        for n in &mut view {
            n.refs.retain(|k, _| *k == r);
        }
    }
    Json(view).into_response()
}

/// `%XX` decoded (and `+` as a space, as forms send it); malformed escapes stay as they are.
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match b[i] {
            b'%' if i + 2 < b.len() => match (hex(b[i + 1]), hex(b[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push(u8::try_from(h * 16 + l).unwrap_or(b'?'));
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b'+' => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hb(node: &str, peer: Option<&str>, refs: &[(&str, &str)]) -> Heartbeat {
        Heartbeat {
            node: node.into(),
            boot_id: "b".into(),
            version: "v".into(),
            checks: Vec::new(),
            versions: BTreeMap::new(),
            images: Vec::new(),
            leftovers: Vec::new(),
            cause: None,
            daemons: Vec::new(),
            peer: peer.map(str::to_string),
            refs: refs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            step_report: None,
        }
    }

    #[test]
    fn queries_decode() {
        assert_eq!(
            percent_decode("docker%3A%2F%2Fr%2Fa%3A1"),
            "docker://r/a:1".to_string()
        );
        assert_eq!(percent_decode("a%2"), "a%2".to_string());
        assert_eq!(percent_decode("%zz"), "%zz".to_string());
    }

    #[test]
    fn heartbeats_fill_the_catalog_and_bad_addresses_are_dropped() {
        let c = Catalog::default();
        c.record(&hb(
            "n1",
            Some("10.0.0.1:6822"),
            &[("docker://r/a:1", "sha256:x")],
        ));
        c.record(&hb(
            "n2",
            Some("http://evil/x"),
            &[("docker://r/a:1", "sha256:x")],
        ));
        // A heartbeat without inventory keeps the last one.
        c.record(&hb("n1", None, &[]));
        let v = c.view(Duration::from_secs(15));
        assert_eq!(v[0].peer.as_deref(), Some("10.0.0.1:6822"));
        assert_eq!(v[0].refs["docker://r/a:1"], "sha256:x");
        assert_eq!(v[1].peer, None);
    }

    #[test]
    fn nodes_that_stopped_heartbeating_leave_the_catalog() {
        let c = Catalog::default();
        let refs = [("docker://r/a:1", "sha256:x")];
        c.record(&hb("gone", Some("10.0.0.1:6822"), &refs));
        c.record(&hb("here", Some("10.0.0.2:6822"), &refs));
        let long_ago = Instant::now()
            .checked_sub(Duration::from_secs(60))
            .expect("the clock is past a minute");
        c.nodes.lock().unwrap().get_mut("gone").unwrap().at = long_ago;
        let v = c.view(Duration::from_secs(15));
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].node, "here");
        // Pruned, not only hidden: a wider window does not bring it back.
        assert_eq!(c.view(Duration::from_secs(3600)).len(), 1);
        // Its next heartbeat brings it back.
        c.record(&hb("gone", Some("10.0.0.1:6822"), &refs));
        assert_eq!(c.view(Duration::from_secs(15)).len(), 2);
    }
}
