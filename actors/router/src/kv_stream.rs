//! The KV events feed of a router replica's indexer, and its snapshots.
//!
//! Workers publish their event batches on `kv.<worker>`; the KV events
//! stream (JetStream, bounded by age and bytes, see
//! [`dynamo_runtime::Bus::ensure_kv_events_stream`]) keeps them. A replica
//! follows new batches on core NATS (the lowest latency, and nothing to
//! re-create when a NATS server fails) and uses the stream for what it was
//! not there for:
//!
//! 1. subscribe to `kv.*` (what arrives from now on waits in the
//!    subscription);
//! 2. load the newest index snapshot from the object store, if any;
//! 3. replay the stream from the snapshot's sequence + 1 (or its start) up
//!    to its last message at this moment — if the stream no longer holds
//!    the message after the snapshot, it was truncated, and every worker
//!    is synced from a dump instead;
//! 4. follow the subscription (batches the replay already applied are
//!    dropped as duplicates by their event ids).
//!
//! Dumps wait until step 3 is over (`KvSync::begin_replay`): a new replica
//! asks a worker for one only when the stream cannot fill its gap. A gap
//! found later, on the live feed (a batch core NATS lost), is filled the
//! same way ([`fill_gap`]): the worker's own messages read back from the
//! stream, a dump only when they are not all there.
//!
//! Snapshots: every `period` the replica with the lowest id among the live
//! ones (or another, when the store's newest is stale: see
//! [`crate::indexer_state::IndexerState::snapshot`]) writes its index to the
//! object store, tagged with the stream's last sequence as read one period
//! earlier — every message up to it was published at least a period ago
//! and is applied (one that was not shows up as an event id gap to the
//! replica that loads the snapshot, which repairs that worker). Once events
//! stop, the last snapshot is written again with the newer tag (nothing
//! was applied since; while the stream moves and nothing is applied, as
//! when workers are still syncing, once per interval), so that a replica
//! loading it replays none of what it holds. A snapshot taken but not
//! stored is taken again at the next interval.
//!
//! Invariants: every message cast carries a ticket of the feed's gate; an
//! undecodable message or snapshot is rejected and counted, never fatal; a
//! stream or object store that cannot be reached ends the replay (dumps
//! take over), it never holds the router.

use crate::indexer::IndexerMsg;
use crate::kv_sync::GapFill;
use dynamo_bus_schema::codec::MAX_ASSEMBLED;
use dynamo_bus_schema::{
    decode, decode_assembled, encode, KvEvent, KvEventBatch, KvIndexSnapshot, WireMessage,
    KV_SNAPSHOT_OBJECT,
};
use dynamo_runtime::{counters, Bus, Gate};
use futures::StreamExt;
use ractor::ActorRef;
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;

/// When the replica writes its KV index to the object store.
#[derive(Clone, Debug, PartialEq)]
pub struct KvSnapshotConfig {
    /// Write snapshots (a replica that starts loads one either way).
    pub enabled: bool,
    /// Longest time between two snapshots while events arrive; keep it well
    /// under the stream's retention (600 s, 256 MiB), or a replica that
    /// starts finds the stream truncated and falls back to dumps.
    pub interval: Duration,
    /// A snapshot is due once this many events were applied since the last.
    pub events: u64,
}

impl Default for KvSnapshotConfig {
    fn default() -> Self {
        KvSnapshotConfig {
            enabled: true,
            interval: Duration::from_secs(30),
            events: 500_000,
        }
    }
}

impl KvSnapshotConfig {
    /// How often the writer checks whether a snapshot is due (and how old
    /// the stream sequence it is tagged with is).
    pub fn check_period(&self) -> Duration {
        (self.interval / 4).clamp(Duration::from_millis(250), Duration::from_secs(5))
    }
}

/// A replay that receives nothing for this long is over (the messages it
/// waited for expired meanwhile).
const REPLAY_IDLE: Duration = Duration::from_secs(3);

/// Longest the newest snapshot may take to load (a 1M-block one takes
/// about 0.1 s here); past it the catch-up goes on without it.
const SNAPSHOT_LOAD_TIMEOUT: Duration = Duration::from_secs(30);

