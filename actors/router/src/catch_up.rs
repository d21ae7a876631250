//! A router replica's start-up gate: it routes only once its view is whole
//! enough to agree with its peers, so a replica (re)started under load does
//! not send requests to workers it wrongly thinks are cold or idle.
//!
//! Caught up = the worker registry's history has been read, the active-load
//! snapshot of a peer has been loaded (or no peer answered), the KV events
//! stream has been replayed (from the newest index snapshot), and every
//! worker that publishes KV events and that the replay did not cover has
//! had its block table dumped into the index. A worker that never answers cannot hold the gate: after
//! [`CATCH_UP_MAX`] the replica routes with what it has. Once caught up, a
//! replica stays caught up (later workers are synced while it routes).

use std::time::{Duration, Instant};

/// Longest a replica waits for its view before routing anyway.
pub const CATCH_UP_MAX: Duration = Duration::from_secs(5);

#[derive(Debug)]
pub struct CatchUp {
    started: Instant,
    registry_loaded: bool,
    snapshot_done: bool,
    done: bool,
}

impl CatchUp {
    /// Already caught up (a state built for tests or tools).
    pub fn done() -> Self {
        CatchUp {
            started: Instant::now(),
            registry_loaded: true,
            snapshot_done: true,
            done: true,
        }
    }

    /// Starts waiting now.
    pub fn begin(now: Instant) -> Self {
        CatchUp {
            started: now,
            registry_loaded: false,
            snapshot_done: false,
            done: false,
        }
    }

    pub fn registry_loaded(&mut self) {
        self.registry_loaded = true;
    }

    pub fn snapshot_done(&mut self) {
        self.snapshot_done = true;
    }

    /// Whether the registry's history has been read.
    pub fn registry_was_loaded(&self) -> bool {
        self.registry_loaded
    }

    /// Routing has started.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// How long ago the wait began.
    pub fn waited(&self, now: Instant) -> Duration {
        now.duration_since(self.started)
    }

    /// Whether routing may start; `syncing` = workers still waiting for a
    /// repair, `replaying` = the indexer still replays the KV events stream.
    pub fn check(&mut self, syncing: usize, replaying: bool, now: Instant) -> bool {
        if self.done {
            return true;
        }
        let whole = self.registry_loaded && self.snapshot_done && !replaying && syncing == 0;
        if whole || now.duration_since(self.started) >= CATCH_UP_MAX {
            self.done = true;
            tracing::info!(
                ms = now.duration_since(self.started).as_millis() as u64,
                complete = whole,
                "router caught up; routing"
            );
        }
        self.done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_for_every_part_or_the_cap() {
        let t0 = Instant::now();
        let mut c = CatchUp::begin(t0);
        assert!(!c.check(0, false, t0));
        c.registry_loaded();
        c.snapshot_done();
        assert!(!c.check(0, true, t0), "the KV stream is still replaying");
        assert!(!c.check(2, false, t0), "two workers still syncing");
        assert!(c.check(0, false, t0));
        assert!(c.check(5, true, t0), "stays caught up");

        let mut stuck = CatchUp::begin(t0);
        assert!(!stuck.check(1, true, t0 + Duration::from_secs(1)));
        assert!(stuck.check(1, true, t0 + CATCH_UP_MAX));
        assert!(CatchUp::done().check(9, true, t0));
    }
}
