//! Supervision, graceful shutdown and the admin CLI, with real processes.

use dynamo_bus_schema::{
    decode, encode, FaultAck, FaultInjection, FaultKind, WorkerId, WorkerRegistration,
};
use dynamo_integration::*;
use futures::StreamExt;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_worker_is_restarted_and_serves_again() {
    let nats = Nats::start();
    let port = free_port();
    let extra = "[supervision]\nrestart_base_ms = 50\nfault_injection = true\n";
    let mut node = Node::start(&node_config("n1", &nats.url, Some(port), 1, extra));
    let http = Http::new(port);
    http.wait_ready(1, &mut node).await;
    let body = json!({"model": MODEL, "prompt": [500, 501, 502], "max_tokens": 3});
    let before = http.post("/v1/completions", &body).await;
    assert_eq!(before.status, 200);
    let regs = registrations(&nats.url).await;
    assert_eq!(regs.len(), 1);
    let (worker, gen0) = (regs[0].worker_id, regs[0].generation);

    // Make the worker actor panic inside its message handler.
    let client = async_nats::connect(&nats.url).await.unwrap();
    let subject = "dynamo.it.node.n1.fault".to_string();
    let msg = FaultInjection {
        worker_id: worker,
        fault: FaultKind::PanicActor,
    };
    let reply = client
        .request(subject.clone(), encode(&msg).unwrap().into())
        .await
        .unwrap();
    let ack: FaultAck = decode(&reply.payload).unwrap();
    assert!(ack.applied, "{}", ack.message);

    // The supervisor restarts it: same id, newer generation, serving again.
    let t0 = Instant::now();
    loop {
        let regs = registrations(&nats.url).await;
        if regs
            .iter()
            .any(|r| r.worker_id == worker && r.generation > gen0)
        {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "worker not restarted:\n{}",
            node.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(node.alive(), "the node must survive an actor panic");
    let log = node.log_text();
    assert!(
        log.contains("fault injected into worker"),
        "panic not logged"
    );
    assert!(
        log.contains("actor exited; restarting"),
        "restart not logged:\n{log}"
    );
    let mut after = http.post("/v1/completions", &body).await;
    for _ in 0..40 {
        if after.status == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        after = http.post("/v1/completions", &body).await;
    }
    assert_eq!(after.status, 200, "{}", after.json);
    assert_eq!(
        after.json["choices"], before.json["choices"],
        "same deterministic output after restart"
    );

    // Fault injection for an unknown worker is refused, not fatal.
    let msg = FaultInjection {
        worker_id: WorkerId(1),
        fault: FaultKind::PanicActor,
    };
    let reply = client
        .request(subject, encode(&msg).unwrap().into())
        .await
        .unwrap();
    assert!(!decode::<FaultAck>(&reply.payload).unwrap().applied);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_injection_is_off_unless_configured() {
    let nats = Nats::start();
    let port = free_port();
    let mut node = Node::start(&node_config("n1", &nats.url, Some(port), 1, ""));
    Http::new(port).wait_ready(1, &mut node).await;
    let client = async_nats::connect(&nats.url).await.unwrap();
    let msg = FaultInjection {
        worker_id: WorkerId(1),
        fault: FaultKind::PanicActor,
    };
    let res = client
        .request("dynamo.it.node.n1.fault", encode(&msg).unwrap().into())
        .await;
    assert!(res.is_err(), "nobody should answer fault injection");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_in_flight_streams_then_exits() {
    let nats = Nats::start();
    let port = free_port();
    // Real-time mocker so the stream takes a while (~200 decode steps of ≥ 5.7 ms).
    let cfg =
        node_config("n1", &nats.url, Some(port), 1, "").replace("speedup = 0.0", "speedup = 1.0");
    let mut node = Node::start(&cfg);
    let http = Http::new(port);
    http.wait_ready(1, &mut node).await;
    let ids: Vec<u32> = (700..720).collect();
    let body = json!({"model": MODEL, "prompt": ids, "max_tokens": 200, "stream": true});
    let stream = tokio::spawn({
        let http = Http::new(port);
        async move { http.stream("/v1/completions", &body).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    node.signal(libc::SIGTERM);
    let (status, events) = stream.await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "stream was cut: {events:?}"
    );
    let text: String = events[..events.len() - 1]
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    assert_eq!(text, expected_text(&ids, 200).1);
    assert_eq!(
        node.wait(Duration::from_secs(20)),
        Some(0),
        "{}",
        node.log_text()
    );
    // New requests are refused once shutdown began (the port is closed now).
    assert!(http
        .client
        .get(format!("{}/health", http.base))
        .send()
        .await
        .is_err());
    // The worker deregistered.
    assert!(registrations(&nats.url).await.is_empty());
}

/// A stream longer than the gateway's shutdown grace ends with an error
/// event that says why (and is counted), not a cut connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_past_the_shutdown_grace_ends_with_an_error_event() {
    let nats = Nats::start();
    let port = free_port();
    let cfg = node_config("n1", &nats.url, Some(port), 1, "")
        .replace("speedup = 0.0", "speedup = 1.0")
        .replace("shutdown_grace_ms = 10000", "shutdown_grace_ms = 1000");
    let mut node = Node::start(&cfg);
    let http = Http::new(port);
    http.wait_ready(1, &mut node).await;
    // About 13 s of tokens at the mocker's pace.
    let body = json!({"model": MODEL, "prompt": [700, 701], "max_tokens": 2000, "ignore_eos": true, "stream": true});
    let mut stream = tokio::task::JoinSet::new();
    stream.spawn({
        let http = Http::new(port);
        async move { http.stream("/v1/completions", &body).await }
    });
    // Signalled once a worker runs it.
    let t0 = std::time::Instant::now();
    while !http
        .metrics_text()
        .await
        .lines()
        .any(|l| l.starts_with("dynamo_router_worker_inflight{") && l.ends_with(" 1"))
    {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the stream never started"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    node.signal(libc::SIGTERM);
    let (status, events) = stream.join_next().await.expect("the stream").unwrap();
    assert_eq!(status, 200);
    let last: Value = serde_json::from_str(events.last().expect("events")).expect("JSON");
    assert_eq!(last["error"]["code"], "no_workers_available", "{last}");
    assert!(
        last["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("shutting down")),
        "{last}"
    );
    assert_eq!(
        node.wait(Duration::from_secs(30)),
        Some(0),
        "{}",
        node.log_text()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_to_the_process_group_stops_a_node_with_embedded_nats_at_once() {
    let port = free_port();
    // As a terminal runs `make run`: the node leads a foreground group.
    let mut node = Node::start_in_own_group(&node_config("n1", "embedded", Some(port), 2, ""));
    let http = Http::new(port);
    http.wait_ready(2, &mut node).await;
    let url = std::fs::read_to_string(node.dir().join("it.nats-url")).expect("state file");
    let nats_port: u16 = url.trim().rsplit(':').next().unwrap().parse().unwrap();
    // Secure by default: TLS from a CA made at start and a user per role.
    // The CLI finds the CA and the admin seed beside the URL.
    assert!(url.starts_with("tls://"), "{url}");
    assert!(node.dir().join("it.nats-ca.pem").is_file());
    assert!(node.dir().join("it.nats-creds/admin.nk").is_file());
    // Made for the CLI: the node's own connections never see it.
    assert!(!node.log_text().contains("admin.nk"), "{}", node.log_text());
    let status = std::process::Command::new(bin("dynamoctl"))
        .args(["status", "--json", "--namespace", "it"])
        .env("DYNAMO_STATE_DIR", node.dir())
        .env_remove("DYNAMO_NATS_URL")
        .env_remove("DYNAMO_NATS_CA")
        .env_remove("DYNAMO_NATS_CREDENTIALS")
        .output()
        .unwrap();
    assert_success(&status);
    let v: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(v["workers"].as_array().map(Vec::len), Some(2), "{v}");
    // Nobody else gets in: no CA, no user.
    let anonymous = async_nats::ConnectOptions::new()
        .add_root_certificates(node.dir().join("it.nats-ca.pem"))
        .connect(url.trim())
        .await;
    assert!(anonymous.is_err(), "a client without a user connected");
    // Some load first (the replay that once left a node hanging), then idle.
    let load: Vec<_> = (0..200u32)
        .map(|i| {
            let http = Http::new(port);
            tokio::spawn(async move {
                let body = json!({"model": MODEL, "prompt": [100 + i, 7, 8], "max_tokens": 4});
                http.post("/v1/completions", &body).await.status
            })
        })
        .collect();
    for t in load {
        assert_eq!(t.await.unwrap(), 200);
    }
    let t0 = Instant::now();
    // SAFETY: signals the node's own process group.
    unsafe { libc::kill(-(node.pid() as i32), libc::SIGINT) };
    let code = node.wait(Duration::from_secs(20));
    let took = t0.elapsed();
    let log = node.log_text();
    assert_eq!(code, Some(0), "{log}");
    // Idle, nothing to drain and the bus up to the end: under 2 s.
    assert!(
        took < Duration::from_secs(2),
        "Ctrl-C took {took:?}:\n{log}"
    );
    assert!(log.contains("node stopped"), "{log}");
    // The bus was up until the end: nothing waited on it.
    for bad in [
        "heartbeat failed",
        "timed out",
        "cannot delete",
        "the bus is gone",
    ] {
        assert!(!log.contains(bad), "{bad:?} in:\n{log}");
    }
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", nats_port)).is_err(),
        "NATS left running"
    );
    assert!(!node.dir().join("it.nats-url").exists());
    assert!(!node.dir().join("it.nats-ca.pem").exists());
    assert!(!node.dir().join("it.nats-creds").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamoctl_status_and_bench() {
    let nats = Nats::start();
    let port = free_port();
    let mut node = Node::start(&node_config("n1", &nats.url, Some(port), 2, ""));
    let http = Http::new(port);
    http.wait_ready(2, &mut node).await;
    let out = std::process::Command::new(bin("dynamoctl"))
        .args(["status", "--json", "--namespace", "it", "--nats", &nats.url])
        .output()
        .unwrap();
    assert_success(&out);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["nodes"][0]["node_id"], "n1");
    assert_eq!(v["nodes"][0]["pid"], node.pid());
    assert_eq!(v["workers"].as_array().unwrap().len(), 2);
    for w in v["workers"].as_array().unwrap() {
        assert_eq!(w["state"], "serving");
        assert_eq!(w["model"], MODEL);
        assert_eq!(w["pid"], node.pid());
        assert!(w["load"]["kv_total_blocks"].as_u64().unwrap() > 0);
    }
    assert_eq!(v["models"][0]["workers"], 2);
    // The router's view of its index: per-worker indexed blocks and event lag.
    assert_eq!(v["router"]["policy"], "least_loaded");
    for w in v["workers"].as_array().unwrap() {
        assert!(w["index"]["device_blocks"].is_u64(), "{w}");
        assert!(w["index"]["event_lag_ms"].is_u64(), "{w}");
    }
    // Human output names the same things.
    let out = std::process::Command::new(bin("dynamoctl"))
        .args(["status", "--namespace", "it", "--nats", &nats.url])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("n1") && text.contains(MODEL), "{text}");
    assert!(
        text.contains("INDEXED") && text.contains("LAG MS"),
        "{text}"
    );
    // A bad URL is a clear error with a non-zero exit.
    let out = std::process::Command::new(bin("dynamoctl"))
        .args(["status", "--nats", "nats://127.0.0.1:1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("dynamoctl:"));

    for stream in [false, true] {
        let mut args = vec![
            "bench",
            "--url",
            &http.base,
            "--concurrency",
            "4",
            "--requests",
            "40",
            "--max-tokens",
            "8",
            "--prompt-tokens",
            "30",
            "--json",
        ];
        if stream {
            args.push("--stream");
        }
        let out = std::process::Command::new(bin("dynamoctl"))
            .args(&args)
            .output()
            .unwrap();
        assert_success(&out);
        let r: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(r["requests"], 40);
        assert_eq!(r["ok"], 40, "{r}");
        assert_eq!(r["errors"], 0);
        for k in [
            "req_per_s",
            "latency_p50_ms",
            "latency_p99_ms",
            "output_tokens_per_s",
        ] {
            assert!(r[k].as_f64().unwrap() > 0.0, "{k} in {r}");
        }
        assert_eq!(r["ttft_p50_ms"].is_number(), stream, "{r}");
        assert_eq!(r["itl_p50_ms"].is_number(), stream, "{r}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_disconnect_cancels_the_request_on_the_worker() {
    let nats = Nats::start();
    let port = free_port();
    let cfg =
        node_config("n1", &nats.url, Some(port), 1, "").replace("speedup = 0.0", "speedup = 1.0");
    let mut node = Node::start(&cfg);
    let http = Http::new(port);
    http.wait_ready(1, &mut node).await;
    let load = |regs: Vec<WorkerRegistration>| regs[0].load.clone();

    let body = json!({"model": MODEL, "prompt": (800..900).collect::<Vec<u32>>(), "max_tokens": 2000, "stream": true});
    let resp = http.open("/v1/completions", &body).await;
    let mut chunks = resp.bytes_stream();
    let first = chunks.next().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).starts_with("data: "));
    // The worker reports the request and its blocks while it runs…
    let t0 = Instant::now();
    loop {
        let l = load(registrations(&nats.url).await);
        if l.inflight_requests == 1 && l.kv_used_blocks > 0 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "request never showed up in the load: {l:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // …and drops both soon after the client goes away (long before 2,000 tokens).
    drop(chunks);
    let t0 = Instant::now();
    loop {
        let l = load(registrations(&nats.url).await);
        if l.inflight_requests == 0 && l.kv_used_blocks == 0 && l.active_seqs == 0 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "request not cancelled: {l:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let m = http.metrics_text().await;
    assert!(m.contains("dynamo_gateway_inflight_requests 0"), "{m}");
    assert_eq!(
        http.metric("dynamo_gateway_stream_endings_total{how=\"client_gone\"}")
            .await,
        1,
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamoctl_drain_stops_new_work_and_lets_in_flight_requests_finish() {
    let nats = Nats::start();
    let port = free_port();
    let cfg =
        node_config("n1", &nats.url, Some(port), 2, "").replace("speedup = 0.0", "speedup = 1.0");
    let mut node = Node::start(&cfg);
    let http = Http::new(port);
    http.wait_ready(2, &mut node).await;
    let url = nats.url.clone();
    let ctl = move |args: &[&str]| {
        let mut a = args.to_vec();
        a.extend(["--namespace", "it", "--nats", url.as_str()]);
        std::process::Command::new(bin("dynamoctl"))
            .args(&a)
            .output()
            .unwrap()
    };
    let regs = registrations(&nats.url).await;
    let (a, b) = (regs[0].worker_id.to_string(), regs[1].worker_id.to_string());

    // Long streams on both workers, then drain one of them while they run.
    let streams: Vec<_> = (0..6)
        .map(|i| {
            let body = json!({"model": MODEL, "prompt": [300 + i, 301, 302], "max_tokens": 400,
                              "stream": true, "ignore_eos": true});
            tokio::spawn(async move { Http::new(port).stream("/v1/completions", &body).await })
        })
        .collect();
    // Registrations refresh every heartbeat (500 ms here).
    let t0 = std::time::Instant::now();
    loop {
        let busy = registrations(&nats.url)
            .await
            .iter()
            .find(|r| r.worker_id.to_string() == a)
            .map(|r| r.load.inflight_requests)
            .unwrap_or(0);
        if busy > 0 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "the worker to drain never had work"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let out = tokio::task::spawn_blocking({
        let a = a.clone();
        let ctl = ctl.clone();
        move || ctl(&["drain", &a[..6], "--json"])
    })
    .await
    .unwrap();
    assert_success(&out);
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["drained"], true, "{report}");
    assert_eq!(report["state"], "draining");
    assert_eq!(report["worker_id"], a.as_str());
    for s in streams {
        let (status, events) = s.await.unwrap();
        assert_eq!(status, 200);
        assert_eq!(
            events.last().map(String::as_str),
            Some("[DONE]"),
            "{events:?}"
        );
    }
    // New work goes to the other worker only.
    for i in 0..6 {
        let r = http
            .post(
                "/v1/completions",
                &json!({"model": MODEL, "prompt": [400 + i], "max_tokens": 2}),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.json);
        assert_eq!(r.worker.as_deref(), Some(b.as_str()));
    }
    // Resume: the worker is serving again.
    let out = ctl(&["drain", &a, "--resume"]);
    assert_success(&out);
    let reg = registrations(&nats.url).await;
    let ra = reg.iter().find(|r| r.worker_id.to_string() == a).unwrap();
    assert_eq!(ra.state, dynamo_bus_schema::WorkerState::Serving);
    // An unknown worker is a clear error and a non-zero exit.
    let out = ctl(&["drain", "ffffffffffffffffff"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no registered worker"));
}

/// With `--config`, `--nats-ca` and `--nats-credentials` are not ignored:
/// they override the config's `[nats]` files and are checked at start, the
/// error naming the flag (here, files that do not exist); and an open
/// `--metrics-listen` needs a token or an allowance.
#[test]
fn nats_access_flags_apply_with_a_config_file() {
    let dir = tempfile::tempdir().expect("dir");
    let cfg = dir.path().join("node.toml");
    std::fs::write(&cfg, node_config("n1", "nats://127.0.0.1:1", None, 1, "")).expect("write");
    // `dynamo-node --config cfg ARGS` exits non-zero; its stderr.
    let refused = |args: &[&std::ffi::OsStr]| -> String {
        let out = std::process::Command::new(bin("dynamo-node"))
            .arg("--config")
            .arg(&cfg)
            .args(args)
            .output()
            .expect("dynamo-node runs");
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let missing = dir.path().join("no-such-ca.pem");
    let err = refused(&["--nats-ca".as_ref(), missing.as_os_str()]);
    assert!(err.contains("--nats-ca"), "{err}");
    let no_dir = dir.path().join("no-such-dir");
    let err = refused(&["--nats-credentials".as_ref(), no_dir.as_os_str()]);
    assert!(err.contains("--nats-credentials"), "{err}");
    // A metrics listener other hosts can reach, with no token and no
    // allowance, is refused at start, naming the flags.
    let err = refused(&["--metrics-listen".as_ref(), "0.0.0.0:0".as_ref()]);
    assert!(
        err.contains("--metrics-listen") && err.contains("--metrics-token-file"),
        "{err}"
    );
    // A config naming a CA this machine does not have: --nats-ca replaces
    // it before anything is read, so the start gets past the check.
    let pki = dynamo_runtime::tls::Pki::generate("it", &["127.0.0.1"])
        .expect("pki")
        .write(dir.path())
        .expect("pki files");
    let elsewhere = dir.path().join("elsewhere.toml");
    std::fs::write(
        &elsewhere,
        node_config("n1", "tls://127.0.0.1:1", None, 1, "").replace(
            "[nats]\n",
            "[nats]\nca_file = \"/on/another/machine/ca.pem\"\n",
        ),
    )
    .expect("write");
    let mut child = std::process::Command::new(bin("dynamo-node"))
        .arg("--config")
        .arg(&elsewhere)
        .arg("--nats-ca")
        .arg(&pki.ca)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("dynamo-node runs");
    std::thread::sleep(std::time::Duration::from_secs(2));
    let _ = child.kill();
    let out = child.wait_with_output().expect("output");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !err.contains("nats.ca_file") && !err.contains("another/machine"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_node_under_a_live_nodes_id_is_refused_and_the_first_is_untouched() {
    let nats = Nats::start();
    let port = free_port();
    let mut first = Node::start(&node_config("n1", &nats.url, Some(port), 1, ""));
    let http = Http::new(port);
    http.wait_ready(1, &mut first).await;
    let before = registrations(&nats.url).await;
    // The same id again (another node's workers would be n1's workers).
    let mut second = Node::start(&node_config("n1", &nats.url, None, 1, ""));
    assert_eq!(second.wait(Duration::from_secs(30)), Some(1), "refused");
    let log = second.log_text();
    assert!(log.contains("node id \"n1\" is taken"), "{log}");
    // The first node and its worker are as they were.
    assert!(first.alive());
    let after = registrations(&nats.url).await;
    assert_eq!(
        after
            .iter()
            .map(|r| (r.worker_id, r.generation))
            .collect::<Vec<_>>(),
        before
            .iter()
            .map(|r| (r.worker_id, r.generation))
            .collect::<Vec<_>>()
    );
    http.assert_serves().await;
    // Once it is gone (SIGTERM), its id is free again at once on this host.
    first.signal(libc::SIGTERM);
    assert_eq!(first.wait(Duration::from_secs(30)), Some(0));
    let mut third = Node::start(&node_config("n1", &nats.url, Some(port), 1, ""));
    http.wait_ready(1, &mut third).await;
}
