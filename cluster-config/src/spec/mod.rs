//! The deployment spec: one YAML file describing a serving graph, parsed
//! into checked types ([`DeploymentSpec`]).
//!
//! ```yaml
//! version: 1
//! name: disagg
//! topology: {preferred: zone}            # the whole deployment
//! services:
//!   frontend: {role: frontend, replicas: 1, gateway: {listen: "127.0.0.1:8000"}, router: {policy: kv_aware}}
//!   prefill:  {role: prefill, replicas: 2, resources: {slots: 1}, topology: {required: rack},
//!              starts_after: [frontend], worker: {engine: mocker}}
//!   decode:   {role: decode, replicas: 2, resources: {slots: 1}, worker: {engine: mocker}}
//! groups:                                 # services scaled and placed together
//!   pd: {services: [prefill, decode], replicas: 1, min_available: 1, topology: {required: rack}}
//! ```
//!
//! Invariants of a [`DeploymentSpec`]:
//! - names are DNS labels (`[a-z0-9-]`, starting with a letter), unique
//!   across services and groups;
//! - every numeric field is bounded (replicas ≤ [`MAX_REPLICAS`], slots ≤
//!   [`MAX_SLOTS`]); `min_available` ≤ replicas;
//! - a child's topology constraint only narrows its parent's (deployment →
//!   group → service), and in one constraint `preferred` is narrower than
//!   `required`;
//! - `starts_after` names existing services, and the order has no cycle;
//! - a service is in at most one group; a frontend has no `worker` section
//!   and a worker has no `gateway`/`router` section.
//!
//! A spec being applied meets more ([`DeploymentSpec::check_for_apply`]):
//! rules added after specs were stored, which a stored spec need not meet.
//!
//! Engine, gateway and router settings stay JSON values here: their types
//! live above this crate, and the node validates them (`dynamoctl apply`
//! does so before anything is stored), with errors naming
//! `services.<name>.worker.<field>`.

use crate::placement::{Gang, Level, Member, Pack, Scope};
use crate::planner_spec::{PlannerSpec, RawPlanner};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use thiserror::Error;

mod placing;
pub use placing::Replica;

/// Most replicas of one service or group.
pub const MAX_REPLICAS: u32 = 4096;
/// Most slots (GPUs) one replica may ask for.
pub const MAX_SLOTS: u32 = 64;
/// Longest service, group or deployment name. Grove pod names are
/// `<pcs>-<i>-<pcsg>-<j>-<pclq>-<suffix>` in at most 63 characters; the
/// renderer checks the composed names.
pub const MAX_NAME: usize = 40;
/// Most services and groups in one deployment.
pub const MAX_SERVICES: usize = 64;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum SpecError {
    #[error("deployment spec: {0}")]
    Parse(String),
    #[error("deployment spec field `{field}`: {message}")]
    Invalid { field: String, message: String },
    #[error("cannot scale {target} to {replicas}: {message}")]
    Scale {
        target: String,
        replicas: u32,
        message: String,
    },
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> SpecError {
    SpecError::Invalid {
        field: field.into(),
        message: message.into(),
    }
}

/// What a service runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// A gateway and a router.
    Frontend,
    Aggregated,
    Prefill,
    Decode,
}

impl Role {
    pub fn as_str(&self) -> &'static str {
        match self {
            Role::Frontend => "frontend",
            Role::Aggregated => "aggregated",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
    pub fn is_worker(&self) -> bool {
        !matches!(self, Role::Frontend)
    }
}

/// Resources of one replica.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Resources {
    /// Accelerator slots (GPUs) the replica takes on its node.
    #[serde(default)]
    pub slots: u32,
    /// Memory the replica takes on its node, MiB.
    #[serde(default)]
    pub memory_mib: u64,
}

/// A checked service.
#[derive(Clone, Debug, PartialEq)]
pub struct ServiceSpec {
    pub name: String,
    pub role: Role,
    /// Replicas; for a member of a group, replicas per group replica.
    pub replicas: u32,
    /// Ready replicas below which the service is not available (the
    /// gang floor, and what `starts_after` waits for).
    pub min_available: u32,
    pub resources: Resources,
    /// Packing of all of this service's replicas (within one group replica
    /// for a group member).
    pub pack: Pack,
    /// Services that must be available before this one is started.
    pub starts_after: Vec<String>,
    /// Node labels a replica's node must have (`key: value`, sorted).
    pub node_selector: Vec<(String, String)>,
    /// The scaling group this service belongs to.
    pub group: Option<String>,
    /// Worker settings (engine, model, …) for worker roles, in the node's
    /// `[[workers]]` shape without `count` and `role`.
    pub worker: Option<serde_json::Value>,
    /// Gateway settings (frontend).
    pub gateway: Option<serde_json::Value>,
    /// Router settings (frontend).
    pub router: Option<serde_json::Value>,
}