/// The KV events feed: catch-up from the stream, then core NATS.
pub async fn follow(bus: Bus, indexer: ActorRef<IndexerMsg>, gate: Gate) {
    if let Err(e) = bus.ensure_kv_events_stream().await {
        tracing::warn!(error = %e, "cannot create the KV events stream");
    }
    let subject = bus.subjects.kv_events_all();
    let sub = match bus.client.subscribe(subject.clone()).await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(subject, error = %e, "cannot subscribe to KV events");
            let _ = indexer.cast(IndexerMsg::KvReplayDone);
            return;
        }
    };
    let t0 = Instant::now();
    // Bounded: a snapshot that cannot be read in time is skipped (every
    // worker the replay cannot cover is then dumped), so the live feed
    // always starts.
    let snap = match tokio::time::timeout(SNAPSHOT_LOAD_TIMEOUT, load_snapshot(&bus)).await {
        Ok(s) => s,
        Err(_) => {
            tracing::warn!(
                timeout_s = SNAPSHOT_LOAD_TIMEOUT.as_secs(),
                "loading the KV index snapshot timed out; workers are synced from the stream and dumps"
            );
            None
        }
    };
    let after = snap.as_ref().map(|s| s.stream_seq).unwrap_or(0);
    let snap_ms = t0.elapsed().as_millis() as u64;
    if let Some(s) = snap {
        if indexer.cast(IndexerMsg::KvSnapshot(Box::new(s))).is_err() {
            return;
        }
    }
    let mut sink = ToIndexer {
        indexer: &indexer,
        gate: &gate,
    };
    let replayed = match replay(&bus, after, &mut sink).await {
        Ok(n) => n,
        Err(e) => {
            // What the snapshot's workers did since is unknown: dump them.
            tracing::warn!(error = %e, "cannot replay the KV events stream; workers are synced from dumps");
            let _ = indexer.cast(IndexerMsg::KvStreamTruncated);
            0
        }
    };
    tracing::info!(
        snapshot_ms = snap_ms,
        total_ms = t0.elapsed().as_millis() as u64,
        replayed,
        "KV events stream replayed"
    );
    if indexer.cast(IndexerMsg::KvReplayDone).is_err() {
        return;
    }
    crate::feeds::forward_from::<KvEventBatch, _>(sub, indexer, gate, IndexerMsg::KvBatch).await;
}

/// The newest snapshot in the object store, if one can be read.
pub async fn load_snapshot(bus: &Bus) -> Option<KvIndexSnapshot> {
    let bucket = bus.subjects.router_state_objects();
    let store = match bus.object_store(&bucket).await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "cannot open the router state store");
            return None;
        }
    };
    let mut obj = match store.get(KV_SNAPSHOT_OBJECT).await {
        Ok(o) => o,
        Err(e) => {
            tracing::info!(reason = %e, "no KV index snapshot to load");
            return None;
        }
    };
    if obj.info().size > MAX_ASSEMBLED {
        counters::reject(
            KvIndexSnapshot::NAME,
            &bucket,
            &format!("{} bytes, over {MAX_ASSEMBLED}", obj.info().size),
        );
        return None;
    }
    let mut bytes = Vec::with_capacity(obj.info().size);
    if let Err(e) = obj.read_to_end(&mut bytes).await {
        tracing::warn!(error = %e, "cannot read the KV index snapshot");
        return None;
    }
    match decode_assembled::<KvIndexSnapshot>(&bytes) {
        Ok(s) => Some(s),
        Err(e) => {
            counters::reject(KvIndexSnapshot::NAME, &bucket, &e);
            None
        }
    }
}

/// What a replay hands on, in stream order.
pub enum Replayed {
    /// The stream no longer holds the message after `after` (comes first).
    Truncated,
    Batch(KvEventBatch),
}

/// Where a replay goes.
pub trait ReplaySink: Send {
    /// Takes the next item; false stops the replay.
    fn take(&mut self, item: Replayed) -> impl std::future::Future<Output = bool> + Send;
}

/// Replayed batches into the indexer's mailbox, through the feed's gate.
struct ToIndexer<'a> {
    indexer: &'a ActorRef<IndexerMsg>,
    gate: &'a Gate,
}

impl ReplaySink for ToIndexer<'_> {
    async fn take(&mut self, item: Replayed) -> bool {
        match item {
            Replayed::Truncated => self.indexer.cast(IndexerMsg::KvStreamTruncated).is_ok(),
            Replayed::Batch(b) => {
                let ticket = self.gate.enter().await;
                self.indexer.cast(IndexerMsg::KvReplayed(b, ticket)).is_ok()
            }
        }
    }
}

