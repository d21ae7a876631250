//! `dynamo-engine`: the one seam every engine implements.
//!
//! The worker actor parses a wire [`GenerateRequest`] into a [`ValidRequest`]
//! (the only request type an engine accepts) and drives the engine through
//! [`Engine`]. Gateway and router never see an engine's internals.
//!
//! Invariants:
//! - A [`ValidRequest`] has a non-empty prompt whose ids are all inside the
//!   vocabulary, `max_tokens >= 1`, and `prompt + max_tokens <= context`.
//! - Every [`ResponseStream`] ends with exactly one terminal event
//!   ([`EngineEvent::Finished`] or [`EngineEvent::Failed`]) unless the
//!   receiver is dropped first; [`EngineEvent::Started`] comes before any tokens.
//! - An engine's KV pool lives in its [`KvArena`]; blocks it reserved for a
//!   peer ([`Engine::reserve_blocks`]) are written only by that peer until
//!   they are committed or released.

use dynamo_bus_schema::blocks::SequenceHash;
use dynamo_bus_schema::{
    ErrorKind, FinishReason, GenerateRequest, LoadMetrics, RequestId, SamplingParams, WireError,
};
use std::sync::Arc;
use thiserror::Error;
use tokio::sync::mpsc;

mod arena;
pub mod driver;
pub use arena::{ArenaError, KvArena};
pub use driver::{
    commands, kv_events, liveness, Admission, Alive, Commands, KvEventSink, Liveness, QueueError,
    Queued, ReservationReceiver, Slot,
};

/// Limits a request is checked against (from the model card).
#[derive(Clone, Copy, Debug)]
pub struct EngineLimits {
    pub context_length: u32,
    pub vocab_size: u32,
}

/// Sampling parameters that passed validation.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidSampling {
    pub max_tokens: u32,
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: u32,
    pub seed: Option<u64>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
}

/// A request an engine can run.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidRequest {
    id: RequestId,
    prompt: Vec<u32>,
    sampling: ValidSampling,
}

#[derive(Clone, Debug, Error, PartialEq)]
pub enum RequestError {
    #[error("prompt is empty")]
    EmptyPrompt,
    #[error(
        "prompt token {token} at position {position} is outside the vocabulary (size {vocab})"
    )]
    TokenOutOfVocab {
        token: u32,
        position: usize,
        vocab: u32,
    },
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    #[error(
        "prompt ({prompt} tokens) + max_tokens ({max_tokens}) exceeds the context length {context}"
    )]
    TooLong {
        prompt: usize,
        max_tokens: u32,
        context: u32,
    },
    #[error("{field} = {value} is out of range ({range})")]
    OutOfRange {
        field: &'static str,
        value: f32,
        range: &'static str,
    },
}

impl ValidRequest {
    /// Checks a wire request against the model's limits.
    pub fn parse(req: &GenerateRequest, limits: EngineLimits) -> Result<Self, RequestError> {
        Self::from_parts(req.request_id, req.token_ids.clone(), &req.sampling, limits)
    }

    /// Checks a prompt and sampling parameters against the model's limits.
    pub fn from_parts(
        id: RequestId,
        prompt: Vec<u32>,
        s: &SamplingParams,
        limits: EngineLimits,
    ) -> Result<Self, RequestError> {
        if prompt.is_empty() {
            return Err(RequestError::EmptyPrompt);
        }
        if let Some((position, &token)) = prompt
            .iter()
            .enumerate()
            .find(|(_, &t)| t >= limits.vocab_size)
        {
            return Err(RequestError::TokenOutOfVocab {
                token,
                position,
                vocab: limits.vocab_size,
            });
        }
        if s.max_tokens == 0 {
            return Err(RequestError::ZeroMaxTokens);
        }
        if prompt.len() as u64 + s.max_tokens as u64 > limits.context_length as u64 {
            return Err(RequestError::TooLong {
                prompt: prompt.len(),
                max_tokens: s.max_tokens,
                context: limits.context_length,
            });
        }
        if !(0.0..=2.0).contains(&s.temperature) {
            return Err(RequestError::OutOfRange {
                field: "temperature",
                value: s.temperature,
                range: "0..=2",
            });
        }
        if !(s.top_p > 0.0 && s.top_p <= 1.0) {
            return Err(RequestError::OutOfRange {
                field: "top_p",
                value: s.top_p,
                range: "(0, 1]",
            });
        }
        Ok(ValidRequest {
            id,
            prompt,
            sampling: ValidSampling {
                max_tokens: s.max_tokens,
                temperature: s.temperature,
                top_p: s.top_p,
                top_k: s.top_k,
                seed: s.seed,
                stop_token_ids: s.stop_token_ids.clone(),
                ignore_eos: s.ignore_eos,
            },
        })
    }
    pub fn id(&self) -> RequestId {
        self.id
    }
    pub fn prompt(&self) -> &[u32] {
        &self.prompt
    }
    pub fn sampling(&self) -> &ValidSampling {
        &self.sampling
    }
}

