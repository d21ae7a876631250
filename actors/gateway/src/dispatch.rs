//! Getting a worker to take a prompt: route it (router actor), send it,
//! wait for the acknowledgement, and try another worker when one refuses
//! or is unreachable.
//!
//! Invariants: a worker that fails a request is never chosen again for it;
//! a worker that refuses as overloaded is reported to the router, which
//! avoids it until it has a place again (or for a while); when every
//! worker refused for room the request waits for room at most the
//! admission queue's wait (a later prompt of a batch whose earlier ones
//! run: up to a minute), among at most `max_queued` such waiters, then
//! gets 503 `workers_overloaded`; the deadline bounds every wait; a request routed
//! to a worker whose model card differs from the one it was tokenized with
//! is given back ([`DispatchError::CardChanged`]) so the caller tokenizes
//! it again with that card; every route that does not end in an accepted
//! request is released.

use crate::error::ApiError;
use crate::generate::map_wire;
use crate::inbox::Frame;
use crate::shared::Shared;
use dynamo_bus_schema::{
    unix_ms, CancelReason, CancelRequest, ErrorKind, GenerateAck, GenerateDisagg, GenerateRequest,
    ModelName, RequestId, SamplingParams, WorkerId, HEADER_FRAME_BATCH_MS, HEADER_FRAME_MUX,
};
use dynamo_router::{RouteDecision, RouteError, RouterMsg};
use dynamo_runtime::BusError;
use ractor::rpc::CallResult;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Everything needed to send (or re-send) a request.
pub struct Attempt {
    pub model: ModelName,
    pub prompt: Arc<Vec<u32>>,
    pub sampling: SamplingParams,
    pub routing: Option<dynamo_router::policy::KvCostWeights>,
    /// The card the prompt was tokenized with (`None`: any worker will do,
    /// as for a migration, whose tokens are fixed).
    pub card_digest: Option<u64>,
    /// Tokens per KV block of that card.
    pub block_size: u32,
    /// How long workers may hold token frames (a client that does not
    /// stream), sent as [`HEADER_FRAME_BATCH_MS`].
    pub frame_batch: Option<std::time::Duration>,
    /// Waits for room until the deadline rather than the admission
    /// queue's wait (a later prompt of a batch: [`crate::openai::ValidGenerate::patient`]).
    pub patient: bool,
}

/// Why a request could not be dispatched.
#[derive(Debug)]
pub enum DispatchError {
    Api(ApiError),
    /// The router chose a worker whose model card (digest) differs from
    /// the one the prompt was tokenized with.
    CardChanged(u64),
}

impl From<ApiError> for DispatchError {
    fn from(e: ApiError) -> Self {
        DispatchError::Api(e)
    }
}

/// Longest a later prompt of a batch waits for room (its place among the
/// waiters is held meanwhile, and its earlier prompts' frames wait unread).
const BATCH_ROOM_WAIT: Duration = Duration::from_secs(60);

/// How often a request waiting for room asks the router again when no
/// request of this gateway ended meanwhile (a place freed by another
/// gateway's request, or a mark that expired).
const ROOM_POLL: Duration = Duration::from_millis(100);

/// Requests waiting for a worker with room: every worker of their model
/// refused them for room (`Overloaded`). Each waits at most the admission
/// queue's wait (`max_queue_wait`) within its deadline, and at most
/// `max_queued` wait at once (past it: 503 at once, as before). A request
/// of a model ending wakes one of that model's waiters; a wake-up that
/// finds none busy waiting is kept for the next (one at most), and every
/// waiter also asks again each [`ROOM_POLL`].
pub struct Room {
    /// One per model that has had waiters (bounded by the models served).
    by_model: std::sync::Mutex<std::collections::HashMap<ModelName, Arc<tokio::sync::Notify>>>,
    waiters: Arc<tokio::sync::Semaphore>,
}

impl Room {
    pub fn new(max_waiting: usize) -> Self {
        Room {
            by_model: std::sync::Mutex::new(std::collections::HashMap::new()),
            waiters: Arc::new(tokio::sync::Semaphore::new(max_waiting)),
        }
    }

    /// A request of `model` that a worker had taken ended: one of the
    /// model's waiters tries again.
    pub fn freed(&self, model: &ModelName) {
        if let Ok(m) = self.by_model.lock() {
            if let Some(n) = m.get(model) {
                n.notify_one();
            }
        }
    }

    fn of(&self, model: &ModelName) -> Arc<tokio::sync::Notify> {
        match self.by_model.lock() {
            Ok(mut m) => m.entry(model.clone()).or_default().clone(),
            // Poisoned (a panic while holding it): waiters still poll.
            Err(_) => Arc::new(tokio::sync::Notify::new()),
        }
    }
}