/// A checked scaling group.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupSpec {
    pub name: String,
    pub services: Vec<String>,
    pub replicas: u32,
    pub min_available: u32,
    /// Packing of each group replica.
    pub pack: Pack,
}

/// A checked deployment spec.
#[derive(Clone, Debug, PartialEq)]
pub struct DeploymentSpec {
    pub name: String,
    /// Packing of the whole deployment.
    pub pack: Pack,
    /// Sorted by name.
    pub services: Vec<ServiceSpec>,
    /// Sorted by name.
    pub groups: Vec<GroupSpec>,
    /// What the planner scales, and the SLA it keeps (None: no planner).
    pub planner: Option<PlannerSpec>,
}

// ---- the file's shape ----

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTopology {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub required: Option<Level>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preferred: Option<Level>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawService {
    pub role: Role,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_available: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<Resources>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topology: Option<RawTopology>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub starts_after: Vec<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router: Option<serde_json::Value>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawGroup {
    pub services: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_available: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topology: Option<RawTopology>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSpec {
    /// Spec format version (1).
    pub version: u32,
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topology: Option<RawTopology>,
    pub services: BTreeMap<String, RawService>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub groups: BTreeMap<String, RawGroup>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub planner: Option<RawPlanner>,
}

/// Checks a name is a DNS label of at most [`MAX_NAME`] characters.
pub fn check_name(field: &str, name: &str) -> Result<(), SpecError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && name.as_bytes()[0].is_ascii_lowercase()
        && !name.ends_with('-')
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(invalid(
            field,
            format!(
                "{name:?} must be 1-{MAX_NAME} characters of [a-z0-9-], start with a letter and not end with '-'"
            ),
        ))
    }
}

fn pack(field: &str, t: Option<RawTopology>) -> Result<Pack, SpecError> {
    let t = t.unwrap_or_default();
    let p = Pack {
        required: t.required,
        preferred: t.preferred,
    };
    if let (Some(r), Some(pr)) = (p.required, p.preferred) {
        if !pr.narrower_or_equal(r) || pr == r {
            return Err(invalid(
                format!("{field}.preferred"),
                format!("{pr} is not narrower than the required {r}: preferring it adds nothing"),
            ));
        }
    }
    Ok(p)
}

/// A child's constraint may only narrow its parent's.
fn narrows(field: &str, parent_name: &str, parent: Pack, child: Pack) -> Result<(), SpecError> {
    if let (Some(p), Some(c)) = (parent.required, child.required) {
        if !c.narrower_or_equal(p) {
            return Err(invalid(
                format!("{field}.required"),
                format!("{c} is wider than {parent_name}'s required {p}: a child may only narrow its parent's constraint"),
            ));
        }
    }
    if let (Some(p), Some(c)) = (parent.required, child.preferred) {
        if !c.narrower_or_equal(p) {
            return Err(invalid(
                format!("{field}.preferred"),
                format!("{c} is wider than {parent_name}'s required {p}: a child may only narrow its parent's constraint"),
            ));
        }
    }
    if let (Some(p), Some(c)) = (parent.preferred, child.preferred) {
        if !c.narrower_or_equal(p) {
            return Err(invalid(
                format!("{field}.preferred"),
                format!("{c} is wider than {parent_name}'s preferred {p}: a child may only narrow its parent's constraint"),
            ));
        }
    }
    Ok(())
}

impl DeploymentSpec {
    /// Parses and checks a YAML spec.
    pub fn parse(text: &str) -> Result<Self, SpecError> {
        // A key given twice anywhere is refused: a map would keep the last
        // one and drop the other silently (two services of one name).
        let mut value = serde_yaml_ng::from_str::<serde_yaml_ng::Value>(text)
            .map_err(|e| SpecError::Parse(e.to_string()))?;
        // Top-level `x-…` keys are the file's own (anchors to share, as in
        // Compose files), and `<<: *anchor` merges one in. Such a file is
        // read from its value, whose errors name the field but no line.
        let extensions = value.as_mapping().is_some_and(|m| {
            m.keys()
                .any(|k| k.as_str().is_some_and(|k| k.starts_with("x-")))
        });
        let raw: RawSpec = if extensions || text.contains("<<") {
            value
                .apply_merge()
                .map_err(|e| SpecError::Parse(e.to_string()))?;
            if let Some(m) = value.as_mapping_mut() {
                m.retain(|k, _| !k.as_str().is_some_and(|k| k.starts_with("x-")));
            }
            serde_yaml_ng::from_value(value).map_err(|e| SpecError::Parse(e.to_string()))?
        } else {
            serde_yaml_ng::from_str(text).map_err(|e| SpecError::Parse(e.to_string()))?
        };
        Self::validate(raw)
    }

    pub fn validate(raw: RawSpec) -> Result<Self, SpecError> {
        if raw.version != 1 {
            return Err(invalid("version", "must be 1"));
        }
        check_name("name", &raw.name)?;
        let dep_pack = pack("topology", raw.topology)?;
        if raw.services.is_empty() {
            return Err(invalid(
                "services",
                "a deployment needs at least one service",
            ));
        }
        if raw.services.len() + raw.groups.len() > MAX_SERVICES {
            return Err(invalid(
                "services",
                format!("at most {MAX_SERVICES} services and groups"),
            ));
        }
        // Groups first: a member's parent constraint is its group's.
        let mut member_of: BTreeMap<String, String> = BTreeMap::new();
        let mut groups = Vec::new();
        for (name, g) in raw.groups {
            let f = format!("groups.{name}");
            check_name(&f, &name)?;
            if raw.services.contains_key(&name) {
                return Err(invalid(&f, "a group and a service share this name"));
            }
            if g.services.is_empty() {
                return Err(invalid(format!("{f}.services"), "a group needs services"));
            }
            let replicas = g.replicas.unwrap_or(1);
            if replicas > MAX_REPLICAS {
                return Err(invalid(
                    format!("{f}.replicas"),
                    format!("must be 0-{MAX_REPLICAS}"),
                ));
            }
            let min_available = g.min_available.unwrap_or(replicas.min(1));
            if min_available > replicas {
                return Err(invalid(
                    format!("{f}.min_available"),
                    format!("{min_available} is more than the group's {replicas} replicas"),
                ));
            }
            let p = pack(&format!("{f}.topology"), g.topology)?;
            narrows(&format!("{f}.topology"), "the deployment", dep_pack, p)?;
            let mut seen = BTreeSet::new();
            for s in &g.services {
                if !raw.services.contains_key(s) {
                    return Err(invalid(
                        format!("{f}.services"),
                        format!("no service {s:?} in this deployment"),
                    ));
                }
                if !seen.insert(s.clone()) {
                    return Err(invalid(
                        format!("{f}.services"),
                        format!("{s:?} is listed twice"),
                    ));
                }
                if let Some(other) = member_of.insert(s.clone(), name.clone()) {
                    return Err(invalid(
                        format!("{f}.services"),
                        format!("{s:?} is already in group {other:?}; a service is in at most one group"),
                    ));
                }
            }
            groups.push(GroupSpec {
                name,
                services: g.services,
                replicas,
                min_available,
                pack: p,
            });
        }
        let names: BTreeSet<String> = raw.services.keys().cloned().collect();
        let mut services = Vec::new();
        for (name, s) in raw.services {
            let f = format!("services.{name}");
            check_name(&f, &name)?;
            let group = member_of.get(&name).cloned();
            let replicas = s.replicas.unwrap_or(1);
            if replicas > MAX_REPLICAS {
                return Err(invalid(
                    format!("{f}.replicas"),
                    format!("must be 0-{MAX_REPLICAS}"),
                ));
            }
            if group.is_some() && replicas == 0 {
                return Err(invalid(
                    format!("{f}.replicas"),
                    "a group member needs at least 1 replica per group replica (scale the group instead)",
                ));
            }
            let min_available = s.min_available.unwrap_or(replicas.min(1));
            if min_available > replicas {
                return Err(invalid(
                    format!("{f}.min_available"),
                    format!("{min_available} is more than the service's {replicas} replicas"),
                ));
            }
            let resources = s.resources.unwrap_or(Resources {
                slots: u32::from(s.role.is_worker()),
                memory_mib: 0,
            });
            if resources.slots > MAX_SLOTS {
                return Err(invalid(
                    format!("{f}.resources.slots"),
                    format!("must be 0-{MAX_SLOTS}"),
                ));
            }
            if resources.memory_mib > (1 << 30) {
                return Err(invalid(
                    format!("{f}.resources.memory_mib"),
                    "must be at most 1073741824 (1 PiB)",
                ));
            }
            let p = pack(&format!("{f}.topology"), s.topology)?;
            match &group {
                Some(g) => {
                    let gp = groups
                        .iter()
                        .find(|x| &x.name == g)
                        .map(|x| x.pack)
                        .unwrap_or_default();
                    narrows(&format!("{f}.topology"), &format!("group {g}"), gp, p)?;
                    narrows(&format!("{f}.topology"), "the deployment", dep_pack, p)?;
                }
                None => narrows(&format!("{f}.topology"), "the deployment", dep_pack, p)?,
            }
            let label_ok = |v: &str| {
                !v.is_empty()
                    && v.len() <= 63
                    && v.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
            };
            for (k, v) in &s.node_selector {
                if !label_ok(k) || !label_ok(v) {
                    return Err(invalid(
                        format!("{f}.node_selector.{k}"),
                        "label keys and values are 1-63 characters of [A-Za-z0-9._-]",
                    ));
                }
            }
            let node_selector: Vec<(String, String)> =
                s.node_selector.clone().into_iter().collect();
            for a in &s.starts_after {
                if a == &name {
                    return Err(invalid(
                        format!("{f}.starts_after"),
                        "a service cannot start after itself",
                    ));
                }
                if !names.contains(a) {
                    return Err(invalid(
                        format!("{f}.starts_after"),
                        format!("no service {a:?} in this deployment"),
                    ));
                }
            }
            let (worker, gateway, router) = if s.role.is_worker() {
                if s.gateway.is_some() || s.router.is_some() {
                    return Err(invalid(
                        format!(
                            "{f}.{}",
                            if s.gateway.is_some() {
                                "gateway"
                            } else {
                                "router"
                            }
                        ),
                        "only a frontend service has gateway or router settings",
                    ));
                }
                let w = s.worker.ok_or_else(|| {
                    invalid(
                        format!("{f}.worker"),
                        "a worker service needs a worker section (engine, model, …)",
                    )
                })?;
                let obj = w
                    .as_object()
                    .ok_or_else(|| invalid(format!("{f}.worker"), "must be a mapping"))?;
                for k in ["count", "role"] {
                    if obj.contains_key(k) {
                        return Err(invalid(
                            format!("{f}.worker.{k}"),
                            "set by the service (`replicas`, `role`), not in worker".to_string(),
                        ));
                    }
                }
                if !obj.get("engine").is_some_and(|e| e.is_string()) {
                    return Err(invalid(
                        format!("{f}.worker.engine"),
                        "missing: name an engine (cpu or mocker)",
                    ));
                }
                (Some(w), None, None)
            } else {
                if s.worker.is_some() {
                    return Err(invalid(
                        format!("{f}.worker"),
                        "a frontend runs a gateway and a router, not workers",
                    ));
                }
                for (k, v) in [("gateway", &s.gateway), ("router", &s.router)] {
                    if v.as_ref().is_some_and(|v| !v.is_object()) {
                        return Err(invalid(format!("{f}.{k}"), "must be a mapping"));
                    }
                }
                (None, s.gateway, s.router)
            };
            services.push(ServiceSpec {
                name,
                role: s.role,
                replicas,
                min_available,
                resources,
                pack: p,
                starts_after: s.starts_after,
                node_selector,
                group,
                worker,
                gateway,
                router,
            });
        }
        let spec = DeploymentSpec {
            name: raw.name,
            pack: dep_pack,
            services,
            groups,
            planner: raw.planner.map(PlannerSpec::validate).transpose()?,
        };
        spec.check_start_order()?;
        spec.check_planner_targets()?;

        Ok(spec)
    }

    /// Each planner target is a group, or a worker service outside any group.
    fn check_planner_targets(&self) -> Result<(), SpecError> {
        let Some(p) = &self.planner else {
            return Ok(());
        };
        for name in p.targets.keys() {
            let f = format!("planner.services.{name}");
            if self.group(name).is_some() {
                continue;
            }
            match self.service(name) {
                None => {
                    return Err(invalid(
                        f,
                        format!("no service or group {name:?} in this deployment"),
                    ))
                }
                Some(s) if !s.role.is_worker() => {
                    return Err(invalid(f, "the planner scales worker services and groups"))
                }
                Some(s) => {
                    if let Some(g) = &s.group {
                        return Err(invalid(
                            f,
                            format!("{name} is in group {g}: name the group, which scales its members together"),
                        ));
                    }
                }
            }
        }
        if let Some(budget) = p.slot_budget {
            let floor: u64 = p
                .targets
                .iter()
                .map(|(n, l)| l.min as u64 * self.target_slots(n).unwrap_or(0) as u64)
                .sum();
            if floor > budget as u64 {
                return Err(invalid(
                    "planner.slot_budget",
                    format!("{budget} is less than the {floor} slots the targets' minimums hold"),
                ));
            }
        }
        Ok(())
    }

    /// Slots one replica of a target holds: a service's, or a group's
    /// members' together (None: no such target).
    pub fn target_slots(&self, target: &str) -> Option<u32> {
        if let Some(g) = self.group(target) {
            return Some(
                g.services
                    .iter()
                    .filter_map(|m| self.service(m))
                    .map(|m| m.resources.slots.saturating_mul(m.replicas))
                    .fold(0u32, |a, b| a.saturating_add(b)),
            );
        }
        self.service(target).map(|s| s.resources.slots)
    }

    /// Replicas a target has now (a service's, or a group's).
    pub fn target_replicas(&self, target: &str) -> Option<u32> {
        self.group(target)
            .map(|g| g.replicas)
            .or_else(|| self.service(target).map(|s| s.replicas))
    }

    /// Rejects a cycle in `starts_after`, naming a service on it.
    fn check_start_order(&self) -> Result<(), SpecError> {
        // Kahn's algorithm over the (small) service graph.
        let mut pending: BTreeMap<&str, BTreeSet<&str>> = self
            .services
            .iter()
            .map(|s| {
                (
                    s.name.as_str(),
                    s.starts_after.iter().map(|x| x.as_str()).collect(),
                )
            })
            .collect();
        loop {
            let ready: Vec<&str> = pending
                .iter()
                .filter(|(_, d)| d.is_empty())
                .map(|(n, _)| *n)
                .collect();
            if ready.is_empty() {
                break;
            }
            for r in ready {
                pending.remove(r);
                for d in pending.values_mut() {
                    d.remove(r);
                }
            }
        }
        match pending.keys().next() {
            None => Ok(()),
            Some(n) => Err(invalid(
                format!("services.{n}.starts_after"),
                "the start-up order has a cycle",
            )),
        }
    }

    pub fn service(&self, name: &str) -> Option<&ServiceSpec> {
        self.services.iter().find(|s| s.name == name)
    }

    pub fn group(&self, name: &str) -> Option<&GroupSpec> {
        self.groups.iter().find(|g| g.name == name)
    }

    /// Sets the replicas of a standalone service or of a group (what
    /// `dynamoctl scale deployment/TARGET N` changes). A group member is
    /// scaled through its group, so that its members stay together.
    pub fn scale(&mut self, target: &str, replicas: u32) -> Result<(), SpecError> {
        let refuse = |message: String| SpecError::Scale {
            target: format!("{}/{target}", self.name),
            replicas,
            message,
        };
        if replicas > MAX_REPLICAS {
            return Err(refuse(format!("replicas must be 0-{MAX_REPLICAS}")));
        }
        let mut scaled = self.clone();
        if let Some(g) = scaled.groups.iter_mut().find(|g| g.name == target) {
            g.replicas = replicas;
            g.min_available = floor(g.min_available, replicas);
        } else {
            match scaled.services.iter_mut().find(|s| s.name == target) {
                Some(s) => match &s.group {
                    Some(g) => {
                        return Err(refuse(format!(
                            "service {target} is in scaling group {g}: scale deployment/{g}"
                        )))
                    }
                    None => {
                        s.replicas = replicas;
                        s.min_available = floor(s.min_available, replicas);
                    }
                },
                None => {
                    return Err(refuse(format!(
                        "no service or group {target:?} in deployment {}",
                        self.name
                    )))
                }
            }
        }
        let total = scaled.total_replicas();
        if total > MAX_REPLICAS as u64 {
            return Err(refuse(format!(
                "the deployment would have {total} replicas in all; at most {MAX_REPLICAS}"
            )));
        }
        *self = scaled;
        Ok(())
    }

    /// Rules for a spec being applied (`dynamoctl apply`, `render`),
    /// beyond what a stored spec must meet: they were added after specs
    /// were stored, and a stored spec that breaks one still loads (the
    /// controller stops, rather than place a smaller world, on one that
    /// does not).
    /// - at most [`MAX_REPLICAS`] replicas in all, so what the controller
    ///   reports of the deployment fits one bus message;
    /// - the start-up order, with each group one unit (its services start
    ///   together), has no cycle: a group's services cannot wait for one
    ///   another, even through other services;
    /// - the planner's settings can work.
    pub fn check_for_apply(&self) -> Result<(), SpecError> {
        let total = self.total_replicas();
        if total > MAX_REPLICAS as u64 {
            return Err(invalid(
                "services",
                format!("{total} replicas in all (groups' replicas times their services'); at most {MAX_REPLICAS}"),
            ));
        }
        let unit = |svc: &str| -> String {
            self.service(svc)
                .and_then(|s| s.group.clone())
                .unwrap_or_else(|| svc.to_string())
        };
        for s in &self.services {
            for a in &s.starts_after {
                if s.group.is_some() && unit(a) == unit(&s.name) {
                    return Err(invalid(
                        format!("services.{}.starts_after", s.name),
                        format!(
                            "{a:?} is in group {:?} too, and a group's services start together; order the group after other services instead",
                            unit(a)
                        ),
                    ));
                }
            }
        }
        let mut pending: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for s in &self.services {
            let deps = pending.entry(unit(&s.name)).or_default();
            deps.extend(s.starts_after.iter().map(|a| unit(a)));
        }
        for (u, deps) in pending.iter_mut() {
            deps.remove(u);
        }
        loop {
            let ready: Vec<String> = pending
                .iter()
                .filter(|(_, d)| d.is_empty())
                .map(|(n, _)| n.clone())
                .collect();
            if ready.is_empty() {
                break;
            }
            for r in &ready {
                pending.remove(r);
                for d in pending.values_mut() {
                    d.remove(r);
                }
            }
        }
        if let Some(u) = pending.keys().next() {
            return Err(invalid(
                format!("groups.{u}"),
                "the start-up order has a cycle through this group (its services start together)",
            ));
        }
        if let Some(p) = &self.planner {
            p.check_for_apply()?;
        }
        Ok(())
    }

    /// Replicas of every service in all (a group member's times its
    /// group's replicas).
    pub fn total_replicas(&self) -> u64 {
        self.services
            .iter()
            .map(|s| {
                let times = match &s.group {
                    Some(g) => self.group(g).map_or(0, |g| g.replicas as u64),
                    None => 1,
                };
                s.replicas as u64 * times
            })
            .sum()
    }

    /// The spec back in its file's shape (for `configure --emit-config`
    /// and for storing a scaled spec).
    pub fn to_raw(&self) -> RawSpec {
        let topo = |p: Pack| {
            (p != Pack::default()).then_some(RawTopology {
                required: p.required,
                preferred: p.preferred,
            })
        };
        RawSpec {
            version: 1,
            name: self.name.clone(),
            topology: topo(self.pack),
            services: self
                .services
                .iter()
                .map(|s| {
                    (
                        s.name.clone(),
                        RawService {
                            role: s.role,
                            replicas: Some(s.replicas),
                            min_available: Some(s.min_available),
                            resources: Some(s.resources),
                            topology: topo(s.pack),
                            starts_after: s.starts_after.clone(),
                            node_selector: s.node_selector.iter().cloned().collect(),
                            worker: s.worker.clone(),
                            gateway: s.gateway.clone(),
                            router: s.router.clone(),
                        },
                    )
                })
                .collect(),
            groups: self
                .groups
                .iter()
                .map(|g| {
                    (
                        g.name.clone(),
                        RawGroup {
                            services: g.services.clone(),
                            replicas: Some(g.replicas),
                            min_available: Some(g.min_available),
                            topology: topo(g.pack),
                        },
                    )
                })
                .collect(),
            planner: self.planner.as_ref().map(|p| p.to_raw()),
        }
    }

    /// The spec as YAML.
    pub fn to_yaml(&self) -> Result<String, SpecError> {
        serde_yaml_ng::to_string(&self.to_raw()).map_err(|e| SpecError::Parse(e.to_string()))
    }
}

/// `min_available` after scaling to `replicas`: at most the replicas, and
/// back to 1 when a service scaled to zero grows again.
fn floor(min_available: u32, replicas: u32) -> u32 {
    match (min_available, replicas) {
        (_, 0) => 0,
        (0, _) => 1,
        (m, r) => m.min(r),
    }
}

#[cfg(test)]
mod tests;
