//! Routing policies: the seam where the KV-aware policy plugs in.
//!
//! A policy sees the request (model, prompt tokens) and the eligible
//! candidates (serving, fresh, not excluded) and picks one. It never sees
//! workers that cannot take the request.
//!
//! Invariant: selection is total. Given a non-empty candidate list every
//! policy returns one of its workers, whatever the weights or loads: costs
//! are compared with a total order, a cost that is not a finite number
//! counts as the worst, and sampling that cannot be done (weights that
//! overflow or vanish) falls back to the cheapest.

use dynamo_bus_schema::{LoadMetrics, ModelName, WorkerId};
use dynamo_kv_index::Overlap;
use std::str::FromStr;

/// What a policy knows about one request.
pub struct RouteRequest<'a> {
    pub model: &'a ModelName,
    pub token_ids: &'a [u32],
    /// Per-request KV cost weights (replace the configured ones).
    pub weights: Option<KvCostWeights>,
}

/// What a policy knows about one eligible worker.
#[derive(Clone, Debug)]
pub struct Candidate {
    pub worker_id: WorkerId,
    /// Requests this router has sent there and not yet seen finish.
    pub router_inflight: u32,
    /// The worker's own last report.
    pub reported: LoadMetrics,
    /// Leading blocks of the request this worker already holds (KV-aware policies only).
    pub overlap: Overlap,
    /// Uncached prompt tokens sent there (by any replica) and not prefilled yet.
    pub pending_prefill_tokens: u64,
    /// KV blocks of the requests in flight there (by any replica).
    pub active_blocks: u64,
    /// Requests in flight there past their prefill (by any replica).
    pub decoding: u32,
    /// Tokens per KV block of the worker's model.
    pub block_size: u32,
}

impl Candidate {
    /// The load figure least-loaded compares: requests in flight there from
    /// every router replica (shared over the bus, so it is fresh and complete).
    /// The worker's own report lags by up to one report interval and would
    /// make a just-finished request look busy, so it is not used here.
    pub fn load(&self) -> u32 {
        self.router_inflight
    }
}

pub trait RoutingPolicy: Send + 'static {
    fn name(&self) -> &'static str;
    /// Whether candidates need their KV overlap computed (costs an index query).
    fn needs_overlap(&self) -> bool {
        false
    }
    /// Picks one of `candidates` (never empty).
    fn select(&mut self, req: &RouteRequest<'_>, candidates: &[Candidate]) -> WorkerId;
}

/// Cycles through the candidates in worker-id order.
#[derive(Default)]
pub struct RoundRobin {
    next: usize,
}

impl RoutingPolicy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }
    fn select(&mut self, _req: &RouteRequest<'_>, candidates: &[Candidate]) -> WorkerId {
        let c = &candidates[self.next % candidates.len().max(1)];
        self.next = self.next.wrapping_add(1);
        c.worker_id
    }
}

/// Lowest load wins; ties go round-robin so equal workers share evenly.
#[derive(Default)]
pub struct LeastLoaded {
    tie: usize,
}

impl RoutingPolicy for LeastLoaded {
    fn name(&self) -> &'static str {
        "least_loaded"
    }
    fn select(&mut self, _req: &RouteRequest<'_>, candidates: &[Candidate]) -> WorkerId {
        let min = candidates.iter().map(Candidate::load).min().unwrap_or(0);
        let tied: Vec<&Candidate> = candidates.iter().filter(|c| c.load() == min).collect();
        let c = tied[self.tie % tied.len().max(1)];
        self.tie = self.tie.wrapping_add(1);
        c.worker_id
    }
}

/// Weights of the KV-aware cost (see the crate README for the formula).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvCostWeights {
    /// Weight of prefill work (in blocks) against decode load (in blocks).
    pub overlap_weight: f64,
    /// Fraction of a block's prefill cost still paid for a host-tier hit.
    pub host_hit_cost: f64,
    /// Fraction of a block's prefill cost still paid for a disk-tier hit.
    pub disk_hit_cost: f64,
    /// 0 = always the cheapest; > 0 = softmax sampling over −cost/temperature.
    pub temperature: f64,
}

