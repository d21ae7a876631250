//! `ControllerActor`: runs on every node with the controller role; exactly
//! one is active, through a lease in JetStream KV.
//!
//! The lease (controller bucket, key `lease`) is taken and renewed only by
//! compare-and-set on the entry's revision: `create` when there is none,
//! `update(revision)` to renew, and `update(revision)` with a greater epoch
//! to take it over once it has not been renewed for its TTL. A controller
//! that fails to renew stops acting at once (before anyone else may take
//! the lease: it renews every tick, the TTL is several ticks).
//!
//! Each tick the active controller reads the desired state, the inventory
//! and the assignments, and writes only what changed (assignments, then
//! statuses). Every bus call is bounded by a timeout; a failed tick is
//! logged and the next one tries again. Ticks are scheduled one after the
//! other (never queued behind a slow one).

use crate::state::{ControllerState, Deployment, World};
use async_nats::jetstream::kv;
use dynamo_bus_schema::{
    decode, encode, unix_ms, DeploymentRecord, DeploymentStatus, NodeAssignment, NodeId,
    NodeInventory, WireMessage,
};
use dynamo_cluster_config::spec::DeploymentSpec;
use dynamo_runtime::bus::REGISTRY_MAX_AGE;
use dynamo_runtime::Bus;
use futures::StreamExt;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::collections::BTreeMap;
use std::time::Duration;

/// Key of the lease in the controller bucket.
pub const LEASE_KEY: &str = "lease";

/// Controller settings.
#[derive(Clone, Debug)]
pub struct ControllerConfig {
    /// This node (the lease holder's name).
    pub node_id: NodeId,
    /// Period of lease renewal and reconciliation.
    pub tick: Duration,
    /// Another controller takes the lease this long after its last renewal.
    pub lease_ttl: Duration,
    /// A node whose heartbeat is older than this is lost.
    pub node_ttl: Duration,
}

impl ControllerConfig {
    pub fn new(node_id: NodeId) -> Self {
        ControllerConfig {
            node_id,
            tick: Duration::from_millis(500),
            lease_ttl: Duration::from_secs(3),
            node_ttl: Duration::from_secs(10),
        }
    }
}

pub struct ControllerArgs {
    pub bus: Bus,
    pub config: ControllerConfig,
}

pub enum ControllerMsg {
    /// Periodic: renew the lease, reconcile.
    Tick,
    /// The desired state changed (apply, scale, delete): reconcile now.
    Changed,
}

pub struct ControllerActor;

pub struct Buckets {
    deployments: kv::Store,
    nodes: kv::Store,
    assignments: kv::Store,
    lease: kv::Store,
    status: kv::Store,
}

