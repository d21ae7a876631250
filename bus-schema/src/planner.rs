//! Wire types of the planner: the metrics it reads (gateways and workers
//! publish them once per interval, never per request), its lease, status
//! and the pins a manual `scale` sets.
//!
//! Invariants: latency histograms have exactly [`LATENCY_BUCKETS_MS`]`.len() + 1`
//! counts (the last is the overflow) or none; every list is bounded by
//! [`MAX_PLANNER_ITEMS`] and a status's memory by [`MAX_MEMORY_JSON`];
//! a receiver drops a message past those bounds and counts it.

use crate::codec::{MessageKind, WireMessage};
use crate::ids::{ModelName, NodeId, WorkerId};
use crate::messages::WorkerRole;
use serde::{Deserialize, Serialize};

/// Upper edges (ms) of the latency histograms' buckets (log-spaced).
pub const LATENCY_BUCKETS_MS: [u32; 22] = [
    1, 2, 5, 10, 15, 20, 30, 50, 75, 100, 150, 200, 300, 500, 750, 1_000, 1_500, 2_000, 3_000,
    5_000, 10_000, 30_000,
];
/// Most targets, decisions or numbers in one planner record.
pub const MAX_PLANNER_ITEMS: usize = 64;
/// Decisions a planner's status keeps (the newest).
pub const MAX_DECISIONS: usize = 32;
/// Largest stored planner memory (JSON bytes).
pub const MAX_MEMORY_JSON: usize = 256 * 1024;

macro_rules! wire {
    ($ty:ident = $kind:literal) => {
        impl WireMessage for $ty {
            const KIND: MessageKind = MessageKind($kind);
            const NAME: &'static str = stringify!($ty);
        }
    };
}

/// Index of the histogram bucket a latency falls in.
pub fn latency_bucket(ms: f64) -> usize {
    LATENCY_BUCKETS_MS
        .iter()
        .position(|&edge| ms <= edge as f64)
        .unwrap_or(LATENCY_BUCKETS_MS.len())
}

/// The value below which `q` (0–1) of a histogram's samples fall,
/// interpolated linearly inside the bucket that reaches it (the overflow
/// bucket counts as ending at twice the last edge). None: no samples.
pub fn latency_quantile(counts: &[u32], q: f64) -> Option<f64> {
    let total: u64 = counts.iter().map(|&c| c as u64).sum();
    if total == 0 {
        return None;
    }
    let last = *LATENCY_BUCKETS_MS.last().unwrap_or(&1) as f64;
    let want = q.clamp(0.0, 1.0) * total as f64;
    let mut seen = 0u64;
    for (i, &c) in counts.iter().enumerate() {
        if c == 0 {
            continue;
        }
        let before = seen;
        seen += c as u64;
        if seen as f64 >= want {
            let lo = if i == 0 {
                0.0
            } else {
                LATENCY_BUCKETS_MS
                    .get(i - 1)
                    .map(|&e| e as f64)
                    .unwrap_or(last)
            };
            let hi = LATENCY_BUCKETS_MS
                .get(i)
                .map(|&e| e as f64)
                .unwrap_or(2.0 * last);
            let frac = ((want - before as f64) / c as f64).clamp(0.0, 1.0);
            return Some(lo + (hi - lo) * frac);
        }
    }
    None
}

/// Gateway → `Subjects::frontend_metrics`: one interval of one model's
/// traffic at one gateway.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FrontendMetrics {
    /// The gateway's process (any stable id: its node and listen address).
    pub gateway: String,
    pub model: ModelName,
    pub unix_ms: u64,
    pub interval_ms: u32,
    /// Requests admitted in the interval (each counted once).
    pub arrivals: u32,
    /// Requests that ended in the interval, and of those, failed.
    pub finished: u32,
    pub failed: u32,
    /// Requests whose prompt was tokenized, and its tokens summed (the
    /// ISL is `isl_sum / prompts`); output tokens of the finished.
    pub prompts: u32,
    pub isl_sum: u64,
    pub osl_sum: u64,
    /// Time to first token of requests that got one (ms histogram).
    pub ttft: Vec<u32>,
    /// Each finished request's mean inter-token latency (ms histogram).
    pub itl: Vec<u32>,
    /// Time waited for admission, summed (ms), over `arrivals`.
    pub queue_ms_sum: u64,
    /// Requests waiting for admission now.
    pub queued_now: u32,
    /// Requests held now because no worker serves the model at all.
    pub held_now: u32,
    /// Requests being served now (all models of the gateway).
    pub inflight_now: u32,
    /// This model's streams open now, and the output tokens they have
    /// streamed so far: each is a lower bound on its stream's final length,
    /// which the planner needs before long requests finish.
    pub streams_now: u32,
    pub stream_tokens_now: u64,
}
wire!(FrontendMetrics = 110);

