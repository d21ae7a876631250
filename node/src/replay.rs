//! `dynamoctl replay`: replays a Mooncake-format JSONL trace against any
//! OpenAI `/v1/completions` endpoint.
//!
//! Each line: `timestamp` (ms), `input_length`, `output_length`, `hash_ids`
//! (one id per 512-token block; equal ids = identical content). Block id `h`
//! becomes 512 deterministic token ids (SplitMix64 of `h` and the position,
//! mapped into `[256, vocab)`); the prompt is the concatenation, truncated to
//! `input_length`. Requests are sent open-loop at `timestamp / speedup`,
//! streaming with `include_usage`, so TTFT and `cached_tokens` are measured.
//!
//! `token_scale` K shrinks the trace: every length is divided by K, so a
//! trace block becomes `512 / K` tokens (K must divide 512). The report also
//! gives the oracle: the share of prompt tokens whose trace block appeared in
//! an earlier request of the slice (what a router with one infinite cache
//! shared by all workers would reuse), and the measured cached tokens as a
//! fraction of it.

use serde::Serialize;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Tokens per trace block.
pub const TRACE_BLOCK: usize = 512;

#[derive(Clone, Debug)]
pub struct ReplaySpec {
    pub trace: PathBuf,
    pub url: String,
    pub model: String,
    pub speedup: f64,
    pub max_requests: Option<usize>,
    /// Cap on each request's output tokens (None = the trace's).
    pub max_output: Option<u32>,
    /// Token ids are drawn below this.
    pub vocab: u32,
    /// Divide every length by this (a trace block becomes 512 / K tokens); K divides 512.
    pub token_scale: u32,
}

#[derive(Debug, Serialize)]
pub struct ReplayReport {
    pub requests: usize,
    pub ok: usize,
    pub errors: usize,
    pub cached_token_fraction: f64,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
    pub e2e_p50_ms: Option<f64>,
    pub req_per_s: f64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Prompt tokens whose trace block appeared in an earlier request (sent requests only).
    pub oracle_cached_tokens: u64,
    pub oracle_cached_fraction: f64,
    /// `cached_tokens / oracle_cached_tokens`.
    pub cached_vs_oracle: f64,
    pub token_scale: u32,
    pub duration_s: f64,
    pub first_error: Option<String>,
}

/// `replay`'s report for people (`--json` prints every field).
pub fn render(r: &ReplayReport) -> String {
    let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
    let out = format!(
        "{} requests in {:.1} s: {} ok, {} failed ({:.2} req/s)\n\
         cached prompt tokens  {} of {} ({:.1}%); the oracle {:.1}%, so {:.3} of it\n\
         TTFT (ms)             p50 {}  p99 {}\n\
         end to end (ms)       p50 {}\n",
        r.requests,
        r.duration_s,
        r.ok,
        r.errors,
        r.req_per_s,
        r.cached_tokens,
        r.prompt_tokens,
        r.cached_token_fraction * 100.0,
        r.oracle_cached_fraction * 100.0,
        r.cached_vs_oracle,
        ms(r.ttft_p50_ms),
        ms(r.ttft_p99_ms),
        ms(r.e2e_p50_ms),
    );
    // A failure's first error ends the command's output (its exit message).
    out
}

