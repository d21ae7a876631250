//! Llama-architecture weights read from a GGUF file: hyper-parameters from
//! the metadata, matrices kept in their quantized GGUF layout (one buffer
//! for the whole tensor data section), norms as f32.
//!
//! Invariants: every matrix has `cols % 32 == 0` and exactly
//! `rows · cols/32` blocks of its type inside the buffer; shapes agree with
//! the hyper-parameters (checked at load, so the forward pass never
//! indexes out of bounds).

use crate::quant::{QType, QK};
use bytes::Bytes;
use dynamo_model::gguf::{GgufError, GgufMetadata, TensorInfo, Value};
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum LoadError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("cannot read tensor data of {path}: {cause}")]
    Io { path: String, cause: std::io::Error },
    #[error("architecture {0:?} is not supported (llama is)")]
    Architecture(String),
    #[error("metadata key {0} is missing or not a number")]
    MissingKey(String),
    #[error("tensor {0} is missing")]
    MissingTensor(String),
    #[error("tensor {name}: {reason}")]
    BadTensor { name: String, reason: String },
}

/// Model hyper-parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub n_layers: usize,
    pub dim: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub ffn_dim: usize,
    pub vocab: usize,
    pub context: usize,
    pub rope_base: f32,
    pub norm_eps: f32,
}

impl ModelConfig {
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

/// A quantized matrix: `rows` rows of `cols` weights at `offset` in the buffer.
#[derive(Clone, Copy, Debug)]
pub struct QMatrix {
    pub qt: QType,
    pub rows: usize,
    pub cols: usize,
    offset: usize,
}

impl QMatrix {
    pub fn row_bytes(&self) -> usize {
        self.cols / QK * self.qt.block_bytes()
    }
    pub fn blocks_per_row(&self) -> usize {
        self.cols / QK
    }
}

pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub wq: QMatrix,
    pub wk: QMatrix,
    pub wv: QMatrix,
    pub wo: QMatrix,
    pub ffn_norm: Vec<f32>,
    pub w_gate: QMatrix,
    pub w_up: QMatrix,
    pub w_down: QMatrix,
}

pub struct Weights {
    pub cfg: ModelConfig,
    /// The tensor data section, possibly shared (read-only) with the
    /// memory a load landed in (see [`Weights::from_gguf_bytes`]).
    data: Bytes,
    pub embed: QMatrix,
    pub layers: Vec<LayerWeights>,
    pub out_norm: Vec<f32>,
    pub output: QMatrix,
}

impl Weights {
    /// Row `r` of `m` as raw blocks.
    #[inline]
    pub fn row(&self, m: &QMatrix, r: usize) -> &[u8] {
        let rb = m.row_bytes();
        &self.data[m.offset + r * rb..m.offset + (r + 1) * rb]
    }

