//! The search: every layout (TP, PP), batch and serving mode (aggregated,
//! or disaggregated with a P:D ratio) that fits a GPU budget, each
//! predicted for TTFT, ITL and throughput with the step-time model; kept
//! when it meets the SLA; summarised as a Pareto frontier (tokens/s per
//! user against tokens/s per GPU) and the best deployment per GPU budget.
//!
//! Serving models, per replica, in steady state:
//! - **Aggregated** (in-flight batching with chunked prefill): `batch`
//!   sequences decode together and each prompt is computed once over its
//!   sequence's `osl` steps, so an average step carries `batch` decode
//!   tokens and `batch·isl/osl` prompt tokens. ITL is that step; TTFT is
//!   half a step of waiting plus the steps that carry the prompt in chunks
//!   of `max_num_tokens`.
//! - **Disaggregated**: prefill replicas compute prompts in batches of up
//!   to `max_num_tokens` tokens; decode replicas run `batch` sequences.
//!   The request rate is the smaller of the two pools' rates (prefill kept
//!   at most 90% busy); TTFT is a prefill batch plus its M/D/1 queueing
//!   wait plus moving the prompt's KV at `kv_link_gbps`.
//!
//! P:D splits and replica counts are tried exhaustively up to 16 replicas
//! a side, then at powers of two and the most that fit.
//!
//! Invariants: every candidate fits in memory (weights plus the KV of all
//! its sequences, each charged its expected live context or, for engines
//! that reserve whole sequences or with `KvCharge::WorstCase`, its full
//! length) and in the engine's batch cap and step budget; a candidate meets the SLA only if both
//! its TTFT and ITL do; the frontier holds no candidate that another beats
//! on both axes.

use crate::calib::Calibration;
use crate::memory::{plan, Deployment, Dtype};
pub use crate::online::Load;

mod online;
use crate::perf::{EngineProfile, Step, StepModel};
use crate::spec::{Gpu, Model};
use serde::Serialize;
use thiserror::Error;

/// What to serve and what it must achieve.
#[derive(Clone, Debug, PartialEq)]
pub struct Query {
    /// GPUs available in all.
    pub gpus: u32,
    /// Prompt (input) and output lengths, tokens.
    pub isl: u32,
    pub osl: u32,
    /// Time to first token and inter-token latency targets, ms.
    pub ttft_ms: f64,
    pub itl_ms: f64,
    /// Storage of weights (and GEMM inputs) and of the KV cache.
    pub weights: Dtype,
    pub kv: Dtype,
    /// Largest TP group (GPUs joined by NVLink).
    pub max_tp: u32,
    /// Token budget of one step (prefill chunk plus decodes).
    pub max_num_tokens: u32,
    /// Bandwidth moving KV from prefill to decode replicas, GB/s.
    pub kv_link_gbps: f64,
    /// Largest data-parallel-attention, expert-parallel group of an MoE
    /// model (it may span nodes; its all-to-all leaves the node over the
    /// network). 1 turns such layouts off.
    pub max_ep: u32,
    /// How a sequence is charged KV when sizing batches.
    pub kv_charge: KvCharge,
    /// Online mode: the load offered to the whole deployment (a request
    /// rate, or closed-loop clients). Candidates are then predicted at
    /// that load, with its queueing, instead of at each batch size.
    pub load: Option<Load>,
}

/// How much KV a running sequence is charged when batches are sized.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KvCharge {
    /// Its expected live context, `isl + osl/2`: engines admit by free
    /// blocks and preempt when the pool runs out, and sequences at
    /// different points of their lives share it.
    Expected,
    /// Its whole `isl + osl` for its whole life (no preemption ever).
    WorstCase,
}

impl KvCharge {
    /// Tokens of KV charged per running sequence.
    pub fn tokens(self, isl: u32, osl: u32) -> u64 {
        match self {
            KvCharge::Expected => isl as u64 + (osl as u64).div_ceil(2),
            KvCharge::WorstCase => isl as u64 + osl as u64,
        }
    }
}

impl Query {
    /// Defaults for `gpu`: FP8 where it has FP8 tensor cores, a TP group of
    /// up to 8, 8192-token steps, KV between nodes at the GPU's network
    /// bandwidth.
    pub fn new(gpu: &Gpu, gpus: u32, isl: u32, osl: u32, ttft_ms: f64, itl_ms: f64) -> Self {
        let dtype = if gpu.fp8_tflops > gpu.bf16_tflops {
            Dtype::Fp8
        } else {
            Dtype::Bf16
        };
        Query {
            gpus,
            isl,
            osl,
            ttft_ms,
            itl_ms,
            weights: dtype,
            kv: dtype,
            max_tp: 8,
            max_num_tokens: 8192,
            kv_link_gbps: gpu.net_gbps,
            max_ep: 8,
            kv_charge: KvCharge::Expected,
            load: None,
        }
    }
}