/// Replays the stream's messages after `after` up to its last one now into
/// `sink`; returns how many were replayed.
pub async fn replay(bus: &Bus, after: u64, sink: &mut impl ReplaySink) -> Result<u64, String> {
    use async_nats::jetstream::consumer::{push, DeliverPolicy};
    let name = bus.subjects.kv_events_stream();
    let mut stream = bus.js.get_stream(&name).await.map_err(|e| e.to_string())?;
    let state = stream
        .info()
        .await
        .map_err(|e| e.to_string())?
        .state
        .clone();
    let (first, last) = (state.first_sequence, state.last_sequence);
    // Truncated: what followed the snapshot is gone, or the stream was
    // re-created (its sequence restarted below the snapshot's).
    if after + 1 < first || after > last {
        tracing::warn!(
            snapshot_seq = after,
            stream_first = first,
            "the KV events stream no longer holds what followed the snapshot"
        );
        if !sink.take(Replayed::Truncated).await {
            return Ok(0);
        }
    }
    let start = (after + 1).max(first).max(1);
    if start > last {
        return Ok(0);
    }
    let consumer = stream
        .create_consumer(push::OrderedConfig {
            deliver_subject: bus.client.new_inbox(),
            deliver_policy: DeliverPolicy::ByStartSequence {
                start_sequence: start,
            },
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    let mut messages = consumer.messages().await.map_err(|e| e.to_string())?;
    let mut n = 0;
    // Whether a hole at the head was already reported, and whether a
    // message was delivered yet.
    let mut truncated = after + 1 < first || after > last;
    let mut delivered = false;
    loop {
        let m = match tokio::time::timeout(REPLAY_IDLE, messages.next()).await {
            Ok(Some(Ok(m))) => m,
            Ok(Some(Err(e))) => return Err(e.to_string()),
            Ok(None) => return Err(format!("the replay ended after {n} batches, before {last}")),
            Err(_) => {
                return Err(format!(
                    "the replay stalled after {n} batches, before sequence {last}"
                ))
            }
        };
        let seq = m.info().map(|i| i.stream_sequence).ok();
        let first_delivery = !std::mem::replace(&mut delivered, true);
        // The head was trimmed (age or bytes) between reading the stream's
        // state and the first delivery: what lay before `seq` is gone too.
        if first_delivery && seq.is_some_and(|q| q > start) && !truncated {
            truncated = true;
            tracing::warn!(
                snapshot_seq = after,
                first_delivered = seq.unwrap_or_default(),
                "the KV events stream lost its head while the replay started"
            );
            if !sink.take(Replayed::Truncated).await {
                return Ok(0);
            }
        }
        match decode::<KvEventBatch>(&m.payload) {
            Ok(b) => {
                if !sink.take(Replayed::Batch(b)).await {
                    return Ok(n);
                }
                n += 1;
            }
            Err(e) => counters::reject(KvEventBatch::NAME, m.subject.as_str(), &e),
        }
        if seq.unwrap_or(last) >= last {
            break;
        }
    }
    Ok(n)
}

/// Most events one gap fill may bring back (as many as a worker's buffer
/// holds while it waits): past it the fill fails and a dump follows.
const FILL_MAX_EVENTS: usize = 100_000;

/// Fills `fill`'s gap: the worker's events of its generation from id
/// `from` on, read back from the KV events stream (only that worker's
/// subject, from when its last batch before the gap was published) up to
/// the stream's last message now. Casts the answer to the indexer, which
/// applies it or falls back to a dump.
pub async fn fill_gap(bus: Bus, fill: GapFill, indexer: ActorRef<IndexerMsg>) {
    let found = read_gap(&bus, &fill).await;
    let _ = indexer.cast(IndexerMsg::KvFilled(fill, found));
}

async fn read_gap(bus: &Bus, fill: &GapFill) -> Result<Vec<KvEvent>, String> {
    use async_nats::jetstream::consumer::{push, DeliverPolicy};
    let name = bus.subjects.kv_events_stream();
    let mut stream = bus.js.get_stream(&name).await.map_err(|e| e.to_string())?;
    let last = stream
        .info()
        .await
        .map_err(|e| e.to_string())?
        .state
        .last_sequence;
    // async-nats takes a start time as `time`'s type (not chrono's).
    let start_time =
        time::OffsetDateTime::from_unix_timestamp_nanos(fill.since_unix_ms as i128 * 1_000_000)
            .map_err(|e| e.to_string())?;
    let consumer = stream
        .create_consumer(push::OrderedConfig {
            deliver_subject: bus.client.new_inbox(),
            filter_subject: bus.subjects.kv_events(fill.worker),
            deliver_policy: DeliverPolicy::ByStartTime { start_time },
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    let mut messages = consumer.messages().await.map_err(|e| e.to_string())?;
    let mut events = Vec::new();
    loop {
        let m = match tokio::time::timeout(REPLAY_IDLE, messages.next()).await {
            Ok(Some(Ok(m))) => m,
            Ok(Some(Err(e))) => return Err(e.to_string()),
            // Nothing more of this worker's up to now (or it went quiet).
            Ok(None) | Err(_) => break,
        };
        // Nothing more of this worker's after it: the consumer says so,
        // so the fill need not wait out the idle timeout.
        let (seq, pending) = m
            .info()
            .map(|i| (i.stream_sequence, i.pending))
            .unwrap_or((last, 0));
        match decode::<KvEventBatch>(&m.payload) {
            Ok(b) if b.worker_id == fill.worker && b.generation == fill.generation => {
                events.extend(b.events.into_iter().filter(|e| e.event_id.0 >= fill.from));
                if events.len() > FILL_MAX_EVENTS {
                    return Err(format!("more than {FILL_MAX_EVENTS} events to fill"));
                }
            }
            Ok(_) => {}
            Err(e) => counters::reject(KvEventBatch::NAME, m.subject.as_str(), &e),
        }
        if seq >= last || pending == 0 {
            break;
        }
    }
    Ok(events)
}

/// Writes this replica's index to the object store when it is due.
pub async fn snapshots(bus: Bus, indexer: ActorRef<IndexerMsg>, cfg: KvSnapshotConfig) {
    let period = cfg.check_period();
    let bucket = bus.subjects.router_state_objects();
    let name = bus.subjects.kv_events_stream();
    // The stream's last sequence one period ago.
    let mut earlier: Option<u64> = None;
    let mut iv = tokio::time::interval(period);
    iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        iv.tick().await;
        let now_seq = match bus.js.get_stream(&name).await {
            Ok(mut s) => match s.info().await {
                Ok(i) => Some(i.state.last_sequence),
                Err(_) => None,
            },
            Err(_) => None,
        };
        if let Some(seq) = earlier {
            let stored = stored_snapshot(&bus, &bucket).await;
            let snap = indexer
                .call(
                    |reply| IndexerMsg::TakeKvSnapshot(seq, stored, reply),
                    Some(Duration::from_secs(10)),
                )
                .await;
            if let Ok(ractor::rpc::CallResult::Success(Some(snap))) = snap {
                if !write(&bus, &bucket, &snap).await {
                    // Taken but not stored: the indexer takes one again.
                    let _ = indexer.cast(IndexerMsg::KvSnapshotNotWritten);
                }
            }
        }
        earlier = now_seq;
    }
}

/// What the object store holds of the newest snapshot, as the writer
/// election reads it (see [`crate::indexer_state::IndexerState::snapshot`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoredSnapshot {
    /// Written this long ago.
    Age(Duration),
    /// None there (or deleted).
    Missing,
    /// The store cannot be read: writing would fail too.
    Unknown,
}

/// The age of the newest snapshot in the object store.
async fn stored_snapshot(bus: &Bus, bucket: &str) -> StoredSnapshot {
    let Ok(store) = bus.object_store(bucket).await else {
        return StoredSnapshot::Unknown;
    };
    match store.info(KV_SNAPSHOT_OBJECT).await {
        Ok(info) if info.deleted => StoredSnapshot::Missing,
        Ok(info) => match info.modified {
            Some(m) => {
                let age = time::OffsetDateTime::now_utc() - m;
                StoredSnapshot::Age(age.try_into().unwrap_or(Duration::ZERO))
            }
            None => StoredSnapshot::Missing,
        },
        Err(e) => {
            use async_nats::jetstream::object_store::InfoErrorKind;
            if matches!(e.kind(), InfoErrorKind::NotFound) {
                StoredSnapshot::Missing
            } else {
                StoredSnapshot::Unknown
            }
        }
    }
}

/// Writes `snap` to the object store (logged, never fatal); whether it
/// was written.
pub async fn write(bus: &Bus, bucket: &str, snap: &KvIndexSnapshot) -> bool {
    let t0 = Instant::now();
    let bytes = match encode(snap) {
        Ok(b) => b,
        Err(e) => {
            tracing::warn!(error = %e, "cannot encode the KV index snapshot");
            return false;
        }
    };
    let res = match bus.object_store(bucket).await {
        Ok(store) => store
            .put(KV_SNAPSHOT_OBJECT, &mut bytes.as_slice())
            .await
            .map(|_| ())
            .map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    let written = res.is_ok();
    match res {
        Ok(()) => tracing::info!(
            stream_seq = snap.stream_seq,
            blocks = snap.blocks(),
            workers = snap.workers.len(),
            bytes = bytes.len(),
            ms = t0.elapsed().as_millis() as u64,
            "KV index snapshot written"
        ),
        Err(e) => tracing::warn!(error = %e, "cannot write the KV index snapshot"),
    }
    written
}
