//! Online serving: TTFT, ITL and throughput of one aggregated replica at a
//! request rate or a number of concurrent clients, with the queueing that
//! implies; and its offline maximum throughput.
//!
//! The replica runs in-flight batching with chunked prefill: every step
//! carries the decoding sequences and up to `max_num_tokens` tokens in
//! all. At an arrival rate λ and a step time T, a step carries λ·T new
//! prompts (λ·T·isl tokens) and λ·T·(osl−1) decoding sequences (Little's
//! law), and T is the step model's time of that step: a fixed point found
//! by iteration. The replica is saturated when no fixed point exists, the
//! decoding sequences exceed the batch cap or KV pool, or the step's
//! tokens exceed its budget.
//!
//! TTFT is the serving overhead, the wait for the running step to end
//! (half a step), the prompt's wait for room in the step budget (M/D/1 in
//! the budget's utilisation), and the steps that carry its chunks. ITL is
//! the step. A closed loop of C clients runs at the rate λ with
//! λ·(TTFT + (osl−1)·ITL) = C, found by bisection.
//!
//! Invariants: every reported figure is finite and positive; a load past
//! saturation is reported as saturated, never as a finite latency.

use crate::perf::{Step, StepModel};
use serde::Serialize;

/// What one replica serves.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Workload {
    pub isl: f64,
    pub osl: f64,
    /// Token budget of one step.
    pub max_num_tokens: f64,
    /// Most sequences running at once (the engine's cap, or what the KV
    /// pool holds at the expected live context).
    pub max_batch: f64,
    /// Serving overhead before the first step, ms.
    pub serving_ms: f64,
}

/// The load offered to one replica.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Load {
    /// Poisson arrivals, requests/s.
    Rate(f64),
    /// Closed-loop clients, each sending its next request when the last ends.
    Concurrency(f64),
}

/// Predicted service at a load.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Service {
    /// Requests/s completed.
    pub rate: f64,
    pub ttft_ms: f64,
    pub itl_ms: f64,
    /// Output tokens/s of the replica.
    pub output_tokens_per_s: f64,
    /// Sequences decoding in an average step.
    pub batch: f64,
}

/// The step of a replica at arrival rate `rate`, µs, and its decoding
/// sequences; None when the rate saturates it.
fn steady(sm: &StepModel, w: &Workload, rate: f64) -> Option<(f64, f64)> {
    let ctx = w.isl + w.osl / 2.0;
    let step_at = |t_us: f64| {
        let per_step = rate * t_us * 1e-6;
        let decode = per_step * (w.osl - 1.0).max(0.0);
        let t = sm
            .step(&Step {
                decode,
                decode_ctx: ctx,
                prefill: per_step * w.isl,
                prefill_seqs: per_step,
                prefill_past: 0.0,
            })
            .total();
        (t, decode, per_step * w.isl)
    };
    let t = fixed_point(|t| step_at(t).0)?;
    // The limits hold at the fixed point, not on the way there.
    let (_, decode, prefill) = step_at(t);
    (decode <= w.max_batch && decode + prefill <= w.max_num_tokens).then_some((t, decode))
}

/// The smallest T ≥ f(0) with T = f(T), for f increasing; None when none
/// is found below 10⁹. Iterates, jumping to the fixed point of the secant
/// through the last two iterates (Steffensen) where that lies ahead, which
/// converges in a few steps even near capacity where plain iteration
/// crawls; where f is locally steeper than the identity (MoE layers
/// touching more experts as tokens grow), plain iteration walks on
/// towards the next fixed point.
pub fn fixed_point(f: impl Fn(f64) -> f64) -> Option<f64> {
    let mut t = f(0.0);
    for _ in 0..200 {
        let t1 = f(t);
        if !t1.is_finite() {
            return None;
        }
        if (t1 - t).abs() <= 1e-6 * t {
            return Some(t1);
        }
        let t2 = f(t1);
        let slope = (t2 - t1) / (t1 - t);
        let jump = t1 + (t2 - t1) / (1.0 - slope);
        t = if slope < 1.0 && jump.is_finite() && jump > 0.0 {
            jump
        } else {
            t2
        };
        if t > 1e9 {
            return None;
        }
    }
    None
}

