//! Turning a chosen [`Candidate`] into deployment files for our node
//! daemons, and the mocker's timing from the step-time model.
//!
//! The files run the deployment GPU-free: each replica becomes a mocker
//! worker whose KV pool, batch limits and step-time polynomials come from
//! the configurator, so the mocker and the configurator agree. They serve
//! the default model's tokenizer and chat template (SmolLM2-135M's), with
//! the configured model's timing and KV sizes. On GPUs the same layout
//! applies with a GPU engine in place of the mocker.
//!
//! Invariants: fitted polynomials reproduce the step model within a few
//! percent over the range they were fitted on (tested); every emitted
//! file parses as a node config (tested in `dynamo-node`).

use crate::memory::plan;
use crate::perf::StepModel;
use crate::search::{Candidate, Layout, Mode, Query};
use std::fmt::Write;

/// Least-squares `a·x² + b·x + c` through `points`.
pub fn fit_quadratic(points: &[(f64, f64)]) -> [f64; 3] {
    // Normal equations over x scaled to [0, 1] for conditioning.
    let scale = points.iter().map(|p| p.0.abs()).fold(1e-12, f64::max);
    let mut m = [[0.0f64; 4]; 3];
    for &(x, y) in points {
        let x = x / scale;
        let row = [x * x, x, 1.0];
        for i in 0..3 {
            for j in 0..3 {
                m[i][j] += row[i] * row[j];
            }
            m[i][3] += row[i] * y;
        }
    }
    // Gaussian elimination with partial pivoting.
    for col in 0..3 {
        let piv = (col..3)
            .max_by(|&a, &b| m[a][col].abs().total_cmp(&m[b][col].abs()))
            .unwrap_or(col);
        m.swap(col, piv);
        if m[col][col].abs() < 1e-300 {
            continue;
        }
        let pivot = m[col];
        for (r, row) in m.iter_mut().enumerate() {
            if r != col {
                let f = row[col] / pivot[col];
                for (x, p) in row.iter_mut().zip(pivot).skip(col) {
                    *x -= f * p;
                }
            }
        }
    }
    let sol = |i: usize| {
        if m[i][i].abs() < 1e-300 {
            0.0
        } else {
            m[i][3] / m[i][i]
        }
    };
    [sol(0) / (scale * scale), sol(1) / scale, sol(2)]
}

/// The mocker settings of one replica.
#[derive(Clone, Debug, PartialEq)]
pub struct MockerTiming {
    pub block_size: u32,
    pub num_blocks: u32,
    pub max_num_seqs: u32,
    pub max_num_batched_tokens: u32,
    pub kv_bytes_per_block: u32,
    /// `a·n² + b·n + c` ms for a step computing `n` new prompt tokens.
    pub prefill_ms: [f64; 3],
    /// `a·u² + b·u + c` ms for a decode step at KV utilisation `u`.
    pub decode_ms: [f64; 3],
}

/// Fits the mocker's polynomials to `sm`: prefill over 1 to
/// `max_num_tokens` new tokens; decode over KV utilisation, the running
/// sequences (`utilisation × KV tokens / (isl + osl/2)`, at most
/// `max_seqs`, at least one) at the mean context `isl + osl/2`.
pub fn mocker_timing(sm: &StepModel, q: &Query, max_seqs: u32) -> MockerTiming {
    const BLOCK: u32 = 16;
    let kv_tokens = plan(sm.model, sm.gpu, &sm.deployment)
        .map(|p| p.kv_tokens)
        .unwrap_or(0);
    let ctx = q.isl as f64 + q.osl as f64 / 2.0;
    let prefill: Vec<(f64, f64)> = (1..=32)
        .map(|i| {
            let n = (q.max_num_tokens as f64 * i as f64 / 32.0).max(1.0);
            (n, sm.prefill_us(1.0, n) / 1e3)
        })
        .collect();
    let decode: Vec<(f64, f64)> = (0..=20)
        .map(|i| {
            let u = i as f64 / 20.0;
            let seqs = (u * kv_tokens as f64 / ctx).clamp(1.0, max_seqs as f64);
            (u, sm.decode_us(seqs, ctx) / 1e3)
        })
        .collect();
    let kv_per_token = sm.model.kv_elements_per_token_layer() as f64
        * sm.model.layers as f64
        * sm.deployment.kv.bytes();
    MockerTiming {
        block_size: BLOCK,
        num_blocks: (kv_tokens / BLOCK as u64).clamp(1, u32::MAX as u64) as u32,
        max_num_seqs: max_seqs,
        max_num_batched_tokens: q.max_num_tokens,
        kv_bytes_per_block: (kv_per_token * BLOCK as f64).min(u32::MAX as f64) as u32,
        prefill_ms: fit_quadratic(&prefill),
        decode_ms: fit_quadratic(&decode),
    }
}

