//! `dynamo-runtime`: plumbing every actor shares.
//!
//! - [`bus::Bus`]: one NATS connection plus JetStream, typed publish and
//!   request/reply through the `bus-schema` codec, and KV buckets created the
//!   way nats-server 2.9.10 accepts (see [`bus::Bus::kv_bucket`]).
//! - [`backoff::Backoff`]: restart/retry delays for supervisors and watchers.
//! - [`counters`]: process-wide counts of rejected bus messages (exported by
//!   the gateway's `/metrics`, logged everywhere).
//! - [`tasks::Tasks`]: an actor's background tasks, which fail their actor
//!   when one ends unexpectedly.
//! - [`access`] and [`tls`]: who a connection is to NATS (a role's nkey)
//!   and how servers are checked (a CA); HTTPS and generated certificates.
//! - [`metrics`]: the process-wide Prometheus registry (rendered by the
//!   gateway's `/metrics`).

pub mod access;
pub mod backoff;
pub mod bus;
pub mod counters;
pub mod mailbox;
pub mod metrics;
pub mod tasks;
pub mod tls;

pub use access::{BusAccess, Credentials};
pub use backoff::Backoff;
pub use bus::{Bus, BusError};
pub use mailbox::{Gate, Ticket};
pub use tasks::{OnTaskEnd, Spawner, Tasks};
