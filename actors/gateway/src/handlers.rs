//! HTTP handlers: OpenAI endpoints, health and metrics.

use crate::error::ApiError;
use crate::generate::{GenEvent, Generation, Usage};
use crate::models;
use crate::openai::{parse_body, ChatRequest, CompletionRequest, ValidGenerate, ValidOptions};
use crate::shared::Shared;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, Uri};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use dynamo_model::Preprocessor;
use futures::stream::{self, StreamExt};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Endpoint {
    Chat,
    Completions,
}

impl Endpoint {
    fn label(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat_completions",
            Endpoint::Completions => "completions",
        }
    }
}

pub fn app(shared: Arc<Shared>) -> Router {
    let limit = shared.config.max_body_bytes;
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(list_models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/dynamo/overlap", post(overlap))
        .fallback(|uri: Uri| async move { ApiError::not_found(uri.path()) })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        .layer(DefaultBodyLimit::max(limit))
        .with_state(shared)
}

fn body_error(r: BytesRejection, limit: usize) -> ApiError {
    if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::too_large(limit)
    } else {
        ApiError::invalid(None, format!("Cannot read the request body: {r}"))
    }
}

struct InflightGuard<'a>(&'a Shared);
impl Drop for InflightGuard<'_> {
    fn drop(&mut self) {
        self.0.metrics.inflight.dec();
    }
}

async fn chat(State(s): State<Arc<Shared>>, body: Result<Bytes, BytesRejection>) -> Response {
    serve(s, body, Endpoint::Chat).await
}

async fn completions(
    State(s): State<Arc<Shared>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    serve(s, body, Endpoint::Completions).await
}

async fn serve(s: Arc<Shared>, body: Result<Bytes, BytesRejection>, ep: Endpoint) -> Response {
    let t0 = Instant::now();
    s.metrics.inflight.inc();
    let _guard = InflightGuard(&s);
    let res = handle(s.clone(), body, ep, t0).await;
    let resp = match res {
        Ok(r) => r,
        Err(e) => {
            s.metrics.errors.with_label_values(&[e.metric_kind()]).inc();
            e.into_response()
        }
    };
    s.metrics
        .requests
        .with_label_values(&[ep.label(), resp.status().as_str()])
        .inc();
    resp
}

async fn handle(
    s: Arc<Shared>,
    body: Result<Bytes, BytesRejection>,
    ep: Endpoint,
    t0: Instant,
) -> Result<Response, ApiError> {
    if !s.is_accepting() {
        return Err(ApiError::unavailable("This gateway is shutting down."));
    }
    let body = body.map_err(|r| body_error(r, s.config.max_body_bytes))?;
    let (model, pre, gens, opts) = match ep {
        Endpoint::Chat => {
            let req: ChatRequest = parse_body(&body)?;
            let opts = req.common.options()?;
            let pre = s.models.get(&s, &req.common.model).await?;
            let v = req.validate(&pre)?;
            (req.common.model, pre, vec![v], opts)
        }
        Endpoint::Completions => {
            let req: CompletionRequest = parse_body(&body)?;
            let opts = req.common.options()?;
            let pre = s.models.get(&s, &req.common.model).await?;
            let v = req.validate(&pre)?;
            (req.common.model, pre, v, opts)
        }
    };
    for g in &gens {
        s.metrics.input_tokens.inc_by(g.token_ids.len() as u64);
    }
    let timeout = opts
        .timeout_ms
        .map(Duration::from_millis)
        .unwrap_or(s.config.request_timeout)
        .min(s.config.request_timeout);
    let deadline = t0 + timeout;
    let mut started = Vec::with_capacity(gens.len());
    let max_migrations = opts
        .max_migrations
        .unwrap_or(s.config.max_migrations)
        .min(s.config.max_migrations);
    for mut v in gens {
        v.routing = opts.routing;
        started.push(
            Generation::start(s.clone(), pre.clone(), v, deadline, t0, max_migrations).await?,
        );
    }
    let workers: Vec<String> = started
        .iter()
        .filter_map(|g| g.worker_id().map(|w| w.to_string()))
        .collect();
    let out = if opts.stream {
        // The stream task observes the duration when the stream ends.
        Ok(stream_response(s.clone(), started, ep, model, opts, t0))
    } else {
        let r = collect_response(started, ep, &model).await;
        s.metrics
            .request_duration
            .observe(t0.elapsed().as_secs_f64());
        r
    };
    out.map(|mut r| {
        if let Ok(v) = axum::http::HeaderValue::from_str(&workers.join(",")) {
            r.headers_mut().insert(WORKER_HEADER, v);
        }
        r
    })
}

