//! `dynamoctl bench`: a load generator for any OpenAI-compatible endpoint.
//!
//! `concurrency` clients send `requests` requests in total, or keep
//! sending for `duration` (closed loop). Latency is per admitted request;
//! TTFT is the time to the first content chunk (streaming only); ITL is a
//! request's mean gap between content tokens ((last chunk − first chunk) /
//! (completion tokens − 1)). A request refused under load (429 or 503) is
//! counted apart, with the time the refusal took; the client then waits
//! what `Retry-After` says (or `retry_wait`), jittered between half and one
//! and a half times that, before its next request.

use serde::Serialize;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct BenchSpec {
    pub url: String,
    pub model: String,
    pub concurrency: usize,
    pub requests: usize,
    pub max_tokens: u32,
    /// Draw each request's `max_tokens` from `[max_tokens / 4, max_tokens × 7 / 4]`
    /// (mean `max_tokens`) instead of always `max_tokens`, as real outputs vary.
    pub vary_output: bool,
    pub prompt_tokens: usize,
    pub stream: bool,
    /// `chat` or `completions`.
    pub endpoint: String,
    /// Keep sending for this long instead of stopping after `requests`.
    pub duration: Option<Duration>,
    /// Wait after a refusal when the answer names no `Retry-After`.
    pub retry_wait: Duration,
    /// Clients start spread over this long (0: all at once).
    pub ramp: Duration,
    /// Sent as `Authorization: Bearer …` (a gateway with API keys).
    pub api_key: Option<String>,
    /// For an `https://` URL: trust only this CA (PEM) instead of the
    /// system's roots.
    pub ca_file: Option<std::path::PathBuf>,
}

#[derive(Debug, Default, Serialize)]
pub struct BenchReport {
    pub requests: usize,
    pub ok: usize,
    pub errors: usize,
    pub req_per_s: f64,
    pub latency_p50_ms: f64,
    pub latency_p99_ms: f64,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
    pub itl_p50_ms: Option<f64>,
    pub output_tokens_per_s: f64,
    pub duration_s: f64,
    /// Requests refused under load (429 or 503, with `Retry-After`).
    pub rejected: usize,
    /// Time to the refusal.
    pub reject_p50_ms: Option<f64>,
    pub reject_p90_ms: Option<f64>,
    pub reject_p99_ms: Option<f64>,
    pub reject_p999_ms: Option<f64>,
    pub first_error: Option<String>,
}

/// `bench`'s report for people (`--json` prints every field).
pub fn render(r: &BenchReport) -> String {
    let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
    let mut out = format!(
        "{} requests in {:.1} s: {} ok, {} failed, {} refused under load\n\
         throughput    {:.1} req/s, {:.0} output tokens/s\n\
         latency (ms)  p50 {:.1}  p99 {:.1}\n",
        r.requests,
        r.duration_s,
        r.ok,
        r.errors,
        r.rejected,
        r.req_per_s,
        r.output_tokens_per_s,
        r.latency_p50_ms,
        r.latency_p99_ms,
    );
    if r.ttft_p50_ms.is_some() {
        out += &format!(
            "TTFT (ms)     p50 {}  p99 {}\nITL (ms)      p50 {}\n",
            ms(r.ttft_p50_ms),
            ms(r.ttft_p99_ms),
            ms(r.itl_p50_ms)
        );
    }
    if r.rejected > 0 {
        out += &format!(
            "refusal (ms)  p50 {}  p90 {}  p99 {}  p99.9 {}\n",
            ms(r.reject_p50_ms),
            ms(r.reject_p90_ms),
            ms(r.reject_p99_ms),
            ms(r.reject_p999_ms)
        );
    }
    // A failure's first error ends the command's output (its exit message).
    out
}

/// A load's outcome as an exit status: an error when any request failed
/// (refusals under load are not failures: they are counted apart).
pub fn outcome(
    requests: usize,
    ok: usize,
    errors: usize,
    first_error: Option<&str>,
) -> anyhow::Result<()> {
    let first = first_error.unwrap_or("unknown");
    if ok == 0 && errors == 0 && requests > 0 {
        anyhow::bail!("no request succeeded: every one was refused under load");
    }
    if ok == 0 && errors > 0 {
        anyhow::bail!("every request failed: {first}");
    }
    if errors > 0 {
        anyhow::bail!("{errors} of {requests} requests failed; the first: {first}");
    }
    Ok(())
}

