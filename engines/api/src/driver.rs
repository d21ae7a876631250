//! What every engine driver (the task or thread behind an [`crate::Engine`]
//! handle) shares with its handle: liveness, admission slots, and a
//! reservation hand-off that cannot leak.
//!
//! Invariants:
//! - a [`Liveness`] resolves once its driver's [`Alive`] is dropped, which
//!   happens however the driver ends (returns, panics, or its thread dies);
//! - an [`Admission`] hands out at most `capacity` [`Slot`]s; a slot is
//!   given back when dropped, so a request's slot lives exactly as long as
//!   the driver keeps the request (its event sender), panics included;
//! - a [`ReservationReceiver`] dropped before its answer was read gives the
//!   reserved blocks back, whether the answer was already sent or not;
//! - a [`Commands`] queue holds at most `cap` work commands (new requests,
//!   snapshots, block moves): past it the sender is told at once. Control
//!   commands (cancel, release) always go through: each names a request or
//!   a reservation the engine holds, so they are bounded by its admission.

use crate::{EngineError, Reservation, ReservationId};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::sync::{mpsc, oneshot, watch};

/// The handle side of a driver's command queue.
pub struct Commands<C> {
    tx: mpsc::UnboundedSender<Queued<C>>,
    work: Arc<AtomicUsize>,
    cap: usize,
}

/// A command as the driver receives it; dropping it frees its place.
pub struct Queued<C> {
    pub cmd: C,
    _ticket: Option<WorkTicket>,
}

struct WorkTicket(Arc<AtomicUsize>);

impl Drop for WorkTicket {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Why a command could not be queued.
#[derive(Debug, PartialEq, Eq)]
pub enum QueueError {
    /// `cap` work commands are already queued.
    Full,
    /// The driver has stopped.
    Stopped,
}

impl From<QueueError> for EngineError {
    fn from(e: QueueError) -> Self {
        match e {
            QueueError::Full => {
                EngineError::Overloaded("the engine's command queue is full".into())
            }
            QueueError::Stopped => EngineError::Stopped,
        }
    }
}

/// A command queue: the handle and the driver's receiving end.
pub fn commands<C>(cap: usize) -> (Commands<C>, mpsc::UnboundedReceiver<Queued<C>>) {
    // Unbounded by type only: work commands are counted against `cap`,
    // control commands by what the engine holds (see the module doc).
    let (tx, rx) = mpsc::unbounded_channel();
    (
        Commands {
            tx,
            work: Arc::new(AtomicUsize::new(0)),
            cap: cap.max(1),
        },
        rx,
    )
}

impl<C> Clone for Commands<C> {
    fn clone(&self) -> Self {
        Commands {
            tx: self.tx.clone(),
            work: self.work.clone(),
            cap: self.cap,
        }
    }
}

impl<C> Commands<C> {
    /// Queues a work command, unless `cap` are already waiting.
    pub fn work(&self, cmd: C) -> Result<(), QueueError> {
        if self.work.fetch_add(1, Ordering::AcqRel) >= self.cap {
            self.work.fetch_sub(1, Ordering::AcqRel);
            return Err(QueueError::Full);
        }
        let ticket = WorkTicket(self.work.clone());
        self.tx
            .send(Queued {
                cmd,
                _ticket: Some(ticket),
            })
            .map_err(|_| QueueError::Stopped)
    }

    /// Queues a control command (cancel, release): never refused for room.
    pub fn control(&self, cmd: C) -> Result<(), QueueError> {
        self.tx
            .send(Queued { cmd, _ticket: None })
            .map_err(|_| QueueError::Stopped)
    }

    /// Work commands queued now.
    pub fn queued(&self) -> usize {
        self.work.load(Ordering::Relaxed)
    }

