//! The planner actors.
//!
//! - [`PlannersActor`] (one per node with the controller or planner role)
//!   runs a [`PlannerActor`] for every deployment whose spec has a
//!   `planner:` section, supervises them (a failed one is started again on
//!   the next look) and stops the ones whose deployment or section is gone.
//! - [`PlannerActor`] (one per deployment per such node) hears the
//!   frontends' and workers' metrics all the time, but decides only while
//!   it holds the deployment's lease (planner bucket, `lease.<deployment>`).
//!   It acts through the desired state, the path `dynamoctl scale` takes
//!   (or the Kubernetes connector where the deployment runs there).
//!
//! Invariants: one active planner per deployment (the lease); a planner
//! checks its lease right before each write, so a deposed one writes
//! nothing (on the desired state a compare-and-set fences it too; on
//! Kubernetes a patch applies only if the replica count is still the one
//! read that tick, see `k8s`, which stops a deposed planner once its
//! successor has patched);
//! its status carries its memory, so the next holder continues (no
//! decision is made twice, no shrink delay restarts); pinned targets are
//! never changed by a decision (on Kubernetes the pin's own count is what
//! gets applied, since nothing else applies it there).

use crate::feed::MetricsFeed;
use crate::k8s::K8s;
use crate::targets::{
    models, placements, pod_placements, pod_serving, targets, with_observed, Seed,
};
use async_nats::jetstream::kv;
use dynamo_bus_schema::{
    decode, encode, peek_kind, unix_ms, DeploymentRecord, DeploymentStatus, FrontendMetrics,
    NodeAssignment, NodeId, PlannerDecision, PlannerPin, PlannerStatus, PlannerTarget, WireMessage,
    WorkerMetrics, WorkerRegistration, MAX_DECISIONS, MAX_MEMORY_JSON, MAX_PLANNER_ITEMS,
};
use dynamo_cluster_config::planner_spec::PlannerPolicy;
use dynamo_cluster_config::spec::DeploymentSpec;
use dynamo_controller::{bounded, desired, lease, read_all};
use dynamo_planner::{Memory, PlannerState};
use dynamo_runtime::Bus;
use futures::StreamExt;
use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Planner settings (the node's; the SLA and bounds are the spec's).
#[derive(Clone, Debug)]
pub struct PlannerConfig {
    /// This node (the lease holder's name).
    pub node_id: NodeId,
    /// Another planner takes a deployment's lease this long after the
    /// holder's last renewal.
    pub lease_ttl: Duration,
    /// How often the set of deployments with a planner is looked at.
    pub poll: Duration,
    /// Scale through this Kubernetes namespace's Grove objects instead of
    /// the desired state (needs the `k8s-client` feature).
    pub kubernetes_namespace: Option<String>,
}

impl PlannerConfig {
    pub fn new(node_id: NodeId) -> Self {
        PlannerConfig {
            node_id,
            lease_ttl: Duration::from_secs(3),
            poll: Duration::from_secs(1),
            kubernetes_namespace: None,
        }
    }
}

pub struct PlannersArgs {
    pub bus: Bus,
    pub config: PlannerConfig,
    pub seed: Seed,
}

pub enum PlannersMsg {
    Tick,
}

pub struct PlannersActor;

pub struct Planners {
    bus: Bus,
    cfg: PlannerConfig,
    seed: Seed,
    deployments: Option<kv::Store>,
    children: HashMap<String, ActorRef<PlannerMsg>>,
}