struct TraceRequest {
    at: Duration,
    prompt: Vec<u32>,
    output: u32,
    /// The trace block ids the prompt is made of, in order.
    blocks: Vec<u64>,
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The `len` tokens of trace block `h`.
pub fn block_tokens(h: u64, vocab: u32, len: usize) -> impl Iterator<Item = u32> {
    let span = (vocab.max(257) - 256) as u64;
    (0..len as u64).map(move |j| 256 + (splitmix(h.wrapping_mul(1 << 20) ^ j) % span) as u32)
}

/// Checks a token scale: ≥ 1 and dividing the trace block.
pub fn check_token_scale(k: u32) -> anyhow::Result<()> {
    anyhow::ensure!(
        k >= 1 && TRACE_BLOCK.is_multiple_of(k as usize),
        "--token-scale must divide {TRACE_BLOCK} (1, 2, 4, …, 512), not {k}"
    );
    Ok(())
}

/// Prompt tokens (per request, summed) whose trace block appeared in an earlier request.
fn oracle_tokens(reqs: &[TraceRequest], block: usize) -> u64 {
    let mut seen = std::collections::HashSet::new();
    let mut total = 0u64;
    for r in reqs {
        for (i, h) in r.blocks.iter().enumerate() {
            let len = block.min(r.prompt.len().saturating_sub(i * block));
            if seen.contains(h) {
                total += len as u64;
            }
        }
        seen.extend(r.blocks.iter().copied());
    }
    total
}

fn parse_line(line: &str, n: usize, vocab: u32, scale: u32) -> anyhow::Result<TraceRequest> {
    let v: Value = serde_json::from_str(line).map_err(|e| anyhow::anyhow!("line {n}: {e}"))?;
    let field = |k: &str| {
        v[k].as_u64()
            .ok_or_else(|| anyhow::anyhow!("line {n}: `{k}` missing or not a number"))
    };
    let scale = scale.max(1);
    let block = TRACE_BLOCK / scale as usize;
    let (ts, input, output) = (
        field("timestamp")?,
        field("input_length")? as usize / scale as usize,
        field("output_length")? as u32 / scale,
    );
    let ids = v["hash_ids"]
        .as_array()
        .ok_or_else(|| anyhow::anyhow!("line {n}: `hash_ids` missing"))?;
    let mut prompt = Vec::with_capacity(input);
    let mut blocks = Vec::new();
    for id in ids {
        if prompt.len() >= input {
            break;
        }
        let h = id
            .as_u64()
            .ok_or_else(|| anyhow::anyhow!("line {n}: bad hash id {id}"))?;
        prompt.extend(block_tokens(h, vocab, block));
        blocks.push(h);
    }
    prompt.truncate(input);
    anyhow::ensure!(!prompt.is_empty(), "line {n}: empty prompt");
    Ok(TraceRequest {
        at: Duration::from_millis(ts),
        prompt,
        output: output.max(1),
        blocks,
    })
}

async fn one(
    client: &reqwest::Client,
    url: &str,
    body: String,
    t0: Instant,
) -> Result<(u64, u64, Option<Duration>, Duration), String> {
    use futures::StreamExt;
    let resp = client
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        let st = resp.status();
        return Err(format!(
            "HTTP {st}: {}",
            resp.text().await.unwrap_or_default()
        ));
    }
    let mut stream = resp.bytes_stream();
    let mut buf = Vec::new();
    let (mut ttft, mut usage) = (None, None);
    while let Some(chunk) = stream.next().await {
        buf.extend_from_slice(&chunk.map_err(|e| e.to_string())?);
        while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
            let ev: Vec<u8> = buf.drain(..pos + 2).collect();
            let text = String::from_utf8_lossy(&ev);
            let Some(data) = text.lines().find_map(|l| l.strip_prefix("data: ")) else {
                continue;
            };
            if data == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(data).map_err(|e| e.to_string())?;
            if v.get("error").is_some() {
                return Err(data.to_string());
            }
            if ttft.is_none()
                && v["choices"][0]["text"]
                    .as_str()
                    .is_some_and(|t| !t.is_empty())
            {
                ttft = Some(t0.elapsed());
            }
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                usage = Some((
                    u["prompt_tokens"].as_u64().unwrap_or(0),
                    u["prompt_tokens_details"]["cached_tokens"]
                        .as_u64()
                        .unwrap_or(0),
                ));
            }
        }
    }
    let (p, c) = usage.ok_or("stream ended without usage")?;
    Ok((p, c, ttft, t0.elapsed()))
}

/// `a / b` to 4 decimals (0 when `b` is 0).
fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        (a as f64 / b as f64 * 10_000.0).round() / 10_000.0
    }
}

fn pct(v: &mut [f64], p: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Some((v[((v.len() - 1) as f64 * p).round() as usize] * 10.0).round() / 10.0)
}

