//! The Kubernetes scaling connector: how the planner changes a rendered
//! deployment's replicas on Kubernetes.
//!
//! A standalone service scales through its PodClique
//! (`<pcs>-0-<service>`), a scaling group through its PodCliqueScalingGroup
//! (`<pcs>-0-<group>`); a group member is scaled with its group. The
//! objects are patched directly because Grove does not propagate replica
//! changes of the PodCliqueSet template to existing children (what
//! Dynamo's operator does too).
//!
//! Invariants:
//! - [`scale_request`] builds, with `kube::core::Request`, a `PATCH` of
//!   `/apis/grove.io/v1alpha1/namespaces/{ns}/{podcliques|podcliquescalinggroups}/{name}`
//!   whose body is the JSON merge patch `{"spec":{"replicas":N}}`
//!   (`Content-Type: application/merge-patch+json`), with
//!   `fieldManager=`[`FIELD_MANAGER`]; nothing else in the object changes;
//! - given the replica count a read returned, the request is instead a
//!   JSON Patch (`application/json-patch+json`) that first tests
//!   `/spec/replicas` against it, so the API server refuses it if anyone
//!   changed the count since: a decision made on what was read never
//!   overwrites a change it did not see. Only the count is tested, so
//!   Grove's own status writes (which bump `resourceVersion` while pods
//!   come up) never refuse it;
//! - targets and namespaces are checked before a request exists, and each
//!   error names the target or field;
//! - [`get_request`] reads the same object back; [`observed_scale`] takes
//!   from it the replicas asked for (`spec.replicas`) and those ready
//!   (a PodClique's `status.readyReplicas`, a scaling group's
//!   `status.availableReplicas`), refusing an object of another kind or
//!   name, or a count outside `0..=MAX_REPLICAS`, with the field named;
//! - sending needs the non-default `k8s-client` feature (`KubeScaler`);
//!   the default build only constructs requests and parses answers.

use super::names;
use crate::spec::{DeploymentSpec, MAX_REPLICAS};
use kube::core::params::{GetParams, Patch, PatchParams};
use kube::core::{ApiResource, DynamicObject, Request, Resource};
use serde_json::{json, Value};
use thiserror::Error;

/// Grove's API group and version.
pub const GROUP: &str = "grove.io";
pub const VERSION: &str = "v1alpha1";
/// `fieldManager` of the connector's patches.
pub const FIELD_MANAGER: &str = "dynamo-planner";

#[derive(Debug, Error)]
pub enum ConnectorError {
    #[error("scale target {target:?}: {message}")]
    Target { target: String, message: String },
    #[error("scale request field `{field}`: {message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
    #[error("building the scale request for {kind} {name}: {message}")]
    Request {
        kind: &'static str,
        name: String,
        message: String,
    },
    #[cfg(feature = "k8s-client")]
    #[error("Kubernetes API: {0}")]
    Api(kube::Error),
}

// Not `#[from]`: the message already shows the cause, and a source would
// print it twice in a chain (`{:#}`).
#[cfg(feature = "k8s-client")]
impl From<kube::Error> for ConnectorError {
    fn from(e: kube::Error) -> Self {
        ConnectorError::Api(e)
    }
}

/// The Grove kinds that scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScaleKind {
    PodClique,
    PodCliqueScalingGroup,
}

impl ScaleKind {
    pub fn kind(&self) -> &'static str {
        match self {
            ScaleKind::PodClique => "PodClique",
            ScaleKind::PodCliqueScalingGroup => "PodCliqueScalingGroup",
        }
    }
    /// The resource's plural (its URL segment), as in the CRD.
    pub fn plural(&self) -> &'static str {
        match self {
            ScaleKind::PodClique => "podcliques",
            ScaleKind::PodCliqueScalingGroup => "podcliquescalinggroups",
        }
    }
    pub fn api_resource(&self) -> ApiResource {
        ApiResource {
            group: GROUP.into(),
            version: VERSION.into(),
            api_version: format!("{GROUP}/{VERSION}"),
            kind: self.kind().into(),
            plural: self.plural().into(),
        }
    }
}

