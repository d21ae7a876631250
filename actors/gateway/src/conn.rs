//! Serving HTTP connections: the accept loop, with a bound on open
//! connections and a timeout on clients that stall.
//!
//! Invariants:
//! - at most `max_connections` connections are open at once; past it the
//!   loop stops accepting, so new plain-HTTP ones wait in the kernel's
//!   accept queue until any open one closes (HTTPS: see `tls`, whose
//!   handshakes run before a connection takes a place here);
//! - a connection waiting for a request's head (a new connection, a
//!   kept-alive one between requests, or a client sending its headers
//!   slowly) for `client_timeout` is closed (hyper's header-read timeout);
//! - a request body not complete within `client_timeout` of its head
//!   fails with [`BodyStalled`], which the handlers answer with a 408
//!   OpenAI error ([`stalled`]); a trickle cannot stretch it;
//! - a write the client does not take (it stopped reading) for
//!   `client_timeout` closes the connection ([`StallIo`]); waiting for a
//!   response (no write pending) never does;
//! - connections are tasks of the serve future's own [`JoinSet`]: they
//!   end with it. On shutdown the loop accepts no more, asks every
//!   connection to close after its in-flight request, and returns once
//!   all have closed.

use axum::serve::Listener;
use axum::Router;
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::future::Future;
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Sleep;

/// Limits on the connections of one HTTP server.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ConnLimits {
    /// Connections open at once (past it, new ones wait to be accepted).
    pub max_connections: usize,
    /// Longest a client may leave the server waiting: for a request's head
    /// (also between requests of a kept-alive connection), for the whole
    /// body, and to take a write.
    pub client_timeout: Duration,
}

/// Serves `router` on the connections of `listener` until `shutdown`
/// resolves and every connection has closed. Dropping the future ends
/// every connection with it.
pub async fn serve<L>(
    mut listener: L,
    router: Router,
    limits: ConnLimits,
    shutdown: impl Future<Output = ()>,
) where
    L: Listener,
{
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    // Connections watch `stop` to close gracefully.
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut conns = JoinSet::new();
    let mut shutdown = pin!(shutdown);
    'accept: loop {
        // Finished connections are reaped while the loop waits.
        let slot = loop {
            tokio::select! {
                s = slots.clone().acquire_owned() => match s {
                    Ok(s) => break s,
                    Err(_) => break 'accept, // never closed
                },
                Some(_) = conns.join_next() => {}
                _ = &mut shutdown => break 'accept,
            }
        };
        let io = loop {
            tokio::select! {
                (io, _addr) = listener.accept() => break io,
                Some(_) = conns.join_next() => {}
                _ = &mut shutdown => break 'accept,
            }
        };
        let svc = Svc {
            router: router.clone(),
            timeout: limits.client_timeout,
        };
        let mut stop = stop_rx.clone();
        conns.spawn(async move {
            let _slot = slot;
            let mut b = hyper::server::conn::http1::Builder::new();
            b.timer(TokioTimer::new())
                .header_read_timeout(limits.client_timeout);
            let io = TokioIo::new(StallIo::new(io, limits.client_timeout));
            let mut conn = pin!(b.serve_connection(io, svc));
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::trace!(error = %e, "connection ended");
                    }
                    return;
                }
                _ = stop.wait_for(|s| *s) => conn.as_mut().graceful_shutdown(),
            }
            if let Err(e) = conn.await {
                tracing::trace!(error = %e, "connection ended");
            }
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    while conns.join_next().await.is_some() {}
}

/// A connection's socket, closed (an error on the write) when a write
/// waits `timeout` for the client to take it: a client that stopped
/// reading cannot hold its connection. Reads pass through.
pub struct StallIo<T> {
    io: T,
    timeout: Duration,
    /// Armed when a write first waits; disarmed when one goes through.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<T> StallIo<T> {
    pub fn new(io: T, timeout: Duration) -> Self {
        StallIo {
            io,
            timeout,
            stalled: None,
        }
    }