/// One emitted file.
#[derive(Clone, Debug, PartialEq)]
pub struct File {
    pub name: String,
    pub text: String,
}

fn layout_name(l: &Layout) -> String {
    if l.dpa {
        return format!(
            "data-parallel attention and expert parallel over {} GPUs",
            l.tp
        );
    }
    let ep = if l.ep { ", expert parallel" } else { "" };
    format!("tp{} pp{}{ep}", l.tp, l.pp)
}

fn worker(
    out: &mut String,
    role: Option<&str>,
    count: u32,
    layout: &Layout,
    t: &MockerTiming,
) -> std::fmt::Result {
    writeln!(out)?;
    writeln!(
        out,
        "# {count} replica(s) of {} GPU(s) each ({}).",
        layout.gpus(),
        layout_name(layout)
    )?;
    writeln!(out, "[[workers]]")?;
    writeln!(out, "count = {count}")?;
    writeln!(out, "engine = \"mocker\"")?;
    if let Some(role) = role {
        writeln!(out, "role = \"{role}\"")?;
    }
    writeln!(out, "model = \"smollm2-135m-instruct\"")?;
    writeln!(out, "model_path = \"auto\"")?;
    writeln!(out, "heartbeat_ms = 1000")?;
    writeln!(out, "stream_heartbeat_ms = 200")?;
    if role.is_some() {
        writeln!(out, "\n[workers.transfer]")?;
        writeln!(out, "provider = \"tcp;ofi_rxm\"")?;
    }
    writeln!(out, "\n[workers.mocker]")?;
    writeln!(out, "block_size = {}", t.block_size)?;
    writeln!(out, "num_blocks = {}", t.num_blocks)?;
    writeln!(out, "max_num_seqs = {}", t.max_num_seqs)?;
    writeln!(out, "max_num_batched_tokens = {}", t.max_num_batched_tokens)?;
    // A block's simulated bytes, capped so that moving blocks between
    // mocker workers on one machine stays affordable.
    writeln!(
        out,
        "kv_bytes_per_block = {}   # {} for this model",
        t.kv_bytes_per_block.min(1 << 20),
        t.kv_bytes_per_block
    )?;
    writeln!(
        out,
        "prefill_ms = [{:e}, {:e}, {:e}]",
        t.prefill_ms[0], t.prefill_ms[1], t.prefill_ms[2]
    )?;
    writeln!(
        out,
        "decode_ms = [{:e}, {:e}, {:e}]",
        t.decode_ms[0], t.decode_ms[1], t.decode_ms[2]
    )?;
    writeln!(out, "speedup = 1.0")
}

fn node(out: &mut String, id: &str, header: &str) -> std::fmt::Result {
    writeln!(out, "{header}")?;
    writeln!(out, "node_id = \"{id}\"")?;
    writeln!(out, "namespace = \"default\"")?;
    writeln!(out, "\n[nats]")?;
    writeln!(
        out,
        "url = \"nats://127.0.0.1:4222\"   # the NATS every node of the deployment shares"
    )
}

