//! Admission control: how many requests of one model the gateway serves
//! and lets wait (see [`AdmissionConfig`]).
//!
//! Invariants: per model, at most `max_inflight` [`Permit`]s exist and at
//! most `max_queued` requests wait for one, in arrival order; a request
//! past the queue, or whose expected wait for a place (from how long
//! requests hold their places, by Little's law) is more than half of
//! `max_queue_wait` (the other half absorbs the estimate's error), is
//! refused at once
//! ([`Refusal::QueueFull`]); one that waits longer than `max_queue_wait`
//! (or its own deadline) anyway is refused then ([`Refusal::QueueTimeout`]);
//! a permit is given back when dropped, however the request ends. Gates
//! exist only for models the router serves, so their number is bounded by
//! the fleet's.

use crate::config::AdmissionConfig;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// A request's place among its model's served requests.
#[derive(Debug)]
pub struct Permit {
    _place: OwnedSemaphorePermit,
    gate: Arc<ModelGate>,
    since: Instant,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.gate
            .served(Instant::now().saturating_duration_since(self.since));
    }
}

/// Why a request was not admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// `max_queued` requests already wait, or the wait would likely be too long.
    QueueFull,
    /// It waited the queue-wait limit (or until its deadline).
    QueueTimeout(Duration),
}

impl Refusal {
    /// Label for the rejections metric.
    pub fn reason(self) -> &'static str {
        match self {
            Refusal::QueueFull => "queue_full",
            Refusal::QueueTimeout(_) => "queue_timeout",
        }
    }
}

#[derive(Debug)]
struct ModelGate {
    serving: Arc<Semaphore>,
    places: u32,
    waiting: AtomicU32,
    /// How long a request holds its place: the mean (an EWMA, seconds; 0
    /// until one has finished).
    mean_hold_s: Mutex<f64>,
}

impl ModelGate {
    fn served(&self, held: Duration) {
        let mut m = self.mean_hold_s.lock().unwrap_or_else(|p| p.into_inner());
        let h = held.as_secs_f64();
        *m = if *m == 0.0 { h } else { 0.95 * *m + 0.05 * h };
    }

    /// How long the request at `position` in the queue should wait: with
    /// every place taken, places free up `places / mean hold` times a
    /// second (Little's law). `None` until a request has finished.
    fn expected_wait(&self, position: u32) -> Option<Duration> {
        let m = *self.mean_hold_s.lock().unwrap_or_else(|p| p.into_inner());
        (m > 0.0).then(|| Duration::from_secs_f64(m * position as f64 / self.places as f64))
    }
}

pub struct Admission {
    cfg: AdmissionConfig,
    models: Mutex<HashMap<String, Arc<ModelGate>>>,
}

/// Takes a waiting place back when dropped (however the wait ends).
struct Waiting<'a>(&'a AtomicU32);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Admission {
    pub fn new(cfg: AdmissionConfig) -> Self {
        Admission {
            cfg,
            models: Mutex::new(HashMap::new()),
        }
    }

    fn gate(&self, model: &str) -> Arc<ModelGate> {
        let mut m = self.models.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(g) = m.get(model) {
            return g.clone();
        }
        m.entry(model.to_string())
            .or_insert_with(|| {
                Arc::new(ModelGate {
                    serving: Arc::new(Semaphore::new(self.cfg.max_inflight.max(1) as usize)),
                    places: self.cfg.max_inflight.max(1),
                    waiting: AtomicU32::new(0),
                    mean_hold_s: Mutex::new(0.0),
                })
            })
            .clone()
    }

    /// A permit to serve a request of `model` (a model the router serves),
    /// waiting at most the queue-wait limit and never past `deadline`;
    /// also returns how long it waited.
    pub async fn admit(
        &self,
        model: &str,
        deadline: Instant,
    ) -> Result<(Permit, Duration), Refusal> {
        let gate = self.gate(model);
        if let Ok(p) = gate.serving.clone().try_acquire_owned() {
            let since = Instant::now();
            return Ok((
                Permit {
                    _place: p,
                    gate,
                    since,
                },
                Duration::ZERO,
            ));
        }
        let position = gate.waiting.fetch_add(1, Ordering::AcqRel);
        let _waiting = Waiting(&gate.waiting);
        if position >= self.cfg.max_queued {
            return Err(Refusal::QueueFull);
        }
        // A wait likely to run past the limit is refused now, not after it.
        let t0 = Instant::now();
        let until = (t0 + self.cfg.max_queue_wait).min(deadline);
        let budget = until.saturating_duration_since(t0) / 2;
        if gate.expected_wait(position + 1).is_some_and(|w| w > budget) {
            return Err(Refusal::QueueFull);
        }
        match tokio::time::timeout_at(until, gate.serving.clone().acquire_owned()).await {
            Ok(Ok(p)) => Ok((
                Permit {
                    _place: p,
                    gate: gate.clone(),
                    since: Instant::now(),
                },
                t0.elapsed(),
            )),
            // The semaphore is never closed; a timeout is the refusal.
            _ => Err(Refusal::QueueTimeout(t0.elapsed())),
        }
    }

