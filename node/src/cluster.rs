//! `dynamoctl apply|get|describe|scale|delete`: the desired state of
//! deployments in JetStream KV, and what the placement controller reports.
//!
//! Invariants: a spec is stored only once it parses into checked types and
//! every service's settings pass the node's own validation (errors name the
//! spec's field); every change bumps the deployment's generation and is
//! written by compare-and-set on the entry's revision, so two concurrent
//! changes never lose one another (the loser retries on the new state).

use crate::config::check_spec_settings;
use dynamo_bus_schema::{
    encode, unix_ms, DeploymentRecord, DeploymentStatus, Namespace, PlannerPin,
};
use dynamo_cluster_config::spec::DeploymentSpec;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

/// Largest spec file read (a deployment record must fit one bus message).
pub const MAX_SPEC_BYTES: u64 = 256 * 1024;

/// Reads and checks a spec file, or standard input for `-` (no bus needed).
pub fn load_spec(path: &Path) -> anyhow::Result<DeploymentSpec> {
    // `-`: the spec comes on standard input (bounded: a spec is small).
    let text = if path == Path::new("-") {
        use std::io::Read;
        let mut text = String::new();
        std::io::stdin()
            .take(MAX_SPEC_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(|e| anyhow::anyhow!("cannot read the spec from standard input: {e}"))?;
        text
    } else {
        std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?
    };
    anyhow::ensure!(
        text.len() as u64 <= MAX_SPEC_BYTES,
        "{}: a spec is at most {MAX_SPEC_BYTES} bytes",
        path.display()
    );
    let spec =
        DeploymentSpec::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    check_spec_settings(&spec).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    spec.check_for_apply()
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    check_planner_bounds(&spec).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    Ok(spec)
}

/// A planner target's replicas in a spec being applied are within the
/// planner's bounds: outside them the planner would change them at once.
/// (Checked where a spec is applied, not on stored specs: a manual scale
/// may take a pinned target past them.)
fn check_planner_bounds(spec: &DeploymentSpec) -> anyhow::Result<()> {
    let Some(p) = &spec.planner else {
        return Ok(());
    };
    for (t, l) in &p.targets {
        let Some(r) = spec.target_replicas(t) else {
            continue;
        };
        if r < l.min || r > l.max {
            let kind = if spec.group(t).is_some() {
                "groups"
            } else {
                "services"
            };
            anyhow::bail!(
                "deployment spec field `{kind}.{t}.replicas`: {r} is outside the planner's {}-{} (planner.services.{t}), so the planner would change it at once",
                l.min,
                l.max
            );
        }
    }
    Ok(())
}

struct Store {
    deployments: async_nats::jetstream::kv::Store,
    status: async_nats::jetstream::kv::Store,
    pins: async_nats::jetstream::kv::Store,
    planner: async_nats::jetstream::kv::Store,
}

/// The namespace's desired state; `existing`: only where the namespace
/// has state already (every command but `apply`).
async fn open(url: &str, ns: Namespace, existing: bool) -> anyhow::Result<Store> {
    let bus = if existing {
        crate::access::cli_connect_existing(url, ns).await?
    } else {
        crate::access::cli_connect(url, ns).await?
    };
    let s = &bus.subjects;
    Ok(Store {
        deployments: bus.kv_bucket_durable(&s.deployments_bucket()).await?,
        status: bus.kv_bucket_durable(&s.deploy_status_bucket()).await?,
        pins: bus.kv_bucket_durable(&s.pins_bucket()).await?,
        planner: bus.kv_bucket_durable(&s.planner_bucket()).await?,
    })
}

use dynamo_controller::desired::{record, write};

/// `apply -f SPEC`: stores the checked spec as the deployment's desired state.
pub async fn apply(url: &str, ns: Namespace, path: &Path) -> anyhow::Result<Value> {
    let spec = load_spec(path)?;
    let store = open(url, ns, false).await?;
    for _ in 0..5 {
        let prev = record(&store.deployments, &spec.name).await?;
        let unchanged = prev
            .as_ref()
            .is_some_and(|(r, _)| DeploymentSpec::parse(&r.spec_yaml).ok().as_ref() == Some(&spec));
        if unchanged {
            // The pins follow it too (an apply whose re-pin failed, again).
            repin(&store, &spec).await?;
            let generation = prev.map(|(r, _)| r.generation).unwrap_or(0);
            return Ok(
                json!({"deployment": spec.name, "generation": generation, "changed": false}),
            );
        }
        if let Ok(generation) = write(&store.deployments, &spec, prev).await {
            repin(&store, &spec).await?;
            return Ok(json!({"deployment": spec.name, "generation": generation, "changed": true}));
        }
    }
    anyhow::bail!("deployment {} kept changing under us; try again", spec.name)
}

/// The pins of deployment `name`, by key.
async fn pins_of(store: &Store, name: &str) -> anyhow::Result<BTreeMap<String, PlannerPin>> {
    let all: BTreeMap<String, PlannerPin> = dynamo_controller::read_all(&store.pins)
        .await
        .map_err(|e| anyhow::anyhow!("reading the pins: {e}"))?;
    Ok(all
        .into_iter()
        .filter(|(_, p)| p.deployment == name)
        .collect())
}

/// After an apply, the deployment's pins say what the applied spec asks
/// (the operator's latest word on replicas); a pin of a target the spec no
/// longer has goes. Pinned targets stay pinned.
async fn repin(store: &Store, spec: &DeploymentSpec) -> anyhow::Result<()> {
    for (key, mut pin) in pins_of(store, &spec.name).await? {
        match spec.target_replicas(&pin.target) {
            Some(r) if r == pin.replicas => {}
            Some(r) => {
                pin.replicas = r;
                pin.unix_ms = unix_ms();
                store
                    .pins
                    .put(key.clone(), encode(&pin)?.into())
                    .await
                    .map_err(|e| anyhow::anyhow!("updating pin {key}: {e}"))?;
            }
            None => {
                store
                    .pins
                    .purge(&key)
                    .await
                    .map_err(|e| anyhow::anyhow!("removing pin {key}: {e}"))?;
            }
        }
    }
    Ok(())
}

/// Splits `NAME/SERVICE` (or `deployment/NAME/SERVICE`).
pub fn parse_target(target: &str) -> anyhow::Result<(String, String)> {
    let t = target.strip_prefix("deployment/").unwrap_or(target);
    match t.split_once('/') {
        Some((d, s)) if !d.is_empty() && !s.is_empty() && !s.contains('/') => {
            Ok((d.to_string(), s.to_string()))
        }
        _ => anyhow::bail!("{target:?}: name it as DEPLOYMENT/SERVICE (or DEPLOYMENT/GROUP)"),
    }
}

/// `scale DEPLOYMENT/SERVICE N`.
pub async fn scale(url: &str, ns: Namespace, target: &str, replicas: u32) -> anyhow::Result<Value> {
    let store = open(url, ns, true).await?;
    let (name, service) = match parse_target(target) {
        Ok(t) => t,
        // `deployment/SERVICE` (or `SERVICE`): the one deployment that has it.
        Err(e) => {
            let svc = target.strip_prefix("deployment/").unwrap_or(target);
            let recs: BTreeMap<String, DeploymentRecord> =
                dynamo_controller::read_all(&store.deployments)
                    .await
                    .map_err(|e| anyhow::anyhow!(e))?;
            let owners: Vec<&String> = recs
                .iter()
                .filter(|(_, r)| {
                    DeploymentSpec::parse(&r.spec_yaml)
                        .is_ok_and(|s| s.service(svc).is_some() || s.group(svc).is_some())
                })
                .map(|(n, _)| n)
                .collect();
            match owners.as_slice() {
                [one] => ((*one).clone(), svc.to_string()),
                [] => return Err(e),
                many => anyhow::bail!(
                    "{svc:?} is in {} deployments ({}): name one as DEPLOYMENT/{svc}",
                    many.len(),
                    many.iter()
                        .map(|s| s.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            }
        }
    };
    // A manual scale pins the target: the planner leaves it alone until
    // `dynamoctl planner release`. The pin goes first, so the planner cannot
    // override the new value in between; a scale that fails takes it back.
    let pin = PlannerPin {
        deployment: name.clone(),
        target: service.clone(),
        replicas,
        unix_ms: unix_ms(),
    };
    let key = format!("{name}.{service}");
    store
        .pins
        .put(key.clone(), encode(&pin)?.into())
        .await
        .map_err(|e| anyhow::anyhow!("cannot pin {name}/{service}: {e}"))?;
    let pinned = true;
    let (generation, changed) = match dynamo_controller::desired::scale(
        &store.deployments,
        &name,
        &service,
        replicas,
    )
    .await
    {
        Ok(x) => x,
        Err(e) => {
            let _ = store.pins.delete(&key).await;
            return Err(e.into());
        }
    };
    // Whether a planner would size it otherwise (what the pin holds off).
    let planner = record(&store.deployments, &name)
        .await?
        .and_then(|(r, _)| DeploymentSpec::parse(&r.spec_yaml).ok())
        .is_some_and(|s| s.planner.is_some_and(|p| p.targets.contains_key(&service)));
    // How long since a controller last reported on it (None: never).
    let status_age_ms = match store.status.entry(&name).await {
        Ok(Some(e)) if e.operation == async_nats::jetstream::kv::Operation::Put => {
            dynamo_bus_schema::decode::<DeploymentStatus>(&e.value)
                .ok()
                .map(|s| unix_ms().saturating_sub(s.updated_unix_ms))
        }
        _ => None,
    };
    Ok(
        json!({"deployment": name, "target": service, "replicas": replicas, "generation": generation, "changed": changed, "pinned": pinned, "planner": planner, "status_age_ms": status_age_ms}),
    )
}

/// `delete deployment NAME`: its replicas drain and stop.
pub async fn delete(url: &str, ns: Namespace, name: &str) -> anyhow::Result<Value> {
    let store = open(url, ns, true).await?;
    if record(&store.deployments, name).await?.is_none() {
        anyhow::bail!("no deployment {name:?} (see dynamoctl get deployments)");
    }
    store.deployments.delete(name).await?;
    // What was said about it goes with it: a deployment applied later
    // under this name starts with no pins and a planner with no memory.
    for key in pins_of(&store, name).await?.into_keys() {
        store
            .pins
            .purge(&key)
            .await
            .map_err(|e| anyhow::anyhow!("removing pin {key}: {e}"))?;
    }
    store
        .planner
        .purge(format!("status.{name}"))
        .await
        .map_err(|e| anyhow::anyhow!("removing the planner's status of {name}: {e}"))?;
    Ok(json!({"deployment": name, "deleted": true}))
}

async fn statuses(store: &Store) -> anyhow::Result<BTreeMap<String, DeploymentStatus>> {
    dynamo_controller::read_all(&store.status)
        .await
        .map_err(|e| anyhow::anyhow!(e))
}

fn status_json(rec: &DeploymentRecord, st: Option<&DeploymentStatus>) -> Value {
    let services: Vec<Value> = st
        .map(|s| {
            s.services
                .iter()
                .map(|x| {
                    json!({
                        "name": x.name, "role": x.role, "desired": x.desired,
                        "placed": x.placed, "ready": x.ready, "pending": x.pending,
                        "placements": x.placements.iter().map(|(k, n)| json!({"replica": k, "node": n})).collect::<Vec<_>>(),
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    let ready = st.is_some_and(|s| s.services.iter().all(|x| x.ready == x.desired));
    json!({
        "name": rec.name,
        "generation": rec.generation,
        "observed_generation": st.map(|s| s.generation),
        "ready": ready && st.is_some_and(|s| s.generation == rec.generation),
        "services": services,
        "events": st.map(|s| s.events.iter().map(|e| json!({"unix_ms": e.unix_ms, "time": crate::time::rfc3339(e.unix_ms), "message": e.message})).collect::<Vec<_>>()).unwrap_or_default(),
        "controller": st.map(|s| s.controller.0.clone()),
        "status_age_ms": st.map(|s| unix_ms().saturating_sub(s.updated_unix_ms)),
    })
}

/// `get deployments`.
pub async fn get(url: &str, ns: Namespace) -> anyhow::Result<Value> {
    let store = open(url, ns, true).await?;
    let recs: BTreeMap<String, DeploymentRecord> = dynamo_controller::read_all(&store.deployments)
        .await
        .map_err(|e| anyhow::anyhow!(e))?;
    let st = statuses(&store).await?;
    Ok(Value::Array(
        recs.values()
            .map(|r| status_json(r, st.get(&r.name)))
            .collect(),
    ))
}

/// `describe deployment NAME`.
pub async fn describe(url: &str, ns: Namespace, name: &str) -> anyhow::Result<Value> {
    let store = open(url, ns, true).await?;
    let Some((rec, _)) = record(&store.deployments, name).await? else {
        anyhow::bail!("no deployment {name:?} (see dynamoctl get deployments)");
    };
    let st = statuses(&store).await?;
    Ok(status_json(&rec, st.get(name)))
}

/// A status older than this says no controller is running: a live one
/// refreshes every deployment's status at least every 5 s.
pub const STALE_STATUS_MS: u64 = 15_000;

/// How long since the controller last reported on the deployment `d`
/// (status JSON), when that is long enough to mean none is running.
fn stale_for(d: &Value) -> Option<f64> {
    d["status_age_ms"]
        .as_u64()
        .filter(|a| *a > STALE_STATUS_MS)
        .map(|a| a as f64 / 1000.0)
}

/// `get deployments` as a table.
pub fn render_list(v: &Value) -> String {
    let mut out = format!(
        "{:<24} {:>14} {:>8} {:>8}  {}\n",
        "NAME", "GENERATION", "READY", "DESIRED", "STATUS"
    );
    for d in v.as_array().into_iter().flatten() {
        let sum = |k: &str| -> u64 {
            d["services"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|s| s[k].as_u64().unwrap_or(0))
                .sum()
        };
        let state = if let Some(s) = stale_for(d) {
            format!("unknown: no controller has reported for {s:.0} s")
        } else if d["ready"].as_bool() == Some(true) {
            "ready".to_string()
        } else if d["observed_generation"].is_null() {
            "waiting for a controller".to_string()
        } else {
            "pending".to_string()
        };
        out.push_str(&format!(
            "{:<24} {:>14} {:>8} {:>8}  {}\n",
            d["name"].as_str().unwrap_or(""),
            d["generation"].as_u64().unwrap_or(0).to_string(),
            sum("ready"),
            sum("desired"),
            state
        ));
    }
    out
}

/// `describe deployment NAME` for people.
pub fn render_describe(d: &Value) -> String {
    let mut out = format!(
        "deployment {}  generation {} (controller saw {}), controller {}\n\n",
        d["name"].as_str().unwrap_or(""),
        d["generation"],
        d["observed_generation"],
        d["controller"].as_str().unwrap_or("none yet"),
    );
    if let Some(s) = stale_for(d) {
        out.push_str(&format!(
            "STALE: no controller has reported for {s:.0} s (is one running?); what follows is its last report\n\n"
        ));
    }
    out.push_str(&format!(
        "{:<16} {:<11} {:>7} {:>6} {:>5}\n",
        "SERVICE", "ROLE", "DESIRED", "PLACED", "READY"
    ));
    for s in d["services"].as_array().into_iter().flatten() {
        let n = |k: &str| s[k].as_u64().unwrap_or(0).to_string();
        out.push_str(&format!(
            "{:<16} {:<11} {:>7} {:>6} {:>5}\n",
            s["name"].as_str().unwrap_or(""),
            s["role"].as_str().unwrap_or(""),
            n("desired"),
            n("placed"),
            n("ready")
        ));
        for p in s["placements"].as_array().into_iter().flatten() {
            out.push_str(&format!(
                "    {} on {}\n",
                p["replica"].as_str().unwrap_or(""),
                p["node"].as_str().unwrap_or("")
            ));
        }
        for why in s["pending"].as_array().into_iter().flatten() {
            out.push_str(&format!("    pending: {}\n", why.as_str().unwrap_or("")));
        }
    }
    out.push_str("\nevents:\n");
    let now = unix_ms();
    for e in d["events"].as_array().into_iter().flatten() {
        let at = e["unix_ms"].as_u64().unwrap_or(now);
        let ago = now.saturating_sub(at) as f64 / 1000.0;
        out.push_str(&format!(
            "  {}  ({ago:.1} s ago)  {}\n",
            crate::time::rfc3339(at),
            e["message"].as_str().unwrap_or("")
        ));
    }
    out
}

/// Waits until the deployment is ready (every service's ready = desired,
/// at the current generation), or fails after `within` with what is pending.
pub async fn wait_ready(
    url: &str,
    ns: Namespace,
    name: &str,
    within: Duration,
) -> anyhow::Result<Value> {
    let t0 = std::time::Instant::now();
    loop {
        let d = describe(url, ns.clone(), name).await?;
        if d["ready"].as_bool() == Some(true) {
            return Ok(d);
        }
        if t0.elapsed() > within {
            anyhow::bail!(
                "deployment {name} not ready after {within:?}:\n{}",
                render_describe(&d)
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replicas_outside_the_planners_bounds_are_refused_at_apply() {
        let spec = |replicas: u32| {
            dynamo_cluster_config::spec::DeploymentSpec::parse(&format!(
                "version: 1\nname: d\nservices:\n  w: {{role: aggregated, replicas: {replicas}, worker: {{engine: mocker}}}}\nplanner:\n  services: {{w: {{min: 1, max: 2}}}}\n"
            ))
            .unwrap()
        };
        assert!(super::check_planner_bounds(&spec(2)).is_ok());
        let e = super::check_planner_bounds(&spec(3))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`services.w.replicas`: 3 is outside the planner's 1-2"),
            "{e}"
        );
    }

    #[test]
    fn example_specs_are_valid() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../cluster-config/examples");
        let mut n = 0;
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "yaml") {
                load_spec(&p).unwrap_or_else(|e| panic!("{e}"));
                n += 1;
            }
        }
        assert!(n >= 5, "{n} example specs");
    }

    #[test]
    fn spec_settings_errors_name_the_field() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s.yaml");
        let spec = "version: 1\nname: d\nservices:\n  w:\n    role: decode\n    worker: {engine: mocker, mocker: {speedup: -1}}\n";
        std::fs::write(&p, spec).unwrap();
        let e = load_spec(&p).unwrap_err().to_string();
        assert!(e.contains("services.w.worker.mocker"), "{e}");
        std::fs::write(&p, spec.replace("mocker: {speedup: -1}", "bogus: 1")).unwrap();
        let e = load_spec(&p).unwrap_err().to_string();
        assert!(
            e.contains("services.w.worker") && e.contains("bogus"),
            "{e}"
        );
        let f = "version: 1\nname: d\nservices:\n  f:\n    role: frontend\n    gateway: {listen: nope}\n";
        std::fs::write(&p, f).unwrap();
        let e = load_spec(&p).unwrap_err().to_string();
        assert!(e.contains("services.f.gateway.listen"), "{e}");
    }

    #[test]
    fn targets_name_a_deployment_and_a_service() {
        assert_eq!(
            parse_target("d/decode").unwrap(),
            ("d".into(), "decode".into())
        );
        assert_eq!(
            parse_target("deployment/d/decode").unwrap(),
            ("d".into(), "decode".into())
        );
        for bad in ["decode", "d/", "/x", "a/b/c"] {
            assert!(parse_target(bad).is_err(), "{bad}");
        }
    }
}
