//! HTTPS: a listener that hands axum connections whose TLS handshake is
//! done.
//!
//! Handshakes run off the accept loop, each in a task of the loop's own
//! set and bounded in time ([`HANDSHAKE_TIMEOUT`]) and number
//! ([`MAX_HANDSHAKES`]), so a client that connects and says nothing delays
//! no one. When that many are pending, a new connection evicts the oldest
//! pending handshake rather than waiting for it: a real client finishes in
//! a few round trips, so clients that connect and stall (slowloris) can
//! hold the pool only by opening connections faster than real clients
//! finish, not by sitting on it for the timeout. A failed, timed-out or
//! evicted handshake (a client that does not trust the certificate, plain
//! HTTP on the TLS port) is logged at debug and counted; the listener goes
//! on.
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
/// Handshakes in progress at once; past it, a new connection evicts the
/// oldest.
pub const MAX_HANDSHAKES: usize = 1024;

/// Handshakes that failed, timed out or were evicted (exported as
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
        Self::with_limit(tcp, config, MAX_HANDSHAKES)
    }

    /// [`TlsListener::new`] with at most `max` handshakes pending.
    fn with_limit(
        tcp: TcpListener,
        config: Arc<rustls::ServerConfig>,
        max: usize,
    ) -> std::io::Result<(Self, impl std::future::Future<Output = ()> + Send)> {
        let local = tcp.local_addr()?;
        // Bounded: finished handshakes wait here for axum's accept; while
        // it is full, finished handshakes wait to be taken (and count as
        // pending, so new connections evict the oldest of those too).
        let (tx, rx) = mpsc::channel(max);
        let acceptor = tokio_rustls::TlsAcceptor::from(config);
        Ok((
            TlsListener { ready: rx, local },
            accept_loop(tcp, acceptor, tx, max),
        ))
    }
}

async fn accept_loop(
    tcp: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    tx: mpsc::Sender<(TlsStream<TcpStream>, SocketAddr)>,
    max: usize,
) {
    let mut handshakes = tokio::task::JoinSet::new();
    // Pending handshakes, oldest first (abort handles of the set's tasks;
    // finished ones are dropped before each eviction check).
    let mut pending: std::collections::VecDeque<tokio::task::AbortHandle> =
        std::collections::VecDeque::new();
    loop {
        // Reap finished handshakes so the set stays small.
        while handshakes.try_join_next().is_some() {}
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
        // A newcomer and every slot pending: the oldest makes room.
        pending.retain(|h| !h.is_finished());
        if pending.len() >= max {
            if let Some(oldest) = pending.pop_front() {
                oldest.abort();
                HANDSHAKE_FAILURES.fetch_add(1, Ordering::Relaxed);
                tracing::debug!("TLS handshake evicted: {max} pending");
            }
        }
        let (acceptor, tx) = (acceptor.clone(), tx.clone());
        let handle = handshakes.spawn(async move {
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
        pending.push_back(handle);
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Clients that connect and never send a byte fill the pending
    /// handshakes; a real client that comes next is still served at once,
    /// well before their timeout, because it evicts the oldest of them.
    #[tokio::test]
    async fn stalled_clients_cannot_hold_the_handshake_pool() {
        let dir = tempfile::tempdir().unwrap();
        let files = dynamo_runtime::tls::Pki::generate("test", &["127.0.0.1"])
            .unwrap()
            .write(dir.path())
            .unwrap();
        let server = dynamo_runtime::tls::server_config(&files.cert, &files.key).unwrap();
        let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = tcp.local_addr().unwrap();
        const MAX: usize = 4;
        let (mut listener, accept) = TlsListener::with_limit(tcp, server, MAX).unwrap();
        let mut tasks = tokio::task::JoinSet::new();
        tasks.spawn(accept);
        // An echo of one 5-byte message per accepted connection.
        tasks.spawn(async move {
            loop {
                let (mut io, _) = axum::serve::Listener::accept(&mut listener).await;
                let mut buf = [0u8; 5];
                if io.read_exact(&mut buf).await.is_ok() {
                    let _ = io.write_all(&buf).await;
                    let _ = io.flush().await;
                }
            }
        });
        let failures = HANDSHAKE_FAILURES.load(Ordering::Relaxed);
        // More stalled clients than the pool holds.
        let mut stalled = Vec::new();
        for _ in 0..MAX * 2 {
            stalled.push(TcpStream::connect(addr).await.unwrap());
        }
        let client = dynamo_runtime::tls::client_config(&files.ca).unwrap();
        let connector = tokio_rustls::TlsConnector::from(client);
        let served = async {
            let tcp = TcpStream::connect(addr).await.unwrap();
            let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
            let mut tls = connector.connect(name, tcp).await.unwrap();
            tls.write_all(b"hello").await.unwrap();
            tls.flush().await.unwrap();
            let mut buf = [0u8; 5];
            tls.read_exact(&mut buf).await.unwrap();
            buf
        };
        let got = tokio::time::timeout(HANDSHAKE_TIMEOUT / 5, served)
            .await
            .expect("served before the stalled clients time out");
        assert_eq!(&got, b"hello");
        assert!(
            HANDSHAKE_FAILURES.load(Ordering::Relaxed) >= failures + MAX as u64,
            "the oldest stalled handshakes were evicted and counted"
        );
        assert!(tasks.try_join_next().is_none(), "the accept loop runs on");
        drop(stalled);
    }
}
