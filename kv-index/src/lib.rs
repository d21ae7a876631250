//! `dynamo-kv-index`: which worker holds which KV blocks, fed by the
//! engines' KV events, answering "how long a prefix of this request does
//! each worker already hold, and in which tier?".
//!
//! NATS-free: the router actor feeds it events and queries it; benches and
//! property tests drive it alone.
//!
//! Design: a block's [`SequenceHash`] already identifies its whole prefix,
//! so the index is a flat table per tier from sequence hash to a 128-bit
//! mask of the workers holding that block ([`table::MaskTable`]). A query
//! walks the request's hashes in order, intersecting masks; a worker drops
//! out at the first block it lacks, which is its matched prefix length.
//!
//! Invariants:
//! - a worker's bit is set on a block in a tier iff the last event about that
//!   (worker, tier, block) was `Stored` (and no `Cleared`/removal came after);
//! - `find_matches` returns, for every worker holding at least the first
//!   block, the number of leading blocks it holds in any tier, split by the
//!   cheapest tier holding each (device < host < disk);
//! - per-worker block counts equal the number of set bits for that worker;
//! - at most [`MAX_WORKERS`] workers are indexed at once (one bit each);
//!   a further worker is refused with [`IndexError::TooManyWorkers`].

pub mod table;
pub mod workload;

use dynamo_bus_schema::blocks::SequenceHash;
use dynamo_bus_schema::WorkerId;
use std::collections::HashMap;
use table::MaskTable;
use thiserror::Error;

/// Workers one index can hold (bits in a mask).
pub const MAX_WORKERS: usize = 128;

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
    #[error("the index already holds {MAX_WORKERS} workers; worker {0} was not indexed")]
    TooManyWorkers(WorkerId),
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

pub struct KvIndex {
    tables: [MaskTable; 3],
    slot_of: HashMap<WorkerId, u8>,
    worker_at: Vec<Option<WorkerId>>,
    counts: Vec<[u64; 3]>,
    registered: u128,
    orphans: u64,
}

impl Default for KvIndex {
    fn default() -> Self {
        Self::new()
    }
}

const AHEAD: usize = 8;

impl KvIndex {
    pub fn new() -> Self {
        KvIndex {
            tables: [MaskTable::new(), MaskTable::new(), MaskTable::new()],
            slot_of: HashMap::new(),
            worker_at: vec![None; MAX_WORKERS],
            counts: vec![[0; 3]; MAX_WORKERS],
            registered: 0,
            orphans: 0,
        }
    }

    fn slot(&mut self, w: WorkerId) -> Result<u8, IndexError> {
        if let Some(&s) = self.slot_of.get(&w) {
            return Ok(s);
        }
        let free = self
            .worker_at
            .iter()
            .position(Option::is_none)
            .ok_or(IndexError::TooManyWorkers(w))?;
        self.worker_at[free] = Some(w);
        self.slot_of.insert(w, free as u8);
        self.registered |= 1u128 << free;
        Ok(free as u8)
    }

    /// Applies one event.
    pub fn apply(&mut self, ev: &IndexEvent) -> Result<(), IndexError> {
        match &ev.data {
            IndexEventData::Stored {
                tier,
                parent,
                blocks,
            } => {
                let s = self.slot(ev.worker)?;
                let bit = 1u128 << s;
                if let Some(p) = parent {
                    if TIERS
                        .iter()
                        .all(|t| self.tables[*t as usize].get(p.0) & bit == 0)
                    {
                        self.orphans += 1;
                    }
                }
                let t = &mut self.tables[*tier as usize];
                for b in blocks {
                    if t.set(b.0, bit) & bit == 0 {
                        self.counts[s as usize][*tier as usize] += 1;
                    }
                }
            }
            IndexEventData::Removed { tier, blocks } => {
                if let Some(&s) = self.slot_of.get(&ev.worker) {
                    let bit = 1u128 << s;
                    let t = &mut self.tables[*tier as usize];
                    for b in blocks {
                        if t.clear(b.0, bit) & bit != 0 {
                            self.counts[s as usize][*tier as usize] -= 1;
                        }
                    }
                }
            }
            IndexEventData::Cleared => self.clear_worker(ev.worker),
        }
        Ok(())
    }

