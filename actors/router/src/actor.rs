//! `RouterActor`: a thin shell around [`RouterState`]. Its feeds
//! ([`crate::feeds`]) bring the bus in (the workers KV bucket, watched with
//! history; load reports; peers' load), and it answers route/release/list
//! calls from the gateway. The KV index is kept by its child, the
//! [`IndexerActor`], which it tells of registry changes and reads through
//! a shared handle.
//!
//! Invariants: every task is owned by the actor's `Tasks`: they stop with
//! its state, and one that ends on its own fails the actor (its supervisor
//! restarts it with fresh feeds, and it catches up again before routing);
//! the indexer is linked to it: one that fails is replaced with a fresh
//! index (at most [`INDEXER_RESTARTS_MAX`] a minute, past which the router
//! fails too), and it stops with the router; route calls are bounded by
//! the gateway's admission, feeds by their gates, ticks by one outstanding
//! each.

use crate::feeds::{self, FEED_BACKLOG};
use crate::indexer::{IndexerActor, IndexerArgs, IndexerMsg};
use crate::kv_sync::{KvStats, KvSync, SharedKv};
use crate::policy::{build, PolicyKind};
use crate::state::{ModelEntry, RouteDecision, RouteError, RouterState, WorkerEntry};
use dynamo_bus_schema::{
    ActiveLoadEvent, FaultKind, LoadReport, ModelName, RequestId, RouterHeartbeat, RouterId,
    WorkerId, WorkerRegistration,
};
use dynamo_runtime::{Bus, Gate, Tasks, Ticket};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
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
    /// An own route was given back without the worker keeping the request
    /// (it refused, failed or could not be reached; the request moved on).
    Release(RequestId),
    /// An own request its worker had taken ended (in any way): released,
    /// and that worker has a place again.
    Finished(RequestId),
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
    /// [`FaultKind::PanicActor`] panics in the handler; any other fault
    /// goes to the indexer.
    InjectFault(FaultKind, String),
    /// Fault injection into the indexer (see [`IndexerMsg::InjectFault`]).
    InjectIndexerFault(FaultKind, String),
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
    /// Times the indexer failed and was replaced with a fresh index.
    pub indexer_restarts: u64,
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
    /// The child that keeps the KV index.
    indexer: ActorRef<IndexerMsg>,
    /// What each new indexer is started with.
    indexer_args: IndexerSettings,
    /// When the indexer failed, within the last minute.
    indexer_failures: std::collections::VecDeque<Instant>,
    /// Indexers replaced since the router started.
    indexer_restarts: u64,
    /// Load events and heartbeats for the peers, published by a task of
    /// their own (the bus never stalls routing). Bounded: when the bus is
    /// away and it fills, newer ones are dropped (peers expire what they
    /// miss with this router's heartbeats).
    to_peers: tokio::sync::mpsc::Sender<ToPeers>,
    tasks: Tasks,
}

/// Most indexer failures a minute the router absorbs; past them it fails
/// too (something outside the indexer is wrong), and the node's
/// supervisor restarts both.
pub const INDEXER_RESTARTS_MAX: usize = 5;

/// What a new indexer is started with (less its fresh index).
#[derive(Clone)]
struct IndexerSettings {
    snapshots: crate::kv_stream::KvSnapshotConfig,
    tick: Duration,
}

/// Starts an indexer, linked to the router, filling `kv`.
async fn spawn_indexer(
    myself: &ActorRef<RouterMsg>,
    bus: &Bus,
    router_id: RouterId,
    kv: SharedKv,
    settings: &IndexerSettings,
) -> Result<ActorRef<IndexerMsg>, ActorProcessingErr> {
    let args = IndexerArgs {
        bus: bus.clone(),
        router_id,
        kv,
        snapshots: settings.snapshots.clone(),
        tick: settings.tick,
    };
    let (indexer, _) = Actor::spawn_linked(None, IndexerActor, args, myself.get_cell()).await?;
    Ok(indexer)
}

/// A fresh index, replaying the stream until its indexer says otherwise
/// (the router holds routing meanwhile, while catching up).
fn fresh_index(stats: KvStats) -> SharedKv {
    let mut kv = KvSync::default();
    kv.stats = stats;
    kv.begin_replay();
    SharedKv::new(kv)
}

