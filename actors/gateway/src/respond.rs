//! Turning generations into OpenAI responses: one JSON body, or an SSE
//! stream of chunks ending with `data: [DONE]`.
//!
//! Invariants: a stream sends its chunks in order, then the usage chunk
//! when asked, then `[DONE]`; an error mid-stream is sent as an OpenAI
//! error object and ends the stream; a client that goes away drops the
//! generations (which cancels them on their workers) at once, even while
//! nothing is being sent; the SSE channel holds at most 64 events (the
//! stream task waits for the client, and the frames back up into the
//! request's bounded inbox channel).

use crate::admission::Permit;
use crate::error::ApiError;
use crate::generate::{GenEvent, Generation, Usage};
use crate::handlers::Endpoint;
use crate::openai::ValidOptions;
use crate::shared::Shared;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::{self, StreamExt};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// Response header naming the worker(s) that served the request.
pub const WORKER_HEADER: &str = "x-dynamo-worker";

/// Renders stream chunks around a prefix built once per response.
struct ChunkWriter {
    /// `{"id":…,"object":…,"created":…,"model":…,"choices":`, with
    /// `"usage":null,` before `"choices"` when the client asked for usage
    /// (OpenAI's chunks all carry the field then; only the last has it).
    prefix: String,
    /// The same without `usage`, for the usage chunk itself.
    plain: String,
}

impl ChunkWriter {
    fn new(id: &str, object: &str, created: u64, model: &str, include_usage: bool) -> Self {
        let q = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into());
        let head = format!(
            "{{\"id\":{},\"object\":{},\"created\":{created},\"model\":{},",
            q(id),
            q(object),
            q(model)
        );
        ChunkWriter {
            prefix: if include_usage {
                format!("{head}\"usage\":null,\"choices\":")
            } else {
                format!("{head}\"choices\":")
            },
            plain: format!("{head}\"choices\":"),
        }
    }

    /// A chunk with arbitrary `choices` (and optionally one more top-level
    /// field: `usage`, or `timings` on a choice's last chunk).
    fn raw(&self, choices: &Value, extra: Option<(&str, &Value)>) -> Event {
        let prefix = match extra {
            Some(("usage", _)) => &self.plain,
            _ => &self.prefix,
        };
        let mut s = String::with_capacity(prefix.len() + 128);
        s.push_str(prefix);
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

pub async fn collect_response(
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

/// An SSE response over `gens`; `permit` (the request's admission) is
/// held until the stream ends.
pub fn stream_response(
    s: Arc<Shared>,
    gens: Vec<Generation>,
    ep: Endpoint,
    model: String,
    opts: ValidOptions,
    t0: Instant,
    permit: Permit,
) -> Response {
    let id = response_id(ep, &gens[0]);
    let created = now_s();
    let object = match ep {
        Endpoint::Chat => "chat.completion.chunk",
        Endpoint::Completions => "text_completion",
    };
    let chunks = ChunkWriter::new(&id, object, created, &model, opts.include_usage);
    let chunk_prefix = chunks.prefix.clone();
    let chunk = move |choices: Value, extra: Option<(&str, Value)>| -> Event {
        chunks.raw(&choices, extra.as_ref().map(|(k, v)| (*k, v)))
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Event, Infallible>>(64);
    let n = gens.len();
    // The task ends when every generation ends or the client goes away (send fails),
    // which drops the generations and cancels them on their workers.
    let spawner = s.spawner.clone();
    spawner.spawn_transient("sse", async move {
        let metrics = s.clone();
        let how = async move {
        let _permit = permit;
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
                    return "client_gone";
                }
            }
        }
        let mut usage = Usage::default();
        loop {
            // A client that leaves while nothing is being sent (a long
            // prefill) is noticed at once, not at the next event.
            let next = tokio::select! {
                next = all.next() => next,
                _ = tx.closed() => return "client_gone",
                _ = s.grace_over.cancelled() => {
                    let e = ApiError::unavailable("The gateway is shutting down; retry the request.");
                    let _ = tx.send(Ok(Event::default().data(e.body().to_string()))).await;
                    return "shutdown";
                }
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
                    return "error";
                }
            };
            if tx.send(Ok(event)).await.is_err() {
                return "client_gone";
            }
        }
        if opts.include_usage
            && tx
                .send(Ok(chunk(json!([]), Some(("usage", usage.json())))))
                .await
                .is_err()
        {
            return "client_gone";
        }
        let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
        s.metrics
            .request_duration
            .observe(t0.elapsed().as_secs_f64());
        "done"
        }
        .await;
        metrics.metrics.stream_endings.with_label_values(&[how]).inc();
    });
    Sse::new(tokio_stream::wrappers::ReceiverStream::new(rx))
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}