/// A request's wait for room: since when, and its place among the waiters.
type Waiting = Option<(Instant, tokio::sync::OwnedSemaphorePermit)>;

/// Waits until a place may be free (a request of this gateway ended, or
/// [`ROOM_POLL`] passed); false when this request may not wait (longer).
async fn wait_for_room(
    shared: &Shared,
    model: &ModelName,
    waiting: &mut Waiting,
    deadline: Instant,
    patient: bool,
) -> bool {
    let now = Instant::now();
    let since = match waiting {
        Some((since, _)) => *since,
        None => {
            let Ok(place) = shared.room.waiters.clone().try_acquire_owned() else {
                return false;
            };
            shared.metrics.room_waits.inc();
            *waiting = Some((now, place));
            now
        }
    };
    let wait = if patient {
        shared.config.admission.max_queue_wait.max(BATCH_ROOM_WAIT)
    } else {
        shared.config.admission.max_queue_wait
    };
    let until = (since + wait).min(deadline);
    if now >= until {
        return false;
    }
    let room = shared.room.of(model);
    tokio::select! {
        _ = room.notified() => {}
        _ = tokio::time::sleep_until(until.min(now + ROOM_POLL)) => {}
    }
    true
}

/// Routes `tokens` and gets a worker to accept them as request `id`,
/// trying other workers when one refuses (retryable) or is unreachable;
/// workers in `exclude` are never chosen and the ones that fail are added.
/// When every worker refused for room, the request waits for one to have
/// room again ([`Room`]), then tries again; a worker that refused for room
/// is not excluded.
pub async fn dispatch(
    shared: &Arc<Shared>,
    id: RequestId,
    plan: &Attempt,
    tokens: Arc<Vec<u32>>,
    sampling: &SamplingParams,
    deadline: Instant,
    exclude: &mut Vec<WorkerId>,
) -> Result<(RouteDecision, mpsc::Receiver<Frame>), DispatchError> {
    let mut waiting: Waiting = None;
    loop {
        match try_workers(shared, id, plan, &tokens, sampling, deadline, exclude).await {
            Err(DispatchError::Api(e)) if e.code == Some("workers_overloaded") => {
                if !wait_for_room(shared, &plan.model, &mut waiting, deadline, plan.patient).await {
                    return Err(refused_overloaded(shared, e));
                }
            }
            other => return other,
        }
    }
}

