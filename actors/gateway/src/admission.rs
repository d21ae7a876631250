//! Admission control: how many requests of one model the gateway serves
//! and lets wait (see [`AdmissionConfig`]).
//!
//! Invariants: per model, at most `max_inflight` [`Permit`]s exist and at
//! most `max_queued` requests wait for one, in arrival order; a request
//! past the queue is refused at once ([`Refusal::QueueFull`]), one that
//! waits longer than `max_queue_wait` (or its own deadline) is refused
//! then ([`Refusal::QueueTimeout`]); a permit is given back when dropped,
//! however the request ends. Gates exist only for models the router
//! serves, so their number is bounded by the fleet's.

use crate::config::AdmissionConfig;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// A request's place among its model's served requests.
#[derive(Debug)]
pub struct Permit(#[allow(dead_code)] OwnedSemaphorePermit);

/// Why a request was not admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// `max_queued` requests already wait.
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

struct ModelGate {
    serving: Arc<Semaphore>,
    waiting: AtomicU32,
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
        m.entry(model.to_string())
            .or_insert_with(|| {
                Arc::new(ModelGate {
                    serving: Arc::new(Semaphore::new(self.cfg.max_inflight.max(1) as usize)),
                    waiting: AtomicU32::new(0),
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
            return Ok((Permit(p), Duration::ZERO));
        }
        if gate.waiting.fetch_add(1, Ordering::AcqRel) >= self.cfg.max_queued {
            gate.waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(Refusal::QueueFull);
        }
        let _waiting = Waiting(&gate.waiting);
        let t0 = Instant::now();
        let until = (t0 + self.cfg.max_queue_wait).min(deadline);
        match tokio::time::timeout_at(until, gate.serving.clone().acquire_owned()).await {
            Ok(Ok(p)) => Ok((Permit(p), t0.elapsed())),
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
        // …or its own deadline, if sooner.
        let soon = Instant::now() + Duration::from_millis(10);
        assert_eq!(
            a.admit("m", soon).await.unwrap_err(),
            Refusal::QueueTimeout(Duration::from_millis(10))
        );
        assert_eq!(a.waiting_total(), 0);
    }
}
