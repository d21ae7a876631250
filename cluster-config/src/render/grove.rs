//! The Grove `PodCliqueSet` of a deployment (schema:
//! `cluster-config/k8s/grove-crds/grove.io_podcliquesets.yaml`).
//!
//! Invariants of [`pod_clique_set`]:
//! - one PCS named after the deployment, `spec.replicas: 1`;
//! - one clique per service, in the spec's (name) order: clique `name` and
//!   `roleName` are the service name (Grove requires both unique), `replicas`
//!   and `minAvailable` the service's (per group replica for a member);
//! - one `podCliqueScalingGroups` entry per spec group with its members as
//!   `cliqueNames`, the group's `replicas` and `minAvailable`;
//! - `topologyConstraint` mirrors each level's packing (deployment → PCS
//!   template, group → scaling group, service → clique) as
//!   `{topologyName, pack: {required?, preferred?}}` with the level names
//!   `zone`/`rack`/`host`, and is left out where a level does not pack
//!   (the CRD requires a `pack` with at least one of the two);
//! - `cliqueStartupType` is `CliqueStartupTypeExplicit`, with each clique's
//!   `startsAfter`, when any service has `starts_after`, else
//!   `CliqueStartupTypeAnyOrder`;
//! - replica counts and floors are ≥ 1 (Grove's webhook refuses 0); a 0 is
//!   a [`RenderError::Spec`] naming the field.

use super::core::{self, ANNOTATION_CONFIG_HASH};
use super::{RenderError, RenderOptions};
use crate::placement::Pack;
use crate::spec::{DeploymentSpec, ServiceSpec};
use serde_json::{json, Map, Value};

/// `apiVersion` of Grove's core resources.
pub const API_VERSION: &str = "grove.io/v1alpha1";
/// Start-up order values of `cliqueStartupType`.
pub const STARTUP_ANY_ORDER: &str = "CliqueStartupTypeAnyOrder";
pub const STARTUP_EXPLICIT: &str = "CliqueStartupTypeExplicit";

/// A `topologyConstraint`, or `None` when `pack` constrains nothing.
pub fn topology_constraint(pack: Pack, opts: &RenderOptions) -> Option<Value> {
    if pack.required.is_none() && pack.preferred.is_none() {
        return None;
    }
    let mut p = Map::new();
    if let Some(r) = pack.required {
        p.insert("required".into(), json!(r.to_string()));
    }
    if let Some(r) = pack.preferred {
        p.insert("preferred".into(), json!(r.to_string()));
    }
    Some(json!({"topologyName": opts.topology_name, "pack": Value::Object(p)}))
}

fn at_least_one(field: String, what: &str, n: u32) -> Result<i32, RenderError> {
    if n == 0 {
        return Err(RenderError::Spec {
            field,
            message: format!("Grove requires {what} of at least 1"),
        });
    }
    i32::try_from(n).map_err(|_| RenderError::Spec {
        field,
        message: format!("{n} does not fit Grove's int32"),
    })
}

fn clique(
    spec: &DeploymentSpec,
    svc: &ServiceSpec,
    opts: &RenderOptions,
    explicit: bool,
    node_toml: &str,
) -> Result<Value, RenderError> {
    let f = format!("services.{}", svc.name);
    let mut cspec = Map::new();
    cspec.insert("roleName".into(), json!(svc.name));
    cspec.insert(
        "replicas".into(),
        json!(at_least_one(
            format!("{f}.replicas"),
            "replicas",
            svc.replicas
        )?),
    );
    cspec.insert(
        "minAvailable".into(),
        json!(at_least_one(
            format!("{f}.min_available"),
            "min_available",
            svc.min_available
        )?),
    );
    if explicit && !svc.starts_after.is_empty() {
        cspec.insert("startsAfter".into(), json!(svc.starts_after));
    }
    cspec.insert("podSpec".into(), core::pod_spec(spec, svc, opts)?);
    let mut c = Map::new();
    c.insert("name".into(), json!(svc.name));
    c.insert("labels".into(), json!(core::service_labels(spec, svc)));
    c.insert(
        "annotations".into(),
        Value::Object(Map::from_iter([(
            ANNOTATION_CONFIG_HASH.to_string(),
            json!(format!("{:016x}", core::fnv1a64(node_toml.as_bytes()))),
        )])),
    );
    if let Some(tc) = topology_constraint(svc.pack, opts) {
        c.insert("topologyConstraint".into(), tc);
    }
    c.insert("spec".into(), Value::Object(cspec));
    Ok(Value::Object(c))
}

/// The PodCliqueSet. `node_tomls[i]` is the `node.toml` of `spec.services[i]`.
pub fn pod_clique_set(
    spec: &DeploymentSpec,
    opts: &RenderOptions,
    node_tomls: &[String],
) -> Result<Value, RenderError> {
    let explicit = spec.services.iter().any(|s| !s.starts_after.is_empty());
    let cliques = spec
        .services
        .iter()
        .zip(node_tomls)
        .map(|(s, t)| clique(spec, s, opts, explicit, t))
        .collect::<Result<Vec<_>, _>>()?;
    let mut template = Map::new();
    template.insert(
        "cliqueStartupType".into(),
        json!(if explicit {
            STARTUP_EXPLICIT
        } else {
            STARTUP_ANY_ORDER
        }),
    );
    if let Some(tc) = topology_constraint(spec.pack, opts) {
        template.insert("topologyConstraint".into(), tc);
    }
    template.insert("cliques".into(), Value::Array(cliques));
    if !spec.groups.is_empty() {
        let groups = spec
            .groups
            .iter()
            .map(|g| {
                let f = format!("groups.{}", g.name);
                let mut v = Map::new();
                v.insert("name".into(), json!(g.name));
                v.insert("cliqueNames".into(), json!(g.services));
                v.insert(
                    "replicas".into(),
                    json!(at_least_one(
                        format!("{f}.replicas"),
                        "replicas",
                        g.replicas
                    )?),
                );
                v.insert(
                    "minAvailable".into(),
                    json!(at_least_one(
                        format!("{f}.min_available"),
                        "min_available",
                        g.min_available
                    )?),
                );
                if let Some(tc) = topology_constraint(g.pack, opts) {
                    v.insert("topologyConstraint".into(), tc);
                }
                Ok(Value::Object(v))
            })
            .collect::<Result<Vec<_>, RenderError>>()?;
        template.insert("podCliqueScalingGroups".into(), Value::Array(groups));
    }
    Ok(json!({
        "apiVersion": API_VERSION,
        "kind": "PodCliqueSet",
        "metadata": {
            "name": spec.name,
            "namespace": opts.namespace,
            "labels": core::object_labels(spec, None),
        },
        "spec": {
            "replicas": 1,
            "template": Value::Object(template),
        },
    }))
}
