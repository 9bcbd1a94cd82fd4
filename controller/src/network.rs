//! Raft RPCs between controllers: JSON over HTTP (`POST /raft/{append,vote,snapshot}` on the
//! peer's API address), sent with `ureq` on tokio's blocking pool, signed with the shared key
//! (berth_api::auth); an answer without the peer's proof of the key is refused.
//! Every call is bounded by openraft's per-RPC deadline, so a stopped peer (SIGSTOP: its socket
//! accepts but never answers) costs one timeout, not a stuck replication stream.

use std::time::Duration;

use openraft::BasicNode;
use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::TypeConfig;

type NodeId = u64;

/// The most bytes a peer's answer may hold.
const REPLY_MAX: u64 = 64 << 20;

#[derive(Clone)]
pub struct Network {
    pub key: berth_api::auth::Key,
}

pub struct Peer {
    target: NodeId,
    addr: String,
    key: berth_api::auth::Key,
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = Peer;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> Peer {
        Peer {
            target,
            addr: node.addr.clone(),
            key: self.key.clone(),
        }
    }
}

/// Why a call failed before the peer's Raft answered.
enum Fail {
    /// Could not reach it (refused, timed out): openraft backs off.
    Unreachable(std::io::Error),
    /// It answered something other than a Raft reply.
    Network(std::io::Error),
}

impl Peer {
    async fn call<Req: Serialize, Resp: DeserializeOwned + Send + 'static>(
        &self,
        path: &str,
        req: &Req,
        timeout: Duration,
    ) -> Result<Resp, Fail> {
        let body = serde_json::to_vec(req).map_err(|e| Fail::Network(std::io::Error::other(e)))?;
        let url = format!("http://{}{path}", self.addr);
        let key = self.key.clone();
        let path = path.to_string();
        let task = tokio::task::spawn_blocking(move || -> Result<Resp, Fail> {
            use berth_api::auth;
            let signed = auth::sign_request(&key, "POST", &path, &body)
                .map_err(|e| Fail::Network(std::io::Error::other(e.to_string())))?;
            let agent: ureq::Agent = ureq::Agent::config_builder()
                .http_status_as_error(false)
                .timeout_global(Some(timeout))
                .build()
                .into();
            let mut resp = agent
                .post(&url)
                .header(auth::AUTH_HEADER, &signed.header)
                .content_type("application/json")
                .send(&body[..])
                .map_err(|e| Fail::Unreachable(std::io::Error::other(format!("{url}: {e}"))))?;
            let status = resp.status().as_u16();
            let proof = resp
                .headers()
                .get(auth::PROOF_HEADER)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let bytes = resp
                .body_mut()
                .with_config()
                .limit(REPLY_MAX)
                .read_to_vec()
                .map_err(|e| Fail::Unreachable(std::io::Error::other(format!("{url}: {e}"))))?;
            auth::verify_answer(
                &key,
                proof.as_deref(),
                &signed.nonce,
                status,
                &auth::body_tag(&bytes),
            )
            .map_err(|e| Fail::Unreachable(std::io::Error::other(format!("{url}: {e}"))))?;
            if status != 200 {
                return Err(Fail::Network(std::io::Error::other(format!(
                    "{url}: HTTP {status}: {}",
                    String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
                ))));
            }
            serde_json::from_slice(&bytes)
                .map_err(|e| Fail::Network(std::io::Error::other(format!("{url}: {e}"))))
        });
        match task.await {
            Ok(r) => r,
            Err(e) => Err(Fail::Network(std::io::Error::other(e.to_string()))),
        }
    }

    async fn rpc<Req, Resp, E>(
        &self,
        path: &str,
        req: &Req,
        option: &RPCOption,
    ) -> Result<Resp, RPCError<NodeId, BasicNode, RaftError<NodeId, E>>>
    where
        Req: Serialize,
        Resp: DeserializeOwned + Send + 'static,
        E: std::error::Error + DeserializeOwned + Send + 'static,
    {
        match self
            .call::<Req, Result<Resp, RaftError<NodeId, E>>>(path, req, option.hard_ttl())
            .await
        {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(e)) => Err(RPCError::RemoteError(RemoteError::new(self.target, e))),
            Err(Fail::Unreachable(e)) => Err(RPCError::Unreachable(Unreachable::new(&e))),
            Err(Fail::Network(e)) => Err(RPCError::Network(NetworkError::new(&e))),
        }
    }
}

impl RaftNetwork<TypeConfig> for Peer {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        self.rpc("/raft/append", &rpc, &option).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<NodeId>,
        RPCError<NodeId, BasicNode, RaftError<NodeId, InstallSnapshotError>>,
    > {
        self.rpc("/raft/snapshot", &rpc, &option).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        self.rpc("/raft/vote", &rpc, &option).await
    }
}
