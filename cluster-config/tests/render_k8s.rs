//! Rendering deployment specs for Kubernetes with Grove.
//!
//! No Kubernetes API server runs here: every rendered Grove object is
//! validated against its CRD's `openAPIV3Schema` (vendored in
//! `cluster-config/k8s/grove-crds`), made strict the way `kubectl apply`'s
//! default server-side field validation is (unknown fields are errors), and
//! the core objects round-trip through their `k8s-openapi` types. Grove's
//! own samples pass the same validator, and broken objects fail it.

use dynamo_cluster_config::render::connector::{
    get_request, observed_scale, scale_request, ObservedScale, ScaleKind, ScaleTarget,
};
use dynamo_cluster_config::render::{
    names, render_k8s, to_yaml_documents, RenderError, RenderOptions,
};
use dynamo_cluster_config::spec::DeploymentSpec;
use k8s_openapi::api::core::v1::{ConfigMap, PodSpec, Service};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

fn k8s_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("k8s")
}

// ---- the validator ----

/// Makes an OpenAPI v3 schema strict and plain JSON Schema: objects with
/// `properties` (and no `additionalProperties` or
/// `x-kubernetes-preserve-unknown-fields`) refuse unknown fields, and the
/// `x-kubernetes-*` keywords (CEL rules, list types) are dropped — they need
/// an API server.
fn strict(schema: &mut Value) {
    let Value::Object(m) = schema else { return };
    let preserve = m.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true));
    m.retain(|k, _| !k.starts_with("x-kubernetes-"));
    if let Some(Value::Object(props)) = m.get_mut("properties") {
        for p in props.values_mut() {
            strict(p);
        }
        if !preserve && !m.contains_key("additionalProperties") {
            m.insert("additionalProperties".into(), Value::Bool(false));
        }
    }
    for k in ["items", "additionalProperties", "not"] {
        if let Some(s) = m.get_mut(k) {
            strict(s);
        }
    }
    for k in ["allOf", "anyOf", "oneOf"] {
        if let Some(Value::Array(a)) = m.get_mut(k) {
            a.iter_mut().for_each(strict);
        }
    }
}

struct Crd {
    api_version: String,
    kind: String,
    validator: jsonschema::Validator,
}

fn yaml_docs(text: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(text)
        .map(|d| Value::deserialize(d).expect("YAML document"))
        .filter(|v| !v.is_null())
        .collect()
}

fn crds() -> &'static [Crd] {
    static CRDS: OnceLock<Vec<Crd>> = OnceLock::new();
    CRDS.get_or_init(|| {
        let mut out = Vec::new();
        let mut paths: Vec<PathBuf> = std::fs::read_dir(k8s_dir().join("grove-crds"))
            .expect("k8s/grove-crds")
            .map(|e| e.expect("dir entry").path())
            .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
            .collect();
        paths.sort();
        assert_eq!(paths.len(), 5, "the five Grove CRDs are vendored");
        for p in paths {
            let text = std::fs::read_to_string(&p).expect("CRD file");
            for crd in yaml_docs(&text) {
                assert_eq!(crd["kind"], "CustomResourceDefinition", "{}", p.display());
                let group = crd["spec"]["group"].as_str().expect("group").to_string();
                let kind = crd["spec"]["names"]["kind"]
                    .as_str()
                    .expect("kind")
                    .to_string();
                for v in crd["spec"]["versions"].as_array().expect("versions") {
                    let mut schema = v["schema"]["openAPIV3Schema"].clone();
                    assert!(schema.is_object(), "{kind} has a schema");
                    strict(&mut schema);
                    let validator = jsonschema::options()
                        .with_draft(jsonschema::Draft::Draft4)
                        .should_validate_formats(false)
                        .build(&schema)
                        .unwrap_or_else(|e| panic!("{kind} schema compiles: {e}"));
                    out.push(Crd {
                        api_version: format!("{group}/{}", v["name"].as_str().expect("version")),
                        kind: kind.clone(),
                        validator,
                    });
                }
            }
        }
        out
    })
}

/// Validates a Grove object against its CRD: the errors, if any.
fn grove_errors(obj: &Value) -> Vec<String> {
    let (Some(av), Some(kind)) = (obj["apiVersion"].as_str(), obj["kind"].as_str()) else {
        return vec!["no apiVersion/kind".into()];
    };
    let Some(crd) = crds()
        .iter()
        .find(|c| c.api_version == av && c.kind == kind)
    else {
        return vec![format!("no CRD for {av} {kind}")];
    };
    crd.validator
        .iter_errors(obj)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect()
}

