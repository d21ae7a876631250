//! The planner's reactive rules: the burst rule (queues and KV the
//! prediction did not see) and Dynamo's load rule (the baseline policy).
//!
//! Both read one window and return a recommendation; neither changes the
//! planner's memory. Invariant: a recommendation is 0 ("nothing to ask
//! for") or the replicas that would meet the SLA for what the window shows.

use crate::policy::{
    ceil_u32, Phase, PlannerState, Target, TargetCapacity, TargetKind, Window, WorkerSample,
};
use std::collections::BTreeMap;

impl PlannerState {
    /// Replicas the queues ask for now (0 when they ask for nothing), with
    /// each replica filled to `headroom` of its limit: 1 for growth, and
    /// `DOWN_UTILISATION` for what a shrink must leave, so a target shrunk
    /// under a lasting queue is not one the same queue grows back.
    pub(crate) fn burst(
        &self,
        t: &Target,
        w: &Window,
        cap: &TargetCapacity,
        isl: f64,
        headroom: f64,
    ) -> (u32, String) {
        let mine: Vec<&WorkerSample> = w.workers.iter().filter(|s| s.target == t.name).collect();
        let (pf, dc, per_group) = match t.kind {
            TargetKind::Prefill => (true, false, (1, 0)),
            TargetKind::Decode => (false, true, (0, 1)),
            TargetKind::Aggregated => (true, true, (1, 1)),
            TargetKind::Group {
                prefill,
                decode,
                aggregated,
            } => (
                prefill + aggregated > 0,
                decode + aggregated > 0,
                (prefill + aggregated, decode + aggregated),
            ),
        };
        let mut best = (0, String::new());
        let ttft = self.ttft_ms();
        if pf && per_group.0 > 0 {
            let queued: u64 = mine
                .iter()
                .filter(|s| matches!(s.phase, Some(Phase::Prefill) | Some(Phase::Aggregated)))
                .map(|s| s.queued_prefill_tokens)
                .fold(0u64, u64::saturating_add)
                .saturating_add((w.queued as f64 * isl) as u64);
            // The learned cost of a prefill (per token and per batch).
            let factor = cap.prefill.service_ms / t.timing.prefill(isl.max(1.0));
            let batch = t.timing.max_batch_tokens.max(1.0);
            let drain_ms = |q: f64| {
                if q <= 0.0 {
                    return 0.0;
                }
                (q / batch).ceil() * t.timing.prefill(q.min(batch)) * factor
            };
            // A new arrival waits for the queue ahead of it, then its own.
            let budget = (ttft - cap.prefill.service_ms) * headroom;
            let q = queued as f64;
            if queued > 0 && budget > 0.0 && drain_ms(q / t.desired.max(1) as f64) > budget {
                let mut n = t.desired.max(1);
                while n < 4096 && drain_ms(q / n as f64) > budget {
                    n += 1;
                }
                let n = n.div_ceil(per_group.0);
                if n > best.0 {
                    best = (
                        n,
                        format!(
                            "{queued} prompt tokens queued: {n} replicas prefill them within TTFT {ttft:.0} ms ({:.0} ms for a {batch:.0}-token batch)",
                            t.timing.prefill(batch) * factor
                        ),
                    );
                }
            }
        }
        if dc && per_group.1 > 0 {
            let seqs: u32 = mine
                .iter()
                .filter(|s| matches!(s.phase, Some(Phase::Decode) | Some(Phase::Aggregated)))
                .map(|s| s.active.saturating_add(s.waiting))
                .fold(0u32, u32::saturating_add);
            let per = (cap.decode_seqs * headroom).max(1.0);
            let n = ceil_u32(seqs as f64 / per).div_ceil(per_group.1);
            if n > best.0 && seqs > 0 {
                best = (
                    n,
                    format!(
                        "{seqs} sequences decoding or waiting: {n} replicas keep ITL within {:.0} ms ({per:.0} sequences each)",
                        self.itl_ms()
                    ),
                );
            }
            // The KV the sequences hold now, which is what a step's time
            // follows: it needs no estimate of their lengths (output
            // lengths seen early are those of the short requests, which
            // finish first). It is a realised occupancy, so it is compared
            // with the limit u* where a step meets ITL, not with the mean
            // sizing plans for (whose 90th percentile is u*).
            let held: f64 = mine
                .iter()
                .filter(|s| matches!(s.phase, Some(Phase::Decode) | Some(Phase::Aggregated)))
                .map(|s| s.kv_util.clamp(0.0, 1.0))
                .sum();
            // A sequence is never split across replicas: more replicas
            // than sequences hold no less KV each (one long sequence over
            // the limit is not a fleet too small, and a replica added for
            // it would sit idle).
            let limit = cap.decode_util * headroom;
            let n = ceil_u32(held / limit - 1e-9)
                .min(seqs.max(1))
                .div_ceil(per_group.1);
            if n > best.0 && held > 0.0 {
                best = (
                    n,
                    format!(
                        "KV held by decoding sequences adds up to {:.0}% of a replica: {n} replicas hold it within the {:.0}% where a step meets ITL {:.0} ms",
                        held * 100.0,
                        limit * 100.0,
                        self.itl_ms()
                    ),
                );
            }
        }
        best
    }

    /// Dynamo's load rule (the baseline): +1 when every engine is over its
    /// target, −1 when every engine is under 80% of it.
    pub(crate) fn load_rule(
        &self,
        t: &Target,
        w: &Window,
    ) -> (u32, String, String, BTreeMap<String, f64>) {
        let (ttft, itl) = (self.ttft_ms(), self.itl_ms());
        let mine: Vec<&WorkerSample> = w.workers.iter().filter(|s| s.target == t.name).collect();
        let mut nums = BTreeMap::new();
        nums.insert("engines".into(), mine.len() as f64);
        // An engine's load against its target: the worse of its phases
        // (None: it measured nothing in the period, so it says nothing).
        let ratio = |s: &WorkerSample| -> Option<f64> {
            let p = s.ttft_ms.map(|x| x / ttft);
            let d = s.itl_ms.map(|x| x / itl);
            match s.phase {
                Some(Phase::Prefill) => p,
                Some(Phase::Decode) => d,
                _ => match (p, d) {
                    (Some(a), Some(b)) => Some(a.max(b)),
                    (a, b) => a.or(b),
                },
            }
        };
        if mine.is_empty() {
            return (t.desired, "hold".into(), "no engine reports".into(), nums);
        }
        let ratios: Vec<f64> = mine.iter().filter_map(|s| ratio(s)).collect();
        if ratios.is_empty() {
            return (
                t.desired,
                "hold".into(),
                "no engine measured anything in the period".into(),
                nums,
            );
        }
        let max = ratios.iter().cloned().fold(0.0, f64::max);
        let min = ratios.iter().cloned().fold(f64::INFINITY, f64::min);
        nums.insert("highest_load".into(), max);
        nums.insert("lowest_load".into(), min);
        if min > 1.0 {
            (
                t.desired + 1,
                "load_rule".into(),
                format!(
                    "every engine over its target (lowest at {:.0}%)",
                    min * 100.0
                ),
                nums,
            )
        } else if max < 0.8 && t.desired > 1 {
            (
                t.desired - 1,
                "load_rule".into(),
                format!(
                    "every engine under 80% of its target (highest at {:.0}%)",
                    max * 100.0
                ),
                nums,
            )
        } else {
            (t.desired, "hold".into(), "within the band".into(), nums)
        }
    }
}
