//! What a deployment needs in GPU memory: weights per GPU under tensor (TP)
//! and pipeline (PP) parallelism, KV bytes per token on each GPU, and how
//! many tokens of KV a replica holds.
//!
//! Conventions: TP splits every weight matrix and the KV heads (a GPU holds
//! `kv_heads / tp` of them, at least one: heads are replicated when TP
//! exceeds them; MLA's latent KV is replicated on every TP rank); PP splits
//! layers evenly; data-parallel attention keeps attention whole on every
//! GPU and splits the sequences instead. HBM is counted in GiB, as the
//! driver reports it, and the KV pool is what the engine's own memory
//! setting leaves ([`MemoryPolicy`]).

use crate::spec::{Gpu, Model};
use thiserror::Error;

/// Storage type of weights or KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    Bf16,
    Fp8,
    /// MXFP4 routed experts (4-bit values, one 8-bit scale per 32: 4.25
    /// bits), computed at the FP8 rate (Hopper has no FP4 tensor cores;
    /// its kernels dequantize), with every other weight in BF16, as
    /// MXFP4 checkpoints (gpt-oss) ship. KV is never FP4.
    Fp4,
}

impl Dtype {
    pub fn bytes(self) -> f64 {
        match self {
            Dtype::Bf16 => 2.0,
            Dtype::Fp8 => 1.0,
            Dtype::Fp4 => 0.53125,
        }
    }

    /// The type of the weights that are not routed experts.
    pub fn dense(self) -> Dtype {
        match self {
            Dtype::Fp4 => Dtype::Bf16,
            d => d,
        }
    }

    /// The type whose tensor-core rate and measured efficiencies apply.
    pub fn compute(self) -> Dtype {
        match self {
            Dtype::Fp4 => Dtype::Fp8,
            d => d,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::Fp8 => "fp8",
            Dtype::Fp4 => "fp4",
        }
    }

    /// Parses `bf16`, `fp8` or `fp4`.
    pub fn parse(s: &str) -> Option<Dtype> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" | "fp16" => Some(Dtype::Bf16),
            "fp8" => Some(Dtype::Fp8),
            "fp4" | "mxfp4" => Some(Dtype::Fp4),
            _ => None,
        }
    }
}

/// How an engine sizes its KV pool: what share of which memory it takes.
///
/// - vLLM (`gpu_memory_utilization`, 0.9): a share of the *total* memory for
///   weights, activations, CUDA graphs and the KV pool together.
/// - SGLang (`mem_fraction_static`): a share of the total for weights and
///   the KV pool; activations and graphs live in the rest.
/// - TensorRT-LLM (`free_gpu_memory_fraction`, 0.9): a share of the memory
///   *left free* after the weights and the runtime's buffers.
#[derive(Clone, Copy, Debug, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryPolicy {
    /// The engine's setting, in (0, 1].
    pub fraction: f64,
    /// The share is of the memory free after weights and runtime
    /// (TensorRT-LLM), not of the total (vLLM, SGLang).
    pub of_free: bool,
    /// Memory per GPU besides weights and KV that the share must cover:
    /// CUDA context, graphs, activation workspace, GiB.
    pub runtime_gib: f64,
}

impl MemoryPolicy {
    /// vLLM's default: 90% of the total, 2 GiB of it for activations and graphs.
    pub const DEFAULT: MemoryPolicy = MemoryPolicy {
        fraction: 0.9,
        of_free: false,
        runtime_gib: 2.0,
    };
}

/// How one replica is laid out.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Deployment {
    /// GPUs of the tensor-parallel group (with `dp_attention`: of the
    /// data-parallel attention and expert-parallel group, which may span
    /// nodes).
    pub tp: u32,
    pub pp: u32,
    pub weights: Dtype,
    pub kv: Dtype,
    /// How the engine sizes its KV pool.
    pub memory: MemoryPolicy,
    /// MoE layers shard whole experts across the TP group (expert
    /// parallelism) instead of splitting every expert's matrices; the same
    /// bytes per GPU either way.
    pub expert_parallel: bool,
    /// Attention runs data-parallel across the group (DeepSeek-style
    /// serving): every GPU holds the whole attention and only its own
    /// sequences' KV; routed experts are spread across the group.
    pub dp_attention: bool,
    /// Communication overlaps compute (two micro-batches in turn, as
    /// SGLang's and TensorRT-LLM's two-batch overlap do).
    pub overlap: bool,
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
    /// Tokens of KV one sequence may hold: all of `kv_tokens`, or with
    /// data-parallel attention one GPU's share.
    pub seq_tokens: u64,
}

