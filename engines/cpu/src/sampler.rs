//! Token sampling: greedy, temperature, top-k, top-p, with a per-request
//! seeded generator so a seeded request gives the same tokens however it
//! is batched.
//!
//! Invariants: temperature 0 (or top_k 1) is exact argmax (lowest id on
//! ties); otherwise a token is drawn from the softmax of `logits / T`
//! restricted to the `top_k` most likely tokens and then to the smallest
//! prefix whose probability reaches `top_p`; the draw consumes exactly one
//! random number per token.

use dynamo_engine::ValidSampling;

/// SplitMix64: tiny, fast and stable across versions (reproducibility is
/// part of the API: the same seed gives the same tokens in every release).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in logits.iter().enumerate() {
        if *v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Picks the next token from `logits`.
pub fn sample(logits: &[f32], s: &ValidSampling, rng: &mut Rng) -> u32 {
    if s.temperature <= 0.0 || s.top_k == 1 {
        return argmax(logits);
    }
    let mut cand: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .map(|(i, l)| (i as u32, *l))
        .collect();
    let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if s.top_k > 0 && (s.top_k as usize) < cand.len() {
        cand.select_nth_unstable_by(s.top_k as usize - 1, by_logit);
        cand.truncate(s.top_k as usize);
    }
    let max = cand.iter().fold(f32::NEG_INFINITY, |m, c| m.max(c.1));
    let inv_t = 1.0 / s.temperature as f64;
    let mut probs: Vec<(u32, f64)> = cand
        .iter()
        .map(|(i, l)| (*i, ((*l - max) as f64 * inv_t).exp()))
        .collect();
    let total: f64 = probs.iter().map(|p| p.1).sum();
    if s.top_p < 1.0 {
        probs.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let want = s.top_p as f64 * total;
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (k, p) in probs.iter().enumerate() {
            acc += p.1;
            if acc >= want {
                keep = k + 1;
                break;
            }
        }
        probs.truncate(keep);
    } else {
        probs.sort_unstable_by_key(|p| p.0);
    }
    let total: f64 = probs.iter().map(|p| p.1).sum();
    let mut r = rng.next_f64() * total;
    for (i, p) in &probs {
        if r < *p {
            return *i;
        }
        r -= p;
    }
    probs.last().map(|p| p.0).unwrap_or_else(|| argmax(logits))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_p: f32, top_k: u32) -> ValidSampling {
        ValidSampling {
            max_tokens: 1,
            temperature,
            top_p,
            top_k,
            seed: Some(1),
            stop_token_ids: vec![],
            ignore_eos: false,
        }
    }

    #[test]
    fn greedy_and_filters_and_seeds() {
        let logits = [1.0, 3.0, 2.0, 3.0, -1.0];
        let mut rng = Rng::new(5);
        assert_eq!(sample(&logits, &params(0.0, 1.0, 0), &mut rng), 1);
        assert_eq!(sample(&logits, &params(1.0, 1.0, 1), &mut rng), 1);
        // top_k = 2 keeps tokens 1 and 3 only.
        for _ in 0..200 {
            let t = sample(&logits, &params(1.0, 1.0, 2), &mut rng);
            assert!(t == 1 || t == 3, "{t}");
        }
        // A tiny top_p keeps only the most likely token.
        for _ in 0..50 {
            assert_eq!(sample(&logits, &params(1.5, 0.01, 0), &mut rng), 1);
        }
        // Full sampling reaches every token and follows the distribution roughly.
        let mut counts = [0u32; 5];
        for _ in 0..20_000 {
            counts[sample(&logits, &params(1.0, 1.0, 0), &mut rng) as usize] += 1;
        }
        assert!(counts.iter().all(|c| *c > 0), "{counts:?}");
        let ratio = counts[1] as f64 / counts[2] as f64;
        assert!((ratio - std::f64::consts::E).abs() < 0.3, "{ratio}");
        // Same seed, same draws.
        let draw = |seed| {
            let mut r = Rng::new(seed);
            (0..20)
                .map(|_| sample(&logits, &params(1.0, 0.9, 0), &mut r))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(9), draw(9));
        assert_ne!(draw(9), draw(10));
    }
}
