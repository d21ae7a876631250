//! A lease in a JetStream KV entry, taken and renewed by compare-and-set
//! on the entry's revision: the placement controller's (one per cluster)
//! and each deployment's planner (one per deployment).
//!
//! Invariants: at most one holder at a time for a key (every write is a
//! compare-and-set); the epoch grows by one with every change of holder,
//! so anything written under an older epoch can be recognised; a holder
//! that misses renewals for longer than the TTL loses the lease.
//!
//! Expiry is judged by the challenger's own monotonic clock, never by
//! comparing wall clocks across nodes: it remembers the entry's revision
//! and when it first saw it ([`Observed`]), and takes over only once that
//! revision has not changed for the TTL. A holder whose clock runs hours
//! ahead can no longer keep a lease after it dies, and one whose clock runs
//! behind is not deposed while it renews.

use async_nats::jetstream::kv;
use dynamo_bus_schema::{decode, encode, unix_ms, ControllerLease, NodeId};
use std::time::Duration;

const CALL: Duration = Duration::from_secs(2);

/// What a challenger has seen of a lease another holds: the entry's
/// revision, and when (by this process's monotonic clock) it first saw
/// that revision. One per lease key, kept by the caller across claims.
#[derive(Debug, Default)]
pub struct Observed {
    seen: Option<(u64, std::time::Instant)>,
}

impl Observed {
    /// How long `revision` has been the entry's, as far as this process
    /// has seen (zero the first time).
    fn unchanged_for(&mut self, revision: u64, now: std::time::Instant) -> Duration {
        match self.seen {
            Some((r, since)) if r == revision => now.duration_since(since),
            _ => {
                self.seen = Some((revision, now));
                Duration::ZERO
            }
        }
    }
}

/// Takes or renews the lease under `key`. `epoch` is the epoch this holder
/// last held (0: never), `was_active` whether it believes it holds it now,
/// `observed` what this process has seen of the key so far. Returns the
/// epoch held, or None when another holder has it.
pub async fn claim(
    store: &kv::Store,
    key: &str,
    me: &NodeId,
    ttl: Duration,
    epoch: u64,
    was_active: bool,
    observed: &mut Observed,
) -> Result<Option<u64>, String> {
    let ttl_ms = ttl.as_millis() as u64;
    let now = unix_ms();
    let entry = match tokio::time::timeout(CALL, store.entry(key)).await {
        Ok(Ok(e)) => e,
        Ok(Err(e)) => return Err(format!("lease {key}: {e}")),
        Err(_) => return Err(format!("lease {key}: timed out")),
    };
    let current = entry.as_ref().and_then(|e| {
        (e.operation == kv::Operation::Put)
            .then(|| decode::<ControllerLease>(&e.value).ok())
            .flatten()
    });
    let put = |epoch: u64| -> Result<bytes::Bytes, String> {
        encode(&ControllerLease {
            holder: me.clone(),
            epoch,
            renewed_unix_ms: now,
            ttl_ms,
        })
        .map(Into::into)
        .map_err(|e| e.to_string())
    };
    let (next, ok) = match (&entry, &current) {
        (None, _) => (1, written(store.create(key, put(1)?)).await),
        (Some(e), Some(l)) if &l.holder == me && (l.epoch == epoch || !was_active) => {
            // Ours: renew (a restarted holder on the same node takes it
            // back under the next epoch).
            let next = if l.epoch == epoch {
                l.epoch
            } else {
                l.epoch + 1
            };
            (
                next,
                written(store.update(key, put(next)?, e.revision)).await,
            )
        }
        (Some(e), Some(l)) => {
            // Another's: expired once its revision stood still for the TTL
            // (the longer of ours and the one it wrote), by our clock.
            let ttl = Duration::from_millis(l.ttl_ms.max(ttl_ms));
            let still = observed.unchanged_for(e.revision, std::time::Instant::now());
            if still <= ttl {
                return Ok(None);
            }
            tracing::warn!(holder = %l.holder, key, unrenewed_ms = still.as_millis() as u64, "lease expired; taking it over");
            let next = l.epoch + 1;
            (
                next,
                written(store.update(key, put(next)?, e.revision)).await,
            )
        }
        (Some(e), None) => {
            // A deleted or unreadable lease: replace it, under an epoch past
            // any it held (an epoch never exceeds the revision that wrote
            // it, so the entry's revision bounds them all).
            let next = epoch.max(e.revision) + 1;
            (
                next,
                written(store.update(key, put(next)?, e.revision)).await,
            )
        }
    };
    Ok(ok.then_some(next))
}

/// Whether a bounded write succeeded.
async fn written<T, E>(f: impl std::future::Future<Output = Result<T, E>>) -> bool {
    matches!(tokio::time::timeout(CALL, f).await, Ok(Ok(_)))
}
