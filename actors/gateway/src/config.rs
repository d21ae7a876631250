//! Gateway settings.

use std::net::SocketAddr;
use std::time::Duration;

#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// Address the HTTP server listens on.
    pub listen: SocketAddr,
    /// Largest accepted request body in bytes (larger → 413).
    pub max_body_bytes: usize,
    /// End-to-end deadline of a request unless it asks for a shorter one.
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
        }
    }
}
