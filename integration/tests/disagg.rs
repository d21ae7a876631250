//! Disaggregated serving with real processes: a gateway node, a prefill
//! node and a decode node running the real CPU engine, KV blocks moving
//! over real libfabric endpoints (`tcp;ofi_rxm` on loopback).
//!
//! - Greedy outputs equal aggregated serving's, token for token.
//! - A decode worker that stops polling its endpoint makes the prefill
//!   worker's write time out: the request still completes (local prefill,
//!   reported in `timings.fallback`), and the failing peer gets fenced.
//! - A prefill worker killed with `kill -9` costs no request.

use dynamo_bus_schema::{decode, encode, FaultAck, FaultInjection, FaultKind, WorkerRole};
use dynamo_integration::*;
use serde_json::{json, Value};
use std::time::Duration;

const CPU: &str = "engine = \"cpu\"\nheartbeat_ms = 500\nblock_size = 16\n";
const CPU_SETTINGS: &str = "[workers.cpu]\nthreads = 1\nnum_blocks = 256\n\n";

fn gateway(nats: &Nats, port: u16) -> Node {
    let cfg = node_config("gw", &nats.url, Some(port), 0, "").replace(
        "worker_ttl_ms = 3000\n",
        "worker_ttl_ms = 3000\nmin_remote_prefill_tokens = 32\n",
    );
    Node::start(&cfg)
}

fn worker(nats: &Nats, name: &str, role: &str, transfer: &str) -> Node {
    worker_with(nats, name, role, transfer, CPU_SETTINGS)
}

fn worker_with(nats: &Nats, name: &str, role: &str, transfer: &str, cpu: &str) -> Node {
    let extra = format!(
        "[[workers]]\ncount = 1\nrole = \"{role}\"\nmodel = \"{MODEL}\"\n{CPU}\n\
         [workers.transfer]\n{transfer}\n\n{cpu}\
         [supervision]\nfault_injection = true\n"
    );
    Node::start(&node_config(name, &nats.url, None, 0, &extra))
}

/// Prompts long enough to be prefilled remotely (> 32 uncached tokens).
fn prompts() -> Vec<Value> {
    let topics = [
        "the water cycle",
        "why the sky is blue",
        "how bread rises",
        "what a prime number is",
        "how a rainbow forms",
    ];
    topics
        .iter()
        .map(|t| {
            json!([
                {"role": "system", "content": "You are a careful teacher. Answer in two short sentences, plainly, for a curious twelve year old reader who likes facts."},
                {"role": "user", "content": format!("Explain {t}.")},
            ])
        })
        .collect()
}

