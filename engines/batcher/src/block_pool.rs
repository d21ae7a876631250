//! Paged KV block pool with prefix caching and LRU eviction. It holds no
//! tensors: an engine keeps its KV data in slots indexed by [`BlockIdx`]
//! (the mocker keeps none beyond checking the blocks a peer writes).
//!
//! Invariants (checked by `check_invariants` in tests):
//! - every block is in exactly one of: referenced (`refs > 0`), evictable
//!   (`refs == 0`, hashed, in the LRU), or free (`refs == 0`, unhashed);
//! - `by_hash` maps each registered hash to exactly one block, whose `hash`
//!   field is that hash; a hash is never registered twice;
//! - eviction takes the least recently released evictable block; sequences
//!   release their blocks tail first, so prefixes outlive their tails;
//! - every registration emits `Stored`, every eviction `Removed`, with
//!   strictly increasing event ids shared with the offload tiers' events
//!   ([`BlockPool::emit_tier`]);
//! - no event names more than [`MAX_EVENT_BLOCKS`] blocks (a longer one is
//!   split into consecutive events, a store chained to its predecessor),
//!   so every event fits in a bus message whatever the pool's size;
//! - with eviction recording on, every evicted hashed block is listed once
//!   in [`BlockPool::take_evicted`] before anything can write into it, so
//!   an engine can copy its KV to an offload tier first.

use dynamo_bus_schema::blocks::SequenceHash;
use dynamo_engine::{KvCacheEvent, KvCacheEventData, KvTier};
use std::collections::{BTreeSet, HashMap};

/// Most blocks one KV event names (about 9 bytes each on the wire).
pub const MAX_EVENT_BLOCKS: usize = 4096;

/// Index of a block in the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockIdx(pub u32);

#[derive(Clone, Debug, Default)]
struct Block {
    hash: Option<SequenceHash>,
    parent: Option<SequenceHash>,
    refs: u32,
    /// LRU key while evictable.
    released_at: u64,
}

pub struct BlockPool {
    blocks: Vec<Block>,
    free: Vec<BlockIdx>,
    evictable: BTreeSet<(u64, BlockIdx)>,
    by_hash: HashMap<SequenceHash, BlockIdx>,
    tick: u64,
    next_event_id: u64,
    /// Recorded since the last drain; ids are assigned when drained.
    events: Vec<(KvTier, KvCacheEventData)>,
    record_events: bool,
    /// Evicted blocks not yet taken: (block, its hash, its parent's).
    evicted: Option<Vec<Evicted>>,
}

/// A cached block that was evicted to make room: its KV is still in `idx`
/// until the engine writes there.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Evicted {
    pub idx: BlockIdx,
    pub hash: SequenceHash,
    pub parent: Option<SequenceHash>,
}

impl BlockPool {
    pub fn new(num_blocks: u32, record_events: bool) -> Self {
        BlockPool {
            blocks: vec![Block::default(); num_blocks as usize],
            free: (0..num_blocks).rev().map(BlockIdx).collect(),
            evictable: BTreeSet::new(),
            by_hash: HashMap::new(),
            tick: 0,
            next_event_id: 1,
            events: Vec::new(),
            record_events,
            evicted: None,
        }
    }

    /// Starts listing evicted blocks (for offloading).
    pub fn record_evictions(&mut self) {
        self.evicted.get_or_insert_with(Vec::new);
    }

