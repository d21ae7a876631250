//! Pool blocks reserved for a peer's one-sided writes (disaggregated
//! prefill writes a prompt's KV straight into the decode engine's pool).
//!
//! Invariants:
//! - a reserved block holds one reference owned by its reservation and no
//!   hash, so the scheduler never hands it out, evicts it or computes with
//!   it, and it counts as used in the load;
//! - blocks evicted to make room are offloaded (when tiers are on) before
//!   the reservation is returned, so a peer's write never destroys KV a
//!   tier was to keep;
//! - [`Scheduler::commit_reserved`] registers the written prefix in order
//!   (a `Stored` event, exactly like [`Scheduler::import_block`]) and frees
//!   the rest; a hash already cached elsewhere keeps the cached copy and
//!   frees the written block; every reservation is committed or released
//!   exactly once (unknown ids are refused or ignored).

use crate::block_pool::BlockIdx;
use crate::scheduler::{BlockData, Scheduler};
use dynamo_bus_schema::blocks::SequenceHash;
use dynamo_engine::{EngineError, Reservation, ReservationId};

impl Scheduler {
    /// Reserves `n` blocks for a peer to write (see the module invariants).
    pub fn reserve(
        &mut self,
        n: usize,
        kv: &mut dyn BlockData,
    ) -> Result<Reservation, EngineError> {
        if n == 0 {
            return Err(EngineError::Internal("reservation of no blocks".into()));
        }
        if n > self.pool().available() {
            return Err(EngineError::Overloaded(format!(
                "{n} KV blocks asked for a transfer, {} can be spared",
                self.pool().available()
            )));
        }
        let mut blocks = Vec::with_capacity(n);
        for _ in 0..n {
            match self.pool_mut().allocate() {
                Some(b) => blocks.push(b),
                None => break,
            }
        }
        self.offload_evicted(kv);
        if blocks.len() < n {
            for b in blocks {
                self.pool_mut().release(b);
            }
            return Err(EngineError::Overloaded(format!(
                "{n} KV blocks asked for a transfer, the pool ran short"
            )));
        }
        let id = ReservationId(self.next_reservation);
        self.next_reservation += 1;
        let out = Reservation {
            id,
            blocks: blocks.iter().map(|b| b.0).collect(),
        };
        self.reserved.insert(id, blocks);
        Ok(out)
    }

    /// Blocks currently reserved, over all reservations.
    pub fn reserved_blocks(&self) -> usize {
        self.reserved.values().map(Vec::len).sum()
    }

    /// The blocks of a live reservation.
    pub fn reservation(&self, id: ReservationId) -> Option<&[BlockIdx]> {
        self.reserved.get(&id).map(Vec::as_slice)
    }

    /// Stores the written prefix of a reservation in the prefix cache and
    /// frees the rest; returns how many blocks were stored.
    pub fn commit_reserved(
        &mut self,
        id: ReservationId,
        parent: Option<SequenceHash>,
        hashes: &[SequenceHash],
    ) -> Result<usize, EngineError> {
        let blocks = self
            .reserved
            .remove(&id)
            .ok_or_else(|| EngineError::Internal(format!("no reservation {}", id.0)))?;
        if hashes.len() > blocks.len() {
            self.free(&blocks);
            return Err(EngineError::BadKvData(format!(
                "{} blocks named for a reservation of {}",
                hashes.len(),
                blocks.len()
            )));
        }
        let mut stored = 0;
        let mut prev = parent;
        for (&b, &h) in blocks.iter().zip(hashes) {
            if self.pool_mut().register(b, h, prev) {
                stored += 1;
            }
            prev = Some(h);
        }
        self.free(&blocks);
        Ok(stored)
    }

    /// Frees a reservation without storing anything.
    pub fn release_reserved(&mut self, id: ReservationId) -> bool {
        match self.reserved.remove(&id) {
            Some(blocks) => {
                self.free(&blocks);
                true
            }
            None => false,
        }
    }