async fn chat(http: &Http, messages: &Value) -> (String, Value, Value) {
    let body = json!({"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0});
    let r = http.post("/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.json);
    let text = r.json["choices"][0]["message"]["content"]
        .as_str()
        .expect("content")
        .to_string();
    (text, r.json["timings"].clone(), r.json["usage"].clone())
}

async fn inject(nats: &Nats, node: &str, role: WorkerRole, fault: FaultKind) {
    let worker = registrations(&nats.url)
        .await
        .into_iter()
        .find(|r| r.role == role)
        .expect("worker of that role")
        .worker_id;
    let client = async_nats::connect(&nats.url).await.unwrap();
    let msg = FaultInjection {
        worker_id: worker,
        fault,
    };
    let reply = client
        .request(
            format!("dynamo.it.node.{node}.fault"),
            encode(&msg).unwrap().into(),
        )
        .await
        .unwrap();
    let ack: FaultAck = decode(&reply.payload).unwrap();
    assert!(ack.applied, "{}", ack.message);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_greedy_outputs_equal_aggregated_ones() {
    // Aggregated: one CPU worker behind its own gateway and bus.
    let agg_nats = Nats::start();
    let agg_port = free_port();
    let mut agg = Node::start(&node_config(
        "agg",
        &agg_nats.url,
        Some(agg_port),
        0,
        &format!("[[workers]]\ncount = 1\nmodel = \"{MODEL}\"\n{CPU}\n{CPU_SETTINGS}"),
    ));
    let agg_http = Http::new(agg_port);
    agg_http.wait_ready(1, &mut agg).await;
    let mut expected = Vec::new();
    for p in prompts() {
        expected.push(chat(&agg_http, &p).await.0);
    }
    drop(agg);

    // Disaggregated: gateway, prefill and decode nodes on another bus.
    let nats = Nats::start();
    let port = free_port();
    let mut prefill = worker(&nats, "prefill", "prefill", "");
    let _decode = worker(&nats, "decode", "decode", "");
    let mut gw = gateway(&nats, port);
    let http = Http::new(port);
    http.wait_ready(2, &mut gw).await;
    let regs = registrations(&nats.url).await;
    let prefill_id = regs
        .iter()
        .find(|r| r.role == WorkerRole::Prefill)
        .expect("prefill worker")
        .worker_id
        .to_string();
    let prompts = prompts();
    let (last, first) = prompts.split_last().expect("prompts");
    for (p, want) in first.iter().zip(&expected) {
        let (text, timings, usage) = chat(&http, p).await;
        assert_eq!(&text, want, "disaggregated output differs");
        assert_eq!(timings["disaggregated"], true, "{timings}");
        assert_eq!(timings["prefill_worker"], prefill_id.as_str());
        assert!(timings["fallback"].is_null(), "{timings}");
        assert!(timings["transfer_ms"].as_f64().unwrap() > 0.0, "{timings}");
        // The transferred blocks were served from the decode worker's cache.
        assert!(
            usage["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
                >= 32
        );
    }
    let phases = http
        .metric("dynamo_gateway_request_phase_seconds_count{mode=\"remote\",phase=\"transfer\"}")
        .await;
    assert_eq!(phases, first.len() as u64);

    // A prefill worker killed with -9 (still registered for a moment) costs
    // no request: the decode worker finds no responder and prefills locally.
    prefill.signal(libc::SIGKILL);
    prefill.wait(Duration::from_secs(5));
    let (text, timings, _) = chat(&http, last).await;
    assert_eq!(&text, expected.last().unwrap());
    if timings["disaggregated"] == false && !timings["fallback"].is_null() {
        let reason = timings["fallback"].as_str().unwrap();
        assert!(reason.contains("failed"), "{reason}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_transfers_fall_back_to_local_prefill_and_fence_the_peer() {
    let nats = Nats::start();
    let port = free_port();
    let _prefill = worker(&nats, "prefill", "prefill", "write_timeout_ms = 1000");
    let _decode = worker(
        &nats,
        "decode",
        "decode",
        "prefill_timeout_ms = 20000\nfence_after = 2\nfence_for_ms = 60000",
    );
    let mut gw = gateway(&nats, port);
    let http = Http::new(port);
    http.wait_ready(2, &mut gw).await;
    let prompts = prompts();
    let (want, timings, _) = chat(&http, &prompts[0]).await;
    assert_eq!(timings["disaggregated"], true, "{timings}");

    // The decode worker's endpoint stops polling: writes into it stall.
    inject(
        &nats,
        "decode",
        WorkerRole::Decode,
        FaultKind::StopTransferProgress,
    )
    .await;
    let mut reasons = Vec::new();
    for p in &prompts[1..3] {
        let (text, timings, _) = chat(&http, p).await;
        assert!(!text.is_empty());
        assert_eq!(timings["disaggregated"], false, "{timings}");
        reasons.push(timings["fallback"].as_str().expect("a reason").to_string());
    }
    assert!(
        reasons[0].contains("transfer"),
        "first failure is the write timeout: {reasons:?}"
    );
    // Two failures in a row fence the prefill worker: no more waiting on it.
    let (again, timings, _) = chat(&http, &prompts[0]).await;
    assert_eq!(again, want, "a local prefill gives the same answer");
    let reason = timings["fallback"].as_str().expect("a reason");
    assert!(reason.contains("fenced"), "{reason}");
    assert!(http.metric("dynamo_gateway_disagg_fallbacks_total").await >= 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_during_a_remote_prefill_stops_the_prefill_too() {
    let nats = Nats::start();
    let port = free_port();
    // Small prefill chunks: a cancel takes effect at the next step.
    let small_steps =
        "[workers.cpu]\nthreads = 1\nnum_blocks = 256\nmax_num_batched_tokens = 64\n\n";
    let _prefill = worker_with(&nats, "prefill", "prefill", "", small_steps);
    let _decode = worker(&nats, "decode", "decode", "");
    let mut gw = gateway(&nats, port);
    let http = Http::new(port);
    http.wait_ready(2, &mut gw).await;
    // About 20 s of prefill on one thread: far longer than the wait below.
    let prompt: Vec<u32> = (0..1500).map(|i| 1000 + (i * 37) % 30000).collect();
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": true});
    let busy = |regs: &[dynamo_bus_schema::WorkerRegistration]| {
        regs.iter()
            .find(|r| r.role == WorkerRole::Prefill)
            .map(|r| r.load.active_seqs + r.load.waiting_seqs)
            .unwrap_or(0)
    };
    let stream = http.open("/v1/completions", &body).await;
    assert_eq!(stream.status().as_u16(), 200);
    let t0 = std::time::Instant::now();
    while busy(&registrations(&nats.url).await) == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the prefill never started"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(stream); // the client leaves
    let t0 = std::time::Instant::now();
    while busy(&registrations(&nats.url).await) > 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(8),
            "the prefill worker kept computing for a client that left"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Both workers serve the next request.
    let (text, timings, _) = chat(&http, &prompts()[0]).await;
    assert!(!text.is_empty());
    assert_eq!(timings["disaggregated"], true, "{timings}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mocker_workers_disaggregate_with_buffers_of_the_configured_size() {
    let nats = Nats::start();
    let port = free_port();
    let mocker = |name: &str, role: &str| {
        let extra = format!(
            "[[workers]]\ncount = 1\nrole = \"{role}\"\nengine = \"mocker\"\nmodel = \"{MODEL}\"\n\
             heartbeat_ms = 500\n\n[workers.mocker]\nspeedup = 0.0\nkv_bytes_per_block = 131072\n"
        );
        Node::start(&node_config(name, &nats.url, None, 0, &extra))
    };
    let _p = mocker("prefill", "prefill");
    let _d = mocker("decode", "decode");
    let mut gw = gateway(&nats, port);
    let http = Http::new(port);
    http.wait_ready(2, &mut gw).await;
    let prompt: Vec<u32> = (1000..1100).collect();
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 12});
    let r = http.post("/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.json);
    let t = &r.json["timings"];
    assert_eq!(t["disaggregated"], true, "{t}");
    assert!(t["transfer_ms"].as_f64().unwrap() > 0.0, "{t}");
    // 6 full blocks of 16 moved; the decode worker recomputes only the tail.
    assert_eq!(
        r.json["usage"]["prompt_tokens_details"]["cached_tokens"],
        96
    );
    assert_eq!(r.json["choices"][0]["text"], expected_text(&prompt, 12).1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_land_in_scattered_pool_blocks_through_one_window_per_run() {
    let nats = Nats::start();
    let port = free_port();
    // A decode pool of 16 blocks: after two 7-block requests it is full, and
    // the blocks reserved next come from the LRU, which hands out a finished
    // prompt's blocks in reverse order (released tail first), so they are
    // not consecutive and need a window each.
    let mocker = |name: &str, role: &str, blocks: u32| {
        let extra = format!(
            "[[workers]]\ncount = 1\nrole = \"{role}\"\nengine = \"mocker\"\nmodel = \"{MODEL}\"\n\
             heartbeat_ms = 500\n\n[workers.mocker]\nspeedup = 0.0\nkv_bytes_per_block = 65536\n\
             num_blocks = {blocks}\n"
        );
        Node::start_with_log(
            &node_config(name, &nats.url, None, 0, &extra),
            "info,dynamo_worker=debug,async_nats=warn",
        )
    };
    let _p = mocker("prefill", "prefill", 1024);
    let d = mocker("decode", "decode", 16);
    let mut gw = gateway(&nats, port);
    let http = Http::new(port);
    http.wait_ready(2, &mut gw).await;
    for i in 0..5u32 {
        let prompt: Vec<u32> = (0..100).map(|t| 1000 + i * 1000 + t).collect();
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 12});
        let r = http.post("/v1/completions", &body).await;
        assert_eq!(r.status, 200, "{}", r.json);
        let t = &r.json["timings"];
        assert_eq!(t["disaggregated"], true, "{t}");
        assert!(t["fallback"].is_null(), "{t}");
        // All 6 full blocks came through the pool (the mocker refuses a
        // block that does not carry its own hash: a misplaced write fails).
        assert_eq!(
            r.json["usage"]["prompt_tokens_details"]["cached_tokens"],
            96
        );
        assert_eq!(r.json["choices"][0]["text"], expected_text(&prompt, 12).1);
    }
    let log = d.log_text();
    let windows: Vec<u32> = log
        .lines()
        .filter(|l| l.contains("remote prefill done"))
        .filter_map(|l| {
            l.split("windows=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect();
    assert_eq!(windows.len(), 5, "{log}");
    assert_eq!(windows[0], 1, "a fresh pool gives consecutive blocks");
    assert!(
        windows.iter().any(|&w| w > 1),
        "an evicting pool scatters the blocks: {windows:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_evicted_to_host_memory_are_announced_and_served_from_there() {
    let nats = Nats::start();
    let port = free_port();
    let cfg = node_config(
        "cpu",
        &nats.url,
        Some(port),
        0,
        &format!(
            "[[workers]]\ncount = 1\nmodel = \"{MODEL}\"\n{CPU}\n\
             [workers.cpu]\nthreads = 1\nnum_blocks = 24\noffload_host_blocks = 64\n"
        ),
    )
    .replace("policy = \"least_loaded\"", "policy = \"kv_aware\"");
    let mut node = Node::start(&cfg);
    let http = Http::new(port);
    http.wait_ready(1, &mut node).await;
    let ask = |topic: &str| {
        json!([
            {"role": "system", "content": format!("{topic} Be exact and brief. ").repeat(25)},
            {"role": "user", "content": topic},
        ])
    };
    let (first, _, _) = chat(&http, &ask("Name a planet.")).await;
    // Two other long prompts push the first one's blocks out of the pool.
    for topic in ["Name a river.", "Name a colour."] {
        chat(&http, &ask(topic)).await;
    }
    let regs = registrations(&nats.url).await;
    let host = format!(
        "dynamo_router_kv_index_blocks{{worker=\"{}\",tier=\"host\"}}",
        regs[0].worker_id
    );
    let t0 = std::time::Instant::now();
    while http.metric(&host).await == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "no host-tier blocks indexed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (again, _, usage) = chat(&http, &ask("Name a planet.")).await;
    assert_eq!(again, first);
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= 64, "cached {cached}");
}

/// BENCHMARKS.md: time to first token of a 2,000-token prompt, aggregated
/// (one CPU worker) against disaggregated (prefill worker → `tcp;ofi_rxm`
/// → decode worker), with the phase breakdown each response reports; 3
/// fresh prompts each. `cargo test --release -p dynamo-integration --test
/// disagg -- --ignored --nocapture ttft_breakdown` (after `cargo build
/// --release --bins`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run explicitly (make bench)"]
async fn ttft_breakdown() {
    const TRIALS: u32 = 3;
    const LEN: u32 = 2000;
    let settings = "[workers.cpu]\nthreads = 2\nnum_blocks = 512\n\n";
    let prompt = |trial: u32, mode: u32| -> Vec<u32> {
        (0..LEN)
            .map(|i| 1000 + (i * 7919 + trial * 104729 + mode * 15485863) % 40000)
            .collect()
    };
    let measure = |http: Http, mode: u32| async move {
        let mut rows = Vec::new();
        for trial in 0..TRIALS {
            let body = json!({"model": MODEL, "prompt": prompt(trial, mode), "max_tokens": 4,
                              "temperature": 0, "ignore_eos": true});
            let t0 = std::time::Instant::now();
            let r = http.post("/v1/completions", &body).await;
            assert_eq!(r.status, 200, "{}", r.json);
            let total = t0.elapsed().as_secs_f64() * 1000.0;
            rows.push((r.json["timings"].clone(), total));
        }
        rows
    };
    let nats = Nats::start();
    let port = free_port();
    let mut agg = Node::start(&node_config(
        "agg",
        &nats.url,
        Some(port),
        0,
        &format!("[[workers]]\ncount = 1\nmodel = \"{MODEL}\"\n{CPU}\n{settings}"),
    ));
    Http::new(port).wait_ready(1, &mut agg).await;
    let agg_rows = measure(Http::new(port), 0).await;
    drop(agg);
    drop(nats);

    let nats = Nats::start();
    let port = free_port();
    let worker = |name: &str, role: &str| {
        let extra = format!(
            "[[workers]]\ncount = 1\nrole = \"{role}\"\nmodel = \"{MODEL}\"\n{CPU}\n{settings}"
        );
        Node::start(&node_config(name, &nats.url, None, 0, &extra))
    };
    let _p = worker("prefill", "prefill");
    let _d = worker("decode", "decode");
    let mut gw = gateway(&nats, port);
    Http::new(port).wait_ready(2, &mut gw).await;
    let disagg_rows = measure(Http::new(port), 1).await;

    println!(
        "\n| mode | trial | first token ms | queue ms | prefill ms | transfer ms | request ms |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (mode, rows) in [("aggregated", &agg_rows), ("disaggregated", &disagg_rows)] {
        for (i, (t, total)) in rows.iter().enumerate() {
            if mode == "disaggregated" {
                assert_eq!(t["disaggregated"], true, "{t}");
            }
            println!(
                "| {mode} | {i} | {} | {} | {} | {} | {total:.0} |",
                t["first_token_ms"], t["queue_ms"], t["prefill_ms"], t["transfer_ms"]
            );
        }
    }
}
