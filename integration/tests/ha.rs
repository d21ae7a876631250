//! Gateway/router high availability and bus loss, with real processes:
//! - killing one of two gateway+router replicas under load costs the other
//!   nothing, and the restarted replica's index agrees with its peer's;
//! - stopping and restarting the nats-server under load: nothing panics or
//!   hangs, requests in the outage fail with a clear error, and service and
//!   the KV index come back;
//! - killing one of three clustered NATS servers under load fails no
//!   request: the node was given every server, its streams and buckets are
//!   R3, and routing still follows the cache.

use dynamo_integration::*;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn gateway_cfg(id: &str, nats: &str, port: u16) -> String {
    node_config(id, nats, Some(port), 0, "")
        .replace("policy = \"least_loaded\"", "policy = \"kv_aware\"")
}

fn prompt(i: usize) -> Vec<u32> {
    // Eight families of prompts sharing 48-token prefixes.
    let family = (i % 8) as u32;
    (0..64)
        .map(|k| {
            if k < 48 {
                2000 + family * 100 + k
            } else {
                9000 + i as u32 * 16 + k
            }
        })
        .collect()
}

/// A completion request; `None` when the gateway cannot be reached.
async fn try_post(http: &Http, body: &Value) -> Option<Reply> {
    let r = http
        .client
        .post(format!("{}/v1/completions", http.base))
        .json(body)
        .send()
        .await
        .ok()?;
    let status = r.status().as_u16();
    let json = r.json::<Value>().await.unwrap_or(Value::Null);
    Some(Reply {
        status,
        json,
        worker: None,
        retry_after: None,
    })
}