impl RouterRuntime {
    /// Tells the indexer what the last message changed, in order. A send
    /// that fails (the indexer is dying) is made good when the router
    /// replaces it: the new one is told the whole registry.
    fn tell_indexer(&mut self) {
        for n in self.state.take_to_indexer() {
            if self.indexer.cast(IndexerMsg::Router(n)).is_err() {
                break;
            }
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
    /// Publishes own requests a peer that now listens does not hold yet.
    fn share_pending(&mut self, now: Instant) {
        // Half the room left to the bus, so a flood of these never crowds
        // out the events of requests that finish meanwhile.
        let budget = self.to_peers.capacity() / 2;
        for ev in self.state.share_pending(now, budget) {
            self.tell_peers(ToPeers::Load(ev));
        }
    }

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
        let period = (args.config.worker_ttl / 4).max(Duration::from_millis(50));
        let indexer_args = IndexerSettings {
            snapshots: args.config.kv_snapshot.clone(),
            tick: period,
        };
        let kv = fresh_index(KvStats::default());
        let indexer =
            spawn_indexer(&myself, &bus, state.router_id(), kv.clone(), &indexer_args).await?;
        state.indexer_replaced(kv);
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
        let mut rt = RouterRuntime {
            state,
            bus,
            indexer,
            indexer_args,
            indexer_failures: Default::default(),
            indexer_restarts: 0,
            to_peers,
            tasks,
        };
        rt.tell_indexer();
        Ok(rt)
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<RouterMsg>,
        rt: &mut RouterRuntime,
    ) -> Result<(), ActorProcessingErr> {
        rt.tasks.shutdown();
        rt.indexer.stop(None);
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<RouterMsg>,
        evt: SupervisionEvent,
        rt: &mut RouterRuntime,
    ) -> Result<(), ActorProcessingErr> {
        let why = match &evt {
            SupervisionEvent::ActorTerminated(cell, _, reason)
                if cell.get_id() == rt.indexer.get_id() =>
            {
                format!("stopped: {reason:?}")
            }
            SupervisionEvent::ActorFailed(cell, err) if cell.get_id() == rt.indexer.get_id() => {
                format!("failed: {err}")
            }
            _ => return Ok(()),
        };
        let now = Instant::now();
        rt.indexer_failures
            .retain(|t| now.duration_since(*t) < Duration::from_secs(60));
        rt.indexer_failures.push_back(now);
        if rt.indexer_failures.len() > INDEXER_RESTARTS_MAX {
            return Err(format!(
                "router: the indexer failed {} times in a minute (last: {why})",
                rt.indexer_failures.len()
            )
            .into());
        }
        tracing::error!(%why, "indexer exited; restarting it with a fresh index");
        rt.indexer_restarts += 1;
        // Counters carry over; the index itself is rebuilt from the
        // snapshot and the stream.
        let kv = fresh_index(rt.state.kv().stats());
        rt.indexer = spawn_indexer(
            &myself,
            &rt.bus,
            rt.state.router_id(),
            kv.clone(),
            &rt.indexer_args,
        )
        .await?;
        rt.state.indexer_replaced(kv);
        rt.tell_indexer();
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<RouterMsg>,
        msg: RouterMsg,
        rt: &mut RouterRuntime,
    ) -> Result<(), ActorProcessingErr> {
        let s = &mut rt.state;
        let now = Instant::now();
        match msg {
            RouterMsg::Upsert(reg, _ticket) => s.upsert(*reg, now),
            RouterMsg::Remove(id, _ticket) => s.remove(id),
            RouterMsg::Load(r, _ticket) => s.load(r, now),
            RouterMsg::Expire(_ticket) => {
                s.expire(now);
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
            RouterMsg::InjectFault(fault, task) | RouterMsg::InjectIndexerFault(fault, task) => {
                let _ = rt.indexer.cast(IndexerMsg::InjectFault(fault, task));
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
                        // The caller gave up: undo the accounting (its
                        // `Added` never went out).
                        let _ = s.release(request_id);
                    } else if let Some(ev) = ev {
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
            RouterMsg::Finished(id) => {
                if let Some(ev) = s.finished(id) {
                    rt.tell_peers(ToPeers::Load(ev));
                }
            }
            RouterMsg::PrefillDone(id) => {
                for ev in s.prefill_done(id, now) {
                    rt.tell_peers(ToPeers::Load(ev));
                }
            }
            RouterMsg::RemoteLoad(ev, _ticket) => {
                s.remote_load(&ev, now);
                rt.share_pending(now);
            }
            RouterMsg::PeerHeartbeat(p, _ticket) => {
                s.peer_heartbeat(p, now);
                rt.share_pending(now);
            }
            RouterMsg::LoadSnapshot(entries) => {
                tracing::info!(
                    entries = entries.len(),
                    "loaded the active-load snapshot of a peer"
                );
                s.load_snapshot(&entries, now);
                rt.share_pending(now);
            }
            RouterMsg::SnapshotDone => s.snapshot_done(),
            RouterMsg::RegistryLoaded => s.registry_loaded(),
            RouterMsg::ServeSnapshot(reply) => {
                let _ = reply.send(s.active_snapshot(now));
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
                    indexer_restarts: rt.indexer_restarts,
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
        rt.tell_indexer();
        Ok(())
    }
}