    /// Bytes of weight data held.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    pub fn load(path: &Path) -> Result<Self, LoadError> {
        let meta = GgufMetadata::open(path)?;
        let p = path.display().to_string();
        let io = |source| LoadError::Io {
            path: p.clone(),
            cause: source,
        };
        let mut f = std::fs::File::open(path).map_err(io)?;
        let len = f.metadata().map_err(io)?.len();
        f.seek(SeekFrom::Start(meta.data_offset)).map_err(io)?;
        let mut data = Vec::with_capacity(len.saturating_sub(meta.data_offset) as usize);
        f.read_to_end(&mut data).map_err(io)?;
        Self::from_parts(&meta, data.into())
    }

    /// The same from a GGUF file's bytes in memory (a file loaded from the
    /// cluster), shared rather than copied: the engine keeps a reference to
    /// the tensor data, which nothing writes while it is shared. `name`
    /// names it in errors.
    pub fn from_gguf_bytes(bytes: Bytes, name: &str) -> Result<Self, LoadError> {
        let meta = GgufMetadata::read(&mut &bytes[..], name)?;
        let data = usize::try_from(meta.data_offset)
            .ok()
            .filter(|&o| o <= bytes.len())
            .map(|o| bytes.slice(o..))
            .ok_or_else(|| LoadError::Io {
                path: name.to_string(),
                cause: std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!(
                        "tensor data starts at {} but the file has {} bytes",
                        meta.data_offset,
                        bytes.len()
                    ),
                ),
            })?;
        Self::from_parts(&meta, data)
    }

    fn from_parts(meta: &GgufMetadata, data: Bytes) -> Result<Self, LoadError> {
        let arch = meta
            .get("general.architecture")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        if arch != "llama" {
            return Err(LoadError::Architecture(arch));
        }
        let num = |k: &str| -> Result<f64, LoadError> {
            let key = format!("llama.{k}");
            match meta.get(&key) {
                Some(Value::F64(v)) => Ok(*v),
                Some(v) => v
                    .as_u64()
                    .map(|v| v as f64)
                    .ok_or(LoadError::MissingKey(key)),
                None => Err(LoadError::MissingKey(key)),
            }
        };
        let dim = num("embedding_length")? as usize;
        let n_heads = num("attention.head_count")? as usize;
        let n_kv_heads = num("attention.head_count_kv").unwrap_or(n_heads as f64) as usize;
        let by_name = |name: &str| -> Result<&TensorInfo, LoadError> {
            meta.tensors
                .iter()
                .find(|t| t.name == name)
                .ok_or_else(|| LoadError::MissingTensor(name.into()))
        };
        let vocab = by_name("token_embd.weight")?
            .dims
            .get(1)
            .copied()
            .unwrap_or(0) as usize;
        let cfg = ModelConfig {
            n_layers: num("block_count")? as usize,
            dim,
            n_heads,
            n_kv_heads,
            head_dim: dim.checked_div(n_heads).unwrap_or(0),
            ffn_dim: num("feed_forward_length")? as usize,
            vocab,
            context: num("context_length")? as usize,
            rope_base: num("rope.freq_base").unwrap_or(10_000.0) as f32,
            norm_eps: num("attention.layer_norm_rms_epsilon").unwrap_or(1e-5) as f32,
        };
        if cfg.n_heads == 0
            || cfg.n_kv_heads == 0
            || !cfg.n_heads.is_multiple_of(cfg.n_kv_heads)
            || !cfg.dim.is_multiple_of(cfg.n_heads)
            || !cfg.head_dim.is_multiple_of(2)
        {
            return Err(LoadError::BadTensor {
                name: "attention".into(),
                reason: format!("unsupported head layout {cfg:?}"),
            });
        }
        let matrix = |name: &str, cols: usize, rows: usize| -> Result<QMatrix, LoadError> {
            let t = by_name(name)?;
            let bad = |reason: String| LoadError::BadTensor {
                name: name.into(),
                reason,
            };
            if t.dims != [cols as u64, rows as u64] {
                return Err(bad(format!(
                    "shape {:?}, expected [{cols}, {rows}]",
                    t.dims
                )));
            }
            let qt = match t.ggml_type {
                3 => QType::Q4_1,
                8 => QType::Q8_0,
                other => {
                    return Err(bad(format!(
                        "ggml type {other} is not supported (Q4_1, Q8_0 are)"
                    )))
                }
            };
            if !cols.is_multiple_of(QK) {
                return Err(bad(format!("{cols} columns is not a multiple of {QK}")));
            }
            let m = QMatrix {
                qt,
                rows,
                cols,
                offset: t.offset as usize,
            };
            if m.offset + rows * m.row_bytes() > data.len() {
                return Err(bad("data runs past the end of the file".into()));
            }
            Ok(m)
        };
        let vector = |name: &str, n: usize| -> Result<Vec<f32>, LoadError> {
            let t = by_name(name)?;
            let bad = |reason: String| LoadError::BadTensor {
                name: name.into(),
                reason,
            };
            if t.ggml_type != 0 || t.dims != [n as u64] {
                return Err(bad(format!(
                    "expected f32 [{n}], got type {} {:?}",
                    t.ggml_type, t.dims
                )));
            }
            let o = t.offset as usize;
            let bytes = data
                .get(o..o + 4 * n)
                .ok_or_else(|| bad("data runs past the end of the file".into()))?;
            Ok(bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect())
        };
        let kv = cfg.kv_dim();
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            layers.push(LayerWeights {
                attn_norm: vector(&n("attn_norm"), dim)?,
                wq: matrix(&n("attn_q"), dim, dim)?,
                wk: matrix(&n("attn_k"), dim, kv)?,
                wv: matrix(&n("attn_v"), dim, kv)?,
                wo: matrix(&n("attn_output"), dim, dim)?,
                ffn_norm: vector(&n("ffn_norm"), dim)?,
                w_gate: matrix(&n("ffn_gate"), dim, cfg.ffn_dim)?,
                w_up: matrix(&n("ffn_up"), dim, cfg.ffn_dim)?,
                w_down: matrix(&n("ffn_down"), cfg.ffn_dim, dim)?,
            });
        }
        let embed = matrix("token_embd.weight", dim, vocab)?;
        let output = match meta.tensors.iter().any(|t| t.name == "output.weight") {
            true => matrix("output.weight", dim, vocab)?,
            false => embed,
        };
        let out_norm = vector("output_norm.weight", dim)?;
        Ok(Weights {
            cfg,
            data,
            embed,
            layers,
            out_norm,
            output,
        })
    }
}
