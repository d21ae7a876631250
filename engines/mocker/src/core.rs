//! The simulated engine's synchronous core: admission, chunked prefill,
//! continuous batching, preemption and completion, one [`MockerCore::step`]
//! at a time. No I/O and no clocks: the async driver in `engine.rs` owns time.
//!
//! Invariants:
//! - at most `max_num_seqs` sequences run and at most
//!   `max_num_batched_tokens` tokens are scheduled per step;
//! - running sequences are served before waiting ones (decode is never
//!   starved by new prefills); a waiting sequence is admitted only when its
//!   next chunk's blocks are available;
//! - when blocks run out, the most recently admitted running sequence is
//!   preempted (blocks released, progress reset, back to the queue's front);
//! - a sequence's blocks are released exactly once, tail first, when it
//!   finishes, is cancelled or is preempted.

use crate::block_pool::{BlockIdx, BlockPool};
use crate::config::MockerConfig;
use crate::tokens::next_token;
use dynamo_bus_schema::blocks::{chain, local_block_hash, SequenceHash};
use dynamo_bus_schema::{FinishReason, LoadMetrics, RequestId};
use dynamo_engine::{EngineError, EngineEvent, KvCacheEvent, ValidRequest};
use std::collections::{HashMap, VecDeque};

struct Seq {
    tokens: Vec<u32>,
    prompt_len: usize,
    max_tokens: u32,
    generated: u32,
    /// Tokens whose KV is computed.
    computed: usize,
    blocks: Vec<BlockIdx>,
    /// Sequence hashes of the full blocks registered so far.
    hashes: Vec<SequenceHash>,
    seed: u64,
    stop_ids: Vec<u32>,
    started: bool,
}

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

pub struct MockerCore {
    cfg: MockerConfig,
    salt: u64,
    token_lo: u32,
    token_hi: u32,
    eos_ids: Vec<u32>,
    pool: BlockPool,
    seqs: HashMap<RequestId, Seq>,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
}

impl MockerCore {
    pub fn new(
        cfg: MockerConfig,
        salt: u64,
        token_range: (u32, u32),
        eos_ids: Vec<u32>,
        record_kv_events: bool,
    ) -> Self {
        MockerCore {
            pool: BlockPool::new(cfg.num_blocks, record_kv_events),
            cfg,
            salt,
            token_lo: token_range.0,
            token_hi: token_range.1,
            eos_ids,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
        }
    }

    pub fn is_idle(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Queues a request.
    pub fn add(&mut self, req: ValidRequest) -> Result<(), EngineError> {
        if self.seqs.contains_key(&req.id()) {
            return Err(EngineError::Duplicate(req.id()));
        }
        let bs = self.cfg.block_size as usize;
        let needed = (req.prompt().len() + req.sampling().max_tokens as usize).div_ceil(bs);
        if needed > self.pool.total() as usize {
            return Err(EngineError::TooLarge {
                needed,
                capacity: self.pool.total() as usize,
            });
        }
        let s = req.sampling();
        let mut stop_ids = s.stop_token_ids.clone();
        if !s.ignore_eos {
            stop_ids.extend_from_slice(&self.eos_ids);
        }
        self.seqs.insert(
            req.id(),
            Seq {
                tokens: req.prompt().to_vec(),
                prompt_len: req.prompt().len(),
                max_tokens: s.max_tokens,
                generated: 0,
                computed: 0,
                blocks: Vec::new(),
                hashes: Vec::new(),
                seed: s.seed.unwrap_or(0),
                stop_ids,
                started: false,
            },
        );
        self.waiting.push_back(req.id());
        Ok(())
    }

    /// Removes a request; returns true if it was known.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        if !self.seqs.contains_key(&id) {
            return false;
        }
        self.finish(id);
        true
    }

    /// Fails every request (engine shutting down) and returns their ids.
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
    pub fn kv_snapshot(&self) -> dynamo_engine::KvSnapshot {
        let (last_event_id, blocks) = self.pool.snapshot();
        dynamo_engine::KvSnapshot {
            last_event_id,
            blocks,
        }
    }

    pub fn drain_kv_events(&mut self) -> Vec<KvCacheEvent> {
        self.pool.drain_events()
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

    /// Runs one engine step.
    pub fn step(&mut self) -> StepOutput {
        let bs = self.cfg.block_size as usize;
        let mut budget = self.cfg.max_num_batched_tokens as usize;
        let mut out = StepOutput::default();
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

        // 2. Admit waiting sequences.
        while budget > 0 && self.running.len() < self.cfg.max_num_seqs as usize {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let seq = self.seqs.get_mut(&id).expect("waiting seq exists");
            let mut matched = 0;
            if seq.blocks.is_empty() && self.cfg.enable_prefix_caching {
                let hashes = block_hashes(&seq.tokens, bs, self.salt);
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
                let cached = (matched * bs) as u32;
                out.events.push((
                    id,
                    EngineEvent::Started {
                        cached_tokens: cached,
                    },
                ));
            }
            self.waiting.pop_front();
            self.running.push(id);
            scheduled.push((id, n));
            budget -= n;
        }

        // 3. Time the step.
        let mut prefill_tokens = 0u64;
        let mut decoding = false;
        for (id, n) in &scheduled {
            let seq = &self.seqs[id];
            if seq.computed + n <= seq.prompt_len && *n > 0 {
                prefill_tokens += *n as u64;
            } else if seq.computed >= seq.prompt_len {
                decoding = true;
            } else {
                prefill_tokens += (seq.prompt_len - seq.computed) as u64;
                decoding = true;
            }
        }
        let util = self.pool.used() as f64 / self.pool.total() as f64;
        out.simulated_ms = self.cfg.step_ms(prefill_tokens, decoding, util);
        out.scheduled_tokens = scheduled.iter().map(|(_, n)| n).sum();

        // 4. Apply: advance, register full blocks, sample, finish.
        let mut finished = Vec::new();
        for (id, n) in scheduled {
            let seq = self.seqs.get_mut(&id).expect("scheduled seq exists");
            seq.computed += n;
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
            if seq.computed == seq.tokens.len() {
                let t = next_token(&seq.tokens, seq.seed, self.token_lo, self.token_hi);
                seq.tokens.push(t);
                seq.generated += 1;
                out.events.push((id, EngineEvent::Tokens(vec![t])));
                let reason = if seq.stop_ids.contains(&t) {
                    Some(FinishReason::Stop)
                } else if seq.generated >= seq.max_tokens {
                    Some(FinishReason::Length)
                } else {
                    None
                };
                if let Some(reason) = reason {
                    out.events.push((id, EngineEvent::Finished { reason }));
                    finished.push(id);
                }
            }
        }
        for id in finished {
            self.finish(id);
        }
        out
    }

    #[cfg(test)]
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }
}

/// Sequence hashes of every full block of `tokens`.
pub fn block_hashes(tokens: &[u32], bs: usize, salt: u64) -> Vec<SequenceHash> {
    dynamo_bus_schema::blocks::sequence_hashes(tokens, bs, salt)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::predict;
    use dynamo_bus_schema::SamplingParams;
    use dynamo_engine::EngineLimits;

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
        MockerCore::new(cfg, 1, (100, 1000), vec![2], true)
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
                    EngineEvent::Started { cached_tokens } => e.0 = cached_tokens,
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
