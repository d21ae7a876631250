//! A router replica that starts late catches up from the newest KV index
//! snapshot and the KV events stream, asking no worker for a dump; when the
//! stream no longer holds what followed the snapshot, it falls back to
//! dumps, and agrees either way.

use dynamo_integration::kv::{held, indexed, purge_kv_events};
use dynamo_integration::*;
use serde_json::json;
use std::time::{Duration, Instant};

const WORKERS: usize = 8;
/// Blocks each worker must hold before the late replicas start.
const MIN_BLOCKS: u64 = 100_000;

/// A gateway whose router indexes every worker (round-robin spreads the
/// prompts evenly); `snapshots` = whether it writes KV index snapshots.
fn gateway(id: &str, nats: &str, port: u16, snapshots: bool) -> String {
    node_config(id, nats, Some(port), 0, "")
        .replace("policy = \"least_loaded\"", "policy = \"round_robin\"")
        .replace(
            "worker_ttl_ms = 3000\n",
            &format!(
                "worker_ttl_ms = 3000\nkv_snapshots = {snapshots}\nkv_snapshot_interval_ms = 1000\n"
            ),
        )
}

/// 4096 blocks of 2 tokens, distinct per `i`.
fn prompt(i: usize) -> Vec<u32> {
    std::iter::once(100 + i as u32)
        .chain((1..8192u32).map(|k| 200 + (k * 13 + i as u32 * 7) % 40000))
        .collect()
}

async fn send(h: &Http, range: std::ops::Range<usize>) {
    let idx: Vec<usize> = range.collect();
    for chunk in idx.chunks(WORKERS) {
        let bodies: Vec<_> = chunk
            .iter()
            .map(|&i| json!({"model": MODEL, "prompt": prompt(i), "max_tokens": 1}))
            .collect();
        let replies =
            futures::future::join_all(bodies.iter().map(|b| h.post("/v1/completions", b))).await;
        for r in replies {
            assert_eq!(r.status, 200, "{}", r.json);
        }
    }
}

