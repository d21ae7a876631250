//! `NodeSupervisor`: spawns the node's actors (router, workers, gateway) as
//! linked children and restarts any that panics or stops, with exponential
//! backoff per child. The node keeps serving with the others meanwhile.
//!
//! Invariants: a child is restarted only while the node is not shutting
//! down; a restarted worker keeps its id and gets a strictly greater
//! generation; a start that fails is retried with backoff, never dropped.

use crate::config::EngineSpec;
use crate::config::{NodeConfig, WorkerGroup};
use dynamo_bus_schema::access::Role;
use dynamo_bus_schema::blocks::hash_salt;
use dynamo_bus_schema::{
    decode_payload, peek_kind, unix_ms, ActorFault, ErrorKind, ErrorReply, FaultAck,
    FaultInjection, WireError, WireMessage, WorkerId,
};
use dynamo_gateway::{GatewayActor, GatewayArgs, GatewayConfig, GatewayMsg};
use dynamo_model::LoadedModel;
use dynamo_router::{RouterActor, RouterArgs, RouterConfig, ROUTER_ACTOR_NAME};
use dynamo_runtime::{Backoff, Bus};
use dynamo_worker::{WorkerActor, WorkerArgs, WorkerConfig, WorkerMsg};
use ractor::{
    Actor, ActorCell, ActorId, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent,
};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Clone, Debug, PartialEq)]
pub enum ChildKind {
    Router,
    Gateway,
    /// The placement controller (nodes with the controller role).
    Controller,
    /// The deployments' planners (nodes with the controller or planner role).
    Planner,
    /// A joined node's agent (assignment → actors, inventory).
    Agent,
    Worker {
        group: usize,
        slot: u32,
        worker_id: WorkerId,
    },
}

impl ChildKind {
    fn name(&self) -> String {
        match self {
            ChildKind::Router => "router".into(),
            ChildKind::Gateway => "gateway".into(),
            ChildKind::Controller => "controller".into(),
            ChildKind::Planner => "planner".into(),
            ChildKind::Agent => "agent".into(),
            ChildKind::Worker { group, slot, .. } => format!("worker-{group}-{slot}"),
        }
    }
}

/// The stable id of a worker slot on a node.
pub fn worker_id(cfg: &NodeConfig, group: usize, slot: u32) -> WorkerId {
    WorkerId(hash_salt(
        &format!("{}/{}/{group}/{slot}", cfg.namespace.as_str(), cfg.node_id),
        None,
    ))
}

pub struct SupervisorArgs {
    /// The node's own connection.
    pub bus: Bus,
    /// The connection of each role its children take.
    pub buses: Arc<crate::access::NodeBuses>,
    pub config: NodeConfig,
    /// One loaded model per worker group.
    pub models: Vec<Arc<GroupModel>>,
    /// What the node serves of its weights, and how it finds more.
    pub weights: Arc<crate::weights::NodeWeights>,
}

/// What a worker group's engines share: the model card and tokenizer, and
/// for the CPU engine the weights (loaded once per group, shared by every
/// worker and every restart).
pub struct GroupModel {
    pub loaded: LoadedModel,
    pub weights: Option<Arc<dynamo_cpu_engine::Model>>,
}

/// What runs on a node: workers (id → generation), whether a frontend
/// runs, and the workers whose engine is still loading.
pub type Live = (HashMap<WorkerId, u64>, bool, HashSet<WorkerId>);

