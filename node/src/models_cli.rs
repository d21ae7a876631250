//! `dynamoctl models`: the weights the cluster knows (`ls`), putting a
//! file in its cache (`push`), and following loads as they go (`watch`).

use crate::weights::{catalog, push as push_file};
use dynamo_bus_schema::weights::WeightSourceState;
use dynamo_bus_schema::Namespace;
use dynamo_runtime::bus::Bus;
use serde_json::{json, Value};
use std::path::Path;

/// Every weight file: its manifest, whether the cache holds it, and the
/// nodes serving it.
pub async fn ls(url: &str, ns: Namespace) -> anyhow::Result<Value> {
    let bus = crate::access::cli_connect_existing(url, ns).await?;
    catalog_json(&bus).await
}

/// [`ls`] on a connected bus.
pub async fn catalog_json(bus: &Bus) -> anyhow::Result<Value> {
    let cat = catalog(bus).await?;
    let models: Vec<Value> = cat
        .manifests
        .values()
        .map(|m| {
            let sources: Vec<Value> = cat
                .sources
                .get(&m.sha256)
                .into_iter()
                .flatten()
                .map(|s| {
                    json!({
                        "node": s.node.0,
                        "state": match s.state {
                            WeightSourceState::Ready => "ready",
                            WeightSourceState::Loading => "loading",
                            WeightSourceState::Unknown => "unknown",
                        },
                        "provider": s.provider,
                        "loaded_bytes": s.loaded_bytes,
                    })
                })
                .collect();
            json!({
                "model": m.model,
                "sha256": m.sha256.hex(),
                "layout": m.layout,
                "size": m.size,
                "chunks": m.chunks.len(),
                "cached": cat.cached.contains(&m.sha256),
                "sources": sources,
            })
        })
        .collect();
    Ok(json!({ "models": models }))
}

/// `ls` as a table.
pub fn render(v: &Value) -> String {
    let mut out = format!(
        "{:<28} {:<14} {:>10} {:<7} SOURCES\n",
        "MODEL", "SHA256", "SIZE", "CACHED"
    );
    for m in v["models"].as_array().into_iter().flatten() {
        let sources: Vec<String> = m["sources"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|s| {
                let pct = s["loaded_bytes"].as_u64().unwrap_or(0) * 100
                    / m["size"].as_u64().unwrap_or(1).max(1);
                match s["state"].as_str() {
                    Some("ready") => format!(
                        "{} ({})",
                        s["node"].as_str().unwrap_or("?"),
                        s["provider"].as_str().unwrap_or("?")
                    ),
                    st => format!(
                        "{} ({} {pct}%)",
                        s["node"].as_str().unwrap_or("?"),
                        st.unwrap_or("?")
                    ),
                }
            })
            .collect();
        out.push_str(&format!(
            "{:<28} {:<14} {:>10} {:<7} {}\n",
            m["model"].as_str().unwrap_or("?"),
            m["sha256"]
                .as_str()
                .and_then(|h| h.get(..12))
                .unwrap_or("?"),
            human(m["size"].as_u64().unwrap_or(0)),
            if m["cached"] == true { "yes" } else { "no" },
            if sources.is_empty() {
                "-".to_string()
            } else {
                sources.join(", ")
            }
        ));
    }
    out
}

fn human(b: u64) -> String {
    match b {
        b if b >= 1 << 30 => format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b => format!("{b} B"),
    }
}

/// A name clients can put in `"model"`: 1-128 characters of letters,
/// digits and `-_./:+@`, without `..` (`org/Model-1.5B:q4` passes).
pub fn check_model_name(model: &str) -> anyhow::Result<()> {
    let ok = !model.is_empty()
        && model.len() <= 128
        && !model.contains("..")
        && model
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:+@".contains(c));
    anyhow::ensure!(
        ok,
        "--model {model:?} is not a model name: 1-128 characters of letters, digits and -_./:+@, without '..'"
    );
    Ok(())
}

/// The cache holds model files a worker can load: GGUF, by its magic.
fn check_gguf(file: &Path) -> anyhow::Result<()> {
    use std::io::Read;
    let mut magic = [0u8; 4];
    std::fs::File::open(file)
        .and_then(|mut f| f.read_exact(&mut magic))
        .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", file.display()))
        .and_then(|()| {
            anyhow::ensure!(
                &magic == b"GGUF",
                "{} is not a GGUF model file (it does not start with \"GGUF\")",
                file.display()
            );
            Ok(())
        })
        .map_err(|e| {
            if e.to_string().contains("failed to fill whole buffer") {
                anyhow::anyhow!("{} is not a GGUF model file (too short)", file.display())
            } else {
                e
            }
        })
}