fn assert_valid_grove(obj: &Value) {
    let errs = grove_errors(obj);
    assert!(
        errs.is_empty(),
        "{} {} fails its CRD schema:\n{}",
        obj["kind"],
        obj["metadata"]["name"],
        errs.join("\n")
    );
}

/// Deserializes into `T` and back: equal only if every field is one `T`
/// knows (with the right type) and the required ones are there.
fn round_trip<T: DeserializeOwned + Serialize>(what: &str, v: &Value) {
    let t: T = serde_json::from_value(v.clone()).unwrap_or_else(|e| panic!("{what}: {e}\n{v:#}"));
    let back = serde_json::to_value(&t).expect("serialize");
    assert_eq!(
        &back, v,
        "{what} does not round-trip through its k8s-openapi type"
    );
}

/// Checks every object of a rendering.
fn check_all(objs: &[Value]) {
    assert!(!objs.is_empty());
    for o in objs {
        let name = o["metadata"]["name"].as_str().unwrap_or_default();
        assert!(names::is_dns1123_subdomain(name), "name {name:?}");
        match (o["apiVersion"].as_str(), o["kind"].as_str()) {
            (Some("v1"), Some("ConfigMap")) => round_trip::<ConfigMap>(name, o),
            (Some("v1"), Some("Service")) => round_trip::<Service>(name, o),
            (Some("grove.io/v1alpha1"), Some("PodCliqueSet")) => {
                assert_valid_grove(o);
                for c in o["spec"]["template"]["cliques"]
                    .as_array()
                    .expect("cliques")
                {
                    round_trip::<PodSpec>(
                        &format!("{name} clique {}", c["name"]),
                        &c["spec"]["podSpec"],
                    );
                }
            }
            other => panic!("unexpected object {other:?}"),
        }
    }
    // The YAML stream parses back to the same objects.
    let yaml = to_yaml_documents(objs).expect("yaml");
    assert_eq!(yaml_docs(&yaml), objs);
}

// ---- specs ----

const AGG: &str = r#"
version: 1
name: agg
services:
  frontend:
    role: frontend
    router: {policy: round_robin}
  worker:
    role: aggregated
    replicas: 2
    resources: {slots: 0}
    worker: {engine: mocker, model: smollm2-135m-instruct}
"#;

const DISAGG: &str = r#"
version: 1
name: disagg
topology: {preferred: zone}
services:
  frontend:
    role: frontend
    replicas: 2
    gateway: {listen: "127.0.0.1:9000", request_timeout_ms: 600000, liveness_timeout_ms: 800}
    router: {policy: kv_aware, min_remote_prefill_tokens: 256, overlap_weight: 1.5}
  prefill:
    role: prefill
    replicas: 2
    min_available: 1
    resources: {slots: 1, memory_mib: 2048}
    topology: {required: host}
    starts_after: [frontend]
    worker:
      engine: cpu
      model: smollm2-135m-instruct
      block_size: 16
      transfer: {provider: "tcp;ofi_rxm", prefill_timeout_ms: 60000}
      cpu: {threads: 1, num_blocks: 512}
  decode:
    role: decode
    resources: {slots: 2}
    starts_after: [frontend]
    worker: {engine: mocker, mocker: {speedup_ratio: 10.0}}
groups:
  pd:
    services: [prefill, decode]
    replicas: 3
    min_available: 2
    topology: {required: rack, preferred: host}
"#;

fn parse(text: &str) -> DeploymentSpec {
    DeploymentSpec::parse(text).unwrap_or_else(|e| panic!("{e}"))
}

fn render(text: &str) -> Vec<Value> {
    render_k8s(&parse(text), &RenderOptions::default()).unwrap_or_else(|e| panic!("{e}"))
}

fn pcs(objs: &[Value]) -> &Value {
    objs.iter()
        .find(|o| o["kind"] == "PodCliqueSet")
        .expect("a PodCliqueSet")
}

fn clique<'a>(objs: &'a [Value], name: &str) -> &'a Value {
    pcs(objs)["spec"]["template"]["cliques"]
        .as_array()
        .expect("cliques")
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("clique {name}"))
}