pub enum SupervisorMsg {
    Start(ChildKind),
    InjectFault(FaultInjection, RpcReplyPort<FaultAck>),
    /// A fault for an actor named by role (`router`, `gateway`) or worker id.
    InjectActorFault(ActorFault, RpcReplyPort<FaultAck>),
    /// The fault-injection server ended (it is started again).
    FaultServerEnded(String),
    /// Graceful stop of every child; replies when done.
    Shutdown(RpcReplyPort<()>),
    /// Names of the running children.
    Children(RpcReplyPort<Vec<String>>),
    /// Starts a worker of an assigned replica (cluster mode); replies with
    /// its generation.
    StartWorker {
        group: Box<WorkerGroup>,
        model: Arc<GroupModel>,
        worker_id: WorkerId,
        reply: RpcReplyPort<Result<u64, String>>,
    },
    /// Takes a replica's worker (or, with `None`, the frontend) out of
    /// supervision and drains it: no new requests, in-flight ones finish
    /// within `grace`, the worker deregisters, then it stops. The node's
    /// agent hears [`crate::agent::AgentMsg::Stopped`] with `key` when done.
    Remove {
        worker: Option<WorkerId>,
        grace: Duration,
        key: String,
    },
    /// Starts a frontend (router, then gateway) of an assigned replica.
    StartFrontend {
        gateway: Box<GatewayConfig>,
        router: Box<RouterConfig>,
        reply: RpcReplyPort<Result<(), String>>,
    },
    /// The workers running now (id → generation), whether a frontend
    /// runs, and the running workers whose engine is still loading.
    Live(RpcReplyPort<Live>),
    /// A worker whose (simulated) cold start is over: spawn it, unless it
    /// was removed or started again since (`token` tells).
    SpawnLater {
        kind: ChildKind,
        token: u64,
    },
}

pub struct NodeSupervisor;

pub struct SupervisorState {
    weights: Arc<crate::weights::NodeWeights>,
    bus: Bus,
    buses: Arc<crate::access::NodeBuses>,
    cfg: NodeConfig,
    models: Vec<Arc<GroupModel>>,
    children: HashMap<ActorId, (ChildKind, ActorCell)>,
    gateway: Option<ActorRef<GatewayMsg>>,
    workers: HashMap<WorkerId, ActorRef<WorkerMsg>>,
    backoffs: HashMap<String, Backoff>,
    generations: HashMap<WorkerId, u64>,
    shutting_down: bool,
    tasks: dynamo_runtime::Tasks,
    /// Children taken out of supervision (being drained and stopped).
    retired: std::collections::HashSet<ActorId>,
    /// Workers retired while a restart of theirs was pending: not restarted.
    retired_workers: std::collections::HashSet<WorkerId>,
    /// Workers in a simulated cold start: the token of their pending spawn.
    pending_spawn: HashMap<WorkerId, u64>,
    spawn_seq: u64,
    router: Option<ActorCell>,
}

