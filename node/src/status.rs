//! `dynamoctl status`: nodes, workers, models and load, read from the
//! registry buckets on the bus.

use dynamo_bus_schema::{
    unix_ms, Namespace, NodeInventory, NodeRegistration, RouterInfo, RouterInfoRequest,
    WorkerRegistration,
};
use dynamo_runtime::bus::REGISTRY_MAX_AGE;
use dynamo_runtime::Bus;
use serde_json::{json, Value};
use std::collections::BTreeMap;

/// Finds the bus: `--nats`, `$DYNAMO_NATS_URL`, or the URL a local node with
/// embedded NATS published for this namespace.
pub fn resolve_nats_url(flag: Option<String>, ns: &Namespace) -> anyhow::Result<String> {
    if let Some(u) = flag {
        return Ok(u);
    }
    if let Ok(u) = std::env::var(crate::env::NATS_URL) {
        return Ok(u);
    }
    let f = crate::env::state_dir().join(format!("{}.nats-url", ns.as_str()));
    std::fs::read_to_string(&f)
        .map(|s| s.trim().to_string())
        .map_err(|_| {
            anyhow::anyhow!(
            "no NATS URL: pass --nats, set ${}, or start a node with embedded NATS (looked for {})",
            crate::env::NATS_URL,
            f.display()
        )
        })
}

/// The entries of a bucket holding several kinds: those of `T`, decoded
/// (undecodable ones are counted and skipped; other kinds are ignored).
/// Keys come from the stream's subjects, so a read ends while the bucket
/// is being written (heartbeats write it all the time).
async fn read_bucket<T: dynamo_bus_schema::WireMessage>(
    bus: &Bus,
    bucket: &str,
) -> anyhow::Result<Vec<T>> {
    let kv = bus.kv_bucket(bucket, REGISTRY_MAX_AGE).await?;
    dynamo_controller::read_all::<T>(&kv)
        .await
        .map(|m| m.into_values().collect())
        .map_err(|e| anyhow::anyhow!("reading {bucket}: {e}"))
}

