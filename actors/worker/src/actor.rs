//! `WorkerActor`: serves one engine on the bus.
//!
//! Subjects: `worker.<id>.generate` (request/reply: ack, then frames to the
//! request's `reply_to`), `worker.<id>.cancel`, `worker.<id>.artifact`;
//! a prefill worker also serves `worker.<id>.prefill`, a decode worker
//! hears `worker.<id>.transfer` (see [`crate::disagg`]). Registration: the worker's record in the workers KV bucket, rewritten
//! every heartbeat with its load; load reports on `load.<id>` in between.
//!
//! Invariants: every accepted request gets exactly one terminal frame (from
//! the engine, the deadline, or shutdown); a draining worker accepts nothing
//! new; all tasks the actor spawns stop when its state is dropped (a
//! `DropGuard` cancels them, also when the actor panics).

use crate::disagg::{KvTransfer, PrefillServer, TransferConfig};
use crate::forward::{Forward, Outcome, PrefillOutcome};
use dynamo_bus_schema::{
    decode, peek_kind, unix_ms, ArtifactChunk, ArtifactRequest, CancelRequest, DrainReply,
    DrainRequest, ErrorKind, ErrorReply, EventId, FaultKind, GenerateAck, GenerateDisagg,
    GenerateRequest, KvDumpRequest, KvDumpTiered, KvEvent, KvEventBatch, KvEventKind, KvTierBlocks,
    LoadReport, ModelCard, NodeId, RequestId, StorageTier, WireError, WireMessage, WorkerId,
    WorkerRegistration, WorkerRole, WorkerState,
};
use dynamo_engine::{Engine, EngineEvent, EngineLimits, KvTier, ValidRequest};
use dynamo_runtime::{counters, Bus};
use futures::StreamExt;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::{CancellationToken, DropGuard};

/// Builds a fresh engine (called at every actor (re)start).
pub type EngineFactory = Arc<dyn Fn() -> Result<Arc<dyn Engine>, String> + Send + Sync + 'static>;

/// Worker settings.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    pub worker_id: WorkerId,
    pub node_id: NodeId,
    pub role: WorkerRole,
    /// How often the registration is rewritten (the router's TTL should be ≥ 3×).
    pub heartbeat_interval: Duration,
    /// How often load is published when it changed.
    pub load_interval: Duration,
    /// How often an open stream that sent nothing gets a heartbeat frame
    /// (the gateway declares a silent worker dead after a few missed ones).
    pub stream_heartbeat: Duration,
    /// KV transfer endpoint of a prefill or decode worker (unused when aggregated).
    pub transfer: TransferConfig,
}

pub struct WorkerArgs {
    pub bus: Bus,
    pub config: WorkerConfig,
    pub card: ModelCard,
    /// Named blobs served over `worker.<id>.artifact` (e.g. `tokenizer.json`).
    pub artifacts: Arc<HashMap<String, Arc<Vec<u8>>>>,
    pub engine: EngineFactory,
    /// Strictly greater than any earlier generation of this worker.
    pub generation: u64,
}

pub enum WorkerMsg {
    Generate(async_nats::Message),
    Cancel(CancelRequest),
    Done(RequestId),
    Heartbeat,
    PublishLoad,
    InjectFault(FaultKind),
    /// Stop taking new requests; replies with the number still in flight.
    Drain(RpcReplyPort<u32>),
    /// Drain (or resume, with `true`) on an admin's request over the bus.
    AdminDrain(bool, RpcReplyPort<DrainReply>),
    /// In-flight request count.
    Inflight(RpcReplyPort<u32>),
    /// Removes the registration (before a graceful stop).
    Deregister(RpcReplyPort<()>),
}

pub struct WorkerActor;

