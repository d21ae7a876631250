//! HTTPS: a listener that hands axum connections whose TLS handshake is
//! done.
//!
//! Handshakes run off the accept loop, each in a task of the loop's own
//! set and bounded in time ([`HANDSHAKE_TIMEOUT`]) and number
//! ([`MAX_HANDSHAKES`]), so a client that connects and says nothing delays
//! no one. A failed handshake (a client that does not trust the
//! certificate, plain HTTP on the TLS port) is logged at debug and counted;
//! the listener goes on.
//!
//! Invariant: the accept loop is owned by the gateway's task set (it fails
//! the gateway if it ends), and the queue of finished handshakes is bounded.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;

/// Longest a client may take to finish its handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes in progress at once; past it, accepting waits.
pub const MAX_HANDSHAKES: usize = 1024;

/// Handshakes that failed or timed out (exported as
/// `dynamo_gateway_tls_handshake_failures_total`).
pub static HANDSHAKE_FAILURES: AtomicU64 = AtomicU64::new(0);

/// The gateway's TLS settings, loaded and checked at start-up.
#[derive(Clone, Debug)]
pub struct TlsSettings {
    /// The certificate chain file (PEM).
    pub cert: std::path::PathBuf,
    /// The private key file (PEM).
    pub key: std::path::PathBuf,
    /// The server config made from them.
    pub config: Arc<rustls::ServerConfig>,
}

impl TlsSettings {
    /// Reads and checks the files.
    pub fn load(
        cert: &std::path::Path,
        key: &std::path::Path,
    ) -> Result<Self, dynamo_runtime::tls::TlsError> {
        Ok(TlsSettings {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            config: dynamo_runtime::tls::server_config(cert, key)?,
        })
    }
}

/// Connections after their handshake, for `axum::serve`.
pub struct TlsListener {
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
}

impl TlsListener {
    /// The listener, and the accept loop its owner must run (it never
    /// ends: once the server drops the listener it waits to be stopped).
    pub fn new(
        tcp: TcpListener,
        config: Arc<rustls::ServerConfig>,
    ) -> std::io::Result<(Self, impl std::future::Future<Output = ()> + Send)> {
        let local = tcp.local_addr()?;
        // Bounded: finished handshakes wait here for axum's accept; while
        // it is full, handshakes in flight hold their permits and the
        // accept loop waits for one.
        let (tx, rx) = mpsc::channel(MAX_HANDSHAKES);
        let acceptor = tokio_rustls::TlsAcceptor::from(config);
        Ok((
            TlsListener { ready: rx, local },
            accept_loop(tcp, acceptor, tx),
        ))
    }
}

async fn accept_loop(
    tcp: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    tx: mpsc::Sender<(TlsStream<TcpStream>, SocketAddr)>,
) {
    let permits = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
    let mut handshakes = tokio::task::JoinSet::new();
    loop {
        // Reap finished handshakes so the set stays small.
        while handshakes.try_join_next().is_some() {}
        let Ok(permit) = permits.clone().acquire_owned().await else {
            // Never closed: the semaphore lives here.
            std::future::pending::<()>().await;
            continue;
        };
        let (stream, peer) = tokio::select! {
            r = tcp.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // Out of descriptors and the like: pause, as axum does.
                    tracing::warn!(error = %e, "HTTPS accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            // The server dropped the listener (it was stopped on purpose):
            // accept no more, and wait to be stopped with the gateway's
            // tasks rather than end as a failure.
            _ = tx.closed() => std::future::pending().await,
        };
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY");
        }
        let (acceptor, tx) = (acceptor.clone(), tx.clone());
        handshakes.spawn(async move {
            let _permit = permit;
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => {
                    let _ = tx.send((tls, peer)).await;
                }
                Ok(Err(e)) => {
                    HANDSHAKE_FAILURES.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                }
                Err(_) => {
                    HANDSHAKE_FAILURES.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(%peer, "TLS handshake timed out");
                }
            }
        });
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(c) => c,
            // The accept loop is gone: its owner fails the gateway; until
            // then accept nothing.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}
