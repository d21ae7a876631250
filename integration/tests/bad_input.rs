//! Bad input end to end: each malformed or unsupported request gets the
//! right HTTP status and an OpenAI error object naming the field, from a
//! real node (real nats-server, HTTP, tokenizer and a mocker engine).

use dynamo_integration::*;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_the_right_status_and_error_object() {
    let (_nats, _node, http) = single_node(1).await;
    let chat = |extra: Value| {
        let mut b = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let cases: Vec<(&str, Value, u16, &str, Option<&str>)> = vec![
        (
            "n=2",
            chat(json!({"n": 2})),
            400,
            "invalid_request_error",
            Some("n"),
        ),
        (
            "temperature",
            chat(json!({"temperature": 3.5})),
            400,
            "invalid_request_error",
            Some("temperature"),
        ),
        (
            "top_p",
            chat(json!({"top_p": 0.0})),
            400,
            "invalid_request_error",
            Some("top_p"),
        ),
        (
            "max_tokens=0",
            chat(json!({"max_tokens": 0})),
            400,
            "invalid_request_error",
            Some("max_tokens"),
        ),
        (
            "stop x5",
            chat(json!({"stop": ["a", "b", "c", "d", "e"]})),
            400,
            "invalid_request_error",
            Some("stop"),
        ),
        (
            "routing weight",
            chat(json!({"routing": {"overlap_weight": -1.0}})),
            400,
            "invalid_request_error",
            Some("routing.overlap_weight"),
        ),
        (
            "wrong type",
            chat(json!({"temperature": "hot"})),
            400,
            "invalid_request_error",
            None,
        ),
        (
            "no messages",
            json!({"model": MODEL, "messages": []}),
            400,
            "invalid_request_error",
            Some("messages"),
        ),
        (
            "missing model",
            json!({"messages": [{"role": "user", "content": "hi"}]}),
            400,
            "invalid_request_error",
            Some("model"),
        ),
        (
            "bad role",
            json!({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}),
            400,
            "invalid_request_error",
            Some("messages.[0].role"),
        ),
        (
            "unknown model",
            json!({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}),
            404,
            "invalid_request_error",
            Some("model"),
        ),
        (
            "too long",
            chat(json!({"max_tokens": 8190})),
            400,
            "invalid_request_error",
            Some("messages"),
        ),
        // Options this server does not implement are refused, not ignored.
        (
            "json mode",
            chat(json!({"response_format": {"type": "json_object"}})),
            400,
            "invalid_request_error",
            Some("response_format"),
        ),
        (
            "logprobs",
            chat(json!({"logprobs": true, "top_logprobs": 3})),
            400,
            "invalid_request_error",
            Some("logprobs"),
        ),
        (
            "tools",
            chat(json!({"tools": [{"type": "function", "function": {"name": "f"}}]})),
            400,
            "invalid_request_error",
            Some("tools"),
        ),
        (
            "tool calls in the history",
            json!({"model": MODEL, "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ]},
                {"role": "tool", "tool_call_id": "1", "content": "42"}
            ]}),
            400,
            "invalid_request_error",
            Some("messages.[1].tool_calls"),
        ),
    ];
    for (name, body, status, kind, param) in cases {
        let r = http.post("/v1/chat/completions", &body).await;
        assert_error(&r, status, kind);
        if let Some(p) = param {
            assert_eq!(r.json["error"]["param"], p, "{name}: {}", r.json);
        }
    }
    // The same options left at their defaults (as SDKs send them) serve.
    let r = http
        .post(
            "/v1/chat/completions",
            &chat(json!({
                "logprobs": false,
                "presence_penalty": 0,
                "frequency_penalty": 0.0,
                "response_format": {"type": "text"},
                "tools": [],
                "user": "someone",
            })),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.json);
    // Completions: `logprobs` is a count there, and 0 still asks for some.
    for (extra, status) in [
        (json!({"logprobs": 0}), 400),
        (json!({"logprobs": 2, "best_of": 1}), 400),
        // A benchmark's recipe: every request runs to max_tokens anyway.
        (
            json!({"best_of": 1, "min_tokens": 4, "ignore_eos": true}),
            200,
        ),
    ] {
        let mut body = json!({"model": MODEL, "prompt": "hi", "max_tokens": 4});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = http.post("/v1/completions", &body).await;
        assert_eq!(r.status, status, "{extra}: {}", r.json);
        if status == 400 {
            assert_eq!(r.json["error"]["param"], "logprobs", "{}", r.json);
        }
    }
    let r = http
        .post("/v1/chat/completions", &chat(json!({"max_tokens": 8190})))
        .await;
    assert_eq!(r.json["error"]["code"], "context_length_exceeded");
    let r = http
        .post(
            "/v1/chat/completions",
            &json!({"model": "gpt-9", "messages": []}),
        )
        .await;
    assert_eq!(r.json["error"]["code"], "model_not_found");

    // Malformed JSON.
    let r = http.post_raw("/v1/chat/completions", "{\"model\": ").await;
    assert_error(&r, 400, "invalid_request_error");
    // Completions: out-of-vocabulary and negative token ids, empty prompt, mixed list.
    for prompt in [
        json!([1, 2, 999999]),
        json!([1, -2]),
        json!(""),
        json!([]),
        json!([[1], "x"]),
        json!(5),
    ] {
        let r = http
            .post(
                "/v1/completions",
                &json!({"model": MODEL, "prompt": prompt}),
            )
            .await;
        assert_error(&r, 400, "invalid_request_error");
        assert_eq!(r.json["error"]["param"], "prompt", "{prompt}: {}", r.json);
    }
    // A prompt longer than the context.
    let long: Vec<u32> = vec![300; 9000];
    let r = http
        .post(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": long, "max_tokens": 1}),
        )
        .await;
    assert_error(&r, 400, "invalid_request_error");
    assert_eq!(r.json["error"]["code"], "context_length_exceeded");
    // A prompt that fills the context, with no max_tokens: one token more
    // is needed, and the message's sum adds up.
    let full: Vec<u32> = vec![300; 8192];
    let r = http
        .post("/v1/completions", &json!({"model": MODEL, "prompt": full}))
        .await;
    assert_eq!(r.json["error"]["code"], "context_length_exceeded");
    let msg = r.json["error"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("you requested 8193 tokens (8192 in the prompt, 1 for the completion)"),
        "{msg}"
    );
    // What OpenAI's API allows or refuses, as it does.
    for (body, status, param) in [
        // Optional fields sent as null take their defaults.
        (
            chat(json!({"stream": null, "ignore_eos": null, "max_tokens": 2})),
            200,
            None,
        ),
        // vLLM's "top_k off".
        (chat(json!({"top_k": -1, "max_tokens": 2})), 200, None),
        (chat(json!({"top_k": -2})), 400, Some("top_k")),
        (
            chat(json!({"stream_options": {"include_usage": true}})),
            400,
            Some("stream_options"),
        ),
        (
            chat(json!({"tool_choice": "required"})),
            400,
            Some("tool_choice"),
        ),
        (
            chat(json!({"tool_choice": "auto", "max_tokens": 2})),
            200,
            None,
        ),
        (chat(json!({"user": 123})), 400, Some("user")),
        (chat(json!({"model": 123})), 400, Some("model")),
        (chat(json!({"max_tokens": "5"})), 400, Some("max_tokens")),
        (
            chat(json!({"messages": [{"role": "user"}]})),
            400,
            Some("messages.[0].content"),
        ),
        (
            chat(json!({"messages": [{"role": "user", "content": null}]})),
            400,
            Some("messages.[0].content"),
        ),
        (
            chat(json!({"messages": [{"role": "user", "content": []}]})),
            400,
            Some("messages.[0].content"),
        ),
        (
            chat(json!({"messages": [{"role": 7, "content": "hi"}]})),
            400,
            Some("messages.[0].role"),
        ),
        (
            chat(
                json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null}, {"role": "user", "content": "more"}], "max_tokens": 2}),
            ),
            200,
            None,
        ),
    ] {
        let r = http.post("/v1/chat/completions", &body).await;
        assert_eq!(r.status, status, "{body}: {}", r.json);
        if let Some(p) = param {
            assert_error(&r, 400, "invalid_request_error");
            assert_eq!(r.json["error"]["param"], p, "{body}: {}", r.json);
        }
    }
    let r = http
        .post(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": "hi", "max_tokens": 2, "echo": null, "stream": null}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.json);
    // A compressed body: 415, not a JSON error.
    let r = http
        .client
        .post(format!("{}/v1/chat/completions", http.base))
        .header("content-type", "application/json")
        .header("content-encoding", "gzip")
        .body(vec![0x1f, 0x8b, 8, 0])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 415);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["code"], "unsupported_content_encoding", "{e}");
    // Body over the configured limit (64 KiB in these tests) → 413.
    let big = json!({"model": MODEL, "prompt": "x".repeat(70_000)});
    let r = http.post("/v1/completions", &big).await;
    assert_error(&r, 413, "invalid_request_error");
    // Unknown path and wrong method.
    let r = http.post("/v1/embeddingz", &json!({})).await;
    assert_error(&r, 404, "invalid_request_error");
    let r = http
        .client
        .get(format!("{}/v1/chat/completions", http.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error");

    // Errors are counted in /metrics, with the request metrics.
    let m = http.metrics_text().await;
    assert!(
        m.contains("dynamo_gateway_errors_total{kind=\"model_not_found\"}"),
        "{m}"
    );
    assert!(m.contains("dynamo_gateway_requests_total"), "{m}");
}
