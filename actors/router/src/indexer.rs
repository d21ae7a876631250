//! `IndexerActor`: the KV index of one router replica, kept by an actor of
//! its own beside the router (a thin shell around
//! [`crate::indexer_state::IndexerState`]).
//!
//! It consumes the KV events (a replay of the JetStream stream from the
//! newest snapshot, then the live feed; see [`crate::kv_stream`]), repairs
//! gaps from the stream or, failing that, from a worker's dump, and
//! writes snapshots to the object store when this replica is the elected
//! writer. The router reads the index through a [`SharedKv`] on every
//! route; the indexer is its only writer, so a flood of events is applied
//! here while the router's mailbox serves routes.
//!
//! Supervision: the router spawns the indexer linked to itself. An indexer
//! that fails (a panic, or one of its tasks ending) is replaced by the
//! router with a fresh index, which catches up from the snapshot and the
//! stream as a starting replica does, while the router keeps routing (on
//! load alone until the new index fills). Past
//! [`crate::actor::INDEXER_RESTARTS_MAX`] failures a minute the router
//! fails too, and the node's supervisor restarts both.
//!
//! Invariants: every task is owned by the indexer's `Tasks` (they stop
//! with it; one that ends on its own fails it); feeds are bounded by their
//! gates, ticks by one outstanding each; notices from the router arrive in
//! the order the router saw the registry change.

use crate::dumps::request_dump;
use crate::feeds::{self, FEED_BACKLOG};
use crate::indexer_state::{IndexerState, Then, ToIndexer};
use crate::kv_stream::{KvSnapshotConfig, StoredSnapshot};
use crate::kv_sync::{GapFill, SharedKv};
use dynamo_bus_schema::{
    FaultKind, KvDumpTiered, KvEvent, KvEventBatch, KvIndexSnapshot, RouterId, WireMessage,
};
use dynamo_runtime::{counters, Bus, Gate, Tasks, Ticket};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest a starting indexer waits for the KV events replay before it
/// syncs the workers it did not cover from dumps.
pub const KV_REPLAY_MAX: Duration = Duration::from_secs(30);

/// The indexer's mailbox. Messages from bus feeds carry their feed's
/// [`Ticket`] (dropped once handled), which bounds how many wait.
pub enum IndexerMsg {
    /// From the router: a registry change, a routed prompt, its view.
    Router(ToIndexer),
    KvBatch(KvEventBatch, Ticket),
    KvDump(KvDumpTiered),
    /// The newest KV index snapshot, loaded while catching up.
    KvSnapshot(Box<KvIndexSnapshot>),
    /// The stream no longer holds what followed the snapshot.
    KvStreamTruncated,
    /// A batch read back from the KV events stream while catching up.
    KvReplayed(KvEventBatch, Ticket),
    /// The stream replay is over (or could not run).
    KvReplayDone,
    /// The last snapshot taken could not be stored: take one again.
    KvSnapshotNotWritten,
    /// The KV events stream's answer to a gap fill.
    KvFilled(GapFill, Result<Vec<KvEvent>, String>),
    /// A snapshot of the index to write, tagged with this stream
    /// sequence, if this replica should write one now, given what the
    /// store holds.
    TakeKvSnapshot(u64, StoredSnapshot, RpcReplyPort<Option<KvIndexSnapshot>>),
    /// Retry due repairs, expire approximate records, end an overdue replay.
    Tick(Ticket),
    /// A background task ended on its own (its input is gone).
    TaskEnded(String),
    /// Fault injection: [`FaultKind::EndTask`] ends the named task,
    /// [`FaultKind::PanicActor`] panics in the handler,
    /// [`FaultKind::DropKvBatch`] drops the next live KV event batch.
    InjectFault(FaultKind, String),
}

pub struct IndexerActor;

pub struct IndexerArgs {
    pub bus: Bus,
    /// The router replica this index belongs to (snapshots name it).
    pub router_id: RouterId,
    /// The index to fill (the router reads it).
    pub kv: SharedKv,
    pub snapshots: KvSnapshotConfig,
    /// How often repairs are retried and approximate records expire.
    pub tick: Duration,
}

pub struct IndexerRuntime {
    state: IndexerState,
    bus: Bus,
    tasks: Tasks,
    /// The KV events feed starts once the router has read the registry's
    /// history (so that replayed batches find their workers registered).
    feed_started: bool,
    snapshots: KvSnapshotConfig,
    /// Fault injection: drop the next live KV event batch.
    drop_next_batch: bool,
}

impl IndexerRuntime {
    /// Starts the repairs due: gap fills from the KV events stream, and
    /// dumps (for workers first seen, and gaps the stream could not fill).
    fn spawn_repairs(&mut self, myself: &ActorRef<IndexerMsg>, now: Instant) {
        for fill in self.state.fills_due(now) {
            self.tasks.spawn_transient(
                "kv-fill",
                crate::kv_stream::fill_gap(self.bus.clone(), fill, myself.clone()),
            );
        }
        for w in self.state.dumps_due(now) {
            self.tasks
                .spawn_transient("kv-dump", request_dump(self.bus.clone(), w, myself.clone()));
        }
    }
}

