//! Routing policies: the seam where the KV-aware policy plugs in.
//!
//! A policy sees the request (model, prompt tokens) and the eligible
//! candidates (serving, fresh, not excluded) and picks one. It never sees
//! workers that cannot take the request.

use dynamo_bus_schema::{LoadMetrics, ModelName, WorkerId};
use std::str::FromStr;

/// What a policy knows about one request.
pub struct RouteRequest<'a> {
    pub model: &'a ModelName,
    pub token_ids: &'a [u32],
}

/// What a policy knows about one eligible worker.
#[derive(Clone, Debug)]
pub struct Candidate {
    pub worker_id: WorkerId,
    /// Requests this router has sent there and not yet seen finish.
    pub router_inflight: u32,
    /// The worker's own last report.
    pub reported: LoadMetrics,
}

impl Candidate {
    /// The load figure least-loaded compares: the larger of the router's own
    /// count (fresh) and the worker's report (sees other routers' requests).
    pub fn load(&self) -> u32 {
        self.router_inflight.max(self.reported.inflight_requests)
    }
}

pub trait RoutingPolicy: Send + 'static {
    fn name(&self) -> &'static str;
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
        let c = &candidates[self.next % candidates.len()];
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
        let c = tied[self.tie % tied.len()];
        self.tie = self.tie.wrapping_add(1);
        c.worker_id
    }
}

/// Policy names as they appear in configs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PolicyKind {
    RoundRobin,
    #[default]
    LeastLoaded,
}

impl FromStr for PolicyKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "round_robin" => Ok(PolicyKind::RoundRobin),
            "least_loaded" => Ok(PolicyKind::LeastLoaded),
            other => Err(format!(
                "unknown routing policy {other:?} (expected round_robin or least_loaded)"
            )),
        }
    }
}

/// Builds the policy named in the config.
pub fn build(kind: PolicyKind) -> Box<dyn RoutingPolicy> {
    match kind {
        PolicyKind::RoundRobin => Box::new(RoundRobin::default()),
        PolicyKind::LeastLoaded => Box::new(LeastLoaded::default()),
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
        }
    }

    #[test]
    fn round_robin_cycles_and_least_loaded_prefers_idle() {
        let m = ModelName("m".into());
        let req = RouteRequest {
            model: &m,
            token_ids: &[],
        };
        let cs = [cand(1, 5), cand(2, 0), cand(3, 0)];
        let mut rr = RoundRobin::default();
        let picks: Vec<u64> = (0..4).map(|_| rr.select(&req, &cs).0).collect();
        assert_eq!(picks, vec![1, 2, 3, 1]);
        let mut ll = LeastLoaded::default();
        let picks: Vec<u64> = (0..4).map(|_| ll.select(&req, &cs).0).collect();
        assert_eq!(picks, vec![2, 3, 2, 3]);
        let mut reported = cand(2, 0);
        reported.reported.inflight_requests = 9;
        assert_eq!(ll.select(&req, &[cand(1, 1), reported]).0, 1);
    }
}
