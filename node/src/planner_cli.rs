//! `dynamoctl planner status|release`: what each deployment's planner
//! decided and why (the numbers behind each decision), and handing a
//! manually scaled (pinned) service back to the planner.

use dynamo_bus_schema::{decode, unix_ms, DeploymentRecord, Namespace, PlannerPin, PlannerStatus};
use serde_json::{json, Value};
use std::collections::BTreeMap;

struct Store {
    deployments: async_nats::jetstream::kv::Store,
    planner: async_nats::jetstream::kv::Store,
    pins: async_nats::jetstream::kv::Store,
}

async fn open(url: &str, ns: Namespace) -> anyhow::Result<Store> {
    let bus = crate::access::cli_connect_existing(url, ns).await?;
    let s = &bus.subjects;
    Ok(Store {
        deployments: bus.kv_bucket_durable(&s.deployments_bucket()).await?,
        planner: bus.kv_bucket_durable(&s.planner_bucket()).await?,
        pins: bus.kv_bucket_durable(&s.pins_bucket()).await?,
    })
}

fn status_json(name: &str, st: Option<&PlannerStatus>, pins: &[&PlannerPin]) -> Value {
    let pins: Vec<Value> = pins
        .iter()
        .map(|p| json!({"target": p.target, "replicas": p.replicas, "unix_ms": p.unix_ms, "time": crate::time::rfc3339(p.unix_ms)}))
        .collect();
    let Some(s) = st else {
        return json!({"deployment": name, "planner": null, "pins": pins});
    };
    json!({
        "deployment": name,
        "planner": s.holder.0,
        "epoch": s.epoch,
        "policy": s.policy,
        "updated_ms_ago": unix_ms().saturating_sub(s.updated_unix_ms),
        "targets": s.targets.iter().map(|t| json!({
            "name": t.name, "desired": t.desired, "ready": t.ready,
            "recommended": t.recommended, "pinned": t.pinned, "reason": t.reason,
            "numbers": t.numbers.iter().cloned().collect::<BTreeMap<String, f64>>(),
        })).collect::<Vec<_>>(),
        "decisions": s.decisions.iter().map(|d| json!({
            "seq": d.seq, "unix_ms": d.unix_ms, "time": crate::time::rfc3339(d.unix_ms), "target": d.target, "from": d.from,
            "to": d.to, "rule": d.rule, "reason": d.reason, "applied": d.applied,
        })).collect::<Vec<_>>(),
        "pins": pins,
    })
}

/// `planner status [DEPLOYMENT]`: one deployment, or every one with a planner.
pub async fn status(url: &str, ns: Namespace, name: Option<&str>) -> anyhow::Result<Value> {
    let store = open(url, ns).await?;
    let recs: BTreeMap<String, DeploymentRecord> = dynamo_controller::read_all(&store.deployments)
        .await
        .map_err(|e| anyhow::anyhow!(e))?;
    let pins: BTreeMap<String, PlannerPin> = dynamo_controller::read_all(&store.pins)
        .await
        .map_err(|e| anyhow::anyhow!(e))?;
    let names: Vec<String> = match name {
        Some(n) => {
            if !recs.contains_key(n) {
                anyhow::bail!("no deployment {n:?} (see dynamoctl get deployments)");
            }
            vec![n.to_string()]
        }
        None => recs
            .iter()
            .filter(|(_, r)| r.spec_yaml.contains("\nplanner:"))
            .map(|(n, _)| n.clone())
            .collect(),
    };
    let mut out = Vec::new();
    for n in names {
        let st = match store.planner.entry(format!("status.{n}")).await? {
            Some(e) if e.operation == async_nats::jetstream::kv::Operation::Put => {
                Some(decode::<PlannerStatus>(&e.value)?)
            }
            _ => None,
        };
        let mine: Vec<&PlannerPin> = pins.values().filter(|p| p.deployment == n).collect();
        out.push(status_json(&n, st.as_ref(), &mine));
    }
    Ok(Value::Array(out))
}

