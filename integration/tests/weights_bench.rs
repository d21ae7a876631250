//! Time to ready of a new CPU worker on a node without the model file,
//! from each source (issue 18's benchmark; BENCHMARKS.md, "Weights: time
//! to ready"). Real node daemons, real NATS, real libfabric endpoints.
//!
//! Two files: the 98 MB SmolLM2 GGUF, and the same file followed by
//! `WEIGHTS_BENCH_PAD_MIB` (default 2048) MiB of random bytes, a model the
//! CPU engine loads whole, so a 2 GiB file crosses every path and lands in
//! the engine. For each, two source nodes hold the file (one serving over
//! `tcp;ofi_rxm`, one over `shm`) and it is pushed to the in-cluster
//! cache. Then, `WEIGHTS_BENCH_ROUNDS` times (default 3), a new node with
//! one CPU worker starts, the content pinned (`model_sha256`), from:
//! - a local file with a cold page cache (its pages dropped with
//!   `posix_fadvise(DONTNEED)`), pinned, so hashed before use like every
//!   other path, and unpinned (trusted, not hashed);
//! - the cache (`DYNAMO_WEIGHTS_ORDER=cache`);
//! - a peer over `tcp;ofi_rxm`, and a peer over `shm`.
//!
//! Time to ready runs from the node's spawn to the gateway counting its
//! worker; "load" is the load the node logged (`weights: loaded and
//! verified`). The new node serves no one (`DYNAMO_WEIGHTS_SERVE=0`), so
//! each round reads from the same sources; it is stopped once ready, and
//! what it wrote is synced to disk before the next round.
//!
//! `cargo build --release --bins && cargo test --release -p
//! dynamo-integration --test weights_bench -- --ignored --nocapture`
//! (part of `make bench`).

use dynamo_integration::*;
use serde_json::Value;
use std::io::Write;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const PADDED: &str = "smollm2-padded";

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Drops the page cache's copy of `path`.
fn drop_cache(path: &Path) {
    let f = std::fs::File::open(path).expect("open");
    f.sync_all().expect("sync");
    // SAFETY: an advisory call on an open descriptor.
    unsafe {
        libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
    }
}

/// `src` followed by `mib` MiB of pseudo-random bytes (no two MiB alike).
fn padded(src: &Path, dst: &Path, mib: u64) {
    std::fs::copy(src, dst).expect("copy the model");
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(dst)
        .expect("open the copy");
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut block = vec![0u8; 1 << 20];
    for _ in 0..mib {
        for w in block.chunks_exact_mut(8) {
            // xorshift64
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            w.copy_from_slice(&x.to_le_bytes());
        }
        f.write_all(&block).expect("write padding");
    }
    f.sync_all().expect("sync");
}

fn worker(model: &str, path: Option<&Path>, engine: &str, pin: Option<&str>) -> String {
    let mut s = format!(
        "[[workers]]\ncount = 1\nengine = \"{engine}\"\nmodel = \"{model}\"\nheartbeat_ms = 500\n"
    );
    if let Some(p) = path {
        s.push_str(&format!("model_path = \"{}\"\n", p.display()));
    }
    if let Some(sha) = pin {
        s.push_str(&format!("model_sha256 = \"{sha}\"\n"));
    }
    match engine {
        "cpu" => s.push_str("\n[workers.cpu]\nthreads = 1\nnum_blocks = 128\n\n"),
        _ => s.push_str("\n[workers.mocker]\nspeedup = 0.0\n\n"),
    }
    s
}

