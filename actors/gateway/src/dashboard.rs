//! The live cluster page: `GET /dashboard` (one self-contained HTML page,
//! no external assets) polls `GET /v1/dynamo/cluster`, which shows nodes,
//! workers and their load, the KV hit rate, and recent scaling and
//! migration events.
//!
//! Invariants: the events ring is bounded ([`MAX_EVENTS`]); the cluster
//! view is built from the router's registry (no bus round trip per
//! worker) plus one bounded read of the planner bucket; with API keys on,
//! the JSON needs a key like every other API (the page asks for one), is
//! charged as a request, and a key limited to some models sees only their
//! workers and no events.

use crate::error::ApiError;
use crate::shared::Shared;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Html;
use axum::Json;
use dynamo_bus_schema::{decode, unix_ms, PlannerStatus};
use futures::StreamExt;
use serde_json::{json, Value};
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Events kept for the page.
pub const MAX_EVENTS: usize = 64;
/// Planner statuses read for the page (one per deployment).
const MAX_DEPLOYMENTS: usize = 32;

/// Recent events this gateway saw (migrations), newest last.
#[derive(Default)]
pub struct Events(Mutex<VecDeque<(u64, &'static str, String)>>);

impl Events {
    pub fn push(&self, kind: &'static str, message: String) {
        if let Ok(mut q) = self.0.lock() {
            if q.len() == MAX_EVENTS {
                q.pop_front();
            }
            q.push_back((unix_ms(), kind, message));
        }
    }

    fn list(&self) -> Vec<(u64, &'static str, String)> {
        self.0
            .lock()
            .map(|q| q.iter().cloned().collect())
            .unwrap_or_default()
    }
}

pub async fn page() -> Html<&'static str> {
    Html(include_str!("dashboard.html"))
}

/// The planners' recent decisions (bounded: a second at most).
async fn decisions(s: &Shared) -> Vec<(u64, &'static str, String)> {
    let read = async {
        let kv = s
            .bus
            .js
            .get_key_value(s.bus.subjects.planner_bucket())
            .await
            .ok()?;
        let mut keys = kv.keys().await.ok()?;
        let mut out = Vec::new();
        let mut n = 0;
        while let Some(Ok(k)) = keys.next().await {
            n += 1;
            if n > MAX_DEPLOYMENTS {
                break;
            }
            let Ok(Some(bytes)) = kv.get(&k).await else {
                continue;
            };
            let Ok(st) = decode::<PlannerStatus>(&bytes) else {
                continue;
            };
            for d in st.decisions.iter().rev().take(10) {
                out.push((
                    d.unix_ms,
                    "scaling",
                    format!(
                        "{}/{}: {} → {} ({}{}) {}",
                        st.deployment,
                        d.target,
                        d.from,
                        d.to,
                        d.rule,
                        if d.applied { "" } else { ", not applied" },
                        d.reason
                    ),
                ));
            }
        }
        Some(out)
    };
    tokio::time::timeout(Duration::from_secs(1), read)
        .await
        .ok()
        .flatten()
        .unwrap_or_default()
}

pub async fn cluster(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    let caller = s.auth.authenticate(&headers)?;
    s.auth.admit(&caller, std::time::Instant::now())?;
    // A key limited to some models sees only their workers, and no
    // cluster-wide events (other deployments' decisions, other callers'
    // request ids).
    let unrestricted = s.auth.all_models(&caller);
    let _place = s.control.try_enter().ok_or_else(|| {
        ApiError::overloaded("Too many status requests at once; retry shortly.", "busy")
    })?;
    let workers: Vec<_> = s
        .workers()
        .await?
        .into_iter()
        .filter(|w| s.auth.allow_model(&caller, &w.reg.model.name.0).is_ok())
        .collect();
    let mut nodes: BTreeMap<String, (u32, u32, u32)> = BTreeMap::new();
    let workers_json: Vec<Value> = workers
        .iter()
        .map(|w| {
            let r = &w.reg;
            let n = nodes.entry(r.node_id.0.clone()).or_default();
            n.0 += 1;
            n.1 += r.load.active_seqs;
            n.2 += r.load.inflight_requests;
            json!({
                "worker_id": r.worker_id.to_string(),
                "node": r.node_id.0,
                "model": r.model.name.0,
                "role": format!("{:?}", r.role).to_lowercase(),
                "state": format!("{:?}", r.state).to_lowercase(),
                "engine": r.engine,
                "active_seqs": r.load.active_seqs,
                "waiting_seqs": r.load.waiting_seqs,
                "inflight_requests": r.load.inflight_requests,
                "kv_used_blocks": r.load.kv_used_blocks,
                "kv_total_blocks": r.load.kv_total_blocks,
                "seen_ms_ago": w.last_seen.elapsed().as_millis() as u64,
            })
        })
        .collect();
    let nodes_json: Vec<Value> = nodes
        .iter()
        .map(|(id, (workers, active, inflight))| {
            json!({"node": id, "workers": workers, "active_seqs": active, "inflight_requests": inflight})
        })
        .collect();
    let m = &s.metrics;
    let (prompt, cached) = (m.input_tokens.get(), m.cached_tokens.get());
    let mut events = Vec::new();
    if unrestricted {
        events = s.events.list();
        events.extend(decisions(&s).await);
    }
    events.sort_by_key(|e| std::cmp::Reverse(e.0));
    events.truncate(MAX_EVENTS);
    let events: Vec<Value> = events
        .into_iter()
        .map(|(at, kind, message)| json!({"unix_ms": at, "kind": kind, "message": message}))
        .collect();
    Ok(Json(json!({
        "gateway_id": s.gateway_id.to_string(),
        "unix_ms": unix_ms(),
        "nodes": nodes_json,
        "workers": workers_json,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "kv_hit_rate": if prompt == 0 { Value::Null } else { json!(cached as f64 / prompt as f64) },
        "inflight_requests": m.inflight.get(),
        "queued_requests": s.admission.waiting_total(),
        "events": events,
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_events_ring_keeps_the_newest() {
        let e = Events::default();
        for i in 0..(MAX_EVENTS + 5) {
            e.push("migration", format!("m{i}"));
        }
        let l = e.list();
        assert_eq!(l.len(), MAX_EVENTS);
        assert_eq!(l[0].2, "m5");
        assert_eq!(l.last().unwrap().2, format!("m{}", MAX_EVENTS + 4));
    }
}