/// Puts `file` in the cache as `model`, with a progress bar on a terminal.
pub async fn push(url: &str, ns: Namespace, file: &Path, model: &str) -> anyhow::Result<Value> {
    if !file.is_file() {
        anyhow::bail!("{} is not a file", file.display());
    }
    check_model_name(model)?;
    check_gguf(file)?;
    let bus = crate::access::cli_connect(url, ns).await?;
    let bar = indicatif::ProgressBar::new(file.metadata()?.len());
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    bar.set_message(format!("pushing {}", file.display()));
    let b = bar.clone();
    let started = std::time::Instant::now();
    let m = push_file(&bus, file, model, &mut move |done, _| b.set_position(done)).await;
    bar.finish_and_clear();
    let m = m?;
    let secs = started.elapsed().as_secs_f64();
    Ok(json!({
        "model": m.model,
        "sha256": m.sha256.hex(),
        "size": m.size,
        "chunks": m.chunks.len(),
        "seconds": secs,
        "mb_per_s": m.size as f64 / 1e6 / secs.max(1e-9),
    }))
}

/// `dynamoctl models rm MODEL|SHA256 --yes`: takes a file out of the
/// in-cluster cache. `what` is a model name or a content hash (its first 8
/// hex digits or more) and must name one file. Nodes serving the file keep
/// serving it, and peers keep loading it from them (its manifest stays
/// while any does).
pub async fn rm(url: &str, ns: Namespace, what: &str, yes: bool) -> anyhow::Result<Value> {
    let bus = crate::access::cli_connect_existing(url, ns).await?;
    let cat = catalog(&bus).await?;
    let by_hash = what.len() >= 8 && what.bytes().all(|b| b.is_ascii_hexdigit());
    let found: Vec<_> = cat
        .manifests
        .values()
        .filter(|m| {
            m.model == what || (by_hash && m.sha256.hex().starts_with(&what.to_ascii_lowercase()))
        })
        .collect();
    let m = match found.as_slice() {
        [one] => *one,
        [] => anyhow::bail!(
            "no model or content hash {what:?} is known (dynamoctl models ls lists them)"
        ),
        many => anyhow::bail!(
            "{what:?} names {} files ({}): give the content hash",
            many.len(),
            many.iter()
                .map(|m| format!("{} {}", m.model, &m.sha256.hex()[..12]))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let sha = m.sha256.hex();
    let mut served: Vec<String> = cat
        .sources
        .get(&m.sha256)
        .into_iter()
        .flatten()
        .map(|s| s.node.0.clone())
        .collect();
    served.sort();
    let cached = cat.cached.contains(&m.sha256);
    if !cached && !served.is_empty() {
        anyhow::bail!(
            "{} ({}) is not in the cache: nodes {} hold it loaded, and serve it while they run",
            m.model,
            &sha[..12],
            served.join(", ")
        );
    }
    if !yes {
        anyhow::bail!(
            "this deletes {} ({}, {} bytes) from the in-cluster cache: add --yes to do it",
            m.model,
            &sha[..12],
            m.size
        );
    }
    let chunks = crate::weights::remove(&bus, m, !served.is_empty()).await?;
    Ok(json!({
        "model": m.model,
        "sha256": sha,
        "was_cached": cached,
        "chunks_deleted": chunks,
        "served_by": served,
        "manifest_kept": !served.is_empty(),
    }))
}

/// One weight source record as `models watch` follows it.
#[derive(Clone, Debug, PartialEq)]
struct Seen {
    model: String,
    state: &'static str,
    loaded: u64,
    size: u64,
}

/// The records `watch` follows (every node's, or `node`'s), by content
/// hash and node.
fn records(v: &Value, node: Option<&str>) -> std::collections::BTreeMap<(String, String), Seen> {
    let mut out = std::collections::BTreeMap::new();
    for m in v["models"].as_array().into_iter().flatten() {
        for s in m["sources"].as_array().into_iter().flatten() {
            let n = s["node"].as_str().unwrap_or("?");
            if node.is_some_and(|want| want != n) {
                continue;
            }
            let state = match s["state"].as_str() {
                Some("ready") => "ready",
                Some("loading") => "loading",
                _ => "unknown",
            };
            out.insert(
                (
                    m["sha256"].as_str().unwrap_or("?").to_string(),
                    n.to_string(),
                ),
                Seen {
                    model: m["model"].as_str().unwrap_or("?").to_string(),
                    state,
                    loaded: s["loaded_bytes"].as_u64().unwrap_or(0),
                    size: m["size"].as_u64().unwrap_or(0),
                },
            );
        }
    }
    out
}

/// What changed between two reads of the records: each record that is
/// new or changed, then each one gone (`None`).
type Change = ((String, String), Option<Seen>);

fn changes(
    before: &std::collections::BTreeMap<(String, String), Seen>,
    now: &std::collections::BTreeMap<(String, String), Seen>,
) -> Vec<Change> {
    let mut out: Vec<Change> = now
        .iter()
        .filter(|(k, s)| before.get(*k) != Some(*s))
        .map(|(k, s)| (k.clone(), Some(s.clone())))
        .collect();
    out.extend(
        before
            .keys()
            .filter(|k| !now.contains_key(*k))
            .map(|k| (k.clone(), None)),
    );
    out
}

/// Fails unless `node` is a registered node or holds a weights record: a
/// mistyped `--node` would otherwise watch nothing, silently.
async fn check_node(bus: &Bus, node: &str) -> anyhow::Result<()> {
    use futures::TryStreamExt;
    let v = tokio::time::timeout(WATCH_READ, catalog_json(bus))
        .await
        .map_err(|_| {
            anyhow::anyhow!(
                "reading the weights bucket took over {} s",
                WATCH_READ.as_secs()
            )
        })??;
    if !records(&v, Some(node)).is_empty() {
        return Ok(());
    }
    let name = bus.subjects.nodes_bucket();
    let read = async {
        let kv = bus
            .kv_bucket(&name, dynamo_runtime::bus::REGISTRY_MAX_AGE)
            .await?;
        let keys: Vec<String> = kv.keys().await?.try_collect().await?;
        anyhow::Ok(keys)
    };
    let mut nodes = tokio::time::timeout(WATCH_READ, read)
        .await
        .map_err(|_| anyhow::anyhow!("reading {name} took over {} s", WATCH_READ.as_secs()))?
        .map_err(|e| anyhow::anyhow!("reading {name}: {e}"))?;
    if nodes.iter().any(|n| n == node) {
        return Ok(());
    }
    nodes.sort();
    anyhow::bail!(
        "no node {node:?} is registered or holds weights (registered: {})",
        if nodes.is_empty() {
            "none".to_string()
        } else {
            nodes.join(", ")
        }
    )
}

/// Longest read of the weights bucket by `models watch`.
const WATCH_READ: std::time::Duration = std::time::Duration::from_secs(10);
/// Failed reads in a row that end `models watch`.
const WATCH_FAILURES: u32 = 5;

/// How `models watch` runs.
pub struct WatchArgs {
    /// Only this node's records.
    pub node: Option<String>,
    /// Stop once no load is in progress.
    pub until_idle: bool,
    /// One JSON object per change on stdout, rather than progress bars.
    pub json: bool,
    /// How often the weights bucket is read.
    pub every: std::time::Duration,
}

/// `dynamoctl models watch`: follows the loads in the cluster, a progress
/// bar for each on a terminal (a line per start and end otherwise), until
/// interrupted or, with `until_idle`, until none is in progress.
pub async fn watch(url: &str, ns: Namespace, args: WatchArgs) -> anyhow::Result<()> {
    let bus = crate::access::cli_connect_existing(url, ns).await?;
    if let Some(node) = &args.node {
        check_node(&bus, node).await?;
    }
    let bars = indicatif::MultiProgress::new();
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let style = indicatif::ProgressStyle::with_template(
        "{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    )
    .expect("a valid template")
    .progress_chars("=> ");
    let mut open: std::collections::BTreeMap<(String, String), indicatif::ProgressBar> =
        Default::default();
    let mut before = Default::default();
    let mut first = true;
    let mut failures = 0u32;
    loop {
        // A read that fails or stalls is tried again; several in a row end
        // the watch with the last error.
        let read = tokio::time::timeout(WATCH_READ, catalog_json(&bus))
            .await
            .unwrap_or_else(|_| {
                Err(anyhow::anyhow!(
                    "reading the weights bucket took over {} s",
                    WATCH_READ.as_secs()
                ))
            });
        let v = match read {
            Ok(v) => {
                failures = 0;
                v
            }
            Err(e) => {
                failures += 1;
                if failures >= WATCH_FAILURES {
                    return Err(e);
                }
                eprintln!("models watch: {e:#}; trying again");
                tokio::time::sleep(args.every).await;
                continue;
            }
        };
        let now = records(&v, args.node.as_deref());
        for ((sha, node), seen) in changes(&before, &now) {
            let key = (sha.clone(), node.clone());
            if args.json {
                let v = match &seen {
                    Some(s) => json!({
                        "node": node, "model": s.model, "sha256": sha,
                        "state": s.state, "loaded_bytes": s.loaded, "size": s.size,
                    }),
                    None => json!({"node": node, "sha256": sha, "state": "gone"}),
                };
                use std::io::Write;
                let mut out = std::io::stdout().lock();
                match writeln!(out, "{v}").and_then(|_| out.flush()) {
                    Ok(()) => {}
                    // The reader went away (`| head`): done.
                    Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(()),
                    Err(e) => return Err(e.into()),
                }
                continue;
            }
            let label = |model: &str| format!("{node}: {model} ({})", &sha[..sha.len().min(12)]);
            match seen {
                Some(s) if s.state == "loading" => {
                    let bar = open.entry(key).or_insert_with(|| {
                        if !tty {
                            eprintln!("{} loading", label(&s.model));
                        }
                        let b = bars.add(indicatif::ProgressBar::new(s.size));
                        b.set_style(style.clone());
                        b.set_message(label(&s.model));
                        b
                    });
                    bar.set_position(s.loaded);
                }
                Some(s) => {
                    let done = format!("{} {}", label(&s.model), s.state);
                    // On a terminal the finished bar says it.
                    match open.remove(&key) {
                        Some(b) => b.finish_with_message(done.clone()),
                        None if first => continue,
                        None => {}
                    }
                    if !tty {
                        eprintln!("{done}");
                    }
                }
                None => {
                    if let Some(b) = open.remove(&key) {
                        let gone = format!("{node}: ({sha:.12}) no longer loading");
                        if !tty {
                            eprintln!("{gone}");
                        }
                        b.abandon_with_message(gone);
                    }
                }
            }
        }
        let loading = now.values().any(|s| s.state == "loading");
        if args.until_idle && !loading {
            if first && !args.json {
                eprintln!("no load in progress");
            }
            return Ok(());
        }
        before = now;
        first = false;
        tokio::time::sleep(args.every).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn catalog(sources: Value) -> Value {
        json!({"models": [{"model": "m", "sha256": "ab", "size": 100, "sources": sources}]})
    }

    #[test]
    fn watch_reports_each_record_that_starts_moves_ends_or_goes() {
        let a = records(
            &catalog(json!([
                {"node": "a", "state": "ready", "loaded_bytes": 0},
                {"node": "b", "state": "loading", "loaded_bytes": 10},
            ])),
            None,
        );
        assert_eq!(a.len(), 2);
        // Nothing changed: nothing reported.
        assert!(changes(&a, &a).is_empty());
        // b moves on, c starts.
        let b = records(
            &catalog(json!([
                {"node": "a", "state": "ready", "loaded_bytes": 0},
                {"node": "b", "state": "loading", "loaded_bytes": 60},
                {"node": "c", "state": "loading", "loaded_bytes": 0},
            ])),
            None,
        );
        let c: Vec<_> = changes(&a, &b)
            .into_iter()
            .map(|(k, s)| (k.1, s.map(|s| s.loaded)))
            .collect();
        assert_eq!(
            c,
            vec![("b".to_string(), Some(60)), ("c".to_string(), Some(0))]
        );
        // b is ready, c is gone, a is filtered out.
        let d = records(
            &catalog(json!([
                {"node": "a", "state": "ready", "loaded_bytes": 0},
                {"node": "b", "state": "ready", "loaded_bytes": 0},
                {"node": "x", "state": "???", "loaded_bytes": 0},
            ])),
            Some("b"),
        );
        let b_only = records(&catalog(json!([])), None);
        let c: Vec<_> = changes(&b, &d)
            .into_iter()
            .map(|(k, s)| (k.1, s.map(|s| s.state)))
            .collect();
        assert_eq!(
            c,
            vec![
                ("b".to_string(), Some("ready")),
                ("a".to_string(), None),
                ("c".to_string(), None),
            ]
        );
        assert!(b_only.is_empty());
        // An unknown state is kept as unknown, not dropped.
        let x = records(
            &catalog(json!([{"node": "x", "state": "???", "loaded_bytes": 0}])),
            None,
        );
        assert_eq!(x.values().next().map(|s| s.state), Some("unknown"));
    }
}
