//! `dynamo-planner-actor`: the planner on the bus.
//!
//! - [`feed`]: the frontends' and workers' metrics summed into windows
//!   (plain logic, driven by tests);
//! - [`targets`]: what a deployment's planner scales, and which worker
//!   serves which target (plain logic);
//! - [`actor`]: the supervised actors (one manager per node, one planner
//!   per deployment, one active through a lease) that wire the core
//!   (`dynamo-planner`) to JetStream KV and NATS;
//! - [`k8s`]: the Kubernetes connector's read-back and patches, where a
//!   deployment runs on Kubernetes;
//! - [`metrics`]: its decisions as Prometheus metrics.

pub mod actor;
pub mod feed;
pub mod k8s;
pub mod metrics;
pub mod targets;

pub use actor::{PlannerActor, PlannerConfig, PlannersActor, PlannersArgs, PlannersMsg};
pub use targets::Seed;
