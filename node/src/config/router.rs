//! `[router]`: the routing policy, its cost weights and timing model, and
//! the router's timeouts, checked into a [`RouterConfig`].

use super::{invalid, ms, ConfigError};
use dynamo_router::policy::StepTiming;
use dynamo_router::{DisaggPolicy, PolicyKind, RouterConfig};
use serde::Deserialize;
use std::time::Duration;

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawRouter {
    pub policy: Option<String>,
    pub worker_ttl_ms: Option<u64>,
    /// kv_aware: weight of the uncached prefill time (kv_aware_blocks: of
    /// prefill blocks against decode blocks).
    pub overlap_weight: Option<f64>,
    /// kv_aware: share of prefill cost still paid for a host-tier hit.
    pub host_hit_cost: Option<f64>,
    /// kv_aware: share of prefill cost still paid for a disk-tier hit.
    pub disk_hit_cost: Option<f64>,
    /// kv_aware: softmax temperature (0 = deterministic).
    pub temperature: Option<f64>,
    /// kv_aware: the workers' prefill time for N new tokens in one step,
    /// `[a, b, c]` ms = a·N² + b·N + c (default: the mocker's).
    pub prefill_ms: Option<[f64; 3]>,
    /// kv_aware: a decode step's time at KV utilisation u, `[a, b, c]` ms.
    pub decode_ms: Option<[f64; 3]>,
    /// kv_aware: most prefill tokens a worker runs in one step.
    pub max_batched_tokens: Option<u32>,
    /// Disaggregated serving: uncached prompt tokens below which the decode
    /// worker prefills itself.
    pub min_remote_prefill_tokens: Option<u64>,
    /// Disaggregated serving: a prefill worker with this many requests
    /// waiting is skipped.
    pub max_prefill_queue: Option<u32>,
    /// How long a worker that refused a request as overloaded is avoided.
    pub overload_backoff_ms: Option<u64>,
    /// Write KV index snapshots to the object store (default true; a
    /// replica that starts loads the newest either way).
    pub kv_snapshots: Option<bool>,
    /// Longest time between two KV index snapshots while events arrive.
    pub kv_snapshot_interval_ms: Option<u64>,
    /// A KV index snapshot is due after this many applied events.
    pub kv_snapshot_events: Option<u64>,
}

/// The KV events stream keeps 600 s: snapshots must come well within it.
const MAX_SNAPSHOT_INTERVAL: Duration = Duration::from_secs(150);

/// Largest magnitude of a timing coefficient.
const MAX_COEFF: f64 = 1e6;

pub(super) fn parse(r: RawRouter) -> Result<RouterConfig, ConfigError> {
    let d = RouterConfig::default();
    let mut router = RouterConfig {
        worker_ttl: ms(r.worker_ttl_ms, d.worker_ttl),
        policy: match &r.policy {
            None => PolicyKind::default(),
            Some(p) => p.parse().map_err(|e: String| invalid("router.policy", e))?,
        },
        disagg: DisaggPolicy {
            min_remote_prefill_tokens: r
                .min_remote_prefill_tokens
                .unwrap_or(d.disagg.min_remote_prefill_tokens),
            max_prefill_queue: r.max_prefill_queue.unwrap_or(d.disagg.max_prefill_queue),
        },
        overload_backoff: ms(r.overload_backoff_ms, d.overload_backoff),
        kv_snapshot: dynamo_router::kv_stream::KvSnapshotConfig {
            enabled: r.kv_snapshots.unwrap_or(d.kv_snapshot.enabled),
            interval: ms(r.kv_snapshot_interval_ms, d.kv_snapshot.interval),
            events: r.kv_snapshot_events.unwrap_or(d.kv_snapshot.events),
        },
    };
    if !(Duration::from_millis(100)..=MAX_SNAPSHOT_INTERVAL).contains(&router.kv_snapshot.interval)
    {
        return Err(invalid(
            "router.kv_snapshot_interval_ms",
            format!(
                "must be between 100 and {} (a quarter of the KV events stream's retention)",
                MAX_SNAPSHOT_INTERVAL.as_millis()
            ),
        ));
    }
    if router.kv_snapshot.events == 0 {
        return Err(invalid("router.kv_snapshot_events", "must be at least 1"));
    }
    if router.disagg.max_prefill_queue == 0 {
        return Err(invalid("router.max_prefill_queue", "must be at least 1"));
    }
    let timing_given =
        r.prefill_ms.is_some() || r.decode_ms.is_some() || r.max_batched_tokens.is_some();
    if let PolicyKind::KvAware(_, t) = &mut router.policy {
        timing(&r, t)?;
    } else if timing_given {
        return Err(invalid(
            "router.policy",
            "prefill_ms, decode_ms and max_batched_tokens are only used by policy = \"kv_aware\"",
        ));
    }
    if let Some(w) = router.policy.weights_mut() {
        // The same ranges a request's `routing` extension has.
        for (key, v, slot, hi) in [
            (
                "router.overlap_weight",
                r.overlap_weight,
                &mut w.overlap_weight,
                dynamo_gateway::openai::MAX_OVERLAP_WEIGHT,
            ),
            (
                "router.host_hit_cost",
                r.host_hit_cost,
                &mut w.host_hit_cost,
                1.0,
            ),
            (
                "router.disk_hit_cost",
                r.disk_hit_cost,
                &mut w.disk_hit_cost,
                1.0,
            ),
            (
                "router.temperature",
                r.temperature,
                &mut w.temperature,
                dynamo_gateway::openai::MAX_ROUTING_TEMPERATURE,
            ),
        ] {
            if let Some(v) = v {
                if !(v.is_finite() && (0.0..=hi).contains(&v)) {
                    return Err(invalid(key, format!("must be between 0 and {hi}")));
                }
                *slot = v;
            }
        }
    } else if r
        .overlap_weight
        .or(r.host_hit_cost)
        .or(r.disk_hit_cost)
        .or(r.temperature)
        .is_some()
    {
        return Err(invalid(
            "router.policy",
            "cost weights are only used by policy = \"kv_aware\" or \"kv_aware_blocks\"",
        ));
    }
    if router.worker_ttl < Duration::from_millis(100) {
        return Err(invalid("router.worker_ttl_ms", "must be at least 100"));
    }
    Ok(router)
}

/// Fills the timing model from the config, checking every coefficient.
fn timing(r: &RawRouter, t: &mut StepTiming) -> Result<(), ConfigError> {
    for (key, v, slot) in [
        ("router.prefill_ms", r.prefill_ms, &mut t.prefill_ms),
        ("router.decode_ms", r.decode_ms, &mut t.decode_ms),
    ] {
        if let Some(v) = v {
            if v.iter().any(|x| !x.is_finite() || x.abs() > MAX_COEFF) {
                return Err(invalid(
                    key,
                    format!("coefficients must be finite numbers within ±{MAX_COEFF}"),
                ));
            }
            *slot = v;
        }
    }
    if let Some(n) = r.max_batched_tokens {
        if n == 0 {
            return Err(invalid("router.max_batched_tokens", "must be at least 1"));
        }
        t.max_batched_tokens = n;
    }
    Ok(())
}
