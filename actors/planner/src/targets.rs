//! What the planner scales: each target of the spec's `planner:` section
//! with its replicas, readiness, slots, pin and capacity seed; and which
//! worker (by id) belongs to which target. Read off the desired state, or
//! on Kubernetes off the Grove objects and the worker registry
//! ([`with_observed`], [`pod_placements`], [`pod_serving`]).
//!
//! Invariants: a target is a worker service outside any group, or a group
//! (the spec checks that); a group's ready replicas are the complete group
//! replicas (each member at its count, serving); only this deployment's
//! replicas map to a target; on Kubernetes a worker maps to a target only
//! if its pod's name names exactly one service and its role is that
//! service's, and a target's ready replicas are at most those whose
//! workers have registered as serving.

use dynamo_bus_schema::{
    replica_worker_id, DeploymentStatus, NodeAssignment, WorkerId, WorkerRegistration, WorkerRole,
    WorkerState,
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
/// Grove object says (the desired state is not where it is scaled there),
/// ready only as far as its workers have registered as serving (`serving`,
/// from [`pod_serving`]: Grove counts a pod ready once its container runs,
/// before the engine has loaded). Grove keeps at least one replica of a
/// PodClique, so the floor is 1: no scale to zero there. A target without
/// a reading is left as it is.
pub fn with_observed(
    ts: &mut [Target],
    observed: &BTreeMap<String, ObservedScale>,
    serving: &BTreeMap<String, u32>,
) {
    for t in ts.iter_mut() {
        if let Some(o) = observed.get(&t.name) {
            t.desired = o.desired;
            t.ready = o
                .ready
                .min(serving.get(&t.name).copied().unwrap_or(0))
                .min(o.desired);
            // Grove keeps one replica even of a target whose `max` is 0.
            t.limits.max = t.limits.max.max(1);
            t.limits.min = t.limits.min.max(1);
        }
    }
}

/// Whether a worker registered as `reg` may run a service of role `role`.
fn role_matches(reg: WorkerRole, role: Role) -> bool {
    matches!(
        (reg, role),
        (WorkerRole::Aggregated, Role::Aggregated)
            | (WorkerRole::Prefill, Role::Prefill)
            | (WorkerRole::Decode, Role::Decode)
    )
}

/// The pod a registered worker runs in, if it is one of this
/// deployment's, of a matching role.
fn pod<'a>(spec: &'a DeploymentSpec, w: &WorkerRegistration) -> Option<names::PodOf<'a>> {
    names::pod_of(spec, &w.node_id.0).filter(|p| role_matches(w.role, p.service.role))
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
            let s = pod(spec, w)?.service;
            let ph = phase(s.role)?;
            let target = s.group.clone().unwrap_or_else(|| s.name.clone());
            Some((w.worker_id, (target, ph)))
        })
        .collect()
}

/// A registration whose heartbeat is older than this does not count as
/// serving (its pod may be gone; the registry keeps it for a while).
pub const SERVING_HEARTBEAT_MS: u64 = 5_000;

