//! The planner end to end, with real node daemons, mocker workers and one
//! real NATS: a load step scales prefill for TTFT and decode for ITL, and a
//! step down drains and shrinks with no failed request; the slot budget
//! holds and says so; an idle service goes to zero and the first request
//! after it succeeds; a manual scale pins; a killed planner is replaced
//! without a double decision; a planner for Kubernetes that cannot read the
//! replicas back decides nothing and says why.
//!
//! The mocker runs slower than Dynamo's defaults (long prefills, a small
//! KV cache) so that a few requests a second break the SLA on 2 cores.

use dynamo_integration::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// One cluster at a time in this binary (each is several processes).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// n1 and n2 run the controller and planners (no slots); n3 runs the
/// frontend and the workers.
fn cluster() -> JoinedCluster {
    JoinedCluster::start(&[
        JoinSpec::new("n1", "zone=z1,rack=r1,host=h1,edge=no", 0, "controller"),
        JoinSpec::new("n2", "zone=z1,rack=r1,host=h2,edge=no", 0, "controller"),
        JoinSpec::new("n3", "zone=z1,rack=r1,host=h3,edge=yes", 8, ""),
    ])
}

/// A 1,000-token prompt prefills in 220 ms; a decode step takes 10 + 40·u
/// ms at KV utilisation u, with room for about 4 such sequences.
fn mocker(startup_ms: u64) -> String {
    format!(
        "{{engine: mocker, model: {MODEL}, heartbeat_ms: 500, mocker: {{prefill_ms: [0.0, 0.2, 20.0], decode_ms: [0.0, 40.0, 10.0], num_blocks: 256, startup_ms: {startup_ms}}}}}"
    )
}

const FRONTEND: &str = "  frontend:
    role: frontend
    node_selector: {edge: \"yes\"}
    gateway: {liveness_timeout_ms: 1500, max_queue_wait_ms: 30000, shutdown_grace_ms: 10000}
    router: {worker_ttl_ms: 3000, min_remote_prefill_tokens: 1}
";

fn target<'a>(status: &'a Value, name: &str) -> &'a Value {
    static NULL: Value = Value::Null;
    status["targets"]
        .as_array()
        .and_then(|a| a.iter().find(|t| t["name"] == name))
        .unwrap_or(&NULL)
}

