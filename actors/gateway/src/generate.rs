//! One prompt's life at the gateway: route, send, receive frames, detokenize,
//! apply stop strings, account usage, and clean up.
//!
//! Invariants:
//! - a [`Generation`] yields text deltas that never split a UTF-8 character,
//!   then exactly one [`GenEvent::Done`] or one error, then nothing;
//! - frames must arrive in `seq` order with no gap;
//! - a worker that fails mid-stream (silent past the liveness timeout, a
//!   frame gap, or a retryable error frame) is replaced: the request moves
//!   to another worker with the prompt plus every token already received,
//!   `max_tokens` reduced by those and the same seed, and the client's
//!   stream continues with no gap and no duplicate (at most
//!   `max_migrations` times; invalid requests and deadlines never move);
//! - the deadline passing fails the stream (no request can hang);
//! - dropping a `Generation` (client gone, stop string, error) releases its
//!   router slot, removes its inbox entry and, unless the worker already
//!   finished, cancels it on the worker.

use crate::dispatch::{dispatch, release, send_cancel, Attempt, DispatchError};
use crate::error::ApiError;
use crate::inbox::Frame;
use crate::openai::ValidGenerate;
use crate::shared::Shared;
use dynamo_bus_schema::{CancelReason, ErrorKind, FinishReason, RequestId, WireError, WorkerId};
use dynamo_model::{IncrementalDecoder, Preprocessor};
use dynamo_router::{RouteDecision, RouterMsg};
use std::collections::VecDeque;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio::time::Instant;

#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub cached_tokens: u32,
}

impl Usage {
    pub fn add(&mut self, o: &Usage) {
        self.prompt_tokens += o.prompt_tokens;
        self.completion_tokens += o.completion_tokens;
        self.cached_tokens += o.cached_tokens;
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }
}

#[derive(Debug, PartialEq)]
pub enum GenEvent {
    Text(String),
    Done {
        finish_reason: &'static str,
        usage: Usage,
        /// The phase breakdown the worker reported (last attempt's).
        timings: Option<dynamo_bus_schema::PhaseTimings>,
    },
}

/// Maps an error a worker sent to what the client sees.
pub fn map_wire(e: &WireError) -> ApiError {
    match e.kind {
        ErrorKind::InvalidRequest => ApiError::invalid(None, e.message.clone()),
        ErrorKind::DeadlineExceeded => {
            ApiError::timeout(format!("Request deadline exceeded: {}", e.message))
        }
        ErrorKind::Overloaded => ApiError::overloaded(e.message.clone(), "workers_overloaded"),
        ErrorKind::Unavailable => ApiError::unavailable(e.message.clone()),
        ErrorKind::EngineFailed => {
            ApiError::bad_gateway(format!("The worker failed: {}", e.message))
        }
        _ => ApiError::internal("The worker reported an internal error."),
    }
}

pub struct Generation {
    shared: Arc<Shared>,
    pre: Arc<Preprocessor>,
    /// The id clients see (the first attempt's).
    public_id: RequestId,
    /// The id of the current attempt on the bus.
    id: RequestId,
    decision: Option<RouteDecision>,
    rx: mpsc::Receiver<Frame>,
    next_seq: u32,
    decoder: IncrementalDecoder,
    stop: Vec<String>,
    max_stop_len: usize,
    held: String,
    usage: Usage,
    deadline: Instant,
    started_at: Instant,
    first_token_at: Option<Instant>,
    last_token_at: Option<Instant>,
    /// The stream ended in an error (for the planner's summary).
    errored: bool,
    queued: VecDeque<Result<GenEvent, ApiError>>,
    done: bool,
    worker_finished: bool,
    cancel_reason: CancelReason,
    /// What a migration needs to continue the request elsewhere.
    plan: Attempt,
    /// Tokens received so far (all attempts).
    generated: Vec<u32>,
    migrations: u32,
    max_migrations: u32,
    /// Workers that failed this request.
    failed: Vec<WorkerId>,
    /// The current attempt has reported its first token to the router.
    prefill_reported: bool,
    timings: Option<dynamo_bus_schema::PhaseTimings>,
    /// The cached prompt tokens the current attempt's worker reported
    /// (counted in the metric once, however often it corrects them).
    attempt_cached: u32,
    /// This stream's share of the planner's open-stream gauges.
    gauge: Option<crate::feed::StreamGauge>,
}