pub async fn run(spec: ReplaySpec) -> anyhow::Result<ReplayReport> {
    anyhow::ensure!(
        (1e-6..=1e9).contains(&spec.speedup),
        "--speedup must be between 0.000001 and 1000000000 (got {})",
        spec.speedup
    );
    check_token_scale(spec.token_scale)?;
    anyhow::ensure!(
        spec.vocab > 256,
        "--vocab must be over 256: token ids are drawn from [256, vocab) (got {})",
        spec.vocab
    );
    anyhow::ensure!(
        spec.max_output != Some(0),
        "--max-output must be at least 1 (leave it out to keep the trace's lengths)"
    );
    let text = std::fs::read_to_string(&spec.trace)
        .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", spec.trace.display()))?;
    let mut reqs = Vec::new();
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        if spec.max_requests.is_some_and(|m| reqs.len() >= m) {
            break;
        }
        reqs.push(parse_line(line, n + 1, spec.vocab, spec.token_scale)?);
    }
    anyhow::ensure!(!reqs.is_empty(), "the trace has no requests");
    let oracle = oracle_tokens(&reqs, TRACE_BLOCK / spec.token_scale as usize);
    let base = reqs[0].at;
    // Bodies are built before the clock starts so the client's cost does not skew timing.
    let bodies: Vec<(Duration, String)> = reqs
        .iter()
        .map(|r| {
            let out = spec.max_output.map_or(r.output, |m| r.output.min(m));
            let body = json!({"model": spec.model, "prompt": r.prompt, "max_tokens": out, "stream": true,
                              "stream_options": {"include_usage": true}, "ignore_eos": true});
            (r.at.saturating_sub(base).div_f64(spec.speedup), body.to_string())
        })
        .collect();
    drop(reqs);
    let url = format!("{}/v1/completions", spec.url.trim_end_matches('/'));
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(1800))
        .build()?;
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(bodies.len());
    for (at, body) in bodies {
        tokio::time::sleep_until(tokio::time::Instant::from_std(start + at)).await;
        let (client, url) = (client.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            one(&client, &url, body, Instant::now()).await
        }));
    }
    let results: Vec<_> = futures::future::join_all(tasks)
        .await
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| Err(e.to_string())))
        .collect();
    let dur = start.elapsed().as_secs_f64();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let ok: Vec<_> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
    let prompt_tokens: u64 = ok.iter().map(|r| r.0).sum();
    let cached_tokens: u64 = ok.iter().map(|r| r.1).sum();
    let mut ttft: Vec<f64> = ok.iter().filter_map(|r| r.2.map(ms)).collect();
    let mut e2e: Vec<f64> = ok.iter().map(|r| ms(r.3)).collect();
    Ok(ReplayReport {
        requests: results.len(),
        ok: ok.len(),
        errors: results.len() - ok.len(),
        cached_token_fraction: ratio(cached_tokens, prompt_tokens),
        ttft_p50_ms: pct(&mut ttft, 0.5),
        ttft_p99_ms: pct(&mut ttft, 0.99),
        e2e_p50_ms: pct(&mut e2e, 0.5),
        req_per_s: (ok.len() as f64 / dur * 100.0).round() / 100.0,
        prompt_tokens,
        cached_tokens,
        oracle_cached_tokens: oracle,
        oracle_cached_fraction: ratio(oracle, prompt_tokens),
        cached_vs_oracle: ratio(cached_tokens, oracle),
        token_scale: spec.token_scale,
        duration_s: (dur * 1000.0).round() / 1000.0,
        first_error: results.iter().find_map(|r| r.as_ref().err().cloned()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn bad_settings_are_refused_before_the_trace_is_read() {
        let spec = |vocab, max_output| ReplaySpec {
            trace: "/nonexistent/trace.jsonl".into(),
            url: "http://127.0.0.1:1".into(),
            model: "m".into(),
            speedup: 1.0,
            max_requests: None,
            max_output,
            vocab,
            token_scale: 1,
        };
        let e = run(spec(10, None)).await.unwrap_err().to_string();
        assert!(e.contains("--vocab must be over 256"), "{e}");
        let e = run(spec(49152, Some(0))).await.unwrap_err().to_string();
        assert!(e.contains("--max-output must be at least 1"), "{e}");
        let e = run(spec(49152, Some(1))).await.unwrap_err().to_string();
        assert!(e.contains("cannot read /nonexistent/trace.jsonl"), "{e}");
    }

    #[test]
    fn equal_hash_ids_give_equal_tokens_and_lengths_are_exact() {
        let a = parse_line(
            r#"{"timestamp": 5, "input_length": 700, "output_length": 3, "hash_ids": [7, 8]}"#,
            1,
            49152,
            1,
        )
        .unwrap();
        let b = parse_line(
            r#"{"timestamp": 9, "input_length": 600, "output_length": 0, "hash_ids": [7, 9]}"#,
            2,
            49152,
            1,
        )
        .unwrap();
        assert_eq!(a.prompt.len(), 700);
        assert_eq!(b.prompt.len(), 600);
        assert_eq!(a.prompt[..512], b.prompt[..512]);
        assert_ne!(a.prompt[512..600], b.prompt[512..600]);
        assert!(a.prompt.iter().all(|&t| (256..49152).contains(&t)));
        assert_eq!(b.output, 1);
        assert!(parse_line("{}", 3, 49152, 1).is_err());
        assert!(parse_line("not json", 4, 49152, 1).is_err());
    }

    #[test]
    fn a_token_scale_shrinks_blocks_and_the_oracle_counts_earlier_blocks() {
        let line = |ts, input, ids: &str| {
            format!(
                r#"{{"timestamp": {ts}, "input_length": {input}, "output_length": 80, "hash_ids": {ids}}}"#
            )
        };
        let a = parse_line(&line(0, 1100, "[1, 2, 3]"), 1, 49152, 8).unwrap();
        let b = parse_line(&line(5, 1024, "[1, 2]"), 2, 49152, 8).unwrap();
        let c = parse_line(&line(9, 700, "[1, 9]"), 3, 49152, 8).unwrap();
        // 1100 / 8 = 137 tokens: blocks of 64, 64 and 9.
        assert_eq!(a.prompt.len(), 137);
        assert_eq!(a.blocks, [1, 2, 3]);
        assert_eq!(a.output, 10);
        assert_eq!(a.prompt[..128], b.prompt[..128]);
        assert_eq!(c.prompt.len(), 87);
        assert_eq!(a.prompt[..64], c.prompt[..64]);
        assert_ne!(a.prompt[64..87], c.prompt[64..87]);
        // b reuses 1 and 2 (128 tokens), c reuses 1 (64): 9 is new.
        assert_eq!(oracle_tokens(&[a, b, c], 64), 192);
        assert!(check_token_scale(8).is_ok());
        assert!(check_token_scale(0).is_err());
        assert!(check_token_scale(3).is_err());
    }
}
