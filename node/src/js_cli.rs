//! `dynamoctl streams|buckets|consumers|events`: the JetStream state the
//! cluster runs on, with our wire types decoded.
//!
//! Every command prints a table, or JSON with `--json` (one JSON object per
//! line for the ones that follow: `buckets watch`, `events tail`). A
//! destructive one (`streams purge`) needs `--yes`. Bucket names may be
//! given whole (`dynamo_<ns>_workers`) or short (`workers`).

use clap::Subcommand;
use dynamo_bus_schema::weights::{WeightManifest, WeightSource};
use dynamo_bus_schema::*;
use futures::{StreamExt, TryStreamExt};
use serde_json::{json, Value};
use std::time::Duration;

/// Where the bus is, and how to print.
#[derive(clap::Args, Debug)]
pub struct Target {
    /// NATS URL (default: $DYNAMO_NATS_URL, or the local embedded server).
    #[arg(long)]
    pub nats: Option<String>,
    #[arg(long, env = crate::env::NAMESPACE, default_value = "default")]
    pub namespace: String,
    #[arg(long)]
    pub json: bool,
}

impl Target {
    fn resolve(&self) -> anyhow::Result<(String, Namespace)> {
        let ns = Namespace::new(&self.namespace)?;
        let url = crate::status::resolve_nats_url(self.nats.clone(), &ns)?;
        Ok((url, ns))
    }
}

#[derive(Subcommand, Debug)]
pub enum StreamsCmd {
    /// The namespace's (with --all: every) stream: subjects, messages, bytes, replicas, sequences.
    Ls {
        /// Every one on the server, not only the namespace's.
        #[arg(long)]
        all: bool,
        #[command(flatten)]
        t: Target,
    },
    /// One stream's configuration, state and cluster placement.
    Info {
        name: String,
        #[command(flatten)]
        t: Target,
    },
    /// Deletes every message of a stream (needs --yes).
    Purge {
        name: String,
        #[arg(long)]
        yes: bool,
        #[command(flatten)]
        t: Target,
    },
}

#[derive(Subcommand, Debug)]
pub enum BucketsCmd {
    /// The namespace's (with --all: every) KV bucket and object store, with its entry count.
    Ls {
        /// Every one on the server, not only the namespace's.
        #[arg(long)]
        all: bool,
        #[command(flatten)]
        t: Target,
    },
    /// A bucket's keys (without KEY) or one entry, decoded.
    Get {
        bucket: String,
        key: Option<String>,
        #[command(flatten)]
        t: Target,
    },
    /// Prints the bucket's changes as they come (history first).
    Watch {
        bucket: String,
        #[command(flatten)]
        t: Target,
        /// Stop after this many entries.
        #[arg(long)]
        count: Option<usize>,
        /// Stop after this many seconds (at most a year).
        #[arg(long, value_parser = clap::value_parser!(u64).range(0..=MAX_FOLLOW_S))]
        timeout_s: Option<u64>,
    },
}

#[derive(Subcommand, Debug)]
pub enum ConsumersCmd {
    /// The namespace's (with --all: every) stream's consumers: pending, delivered, durable or not.
    Ls {
        /// Every one on the server, not only the namespace's.
        #[arg(long)]
        all: bool,
        #[command(flatten)]
        t: Target,
    },
}

#[derive(Subcommand, Debug)]
pub enum EventsCmd {
    /// KV events as workers publish them, decoded.
    Tail {
        #[command(flatten)]
        t: Target,
        /// Only this worker's events (its id, 16 hex digits, or a prefix of
        /// a registered worker's).
        #[arg(long)]
        worker: Option<String>,
        /// Start with the stream's last N batches.
        #[arg(long, default_value_t = 0)]
        last: u64,
        /// Stop after this many batches.
        #[arg(long)]
        count: Option<usize>,
        /// Stop after this many seconds (at most a year).
        #[arg(long, value_parser = clap::value_parser!(u64).range(0..=MAX_FOLLOW_S))]
        timeout_s: Option<u64>,
    },
}