#[derive(Default)]
struct Sample {
    latency: Option<Duration>,
    ttft: Option<Duration>,
    itl: Option<Duration>,
    tokens: u64,
    error: Option<String>,
    /// Refused under load after this long; wait this long before the next.
    rejected: Option<(Duration, Duration)>,
}

/// A prompt of about `n` tokens (one short word per token), unique per request.
pub fn prompt(n: usize, i: usize) -> String {
    let words = [
        "alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "light",
    ];
    let mut s = format!("Request {i}:");
    for k in 0..n.saturating_sub(3) {
        s.push(' ');
        s.push_str(words[(k + i) % words.len()]);
    }
    s
}

fn body(spec: &BenchSpec, i: usize) -> Value {
    let p = prompt(spec.prompt_tokens, i);
    let mut b = if spec.endpoint == "completions" {
        json!({"model": spec.model, "prompt": p})
    } else {
        json!({"model": spec.model, "messages": [{"role": "user", "content": p}]})
    };
    let max_tokens = if spec.vary_output {
        // A fixed spread per request index (reproducible runs).
        let lo = (spec.max_tokens / 4).max(1) as u64;
        let span = (spec.max_tokens as u64 * 3 / 2).max(1);
        let h = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32;
        (lo + h % (span + 1)) as u32
    } else {
        spec.max_tokens
    };
    b["max_tokens"] = json!(max_tokens);
    if spec.vary_output {
        b["ignore_eos"] = json!(true);
    }
    b["stream"] = json!(spec.stream);
    if spec.stream {
        b["stream_options"] = json!({"include_usage": true});
    }
    b
}

/// An http(s) URL of a server (`--url`).
pub fn check_url(url: &str) -> anyhow::Result<()> {
    match reqwest::Url::parse(url) {
        Ok(u) if matches!(u.scheme(), "http" | "https") && u.host().is_some() => Ok(()),
        Ok(u) => anyhow::bail!(
            "--url {url:?}: needs http:// or https:// and a host (got scheme {:?})",
            u.scheme()
        ),
        Err(e) => {
            anyhow::bail!("--url {url:?} is not a URL ({e}); for example http://127.0.0.1:8000")
        }
    }
}

/// How long the server has to answer `GET /v1/models` before a bench or a
/// calibration starts.
const PREFLIGHT: Duration = Duration::from_secs(10);

/// Fails at once, naming the server, when `base` does not answer HTTP
/// (any status will do: an API key may be needed): a listener that never
/// replies would otherwise hold every request for its whole timeout.
pub async fn preflight(client: &reqwest::Client, base: &str) -> anyhow::Result<()> {
    let url = format!("{}/v1/models", base.trim_end_matches('/'));
    match tokio::time::timeout(PREFLIGHT, client.get(&url).send()).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => {
            let mut why = e.to_string();
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                why = format!("{why}: {s}");
                src = s.source();
            }
            anyhow::bail!("cannot reach {base}: {why}")
        }
        Err(_) => anyhow::bail!(
            "{base} did not answer GET /v1/models within {} s: is it an OpenAI server?",
            PREFLIGHT.as_secs()
        ),
    }
}