pub struct WorkerRuntime {
    bus: Bus,
    cfg: WorkerConfig,
    engine: Arc<dyn Engine>,
    limits: EngineLimits,
    reg: WorkerRegistration,
    kv: async_nats::jetstream::kv::Store,
    inflight: HashSet<RequestId>,
    last_load: Option<dynamo_bus_schema::LoadMetrics>,
    /// Prefill and decode workers' KV transfer endpoint.
    transfer: Option<Arc<KvTransfer>>,
    /// Requests waiting on a remote prefill (cancelling one stops the wait).
    prefilling: HashMap<RequestId, CancellationToken>,
    tasks: CancellationToken,
    _guard: DropGuard,
}

impl Actor for WorkerActor {
    type Msg = WorkerMsg;
    type State = WorkerRuntime;
    type Arguments = WorkerArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<WorkerMsg>,
        args: WorkerArgs,
    ) -> Result<WorkerRuntime, ActorProcessingErr> {
        let engine = (args.engine)().map_err(|e| format!("engine failed to start: {e}"))?;
        let tasks = CancellationToken::new();
        let guard = tasks.clone().drop_guard();
        let bus = args.bus.clone();
        let s = &bus.subjects;
        let id = args.config.worker_id;
        let kv = bus
            .kv_bucket(&s.workers_bucket(), dynamo_runtime::bus::REGISTRY_MAX_AGE)
            .await
            .map_err(|e| e.to_string())?;

        let role = args.config.role;
        let transfer = if role == WorkerRole::Prefill || role == WorkerRole::Decode {
            let t = KvTransfer::open(id, args.config.transfer.clone(), engine.kv_block_bytes())
                .map_err(|e| format!("KV transfer endpoint: {e}"))?;
            Some(Arc::new(t))
        } else {
            None
        };
        let limits = EngineLimits {
            context_length: args.card.context_length,
            vocab_size: args.card.vocab_size,
        };
        if let (WorkerRole::Prefill, Some(t)) = (role, &transfer) {
            let sub = bus.client.subscribe(s.worker_prefill(id)).await?;
            let server = PrefillServer {
                bus: bus.clone(),
                engine: engine.clone(),
                transfer: t.clone(),
                card: args.card.clone(),
                limits,
                worker_id: id,
            };
            tokio::spawn(server.run(sub, tasks.child_token()));
        }
        if let (WorkerRole::Decode, Some(t)) = (role, &transfer) {
            let sub = bus.client.subscribe(s.worker_transfer(id)).await?;
            tokio::spawn(pump_transfer_starts(sub, t.clone(), tasks.child_token()));
        }
        let gen_sub = bus.client.subscribe(s.worker_generate(id)).await?;
        let cancel_sub = bus.client.subscribe(s.worker_cancel(id)).await?;
        let artifact_sub = bus.client.subscribe(s.worker_artifact(id)).await?;
        spawn_pump(gen_sub, myself.clone(), tasks.child_token(), |m| {
            Some(WorkerMsg::Generate(m))
        });
        spawn_pump(
            cancel_sub,
            myself.clone(),
            tasks.child_token(),
            |m| match decode::<CancelRequest>(&m.payload) {
                Ok(c) => Some(WorkerMsg::Cancel(c)),
                Err(e) => {
                    counters::reject("CancelRequest", m.subject.as_str(), &e);
                    None
                }
            },
        );
        bus.ensure_kv_events_stream()
            .await
            .map_err(|e| e.to_string())?;
        let kv_events = engine.take_kv_events();
        let emits_kv_events = kv_events.is_some();
        if let Some(rx) = kv_events {
            tokio::spawn(publish_kv_events(
                bus.clone(),
                id,
                args.generation,
                rx,
                tasks.child_token(),
            ));
        }
        let dump_sub = bus.client.subscribe(s.worker_kv_dump(id)).await?;
        let (b, eng, generation) = (bus.clone(), engine.clone(), args.generation);
        let cancel = tasks.child_token();
        tokio::spawn(async move {
            b.serve(dump_sub, cancel, |_: KvDumpRequest| {
                kv_dump(eng.clone(), id, generation)
            })
            .await
        });
        let drain_sub = bus.client.subscribe(s.worker_drain(id)).await?;
        let (b, me) = (bus.clone(), myself.clone());
        let cancel = tasks.child_token();
        tokio::spawn(async move {
            b.serve(drain_sub, cancel, |req: DrainRequest| {
                let me = me.clone();
                async move {
                    me.call(
                        |r| WorkerMsg::AdminDrain(req.resume, r),
                        Some(Duration::from_secs(5)),
                    )
                    .await
                    .ok()
                    .and_then(|c| match c {
                        ractor::rpc::CallResult::Success(r) => Some(r),
                        _ => None,
                    })
                    .ok_or_else(|| WireError::new(ErrorKind::Unavailable, "worker is restarting"))
                }
            })
            .await
        });
        let (b, artifacts) = (bus.clone(), args.artifacts.clone());
        let cancel = tasks.child_token();
        tokio::spawn(async move {
            b.serve(artifact_sub, cancel, |req: ArtifactRequest| {
                std::future::ready(artifact_chunk(&artifacts, req))
            })
            .await
        });
        spawn_ticker(
            myself.clone(),
            args.config.heartbeat_interval,
            tasks.child_token(),
            || WorkerMsg::Heartbeat,
        );
        spawn_ticker(
            myself.clone(),
            args.config.load_interval,
            tasks.child_token(),
            || WorkerMsg::PublishLoad,
        );

        let now = unix_ms();
        let reg = WorkerRegistration {
            worker_id: id,
            generation: args.generation,
            node_id: args.config.node_id.clone(),
            pid: std::process::id(),
            role: args.config.role,
            state: WorkerState::Serving,
            engine: engine.kind().to_string(),
            model: args.card.clone(),
            started_unix_ms: now,
            heartbeat_unix_ms: now,
            load: engine.load(),
            kv_events: emits_kv_events,
        };
        let mut rt = WorkerRuntime {
            limits,
            transfer,
            prefilling: HashMap::new(),
            bus,
            cfg: args.config,
            engine,
            reg,
            kv,
            inflight: HashSet::new(),
            last_load: None,
            tasks,
            _guard: guard,
        };
        rt.heartbeat().await?;
        tracing::info!(worker = %id, generation = args.generation, "worker serving");
        Ok(rt)
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<WorkerMsg>,
        rt: &mut WorkerRuntime,
    ) -> Result<(), ActorProcessingErr> {
        rt.tasks.cancel();
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<WorkerMsg>,
        msg: WorkerMsg,
        rt: &mut WorkerRuntime,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            WorkerMsg::Generate(m) => rt.generate(m, myself).await,
            WorkerMsg::Cancel(c) if rt.cfg.role == WorkerRole::Prefill => {
                // Prefills run under their decode worker's request id.
                rt.engine.cancel(c.request_id);
            }
            WorkerMsg::Cancel(c) => {
                if rt.inflight.contains(&c.request_id) {
                    tracing::debug!(request = %c.request_id, reason = ?c.reason, "cancel");
                    if let Some(t) = rt.prefilling.get(&c.request_id) {
                        t.cancel();
                    }
                    rt.engine.cancel(c.request_id);
                }
            }
            WorkerMsg::Done(id) => {
                rt.inflight.remove(&id);
                rt.prefilling.remove(&id);
            }
            WorkerMsg::Heartbeat => {
                if let Err(e) = rt.heartbeat().await {
                    tracing::warn!(error = %e, "heartbeat failed");
                }
            }
            WorkerMsg::PublishLoad => rt.publish_load().await,
            WorkerMsg::InjectFault(FaultKind::PanicActor) => {
                panic!("fault injected into worker {}", rt.cfg.worker_id);
            }
            WorkerMsg::InjectFault(FaultKind::StopTransferProgress) => match &rt.transfer {
                Some(t) => {
                    tracing::warn!(worker = %rt.cfg.worker_id, "fault injected: KV transfer endpoint stops polling");
                    t.stop_progress();
                }
                None => tracing::warn!("no KV transfer endpoint to stop"),
            },
            WorkerMsg::InjectFault(other) => {
                tracing::warn!(?other, "unknown fault kind ignored");
            }
            WorkerMsg::Drain(reply) => {
                rt.reg.state = WorkerState::Draining;
                if let Err(e) = rt.heartbeat().await {
                    tracing::warn!(error = %e, "cannot publish draining state");
                }
                let _ = reply.send(rt.inflight.len() as u32);
            }
            WorkerMsg::AdminDrain(resume, reply) => {
                let state = if resume {
                    WorkerState::Serving
                } else {
                    WorkerState::Draining
                };
                if rt.reg.state != state {
                    tracing::info!(worker = %rt.cfg.worker_id, ?state, "admin changed the worker's state");
                    rt.reg.state = state;
                    if let Err(e) = rt.heartbeat().await {
                        tracing::warn!(error = %e, "cannot publish the worker's state");
                    }
                }
                let _ = reply.send(DrainReply {
                    worker_id: rt.cfg.worker_id,
                    state: rt.reg.state,
                    inflight: rt.inflight.len() as u32,
                });
            }
            WorkerMsg::Inflight(reply) => {
                let _ = reply.send(rt.inflight.len() as u32);
            }
            WorkerMsg::Deregister(reply) => {
                if let Err(e) = rt.kv.delete(rt.cfg.worker_id.to_string()).await {
                    tracing::warn!(error = %e, "cannot delete registration");
                }
                let _ = reply.send(());
            }
        }
        Ok(())
    }
}

