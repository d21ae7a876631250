//! `dynamo-gateway`: the OpenAI-compatible HTTP edge.
//!
//! Request path: parse the body ([`openai`], refusing options this server
//! does not implement, [`unsupported`]) → model preprocessor (chat
//! template + tokenizer, [`models`]) → admission ([`admission`]) →
//! validate into `ValidGenerate` ([`preprocess`] for large bodies) → route
//! and send ([`dispatch`]) → stream frames back ([`generate`], [`inbox`])
//! → detokenize incrementally, apply stop strings → JSON or SSE
//! ([`respond`], from [`handlers`]). Every failure becomes an OpenAI error
//! object through [`error::ApiError`], the one mapping to HTTP. Traffic
//! summaries for the planner are published once per interval ([`feed`]).
//! HTTPS, when configured, is served by [`tls::TlsListener`].

pub mod actor;
pub mod admission;
pub mod auth;
pub mod config;
pub mod conn;
pub mod dashboard;
pub mod dispatch;
pub mod error;
pub mod feed;
pub mod generate;
pub mod handlers;
pub mod inbox;
pub mod metrics;
pub mod models;
pub mod openai;
pub mod preprocess;
pub mod respond;
pub mod router_metrics;
pub mod shared;
pub mod tls;
pub mod unsupported;

pub use actor::{GatewayActor, GatewayArgs, GatewayMsg};
pub use config::GatewayConfig;
