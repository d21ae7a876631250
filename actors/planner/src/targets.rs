//! What the planner scales, read off the desired state: each target of the
//! spec's `planner:` section with its replicas, readiness, slots, pin and
//! capacity seed; and which worker (by id) belongs to which target.
//!
//! Invariants: a target is a worker service outside any group, or a group
//! (the spec checks that); a group's ready replicas are the complete group
//! replicas (each member at its count); only this deployment's replicas
//! map to a target.

use dynamo_bus_schema::{
    replica_worker_id, DeploymentStatus, NodeAssignment, WorkerId, WorkerRegistration,
};
use dynamo_cluster_config::render::connector::ObservedScale;
use dynamo_cluster_config::render::names;
use dynamo_cluster_config::spec::{DeploymentSpec, Role};
use dynamo_planner::{EngineTiming, Phase, Target, TargetKind};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

/// An engine's step timing from a worker service's settings (the node
/// knows the engines; see `dynamo-node`'s seed).
pub type Seed = Arc<dyn Fn(&serde_json::Value) -> EngineTiming + Send + Sync>;

fn phase(role: Role) -> Option<Phase> {
    match role {
        Role::Prefill => Some(Phase::Prefill),
        Role::Decode => Some(Phase::Decode),
        Role::Aggregated => Some(Phase::Aggregated),
        Role::Frontend => None,
    }
}

/// The planner's targets, in the section's (sorted) order.
pub fn targets(
    spec: &DeploymentSpec,
    status: Option<&DeploymentStatus>,
    pinned: &BTreeSet<String>,
    seed: &Seed,
) -> Vec<Target> {
    let Some(p) = &spec.planner else {
        return Vec::new();
    };
    let ready_of = |svc: &str| -> u32 {
        status
            .filter(|s| s.name == spec.name)
            .and_then(|s| s.services.iter().find(|x| x.name == svc))
            .map(|x| x.ready)
            .unwrap_or(0)
    };
    let mut out = Vec::new();
    for (name, limits) in &p.targets {
        let (kind, desired, ready, settings) = if let Some(g) = spec.group(name) {
            let (mut pf, mut dc, mut ag) = (0, 0, 0);
            let mut ready = u32::MAX;
            let mut settings = None;
            for m in g.services.iter().filter_map(|m| spec.service(m)) {
                match m.role {
                    Role::Prefill => pf += m.replicas,
                    Role::Decode => dc += m.replicas,
                    Role::Aggregated => ag += m.replicas,
                    Role::Frontend => {}
                }
                if let Some(whole) = ready_of(&m.name).checked_div(m.replicas) {
                    ready = ready.min(whole);
                }
                settings = settings.or(m.worker.clone());
            }
            (
                TargetKind::Group {
                    prefill: pf,
                    decode: dc,
                    aggregated: ag,
                },
                g.replicas,
                if ready == u32::MAX { 0 } else { ready },
                settings,
            )
        } else if let Some(s) = spec.service(name) {
            let kind = match s.role {
                Role::Prefill => TargetKind::Prefill,
                Role::Decode => TargetKind::Decode,
                _ => TargetKind::Aggregated,
            };
            (kind, s.replicas, ready_of(&s.name), s.worker.clone())
        } else {
            continue;
        };
        out.push(Target {
            name: name.clone(),
            kind,
            desired,
            ready: ready.min(desired),
            slots: spec.target_slots(name).unwrap_or(0),
            limits: *limits,
            pinned: pinned.contains(name),
            timing: seed(&settings.unwrap_or(serde_json::Value::Null)),
        });
    }
    out
}

/// Where the deployment runs on Kubernetes: each target's replicas as its
/// Grove object says (the desired state is not where it is scaled there).
/// A target without a reading is left as it is.
pub fn with_observed(ts: &mut [Target], observed: &BTreeMap<String, ObservedScale>) {
    for t in ts.iter_mut() {
        if let Some(o) = observed.get(&t.name) {
            t.desired = o.desired;
            t.ready = o.ready.min(o.desired);
        }
    }
}

