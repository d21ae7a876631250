//! `RouterActor`: a thin shell around [`RouterState`]. Its feeds
//! ([`crate::feeds`]) bring the bus in (the workers KV bucket, watched with
//! history; load reports; KV events; peers' load), dumps
//! ([`crate::dumps`]) fill the index, and it answers route/release/list
//! calls from the gateway.
//!
//! Invariants: every task is owned by the actor's `Tasks`: they stop with
//! its state, and one that ends on its own fails the actor (its supervisor
//! restarts it with fresh feeds, and it catches up again before routing);
//! route calls are bounded by the gateway's admission, feeds by their
//! gates, ticks by one outstanding each.

use crate::dumps::request_dump;
use crate::feeds::{self, FEED_BACKLOG};
use crate::policy::{build, PolicyKind};
use crate::state::{ModelEntry, RouteDecision, RouteError, RouterState, WorkerEntry};
use dynamo_bus_schema::WireMessage;
use dynamo_bus_schema::{
    ActiveLoadEvent, FaultKind, KvDumpTiered, KvEventBatch, KvIndexSnapshot, LoadReport, ModelName,
    RequestId, RouterHeartbeat, RouterId, WorkerId, WorkerRegistration,
};
use dynamo_runtime::{counters, Bus, Gate, Tasks, Ticket};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Router settings.
#[derive(Clone, Debug)]
pub struct RouterConfig {
    /// A worker not heard from for this long is not routed to and is forgotten.
    pub worker_ttl: Duration,
    /// How to pick among eligible workers.
    pub policy: PolicyKind,
    /// When prefill moves to prefill workers (disaggregated serving).
    pub disagg: crate::DisaggPolicy,
    /// How long a worker that refused a request as overloaded is avoided.
    pub overload_backoff: Duration,
    /// When the KV index is written to the object store.
    pub kv_snapshot: crate::kv_stream::KvSnapshotConfig,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            worker_ttl: Duration::from_secs(3),
            policy: PolicyKind::LeastLoaded,
            disagg: crate::DisaggPolicy::default(),
            overload_backoff: crate::state::DEFAULT_OVERLOAD_BACKOFF,
            kv_snapshot: Default::default(),
        }
    }
}

/// The router's mailbox. Messages from bus feeds carry their feed's
/// [`Ticket`] (dropped once handled), which bounds how many wait.
pub enum RouterMsg {
    Upsert(Box<WorkerRegistration>, Ticket),
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
    KvFilled(
        crate::kv_sync::GapFill,
        Result<Vec<dynamo_bus_schema::KvEvent>, String>,
    ),
    /// A snapshot of the index to write, tagged with this stream
    /// sequence, if this replica should write one now, given what the
    /// store holds.
    TakeKvSnapshot(
        u64,
        crate::kv_stream::StoredSnapshot,
        RpcReplyPort<Option<KvIndexSnapshot>>,
    ),
    Remove(WorkerId, Ticket),
    Load(LoadReport, Ticket),
    Expire(Ticket),
    Route {
        request_id: RequestId,
        model: ModelName,
        token_ids: Arc<Vec<u32>>,
        exclude: Vec<WorkerId>,
        /// Per-request KV cost weights.
        weights: Option<crate::policy::KvCostWeights>,
        reply: RpcReplyPort<Result<RouteDecision, RouteError>>,
    },
    /// An own request finished (in any way).
    Release(RequestId),
    /// An own request's first token came back.
    PrefillDone(RequestId),
    /// A worker refused one of this gateway's requests as overloaded.
    WorkerOverloaded(WorkerId),
    RemoteLoad(ActiveLoadEvent, Ticket),
    PeerHeartbeat(RouterId, Ticket),
    LoadSnapshot(Vec<ActiveLoadEvent>),
    /// The peer snapshot step is over (loaded, or no peer answered).
    SnapshotDone,
    /// The worker registry's history has been read.
    RegistryLoaded,
    ServeSnapshot(RpcReplyPort<Vec<ActiveLoadEvent>>),
    /// Publish this router's heartbeat.
    Heartbeat(Ticket),
    /// A background task ended on its own (its input is gone).
    TaskEnded(String),
    /// Fault injection: [`FaultKind::EndTask`] ends the named task,
    /// [`FaultKind::PanicActor`] panics in the handler,
    /// [`FaultKind::DropKvBatch`] drops the next live KV event batch.
    InjectFault(FaultKind, String),
    Models(RpcReplyPort<Vec<ModelEntry>>),
    KvInfo(RpcReplyPort<KvInfo>),
    Info(RpcReplyPort<dynamo_bus_schema::RouterInfo>),
    Overlap {
        model: ModelName,
        token_ids: Vec<u32>,
        reply: RpcReplyPort<Vec<(WorkerId, dynamo_kv_index::Overlap)>>,
    },
    Workers(RpcReplyPort<Vec<WorkerEntry>>),
}