/// The node configs of `c`: `gateway.toml` (gateway and KV-aware router)
/// and the worker nodes (`workers.toml`, or `prefill.toml` and
/// `decode.toml`). `timing` gives each layout's mocker settings.
pub fn node_configs(
    c: &Candidate,
    summary: &str,
    timing: impl Fn(&Layout, u32) -> MockerTiming,
) -> Result<Vec<File>, std::fmt::Error> {
    let mut gw = String::new();
    node(
        &mut gw,
        "gateway",
        &format!("# Emitted by `dynamoctl configure`: {summary}\n# The gateway and KV-aware router node."),
    )?;
    writeln!(gw, "\n[gateway]\nlisten = \"127.0.0.1:8000\"\nrequest_timeout_ms = 600000\nliveness_timeout_ms = 800\nmax_migrations = 3")?;
    writeln!(
        gw,
        "\n[router]\npolicy = \"kv_aware\"\nworker_ttl_ms = 3000"
    )?;
    let mut files = Vec::new();
    match &c.mode {
        Mode::Aggregated {
            layout,
            replicas,
            batch,
        } => {
            let mut w = String::new();
            node(
                &mut w,
                "workers",
                &format!("# Emitted by `dynamoctl configure`: {summary}\n# Aggregated workers."),
            )?;
            worker(&mut w, None, *replicas, layout, &timing(layout, *batch))?;
            files.push(File {
                name: "workers.toml".into(),
                text: w,
            });
        }
        Mode::Disaggregated {
            prefill,
            prefill_replicas,
            prefill_batch,
            decode,
            decode_replicas,
            batch,
        } => {
            writeln!(gw, "min_remote_prefill_tokens = 256\nmax_prefill_queue = 8")?;
            let mut p = String::new();
            node(
                &mut p,
                "prefill",
                &format!("# Emitted by `dynamoctl configure`: {summary}\n# Prefill workers."),
            )?;
            worker(
                &mut p,
                Some("prefill"),
                *prefill_replicas,
                prefill,
                &timing(prefill, *prefill_batch),
            )?;
            let mut d = String::new();
            node(
                &mut d,
                "decode",
                &format!("# Emitted by `dynamoctl configure`: {summary}\n# Decode workers."),
            )?;
            worker(
                &mut d,
                Some("decode"),
                *decode_replicas,
                decode,
                &timing(decode, *batch),
            )?;
            files.push(File {
                name: "prefill.toml".into(),
                text: p,
            });
            files.push(File {
                name: "decode.toml".into(),
                text: d,
            });
        }
    }
    files.insert(
        0,
        File {
            name: "gateway.toml".into(),
            text: gw,
        },
    );
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calib::{Calibration, H200_JSON};
    use crate::memory::{Deployment, Dtype};
    use crate::perf::EngineProfile;
    use crate::Catalog;

    #[test]
    fn a_quadratic_comes_back_exactly() {
        let pts: Vec<(f64, f64)> = (0..50)
            .map(|i| {
                let x = i as f64 * 100.0;
                (x, 3e-7 * x * x + 0.02 * x + 5.0)
            })
            .collect();
        let [a, b, c] = fit_quadratic(&pts);
        assert!((a - 3e-7).abs() < 1e-12 && (b - 0.02).abs() < 1e-8 && (c - 5.0).abs() < 1e-6);
    }

    #[test]
    fn the_mocker_timing_follows_the_step_model() {
        let cat = Catalog::builtin().unwrap();
        let g = cat.gpu("H200").unwrap();
        let cal = Calibration::parse(H200_JSON, g).unwrap();
        let sm = StepModel {
            model: cat.model("Llama-3.1-8B").unwrap(),
            gpu: g,
            deployment: Deployment {
                tp: 1,
                pp: 1,
                weights: Dtype::Fp8,
                kv: Dtype::Fp8,
                memory: crate::memory::MemoryPolicy::DEFAULT,
                dp_attention: false,
                overlap: false,
                expert_parallel: false,
            },
            calib: &cal,
            profile: EngineProfile::current(&cal),
        };
        let q = Query::new(g, 8, 2000, 500, 1000.0, 50.0);
        let t = mocker_timing(&sm, &q, 128);
        let poly = |p: [f64; 3], x: f64| p[0] * x * x + p[1] * x + p[2];
        for n in [1024.0, 4096.0, 8192.0] {
            let want = sm.prefill_us(1.0, n) / 1e3;
            let got = poly(t.prefill_ms, n);
            assert!(
                (got / want - 1.0).abs() < 0.1,
                "prefill {n}: {got} vs {want}"
            );
        }
        // A full pool decodes 128 sequences (the cap) at the mean context.
        let want = sm.decode_us(128.0, 2250.0) / 1e3;
        let got = poly(t.decode_ms, 1.0);
        assert!((got / want - 1.0).abs() < 0.1, "decode: {got} vs {want}");
        assert_eq!(t.block_size, 16);
        // 32 layers × 2 × 8 KV heads × 128 × 1 byte = 64 KiB per token.
        assert_eq!(t.kv_bytes_per_block, 16 * 65536);
        assert!(t.num_blocks > 50_000, "{}", t.num_blocks);
    }
}
