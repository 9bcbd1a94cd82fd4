//! Raft RPCs between controllers: JSON over HTTP (`POST /raft/{append,vote,snapshot}` on the
//! peer's API address), sent with `ureq` on tokio's blocking pool, carrying the shared key.
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
    pub bearer: String,
}

pub struct Peer {
    target: NodeId,
    addr: String,
    bearer: String,
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = Peer;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> Peer {
        Peer {
            target,
            addr: node.addr.clone(),
            bearer: self.bearer.clone(),
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
        let bearer = self.bearer.clone();
        let task = tokio::task::spawn_blocking(move || -> Result<Resp, Fail> {
            let agent: ureq::Agent = ureq::Agent::config_builder()
                .http_status_as_error(false)
                .timeout_global(Some(timeout))
                .build()
                .into();
            let mut resp = agent
                .post(&url)
                .header(berth_api::KEY_HEADER, &bearer)
                .content_type("application/json")
                .send(&body[..])
                .map_err(|e| Fail::Unreachable(std::io::Error::other(format!("{url}: {e}"))))?;
            let status = resp.status().as_u16();
            let bytes = resp
                .body_mut()
                .with_config()
                .limit(REPLY_MAX)
                .read_to_vec()
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
