//! `NodeAgentActor`: a joined node's side of the cluster layer. It watches
//! the node's assignment (written by the active controller), reconciles it
//! with what runs (starting and stopping worker and frontend actors through
//! the node supervisor), and reports the node's inventory (labels,
//! capacity, health, replicas and whether each is ready) every second.
//!
//! Invariants:
//! - only replicas whose key or settings changed are touched: the others'
//!   actors (and generations) are left alone;
//! - a replica leaves by draining: its worker stops taking requests, its
//!   in-flight ones finish (within the node's shutdown grace), it
//!   deregisters, then stops, the path `dynamoctl drain` uses;
//! - a replica whose start failed is retried with backoff, and the failure
//!   is reported, never dropped;
//! - the inventory is written by a task of its own, so a slow start (a
//!   model load) never delays the heartbeat the controller judges the node by.

use crate::config::{frontend_from_spec, worker_from_spec, JoinConfig, NodeConfig};
use crate::supervisor::{GroupModel, SupervisorMsg};
use dynamo_bus_schema::{
    decode, encode, unix_ms, AssignedReplica, NodeAssignment, NodeInventory, NodeRegistration,
    RunningReplica, WorkerId,
};
use dynamo_runtime::bus::REGISTRY_MAX_AGE;
use dynamo_runtime::{Backoff, Bus, Tasks};
use futures::StreamExt;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Registered name of a node's agent.
pub const AGENT_NAME: &str = "node-agent";

/// What runs for one assigned replica.
#[derive(Clone, Debug, PartialEq)]
pub enum Runs {
    Frontend,
    Worker(WorkerId),
}

#[derive(Clone, Debug)]
pub struct Running {
    pub replica: AssignedReplica,
    pub runs: Runs,
    pub generation: u64,
    pub stopping: bool,
}

/// What to do to make what runs match the assignment.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    pub start: Vec<AssignedReplica>,
    pub stop: Vec<String>,
}

/// The synchronous part: the difference between an assignment and what
/// runs. A replica whose settings changed is stopped first and started
/// again once it has stopped; one still stopping is left alone.
pub fn plan(desired: &[AssignedReplica], running: &BTreeMap<String, Running>) -> Plan {
    let mut p = Plan::default();
    let want: BTreeMap<&str, &AssignedReplica> =
        desired.iter().map(|r| (r.key.as_str(), r)).collect();
    for (key, r) in running {
        if r.stopping {
            continue;
        }
        match want.get(key.as_str()) {
            Some(d) if **d == r.replica => {}
            _ => p.stop.push(key.clone()),
        }
    }
    for d in desired {
        if !running.contains_key(&d.key) {
            p.start.push(d.clone());
        }
    }
    // A frontend leaves before another starts (one per node).
    p
}

pub struct AgentArgs {
    pub bus: Bus,
    pub config: NodeConfig,
    pub supervisor: ActorRef<SupervisorMsg>,
    pub weights: Arc<crate::weights::NodeWeights>,
}

pub enum AgentMsg {
    /// The node's assignment as last read (None: none yet).
    /// The watch saw the assignment change: take the newest from its slot
    /// (at most one of these is queued; changes coalesce).
    AssignmentChanged,
    /// Periodic: read the assignment again, retry failed starts.
    Tick,
    /// A replica finished stopping.
    Stopped(String),
    /// The node is leaving: report it as draining so nothing new comes.
    Leave(RpcReplyPort<()>),
}

pub struct NodeAgentActor;

pub struct AgentState {
    bus: Bus,
    cfg: NodeConfig,
    join: JoinConfig,
    sup: ActorRef<SupervisorMsg>,
    desired: Vec<AssignedReplica>,
    running: BTreeMap<String, Running>,
    /// Replica → (why its start failed, when to try again, backoff).
    failed: BTreeMap<String, (String, Instant, Backoff)>,
    models: HashMap<String, Arc<GroupModel>>,
    weights: Arc<crate::weights::NodeWeights>,
    record: Arc<Mutex<NodeInventory>>,
    /// Wakes the inventory writer when what runs changed.
    changed: Arc<tokio::sync::Notify>,
    /// The highest controller epoch seen, and when: an assignment from an
    /// older epoch (a deposed controller) is ignored while the newer one is
    /// recent.
    epoch: (u64, Instant),
    /// The revision of the assignment entry last taken.
    revision: u64,
    /// The newest assignment the watch saw, not yet taken.
    latest: Latest,
    /// The supervisor's live workers (id → generation), frontend, and
    /// workers whose engine is still loading.
    live: crate::supervisor::Live,
    assignments: Option<async_nats::jetstream::kv::Store>,
    tasks: Tasks,
}

