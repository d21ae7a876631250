//! Traffic summaries for the planner: per model, what arrived, how long the
//! first token and each token took, and what waits now; published once
//! per interval as [`FrontendMetrics`] (never a message per request).
//!
//! Invariants: a request is counted once as an arrival (when admitted) and
//! once as finished (when its stream ends); a stream's [`Live`] share is
//! added when it opens and taken back, whole, when it ends, so the gauges
//! are the open streams and what they have streamed so far; the models
//! tracked are bounded by [`MAX_MODELS`] (past it a new model's traffic is
//! dropped and counted).

use dynamo_bus_schema::{latency_bucket, FrontendMetrics, ModelName, LATENCY_BUCKETS_MS};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Most models one gateway summarises.
pub const MAX_MODELS: usize = 256;

#[derive(Default)]
struct Acc {
    arrivals: u32,
    finished: u32,
    failed: u32,
    prompts: u32,
    isl_sum: u64,
    osl_sum: u64,
    ttft: Vec<u32>,
    itl: Vec<u32>,
    queue_ms_sum: u64,
    /// Gauges, kept across intervals.
    live: Arc<Live>,
}

/// A model's open streams and the output tokens they have streamed so far.
#[derive(Default)]
pub struct Live {
    streams: AtomicU32,
    tokens: AtomicU64,
}

/// One open stream's share of its model's [`Live`] gauges, taken back
/// when dropped.
pub struct StreamGauge {
    live: Arc<Live>,
    tokens: u64,
}

impl StreamGauge {
    /// The stream sent `n` more output tokens.
    pub fn tokens(&mut self, n: u32) {
        self.tokens = self.tokens.saturating_add(n as u64);
        self.live.tokens.fetch_add(n as u64, Ordering::Relaxed);
    }
}

impl Drop for StreamGauge {
    fn drop(&mut self) {
        self.live.streams.fetch_sub(1, Ordering::Relaxed);
        self.live.tokens.fetch_sub(self.tokens, Ordering::Relaxed);
    }
}

fn hist() -> Vec<u32> {
    vec![0; LATENCY_BUCKETS_MS.len() + 1]
}

/// The gateway's running summary (shared by its request tasks).
#[derive(Default)]
pub struct Feed {
    models: Mutex<HashMap<String, Acc>>,
    /// Requests held now for lack of any worker.
    pub held: AtomicU32,
    /// Traffic of models past [`MAX_MODELS`], dropped.
    pub dropped: AtomicU64,
}

/// How one request ended, for the summary.
pub struct Ended<'a> {
    pub model: &'a str,
    pub ttft_ms: Option<f64>,
    /// Mean gap between its output tokens.
    pub itl_ms: Option<f64>,
    pub output_tokens: u32,
    pub failed: bool,
}