    fn progress<R>(
        &mut self,
        r: Poll<std::io::Result<R>>,
        cx: &mut Context<'_>,
    ) -> Poll<std::io::Result<R>> {
        match r {
            Poll::Ready(r) => {
                self.stalled = None;
                Poll::Ready(r)
            }
            Poll::Pending => {
                let timeout = self.timeout;
                let s = self
                    .stalled
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
                match s.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("the client took no data for {} ms", timeout.as_millis()),
                    ))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for StallIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for StallIo<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        self.progress(r, cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.progress(r, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let r = Pin::new(&mut self.io).poll_flush(cx);
        self.progress(r, cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let r = Pin::new(&mut self.io).poll_shutdown(cx);
        self.progress(r, cx)
    }
}

/// A connection's service: the router, with each body under its timeout.
#[derive(Clone)]
struct Svc {
    router: Router,
    timeout: Duration,
}

impl hyper::service::Service<hyper::Request<Incoming>> for Svc {
    type Response = axum::response::Response;
    type Error = std::convert::Infallible;
    type Future = <Router as tower_service::Service<hyper::Request<TimedBody<Incoming>>>>::Future;

    fn call(&self, req: hyper::Request<Incoming>) -> Self::Future {
        // A router is always ready (its `poll_ready` does nothing).
        let mut router = self.router.clone();
        tower_service::Service::call(&mut router, req.map(|b| TimedBody::new(b, self.timeout)))
    }
}

/// The body did not arrive within this long of the request's head.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within {} ms", .0.as_millis())]
pub struct BodyStalled(pub Duration);

/// The stall in an error's chain, if that is what it was.
pub fn stalled(e: &(dyn std::error::Error + 'static)) -> Option<Duration> {
    let mut cur = Some(e);
    while let Some(e) = cur {
        if let Some(s) = e.downcast_ref::<BodyStalled>() {
            return Some(s.0);
        }
        cur = e.source();
    }
    None
}

/// A request body that fails with [`BodyStalled`] when it is not complete
/// within its timeout of the request's head (however it trickles in).
pub struct TimedBody<B> {
    inner: B,
    timeout: Duration,
    deadline: Pin<Box<Sleep>>,
}

impl<B> TimedBody<B> {
    pub fn new(inner: B, timeout: Duration) -> Self {
        TimedBody {
            inner,
            timeout,
            deadline: Box::pin(tokio::time::sleep(timeout)),
        }
    }
}

impl<B> Body for TimedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<axum::BoxError>,
{
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => Poll::Ready(frame.map(|f| f.map_err(Into::into))),
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(BodyStalled(this.timeout))))),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::time::Instant;

    /// A body that sends a piece every `every`, forever.
    struct Drip {
        every: Duration,
        next: Pin<Box<Sleep>>,
    }
    impl Body for Drip {
        type Data = Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            match self.next.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    let at = Instant::now() + self.every;
                    self.next.as_mut().reset(at);
                    Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b" ")))))
                }
                Poll::Pending => Poll::Pending,
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_trickles_fails_at_its_deadline_however_often_it_sends() {
        let t = Duration::from_secs(30);
        let every = Duration::from_secs(7);
        let drip = Drip {
            every,
            next: Box::pin(tokio::time::sleep(every)),
        };
        let t0 = Instant::now();
        let mut body = TimedBody::new(drip, t);
        let mut pieces = 0;
        let err = loop {
            match body.frame().await.expect("never ends by itself") {
                Ok(_) => pieces += 1,
                Err(e) => break e,
            }
        };
        assert_eq!(pieces, 4, "pieces at 7, 14, 21 and 28 s went through");
        assert_eq!(t0.elapsed(), t, "failed at the deadline, not before");
        assert_eq!(stalled(err.as_ref()), Some(t));
    }

    #[tokio::test(start_paused = true)]
    async fn a_whole_body_passes_through() {
        let body = TimedBody::new(
            http_body_util::Full::new(Bytes::from_static(b"{}")),
            Duration::from_secs(1),
        );
        let bytes = body.collect().await.expect("read").to_bytes();
        assert_eq!(&bytes[..], b"{}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_the_client_does_not_take_fails_after_the_timeout() {
        let t = Duration::from_secs(30);
        let (server, mut client) = tokio::io::duplex(64);
        let mut server = StallIo::new(server, t);
        // A client that reads late, but within the timeout: no error.
        let reader = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(20)).await;
            let mut buf = vec![0u8; 128];
            client.read_exact(&mut buf).await.expect("read");
            client
        });
        server.write_all(&[1u8; 128]).await.expect("taken in time");
        let mut client = reader.await.unwrap();
        // Then it stops reading: the write that waits fails at the timeout.
        let t0 = Instant::now();
        let err = server.write_all(&[2u8; 128]).await.expect_err("stalled");
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        assert_eq!(t0.elapsed(), t);
        let mut got = vec![0u8; 64];
        client.read_exact(&mut got).await.expect("what fit");
    }
}
