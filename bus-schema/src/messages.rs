//! Wire types. Each top-level message implements [`WireMessage`] with a kind
//! tag that never changes. Closed sets (error kinds, finish reasons, roles…)
//! are "open enums": encoded as a `u16`, and a value this build does not know
//! decodes to `Unknown(n)` instead of failing, so a newer peer's variant is
//! kept and can be reported.

use crate::codec::{MessageKind, WireMessage};
use crate::ids::*;
use serde::{Deserialize, Serialize};

macro_rules! open_enum {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $variant:ident = $val:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[serde(from = "u16", into = "u16")]
        pub enum $name {
            $($(#[$vdoc])* $variant,)+
            /// A value from a newer schema; kept, never fatal.
            Unknown(u16),
        }
        impl From<u16> for $name {
            fn from(v: u16) -> Self {
                match v { $($val => $name::$variant,)+ other => $name::Unknown(other) }
            }
        }
        impl From<$name> for u16 {
            fn from(v: $name) -> u16 {
                match v { $($name::$variant => $val,)+ $name::Unknown(other) => other }
            }
        }
    };
}

macro_rules! wire {
    ($ty:ident = $kind:literal) => {
        impl WireMessage for $ty {
            const KIND: MessageKind = MessageKind($kind);
            const NAME: &'static str = stringify!($ty);
        }
    };
}

open_enum!(
    /// What the receiver of an error should do about it.
    ErrorKind {
        /// The request itself is wrong; never retried or migrated.
        InvalidRequest = 1,
        /// The worker is full right now; another worker may take it.
        Overloaded = 2,
        /// The worker or its engine failed mid-request; the request may migrate.
        EngineFailed = 3,
        /// The request was cancelled (client gone, stop string, admin).
        Cancelled = 4,
        /// The request's deadline passed.
        DeadlineExceeded = 5,
        /// The worker is draining or shutting down; route elsewhere.
        Unavailable = 6,
        /// A bug or an unexpected state; fail the request.
        Internal = 7,
        /// The message could not be decoded.
        BadMessage = 8,
    }
);

impl ErrorKind {
    /// Whether sending the same request to another worker can succeed.
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            ErrorKind::Overloaded | ErrorKind::EngineFailed | ErrorKind::Unavailable
        )
    }
}

/// An error that crosses the bus: a kind to act on and a message for humans
/// (never an internal error chain).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WireError {
    pub kind: ErrorKind,
    pub message: String,
}

impl WireError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        WireError {
            kind,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}: {}", self.kind, self.message)
    }
}

open_enum!(
    /// Why a sequence stopped.
    FinishReason {
        /// `max_tokens` reached.
        Length = 1,
        /// An end-of-sequence or stop token was generated.
        Stop = 2,
        /// Cancelled before it finished.
        Cancelled = 3,
    }
);

open_enum!(
    /// What a worker does.
    WorkerRole {
        /// Prefill and decode in one engine.
        Aggregated = 1,
        Prefill = 2,
        Decode = 3,
    }
);

open_enum!(
    /// A worker's admission state.
    WorkerState {
        /// Takes new requests.
        Serving = 1,
        /// Finishes in-flight requests, takes no new ones.
        Draining = 2,
        /// Its engine died: it takes nothing and is being restarted (a new
        /// generation follows). Older routers read it as an unknown state,
        /// which is not routable either.
        Failed = 3,
        /// Its engine is loading (an external engine's server is not
        /// healthy yet): it takes nothing until it turns `Serving`.
        Starting = 4,
    }
);

open_enum!(
    /// Why a request is cancelled.
    CancelReason {
        ClientDisconnected = 1,
        StopString = 2,
        DeadlineExceeded = 3,
        Admin = 4,
        /// The gateway moved the request to another worker.
        Migrated = 5,
        /// The gateway no longer has the request (it failed it while the
        /// bus was down, or the gateway is gone).
        Orphaned = 6,
    }
);

open_enum!(
    /// Where a KV block lives.
    StorageTier {
        Device = 1,
        Host = 2,
        Disk = 3,
    }
);

open_enum!(
    /// What happened to a worker's KV blocks.
    KvEventKind {
        /// `blocks` were stored after `parent`, in prefix order.
        Stored = 1,
        /// `blocks` were evicted from `tier`.
        Removed = 2,
        /// Every block of the worker is gone (engine restart, cache reset).
        Cleared = 3,
    }
);

