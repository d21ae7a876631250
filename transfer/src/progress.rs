//! The progress thread: manual-progress providers (tcp, shm) move data
//! only while someone reads the endpoint's completion queue.
//!
//! Invariants: the thread stops when the [`Progress`] is dropped; it spins
//! while an [`Expecting`] guard lives, and, for a read target
//! ([`Progress::spawn_read_target`]), for [`HOT_FOR`] after a poll that
//! used [`BUSY_CALL`] of its CPU time (a peer's reads of this endpoint's
//! memory move through it); it polls every [`IDLE_POLL`] otherwise; a
//! paused thread does not poll until resumed.

use crate::{Agent, FabricError};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Drives an agent's progress from a thread of its own (a write target on
/// a manual-progress provider needs one) until dropped.
///
/// It spins while someone expects traffic ([`Progress::expect`]: a
/// transfer is under way), a read target also while peers read it, and it
/// polls every [`IDLE_POLL`] otherwise, which keeps connection set-up
/// moving without burning a core the engine needs.
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
    /// Spinning after a poll that did work (see [`HOT_FOR`]).
    hot: std::sync::atomic::AtomicBool,
    /// Times the thread went from idle to spinning after a poll that did
    /// work.
    spells: std::sync::atomic::AtomicU64,
}

/// Poll period of an idle progress thread.
pub const IDLE_POLL: Duration = Duration::from_millis(2);

/// A poll of a read target that took this much of the thread's CPU time
/// moved data. A target of one-sided reads sees no completion for them,
/// but on providers with manual progress (shm's bounce buffers, rxm's
/// rendezvous over tcp) the data moves inside its polls, so a long poll is
/// the sign that a peer is reading. CPU time, not wall time: a poll the
/// scheduler preempted on a busy machine did no work. The bar is well
/// above an idle poll's few microseconds, so the provider's own timers and
/// interrupt time charged to the thread (where the kernel does not account
/// it apart) do not keep it spinning.
pub const BUSY_CALL: Duration = Duration::from_micros(100);

/// How long the thread keeps spinning after a poll that did work: a peer
/// that is reading posts its next reads within this, and each would
/// otherwise wait up to [`IDLE_POLL`] for the target's next poll (a 2 GiB
/// load over shm measured 2.4 s against 1.35 s).
pub const HOT_FOR: Duration = Duration::from_millis(20);

/// While alive, the progress thread spins (see [`Progress::expect`]).
pub struct Expecting(std::sync::Arc<ProgressFlags>);

impl Drop for Expecting {
    fn drop(&mut self) {
        self.0.expecting.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Progress {
    /// A thread that spins only while someone expects traffic (a write
    /// target: its writers say when, see [`Progress::expect`]).
    pub fn spawn(agent: Agent) -> std::io::Result<Self> {
        Self::start(agent, false)
    }

    /// A thread for memory that peers read without saying when (weights
    /// served to loading peers): it also spins for [`HOT_FOR`] after each
    /// poll that did work, so a reader's next window is not held up by
    /// [`IDLE_POLL`].
    pub fn spawn_read_target(agent: Agent) -> std::io::Result<Self> {
        Self::start(agent, true)
    }

    fn start(agent: Agent, follow_reads: bool) -> std::io::Result<Self> {
        let agent = std::sync::Arc::new(std::sync::Mutex::new(agent));
        let shared = std::sync::Arc::new(ProgressFlags::default());
        let (a, f) = (agent.clone(), shared.clone());
        let thread = std::thread::Builder::new()
            .name("fabric-progress".into())
            .spawn(move || {
                // A broken completion queue is reported at `stop`, but the
                // thread keeps polling: it is the endpoint's only progress.
                let mut first_error = None;
                let mut hot_until = std::time::Instant::now();
                let mut was_hot = false;
                while !f.stop.load(Ordering::Relaxed) {
                    if !f.paused.load(Ordering::Relaxed) {
                        if let Ok(mut a) = a.lock() {
                            let t = if follow_reads {
                                thread_cpu()
                            } else {
                                Duration::ZERO
                            };
                            match a.progress() {
                                Ok(_) => {
                                    if follow_reads && thread_cpu().saturating_sub(t) >= BUSY_CALL {
                                        hot_until = std::time::Instant::now() + HOT_FOR;
                                    }
                                }
                                Err(e) => {
                                    if first_error.is_none() {
                                        tracing::error!(error = %e, "KV transfer progress failed");
                                        first_error = Some(e);
                                    }
                                }
                            }
                        }
                    }
                    let hot = std::time::Instant::now() < hot_until;
                    if hot && !was_hot {
                        f.spells.fetch_add(1, Ordering::Relaxed);
                    }
                    was_hot = hot;
                    f.hot.store(hot, Ordering::Relaxed);
                    if hot || f.expecting.load(Ordering::Relaxed) > 0 {
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

    /// Whether the thread spins because a recent poll did work (not
    /// counting [`Self::expect`]).
    pub fn hot(&self) -> bool {
        self.shared.hot.load(Ordering::Relaxed)
    }

    /// How many times the thread went from idle to spinning because a poll
    /// did work.
    pub fn hot_spells(&self) -> u64 {
        self.shared.spells.load(Ordering::Relaxed)
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

/// CPU time the calling thread has used (zero where the clock is missing,
/// which only leaves the thread cold).
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes one timespec we own.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}
