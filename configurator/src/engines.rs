//! Engine profiles: what the GPU tables cannot see, per engine and
//! version (`data/engines.toml`, built in).
//!
//! A profile holds the engine's memory setting and batch cap (its
//! documented defaults), its kernel count per layer, and the constants
//! fitted to published figures of that engine: the fixed cost of a step,
//! the synchronisation cost of each collective beyond NCCL's own time, how
//! its GEMM and attention kernels compare with the calibration tables, the
//! rate of its decode attention's arithmetic, and the serving overhead an
//! online request pays before its first token.
//!
//! Invariants: every profile names the figures it was fitted on
//! (`fitted_on`, point ids of `data/published.toml`), and the validation
//! refuses a profile validated on a figure it was fitted on; every number
//! is finite and in range when loaded; lookups are case-insensitive and an
//! unknown name lists the known ones.

use crate::calib::Calibration;
use crate::memory::MemoryPolicy;
use serde::Deserialize;
use thiserror::Error;

/// The built-in profiles.
pub const ENGINES_TOML: &str = include_str!("../data/engines.toml");

/// Engine behaviour the GPU tables do not capture.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EngineProfile {
    /// Name on the command line (`vllm-0.10`, `trtllm-0.5`, …).
    pub name: String,
    /// `vllm`, `sglang`, `trtllm`, or `generic`.
    pub engine: String,
    /// The version whose defaults and figures the profile holds.
    pub version: String,
    /// Kernels per transformer layer besides GEMMs and attention (norms,
    /// rotary embedding, activation, residual adds, quantization).
    pub kernels_per_layer: f64,
    /// Cost of each of those kernels, µs (a graph launch in decode); 0
    /// takes the calibration's measured kernel cost.
    #[serde(default)]
    pub kernel_us: f64,
    /// Latency of one collective where no NCCL table covers the GPU, µs.
    pub allreduce_us: f64,
    /// Synchronisation cost of each collective on top of its transfer
    /// (rank skew, the engine's custom all-reduce barrier), µs. Fitted.
    pub sync_us: f64,
    /// Fixed cost of one step (scheduling, sampling, host sync), µs. Fitted.
    pub step_us: f64,
    /// Cost of each running sequence in a step beyond its GPU work
    /// (scheduling, sampling, output handling), µs. Fitted.
    #[serde(default)]
    pub seq_us: f64,
    /// Rank skew: the share of a step's compute each collective of a
    /// tensor-parallel group waits for its slowest rank, per unit of
    /// √(2 ln n) (the expected maximum of n ranks' jitter). Fitted.
    #[serde(default)]
    pub skew: f64,
    /// The engine's GEMM time over the calibrated GEMM time. Fitted.
    pub gemm_scale: f64,
    /// Where a GEMM is bandwidth-bound (decode-sized batches streaming the
    /// weights), its time scales by this ratio on top of `gemm_scale`;
    /// between the bounds, by a blend of how close the GEMM is to each.
    /// 1: both regimes alike. Fitted.
    #[serde(default = "unit")]
    pub gemm_bw_ratio: f64,
    /// The engine's grouped expert GEMMs over dense GEMMs of the same
    /// work (uneven tokens per expert, routing and permutation). Fitted.
    #[serde(default = "unit")]
    pub moe_scale: f64,
    /// The engine's attention time over the calibrated attention. Fitted.
    pub attention_scale: f64,
    /// Time of the engine's decode attention dot products (four FLOPs per
    /// query head, head dimension and token of context) over their time at
    /// the GPU's FP32 (CUDA-core) peak: 1 at the peak, 2 at half of it.
    /// The kernel takes the longer of that and its KV read. A GQA group
    /// sharing one KV read multiplies the arithmetic per byte, so large
    /// groups over short contexts become arithmetic-bound. 0: never the
    /// bound (tensor-core kernels). Not applied to MLA, whose decode
    /// kernels run on tensor cores. Fitted.
    #[serde(default)]
    pub decode_attention_fp32: f64,
    /// What an online request pays before its first step: HTTP,
    /// tokenization, scheduling, ms. Fitted on online figures.
    pub serving_ms: f64,
    /// Decode attention reads each KV head once for its whole GQA group;
    /// false for kernels that read it once per query head.
    pub gqa_shared_reads: bool,
    /// How the engine sizes its KV pool (its default setting).
    pub memory: MemoryPolicy,
    /// The engine's scheduler reserves a sequence's whole `isl + osl` of
    /// KV when it admits it (TensorRT-LLM's default
    /// `GUARANTEED_NO_EVICT`), rather than admitting by the blocks in use
    /// and preempting when the pool runs out (vLLM, SGLang).
    #[serde(default)]
    pub reserves_whole_sequence: bool,
    /// The engine's default cap on running sequences (per data-parallel
    /// attention rank, which schedules on its own).
    pub max_batch: u32,
    /// The engine's default token budget of one step (chunked prefill),
    /// per data-parallel attention rank.
    pub max_num_tokens: u32,
    /// Data-parallel-attention layouts overlap the experts' all-to-all
    /// with compute (two micro-batches in turn).
    #[serde(default)]
    pub two_batch_overlap: bool,
    /// Point ids of `data/published.toml` the fitted constants came from.
    #[serde(default)]
    pub fitted_on: Vec<String>,
    /// Where the defaults come from.
    #[serde(default)]
    pub source: String,
}

