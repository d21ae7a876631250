//! What a deployment needs in GPU memory: weights per GPU under tensor (TP)
//! and pipeline (PP) parallelism, KV bytes per token on each GPU, and how
//! many tokens of KV a replica holds.
//!
//! Conventions: TP splits every weight matrix and the KV heads (a GPU holds
//! `kv_heads / tp` of them, at least one: heads are replicated when TP
//! exceeds them; MLA's latent KV is replicated on every TP rank); PP splits
//! layers evenly. A fixed share of HBM is kept for activations and
//! runtime buffers.

use crate::spec::{Gpu, Model};
use thiserror::Error;

/// Storage type of weights or KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    Bf16,
    Fp8,
}

impl Dtype {
    pub fn bytes(self) -> f64 {
        match self {
            Dtype::Bf16 => 2.0,
            Dtype::Fp8 => 1.0,
        }
    }
}

/// How one replica is laid out.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Deployment {
    pub tp: u32,
    pub pp: u32,
    pub weights: Dtype,
    pub kv: Dtype,
    /// Share of HBM kept for activations and runtime buffers (0.1 = 10 %).
    pub reserve: f64,
    /// MoE layers shard whole experts across the TP group (expert
    /// parallelism) instead of splitting every expert's matrices; the same
    /// bytes per GPU either way.
    pub expert_parallel: bool,
}

impl Deployment {
    pub fn gpus(&self) -> u32 {
        self.tp * self.pp
    }
}

/// Memory of one replica, per GPU.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MemoryPlan {
    pub weight_bytes_per_gpu: f64,
    pub kv_bytes_per_token_per_gpu: f64,
    /// Tokens of KV the replica holds (all sequences together).
    pub kv_tokens: u64,
}

#[derive(Debug, Error, PartialEq)]
pub enum MemoryError {
    #[error("tp = {tp} must divide the model's {heads} attention heads")]
    TpHeads { tp: u32, heads: u32 },
    #[error("pp = {pp} must be between 1 and the model's {layers} layers")]
    PpLayers { pp: u32, layers: u32 },
    #[error("reserve = {0} must be in [0, 1)")]
    Reserve(f64),
    #[error(
        "the weights need {need_gb:.1} GB per GPU at tp={tp} pp={pp}, but only {have_gb:.1} GB of each GPU's HBM is usable"
    )]
    DoesNotFit {
        need_gb: f64,
        have_gb: f64,
        tp: u32,
        pp: u32,
    },
}

/// The memory plan of `model` on `gpu` laid out as `d`.
pub fn plan(model: &Model, gpu: &Gpu, d: &Deployment) -> Result<MemoryPlan, MemoryError> {
    if d.tp == 0 || !model.heads.is_multiple_of(d.tp) {
        return Err(MemoryError::TpHeads {
            tp: d.tp,
            heads: model.heads,
        });
    }
    if d.pp == 0 || d.pp > model.layers {
        return Err(MemoryError::PpLayers {
            pp: d.pp,
            layers: model.layers,
        });
    }
    if !(0.0..1.0).contains(&d.reserve) {
        return Err(MemoryError::Reserve(d.reserve));
    }
    let weight_bytes_per_gpu = model.params() as f64 * d.weights.bytes() / d.gpus() as f64;
    let usable = gpu.hbm_gb * 1e9 * (1.0 - d.reserve);
    if weight_bytes_per_gpu >= usable {
        return Err(MemoryError::DoesNotFit {
            need_gb: weight_bytes_per_gpu / 1e9,
            have_gb: usable / 1e9,
            tp: d.tp,
            pp: d.pp,
        });
    }
    let per_layer = model.kv_elements_per_token_layer() as f64 * d.kv.bytes();
    // Share of a token's KV one GPU holds.
    let tp_share = match model.mla {
        Some(_) => 1.0,
        None => (model.kv_heads / d.tp).max(1) as f64 / model.kv_heads as f64,
    };
    let layers_per_gpu = (model.layers as f64 / d.pp as f64).ceil();
    let kv_bytes_per_token_per_gpu = per_layer * layers_per_gpu * tp_share;
    let kv_tokens = ((usable - weight_bytes_per_gpu) / kv_bytes_per_token_per_gpu) as u64;
    Ok(MemoryPlan {
        weight_bytes_per_gpu,
        kv_bytes_per_token_per_gpu,
        kv_tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Catalog;

    fn dep(tp: u32, pp: u32, weights: Dtype) -> Deployment {
        Deployment {
            tp,
            pp,
            weights,
            kv: Dtype::Bf16,
            reserve: 0.1,
            expert_parallel: false,
        }
    }

    #[test]
    fn llama_70b_needs_several_h100s_in_bf16_and_kv_splits_by_kv_head() {
        let c = Catalog::builtin().unwrap();
        let (m, h100) = (c.model("Llama-3.1-70B").unwrap(), c.gpu("H100").unwrap());
        assert!(matches!(
            plan(m, h100, &dep(1, 1, Dtype::Bf16)),
            Err(MemoryError::DoesNotFit { .. })
        ));
        let p = plan(m, h100, &dep(4, 1, Dtype::Bf16)).unwrap();
        // 80 layers × 2 (K, V) × 2 of 8 KV heads × 128 × 2 bytes.
        assert_eq!(p.kv_bytes_per_token_per_gpu, 80.0 * 2.0 * 2.0 * 128.0 * 2.0);
        assert!((p.weight_bytes_per_gpu / 1e9 - 35.3).abs() < 0.2);
        // (72 GB usable − 35.3 GB of weights) / 80 KiB per token ≈ 448k tokens.
        assert!((440_000..460_000).contains(&p.kv_tokens), "{}", p.kv_tokens);
        // Beyond 8-way TP the KV heads are replicated: one per GPU.
        let p16 = plan(m, c.gpu("H200").unwrap(), &dep(16, 1, Dtype::Bf16)).unwrap();
        assert_eq!(p16.kv_bytes_per_token_per_gpu, 80.0 * 2.0 * 128.0 * 2.0);
        // PP halves the layers per GPU.
        let p8 = plan(m, h100, &dep(8, 2, Dtype::Fp8)).unwrap();
        assert_eq!(p8.kv_bytes_per_token_per_gpu, 40.0 * 2.0 * 128.0 * 2.0);
        assert!((p8.weight_bytes_per_gpu / 1e9 - 70.6 / 16.0).abs() < 0.1);
    }

    #[test]
    fn bad_layouts_are_clear_errors() {
        let c = Catalog::builtin().unwrap();
        let (m, g) = (c.model("SmolLM2-135M").unwrap(), c.gpu("L40S").unwrap());
        assert!(matches!(
            plan(m, g, &dep(2, 1, Dtype::Bf16)),
            Err(MemoryError::TpHeads { tp: 2, heads: 9 })
        ));
        assert!(matches!(
            plan(m, g, &dep(1, 31, Dtype::Bf16)),
            Err(MemoryError::PpLayers { .. })
        ));
        let mut d = dep(1, 1, Dtype::Bf16);
        d.reserve = 1.0;
        assert!(matches!(plan(m, g, &d), Err(MemoryError::Reserve(_))));
        let msg = plan(
            c.model("DeepSeek-V3").unwrap(),
            c.gpu("H100").unwrap(),
            &dep(8, 1, Dtype::Fp8),
        )
        .unwrap_err()
        .to_string();
        assert!(msg.contains("GB per GPU"), "{msg}");
    }
}