async fn wait_metric(h: &Http, name: &str, at_least: u64, node: &mut Node) -> u64 {
    let t0 = Instant::now();
    loop {
        let v = h.metric(name).await;
        if v >= at_least {
            return v;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{name} = {v}, waited for {at_least}:\n{}",
            node.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until `h` indexes exactly what every worker holds.
async fn agrees(h: &Http, nats: &str, workers: &[String], node: &mut Node) {
    for w in workers {
        let want = held(nats, w).await;
        let t0 = Instant::now();
        loop {
            let got = indexed(h, w).await;
            if got == want {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "worker {w}: indexed {got:?}, holds {want:?}\n{}",
                node.log_text()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_replica_catches_up_from_the_snapshot_and_the_stream_without_dumps() {
    let nats = Nats::start();
    // Tiny simulated blocks, most of them in a large host tier.
    let worker_cfg = node_config("w", &nats.url, None, WORKERS as u32, "")
        .replace("heartbeat_ms = 500\n", "heartbeat_ms = 500\ncontext_length = 16384\n")
        .replace(
            "speedup = 0.0\n",
            "speedup = 0.0\nblock_size = 2\nnum_blocks = 20000\nkv_bytes_per_block = 8\noffload_host_blocks = 200000\n",
        );
    let mut w = Node::start(&worker_cfg);
    let pa = free_port();
    let mut a = Node::start(&gateway("a", &nats.url, pa, true));
    let ha = Http::new(pa);
    ha.wait_ready(WORKERS as u64, &mut a).await;
    let workers: Vec<String> = registrations(&nats.url)
        .await
        .iter()
        .map(|r| r.worker_id.to_string())
        .collect();
    assert_eq!(workers.len(), WORKERS);

    // 26 prompts of 4096 blocks per worker: ≥ 100k blocks each.
    let fill = WORKERS * 26;
    send(&ha, 0..fill).await;
    assert!(w.alive());
    for wk in &workers {
        let b = held(&nats.url, wk).await;
        assert!(
            b.iter().sum::<u64>() >= MIN_BLOCKS,
            "worker {wk} holds {b:?}"
        );
    }
    agrees(&ha, &nats.url, &workers, &mut a).await;
    // A snapshot taken after the fill (the interval is 1 s), then the
    // writer goes away: nothing newer is written.
    // Snapshots are taken while events arrive: once none was taken for 3 s
    // the last one holds everything.
    let mut taken = wait_metric(&ha, "dynamo_router_kv_snapshots_taken_total", 1, &mut a).await;
    let mut since = Instant::now();
    while since.elapsed() < Duration::from_secs(3) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = ha.metric("dynamo_router_kv_snapshots_taken_total").await;
        if now != taken {
            (taken, since) = (now, Instant::now());
        }
    }
    drop(a);

    // Replica C (no snapshots of its own) starts from the snapshot; the
    // prompts sent through it are only in the stream.
    let pc = free_port();
    let mut c = Node::start(&gateway("c", &nats.url, pc, false));
    let hc = Http::new(pc);
    hc.wait_ready(WORKERS as u64, &mut c).await;
    send(&hc, fill..fill + 2 * WORKERS).await;
    agrees(&hc, &nats.url, &workers, &mut c).await;

    // Replica B: the snapshot plus the stream's tail, no dump.
    let pb = free_port();
    let mut b = Node::start(&gateway("b", &nats.url, pb, false));
    let hb = Http::new(pb);
    hb.wait_ready(WORKERS as u64, &mut b).await;
    agrees(&hb, &nats.url, &workers, &mut b).await;
    caught_up_whole(&mut b).await;
    let loaded = hb
        .metric("dynamo_router_kv_snapshot_blocks_loaded_total")
        .await;
    assert!(
        loaded >= WORKERS as u64 * MIN_BLOCKS / 2,
        "{loaded} blocks from the snapshot"
    );
    assert!(hb.metric("dynamo_router_kv_batches_replayed_total").await >= 1);
    for (h, who) in [(&hb, "b"), (&hc, "c")] {
        assert_eq!(
            h.metric("dynamo_router_kv_dumps_total").await,
            0,
            "replica {who} asked for a dump"
        );
        assert_eq!(h.metric("dynamo_router_kv_event_gaps_total").await, 0);
    }
    // The two replicas route from the same view.
    for i in [0, 77, fill + 3] {
        assert_eq!(hb.overlap(&prompt(i)).await, hc.overlap(&prompt(i)).await);
    }
    assert!(
        hb.overlap(&prompt(fill + 3))
            .await
            .as_object()
            .is_some_and(|o| !o.is_empty()),
        "a prompt only the stream holds is indexed"
    );

    // The stream loses what followed the snapshot: a replica that starts
    // now cannot fill the gap from it and dumps every worker instead.
    assert!(purge_kv_events(&nats.url).await > 0);
    let pd = free_port();
    let mut d = Node::start(&gateway("d", &nats.url, pd, false));
    let hd = Http::new(pd);
    hd.wait_ready(WORKERS as u64, &mut d).await;
    agrees(&hd, &nats.url, &workers, &mut d).await;
    caught_up_whole(&mut d).await;
    assert_eq!(
        hd.metric("dynamo_router_kv_stream_truncated_total").await,
        1
    );
    assert!(hd.metric("dynamo_router_kv_dumps_total").await >= WORKERS as u64);
    for i in [0, fill + 3] {
        assert_eq!(hd.overlap(&prompt(i)).await, hb.overlap(&prompt(i)).await);
    }
    assert!(b.alive() && c.alive() && d.alive() && w.alive());
}

/// The replica opened routing because its view was whole, not because
/// the catch-up cap ran out (a piece of the gate that never completes).
async fn caught_up_whole(node: &mut Node) {
    wait_log(node, Duration::from_secs(10), "the catch-up", |l| {
        l.contains("router caught up; routing")
    })
    .await;
    let log = node.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("router caught up; routing"))
        .unwrap_or_default();
    assert!(line.contains("complete=true"), "{line}");
}

const FAULTS: &str = "[supervision]\nfault_injection = true\n";

/// A node with two mocker workers and a gateway node of config `gateway`
/// (listening on `port`), four prompts served and indexed: the nodes, the
/// gateway's HTTP, and the workers' ids.
async fn two_workers_and(nats: &Nats, gateway: &str, port: u16) -> (Node, Node, Http, Vec<String>) {
    let w = Node::start(&node_config("w", &nats.url, None, 2, "").replace(
        "heartbeat_ms = 500\n",
        "heartbeat_ms = 500\ncontext_length = 16384\n",
    ));
    let mut g = Node::start(gateway);
    let h = Http::new(port);
    h.wait_ready(2, &mut g).await;
    let workers: Vec<String> = registrations(&nats.url)
        .await
        .iter()
        .map(|r| r.worker_id.to_string())
        .collect();
    send(&h, 0..4).await;
    agrees(&h, &nats.url, &workers, &mut g).await;
    (w, g, h, workers)
}

/// A live KV event batch lost on core NATS leaves a gap that the router
/// fills from the KV events stream: the index agrees with the workers again
/// and no worker is asked for a dump.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_gap_is_filled_from_the_stream_without_a_dump() {
    let nats = Nats::start();
    let port = free_port();
    let (mut w, mut g, h, workers) = two_workers_and(
        &nats,
        &node_config("g", &nats.url, Some(port), 0, FAULTS)
            .replace("policy = \"least_loaded\"", "policy = \"round_robin\""),
        port,
    )
    .await;
    let dumps = h.metric("dynamo_router_kv_dumps_total").await;
    let gaps = h.metric("dynamo_router_kv_event_gaps_total").await;

    let ack = inject(
        &nats.url,
        "g",
        &dynamo_bus_schema::ActorFault {
            actor: "router".into(),
            fault: dynamo_bus_schema::FaultKind::DropKvBatch,
            task: String::new(),
        },
    )
    .await;
    assert!(ack.applied, "{}", ack.message);
    // The first batch after the fault is lost; later ones reveal the gap.
    send(&h, 4..6).await;
    wait_log(&mut g, Duration::from_secs(10), "the dropped batch", |l| {
        l.contains("a live KV event batch dropped")
    })
    .await;
    send(&h, 6..10).await;
    agrees(&h, &nats.url, &workers, &mut g).await;
    assert!(h.metric("dynamo_router_kv_event_gaps_total").await > gaps);
    assert!(
        h.metric("dynamo_router_kv_gaps_filled_from_stream_total")
            .await
            >= 1,
        "{}",
        g.log_text()
    );
    assert_eq!(
        h.metric("dynamo_router_kv_gap_fill_failures_total").await,
        0
    );
    assert_eq!(
        h.metric("dynamo_router_kv_dumps_total").await,
        dumps,
        "a dump was asked for:\n{}",
        g.log_text()
    );
    // The router finds what the workers hold of a prompt served across
    // the gap.
    let o = h.overlap(&prompt(5)).await;
    assert!(o.as_object().is_some_and(|m| !m.is_empty()), "{o}");
    assert!(w.alive() && g.alive());
}

/// The indexer is an actor of its own under the router: one that panics,
/// or whose KV events feed ends, is replaced with a fresh index that
/// catches up from the snapshot and the stream (no dump), while the router
/// itself keeps running and routing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_indexer_is_replaced_and_catches_up_while_the_router_runs() {
    let nats = Nats::start();
    let port = free_port();
    let (mut w, mut g, h, workers) = two_workers_and(
        &nats,
        &format!("{}{FAULTS}", gateway("g", &nats.url, port, true)),
        port,
    )
    .await;
    // A snapshot of the filled index is in the store.
    let bus = it_bus(&nats.url, "test").await;
    let objects = bus
        .object_store(&bus.subjects.router_state_objects())
        .await
        .unwrap();
    let t0 = Instant::now();
    while !objects
        .info(dynamo_bus_schema::KV_SNAPSHOT_OBJECT)
        .await
        .is_ok_and(|i| !i.deleted)
    {
        assert!(t0.elapsed() < Duration::from_secs(30), "no snapshot stored");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let dumps = h.metric("dynamo_router_kv_dumps_total").await;
    // Requests go on throughout, each answered (`send` asserts it).
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let served = std::sync::Arc::new(AtomicU64::new(0));
    let mut background = tokio::task::JoinSet::new();
    {
        let (stop, served, hb) = (stop.clone(), served.clone(), Http::new(port));
        background.spawn(async move {
            let mut i = 100;
            while !stop.load(Ordering::Relaxed) {
                send(&hb, i..i + 2).await;
                served.fetch_add(2, Ordering::Relaxed);
                i += 2;
            }
        });
    }
    for (n, (fault, task)) in [
        (dynamo_bus_schema::FaultKind::PanicActor, ""),
        (dynamo_bus_schema::FaultKind::EndTask, "kv-events"),
    ]
    .into_iter()
    .enumerate()
    {
        let loaded = h
            .metric("dynamo_router_kv_snapshot_blocks_loaded_total")
            .await;
        let ack = inject(
            &nats.url,
            "g",
            &dynamo_bus_schema::ActorFault {
                actor: "indexer".into(),
                fault,
                task: task.into(),
            },
        )
        .await;
        assert!(ack.applied, "{}", ack.message);
        wait_metric(
            &h,
            "dynamo_router_indexer_restarts_total",
            n as u64 + 1,
            &mut g,
        )
        .await;
        // The new index started from the snapshot.
        wait_metric(
            &h,
            "dynamo_router_kv_snapshot_blocks_loaded_total",
            loaded + 1,
            &mut g,
        )
        .await;
        // And requests are served after the restart too.
        let before = served.load(Ordering::Relaxed);
        let t0 = Instant::now();
        while served.load(Ordering::Relaxed) < before + 4 {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "no request served after restart {}:\n{}",
                n + 1,
                g.log_text()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    stop.store(true, Ordering::Relaxed);
    background.join_next().await.unwrap().unwrap();
    // The last index holds what was served before, during and after the
    // restarts.
    send(&h, 10..14).await;
    agrees(&h, &nats.url, &workers, &mut g).await;
    let log = g.log_text();
    assert_eq!(
        log.matches("indexer exited; restarting it with a fresh index")
            .count(),
        2,
        "{log}"
    );
    assert!(
        !log.contains("actor exited; restarting"),
        "the router itself restarted:\n{log}"
    );
    assert_eq!(
        h.metric("dynamo_router_kv_dumps_total").await,
        dumps,
        "a dump was asked for:\n{log}"
    );
    let o = h.overlap(&prompt(11)).await;
    assert!(o.as_object().is_some_and(|m| !m.is_empty()), "{o}");
    assert!(w.alive() && g.alive());
}

/// A replica with snapshots turned off does not stop its peers from writing
/// them, even when it has the lowest id (the elected writer): once the
/// store's newest snapshot is stale (missing, then older than three
/// intervals plus one per lower peer), a replica that writes them writes one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_with_snapshots_off_does_not_stop_its_peers_writing_them() {
    let nats = Nats::start();
    let mut w = Node::start(&node_config("w", &nats.url, None, 2, "").replace(
        "heartbeat_ms = 500\n",
        "heartbeat_ms = 500\ncontext_length = 16384\n",
    ));
    let pa = free_port();
    let mut a = Node::start(&gateway("a", &nats.url, pa, false));
    let ha = Http::new(pa);
    ha.wait_ready(2, &mut a).await;
    let ida = *router_ids(&nats.url, 1).await.first().expect("a's id");
    // b must have the higher id, so that a is the elected writer.
    let (mut b, hb) = loop {
        let pb = free_port();
        let mut b = Node::start(&gateway("b", &nats.url, pb, true));
        let hb = Http::new(pb);
        hb.wait_ready(2, &mut b).await;
        let ids = router_ids(&nats.url, 2).await;
        if ids.iter().any(|id| id.0 > ida.0) {
            break (b, hb);
        }
        drop(b);
    };
    // Events keep arriving long enough for b to find the store empty for
    // four intervals (1 s each), write, and find its own snapshot stale.
    let t0 = Instant::now();
    let mut i = 0;
    while t0.elapsed() < Duration::from_secs(12) {
        send(&ha, i..i + 2).await;
        i += 2;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let taken = wait_metric(&hb, "dynamo_router_kv_snapshots_taken_total", 2, &mut b).await;
    assert!(taken >= 2, "{taken}");
    assert_eq!(
        ha.metric("dynamo_router_kv_snapshots_taken_total").await,
        0,
        "snapshots are off on replica a"
    );
    assert!(a.alive() && b.alive() && w.alive());
}

/// The ids of the live router replicas (asked until `n` distinct answered;
/// any one replica answers each request).
async fn router_ids(nats_url: &str, n: usize) -> Vec<dynamo_bus_schema::RouterId> {
    let bus = it_bus(nats_url, "test").await;
    let mut ids = std::collections::BTreeSet::new();
    for _ in 0..200 {
        let info: dynamo_bus_schema::RouterInfo = bus
            .request(
                bus.subjects.router_info(),
                &dynamo_bus_schema::RouterInfoRequest {},
                Duration::from_secs(5),
            )
            .await
            .expect("a router answers");
        ids.insert(info.router_id.0);
        if ids.len() >= n {
            break;
        }
    }
    assert!(ids.len() >= n, "{ids:?}");
    ids.into_iter().map(dynamo_bus_schema::RouterId).collect()
}
