//! `ControllerState`: the controller's synchronous logic. Given the desired
//! state (deployments), the inventory (nodes) and the current assignments,
//! it decides every node's assignment and every deployment's status.
//!
//! Invariants:
//! - a member keeps its node while that node is schedulable and its
//!   constraints hold (placement is stable), so a change to one service
//!   never moves another's replicas;
//! - a node whose heartbeat is older than the node TTL, or that is not
//!   healthy, is not schedulable: its members are placed again, gangs whole;
//! - a service whose `starts_after` services are not yet available (ready
//!   below their `min_available`) is not placed, unless it already runs; a
//!   service scaled to zero is not waited for;
//! - at most one frontend replica per node (it owns the node's HTTP port
//!   and the router's name);
//! - statuses keep the newest [`MAX_EVENTS`] events.

use dynamo_bus_schema::{
    AssignedReplica, ClusterEvent, DeploymentStatus, NodeAssignment, NodeId, NodeInventory,
    ServiceStatus, MAX_EVENTS,
};
use dynamo_cluster_config::placement::{place, Gang, NodeInfo, PlacementRequest, Scope};
use dynamo_cluster_config::spec::DeploymentSpec;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::Duration;

/// A deployment as the controller reads it.
#[derive(Clone, Debug)]
pub struct Deployment {
    pub spec: DeploymentSpec,
    pub generation: u64,
}

/// Everything one reconciliation looks at.
#[derive(Clone, Debug, Default)]
pub struct World {
    pub deployments: Vec<Deployment>,
    pub nodes: Vec<NodeInventory>,
    /// Node id → what it was last assigned.
    pub assignments: BTreeMap<String, NodeAssignment>,
    /// Nodes whose process is gone (presence probes found no responder):
    /// lost without waiting for their heartbeat to go stale.
    pub absent: BTreeSet<String>,
    pub now_ms: u64,
}

/// What one reconciliation decided.
#[derive(Clone, Debug, Default)]
pub struct Decision {
    /// Node id → its new assignment, for every node whose assignment changed.
    pub changed: BTreeMap<String, NodeAssignment>,
    pub statuses: Vec<DeploymentStatus>,
}

pub struct ControllerState {
    pub node_id: NodeId,
    pub node_ttl: Duration,
    pub epoch: u64,
    /// Nodes seen schedulable at the last reconciliation.
    alive: BTreeSet<String>,
    /// Gang → reason, as last reported (events only on change).
    pending: BTreeMap<String, String>,
    events: BTreeMap<String, VecDeque<ClusterEvent>>,
}

impl ControllerState {
    pub fn new(node_id: NodeId, node_ttl: Duration) -> Self {
        ControllerState {
            node_id,
            node_ttl,
            epoch: 0,
            alive: BTreeSet::new(),
            pending: BTreeMap::new(),
            events: BTreeMap::new(),
        }
    }

    /// Takes over the events a previous controller recorded (its statuses),
    /// so a failover keeps the history.
    pub fn adopt(&mut self, statuses: &[DeploymentStatus]) {
        // The stored history is the truth (another controller may have
        // acted since this one last did).
        self.events = statuses
            .iter()
            .map(|s| (s.name.clone(), s.events.iter().cloned().collect()))
            .collect();
        self.alive.clear();
        self.pending.clear();
    }

    pub fn event(&mut self, deployment: &str, now_ms: u64, message: String) {
        tracing::info!(deployment, "{message}");
        crate::metrics::event(deployment);
        let q = self.events.entry(deployment.to_string()).or_default();
        q.push_back(ClusterEvent {
            unix_ms: now_ms,
            message,
        });
        while q.len() > MAX_EVENTS {
            q.pop_front();
        }
    }

    fn schedulable(&self, n: &NodeInventory, now_ms: u64, absent: &BTreeSet<String>) -> bool {
        let age = now_ms.saturating_sub(n.registration.heartbeat_unix_ms);
        age <= self.node_ttl.as_millis() as u64
            && n.health == "healthy"
            && !absent.contains(&n.registration.node_id.0)
    }