impl Actor for NodeAgentActor {
    type Msg = AgentMsg;
    type State = AgentState;
    type Arguments = AgentArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<AgentMsg>,
        args: AgentArgs,
    ) -> Result<AgentState, ActorProcessingErr> {
        let join = args
            .config
            .join
            .clone()
            .ok_or("the node has not joined a cluster")?;
        let me = myself.clone();
        let tasks = Tasks::new(Arc::new(move |why| {
            tracing::error!(%why, "node agent task ended");
            me.stop(Some(why));
        }));
        let record = Arc::new(Mutex::new(NodeInventory {
            registration: NodeRegistration {
                node_id: args.config.node_id.clone(),
                pid: std::process::id(),
                hostname: crate::daemon::hostname(),
                actors: Vec::new(),
                http_addr: None,
                started_unix_ms: unix_ms(),
                heartbeat_unix_ms: unix_ms(),
            },
            labels: join.labels.clone(),
            slots: join.slots,
            free_slots: join.slots,
            memory_mib: join.memory_mib,
            free_memory_mib: join.memory_mib,
            controller: args.config.controller.is_some(),
            health: "healthy".into(),
            replicas: Vec::new(),
        }));
        let changed = Arc::new(tokio::sync::Notify::new());
        tasks.spawn(
            "inventory",
            report_inventory(
                args.bus.clone(),
                record.clone(),
                args.supervisor.clone(),
                changed.clone(),
            ),
        );
        // Presence: the controller's probes are answered with the record.
        let sub = args
            .bus
            .client
            .subscribe(args.bus.subjects.node_presence(&args.config.node_id))
            .await?;
        let (b, rec, cancel) = (args.bus.clone(), record.clone(), tasks.token());
        tasks.spawn("presence", async move {
            b.serve(sub, cancel, |_: dynamo_bus_schema::PresenceProbe| {
                let r = rec.lock().map(|r| r.clone()).map_err(|_| {
                    dynamo_bus_schema::WireError::new(
                        dynamo_bus_schema::ErrorKind::Unavailable,
                        "node record unavailable",
                    )
                });
                async move { r }
            })
            .await
        });
        let latest: Latest = Arc::new(Mutex::new(None));
        tasks.spawn(
            "assignment watch",
            watch_assignment(
                latest.clone(),
                args.bus.clone(),
                args.config.node_id.0.clone(),
                myself.clone(),
            ),
        );
        myself.send_interval(Duration::from_secs(1), || AgentMsg::Tick);
        Ok(AgentState {
            bus: args.bus,
            cfg: args.config,
            join,
            sup: args.supervisor,
            desired: Vec::new(),
            running: BTreeMap::new(),
            failed: BTreeMap::new(),
            models: HashMap::new(),
            weights: args.weights,
            record,
            changed,
            epoch: (0, Instant::now()),
            revision: 0,
            latest,
            live: (HashMap::new(), false, Default::default()),
            assignments: None,
            tasks,
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<AgentMsg>,
        st: &mut AgentState,
    ) -> Result<(), ActorProcessingErr> {
        st.tasks.shutdown();
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<AgentMsg>,
        msg: AgentMsg,
        st: &mut AgentState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            AgentMsg::AssignmentChanged => {
                let latest = st.latest.lock().ok().and_then(|mut l| l.take());
                // A watch event older than a fresher read is skipped.
                if let Some((a, rev)) = latest {
                    if rev >= st.revision {
                        st.assign(a, rev);
                    }
                }
                st.reconcile(&myself).await;
            }
            AgentMsg::Tick => {
                // A fresh read is the truth (even at a lower revision: the
                // bucket may have been recreated).
                if let Some((a, rev)) = st.read_assignment().await {
                    st.assign(a, rev);
                }
                st.reconcile(&myself).await;
            }
            AgentMsg::Stopped(key) => {
                st.running.remove(&key);
                st.publish();
                st.reconcile(&myself).await;
            }
            AgentMsg::Leave(reply) => {
                if let Ok(mut r) = st.record.lock() {
                    r.health = "draining".into();
                }
                st.changed.notify_one();
                let _ = reply.send(());
            }
        }
        Ok(())
    }
}