#[derive(Debug, Error, PartialEq)]
pub enum SearchError {
    #[error("{load} saturates every deployment of {model} on {gpus} × {gpu}: no layout serves it without an unbounded queue")]
    Saturated {
        load: String,
        model: String,
        gpu: String,
        gpus: u32,
    },
    #[error("{field} must be positive (got {value})")]
    NotPositive { field: &'static str, value: f64 },
    #[error("{field} = {value} is more than this search plans for ({most})")]
    TooLarge {
        field: &'static str,
        value: f64,
        most: f64,
    },
    #[error(
        "{gpus} × {gpu} cannot hold {model}: its weights need at least {need} GPUs (tp × pp) with room for KV"
    )]
    TooFewGpus {
        model: String,
        gpu: String,
        gpus: u32,
        need: u32,
    },
    #[error(
        "{gpus} × {gpu} hold {model}'s weights but not the KV cache of one sequence of {tokens} tokens (ISL + OSL): at most {most} fit beside the weights; shorten the sequence or add GPUs"
    )]
    SequenceTooLong {
        model: String,
        gpu: String,
        gpus: u32,
        tokens: u64,
        most: u64,
    },
    #[error(
        "no deployment of {model} on {gpus} × {gpu} meets TTFT ≤ {ttft_ms} ms and ITL ≤ {itl_ms} ms; best reachable: TTFT {best_ttft_ms:.0} ms, ITL {best_itl_ms:.1} ms (not necessarily together)"
    )]
    ImpossibleSla {
        model: String,
        gpu: String,
        gpus: u32,
        ttft_ms: f64,
        itl_ms: f64,
        best_ttft_ms: f64,
        best_itl_ms: f64,
    },
}

/// One replica's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Layout {
    pub tp: u32,
    pub pp: u32,
    /// MoE layers use expert parallelism across the TP group.
    pub ep: bool,
    /// Attention is data-parallel across the group (`tp` GPUs), and the
    /// experts are spread across it.
    #[serde(default)]
    pub dpa: bool,
}

impl Layout {
    pub fn gpus(&self) -> u32 {
        self.tp * self.pp
    }
}

/// How a candidate serves.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum Mode {
    Aggregated {
        layout: Layout,
        replicas: u32,
        batch: u32,
    },
    Disaggregated {
        prefill: Layout,
        prefill_replicas: u32,
        /// Prompts per prefill step.
        prefill_batch: u32,
        decode: Layout,
        decode_replicas: u32,
        batch: u32,
    },
}

/// One deployment and its predicted service.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Candidate {
    #[serde(flatten)]
    pub mode: Mode,
    pub gpus: u32,
    pub ttft_ms: f64,
    pub itl_ms: f64,
    /// Output tokens/s each sequence sees (1000 / ITL).
    pub tokens_per_s_per_user: f64,
    /// Output tokens/s of the whole deployment over its GPUs.
    pub tokens_per_s_per_gpu: f64,
    pub meets_sla: bool,
}

impl Candidate {
    pub fn tokens_per_s(&self) -> f64 {
        self.tokens_per_s_per_gpu * self.gpus as f64
    }

    /// A short description: `agg 4×(tp2) b64` or `disagg 2×(tp1):3×(tp4) b128`.
    pub fn label(&self) -> String {
        let l = |x: &Layout| {
            if x.dpa {
                return format!("dep{}", x.tp);
            }
            let mut s = format!("tp{}", x.tp);
            if x.pp > 1 {
                s += &format!("pp{}", x.pp);
            }
            if x.ep {
                s += "ep";
            }
            s
        };
        match &self.mode {
            Mode::Aggregated {
                layout,
                replicas,
                batch,
            } => format!("agg {replicas}×{} b{batch}", l(layout)),
            Mode::Disaggregated {
                prefill,
                prefill_replicas,
                decode,
                decode_replicas,
                batch,
                ..
            } => format!(
                "disagg {prefill_replicas}×{} : {decode_replicas}×{} b{batch}",
                l(prefill),
                l(decode)
            ),
        }
    }
}

/// Everything the search found.
#[derive(Clone, Debug, Serialize)]
pub struct Outcome {
    /// Candidates meeting the SLA, best tokens/s per GPU first.
    pub feasible: Vec<Candidate>,
    /// The feasible candidates no other beats on both tokens/s per user and per GPU.
    pub frontier: Vec<Candidate>,
    /// For budgets of 1, 2, 4, … GPUs up to the query's: the feasible
    /// deployment with the most tokens/s within that many GPUs.
    pub best_per_budget: Vec<(u32, Candidate)>,
    /// Candidates evaluated (feasible or not).
    pub evaluated: usize,
}

/// An aggregated replica's predicted behaviour at one batch size.
#[derive(Clone, Copy, Debug)]
struct Point {
    itl_ms: f64,
    ttft_ms: f64,
    /// Requests/s one replica completes.
    rate: f64,
}

struct Ctx<'a> {
    model: &'a Model,
    gpu: &'a Gpu,
    calib: &'a Calibration,
    profile: &'a EngineProfile,
    q: &'a Query,
}

