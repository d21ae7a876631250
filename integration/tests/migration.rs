//! Fault tolerance with real processes: a worker killed (`kill -9`) or
//! frozen (SIGSTOP) mid-stream loses no request; each moves to another
//! worker and the client's stream continues token-identical.

use dynamo_integration::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

struct Cluster {
    _nats: Nats,
    gateway: Node,
    workers: Vec<Node>,
    http: Http,
    port: u16,
}

/// A gateway node and `n` single-worker nodes (separate processes) whose
/// mockers run in real time, so requests are mid-stream when we strike.
async fn cluster(n: usize) -> Cluster {
    let nats = Nats::start();
    let port = free_port();
    let mut gateway = Node::start(&node_config("gw", &nats.url, Some(port), 0, ""));
    let workers: Vec<Node> = (0..n)
        .map(|i| {
            Node::start(
                &node_config(&format!("w{i}"), &nats.url, None, 1, "")
                    .replace("speedup = 0.0", "speedup = 1.0"),
            )
        })
        .collect();
    let http = Http::new(port);
    http.wait_ready(n as u64, &mut gateway).await;
    Cluster {
        _nats: nats,
        gateway,
        workers,
        http,
        port,
    }
}

/// One streamed completion: the text, the finish reason, whether `[DONE]`
/// arrived, and the first error object if any.
#[derive(Debug)]
struct Streamed {
    text: String,
    finish: Option<String>,
    done: bool,
    error: Option<Value>,
}

async fn stream_completion(port: u16, prompt: Vec<u32>, max_tokens: u32) -> Streamed {
    let http = Http::new(port);
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                      "stream": true, "ignore_eos": true});
    let (status, events) = http.stream("/v1/completions", &body).await;
    let mut out = Streamed {
        text: String::new(),
        finish: None,
        done: false,
        error: None,
    };
    if status != 200 {
        out.error = Some(json!({"status": status, "events": events}));
        return out;
    }
    for e in events {
        if e == "[DONE]" {
            out.done = true;
            continue;
        }
        let v: Value = serde_json::from_str(&e).unwrap_or(Value::String(e));
        if !v["error"].is_null() {
            out.error.get_or_insert(v["error"].clone());
            continue;
        }
        if let Some(t) = v["choices"][0]["text"].as_str() {
            out.text.push_str(t);
        }
        if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
            out.finish = Some(f.to_string());
        }
    }
    out
}

fn prompt(i: usize) -> Vec<u32> {
    (0..40).map(|k| 1000 + (i * 131 + k * 7) as u32).collect()
}

/// Runs `n` concurrent streams, strikes one worker `after` their start, and
/// checks every stream against the mocker's prediction.
async fn strike_mid_stream(c: &Cluster, n: usize, after: Duration, strike: impl FnOnce()) {
    const MAX: u32 = 200;
    let tasks: Vec<_> = (0..n)
        .map(|i| tokio::spawn(stream_completion(c.port, prompt(i), MAX)))
        .collect();
    tokio::time::sleep(after).await;
    strike();
    let t0 = Instant::now();
    for (i, t) in tasks.into_iter().enumerate() {
        let s = t.await.expect("stream task");
        let (_, want) = expected_text(&prompt(i), MAX as usize);
        assert!(s.error.is_none(), "request {i} failed: {:?}", s.error);
        assert!(s.done, "request {i} did not end with [DONE]");
        assert_eq!(s.finish.as_deref(), Some("length"), "request {i}");
        assert_eq!(
            s.text, want,
            "request {i}: text differs from the failure-free run"
        );
    }
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "streams took too long"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_worker_mid_stream_loses_no_token() {
    let c = cluster(3).await;
    let victim = c.workers[1].pid() as i32;
    strike_mid_stream(&c, 50, Duration::from_millis(400), || unsafe {
        libc::kill(victim, libc::SIGKILL);
    })
    .await;
    let migrated = c
        .http
        .metric("dynamo_gateway_migrations_total{reason=\"worker_silent\"}")
        .await;
    assert!(
        migrated > 0,
        "no request was migrated: {}",
        c.http.metrics_text().await
    );
    assert!(c.gateway.log_text().contains("migrating request"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_worker_is_left_behind_within_the_liveness_window() {
    let c = cluster(2).await;
    let victim = c.workers[0].pid() as i32;
    strike_mid_stream(&c, 16, Duration::from_millis(300), || unsafe {
        libc::kill(victim, libc::SIGSTOP);
    })
    .await;
    assert!(
        c.http
            .metric("dynamo_gateway_migrations_total{reason=\"worker_silent\"}")
            .await
            > 0
    );
    // Thawed, it finds its requests gone (cancelled) and serves again.
    unsafe { libc::kill(victim, libc::SIGCONT) };
    let s = stream_completion(c.port, prompt(99), 8).await;
    assert!(s.error.is_none() && s.done, "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migration_can_be_turned_off_per_request() {
    let c = cluster(1).await;
    let victim = c.workers[0].pid() as i32;
    let body = json!({"model": MODEL, "prompt": prompt(1), "max_tokens": 400,
                      "stream": true, "ignore_eos": true, "max_migrations": 0});
    let t0 = Instant::now();
    let task =
        tokio::spawn(async move { Http::new(c.port).stream("/v1/completions", &body).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    unsafe { libc::kill(victim, libc::SIGKILL) };
    let (status, events) = task.await.unwrap();
    assert_eq!(status, 200);
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["type"], "server_error", "{last}");
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "failure not surfaced promptly"
    );
}
