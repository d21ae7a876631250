//! Gateway settings.

use std::net::SocketAddr;
use std::time::Duration;

#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// Address the HTTP server listens on.
    pub listen: SocketAddr,
    /// Largest accepted request body in bytes (larger → 413).
    pub max_body_bytes: usize,
    /// End-to-end deadline of a request unless it asks for a shorter one
    /// (also the largest `timeout_ms` a request may ask for).
    pub request_timeout: Duration,
    /// A stream with no frame (tokens or worker heartbeat) for this long
    /// has lost its worker: the request migrates or fails.
    pub liveness_timeout: Duration,
    /// How long a worker has to acknowledge a request.
    pub ack_timeout: Duration,
    /// How many other workers are tried when one refuses or is unreachable.
    pub max_route_attempts: u32,
    /// Time given to in-flight requests at shutdown.
    pub shutdown_grace: Duration,
    /// Most times one request may move to another worker after its worker
    /// failed (0 turns migration off).
    pub max_migrations: u32,
    /// Admission control, per model.
    pub admission: AdmissionConfig,
    /// Bodies at least this large are tokenized (chat template and
    /// tokenizer) on the blocking pool instead of the async workers.
    pub blocking_preprocess_bytes: usize,
    /// Threads of that pool (at most this many large bodies at once).
    pub preprocess_threads: usize,
    /// A request for a model no worker serves waits this long (within its
    /// deadline) for one to be ready, as after a scale to zero (0: answer
    /// 503 at once).
    pub hold_for_workers: Duration,
    /// Most requests held that way at once (past it: 503 at once).
    pub max_held: u32,
    /// Models served here even while no worker has registered them yet
    /// (a deployment's, before its first worker or after a scale to zero
    /// of a model this gateway never saw): a request for one is held as
    /// above, not answered 404.
    pub held_models: Vec<String>,
    /// Period of the traffic summaries published for the planner.
    pub metrics_interval: Duration,
    /// API keys (hashed) and their limits; empty = no authentication.
    pub api_keys: Vec<crate::auth::ApiKey>,
    /// A client that does not stream lets workers hold its token frames
    /// this long and send them together (fewer bus messages per request;
    /// a worker lost mid-request costs at most this much regenerated
    /// work). Zero: a frame per engine step for every request.
    pub frame_batch: Duration,
    /// HTTPS with this certificate and key (None: plain HTTP).
    pub tls: Option<crate::tls::TlsSettings>,
    /// Connections open at once; past it new ones wait to be accepted.
    pub max_connections: usize,
    /// A client that leaves the server waiting this long is disconnected:
    /// for a request's head (or the next one on a kept-alive connection),
    /// for the whole body (a 408 first), or to take a write.
    pub client_timeout: Duration,
}

/// Per-model admission control: past `max_inflight` requests being served,
/// up to `max_queued` wait (at most `max_queue_wait` each, FIFO); beyond
/// that a request is refused at once with 429, and one that waited too long
/// with 503, both with `Retry-After`.
#[derive(Clone, Debug, PartialEq)]
pub struct AdmissionConfig {
    /// Requests of one model served at once.
    pub max_inflight: u32,
    /// Requests of one model waiting for a place.
    pub max_queued: u32,
    /// Longest a request waits for a place.
    pub max_queue_wait: Duration,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            max_inflight: 1024,
            max_queued: 256,
            max_queue_wait: Duration::from_millis(500),
        }
    }
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8000)),
            max_body_bytes: 4 * 1024 * 1024,
            request_timeout: Duration::from_secs(600),
            liveness_timeout: Duration::from_millis(800),
            ack_timeout: Duration::from_secs(5),
            max_route_attempts: 3,
            shutdown_grace: Duration::from_secs(30),
            max_migrations: 3,
            admission: AdmissionConfig::default(),
            blocking_preprocess_bytes: 64 * 1024,
            preprocess_threads: 2,
            hold_for_workers: Duration::ZERO,
            max_held: 256,
            held_models: Vec::new(),
            metrics_interval: Duration::from_secs(1),
            api_keys: Vec::new(),
            frame_batch: Duration::from_millis(50),
            tls: None,
            max_connections: 8192,
            client_timeout: Duration::from_secs(30),
        }
    }
}
