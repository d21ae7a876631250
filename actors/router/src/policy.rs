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

/// Lowest predicted cost wins:
/// `cost = overlap_weight × (pending_prefill + uncached) / block_size + decode_blocks`,
/// `uncached = input − block_size × (device + host × (1 − host_hit_cost) + disk × (1 − disk_hit_cost))`,
/// `decode_blocks = max(the worker's used KV blocks, blocks in flight there) + this request's blocks`.
/// Ties go to the lower load, then at random.
pub struct KvAware {
    w: KvCostWeights,
    rng: rand::rngs::StdRng,
}

impl KvAware {
    pub fn new(w: KvCostWeights) -> Self {
        use rand::SeedableRng;
        KvAware {
            w,
            rng: rand::rngs::StdRng::from_os_rng(),
        }
    }

    /// The predicted cost of sending a request of `input` tokens to `c`
    /// (in blocks of `c`'s own size).
    pub fn cost(&self, c: &Candidate, input: usize) -> f64 {
        Self::cost_with(&self.w, c, input, c.block_size)
    }

    /// The cost in blocks of `unit` tokens: candidates whose block sizes
    /// differ (a misconfigured worker) are compared in one unit, while each
    /// one's cache hits count in its own blocks.
    fn cost_with(w: &KvCostWeights, c: &Candidate, input: usize, unit: u32) -> f64 {
        let bs = c.block_size.max(1) as f64;
        let unit = unit.max(1) as f64;
        let o = &c.overlap;
        let saved = bs
            * (o.device as f64
                + o.host as f64 * (1.0 - w.host_hit_cost)
                + o.disk as f64 * (1.0 - w.disk_hit_cost));
        let uncached = (input as f64 - saved).max(0.0);
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
        "kv_aware"
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
        let costs: Vec<f64> = candidates
            .iter()
            .map(|c| Self::cost_with(&w, c, req.token_ids.len(), unit))
            .map(|c| if c.is_finite() { c } else { f64::MAX })
            .collect();
        let min = costs.iter().copied().min_by(f64::total_cmp).unwrap_or(0.0);
        if w.temperature > 0.0 && w.temperature.is_finite() {
            let weights: Vec<f64> = costs
                .iter()
                .map(|c| (-(c - min) / w.temperature).exp())
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
    KvAware(KvCostWeights),
}

impl FromStr for PolicyKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "round_robin" => Ok(PolicyKind::RoundRobin),
            "least_loaded" => Ok(PolicyKind::LeastLoaded),
            "random" => Ok(PolicyKind::Random),
            "kv_aware" => Ok(PolicyKind::KvAware(KvCostWeights::default())),
            other => Err(format!(
                "unknown routing policy {other:?} (expected kv_aware, least_loaded, round_robin or random)"
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
        PolicyKind::KvAware(w) => Box::new(KvAware::new(w)),
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
        let mut loaded = cand(2, 3);
        loaded.pending_prefill_tokens = u64::MAX;
        loaded.reported.kv_used_blocks = u32::MAX;
        let cs = [cand(1, 0), loaded, cand(3, 1)];
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
}
