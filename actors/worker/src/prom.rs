//! The worker's Prometheus metrics, in the process-wide registry (rendered
//! by the node's metrics listener and by a co-located gateway's
//! `/metrics`), each labelled `{worker, model, role}`:
//! - `dynamo_worker_requests_total{…, outcome}`: `finished`, `cancelled`
//!   (its client left, a stop string, a migration, no gateway waiting),
//!   `failed`, `aborted` (the worker shut down under it);
//! - `dynamo_worker_time_to_first_token_seconds` (histogram, from the
//!   worker accepting the request) and
//!   `dynamo_worker_inter_token_latency_seconds` (histogram);
//! - `dynamo_worker_prompt_tokens_total`, `dynamo_worker_output_tokens_total`;
//! - `dynamo_worker_frames_total` and `dynamo_worker_frame_messages_total`:
//!   response frames sent, and the bus messages that carried them (frames
//!   of several requests share a message, [`crate::mux`]), and
//!   `dynamo_worker_frames_lost_total`: frames that could not be encoded
//!   or published;
//! - `dynamo_worker_orphans_cancelled_total`: requests cancelled because
//!   no gateway waited for them any more ([`crate::orphans`]);
//! - gauges from the engine's load: `dynamo_worker_active_seqs`,
//!   `…_waiting_seqs`, `…_kv_used_blocks`, `…_kv_total_blocks`,
//!   `…_inflight_requests`, `…_queued_prefill_tokens`.
//!
//! Invariant: a worker's series are removed when the last [`Series`] of
//! its labels is dropped (a restarted actor makes a new one before the old
//! one's tasks are gone: they share the series, counted), so a retired
//! worker leaves no stale gauge behind. Counting and creating, or counting
//! and removing, happen under one lock, so a new [`Series`] never sees its
//! series removed by an old one dropped at the same moment; both walk one
//! list of the series ([`each`]).

use dynamo_bus_schema::{LoadMetrics, WorkerRole};
use dynamo_runtime::metrics::{counter_vec, gauge_vec, register};
use prometheus::core::{Collector, MetricVec, MetricVecBuilder};
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

const LABELS: [&str; 3] = ["worker", "model", "role"];

struct M {
    requests: IntCounterVec,
    ttft: HistogramVec,
    itl: HistogramVec,
    prompt_tokens: IntCounterVec,
    output_tokens: IntCounterVec,
    frames: IntCounterVec,
    frame_messages: IntCounterVec,
    frames_lost: IntCounterVec,
    orphans: IntCounterVec,
    gauges: [IntGaugeVec; 6],
}

const GAUGES: [(&str, &str); 6] = [
    (
        "dynamo_worker_active_seqs",
        "Sequences the engine is running",
    ),
    (
        "dynamo_worker_waiting_seqs",
        "Sequences waiting in the engine",
    ),
    ("dynamo_worker_kv_used_blocks", "KV cache blocks in use"),
    (
        "dynamo_worker_kv_total_blocks",
        "KV cache blocks in the pool",
    ),
    (
        "dynamo_worker_inflight_requests",
        "Requests the worker is serving",
    ),
    (
        "dynamo_worker_queued_prefill_tokens",
        "Prompt tokens accepted and still waiting for their first token",
    ),
];

fn m() -> Option<&'static M> {
    static CELL: OnceLock<Option<M>> = OnceLock::new();
    CELL.get_or_init(|| {
        let counter = |name: &str, help: &str, extra: &[&str]| {
            let labels: Vec<&str> = LABELS.iter().chain(extra).copied().collect();
            counter_vec(name, help, &labels)
        };
        let hist = |name: &str, help: &str, buckets: Vec<f64>| {
            HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), &LABELS).ok()
        };
        let g = |i: usize| gauge_vec(GAUGES[i].0, GAUGES[i].1, &LABELS);
        let m = M {
            requests: counter(
                "dynamo_worker_requests_total",
                "Requests the worker served, by outcome",
                &["outcome"],
            )?,
            ttft: hist(
                "dynamo_worker_time_to_first_token_seconds",
                "Time from accepting a request to its first token",
                prometheus::exponential_buckets(0.001, 2.0, 16).ok()?,
            )?,
            itl: hist(
                "dynamo_worker_inter_token_latency_seconds",
                "Time between output tokens",
                prometheus::exponential_buckets(0.0005, 2.0, 14).ok()?,
            )?,
            prompt_tokens: counter(
                "dynamo_worker_prompt_tokens_total",
                "Prompt tokens of requests that produced a first token",
                &[],
            )?,
            output_tokens: counter(
                "dynamo_worker_output_tokens_total",
                "Output tokens after the first",
                &[],
            )?,
            frames: counter(
                "dynamo_worker_frames_total",
                "Response frames sent to gateways",
                &[],
            )?,
            frame_messages: counter(
                "dynamo_worker_frame_messages_total",
                "Bus messages that carried the response frames",
                &[],
            )?,
            frames_lost: counter(
                "dynamo_worker_frames_lost_total",
                "Response frames that could not be encoded or published",
                &[],
            )?,
            orphans: counter(
                "dynamo_worker_orphans_cancelled_total",
                "Requests cancelled because no gateway waited for them any more",
                &[],
            )?,
            gauges: [g(0)?, g(1)?, g(2)?, g(3)?, g(4)?, g(5)?],
        };
        register([
            Box::new(m.requests.clone()),
            Box::new(m.ttft.clone()),
            Box::new(m.itl.clone()),
            Box::new(m.prompt_tokens.clone()),
            Box::new(m.output_tokens.clone()),
            Box::new(m.frames.clone()),
            Box::new(m.frame_messages.clone()),
            Box::new(m.frames_lost.clone()),
            Box::new(m.orphans.clone()),
        ])?;
        register(m.gauges.clone().map(|g| Box::new(g) as Box<dyn Collector>))?;
        Some(m)
    })
    .as_ref()
}

