//! `berth cluster prewarm REF`: gets a registry image onto many nodes before jobs need it,
//! with the registry serving each blob once.
//!
//! The plan is a tree, started whole at once: the first node pulls from the registry (unless
//! the catalog already names nodes holding the image); every node, as soon as it has started,
//! serves at most `--fanout` others, each of those fetching from it first, then from up to two
//! nodes started before it, then from the registry (the registry client verifies every blob,
//! so a bad or dead peer costs a retry, never a wrong image). A node serves each blob as it
//! downloads it (`crate::peer`), so the tree's levels run at the same time instead of one
//! after the other: the wall time is about one import at the pace the nodes' shared disk and
//! CPUs allow, not the tree's depth times one import. Each node's agent does its own import
//! (`POST /v1/warm` on `peers.listen`); this command only schedules and reports.
//!
//! `lazy:REF` warms a lazy image the same way: each node fetches its index and every chunk into
//! its chunk cache, from its parent first, which serves each chunk once its own warm verified
//! it. Why a tree for a job's first step: its nodes all start cold at once, so no node holds a
//! chunk the others could ask for, and on-demand readers would all go to the registry; a planned
//! tree gives every chunk one registry fetch, at about one node's fetch time.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use berth_api::{CatalogNode, WarmReply, WarmRequest};
use berth_config::Config;
use berth_image::Reference;

use crate::AgentError;
use crate::client::Client;

/// What to warm: a registry image, on which nodes, how wide the tree, how long one node may take.
#[derive(Clone, Debug)]
pub struct Request {
    pub reference: String,
    /// Empty: every node whose agent serves peers.
    pub nodes: Vec<String>,
    pub fanout: usize,
    pub timeout: Duration,
}

/// The warm's end: each node's outcome (by name), the store key of the image, the time taken.
#[derive(Debug)]
pub struct Report {
    pub outcomes: Vec<Outcome>,
    pub key: String,
    pub seconds: f64,
}

/// One node's warm as scheduled: who it fetches from, best first (empty: the registry).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assignment {
    pub node: String,
    pub parent: Option<String>,
    pub peers: Vec<String>,
}

/// The fan-out scheduler: which node to warm next and from whom.
#[derive(Debug)]
pub struct Plan {
    fanout: usize,
    /// Nodes holding the image or getting it (they serve it as it comes), with how many they
    /// serve now, in the order they started.
    holders: Vec<(String, usize)>,
    pending: VecDeque<String>,
    running: usize,
    /// The pull from the registry failed: nothing else is started from it.
    registry_failed: bool,
}

/// Fallback holders given besides the parent.
const FALLBACKS: usize = 2;

impl Plan {
    pub fn new(targets: Vec<String>, holders: Vec<String>, fanout: usize) -> Self {
        Self {
            fanout: fanout.max(1),
            pending: targets
                .into_iter()
                .filter(|t| !holders.contains(t))
                .collect(),
            holders: holders.into_iter().map(|h| (h, 0)).collect(),
            running: 0,
            registry_failed: false,
        }
    }

    /// The next warm to start now, if any may start.
    pub fn start_next(&mut self) -> Option<Assignment> {
        if self.pending.is_empty() {
            return None;
        }
        if self.holders.is_empty() {
            // One pull from the registry: the others fetch through it (or a node that does).
            if self.running > 0 || self.registry_failed {
                return None;
            }
            let node = self.pending.pop_front()?;
            self.running += 1;
            self.holders.push((node.clone(), 0));
            return Some(Assignment {
                node,
                parent: None,
                peers: Vec::new(),
            });
        }
        // The first started with a free slot: a breadth-first tree, as shallow as the fan-out
        // allows (every hop adds its lag, and a failure hurts fewer nodes below it).
        let i = self
            .holders
            .iter()
            .position(|(_, serving)| *serving < self.fanout)?;
        let node = self.pending.pop_front()?;
        self.holders[i].1 += 1;
        self.running += 1;
        let parent = self.holders[i].0.clone();
        let mut peers = vec![parent.clone()];
        // Only nodes started before it: no node ever waits for a blob on one that waits on it.
        peers.extend(
            self.holders
                .iter()
                .filter(|(h, _)| *h != parent)
                .map(|(h, _)| h.clone())
                .take(FALLBACKS),
        );
        self.holders.push((node.clone(), 0));
        Some(Assignment {
            node,
            parent: Some(parent),
            peers,
        })
    }

    /// A warm ended; `ok` when the node now holds the image.
    pub fn done(&mut self, a: &Assignment, ok: bool) {
        self.running = self.running.saturating_sub(1);
        if let Some(p) = &a.parent
            && let Some(h) = self.holders.iter_mut().find(|(h, _)| h == p)
        {
            h.1 = h.1.saturating_sub(1);
        }
        if !ok {
            // Its children, if any, go on with their other sources; no new ones are given it.
            self.holders.retain(|(h, _)| *h != a.node);
            if a.parent.is_none() {
                self.registry_failed = true;
            }
        }
    }