    /// Queues a reservation of `n` blocks (a work command built by
    /// `reserve`); the answer, dropped unread, is given back with the
    /// control command `release` builds.
    pub fn reserve(
        &self,
        n: usize,
        reserve: fn(usize, oneshot::Sender<Result<Reservation, EngineError>>) -> C,
        release: fn(ReservationId) -> C,
    ) -> Result<ReservationReceiver, EngineError>
    where
        C: Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        self.work(reserve(n, tx))?;
        let cmds = self.clone();
        Ok(ReservationReceiver::new(
            rx,
            Box::new(move |id| drop(cmds.control(release(id)))),
        ))
    }
}

/// A driver's end of its KV event stream: bounded ([`crate::KV_EVENT_BUFFER`]);
/// when the publisher falls behind, events are dropped and counted (the
/// gap in event ids makes routers re-sync from a dump).
pub struct KvEventSink {
    tx: mpsc::Sender<crate::KvCacheEvent>,
    dropped: u64,
}

/// A KV event stream: the driver's sink and the publisher's receiver.
pub fn kv_events() -> (KvEventSink, crate::KvEventStream) {
    let (tx, rx) = mpsc::channel(crate::KV_EVENT_BUFFER);
    (KvEventSink { tx, dropped: 0 }, rx)
}

impl KvEventSink {
    pub fn send(&mut self, ev: crate::KvCacheEvent) {
        match self.tx.try_send(ev) {
            Ok(()) => {
                if self.dropped > 0 {
                    tracing::warn!(
                        dropped = self.dropped,
                        "KV event publisher caught up; routers re-sync the gap from a dump"
                    );
                    self.dropped = 0;
                }
            }
            // Nobody publishes this engine's events: nothing to tell.
            Err(mpsc::error::TrySendError::Closed(_)) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                if self.dropped == 0 {
                    tracing::warn!("KV event publisher is behind; dropping events");
                }
                self.dropped += 1;
            }
        }
    }

    /// Events dropped since the publisher last kept up.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }
}