/// A bus message decoded as whichever of our types its kind names.
pub fn decode_any(bytes: &[u8]) -> Value {
    let Ok((kind, _)) = peek_kind(bytes) else {
        return json!({ "undecodable": true, "bytes": bytes.len() });
    };
    macro_rules! try_kinds {
        ($($t:ty),* $(,)?) => {
            $(
                if kind == <$t as WireMessage>::KIND {
                    return match decode_assembled::<$t>(bytes) {
                        Ok(v) => json!({ "type": <$t as WireMessage>::NAME, "value": serde_json::to_value(&v).unwrap_or(Value::Null) }),
                        Err(e) => json!({ "type": <$t as WireMessage>::NAME, "error": e.to_string() }),
                    };
                }
            )*
        };
    }
    try_kinds!(
        WorkerRegistration,
        NodeRegistration,
        KvEventBatch,
        LoadReport,
        DeploymentRecord,
        NodeInventory,
        NodeAssignment,
        ControllerLease,
        DeploymentStatus,
        PresenceProbe,
        FrontendMetrics,
        WorkerMetrics,
        PlannerStatus,
        PlannerPin,
        WeightManifest,
        WeightSource,
        ActiveLoadEvent,
        RouterHeartbeat,
    );
    json!({ "kind": kind.0, "bytes": bytes.len() })
}

/// JetStream as the admin role (the CA and credentials of
/// [`crate::access::cli_access`]).
async fn connect(url: &str, ns: &Namespace) -> anyhow::Result<async_nats::jetstream::Context> {
    Ok(crate::access::cli_connect(url, ns.clone()).await?.js)
}

fn stream_row(i: &async_nats::jetstream::stream::Info) -> Value {
    json!({
        "name": i.config.name,
        "subjects": i.config.subjects,
        "messages": i.state.messages,
        "bytes": i.state.bytes,
        "replicas": i.config.num_replicas,
        "storage": format!("{:?}", i.config.storage).to_lowercase(),
        "first_seq": i.state.first_sequence,
        "last_seq": i.state.last_sequence,
        "consumers": i.state.consumer_count,
        "leader": i.cluster.as_ref().and_then(|c| c.leader.clone()),
    })
}

/// Whether a stream is the namespace's (`all`: every stream is shown).
fn ours(ns: &Namespace, all: bool) -> impl Fn(&str) -> bool {
    let names = Subjects::new(ns.clone()).stream_names();
    move |name: &str| all || names.iter().any(|n| n == name)
}

/// `streams …`.
async fn streams(url: &str, ns: &Namespace, cmd: &StreamsCmd) -> anyhow::Result<Value> {
    let js = connect(url, ns).await?;
    match cmd {
        StreamsCmd::Ls { all, .. } => {
            let infos: Vec<_> = js.streams().try_collect().await?;
            let ours = ours(ns, *all);
            let mut rows: Vec<Value> = infos
                .iter()
                .filter(|i| ours(&i.config.name))
                .map(stream_row)
                .collect();
            rows.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
            Ok(json!({ "streams": rows }))
        }
        StreamsCmd::Info { name, .. } => {
            let mut s = js
                .get_stream(name)
                .await
                .map_err(|e| anyhow::anyhow!("no stream {name}: {e}"))?;
            let i = s.info().await?;
            let mut row = stream_row(i);
            row["config"] = serde_json::to_value(&i.config)?;
            row["replicas_placed"] = json!(i.cluster.as_ref().map(|c| c.replicas.len() + 1));
            Ok(row)
        }
        StreamsCmd::Purge { name, yes, .. } => {
            if !yes {
                anyhow::bail!("purging deletes every message of {name}: add --yes to do it");
            }
            let s = js
                .get_stream(name)
                .await
                .map_err(|e| anyhow::anyhow!("no stream {name}: {e}"))?;
            let r = s.purge().await?;
            Ok(json!({ "stream": name, "purged": r.purged }))
        }
    }
}

