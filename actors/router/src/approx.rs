//! Approximate KV tracking for engines that emit no KV events: the indexer
//! records the blocks of every request the router routes to such a worker
//! (as the router tells it), as if the worker had stored them, and forgets them after a TTL or when a size cap
//! is exceeded (oldest first).
//!
//! The router hands each routed prompt to the indexer by message, so a
//! prompt routed right after an identical one may not see its record yet
//! (as with real KV events, which follow the prefill).
//!
//! Invariants: a (worker, block) is in the index iff at least one unexpired
//! record holds it (records are reference-counted, so routing the same
//! prefix again keeps it alive); the number of recorded blocks never exceeds
//! the cap after `record` returns.

use dynamo_bus_schema::blocks::SequenceHash;
use dynamo_bus_schema::WorkerId;
use dynamo_kv_index::{IndexEvent, IndexEventData, KvIndex, Tier};
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Defaults from Dynamo's approximate mode.
pub const DEFAULT_TTL: Duration = Duration::from_secs(120);
pub const DEFAULT_CAP: usize = 1 << 20;

pub struct Approx {
    ttl: Duration,
    cap: usize,
    records: VecDeque<(Instant, WorkerId, Vec<SequenceHash>)>,
    refs: HashMap<(WorkerId, SequenceHash), u32>,
    blocks: usize,
}

impl Default for Approx {
    fn default() -> Self {
        Self::new(DEFAULT_TTL, DEFAULT_CAP)
    }
}

impl Approx {
    pub fn new(ttl: Duration, cap: usize) -> Self {
        Approx {
            ttl,
            cap,
            records: VecDeque::new(),
            refs: HashMap::new(),
            blocks: 0,
        }
    }

    /// Blocks currently recorded (with repeats).
    pub fn len(&self) -> usize {
        self.blocks
    }

    pub fn is_empty(&self) -> bool {
        self.blocks == 0
    }

    pub fn record(
        &mut self,
        index: &mut KvIndex,
        w: WorkerId,
        hashes: &[SequenceHash],
        now: Instant,
    ) {
        if hashes.is_empty() {
            return;
        }
        let mut fresh = Vec::new();
        for h in hashes {
            let r = self.refs.entry((w, *h)).or_insert(0);
            if *r == 0 {
                fresh.push(*h);
            }
            *r += 1;
        }
        if !fresh.is_empty() {
            let ev = IndexEvent {
                worker: w,
                data: IndexEventData::Stored {
                    tier: Tier::Device,
                    parent: None,
                    blocks: fresh,
                },
            };
            if let Err(e) = index.apply(&ev) {
                tracing::error!(error = %e, "approximate KV record refused");
            }
        }
        self.blocks += hashes.len();
        self.records.push_back((now + self.ttl, w, hashes.to_vec()));
        while self.blocks > self.cap {
            self.pop(index);
        }
    }

    fn pop(&mut self, index: &mut KvIndex) {
        let Some((_, w, hashes)) = self.records.pop_front() else {
            return;
        };
        self.blocks -= hashes.len();
        let mut gone = Vec::new();
        for h in hashes {
            if let Some(r) = self.refs.get_mut(&(w, h)) {
                *r -= 1;
                if *r == 0 {
                    self.refs.remove(&(w, h));
                    gone.push(h);
                }
            }
        }
        if !gone.is_empty() {
            let ev = IndexEvent {
                worker: w,
                data: IndexEventData::Removed {
                    tier: Tier::Device,
                    blocks: gone,
                },
            };
            let _ = index.apply(&ev);
        }
    }

    /// Puts every block a live record holds back into `index` (one that
    /// was replaced, as by a loaded snapshot, which holds none of them).
    pub fn reapply(&self, index: &mut KvIndex) {
        // Record by record, in prefix order, as they were first stored
        // (storing a block twice changes nothing).
        for (_, w, hashes) in &self.records {
            let ev = IndexEvent {
                worker: *w,
                data: IndexEventData::Stored {
                    tier: Tier::Device,
                    parent: None,
                    blocks: hashes.clone(),
                },
            };
            if let Err(e) = index.apply(&ev) {
                tracing::error!(error = %e, "approximate KV records not put back");
            }
        }
    }

    /// Drops records past their TTL.
    pub fn expire(&mut self, index: &mut KvIndex, now: Instant) {
        while self.records.front().is_some_and(|(t, _, _)| *t <= now) {
            self.pop(index);
        }
    }

    /// Forgets every record of a worker (it left or restarted).
    pub fn forget(&mut self, w: WorkerId) {
        self.records.retain(|(_, x, _)| *x != w);
        self.refs.retain(|(x, _), _| *x != w);
        self.blocks = self.records.iter().map(|(_, _, h)| h.len()).sum();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hs(r: std::ops::Range<u64>) -> Vec<SequenceHash> {
        r.map(SequenceHash).collect()
    }

    #[test]
    fn records_expire_by_ttl_and_cap_and_refcount() {
        let t0 = Instant::now();
        let mut idx = KvIndex::new();
        let mut a = Approx::new(Duration::from_secs(10), 8);
        let w = WorkerId(1);
        a.record(&mut idx, w, &hs(0..4), t0);
        a.record(&mut idx, w, &hs(0..2), t0 + Duration::from_secs(5));
        assert_eq!(idx.find_matches(&hs(0..4))[0].1.blocks, 4);
        // First record expires; blocks 0..2 live on through the second.
        a.expire(&mut idx, t0 + Duration::from_secs(11));
        assert_eq!(idx.find_matches(&hs(0..4))[0].1.blocks, 2);
        a.expire(&mut idx, t0 + Duration::from_secs(16));
        assert!(idx.find_matches(&hs(0..4)).is_empty());
        // The cap evicts the oldest records.
        a.record(&mut idx, w, &hs(10..15), t0);
        a.record(&mut idx, w, &hs(20..25), t0);
        assert!(a.len() <= 8);
        assert!(idx.find_matches(&hs(10..15)).is_empty());
        assert_eq!(idx.find_matches(&hs(20..25))[0].1.blocks, 5);
        // An index replaced (a snapshot loaded) gets the live records back.
        let mut fresh = KvIndex::new();
        a.reapply(&mut fresh);
        assert!(fresh.find_matches(&hs(10..15)).is_empty());
        assert_eq!(fresh.find_matches(&hs(20..25))[0].1.blocks, 5);
        assert_eq!(fresh.blocks_of(w), idx.blocks_of(w));
    }
}
