//! A worker's presence on the bus: its record in the workers KV bucket,
//! rewritten every heartbeat and at once when its state changes, and its
//! load reports on `load.<id>`: on every change and every heartbeat, so
//! that routers hear it live over core NATS when the bucket cannot be
//! written.
//!
//! Invariants: all of this runs in a task of its own ([`Registrar::run`]),
//! never on the worker actor, so a slow or absent bus never blocks the
//! actor; inside it the record is written by a writer of its own, beside
//! the heartbeat loop, so a stalled bucket (its stream re-electing a
//! leader takes seconds) never delays a load report; every bus call is
//! bounded by [`WRITE_TIMEOUT`]; the newest record wins (writes are
//! coalesced through watch channels); a deregistration is the last write
//! and nothing is written after it.

use dynamo_bus_schema::{
    encode, unix_ms, LoadMetrics, LoadReport, WorkerMetrics, WorkerRegistration, WorkerState,
};
use dynamo_engine::Engine;
use dynamo_runtime::bus::REGISTRY_MAX_AGE;
use dynamo_runtime::Bus;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Longest one registration write or delete may take.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(2);

/// What the worker wants the bucket to say.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Desired {
    State(WorkerState),
    Deregistered,
}

/// The actor's side: set the state, count requests, deregister.
pub struct Registration {
    /// What the record should say, numbered: each change takes the next
    /// number.
    desired: watch::Sender<(u64, Desired)>,
    /// The highest number the writer has written (or deleted), so a caller
    /// waits for its own change, not for a heartbeat write in flight.
    written: watch::Receiver<u64>,
    inflight: Arc<AtomicUsize>,
}

/// The task's side: the heartbeat loop and the record writer.
pub struct Registrar {
    beat: Heartbeat,
    writer: RecordWriter,
}

/// Publishes load and metrics, and hands the writer the newest record.
struct Heartbeat {
    bus: Bus,
    reg: WorkerRegistration,
    engine: Arc<dyn Engine>,
    desired: watch::Receiver<(u64, Desired)>,
    /// The number of the desired state the record now carries.
    seq: u64,
    inflight: Arc<AtomicUsize>,
    heartbeat: Duration,
    load_interval: Duration,
    stats: Arc<crate::stats::WorkerStats>,
    metrics_interval: Duration,
}

impl Registration {
    /// Sets the state the registration shows (written at once); returns
    /// the change's number.
    pub fn set_state(&self, state: WorkerState) -> u64 {
        self.change(Desired::State(state))
    }

    fn change(&self, d: Desired) -> u64 {
        let mut seq = 0;
        self.desired.send_modify(|(n, old)| {
            *n += 1;
            *old = d;
            seq = *n;
        });
        seq
    }

    /// The state the registration shows (or will, after the next write).
    pub fn state(&self) -> WorkerState {
        match self.desired.borrow().1 {
            Desired::State(s) => s,
            Desired::Deregistered => WorkerState::Draining,
        }
    }

    /// Requests in flight, as load reports and the registration count them.
    pub fn set_inflight(&self, n: usize) {
        self.inflight.store(n, Ordering::Relaxed);
    }

    /// Sets a state and waits (at most [`WRITE_TIMEOUT`]) until it is written.
    pub async fn write_state(&mut self, state: WorkerState) -> bool {
        let seq = self.set_state(state);
        self.wait_written(seq).await
    }

    /// Removes the registration; waits (bounded) for the delete.
    pub async fn deregister(&mut self) -> bool {
        let seq = self.change(Desired::Deregistered);
        self.wait_written(seq).await
    }

    /// Waits (bounded) until change `seq` (or a later one) is written.
    async fn wait_written(&mut self, seq: u64) -> bool {
        let wait = async {
            while *self.written.borrow_and_update() < seq {
                if self.written.changed().await.is_err() {
                    return false;
                }
            }
            true
        };
        tokio::time::timeout(WRITE_TIMEOUT + Duration::from_millis(500), wait)
            .await
            .unwrap_or(false)
    }
}