/// A labelled family whose series a [`Series`] makes and removes.
trait Family {
    fn make(&self, labels: &[&str]);
    fn remove(&self, labels: &[&str]);
}

impl<T: MetricVecBuilder> Family for MetricVec<T> {
    fn make(&self, labels: &[&str]) {
        let _ = self.with_label_values(labels);
    }
    fn remove(&self, labels: &[&str]) {
        let _ = self.remove_label_values(labels);
    }
}

/// Every series of a worker labelled `l`: the one list both making and
/// removing walk.
fn each(m: &M, l: [&str; 3], mut f: impl FnMut(&dyn Family, &[&str])) {
    for o in [
        RequestOutcome::Finished,
        RequestOutcome::Cancelled,
        RequestOutcome::Failed,
        RequestOutcome::Aborted,
    ] {
        f(&m.requests, &[l[0], l[1], l[2], o.as_str()]);
    }
    f(&m.ttft, &l);
    f(&m.itl, &l);
    f(&m.prompt_tokens, &l);
    f(&m.output_tokens, &l);
    f(&m.frames, &l);
    f(&m.frame_messages, &l);
    f(&m.frames_lost, &l);
    f(&m.orphans, &l);
    for g in &m.gauges {
        f(g, &l);
    }
}

/// Live [`Series`] per label set.
fn live() -> &'static Mutex<HashMap<[String; 3], usize>> {
    static LIVE: OnceLock<Mutex<HashMap<[String; 3], usize>>> = OnceLock::new();
    LIVE.get_or_init(Default::default)
}

/// One worker's series; dropping the last of its labels removes them.
#[derive(Debug)]
pub struct Series {
    labels: [String; 3],
}

/// How a request ended, for `dynamo_worker_requests_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestOutcome {
    Finished,
    Cancelled,
    Failed,
    Aborted,
}

impl RequestOutcome {
    fn as_str(self) -> &'static str {
        match self {
            RequestOutcome::Finished => "finished",
            RequestOutcome::Cancelled => "cancelled",
            RequestOutcome::Failed => "failed",
            RequestOutcome::Aborted => "aborted",
        }
    }
}

impl Series {
    pub fn new(worker: &str, model: &str, role: WorkerRole) -> Self {
        let s = Series {
            labels: [
                worker.to_string(),
                model.to_string(),
                format!("{role:?}").to_lowercase(),
            ],
        };
        // Every series exists from the start (at zero), so dashboards and
        // alerts see a worker before its first request. Made under the
        // lock that counts them (see the module's invariant).
        let mut live = live().lock().unwrap_or_else(|e| e.into_inner());
        *live.entry(s.labels.clone()).or_default() += 1;
        if let Some(m) = m() {
            each(m, s.l(), |f, l| f.make(l));
        }
        drop(live);
        s
    }

    fn l(&self) -> [&str; 3] {
        [&self.labels[0], &self.labels[1], &self.labels[2]]
    }

    pub fn first_token(&self, after: Duration, prompt_tokens: u32) {
        if let Some(m) = m() {
            let l = self.l();
            m.ttft.with_label_values(&l).observe(after.as_secs_f64());
            m.prompt_tokens
                .with_label_values(&l)
                .inc_by(prompt_tokens as u64);
        }
    }

    /// `n` tokens came `gap` after the previous ones: `n` gaps of `gap / n`
    /// (all of them, so the histogram's count is the output tokens' count;
    /// `n` is one engine step's tokens for one request).
    pub fn tokens(&self, n: u32, gap: Duration) {
        if let (Some(m), true) = (m(), n > 0) {
            let l = self.l();
            let h = m.itl.with_label_values(&l);
            let each = gap.as_secs_f64() / n as f64;
            for _ in 0..n {
                h.observe(each);
            }
            m.output_tokens.with_label_values(&l).inc_by(n as u64);
        }
    }

