//! The request path end to end: real nats-server, real dynamo-node processes,
//! real HTTP, the real SmolLM2 tokenizer and chat template, mocker engines.

use dynamo_integration::*;
use serde_json::{json, Value};

/// What one gateway-inbox message carries: one frame, or a mux's frames.
enum Frame {
    Tokens(dynamo_bus_schema::FrameTokens),
    Other(dynamo_bus_schema::RequestId),
}

/// The text of a streamed completion (status 200).
async fn streamed_text(http: &Http, body: &Value) -> String {
    let (status, events) = http.stream("/v1/completions", body).await;
    assert_eq!(status, 200);
    events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_string))
        .collect()
}

/// A subscription to every gateway inbox of the test namespace.
async fn watch_frames(nats_url: &str) -> (async_nats::Client, async_nats::Subscriber) {
    let client = async_nats::connect(nats_url).await.unwrap();
    let sub = client
        .subscribe("dynamo.it.gateway.*.frames")
        .await
        .unwrap();
    client.flush().await.unwrap();
    (client, sub)
}

fn frames_in(payload: &[u8]) -> Vec<Frame> {
    use dynamo_bus_schema::*;
    let one = |b: &[u8]| match peek_kind(b).unwrap().0 {
        k if k == FrameTokens::KIND => Frame::Tokens(decode(b).unwrap()),
        k if k == FrameStarted::KIND => Frame::Other(decode::<FrameStarted>(b).unwrap().request_id),
        k if k == FrameFinished::KIND => {
            Frame::Other(decode::<FrameFinished>(b).unwrap().request_id)
        }
        k if k == FrameTimings::KIND => Frame::Other(decode::<FrameTimings>(b).unwrap().request_id),
        // A quiet stream's heartbeat, or an error, may come too.
        k if k == FrameHeartbeat::KIND => {
            Frame::Other(decode::<FrameHeartbeat>(b).unwrap().request_id)
        }
        k if k == FrameError::KIND => Frame::Other(decode::<FrameError>(b).unwrap().request_id),
        k => panic!("unexpected frame kind {k:?}"),
    };
    match peek_kind(payload).unwrap().0 {
        k if k == FrameMux::KIND => decode::<FrameMux>(payload)
            .unwrap()
            .frames
            .iter()
            .map(|f| one(f))
            .collect(),
        _ => vec![one(payload)],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_and_completions_return_the_mockers_tokens_detokenized() {
    let (_nats, _node, http) = single_node(2).await;

    // /v1/models lists the model.
    let r = http
        .client
        .get(format!("{}/v1/models", http.base))
        .send()
        .await
        .unwrap();
    let models: Value = r.json().await.unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], MODEL);
    // And one model by its id, as OpenAI's `GET /v1/models/{id}`.
    for (id, status) in [(MODEL, 200), ("gpt-9", 404), ("%FF", 400)] {
        let r = http
            .client
            .get(format!("{}/v1/models/{id}", http.base))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), status, "{id}");
        let m: Value = r.json().await.unwrap();
        match status {
            200 => assert_eq!(m, models["data"][0], "the list's entry"),
            404 => assert_eq!(m["error"]["code"], "model_not_found", "{m}"),
            _ => assert_eq!(m["error"]["type"], "invalid_request_error", "{m}"),
        }
    }

    // Non-streaming chat: text = mocker tokens through the real tokenizer, usage matches.
    let content = "What is the capital of France?";
    let prompt = chat_tokens(content);
    let (_, want) = expected_text(&prompt, 12);
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 12});
    let r = http.post("/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.json);
    assert_eq!(r.json["object"], "chat.completion");
    assert_eq!(r.json["choices"][0]["message"]["role"], "assistant");
    assert_eq!(r.json["choices"][0]["message"]["content"], want.as_str());
    assert_eq!(r.json["choices"][0]["finish_reason"], "length");
    assert_eq!(r.json["usage"]["prompt_tokens"], prompt.len());
    assert_eq!(r.json["usage"]["completion_tokens"], 12);
    assert_eq!(r.json["usage"]["total_tokens"], prompt.len() + 12);
    assert!(r.json["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64());

    // Streaming chat: role chunk, content deltas that concatenate to the same text,
    // a finish chunk, a usage chunk, then [DONE].
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let (status, events) = http.stream("/v1/chat/completions", &sbody).await;
    assert_eq!(status, 200);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, want);
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    let finish: Vec<&Value> = chunks
        .iter()
        .filter(|c| !c["choices"][0]["finish_reason"].is_null())
        .collect();
    assert_eq!(finish.len(), 1);
    assert_eq!(finish[0]["choices"][0]["finish_reason"], "length");
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 12);
    assert_eq!(usage["prompt_tokens"], prompt.len());
    // As OpenAI's: with usage asked for, every other chunk says `null`.
    assert!(chunks[..chunks.len() - 1]
        .iter()
        .all(|c| c.get("usage") == Some(&Value::Null)));
    assert_eq!(chunks.last().unwrap()["choices"], json!([]));

    // Completions with a string prompt (no chat template).
    let ptoks = preprocessor().tokenizer.encode("Once upon a time").unwrap();
    let (_, want) = expected_text(&ptoks, 7);
    let r = http
        .post(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 7}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.json);
    assert_eq!(r.json["object"], "text_completion");
    assert_eq!(r.json["choices"][0]["text"], want.as_str());
    assert_eq!(r.json["usage"]["prompt_tokens"], ptoks.len());

    // Token-id prompt, and a list of token-id prompts (one choice each).
    let ids: Vec<u32> = (1000..1040).collect();
    let (_, want_ids) = expected_text(&ids, 5);
    let r = http
        .post(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": ids, "max_tokens": 5}),
        )
        .await;
    assert_eq!(r.json["choices"][0]["text"], want_ids.as_str());
    assert_eq!(r.json["usage"]["prompt_tokens"], 40);
    let ids2: Vec<u32> = (2000..2010).collect();
    let (_, want2) = expected_text(&ids2, 5);
    let r = http
        .post(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": [ids, ids2], "max_tokens": 5}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.json);
    assert_eq!(r.json["choices"][0]["text"], want_ids.as_str());
    assert_eq!(r.json["choices"][1]["index"], 1);
    assert_eq!(r.json["choices"][1]["text"], want2.as_str());
    assert_eq!(r.json["usage"]["prompt_tokens"], 50);
    assert_eq!(r.json["usage"]["completion_tokens"], 10);

    // A list of string prompts, streamed: both choices arrive, indexed.
    let (_, events) = http
        .stream(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": ["a b c", "d e f"], "max_tokens": 4, "stream": true}),
        )
        .await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    for (i, p) in ["a b c", "d e f"].iter().enumerate() {
        let (_, want) = expected_text(&preprocessor().tokenizer.encode(p).unwrap(), 4);
        let got: String = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str::<Value>(e).unwrap())
            .filter(|c| c["choices"][0]["index"] == i)
            .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_string))
            .collect();
        assert_eq!(got, want, "choice {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_and_max_tokens_end_generation() {
    let (_nats, _node, http) = single_node(1).await;
    let ids: Vec<u32> = (3000..3020).collect();
    let (toks, full) = expected_text(&ids, 30);
    // Pick a stop string from the middle of the expected output.
    let pre = preprocessor();
    let cut_at = pre.tokenizer.decode(&toks[..10]).unwrap().len();
    let stop: String = full[cut_at..].chars().take(4).collect();
    let before = &full[..full.find(&stop).unwrap()];
    for stream in [false, true] {
        let body = json!({"model": MODEL, "prompt": ids, "max_tokens": 30, "stop": [stop], "stream": stream});
        let (text, finish) = if stream {
            let (_, events) = http.stream("/v1/completions", &body).await;
            assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
            let cs: Vec<Value> = events[..events.len() - 1]
                .iter()
                .map(|e| serde_json::from_str(e).unwrap())
                .collect();
            let text: String = cs
                .iter()
                .filter_map(|c| c["choices"][0]["text"].as_str())
                .collect();
            let finish = cs.iter().find_map(|c| {
                c["choices"][0]["finish_reason"]
                    .as_str()
                    .map(str::to_string)
            });
            (text, finish.unwrap())
        } else {
            let r = http.post("/v1/completions", &body).await;
            assert_eq!(r.status, 200, "{}", r.json);
            (
                r.json["choices"][0]["text"].as_str().unwrap().to_string(),
                r.json["choices"][0]["finish_reason"]
                    .as_str()
                    .unwrap()
                    .to_string(),
            )
        };
        assert_eq!(text, before, "stream={stream}");
        assert_eq!(finish, "stop");
    }
    // max_tokens is exact.
    for n in [1, 3, 17] {
        let r = http
            .post(
                "/v1/completions",
                &json!({"model": MODEL, "prompt": ids, "max_tokens": n}),
            )
            .await;
        assert_eq!(r.json["usage"]["completion_tokens"], n);
        assert_eq!(
            r.json["choices"][0]["text"],
            expected_text(&ids, n as usize).1.as_str()
        );
    }
    // Completions default to 16 tokens.
    let r = http
        .post("/v1/completions", &json!({"model": MODEL, "prompt": ids}))
        .await;
    assert_eq!(r.json["usage"]["completion_tokens"], 16);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prompt_reports_cached_tokens() {
    let (_nats, _node, http) = single_node(1).await;
    let content = "Tell me a long story about a lighthouse keeper and the sea.";
    let prompt_len = chat_tokens(content).len();
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4});
    let first = http.post("/v1/chat/completions", &body).await;
    assert_eq!(
        first.json["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );
    let second = http.post("/v1/chat/completions", &body).await;
    let cached = second.json["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 0, "{}", second.json);
    assert_eq!(
        cached as usize,
        (prompt_len - 1) / 16 * 16,
        "every full prompt block but the last token's"
    );
    assert_eq!(second.json["choices"], first.json["choices"]);
    // Streaming with include_usage reports it too.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let (_, events) = http.stream("/v1/chat/completions", &sbody).await;
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(
        usage["usage"]["prompt_tokens_details"]["cached_tokens"],
        cached
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_worker_means_503_with_a_clear_message() {
    let nats = Nats::start();
    let port = free_port();
    let mut gw = Node::start(&node_config("gw", &nats.url, Some(port), 0, ""));
    let http = Http::new(port);
    http.wait_ready(0, &mut gw).await;
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]});
    let r = http.post("/v1/chat/completions", &body).await;
    assert_error(&r, 503, "service_unavailable_error");
    assert!(
        r.json["error"]["message"]
            .as_str()
            .unwrap()
            .contains("No workers"),
        "{}",
        r.json
    );

    // A worker node joins: requests succeed. It leaves (SIGKILL): 503 again, not a hang.
    let mut w = Node::start(&node_config("w1", &nats.url, None, 1, ""));
    http.wait_ready(1, &mut w).await;
    let r = http.post("/v1/chat/completions", &json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})).await;
    assert_eq!(r.status, 200, "{}", r.json);
    w.signal(libc::SIGKILL);
    w.wait(std::time::Duration::from_secs(5));
    let r = http.post("/v1/chat/completions", &body).await;
    assert_error(&r, 503, "service_unavailable_error");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_worker_processes_share_the_load() {
    let nats = Nats::start();
    let port = free_port();
    let mut gw = Node::start(&node_config("gw", &nats.url, Some(port), 0, ""));
    // Each worker node serves its own metrics.
    let metrics = [free_port(), free_port()];
    let listen = |p: u16| format!("[metrics]\nlisten = \"127.0.0.1:{p}\"\n");
    let _w1 = Node::start(&node_config("w1", &nats.url, None, 1, &listen(metrics[0])));
    let _w2 = Node::start(&node_config("w2", &nats.url, None, 1, &listen(metrics[1])));
    let http = Http::new(port);
    http.wait_ready(2, &mut gw).await;
    let mut served: std::collections::HashMap<String, usize> = Default::default();
    for i in 0..20 {
        let r = http
            .post(
                "/v1/completions",
                &json!({"model": MODEL, "prompt": format!("request {i}"), "max_tokens": 3}),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.json);
        *served
            .entry(r.worker.expect("x-dynamo-worker header"))
            .or_default() += 1;
    }
    assert_eq!(served.len(), 2, "{served:?}");
    assert!(served.values().all(|&n| n >= 8), "uneven split {served:?}");

    // Each worker's own node counts exactly the requests it served, with
    // their tokens, and says which node it is.
    let value = |text: &str, name: &str, worker: &str, extra: &str| -> Option<f64> {
        text.lines()
            .find(|l| {
                l.starts_with(name)
                    && l.contains(&format!("worker=\"{worker}\""))
                    && l.contains(extra)
            })
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
    };
    let texts = [
        dashboard::scrape(metrics[0]).await,
        dashboard::scrape(metrics[1]).await,
    ];
    assert!(
        texts[0].contains("dynamo_node_info{bus_namespace=\"it\",node=\"w1\""),
        "{}",
        texts[0]
    );
    assert!(
        texts[1].contains("dynamo_node_bus_connected{node=\"w2\"} 1"),
        "{}",
        texts[1]
    );
    for (worker, n) in &served {
        let t0 = std::time::Instant::now();
        loop {
            let texts = [
                dashboard::scrape(metrics[0]).await,
                dashboard::scrape(metrics[1]).await,
            ];
            let text = texts
                .iter()
                .find(|t| t.contains(&format!("worker=\"{worker}\"")))
                .expect("the worker's node exports its series");
            let finished = value(
                text,
                "dynamo_worker_requests_total",
                worker,
                "outcome=\"finished\"",
            );
            if finished == Some(*n as f64) {
                let prompt = value(text, "dynamo_worker_prompt_tokens_total", worker, "");
                assert!(prompt.unwrap_or(0.0) >= *n as f64, "{text}");
                let ttft = value(
                    text,
                    "dynamo_worker_time_to_first_token_seconds_count",
                    worker,
                    "",
                );
                assert_eq!(ttft, Some(*n as f64), "{text}");
                break;
            }
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(5),
                "worker {worker} served {n}, its node says {finished:?}:\n{text}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }

    // Concurrent requests are spread too, and all complete.
    let futs = (0..16).map(|i| {
        let http = &http;
        async move {
            http.post(
                "/v1/completions",
                &json!({"model": MODEL, "prompt": format!("c {i}"), "max_tokens": 8}),
            )
            .await
        }
    });
    let replies = futures::future::join_all(futs).await;
    assert!(replies.iter().all(|r| r.status == 200));
    let distinct: std::collections::HashSet<_> =
        replies.iter().filter_map(|r| r.worker.clone()).collect();
    assert_eq!(distinct.len(), 2);
}

/// A client that does not stream gets its tokens in a few frames (the
/// worker sends the first at once and holds the rest for the gateway's
/// batching window); a streaming one
/// gets a frame per engine step. Same text either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_does_not_stream_gets_its_tokens_in_few_frames() {
    let nats = Nats::start();
    let port = free_port();
    // Real step timing (a few ms a step), a 100 ms window.
    let config = node_config("n1", &nats.url, Some(port), 1, "")
        .replace("speedup = 0.0", "speedup = 1.0")
        .replace(
            "max_body_bytes = 65536\n",
            "max_body_bytes = 65536\nframe_batch_ms = 100\n",
        );
    let mut node = Node::start(&config);
    let http = Http::new(port);
    http.wait_ready(1, &mut node).await;
    let (_client, mut frames) = watch_frames(&nats.url).await;

    let n = 48u32;
    let prompt: Vec<u32> = (0..40).map(|i| 500 + i).collect();
    async fn count(
        http: &Http,
        frames: &mut async_nats::Subscriber,
        prompt: &[u32],
        n: u32,
        stream: bool,
    ) -> (String, usize) {
        use futures::StreamExt;
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": n, "ignore_eos": true, "stream": stream});
        let text = if stream {
            streamed_text(http, &body).await
        } else {
            let r = http.post("/v1/completions", &body).await;
            assert_eq!(r.status, 200, "{}", r.json);
            assert_eq!(r.json["usage"]["completion_tokens"], n);
            r.json["choices"][0]["text"].as_str().unwrap().to_string()
        };
        // Count this request's token frames (all have arrived: the answer
        // is complete).
        let mut tokens_frames = 0;
        while let Ok(Some(m)) =
            tokio::time::timeout(std::time::Duration::from_millis(200), frames.next()).await
        {
            tokens_frames += frames_in(&m.payload)
                .iter()
                .filter(|f| matches!(f, Frame::Tokens(_)))
                .count();
        }
        (text, tokens_frames)
    }
    let (streamed, stream_frames) = count(&http, &mut frames, &prompt, n, true).await;
    let (whole, batched_frames) = count(&http, &mut frames, &prompt, n, false).await;
    assert_eq!(streamed, whole, "the same tokens either way");
    assert!(
        stream_frames >= 20,
        "streaming sends a frame per step: {stream_frames}"
    );
    assert!(
        batched_frames * 2 <= stream_frames,
        "not streamed: {batched_frames} token frames against {stream_frames} streamed"
    );
}

/// A node's metrics listener with a bearer token: a scrape without it gets
/// 401 (nothing rendered), with it the metrics; `/health` stays open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_metrics_listener_with_a_token_refuses_scrapes_without_it() {
    let nats = Nats::start();
    let dir = tempfile::tempdir().expect("dir");
    let token = dir.path().join("metrics-token");
    std::fs::write(&token, "scrape-me\n").expect("token file");
    let port = free_port();
    let extra = format!(
        "[metrics]\nlisten = \"127.0.0.1:{port}\"\ntoken_file = {:?}\n",
        token.display().to_string()
    );
    let mut w = Node::start(&node_config("w1", &nats.url, None, 1, &extra));
    let url = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::new();
    let t0 = std::time::Instant::now();
    loop {
        if client.get(format!("{url}/health")).send().await.is_ok() {
            break;
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(30),
            "{}",
            w.log_text()
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let health = client.get(format!("{url}/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    let refused = client.get(format!("{url}/metrics")).send().await.unwrap();
    assert_eq!(refused.status(), 401);
    assert_eq!(
        refused
            .headers()
            .get("www-authenticate")
            .and_then(|v| v.to_str().ok()),
        Some("Bearer")
    );
    assert!(!refused.text().await.unwrap().contains("dynamo_"));
    let wrong = client
        .get(format!("{url}/metrics"))
        .bearer_auth("scrape-you")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    let ok = client
        .get(format!("{url}/metrics"))
        .bearer_auth("scrape-me")
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    assert!(ok.text().await.unwrap().contains("dynamo_node_info"));
    assert!(w.alive());
}

/// Many streams at once on one worker: the frames of one engine step for
/// every request leave in one bus message per gateway (`FrameMux`), and
/// every stream still gets exactly its own tokens, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streams_share_bus_messages_and_each_gets_its_own_tokens() {
    use futures::StreamExt;
    let (nats, _node, http) = single_node(1).await;
    let (_client, mut sub) = watch_frames(&nats.url).await;

    let n = 32usize;
    let prompts: Vec<Vec<u32>> = (0..24u32)
        .map(|r| (0..20).map(|i| 1000 + r * 50 + i).collect())
        .collect();
    let streams = prompts.iter().map(|p| {
        let body = json!({"model": MODEL, "prompt": p, "max_tokens": n, "ignore_eos": true, "stream": true});
        let http = &http;
        async move {
            streamed_text(http, &body).await
        }
    });
    let texts = futures::future::join_all(streams).await;
    for (p, text) in prompts.iter().zip(&texts) {
        assert_eq!(text, &expected_text(p, n).1, "prompt {p:?}");
    }

    // What crossed the bus: every frame arrived once, some messages held
    // frames of more than one request.
    let (mut messages, mut frames, mut shared) = (0, 0, 0);
    let mut seqs: std::collections::HashMap<_, Vec<u32>> = Default::default();
    while let Ok(Some(m)) =
        tokio::time::timeout(std::time::Duration::from_millis(300), sub.next()).await
    {
        let fs = frames_in(&m.payload);
        messages += 1;
        frames += fs.len();
        let mut ids = std::collections::HashSet::new();
        for f in fs {
            match f {
                Frame::Tokens(t) => {
                    ids.insert(t.request_id);
                    seqs.entry(t.request_id).or_default().push(t.seq.0);
                }
                Frame::Other(id) => {
                    ids.insert(id);
                }
            }
        }
        shared += usize::from(ids.len() > 1);
    }
    assert_eq!(
        seqs.len(),
        prompts.len(),
        "every request's tokens were seen"
    );
    for (id, s) in &seqs {
        assert!(
            s.windows(2).all(|w| w[0] < w[1]),
            "{id}: frames in order: {s:?}"
        );
    }
    assert!(
        shared > 0 && messages < frames,
        "{frames} frames in {messages} messages, {shared} shared by requests"
    );
    // The worker counts them too.
    let f = http.metric("dynamo_worker_frames_total").await;
    let m = http.metric("dynamo_worker_frame_messages_total").await;
    assert!(
        f >= frames as u64 && m < f,
        "metrics: {f} frames in {m} messages"
    );
}

/// A gateway of an older build does not send `Dynamo-Frame-Mux`: a worker
/// then sends its requests' frames one per message, while requests that
/// ask for muxing, on the same worker at the same time, share messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_without_the_mux_header_get_one_frame_per_message() {
    use dynamo_bus_schema::*;
    use futures::StreamExt;
    let nats = Nats::start();
    let _node = Node::start(&node_config("w", &nats.url, None, 1, ""));
    let t0 = std::time::Instant::now();
    let js = async_nats::jetstream::new(async_nats::connect(&nats.url).await.unwrap());
    let worker = loop {
        // The bucket exists once the node made it.
        if js.get_key_value("dynamo_it_workers").await.is_ok() {
            if let Some(r) = registrations(&nats.url).await.first() {
                break r.worker_id;
            }
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(30),
            "no worker registered"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    let bus = it_bus(&nats.url, "old-and-new-gateway").await;
    let mut old = bus.client.subscribe("it.old.frames").await.unwrap();
    let mut new = bus.client.subscribe("it.new.frames").await.unwrap();
    bus.client.flush().await.unwrap();

    let per = 12u128;
    let sends = (0..2 * per).map(|i| {
        let bus = &bus;
        async move {
            let muxed = i % 2 == 1;
            let mut sampling = SamplingParams::greedy(24);
            sampling.ignore_eos = true;
            let req = GenerateRequest {
                request_id: RequestId(1000 + i),
                model: ModelName(MODEL.into()),
                token_ids: (0..20).map(|k| 2000 + i as u32 * 30 + k).collect(),
                sampling,
                reply_to: if muxed {
                    "it.new.frames"
                } else {
                    "it.old.frames"
                }
                .into(),
                deadline_unix_ms: 0,
            };
            let headers = muxed.then(|| {
                let mut h = async_nats::HeaderMap::new();
                h.insert(HEADER_FRAME_MUX, "1");
                h
            });
            let ack: GenerateAck = bus
                .request_with(
                    bus.subjects.worker_generate(worker),
                    &req,
                    headers,
                    std::time::Duration::from_secs(10),
                )
                .await
                .unwrap();
            assert!(ack.rejected.is_none(), "{ack:?}");
        }
    });
    futures::future::join_all(sends).await;

    // Until every request of a subject has its Finished frame.
    async fn collect(sub: &mut async_nats::Subscriber, requests: usize) -> (usize, usize) {
        let (mut messages, mut muxes, mut finished) = (0, 0, 0);
        while finished < requests {
            let m = tokio::time::timeout(std::time::Duration::from_secs(20), sub.next())
                .await
                .expect("frames stopped before every request finished")
                .unwrap();
            messages += 1;
            muxes += usize::from(peek_kind(&m.payload).unwrap().0 == FrameMux::KIND);
            let frames: Vec<Vec<u8>> = match peek_kind(&m.payload).unwrap().0 {
                k if k == FrameMux::KIND => decode::<FrameMux>(&m.payload).unwrap().frames,
                _ => vec![m.payload.to_vec()],
            };
            finished += frames
                .iter()
                .filter(|f| peek_kind(f).unwrap().0 == FrameFinished::KIND)
                .count();
        }
        (messages, muxes)
    }
    let (old_messages, old_muxes) = collect(&mut old, per as usize).await;
    let (new_messages, new_muxes) = collect(&mut new, per as usize).await;
    assert_eq!(old_muxes, 0, "a gateway that did not ask got a FrameMux");
    // Started, tokens, timings and finished: at least four each, alone.
    assert!(old_messages >= per as usize * 4, "{old_messages} messages");
    assert!(
        new_muxes > 0,
        "requests that asked shared no message ({new_messages} messages)"
    );
}
