//! `WorkerActor`: serves one engine on the bus.
//!
//! Subjects: `worker.<id>.generate` (request/reply: ack, then frames to the
//! request's `reply_to`), `worker.<id>.cancel`, `worker.<id>.artifact`,
//! `worker.<id>.kv_dump`, `worker.<id>.drain`; a prefill worker also
//! serves `worker.<id>.prefill`, a decode worker hears
//! `worker.<id>.transfer` (see [`crate::disagg`]). Its registration and
//! load reports are kept fresh by [`crate::registration`], its KV events
//! published by [`crate::kv_events`], its other endpoints answered by
//! [`crate::endpoints`]; each runs in a task of its own.
//!
//! Invariants: every accepted request gets exactly one terminal frame (from
//! the engine, the deadline, or shutdown); a draining worker accepts
//! nothing new; every task the actor spawns is owned by its [`Tasks`]: the
//! tasks stop with its state (also when it panics), and one that ends on
//! its own fails the actor, so the supervisor restarts it; an engine whose
//! driver dies makes the worker register as `Failed` at once and fail, so
//! it is restarted with a fresh engine; at most the engine's capacity of
//! generate messages wait in the mailbox (more are refused `Overloaded`).

use crate::admit::{self, Admission};
use crate::disagg::{KvTransfer, PrefillServer, RemotePrefillPipe, TransferConfig};
use crate::endpoints;
use crate::forward::{Forward, Outcome, PrefillOutcome};
use crate::mux::Outgoing;
use crate::registration::{register, Registration};
use dynamo_bus_schema::{
    decode, unix_ms, ArtifactRequest, CancelReason, CancelRequest, DrainReply, DrainRequest,
    ErrorKind, ErrorReply, FaultKind, GenerateAck, KvDumpRequest, ModelCard, NodeId, RequestId,
    WireError, WorkerId, WorkerRegistration, WorkerRole, WorkerState,
};
use dynamo_engine::{Engine, EngineFault, EngineLimits, Readiness};
use dynamo_runtime::{counters, Bus, Gate, Tasks, Ticket};
use futures::StreamExt;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

/// Builds a fresh engine (called at every actor (re)start).
pub type EngineFactory = Arc<dyn Fn() -> Result<Arc<dyn Engine>, String> + Send + Sync + 'static>;

/// Cancels that may wait in the mailbox at once (more wait in the bus
/// subscription; each names a request in flight, so they are few).
const CANCEL_BACKLOG: usize = 1024;

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
    /// Period of the load and timing summaries published for the planner.
    pub metrics_interval: Duration,
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
    Generate(async_nats::Message, Ticket),
    Cancel(CancelRequest, Ticket),
    Done(RequestId),
    /// A fault, and for [`FaultKind::EndTask`] the task to end.
    InjectFault(FaultKind, String),
    /// The engine's driver stopped on its own.
    EngineDied,
    /// An engine that was loading serves now (`Ok`), or never will.
    EngineReady(Result<(), String>),
    /// Whether the engine serves yet.
    EngineReadyNow(RpcReplyPort<bool>),
    /// A background task ended on its own (its input is gone).
    TaskEnded(String),
    /// Stop taking new requests; replies with the number still in flight.
    Drain(RpcReplyPort<u32>),
    /// Drain (or resume, with `true`) on an admin's request over the bus.
    AdminDrain(bool, RpcReplyPort<DrainReply>),
    /// In-flight request count.
    Inflight(RpcReplyPort<u32>),
    /// Removes the registration (before a graceful stop).
    Deregister(RpcReplyPort<()>),
    /// Time to look for requests nobody waits for ([`crate::orphans`]).
    CheckOrphans,
    /// A probe of a gateway inbox found no responder (`true`) or not.
    GatewayProbe(String, bool),
}

pub struct WorkerActor;

