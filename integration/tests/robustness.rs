//! No request, overload or fault takes the service down, with real
//! processes: out-of-range input is refused and routing stays up; a dead
//! engine or an input task that ends is recovered with no request left
//! hanging; overload is refused at once with `Retry-After` and counted; a
//! changed model card is picked up; a worker far larger than one bus
//! message is dumped and indexed exactly.

use dynamo_bus_schema::{ActorFault, FaultInjection, FaultKind};
use dynamo_integration::kv::indexed;
use dynamo_integration::*;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn kv_aware(cfg: String) -> String {
    cfg.replace("policy = \"least_loaded\"", "policy = \"kv_aware\"")
}

fn real_time(cfg: String) -> String {
    cfg.replace("speedup = 0.0", "speedup = 1.0")
}

const FAULTS: &str = "[supervision]\nrestart_base_ms = 50\nfault_injection = true\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overflowing_routing_weight_is_refused_and_routing_stays_up() {
    let nats = Nats::start();
    let port = free_port();
    let mut node = Node::start(&kv_aware(node_config("n1", &nats.url, Some(port), 2, "")));
    let http = Http::new(port);
    http.wait_ready(2, &mut node).await;
    let prompt: Vec<u32> = (300..400).collect();
    // The reproduction: every cost would overflow to inf, and inf - inf is NaN.
    let r = http
        .post(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": prompt, "routing": {"overlap_weight": 1e308}}),
        )
        .await;
    assert_error(&r, 400, "invalid_request_error");
    assert_eq!(r.json["error"]["param"], "routing.overlap_weight");
    // Weights at the edges of their ranges route normally, every time.
    for routing in [
        json!({"overlap_weight": 1000.0}),
        json!({"overlap_weight": 1000.0, "temperature": 100.0}),
        json!({"overlap_weight": 0.0, "temperature": 0.0}),
        json!({"host_hit_cost": 1.0, "disk_hit_cost": 1.0, "temperature": 1e-300}),
    ] {
        for i in 0..5u32 {
            let p: Vec<u32> = (0..1500).map(|k| 500 + (k * 7 + i) % 40000).collect();
            let r = http
                .post(
                    "/v1/completions",
                    &json!({"model": MODEL, "prompt": p, "max_tokens": 2, "routing": routing}),
                )
                .await;
            assert_eq!(r.status, 200, "{routing}: {}", r.json);
        }
    }
    let log = node.log_text();
    assert!(!log.contains("panicked"), "{log}");
    assert!(
        !log.contains("actor exited"),
        "the router restarted:\n{log}"
    );
}

/// A gateway node and `n` single-worker nodes (fault injection on), whose
/// mockers run in real time.
async fn cluster(nats: &Nats, n: usize) -> (Node, Vec<Node>, u16) {
    let port = free_port();
    let mut gw = Node::start(&node_config("gw", &nats.url, Some(port), 0, FAULTS));
    let workers = (0..n)
        .map(|i| {
            Node::start(&real_time(node_config(
                &format!("w{i}"),
                &nats.url,
                None,
                1,
                FAULTS,
            )))
        })
        .collect();
    Http::new(port).wait_ready(n as u64, &mut gw).await;
    (gw, workers, port)
}

fn prompt(i: usize) -> Vec<u32> {
    (0..40).map(|k| 1500 + (i * 131 + k * 7) as u32).collect()
}