    /// Requests of `model` waiting now (for metrics and tests).
    pub fn waiting(&self, model: &str) -> u32 {
        self.gate(model).waiting.load(Ordering::Relaxed)
    }

    /// Requests waiting, all models.
    pub fn waiting_total(&self) -> u64 {
        let m = self.models.lock().unwrap_or_else(|p| p.into_inner());
        m.values()
            .map(|g| g.waiting.load(Ordering::Relaxed) as u64)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(inflight: u32, queued: u32, wait_ms: u64) -> AdmissionConfig {
        AdmissionConfig {
            max_inflight: inflight,
            max_queued: queued,
            max_queue_wait: Duration::from_millis(wait_ms),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_that_would_exceed_the_limit_is_refused_at_once() {
        let a = Arc::new(Admission::new(cfg(1, 100, 100)));
        let far = Instant::now() + Duration::from_secs(60);
        // A request holds its (only) place for 40 ms.
        for _ in 0..5 {
            let (p, _) = a.admit("m", far).await.unwrap();
            tokio::time::sleep(Duration::from_millis(40)).await;
            drop(p);
        }
        let _busy = a.admit("m", far).await.unwrap();
        let a1 = a.clone();
        // First in line can expect a place within half the limit (50 ms)…
        let w1 = tokio::spawn(async move { a1.admit("m", far).await.map(|_| ()) });
        tokio::task::yield_now().await;
        assert_eq!(a.waiting("m"), 1);
        // …the second cannot (2 × 40 ms > 50 ms): refused without waiting.
        let t0 = Instant::now();
        assert_eq!(a.admit("m", far).await.unwrap_err(), Refusal::QueueFull);
        assert_eq!(t0.elapsed(), Duration::ZERO);
        drop(_busy);
        w1.await.unwrap().unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn past_the_limit_requests_wait_then_are_refused() {
        let a = Arc::new(Admission::new(cfg(2, 1, 100)));
        let far = Instant::now() + Duration::from_secs(60);
        let (p1, w) = a.admit("m", far).await.unwrap();
        assert_eq!(w, Duration::ZERO);
        let _p2 = a.admit("m", far).await.unwrap();
        // Another model has places of its own.
        let _other = a.admit("n", far).await.unwrap();
        // The third waits; the fourth finds the queue full.
        let a2 = a.clone();
        let waiter = tokio::spawn(async move { a2.admit("m", far).await });
        tokio::task::yield_now().await;
        assert_eq!(a.waiting("m"), 1);
        assert_eq!(a.admit("m", far).await.unwrap_err(), Refusal::QueueFull);
        // A place frees up: the waiter gets it, having waited.
        tokio::time::sleep(Duration::from_millis(30)).await;
        drop(p1);
        let (_p3, waited) = waiter.await.unwrap().unwrap();
        assert!(waited >= Duration::from_millis(30));
        assert_eq!(a.waiting("m"), 0);
        // Nobody frees one: the queue-wait limit refuses it.
        let err = a.admit("m", far).await.unwrap_err();
        assert_eq!(err, Refusal::QueueTimeout(Duration::from_millis(100)));
        assert_eq!(err.reason(), "queue_timeout");
        // …or its own deadline, if sooner (a gate with no history yet).
        let fresh = Admission::new(cfg(1, 1, 100));
        let _only = fresh.admit("m", far).await.unwrap();
        let soon = Instant::now() + Duration::from_millis(10);
        assert_eq!(
            fresh.admit("m", soon).await.unwrap_err(),
            Refusal::QueueTimeout(Duration::from_millis(10))
        );
        // With history, a wait that cannot fit the deadline is refused at once.
        assert_eq!(a.admit("m", soon).await.unwrap_err(), Refusal::QueueFull);
        assert_eq!(a.waiting_total(), 0);
    }
}
