//! Kubernetes manifests for a deployment spec: one Grove `PodCliqueSet`
//! plus the core objects its pods need ([`render_k8s`]), and the scaling
//! connector the planner uses on Kubernetes ([`connector`]).
//!
//! Invariants of what [`render_k8s`] returns:
//! - objects in apply order: one ConfigMap per service (its `node.toml`),
//!   one Service per frontend, then the PodCliqueSet ([`grove`]);
//! - the Grove object follows Grove's CRD schema, vendored in
//!   `cluster-config/k8s/grove-crds/` and checked by
//!   `tests/render_k8s.rs`; the core objects are `k8s-openapi` types
//!   serialized to JSON ([`core`]);
//! - every name rendered or composed by Grove from those names (PodCliques,
//!   scaling groups, pods, for the highest replica indices the spec
//!   reaches) is a DNS-1123 label of at most 63 characters and meets
//!   Grove's 45-character rule ([`names`]); otherwise a
//!   [`RenderError::Name`] naming the object;
//! - the options are checked first; a bad one is a [`RenderError::Option`]
//!   naming it;
//! - rendering is deterministic: the same spec and options give the same
//!   objects, in the same order.

pub mod connector;
pub mod core;
pub mod grove;
pub mod names;

use crate::spec::DeploymentSpec;
use serde_json::Value;
use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum RenderError {
    #[error("render option `{field}`: {message}")]
    Option {
        field: &'static str,
        message: String,
    },
    #[error("deployment spec field `{field}`: {message}")]
    Spec { field: String, message: String },
    #[error("{object}: name {name:?} {message}")]
    Name {
        object: String,
        name: String,
        message: String,
    },
    #[error("{object}: cannot serialize: {message}")]
    Serialize { object: String, message: String },
}

/// Where and how the deployment runs on Kubernetes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RenderOptions {
    /// Container image with `dynamo-node` on its PATH.
    pub image: String,
    /// Kubernetes namespace of every object.
    pub namespace: String,
    /// The NATS every pod connects to (passed as `$DYNAMO_NATS_URL`).
    pub nats_url: String,
    /// The bus namespace the nodes join.
    pub dynamo_namespace: String,
    /// The Grove `ClusterTopologyBinding` named in every
    /// `topologyConstraint.topologyName`.
    pub topology_name: String,
    /// `schedulerName` of every pod (Grove requires one scheduler for all
    /// pods of a PodCliqueSet); `None` leaves Grove's default.
    pub scheduler_name: Option<String>,
}

impl Default for RenderOptions {
    fn default() -> Self {
        RenderOptions {
            image: "dynamo:latest".into(),
            namespace: "default".into(),
            // The Service of the official NATS Helm chart (`helm install nats nats/nats`).
            nats_url: "nats://nats:4222".into(),
            dynamo_namespace: "default".into(),
            // The ClusterTopologyBinding Grove's operator manages when
            // topology-aware scheduling is enabled.
            topology_name: "grove-topology".into(),
            scheduler_name: None,
        }
    }
}

impl RenderOptions {
    /// Checks every option, naming the first bad one.
    pub fn validate(&self) -> Result<(), RenderError> {
        let bad =
            |field: &'static str, message: String| Err(RenderError::Option { field, message });
        if self.image.is_empty() || self.image.chars().any(|c| c.is_whitespace()) {
            return bad(
                "image",
                format!("{:?} is not an image reference", self.image),
            );
        }
        if !names::is_dns1123_label(&self.namespace) {
            return bad(
                "namespace",
                format!("{:?} is not a DNS-1123 label", self.namespace),
            );
        }
        if !(self.nats_url.starts_with("nats://") || self.nats_url.starts_with("tls://"))
            || self.nats_url.len() <= "nats://".len()
            || self.nats_url.chars().any(|c| c.is_whitespace())
        {
            return bad(
                "nats_url",
                format!("{:?} is not a nats:// or tls:// URL", self.nats_url),
            );
        }
        let ns = &self.dynamo_namespace;
        if ns.is_empty()
            || ns.len() > 64
            || !ns
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        {
            return bad(
                "dynamo_namespace",
                format!("{ns:?} must be 1-64 characters of [A-Za-z0-9_-]"),
            );
        }
        if !names::is_dns1123_subdomain(&self.topology_name) {
            return bad(
                "topology_name",
                format!("{:?} is not a DNS-1123 subdomain", self.topology_name),
            );
        }
        if let Some(s) = &self.scheduler_name {
            if !names::is_dns1123_subdomain(s) {
                return bad(
                    "scheduler_name",
                    format!("{s:?} is not a DNS-1123 subdomain"),
                );
            }
        }
        Ok(())
    }
}

/// Renders `spec` into Kubernetes objects (JSON values, apply order).
pub fn render_k8s(spec: &DeploymentSpec, opts: &RenderOptions) -> Result<Vec<Value>, RenderError> {
    opts.validate()?;
    names::check_deployment(spec)?;
    planner_budget(spec)?;
    let tomls = spec
        .services
        .iter()
        .map(|s| core::node_toml(s, opts))
        .collect::<Result<Vec<_>, _>>()?;
    let mut out = Vec::new();
    for (s, t) in spec.services.iter().zip(&tomls) {
        out.push(core::config_map(spec, s, opts, t)?);
    }
    for s in spec.services.iter().filter(|s| !s.role.is_worker()) {
        out.push(core::frontend_service(spec, s, opts)?);
    }
    out.push(grove::pod_clique_set(spec, opts, &tomls)?);
    Ok(out)
}

/// Grove keeps every PodClique and scaling group at one replica or more, so
/// on Kubernetes a planner target's floor is 1 even where its `min` is 0:
/// a slot budget must hold every target at that floor.
fn planner_budget(spec: &DeploymentSpec) -> Result<(), RenderError> {
    let Some(p) = &spec.planner else {
        return Ok(());
    };
    let Some(budget) = p.slot_budget else {
        return Ok(());
    };
    let floor: u64 = p
        .targets
        .iter()
        .map(|(name, l)| l.min.max(1) as u64 * spec.target_slots(name).unwrap_or(0) as u64)
        .sum();
    if floor > budget as u64 {
        return Err(RenderError::Spec {
            field: "planner.slot_budget".into(),
            message: format!(
                "{budget} is less than the {floor} slots the planner's targets hold at one replica each, the least Grove keeps (no scale to zero on Kubernetes)"
            ),
        });
    }
    Ok(())
}

/// The objects as one multi-document YAML stream (`---` before each).
pub fn to_yaml_documents(objs: &[Value]) -> Result<String, RenderError> {
    let mut out = String::new();
    for o in objs {
        let kind = o.get("kind").and_then(Value::as_str).unwrap_or("object");
        let name = o
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or("");
        let doc = serde_yaml_ng::to_string(o).map_err(|e| RenderError::Serialize {
            object: format!("{kind} {name}"),
            message: e.to_string(),
        })?;
        out.push_str("---\n");
        out.push_str(&doc);
        if !doc.ends_with('\n') {
            out.push('\n');
        }
    }
    Ok(out)
}
