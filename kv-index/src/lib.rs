//! `dynamo-kv-index`: which worker holds which KV blocks, fed by the
//! engines' KV events, answering "how long a prefix of this request does
//! each worker already hold, and in which tier?".
//!
//! NATS-free: the router actor feeds it events and queries it; benches and
//! property tests drive it alone.
//!
//! Design: a block's [`SequenceHash`] already identifies its whole prefix,
//! so a table from sequence hash to the block's place is exact. Blocks with
//! the same holders are kept in runs ([`runs`]): a query does one random
//! access per run and compares the rest of the run sequentially; a worker
//! drops out at the first block it lacks, which is its matched prefix
//! length. [`flat::FlatIndex`] (one mask per block) is the test oracle.
//!
//! Invariants:
//! - a worker's bit is set on a block in a tier iff the last event about that
//!   (worker, tier, block) was `Stored` (and no `Cleared`/removal came after);
//! - `find_matches` returns, for every worker holding at least the first
//!   block, the number of leading blocks it holds in any tier, split by the
//!   cheapest tier holding each (device < host < disk);
//! - per-worker block counts equal the number of set bits for that worker;
//! - at most the index's worker limit ([`MAX_WORKERS`] by default) are
//!   indexed at once; a further worker is refused with
//!   [`IndexError::TooManyWorkers`].

pub mod flat;
mod runs;
pub mod table;
pub mod workload;

pub use runs::{KvIndex, SnapshotError, MAX_WORKERS};

use dynamo_bus_schema::blocks::SequenceHash;
use dynamo_bus_schema::WorkerId;
use thiserror::Error;

/// Where a block lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    Device = 0,
    Host = 1,
    Disk = 2,
}

pub const TIERS: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Disk];

/// A change in one worker's blocks.
#[derive(Clone, Debug, PartialEq)]
pub struct IndexEvent {
    pub worker: WorkerId,
    pub data: IndexEventData,
}

#[derive(Clone, Debug, PartialEq)]
pub enum IndexEventData {
    Stored {
        tier: Tier,
        parent: Option<SequenceHash>,
        blocks: Vec<SequenceHash>,
    },
    Removed {
        tier: Tier,
        blocks: Vec<SequenceHash>,
    },
    /// Every block of the worker, in every tier, is gone.
    Cleared,
}

#[derive(Debug, Error, PartialEq)]
pub enum IndexError {
    #[error("the index already holds its limit of {max} workers; worker {worker} was not indexed")]
    TooManyWorkers { worker: WorkerId, max: usize },
}

/// A worker's matched prefix for one query.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Overlap {
    /// Leading blocks held in any tier.
    pub blocks: u32,
    pub device: u32,
    pub host: u32,
    pub disk: u32,
}

#[cfg(test)]
mod tests;
