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
    decode, encode, unix_ms, ControllerLease, DeploymentRecord, DeploymentStatus, NodeAssignment,
    NodeId, NodeInventory, WireMessage,
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
    Tick,
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
}

const CALL: Duration = Duration::from_secs(2);

async fn bounded<T, E: std::fmt::Display>(
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
    let mut keys = bounded("keys", store.keys()).await?;
    let mut names = Vec::new();
    while let Ok(Some(k)) = tokio::time::timeout(CALL, keys.next()).await {
        match k {
            Ok(k) => names.push(k),
            Err(e) => return Err(format!("keys: {e}")),
        }
    }
    let mut out = BTreeMap::new();
    for k in names {
        if let Some(v) = bounded("get", store.get(k.clone())).await? {
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
        Ok(Controller {
            state: ControllerState::new(args.config.node_id.clone(), args.config.node_ttl),
            bus: args.bus,
            cfg: args.config,
            buckets: None,
            active: false,
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
        }
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
                    self.bus.kv_bucket(&s.controller_bucket(), Duration::ZERO),
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
        if res.is_err() {
            // The bus may have restarted without its JetStream state.
            self.buckets = None;
        }
        res
    }

    async fn tick_inner(&mut self) -> Result<(), String> {
        let was = self.active;
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
        let ttl_ms = self.cfg.lease_ttl.as_millis() as u64;
        let my_epoch = self.state.epoch;
        let was_active = self.active;
        let b = self.buckets().await?;
        let now = unix_ms();
        let entry = bounded("lease", b.lease.entry(LEASE_KEY)).await?;
        let current = entry.as_ref().and_then(|e| {
            (e.operation == kv::Operation::Put)
                .then(|| decode::<ControllerLease>(&e.value).ok())
                .flatten()
        });
        let put = |epoch: u64| -> Result<bytes::Bytes, String> {
            encode(&ControllerLease {
                holder: me.clone(),
                epoch,
                renewed_unix_ms: now,
                ttl_ms,
            })
            .map(Into::into)
            .map_err(|e| e.to_string())
        };
        let (epoch, ok) = match (&entry, &current) {
            (None, _) => {
                let epoch = 1;
                (epoch, b.lease.create(LEASE_KEY, put(epoch)?).await.is_ok())
            }
            (Some(e), Some(l)) if l.holder == me && (l.epoch == my_epoch || !was_active) => {
                // Ours: renew (a restarted controller of the same node takes
                // it back under the next epoch).
                let epoch = if l.epoch == my_epoch {
                    l.epoch
                } else {
                    l.epoch + 1
                };
                (
                    epoch,
                    b.lease
                        .update(LEASE_KEY, put(epoch)?, e.revision)
                        .await
                        .is_ok(),
                )
            }
            (Some(e), Some(l)) => {
                if now.saturating_sub(l.renewed_unix_ms) <= l.ttl_ms.max(ttl_ms) {
                    return Ok(false);
                }
                tracing::warn!(holder = %l.holder, "controller lease expired; taking it over");
                let epoch = l.epoch + 1;
                (
                    epoch,
                    b.lease
                        .update(LEASE_KEY, put(epoch)?, e.revision)
                        .await
                        .is_ok(),
                )
            }
            (Some(e), None) => {
                // A deleted or unreadable lease: replace it.
                let epoch = my_epoch + 1;
                (
                    epoch,
                    b.lease
                        .update(LEASE_KEY, put(epoch)?, e.revision)
                        .await
                        .is_ok(),
                )
            }
        };
        if ok {
            self.state.epoch = epoch;
        }
        Ok(ok)
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
                Err(e) => {
                    tracing::error!(deployment = name, error = %e, "stored spec does not parse; skipped")
                }
            }
        }
        let world = World {
            deployments,
            nodes: nodes.into_values().collect(),
            assignments,
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
