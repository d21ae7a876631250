//! The simulated engine's synchronous core: the shared [`Scheduler`] plans
//! each step, the timing model prices it and [`next_token`] stands in for
//! the forward pass. No I/O and no clocks: the async driver in `engine.rs`
//! owns time.

use crate::config::MockerConfig;
use crate::tokens::next_token;
use dynamo_batcher::{BlockData, BlockIdx, Scheduler, SchedulerConfig, TierStore};
use dynamo_bus_schema::blocks::SequenceHash;
use dynamo_bus_schema::{LoadMetrics, RequestId};
use dynamo_engine::{
    ArenaError, EngineError, EngineEvent, KvArena, KvBlockData, KvCacheEvent, Reservation,
    ReservationId, ValidRequest,
};
use std::sync::Arc;

/// What one step produced.
#[derive(Debug, Default)]
pub struct StepOutput {
    /// Events per request, in order.
    pub events: Vec<(RequestId, EngineEvent)>,
    /// Simulated duration of the step in ms (before speedup).
    pub simulated_ms: f64,
    /// Tokens scheduled this step (0 = nothing to do).
    pub scheduled_tokens: usize,
}

/// The mocker's "KV data": it computes none, so an offloaded block is a
/// buffer of `kv_bytes_per_block` zeros (memory and disk are used for
/// real) and bringing one back writes nowhere.
struct SimulatedKv(usize);

impl BlockData for SimulatedKv {
    fn read(&mut self, _idx: BlockIdx) -> Option<Vec<u8>> {
        Some(vec![0; self.0])
    }
    fn write(&mut self, _idx: BlockIdx, bytes: &[u8]) -> bool {
        bytes.len() == self.0
    }
}

pub struct MockerCore {
    cfg: MockerConfig,
    /// The pool's memory, written only by peers (disaggregated prefill):
    /// a block is checked when its reservation is committed and then given
    /// back to the system, so resident memory is bounded by the blocks in
    /// flight, not by the pool.
    arena: Arc<KvArena>,
    token_lo: u32,
    token_hi: u32,
    sched: Scheduler,
}

impl MockerCore {
    pub fn new(
        cfg: MockerConfig,
        salt: u64,
        token_range: (u32, u32),
        eos_ids: Vec<u32>,
        record_kv_events: bool,
    ) -> Result<Self, ArenaError> {
        let arena = Arc::new(KvArena::new(
            cfg.num_blocks as usize,
            cfg.kv_bytes_per_block as usize,
        )?);
        let sc = SchedulerConfig {
            record_kv_events,
            ..cfg.scheduler()
        };
        let mut sched = Scheduler::new(sc, salt, eos_ids);
        let offload = cfg.offload();
        if offload.enabled() {
            match TierStore::new(offload) {
                Ok(t) => sched = sched.with_offload(t),
                // Checked by `MockerConfig::validate`; only the disk can fail here.
                Err(e) => tracing::error!(error = %e, "mocker offload tiers disabled"),
            }
        }
        Ok(MockerCore {
            cfg,
            arena,
            token_lo: token_range.0,
            token_hi: token_range.1,
            sched,
        })
    }

    pub fn arena(&self) -> Arc<KvArena> {
        self.arena.clone()
    }

    /// Reserves pool blocks for a peer's writes.
    pub fn reserve(&mut self, n: usize) -> Result<Reservation, EngineError> {
        let mut kv = SimulatedKv(self.cfg.kv_bytes_per_block as usize);
        self.sched.reserve(n, &mut kv)
    }

    /// Stores the written prefix of a reservation after checking that each
    /// block carries its hash (as [`Self::export_blocks`] makes them): a
    /// torn or misplaced write is refused and nothing is stored.
    pub fn commit(
        &mut self,
        id: ReservationId,
        parent: Option<SequenceHash>,
        hashes: &[SequenceHash],
    ) -> Result<usize, EngineError> {
        let blocks = self
            .sched
            .reservation(id)
            .ok_or_else(|| EngineError::Internal(format!("no reservation {}", id.0)))?
            .to_vec();
        let torn = blocks
            .iter()
            .zip(hashes)
            .find(|(b, h)| self.head(**b) != Some(h.0.to_le_bytes()));
        let result = match torn {
            Some((_, h)) => {
                self.sched.release_reserved(id);
                Err(EngineError::BadKvData(format!(
                    "block {:016x} landed torn or misplaced (it does not carry its hash)",
                    h.0
                )))
            }
            None => self.sched.commit_reserved(id, parent, hashes),
        };
        self.discard(&blocks);
        result
    }

    /// Frees a reservation.
    pub fn release(&mut self, id: ReservationId) {
        if let Some(blocks) = self.sched.reservation(id).map(<[BlockIdx]>::to_vec) {
            self.sched.release_reserved(id);
            self.discard(&blocks);
        }
    }