impl Ctx<'_> {
    fn step_model(&self, l: Layout) -> StepModel<'_> {
        StepModel {
            model: self.model,
            gpu: self.gpu,
            deployment: self.deployment(l),
            calib: self.calib,
            profile: self.profile.clone(),
        }
    }

    fn deployment(&self, l: Layout) -> Deployment {
        deployment(self.q, self.profile, l)
    }

    /// The most sequences a replica of `l` holding `kv_tokens` runs.
    pub(super) fn max_batch(&self, l: Layout, kv_tokens: u64) -> u64 {
        max_batch_for(self.q, self.profile, l, kv_tokens)
    }

    /// Token budget of one step of a replica of `l`.
    pub(super) fn step_tokens(&self, l: Layout) -> u64 {
        step_tokens_for(self.q, l)
    }

    /// Layouts that hold the weights plus at least one full sequence:
    /// `(layout, KV tokens of a replica)`.
    fn layouts(&self) -> Vec<(Layout, u64)> {
        let seq = self.q.isl as u64 + self.q.osl as u64;
        let mut out = Vec::new();
        // Expert parallelism is a choice only for MoE models whose experts
        // split evenly over the TP group.
        let ep_choices = |tp: u32| match &self.model.moe {
            Some(moe) if tp > 1 && moe.experts.is_multiple_of(tp) => vec![false, true],
            _ => vec![false],
        };
        let mut shapes = Vec::new();
        for tp in [1, 2, 4, 8, 16] {
            for pp in [1, 2, 4, 8] {
                for ep in ep_choices(tp) {
                    if tp <= self.q.max_tp {
                        shapes.push(Layout {
                            tp,
                            pp,
                            ep,
                            dpa: false,
                        });
                    }
                }
            }
        }
        // Data-parallel attention over expert-parallel groups, within a
        // node and across nodes.
        if let Some(moe) = &self.model.moe {
            for g in [2, 4, 8, 16, 32, 64, 72] {
                // At least one whole expert per GPU.
                if g <= self.q.max_ep && g <= moe.experts {
                    shapes.push(Layout {
                        tp: g,
                        pp: 1,
                        ep: true,
                        dpa: true,
                    });
                }
            }
        }
        for l in shapes {
            if l.gpus() > self.q.gpus {
                continue;
            }
            if let Ok(p) = plan(self.model, self.gpu, &self.deployment(l)) {
                if p.seq_tokens >= seq {
                    out.push((l, p.kv_tokens));
                }
            }
        }
        out
    }

    /// Batch sizes to try for a replica of `l` holding `kv_tokens`: powers
    /// of two and the largest that fits ([`Self::max_batch`]).
    fn batches(&self, l: Layout, kv_tokens: u64) -> impl Iterator<Item = u32> {
        let most = self.max_batch(l, kv_tokens).min(u32::MAX as u64) as u32;
        let mut v: Vec<u32> = (0..16)
            .map(|i| 1u32 << i)
            .filter(move |b| *b <= most)
            .collect();
        if most > 0 && v.last() != Some(&most) {
            v.push(most);
        }
        v.into_iter()
    }

    fn aggregated(&self, l: Layout, batch: u32) -> Point {
        let sm = self.step_model(l);
        let (b, isl, osl) = (batch as f64, self.q.isl as f64, self.q.osl as f64);
        let ctx = isl + osl / 2.0;
        let step = sm
            .step(&Step {
                decode: b,
                decode_ctx: ctx,
                prefill: b * isl / osl,
                prefill_seqs: b / osl,
                prefill_past: 0.0,
            })
            .total();
        // A prompt's chunks share the step budget with the decodes.
        let room = (self.step_tokens(l) as f64 - b).max(1.0);
        let (chunks, chunk) = crate::online::prompt_chunks(isl, room);
        let with_chunk = sm
            .step(&Step {
                decode: b,
                decode_ctx: ctx,
                prefill: chunk,
                prefill_seqs: 1.0,
                prefill_past: crate::online::chunked_past(chunks, chunk),
            })
            .total();
        Point {
            itl_ms: step / 1e3,
            ttft_ms: self.profile.serving_ms + (step / 2.0 + chunks * with_chunk) / 1e3,
            rate: b / osl / (step * 1e-6),
        }
    }

    /// A prefill replica: (prompts per step, step time µs).
    fn prefill(&self, l: Layout) -> (u32, f64) {
        let n = (self.step_tokens(l) / self.q.isl as u64).clamp(1, u32::MAX as u64) as u32;
        (
            n,
            self.step_model(l).prefill_us(n as f64, self.q.isl as f64),
        )
    }

    /// A decode replica at `batch`: (ITL ms, requests/s). Its TTFT is the
    /// prefill pool's.
    fn decode(&self, l: Layout, batch: u32) -> (f64, f64) {
        let (isl, osl) = (self.q.isl as f64, self.q.osl as f64);
        let step = self.step_model(l).decode_us(batch as f64, isl + osl / 2.0);
        (step / 1e3, batch as f64 / osl / (step * 1e-6))
    }

    /// TTFT of a disaggregated deployment whose prefill pool, computing a
    /// batch in `p_us`, is busy a share `rho` of the time: the serving
    /// overhead, the batch and its M/D/1 wait, and the KV transfer.
    fn disagg_ttft_ms(&self, p_us: f64, rho: f64, transfer_ms: f64) -> f64 {
        self.profile.serving_ms + p_us / 1e3 * (1.0 + rho / (2.0 * (1.0 - rho))) + transfer_ms
    }

    /// A disaggregated candidate serving `rate` requests/s.
    #[allow(clippy::too_many_arguments)]
    fn disagg_candidate(
        &self,
        (prefill, prefill_replicas, prefill_batch): (Layout, u32, u32),
        (decode, decode_replicas, batch): (Layout, u32, u32),
        rate: f64,
        ttft_ms: f64,
        itl_ms: f64,
        sla: &dyn Fn(f64, f64) -> bool,
    ) -> Candidate {
        let gpus = prefill_replicas * prefill.gpus() + decode_replicas * decode.gpus();
        Candidate {
            mode: Mode::Disaggregated {
                prefill,
                prefill_replicas,
                prefill_batch,
                decode,
                decode_replicas,
                batch,
            },
            gpus,
            ttft_ms,
            itl_ms,
            tokens_per_s_per_user: 1e3 / itl_ms,
            tokens_per_s_per_gpu: rate * self.q.osl as f64 / gpus as f64,
            meets_sla: sla(ttft_ms, itl_ms),
        }
    }

    /// Seconds to move one prompt's KV from a prefill to a decode replica.
    fn transfer_s(&self) -> f64 {
        let per_token = self.model.kv_elements_per_token_layer() as f64
            * self.model.layers as f64
            * self.q.kv.bytes();
        per_token * self.q.isl as f64 / (self.q.kv_link_gbps * 1e9)
    }
}

