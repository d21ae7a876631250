//! What one replica serves while meeting the SLA.
//!
//! The model is an engine's step timing (the mocker's formulas, or any
//! engine's fitted the same way): prefill of N new tokens takes
//! `a·N² + b·N + c` ms, and a decode step at KV utilisation u takes
//! `a·u² + b·u + c` ms. It is seeded from the engine's settings and learned
//! online: once per window, the warm workers' observed prefill times (or
//! ITLs) together, over what the model predicts at the loads they had, is
//! averaged into a multiplier per phase ([`Learned`]). The seed counts as
//! [`SEED_SAMPLES`] samples: the first samples are averaged with it (a
//! running mean), and once that would weigh a sample less than
//! [`LEARN_RATE`], samples are blended at that rate, so what is learned
//! follows a change. A seed that is off is corrected within a few windows,
//! not after the dozens an exponential average from the seed takes.
//!
//! Invariants: capacities are finite and > 0; a multiplier stays within
//! [`MIN_FACTOR`, `MAX_FACTOR`]; samples from a worker's first windows
//! after it became ready (cold start) are never learned from.

use serde::{Deserialize, Serialize};

pub const MIN_FACTOR: f64 = 0.2;
pub const MAX_FACTOR: f64 = 5.0;
/// Least weight of a new sample (one window's workers) in a learned
/// multiplier.
const LEARN_RATE: f64 = 0.15;
/// Samples the seed is worth.
const SEED_SAMPLES: f64 = 1.0;
/// Tail factor on the queueing wait (about the 90th percentile of an
/// M/D/1 queue's wait over its mean).
const TAIL: f64 = 2.0;
/// Highest utilisation sized for, whatever the SLA allows.
const MAX_RHO: f64 = 0.85;
/// Decode occupancy margin, in standard deviations: a fleet's KV holds
/// the sequences it is given, whose number and lengths vary (Poisson
/// arrivals, lengths spread about as widely as an exponential's, so the
/// KV held has variance `2·m·live²` for `m` sequences of mean `live`
/// tokens), and the router shares it out evenly. Sizing keeps a replica's
/// `mean + DECODE_Z·σ` at the utilisation where a step meets the ITL
/// target: about the 90th percentile of occupancy.
pub const DECODE_Z: f64 = 1.28;

/// An engine's step timing (milliseconds of real time).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EngineTiming {
    /// Prefill of N new tokens: `a·N² + b·N + c` ms.
    pub prefill_ms: [f64; 3],
    /// Decode step at KV utilisation u: `a·u² + b·u + c` ms (floor 1 ms).
    pub decode_ms: [f64; 3],
    /// KV capacity of one replica, in tokens.
    pub kv_tokens: f64,
    /// Most sequences one replica runs at once.
    pub max_seqs: f64,
    /// Most prompt tokens one prefill step batches.
    pub max_batch_tokens: f64,
    /// Simulated time runs this many times faster (1 for a real engine).
    pub speedup: f64,
}

impl EngineTiming {
    /// Dynamo's mocker defaults (see the mocker's configuration).
    pub fn mocker_default() -> Self {
        EngineTiming {
            prefill_ms: [4.21e-7, 1.518e-2, 16.5],
            decode_ms: [-25.74, 54.01, 5.74],
            kv_tokens: 16_384.0 * 16.0,
            max_seqs: 256.0,
            max_batch_tokens: 8192.0,
            speedup: 1.0,
        }
    }

    fn scale(&self) -> f64 {
        if self.speedup.is_finite() && self.speedup > 0.0 {
            1.0 / self.speedup
        } else {
            // No delay at all: a tiny positive time keeps the model finite.
            1e-6
        }
    }

    /// Prefill time of `n` new tokens, ms.
    pub fn prefill(&self, n: f64) -> f64 {
        let [a, b, c] = self.prefill_ms;
        ((a * n * n + b * n + c) * self.scale()).max(1e-6)
    }

    /// Decode step time at KV utilisation `u`, ms.
    pub fn step(&self, u: f64) -> f64 {
        let [a, b, c] = self.decode_ms;
        let u = u.clamp(0.0, 1.0);
        ((a * u * u + b * u + c).max(1.0) * self.scale()).max(1e-6)
    }
}

/// Multipliers learned from observed timings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Learned {
    pub prefill: f64,
    pub decode: f64,
    pub prefill_samples: u64,
    pub decode_samples: u64,
}

impl Default for Learned {
    fn default() -> Self {
        Learned {
            prefill: 1.0,
            decode: 1.0,
            prefill_samples: 0,
            decode_samples: 0,
        }
    }
}