impl WorkerRuntime {
    async fn heartbeat(&mut self) -> Result<(), String> {
        self.reg.heartbeat_unix_ms = unix_ms();
        self.reg.load = self.load();
        let bytes: bytes::Bytes = dynamo_bus_schema::encode(&self.reg)
            .map_err(|e| e.to_string())?
            .into();
        let key = self.cfg.worker_id.to_string();
        if let Err(e) = self.kv.put(key.clone(), bytes.clone()).await {
            // A bus restarted without its JetStream state has lost the bucket
            // (and the KV event stream): create them again and retry once.
            tracing::warn!(error = %e, "registration write failed; re-creating the bucket");
            self.kv = self
                .bus
                .kv_bucket(
                    &self.bus.subjects.workers_bucket(),
                    dynamo_runtime::bus::REGISTRY_MAX_AGE,
                )
                .await
                .map_err(|e| e.to_string())?;
            if let Err(e) = self.bus.ensure_kv_events_stream().await {
                tracing::warn!(error = %e, "cannot re-create the KV event stream");
            }
            self.kv.put(key, bytes).await.map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    fn load(&self) -> dynamo_bus_schema::LoadMetrics {
        let mut l = self.engine.load();
        l.inflight_requests = self.inflight.len() as u32;
        l
    }

    async fn publish_load(&mut self) {
        let load = self.load();
        if self.last_load.as_ref() == Some(&load) {
            return;
        }
        let report = LoadReport {
            worker_id: self.cfg.worker_id,
            generation: self.reg.generation,
            load: load.clone(),
        };
        if self
            .bus
            .publish(self.bus.subjects.load(self.cfg.worker_id), &report)
            .await
            .is_ok()
        {
            self.last_load = Some(load);
        }
    }

    async fn reject(&self, m: &async_nats::Message, request_id: RequestId, error: WireError) {
        let ack = GenerateAck {
            request_id,
            worker_id: self.cfg.worker_id,
            rejected: Some(error),
        };
        self.bus.reply(m.reply.as_ref(), &ack).await;
    }

    async fn generate(&mut self, m: async_nats::Message, myself: ActorRef<WorkerMsg>) {
        let received = tokio::time::Instant::now();
        let parsed = match peek_kind(&m.payload) {
            Ok((k, _)) if k == GenerateDisagg::KIND => {
                decode::<GenerateDisagg>(&m.payload).map(|d| (d.request.clone(), Some(d)))
            }
            _ => decode::<GenerateRequest>(&m.payload).map(|r| (r, None)),
        };
        let (req, plan) = match parsed {
            Ok(r) => r,
            Err(e) => {
                counters::reject("GenerateRequest", m.subject.as_str(), &e);
                let reply = ErrorReply {
                    error: WireError::new(ErrorKind::BadMessage, e.to_string()),
                };
                self.bus.reply(m.reply.as_ref(), &reply).await;
                return;
            }
        };
        let id = req.request_id;
        if self.reg.state != WorkerState::Serving {
            let e = WireError::new(ErrorKind::Unavailable, "worker is draining");
            return self.reject(&m, id, e).await;
        }
        if req.model != self.reg.model.name {
            let e = WireError::new(
                ErrorKind::InvalidRequest,
                format!(
                    "this worker serves {}, not {}",
                    self.reg.model.name, req.model
                ),
            );
            return self.reject(&m, id, e).await;
        }
        let now = unix_ms();
        if req.deadline_unix_ms != 0 && req.deadline_unix_ms <= now {
            let e = WireError::new(
                ErrorKind::DeadlineExceeded,
                "deadline passed before admission",
            );
            return self.reject(&m, id, e).await;
        }
        if self.inflight.contains(&id) {
            let e = WireError::new(
                ErrorKind::InvalidRequest,
                format!("request {id} is already running"),
            );
            return self.reject(&m, id, e).await;
        }
        let valid = match ValidRequest::parse(&req, self.limits) {
            Ok(v) => v,
            Err(e) => {
                let e = WireError::new(ErrorKind::InvalidRequest, e.to_string());
                return self.reject(&m, id, e).await;
            }
        };
        let prefill = Arc::new(std::sync::Mutex::new(PrefillOutcome::default()));
        // A decode worker given a prefill worker feeds the engine's events
        // through a pipe that first waits for the remote prefill.
        let events = match (plan, &self.transfer) {
            (Some(plan), Some(t)) if self.cfg.role == WorkerRole::Decode => {
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                let cancel = self.tasks.child_token();
                self.prefilling.insert(id, cancel.clone());
                let pipe = RemotePrefillPipe {
                    bus: self.bus.clone(),
                    engine: self.engine.clone(),
                    transfer: t.clone(),
                    card: self.reg.model.clone(),
                    req: req.clone(),
                    plan,
                    valid,
                    outcome: prefill.clone(),
                };
                tokio::spawn(pipe.run(tx, cancel));
                rx
            }
            _ => match self.engine.generate(valid) {
                Ok(ev) => ev,
                Err(e) => return self.reject(&m, id, e.to_wire()).await,
            },
        };
        self.inflight.insert(id);
        let ack = GenerateAck {
            request_id: id,
            worker_id: self.cfg.worker_id,
            rejected: None,
        };
        self.bus.reply(m.reply.as_ref(), &ack).await;

        let remaining = if req.deadline_unix_ms == 0 {
            Duration::from_secs(24 * 3600)
        } else {
            Duration::from_millis(req.deadline_unix_ms.saturating_sub(now))
        };
        let fwd = Forward {
            bus: self.bus.clone(),
            worker_id: self.cfg.worker_id,
            request_id: id,
            reply_to: req.reply_to,
            prompt_tokens: req.token_ids.len() as u32,
            deadline: tokio::time::Instant::now() + remaining,
            heartbeat: self.cfg.stream_heartbeat,
            last_sent: tokio::time::Instant::now(),
            received,
            prefill,
        };
        let engine = self.engine.clone();
        let cancel = self.tasks.child_token();
        tokio::spawn(async move {
            let outcome = fwd.run(events, cancel, || engine.cancel(id)).await;
            if let Outcome::Failed(kind) = &outcome {
                tracing::debug!(request = %id, ?kind, "request failed");
            }
            // The actor may be gone (restart); nothing to account then.
            let _ = myself.cast(WorkerMsg::Done(id));
        });
    }
}

/// Remote prefill, then the engine's own events, into one stream.
struct RemotePrefillPipe {
    bus: Bus,
    engine: Arc<dyn Engine>,
    transfer: Arc<KvTransfer>,
    card: ModelCard,
    req: GenerateRequest,
    plan: GenerateDisagg,
    valid: ValidRequest,
    outcome: Arc<std::sync::Mutex<PrefillOutcome>>,
}

impl RemotePrefillPipe {
    async fn run(
        self,
        tx: tokio::sync::mpsc::UnboundedSender<EngineEvent>,
        cancel: CancellationToken,
    ) {
        let id = self.req.request_id;
        let remote = tokio::select! {
            r = self.transfer.remote_prefill(&self.bus, &self.engine, &self.card, &self.req, &self.plan) => r,
            _ = cancel.cancelled() => {
                let why = dynamo_bus_schema::CancelReason::ClientDisconnected;
                crate::disagg::cancel_prefill(&self.bus, self.plan.prefill_worker, id, why).await;
                let _ = tx.send(EngineEvent::Finished { reason: dynamo_bus_schema::FinishReason::Cancelled });
                return;
            }
        };
        if let Ok(mut o) = self.outcome.lock() {
            match remote {
                Ok(done) => {
                    tracing::debug!(request = %id, prefill_worker = %done.reply.worker_id, blocks = done.imported, windows = done.windows, "remote prefill done");
                    o.remote = Some(done.reply);
                }
                Err(why) => {
                    tracing::warn!(request = %id, reason = %why, "remote prefill not used; prefilling locally");
                    o.fallback = Some(why);
                }
            }
        }
        if tx.is_closed() {
            return;
        }
        let mut events = match self.engine.generate(self.valid) {
            Ok(ev) => ev,
            Err(e) => {
                let _ = tx.send(EngineEvent::Failed(e));
                return;
            }
        };
        while let Some(ev) = events.recv().await {
            if tx.send(ev).is_err() {
                self.engine.cancel(id);
                return;
            }
        }
    }
}

/// Tells the transfer endpoint when a prefill worker starts writing.
async fn pump_transfer_starts(
    mut sub: async_nats::Subscriber,
    transfer: Arc<KvTransfer>,
    cancel: CancellationToken,
) {
    loop {
        let m = tokio::select! {
            _ = cancel.cancelled() => break,
            m = sub.next() => m,
        };
        let Some(m) = m else { break };
        match decode::<dynamo_bus_schema::TransferStarting>(&m.payload) {
            Ok(t) => transfer.transfer_starting(t.request_id),
            Err(e) => counters::reject("TransferStarting", m.subject.as_str(), &e),
        }
    }
    let _ = sub.unsubscribe().await;
}

fn spawn_pump(
    mut sub: async_nats::Subscriber,
    to: ActorRef<WorkerMsg>,
    cancel: CancellationToken,
    map: impl Fn(async_nats::Message) -> Option<WorkerMsg> + Send + 'static,
) {
    tokio::spawn(async move {
        loop {
            let m = tokio::select! {
                _ = cancel.cancelled() => break,
                m = sub.next() => m,
            };
            let Some(m) = m else { break };
            if let Some(msg) = map(m) {
                if to.cast(msg).is_err() {
                    break;
                }
            }
        }
        let _ = sub.unsubscribe().await;
    });
}

fn spawn_ticker(
    to: ActorRef<WorkerMsg>,
    period: Duration,
    cancel: CancellationToken,
    msg: impl Fn() -> WorkerMsg + Send + 'static,
) {
    tokio::spawn(async move {
        let mut iv = tokio::time::interval(period);
        iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        iv.tick().await;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = iv.tick() => if to.cast(msg()).is_err() { break },
            }
        }
    });
}

