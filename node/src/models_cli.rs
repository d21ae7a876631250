//! `dynamoctl models`: the weights the cluster knows (`ls`), and putting a
//! file in its cache (`push`).

use crate::weights::{catalog, push as push_file};
use dynamo_bus_schema::weights::WeightSourceState;
use dynamo_bus_schema::Namespace;
use dynamo_runtime::bus::Bus;
use serde_json::{json, Value};
use std::path::Path;

/// Every weight file: its manifest, whether the cache holds it, and the
/// nodes serving it.
pub async fn ls(url: &str, ns: Namespace) -> anyhow::Result<Value> {
    let bus = crate::access::cli_connect(url, ns).await?;
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

/// Puts `file` in the cache as `model`, with a progress bar on a terminal.
pub async fn push(url: &str, ns: Namespace, file: &Path, model: &str) -> anyhow::Result<Value> {
    if !file.is_file() {
        anyhow::bail!("{} is not a file", file.display());
    }
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