impl Actor for IndexerActor {
    type Msg = IndexerMsg;
    type State = IndexerRuntime;
    type Arguments = IndexerArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<IndexerMsg>,
        args: IndexerArgs,
    ) -> Result<IndexerRuntime, ActorProcessingErr> {
        let me = myself.clone();
        let tasks = Tasks::new(Arc::new(move |why| {
            let _ = me.cast(IndexerMsg::TaskEnded(why));
        }));
        // Nothing here waits on the bus: the router waits for this start
        // (its routes too). The KV events stream is made sure of by the
        // feed task.
        let bus = args.bus;
        if args.snapshots.enabled {
            tasks.spawn(
                "kv-snapshots",
                crate::kv_stream::snapshots(bus.clone(), myself.clone(), args.snapshots.clone()),
            );
        }
        tasks.spawn(
            "indexer-tick",
            feeds::ticker(args.tick, myself.clone(), IndexerMsg::Tick),
        );
        Ok(IndexerRuntime {
            state: IndexerState::new(args.router_id, args.kv, Instant::now()),
            bus,
            tasks,
            feed_started: false,
            snapshots: args.snapshots,
            drop_next_batch: false,
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<IndexerMsg>,
        rt: &mut IndexerRuntime,
    ) -> Result<(), ActorProcessingErr> {
        rt.tasks.shutdown();
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<IndexerMsg>,
        msg: IndexerMsg,
        rt: &mut IndexerRuntime,
    ) -> Result<(), ActorProcessingErr> {
        let s = &mut rt.state;
        let now = Instant::now();
        match msg {
            IndexerMsg::Router(n) => match s.notice(n, now) {
                // A worker seen for the first time is dumped at once, not
                // at the next tick: a starting replica routes only after.
                Then::Repair => rt.spawn_repairs(&myself, now),
                Then::StartFeed if !rt.feed_started => {
                    rt.feed_started = true;
                    rt.tasks.spawn(
                        "kv-events",
                        crate::kv_stream::follow(
                            rt.bus.clone(),
                            myself.clone(),
                            Gate::new(FEED_BACKLOG),
                        ),
                    );
                }
                Then::StartFeed | Then::Nothing => {}
            },
            IndexerMsg::KvBatch(_, _ticket) if rt.drop_next_batch => {
                rt.drop_next_batch = false;
                tracing::warn!("fault injected: a live KV event batch dropped");
            }
            IndexerMsg::KvBatch(b, _ticket) => {
                if s.batch(b) {
                    rt.spawn_repairs(&myself, now);
                }
            }
            IndexerMsg::KvSnapshotNotWritten => s.snapshot_not_written(),
            IndexerMsg::KvFilled(fill, found) => {
                s.filled(&fill, found);
                rt.spawn_repairs(&myself, now);
            }
            IndexerMsg::KvDump(d) => s.dump(d),
            IndexerMsg::KvSnapshot(snap) => match s.restore(&snap) {
                Ok(blocks) => tracing::info!(
                    blocks,
                    stream_seq = snap.stream_seq,
                    workers = snap.workers.len(),
                    "loaded the KV index snapshot"
                ),
                Err(e) => counters::reject(
                    KvIndexSnapshot::NAME,
                    &rt.bus.subjects.router_state_objects(),
                    &e,
                ),
            },
            IndexerMsg::KvStreamTruncated => s.stream_truncated(),
            IndexerMsg::KvReplayed(b, _ticket) => s.replayed(b),
            IndexerMsg::KvReplayDone => {
                s.replay_done(now);
                rt.spawn_repairs(&myself, now);
            }
            IndexerMsg::TakeKvSnapshot(seq, stored, reply) => {
                let _ = reply.send(s.snapshot(seq, stored, &rt.snapshots, now));
            }
            IndexerMsg::Tick(_ticket) => {
                s.expire(now);
                s.replay_overdue(now, KV_REPLAY_MAX);
                rt.spawn_repairs(&myself, now);
            }
            IndexerMsg::TaskEnded(why) => return Err(format!("indexer: {why}").into()),
            IndexerMsg::InjectFault(FaultKind::PanicActor, _) => {
                panic!("fault injected into the indexer")
            }
            IndexerMsg::InjectFault(FaultKind::EndTask, task) => {
                if !rt.tasks.end(&task) {
                    tracing::warn!(task, tasks = ?rt.tasks.names(), "no such indexer task to end");
                }
            }
            IndexerMsg::InjectFault(FaultKind::DropKvBatch, _) => rt.drop_next_batch = true,
            IndexerMsg::InjectFault(other, _) => {
                tracing::warn!(?other, "fault not applicable to the indexer")
            }
        }
        Ok(())
    }
}