fn node_toml(objs: &[Value], cm: &str) -> toml::Table {
    let o = objs
        .iter()
        .find(|o| o["kind"] == "ConfigMap" && o["metadata"]["name"] == cm)
        .unwrap_or_else(|| panic!("ConfigMap {cm}"));
    let text = o["data"]["node.toml"].as_str().expect("node.toml");
    text.parse()
        .unwrap_or_else(|e| panic!("{cm} node.toml: {e}\n{text}"))
}

// ---- tests ----

#[test]
fn inline_specs_render_and_validate() {
    for (text, configmaps) in [(AGG, 2), (DISAGG, 3)] {
        let objs = render(text);
        check_all(&objs);
        let kinds: Vec<&str> = objs.iter().filter_map(|o| o["kind"].as_str()).collect();
        // Apply order: a ConfigMap per service, the frontend's Service, the PodCliqueSet.
        let mut want = vec!["ConfigMap"; configmaps];
        want.extend(["Service", "PodCliqueSet"]);
        assert_eq!(kinds, want);
    }
}

#[test]
fn example_specs_render_and_validate() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    let mut found = Vec::new();
    if let Ok(entries) = std::fs::read_dir(&dir) {
        for e in entries {
            let p = e.expect("dir entry").path();
            if p.extension().is_some_and(|x| x == "yaml" || x == "yml") {
                found.push(p);
            }
        }
    }
    found.sort();
    if dir.join("disagg.yaml").exists() {
        assert!(!found.is_empty());
    }
    for p in &found {
        let text = std::fs::read_to_string(p).expect("example");
        let spec = DeploymentSpec::parse(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        let objs = render_k8s(&spec, &RenderOptions::default())
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        check_all(&objs);
    }
}

#[test]
fn grove_samples_validate_against_the_crds() {
    let mut n = 0;
    let mut paths: Vec<PathBuf> = std::fs::read_dir(k8s_dir().join("grove-samples"))
        .expect("k8s/grove-samples")
        .map(|e| e.expect("dir entry").path())
        .collect();
    paths.sort();
    for p in paths {
        let text = std::fs::read_to_string(&p).expect("sample");
        for doc in yaml_docs(&text) {
            let errs = grove_errors(&doc);
            assert!(errs.is_empty(), "{}: {}", p.display(), errs.join("\n"));
            for c in doc["spec"]["template"]["cliques"]
                .as_array()
                .expect("cliques")
            {
                let _: PodSpec = serde_json::from_value(c["spec"]["podSpec"].clone())
                    .unwrap_or_else(|e| panic!("{} podSpec: {e}", p.display()));
            }
            n += 1;
        }
    }
    assert_eq!(n, 5, "the five samples are PodCliqueSets");
}

#[test]
fn the_validator_rejects_invalid_objects() {
    let good = pcs(&render(DISAGG)).clone();
    assert_valid_grove(&good);
    type Mutation = fn(&mut Value);
    let cases: [(&str, &str, Mutation); 7] = [
        (
            "clique replicas \"two\"",
            "/spec/template/cliques/0/spec/replicas",
            |v| v["spec"]["template"]["cliques"][0]["spec"]["replicas"] = json!("two"),
        ),
        (
            "unknown startup type",
            "/spec/template/cliqueStartupType",
            |v| v["spec"]["template"]["cliqueStartupType"] = json!("CliqueStartupTypeRandom"),
        ),
        (
            "missing roleName",
            "\"roleName\" is a required property",
            |v| {
                v["spec"]["template"]["cliques"][0]["spec"]
                    .as_object_mut()
                    .map(|m| m.remove("roleName"));
            },
        ),
        ("unknown field", "'replicaz' was unexpected", |v| {
            v["spec"]["template"]["cliques"][0]["spec"]["replicaz"] = json!(1)
        }),
        (
            "pack domain not a DNS label",
            "/topologyConstraint/pack/required",
            |v| {
                v["spec"]["template"]["podCliqueScalingGroups"][0]["topologyConstraint"]["pack"]
                    ["required"] = json!("Rack")
            },
        ),
        (
            "scaling group without cliqueNames",
            "\"cliqueNames\" is a required property",
            |v| {
                v["spec"]["template"]["podCliqueScalingGroups"][0]
                    .as_object_mut()
                    .map(|m| m.remove("cliqueNames"));
            },
        ),
        (
            "unknown field in the pod spec",
            "'containerz' was unexpected",
            |v| v["spec"]["template"]["cliques"][0]["spec"]["podSpec"]["containerz"] = json!([]),
        ),
    ];
    for (what, at, mutate) in cases {
        let mut bad = good.clone();
        mutate(&mut bad);
        assert_ne!(bad, good, "{what}: the mutation applies");
        let errs = grove_errors(&bad);
        assert!(
            errs.iter().any(|e| e.contains(at)),
            "{what}: no error at {at}: {errs:?}"
        );
    }
}

