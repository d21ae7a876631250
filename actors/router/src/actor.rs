//! `RouterActor`: a thin shell around [`RouterState`]. It feeds the state
//! from the bus (the workers KV bucket, watched with history, and the load
//! subject) and answers route/release/list calls from the gateway.
//!
//! The watch and load tasks are owned by the actor (a cancellation token
//! stops them in `post_stop`) and re-establish themselves with backoff when
//! the bus drops.

use crate::policy::{build, PolicyKind};
use crate::state::{ModelEntry, RouteDecision, RouteError, RouterState, WorkerEntry};
use dynamo_bus_schema::{
    decode, decode_payload, peek_kind, ActiveLoadEvent, ActiveLoadSnapshot,
    ActiveLoadSnapshotRequest, ErrorKind, KvDump, KvDumpRequest, KvDumpTiered, KvEventBatch,
    LoadReport, ModelName, RequestId, RouterHeartbeat, RouterId, WireError, WireMessage, WorkerId,
    WorkerRegistration,
};
use dynamo_runtime::{counters, Backoff, Bus};
use futures::StreamExt;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Router settings.
#[derive(Clone, Debug)]
pub struct RouterConfig {
    /// A worker not heard from for this long is not routed to and is forgotten.
    pub worker_ttl: Duration,
    /// How to pick among eligible workers.
    pub policy: PolicyKind,
    /// When prefill moves to prefill workers (disaggregated serving).
    pub disagg: crate::DisaggPolicy,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            worker_ttl: Duration::from_secs(3),
            policy: PolicyKind::LeastLoaded,
            disagg: crate::DisaggPolicy::default(),
        }
    }
}

