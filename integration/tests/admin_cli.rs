//! `dynamoctl streams|buckets|consumers|events` against a running cluster
//! (a real nats-server with JetStream, a gateway and a mocker worker): each
//! command answers, in a table and with `--json`, and decodes our types.

use dynamo_integration::*;
use serde_json::{json, Value};

/// `dynamoctl ARGS --json`, which must succeed: its stdout.
fn json_out(nats: &str, args: &[&str]) -> String {
    let mut a = args.to_vec();
    a.push("--json");
    let out = dynamoctl(nats, &a);
    assert_success(&out);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn ok_json(nats: &str, args: &[&str]) -> Value {
    let text = json_out(nats, args);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {text}"))
}

/// One JSON object per line (the following commands).
fn lines(nats: &str, args: &[&str]) -> Vec<Value> {
    json_out(nats, args)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

/// `dynamoctl index query` against the gateway at `base`, which must succeed.
fn index_query(base: &str, args: &[&str]) -> std::process::Output {
    let out = std::process::Command::new(bin("dynamoctl"))
        .args(["index", "query", "--url", base, "--model", MODEL])
        .args(args)
        .output()
        .unwrap();
    assert_success(&out);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_commands_show_and_decode_the_jetstream_state() {
    let nats = Nats::start();
    let port = free_port();
    let cfg = node_config("n", &nats.url, Some(port), 1, "")
        .replace("policy = \"least_loaded\"", "policy = \"kv_aware\"");
    let mut node = Node::start(&cfg);
    let h = Http::new(port);
    h.wait_ready(1, &mut node).await;
    let r = h
        .post(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": (1..200).collect::<Vec<u32>>(), "max_tokens": 2}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.json);
    let worker = r.worker.clone().expect("worker header");

    // streams ls / info: the KV events stream holds the request's events.
    let v = ok_json(&nats.url, &["streams", "ls"]);
    let events = v["streams"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "dynamo_it_kv_events")
        .cloned()
        .unwrap_or_else(|| panic!("no KV events stream: {v}"));
    assert!(events["messages"].as_u64().unwrap() >= 1, "{events}");
    let table = dynamoctl(&nats.url, &["streams", "ls"]);
    assert_success(&table);
    assert!(String::from_utf8_lossy(&table.stdout).contains("dynamo_it_kv_events"));
    let info = ok_json(&nats.url, &["streams", "info", "dynamo_it_kv_events"]);
    assert_eq!(
        info["config"]["max_age"].as_u64().map(|_| ()),
        Some(()),
        "{info}"
    );

    // Another namespace whose name extends this one's ("it_b"): its
    // streams are not "it"'s, though their names share a prefix; --all
    // shows every stream on the server.
    let other = dynamo_runtime::Bus::connect(
        &nats.url,
        "other",
        dynamo_bus_schema::Subjects::new(dynamo_bus_schema::Namespace::new("it_b").unwrap()),
        &Default::default(),
    )
    .await
    .expect("connect to NATS");
    other
        .kv_bucket(
            &other.subjects.workers_bucket(),
            std::time::Duration::from_secs(60),
        )
        .await
        .expect("it_b's workers bucket");
    let names = |v: &Value, list: &str, key: &str| -> Vec<String> {
        v[list]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s[key].as_str().unwrap().to_string())
            .collect()
    };
    let ns_only = names(&ok_json(&nats.url, &["streams", "ls"]), "streams", "name");
    assert!(
        !ns_only.contains(&"KV_dynamo_it_b_workers".to_string()),
        "{ns_only:?}"
    );
    assert!(
        ns_only.contains(&"KV_dynamo_it_workers".to_string()),
        "{ns_only:?}"
    );
    let every = names(
        &ok_json(&nats.url, &["streams", "ls", "--all"]),
        "streams",
        "name",
    );
    assert!(
        every.contains(&"KV_dynamo_it_b_workers".to_string()),
        "{every:?}"
    );
    let buckets = names(&ok_json(&nats.url, &["buckets", "ls"]), "buckets", "bucket");
    assert!(
        !buckets.contains(&"dynamo_it_b_workers".to_string()),
        "{buckets:?}"
    );
    let buckets = names(
        &ok_json(&nats.url, &["buckets", "ls", "--all"]),
        "buckets",
        "bucket",
    );
    assert!(
        buckets.contains(&"dynamo_it_b_workers".to_string()),
        "{buckets:?}"
    );

    // buckets ls / get (short name, decoded) / watch.
    let v = ok_json(&nats.url, &["buckets", "ls"]);
    assert!(
        v["buckets"]
            .as_array()
            .unwrap()
            .iter()
            .any(|b| b["bucket"] == "dynamo_it_workers"),
        "{v}"
    );
    let keys = ok_json(&nats.url, &["buckets", "get", "workers"]);
    assert!(
        keys["keys"]
            .as_array()
            .unwrap()
            .iter()
            .any(|k| k == &json!(worker)),
        "{keys}"
    );
    let e = ok_json(&nats.url, &["buckets", "get", "workers", &worker]);
    assert_eq!(e["value"]["type"], "WorkerRegistration", "{e}");
    assert_eq!(e["value"]["value"]["kv_events"], true);
    let watched = lines(
        &nats.url,
        &[
            "buckets",
            "watch",
            "workers",
            "--count",
            "1",
            "--timeout-s",
            "10",
        ],
    );
    assert_eq!(watched.len(), 1);
    assert_eq!(watched[0]["value"]["type"], "WorkerRegistration");

    // events tail: the last batches, decoded, for that worker only.
    let tail = |w: &str| {
        let args = [
            "events",
            "tail",
            "--worker",
            w,
            "--last",
            "5",
            "--count",
            "1",
            "--timeout-s",
            "10",
        ];
        lines(&nats.url, &args)
    };
    let batches = tail(&worker);
    assert_eq!(batches.len(), 1, "{batches:?}");
    assert_eq!(batches[0]["worker"], json!(worker));
    assert_eq!(batches[0]["events"][0]["kind"], "stored", "{}", batches[0]);
    // A prefix of the id, as drain takes, names the same worker.
    let by_prefix = tail(&worker[..6]);
    assert_eq!(by_prefix[0]["worker"], json!(worker), "{by_prefix:?}");
    let out = dynamoctl(&nats.url, &["events", "tail", "--worker", "nothex"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--worker"), "{err}");

    // index query: by token ids and by text, what the worker holds.
    let ids: Vec<String> = (1..200).map(|t: u32| t.to_string()).collect();
    let out = index_query(&h.base, &["--json", "--tokens", &ids.join(",")]);
    let q: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(q["tokens"], 199);
    assert!(
        q["workers"][&worker]["blocks"].as_u64().unwrap() >= 12,
        "{q}"
    );
    let out = index_query(&h.base, &["--text", "hello there"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("prompt:"));
    // A model nobody serves is an error, not "no worker holds it".
    let out = std::process::Command::new(bin("dynamoctl"))
        .args([
            "index", "query", "--url", &h.base, "--model", "nosuch", "--tokens", "1,2,3",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("404"), "{err}");

    // consumers ls answers (the routers follow core NATS: maybe none).
    let c = ok_json(&nats.url, &["consumers", "ls"]);
    assert!(c["consumers"].is_array(), "{c}");

    // A purge needs --yes, then empties the stream.
    let refused = dynamoctl(&nats.url, &["streams", "purge", "dynamo_it_kv_events"]);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--yes"));
    let p = ok_json(
        &nats.url,
        &["streams", "purge", "dynamo_it_kv_events", "--yes"],
    );
    assert!(p["purged"].as_u64().unwrap() >= 1, "{p}");
    // A bucket that does not exist is a clear error.
    let missing = dynamoctl(&nats.url, &["buckets", "get", "nope"]);
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("no KV bucket nope"));
    assert!(node.alive());
}

#[test]
fn bench_and_calibrate_fail_fast_against_a_server_that_never_answers() {
    // Accepts connections and never says a word.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let _hold = std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in listener.incoming().flatten() {
            held.push(s);
        }
    });
    for args in [
        vec!["bench", "--url", url.as_str(), "--requests", "1"],
        vec!["calibrate-mocker", "--url", url.as_str()],
    ] {
        let out = std::process::Command::new(bin("dynamoctl"))
            .args(&args)
            .output()
            .expect("run dynamoctl");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(
            err.contains("did not answer GET /v1/models within 10 s"),
            "{args:?}: {err}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mistyped_namespace_is_an_error_and_leaves_nothing_behind() {
    let nats = Nats::start();
    for args in [
        vec!["status"],
        vec!["get", "deployments"],
        vec!["models", "ls"],
        vec!["planner", "status"],
    ] {
        let out = std::process::Command::new(bin("dynamoctl"))
            .args(&args)
            .args(["--nats", nats.url.as_str(), "--namespace", "typo"])
            .output()
            .expect("run dynamoctl");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(
            err.contains("namespace \"typo\" has nothing on this NATS server"),
            "{args:?}: {err}"
        );
    }
    let js = async_nats::jetstream::new(async_nats::connect(&nats.url).await.unwrap());
    let names: Vec<String> = futures::StreamExt::collect::<Vec<_>>(js.stream_names())
        .await
        .into_iter()
        .map(|n| n.unwrap())
        .collect();
    assert!(names.iter().all(|n| !n.contains("typo")), "{names:?}");
    // A cache filled before any node starts is a namespace in use.
    let gguf = dynamo_integration::llama::gguf();
    for args in [
        vec!["models", "push", gguf.as_str(), "--model", MODEL],
        vec!["models", "ls"],
    ] {
        let out = std::process::Command::new(bin("dynamoctl"))
            .args(&args)
            .args(["--nats", nats.url.as_str(), "--namespace", "early"])
            .output()
            .expect("run dynamoctl");
        assert_success(&out);
    }
}
