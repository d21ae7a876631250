//! Weights from the cluster (issue 18): real node daemons, real NATS,
//! real libfabric endpoints (`tcp;ofi_rxm`). A node started without the
//! model file (`DYNAMO_MODEL_GGUF` unset, the package hidden with
//! `DYNAMO_MODEL_PACKAGE=0`) gets it from a peer, or from the in-cluster
//! cache, verified, and serves it on.

use dynamo_integration::*;
use serde_json::{json, Value};
use std::time::Duration;

/// The environment of a node that has no model file of its own.
fn bare(dir: &std::path::Path) -> (Vec<(&'static str, String)>, &'static [&'static str]) {
    (
        vec![
            ("DYNAMO_MODEL_PACKAGE", "0".to_string()),
            ("DYNAMO_WEIGHTS_DIR", dir.display().to_string()),
        ],
        &["DYNAMO_MODEL_GGUF"],
    )
}

fn start_bare(cfg: &str, dir: &std::path::Path, more: &[(&str, &str)]) -> Node {
    let (set, unset) = bare(dir);
    let mut env: Vec<(&str, &str)> = set.iter().map(|(k, v)| (*k, v.as_str())).collect();
    env.extend_from_slice(more);
    Node::start_with_env(cfg, &env, unset)
}

fn cpu_worker() -> String {
    format!(
        "[[workers]]\ncount = 1\nengine = \"cpu\"\nmodel = \"{MODEL}\"\nheartbeat_ms = 500\n\n\
         [workers.cpu]\nthreads = 1\nnum_blocks = 128\n\n"
    )
}

/// Waits until `node` advertises the model as ready to peers.
async fn wait_served(nats: &str, node: &str) {
    let t0 = std::time::Instant::now();
    loop {
        let v = models_ls(nats);
        let served = v["models"].as_array().into_iter().flatten().any(|m| {
            m["sources"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|s| s["node"] == node && s["state"] == "ready")
        });
        if served {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{node} never served the model: {v}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A NATS server and node `a`: a gateway and one mocker worker, the model
/// file its own, served to peers.
async fn peer_a() -> (Nats, Node, Http) {
    let nats = Nats::start();
    let port = free_port();
    let mut a = Node::start(&node_config("a", &nats.url, Some(port), 1, ""));
    let http = Http::new(port);
    http.wait_ready(1, &mut a).await;
    wait_served(&nats.url, "a").await;
    (nats, a, http)
}

/// Waits until `node` has written the file it loaded.
async fn kept(node: &mut Node) {
    wait_log(node, Duration::from_secs(60), "the loaded file kept", |l| {
        l.contains("weights: the loaded file is kept")
    })
    .await;
}

/// Waits until `node`'s load ends; answers its log and the line that
/// says what each source gave.
async fn load_finished(node: &mut Node) -> (String, String) {
    wait_log(node, Duration::from_secs(120), "the load finishing", |l| {
        l.contains("weights: loaded and verified")
    })
    .await;
    let log = node.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("loaded and verified"))
        .expect("the line just waited for")
        .to_string();
    (log, line)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_the_model_loads_it_from_a_peer_and_answers_the_same() {
    let nats = Nats::start();
    // b starts first, as in a fleet started at once: no node offers the
    // model yet, so it waits for a source (`DYNAMO_WEIGHTS_WAIT_S`).
    let dir = tempfile::tempdir().unwrap();
    let mut b = start_bare(
        &node_config("b", &nats.url, None, 0, &cpu_worker()),
        dir.path(),
        &[],
    );
    wait_log(&mut b, Duration::from_secs(60), "b waiting for a source", |l| {
        l.contains("weights: no source yet (no node advertises smollm2-135m-instruct); waiting for one")
    })
    .await;
    let port = free_port();
    let mut a = Node::start(&node_config("a", &nats.url, Some(port), 0, &cpu_worker()));
    let http = Http::new(port);
    http.wait_ready(2, &mut a).await;
    let log = b.log_text();
    assert!(log.contains("weights: loaded and verified"), "{log}");
    assert!(log.contains("peer a"), "{log}");
    // a read its file once: its engine computes with the memory b read.
    let log = a.log_text();
    assert!(
        log.contains("weights: the engine and peers share one copy of the file"),
        "{log}"
    );
    // The file it wrote (in the background, while its worker started
    // from memory) is the same file.
    kept(&mut b).await;
    let want = std::fs::read(dynamo_integration::llama::gguf()).unwrap();
    let got: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .collect();
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(std::fs::read(got[0].path()).unwrap() == want);
    // Both nodes serve it now.
    let v = models_ls(&nats.url);
    let m = &v["models"][0];
    assert_eq!(m["model"], MODEL, "{v}");
    let nodes: Vec<&str> = m["sources"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["state"] == "ready")
        .filter_map(|s| s["node"].as_str())
        .collect();
    assert!(nodes.contains(&"a") && nodes.contains(&"b"), "{v}");
    // Greedy answers from either worker are byte-identical.
    let body = json!({"model": MODEL, "prompt": chat_tokens("Name three colours."),
                      "max_tokens": 16, "temperature": 0.0});
    let mut by_worker = std::collections::BTreeMap::new();
    for _ in 0..6 {
        let (x, y) = tokio::join!(
            http.post("/v1/completions", &body),
            http.post("/v1/completions", &body)
        );
        for r in [x, y] {
            assert_eq!(r.status, 200, "{}", r.json);
            let text = r.json["choices"][0]["text"].as_str().unwrap().to_string();
            by_worker.insert(r.worker.clone().unwrap_or_default(), text);
        }
    }
    assert_eq!(
        by_worker.len(),
        2,
        "one worker served everything: {by_worker:?}"
    );
    let texts: std::collections::BTreeSet<&String> = by_worker.values().collect();
    assert_eq!(texts.len(), 1, "{by_worker:?}");
    assert!(b.alive());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_killed_mid_load_is_replaced_by_the_cache() {
    let (nats, a, _http) = peer_a().await;
    // The file is in the cache as well.
    let out = dynamoctl(
        &nats.url,
        &[
            "models",
            "push",
            &dynamo_integration::llama::gguf(),
            "--model",
            MODEL,
        ],
    );
    assert_success(&out);
    let v = models_ls(&nats.url);
    assert_eq!(v["models"][0]["cached"], true, "{v}");
    // A slow load (20 MB/s), so the peer can die in the middle of it.
    let dir = tempfile::tempdir().unwrap();
    let mut b = start_bare(
        &node_config("b", &nats.url, None, 1, ""),
        dir.path(),
        &[("DYNAMO_WEIGHTS_MAX_MBPS", "20")],
    );
    wait_log(
        &mut b,
        Duration::from_secs(30),
        "a first part from the peer",
        |l| l.contains("% loaded") && l.contains("peer a"),
    )
    .await;
    // An operator follows the load (`models watch`) while it goes.
    let mut watch = std::process::Command::new(bin("dynamoctl"))
        .args(["models", "watch", "--node", "b", "--until-idle", "--json"])
        .args([
            "--every-ms",
            "200",
            "--nats",
            &nats.url,
            "--namespace",
            "it",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("run dynamoctl models watch");
    a.signal(libc::SIGKILL);
    let (log, line) = load_finished(&mut b).await;
    assert!(line.contains("peer a") && line.contains("cache"), "{line}");
    assert!(
        !log.contains("\"cache (object store)\", 0)"),
        "the cache gave nothing: {line}"
    );
    // Its worker comes up on the verified file.
    let t0 = std::time::Instant::now();
    while !registrations(&nats.url)
        .await
        .iter()
        .any(|r| r.node_id.0 == "b")
    {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "b's worker never registered:\n{}",
            b.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The watch saw the load move on and end with b serving, then stopped.
    let t0 = std::time::Instant::now();
    let code = loop {
        if let Some(st) = watch.try_wait().unwrap() {
            break st;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "models watch never stopped"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(code.success(), "{code:?}");
    let mut out = String::new();
    std::io::Read::read_to_string(&mut watch.stdout.take().unwrap(), &mut out).unwrap();
    let lines: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let loaded: Vec<u64> = lines
        .iter()
        .filter(|l| l["state"] == "loading")
        .map(|l| l["loaded_bytes"].as_u64().unwrap())
        .collect();
    assert!(loaded.len() >= 2, "{out}");
    assert!(loaded.windows(2).all(|w| w[0] <= w[1]), "{out}");
    let last = lines.last().unwrap();
    assert!(last["node"] == "b" && last["state"] == "ready", "{out}");
    assert!(b.alive());
    // A mistyped node is an error, not a silent watch of nothing.
    let out = dynamoctl(
        &nats.url,
        &["models", "watch", "--node", "nosuch", "--until-idle"],
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no node \"nosuch\"") && err.contains("b"),
        "{err}"
    );
}

/// libfabric's `shm` provider installs SIGTERM and SIGINT handlers when
/// first used; a node that read its weights over it still drains on
/// SIGTERM (exit 0) rather than dying at once. A node stopped while it
/// waits for a source stops at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_stops_cleanly_after_a_shm_load_and_while_waiting_for_a_source() {
    let nats = Nats::start();
    let shm = [("DYNAMO_WEIGHTS_PROVIDER", "shm")];
    let port = free_port();
    let mut a = Node::start_with_env(&node_config("a", &nats.url, Some(port), 1, ""), &shm, &[]);
    let http = Http::new(port);
    http.wait_ready(1, &mut a).await;
    wait_served(&nats.url, "a").await;
    let dir = tempfile::tempdir().unwrap();
    // Two groups of the model: the second uses the file the first load
    // keeps, rather than loading it again.
    let mut b = start_bare(
        &node_config("b", &nats.url, None, 1, &cpu_worker()),
        dir.path(),
        &shm,
    );
    http.wait_ready(3, &mut a).await;
    let (log, line) = load_finished(&mut b).await;
    assert!(line.contains("peer a"), "{line}");
    assert_eq!(
        log.matches("weights: loaded and verified").count(),
        1,
        "{log}"
    );
    assert!(
        log.contains("weights: using the verified local copy"),
        "{log}"
    );
    // ... and serves it once, from the memory the load landed in.
    wait_served(&nats.url, "b").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let log = b.log_text();
    assert_eq!(log.matches("weights: serving to peers").count(), 1, "{log}");
    // The node handles signals once its worker registered.
    tokio::time::sleep(Duration::from_millis(500)).await;
    b.signal(libc::SIGTERM);
    assert_eq!(b.wait(Duration::from_secs(60)), Some(0), "{}", b.log_text());
    assert!(b.log_text().contains("node stopped"), "{}", b.log_text());

    // Waiting for a model no one offers: SIGTERM ends the wait.
    let dir = tempfile::tempdir().unwrap();
    let other =
        "[[workers]]\ncount = 1\nengine = \"mocker\"\nmodel = \"not-offered\"\nheartbeat_ms = 500\n\n\
         [workers.mocker]\nspeedup = 0.0\n\n";
    let mut c = start_bare(
        &node_config("c", &nats.url, None, 0, other),
        dir.path(),
        &[],
    );
    wait_log(
        &mut c,
        Duration::from_secs(60),
        "c waiting for a source",
        |l| l.contains("weights: no source yet (no node advertises not-offered); waiting for one"),
    )
    .await;
    c.signal(libc::SIGTERM);
    assert_eq!(c.wait(Duration::from_secs(10)), Some(0), "{}", c.log_text());
    assert!(c
        .log_text()
        .contains("stopped by a signal while loading models"));
    assert!(a.alive());
}

/// A load that fails while wait time is left waits for a source again:
/// here the only peer is killed mid-load, and a new peer then comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_whose_peer_is_gone_waits_for_another_source() {
    let (nats, a, _http) = peer_a().await;
    // A slow load (20 MB/s) from peers only, so a dies in the middle of it.
    let dir = tempfile::tempdir().unwrap();
    let mut b = start_bare(
        &node_config("b", &nats.url, None, 1, ""),
        dir.path(),
        &[
            ("DYNAMO_WEIGHTS_ORDER", "peer"),
            ("DYNAMO_WEIGHTS_WAIT_S", "90"),
            ("DYNAMO_WEIGHTS_PEER_TIMEOUT_S", "3"),
            ("DYNAMO_WEIGHTS_MAX_MBPS", "20"),
        ],
    );
    wait_log(
        &mut b,
        Duration::from_secs(60),
        "a first part from a",
        |l| l.contains("% loaded") && l.contains("peer a"),
    )
    .await;
    a.signal(libc::SIGKILL);
    wait_log(&mut b, Duration::from_secs(60), "b's load failing", |l| {
        l.contains("weights: the load failed; waiting for a source again")
    })
    .await;
    let mut c = Node::start(&node_config("c", &nats.url, None, 1, ""));
    let (_, line) = load_finished(&mut b).await;
    assert!(line.contains("(\"peer c\", 98362432)"), "{line}");
    assert!(b.alive() && c.alive());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_source_at_all_the_node_fails_naming_each_source_tried() {
    let nats = Nats::start();
    let dir = tempfile::tempdir().unwrap();
    let mut c = start_bare(
        &node_config("c", &nats.url, None, 1, ""),
        dir.path(),
        &[("DYNAMO_WEIGHTS_WAIT_S", "2")],
    );
    let code = c.wait(Duration::from_secs(60)).expect("the node exits");
    assert_ne!(code, 0);
    let log = c.log_text();
    for want in [
        "weights: no source yet (no node advertises smollm2-135m-instruct); waiting for one",
        "after waiting 2 s for one; $DYNAMO_WEIGHTS_WAIT_S sets how long",
        "no source for model smollm2-135m-instruct",
        "file: no model file given",
        "$DYNAMO_MODEL_GGUF is unset",
        "peer: none advertises it",
        "cache: does not hold it",
    ] {
        assert!(log.contains(want), "{want:?} not in:\n{log}");
    }
}

fn pinned_mocker(sha: &str) -> String {
    format!(
        "[[workers]]\ncount = 1\nengine = \"mocker\"\nmodel = \"{MODEL}\"\nmodel_sha256 = \"{sha}\"\n\
         heartbeat_ms = 500\n\n[workers.mocker]\nspeedup = 0.0\n\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_chunk_is_fetched_again_and_other_content_is_refused() {
    let (nats, mut a, _http) = peer_a().await;
    let gguf = dynamo_integration::llama::gguf();
    // What no worker could load, or no client could name, stays out.
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("notes.gguf");
    std::fs::write(&text, "not a model").unwrap();
    let empty = dir.path().join("empty.gguf");
    std::fs::write(&empty, "").unwrap();
    for (file, model, says) in [
        (text.to_str().unwrap(), MODEL, "is not a GGUF model file"),
        (empty.to_str().unwrap(), MODEL, "is not a GGUF model file"),
        (gguf.as_str(), "a b/../c*>", "is not a model name"),
    ] {
        let out = dynamoctl(&nats.url, &["models", "push", file, "--model", model]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(says),
            "{file} {model}: {err}"
        );
    }
    let v = models_ls(&nats.url);
    assert!(
        v["models"].as_array().is_some_and(|ms| ms
            .iter()
            .all(|m| m["cached"] != true && m["model"] == MODEL)),
        "nothing was pushed: {v}"
    );
    assert_success(&dynamoctl(
        &nats.url,
        &["models", "push", &gguf, "--model", MODEL],
    ));
    let sha = models_ls(&nats.url)["models"][0]["sha256"]
        .as_str()
        .expect("a sha256")
        .to_string();
    // One chunk in the cache goes bad: same length, one byte flipped.
    let js = async_nats::jetstream::new(async_nats::connect(&nats.url).await.unwrap());
    let store = js.get_object_store("dynamo_it_weight_cache").await.unwrap();
    let name = format!("{sha}.3");
    let mut chunk = Vec::new();
    {
        use tokio::io::AsyncReadExt;
        let mut o = store.get(name.as_str()).await.unwrap();
        o.read_to_end(&mut chunk).await.unwrap();
    }
    chunk[1000] ^= 0xff;
    store
        .put(name.as_str(), &mut chunk.as_slice())
        .await
        .unwrap();

    // The cache first, then the peer; the hash pinned in the config.
    let dir = tempfile::tempdir().unwrap();
    let mut b = start_bare(
        &node_config("b", &nats.url, None, 0, &pinned_mocker(&sha)),
        dir.path(),
        &[("DYNAMO_WEIGHTS_ORDER", "cache,peer")],
    );
    let (log, line) = load_finished(&mut b).await;
    assert!(
        log.contains("chunk=3") && log.contains("does not match its hash"),
        "{log}"
    );
    assert!(line.contains("refetched=1"), "{line}");
    assert!(line.contains("peer a"), "{line}");
    kept(&mut b).await;
    let want = std::fs::read(&gguf).unwrap();
    let got = std::fs::read(dir.path().join(format!("{sha}.gguf"))).unwrap();
    assert!(got == want, "the loaded file differs from the original");

    // A local file of other content than the pinned hash is refused...
    let mut other = sha.clone().into_bytes();
    other[0] = if other[0] == b'0' { b'1' } else { b'0' };
    let other = String::from_utf8(other).unwrap();
    let mut c = Node::start(&node_config(
        "c",
        &nats.url,
        None,
        0,
        &pinned_mocker(&other),
    ));
    assert_ne!(c.wait(Duration::from_secs(60)).expect("c exits"), 0);
    let log = c.log_text();
    let want = format!("its sha256 is {sha}, not the pinned {other} (model_sha256)");
    assert!(
        log.contains("refused") && log.contains(&want),
        "{want:?} not in:\n{log}"
    );
    // ... and so is every cluster source of it.
    let dir = tempfile::tempdir().unwrap();
    let mut d = start_bare(
        &node_config("d", &nats.url, None, 0, &pinned_mocker(&other)),
        dir.path(),
        &[("DYNAMO_WEIGHTS_WAIT_S", "0")],
    );
    assert_ne!(d.wait(Duration::from_secs(60)).expect("d exits"), 0);
    let log = d.log_text();
    let want = format!("no source for model {MODEL} with the pinned sha256 {other}");
    assert!(log.contains(&want), "{want:?} not in:\n{log}");

    // `models rm` takes the file out of the cache: only with --yes, only
    // what it names, and the nodes serving it go on serving it.
    let out = dynamoctl(&nats.url, &["models", "rm", MODEL]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("add --yes"));
    let out = dynamoctl(&nats.url, &["models", "rm", "nosuch-model", "--yes"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("no model or content hash"));
    let out = dynamoctl(&nats.url, &["models", "rm", &sha[..10], "--yes", "--json"]);
    assert_success(&out);
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(r["chunks_deleted"].as_u64().is_some_and(|n| n >= 1), "{r}");
    assert_eq!(r["manifest_kept"], true, "{r}");
    assert!(r["served_by"].as_array().unwrap().len() >= 2, "{r}");
    assert!(
        store.get(format!("{sha}.0").as_str()).await.is_err(),
        "chunk 0 is still in the object store"
    );
    let v = models_ls(&nats.url);
    assert_eq!(v["models"][0]["cached"], false, "{v}");
    assert_eq!(v["models"][0]["sha256"], sha.as_str(), "{v}");
    let out = dynamoctl(&nats.url, &["models", "rm", MODEL, "--yes"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("is not in the cache"),
        "{err}"
    );
    assert!(a.alive() && b.alive());
}

/// Makes `path` a named pipe and opens its reading end, so the node's real
/// write into it goes only as fast as the test reads (a disk as slow as
/// the test wants). The reader is opened before the node writes, so the
/// node never waits to open the pipe, and a read never waits for a writer
/// that does not come: with no writer it ends at once.
fn slow_disk_at(path: &std::path::Path) -> std::fs::File {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::OpenOptionsExt;
    use std::os::unix::io::AsRawFd;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).expect("a path without NUL");
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
    assert_eq!(rc, 0, "mkfifo {}", path.display());
    // Opening a pipe's reading end blocks until a writer comes, unless
    // non-blocking; reads then block again (for data or the writer's end).
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .expect("the pipe's reading end");
    // SAFETY: `f` is an open descriptor for the duration of the call.
    let rc = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_SETFL, 0) };
    assert_eq!(rc, 0, "fcntl on {}", path.display());
    f
}

/// Starts node `name` without the model, with a shutdown grace of
/// `grace_ms` and its file's temporary path a named pipe nothing reads
/// yet. Once it has loaded the model from peer a and its worker has
/// registered, stops it (SIGTERM) and waits until it says it is
/// finishing the write. Answers the node, its directory and the pipe.
async fn stopped_while_writing(
    name: &str,
    nats: &str,
    sha: &str,
    grace_ms: u64,
) -> (Node, tempfile::TempDir, std::fs::File) {
    let dir = tempfile::tempdir().unwrap();
    let pipe = slow_disk_at(&dir.path().join(format!("{sha}.gguf.part")));
    let grace = format!("[supervision]\nshutdown_grace_ms = {grace_ms}\n");
    let mut n = start_bare(&node_config(name, nats, None, 1, &grace), dir.path(), &[]);
    let (_, line) = load_finished(&mut n).await;
    assert!(line.contains("peer a"), "{line}");
    // Its worker starts from the loaded bytes, with the write pending.
    let t0 = std::time::Instant::now();
    while !registrations(nats)
        .await
        .iter()
        .any(|r| r.node_id.0 == name)
    {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{name}'s worker never registered:\n{}",
            n.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(!n.log_text().contains("the loaded file is kept"));
    n.signal(libc::SIGTERM);
    wait_log(
        &mut n,
        Duration::from_secs(30),
        "the stop waiting for the write",
        |l| l.contains("weights: finishing the write of loaded files"),
    )
    .await;
    (n, dir, pipe)
}

/// A node stopped while it writes the file it loaded from a peer waits for
/// the write (the file is kept for its next start), and waits only as long
/// as its shutdown grace. The write goes into a named pipe at the file's
/// temporary path (`<sha256>.gguf.part`), so it lasts as long as the test
/// wants: the bytes that come out are the model's, and a write that never
/// ends holds the stop for the grace and no longer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_waits_for_a_loaded_file_being_written_within_its_grace() {
    let (nats, mut a, _http) = peer_a().await;
    let sha = models_ls(&nats.url)["models"][0]["sha256"]
        .as_str()
        .expect("a sha256")
        .to_string();

    // 1. The write finishes during the stop (a grace of 30 s): the node
    // waits for it. A node that did not wait would be gone within the
    // runtime's 1 s shutdown bound.
    let (mut b, _dir, mut pipe) = stopped_while_writing("b", &nats.url, &sha, 30_000).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(b.alive(), "b did not wait for its write: {}", b.log_text());
    // Now the "disk" takes the bytes.
    let got = tokio::task::spawn_blocking(move || {
        use std::io::Read;
        let mut v = Vec::new();
        pipe.read_to_end(&mut v).map(|_| v)
    })
    .await
    .expect("the reader")
    .expect("the pipe read");
    let want = std::fs::read(dynamo_integration::llama::gguf()).unwrap();
    assert!(got == want, "{} bytes written, not the model's", got.len());
    assert_eq!(b.wait(Duration::from_secs(30)), Some(0), "{}", b.log_text());
    let log = b.log_text();
    assert!(log.contains("weights: the loaded file is kept"), "{log}");
    assert!(!log.contains("was not written in time"), "{log}");
    assert!(log.contains("node stopped"), "{log}");

    // 2. A write that never finishes (the pipe is never read): the stop
    // gives up at its grace (3 s), not at another bound.
    let (mut c, _dir, _pipe) = stopped_while_writing("c", &nats.url, &sha, 3_000).await;
    assert_eq!(c.wait(Duration::from_secs(30)), Some(0), "{}", c.log_text());
    let log = c.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("weights: a loaded file was not written in time"))
        .unwrap_or_else(|| panic!("no give-up line in:\n{log}"));
    assert!(line.contains("limit_s=3"), "{line}");
    assert!(!log.contains("the loaded file is kept"), "{log}");
    assert!(log.contains("node stopped"), "{log}");
    assert!(a.alive());
}
