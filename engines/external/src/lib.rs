//! External engines behind our engine seam.
//!
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

pub mod events;
pub mod kv_feed;
pub mod sequence;
pub mod translate;
pub mod zmq_source;