    pub fn reconcile(&mut self, w: &World) -> Decision {
        let now = w.now_ms;
        let label = |n: &NodeInventory, k: &str| {
            n.labels
                .iter()
                .find(|(a, _)| a == k)
                .map(|(_, v)| v.clone())
                .unwrap_or_default()
        };
        let nodes: Vec<NodeInfo> = w
            .nodes
            .iter()
            .map(|n| NodeInfo {
                id: n.registration.node_id.0.clone(),
                zone: label(n, "zone"),
                rack: label(n, "rack"),
                host: label(n, "host"),
                slots: n.slots,
                memory_mib: n.memory_mib,
                schedulable: self.schedulable(n, now, &w.absent),
                labels: n.labels.clone(),
            })
            .collect();
        let alive: BTreeSet<String> = nodes
            .iter()
            .filter(|n| n.schedulable)
            .map(|n| n.id.clone())
            .collect();
        // Members where they run now.
        let mut current: HashMap<String, String> = HashMap::new();
        for (node, a) in &w.assignments {
            for r in &a.replicas {
                current.insert(r.key.clone(), node.clone());
            }
        }
        // Nodes lost since the last look, and who had members there.
        let lost: Vec<String> = self.alive.difference(&alive).cloned().collect();
        for node in &lost {
            let why = match w.nodes.iter().find(|n| &n.registration.node_id.0 == node) {
                Some(n) if n.health != "healthy" => format!("lost ({})", n.health),
                Some(_) if w.absent.contains(node) => "lost (its process is gone)".to_string(),
                Some(n) => format!(
                    "lost (no heartbeat for {} s)",
                    now.saturating_sub(n.registration.heartbeat_unix_ms) / 1000
                ),
                None => "left (gone from the nodes bucket)".into(),
            };
            let deps: BTreeSet<String> = w
                .assignments
                .get(node)
                .map(|a| a.replicas.iter().map(|r| r.deployment.clone()).collect())
                .unwrap_or_default();
            for d in deps {
                self.event(
                    &d,
                    now,
                    format!("node {node} {why}: its replicas are placed again"),
                );
            }
        }
        self.alive = alive.clone();
        // Ready replicas: reported ready by the node they are assigned to.
        let mut ready: BTreeSet<String> = BTreeSet::new();
        for n in &w.nodes {
            let id = &n.registration.node_id.0;
            if !alive.contains(id) {
                continue;
            }
            for r in &n.replicas {
                if r.ready && !r.stopping && current.get(&r.key) == Some(id) {
                    ready.insert(r.key.clone());
                }
            }
        }
        // The placement problem over every deployment at once (capacity is shared).
        let mut scopes: Vec<Scope> = Vec::new();
        let mut gangs: Vec<Gang> = Vec::new();
        let mut waiting: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for d in &w.deployments {
            let spec = &d.spec;
            // Each replica once: (service, its member key).
            let keyed: Vec<(String, String)> = spec
                .replicas()
                .into_iter()
                .map(|r| (r.service, format!("{}/{}", spec.name, r.key)))
                .collect();
            let ready_of = |svc: &str| {
                keyed
                    .iter()
                    .filter(|(s, k)| s == svc && ready.contains(k))
                    .count() as u32
            };
            let running = |svc: &str| {
                keyed
                    .iter()
                    .any(|(s, k)| s == svc && current.contains_key(k))
            };
            let mut blocked: BTreeMap<String, String> = BTreeMap::new();
            for s in &spec.services {
                if running(&s.name) {
                    continue;
                }
                for a in &s.starts_after {
                    // A service scaled to zero (itself or through its
                    // group) is nothing to wait for, as when it is scaled to
                    // zero after its dependents start.
                    if !keyed.iter().any(|(s, _)| s == a) {
                        continue;
                    }
                    let need = spec.service(a).map(|x| x.min_available).unwrap_or(0);
                    let have = ready_of(a);
                    if have < need.max(1) {
                        blocked.insert(
                            s.name.clone(),
                            format!(
                                "waits for {a} to be available ({have}/{} ready)",
                                need.max(1)
                            ),
                        );
                    }
                }
            }
            for (svc, why) in &blocked {
                waiting
                    .entry(spec.name.clone())
                    .or_default()
                    .push(format!("{svc}: {why}"));
            }
            let (sc, mut gs) = spec.gangs(&|svc| !blocked.contains_key(svc));
            let offset = scopes.len();
            for g in &mut gs {
                for i in &mut g.scopes {
                    *i += offset;
                }
            }
            scopes.extend(sc);
            gangs.extend(gs);
        }
        // Replicas still draining hold their slots until they are gone.
        let mut reserved: HashMap<String, (u32, u64)> = HashMap::new();
        for n in &w.nodes {
            let id = &n.registration.node_id.0;
            for r in n.replicas.iter().filter(|r| r.stopping) {
                if current.get(&r.key) != Some(id) {
                    let e = reserved.entry(id.clone()).or_default();
                    e.0 = e.0.saturating_add(r.slots);
                    e.1 = e.1.saturating_add(r.memory_mib);
                }
            }
        }
        // Starts that failed, with the node's reason.
        let mut failed: BTreeMap<String, String> = BTreeMap::new();
        for n in &w.nodes {
            let id = &n.registration.node_id.0;
            for r in n.replicas.iter().filter(|r| !r.error.is_empty()) {
                if current.get(&r.key) == Some(id) {
                    failed.insert(
                        r.key.clone(),
                        format!("failed to start on node {id}: {}", r.error),
                    );
                }
            }
        }
        let mut placed = place(&PlacementRequest {
            nodes: &nodes,
            scopes: &scopes,
            gangs: &gangs,
            current: &current,
            reserved: &reserved,
        });
        // A group starts with at least `min_available` of its replicas
        // placed together (Grove's gang floor), or none.
        for d in &w.deployments {
            for g in d.spec.groups.iter().filter(|g| g.min_available > 1) {
                let prefix = format!("{}/{}-", d.spec.name, g.name);
                let in_group = |k: &String| {
                    k.strip_prefix(&prefix).is_some_and(|rest| {
                        rest.split('.')
                            .next()
                            .is_some_and(|j| j.parse::<u32>().is_ok())
                    })
                };
                if current.keys().any(in_group) {
                    continue;
                }
                let gang_keys: Vec<&Gang> = gangs
                    .iter()
                    .filter(|x| in_group(&format!("{}.", x.key)))
                    .collect();
                let whole = gang_keys
                    .iter()
                    .filter(|x| {
                        x.members
                            .iter()
                            .all(|m| placed.assignments.contains_key(&m.key))
                    })
                    .count() as u32;
                if whole >= g.min_available || gang_keys.is_empty() {
                    continue;
                }
                for x in &gang_keys {
                    for m in &x.members {
                        placed.assignments.remove(&m.key);
                    }
                    if !placed.pending.iter().any(|p| p.gang == x.key) {
                        placed.pending.push(dynamo_cluster_config::placement::Pending {
                            gang: x.key.clone(),
                            reason: format!(
                                "group {} starts with {} replicas placed together (min_available); only {whole} fit",
                                g.name, g.min_available
                            ),
                        });
                    }
                }
            }
        }
        // Assignments per node.
        let mut per_node: BTreeMap<String, Vec<AssignedReplica>> = BTreeMap::new();
        for d in &w.deployments {
            let spec = &d.spec;
            for r in spec.replicas() {
                let key = format!("{}/{}", spec.name, r.key);
                let (Some(node), Some(s)) =
                    (placed.assignments.get(&key), spec.service(&r.service))
                else {
                    continue;
                };
                let settings = match &s.worker {
                    Some(wk) => wk.to_string(),
                    None => serde_json::json!({"gateway": frontend_gateway(spec, s), "router": s.router})
                        .to_string(),
                };
                per_node
                    .entry(node.clone())
                    .or_default()
                    .push(AssignedReplica {
                        key: key.clone(),
                        deployment: spec.name.clone(),
                        service: s.name.clone(),
                        role: s.role.as_str().into(),
                        settings,
                        slots: s.resources.slots,
                        memory_mib: s.resources.memory_mib,
                    });
                match current.get(&key) {
                    None => self.event(
                        &spec.name,
                        now,
                        format!("replica {} placed on node {node}", r.key),
                    ),
                    Some(old) if old != node => self.event(
                        &spec.name,
                        now,
                        format!("replica {} moved from node {old} to node {node}", r.key),
                    ),
                    _ => {}
                }
            }
        }
        let mut changed = BTreeMap::new();
        let known: BTreeSet<&String> = w.assignments.keys().chain(per_node.keys()).collect();
        for node in known {
            let mut want = per_node.get(node).cloned().unwrap_or_default();
            want.sort_by(|a, b| a.key.cmp(&b.key));
            let have = w.assignments.get(node).map(|a| a.replicas.clone());
            if have.as_ref() != Some(&want) && !(have.is_none() && want.is_empty()) {
                changed.insert(
                    node.clone(),
                    NodeAssignment {
                        node_id: NodeId(node.clone()),
                        epoch: self.epoch,
                        replicas: want,
                    },
                );
            }
        }
        // Pending reasons, with events when they change.
        let mut pending_now: BTreeMap<String, String> = BTreeMap::new();
        for p in &placed.pending {
            pending_now.insert(p.gang.clone(), p.reason.clone());
        }
        // One event per deployment and reason, however many replicas.
        let mut newly: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
        for (gang, reason) in &pending_now {
            if self.pending.get(gang) != Some(reason) {
                let dep = gang.split('/').next().unwrap_or_default().to_string();
                let short = gang.split_once('/').map(|x| x.1).unwrap_or(gang);
                newly
                    .entry((dep, reason.clone()))
                    .or_default()
                    .push(short.to_string());
            }
        }
        for ((dep, reason), gangs) in newly {
            let what = if gangs.len() == 1 {
                "replica"
            } else {
                "replicas"
            };
            self.event(
                &dep,
                now,
                format!("{what} {} pending: {reason}", listed(&gangs)),
            );
        }
        self.pending = pending_now.clone();
        // Statuses.
        let mut statuses = Vec::new();
        for d in &w.deployments {
            let spec = &d.spec;
            let all = spec.replicas();
            let mut services = Vec::new();
            for s in &spec.services {
                let reps: Vec<_> = all.iter().filter(|r| r.service == s.name).collect();
                let mut st = ServiceStatus {
                    name: s.name.clone(),
                    role: s.role.as_str().into(),
                    desired: reps.len() as u32,
                    placed: 0,
                    ready: 0,
                    pending: Vec::new(),
                    placements: Vec::new(),
                };
                let mut reasons = BTreeSet::new();
                // Replicas by why they are not placed or not ready, in order.
                let mut why_of: BTreeMap<String, Vec<String>> = BTreeMap::new();
                for r in &reps {
                    let key = format!("{}/{}", spec.name, r.key);
                    match placed.assignments.get(&key) {
                        Some(node) => {
                            st.placed += 1;
                            st.placements.push((r.key.clone(), node.clone()));
                            if ready.contains(&key) {
                                st.ready += 1;
                            } else if let Some(why) = failed.get(&key) {
                                why_of.entry(why.clone()).or_default().push(r.key.clone());
                            }
                        }
                        None => {
                            if let Some(why) = pending_now.get(&format!("{}/{}", spec.name, r.gang))
                            {
                                let keys = why_of.entry(why.clone()).or_default();
                                // A group's replica is one gang for its services.
                                if keys.last() != Some(&r.gang) {
                                    keys.push(r.gang.clone());
                                }
                            }
                        }
                    }
                }
                for (why, keys) in &why_of {
                    reasons.insert(format!("{}: {why}", listed(keys)));
                }
                if let Some(ws) = waiting.get(&spec.name) {
                    for x in ws {
                        if x.starts_with(&format!("{}: ", s.name)) {
                            reasons.insert(x.clone());
                        }
                    }
                }
                if st.placed > st.ready {
                    reasons.insert(format!(
                        "{} placed replica(s) starting",
                        st.placed - st.ready
                    ));
                }
                st.pending = reasons.into_iter().collect();
                services.push(st);
            }
            statuses.push(DeploymentStatus {
                name: spec.name.clone(),
                generation: d.generation,
                services,
                events: self
                    .events
                    .get(&spec.name)
                    .map(|q| q.iter().cloned().collect())
                    .unwrap_or_default(),
                controller: self.node_id.clone(),
                updated_unix_ms: now,
            });
        }
        // Deployments gone: forget their events, and their series.
        let names: BTreeSet<&str> = w.deployments.iter().map(|d| d.spec.name.as_str()).collect();
        self.events.retain(|k, _| {
            let keep = names.contains(k.as_str());
            if !keep {
                crate::metrics::deployment_gone(k);
            }
            keep
        });
        Decision { changed, statuses }
    }
}

