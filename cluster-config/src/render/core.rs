//! Core Kubernetes objects of a deployment, built from typed `k8s-openapi`
//! structs: a ConfigMap per service holding its `node.toml`, a Service per
//! frontend, and the pod spec every clique's pods run.
//!
//! Invariants:
//! - a service's `node.toml` configures exactly one replica: `node_id` is a
//!   placeholder that `--node-id $(POD_NAME)` overrides, the bus URL is read
//!   from `$DYNAMO_NATS_URL` (`[nats] url = "env"`), a frontend binds its
//!   gateway on `0.0.0.0:<the spec's port>` and a worker service runs one
//!   `[[workers]]` entry with `count = 1` and the service's role;
//! - the spec's engine, gateway and router settings are copied as given
//!   (the node validates them); a value TOML cannot hold (a JSON `null`) is
//!   a [`RenderError::Spec`] naming the field;
//! - the container runs `dynamo-node --config /etc/dynamo/node.toml
//!   --node-id $(POD_NAME)` as uid [`RUN_AS_USER`], the ConfigMap mounted
//!   read-only at `/etc/dynamo`;
//! - GPUs are asked for only when the service takes slots
//!   (`nvidia.com/gpu` limit = slots), memory only when `memory_mib > 0`.

use super::{names, RenderError, RenderOptions};
use crate::spec::{DeploymentSpec, ServiceSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, ConfigMapVolumeSource, Container, ContainerPort, EnvVar, EnvVarSource,
    HTTPGetAction, ObjectFieldSelector, PodSecurityContext, PodSpec, Probe, ResourceRequirements,
    SecurityContext, Service, ServicePort, ServiceSpec as K8sServiceSpec, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;

/// Where the ConfigMap is mounted.
pub const CONFIG_DIR: &str = "/etc/dynamo";
/// The key (file) in each ConfigMap.
pub const CONFIG_FILE: &str = "node.toml";
/// The gateway's port when the spec does not set one.
pub const DEFAULT_GATEWAY_PORT: u16 = 8000;
/// The uid (and gid) the image's user has.
pub const RUN_AS_USER: i64 = 10001;
/// The extended resource GPUs are asked for as.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
/// Label: the deployment an object belongs to.
pub const LABEL_DEPLOYMENT: &str = "dynamo.nvidia.com/deployment";
/// Label: the service an object (or pod) belongs to.
pub const LABEL_SERVICE: &str = "dynamo.nvidia.com/service";
/// Label: the service's role.
pub const LABEL_ROLE: &str = "dynamo.nvidia.com/role";
/// Pod annotation: a hash of the `node.toml`, so a changed config rolls the pods.
pub const ANNOTATION_CONFIG_HASH: &str = "dynamo.nvidia.com/node-toml-fnv1a64";
const LABEL_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
const MANAGED_BY: &str = "dynamoctl";

fn spec_err(field: impl Into<String>, message: impl Into<String>) -> RenderError {
    RenderError::Spec {
        field: field.into(),
        message: message.into(),
    }
}

fn ser<T: serde::Serialize>(object: &str, v: &T) -> Result<Value, RenderError> {
    serde_json::to_value(v).map_err(|e| RenderError::Serialize {
        object: object.to_string(),
        message: e.to_string(),
    })
}

/// Labels of the pods (and per-service objects) of `svc`.
pub fn service_labels(spec: &DeploymentSpec, svc: &ServiceSpec) -> BTreeMap<String, String> {
    BTreeMap::from([
        (LABEL_DEPLOYMENT.to_string(), spec.name.clone()),
        (LABEL_SERVICE.to_string(), svc.name.clone()),
        (LABEL_ROLE.to_string(), svc.role.as_str().to_string()),
    ])
}

/// Labels of the objects the renderer writes itself (not Grove's).
pub fn object_labels(spec: &DeploymentSpec, svc: Option<&ServiceSpec>) -> BTreeMap<String, String> {
    let mut l = match svc {
        Some(s) => service_labels(spec, s),
        None => BTreeMap::from([(LABEL_DEPLOYMENT.to_string(), spec.name.clone())]),
    };
    l.insert(LABEL_MANAGED_BY.to_string(), MANAGED_BY.to_string());
    l
}

/// The port a frontend's gateway listens on: the spec's `gateway.listen`
/// port, else [`DEFAULT_GATEWAY_PORT`].
pub fn gateway_port(svc: &ServiceSpec) -> Result<u16, RenderError> {
    let field = format!("services.{}.gateway.listen", svc.name);
    let Some(listen) = svc.gateway.as_ref().and_then(|g| g.get("listen")) else {
        return Ok(DEFAULT_GATEWAY_PORT);
    };
    let text = listen
        .as_str()
        .ok_or_else(|| spec_err(&field, "must be a string `host:port`"))?;
    let port = text
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse::<u16>().ok())
        .filter(|p| *p != 0)
        .ok_or_else(|| {
            spec_err(
                &field,
                format!("{text:?} is not `host:port` with a port of 1-65535"),
            )
        })?;
    Ok(port)
}