fn unit() -> f64 {
    1.0
}

#[derive(Debug, Error, PartialEq)]
pub enum EngineError {
    #[error("engines.toml: {0}")]
    Bad(String),
    #[error("unknown engine profile {name:?} (known: {known})")]
    Unknown { name: String, known: String },
}

#[derive(Deserialize)]
struct File {
    engine: Vec<EngineProfile>,
}

/// Every built-in profile, with kernel costs from `calib` where a profile
/// leaves them to the calibration.
pub fn profiles(calib: &Calibration) -> Result<Vec<EngineProfile>, EngineError> {
    parse(ENGINES_TOML, calib)
}

/// Profiles from TOML text (the built-in file's format).
pub fn parse(text: &str, calib: &Calibration) -> Result<Vec<EngineProfile>, EngineError> {
    let f: File = toml::from_str(text).map_err(|e| EngineError::Bad(e.to_string()))?;
    let mut out = f.engine;
    for p in &mut out {
        if p.kernel_us == 0.0 {
            p.kernel_us = calib.kernel_us;
        }
        for (field, v, lo, hi) in [
            ("kernels_per_layer", p.kernels_per_layer, 0.0, 1e3),
            ("kernel_us", p.kernel_us, 0.0, 1e3),
            ("allreduce_us", p.allreduce_us, 0.0, 1e4),
            ("sync_us", p.sync_us, 0.0, 1e4),
            ("step_us", p.step_us, 0.0, 1e6),
            ("seq_us", p.seq_us, 0.0, 1e3),
            ("skew", p.skew, 0.0, 1.0),
            ("gemm_scale", p.gemm_scale, 0.1, 10.0),
            ("gemm_bw_ratio", p.gemm_bw_ratio, 0.1, 10.0),
            ("moe_scale", p.moe_scale, 0.1, 10.0),
            ("attention_scale", p.attention_scale, 0.1, 10.0),
            ("decode_attention_fp32", p.decode_attention_fp32, 0.0, 100.0),
            ("serving_ms", p.serving_ms, 0.0, 1e4),
            ("memory.fraction", p.memory.fraction, 0.01, 1.0),
            ("memory.runtime_gib", p.memory.runtime_gib, 0.0, 1e3),
        ] {
            if !(v.is_finite() && v >= lo && v <= hi) {
                return Err(EngineError::Bad(format!(
                    "{}: {field} = {v} must be in [{lo}, {hi}]",
                    p.name
                )));
            }
        }
        if p.max_batch == 0 || p.max_num_tokens == 0 {
            return Err(EngineError::Bad(format!(
                "{}: max_batch and max_num_tokens must be positive",
                p.name
            )));
        }
    }
    Ok(out)
}

/// The built-in profile named `name` (case-insensitive).
pub fn profile(name: &str, calib: &Calibration) -> Result<EngineProfile, EngineError> {
    let all = profiles(calib)?;
    let known = all
        .iter()
        .map(|p| p.name.as_str())
        .collect::<Vec<_>>()
        .join(", ");
    all.iter()
        .find(|p| p.name.eq_ignore_ascii_case(name))
        .cloned()
        .ok_or(EngineError::Unknown {
            name: name.into(),
            known,
        })
}

impl EngineProfile {
    /// A generic current engine (CUDA graphs, GQA-aware decode attention,
    /// one-shot NVLink all-reduce): the `current` profile.
    pub fn current(calib: &Calibration) -> Self {
        profile("current", calib).expect("the built-in engines.toml has `current`")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calib::H200_JSON;
    use crate::Catalog;

    fn cal() -> Calibration {
        let c = Catalog::builtin().unwrap();
        Calibration::parse(H200_JSON, c.gpu("H200").unwrap()).unwrap()
    }

    #[test]
    fn builtin_profiles_load_and_unknown_names_list_the_known_ones() {
        let cal = cal();
        let all = profiles(&cal).unwrap();
        for engine in ["vllm", "sglang", "trtllm", "generic"] {
            assert!(all.iter().any(|p| p.engine == engine), "{engine}");
        }
        assert!(all.iter().all(|p| p.kernel_us > 0.0));
        let e = profile("tgi", &cal).unwrap_err().to_string();
        assert!(e.contains("current") && e.contains("trtllm-0.5"), "{e}");
        assert!(profile("TRTLLM-0.5", &cal).is_ok());
    }

    #[test]
    fn out_of_range_constants_name_the_field() {
        let cal = cal();
        let text = ENGINES_TOML.replacen("gemm_scale = ", "gemm_scale = 40.0 # ", 1);
        let e = parse(&text, &cal).unwrap_err().to_string();
        assert!(e.contains("gemm_scale"), "{e}");
    }
}