/// Service at Poisson rate `rate`; None past saturation.
fn at_rate(sm: &StepModel, w: &Workload, rate: f64) -> Option<Service> {
    let (t_us, decode) = steady(sm, w, rate)?;
    let per_step = rate * t_us * 1e-6;
    let room = (w.max_num_tokens - decode).max(1.0);
    let rho = per_step * w.isl / room;
    if rho >= 1.0 {
        return None;
    }
    let (chunks, chunk) = prompt_chunks(w.isl, room);
    let with_prompt = sm
        .step(&Step {
            decode,
            decode_ctx: w.isl + w.osl / 2.0,
            prefill: chunk.max(per_step * w.isl),
            prefill_seqs: per_step.max(1.0),
            prefill_past: chunked_past(chunks, chunk),
        })
        .total();
    let wait = t_us / 2.0 + rho / (2.0 * (1.0 - rho)) * t_us;
    let ttft_ms = w.serving_ms + (wait + chunks * with_prompt) / 1e3;
    Some(Service {
        rate,
        ttft_ms,
        itl_ms: t_us / 1e3,
        output_tokens_per_s: rate * w.osl,
        batch: decode,
    })
}

/// How a prompt of `isl` tokens goes through steps with `room` tokens of
/// budget left: the number of chunks, and their (equal) size.
pub fn prompt_chunks(isl: f64, room: f64) -> (f64, f64) {
    let chunks = (isl / room.max(1.0)).ceil().max(1.0);
    (chunks, isl / chunks)
}

/// The mean context before each chunk of a prompt computed in `chunks`
/// chunks of `chunk` tokens: chunk k attends to the k·chunk tokens before
/// it, and attention is linear in that context, so `chunks` steps at this
/// mean cost what the chunks cost.
pub fn chunked_past(chunks: f64, chunk: f64) -> f64 {
    (chunks - 1.0).max(0.0) / 2.0 * chunk
}