pub struct WorkerRuntime {
    bus: Bus,
    cfg: WorkerConfig,
    engine: Arc<dyn Engine>,
    limits: EngineLimits,
    model: ModelCard,
    registration: Registration,
    inflight: HashSet<RequestId>,
    /// Where each request in flight streams, to find those no gateway
    /// waits for any more.
    orphans: crate::orphans::Orphans,
    /// Prefill and decode workers' KV transfer endpoint.
    transfer: Option<Arc<KvTransfer>>,
    /// A prefill worker's server (its cancels go only to what it runs).
    prefill: Option<PrefillServer>,
    /// Requests waiting on a remote prefill (cancelling one stops the wait).
    prefilling: HashMap<RequestId, tokio_util::sync::CancellationToken>,
    /// Timings measured around the engine (for the planner).
    stats: Arc<crate::stats::WorkerStats>,
    /// Where forwards queue their frames ([`crate::mux`]).
    frames: crate::mux::FrameSink,
    /// Whether the engine serves yet (until then the registration says
    /// `Starting`, and a resume leaves it so).
    engine_ready: bool,
    tasks: Tasks,
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
        let me = myself.clone();
        let tasks = Tasks::new(Arc::new(move |why| {
            let _ = me.cast(WorkerMsg::TaskEnded(why));
        }));
        let bus = args.bus.clone();
        let s = &bus.subjects;
        let id = args.config.worker_id;
        let role = args.config.role;
        let stats = Arc::new(crate::stats::WorkerStats::with_series(
            crate::prom::Series::new(&id.to_string(), &args.card.name.0, role),
        ));
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
        let mut prefill = None;
        if let (WorkerRole::Prefill, Some(t)) = (role, &transfer) {
            let sub = bus.client.subscribe(s.worker_prefill(id)).await?;
            let server = PrefillServer {
                stats: stats.clone(),
                bus: bus.clone(),
                engine: engine.clone(),
                transfer: t.clone(),
                card: args.card.clone(),
                limits,
                worker_id: id,
                slots: Arc::new(tokio::sync::Semaphore::new(engine.capacity())),
                active: Default::default(),
            };
            tasks.spawn(
                "prefill-server",
                server.clone().run(sub, tasks.spawner(), tasks.token()),
            );
            prefill = Some(server);
        }
        if let (WorkerRole::Decode, Some(t)) = (role, &transfer) {
            let sub = bus.client.subscribe(s.worker_transfer(id)).await?;
            tasks.spawn("transfer-starts", pump_transfer_starts(sub, t.clone()));
        }
        // Response frames of every request leave through one queue.
        let (frames, queue) = crate::mux::channel();
        tasks.spawn_draining("frames", crate::mux::run(bus.clone(), queue, stats.clone()));
        // Generate messages: at most the engine's capacity wait in the
        // mailbox; past it a request is refused `Overloaded` at once.
        let gate = Gate::new(engine.capacity());
        let sub = bus.client.subscribe(s.worker_generate(id)).await?;
        tasks.spawn(
            "generate",
            pump_generate(sub, bus.clone(), id, gate, myself.clone()),
        );
        let sub = bus.client.subscribe(s.worker_cancel(id)).await?;
        tasks.spawn(
            "cancel",
            pump_cancel(sub, Gate::new(CANCEL_BACKLOG), myself.clone()),
        );
        bus.ensure_kv_events_stream()
            .await
            .map_err(|e| e.to_string())?;
        let kv_events = engine.take_kv_events();
        let emits_kv_events = kv_events.is_some();
        if let Some(rx) = kv_events {
            tasks.spawn(
                "kv-events",
                crate::kv_events::publish(bus.clone(), id, args.generation, rx),
            );
        }
        let sub = bus.client.subscribe(s.worker_kv_dump(id)).await?;
        let (b, eng, generation, cancel) =
            (bus.clone(), engine.clone(), args.generation, tasks.token());
        tasks.spawn("kv-dump", async move {
            b.serve(sub, cancel, |_: KvDumpRequest| {
                endpoints::kv_dump(eng.clone(), id, generation)
            })
            .await
        });
        let sub = bus.client.subscribe(s.worker_drain(id)).await?;
        let (b, me, cancel) = (bus.clone(), myself.clone(), tasks.token());
        tasks.spawn("drain", async move {
            b.serve(sub, cancel, |req: DrainRequest| {
                let me = me.clone();
                async move {
                    match me
                        .call(
                            |r| WorkerMsg::AdminDrain(req.resume, r),
                            Some(Duration::from_secs(5)),
                        )
                        .await
                    {
                        Ok(ractor::rpc::CallResult::Success(r)) => Ok(r),
                        _ => Err(WireError::new(
                            ErrorKind::Unavailable,
                            "worker is restarting",
                        )),
                    }
                }
            })
            .await
        });
        let sub = bus.client.subscribe(s.worker_artifact(id)).await?;
        let (b, artifacts, cancel) = (bus.clone(), args.artifacts.clone(), tasks.token());
        tasks.spawn("artifacts", async move {
            b.serve(sub, cancel, |req: ArtifactRequest| {
                std::future::ready(endpoints::artifact_chunk(&artifacts, req))
            })
            .await
        });
        // Requests in flight are checked now and then for a gateway that
        // still waits for them.
        let me = myself.clone();
        tasks.spawn("orphan-check", async move {
            let mut every = tokio::time::interval(crate::orphans::CHECK_EVERY);
            every.tick().await;
            loop {
                every.tick().await;
                if me.cast(WorkerMsg::CheckOrphans).is_err() {
                    std::future::pending::<()>().await
                }
            }
        });
        // A driver that stops on its own is a dead engine.
        let (live, me) = (engine.liveness(), myself.clone());
        tasks.spawn("engine-watch", async move {
            live.stopped().await;
            let _ = me.cast(WorkerMsg::EngineDied);
            std::future::pending::<()>().await
        });