/// A bucket's stream name, whole or short (`workers` → `dynamo_<ns>_workers`).
async fn bucket_store(
    js: &async_nats::jetstream::Context,
    ns: &Namespace,
    bucket: &str,
) -> anyhow::Result<(String, async_nats::jetstream::kv::Store)> {
    for name in [
        bucket.to_string(),
        format!("dynamo_{}_{bucket}", ns.as_str()),
    ] {
        if js.get_stream(format!("KV_{name}")).await.is_ok() {
            return Ok((name.clone(), js.get_key_value(&name).await?));
        }
    }
    for name in [
        bucket.to_string(),
        format!("dynamo_{}_{bucket}", ns.as_str()),
    ] {
        if js.get_stream(format!("OBJ_{name}")).await.is_ok() {
            anyhow::bail!(
                "{name} is an object store, not a KV bucket: `buckets ls` shows its size; its objects are not read here"
            );
        }
    }
    anyhow::bail!(
        "no KV bucket {bucket} (nor dynamo_{}_{bucket})",
        ns.as_str()
    )
}

/// `buckets ls|get` (watch is [`watch`]).
async fn buckets(url: &str, ns: &Namespace, cmd: &BucketsCmd) -> anyhow::Result<Value> {
    let js = connect(url, ns).await?;
    match cmd {
        BucketsCmd::Ls { all, .. } => {
            let infos: Vec<_> = js.streams().try_collect().await?;
            let ours = ours(ns, *all);
            let mut rows: Vec<Value> = infos
                .iter()
                .filter(|i| ours(&i.config.name))
                .filter_map(|i| {
                    let (kind, name) = if let Some(n) = i.config.name.strip_prefix("KV_") {
                        ("kv", n)
                    } else if let Some(n) = i.config.name.strip_prefix("OBJ_") {
                        ("object", n)
                    } else {
                        return None;
                    };
                    Some(json!({
                        "bucket": name, "kind": kind, "messages": i.state.messages,
                        "bytes": i.state.bytes, "replicas": i.config.num_replicas,
                        "max_age_s": i.config.max_age.as_secs(),
                    }))
                })
                .collect();
            rows.sort_by(|a, b| a["bucket"].as_str().cmp(&b["bucket"].as_str()));
            Ok(json!({ "buckets": rows }))
        }
        BucketsCmd::Get {
            bucket, key: None, ..
        } => {
            let (name, kv) = bucket_store(&js, ns, bucket).await?;
            let mut keys: Vec<String> = kv.keys().await?.try_collect().await?;
            keys.sort();
            Ok(json!({ "bucket": name, "keys": keys }))
        }
        BucketsCmd::Get {
            bucket,
            key: Some(key),
            ..
        } => {
            let (name, kv) = bucket_store(&js, ns, bucket).await?;
            let e = kv
                .entry(key.as_str())
                .await?
                .ok_or_else(|| anyhow::anyhow!("bucket {name} has no key {key}"))?;
            Ok(json!({
                "bucket": name, "key": key, "revision": e.revision,
                "created": e.created.to_string(), "value": decode_any(&e.value),
            }))
        }
        BucketsCmd::Watch { .. } => anyhow::bail!("watch prints as it goes"),
    }
}

/// The longest `--timeout-s` of `watch` and `tail`: a year.
const MAX_FOLLOW_S: u64 = 365 * 24 * 3600;

/// Prints `f(item)` per item until `count` items or `timeout_s` seconds.
async fn follow<S, T>(
    mut s: S,
    count: Option<usize>,
    timeout_s: Option<u64>,
    json_out: bool,
    f: impl Fn(T) -> Option<(Value, String)>,
) -> anyhow::Result<()>
where
    S: futures::Stream<Item = T> + Unpin,
{
    let deadline = timeout_s.map(|t| tokio::time::Instant::now() + Duration::from_secs(t));
    let mut n = 0;
    while count.is_none_or(|c| n < c) {
        let next = match deadline {
            Some(d) => match tokio::time::timeout_at(d, s.next()).await {
                Ok(x) => x,
                Err(_) => break,
            },
            None => s.next().await,
        };
        let Some(item) = next else { break };
        if let Some((v, line)) = f(item) {
            if json_out {
                println!("{v}");
            } else {
                println!("{line}");
            }
            n += 1;
        }
    }
    Ok(())
}