/// Writes the first registration (the worker is serving once it is there)
/// and returns both halves; [`Registrar::run`] keeps it fresh afterwards.
pub async fn register(
    bus: Bus,
    reg: WorkerRegistration,
    engine: Arc<dyn Engine>,
    heartbeat: Duration,
    load_interval: Duration,
    stats: Arc<crate::stats::WorkerStats>,
    metrics_interval: Duration,
) -> Result<(Registration, Registrar), String> {
    let kv = tokio::time::timeout(
        WRITE_TIMEOUT,
        bus.kv_bucket(&bus.subjects.workers_bucket(), REGISTRY_MAX_AGE),
    )
    .await
    .map_err(|_| "the workers bucket did not answer in time".to_string())?
    .map_err(|e| e.to_string())?;
    let (desired_tx, desired) = watch::channel((0, Desired::State(reg.state)));
    let (written_tx, written) = watch::channel(0);
    let inflight = Arc::new(AtomicUsize::new(0));
    let mut writer = RecordWriter {
        bus: bus.clone(),
        kv,
        key: reg.worker_id.to_string(),
        written: written_tx,
    };
    let mut beat = Heartbeat {
        bus,
        reg,
        engine,
        desired,
        seq: 0,
        inflight: inflight.clone(),
        heartbeat,
        load_interval,
        stats,
        metrics_interval,
    };
    let first = beat.record();
    writer.write(&first, 0).await?;
    Ok((
        Registration {
            desired: desired_tx,
            written,
            inflight,
        },
        Registrar { beat, writer },
    ))
}

impl Registrar {
    /// Keeps the registration fresh and the load published until the
    /// worker deregisters (or the actor drops its half). The record writer
    /// runs beside the heartbeat loop in this same task; the loop hands it
    /// the newest record and never waits for a write.
    pub async fn run(self) {
        let (jobs, rx) = watch::channel(None);
        tokio::join!(self.writer.run(rx), self.beat.run(jobs));
    }
}

impl Heartbeat {
    fn load(&self) -> LoadMetrics {
        let mut l = self.engine.load();
        l.inflight_requests = self.inflight.load(Ordering::Relaxed) as u32;
        self.stats.observe_load(&l);
        l
    }

    /// The record as of now (state, heartbeat time and load).
    fn record(&mut self) -> WorkerRegistration {
        self.reg.heartbeat_unix_ms = unix_ms();
        self.reg.load = self.load();
        self.reg.clone()
    }

    /// Publishes until the worker deregisters (then asks the writer for
    /// the delete) or the actor drops its half.
    async fn run(mut self, jobs: watch::Sender<Option<Job>>) {
        let mut beat = tokio::time::interval(self.heartbeat);
        beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        beat.tick().await;
        let mut load_tick = tokio::time::interval(self.load_interval);
        load_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut last_load = None;
        let mut metrics_tick = tokio::time::interval(self.metrics_interval);
        metrics_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        metrics_tick.tick().await;
        loop {
            tokio::select! {
                _ = metrics_tick.tick() => self.publish_metrics().await,
                changed = self.desired.changed() => {
                    if changed.is_err() {
                        return; // the actor is gone
                    }
                    let (seq, d) = *self.desired.borrow_and_update();
                    self.seq = seq;
                    match d {
                        Desired::State(s) => {
                            self.reg.state = s;
                            jobs.send_replace(Some(Job::Write(Box::new(self.record()), seq)));
                        }
                        Desired::Deregistered => {
                            // The writer deletes and ends; so does this loop.
                            jobs.send_replace(Some(Job::Delete(seq)));
                            return;
                        }
                    }
                }
                _ = beat.tick() => {
                    // The load report goes out every heartbeat too, over
                    // core NATS: it keeps the worker fresh in every router
                    // while the bucket cannot be written (its stream leader
                    // is being re-elected, which takes seconds).
                    last_load = self.publish_load(None).await;
                    jobs.send_replace(Some(Job::Write(Box::new(self.record()), self.seq)));
                }
                _ = load_tick.tick() => {
                    let load = self.load();
                    if last_load.as_ref() != Some(&load) {
                        last_load = self.publish_load(Some(load)).await;
                    }
                }
            }
        }
    }

    /// Publishes a load report (bounded); returns the load it carried if
    /// the bus took it.
    async fn publish_load(&mut self, load: Option<LoadMetrics>) -> Option<LoadMetrics> {
        let load = load.unwrap_or_else(|| self.load());
        let report = LoadReport {
            worker_id: self.reg.worker_id,
            generation: self.reg.generation,
            load: load.clone(),
        };
        let subject = self.bus.subjects.load(self.reg.worker_id);
        match tokio::time::timeout(WRITE_TIMEOUT, self.bus.publish(subject, &report)).await {
            Ok(Ok(())) => Some(load),
            _ => None,
        }
    }

