//! GPUs and models as data (`data/*.toml`, built in), with their derived
//! sizes.

use serde::Deserialize;
use thiserror::Error;

/// One GPU type: dense peaks, memory and link bandwidth.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Gpu {
    pub name: String,
    /// Dense BF16 tensor throughput, TFLOP/s.
    pub bf16_tflops: f64,
    /// Dense FP8 tensor throughput, TFLOP/s.
    pub fp8_tflops: f64,
    /// Non-tensor (CUDA-core) FP32 throughput, TFLOP/s: the rate of
    /// kernels that do their arithmetic outside the tensor cores, as some
    /// engines' decode attention does.
    pub fp32_tflops: f64,
    /// HBM capacity, GiB (2^30 bytes): the memory the driver reports
    /// (`nvidia-smi --query-gpu=memory.total`), not the marketing size.
    pub hbm_gib: f64,
    /// HBM bandwidth, TB/s.
    pub hbm_tbps: f64,
    /// GPU-to-GPU bandwidth per direction (NVLink, or PCIe without it), GB/s.
    pub link_gbps: f64,
    /// Scale-out network bandwidth per GPU (its NIC), GB/s: what KV moves
    /// over between nodes.
    pub net_gbps: f64,
}

impl Gpu {
    /// HBM capacity in bytes.
    pub fn hbm_bytes(&self) -> f64 {
        self.hbm_gib * (1u64 << 30) as f64
    }
}

/// Mixture-of-experts layers of a model.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Moe {
    /// Leading layers with a dense MLP of `Model::ffn`.
    pub dense_layers: u32,
    /// Routed experts per MoE layer.
    pub experts: u32,
    /// Routed experts each token uses.
    pub active: u32,
    /// Shared experts every token uses.
    pub shared: u32,
    /// Intermediate size of one expert.
    pub expert_ffn: u64,
}

/// Multi-head latent attention (DeepSeek): low-rank Q and KV projections;
/// the KV cache holds `kv_lora + rope_dim` elements per token and layer.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Mla {
    pub q_lora: u64,
    pub kv_lora: u64,
    pub rope_dim: u64,
    pub nope_dim: u64,
    pub v_dim: u64,
}

/// A llama-style decoder (optionally MoE and/or MLA).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Model {
    pub name: String,
    /// Other names of the same shape (DeepSeek-R1 is DeepSeek-V3's).
    #[serde(default)]
    pub aliases: Vec<String>,
    pub layers: u32,
    pub hidden: u64,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u64,
    /// Intermediate size of the (dense) gated MLP.
    pub ffn: u64,
    pub vocab: u64,
    #[serde(default)]
    pub tied_embeddings: bool,
    #[serde(default)]
    pub moe: Option<Moe>,
    #[serde(default)]
    pub mla: Option<Mla>,
}

impl Model {
    /// Parameters of one layer's attention.
    fn attention_params(&self) -> u64 {
        let (h, d) = (self.hidden, self.head_dim);
        let heads = self.heads as u64;
        match &self.mla {
            Some(m) => {
                let q = h * m.q_lora + m.q_lora * heads * (m.nope_dim + m.rope_dim);
                let kv = h * (m.kv_lora + m.rope_dim) + m.kv_lora * heads * (m.nope_dim + m.v_dim);
                q + kv + heads * m.v_dim * h
            }
            None => {
                let kv = self.kv_heads as u64 * d;
                h * heads * d + 2 * h * kv + heads * d * h
            }
        }
    }

    fn mlp_params(&self, ffn: u64) -> u64 {
        3 * self.hidden * ffn
    }

    fn embedding_params(&self) -> u64 {
        let e = self.vocab * self.hidden;
        if self.tied_embeddings {
            e
        } else {
            2 * e
        }
    }

    /// All parameters (every expert counted).
    pub fn params(&self) -> u64 {
        self.count(false)
    }

    /// Parameters one token uses (routed experts: only the active ones).
    pub fn active_params(&self) -> u64 {
        self.count(true)
    }

    fn count(&self, active_only: bool) -> u64 {
        let layers = self.layers as u64;
        let attention = layers * self.attention_params();
        let mlp = match &self.moe {
            None => layers * self.mlp_params(self.ffn),
            Some(m) => {
                let dense = m.dense_layers as u64 * self.mlp_params(self.ffn);
                let routed = if active_only { m.active } else { m.experts } as u64;
                let per_layer = (routed + m.shared as u64) * self.mlp_params(m.expert_ffn)
                    + self.hidden * m.experts as u64;
                dense + (layers - m.dense_layers as u64) * per_layer
            }
        };
        attention + mlp + self.embedding_params()
    }

