//! KV-aware routing against real processes: the router's index is fed by the
//! workers' KV events over NATS, repairs gaps and duplicates, and forgets a
//! restarted worker's blocks.

use dynamo_bus_schema::blocks::SequenceHash;
use dynamo_bus_schema::{
    decode, encode, EventId, FaultAck, FaultInjection, FaultKind, KvEvent, KvEventBatch,
    KvEventKind, StorageTier, WorkerId,
};
use dynamo_integration::*;
use serde_json::json;
use std::time::{Duration, Instant};

async fn wait_for(what: &str, mut f: impl AsyncFnMut() -> bool) {
    let t0 = Instant::now();
    while !f().await {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_aware_routing_follows_the_cache_and_the_index_stays_exact() {
    let nats = Nats::start();
    let port = free_port();
    let cfg = node_config(
        "n1",
        &nats.url,
        Some(port),
        2,
        "[supervision]\nrestart_base_ms = 50\nfault_injection = true\n",
    )
    .replace("policy = \"least_loaded\"", "policy = \"kv_aware\"");
    let mut node = Node::start(&cfg);
    let http = Http::new(port);
    http.wait_ready(2, &mut node).await;

    // A long prompt goes somewhere, then keeps going to the worker that caches it.
    let prompt: Vec<u32> = (300..600).collect(); // 18 full blocks + 12 tokens
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2});
    let first = http.post("/v1/completions", &body).await;
    assert_eq!(first.status, 200, "{}", first.json);
    let x = first.worker.clone().unwrap();
    let device = format!("dynamo_router_kv_index_blocks{{worker=\"{x}\",tier=\"device\"}}");
    wait_for("the index to learn the prompt's blocks", async || {
        http.metric(&device).await >= 18
    })
    .await;
    for _ in 0..6 {
        let r = http.post("/v1/completions", &body).await;
        assert_eq!(
            r.worker.as_deref(),
            Some(x.as_str()),
            "KV-aware routing left the cached worker"
        );
        assert_eq!(
            r.json["usage"]["prompt_tokens_details"]["cached_tokens"],
            288
        );
    }
    let held = http.metric(&device).await;
    // The router's prediction matched what the engine reported, request for request.
    let predicted = http
        .metric("dynamo_gateway_predicted_cached_tokens_total")
        .await;
    let actual = http.metric("dynamo_gateway_cached_tokens_total").await;
    assert_eq!(predicted, 6 * 288);
    assert_eq!(actual, 6 * 288);
    assert!(
        http.metric("dynamo_router_find_matches_seconds_count")
            .await
            >= 7
    );
    assert!(http.metric("dynamo_router_route_seconds_count").await >= 7);

    // A duplicate event (old id) and a bogus far-future event: detected, repaired from a dump.
    let regs = registrations(&nats.url).await;
    let reg = regs.iter().find(|r| r.worker_id.to_string() == x).unwrap();
    let client = async_nats::connect(&nats.url).await.unwrap();
    let subject = format!("dynamo.it.kv.{x}");
    let bogus = |id: u64| KvEventBatch {
        worker_id: reg.worker_id,
        generation: reg.generation,
        events: vec![KvEvent {
            event_id: EventId(id),
            kind: KvEventKind::Stored,
            tier: StorageTier::Device,
            parent: None,
            blocks: vec![SequenceHash(42), SequenceHash(43)],
        }],
        published_unix_ms: dynamo_bus_schema::unix_ms(),
    };
    let dumps0 = http.metric("dynamo_router_kv_dumps_total").await;
    client
        .publish(subject.clone(), encode(&bogus(1)).unwrap().into())
        .await
        .unwrap();
    wait_for("a duplicate to be counted", async || {
        http.metric("dynamo_router_kv_event_duplicates_total").await >= 1
    })
    .await;
    client
        .publish(subject, encode(&bogus(1_000_000)).unwrap().into())
        .await
        .unwrap();
    wait_for("a gap to be counted", async || {
        http.metric("dynamo_router_kv_event_gaps_total").await >= 1
    })
    .await;
    wait_for("the gap to be repaired by a dump", async || {
        http.metric("dynamo_router_kv_dumps_total").await > dumps0
    })
    .await;
    assert_eq!(
        http.metric(&device).await,
        held,
        "the index must equal the worker's own table again"
    );
    let r = http.post("/v1/completions", &body).await;
    assert_eq!(r.worker.as_deref(), Some(x.as_str()));
    // Per-request weights (the `routing` extension) are accepted.
    let mut weighted = body.clone();
    weighted["routing"] = json!({"overlap_weight": 4.0, "temperature": 0.0});
    let r = http.post("/v1/completions", &weighted).await;
    assert_eq!(r.status, 200, "{}", r.json);
    assert_eq!(r.worker.as_deref(), Some(x.as_str()));

    // Restarting the worker (actor panic → new engine) clears its blocks from the index.
    let msg = FaultInjection {
        worker_id: reg.worker_id,
        fault: FaultKind::PanicActor,
    };
    let ack = client
        .request("dynamo.it.node.n1.fault", encode(&msg).unwrap().into())
        .await
        .unwrap();
    assert!(decode::<FaultAck>(&ack.payload).unwrap().applied);
    let gen0 = reg.generation;
    let wid: WorkerId = reg.worker_id;
    let url = nats.url.clone();
    wait_for("the restarted worker", async || {
        registrations(&url)
            .await
            .iter()
            .any(|r| r.worker_id == wid && r.generation > gen0)
    })
    .await;
    wait_for(
        "the restarted worker's blocks to leave the index",
        async || http.metric(&device).await == 0,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_size_mismatch_is_reported_loudly() {
    let nats = Nats::start();
    let port = free_port();
    let mut gw = Node::start(
        &node_config("gw", &nats.url, Some(port), 0, "")
            .replace("policy = \"least_loaded\"", "policy = \"kv_aware\""),
    );
    let _good = Node::start(&node_config("good", &nats.url, None, 1, ""));
    let http = Http::new(port);
    http.wait_ready(1, &mut gw).await;
    let _odd = Node::start(
        &node_config("odd", &nats.url, None, 1, "")
            .replace("speedup = 0.0", "speedup = 0.0\nblock_size = 32"),
    );
    http.wait_ready(2, &mut gw).await;
    wait_for("the mismatch metric", async || {
        http.metric("dynamo_router_kv_config_mismatch ").await == 1
    })
    .await;
    assert!(
        gw.log_text().contains("KV block configuration mismatch"),
        "not logged"
    );
    let out = std::process::Command::new(bin("dynamoctl"))
        .args(["status", "--json", "--namespace", "it", "--nats", &nats.url])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let flagged: Vec<&serde_json::Value> = v["workers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|w| w["kv_config_mismatch"] == true)
        .collect();
    assert_eq!(flagged.len(), 1, "{v}");
    assert_eq!(flagged[0]["node_id"], "odd");
    assert_eq!(flagged[0]["block_size"], 32);
    // Requests still succeed on both workers.
    for i in 0..4 {
        let r = http
            .post(
                "/v1/completions",
                &json!({"model": MODEL, "prompt": format!("x {i}"), "max_tokens": 2}),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.json);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_without_kv_events_are_routed_approximately() {
    let nats = Nats::start();
    let port = free_port();
    let cfg = node_config("n1", &nats.url, Some(port), 2, "")
        .replace("policy = \"least_loaded\"", "policy = \"kv_aware\"")
        .replace("speedup = 0.0", "speedup = 0.0\nemit_kv_events = false")
        // A worker starved of CPU for the 3 s TTL (2 loaded cores) would be
        // dropped with its approximate blocks, which is not under test here.
        .replace("worker_ttl_ms = 3000\n", "worker_ttl_ms = 60000\n");
    assert!(cfg.contains("worker_ttl_ms = 60000"));
    let mut node = Node::start(&cfg);
    let http = Http::new(port);
    http.wait_ready(2, &mut node).await;
    assert!(registrations(&nats.url).await.iter().all(|r| !r.kv_events));
    let prompt: Vec<u32> = (900..1100).collect();
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2});
    let first = http.post("/v1/completions", &body).await;
    let x = first.worker.clone().unwrap();
    for _ in 0..4 {
        let r = http.post("/v1/completions", &body).await;
        assert_eq!(
            r.worker.as_deref(),
            Some(x.as_str()),
            "approximate routing left the worker it sent the prompt to"
        );
        assert!(
            r.json["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
                > 0
        );
    }
    let o = http
        .post(
            "/v1/dynamo/overlap",
            &json!({"model": MODEL, "prompt": prompt}),
        )
        .await
        .json;
    assert_eq!(o["workers"][&x]["blocks"], 12, "{o}");
    assert_eq!(
        http.metric("dynamo_router_kv_events_applied_total").await,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_process_leaves_the_index_and_restarts_empty() {
    let nats = Nats::start();
    let port = free_port();
    let mut gw = Node::start(
        &node_config("gw", &nats.url, Some(port), 0, "")
            .replace("policy = \"least_loaded\"", "policy = \"kv_aware\""),
    );
    let wcfg = node_config("w1", &nats.url, None, 1, "");
    let mut w = Node::start(&wcfg);
    let http = Http::new(port);
    http.wait_ready(1, &mut gw).await;
    let body = json!({"model": MODEL, "prompt": (300..600).collect::<Vec<u32>>(), "max_tokens": 2});
    let r = http.post("/v1/completions", &body).await;
    let x = r.worker.unwrap();
    let device = format!("dynamo_router_kv_index_blocks{{worker=\"{x}\",tier=\"device\"}}");
    wait_for("blocks in the index", async || {
        http.metric(&device).await >= 18
    })
    .await;
    let listed = async |http: &Http| {
        let m = http.metrics_text().await;
        m.contains(&format!("worker=\"{x}\""))
    };
    w.signal(libc::SIGKILL);
    w.wait(Duration::from_secs(5));
    // After the registration TTL (3 s) the worker and its blocks are gone.
    wait_for("the dead worker to leave the index", async || {
        !listed(&http).await
    })
    .await;
    // The same node restarts: same worker id, new engine, nothing indexed until it stores blocks.
    let mut w2 = Node::start(&wcfg);
    http.wait_ready(1, &mut w2).await;
    wait_for("the restarted worker to be indexed empty", async || {
        listed(&http).await
    })
    .await;
    assert_eq!(http.metric(&device).await, 0);
    let r = http.post("/v1/completions", &body).await;
    assert_eq!(r.worker.as_deref(), Some(x.as_str()));
    assert_eq!(r.json["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    wait_for("its new blocks", async || http.metric(&device).await >= 18).await;
}