impl Default for KvCostWeights {
    fn default() -> Self {
        KvCostWeights {
            overlap_weight: 1.0,
            host_hit_cost: 0.2,
            disk_hit_cost: 0.5,
            temperature: 0.0,
        }
    }
}

/// A worker's step timing, the model the time cost predicts with (the
/// mocker's: a step of N new prefill tokens takes `a·N² + b·N + c` ms, plus
/// `a·u² + b·u + c` ms, floor 1 ms, when sequences decode at KV utilisation u).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepTiming {
    /// Prefill ms for N new tokens in one step: `[a, b, c]`.
    pub prefill_ms: [f64; 3],
    /// Decode step ms at KV utilisation u: `[a, b, c]`.
    pub decode_ms: [f64; 3],
    /// Most prefill tokens in one step (chunked prefill).
    pub max_batched_tokens: u32,
}

impl Default for StepTiming {
    /// The mocker's default timing (Dynamo's).
    fn default() -> Self {
        StepTiming {
            prefill_ms: [4.21e-7, 1.518e-2, 16.5],
            decode_ms: [-25.74, 54.01, 5.74],
            max_batched_tokens: 8192,
        }
    }
}

impl StepTiming {
    fn prefill(&self, n: f64) -> f64 {
        let [a, b, c] = self.prefill_ms;
        if n <= 0.0 {
            0.0
        } else {
            (a * n * n + b * n + c).max(0.0)
        }
    }

    fn decode(&self, u: f64) -> f64 {
        let u = u.clamp(0.0, 1.0);
        let [a, b, c] = self.decode_ms;
        (a * u * u + b * u + c).max(1.0)
    }

    /// Time to prefill `tokens` in chunked steps, each also taking `decode`
    /// ms for the sequences decoding there.
    fn prefill_steps(&self, tokens: f64, decode: f64) -> f64 {
        if tokens <= 0.0 {
            return 0.0;
        }
        let chunk = self.max_batched_tokens.max(1) as f64;
        let full = (tokens / chunk).floor();
        let rest = tokens - full * chunk;
        let steps = (tokens / chunk).ceil();
        full * self.prefill(chunk) + self.prefill(rest) + steps * decode
    }

    /// Predicted time to first token of a request with `ours` uncached
    /// tokens on a worker with `queued` prefill tokens ahead of it, decoding
    /// (when `decoding`) at utilisation `u`. The first queued step is already
    /// running, so on average half of it remains.
    pub fn ttft_ms(&self, queued: f64, ours: f64, u: f64, decoding: bool) -> f64 {
        let decode = if decoding { self.decode(u) } else { 0.0 };
        let chunk = self.max_batched_tokens.max(1) as f64;
        let mut wait = 0.0;
        if queued > 0.0 {
            let first = queued.min(chunk);
            wait += (self.prefill(first) + decode) / 2.0;
            wait += self.prefill_steps(queued - first, decode);
        }
        wait + self.prefill_steps(ours.max(1.0), decode)
    }

    /// GPU time spent prefilling `tokens` (chunked, without the decodes).
    pub fn prefill_work_ms(&self, tokens: f64) -> f64 {
        self.prefill_steps(tokens, 0.0)
    }
}

/// Lowest predicted cost wins. With a [`StepTiming`] (policy `kv_aware`), the
/// cost is the request's predicted time to first token on that worker, in ms
/// ([`StepTiming::ttft_ms`]): the worker first finishes what is queued there
/// (`pending_prefill`, sent by any replica; its first step is already
/// running), then prefills the request's uncached tokens, in chunked steps,
/// each step also decoding at the worker's KV utilisation. A miss costs its
/// prefill time and waiting costs the queue's, so a cache hit wins at light
/// load and loses to an idle worker when the queue ahead of it is longer than
/// the work it saves. `overlap_weight` scales the uncached prefill term.
/// In selection a miss also pays for the GPU time it burns: the prefill of
/// what the best-placed candidate already holds, times the share of
/// candidates that are busy (see [`KvAware::add_burned`]).
///
/// Without one (policy `kv_aware_blocks`, Dynamo's formula):
/// `cost = overlap_weight × (pending_prefill + uncached) / block_size + decode_blocks`,
/// `uncached = input − block_size × (device + host × (1 − host_hit_cost) + disk × (1 − disk_hit_cost))`,
/// `decode_blocks = max(the worker's used KV blocks, blocks in flight there) + this request's blocks`.
/// Ties go to the lower load, then at random.
pub struct KvAware {
    w: KvCostWeights,
    timing: Option<StepTiming>,
    rng: rand::rngs::StdRng,
}

