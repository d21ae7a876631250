//! A router's KV index written to the JetStream object store, so that a
//! replica that starts loads it and replays the KV events stream from
//! `stream_seq` instead of asking every worker for a dump.
//!
//! Invariants (checked when a snapshot is loaded, not trusted):
//! - every block appears in exactly one run; a run has ≥ 1 block and ≥ 1
//!   holder, holders are distinct workers with tier bits in `1..=7`
//!   (bit 0 device, 1 host, 2 disk);
//! - every holder is one of `workers`, whose events up to `last_event_id`
//!   (of `generation`) the snapshot reflects;
//! - every KV events stream message at or below `stream_seq` had been
//!   applied when it was taken (later ones may have been too: replaying
//!   them is harmless, a worker's event ids drop duplicates).

use crate::blocks::SequenceHash;
use crate::codec::{MessageKind, WireMessage};
use crate::ids::{EventId, RouterId, WorkerId};
use serde::{Deserialize, Serialize};

macro_rules! wire {
    ($ty:ident = $kind:literal) => {
        impl WireMessage for $ty {
            const KIND: MessageKind = MessageKind($kind);
            const NAME: &'static str = stringify!($ty);
        }
    };
}

/// The object store object holding the newest snapshot.
pub const KV_SNAPSHOT_OBJECT: &str = "kv-index";

/// One worker whose blocks a snapshot holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvSnapshotWorker {
    pub worker_id: WorkerId,
    pub generation: u64,
    pub last_event_id: EventId,
}

/// A worker holding a run, and in which tiers (bit 0 device, 1 host, 2 disk).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvSnapshotHolder {
    pub worker_id: WorkerId,
    pub tiers: u8,
}

/// Consecutive blocks (normally of one prefix chain) held by exactly the
/// same workers in the same tiers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvSnapshotRun {
    pub blocks: Vec<SequenceHash>,
    pub holders: Vec<KvSnapshotHolder>,
}

/// The whole index at one point of the KV events stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvIndexSnapshot {
    /// Every stream message up to this sequence is reflected.
    pub stream_seq: u64,
    pub taken_unix_ms: u64,
    /// The replica that wrote it.
    pub router_id: RouterId,
    pub workers: Vec<KvSnapshotWorker>,
    pub runs: Vec<KvSnapshotRun>,
}
wire!(KvIndexSnapshot = 64);

impl KvIndexSnapshot {
    /// Blocks in all runs.
    pub fn blocks(&self) -> usize {
        self.runs.iter().map(|r| r.blocks.len()).sum()
    }
}