pub enum RouterMsg {
    Upsert(Box<WorkerRegistration>),
    KvBatch(KvEventBatch),
    KvDump(KvDumpTiered),
    Remove(WorkerId),
    Load(LoadReport),
    Expire,
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
    RemoteLoad(ActiveLoadEvent),
    PeerHeartbeat(RouterId),
    LoadSnapshot(Vec<ActiveLoadEvent>),
    /// The peer snapshot step is over (loaded, or no peer answered).
    SnapshotDone,
    /// The worker registry's history has been read.
    RegistryLoaded,
    ServeSnapshot(RpcReplyPort<Vec<ActiveLoadEvent>>),
    /// Publish this router's heartbeat.
    Heartbeat,
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
    tasks: CancellationToken,
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
        let tasks = CancellationToken::new();
        let bucket = args.bus.subjects.workers_bucket();
        tokio::spawn(watch_workers(
            args.bus.clone(),
            bucket,
            myself.clone(),
            tasks.child_token(),
        ));
        tokio::spawn(forward::<LoadReport>(
            args.bus.clone(),
            args.bus.subjects.load_all(),
            myself.clone(),
            tasks.child_token(),
            RouterMsg::Load,
        ));
        if let Err(e) = args.bus.ensure_kv_events_stream().await {
            tracing::warn!(error = %e, "cannot create the KV events stream");
        }
        tokio::spawn(forward::<KvEventBatch>(
            args.bus.clone(),
            args.bus.subjects.kv_events_all(),
            myself.clone(),
            tasks.child_token(),
            RouterMsg::KvBatch,
        ));
        let tick = tasks.child_token();
        let me = myself.clone();
        let period = args.config.worker_ttl / 4;
        tokio::spawn(async move {
            let mut iv = tokio::time::interval(period.max(Duration::from_millis(50)));
            loop {
                tokio::select! {
                    _ = tick.cancelled() => break,
                    _ = iv.tick() => if me.cast(RouterMsg::Expire).is_err() { break },
                }
            }
        });
        let mut state = RouterState::new(args.config.worker_ttl, build(args.config.policy));
        state.set_disagg(args.config.disagg);
        state.begin_catch_up(Instant::now());
        tokio::spawn(serve_info(
            args.bus.clone(),
            myself.clone(),
            tasks.child_token(),
        ));
        tokio::spawn(share_load(
            args.bus.clone(),
            state.router_id(),
            myself.clone(),
            tasks.child_token(),
        ));
        let hb = tasks.child_token();
        let me2 = myself.clone();
        tokio::spawn(async move {
            let mut iv = tokio::time::interval(Duration::from_secs(1));
            loop {
                tokio::select! {
                    _ = hb.cancelled() => break,
                    _ = iv.tick() => if me2.cast(RouterMsg::Heartbeat).is_err() { break },
                }
            }
        });
        tracing::info!(policy = state.policy_name(), "router started");
        Ok(RouterRuntime {
            state,
            bus: args.bus,
            tasks,
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<RouterMsg>,
        rt: &mut RouterRuntime,
    ) -> Result<(), ActorProcessingErr> {
        rt.tasks.cancel();
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
            RouterMsg::Upsert(reg) => {
                s.upsert(*reg, now);
                // A worker seen for the first time is dumped at once, not at
                // the next tick: a starting replica routes only after that.
                for w in s.kv_dumps_due(now) {
                    tokio::spawn(request_dump(rt.bus.clone(), w, myself.clone()));
                }
            }
            RouterMsg::KvBatch(b) => s.kv_batch(b),
            RouterMsg::KvDump(d) => s.kv_dump(d),
            RouterMsg::Remove(id) => s.remove(id),
            RouterMsg::Load(r) => s.load(r, now),
            RouterMsg::Expire => {
                s.expire(now);
                for w in s.kv_dumps_due(now) {
                    tokio::spawn(request_dump(rt.bus.clone(), w, myself.clone()));
                }
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
                        publish_load(&rt.bus, &ev).await;
                    }
                }
                Err(e) => {
                    let _ = reply.send(Err(e));
                }
            },
            RouterMsg::Release(id) => {
                if let Some(ev) = s.release(id) {
                    publish_load(&rt.bus, &ev).await;
                }
            }
            RouterMsg::PrefillDone(id) => {
                if let Some(ev) = s.prefill_done(id) {
                    publish_load(&rt.bus, &ev).await;
                }
            }
            RouterMsg::RemoteLoad(ev) => s.remote_load(&ev, now),
            RouterMsg::PeerHeartbeat(p) => s.peer_heartbeat(p, now),
            RouterMsg::LoadSnapshot(entries) => {
                tracing::info!(
                    entries = entries.len(),
                    "loaded the active-load snapshot of a peer"
                );
                s.load_snapshot(&entries, now);
            }
            RouterMsg::SnapshotDone => s.snapshot_done(),
            RouterMsg::RegistryLoaded => s.registry_loaded(),
            RouterMsg::ServeSnapshot(reply) => {
                let _ = reply.send(s.active_snapshot());
            }
            RouterMsg::Heartbeat => {
                let hb = RouterHeartbeat {
                    router_id: s.router_id(),
                };
                if let Err(e) = rt.bus.publish(rt.bus.subjects.router_load(), &hb).await {
                    tracing::debug!(error = %e, "cannot publish router heartbeat");
                }
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

async fn watch_workers(
    bus: Bus,
    bucket: String,
    router: ActorRef<RouterMsg>,
    cancel: CancellationToken,
) {
    let mut backoff = Backoff::new(
        Duration::from_millis(100),
        Duration::from_secs(2),
        Duration::from_secs(10),
    );
    while !cancel.is_cancelled() {
        let watch = async {
            let kv = bus
                .kv_bucket(&bucket, dynamo_runtime::bus::REGISTRY_MAX_AGE)
                .await?;
            kv.watch_with_history(">")
                .await
                .map_err(|e| dynamo_runtime::BusError::Bucket {
                    bucket: bucket.clone(),
                    reason: e.to_string(),
                })
        };
        let mut w = match watch.await {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch worker registrations; retrying");
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(backoff.next_delay(Instant::now())) => continue,
                }
            }
        };
        // The history is read once an entry says nothing is pending, or
        // when none comes at all (an empty bucket).
        let mut history_read = false;
        let quiet = tokio::time::sleep(Duration::from_millis(200));
        tokio::pin!(quiet);
        loop {
            let entry = tokio::select! {
                _ = cancel.cancelled() => return,
                _ = &mut quiet, if !history_read => {
                    history_read = true;
                    let _ = router.cast(RouterMsg::RegistryLoaded);
                    continue;
                }
                e = w.next() => e,
            };
            // Signalled after this entry's own message (below).
            let last_of_history = matches!(&entry, Some(Ok(e)) if e.delta == 0) && !history_read;
            let entry = match entry {
                Some(Ok(e)) => e,
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "worker watch failed; re-watching");
                    break;
                }
                None => break,
            };
            let msg = match entry.operation {
                async_nats::jetstream::kv::Operation::Put => {
                    match decode::<WorkerRegistration>(&entry.value) {
                        Ok(reg) => RouterMsg::Upsert(Box::new(reg)),
                        Err(e) => {
                            counters::reject("WorkerRegistration", &entry.key, &e);
                            continue;
                        }
                    }
                }
                _ => match entry.key.parse::<WorkerId>() {
                    Ok(id) => RouterMsg::Remove(id),
                    Err(e) => {
                        counters::reject("worker key", &entry.key, &e);
                        continue;
                    }
                },
            };
            if router.cast(msg).is_err() {
                return;
            }
            if last_of_history {
                history_read = true;
                let _ = router.cast(RouterMsg::RegistryLoaded);
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(backoff.next_delay(Instant::now())) => {}
        }
    }
}

