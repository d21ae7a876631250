//! Bounds on what waits in an actor's mailbox.
//!
//! ractor mailboxes are unbounded, so every input that feeds one from
//! outside (a bus subscription) passes a [`Gate`]: a message carries a
//! [`Ticket`] from the gate, dropped once the actor has handled it, and at
//! most the gate's size are in the mailbox at once. What the input does
//! when the gate is shut is its own choice, written where it enters:
//! refuse at once ([`Gate::try_enter`], e.g. a new request answered
//! `Overloaded`) or wait ([`Gate::enter`]), which backs up into the bus
//! subscription and, past its capacity, drops messages there (every such
//! input is numbered or repeated, so the loss is seen and repaired).

use std::sync::Arc;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Admits at most `n` messages of one input into a mailbox at once.
#[derive(Clone, Debug)]
pub struct Gate(Arc<Semaphore>);

/// One admitted message's place (freed when dropped).
#[derive(Debug)]
pub struct Ticket(#[allow(dead_code)] OwnedSemaphorePermit);

impl Gate {
    pub fn new(n: usize) -> Self {
        Gate(Arc::new(Semaphore::new(n.max(1))))
    }

    /// Waits for a place.
    pub async fn enter(&self) -> Ticket {
        match self.0.clone().acquire_owned().await {
            Ok(p) => Ticket(p),
            // The semaphore is never closed.
            Err(_) => unreachable!("mailbox gates are never closed"),
        }
    }

    /// A place now, or `None` when the gate is full.
    pub fn try_enter(&self) -> Option<Ticket> {
        self.0.clone().try_acquire_owned().ok().map(Ticket)
    }

    /// Places free now.
    pub fn available(&self) -> usize {
        self.0.available_permits()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_gate_admits_its_size_then_refuses_until_a_ticket_drops() {
        let g = Gate::new(2);
        let a = g.enter().await;
        let _b = g.try_enter().unwrap();
        assert!(g.try_enter().is_none());
        drop(a);
        assert_eq!(g.available(), 1);
        assert!(g.try_enter().is_some());
    }
}
