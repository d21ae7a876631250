//! `dynamo-cpu-engine`: a real engine on the CPU for llama-architecture GGUF
//! models (SmolLM2-135M-Instruct by default), behind the same
//! [`dynamo_engine::Engine`] trait as the mocker.
//!
//! - [`quant`]: Q4_1 / Q8_0 weight blocks, i8 activation blocks, AVX2 and
//!   scalar dot products (chosen at run time).
//! - [`pool`]: the fork-join thread pool of the forward pass.
//! - [`weights`]: GGUF tensors → matrices and norms.
//! - [`kv`]: the paged K/V store, blocks exportable/importable as bytes.
//! - [`model`]: the batched forward pass over paged K/V.
//! - [`reference`]: a straightforward contiguous-cache forward pass (tests).
//! - [`sampler`]: greedy / temperature / top-k / top-p with seeded draws.
//! - [`engine`]: the driver thread implementing [`dynamo_engine::Engine`].

pub mod engine;
pub mod kv;
pub mod model;
pub mod pool;
pub mod quant;
pub mod reference;
pub mod sampler;
pub mod weights;

pub use engine::{CpuEngine, CpuEngineConfig, CpuModelInfo, CpuStats, KvBlockData};
pub use model::Model;
pub use weights::Weights;