/// Publishes the engine's KV events, one batch per wake-up (one engine step
/// usually), in order. The subject is captured by the KV events stream.
async fn publish_kv_events(
    bus: Bus,
    worker_id: WorkerId,
    generation: u64,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<dynamo_engine::KvCacheEvent>,
    cancel: CancellationToken,
) {
    let subject = bus.subjects.kv_events(worker_id);
    loop {
        let first = tokio::select! {
            _ = cancel.cancelled() => break,
            e = rx.recv() => e,
        };
        let Some(first) = first else { break };
        let mut events = vec![to_wire(first)];
        while let Ok(e) = rx.try_recv() {
            events.push(to_wire(e));
            if events.len() >= 1024 {
                break;
            }
        }
        let batch = KvEventBatch {
            worker_id,
            generation,
            events,
            published_unix_ms: unix_ms(),
        };
        if let Err(e) = bus.publish(subject.clone(), &batch).await {
            // Routers detect the gap by event id and ask for a dump.
            tracing::warn!(error = %e, "cannot publish KV events");
        }
    }
}

fn to_wire(e: dynamo_engine::KvCacheEvent) -> KvEvent {
    use dynamo_engine::KvCacheEventData as D;
    let (kind, parent, blocks) = match e.data {
        D::Stored { parent, blocks } => (KvEventKind::Stored, parent, blocks),
        D::Removed { blocks } => (KvEventKind::Removed, None, blocks),
        D::Cleared => (KvEventKind::Cleared, None, Vec::new()),
    };
    KvEvent {
        event_id: EventId(e.event_id),
        kind,
        tier: wire_tier(e.tier),
        parent,
        blocks,
    }
}

