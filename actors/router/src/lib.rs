//! `dynamo-router`: the router actor.
//!
//! Workers register in a JetStream KV bucket and refresh their record every
//! heartbeat; the router watches the bucket (with history, so a late router
//! sees every live worker at once) and the load subject, and picks a worker
//! per request with a [`policy::RoutingPolicy`] (round-robin or
//! least-loaded; the KV-aware policy plugs into the same seam).
//!
//! The router runs beside the gateway in the same node: routing is a local
//! actor call (no bus round trip on the request path), while every input
//! to the decision arrives over the bus, so any number of gateway+router
//! replicas see the same registry.

pub mod active;
pub mod actor;
pub mod approx;
pub mod catch_up;
pub mod disagg;
pub mod dumps;
pub mod feeds;
pub mod indexer;
pub mod indexer_state;
pub mod kv_stream;
pub mod kv_sync;
pub mod policy;
pub mod registry;
pub mod state;
pub mod timing;

pub use actor::{KvInfo, RouterActor, RouterArgs, RouterConfig, RouterMsg};
pub use disagg::DisaggPolicy;
pub use indexer::{IndexerActor, IndexerMsg};
pub use policy::PolicyKind;
pub use state::{ModelEntry, RouteDecision, RouteError, RouterState, WorkerEntry};

/// The name the router registers under, so the gateway finds it after restarts.
pub const ROUTER_ACTOR_NAME: &str = "router";