open_enum!(
    /// Faults a node injects into its own actors when its config allows it.
    FaultKind {
        /// The target actor panics inside its message handler.
        PanicActor = 1,
        /// The worker's KV transfer endpoint stops polling for progress (a
        /// peer that never polls: writes into it stall and time out).
        StopTransferProgress = 2,
        /// The worker's engine driver panics (its task or thread dies).
        PanicEngine = 3,
        /// One of the target actor's background tasks ends as if its input
        /// had gone away (see [`ActorFault::task`]).
        EndTask = 4,
        /// The router drops the next KV event batch it receives live, as if
        /// core NATS had lost it (the KV events stream still holds it).
        DropKvBatch = 5,
    }
);

/// Sampling parameters as sent to a worker (already validated by the gateway).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    pub max_tokens: u32,
    pub temperature: f32,
    pub top_p: f32,
    /// 0 = disabled.
    pub top_k: u32,
    pub seed: Option<u64>,
    /// Generation stops after emitting one of these (EOS is added by the worker).
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
}

impl SamplingParams {
    /// Greedy decoding of up to `max_tokens` tokens, no seed, no extra stops.
    pub fn greedy(max_tokens: u32) -> Self {
        SamplingParams {
            max_tokens,
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
        }
    }
}

/// NATS header on a [`GenerateRequest`] (or [`GenerateDisagg`]): the client
/// reads the whole answer at once (not streamed), so the worker may hold
/// its token frames for up to this many milliseconds and send them
/// together (fewer bus messages per request). Absent: a frame per engine
/// step. A header rather than a field, so workers and gateways of either
/// version understand each other.
pub const HEADER_FRAME_BATCH_MS: &str = "Dynamo-Frame-Batch-Ms";

/// The batching window a [`HEADER_FRAME_BATCH_MS`] value asks for:
/// 1–1000 ms, anything else none.
pub fn frame_batch_window(value: &str) -> Option<std::time::Duration> {
    match value.trim().parse::<u64>() {
        Ok(ms @ 1..=1000) => Some(std::time::Duration::from_millis(ms)),
        _ => None,
    }
}

/// Gateway → worker (`Subjects::worker_generate`), sent as a NATS request;
/// the worker replies with a [`GenerateAck`] and then streams frames to
/// `reply_to`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    pub request_id: RequestId,
    pub model: ModelName,
    pub token_ids: Vec<u32>,
    pub sampling: SamplingParams,
    /// Subject that receives the response frames.
    pub reply_to: String,
    /// Absolute deadline, Unix milliseconds; the worker drops the request after it.
    pub deadline_unix_ms: u64,
}
wire!(GenerateRequest = 1);

/// Worker → gateway: whether the worker took the request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GenerateAck {
    pub request_id: RequestId,
    pub worker_id: WorkerId,
    /// `None` = accepted; `Some` = refused, with why.
    pub rejected: Option<WireError>,
}
wire!(GenerateAck = 2);

/// A generic error reply to any request/reply call.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ErrorReply {
    pub error: WireError,
}
wire!(ErrorReply = 3);

/// First frame of a response stream: the prompt has been admitted.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FrameStarted {
    pub request_id: RequestId,
    pub seq: FrameSeq,
    pub worker_id: WorkerId,
    pub prompt_tokens: u32,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u32,
}
wire!(FrameStarted = 10);

/// New output tokens (one or more; the worker coalesces what one engine step produced).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FrameTokens {
    pub request_id: RequestId,
    pub seq: FrameSeq,
    pub token_ids: Vec<u32>,
}
wire!(FrameTokens = 11);

/// Last frame of a successful stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FrameFinished {
    pub request_id: RequestId,
    pub seq: FrameSeq,
    pub reason: FinishReason,
    pub completion_tokens: u32,
}
wire!(FrameFinished = 12);

/// Last frame of a failed stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FrameError {
    pub request_id: RequestId,
    pub seq: FrameSeq,
    pub error: WireError,
}
wire!(FrameError = 13);

/// Worker → gateway, while a stream is open but has sent nothing for a
/// heartbeat period (queued, or in a long prefill): the worker is alive.
/// Carries no `seq`; it never reorders or replaces a frame.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FrameHeartbeat {
    pub request_id: RequestId,
    pub worker_id: WorkerId,
}
wire!(FrameHeartbeat = 14);

