//! Workers that front a real external engine: llama.cpp's `llama-server`,
//! built from the llama.cpp source in the PyPI package `llama-cpp-python`
//! (`scripts/build_llama_server.sh`), serving the same SmolLM2 GGUF as our
//! tokenizer reads.
//!
//! The build is heavy, so these run in `make test-engines` (which builds
//! the server once, caches it outside `target/`, and passes its path in
//! `DYNAMO_LLAMA_SERVER`), not in `make test`:
//!
//! ```text
//! DYNAMO_LLAMA_SERVER=$(scripts/build_llama_server.sh) \
//!   cargo test -p dynamo-integration --test external_engine -- --ignored
//! ```

use dynamo_integration::llama::{llama_server, server_args, Server};
use dynamo_integration::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// The pids of the engine processes a node's log says it started.
fn engine_pids(log: &str) -> Vec<i32> {
    log.lines()
        .filter(|l| l.contains("engine process started"))
        .filter_map(|l| l.split("pid=").nth(1))
        .filter_map(|p| p.split_whitespace().next()?.parse().ok())
        .collect()
}

/// Whether a process runs: its /proc entry is there and not a zombie.
fn running(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| !stat.contains(") Z"))
}

/// A worker group attached to a running server.
fn attached(port: u16) -> String {
    format!(
        "[[workers]]\ncount = 1\nengine = \"llamacpp\"\nmodel = \"{MODEL}\"\nheartbeat_ms = 500\n\n\
         [workers.external]\nurl = \"http://127.0.0.1:{port}\"\nmax_inflight = 8\n\
         health_interval_ms = 200\nhealth_failures = 2\n\n"
    )
}

struct Deployment {
    nats: Nats,
    node: Node,
    http: Http,
    port: u16,
    servers: Vec<Server>,
}

/// A gateway and two workers, each fronting its own llama.cpp server.
async fn two_servers() -> Deployment {
    let servers = vec![Server::start().await, Server::start().await];
    let nats = Nats::start();
    let port = free_port();
    let extra: String = servers.iter().map(|s| attached(s.port)).collect();
    let mut node = Node::start(&node_config("n", &nats.url, Some(port), 0, &extra));
    let http = Http::new(port);
    http.wait_ready(2, &mut node).await;
    wait_serving(&nats.url, 2).await;
    Deployment {
        nats,
        node,
        http,
        port,
        servers,
    }
}