/// The highest rate the replica sustains, requests/s.
pub fn capacity(sm: &StepModel, w: &Workload) -> f64 {
    let (mut lo, mut hi) = (0.0, 1.0);
    while at_rate(sm, w, hi).is_some() && hi < 1e7 {
        lo = hi;
        hi *= 2.0;
    }
    for _ in 0..30 {
        let mid = (lo + hi) / 2.0;
        if at_rate(sm, w, mid).is_some() {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// Service at `load`; None when the load saturates the replica (a rate
/// past capacity; a closed loop never saturates, it runs at capacity).
pub fn serve(sm: &StepModel, w: &Workload, load: Load) -> Option<Service> {
    serve_within(sm, w, load, None)
}

/// [`serve`] for a replica whose [`capacity`] is already known (the
/// search asks one layout for many loads).
pub fn serve_within(
    sm: &StepModel,
    w: &Workload,
    load: Load,
    capacity_known: Option<f64>,
) -> Option<Service> {
    match load {
        Load::Rate(r) if r > 0.0 && r.is_finite() => at_rate(sm, w, r),
        Load::Concurrency(c) if c > 0.0 && c.is_finite() => {
            let cap = capacity_known.unwrap_or_else(|| capacity(sm, w));
            if cap.is_nan() || cap <= 0.0 {
                return None;
            }
            let in_system =
                |s: &Service| s.rate * (s.ttft_ms + (w.osl - 1.0).max(0.0) * s.itl_ms) / 1e3;
            let near_cap = at_rate(sm, w, cap * 0.999)?;
            if in_system(&near_cap) <= c {
                // More clients than the replica holds: the extra ones queue
                // and the replica runs at capacity.
                let queued = c - in_system(&near_cap);
                let mut s = near_cap;
                s.ttft_ms += queued / s.rate * 1e3;
                return Some(s);
            }
            let (mut lo, mut hi) = (0.0, cap * 0.999);
            for _ in 0..24 {
                let mid = (lo + hi) / 2.0;
                match at_rate(sm, w, mid) {
                    Some(s) if in_system(&s) < c => lo = mid,
                    _ => hi = mid,
                }
            }
            at_rate(sm, w, lo.max(1e-9))
        }
        _ => None,
    }
}

/// A finite run: `n` requests arriving at `rate` (Poisson), measured from
/// the first arrival to the last token. Returns the mean TTFT, the mean
/// ITL, and the achieved rate and output tokens/s over the run.
///
/// Three regimes:
/// - the replica sustains the rate with at most `n` requests in flight:
///   the steady state, and the run lasts the arrivals plus one request;
/// - all `n` fit in the batch at once but arrive faster than they can be
///   prefilled or decoded in steady state (a burst): they decode together
///   (the ITL of a closed loop of `n`), and prompts queue for prefill, the
///   k-th waiting k × (prefill time − arrival gap) when that is positive;
/// - more than the batch holds, past capacity: the replica runs at
///   capacity and requests queue for a slot, the queue growing at the
///   difference of the arrival rate and capacity.
pub fn finite(sm: &StepModel, w: &Workload, n: f64, rate: f64) -> Option<Service> {
    if !(n >= 1.0 && n.is_finite() && rate > 0.0 && rate.is_finite()) {
        return None;
    }
    let tail = |s: &Service| (s.ttft_ms + (w.osl - 1.0).max(0.0) * s.itl_ms) / 1e3;
    let done = |mut s: Service, duration: f64| {
        s.rate = n / duration;
        s.output_tokens_per_s = n * w.osl / duration;
        Some(s)
    };
    let capped = Workload {
        max_batch: w.max_batch.min(n),
        ..*w
    };
    if let Some(s) = at_rate(sm, &capped, rate) {
        // Steady state holds while fewer than `n` requests are in flight
        // (Little's law).
        if rate * tail(&s) < n {
            let duration = (n - 1.0) / rate + tail(&s);
            return done(s, duration);
        }
    }
    if n <= w.max_batch {
        // A burst: every request is admitted as it arrives.
        let mut s = serve(sm, &capped, Load::Concurrency(n))?;
        let ctx = w.isl + w.osl / 2.0;
        let room = (w.max_num_tokens - n / 2.0).max(1.0);
        let (chunks, chunk) = prompt_chunks(w.isl, room);
        let prefill_ms = chunks
            * sm.step(&Step {
                decode: n / 2.0,
                decode_ctx: ctx,
                prefill: chunk,
                prefill_seqs: 1.0,
                prefill_past: chunked_past(chunks, chunk),
            })
            .total()
            / 1e3;
        let lag_ms = (prefill_ms - 1e3 / rate).max(0.0);
        let first_ms = w.serving_ms + s.itl_ms / 2.0 + prefill_ms;
        s.ttft_ms = first_ms + (n - 1.0) / 2.0 * lag_ms;
        let last_ttft_ms = first_ms + (n - 1.0) * lag_ms;
        let duration = (n - 1.0) / rate + (last_ttft_ms + (w.osl - 1.0).max(0.0) * s.itl_ms) / 1e3;
        return done(s, duration);
    }
    // Past capacity with more requests than slots.
    let cap = capacity(sm, w);
    let mut s = at_rate(sm, w, cap * 0.999)?;
    let gap = (1.0 / cap - 1.0 / rate).max(0.0);
    s.ttft_ms += (n - 1.0) / 2.0 * gap * 1e3;
    let duration = (n - 1.0) / cap.min(rate) + tail(&s);
    done(s, duration)
}

/// Offline maximum throughput, output tokens/s: every request queued at
/// once, the replica running as many sequences as its cap, KV pool and
/// step budget allow (each sequence's prompt shares the steps with the
/// decodes: `isl/osl` prompt tokens per decode token).
pub fn max_throughput(sm: &StepModel, w: &Workload) -> f64 {
    let per_decode = 1.0 + w.isl / w.osl;
    let batch = w.max_batch.min(w.max_num_tokens / per_decode).max(1.0);
    let t = sm
        .step(&Step {
            decode: batch,
            decode_ctx: w.isl + w.osl / 2.0,
            prefill: batch * w.isl / w.osl,
            prefill_seqs: batch / w.osl,
            prefill_past: 0.0,
        })
        .total();
    batch / (t * 1e-6)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calib::{Calibration, H200_JSON};
    use crate::memory::{Deployment, Dtype, MemoryPolicy};
    use crate::perf::EngineProfile;
    use crate::Catalog;

    #[test]
    fn a_prompt_is_cut_into_equal_chunks_that_fit_the_room() {
        assert_eq!(prompt_chunks(1000.0, 8192.0), (1.0, 1000.0));
        // 10,000 tokens through 8,167 of room: two chunks of 5,000, not
        // two of 8,167.
        assert_eq!(prompt_chunks(10000.0, 8167.0), (2.0, 5000.0));
        assert_eq!(prompt_chunks(5000.0, 0.0), (5000.0, 1.0));
    }

    #[test]
    fn chunked_past_is_the_mean_context_before_each_chunk() {
        assert_eq!(chunked_past(1.0, 5000.0), 0.0);
        // Chunks attend to 0, 2048 and 4096 tokens before them.
        assert_eq!(chunked_past(3.0, 2048.0), 2048.0);
    }

    fn with<R>(f: impl FnOnce(&StepModel, &Workload) -> R) -> R {
        let c = Catalog::builtin().unwrap();
        let cal = Calibration::parse(H200_JSON, c.gpu("H200").unwrap()).unwrap();
        let sm = StepModel {
            model: c.model("Llama-3.1-8B").unwrap(),
            gpu: c.gpu("H100").unwrap(),
            deployment: Deployment {
                tp: 1,
                pp: 1,
                weights: Dtype::Fp8,
                kv: Dtype::Fp8,
                memory: MemoryPolicy::DEFAULT,
                expert_parallel: false,
                dp_attention: false,
                overlap: false,
            },
            profile: EngineProfile::current(&cal),
            calib: &cal,
        };
        let w = Workload {
            isl: 1000.0,
            osl: 200.0,
            max_num_tokens: 8192.0,
            max_batch: 256.0,
            serving_ms: 5.0,
        };
        f(&sm, &w)
    }

    #[test]
    fn latency_grows_with_load_and_saturates_at_capacity() {
        with(|sm, w| {
            let cap = capacity(sm, w);
            assert!(cap > 1.0, "{cap}");
            let light = serve(sm, w, Load::Rate(cap * 0.1)).unwrap();
            let heavy = serve(sm, w, Load::Rate(cap * 0.9)).unwrap();
            assert!(heavy.ttft_ms > light.ttft_ms, "{heavy:?} vs {light:?}");
            assert!(heavy.itl_ms > light.itl_ms);
            assert!(heavy.batch > light.batch);
            // At light load TTFT is about the overhead plus one prefill.
            let alone = sm.prefill_us(1.0, 1000.0) / 1e3;
            assert!(light.ttft_ms > 5.0 + alone * 0.9, "{light:?}");
            assert!(light.ttft_ms < 5.0 + alone * 3.0, "{light:?}");
            assert!(serve(sm, w, Load::Rate(cap * 1.5)).is_none());
            // Offline throughput is at least what any sustained rate gives.
            assert!(max_throughput(sm, w) >= heavy.output_tokens_per_s);
        });
    }

    #[test]
    fn a_finite_run_is_steady_light_and_queues_in_a_burst() {
        with(|sm, w| {
            let cap = capacity(sm, w);
            // Light: the steady state, the run's rate about the offered one.
            let light = finite(sm, w, 500.0, cap * 0.2).unwrap();
            let steady = serve(sm, w, Load::Rate(cap * 0.2)).unwrap();
            assert_eq!(light.ttft_ms, steady.ttft_ms);
            assert!(
                light.rate < cap * 0.2 && light.rate > cap * 0.1,
                "{light:?}"
            );
            // A burst of long prompts faster than they prefill: TTFT grows
            // with the queue, far past one prefill.
            let long = Workload { isl: 8000.0, ..*w };
            let burst = finite(sm, &long, 50.0, 100.0).unwrap();
            let alone = sm.prefill_us(1.0, 8000.0) / 1e3;
            assert!(burst.ttft_ms > 10.0 * alone, "{burst:?} vs {alone}");
            // Past capacity with more requests than slots: the run's rate
            // is the capacity.
            let over = finite(sm, w, 5000.0, cap * 3.0).unwrap();
            assert!(over.rate <= cap * 1.001, "{over:?} vs {cap}");
            assert!(over.ttft_ms > steady.ttft_ms * 10.0);
        });
    }

    #[test]
    fn a_closed_loop_holds_its_clients_in_the_system() {
        with(|sm, w| {
            for c in [1.0, 8.0, 64.0] {
                let s = serve(sm, w, Load::Concurrency(c)).unwrap();
                let in_system = s.rate * (s.ttft_ms + (w.osl - 1.0) * s.itl_ms) / 1e3;
                assert!((in_system / c - 1.0).abs() < 0.01, "{c}: {s:?}");
            }
            // Far more clients than the batch cap: capacity, and queueing in TTFT.
            let many = serve(sm, w, Load::Concurrency(5000.0)).unwrap();
            let cap = capacity(sm, w);
            assert!(many.rate <= cap * 1.0001 && many.rate > cap * 0.99);
            assert!(many.ttft_ms > 1000.0, "{many:?}");
            assert!(serve(sm, w, Load::Concurrency(0.0)).is_none());
        });
    }
}