/// Response header naming the worker(s) that served the request.
pub const WORKER_HEADER: &str = "x-dynamo-worker";

/// Renders stream chunks around a prefix built once per response.
struct ChunkWriter {
    /// `{"id":…,"object":…,"created":…,"model":…,"choices":`
    prefix: String,
}

impl ChunkWriter {
    fn new(id: &str, object: &str, created: u64, model: &str) -> Self {
        let q = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into());
        ChunkWriter {
            prefix: format!(
                "{{\"id\":{},\"object\":{},\"created\":{created},\"model\":{},\"choices\":",
                q(id),
                q(object),
                q(model)
            ),
        }
    }

    /// A chunk with arbitrary `choices` (and optionally one more top-level
    /// field: `usage`, or `timings` on a choice's last chunk).
    fn raw(&self, choices: &Value, extra: Option<(&str, &Value)>) -> Event {
        let mut s = String::with_capacity(self.prefix.len() + 128);
        s.push_str(&self.prefix);
        s.push_str(&choices.to_string());
        if let Some((key, v)) = extra {
            let _ = write!(s, ",\"{key}\":{v}");
        }
        s.push('}');
        Event::default().data(s)
    }
}

/// The `timings` extension of a response: where its prompt time went.
fn timings_json(t: &dynamo_bus_schema::PhaseTimings) -> Value {
    let ms = |x: f32| (x as f64 * 10.0).round() / 10.0;
    json!({
        "queue_ms": ms(t.queue_ms),
        "prefill_ms": ms(t.prefill_ms),
        "transfer_ms": ms(t.transfer_ms),
        "first_token_ms": ms(t.first_token_ms),
        "prefill_worker": t.prefill_worker.map(|w| w.to_string()),
        "decode_worker": t.decode_worker.to_string(),
        "disaggregated": t.prefill_worker.is_some(),
        "fallback": t.fallback,
    })
}

/// A content chunk: only the text is escaped per token.
fn chunk_text(prefix: &str, ep: Endpoint, index: usize, text: &str) -> Event {
    let t = serde_json::to_string(text).unwrap_or_else(|_| "\"\"".into());
    let mut s = String::with_capacity(prefix.len() + t.len() + 96);
    s.push_str(prefix);
    match ep {
        Endpoint::Chat => {
            let _ = write!(s, "[{{\"index\":{index},\"delta\":{{\"content\":{t}}},\"logprobs\":null,\"finish_reason\":null}}]}}");
        }
        Endpoint::Completions => {
            let _ = write!(
                s,
                "[{{\"index\":{index},\"text\":{t},\"logprobs\":null,\"finish_reason\":null}}]}}"
            );
        }
    }
    Event::default().data(s)
}

fn now_s() -> u64 {
    dynamo_bus_schema::unix_ms() / 1000
}

fn response_id(ep: Endpoint, g: &Generation) -> String {
    match ep {
        Endpoint::Chat => format!("chatcmpl-{}", g.request_id()),
        Endpoint::Completions => format!("cmpl-{}", g.request_id()),
    }
}