/// What an engine reports for one request.
#[derive(Clone, Debug, PartialEq)]
pub enum EngineEvent {
    /// Admitted; `cached_tokens` of the prompt were served from the prefix cache.
    Started {
        cached_tokens: u32,
    },
    /// Tokens produced by one engine step.
    Tokens(Vec<u32>),
    /// The prompt tokens served from the prefix cache, known only after
    /// `Started` (an external engine that reports them late, as vLLM does
    /// in its last usage chunk): replaces `Started`'s count. At most once,
    /// before the terminal event.
    Cached {
        cached_tokens: u32,
    },
    Finished {
        reason: FinishReason,
    },
    Failed(EngineError),
}

#[derive(Clone, Debug, Error, PartialEq)]
pub enum EngineError {
    #[error("engine is full: {0}")]
    Overloaded(String),
    #[error("engine stopped")]
    Stopped,
    #[error("invalid request: {0}")]
    Invalid(RequestError),
    #[error("request {0} is already running")]
    Duplicate(RequestId),
    #[error("request needs {needed} KV blocks but the engine has only {capacity}")]
    TooLarge { needed: usize, capacity: usize },
    #[error("KV block data refused: {0}")]
    BadKvData(String),
    #[error("internal engine error: {0}")]
    Internal(String),
    /// The engine refused the request as invalid (an external engine's 4xx).
    #[error("the engine refused the request: {0}")]
    Rejected(String),
    /// The engine failed while serving it (an external engine's server
    /// went away or answered an error): another worker can take it over.
    #[error("the engine failed: {0}")]
    Failed(String),
}

// Not `#[from]`: the message already shows the cause, and a source would
// print it twice in a chain (`{:#}`).
impl From<RequestError> for EngineError {
    fn from(e: RequestError) -> Self {
        EngineError::Invalid(e)
    }
}

impl EngineError {
    /// The bus error a worker sends for this failure.
    pub fn to_wire(&self) -> WireError {
        let kind = match self {
            EngineError::Overloaded(_) => ErrorKind::Overloaded,
            EngineError::Stopped | EngineError::Failed(_) => ErrorKind::EngineFailed,
            EngineError::Invalid(_)
            | EngineError::Duplicate(_)
            | EngineError::TooLarge { .. }
            | EngineError::Rejected(_) => ErrorKind::InvalidRequest,
            EngineError::Internal(_) | EngineError::BadKvData(_) => ErrorKind::Internal,
        };
        WireError::new(kind, self.to_string())
    }
}

/// The events of one request, in order. Unbounded on purpose: the engine
/// never waits on a consumer (one slow request must not stall the batch),
/// and a request's stream holds at most `max_tokens + 2` events (started,
/// one per step with at least one token, one terminal), so its size is
/// bounded by the request's own validated `max_tokens`.
pub type ResponseStream = mpsc::UnboundedReceiver<EngineEvent>;

/// KV events an engine buffers for its publisher. When the publisher falls
/// this far behind (the bus is away), newer events are dropped and
/// counted: routers see the gap in the event ids and re-sync from a dump.
pub const KV_EVENT_BUFFER: usize = 65_536;

/// The engine's stream of KV events (bounded: see [`KV_EVENT_BUFFER`]).
pub type KvEventStream = mpsc::Receiver<KvCacheEvent>;

