//! Fault tolerance with real processes: a worker killed (`kill -9`) or
//! frozen (SIGSTOP) mid-stream loses no request; each moves to another
//! worker and the client's stream continues token-identical.

use dynamo_integration::*;
use serde_json::{json, Value};
use std::sync::Arc;
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

fn prompt(i: usize) -> Vec<u32> {
    (0..40).map(|k| 1000 + (i * 131 + k * 7) as u32).collect()
}

/// Runs `n` concurrent streams, strikes one worker `after` their start, and
/// checks every stream against the mocker's prediction.
async fn strike_mid_stream(c: &Cluster, n: usize, after: Duration, strike: impl FnOnce()) {
    let streams = Streams::start(c.port, (0..n).map(prompt).collect(), 200).await;
    tokio::time::sleep(after).await;
    strike();
    let t0 = Instant::now();
    streams.expect_undisturbed().await;
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "streams took too long"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_worker_mid_stream_loses_no_token() {
    let c = cluster(3).await;
    let victim = c.workers[1].pid() as i32;
    strike_mid_stream(&c, 50, Duration::from_millis(100), || unsafe {
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

/// Requests that do not stream (their token frames batched by the worker)
/// lose nothing either: a killed worker's requests move on, the tokens of
/// its last window are generated again, and every answer is the whole text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_worker_under_batched_requests_loses_no_token() {
    let c = cluster(3).await;
    let mut set = tokio::task::JoinSet::new();
    for i in 0..30 {
        let http = Http::new(c.port);
        set.spawn(async move {
            let body = serde_json::json!({"model": MODEL, "prompt": prompt(i), "max_tokens": 800, "ignore_eos": true});
            (i, http.post("/v1/completions", &body).await)
        });
    }
    // Strike the busiest worker once it has requests generating.
    let t0 = Instant::now();
    let busiest = loop {
        let (w, n) = busiest_worker(&c.http).await;
        if n >= 3 {
            break w;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "no worker got busy");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let victim = registrations(&c._nats.url)
        .await
        .into_iter()
        .find(|r| r.worker_id.to_string() == busiest)
        .map(|r| r.pid)
        .expect("the busiest worker is registered");
    // SAFETY: kills a worker process this test started.
    unsafe { libc::kill(victim as i32, libc::SIGKILL) };
    while let Some(r) = set.join_next().await {
        let (i, r) = r.unwrap();
        assert_eq!(r.status, 200, "{}", r.json);
        let (_, want) = expected_text(&prompt(i), 800);
        assert_eq!(r.json["choices"][0]["text"], want.as_str(), "request {i}");
        assert_eq!(r.json["usage"]["completion_tokens"], 800);
    }
    let text = c.http.metrics_text().await;
    let migrated: u64 = text
        .lines()
        .filter(|l| l.starts_with("dynamo_gateway_migrations_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum();
    assert!(migrated > 0, "no request was migrated:\n{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_worker_is_left_behind_within_the_liveness_window() {
    let c = cluster(2).await;
    let victim = c.workers[0].pid() as i32;
    strike_mid_stream(&c, 16, Duration::from_millis(100), || unsafe {
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
    let s = stream_completion(c.port, prompt(99), 8, Arc::default()).await;
    assert!(s.error.is_none() && s.done, "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migration_can_be_turned_off_per_request() {
    let c = cluster(1).await;
    let victim = c.workers[0].pid() as i32;
    let body = json!({"model": MODEL, "prompt": prompt(1), "max_tokens": 400,
                      "stream": true, "ignore_eos": true, "max_migrations": 0});
    let (first_tx, first_rx) = tokio::sync::oneshot::channel::<()>();
    let port = c.port;
    let task = tokio::spawn(async move {
        let http = Http::new(port);
        let mut r = http.open("/v1/completions", &body).await;
        assert_eq!(r.status().as_u16(), 200);
        let mut text = String::new();
        let mut first = Some(first_tx);
        while let Ok(Some(chunk)) = r.chunk().await {
            text.push_str(&String::from_utf8_lossy(&chunk));
            if text.contains("\"text\"") {
                if let Some(tx) = first.take() {
                    let _ = tx.send(());
                }
            }
        }
        text
    });
    // Strike once tokens flow: the failure happens mid-stream.
    first_rx.await.expect("first token");
    let t0 = Instant::now();
    unsafe { libc::kill(victim, libc::SIGKILL) };
    let text = task.await.unwrap();
    let last = sse_data(&text)
        .into_iter()
        .rfind(|d| d != "[DONE]")
        .expect("an event");
    let last: Value = serde_json::from_str(&last).unwrap();
    assert_eq!(last["error"]["type"], "server_error", "{last}");
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "failure not surfaced promptly"
    );
    assert_eq!(
        c.http
            .metric("dynamo_gateway_migration_failures_total{why=\"limit\"}")
            .await,
        1
    );
}

/// BENCHMARKS.md: time from `kill -9` of the serving worker to the next
/// token the client receives (detection + re-route + re-prefill), over 20
/// trials. `cargo test --release -p dynamo-integration --test migration --
/// --ignored --nocapture failover_latency` (after `cargo build --release --bins`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run explicitly (make bench)"]
async fn failover_latency() {
    use std::sync::{Arc, Mutex};
    const TRIALS: usize = 20;
    let mut c = cluster(2).await;
    let mut samples = Vec::new();
    for (trial, spawned) in (0..TRIALS).zip(2..) {
        let arrivals: Arc<Mutex<Vec<Instant>>> = Arc::default();
        let (tx, rx) = tokio::sync::oneshot::channel::<String>();
        let port = c.port;
        let a = arrivals.clone();
        let task = tokio::spawn(async move {
            let http = Http::new(port);
            let body = json!({"model": MODEL, "prompt": prompt(trial), "max_tokens": 3000,
                              "stream": true, "ignore_eos": true});
            let mut r = http.open("/v1/completions", &body).await;
            let worker = r
                .headers()
                .get("x-dynamo-worker")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string();
            let _ = tx.send(worker);
            while let Ok(Some(chunk)) = r.chunk().await {
                if String::from_utf8_lossy(&chunk).contains("\"text\"") {
                    a.lock().unwrap().push(Instant::now());
                }
            }
        });
        let worker = rx.await.expect("response headers");
        tokio::time::sleep(Duration::from_millis(300)).await;
        let regs = registrations(&c._nats.url).await;
        let pid = regs
            .iter()
            .find(|r| r.worker_id.to_string() == worker)
            .map(|r| r.pid)
            .expect("serving worker registered");
        let idx = c
            .workers
            .iter()
            .position(|w| w.pid() == pid)
            .expect("our node");
        let killed_at = Instant::now();
        c.workers[idx].signal(libc::SIGKILL);
        let t0 = Instant::now();
        let next = loop {
            let after = arrivals
                .lock()
                .unwrap()
                .iter()
                .find(|t| **t > killed_at + Duration::from_millis(5))
                .copied();
            if let Some(t) = after {
                break t;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "no token after the kill"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        };
        samples.push((next - killed_at).as_secs_f64() * 1000.0);
        task.abort();
        // Replace the dead worker so every trial starts with two.
        c.workers.remove(idx);
        c.workers.push(Node::start(
            &node_config(&format!("w{spawned}"), &c._nats.url, None, 1, "")
                .replace("speedup = 0.0", "speedup = 1.0"),
        ));
        // The router forgets the dead worker after its TTL (3 s).
        tokio::time::sleep(Duration::from_millis(3500)).await;
        c.http.wait_ready(2, &mut c.gateway).await;
    }
    samples.sort_by(f64::total_cmp);
    let pct = |p: f64| samples[((samples.len() - 1) as f64 * p).round() as usize];
    println!(
        "kill -9 → next token over {TRIALS} trials: p50 {:.0} ms, p99 {:.0} ms, min {:.0} ms, max {:.0} ms",
        pct(0.5),
        pct(0.99),
        samples[0],
        samples[samples.len() - 1]
    );
    assert!(pct(0.5) < 5000.0);
}