    /// The blocks evicted since the last call (their KV is still in place).
    pub fn take_evicted(&mut self) -> Vec<Evicted> {
        self.evicted
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    pub fn total(&self) -> u32 {
        self.blocks.len() as u32
    }

    /// Blocks that can be handed out now (free + evictable).
    pub fn available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks held by at least one sequence.
    pub fn used(&self) -> usize {
        self.blocks.len() - self.available()
    }

    /// How many leading `hashes` are cached.
    pub fn match_prefix(&self, hashes: &[SequenceHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.by_hash.contains_key(h))
            .count()
    }

    /// Of the first `n` hashes (all cached), how many are evictable right now
    /// (acquiring them reduces [`Self::available`]).
    pub fn evictable_among(&self, hashes: &[SequenceHash]) -> usize {
        hashes
            .iter()
            .filter(|h| {
                self.by_hash
                    .get(h)
                    .is_some_and(|b| self.blocks[b.0 as usize].refs == 0)
            })
            .count()
    }

    /// The cached block holding `hash`, if any (no reference is taken).
    pub fn lookup(&self, hash: SequenceHash) -> Option<BlockIdx> {
        self.by_hash.get(&hash).copied()
    }

    /// Takes a reference on the cached block holding `hash`.
    pub fn acquire_cached(&mut self, hash: SequenceHash) -> Option<BlockIdx> {
        let idx = *self.by_hash.get(&hash)?;
        let b = &mut self.blocks[idx.0 as usize];
        if b.refs == 0 {
            self.evictable.remove(&(b.released_at, idx));
        }
        b.refs += 1;
        Some(idx)
    }

    /// Hands out an empty block, evicting the least recently used cached one if needed.
    pub fn allocate(&mut self) -> Option<BlockIdx> {
        let idx = match self.free.pop() {
            Some(idx) => idx,
            None => {
                let (t, idx) = self.evictable.pop_first()?;
                debug_assert_eq!(self.blocks[idx.0 as usize].released_at, t);
                let b = &mut self.blocks[idx.0 as usize];
                if let Some(hash) = b.hash.take() {
                    let parent = b.parent.take();
                    self.by_hash.remove(&hash);
                    self.emit(
                        KvTier::Device,
                        KvCacheEventData::Removed { blocks: vec![hash] },
                    );
                    if let Some(ev) = &mut self.evicted {
                        ev.push(Evicted { idx, hash, parent });
                    }
                }
                idx
            }
        };
        self.blocks[idx.0 as usize].refs = 1;
        Some(idx)
    }

    /// Records that `idx` now holds the full block `hash` (child of `parent`).
    /// Returns false if another block already holds that hash (the block then
    /// stays private to its sequence and is never shared).
    pub fn register(
        &mut self,
        idx: BlockIdx,
        hash: SequenceHash,
        parent: Option<SequenceHash>,
    ) -> bool {
        if self.by_hash.contains_key(&hash) || self.blocks[idx.0 as usize].hash.is_some() {
            return false;
        }
        self.blocks[idx.0 as usize].hash = Some(hash);
        self.blocks[idx.0 as usize].parent = parent;
        self.by_hash.insert(hash, idx);
        self.emit(
            KvTier::Device,
            KvCacheEventData::Stored {
                parent,
                blocks: vec![hash],
            },
        );
        true
    }

    /// Drops one reference; an unreferenced hashed block stays cached (evictable).
    pub fn release(&mut self, idx: BlockIdx) {
        let b = &mut self.blocks[idx.0 as usize];
        debug_assert!(b.refs > 0, "release of an unreferenced block");
        b.refs = b.refs.saturating_sub(1);
        if b.refs == 0 {
            if b.hash.is_some() {
                self.tick += 1;
                b.released_at = self.tick;
                self.evictable.insert((self.tick, idx));
            } else {
                self.free.push(idx);
            }
        }
    }

    /// Empties the cache of every unreferenced block and emits `Cleared`
    /// (referenced blocks keep working but are no longer shareable).
    pub fn clear_cache(&mut self) {
        for (_, idx) in std::mem::take(&mut self.evictable) {
            self.blocks[idx.0 as usize].hash = None;
            self.free.push(idx);
        }
        for b in &mut self.blocks {
            b.hash = None;
            b.parent = None;
        }
        self.by_hash.clear();
        self.emit(KvTier::Device, KvCacheEventData::Cleared);
    }

    /// Records an event, merging it into the previous one when it extends
    /// it: a store that continues the previous store's chain, or another
    /// removal. Order between different kinds is kept.
    fn emit(&mut self, tier: KvTier, data: KvCacheEventData) {
        if !self.record_events {
            return;
        }
        match (self.events.last_mut(), data) {
            (
                Some((t, KvCacheEventData::Stored { blocks, .. })),
                KvCacheEventData::Stored {
                    parent: Some(p),
                    blocks: more,
                },
            ) if *t == tier
                && blocks.last() == Some(&p)
                && blocks.len() + more.len() <= MAX_EVENT_BLOCKS =>
            {
                blocks.extend(more)
            }
            (
                Some((t, KvCacheEventData::Removed { blocks })),
                KvCacheEventData::Removed { blocks: more },
            ) if *t == tier && blocks.len() + more.len() <= MAX_EVENT_BLOCKS => blocks.extend(more),
            (_, data) => self.events.push((tier, data)),
        }
    }

    /// Records an event of an offload tier in this pool's event sequence
    /// (one id sequence per engine, whatever the tier).
    pub fn emit_tier(&mut self, tier: KvTier, data: KvCacheEventData) {
        self.emit(tier, data);
    }

    /// Every cached block hash, and the id of the last event emitted.
    pub fn snapshot(&self) -> (u64, Vec<SequenceHash>) {
        (
            self.next_event_id - 1,
            self.by_hash.keys().copied().collect(),
        )
    }

    /// Takes the events recorded since the last call, numbered
    /// consecutively, none naming more than [`MAX_EVENT_BLOCKS`] blocks.
    pub fn drain_events(&mut self) -> Vec<KvCacheEvent> {
        let mut out = Vec::with_capacity(self.events.len());
        for (tier, data) in std::mem::take(&mut self.events) {
            for data in split_event(data) {
                out.push(KvCacheEvent {
                    event_id: self.next_event_id,
                    tier,
                    data,
                });
                self.next_event_id += 1;
            }
        }
        out
    }

    #[cfg(test)]
    pub fn check_invariants(&self) {
        let mut referenced = 0;
        for (i, b) in self.blocks.iter().enumerate() {
            let idx = BlockIdx(i as u32);
            let in_free = self.free.contains(&idx);
            let in_lru = self.evictable.contains(&(b.released_at, idx));
            match (b.refs > 0, b.hash.is_some()) {
                (true, _) => {
                    referenced += 1;
                    assert!(!in_free && !in_lru, "referenced block {i} is free");
                }
                (false, true) => assert!(in_lru && !in_free, "cached block {i} not evictable"),
                (false, false) => assert!(in_free && !in_lru, "empty block {i} not free"),
            }
            if let Some(h) = b.hash {
                assert_eq!(self.by_hash.get(&h), Some(&idx));
            }
        }
        assert_eq!(
            self.by_hash.len(),
            self.blocks.iter().filter(|b| b.hash.is_some()).count()
        );
        assert_eq!(referenced + self.available(), self.blocks.len());
    }
}

/// Splits an event that names more than [`MAX_EVENT_BLOCKS`] blocks into
/// consecutive ones (each store chained to the last block of the one before).
fn split_event(data: KvCacheEventData) -> Vec<KvCacheEventData> {
    match data {
        KvCacheEventData::Stored { parent, blocks } if blocks.len() > MAX_EVENT_BLOCKS => {
            let mut parent = parent;
            blocks
                .chunks(MAX_EVENT_BLOCKS)
                .map(|c| {
                    let e = KvCacheEventData::Stored {
                        parent,
                        blocks: c.to_vec(),
                    };
                    parent = c.last().copied();
                    e
                })
                .collect()
        }
        KvCacheEventData::Removed { blocks } if blocks.len() > MAX_EVENT_BLOCKS => blocks
            .chunks(MAX_EVENT_BLOCKS)
            .map(|c| KvCacheEventData::Removed { blocks: c.to_vec() })
            .collect(),
        other => vec![other],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn long_events_are_split_into_chained_events_of_bounded_size() {
        let n = MAX_EVENT_BLOCKS * 2 + 5;
        let mut p = BlockPool::new(1, true);
        let hashes: Vec<SequenceHash> = (0..n as u64).map(SequenceHash).collect();
        p.emit(
            KvTier::Host,
            KvCacheEventData::Stored {
                parent: Some(SequenceHash(u64::MAX)),
                blocks: hashes.clone(),
            },
        );
        p.emit(
            KvTier::Host,
            KvCacheEventData::Removed {
                blocks: hashes.clone(),
            },
        );
        let ev = p.drain_events();
        assert_eq!(ev.len(), 6);
        let ids: Vec<u64> = ev.iter().map(|e| e.event_id).collect();
        assert_eq!(ids, vec![1, 2, 3, 4, 5, 6]);
        let mut stored: Vec<SequenceHash> = Vec::new();
        let mut parent = Some(SequenceHash(u64::MAX));
        for e in &ev[..3] {
            let KvCacheEventData::Stored { parent: p, blocks } = &e.data else {
                panic!("{e:?}")
            };
            assert!(blocks.len() <= MAX_EVENT_BLOCKS);
            assert_eq!(*p, parent, "each piece continues the chain");
            parent = blocks.last().copied();
            stored.extend(blocks.iter().copied());
        }
        assert_eq!(stored, hashes);
        for e in &ev[3..] {
            assert!(
                matches!(&e.data, KvCacheEventData::Removed { blocks } if blocks.len() <= MAX_EVENT_BLOCKS)
            );
        }
    }

    #[test]
    fn lru_evicts_tails_first_and_emits_events() {
        let mut p = BlockPool::new(3, true);
        let a = p.allocate().unwrap();
        let b = p.allocate().unwrap();
        assert!(p.register(a, SequenceHash(1), None));
        assert!(p.register(b, SequenceHash(2), Some(SequenceHash(1))));
        // Tail first.
        p.release(b);
        p.release(a);
        assert_eq!(p.match_prefix(&[SequenceHash(1), SequenceHash(2)]), 2);
        let _c = p.allocate().unwrap(); // the free one
        let _d = p.allocate().unwrap(); // evicts hash 2 (the tail)
        assert_eq!(p.match_prefix(&[SequenceHash(1), SequenceHash(2)]), 1);
        let ev = p.drain_events();
        // The two stores of one chain merge into one event.
        assert_eq!(ev.len(), 2);
        assert_eq!(
            ev[0].data,
            KvCacheEventData::Stored {
                parent: None,
                blocks: vec![SequenceHash(1), SequenceHash(2)]
            }
        );
        assert_eq!(
            ev[1].data,
            KvCacheEventData::Removed {
                blocks: vec![SequenceHash(2)]
            }
        );
        assert_eq!((ev[0].event_id, ev[1].event_id), (1, 2));
        assert_eq!(p.snapshot().0, 2);
        p.check_invariants();
    }

    #[derive(Clone, Debug)]
    enum Op {
        Alloc,
        Register(u8),
        Release(u8),
        Acquire(u8),
        Clear,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => Just(Op::Alloc),
            3 => any::<u8>().prop_map(Op::Register),
            4 => any::<u8>().prop_map(Op::Release),
            3 => any::<u8>().prop_map(Op::Acquire),
            1 => Just(Op::Clear),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, rng_seed: proptest::test_runner::RngSeed::Fixed(42), ..ProptestConfig::default() })]
        #[test]
        fn random_operations_keep_invariants(ops in proptest::collection::vec(op(), 1..200)) {
            let mut p = BlockPool::new(8, true);
            let mut held: Vec<BlockIdx> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc => if let Some(b) = p.allocate() { held.push(b) },
                    Op::Register(h) => if let Some(&b) = held.last() { p.register(b, SequenceHash(h as u64 % 16), None); },
                    Op::Release(i) => if !held.is_empty() { let b = held.swap_remove(i as usize % held.len()); p.release(b) },
                    Op::Acquire(h) => if let Some(b) = p.acquire_cached(SequenceHash(h as u64 % 16)) { held.push(b) },
                    Op::Clear => p.clear_cache(),
                }
                p.check_invariants();
                prop_assert_eq!(p.used(), { let mut s = held.clone(); s.sort(); s.dedup(); s.len() });
            }
            let ids: Vec<u64> = p.drain_events().iter().map(|e| e.event_id).collect();
            prop_assert!(ids.windows(2).all(|w| w[0] < w[1]));
        }
    }
}