impl Actor for NodeSupervisor {
    type Msg = SupervisorMsg;
    type State = SupervisorState;
    type Arguments = SupervisorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<SupervisorMsg>,
        args: SupervisorArgs,
    ) -> Result<SupervisorState, ActorProcessingErr> {
        let me = myself.clone();
        let tasks = dynamo_runtime::Tasks::new(Arc::new(move |why| {
            let _ = me.cast(SupervisorMsg::FaultServerEnded(why));
        }));
        let mut st = SupervisorState {
            bus: args.bus,
            buses: args.buses,
            cfg: args.config,
            models: args.models,
            weights: args.weights,
            children: HashMap::new(),
            gateway: None,
            workers: HashMap::new(),
            backoffs: HashMap::new(),
            generations: HashMap::new(),
            shutting_down: false,
            tasks,
            retired: Default::default(),
            retired_workers: Default::default(),
            pending_spawn: HashMap::new(),
            spawn_seq: 0,
            router: None,
        };
        if st.cfg.fault_injection {
            st.serve_faults(&myself).await?;
            tracing::warn!("fault injection is enabled on this node");
        }
        // Start-up failures are fatal (bad port, engine config…); later ones restart.
        let mut kinds = Vec::new();
        if st.cfg.gateway.is_some() {
            kinds.push(ChildKind::Router);
        }
        for (g, group) in st.cfg.workers.iter().enumerate() {
            for slot in 0..group.count {
                kinds.push(ChildKind::Worker {
                    group: g,
                    slot,
                    worker_id: worker_id(&st.cfg, g, slot),
                });
            }
        }
        if st.cfg.gateway.is_some() {
            kinds.push(ChildKind::Gateway);
        }
        if st.cfg.controller.is_some() {
            kinds.push(ChildKind::Controller);
        }
        if st.cfg.planner.is_some() {
            kinds.push(ChildKind::Planner);
        }
        if st.cfg.join.is_some() {
            kinds.push(ChildKind::Agent);
        }
        for k in kinds {
            st.spawn_child(k, myself.get_cell()).await?;
        }
        Ok(st)
    }

    async fn handle(
        &self,
        myself: ActorRef<SupervisorMsg>,
        msg: SupervisorMsg,
        st: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SupervisorMsg::Start(kind) => {
                if st.shutting_down {
                    return Ok(());
                }
                // A restart that was pending when its actor was retired.
                let retired = match &kind {
                    ChildKind::Worker { worker_id, .. } => st.retired_workers.contains(worker_id),
                    ChildKind::Gateway | ChildKind::Router => st.cfg.gateway.is_none(),
                    _ => false,
                };
                if retired {
                    tracing::info!(child = kind.name(), "not restarted: retired");
                    return Ok(());
                }
                if let Err(e) = st.spawn_child(kind.clone(), myself.get_cell()).await {
                    tracing::error!(child = kind.name(), error = %e, "restart failed");
                    st.schedule_restart(kind, &myself);
                }
            }
            SupervisorMsg::InjectFault(f, reply) => {
                let ack = match st.workers.get(&f.worker_id) {
                    Some(w) => match w.cast(WorkerMsg::InjectFault(f.fault, String::new())) {
                        Ok(()) => FaultAck {
                            applied: true,
                            message: format!("{:?} sent to worker {}", f.fault, f.worker_id),
                        },
                        Err(e) => FaultAck {
                            applied: false,
                            message: format!("worker unreachable: {e}"),
                        },
                    },
                    None => FaultAck {
                        applied: false,
                        message: format!("no worker {} on this node", f.worker_id),
                    },
                };
                let _ = reply.send(ack);
            }
            SupervisorMsg::InjectActorFault(f, reply) => {
                let _ = reply.send(st.actor_fault(f));
            }
            SupervisorMsg::FaultServerEnded(why) => {
                tracing::warn!(%why, "fault injection server ended; serving again");
                if !st.shutting_down {
                    if let Err(e) = st.serve_faults(&myself).await {
                        tracing::error!(error = %e, "cannot serve fault injection");
                    }
                }
            }
            SupervisorMsg::Shutdown(reply) => {
                st.shutdown().await;
                let _ = reply.send(());
            }
            SupervisorMsg::Children(reply) => {
                let mut names: Vec<String> = st.children.values().map(|(k, _)| k.name()).collect();
                names.sort();
                let _ = reply.send(names);
            }
            SupervisorMsg::StartWorker {
                group,
                model,
                worker_id,
                reply,
            } => {
                if st.shutting_down {
                    let _ = reply.send(Err("the node is shutting down".into()));
                    return Ok(());
                }
                st.retired_workers.remove(&worker_id);
                // Groups are kept (restarts index them); an identical one is reused.
                let same = format!("{group:?}");
                let g = match st.cfg.workers.iter().position(|w| format!("{w:?}") == same) {
                    Some(g) if Arc::ptr_eq(&st.models[g], &model) => g,
                    _ => {
                        st.cfg.workers.push(*group);
                        st.models.push(model);
                        st.cfg.workers.len() - 1
                    }
                };
                let kind = ChildKind::Worker {
                    group: g,
                    slot: 0,
                    worker_id,
                };
                // A mocker's simulated cold start (model loading): the
                // worker comes up, and registers, that much later. The
                // reply's generation 0 says it is not live yet.
                let startup = match &st.cfg.workers[g].engine {
                    EngineSpec::Mocker(m) => Duration::from_millis(m.startup_ms),
                    _ => Duration::ZERO,
                };
                if !startup.is_zero() {
                    st.spawn_seq += 1;
                    let token = st.spawn_seq;
                    st.pending_spawn.insert(worker_id, token);
                    tracing::info!(worker = %worker_id, ms = startup.as_millis() as u64, "worker loading (simulated cold start)");
                    myself.send_after(startup, move || SupervisorMsg::SpawnLater { kind, token });
                    let _ = reply.send(Ok(0));
                    return Ok(());
                }
                let res = match st.spawn_child(kind, myself.get_cell()).await {
                    Ok(()) => Ok(st.generations.get(&worker_id).copied().unwrap_or(0)),
                    Err(e) => Err(e.to_string()),
                };
                let _ = reply.send(res);
            }
            SupervisorMsg::SpawnLater { kind, token } => {
                let ChildKind::Worker { worker_id, .. } = &kind else {
                    return Ok(());
                };
                if st.shutting_down || st.pending_spawn.get(worker_id) != Some(&token) {
                    return Ok(());
                }
                st.pending_spawn.remove(worker_id);
                let id = *worker_id;
                if let Err(e) = st.spawn_child(kind, myself.get_cell()).await {
                    tracing::error!(worker = %id, error = %e, "worker failed to start after its cold start");
                }
            }
            SupervisorMsg::Live(reply) => {
                let live = st
                    .workers
                    .keys()
                    .map(|w| (*w, st.generations.get(w).copied().unwrap_or(0)))
                    .collect();
                // An external engine's server may load for minutes: its
                // worker runs, but is not ready until the engine is.
                let asks = st.workers.iter().map(|(id, w)| async move {
                    let ready = matches!(
                        w.call(WorkerMsg::EngineReadyNow, Some(Duration::from_millis(500)))
                            .await,
                        Ok(ractor::rpc::CallResult::Success(true))
                    );
                    (!ready).then_some(*id)
                });
                let loading = futures::future::join_all(asks)
                    .await
                    .into_iter()
                    .flatten()
                    .collect();
                let _ = reply.send((live, st.gateway.is_some(), loading));
            }
            SupervisorMsg::Remove { worker, grace, key } => {
                let done = move || {
                    if let Some(a) = ractor::registry::where_is(crate::agent::AGENT_NAME) {
                        let agent = ActorRef::<crate::agent::AgentMsg>::from(a);
                        let _ = agent.cast(crate::agent::AgentMsg::Stopped(key));
                    }
                };
                match worker {
                    Some(id) => {
                        st.pending_spawn.remove(&id);
                        st.retired_workers.insert(id);
                        let w = st.workers.remove(&id);
                        if let Some(w) = &w {
                            st.retired.insert(w.get_id());
                        }
                        st.tasks.spawn_transient("replica drain", async move {
                            if let Some(w) = w {
                                drain_worker(&w, id, grace).await;
                            }
                            done();
                        });
                    }
                    None => {
                        st.cfg.gateway = None;
                        let g = st.gateway.take();
                        let r = st.router.take();
                        for c in [g.as_ref().map(|g| g.get_cell()), r.clone()]
                            .into_iter()
                            .flatten()
                        {
                            st.retired.insert(c.get_id());
                        }
                        st.tasks.spawn_transient("frontend drain", async move {
                            if let Some(g) = g {
                                let _ = g
                                    .call(
                                        GatewayMsg::Shutdown,
                                        Some(grace + Duration::from_secs(1)),
                                    )
                                    .await;
                                g.stop(Some("replica removed".into()));
                            }
                            if let Some(r) = r {
                                r.stop(Some("replica removed".into()));
                            }
                            done();
                        });
                    }
                }
            }
            SupervisorMsg::StartFrontend {
                gateway,
                router,
                reply,
            } => {
                if st.shutting_down || st.gateway.is_some() {
                    let _ = reply.send(Err("the node already runs a frontend".into()));
                    return Ok(());
                }
                st.cfg.gateway = Some(*gateway);
                st.cfg.router = *router;
                let mut res = Ok(());
                for k in [ChildKind::Router, ChildKind::Gateway] {
                    if let Err(e) = st.spawn_child(k, myself.get_cell()).await {
                        res = Err(e.to_string());
                        break;
                    }
                }
                if res.is_err() {
                    // Half a frontend is none: stop what started.
                    st.cfg.gateway = None;
                    for cell in [st.gateway.take().map(|g| g.get_cell()), st.router.take()]
                        .into_iter()
                        .flatten()
                    {
                        st.retired.insert(cell.get_id());
                        cell.stop(Some("frontend failed to start".into()));
                    }
                }
                let _ = reply.send(res);
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<SupervisorMsg>,
        evt: SupervisionEvent,
        st: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        let (id, why) = match &evt {
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                (cell.get_id(), format!("stopped: {reason:?}"))
            }
            SupervisionEvent::ActorFailed(cell, err) => (cell.get_id(), format!("failed: {err}")),
            _ => return Ok(()),
        };
        let Some((kind, _)) = st.children.remove(&id) else {
            return Ok(());
        };
        if st.retired.remove(&id) {
            tracing::info!(child = kind.name(), "retired actor stopped");
            return Ok(());
        }
        match &kind {
            ChildKind::Gateway => st.gateway = None,
            ChildKind::Worker { worker_id, .. } => {
                st.workers.remove(worker_id);
            }
            ChildKind::Router => st.router = None,
            ChildKind::Controller | ChildKind::Planner | ChildKind::Agent => {}
        }
        if st.shutting_down {
            return Ok(());
        }
        tracing::error!(child = kind.name(), %why, "actor exited; restarting");
        crate::metrics::restarted(&st.cfg.node_id.0, &kind.name());
        st.schedule_restart(kind, &myself);
        Ok(())
    }
}