impl Actor for PlannersActor {
    type Msg = PlannersMsg;
    type State = Planners;
    type Arguments = PlannersArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<PlannersMsg>,
        args: PlannersArgs,
    ) -> Result<Planners, ActorProcessingErr> {
        let _ = myself.cast(PlannersMsg::Tick);
        Ok(Planners {
            bus: args.bus,
            cfg: args.config,
            seed: args.seed,
            deployments: None,
            children: HashMap::new(),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<PlannersMsg>,
        msg: PlannersMsg,
        st: &mut Planners,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            PlannersMsg::Tick => {
                if let Err(e) = st.look(&myself).await {
                    tracing::warn!(error = %e, "planners: cannot read the deployments");
                    st.deployments = None;
                }
                myself.send_after(st.cfg.poll, || PlannersMsg::Tick);
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<PlannersMsg>,
        evt: SupervisionEvent,
        st: &mut Planners,
    ) -> Result<(), ActorProcessingErr> {
        let gone = match &evt {
            SupervisionEvent::ActorTerminated(cell, _, why) => Some((cell.get_id(), why.clone())),
            SupervisionEvent::ActorFailed(cell, e) => Some((cell.get_id(), Some(e.to_string()))),
            _ => None,
        };
        if let Some((id, why)) = gone {
            st.children.retain(|dep, c| {
                let keep = c.get_id() != id;
                if !keep {
                    tracing::warn!(deployment = %dep, reason = ?why, "planner stopped; starting it again");
                }
                keep
            });
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<PlannersMsg>,
        st: &mut Planners,
    ) -> Result<(), ActorProcessingErr> {
        for c in st.children.values() {
            c.stop(None);
        }
        Ok(())
    }
}

impl Planners {
    async fn look(&mut self, myself: &ActorRef<PlannersMsg>) -> Result<(), String> {
        if self.deployments.is_none() {
            let s = &self.bus.subjects;
            self.deployments = Some(
                bounded(
                    "deployments bucket",
                    self.bus.kv_bucket_durable(&s.deployments_bucket()),
                )
                .await?,
            );
        }
        let Some(store) = &self.deployments else {
            return Ok(());
        };
        let recs: std::collections::BTreeMap<String, DeploymentRecord> = read_all(store).await?;
        let planned: BTreeSet<String> = recs
            .iter()
            .filter(|(_, r)| DeploymentSpec::parse(&r.spec_yaml).is_ok_and(|s| s.planner.is_some()))
            .map(|(n, _)| n.clone())
            .collect();
        self.children.retain(|dep, c| {
            let keep = planned.contains(dep);
            if !keep {
                c.stop(Some("its deployment has no planner any more".into()));
            }
            keep
        });
        for dep in planned {
            if self.children.contains_key(&dep) {
                continue;
            }
            let args = PlannerArgs {
                bus: self.bus.clone(),
                config: self.cfg.clone(),
                seed: self.seed.clone(),
                deployment: dep.clone(),
            };
            match Actor::spawn_linked(None, PlannerActor, args, myself.get_cell()).await {
                Ok((a, _)) => {
                    self.children.insert(dep, a);
                }
                Err(e) => tracing::warn!(deployment = %dep, error = %e, "planner did not start"),
            }
        }
        Ok(())
    }
}

pub struct PlannerArgs {
    pub bus: Bus,
    pub config: PlannerConfig,
    pub seed: Seed,
    pub deployment: String,
}

pub enum PlannerMsg {
    Tick,
}

pub struct PlannerActor;

struct Buckets {
    deployments: kv::Store,
    status: kv::Store,
    assignments: kv::Store,
    planner: kv::Store,
    pins: kv::Store,
    /// The worker registry, read only on Kubernetes (see `pod_placements`).
    workers: Option<kv::Store>,
}

/// What a tick's Kubernetes read-back came to.
enum K8sRead {
    /// Read (or not on Kubernetes): decide.
    Read,
    /// The read failed: decide nothing, and say why.
    Failed(String),
    /// The lease was lost on the way: write nothing.
    Deposed,
}

pub struct Planner {
    bus: Bus,
    cfg: PlannerConfig,
    seed: Seed,
    deployment: String,
    buckets: Option<Buckets>,
    feed: Arc<Mutex<MetricsFeed>>,
    /// While active: the decisions' state.
    state: Option<PlannerState>,
    epoch: u64,
    active: bool,
    /// What this planner has seen of the lease while another held it.
    lease_seen: lease::Observed,
    last_sizing_ms: u64,
    decisions: VecDeque<PlannerDecision>,
    /// Period of the next tick (the spec's fast interval).
    every: Duration,
    /// Where the deployment runs on Kubernetes: its connector.
    k8s: Option<K8s>,
    _tasks: dynamo_runtime::Tasks,
}

/// Feeds the metrics heard on the bus into `feed` (bad messages are
/// logged, counted and skipped).
async fn listen(bus: Bus, feed: Arc<Mutex<MetricsFeed>>) {
    let s = &bus.subjects;
    let (front, work) = (s.frontend_metrics(), s.worker_metrics());
    let subs = futures::future::join(
        bus.client.subscribe(front.clone()),
        bus.client.subscribe(work.clone()),
    )
    .await;
    let (Ok(a), Ok(b)) = subs else {
        tracing::warn!("planner cannot subscribe to the metrics");
        return;
    };
    let mut all = futures::stream::select(a, b);
    while let Some(m) = all.next().await {
        let kind = match peek_kind(&m.payload) {
            Ok((k, _)) => k,
            Err(e) => {
                dynamo_runtime::counters::reject("planner metrics", m.subject.as_str(), &e);
                continue;
            }
        };
        let Ok(mut f) = feed.lock() else { return };
        if kind == FrontendMetrics::KIND {
            match decode::<FrontendMetrics>(&m.payload) {
                Ok(x) if x.ttft.len() <= 64 && x.itl.len() <= 64 => f.frontend(&x, unix_ms()),
                Ok(_) => dynamo_runtime::counters::reject(
                    "FrontendMetrics",
                    m.subject.as_str(),
                    &"histogram past its bound",
                ),
                Err(e) => {
                    dynamo_runtime::counters::reject("FrontendMetrics", m.subject.as_str(), &e)
                }
            }
        } else if kind == WorkerMetrics::KIND {
            match decode::<WorkerMetrics>(&m.payload) {
                Ok(x) => f.worker(&x, unix_ms()),
                Err(e) => dynamo_runtime::counters::reject("WorkerMetrics", m.subject.as_str(), &e),
            }
        } else {
            dynamo_runtime::counters::reject(
                "planner metrics",
                m.subject.as_str(),
                &format!("unexpected message kind {}", kind.0),
            );
        }
    }
}

impl Actor for PlannerActor {
    type Msg = PlannerMsg;
    type State = Planner;
    type Arguments = PlannerArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<PlannerMsg>,
        args: PlannerArgs,
    ) -> Result<Planner, ActorProcessingErr> {
        let me = myself.clone();
        let tasks = dynamo_runtime::Tasks::new(Arc::new(move |why| {
            tracing::error!(%why, "planner task ended");
            me.stop(Some(why));
        }));
        let feed = Arc::new(Mutex::new(MetricsFeed::new(unix_ms())));
        tasks.spawn("metrics", listen(args.bus.clone(), feed.clone()));
        let _ = myself.cast(PlannerMsg::Tick);
        let k8s = args.config.kubernetes_namespace.clone().map(K8s::new);
        Ok(Planner {
            bus: args.bus,
            cfg: args.config,
            seed: args.seed,
            deployment: args.deployment,
            buckets: None,
            feed,
            state: None,
            epoch: 0,
            active: false,
            lease_seen: Default::default(),
            last_sizing_ms: 0,
            decisions: VecDeque::new(),
            every: Duration::from_secs(1),
            k8s,
            _tasks: tasks,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<PlannerMsg>,
        msg: PlannerMsg,
        st: &mut Planner,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            PlannerMsg::Tick => {
                if let Err(e) = st.tick().await {
                    tracing::warn!(deployment = %st.deployment, error = %e, "planner tick failed");
                    st.buckets = None;
                }
                myself.send_after(st.every, || PlannerMsg::Tick);
            }
        }
        Ok(())
    }
}

impl Planner {
    async fn buckets(&mut self) -> Result<&Buckets, String> {
        if self.buckets.is_none() {
            let s = &self.bus.subjects;
            let bus = &self.bus;
            self.buckets = Some(Buckets {
                deployments: bounded(
                    "deployments bucket",
                    bus.kv_bucket_durable(&s.deployments_bucket()),
                )
                .await?,
                status: bounded(
                    "status bucket",
                    bus.kv_bucket_durable(&s.deploy_status_bucket()),
                )
                .await?,
                assignments: bounded(
                    "assignments bucket",
                    bus.kv_bucket_durable(&s.assignments_bucket()),
                )
                .await?,
                planner: bounded("planner bucket", bus.kv_bucket_durable(&s.planner_bucket()))
                    .await?,
                pins: bounded("pins bucket", bus.kv_bucket_durable(&s.pins_bucket())).await?,
                workers: match self.k8s {
                    Some(_) => Some(
                        bounded(
                            "workers bucket",
                            bus.kv_bucket(
                                &s.workers_bucket(),
                                dynamo_runtime::bus::REGISTRY_MAX_AGE,
                            ),
                        )
                        .await?,
                    ),
                    None => None,
                },
            });
        }
        self.buckets.as_ref().ok_or_else(|| "no buckets".into())
    }

    fn lease_key(&self) -> String {
        format!("lease.{}", self.deployment)
    }

    fn status_key(&self) -> String {
        format!("status.{}", self.deployment)
    }

    /// Whether this planner (still) holds the deployment's lease.
    async fn hold(&mut self) -> Result<bool, String> {
        let (key, me, ttl) = (
            self.lease_key(),
            self.cfg.node_id.clone(),
            self.cfg.lease_ttl,
        );
        let (epoch, was) = (self.epoch, self.active);
        let store = self.buckets().await?.planner.clone();
        let seen = &mut self.lease_seen;
        let held = lease::claim(&store, &key, &me, ttl, epoch, was, seen).await?;
        Ok(match held {
            Some(e) => {
                if self.state.is_some() && e != self.epoch {
                    // Taken back under a new epoch (a lease that was
                    // deleted or unreadable): a takeover like any other,
                    // so the next tick fences the last holder and adopts
                    // afresh.
                    self.state = None;
                }
                self.epoch = e;
                true
            }
            None => false,
        })
    }

    async fn tick(&mut self) -> Result<(), String> {
        let now = unix_ms();
        let dep = self.deployment.clone();
        let b = self.buckets().await?;
        let rec = bounded("deployment", desired::record(&b.deployments, &dep)).await?;
        let Some((rec, _)) = rec else {
            // Deleted: the manager stops this planner. Its status goes (a
            // tick that read the record before the delete may have written
            // it after `dynamoctl delete` removed it).
            let key = format!("status.{dep}");
            let _ = bounded("planner status", b.planner.purge(key)).await;
            return Ok(());
        };
        let spec = DeploymentSpec::parse(&rec.spec_yaml).map_err(|e| e.to_string())?;
        let Some(pspec) = spec.planner.clone() else {
            return Ok(());
        };
        self.every = pspec.fast_interval;
        let was = self.active;
        self.active = self.hold().await?;
        if !self.active {
            if was {
                tracing::warn!(deployment = %dep, "planner lost its lease; standing by");
            }
            self.state = None;
            // Standing by: windows are taken (and dropped) so a takeover
            // starts from fresh ones.
            if let Ok(mut f) = self.feed.lock() {
                let _ = f.take(now, true, &|_| None);
            }
            return Ok(());
        }
        if self.state.is_none() {
            // Fences the last holder: a write it prepared before this
            // takeover now fails (see `desired`'s module docs).
            let store = self.buckets().await?.deployments.clone();
            bounded("deployment", desired::touch(&store, &dep)).await?;
            self.adopt(&pspec).await?;
            tracing::info!(deployment = %dep, epoch = self.epoch, node = %self.cfg.node_id, "planner active");
            // The record read above may predate a last write of the old
            // holder's that landed before the touch: decide from the next
            // tick's read.
            return Ok(());
        }
        let b = self.buckets().await?;
        // On Kubernetes (where the planner reads the workers bucket) no
        // controller writes a status: replicas come from the API server.
        let status: Option<DeploymentStatus> = if b.workers.is_some() {
            None
        } else {
            match bounded("status", b.status.entry(dep.clone())).await? {
                Some(e) if e.operation == kv::Operation::Put => decode(&e.value).ok(),
                _ => None,
            }
        };
        let pins: std::collections::BTreeMap<String, PlannerPin> = read_all(&b.pins).await?;
        let pins: Vec<PlannerPin> = pins.into_values().filter(|p| p.deployment == dep).collect();
        let pinned: BTreeSet<String> = pins.iter().map(|p| p.target.clone()).collect();
        let (workers, assignments) = (b.workers.clone(), b.assignments.clone());
        let mut ts = targets(&spec, status.as_ref(), &pinned, &self.seed);
        let place = match workers {
            Some(workers) => {
                // On Kubernetes: replicas from the API server, workers by
                // their pods' names (see `k8s`).
                let regs: std::collections::BTreeMap<String, WorkerRegistration> =
                    read_all(&workers).await?;
                let regs: Vec<WorkerRegistration> = regs.into_values().collect();
                match self.kubernetes(&spec, &mut ts, &regs, &pins).await? {
                    K8sRead::Read => {}
                    K8sRead::Deposed => return Ok(()),
                    K8sRead::Failed(why) => {
                        // Decides nothing, and says why in its status.
                        let notes: Vec<dynamo_planner::Note> = ts
                            .iter()
                            .map(|t| dynamo_planner::Note {
                                target: t.name.clone(),
                                desired: t.desired,
                                ready: t.ready,
                                recommended: t.desired,
                                pinned: t.pinned,
                                reason: format!("not decided: {why}"),
                                numbers: Default::default(),
                            })
                            .collect();
                        return self.report(&pspec.policy, &notes, now).await;
                    }
                }
                pod_placements(&spec, &regs)
            }
            None => {
                let assignments: std::collections::BTreeMap<String, NodeAssignment> =
                    read_all(&assignments).await?;
                let assignments: Vec<NodeAssignment> = assignments.into_values().collect();
                placements(self.bus.subjects.namespace().as_str(), &spec, &assignments)
            }
        };
        let sizing = now.saturating_sub(self.last_sizing_ms) >= pspec.interval.as_millis() as u64;
        if sizing {
            self.last_sizing_ms = now;
        }
        let (fast, slow) = {
            let mut f = self
                .feed
                .lock()
                .map_err(|_| "metrics feed poisoned".to_string())?;
            f.models = models(&spec);
            f.take(now, sizing, &|w| place.get(&w).cloned())
        };
        tracing::debug!(deployment = %dep, arrivals = fast.arrivals, queued = fast.queued, held = fast.held, inflight = fast.inflight, workers = fast.workers.len(), "planner window");
        let Some(state) = self.state.as_mut() else {
            return Ok(());
        };
        state.spec = pspec.clone();
        let ev = state.evaluate(&ts, &fast, slow.as_ref());
        let first_seq = state
            .memory
            .decisions
            .saturating_sub(ev.changes.len() as u64);
        for (i, c) in ev.changes.iter().enumerate() {
            let seq = first_seq + 1 + i as u64;
            // Fenced: only with the lease renewed just before.
            if !self.hold().await? {
                self.active = false;
                self.state = None;
                tracing::warn!(deployment = %dep, "planner lost its lease before acting");
                return Ok(());
            }
            let res = self.apply(&spec, &c.target, c.to).await;
            if !self.active || self.state.is_none() {
                // Deposed between reading the record and writing it
                // (nothing was written), or the lease was re-taken under a
                // new epoch: either way this tick's decisions are stale,
                // and nothing more is written (the status neither) until
                // the next tick fences and adopts.
                tracing::warn!(deployment = %dep, "planner lost its lease before acting");
                return Ok(());
            }
            let (applied, reason) = match res {
                Ok(()) => (true, c.reason.clone()),
                Err(e) => (false, format!("{}; not applied: {e}", c.reason)),
            };
            tracing::info!(deployment = %dep, target = %c.target, from = c.from, to = c.to, rule = %c.rule, applied, "planner: {reason}");
            crate::metrics::decided(&dep, &c.target, &c.rule, c.to > c.from, applied);
            self.decisions.push_back(PlannerDecision {
                seq,
                unix_ms: now,
                target: c.target.clone(),
                from: c.from,
                to: c.to,
                rule: c.rule.clone(),
                reason,
                applied,
            });
            while self.decisions.len() > MAX_DECISIONS {
                self.decisions.pop_front();
            }
        }
        for n in &ev.notes {
            crate::metrics::recommended(&dep, &n.target, n.desired, n.recommended, n.ready);
        }
        self.report(&pspec.policy, &ev.notes, now).await
    }

    /// On Kubernetes: reads each target's replicas back into `ts` (ready
    /// only as far as its workers serve), and makes a manual `dynamoctl
    /// scale` (a pin, written to the desired state, which nothing else
    /// applies there) take effect on the Grove object. When the read
    /// failed (logged) or the lease was lost, the tick decides nothing.
    async fn kubernetes(
        &mut self,
        spec: &DeploymentSpec,
        ts: &mut [dynamo_planner::Target],
        regs: &[WorkerRegistration],
        pins: &[PlannerPin],
    ) -> Result<K8sRead, String> {
        let dep = self.deployment.clone();
        let Some(k) = self.k8s.as_mut() else {
            return Ok(K8sRead::Read);
        };
        // The planner's targets, and any other service a pin scales.
        let names: Vec<String> = ts
            .iter()
            .map(|t| t.name.clone())
            .chain(pins.iter().map(|p| p.target.clone()))
            .collect::<BTreeSet<String>>()
            .into_iter()
            .collect();
        let observed = match k.observe(spec, &names).await {
            Ok(o) => o,
            Err(e) => {
                tracing::warn!(deployment = %dep, namespace = %k.namespace(), error = %e, "planner: cannot read the replicas back from Kubernetes; deciding nothing this tick");
                return Ok(K8sRead::Failed(format!(
                    "cannot read the replicas back from Kubernetes namespace {}: {e}",
                    k.namespace()
                )));
            }
        };
        with_observed(
            ts,
            &observed,
            &pod_serving(spec, regs, unix_ms(), &observed),
        );
        for p in pins {
            let Some(o) = observed.get(&p.target) else {
                continue;
            };
            if o.desired == p.replicas {
                continue;
            }
            if p.replicas == 0 {
                let first = self
                    .k8s
                    .as_mut()
                    .is_some_and(|k| k.first_warning(&p.target, p.replicas));
                if first {
                    tracing::warn!(deployment = %dep, target = %p.target, "planner: a pin of 0 replicas cannot be applied on Kubernetes (Grove keeps at least one); release it or pin 1 or more");
                }
                continue;
            }
            // Fenced like every write: only with the lease renewed.
            if !self.hold().await? || self.state.is_none() {
                return Ok(K8sRead::Deposed);
            }
            let Some(k) = self.k8s.as_mut() else {
                return Ok(K8sRead::Deposed);
            };
            match k.scale(spec, &p.target, p.replicas).await {
                Ok(()) => {
                    tracing::info!(deployment = %dep, target = %p.target, from = o.desired, to = p.replicas, "planner: applied a manual scale (pin) to Kubernetes");
                    // This tick's budget sees the pinned count.
                    if let Some(t) = ts.iter_mut().find(|t| t.name == p.target) {
                        t.desired = p.replicas;
                        t.ready = t.ready.min(p.replicas);
                    }
                }
                Err(e) => {
                    if k.first_warning(&p.target, p.replicas) {
                        tracing::warn!(deployment = %dep, target = %p.target, to = p.replicas, error = %e, "planner: cannot apply a manual scale (pin) to Kubernetes (retried every tick; logged once)");
                    }
                }
            }
        }
        Ok(K8sRead::Read)
    }

    /// Continues from the last holder's status (its memory and decisions),
    /// or starts afresh.
    async fn adopt(
        &mut self,
        pspec: &dynamo_cluster_config::planner_spec::PlannerSpec,
    ) -> Result<(), String> {
        let key = self.status_key();
        let b = self.buckets().await?;
        let prev: Option<PlannerStatus> =
            match bounded("planner status", b.planner.entry(key)).await? {
                Some(e) if e.operation == kv::Operation::Put => decode(&e.value).ok(),
                _ => None,
            };
        let memory = prev
            .as_ref()
            .and_then(|p| serde_json::from_str::<Memory>(&p.memory_json).ok());
        self.decisions = prev.map(|p| p.decisions.into()).unwrap_or_default();
        self.state = Some(match memory {
            Some(m) => PlannerState::adopt(pspec.clone(), m),
            None => PlannerState::new(pspec.clone()),
        });
        self.last_sizing_ms = unix_ms();
        Ok(())
    }

    /// Sets a target's replicas: the desired state (the controller places
    /// it), or the Kubernetes objects where the deployment runs there.
    async fn apply(
        &mut self,
        spec: &DeploymentSpec,
        target: &str,
        replicas: u32,
    ) -> Result<(), String> {
        if let Some(k) = self.k8s.as_mut() {
            return k.scale(spec, target, replicas).await;
        }
        let dep = self.deployment.clone();
        let store = self.buckets().await?.deployments.clone();
        // Fenced: the lease is renewed between reading the record and
        // writing it by compare-and-set (see `desired`'s module docs).
        for _ in 0..desired::ATTEMPTS {
            let prepared = bounded(
                "scale",
                desired::prepare_scale(&store, &dep, target, replicas),
            )
            .await?;
            let desired::Scale::Ready(p) = prepared else {
                return Ok(());
            };
            if !self.hold().await? {
                self.active = false;
                self.state = None;
                return Err("not written: this planner lost its lease".into());
            }
            if bounded("scale", p.commit(&store)).await.is_ok() {
                return Ok(());
            }
        }
        Err(format!("deployment {dep} kept changing under us"))
    }

    async fn report(
        &mut self,
        policy: &PlannerPolicy,
        notes: &[dynamo_planner::Note],
        now: u64,
    ) -> Result<(), String> {
        let memory_json = self
            .state
            .as_ref()
            .and_then(|s| serde_json::to_string(&s.memory).ok())
            .filter(|j| j.len() <= MAX_MEMORY_JSON)
            .unwrap_or_default();
        let status = PlannerStatus {
            deployment: self.deployment.clone(),
            holder: self.cfg.node_id.clone(),
            epoch: self.epoch,
            policy: match policy {
                PlannerPolicy::Sla => "sla".into(),
                PlannerPolicy::Load => "load".into(),
            },
            updated_unix_ms: now,
            targets: notes
                .iter()
                .take(MAX_PLANNER_ITEMS)
                .map(|n| PlannerTarget {
                    name: n.target.clone(),
                    desired: n.desired,
                    ready: n.ready,
                    recommended: n.recommended,
                    pinned: n.pinned,
                    reason: n.reason.clone(),
                    numbers: n
                        .numbers
                        .iter()
                        .take(MAX_PLANNER_ITEMS)
                        .map(|(k, v)| (k.clone(), *v))
                        .collect(),
                })
                .collect(),
            decisions: self.decisions.iter().cloned().collect(),
            memory_json,
        };
        let bytes = encode(&status).map_err(|e| e.to_string())?;
        let key = self.status_key();
        let b = self.buckets().await?;
        bounded("planner status", b.planner.put(key, bytes.into())).await?;
        Ok(())
    }
}
