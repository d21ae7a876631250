//! Several gateway+router replicas on one bus: they share active load, and a
//! replica started late agrees with the others (index and load) at once.

use dynamo_integration::*;
use serde_json::json;
use std::collections::HashMap;
use std::time::{Duration, Instant};

fn gateway_cfg(id: &str, nats: &str, port: u16) -> String {
    node_config(id, nats, Some(port), 0, "")
        .replace("policy = \"least_loaded\"", "policy = \"kv_aware\"")
}

/// Sends `n` requests open-loop, one every 5 ms (each lasts ~250 ms, so ~50
/// overlap), round-robin over `gws`; returns per-worker counts.
async fn spread(gws: &[Http], n: usize, tag: &str) -> HashMap<String, usize> {
    let futs = (0..n).map(|i| {
        let gw = &gws[i % gws.len()];
        let prompt: Vec<u32> = (0..64)
            .map(|k| 1000 + (i as u32 * 64 + k) % 30000)
            .collect();
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 40, "user": tag});
        async move {
            tokio::time::sleep(Duration::from_millis(5 * i as u64)).await;
            gw.post("/v1/completions", &body).await
        }
    });
    let mut counts = HashMap::new();
    for r in futures::future::join_all(futs).await {
        assert_eq!(r.status, 200, "{}", r.json);
        *counts.entry(r.worker.unwrap()).or_default() += 1;
    }
    counts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_load_and_a_late_replica_agrees() {
    let nats = Nats::start();
    // Four workers in real time (≈ 6 ms per decode step), so requests overlap.
    let wcfg = node_config("w", &nats.url, None, 4, "").replace("speedup = 0.0", "speedup = 1.0");
    let mut workers = Node::start(&wcfg);
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let mut gw_nodes: Vec<Node> = ports
        .iter()
        .enumerate()
        .map(|(i, p)| Node::start(&gateway_cfg(&format!("gw{i}"), &nats.url, *p)))
        .collect();
    let gws: Vec<Http> = ports.iter().map(|p| Http::new(*p)).collect();
    for (gw, node) in gws.iter().zip(gw_nodes.iter_mut()) {
        gw.wait_ready(4, node).await;
    }
    assert!(workers.alive());

    // Three replicas fed round-robin spread overlapping requests as evenly as one does.
    let one = spread(&gws[..1], 60, "one").await;
    let three = spread(&gws, 60, "three").await;
    let imbalance =
        |c: &HashMap<String, usize>| c.values().max().unwrap() - c.values().min().unwrap();
    assert_eq!(three.len(), 4, "{three:?}");
    // 60 requests over 4 workers: 15 each on average. Herding (replicas piling
    // onto the same "idle" worker) shows as a starved or doubled worker; the
    // bound leaves room for random tie-breaks on a noisy 2-core machine.
    assert!(
        imbalance(&three) <= imbalance(&one) + 6 && three.values().all(|&n| (8..=22).contains(&n)),
        "one replica {one:?}, three replicas {three:?}"
    );

    // The spread's last requests may still count in a replica's view for a
    // moment after their answers came back (a peer's "done" is on its
    // way): wait until every replica sees every worker idle, so the busy
    // worker found below is the long request's and not a leftover.
    for gw in &gws {
        let t0 = Instant::now();
        loop {
            let m = gw.metrics_text().await;
            let busy: Vec<&str> = m
                .lines()
                .filter(|l| l.starts_with("dynamo_router_worker_inflight{") && !l.ends_with(" 0"))
                .collect();
            if busy.is_empty() {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "load left over after the spread at {}: {busy:?}",
                gw.base
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    // A long request through replica 0 is visible in replica 1's load view.
    let long =
        json!({"model": MODEL, "prompt": (5000..5100).collect::<Vec<u32>>(), "max_tokens": 1500});
    let h = {
        let gw = Http::new(ports[0]);
        tokio::spawn(async move { gw.post("/v1/completions", &long).await })
    };
    let t0 = Instant::now();
    let busy_worker = loop {
        let m = gws[1].metrics_text().await;
        let busy = m
            .lines()
            .filter(|l| l.starts_with("dynamo_router_worker_inflight{") && l.ends_with(" 1"))
            .map(|l| l.split('"').nth(1).unwrap().to_string())
            .next();
        if let Some(w) = busy {
            break w;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "replica 1 never saw replica 0's request:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };

    // Every replica sees it before the late one starts: any of them may
    // answer the late replica's snapshot request.
    let key = format!("dynamo_router_worker_inflight{{worker=\"{busy_worker}\"}}");
    for gw in &gws {
        let t0 = Instant::now();
        while gw.metric(&key).await != 1 {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "a replica never saw the request"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    // A replica started now loads the active load and the KV index from its peers.
    let late_port = free_port();
    let mut late_node = Node::start(&gateway_cfg("late", &nats.url, late_port));
    let late = Http::new(late_port);
    late.wait_ready(4, &mut late_node).await;
    // The long request (~9 s of decode) is still running: the late replica
    // must see it from the snapshot it loaded.
    let t0 = Instant::now();
    while late.metric(&key).await != 1 {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "late replica does not see the in-flight request (still running: {})",
            !h.is_finished()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for i in [0usize, 7, 21, 40] {
        let prompt: Vec<u32> = (0..64)
            .map(|k| 1000 + (i as u32 * 64 + k) % 30000)
            .collect();
        let t0 = Instant::now();
        loop {
            let (a, b) = (gws[0].overlap(&prompt).await, late.overlap(&prompt).await);
            if a == b && a.as_object().is_some_and(|o| !o.is_empty()) {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(3),
                "replicas disagree on prompt {i}: {a} vs {b}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let r = h.await.unwrap();
    assert_eq!(r.status, 200);
    // Once it finished, every replica sees the worker idle again.
    for gw in gws.iter().chain([&late]) {
        let t0 = Instant::now();
        while gw.metric(&key).await != 0 {
            assert!(
                t0.elapsed() < Duration::from_secs(3),
                "stale load entry at {}",
                gw.base
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Load events on the bus, by kind, from `sub` over `wait`.
async fn load_events(sub: &mut async_nats::Subscriber, wait: Duration) -> (usize, usize) {
    use dynamo_bus_schema::{peek_kind, ActiveLoadEvent, RouterHeartbeat, WireMessage};
    use futures::StreamExt;
    let (mut loads, mut beats) = (0, 0);
    let until = tokio::time::Instant::now() + wait;
    while let Ok(Some(m)) = tokio::time::timeout_at(until, sub.next()).await {
        match peek_kind(&m.payload) {
            Ok((k, _)) if k == ActiveLoadEvent::KIND => loads += 1,
            Ok((k, _)) if k == RouterHeartbeat::KIND => beats += 1,
            _ => {}
        }
    }
    (loads, beats)
}

/// A replica alone publishes no per-request load (nobody would read it),
/// and starts to as soon as a peer starts, which then sees its requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_alone_shares_no_load_and_starts_once_a_peer_listens() {
    let nats = Nats::start();
    let wcfg = node_config("w", &nats.url, None, 2, "").replace("speedup = 0.0", "speedup = 1.0");
    let mut workers = Node::start(&wcfg);
    let p0 = free_port();
    let mut n0 = Node::start(&gateway_cfg("gw0", &nats.url, p0));
    let g0 = Http::new(p0);
    g0.wait_ready(2, &mut n0).await;
    let client = async_nats::connect(&nats.url).await.expect("nats");
    let mut sub = client
        .subscribe("dynamo.it.router.load")
        .await
        .expect("subscribe");

    let prompt: Vec<u32> = (100..164).collect();
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 8});
    for _ in 0..10 {
        assert_eq!(g0.post("/v1/completions", &body).await.status, 200);
    }
    let (loads, beats) = load_events(&mut sub, Duration::from_millis(2500)).await;
    assert!(
        beats >= 1,
        "the replica heartbeats ({beats}), so the subject is right"
    );
    assert_eq!(loads, 0, "a replica alone published load events");

    // A peer starts: it asks for a snapshot, so the first replica shares
    // its requests from then on: all three events of each.
    let p1 = free_port();
    let mut n1 = Node::start(&gateway_cfg("gw1", &nats.url, p1));
    Http::new(p1).wait_ready(2, &mut n1).await;
    for _ in 0..10 {
        assert_eq!(g0.post("/v1/completions", &body).await.status, 200);
    }
    let mut loads = 0;
    let t0 = Instant::now();
    while loads < 30 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{loads} load events for 10 requests with a peer"
        );
        loads += load_events(&mut sub, Duration::from_millis(200)).await.0;
    }
    let (more, _) = load_events(&mut sub, Duration::from_millis(300)).await;
    assert_eq!(loads + more, 30, "load events for 10 requests with a peer");
    assert!(workers.alive() && n0.alive() && n1.alive());
}