/// On Kubernetes: each target's replicas whose workers are all registered
/// as serving, with a fresh heartbeat (at `now_ms`). Pods count once each
/// (a standalone service's pod runs one worker); a group replica `j`
/// counts when each member has its count of such pods in `j`, and only
/// below the group's observed count (`observed`), so a replica being
/// removed does not.
pub fn pod_serving(
    spec: &DeploymentSpec,
    workers: &[WorkerRegistration],
    now_ms: u64,
    observed: &BTreeMap<String, ObservedScale>,
) -> BTreeMap<String, u32> {
    // (service, group replica) -> its serving pods
    let mut by: HashMap<(&str, Option<u32>), BTreeSet<&str>> = HashMap::new();
    let fresh = |w: &&WorkerRegistration| {
        w.state == WorkerState::Serving
            && now_ms.saturating_sub(w.heartbeat_unix_ms) <= SERVING_HEARTBEAT_MS
    };
    for w in workers.iter().filter(fresh) {
        if let Some(p) = pod(spec, w) {
            by.entry((p.service.name.as_str(), p.group_replica))
                .or_default()
                .insert(w.node_id.0.as_str());
        }
    }
    let mut out = BTreeMap::new();
    for s in spec.services.iter().filter(|s| s.group.is_none()) {
        let pods = by.get(&(s.name.as_str(), None)).map_or(0, |p| p.len());
        out.insert(s.name.clone(), pods as u32);
    }
    for g in &spec.groups {
        let below = observed.get(&g.name).map_or(u32::MAX, |o| o.desired);
        let replicas: BTreeSet<u32> = by
            .keys()
            .filter(|(s, _)| g.services.iter().any(|m| m == s))
            .filter_map(|(_, j)| *j)
            .filter(|j| *j < below)
            .collect();
        let complete = replicas
            .into_iter()
            .filter(|j| {
                g.services.iter().all(|m| {
                    let want = spec.service(m).map(|s| s.replicas).unwrap_or(0);
                    by.get(&(m.as_str(), Some(*j))).map_or(0, |p| p.len()) as u32 >= want
                })
            })
            .count();
        out.insert(g.name.clone(), complete as u32);
    }
    out
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

    fn reg(id: u64, pod: &str, role: WorkerRole, state: WorkerState) -> WorkerRegistration {
        dynamo_bus_schema::testing::registration(id, pod, "m", role, state, 1_000_000)
    }

    #[test]
    fn on_kubernetes_replicas_are_the_api_servers_and_ready_is_what_serves() {
        let spec = DeploymentSpec::parse(SPEC).unwrap();
        // The desired state still says 2 prefill and 2 pd, none ready.
        let mut ts = targets(&spec, None, &BTreeSet::new(), &seed());
        let read = |desired, ready| ObservedScale { desired, ready };
        let observed = BTreeMap::from([
            ("prefill".to_string(), read(3, 2)),
            ("pd".to_string(), read(1, 1)),
        ]);
        // Grove says 2 prefill pods ready, but only one has registered as
        // serving (the other's engine is still loading).
        let serving = BTreeMap::from([("prefill".to_string(), 1), ("pd".to_string(), 4)]);
        with_observed(&mut ts, &observed, &serving);
        let by = |n: &str| ts.iter().find(|t| t.name == n).unwrap();
        assert_eq!((by("prefill").desired, by("prefill").ready), (3, 1));
        assert_eq!((by("pd").desired, by("pd").ready), (1, 1));
        // Grove keeps a PodClique at 1 or more: decode's `min: 0` is 1 here.
        assert_eq!(by("prefill").limits.min, 1);
        // Unread targets keep what the spec says.
        assert_eq!((by("decode").desired, by("decode").ready), (2, 0));
        assert_eq!(by("decode").limits.min, 0);
    }

    #[test]
    fn on_kubernetes_workers_map_to_their_target_by_pod_name_and_role() {
        let spec = DeploymentSpec::parse(SPEC).unwrap();
        let s = WorkerState::Serving;
        let m = pod_placements(
            &spec,
            &[
                reg(1, "d-0-prefill-0-ab1cd", WorkerRole::Prefill, s),
                reg(2, "d-0-pd-1-pd-d-1-zzzzz", WorkerRole::Decode, s),
                // A role its service does not have: not this service's.
                reg(3, "d-0-decode-0-abcde", WorkerRole::Prefill, s),
                reg(4, "d-0-frontend-0-abcde", WorkerRole::Aggregated, s),
                reg(5, "e-0-prefill-0-abcde", WorkerRole::Prefill, s),
                reg(6, "laptop", WorkerRole::Prefill, s),
            ],
        );
        assert_eq!(m.len(), 2, "{m:?}");
        assert_eq!(m[&WorkerId(1)], ("prefill".to_string(), Phase::Prefill));
        // A group member's phase is its service's role, its target the group.
        assert_eq!(m[&WorkerId(2)], ("pd".to_string(), Phase::Decode));
    }

    #[test]
    fn on_kubernetes_a_group_replica_serves_when_every_member_does() {
        let spec = DeploymentSpec::parse(SPEC).unwrap();
        let (on, off) = (WorkerState::Serving, WorkerState::Draining);
        let (p, d) = (WorkerRole::Prefill, WorkerRole::Decode);
        let regs = [
            reg(1, "d-0-prefill-0-aaaaa", p, on),
            reg(2, "d-0-prefill-1-bbbbb", p, off),
            // Group replica 0: pd-p ×1 and pd-d ×2, all serving.
            reg(3, "d-0-pd-0-pd-p-0-aaaaa", p, on),
            reg(4, "d-0-pd-0-pd-d-0-aaaaa", d, on),
            reg(5, "d-0-pd-0-pd-d-1-aaaaa", d, on),
            // Group replica 1: one of its two decoders is not serving.
            reg(6, "d-0-pd-1-pd-p-0-aaaaa", p, on),
            reg(7, "d-0-pd-1-pd-d-0-aaaaa", d, on),
            reg(8, "d-0-pd-1-pd-d-1-aaaaa", d, off),
        ];
        let now = 1_000_000 + SERVING_HEARTBEAT_MS;
        let serving = pod_serving(&spec, &regs, now, &BTreeMap::new());
        assert_eq!(serving["prefill"], 1);
        assert_eq!(serving["decode"], 0);
        assert_eq!(serving["pd"], 1);
        // A pod registered twice counts once; a stale heartbeat not at all.
        let mut twice = regs.to_vec();
        twice.push(reg(9, "d-0-prefill-0-aaaaa", p, on));
        let mut stale = reg(10, "d-0-prefill-2-ccccc", p, on);
        stale.heartbeat_unix_ms = 0;
        twice.push(stale);
        assert_eq!(
            pod_serving(&spec, &twice, now, &BTreeMap::new())["prefill"],
            1
        );
        // Group replicas at or past the observed count are being removed.
        let shrunk = BTreeMap::from([(
            "pd".to_string(),
            ObservedScale {
                desired: 0,
                ready: 0,
            },
        )]);
        assert_eq!(pod_serving(&spec, &regs, now, &shrunk)["pd"], 0);
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