/// A frontend's gateway settings as placed: a deployment its planner may
/// scale to zero holds requests while no worker is up (unless the spec
/// says otherwise), so the first request after an idle period waits for
/// the worker the planner wakes instead of failing, also for a model this
/// frontend never saw served (`held_models`: its workers' models). Other
/// frontends' settings are the spec's as written (a change of settings
/// restarts a replica).
fn frontend_gateway(
    spec: &dynamo_cluster_config::spec::DeploymentSpec,
    s: &dynamo_cluster_config::spec::ServiceSpec,
) -> Option<serde_json::Value> {
    let to_zero = spec
        .planner
        .as_ref()
        .is_some_and(|p| p.idle_to_zero.is_some());
    // The models its workers serve: a request for one is not a 404 before
    // the first worker of it registers (or after a scale to zero).
    let mut models: Vec<String> = spec
        .services
        .iter()
        .filter_map(|w| {
            w.worker
                .as_ref()?
                .get("model")?
                .as_str()
                .map(str::to_string)
        })
        .collect();
    models.sort();
    models.dedup();
    if !to_zero {
        return s.gateway.clone();
    }
    let mut g = s.gateway.clone().unwrap_or_else(|| serde_json::json!({}));
    if let Some(o) = g.as_object_mut() {
        o.entry("held_models").or_insert_with(|| models.into());
        // Within the request deadline (the gateway checks the two).
        let deadline = o
            .get("request_timeout_ms")
            .and_then(|v| v.as_u64())
            .unwrap_or(600_000);
        o.entry("hold_for_workers_ms")
            .or_insert_with(|| HOLD_AFTER_ZERO_MS.min(deadline).into());
    }
    Some(g)
}