/// Waits until both source nodes serve `model`, and the cache holds it;
/// answers its content hash.
async fn wait_sources(nats: &str, model: &str) -> String {
    let t0 = Instant::now();
    loop {
        let v = models_ls(nats);
        for m in v["models"].as_array().into_iter().flatten() {
            if m["model"] != model {
                continue;
            }
            let ready: Vec<&str> = m["sources"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|s| s["state"] == "ready")
                .filter_map(|s| s["node"].as_str())
                .collect();
            if ready.contains(&"src-tcp") && ready.contains(&"src-shm") && m["cached"] == true {
                return m["sha256"].as_str().expect("sha256").to_string();
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(600),
            "{model} never served by both sources and cached: {v}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Polls `/health` until it counts `n` workers; panics past `within`.
async fn wait_workers(
    http: &reqwest::Client,
    port: u16,
    n: u64,
    node: &mut Node,
    within: Duration,
) {
    let t0 = Instant::now();
    loop {
        if let Ok(r) = http
            .get(format!("http://127.0.0.1:{port}/health"))
            .send()
            .await
        {
            if let Ok(v) = r.json::<Value>().await {
                if v["workers"].as_u64() == Some(n) {
                    return;
                }
            }
        }
        assert!(
            t0.elapsed() < within,
            "{n} workers not seen within {within:?}:\n{}",
            node.log_text()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One way a new node gets the model.
struct Route {
    name: &'static str,
    env: Vec<(&'static str, String)>,
    local: bool,
    pinned: bool,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    v[v.len() / 2]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: make bench"]
async fn weights_time_to_ready() {
    let rounds = env_u64("WEIGHTS_BENCH_ROUNDS", 3).max(1) as usize;
    let pad = env_u64("WEIGHTS_BENCH_PAD_MIB", 2048);
    let nats = Nats::start();
    let files = tempfile::tempdir().expect("tempdir");
    let small = PathBuf::from(dynamo_integration::llama::gguf());
    let big = files.path().join("smollm2-padded.gguf");
    padded(&small, &big, pad);
    let models = [(MODEL, small.clone()), (PADDED, big.clone())];

    // Two source nodes, each holding both files; the first has the gateway.
    let port = free_port();
    let groups: String = models
        .iter()
        .map(|(m, p)| worker(m, Some(p), "mocker", None))
        .collect();
    let mut src_tcp = Node::start_with_env(
        &node_config("src-tcp", &nats.url, Some(port), 0, &groups),
        &[("DYNAMO_WEIGHTS_PROVIDER", "tcp;ofi_rxm")],
        &[],
    );
    let _src_shm = Node::start_with_env(
        &node_config("src-shm", &nats.url, None, 0, &groups),
        &[("DYNAMO_WEIGHTS_PROVIDER", "shm")],
        &[],
    );
    let http = reqwest::Client::new();
    wait_workers(&http, port, 4, &mut src_tcp, Duration::from_secs(120)).await;
    for (m, p) in &models {
        let p = p.display().to_string();
        assert_success(&dynamoctl(&nats.url, &["models", "push", &p, "--model", m]));
    }
    let mut shas = Vec::new();
    for (m, _) in &models {
        shas.push(wait_sources(&nats.url, m).await);
    }

    println!();
    println!("| file | source | time to ready (median of {rounds}) | ready rate | load (logged) | load rate |");
    println!("|---|---|---|---|---|---|");
    for (n, ((model, file), sha)) in models.iter().zip(&shas).enumerate() {
        let size = std::fs::metadata(file).expect("size").len();
        let paths = [
            Route {
                name: "local file, cold page cache, pinned (hashed)",
                env: vec![],
                local: true,
                pinned: true,
            },
            Route {
                name: "local file, cold page cache, not pinned",
                env: vec![],
                local: true,
                pinned: false,
            },
            Route {
                name: "in-cluster cache (object store)",
                env: vec![("DYNAMO_WEIGHTS_ORDER", "cache".into())],
                local: false,
                pinned: true,
            },
            Route {
                name: "peer over `tcp;ofi_rxm`",
                env: vec![
                    ("DYNAMO_WEIGHTS_ORDER", "peer".into()),
                    ("DYNAMO_WEIGHTS_PROVIDER", "tcp;ofi_rxm".into()),
                ],
                local: false,
                pinned: true,
            },
            Route {
                name: "peer over `shm`",
                env: vec![
                    ("DYNAMO_WEIGHTS_ORDER", "peer".into()),
                    ("DYNAMO_WEIGHTS_PROVIDER", "shm".into()),
                ],
                local: false,
                pinned: true,
            },
        ];
        for (k, path) in paths.iter().enumerate() {
            let (mut ready, mut load) = (Vec::new(), Vec::new());
            for round in 0..rounds {
                let dir = tempfile::tempdir().expect("tempdir");
                let local = dir.path().join("model.gguf");
                if path.local {
                    std::fs::copy(file, &local).expect("copy");
                    drop_cache(&local);
                }
                let group = worker(
                    model,
                    path.local.then_some(local.as_path()),
                    "cpu",
                    path.pinned.then_some(sha.as_str()),
                );
                let weights_dir = dir.path().join("weights").display().to_string();
                let manifests = dir.path().join("manifests").display().to_string();
                let mut env: Vec<(&str, &str)> = vec![
                    ("DYNAMO_MODEL_PACKAGE", "0"),
                    ("DYNAMO_WEIGHTS_SERVE", "0"),
                    ("DYNAMO_WEIGHTS_DIR", &weights_dir),
                    ("DYNAMO_MANIFEST_CACHE", &manifests),
                    ("DYNAMO_WEIGHTS_WAIT_S", "0"),
                ];
                env.extend(path.env.iter().map(|(k, v)| (*k, v.as_str())));
                let t0 = Instant::now();
                let mut b = Node::start_with_env(
                    &node_config(&format!("new-{n}-{k}-{round}"), &nats.url, None, 0, &group),
                    &env,
                    &["DYNAMO_MODEL_GGUF"],
                );
                wait_workers(&http, port, 5, &mut b, Duration::from_secs(300)).await;
                ready.push(t0.elapsed().as_secs_f64());
                let log = b.log_text();
                if !path.local {
                    let line = log
                        .lines()
                        .find(|l| l.contains("weights: loaded and verified"))
                        .unwrap_or_else(|| panic!("no load logged:\n{log}"));
                    let ms: f64 = line
                        .split_whitespace()
                        .find_map(|w| w.strip_prefix("ms="))
                        .and_then(|v| v.parse().ok())
                        .unwrap_or_else(|| panic!("no ms= in {line}"));
                    load.push(ms / 1000.0);
                    let want = if path.name.starts_with("peer") {
                        "peer src-"
                    } else {
                        "cache"
                    };
                    assert!(line.contains(want), "{want:?} not in {line}");
                }
                // A clean stop, once the node handles signals (just after its
                // worker registers): its worker leaves the registry at once.
                tokio::time::sleep(Duration::from_millis(500)).await;
                b.signal(libc::SIGTERM);
                assert_eq!(
                    b.wait(Duration::from_secs(60)),
                    Some(0),
                    "the new node's stop"
                );
                wait_workers(&http, port, 4, &mut src_tcp, Duration::from_secs(30)).await;
                // What the round wrote reaches the disk before the next one.
                // SAFETY: no preconditions.
                unsafe { libc::sync() };
            }
            let r = median(&mut ready);
            let gb = size as f64 / 1e9;
            let (l, lr) = if load.is_empty() {
                ("".to_string(), "".to_string())
            } else {
                let l = median(&mut load);
                (format!("{l:.3} s"), format!("{:.2} GB/s", gb / l))
            };
            println!(
                "| {:.0} MB | {} | {r:.3} s | {:.2} GB/s | {l} | {lr} |",
                size as f64 / 1e6,
                path.name,
                gb / r
            );
        }
    }
}
