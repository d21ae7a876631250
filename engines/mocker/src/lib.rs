//! `dynamo-mocker`: a simulated vLLM-like engine, a product feature for
//! capacity planning and scale tests.
//!
//! - [`core`]: one simulated step: the shared `dynamo_batcher` scheduler
//!   (paged blocks, prefix cache, continuous batching, chunked prefill,
//!   preemption, cancellation) priced by the timing model.
//! - [`config`]: the timing model (documented polynomials, see the README).
//! - [`tokens`]: deterministic output tokens (predictable in tests,
//!   continuation-stable for migration).
//! - [`engine`]: the async driver implementing [`dynamo_engine::Engine`].

pub mod config;
pub mod core;
pub mod engine;
pub mod tokens;

pub use config::MockerConfig;
pub use engine::{MockerEngine, MockerModel};
