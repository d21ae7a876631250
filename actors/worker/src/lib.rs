//! `dynamo-worker`: the worker actor, which serves any [`dynamo_engine::Engine`]
//! on the bus (generate, cancel, artifacts, registration, heartbeats, load).
//!
//! Modules, one job each: [`actor`] (the mailbox and the request path),
//! [`admit`] (whether a request is taken), [`forward`] (engine events to
//! frames), [`mux`] (frames of many requests in one bus message),
//! [`registration`] (the registry record and load reports),
//! [`kv_events`] (KV event batches), [`endpoints`] (dumps, artifacts),
//! [`disagg`] (the KV transfer endpoint, its client and server), [`stats`]
//! (timings measured around the engine, published for the planner).

pub mod actor;
pub mod admit;
pub mod disagg;
pub mod endpoints;
pub mod forward;
pub mod kv_events;
pub mod mux;
pub mod orphans;
pub mod prom;
pub mod registration;
pub mod stats;

pub use actor::{EngineFactory, WorkerActor, WorkerArgs, WorkerConfig, WorkerMsg};
pub use disagg::TransferConfig;