        // An engine still loading registers as `Starting`: routers skip it
        // until it turns `Serving`.
        let engine_ready = match engine.ready() {
            Readiness::Now => true,
            Readiness::Later(ready) => {
                let me = myself.clone();
                tasks.spawn("engine-ready", async move {
                    let r = ready.await.map_err(|e| e.to_string());
                    let _ = me.cast(WorkerMsg::EngineReady(r));
                    std::future::pending::<()>().await
                });
                tracing::info!(worker = %id, "worker starting: its engine is loading");
                false
            }
        };
        let now = unix_ms();
        let reg = WorkerRegistration {
            worker_id: id,
            generation: args.generation,
            node_id: args.config.node_id.clone(),
            pid: std::process::id(),
            role,
            state: if engine_ready {
                WorkerState::Serving
            } else {
                WorkerState::Starting
            },
            engine: engine.kind().to_string(),
            model: args.card.clone(),
            started_unix_ms: now,
            heartbeat_unix_ms: now,
            load: engine.load(),
            kv_events: emits_kv_events,
        };
        let (registration, registrar) = register(
            bus.clone(),
            reg,
            engine.clone(),
            args.config.heartbeat_interval,
            args.config.load_interval,
            stats.clone(),
            args.config.metrics_interval,
        )
        .await?;
        tasks.spawn("registration", async move {
            registrar.run().await;
            // Deregistered: nothing more to write until the actor stops.
            std::future::pending::<()>().await
        });
        if engine_ready {
            tracing::info!(worker = %id, generation = args.generation, "worker serving");
        }
        Ok(WorkerRuntime {
            frames,
            engine_ready,
            limits,
            transfer,
            prefill,
            prefilling: HashMap::new(),
            bus,
            cfg: args.config,
            engine,
            model: args.card,
            registration,
            inflight: HashSet::new(),
            orphans: Default::default(),
            stats,
            tasks,
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<WorkerMsg>,
        rt: &mut WorkerRuntime,
    ) -> Result<(), ActorProcessingErr> {
        rt.tasks.shutdown();
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<WorkerMsg>,
        msg: WorkerMsg,
        rt: &mut WorkerRuntime,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            WorkerMsg::Generate(m, _ticket) => rt.generate(m, myself).await,
            WorkerMsg::Cancel(c, _ticket) => rt.cancel(c),
            WorkerMsg::CheckOrphans => rt.check_orphans(&myself),
            WorkerMsg::GatewayProbe(inbox, gone) => {
                for id in rt.orphans.probed(&inbox, gone) {
                    tracing::info!(request = %id, inbox, "no gateway waits for this request: cancelling it");
                    rt.stats.orphan_cancelled();
                    rt.cancel(CancelRequest {
                        request_id: id,
                        reason: CancelReason::Orphaned,
                    });
                }
            }
            WorkerMsg::Done(id) => {
                rt.orphans.ended(id);
                rt.inflight.remove(&id);
                rt.prefilling.remove(&id);
                rt.registration.set_inflight(rt.inflight.len());
            }
            WorkerMsg::InjectFault(fault, task) => rt.inject(fault, &task)?,
            WorkerMsg::EngineDied => return Err(rt.engine_died().await),
            WorkerMsg::EngineReady(Ok(())) => {
                rt.engine_ready = true;
                if rt.registration.state() == WorkerState::Starting {
                    rt.registration.set_state(WorkerState::Serving);
                }
                tracing::info!(worker = %rt.cfg.worker_id, "worker serving: its engine is ready");
            }
            WorkerMsg::EngineReadyNow(reply) => {
                let _ = reply.send(rt.engine_ready);
            }
            WorkerMsg::EngineReady(Err(why)) => {
                return Err(format!(
                    "worker {}: its engine did not start: {why}",
                    rt.cfg.worker_id
                )
                .into())
            }
            // A task fed by the engine (its KV events) ends with it: the
            // engine's death is what to report.
            WorkerMsg::TaskEnded(_) if rt.engine.liveness().is_stopped() => {
                return Err(rt.engine_died().await)
            }
            WorkerMsg::TaskEnded(why) => {
                return Err(format!("worker {}: {why}", rt.cfg.worker_id).into());
            }
            WorkerMsg::Drain(reply) => {
                rt.registration.set_state(WorkerState::Draining);
                let _ = reply.send(rt.inflight.len() as u32);
            }
            WorkerMsg::AdminDrain(resume, reply) => {
                let state = if resume && !rt.engine_ready {
                    WorkerState::Starting
                } else if resume {
                    WorkerState::Serving
                } else {
                    WorkerState::Draining
                };
                if rt.registration.state() != state {
                    tracing::info!(worker = %rt.cfg.worker_id, ?state, "admin changed the worker's state");
                    rt.registration.set_state(state);
                }
                let _ = reply.send(DrainReply {
                    worker_id: rt.cfg.worker_id,
                    state,
                    inflight: rt.inflight.len() as u32,
                });
            }
            WorkerMsg::Inflight(reply) => {
                let _ = reply.send(rt.inflight.len() as u32);
            }
            WorkerMsg::Deregister(reply) => {
                if !rt.registration.deregister().await {
                    tracing::warn!("could not delete the registration");
                }
                let _ = reply.send(());
            }
        }
        Ok(())
    }
}

