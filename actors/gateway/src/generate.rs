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

use crate::error::ApiError;
use crate::inbox::Frame;
use crate::openai::ValidGenerate;
use crate::shared::Shared;
use dynamo_bus_schema::{
    unix_ms, CancelReason, CancelRequest, ErrorKind, FinishReason, GenerateAck, GenerateDisagg,
    GenerateRequest, ModelName, RequestId, SamplingParams, WireError, WorkerId,
};
use dynamo_model::{IncrementalDecoder, Preprocessor};
use dynamo_router::{RouteDecision, RouteError, RouterMsg};
use dynamo_runtime::BusError;
use ractor::rpc::CallResult;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
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
        ErrorKind::Overloaded | ErrorKind::Unavailable => ApiError::unavailable(e.message.clone()),
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
    rx: mpsc::UnboundedReceiver<Frame>,
    next_seq: u32,
    decoder: IncrementalDecoder,
    stop: Vec<String>,
    max_stop_len: usize,
    held: String,
    usage: Usage,
    deadline: Instant,
    started_at: Instant,
    last_token_at: Option<Instant>,
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
}

/// Everything needed to send (or re-send) a request.
struct Attempt {
    model: ModelName,
    prompt: Arc<Vec<u32>>,
    sampling: SamplingParams,
    routing: Option<dynamo_router::policy::KvCostWeights>,
}