impl AgentState {
    /// Takes a new assignment, unless a deposed controller wrote it.
    fn assign(&mut self, a: Option<NodeAssignment>, revision: u64) {
        self.revision = revision;
        if let Some(a) = &a {
            let (seen, at) = self.epoch;
            if a.epoch < seen && at.elapsed() < Duration::from_secs(10) {
                tracing::warn!(
                    epoch = a.epoch,
                    newest = seen,
                    "ignoring an assignment from a deposed controller"
                );
                return;
            }
            self.epoch = (a.epoch, Instant::now());
        }
        let desired = a.map(|a| a.replicas).unwrap_or_default();
        if desired != self.desired {
            self.desired = desired;
            self.failed
                .retain(|k, _| self.desired.iter().any(|d| &d.key == k));
        }
    }

    async fn read_assignment(&mut self) -> Option<(Option<NodeAssignment>, u64)> {
        if self.assignments.is_none() {
            let name = self.bus.subjects.assignments_bucket();
            let kv =
                tokio::time::timeout(Duration::from_secs(2), self.bus.kv_bucket_durable(&name))
                    .await
                    .ok()?
                    .ok()?;
            self.assignments = Some(kv);
        }
        let kv = self.assignments.as_ref()?;
        match tokio::time::timeout(Duration::from_secs(2), kv.entry(self.cfg.node_id.0.clone()))
            .await
        {
            Ok(Ok(Some(e))) if e.operation != async_nats::jetstream::kv::Operation::Put => {
                Some((None, e.revision))
            }
            Ok(Ok(Some(e))) => match decode::<NodeAssignment>(&e.value) {
                Ok(a) => Some((Some(a), e.revision)),
                Err(e) => {
                    dynamo_runtime::counters::reject("NodeAssignment", &self.cfg.node_id.0, &e);
                    None
                }
            },
            Ok(Ok(None)) => Some((None, 0)),
            _ => {
                self.assignments = None;
                None
            }
        }
    }

    /// The worker id of a replica on this node (stable: the same key on
    /// the same node is the same worker).
    fn worker_id(&self, key: &str) -> WorkerId {
        dynamo_bus_schema::replica_worker_id(self.cfg.namespace.as_str(), key, &self.cfg.node_id)
    }

    /// Records a replica as running here (started or adopted).
    fn runs(&mut self, replica: AssignedReplica, runs: Runs, generation: u64) {
        self.failed.remove(&replica.key);
        self.running.insert(
            replica.key.clone(),
            Running {
                replica,
                runs,
                generation,
                stopping: false,
            },
        );
    }

    async fn reconcile(&mut self, myself: &ActorRef<AgentMsg>) {
        if let Ok(ractor::rpc::CallResult::Success(l)) = self
            .sup
            .call(SupervisorMsg::Live, Some(Duration::from_secs(2)))
            .await
        {
            self.live = l;
        }
        let p = plan(&self.desired, &self.running);
        for key in p.stop {
            self.stop(&key, myself).await;
        }
        // One frontend per node: wait for a leaving one before another starts.
        let frontend_busy = self.running.values().any(|r| r.runs == Runs::Frontend);
        for r in p.start {
            if r.role == "frontend" && frontend_busy {
                continue;
            }
            // Already running (started before this agent, or a start that
            // timed out and finished later): adopted, not started twice.
            let adopted = if r.role == "frontend" {
                self.live.1.then_some((Runs::Frontend, 0))
            } else {
                let id = self.worker_id(&r.key);
                self.live.0.get(&id).map(|g| (Runs::Worker(id), *g))
            };
            if let Some((runs, generation)) = adopted {
                tracing::info!(replica = r.key, "replica already running: adopted");
                self.runs(r, runs, generation);
                continue;
            }
            if let Some((_, at, _)) = self.failed.get(&r.key) {
                if Instant::now() < *at {
                    continue;
                }
            }
            match self.start(&r).await {
                Ok((runs, generation)) => {
                    tracing::info!(replica = r.key, "replica started");
                    match &runs {
                        Runs::Frontend => self.live.1 = true,
                        // Generation 0: still loading (not live yet).
                        Runs::Worker(id) if generation > 0 => {
                            self.live.0.insert(*id, generation);
                        }
                        Runs::Worker(_) => {}
                    }
                    self.runs(r, runs, generation);
                }
                Err(e) => {
                    tracing::error!(replica = r.key, error = %e, "replica failed to start");
                    let now = Instant::now();
                    let entry = self.failed.entry(r.key.clone()).or_insert_with(|| {
                        (
                            String::new(),
                            now,
                            Backoff::new(
                                Duration::from_millis(500),
                                Duration::from_secs(30),
                                Duration::from_secs(300),
                            ),
                        )
                    });
                    let delay = entry.2.next_delay(now);
                    entry.0 = e;
                    entry.1 = now + delay;
                }
            }
        }
        self.publish();
    }

