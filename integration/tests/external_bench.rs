//! What the external-engine path costs: the same llama.cpp server called
//! directly, and through our gateway and a worker fronting it, side by
//! side in one run, at concurrency 1 and 8. TTFT and ITL p50/p99 for each
//! (BENCHMARKS.md, "External engines"). Concurrency 8 runs three ways:
//! bursts of 8 streams released together, 8 clients in a closed loop, and
//! the same loop with a pause before each request. A benchmark, not a
//! test:
//!
//! ```text
//! DYNAMO_LLAMA_SERVER=$(scripts/build_llama_server.sh) cargo test --release \
//!   -p dynamo-integration --test external_bench -- --ignored --nocapture
//! ```

use dynamo_integration::llama::Server;
use dynamo_integration::*;
use futures::StreamExt;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const MAX_TOKENS: u32 = 32;

/// One stream as the client saw it.
struct Timed {
    /// First token, ms after sending.
    ttft: f64,
    /// Gaps between token events, ms.
    itl: Vec<f64>,
    /// From the last token event to the end of the stream, ms.
    tail: f64,
    /// Our path only: TTFT less the worker's own first-token time (its
    /// `timings.first_token_ms`, from receiving the request to the
    /// engine's first token): what the gateway, router, bus and return
    /// path took. A lower bound of what our path adds: the worker's own
    /// work (the engine's request, its HTTP call) is inside that time.
    path: Option<f64>,
}

