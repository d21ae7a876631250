//! Forwarding one request's engine events to the gateway as bus frames.
//!
//! Invariants: frames carry consecutive `seq` numbers starting at 0; every
//! stream ends with exactly one `FrameFinished` or `FrameError`; tokens that
//! are already waiting when a frame is built are coalesced into it (one
//! engine step, one frame); the request's deadline is enforced here too;
//! a stream that has sent nothing for `heartbeat` gets a `FrameHeartbeat`
//! (no `seq`), so the gateway can tell a slow request from a dead worker;
//! a successful stream sends its phase breakdown (`FrameTimings`, no `seq`)
//! just before `FrameFinished`; with a `frame_batch` window (the client
//! does not stream), the first token goes at once and later ones wait at
//! most that long (or until a heartbeat is due, or a frame's worth is
//! pending), and pending ones always go out before an ending frame of any
//! kind.

use crate::mux::{FrameSink, Outgoing};
use dynamo_bus_schema::{
    ErrorKind, FinishReason, FrameError, FrameFinished, FrameHeartbeat, FrameSeq, FrameStarted,
    FrameTimings, FrameTokens, FrameUsage, PhaseTimings, PrefillReply, RequestId, WireError,
    WorkerId,
};
use dynamo_engine::{EngineEvent, ResponseStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Most tokens one batched frame holds (far below a bus message's limit).
const MAX_BATCHED_TOKENS: usize = 8192;

pub struct Forward {
    /// The worker's queue of outgoing frames.
    pub sink: FrameSink,
    /// The gateway's inbox takes frames together with other requests'.
    pub mux: bool,
    pub worker_id: WorkerId,
    pub request_id: RequestId,
    pub reply_to: String,
    pub prompt_tokens: u32,
    pub deadline: Instant,
    /// Silence after which a heartbeat frame is sent.
    pub heartbeat: Duration,
    /// When the last frame went out.
    pub last_sent: Instant,
    /// Token frames may wait this long to go together (a client that does
    /// not stream); None: one per engine step.
    pub frame_batch: Option<Duration>,
    /// When the worker received the request.
    pub received: Instant,
    /// What a remote prefill did (set before the engine's first event).
    pub prefill: Arc<Mutex<PrefillOutcome>>,
    /// The worker's timings for the planner.
    pub stats: Arc<crate::stats::WorkerStats>,
}

/// How a request's prompt was prefilled, when not simply by this engine.
#[derive(Clone, Debug, Default)]
pub struct PrefillOutcome {
    /// A prefill worker computed it and wrote its blocks here.
    pub remote: Option<PrefillReply>,
    /// A remote prefill was planned but not used, and why.
    pub fallback: Option<String>,
}

/// How a forwarded request ended (for the worker's bookkeeping).
#[derive(Debug, PartialEq)]
pub enum Outcome {
    Finished(FinishReason),
    Failed(ErrorKind),
    /// The worker shut down under it.
    Aborted,
}

impl Forward {
    pub async fn run(
        mut self,
        mut events: ResponseStream,
        cancel: CancellationToken,
        on_timeout: impl FnOnce(),
    ) -> Outcome {
        let mut seq = 0u32;
        let mut next_seq = || {
            let s = FrameSeq(seq);
            seq += 1;
            s
        };
        let mut completion = 0u32;
        let mut pending: Vec<u32> = Vec::new();
        let (mut started, mut first) = (None, None);
        let mut queued = Some(self.stats.queue(self.prompt_tokens));
        let mut last_token: Option<Instant> = None;
        // When the oldest pending token must go (a batching window only).
        let mut flush_at: Option<Instant> = None;
        loop {
            let ev = tokio::select! {
                ev = events.recv() => ev,
                _ = async { tokio::time::sleep_until(flush_at.unwrap_or_else(Instant::now)).await }, if flush_at.is_some() => {
                    flush_at = None;
                    self.flush(&mut pending, &mut next_seq).await;
                    continue;
                }
                _ = tokio::time::sleep_until(self.deadline) => {
                    on_timeout();
                    self.flush(&mut pending, &mut next_seq).await;
                    let err = WireError::new(ErrorKind::DeadlineExceeded, "request deadline passed on the worker");
                    self.error(next_seq(), err).await;
                    return Outcome::Failed(ErrorKind::DeadlineExceeded);
                }
                _ = cancel.cancelled() => {
                    // What was generated goes out first: a migration then
                    // resumes after it instead of generating it again.
                    self.flush(&mut pending, &mut next_seq).await;
                    let err = WireError::new(ErrorKind::Unavailable, "worker is shutting down");
                    self.error(next_seq(), err).await;
                    return Outcome::Aborted;
                }
                _ = tokio::time::sleep_until(self.last_sent + self.heartbeat) => {
                    if pending.is_empty() {
                        let f = FrameHeartbeat {
                            request_id: self.request_id,
                            worker_id: self.worker_id,
                        };
                        self.send(&f).await;
                    } else {
                        // Tokens are a sign of life too (a window longer
                        // than the heartbeat).
                        flush_at = None;
                        self.flush(&mut pending, &mut next_seq).await;
                    }
                    continue;
                }
            };
            let Some(ev) = ev else {
                self.flush(&mut pending, &mut next_seq).await;
                let err = WireError::new(ErrorKind::EngineFailed, "engine dropped the request");
                self.error(next_seq(), err).await;
                return Outcome::Failed(ErrorKind::EngineFailed);
            };
            let first_batch = last_token.is_none();
            // Coalesce whatever else is ready.
            let mut batch = vec![ev];
            while let Ok(more) = events.try_recv() {
                batch.push(more);
            }
            for ev in batch {
                match ev {
                    EngineEvent::Tokens(t) => {
                        let now = Instant::now();
                        match last_token {
                            None => {
                                drop(queued.take());
                                self.stats
                                    .first_token(now - self.received, self.prompt_tokens);
                            }
                            Some(prev) => self.stats.tokens(t.len() as u32, now - prev),
                        }
                        last_token = Some(now);
                        first = first.or(Some(now));
                        completion += t.len() as u32;
                        pending.extend(t);
                    }
                    EngineEvent::Started { cached_tokens } => {
                        started = Some(Instant::now());
                        let f = FrameStarted {
                            request_id: self.request_id,
                            seq: next_seq(),
                            worker_id: self.worker_id,
                            prompt_tokens: self.prompt_tokens,
                            cached_tokens,
                        };
                        self.send(&f).await;
                    }
                    EngineEvent::Cached { cached_tokens } => {
                        // Unnumbered, and ahead of the terminal frame.
                        let f = FrameUsage {
                            request_id: self.request_id,
                            cached_tokens,
                        };
                        self.send(&f).await;
                    }
                    EngineEvent::Finished { reason } => {
                        self.flush(&mut pending, &mut next_seq).await;
                        let t = FrameTimings {
                            request_id: self.request_id,
                            timings: self.timings(started, first),
                        };
                        self.send(&t).await;
                        let f = FrameFinished {
                            request_id: self.request_id,
                            seq: next_seq(),
                            reason,
                            completion_tokens: completion,
                        };
                        self.send(&f).await;
                        return Outcome::Finished(reason);
                    }
                    EngineEvent::Failed(e) => {
                        self.flush(&mut pending, &mut next_seq).await;
                        let w = e.to_wire();
                        let kind = w.kind;
                        self.error(next_seq(), w).await;
                        return Outcome::Failed(kind);
                    }
                }
            }
            match self.frame_batch {
                // The first token goes at once (time to first token, and
                // the router's prefill accounting, must not wait); later
                // ones wait for the window, or for a frame's worth.
                Some(window)
                    if !pending.is_empty()
                        && !first_batch
                        && pending.len() < MAX_BATCHED_TOKENS =>
                {
                    flush_at.get_or_insert_with(|| Instant::now() + window);
                }
                _ => {
                    flush_at = None;
                    self.flush(&mut pending, &mut next_seq).await
                }
            }
        }
    }

    /// The phase breakdown: the prefill worker's figures when it prefilled,
    /// else this engine's admission and first token.
    fn timings(&self, started: Option<Instant>, first: Option<Instant>) -> PhaseTimings {
        let now = Instant::now();
        let first = first.unwrap_or(now);
        let started = started.unwrap_or(first);
        let ms = |d: Duration| d.as_secs_f32() * 1000.0;
        let first_token_ms = ms(first.saturating_duration_since(self.received));
        let o = self.prefill.lock().map(|o| o.clone()).unwrap_or_default();
        match o.remote {
            Some(r) => PhaseTimings {
                queue_ms: r.queue_ms,
                prefill_ms: r.prefill_ms,
                transfer_ms: r.transfer_ms,
                first_token_ms,
                prefill_worker: Some(r.worker_id),
                decode_worker: self.worker_id,
                fallback: None,
            },
            None => PhaseTimings {
                queue_ms: ms(started.saturating_duration_since(self.received)),
                prefill_ms: ms(first.saturating_duration_since(started)),
                transfer_ms: 0.0,
                first_token_ms,
                prefill_worker: None,
                decode_worker: self.worker_id,
                fallback: o.fallback,
            },
        }
    }

    async fn flush(&mut self, pending: &mut Vec<u32>, next_seq: &mut impl FnMut() -> FrameSeq) {
        if pending.is_empty() {
            return;
        }
        let f = FrameTokens {
            request_id: self.request_id,
            seq: next_seq(),
            token_ids: std::mem::take(pending),
        };
        self.send(&f).await;
    }

    async fn error(&mut self, seq: FrameSeq, error: WireError) {
        let f = FrameError {
            request_id: self.request_id,
            seq,
            error,
        };
        self.send(&f).await;
    }

    async fn send<T: dynamo_bus_schema::WireMessage>(&mut self, msg: &T) {
        self.last_sent = Instant::now();
        // The gateway's liveness checks turn a lost frame into an error.
        let bytes = match dynamo_bus_schema::encode(msg) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(request = %self.request_id, error = %e, "cannot encode frame");
                self.stats.frames_sent(1, false);
                return;
            }
        };
        let o = Outgoing {
            subject: self.reply_to.clone(),
            bytes,
            mux: self.mux,
        };
        if self.sink.send(o).await.is_err() {
            tracing::warn!(request = %self.request_id, "the worker's frame queue is gone");
            self.stats.frames_sent(1, false);
        }
    }
}
