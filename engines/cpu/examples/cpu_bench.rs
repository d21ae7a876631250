//! Throughput of the CPU engine on SmolLM2-135M-Instruct through the
//! `Engine` trait (scheduling and sampling included):
//! prefill of a 512-token prompt, batch-1 decode from an empty cache and
//! after 512 tokens, total decode with 8 parallel sequences, peak RSS.
//!
//! `cargo run --release -p dynamo-cpu-engine --example cpu_bench -- [threads]`

use dynamo_bus_schema::{RequestId, SamplingParams};
use dynamo_cpu_engine::{CpuEngine, CpuEngineConfig, CpuModelInfo, Model, Weights};
use dynamo_engine::{Engine, EngineEvent, EngineLimits, ResponseStream, ValidRequest};
use std::sync::Arc;
use std::time::Instant;

fn request(id: u128, prompt: Vec<u32>, max_tokens: u32) -> ValidRequest {
    let mut s = SamplingParams::greedy(max_tokens);
    s.ignore_eos = true;
    let limits = EngineLimits {
        context_length: 8192,
        vocab_size: 49152,
    };
    ValidRequest::from_parts(RequestId(id), prompt, &s, limits).expect("valid request")
}

/// Token arrival times of one stream.
async fn times(mut rx: ResponseStream) -> Vec<Instant> {
    let mut t = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            EngineEvent::Tokens(toks) => t.extend(toks.iter().map(|_| Instant::now())),
            EngineEvent::Finished { .. } => break,
            EngineEvent::Failed(e) => panic!("{e}"),
            EngineEvent::Started { .. } | EngineEvent::Cached { .. } => {}
        }
    }
    t
}

fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 1000 + (i * 7919 + seed * 104729) % 40000)
        .collect()
}

fn peak_rss_mib() -> f64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<f64>().ok())
        .map(|kb| kb / 1024.0)
        .unwrap_or(0.0)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let threads: u32 = std::env::args()
        .nth(1)
        .and_then(|t| t.parse().ok())
        .unwrap_or(2);
    let path = dynamo_model::locate_default_gguf().expect("model installed (make deps)");
    let model = Arc::new(Model::new(Weights::load(&path).expect("weights load")));
    let cfg = CpuEngineConfig {
        threads,
        num_blocks: 160,
        enable_prefix_caching: false,
        ..CpuEngineConfig::default()
    };
    let info = CpuModelInfo {
        block_size: 16,
        hash_salt: 0,
        eos_token_ids: vec![2],
    };
    let e = CpuEngine::start(cfg, model, info).expect("engine starts");
    let simd = dynamo_cpu_engine::quant::simd_available();
    println!("threads {threads}, avx2 kernels {simd}");

    // Warm-up.
    times(e.generate(request(0, prompt(0, 64), 8)).unwrap()).await;

    const RUNS: u128 = 5;
    let mut prefill = Vec::new();
    let mut empty = Vec::new();
    let mut after = Vec::new();
    let mut parallel = Vec::new();
    let decode = |t: &[Instant]| (t.len() - 1) as f64 / (t[t.len() - 1] - t[0]).as_secs_f64();
    for r in 0..RUNS {
        let id = 100 * (r + 1);
        let t0 = Instant::now();
        let t = times(e.generate(request(id, prompt(id as u32, 512), 1)).unwrap()).await;
        prefill.push(512.0 / (t[0] - t0).as_secs_f64());
        let t = times(
            e.generate(request(id + 1, prompt(id as u32 + 1, 1), 129))
                .unwrap(),
        )
        .await;
        empty.push(decode(&t));
        let t = times(
            e.generate(request(id + 2, prompt(id as u32 + 2, 512), 129))
                .unwrap(),
        )
        .await;
        after.push(decode(&t));
        let streams: Vec<_> = (0..8)
            .map(|i| {
                e.generate(request(id + 10 + i, prompt((id + i) as u32, 8), 128))
                    .unwrap()
            })
            .collect();
        let t0 = Instant::now();
        let tasks: Vec<_> = streams
            .into_iter()
            .map(|s| tokio::spawn(times(s)))
            .collect();
        let mut all = Vec::new();
        for t in tasks {
            all.push(t.await.expect("stream task"));
        }
        let last = all.iter().map(|t| t[t.len() - 1]).max().unwrap_or(t0);
        let tokens = all.iter().map(|t| t.len()).sum::<usize>() as f64;
        parallel.push(tokens / (last - t0).as_secs_f64());
    }
    let show = |name: &str, mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        println!(
            "{name:<28} median {:7.1} tok/s, best {:7.1} (runs {:.1?})",
            v[v.len() / 2],
            v[v.len() - 1],
            v
        );
    };
    show("prefill 512 tokens:", prefill);
    show("decode batch 1, empty:", empty);
    show("decode batch 1, after 512:", after);
    show("decode 8 parallel (total):", parallel);
    println!("peak RSS:                  {:7.1} MiB", peak_rss_mib());
}