#[derive(Debug, Error, PartialEq)]
pub enum MemoryError {
    #[error("tp = {tp} must divide the model's {heads} attention heads")]
    TpHeads { tp: u32, heads: u32 },
    #[error("pp = {pp} must be between 1 and the model's {layers} layers")]
    PpLayers { pp: u32, layers: u32 },
    #[error("memory fraction = {0} must be in (0, 1]")]
    Fraction(f64),
    #[error("data-parallel attention needs an MoE model and pp = 1 ({0})")]
    DpAttention(String),
    #[error(
        "the weights need {need_gib:.1} GiB per GPU at tp={tp} pp={pp}, but only {have_gib:.1} GiB of each GPU's HBM is usable"
    )]
    DoesNotFit {
        need_gib: f64,
        have_gib: f64,
        tp: u32,
        pp: u32,
    },
}

const GIB: f64 = (1u64 << 30) as f64;

/// The memory plan of `model` on `gpu` laid out as `d`.
pub fn plan(model: &Model, gpu: &Gpu, d: &Deployment) -> Result<MemoryPlan, MemoryError> {
    if d.dp_attention {
        if model.moe.is_none() || d.pp != 1 || d.tp == 0 {
            return Err(MemoryError::DpAttention(model.name.clone()));
        }
    } else if d.tp == 0 || !model.heads.is_multiple_of(d.tp) {
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
    let m = &d.memory;
    if !(m.fraction > 0.0 && m.fraction <= 1.0) {
        return Err(MemoryError::Fraction(m.fraction));
    }
    // Routed experts in the weights' type, the rest in its dense type.
    let experts = model.routed_expert_params() as f64;
    let (expert_bytes, dense_bytes) = (d.weights.bytes(), d.weights.dense().bytes());
    let weight_bytes_per_gpu = if d.dp_attention {
        let (whole, split) = model.dp_attention_split();
        whole as f64 * dense_bytes
            + ((split as f64 - experts) * dense_bytes + experts * expert_bytes) / d.tp as f64
    } else {
        ((model.params() as f64 - experts) * dense_bytes + experts * expert_bytes) / d.gpus() as f64
    };
    let hbm = gpu.hbm_bytes();
    let runtime = m.runtime_gib.max(0.0) * GIB;
    let kv_space = if m.of_free {
        m.fraction * (hbm - weight_bytes_per_gpu - runtime)
    } else {
        m.fraction * hbm - weight_bytes_per_gpu - runtime
    };
    if kv_space <= 0.0 {
        return Err(MemoryError::DoesNotFit {
            need_gib: weight_bytes_per_gpu / GIB,
            // What the weights may take before the pool would be empty.
            have_gib: (if m.of_free {
                hbm - runtime
            } else {
                hbm * m.fraction - runtime
            })
            .max(0.0)
                / GIB,
            tp: d.tp,
            pp: d.pp,
        });
    }
    let per_layer = model.kv_elements_per_token_layer() as f64 * d.kv.bytes();
    // Share of a token's KV one GPU holds.
    let tp_share = match (&model.mla, d.dp_attention) {
        (Some(_), _) | (_, true) => 1.0,
        (None, false) => (model.kv_heads / d.tp).max(1) as f64 / model.kv_heads as f64,
    };
    let layers_per_gpu = (model.layers as f64 / d.pp as f64).ceil();
    let kv_bytes_per_token_per_gpu = per_layer * layers_per_gpu * tp_share;
    let per_gpu = (kv_space / kv_bytes_per_token_per_gpu) as u64;
    let (kv_tokens, seq_tokens) = if d.dp_attention {
        (per_gpu * d.tp as u64, per_gpu)
    } else {
        (per_gpu, per_gpu)
    };
    Ok(MemoryPlan {
        weight_bytes_per_gpu,
        kv_bytes_per_token_per_gpu,
        kv_tokens,
        seq_tokens,
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
            memory: MemoryPolicy::DEFAULT,
            expert_parallel: false,
            dp_attention: false,
            overlap: false,
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
        // (0.9 × 79.6 GiB − 35.3 GB of weights − 2 GiB) / 80 KiB per token ≈ 482k tokens.
        assert!((475_000..490_000).contains(&p.kv_tokens), "{}", p.kv_tokens);
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
        d.memory.fraction = 1.5;
        assert!(matches!(plan(m, g, &d), Err(MemoryError::Fraction(_))));
        d.memory.fraction = 0.9;
        d.dp_attention = true;
        assert!(matches!(plan(m, g, &d), Err(MemoryError::DpAttention(_))));
        let msg = plan(
            c.model("DeepSeek-V3").unwrap(),
            c.gpu("H100").unwrap(),
            &dep(8, 1, Dtype::Fp8),
        )
        .unwrap_err()
        .to_string();
        assert!(msg.contains("GiB per GPU"), "{msg}");
    }

    #[test]
    fn the_engines_memory_setting_sizes_the_pool() {
        let c = Catalog::builtin().unwrap();
        let (m, h100) = (c.model("Llama-3.1-8B").unwrap(), c.gpu("H100").unwrap());
        let with = |memory| {
            plan(
                m,
                h100,
                &Deployment {
                    memory,
                    ..dep(1, 1, Dtype::Fp8)
                },
            )
            .unwrap()
            .kv_tokens as f64
        };
        // vLLM-style: 90% of 79.6 GiB, less 8 GB of weights and 2 GiB.
        let total = with(MemoryPolicy::DEFAULT);
        let want = (0.9 * 79.6 * GIB - 8.03e9 - 2.0 * GIB) / (32.0 * 2048.0 * 2.0);
        assert!((total / want - 1.0).abs() < 0.01, "{total} vs {want}");
        // TensorRT-LLM-style: 90% of what is free, so more of the card.
        let free = with(MemoryPolicy {
            of_free: true,
            ..MemoryPolicy::DEFAULT
        });
        let want = 0.9 * (79.6 * GIB - 8.03e9 - 2.0 * GIB) / (32.0 * 2048.0 * 2.0);
        assert!((free / want - 1.0).abs() < 0.01, "{free} vs {want}");
        assert!(free > total);
    }

    #[test]
    fn mxfp4_stores_only_the_routed_experts_at_four_bits() {
        let c = Catalog::builtin().unwrap();
        let (m, h100) = (c.model("gpt-oss-120b").unwrap(), c.gpu("H100").unwrap());
        let p = plan(m, h100, &dep(1, 1, Dtype::Fp4)).unwrap();
        let experts = m.routed_expert_params() as f64;
        let rest = m.params() as f64 - experts;
        assert!(experts / m.params() as f64 > 0.95);
        let want = experts * 0.53125 + rest * 2.0;
        assert!((p.weight_bytes_per_gpu / want - 1.0).abs() < 1e-9);
        // About 65 GB: one 80 GB card holds it, with room for KV.
        assert!((60e9..70e9).contains(&p.weight_bytes_per_gpu), "{p:?}");
        assert!(p.kv_tokens > 100_000, "{p:?}");
        // A dense model has no experts: FP4 leaves it in BF16.
        let l = c.model("Llama-3.1-8B").unwrap();
        let bf = plan(l, h100, &dep(1, 1, Dtype::Bf16)).unwrap();
        let f4 = plan(l, h100, &dep(1, 1, Dtype::Fp4)).unwrap();
        assert_eq!(bf.weight_bytes_per_gpu, f4.weight_bytes_per_gpu);
    }

    #[test]
    fn data_parallel_attention_keeps_attention_whole_and_splits_sequences() {
        let c = Catalog::builtin().unwrap();
        let (m, h200) = (c.model("DeepSeek-R1").unwrap(), c.gpu("H200").unwrap());
        let tp8 = plan(m, h200, &dep(8, 1, Dtype::Fp8)).unwrap();
        let dp8 = plan(
            m,
            h200,
            &Deployment {
                dp_attention: true,
                ..dep(8, 1, Dtype::Fp8)
            },
        )
        .unwrap();
        // Attention and the dense layers are replicated: more weight per GPU.
        assert!(dp8.weight_bytes_per_gpu > tp8.weight_bytes_per_gpu);
        // MLA's latent KV is replicated across TP ranks, but each
        // data-parallel rank holds only its own: far more tokens in all.
        assert!(dp8.kv_tokens > 5 * tp8.kv_tokens, "{dp8:?} vs {tp8:?}");
        assert_eq!(dp8.seq_tokens * 8, dp8.kv_tokens);
        // A group across nodes splits the experts further.
        let dp32 = plan(
            m,
            h200,
            &Deployment {
                dp_attention: true,
                ..dep(32, 1, Dtype::Fp8)
            },
        )
        .unwrap();
        assert!(dp32.weight_bytes_per_gpu < dp8.weight_bytes_per_gpu);
    }
}
