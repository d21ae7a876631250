//! The metrics a planner has heard on the bus, summed into windows: a fast
//! one (since the last evaluation) and a slow one (since the last sizing).
//! Plain logic: the actor's subscription task feeds it, tests drive it.
//!
//! Invariants: every report counts once in each window; gauges (queues,
//! in-flight) are the latest report of each gateway or worker still fresh
//! (younger than [`STALE_MS`]); at most [`MAX_SOURCES`] gateways and
//! workers are tracked (past it, new ones are dropped and counted).

use dynamo_bus_schema::{
    latency_quantile, FrontendMetrics, WorkerId, WorkerMetrics, LATENCY_BUCKETS_MS,
};
use dynamo_planner::{Phase, Window, WorkerSample};
use std::collections::{BTreeSet, HashMap};

/// A source that has not reported for this long no longer counts.
pub const STALE_MS: u64 = 5_000;
/// Most gateways, and most workers, tracked.
pub const MAX_SOURCES: usize = 4096;

#[derive(Clone, Default)]
struct Sums {
    arrivals: u64,
    prompts: u64,
    finished: u64,
    isl_sum: u64,
    osl_sum: u64,
    ttft: Vec<u32>,
    itl: Vec<u32>,
}

impl Sums {
    fn add(&mut self, m: &FrontendMetrics) {
        self.arrivals = self.arrivals.saturating_add(m.arrivals as u64);
        self.prompts = self.prompts.saturating_add(m.prompts as u64);
        self.finished = self.finished.saturating_add(m.finished as u64);
        self.isl_sum = self.isl_sum.saturating_add(m.isl_sum);
        self.osl_sum = self.osl_sum.saturating_add(m.osl_sum);
        for (dst, src) in [(&mut self.ttft, &m.ttft), (&mut self.itl, &m.itl)] {
            if src.len() == LATENCY_BUCKETS_MS.len() + 1 {
                dst.resize(src.len(), 0);
                for (d, s) in dst.iter_mut().zip(src) {
                    *d = d.saturating_add(*s);
                }
            }
        }
    }
}

#[derive(Clone, Default)]
struct WorkerSums {
    first_tokens: u64,
    ttft_us: u64,
    prompt_tokens: u64,
    gaps: u64,
    itl_us: u64,
}

struct Worker {
    last: WorkerMetrics,
    windows: u32,
    fast: WorkerSums,
    slow: WorkerSums,
}

struct Gateway {
    unix_ms: u64,
    queued: u32,
    held: u32,
    inflight: u32,
    streams: u32,
    stream_tokens: u64,
}

/// What a planner has heard.
pub struct MetricsFeed {
    /// Models the deployment serves (empty: any).
    pub models: BTreeSet<String>,
    fast: Sums,
    slow: Sums,
    fast_since_ms: u64,
    slow_since_ms: u64,
    gateways: HashMap<String, Gateway>,
    workers: HashMap<WorkerId, Worker>,
    /// Reports dropped for the bounds.
    pub dropped: u64,
}

impl MetricsFeed {
    pub fn new(now_ms: u64) -> Self {
        MetricsFeed {
            models: BTreeSet::new(),
            fast: Sums::default(),
            slow: Sums::default(),
            fast_since_ms: now_ms,
            slow_since_ms: now_ms,
            gateways: HashMap::new(),
            workers: HashMap::new(),
            dropped: 0,
        }
    }

    fn wanted(&self, model: &str) -> bool {
        self.models.is_empty() || self.models.contains(model)
    }

    /// A gateway's report, heard at `now_ms` (this planner's clock).
    pub fn frontend(&mut self, m: &FrontendMetrics, now_ms: u64) {
        if !self.wanted(&m.model.0) {
            return;
        }
        let key = format!("{}/{}", m.gateway, m.model.0);
        if !self.gateways.contains_key(&key) && self.gateways.len() >= MAX_SOURCES {
            self.dropped += 1;
            return;
        }
        self.fast.add(m);
        self.slow.add(m);
        self.gateways.insert(
            key,
            Gateway {
                unix_ms: now_ms,
                queued: m.queued_now,
                held: m.held_now,
                inflight: m.inflight_now,
                streams: m.streams_now,
                stream_tokens: m.stream_tokens_now,
            },
        );
    }

