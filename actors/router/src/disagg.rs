//! Conditional disaggregation: whether a request's prefill runs on a
//! prefill worker, and on which one.
//!
//! Invariants: a remote prefill is chosen only when the decode worker would
//! compute at least `min_remote_prefill_tokens` uncached prompt tokens and
//! some prefill worker has fewer than `max_prefill_queue` requests waiting
//! (counting what this router sent it since its last load report); among
//! those, the one holding the longest prefix of the prompt wins, then the
//! one with the fewest prompts ahead (running, waiting, and sent since its
//! report), then the lowest id.
//!
//! A worker's report lags the router's decisions (it is sent when its load
//! changes, at most every load interval), so the prompts this router sent
//! since the last report count too: without them every request of a burst
//! would go to the same worker until it reported.

use dynamo_bus_schema::{LoadMetrics, WorkerId};

/// When prefill moves to a prefill worker.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DisaggPolicy {
    /// Uncached prompt tokens below which the decode worker prefills itself
    /// (a short prefill costs less than a transfer).
    pub min_remote_prefill_tokens: u64,
    /// A prefill worker with this many requests waiting is saturated and
    /// skipped (the decode worker then prefills locally).
    pub max_prefill_queue: u32,
}

impl Default for DisaggPolicy {
    fn default() -> Self {
        DisaggPolicy {
            min_remote_prefill_tokens: 256,
            max_prefill_queue: 8,
        }
    }
}

/// A prefill worker the router could pick.
#[derive(Clone, Debug)]
pub struct PrefillCandidate {
    pub worker_id: WorkerId,
    /// Leading prompt blocks it holds.
    pub overlap_blocks: u32,
    pub reported: LoadMetrics,
    /// Prompts this router sent it since its last load report.
    pub assigned: u32,
}

impl PrefillCandidate {
    fn waiting(&self) -> u32 {
        self.reported.waiting_seqs.saturating_add(self.assigned)
    }

    /// Prompts ahead of a new one: the engine's running and waiting
    /// sequences (or the worker's in-flight requests, when larger), and
    /// what was sent since.
    fn ahead(&self) -> u32 {
        let r = &self.reported;
        r.active_seqs
            .saturating_add(r.waiting_seqs)
            .max(r.inflight_requests)
            .saturating_add(self.assigned)
    }
}

impl DisaggPolicy {
    /// The prefill worker for a request whose decode worker would compute
    /// `uncached_tokens` of its prompt, or `None` to prefill locally.
    pub fn pick(&self, uncached_tokens: u64, candidates: &[PrefillCandidate]) -> Option<WorkerId> {
        if uncached_tokens < self.min_remote_prefill_tokens {
            return None;
        }
        candidates
            .iter()
            .filter(|c| c.waiting() < self.max_prefill_queue)
            .min_by_key(|c| (std::cmp::Reverse(c.overlap_blocks), c.ahead(), c.worker_id))
            .map(|c| c.worker_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(id: u64, overlap: u32, waiting: u32, inflight: u32) -> PrefillCandidate {
        PrefillCandidate {
            worker_id: WorkerId(id),
            overlap_blocks: overlap,
            reported: LoadMetrics {
                waiting_seqs: waiting,
                inflight_requests: inflight,
                ..LoadMetrics::default()
            },
            assigned: 0,
        }
    }

    #[test]
    fn short_prompts_and_saturated_prefill_workers_stay_local() {
        let p = DisaggPolicy::default();
        let c = [cand(1, 0, 0, 0)];
        assert_eq!(p.pick(100, &c), None);
        assert_eq!(p.pick(256, &c), Some(WorkerId(1)));
        assert_eq!(p.pick(5000, &[cand(1, 0, 8, 8)]), None);
        assert_eq!(p.pick(5000, &[]), None);
    }

    #[test]
    fn overlap_then_load_then_id_decide() {
        let p = DisaggPolicy::default();
        let c = [cand(3, 0, 0, 0), cand(2, 4, 1, 5), cand(1, 4, 0, 5)];
        assert_eq!(p.pick(1000, &c), Some(WorkerId(1)));
        let c = [cand(3, 0, 0, 0), cand(2, 0, 1, 5)];
        assert_eq!(p.pick(1000, &c), Some(WorkerId(3)));
        // Running sequences count when the worker reports no requests.
        let mut busy = cand(1, 0, 0, 0);
        busy.reported.active_seqs = 2;
        assert_eq!(p.pick(1000, &[busy, cand(2, 0, 0, 0)]), Some(WorkerId(2)));
    }

    #[test]
    fn what_was_sent_since_the_report_counts() {
        let p = DisaggPolicy::default();
        let mut sent = cand(1, 0, 0, 0);
        sent.assigned = 1;
        assert_eq!(
            p.pick(1000, &[sent.clone(), cand(2, 0, 0, 0)]),
            Some(WorkerId(2))
        );
        // A worker sent a full queue since its report is saturated.
        sent.assigned = 8;
        assert_eq!(p.pick(1000, &[sent]), None);
    }
}