impl WorkerRuntime {
    /// The engine is dead: the registration says `Failed` at once (no
    /// router sends it more work) and the actor fails, so its supervisor
    /// restarts it with a fresh engine.
    async fn engine_died(&mut self) -> ActorProcessingErr {
        tracing::error!(worker = %self.cfg.worker_id, "the engine stopped; reporting failed and restarting");
        if !self.registration.write_state(WorkerState::Failed).await {
            tracing::warn!("could not publish the failed state");
        }
        format!("worker {}: its engine stopped", self.cfg.worker_id).into()
    }

    fn cancel(&mut self, c: CancelRequest) {
        if let Some(server) = &self.prefill {
            // Prefills run under their decode worker's request id.
            if server.is_active(c.request_id) {
                self.engine.cancel(c.request_id);
            }
            return;
        }
        if self.inflight.contains(&c.request_id) {
            tracing::debug!(request = %c.request_id, reason = ?c.reason, "cancel");
            if let Some(t) = self.prefilling.get(&c.request_id) {
                t.cancel();
            }
            self.engine.cancel(c.request_id);
        }
    }

    /// Heartbeats for requests in flight a while (a gateway that forgot
    /// one cancels it) and a probe of each inbox they stream to (one that
    /// has no subscriber twice in a row loses its requests).
    fn check_orphans(&mut self, myself: &ActorRef<WorkerMsg>) {
        use crate::orphans::PROBE_TIMEOUT;
        let due = self.orphans.due(tokio::time::Instant::now());
        let beat = |id| {
            dynamo_bus_schema::encode(&dynamo_bus_schema::FrameHeartbeat {
                request_id: id,
                worker_id: self.cfg.worker_id,
            })
            .ok()
        };
        for (id, subject, mux) in due.heartbeats {
            if let Some(bytes) = beat(id) {
                // Skipped when the queue is full: the next check sends it.
                self.frames.try_send(Outgoing {
                    subject,
                    bytes,
                    mux,
                });
            }
        }
        for (subject, id) in due.probes {
            let Some(bytes) = beat(id) else { continue };
            let (client, me) = (self.bus.client.clone(), myself.clone());
            self.tasks.spawn_transient("gateway-probe", async move {
                let r = tokio::time::timeout(
                    PROBE_TIMEOUT,
                    client.request(subject.clone(), bytes.into()),
                )
                .await;
                let gone = matches!(&r, Ok(Err(e))
                    if e.kind() == async_nats::client::RequestErrorKind::NoResponders);
                let _ = me.cast(WorkerMsg::GatewayProbe(subject, gone));
            });
        }
    }