async fn collect_response(
    gens: Vec<Generation>,
    ep: Endpoint,
    model: &str,
) -> Result<Response, ApiError> {
    let id = response_id(ep, &gens[0]);
    let results = futures::future::join_all(gens.into_iter().map(|mut g| async move {
        let mut text = String::new();
        loop {
            match g.next().await {
                Some(Ok(GenEvent::Text(t))) => text.push_str(&t),
                Some(Ok(GenEvent::Done {
                    finish_reason,
                    usage,
                    timings,
                })) => return Ok((text, finish_reason, usage, timings)),
                Some(Err(e)) => return Err(e),
                None => return Err(ApiError::internal("Stream ended without a result.")),
            }
        }
    }))
    .await;
    let mut usage = Usage::default();
    let mut choices = Vec::new();
    let mut all_timings = Vec::new();
    for (i, r) in results.into_iter().enumerate() {
        let (text, finish_reason, u, timings) = r?;
        usage.add(&u);
        all_timings.extend(timings.map(|t| timings_json(&t)));
        choices.push(match ep {
            Endpoint::Chat => json!({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": finish_reason}),
            Endpoint::Completions => json!({"index": i, "text": text, "logprobs": null, "finish_reason": finish_reason}),
        });
    }
    let object = match ep {
        Endpoint::Chat => "chat.completion",
        Endpoint::Completions => "text_completion",
    };
    let mut body = json!({
        "id": id, "object": object, "created": now_s(), "model": model,
        "choices": choices, "usage": usage.json(),
    });
    // Extension: where the first choice's prompt time went (all choices' when n > 1).
    match all_timings.len() {
        0 => {}
        1 => body["timings"] = all_timings.remove(0),
        _ => body["timings"] = Value::Array(all_timings),
    }
    Ok(Json(body).into_response())
}

fn stream_response(
    s: Arc<Shared>,
    gens: Vec<Generation>,
    ep: Endpoint,
    model: String,
    opts: ValidOptions,
    t0: Instant,
) -> Response {
    let id = response_id(ep, &gens[0]);
    let created = now_s();
    let object = match ep {
        Endpoint::Chat => "chat.completion.chunk",
        Endpoint::Completions => "text_completion",
    };
    let chunks = ChunkWriter::new(&id, object, created, &model);
    let chunk_prefix = chunks.prefix.clone();
    let chunk = move |choices: Value, extra: Option<(&str, Value)>| -> Event {
        chunks.raw(&choices, extra.as_ref().map(|(k, v)| (*k, v)))
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Event, Infallible>>(64);
    let n = gens.len();
    // The task ends when every generation ends or the client goes away (send fails),
    // which drops the generations and cancels them on their workers.
    tokio::spawn(async move {
        let streams = gens.into_iter().enumerate().map(|(i, g)| {
            stream::unfold(Some(g), move |g| async move {
                let mut g = g?;
                let ev = g.next().await?;
                Some(((i, ev), Some(g)))
            })
            .boxed()
        });
        let mut all = stream::select_all(streams);
        if ep == Endpoint::Chat {
            for i in 0..n {
                let c = json!([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]);
                if tx.send(Ok(chunk(c, None))).await.is_err() {
                    return;
                }
            }
        }
        let mut usage = Usage::default();
        loop {
            // A client that leaves while nothing is being sent (a long
            // prefill) is noticed at once, not at the next event.
            let next = tokio::select! {
                next = all.next() => next,
                _ = tx.closed() => return,
            };
            let Some((i, ev)) = next else { break };
            let event = match ev {
                // The hot path (one event per token) skips building a JSON value.
                Ok(GenEvent::Text(t)) => chunk_text(&chunk_prefix, ep, i, &t),
                Ok(GenEvent::Done {
                    finish_reason,
                    usage: u,
                    timings,
                }) => {
                    usage.add(&u);
                    let timings = timings.map(|t| ("timings", timings_json(&t)));
                    match ep {
                        Endpoint::Chat => chunk(
                            json!([{"index": i, "delta": {}, "logprobs": null, "finish_reason": finish_reason}]),
                            timings,
                        ),
                        Endpoint::Completions => chunk(
                            json!([{"index": i, "text": "", "logprobs": null, "finish_reason": finish_reason}]),
                            timings,
                        ),
                    }
                }
                Err(e) => {
                    s.metrics.errors.with_label_values(&[e.metric_kind()]).inc();
                    let _ = tx
                        .send(Ok(Event::default().data(e.body().to_string())))
                        .await;
                    return;
                }
            };
            if tx.send(Ok(event)).await.is_err() {
                return;
            }
        }
        if opts.include_usage
            && tx
                .send(Ok(chunk(json!([]), Some(("usage", usage.json())))))
                .await
                .is_err()
        {
            return;
        }
        let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
        s.metrics
            .request_duration
            .observe(t0.elapsed().as_secs_f64());
    });
    Sse::new(tokio_stream::wrappers::ReceiverStream::new(rx))
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

async fn list_models(State(s): State<Arc<Shared>>) -> Result<Json<Value>, ApiError> {
    let models = models::list(&s).await?;
    let data: Vec<Value> = models
        .iter()
        .map(|m| {
            json!({
                "id": m.card.name.0, "object": "model", "created": s.started_unix_s, "owned_by": "dynamo",
                "context_length": m.card.context_length, "block_size": m.card.block_size,
                "workers": m.workers.len(),
            })
        })
        .collect();
    Ok(Json(json!({"object": "list", "data": data})))
}

async fn health(State(s): State<Arc<Shared>>) -> Response {
    let models = models::list(&s).await.unwrap_or_default();
    let workers: usize = models.iter().map(|m| m.workers.len()).sum();
    let accepting = s.is_accepting();
    let body = json!({
        "status": if accepting { "ok" } else { "draining" },
        "gateway_id": s.gateway_id.to_string(),
        "models": models.iter().map(|m| m.card.name.0.clone()).collect::<Vec<_>>(),
        "workers": workers,
    });
    let code = if accepting {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(body)).into_response()
}

async fn metrics(State(s): State<Arc<Shared>>) -> Response {
    let mut text = s.metrics.render();
    if let Ok(r) = s.router() {
        if let Ok(ractor::rpc::CallResult::Success(info)) = r
            .call(
                dynamo_router::RouterMsg::KvInfo,
                Some(Duration::from_secs(1)),
            )
            .await
        {
            text.push_str(&router_metrics(&info));
        }
    }
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        text,
    )
        .into_response()
}

/// The router's KV index state in the Prometheus text format.
fn router_metrics(info: &dynamo_router::KvInfo) -> String {
    use std::fmt::Write;
    let st = &info.stats;
    let mut out = String::new();
    for (name, help, v) in [
        (
            "kv_events_applied_total",
            "KV events applied to the index",
            st.applied,
        ),
        (
            "kv_event_duplicates_total",
            "KV events dropped as duplicates",
            st.duplicates,
        ),
        (
            "kv_event_gaps_total",
            "Gaps detected in a worker's KV event ids",
            st.gaps,
        ),
        (
            "kv_dumps_total",
            "Worker block tables loaded (start-up and gap repair)",
            st.dumps,
        ),
        (
            "kv_events_unknown_total",
            "KV events of a kind or tier this build does not know",
            st.unknown,
        ),
    ] {
        let _ = writeln!(out, "# HELP dynamo_router_{name} {help}");
        let _ = writeln!(out, "# TYPE dynamo_router_{name} counter");
        let _ = writeln!(out, "dynamo_router_{name} {v}");
    }
    let _ = writeln!(
        out,
        "# HELP dynamo_router_kv_index_blocks Blocks the router's index holds per worker and tier"
    );
    let _ = writeln!(out, "# TYPE dynamo_router_kv_index_blocks gauge");
    for (w, b) in &info.blocks {
        for (tier, n) in ["device", "host", "disk"].iter().zip(b) {
            let _ = writeln!(
                out,
                "dynamo_router_kv_index_blocks{{worker=\"{w}\",tier=\"{tier}\"}} {n}"
            );
        }
    }
    let _ = writeln!(
        out,
        "# HELP dynamo_router_worker_inflight Requests in flight per worker, all router replicas"
    );
    let _ = writeln!(out, "# TYPE dynamo_router_worker_inflight gauge");
    for (w, l) in &info.load {
        let _ = writeln!(
            out,
            "dynamo_router_worker_inflight{{worker=\"{w}\"}} {}",
            l.inflight
        );
    }
    let _ = writeln!(out, "# HELP dynamo_router_worker_pending_prefill_tokens Uncached prompt tokens not yet prefilled per worker, all replicas");
    let _ = writeln!(
        out,
        "# TYPE dynamo_router_worker_pending_prefill_tokens gauge"
    );
    for (w, l) in &info.load {
        let _ = writeln!(
            out,
            "dynamo_router_worker_pending_prefill_tokens{{worker=\"{w}\"}} {}",
            l.prefill_tokens
        );
    }
    let _ = writeln!(out, "# HELP dynamo_router_kv_config_mismatch Workers whose KV block size or hash salt differ from their model's (excluded from KV scoring)");
    let _ = writeln!(out, "# TYPE dynamo_router_kv_config_mismatch gauge");
    let _ = writeln!(
        out,
        "dynamo_router_kv_config_mismatch {}",
        info.mismatched.len()
    );
    for w in &info.mismatched {
        let _ = writeln!(
            out,
            "dynamo_router_kv_config_mismatch_worker{{worker=\"{w}\"}} 1"
        );
    }
    let t = &info.timings;
    out.push_str(&t.hashing.render(
        "dynamo_router_hashing_seconds",
        "Time to hash a request's blocks (KV-aware policies)",
    ));
    out.push_str(&t.find_matches.render(
        "dynamo_router_find_matches_seconds",
        "Time to query the KV index",
    ));
    out.push_str(&t.total.render(
        "dynamo_router_route_seconds",
        "Time of a whole routing decision",
    ));
    let _ = writeln!(out, "# HELP dynamo_router_info Routing policy in use");
    let _ = writeln!(out, "# TYPE dynamo_router_info gauge");
    let _ = writeln!(out, "dynamo_router_info{{policy=\"{}\"}} 1", info.policy);
    out
}

/// `POST /v1/dynamo/overlap` `{"model", "prompt": [token ids]}`: how many
/// leading KV blocks of the prompt each worker holds, by tier, according to
/// this gateway's router (for debugging routing decisions).
async fn overlap(
    State(s): State<Arc<Shared>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    #[derive(serde::Deserialize)]
    struct Req {
        model: String,
        prompt: Vec<u32>,
    }
    let body = body.map_err(|r| body_error(r, s.config.max_body_bytes))?;
    let req: Req = parse_body(&body)?;
    let router = s.router()?;
    let res = router
        .call(
            |reply| dynamo_router::RouterMsg::Overlap {
                model: dynamo_bus_schema::ModelName(req.model),
                token_ids: req.prompt,
                reply,
            },
            Some(Duration::from_secs(2)),
        )
        .await;
    let Ok(ractor::rpc::CallResult::Success(m)) = res else {
        return Err(ApiError::unavailable(
            "The router did not answer; retry shortly.",
        ));
    };
    let workers: serde_json::Map<String, Value> = m
        .into_iter()
        .map(|(w, o)| {
            (
                w.to_string(),
                json!({"blocks": o.blocks, "device": o.device, "host": o.host, "disk": o.disk}),
            )
        })
        .collect();
    Ok(Json(json!({"workers": workers})))
}

/// Used by tests: validate without serving.
pub fn validate_chat(pre: &Preprocessor, body: &[u8]) -> Result<ValidGenerate, ApiError> {
    let req: ChatRequest = parse_body(body)?;
    req.common.options()?;
    req.validate(pre)
}
