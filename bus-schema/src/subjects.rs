//! Subject and bucket names, all scoped by a namespace: `dynamo.<ns>.…`.
//!
//! Invariant: a [`Namespace`] contains only `[A-Za-z0-9_-]`, so it can never
//! inject a `.`, `*` or `>` into a subject.

use crate::ids::{GatewayId, NodeId, WorkerId};
use thiserror::Error;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Namespace(String);

#[derive(Debug, Error, PartialEq, Eq)]
#[error("namespace {value:?} is invalid: use 1-64 characters from [A-Za-z0-9_-]")]
pub struct NamespaceError {
    pub value: String,
}

impl Namespace {
    pub fn new(value: &str) -> Result<Self, NamespaceError> {
        let ok = !value.is_empty()
            && value.len() <= 64
            && value
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if ok {
            Ok(Namespace(value.to_string()))
        } else {
            Err(NamespaceError {
                value: value.to_string(),
            })
        }
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Builds every subject and bucket name for one namespace.
#[derive(Clone, Debug)]
pub struct Subjects {
    ns: Namespace,
}

impl Subjects {
    pub fn new(ns: Namespace) -> Self {
        Subjects { ns }
    }
    pub fn namespace(&self) -> &Namespace {
        &self.ns
    }
    fn base(&self) -> String {
        format!("dynamo.{}", self.ns.0)
    }
    /// Worker takes [`crate::GenerateRequest`]s here (request/reply).
    pub fn worker_generate(&self, w: WorkerId) -> String {
        format!("{}.worker.{w}.generate", self.base())
    }
    /// Worker takes [`crate::CancelRequest`]s here.
    pub fn worker_cancel(&self, w: WorkerId) -> String {
        format!("{}.worker.{w}.cancel", self.base())
    }
    /// Prefill worker takes [`crate::PrefillRequest`]s here (request/reply).
    pub fn worker_prefill(&self, w: WorkerId) -> String {
        format!("{}.worker.{w}.prefill", self.base())
    }
    /// Decode worker hears [`crate::TransferStarting`] here.
    pub fn worker_transfer(&self, w: WorkerId) -> String {
        format!("{}.worker.{w}.transfer", self.base())
    }
    /// Worker serves [`crate::ArtifactRequest`]s here.
    pub fn worker_artifact(&self, w: WorkerId) -> String {
        format!("{}.worker.{w}.artifact", self.base())
    }
    /// Gateway receives response frames for all its requests here.
    pub fn gateway_frames(&self, g: GatewayId) -> String {
        format!("{}.gateway.{g}.frames", self.base())
    }
    /// A worker's [`crate::LoadReport`]s.
    pub fn load(&self, w: WorkerId) -> String {
        format!("{}.load.{w}", self.base())
    }
    /// Every worker's load reports.
    pub fn load_all(&self) -> String {
        format!("{}.load.*", self.base())
    }
    /// A worker's KV events ([`crate::KvEventBatch`]).
    pub fn kv_events(&self, w: WorkerId) -> String {
        format!("{}.kv.{w}", self.base())
    }
    /// Every worker's KV events (the subjects of the KV events stream).
    pub fn kv_events_all(&self) -> String {
        format!("{}.kv.*", self.base())
    }
    /// JetStream stream holding every worker's KV events.
    pub fn kv_events_stream(&self) -> String {
        format!("dynamo_{}_kv_events", self.ns.0)
    }
    /// Worker answers [`crate::DrainRequest`]s here.
    pub fn worker_drain(&self, w: WorkerId) -> String {
        format!("{}.worker.{w}.drain", self.base())
    }
    /// Worker answers [`crate::KvDumpRequest`]s here.
    pub fn worker_kv_dump(&self, w: WorkerId) -> String {
        format!("{}.worker.{w}.kv_dump", self.base())
    }
    /// Routers share per-request load here ([`crate::ActiveLoadEvent`], [`crate::RouterHeartbeat`]).
    pub fn router_load(&self) -> String {
        format!("{}.router.load", self.base())
    }
    /// Routers answer [`crate::RouterInfoRequest`]s here (queue group: any one answers).
    pub fn router_info(&self) -> String {
        format!("{}.router.info", self.base())
    }
    /// Routers answer [`crate::ActiveLoadSnapshotRequest`]s here.
    pub fn router_snapshot(&self) -> String {
        format!("{}.router.snapshot", self.base())
    }
    /// A node's fault-injection endpoint.
    pub fn node_fault(&self, n: &NodeId) -> String {
        format!("{}.node.{}.fault", self.base(), subject_safe(n))
    }
    /// A joined node answers [`crate::PresenceProbe`]s here.
    pub fn node_presence(&self, n: &NodeId) -> String {
        format!("{}.node.{}.presence", self.base(), subject_safe(n))
    }
    /// JetStream KV bucket holding [`crate::WorkerRegistration`]s keyed by worker id.
    pub fn workers_bucket(&self) -> String {
        format!("dynamo_{}_workers", self.ns.0)
    }
    /// JetStream KV bucket holding [`crate::NodeRegistration`]s keyed by node id.
    pub fn nodes_bucket(&self) -> String {
        format!("dynamo_{}_nodes", self.ns.0)
    }
    /// JetStream KV bucket holding [`crate::DeploymentRecord`]s (desired state) keyed by name.
    pub fn deployments_bucket(&self) -> String {
        format!("dynamo_{}_deployments", self.ns.0)
    }
    /// JetStream KV bucket holding [`crate::NodeAssignment`]s keyed by node id.
    pub fn assignments_bucket(&self) -> String {
        format!("dynamo_{}_assignments", self.ns.0)
    }
    /// JetStream KV bucket holding the [`crate::ControllerLease`] (key `lease`).
    pub fn controller_bucket(&self) -> String {
        format!("dynamo_{}_controller", self.ns.0)
    }
    /// Gateways publish [`crate::FrontendMetrics`] here, once per interval.
    pub fn frontend_metrics(&self) -> String {
        format!("{}.metrics.frontend", self.base())
    }
    /// Workers publish [`crate::WorkerMetrics`] here, once per interval.
    pub fn worker_metrics(&self) -> String {
        format!("{}.metrics.worker", self.base())
    }
    /// JetStream KV bucket of the planners: `lease.<deployment>`
    /// ([`crate::ControllerLease`]) and `status.<deployment>`
    /// ([`crate::PlannerStatus`]).
    pub fn planner_bucket(&self) -> String {
        format!("dynamo_{}_planner", self.ns.0)
    }
    /// JetStream KV bucket of [`crate::PlannerPin`]s keyed `<deployment>.<target>`.
    pub fn pins_bucket(&self) -> String {
        format!("dynamo_{}_pins", self.ns.0)
    }
    /// JetStream KV bucket of weights: `manifest.<sha256>`
    /// ([`crate::weights::WeightManifest`], kept) and
    /// `source.<sha256>.<node>` ([`crate::weights::WeightSource`]s, reaped
    /// by age unless rewritten).
    pub fn weights_bucket(&self) -> String {
        format!("dynamo_{}_weights", self.ns.0)
    }
    /// JetStream object store of the in-cluster weight cache: objects
    /// `<sha256>.<chunk>`, one per manifest chunk.
    pub fn weights_objects(&self) -> String {
        format!("dynamo_{}_weight_cache", self.ns.0)
    }
    /// JetStream object store of the routers' KV index snapshots
    /// ([`crate::KvIndexSnapshot`] under [`crate::KV_SNAPSHOT_OBJECT`]).
    pub fn router_state_objects(&self) -> String {
        format!("dynamo_{}_router_state", self.ns.0)
    }
    /// JetStream KV bucket holding [`crate::DeploymentStatus`]es keyed by deployment.
    pub fn deploy_status_bucket(&self) -> String {
        format!("dynamo_{}_deploy_status", self.ns.0)
    }
    /// The names of every JetStream stream of this namespace (a KV bucket's
    /// is `KV_<bucket>`, an object store's `OBJ_<store>`), sorted. Exact
    /// names, not a prefix: namespace `a` must not claim `a_b`'s streams.
    pub fn stream_names(&self) -> Vec<String> {
        let buckets = [
            self.workers_bucket(),
            self.nodes_bucket(),
            self.deployments_bucket(),
            self.assignments_bucket(),
            self.controller_bucket(),
            self.planner_bucket(),
            self.pins_bucket(),
            self.weights_bucket(),
            self.deploy_status_bucket(),
        ];
        let objects = [self.weights_objects(), self.router_state_objects()];
        let mut names: Vec<String> = buckets
            .iter()
            .map(|b| format!("KV_{b}"))
            .chain(objects.iter().map(|o| format!("OBJ_{o}")))
            .chain([self.kv_events_stream()])
            .collect();
        names.sort();
        names
    }
}

/// Node ids come from configs and flags; keep only subject-safe characters.
fn subject_safe(n: &NodeId) -> String {
    subject_token(&n.0)
}

/// `s` with every character but ASCII letters, digits, `-` and `_` made `_`
/// (one subject or key token).
pub fn subject_token(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_rejects_subject_metacharacters() {
        for bad in ["", "a.b", "a*", "a>", "a b", &"x".repeat(65)] {
            assert!(Namespace::new(bad).is_err(), "{bad:?} accepted");
        }
        assert!(Namespace::new("prod-1_a").is_ok());
    }

    #[test]
    fn subjects_are_namespaced() {
        let s = Subjects::new(Namespace::new("t1").unwrap());
        assert_eq!(
            s.worker_generate(WorkerId(1)),
            "dynamo.t1.worker.0000000000000001.generate"
        );
        assert_eq!(s.load_all(), "dynamo.t1.load.*");
        assert_eq!(s.workers_bucket(), "dynamo_t1_workers");
        assert_eq!(
            s.node_fault(&NodeId("a.b".into())),
            "dynamo.t1.node.a_b.fault"
        );
    }
}
