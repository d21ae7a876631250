//! `dynamo-worker`: the worker actor, which serves any [`dynamo_engine::Engine`]
//! on the bus (generate, cancel, artifacts, registration, heartbeats, load).

pub mod actor;
pub mod disagg;
pub mod forward;

pub use actor::{EngineFactory, WorkerActor, WorkerArgs, WorkerConfig, WorkerMsg};
pub use disagg::TransferConfig;