/// Waits until the planner's status satisfies `cond`; its last status.
async fn wait_planner(
    c: &JoinedCluster,
    dep: &str,
    within: Duration,
    what: &str,
    cond: impl Fn(&Value) -> bool,
) -> Value {
    let t0 = Instant::now();
    loop {
        let s = planner_status(&c.nats.url, dep);
        if cond(&s) {
            return s;
        }
        assert!(
            t0.elapsed() < within,
            "{what}: not within {within:?}:\n{}",
            serde_json::to_string_pretty(&s).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Applies `spec` (deployment `plan`), waits until it is ready; the
/// frontend's port.
async fn deploy(c: &JoinedCluster, spec: &str) -> u16 {
    let file = c.write("plan.yaml", spec);
    assert_success(&c.ctl(&["apply", "-f", &file]));
    let d = wait_deployment(&c.nats.url, "plan", Duration::from_secs(60), "ready", |d| {
        d["ready"] == true
    })
    .await;
    c.port_of(&d, "frontend")
}

fn desired(s: &Value, name: &str) -> u64 {
    target(s, name)["desired"].as_u64().unwrap_or(0)
}

fn decisions(s: &Value) -> Vec<Value> {
    s["decisions"].as_array().cloned().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_up_scales_prefill_for_ttft_and_decode_for_itl_and_a_step_down_shrinks_with_no_failure(
) {
    let _one = SERIAL.lock().await;
    let c = cluster();
    let spec = format!(
        "version: 1\nname: plan\nservices:\n{FRONTEND}  prefill:\n    role: prefill\n    worker: {w}\n  decode:\n    role: decode\n    worker: {w}\nplanner:\n  ttft_ms: 500\n  itl_ms: 30\n  interval_ms: 2000\n  fast_interval_ms: 500\n  scale_down_after_ms: 6000\n  cold_start_ms: 1000\n  services: {{prefill: {{min: 1, max: 3}}, decode: {{min: 1, max: 3}}}}\n",
        w = mocker(0)
    );
    let port = deploy(&c, &spec).await;
    // Light load: nothing to do.
    let load = Load::start(port, 1.0, 1000, 20);
    tokio::time::sleep(Duration::from_secs(6)).await;
    let s = planner_status(&c.nats.url, "plan");
    assert_eq!(
        (desired(&s, "prefill"), desired(&s, "decode")),
        (1, 1),
        "{s}"
    );
    // A step up: each phase grows, for its own SLA.
    load.set_rate(6.0);
    let s = wait_planner(
        &c,
        "plan",
        Duration::from_secs(60),
        "both phases grown",
        |s| desired(s, "prefill") >= 2 && desired(s, "decode") >= 2,
    )
    .await;
    let ups: Vec<Value> = decisions(&s)
        .into_iter()
        .filter(|d| d["to"].as_u64() > d["from"].as_u64())
        .collect();
    for t in ["prefill", "decode"] {
        assert!(
            ups.iter().any(|d| d["target"] == t && d["applied"] == true),
            "no applied scale-up of {t}: {ups:?}"
        );
    }
    assert!(
        ups.iter().any(
            |d| d["target"] == "prefill" && d["reason"].as_str().unwrap_or("").contains("TTFT")
        ),
        "{ups:?}"
    );
    // The controller places what the planner asked for.
    wait_deployment(
        &c.nats.url,
        "plan",
        Duration::from_secs(60),
        "grown and ready",
        |d| {
            service(d, "prefill")["ready"].as_u64() >= Some(2)
                && service(d, "decode")["ready"].as_u64() >= Some(2)
        },
    )
    .await;
    // The grown fleet carries the load, and holds while it lasts.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let s = planner_status(&c.nats.url, "plan");
    assert!(
        desired(&s, "prefill") >= 2 && desired(&s, "decode") >= 2,
        "{s}"
    );
    // Every metric the Grafana dashboard names is exported, by the
    // gateway or some node's own listener, with the type its query needs.
    let mut texts = vec![dashboard::scrape(port).await];
    for p in c.metrics_ports.values() {
        texts.push(dashboard::scrape(*p).await);
    }
    let missing = dashboard::missing(&dashboard::dashboard(), &texts);
    assert!(
        missing.is_empty(),
        "the dashboard names metrics nothing exports: {missing:?}"
    );
    // A step down: after the shrink delay both go back to one, by drain.
    load.set_rate(0.3);
    let s = wait_planner(
        &c,
        "plan",
        Duration::from_secs(90),
        "both phases shrunk",
        |s| desired(s, "prefill") == 1 && desired(s, "decode") == 1,
    )
    .await;
    wait_deployment(
        &c.nats.url,
        "plan",
        Duration::from_secs(60),
        "shrunk",
        |d| service(d, "prefill")["placed"] == 1 && service(d, "decode")["placed"] == 1,
    )
    .await;
    let (ok, failed) = load.finish().await;
    assert!(
        failed.is_empty(),
        "{} of {} requests failed: {:?}",
        failed.len(),
        ok + failed.len() as u64,
        &failed[..failed.len().min(5)]
    );
    assert!(ok > 40, "only {ok} requests");
    // Every target went up, then down, never back and forth.
    for t in ["prefill", "decode"] {
        let dirs: Vec<bool> = decisions(&s)
            .iter()
            .filter(|d| d["target"] == t)
            .map(|d| d["to"].as_u64() > d["from"].as_u64())
            .collect();
        let flips = dirs.windows(2).filter(|w| w[0] != w[1]).count();
        assert_eq!(flips, 1, "{t}: {dirs:?} in {:?}", decisions(&s));
    }
    let shrink = decisions(&s)
        .into_iter()
        .rev()
        .find(|d| d["rule"] == "shrink")
        .expect("a shrink decision");
    assert!(
        shrink["reason"]
            .as_str()
            .unwrap_or("")
            .contains("for the last"),
        "{shrink}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slot_budget_holds_when_demand_exceeds_it_and_the_planner_says_so() {
    let _one = SERIAL.lock().await;
    let c = cluster();
    let spec = format!(
        "version: 1\nname: plan\nservices:\n{FRONTEND}  agg:\n    role: aggregated\n    resources: {{slots: 1}}\n    worker: {w}\nplanner:\n  ttft_ms: 500\n  itl_ms: 30\n  interval_ms: 1000\n  fast_interval_ms: 500\n  slot_budget: 2\n  services: {{agg: {{min: 1, max: 4}}}}\n",
        w = mocker(0)
    );
    let port = deploy(&c, &spec).await;
    let load = Load::start(port, 8.0, 1000, 20);
    let t0 = Instant::now();
    let mut said = None;
    while t0.elapsed() < Duration::from_secs(40) {
        let s = planner_status(&c.nats.url, "plan");
        let d = describe_deployment(&c.nats.url, "plan");
        assert!(desired(&s, "agg") <= 2, "over the budget: {s}");
        assert!(
            service(&d, "agg")["desired"].as_u64() <= Some(2),
            "over the budget: {d}"
        );
        if desired(&s, "agg") == 2
            && target(&s, "agg")["reason"]
                .as_str()
                .is_some_and(|r| r.contains("slot budget 2"))
        {
            said = Some(s);
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let s = said.expect("the planner reached the budget and said so");
    assert!(
        target(&s, "agg")["reason"]
            .as_str()
            .unwrap_or("")
            .contains("demand asks for"),
        "{s}"
    );
    let (_, failed) = load.finish().await;
    assert!(failed.is_empty(), "{:?}", &failed[..failed.len().min(5)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_service_goes_to_zero_the_next_request_succeeds_and_a_manual_scale_pins() {
    let _one = SERIAL.lock().await;
    let c = cluster();
    let spec = format!(
        "version: 1\nname: plan\nservices:\n{FRONTEND}  agg:\n    role: aggregated\n    worker: {w}\nplanner:\n  interval_ms: 1000\n  fast_interval_ms: 500\n  scale_down_after_ms: 2000\n  idle_to_zero_ms: 3000\n  services: {{agg: {{min: 0, max: 2}}}}\n",
        w = mocker(1500)
    );
    let port = deploy(&c, &spec).await;
    let http = Http::new(port);
    let ask = |n: u32| json!({"model": MODEL, "prompt": (n..n + 40).collect::<Vec<u32>>(), "max_tokens": 4});
    // Wait until the worker is serving, then use it once.
    let t0 = Instant::now();
    loop {
        let r = http.post("/v1/completions", &ask(1000)).await;
        if r.status == 200 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "never served: {}",
            r.json
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Idle: to zero, and its worker drains away.
    let s = wait_planner(&c, "plan", Duration::from_secs(30), "scaled to zero", |s| {
        desired(s, "agg") == 0
    })
    .await;
    assert!(
        decisions(&s)
            .iter()
            .any(|d| d["rule"] == "idle" && d["to"] == 0),
        "{s}"
    );
    let t0 = Instant::now();
    while !registrations(&c.nats.url).await.is_empty() {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "workers still registered at zero"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The first request after it: held while a worker wakes (its 1.5 s
    // cold start included), then served.
    let t0 = Instant::now();
    let r = http.post("/v1/completions", &ask(2000)).await;
    assert_eq!(r.status, 200, "{}", r.json);
    let took = t0.elapsed();
    let s = planner_status(&c.nats.url, "plan");
    assert!(
        took >= Duration::from_millis(1500),
        "served {took:?} after, before any worker could load: {s}\n{}",
        c.nodes["n3"].log_text()
    );
    assert!(decisions(&s).iter().any(|d| d["rule"] == "wake"), "{s}");
    // A manual scale pins: the planner leaves it through idle periods…
    let out = c.ctl(&["scale", "plan/agg", "2", "--json"]);
    assert_success(&out);
    assert!(String::from_utf8_lossy(&out.stdout).contains("\"pinned\":true"));
    tokio::time::sleep(Duration::from_secs(8)).await;
    let s = planner_status(&c.nats.url, "plan");
    assert_eq!(desired(&s, "agg"), 2, "{s}");
    assert_eq!(target(&s, "agg")["pinned"], true, "{s}");
    assert_eq!(
        service(&describe_deployment(&c.nats.url, "plan"), "agg")["desired"],
        2
    );
    // …until released.
    assert_success(&c.ctl(&["planner", "release", "plan/agg"]));
    wait_planner(
        &c,
        "plan",
        Duration::from_secs(30),
        "back to zero after release",
        |s| desired(s, "agg") == 0 && target(s, "agg")["pinned"] == false,
    )
    .await;
    let out = c.ctl(&["planner", "release", "plan/agg"]);
    assert!(
        !out.status.success(),
        "releasing an unpinned service is an error"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("not pinned"));
    // An apply says the replicas anew, and a pin follows it (the spec has
    // one replica of agg)…
    assert_success(&c.ctl(&["scale", "plan/agg", "2"]));
    let file = c.write("plan.yaml", &spec);
    assert_success(&c.ctl(&["apply", "-f", &file]));
    let pins = planner_status(&c.nats.url, "plan")["pins"].clone();
    assert_eq!(pins.as_array().map(Vec::len), Some(1), "one pin: {pins}");
    assert_eq!(pins[0]["target"], "agg", "{pins}");
    assert_eq!(pins[0]["replicas"], 1, "{pins}");
    // …and a delete takes the pins and the planner's memory with it: the
    // deployment applied again under its name starts afresh.
    assert_success(&c.ctl(&["delete", "deployment", "plan"]));
    let keys = |bucket: &str| -> Vec<Value> {
        let out = c.ctl(&["buckets", "get", bucket, "--json"]);
        assert_success(&out);
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        v["keys"].as_array().cloned().unwrap_or_default()
    };
    assert_eq!(keys("pins"), Vec::<Value>::new());
    // The planner's status goes too (its planner removes it if a last tick
    // wrote it again).
    let t0 = Instant::now();
    while keys("planner").contains(&json!("status.plan")) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the planner's status stays"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A model this frontend has never seen served (its one service starts at
/// zero, beside another model that is up): the first request for it is
/// held while the planner wakes a worker, not answered 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_request_for_a_model_never_served_yet_is_held_until_a_worker_wakes() {
    let _one = SERIAL.lock().await;
    let c = cluster();
    let zero = mocker(1000).replace(&format!("model: {MODEL}"), "model: zero-m");
    let spec = format!(
        "version: 1\nname: plan\nservices:\n{FRONTEND}  agg:\n    role: aggregated\n    worker: {w}\n  zero:\n    role: aggregated\n    replicas: 0\n    worker: {zero}\nplanner:\n  interval_ms: 1000\n  fast_interval_ms: 500\n  idle_to_zero_ms: 60000\n  services: {{zero: {{min: 0, max: 1}}}}\n",
        w = mocker(0)
    );
    let port = deploy(&c, &spec).await;
    let http = Http::new(port);
    let r = http
        .post(
            "/v1/completions",
            &json!({"model": "zero-m", "prompt": [300, 301, 302], "max_tokens": 3}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.json);
    assert_eq!(r.json["usage"]["completion_tokens"], 3, "{}", r.json);
    let s = planner_status(&c.nats.url, "plan");
    assert!(decisions(&s).iter().any(|d| d["rule"] == "wake"), "{s}");
    // A model no service of the deployment names is still not found.
    let r = http
        .post(
            "/v1/completions",
            &json!({"model": "nosuch", "prompt": [300], "max_tokens": 1}),
        )
        .await;
    assert_eq!(r.status, 404, "{}", r.json);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_planner_is_replaced_with_its_memory_and_no_decision_is_made_twice() {
    let _one = SERIAL.lock().await;
    let mut c = cluster();
    let spec = format!(
        "version: 1\nname: plan\nservices:\n{FRONTEND}  agg:\n    role: aggregated\n    worker: {w}\nplanner:\n  ttft_ms: 500\n  itl_ms: 30\n  interval_ms: 1000\n  fast_interval_ms: 500\n  scale_down_after_ms: 60000\n  services: {{agg: {{min: 1, max: 3}}}}\n",
        w = mocker(0)
    );
    let port = deploy(&c, &spec).await;
    let load = Load::start(port, 3.0, 1000, 20);
    let s = wait_planner(&c, "plan", Duration::from_secs(60), "a scale-up", |s| {
        desired(s, "agg") >= 2
    })
    .await;
    let holder = s["planner"].as_str().unwrap().to_string();
    let epoch = s["epoch"].as_u64().unwrap();
    let before = decisions(&s);
    assert!(!before.is_empty());
    let mut node = c.nodes.remove(&holder).expect("the planner's node");
    node.signal(libc::SIGKILL);
    node.wait(Duration::from_secs(5));
    let s = wait_planner(
        &c,
        "plan",
        Duration::from_secs(30),
        "another planner",
        |s| {
            s["planner"].as_str().is_some_and(|h| h != holder)
                && s["updated_ms_ago"].as_u64() < Some(2000)
        },
    )
    .await;
    assert!(s["epoch"].as_u64().unwrap() > epoch, "{s}");
    // Same load, shortly after: the successor continues (the history is
    // kept, no shrink delay restarts, nothing decided again).
    tokio::time::sleep(Duration::from_secs(6)).await;
    let s = planner_status(&c.nats.url, "plan");
    let after = decisions(&s);
    for d in &before {
        assert!(
            after.contains(d) || after.len() >= 32,
            "history lost: {d} not in {after:?}"
        );
    }
    let seqs: Vec<u64> = after.iter().filter_map(|d| d["seq"].as_u64()).collect();
    assert!(
        seqs.windows(2).all(|w| w[0] < w[1]),
        "sequence numbers repeat: {seqs:?}"
    );
    let moves: Vec<(u64, u64)> = after
        .iter()
        .map(|d| {
            (
                d["from"].as_u64().unwrap_or(0),
                d["to"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    for (i, m) in moves.iter().enumerate() {
        assert!(
            !moves[..i].contains(m),
            "decision {m:?} made twice: {after:?}"
        );
    }
    let (_, failed) = load.finish().await;
    assert!(failed.is_empty(), "{:?}", &failed[..failed.len().min(5)]);
}

/// A planner told the deployment runs on Kubernetes
/// (`--planner-k8s-namespace`) reads each target back from the API server
/// every tick. This build has no Kubernetes client (no API server runs
/// here), so every read fails: under load that would scale, it decides
/// nothing, leaves the desired state alone and says why in its status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_kubernetes_a_planner_that_cannot_read_back_decides_nothing_and_says_why() {
    let _one = SERIAL.lock().await;
    let c = JoinedCluster::start(&[
        JoinSpec::new("n1", "zone=z1,rack=r1,host=h1,edge=no", 0, "controller")
            .with_args(&["--planner-k8s-namespace", "serving"]),
        JoinSpec::new("n3", "zone=z1,rack=r1,host=h3,edge=yes", 8, ""),
    ]);
    let spec = format!(
        "version: 1\nname: plan\nservices:\n{FRONTEND}  agg:\n    role: aggregated\n    resources: {{slots: 1}}\n    worker: {w}\nplanner:\n  ttft_ms: 500\n  itl_ms: 30\n  interval_ms: 1000\n  fast_interval_ms: 500\n  services: {{agg: {{min: 1, max: 4}}}}\n",
        w = mocker(0)
    );
    let port = deploy(&c, &spec).await;
    let load = Load::start(port, 8.0, 1000, 20);
    let s = wait_planner(&c, "plan", Duration::from_secs(30), "the reason", |s| {
        target(s, "agg")["reason"].as_str().is_some_and(|r| {
            r.contains("not decided") && r.contains("Kubernetes namespace serving")
        })
    })
    .await;
    let reason = target(&s, "agg")["reason"].as_str().unwrap_or("");
    assert!(reason.contains("k8s-client"), "{reason}");
    // Under the load that scales `agg` elsewhere in this file, for a while.
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(8) {
        let s = planner_status(&c.nats.url, "plan");
        assert!(decisions(&s).is_empty(), "a decision without a read: {s}");
        let d = describe_deployment(&c.nats.url, "plan");
        assert_eq!(service(&d, "agg")["desired"], 1, "{d}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let (ok, failed) = load.finish().await;
    assert!(ok > 0 && failed.is_empty(), "{ok} ok, {failed:?}");
}
