//! Background tasks with an owner.
//!
//! An actor's tasks (bus subscriptions that feed its mailbox, tickers,
//! servers) are spawned through its [`Tasks`]. Invariants:
//! - every task stops when the `Tasks` is dropped (the actor's state goes
//!   with it, also when the actor panics) or [`Tasks::shutdown`] is called,
//!   a transient one within [`TRANSIENT_GRACE`] and a draining one
//!   ([`Tasks::spawn_draining`], a queue others hand their last words to)
//!   within twice that;
//! - a long-lived task ([`Tasks::spawn`]) that ends or panics while its
//!   owner still runs tells the owner, which fails (its supervisor then
//!   restarts it with fresh inputs): an input never disappears unnoticed;
//! - a short-lived task ([`Tasks::spawn_transient`]) may end whenever it
//!   likes, but its panic fails the owner too; when the set stops, it gets
//!   [`TRANSIENT_GRACE`] to finish (so a request always gets its final
//!   frame, a peer its cancel), then is dropped.

use futures::FutureExt;
use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use tokio_util::sync::CancellationToken;

/// How a task's unexpected end reaches its owner: typically a cast of the
/// owner's "task ended" message, whose handler returns an error.
pub type OnTaskEnd = Arc<dyn Fn(String) + Send + Sync>;

/// The background tasks of one actor.
pub struct Tasks {
    cancel: CancellationToken,
    on_end: OnTaskEnd,
    /// Long-lived tasks by name, each with a token that ends it on purpose
    /// (fault injection: "this input went away").
    named: Mutex<HashMap<&'static str, CancellationToken>>,
}

impl Tasks {
    pub fn new(on_end: OnTaskEnd) -> Self {
        Tasks {
            cancel: CancellationToken::new(),
            on_end,
            named: Mutex::new(HashMap::new()),
        }
    }

    /// A token cancelled when the tasks stop (for a task's own select).
    pub fn token(&self) -> CancellationToken {
        self.cancel.child_token()
    }

    /// Whether [`Self::shutdown`] was called (or the set was dropped).
    pub fn is_shut_down(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// Spawns a task that must run as long as its owner: if it ends (or
    /// panics) before the tasks are shut down, the owner is told.
    pub fn spawn<F>(&self, name: &'static str, fut: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.spawn_long(name, fut, None)
    }

    /// Like [`Self::spawn`], for a task others hand their last words to
    /// (a queue of outgoing frames): when the set stops it is not dropped
    /// at once but gets twice [`TRANSIENT_GRACE`] to end by itself (it
    /// should end when its senders are gone), so what transient tasks queue
    /// until the end of their own grace still goes out. An end before the
    /// set stops fails the owner, as does [`Self::end`] (fault injection).
    pub fn spawn_draining<F>(&self, name: &'static str, fut: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.spawn_long(name, fut, Some(2 * TRANSIENT_GRACE))
    }

    /// A long-lived task: its end or panic fails the owner unless the set
    /// stopped; once it stops, the task is dropped after `grace` (at once
    /// for `None`).
    fn spawn_long<F>(&self, name: &'static str, fut: F, grace: Option<std::time::Duration>)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let exit = self.named_exit(name);
        let (cancel, on_end) = (self.cancel.clone(), self.on_end.clone());
        tokio::spawn(async move {
            let why = tokio::select! {
                r = with_grace(fut, &cancel, grace) => match r {
                    None => return,
                    Some(Ok(())) => "ended".to_string(),
                    Some(Err(p)) => format!("panicked: {}", panic_message(&*p)),
                },
                _ = exit.cancelled() => "was ended (fault injection)".to_string(),
            };
            stopped(name, &why, &cancel, &on_end);
        });
    }

    /// Spawns a task that may end at any time (one request's work); only a
    /// panic is reported to the owner. It stops with the other tasks, after
    /// at most [`TRANSIENT_GRACE`].
    pub fn spawn_transient<F>(&self, name: &'static str, fut: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.spawner().spawn_transient(name, fut)
    }

    /// A handle that spawns transient tasks of this set from inside one of
    /// its tasks (it does not keep the set alive).
    pub fn spawner(&self) -> Spawner {
        Spawner {
            cancel: self.cancel.clone(),
            on_end: self.on_end.clone(),
        }
    }

    /// Names of the long-lived tasks (for fault injection and errors).
    pub fn names(&self) -> Vec<&'static str> {
        let mut v: Vec<_> = self
            .named
            .lock()
            .map(|n| n.keys().copied().collect())
            .unwrap_or_default();
        v.sort();
        v
    }

