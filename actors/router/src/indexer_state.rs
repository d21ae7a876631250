//! The indexer's synchronous state: which workers' KV events it applies,
//! the catch-up replay, gap repairs, snapshots, and the approximate index
//! of workers that publish no events.
//!
//! Invariants:
//! - the indexer is the only writer of the [`SharedKv`] it holds; the
//!   router only reads it;
//! - a batch or dump is applied only for a worker the router registered,
//!   of its registered generation and (for batches) publishing KV events:
//!   anything else is dropped and counted as ignored, and the gap it may
//!   leave is repaired once the registration says which generation is
//!   real;
//! - what it knows of the registry comes from the router's
//!   [`ToIndexer`] notices, in the order the router saw the changes; a
//!   restarted indexer is told the whole registry again;
//! - a snapshot is written by the replica the router says is elected (see
//!   [`IndexerState::snapshot`]), only once that router is caught up and
//!   this index is whole (its replay over and its workers synced, or 5 s
//!   past the replay for dumps that do not come), so a restarted indexer
//!   does not replace the stored snapshot with a partial one while its
//!   repairs are under way;
//! - the approximate records of workers without events survive a snapshot
//!   being loaded (they are put back into the loaded index).

use crate::approx::Approx;
use crate::catch_up::CATCH_UP_MAX;
use crate::kv_stream::{KvSnapshotConfig, StoredSnapshot};
use crate::kv_sync::{GapFill, KvSync, SharedKv};
use dynamo_bus_schema::blocks::SequenceHash;
use dynamo_bus_schema::{KvDumpTiered, KvEvent, KvEventBatch, KvIndexSnapshot, RouterId, WorkerId};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// A snapshot older than this many intervals (plus one per live replica
/// with a lower id) is written by a replica that is not the elected writer.
pub const STALE_INTERVALS: u32 = 3;

/// What the router tells its indexer: registry changes (so that events
/// are applied only for registered generations), the prompts it routed to
/// workers that publish no events, and its own view for snapshot
/// election.
#[derive(Clone, Debug, PartialEq)]
pub enum ToIndexer {
    /// A worker was registered, or registered again with a new generation.
    Registered {
        worker: WorkerId,
        generation: u64,
        kv_events: bool,
    },
    /// A worker left, or was not heard from within the TTL.
    Gone(WorkerId),
    /// A prompt (its block hashes) was routed to a worker without KV
    /// events: assume it keeps it.
    Routed(WorkerId, Vec<SequenceHash>),
    /// The registry's history has been read: the KV events feed may start
    /// (replayed batches then find their workers registered).
    RegistryLoaded,
    /// The router's place among the live replicas (0 = lowest id), and
    /// whether it routes (caught up).
    View { rank: u32, caught_up: bool },
}

/// What the indexer actor does after a notice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Then {
    Nothing,
    /// A worker needs a repair now (first seen: a dump).
    Repair,
    /// The registry's history is read: start the KV events feed (once).
    StartFeed,
}

/// A registered worker, as the indexer knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Known {
    generation: u64,
    kv_events: bool,
}

pub struct IndexerState {
    kv: SharedKv,
    router_id: RouterId,
    workers: HashMap<WorkerId, Known>,
    approx: Approx,
    /// When this indexer started (its replay is overdue after a while).
    started: Instant,
    rank: u32,
    caught_up: bool,
    /// When the replay ended (None while it runs).
    replay_ended: Option<Instant>,
    /// This index is whole enough to snapshot: its replay is over and no
    /// worker waits for a repair, or [`CATCH_UP_MAX`] passed since the
    /// replay ended (the dumps it asks for had that long; a worker that
    /// never answers cannot stop snapshots for good, and is left out of
    /// them). A restarted indexer's router is caught up already, so its say
    /// alone is not enough. Once set, it stays set.
    whole: bool,
    /// When this replica last took a snapshot of its KV index.
    last_snapshot: Option<Instant>,
    /// The stream sequence the last snapshot was tagged with.
    last_snapshot_tag: u64,
    /// When this replica first found no snapshot in the store (cleared
    /// once it finds one).
    snapshot_missing_since: Option<Instant>,
}

impl IndexerState {
    /// An indexer that starts by replaying the KV events stream (dumps
    /// wait until [`Self::replay_done`]).
    pub fn new(router_id: RouterId, kv: SharedKv, now: Instant) -> Self {
        kv.write().begin_replay();
        IndexerState {
            replay_ended: None,
            ..Self::live(router_id, kv, now)
        }
    }