/// Waits until `n` workers are registered as serving.
async fn wait_serving(nats_url: &str, n: usize) {
    let t0 = Instant::now();
    loop {
        let regs = registrations(nats_url).await;
        let serving = regs
            .iter()
            .filter(|r| r.state == dynamo_bus_schema::WorkerState::Serving)
            .count();
        if serving >= n {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{serving} of {n} workers serving: {regs:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn prompts() -> Vec<Vec<u32>> {
    [
        "Write a haiku about the sea.",
        "What is the capital of France?",
        "List three prime numbers.",
        "Explain what a compiler does in one sentence.",
    ]
    .iter()
    .map(|p| chat_tokens(p))
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs llama-server: make test-engines"]
async fn greedy_answers_through_the_gateway_equal_llamacpps_own() {
    let d = two_servers().await;
    let mut served_by = std::collections::HashSet::new();
    for p in prompts() {
        let want = d.servers[0].direct(&p, 32).await;
        assert!(!want.is_empty());
        let r = d
            .http
            .post(
                "/v1/completions",
                &json!({"model": MODEL, "prompt": p, "max_tokens": 32, "temperature": 0.0}),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.json);
        assert_eq!(r.json["choices"][0]["text"].as_str(), Some(want.as_str()));
        served_by.extend(r.worker);
        // Streamed, the same text arrives in pieces.
        let (status, events) = d
            .http
            .stream(
                "/v1/completions",
                &json!({"model": MODEL, "prompt": p, "max_tokens": 32, "temperature": 0.0, "stream": true}),
            )
            .await;
        assert_eq!(status, 200);
        let text: String = events
            .iter()
            .filter_map(|e| serde_json::from_str::<Value>(e).ok())
            .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_string))
            .collect();
        assert_eq!(text, want);
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    }
    // A chat request: our template, then the server's greedy tokens.
    let msg = "Name a colour.";
    let want = d.servers[1].direct(&chat_tokens(msg), 16).await;
    let r = d
        .http
        .post(
            "/v1/chat/completions",
            &json!({"model": MODEL, "messages": [{"role": "user", "content": msg}],
                    "max_tokens": 16, "temperature": 0.0}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.json);
    assert_eq!(
        r.json["choices"][0]["message"]["content"].as_str(),
        Some(want.trim_end_matches("<|im_end|>"))
    );
    assert!(!served_by.is_empty());

    // Status names the engine kind and says routing is approximate.
    let out = dynamoctl(&d.nats.url, &["status", "--json"]);
    assert_success(&out);
    let v: Value = serde_json::from_slice(&out.stdout).expect("status JSON");
    let workers = v["workers"].as_array().expect("workers");
    assert_eq!(workers.len(), 2, "{v}");
    for w in workers {
        assert_eq!(w["engine"], "llamacpp", "{w}");
        assert_eq!(w["routing"], "approximate", "{w}");
        assert_eq!(w["kv_events"], false, "{w}");
    }
    let out = dynamoctl(&d.nats.url, &["status"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("llamacpp") && text.contains("approximate"),
        "{text}"
    );
    drop(d.node);
}

/// `prompt = "text"`: the prompt goes as our text, which the server
/// tokenizes itself; its greedy answers are still its own, and the usage
/// says what its prefix cache served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs llama-server: make test-engines"]
async fn a_text_prompt_gives_the_servers_own_greedy_answers() {
    let server = Server::start().await;
    let nats = Nats::start();
    let port = free_port();
    let extra = format!("{}prompt = \"text\"\n\n", attached(server.port));
    let mut node = Node::start(&node_config("n", &nats.url, Some(port), 0, &extra));
    let http = Http::new(port);
    http.wait_ready(1, &mut node).await;
    wait_serving(&nats.url, 1).await;
    for p in prompts() {
        let want = server.direct(&p, 24).await;
        for round in 0..2 {
            let r = http
                .post(
                    "/v1/completions",
                    &json!({"model": MODEL, "prompt": p, "max_tokens": 24, "temperature": 0.0}),
                )
                .await;
            assert_eq!(r.status, 200, "{}", r.json);
            assert_eq!(r.json["choices"][0]["text"].as_str(), Some(want.as_str()));
            // The second time, the server's prompt cache holds the prompt.
            let cached = r.json["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0);
            if round == 1 {
                assert!(cached > 0, "{}", r.json);
            }
        }
    }
    drop(node);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs llama-server: make test-engines"]
async fn a_client_that_goes_away_stops_the_engines_generation() {
    let d = two_servers().await;
    let body = json!({"model": MODEL, "prompt": prompts()[0], "max_tokens": 4000,
                      "ignore_eos": true, "temperature": 0.0, "stream": true});
    let mut r = d.http.open("/v1/completions", &body).await;
    assert_eq!(r.status().as_u16(), 200);
    let worker = r
        .headers()
        .get("x-dynamo-worker")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let mut got = 0;
    while got < 5 {
        let c = r.chunk().await.expect("chunk").expect("stream open");
        got += String::from_utf8_lossy(&c).matches("\"text\"").count();
    }
    // Which server runs it: the one whose slot is busy.
    let mut busy = None;
    for (i, s) in d.servers.iter().enumerate() {
        if s.metric("llamacpp:requests_processing").await >= 1.0 {
            busy = Some(i);
        }
    }
    let busy = busy.unwrap_or_else(|| panic!("no server is generating (worker {worker:?})"));
    drop(r);
    let s = &d.servers[busy];
    let t0 = Instant::now();
    while s.metric("llamacpp:requests_processing").await > 0.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the server still generates after the client left"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // And it does no more decoding.
    let before = s.metric("llamacpp:n_decode_total").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(s.metric("llamacpp:n_decode_total").await, before);
    assert!(
        before < 4000.0,
        "the request ran to the end ({before} decode steps)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs llama-server: make test-engines"]
async fn killing_an_engine_migrates_its_requests_to_the_other() {
    let mut d = two_servers().await;
    let n = 6;
    let max_tokens = 120;
    let body = |i: usize| {
        json!({"model": MODEL, "prompt": prompts()[i % 4], "max_tokens": max_tokens,
               "ignore_eos": true, "temperature": 0.0, "stream": true})
    };
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        let http = Http::new(d.port);
        let b = body(i);
        tasks.spawn(async move { (i, http.stream("/v1/completions", &b).await) });
    }
    // Strike once both servers are generating.
    let t0 = Instant::now();
    loop {
        let mut busy = 0;
        for s in &d.servers {
            if s.metric("llamacpp:requests_processing").await >= 1.0 {
                busy += 1;
            }
        }
        if busy == 2 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "servers never both busy"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    unsafe {
        libc::kill(d.servers[0].child.id() as i32, libc::SIGKILL);
    }
    let mut texts = Vec::new();
    while let Some(t) = tasks.join_next().await {
        let (i, (status, events)) = t.expect("stream task");
        assert_eq!(status, 200);
        let mut finish = None;
        let mut text = String::new();
        for e in &events {
            let Ok(v) = serde_json::from_str::<Value>(e) else {
                continue;
            };
            assert!(v["error"].is_null(), "a stream failed: {v}");
            if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
            text.push_str(v["choices"][0]["text"].as_str().unwrap_or(""));
        }
        assert_eq!(finish.as_deref(), Some("length"), "{events:?}");
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
        texts.push((i, text));
    }
    // Each stream, moved or not, is the surviving server's own greedy
    // answer: nothing lost, doubled or re-sampled across the move (its
    // text shows special tokens, which our gateway leaves out).
    for (i, got) in texts {
        let want = d.servers[1]
            .direct_with(&prompts()[i % 4], max_tokens, true)
            .await;
        let want = ["<|im_end|>", "<|im_start|>", "<|endoftext|>"]
            .iter()
            .fold(want, |w, s| w.replace(s, ""));
        assert_eq!(got, want, "stream {i}");
    }
    let text = d.http.metrics_text().await;
    assert!(
        text.lines()
            .filter(|l| l.starts_with("dynamo_gateway_migrations_total"))
            .any(|l| !l.ends_with(" 0")),
        "no request migrated:\n{text}"
    );
    // The worker whose server died is restarted and waits for it (attach
    // mode): it is not routable, and new requests all succeed.
    for p in prompts() {
        let r = d
            .http
            .post(
                "/v1/completions",
                &json!({"model": MODEL, "prompt": p, "max_tokens": 8}),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.json);
    }
    assert!(d.node.alive());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs llama-server: make test-engines"]
async fn a_launched_engine_is_started_supervised_and_restarted() {
    let nats = Nats::start();
    let port = free_port();
    let mut cmd: Vec<String> = vec![llama_server()];
    cmd.extend(server_args(0));
    // The node picks the port.
    let i = cmd.iter().position(|a| a == "--port").expect("--port") + 1;
    cmd[i] = "{port}".into();
    cmd[2] = "{model_path}".into();
    let command = cmd
        .iter()
        .map(|a| format!("{a:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    let extra = format!(
        "[[workers]]\ncount = 1\nengine = \"llamacpp\"\nmodel = \"{MODEL}\"\nheartbeat_ms = 500\n\n\
         [workers.external]\nhealth_interval_ms = 200\nhealth_failures = 2\n\n\
         [workers.external.launch]\ncommand = [{command}]\n\n\
         [supervision]\nrestart_base_ms = 100\nrestart_max_ms = 1000\n"
    );
    let mut node = Node::start(&node_config("n", &nats.url, Some(port), 0, &extra));
    let http = Http::new(port);
    http.wait_ready(1, &mut node).await;
    wait_serving(&nats.url, 1).await;
    let ask = || async {
        Http::new(port)
            .post(
                "/v1/completions",
                &json!({"model": MODEL, "prompt": prompts()[1], "max_tokens": 12, "temperature": 0.0}),
            )
            .await
    };
    let first = ask().await;
    assert_eq!(first.status, 200, "{}", first.json);
    // The server's output is in the node's log.
    let log = node.log_text();
    let pids = engine_pids(&log);
    assert_eq!(pids.len(), 1, "{log}");
    assert!(
        log.contains("target=\"engine\"") || log.contains("engine:"),
        "no engine output logged"
    );
    unsafe {
        libc::kill(pids[0], libc::SIGKILL);
    }
    // A new process, a new generation, serving the same answer.
    let t0 = Instant::now();
    while engine_pids(&node.log_text()).len() < 2 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "engine never restarted:\n{}",
            node.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    wait_serving(&nats.url, 1).await;
    let t0 = Instant::now();
    let again = loop {
        let r = ask().await;
        if r.status == 200 || t0.elapsed() > Duration::from_secs(30) {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(again.status, 200, "{}", again.json);
    assert_eq!(
        again.json["choices"][0]["text"],
        first.json["choices"][0]["text"]
    );
    assert!(
        node.log_text().contains("exited"),
        "the exit was not logged"
    );
    // Stopping the node stops its engine.
    let last = *engine_pids(&node.log_text()).last().unwrap();
    node.signal(libc::SIGTERM);
    node.wait(Duration::from_secs(20));
    let t0 = Instant::now();
    while running(last) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the engine outlived its node"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The cluster layer with launched engines: a deployment spec whose
/// service launches llama.cpp servers is placed on a node daemon. A replica
/// counts as ready only once its server answers (it registers as
/// `starting` until then), the deployment serves llama.cpp's own greedy
/// answer, and scaling down stops the server of the replica removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs llama-server: make test-engines"]
async fn a_deployment_spec_launches_its_servers_and_counts_them_ready_once_they_answer() {
    let j = JoinedCluster::start(&[JoinSpec::new(
        "n1",
        "zone=z1,rack=r1,host=h1",
        4,
        "controller",
    )]);
    // Each server starts 3 s late, so the window where the worker is up
    // and its engine is not can be seen.
    let mut args = vec![llama_server()];
    args.extend(server_args(0));
    let i = args.iter().position(|a| a == "--port").expect("--port") + 1;
    args[i] = "{port}".into();
    let i = args.iter().position(|a| a == "-m").expect("-m") + 1;
    args[i] = "{model_path}".into();
    // Each word single-quoted for the shell (paths may hold spaces).
    let quoted: Vec<String> = args
        .iter()
        .map(|a| format!("'{}'", a.replace('\'', "'\\''")))
        .collect();
    let script = format!("sleep 3; exec {}", quoted.join(" "));
    let spec = format!(
        r#"
version: 1
name: llamacpp
services:
  frontend:
    role: frontend
    resources: {{memory_mib: 1}}
    gateway: {{max_migrations: 3, liveness_timeout_ms: 1500}}
    router: {{worker_ttl_ms: 3000}}
  engines:
    role: aggregated
    replicas: 2
    resources: {{slots: 1}}
    starts_after: [frontend]
    worker:
      engine: llamacpp
      model: {MODEL}
      heartbeat_ms: 500
      external:
        max_inflight: 4
        health_interval_ms: 200
        health_failures: 2
        launch:
          command: ["sh", "-c", {script:?}]
"#
    );
    let file = j.dir.path().join("llamacpp.yaml");
    std::fs::write(&file, spec).expect("write spec");
    assert_success(&dynamoctl(
        &j.nats.url,
        &["apply", "-f", &file.display().to_string()],
    ));

    // Both workers register as starting while their servers sleep, and the
    // deployment does not count them.
    let t0 = Instant::now();
    loop {
        let regs = registrations(&j.nats.url).await;
        let starting = regs
            .iter()
            .filter(|r| r.state == dynamo_bus_schema::WorkerState::Starting)
            .count();
        if starting == 2 {
            break;
        }
        assert!(
            regs.iter()
                .all(|r| r.state != dynamo_bus_schema::WorkerState::Serving),
            "a worker serving before its server started: {regs:?}"
        );
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "never saw both workers starting: {regs:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let d = describe_deployment(&j.nats.url, "llamacpp");
    assert_eq!(service(&d, "engines")["ready"], 0, "{d}");
    assert_ne!(d["ready"], true, "{d}");

    // Ready once the servers answer; then it serves their greedy answer.
    let d = wait_deployment(
        &j.nats.url,
        "llamacpp",
        Duration::from_secs(60),
        "deployment ready",
        |d| d["ready"] == true && service(d, "engines")["ready"] == 2,
    )
    .await;
    let node = placements(&d, "frontend")
        .into_values()
        .next()
        .expect("a placed frontend");
    let port = j.ports[&node];
    wait_serving(&j.nats.url, 2).await;
    let reference = Server::start().await;
    let prompt = &prompts()[1];
    let want = reference.direct(prompt, 16).await;
    let http = Http::new(port);
    let t0 = Instant::now();
    let r = loop {
        let r = http
            .post(
                "/v1/completions",
                &json!({"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0.0}),
            )
            .await;
        if r.status == 200 || t0.elapsed() > Duration::from_secs(20) {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(r.status, 200, "{}", r.json);
    assert_eq!(r.json["choices"][0]["text"], want.as_str());

    // Two servers were started; scaling to one stops one of them.
    let log = j.nodes[&node].log_text();
    let pids = engine_pids(&log);
    assert_eq!(pids.len(), 2, "{log}");
    assert_success(&dynamoctl(&j.nats.url, &["scale", "llamacpp/engines", "1"]));
    let t0 = Instant::now();
    while pids.iter().filter(|p| running(**p)).count() != 1 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "after scaling to 1, {} of the servers run",
            pids.iter().filter(|p| running(**p)).count()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    wait_deployment(
        &j.nats.url,
        "llamacpp",
        Duration::from_secs(30),
        "one replica ready",
        |d| d["ready"] == true && service(d, "engines")["ready"] == 1,
    )
    .await;
    let r = http
        .post(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0.0}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.json);
    assert_eq!(r.json["choices"][0]["text"], want.as_str());
}

/// A libzmq publisher (`zmq_publisher.py --stdin`, pyzmq) standing in for an
/// engine's KV event publisher, framed as vLLM frames it; the batches it
/// sends are encoded here, in vLLM's map encoding.
struct Publisher {
    child: std::process::Child,
    port: u16,
    replay: u16,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Publisher {
    fn start() -> Publisher {
        use std::io::BufRead;
        // The ZMQ source tests' publisher, in its stdin mode.
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../engines/external/tests/zmq_publisher.py"
        );
        let mut child = std::process::Command::new("python3")
            .arg(script)
            .arg("--stdin")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3");
        let out = child.stdout.take().expect("stdout");
        let (tx, lines) = std::sync::mpsc::sync_channel(64);
        // The reader ends when the publisher exits (its stdout closes).
        std::thread::spawn(move || {
            for l in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let mut p = Publisher {
            child,
            port: 0,
            replay: 0,
            lines,
        };
        let ready = p.expect_line("ready");
        let ports: Vec<u16> = ready
            .split_whitespace()
            .skip(1)
            .map(|w| w.parse().expect("a port"))
            .collect();
        assert_eq!(
            ports.len(),
            2,
            "{ready} (the publisher needs pyzmq: make deps)"
        );
        (p.port, p.replay) = (ports[0], ports[1]);
        p
    }

    /// The next line starting with `word` (30 s at most).
    fn expect_line(&mut self, word: &str) -> String {
        loop {
            let l = self
                .lines
                .recv_timeout(Duration::from_secs(30))
                .unwrap_or_else(|e| panic!("publisher: no {word:?} line: {e}"));
            if l.starts_with(word) {
                return l;
            }
        }
    }

    fn send(&mut self, events: Vec<dynamo_external_engine::events::EngineEvent>) {
        use dynamo_external_engine::events::{encode_batch, Encoding, EngineBatch};
        use std::io::Write;
        let b = EngineBatch {
            ts: 0.0,
            events,
            dp_rank: None,
        };
        let line = hex::encode(encode_batch(&b, Encoding::Map));
        let stdin = self.child.stdin.as_mut().expect("stdin");
        writeln!(stdin, "{line}").expect("publisher stdin");
        stdin.flush().expect("flush");
        self.expect_line("sent");
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// How many leading blocks of `prompt` `worker` holds, by the router.
async fn held(http: &Http, prompt: &[u32], worker: &str) -> u64 {
    http.overlap(prompt).await[worker]["blocks"]
        .as_u64()
        .unwrap_or(0)
}

/// Polls until some worker holds `blocks` leading blocks of `prompt`, and
/// names it (30 s at most).
async fn holder(http: &Http, prompt: &[u32], blocks: u64) -> String {
    let t0 = Instant::now();
    loop {
        let o = http.overlap(prompt).await;
        if let Some((w, _)) = o
            .as_object()
            .and_then(|m| m.iter().find(|(_, v)| v["blocks"] == blocks))
        {
            return w.clone();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "no worker holds {blocks} blocks: {o}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Polls until `worker` holds `blocks` leading blocks of `prompt` (30 s at
/// most).
async fn wait_held(http: &Http, prompt: &[u32], worker: &str, blocks: u64) {
    let t0 = Instant::now();
    loop {
        let now = held(http, prompt, worker).await;
        if now == blocks {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "{worker} holds {now} blocks, not {blocks}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A worker fronting the llama.cpp server on `port`, its KV events from
/// the publisher `p`.
fn with_events(port: u16, p: &Publisher) -> String {
    format!(
        "[[workers]]\ncount = 1\nengine = \"llamacpp\"\nmodel = \"{MODEL}\"\nheartbeat_ms = 500\nblock_size = 16\n\n\
         [workers.external]\nurl = \"http://127.0.0.1:{port}\"\nmax_inflight = 8\n\
         health_interval_ms = 200\nhealth_failures = 2\n\n\
         [workers.external.kv_events]\nendpoint = \"tcp://127.0.0.1:{}\"\n\
         replay_endpoint = \"tcp://127.0.0.1:{}\"\n\n",
        p.port, p.replay
    )
}

/// Two workers, each fronting a llama.cpp server for HTTP and a libzmq
/// publisher for its KV events (llama.cpp publishes none, and no engine
/// here does both): the events reach the router's exact index through the
/// node, rehashed from the engine's 32-token blocks into our 16-token
/// ones, and steer routing; a removal, a hybrid model's sliding-window
/// group and a clear act as they should.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs llama-server: make test-engines"]
async fn kv_events_of_an_external_engine_feed_the_routers_index_through_the_node() {
    use dynamo_external_engine::events::{CacheGroup, EngineEvent, EngineHash};
    let servers = [Server::start().await, Server::start().await];
    let mut pubs = [Publisher::start(), Publisher::start()];
    let nats = Nats::start();
    let port = free_port();
    let extra: String = servers
        .iter()
        .zip(&pubs)
        .map(|(s, p)| with_events(s.port, p))
        .collect();
    let config = node_config("n", &nats.url, Some(port), 0, &extra)
        .replace("policy = \"least_loaded\"", "policy = \"kv_aware\"");
    let mut node = Node::start(&config);
    let http = Http::new(port);
    http.wait_ready(2, &mut node).await;
    wait_serving(&nats.url, 2).await;
    for p in &mut pubs {
        p.expect_line("subscribed");
    }

    // Status: both workers are routed exactly, from their events.
    let out = dynamoctl(&nats.url, &["status", "--json"]);
    assert_success(&out);
    let v: Value = serde_json::from_slice(&out.stdout).expect("status JSON");
    let workers = v["workers"].as_array().expect("workers");
    assert_eq!(workers.len(), 2, "{v}");
    for w in workers {
        assert_eq!(w["routing"], "exact", "{w}");
        assert_eq!(w["kv_events"], true, "{w}");
    }

    let prompt = |text: &str| -> Vec<u32> {
        let t = chat_tokens(text);
        assert!(t.len() > 64, "{} tokens", t.len());
        t
    };
    let p = prompt("Describe, in a few sentences, how a lighthouse keeper spent a long winter on a small rocky island far from the coast, what they read by the lamp at night, and how the supply boat finally came back in the spring.");
    let q = prompt("Summarise the rules of chess for a child who has never played a board game before, starting with how each of the pieces moves across the board, then how a game is won, lost or drawn, and what castling is.");
    let stored = |hashes: [u64; 2], tokens: &[u32], group: CacheGroup| EngineEvent::Stored {
        hashes: hashes.map(EngineHash).to_vec(),
        parent: None,
        token_ids: tokens[..64].to_vec(),
        block_size: 32,
        lora_id: None,
        lora_name: None,
        medium: Some("GPU".into()),
        group,
    };

    // The second engine caches P's first 64 tokens (two of its blocks,
    // four of ours), the first engine (a model with one cache group) Q's:
    // the router sees each on its worker, and each prompt goes where its
    // blocks are.
    // The second engine serves a hybrid model: its full attention is
    // group 0, and says so.
    let full = CacheGroup {
        idx: Some(0),
        kind: Some("full_attention".into()),
    };
    pubs[1].send(vec![stored([101, 102], &p, full)]);
    let w1 = holder(&http, &p, 4).await;
    pubs[0].send(vec![stored([301, 302], &q, CacheGroup::default())]);
    let w0 = holder(&http, &q, 4).await;
    assert_ne!(w0, w1, "each engine's events name its own worker");
    // The chat template's system turn is common to both: its whole blocks
    // are on both workers.
    let common = (1..=4).take_while(|b| p[..16 * b] == q[..16 * b]).count() as u64;
    assert!(common < 4);
    assert_eq!(held(&http, &p, &w0).await, common);
    for (prompt, worker) in [(&p, &w1), (&q, &w0), (&p, &w1)] {
        let r = http
            .post(
                "/v1/completions",
                &json!({"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0.0}),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.json);
        assert_eq!(
            r.worker.as_deref(),
            Some(worker.as_str()),
            "routed by the engine's events"
        );
    }

    // The second engine's sliding-window group stores P too (under other
    // hashes here). Full attention then drops P's second block, naming its
    // group by index only, and the router drops our blocks 3 and 4: the
    // window's copy does not keep them.
    let swa = CacheGroup {
        idx: Some(1),
        kind: Some("sliding_window".into()),
    };
    pubs[1].send(vec![stored([201, 202], &p, swa)]);
    pubs[1].send(vec![EngineEvent::Removed {
        hashes: vec![EngineHash(102)],
        medium: Some("GPU".into()),
        group: CacheGroup {
            idx: Some(0),
            kind: None,
        },
    }]);
    wait_held(&http, &p, &w1, 2).await;
    // The first engine clears its cache: Q is gone from the index.
    pubs[0].send(vec![EngineEvent::Cleared]);
    wait_held(&http, &q, &w0, 0).await;
    assert_eq!(held(&http, &p, &w1).await, 2);
    assert!(node.alive());
}
