//! Continuous batching over a [`BlockPool`]: admission with prefix-cache
//! matching, chunked prefill, preemption, stop conditions and completion.
//! No tensors and no clocks: an engine calls [`Scheduler::schedule`], runs
//! its forward pass over the planned tokens (writing their KV into the
//! planned blocks), samples one token for every item that asks for one and
//! hands the tokens back to [`Scheduler::commit`].
//!
//! Invariants:
//! - at most `max_num_seqs` sequences run and at most
//!   `max_num_batched_tokens` tokens are planned per step;
//! - running sequences are planned before waiting ones (decode is never
//!   starved by new prefills); a waiting sequence is admitted only when its
//!   first chunk's blocks are available;
//! - when blocks run out, the most recently admitted running sequence is
//!   preempted (blocks released, progress reset, back to the queue's front);
//! - a sequence's blocks are released exactly once, tail first, when it
//!   finishes, is cancelled or is preempted;
//! - a block is registered under its hash (and so shared and announced in a
//!   KV event) only in `commit`, after the engine has written its KV;
//! - at least one prompt token is always computed, so the step that
//!   finishes a prompt yields logits to sample from.

use crate::block_pool::{BlockIdx, BlockPool};
use crate::offload::{OffloadStats, TierStore};
use dynamo_bus_schema::blocks::{chain, local_block_hash, sequence_hashes, SequenceHash};
use dynamo_bus_schema::{FinishReason, LoadMetrics, RequestId};
use dynamo_engine::{
    EngineError, EngineEvent, KvBlockData, KvCacheEvent, KvSnapshot, KvTier, ReservationId,
    ValidRequest, ValidSampling,
};

/// An engine's KV storage as the offload tiers see it: whole blocks as bytes.
pub trait BlockData {
    /// The KV in block `idx` (`None` if it cannot be read).
    fn read(&mut self, idx: BlockIdx) -> Option<Vec<u8>>;
    /// Overwrites block `idx`; false if the bytes do not fit.
    fn write(&mut self, idx: BlockIdx, bytes: &[u8]) -> bool;
}
use std::collections::{HashMap, VecDeque};

/// The scheduler's limits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SchedulerConfig {
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV blocks in the pool.
    pub num_blocks: u32,
    /// Most sequences running at once.
    pub max_num_seqs: u32,
    /// Most tokens (prefill chunks + decodes) in one step.
    pub max_num_batched_tokens: u32,
    /// Most sequences waiting beyond the `max_num_seqs` running: past
    /// `max_num_seqs + max_waiting` held, [`Scheduler::add`] refuses with
    /// `Overloaded` (the router then sends work elsewhere).
    pub max_waiting: u32,
    /// Reuse cached blocks across requests by block hash.
    pub enable_prefix_caching: bool,
    /// Record KV events for routers.
    pub record_kv_events: bool,
}

impl SchedulerConfig {
    /// Requests an engine with this config holds at once: running plus
    /// waiting (what its [`dynamo_engine::Admission`] admits).
    pub fn capacity(&self) -> usize {
        self.max_num_seqs as usize + self.max_waiting as usize
    }
}

/// One sequence as the engine sees it.
#[derive(Debug)]
pub struct Seq {
    /// Prompt followed by every generated token.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub sampling: ValidSampling,
    /// Tokens generated so far.
    pub generated: u32,
    /// Tokens whose KV is computed.
    pub computed: usize,
    /// The block table: block `i` holds positions `i*bs .. (i+1)*bs`.
    pub blocks: Vec<BlockIdx>,
    /// Sequence hashes of the full blocks registered so far.
    hashes: Vec<SequenceHash>,
    stop_ids: Vec<u32>,
    started: bool,
}

/// Part of one sequence planned for a step: positions `start .. start + len`
/// of `tokens` are computed; `sample` means the last of them is the
/// sequence's last token, so the engine must sample the next one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Planned {
    pub id: RequestId,
    pub start: usize,
    pub len: usize,
    pub sample: bool,
}

/// What one step computes, plus the events decided while planning
/// (`Started`, with the prompt tokens found in the prefix cache).
#[derive(Debug, Default)]
pub struct Plan {
    pub items: Vec<Planned>,
    pub events: Vec<(RequestId, EngineEvent)>,
}

impl Plan {
    pub fn tokens(&self) -> usize {
        self.items.iter().map(|p| p.len).sum()
    }
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    salt: u64,
    eos_ids: Vec<u32>,
    pool: BlockPool,
    seqs: HashMap<RequestId, Seq>,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
    tiers: Option<TierStore>,
    /// Blocks reserved for peers' writes (see [`crate::reserve`]).
    pub(crate) reserved: HashMap<ReservationId, Vec<BlockIdx>>,
    pub(crate) next_reservation: u64,
}

