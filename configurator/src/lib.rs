//! `dynamo-configurator`: deciding how to deploy a model without GPUs.
//!
//! This first part holds the inputs as data and what follows from them
//! exactly: GPUs and models ([`spec`]), and the memory a deployment needs
//! ([`memory`]): weights per GPU under tensor and pipeline parallelism, KV
//! bytes per token, and how many tokens of KV fit. The performance model
//! per forward step and the search build on these.
//!
//! Invariants: specs are validated when loaded (every size positive, heads
//! divisible by KV heads, MoE active ≤ experts); lookups are
//! case-insensitive and an unknown name is an error that lists the known
//! ones; memory figures are exact functions of the specs (no fitted
//! constants).

pub mod calib;
pub mod emit;
pub mod memory;
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
