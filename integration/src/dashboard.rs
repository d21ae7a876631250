//! The Grafana dashboard against a running cluster: every metric a panel
//! names must be exported by some node's metrics listener or a gateway's
//! `/metrics`, with the type the query assumes (a `histogram_quantile`
//! over `_bucket` needs a histogram), with at least one sample (a `# TYPE`
//! line alone draws nothing), and with every label the query selects on or
//! groups by (labels the scrape job adds, like `namespace`, excepted).

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
    names_at(expr)
        .into_iter()
        .map(|(name, histogram, _)| (name, histogram))
        .collect()
}

/// Labels Prometheus's scrape job adds (not the exporter's to carry).
const SCRAPE_LABELS: [&str; 3] = ["namespace", "job", "instance"];

/// The label names of each sample in an exposition, by metric (a
/// histogram's `_bucket`, `_sum` and `_count` samples under its own name).
pub fn samples(text: &str) -> BTreeMap<String, BTreeSet<String>> {
    let types = exported(text);
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
    {
        let name_end = line
            .find(|c: char| c == '{' || c.is_whitespace())
            .unwrap_or(line.len());
        let mut name = &line[..name_end];
        for suffix in ["_bucket", "_sum", "_count"] {
            if let Some(base) = name.strip_suffix(suffix) {
                if types.get(base).is_some_and(|k| k == "histogram") {
                    name = base;
                }
            }
        }
        let labels = out.entry(name.to_string()).or_default();
        if line[name_end..].starts_with('{') {
            labels.extend(label_names(&line[name_end + 1..]));
        }
    }
    out
}

/// The label names in `a="x",b="y"}…` (values, in any of PromQL's three
/// quotes, may hold commas, braces and escaped quotes).
fn label_names(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut name = String::new();
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match c {
            '}' => break,
            '"' | '\'' | '`' => skip_quoted(&mut chars, c),
            '=' | '!' | '~' => {
                if !name.trim().is_empty() {
                    out.push(name.trim().to_string());
                }
                name.clear();
            }
            ',' => name.clear(),
            c => name.push(c),
        }
    }
    out
}

/// Skips a quoted string's rest, up to its closing `quote` (a backslash
/// escapes, except in backticks).
fn skip_quoted(chars: &mut std::str::Chars<'_>, quote: char) {
    while let Some(v) = chars.next() {
        if v == '\\' && quote != '`' {
            chars.next();
        } else if v == quote {
            break;
        }
    }
}

/// The labels an expression selects `name` on (`name{a="x",b=~"y"}`).
fn selector_labels(expr: &str, name_end: usize) -> Vec<String> {
    match expr[name_end..].strip_prefix('{') {
        Some(rest) => label_names(rest),
        None => Vec::new(),
    }
}

/// The labels an expression groups by (`by (a, b)` or `by(a)`), every
/// clause (`without` drops labels, which need not exist).
fn group_labels(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (at, _) in idents(expr).filter(|(_, w)| *w == "by") {
        let rest = expr[at + 2..].trim_start();
        let Some(inner) = rest.strip_prefix('(') else {
            continue;
        };
        let Some(len) = inner.find(')') else {
            break;
        };
        out.extend(
            inner[..len]
                .split(',')
                .map(|l| l.trim().to_string())
                .filter(|l| !l.is_empty()),
        );
    }
    out
}

/// The identifiers of an expression, with where each starts, outside its
/// quoted strings.
fn idents(expr: &str) -> impl Iterator<Item = (usize, &str)> {
    let mut out = Vec::new();
    let mut chars = expr.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        if c == '"' || c == '\'' || c == '`' {
            let mut rest = expr[i + c.len_utf8()..].chars();
            let before = rest.as_str().len();
            skip_quoted(&mut rest, c);
            let end = i + c.len_utf8() + (before - rest.as_str().len());
            while chars.peek().is_some_and(|(j, _)| *j < end) {
                chars.next();
            }
        } else if c.is_ascii_alphabetic() || c == '_' {
            let mut end = i + c.len_utf8();
            while let Some(&(j, d)) = chars.peek() {
                if d.is_ascii_alphanumeric() || d == '_' || d == ':' {
                    end = j + d.len_utf8();
                    chars.next();
                } else {
                    break;
                }
            }
            out.push((i, &expr[i..end]));
        } else if c.is_ascii_digit() {
            // A number (or a duration like 5m): not an identifier.
            while chars
                .peek()
                .is_some_and(|(_, d)| d.is_ascii_alphanumeric() || *d == '.')
            {
                chars.next();
            }
        }
    }
    out.into_iter()
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