    /// An indexer with nothing to replay (a state built for tests).
    pub fn live(router_id: RouterId, kv: SharedKv, now: Instant) -> Self {
        IndexerState {
            kv,
            router_id,
            workers: HashMap::new(),
            approx: Approx::default(),
            started: now,
            replay_ended: Some(now),
            rank: 0,
            caught_up: false,
            whole: false,
            last_snapshot: None,
            last_snapshot_tag: 0,
            snapshot_missing_since: None,
        }
    }

    pub fn shared(&self) -> &SharedKv {
        &self.kv
    }

    /// A notice from the router, and what the actor must do next. Every
    /// notice is counted here, once handled: the router's catch-up waits
    /// for every notice it sent (a worker registered is syncing by then).
    pub fn notice(&mut self, n: ToIndexer, now: Instant) -> Then {
        let then = self.take_notice(n, now);
        self.kv.write().notices += 1;
        then
    }

    fn take_notice(&mut self, n: ToIndexer, now: Instant) -> Then {
        let repair = |needs: bool| if needs { Then::Repair } else { Then::Nothing };
        match n {
            ToIndexer::Registered {
                worker,
                generation,
                kv_events,
            } => {
                let before = self.workers.get(&worker).copied();
                if before.is_some_and(|b| b.generation >= generation) {
                    // Told again, or an older generation: nothing changes.
                    return Then::Nothing;
                }
                self.workers.insert(
                    worker,
                    Known {
                        generation,
                        kv_events,
                    },
                );
                if before.is_some() {
                    // Restarted: what was assumed of the old engine is gone.
                    self.approx.forget(worker);
                }
                let mut kv = self.kv.write();
                if kv_events {
                    repair(kv.worker_seen(worker, generation))
                } else {
                    kv.worker_gone(worker);
                    Then::Nothing
                }
            }
            ToIndexer::Gone(worker) => {
                self.workers.remove(&worker);
                self.approx.forget(worker);
                self.kv.write().worker_gone(worker);
                Then::Nothing
            }
            ToIndexer::Routed(worker, hashes) => {
                // Only while the worker is still registered without events
                // (a notice can cross its restart or removal).
                if self.workers.get(&worker).is_some_and(|k| !k.kv_events) {
                    let mut kv = self.kv.write();
                    self.approx.record(&mut kv.index, worker, &hashes, now);
                }
                Then::Nothing
            }
            ToIndexer::RegistryLoaded => Then::StartFeed,
            ToIndexer::View { rank, caught_up } => {
                self.rank = rank;
                self.caught_up = caught_up;
                Then::Nothing
            }
        }
    }

    /// A batch of KV events arrived live. Returns true when the worker now
    /// needs a repair (a gap).
    pub fn batch(&mut self, b: KvEventBatch) -> bool {
        let mut kv = self.kv.write();
        match self.workers.get(&b.worker_id) {
            Some(k) if k.generation == b.generation && k.kv_events => kv.batch(b),
            _ => {
                kv.stats.ignored += 1;
                false
            }
        }
    }

    /// A batch read back from the stream while catching up.
    pub fn replayed(&mut self, b: KvEventBatch) {
        self.kv.write().stats.replayed += 1;
        self.batch(b);
    }

    /// Loads a KV index snapshot (while catching up, before the stream is
    /// replayed from its sequence); returns the blocks loaded.
    ///
    /// The index is built without the lock (the router reads the old one
    /// meanwhile) and swapped in; the approximate records of workers
    /// without events, which the snapshot does not hold, are put back.
    pub fn restore(
        &mut self,
        snap: &KvIndexSnapshot,
    ) -> Result<u64, dynamo_kv_index::SnapshotError> {
        if !self.kv.read().is_some_and(|kv| kv.replaying()) {
            // Too late: the replay was ended (overdue) and dumps went out.
            tracing::warn!("a KV index snapshot arrived after catch-up; ignored");
            return Ok(0);
        }
        let workers = &self.workers;
        let restored = KvSync::restored(snap, |w| {
            workers
                .get(&w)
                .filter(|k| k.kv_events)
                .map(|k| k.generation)
        })?;
        let mut kv = self.kv.write();
        let blocks = kv.install(restored);
        self.approx.reapply(&mut kv.index);
        Ok(blocks)
    }

    /// The stream lost messages after the snapshot: dump every worker.
    pub fn stream_truncated(&mut self) {
        let mut kv = self.kv.write();
        if kv.replaying() {
            kv.stream_truncated();
        }
    }

    /// The stream replay is over (or could not run): dumps may go out.
    pub fn replay_done(&mut self, now: Instant) {
        let mut kv = self.kv.write();
        if kv.replaying() {
            kv.end_replay();
        }
        self.replay_ended.get_or_insert(now);
    }