    fn clear_worker(&mut self, w: WorkerId) {
        if let Some(&s) = self.slot_of.get(&w) {
            let bit = 1u128 << s;
            for t in TIERS {
                if self.counts[s as usize][t as usize] > 0 {
                    self.tables[t as usize].clear_all(bit);
                }
            }
            self.counts[s as usize] = [0; 3];
        }
    }

    /// Forgets a worker entirely (it died or left).
    pub fn remove_worker(&mut self, w: WorkerId) {
        self.clear_worker(w);
        if let Some(s) = self.slot_of.remove(&w) {
            self.worker_at[s as usize] = None;
            self.registered &= !(1u128 << s);
        }
    }

    /// Blocks held by `w` per tier.
    pub fn blocks_of(&self, w: WorkerId) -> [u64; 3] {
        self.slot_of
            .get(&w)
            .map(|&s| self.counts[s as usize])
            .unwrap_or([0; 3])
    }

    /// Workers currently indexed.
    pub fn workers(&self) -> impl Iterator<Item = WorkerId> + '_ {
        self.worker_at.iter().flatten().copied()
    }

    /// Distinct (block, tier) entries.
    pub fn len(&self) -> usize {
        self.tables.iter().map(MaskTable::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `Stored` events whose parent the worker did not hold (out of order or missed).
    pub fn orphans(&self) -> u64 {
        self.orphans
    }

    /// Heap bytes of the tables.
    pub fn heap_bytes(&self) -> usize {
        self.tables.iter().map(MaskTable::heap_bytes).sum()
    }

    /// For each worker holding at least the first block of `hashes`, how
    /// many leading blocks it holds (see [`Overlap`]).
    pub fn find_matches(&self, hashes: &[SequenceHash]) -> Vec<(WorkerId, Overlap)> {
        let mut out = Vec::new();
        if hashes.is_empty() || self.registered == 0 {
            return out;
        }
        let lower = !self.tables[1].is_empty() || !self.tables[2].is_empty();
        let dev = &self.tables[0];
        for h in hashes.iter().take(AHEAD) {
            self.prefetch(h.0, lower);
        }
        // Per position masks, kept only when lower tiers exist (for the tier split).
        let mut per_pos: Vec<[u128; 3]> = Vec::new();
        let mut active = self.registered;
        let mut depth: [(u8, u32); MAX_WORKERS] = [(0, 0); MAX_WORKERS];
        let mut ndepth = 0;
        let mut reached = hashes.len();
        for (i, h) in hashes.iter().enumerate() {
            if let Some(next) = hashes.get(i + AHEAD) {
                self.prefetch(next.0, lower);
            }
            let d = dev.get(h.0);
            let any = if lower {
                let m = [d, self.tables[1].get(h.0), self.tables[2].get(h.0)];
                per_pos.push(m);
                m[0] | m[1] | m[2]
            } else {
                d
            };
            let dropped = active & !any;
            if dropped != 0 {
                let mut bits = dropped;
                while bits != 0 {
                    let b = bits.trailing_zeros() as u8;
                    bits &= bits - 1;
                    if i > 0 {
                        depth[ndepth] = (b, i as u32);
                        ndepth += 1;
                    }
                }
                active &= any;
                if active == 0 {
                    reached = i;
                    break;
                }
            }
        }
        let mut bits = active;
        while bits != 0 {
            let b = bits.trailing_zeros() as u8;
            bits &= bits - 1;
            depth[ndepth] = (b, reached as u32);
            ndepth += 1;
        }
        out.reserve(ndepth);
        for &(b, d) in &depth[..ndepth] {
            let Some(w) = self.worker_at[b as usize] else {
                continue;
            };
            let mut o = Overlap {
                blocks: d,
                device: d,
                host: 0,
                disk: 0,
            };
            if lower {
                let bit = 1u128 << b;
                o.device = 0;
                for m in &per_pos[..d as usize] {
                    if m[0] & bit != 0 {
                        o.device += 1;
                    } else if m[1] & bit != 0 {
                        o.host += 1;
                    } else {
                        o.disk += 1;
                    }
                }
            }
            out.push((w, o));
        }
        out
    }

    #[inline]
    fn prefetch(&self, key: u64, lower: bool) {
        self.tables[0].prefetch(key);
        if lower {
            self.tables[1].prefetch(key);
            self.tables[2].prefetch(key);
        }
    }
}

#[cfg(test)]
mod tests;
