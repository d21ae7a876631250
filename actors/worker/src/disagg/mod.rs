//! Disaggregated serving on a worker: a prefill worker computes a prompt's
//! KV and writes its blocks, one-sided over libfabric, straight into pool
//! blocks the decode worker's engine reserved for them; the decode engine
//! then caches them as if it had computed them, and generates.
//!
//! Invariants:
//! - a decode worker reserves the blocks in its engine before it asks for
//!   a prefill; the engine neither computes with, hands out nor evicts a
//!   reserved block, so nothing else touches the bytes a peer writes;
//! - the prefill worker writes through windows registered for this request
//!   alone (one per run of consecutive blocks), closed before the blocks
//!   are committed or released, so a write that arrives late (after a
//!   timeout or a cancel) is refused instead of landing in reused blocks;
//! - it commits only blocks whose hashes are its own prompt's, in order,
//!   and only once its own completion queue has every written window's
//!   notice (remote CQ data): the data is in place, whatever the bus says;
//! - every failure (prefill worker gone or slow, transfer timeout, bad
//!   reply, no blocks to spare, fenced peer) is returned as a reason: the
//!   caller prefills locally and reports the reason; nothing waits past
//!   `prefill_timeout`, and a write never waits past `write_timeout`;
//! - a prefill worker that fails `fence_after` times in a row is skipped
//!   for `fence_for`;
//! - the source region of a write that failed or timed out is kept by the
//!   endpoint until the provider is done with it (the write's late
//!   completion frees it), and a prefill worker whose stalled writes hold
//!   more than `max_stalled_bytes` refuses new transfers until they drain.
//!
//! Layout: this module holds the endpoint ([`KvTransfer`]: settings,
//! fencing, stalled-write accounting); [`client`] is the decode side
//! (reserve, ask, wait for the notices, commit), [`server`] the prefill
//! side (compute, export, write).

pub mod client;
pub mod server;

pub use client::{cancel_prefill, RemoteDone, RemotePrefillPipe};
pub use server::PrefillServer;

use dynamo_bus_schema::{RequestId, WorkerId};
use dynamo_transfer::{Agent, FabricError, Peer, Progress};
use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// KV transfer settings of a prefill or decode worker.
#[derive(Clone, Debug, PartialEq)]
pub struct TransferConfig {
    /// libfabric provider: `tcp;ofi_rxm` (default, any host) or `shm` (same host).
    pub provider: String,
    /// Longest one write of a request's blocks may take before it fails.
    pub write_timeout: Duration,
    /// Longest a decode worker waits for a remote prefill (compute and
    /// transfer) before it prefills locally.
    pub prefill_timeout: Duration,
    /// Consecutive failures after which a prefill worker is fenced.
    pub fence_after: u32,
    /// How long a fenced prefill worker is skipped.
    pub fence_for: Duration,
    /// Bytes a prefill worker's failed or timed-out writes may still hold
    /// (the provider may read them until they complete); past it, new
    /// transfers are refused and their decode workers prefill locally.
    pub max_stalled_bytes: usize,
}

impl Default for TransferConfig {
    fn default() -> Self {
        TransferConfig {
            provider: "tcp;ofi_rxm".into(),
            write_timeout: Duration::from_secs(5),
            prefill_timeout: Duration::from_secs(60),
            fence_after: 2,
            fence_for: Duration::from_secs(30),
            max_stalled_bytes: 1 << 30,
        }
    }
}

struct Fence {
    failures: u32,
    until: Option<Instant>,
}

/// A worker's KV transfer endpoint.
pub struct KvTransfer {
    worker_id: WorkerId,
    cfg: TransferConfig,
    progress: Progress,
    address: Vec<u8>,
    block_bytes: usize,
    /// Base of the next request's notices (each window takes one).
    next_notice: AtomicU64,
    peers: Mutex<HashMap<Vec<u8>, Peer>>,
    fences: Mutex<HashMap<WorkerId, Fence>>,
    /// Remote prefills waiting for their writes to start.
    starting: Mutex<HashMap<RequestId, tokio::sync::oneshot::Sender<()>>>,
}

impl KvTransfer {
    /// Opens the endpoint of a prefill or decode worker.
    pub fn open(
        worker_id: WorkerId,
        cfg: TransferConfig,
        block_bytes: usize,
    ) -> Result<Self, FabricError> {
        let agent = Agent::new(&cfg.provider)?;
        let address = agent.address()?;
        let progress =
            Progress::spawn(agent).map_err(|e| FabricError::Completion(e.to_string()))?;
        Ok(KvTransfer {
            worker_id,
            cfg,
            progress,
            address,
            block_bytes,
            next_notice: AtomicU64::new(1),
            peers: Mutex::new(HashMap::new()),
            fences: Mutex::new(HashMap::new()),
            starting: Mutex::new(HashMap::new()),
        })
    }

    /// A prefill worker is about to write `id`'s blocks here.
    pub fn transfer_starting(&self, id: RequestId) {
        if let Some(tx) = self.starting.lock().ok().and_then(|mut s| s.remove(&id)) {
            let _ = tx.send(());
        }
    }

    /// Stops polling the endpoint (fault injection: a peer that never polls).
    pub fn stop_progress(&self) {
        self.progress.pause();
    }

    /// Bytes held by writes that failed or timed out and have not completed
    /// yet (freed as their completions arrive).
    pub fn stalled_bytes(&self) -> usize {
        self.progress.agent().buried_bytes()
    }

    fn fenced(&self, w: WorkerId) -> Option<Duration> {
        let f = self.fences.lock().ok()?;
        let until = f.get(&w)?.until?;
        until.checked_duration_since(Instant::now())
    }

    fn record(&self, w: WorkerId, ok: bool) {
        let Ok(mut f) = self.fences.lock() else {
            return;
        };
        let e = f.entry(w).or_insert(Fence {
            failures: 0,
            until: None,
        });
        if ok {
            e.failures = 0;
            e.until = None;
        } else {
            e.failures += 1;
            if e.failures >= self.cfg.fence_after {
                tracing::warn!(prefill_worker = %w, failures = e.failures, fence_for = ?self.cfg.fence_for, "fencing prefill worker");
                e.until = Some(Instant::now() + self.cfg.fence_for);
                e.failures = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_failures_fence_a_peer_and_success_clears_it() {
        let t = KvTransfer::open(WorkerId(1), TransferConfig::default(), 64)
            .expect("tcp;ofi_rxm endpoint");
        let w = WorkerId(9);
        t.record(w, false);
        assert!(t.fenced(w).is_none());
        t.record(w, false);
        assert!(t.fenced(w).is_some());
        t.record(w, true);
        assert!(t.fenced(w).is_none());
    }
}