#[test]
fn cliques_and_scaling_groups_follow_the_spec() {
    let objs = render(DISAGG);
    let p = pcs(&objs);
    assert_eq!(p["apiVersion"], "grove.io/v1alpha1");
    assert_eq!(p["metadata"]["name"], "disagg");
    assert_eq!(p["metadata"]["namespace"], "default");
    assert_eq!(p["spec"]["replicas"], 1);
    let t = &p["spec"]["template"];
    let names: Vec<&str> = t["cliques"]
        .as_array()
        .expect("cliques")
        .iter()
        .filter_map(|c| c["name"].as_str())
        .collect();
    assert_eq!(names, ["decode", "frontend", "prefill"]);
    let pre = clique(&objs, "prefill");
    assert_eq!(pre["spec"]["roleName"], "prefill");
    assert_eq!(pre["spec"]["replicas"], 2);
    assert_eq!(pre["spec"]["minAvailable"], 1);
    assert_eq!(pre["labels"]["dynamo.nvidia.com/role"], "prefill");
    assert_eq!(clique(&objs, "frontend")["spec"]["replicas"], 2);
    assert_eq!(
        t["podCliqueScalingGroups"],
        json!([{
            "name": "pd",
            "cliqueNames": ["prefill", "decode"],
            "replicas": 3,
            "minAvailable": 2,
            "topologyConstraint": {
                "topologyName": "grove-topology",
                "pack": {"required": "rack", "preferred": "host"},
            },
        }])
    );
    assert!(pcs(&render(AGG))["spec"]["template"]
        .get("podCliqueScalingGroups")
        .is_none());
}

#[test]
fn topology_constraints_follow_each_level() {
    let opts = RenderOptions {
        topology_name: "racks-and-hosts".into(),
        ..Default::default()
    };
    let objs = render_k8s(&parse(DISAGG), &opts).expect("render");
    let t = &pcs(&objs)["spec"]["template"];
    assert_eq!(
        t["topologyConstraint"],
        json!({"topologyName": "racks-and-hosts", "pack": {"preferred": "zone"}})
    );
    assert_eq!(
        t["podCliqueScalingGroups"][0]["topologyConstraint"]["topologyName"],
        "racks-and-hosts"
    );
    assert_eq!(
        clique(&objs, "prefill")["topologyConstraint"],
        json!({"topologyName": "racks-and-hosts", "pack": {"required": "host"}})
    );
    // A level that does not pack has no constraint (the CRD needs a pack).
    assert!(clique(&objs, "decode").get("topologyConstraint").is_none());
    assert!(pcs(&render(AGG))["spec"]["template"]
        .get("topologyConstraint")
        .is_none());
}

#[test]
fn start_up_order_is_explicit_only_with_starts_after() {
    let objs = render(DISAGG);
    let t = &pcs(&objs)["spec"]["template"];
    assert_eq!(t["cliqueStartupType"], "CliqueStartupTypeExplicit");
    assert_eq!(
        clique(&objs, "prefill")["spec"]["startsAfter"],
        json!(["frontend"])
    );
    assert_eq!(
        clique(&objs, "decode")["spec"]["startsAfter"],
        json!(["frontend"])
    );
    assert!(clique(&objs, "frontend")["spec"]
        .get("startsAfter")
        .is_none());
    let agg = render(AGG);
    assert_eq!(
        pcs(&agg)["spec"]["template"]["cliqueStartupType"],
        "CliqueStartupTypeAnyOrder"
    );
}

