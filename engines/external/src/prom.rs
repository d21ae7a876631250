//! An engine's load, read from its own Prometheus metrics (text format).
//!
//! Names read (summed over label sets, e.g. vLLM's per-engine series):
//! - running: `vllm:num_requests_running`, `sglang:num_running_reqs`,
//!   `llamacpp:requests_processing`;
//! - waiting: `vllm:num_requests_waiting`, `sglang:num_queue_reqs`,
//!   `llamacpp:requests_deferred`;
//! - KV cache in use (a fraction, the largest series): `vllm:kv_cache_usage_perc`,
//!   `vllm:gpu_cache_usage_perc` (older vLLM), `sglang:token_usage`.
//!
//! Invariant: what an engine does not export stays `None`; an unreadable
//! line is skipped, never fatal.

const RUNNING: [&str; 3] = [
    "vllm:num_requests_running",
    "sglang:num_running_reqs",
    "llamacpp:requests_processing",
];
const WAITING: [&str; 3] = [
    "vllm:num_requests_waiting",
    "sglang:num_queue_reqs",
    "llamacpp:requests_deferred",
];
const KV_USAGE: [&str; 3] = [
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "sglang:token_usage",
];

/// What the engine said about its load.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineLoad {
    pub running: Option<u32>,
    pub waiting: Option<u32>,
    /// 0..=1.
    pub kv_usage: Option<f64>,
}

fn count(v: f64) -> u32 {
    if v.is_finite() && v > 0.0 {
        v.min(u32::MAX as f64) as u32
    } else {
        0
    }
}

/// Reads the load from a scrape.
pub fn parse(text: &str) -> EngineLoad {
    let (mut running, mut waiting, mut kv): (Option<f64>, Option<f64>, Option<f64>) =
        (None, None, None);
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let name = &line[..name_end];
        // The value follows the labels; a timestamp may follow it.
        let rest = match line[name_end..].rfind('}') {
            Some(i) if line[name_end..].starts_with('{') => &line[name_end + i + 1..],
            _ => &line[name_end..],
        };
        let Some(v) = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        if !v.is_finite() {
            continue;
        }
        if RUNNING.contains(&name) {
            *running.get_or_insert(0.0) += v;
        } else if WAITING.contains(&name) {
            *waiting.get_or_insert(0.0) += v;
        } else if KV_USAGE.contains(&name) {
            let v = v.clamp(0.0, 1.0);
            kv = Some(kv.map_or(v, |k: f64| k.max(v)));
        }
    }
    EngineLoad {
        running: running.map(count),
        waiting: waiting.map(count),
        kv_usage: kv,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_series_are_summed() {
        let text =
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
# TYPE vllm:num_requests_running gauge\n\
vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n\
vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 2.0\n\
vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 4.0\n\
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25\n\
vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.5\n\
vllm:prompt_tokens_total{model_name=\"m\"} 1234.0\n";
        assert_eq!(
            parse(text),
            EngineLoad {
                running: Some(5),
                waiting: Some(4),
                kv_usage: Some(0.5)
            }
        );
    }

    #[test]
    fn llamacpp_and_sglang_names() {
        let l = parse("# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 2\nllamacpp:requests_deferred 1\n");
        assert_eq!((l.running, l.waiting, l.kv_usage), (Some(2), Some(1), None));
        let s = parse("sglang:num_running_reqs{model_name=\"m\"} 7 1700000000\nsglang:num_queue_reqs{model_name=\"m\"} 0\nsglang:token_usage{model_name=\"m\"} 1.7\n");
        assert_eq!(
            (s.running, s.waiting, s.kv_usage),
            (Some(7), Some(0), Some(1.0))
        );
    }

    #[test]
    fn garbage_is_skipped() {
        let l = parse("vllm:num_requests_running{a=\"b\"} NaN\nvllm:num_requests_waiting x\n{}\n\u{0}\nllamacpp:requests_processing -3\n");
        assert_eq!((l.running, l.waiting), (Some(0), None));
        assert_eq!(parse(""), EngineLoad::default());
    }
}