/// The engine's block table in every tier, consistent with its events so far.
async fn kv_dump(
    engine: Arc<dyn Engine>,
    worker_id: WorkerId,
    generation: u64,
) -> Result<KvDumpTiered, WireError> {
    let stopped = || WireError::new(ErrorKind::EngineFailed, "engine stopped");
    let snap = engine
        .kv_snapshot()
        .map_err(|_| stopped())?
        .await
        .map_err(|_| stopped())?;
    let mut tiers = vec![KvTierBlocks {
        tier: StorageTier::Device,
        blocks: snap.blocks,
    }];
    for (tier, blocks) in snap.offloaded {
        tiers.push(KvTierBlocks {
            tier: wire_tier(tier),
            blocks,
        });
    }
    Ok(KvDumpTiered {
        worker_id,
        generation,
        last_event_id: EventId(snap.last_event_id),
        tiers,
    })
}

fn wire_tier(t: KvTier) -> StorageTier {
    match t {
        KvTier::Device => StorageTier::Device,
        KvTier::Host => StorageTier::Host,
        KvTier::Disk => StorageTier::Disk,
    }
}

/// Largest chunk served per artifact request (NATS caps messages at 1 MiB).
pub const ARTIFACT_CHUNK: u32 = 512 * 1024;

/// One byte range of a named artifact.
fn artifact_chunk(
    artifacts: &HashMap<String, Arc<Vec<u8>>>,
    req: ArtifactRequest,
) -> Result<ArtifactChunk, WireError> {
    match artifacts.get(&req.name) {
        Some(data) if req.offset <= data.len() as u64 => {
            let start = req.offset as usize;
            let len = (req.max_len.min(ARTIFACT_CHUNK) as usize).min(data.len() - start);
            Ok(ArtifactChunk {
                name: req.name,
                total_len: data.len() as u64,
                offset: req.offset,
                data: data[start..start + len].to_vec(),
            })
        }
        _ => Err(WireError::new(
            ErrorKind::InvalidRequest,
            format!("no artifact {:?} at offset {}", req.name, req.offset),
        )),
    }
}