fn check(q: &Query) -> Result<(), SearchError> {
    for (field, value) in [
        ("gpus", q.gpus as f64),
        ("isl", q.isl as f64),
        ("osl", q.osl as f64),
        ("ttft_ms", q.ttft_ms),
        ("itl_ms", q.itl_ms),
        ("max_tp", q.max_tp as f64),
        ("max_num_tokens", q.max_num_tokens as f64),
        ("kv_link_gbps", q.kv_link_gbps),
        ("max_ep", q.max_ep as f64),
        (
            "rate or concurrency",
            match q.load {
                Some(Load::Rate(x)) | Some(Load::Concurrency(x)) => x,
                None => 1.0,
            },
        ),
    ] {
        if !value.is_finite() || value <= 0.0 {
            return Err(SearchError::NotPositive { field, value });
        }
    }
    for (field, value, most) in [
        ("gpus", q.gpus as f64, MAX_GPUS as f64),
        ("isl", q.isl as f64, MAX_TOKENS as f64),
        ("osl", q.osl as f64, MAX_TOKENS as f64),
    ] {
        if value > most {
            return Err(SearchError::TooLarge { field, value, most });
        }
    }
    Ok(())
}

/// Schedulers in a replica of `l`: each data-parallel attention rank runs
/// its own batch and step budget.
fn ranks(l: Layout) -> u64 {
    if l.dpa {
        l.tp as u64
    } else {
        1
    }
}

/// Token budget of one step of a replica of `l`.
fn step_tokens_for(q: &Query, l: Layout) -> u64 {
    q.max_num_tokens as u64 * ranks(l)
}

/// The most sequences a replica of `l` holding `kv_tokens` runs: its KV
/// pool at the engine's charge per sequence, the engine's cap per
/// scheduler, and the step budget (each decode brings `isl/osl` prompt
/// tokens).
fn max_batch_for(q: &Query, profile: &EngineProfile, l: Layout, kv_tokens: u64) -> u64 {
    let charge = if profile.reserves_whole_sequence {
        KvCharge::WorstCase
    } else {
        q.kv_charge
    };
    let per_seq = charge.tokens(q.isl, q.osl).max(1);
    let (isl, osl) = (q.isl as u64, q.osl as u64);
    let by_budget = step_tokens_for(q, l) * osl / (isl + osl);
    (kv_tokens / per_seq)
        .min(profile.max_batch as u64 * ranks(l))
        .min(by_budget.max(1))
}

/// The batch cap of one replica of `l` (what an emitted worker's
/// `max_num_seqs` should be); None when the layout does not fit.
pub fn batch_cap(
    model: &Model,
    gpu: &Gpu,
    profile: &EngineProfile,
    q: &Query,
    l: Layout,
) -> Option<u32> {
    let p = plan(model, gpu, &deployment(q, profile, l)).ok()?;
    Some(max_batch_for(q, profile, l, p.kv_tokens).min(u32::MAX as u64) as u32)
}

/// Keeps `c` in `best` if it meets the SLA where `best` does not, or has
/// more tokens/s per GPU at the same standing: one P:D split per layout
/// pair and batch.
pub(super) fn keep_better(best: &mut Option<Candidate>, c: Candidate) {
    let better = match best {
        None => true,
        Some(b) => (c.meets_sla, c.tokens_per_s_per_gpu) > (b.meets_sla, b.tokens_per_s_per_gpu),
    };
    if better {
        *best = Some(c);
    }
}