/// The registration of the worker the router counts most requests on.
async fn busiest_registration(nats: &Nats, http: &Http) -> dynamo_bus_schema::WorkerRegistration {
    let (busiest, serving) = busiest_worker(http).await;
    assert!(serving > 0);
    registrations(&nats.url)
        .await
        .into_iter()
        .find(|r| r.worker_id.to_string() == busiest)
        .expect("registered")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_engine_fails_its_worker_at_once_and_loses_no_request() {
    let nats = Nats::start();
    let (_gw, mut workers, port) = cluster(&nats, 2).await;
    let http = Http::new(port);
    let streams = Streams::start(port, (0..8).map(prompt).collect(), 200).await;
    let victim = busiest_registration(&nats, &http).await;
    let ack = inject(
        &nats.url,
        &victim.node_id.0,
        &FaultInjection {
            worker_id: victim.worker_id,
            fault: FaultKind::PanicEngine,
        },
    )
    .await;
    assert!(ack.applied, "{}", ack.message);
    // Every stream completes, token-identical to an undisturbed run.
    streams.expect_undisturbed().await;
    let idx: usize = victim.node_id.0[1..].parse().unwrap();
    let w = &mut workers[idx];
    wait_log(w, Duration::from_secs(10), "the worker's restart", |l| {
        l.contains("the engine stopped; reporting failed and restarting")
            && l.contains("actor exited; restarting")
    })
    .await;
    // It comes back with a fresh engine (a newer generation) and serves.
    let t0 = Instant::now();
    loop {
        let regs = registrations(&nats.url).await;
        let now = regs
            .iter()
            .find(|r| r.worker_id == victim.worker_id)
            .unwrap();
        if now.generation > victim.generation
            && now.state == dynamo_bus_schema::WorkerState::Serving
        {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "no new generation");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(w.alive(), "the node must survive its engine");
    let s = stream_completion(port, prompt(50), 8, Arc::default()).await;
    assert!(s.error.is_none() && s.done, "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_worker_input_under_streams_restarts_it_and_loses_no_request() {
    let nats = Nats::start();
    let (_gw, mut workers, port) = cluster(&nats, 2).await;
    let http = Http::new(port);
    let streams = Streams::start(port, (0..8).map(prompt).collect(), 200).await;
    let victim = busiest_registration(&nats, &http).await;
    let ack = inject(
        &nats.url,
        &victim.node_id.0,
        &ActorFault {
            actor: victim.worker_id.to_string(),
            fault: FaultKind::EndTask,
            task: "generate".into(),
        },
    )
    .await;
    assert!(ack.applied, "{}", ack.message);
    // Its streams got their last frame from the stopping worker and moved
    // on: every one completes, token-identical to an undisturbed run.
    streams.expect_undisturbed().await;
    assert!(
        http.metric("dynamo_gateway_migrations_total{reason=\"worker_error\"}")
            .await
            > 0
    );
    assert_eq!(
        http.metric("dynamo_gateway_migrations_total{reason=\"worker_silent\"}")
            .await,
        0,
        "told at once, none waited out the liveness timeout"
    );
    let idx: usize = victim.node_id.0[1..].parse().unwrap();
    wait_log(
        &mut workers[idx],
        Duration::from_secs(10),
        "the restart",
        |l| {
            l.contains("background task `generate` was ended")
                && l.contains("actor exited; restarting")
        },
    )
    .await;
    let s = stream_completion(port, prompt(60), 8, Arc::default()).await;
    assert!(s.error.is_none() && s.done, "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_task_that_ends_restarts_its_actor() {
    let nats = Nats::start();
    let port = free_port();
    let mut node = Node::start(&node_config("n1", &nats.url, Some(port), 1, FAULTS));
    let http = Http::new(port);
    http.wait_ready(1, &mut node).await;
    let body = json!({"model": MODEL, "prompt": [700, 701, 702], "max_tokens": 3});
    let ok = http.post("/v1/completions", &body).await;
    assert_eq!(ok.status, 200, "{}", ok.json);
    let worker = registrations(&nats.url).await[0].clone();
    for (actor, task, child) in [
        ("router".to_string(), "load-reports", "router"),
        (worker.worker_id.to_string(), "generate", "worker-0-0"),
        ("gateway".to_string(), "inbox", "gateway"),
    ] {
        let before = node.log_text().matches("actor exited; restarting").count();
        let ack = inject(
            &nats.url,
            "n1",
            &ActorFault {
                actor: actor.clone(),
                fault: FaultKind::EndTask,
                task: task.into(),
            },
        )
        .await;
        assert!(ack.applied, "{actor}: {}", ack.message);
        wait_log(&mut node, Duration::from_secs(10), "the restart", |l| {
            l.matches("actor exited; restarting").count() > before
                && l.contains(&format!("background task `{task}` was ended"))
        })
        .await;
        assert!(
            node.log_text()
                .lines()
                .any(|l| l.contains("actor exited; restarting") && l.contains(child)),
            "{actor}: {}",
            node.log_text()
        );
        // Serving again, whatever restarted.
        let t0 = Instant::now();
        loop {
            match http
                .client
                .post(format!("{}/v1/completions", http.base))
                .json(&body)
                .send()
                .await
            {
                Ok(r) if r.status() == 200 => {
                    let v: Value = r.json().await.unwrap();
                    assert_eq!(v["choices"], ok.json["choices"]);
                    break;
                }
                _ => {}
            }
            assert!(
                t0.elapsed() < Duration::from_secs(15),
                "{actor} never served again:\n{}",
                node.log_text()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    // An unknown actor is refused, not fatal.
    let ack = inject(
        &nats.url,
        "n1",
        &ActorFault {
            actor: "nobody".into(),
            fault: FaultKind::EndTask,
            task: "x".into(),
        },
    )
    .await;
    assert!(!ack.applied);
    assert!(node.alive());
}

/// One non-streaming completion: status, `Retry-After`, body, and when it came back.
async fn timed_post(port: u16, body: Value) -> (u16, Option<String>, Value, Instant) {
    let r = Http::new(port).post("/v1/completions", &body).await;
    (r.status, r.retry_after, r.json, Instant::now())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_is_refused_at_once_with_retry_after_and_counted() {
    let nats = Nats::start();
    let port = free_port();
    let cfg = real_time(node_config("n1", &nats.url, Some(port), 1, "")).replace(
        "shutdown_grace_ms = 10000\n",
        "shutdown_grace_ms = 10000\nmax_inflight_requests = 2\nmax_queued_requests = 2\nmax_queue_wait_ms = 1000\n",
    );
    let mut node = Node::start(&cfg);
    let http = Http::new(port);
    http.wait_ready(1, &mut node).await;
    let long = |i: usize| json!({"model": MODEL, "prompt": prompt(i), "max_tokens": 600, "ignore_eos": true});
    // Two long requests take both places.
    let admitted: Vec<_> = (0..2)
        .map(|i| tokio::spawn(timed_post(port, long(i))))
        .collect();
    let t0 = Instant::now();
    while routed(&http).await < 2 {
        assert!(t0.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let refused: Vec<_> = (2..12)
        .map(|i| tokio::spawn(timed_post(port, long(i))))
        .collect();
    let mut refused_at = Vec::new();
    let (mut full, mut timed_out) = (0, 0);
    for t in refused {
        let (status, retry, json, at) = t.await.unwrap();
        assert_eq!(retry.as_deref(), Some("1"), "{status} {json}");
        assert!(json["error"]["message"].is_string(), "{json}");
        match (status, json["error"]["code"].as_str()) {
            (429, Some("queue_full")) => full += 1,
            (503, Some("queue_timeout")) => timed_out += 1,
            other => panic!("unexpected answer {other:?}: {json}"),
        }
        refused_at.push(at);
    }
    assert_eq!(
        (full, timed_out),
        (8, 2),
        "two wait in the queue, the rest are refused"
    );
    let mut done_at = Vec::new();
    for t in admitted {
        let (status, _, json, at) = t.await.unwrap();
        assert_eq!(status, 200, "{json}");
        done_at.push(at);
    }
    // Refused while the admitted ones were still running: at once, not after them.
    let first_done = done_at.iter().min().unwrap();
    assert!(refused_at.iter().all(|t| t < first_done));
    for (reason, n) in [("queue_full", 8), ("queue_timeout", 2)] {
        let m = format!("dynamo_gateway_rejected_requests_total{{reason=\"{reason}\"}}");
        assert_eq!(http.metric(&m).await, n, "{reason}");
    }
    // The places are free again.
    let (status, _, json, _) = timed_post(
        port,
        json!({"model": MODEL, "prompt": [5, 6], "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200, "{json}");
}

/// A node of two real-time mocker workers that hold two requests each
/// (one running, one waiting); the router avoids a worker that refused
/// for a minute unless it shows a place again. `gateway` adds gateway keys.
fn two_small_engines(nats: &Nats, port: u16, gateway: &str) -> String {
    real_time(node_config("n1", &nats.url, Some(port), 2, ""))
        .replace(
            "speedup = 1.0\n",
            "speedup = 1.0\nmax_num_seqs = 1\nmax_waiting_seqs = 1\n",
        )
        .replace(
            "worker_ttl_ms = 3000\n",
            "worker_ttl_ms = 3000\noverload_backoff_ms = 60000\n",
        )
        .replace(
            "shutdown_grace_ms = 10000\n",
            &format!("shutdown_grace_ms = 10000\n{gateway}"),
        )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_engine_answers_overloaded_and_the_router_avoids_it() {
    let nats = Nats::start();
    let port = free_port();
    let mut node = Node::start(&two_small_engines(&nats, port, ""));
    let http = Http::new(port);
    http.wait_ready(2, &mut node).await;
    let long = |i: usize| json!({"model": MODEL, "prompt": prompt(i), "max_tokens": 300, "ignore_eos": true});
    let tasks: Vec<_> = (0..8)
        .map(|i| tokio::spawn(timed_post(port, long(i))))
        .collect();
    let (mut ok, mut refused) = (0, 0);
    for t in tasks {
        let (status, retry, json, _) = t.await.unwrap();
        match status {
            200 => ok += 1,
            503 => {
                assert_eq!(retry.as_deref(), Some("1"), "{json}");
                assert_eq!(json["error"]["code"], "workers_overloaded", "{json}");
                refused += 1;
            }
            other => panic!("{other}: {json}"),
        }
    }
    assert_eq!((ok, refused), (4, 4), "two workers hold two requests each");
    assert!(http.metric("dynamo_gateway_route_retries_total").await > 0);
    // Each refused one waited for room (the 500 ms queue wait) first.
    assert_eq!(http.metric("dynamo_gateway_room_waits_total").await, 4);
    assert_eq!(
        http.metric("dynamo_gateway_rejected_requests_total{reason=\"workers_overloaded\"}")
            .await,
        4,
        "each refusal counted once"
    );
    // Their requests ended, so both have places again: the next request is
    // served at once, not refused for the minute the marks would last.
    let (status, _, json, _) = timed_post(port, long(9)).await;
    assert_eq!(status, 200, "{json}");
    assert_eq!(http.metric("dynamo_gateway_room_waits_total").await, 4);
    assert!(!node.log_text().contains("panicked"));
}

/// Requests waited for room, and none was refused for it.
async fn waited_and_none_refused(http: &Http, node: &Node) {
    assert!(http.metric("dynamo_gateway_room_waits_total").await >= 1);
    assert_eq!(
        http.metric("dynamo_gateway_rejected_requests_total{reason=\"workers_overloaded\"}")
            .await,
        0
    );
    assert!(!node.log_text().contains("panicked"));
}

/// A batch of more prompts than every worker has places: the prompts a
/// worker took free places as they end, and the rest wait for them (past
/// the queue's 500 ms), so the batch is served whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_larger_than_every_engines_room_is_served_whole() {
    let nats = Nats::start();
    let port = free_port();
    let mut node = Node::start(&two_small_engines(&nats, port, ""));
    let http = Http::new(port);
    http.wait_ready(2, &mut node).await;
    // Eight prompts of about a second each; the two workers hold four.
    let prompts: Vec<Vec<u32>> = (0..8u32).map(|i| vec![300 + i, 7, 8, 9]).collect();
    let (status, _, json, _) = timed_post(
        port,
        json!({"model": MODEL, "prompt": prompts, "max_tokens": 150, "ignore_eos": true}),
    )
    .await;
    assert_eq!(status, 200, "{json}");
    let choices = json["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 8, "{json}");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i, "{json}");
        assert_eq!(c["finish_reason"], "length", "{json}");
    }
    assert_eq!(json["usage"]["completion_tokens"], 8 * 150, "{json}");
    waited_and_none_refused(&http, &node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_past_every_engine_waits_for_room_instead_of_failing() {
    let nats = Nats::start();
    let port = free_port();
    let mut node = Node::start(&two_small_engines(
        &nats,
        port,
        "max_queue_wait_ms = 5000\n",
    ));
    let http = Http::new(port);
    http.wait_ready(2, &mut node).await;
    // Four requests of about a second take the four places; four more
    // come while they run, and wait for room.
    let req = |i: usize| json!({"model": MODEL, "prompt": prompt(i), "max_tokens": 150, "ignore_eos": true});
    let mut tasks: Vec<_> = (0..4)
        .map(|i| tokio::spawn(timed_post(port, req(i))))
        .collect();
    let t0 = Instant::now();
    while routed(&http).await < 4 {
        assert!(t0.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tasks.extend((4..8).map(|i| tokio::spawn(timed_post(port, req(i)))));
    for t in tasks {
        let (status, _, json, _) = t.await.unwrap();
        assert_eq!(status, 200, "{json}");
        assert_eq!(json["usage"]["completion_tokens"], 150, "{json}");
    }
    waited_and_none_refused(&http, &node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_model_card_is_picked_up() {
    let nats = Nats::start();
    let port = free_port();
    let mut gw = Node::start(&node_config("gw", &nats.url, Some(port), 0, ""));
    let mut w1 = Node::start(&node_config("w1", &nats.url, None, 1, ""));
    let http = Http::new(port);
    http.wait_ready(1, &mut gw).await;
    let long: Vec<u32> = (0..1000).map(|k| 300 + k).collect();
    let body = json!({"model": MODEL, "prompt": long, "max_tokens": 4});
    let r = http.post("/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.json);
    // A rolling upgrade: the worker is replaced by one with a shorter context.
    w1.signal(libc::SIGTERM);
    assert_eq!(w1.wait(Duration::from_secs(20)), Some(0));
    let cfg = node_config("w2", &nats.url, None, 1, "").replace(
        "heartbeat_ms = 500\n",
        "heartbeat_ms = 500\ncontext_length = 600\n",
    );
    let _w2 = Node::start(&cfg);
    let t0 = Instant::now();
    loop {
        let m = http
            .client
            .get(format!("{}/v1/models", http.base))
            .send()
            .await
            .unwrap();
        let m: Value = m.json().await.unwrap();
        if m["data"][0]["context_length"] == 600 && m["data"][0]["workers"] == 1 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "the new worker never registered: {m}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The very next request is checked against the new card.
    let r = http.post("/v1/completions", &body).await;
    assert_error(&r, 400, "invalid_request_error");
    assert_eq!(
        r.json["error"]["code"], "context_length_exceeded",
        "{}",
        r.json
    );
    assert!(r.json["error"]["message"].as_str().unwrap().contains("600"));
    let short = json!({"model": MODEL, "prompt": long[..100].to_vec(), "max_tokens": 4});
    let r = http.post("/v1/completions", &short).await;
    assert_eq!(r.status, 200, "{}", r.json);
    assert!(gw.log_text().contains("a worker has another model card"));
}

/// Requests the router counts in flight, all workers.
async fn routed(h: &Http) -> u64 {
    h.metrics_text()
        .await
        .lines()
        .filter(|l| l.starts_with("dynamo_router_worker_inflight{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_holding_300k_blocks_is_dumped_and_indexed_exactly() {
    let nats = Nats::start();
    // A mocker with a small device pool and a large host tier of tiny
    // simulated blocks: 80 prompts of 4096 blocks leave 327,680 behind.
    let worker_cfg = node_config("w", &nats.url, None, 1, "")
        .replace("heartbeat_ms = 500\n", "heartbeat_ms = 500\ncontext_length = 16384\n")
        .replace(
            "speedup = 0.0\n",
            "speedup = 0.0\nblock_size = 2\nnum_blocks = 20000\nkv_bytes_per_block = 8\noffload_host_blocks = 400000\n",
        );
    let mut w = Node::start(&worker_cfg);
    let p1 = free_port();
    // No snapshots: a router that starts later must learn the worker from
    // its dump, not from a snapshot this one took in time (catch_up.rs
    // tests snapshots).
    let g1_cfg = kv_aware(node_config("g1", &nats.url, Some(p1), 0, "")).replace(
        "policy = \"kv_aware\"",
        "policy = \"kv_aware\"\nkv_snapshots = false",
    );
    assert!(g1_cfg.contains("kv_snapshots = false"), "{g1_cfg}");
    let mut g1 = Node::start(&g1_cfg);
    let h1 = Http::new(p1);
    h1.wait_ready(1, &mut g1).await;
    const PROMPTS: usize = 80;
    let prompt = |i: usize| -> Vec<u32> {
        std::iter::once(100 + i as u32)
            .chain((1..8192u32).map(|k| 200 + (k * 13 + i as u32) % 40000))
            .collect()
    };
    for i in 0..PROMPTS {
        let r = h1
            .post(
                "/v1/completions",
                &json!({"model": MODEL, "prompt": prompt(i), "max_tokens": 1}),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.json);
    }
    assert!(w.alive());
    let worker = registrations(&nats.url).await[0].worker_id.to_string();
    // What the worker itself holds, by tier (its dump comes in pieces).
    let (want, bytes) = dynamo_integration::kv::held_dump(&nats.url, &worker).await;
    assert!(
        bytes > dynamo_bus_schema::MAX_MESSAGE,
        "{bytes} bytes fit one message"
    );
    assert!(want.iter().sum::<u64>() >= 300_000, "{want:?}");
    // The router that watched it happen, from the (byte-bounded) events.
    let t0 = Instant::now();
    while indexed(&h1, &worker).await != want {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "events: {:?} vs {want:?}",
            indexed(&h1, &worker).await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A router that starts now, with the KV events stream past its
    // retention (purged), learns all of it from one dump, in pieces.
    dynamo_integration::kv::purge_kv_events(&nats.url).await;
    let p2 = free_port();
    let mut g2 = Node::start(&kv_aware(node_config("g2", &nats.url, Some(p2), 0, "")));
    let h2 = Http::new(p2);
    h2.wait_ready(1, &mut g2).await;
    let t0 = Instant::now();
    while indexed(&h2, &worker).await != want {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "dump: {:?} vs {want:?}\n{}",
            indexed(&h2, &worker).await,
            g2.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(h2.metric("dynamo_router_kv_dumps_total").await >= 1);
    // And it routes from it: the first prompt's blocks are all found.
    let o = h2.overlap(&prompt(0)).await;
    let found = o[&worker]["blocks"].as_u64().unwrap_or(0);
    assert_eq!(found, 4096, "{o}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_lost_its_bus_stops_within_its_grace_without_waiting_on_it() {
    let nats = Nats::start();
    let port = free_port();
    // Shutdown grace 10 s; one stream that would take longer than that.
    let mut node = Node::start(&real_time(node_config("n1", &nats.url, Some(port), 1, "")));
    Http::new(port).wait_ready(1, &mut node).await;
    let flowing = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let stream = tokio::spawn(stream_completion(port, prompt(1), 4000, flowing.clone()));
    let t0 = Instant::now();
    while flowing.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the stream never started"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(nats); // the bus goes away mid-stream
    let t0 = Instant::now();
    // SAFETY: signals the node's own process.
    unsafe { libc::kill(node.pid() as i32, libc::SIGTERM) };
    let code = node.wait(Duration::from_secs(30));
    let took = t0.elapsed();
    let log = node.log_text();
    assert_eq!(code, Some(0), "{log}");
    assert!(log.contains("not waiting for in-flight requests"), "{log}");
    assert!(log.contains("node stopped"), "{log}");
    assert!(
        took < Duration::from_secs(10),
        "took {took:?}, past the 10 s grace:\n{log}"
    );
    // The client is told, not left hanging.
    let s = stream.await.unwrap();
    assert!(!s.done || s.error.is_some(), "{s:?}");
}

/// Reads what the server sends until it closes the connection (bounded).
async fn until_closed(s: &mut tokio::net::TcpStream) -> (String, Instant) {
    use tokio::io::AsyncReadExt;
    let mut out = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut out)).await;
    assert!(read.is_ok(), "the server never closed the connection");
    (String::from_utf8_lossy(&out).into_owned(), Instant::now())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_clients_are_cut_off_and_open_connections_are_bounded() {
    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpStream;
    let nats = Nats::start();
    let port = free_port();
    let cfg = node_config("n1", &nats.url, Some(port), 1, "").replace(
        "shutdown_grace_ms = 10000\n",
        "shutdown_grace_ms = 10000\nclient_timeout_ms = 1000\nmax_connections = 3\n",
    );
    let mut node = Node::start(&cfg);
    let http = Http::new(port);
    http.wait_ready(1, &mut node).await;
    let connect = || TcpStream::connect(("127.0.0.1", port));
    // Headers sent halfway, then nothing: the connection is closed.
    let mut half = connect().await.unwrap();
    half.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    // A body that stops: a 408 OpenAI error, then the connection closes.
    let mut stalled = connect().await.unwrap();
    stalled
        .write_all(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\":",
        )
        .await
        .unwrap();
    let (text, _) = until_closed(&mut half).await;
    assert!(!text.contains(" 200 "), "{text}");
    let (text, _) = until_closed(&mut stalled).await;
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    let body: Value = serde_json::from_str(text.split("\r\n\r\n").nth(1).unwrap_or("")).unwrap();
    assert_eq!(body["error"]["code"], "body_timeout", "{body}");
    assert!(body["error"]["message"].is_string(), "{body}");
    // Three connections that send nothing fill the server's three places
    // (the client's pooled ones have timed out by now): a fourth is
    // answered only once the timeout has closed one of them.
    let opened = Instant::now();
    let mut idle = Vec::new();
    for _ in 0..3 {
        idle.push(connect().await.unwrap());
    }
    let mut fourth = connect().await.unwrap();
    fourth
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let answer = tokio::spawn(async move { until_closed(&mut fourth).await });
    for s in &mut idle {
        let (text, _) = until_closed(s).await;
        assert!(!text.contains(" 200 "), "{text}");
    }
    let (text, answered) = answer.await.unwrap();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    // A place frees only when an idle connection's timeout (1 s from its
    // accept, which came after `opened`) closes it.
    assert!(
        answered.duration_since(opened) >= Duration::from_millis(1000),
        "the fourth connection was served while three were open"
    );
    // And the server serves as before.
    http.assert_serves().await;
    assert!(!node.log_text().contains("panicked"));
}

/// Waits until the gateway's router counts `n` requests in flight.
async fn until_routed(http: &Http, n: u64) {
    let t0 = Instant::now();
    while routed(http).await < n {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the requests never ran"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `n` requests of about a minute each at the mocker's pace, in a set of
/// their own (dropping it ends them): each one's status, or the error when
/// its gateway went away.
fn long_requests(port: u16, n: usize) -> tokio::task::JoinSet<reqwest::Result<u16>> {
    let client = reqwest::Client::new();
    let mut set = tokio::task::JoinSet::new();
    for i in 0..n {
        let (c, url) = (
            client.clone(),
            format!("http://127.0.0.1:{port}/v1/completions"),
        );
        let body =
            json!({"model": MODEL, "prompt": prompt(i), "max_tokens": 8000, "ignore_eos": true});
        set.spawn(async move {
            c.post(url)
                .json(&body)
                .send()
                .await
                .map(|r| r.status().as_u16())
        });
    }
    set
}

/// A series' values summed over its labels (`series` ends with `{`).
fn sum_of(text: &str, series: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(series))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A gateway killed mid-request leaves no work behind: its worker finds
/// that nothing subscribes to the gateway's inbox any more (twice, 5 s
/// apart) and cancels what it ran for it, instead of generating a minute
/// of tokens for no one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_stops_the_requests_of_a_gateway_that_died() {
    let nats = Nats::start();
    let (port, metrics) = (free_port(), free_port());
    let mut gw = Node::start(&real_time(node_config("gw", &nats.url, Some(port), 0, "")));
    let listen = format!("[metrics]\nlisten = \"127.0.0.1:{metrics}\"\n");
    let _w = Node::start(&real_time(node_config("w1", &nats.url, None, 1, &listen)));
    Http::new(port).wait_ready(1, &mut gw).await;
    let _calls = long_requests(port, 4);
    let inflight = |regs: &[dynamo_bus_schema::WorkerRegistration]| -> u32 {
        regs.iter().map(|r| r.load.inflight_requests).sum()
    };
    let t0 = Instant::now();
    while inflight(&registrations(&nats.url).await) < 4 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the requests never ran"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    gw.signal(libc::SIGKILL);
    let t0 = Instant::now();
    while inflight(&registrations(&nats.url).await) > 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(40),
            "the worker still runs the dead gateway's requests"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let text = dashboard::scrape(metrics).await;
    let cancelled = sum_of(&text, "dynamo_worker_orphans_cancelled_total{");
    assert_eq!(cancelled, 4.0, "{text}");
}

/// A bus outage longer than the liveness timeout: the gateway tells it
/// from a silent worker (its own connection is down) and holds its
/// requests, which go on when the bus is back (where a frame was lost,
/// on another worker from the tokens received): each is answered whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_outlive_a_bus_outage_longer_than_the_liveness_timeout() {
    let mut nats = Nats::start();
    let port = free_port();
    let mut gw = Node::start(&real_time(node_config("gw", &nats.url, Some(port), 0, "")));
    let _w1 = Node::start(&real_time(node_config("w1", &nats.url, None, 1, "")));
    let _w2 = Node::start(&real_time(node_config("w2", &nats.url, None, 1, "")));
    let http = Http::new(port);
    http.wait_ready(2, &mut gw).await;
    let client = reqwest::Client::new();
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..4 {
        let (c, url) = (
            client.clone(),
            format!("http://127.0.0.1:{port}/v1/completions"),
        );
        let body =
            json!({"model": MODEL, "prompt": prompt(i), "max_tokens": 1500, "ignore_eos": true});
        calls.spawn(async move {
            let r = c.post(url).json(&body).send().await.expect("an answer");
            (r.status().as_u16(), r.json::<Value>().await.expect("JSON"))
        });
    }
    until_routed(&http, 4).await;
    nats.stop();
    tokio::time::sleep(Duration::from_secs(5)).await;
    nats.restart();
    while let Some(c) = calls.join_next().await {
        let (status, body) = c.unwrap();
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["usage"]["completion_tokens"], 1500, "{body}");
    }
}

/// Clients that leave during a bus outage: no work is left behind (about a
/// minute of tokens each, otherwise). The gateway's cancels may reach the
/// worker once the bus is back (the client buffers them), or be lost with
/// it; then the worker's heartbeats of those requests reach a gateway that
/// no longer has them, which tells the worker to stop them (that path is
/// shown alone by `inbox.rs`'s unit test; here either may act).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_whose_clients_left_during_a_bus_outage_are_stopped_when_it_is_back() {
    let mut nats = Nats::start();
    let (port, metrics) = (free_port(), free_port());
    let mut gw = Node::start(&real_time(node_config("gw", &nats.url, Some(port), 0, "")));
    let listen = format!("[metrics]\nlisten = \"127.0.0.1:{metrics}\"\n");
    let _w = Node::start(&real_time(node_config("w1", &nats.url, None, 1, &listen)));
    let http = Http::new(port);
    http.wait_ready(1, &mut gw).await;
    let mut calls = long_requests(port, 4);
    until_routed(&http, 4).await;
    nats.stop();
    tokio::time::sleep(Duration::from_secs(1)).await;
    calls.abort_all();
    tokio::time::sleep(Duration::from_secs(8)).await;
    nats.restart();
    let t0 = Instant::now();
    // The worker's own count of what its engine runs.
    loop {
        let running = sum_of(
            &dashboard::scrape(metrics).await,
            "dynamo_worker_active_seqs{",
        );
        if running == 0.0 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the worker still runs {running} requests no one waits for:\n{}",
            gw.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
