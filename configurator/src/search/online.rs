//! Online mode of the search: every candidate predicted at the offered
//! load (a request rate or closed-loop clients) with the queueing it
//! implies ([`crate::online`]), instead of at each batch size.
//!
//! Aggregated replicas split the load evenly; a replica count a request
//! rate saturates is left out. Disaggregated deployments serve prompts
//! with prefill replicas as M/D/1 servers of prompt batches and decode at
//! the batch Little's law gives at the decode pool's share of the rate. A
//! closed loop never saturates: clients past what the pools hold queue
//! before their first token, aggregated or disaggregated alike.

use super::{keep_better, replica_counts, Candidate, Ctx, Layout, Mode};
use crate::online::{self, Load, Workload};

impl Ctx<'_> {
    /// A replica's online workload.
    pub(super) fn workload(&self, l: Layout, kv_tokens: u64) -> Workload {
        Workload {
            isl: self.q.isl as f64,
            osl: self.q.osl as f64,
            max_num_tokens: self.step_tokens(l) as f64,
            max_batch: self.max_batch(l, kv_tokens) as f64,
            serving_ms: self.profile.serving_ms,
        }
    }

    /// Online mode: every layout and replica count (aggregated), and every
    /// prefill and decode layout and P:D split (disaggregated), predicted
    /// at the offered load. A candidate that the load saturates is left
    /// out.
    pub(super) fn online(
        &self,
        layouts: &[(Layout, u64)],
        load: Load,
        sla: &dyn Fn(f64, f64) -> bool,
    ) -> Vec<Candidate> {
        let q = self.q;
        let osl = q.osl as f64;
        let split = |load: Load, n: u32| match load {
            Load::Rate(r) => Load::Rate(r / n as f64),
            Load::Concurrency(c) => Load::Concurrency(c / n as f64),
        };
        let mut out = Vec::new();
        for &(l, kv) in layouts {
            let sm = self.step_model(l);
            let w = self.workload(l, kv);
            // A closed loop needs the replica's capacity: once per layout.
            let cap = matches!(load, Load::Concurrency(_)).then(|| online::capacity(&sm, &w));
            for replicas in replica_counts(q.gpus / l.gpus()) {
                let Some(s) = online::serve_within(&sm, &w, split(load, replicas), cap) else {
                    continue;
                };
                let gpus = replicas * l.gpus();
                out.push(Candidate {
                    mode: Mode::Aggregated {
                        layout: l,
                        replicas,
                        batch: s.batch.round().max(1.0) as u32,
                    },
                    gpus,
                    ttft_ms: s.ttft_ms,
                    itl_ms: s.itl_ms,
                    tokens_per_s_per_user: 1e3 / s.itl_ms,
                    tokens_per_s_per_gpu: s.output_tokens_per_s * replicas as f64 / gpus as f64,
                    meets_sla: sla(s.ttft_ms, s.itl_ms),
                });
            }
        }
        // Disaggregated: prefill replicas as M/D/1 servers of prompt
        // batches; decode replicas at the batch Little's law gives.
        let transfer_ms = self.transfer_s() * 1e3;
        for &(pl, _) in layouts {
            let (n, p_us) = self.prefill(pl);
            let p_rate = n as f64 / (p_us * 1e-6);
            for &(dl, kv) in layouts {
                let dsm = self.step_model(dl);
                let max_batch = self.workload(dl, kv).max_batch;
                let ctx = q.isl as f64 + osl / 2.0;
                let mut best: Option<Candidate> = None;
                for pr in replica_counts(q.gpus / pl.gpus()) {
                    let left = q.gpus - pr * pl.gpus();
                    for dr in replica_counts(left / dl.gpus()) {
                        // Service at total rate `rate`: (TTFT, ITL, batch).
                        let at = |rate: f64| -> Option<(f64, f64, f64)> {
                            let rho = rate / (pr as f64 * p_rate);
                            if rho >= 1.0 {
                                return None;
                            }
                            let ttft = self.disagg_ttft_ms(p_us, rho, transfer_ms);
                            let per = rate / dr as f64;
                            let t = decode_fixed_point(&|b| dsm.decode_us(b, ctx), per * osl)?;
                            let b = (per * osl * t * 1e-6).max(1.0);
                            (b <= max_batch).then_some((ttft, t / 1e3, b))
                        };
                        let rate = match load {
                            Load::Rate(r) => r,
                            Load::Concurrency(c) => {
                                // A closed loop: the decode pool holds the
                                // clients that are decoding (first all of
                                // them, then the share the rate implies);
                                // the rate solves rate × (TTFT + decode
                                // time) = clients, TTFT from the prefill
                                // pool's queue.
                                let mu = pr as f64 * p_rate;
                                let ttft = |r: f64| self.disagg_ttft_ms(p_us, r / mu, transfer_ms);
                                let mut rate = 0.0;
                                let mut decoding = c;
                                for _ in 0..4 {
                                    let b = (decoding / dr as f64).clamp(1.0, max_batch.max(1.0));
                                    let d_ms = (osl - 1.0) * dsm.decode_us(b, ctx) / 1e3;
                                    let (mut lo, mut hi) = (0.0, mu);
                                    for _ in 0..40 {
                                        let mid = (lo + hi) / 2.0;
                                        if mid * (ttft(mid) + d_ms) / 1e3 < c {
                                            lo = mid;
                                        } else {
                                            hi = mid;
                                        }
                                    }
                                    rate = lo;
                                    decoding = rate * d_ms / 1e3;
                                }
                                rate
                            }
                        };
                        let (ttft, itl, batch) = match (at(rate), load) {
                            (Some(x), _) => x,
                            (None, Load::Concurrency(c)) => {
                                // More clients than the pools hold: they
                                // run at the highest rate the pools
                                // sustain, and the rest queue before their
                                // first token.
                                // The decode pool at its batch cap, and
                                // the prefill pool short of saturation.
                                let full = dsm.decode_us(max_batch.max(1.0), ctx);
                                let decode_cap = dr as f64 * max_batch / (osl * full * 1e-6);
                                let lo = 0.999 * decode_cap.min(0.999 * pr as f64 * p_rate);
                                let Some((ttft, itl, batch)) = at(lo).filter(|_| lo > 0.0) else {
                                    continue;
                                };
                                let held = lo * (ttft + (osl - 1.0) * itl) / 1e3;
                                let queued = (c - held).max(0.0);
                                (ttft + queued / lo * 1e3, itl, batch)
                            }
                            (None, Load::Rate(_)) => continue,
                        };
                        let c = self.disagg_candidate(
                            (pl, pr, n),
                            (dl, dr, batch.round() as u32),
                            rate,
                            ttft,
                            itl,
                            sla,
                        );
                        keep_better(&mut best, c);
                    }
                }
                out.extend(best);
            }
        }
        out
    }
}

/// The decode step T (µs) at which `tokens_per_s` output tokens/s keep
/// `tokens_per_s × T` sequences decoding: T = step(tokens_per_s × T).
/// None when no such step exists (the pool cannot keep up).
fn decode_fixed_point(step: &dyn Fn(f64) -> f64, tokens_per_s: f64) -> Option<f64> {
    online::fixed_point(|t| step((tokens_per_s * t * 1e-6).max(1.0)))
}