    fn inject(&mut self, fault: FaultKind, task: &str) -> Result<(), ActorProcessingErr> {
        let w = self.cfg.worker_id;
        match fault {
            FaultKind::PanicActor => panic!("fault injected into worker {w}"),
            FaultKind::StopTransferProgress => match &self.transfer {
                Some(t) => {
                    tracing::warn!(worker = %w, "fault injected: KV transfer endpoint stops polling");
                    t.stop_progress();
                }
                None => tracing::warn!("no KV transfer endpoint to stop"),
            },
            FaultKind::PanicEngine => {
                tracing::warn!(worker = %w, "fault injected: the engine's driver panics");
                if let Err(e) = self.engine.inject(EngineFault::PanicDriver) {
                    tracing::warn!(error = %e, "the engine did not take the fault");
                }
            }
            FaultKind::EndTask => {
                if !self.tasks.end(task) {
                    tracing::warn!(task, tasks = ?self.tasks.names(), "no such task to end");
                }
            }
            FaultKind::DropKvBatch => {
                tracing::warn!("a fault for routers; not applicable to a worker")
            }
            FaultKind::Unknown(k) => tracing::warn!(kind = k, "unknown fault kind ignored"),
        }
        Ok(())
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
        // A client that does not stream: token frames may wait a little
        // and go together.
        let frame_batch = m
            .headers
            .as_ref()
            .and_then(|h| h.get(dynamo_bus_schema::HEADER_FRAME_BATCH_MS))
            .and_then(|v| dynamo_bus_schema::frame_batch_window(v.as_str()));
        // The gateway's inbox takes frames of several requests at once.
        let mux = m
            .headers
            .as_ref()
            .is_some_and(|h| h.get(dynamo_bus_schema::HEADER_FRAME_MUX).is_some());
        let (req, plan) = match admit::parse(&m.payload) {
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
        let now = unix_ms();
        let admission = Admission {
            state: self.registration.state(),
            model: &self.model.name,
            limits: self.limits,
            inflight: &self.inflight,
            max_inflight: self.engine.capacity(),
        };
        let valid = match admission.check(&req, now) {
            Ok(v) => v,
            Err(e) => return self.reject(&m, id, e).await,
        };
        let prefill = Arc::new(std::sync::Mutex::new(PrefillOutcome::default()));
        // A decode worker given a prefill worker feeds the engine's events
        // through a pipe that first waits for the remote prefill.
        let events = match (plan, &self.transfer) {
            (Some(plan), Some(t)) if self.cfg.role == WorkerRole::Decode => {
                // Holds at most `max_tokens + 2` events, like the engine's stream.
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                let cancel = self.tasks.token();
                self.prefilling.insert(id, cancel.clone());
                let pipe = RemotePrefillPipe {
                    bus: self.bus.clone(),
                    engine: self.engine.clone(),
                    transfer: t.clone(),
                    card: self.model.clone(),
                    req: req.clone(),
                    plan,
                    valid,
                    outcome: prefill.clone(),
                };
                self.tasks
                    .spawn_transient("remote-prefill", pipe.run(tx, cancel));
                rx
            }
            _ => match self.engine.generate(valid) {
                Ok(ev) => ev,
                Err(e) => return self.reject(&m, id, e.to_wire()).await,
            },
        };
        self.inflight.insert(id);
        self.orphans
            .started(id, req.reply_to.clone(), mux, tokio::time::Instant::now());
        self.registration.set_inflight(self.inflight.len());
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
            sink: self.frames.clone(),
            mux,
            worker_id: self.cfg.worker_id,
            request_id: id,
            reply_to: req.reply_to,
            prompt_tokens: req.token_ids.len() as u32,
            deadline: tokio::time::Instant::now() + remaining,
            heartbeat: self.cfg.stream_heartbeat,
            last_sent: tokio::time::Instant::now(),
            frame_batch,
            received,
            prefill,
            stats: self.stats.clone(),
        };
        let engine = self.engine.clone();
        let stats = self.stats.clone();
        let cancel = self.tasks.token();
        self.tasks.spawn_transient("forward", async move {
            let outcome = fwd.run(events, cancel, || engine.cancel(id)).await;
            use crate::prom::RequestOutcome as R;
            let done = match &outcome {
                Outcome::Finished(dynamo_bus_schema::FinishReason::Cancelled) => R::Cancelled,
                Outcome::Finished(_) => R::Finished,
                Outcome::Failed(kind) => {
                    tracing::debug!(request = %id, ?kind, "request failed");
                    R::Failed
                }
                Outcome::Aborted => R::Aborted,
            };
            stats.request_done(done);
            // The actor may be gone (restart); nothing to account then.
            let _ = myself.cast(WorkerMsg::Done(id));
        });
    }
}