pub struct Controller {
    bus: Bus,
    cfg: ControllerConfig,
    buckets: Option<Buckets>,
    state: ControllerState,
    /// Whether this controller holds the lease.
    active: bool,
    /// What this controller has seen of the lease while another held it.
    lease_seen: crate::lease::Observed,
    tasks: dynamo_runtime::Tasks,
    /// A `Changed` is in the mailbox (at most one is: changes coalesce).
    change_queued: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Node → (consecutive presence probes that found no responder, when
    /// the first of them was).
    absent_streak: BTreeMap<String, (u32, std::time::Instant)>,
}

const CALL: Duration = Duration::from_secs(2);
/// How long a presence probe waits (a live node answers in about a millisecond).
const PROBE: Duration = Duration::from_millis(300);

/// A bus call that gives up after [`CALL`] (2 s), its error naming `what`.
pub async fn bounded<T, E: std::fmt::Display>(
    what: &str,
    f: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, String> {
    match tokio::time::timeout(CALL, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(format!("{what}: {e}")),
        Err(_) => Err(format!("{what}: timed out")),
    }
}

/// Every decodable entry of a bucket, by key; undecodable ones are logged,
/// counted and skipped.
pub async fn read_all<T: WireMessage>(store: &kv::Store) -> Result<BTreeMap<String, T>, String> {
    // The keys from the stream's subjects (a KV `keys()` consumer may not
    // end while the bucket is being written). A partial read is an error,
    // never a smaller world.
    let mut subjects = bounded(
        "keys",
        store
            .stream
            .info_with_subjects(format!("{}>", store.prefix)),
    )
    .await?;
    let mut names = Vec::new();
    loop {
        match tokio::time::timeout(CALL, subjects.next()).await {
            Ok(Some(Ok((subject, _)))) => {
                if let Some(k) = subject.strip_prefix(store.prefix.as_str()) {
                    names.push(k.to_string());
                }
            }
            Ok(Some(Err(e))) => return Err(format!("keys: {e}")),
            Ok(None) => break,
            Err(_) => return Err("keys: timed out".into()),
        }
    }
    names.sort();
    let mut out = BTreeMap::new();
    for k in names {
        if let Some(v) = bounded("get", store.get(k.clone())).await? {
            // A bucket may hold other kinds (the nodes bucket holds static
            // nodes' registrations too): only `T`'s entries are read.
            if dynamo_bus_schema::peek_kind(&v).is_ok_and(|(kind, _)| kind != T::KIND) {
                continue;
            }
            match decode::<T>(&v) {
                Ok(t) => {
                    out.insert(k, t);
                }
                Err(e) => dynamo_runtime::counters::reject(T::NAME, &k, &e),
            }
        }
    }
    Ok(out)
}

impl Actor for ControllerActor {
    type Msg = ControllerMsg;
    type State = Controller;
    type Arguments = ControllerArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<ControllerMsg>,
        args: ControllerArgs,
    ) -> Result<Controller, ActorProcessingErr> {
        let _ = myself.cast(ControllerMsg::Tick);
        let me = myself.clone();
        let tasks = dynamo_runtime::Tasks::new(std::sync::Arc::new(move |why| {
            tracing::error!(%why, "controller task ended");
            me.stop(Some(why));
        }));
        let change_queued = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        tasks.spawn(
            "desired-state watch",
            watch_desired(args.bus.clone(), myself.clone(), change_queued.clone()),
        );
        Ok(Controller {
            state: ControllerState::new(args.config.node_id.clone(), args.config.node_ttl),
            bus: args.bus,
            cfg: args.config,
            buckets: None,
            active: false,
            lease_seen: Default::default(),
            tasks,
            change_queued,
            absent_streak: BTreeMap::new(),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<ControllerMsg>,
        msg: ControllerMsg,
        st: &mut Controller,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            ControllerMsg::Tick => {
                if let Err(e) = st.tick().await {
                    tracing::warn!(error = %e, "controller tick failed");
                }
                myself.send_after(st.cfg.tick, || ControllerMsg::Tick);
            }
            ControllerMsg::Changed => {
                st.change_queued
                    .store(false, std::sync::atomic::Ordering::SeqCst);
                // Only the active controller acts, and only with the lease
                // renewed just before (a deposed one writes nothing).
                if st.active {
                    st.active = matches!(st.lease().await, Ok(true));
                    if st.active {
                        if let Err(e) = st.reconcile().await {
                            tracing::warn!(error = %e, "controller reconcile failed");
                        }
                    }
                }
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<ControllerMsg>,
        st: &mut Controller,
    ) -> Result<(), ActorProcessingErr> {
        st.tasks.shutdown();
        Ok(())
    }
}

impl Controller {
    async fn buckets(&mut self) -> Result<&Buckets, String> {
        if self.buckets.is_none() {
            let s = &self.bus.subjects;
            let b = Buckets {
                deployments: bounded(
                    "deployments bucket",
                    self.bus.kv_bucket_durable(&s.deployments_bucket()),
                )
                .await?,
                nodes: bounded(
                    "nodes bucket",
                    self.bus.kv_bucket(&s.nodes_bucket(), REGISTRY_MAX_AGE),
                )
                .await?,
                assignments: bounded(
                    "assignments bucket",
                    self.bus.kv_bucket_durable(&s.assignments_bucket()),
                )
                .await?,
                lease: bounded(
                    "controller bucket",
                    self.bus.kv_bucket_durable(&s.controller_bucket()),
                )
                .await?,
                status: bounded(
                    "status bucket",
                    self.bus.kv_bucket_durable(&s.deploy_status_bucket()),
                )
                .await?,
            };
            self.buckets = Some(b);
        }
        self.buckets.as_ref().ok_or_else(|| "no buckets".into())
    }

    async fn tick(&mut self) -> Result<(), String> {
        let res = self.tick_inner().await;
        crate::metrics::ticked(
            &self.cfg.node_id.0,
            self.active,
            self.state.epoch,
            res.is_ok(),
        );
        if res.is_err() {
            // The bus may have restarted without its JetStream state.
            self.buckets = None;
        }
        res
    }

    async fn tick_inner(&mut self) -> Result<(), String> {
        let was = self.active;
        // Not known to hold the lease: not active (a failed renewal included).
        self.active = false;
        self.active = self.lease().await?;
        if self.active && !was {
            tracing::info!(node = %self.cfg.node_id, epoch = self.state.epoch, "placement controller active");
            let b = self.buckets().await?;
            let statuses: BTreeMap<String, DeploymentStatus> = read_all(&b.status).await?;
            let statuses: Vec<DeploymentStatus> = statuses.into_values().collect();
            self.state.adopt(&statuses);
            let now = unix_ms();
            let (me, epoch) = (self.cfg.node_id.clone(), self.state.epoch);
            for s in &statuses {
                self.state.event(
                    &s.name,
                    now,
                    format!("controller on node {me} active (lease epoch {epoch})"),
                );
            }
        } else if was && !self.active {
            tracing::warn!(node = %self.cfg.node_id, "placement controller lost its lease; standing by");
        }
        if !self.active {
            return Ok(());
        }
        self.reconcile().await
    }

    /// Takes or renews the lease; whether this controller holds it.
    async fn lease(&mut self) -> Result<bool, String> {
        let me = self.cfg.node_id.clone();
        let (ttl, epoch, was) = (self.cfg.lease_ttl, self.state.epoch, self.active);
        let store = self.buckets().await?.lease.clone();
        let seen = &mut self.lease_seen;
        match crate::lease::claim(&store, LEASE_KEY, &me, ttl, epoch, was, seen).await? {
            Some(e) => {
                self.state.epoch = e;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Probes every node with a fresh record: a node whose process is gone
    /// twice in a row is absent; a node that answers gives its current
    /// record (fresher than the bucket's, so readiness shows at once).
    async fn probe(&mut self, nodes: &mut [NodeInventory]) -> std::collections::BTreeSet<String> {
        let now = unix_ms();
        let ttl = self.cfg.node_ttl.as_millis() as u64;
        let bus = &self.bus;
        let probes = nodes.iter().map(|n| {
            let fresh = now.saturating_sub(n.registration.heartbeat_unix_ms) <= ttl;
            let subject = bus.subjects.node_presence(&n.registration.node_id);
            async move {
                if !fresh {
                    return None;
                }
                Some(
                    bus.request::<_, NodeInventory>(
                        subject,
                        &dynamo_bus_schema::PresenceProbe {},
                        PROBE,
                    )
                    .await,
                )
            }
        });
        let answers = futures::future::join_all(probes).await;
        let mut absent = std::collections::BTreeSet::new();
        for (n, a) in nodes.iter_mut().zip(answers) {
            let id = n.registration.node_id.0.clone();
            match a {
                Some(Ok(rec)) if rec.registration.node_id == n.registration.node_id => {
                    self.absent_streak.remove(&id);
                    *n = rec;
                }
                Some(Err(dynamo_runtime::BusError::NoResponders { .. })) => {
                    // Gone twice, a second apart: not a reconnect or an
                    // agent restarting.
                    let s = self
                        .absent_streak
                        .entry(id.clone())
                        .or_insert((0, std::time::Instant::now()));
                    s.0 += 1;
                    if s.0 >= 2 && s.1.elapsed() >= Duration::from_secs(1) {
                        absent.insert(id);
                    }
                }
                // Slow, or an old node without presence: its heartbeat decides.
                _ => {}
            }
        }
        let known: std::collections::BTreeSet<String> = nodes
            .iter()
            .map(|n| n.registration.node_id.0.clone())
            .collect();
        self.absent_streak.retain(|k, _| known.contains(k));
        absent
    }

    async fn reconcile(&mut self) -> Result<(), String> {
        let b = self.buckets().await?;
        let records: BTreeMap<String, DeploymentRecord> = read_all(&b.deployments).await?;
        let nodes: BTreeMap<String, NodeInventory> = read_all(&b.nodes).await?;
        let assignments: BTreeMap<String, NodeAssignment> = read_all(&b.assignments).await?;
        let old_status: BTreeMap<String, DeploymentStatus> = read_all(&b.status).await?;
        let mut deployments = Vec::new();
        for (name, r) in records {
            match DeploymentSpec::parse(&r.spec_yaml) {
                Ok(spec) => deployments.push(Deployment {
                    spec,
                    generation: r.generation,
                }),
                // Never a smaller world: placing without it would tear it down.
                Err(e) => {
                    dynamo_runtime::counters::reject("DeploymentRecord", &name, &e);
                    return Err(format!(
                        "stored spec of deployment {name} does not parse ({e}); nothing changed"
                    ));
                }
            }
        }
        // Records past the bounds of one message are refused, not trusted.
        let nodes: BTreeMap<String, NodeInventory> = nodes
            .into_iter()
            .filter(|(k, n)| {
                let ok = n.replicas.len() <= dynamo_bus_schema::MAX_CLUSTER_ITEMS
                    && n.labels.len() <= dynamo_bus_schema::MAX_CLUSTER_ITEMS
                    && &n.registration.node_id.0 == k;
                if !ok {
                    dynamo_runtime::counters::reject(
                        "NodeInventory",
                        k,
                        &"too many replicas or labels, or a key that is not its node id",
                    );
                }
                ok
            })
            .collect();
        let mut nodes: Vec<NodeInventory> = nodes.into_values().collect();
        let absent = self.probe(&mut nodes).await;
        let world = World {
            deployments,
            nodes,
            assignments,
            absent,
            now_ms: unix_ms(),
        };
        let decision = self.state.reconcile(&world);
        let b = self.buckets().await?;
        for (node, a) in &decision.changed {
            let bytes = encode(a).map_err(|e| e.to_string())?;
            bounded("assignment", b.assignments.put(node.clone(), bytes.into())).await?;
        }
        for s in &decision.statuses {
            let same = old_status.get(&s.name).is_some_and(|o| {
                o.generation == s.generation
                    && o.services == s.services
                    && o.events == s.events
                    && o.controller == s.controller
            });
            // Refreshed now and then even when unchanged, so readers can tell
            // the controller is alive.
            let fresh = old_status
                .get(&s.name)
                .is_some_and(|o| s.updated_unix_ms.saturating_sub(o.updated_unix_ms) < 5_000);
            if same && fresh {
                continue;
            }
            let bytes = encode(s).map_err(|e| e.to_string())?;
            bounded("status", b.status.put(s.name.clone(), bytes.into())).await?;
        }
        for name in old_status.keys() {
            if !decision.statuses.iter().any(|s| &s.name == name) {
                bounded("status", b.status.delete(name)).await?;
            }
        }
        Ok(())
    }
}

/// Watches the deployments bucket and wakes the controller on every
/// change, so `apply`, `scale` and `delete` act without waiting for a tick.
/// A watch that breaks is opened again (ticks reconcile meanwhile).
async fn watch_desired(
    bus: Bus,
    controller: ActorRef<ControllerMsg>,
    queued: std::sync::Arc<std::sync::atomic::AtomicBool>,
) {
    loop {
        let watched = async {
            let kv = bus
                .kv_bucket_durable(&bus.subjects.deployments_bucket())
                .await
                .map_err(|e| e.to_string())?;
            let mut w = kv.watch_all().await.map_err(|e| e.to_string())?;
            while let Some(e) = w.next().await {
                e.map_err(|e| e.to_string())?;
                // One wake-up covers every change before it is handled.
                if !queued.swap(true, std::sync::atomic::Ordering::SeqCst)
                    && controller.cast(ControllerMsg::Changed).is_err()
                {
                    return Ok(());
                }
            }
            Err::<(), String>("the watch ended".into())
        };
        match watched.await {
            Ok(()) => return,
            Err(e) => tracing::debug!(error = %e, "deployments watch interrupted; watching again"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