impl Feed {
    fn with(&self, model: &str, f: impl FnOnce(&mut Acc)) {
        let Ok(mut m) = self.models.lock() else {
            return;
        };
        if !m.contains_key(model) && m.len() >= MAX_MODELS {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let a = m.entry(model.to_string()).or_insert_with(|| Acc {
            ttft: hist(),
            itl: hist(),
            ..Acc::default()
        });
        f(a);
    }

    /// A request for `model` arrived (before it waits for anything, so a
    /// request held for a worker is seen at once).
    pub fn arrived(&self, model: &str) {
        self.with(model, |a| a.arrivals = a.arrivals.saturating_add(1));
    }

    /// A stream for `model` opens; its gauge counts it until dropped
    /// (`None` for a model past [`MAX_MODELS`]).
    pub fn stream(&self, model: &str) -> Option<StreamGauge> {
        let mut live = None;
        self.with(model, |a| live = Some(a.live.clone()));
        let live = live?;
        live.streams.fetch_add(1, Ordering::Relaxed);
        Some(StreamGauge { live, tokens: 0 })
    }

    /// It waited this long for admission.
    pub fn admitted(&self, model: &str, queue_ms: u64) {
        self.with(model, |a| {
            a.queue_ms_sum = a.queue_ms_sum.saturating_add(queue_ms)
        });
    }

    /// Its prompt has this many tokens.
    pub fn prompt(&self, model: &str, tokens: usize) {
        self.with(model, |a| {
            a.prompts = a.prompts.saturating_add(1);
            a.isl_sum = a.isl_sum.saturating_add(tokens as u64);
        });
    }

    /// A request's stream ended.
    pub fn ended(&self, e: Ended<'_>) {
        self.with(e.model, |a| {
            a.finished = a.finished.saturating_add(1);
            if e.failed {
                a.failed = a.failed.saturating_add(1);
            }
            a.osl_sum = a.osl_sum.saturating_add(e.output_tokens as u64);
            if let Some(t) = e.ttft_ms {
                a.ttft[latency_bucket(t)] += 1;
            }
            if let Some(t) = e.itl_ms {
                a.itl[latency_bucket(t)] += 1;
            }
        });
    }

    /// The interval's summaries (and a fresh start). A model is reported
    /// while it has traffic, and once more after it stops.
    pub fn take(
        &self,
        gateway: &str,
        unix_ms: u64,
        interval_ms: u32,
        queued: &dyn Fn(&str) -> u32,
        inflight: u32,
    ) -> Vec<FrontendMetrics> {
        let Ok(mut m) = self.models.lock() else {
            return Vec::new();
        };
        let held = self.held.load(Ordering::Relaxed);
        let mut out = Vec::new();
        m.retain(|model, a| {
            let q = queued(model);
            let streams = a.live.streams.load(Ordering::Relaxed);
            let idle = a.arrivals == 0 && a.finished == 0 && q == 0 && streams == 0;
            out.push(FrontendMetrics {
                gateway: gateway.to_string(),
                model: ModelName(model.clone()),
                unix_ms,
                interval_ms,
                arrivals: a.arrivals,
                finished: a.finished,
                failed: a.failed,
                prompts: a.prompts,
                isl_sum: a.isl_sum,
                osl_sum: a.osl_sum,
                ttft: std::mem::replace(&mut a.ttft, hist()),
                itl: std::mem::replace(&mut a.itl, hist()),
                queue_ms_sum: a.queue_ms_sum,
                queued_now: q,
                held_now: held,
                inflight_now: inflight,
                streams_now: streams,
                stream_tokens_now: a.live.tokens.load(Ordering::Relaxed),
            });
            *a = Acc {
                ttft: hist(),
                itl: hist(),
                live: a.live.clone(),
                ..Acc::default()
            };
            // An idle model is reported once (zeros), then forgotten until
            // it has traffic again.
            !idle
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_interval_sums_its_requests_and_then_starts_afresh() {
        let f = Feed::default();
        for (tokens, queue) in [(100, 3), (50, 0)] {
            f.arrived("m");
            f.admitted("m", queue);
            f.prompt("m", tokens);
        }
        f.ended(Ended {
            model: "m",
            ttft_ms: Some(40.0),
            itl_ms: Some(8.0),
            output_tokens: 10,
            failed: false,
        });
        f.ended(Ended {
            model: "m",
            ttft_ms: None,
            itl_ms: None,
            output_tokens: 0,
            failed: true,
        });
        let out = f.take("g", 1, 1000, &|_| 2, 1);
        assert_eq!(out.len(), 1);
        let m = &out[0];
        assert_eq!((m.arrivals, m.finished, m.failed), (2, 2, 1));
        assert_eq!(
            (m.prompts, m.isl_sum, m.osl_sum, m.queue_ms_sum),
            (2, 150, 10, 3)
        );
        assert_eq!(m.ttft.iter().sum::<u32>(), 1);
        assert_eq!(m.ttft[latency_bucket(40.0)], 1);
        assert_eq!(m.queued_now, 2);
        // Next interval: zeros once, then nothing.
        let again = f.take("g", 2, 1000, &|_| 0, 0);
        assert_eq!(again[0].arrivals, 0);
        assert!(f.take("g", 3, 1000, &|_| 0, 0).is_empty());
    }

    #[test]
    fn open_streams_and_their_tokens_are_gauges_kept_until_the_streams_end() {
        let f = Feed::default();
        let mut a = f.stream("m").unwrap();
        let mut b = f.stream("m").unwrap();
        a.tokens(5);
        b.tokens(2);
        a.tokens(3);
        let m = &f.take("g", 1, 1000, &|_| 0, 2)[0];
        assert_eq!((m.streams_now, m.stream_tokens_now), (2, 10));
        // A model with nothing but a long stream open is still reported.
        drop(b);
        let m = &f.take("g", 2, 1000, &|_| 0, 1)[0];
        assert_eq!((m.arrivals, m.streams_now, m.stream_tokens_now), (0, 1, 8));
        drop(a);
        let m = &f.take("g", 3, 1000, &|_| 0, 0)[0];
        assert_eq!((m.streams_now, m.stream_tokens_now), (0, 0));
        assert!(f.take("g", 4, 1000, &|_| 0, 0).is_empty());
    }
}