    /// Writes what runs into the shared inventory record.
    fn publish(&self) {
        let used_slots: u32 = self.running.values().map(|r| r.replica.slots).sum();
        let used_mem: u64 = self.running.values().map(|r| r.replica.memory_mib).sum();
        let http = self
            .running
            .values()
            .find(|r| r.runs == Runs::Frontend && !r.stopping)
            .and_then(|r| self.frontend_listen(&r.replica).ok())
            .map(|a| a.to_string());
        if let Ok(mut rec) = self.record.lock() {
            rec.free_slots = self.join.slots.saturating_sub(used_slots);
            rec.free_memory_mib = self.join.memory_mib.saturating_sub(used_mem);
            rec.registration.http_addr = http;
            // Ready: its actors run now (a crashed one waiting for its
            // restart is not), and a worker's engine serves.
            let up = |r: &Running| match r.runs {
                Runs::Frontend => self.live.1,
                Runs::Worker(id) => self.live.0.contains_key(&id) && !self.live.2.contains(&id),
            };
            rec.replicas = self
                .running
                .values()
                .map(|r| RunningReplica {
                    key: r.replica.key.clone(),
                    ready: !r.stopping && up(r),
                    stopping: r.stopping,
                    generation: r.generation,
                    error: String::new(),
                    slots: r.replica.slots,
                    memory_mib: r.replica.memory_mib,
                })
                .chain(self.failed.iter().map(|(k, (e, _, _))| RunningReplica {
                    key: k.clone(),
                    ready: false,
                    stopping: false,
                    generation: 0,
                    error: e.clone(),
                    slots: 0,
                    memory_mib: 0,
                }))
                .collect();
        }
        self.changed.notify_one();
    }

    fn frontend_listen(&self, r: &AssignedReplica) -> Result<std::net::SocketAddr, String> {
        let (g, _) = self.frontend_config(r)?;
        Ok(g.listen)
    }

    fn frontend_config(
        &self,
        r: &AssignedReplica,
    ) -> Result<(dynamo_gateway::GatewayConfig, dynamo_router::RouterConfig), String> {
        let v: serde_json::Value =
            serde_json::from_str(&r.settings).map_err(|e| format!("settings: {e}"))?;
        let field = format!("services.{}", r.service);
        let (mut g, rt) = frontend_from_spec(
            &field,
            v.get("gateway").filter(|x| !x.is_null()),
            v.get("router").filter(|x| !x.is_null()),
        )
        .map_err(|e| e.to_string())?;
        if let Some(l) = self.join.http_listen {
            g.listen = l;
            // The open-gateway rule holds for the address actually served.
            let allowed = v["gateway"]["allow_unauthenticated"] == serde_json::json!(true);
            if g.api_keys.is_empty() && !l.ip().is_loopback() && !allowed {
                return Err(format!(
                    "{field}.gateway: --http-listen {l} is reachable from other hosts and the \
                     service has no API keys (gateway.api_keys_file); set \
                     gateway.allow_unauthenticated = true in the spec to serve it open"
                ));
            }
        }
        Ok((g, rt))
    }