    /// Whether nothing more will start or finish.
    pub fn finished(&self) -> bool {
        self.running == 0 && (self.pending.is_empty() || self.next_is_blocked())
    }

    fn next_is_blocked(&self) -> bool {
        self.holders.is_empty() && self.registry_failed
    }

    /// Nodes never started (the registry pull failed).
    pub fn not_started(&self) -> Vec<String> {
        self.pending.iter().cloned().collect()
    }
}

fn warm(
    addr: &str,
    key: &berth_api::auth::Key,
    req: &WarmRequest,
    timeout: Duration,
) -> Result<WarmReply, AgentError> {
    let agent = crate::client::agent(timeout);
    let body = serde_json::to_vec(req).expect("serializes");
    let (status, bytes) = crate::client::call(&agent, key, addr, "/v1/warm", Some(&body), 1 << 20)?;
    if status != 200 {
        return Err(AgentError::Host(format!(
            "{addr}: HTTP {status}: {}",
            String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).trim()
        )));
    }
    serde_json::from_slice(&bytes)
        .map_err(|e| AgentError::Host(format!("{addr}: the answer does not parse: {e}")))
}

/// One node's outcome.
#[derive(Debug, serde::Serialize)]
pub struct Outcome {
    pub node: String,
    /// The node it fetched from, `registry`, `(held it)`, or `-` when it never started.
    pub from: String,
    pub digest: Option<String>,
    pub error: Option<String>,
    pub seconds: f64,
}

