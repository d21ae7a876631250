//! The progress thread: manual-progress providers (tcp, shm) move data
//! only while someone reads the endpoint's completion queue.
//!
//! Invariants: the thread stops when the [`Progress`] is dropped; it spins
//! only while an [`Expecting`] guard lives, and polls every [`IDLE_POLL`]
//! otherwise; a paused thread does not poll until resumed.

use crate::{Agent, FabricError};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Drives an agent's progress from a thread of its own (a write target on
/// a manual-progress provider needs one) until dropped.
///
/// It spins while someone expects traffic ([`Progress::expect`]: a
/// transfer is under way), and polls every [`IDLE_POLL`] otherwise, which
/// keeps connection set-up moving without burning a core the engine needs.
pub struct Progress {
    agent: std::sync::Arc<std::sync::Mutex<Agent>>,
    shared: std::sync::Arc<ProgressFlags>,
    thread: Option<std::thread::JoinHandle<Option<FabricError>>>,
}

#[derive(Default)]
struct ProgressFlags {
    stop: std::sync::atomic::AtomicBool,
    paused: std::sync::atomic::AtomicBool,
    expecting: std::sync::atomic::AtomicUsize,
}

/// Poll period of an idle progress thread.
pub const IDLE_POLL: Duration = Duration::from_millis(2);

/// While alive, the progress thread spins (see [`Progress::expect`]).
pub struct Expecting(std::sync::Arc<ProgressFlags>);

impl Drop for Expecting {
    fn drop(&mut self) {
        self.0.expecting.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Progress {
    pub fn spawn(agent: Agent) -> std::io::Result<Self> {
        let agent = std::sync::Arc::new(std::sync::Mutex::new(agent));
        let shared = std::sync::Arc::new(ProgressFlags::default());
        let (a, f) = (agent.clone(), shared.clone());
        let thread = std::thread::Builder::new()
            .name("fabric-progress".into())
            .spawn(move || {
                // A broken completion queue is reported at `stop`, but the
                // thread keeps polling: it is the endpoint's only progress.
                let mut first_error = None;
                while !f.stop.load(Ordering::Relaxed) {
                    if !f.paused.load(Ordering::Relaxed) {
                        if let Ok(mut a) = a.lock() {
                            if let Err(e) = a.progress() {
                                if first_error.is_none() {
                                    tracing::error!(error = %e, "KV transfer progress failed");
                                    first_error = Some(e);
                                }
                            }
                        }
                    }
                    if f.expecting.load(Ordering::Relaxed) > 0 {
                        std::thread::yield_now();
                    } else {
                        std::thread::sleep(IDLE_POLL);
                    }
                }
                first_error
            })?;
        Ok(Progress {
            agent,
            shared,
            thread: Some(thread),
        })
    }

    /// The agent (locked while the progress thread is between polls).
    pub fn agent(&self) -> std::sync::MutexGuard<'_, Agent> {
        self.agent.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Spin (poll without pausing) until the returned guard is dropped:
    /// hold it while a peer writes here.
    pub fn expect(&self) -> Expecting {
        self.shared.expecting.fetch_add(1, Ordering::Relaxed);
        Expecting(self.shared.clone())
    }

    /// Takes a notice read by the progress thread (see [`Agent::take_notice`]).
    pub fn take_notice(&self, data: u64) -> bool {
        self.agent().take_notice(data)
    }

    /// Stops polling (fault injection: a peer that never polls).
    pub fn pause(&self) {
        self.shared.paused.store(true, Ordering::Relaxed);
    }

    /// Polls again after [`Self::pause`].
    pub fn resume(&self) {
        self.shared.paused.store(false, Ordering::Relaxed);
    }

    /// Stops the thread; returns the first progress error, if any.
    pub fn stop(mut self) -> Result<(), FabricError> {
        self.halt()
    }

    fn halt(&mut self) -> Result<(), FabricError> {
        self.shared.stop.store(true, Ordering::Relaxed);
        match self.thread.take().map(|t| t.join()) {
            Some(Ok(None)) | None => Ok(()),
            Some(Ok(Some(e))) => Err(e),
            Some(Err(_)) => Err(FabricError::Completion("progress thread panicked".into())),
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        let _ = self.halt();
    }
}