/// Gateway → worker (`Subjects::worker_cancel`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CancelRequest {
    pub request_id: RequestId,
    pub reason: CancelReason,
}
wire!(CancelRequest = 20);

/// A content-addressed blob a worker serves over request/reply (e.g. the tokenizer).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ArtifactRef {
    pub name: String,
    pub len: u64,
    /// Lower-case hex SHA-256 of the content.
    pub sha256: String,
}

/// What a gateway needs to serve a model; registered by every worker.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelCard {
    pub name: ModelName,
    /// Maximum prompt + completion tokens.
    pub context_length: u32,
    /// Tokens per KV block (the unit of prefix caching and routing).
    pub block_size: u32,
    /// Jinja chat template (HF conventions).
    pub chat_template: String,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub eos_token_ids: Vec<u32>,
    pub vocab_size: u32,
    /// HF `tokenizer.json` built from the model file, fetched from the worker.
    pub tokenizer: ArtifactRef,
    /// Seed of the block hashes (`blocks::hash_salt`); router and engine must agree.
    pub hash_salt: u64,
    /// Where the weights/metadata came from (file name), for humans.
    pub source: String,
}

impl ModelCard {
    /// A content hash of everything a gateway derives from the card
    /// (tokenizer, chat template, special tokens, limits, block identity):
    /// two cards with the same digest preprocess every request alike.
    pub fn digest(&self) -> u64 {
        let mut bytes = Vec::with_capacity(256 + self.chat_template.len());
        let mut put = |b: &[u8]| {
            bytes.extend_from_slice(&(b.len() as u64).to_le_bytes());
            bytes.extend_from_slice(b);
        };
        put(self.name.0.as_bytes());
        put(&self.context_length.to_le_bytes());
        put(&self.block_size.to_le_bytes());
        put(self.chat_template.as_bytes());
        put(self.bos_token.as_deref().unwrap_or("\u{0}none").as_bytes());
        put(self.eos_token.as_deref().unwrap_or("\u{0}none").as_bytes());
        for id in &self.eos_token_ids {
            put(&id.to_le_bytes());
        }
        put(&self.vocab_size.to_le_bytes());
        put(self.tokenizer.sha256.as_bytes());
        put(&self.tokenizer.len.to_le_bytes());
        put(&self.hash_salt.to_le_bytes());
        xxhash_rust::xxh3::xxh3_64(&bytes)
    }
}

/// Load as a worker reports it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LoadMetrics {
    pub active_seqs: u32,
    pub waiting_seqs: u32,
    pub kv_used_blocks: u32,
    pub kv_total_blocks: u32,
    /// Requests accepted and not yet finished.
    pub inflight_requests: u32,
}

/// Worker → `Subjects::load(worker)`: frequent load updates (pub/sub).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LoadReport {
    pub worker_id: WorkerId,
    pub generation: u64,
    pub load: LoadMetrics,
}
wire!(LoadReport = 21);

/// The value under a worker's key in the workers KV bucket, rewritten every
/// heartbeat. A record whose `heartbeat_unix_ms` is older than the router's
/// TTL is treated as gone.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkerRegistration {
    pub worker_id: WorkerId,
    /// Bumped each time the worker actor (and its engine) restarts.
    pub generation: u64,
    pub node_id: NodeId,
    /// OS process id of the node daemon running this worker.
    pub pid: u32,
    pub role: WorkerRole,
    pub state: WorkerState,
    /// Engine kind, e.g. `mocker`.
    pub engine: String,
    pub model: ModelCard,
    pub started_unix_ms: u64,
    pub heartbeat_unix_ms: u64,
    pub load: LoadMetrics,
    /// Whether the engine publishes KV events (else routers track it approximately).
    pub kv_events: bool,
}
wire!(WorkerRegistration = 30);

/// The value under a node's key in the nodes KV bucket.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeRegistration {
    pub node_id: NodeId,
    pub pid: u32,
    pub hostname: String,
    /// Actor names this node supervises, e.g. `gateway`, `router`, `worker-0`.
    pub actors: Vec<String>,
    /// HTTP address of the node's gateway, if it runs one.
    pub http_addr: Option<String>,
    pub started_unix_ms: u64,
    pub heartbeat_unix_ms: u64,
}
wire!(NodeRegistration = 31);

/// Admin → worker (`Subjects::worker_drain`): stop taking new requests and
/// let in-flight ones finish (`resume` = take requests again). Idempotent:
/// asking again reports progress.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DrainRequest {
    pub resume: bool,
}
wire!(DrainRequest = 32);

