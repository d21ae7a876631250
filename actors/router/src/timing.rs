//! A small fixed-bucket latency histogram for the router's hot path (hashing,
//! index lookup, whole routing decision), rendered by the gateway's `/metrics`.

use std::time::Duration;

/// Bucket upper bounds in microseconds.
pub const BUCKETS_US: [u64; 12] = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 5_000, 20_000];

#[derive(Clone, Debug, Default)]
pub struct Histogram {
    /// Cumulative counts per bucket (Prometheus style: ≤ bound).
    pub counts: [u64; BUCKETS_US.len()],
    pub count: u64,
    pub sum_us: f64,
}

impl Histogram {
    pub fn observe(&mut self, d: Duration) {
        let us = d.as_secs_f64() * 1e6;
        for (i, b) in BUCKETS_US.iter().enumerate() {
            if us <= *b as f64 {
                self.counts[i] += 1;
            }
        }
        self.count += 1;
        self.sum_us += us;
    }

    /// Prometheus text lines for `name` (seconds).
    pub fn render(&self, name: &str, help: &str) -> String {
        let mut s = format!("# HELP {name} {help}\n# TYPE {name} histogram\n");
        for (b, c) in BUCKETS_US.iter().zip(self.counts) {
            s.push_str(&format!(
                "{name}_bucket{{le=\"{}\"}} {c}\n",
                *b as f64 / 1e6
            ));
        }
        s.push_str(&format!(
            "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}\n",
            self.count,
            self.sum_us / 1e6,
            self.count
        ));
        s
    }
}

/// Where routing time goes.
#[derive(Clone, Debug, Default)]
pub struct RouteTimings {
    pub hashing: Histogram,
    pub find_matches: Histogram,
    pub total: Histogram,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative() {
        let mut h = Histogram::default();
        h.observe(Duration::from_micros(3));
        h.observe(Duration::from_millis(30));
        assert_eq!(h.counts[1], 0);
        assert_eq!(h.counts[2], 1);
        assert_eq!(h.counts[BUCKETS_US.len() - 1], 1);
        assert!(h.render("x", "y").contains("x_bucket{le=\"+Inf\"} 2"));
    }
}
