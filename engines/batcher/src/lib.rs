//! `dynamo-batcher`: what every paged engine shares, with no tensors and no
//! I/O, so the mocker and the CPU engine schedule, cache and announce
//! blocks identically.
//!
//! - [`block_pool`]: paged KV blocks, prefix cache by sequence hash, LRU
//!   eviction of unreferenced blocks (tails first), exact KV events.
//! - [`scheduler`]: continuous batching with `max_num_seqs` and
//!   `max_num_batched_tokens`, chunked prefill, preemption, cancellation,
//!   stop tokens and `max_tokens`.

//! - [`offload`]: host-memory and disk tiers under the pool.
//! - [`reserve`]: pool blocks reserved for a peer's one-sided writes.

pub mod block_pool;
pub mod offload;
pub mod reserve;
pub mod scheduler;

pub use block_pool::{BlockIdx, BlockPool, Evicted};
pub use offload::{OffloadConfig, OffloadError, OffloadStats, TierStore};
pub use scheduler::{BlockData, Plan, Planned, Scheduler, SchedulerConfig, Seq};
