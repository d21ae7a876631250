//! The real CPU engine (SmolLM2-135M-Instruct) behind the gateway: real
//! answers over HTTP, streaming equal to non-streaming, and prefix caching
//! visible to clients as `cached_tokens` and a shorter time to first token.

use dynamo_integration::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

fn cpu_node(nats: &Nats, port: u16) -> Node {
    let cfg = node_config(
        "cpu",
        &nats.url,
        Some(port),
        0,
        &format!(
            "[[workers]]\ncount = 1\nengine = \"cpu\"\nmodel = \"{MODEL}\"\nheartbeat_ms = 500\n\n\
             [workers.cpu]\nthreads = 2\nnum_blocks = 256\n\n"
        ),
    )
    .replace("policy = \"least_loaded\"", "policy = \"kv_aware\"");
    Node::start(&cfg)
}

/// Streams a chat request; returns the time to the first content token,
/// the whole text and the usage object.
async fn stream_chat(http: &Http, messages: Value, max_tokens: u32) -> (Duration, String, Value) {
    let body = json!({
        "model": MODEL, "messages": messages, "max_tokens": max_tokens,
        "temperature": 0, "stream": true, "stream_options": {"include_usage": true}
    });
    let t0 = Instant::now();
    let mut r = http.open("/v1/chat/completions", &body).await;
    assert_eq!(r.status().as_u16(), 200);
    let mut buf = String::new();
    let mut ttft = None;
    let mut text = String::new();
    let mut usage = Value::Null;
    while let Some(chunk) = r.chunk().await.expect("stream chunk") {
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let Some(data) = event.lines().find_map(|l| l.strip_prefix("data: ")) else {
                continue;
            };
            if data == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(data).expect("chunk is JSON");
            if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
                if !c.is_empty() && ttft.is_none() {
                    ttft = Some(t0.elapsed());
                }
                text.push_str(c);
            }
            if !v["usage"].is_null() {
                usage = v["usage"].clone();
            }
        }
    }
    (ttft.expect("a content token"), text, usage)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_model_answers_over_http() {
    let nats = Nats::start();
    let port = free_port();
    let mut node = cpu_node(&nats, port);
    let http = Http::new(port);
    http.wait_ready(1, &mut node).await;

    let messages = json!([{"role": "user", "content": "What is the capital of France?"}]);
    let r = http
        .post(
            "/v1/chat/completions",
            &json!({"model": MODEL, "messages": messages, "max_tokens": 32, "temperature": 0}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.json);
    let answer = r.json["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(answer, "The capital of France is Paris.");
    assert_eq!(r.json["choices"][0]["finish_reason"], "stop");
    let (_, streamed, usage) = stream_chat(&http, messages, 32).await;
    assert_eq!(streamed, answer);
    assert_eq!(
        usage["completion_tokens"],
        r.json["usage"]["completion_tokens"]
    );

    // Completions with a string prompt and max_tokens.
    let r = http
        .post(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": "The capital of Japan is", "max_tokens": 3, "temperature": 0}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.json);
    assert_eq!(r.json["choices"][0]["finish_reason"], "length");
    assert_eq!(r.json["usage"]["completion_tokens"], 3);
    assert!(
        r.json["choices"][0]["text"]
            .as_str()
            .unwrap()
            .contains("Tokyo"),
        "{}",
        r.json
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_system_prompt_is_served_from_the_prefix_cache() {
    let nats = Nats::start();
    let port = free_port();
    let mut node = cpu_node(&nats, port);
    let http = Http::new(port);
    http.wait_ready(1, &mut node).await;

    let system = "You are the help desk of a public library. Be polite, be brief, and \
                  answer in one sentence. Opening hours are nine to five on weekdays and \
                  ten to two on Saturdays; the library is closed on Sundays. "
        .repeat(6);
    let ask = |q: &str| {
        json!([
            {"role": "system", "content": system},
            {"role": "user", "content": q}
        ])
    };
    let (ttft_first, _, first) = stream_chat(&http, ask("When do you open on Saturday?"), 8).await;
    let (ttft_second, _, second) = stream_chat(&http, ask("Are you open on Sunday?"), 8).await;
    eprintln!("TTFT uncached {ttft_first:?}, cached {ttft_second:?}");
    let prompt = second["prompt_tokens"].as_u64().unwrap();
    let cached = second["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(prompt > 300, "{second}");
    assert_eq!(
        first["prompt_tokens_details"]["cached_tokens"], 0,
        "{first}"
    );
    assert!(
        cached > 0 && cached >= prompt - 32,
        "cached {cached} of {prompt}"
    );
    assert!(
        ttft_second < ttft_first,
        "cached TTFT {ttft_second:?} is not below uncached {ttft_first:?}"
    );
}