/// What a frame means for the stream.
enum FrameOutcome {
    Continue,
    /// The worker failed in a way another worker can take over from.
    Migrate(&'static str, ApiError),
}

/// How long after the bus's own outage a lost frame or a silence is put on
/// the bus rather than the worker, and a migration waits for a worker to be
/// routable again (registrations lapse while the bus is down, and come back
/// within a heartbeat or two of it).
pub(crate) const AFTER_OUTAGE: std::time::Duration = std::time::Duration::from_secs(15);
/// How often such a migration asks again for a worker.
const OUTAGE_RETRY: std::time::Duration = std::time::Duration::from_millis(200);

impl Generation {
    /// Routes the prompt and gets a worker to accept it, trying other
    /// workers when one refuses (retryable) or is unreachable. With
    /// `card_digest`, a worker whose model card differs is refused
    /// ([`DispatchError::CardChanged`]: tokenize again with its card).
    pub async fn start(
        shared: Arc<Shared>,
        pre: Arc<Preprocessor>,
        v: ValidGenerate,
        card_digest: Option<u64>,
        deadline: Instant,
        started_at: Instant,
        max_migrations: u32,
    ) -> Result<Self, DispatchError> {
        let id = RequestId::random();
        let plan = Attempt {
            model: pre.card.name.clone(),
            prompt: Arc::new(v.token_ids),
            sampling: v.sampling,
            routing: v.routing,
            card_digest,
            block_size: pre.card.block_size,
            frame_batch: v.frame_batch,
            patient: v.patient,
        };
        let mut failed = Vec::new();
        let (decision, rx) = dispatch(
            &shared,
            id,
            &plan,
            plan.prompt.clone(),
            &plan.sampling,
            deadline,
            &mut failed,
        )
        .await?;
        let max_stop_len = v.stop.iter().map(String::len).max().unwrap_or(0);
        let gauge = shared.feed.stream(&plan.model.0);
        Ok(Generation {
            usage: Usage {
                prompt_tokens: plan.prompt.len() as u32,
                ..Usage::default()
            },
            shared,
            pre,
            public_id: id,
            id,
            decision: Some(decision),
            rx,
            next_seq: 0,
            decoder: IncrementalDecoder::default(),
            stop: v.stop,
            max_stop_len,
            held: String::new(),
            deadline,
            started_at,
            first_token_at: None,
            last_token_at: None,
            errored: false,
            queued: VecDeque::new(),
            done: false,
            worker_finished: false,
            cancel_reason: CancelReason::ClientDisconnected,
            plan,
            generated: Vec::new(),
            migrations: 0,
            max_migrations,
            failed,
            prefill_reported: false,
            timings: None,
            attempt_cached: 0,
            gauge,
        })
    }

    pub fn request_id(&self) -> RequestId {
        self.public_id
    }

    /// The worker serving this generation.
    pub fn worker_id(&self) -> Option<WorkerId> {
        self.decision.as_ref().map(|d| d.worker_id)
    }