/// Held by a driver for as long as it runs.
pub struct Alive(#[allow(dead_code)] watch::Sender<()>);

/// Tells whether a driver still runs.
#[derive(Clone)]
pub struct Liveness(watch::Receiver<()>);

/// A driver's liveness pair.
pub fn liveness() -> (Alive, Liveness) {
    let (tx, rx) = watch::channel(());
    (Alive(tx), Liveness(rx))
}

impl Liveness {
    /// Resolves once the driver has stopped (for whatever reason).
    pub async fn stopped(mut self) {
        while self.0.changed().await.is_ok() {}
    }

    /// Whether the driver has stopped.
    pub fn is_stopped(&self) -> bool {
        self.0.has_changed().is_err()
    }
}

/// Requests an engine holds at once (running and waiting): past it,
/// [`crate::Engine::generate`] answers [`EngineError::Overloaded`] at once.
#[derive(Debug)]
pub struct Admission {
    held: AtomicUsize,
    capacity: usize,
}

/// One admitted request's place in its engine (given back on drop).
#[derive(Debug)]
pub struct Slot(Arc<Admission>);

impl Admission {
    pub fn new(capacity: usize) -> Arc<Self> {
        Arc::new(Admission {
            held: AtomicUsize::new(0),
            capacity: capacity.max(1),
        })
    }

    /// A slot, or `Overloaded` when every slot is taken.
    pub fn try_admit(self: &Arc<Self>) -> Result<Slot, EngineError> {
        let mut cur = self.held.load(Ordering::Relaxed);
        loop {
            if cur >= self.capacity {
                return Err(EngineError::Overloaded(format!(
                    "{} requests running or waiting, the engine's limit",
                    self.capacity
                )));
            }
            match self
                .held
                .compare_exchange_weak(cur, cur + 1, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return Ok(Slot(self.clone())),
                Err(now) => cur = now,
            }
        }
    }

    /// Slots taken now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.held.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Gives reserved blocks back (the engine's `release_blocks`).
pub type Releaser = Box<dyn Fn(ReservationId) + Send + Sync>;

/// The answer to [`crate::Engine::reserve_blocks`]: a future of the
/// reservation. Dropped unread, it gives the blocks back.
pub struct ReservationReceiver {
    rx: Option<oneshot::Receiver<Result<Reservation, EngineError>>>,
    release: Releaser,
}

impl ReservationReceiver {
    pub fn new(rx: oneshot::Receiver<Result<Reservation, EngineError>>, release: Releaser) -> Self {
        ReservationReceiver {
            rx: Some(rx),
            release,
        }
    }
}

impl Future for ReservationReceiver {
    type Output = Result<Result<Reservation, EngineError>, oneshot::error::RecvError>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(rx) = self.rx.as_mut() else {
            return Poll::Pending;
        };
        match Pin::new(rx).poll(cx) {
            Poll::Ready(r) => {
                self.rx = None;
                Poll::Ready(r)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Drop for ReservationReceiver {
    fn drop(&mut self) {
        if let Some(mut rx) = self.rx.take() {
            // After `close`, the driver's send fails (and it gives the
            // blocks back itself); an answer already sent is still here.
            rx.close();
            if let Ok(Ok(r)) = rx.try_recv() {
                (self.release)(r.id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[tokio::test]
    async fn liveness_resolves_when_the_driver_goes_even_by_panic() {
        let (alive, live) = liveness();
        assert!(!live.is_stopped());
        let t = std::thread::spawn(move || {
            let _alive = alive;
            panic!("driver died");
        });
        assert!(t.join().is_err());
        live.clone().stopped().await;
        assert!(live.is_stopped());
    }

    #[test]
    fn work_commands_are_bounded_and_control_commands_are_not() {
        let (q, mut rx) = commands::<u32>(2);
        q.work(1).unwrap();
        q.work(2).unwrap();
        assert_eq!(q.work(3), Err(QueueError::Full));
        q.control(4).unwrap();
        let first = rx.try_recv().unwrap();
        assert_eq!(first.cmd, 1);
        assert_eq!(q.queued(), 2, "its place is freed when the driver drops it");
        drop(first);
        q.work(5).unwrap();
        drop(rx);
        assert_eq!(q.control(6), Err(QueueError::Stopped));
    }

    #[test]
    fn admission_gives_slots_back_on_drop() {
        let a = Admission::new(2);
        let s1 = a.try_admit().unwrap();
        let _s2 = a.try_admit().unwrap();
        assert!(matches!(a.try_admit(), Err(EngineError::Overloaded(_))));
        drop(s1);
        assert_eq!(a.held(), 1);
        assert!(a.try_admit().is_ok());
    }

    #[tokio::test]
    async fn a_reservation_answered_but_never_read_is_given_back() {
        let released = Arc::new(Mutex::new(Vec::new()));
        let r = released.clone();
        let release: Releaser = Box::new(move |id| r.lock().unwrap().push(id));
        let (tx, rx) = oneshot::channel();
        let pending = ReservationReceiver::new(rx, release);
        tx.send(Ok(Reservation {
            id: ReservationId(7),
            blocks: vec![1],
        }))
        .unwrap();
        drop(pending);
        assert_eq!(*released.lock().unwrap(), vec![ReservationId(7)]);
        // Read, it is the reader's to release.
        let r = released.clone();
        let (tx, rx) = oneshot::channel();
        let mut pending =
            ReservationReceiver::new(rx, Box::new(move |id| r.lock().unwrap().push(id)));
        tx.send(Ok(Reservation {
            id: ReservationId(8),
            blocks: vec![],
        }))
        .unwrap();
        assert!((&mut pending).await.unwrap().is_ok());
        drop(pending);
        assert_eq!(released.lock().unwrap().len(), 1);
        // Dropped before the driver answered: its send fails, nothing here.
        let (tx, rx) = oneshot::channel::<Result<Reservation, EngineError>>();
        drop(ReservationReceiver::new(
            rx,
            Box::new(|_| panic!("not ours")),
        ));
        assert!(tx
            .send(Ok(Reservation {
                id: ReservationId(9),
                blocks: vec![]
            }))
            .is_err());
    }
}