async fn one(client: &reqwest::Client, url: &str, spec: &BenchSpec, i: usize) -> Sample {
    let t0 = Instant::now();
    let mut s = Sample::default();
    let resp = match client.post(url).json(&body(spec, i)).send().await {
        Ok(r) => r,
        Err(e) => {
            s.error = Some(e.to_string());
            return s;
        }
    };
    let status = resp.status();
    if status.as_u16() == 429 || status.as_u16() == 503 {
        let wait = resp
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
            .map(Duration::from_secs)
            .unwrap_or(spec.retry_wait);
        // Read to the end, so the connection is kept for the next request.
        let _ = resp.bytes().await;
        s.rejected = Some((t0.elapsed(), wait));
        return s;
    }
    if !status.is_success() {
        s.error = Some(format!(
            "HTTP {status}: {}",
            resp.text().await.unwrap_or_default()
        ));
        return s;
    }
    if !spec.stream {
        match resp.json::<Value>().await {
            Ok(v) => s.tokens = v["usage"]["completion_tokens"].as_u64().unwrap_or(0),
            Err(e) => s.error = Some(e.to_string()),
        }
        s.latency = Some(t0.elapsed());
        return s;
    }
    use futures::StreamExt;
    let mut stream = resp.bytes_stream();
    let mut buf = Vec::new();
    let (mut first, mut last) = (None, None);
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                s.error = Some(e.to_string());
                return s;
            }
        };
        buf.extend_from_slice(&chunk);
        while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..pos + 2).collect();
            let text = String::from_utf8_lossy(&event);
            for line in text.lines() {
                let Some(data) = line.strip_prefix("data: ") else {
                    continue;
                };
                if data == "[DONE]" {
                    continue;
                }
                let Ok(v) = serde_json::from_str::<Value>(data) else {
                    continue;
                };
                if v.get("error").is_some() {
                    s.error = Some(data.to_string());
                }
                if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                    s.tokens = u["completion_tokens"].as_u64().unwrap_or(0);
                }
                let c = &v["choices"][0];
                let content = c["delta"]["content"]
                    .as_str()
                    .or(c["text"].as_str())
                    .unwrap_or("");
                if !content.is_empty() {
                    let now = t0.elapsed();
                    first.get_or_insert(now);
                    last = Some(now);
                }
            }
        }
    }
    s.latency = Some(t0.elapsed());
    s.ttft = first;
    if let (Some(f), Some(l)) = (first, last) {
        if s.tokens > 1 {
            s.itl = Some((l - f) / (s.tokens as u32 - 1));
        }
    }
    s
}

fn pct(v: &mut [f64], p: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let idx = ((v.len() as f64 - 1.0) * p).round() as usize;
    Some((v[idx] * 1000.0).round() / 1000.0)
}

pub async fn run(spec: BenchSpec) -> anyhow::Result<BenchReport> {
    anyhow::ensure!(spec.concurrency >= 1, "--concurrency must be at least 1");
    anyhow::ensure!(spec.requests >= 1, "--requests must be at least 1");
    anyhow::ensure!(
        spec.duration.is_none_or(|d| !d.is_zero()),
        "--duration-s must be positive"
    );
    anyhow::ensure!(
        spec.endpoint == "chat" || spec.endpoint == "completions",
        "--endpoint must be chat or completions"
    );
    check_url(&spec.url)?;
    let path = if spec.endpoint == "chat" {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    };
    let url = format!("{}{path}", spec.url.trim_end_matches('/'));
    let mut builder = reqwest::Client::builder()
        .pool_max_idle_per_host(spec.concurrency)
        .connect_timeout(Duration::from_secs(10))
        .timeout(Duration::from_secs(600));
    if let Some(ca) = &spec.ca_file {
        let pem =
            std::fs::read(ca).map_err(|e| anyhow::anyhow!("--ca-file {}: {e}", ca.display()))?;
        let cert = reqwest::Certificate::from_pem(&pem)
            .map_err(|e| anyhow::anyhow!("--ca-file {}: {e}", ca.display()))?;
        builder = builder
            .tls_built_in_root_certs(false)
            .add_root_certificate(cert);
    }
    if let Some(key) = &spec.api_key {
        let mut h = reqwest::header::HeaderMap::new();
        let v = reqwest::header::HeaderValue::from_str(&format!("Bearer {key}"))
            .map_err(|_| anyhow::anyhow!("--api-key holds characters a header cannot"))?;
        h.insert(reqwest::header::AUTHORIZATION, v);
        builder = builder.default_headers(h);
    }
    let client = builder.build()?;
    preflight(&client, &spec.url).await?;
    let next = Arc::new(AtomicUsize::new(0));
    let spec = Arc::new(spec);
    let t0 = Instant::now();
    let until = spec.duration.map(|d| t0 + d);
    let mut tasks = Vec::new();
    for c in 0..spec.concurrency {
        let (client, url, spec, next) = (client.clone(), url.clone(), spec.clone(), next.clone());
        let start = spec.ramp.mul_f64(c as f64 / spec.concurrency as f64);
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            tokio::time::sleep(start).await;
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let more = match until {
                    Some(u) => Instant::now() < u,
                    None => i < spec.requests,
                };
                if !more {
                    break;
                }
                let sample = one(&client, &url, &spec, i).await;
                let wait = sample.rejected.map(|(_, w)| w);
                out.push(sample);
                if let Some(w) = wait {
                    // Jittered (½× to 1½×), as well-behaved clients retry, so
                    // refused clients do not all come back at once.
                    let h = (i as u64).wrapping_mul(0xd1b5_4a32_d192_ed03) >> 11;
                    let f = 0.5 + (h as f64 / (1u64 << 53) as f64);
                    tokio::time::sleep(w.mul_f64(f)).await;
                }
            }
            out
        }));
    }
    let mut samples = Vec::new();
    for t in tasks {
        samples.extend(t.await?);
    }
    let dur = t0.elapsed().as_secs_f64();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let ok: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.error.is_none() && s.rejected.is_none())
        .collect();
    let mut refused: Vec<f64> = samples
        .iter()
        .filter_map(|s| s.rejected.map(|(t, _)| ms(t)))
        .collect();
    let rejected = refused.len();
    let mut lat: Vec<f64> = ok.iter().filter_map(|s| s.latency.map(ms)).collect();
    let mut ttft: Vec<f64> = ok.iter().filter_map(|s| s.ttft.map(ms)).collect();
    let mut itl: Vec<f64> = ok.iter().filter_map(|s| s.itl.map(ms)).collect();
    let tokens: u64 = ok.iter().map(|s| s.tokens).sum();
    Ok(BenchReport {
        requests: samples.len(),
        ok: ok.len(),
        errors: samples.len() - ok.len() - rejected,
        req_per_s: (ok.len() as f64 / dur * 10.0).round() / 10.0,
        latency_p50_ms: pct(&mut lat, 0.5).unwrap_or(0.0),
        latency_p99_ms: pct(&mut lat, 0.99).unwrap_or(0.0),
        ttft_p50_ms: pct(&mut ttft, 0.5),
        ttft_p99_ms: pct(&mut ttft, 0.99),
        itl_p50_ms: pct(&mut itl, 0.5),
        output_tokens_per_s: (tokens as f64 / dur * 10.0).round() / 10.0,
        duration_s: (dur * 1000.0).round() / 1000.0,
        rejected,
        reject_p50_ms: pct(&mut refused, 0.5),
        reject_p90_ms: pct(&mut refused, 0.9),
        reject_p99_ms: pct(&mut refused, 0.99),
        reject_p999_ms: pct(&mut refused, 0.999),
        first_error: samples.iter().find_map(|s| s.error.clone()),
    })
}