/// One Grove object whose `spec.replicas` the connector sets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScaleTarget {
    pub kind: ScaleKind,
    /// The object's name (Grove's composed name).
    pub name: String,
}

impl ScaleTarget {
    /// The object that scales `target` — a standalone service or a scaling
    /// group of `spec` — in the PodCliqueSet [`super::render_k8s`] renders
    /// (PCS replica 0).
    pub fn for_spec(spec: &DeploymentSpec, target: &str) -> Result<Self, ConnectorError> {
        let err = |message: String| ConnectorError::Target {
            target: target.to_string(),
            message,
        };
        if let Some(g) = spec.group(target) {
            return Ok(ScaleTarget {
                kind: ScaleKind::PodCliqueScalingGroup,
                name: names::scaling_group_name(&spec.name, 0, &g.name),
            });
        }
        match spec.service(target) {
            Some(s) => match &s.group {
                Some(g) => Err(err(format!(
                    "service {target} is in scaling group {g}: scale the group"
                ))),
                None => Ok(ScaleTarget {
                    kind: ScaleKind::PodClique,
                    name: names::podclique_name(&spec.name, 0, &s.name),
                }),
            },
            None => Err(err(format!(
                "no service or group {target:?} in deployment {}",
                spec.name
            ))),
        }
    }
}

/// Checks the namespace and the target's name before a request is built.
fn checked(namespace: &str, target: &ScaleTarget) -> Result<String, ConnectorError> {
    if !names::is_dns1123_label(namespace) {
        return Err(ConnectorError::Invalid {
            field: "namespace",
            message: format!("{namespace:?} is not a DNS-1123 label"),
        });
    }
    if !names::is_dns1123_subdomain(&target.name) {
        return Err(ConnectorError::Invalid {
            field: "name",
            message: format!("{:?} is not a DNS-1123 subdomain", target.name),
        });
    }
    Ok(DynamicObject::url_path(
        &target.kind.api_resource(),
        Some(namespace),
    ))
}

fn request_err(target: &ScaleTarget) -> impl FnOnce(kube::core::request::Error) -> ConnectorError {
    let kind = target.kind.kind();
    let name = target.name.clone();
    move |e| ConnectorError::Request {
        kind,
        name,
        message: e.to_string(),
    }
}

/// The request setting `target`'s `spec.replicas` to `replicas` in
/// `namespace`: a merge patch, or, given `expect` (the count this change
/// was decided on), a JSON Patch applied only if the count is still that.
/// Grove may refuse 0 (scale to zero); the API server's answer says so.
pub fn scale_request(
    namespace: &str,
    target: &ScaleTarget,
    replicas: u32,
    expect: Option<u32>,
) -> Result<http::Request<Vec<u8>>, ConnectorError> {
    let url = checked(namespace, target)?;
    for (field, n) in [("replicas", Some(replicas)), ("expect", expect)] {
        if let Some(n) = n.filter(|n| *n > MAX_REPLICAS) {
            return Err(ConnectorError::Invalid {
                field,
                message: format!("{n} is more than {MAX_REPLICAS}"),
            });
        }
    }
    let pp = PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..Default::default()
    };
    let merge = Patch::Merge(json!({"spec": {"replicas": replicas}}));
    let mut req = Request::new(url)
        .patch(&target.name, &pp, &merge)
        .map_err(request_err(target))?;
    if let Some(expect) = expect {
        // Same URL and field manager; the body tests, then replaces.
        let ops = json!([
            {"op": "test", "path": "/spec/replicas", "value": expect},
            {"op": "replace", "path": "/spec/replicas", "value": replicas},
        ]);
        *req.body_mut() = serde_json::to_vec(&ops).map_err(|e| ConnectorError::Request {
            kind: target.kind.kind(),
            name: target.name.clone(),
            message: e.to_string(),
        })?;
        req.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json-patch+json"),
        );
    }
    Ok(req)
}