impl Scheduler {
    /// `salt` is the model's block-hash salt; `eos_ids` stop every request
    /// that does not ask to ignore EOS.
    pub fn new(cfg: SchedulerConfig, salt: u64, eos_ids: Vec<u32>) -> Self {
        Scheduler {
            pool: BlockPool::new(cfg.num_blocks, cfg.record_kv_events),
            cfg,
            salt,
            eos_ids,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            tiers: None,
            reserved: HashMap::new(),
            next_reservation: 1,
        }
    }

    /// Adds offload tiers: from now on evicted blocks are listed for
    /// [`Self::offload_evicted`].
    pub fn with_offload(mut self, tiers: TierStore) -> Self {
        self.pool.record_evictions();
        self.tiers = Some(tiers);
        self
    }

    pub fn offload_stats(&self) -> Option<OffloadStats> {
        self.tiers.as_ref().map(|t| t.stats())
    }

    /// Moves the blocks evicted since the last call to the host tier,
    /// reading their KV from `kv`. Call it after every [`Self::schedule`]
    /// or [`Self::import_block`], before the engine writes into the blocks
    /// they handed out.
    pub fn offload_evicted(&mut self, kv: &mut dyn BlockData) {
        let Some(tiers) = self.tiers.as_mut() else {
            return;
        };
        for e in self.pool.take_evicted() {
            if let Some(bytes) = kv.read(e.idx) {
                let block = KvBlockData {
                    hash: e.hash,
                    parent: e.parent,
                    bytes,
                };
                tiers.offload(block, &mut self.pool);
            }
        }
    }

    /// Brings back from the offload tiers the blocks of `prompt` that follow
    /// its device-cached prefix, in order, until a block no tier holds; the
    /// prefix is pinned meanwhile so making room cannot evict it. Call it
    /// before adding the request, so admission finds the blocks cached
    /// instead of recomputing them. Returns how many came back, per tier.
    pub fn onboard(&mut self, prompt: &[u32], kv: &mut dyn BlockData) -> (usize, usize) {
        if self.tiers.is_none() {
            return (0, 0);
        }
        let hashes = sequence_hashes(prompt, self.cfg.block_size as usize, self.salt);
        let on_device = self.pool.match_prefix(&hashes);
        let mut pinned: Vec<BlockIdx> = hashes[..on_device]
            .iter()
            .filter_map(|h| self.pool.acquire_cached(*h))
            .collect();
        let (mut host, mut disk) = (0, 0);
        for &h in &hashes[on_device..] {
            let Some((block, tier)) = self.tiers.as_mut().and_then(|t| t.take(h, &mut self.pool))
            else {
                break;
            };
            let Some(idx) = self.pool.allocate() else {
                break;
            };
            self.offload_evicted(kv);
            if !kv.write(idx, &block.bytes) {
                self.pool.release(idx);
                break;
            }
            self.pool.register(idx, block.hash, block.parent);
            pinned.push(idx);
            match tier {
                KvTier::Disk => disk += 1,
                _ => host += 1,
            }
        }
        // Tail first, like a finished sequence, so the prefix outlives it.
        for idx in pinned.into_iter().rev() {
            self.pool.release(idx);
        }
        (host, disk)
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    pub fn is_idle(&self) -> bool {
        self.seqs.is_empty()
    }

    pub fn seq(&self, id: RequestId) -> Option<&Seq> {
        self.seqs.get(&id)
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub(crate) fn pool_mut(&mut self) -> &mut BlockPool {
        &mut self.pool
    }

    /// Queues a request.
    pub fn add(&mut self, req: ValidRequest) -> Result<(), EngineError> {
        if self.seqs.contains_key(&req.id()) {
            return Err(EngineError::Duplicate(req.id()));
        }
        // Running plus waiting: what the engine's admission also counts
        // (a request just added waits until the next step admits it).
        if self.seqs.len() >= self.cfg.capacity() {
            return Err(EngineError::Overloaded(format!(
                "{} requests are running or waiting, the engine's limit",
                self.seqs.len()
            )));
        }
        let bs = self.cfg.block_size as usize;
        let needed = (req.prompt().len() + req.sampling().max_tokens as usize).div_ceil(bs);
        if needed > self.pool.total() as usize {
            return Err(EngineError::TooLarge {
                needed,
                capacity: self.pool.total() as usize,
            });
        }
        let s = req.sampling().clone();
        let mut stop_ids = s.stop_token_ids.clone();
        if !s.ignore_eos {
            stop_ids.extend_from_slice(&self.eos_ids);
        }
        self.seqs.insert(
            req.id(),
            Seq {
                tokens: req.prompt().to_vec(),
                prompt_len: req.prompt().len(),
                sampling: s,
                generated: 0,
                computed: 0,
                blocks: Vec::new(),
                hashes: Vec::new(),
                stop_ids,
                started: false,
            },
        );
        self.waiting.push_back(req.id());
        Ok(())
    }

    /// Removes a request and frees its blocks; returns true if it was known.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        if !self.seqs.contains_key(&id) {
            return false;
        }
        self.finish(id);
        true
    }