/// Warms `req` on its nodes as a tree of at most `fanout` children per node (the registry serves
/// the first); `done` hears each node's outcome as it comes.
pub fn run(config: &Config, req: &Request, done: &dyn Fn(&Outcome)) -> Result<Report, AgentError> {
    // `lazy:REF`: each node fills its chunk cache of the lazy image (berth_image::lazy::warm)
    // through the same tree, so the registry serves each chunk once.
    let (lazy, text) = match req.reference.strip_prefix("lazy:") {
        Some(rest) => (true, rest),
        None => (false, req.reference.as_str()),
    };
    let reference = berth_image::reference::parse(text)?;
    if !matches!(reference, Reference::Registry(_)) {
        return Err(AgentError::input(format!(
            "{}: only registry images are pre-warmed (a file is already where nodes can read it)",
            req.reference
        )));
    }
    let key = berth_image::reference::reference_key(&reference);
    // A lazy image's holders are known by its index, not its reference: every node warms (one
    // that holds every chunk already fetches none).
    let key = if lazy { format!("lazy:{key}") } else { key };
    let Survey {
        catalog,
        addrs,
        targets,
        holders,
    } = survey(config, req, &key)?;
    let cluster_key = berth_api::auth::Key::new(&crate::client::read_key(&config.agent.key_file)?);
    let timeout = req.timeout;
    let started = Instant::now();
    let mut plan = Plan::new(targets.clone(), holders.clone(), req.fanout);
    let (tx, rx) = mpsc::channel::<(Assignment, Result<WarmReply, AgentError>)>();
    let mut outcomes: HashMap<String, Outcome> = HashMap::new();
    for h in holders.iter().filter(|h| targets.contains(h)) {
        outcomes.insert(
            h.clone(),
            Outcome {
                node: h.clone(),
                from: "(held it)".into(),
                digest: catalog
                    .iter()
                    .find(|n| &n.node == h)
                    .and_then(|n| n.refs.get(&key).cloned()),
                error: None,
                seconds: 0.0,
            },
        );
    }
    loop {
        while let Some(a) = plan.start_next() {
            let warm_req = WarmRequest {
                reference: key.clone(),
                peers: a.peers.iter().map(|p| addrs[p].clone()).collect(),
            };
            let (tx, addr, cluster_key) = (tx.clone(), addrs[&a.node].clone(), cluster_key.clone());
            std::thread::spawn(move || {
                let r = warm(&addr, &cluster_key, &warm_req, timeout);
                let _ = tx.send((a, r));
            });
        }
        if plan.finished() {
            break;
        }
        let Ok((a, r)) = rx.recv() else { break };
        let outcome = outcome_of(&a, r);
        done(&outcome);
        plan.done(&a, outcome.digest.is_some());
        outcomes.insert(a.node.clone(), outcome);
    }
    for n in plan.not_started() {
        outcomes.insert(
            n.clone(),
            Outcome {
                node: n,
                from: "-".into(),
                digest: None,
                error: Some("not started: the pull from the registry failed".into()),
                seconds: 0.0,
            },
        );
    }
    let mut all: Vec<Outcome> = outcomes.into_values().collect();
    all.sort_by(|a, b| a.node.cmp(&b.node));
    Ok(Report {
        outcomes: all,
        key,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// What the controller's catalog says of a warm: each node's peers address, the nodes to warm
/// (all that have one, or those the request names), and those that hold the image already.
struct Survey {
    catalog: Vec<CatalogNode>,
    addrs: BTreeMap<String, String>,
    targets: Vec<String>,
    holders: Vec<String>,
}

fn survey(config: &Config, req: &Request, key: &str) -> Result<Survey, AgentError> {
    let mut client = Client::new(config)?;
    let (addr, status, bytes) = client.request("/v1/catalog", None, true)?;
    if status != 200 {
        return Err(AgentError::host(format!(
            "controller {addr}: HTTP {status}: {}",
            String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).trim()
        )));
    }
    let catalog: Vec<CatalogNode> = serde_json::from_slice(&bytes)
        .map_err(|e| AgentError::host(format!("the controller's catalog does not parse: {e}")))?;
    let addrs: BTreeMap<String, String> = catalog
        .iter()
        .filter_map(|n| n.peer.clone().map(|p| (n.node.clone(), p)))
        .collect();
    let targets: Vec<String> = if req.nodes.is_empty() {
        addrs.keys().cloned().collect()
    } else {
        req.nodes.clone()
    };
    if targets.is_empty() {
        return Err(AgentError::input(
            "no node to warm: no agent reports a peers.listen address (set [peers] listen on \
             the nodes) and --nodes names none",
        ));
    }
    if let Some(bad) = targets.iter().find(|t| !addrs.contains_key(*t)) {
        return Err(AgentError::input(format!(
            "node {bad}: the controller knows no peers address for it: is its agent running \
             with [peers] listen set? (berth cluster nodes lists the nodes)"
        )));
    }
    let holders: Vec<String> = catalog
        .iter()
        .filter(|n| n.peer.is_some() && n.refs.contains_key(key))
        .map(|n| n.node.clone())
        .collect();
    Ok(Survey {
        catalog,
        addrs,
        targets,
        holders,
    })
}

/// A node's outcome from its agent's answer: the image's digest when it holds it now.
fn outcome_of(a: &Assignment, r: Result<WarmReply, AgentError>) -> Outcome {
    let from = a.parent.clone().unwrap_or_else(|| "registry".into());
    match r {
        Ok(reply) => Outcome {
            node: a.node.clone(),
            from,
            digest: reply.digest,
            error: reply.error,
            seconds: reply.seconds,
        },
        Err(e) => Outcome {
            node: a.node.clone(),
            from,
            digest: None,
            error: Some(e.to_string()),
            seconds: 0.0,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: usize) -> Vec<String> {
        (1..=n).map(|i| format!("n{i}")).collect()
    }

    #[test]
    fn one_registry_pull_and_the_whole_tree_starts_at_once_k_children_each() {
        let mut p = Plan::new(names(8), Vec::new(), 2);
        let all: Vec<Assignment> = std::iter::from_fn(|| p.start_next()).collect();
        assert_eq!(all.len(), 8, "every node starts at once");
        assert_eq!(all[0].parent, None, "one registry pull");
        assert!(all[1..].iter().all(|a| a.parent.is_some()));
        let mut count: HashMap<String, usize> = HashMap::new();
        for (i, a) in all.iter().enumerate().skip(1) {
            *count.entry(a.parent.clone().unwrap()).or_default() += 1;
            assert_eq!(a.peers[0], *a.parent.as_ref().unwrap());
            assert!(a.peers.len() <= 1 + FALLBACKS);
            // Every source started before the node: no cycle of waits.
            let earlier: Vec<&String> = all[..i].iter().map(|b| &b.node).collect();
            assert!(a.peers.iter().all(|s| earlier.contains(&s)), "{a:?}");
        }
        assert!(count.values().all(|c| *c <= 2), "{count:?}");
        assert_eq!(count["n1"], 2);
        for a in &all {
            p.done(a, true);
        }
        assert!(p.finished());
    }

    #[test]
    fn a_failed_child_frees_its_parents_slot_and_a_failed_registry_pull_stops() {
        let mut p = Plan::new(names(3), vec!["n1".into()], 1);
        let a = p.start_next().unwrap();
        assert_eq!((a.node.as_str(), a.parent.as_deref()), ("n2", Some("n1")));
        let b = p.start_next().unwrap();
        assert_eq!((b.node.as_str(), b.parent.as_deref()), ("n3", Some("n2")));
        assert_eq!(b.peers, vec!["n2".to_string(), "n1".to_string()]);
        // n2 failed: it is no parent for anyone after, and n1's slot is free again.
        p.done(&a, false);
        let mut r = Plan::new(names(4), vec!["n1".into()], 1);
        let a = r.start_next().unwrap();
        r.done(&a, false);
        let b = r.start_next().unwrap();
        assert_eq!((b.node.as_str(), b.parent.as_deref()), ("n3", Some("n1")));
        let mut q = Plan::new(names(3), Vec::new(), 4);
        let root = q.start_next().unwrap();
        q.done(&root, false);
        assert!(q.start_next().is_none());
        assert!(q.finished());
        assert_eq!(q.not_started(), vec!["n2".to_string(), "n3".to_string()]);
    }
}