/// Closed-loop load on one gateway until `stop`; counts successes and
/// failures (with the first failure kept).
struct Load {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicUsize>,
    failed: Arc<AtomicUsize>,
    first_failure: Arc<std::sync::Mutex<Option<String>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(port: u16, clients: usize, timeout_ms: u64) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicUsize::new(0));
        let failed = Arc::new(AtomicUsize::new(0));
        let first_failure = Arc::new(std::sync::Mutex::new(None));
        let tasks = (0..clients)
            .map(|c| {
                let (stop, ok, failed, first) = (
                    stop.clone(),
                    ok.clone(),
                    failed.clone(),
                    first_failure.clone(),
                );
                tokio::spawn(async move {
                    let http = Http::new(port);
                    let mut i = c;
                    while !stop.load(Ordering::Relaxed) {
                        let body = json!({"model": MODEL, "prompt": prompt(i), "max_tokens": 8,
                                          "timeout_ms": timeout_ms});
                        let t0 = Instant::now();
                        let Some(r) = try_post(&http, &body).await else {
                            failed.fetch_add(1, Ordering::Relaxed);
                            first
                                .lock()
                                .unwrap()
                                .get_or_insert("connection failed".into());
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            i += clients;
                            continue;
                        };
                        // No request outlives its deadline (plus slack for the reply).
                        assert!(
                            t0.elapsed() < Duration::from_millis(timeout_ms + 2000),
                            "a request hung for {:?}",
                            t0.elapsed()
                        );
                        if r.status == 200 {
                            ok.fetch_add(1, Ordering::Relaxed);
                        } else {
                            // Every failure is an OpenAI error object.
                            assert!(r.json["error"]["message"].is_string(), "{}", r.json);
                            failed.fetch_add(1, Ordering::Relaxed);
                            first
                                .lock()
                                .unwrap()
                                .get_or_insert(format!("{} {}", r.status, r.json));
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                        i += clients;
                    }
                })
            })
            .collect();
        Load {
            stop,
            ok,
            failed,
            first_failure,
            tasks,
        }
    }

    async fn finish(self) -> (usize, usize, Option<String>) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.expect("load task");
        }
        let first = self.first_failure.lock().unwrap().clone();
        (
            self.ok.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
            first,
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_gateway_replica_costs_the_other_nothing() {
    let nats = Nats::start();
    let mut workers = Node::start(
        &node_config("w", &nats.url, None, 2, "").replace("speedup = 0.0", "speedup = 1.0"),
    );
    let (pa, pb) = (free_port(), free_port());
    let mut a = Node::start(&gateway_cfg("gw-a", &nats.url, pa));
    let mut b = Node::start(&gateway_cfg("gw-b", &nats.url, pb));
    let (ha, hb) = (Http::new(pa), Http::new(pb));
    ha.wait_ready(2, &mut a).await;
    hb.wait_ready(2, &mut b).await;

    let load_a = Load::start(pa, 4, 10_000);
    let load_b = Load::start(pb, 4, 10_000);
    tokio::time::sleep(Duration::from_millis(800)).await;
    a.signal(libc::SIGKILL);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (ok_b, failed_b, first) = load_b.finish().await;
    assert!(ok_b > 20, "too little load on the survivor ({ok_b})");
    assert_eq!(
        failed_b, 0,
        "the surviving replica failed requests: {first:?}"
    );
    // The killed replica's clients see connection errors, not hangs.
    let (_, failed_a, _) = load_a.finish().await;
    assert!(failed_a > 0, "requests to the killed replica should fail");
    assert!(workers.alive());

    // A prompt only one worker has seen.
    let q: Vec<u32> = (30_000..30_100).collect();
    let qb = json!({"model": MODEL, "prompt": q, "max_tokens": 2});
    let served = hb.post("/v1/completions", &qb).await;
    assert_eq!(served.status, 200, "{}", served.json);
    let holder = served.worker.clone().unwrap();
    let t0 = Instant::now();
    while hb.overlap(&q).await[&holder]["device"]
        .as_u64()
        .unwrap_or(0)
        < 6
    {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "index never learned the prompt"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Wait until the survivor's view holds no load (the killed replica's
    // requests expire with its heartbeats), so only the index can decide.
    let t0 = Instant::now();
    loop {
        let m = hb.metrics_text().await;
        let busy = m
            .lines()
            .filter(|l| l.starts_with("dynamo_router_worker_inflight{"))
            .any(|l| !l.ends_with(" 0"));
        if !busy {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "load never drained:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Restarted on the same port, it catches up with its peer before routing:
    // its very first request already follows the cache.
    let mut a = Node::start(&gateway_cfg("gw-a", &nats.url, pa));
    ha.wait_ready(2, &mut a).await;
    let first = ha.post("/v1/completions", &qb).await;
    assert_eq!(first.status, 200, "{}", first.json);
    assert_eq!(
        first.worker.as_deref(),
        Some(holder.as_str()),
        "routed before catching up"
    );
    assert_eq!(
        first.json["usage"]["prompt_tokens_details"]["cached_tokens"],
        96
    );
    assert!(
        a.log_text().contains("router caught up"),
        "{}",
        a.log_text()
    );
    for i in [0usize, 3, 5, 9, 14] {
        let p = prompt(i);
        let t0 = Instant::now();
        loop {
            let (x, y) = (ha.overlap(&p).await, hb.overlap(&p).await);
            if x == y && x.as_object().is_some_and(|o| !o.is_empty()) {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "replicas disagree on prompt {i}: {x} vs {y}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let r = ha
        .post(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": prompt(1), "max_tokens": 4}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.json);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_restart_under_load_recovers_without_hangs_or_panics() {
    let mut nats = Nats::start();
    let port = free_port();
    let cfg = node_config("n1", &nats.url, Some(port), 2, "")
        .replace("policy = \"least_loaded\"", "policy = \"kv_aware\"")
        .replace("speedup = 0.0", "speedup = 1.0");
    let mut node = Node::start(&cfg);
    let http = Http::new(port);
    http.wait_ready(2, &mut node).await;

    let load = Load::start(port, 4, 3_000);
    tokio::time::sleep(Duration::from_millis(800)).await;
    nats.stop();
    tokio::time::sleep(Duration::from_secs(2)).await;
    nats.restart();
    // Service comes back by itself.
    let t0 = Instant::now();
    loop {
        let r = http
            .post(
                "/v1/completions",
                &json!({"model": MODEL, "prompt": prompt(0), "max_tokens": 4}),
            )
            .await;
        if r.status == 200 {
            break;
        }
        assert!(r.json["error"]["message"].is_string(), "{}", r.json);
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "no successful request after the bus came back: {}",
            r.json
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Keep the load on past the router's worker TTL (3 s): registrations
    // must be refreshed on the new server, or every worker would expire.
    let ok_before = load.ok.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(4)).await;
    let failed_before = load.failed.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        load.failed.load(Ordering::Relaxed),
        failed_before,
        "requests still fail 4 s after the bus came back"
    );
    assert!(load.ok.load(Ordering::Relaxed) > ok_before + 10);
    let (ok, failed, first) = load.finish().await;
    eprintln!(
        "bus outage: {ok} ok, {failed} failed (first: {first:?}); back after {:?}",
        t0.elapsed()
    );
    assert!(
        ok > 10,
        "too little load ({ok} ok, {failed} failed: {first:?})"
    );
    assert!(node.alive(), "the node died:\n{}", node.log_text());
    let log = node.log_text();
    assert!(!log.contains("panicked"), "a panic:\n{log}");

    // The KV index converges: for every worker, the router indexes exactly
    // the blocks the worker says it holds, and a prompt served now is found
    // in the index.
    let p: Vec<u32> = (7000..7100).collect();
    let body = json!({"model": MODEL, "prompt": p, "max_tokens": 2});
    let first = http.post("/v1/completions", &body).await;
    assert_eq!(first.status, 200, "{}", first.json);
    let w = first.worker.clone().unwrap();
    let t0 = Instant::now();
    loop {
        let o = http.overlap(&p).await;
        let mut exact = o[&w]["device"].as_u64().unwrap_or(0) >= 6;
        for r in registrations(&nats.url).await {
            let id = r.worker_id.to_string();
            let key = format!("dynamo_router_kv_index_blocks{{worker=\"{id}\",tier=\"device\"}}");
            exact &= http.metric(&key).await as usize == worker_blocks(&nats.url, &id).await;
        }
        if exact {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the index did not converge: {o}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_one_of_three_nats_servers_fails_no_request() {
    kill_one_of_three(Victim::Busiest).await;
}

/// The worst case: the workers bucket cannot be written until its stream
/// elects a new leader (seconds, past the worker TTL). Workers stay fresh
/// in the router through their load reports over core NATS meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_workers_bucket_leader_fails_no_request() {
    kill_one_of_three(Victim::WorkersLeader).await;
}

enum Victim {
    /// The server holding the most client connections.
    Busiest,
    /// The leader of the workers bucket's stream.
    WorkersLeader,
}

async fn kill_one_of_three(which: Victim) {
    let mut cluster = NatsCluster::start(3).await;
    let urls = cluster.urls();
    let port = free_port();
    let cfg = node_config("n1", &urls, Some(port), 2, "")
        .replace("policy = \"least_loaded\"", "policy = \"kv_aware\"")
        .replace("speedup = 0.0", "speedup = 1.0");
    let mut node = Node::start(&cfg);
    let http = Http::new(port);
    http.wait_ready(2, &mut node).await;

    // Every stream (buckets included) is replicated on all three servers.
    let streams = stream_replicas(&cluster.url(0)).await.expect("stream list");
    assert!(streams.len() >= 3, "{streams:?}");
    assert!(streams.iter().all(|(_, r)| *r == 3), "{streams:?}");

    let load = Load::start(port, 16, 10_000);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let victim = match which {
        Victim::Busiest => cluster.busiest().await,
        Victim::WorkersLeader => cluster
            .leader_of("KV_dynamo_it_workers")
            .await
            .expect("the workers bucket has a leader"),
    };
    eprintln!(
        "killing server {victim}: {} client connections, workers bucket leader {:?}",
        cluster.connections(victim).await,
        cluster.leader_of("KV_dynamo_it_workers").await
    );
    cluster.kill(victim);
    // Past the router's worker TTL (3 s): registrations keep being written.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (ok, failed, first) = load.finish().await;
    eprintln!("one of three NATS servers killed: {ok} ok, {failed} failed (first: {first:?})");
    assert_eq!(
        failed, 0,
        "requests failed when one NATS server died: {first:?}"
    );
    assert!(ok > 20, "too little load ({ok} ok)");

    // Buckets intact: the registry still lists both workers, read through
    // the surviving servers, and every stream is still there.
    // (JetStream's API may answer only once a new meta leader is elected
    // if the killed server led it.)
    let survivor = cluster.url((victim + 1) % 3);
    let t0 = Instant::now();
    let regs = loop {
        let read = async {
            let c = async_nats::connect(survivor.as_str()).await.ok()?;
            let kv = async_nats::jetstream::new(c)
                .get_key_value("dynamo_it_workers")
                .await
                .ok()?;
            dynamo_controller::read_all::<dynamo_bus_schema::WorkerRegistration>(&kv)
                .await
                .ok()
        };
        if let Ok(Some(r)) = tokio::time::timeout(Duration::from_secs(5), read).await {
            break r;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the workers bucket stayed unreadable after one NATS server died"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    eprintln!("workers bucket readable again after {:?}", t0.elapsed());
    assert_eq!(regs.len(), 2);
    // Every stream of before is still there, as it was (one made since,
    // such as the weights bucket a node writes once it serves its model
    // file, may be there too). Just after the kill, a survivor's listing may
    // leave out a stream whose leader is being elected: read again until
    // the set is whole, within 30 s.
    let t0 = Instant::now();
    let whole = |after: &[(String, usize)]| streams.iter().all(|s| after.contains(s));
    let mut after = None;
    while t0.elapsed() < Duration::from_secs(30) {
        after = stream_replicas(&survivor).await;
        if after.as_deref().is_some_and(whole) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(
        after.as_deref().is_some_and(whole),
        "a stream was lost or changed: before {streams:?}, after {after:?}"
    );
    // Routing still follows the cache: a prompt served once is found in
    // the index on the worker that served it, and goes there again.
    let p: Vec<u32> = (7000..7100).collect();
    let body = json!({"model": MODEL, "prompt": p, "max_tokens": 2});
    let first = http.post("/v1/completions", &body).await;
    assert_eq!(first.status, 200, "{}", first.json);
    let w = first.worker.clone().expect("worker header");
    let t0 = Instant::now();
    while http.overlap(&p).await[&w]["device"].as_u64().unwrap_or(0) < 6 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the index never saw the prompt's blocks"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let again = http.post("/v1/completions", &body).await;
    assert_eq!(again.status, 200, "{}", again.json);
    assert_eq!(again.worker.as_deref(), Some(w.as_str()));
    assert!(node.alive(), "the node died:\n{}", node.log_text());
    assert!(!node.log_text().contains("panicked"));
}

/// (stream name, replicas) of every stream, read through server `url`
/// (None when JetStream does not answer within 5 s).
async fn stream_replicas(url: &str) -> Option<Vec<(String, usize)>> {
    use futures::TryStreamExt;
    let read = async {
        let js = async_nats::jetstream::new(async_nats::connect(url).await.ok()?);
        let names: Vec<String> = js.stream_names().try_collect().await.ok()?;
        let mut out = Vec::new();
        for n in names {
            let mut s = js.get_stream(&n).await.ok()?;
            let info = s.info().await.ok()?;
            out.push((n, info.config.num_replicas));
        }
        out.sort();
        Some(out)
    };
    tokio::time::timeout(Duration::from_secs(5), read)
        .await
        .ok()
        .flatten()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_seed_url_of_a_cluster_replicates_and_an_r1_stream_is_scaled_up() {
    let cluster = NatsCluster::start(3).await;
    let subjects =
        dynamo_bus_schema::Subjects::new(dynamo_bus_schema::Namespace::new("it").unwrap());
    // The KV events stream as a process that saw one server made it: R1.
    let js = async_nats::jetstream::new(async_nats::connect(cluster.url(0)).await.unwrap());
    js.create_stream(async_nats::jetstream::stream::Config {
        name: subjects.kv_events_stream(),
        subjects: vec![subjects.kv_events_all()],
        storage: async_nats::jetstream::stream::StorageType::Memory,
        num_replicas: 1,
        ..Default::default()
    })
    .await
    .unwrap();
    // A node given one seed URL learns the cluster from the server.
    let bus = dynamo_runtime::Bus::connect(
        &cluster.url(1),
        "seed",
        subjects.clone(),
        &Default::default(),
    )
    .await
    .unwrap();
    assert_eq!(bus.replicas, 3, "the cluster's advertised servers count");
    bus.ensure_kv_events_stream().await.unwrap();
    bus.kv_bucket("dynamo_it_probe", Duration::from_secs(60))
        .await
        .unwrap();
    let t0 = Instant::now();
    loop {
        let got = stream_replicas(&cluster.url(2)).await.unwrap_or_default();
        let of = |n: &str| got.iter().find(|(s, _)| s == n).map(|(_, r)| *r);
        if of(&subjects.kv_events_stream()) == Some(3) && of("KV_dynamo_it_probe") == Some(3) {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(15), "{got:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Lease expiry does not compare wall clocks across nodes: a dead holder
/// whose clock ran an hour ahead loses its lease after the TTL, and a live
/// holder whose clock runs an hour behind keeps it while it renews (the
/// controller's and every planner's lease).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_expiry_holds_whatever_the_holders_clock_says() {
    use dynamo_bus_schema::{encode, unix_ms, ControllerLease, NodeId};
    use dynamo_controller::lease::{claim, Observed};
    let nats = Nats::start();
    let bus = it_bus(&nats.url, "lease-test").await;
    let store = bus
        .kv_bucket("it_lease_test", Duration::from_secs(60))
        .await
        .expect("bucket");
    // Renewals every 100 ms against a 2 s TTL: a loaded machine's stalls
    // do not depose a live holder.
    let ttl = Duration::from_secs(2);
    let lease = |holder: &str, renewed_unix_ms: u64| -> Vec<u8> {
        encode(&ControllerLease {
            holder: NodeId(holder.into()),
            epoch: 1,
            renewed_unix_ms,
            ttl_ms: ttl.as_millis() as u64,
        })
        .expect("encode")
    };
    let hour = 3_600_000;

    // A holder an hour ahead, dead after its one write.
    store
        .put("ahead", lease("ahead", unix_ms() + hour).into())
        .await
        .expect("put");
    let me = NodeId("challenger".into());
    let mut seen = Observed::default();
    let t0 = Instant::now();
    let taken = loop {
        if let Some(epoch) = claim(&store, "ahead", &me, ttl, 0, false, &mut seen)
            .await
            .expect("claim")
        {
            break epoch;
        }
        assert!(
            t0.elapsed() < ttl * 4,
            "a dead holder with a clock ahead kept its lease"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(taken, 2);
    assert!(t0.elapsed() >= ttl, "not before the TTL");

    // A live holder an hour behind, renewing every 100 ms.
    let rev = store
        .put("behind", lease("behind", unix_ms() - hour).into())
        .await
        .expect("put");
    let renew = {
        let store = store.clone();
        async move {
            let mut rev = rev;
            for _ in 0..30 {
                tokio::time::sleep(Duration::from_millis(100)).await;
                rev = store
                    .update("behind", lease("behind", unix_ms() - hour).into(), rev)
                    .await
                    .expect("the challenger deposed a live holder (its renewal was refused)");
            }
        }
    };
    let challenge = async {
        let mut seen = Observed::default();
        for _ in 0..25 {
            let got = claim(&store, "behind", &me, ttl, 0, false, &mut seen)
                .await
                .expect("claim");
            assert_eq!(got, None, "a live holder with a clock behind was deposed");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::join!(renew, challenge);
}

/// A server list that names three servers where the cluster has two (an
/// alias of one, a stale config) asks for three replicas, which two servers
/// cannot hold: every stream and bucket is created with one replica
/// instead, and the bus works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_too_small_for_three_replicas_falls_back_to_one() {
    let cluster = NatsCluster::start(2).await;
    let list = format!("{},{}/", cluster.urls(), cluster.url(0));
    let subjects =
        dynamo_bus_schema::Subjects::new(dynamo_bus_schema::Namespace::new("it").unwrap());
    let bus = dynamo_runtime::Bus::connect(&list, "aliases", subjects.clone(), &Default::default())
        .await
        .unwrap();
    assert_eq!(bus.replicas, 3, "three URLs ask for three replicas");
    bus.ensure_kv_events_stream().await.unwrap();
    let kv = bus
        .kv_bucket("dynamo_it_probe", Duration::from_secs(60))
        .await
        .unwrap();
    kv.put("k", "v".into()).await.unwrap();
    let store = bus.object_store("dynamo_it_objects").await.unwrap();
    store.put("o", &mut &b"bytes"[..]).await.unwrap();
    let got = stream_replicas(&cluster.url(1))
        .await
        .expect("streams listed");
    for name in [
        subjects.kv_events_stream(),
        "KV_dynamo_it_probe".to_string(),
        "OBJ_dynamo_it_objects".to_string(),
    ] {
        assert_eq!(
            got.iter().find(|(s, _)| *s == name).map(|(_, r)| *r),
            Some(1),
            "{name}: {got:?}"
        );
    }
    // A second process with the same list finds them and works too.
    let again = dynamo_runtime::Bus::connect(&list, "aliases-2", subjects, &Default::default())
        .await
        .unwrap();
    again.ensure_kv_events_stream().await.unwrap();
    let kv = again
        .kv_bucket("dynamo_it_probe", Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(kv.get("k").await.unwrap().as_deref(), Some(&b"v"[..]));
}

/// The desired-state half of the planner's fence (the planner checks its
/// lease between `prepare_scale` and `commit`, and touches the record when
/// it takes over): a scale prepared before a successor's touch fails its
/// compare-and-set, and the touch changes nothing else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deposed_lease_holders_scale_is_fenced_off() {
    use dynamo_cluster_config::spec::DeploymentSpec;
    use dynamo_controller::desired;
    let nats = Nats::start();
    let bus = it_bus(&nats.url, "fence-test").await;
    let store = bus
        .kv_bucket_durable(&bus.subjects.deployments_bucket())
        .await
        .unwrap();
    let yaml = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../cluster-config/examples/mocker-disagg.yaml"
    ))
    .unwrap();
    let spec = DeploymentSpec::parse(&yaml).unwrap();
    let g0 = desired::write(&store, &spec, None).await.unwrap();
    let decode_replicas = async || {
        let (rec, _) = desired::record(&store, "mocker-disagg")
            .await
            .unwrap()
            .unwrap();
        let spec = DeploymentSpec::parse(&rec.spec_yaml).unwrap();
        (rec.generation, spec.target_replicas("decode"))
    };
    let ready = async || match desired::prepare_scale(&store, "mocker-disagg", "decode", 5)
        .await
        .unwrap()
    {
        desired::Scale::Ready(p) => p,
        desired::Scale::Unchanged(_) => panic!("decode has 2 replicas"),
    };
    // The old holder reads the record (and then passes its lease check);
    // its successor takes over and touches the record before the old
    // holder's write lands: that write fails.
    let stale = ready().await;
    assert!(desired::touch(&store, "mocker-disagg").await.unwrap());
    assert!(stale.commit(&store).await.is_err());
    assert_eq!(
        decode_replicas().await,
        (g0, Some(2)),
        "nothing written; the touch kept the generation"
    );
    // A write read after the touch (by the holder) lands.
    let g = ready().await.commit(&store).await.unwrap();
    assert_eq!((g, decode_replicas().await), (g0 + 1, (g0 + 1, Some(5))));
    assert!(matches!(
        desired::prepare_scale(&store, "mocker-disagg", "decode", 5)
            .await
            .unwrap(),
        desired::Scale::Unchanged(g1) if g1 == g0 + 1
    ));
    // There is nothing to touch for a deployment that does not exist.
    assert!(!desired::touch(&store, "nope").await.unwrap());
}