    /// The next event, or `None` after the last one.
    pub async fn next(&mut self) -> Option<Result<GenEvent, ApiError>> {
        loop {
            if let Some(ev) = self.queued.pop_front() {
                return Some(ev);
            }
            if self.done {
                return None;
            }
            let silent = Instant::now() + self.shared.config.liveness_timeout;
            let frame = tokio::select! {
                f = self.rx.recv() => f,
                _ = tokio::time::sleep_until(silent.min(self.deadline)) => {
                    if Instant::now() >= self.deadline {
                        self.done = true;
                        self.cancel_reason = CancelReason::DeadlineExceeded;
                        return Some(Err(ApiError::timeout(
                            "The request did not finish before its deadline.",
                        )));
                    }
                    // The bus's outage, not the worker's: the worker may well
                    // go on, and its frames come when the bus is back (a
                    // frame lost meanwhile shows as a gap, and migrates).
                    if self.shared.bus.outage_within(self.shared.config.liveness_timeout) {
                        continue;
                    }
                    self.migrate("worker_silent", ApiError::bad_gateway("The worker stopped responding.")).await;
                    continue;
                }
            };
            let Some(frame) = frame else {
                // Only the inbox closes it: the client read too slowly.
                self.done = true;
                self.shared
                    .metrics
                    .rejected
                    .with_label_values(&["slow_client"])
                    .inc();
                return Some(Err(ApiError::unavailable(
                    "The response was not read fast enough and was dropped.",
                )));
            };
            let Some(seq) = frame.seq() else {
                // A heartbeat (the worker is alive) or the phase breakdown.
                let _ = self.on_frame(frame);
                continue;
            };
            if seq != self.next_seq {
                let e = ApiError::bad_gateway(format!(
                    "Lost response frames (expected {}, got {seq}).",
                    self.next_seq
                ));
                self.migrate("lost_frames", e).await;
                continue;
            }
            self.next_seq += 1;
            if let FrameOutcome::Migrate(reason, e) = self.on_frame(frame) {
                self.migrate(reason, e).await;
            }
        }
    }

    /// Continues the request on a worker from the prompt plus every
    /// token generated so far, or fails the stream with `err` when it may
    /// not (limit reached, deadline, nobody else to take it).
    async fn migrate(&mut self, reason: &'static str, err: ApiError) {
        let m = &self.shared.metrics;
        if self.migrations >= self.max_migrations {
            m.migration_failures.with_label_values(&["limit"]).inc();
            return self.fail(err);
        }
        let Some(old) = self.decision.take() else {
            return self.fail(err);
        };
        tracing::warn!(request = %self.public_id, worker = %old.worker_id, reason, generated = self.generated.len(), "migrating request");
        self.shared.events.push(
            "migration",
            format!(
                "request {} left worker {} ({reason}) after {} tokens",
                self.public_id,
                old.worker_id,
                self.generated.len()
            ),
        );
        // Right after the bus's own outage the worker is not to blame (it
        // may well take the request again), and workers take a moment to
        // be routable again: wait for one rather than fail.
        let outage = self.shared.bus.outage_within(AFTER_OUTAGE);
        if !outage {
            self.failed.push(old.worker_id);
        }
        send_cancel(&self.shared, old.worker_id, self.id, CancelReason::Migrated);
        release(&self.shared, self.id);
        let done = self.generated.len() as u32;
        if done >= self.plan.sampling.max_tokens {
            // Every token arrived; only the end was lost.
            self.worker_finished = true;
            let tail = self.decoder.flush(&self.pre.tokenizer).unwrap_or_default();
            self.text(tail, true);
            if !self.done {
                self.finish("length");
            }
            return;
        }
        let mut sampling = self.plan.sampling.clone();
        sampling.max_tokens -= done;
        let mut tokens = Vec::with_capacity(self.plan.prompt.len() + self.generated.len());
        tokens.extend_from_slice(&self.plan.prompt);
        tokens.extend_from_slice(&self.generated);
        let id = RequestId::random();
        // The tokens are fixed now: any worker of the model will do.
        self.plan.card_digest = None;
        let tokens = Arc::new(tokens);
        let dispatched = loop {
            // After an outage, a worker that did not answer may only not be
            // back yet: it is avoided for this try, not for the request.
            let mut this_try = self.failed.clone();
            let exclude = if outage {
                &mut this_try
            } else {
                &mut self.failed
            };
            let r = dispatch(
                &self.shared,
                id,
                &self.plan,
                tokens.clone(),
                &sampling,
                self.deadline,
                exclude,
            )
            .await;
            match r {
                Err(DispatchError::Api(e))
                    if outage
                        && e.code == Some("no_workers_available")
                        && Instant::now() + OUTAGE_RETRY < self.deadline
                        && self.shared.bus.outage_within(AFTER_OUTAGE) =>
                {
                    tokio::time::sleep(OUTAGE_RETRY).await;
                }
                r => break r,
            }
        };
        match dispatched {
            Ok((decision, rx)) => {
                m.migrations.with_label_values(&[reason]).inc();
                self.migrations += 1;
                self.id = id;
                self.decision = Some(decision);
                self.rx = rx;
                self.next_seq = 0;
                self.prefill_reported = false;
            }
            Err(e) => {
                let why = match e {
                    DispatchError::Api(e) => e.message,
                    DispatchError::CardChanged(d) => format!("card {d:x} changed"),
                };
                tracing::warn!(request = %self.public_id, error = %why, "migration found no worker");
                m.migration_failures.with_label_values(&["no_worker"]).inc();
                self.fail(err);
            }
        }
    }

