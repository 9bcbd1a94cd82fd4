//! A client of the cluster controllers (`berth agent`, `berth cluster`, pre-warm): requests
//! signed with the shared key and answers checked for the server's proof of it (berth_api::auth;
//! the key itself is never sent), bounded requests, a follower's redirect to the leader.

use std::io::Read;
use std::path::Path;
use std::time::Duration;

use berth_api::NotLeader;
use berth_api::auth::{self, Key};
use berth_config::Config;

use crate::AgentError;

/// How long one request to a controller may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// The most bytes a controller's answer may hold.
const REPLY_MAX: u64 = 16 << 20;
/// Hops from follower to leader before giving up on one attempt.
const MAX_HOPS: usize = 3;

/// A client of the cluster controllers.
#[derive(Debug)]
pub struct Client {
    agent: ureq::Agent,
    controllers: Vec<String>,
    key: Key,
    /// The leader's address, learnt from a follower's 421 or the last success.
    leader: Option<String>,
}

/// Reads the shared key file: at most [`berth_api::KEY_MAX`] bytes, not empty, owned by root
/// or by the user reading it and closed to group and others (like munge.key): a key others
/// could read or replace authenticates nothing, so such a file is refused in one line.
pub fn read_key(path: &Path) -> Result<String, AgentError> {
    use std::os::unix::fs::MetadataExt;
    let hint = || {
        format!(
            "reading the cluster key file {}: it must hold the controllers' key (agent.key_file)",
            path.display()
        )
    };
    let f = std::fs::File::open(path).map_err(|e| AgentError::input(format!("{}: {e}", hint())))?;
    // Checked on the open file, not the path: what is read is what was checked.
    let meta = f
        .metadata()
        .map_err(|e| AgentError::input(format!("{}: {e}", hint())))?;
    key_file_ok(meta.uid(), meta.mode(), nix::unistd::geteuid().as_raw()).map_err(|why| {
        AgentError::input(format!("the cluster key file {}: {why}", path.display()))
    })?;
    let mut key = String::new();
    f.take(berth_api::KEY_MAX as u64 + 1)
        .read_to_string(&mut key)
        .map_err(|e| AgentError::input(format!("{}: {e}", hint())))?;
    if key.trim().is_empty() || key.len() > berth_api::KEY_MAX {
        return Err(AgentError::input(format!(
            "{}: it is empty or longer than {} bytes",
            hint(),
            berth_api::KEY_MAX
        )));
    }
    Ok(key)
}

/// Whether a key file of owner `uid` and mode `mode` may be trusted by user `euid`: a regular
/// file owned by root or `euid`, with no permission for group or others. The same rule as
/// `berth-controller`'s (berth_api::key_file_problem).
pub fn key_file_ok(uid: u32, mode: u32, euid: u32) -> Result<(), AgentError> {
    match berth_api::key_file_problem(uid, mode, euid) {
        None => Ok(()),
        Some(why) => Err(AgentError::Input(why)),
    }
}

impl Client {
    pub fn new(config: &Config) -> Result<Self, AgentError> {
        if config.agent.controllers.is_empty() {
            return Err(AgentError::input(
                "no cluster controller configured: set agent.controllers in berth.toml",
            ));
        }
        let key = read_key(&config.agent.key_file)?;
        Ok(Self {
            agent: agent(REQUEST_TIMEOUT),
            controllers: config.agent.controllers.clone(),
            key: Key::new(&key),
            leader: None,
        })
    }

    fn once(
        &self,
        addr: &str,
        path: &str,
        body: Option<&[u8]>,
    ) -> Result<(u16, Vec<u8>), AgentError> {
        call(&self.agent, &self.key, addr, path, body, REPLY_MAX)
    }

