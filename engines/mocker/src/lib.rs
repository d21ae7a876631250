//! `dynamo-mocker`: a simulated vLLM-like engine, a product feature for
//! capacity planning and scale tests.
//!
//! - [`block_pool`]: paged KV blocks, prefix cache by sequence hash, LRU
//!   eviction of unreferenced blocks (tails first), exact KV events.
//! - [`core`]: continuous batching with `max_num_seqs` and
//!   `max_num_batched_tokens`, chunked prefill, preemption, cancellation.
//! - [`config`]: the timing model (documented polynomials, see the README).
//! - [`tokens`]: deterministic output tokens (predictable in tests,
//!   continuation-stable for migration).
//! - [`engine`]: the async driver implementing [`dynamo_engine::Engine`].

pub mod block_pool;
pub mod config;
pub mod core;
pub mod engine;
pub mod tokens;

pub use config::MockerConfig;
pub use engine::{MockerEngine, MockerModel};