/// Replica counts to try up to `most`: every count to 16, then powers of
/// two, and `most` itself.
pub(super) fn replica_counts(most: u32) -> Vec<u32> {
    let mut v: Vec<u32> = (1..=most.min(16)).collect();
    let mut p = 32;
    while p < most {
        v.push(p);
        p *= 2;
    }
    if most > 16 {
        v.push(most);
    }
    v
}

/// Most GPUs one search plans for.
pub const MAX_GPUS: u32 = 4096;
/// Longest prompt or output one search plans for, tokens.
pub const MAX_TOKENS: u32 = 10_000_000;

/// The layout `l` of a replica as the step model and memory plan see it,
/// for the query's dtypes and the engine's memory setting; data-parallel
/// attention overlaps its all-to-all where the engine does.
pub fn deployment(q: &Query, profile: &EngineProfile, l: Layout) -> Deployment {
    Deployment {
        tp: l.tp,
        pp: l.pp,
        weights: q.weights,
        kv: q.kv,
        memory: profile.memory,
        expert_parallel: l.ep,
        dp_attention: l.dpa,
        overlap: l.dpa && profile.two_batch_overlap,
    }
}

/// Searches every deployment of `model` on `gpu` within the query's budget.
pub fn search(
    model: &Model,
    gpu: &Gpu,
    calib: &Calibration,
    profile: &EngineProfile,
    q: &Query,
) -> Result<Outcome, SearchError> {
    check(q)?;
    let cx = Ctx {
        model,
        gpu,
        calib,
        profile,
        q,
    };
    let layouts = cx.layouts();
    if layouts.is_empty() {
        // The layouts of the searched grid, and the longest sequence each
        // holds beside the weights (None: the weights alone do not fit).
        let grid: Vec<(Layout, Option<u64>)> = [1, 2, 4, 8, 16]
            .into_iter()
            .filter(|tp| *tp <= q.max_tp)
            .flat_map(|tp| {
                [1, 2, 4, 8].map(move |pp| Layout {
                    tp,
                    pp,
                    ep: false,
                    dpa: false,
                })
            })
            .map(|l| {
                let seq = plan(model, gpu, &cx.deployment(l))
                    .ok()
                    .map(|p| p.seq_tokens);
                (l, seq)
            })
            .collect();
        let tokens = q.isl as u64 + q.osl as u64;
        // The smallest that would hold the weights and one sequence (128
        // GPUs when none does).
        let need = grid
            .iter()
            .filter(|(_, seq)| seq.is_some_and(|s| s >= tokens))
            .map(|(l, _)| l.gpus())
            .min()
            .unwrap_or(128);
        // The budget holds the weights: what it cannot hold is the sequence.
        let most = grid
            .iter()
            .filter(|(l, _)| l.gpus() <= q.gpus)
            .filter_map(|(_, seq)| *seq)
            .max();
        if let Some(most) = most {
            return Err(SearchError::SequenceTooLong {
                model: model.name.clone(),
                gpu: gpu.name.clone(),
                gpus: q.gpus,
                tokens,
                most,
            });
        }
        return Err(SearchError::TooFewGpus {
            model: model.name.clone(),
            gpu: gpu.name.clone(),
            gpus: q.gpus,
            need: need.max(q.gpus + 1),
        });
    }
    let sla = |ttft: f64, itl: f64| ttft <= q.ttft_ms && itl <= q.itl_ms;
    let mut all = match q.load {
        Some(load) => cx.online(&layouts, load, &sla),
        None => Vec::new(),
    };

    // Aggregated: as many replicas of one layout as fit.
    for &(l, kv) in layouts.iter().filter(|_| q.load.is_none()) {
        let replicas = q.gpus / l.gpus();
        for batch in cx.batches(l, kv) {
            let p = cx.aggregated(l, batch);
            let gpus = replicas * l.gpus();
            all.push(Candidate {
                mode: Mode::Aggregated {
                    layout: l,
                    replicas,
                    batch,
                },
                gpus,
                ttft_ms: p.ttft_ms,
                itl_ms: p.itl_ms,
                tokens_per_s_per_user: 1e3 / p.itl_ms,
                tokens_per_s_per_gpu: p.rate * replicas as f64 * q.osl as f64 / gpus as f64,
                meets_sla: sla(p.ttft_ms, p.itl_ms),
            });
        }
    }

    // Disaggregated: a prefill layout, a decode layout and batch, and the
    // P:D split of the budget with the most tokens/s per GPU.
    let transfer_ms = cx.transfer_s() * 1e3;
    let prefills: Vec<(Layout, u32, f64)> = layouts
        .iter()
        .map(|&(l, _)| {
            let (n, us) = cx.prefill(l);
            (l, n, us)
        })
        .collect();
    for &(dl, kv) in layouts.iter().filter(|_| q.load.is_none()) {
        for batch in cx.batches(dl, kv) {
            let (d_itl_ms, d_rate) = cx.decode(dl, batch);
            for &(pl, n, p_us) in &prefills {
                let p_rate = n as f64 / (p_us * 1e-6);
                let mut best: Option<Candidate> = None;
                for pr in replica_counts(q.gpus / pl.gpus()) {
                    let left = q.gpus - pr * pl.gpus();
                    for dr in replica_counts(left / dl.gpus()) {
                        let rate = (dr as f64 * d_rate).min(0.9 * pr as f64 * p_rate);
                        let rho = rate / (pr as f64 * p_rate);
                        let ttft = cx.disagg_ttft_ms(p_us, rho, transfer_ms);
                        let c = cx.disagg_candidate(
                            (pl, pr, n),
                            (dl, dr, batch),
                            rate,
                            ttft,
                            d_itl_ms,
                            &sla,
                        );
                        keep_better(&mut best, c);
                    }
                }
                all.extend(best);
            }
        }
    }

    if all.is_empty() {
        if let Some(load) = q.load {
            return Err(SearchError::Saturated {
                load: match load {
                    Load::Rate(r) => format!("{r} requests/s"),
                    Load::Concurrency(c) => format!("{c} concurrent clients"),
                },
                model: model.name.clone(),
                gpu: gpu.name.clone(),
                gpus: q.gpus,
            });
        }
    }
    let evaluated = all.len();
    let mut feasible: Vec<Candidate> = all.iter().filter(|c| c.meets_sla).cloned().collect();
    if feasible.is_empty() {
        let best_ttft = all.iter().map(|c| c.ttft_ms).fold(f64::INFINITY, f64::min);
        let best_itl = all.iter().map(|c| c.itl_ms).fold(f64::INFINITY, f64::min);
        return Err(SearchError::ImpossibleSla {
            model: model.name.clone(),
            gpu: gpu.name.clone(),
            gpus: q.gpus,
            ttft_ms: q.ttft_ms,
            itl_ms: q.itl_ms,
            best_ttft_ms: best_ttft,
            best_itl_ms: best_itl,
        });
    }
    feasible.sort_by(|a, b| b.tokens_per_s_per_gpu.total_cmp(&a.tokens_per_s_per_gpu));
    let frontier = pareto(&feasible);
    let best_per_budget = budgets(q.gpus)
        .into_iter()
        .filter_map(|budget| {
            // The best deployment within `budget` GPUs: a candidate's
            // replicas scaled down to the budget where its unit fits
            // (offline), or a candidate within it (online: the load is
            // fixed, so fewer replicas would change every prediction).
            // Ties (online, every candidate serves the same load) go to
            // fewer GPUs, then to the shorter ITL.
            feasible
                .iter()
                .filter_map(|c| match q.load {
                    None => shrink(c, budget),
                    Some(_) => (c.gpus <= budget).then(|| c.clone()),
                })
                .max_by(|a, b| {
                    let (x, y) = (a.tokens_per_s(), b.tokens_per_s());
                    if (x - y).abs() > 1e-6 * x.max(y) {
                        x.total_cmp(&y)
                    } else {
                        b.gpus.cmp(&a.gpus).then(b.itl_ms.total_cmp(&a.itl_ms))
                    }
                })
                .map(|c| (budget, c))
        })
        .collect();
    Ok(Outcome {
        feasible,
        frontier,
        best_per_budget,
        evaluated,
    })
}