/// `buckets watch`.
async fn watch(
    url: &str,
    ns: &Namespace,
    bucket: &str,
    count: Option<usize>,
    timeout_s: Option<u64>,
    json_out: bool,
) -> anyhow::Result<()> {
    let js = connect(url, ns).await?;
    let (name, kv) = bucket_store(&js, ns, bucket).await?;
    let w = kv.watch_all_from_revision(1).await?;
    follow(w, count, timeout_s, json_out, |e| {
        let e = e.ok()?;
        let op = format!("{:?}", e.operation).to_lowercase();
        let v = json!({
            "bucket": name, "key": e.key, "revision": e.revision, "operation": op,
            "value": if e.value.is_empty() { Value::Null } else { decode_any(&e.value) },
        });
        let line = format!(
            "{:>6} {:<7} {} {}",
            e.revision,
            op,
            e.key,
            v["value"]["type"].as_str().unwrap_or("")
        );
        Some((v, line))
    })
    .await
}

/// `events tail`.
async fn tail(
    url: &str,
    ns: &Namespace,
    worker: Option<&str>,
    last: u64,
    count: Option<usize>,
    timeout_s: Option<u64>,
    json_out: bool,
) -> anyhow::Result<()> {
    use async_nats::jetstream::consumer::{push, DeliverPolicy};
    let subjects = Subjects::new(ns.clone());
    let bus = crate::access::cli_connect(url, ns.clone()).await?;
    let subject = match worker {
        // A whole id: its events, registered now or not (history).
        Some(w) if w.len() == 16 && w.parse::<WorkerId>().is_ok() => {
            subjects.kv_events(w.parse::<WorkerId>().map_err(anyhow::Error::msg)?)
        }
        // A prefix, as `drain` takes: one registered worker.
        Some(w) if !w.is_empty() && w.len() < 16 && w.chars().all(|c| c.is_ascii_hexdigit()) => {
            subjects.kv_events(
                crate::drain::find_worker(&bus, w)
                    .await
                    .map_err(|e| anyhow::anyhow!("--worker: {e}"))?,
            )
        }
        Some(w) => anyhow::bail!(
            "--worker {w:?} is not a worker id: 16 hex digits (or a prefix of a registered one), as `dynamoctl status` lists them"
        ),
        None => subjects.kv_events_all(),
    };
    let js = bus.js.clone();
    let mut stream = js
        .get_stream(subjects.kv_events_stream())
        .await
        .map_err(|e| anyhow::anyhow!("no KV events stream: {e}"))?;
    let lastseq = stream.info().await?.state.last_sequence;
    let start = lastseq.saturating_sub(last) + 1;
    let consumer = stream
        .create_consumer(push::OrderedConfig {
            deliver_subject: js.client().new_inbox(),
            filter_subject: subject,
            deliver_policy: DeliverPolicy::ByStartSequence {
                start_sequence: start.max(1),
            },
            ..Default::default()
        })
        .await?;
    let messages = consumer.messages().await?;
    follow(messages, count, timeout_s, json_out, |m| {
        let m = m.ok()?;
        let seq = m.info().map(|i| i.stream_sequence).unwrap_or(0);
        let b = match decode::<KvEventBatch>(&m.payload) {
            Ok(b) => b,
            Err(e) => {
                let v =
                    json!({ "seq": seq, "subject": m.subject.as_str(), "error": e.to_string() });
                return Some((v.clone(), v.to_string()));
            }
        };
        let events: Vec<Value> = b
            .events
            .iter()
            .map(|e| {
                json!({
                    "event_id": e.event_id.0, "kind": format!("{:?}", e.kind).to_lowercase(),
                    "tier": format!("{:?}", e.tier).to_lowercase(),
                    "parent": e.parent.map(|p| format!("{:016x}", p.0)),
                    "blocks": e.blocks.len(),
                })
            })
            .collect();
        let line = format!(
            "{seq:>8} worker {} gen {} events {} ({} blocks)",
            b.worker_id,
            b.generation,
            b.events.len(),
            b.events.iter().map(|e| e.blocks.len()).sum::<usize>()
        );
        let v = json!({
            "seq": seq, "worker": b.worker_id.to_string(), "generation": b.generation,
            "published_unix_ms": b.published_unix_ms, "events": events,
        });
        Some((v, line))
    })
    .await
}