    /// Ends a replay that has run past `max` since the indexer started
    /// (its feed is stuck): the workers it did not cover are dumped.
    pub fn replay_overdue(&mut self, now: Instant, max: Duration) -> bool {
        let replaying = self.kv.read().is_some_and(|kv| kv.replaying());
        if replaying && now.duration_since(self.started) >= max {
            tracing::warn!("the KV events replay is overdue; syncing workers from dumps");
            self.replay_done(now);
            return true;
        }
        false
    }

    /// Gaps to fill from the KV events stream now.
    pub fn fills_due(&mut self, now: Instant) -> Vec<GapFill> {
        self.kv.write().fills_due(now)
    }

    /// The stream's answer to a gap fill.
    pub fn filled(&mut self, fill: &GapFill, found: Result<Vec<KvEvent>, String>) {
        self.kv.write().filled(fill, found)
    }

    /// A worker's block table arrived (applied only for its registered generation).
    pub fn dump(&mut self, d: KvDumpTiered) {
        let mut kv = self.kv.write();
        match self.workers.get(&d.worker_id) {
            Some(k) if k.generation == d.generation => kv.dump(d),
            _ => kv.stats.ignored += 1,
        }
    }

    /// Workers whose block table must be (re)requested now.
    pub fn dumps_due(&mut self, now: Instant) -> Vec<WorkerId> {
        self.kv.write().dumps_due(now)
    }

    /// Drops approximate records past their TTL.
    pub fn expire(&mut self, now: Instant) {
        if !self.approx.is_empty() {
            let mut kv = self.kv.write();
            self.approx.expire(&mut kv.index, now);
        }
    }

    /// A snapshot of the KV index, if this replica should write one now:
    /// its router routes (caught up), `cfg.events` were applied or
    /// `cfg.interval` passed since its last, and it is the writer: the live
    /// replica with the lowest id, or, when the store's newest snapshot is
    /// stale (the elected writer does not write: snapshots off, writes
    /// failing), any replica, the `k`-th lowest once it is
    /// `STALE_INTERVALS + k` intervals old (missing counts from when this
    /// replica first saw it missing), so that they do not all write at once.
    /// `stream_seq`: every stream message up to it is applied.
    ///
    /// The index is exported under a read lock: the router keeps routing.
    pub fn snapshot(
        &mut self,
        stream_seq: u64,
        stored: StoredSnapshot,
        cfg: &KvSnapshotConfig,
        now: Instant,
    ) -> Option<KvIndexSnapshot> {
        let rank = self.rank;
        let age = match stored {
            StoredSnapshot::Age(a) => {
                self.snapshot_missing_since = None;
                Some(a)
            }
            StoredSnapshot::Missing => {
                let since = *self.snapshot_missing_since.get_or_insert(now);
                Some(now.duration_since(since))
            }
            StoredSnapshot::Unknown => None,
        };
        let stale_after = cfg.interval * (STALE_INTERVALS + rank);
        let lowest = rank == 0 || age.is_some_and(|a| a >= stale_after);
        let snap = {
            let kv = self.kv.read()?;
            let changed = kv.since_snapshot();
            let interval_over = self
                .last_snapshot
                .is_none_or(|t| now.duration_since(t) >= cfg.interval);
            // Quiet since the last snapshot, which was tagged a period
            // behind the stream: nothing was applied since, so everything
            // up to the stream's sequence now is in it; write it again with
            // that tag, so that a replica loading it replays nothing it
            // holds.
            let retag =
                changed == 0 && self.last_snapshot.is_some() && stream_seq > self.last_snapshot_tag;
            let due = changed >= cfg.events || ((changed > 0 || retag) && interval_over);
            self.whole = self.whole
                || (!kv.replaying()
                    && (kv.syncing() == 0
                        || self
                            .replay_ended
                            .is_some_and(|t| now.duration_since(t) >= CATCH_UP_MAX)));
            if !cfg.enabled || !lowest || !due || !self.caught_up || !self.whole {
                return None;
            }
            kv.export(stream_seq, self.router_id)
        };
        self.kv.write().snapshot_taken();
        self.last_snapshot = Some(now);
        self.last_snapshot_tag = stream_seq;
        Some(snap)
    }

    /// The last snapshot taken was not stored: the next interval takes one
    /// again (as a re-tag if nothing was applied meanwhile).
    pub fn snapshot_not_written(&mut self) {
        self.last_snapshot_tag = 0;
    }
}