impl KvAware {
    /// The block-count cost (`kv_aware_blocks`).
    pub fn new(w: KvCostWeights) -> Self {
        use rand::SeedableRng;
        KvAware {
            w,
            timing: None,
            rng: rand::rngs::StdRng::from_os_rng(),
        }
    }

    /// The predicted-time cost (`kv_aware`).
    pub fn timed(w: KvCostWeights, timing: StepTiming) -> Self {
        KvAware {
            timing: Some(timing),
            ..Self::new(w)
        }
    }

    /// The predicted cost of sending a request of `input` tokens to `c`
    /// (ms with a timing model, else blocks of `c`'s own size).
    pub fn cost(&self, c: &Candidate, input: usize) -> f64 {
        self.cost_under(&self.w, c, input, c.block_size)
    }

    /// The cost under weights `w`; block costs are counted in blocks of `unit` tokens.
    fn cost_under(&self, w: &KvCostWeights, c: &Candidate, input: usize, unit: u32) -> f64 {
        match &self.timing {
            Some(t) => Self::time_cost(t, w, c, input),
            None => Self::cost_with(w, c, input, unit),
        }
    }

    /// Uncached prompt tokens on `c`: tier hits count at their share of a miss.
    fn uncached(w: &KvCostWeights, c: &Candidate, input: usize) -> f64 {
        let bs = c.block_size.max(1) as f64;
        let o = &c.overlap;
        let saved = bs
            * (o.device as f64
                + o.host as f64 * (1.0 - w.host_hit_cost)
                + o.disk as f64 * (1.0 - w.disk_hit_cost));
        (input as f64 - saved).max(0.0)
    }

    /// Predicted time to first token on `c`, ms.
    fn time_cost(t: &StepTiming, w: &KvCostWeights, c: &Candidate, input: usize) -> f64 {
        let bs = c.block_size.max(1) as f64;
        let ours = w.overlap_weight * Self::uncached(w, c, input);
        let used = (c.reported.kv_used_blocks as u64).max(c.active_blocks) as f64;
        let total = c.reported.kv_total_blocks as f64;
        let u = if total > 0.0 {
            (used + input as f64 / bs) / total
        } else {
            0.0
        };
        // Requests still prefilling are the queue, not decoders.
        let decoding = c.decoding > 0;
        t.ttft_ms(c.pending_prefill_tokens as f64, ours, u, decoding)
    }

    /// What a miss costs the fleet besides this request's own time: the GPU
    /// time spent recomputing what the best-placed candidate holds is
    /// capacity lost to every later request, one for one while every worker
    /// is busy and not at all while they idle. It is added to each
    /// candidate's predicted TTFT, times the share of candidates that are
    /// busy (prefilling or decoding); the best-placed candidate pays nothing.
    fn add_burned(
        t: &StepTiming,
        w: &KvCostWeights,
        candidates: &[Candidate],
        input: usize,
        costs: &mut [f64],
    ) {
        if candidates.is_empty() {
            return;
        }
        let work: Vec<f64> = candidates
            .iter()
            .map(|c| t.prefill_work_ms(w.overlap_weight * Self::uncached(w, c, input)))
            .collect();
        let least = work.iter().copied().fold(f64::INFINITY, f64::min);
        let busy = candidates
            .iter()
            .filter(|c| c.decoding > 0 || c.pending_prefill_tokens > 0)
            .count() as f64
            / candidates.len() as f64;
        for (cost, work) in costs.iter_mut().zip(&work) {
            *cost += busy * (work - least);
        }
    }