/// The worker's answer to a [`DrainRequest`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DrainReply {
    pub worker_id: WorkerId,
    pub state: WorkerState,
    /// Requests still running on the worker.
    pub inflight: u32,
}
wire!(DrainReply = 33);

/// Request for a byte range of an artifact (`Subjects::worker_artifact`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ArtifactRequest {
    pub name: String,
    pub offset: u64,
    pub max_len: u32,
}
wire!(ArtifactRequest = 40);

/// A byte range of an artifact.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ArtifactChunk {
    pub name: String,
    pub total_len: u64,
    pub offset: u64,
    pub data: Vec<u8>,
}
wire!(ArtifactChunk = 41);

/// Admin → node (`Subjects::node_fault`): inject a fault into one of the
/// node's actors. Refused unless the node's config enables fault injection.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FaultInjection {
    pub worker_id: WorkerId,
    pub fault: FaultKind,
}
wire!(FaultInjection = 50);

/// Admin → node (`Subjects::node_fault`): inject a fault into an actor
/// named by its role (`router`, `indexer`, `gateway`, or a worker id in hex), for
/// faults that are not a worker's alone (a background task that ends).
/// Refused unless the node's config enables fault injection.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ActorFault {
    /// `router`, `indexer` (the router's KV index), `gateway`, or a worker
    /// id (hex, as `dynamoctl status` shows it).
    pub actor: String,
    pub fault: FaultKind,
    /// The task [`FaultKind::EndTask`] ends (names are listed in the refusal
    /// when unknown); empty for other faults.
    pub task: String,
}
wire!(ActorFault = 52);

/// Reply to a [`FaultInjection`] or an [`ActorFault`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FaultAck {
    pub applied: bool,
    pub message: String,
}
wire!(FaultAck = 51);

/// Gateway → decode worker (`Subjects::worker_generate`, like a
/// [`GenerateRequest`]): generate, prefilling on `prefill_worker` first when
/// the worker can take the blocks (else it prefills locally).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GenerateDisagg {
    pub request: GenerateRequest,
    pub prefill_worker: WorkerId,
    /// Leading prompt blocks the router says the decode worker already
    /// holds (they are not transferred).
    pub cached_blocks: u32,
}
wire!(GenerateDisagg = 4);

/// Where a request's prompt time went, in milliseconds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PhaseTimings {
    /// Waiting before prefill started (on the prefill worker when remote).
    pub queue_ms: f32,
    /// Computing the prompt's KV.
    pub prefill_ms: f32,
    /// Moving the KV to the decode worker (0 when prefilled locally).
    pub transfer_ms: f32,
    /// From the decode worker receiving the request to its first token.
    pub first_token_ms: f32,
    pub prefill_worker: Option<WorkerId>,
    pub decode_worker: WorkerId,
    /// Why a planned remote prefill was not used (prefilled locally instead).
    pub fallback: Option<String>,
}

/// Worker → gateway, just before the terminal frame of a successful stream:
/// the request's phase breakdown. Carries no `seq` (like a heartbeat).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FrameTimings {
    pub request_id: RequestId,
    pub timings: PhaseTimings,
}
wire!(FrameTimings = 15);

/// Worker → gateway, before the terminal frame: the prompt tokens served
/// from the prefix cache, where the engine reported them only after the
/// stream started (vLLM's last usage chunk); replaces
/// [`FrameStarted::cached_tokens`]. Sent only when it differs from it.
/// Carries no `seq` (like [`FrameTimings`]): a gateway of an older build
/// rejects and counts it, and the stream goes on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FrameUsage {
    pub request_id: RequestId,
    pub cached_tokens: u32,
}
wire!(FrameUsage = 17);

/// Worker → gateway (`reply_to`): frames of several requests bound for one
/// gateway's inbox, in the order the worker made them. Each element is the
/// complete envelope the frame would have been published as alone (a
/// [`FrameStarted`], [`FrameTokens`], …; never another `FrameMux`). Sent
/// only to a gateway that asked for it with [`HEADER_FRAME_MUX`], so a
/// gateway of an older build keeps getting one frame per message; at most
/// [`MAX_MUX_FRAMES`] frames.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FrameMux {
    pub frames: Vec<Vec<u8>>,
}
wire!(FrameMux = 16);

