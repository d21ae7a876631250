//! A worker fronting an OpenAI-style engine server (vLLM, TensorRT-LLM),
//! through a real node, real NATS and real HTTP. vLLM itself needs a GPU,
//! so the server here answers in vLLM's published stream format
//! (`/v1/completions` with `return_token_ids` and `continuous_usage_stats`):
//! usage on every chunk, and the prompt tokens its prefix cache served
//! only in the usage chunk after the last choice
//! (`--enable-prompt-tokens-details`). The real llama.cpp server is
//! tested in `external_engine.rs` (`make test-engines`).

use axum::body::Body;
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::{get, post};
use axum::{Json, Router};
use dynamo_integration::*;
use serde_json::{json, Value};

/// Answers with `max_tokens` tokens (100, 101, …), and says its cache
/// served all of the prompt but its last token.
async fn completions(Json(b): Json<Value>) -> Response {
    let prompt = b["prompt"].as_array().map(Vec::len).unwrap_or(0) as u32;
    let n = b["max_tokens"].as_u64().unwrap_or(1) as u32;
    let usage = |k: u32| json!({"prompt_tokens": prompt, "completion_tokens": k, "total_tokens": prompt + k});
    let mut frames: Vec<String> = (0..n)
        .map(|i| {
            let finish = (i + 1 == n).then_some("length");
            let v = json!({"choices": [{"index": 0, "text": "", "token_ids": [100 + i], "finish_reason": finish}],
                           "usage": usage(i + 1)});
            format!("data: {v}\n\n")
        })
        .collect();
    let mut u = usage(n);
    u["prompt_tokens_details"] = json!({"cached_tokens": prompt.saturating_sub(1)});
    frames.push(format!("data: {}\n\n", json!({"choices": [], "usage": u})));
    frames.push("data: [DONE]\n\n".into());
    let stream = futures::stream::iter(frames.into_iter().map(Ok::<_, std::io::Error>));
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(stream))
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_tokens_an_engine_reports_after_its_last_choice_reach_the_usage() {
    let app = Router::new()
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/v1/completions", post(completions));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine_port = l.local_addr().unwrap().port();
    let mut server = tokio::task::JoinSet::new();
    server.spawn(async move { axum::serve(l, app).await.expect("the server runs") });

    let nats = Nats::start();
    let port = free_port();
    let worker = format!(
        "[[workers]]\ncount = 1\nengine = \"vllm\"\nmodel = \"{MODEL}\"\nheartbeat_ms = 500\n\n\
         [workers.external]\nurl = \"http://127.0.0.1:{engine_port}\"\nserved_model = \"m\"\n\
         metrics_path = \"\"\nhealth_interval_ms = 200\n\n"
    );
    let mut node = Node::start(&node_config("n", &nats.url, Some(port), 0, &worker));
    let http = Http::new(port);
    http.wait_ready(1, &mut node).await;

    let content = "What is the capital of France?";
    let prompt_len = chat_tokens(content).len() as u64;
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 3});
    let r = http.post("/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.json);
    assert_eq!(r.json["usage"]["completion_tokens"], 3, "{}", r.json);
    assert_eq!(r.json["usage"]["prompt_tokens"], prompt_len);
    // The engine's own count, from its usage chunk (before, 0).
    assert_eq!(
        r.json["usage"]["prompt_tokens_details"]["cached_tokens"],
        prompt_len - 1,
        "{}",
        r.json
    );
    // Streamed, with usage: the same count in the usage chunk.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let (status, events) = http.stream("/v1/chat/completions", &sbody).await;
    assert_eq!(status, 200);
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(
        usage["usage"]["prompt_tokens_details"]["cached_tokens"],
        prompt_len - 1,
        "{usage}"
    );
    // And in the gateway's counter, once per request.
    assert_eq!(
        http.metric("dynamo_gateway_cached_tokens_total").await,
        2 * (prompt_len - 1)
    );
}