    /// Sends a request to the leader (found through any controller) when `leader_only`, else
    /// to the first controller that answers. Returns the answering address, status and body.
    pub fn request(
        &mut self,
        path: &str,
        body: Option<&[u8]>,
        leader_only: bool,
    ) -> Result<(String, u16, Vec<u8>), AgentError> {
        let mut order: Vec<String> = self.leader.iter().cloned().collect();
        order.extend(
            self.controllers
                .iter()
                .filter(|c| Some(*c) != self.leader.as_ref())
                .cloned(),
        );
        let mut errors = Vec::new();
        for start in order {
            let mut addr = start;
            for _ in 0..MAX_HOPS {
                match self.once(&addr, path, body) {
                    Ok((status, bytes)) if status == berth_api::NOT_LEADER_STATUS => {
                        let next = serde_json::from_slice::<NotLeader>(&bytes)
                            .ok()
                            .and_then(|n| n.leader)
                            .filter(|l| *l != addr);
                        match next {
                            Some(l) => addr = l,
                            None => {
                                errors.push(format!("{addr}: not the leader, knows none yet"));
                                break;
                            }
                        }
                    }
                    Ok((status, bytes)) => {
                        if leader_only || status == 200 {
                            self.leader = leader_only.then(|| addr.clone());
                        }
                        return Ok((addr, status, bytes));
                    }
                    Err(e) => {
                        if self.leader.as_deref() == Some(addr.as_str()) {
                            self.leader = None;
                        }
                        errors.push(e.to_string());
                        break;
                    }
                }
            }
        }
        Err(AgentError::Host(format!(
            "no cluster controller answered ({}): check agent.controllers and that a \
             controller runs",
            errors.join("; ")
        )))
    }

    /// [`Client::request`], with any answer but 200 an error worded from the controller's
    /// error body (`controller ADDR: HTTP 409: ...`).
    pub fn ask(
        &mut self,
        path: &str,
        body: Option<&[u8]>,
        leader_only: bool,
    ) -> Result<Vec<u8>, AgentError> {
        let (addr, status, bytes) = self.request(path, body, leader_only)?;
        if status != 200 {
            let msg = serde_json::from_slice::<berth_api::ErrorReply>(&bytes)
                .map(|e| e.error)
                .unwrap_or_else(|_| {
                    String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).into_owned()
                });
            return Err(AgentError::host(format!(
                "controller {addr}: HTTP {status}: {msg}"
            )));
        }
        Ok(bytes)
    }

    /// [`Client::ask`], the answer decoded as `T`.
    pub fn ask_json<T: serde::de::DeserializeOwned>(
        &mut self,
        path: &str,
        body: Option<&[u8]>,
        leader_only: bool,
    ) -> Result<T, AgentError> {
        let bytes = self.ask(path, body, leader_only)?;
        serde_json::from_slice(&bytes).map_err(|e| {
            AgentError::host(format!(
                "the controller's answer to {path} does not parse: {e}"
            ))
        })
    }
}

/// An HTTP agent for calls between berth processes: no kept-alive connections (servers close
/// idle ones after a few seconds, listen.rs), every call within `timeout`.
pub fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(timeout))
        .max_idle_connections(0)
        .user_agent(concat!("berth/", env!("CARGO_PKG_VERSION")))
        .build()
        .into()
}

/// One call to another berth process at `addr`: `POST` with `body` (JSON), else `GET`, signed
/// with `key`; returns the status and body (at most `limit` bytes) once the answer proved the
/// server holds the key too (an answer without that proof is refused, whatever it says).
pub fn call(
    agent: &ureq::Agent,
    key: &Key,
    addr: &str,
    path: &str,
    body: Option<&[u8]>,
    limit: u64,
) -> Result<(u16, Vec<u8>), AgentError> {
    let url = format!("http://{addr}{path}");
    let method = if body.is_some() { "POST" } else { "GET" };
    let signed = auth::sign_request(key, method, path, body.unwrap_or_default())
        .map_err(|e| AgentError::Host(format!("{url}: {e}")))?;
    let resp = match body {
        Some(b) => agent
            .post(&url)
            .header(auth::AUTH_HEADER, &signed.header)
            .content_type("application/json")
            .send(b),
        None => agent
            .get(&url)
            .header(auth::AUTH_HEADER, &signed.header)
            .call(),
    };
    let mut resp = resp.map_err(|e| AgentError::Host(format!("{url}: {e}")))?;
    let status = resp.status().as_u16();
    let proof = resp
        .headers()
        .get(auth::PROOF_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let bytes = resp
        .body_mut()
        .with_config()
        .limit(limit)
        .read_to_vec()
        .map_err(|e| AgentError::Host(format!("{url}: {e}")))?;
    auth::verify_answer(
        key,
        proof.as_deref(),
        &signed.nonce,
        status,
        &auth::body_tag(&bytes),
    )
    .map_err(|e| {
        let said = String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
            .trim()
            .replace('\n', " ");
        AgentError::Host(format!("{url}: HTTP {status}: {e} (it said: {said})"))
    })?;
    Ok((status, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_file_rule_is_the_controllers() {
        key_file_ok(0, 0o100600, 0).unwrap();
        assert!(
            key_file_ok(0, 0o100644, 0)
                .unwrap_err()
                .to_string()
                .contains("chmod 600")
        );
        assert!(key_file_ok(1000, 0o100600, 0).is_err());
    }
}