    /// The cost in blocks of `unit` tokens: candidates whose block sizes
    /// differ (a misconfigured worker) are compared in one unit, while each
    /// one's cache hits count in its own blocks.
    fn cost_with(w: &KvCostWeights, c: &Candidate, input: usize, unit: u32) -> f64 {
        let bs = c.block_size.max(1) as f64;
        let unit = unit.max(1) as f64;
        let uncached = Self::uncached(w, c, input);
        let prefill_blocks = (c.pending_prefill_tokens as f64 + uncached) / unit;
        // The worker's report lags by up to one report interval; the routers'
        // own count of in-flight blocks does not.
        let active = (c.reported.kv_used_blocks as u64).max(c.active_blocks) as f64 * bs / unit;
        let decode_blocks = active + (input as f64 / unit).ceil();
        w.overlap_weight * prefill_blocks + decode_blocks
    }
}

impl RoutingPolicy for KvAware {
    fn name(&self) -> &'static str {
        if self.timing.is_some() {
            "kv_aware"
        } else {
            "kv_aware_blocks"
        }
    }
    fn needs_overlap(&self) -> bool {
        true
    }
    fn select(&mut self, req: &RouteRequest<'_>, candidates: &[Candidate]) -> WorkerId {
        use rand::Rng;
        let w = req.weights.unwrap_or(self.w);
        // A cost that is not a finite number (weights or loads at the edge
        // of f64) counts as the worst possible.
        let unit = candidates.iter().map(|c| c.block_size).min().unwrap_or(1);
        let input = req.token_ids.len();
        let mut costs: Vec<f64> = candidates
            .iter()
            .map(|c| self.cost_under(&w, c, input, unit))
            .collect();
        if let Some(t) = &self.timing {
            Self::add_burned(t, &w, candidates, input, &mut costs);
        }
        for c in &mut costs {
            if !c.is_finite() {
                *c = f64::MAX;
            }
        }
        let min = costs.iter().copied().min_by(f64::total_cmp).unwrap_or(0.0);
        if w.temperature > 0.0 && w.temperature.is_finite() {
            // Time costs are sampled relative to the cheapest (a temperature
            // of 1 weighs a cost twice the cheapest by 1/e); block costs in blocks.
            let scale = match self.timing {
                Some(_) => w.temperature * min.max(1.0),
                None => w.temperature,
            };
            let weights: Vec<f64> = costs
                .iter()
                .map(|c| (-(c - min) / scale).exp())
                .map(|x| if x.is_finite() { x } else { 0.0 })
                .collect();
            let total: f64 = weights.iter().sum();
            if total.is_finite() && total > 0.0 {
                let mut x = self.rng.random::<f64>() * total;
                for (c, w) in candidates.iter().zip(&weights) {
                    if x < *w {
                        return c.worker_id;
                    }
                    x -= w;
                }
            }
        }
        // The cheapest (within a relative tolerance), then the least loaded,
        // then at random. `min` is one of the costs, so `best` is never empty.
        let tol = 1e-9 * min.abs().max(1.0);
        let best: Vec<&Candidate> = candidates
            .iter()
            .zip(&costs)
            .filter(|(_, c)| **c - min <= tol)
            .map(|(c, _)| c)
            .collect();
        let least = best.iter().map(|c| c.load()).min().unwrap_or(0);
        let tied: Vec<&&Candidate> = best.iter().filter(|c| c.load() == least).collect();
        match tied.len() {
            0 => candidates[0].worker_id,
            n => tied[self.rng.random_range(0..n)].worker_id,
        }
    }
}

/// Sends each request to a uniformly random candidate (a baseline).
pub struct Random {
    rng: rand::rngs::StdRng,
}

impl Default for Random {
    fn default() -> Self {
        use rand::SeedableRng;
        Random {
            rng: rand::rngs::StdRng::from_os_rng(),
        }
    }
}

impl RoutingPolicy for Random {
    fn name(&self) -> &'static str {
        "random"
    }
    fn select(&mut self, _req: &RouteRequest<'_>, candidates: &[Candidate]) -> WorkerId {
        use rand::Rng;
        candidates[self.rng.random_range(0..candidates.len().max(1))].worker_id
    }
}