    /// The first 8 bytes of a block a peer wrote.
    fn head(&self, b: BlockIdx) -> Option<[u8; 8]> {
        let r = self.arena.block_range(b.0 as usize)?;
        let mut head = [0u8; 8];
        // SAFETY: the block is reserved and its writer is done (the commit
        // contract); 8 bytes inside it (kv_bytes_per_block >= 8).
        unsafe {
            std::ptr::copy_nonoverlapping(self.arena.as_ptr().add(r.start), head.as_mut_ptr(), 8)
        };
        Some(head)
    }

    /// Gives the pages of blocks no reservation holds any more back.
    fn discard(&self, blocks: &[BlockIdx]) {
        for b in blocks {
            // SAFETY: the reservation is gone and its writer is done; the
            // mocker never reads a block's bytes except at commit.
            unsafe { self.arena.discard_block(b.0 as usize) };
        }
    }

    /// Offload tier counters, when tiers are configured.
    pub fn offload_stats(&self) -> Option<dynamo_batcher::OffloadStats> {
        self.sched.offload_stats()
    }

    pub fn is_idle(&self) -> bool {
        self.sched.is_idle()
    }

    /// The blocks of the longest cached prefix of `hashes`, each a buffer of
    /// `kv_bytes_per_block` whose first 8 bytes are its hash (so an import
    /// can tell a torn or misplaced block).
    pub fn export_blocks(&self, hashes: &[SequenceHash]) -> Vec<KvBlockData> {
        let n = self.cfg.kv_bytes_per_block as usize;
        let mut out = Vec::new();
        let mut parent = None;
        for &h in hashes {
            if self.sched.cached_block(h).is_none() {
                break;
            }
            let mut bytes = vec![(h.0 & 0xff) as u8; n];
            bytes[..8].copy_from_slice(&h.0.to_le_bytes());
            out.push(KvBlockData {
                hash: h,
                parent,
                bytes,
            });
            parent = Some(h);
        }
        out
    }

    /// Stores exported blocks in the prefix cache; refuses a block of the
    /// wrong size or whose content does not carry its hash.
    pub fn import_blocks(&mut self, blocks: Vec<KvBlockData>) -> Result<usize, EngineError> {
        let n = self.cfg.kv_bytes_per_block as usize;
        let mut stored = 0;
        for b in blocks {
            if b.bytes.len() != n || b.bytes[..8] != b.hash.0.to_le_bytes() {
                return Err(EngineError::BadKvData(format!(
                    "block {:016x}: {} bytes, expected {n} carrying its hash",
                    b.hash.0,
                    b.bytes.len()
                )));
            }
            if self.sched.import_block(b.hash, b.parent).is_some() {
                stored += 1;
            }
        }
        Ok(stored)
    }

    /// Queues a request, bringing its offloaded blocks back first.
    pub fn add(&mut self, req: ValidRequest) -> Result<(), EngineError> {
        let mut kv = SimulatedKv(self.cfg.kv_bytes_per_block as usize);
        self.sched.onboard(req.prompt(), &mut kv);
        self.sched.add(req)
    }