/// Arrival times of one stream's token events.
async fn timed(client: &reqwest::Client, url: &str, body: &Value, direct: bool) -> Timed {
    let t0 = Instant::now();
    let r = client.post(url).json(body).send().await.expect("request");
    assert_eq!(r.status().as_u16(), 200);
    let mut s = r.bytes_stream();
    let mut buf = String::new();
    let mut at = Vec::new();
    let mut worker_first = None;
    while let Some(Ok(b)) = s.next().await {
        buf.push_str(&String::from_utf8_lossy(&b));
        while let Some(i) = buf.find("\n\n") {
            let ev: String = buf.drain(..i + 2).collect();
            let Some(data) = ev.trim().strip_prefix("data: ") else {
                continue;
            };
            let Ok(v) = serde_json::from_str::<Value>(data) else {
                continue;
            };
            let token = if direct {
                v["tokens"].as_array().is_some_and(|t| !t.is_empty())
            } else {
                v["choices"][0]["text"]
                    .as_str()
                    .is_some_and(|t| !t.is_empty())
            };
            if token {
                at.push(t0.elapsed().as_secs_f64() * 1e3);
            }
            if let Some(f) = v["timings"]["first_token_ms"].as_f64() {
                worker_first = Some(f);
            }
        }
    }
    let end = t0.elapsed().as_secs_f64() * 1e3;
    assert!(!at.is_empty(), "no tokens from {url}");
    Timed {
        ttft: at[0],
        itl: at.windows(2).map(|w| w[1] - w[0]).collect(),
        tail: end - at[at.len() - 1],
        path: worker_first.map(|f| at[0] - f),
    }
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Pins the calling thread (and so what it spawns) to `cpus`.
fn pin(cpus: std::ops::Range<usize>) {
    // SAFETY: a zeroed cpu_set_t is empty; the call reads only `set`.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for c in cpus {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

#[derive(Default)]
struct Samples {
    ttft: Vec<f64>,
    itl: Vec<f64>,
    tail: Vec<f64>,
    path: Vec<f64>,
}

impl Samples {
    fn add(&mut self, t: Timed) {
        self.ttft.push(t.ttft);
        self.itl.extend(t.itl);
        self.tail.push(t.tail);
        self.path.extend(t.path);
    }

    fn extend(&mut self, o: Samples) {
        self.ttft.extend(o.ttft);
        self.itl.extend(o.itl);
        self.tail.extend(o.tail);
        self.path.extend(o.path);
    }
}

/// Prints both paths' percentiles and what ours adds.
/// `verbose` adds each stream's end after its last token and our path's
/// share of TTFT.
fn report(conc: &str, direct: &mut Samples, gateway: &mut Samples, verbose: bool) {
    let row = |name: &str, s: &mut Samples| {
        let r = [
            pct(&mut s.ttft, 0.5),
            pct(&mut s.ttft, 0.99),
            pct(&mut s.itl, 0.5),
            pct(&mut s.itl, 0.99),
        ];
        println!(
            "{conc:<7} {name:<8} {:>9.2} {:>9.2} {:>9.2} {:>9.2}",
            r[0], r[1], r[2], r[3]
        );
        r
    };
    let d = row("direct", direct);
    let g = row("gateway", gateway);
    println!(
        "{conc:<7} {:<8} {:>+9.2} {:>+9.2} {:>+9.2} {:>+9.2}",
        "added",
        g[0] - d[0],
        g[1] - d[1],
        g[2] - d[2],
        g[3] - d[3]
    );
    assert!(d[0] > 0.0 && g[0] > 0.0);
    if verbose {
        println!(
            "{conc:<7} last token to end of stream p50: direct {:.2} ms, gateway {:.2} ms; our path's share of TTFT p50 {:.2} ms, p99 {:.2} ms",
            pct(&mut direct.tail, 0.5),
            pct(&mut gateway.tail, 0.5),
            pct(&mut gateway.path, 0.5),
            pct(&mut gateway.path, 0.99),
        );
    }
}

/// Builds a request body for a prompt and an output length.
type BodyFn = dyn Fn(&[u32], u32) -> Value;

/// Clients in the closed loop, and requests each sends per block.
const LOOP_CLIENTS: usize = 8;
const LOOP_REQUESTS: usize = 6;

/// One block of the closed loop: eight clients, each sending its next
/// request as soon as its last one ends. Output lengths vary from 16 to 47
/// tokens, a fixed hash of the block, client and request, so both paths
/// get the same sequence. Varied lengths spread the arrivals over the server's steps,
/// as real traffic does; in the rounds above all eight land together.
async fn closed_loop(
    client: &reqwest::Client,
    url: &str,
    prompts: &[Vec<u32>],
    body: &BodyFn,
    direct: bool,
    block: usize,
    think: bool,
) -> Samples {
    let runs = (0..LOOP_CLIENTS).map(|c| async move {
        let mut s = Samples::default();
        for k in 0..LOOP_REQUESTS {
            // A fixed hash of (block, client, request): the same lengths
            // and pauses on both paths.
            let h = ((block * 131 + c) * 31 + k) as u64;
            let h = h.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let n = 16 + (h >> 59) as u32; // 16..=47 tokens
            if think {
                // 0..128 ms, longer than a step here, so a request
                // arrives at any point of the server's step.
                let ms = (h >> 20) & 127;
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            let p = &prompts[(c + k) % prompts.len()];
            s.add(timed(client, url, &body(p, n), direct).await);
        }
        s
    });
    let mut all = Samples::default();
    for s in futures::future::join_all(runs).await {
        all.extend(s);
    }
    all
}

// One thread: the client runs where it is pinned.
#[tokio::test]
#[ignore = "benchmark: make bench"]
async fn external_overhead() {
    // With EXTERNAL_BENCH_PIN=1 the server gets core 0 to itself, and NATS,
    // the node and the client share the others: what our path costs when
    // it does not take CPU from the engine (engines run on GPUs).
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pinned = std::env::var("EXTERNAL_BENCH_PIN").is_ok_and(|v| v == "1") && cores >= 2;
    if pinned {
        pin(0..1);
    }
    let server = Server::start_with(8).await;
    if pinned {
        pin(1..cores);
    }
    let nats = Nats::start();
    let port = free_port();
    let extra = format!(
        "[[workers]]\ncount = 1\nengine = \"llamacpp\"\nmodel = \"{MODEL}\"\n\n\
         [workers.external]\nurl = \"http://127.0.0.1:{}\"\nmax_inflight = 8\n",
        server.port
    );
    let mut node = Node::start(&node_config("n", &nats.url, Some(port), 0, &extra));
    let http = Http::new(port);
    http.wait_ready(1, &mut node).await;
    // A new connection for every request on both paths: llama.cpp's server
    // closes one after every stream (our worker's client tries again on a
    // new connection when that loses a request).
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .expect("client");
    let gateway_url = format!("http://127.0.0.1:{port}/v1/completions");
    let direct_url = server.url("/completion");
    let prompts: Vec<Vec<u32>> = (0..8)
        .map(|i| chat_tokens(&format!("Tell me fact number {i} about the ocean.")))
        .collect();
    // The body our worker sends for such a request, sent directly.
    let direct_body_n = |p: &[u32], n: u32| {
        json!({"prompt": p, "n_predict": n, "temperature": 0.0, "top_p": 1.0, "top_k": 0,
               "min_p": 0.0, "stream": true, "return_tokens": true, "cache_prompt": true,
               "ignore_eos": true})
    };
    let gateway_body_n = |p: &[u32], n: u32| {
        json!({"model": MODEL, "prompt": p, "max_tokens": n, "temperature": 0.0,
               "ignore_eos": true, "stream": true})
    };
    let direct_body = |p: &[u32]| direct_body_n(p, MAX_TOKENS);
    let gateway_body = |p: &[u32]| gateway_body_n(p, MAX_TOKENS);
    // Warm both paths (and the server's prompt cache) with every prompt.
    for p in &prompts {
        timed(&client, &direct_url, &direct_body(p), true).await;
        timed(&client, &gateway_url, &gateway_body(p), false).await;
    }
    let rounds: usize = std::env::var("EXTERNAL_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(24);
    // EXTERNAL_BENCH_VERBOSE=1 prints each round's first-token times.
    let verbose = std::env::var("EXTERNAL_BENCH_VERBOSE").is_ok_and(|v| v == "1");
    println!(
        "external engine overhead: llama-server (1 thread, 8 slots), paths interleaved{}",
        if pinned {
            ", server pinned to core 0, the rest to the other cores"
        } else {
            ""
        }
    );
    println!("  1, 8: {rounds} rounds of 1 or 8 streams of {MAX_TOKENS} tokens released together");
    println!("  8 loop: 8 clients in a closed loop, {} blocks per path of {LOOP_CLIENTS}x{LOOP_REQUESTS} streams, 16-47 tokens", rounds.div_ceil(4).max(2));
    println!("  8 think: the same, each request after a pause of 0-127 ms");
    println!(
        "{:<7} {:<8} {:>9} {:>9} {:>9} {:>9}",
        "conc", "path", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99"
    );
    for conc in [1usize, 8] {
        let mut direct = Samples::default();
        let mut gateway = Samples::default();
        for round in 0..rounds {
            // Alternate which path goes first, so neither always follows the other.
            for first in [round % 2 == 0, round % 2 != 0] {
                let runs = (0..conc).map(|i| {
                    let p = &prompts[(round + i) % prompts.len()];
                    let (url, body) = if first {
                        (&direct_url, direct_body(p))
                    } else {
                        (&gateway_url, gateway_body(p))
                    };
                    let client = client.clone();
                    async move { timed(&client, url, &body, first).await }
                });
                let out = futures::future::join_all(runs).await;
                if verbose && conc > 1 {
                    let mut t: Vec<f64> = out.iter().map(|t| t.ttft).collect();
                    t.sort_by(|a, b| a.total_cmp(b));
                    let t: Vec<String> = t.iter().map(|x| format!("{x:.1}")).collect();
                    println!(
                        "  round {round:>2} {:<8} TTFT ms: {}",
                        if first { "direct" } else { "gateway" },
                        t.join(" ")
                    );
                }
                let s = if first { &mut direct } else { &mut gateway };
                for t in out {
                    s.add(t);
                }
            }
        }
        report(&conc.to_string(), &mut direct, &mut gateway, verbose);
    }
    // Concurrency 8 as load tools mean it: eight clients in a closed loop,
    // sending at once ("8 loop") or after a pause ("8 think").
    let blocks = rounds.div_ceil(4).max(2);
    for think in [false, true] {
        let mut direct = Samples::default();
        let mut gateway = Samples::default();
        for b in 0..blocks {
            for first in [b % 2 == 0, b % 2 != 0] {
                let (url, body): (&str, &BodyFn) = if first {
                    (&direct_url, &direct_body_n)
                } else {
                    (&gateway_url, &gateway_body_n)
                };
                let s = closed_loop(&client, url, &prompts, body, first, b, think).await;
                let into = if first { &mut direct } else { &mut gateway };
                into.extend(s);
            }
        }
        report(
            if think { "8 think" } else { "8 loop" },
            &mut direct,
            &mut gateway,
            verbose,
        );
    }
    // Requests our worker sent twice because the server had closed the
    // connection it picked (the worker logs the count at powers of two).
    let retried = node
        .log_text()
        .lines()
        .rfind(|l| l.contains("a connection closed before any answer"))
        .map(str::to_string);
    println!(
        "worker: requests sent again on a new connection: {}",
        retried.as_deref().unwrap_or("none logged")
    );
    tokio::time::sleep(Duration::from_millis(10)).await;
}
