//! HTTP handlers: OpenAI endpoints, health and metrics.
//!
//! A generate request: parse the body (cheap) → the model's preprocessor
//! (404 for an unknown model) → admission (429/503 past the model's
//! limits, before any tokenizing) → template and tokenize (large bodies on
//! the blocking pool) → route and send each prompt → JSON or SSE
//! ([`crate::respond`]). A prompt routed to a worker whose model card
//! differs from the one it was tokenized with is tokenized again with
//! that card, once.

use crate::dispatch::DispatchError;
use crate::error::ApiError;
use crate::generate::Generation;
use crate::models;
use crate::openai::{parse_body, ChatRequest, CompletionRequest, Parsed, ValidGenerate};
use crate::respond::{collect_response, stream_response, WORKER_HEADER};
use crate::router_metrics::router_metrics;
use crate::shared::Shared;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use dynamo_model::Preprocessor;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Endpoint {
    Chat,
    Completions,
}

impl Endpoint {
    pub fn label(self) -> &'static str {
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
        .route("/v1/models/{*id}", get(get_model))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/dynamo/overlap", post(overlap))
        .route("/v1/dynamo/cluster", get(crate::dashboard::cluster))
        .route("/dashboard", get(crate::dashboard::page))
        .fallback(|uri: Uri| async move { ApiError::not_found(uri.path()) })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        .layer(DefaultBodyLimit::max(limit))
        .with_state(shared)
}