    /// Removes a request; returns true if it was known.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        self.sched.cancel(id)
    }

    /// Fails every request (engine shutting down) and returns their ids.
    pub fn abort_all(&mut self) -> Vec<RequestId> {
        self.sched.abort_all()
    }

    pub fn load(&self) -> LoadMetrics {
        self.sched.load()
    }

    /// The block table, consistent with every event drained so far.
    pub fn kv_snapshot(&self) -> dynamo_engine::KvSnapshot {
        self.sched.kv_snapshot()
    }

    pub fn drain_kv_events(&mut self) -> Vec<KvCacheEvent> {
        self.sched.drain_kv_events()
    }

    /// Runs one engine step.
    pub fn step(&mut self) -> StepOutput {
        let plan = self.sched.schedule();
        let mut kv = SimulatedKv(self.cfg.kv_bytes_per_block as usize);
        self.sched.offload_evicted(&mut kv);
        let mut prefill_tokens = 0u64;
        let mut decoding = false;
        let mut sampled = Vec::with_capacity(plan.items.len());
        for item in &plan.items {
            let seq = self.sched.seq(item.id).expect("planned seq exists");
            let end = item.start + item.len;
            if end <= seq.prompt_len {
                prefill_tokens += item.len as u64;
            } else if item.start >= seq.prompt_len {
                decoding = true;
            } else {
                prefill_tokens += (seq.prompt_len - item.start) as u64;
                decoding = true;
            }
            sampled.push(item.sample.then(|| {
                next_token(
                    &seq.tokens,
                    seq.sampling.seed.unwrap_or(0),
                    self.token_lo,
                    self.token_hi,
                )
            }));
        }
        let pool = self.sched.pool();
        let util = pool.used() as f64 / pool.total() as f64;
        let simulated_ms = self.cfg.step_ms(prefill_tokens, decoding, util);
        let scheduled_tokens = plan.tokens();
        StepOutput {
            events: self.sched.commit(plan, &sampled),
            simulated_ms,
            scheduled_tokens,
        }
    }

    #[cfg(test)]
    pub fn pool(&self) -> &dynamo_batcher::BlockPool {
        self.sched.pool()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::predict;
    use dynamo_bus_schema::FinishReason;
    use dynamo_bus_schema::SamplingParams;
    use dynamo_engine::EngineLimits;
    use std::collections::HashMap;

    const LIMITS: EngineLimits = EngineLimits {
        context_length: 100_000,
        vocab_size: 1000,
    };

    fn req(id: u128, prompt: Vec<u32>, max_tokens: u32) -> ValidRequest {
        ValidRequest::from_parts(
            RequestId(id),
            prompt,
            &SamplingParams::greedy(max_tokens),
            LIMITS,
        )
        .unwrap()
    }

    fn core(cfg: MockerConfig) -> MockerCore {
        MockerCore::new(cfg, 1, (100, 1000), vec![2], true).unwrap()
    }

    fn run_to_end(c: &mut MockerCore) -> HashMap<RequestId, (u32, Vec<u32>, FinishReason)> {
        let mut res: HashMap<RequestId, (u32, Vec<u32>, FinishReason)> = HashMap::new();
        for _ in 0..10_000 {
            if c.is_idle() {
                break;
            }
            for (id, ev) in c.step().events {
                let e = res
                    .entry(id)
                    .or_insert((0, vec![], FinishReason::Unknown(0)));
                match ev {
                    EngineEvent::Started { cached_tokens }
                    | EngineEvent::Cached { cached_tokens } => e.0 = cached_tokens,
                    EngineEvent::Tokens(t) => e.1.extend(t),
                    EngineEvent::Finished { reason } => e.2 = reason,
                    EngineEvent::Failed(err) => panic!("{err}"),
                }
            }
        }
        assert!(c.is_idle());
        res
    }

    #[test]
    fn evicted_blocks_come_back_from_the_host_tier() {
        let cfg = MockerConfig {
            num_blocks: 8,
            kv_bytes_per_block: 1024,
            offload_host_blocks: 16,
            ..MockerConfig::default()
        };
        let mut c = core(cfg);
        let a: Vec<u32> = (100..164).collect(); // 4 full blocks
        c.add(req(1, a.clone(), 1)).unwrap();
        run_to_end(&mut c);
        // Two other prompts fill the 8-block pool and push A out.
        for (id, base) in [(2u128, 300u32), (3, 500)] {
            c.add(req(id, (base..base + 64).collect(), 1)).unwrap();
            run_to_end(&mut c);
        }
        c.add(req(4, a, 1)).unwrap();
        let res = run_to_end(&mut c);
        let stats = c.offload_stats().unwrap();
        assert!(stats.offloaded >= 4, "{stats:?}");
        assert!(stats.onboarded_host > 0, "{stats:?}");
        // Everything but the last block (the last prompt token is always computed).
        assert_eq!(res[&RequestId(4)].0, 48);
    }

    #[test]
    fn outputs_are_predictable_and_prefixes_are_reused() {
        let mut c = core(MockerConfig::default());
        let prompt: Vec<u32> = (100..160).collect(); // 60 tokens = 3 full blocks + 12
        c.add(req(1, prompt.clone(), 5)).unwrap();
        let r = run_to_end(&mut c);
        assert_eq!(r[&RequestId(1)].1, predict(&prompt, 5, 0, 100, 1000));
        assert_eq!(r[&RequestId(1)].0, 0);
        assert_eq!(r[&RequestId(1)].2, FinishReason::Length);
        // The same prompt again hits the 3 cached prompt blocks.
        c.add(req(2, prompt.clone(), 5)).unwrap();
        let r = run_to_end(&mut c);
        assert_eq!(r[&RequestId(2)].0, 48);
        assert_eq!(c.pool().used(), 0, "all blocks released");
        let ev = c.drain_kv_events();
        assert!(!ev.is_empty());
    }

    #[test]
    fn batching_respects_limits_and_chunks_prefill() {
        let cfg = MockerConfig {
            max_num_seqs: 2,
            max_num_batched_tokens: 32,
            ..MockerConfig::default()
        };
        let mut c = core(cfg);
        for i in 0..4 {
            c.add(req(i, (100 + i as u32..200 + i as u32).collect(), 3))
                .unwrap();
        }
        let s = c.step();
        assert_eq!(s.scheduled_tokens, 32, "chunked prefill fills the budget");
        assert!(c.load().active_seqs <= 2);
        let mut steps = 1;
        while !c.is_idle() {
            let s = c.step();
            assert!(s.scheduled_tokens <= 32);
            assert!(c.load().active_seqs <= 2);
            steps += 1;
        }
        // 4 × 100 prompt tokens in chunks of ≤ 32 need at least 13 steps.
        assert!(steps >= 13, "{steps}");
    }

    #[test]
    fn preemption_under_block_pressure_still_finishes_everything() {
        let cfg = MockerConfig {
            num_blocks: 12,
            block_size: 4,
            enable_prefix_caching: false,
            ..MockerConfig::default()
        };
        let mut c = core(cfg);
        for i in 0..5 {
            c.add(req(i, vec![100 + i as u32; 10], 20)).unwrap();
        }
        let r = run_to_end(&mut c);
        assert_eq!(r.len(), 5);
        for i in 0..5u128 {
            assert_eq!(
                r[&RequestId(i)].1,
                predict(&[100 + i as u32; 10], 20, 0, 100, 1000)
            );
        }
        assert_eq!(c.pool().used(), 0);
        // A request that can never fit is refused up front.
        assert!(matches!(
            c.add(req(9, vec![100; 40], 20)),
            Err(EngineError::TooLarge { .. })
        ));
    }

    #[test]
    fn cancel_frees_blocks_at_once() {
        let mut c = core(MockerConfig::default());
        c.add(req(1, (100..200).collect(), 100)).unwrap();
        c.step();
        assert!(c.pool().used() > 0);
        assert!(c.cancel(RequestId(1)));
        assert_eq!(c.pool().used(), 0);
        assert!(c.is_idle());
        assert!(!c.cancel(RequestId(1)));
    }

    #[test]
    fn stop_token_ends_the_sequence() {
        let mut c = core(MockerConfig::default());
        let prompt: Vec<u32> = (100..110).collect();
        let expect = predict(&prompt, 3, 0, 100, 1000);
        let mut sampling = SamplingParams::greedy(50);
        sampling.stop_token_ids.push(expect[2]);
        let r = ValidRequest::from_parts(RequestId(1), prompt, &sampling, LIMITS).unwrap();
        c.add(r).unwrap();
        let res = run_to_end(&mut c);
        let (_, toks, reason) = &res[&RequestId(1)];
        assert_eq!(toks, &expect);
        assert_eq!(*reason, FinishReason::Stop);
    }
}