    /// Tail first, like a finished sequence, so a prefix outlives its tail.
    fn free(&mut self, blocks: &[BlockIdx]) {
        for &b in blocks.iter().rev() {
            self.pool_mut().release(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::scheduler::{BlockData, Scheduler, SchedulerConfig};
    use crate::BlockIdx;
    use dynamo_bus_schema::blocks::sequence_hashes;
    use dynamo_bus_schema::{RequestId, SamplingParams};
    use dynamo_engine::{
        EngineError, EngineEvent, EngineLimits, KvCacheEventData, ReservationId, ValidRequest,
    };

    struct NoKv;
    impl BlockData for NoKv {
        fn read(&mut self, _: BlockIdx) -> Option<Vec<u8>> {
            Some(vec![0; 4])
        }
        fn write(&mut self, _: BlockIdx, b: &[u8]) -> bool {
            b.len() == 4
        }
    }

    fn sched(num_blocks: u32) -> Scheduler {
        Scheduler::new(
            SchedulerConfig {
                block_size: 4,
                num_blocks,
                max_num_seqs: 4,
                max_num_batched_tokens: 64,
                max_waiting: 64,
                enable_prefix_caching: true,
                record_kv_events: true,
            },
            7,
            vec![],
        )
    }

    #[test]
    fn reserved_blocks_are_withheld_then_committed_as_a_cached_prefix() {
        let mut s = sched(8);
        let prompt: Vec<u32> = (10..23).collect(); // 3 full blocks + 1
        let hashes = sequence_hashes(&prompt, 4, 7);
        let r = s.reserve(3, &mut NoKv).unwrap();
        assert_eq!(r.blocks.len(), 3);
        assert_eq!(s.pool().used(), 3);
        assert_eq!(s.reserved_blocks(), 3);
        // The pool cannot hand the reserved blocks to anyone else.
        assert!(matches!(
            s.reserve(6, &mut NoKv),
            Err(EngineError::Overloaded(_))
        ));
        // Only two of the three arrived: they are stored, the third is freed.
        assert_eq!(s.commit_reserved(r.id, None, &hashes[..2]), Ok(2));
        assert_eq!(s.reserved_blocks(), 0);
        assert_eq!(s.pool().used(), 0);
        assert_eq!(s.cached_block(hashes[0]), Some(BlockIdx(r.blocks[0])));
        assert_eq!(s.cached_block(hashes[1]), Some(BlockIdx(r.blocks[1])));
        let ev = s.drain_kv_events();
        assert_eq!(
            ev[0].data,
            KvCacheEventData::Stored {
                parent: None,
                blocks: vec![hashes[0], hashes[1]]
            }
        );
        // A request for the prompt is served from them.
        let req = ValidRequest::from_parts(
            RequestId(1),
            prompt,
            &SamplingParams::greedy(1),
            EngineLimits {
                context_length: 100,
                vocab_size: 100,
            },
        )
        .unwrap();
        s.add(req).unwrap();
        let plan = s.schedule();
        assert!(matches!(
            plan.events[0].1,
            EngineEvent::Started { cached_tokens: 8 }
        ));
        s.pool().check_invariants();
    }

    #[test]
    fn released_and_unknown_reservations_free_everything_once() {
        let mut s = sched(4);
        let hashes = sequence_hashes(&(0..16).collect::<Vec<u32>>(), 4, 7);
        let a = s.reserve(2, &mut NoKv).unwrap();
        let b = s.reserve(2, &mut NoKv).unwrap();
        assert!(s.reserve(1, &mut NoKv).is_err());
        assert!(s.release_reserved(a.id));
        assert!(!s.release_reserved(a.id));
        assert!(s.commit_reserved(a.id, None, &hashes[..1]).is_err());
        // More hashes than blocks: refused, and the blocks are freed.
        assert!(matches!(
            s.commit_reserved(b.id, None, &hashes[..3]),
            Err(EngineError::BadKvData(_))
        ));
        assert_eq!(s.pool().used(), 0);
        assert!(s.reservation(ReservationId(99)).is_none());
        assert!(s.reserve(0, &mut NoKv).is_err());
        s.pool().check_invariants();
    }

    #[test]
    fn a_hash_cached_meanwhile_keeps_its_copy_and_the_written_block_is_freed() {
        let mut s = sched(6);
        let hashes = sequence_hashes(&(0..8).collect::<Vec<u32>>(), 4, 7);
        let cached = s.import_block(hashes[0], None).unwrap();
        let r = s.reserve(2, &mut NoKv).unwrap();
        assert_eq!(s.commit_reserved(r.id, None, &hashes), Ok(1));
        assert_eq!(s.cached_block(hashes[0]), Some(cached));
        assert_eq!(s.cached_block(hashes[1]), Some(BlockIdx(r.blocks[1])));
        assert_eq!(s.pool().available(), 6);
        s.pool().check_invariants();
    }

    #[derive(Clone, Debug)]
    enum Op {
        Reserve(u8),
        Commit(u8, u8),
        Release(u8),
        Import(u8),
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            3 => (1u8..5).prop_map(Op::Reserve),
            2 => (any::<u8>(), 0u8..5).prop_map(|(i, k)| Op::Commit(i, k)),
            1 => any::<u8>().prop_map(Op::Release),
            2 => any::<u8>().prop_map(Op::Import),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config { cases: 300, rng_seed: proptest::test_runner::RngSeed::Fixed(7), ..Default::default() })]
        #[test]
        fn random_reservations_never_share_or_leak_blocks(ops in proptest::collection::vec(op(), 1..120)) {
            let mut s = sched(12);
            let chain = sequence_hashes(&(0..96).collect::<Vec<u32>>(), 4, 7);
            let mut live: Vec<dynamo_engine::Reservation> = Vec::new();
            let mut next_hash = 0usize;
            for op in ops {
                match op {
                    Op::Reserve(n) => {
                        if let Ok(r) = s.reserve(n as usize, &mut NoKv) {
                            live.push(r);
                        }
                    }
                    Op::Commit(i, k) => {
                        if !live.is_empty() {
                            let r = live.swap_remove(i as usize % live.len());
                            let k = (k as usize).min(r.blocks.len());
                            let from = next_hash % (chain.len() - k);
                            let hashes = &chain[from..from + k];
                            let parent = from.checked_sub(1).map(|i| chain[i]);
                            let stored = s.commit_reserved(r.id, parent, hashes).unwrap();
                            proptest::prop_assert!(stored <= k);
                            // Every committed hash is cached, in this block or an earlier one.
                            for h in hashes {
                                proptest::prop_assert!(s.cached_block(*h).is_some());
                            }
                            next_hash += k;
                        }
                    }
                    Op::Release(i) => {
                        if !live.is_empty() {
                            let r = live.swap_remove(i as usize % live.len());
                            proptest::prop_assert!(s.release_reserved(r.id));
                        }
                    }
                    Op::Import(h) => {
                        s.import_block(chain[h as usize % chain.len()], None);
                    }
                }
                s.pool().check_invariants();
                // Reserved blocks are exactly the used ones, each held once,
                // and no cached hash maps to one of them.
                let mut held: Vec<u32> = live.iter().flat_map(|r| r.blocks.clone()).collect();
                let n = held.len();
                held.sort();
                held.dedup();
                proptest::prop_assert_eq!(held.len(), n);
                proptest::prop_assert_eq!(s.pool().used(), n);
                proptest::prop_assert_eq!(s.reserved_blocks(), n);
                for h in &chain {
                    if let Some(b) = s.cached_block(*h) {
                        proptest::prop_assert!(!held.contains(&b.0));
                    }
                }
            }
        }
    }
}