    async fn start(&mut self, r: &AssignedReplica) -> Result<(Runs, u64), String> {
        let limit = Some(Duration::from_secs(30));
        if r.role == "frontend" {
            let (g, rt) = self.frontend_config(r)?;
            let res = self
                .sup
                .call(
                    |reply| SupervisorMsg::StartFrontend {
                        gateway: Box::new(g),
                        router: Box::new(rt),
                        reply,
                    },
                    limit,
                )
                .await;
            return match res {
                Ok(ractor::rpc::CallResult::Success(Ok(()))) => Ok((Runs::Frontend, 0)),
                Ok(ractor::rpc::CallResult::Success(Err(e))) => Err(e),
                _ => Err("the node supervisor did not answer".into()),
            };
        }
        let v: serde_json::Value =
            serde_json::from_str(&r.settings).map_err(|e| format!("settings: {e}"))?;
        let group = worker_from_spec(&format!("services.{}", r.service), &v, &r.role)
            .map_err(|e| e.to_string())?;
        // By what the load makes: an external engine's server reads the
        // file itself, so its group waits for the file to be written.
        let model_key = format!(
            "{:?}|{}|{}|{}|{}|{:?}",
            group.model_path,
            group.model,
            group.engine.block_size(),
            matches!(group.engine, crate::config::EngineSpec::Cpu { .. }),
            matches!(group.engine, crate::config::EngineSpec::External { .. }),
            group.context_length
        );
        let model = match self.models.get(&model_key) {
            Some(m) => m.clone(),
            None => {
                // No wait for a source here: the agent would stop answering
                // meanwhile. A start without one fails, shows in status, and
                // is retried with backoff.
                let m = Arc::new(
                    crate::daemon::load_group_model(&group, &self.weights, Duration::ZERO)
                        .await
                        .map_err(|e| format!("{e:#}"))?,
                );
                self.models.insert(model_key, m.clone());
                m
            }
        };
        let worker_id = self.worker_id(&r.key);
        let res = self
            .sup
            .call(
                |reply| SupervisorMsg::StartWorker {
                    group: Box::new(group),
                    model,
                    worker_id,
                    reply,
                },
                limit,
            )
            .await;
        match res {
            Ok(ractor::rpc::CallResult::Success(Ok(generation))) => {
                Ok((Runs::Worker(worker_id), generation))
            }
            Ok(ractor::rpc::CallResult::Success(Err(e))) => Err(e),
            _ => Err("the node supervisor did not answer".into()),
        }
    }

    /// Starts draining a replica; [`AgentMsg::Stopped`] comes when it is gone.
    async fn stop(&mut self, key: &str, myself: &ActorRef<AgentMsg>) {
        let Some(r) = self.running.get_mut(key) else {
            return;
        };
        r.stopping = true;
        tracing::info!(replica = key, "replica leaving: draining");
        // The supervisor owns the drain: it outlives this agent, so a
        // replica half drained when the agent restarts is still stopped.
        let worker = match r.runs {
            Runs::Worker(id) => Some(id),
            Runs::Frontend => None,
        };
        let msg = SupervisorMsg::Remove {
            worker,
            grace: self.cfg.shutdown_grace,
            key: key.to_string(),
        };
        if self.sup.cast(msg).is_err() {
            let _ = myself.cast(AgentMsg::Stopped(key.to_string()));
        }
    }
}

/// Writes the node's inventory every second (and whenever it can after a
/// bus restart), with the actor names the supervisor reports.
async fn report_inventory(
    bus: Bus,
    record: Arc<Mutex<NodeInventory>>,
    sup: ActorRef<SupervisorMsg>,
    changed: Arc<tokio::sync::Notify>,
) {
    let mut beat = tokio::time::interval(Duration::from_secs(1));
    beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut kv = None;
    loop {
        tokio::select! {
            _ = beat.tick() => {}
            _ = changed.notified() => {}
        }
        if let Ok(ractor::rpc::CallResult::Success(mut c)) = sup
            .call(SupervisorMsg::Children, Some(Duration::from_secs(1)))
            .await
        {
            c.sort();
            if let Ok(mut r) = record.lock() {
                r.registration.actors = c;
            }
        }
        let rec = match record.lock() {
            Ok(mut r) => {
                r.registration.heartbeat_unix_ms = unix_ms();
                r.clone()
            }
            Err(_) => return,
        };
        if kv.is_none() {
            let name = bus.subjects.nodes_bucket();
            kv = tokio::time::timeout(
                Duration::from_secs(2),
                bus.kv_bucket(&name, REGISTRY_MAX_AGE),
            )
            .await
            .ok()
            .and_then(|r| r.ok());
            // At start, or after the server lost its JetStream state: the
            // streams this node's workers write but may not make.
            if kv.is_some() {
                crate::access::ensure_worker_streams(&bus).await;
            }
        }
        let Some(store) = &kv else { continue };
        let bytes = match encode(&rec) {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(error = %e, "cannot encode the node inventory");
                continue;
            }
        };
        let put = store.put(rec.registration.node_id.0.clone(), bytes.into());
        if !matches!(
            tokio::time::timeout(Duration::from_secs(2), put).await,
            Ok(Ok(_))
        ) {
            kv = None;
        }
    }
}