fn body_error(r: BytesRejection, limit: usize) -> ApiError {
    if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::too_large(limit)
    } else if let Some(after) = crate::conn::stalled(&r) {
        ApiError::body_stalled(after)
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

async fn chat(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    serve(s, headers, body, Endpoint::Chat).await
}

async fn completions(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    serve(s, headers, body, Endpoint::Completions).await
}

async fn serve(
    s: Arc<Shared>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    ep: Endpoint,
) -> Response {
    let t0 = Instant::now();
    s.metrics.inflight.inc();
    let _guard = InflightGuard(&s);
    let caller = s.auth.authenticate(&headers);
    let res = match &caller {
        Ok(c) => match s
            .auth
            .admit(c, t0.into_std())
            .and_then(|()| plain_body(&headers))
        {
            Ok(()) => handle(s.clone(), c, body, ep, t0).await,
            Err(e) => Err(e),
        },
        Err(e) => Err(e.clone()),
    };
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
    if s.auth.enabled() {
        let (key, id) = caller
            .map(|c| s.auth.label(&c))
            .unwrap_or_else(|_| ("-".into(), "-".into()));
        s.metrics
            .key_requests
            .with_label_values(&[key.as_str(), id.as_str(), resp.status().as_str()])
            .inc();
    }
    resp
}

/// A compressed body is refused (415) rather than misread as broken JSON.
fn plain_body(headers: &HeaderMap) -> Result<(), ApiError> {
    match headers.get(axum::http::header::CONTENT_ENCODING) {
        None => Ok(()),
        Some(v) => {
            let v = v.to_str().unwrap_or("?").trim();
            if v.is_empty() || v.eq_ignore_ascii_case("identity") {
                Ok(())
            } else {
                Err(ApiError::unsupported_encoding(v))
            }
        }
    }
}

async fn handle(
    s: Arc<Shared>,
    caller: &crate::auth::Caller,
    body: Result<Bytes, BytesRejection>,
    ep: Endpoint,
    t0: Instant,
) -> Result<Response, ApiError> {
    if !s.is_accepting() {
        s.metrics
            .rejected
            .with_label_values(&["shutting_down"])
            .inc();
        return Err(ApiError::unavailable("This gateway is shutting down."));
    }
    let body = body.map_err(|r| body_error(r, s.config.max_body_bytes))?;
    let parsed = Arc::new(match ep {
        Endpoint::Chat => Parsed::Chat(parse_body::<ChatRequest>(&body)?),
        Endpoint::Completions => Parsed::Completions(parse_body::<CompletionRequest>(&body)?),
    });
    let common = parsed.common();
    let opts = common.options(&s.config)?;
    let model = common.model.clone();
    s.auth.allow_model(caller, &model)?;
    let timeout = opts
        .timeout_ms
        .map(Duration::from_millis)
        .unwrap_or(s.config.request_timeout);
    let deadline = t0 + timeout;
    let max_migrations = opts.max_migrations.unwrap_or(s.config.max_migrations);
    s.feed.arrived(&model);
    // One hold per request, however many times it is retried.
    let hold_until = deadline.min(tokio::time::Instant::now() + s.config.hold_for_workers);
    let mut loaded = loop {
        match s.models.get(&s, &model).await {
            Err(e) if no_capacity(&e) => hold_for_workers(&s, &model, hold_until, e).await?,
            r => break r?,
        }
    };
    let (permit, waited) = s.admission.admit(&model, deadline).await.map_err(|r| {
        s.metrics.rejected.with_label_values(&[r.reason()]).inc();
        match r {
            crate::admission::Refusal::QueueFull => ApiError::too_many_requests(format!(
                "Too many requests for {model}: its queue is full. Retry shortly."
            )),
            crate::admission::Refusal::QueueTimeout(w) => ApiError::overloaded(
                format!(
                    "{model} is overloaded: the request waited {} ms for a place. Retry shortly.",
                    w.as_millis()
                ),
                "queue_timeout",
            ),
        }
    })?;
    s.metrics.queue_wait.observe(waited.as_secs_f64());
    s.feed.admitted(&model, waited.as_millis() as u64);
    // At most two passes: the second with the card a routed worker has.
    let mut started = Vec::new();
    for pass in 0..2 {
        let (p, pre) = (parsed.clone(), loaded.pre.clone());
        let gens: Vec<ValidGenerate> = s
            .preprocess
            .run(body.len(), move || p.validate(&pre))
            .await??;
        if pass == 0 {
            let mut charged = 0u64;
            for g in &gens {
                s.metrics.input_tokens.inc_by(g.token_ids.len() as u64);
                s.feed.prompt(&model, g.token_ids.len());
                charged += g.token_ids.len() as u64 + g.sampling.max_tokens as u64;
            }
            if s.auth.enabled() {
                s.auth
                    .charge_tokens(caller, charged, std::time::Instant::now())?;
                let (key, id) = s.auth.label(caller);
                s.metrics
                    .key_tokens
                    .with_label_values(&[key.as_str(), id.as_str()])
                    .inc_by(charged);
            }
        }
        // The second pass takes whichever card the worker has.
        let want = (pass == 0).then_some(loaded.digest);
        started.clear();
        let mut changed = None;
        for mut v in gens {
            v.routing = opts.routing;
            // Not with stop strings: the gateway finds them in the text and
            // stops the worker, which a batch would make late (and its
            // usage count long).
            v.frame_batch = (!opts.stream && v.stop.is_empty() && !s.config.frame_batch.is_zero())
                .then_some(s.config.frame_batch);
            // Prompts of this batch that a worker took free room as they
            // end: a later one waits for it (up to a minute) rather than
            // failing the batch.
            v.patient = !started.is_empty();
            // A copy to try again with only where requests may be held.
            let again = (!s.config.hold_for_workers.is_zero()).then(|| v.clone());
            let mut next = Some(v);
            let res = loop {
                let Some(v) = next.take().or_else(|| again.clone()) else {
                    break Err(DispatchError::Api(ApiError::internal("no request to send")));
                };
                match Generation::start(
                    s.clone(),
                    loaded.pre.clone(),
                    v,
                    want,
                    deadline,
                    t0,
                    max_migrations,
                )
                .await
                {
                    // The card is known here, so a model the router does
                    // not know has no worker now (scaled to zero).
                    Err(DispatchError::Api(e))
                        if again.is_some()
                            && (no_capacity(&e) || e.code == Some("model_not_found")) =>
                    {
                        hold_for_workers(&s, &model, hold_until, e).await?
                    }
                    r => break r,
                }
            };
            match res {
                Ok(g) => started.push(g),
                Err(DispatchError::Api(e)) => return Err(e),
                Err(DispatchError::CardChanged(d)) => {
                    changed = Some(d);
                    break;
                }
            }
        }
        match changed {
            None => break,
            Some(d) => {
                // Dropping what started releases it.
                started.clear();
                loaded = s.models.get_card(&s, &model, d).await?;
            }
        }
    }
    let workers: Vec<String> = started
        .iter()
        .filter_map(|g| g.worker_id().map(|w| w.to_string()))
        .collect();
    let out = if opts.stream {
        // The stream task observes the duration when the stream ends.
        Ok(stream_response(
            s.clone(),
            started,
            ep,
            model,
            opts,
            t0,
            permit,
        ))
    } else {
        let r = collect_response(started, ep, &model).await;
        drop(permit);
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

/// No worker serves the model at all (not: all are busy).
fn no_capacity(e: &ApiError) -> bool {
    e.code == Some("no_workers_available")
}

/// Holds a request while no worker serves its model (after a scale to
/// zero the planner wakes one on seeing held requests), until `until` (the
/// earlier of the request's deadline and the gateway's hold limit, fixed
/// when the request arrived); `Ok` to try again, or the 503. Every call
/// waits at least one poll, so a worker that is listed but cannot take the
/// request yet (starting, draining, prefill-only) is no busy loop.
async fn hold_for_workers(
    s: &Shared,
    model: &str,
    until: tokio::time::Instant,
    cause: ApiError,
) -> Result<(), ApiError> {
    use std::sync::atomic::Ordering;
    if s.config.hold_for_workers.is_zero() {
        return Err(cause);
    }
    struct Held<'a>(&'a std::sync::atomic::AtomicU32);
    impl Drop for Held<'_> {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::Relaxed);
        }
    }
    if s.feed.held.fetch_add(1, Ordering::Relaxed) >= s.config.max_held {
        s.feed.held.fetch_sub(1, Ordering::Relaxed);
        s.metrics.rejected.with_label_values(&["held_full"]).inc();
        return Err(cause);
    }
    let _held = Held(&s.feed.held);
    let t0 = tokio::time::Instant::now();
    loop {
        if tokio::time::Instant::now() + HOLD_POLL >= until {
            s.metrics
                .rejected
                .with_label_values(&["held_timeout"])
                .inc();
            return Err(ApiError::unavailable(format!(
                "No worker for {model} became ready in time (the request's deadline or the gateway's hold limit; held {} ms this time). Retry shortly.",
                t0.elapsed().as_millis()
            )));
        }
        tokio::time::sleep(HOLD_POLL).await;
        let up = models::list(s)
            .await
            .map(|all| {
                all.iter()
                    .any(|m| m.card.name.0 == model && !m.workers.is_empty())
            })
            .unwrap_or(false);
        if up {
            return Ok(());
        }
    }
}