/// What a frame means for the stream.
enum FrameOutcome {
    Continue,
    /// The worker failed in a way another worker can take over from.
    Migrate(&'static str, ApiError),
}

impl Generation {
    /// Routes the prompt and gets a worker to accept it, trying other
    /// workers when one refuses (retryable) or is unreachable.
    pub async fn start(
        shared: Arc<Shared>,
        pre: Arc<Preprocessor>,
        v: ValidGenerate,
        deadline: Instant,
        started_at: Instant,
        max_migrations: u32,
    ) -> Result<Self, ApiError> {
        let id = RequestId::random();
        let plan = Attempt {
            model: pre.card.name.clone(),
            prompt: Arc::new(v.token_ids),
            sampling: v.sampling,
            routing: v.routing,
        };
        let mut failed = Vec::new();
        let (decision, rx) = dispatch(
            &shared,
            &pre,
            id,
            &plan,
            plan.prompt.clone(),
            &plan.sampling,
            deadline,
            &mut failed,
        )
        .await?;
        let max_stop_len = v.stop.iter().map(String::len).max().unwrap_or(0);
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
            last_token_at: None,
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
                    self.migrate("worker_silent", ApiError::bad_gateway("The worker stopped responding.")).await;
                    continue;
                }
            };
            let Some(frame) = frame else {
                self.done = true;
                return Some(Err(ApiError::internal(
                    "Response stream closed unexpectedly.",
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

    /// Continues the request on another worker from the prompt plus every
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
        self.failed.push(old.worker_id);
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
        match dispatch(
            &self.shared,
            &self.pre,
            id,
            &self.plan,
            Arc::new(tokens),
            &sampling,
            self.deadline,
            &mut self.failed,
        )
        .await
        {
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
                tracing::warn!(request = %self.public_id, error = %e.message, "migration found no worker");
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
                self.shared
                    .metrics
                    .cached_tokens
                    .inc_by(f.cached_tokens as u64);
            }
            Frame::Tokens(f) => {
                let n = f.token_ids.len() as u32;
                let now = Instant::now();
                match self.last_token_at {
                    None => self
                        .shared
                        .metrics
                        .ttft
                        .observe((now - self.started_at).as_secs_f64()),
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
        if let Some(d) = self.decision.take() {
            if !self.worker_finished {
                send_cancel(&self.shared, d.worker_id, self.id, self.cancel_reason);
            }
            if let Ok(r) = self.shared.router() {
                let _ = r.cast(RouterMsg::Release(self.id));
            }
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

/// Routes `tokens` and gets a worker to accept them as request `id`,
/// trying other workers when one refuses (retryable) or is unreachable;
/// workers in `exclude` are never chosen and the ones that fail are added.
#[allow(clippy::too_many_arguments)]
async fn dispatch(
    shared: &Arc<Shared>,
    pre: &Preprocessor,
    id: RequestId,
    plan: &Attempt,
    tokens: Arc<Vec<u32>>,
    sampling: &SamplingParams,
    deadline: Instant,
    exclude: &mut Vec<WorkerId>,
) -> Result<(RouteDecision, mpsc::UnboundedReceiver<Frame>), ApiError> {
    let attempts = shared.config.max_route_attempts.max(1);
    let mut last_error = None;
    for attempt in 0..attempts {
        if attempt > 0 {
            shared.metrics.route_retries.inc();
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ApiError::timeout(
                "The request did not reach a worker before its deadline.",
            ));
        }
        let decision = route(
            shared,
            id,
            &plan.model,
            &tokens,
            exclude,
            plan.routing,
            left,
        )
        .await?;
        let rx = shared.inbox.register(id);
        let req = GenerateRequest {
            request_id: id,
            model: plan.model.clone(),
            token_ids: (*tokens).clone(),
            sampling: sampling.clone(),
            reply_to: shared.frames_subject.clone(),
            deadline_unix_ms: unix_ms()
                + deadline
                    .saturating_duration_since(Instant::now())
                    .as_millis() as u64,
        };
        let subject = shared.bus.subjects.worker_generate(decision.worker_id);
        let wait = shared.config.ack_timeout.min(left);
        let res: Result<GenerateAck, BusError> = match decision.prefill_worker {
            Some(prefill_worker) => {
                let req = GenerateDisagg {
                    request: req,
                    prefill_worker,
                    cached_blocks: decision.overlap_blocks,
                };
                shared.bus.request(subject, &req, wait).await
            }
            None => shared.bus.request(subject, &req, wait).await,
        };
        let failure = match res {
            Ok(ack) => match ack.rejected {
                None => {
                    let bs = pre.card.block_size as u64;
                    shared
                        .metrics
                        .predicted_cached_tokens
                        .inc_by((decision.overlap_blocks as u64 * bs).min(tokens.len() as u64));
                    return Ok((decision, rx));
                }
                Some(e) if e.kind.is_retryable() => Some(map_wire(&e)),
                Some(e) => {
                    release(shared, id);
                    return Err(map_wire(&e));
                }
            },
            Err(BusError::NoResponders { .. }) => {
                Some(ApiError::unavailable("The chosen worker is gone."))
            }
            Err(BusError::Timeout { .. }) => {
                // It may have accepted after all: make sure it stops.
                send_cancel(
                    shared,
                    decision.worker_id,
                    id,
                    CancelReason::DeadlineExceeded,
                );
                Some(ApiError::unavailable(
                    "The chosen worker did not acknowledge in time.",
                ))
            }
            Err(BusError::Remote { error, .. }) => Some(map_wire(&error)),
            Err(e) => {
                tracing::warn!(request = %id, error = %e, "cannot send request");
                Some(ApiError::unavailable(
                    "The bus is unavailable; retry shortly.",
                ))
            }
        };
        tracing::debug!(request = %id, worker = %decision.worker_id, ?failure, "worker did not take request");
        exclude.push(decision.worker_id);
        release(shared, id);
        last_error = failure;
    }
    Err(last_error.unwrap_or_else(|| ApiError::unavailable("No worker accepted the request.")))
}

async fn route(
    shared: &Shared,
    request_id: RequestId,
    model: &ModelName,
    tokens: &Arc<Vec<u32>>,
    exclude: &[WorkerId],
    weights: Option<dynamo_router::policy::KvCostWeights>,
    within: Duration,
) -> Result<RouteDecision, ApiError> {
    let router = shared.router()?;
    let t0 = Instant::now();
    loop {
        let call = router
            .call(
                |reply| RouterMsg::Route {
                    request_id,
                    model: model.clone(),
                    token_ids: tokens.clone(),
                    exclude: exclude.to_vec(),
                    weights,
                    reply,
                },
                Some(Duration::from_secs(2).min(within)),
            )
            .await;
        let Ok(CallResult::Success(answer)) = call else {
            return Err(ApiError::unavailable(
                "The router did not answer; retry shortly.",
            ));
        };
        match answer {
            // A replica that just started loads its view first; wait for it
            // (bounded by the router's own cap and this request's deadline).
            Err(RouteError::CatchingUp) if t0.elapsed() < within => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(RouteError::CatchingUp) => {
                return Err(ApiError::unavailable(
                    "The router is still starting; retry shortly.",
                ))
            }
            Err(RouteError::UnknownModel { model }) => {
                return Err(ApiError::model_not_found(&model))
            }
            Err(e @ RouteError::NoWorkers { .. }) => {
                return Err(ApiError::unavailable(format!("{e}. Retry shortly.")))
            }
            Ok(d) => return Ok(d),
        }
    }
}

fn release(shared: &Shared, id: RequestId) {
    shared.inbox.unregister(id);
    if let Ok(r) = shared.router() {
        let _ = r.cast(RouterMsg::Release(id));
    }
}

fn send_cancel(shared: &Arc<Shared>, worker: WorkerId, id: RequestId, reason: CancelReason) {
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let shared = shared.clone();
    handle.spawn(async move {
        let subject = shared.bus.subjects.worker_cancel(worker);
        if let Err(e) = shared
            .bus
            .publish(
                subject,
                &CancelRequest {
                    request_id: id,
                    reason,
                },
            )
            .await
        {
            tracing::warn!(request = %id, error = %e, "cannot send cancel");
        }
    });
}