/// Which target (and phase) each of this deployment's workers serves.
pub fn placements(
    namespace: &str,
    spec: &DeploymentSpec,
    assignments: &[NodeAssignment],
) -> HashMap<WorkerId, (String, Phase)> {
    let mut out = HashMap::new();
    for a in assignments {
        for r in a.replicas.iter().filter(|r| r.deployment == spec.name) {
            let Some(s) = spec.service(&r.service) else {
                continue;
            };
            let Some(ph) = phase(s.role) else {
                continue;
            };
            let target = s.group.clone().unwrap_or_else(|| s.name.clone());
            out.insert(
                replica_worker_id(namespace, &r.key, &a.node_id),
                (target, ph),
            );
        }
    }
    out
}

/// On Kubernetes, where nothing is placed through node assignments: which
/// target (and phase) each registered worker serves, from its node id,
/// the name of the pod it runs in (`--node-id $(POD_NAME)`, see the
/// renderer). Workers of other deployments' pods, or of no pod, map to
/// none.
pub fn pod_placements(
    spec: &DeploymentSpec,
    workers: &[WorkerRegistration],
) -> HashMap<WorkerId, (String, Phase)> {
    workers
        .iter()
        .filter_map(|w| {
            let s = names::service_of_pod(spec, &w.node_id.0)?;
            let ph = phase(s.role)?;
            let target = s.group.clone().unwrap_or_else(|| s.name.clone());
            Some((w.worker_id, (target, ph)))
        })
        .collect()
}