/// Policy names as they appear in configs.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub enum PolicyKind {
    RoundRobin,
    #[default]
    LeastLoaded,
    Random,
    /// Predicted time to first token (see [`KvAware`]).
    KvAware(KvCostWeights, StepTiming),
    /// Dynamo's block-count cost.
    KvAwareBlocks(KvCostWeights),
}

impl PolicyKind {
    /// The KV cost weights of a KV-aware policy.
    pub fn weights_mut(&mut self) -> Option<&mut KvCostWeights> {
        match self {
            PolicyKind::KvAware(w, _) | PolicyKind::KvAwareBlocks(w) => Some(w),
            _ => None,
        }
    }
}

impl FromStr for PolicyKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "round_robin" => Ok(PolicyKind::RoundRobin),
            "least_loaded" => Ok(PolicyKind::LeastLoaded),
            "random" => Ok(PolicyKind::Random),
            "kv_aware" => Ok(PolicyKind::KvAware(
                KvCostWeights::default(),
                StepTiming::default(),
            )),
            "kv_aware_blocks" => Ok(PolicyKind::KvAwareBlocks(KvCostWeights::default())),
            other => Err(format!(
                "unknown routing policy {other:?} (expected kv_aware, kv_aware_blocks, least_loaded, round_robin or random)"
            )),
        }
    }
}