#[test]
fn node_toml_configures_one_replica() {
    let opts = RenderOptions {
        dynamo_namespace: "prod".into(),
        ..Default::default()
    };
    let objs = render_k8s(&parse(DISAGG), &opts).expect("render");
    let fe = node_toml(&objs, "disagg-frontend");
    assert_eq!(fe["node_id"].as_str(), Some("pod"));
    assert_eq!(fe["namespace"].as_str(), Some("prod"));
    assert_eq!(fe["nats"]["url"].as_str(), Some("env"));
    // In a pod the gateway binds every address, on the spec's port.
    assert_eq!(fe["gateway"]["listen"].as_str(), Some("0.0.0.0:9000"));
    assert_eq!(
        fe["gateway"]["request_timeout_ms"].as_integer(),
        Some(600000)
    );
    assert_eq!(fe["router"]["policy"].as_str(), Some("kv_aware"));
    assert_eq!(fe["router"]["overlap_weight"].as_float(), Some(1.5));
    assert!(fe.get("workers").is_none());
    let pre = node_toml(&objs, "disagg-prefill");
    assert!(pre.get("gateway").is_none() && pre.get("router").is_none());
    let w = pre["workers"].as_array().expect("[[workers]]");
    assert_eq!(w.len(), 1);
    assert_eq!(w[0]["count"].as_integer(), Some(1));
    assert_eq!(w[0]["role"].as_str(), Some("prefill"));
    assert_eq!(w[0]["engine"].as_str(), Some("cpu"));
    assert_eq!(w[0]["transfer"]["provider"].as_str(), Some("tcp;ofi_rxm"));
    assert_eq!(w[0]["cpu"]["num_blocks"].as_integer(), Some(512));
    let dec = node_toml(&objs, "disagg-decode");
    assert_eq!(dec["workers"][0]["role"].as_str(), Some("decode"));
    assert_eq!(
        dec["workers"][0]["mocker"]["speedup_ratio"].as_float(),
        Some(10.0)
    );
    // No gateway section in the spec: the default port.
    let agg = render(AGG);
    assert_eq!(
        node_toml(&agg, "agg-frontend")["gateway"]["listen"].as_str(),
        Some("0.0.0.0:8000")
    );
    assert_eq!(
        node_toml(&agg, "agg-worker")["workers"][0]["role"].as_str(),
        Some("aggregated")
    );
    // The pods carry a hash of their config, so a changed config rolls them.
    let h1 = clique(&objs, "prefill")["annotations"]["dynamo.nvidia.com/node-toml-fnv1a64"].clone();
    let other = render_k8s(
        &parse(&DISAGG.replace("num_blocks: 512", "num_blocks: 256")),
        &opts,
    )
    .expect("render");
    assert!(h1.is_string());
    assert_ne!(
        clique(&other, "prefill")["annotations"]["dynamo.nvidia.com/node-toml-fnv1a64"],
        h1
    );
    assert_eq!(
        clique(&other, "decode")["annotations"],
        clique(&objs, "decode")["annotations"]
    );
}