/// 1, 2, 4, … up to `gpus`, and `gpus` itself.
fn budgets(gpus: u32) -> Vec<u32> {
    let mut v: Vec<u32> = (0..).map(|i| 1u32 << i).take_while(|b| *b < gpus).collect();
    v.push(gpus);
    v
}

/// `c` cut down to at most `budget` GPUs, keeping its replica shape and
/// (for disaggregation) its P:D proportion; None when one unit does not fit.
fn shrink(c: &Candidate, budget: u32) -> Option<Candidate> {
    if c.gpus <= budget {
        return Some(c.clone());
    }
    let mut out = c.clone();
    match &mut out.mode {
        Mode::Aggregated {
            layout, replicas, ..
        } => {
            let r = budget / layout.gpus();
            if r == 0 {
                return None;
            }
            *replicas = r;
            out.gpus = r * layout.gpus();
        }
        Mode::Disaggregated {
            prefill,
            prefill_replicas,
            decode,
            decode_replicas,
            ..
        } => {
            // Scale both pools by the same factor (each at least one replica).
            let scale = budget as f64 / c.gpus as f64;
            let pr = ((*prefill_replicas as f64 * scale).floor() as u32).max(1);
            let dr = ((*decode_replicas as f64 * scale).floor() as u32).max(1);
            let gpus = pr * prefill.gpus() + dr * decode.gpus();
            if gpus > budget {
                return None;
            }
            // The rate follows the scarcer pool.
            let keep =
                (pr as f64 / *prefill_replicas as f64).min(dr as f64 / *decode_replicas as f64);
            let tokens = c.tokens_per_s() * keep;
            *prefill_replicas = pr;
            *decode_replicas = dr;
            out.gpus = gpus;
            out.tokens_per_s_per_gpu = tokens / gpus as f64;
        }
    }
    Some(out)
}