/// One round of [`dispatch`]: up to `max_route_attempts` workers. Every
/// worker refusing for room ends it with a `workers_overloaded` error
/// (not counted yet: the caller may wait and try again).
async fn try_workers(
    shared: &Arc<Shared>,
    id: RequestId,
    plan: &Attempt,
    tokens: &Arc<Vec<u32>>,
    sampling: &SamplingParams,
    deadline: Instant,
    exclude: &mut Vec<WorkerId>,
) -> Result<(RouteDecision, mpsc::Receiver<Frame>), DispatchError> {
    let attempts = shared.config.max_route_attempts.max(1);
    let mut last_error = None;
    // Workers that refused this request for room (they said `Overloaded`):
    // avoided this round, not for good.
    let mut overloaded: Vec<WorkerId> = Vec::new();
    for attempt in 0..attempts {
        if attempt > 0 {
            shared.metrics.route_retries.inc();
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ApiError::timeout(
                "The request did not reach a worker before its deadline.",
            )
            .into());
        }
        let avoid: Vec<WorkerId> = exclude.iter().chain(&overloaded).copied().collect();
        let decision =
            match route(shared, id, &plan.model, tokens, &avoid, plan.routing, left).await {
                Ok(d) => d,
                // The workers left all refused it for room: that is overload,
                // not a missing fleet.
                Err(e) if !overloaded.is_empty() && e.code == Some("no_workers_available") => {
                    return Err(overloaded_error(last_error.unwrap_or(e)).into())
                }
                Err(e) => return Err(e.into()),
            };
        if let Some(want) = plan.card_digest {
            if decision.card_digest != want {
                release(shared, id);
                return Err(DispatchError::CardChanged(decision.card_digest));
            }
        }
        let rx = shared.inbox.register(id);
        let req = GenerateRequest {
            request_id: id,
            model: plan.model.clone(),
            token_ids: (**tokens).clone(),
            sampling: sampling.clone(),
            reply_to: shared.frames_subject.clone(),
            deadline_unix_ms: unix_ms()
                + deadline
                    .saturating_duration_since(Instant::now())
                    .as_millis() as u64,
        };
        let subject = shared.bus.subjects.worker_generate(decision.worker_id);
        let wait = shared.config.ack_timeout.min(left);
        // This inbox takes frames of several requests in one message.
        let mut h = async_nats::HeaderMap::new();
        h.insert(HEADER_FRAME_MUX, "1");
        if let Some(w) = plan.frame_batch {
            h.insert(
                HEADER_FRAME_BATCH_MS,
                w.as_millis().clamp(1, 1000).to_string().as_str(),
            );
        }
        let headers = Some(h);
        let res: Result<GenerateAck, BusError> = match decision.prefill_worker {
            Some(prefill_worker) => {
                let req = GenerateDisagg {
                    request: req,
                    prefill_worker,
                    cached_blocks: decision.overlap_blocks,
                };
                shared.bus.request_with(subject, &req, headers, wait).await
            }
            None => shared.bus.request_with(subject, &req, headers, wait).await,
        };
        let failure = match res {
            Ok(ack) => match ack.rejected {
                None => {
                    let bs = plan.block_size as u64;
                    shared
                        .metrics
                        .predicted_cached_tokens
                        .inc_by((decision.overlap_blocks as u64 * bs).min(tokens.len() as u64));
                    return Ok((decision, rx));
                }
                Some(e) if e.kind.is_retryable() => {
                    if e.kind == ErrorKind::Overloaded {
                        overloaded.push(decision.worker_id);
                        if let Ok(r) = shared.router() {
                            let _ = r.cast(RouterMsg::WorkerOverloaded(decision.worker_id));
                        }
                    }
                    Some(map_wire(&e))
                }
                Some(e) => {
                    release(shared, id);
                    return Err(map_wire(&e).into());
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
            Err(BusError::TooLarge { len, .. }) => {
                // No worker could take it: the client's to shorten.
                release(shared, id);
                return Err(ApiError::invalid(
                    Some("prompt".to_string()),
                    format!(
                        "The request is {len} bytes on the bus, over its limit of {} KiB: shorten the prompt.",
                        dynamo_bus_schema::codec::MAX_MESSAGE / 1024
                    ),
                )
                .into());
            }
            Err(e) => {
                tracing::warn!(request = %id, error = %e, "cannot send request");
                Some(ApiError::unavailable(
                    "The bus is unavailable; retry shortly.",
                ))
            }
        };
        tracing::debug!(request = %id, worker = %decision.worker_id, ?failure, "worker did not take request");
        if overloaded.last() != Some(&decision.worker_id) {
            exclude.push(decision.worker_id);
        }
        release(shared, id);
        last_error = failure;
    }
    let e = last_error.unwrap_or_else(|| ApiError::unavailable("No worker accepted the request."));
    Err(e.into())
}

/// The error of a request every worker refused for room.
fn overloaded_error(e: ApiError) -> ApiError {
    if e.code == Some("workers_overloaded") {
        e
    } else {
        ApiError::overloaded(
            "Every worker for this model is at capacity. Retry shortly.",
            "workers_overloaded",
        )
    }
}

/// A request every worker refused for room, after its wait: counted as a
/// rejection.
fn refused_overloaded(shared: &Shared, e: ApiError) -> DispatchError {
    shared
        .metrics
        .rejected
        .with_label_values(&["workers_overloaded"])
        .inc();
    overloaded_error(e).into()
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
            // Its workers' registrations lapsed while the bus was down, or
            // it is a model this gateway holds requests for: a 503 to
            // retry, not a 404 a client takes as final. Otherwise the
            // model is gone (a request held for workers waits on 404 too).
            Err(RouteError::UnknownModel { model })
                if shared.bus.outage_within(crate::generate::AFTER_OUTAGE)
                    || shared.config.held_models.iter().any(|m| m == &model) =>
            {
                return Err(ApiError::unavailable(format!(
                    "No worker of {model} is registered now; retry shortly."
                )))
            }
            Err(RouteError::UnknownModel { model }) => {
                return Err(ApiError::model_not_found(&model))
            }
            Err(e @ RouteError::NoWorkers { .. }) => {
                return Err(ApiError::unavailable(format!("{e}. Retry shortly.")))
            }
            Err(e @ RouteError::Overloaded { .. }) => {
                return Err(ApiError::overloaded(
                    format!("{e}. Retry shortly."),
                    "workers_overloaded",
                ));
            }
            Ok(d) => return Ok(d),
        }
    }
}

/// Gives a route back: the router's load accounting and the inbox entry.
pub fn release(shared: &Shared, id: RequestId) {
    shared.inbox.unregister(id);
    if let Ok(r) = shared.router() {
        let _ = r.cast(RouterMsg::Release(id));
    }
}

/// Tells a worker to stop a request (from a task of the gateway's own).
pub fn send_cancel(shared: &Arc<Shared>, worker: WorkerId, id: RequestId, reason: CancelReason) {
    if tokio::runtime::Handle::try_current().is_err() {
        return; // the runtime is going away: so is every worker's stream
    }
    let s = shared.clone();
    shared.spawner.spawn_transient("cancel", async move {
        let subject = s.bus.subjects.worker_cancel(worker);
        if let Err(e) = s
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
