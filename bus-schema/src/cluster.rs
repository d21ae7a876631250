//! Wire types of the cluster layer: desired state, inventory, assignments,
//! the controller's lease and what it reports. All of them live in
//! JetStream KV buckets (names in [`crate::Subjects`]).
//!
//! Invariants: every list is bounded by [`MAX_CLUSTER_ITEMS`] when it is
//! written (the controller keeps the last [`MAX_EVENTS`] events); replica
//! keys are `<deployment>/<replica>` and unique in a namespace; settings
//! travel as JSON text validated by the node before they are stored.

use crate::codec::{MessageKind, WireMessage};
use crate::ids::NodeId;
use crate::messages::NodeRegistration;
use serde::{Deserialize, Serialize};

/// Most replicas, labels or services in one cluster record.
pub const MAX_CLUSTER_ITEMS: usize = 4096;
/// Events a deployment's status keeps (the newest).
pub const MAX_EVENTS: usize = 32;

macro_rules! wire {
    ($ty:ident = $kind:literal) => {
        impl WireMessage for $ty {
            const KIND: MessageKind = MessageKind($kind);
            const NAME: &'static str = stringify!($ty);
        }
    };
}

/// The worker id of a replica (`<deployment>/<replica>` key) on a node:
/// stable, so the same replica on the same node is the same worker, and
/// anyone reading the assignments can tell which worker runs what.
pub fn replica_worker_id(namespace: &str, key: &str, node: &NodeId) -> crate::ids::WorkerId {
    crate::ids::WorkerId(crate::blocks::hash_salt(
        &format!("{namespace}/{key}/{node}"),
        None,
    ))
}

/// Desired state of one deployment (deployments bucket, key = its name):
/// the checked spec as YAML, scale changes included.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeploymentRecord {
    pub name: String,
    /// The spec (YAML), as `dynamoctl apply` checked it, with `scale` applied.
    pub spec_yaml: String,
    /// Grows by one with every change (apply or scale).
    pub generation: u64,
    pub updated_unix_ms: u64,
}
wire!(DeploymentRecord = 100);

/// A replica a node runs, as it reports it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunningReplica {
    /// `<deployment>/<replica>`.
    pub key: String,
    /// Its actors started and serving.
    pub ready: bool,
    /// Being drained before it stops.
    pub stopping: bool,
    /// The worker generation (0 for a frontend).
    pub generation: u64,
    /// Why its last start failed ("" when it did not).
    pub error: String,
    /// Slots and memory it holds on the node (a draining one still does).
    pub slots: u32,
    pub memory_mib: u64,
}

/// A node of the cluster (nodes bucket, key = node id): what
/// [`NodeRegistration`] says, plus labels, capacity and health.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeInventory {
    pub registration: NodeRegistration,
    /// `zone`, `rack`, `host` and any other labels, sorted by key.
    pub labels: Vec<(String, String)>,
    pub slots: u32,
    pub free_slots: u32,
    pub memory_mib: u64,
    pub free_memory_mib: u64,
    /// Runs a placement controller (active or standby).
    pub controller: bool,
    /// `healthy`, or why not (`draining`: shutting down; nothing new goes there).
    pub health: String,
    pub replicas: Vec<RunningReplica>,
}
wire!(NodeInventory = 101);

/// One replica assigned to a node.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AssignedReplica {
    /// `<deployment>/<replica>`.
    pub key: String,
    pub deployment: String,
    pub service: String,
    /// `frontend`, `aggregated`, `prefill` or `decode`.
    pub role: String,
    /// JSON: the worker section (workers) or `{gateway, router}` (frontend).
    pub settings: String,
    pub slots: u32,
    pub memory_mib: u64,
}

/// What a node must run (assignments bucket, key = node id), written by
/// the active controller.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeAssignment {
    pub node_id: NodeId,
    /// The controller lease epoch that wrote it.
    pub epoch: u64,
    pub replicas: Vec<AssignedReplica>,
}
wire!(NodeAssignment = 102);

/// The placement controller's lease (controller bucket, key `lease`):
/// taken and renewed by compare-and-set on the entry's revision.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ControllerLease {
    pub holder: NodeId,
    /// Grows by one with every change of holder.
    pub epoch: u64,
    pub renewed_unix_ms: u64,
    /// Another controller may take the lease this long after the last renewal.
    pub ttl_ms: u64,
}
wire!(ControllerLease = 103);

/// Desired, placed and ready replicas of one service.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ServiceStatus {
    pub name: String,
    pub role: String,
    pub desired: u32,
    pub placed: u32,
    pub ready: u32,
    /// Why replicas are not placed or not ready.
    pub pending: Vec<String>,
    /// `replica key = node id` of each placed replica.
    pub placements: Vec<(String, String)>,
}

/// Something the controller did or saw.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterEvent {
    pub unix_ms: u64,
    pub message: String,
}

/// What the controller reports about one deployment (status bucket, key =
/// the deployment's name).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeploymentStatus {
    pub name: String,
    /// The desired state's generation this status is for.
    pub generation: u64,
    pub services: Vec<ServiceStatus>,
    pub events: Vec<ClusterEvent>,
    pub controller: NodeId,
    pub updated_unix_ms: u64,
}
wire!(DeploymentStatus = 104);

/// Controller → node (`Subjects::node_presence`): is the node's process
/// there? Answered with the node's [`NodeInventory`]. A dead process has
/// no subscription, so the server answers "no responders" at once, long
/// before the node's heartbeat goes stale.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PresenceProbe {}
wire!(PresenceProbe = 105);