#[test]
fn pods_run_dynamo_node_with_the_config() {
    let opts = RenderOptions {
        image: "registry.example.com/dynamo:1.2".into(),
        nats_url: "nats://nats.messaging:4222".into(),
        scheduler_name: Some("kai-scheduler".into()),
        namespace: "serving".into(),
        ..Default::default()
    };
    let objs = render_k8s(&parse(DISAGG), &opts).expect("render");
    check_all(&objs);
    for o in &objs {
        assert_eq!(o["metadata"]["namespace"], "serving");
    }
    let fe = &clique(&objs, "frontend")["spec"]["podSpec"];
    assert_eq!(fe["schedulerName"], "kai-scheduler");
    let c = &fe["containers"][0];
    assert_eq!(c["image"], "registry.example.com/dynamo:1.2");
    assert_eq!(c["command"], json!(["dynamo-node"]));
    assert_eq!(
        c["args"],
        json!([
            "--config",
            "/etc/dynamo/node.toml",
            "--node-id",
            "$(POD_NAME)"
        ])
    );
    let env: Map<String, Value> = c["env"]
        .as_array()
        .expect("env")
        .iter()
        .map(|e| {
            (
                e["name"].as_str().unwrap_or_default().to_string(),
                e.clone(),
            )
        })
        .collect();
    assert_eq!(
        env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.name"
    );
    assert_eq!(
        env["DYNAMO_NATS_URL"]["value"],
        "nats://nats.messaging:4222"
    );
    assert_eq!(env["DYNAMO_NAMESPACE"]["value"], "default");
    assert_eq!(
        c["ports"],
        json!([{"name": "http", "containerPort": 9000, "protocol": "TCP"}])
    );
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/health");
    assert_eq!(c["readinessProbe"]["httpGet"]["port"], "http");
    assert_eq!(c["volumeMounts"][0]["mountPath"], "/etc/dynamo");
    assert_eq!(fe["volumes"][0]["configMap"]["name"], "disagg-frontend");
    assert_eq!(fe["securityContext"]["runAsUser"], 10001);
    assert_eq!(fe["securityContext"]["runAsNonRoot"], true);
    // Workers have no HTTP port to probe.
    let w = &clique(&objs, "prefill")["spec"]["podSpec"]["containers"][0];
    assert!(w.get("readinessProbe").is_none() && w.get("ports").is_none());
    // The frontend's Service selects its pods by the clique's labels.
    let svc = objs
        .iter()
        .find(|o| o["kind"] == "Service")
        .expect("Service");
    assert_eq!(svc["metadata"]["name"], "disagg-frontend");
    assert_eq!(
        svc["spec"]["selector"],
        json!({"dynamo.nvidia.com/deployment": "disagg", "dynamo.nvidia.com/service": "frontend"})
    );
    let labels = &clique(&objs, "frontend")["labels"];
    for (k, v) in svc["spec"]["selector"].as_object().expect("selector") {
        assert_eq!(&labels[k], v);
    }
    assert_eq!(
        svc["spec"]["ports"],
        json!([{"name": "http", "port": 9000, "protocol": "TCP", "targetPort": "http"}])
    );
}

#[test]
fn resources_ask_for_gpus_and_memory() {
    let objs = render(DISAGG);
    let res =
        |name: &str| clique(&objs, name)["spec"]["podSpec"]["containers"][0]["resources"].clone();
    assert_eq!(
        res("prefill"),
        json!({"limits": {"nvidia.com/gpu": "1"}, "requests": {"memory": "2048Mi"}})
    );
    assert_eq!(res("decode"), json!({"limits": {"nvidia.com/gpu": "2"}}));
    // Frontends take no slots by default; slots: 0 asks for nothing.
    assert!(res("frontend").is_null());
    let agg = render(AGG);
    assert!(clique(&agg, "worker")["spec"]["podSpec"]["containers"][0]
        .get("resources")
        .is_none());
}

fn render_err(text: &str) -> RenderError {
    render_k8s(&parse(text), &RenderOptions::default()).expect_err("render fails")
}

#[test]
fn overlong_names_are_refused_naming_the_object() {
    // 40 + 8 characters: over Grove's 45 for the names of one pod.
    let long = "a".repeat(40);
    let e = render_err(&AGG.replace("name: agg", &format!("name: {long}")));
    match &e {
        RenderError::Name { object, .. } => assert!(object.contains("clique frontend"), "{e}"),
        other => panic!("{other}"),
    }
    assert!(e.to_string().contains("45"), "{e}");
    // Within 45, the longest names a valid spec composes fit in 63: a
    // deployment has at most 4096 replicas in all, so the group's and the
    // service's indices have at most 5 digits together (4095 and 0).
    let spec = |group: u32, svc: u32| {
        format!(
            "version: 1\nname: {}\nservices:\n  {}:\n    role: aggregated\n    replicas: {svc}\n    worker: {{engine: mocker}}\n\
             groups:\n  {}:\n    services: [{}]\n    replicas: {group}\n",
            "d".repeat(20),
            "s".repeat(13),
            "g".repeat(12),
            "s".repeat(13)
        )
    };
    assert!(render_k8s(&parse(&spec(4096, 1)), &RenderOptions::default()).is_ok());
    assert!(render_k8s(&parse(&spec(64, 64)), &RenderOptions::default()).is_ok());
    // 4096 × 4096 (whose names would not fit) is refused when applied.
    let e = parse(&spec(4096, 4096))
        .check_for_apply()
        .unwrap_err()
        .to_string();
    assert!(e.contains("16777216 replicas in all"), "{e}");
    // The composed names, checked directly.
    assert_eq!(
        names::pod_name("d-0-g-4095-s", 4095).len(),
        "d-0-g-4095-s-4095-xxxxx".len()
    );
}