/// How often a held request looks for a worker.
const HOLD_POLL: Duration = Duration::from_millis(200);

/// A place among the concurrent status requests, or 503.
fn control(s: &Shared) -> Result<dynamo_runtime::Ticket, ApiError> {
    s.control.try_enter().ok_or_else(|| {
        ApiError::overloaded("Too many status requests at once; retry shortly.", "busy")
    })
}

async fn list_models(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    let caller = s.auth.authenticate(&headers)?;
    let _place = control(&s)?;
    let models = models::list(&s).await?;
    let data: Vec<Value> = models
        .iter()
        .filter(|m| s.auth.allow_model(&caller, &m.card.name.0).is_ok())
        .map(|m| model_object(&s, m))
        .collect();
    Ok(Json(json!({"object": "list", "data": data})))
}

fn model_object(s: &Shared, m: &dynamo_router::registry::ModelEntry) -> Value {
    json!({
        "id": m.card.name.0, "object": "model", "created": s.started_unix_s, "owned_by": "dynamo",
        "context_length": m.card.context_length, "block_size": m.card.block_size,
        "workers": m.workers.len(),
    })
}

/// `GET /v1/models/{id}`: one model (404 `model_not_found` for a model
/// no worker serves or the caller's key may not use).
async fn get_model(
    State(s): State<Arc<Shared>>,
    id: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    let caller = s.auth.authenticate(&headers)?;
    let Path(id) =
        id.map_err(|e| ApiError::invalid(None, format!("Bad model id in the path: {e}")))?;
    let _place = control(&s)?;
    let models = models::list(&s).await?;
    models
        .iter()
        .find(|m| m.card.name.0 == id && s.auth.allow_model(&caller, &id).is_ok())
        .map(|m| Json(model_object(&s, m)))
        .ok_or_else(|| ApiError::model_not_found(&id))
}

