//! `dynamo-gateway`: the OpenAI-compatible HTTP edge.
//!
//! Request path: parse the body ([`openai`]) → model preprocessor (chat
//! template + tokenizer, [`models`]) → validate into `ValidGenerate` → route
//! (router actor) → send to the worker and stream frames back
//! ([`generate`], [`inbox`]) → detokenize incrementally, apply stop strings
//! → JSON or SSE ([`handlers`]). Every failure becomes an OpenAI error
//! object through [`error::ApiError`], the one mapping to HTTP.

pub mod actor;
pub mod config;
pub mod error;
pub mod generate;
pub mod handlers;
pub mod inbox;
pub mod metrics;
pub mod models;
pub mod openai;
pub mod shared;

pub use actor::{GatewayActor, GatewayArgs, GatewayMsg};
pub use config::GatewayConfig;