/// Collects the cluster's status as JSON.
pub async fn collect(url: &str, ns: Namespace) -> anyhow::Result<Value> {
    let bus = crate::access::cli_connect_existing(url, ns.clone()).await?;
    // A node of a cluster (`--join`) writes its inventory; others their registration.
    let inventories: Vec<NodeInventory> = read_bucket(&bus, &bus.subjects.nodes_bucket()).await?;
    let mut nodes: Vec<NodeRegistration> = read_bucket(&bus, &bus.subjects.nodes_bucket()).await?;
    nodes.extend(inventories.iter().map(|i| i.registration.clone()));
    nodes.sort_by(|a, b| a.node_id.0.cmp(&b.node_id.0));
    let workers: Vec<WorkerRegistration> =
        read_bucket(&bus, &bus.subjects.workers_bucket()).await?;
    // Any router's view of its KV index (optional: none may be running).
    let info: Option<RouterInfo> = bus
        .request(
            bus.subjects.router_info(),
            &RouterInfoRequest {},
            std::time::Duration::from_secs(2),
        )
        .await
        .ok();
    let now = unix_ms();
    let stale_after = 3_000;
    let mut models: BTreeMap<String, Value> = BTreeMap::new();
    // The KV block configuration each model's earliest worker uses.
    let mut reference: BTreeMap<&str, (u64, u32, u64)> = BTreeMap::new();
    for w in &workers {
        let e = reference.entry(w.model.name.0.as_str()).or_insert((
            w.started_unix_ms,
            w.model.block_size,
            w.model.hash_salt,
        ));
        if w.started_unix_ms < e.0 {
            *e = (w.started_unix_ms, w.model.block_size, w.model.hash_salt);
        }
    }
    let workers_json: Vec<Value> = workers
        .iter()
        .map(|w| {
            let age = now.saturating_sub(w.heartbeat_unix_ms);
            let stale = age > stale_after;
            let m = models.entry(w.model.name.0.clone()).or_insert_with(|| {
                json!({"name": w.model.name.0, "context_length": w.model.context_length,
                       "block_size": w.model.block_size, "workers": 0, "stale_workers": 0})
            });
            // A stale worker (gone, or cut off) serves nothing: counted apart.
            let count = if stale { "stale_workers" } else { "workers" };
            m[count] = json!(m[count].as_u64().unwrap_or(0) + 1);
            json!({
                "worker_id": w.worker_id.to_string(),
                "node_id": w.node_id.0,
                "pid": w.pid,
                "role": format!("{:?}", w.role).to_lowercase(),
                "state": if age > stale_after { "stale".to_string() } else { format!("{:?}", w.state).to_lowercase() },
                "engine": w.engine,
                // Exact: the router indexes the engine's KV events; approximate:
                // it tracks what it routed there (the engine emits none).
                "kv_events": w.kv_events,
                "routing": if w.kv_events { "exact" } else { "approximate" },
                "model": w.model.name.0,
                "generation": w.generation,
                "started": crate::time::rfc3339(w.started_unix_ms),
                "block_size": w.model.block_size,
                "hash_salt": format!("{:016x}", w.model.hash_salt),
                "kv_config_mismatch": reference
                    .get(w.model.name.0.as_str())
                    .is_some_and(|r| (r.1, r.2) != (w.model.block_size, w.model.hash_salt)),
                "heartbeat_age_ms": age,
                "index": info.as_ref().and_then(|i| i.workers.iter().find(|x| x.worker_id == w.worker_id)).map(|x| json!({
                    "device_blocks": x.blocks[0], "host_blocks": x.blocks[1], "disk_blocks": x.blocks[2],
                    "event_lag_ms": x.event_lag_ms, "router_inflight": x.inflight,
                })),
                // What it last reported; a stale worker's numbers are not
                // current (its requests may have moved on), so none.
                "load": if stale { Value::Null } else { json!({
                    "active_seqs": w.load.active_seqs,
                    "waiting_seqs": w.load.waiting_seqs,
                    "inflight_requests": w.load.inflight_requests,
                    "kv_used_blocks": w.load.kv_used_blocks,
                    "kv_total_blocks": w.load.kv_total_blocks,
                }) },
            })
        })
        .collect();
    let nodes_json: Vec<Value> = nodes
        .iter()
        .map(|n| {
            let age = now.saturating_sub(n.heartbeat_unix_ms);
            let mut v = json!({
                "node_id": n.node_id.0, "pid": n.pid, "hostname": n.hostname, "actors": n.actors,
                "http_addr": n.http_addr, "heartbeat_age_ms": age,
                "state": if age > stale_after { "stale" } else { "up" },
            });
            if let Some(i) = inventories
                .iter()
                .find(|i| i.registration.node_id == n.node_id)
            {
                v["labels"] = i
                    .labels
                    .iter()
                    .map(|(k, l)| (k.clone(), Value::from(l.clone())))
                    .collect::<serde_json::Map<_, _>>()
                    .into();
                v["slots"] = i.slots.into();
                v["free_slots"] = i.free_slots.into();
                v["memory_mib"] = i.memory_mib.into();
                v["free_memory_mib"] = i.free_memory_mib.into();
                v["health"] = i.health.clone().into();
                v["controller"] = i.controller.into();
                v["replicas"] = i
                    .replicas
                    .iter()
                    .map(|r| json!({"key": r.key, "ready": r.ready, "stopping": r.stopping}))
                    .collect::<Vec<_>>()
                    .into();
            }
            v
        })
        .collect();
    Ok(json!({
        "router": info.as_ref().map(|i| json!({
            "router_id": i.router_id.to_string(), "policy": i.policy,
            "events_applied": i.events_applied, "event_gaps": i.event_gaps,
            "event_duplicates": i.event_duplicates, "dumps": i.dumps,
        })),
        "namespace": ns.as_str(),
        "nats_url": dynamo_runtime::bus::redact_url(url),
        "nodes": nodes_json,
        "workers": workers_json,
        "models": models.into_values().collect::<Vec<_>>(),
        // Weight files, their cache state and the nodes serving or loading
        // them (a cluster without the bucket yet shows none).
        "weights": crate::models_cli::catalog_json(&bus)
            .await
            .map(|w| w["models"].clone())
            .unwrap_or_else(|e| json!({"error": e.to_string()})),
    }))
}