impl SupervisorState {
    async fn serve_faults(
        &mut self,
        myself: &ActorRef<SupervisorMsg>,
    ) -> Result<(), ActorProcessingErr> {
        let subject = self.bus.subjects.node_fault(&self.cfg.node_id);
        let sub = self.bus.client.subscribe(subject).await?;
        self.tasks.spawn(
            "faults",
            answer_faults(self.bus.clone(), sub, myself.clone()),
        );
        Ok(())
    }

    /// Applies a fault to an actor named by role or worker id.
    fn actor_fault(&self, f: ActorFault) -> FaultAck {
        let task = f.task.clone();
        let sent = match f.actor.as_str() {
            "router" => ractor::registry::where_is(ROUTER_ACTOR_NAME)
                .map(ActorRef::<dynamo_router::RouterMsg>::from)
                .map(|r| {
                    r.cast(dynamo_router::RouterMsg::InjectFault(f.fault, task))
                        .is_ok()
                }),
            // The router's child: reached through the router.
            "indexer" => ractor::registry::where_is(ROUTER_ACTOR_NAME)
                .map(ActorRef::<dynamo_router::RouterMsg>::from)
                .map(|r| {
                    r.cast(dynamo_router::RouterMsg::InjectIndexerFault(f.fault, task))
                        .is_ok()
                }),
            "gateway" => self
                .gateway
                .as_ref()
                .map(|g| g.cast(GatewayMsg::InjectFault(f.fault, task)).is_ok()),
            other => other
                .parse::<WorkerId>()
                .ok()
                .and_then(|w| self.workers.get(&w))
                .map(|w| w.cast(WorkerMsg::InjectFault(f.fault, task)).is_ok()),
        };
        let (applied, message) = match sent {
            Some(true) => (true, format!("{:?} sent to {}", f.fault, f.actor)),
            Some(false) => (false, format!("{} is unreachable", f.actor)),
            None => (false, format!("no actor {:?} on this node", f.actor)),
        };
        FaultAck { applied, message }
    }