    /// Drops every request (engine shutting down) and returns their ids.
    pub fn abort_all(&mut self) -> Vec<RequestId> {
        let ids: Vec<RequestId> = self.seqs.keys().copied().collect();
        for id in &ids {
            self.finish(*id);
        }
        ids
    }

    pub fn load(&self) -> LoadMetrics {
        LoadMetrics {
            active_seqs: self.running.len() as u32,
            waiting_seqs: self.waiting.len() as u32,
            kv_used_blocks: self.pool.used() as u32,
            kv_total_blocks: self.pool.total(),
            inflight_requests: self.seqs.len() as u32,
        }
    }

    /// The block table, consistent with every event drained so far.
    pub fn kv_snapshot(&self) -> KvSnapshot {
        let (last_event_id, blocks) = self.pool.snapshot();
        let offloaded = match &self.tiers {
            Some(t) => [KvTier::Host, KvTier::Disk]
                .into_iter()
                .map(|tier| (tier, t.hashes(tier)))
                .collect(),
            None => Vec::new(),
        };
        KvSnapshot {
            last_event_id,
            blocks,
            offloaded,
        }
    }

    pub fn drain_kv_events(&mut self) -> Vec<KvCacheEvent> {
        self.pool.drain_events()
    }

    /// The cached block holding `hash` (to export its KV).
    pub fn cached_block(&self, hash: SequenceHash) -> Option<BlockIdx> {
        self.pool.lookup(hash)
    }

    /// Makes room for an imported block `hash` (child of `parent`): returns
    /// the block whose KV the engine must fill right away, or `None` when the
    /// hash is already cached or no block can be freed. The block is
    /// registered (a `Stored` event) and left evictable.
    pub fn import_block(
        &mut self,
        hash: SequenceHash,
        parent: Option<SequenceHash>,
    ) -> Option<BlockIdx> {
        if self.pool.lookup(hash).is_some() {
            return None;
        }
        let idx = self.pool.allocate()?;
        let registered = self.pool.register(idx, hash, parent);
        debug_assert!(registered);
        self.pool.release(idx);
        Some(idx)
    }

    fn release_blocks(pool: &mut BlockPool, seq: &mut Seq) {
        for b in seq.blocks.drain(..).rev() {
            pool.release(b);
        }
        seq.hashes.clear();
        seq.computed = 0;
    }

    fn finish(&mut self, id: RequestId) {
        if let Some(mut seq) = self.seqs.remove(&id) {
            Self::release_blocks(&mut self.pool, &mut seq);
        }
        self.running.retain(|r| *r != id);
        self.waiting.retain(|r| *r != id);
    }

    /// Makes sure `seq` has blocks for `upto` tokens. Returns false if the pool is short.
    fn grow(pool: &mut BlockPool, seq: &mut Seq, upto: usize, bs: usize) -> bool {
        while seq.blocks.len() * bs < upto {
            match pool.allocate() {
                Some(b) => seq.blocks.push(b),
                None => return false,
            }
        }
        true
    }

    fn preempt_last_running(&mut self, except: RequestId) -> bool {
        let Some(pos) = self.running.iter().rposition(|r| *r != except) else {
            return false;
        };
        let victim = self.running.remove(pos);
        if let Some(seq) = self.seqs.get_mut(&victim) {
            Self::release_blocks(&mut self.pool, seq);
        }
        self.waiting.push_front(victim);
        true
    }

