//! `dynamo-configurator`: deciding how to deploy a model without GPUs.
//!
//! Layers, each built on the ones before: the inputs as data ([`spec`]:
//! GPUs and models); the memory a layout needs ([`memory`]); efficiencies
//! measured on a GPU ([`calib`]); the time of one forward step ([`perf`]);
//! the search over layouts, batches and serving modes ([`search`]); its
//! presentation ([`report`]) and deployment files ([`emit`]); and the check
//! against published throughput ([`validate`]).
//!
//! Invariants: specs are validated when loaded (every size positive, heads
//! divisible by KV heads, MoE active ≤ experts); lookups are
//! case-insensitive and an unknown name is an error that lists the known
//! ones; memory figures are exact functions of the specs; the step model
//! has no constant fitted to the validation points; every search result
//! fits in memory and the frontier holds no dominated candidate.

pub mod calib;
pub mod comm;
pub mod emit;
pub mod engines;
pub mod fit;
pub mod memory;
pub mod online;
pub mod perf;
pub mod report;
pub mod search;
pub mod spec;
pub mod validate;

pub use calib::{CalibError, Calibration};
pub use memory::{Deployment, Dtype, MemoryError, MemoryPlan};
pub use perf::{EngineProfile, Step, StepModel, StepTime};
pub use search::{search, Candidate, Layout, Mode, Outcome, Query, SearchError};
pub use spec::{Catalog, Gpu, Mla, Model, Moe, SpecError};
