//! The node's own `GET /metrics` (`[metrics] listen`, or `--metrics-listen`
//! with `--join`): every series of the process-wide registry (workers and
//! their engines' load, the controller, the planners) plus the node's:
//! - `dynamo_node_info{node,bus_namespace,version}` (always 1; not
//!   `namespace`, which scrape jobs set to select a deployment);
//! - `dynamo_node_actor_restarts_total{node,child}`;
//! - `dynamo_node_bus_connected{node}` (1 while connected to NATS);
//! - `dynamo_node_bus_rejected_messages_total`.
//!
//! Invariant: the listener serves only `/metrics` (and `/health`), reads
//! nothing from the request but its `Authorization` header (when a token
//! is set), and lives as long as the daemon (its task is owned by
//! [`serve`]'s caller and aborted with it).

use dynamo_runtime::metrics::{counter_vec, gauge_vec, register};
use dynamo_runtime::Bus;
use prometheus::{IntCounterVec, IntGaugeVec};
use std::net::SocketAddr;
use std::sync::OnceLock;

struct M {
    info: IntGaugeVec,
    restarts: IntCounterVec,
    connected: IntGaugeVec,
}

fn m() -> Option<&'static M> {
    static CELL: OnceLock<Option<M>> = OnceLock::new();
    CELL.get_or_init(|| {
        let m = M {
            info: gauge_vec(
                "dynamo_node_info",
                "The node, its bus namespace and version",
                &["node", "bus_namespace", "version"],
            )?,
            restarts: counter_vec(
                "dynamo_node_actor_restarts_total",
                "Actors of this node restarted after failing",
                &["node", "child"],
            )?,
            connected: gauge_vec(
                "dynamo_node_bus_connected",
                "1 while the node is connected to NATS",
                &["node"],
            )?,
        };
        register([
            Box::new(m.info.clone()),
            Box::new(m.restarts.clone()),
            Box::new(m.connected.clone()),
        ])?;
        Some(m)
    })
    .as_ref()
}

/// The node's identity series (call once at start-up).
pub fn started(node: &str, namespace: &str) {
    if let Some(m) = m() {
        m.info
            .with_label_values(&[node, namespace, env!("CARGO_PKG_VERSION")])
            .set(1);
        m.connected.with_label_values(&[node]);
    }
}

/// One of the node's actors started: its restart count exists (at zero
/// the first time).
pub fn child_started(node: &str, child: &str) {
    if let Some(m) = m() {
        m.restarts.with_label_values(&[node, child]);
    }
}

/// One of the node's actors failed and is restarted.
pub fn restarted(node: &str, child: &str) {
    if let Some(m) = m() {
        m.restarts.with_label_values(&[node, child]).inc();
    }
}

/// Sets `dynamo_node_bus_connected` (the node refreshes it every second, so
/// every exposition of the process, a gateway's included, has it current).
pub fn bus_state(node: &str, connected: bool) {
    if let Some(m) = m() {
        m.connected.with_label_values(&[node]).set(connected as i64);
    }
}

/// The whole exposition: the process-wide registry and the bus state as
/// it is now.
pub fn render(node: &str, bus: &Bus) -> String {
    bus_state(node, bus.is_connected());
    let mut text = dynamo_runtime::metrics::render();
    text.push_str(
        "# HELP dynamo_node_bus_rejected_messages_total Bus messages this process rejected\n\
         # TYPE dynamo_node_bus_rejected_messages_total counter\n",
    );
    text.push_str(&format!(
        "dynamo_node_bus_rejected_messages_total {}\n",
        dynamo_runtime::counters::rejected_total()
    ));
    text
}

/// Whether a request carries `Authorization: Bearer <token>` (the scheme
/// in any case). The SHA-256 digests are compared, in time independent of
/// the token and of where they differ, so the comparison leaks neither
/// the token's bytes nor its length.
fn authorized(headers: &axum::http::HeaderMap, token: &str) -> bool {
    use sha2::{Digest, Sha256};
    let Some(got) = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, rest) = v.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then_some(rest)
        })
    else {
        return false;
    };
    let (a, b) = (
        Sha256::digest(got.trim().as_bytes()),
        Sha256::digest(token.as_bytes()),
    );
    a.iter().zip(b.iter()).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// Binds the listener (a taken port is a start-up error) and returns the
/// address it got and the server's future. With a `token`, `/metrics`
/// answers 401 to a request without it (`/health` stays open).
pub async fn serve(
    listen: SocketAddr,
    token: Option<String>,
    node: String,
    bus: Bus,
) -> anyhow::Result<(
    SocketAddr,
    impl std::future::Future<Output = std::io::Result<()>>,
)> {
    use axum::routing::get;
    use std::future::IntoFuture;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| anyhow::anyhow!("metrics.listen {listen}: {e}"))?;
    let addr = listener.local_addr()?;
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move |headers: axum::http::HeaderMap| {
                let allowed = token.as_deref().is_none_or(|t| authorized(&headers, t));
                let text = allowed.then(|| render(&node, &bus));
                async move {
                    use axum::response::IntoResponse;
                    match text {
                        Some(text) => (
                            [(
                                axum::http::header::CONTENT_TYPE,
                                "text/plain; version=0.0.4",
                            )],
                            text,
                        )
                            .into_response(),
                        None => (
                            axum::http::StatusCode::UNAUTHORIZED,
                            [(axum::http::header::WWW_AUTHENTICATE, "Bearer")],
                            "a bearer token is required\n",
                        )
                            .into_response(),
                    }
                }
            }),
        )
        .route("/health", get(|| async { "ok\n" }));
    Ok((addr, axum::serve(listener, app).into_future()))
}
