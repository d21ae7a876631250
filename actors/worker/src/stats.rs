//! What the worker measures around its engine for the planner, whatever
//! the engine: prompt tokens waiting for their first token, the time to
//! each first token, and the gaps between output tokens. The registrar
//! publishes one [`dynamo_bus_schema::WorkerMetrics`] per interval.
//!
//! Invariants: a request's prompt tokens are queued from acceptance until
//! its first token or its end, whichever comes first (a [`Queued`] guard),
//! so the queued count never leaks; counters are taken and reset together.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Default)]
pub struct WorkerStats {
    queued_prefill: AtomicU64,
    first_tokens: AtomicU32,
    ttft_us: AtomicU64,
    prompt_tokens: AtomicU64,
    token_gaps: AtomicU32,
    itl_us: AtomicU64,
    /// This worker's Prometheus series (none in unit tests of the counters).
    series: Option<crate::prom::Series>,
}

/// One interval's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Taken {
    pub queued_prefill_tokens: u64,
    pub first_tokens: u32,
    pub ttft_us_sum: u64,
    pub prompt_tokens: u64,
    pub token_gaps: u32,
    pub itl_us_sum: u64,
}

/// A request's prompt tokens, queued until its first token (or its end).
pub struct Queued {
    stats: Arc<WorkerStats>,
    tokens: u64,
}

impl Drop for Queued {
    fn drop(&mut self) {
        self.stats
            .queued_prefill
            .fetch_sub(self.tokens, Ordering::Relaxed);
    }
}

impl WorkerStats {
    /// Counters that also feed a worker's Prometheus series.
    pub fn with_series(series: crate::prom::Series) -> Self {
        WorkerStats {
            series: Some(series),
            ..Default::default()
        }
    }

    /// One bus message carried `frames` response frames (`Ok`), or could
    /// not be encoded or published (`Err`: they are lost).
    pub fn frames_sent(&self, frames: usize, sent: bool) {
        if let Some(s) = &self.series {
            s.frames_sent(frames, sent);
        }
    }

    /// A request no gateway waited for was cancelled (Prometheus only).
    pub fn orphan_cancelled(&self) {
        if let Some(s) = &self.series {
            s.orphan_cancelled();
        }
    }

    /// A request ended (Prometheus only: the planner's interval counters
    /// count first tokens, not ends).
    pub fn request_done(&self, outcome: crate::prom::RequestOutcome) {
        if let Some(s) = &self.series {
            s.request_done(outcome);
        }
    }

    /// The load the registrar is about to report, for the gauges.
    pub fn observe_load(&self, load: &dynamo_bus_schema::LoadMetrics) {
        if let Some(s) = &self.series {
            s.load(load, self.queued_prefill.load(Ordering::Relaxed));
        }
    }

    /// A request with `tokens` prompt tokens was accepted.
    pub fn queue(self: &Arc<Self>, tokens: u32) -> Queued {
        self.queued_prefill
            .fetch_add(tokens as u64, Ordering::Relaxed);
        Queued {
            stats: self.clone(),
            tokens: tokens as u64,
        }
    }

    /// Its first token came `after` acceptance.
    pub fn first_token(&self, after: Duration, prompt_tokens: u32) {
        self.first_tokens.fetch_add(1, Ordering::Relaxed);
        self.ttft_us
            .fetch_add(after.as_micros() as u64, Ordering::Relaxed);
        self.prompt_tokens
            .fetch_add(prompt_tokens as u64, Ordering::Relaxed);
        if let Some(s) = &self.series {
            s.first_token(after, prompt_tokens);
        }
    }

    /// `n` more tokens came `gap` after the previous ones.
    pub fn tokens(&self, n: u32, gap: Duration) {
        if n == 0 {
            return;
        }
        self.token_gaps.fetch_add(n, Ordering::Relaxed);
        self.itl_us
            .fetch_add(gap.as_micros() as u64, Ordering::Relaxed);
        if let Some(s) = &self.series {
            s.tokens(n, gap);
        }
    }

    /// The interval's counters (reset), and the queue as it stands.
    pub fn take(&self) -> Taken {
        Taken {
            queued_prefill_tokens: self.queued_prefill.load(Ordering::Relaxed),
            first_tokens: self.first_tokens.swap(0, Ordering::Relaxed),
            ttft_us_sum: self.ttft_us.swap(0, Ordering::Relaxed),
            prompt_tokens: self.prompt_tokens.swap(0, Ordering::Relaxed),
            token_gaps: self.token_gaps.swap(0, Ordering::Relaxed),
            itl_us_sum: self.itl_us.swap(0, Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queued_tokens_leave_with_the_first_token_or_the_request() {
        let s = Arc::new(WorkerStats::default());
        let a = s.queue(100);
        let b = s.queue(50);
        assert_eq!(s.take().queued_prefill_tokens, 150);
        drop(a);
        s.first_token(Duration::from_millis(30), 100);
        s.tokens(4, Duration::from_millis(8));
        let t = s.take();
        assert_eq!(t.queued_prefill_tokens, 50);
        assert_eq!(
            (t.first_tokens, t.ttft_us_sum, t.prompt_tokens),
            (1, 30_000, 100)
        );
        assert_eq!((t.token_gaps, t.itl_us_sum), (4, 8_000));
        drop(b);
        assert_eq!(s.take(), Taken::default());
    }
}