    /// Ends the named long-lived task as if its input had gone away
    /// (fault injection); false if there is none by that name.
    pub fn end(&self, name: &str) -> bool {
        match self.named.lock().ok().and_then(|n| n.get(name).cloned()) {
            Some(t) => {
                t.cancel();
                true
            }
            None => false,
        }
    }

    /// A fresh token that ends the long-lived task `name` ([`Self::end`]).
    fn named_exit(&self, name: &'static str) -> CancellationToken {
        let exit = CancellationToken::new();
        if let Ok(mut n) = self.named.lock() {
            n.insert(name, exit.clone());
        }
        exit
    }

    /// Stops every task; none reports its end.
    pub fn shutdown(&self) {
        self.cancel.cancel();
    }
}

impl Drop for Tasks {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// How long a transient task may still run once its set stops: one that
/// watches [`Tasks::token`] ends itself in that time with its last word
/// sent (a request's final frame, a cancel to a peer); one that does not
/// is dropped after it.
pub const TRANSIENT_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// Spawns transient tasks into a [`Tasks`] set (see [`Tasks::spawner`]).
#[derive(Clone)]
pub struct Spawner {
    cancel: CancellationToken,
    on_end: OnTaskEnd,
}

impl Spawner {
    /// See [`Tasks::spawn_transient`].
    pub fn spawn_transient<F>(&self, name: &'static str, fut: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let (cancel, on_end) = (self.cancel.clone(), self.on_end.clone());
        tokio::spawn(async move {
            let Some(r) = with_grace(fut, &cancel, Some(TRANSIENT_GRACE)).await else {
                return;
            };
            if let Err(p) = r {
                let why = panic_message(&*p);
                tracing::error!(task = name, %why, "task panicked; failing its actor");
                on_end(format!("task `{name}` panicked: {why}"));
            }
        });
    }
}

/// Runs `fut` to its end (`Some`, with its panic caught) or, once `cancel`
/// fires, for at most `grace` more (none: not at all) so its last word
/// still goes out (a request's final frame, a cancel to a peer), then
/// drops it (`None`).
async fn with_grace<F: Future<Output = ()>>(
    fut: F,
    cancel: &CancellationToken,
    grace: Option<std::time::Duration>,
) -> Option<std::thread::Result<()>> {
    let fut = AssertUnwindSafe(fut).catch_unwind();
    tokio::pin!(fut);
    tokio::select! {
        r = &mut fut => Some(r),
        _ = cancel.cancelled() => {
            if let Some(grace) = grace {
                let _ = tokio::time::timeout(grace, &mut fut).await;
            }
            None
        }
    }
}

/// A long-lived task stopped: its owner fails, unless the set was stopping.
fn stopped(name: &str, why: &str, cancel: &CancellationToken, on_end: &OnTaskEnd) {
    if cancel.is_cancelled() {
        return;
    }
    tracing::error!(task = name, %why, "background task stopped; failing its actor");
    on_end(format!("background task `{name}` {why}"));
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn recorder() -> (OnTaskEnd, tokio::sync::mpsc::Receiver<String>) {
        let (tx, rx) = tokio::sync::mpsc::channel(8);
        (Arc::new(move |why| drop(tx.try_send(why))), rx)
    }

    #[tokio::test(start_paused = true)]
    async fn a_task_that_ends_or_panics_tells_its_owner_but_shutdown_does_not() {
        let (on_end, mut rx) = recorder();
        let t = Tasks::new(on_end);
        t.spawn("returns", async {});
        assert!(rx.recv().await.unwrap().contains("`returns` ended"));
        t.spawn("panics", async { panic!("boom") });
        assert!(rx.recv().await.unwrap().contains("panicked: boom"));
        t.spawn_transient("finishes", async {});
        t.spawn_transient("explodes", async { panic!("bang") });
        assert!(rx
            .recv()
            .await
            .unwrap()
            .contains("`explodes` panicked: bang"));
        t.spawn("forever", std::future::pending());
        assert_eq!(t.names(), vec!["forever", "panics", "returns"]);
        assert!(t.end("forever"));
        assert!(rx.recv().await.unwrap().contains("fault injection"));
        assert!(!t.end("nope"));
        t.spawn("quiet", std::future::pending());
        t.shutdown();
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(rx.try_recv().is_err(), "shutdown is not an unexpected end");
    }

    #[tokio::test(start_paused = true)]
    async fn a_transient_task_sends_its_last_word_after_shutdown_within_the_grace() {
        let (on_end, _rx) = recorder();
        let t = Tasks::new(on_end);
        let (tx, mut last) = tokio::sync::mpsc::channel(4);
        // One that watches the token and answers on the way out.
        let token = t.token();
        let tx1 = tx.clone();
        t.spawn_transient("watcher", async move {
            token.cancelled().await;
            tokio::time::sleep(Duration::from_millis(100)).await;
            let _ = tx1.send("final frame").await;
        });
        // One that never ends: dropped once the grace is over.
        let tx2 = tx.clone();
        t.spawn_transient("stuck", async move {
            let _keep = tx2;
            std::future::pending::<()>().await
        });
        drop(tx);
        tokio::task::yield_now().await;
        t.shutdown();
        assert_eq!(last.recv().await, Some("final frame"));
        let t0 = tokio::time::Instant::now();
        assert_eq!(last.recv().await, None, "the stuck one was dropped");
        assert!(t0.elapsed() <= TRANSIENT_GRACE);
    }

    #[tokio::test(start_paused = true)]
    async fn a_draining_task_forwards_what_arrives_after_shutdown_and_fails_its_owner_if_it_ends_early(
    ) {
        let (on_end, mut rx) = recorder();
        let t = Tasks::new(on_end);
        // A queue drained to `out` until its senders are gone.
        let (q, mut queue) = tokio::sync::mpsc::channel::<&str>(4);
        let (out_tx, mut out) = tokio::sync::mpsc::channel(4);
        t.spawn_draining("queue", async move {
            while let Some(m) = queue.recv().await {
                let _ = out_tx.send(m).await;
            }
        });
        let token = t.token();
        let q1 = q.clone();
        // Its last word comes at the very end of its own grace.
        t.spawn_transient("request", async move {
            token.cancelled().await;
            tokio::time::sleep(TRANSIENT_GRACE - Duration::from_millis(10)).await;
            let _ = q1.send("final frame").await;
        });
        drop(q);
        tokio::task::yield_now().await;
        t.shutdown();
        assert_eq!(out.recv().await, Some("final frame"));
        assert_eq!(out.recv().await, None, "it ended with its senders");
        assert!(rx.try_recv().is_err(), "an end after shutdown is expected");

        // One that ends while its owner runs fails the owner.
        let (on_end, mut rx) = recorder();
        let t = Tasks::new(on_end);
        t.spawn_draining("queue", async {});
        assert!(rx.recv().await.unwrap().contains("`queue` ended"));
        t.spawn_draining("forever", std::future::pending());
        assert!(t.end("forever"));
        assert!(rx.recv().await.unwrap().contains("fault injection"));
    }
}