#[test]
fn grove_refuses_zero_replicas() {
    let e = render_err(&AGG.replace("replicas: 2", "replicas: 0"));
    assert!(e.to_string().contains("services.worker.replicas"), "{e}");
    let e = render_err(&AGG.replace("replicas: 2", "replicas: 2\n    min_available: 0"));
    assert!(
        e.to_string().contains("services.worker.min_available"),
        "{e}"
    );
    let e = render_err(&DISAGG.replace("    replicas: 3\n    min_available: 2", "    replicas: 0"));
    assert!(e.to_string().contains("groups.pd.replicas"), "{e}");
}

#[test]
fn a_slot_budget_below_the_kubernetes_floor_is_refused() {
    // Valid for node daemons (minimum 0), but Grove keeps the group at one
    // replica: prefill's 2 × 1 slots and decode's 1 × 2.
    let planned = |budget: u32| {
        format!(
            "{DISAGG}planner:\n  slot_budget: {budget}\n  services: {{pd: {{min: 0, max: 4}}}}\n"
        )
    };
    let e = render_err(&planned(3));
    assert!(e.to_string().contains("planner.slot_budget"), "{e}");
    assert!(e.to_string().contains("4 slots"), "{e}");
    assert!(render_k8s(&parse(&planned(4)), &RenderOptions::default()).is_ok());
}

#[test]
fn bad_options_are_refused() {
    let spec = parse(AGG);
    type Edit = fn(&mut RenderOptions);
    let cases: [(&str, Edit); 6] = [
        ("image", |o| o.image.clear()),
        ("namespace", |o| o.namespace = "Prod".into()),
        ("nats_url", |o| o.nats_url = "http://nats:4222".into()),
        ("dynamo_namespace", |o| o.dynamo_namespace = "a.b".into()),
        ("topology_name", |o| o.topology_name.clear()),
        ("scheduler_name", |o| o.scheduler_name = Some("Kai".into())),
    ];
    for (field, edit) in cases {
        let mut opts = RenderOptions::default();
        edit(&mut opts);
        let e = render_k8s(&spec, &opts).expect_err(field);
        assert!(e.to_string().contains(&format!("`{field}`")), "{e}");
    }
    let e = render_err(&DISAGG.replace("127.0.0.1:9000", "127.0.0.1"));
    assert!(
        e.to_string().contains("services.frontend.gateway.listen"),
        "{e}"
    );
}

#[test]
fn rendering_is_deterministic() {
    let a = to_yaml_documents(&render(DISAGG)).expect("yaml");
    let b = to_yaml_documents(&render(DISAGG)).expect("yaml");
    assert_eq!(a, b);
    assert!(a.starts_with("---\n"));
    assert_eq!(a.matches("\n---\n").count() + 1, render(DISAGG).len());
}

#[test]
fn the_connector_scales_the_rendered_objects() {
    let spec = parse(DISAGG);
    let objs = render(DISAGG);
    // A group scales through its PodCliqueScalingGroup.
    let t = ScaleTarget::for_spec(&spec, "pd").expect("group");
    assert_eq!(
        t,
        ScaleTarget {
            kind: ScaleKind::PodCliqueScalingGroup,
            name: "disagg-0-pd".into()
        }
    );
    let req = scale_request("default", &t, 5, None).expect("request");
    assert_eq!(req.method(), http::Method::PATCH);
    assert_eq!(
        req.uri().path(),
        "/apis/grove.io/v1alpha1/namespaces/default/podcliquescalinggroups/disagg-0-pd"
    );
    assert_eq!(
        req.headers()[http::header::CONTENT_TYPE],
        "application/merge-patch+json"
    );
    assert_eq!(
        serde_json::from_slice::<Value>(req.body()).expect("json"),
        json!({"spec": {"replicas": 5}})
    );
    // A standalone service through its PodClique.
    let t = ScaleTarget::for_spec(&spec, "frontend").expect("service");
    assert_eq!(
        t,
        ScaleTarget {
            kind: ScaleKind::PodClique,
            name: "disagg-0-frontend".into()
        }
    );
    assert_eq!(
        scale_request("default", &t, 1, None)
            .expect("request")
            .uri()
            .path(),
        "/apis/grove.io/v1alpha1/namespaces/default/podcliques/disagg-0-frontend"
    );
    // Group members scale with their group; unknown targets are named.
    let e = ScaleTarget::for_spec(&spec, "prefill")
        .expect_err("member")
        .to_string();
    assert!(
        e.contains("\"prefill\"") && e.contains("scaling group pd"),
        "{e}"
    );
    let e = ScaleTarget::for_spec(&spec, "nope")
        .expect_err("unknown")
        .to_string();
    assert!(e.contains("no service or group"), "{e}");
    // They are the names Grove gives the rendered PCS's children.
    let p = pcs(&objs);
    let group = &p["spec"]["template"]["podCliqueScalingGroups"][0]["name"];
    assert_eq!(
        ScaleTarget::for_spec(&spec, "pd").expect("group").name,
        format!(
            "{}-0-{}",
            p["metadata"]["name"].as_str().unwrap_or_default(),
            group.as_str().unwrap_or_default()
        )
    );
}