/// `planner release DEPLOYMENT/TARGET`: the planner scales it again.
pub async fn release(url: &str, ns: Namespace, target: &str) -> anyhow::Result<Value> {
    let (dep, svc) = crate::cluster::parse_target(target)?;
    let store = open(url, ns).await?;
    let spec = match store.deployments.entry(&dep).await? {
        Some(e) if e.operation == async_nats::jetstream::kv::Operation::Put => {
            let rec: DeploymentRecord = decode(&e.value)?;
            dynamo_cluster_config::spec::DeploymentSpec::parse(&rec.spec_yaml)?
        }
        _ => anyhow::bail!("no deployment {dep:?} (see dynamoctl get deployments)"),
    };
    if spec.target_replicas(&svc).is_none() {
        anyhow::bail!("deployment {dep} has no service or group {svc:?}");
    }
    let key = format!("{dep}.{svc}");
    match store.pins.entry(&key).await? {
        Some(e) if e.operation == async_nats::jetstream::kv::Operation::Put => {}
        _ => anyhow::bail!("{dep}/{svc} is not pinned (a manual `dynamoctl scale` pins it)"),
    }
    store.pins.delete(&key).await?;
    let planner = spec.planner.is_some_and(|p| p.targets.contains_key(&svc));
    Ok(json!({"deployment": dep, "target": svc, "released": true, "planner": planner}))
}

/// The text form of `planner status`.
pub fn render(v: &Value) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    for d in v.as_array().into_iter().flatten() {
        let name = d["deployment"].as_str().unwrap_or("?");
        match d["planner"].as_str() {
            None => {
                let _ = writeln!(out, "deployment {name}: no planner has reported");
            }
            Some(holder) => {
                let _ = writeln!(
                    out,
                    "deployment {name}: planner on {holder} (epoch {}, policy {}), updated {:.1} s ago",
                    d["epoch"],
                    d["policy"].as_str().unwrap_or("?"),
                    d["updated_ms_ago"].as_u64().unwrap_or(0) as f64 / 1000.0
                );
            }
        }
        let _ = writeln!(
            out,
            "  {:<16} {:>7} {:>5} {:>11} {:>6}  WHY",
            "TARGET", "DESIRED", "READY", "RECOMMENDED", "PINNED"
        );
        for t in d["targets"].as_array().into_iter().flatten() {
            let _ = writeln!(
                out,
                "  {:<16} {:>7} {:>5} {:>11} {:>6}  {}",
                t["name"].as_str().unwrap_or("?"),
                t["desired"],
                t["ready"],
                t["recommended"],
                if t["pinned"] == true { "yes" } else { "" },
                t["reason"].as_str().unwrap_or("")
            );
            if let Some(n) = t["numbers"].as_object() {
                let nums: Vec<String> = n
                    .iter()
                    .map(|(k, v)| format!("{k}={:.3}", v.as_f64().unwrap_or(0.0)))
                    .collect();
                let _ = writeln!(out, "  {:<16} {}", "", nums.join(" "));
            }
        }
        let decisions = d["decisions"].as_array().cloned().unwrap_or_default();
        if !decisions.is_empty() {
            let _ = writeln!(out, "  recent decisions:");
            for x in decisions.iter().rev().take(10) {
                let _ = writeln!(
                    out,
                    "    #{} {} {} {} → {} ({}{}): {}",
                    x["seq"],
                    x["time"].as_str().unwrap_or("?"),
                    x["target"].as_str().unwrap_or("?"),
                    x["from"],
                    x["to"],
                    x["rule"].as_str().unwrap_or("?"),
                    if x["applied"] == true {
                        ""
                    } else {
                        ", not applied"
                    },
                    x["reason"].as_str().unwrap_or("")
                );
            }
        }
        for p in d["pins"].as_array().into_iter().flatten() {
            let _ = writeln!(
                out,
                "  pinned: {} at {} (dynamoctl planner release {name}/{})",
                p["target"].as_str().unwrap_or("?"),
                p["replicas"],
                p["target"].as_str().unwrap_or("?")
            );
        }
    }
    if out.is_empty() {
        out.push_str("no deployment has a planner\n");
    }
    out
}