/// Watches the node's assignment key and hands every change to the agent.
/// Returns (failing the agent, which is restarted) if the watch ends.
/// The newest assignment the watch saw (with its revision), for the agent
/// to take.
type Latest = Arc<Mutex<Option<(Option<NodeAssignment>, u64)>>>;

async fn watch_assignment(latest: Latest, bus: Bus, node: String, agent: ActorRef<AgentMsg>) {
    let mut backoff = Backoff::new(
        Duration::from_millis(200),
        Duration::from_secs(5),
        Duration::from_secs(60),
    );
    loop {
        let watched = async {
            let kv = bus
                .kv_bucket_durable(&bus.subjects.assignments_bucket())
                .await
                .map_err(|e| e.to_string())?;
            let mut w = kv.watch(&node).await.map_err(|e| e.to_string())?;
            while let Some(e) = w.next().await {
                let e = e.map_err(|e| e.to_string())?;
                let a = match e.operation {
                    async_nats::jetstream::kv::Operation::Put => {
                        match decode::<NodeAssignment>(&e.value) {
                            Ok(a) => Some(a),
                            Err(err) => {
                                dynamo_runtime::counters::reject("NodeAssignment", &node, &err);
                                continue;
                            }
                        }
                    }
                    _ => None,
                };
                let queued = match latest.lock() {
                    Ok(mut l) => l.replace((a, e.revision)).is_some(),
                    Err(_) => return Ok(()),
                };
                if !queued && agent.cast(AgentMsg::AssignmentChanged).is_err() {
                    return Ok(());
                }
            }
            Err::<(), String>("the watch ended".into())
        };
        if let Err(e) = watched.await {
            tracing::warn!(error = %e, "assignment watch interrupted; watching again");
        } else {
            return;
        }
        tokio::time::sleep(backoff.next_delay(Instant::now())).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rep(key: &str, settings: &str) -> AssignedReplica {
        AssignedReplica {
            key: key.into(),
            deployment: "d".into(),
            service: "decode".into(),
            role: "decode".into(),
            settings: settings.into(),
            slots: 1,
            memory_mib: 0,
        }
    }

    fn running(r: AssignedReplica, stopping: bool) -> Running {
        Running {
            runs: Runs::Worker(WorkerId(1)),
            replica: r,
            generation: 1,
            stopping,
        }
    }

    #[test]
    fn only_what_changed_is_touched() {
        let mut run = BTreeMap::new();
        run.insert("d/a".to_string(), running(rep("d/a", "{}"), false));
        run.insert("d/b".to_string(), running(rep("d/b", "{}"), false));
        run.insert("d/c".to_string(), running(rep("d/c", "{}"), false));
        let want = vec![rep("d/a", "{}"), rep("d/b", "{\"x\":1}"), rep("d/e", "{}")];
        let p = plan(&want, &run);
        assert_eq!(p.stop, vec!["d/b".to_string(), "d/c".to_string()]);
        assert_eq!(
            p.start.iter().map(|r| r.key.as_str()).collect::<Vec<_>>(),
            vec!["d/e"]
        );
        // Once b has stopped it is started with its new settings.
        run.remove("d/b");
        run.get_mut("d/c").unwrap().stopping = true;
        let p = plan(&want, &run);
        assert!(p.stop.is_empty(), "a stopping replica is left to finish");
        assert_eq!(p.start.len(), 2);
        assert!(plan(&[], &BTreeMap::new()) == Plan::default());
    }
}
