//! The controller's accept loop: hyper's HTTP/1 server over each connection, with the bounds
//! agents, the admin's CLI and other controllers rely on when a local user or a host on the
//! network opens connections without the key (axum::serve has none).
//!
//! - At most [`MAX_CONNECTIONS`] connections at once, [`MAX_PER_ADDRESS`] from one address.
//! - A connection is unauthenticated until one of its requests verified (server.rs, `auth`).
//!   When a cap is reached, a new connection closes the oldest unauthenticated one (of that
//!   address for the per-address cap); when every connection is authenticated, the new one is
//!   closed instead. Keyed clients thus always get in past any number of idle or slow ones.
//! - A request head must arrive within [`HEADER_DEADLINE`] (hyper's header_read_timeout, also
//!   for an idle kept-alive connection), and its body within server.rs's deadline.
//! - An accept that fails (EMFILE, ENFILE) waits a little instead of spinning or ending the
//!   server; main raises the soft RLIMIT_NOFILE to the hard limit at start.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::sync::Notify;

/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 512;
/// Connections served at once from one address.
pub const MAX_PER_ADDRESS: usize = 128;
/// How long a request head (or the next one on a kept-alive connection) may take to arrive.
pub const HEADER_DEADLINE: Duration = Duration::from_secs(5);

/// One open connection, as the auth middleware sees it (a request extension).
#[derive(Debug)]
pub struct Conn {
    ip: IpAddr,
    authenticated: AtomicBool,
    close: Notify,
}

impl Conn {
    /// Marks the connection as one of a key holder: never closed to make room.
    pub fn authenticated(&self) {
        self.authenticated.store(true, Ordering::Release);
    }

    fn is_authenticated(&self) -> bool {
        self.authenticated.load(Ordering::Acquire)
    }
}

#[derive(Default)]
struct Conns {
    /// By the order they came in: the first unauthenticated one is the oldest.
    open: Mutex<BTreeMap<u64, Arc<Conn>>>,
    next: AtomicU64,
}

impl Conns {
    /// Registers a new connection from `ip`, closing the oldest unauthenticated one when a cap
    /// is reached; `None` when there is no room (every connection in the way is authenticated).
    fn admit(&self, ip: IpAddr) -> Option<(u64, Arc<Conn>)> {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let from_ip = open.values().filter(|c| c.ip == ip).count();
        if from_ip >= MAX_PER_ADDRESS && !evict(&mut open, Some(ip)) {
            return None;
        }
        if open.len() >= MAX_CONNECTIONS && !evict(&mut open, None) {
            return None;
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(Conn {
            ip,
            authenticated: AtomicBool::new(false),
            close: Notify::new(),
        });
        open.insert(id, conn.clone());
        Some((id, conn))
    }

    fn remove(&self, id: u64) {
        self.open
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
    }
}

/// Closes the oldest unauthenticated connection (of `ip`, when given); whether there was one.
fn evict(open: &mut BTreeMap<u64, Arc<Conn>>, ip: Option<IpAddr>) -> bool {
    let victim = open
        .iter()
        .find(|(_, c)| !c.is_authenticated() && ip.is_none_or(|ip| c.ip == ip))
        .map(|(id, _)| *id);
    match victim.and_then(|id| open.remove(&id)) {
        Some(c) => {
            // notify_one keeps a permit: a connection task not yet waiting still sees it.
            c.close.notify_one();
            true
        }
        None => false,
    }
}

/// Serves `router` on `listener` until the process ends.
pub async fn serve(listener: tokio::net::TcpListener, router: Router) {
    let conns = Arc::new(Conns::default());
    loop {
        let (stream, addr) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!("accepting a connection: {e}; retrying in 100 ms");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some((id, conn)) = conns.admit(addr.ip()) else {
            tracing::debug!("{addr}: no room (every connection is authenticated); closed");
            continue;
        };
        let (conns, router) = (conns.clone(), router.clone());
        tokio::spawn(async move {
            let service = hyper::service::service_fn({
                let conn = conn.clone();
                move |mut req: hyper::Request<hyper::body::Incoming>| {
                    req.extensions_mut().insert(conn.clone());
                    tower_service::Service::call(&mut router.clone(), req)
                }
            });
            let http = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_DEADLINE)
                .serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                r = http => {
                    if let Err(e) = r {
                        tracing::debug!("{addr}: {e}");
                    }
                }
                () = conn.close.notified() => {
                    tracing::debug!("{addr}: closed to make room for another connection");
                }
            }
            conns.remove(id);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_server_closes_the_oldest_unauthenticated_connection_first() {
        let conns = Conns::default();
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let mut from_a = Vec::new();
        for _ in 0..MAX_PER_ADDRESS {
            from_a.push(conns.admit(a).unwrap());
        }
        from_a[0].1.authenticated();
        // a's cap: the oldest unauthenticated of a (the second) makes room, the first stays.
        let (new_id, _) = conns.admit(a).unwrap();
        let open = conns.open.lock().unwrap().clone();
        assert!(open.contains_key(&from_a[0].0));
        assert!(!open.contains_key(&from_a[1].0));
        assert!(open.contains_key(&new_id));
        drop(open);
        // Another address is not held back by a's connections.
        conns.admit(b).unwrap();
        // Every connection of an address authenticated: a new one from there gets no room.
        for c in conns.open.lock().unwrap().values() {
            c.authenticated();
        }
        assert!(conns.admit(a).is_none());
    }
}