async fn health(State(s): State<Arc<Shared>>) -> Response {
    let place = match control(&s) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let models = models::list(&s).await.unwrap_or_default();
    drop(place);
    let workers: usize = models.iter().map(|m| m.workers.len()).sum();
    let accepting = s.is_accepting();
    // Without the bus this gateway can serve nothing: a load balancer
    // should send its traffic elsewhere until it is back.
    let bus = s.bus.is_connected();
    let body = json!({
        "status": if !accepting { "draining" } else if !bus { "bus_disconnected" } else { "ok" },
        "gateway_id": s.gateway_id.to_string(),
        "models": models.iter().map(|m| m.card.name.0.clone()).collect::<Vec<_>>(),
        "workers": workers,
    });
    let code = if accepting && bus {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(body)).into_response()
}

/// The gateway's and its process's metrics. With API keys on, only for a
/// caller with a valid key: the exposition names keys, models and workers.
async fn metrics(State(s): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    if let Err(e) = s.auth.authenticate(&headers) {
        return e.into_response();
    }
    let _place = match control(&s) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    s.metrics.queued.set(s.admission.waiting_total() as i64);
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

/// `POST /v1/dynamo/overlap` `{"model", "prompt": [token ids]}`: how many
/// leading KV blocks of the prompt each worker holds, by tier, according to
/// this gateway's router (for debugging routing decisions).
async fn overlap(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let caller = s.auth.authenticate(&headers)?;
    /// Token ids, or text tokenized as `/v1/completions` tokenizes a string prompt.
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Prompt {
        Tokens(Vec<u32>),
        Text(String),
    }
    #[derive(serde::Deserialize)]
    struct Req {
        model: String,
        prompt: Prompt,
    }
    let _place = control(&s)?;
    let body = body.map_err(|r| body_error(r, s.config.max_body_bytes))?;
    let req: Req = parse_body(&body)?;
    s.auth.allow_model(&caller, &req.model)?;
    // A model no worker serves is a 404, whichever form the prompt has.
    let loaded = s.models.get(&s, &req.model).await?;
    let prompt = match req.prompt {
        Prompt::Tokens(t) => t,
        Prompt::Text(text) => loaded
            .pre
            .tokenizer
            .encode(&text)
            .map_err(|e| ApiError::invalid(Some("prompt".into()), e.to_string()))?,
    };
    let tokens = prompt.len();
    let req = (req.model, prompt);
    let router = s.router()?;
    let res = router
        .call(
            |reply| dynamo_router::RouterMsg::Overlap {
                model: dynamo_bus_schema::ModelName(req.0),
                token_ids: req.1,
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
    Ok(Json(json!({"workers": workers, "tokens": tokens})))
}

/// Used by tests: validate without serving.
pub fn validate_chat(pre: &Preprocessor, body: &[u8]) -> Result<ValidGenerate, ApiError> {
    let req: ChatRequest = parse_body(body)?;
    req.common
        .options(&crate::config::GatewayConfig::default())?;
    req.validate(pre)
}
