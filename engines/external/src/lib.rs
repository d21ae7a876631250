//! External engines behind our engine seam.
//!
//! - [`engine`]: [`engine::ExternalEngine`], a worker's engine that is a
//!   server in another process, reached over its HTTP API ([`dialect`],
//!   [`sse`]), its load read from its Prometheus metrics ([`prom`]), its
//!   process started and watched when the config says so ([`launch`]),
//!   configured by [`config`]; each request's call is in `call`.
//! - [`events`]: vLLM's and SGLang's KV event batches (msgpack, both
//!   encodings), decoded tolerantly.
//! - [`translate`]: their blocks in our block identity, so the router keeps
//!   one index.
//! - [`sequence`] and [`zmq_source`]: the ZMQ stream they publish on, in
//!   order, with gaps filled from the publisher's replay endpoint.
//! - [`kv_feed`]: all of it as the engine seam's KV event stream, with a
//!   snapshot of the block table for the router's dumps.
//!
//! NATS-free: the worker actor wires these to the bus.

mod call;
pub mod config;
pub mod dialect;
pub mod engine;
pub mod events;
pub mod kv_feed;
pub mod launch;
pub mod prom;
pub mod sequence;
pub mod sse;
pub mod translate;
pub mod zmq_source;