    fn schedule_restart(&mut self, kind: ChildKind, myself: &ActorRef<SupervisorMsg>) {
        let (base, max) = (self.cfg.restart_base, self.cfg.restart_max);
        let delay = self
            .backoffs
            .entry(kind.name())
            .or_insert_with(|| Backoff::new(base, max, Duration::from_secs(60)))
            .next_delay(Instant::now());
        // A timer of the supervisor's own: gone with it (nothing to restart then).
        myself.send_after(delay, move || SupervisorMsg::Start(kind));
    }

    async fn spawn_child(
        &mut self,
        kind: ChildKind,
        sup: ActorCell,
    ) -> Result<(), ActorProcessingErr> {
        let cell = match &kind {
            ChildKind::Router => {
                let args = RouterArgs {
                    bus: self.buses.role(Role::Router).await?,
                    config: self.cfg.router.clone(),
                };
                let (r, _) = Actor::spawn_linked(
                    Some(ROUTER_ACTOR_NAME.to_string()),
                    RouterActor,
                    args,
                    sup,
                )
                .await?;
                self.router = Some(r.get_cell());
                r.get_cell()
            }
            ChildKind::Agent => {
                let args = crate::agent::AgentArgs {
                    bus: self.bus.clone(),
                    config: self.cfg.clone(),
                    supervisor: ActorRef::<SupervisorMsg>::from(sup.clone()),
                    weights: self.weights.clone(),
                };
                let (a, _) = Actor::spawn_linked(
                    Some(crate::agent::AGENT_NAME.to_string()),
                    crate::agent::NodeAgentActor,
                    args,
                    sup,
                )
                .await?;
                a.get_cell()
            }
            ChildKind::Controller => {
                let config = self
                    .cfg
                    .controller
                    .clone()
                    .ok_or("no controller configured")?;
                let args = dynamo_controller::ControllerArgs {
                    bus: self.buses.role(Role::Controller).await?,
                    config,
                };
                let (c, _) =
                    Actor::spawn_linked(None, dynamo_controller::ControllerActor, args, sup)
                        .await?;
                c.get_cell()
            }
            ChildKind::Planner => {
                let config = self.cfg.planner.clone().ok_or("no planner configured")?;
                let args = dynamo_planner_actor::PlannersArgs {
                    bus: self.buses.role(Role::Planner).await?,
                    config,
                    seed: crate::seed::seed(),
                };
                let (p, _) =
                    Actor::spawn_linked(None, dynamo_planner_actor::PlannersActor, args, sup)
                        .await?;
                p.get_cell()
            }
            ChildKind::Gateway => {
                let config = self.cfg.gateway.clone().ok_or("no gateway configured")?;
                let args = GatewayArgs {
                    bus: self.buses.role(Role::Gateway).await?,
                    config,
                };
                let (g, _) = Actor::spawn_linked(None, GatewayActor, args, sup).await?;
                let cell = g.get_cell();
                self.gateway = Some(g);
                cell
            }
            ChildKind::Worker {
                group, worker_id, ..
            } => {
                let grp: &WorkerGroup = &self.cfg.workers[*group];
                let model = self.models[*group].clone();
                let prev = self.generations.get(worker_id).copied().unwrap_or(0);
                let generation = unix_ms().max(prev + 1);
                self.generations.insert(*worker_id, generation);
                let engine = crate::engines::factory(grp, &model, worker_id)?;
                let mut artifacts = HashMap::new();
                artifacts.insert(
                    model.loaded.card.tokenizer.name.clone(),
                    model.loaded.tokenizer_json.clone(),
                );
                let args = WorkerArgs {
                    bus: self.buses.role(Role::Worker).await?,
                    config: WorkerConfig {
                        worker_id: *worker_id,
                        node_id: self.cfg.node_id.clone(),
                        role: grp.role,
                        heartbeat_interval: grp.heartbeat,
                        load_interval: Duration::from_millis(100),
                        metrics_interval: Duration::from_secs(1),
                        stream_heartbeat: grp.stream_heartbeat,
                        transfer: grp.transfer.clone(),
                    },
                    card: model.loaded.card.clone(),
                    artifacts: Arc::new(artifacts),
                    engine,
                    generation,
                };
                let (w, _) = Actor::spawn_linked(None, WorkerActor, args, sup).await?;
                self.workers.insert(*worker_id, w.clone());
                w.get_cell()
            }
        };
        tracing::info!(child = kind.name(), "actor started");
        crate::metrics::child_started(&self.cfg.node_id.0, &kind.name());
        self.children.insert(cell.get_id(), (kind, cell));
        Ok(())
    }