/// The KV index as the router sees it (for metrics and status).
#[derive(Clone, Debug)]
pub struct KvInfo {
    pub stats: crate::kv_sync::KvStats,
    /// Indexed blocks per worker: device, host, disk.
    pub blocks: Vec<(WorkerId, [u64; 3])>,
    /// Where routing time went.
    pub timings: crate::timing::RouteTimings,
    /// Workers whose block size / hash salt disagree with their model's.
    pub mismatched: Vec<WorkerId>,
    /// Active load per worker, as all replicas together see it.
    pub load: Vec<(WorkerId, crate::active::WorkerLoad)>,
    pub policy: &'static str,
}

pub struct RouterActor;

pub struct RouterArgs {
    pub bus: Bus,
    pub config: RouterConfig,
}

pub struct RouterRuntime {
    state: RouterState,
    bus: Bus,
    /// Load events and heartbeats for the peers, published by a task of
    /// their own (the bus never stalls routing). Bounded: when the bus is
    /// away and it fills, newer ones are dropped (peers expire what they
    /// miss with this router's heartbeats).
    to_peers: tokio::sync::mpsc::Sender<ToPeers>,
    tasks: Tasks,
    /// The KV events feed starts once the registry's history is read (so
    /// that replayed batches find their workers registered).
    kv_feed_started: bool,
    kv_snapshot: crate::kv_stream::KvSnapshotConfig,
    /// Fault injection: drop the next live KV event batch.
    drop_next_kv_batch: bool,
}

/// Longest a starting replica waits for the KV events replay before it
/// syncs the workers it did not cover from dumps.
const KV_REPLAY_MAX: Duration = Duration::from_secs(30);

impl RouterRuntime {
    /// Starts the repairs due: gap fills from the KV events stream, and
    /// dumps (for workers first seen, and gaps the stream could not fill).
    fn spawn_dumps(&mut self, myself: &ActorRef<RouterMsg>, now: Instant) {
        for fill in self.state.kv_fills_due(now) {
            self.tasks.spawn_transient(
                "kv-fill",
                crate::kv_stream::fill_gap(self.bus.clone(), fill, myself.clone()),
            );
        }
        for w in self.state.kv_dumps_due(now) {
            self.tasks
                .spawn_transient("kv-dump", request_dump(self.bus.clone(), w, myself.clone()));
        }
    }
}

/// Load events and heartbeats that may wait for the bus.
const TO_PEERS_BACKLOG: usize = 8192;

enum ToPeers {
    Load(ActiveLoadEvent),
    Heartbeat(RouterHeartbeat),
}

impl RouterRuntime {
    fn tell_peers(&self, m: ToPeers) {
        if self.to_peers.try_send(m).is_err() {
            tracing::debug!("peer load backlog full; dropping an update");
        }
    }
}

/// Publishes what the router tells its peers.
async fn publish_to_peers(bus: Bus, mut rx: tokio::sync::mpsc::Receiver<ToPeers>) {
    let subject = bus.subjects.router_load();
    while let Some(m) = rx.recv().await {
        let res = match &m {
            ToPeers::Load(ev) => bus.publish(subject.clone(), ev).await,
            ToPeers::Heartbeat(hb) => bus.publish(subject.clone(), hb).await,
        };
        if let Err(e) = res {
            // Peers expire what they miss; our own view stays exact.
            tracing::debug!(error = %e, "cannot publish to peer routers");
        }
    }
}