/// Most frames one [`FrameMux`] carries (receivers refuse more).
pub const MAX_MUX_FRAMES: usize = 1024;

/// NATS header on a [`GenerateRequest`] (or [`GenerateDisagg`]): the
/// gateway's inbox accepts [`FrameMux`] messages, so the worker may send
/// this request's frames together with other requests' frames bound for
/// the same inbox. Absent: one frame per message.
pub const HEADER_FRAME_MUX: &str = "Dynamo-Frame-Mux";

/// One registration over consecutive blocks of a decode engine's KV pool,
/// for one request alone (closed once the request no longer waits for it,
/// so a late write is refused instead of landing in reused blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvWindow {
    /// Remote key, base address (0 unless the provider uses virtual
    /// addresses) and length in bytes (whole blocks).
    pub key: u64,
    pub base: u64,
    pub len: u64,
}

/// Where one request's KV blocks are written (one-sided, over libfabric):
/// straight into pool blocks the decode engine reserved for it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvTransferTarget {
    /// libfabric provider of the decode worker's endpoint (e.g. `tcp;ofi_rxm`).
    pub provider: String,
    /// The endpoint's address (`fi_getname`).
    pub address: Vec<u8>,
    /// Bytes per block.
    pub block_bytes: u64,
    /// Windows over the reserved blocks, in prompt order: the blocks to
    /// write fill window 0 first (`len / block_bytes` of them), then
    /// window 1, and so on.
    pub windows: Vec<KvWindow>,
    /// The write into window `i` carries the notice `notify + i` (remote CQ
    /// data): the decode worker's own completion queue tells it the blocks
    /// have landed.
    pub notify: u64,
}

impl KvTransferTarget {
    /// Blocks the windows hold in all.
    pub fn blocks(&self) -> u64 {
        match self.block_bytes {
            0 => 0,
            bb => self.windows.iter().map(|w| w.len / bb).sum(),
        }
    }
}

/// Decode worker → prefill worker (`Subjects::worker_prefill`, request/reply):
/// compute the prompt's KV and write its full blocks after the first
/// `skip_blocks` into `target`, in order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PrefillRequest {
    pub request_id: RequestId,
    /// The decode worker: told on `Subjects::worker_transfer` just before
    /// the writes start ([`TransferStarting`]), so it polls its endpoint
    /// hard only while data moves.
    pub decode_worker: WorkerId,
    pub model: ModelName,
    pub token_ids: Vec<u32>,
    pub skip_blocks: u32,
    pub target: KvTransferTarget,
    /// Absolute deadline, Unix milliseconds (0 = none).
    pub deadline_unix_ms: u64,
}
// Kind 80 was the first `PrefillRequest`, whose target was a slot range of
// a landing region; retired, never reused.
wire!(PrefillRequest = 83);

/// Prefill worker → decode worker: the blocks now in the target's windows
/// (the `i`-th block of the windows, in order, holds `blocks[i]`), or an
/// [`ErrorReply`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PrefillReply {
    pub request_id: RequestId,
    pub worker_id: WorkerId,
    /// Parent of `blocks[0]` (the last skipped block), if any.
    pub parent: Option<crate::blocks::SequenceHash>,
    pub blocks: Vec<crate::blocks::SequenceHash>,
    pub queue_ms: f32,
    pub prefill_ms: f32,
    pub transfer_ms: f32,
}
wire!(PrefillReply = 81);

/// Prefill worker → decode worker (`Subjects::worker_transfer`): the KV
/// writes for `request_id` start now.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TransferStarting {
    pub request_id: RequestId,
}
wire!(TransferStarting = 82);

/// One KV event of one worker: `Event { id, data }`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvEvent {
    /// Per-worker, strictly increasing from 1 within a generation.
    pub event_id: EventId,
    pub kind: KvEventKind,
    pub tier: StorageTier,
    pub parent: Option<crate::blocks::SequenceHash>,
    pub blocks: Vec<crate::blocks::SequenceHash>,
}

/// Worker → `Subjects::kv_events(worker)` (captured by a JetStream stream):
/// the events of one engine step, in order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvEventBatch {
    pub worker_id: WorkerId,
    pub generation: u64,
    pub events: Vec<KvEvent>,
    /// When the worker published the batch (for event-lag reporting).
    pub published_unix_ms: u64,
}
wire!(KvEventBatch = 60);