#[test]
fn node_selectors_become_the_pods_node_selector() {
    let objs = render(&DISAGG.replace(
        "role: prefill\n",
        "role: prefill\n    node_selector: {gpu: h200}\n",
    ));
    assert_eq!(
        clique(&objs, "prefill")["spec"]["podSpec"]["nodeSelector"],
        json!({"gpu": "h200"})
    );
    assert!(clique(&objs, "decode")["spec"]["podSpec"]
        .get("nodeSelector")
        .is_none());
}

/// The objects Grove makes from the rendered PodCliqueSet, as the API
/// server returns them with a status, pass their CRDs' schemas (strict:
/// no field the CRD does not name), and the connector reads their
/// replicas back.
#[test]
fn the_connector_reads_back_what_grove_reports() {
    let spec = parse(DISAGG);
    let objs = render(DISAGG);
    let p = pcs(&objs);
    let pcs_name = p["metadata"]["name"]
        .as_str()
        .expect("pcs name")
        .to_string();
    let tpl = &p["spec"]["template"];
    // The scaling group, 2 of 3 replicas available, Grove behind by one
    // generation (a patch it has not reconciled yet).
    let g = &tpl["podCliqueScalingGroups"][0];
    let group = g["name"].as_str().expect("group name");
    let t = ScaleTarget::for_spec(&spec, group).expect("group target");
    let obj = json!({
        "apiVersion": "grove.io/v1alpha1",
        "kind": "PodCliqueScalingGroup",
        "metadata": {"name": t.name, "namespace": "default", "generation": 5},
        "spec": {"replicas": 3, "cliqueNames": g["cliqueNames"], "minAvailable": 1},
        "status": {"replicas": 3, "availableReplicas": 2, "scheduledReplicas": 3,
                   "updatedReplicas": 3, "observedGeneration": 4},
    });
    assert_valid_grove(&obj);
    assert_eq!(
        observed_scale(&t, &obj).expect("group read back"),
        ObservedScale {
            desired: 3,
            ready: 2
        }
    );
    // A standalone clique (the frontend), its spec the template's.
    let c = tpl["cliques"]
        .as_array()
        .expect("cliques")
        .iter()
        .find(|c| c["name"] == "frontend")
        .expect("frontend clique");
    let t = ScaleTarget::for_spec(&spec, "frontend").expect("service target");
    assert_eq!(t.name, format!("{pcs_name}-0-frontend"));
    let mut clique_spec = c["spec"].clone();
    clique_spec["replicas"] = json!(2);
    let obj = json!({
        "apiVersion": "grove.io/v1alpha1",
        "kind": "PodClique",
        "metadata": {"name": t.name, "namespace": "default", "generation": 2},
        "spec": clique_spec,
        "status": {"replicas": 2, "readyReplicas": 1, "scheduledReplicas": 2,
                   "scheduleGatedReplicas": 0, "updatedReplicas": 2, "observedGeneration": 2},
    });
    assert_valid_grove(&obj);
    assert_eq!(
        observed_scale(&t, &obj).expect("clique read back"),
        ObservedScale {
            desired: 2,
            ready: 1
        }
    );
    // It is read from where the patch goes.
    let get = get_request("default", &t).expect("get");
    assert_eq!(get.method(), http::Method::GET);
    assert_eq!(
        get.uri().path(),
        scale_request("default", &t, 1, None)
            .expect("patch")
            .uri()
            .path()
    );
}