    /// Parameters of the routed experts (0 for a dense model).
    pub fn routed_expert_params(&self) -> u64 {
        match &self.moe {
            None => 0,
            Some(m) => {
                (self.layers - m.dense_layers) as u64
                    * m.experts as u64
                    * self.mlp_params(m.expert_ffn)
            }
        }
    }

    /// Under data-parallel attention: the parameters every GPU of the group
    /// holds whole (attention, dense MLPs, shared experts, routers), and
    /// those split across it (routed experts; embeddings by vocabulary).
    pub fn dp_attention_split(&self) -> (u64, u64) {
        let layers = self.layers as u64;
        let mut whole = layers * self.attention_params();
        match &self.moe {
            None => whole += layers * self.mlp_params(self.ffn),
            Some(m) => {
                let moe_layers = layers - m.dense_layers as u64;
                whole += m.dense_layers as u64 * self.mlp_params(self.ffn)
                    + moe_layers
                        * (m.shared as u64 * self.mlp_params(m.expert_ffn)
                            + self.hidden * m.experts as u64);
            }
        }
        (whole, self.params() - whole)
    }

    /// KV-cache elements one token adds in one layer.
    pub fn kv_elements_per_token_layer(&self) -> u64 {
        match &self.mla {
            Some(m) => m.kv_lora + m.rope_dim,
            None => 2 * self.kv_heads as u64 * self.head_dim,
        }
    }

    fn check(&self) -> Result<(), String> {
        for (field, v) in [
            ("layers", self.layers as u64),
            ("hidden", self.hidden),
            ("heads", self.heads as u64),
            ("kv_heads", self.kv_heads as u64),
            ("head_dim", self.head_dim),
            ("ffn", self.ffn),
            ("vocab", self.vocab),
        ] {
            if v == 0 {
                return Err(format!("{field} must be positive"));
            }
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(format!(
                "heads ({}) must be a multiple of kv_heads ({})",
                self.heads, self.kv_heads
            ));
        }
        if let Some(m) = &self.moe {
            if m.active == 0 || m.active > m.experts || m.dense_layers >= self.layers {
                return Err("moe: need 0 < active ≤ experts and dense_layers < layers".into());
            }
        }
        Ok(())
    }
}

#[derive(Debug, Error, PartialEq)]
pub enum SpecError {
    #[error("unknown model {name:?} (known: {known})")]
    UnknownModel { name: String, known: String },
    #[error("unknown GPU {name:?} (known: {known})")]
    UnknownGpu { name: String, known: String },
    #[error("{file}: {message}")]
    Bad { file: &'static str, message: String },
}

#[derive(Deserialize)]
struct GpuFile {
    gpu: Vec<Gpu>,
}

#[derive(Deserialize)]
struct ModelFile {
    model: Vec<Model>,
}

/// Every GPU and model the configurator knows.
#[derive(Clone, Debug)]
pub struct Catalog {
    pub gpus: Vec<Gpu>,
    pub models: Vec<Model>,
}

impl Catalog {
    /// The built-in specs (`configurator/data/`).
    pub fn builtin() -> Result<Self, SpecError> {
        Self::parse(
            include_str!("../data/gpus.toml"),
            include_str!("../data/models.toml"),
        )
    }

    /// Specs from TOML text (the built-in files' format).
    pub fn parse(gpus: &str, models: &str) -> Result<Self, SpecError> {
        let g: GpuFile = toml::from_str(gpus).map_err(|e| SpecError::Bad {
            file: "gpus.toml",
            message: e.to_string(),
        })?;
        let m: ModelFile = toml::from_str(models).map_err(|e| SpecError::Bad {
            file: "models.toml",
            message: e.to_string(),
        })?;
        for gpu in &g.gpu {
            let sizes = [
                gpu.bf16_tflops,
                gpu.fp8_tflops,
                gpu.fp32_tflops,
                gpu.hbm_gib,
                gpu.hbm_tbps,
                gpu.link_gbps,
                gpu.net_gbps,
            ];
            if sizes.iter().any(|v| v.is_nan() || *v <= 0.0) {
                return Err(SpecError::Bad {
                    file: "gpus.toml",
                    message: format!("{}: every figure must be positive", gpu.name),
                });
            }
        }
        for model in &m.model {
            model.check().map_err(|message| SpecError::Bad {
                file: "models.toml",
                message: format!("{}: {message}", model.name),
            })?;
        }
        Ok(Catalog {
            gpus: g.gpu,
            models: m.model,
        })
    }

