//! `dynamo-controller`: the placement controller.
//!
//! - [`state`]: the synchronous decision (assignments and statuses from the
//!   desired state, the inventory and the current assignments), driven
//!   directly by tests;
//! - [`actor`]: the supervised actor that holds the lease and wires the
//!   decision to JetStream KV;
//! - [`desired`]: reading, writing and scaling the desired state (what
//!   `dynamoctl` and the planner change it through);
//! - [`lease`]: the compare-and-set lease (the controller's and each
//!   planner's).

pub mod actor;
pub mod desired;
pub mod lease;
pub mod metrics;
pub mod state;

pub use actor::{
    bounded, read_all, ControllerActor, ControllerArgs, ControllerConfig, ControllerMsg, LEASE_KEY,
};
pub use state::{ControllerState, Decision, Deployment, World};