/// What the dashboard reads that `expositions` do not export: a metric
/// not there (or not as the type the query needs, or with no sample), or a
/// label a query selects on or groups by that no sample carries; empty
/// when everything is there.
pub fn missing(d: &Value, expositions: &[String]) -> BTreeSet<String> {
    let mut have: BTreeMap<String, String> = BTreeMap::new();
    let mut labels: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for e in expositions {
        have.extend(exported(e));
        for (name, l) in samples(e) {
            labels.entry(name).or_default().extend(l);
        }
    }
    let scrape = |l: &str| SCRAPE_LABELS.contains(&l);
    let mut out = BTreeSet::new();
    for e in expressions(d) {
        let names = names_in(&e);
        for (name, histogram, end) in names_at(&e) {
            match have.get(&name) {
                Some(kind) if !histogram || kind == "histogram" => {}
                Some(kind) => {
                    out.insert(format!("{name} (read as a histogram, exported as {kind})"));
                    continue;
                }
                None => {
                    out.insert(name);
                    continue;
                }
            }
            let Some(carried) = labels.get(&name) else {
                out.insert(format!("{name} (no sample)"));
                continue;
            };
            for l in selector_labels(&e, end) {
                if !scrape(&l) && !carried.contains(&l) {
                    out.insert(format!("{name} (no sample carries the label {l})"));
                }
            }
        }
        // A grouping label must be on some metric the expression reads
        // (`le` on a histogram's buckets).
        for l in group_labels(&e) {
            let on_some = names.iter().any(|(n, histogram)| {
                (l == "le" && *histogram) || labels.get(n).is_some_and(|c| c.contains(&l))
            });
            if !scrape(&l) && !on_some {
                out.insert(format!(
                    "{e} (groups by {l}, which no metric it reads carries)"
                ));
            }
        }
    }
    out
}

/// [`names_in`], with where each name ends in the expression (its
/// `_bucket` suffix included), for reading its selector: whole identifiers
/// outside quoted strings only.
fn names_at(expr: &str) -> Vec<(String, bool, usize)> {
    idents(expr)
        .filter(|(_, w)| w.starts_with("dynamo_"))
        .map(|(at, name)| {
            let end = at + name.len();
            match name.strip_suffix("_bucket") {
                Some(base) => (base.to_string(), true, end),
                None => (name.to_string(), false, end),
            }
        })
        .collect()
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
        let text = "# TYPE dynamo_gateway_ttft histogram\n\
                    dynamo_gateway_ttft_bucket{a=\"x,}y\",le=\"0.1\"} 1\n\
                    dynamo_gateway_ttft_sum{a=\"x\"} 1\n\
                    # TYPE dynamo_worker_kv_used_blocks gauge\n\
                    dynamo_worker_kv_used_blocks{worker=\"w\"} 3\n"
            .to_string();
        assert!(
            missing(&d, std::slice::from_ref(&text)).is_empty(),
            "{:?}",
            missing(&d, &[text])
        );
        let wrong = "# TYPE dynamo_gateway_ttft counter\n".to_string();
        let m = missing(&d, &[wrong]);
        assert_eq!(m.len(), 2, "{m:?}");
        // A TYPE line alone, or samples without the selected label, fail.
        let bare =
            "# TYPE dynamo_gateway_ttft histogram\n# TYPE dynamo_worker_kv_used_blocks gauge\n\
                    dynamo_worker_kv_used_blocks 3\n"
                .to_string();
        let m = missing(&d, &[bare]);
        assert_eq!(
            m,
            BTreeSet::from(["dynamo_gateway_ttft (no sample)".to_string()]),
            "{m:?}"
        );
        let unlabelled = "# TYPE dynamo_gateway_ttft histogram\ndynamo_gateway_ttft_bucket{le=\"1\"} 1\n\
                          # TYPE dynamo_worker_kv_used_blocks gauge\ndynamo_worker_kv_used_blocks 3\n"
            .to_string();
        let m = missing(&d, &[unlabelled]);
        assert!(
            m.contains("dynamo_gateway_ttft (no sample carries the label a)"),
            "{m:?}"
        );
        // Grouping labels: `le` on a histogram; `worker` must be carried.
        let g = serde_json::json!({"panels": [{"targets": [{"expr": "sum by (worker) (dynamo_x{namespace=~\"n\"})"}]}]});
        let x = "# TYPE dynamo_x gauge\ndynamo_x{node=\"a\"} 1\n".to_string();
        assert_eq!(missing(&g, &[x]).len(), 1);
        let x = "# TYPE dynamo_x gauge\ndynamo_x{worker=\"a\"} 1\n".to_string();
        assert!(
            missing(&g, &[x]).is_empty(),
            "namespace is the scrape job's"
        );
        // Names only as whole identifiers outside quotes; `by(` too.
        assert_eq!(
            names_in("sum by(worker) (x_dynamo_y{job='dynamo_node'} + dynamo_z{a=`dynamo_q`})"),
            vec![("dynamo_z".to_string(), false)]
        );
        assert_eq!(
            group_labels("sum by(worker) (x) / max by (a, b) (y)"),
            ["worker", "a", "b"]
        );
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
