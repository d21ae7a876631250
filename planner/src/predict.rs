//! Forecasts of one series (arrival rate, ISL, OSL) one interval at a time.
//!
//! Invariants: a predictor never returns a negative or non-finite value;
//! before its first observation it predicts 0.

use dynamo_cluster_config::planner_spec::PredictorKind;
use serde::{Deserialize, Serialize};

/// A forecaster over equally spaced observations.
pub trait Predictor: Send {
    /// Adds the value of the interval that just ended.
    fn observe(&mut self, x: f64);
    /// The value expected `steps` intervals after the last observation
    /// (fractions allowed).
    fn predict(&self, steps: f64) -> f64;
    fn name(&self) -> &'static str;
}

fn clean(x: f64) -> f64 {
    if x.is_finite() && x > 0.0 {
        x
    } else {
        0.0
    }
}

/// The last value.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Constant {
    last: f64,
}

impl Predictor for Constant {
    fn observe(&mut self, x: f64) {
        self.last = clean(x);
    }
    fn predict(&self, _steps: f64) -> f64 {
        self.last
    }
    fn name(&self) -> &'static str {
        "constant"
    }
}

/// Holt's linear trend (double exponential smoothing) with a damped trend,
/// so a burst's slope does not run away over a long horizon.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Holt {
    alpha: f64,
    beta: f64,
    /// Trend damping per step (φ in Gardner's damped trend).
    phi: f64,
    level: f64,
    trend: f64,
    seen: u32,
}

impl Default for Holt {
    fn default() -> Self {
        Holt {
            alpha: 0.4,
            beta: 0.15,
            phi: 0.9,
            level: 0.0,
            trend: 0.0,
            seen: 0,
        }
    }
}

impl Predictor for Holt {
    fn observe(&mut self, x: f64) {
        let x = clean(x);
        match self.seen {
            // The trend starts flat: two noisy points are no slope.
            0 => self.level = x,
            _ => {
                let prev = self.level;
                self.level = self.alpha * x + (1.0 - self.alpha) * (prev + self.phi * self.trend);
                self.trend =
                    self.beta * (self.level - prev) + (1.0 - self.beta) * self.phi * self.trend;
            }
        }
        self.seen = self.seen.saturating_add(1);
    }
    fn predict(&self, steps: f64) -> f64 {
        let steps = clean(steps).min(1_000.0);
        // Σ φ^i for i = 1..steps (continuous in steps).
        let damp = if (self.phi - 1.0).abs() < 1e-9 {
            steps
        } else {
            self.phi * (1.0 - self.phi.powf(steps)) / (1.0 - self.phi)
        };
        clean(self.level + damp * self.trend)
    }
    fn name(&self) -> &'static str {
        "holt"
    }
}

/// A predictor of either kind, storable (a successor planner adopts it).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum AnyPredictor {
    Constant(Constant),
    Holt(Holt),
}

impl AnyPredictor {
    pub fn new(kind: PredictorKind) -> Self {
        match kind {
            PredictorKind::Constant => AnyPredictor::Constant(Constant::default()),
            PredictorKind::Holt => AnyPredictor::Holt(Holt::default()),
        }
    }
    fn inner(&self) -> &dyn Predictor {
        match self {
            AnyPredictor::Constant(p) => p,
            AnyPredictor::Holt(p) => p,
        }
    }
}

impl Predictor for AnyPredictor {
    fn observe(&mut self, x: f64) {
        match self {
            AnyPredictor::Constant(p) => p.observe(x),
            AnyPredictor::Holt(p) => p.observe(x),
        }
    }
    fn predict(&self, steps: f64) -> f64 {
        self.inner().predict(steps)
    }
    fn name(&self) -> &'static str {
        self.inner().name()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn holt_follows_a_ramp_and_a_constant() {
        let mut h = Holt::default();
        for i in 0..30 {
            h.observe(10.0 + i as f64);
        }
        let next = h.predict(1.0);
        assert!((next - 40.0).abs() < 3.0, "{next}");
        assert!(h.predict(10.0) > next, "a rising trend predicts more later");
        let mut h = Holt::default();
        for _ in 0..30 {
            h.observe(7.0);
        }
        assert!((h.predict(5.0) - 7.0).abs() < 1e-6);
        let mut c = Constant::default();
        assert_eq!(c.predict(1.0), 0.0);
        c.observe(3.0);
        assert_eq!(c.predict(100.0), 3.0);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, rng_seed: proptest::test_runner::RngSeed::Fixed(16), ..ProptestConfig::default() })]
        #[test]
        fn predictions_are_finite_and_non_negative(xs in proptest::collection::vec(prop_oneof![any::<f64>(), 0.0f64..1e6], 0..50), steps in any::<f64>()) {
            for kind in [PredictorKind::Constant, PredictorKind::Holt] {
                let mut p = AnyPredictor::new(kind);
                for x in &xs {
                    p.observe(*x);
                    let y = p.predict(steps);
                    prop_assert!(y.is_finite() && y >= 0.0, "{y}");
                }
            }
        }
    }
}