/// Converts a JSON value into TOML, naming the field of a value TOML
/// cannot hold.
fn to_toml(field: &str, v: &Value) -> Result<toml::Value, RenderError> {
    Ok(match v {
        Value::Null => {
            return Err(spec_err(
                field,
                "null has no TOML form: leave the key out instead",
            ))
        }
        Value::Bool(b) => toml::Value::Boolean(*b),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                toml::Value::Integer(i)
            } else if n.is_u64() {
                return Err(spec_err(field, format!("{n} does not fit a TOML integer")));
            } else {
                toml::Value::Float(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        Value::String(s) => toml::Value::String(s.clone()),
        Value::Array(a) => toml::Value::Array(
            a.iter()
                .enumerate()
                .map(|(i, x)| to_toml(&format!("{field}[{i}]"), x))
                .collect::<Result<_, _>>()?,
        ),
        Value::Object(o) => toml::Value::Table(
            o.iter()
                .map(|(k, x)| Ok((k.clone(), to_toml(&format!("{field}.{k}"), x)?)))
                .collect::<Result<_, RenderError>>()?,
        ),
    })
}

fn object(field: &str, v: Option<&Value>) -> Result<Map<String, Value>, RenderError> {
    match v {
        None => Ok(Map::new()),
        Some(Value::Object(o)) => Ok(o.clone()),
        Some(_) => Err(spec_err(field, "must be a mapping")),
    }
}

/// The `node.toml` for one replica of `svc`.
pub fn node_toml(svc: &ServiceSpec, opts: &RenderOptions) -> Result<String, RenderError> {
    let f = format!("services.{}", svc.name);
    let mut root = Map::new();
    root.insert("node_id".into(), json!("pod"));
    root.insert("namespace".into(), json!(opts.dynamo_namespace));
    root.insert("nats".into(), json!({"url": "env"}));
    if svc.role.is_worker() {
        let mut w = object(&format!("{f}.worker"), svc.worker.as_ref())?;
        w.insert("count".into(), json!(1));
        w.insert("role".into(), json!(svc.role.as_str()));
        root.insert("workers".into(), Value::Array(vec![Value::Object(w)]));
    } else {
        let mut g = object(&format!("{f}.gateway"), svc.gateway.as_ref())?;
        g.insert(
            "listen".into(),
            json!(format!("0.0.0.0:{}", gateway_port(svc)?)),
        );
        // A pod listens on all addresses for its Service. Without API keys
        // in the spec (`gateway.api_keys_file`, a mounted Secret) it is
        // served open, said so explicitly in the rendered file.
        if !g.contains_key("api_keys_file") {
            g.entry("allow_unauthenticated")
                .or_insert_with(|| json!(true));
        }
        root.insert("gateway".into(), Value::Object(g));
        if let Some(r) = &svc.router {
            root.insert(
                "router".into(),
                Value::Object(object(&format!("{f}.router"), Some(r))?),
            );
        }
    }
    let table = to_toml(&f, &Value::Object(root))?;
    let body = toml::to_string(&table).map_err(|e| RenderError::Serialize {
        object: format!("node.toml of service {}", svc.name),
        message: e.to_string(),
    })?;
    Ok(format!(
        "# node.toml for one replica of service {} (rendered by dynamoctl).\n\
         # node_id is overridden by `--node-id $(POD_NAME)`; the NATS URL comes from $DYNAMO_NATS_URL.\n{body}",
        svc.name
    ))
}

/// FNV-1a, 64 bits: a stable, dependency-free content hash.
pub fn fnv1a64(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The ConfigMap holding `node_toml` for `svc`.
pub fn config_map(
    spec: &DeploymentSpec,
    svc: &ServiceSpec,
    opts: &RenderOptions,
    node_toml: &str,
) -> Result<Value, RenderError> {
    let cm = ConfigMap {
        metadata: ObjectMeta {
            name: Some(names::config_map_name(&spec.name, &svc.name)),
            namespace: Some(opts.namespace.clone()),
            labels: Some(object_labels(spec, Some(svc))),
            ..Default::default()
        },
        data: Some(BTreeMap::from([(
            CONFIG_FILE.to_string(),
            node_toml.to_string(),
        )])),
        ..Default::default()
    };
    ser(&format!("ConfigMap of service {}", svc.name), &cm)
}

/// The Service in front of a frontend's gateways.
pub fn frontend_service(
    spec: &DeploymentSpec,
    svc: &ServiceSpec,
    opts: &RenderOptions,
) -> Result<Value, RenderError> {
    let port = gateway_port(svc)?;
    let s = Service {
        metadata: ObjectMeta {
            name: Some(names::service_name(&spec.name, &svc.name)),
            namespace: Some(opts.namespace.clone()),
            labels: Some(object_labels(spec, Some(svc))),
            ..Default::default()
        },
        spec: Some(K8sServiceSpec {
            type_: Some("ClusterIP".into()),
            selector: Some(BTreeMap::from([
                (LABEL_DEPLOYMENT.to_string(), spec.name.clone()),
                (LABEL_SERVICE.to_string(), svc.name.clone()),
            ])),
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port: i32::from(port),
                protocol: Some("TCP".into()),
                target_port: Some(IntOrString::String("http".into())),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    };
    ser(&format!("Service of frontend {}", svc.name), &s)
}

fn env(name: &str, value: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: Some(value.into()),
        ..Default::default()
    }
}

/// The pod spec of `svc`'s pods (the clique's `podSpec`).
pub fn pod_spec(
    spec: &DeploymentSpec,
    svc: &ServiceSpec,
    opts: &RenderOptions,
) -> Result<Value, RenderError> {
    let mut requests = BTreeMap::new();
    let mut limits = BTreeMap::new();
    if svc.resources.memory_mib > 0 {
        requests.insert(
            "memory".to_string(),
            Quantity(format!("{}Mi", svc.resources.memory_mib)),
        );
    }
    if svc.resources.slots > 0 {
        limits.insert(
            GPU_RESOURCE.to_string(),
            Quantity(svc.resources.slots.to_string()),
        );
    }
    let resources = (!requests.is_empty() || !limits.is_empty()).then(|| ResourceRequirements {
        requests: (!requests.is_empty()).then_some(requests),
        limits: (!limits.is_empty()).then_some(limits),
        ..Default::default()
    });
    let (ports, readiness_probe) = if svc.role.is_worker() {
        (None, None)
    } else {
        let port = gateway_port(svc)?;
        (
            Some(vec![ContainerPort {
                name: Some("http".into()),
                container_port: i32::from(port),
                protocol: Some("TCP".into()),
                ..Default::default()
            }]),
            Some(Probe {
                http_get: Some(HTTPGetAction {
                    path: Some("/health".into()),
                    port: IntOrString::String("http".into()),
                    ..Default::default()
                }),
                period_seconds: Some(5),
                failure_threshold: Some(3),
                ..Default::default()
            }),
        )
    };
    let container = Container {
        name: "dynamo-node".into(),
        image: Some(opts.image.clone()),
        command: Some(vec!["dynamo-node".into()]),
        args: Some(vec![
            "--config".into(),
            format!("{CONFIG_DIR}/{CONFIG_FILE}"),
            "--node-id".into(),
            "$(POD_NAME)".into(),
        ]),
        env: Some(vec![
            EnvVar {
                name: "POD_NAME".into(),
                value_from: Some(EnvVarSource {
                    field_ref: Some(ObjectFieldSelector {
                        field_path: "metadata.name".into(),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            },
            env("DYNAMO_NATS_URL", &opts.nats_url),
            env("DYNAMO_NAMESPACE", &opts.dynamo_namespace),
        ]),
        ports,
        readiness_probe,
        resources,
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            ..Default::default()
        }),
        volume_mounts: Some(vec![VolumeMount {
            name: "config".into(),
            mount_path: CONFIG_DIR.into(),
            read_only: Some(true),
            ..Default::default()
        }]),
        ..Default::default()
    };
    let pod = PodSpec {
        containers: vec![container],
        scheduler_name: opts.scheduler_name.clone(),
        // The spec's node_selector is the pod's: labels its node must have.
        node_selector: (!svc.node_selector.is_empty())
            .then(|| svc.node_selector.iter().cloned().collect()),
        security_context: Some(PodSecurityContext {
            run_as_non_root: Some(true),
            run_as_user: Some(RUN_AS_USER),
            run_as_group: Some(RUN_AS_USER),
            fs_group: Some(RUN_AS_USER),
            ..Default::default()
        }),
        volumes: Some(vec![Volume {
            name: "config".into(),
            config_map: Some(ConfigMapVolumeSource {
                name: names::config_map_name(&spec.name, &svc.name),
                ..Default::default()
            }),
            ..Default::default()
        }]),
        ..Default::default()
    };
    ser(&format!("pod spec of service {}", svc.name), &pod)
}