    /// One bus message carried `frames` response frames (`sent`), or they
    /// were lost.
    pub fn frames_sent(&self, frames: usize, sent: bool) {
        if let Some(m) = m() {
            let l = self.l();
            if sent {
                m.frames.with_label_values(&l).inc_by(frames as u64);
                m.frame_messages.with_label_values(&l).inc();
            } else {
                m.frames_lost.with_label_values(&l).inc_by(frames as u64);
            }
        }
    }

    /// A request no gateway waited for was cancelled.
    pub fn orphan_cancelled(&self) {
        if let Some(m) = m() {
            m.orphans.with_label_values(&self.l()).inc();
        }
    }

    pub fn request_done(&self, outcome: RequestOutcome) {
        if let Some(m) = m() {
            let l = self.l();
            m.requests
                .with_label_values(&[l[0], l[1], l[2], outcome.as_str()])
                .inc();
        }
    }

    /// The engine's load as the registrar reports it.
    pub fn load(&self, load: &LoadMetrics, queued_prefill_tokens: u64) {
        if let Some(m) = m() {
            let l = self.l();
            let values = [
                load.active_seqs as i64,
                load.waiting_seqs as i64,
                load.kv_used_blocks as i64,
                load.kv_total_blocks as i64,
                load.inflight_requests as i64,
                queued_prefill_tokens as i64,
            ];
            for (g, v) in m.gauges.iter().zip(values) {
                g.with_label_values(&l).set(v);
            }
        }
    }
}

impl Drop for Series {
    fn drop(&mut self) {
        // Counted down and removed under one lock (see the module's invariant).
        let mut live = live().lock().unwrap_or_else(|e| e.into_inner());
        match live.get_mut(&self.labels) {
            Some(n) if *n > 1 => *n -= 1,
            _ => {
                live.remove(&self.labels);
                if let Some(m) = m() {
                    each(m, self.l(), |f, l| f.remove(l));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn has(worker: &str, name: &str) -> bool {
        dynamo_runtime::metrics::render()
            .lines()
            .any(|l| l.starts_with(name) && l.contains(&format!("worker=\"{worker}\"")))
    }

    #[test]
    fn a_workers_series_exist_from_the_start_and_leave_with_it() {
        let s = Series::new("w-prom-test", "m", WorkerRole::Aggregated);
        assert!(has("w-prom-test", "dynamo_worker_requests_total"));
        assert!(has("w-prom-test", "dynamo_worker_kv_used_blocks"));
        s.first_token(Duration::from_millis(20), 100);
        s.tokens(4, Duration::from_millis(40));
        // A step of many tokens counts every gap (the histogram's count
        // stays the output tokens').
        s.tokens(100, Duration::from_millis(100));
        s.request_done(RequestOutcome::Finished);
        s.frames_sent(3, true);
        s.frames_sent(1, true);
        s.frames_sent(2, false);
        let load = LoadMetrics {
            kv_used_blocks: 7,
            ..Default::default()
        };
        s.load(&load, 50);
        let text = dynamo_runtime::metrics::render();
        let line = |prefix: &str| {
            text.lines()
                .find(|l| l.starts_with(prefix) && l.contains("w-prom-test"))
                .map(|l| l.rsplit(' ').next().unwrap().to_string())
        };
        assert_eq!(line("dynamo_worker_kv_used_blocks").as_deref(), Some("7"));
        assert_eq!(
            line("dynamo_worker_queued_prefill_tokens").as_deref(),
            Some("50")
        );
        assert_eq!(
            line("dynamo_worker_output_tokens_total").as_deref(),
            Some("104")
        );
        assert_eq!(
            line("dynamo_worker_inter_token_latency_seconds_count").as_deref(),
            Some("104")
        );
        assert_eq!(line("dynamo_worker_frames_total").as_deref(), Some("4"));
        assert_eq!(
            line("dynamo_worker_frame_messages_total").as_deref(),
            Some("2")
        );
        assert_eq!(
            line("dynamo_worker_frames_lost_total").as_deref(),
            Some("2")
        );
        assert!(text
            .lines()
            .any(|l| l.starts_with("dynamo_worker_requests_total")
                && l.contains("w-prom-test")
                && l.contains("outcome=\"finished\"")
                && l.ends_with(" 1")));
        // A restarted actor's series and the old one's overlap.
        let again = Series::new("w-prom-test", "m", WorkerRole::Aggregated);
        drop(s);
        assert!(has("w-prom-test", "dynamo_worker_kv_used_blocks"));
        drop(again);
        assert!(!has("w-prom-test", "dynamo_worker_"));
    }
}