/// Faults an engine injects into itself on request (chaos tests only; the
/// node refuses them unless its config enables fault injection).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineFault {
    /// The driver (task or thread) panics outside any step.
    PanicDriver,
}

/// Where a cached KV block lives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvTier {
    /// The engine's own pool (what a step computes with).
    #[default]
    Device,
    /// Host memory, offloaded from the device pool.
    Host,
    /// Local disk, offloaded from the host tier.
    Disk,
}

/// A change in which KV blocks an engine holds (for KV-aware routing).
#[derive(Clone, Debug, PartialEq)]
pub struct KvCacheEvent {
    /// Per-engine, strictly increasing from 1 (shared by every tier).
    pub event_id: u64,
    pub tier: KvTier,
    pub data: KvCacheEventData,
}

/// One KV block as bytes: its hash, its parent's, and its K/V (layout is
/// the engine's own; only an engine of the same model and config reads it).
#[derive(Clone, Debug, PartialEq)]
pub struct KvBlockData {
    pub hash: SequenceHash,
    pub parent: Option<SequenceHash>,
    pub bytes: Vec<u8>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum KvCacheEventData {
    /// `blocks` were stored, in prefix order, after `parent`.
    Stored {
        parent: Option<SequenceHash>,
        blocks: Vec<SequenceHash>,
    },
    Removed {
        blocks: Vec<SequenceHash>,
    },
    /// Every block is gone.
    Cleared,
}

/// An engine's whole block table, consistent with its KV events up to
/// `last_event_id` (later events apply on top of it).
#[derive(Clone, Debug, PartialEq)]
pub struct KvSnapshot {
    pub last_event_id: u64,
    /// Blocks in the engine's own pool.
    pub blocks: Vec<SequenceHash>,
    /// Blocks in the offload tiers (host, disk), when the engine has them.
    pub offloaded: Vec<(KvTier, Vec<SequenceHash>)>,
}

/// Names pool blocks an engine reserved for a peer to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ReservationId(pub u64);

/// Pool blocks reserved for a peer to write straight into ([`KvArena`]
/// blocks, in the order the peer fills them). Until the reservation is
/// committed or released, the engine neither computes with these blocks,
/// nor hands them out, nor evicts them.
#[derive(Clone, Debug, PartialEq)]
pub struct Reservation {
    pub id: ReservationId,
    pub blocks: Vec<u32>,
}

/// Sends an engine a command carrying a reply channel: the receiver of the
/// answer, or [`EngineError::Stopped`] when `send` finds the engine gone.
pub fn ask<T>(
    send: impl FnOnce(tokio::sync::oneshot::Sender<T>) -> bool,
) -> Result<tokio::sync::oneshot::Receiver<T>, EngineError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    if send(tx) {
        Ok(rx)
    } else {
        Err(EngineError::Stopped)
    }
}

/// Whether an engine serves yet ([`Engine::ready`]).
pub enum Readiness {
    /// It serves now.
    Now,
    /// It will once this resolves `Ok` (an external engine's server is
    /// still loading), or never, with why.
    Later(std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), EngineError>> + Send>>),
}

