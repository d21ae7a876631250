//! Serving HTTP connections: the accept loop, with a bound on open
//! connections and a timeout on clients that stall.
//!
//! Invariants:
//! - at most `max_connections` connections are open at once; past it the
//!   loop stops accepting, so new ones wait in the kernel's accept queue
//!   until any open one closes;
//! - a connection waiting for a request's head (a new connection, a
//!   kept-alive one between requests, or a client sending its headers
//!   slowly) for `client_timeout` is closed (hyper's header-read timeout);
//! - a request body from which nothing arrives for `client_timeout` fails
//!   with [`BodyStalled`], which the handlers answer with a 408 OpenAI
//!   error ([`stalled`]);
//! - on shutdown the loop accepts no more, asks every connection to close
//!   after its in-flight request, and returns once all have closed.

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
use tokio::sync::{watch, Semaphore};
use tokio::time::{Instant, Sleep};

/// Limits on the connections of one HTTP server.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ConnLimits {
    /// Connections open at once (past it, new ones wait to be accepted).
    pub max_connections: usize,
    /// Longest a client may leave the server waiting for its request: the
    /// head (also between requests of a kept-alive connection), and each
    /// piece of the body.
    pub client_timeout: Duration,
}

/// Serves `router` on the connections of `listener` until `shutdown`
/// resolves and every connection has closed.
pub async fn serve<L>(
    mut listener: L,
    router: Router,
    limits: ConnLimits,
    shutdown: impl Future<Output = ()>,
) where
    L: Listener,
{
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    // Connections watch `stop` to close gracefully; each holds a clone of
    // `open` and the loop waits for every one to be dropped.
    let (stop_tx, stop_rx) = watch::channel(false);
    let (open_tx, open_rx) = watch::channel(());
    let mut shutdown = pin!(shutdown);
    loop {
        let slot = tokio::select! {
            s = slots.clone().acquire_owned() => match s {
                Ok(s) => s,
                Err(_) => break, // never closed
            },
            _ = &mut shutdown => break,
        };
        let (io, _addr) = tokio::select! {
            a = listener.accept() => a,
            _ = &mut shutdown => break,
        };
        let svc = Svc {
            router: router.clone(),
            timeout: limits.client_timeout,
        };
        let mut stop = stop_rx.clone();
        let open = open_rx.clone();
        // Owned by the loop through `open`: the loop does not return while
        // a connection task lives, and a connection ends when its client
        // goes, its timeout passes, or the server stops.
        tokio::spawn(async move {
            let _slot = slot;
            let _open = open;
            let mut b = hyper::server::conn::http1::Builder::new();
            b.timer(TokioTimer::new())
                .header_read_timeout(limits.client_timeout);
            let mut conn = pin!(b.serve_connection(TokioIo::new(io), svc));
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
    drop(open_rx);
    let _ = stop_tx.send(true);
    open_tx.closed().await;
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
    type Future = <Router as tower_service::Service<hyper::Request<IdleBody<Incoming>>>>::Future;

    fn call(&self, req: hyper::Request<Incoming>) -> Self::Future {
        // A router is always ready (its `poll_ready` does nothing).
        let mut router = self.router.clone();
        tower_service::Service::call(&mut router, req.map(|b| IdleBody::new(b, self.timeout)))
    }
}

/// The body stopped: nothing arrived for this long.
#[derive(Debug, thiserror::Error)]
#[error("nothing of the request body arrived for {} ms", .0.as_millis())]
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

/// A request body that fails with [`BodyStalled`] when nothing of it
/// arrives for its timeout (counted from the request's head, then from
/// each piece).
pub struct IdleBody<B> {
    inner: B,
    timeout: Duration,
    sleep: Pin<Box<Sleep>>,
}

impl<B> IdleBody<B> {
    pub fn new(inner: B, timeout: Duration) -> Self {
        IdleBody {
            inner,
            timeout,
            sleep: Box::pin(tokio::time::sleep(timeout)),
        }
    }
}

impl<B> Body for IdleBody<B>
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
            Poll::Ready(frame) => {
                this.sleep.as_mut().reset(Instant::now() + this.timeout);
                Poll::Ready(frame.map(|f| f.map_err(Into::into)))
            }
            Poll::Pending => match this.sleep.as_mut().poll(cx) {
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

    /// A body that sends one piece, then nothing.
    struct Trickle(Option<Bytes>);
    impl Body for Trickle {
        type Data = Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            match self.0.take() {
                Some(b) => Poll::Ready(Some(Ok(Frame::data(b)))),
                None => Poll::Pending,
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_stops_sending_fails_after_the_timeout_and_not_before() {
        let t = Duration::from_secs(30);
        let mut body = IdleBody::new(Trickle(Some(Bytes::from_static(b"{\"a\""))), t);
        let first = body.frame().await.expect("a frame").expect("data");
        assert_eq!(first.into_data().ok().as_deref(), Some(&b"{\"a\""[..]));
        let t0 = Instant::now();
        let err = body.frame().await.expect("an end").expect_err("stalled");
        assert_eq!(
            t0.elapsed(),
            t,
            "failed after its timeout, counted from the last piece"
        );
        assert_eq!(stalled(err.as_ref()), Some(t));
    }

    #[tokio::test(start_paused = true)]
    async fn a_whole_body_passes_through() {
        let body = IdleBody::new(
            http_body_util::Full::new(Bytes::from_static(b"{}")),
            Duration::from_secs(1),
        );
        let bytes = body.collect().await.expect("read").to_bytes();
        assert_eq!(&bytes[..], b"{}");
    }
}
