//! What the load asks for: the arrival rate and the request lengths the
//! sizing rule works from, estimated from the sizing windows.
//!
//! - **Rate.** The arrivals of the last [`RATE_WINDOWS`] sizing windows
//!   over their length. One window's count is noisy (Poisson: ±1/√n, so
//!   ±21% for 22 arrivals), and sizing on it grows on noise and holds the
//!   growth for a whole shrink window. The rate sized for is that estimate
//!   plus [`RATE_Z`] standard deviations of its Poisson noise, so a light
//!   load, whose estimate is least sure, gets the widest allowance.
//! - **Lengths.** Prompt and output lengths are means weighted by request,
//!   decayed per window. Lengths are heavy-tailed: one window's mean moves
//!   by a third with a single long prompt, and capacity per replica moved
//!   with it. Prompt lengths have a half-life of [`ISL_HALF_LIFE_WINDOWS`].
//!   Output lengths are known only when a request finishes, and the first
//!   to finish are the short ones, so what a new load shows first is biased
//!   short: they forget faster ([`OSL_HALF_LIFE_WINDOWS`]).
//!
//! Invariants: every estimate is finite and ≥ 0; the history holds at most
//! [`RATE_WINDOWS`] windows; a window without requests leaves the lengths
//! as they were (decayed weights keep their means).

use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// Sizing windows the rate is estimated over.
pub const RATE_WINDOWS: usize = 3;
/// Standard deviations of Poisson noise added to the rate sized for.
pub const RATE_Z: f64 = 1.0;
/// Windows after which a prompt-length sample weighs half.
pub const ISL_HALF_LIFE_WINDOWS: f64 = 8.0;
/// Windows after which an output-length sample weighs half.
pub const OSL_HALF_LIFE_WINDOWS: f64 = 3.0;

/// A mean weighted by count, decayed per window.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DecayedMean {
    weight: f64,
    sum: f64,
}

impl DecayedMean {
    /// Ages what is held by one window (a sample weighs half after
    /// `half_life` windows), then adds `count` samples of mean `mean`.
    /// A window without samples changes nothing: after an idle spell the
    /// lengths are those seen before it.
    pub fn add(&mut self, count: u64, mean: Option<f64>, half_life: f64) {
        let Some(m) = mean.filter(|m| m.is_finite() && *m >= 0.0 && count > 0) else {
            return;
        };
        let decay = 0.5f64.powf(1.0 / half_life.max(1e-3));
        self.weight = self.weight * decay + count as f64;
        self.sum = self.sum * decay + count as f64 * m;
    }
    /// The mean, or `None` before any sample.
    pub fn mean(&self) -> Option<f64> {
        (self.weight > 1e-9).then(|| self.sum / self.weight)
    }
}

/// The demand estimates one planner keeps (part of its memory).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Demand {
    /// The last sizing windows: (seconds, arrivals), newest last.
    windows: VecDeque<(f64, u64)>,
    pub isl: DecayedMean,
    pub osl: DecayedMean,
}

impl Demand {
    /// One sizing window: its length, arrivals, and the requests whose
    /// prompt (`prompts`, mean `isl`) and output (`finished`, mean `osl`)
    /// lengths it saw.
    pub fn observe(
        &mut self,
        secs: f64,
        arrivals: u64,
        prompts: u64,
        isl: Option<f64>,
        finished: u64,
        osl: Option<f64>,
    ) {
        if secs.is_finite() && secs > 0.0 {
            self.windows.push_back((secs, arrivals));
            while self.windows.len() > RATE_WINDOWS {
                self.windows.pop_front();
            }
        }
        self.isl.add(prompts, isl, ISL_HALF_LIFE_WINDOWS);
        self.osl.add(finished, osl, OSL_HALF_LIFE_WINDOWS);
    }

    /// Arrivals per second over the windows held (`None` before any).
    pub fn rate(&self) -> Option<f64> {
        let (secs, n) = self.totals();
        (secs > 0.0).then(|| n / secs)
    }

    /// [`Self::rate`] plus [`RATE_Z`] standard deviations of its Poisson
    /// noise (with at least one arrival's worth, so an empty history does
    /// not claim certainty).
    pub fn rate_upper(&self) -> Option<f64> {
        let (secs, n) = self.totals();
        (secs > 0.0).then(|| (n + RATE_Z * n.max(1.0).sqrt()) / secs)
    }

    fn totals(&self) -> (f64, f64) {
        self.windows
            .iter()
            .fold((0.0, 0.0), |(s, n), (ws, wn)| (s + ws, n + *wn as f64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_is_over_the_last_windows_with_a_noise_allowance() {
        let mut d = Demand::default();
        assert_eq!(d.rate(), None);
        for n in [40, 20, 20, 20] {
            d.observe(2.0, n, n, Some(100.0), n, Some(10.0));
        }
        // The oldest window (40) has left: 60 arrivals in 6 s.
        assert!((d.rate().unwrap() - 10.0).abs() < 1e-9);
        let up = d.rate_upper().unwrap();
        assert!((up - (60.0 + 60f64.sqrt()) / 6.0).abs() < 1e-9, "{up}");
        // Fewer arrivals: a relatively wider allowance.
        let mut light = Demand::default();
        for _ in 0..3 {
            light.observe(2.0, 2, 2, None, 0, None);
        }
        let r = light.rate().unwrap();
        assert!(light.rate_upper().unwrap() / r > up / 10.0);
    }

    #[test]
    fn lengths_are_weighted_by_request_and_forget_slowly() {
        let mut d = Demand::default();
        d.observe(2.0, 30, 30, Some(100.0), 30, Some(10.0));
        // One long prompt in a window of one request barely moves the mean.
        d.observe(2.0, 1, 1, Some(4000.0), 0, None);
        let isl = d.isl.mean().unwrap();
        assert!(isl > 100.0 && isl < 250.0, "{isl}");
        // Windows with no finished request keep the output mean, however many.
        for _ in 0..500 {
            d.observe(2.0, 0, 0, None, 0, None);
        }
        assert!((d.osl.mean().unwrap() - 10.0).abs() < 1e-9);
        // A lasting change wins out.
        for _ in 0..40 {
            d.observe(2.0, 30, 30, Some(1000.0), 30, Some(50.0));
        }
        assert!((d.isl.mean().unwrap() - 1000.0).abs() < 10.0);
        assert!((d.osl.mean().unwrap() - 50.0).abs() < 1.0);
        // Nonsense is ignored.
        d.observe(f64::NAN, 3, 3, Some(f64::INFINITY), 3, Some(-1.0));
        assert!(d.isl.mean().unwrap().is_finite() && d.rate().unwrap().is_finite());
    }
}