/// The engine seam.
pub trait Engine: Send + Sync + 'static {
    /// Whether the engine serves yet. The worker registers as `Starting`
    /// (routers skip it) until it does. Engines in this process serve as
    /// soon as they are started.
    fn ready(&self) -> Readiness {
        Readiness::Now
    }
    /// Short engine kind for registration and logs (e.g. `mocker`).
    fn kind(&self) -> &'static str;
    /// Starts a request; its events arrive on the returned stream. Answers
    /// [`EngineError::Overloaded`] at once when the engine already holds as
    /// many requests (running and waiting) as it admits.
    fn generate(&self, req: ValidRequest) -> Result<ResponseStream, EngineError>;
    /// Stops a request at the next step and frees its blocks. Unknown ids are ignored.
    fn cancel(&self, id: RequestId);
    /// Requests the engine holds at once, running and waiting (past it,
    /// [`Engine::generate`] answers `Overloaded`).
    fn capacity(&self) -> usize;
    /// Current load.
    fn load(&self) -> LoadMetrics;
    /// Takes the stream of KV cache events (only the first caller gets it).
    fn take_kv_events(&self) -> Option<KvEventStream>;
    /// Resolves once the engine's driver has stopped: a panic, a dead
    /// thread, or the handle dropped. A worker whose engine stopped on its
    /// own is dead and must be restarted with a fresh engine.
    fn liveness(&self) -> Liveness;
    /// Injects a fault (chaos tests).
    fn inject(&self, fault: EngineFault) -> Result<(), EngineError>;
    /// Asks for a snapshot of the block table (answered between engine steps).
    fn kv_snapshot(&self) -> Result<tokio::sync::oneshot::Receiver<KvSnapshot>, EngineError>;
    /// Bytes one KV block occupies (what a transfer moves per block).
    fn kv_block_bytes(&self) -> usize;
    /// The KV of the longest cached prefix of `hashes` (answered between
    /// steps; it stops at the first block the engine does not hold).
    fn export_blocks(
        &self,
        hashes: Vec<SequenceHash>,
    ) -> Result<tokio::sync::oneshot::Receiver<Vec<KvBlockData>>, EngineError>;
    /// Stores blocks exported by an engine of the same model and config into
    /// the prefix cache, in order (blocks already cached are skipped).
    /// Answers how many were stored.
    fn import_blocks(
        &self,
        blocks: Vec<KvBlockData>,
    ) -> Result<tokio::sync::oneshot::Receiver<Result<usize, EngineError>>, EngineError>;
    /// The memory the engine's KV pool lives in (block `b` of the pool is
    /// block `b` of the arena), for peers to write reserved blocks.
    fn kv_arena(&self) -> Arc<KvArena>;
    /// Reserves `n` pool blocks for a peer to write (evicting cached blocks,
    /// offloaded first, as a step would); fails with
    /// [`EngineError::Overloaded`] when the pool cannot spare them.
    fn reserve_blocks(&self, n: usize) -> Result<ReservationReceiver, EngineError>;
    /// The peer's writes have landed: the first `hashes.len()` reserved
    /// blocks now hold `hashes` (a chain after `parent`) and join the prefix
    /// cache, exactly as [`Engine::import_blocks`] would store them; the
    /// rest are freed. Answers how many were stored. Commit only once no
    /// peer can write the blocks any more (their registration is closed).
    fn commit_blocks(
        &self,
        id: ReservationId,
        parent: Option<SequenceHash>,
        hashes: Vec<SequenceHash>,
    ) -> Result<tokio::sync::oneshot::Receiver<Result<usize, EngineError>>, EngineError>;
    /// Frees a reservation without storing anything (unknown ids are
    /// ignored). Release only once no peer can write the blocks any more.
    fn release_blocks(&self, id: ReservationId);
}

#[cfg(test)]
mod tests {
    use super::*;
    use dynamo_bus_schema::ModelName;

    fn req(tokens: Vec<u32>, max_tokens: u32) -> GenerateRequest {
        GenerateRequest {
            request_id: RequestId(1),
            model: ModelName("m".into()),
            token_ids: tokens,
            sampling: SamplingParams::greedy(max_tokens),
            reply_to: "x".into(),
            deadline_unix_ms: 0,
        }
    }

    #[test]
    fn parse_checks_every_limit() {
        let l = EngineLimits {
            context_length: 10,
            vocab_size: 100,
        };
        assert!(ValidRequest::parse(&req(vec![1, 2], 8), l).is_ok());
        assert_eq!(
            ValidRequest::parse(&req(vec![], 1), l),
            Err(RequestError::EmptyPrompt)
        );
        assert!(matches!(
            ValidRequest::parse(&req(vec![1, 100], 1), l),
            Err(RequestError::TokenOutOfVocab { position: 1, .. })
        ));
        assert_eq!(
            ValidRequest::parse(&req(vec![1], 0), l),
            Err(RequestError::ZeroMaxTokens)
        );
        assert!(matches!(
            ValidRequest::parse(&req(vec![1, 2, 3], 8), l),
            Err(RequestError::TooLong { .. })
        ));
        let mut r = req(vec![1], 1);
        r.sampling.top_p = 0.0;
        assert!(matches!(
            ValidRequest::parse(&r, l),
            Err(RequestError::OutOfRange { field: "top_p", .. })
        ));
    }
}
