//! The Grafana dashboard against a running cluster: every metric a panel
//! names must be exported by some node's metrics listener or a gateway's
//! `/metrics`, with the type the query assumes (a `histogram_quantile`
//! over `_bucket` needs a histogram).

use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};

/// The dashboard in the repository.
pub fn dashboard() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../cluster-config/grafana/dynamo-dashboard.json"
    );
    let text = std::fs::read_to_string(path).expect("the dashboard file");
    serde_json::from_str(&text).expect("the dashboard is JSON")
}

/// Every PromQL expression of every panel.
pub fn expressions(d: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for p in d["panels"].as_array().into_iter().flatten() {
        for t in p["targets"].as_array().into_iter().flatten() {
            if let Some(e) = t["expr"].as_str() {
                out.push(e.to_string());
            }
        }
    }
    out
}

/// The metric names an expression reads: each `dynamo_…` identifier, with
/// whether it is read as `_bucket` (a histogram), the suffix removed.
pub fn names_in(expr: &str) -> Vec<(String, bool)> {
    let bytes = expr.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(at) = expr[i..].find("dynamo_") {
        let start = i + at;
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        let name = &expr[start..end];
        match name.strip_suffix("_bucket") {
            Some(base) => out.push((base.to_string(), true)),
            None => out.push((name.to_string(), false)),
        }
        i = end;
    }
    out
}

/// `# TYPE name kind` lines of an exposition.
pub fn exported(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            Some((it.next()?.to_string(), it.next()?.to_string()))
        })
        .collect()
}

/// The metrics the dashboard names that `expositions` do not export (or
/// not as the type the query needs); empty when all are there.
pub fn missing(d: &Value, expositions: &[String]) -> BTreeSet<String> {
    let mut have: BTreeMap<String, String> = BTreeMap::new();
    for e in expositions {
        have.extend(exported(e));
    }
    let mut out = BTreeSet::new();
    for e in expressions(d) {
        for (name, histogram) in names_in(&e) {
            match have.get(&name) {
                Some(kind) if !histogram || kind == "histogram" => {}
                Some(kind) => {
                    out.insert(format!("{name} (read as a histogram, exported as {kind})"));
                }
                None => {
                    out.insert(name);
                }
            }
        }
    }
    out
}

/// The whole text of `GET http://127.0.0.1:{port}/metrics` (empty if it
/// does not answer).
pub async fn scrape(port: u16) -> String {
    match reqwest::get(format!("http://127.0.0.1:{port}/metrics")).await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_read_with_their_histogram_suffix_removed() {
        let e = "histogram_quantile(0.9, sum by (le) (rate(dynamo_gateway_ttft_bucket{a=\"b\"}[1m]))) / sum(dynamo_worker_kv_used_blocks)";
        assert_eq!(
            names_in(e),
            vec![
                ("dynamo_gateway_ttft".to_string(), true),
                ("dynamo_worker_kv_used_blocks".to_string(), false)
            ]
        );
        let d = serde_json::json!({"panels": [{"targets": [{"expr": e}]}]});
        let text =
            "# TYPE dynamo_gateway_ttft histogram\n# TYPE dynamo_worker_kv_used_blocks gauge\n"
                .to_string();
        assert!(missing(&d, &[text]).is_empty());
        let wrong = "# TYPE dynamo_gateway_ttft counter\n".to_string();
        let m = missing(&d, &[wrong]);
        assert_eq!(m.len(), 2, "{m:?}");
    }

    #[test]
    fn the_dashboard_has_the_sla_view() {
        let d = dashboard();
        let exprs = expressions(&d).join("\n");
        for needed in [
            "dynamo_gateway_time_to_first_token_seconds_bucket",
            "dynamo_gateway_inter_token_latency_seconds_bucket",
            "dynamo_gateway_queued_requests",
            "dynamo_gateway_cached_tokens_total",
            "dynamo_gateway_migrations_total",
            "dynamo_planner_decisions_total",
            "dynamo_gateway_rejected_requests_total",
        ] {
            assert!(exprs.contains(needed), "the dashboard lacks {needed}");
        }
    }
}
