//! Deployment specs for the cluster layer, NATS-free.
//!
//! - [`spec`]: the deployment spec (YAML) parsed into checked types; every
//!   error names its field.
//! - [`placement`]: a pure function placing replicas on labelled nodes with
//!   gang and topology semantics.
//! - [`planner_spec`]: the spec's `planner:` section (SLA and bounds).
//! - [`render`]: Kubernetes manifests (Grove resources and core objects).

pub mod placement;
pub mod planner_spec;
pub mod render;
pub mod spec;