/// Worker → `Subjects::worker_metrics`: one interval of one worker's load
/// and timings, measured by the worker around its engine.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkerMetrics {
    pub worker_id: WorkerId,
    pub generation: u64,
    pub role: WorkerRole,
    pub model: ModelName,
    pub unix_ms: u64,
    pub interval_ms: u32,
    pub active_seqs: u32,
    pub waiting_seqs: u32,
    pub kv_used_blocks: u32,
    pub kv_total_blocks: u32,
    /// Prompt tokens accepted and not yet prefilled.
    pub queued_prefill_tokens: u64,
    /// Requests that got their first token in the interval, the sum of
    /// their accept → first token times (µs), and their prompt tokens.
    pub first_tokens: u32,
    pub ttft_us_sum: u64,
    pub prompt_tokens: u64,
    /// Output token gaps in the interval and their sum (µs).
    pub token_gaps: u32,
    pub itl_us_sum: u64,
}
wire!(WorkerMetrics = 111);

/// One decision of a planner.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlannerDecision {
    /// Grows by one per decision of the deployment's planners.
    pub seq: u64,
    pub unix_ms: u64,
    pub target: String,
    pub from: u32,
    pub to: u32,
    /// `sla`, `burst`, `shrink`, `wake`, `idle`, `budget`, `limits`, `load_rule`.
    pub rule: String,
    pub reason: String,
    /// Whether the desired state took it (false: why not is in `reason`).
    pub applied: bool,
}

/// A target's latest recommendation with the numbers behind it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlannerTarget {
    pub name: String,
    pub desired: u32,
    pub ready: u32,
    pub recommended: u32,
    pub pinned: bool,
    pub reason: String,
    pub numbers: Vec<(String, f64)>,
}

/// What a deployment's active planner reports (planner bucket, key
/// `status.<deployment>`), with the memory a successor adopts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlannerStatus {
    pub deployment: String,
    pub holder: NodeId,
    pub epoch: u64,
    /// `sla` or `load`.
    pub policy: String,
    pub updated_unix_ms: u64,
    pub targets: Vec<PlannerTarget>,
    pub decisions: Vec<PlannerDecision>,
    /// The planner's memory (predictors, learned capacity, per-target
    /// history) as JSON, for the next holder of the lease.
    pub memory_json: String,
}
wire!(PlannerStatus = 112);

/// A manual scale's pin (pins bucket, key `<deployment>.<target>`): the
/// planner leaves the target at what the operator set until released.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlannerPin {
    pub deployment: String,
    pub target: String,
    pub replicas: u32,
    pub unix_ms: u64,
}
wire!(PlannerPin = 113);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_bucket_and_quantile() {
        let mut h = vec![0u32; LATENCY_BUCKETS_MS.len() + 1];
        for ms in [0.5, 3.0, 40.0, 40.0, 45.0, 400.0, 99_999.0] {
            h[latency_bucket(ms)] += 1;
        }
        assert_eq!(h[0], 1);
        assert_eq!(h[LATENCY_BUCKETS_MS.len()], 1);
        // 7 samples: the 3.5th is in (30, 50] (three there, the 2nd of them).
        let median = latency_quantile(&h, 0.5).unwrap();
        assert!(median > 30.0 && median <= 50.0, "{median}");
        let p80 = latency_quantile(&h, 0.8).unwrap();
        assert!(p80 > 300.0 && p80 <= 500.0, "{p80}");
        assert_eq!(latency_quantile(&h, 1.0), Some(60_000.0));
        assert_eq!(latency_quantile(&[0; 3], 0.5), None);
    }
}