/// Router → worker (`Subjects::worker_kv_dump`): send your whole block table.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvDumpRequest {
    pub reason: String,
}
wire!(KvDumpRequest = 61);

/// A worker's whole block table, consistent with its events up to `last_event_id`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvDump {
    pub worker_id: WorkerId,
    pub generation: u64,
    pub last_event_id: EventId,
    pub tier: StorageTier,
    pub blocks: Vec<crate::blocks::SequenceHash>,
}
wire!(KvDump = 62);

/// The blocks one storage tier of a worker holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvTierBlocks {
    pub tier: StorageTier,
    pub blocks: Vec<crate::blocks::SequenceHash>,
}

/// A worker's whole block table in every tier (device, host, disk),
/// consistent with its events up to `last_event_id`. Workers answer a
/// [`KvDumpRequest`] with this; routers also accept the device-only [`KvDump`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvDumpTiered {
    pub worker_id: WorkerId,
    pub generation: u64,
    pub last_event_id: EventId,
    pub tiers: Vec<KvTierBlocks>,
}
wire!(KvDumpTiered = 63);

impl From<KvDump> for KvDumpTiered {
    fn from(d: KvDump) -> Self {
        KvDumpTiered {
            worker_id: d.worker_id,
            generation: d.generation,
            last_event_id: d.last_event_id,
            tiers: vec![KvTierBlocks {
                tier: d.tier,
                blocks: d.blocks,
            }],
        }
    }
}

open_enum!(
    /// A change in one router's view of a request's load.
    ActiveLoadKind {
        /// Routed to `worker_id`; `prefill_tokens` still to compute.
        Added = 1,
        /// The first token came back: its prefill is done.
        PrefillDone = 2,
        /// Finished, failed or cancelled.
        Finished = 3,
    }
);

/// Router → `Subjects::router_load`: one request's load, shared by replicas.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ActiveLoadEvent {
    pub router_id: RouterId,
    pub request_id: RequestId,
    pub worker_id: WorkerId,
    pub generation: u64,
    pub kind: ActiveLoadKind,
    pub prefill_tokens: u64,
    /// KV blocks the request occupies (its prompt's).
    pub blocks: u64,
}
wire!(ActiveLoadEvent = 70);

/// Router → `Subjects::router_load`, every second: "my entries are live".
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RouterHeartbeat {
    pub router_id: RouterId,
}
wire!(RouterHeartbeat = 71);

/// A starting router asks a peer (`Subjects::router_snapshot`) for the active load.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ActiveLoadSnapshotRequest {
    pub router_id: RouterId,
}
wire!(ActiveLoadSnapshotRequest = 72);

/// Every request a router knows to be active (its own and its peers'), as `Added` events.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ActiveLoadSnapshot {
    pub entries: Vec<ActiveLoadEvent>,
}
wire!(ActiveLoadSnapshot = 73);

/// `dynamoctl` → any router (`Subjects::router_info`): describe your index.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RouterInfoRequest {}
wire!(RouterInfoRequest = 74);

/// One worker as a router's index sees it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IndexedWorker {
    pub worker_id: WorkerId,
    /// Blocks indexed: device, host, disk.
    pub blocks: [u64; 3],
    /// Publish-to-apply delay of the last KV event batch, ms.
    pub event_lag_ms: u64,
    pub inflight: u32,
    /// Block size / hash salt differ from the model's other workers.
    pub kv_config_mismatch: bool,
}

/// A router's answer to [`RouterInfoRequest`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RouterInfo {
    pub router_id: RouterId,
    pub policy: String,
    pub workers: Vec<IndexedWorker>,
    pub events_applied: u64,
    pub event_gaps: u64,
    pub event_duplicates: u64,
    pub dumps: u64,
}
wire!(RouterInfo = 75);

/// One piece of a reply too large for one bus message (a worker's KV dump,
/// a router's active-load snapshot): the reply's whole envelope, encoded,
/// split into `count` pieces sent in order to the request's reply subject.
/// See [`crate::chunk`] for splitting and reassembly.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChunkedReply {
    /// Names this reply (random per reply), so pieces of two replies never mix.
    pub stream: u64,
    /// 0-based position of this piece.
    pub index: u32,
    /// Pieces in all (at least 2: a reply that fits is sent whole).
    pub count: u32,
    pub data: Vec<u8>,
}
wire!(ChunkedReply = 90);

/// Unix time in milliseconds (0 if the clock is before 1970).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
