//! Where request bodies are tokenized: small ones inline on the async
//! workers (microseconds), large ones on a bounded blocking pool, so a
//! few multi-megabyte chat histories never stall every other request.
//!
//! Invariants: at most `threads` large bodies are preprocessed at once
//! (more wait for a place, in order); a panic while preprocessing is an
//! internal error for that request, never a crash.

use crate::error::ApiError;
use std::sync::Arc;
use tokio::sync::Semaphore;

pub struct PreprocessPool {
    slots: Arc<Semaphore>,
    /// Bodies at least this large go to the pool.
    threshold: usize,
}

impl PreprocessPool {
    pub fn new(threads: usize, threshold: usize) -> Self {
        PreprocessPool {
            slots: Arc::new(Semaphore::new(threads.max(1))),
            threshold,
        }
    }

    /// Whether a body of `len` bytes is preprocessed on the pool.
    pub fn offloads(&self, len: usize) -> bool {
        len >= self.threshold
    }

    /// Runs `f` (the tokenization of a body of `len` bytes).
    pub async fn run<T: Send + 'static>(
        &self,
        len: usize,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, ApiError> {
        if !self.offloads(len) {
            return std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
                .map_err(|_| ApiError::internal("Preprocessing the request failed."));
        }
        let _slot = self
            .slots
            .acquire()
            .await
            .map_err(|_| ApiError::internal("The preprocessing pool is closed."))?;
        tokio::task::spawn_blocking(f)
            .await
            .map_err(|_| ApiError::internal("Preprocessing the request failed."))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn large_bodies_run_off_the_async_workers_and_panics_are_errors() {
        let p = PreprocessPool::new(1, 100);
        let here = std::thread::current().id();
        assert_eq!(
            p.run(10, move || std::thread::current().id() == here).await,
            Ok(true)
        );
        assert_eq!(
            p.run(100, move || std::thread::current().id() == here)
                .await,
            Ok(false)
        );
        for len in [10, 1000] {
            let e = p.run(len, || -> u32 { panic!("tokenizer exploded") }).await;
            assert_eq!(e.unwrap_err().status.as_u16(), 500, "inline and pooled");
        }
    }
}