    fn on_frame(&mut self, frame: Frame) -> FrameOutcome {
        match frame {
            Frame::Started(f) => {
                if self.migrations == 0 {
                    self.usage.cached_tokens = f.cached_tokens;
                }
                self.attempt_cached = f.cached_tokens;
                self.shared
                    .metrics
                    .cached_tokens
                    .inc_by(f.cached_tokens as u64);
            }
            Frame::Tokens(f) => {
                let n = f.token_ids.len() as u32;
                let now = Instant::now();
                match self.last_token_at {
                    None => {
                        self.first_token_at = Some(now);
                        self.shared
                            .metrics
                            .ttft
                            .observe((now - self.started_at).as_secs_f64())
                    }
                    Some(prev) if n > 0 => {
                        let per = (now - prev).as_secs_f64() / n as f64;
                        for _ in 0..n {
                            self.shared.metrics.itl.observe(per);
                        }
                    }
                    _ => {}
                }
                if !self.prefill_reported {
                    self.prefill_reported = true;
                    if let Ok(r) = self.shared.router() {
                        let _ = r.cast(RouterMsg::PrefillDone(self.id));
                    }
                }
                self.last_token_at = Some(now);
                self.usage.completion_tokens += n;
                if let Some(g) = &mut self.gauge {
                    g.tokens(n);
                }
                self.generated.extend_from_slice(&f.token_ids);
                match self.decoder.push(&self.pre.tokenizer, &f.token_ids) {
                    Ok(delta) => self.text(delta, false),
                    Err(e) => self.fail(ApiError::internal(format!(
                        "Cannot detokenize the output: {e}"
                    ))),
                }
            }
            Frame::Finished(f) => {
                self.worker_finished = true;
                let tail = self.decoder.flush(&self.pre.tokenizer).unwrap_or_default();
                self.text(tail, true);
                if !self.done {
                    let finish_reason = match f.reason {
                        FinishReason::Length => "length",
                        _ => "stop",
                    };
                    self.finish(finish_reason);
                }
            }
            Frame::Error(f) => {
                if migratable(f.error.kind) {
                    return FrameOutcome::Migrate("worker_error", map_wire(&f.error));
                }
                self.worker_finished = true;
                self.fail(map_wire(&f.error));
            }
            Frame::Heartbeat(_) => {}
            Frame::Usage(f) => {
                // The engine's own count, reported late: it replaces the
                // one `Started` carried (usage is the first attempt's). The
                // counter only rises: a lower count leaves it as it is.
                if self.migrations == 0 {
                    self.usage.cached_tokens = f.cached_tokens.min(self.usage.prompt_tokens);
                }
                self.shared
                    .metrics
                    .cached_tokens
                    .inc_by(f.cached_tokens.saturating_sub(self.attempt_cached) as u64);
                self.attempt_cached = self.attempt_cached.max(f.cached_tokens);
            }
            Frame::Timings(f) => {
                let m = &self.shared.metrics;
                let t = &f.timings;
                let mode = if t.prefill_worker.is_some() {
                    "remote"
                } else {
                    "local"
                };
                for (phase, v) in [
                    ("queue", t.queue_ms),
                    ("prefill", t.prefill_ms),
                    ("transfer", t.transfer_ms),
                    ("first_token", t.first_token_ms),
                ] {
                    m.phase
                        .with_label_values(&[phase, mode])
                        .observe(v as f64 / 1000.0);
                }
                if t.fallback.is_some() {
                    m.disagg_fallbacks.inc();
                }
                self.timings = Some(f.timings);
            }
        }
        FrameOutcome::Continue
    }

