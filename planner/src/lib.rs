//! The planner's core, NATS-free: it sizes a deployment's prefill, decode
//! and aggregated services (or scaling groups) for an SLA.
//!
//! - [`predict`]: forecasts of arrival rate, ISL and OSL behind one trait
//!   (constant; Holt's damped linear trend).
//! - [`capacity`]: what one replica serves within the TTFT and ITL targets,
//!   from an engine's step timing, learned online from observed timings.
//! - [`policy`]: the decisions: sizing for the demand expected when a new
//!   replica would be ready, a burst rule on queues, hysteresis and a
//!   shrink delay, bounds, a slot budget, pins, scale to zero and waking;
//!   and Dynamo's load rule as the baseline.
//!
//! The actor above (`actors/planner`) feeds it windows of metrics from the
//! bus and applies its changes through the controller's desired state.

pub mod capacity;
pub mod demand;
mod limits;
pub mod policy;
pub mod predict;
mod rules;
#[cfg(test)]
mod tests;

pub use capacity::{EngineTiming, Learned};
pub use policy::{
    Change, Evaluation, Memory, Note, Phase, PlannerState, Target, TargetKind, Window, WorkerSample,
};