    /// Stops the node's actors: the gateway stops taking requests and lets
    /// in-flight ones finish (within the grace period), the workers drain
    /// and deregister, then everything stops. Every step is bounded, the
    /// workers are handled together rather than one by one, and nothing
    /// waits on a bus that is gone.
    async fn shutdown(&mut self) {
        self.shutting_down = true;
        self.tasks.shutdown();
        let grace = self.cfg.shutdown_grace;
        if let Some(g) = self.gateway.take() {
            let _ = g
                .call(GatewayMsg::Shutdown, Some(grace + Duration::from_secs(1)))
                .await;
        }
        let workers: Vec<ActorRef<WorkerMsg>> = self.workers.values().cloned().collect();
        futures::future::join_all(
            workers
                .iter()
                .map(|w| w.call(WorkerMsg::Drain, Some(Duration::from_secs(2)))),
        )
        .await;
        let t0 = Instant::now();
        loop {
            // Without a bus no frame reaches a client: nothing to wait for.
            if !self.bus.is_connected() {
                tracing::warn!("the bus is gone; not waiting for in-flight requests");
                break;
            }
            let counts = futures::future::join_all(
                workers
                    .iter()
                    .map(|w| w.call(WorkerMsg::Inflight, Some(Duration::from_secs(1)))),
            )
            .await;
            let busy: u32 = counts
                .into_iter()
                .filter_map(|c| match c {
                    Ok(ractor::rpc::CallResult::Success(n)) => Some(n),
                    _ => None,
                })
                .sum();
            if busy == 0 || t0.elapsed() > grace {
                if busy > 0 {
                    tracing::warn!(busy, "grace period over with requests still in flight");
                }
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        futures::future::join_all(
            workers
                .iter()
                .map(|w| w.call(WorkerMsg::Deregister, Some(Duration::from_secs(3)))),
        )
        .await;
        for (_, (_, cell)) in self.children.drain() {
            cell.stop(Some("node shutting down".into()));
        }
        self.workers.clear();
    }
}

/// Answers fault injections (by worker id, or for an actor by role) on
/// the node's fault subject; undecodable requests are refused and counted.
async fn answer_faults(bus: Bus, mut sub: async_nats::Subscriber, sup: ActorRef<SupervisorMsg>) {
    use futures::StreamExt;
    while let Some(m) = sub.next().await {
        let limit = Some(Duration::from_secs(2));
        type Ask = Box<dyn FnOnce(RpcReplyPort<FaultAck>) -> SupervisorMsg + Send>;
        let asked: Result<Ask, _> = match peek_kind(&m.payload) {
            Ok((k, p)) if k == FaultInjection::KIND => decode_payload::<FaultInjection>(p)
                .map(|f| Box::new(move |r| SupervisorMsg::InjectFault(f, r)) as Ask),
            Ok((k, p)) if k == ActorFault::KIND => decode_payload::<ActorFault>(p)
                .map(|f| Box::new(move |r| SupervisorMsg::InjectActorFault(f, r)) as Ask),
            Ok((k, _)) => Err(dynamo_bus_schema::DecodeError::UnexpectedKind {
                expected: FaultInjection::KIND.0,
                found: k.0,
                name: "FaultInjection",
            }),
            Err(e) => Err(e),
        };
        match asked {
            Ok(ask) => {
                let ack = match sup.call(ask, limit).await {
                    Ok(ractor::rpc::CallResult::Success(a)) => a,
                    _ => FaultAck {
                        applied: false,
                        message: "supervisor did not answer".into(),
                    },
                };
                bus.reply(m.reply.as_ref(), &ack).await;
            }
            Err(e) => {
                dynamo_runtime::counters::reject("fault injection", m.subject.as_str(), &e);
                let error = WireError::new(ErrorKind::BadMessage, e.to_string());
                bus.reply(m.reply.as_ref(), &ErrorReply { error }).await;
            }
        }
    }
}

/// Drains a retired worker (no new requests, in-flight ones finish within
/// `grace`), deregisters it and stops it.
async fn drain_worker(w: &ActorRef<WorkerMsg>, id: WorkerId, grace: Duration) {
    // What `dynamoctl drain` asks over the bus: the worker stops taking
    // requests (routers skip it as soon as its registration says so).
    let _ = w
        .call(
            |r| WorkerMsg::AdminDrain(false, r),
            Some(Duration::from_secs(2)),
        )
        .await;
    let t0 = Instant::now();
    loop {
        let n = match w
            .call(WorkerMsg::Inflight, Some(Duration::from_secs(1)))
            .await
        {
            Ok(ractor::rpc::CallResult::Success(n)) => n,
            _ => 0,
        };
        if n == 0 || t0.elapsed() > grace {
            if n > 0 {
                tracing::warn!(worker = %id, n, "drain grace over with requests in flight");
            }
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = w
        .call(WorkerMsg::Deregister, Some(Duration::from_secs(3)))
        .await;
    w.stop(Some("replica removed".into()));
}