/// The models the deployment's workers serve (its traffic at the gateways).
pub fn models(spec: &DeploymentSpec) -> BTreeSet<String> {
    spec.services
        .iter()
        .filter_map(|s| s.worker.as_ref())
        .filter_map(|w| w.get("model").and_then(|m| m.as_str()).map(String::from))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use dynamo_bus_schema::{AssignedReplica, NodeId, ServiceStatus};

    const SPEC: &str = r#"
version: 1
name: d
services:
  frontend: {role: frontend}
  prefill: {role: prefill, replicas: 2, worker: {engine: mocker, model: m}}
  decode: {role: decode, replicas: 2, resources: {slots: 2}, worker: {engine: mocker, model: m}}
  pd-p: {role: prefill, replicas: 1, worker: {engine: mocker, model: m}}
  pd-d: {role: decode, replicas: 2, worker: {engine: mocker, model: m}}
groups:
  pd: {services: [pd-p, pd-d], replicas: 2}
planner:
  services: {prefill: {min: 1, max: 4}, decode: {min: 0, max: 4}, pd: {min: 1, max: 3}}
"#;

    fn seed() -> Seed {
        Arc::new(|_| EngineTiming::mocker_default())
    }

    #[test]
    fn targets_carry_replicas_readiness_slots_and_pins() {
        let spec = DeploymentSpec::parse(SPEC).unwrap();
        let svc = |name: &str, ready| ServiceStatus {
            name: name.into(),
            role: String::new(),
            desired: 0,
            placed: 0,
            ready,
            pending: vec![],
            placements: vec![],
        };
        let status = DeploymentStatus {
            name: "d".into(),
            generation: 1,
            services: vec![
                svc("prefill", 1),
                svc("decode", 2),
                svc("pd-p", 2),
                svc("pd-d", 3),
            ],
            events: vec![],
            controller: NodeId("n1".into()),
            updated_unix_ms: 0,
        };
        let pins: BTreeSet<String> = ["decode".to_string()].into();
        let ts = targets(&spec, Some(&status), &pins, &seed());
        let by = |n: &str| ts.iter().find(|t| t.name == n).unwrap();
        assert_eq!((by("prefill").desired, by("prefill").ready), (2, 1));
        assert_eq!(by("decode").slots, 2);
        assert!(by("decode").pinned && !by("prefill").pinned);
        let pd = by("pd");
        // Two group replicas; pd-d has 3 of 4 ready: one whole replica.
        assert_eq!((pd.desired, pd.ready, pd.slots), (2, 1, 3));
        assert_eq!(
            pd.kind,
            TargetKind::Group {
                prefill: 1,
                decode: 2,
                aggregated: 0
            }
        );
        assert_eq!(models(&spec), ["m".to_string()].into());
    }

    #[test]
    fn on_kubernetes_replicas_are_the_api_servers() {
        let spec = DeploymentSpec::parse(SPEC).unwrap();
        // The desired state still says 2 prefill and 2 pd, none ready.
        let mut ts = targets(&spec, None, &BTreeSet::new(), &seed());
        let observed = BTreeMap::from([
            (
                "prefill".to_string(),
                ObservedScale {
                    desired: 3,
                    ready: 1,
                },
            ),
            (
                "pd".to_string(),
                ObservedScale {
                    desired: 1,
                    ready: 1,
                },
            ),
        ]);
        with_observed(&mut ts, &observed);
        let by = |n: &str| ts.iter().find(|t| t.name == n).unwrap();
        assert_eq!((by("prefill").desired, by("prefill").ready), (3, 1));
        assert_eq!((by("pd").desired, by("pd").ready), (1, 1));
        // Unread targets keep what the spec says.
        assert_eq!((by("decode").desired, by("decode").ready), (2, 0));
    }

    #[test]
    fn on_kubernetes_workers_map_to_their_target_by_pod_name() {
        use dynamo_bus_schema::{
            ArtifactRef, LoadMetrics, ModelCard, ModelName, WorkerRole, WorkerState,
        };
        let spec = DeploymentSpec::parse(SPEC).unwrap();
        let reg = |id: u64, pod: &str| WorkerRegistration {
            worker_id: WorkerId(id),
            generation: 1,
            node_id: NodeId(pod.into()),
            pid: 1,
            role: WorkerRole::Aggregated,
            state: WorkerState::Serving,
            engine: "mocker".into(),
            model: ModelCard {
                name: ModelName("m".into()),
                context_length: 100,
                block_size: 16,
                chat_template: String::new(),
                bos_token: None,
                eos_token: None,
                eos_token_ids: vec![],
                vocab_size: 10,
                tokenizer: ArtifactRef {
                    name: "t".into(),
                    len: 0,
                    sha256: String::new(),
                },
                source: String::new(),
                hash_salt: 0,
            },
            started_unix_ms: 0,
            heartbeat_unix_ms: 0,
            load: LoadMetrics::default(),
            kv_events: true,
        };
        let m = pod_placements(
            &spec,
            &[
                reg(1, "d-0-prefill-0-ab1cd"),
                reg(2, "d-0-pd-1-pd-d-1-zzzzz"),
                reg(3, "d-0-frontend-0-abcde"),
                reg(4, "e-0-prefill-0-abcde"),
                reg(5, "laptop"),
            ],
        );
        assert_eq!(m.len(), 2, "{m:?}");
        assert_eq!(m[&WorkerId(1)], ("prefill".to_string(), Phase::Prefill));
        // A group member's phase is its service's role, its target the group.
        assert_eq!(m[&WorkerId(2)], ("pd".to_string(), Phase::Decode));
    }

    #[test]
    fn workers_map_to_their_target_by_replica_key_and_node() {
        let spec = DeploymentSpec::parse(SPEC).unwrap();
        let rep = |key: &str, dep: &str, svc: &str| AssignedReplica {
            key: key.into(),
            deployment: dep.into(),
            service: svc.into(),
            role: String::new(),
            settings: String::new(),
            slots: 1,
            memory_mib: 0,
        };
        let a = NodeAssignment {
            node_id: NodeId("n1".into()),
            epoch: 1,
            replicas: vec![
                rep("d/prefill-0", "d", "prefill"),
                rep("d/pd-1.pd-d-0", "d", "pd-d"),
                rep("d/frontend-0", "d", "frontend"),
                rep("e/prefill-0", "e", "prefill"),
            ],
        };
        let m = placements("ns", &spec, &[a]);
        assert_eq!(m.len(), 2);
        let n1 = NodeId("n1".into());
        assert_eq!(
            m[&replica_worker_id("ns", "d/prefill-0", &n1)],
            ("prefill".to_string(), Phase::Prefill)
        );
        assert_eq!(
            m[&replica_worker_id("ns", "d/pd-1.pd-d-0", &n1)],
            ("pd".to_string(), Phase::Decode)
        );
    }
}
