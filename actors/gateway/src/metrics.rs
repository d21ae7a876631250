//! Prometheus metrics of the gateway (`GET /metrics`).

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts,
    Registry, TextEncoder,
};

pub struct Metrics {
    registry: Registry,
    pub requests: IntCounterVec,
    pub inflight: IntGauge,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub request_duration: Histogram,
    pub input_tokens: IntCounter,
    pub output_tokens: IntCounter,
    pub cached_tokens: IntCounter,
    pub predicted_cached_tokens: IntCounter,
    pub errors: IntCounterVec,
    pub route_retries: IntCounter,
    /// Requests that waited for a worker with room.
    pub room_waits: IntCounter,
    /// Cancels sent for requests a worker still ran that this gateway no
    /// longer had (one per heartbeat of one).
    pub orphan_cancels: IntCounter,
    /// Streamed responses by how they ended.
    pub stream_endings: IntCounterVec,
    pub migrations: IntCounterVec,
    pub migration_failures: IntCounterVec,
    pub phase: HistogramVec,
    pub disagg_fallbacks: IntCounter,
    /// Requests refused under load, by why (queue_full, queue_timeout,
    /// workers_overloaded, shutting_down, slow_client).
    pub rejected: IntCounterVec,
    /// Requests waiting for admission now (set when rendered).
    pub queued: IntGauge,
    pub queue_wait: Histogram,
    /// Requests per API key (its name) and status code.
    pub key_requests: IntCounterVec,
    /// Tokens (prompt plus `max_tokens`) charged per API key.
    pub key_tokens: IntCounterVec,
    bus_rejected: IntGauge,
}

fn buckets_s() -> Vec<f64> {
    vec![
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ]
}