/// Candidates not beaten on both tokens/s per user and tokens/s per GPU,
/// fastest per user first.
pub fn pareto(cands: &[Candidate]) -> Vec<Candidate> {
    let mut v: Vec<&Candidate> = cands.iter().collect();
    v.sort_by(|a, b| {
        b.tokens_per_s_per_user
            .total_cmp(&a.tokens_per_s_per_user)
            .then(b.tokens_per_s_per_gpu.total_cmp(&a.tokens_per_s_per_gpu))
    });
    let mut out: Vec<Candidate> = Vec::new();
    let mut best_gpu = f64::NEG_INFINITY;
    for c in v {
        if c.tokens_per_s_per_gpu > best_gpu {
            best_gpu = c.tokens_per_s_per_gpu;
            out.push(c.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calib::H200_JSON;
    use crate::Catalog;

    fn run(model: &str, gpu: &str, gpus: u32, ttft: f64, itl: f64) -> Result<Outcome, SearchError> {
        run_q(model, gpu, |q| {
            q.gpus = gpus;
            q.ttft_ms = ttft;
            q.itl_ms = itl;
        })
    }

    #[test]
    fn feasible_candidates_meet_the_sla_and_the_frontier_is_undominated() {
        let out = run("Llama-3.1-70B", "H200", 16, 2000.0, 40.0).unwrap();
        assert!(out.evaluated > 100, "{}", out.evaluated);
        assert!(!out.feasible.is_empty());
        for c in &out.feasible {
            assert!(c.ttft_ms <= 2000.0 && c.itl_ms <= 40.0, "{c:?}");
            assert!(c.gpus <= 16);
        }
        for a in &out.frontier {
            assert!(!out
                .feasible
                .iter()
                .any(|b| b.tokens_per_s_per_user > a.tokens_per_s_per_user
                    && b.tokens_per_s_per_gpu > a.tokens_per_s_per_gpu));
        }
        // Budgets 1, 2, 4, 8, 16; a 70B model needs more than one H200 at
        // 2,500 tokens per sequence? No: FP8 fits one; every budget has a best.
        let budgets: Vec<u32> = out.best_per_budget.iter().map(|(b, _)| *b).collect();
        assert_eq!(budgets, vec![1, 2, 4, 8, 16]);
        for (b, c) in &out.best_per_budget {
            assert!(c.gpus <= *b);
        }
        // More GPUs never serve fewer tokens/s.
        let tps: Vec<f64> = out
            .best_per_budget
            .iter()
            .map(|(_, c)| c.tokens_per_s())
            .collect();
        assert!(tps.windows(2).all(|w| w[1] >= w[0] * 0.999), "{tps:?}");
    }

    #[test]
    fn a_tight_itl_prefers_more_tensor_parallelism() {
        let loose = run("Llama-3.1-70B", "H200", 8, 5000.0, 100.0).unwrap();
        let tight = run("Llama-3.1-70B", "H200", 8, 5000.0, 12.0).unwrap();
        let tp = |c: &Candidate| match &c.mode {
            Mode::Aggregated { layout, .. } => layout.tp,
            Mode::Disaggregated { decode, .. } => decode.tp,
        };
        assert!(tp(&tight.feasible[0]) >= tp(&loose.feasible[0]));
        assert!(tight.feasible[0].tokens_per_s_per_gpu <= loose.feasible[0].tokens_per_s_per_gpu);
    }

    fn run_q(model: &str, gpu: &str, f: impl FnOnce(&mut Query)) -> Result<Outcome, SearchError> {
        let c = Catalog::builtin().unwrap();
        let cal = Calibration::parse(H200_JSON, c.gpu("H200").unwrap()).unwrap();
        let g = c.gpu(gpu).unwrap();
        let mut q = Query::new(g, 16, 2000, 500, 5000.0, 100.0);
        f(&mut q);
        search(
            c.model(model).unwrap(),
            g,
            &cal,
            &EngineProfile::current(&cal),
            &q,
        )
    }

    #[test]
    fn online_mode_predicts_at_the_offered_load_with_its_queueing() {
        let light = run_q("Llama-3.1-8B", "H100", |q| {
            q.gpus = 8;
            q.load = Some(Load::Rate(1.0));
        })
        .unwrap();
        let heavy = run_q("Llama-3.1-8B", "H100", |q| {
            q.gpus = 8;
            q.load = Some(Load::Rate(60.0));
        })
        .unwrap();
        // The same rate is served; a heavier load needs more GPUs for the
        // same latency, and the best deployment's TTFT at light load is
        // about one prefill.
        let best = |o: &Outcome| o.best_per_budget.last().unwrap().1.clone();
        let (l, h) = (best(&light), best(&heavy));
        assert!((l.tokens_per_s() - 500.0).abs() < 1.0, "{l:?}");
        assert!((h.tokens_per_s() - 30_000.0).abs() < 30.0, "{h:?}");
        let smallest = |o: &Outcome| o.feasible.iter().map(|c| c.gpus).min().unwrap();
        assert!(smallest(&heavy) > smallest(&light));
        // Closed-loop clients: a deployment holds them with their latency.
        let closed = run_q("Llama-3.1-8B", "H100", |q| {
            q.gpus = 4;
            q.load = Some(Load::Concurrency(64.0));
        })
        .unwrap();
        assert!(!closed.feasible.is_empty());
        // Far more clients than any deployment holds: they queue, in
        // aggregated and disaggregated deployments alike.
        let flood = run_q("Llama-3.1-8B", "H100", |q| {
            q.gpus = 4;
            q.ttft_ms = 1e9;
            q.itl_ms = 1e4;
            q.load = Some(Load::Concurrency(50_000.0));
        })
        .unwrap();
        let disagg = |c: &Candidate| matches!(c.mode, Mode::Disaggregated { .. });
        assert!(flood.feasible.iter().any(disagg));
        assert!(flood.feasible.iter().any(|c| !disagg(c)));
        assert!(
            flood.feasible.iter().all(|c| c.ttft_ms > 10_000.0),
            "{:?}",
            flood.feasible[0]
        );
        // A load nothing sustains is a clear error.
        let e = run_q("Llama-3.1-70B", "H100", |q| {
            q.gpus = 4;
            q.load = Some(Load::Rate(1e6));
        })
        .unwrap_err();
        assert!(matches!(e, SearchError::Saturated { .. }), "{e}");
        assert!(e.to_string().contains("saturates"), "{e}");
    }

    #[test]
    fn moe_models_get_data_parallel_attention_across_nodes() {
        let out = run_q("DeepSeek-R1", "H200", |q| {
            q.gpus = 64;
            q.max_ep = 64;
            q.ttft_ms = 5000.0;
            q.itl_ms = 200.0;
        })
        .unwrap();
        let dep = |c: &Candidate| match &c.mode {
            Mode::Aggregated { layout, .. } => layout.dpa,
            Mode::Disaggregated {
                prefill, decode, ..
            } => prefill.dpa || decode.dpa,
        };
        assert!(out.feasible.iter().any(dep));
        // Some candidate spans nodes (a group of more than 8 GPUs).
        assert!(out.feasible.iter().any(|c| match &c.mode {
            Mode::Aggregated { layout, .. } => layout.dpa && layout.tp > 8,
            Mode::Disaggregated { decode, .. } => decode.dpa && decode.tp > 8,
        }));
        assert!(out.feasible.iter().any(|c| c.label().contains("dep")));
    }

    #[test]
    fn impossible_inputs_are_clear_errors() {
        let e = run("Llama-3.1-70B", "H200", 8, 1.0, 0.5).unwrap_err();
        assert!(matches!(e, SearchError::ImpossibleSla { .. }), "{e}");
        assert!(e.to_string().contains("best reachable"), "{e}");
        let e = run("DeepSeek-V3", "H100", 4, 5000.0, 100.0).unwrap_err();
        match &e {
            SearchError::TooFewGpus { need, .. } => assert!(*need >= 8, "{e}"),
            other => panic!("{other}"),
        }
        // The weights fit; a sequence of 10 M tokens does not.
        let e = run_q("Llama-3.1-70B", "H100", |q| q.isl = 10_000_000).unwrap_err();
        match &e {
            SearchError::SequenceTooLong { tokens, most, .. } => {
                assert!(*most > 0 && *most < *tokens, "{e}")
            }
            other => panic!("{other}"),
        }
        assert!(
            e.to_string().contains("hold Llama-3.1-70B's weights"),
            "{e}"
        );
        let e = run("Llama-3.1-8B", "H100", 0, 5000.0, 100.0).unwrap_err();
        assert!(matches!(e, SearchError::NotPositive { field: "gpus", .. }));
        let e = run("Llama-3.1-8B", "H100", MAX_GPUS + 1, 5000.0, 100.0).unwrap_err();
        assert!(
            matches!(e, SearchError::TooLarge { field: "gpus", .. }),
            "{e}"
        );
        let e = run("Llama-3.1-8B", "H100", 8, f64::INFINITY, 100.0).unwrap_err();
        assert!(
            matches!(
                e,
                SearchError::NotPositive {
                    field: "ttft_ms",
                    ..
                }
            ),
            "{e}"
        );
        let e = run_q("Llama-3.1-8B", "H100", |q| q.isl = u32::MAX).unwrap_err();
        assert!(
            matches!(e, SearchError::TooLarge { field: "isl", .. }),
            "{e}"
        );
        let e = run_q("Llama-3.1-8B", "H100", |q| {
            q.load = Some(Load::Concurrency(f64::INFINITY))
        })
        .unwrap_err();
        assert!(matches!(e, SearchError::NotPositive { .. }), "{e}");
    }
}