    /// One interval's load and timings for the planner (dropped, not
    /// queued, when the bus does not take it in time).
    async fn publish_metrics(&mut self) {
        let load = self.load();
        let t = self.stats.take();
        let m = WorkerMetrics {
            worker_id: self.reg.worker_id,
            generation: self.reg.generation,
            role: self.reg.role,
            model: self.reg.model.name.clone(),
            unix_ms: unix_ms(),
            interval_ms: self.metrics_interval.as_millis() as u32,
            active_seqs: load.active_seqs,
            waiting_seqs: load.waiting_seqs,
            kv_used_blocks: load.kv_used_blocks,
            kv_total_blocks: load.kv_total_blocks,
            queued_prefill_tokens: t.queued_prefill_tokens,
            first_tokens: t.first_tokens,
            ttft_us_sum: t.ttft_us_sum,
            prompt_tokens: t.prompt_tokens,
            token_gaps: t.token_gaps,
            itl_us_sum: t.itl_us_sum,
        };
        let subject = self.bus.subjects.worker_metrics();
        if !matches!(
            tokio::time::timeout(WRITE_TIMEOUT, self.bus.publish(subject, &m)).await,
            Ok(Ok(()))
        ) {
            tracing::debug!("worker metrics not published");
        }
    }
}

/// What the record writer is asked to do next (only the newest counts),
/// with the number of the desired state it carries.
#[derive(Clone)]
enum Job {
    Write(Box<WorkerRegistration>, u64),
    Delete(u64),
}

/// Writes the worker's record into the workers bucket.
struct RecordWriter {
    bus: Bus,
    kv: async_nats::jetstream::kv::Store,
    /// The record's key: the worker id.
    key: String,
    /// The highest change number written (or deleted).
    written: watch::Sender<u64>,
}

impl RecordWriter {
    /// Writes the newest record asked for, one write at a time, until the
    /// delete (or until the heartbeat loop is gone).
    async fn run(mut self, mut jobs: watch::Receiver<Option<Job>>) {
        loop {
            if jobs.changed().await.is_err() {
                return;
            }
            let job = jobs.borrow_and_update().clone();
            match job {
                Some(Job::Write(reg, seq)) => {
                    if let Err(e) = self.write(&reg, seq).await {
                        tracing::warn!(error = %e, "registration write failed");
                    }
                }
                Some(Job::Delete(seq)) => {
                    self.delete(seq).await;
                    return;
                }
                None => {}
            }
        }
    }

    /// Writes the record once (bounded); a bus restarted without its
    /// JetStream state has lost the bucket, so it is created again and the
    /// write retried once.
    async fn write(&mut self, reg: &WorkerRegistration, seq: u64) -> Result<(), String> {
        let bytes: bytes::Bytes = encode(reg).map_err(|e| e.to_string())?.into();
        let key = self.key.clone();
        let first = tokio::time::timeout(WRITE_TIMEOUT, self.kv.put(key.clone(), bytes.clone()))
            .await
            .map_err(|_| "timed out".to_string())
            .and_then(|r| r.map_err(|e| e.to_string()));
        if let Err(e) = first {
            if !self.bus.is_connected() {
                return Err(format!("{e} (the bus is away)"));
            }
            tracing::warn!(error = %e, "registration write failed; re-creating the bucket");
            let again = async {
                self.kv = self
                    .bus
                    .kv_bucket(&self.bus.subjects.workers_bucket(), REGISTRY_MAX_AGE)
                    .await
                    .map_err(|e| e.to_string())?;
                if let Err(e) = self.bus.ensure_kv_events_stream().await {
                    tracing::warn!(error = %e, "cannot re-create the KV event stream");
                }
                self.kv.put(key, bytes).await.map_err(|e| e.to_string())
            };
            tokio::time::timeout(WRITE_TIMEOUT, again)
                .await
                .map_err(|_| "timed out".to_string())??;
        }
        self.written.send_modify(|n| *n = (*n).max(seq));
        Ok(())
    }

    async fn delete(&mut self, seq: u64) {
        if self.bus.is_connected() {
            match tokio::time::timeout(WRITE_TIMEOUT, self.kv.delete(&self.key)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "cannot delete the registration"),
                Err(_) => tracing::warn!("deleting the registration timed out"),
            }
        }
        self.written.send_modify(|n| *n = (*n).max(seq));
    }
}
