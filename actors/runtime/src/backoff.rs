//! Exponential backoff with a cap and a reset after a quiet period.

use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    /// A failure this long after the previous one starts again from `base`.
    reset_after: Duration,
    attempt: u32,
    last: Option<Instant>,
}

impl Backoff {
    pub fn new(base: Duration, max: Duration, reset_after: Duration) -> Self {
        Backoff {
            base,
            max,
            reset_after,
            attempt: 0,
            last: None,
        }
    }

    /// The delay before the next attempt, given that a failure happened `now`.
    pub fn next_delay(&mut self, now: Instant) -> Duration {
        if let Some(last) = self.last {
            if now.duration_since(last) >= self.reset_after {
                self.attempt = 0;
            }
        }
        self.last = Some(now);
        let factor = 1u32.checked_shl(self.attempt.min(20)).unwrap_or(u32::MAX);
        self.attempt = self.attempt.saturating_add(1);
        self.base.saturating_mul(factor).min(self.max)
    }

    /// Failures counted since the last reset.
    pub fn attempts(&self) -> u32 {
        self.attempt
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_caps_and_resets() {
        let mut b = Backoff::new(
            Duration::from_millis(100),
            Duration::from_millis(500),
            Duration::from_secs(10),
        );
        let t = Instant::now();
        let d: Vec<u64> = (0..5).map(|_| b.next_delay(t).as_millis() as u64).collect();
        assert_eq!(d, vec![100, 200, 400, 500, 500]);
        assert_eq!(b.next_delay(t + Duration::from_secs(11)).as_millis(), 100);
    }
}