/// Feeds generate messages to the actor, at most the gate's size at once;
/// a message that finds the gate full is refused `Overloaded` here (the
/// gateway retries another worker).
async fn pump_generate(
    mut sub: async_nats::Subscriber,
    bus: Bus,
    worker_id: WorkerId,
    gate: Gate,
    to: ActorRef<WorkerMsg>,
) {
    while let Some(m) = sub.next().await {
        match gate.try_enter() {
            Some(ticket) => {
                if to.cast(WorkerMsg::Generate(m, ticket)).is_err() {
                    return;
                }
            }
            None => match admit::request_id(&m.payload) {
                Some(request_id) => {
                    let ack = GenerateAck {
                        request_id,
                        worker_id,
                        rejected: Some(WireError::new(ErrorKind::Overloaded, "the worker is full")),
                    };
                    bus.reply(m.reply.as_ref(), &ack).await;
                }
                None => {
                    counters::reject("GenerateRequest", m.subject.as_str(), &"undecodable");
                    let error = WireError::new(ErrorKind::BadMessage, "undecodable request");
                    bus.reply(m.reply.as_ref(), &ErrorReply { error }).await;
                }
            },
        }
    }
}

/// Feeds cancels to the actor (waiting when the gate is full: they are few).
async fn pump_cancel(mut sub: async_nats::Subscriber, gate: Gate, to: ActorRef<WorkerMsg>) {
    while let Some(m) = sub.next().await {
        match decode::<CancelRequest>(&m.payload) {
            Ok(c) => {
                let ticket = gate.enter().await;
                if to.cast(WorkerMsg::Cancel(c, ticket)).is_err() {
                    return;
                }
            }
            Err(e) => counters::reject("CancelRequest", m.subject.as_str(), &e),
        }
    }
}

/// Tells the transfer endpoint when a prefill worker starts writing.
async fn pump_transfer_starts(mut sub: async_nats::Subscriber, transfer: Arc<KvTransfer>) {
    while let Some(m) = sub.next().await {
        match decode::<dynamo_bus_schema::TransferStarting>(&m.payload) {
            Ok(t) => transfer.transfer_starting(t.request_id),
            Err(e) => counters::reject("TransferStarting", m.subject.as_str(), &e),
        }
    }
}
