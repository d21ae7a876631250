//! `dynamo-node`: the node daemon (`dynamo-node --config FILE`) and the
//! admin CLI (`dynamoctl`).
//!
//! A node reads a TOML config ([`config`]), connects to the bus (or runs an
//! embedded `nats-server -js`, [`embedded_nats`]), and runs its actors under
//! a [`supervisor::NodeSupervisor`] that restarts any that fails. SIGINT or
//! SIGTERM stop the gateway taking requests, let in-flight ones finish within
//! the grace period, deregister the workers and exit.
//!
//! A node started with `--join` has no actors of its own: it reports its
//! labels and capacity, and its [`agent`] runs what the placement
//! controller assigns it; `dynamoctl apply|get|describe|scale|delete`
//! ([`cluster`]) manage deployments.
//!
//! Every actor connects to NATS as its role ([`access`]): an embedded
//! server runs with TLS and one user per role by default.

pub mod access;
pub mod agent;
pub mod bench;
pub mod calibrate;
pub mod cluster;
pub mod config;
pub mod configure;
pub mod daemon;
pub mod drain;
pub mod embedded_nats;
pub mod engines;
pub mod env;
pub mod index_cli;
pub mod js_cli;
pub mod keys_cli;
pub mod metrics;
pub mod models_cli;
pub mod nats_auth_cli;
pub mod planner_cli;
pub mod replay;
pub mod seed;
pub mod status;
pub mod supervisor;
pub mod time;
pub mod weights;
