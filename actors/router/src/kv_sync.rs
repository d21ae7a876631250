//! Keeping the KV index exact per worker.
//!
//! Each worker's events carry ids that increase by one within a generation.
//! Per worker the indexer is either `Live` (expecting event `next`) or
//! `Syncing` (waiting for a repair, buffering what arrives meanwhile). A
//! repair is the missing events read back from the KV events stream, or a
//! dump of the worker's block table.
//!
//! Invariants:
//! - an event is applied at most once and only in id order: an id below
//!   `next` is a duplicate (dropped, counted), an id above it is a gap
//!   (counted). A gap on a live worker is first filled from the stream
//!   ([`KvSync::fills_due`], [`KvSync::filled`]): the missing events, then
//!   the buffer, applied in order. Only when the stream cannot fill it (it
//!   does not hold them, cannot be read, or takes longer than
//!   [`FILL_MAX`]) is the worker re-synced from a dump;
//! - a dump replaces everything known about the worker (`Cleared`, then its
//!   blocks) and events up to its `last_event_id` are skipped afterwards;
//! - a newer generation (the engine restarted) clears the worker's blocks
//!   and expects event 1; an older generation's events are dropped;
//! - a worker first seen is synced from a dump (a router that starts late
//!   learns what workers already hold), except while a starting replica
//!   replays the KV events stream ([`KvSync::begin_replay`]): dumps wait
//!   until the replay ends, and a worker whose events from id 1 were in the
//!   stream, or whose state a snapshot restored and the stream continued,
//!   needs none;
//! - a snapshot ([`KvSync::snapshot`]) holds only `Live` workers, each with
//!   the last event id it reflects, so replaying stream messages it already
//!   reflects only drops duplicates.

use dynamo_bus_schema::{
    EventId, KvDumpTiered, KvEvent, KvEventBatch, KvEventKind, KvIndexSnapshot, KvSnapshotWorker,
    RouterId, StorageTier, WorkerId,
};
use dynamo_kv_index::{IndexEvent, IndexEventData, KvIndex, SnapshotError, Tier};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Most events buffered per worker while its dump is outstanding.
const MAX_BUFFER: usize = 100_000;
/// Most blocks those events may name in all (an event names up to 4096):
/// past either bound newer events are dropped, and the gap they leave
/// after the dump is re-synced from another dump.
const MAX_BUFFER_BLOCKS: usize = 1 << 20;
/// A dump not answered within this long is asked for again.
const DUMP_RETRY: Duration = Duration::from_secs(2);
/// A stream fill not answered within this long gives way to a dump.
pub const FILL_MAX: Duration = Duration::from_secs(5);
/// A fill reads the worker's stream messages from this long before the
/// last batch applied before the gap (clocks of worker and server differ).
const FILL_MARGIN_MS: u64 = 5_000;
/// Where no batch was applied before the gap (the worker was just synced),
/// a fill reads this far back.
const FILL_WINDOW_MS: u64 = 60_000;

/// How a worker that lost its place is brought back in sync.
#[derive(Debug)]
enum Repair {
    /// Read events `from` on back from the KV events stream, among those
    /// published since `since_unix_ms`; asked at `asked_at`.
    Stream {
        from: u64,
        since_unix_ms: u64,
        asked_at: Option<Instant>,
    },
    /// Ask the worker for a dump of its block table (again after
    /// [`DUMP_RETRY`]).
    Dump { asked_at: Option<Instant> },
}

impl Repair {
    fn dump() -> Self {
        Repair::Dump { asked_at: None }
    }
}

/// A gap to fill from the KV events stream: the worker's events of
/// `generation` from id `from` on, published since `since_unix_ms`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GapFill {
    pub worker: WorkerId,
    pub generation: u64,
    pub from: u64,
    pub since_unix_ms: u64,
}

#[derive(Debug)]
enum Sync {
    Live {
        generation: u64,
        next: u64,
    },
    Syncing {
        generation: u64,
        buffer: Vec<KvEvent>,
        /// Blocks the buffered events name.
        buffered_blocks: usize,
        /// Events were dropped past the bounds: the buffer is not a whole history.
        overflowed: bool,
        repair: Repair,
    },
}