/// Human-readable rendering of [`collect`]'s JSON.
pub fn render(v: &Value) -> String {
    let mut s = format!(
        "namespace {}  (nats {})\n\nNODES\n",
        v["namespace"].as_str().unwrap_or(""),
        v["nats_url"].as_str().unwrap_or("")
    );
    s.push_str(&format!(
        "{:<16} {:>8} {:<8} {:<22} {:<7} {}\n",
        "NODE", "PID", "STATE", "HTTP", "SLOTS", "ACTORS"
    ));
    for n in v["nodes"].as_array().into_iter().flatten() {
        let state = match (n["state"].as_str().unwrap_or(""), n["health"].as_str()) {
            ("up", Some(h)) if h != "healthy" => h.to_string(),
            (s, _) => s.to_string(),
        };
        let slots = match (n["free_slots"].as_u64(), n["slots"].as_u64()) {
            (Some(f), Some(t)) => format!("{f}/{t}"),
            _ => "-".into(),
        };
        s.push_str(&format!(
            "{:<16} {:>8} {:<8} {:<22} {:<7} {}\n",
            n["node_id"].as_str().unwrap_or(""),
            n["pid"].to_string(),
            state,
            n["http_addr"].as_str().unwrap_or("-"),
            slots,
            n["actors"]
                .as_array()
                .map(|a| a
                    .iter()
                    .filter_map(|x| x.as_str())
                    .collect::<Vec<_>>()
                    .join(","))
                .unwrap_or_default()
        ));
    }
    s.push_str(&format!(
        "\nWORKERS\n{:<18} {:<12} {:>8} {:<10} {:<8} {:<11} {:<9} {:<24} {:>6} {:>7} {:>9} {:>13} {:>9} {:>7}\n",
        "WORKER",
        "NODE",
        "PID",
        "ROLE",
        "ENGINE",
        "ROUTING",
        "STATE",
        "MODEL",
        "ACTIVE",
        "WAITING",
        "INFLIGHT",
        "KV BLOCKS",
        "INDEXED",
        "LAG MS"
    ));
    for w in v["workers"].as_array().into_iter().flatten() {
        let l = &w["load"];
        let n = |k: &str| l[k].as_u64().map_or("-".to_string(), |n| n.to_string());
        let kv = match (l["kv_used_blocks"].as_u64(), l["kv_total_blocks"].as_u64()) {
            (Some(u), Some(t)) => format!("{u}/{t}"),
            _ => "-".to_string(),
        };
        s.push_str(&format!(
            "{:<18} {:<12} {:>8} {:<10} {:<8} {:<11} {:<9} {:<24} {:>6} {:>7} {:>9} {:>13} {:>9} {:>7}\n",
            w["worker_id"].as_str().unwrap_or(""),
            w["node_id"].as_str().unwrap_or(""),
            w["pid"].to_string(),
            w["role"].as_str().unwrap_or(""),
            w["engine"].as_str().unwrap_or(""),
            w["routing"].as_str().unwrap_or(""),
            w["state"].as_str().unwrap_or(""),
            w["model"].as_str().unwrap_or(""),
            n("active_seqs"),
            n("waiting_seqs"),
            n("inflight_requests"),
            kv,
            w["index"]["device_blocks"]
                .as_u64()
                .map(|n| n.to_string())
                .unwrap_or_else(|| "-".into()),
            w["index"]["event_lag_ms"]
                .as_u64()
                .map(|n| n.to_string())
                .unwrap_or_else(|| "-".into()),
        ));
    }
    for w in v["workers"].as_array().into_iter().flatten() {
        if w["kv_config_mismatch"].as_bool() == Some(true) {
            s.push_str(&format!(
                "!! worker {} has block_size {} / hash_salt {}, unlike its model's other workers: KV-aware routing cannot use its cache\n",
                w["worker_id"].as_str().unwrap_or(""),
                w["block_size"],
                w["hash_salt"].as_str().unwrap_or("")
            ));
        }
    }
    if let Some(w) = v["weights"].as_array().filter(|w| !w.is_empty()) {
        s.push_str("\nWEIGHTS\n");
        s.push_str(&crate::models_cli::render(&json!({ "models": w })));
    }
    s.push_str("\nMODELS\n");
    for m in v["models"].as_array().into_iter().flatten() {
        let stale = match m["stale_workers"].as_u64() {
            Some(n) if n > 0 => format!(" (and {n} stale)"),
            _ => String::new(),
        };
        s.push_str(&format!(
            "{}  workers={}{stale} context={} block_size={}\n",
            m["name"].as_str().unwrap_or(""),
            m["workers"],
            m["context_length"],
            m["block_size"]
        ));
    }
    s
}