impl Metrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new_custom(Some("dynamo_gateway".into()), None)?;
        let requests = IntCounterVec::new(
            Opts::new(
                "requests_total",
                "HTTP requests by endpoint and status code",
            ),
            &["endpoint", "status"],
        )?;
        let inflight = IntGauge::new("inflight_requests", "Requests being served")?;
        let ttft = Histogram::with_opts(
            HistogramOpts::new("time_to_first_token_seconds", "Time to first token")
                .buckets(buckets_s()),
        )?;
        let itl = Histogram::with_opts(
            HistogramOpts::new("inter_token_latency_seconds", "Time between output tokens")
                .buckets(buckets_s()),
        )?;
        let request_duration = Histogram::with_opts(
            HistogramOpts::new("request_duration_seconds", "End-to-end request time")
                .buckets(buckets_s()),
        )?;
        let input_tokens = IntCounter::new("input_tokens_total", "Prompt tokens")?;
        let output_tokens = IntCounter::new("output_tokens_total", "Completion tokens")?;
        let cached_tokens = IntCounter::new(
            "cached_tokens_total",
            "Prompt tokens served from a prefix cache",
        )?;
        let predicted_cached_tokens = IntCounter::new(
            "predicted_cached_tokens_total",
            "Prompt tokens the router predicted cached on the chosen worker (compare with cached_tokens_total for the index hit rate)",
        )?;
        let errors = IntCounterVec::new(
            Opts::new("errors_total", "Failed requests by error kind"),
            &["kind"],
        )?;
        let route_retries = IntCounter::new(
            "route_retries_total",
            "Requests re-routed after a worker refused or was unreachable",
        )?;
        let room_waits = IntCounter::new(
            "room_waits_total",
            "Requests that waited for a worker with room (every worker had refused them for room)",
        )?;
        let stream_endings = IntCounterVec::new(
            Opts::new(
                "stream_endings_total",
                "Streamed responses by how they ended: done ([DONE] sent), error (an error event, e.g. every worker failed), client_gone (the client left), shutdown (the gateway's shutdown grace ran out)",
            ),
            &["how"],
        )?;
        let orphan_cancels = IntCounter::new(
            "orphan_cancels_total",
            "Cancels sent for requests a worker still ran that this gateway no longer had (one per heartbeat of one; a few come of requests that just ended)",
        )?;
        let migrations = IntCounterVec::new(
            Opts::new(
                "migrations_total",
                "Requests moved to another worker mid-stream, by the failure that caused it",
            ),
            &["reason"],
        )?;
        let migration_failures = IntCounterVec::new(
            Opts::new(
                "migration_failures_total",
                "Worker failures that could not be migrated, by why not",
            ),
            &["why"],
        )?;
        let phase = HistogramVec::new(
            HistogramOpts::new(
                "request_phase_seconds",
                "Where prompt time went, per request: queue, prefill, transfer, first_token (mode: local or remote prefill)",
            )
            .buckets(buckets_s()),
            &["phase", "mode"],
        )?;
        let disagg_fallbacks = IntCounter::new(
            "disagg_fallbacks_total",
            "Requests planned for a remote prefill that prefilled locally instead",
        )?;
        let rejected = IntCounterVec::new(
            Opts::new(
                "rejected_requests_total",
                "Requests refused under load (429/503 with Retry-After), by reason",
            ),
            &["reason"],
        )?;
        let queued = IntGauge::new(
            "queued_requests",
            "Requests waiting for admission (all models)",
        )?;
        let queue_wait = Histogram::with_opts(
            HistogramOpts::new(
                "queue_wait_seconds",
                "Time admitted requests waited for a place",
            )
            .buckets(buckets_s()),
        )?;
        let key_requests = IntCounterVec::new(
            Opts::new(
                "key_requests_total",
                "Requests by API key (its name, and key_id: the first 12 hex digits of its SHA-256) and status code (401s carry no key: `-`)",
            ),
            &["key", "key_id", "status"],
        )?;
        let key_tokens = IntCounterVec::new(
            Opts::new(
                "key_tokens_total",
                "Tokens charged to an API key's limit (prompt plus max_tokens)",
            ),
            &["key", "key_id"],
        )?;
        let bus_rejected = IntGauge::new(
            "bus_rejected_messages",
            "Bus messages this process rejected (malformed or unknown)",
        )?;
        // The reasons a dashboard graphs exist from the start, at zero (a
        // labelled series is otherwise absent until its first event).
        for r in ["worker_error", "worker_silent", "lost_frames"] {
            migrations.with_label_values(&[r]);
        }
        for r in ["limit", "no_worker"] {
            migration_failures.with_label_values(&[r]);
        }
        for r in ["queue_full", "queue_timeout", "held_full"] {
            rejected.with_label_values(&[r]);
        }
        for c in [
            Box::new(requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(inflight.clone()),
            Box::new(ttft.clone()),
            Box::new(itl.clone()),
            Box::new(request_duration.clone()),
            Box::new(input_tokens.clone()),
            Box::new(output_tokens.clone()),
            Box::new(cached_tokens.clone()),
            Box::new(predicted_cached_tokens.clone()),
            Box::new(errors.clone()),
            Box::new(route_retries.clone()),
            Box::new(room_waits.clone()),
            Box::new(orphan_cancels.clone()),
            Box::new(stream_endings.clone()),
            Box::new(migrations.clone()),
            Box::new(migration_failures.clone()),
            Box::new(phase.clone()),
            Box::new(disagg_fallbacks.clone()),
            Box::new(rejected.clone()),
            Box::new(queued.clone()),
            Box::new(queue_wait.clone()),
            Box::new(key_requests.clone()),
            Box::new(key_tokens.clone()),
            Box::new(bus_rejected.clone()),
        ] {
            registry.register(c)?;
        }
        Ok(Metrics {
            registry,
            requests,
            inflight,
            ttft,
            itl,
            request_duration,
            input_tokens,
            output_tokens,
            cached_tokens,
            predicted_cached_tokens,
            errors,
            route_retries,
            room_waits,
            orphan_cancels,
            stream_endings,
            migrations,
            migration_failures,
            phase,
            disagg_fallbacks,
            rejected,
            queued,
            queue_wait,
            key_requests,
            key_tokens,
            bus_rejected,
        })
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        self.bus_rejected
            .set(dynamo_runtime::counters::rejected_total() as i64);
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        let mut text = String::from_utf8(buf).unwrap_or_default();
        text.push_str(&dynamo_runtime::metrics::render());
        let tls_failures =
            crate::tls::HANDSHAKE_FAILURES.load(std::sync::atomic::Ordering::Relaxed);
        text.push_str(&format!(
            "# HELP dynamo_gateway_tls_handshake_failures_total HTTPS handshakes that failed or timed out\n\
             # TYPE dynamo_gateway_tls_handshake_failures_total counter\n\
             dynamo_gateway_tls_handshake_failures_total {tls_failures}\n"
        ));
        text
    }
}
