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
//! - **Output lengths while a period is young.** A period of traffic starts
//!   when the load stood idle (no arrival, no open stream). Counting each
//!   open stream at the tokens it has streamed so far, the mean over the
//!   period's finished requests and its open streams is a lower bound on
//!   the period's mean output length: every request of the period is in
//!   one set or the other, and no open stream is shorter at its end. Early
//!   on it is far above the finished requests' mean, which is only the
//!   short ones. The output length sized for is the larger of the two
//!   while the period is young: until its finished requests outnumber the
//!   open streams [`YOUNG_FINISHED_PER_STREAM`] times. After that the open
//!   streams, a sample biased to long requests, no longer count.
//!   A young period is sized for at least the deployment's expected output
//!   length where its spec gives one (what it was planned for): in its
//!   first seconds no stream has yet streamed what it will.
//!
//! Invariants: every estimate is finite and ≥ 0; the history holds at most
//! [`RATE_WINDOWS`] windows; a window without requests leaves the lengths
//! as they were (decayed weights keep their means); the period's sums
//! start again after a window with no arrival and no open stream.

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
/// A period is young until its finished requests outnumber its open
/// streams this many times.
pub const YOUNG_FINISHED_PER_STREAM: u64 = 8;

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
    /// This period's finished requests and their output tokens (not
    /// decayed), and the open streams at the last window.
    #[serde(default)]
    period: Period,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
struct Period {
    finished: u64,
    osl_sum: f64,
    streams: u64,
    stream_tokens: u64,
}

/// What one window saw of the requests, for [`Demand::observe`].
#[derive(Clone, Copy, Debug, Default)]
pub struct Seen {
    /// Its length, seconds.
    pub secs: f64,
    pub arrivals: u64,
    /// Prompts whose length it saw, and their mean.
    pub prompts: u64,
    pub isl: Option<f64>,
    /// Requests that finished, and their mean output length.
    pub finished: u64,
    pub osl: Option<f64>,
    /// Streams open at its end, and the tokens they have streamed.
    pub streams: u64,
    pub stream_tokens: u64,
}

impl Demand {
    /// One sizing window.
    pub fn observe(&mut self, w: Seen) {
        if w.secs.is_finite() && w.secs > 0.0 {
            self.windows.push_back((w.secs, w.arrivals));
            while self.windows.len() > RATE_WINDOWS {
                self.windows.pop_front();
            }
        }
        self.isl.add(w.prompts, w.isl, ISL_HALF_LIFE_WINDOWS);
        self.osl.add(w.finished, w.osl, OSL_HALF_LIFE_WINDOWS);
        let p = &mut self.period;
        if w.arrivals == 0 && w.streams == 0 {
            *p = Period::default();
            return;
        }
        if let Some(m) = w.osl.filter(|m| m.is_finite() && *m >= 0.0) {
            p.finished = p.finished.saturating_add(w.finished);
            p.osl_sum += w.finished as f64 * m;
        }
        p.streams = w.streams;
        p.stream_tokens = w.stream_tokens;
    }