    pub fn gpu(&self, name: &str) -> Result<&Gpu, SpecError> {
        self.gpus
            .iter()
            .find(|g| g.name.eq_ignore_ascii_case(name))
            .ok_or_else(|| SpecError::UnknownGpu {
                name: name.into(),
                known: names(self.gpus.iter().map(|g| &g.name)),
            })
    }

    pub fn model(&self, name: &str) -> Result<&Model, SpecError> {
        self.models
            .iter()
            .find(|m| {
                m.name.eq_ignore_ascii_case(name)
                    || m.aliases.iter().any(|a| a.eq_ignore_ascii_case(name))
            })
            .ok_or_else(|| SpecError::UnknownModel {
                name: name.into(),
                known: names(self.models.iter().map(|m| &m.name)),
            })
    }
}

fn names<'a>(it: impl Iterator<Item = &'a String>) -> String {
    it.map(String::as_str).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Derived parameter counts against the published totals.
    #[test]
    fn parameter_counts_match_the_published_sizes() {
        let c = Catalog::builtin().unwrap();
        let b = |name: &str| c.model(name).unwrap().params() as f64 / 1e9;
        let within = |got: f64, want: f64, tol: f64| (got / want - 1.0).abs() < tol;
        assert!(
            within(b("Llama-3.1-8B"), 8.03, 0.01),
            "{}",
            b("Llama-3.1-8B")
        );
        assert!(
            within(b("Llama-3.1-70B"), 70.6, 0.01),
            "{}",
            b("Llama-3.1-70B")
        );
        assert!(within(b("Qwen3-32B"), 32.8, 0.01), "{}", b("Qwen3-32B"));
        for (name, want) in [
            ("Llama-2-7B", 6.74),
            ("Llama-2-13B", 13.0),
            ("Llama-2-70B", 69.0),
        ] {
            assert!(within(b(name), want, 0.01), "{name}: {}", b(name));
        }
        assert!(
            within(b("SmolLM2-135M"), 0.1348, 0.01),
            "{}",
            b("SmolLM2-135M")
        );
        let ds = c.model("deepseek-v3").unwrap();
        assert!(
            within(ds.params() as f64 / 1e9, 671.0, 0.01),
            "{}",
            ds.params()
        );
        assert!(
            within(ds.active_params() as f64 / 1e9, 37.0, 0.03),
            "{}",
            ds.active_params()
        );
        assert_eq!(ds.kv_elements_per_token_layer(), 576);
        // The MoE and large models users ask about: total and active.
        for (name, total, active) in [
            ("Llama-3.1-405B", 405.8, 405.8),
            ("Mixtral-8x7B", 46.7, 12.9),
            ("Mixtral-8x22B", 140.6, 39.2),
            ("Qwen3-235B-A22B", 235.1, 22.2),
            ("Qwen3-30B-A3B", 30.5, 3.3),
            ("gpt-oss-120b", 116.8, 5.7),
            ("gpt-oss-20b", 20.9, 4.2),
        ] {
            let m = c.model(name).unwrap();
            let (t, a) = (m.params() as f64 / 1e9, m.active_params() as f64 / 1e9);
            assert!(within(t, total, 0.02), "{name}: {t}");
            assert!(within(a, active, 0.03), "{name}: {a}");
        }
        // Aliases name the same shape.
        assert_eq!(
            c.model("DeepSeek-R1").unwrap(),
            c.model("DeepSeek-V3").unwrap()
        );
        assert_eq!(c.model("llama-3.3-70b").unwrap().name, "Llama-3.1-70B");
        assert_eq!(
            c.model("Llama-3.1-8B")
                .unwrap()
                .kv_elements_per_token_layer(),
            2048
        );
    }

    #[test]
    fn unknown_names_and_bad_specs_are_clear_errors() {
        let c = Catalog::builtin().unwrap();
        match c.gpu("V100") {
            Err(SpecError::UnknownGpu { known, .. }) => assert!(known.contains("H200")),
            other => panic!("{other:?}"),
        }
        assert!(c.gpu("h100").is_ok());
        assert!(matches!(
            c.model("gpt-5"),
            Err(SpecError::UnknownModel { .. })
        ));
        let bad = "[[model]]\nname = \"x\"\nlayers = 2\nhidden = 8\nheads = 3\nkv_heads = 2\nhead_dim = 4\nffn = 8\nvocab = 10\n";
        let err = Catalog::parse("gpu = []", bad).unwrap_err();
        assert!(err.to_string().contains("multiple of kv_heads"), "{err}");
    }
}