    /// A worker's report, heard at `now_ms` (this planner's clock).
    pub fn worker(&mut self, m: &WorkerMetrics, now_ms: u64) {
        if !self.wanted(&m.model.0) {
            return;
        }
        if !self.workers.contains_key(&m.worker_id) && self.workers.len() >= MAX_SOURCES {
            self.dropped += 1;
            return;
        }
        let w = self.workers.entry(m.worker_id).or_insert_with(|| Worker {
            last: m.clone(),
            windows: 0,
            fast: WorkerSums::default(),
            slow: WorkerSums::default(),
        });
        if w.last.generation != m.generation {
            // A restarted worker is cold again.
            w.windows = 0;
        }
        w.windows = w.windows.saturating_add(1);
        for s in [&mut w.fast, &mut w.slow] {
            s.first_tokens = s.first_tokens.saturating_add(m.first_tokens as u64);
            s.ttft_us = s.ttft_us.saturating_add(m.ttft_us_sum);
            s.prompt_tokens = s.prompt_tokens.saturating_add(m.prompt_tokens);
            s.gaps = s.gaps.saturating_add(m.token_gaps as u64);
            s.itl_us = s.itl_us.saturating_add(m.itl_us_sum);
        }
        w.last = m.clone();
        // Freshness by this planner's clock, not the sender's.
        w.last.unix_ms = now_ms;
    }

