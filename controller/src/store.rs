//! The Raft log and state machine, stored in one redb file (`<data dir>/raft.redb`).
//!
//! Tables: `log` (index → JSON entry) and `meta` (vote, committed, last purged log id, and
//! the state machine: the applied [`State`] with its last applied log id and membership,
//! rewritten in the same transaction as each applied batch, so a restart resumes exactly where
//! the last durable apply left off). The state is small (a few hundred bytes per node), so it is
//! also the snapshot.

// openraft's StorageError is what its storage traits return: large, and not ours to shrink.
#![allow(clippy::result_large_err)]

use std::fmt::Debug;
use std::io::Cursor;
use std::ops::RangeBounds;
use std::path::Path;
use std::sync::{Arc, Mutex};

use openraft::storage::{LogState, RaftLogReader, RaftSnapshotBuilder, RaftStorage, Snapshot};
use openraft::{
    Entry, EntryPayload, LogId, OptionalSend, SnapshotMeta, StorageError, StorageIOError,
    StoredMembership, Vote,
};
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};

use crate::TypeConfig;
use crate::state::{Reply, State};

type NodeId = u64;
type Node = openraft::BasicNode;

const LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("log");
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");

/// The state machine as stored.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Machine {
    pub last_applied: Option<LogId<NodeId>>,
    pub membership: StoredMembership<NodeId, Node>,
    pub state: State,
}

/// Shared handle: the Raft core, the log reader, the snapshot builder and the HTTP API's
/// readers all hold clones.
#[derive(Clone)]
pub struct Store {
    db: Arc<Database>,
    pub machine: Arc<Mutex<Machine>>,
}

fn io_err<E: std::error::Error + 'static>(e: E) -> StorageError<NodeId> {
    StorageIOError::write(&e).into()
}

impl Store {
    pub fn open(path: &Path) -> anyhow::Result<Self> {
        let db = Database::create(path)
            .map_err(|e| anyhow::anyhow!("opening the Raft store {}: {e}", path.display()))?;
        let txn = db.begin_write()?;
        txn.open_table(LOG)?;
        txn.open_table(META)?;
        txn.commit()?;
        let store = Self {
            db: Arc::new(db),
            machine: Arc::default(),
        };
        if let Some(m) = store.get_meta::<Machine>("machine")? {
            *store.lock() = m;
        }
        Ok(store)
    }

    pub fn lock(&self) -> std::sync::MutexGuard<'_, Machine> {
        // A panic while holding the lock leaves a consistent value (every write replaces it).
        self.machine.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn get_meta<T: for<'a> Deserialize<'a>>(&self, key: &str) -> anyhow::Result<Option<T>> {
        let txn = self.db.begin_read()?;
        let t = txn.open_table(META)?;
        Ok(match t.get(key)? {
            Some(v) => Some(serde_json::from_slice(v.value())?),
            None => None,
        })
    }

    fn meta<T: for<'a> Deserialize<'a>>(
        &self,
        key: &str,
    ) -> Result<Option<T>, StorageError<NodeId>> {
        self.get_meta(key)
            .map_err(|e| StorageIOError::read(&std::io::Error::other(e.to_string())).into())
    }

    fn put_meta<T: Serialize>(&self, key: &str, value: &T) -> Result<(), StorageError<NodeId>> {
        let bytes = serde_json::to_vec(value).map_err(io_err)?;
        let txn = self.db.begin_write().map_err(io_err)?;
        txn.open_table(META)
            .map_err(io_err)?
            .insert(key, bytes.as_slice())
            .map_err(io_err)?;
        txn.commit().map_err(io_err)
    }

    fn save_machine(&self, m: &Machine) -> Result<(), StorageError<NodeId>> {
        self.put_meta("machine", m)
    }
}

impl RaftLogReader<TypeConfig> for Store {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<TypeConfig>>, StorageError<NodeId>> {
        let txn = self.db.begin_read().map_err(io_err)?;
        let t = txn.open_table(LOG).map_err(io_err)?;
        let mut out = Vec::new();
        for row in t.range(range).map_err(io_err)? {
            let (_, v) = row.map_err(io_err)?;
            out.push(serde_json::from_slice(v.value()).map_err(io_err)?);
        }
        Ok(out)
    }
}

impl RaftSnapshotBuilder<TypeConfig> for Store {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError<NodeId>> {
        let m = self.lock().clone();
        let data = serde_json::to_vec(&m).map_err(io_err)?;
        let id = m.last_applied.map_or_else(
            || "0-0".to_string(),
            |l| format!("{}-{}", l.leader_id, l.index),
        );
        let meta = SnapshotMeta {
            last_log_id: m.last_applied,
            last_membership: m.membership.clone(),
            snapshot_id: id,
        };
        self.put_meta("snapshot", &(&meta, &data))?;
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(data)),
        })
    }
}