/// The request reading `target`'s object back (a `GET` of the same URL
/// [`scale_request`] patches).
pub fn get_request(
    namespace: &str,
    target: &ScaleTarget,
) -> Result<http::Request<Vec<u8>>, ConnectorError> {
    let url = checked(namespace, target)?;
    Request::new(url)
        .get(&target.name, &GetParams::default())
        .map_err(request_err(target))
}

/// What a scale target's object says about its replicas.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObservedScale {
    /// `spec.replicas`: what was asked for, by the planner or anyone else
    /// (`kubectl scale` included).
    pub desired: u32,
    /// Of those, the ones serving: a PodClique's `status.readyReplicas`
    /// (ready pods), a scaling group's `status.availableReplicas` (replicas
    /// whose every clique has its minimum ready). 0 until Grove reports;
    /// never more than `desired`. Grove counts a pod ready when its
    /// container is, and a group replica available when each clique has
    /// its `minAvailable` ready, so this is an upper bound on what serves.
    pub ready: u32,
}

/// Reads [`ObservedScale`] from `target`'s object as the API server
/// returned it.
pub fn observed_scale(target: &ScaleTarget, obj: &Value) -> Result<ObservedScale, ConnectorError> {
    let invalid = |field: &'static str, message: String| ConnectorError::Invalid { field, message };
    if obj["kind"].as_str() != Some(target.kind.kind()) {
        return Err(invalid(
            "kind",
            format!("{} is not a {}", obj["kind"], target.kind.kind()),
        ));
    }
    if obj["metadata"]["name"].as_str() != Some(target.name.as_str()) {
        return Err(invalid(
            "metadata.name",
            format!("{} is not {:?}", obj["metadata"]["name"], target.name),
        ));
    }
    let count = |field: &'static str, v: &Value| -> Result<Option<u32>, ConnectorError> {
        if v.is_null() {
            return Ok(None);
        }
        match v.as_u64() {
            Some(n) if n <= u64::from(MAX_REPLICAS) => Ok(Some(n as u32)),
            _ => Err(invalid(
                field,
                format!("{v} is not a count in 0..={MAX_REPLICAS}"),
            )),
        }
    };
    let desired = count("spec.replicas", &obj["spec"]["replicas"])?
        .ok_or_else(|| invalid("spec.replicas", "missing".into()))?;
    let status = &obj["status"];
    let ready = match target.kind {
        ScaleKind::PodClique => count("status.readyReplicas", &status["readyReplicas"])?,
        ScaleKind::PodCliqueScalingGroup => {
            count("status.availableReplicas", &status["availableReplicas"])?
        }
    }
    .unwrap_or(0);
    Ok(ObservedScale {
        desired,
        ready: ready.min(desired),
    })
}

/// Sends scale requests to a Kubernetes API server (feature `k8s-client`).
#[cfg(feature = "k8s-client")]
#[derive(Clone)]
pub struct KubeScaler {
    client: kube::Client,
    namespace: String,
}

#[cfg(feature = "k8s-client")]
impl KubeScaler {
    pub fn new(client: kube::Client, namespace: impl Into<String>) -> Self {
        KubeScaler {
            client,
            namespace: namespace.into(),
        }
    }

    /// A scaler with the in-cluster or kubeconfig credentials.
    pub async fn try_default(namespace: impl Into<String>) -> Result<Self, ConnectorError> {
        Ok(Self::new(kube::Client::try_default().await?, namespace))
    }

    /// Sets `target`'s replicas, if its count is still `expect` (when
    /// given); returns what the object says after.
    pub async fn scale(
        &self,
        target: &ScaleTarget,
        replicas: u32,
        expect: Option<u32>,
    ) -> Result<ObservedScale, ConnectorError> {
        let req = scale_request(&self.namespace, target, replicas, expect)?;
        let obj = self.client.request::<Value>(req).await?;
        observed_scale(target, &obj)
    }