    /// The fast window (since the last call) and, with `slow`, the slow one
    /// too; `place` maps a worker to its target and phase (None: not this
    /// deployment's).
    pub fn take(
        &mut self,
        now_ms: u64,
        slow: bool,
        place: &dyn Fn(WorkerId) -> Option<(String, Phase)>,
    ) -> (Window, Option<Window>) {
        self.gateways
            .retain(|_, g| now_ms.saturating_sub(g.unix_ms) <= STALE_MS);
        self.workers
            .retain(|_, w| now_ms.saturating_sub(w.last.unix_ms) <= STALE_MS);
        let (mut queued, mut held, mut inflight) = (0u32, 0u32, 0u32);
        let (mut streams, mut stream_tokens) = (0u64, 0u64);
        for g in self.gateways.values() {
            queued = queued.saturating_add(g.queued);
            held = held.saturating_add(g.held);
            inflight = inflight.saturating_add(g.inflight);
            streams = streams.saturating_add(g.streams as u64);
            stream_tokens = stream_tokens.saturating_add(g.stream_tokens);
        }
        let workers = |fast: bool, ws: &mut HashMap<WorkerId, Worker>| -> Vec<WorkerSample> {
            let mut out = Vec::new();
            for (id, w) in ws.iter_mut() {
                let sums = if fast {
                    std::mem::take(&mut w.fast)
                } else {
                    std::mem::take(&mut w.slow)
                };
                let Some((target, phase)) = place(*id) else {
                    continue;
                };
                let l = &w.last;
                out.push(WorkerSample {
                    target,
                    phase: Some(phase),
                    windows: w.windows,
                    active: l.active_seqs,
                    waiting: l.waiting_seqs,
                    kv_util: if l.kv_total_blocks > 0 {
                        l.kv_used_blocks as f64 / l.kv_total_blocks as f64
                    } else {
                        0.0
                    },
                    queued_prefill_tokens: l.queued_prefill_tokens,
                    ttft_ms: (sums.first_tokens > 0)
                        .then(|| sums.ttft_us as f64 / 1000.0 / sums.first_tokens as f64),
                    itl_ms: (sums.gaps > 0).then(|| sums.itl_us as f64 / 1000.0 / sums.gaps as f64),
                    isl: (sums.first_tokens > 0)
                        .then(|| sums.prompt_tokens as f64 / sums.first_tokens as f64),
                });
            }
            out.sort_by(|a, b| a.target.cmp(&b.target));
            out
        };
        let window = |s: &Sums, since: u64, ws: Vec<WorkerSample>| Window {
            now_ms,
            secs: now_ms.saturating_sub(since) as f64 / 1000.0,
            arrivals: s.arrivals,
            prompts: s.prompts,
            isl_mean: (s.prompts > 0).then(|| s.isl_sum as f64 / s.prompts as f64),
            finished: s.finished,
            osl_mean: (s.finished > 0).then(|| s.osl_sum as f64 / s.finished as f64),
            ttft_p90_ms: latency_quantile(&s.ttft, 0.9),
            itl_p50_ms: latency_quantile(&s.itl, 0.5),
            queued,
            held,
            inflight,
            streams,
            stream_tokens,
            workers: ws,
        };
        let fw = workers(true, &mut self.workers);
        let fast = window(&std::mem::take(&mut self.fast), self.fast_since_ms, fw);
        self.fast_since_ms = now_ms;
        let slow = slow.then(|| {
            let sw = workers(false, &mut self.workers);
            let w = window(&std::mem::take(&mut self.slow), self.slow_since_ms, sw);
            self.slow_since_ms = now_ms;
            w
        });
        (fast, slow)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dynamo_bus_schema::{latency_bucket, ModelName, WorkerRole};

    fn fm(gateway: &str, at: u64, arrivals: u32, ttft_ms: f64) -> FrontendMetrics {
        let mut ttft = vec![0; LATENCY_BUCKETS_MS.len() + 1];
        ttft[latency_bucket(ttft_ms)] = arrivals;
        FrontendMetrics {
            gateway: gateway.into(),
            model: ModelName("m".into()),
            unix_ms: at,
            interval_ms: 1000,
            arrivals,
            finished: arrivals,
            failed: 0,
            prompts: arrivals,
            isl_sum: 100 * arrivals as u64,
            osl_sum: 10 * arrivals as u64,
            ttft,
            itl: vec![],
            queue_ms_sum: 0,
            queued_now: 2,
            held_now: 0,
            inflight_now: 1,
            streams_now: 3,
            stream_tokens_now: 60,
        }
    }

    fn wm(id: u64, at: u64, generation: u64) -> WorkerMetrics {
        WorkerMetrics {
            worker_id: WorkerId(id),
            generation,
            role: WorkerRole::Decode,
            model: ModelName("m".into()),
            unix_ms: at,
            interval_ms: 1000,
            active_seqs: 3,
            waiting_seqs: 0,
            kv_used_blocks: 25,
            kv_total_blocks: 100,
            queued_prefill_tokens: 0,
            first_tokens: 1,
            ttft_us_sum: 40_000,
            prompt_tokens: 100,
            token_gaps: 10,
            itl_us_sum: 100_000,
        }
    }

    #[test]
    fn windows_sum_reports_and_keep_the_latest_gauges() {
        let mut f = MetricsFeed::new(0);
        f.frontend(&fm("g1", 1000, 5, 40.0), 1000);
        f.frontend(&fm("g2", 1000, 5, 400.0), 1000);
        f.worker(&wm(1, 1000, 1), 1000);
        f.worker(&wm(9, 1000, 1), 1000);
        let place = |w: WorkerId| (w.0 == 1).then(|| ("decode".to_string(), Phase::Decode));
        let (fast, slow) = f.take(2000, false, &place);
        assert!(slow.is_none());
        assert_eq!(fast.arrivals, 10);
        assert_eq!(fast.secs, 2.0);
        assert_eq!(fast.isl_mean, Some(100.0));
        assert_eq!(fast.ttft_p90_ms, Some(460.0));
        assert_eq!((fast.queued, fast.inflight), (4, 2));
        assert_eq!((fast.streams, fast.stream_tokens), (6, 120));
        assert_eq!(fast.workers.len(), 1, "worker 9 is another deployment's");
        let w = &fast.workers[0];
        assert_eq!(
            (w.ttft_ms, w.itl_ms, w.kv_util),
            (Some(40.0), Some(10.0), 0.25)
        );
        // The slow window still has everything; the fast one starts over.
        f.frontend(&fm("g1", 2500, 1, 40.0), 2500);
        let (fast, slow) = f.take(3000, true, &place);
        assert_eq!(fast.arrivals, 1);
        assert_eq!(slow.unwrap().arrivals, 11);
        // Stale sources leave; a restarted worker is cold again.
        f.worker(&wm(1, 9000, 2), 9000);
        let (fast, _) = f.take(9500, false, &place);
        assert_eq!((fast.queued, fast.workers[0].windows), (0, 1));
    }

    #[test]
    fn other_models_are_ignored() {
        let mut f = MetricsFeed::new(0);
        f.models.insert("other".into());
        f.frontend(&fm("g1", 1000, 5, 40.0), 1000);
        assert_eq!(f.take(1500, false, &|_| None).0.arrivals, 0);
    }
}