impl Actor for RouterActor {
    type Msg = RouterMsg;
    type State = RouterRuntime;
    type Arguments = RouterArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<RouterMsg>,
        args: RouterArgs,
    ) -> Result<RouterRuntime, ActorProcessingErr> {
        let me = myself.clone();
        let tasks = Tasks::new(Arc::new(move |why| {
            let _ = me.cast(RouterMsg::TaskEnded(why));
        }));
        let bus = args.bus.clone();
        let mut state = RouterState::new(args.config.worker_ttl, build(args.config.policy));
        state.set_disagg(args.config.disagg);
        state.set_overload_backoff(args.config.overload_backoff);
        state.begin_catch_up(Instant::now());
        tasks.spawn(
            "workers",
            feeds::watch_workers(bus.clone(), myself.clone(), Gate::new(FEED_BACKLOG)),
        );
        tasks.spawn(
            "load-reports",
            feeds::forward::<LoadReport>(
                bus.clone(),
                bus.subjects.load_all(),
                myself.clone(),
                Gate::new(FEED_BACKLOG),
                RouterMsg::Load,
            ),
        );
        if let Err(e) = bus.ensure_kv_events_stream().await {
            tracing::warn!(error = %e, "cannot create the KV events stream");
        }
        if args.config.kv_snapshot.enabled {
            tasks.spawn(
                "kv-snapshots",
                crate::kv_stream::snapshots(
                    bus.clone(),
                    myself.clone(),
                    args.config.kv_snapshot.clone(),
                ),
            );
        }
        let period = (args.config.worker_ttl / 4).max(Duration::from_millis(50));
        tasks.spawn(
            "expiry-tick",
            feeds::ticker(period, myself.clone(), RouterMsg::Expire),
        );
        tasks.spawn(
            "info",
            feeds::serve_info(bus.clone(), myself.clone(), tasks.token()),
        );
        // Peers' load: subscribe first, then ask a peer for its snapshot,
        // so nothing between the two is lost.
        let sub = bus.client.subscribe(bus.subjects.router_load()).await?;
        tasks.spawn(
            "peer-load",
            feeds::peer_load(
                sub,
                state.router_id(),
                myself.clone(),
                Gate::new(FEED_BACKLOG),
            ),
        );
        tasks.spawn(
            "snapshots",
            feeds::snapshots(
                bus.clone(),
                state.router_id(),
                myself.clone(),
                tasks.token(),
            ),
        );
        tasks.spawn(
            "heartbeat-tick",
            feeds::ticker(Duration::from_secs(1), myself.clone(), RouterMsg::Heartbeat),
        );
        let (to_peers, rx) = tokio::sync::mpsc::channel(TO_PEERS_BACKLOG);
        tasks.spawn("to-peers", publish_to_peers(bus.clone(), rx));
        tracing::info!(policy = state.policy_name(), "router started");
        Ok(RouterRuntime {
            state,
            bus,
            to_peers,
            tasks,
            kv_feed_started: false,
            kv_snapshot: args.config.kv_snapshot,
            drop_next_kv_batch: false,
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<RouterMsg>,
        rt: &mut RouterRuntime,
    ) -> Result<(), ActorProcessingErr> {
        rt.tasks.shutdown();
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<RouterMsg>,
        msg: RouterMsg,
        rt: &mut RouterRuntime,
    ) -> Result<(), ActorProcessingErr> {
        let s = &mut rt.state;
        let now = Instant::now();
        match msg {
            RouterMsg::Upsert(reg, _ticket) => {
                s.upsert(*reg, now);
                // A worker seen for the first time is dumped at once, not at
                // the next tick: a starting replica routes only after that.
                rt.spawn_dumps(&myself, now);
            }
            RouterMsg::KvBatch(_, _ticket) if rt.drop_next_kv_batch => {
                rt.drop_next_kv_batch = false;
                tracing::warn!("fault injected: a live KV event batch dropped");
            }
            RouterMsg::KvBatch(b, _ticket) => {
                if s.kv_batch(b) {
                    rt.spawn_dumps(&myself, now);
                }
            }
            RouterMsg::KvSnapshotNotWritten => s.kv_snapshot_not_written(),
            RouterMsg::KvFilled(fill, found) => {
                s.kv_filled(&fill, found);
                rt.spawn_dumps(&myself, now);
            }
            RouterMsg::KvDump(d) => s.kv_dump(d),
            RouterMsg::KvSnapshot(snap) => match s.kv_restore(&snap) {
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
            RouterMsg::KvStreamTruncated => s.kv_stream_truncated(),
            RouterMsg::KvReplayed(b, _ticket) => s.kv_replayed(b),
            RouterMsg::KvReplayDone => {
                s.kv_replay_done();
                rt.spawn_dumps(&myself, now);
            }
            RouterMsg::TakeKvSnapshot(seq, stored, reply) => {
                let _ = reply.send(s.kv_snapshot(seq, stored, &rt.kv_snapshot, now));
            }
            RouterMsg::Remove(id, _ticket) => s.remove(id),
            RouterMsg::Load(r, _ticket) => s.load(r, now),
            RouterMsg::Expire(_ticket) => {
                s.expire(now);
                s.kv_replay_overdue(now, KV_REPLAY_MAX);
                rt.spawn_dumps(&myself, now);
            }
            RouterMsg::WorkerOverloaded(w) => s.overloaded(w, now),
            RouterMsg::TaskEnded(why) => return Err(format!("router: {why}").into()),
            RouterMsg::InjectFault(FaultKind::PanicActor, _) => {
                panic!("fault injected into the router")
            }
            RouterMsg::InjectFault(FaultKind::EndTask, task) => {
                if !rt.tasks.end(&task) {
                    tracing::warn!(task, tasks = ?rt.tasks.names(), "no such task to end");
                }
            }
            RouterMsg::InjectFault(FaultKind::DropKvBatch, _) => rt.drop_next_kv_batch = true,
            RouterMsg::InjectFault(other, _) => {
                tracing::warn!(?other, "fault not applicable to the router")
            }
            RouterMsg::Route {
                request_id,
                model,
                token_ids,
                exclude,
                weights,
                reply,
            } => match s.route_with(request_id, &model, &token_ids, &exclude, weights, now) {
                Ok((d, ev)) => {
                    if reply.send(Ok(d)).is_err() {
                        // The caller gave up: undo the accounting.
                        s.release(request_id);
                    } else {
                        rt.tell_peers(ToPeers::Load(ev));
                    }
                }
                Err(e) => {
                    let _ = reply.send(Err(e));
                }
            },
            RouterMsg::Release(id) => {
                if let Some(ev) = s.release(id) {
                    rt.tell_peers(ToPeers::Load(ev));
                }
            }
            RouterMsg::PrefillDone(id) => {
                if let Some(ev) = s.prefill_done(id) {
                    rt.tell_peers(ToPeers::Load(ev));
                }
            }
            RouterMsg::RemoteLoad(ev, _ticket) => s.remote_load(&ev, now),
            RouterMsg::PeerHeartbeat(p, _ticket) => s.peer_heartbeat(p, now),
            RouterMsg::LoadSnapshot(entries) => {
                tracing::info!(
                    entries = entries.len(),
                    "loaded the active-load snapshot of a peer"
                );
                s.load_snapshot(&entries, now);
            }
            RouterMsg::SnapshotDone => s.snapshot_done(),
            RouterMsg::RegistryLoaded => {
                s.registry_loaded();
                if !rt.kv_feed_started {
                    rt.kv_feed_started = true;
                    rt.tasks.spawn(
                        "kv-events",
                        crate::kv_stream::follow(
                            rt.bus.clone(),
                            myself.clone(),
                            Gate::new(FEED_BACKLOG),
                        ),
                    );
                }
            }
            RouterMsg::ServeSnapshot(reply) => {
                let _ = reply.send(s.active_snapshot());
            }
            RouterMsg::Heartbeat(_ticket) => {
                let hb = RouterHeartbeat {
                    router_id: s.router_id(),
                };
                rt.tell_peers(ToPeers::Heartbeat(hb));
            }
            RouterMsg::KvInfo(reply) => {
                let blocks = s
                    .workers()
                    .iter()
                    .map(|w| (w.reg.worker_id, s.kv_blocks_of(w.reg.worker_id)))
                    .collect();
                let load = s
                    .workers()
                    .iter()
                    .map(|w| (w.reg.worker_id, s.worker_load(w.reg.worker_id)))
                    .collect();
                let _ = reply.send(KvInfo {
                    stats: s.kv_stats(),
                    blocks,
                    load,
                    mismatched: s.kv_mismatches(),
                    timings: s.timings().clone(),
                    policy: s.policy_name(),
                });
            }
            RouterMsg::Info(reply) => {
                let _ = reply.send(s.info());
            }
            RouterMsg::Overlap {
                model,
                token_ids,
                reply,
            } => {
                let _ = reply.send(s.overlap(&model, &token_ids));
            }
            RouterMsg::Models(reply) => {
                let _ = reply.send(s.models());
            }
            RouterMsg::Workers(reply) => {
                let _ = reply.send(s.workers());
            }
        }
        Ok(())
    }
}