/// `consumers ls`: every stream's consumers.
async fn consumers(url: &str, ns: &Namespace, all: bool) -> anyhow::Result<Value> {
    let js = connect(url, ns).await?;
    let names: Vec<String> = js.stream_names().try_collect().await?;
    let ours = ours(ns, all);
    let mut rows = Vec::new();
    for n in names.into_iter().filter(|n| ours(n)) {
        let s = js.get_stream(&n).await?;
        let infos: Vec<_> = s.consumers().try_collect().await?;
        for c in infos {
            rows.push(json!({
                "stream": n, "name": c.name, "pending": c.num_pending,
                "ack_pending": c.num_ack_pending, "delivered": c.delivered.stream_sequence,
                "durable": c.config.durable_name.is_some(),
            }));
        }
    }
    Ok(json!({ "consumers": rows }))
}

/// A table of `rows` (objects) with these columns.
pub fn table(rows: &[Value], cols: &[&str]) -> String {
    let cell = |v: &Value| match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    };
    let mut widths: Vec<usize> = cols.iter().map(|c| c.len()).collect();
    for r in rows {
        for (i, c) in cols.iter().enumerate() {
            widths[i] = widths[i].max(cell(&r[*c]).len());
        }
    }
    let line = |cells: Vec<String>| {
        cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_string()
    };
    let mut out = line(cols.iter().map(|c| c.to_uppercase()).collect()) + "\n";
    for r in rows {
        out += &(line(cols.iter().map(|c| cell(&r[*c])).collect()) + "\n");
    }
    out
}

fn print(v: &Value, json_out: bool, key: &str, cols: &[&str]) -> anyhow::Result<()> {
    if json_out {
        println!("{}", serde_json::to_string_pretty(v)?);
    } else if let Some(rows) = v[key].as_array() {
        print!("{}", table(rows, cols));
    } else {
        println!("{}", serde_json::to_string_pretty(v)?);
    }
    Ok(())
}

/// Runs `streams …`.
pub async fn run_streams(cmd: StreamsCmd) -> anyhow::Result<()> {
    let t = match &cmd {
        StreamsCmd::Ls { t, .. } | StreamsCmd::Info { t, .. } | StreamsCmd::Purge { t, .. } => t,
    };
    let (url, ns) = t.resolve()?;
    let v = streams(&url, &ns, &cmd).await?;
    let cols = [
        "name",
        "messages",
        "bytes",
        "replicas",
        "storage",
        "first_seq",
        "last_seq",
        "leader",
    ];
    print(&v, t.json, "streams", &cols)
}

/// Runs `buckets …`.
pub async fn run_buckets(cmd: BucketsCmd) -> anyhow::Result<()> {
    match &cmd {
        BucketsCmd::Watch {
            bucket,
            t,
            count,
            timeout_s,
        } => {
            let (url, ns) = t.resolve()?;
            watch(&url, &ns, bucket, *count, *timeout_s, t.json).await
        }
        BucketsCmd::Ls { t, .. } | BucketsCmd::Get { t, .. } => {
            let (url, ns) = t.resolve()?;
            let v = buckets(&url, &ns, &cmd).await?;
            if let (false, Some(keys)) = (t.json, v["keys"].as_array()) {
                for k in keys {
                    println!("{}", k.as_str().unwrap_or_default());
                }
                return Ok(());
            }
            let cols = [
                "bucket",
                "kind",
                "messages",
                "bytes",
                "replicas",
                "max_age_s",
            ];
            print(&v, t.json, "buckets", &cols)
        }
    }
}

/// Runs `consumers ls`.
pub async fn run_consumers(cmd: ConsumersCmd) -> anyhow::Result<()> {
    let ConsumersCmd::Ls { all, t } = cmd;
    let (url, ns) = t.resolve()?;
    let v = consumers(&url, &ns, all).await?;
    let cols = [
        "stream",
        "name",
        "pending",
        "ack_pending",
        "delivered",
        "durable",
    ];
    print(&v, t.json, "consumers", &cols)
}

/// Runs `events tail`.
pub async fn run_events(cmd: EventsCmd) -> anyhow::Result<()> {
    let EventsCmd::Tail {
        t,
        worker,
        last,
        count,
        timeout_s,
    } = cmd;
    let (url, ns) = t.resolve()?;
    tail(&url, &ns, worker.as_deref(), last, count, timeout_s, t.json).await
}