/// `old`, learned from `seen` samples before this one, with `sample`.
fn blend(old: f64, seen: u64, sample: f64) -> f64 {
    if !sample.is_finite() || sample <= 0.0 {
        return old;
    }
    let s = sample.clamp(MIN_FACTOR, MAX_FACTOR);
    let w = (1.0 / (seen as f64 + SEED_SAMPLES + 1.0)).max(LEARN_RATE);
    (old * (1.0 - w) + s * w).clamp(MIN_FACTOR, MAX_FACTOR)
}

impl Learned {
    /// A prefill worker, idle enough that its time to first token is its
    /// prefill time, took `observed_ms` for prompts of `isl` tokens.
    pub fn prefill_sample(&mut self, t: &EngineTiming, isl: f64, observed_ms: f64) {
        self.prefill = blend(
            self.prefill,
            self.prefill_samples,
            observed_ms / t.prefill(isl),
        );
        self.prefill_samples += 1;
    }
    /// A decode worker stepped every `observed_ms` at KV utilisation `u`.
    pub fn decode_sample(&mut self, t: &EngineTiming, u: f64, observed_ms: f64) {
        self.decode = blend(self.decode, self.decode_samples, observed_ms / t.step(u));
        self.decode_samples += 1;
    }
    /// One window's prefill workers, as (isl, observed ms) pairs: one
    /// sample, their total observed time over the total the model predicts
    /// (nothing when empty).
    pub fn prefill_window(&mut self, t: &EngineTiming, samples: &[(f64, f64)]) {
        if let Some(r) = ratio_of_sums(samples, |isl| t.prefill(isl)) {
            self.prefill = blend(self.prefill, self.prefill_samples, r);
            self.prefill_samples += 1;
        }
    }
    /// One window's decode workers, as (utilisation, observed step ms).
    pub fn decode_window(&mut self, t: &EngineTiming, samples: &[(f64, f64)]) {
        if let Some(r) = ratio_of_sums(samples, |u| t.step(u)) {
            self.decode = blend(self.decode, self.decode_samples, r);
            self.decode_samples += 1;
        }
    }
}

/// Σ observed ÷ Σ predicted over the finite samples (`None` when none).
fn ratio_of_sums(samples: &[(f64, f64)], model: impl Fn(f64) -> f64) -> Option<f64> {
    let (obs, pred) = samples
        .iter()
        .filter(|(x, o)| x.is_finite() && o.is_finite() && *o > 0.0)
        .fold((0.0, 0.0), |(a, b), (x, o)| (a + o, b + model(*x)));
    (pred > 0.0).then(|| obs / pred)
}

/// One replica's capacity at the SLA, with the numbers behind it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Capacity {
    /// Requests per second one replica serves within the SLA.
    pub per_replica: f64,
    /// The phase's service time behind it (ms): a prefill, or a step.
    pub service_ms: f64,
    /// Why the SLA cannot be met at any load ("" when it can).
    pub infeasible: String,
}

/// Prefill: requests/s per replica such that queueing wait plus one
/// prefill of `isl` tokens stays within `ttft_ms` (M/D/1, tail factor).
pub fn prefill_capacity(t: &EngineTiming, l: &Learned, isl: f64, ttft_ms: f64) -> Capacity {
    let s = t.prefill(isl.max(1.0)) * l.prefill;
    let (rho, infeasible) = if s >= ttft_ms {
        (
            0.05,
            format!(
                "one prefill of {isl:.0} tokens takes {s:.0} ms, over the {ttft_ms:.0} ms TTFT target"
            ),
        )
    } else {
        // S + TAIL·ρS/(2(1−ρ)) ≤ T  ⇔  ρ ≤ 2a/(1+2a), a = (T−S)/(TAIL·S).
        let a = (ttft_ms - s) / (TAIL * s);
        ((2.0 * a / (1.0 + 2.0 * a)).min(MAX_RHO), String::new())
    };
    Capacity {
        per_replica: (rho / (s / 1000.0)).max(1e-9),
        service_ms: s,
        infeasible,
    }
}