/// How long a frontend holds requests while its deployment has no worker
/// (a scale to zero): a worker's cold start should fit.
const HOLD_AFTER_ZERO_MS: u64 = 180_000;

/// The first few of `keys`, then how many more: a reason many replicas
/// share is one line of a status or one event, not one per replica.
fn listed(keys: &[String]) -> String {
    const LISTED: usize = 3;
    let head = keys[..keys.len().min(LISTED)].join(", ");
    match keys.len().saturating_sub(LISTED) {
        0 => head,
        more => format!("{head} and {more} more ({} in all)", keys.len()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dynamo_bus_schema::{NodeRegistration, RunningReplica};

    const SPEC: &str = r#"
version: 1
name: d
services:
  frontend: {role: frontend, router: {policy: kv_aware}}
  prefill: {role: prefill, replicas: 2, topology: {required: rack}, starts_after: [frontend], worker: {engine: mocker}}
  decode: {role: decode, replicas: 2, worker: {engine: mocker}}
"#;

    fn node(id: &str, rack: &str, host: &str, hb: u64) -> NodeInventory {
        NodeInventory {
            registration: NodeRegistration {
                node_id: NodeId(id.into()),
                pid: 1,
                hostname: "h".into(),
                actors: vec![],
                http_addr: None,
                started_unix_ms: 0,
                heartbeat_unix_ms: hb,
            },
            labels: vec![
                ("host".into(), host.into()),
                ("rack".into(), rack.into()),
                ("zone".into(), "z1".into()),
            ],
            slots: 4,
            free_slots: 4,
            memory_mib: 1024,
            free_memory_mib: 1024,
            controller: true,
            health: "healthy".into(),
            replicas: vec![],
        }
    }

    fn world(now: u64) -> World {
        World {
            deployments: vec![Deployment {
                spec: DeploymentSpec::parse(SPEC).unwrap(),
                generation: 1,
            }],
            nodes: vec![
                node("n1", "r1", "h1", now),
                node("n2", "r1", "h2", now),
                node("n3", "r2", "h3", now),
                node("n4", "r2", "h4", now),
            ],
            assignments: BTreeMap::new(),
            absent: BTreeSet::new(),
            now_ms: now,
        }
    }

    /// Applies a decision and marks every assigned replica ready.
    fn settle(w: &mut World, d: &Decision) {
        for (n, a) in &d.changed {
            w.assignments.insert(n.clone(), a.clone());
        }
        for n in &mut w.nodes {
            n.replicas = w
                .assignments
                .get(&n.registration.node_id.0)
                .map(|a| {
                    a.replicas
                        .iter()
                        .map(|r| RunningReplica {
                            key: r.key.clone(),
                            ready: true,
                            stopping: false,
                            generation: 1,
                            error: String::new(),
                            slots: r.slots,
                            memory_mib: r.memory_mib,
                        })
                        .collect()
                })
                .unwrap_or_default();
        }
    }

    fn placed(w: &World) -> BTreeMap<String, String> {
        w.assignments
            .iter()
            .flat_map(|(n, a)| a.replicas.iter().map(move |r| (r.key.clone(), n.clone())))
            .collect()
    }

    #[test]
    fn start_order_then_placement_then_readiness() {
        let mut st = ControllerState::new(NodeId("n1".into()), Duration::from_secs(10));
        let mut w = world(1_000);
        let d = st.reconcile(&w);
        settle(&mut w, &d);
        let p = placed(&w);
        // Prefill waits for the frontend.
        assert!(p.contains_key("d/frontend-0") && p.contains_key("d/decode-1"));
        assert!(!p.contains_key("d/prefill-0"));
        let pre = d.statuses[0]
            .services
            .iter()
            .find(|s| s.name == "prefill")
            .unwrap();
        assert!(
            pre.pending.iter().any(|r| r.contains("waits for frontend")),
            "{pre:?}"
        );
        let d = st.reconcile(&w);
        settle(&mut w, &d);
        let p = placed(&w);
        let rack = |n: &str| if n == "n1" || n == "n2" { "r1" } else { "r2" };
        assert_eq!(rack(&p["d/prefill-0"]), rack(&p["d/prefill-1"]));
        let d = st.reconcile(&w);
        assert!(d.changed.is_empty(), "a settled cluster changes nothing");
        assert!(d.statuses[0].services.iter().all(|s| s.ready == s.desired));
    }

    #[test]
    fn replicas_pending_for_one_reason_are_one_line_and_one_event() {
        let mut st = ControllerState::new(NodeId("n1".into()), Duration::from_secs(10));
        let mut w = world(1_000);
        w.deployments[0].spec = DeploymentSpec::parse(
            "version: 1\nname: d\nservices:\n  w: {role: aggregated, replicas: 10, node_selector: {gpu: h100}, worker: {engine: mocker}}\n",
        )
        .unwrap();
        let d = st.reconcile(&w);
        let svc = &d.statuses[0].services[0];
        assert_eq!(svc.pending.len(), 1, "{svc:?}");
        assert!(
            svc.pending[0].starts_with("w-0, w-1, w-2 and 7 more (10 in all): "),
            "{svc:?}"
        );
        let events = &d.statuses[0].events;
        assert_eq!(events.len(), 1, "{events:?}");
        assert!(
            events[0]
                .message
                .starts_with("replicas w-0, w-1, w-2 and 7 more (10 in all) pending: "),
            "{events:?}"
        );
        assert_eq!(listed(&["a".to_string()]), "a");
    }

    #[test]
    fn a_service_scaled_to_zero_is_nothing_to_wait_for() {
        let mut st = ControllerState::new(NodeId("n1".into()), Duration::from_secs(10));
        let mut w = world(1_000);
        w.deployments[0].spec.scale("frontend", 0).unwrap();
        let d = st.reconcile(&w);
        settle(&mut w, &d);
        let p = placed(&w);
        assert!(!p.contains_key("d/frontend-0"));
        assert!(
            p.contains_key("d/prefill-0"),
            "prefill waits for no frontend: {p:?}"
        );
    }

    #[test]
    fn scaling_one_service_moves_nothing_else() {
        let mut st = ControllerState::new(NodeId("n1".into()), Duration::from_secs(10));
        let mut w = world(1_000);
        for _ in 0..3 {
            let d = st.reconcile(&w);
            settle(&mut w, &d);
        }
        let before = placed(&w);
        w.deployments[0].spec.scale("decode", 3).unwrap();
        let d = st.reconcile(&w);
        settle(&mut w, &d);
        let after = placed(&w);
        for (k, n) in &before {
            assert_eq!(after.get(k), Some(n), "{k} moved");
        }
        assert!(after.contains_key("d/decode-2"));
        w.deployments[0].spec.scale("decode", 1).unwrap();
        let d = st.reconcile(&w);
        settle(&mut w, &d);
        let after = placed(&w);
        assert!(!after.contains_key("d/decode-1") && after.contains_key("d/decode-0"));
        for (k, n) in &before {
            if !k.starts_with("d/decode") {
                assert_eq!(after.get(k), Some(n), "{k} moved");
            }
        }
    }

    #[test]
    fn a_lost_node_has_its_replicas_placed_again_with_an_event() {
        let mut st = ControllerState::new(NodeId("n1".into()), Duration::from_secs(10));
        let mut w = world(1_000);
        for _ in 0..3 {
            let d = st.reconcile(&w);
            settle(&mut w, &d);
        }
        let before = placed(&w);
        let victim = before["d/decode-0"].clone();
        w.now_ms = 20_000;
        for n in &mut w.nodes {
            if n.registration.node_id.0 != victim {
                n.registration.heartbeat_unix_ms = 20_000;
            }
        }
        let d = st.reconcile(&w);
        settle(&mut w, &d);
        let after = placed(&w);
        assert!(after.values().all(|n| n != &victim));
        assert_eq!(after.len(), before.len());
        let ev = &d.statuses[0].events;
        assert!(
            ev.iter()
                .any(|e| e.message.contains(&format!("node {victim} lost"))),
            "{ev:?}"
        );
    }

    #[test]
    fn a_deleted_deployment_takes_its_event_series_with_it() {
        let series = || -> Vec<String> {
            dynamo_runtime::metrics::registry()
                .gather()
                .iter()
                .filter(|f| f.name() == "dynamo_controller_events_total")
                .flat_map(|f| f.get_metric().iter())
                .flat_map(|m| m.get_label().iter())
                .map(|l| l.value().to_string())
                .collect()
        };
        let mut st = ControllerState::new(NodeId("n1".into()), Duration::from_secs(10));
        let mut w = world(1_000);
        // A name no other test uses: the registry is the process's.
        w.deployments[0].spec.name = "deleted-one".into();
        let name = w.deployments[0].spec.name.clone();
        for _ in 0..2 {
            let d = st.reconcile(&w);
            settle(&mut w, &d);
        }
        st.event(&name, 1_000, "something happened".into());
        assert!(series().contains(&name));
        w.deployments.clear();
        st.reconcile(&w);
        assert!(!series().contains(&name), "{:?}", series());
    }

    #[test]
    fn an_absent_node_is_lost_before_its_heartbeat_is_stale() {
        let mut st = ControllerState::new(NodeId("n1".into()), Duration::from_secs(10));
        let mut w = world(1_000);
        for _ in 0..3 {
            let d = st.reconcile(&w);
            settle(&mut w, &d);
        }
        let victim = placed(&w)["d/decode-1"].clone();
        w.absent.insert(victim.clone());
        let d = st.reconcile(&w);
        settle(&mut w, &d);
        assert!(placed(&w).values().all(|n| n != &victim));
        let ev = &d.statuses[0].events;
        let lost = format!("node {victim} lost (its process is gone)");
        assert!(ev.iter().any(|e| e.message.contains(&lost)), "{ev:?}");
    }

    #[test]
    fn a_group_starts_with_its_floor_placed_or_not_at_all() {
        let spec = "version: 1\nname: g\nservices:\n  w:\n    role: aggregated\n    replicas: 2\n    \
                    resources: {slots: 4}\n    worker: {engine: mocker}\ngroups:\n  pd:\n    services: [w]\n    \
                    replicas: 4\n    min_available: 3\n    topology: {required: host}\n";
        let mut st = ControllerState::new(NodeId("n1".into()), Duration::from_secs(10));
        let mut w = world(1_000);
        w.deployments = vec![Deployment {
            spec: DeploymentSpec::parse(spec).unwrap(),
            generation: 1,
        }];
        // A group replica needs 8 slots on one host: two 8-slot hosts hold
        // two replicas, below the floor of three.
        w.nodes[0].slots = 8;
        w.nodes[1].slots = 8;
        let d = st.reconcile(&w);
        settle(&mut w, &d);
        assert!(placed(&w).is_empty(), "{:?}", placed(&w));
        let s = &d.statuses[0].services[0];
        assert!(
            s.pending.iter().any(|r| r.contains("min_available")),
            "{s:?}"
        );
        // With a third big host the floor fits: three replicas start.
        w.nodes[2].slots = 8;
        let d = st.reconcile(&w);
        settle(&mut w, &d);
        assert_eq!(placed(&w).len(), 6);
    }

    #[test]
    fn unsatisfiable_specs_say_why() {
        let mut st = ControllerState::new(NodeId("n1".into()), Duration::from_secs(10));
        let mut w = world(1_000);
        w.deployments[0].spec.scale("prefill", 9).unwrap();
        for _ in 0..2 {
            let d = st.reconcile(&w);
            settle(&mut w, &d);
        }
        let d = st.reconcile(&w);
        let pre = d.statuses[0]
            .services
            .iter()
            .find(|s| s.name == "prefill")
            .unwrap();
        assert!(pre.placed < 9);
        assert!(pre.pending.iter().any(|r| r.contains("rack")), "{pre:?}");
    }
}