#[cfg(test)]
mod tests {
    use super::{check_url, outcome, render, BenchReport};

    #[test]
    fn the_report_for_people_shows_what_was_measured() {
        let mut r = BenchReport {
            requests: 10,
            ok: 8,
            rejected: 2,
            req_per_s: 5.0,
            latency_p50_ms: 12.5,
            latency_p99_ms: 40.0,
            reject_p50_ms: Some(1.0),
            ..Default::default()
        };
        let text = render(&r);
        assert!(
            text.starts_with("10 requests in 0.0 s: 8 ok, 0 failed, 2 refused under load"),
            "{text}"
        );
        assert!(text.contains("p50 12.5  p99 40.0"), "{text}");
        assert!(text.contains("refusal (ms)  p50 1.0"), "{text}");
        // Streaming adds TTFT and ITL.
        assert!(!text.contains("TTFT"), "{text}");
        r.ttft_p50_ms = Some(3.0);
        assert!(render(&r).contains("TTFT (ms)     p50 3.0"));
    }

    #[test]
    fn any_failed_request_fails_the_run_and_refusals_do_not() {
        assert!(outcome(10, 10, 0, None).is_ok());
        // Two refused under load: counted apart, not failures.
        assert!(outcome(10, 8, 0, None).is_ok());
        let e = outcome(10, 7, 3, Some("HTTP 500: boom")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "3 of 10 requests failed; the first: HTTP 500: boom"
        );
        let e = outcome(4, 0, 4, Some("connection refused")).unwrap_err();
        assert_eq!(e.to_string(), "every request failed: connection refused");
        let e = outcome(4, 0, 0, None).unwrap_err();
        assert!(e.to_string().contains("refused under load"), "{e}");
    }

    #[test]
    fn a_server_url_is_http_or_https_with_a_host() {
        for ok in [
            "http://127.0.0.1:8000",
            "https://gw.example.com/",
            "http://[::1]:80",
        ] {
            assert!(check_url(ok).is_ok(), "{ok}");
        }
        for bad in ["notaurl", "127.0.0.1:8000", "ftp://h/x", "http://", ""] {
            let e = check_url(bad).unwrap_err().to_string();
            assert!(e.starts_with("--url"), "{bad}: {e}");
        }
    }
}
