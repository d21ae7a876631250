//! One engine rank's KV events, from its ZMQ stream to the engine seam's
//! [`KvEventStream`]: decoded, in order, translated into our hashes.
//!
//! A data-parallel rank has its own cache and its own publisher, so it is
//! its own worker to the router: one feed per rank.
//!
//! Invariants: the feed's task is owned by [`KvFeed`] (dropping it stops
//! the task); the event channel is bounded ([`EVENT_QUEUE`]): a consumer
//! that falls behind holds the task back, the engine's publisher then
//! drops what its high-water mark cannot hold, and the gap is replayed;
//! [`KvFeed::snapshot`] is consistent with the events emitted (a later
//! event carries a higher id); a discontinuity in the stream (lost
//! batches, a restarted publisher) clears what was built and emits
//! `Cleared`, so the router never keeps blocks the engine may not hold.

use crate::events::EngineEvent;
use crate::translate::{Counts, Translator};
use crate::zmq_source::{Item, SourceError, SourceStats, ZmqConfig, ZmqSource};
use dynamo_engine::{KvEventStream, KvSnapshot};
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

/// Events queued for the worker at most.
pub const EVENT_QUEUE: usize = 1024;

/// What a feed has seen, for logs and `dynamoctl status`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FeedStats {
    pub source: SourceStats,
    pub skipped: Counts,
    /// Engine blocks tracked now.
    pub tracked: usize,
}

impl FeedStats {
    /// What was dropped since `old`, by reason (counter name, how many
    /// more): skipped events, bad frames, lost batches, socket errors.
    pub fn dropped_since(&self, old: &FeedStats) -> Vec<(&'static str, u64)> {
        let (s, os) = (&self.source, &old.source);
        let source = [
            ("bad_frames", s.bad_frames, os.bad_frames),
            ("lost", s.lost, os.lost),
            ("wrong_rank", s.wrong_rank, os.wrong_rank),
            ("socket_errors", s.socket_errors, os.socket_errors),
        ];
        self.skipped
            .named()
            .into_iter()
            .zip(old.skipped.named())
            .map(|((name, now), (_, then))| (name, now, then))
            .chain(source)
            .filter(|(_, now, then)| now > then)
            .map(|(name, now, then)| (name, now - then))
            .collect()
    }
}

struct Shared {
    translator: Translator,
    source: SourceStats,
}

/// A running feed.
pub struct KvFeed {
    shared: Arc<Mutex<Shared>>,
    /// The feed's one task; dropping the set aborts it.
    task: JoinSet<()>,
}

impl KvFeed {
    /// Connects to the rank's publisher and starts translating for
    /// `model`'s blocks of `block_size` tokens.
    pub async fn start(
        cfg: ZmqConfig,
        model: &str,
        block_size: usize,
    ) -> Result<(Self, KvEventStream), SourceError> {
        let mut source = ZmqSource::connect(cfg).await?;
        let shared = Arc::new(Mutex::new(Shared {
            translator: Translator::new(model, block_size),
            source: SourceStats::default(),
        }));
        let (tx, rx) = mpsc::channel(EVENT_QUEUE);
        let s = shared.clone();
        let mut task = JoinSet::new();
        task.spawn(async move {
            'feed: loop {
                for item in source.next().await {
                    // One item at a time: the lock is held only to translate it.
                    let events = {
                        let Ok(mut g) = s.lock() else {
                            tracing::error!("KV feed state poisoned; the feed stops");
                            break 'feed;
                        };
                        g.source = source.stats.clone();
                        match &item {
                            Item::Batch(_, b) => b
                                .events
                                .iter()
                                .flat_map(|e| g.translator.translate(e))
                                .collect::<Vec<_>>(),
                            Item::Discontinuity { .. } => {
                                g.translator.translate(&EngineEvent::Cleared)
                            }
                        }
                    };
                    for e in events {
                        if tx.send(e).await.is_err() {
                            tracing::debug!("KV feed consumer gone; the feed stops");
                            break 'feed;
                        }
                    }
                }
            }
        });
        Ok((KvFeed { shared, task }, rx))
    }

    /// Resolves when the feed's task has ended (its consumer gone, or a
    /// panic, which is logged): the owner then starts a new feed.
    pub async fn ended(&mut self) {
        if let Some(Err(e)) = self.task.join_next().await {
            tracing::error!(error = %e, "KV feed task failed");
        }
    }

    /// The block table in our hashes.
    pub fn snapshot(&self) -> Option<KvSnapshot> {
        self.shared.lock().ok().map(|g| g.translator.snapshot())
    }

    pub fn stats(&self) -> FeedStats {
        self.shared
            .lock()
            .map(|g| FeedStats {
                source: g.source.clone(),
                skipped: g.translator.skipped.clone(),
                tracked: g.translator.tracked(),
            })
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropped_since_names_what_rose() {
        let old = FeedStats::default();
        let mut now = old.clone();
        assert!(now.dropped_since(&old).is_empty());
        now.skipped.other_group = 3;
        now.source.bad_frames = 1;
        now.source.batches = 9; // not a loss
        assert_eq!(
            now.dropped_since(&old),
            [("other_group", 3), ("bad_frames", 1)]
        );
        assert!(now.dropped_since(&now).is_empty());
    }
}