impl RaftStorage<TypeConfig> for Store {
    type LogReader = Self;
    type SnapshotBuilder = Self;

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError<NodeId>> {
        self.put_meta("vote", vote)
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError<NodeId>> {
        self.meta("vote")
    }

    async fn save_committed(
        &mut self,
        committed: Option<LogId<NodeId>>,
    ) -> Result<(), StorageError<NodeId>> {
        self.put_meta("committed", &committed)
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<NodeId>>, StorageError<NodeId>> {
        Ok(self.meta::<Option<LogId<NodeId>>>("committed")?.flatten())
    }

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError<NodeId>> {
        let purged: Option<LogId<NodeId>> = self.meta::<Option<LogId<NodeId>>>("purged")?.flatten();
        let txn = self.db.begin_read().map_err(io_err)?;
        let t = txn.open_table(LOG).map_err(io_err)?;
        let last = match t.last().map_err(io_err)? {
            Some((_, v)) => {
                let e: Entry<TypeConfig> = serde_json::from_slice(v.value()).map_err(io_err)?;
                Some(e.log_id)
            }
            None => purged,
        };
        Ok(LogState {
            last_purged_log_id: purged,
            last_log_id: last,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn append_to_log<I>(&mut self, entries: I) -> Result<(), StorageError<NodeId>>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + OptionalSend,
    {
        let txn = self.db.begin_write().map_err(io_err)?;
        {
            let mut t = txn.open_table(LOG).map_err(io_err)?;
            for e in entries {
                let bytes = serde_json::to_vec(&e).map_err(io_err)?;
                t.insert(e.log_id.index, bytes.as_slice()).map_err(io_err)?;
            }
        }
        txn.commit().map_err(io_err)
    }

    async fn delete_conflict_logs_since(
        &mut self,
        log_id: LogId<NodeId>,
    ) -> Result<(), StorageError<NodeId>> {
        let txn = self.db.begin_write().map_err(io_err)?;
        {
            let mut t = txn.open_table(LOG).map_err(io_err)?;
            t.retain_in(log_id.index.., |_, _| false).map_err(io_err)?;
        }
        txn.commit().map_err(io_err)
    }

    async fn purge_logs_upto(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        self.put_meta("purged", &Some(log_id))?;
        let txn = self.db.begin_write().map_err(io_err)?;
        {
            let mut t = txn.open_table(LOG).map_err(io_err)?;
            t.retain_in(..=log_id.index, |_, _| false).map_err(io_err)?;
        }
        txn.commit().map_err(io_err)
    }

    async fn last_applied_state(
        &mut self,
    ) -> Result<(Option<LogId<NodeId>>, StoredMembership<NodeId, Node>), StorageError<NodeId>> {
        let m = self.lock();
        Ok((m.last_applied, m.membership.clone()))
    }

    async fn apply_to_state_machine(
        &mut self,
        entries: &[Entry<TypeConfig>],
    ) -> Result<Vec<Reply>, StorageError<NodeId>> {
        let mut m = self.lock().clone();
        let mut replies = Vec::with_capacity(entries.len());
        for e in entries {
            m.last_applied = Some(e.log_id);
            match &e.payload {
                EntryPayload::Blank => replies.push(Reply::default()),
                EntryPayload::Normal(cmd) => replies.push(m.state.apply(cmd)),
                EntryPayload::Membership(mem) => {
                    m.membership = StoredMembership::new(Some(e.log_id), mem.clone());
                    replies.push(Reply::default());
                }
            }
        }
        self.save_machine(&m)?;
        *self.lock() = m;
        Ok(replies)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(
        &mut self,
    ) -> Result<Box<Cursor<Vec<u8>>>, StorageError<NodeId>> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, Node>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError<NodeId>> {
        let data = snapshot.into_inner();
        let mut m: Machine = serde_json::from_slice(&data).map_err(io_err)?;
        m.last_applied = meta.last_log_id;
        m.membership = meta.last_membership.clone();
        self.save_machine(&m)?;
        self.put_meta("snapshot", &(meta, &data))?;
        *self.lock() = m;
        Ok(())
    }

    async fn get_current_snapshot(
        &mut self,
    ) -> Result<Option<Snapshot<TypeConfig>>, StorageError<NodeId>> {
        let s: Option<(SnapshotMeta<NodeId, Node>, Vec<u8>)> = self.meta("snapshot")?;
        Ok(s.map(|(meta, data)| Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(data)),
        }))
    }
}