impl Sync {
    fn syncing(generation: u64, repair: Repair) -> Self {
        Sync::Syncing {
            generation,
            buffer: Vec::new(),
            buffered_blocks: 0,
            overflowed: false,
            repair,
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvStats {
    pub applied: u64,
    pub duplicates: u64,
    pub gaps: u64,
    pub dumps: u64,
    pub unknown: u64,
    /// Batches and dumps dropped: not of a registered worker's generation.
    pub ignored: u64,
    /// Batches read back from the KV events stream while catching up.
    pub replayed: u64,
    /// Snapshots taken of this index (for the object store).
    pub snapshots_taken: u64,
    /// Blocks loaded from a peer's snapshot at start-up.
    pub snapshot_blocks: u64,
    /// Catch-ups whose stream no longer held everything after the snapshot
    /// (every worker was then synced from a dump).
    pub stream_truncated: u64,
    /// Live gaps filled from the KV events stream (no dump).
    pub stream_fills: u64,
    /// Live gaps the stream could not fill (a dump followed).
    pub stream_fill_failures: u64,
}

/// An index built from a snapshot, to install ([`KvSync::install`]).
pub struct Restored {
    index: KvIndex,
    /// The workers kept: generation and last event id.
    keep: HashMap<WorkerId, (u64, EventId)>,
}

/// The KV index and its sync state, shared between the indexer actor,
/// its only writer, and the router, which reads it on every route
/// (overlap, catch-up, status). Locks are held only inside synchronous
/// calls, never across an await.
///
/// A writer that panics mid-call poisons the lock: readers then get
/// `None` and route on load alone, until the router replaces the handle
/// with the restarted indexer's.
#[derive(Clone, Default)]
pub struct SharedKv(std::sync::Arc<std::sync::RwLock<KvSync>>);

impl SharedKv {
    pub fn new(kv: KvSync) -> Self {
        SharedKv(std::sync::Arc::new(std::sync::RwLock::new(kv)))
    }

    /// The index to read; `None` if a writer panicked while holding it.
    pub fn read(&self) -> Option<std::sync::RwLockReadGuard<'_, KvSync>> {
        self.0.read().ok()
    }

    /// The counters, even from an index a panicking writer left behind.
    pub fn stats(&self) -> KvStats {
        self.0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .stats
    }

    /// The index to change (the indexer's alone). A poisoned lock is taken
    /// anyway: only a dying indexer poisons it, and its handle is dropped.
    pub fn write(&self) -> std::sync::RwLockWriteGuard<'_, KvSync> {
        self.0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[derive(Default)]
pub struct KvSync {
    pub index: KvIndex,
    workers: HashMap<WorkerId, Sync>,
    pub stats: KvStats,
    /// Publish-to-apply delay of each worker's last batch, ms.
    lag_ms: HashMap<WorkerId, u64>,
    /// When each worker published its last batch taken before the current
    /// one (worker clock): where a gap's fill starts reading.
    published_ms: HashMap<WorkerId, u64>,
    /// A starting replica is replaying the KV events stream: dumps wait.
    replaying: bool,
    /// Events applied since the last snapshot.
    since_snapshot: u64,
    /// Notices from the router the indexer has handled (the router holds
    /// its catch-up until every notice it sent is handled).
    pub notices: u64,
}

/// A wire event as the index takes it; `None` for a kind or tier this
/// version does not know.
fn index_event(w: WorkerId, ev: KvEvent) -> Option<IndexEvent> {
    let data = match (ev.kind, tier(ev.tier)) {
        (KvEventKind::Stored, Some(tier)) => IndexEventData::Stored {
            tier,
            parent: ev.parent,
            blocks: ev.blocks,
        },
        (KvEventKind::Removed, Some(tier)) => IndexEventData::Removed {
            tier,
            blocks: ev.blocks,
        },
        (KvEventKind::Cleared, _) => IndexEventData::Cleared,
        _ => return None,
    };
    Some(IndexEvent { worker: w, data })
}

fn tier(t: StorageTier) -> Option<Tier> {
    match t {
        StorageTier::Device => Some(Tier::Device),
        StorageTier::Host => Some(Tier::Host),
        StorageTier::Disk => Some(Tier::Disk),
        StorageTier::Unknown(_) => None,
    }
}

impl KvSync {
    /// A worker appeared (or restarted: `generation` grew). Returns true if a dump should be requested.
    pub fn worker_seen(&mut self, w: WorkerId, generation: u64) -> bool {
        match self.workers.get(&w) {
            Some(Sync::Live { generation: g, .. }) | Some(Sync::Syncing { generation: g, .. })
                if *g >= generation =>
            {
                false
            }
            Some(_) => {
                // Restarted engine: empty cache, events from 1.
                self.clear(w);
                self.workers.insert(
                    w,
                    Sync::Live {
                        generation,
                        next: 1,
                    },
                );
                false
            }
            None => {
                self.workers
                    .insert(w, Sync::syncing(generation, Repair::dump()));
                true
            }
        }
    }

    /// Workers whose index still waits for a repair (a stream fill or a dump).
    pub fn syncing(&self) -> usize {
        self.workers
            .values()
            .filter(|s| matches!(s, Sync::Syncing { .. }))
            .count()
    }

    /// Publish-to-apply delay of the worker's last event batch (ms).
    pub fn lag_ms(&self, w: WorkerId) -> u64 {
        self.lag_ms.get(&w).copied().unwrap_or(0)
    }

    /// The worker is gone.
    pub fn worker_gone(&mut self, w: WorkerId) {
        self.workers.remove(&w);
        self.lag_ms.remove(&w);
        self.published_ms.remove(&w);
        self.index.remove_worker(w);
    }

    fn clear(&mut self, w: WorkerId) {
        let _ = self.index.apply(&IndexEvent {
            worker: w,
            data: IndexEventData::Cleared,
        });
    }

    /// Applies a batch; returns true if the worker needs a dump.
    pub fn batch(&mut self, b: KvEventBatch) -> bool {
        let w = b.worker_id;
        self.lag_ms.insert(
            w,
            dynamo_bus_schema::unix_ms().saturating_sub(b.published_unix_ms),
        );
        let published = b.published_unix_ms;
        let dump = self.batch_events(b);
        self.published_ms.insert(w, published);
        dump
    }

    fn batch_events(&mut self, b: KvEventBatch) -> bool {
        let w = b.worker_id;
        match self.workers.get(&w) {
            None => {
                self.workers
                    .insert(w, Sync::syncing(b.generation, Repair::dump()));
                self.feed(w, b.events);
                return true;
            }
            Some(Sync::Live { generation, .. }) | Some(Sync::Syncing { generation, .. })
                if *generation > b.generation =>
            {
                return false; // from before a restart
            }
            Some(Sync::Live { generation, .. }) | Some(Sync::Syncing { generation, .. })
                if *generation < b.generation =>
            {
                self.clear(w);
                self.workers.insert(
                    w,
                    Sync::Live {
                        generation: b.generation,
                        next: 1,
                    },
                );
            }
            _ => {}
        }
        self.feed(w, b.events)
    }

    /// Takes a worker's events in order. Those in sequence on a live worker
    /// are applied together at the end (or before a gap re-syncs it), so
    /// that the index overlaps their cache misses (`apply_batch`).
    fn feed(&mut self, w: WorkerId, events: Vec<KvEvent>) -> bool {
        let mut ready = Vec::new();
        let dump = self.feed_into(w, events, &mut ready);
        self.apply_ready(w, ready);
        dump
    }

    fn feed_into(
        &mut self,
        w: WorkerId,
        events: Vec<KvEvent>,
        ready: &mut Vec<IndexEvent>,
    ) -> bool {
        let mut iter = events.into_iter();
        while let Some(ev) = iter.next() {
            let Some(state) = self.workers.get_mut(&w) else {
                return false;
            };
            match state {
                Sync::Syncing {
                    buffer,
                    buffered_blocks,
                    overflowed,
                    ..
                } => {
                    if buffer.len() < MAX_BUFFER
                        && *buffered_blocks + ev.blocks.len() <= MAX_BUFFER_BLOCKS
                    {
                        *buffered_blocks += ev.blocks.len();
                        buffer.push(ev);
                    } else {
                        *overflowed = true;
                    }
                }
                Sync::Live { generation, next } => {
                    let id = ev.event_id.0;
                    if id < *next {
                        self.stats.duplicates += 1;
                    } else if id > *next {
                        self.stats.gaps += 1;
                        tracing::warn!(worker = %w, expected = *next, got = id, "KV event gap; filling it from the KV events stream");
                        let since_unix_ms = match self.published_ms.get(&w) {
                            Some(&t) => t,
                            None => dynamo_bus_schema::unix_ms().saturating_sub(FILL_WINDOW_MS),
                        }
                        .saturating_sub(FILL_MARGIN_MS);
                        *state = Sync::syncing(
                            *generation,
                            Repair::Stream {
                                from: *next,
                                since_unix_ms,
                                asked_at: None,
                            },
                        );
                        let rest: Vec<KvEvent> = std::iter::once(ev).chain(iter).collect();
                        self.feed_into(w, rest, ready);
                        return true;
                    } else {
                        *next += 1;
                        match index_event(w, ev) {
                            Some(e) => ready.push(e),
                            None => self.stats.unknown += 1,
                        }
                    }
                }
            }
        }
        false
    }

    /// Applies one worker's events, in order. The index refuses only a
    /// worker it has no slot for, and then refuses every later event of
    /// that worker too (bar no-ops), so none of them counts as applied.
    fn apply_ready(&mut self, w: WorkerId, ready: Vec<IndexEvent>) {
        if ready.is_empty() {
            return;
        }
        match self.index.apply_batch(&ready) {
            Ok(()) => {
                self.stats.applied += ready.len() as u64;
                self.since_snapshot += ready.len() as u64;
            }
            Err(e) => tracing::error!(worker = %w, error = %e, "KV index refused events"),
        }
    }

    /// A dump arrived: replace the worker's blocks in every tier, then
    /// replay what was buffered.
    pub fn dump(&mut self, d: impl Into<KvDumpTiered>) {
        let d: KvDumpTiered = d.into();
        let w = d.worker_id;
        let buffer = match self.workers.get_mut(&w) {
            Some(Sync::Syncing {
                generation, buffer, ..
            }) if *generation <= d.generation => std::mem::take(buffer),
            Some(Sync::Live { generation, .. }) if *generation < d.generation => Vec::new(),
            None => Vec::new(),
            _ => return, // stale dump
        };
        self.stats.dumps += 1;
        self.clear(w);
        for t in d.tiers {
            let Some(tier) = tier(t.tier) else { continue };
            let data = IndexEventData::Stored {
                tier,
                parent: None,
                blocks: t.blocks,
            };
            if let Err(e) = self.index.apply(&IndexEvent { worker: w, data }) {
                tracing::error!(error = %e, "KV index refused a dump");
            }
        }
        self.workers.insert(
            w,
            Sync::Live {
                generation: d.generation,
                next: d.last_event_id.0 + 1,
            },
        );
        // Replay only the contiguous run that follows the dump; anything past
        // a hole is dropped (a later real event reveals a true gap), so one
        // bogus event cannot cause dump after dump.
        let mut next = d.last_event_id.0 + 1;
        let mut rest = Vec::new();
        for e in buffer {
            if e.event_id.0 < next {
                continue;
            }
            if e.event_id.0 > next {
                self.stats.gaps += 1;
                tracing::warn!(worker = %w, expected = next, got = e.event_id.0, "dropping buffered KV events past a hole");
                break;
            }
            next += 1;
            rest.push(e);
        }
        self.feed(w, rest);
    }

    /// A starting replica replays the KV events stream from here on.
    pub fn begin_replay(&mut self) {
        self.replaying = true;
    }

    pub fn replaying(&self) -> bool {
        self.replaying
    }

    /// Replaces the index with a snapshot's. Only workers `registered`
    /// with the snapshot's generation are kept (others are gone or have
    /// restarted since); returns the blocks loaded.
    pub fn restore(
        &mut self,
        snap: &KvIndexSnapshot,
        registered: impl Fn(WorkerId) -> Option<u64>,
    ) -> Result<u64, SnapshotError> {
        Ok(self.install(Self::restored(snap, registered)?))
    }

    /// The first half of [`Self::restore`], which reads nothing of `self`:
    /// the index built from the snapshot (the slow part, done without the
    /// lock while the router reads the old index).
    pub fn restored(
        snap: &KvIndexSnapshot,
        registered: impl Fn(WorkerId) -> Option<u64>,
    ) -> Result<Restored, SnapshotError> {
        let mut index = KvIndex::from_runs(&snap.runs, dynamo_kv_index::MAX_WORKERS)?;
        let keep: HashMap<WorkerId, (u64, EventId)> = snap
            .workers
            .iter()
            .filter(|w| registered(w.worker_id) == Some(w.generation))
            .map(|w| (w.worker_id, (w.generation, w.last_event_id)))
            .collect();
        let all: Vec<WorkerId> = index.workers().collect();
        for w in all {
            if !keep.contains_key(&w) {
                index.remove_worker(w);
            }
        }
        Ok(Restored { index, keep })
    }

    /// The second half of [`Self::restore`]: swaps the built index in.
    pub fn install(&mut self, r: Restored) -> u64 {
        self.index = r.index;
        for (w, (generation, last)) in r.keep {
            self.workers.insert(
                w,
                Sync::Live {
                    generation,
                    next: last.0 + 1,
                },
            );
        }
        let blocks = self.index.len() as u64;
        self.stats.snapshot_blocks += blocks;
        blocks
    }

    /// The stream no longer holds every message after the snapshot: what a
    /// worker did meanwhile may be lost, so every worker is synced from a
    /// dump once the replay ends.
    pub fn stream_truncated(&mut self) {
        self.stats.stream_truncated += 1;
        for s in self.workers.values_mut() {
            if let Sync::Live { generation, .. } = *s {
                *s = Sync::syncing(generation, Repair::dump());
            }
        }
    }

    /// The replay is over: a worker still waiting whose buffered events
    /// start at id 1 had its whole history in the stream and goes live
    /// from it; the rest are dumped from now on.
    pub fn end_replay(&mut self) {
        self.replaying = false;
        let from_start: Vec<(WorkerId, u64)> = self
            .workers
            .iter()
            .filter_map(|(w, s)| match s {
                Sync::Syncing {
                    generation,
                    buffer,
                    overflowed: false,
                    ..
                } if buffer.first().is_some_and(|e| e.event_id.0 == 1) => Some((*w, *generation)),
                _ => None,
            })
            .collect();
        for (w, generation) in from_start {
            let buffer = match self.workers.get_mut(&w) {
                Some(Sync::Syncing { buffer, .. }) => std::mem::take(buffer),
                _ => continue,
            };
            self.clear(w);
            self.workers.insert(
                w,
                Sync::Live {
                    generation,
                    next: 1,
                },
            );
            self.feed(w, buffer);
        }
    }

    /// Events applied since the last snapshot.
    pub fn since_snapshot(&self) -> u64 {
        self.since_snapshot
    }

    /// Largest publish-to-apply delay of any worker's last batch (ms).
    pub fn max_lag_ms(&self) -> u64 {
        self.lag_ms.values().copied().max().unwrap_or(0)
    }

    /// The index of the workers in sync, reflecting at least every stream
    /// message up to `stream_seq` (the caller's promise).
    pub fn snapshot(&mut self, stream_seq: u64, router_id: RouterId) -> KvIndexSnapshot {
        let snap = self.export(stream_seq, router_id);
        self.snapshot_taken();
        snap
    }

    /// A snapshot was taken: events since it count from zero.
    pub fn snapshot_taken(&mut self) {
        self.since_snapshot = 0;
        self.stats.snapshots_taken += 1;
    }

    /// [`Self::snapshot`] without counting it: reads only, so the indexer
    /// exports under a read lock while the router keeps routing, then
    /// calls [`Self::snapshot_taken`].
    pub fn export(&self, stream_seq: u64, router_id: RouterId) -> KvIndexSnapshot {
        let live: HashMap<WorkerId, KvSnapshotWorker> = self
            .workers
            .iter()
            .filter_map(|(w, s)| match s {
                Sync::Live { generation, next } => Some((
                    *w,
                    KvSnapshotWorker {
                        worker_id: *w,
                        generation: *generation,
                        last_event_id: EventId(next - 1),
                    },
                )),
                Sync::Syncing { .. } => None,
            })
            .collect();
        let runs = self.index.export_runs(|w| live.contains_key(&w));
        KvIndexSnapshot {
            stream_seq,
            taken_unix_ms: dynamo_bus_schema::unix_ms(),
            router_id,
            workers: live.into_values().collect(),
            runs,
        }
    }

    /// Workers whose dump should be (re-)requested now; marks them asked.
    /// None while the stream is being replayed.
    pub fn dumps_due(&mut self, now: Instant) -> Vec<WorkerId> {
        let mut due = Vec::new();
        if self.replaying {
            return due;
        }
        for (w, s) in &mut self.workers {
            if let Sync::Syncing {
                repair: Repair::Dump { asked_at },
                ..
            } = s
            {
                if asked_at.is_none_or(|t| now.duration_since(t) >= DUMP_RETRY) {
                    *asked_at = Some(now);
                    due.push(*w);
                }
            }
        }
        due
    }

    /// Gaps to fill from the KV events stream now; marks them asked. A fill
    /// asked [`FILL_MAX`] ago and not answered gives way to a dump (which
    /// [`KvSync::dumps_due`] then returns). None while the stream is being
    /// replayed.
    pub fn fills_due(&mut self, now: Instant) -> Vec<GapFill> {
        let mut due = Vec::new();
        if self.replaying {
            return due;
        }
        for (w, s) in &mut self.workers {
            let Sync::Syncing {
                generation, repair, ..
            } = s
            else {
                continue;
            };
            match repair {
                Repair::Stream {
                    from,
                    since_unix_ms,
                    asked_at: asked @ None,
                } => {
                    *asked = Some(now);
                    due.push(GapFill {
                        worker: *w,
                        generation: *generation,
                        from: *from,
                        since_unix_ms: *since_unix_ms,
                    });
                }
                Repair::Stream {
                    asked_at: Some(t), ..
                } if now.duration_since(*t) >= FILL_MAX => {
                    tracing::warn!(worker = %w, "the KV events stream did not fill the gap in time; re-syncing from a dump");
                    self.stats.stream_fill_failures += 1;
                    *repair = Repair::dump();
                }
                _ => {}
            }
        }
        due
    }

    /// The stream's answer to `fill`: the worker's events it holds (any
    /// order, any ids), or why it could not be read. When they join the
    /// worker's place to what was buffered since the gap, all of it is
    /// applied in order and the worker is live again; otherwise it is
    /// re-synced from a dump. A stale answer (the worker was repaired,
    /// restarted or re-gapped meanwhile) is dropped.
    pub fn filled(&mut self, fill: &GapFill, found: Result<Vec<KvEvent>, String>) {
        let w = fill.worker;
        let Some(Sync::Syncing {
            generation,
            buffer,
            repair,
            overflowed,
            ..
        }) = self.workers.get_mut(&w)
        else {
            return;
        };
        let asked =
            matches!(repair, Repair::Stream { from, asked_at: Some(_), .. } if *from == fill.from);
        if *generation != fill.generation || !asked {
            return;
        }
        if *overflowed {
            // Events past the buffer's bounds were dropped: what follows
            // it is unknown, so only a dump puts the worker right.
            tracing::warn!(worker = %w, "events were dropped while the gap was filled; re-syncing from a dump");
            self.stats.stream_fill_failures += 1;
            *repair = Repair::dump();
            return;
        }
        let mut events = match found {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(worker = %w, error = %e, "cannot fill the KV event gap from the stream; re-syncing from a dump");
                self.stats.stream_fill_failures += 1;
                *repair = Repair::dump();
                return;
            }
        };
        events.sort_by_key(|e| e.event_id.0);
        let mut next = fill.from;
        let mut run = Vec::new();
        for e in events {
            if e.event_id.0 < next {
                continue;
            }
            if e.event_id.0 > next {
                break;
            }
            next += 1;
            run.push(e);
        }
        if buffer.first().is_some_and(|b| b.event_id.0 > next) {
            tracing::warn!(worker = %w, from = fill.from, reached = next, "the KV events stream does not hold the whole gap; re-syncing from a dump");
            self.stats.stream_fill_failures += 1;
            *repair = Repair::dump();
            return;
        }
        let generation = *generation;
        // The buffer from where the stream's events end (what both hold is
        // not a duplicate the worker sent).
        run.extend(
            std::mem::take(buffer)
                .into_iter()
                .filter(|e| e.event_id.0 >= next),
        );
        self.stats.stream_fills += 1;
        self.workers.insert(
            w,
            Sync::Live {
                generation,
                next: fill.from,
            },
        );
        // A hole further on, inside the buffer, is filled from the same
        // point in the stream (the newest batch came after it).
        self.published_ms
            .insert(w, fill.since_unix_ms.saturating_add(FILL_MARGIN_MS));
        self.feed(w, run);
    }
}

#[cfg(test)]
#[path = "kv_sync_tests.rs"]
mod tests;