/// Builds the policy named in the config.
pub fn build(kind: PolicyKind) -> Box<dyn RoutingPolicy> {
    match kind {
        PolicyKind::RoundRobin => Box::new(RoundRobin::default()),
        PolicyKind::LeastLoaded => Box::new(LeastLoaded::default()),
        PolicyKind::Random => Box::new(Random::default()),
        PolicyKind::KvAware(w, t) => Box::new(KvAware::timed(w, t)),
        PolicyKind::KvAwareBlocks(w) => Box::new(KvAware::new(w)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(id: u64, inflight: u32) -> Candidate {
        Candidate {
            worker_id: WorkerId(id),
            router_inflight: inflight,
            reported: LoadMetrics::default(),
            overlap: Overlap::default(),
            pending_prefill_tokens: 0,
            active_blocks: 0,
            decoding: 0,
            block_size: 16,
        }
    }

    #[test]
    fn round_robin_cycles_and_least_loaded_prefers_idle() {
        let m = ModelName("m".into());
        let req = RouteRequest {
            model: &m,
            token_ids: &[],
            weights: None,
        };
        let cs = [cand(1, 5), cand(2, 0), cand(3, 0)];
        let mut rr = RoundRobin::default();
        let picks: Vec<u64> = (0..4).map(|_| rr.select(&req, &cs).0).collect();
        assert_eq!(picks, vec![1, 2, 3, 1]);
        let mut ll = LeastLoaded::default();
        let picks: Vec<u64> = (0..4).map(|_| ll.select(&req, &cs).0).collect();
        assert_eq!(picks, vec![2, 3, 2, 3]);
        // A stale worker report does not outweigh the routers' shared count.
        let mut stale = cand(2, 0);
        stale.reported.inflight_requests = 9;
        assert_eq!(ll.select(&req, &[cand(1, 1), stale]).0, 2);
    }

    #[test]
    fn selection_is_total_whatever_the_weights() {
        let m = ModelName("m".into());
        let tokens: Vec<u32> = (300..400).collect();
        let cs = extreme_candidates();
        let mut p = KvAware::new(KvCostWeights::default());
        for (ow, t) in [
            (1e308, 0.0),
            (f64::MAX, 0.0),
            (f64::INFINITY, 0.0),
            (f64::NAN, 0.0),
            (1.0, 1e-300),
            (1e308, 1e308),
            (1.0, f64::NAN),
            (1.0, f64::INFINITY),
            (0.0, 5.0),
        ] {
            let req = RouteRequest {
                model: &m,
                token_ids: &tokens,
                weights: Some(KvCostWeights {
                    overlap_weight: ow,
                    temperature: t,
                    ..KvCostWeights::default()
                }),
            };
            for _ in 0..20 {
                let w = p.select(&req, &cs);
                assert!(cs.iter().any(|c| c.worker_id == w), "{ow} {t}: {w:?}");
            }
        }
    }

    #[test]
    fn kv_aware_prefers_overlap_until_load_outweighs_it() {
        let m = ModelName("m".into());
        let tokens = vec![0u32; 160]; // 10 blocks
        let req = RouteRequest {
            model: &m,
            token_ids: &tokens,
            weights: None,
        };
        let mut p = KvAware::new(KvCostWeights::default());
        let mut hit = cand(1, 0);
        hit.overlap = Overlap {
            blocks: 8,
            device: 8,
            host: 0,
            disk: 0,
        };
        assert_eq!(p.select(&req, &[cand(2, 0), hit.clone()]).0, 1);
        // Same overlap in the host tier is worth less than on device…
        let mut host = cand(3, 0);
        host.overlap = Overlap {
            blocks: 8,
            device: 0,
            host: 8,
            disk: 0,
        };
        assert!(p.cost(&host, 160) > p.cost(&hit, 160));
        assert!(p.cost(&host, 160) < p.cost(&cand(2, 0), 160));
        // …and a heavily loaded worker loses its advantage.
        hit.reported.kv_used_blocks = 100;
        assert_eq!(p.select(&req, &[cand(2, 0), hit.clone()]).0, 2);
        // A request that weighs prefill heavily goes back to its cache.
        let heavy = RouteRequest {
            weights: Some(KvCostWeights {
                overlap_weight: 100.0,
                ..KvCostWeights::default()
            }),
            ..req
        };
        assert_eq!(p.select(&heavy, &[cand(2, 0), hit]).0, 1);
        assert_eq!(p.cost(&cand(2, 0), 160), 10.0 + 10.0);
    }

    fn request<'a>(m: &'a ModelName, tokens: &'a [u32]) -> RouteRequest<'a> {
        RouteRequest {
            model: m,
            token_ids: tokens,
            weights: None,
        }
    }

    fn on_device(n: u32) -> Overlap {
        Overlap {
            blocks: n,
            device: n,
            host: 0,
            disk: 0,
        }
    }

    /// Three candidates, one with loads at the edge of their types.
    fn extreme_candidates() -> [Candidate; 3] {
        let mut loaded = cand(2, 3);
        loaded.pending_prefill_tokens = u64::MAX;
        loaded.reported.kv_used_blocks = u32::MAX;
        [cand(1, 0), loaded, cand(3, 1)]
    }

    fn timed() -> KvAware {
        KvAware::timed(KvCostWeights::default(), StepTiming::default())
    }

    #[test]
    fn the_time_cost_is_the_predicted_time_to_first_token() {
        let t = StepTiming::default();
        let p = timed();
        // An idle worker without a hit: the prefill of the whole prompt.
        let idle = cand(1, 0);
        let want = t.prefill(3000.0);
        assert!((t.ttft_ms(0.0, 3000.0, 0.0, false) - want).abs() < 1e-9);
        assert!((p.cost(&idle, 3000) - want).abs() < 1e-9);
        // A hit on 2,000 tokens (125 blocks) leaves 1,000 to prefill.
        let mut hit = cand(2, 0);
        hit.overlap = on_device(125);
        assert!((p.cost(&hit, 3000) - t.prefill(1000.0)).abs() < 1e-9);
        // Queued prefill there is prefilled first, in chunks of 8,192
        // tokens (the first already running: half of it is left), each step
        // also decoding; then the request's own.
        hit.pending_prefill_tokens = 20_000;
        hit.active_blocks = 10;
        hit.decoding = 1;
        hit.reported.kv_total_blocks = 1000;
        let u = (10.0 + 3000.0 / 16.0) / 1000.0;
        let d = t.decode(u);
        let want = (t.prefill(8192.0) + d) / 2.0
            + t.prefill(8192.0)
            + t.prefill(20_000.0 - 16_384.0)
            + 2.0 * d
            + t.prefill(1000.0)
            + d;
        assert!((p.cost(&hit, 3000) - want).abs() < 1e-6);
    }

    #[test]
    fn a_hit_wins_at_light_load_and_loses_to_a_long_queue() {
        let m = ModelName("m".into());
        let tokens = vec![0u32; 4096]; // 256 blocks
        let req = request(&m, &tokens);
        let mut p = timed();
        // The conversation's history is on worker 1, which is busier than
        // worker 2 (more requests in flight, more KV in use): at light load
        // the saved prefill outweighs the decode load, so it goes there.
        let mut history = cand(1, 3);
        history.overlap = on_device(240);
        history.active_blocks = 2_000;
        history.decoding = 3;
        history.reported.kv_total_blocks = 20_000;
        let mut idle = cand(2, 0);
        idle.reported.kv_total_blocks = 20_000;
        for _ in 0..10 {
            assert_eq!(p.select(&req, &[idle.clone(), history.clone()]).0, 1);
        }
        // Behind a queue longer than the work it saves, it loses.
        history.pending_prefill_tokens = 16_000;
        assert_eq!(p.select(&req, &[idle.clone(), history.clone()]).0, 2);
        // A host-tier hit saves less than a device hit, more than none.
        let mut host = cand(3, 0);
        host.overlap = Overlap {
            blocks: 240,
            device: 0,
            host: 240,
            disk: 0,
        };
        let mut dev = host.clone();
        dev.overlap.device = 240;
        dev.overlap.host = 0;
        assert!(p.cost(&dev, 4096) < p.cost(&host, 4096));
        assert!(p.cost(&host, 4096) < p.cost(&cand(4, 0), 4096));
        assert_eq!(p.name(), "kv_aware");
        assert_eq!(
            KvAware::new(KvCostWeights::default()).name(),
            "kv_aware_blocks"
        );
    }

    #[test]
    fn a_miss_pays_the_gpu_time_it_burns_when_the_fleet_is_busy() {
        let m = ModelName("m".into());
        let tokens = vec![0u32; 4096];
        let req = request(&m, &tokens);
        let mut p = timed();
        // The holder of 3,840 of the 4,096 tokens has a queue that makes its
        // first token ~57 ms later than a full prefill elsewhere; the miss
        // would burn ~65 ms of GPU time recomputing what it holds.
        let mut holder = cand(1, 1);
        holder.overlap = on_device(240);
        holder.pending_prefill_tokens = 9_000;
        holder.decoding = 1;
        let others = |decoding: u32| -> Vec<Candidate> {
            (2..5)
                .map(|i| Candidate {
                    decoding,
                    ..cand(i, decoding)
                })
                .collect()
        };
        // Idle elsewhere: the burned time costs a quarter (one busy worker
        // of four) and the faster first token wins.
        let mut cs = others(0);
        cs.push(holder.clone());
        assert_ne!(p.select(&req, &cs).0, 1);
        // Every worker busy: the recompute would delay someone one for one.
        let mut cs = others(1);
        cs.push(holder.clone());
        assert_eq!(p.select(&req, &cs).0, 1);
        // The candidate cost alone (no fleet) is the plain TTFT.
        let t = StepTiming::default();
        assert!((p.cost(&cand(9, 0), 4096) - t.prefill(4096.0)).abs() < 1e-9);
    }

    #[test]
    fn the_time_cost_is_total_too() {
        let m = ModelName("m".into());
        let tokens: Vec<u32> = (300..400).collect();
        let cs = extreme_candidates();
        let mut p = KvAware::timed(
            KvCostWeights::default(),
            StepTiming {
                prefill_ms: [1e6, 1e6, 1e6],
                decode_ms: [-1e6, 1e6, -1e6],
                max_batched_tokens: 1,
            },
        );
        for t in [0.0, 1e-300, 1.0, 1e308] {
            let req = RouteRequest {
                model: &m,
                token_ids: &tokens,
                weights: Some(KvCostWeights {
                    temperature: t,
                    ..KvCostWeights::default()
                }),
            };
            let w = p.select(&req, &cs);
            assert!(cs.iter().any(|c| c.worker_id == w));
        }
    }
}
