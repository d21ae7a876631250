//! `dynamoctl calibrate-mocker`: fits the mocker's step-time polynomials
//! to an engine's measured timing, so that a mocker can stand in for it
//! (the CPU engine here, or any OpenAI-compatible endpoint that returns
//! our `timings` extension).
//!
//! For each prompt length it sends requests of fresh random token ids (no
//! prefix-cache hits), with `ignore_eos` so every request decodes the
//! tokens asked for, one at a time (no batching). A request gives one
//! prefill point (`timings.prefill_ms` against its prompt length) and one
//! decode point (its mean time per output token after the first, against
//! the KV utilisation at its mean context). The fastest of the repeats is
//! kept (noise only ever adds time). Both quadratics are fitted by least
//! squares ([`dynamo_configurator::emit::fit_quadratic`]).

use dynamo_configurator::emit::fit_quadratic;
use serde::Serialize;
use serde_json::{json, Value};
use std::time::Instant;

/// Everything `dynamoctl calibrate-mocker` takes.
#[derive(Clone, Debug, clap::Args)]
pub struct CalibrateSpec {
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    #[arg(long, default_value = "smollm2-135m-instruct")]
    pub model: String,
    /// Prompt lengths to measure, tokens (at least three distinct).
    #[arg(long, value_delimiter = ',', default_value = "32,64,128,256,512")]
    pub lengths: Vec<u32>,
    /// Output tokens per request (at least two).
    #[arg(long, default_value_t = 16)]
    pub decode_tokens: u32,
    /// Requests per length (the fastest is kept).
    #[arg(long, default_value_t = 2)]
    pub repeats: u32,
    /// Tokens of KV the engine holds (num_blocks × block_size).
    #[arg(long, default_value_t = 8192)]
    pub kv_tokens: u64,
    /// Token ids are drawn from [256, vocab).
    #[arg(long, default_value_t = 49152)]
    pub vocab: u32,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// One measured request.
#[derive(Clone, Debug, Serialize)]
pub struct Measured {
    pub prompt_tokens: u32,
    pub prefill_ms: f64,
    pub decode_step_ms: f64,
    pub kv_utilisation: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Calibrated {
    pub points: Vec<Measured>,
    pub prefill_ms: [f64; 3],
    pub decode_ms: [f64; 3],
}

impl Calibrated {
    /// The lines to put under `[workers.mocker]`.
    pub fn toml(&self) -> String {
        let p = self.prefill_ms;
        let d = self.decode_ms;
        format!(
            "prefill_ms = [{:e}, {:e}, {:e}]\ndecode_ms = [{:e}, {:e}, {:e}]\n",
            p[0], p[1], p[2], d[0], d[1], d[2]
        )
    }
}

fn check(spec: &CalibrateSpec) -> anyhow::Result<()> {
    let mut distinct = spec.lengths.clone();
    distinct.sort_unstable();
    distinct.dedup();
    if distinct.len() < 3 || distinct[0] == 0 {
        anyhow::bail!("--lengths needs at least three distinct positive prompt lengths");
    }
    if spec.decode_tokens < 2 {
        anyhow::bail!("--decode-tokens must be at least 2");
    }
    if spec.repeats == 0 || spec.kv_tokens == 0 || spec.vocab <= 256 {
        anyhow::bail!("--repeats and --kv-tokens must be positive and --vocab above 256");
    }
    Ok(())
}

/// A tiny deterministic generator: calibration prompts need variety, not quality.
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

pub async fn run(spec: &CalibrateSpec) -> anyhow::Result<Calibrated> {
    check(spec)?;
    let client = reqwest::Client::builder()
        .connect_timeout(std::time::Duration::from_secs(10))
        .timeout(std::time::Duration::from_secs(600))
        .build()?;
    crate::bench::check_url(&spec.url)?;
    crate::bench::preflight(&client, &spec.url).await?;
    let url = format!("{}/v1/completions", spec.url.trim_end_matches('/'));
    let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ std::process::id() as u64;
    let mut points = Vec::new();
    for &len in &spec.lengths {
        let mut best: Option<Measured> = None;
        for _ in 0..spec.repeats {
            let prompt: Vec<u32> = (0..len)
                .map(|_| 256 + (next(&mut rng) % (spec.vocab as u64 - 256)) as u32)
                .collect();
            let body = json!({"model": spec.model, "prompt": prompt,
                "max_tokens": spec.decode_tokens, "ignore_eos": true, "temperature": 0.0});
            let t0 = Instant::now();
            let resp = client.post(&url).json(&body).send().await?;
            let status = resp.status();
            let v: Value = resp.json().await?;
            let total_ms = t0.elapsed().as_secs_f64() * 1e3;
            if !status.is_success() {
                anyhow::bail!("{url} answered {status}: {v}");
            }
            let t = &v["timings"];
            let (Some(prefill), Some(first)) =
                (t["prefill_ms"].as_f64(), t["first_token_ms"].as_f64())
            else {
                anyhow::bail!("the response has no timings.prefill_ms / first_token_ms: {v}");
            };
            let n = v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
            if n < 2 {
                anyhow::bail!("only {n} tokens came back; calibration needs at least 2");
            }
            let m = Measured {
                prompt_tokens: len,
                prefill_ms: prefill,
                decode_step_ms: ((total_ms - first) / (n - 1) as f64).max(0.0),
                kv_utilisation: (len as f64 + n as f64 / 2.0) / spec.kv_tokens as f64,
            };
            best = Some(match best {
                Some(b) if b.prefill_ms + b.decode_step_ms <= m.prefill_ms + m.decode_step_ms => b,
                _ => m,
            });
        }
        points.extend(best);
    }
    let prefill: Vec<(f64, f64)> = points
        .iter()
        .map(|p| (p.prompt_tokens as f64, p.prefill_ms))
        .collect();
    let decode: Vec<(f64, f64)> = points
        .iter()
        .map(|p| (p.kv_utilisation, p.decode_step_ms))
        .collect();
    Ok(Calibrated {
        prefill_ms: fit_quadratic(&prefill),
        decode_ms: fit_quadratic(&decode),
        points,
    })
}

/// Human-readable report.
pub fn render(c: &Calibrated) -> String {
    let mut s = String::from("prompt tokens  prefill ms  decode ms/token  KV utilisation\n");
    for p in &c.points {
        s += &format!(
            "{:>13}  {:>10.1}  {:>15.2}  {:>14.4}\n",
            p.prompt_tokens, p.prefill_ms, p.decode_step_ms, p.kv_utilisation
        );
    }
    s += "\n# fitted; put under [workers.mocker]\n";
    s += &c.toml();
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_specs_are_refused_before_any_request() {
        let spec = CalibrateSpec {
            url: "http://127.0.0.1:1".into(),
            model: "m".into(),
            lengths: vec![64, 64, 128],
            decode_tokens: 8,
            repeats: 1,
            kv_tokens: 8192,
            vocab: 49152,
            json: false,
        };
        assert!(check(&spec)
            .unwrap_err()
            .to_string()
            .contains("three distinct"));
        let ok = CalibrateSpec {
            lengths: vec![32, 64, 128],
            ..spec.clone()
        };
        assert!(check(&ok).is_ok());
        let one = CalibrateSpec {
            decode_tokens: 1,
            ..ok.clone()
        };
        assert!(check(&one).is_err());
    }
}