    /// The output length to size for: the finished requests' decayed mean,
    /// or while the period is young, the largest of that, the period's lower
    /// bound and `expected` (see the module doc). `None` before anything
    /// is known.
    pub fn osl_estimate(&self, expected: Option<f64>) -> Option<f64> {
        let decayed = self.osl.mean();
        let p = &self.period;
        let young = p.finished < YOUNG_FINISHED_PER_STREAM.saturating_mul(p.streams.max(1));
        if !young {
            return decayed;
        }
        let n = p.finished.saturating_add(p.streams);
        let bound = (n > 0).then(|| (p.osl_sum + p.stream_tokens as f64) / n as f64);
        [
            decayed,
            bound,
            expected.filter(|e| e.is_finite() && *e > 0.0),
        ]
        .into_iter()
        .flatten()
        .reduce(f64::max)
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

    fn seen(
        secs: f64,
        arrivals: u64,
        prompts: u64,
        isl: Option<f64>,
        finished: u64,
        osl: Option<f64>,
    ) -> Seen {
        Seen {
            secs,
            arrivals,
            prompts,
            isl,
            finished,
            osl,
            ..Seen::default()
        }
    }

    #[test]
    fn the_rate_is_over_the_last_windows_with_a_noise_allowance() {
        let mut d = Demand::default();
        assert_eq!(d.rate(), None);
        for n in [40, 20, 20, 20] {
            d.observe(seen(2.0, n, n, Some(100.0), n, Some(10.0)));
        }
        // The oldest window (40) has left: 60 arrivals in 6 s.
        assert!((d.rate().unwrap() - 10.0).abs() < 1e-9);
        let up = d.rate_upper().unwrap();
        assert!((up - (60.0 + 60f64.sqrt()) / 6.0).abs() < 1e-9, "{up}");
        // Fewer arrivals: a relatively wider allowance.
        let mut light = Demand::default();
        for _ in 0..3 {
            light.observe(seen(2.0, 2, 2, None, 0, None));
        }
        let r = light.rate().unwrap();
        assert!(light.rate_upper().unwrap() / r > up / 10.0);
    }

    #[test]
    fn lengths_are_weighted_by_request_and_forget_slowly() {
        let mut d = Demand::default();
        d.observe(seen(2.0, 30, 30, Some(100.0), 30, Some(10.0)));
        // One long prompt in a window of one request barely moves the mean.
        d.observe(seen(2.0, 1, 1, Some(4000.0), 0, None));
        let isl = d.isl.mean().unwrap();
        assert!(isl > 100.0 && isl < 250.0, "{isl}");
        // Windows with no finished request keep the output mean, however many.
        for _ in 0..500 {
            d.observe(seen(2.0, 0, 0, None, 0, None));
        }
        assert!((d.osl.mean().unwrap() - 10.0).abs() < 1e-9);
        // A lasting change wins out.
        for _ in 0..40 {
            d.observe(seen(2.0, 30, 30, Some(1000.0), 30, Some(50.0)));
        }
        assert!((d.isl.mean().unwrap() - 1000.0).abs() < 10.0);
        assert!((d.osl.mean().unwrap() - 50.0).abs() < 1.0);
        // Nonsense is ignored.
        d.observe(seen(f64::NAN, 3, 3, Some(f64::INFINITY), 3, Some(-1.0)));
        assert!(d.isl.mean().unwrap().is_finite() && d.rate().unwrap().is_finite());
    }

    #[test]
    fn a_young_period_counts_open_streams_at_their_length_so_far() {
        let mut d = Demand::default();
        assert_eq!(d.osl_estimate(None), None);
        // What the deployment was planned for, before anything is seen.
        assert_eq!(d.osl_estimate(Some(60.0)), Some(60.0));
        // The first window: nothing finished, 20 streams have 40 tokens each.
        d.observe(Seen {
            secs: 2.0,
            arrivals: 20,
            streams: 20,
            stream_tokens: 800,
            ..Seen::default()
        });
        assert_eq!(d.osl_estimate(None), Some(40.0));
        assert_eq!(d.osl_estimate(Some(60.0)), Some(60.0));
        // The short ones finish first (10 of 20 tokens); the rest run on.
        d.observe(Seen {
            secs: 2.0,
            arrivals: 10,
            finished: 10,
            osl: Some(20.0),
            streams: 20,
            stream_tokens: 2000,
            ..Seen::default()
        });
        assert!((d.osl.mean().unwrap() - 20.0).abs() < 1e-9);
        // 10 finished at 20, 20 open at 100 so far: at least 73 tokens.
        let e = d.osl_estimate(None).unwrap();
        assert!((e - 2200.0 / 30.0).abs() < 1e-9, "{e}");
        // Once finished requests far outnumber the open streams, only their
        // mean counts: the open streams are a sample biased to long ones.
        for _ in 0..20 {
            d.observe(Seen {
                secs: 2.0,
                arrivals: 10,
                finished: 10,
                osl: Some(50.0),
                streams: 10,
                stream_tokens: 3000,
                ..Seen::default()
            });
        }
        assert_eq!(d.osl_estimate(Some(500.0)), d.osl.mean());
        // An idle window ends the period; the next one is young again.
        d.observe(Seen {
            secs: 2.0,
            ..Seen::default()
        });
        d.observe(Seen {
            secs: 2.0,
            arrivals: 5,
            streams: 5,
            stream_tokens: 1000,
            ..Seen::default()
        });
        assert_eq!(d.osl_estimate(None), Some(200.0));
    }
}