    /// Plans the next step and reserves its blocks.
    pub fn schedule(&mut self) -> Plan {
        let bs = self.cfg.block_size as usize;
        let mut budget = self.cfg.max_num_batched_tokens as usize;
        let mut plan = Plan::default();
        let mut scheduled: Vec<(RequestId, usize)> = Vec::new();

        // 1. Running sequences: decodes and unfinished prefill chunks.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let Some(seq) = self.seqs.get_mut(&id) else {
                self.running.remove(i);
                continue;
            };
            let n = (seq.tokens.len() - seq.computed).min(budget);
            let upto = seq.computed + n;
            let mut ok = Self::grow(&mut self.pool, seq, upto, bs);
            while !ok {
                if !self.preempt_last_running(id) {
                    break;
                }
                let seq = self.seqs.get_mut(&id).expect("present");
                ok = Self::grow(&mut self.pool, seq, upto, bs);
            }
            if !ok {
                // Not even alone does it fit: preempt it too.
                let seq = self.seqs.get_mut(&id).expect("present");
                Self::release_blocks(&mut self.pool, seq);
                self.running.remove(i);
                self.waiting.push_front(id);
                continue;
            }
            scheduled.push((id, n));
            budget -= n;
            i += 1;
        }
        // A preemption inside the loop may have removed an already planned sequence.
        scheduled.retain(|(id, _)| self.running.contains(id));

        // 2. Admit waiting sequences.
        while budget > 0 && self.running.len() < self.cfg.max_num_seqs as usize {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let seq = self.seqs.get_mut(&id).expect("waiting seq exists");
            let mut matched = 0;
            if seq.blocks.is_empty() && self.cfg.enable_prefix_caching {
                let hashes = sequence_hashes(&seq.tokens, bs, self.salt);
                // Keep at least one token to compute, so the step produces logits.
                let max_match = (seq.tokens.len() - 1) / bs;
                matched = self
                    .pool
                    .match_prefix(&hashes[..max_match.min(hashes.len())]);
                let n_first = (seq.tokens.len() - matched * bs).min(budget);
                let new_blocks = (matched * bs + n_first).div_ceil(bs) - matched;
                let lost = self.pool.evictable_among(&hashes[..matched]);
                if self.pool.available() < lost + new_blocks {
                    break;
                }
                for h in &hashes[..matched] {
                    let b = self
                        .pool
                        .acquire_cached(*h)
                        .expect("matched block is cached");
                    seq.blocks.push(b);
                }
                seq.hashes = hashes[..matched].to_vec();
                seq.computed = matched * bs;
            }
            let n = (seq.tokens.len() - seq.computed).min(budget);
            let upto = seq.computed + n;
            if self.pool.available() < upto.div_ceil(bs).saturating_sub(seq.blocks.len()) {
                Self::release_blocks(&mut self.pool, seq);
                break;
            }
            let grown = Self::grow(&mut self.pool, seq, upto, bs);
            debug_assert!(grown);
            if !seq.started {
                seq.started = true;
                plan.events.push((
                    id,
                    EngineEvent::Started {
                        cached_tokens: (matched * bs) as u32,
                    },
                ));
            }
            self.waiting.pop_front();
            self.running.push(id);
            scheduled.push((id, n));
            budget -= n;
        }

        plan.items = scheduled
            .into_iter()
            .map(|(id, len)| {
                let seq = &self.seqs[&id];
                Planned {
                    id,
                    start: seq.computed,
                    len,
                    sample: seq.computed + len == seq.tokens.len(),
                }
            })
            .collect();
        plan
    }

    /// Applies a computed step: `sampled[i]` is the token sampled for
    /// `plan.items[i]` (`None` where the item does not sample). Registers the
    /// blocks that became full, appends tokens and finishes sequences that
    /// hit a stop token or `max_tokens`. Returns the step's events in order.
    pub fn commit(&mut self, plan: Plan, sampled: &[Option<u32>]) -> Vec<(RequestId, EngineEvent)> {
        let bs = self.cfg.block_size as usize;
        let mut events = plan.events;
        let mut finished = Vec::new();
        for (k, item) in plan.items.iter().enumerate() {
            let Some(seq) = self.seqs.get_mut(&item.id) else {
                continue;
            };
            seq.computed = item.start + item.len;
            let full = seq.computed / bs;
            while seq.hashes.len() < full {
                let k = seq.hashes.len();
                let parent = seq.hashes.last().copied();
                let h = chain(
                    parent,
                    local_block_hash(&seq.tokens[k * bs..(k + 1) * bs], self.salt),
                    self.salt,
                );
                if self.cfg.enable_prefix_caching {
                    self.pool.register(seq.blocks[k], h, parent);
                }
                seq.hashes.push(h);
            }
            if !item.sample {
                continue;
            }
            let Some(t) = sampled.get(k).copied().flatten() else {
                debug_assert!(false, "sampling item without a token");
                continue;
            };
            seq.tokens.push(t);
            seq.generated += 1;
            events.push((item.id, EngineEvent::Tokens(vec![t])));
            let reason = if seq.stop_ids.contains(&t) {
                Some(FinishReason::Stop)
            } else if seq.generated >= seq.sampling.max_tokens {
                Some(FinishReason::Length)
            } else {
                None
            };
            if let Some(reason) = reason {
                events.push((item.id, EngineEvent::Finished { reason }));
                finished.push(item.id);
            }
        }
        for id in finished {
            self.finish(id);
        }
        events
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dynamo_bus_schema::SamplingParams;
    use dynamo_engine::{EngineLimits, KvCacheEventData};

    const LIMITS: EngineLimits = EngineLimits {
        context_length: 10_000,
        vocab_size: 1000,
    };

    fn cfg() -> SchedulerConfig {
        SchedulerConfig {
            block_size: 4,
            num_blocks: 16,
            max_num_seqs: 4,
            max_num_batched_tokens: 64,
            max_waiting: 8,
            enable_prefix_caching: true,
            record_kv_events: true,
        }
    }

    #[test]
    fn a_full_waiting_queue_refuses_with_overloaded() {
        let mut s = Scheduler::new(cfg(), 7, vec![2]);
        // Four may run and eight wait: twelve are held at once.
        for i in 0..12 {
            s.add(req(i, vec![10, 11], 1)).unwrap();
        }
        assert!(matches!(
            s.add(req(99, vec![10], 1)),
            Err(EngineError::Overloaded(_))
        ));
        // Finishing some makes room again.
        let plan = s.schedule();
        let sampled = vec![Some(2); plan.items.len()];
        s.commit(plan, &sampled);
        s.add(req(99, vec![10], 1)).unwrap();
    }

    fn req(id: u128, prompt: Vec<u32>, max_tokens: u32) -> ValidRequest {
        ValidRequest::from_parts(
            RequestId(id),
            prompt,
            &SamplingParams::greedy(max_tokens),
            LIMITS,
        )
        .unwrap()
    }

    #[test]
    fn plans_prompt_then_decodes_and_samples_only_at_the_end() {
        let mut s = Scheduler::new(cfg(), 7, vec![2]);
        s.add(req(1, (10..20).collect(), 2)).unwrap();
        let plan = s.schedule();
        assert_eq!(
            plan.items,
            vec![Planned {
                id: RequestId(1),
                start: 0,
                len: 10,
                sample: true
            }]
        );
        assert!(matches!(
            plan.events[0].1,
            EngineEvent::Started { cached_tokens: 0 }
        ));
        let ev = s.commit(plan, &[Some(5)]);
        assert_eq!(ev.last().unwrap().1, EngineEvent::Tokens(vec![5]));
        let plan = s.schedule();
        assert_eq!((plan.items[0].start, plan.items[0].len), (10, 1));
        let ev = s.commit(plan, &[Some(2)]);
        assert!(matches!(
            ev.last().unwrap().1,
            EngineEvent::Finished {
                reason: FinishReason::Stop
            }
        ));
        assert!(s.is_idle());
        assert_eq!(s.pool().used(), 0);
    }

    #[test]
    fn imported_blocks_are_announced_and_hit_by_later_requests() {
        let mut s = Scheduler::new(cfg(), 7, vec![2]);
        let prompt: Vec<u32> = (10..19).collect(); // 2 full blocks + 1
        let hashes = sequence_hashes(&prompt, 4, 7);
        let a = s.import_block(hashes[0], None).unwrap();
        let b = s.import_block(hashes[1], Some(hashes[0])).unwrap();
        assert_ne!(a, b);
        assert_eq!(s.import_block(hashes[1], Some(hashes[0])), None);
        assert_eq!(s.cached_block(hashes[1]), Some(b));
        let ev = s.drain_kv_events();
        assert_eq!(
            ev[0].data,
            KvCacheEventData::Stored {
                parent: None,
                blocks: vec![hashes[0], hashes[1]]
            }
        );
        s.add(req(1, prompt, 1)).unwrap();
        let plan = s.schedule();
        assert!(matches!(
            plan.events[0].1,
            EngineEvent::Started { cached_tokens: 8 }
        ));
        assert_eq!((plan.items[0].start, plan.items[0].len), (8, 1));
        assert_eq!(s.seq(RequestId(1)).unwrap().blocks[..2], [a, b]);
    }
}
