//! A small fork-join pool for the forward pass: [`ThreadPool::run`] calls a
//! job on every thread (the caller is thread 0) and returns when all are
//! done. Helpers spin briefly between jobs (a layer issues several jobs a
//! millisecond apart) and then sleep on a condvar, so an idle engine burns
//! no CPU.
//!
//! Invariants: a job never outlives `run` (the caller waits for every
//! helper, even when a thread panics; the panic is re-raised in the
//! caller); helpers exit when the pool is dropped.

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle helper spins before it sleeps.
const SPIN: Duration = Duration::from_micros(300);

type Job = *const (dyn Fn(usize) + Sync + 'static);

struct Shared {
    epoch: AtomicU64,
    /// Written by the caller before `epoch` moves; read by helpers after.
    job: UnsafeCell<Option<Job>>,
    pending: AtomicUsize,
    sleeping: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    lock: Mutex<()>,
    cv: Condvar,
}

// SAFETY: `job` is only written by the single caller of `run` while no
// helper reads it (all helpers are between jobs), and published by the
// release store of `epoch`.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

pub struct ThreadPool {
    shared: Arc<Shared>,
    handles: Vec<JoinHandle<()>>,
    threads: usize,
    /// `run` takes `&self` but must not be entered twice at once.
    busy: AtomicBool,
}

impl ThreadPool {
    /// A pool of `threads` threads in total (the caller counts as one).
    pub fn new(threads: usize) -> std::io::Result<Self> {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            pending: AtomicUsize::new(0),
            sleeping: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            lock: Mutex::new(()),
            cv: Condvar::new(),
        });
        let mut handles = Vec::new();
        for t in 1..threads {
            let s = shared.clone();
            handles.push(
                std::thread::Builder::new()
                    .name(format!("cpu-engine-{t}"))
                    .spawn(move || helper(&s, t))?,
            );
        }
        Ok(ThreadPool {
            shared,
            handles,
            threads,
            busy: AtomicBool::new(false),
        })
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f(t)` for every thread index `t` in `0..threads()`.
    pub fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        if self.threads == 1 {
            f(0);
            return;
        }
        assert!(
            !self.busy.swap(true, Ordering::Acquire),
            "ThreadPool::run entered twice"
        );
        let s = &*self.shared;
        // SAFETY: the job is only used until every helper has decremented
        // `pending`, and we wait for that below before returning or unwinding.
        let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f) };
        unsafe { *s.job.get() = Some(job) };
        s.pending.store(self.threads - 1, Ordering::Relaxed);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.sleeping.load(Ordering::SeqCst) > 0 {
            drop(s.lock.lock());
            s.cv.notify_all();
        }
        let mine = catch_unwind(AssertUnwindSafe(|| f(0)));
        let mut spins = 0u32;
        while s.pending.load(Ordering::Acquire) != 0 {
            // A helper that is not on a CPU (more threads than cores) gets
            // ours rather than a spinning neighbour.
            spins += 1;
            if spins < 16 * 1024 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        unsafe { *s.job.get() = None };
        self.busy.store(false, Ordering::Release);
        if let Err(p) = mine {
            std::panic::resume_unwind(p);
        }
        if s.panicked.swap(false, Ordering::AcqRel) {
            panic!("a forward-pass helper thread panicked");
        }
    }
}

fn helper(s: &Shared, t: usize) {
    let mut seen = 0u64;
    loop {
        let started = Instant::now();
        let mut spins = 0u32;
        loop {
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
            }
            spins += 1;
            if !spins.is_multiple_of(64) || started.elapsed() < SPIN {
                std::hint::spin_loop();
                continue;
            }
            let mut g = s.lock.lock().unwrap_or_else(|p| p.into_inner());
            s.sleeping.fetch_add(1, Ordering::SeqCst);
            while s.epoch.load(Ordering::SeqCst) == seen && !s.shutdown.load(Ordering::SeqCst) {
                g = s.cv.wait(g).unwrap_or_else(|p| p.into_inner());
            }
            s.sleeping.fetch_sub(1, Ordering::SeqCst);
        }
        // SAFETY: published by the caller before the epoch moved; valid until
        // we decrement `pending`.
        let job = unsafe { (*s.job.get()).expect("job set before epoch") };
        if catch_unwind(AssertUnwindSafe(|| unsafe { (*job)(t) })).is_err() {
            s.panicked.store(true, Ordering::Release);
        }
        s.pending.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        drop(self.shared.lock.lock());
        self.shared.cv.notify_all();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

/// The share `[lo, hi)` of `n` items that thread `t` of `threads` takes.
pub fn split(n: usize, t: usize, threads: usize) -> (usize, usize) {
    let per = n / threads;
    let extra = n % threads;
    let lo = t * per + t.min(extra);
    (lo, lo + per + usize::from(t < extra))
}

/// A raw pointer that threads of one job write through at disjoint indices.
#[derive(Clone, Copy)]
pub struct SharedMut<T>(*mut T);
unsafe impl<T> Send for SharedMut<T> {}
unsafe impl<T> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    pub fn new(s: &mut [T]) -> Self {
        SharedMut(s.as_mut_ptr())
    }
    /// The base pointer (for strided writes).
    pub fn ptr(&self) -> *mut T {
        self.0
    }
    /// # Safety
    /// `range` must be inside the slice this was made from, and no other
    /// thread may touch it during the job.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice(&self, lo: usize, len: usize) -> &mut [T] {
        std::slice::from_raw_parts_mut(self.0.add(lo), len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn every_thread_runs_every_job_and_sleeping_helpers_wake() {
        let pool = ThreadPool::new(3).unwrap();
        let hits = AtomicUsize::new(0);
        for round in 0..200 {
            if round == 100 {
                std::thread::sleep(SPIN * 3); // helpers go to sleep
            }
            pool.run(&|t| {
                hits.fetch_add(1 << (8 * t), Ordering::Relaxed);
            });
        }
        let h = hits.load(Ordering::Relaxed);
        assert_eq!((h & 0xff, (h >> 8) & 0xff, h >> 16), (200, 200, 200));
    }

    #[test]
    fn a_helper_panic_reaches_the_caller_and_the_pool_survives() {
        let pool = ThreadPool::new(2).unwrap();
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(&|t| assert!(t == 0, "boom"));
        }));
        assert!(r.is_err());
        let n = AtomicUsize::new(0);
        pool.run(&|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn split_covers_everything_once() {
        for n in 0..20 {
            for threads in 1..5 {
                let mut next = 0;
                for t in 0..threads {
                    let (lo, hi) = split(n, t, threads);
                    assert_eq!(lo, next);
                    next = hi;
                }
                assert_eq!(next, n);
            }
        }
    }
}