/// KV utilisation at which a step takes `itl_ms` (the largest u ≤ 0.95).
pub fn utilisation_at(t: &EngineTiming, factor: f64, itl_ms: f64) -> f64 {
    let at = |u: f64| t.step(u) * factor;
    if at(0.95) <= itl_ms {
        return 0.95;
    }
    if at(0.0) > itl_ms {
        return 0.0;
    }
    // The step time rises with u over [0, 0.95] for the engines we model.
    let (mut lo, mut hi) = (0.0, 0.95);
    for _ in 0..40 {
        let mid = (lo + hi) / 2.0;
        if at(mid) <= itl_ms {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// The KV a decoding sequence holds on average, in tokens: its prompt and
/// half its output (it grows from one to the other while it decodes).
pub fn live_tokens(isl: f64, osl: f64) -> f64 {
    isl.max(1.0) + osl.max(1.0) / 2.0
}

/// The spread term of a replica's KV occupancy: its standard deviation
/// is `b·√mean / DECODE_Z`, b = Z·√(2·live/(kv·replicas)). A router that
/// sends each sequence to the replica holding least KV keeps the replicas
/// of a fleet close to its mean, so a replica varies as its fleet's total
/// does, shared out: the spread falls with √replicas.
fn decode_spread(t: &EngineTiming, live: f64, replicas: f64) -> f64 {
    DECODE_Z * (2.0 * live.max(1.0) / (t.kv_tokens.max(1.0) * replicas.max(1.0))).sqrt()
}

/// The KV utilisation a replica of a fleet of `replicas` stays under about
/// 90% of the time when its mean is `u` and each sequence holds about
/// `live` tokens (see [`DECODE_Z`]).
pub fn decode_tail_utilisation(t: &EngineTiming, u: f64, live: f64, replicas: f64) -> f64 {
    let u = u.max(0.0);
    (u + decode_spread(t, live, replicas) * u.sqrt()).min(1.0)
}

/// The mean KV utilisation whose 90th percentile
/// ([`decode_tail_utilisation`]) is `u`: m with m + b·√m = u.
pub fn decode_mean_utilisation(t: &EngineTiming, u: f64, live: f64, replicas: f64) -> f64 {
    let u = u.max(0.0);
    let b = decode_spread(t, live, replicas);
    let root = (-b + (b * b + 4.0 * u).sqrt()) / 2.0;
    (root * root).clamp(0.01 * u, u)
}

/// Decode: requests/s per replica at the mean KV utilisation whose 90th
/// percentile ([`decode_tail_utilisation`]) is where a step meets `itl_ms`,
/// each sequence holding about `isl + osl/2` tokens of KV and taking `osl`
/// steps at the mean step time (Little's law), for one of `replicas`
/// replicas that share a load.
pub fn decode_capacity(
    t: &EngineTiming,
    l: &Learned,
    isl: f64,
    osl: f64,
    itl_ms: f64,
    replicas: f64,
) -> Capacity {
    let osl = osl.max(1.0);
    let u = utilisation_at(t, l.decode, itl_ms);
    let (u, infeasible) = if u <= 0.0 {
        (
            0.02,
            format!(
                "a decode step takes {:.1} ms even with an empty cache, over the {itl_ms:.0} ms ITL target",
                t.step(0.0) * l.decode
            ),
        )
    } else {
        (u, String::new())
    };
    let live = live_tokens(isl, osl);
    let mean = decode_mean_utilisation(t, u, live, replicas);
    let seqs = (mean * t.kv_tokens / live).min(t.max_seqs * 0.9).max(1.0);
    let step = t.step(mean) * l.decode;
    Capacity {
        per_replica: (seqs / (osl * step / 1000.0)).max(1e-9),
        service_ms: step,
        infeasible,
    }
}

/// An aggregated worker does both phases: their times add up per request.
pub fn aggregated_capacity(p: &Capacity, d: &Capacity) -> Capacity {
    let per = 1.0 / (1.0 / p.per_replica + 1.0 / d.per_replica);
    let infeasible = [p.infeasible.as_str(), d.infeasible.as_str()]
        .iter()
        .filter(|s| !s.is_empty())
        .cloned()
        .collect::<Vec<_>>()
        .join("; ");
    Capacity {
        per_replica: per,
        service_ms: p.service_ms,
        infeasible,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_capacity_meets_the_ttft_it_sizes_for() {
        let t = EngineTiming::mocker_default();
        let l = Learned::default();
        let c = prefill_capacity(&t, &l, 1000.0, 500.0);
        // One 1,000-token prefill: 0.42 + 15.2 + 16.5 ≈ 32 ms.
        assert!((c.service_ms - 32.1).abs() < 0.5, "{c:?}");
        let rho = c.per_replica * c.service_ms / 1000.0;
        let wait = TAIL * rho * c.service_ms / (2.0 * (1.0 - rho));
        assert!(c.service_ms + wait <= 500.0 + 1e-6);
        assert!(rho <= MAX_RHO + 1e-9);
        assert!(c.infeasible.is_empty());
        // Slower learned prefill → less capacity.
        let slow = Learned {
            prefill: 2.0,
            ..Learned::default()
        };
        assert!(prefill_capacity(&t, &slow, 1000.0, 500.0).per_replica < c.per_replica);
        // A target below one prefill cannot be met, and says so.
        let bad = prefill_capacity(&t, &l, 1000.0, 10.0);
        assert!(
            bad.infeasible.contains("over the 10 ms TTFT target"),
            "{bad:?}"
        );
    }

    #[test]
    fn decode_capacity_follows_the_itl_target_and_the_kv() {
        let t = EngineTiming::mocker_default();
        let l = Learned::default();
        let tight = decode_capacity(&t, &l, 1000.0, 200.0, 15.0, 1.0);
        let loose = decode_capacity(&t, &l, 1000.0, 200.0, 50.0, 1.0);
        assert!(tight.service_ms <= 15.0 + 1e-6, "{tight:?}");
        // The occupancy's 90th percentile meets the target, not its mean.
        let live = 1000.0 + 100.0;
        let mean = tight.per_replica * 200.0 * tight.service_ms / 1000.0 * live / t.kv_tokens;
        let tail = decode_tail_utilisation(&t, mean, live, 1.0);
        assert!(tail > mean);
        assert!(
            (t.step(tail) - 15.0).abs() < 0.05,
            "{} ms at {tail}",
            t.step(tail)
        );
        assert!(loose.per_replica > tight.per_replica);
        // Longer prompts hold more KV: fewer sequences fit.
        let long = decode_capacity(&t, &l, 8000.0, 200.0, 15.0, 1.0);
        assert!(long.per_replica < tight.per_replica);
        assert!(decode_capacity(&t, &l, 100.0, 10.0, 1.0, 1.0)
            .infeasible
            .contains("ITL target"));
        // Replicas that share a load vary less each: more fit per replica,
        // never past the limit itself.
        let fleet = decode_capacity(&t, &l, 1000.0, 200.0, 15.0, 8.0);
        assert!(fleet.per_replica > tight.per_replica);
        assert!(fleet.service_ms <= 15.0 + 1e-6);
    }

    #[test]
    fn learning_converges_and_stays_bounded() {
        let t = EngineTiming::mocker_default();
        let mut l = Learned::default();
        // A seed that is off by 20%: three samples take most of it away.
        let mut quick = Learned::default();
        for _ in 0..3 {
            quick.decode_sample(&t, 0.3, t.step(0.3) * 1.2);
        }
        assert!((quick.decode - 1.15).abs() < 1e-9, "{quick:?}");
        for _ in 0..40 {
            l.prefill_sample(&t, 500.0, t.prefill(500.0) * 1.6);
            l.decode_sample(&t, 0.3, t.step(0.3) * 0.7);
        }
        assert!((l.prefill - 1.6).abs() < 0.01, "{l:?}");
        assert!((l.decode - 0.7).abs() < 0.01, "{l:?}");
        for _ in 0..40 {
            l.prefill_sample(&t, 500.0, 1e12);
            l.decode_sample(&t, 0.3, f64::NAN);
        }
        assert!(l.prefill <= MAX_FACTOR && (l.decode - 0.7).abs() < 0.01);
    }

    #[test]
    fn a_window_of_workers_is_one_sample() {
        let t = EngineTiming::mocker_default();
        let mut l = Learned::default();
        // Two workers, one 1.5× and one 0.5× the model at the same load:
        // one blend toward 1.0, not two toward the last one.
        l.decode_window(&t, &[(0.5, t.step(0.5) * 1.5), (0.5, t.step(0.5) * 0.5)]);
        assert_eq!(l.decode_samples, 1);
        assert!((l.decode - 1.0).abs() < 1e-9, "{l:?}");
        // At different loads, the total observed over the total predicted
        // (a busier worker's steps are more of the time), not a mean of
        // the two ratios.
        let mut k = Learned::default();
        let (a, b) = (t.step(0.2), t.step(0.9));
        k.decode_window(&t, &[(0.2, a * 1.5), (0.9, b * 0.5)]);
        let r = (1.5 * a + 0.5 * b) / (a + b);
        // The first sample is averaged with the seed.
        assert!((k.decode - (1.0 + r) / 2.0).abs() < 1e-9, "{k:?}");
        assert!(r < 1.0);
        l.prefill_window(&t, &[(500.0, t.prefill(500.0) * 2.0)]);
        assert!(l.prefill > 1.0 && l.prefill_samples == 1);
        // An empty window or nonsense teaches nothing.
        l.decode_window(&t, &[]);
        l.decode_window(&t, &[(f64::NAN, 3.0), (0.5, f64::INFINITY)]);
        assert_eq!(l.decode_samples, 1);
    }

    #[test]
    fn speedup_scales_time_and_capacity() {
        let mut t = EngineTiming::mocker_default();
        let l = Learned::default();
        let base = decode_capacity(&t, &l, 1000.0, 100.0, 30.0, 1.0).per_replica;
        t.speedup = 10.0;
        // At 10× speed a step meets a 10× tighter ITL at the same utilisation.
        let fast = decode_capacity(&t, &l, 1000.0, 100.0, 3.0, 1.0).per_replica;
        assert!((fast / base - 10.0).abs() < 0.05, "{fast} vs {base}");
    }
}