async fn publish_load(bus: &Bus, ev: &ActiveLoadEvent) {
    if let Err(e) = bus.publish(bus.subjects.router_load(), ev).await {
        // Peers expire what they miss; our own view stays exact.
        tracing::debug!(error = %e, "cannot publish active load");
    }
}

/// Follows the other replicas' load: subscribes first, then asks a peer for
/// a snapshot (so nothing between the two is lost), then serves snapshots to
/// replicas that start after this one.
async fn share_load(
    bus: Bus,
    me: RouterId,
    router: ActorRef<RouterMsg>,
    cancel: CancellationToken,
) {
    let mut sub = match bus.client.subscribe(bus.subjects.router_load()).await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot subscribe to router load");
            return;
        }
    };
    let fwd_cancel = cancel.clone();
    let fwd_router = router.clone();
    tokio::spawn(async move {
        loop {
            let m = tokio::select! {
                _ = fwd_cancel.cancelled() => return,
                m = sub.next() => m,
            };
            let Some(m) = m else { return };
            let msg = match peek_kind(&m.payload) {
                Ok((k, p)) if k == ActiveLoadEvent::KIND => {
                    match decode_payload::<ActiveLoadEvent>(p) {
                        // Our own echo: the state already has it.
                        Ok(ev) if ev.router_id == me => continue,
                        other => other.map(RouterMsg::RemoteLoad),
                    }
                }
                Ok((k, p)) if k == RouterHeartbeat::KIND => decode_payload::<RouterHeartbeat>(p)
                    .map(|h| RouterMsg::PeerHeartbeat(h.router_id)),
                Ok((k, _)) => {
                    counters::reject(
                        "router load",
                        m.subject.as_str(),
                        &format!("unknown kind {}", k.0),
                    );
                    continue;
                }
                Err(e) => Err(e),
            };
            match msg {
                Ok(msg) => {
                    if fwd_router.cast(msg).is_err() {
                        return;
                    }
                }
                Err(e) => counters::reject("router load", m.subject.as_str(), &e),
            }
        }
    });
    let req = ActiveLoadSnapshotRequest { router_id: me };
    // No responder: this is the first replica. A peer that is slow to
    // answer (a loaded machine) is asked again: without its snapshot this
    // replica would not see the requests already in flight.
    for attempt in 1..=3 {
        match bus
            .request::<_, ActiveLoadSnapshot>(
                bus.subjects.router_snapshot(),
                &req,
                Duration::from_secs(2),
            )
            .await
        {
            Ok(snap) => {
                let _ = router.cast(RouterMsg::LoadSnapshot(snap.entries));
                break;
            }
            Err(e @ dynamo_runtime::BusError::NoResponders { .. }) => {
                tracing::info!(reason = %e, "no peer snapshot of the active load (first replica?)");
                break;
            }
            Err(e) => {
                tracing::warn!(reason = %e, attempt, "peer snapshot of the active load failed")
            }
        }
    }
    let _ = router.cast(RouterMsg::SnapshotDone);
    let snap_sub = match bus
        .client
        .queue_subscribe(bus.subjects.router_snapshot(), "routers".into())
        .await
    {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot serve load snapshots");
            return;
        }
    };
    bus.serve(snap_sub, cancel, |_: ActiveLoadSnapshotRequest| async {
        ask(&router, RouterMsg::ServeSnapshot)
            .await
            .map(|entries| ActiveLoadSnapshot { entries })
    })
    .await;
}

