//! Process-wide counters of bus messages that were rejected (malformed, of an
//! unknown kind, or for an unknown request). Each rejection is also logged at
//! `warn` by the code that counts it.

use std::sync::atomic::{AtomicU64, Ordering};

static REJECTED: AtomicU64 = AtomicU64::new(0);

/// Counts one rejected bus message.
pub fn reject(what: &str, subject: &str, reason: &dyn std::fmt::Display) {
    REJECTED.fetch_add(1, Ordering::Relaxed);
    tracing::warn!(subject, what, %reason, "rejected bus message");
}

/// Rejected bus messages so far in this process.
pub fn rejected_total() -> u64 {
    REJECTED.load(Ordering::Relaxed)
}
