//! Publishes an engine's KV events on `kv.<worker>` (captured by the KV
//! events stream), in order, one batch per wake-up (one engine step
//! usually).
//!
//! Invariants: a batch holds at most [`MAX_BATCH_EVENTS`] events and at
//! most [`MAX_BATCH_BYTES`] of encoded blocks (each event names at most
//! `dynamo_batcher::block_pool::MAX_EVENT_BLOCKS`), so it always fits in
//! one bus message; a batch that cannot be published is dropped and the
//! routers see the gap in the event ids and re-sync from a dump.

use dynamo_bus_schema::{
    unix_ms, EventId, KvEvent, KvEventBatch, KvEventKind, StorageTier, WorkerId,
};
use dynamo_engine::{KvCacheEvent, KvEventStream, KvTier};
use dynamo_runtime::Bus;

/// Most events in one batch.
pub const MAX_BATCH_EVENTS: usize = 1024;
/// Most bytes of block hashes in one batch (a hash is at most 10 bytes as
/// a varint; the envelope and the events' other fields add little).
pub const MAX_BATCH_BYTES: usize = 256 * 1024;

/// An upper bound of an event's encoded size.
fn event_bytes(e: &KvEvent) -> usize {
    32 + 10 * e.blocks.len()
}

/// Groups events into batches within both limits, in order.
pub fn batches(events: Vec<KvEvent>) -> Vec<Vec<KvEvent>> {
    let mut out: Vec<Vec<KvEvent>> = Vec::new();
    let mut bytes = 0;
    for e in events {
        let b = event_bytes(&e);
        let full = out
            .last()
            .is_none_or(|last| last.len() >= MAX_BATCH_EVENTS || bytes + b > MAX_BATCH_BYTES);
        if full {
            out.push(Vec::new());
            bytes = 0;
        }
        bytes += b;
        if let Some(last) = out.last_mut() {
            last.push(e);
        }
    }
    out
}

/// Publishes until the engine's stream ends.
pub async fn publish(bus: Bus, worker_id: WorkerId, generation: u64, mut rx: KvEventStream) {
    let subject = bus.subjects.kv_events(worker_id);
    while let Some(first) = rx.recv().await {
        let mut events = vec![to_wire(first)];
        while events.len() < MAX_BATCH_EVENTS * 4 {
            match rx.try_recv() {
                Ok(e) => events.push(to_wire(e)),
                Err(_) => break,
            }
        }
        for events in batches(events) {
            let batch = KvEventBatch {
                worker_id,
                generation,
                events,
                published_unix_ms: unix_ms(),
            };
            if let Err(e) = bus.publish(subject.clone(), &batch).await {
                // Routers detect the gap by event id and ask for a dump.
                tracing::warn!(error = %e, "cannot publish KV events");
            }
        }
    }
}

fn to_wire(e: KvCacheEvent) -> KvEvent {
    use dynamo_engine::KvCacheEventData as D;
    let (kind, parent, blocks) = match e.data {
        D::Stored { parent, blocks } => (KvEventKind::Stored, parent, blocks),
        D::Removed { blocks } => (KvEventKind::Removed, None, blocks),
        D::Cleared => (KvEventKind::Cleared, None, Vec::new()),
    };
    KvEvent {
        event_id: EventId(e.event_id),
        kind,
        tier: wire_tier(e.tier),
        parent,
        blocks,
    }
}

pub fn wire_tier(t: KvTier) -> StorageTier {
    match t {
        KvTier::Device => StorageTier::Device,
        KvTier::Host => StorageTier::Host,
        KvTier::Disk => StorageTier::Disk,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dynamo_bus_schema::blocks::SequenceHash;

    fn ev(id: u64, blocks: usize) -> KvEvent {
        KvEvent {
            event_id: EventId(id),
            kind: KvEventKind::Stored,
            tier: StorageTier::Device,
            parent: None,
            blocks: (0..blocks as u64)
                .map(|b| SequenceHash(u64::MAX - b))
                .collect(),
        }
    }

    #[test]
    fn batches_stay_within_both_limits_in_order_and_fit_a_message() {
        let mut events: Vec<KvEvent> = (1..=3000).map(|i| ev(i, 1)).collect();
        events.extend((3001..=3040).map(|i| ev(i, 4096)));
        let out = batches(events);
        let ids: Vec<u64> = out.iter().flatten().map(|e| e.event_id.0).collect();
        assert_eq!(ids, (1..=3040).collect::<Vec<_>>(), "every event, in order");
        for b in &out {
            assert!(b.len() <= MAX_BATCH_EVENTS);
            let batch = KvEventBatch {
                worker_id: WorkerId(1),
                generation: 1,
                events: b.clone(),
                published_unix_ms: 0,
            };
            let bytes = dynamo_bus_schema::encode(&batch).unwrap();
            assert!(
                bytes.len() <= dynamo_bus_schema::MAX_MESSAGE,
                "{}",
                bytes.len()
            );
        }
        assert!(batches(Vec::new()).is_empty());
    }
}