/// Answers `dynamoctl`'s info requests (one replica of the queue group answers).
async fn serve_info(bus: Bus, router: ActorRef<RouterMsg>, cancel: CancellationToken) {
    let sub = match bus
        .client
        .queue_subscribe(bus.subjects.router_info(), "routers".into())
        .await
    {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot serve router info");
            return;
        }
    };
    bus.serve(sub, cancel, |_: dynamo_bus_schema::RouterInfoRequest| {
        ask(&router, RouterMsg::Info)
    })
    .await;
}

/// Asks the router actor for something on behalf of a bus request.
async fn ask<T: Send + 'static>(
    router: &ActorRef<RouterMsg>,
    msg: fn(RpcReplyPort<T>) -> RouterMsg,
) -> Result<T, WireError> {
    match router.call(msg, Some(Duration::from_secs(2))).await {
        Ok(ractor::rpc::CallResult::Success(v)) => Ok(v),
        _ => Err(WireError::new(
            ErrorKind::Unavailable,
            "router is restarting",
        )),
    }
}

/// Asks a worker for its block table and hands the answer to the router.
async fn request_dump(bus: Bus, w: WorkerId, router: ActorRef<RouterMsg>) {
    let req = KvDumpRequest {
        reason: "router sync".into(),
    };
    let subject = bus.subjects.worker_kv_dump(w);
    let answer = bus
        .request_bytes(subject.clone(), &req, Duration::from_secs(2))
        .await;
    // Workers answer with every tier; a device-only dump is accepted too.
    let dump = answer.map(|b| match peek_kind(&b) {
        Ok((k, p)) if k == KvDump::KIND => decode_payload::<KvDump>(p).map(Into::into),
        _ => decode::<KvDumpTiered>(&b),
    });
    match dump {
        Ok(Ok(d)) => {
            let _ = router.cast(RouterMsg::KvDump(d));
        }
        Ok(Err(e)) => counters::reject("KvDumpTiered", &subject, &e),
        // Retried from the tick until the worker answers or expires.
        Err(e) => tracing::debug!(worker = %w, error = %e, "KV dump request failed"),
    }
}

/// Forwards every decodable `T` published on `subject` to the router as
/// `wrap(T)`; undecodable messages are rejected and counted.
async fn forward<T: WireMessage>(
    bus: Bus,
    subject: String,
    router: ActorRef<RouterMsg>,
    cancel: CancellationToken,
    wrap: fn(T) -> RouterMsg,
) {
    let mut sub = match bus.client.subscribe(subject.clone()).await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(subject, error = %e, "cannot subscribe");
            return;
        }
    };
    loop {
        let msg = tokio::select! {
            _ = cancel.cancelled() => return,
            m = sub.next() => m,
        };
        let Some(msg) = msg else { return };
        match decode::<T>(&msg.payload) {
            Ok(v) => {
                if router.cast(wrap(v)).is_err() {
                    return;
                }
            }
            Err(e) => counters::reject(T::NAME, msg.subject.as_str(), &e),
        }
    }
}
