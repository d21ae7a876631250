//! One prompt's life at the gateway: route, send, receive frames, detokenize,
//! apply stop strings, account usage, and clean up.
//!
//! Invariants:
//! - a [`Generation`] yields text deltas that never split a UTF-8 character,
//!   then exactly one [`GenEvent::Done`] or one error, then nothing;
//! - frames must arrive in `seq` order with no gap, else the stream fails;
//! - no frame within the idle timeout, or the deadline passing, fails the
//!   stream (no request can hang);
//! - dropping a `Generation` (client gone, stop string, error) releases its
//!   router slot, removes its inbox entry and, unless the worker already
//!   finished, cancels it on the worker.

use crate::error::ApiError;
use crate::inbox::Frame;
use crate::openai::ValidGenerate;
use crate::shared::Shared;
use dynamo_bus_schema::{
    unix_ms, CancelReason, CancelRequest, ErrorKind, FinishReason, GenerateAck, GenerateRequest,
    ModelName, RequestId, WireError,
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
    ) -> Result<Self, ApiError> {
        let id = RequestId::random();
        let model = pre.card.name.clone();
        let tokens = Arc::new(v.token_ids);
        let mut exclude = Vec::new();
        let attempts = shared.config.max_route_attempts.max(1);
        let mut last_error = None;
        for attempt in 0..attempts {
            if attempt > 0 {
                shared.metrics.route_retries.inc();
            }
            let decision = route(&shared, id, &model, &tokens, &exclude, v.routing).await?;
            let rx = shared.inbox.register(id);
            let req = GenerateRequest {
                request_id: id,
                model: model.clone(),
                token_ids: (*tokens).clone(),
                sampling: v.sampling.clone(),
                reply_to: shared.frames_subject.clone(),
                deadline_unix_ms: unix_ms()
                    + deadline
                        .saturating_duration_since(Instant::now())
                        .as_millis() as u64,
            };
            let subject = shared.bus.subjects.worker_generate(decision.worker_id);
            let res: Result<GenerateAck, BusError> = shared
                .bus
                .request(subject, &req, shared.config.ack_timeout)
                .await;
            let failure = match res {
                Ok(ack) => match ack.rejected {
                    None => {
                        let bs = pre.card.block_size as u64;
                        shared
                            .metrics
                            .predicted_cached_tokens
                            .inc_by((decision.overlap_blocks as u64 * bs).min(tokens.len() as u64));
                        let max_stop_len = v.stop.iter().map(String::len).max().unwrap_or(0);
                        return Ok(Generation {
                            shared,
                            pre,
                            id,
                            decision: Some(decision),
                            rx,
                            next_seq: 0,
                            decoder: IncrementalDecoder::default(),
                            stop: v.stop,
                            max_stop_len,
                            held: String::new(),
                            usage: Usage {
                                prompt_tokens: tokens.len() as u32,
                                ..Usage::default()
                            },
                            deadline,
                            started_at,
                            last_token_at: None,
                            queued: VecDeque::new(),
                            done: false,
                            worker_finished: false,
                            cancel_reason: CancelReason::ClientDisconnected,
                        });
                    }
                    Some(e) if e.kind.is_retryable() => Some(map_wire(&e)),
                    Some(e) => {
                        release(&shared, id);
                        return Err(map_wire(&e));
                    }
                },
                Err(BusError::NoResponders { .. }) => {
                    Some(ApiError::unavailable("The chosen worker is gone."))
                }
                Err(BusError::Timeout { .. }) => {
                    // It may have accepted after all: make sure it stops.
                    send_cancel(
                        &shared,
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
            release(&shared, id);
            last_error = failure;
        }
        Err(last_error.unwrap_or_else(|| ApiError::unavailable("No worker accepted the request.")))
    }

    pub fn request_id(&self) -> RequestId {
        self.id
    }

    /// The worker serving this generation.
    pub fn worker_id(&self) -> Option<dynamo_bus_schema::WorkerId> {
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
            let idle = Instant::now() + self.shared.config.stream_idle_timeout;
            let wake = idle.min(self.deadline);
            let frame = tokio::select! {
                f = self.rx.recv() => f,
                _ = tokio::time::sleep_until(wake) => {
                    self.done = true;
                    self.cancel_reason = CancelReason::DeadlineExceeded;
                    let e = if Instant::now() >= self.deadline {
                        ApiError::timeout("The request did not finish before its deadline.")
                    } else {
                        ApiError::bad_gateway("The worker stopped responding.")
                    };
                    return Some(Err(e));
                }
            };
            let Some(frame) = frame else {
                self.done = true;
                return Some(Err(ApiError::internal(
                    "Response stream closed unexpectedly.",
                )));
            };
            if frame.seq() != self.next_seq {
                self.done = true;
                return Some(Err(ApiError::bad_gateway(format!(
                    "Lost response frames (expected {}, got {}).",
                    self.next_seq,
                    frame.seq()
                ))));
            }
            self.next_seq += 1;
            self.on_frame(frame);
        }
    }

    fn on_frame(&mut self, frame: Frame) {
        match frame {
            Frame::Started(f) => {
                self.usage.cached_tokens = f.cached_tokens;
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
                if self.last_token_at.is_none() {
                    if let Ok(r) = self.shared.router() {
                        let _ = r.cast(RouterMsg::PrefillDone(self.id));
                    }
                }
                self.last_token_at = Some(now);
                self.usage.completion_tokens += n;
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
                self.worker_finished = true;
                self.fail(map_wire(&f.error));
            }
        }
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

async fn route(
    shared: &Shared,
    request_id: RequestId,
    model: &ModelName,
    tokens: &Arc<Vec<u32>>,
    exclude: &[dynamo_bus_schema::WorkerId],
    weights: Option<dynamo_router::policy::KvCostWeights>,
) -> Result<RouteDecision, ApiError> {
    let router = shared.router()?;
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
            Some(Duration::from_secs(2)),
        )
        .await;
    match call {
        Ok(CallResult::Success(Ok(d))) => Ok(d),
        Ok(CallResult::Success(Err(RouteError::UnknownModel { model }))) => {
            Err(ApiError::model_not_found(&model))
        }
        Ok(CallResult::Success(Err(e @ RouteError::NoWorkers { .. }))) => {
            Err(ApiError::unavailable(format!("{e}. Retry shortly.")))
        }
        _ => Err(ApiError::unavailable(
            "The router did not answer; retry shortly.",
        )),
    }
}

fn release(shared: &Shared, id: RequestId) {
    shared.inbox.unregister(id);
    if let Ok(r) = shared.router() {
        let _ = r.cast(RouterMsg::Release(id));
    }
}

fn send_cancel(
    shared: &Arc<Shared>,
    worker: dynamo_bus_schema::WorkerId,
    id: RequestId,
    reason: CancelReason,
) {
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