#[cfg(test)]
mod load_tests {
    use super::*;
    use dynamo_bus_schema::SamplingParams;
    use dynamo_engine::EngineLimits;

    /// Prefill-only requests arriving faster than one step (Poisson, 10 a
    /// second of 1,100 tokens, on a small pool): batching never computes a
    /// prompt token twice, so the simulated busy time is exactly the
    /// prompts' tokens plus each step's constant.
    #[test]
    fn prefill_under_load_computes_each_prompt_token_once() {
        let cfg = MockerConfig {
            num_blocks: 2048,
            kv_bytes_per_block: 1024,
            prefill_ms: [0.0, 0.05, 20.0],
            ..MockerConfig::default()
        };
        let mut c = MockerCore::new(cfg, 1, (100, 1000), vec![2], true).unwrap();
        let limits = EngineLimits {
            context_length: 100_000,
            vocab_size: 50_000,
        };
        let (mut clock, mut next) = (0.0f64, 0.0f64);
        let (mut id, mut busy, mut tokens, mut steps) = (0u32, 0.0, 0u64, 0u64);
        let mut seed = 7u64;
        while clock < 30_000.0 {
            while next <= clock {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                let u = (seed >> 11) as f64 / (1u64 << 53) as f64;
                next += -(1.0 - u).ln() * 100.0;
                id += 1;
                let prompt: Vec<u32> = (0..1100)
                    .map(|t| 300 + (id * 7919 + t * 13) % 40_000)
                    .collect();
                let r = ValidRequest::from_parts(
                    RequestId(id as u128),
                    prompt,
                    &SamplingParams::greedy(1),
                    limits,
                )
                .unwrap();
                c.add(r).unwrap();
                tokens += 1100;
            }
            if c.is_idle() {
                clock = next;
                continue;
            }
            let s = c.step();
            steps += 1;
            busy += s.simulated_ms;
            clock += s.simulated_ms;
        }
        let expected = tokens as f64 * 0.05 + steps as f64 * 20.0;
        // Requests still queued at the end account for the difference.
        let queued = c.load().active_seqs + c.load().waiting_seqs;
        assert!(id > 250 && steps > 100, "{id} requests, {steps} steps");
        assert!(
            busy <= expected + 1e-6 && busy >= expected - queued as f64 * 1100.0 * 0.05 - 1e-6,
            "busy {busy} ms, expected {expected} ms ({queued} queued)"
        );
    }
}