    fn fail(&mut self, e: ApiError) {
        self.done = true;
        self.errored = true;
        self.queued.push_back(Err(e));
    }

    fn finish(&mut self, finish_reason: &'static str) {
        self.done = true;
        self.shared
            .metrics
            .output_tokens
            .inc_by(self.usage.completion_tokens as u64);
        self.queued.push_back(Ok(GenEvent::Done {
            finish_reason,
            usage: self.usage,
            timings: self.timings.take(),
        }));
    }

    /// Adds decoded text; emits what can no longer be the start of a stop string.
    fn text(&mut self, delta: String, last: bool) {
        if self.done {
            return;
        }
        self.held.push_str(&delta);
        if !self.stop.is_empty() {
            let hit = self
                .stop
                .iter()
                .filter_map(|s| self.held.find(s.as_str()))
                .min();
            if let Some(pos) = hit {
                self.held.truncate(pos);
                let out = std::mem::take(&mut self.held);
                if !out.is_empty() {
                    self.queued.push_back(Ok(GenEvent::Text(out)));
                }
                self.cancel_reason = CancelReason::StopString;
                self.finish("stop");
                return;
            }
        }
        let keep = if last {
            0
        } else {
            self.max_stop_len.saturating_sub(1)
        };
        let mut cut = self.held.len().saturating_sub(keep);
        while !self.held.is_char_boundary(cut) {
            cut -= 1;
        }
        if cut > 0 {
            let rest = self.held.split_off(cut);
            let out = std::mem::replace(&mut self.held, rest);
            self.queued.push_back(Ok(GenEvent::Text(out)));
        }
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        self.shared.inbox.unregister(self.id);
        let n = self.usage.completion_tokens;
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1000.0;
        self.shared.feed.ended(crate::feed::Ended {
            model: &self.plan.model.0,
            ttft_ms: self.first_token_at.map(|t| ms(t - self.started_at)),
            itl_ms: match (self.first_token_at, self.last_token_at) {
                (Some(a), Some(b)) if n > 1 => Some(ms(b - a) / (n - 1) as f64),
                _ => None,
            },
            output_tokens: n,
            failed: self.errored,
        });
        if let Some(d) = self.decision.take() {
            if !self.worker_finished {
                send_cancel(&self.shared, d.worker_id, self.id, self.cancel_reason);
            }
            if let Ok(r) = self.shared.router() {
                let _ = r.cast(RouterMsg::Finished(self.id));
            }
            // A place on that worker is free: one request waiting for room
            // tries again.
            self.shared.room.freed(&self.plan.model);
        }
    }
}

/// Worker-side failures another worker can take over from. Invalid
/// requests and deadlines are never migrated.
fn migratable(kind: ErrorKind) -> bool {
    matches!(
        kind,
        ErrorKind::EngineFailed | ErrorKind::Unavailable | ErrorKind::Overloaded
    )
}