    /// Reads `target`'s replicas back: asked for and ready.
    pub async fn observe(&self, target: &ScaleTarget) -> Result<ObservedScale, ConnectorError> {
        let req = get_request(&self.namespace, target)?;
        let obj = self.client.request::<Value>(req).await?;
        observed_scale(target, &obj)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(kind: ScaleKind, name: &str) -> ScaleTarget {
        ScaleTarget {
            kind,
            name: name.into(),
        }
    }

    #[test]
    fn a_podclique_patch_sets_only_replicas() {
        let req = scale_request(
            "serving",
            &target(ScaleKind::PodClique, "d-0-prefill"),
            3,
            None,
        )
        .unwrap();
        let body = patch_body(&req, "application/merge-patch+json");
        assert_eq!(body, json!({"spec": {"replicas": 3}}));
    }

    /// Checks a patch of `d-0-prefill` in `serving` by the planner with
    /// this content type; returns its body.
    fn patch_body(req: &http::Request<Vec<u8>>, content_type: &str) -> Value {
        assert_eq!(req.method(), http::Method::PATCH);
        assert_eq!(
            req.uri().path(),
            "/apis/grove.io/v1alpha1/namespaces/serving/podcliques/d-0-prefill"
        );
        assert!(req
            .uri()
            .query()
            .unwrap_or("")
            .contains("fieldManager=dynamo-planner"));
        assert_eq!(req.headers()[http::header::CONTENT_TYPE], content_type);
        serde_json::from_slice(req.body()).unwrap()
    }

    #[test]
    fn a_patch_decided_on_a_reading_is_conditional_on_it() {
        let t = target(ScaleKind::PodClique, "d-0-prefill");
        let req = scale_request("serving", &t, 2, Some(3)).unwrap();
        let body = patch_body(&req, "application/json-patch+json");
        assert_eq!(
            body,
            json!([
                {"op": "test", "path": "/spec/replicas", "value": 3},
                {"op": "replace", "path": "/spec/replicas", "value": 2},
            ])
        );
        let e = scale_request("serving", &t, 2, Some(MAX_REPLICAS + 1))
            .unwrap_err()
            .to_string();
        assert!(e.contains("`expect`"), "{e}");
    }

    #[test]
    fn bad_requests_name_the_field() {
        let t = target(ScaleKind::PodCliqueScalingGroup, "d-0-pd");
        let e = scale_request("Not_A_Namespace", &t, 1, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`namespace`"), "{e}");
        let e = scale_request("ns", &t, MAX_REPLICAS + 1, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`replicas`"), "{e}");
        let e = scale_request("ns", &target(ScaleKind::PodClique, ""), 1, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`name`"), "{e}");
    }

    #[test]
    fn the_read_back_gets_the_object_it_patches() {
        let t = target(ScaleKind::PodCliqueScalingGroup, "d-0-pd");
        let get = get_request("serving", &t).unwrap();
        let patch = scale_request("serving", &t, 2, None).unwrap();
        assert_eq!(get.method(), http::Method::GET);
        assert_eq!(get.uri().path(), patch.uri().path());
        assert_eq!(
            get.uri().path(),
            "/apis/grove.io/v1alpha1/namespaces/serving/podcliquescalinggroups/d-0-pd"
        );
        let e = get_request("ns", &target(ScaleKind::PodClique, "Bad_Name"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("`name`"), "{e}");
    }

    fn object(kind: &str, name: &str, spec: Value, status: Value) -> Value {
        json!({
            "apiVersion": "grove.io/v1alpha1",
            "kind": kind,
            "metadata": {"name": name, "generation": 4},
            "spec": spec,
            "status": status,
        })
    }

    #[test]
    fn observed_replicas_come_from_spec_and_the_kinds_own_ready_count() {
        let pclq = target(ScaleKind::PodClique, "d-0-prefill");
        let obj = object(
            "PodClique",
            "d-0-prefill",
            json!({"replicas": 3}),
            json!({"replicas": 3, "readyReplicas": 2, "availableReplicas": 9, "observedGeneration": 4}),
        );
        assert_eq!(
            observed_scale(&pclq, &obj).unwrap(),
            ObservedScale {
                desired: 3,
                ready: 2
            }
        );
        let pcsg = target(ScaleKind::PodCliqueScalingGroup, "d-0-pd");
        let obj = object(
            "PodCliqueScalingGroup",
            "d-0-pd",
            json!({"replicas": 2}),
            json!({"replicas": 2, "readyReplicas": 9, "availableReplicas": 1, "observedGeneration": 3}),
        );
        assert_eq!(
            observed_scale(&pcsg, &obj).unwrap(),
            ObservedScale {
                desired: 2,
                ready: 1
            }
        );
        // No status yet (Grove has not reconciled): nothing ready.
        let fresh = object(
            "PodClique",
            "d-0-prefill",
            json!({"replicas": 1}),
            Value::Null,
        );
        let o = observed_scale(&pclq, &fresh).unwrap();
        assert_eq!((o.desired, o.ready), (1, 0));
        // Ready never exceeds what is asked for (pods still terminating).
        let shrinking = object(
            "PodClique",
            "d-0-prefill",
            json!({"replicas": 1}),
            json!({"readyReplicas": 3}),
        );
        assert_eq!(observed_scale(&pclq, &shrinking).unwrap().ready, 1);
    }

    #[test]
    fn a_wrong_object_or_count_is_refused_with_its_field() {
        let pclq = target(ScaleKind::PodClique, "d-0-prefill");
        let err = |obj: Value| observed_scale(&pclq, &obj).unwrap_err().to_string();
        let ok_spec = json!({"replicas": 1});
        let e = err(object(
            "PodCliqueScalingGroup",
            "d-0-prefill",
            ok_spec.clone(),
            Value::Null,
        ));
        assert!(e.contains("`kind`"), "{e}");
        let e = err(object(
            "PodClique",
            "d-0-decode",
            ok_spec.clone(),
            Value::Null,
        ));
        assert!(e.contains("`metadata.name`"), "{e}");
        let e = err(object("PodClique", "d-0-prefill", json!({}), Value::Null));
        assert!(e.contains("`spec.replicas`"), "{e}");
        let e = err(object(
            "PodClique",
            "d-0-prefill",
            json!({"replicas": -1}),
            Value::Null,
        ));
        assert!(e.contains("`spec.replicas`"), "{e}");
        let e = err(object(
            "PodClique",
            "d-0-prefill",
            json!({"replicas": MAX_REPLICAS + 1}),
            Value::Null,
        ));
        assert!(e.contains("`spec.replicas`"), "{e}");
        let e = err(object(
            "PodClique",
            "d-0-prefill",
            ok_spec,
            json!({"readyReplicas": "two"}),
        ));
        assert!(e.contains("`status.readyReplicas`"), "{e}");
    }

    #[test]
    fn kinds_and_plurals_are_the_crds_own() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("k8s/grove-crds");
        for (kind, file) in [
            (ScaleKind::PodClique, "grove.io_podcliques.yaml"),
            (
                ScaleKind::PodCliqueScalingGroup,
                "grove.io_podcliquescalinggroups.yaml",
            ),
        ] {
            let text = std::fs::read_to_string(dir.join(file)).unwrap();
            let crd: serde_json::Value = serde_yaml_ng::from_str(&text).unwrap();
            assert_eq!(crd["spec"]["group"], GROUP);
            assert_eq!(crd["spec"]["names"]["plural"], kind.plural());
            assert_eq!(crd["spec"]["names"]["kind"], kind.kind());
            assert!(crd["spec"]["versions"]
                .as_array()
                .unwrap()
                .iter()
                .any(|v| v["name"] == VERSION && v["served"] == true));
            // Both scale through `spec.replicas` (their scale subresource says so).
            assert_eq!(
                crd["spec"]["versions"][0]["subresources"]["scale"]["specReplicasPath"],
                ".spec.replicas"
            );
        }
    }
}
