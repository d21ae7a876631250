//! Unit tests of [`super::KvSync`] (ordering, gaps, repairs, replay, snapshots).
use super::*;
use dynamo_bus_schema::blocks::SequenceHash;
use dynamo_bus_schema::{EventId, KvDump, KvTierBlocks};

#[test]
fn a_tiered_dump_restores_every_tier() {
    let mut s = KvSync::default();
    assert!(s.worker_seen(WorkerId(1), 1));
    let tier = |tier, b: &[u64]| KvTierBlocks {
        tier,
        blocks: b.iter().map(|b| SequenceHash(*b)).collect(),
    };
    s.dump(KvDumpTiered {
        worker_id: WorkerId(1),
        generation: 1,
        last_event_id: EventId(7),
        tiers: vec![
            tier(StorageTier::Device, &[1, 2]),
            tier(StorageTier::Host, &[3]),
            tier(StorageTier::Disk, &[4, 5]),
        ],
    });
    assert_eq!(s.index.blocks_of(WorkerId(1)), [2, 1, 2]);
    // A later device-only dump replaces all tiers.
    s.dump(KvDump {
        worker_id: WorkerId(1),
        generation: 2,
        last_event_id: EventId(1),
        tier: StorageTier::Device,
        blocks: vec![SequenceHash(9)],
    });
    assert_eq!(s.index.blocks_of(WorkerId(1)), [1, 0, 0]);
}

fn stored(id: u64, blocks: &[u64]) -> KvEvent {
    KvEvent {
        event_id: EventId(id),
        kind: KvEventKind::Stored,
        tier: StorageTier::Device,
        parent: None,
        blocks: blocks.iter().map(|b| SequenceHash(*b)).collect(),
    }
}

fn batch(gen: u64, events: Vec<KvEvent>) -> KvEventBatch {
    KvEventBatch {
        worker_id: WorkerId(1),
        generation: gen,
        events,
        published_unix_ms: dynamo_bus_schema::unix_ms(),
    }
}

fn held(s: &KvSync, q: &[u64]) -> u32 {
    let q: Vec<SequenceHash> = q.iter().map(|b| SequenceHash(*b)).collect();
    s.index
        .find_matches(&q)
        .first()
        .map(|(_, o)| o.blocks)
        .unwrap_or(0)
}

#[test]
fn first_sight_dumps_then_applies_in_order_and_skips_duplicates() {
    let mut s = KvSync::default();
    assert!(s.worker_seen(WorkerId(1), 5));
    assert_eq!(s.dumps_due(Instant::now()), vec![WorkerId(1)]);
    // Events arriving before the dump are buffered…
    assert!(!s.batch(batch(5, vec![stored(3, &[10]), stored(4, &[11])])));
    // …the dump covers up to event 3.
    s.dump(KvDump {
        worker_id: WorkerId(1),
        generation: 5,
        last_event_id: EventId(3),
        tier: StorageTier::Device,
        blocks: vec![SequenceHash(10)],
    });
    assert_eq!(held(&s, &[10, 11]), 2);
    // A duplicate is ignored, the next one applies.
    assert!(!s.batch(batch(5, vec![stored(4, &[99]), stored(5, &[12])])));
    assert_eq!(s.stats.duplicates, 1);
    assert_eq!(held(&s, &[10, 11, 12]), 3);
    assert_eq!(held(&s, &[99]), 0);
}

#[test]
fn a_gap_triggers_a_dump_and_a_restart_clears() {
    let mut s = KvSync::default();
    s.worker_seen(WorkerId(1), 1);
    dump(&mut s, 0, &[]);
    assert!(!s.batch(batch(1, vec![stored(1, &[1])])));
    assert!(s.batch(batch(1, vec![stored(3, &[3])])), "event 2 was lost");
    assert_eq!(s.stats.gaps, 1);
    // The stream is asked first; it cannot be read: a dump follows.
    assert!(s.dumps_due(Instant::now()).is_empty());
    let fills = s.fills_due(Instant::now());
    assert_eq!(fills.len(), 1);
    assert_eq!((fills[0].worker, fills[0].from), (WorkerId(1), 2));
    s.filled(&fills[0], Err("no stream".into()));
    assert_eq!(s.stats.stream_fill_failures, 1);
    assert_eq!(s.dumps_due(Instant::now()), vec![WorkerId(1)]);
    dump(&mut s, 3, &[1, 2, 3]);
    assert_eq!(held(&s, &[1, 2, 3]), 3);
    // A bogus far-future event: one re-sync, then live again (no dump loop).
    assert!(s.batch(batch(1, vec![stored(1_000_000, &[66])])));
    let fills = s.fills_due(Instant::now());
    s.filled(&fills[0], Ok(vec![]));
    assert_eq!(
        s.dumps_due(Instant::now()),
        vec![WorkerId(1)],
        "the stream cannot fill it"
    );
    dump(&mut s, 3, &[1, 2, 3]);
    assert!(s.dumps_due(Instant::now()).is_empty());
    assert_eq!(held(&s, &[66]), 0);
    assert!(!s.batch(batch(1, vec![stored(4, &[4])])));
    assert_eq!(held(&s, &[1, 2, 3, 4]), 4);
    // The engine restarts: its blocks are gone, events start at 1 again.
    assert!(!s.worker_seen(WorkerId(1), 2));
    assert_eq!(held(&s, &[1]), 0);
    assert!(!s.batch(batch(2, vec![stored(1, &[7])])));
    assert_eq!(held(&s, &[7]), 1);
    // Late events of the old generation are dropped.
    assert!(!s.batch(batch(1, vec![stored(4, &[8])])));
    assert_eq!(held(&s, &[8]), 0);
    s.worker_gone(WorkerId(1));
    assert_eq!(held(&s, &[7]), 0);
}

#[test]
fn a_batch_applies_what_precedes_its_gap_and_keeps_the_rest_for_the_dump() {
    let mut s = synced(&[], 0);
    let applied = s.stats.applied;
    let b = batch(
        1,
        vec![
            stored(1, &[1]),
            stored(2, &[2]),
            stored(4, &[4]),
            stored(5, &[5]),
        ],
    );
    assert!(s.batch(b), "event 3 was lost");
    assert_eq!(s.stats.applied - applied, 2);
    assert_eq!(held(&s, &[1, 2]), 2);
    assert_eq!(held(&s, &[4]), 0, "past the gap: buffered, not applied");
    let fills = s.fills_due(Instant::now());
    s.filled(&fills[0], Err("no stream".into()));
    // The dump covers event 3; the buffered 4 and 5 follow it.
    dump(&mut s, 3, &[1, 2, 3]);
    assert_eq!(held(&s, &[1, 2, 3, 4, 5]), 5);
    assert_eq!(s.stats.applied - applied, 4);
}

#[test]
fn a_live_gap_is_filled_from_the_stream_without_a_dump() {
    let mut s = synced(&[], 0);
    assert!(!s.batch(batch(1, vec![stored(1, &[1])])));
    // Events 2 and 3 are lost on the live feed; 4 and 5 arrive.
    assert!(s.batch(batch(1, vec![stored(4, &[4])])));
    assert!(
        !s.batch(batch(1, vec![stored(5, &[5])])),
        "buffered while the fill runs"
    );
    assert!(
        s.dumps_due(Instant::now()).is_empty(),
        "no dump while the stream is asked"
    );
    let fills = s.fills_due(Instant::now());
    assert_eq!(fills.len(), 1);
    let f = &fills[0];
    assert_eq!((f.worker, f.generation, f.from), (WorkerId(1), 1, 2));
    assert!(f.since_unix_ms <= dynamo_bus_schema::unix_ms() - FILL_MARGIN_MS);
    assert!(s.fills_due(Instant::now()).is_empty(), "asked once");
    // The stream holds the worker's history from before the gap on, in
    // any order and with more than the gap.
    s.filled(
        f,
        Ok(vec![
            stored(3, &[3]),
            stored(1, &[1]),
            stored(2, &[2]),
            stored(4, &[4]),
        ]),
    );
    assert_eq!(s.stats.stream_fills, 1);
    assert_eq!(held(&s, &[1, 2, 3, 4, 5]), 5);
    assert_eq!(s.stats.dumps, 1, "only the first sight's");
    assert_eq!(
        s.stats.duplicates, 0,
        "what both the stream and the buffer hold"
    );
    assert!(s.dumps_due(Instant::now()).is_empty());
    // Live again: the next event applies, a stale answer changes nothing.
    assert!(!s.batch(batch(1, vec![stored(6, &[6])])));
    s.filled(f, Ok(vec![]));
    assert_eq!(held(&s, &[1, 2, 3, 4, 5, 6]), 6);
}

#[test]
fn a_hole_inside_the_buffer_is_filled_from_where_the_first_fill_read() {
    let mut s = synced(&[], 0);
    assert!(!s.batch(batch(1, vec![stored(1, &[1])])));
    // 2 is lost; 3 reveals it. 4 is lost too; 5 arrives while the
    // fill runs, which read the stream before 4 and 5 were in it.
    assert!(s.batch(batch(1, vec![stored(3, &[3])])));
    assert!(!s.batch(batch(1, vec![stored(5, &[5])])));
    let first = s.fills_due(Instant::now()).remove(0);
    s.filled(
        &first,
        Ok(vec![stored(1, &[1]), stored(2, &[2]), stored(3, &[3])]),
    );
    assert_eq!(held(&s, &[1, 2, 3]), 3);
    // The hole at 4 is filled next, reading from the same point.
    let second = s.fills_due(Instant::now());
    assert_eq!(second.len(), 1);
    assert_eq!(second[0].from, 4);
    assert_eq!(second[0].since_unix_ms, first.since_unix_ms);
    s.filled(&second[0], Ok(vec![stored(4, &[4]), stored(5, &[5])]));
    assert_eq!(held(&s, &[1, 2, 3, 4, 5]), 5);
    assert_eq!(s.stats.stream_fills, 2);
    assert!(s.dumps_due(Instant::now()).is_empty());
}

#[test]
fn a_fill_that_leaves_a_hole_or_does_not_answer_gives_way_to_a_dump() {
    // The stream holds event 2 but not 3.
    let mut s = synced(&[], 0);
    assert!(!s.batch(batch(1, vec![stored(1, &[1])])));
    assert!(s.batch(batch(1, vec![stored(4, &[4])])));
    let fills = s.fills_due(Instant::now());
    s.filled(&fills[0], Ok(vec![stored(2, &[2])]));
    assert_eq!(s.stats.stream_fills, 0);
    assert_eq!(s.stats.stream_fill_failures, 1);
    assert_eq!(s.dumps_due(Instant::now()), vec![WorkerId(1)]);
    assert_eq!(held(&s, &[1, 2]), 1, "nothing of a partial fill applied");

    // No answer within FILL_MAX.
    let mut s = synced(&[], 0);
    assert!(s.batch(batch(1, vec![stored(3, &[3])])));
    let t0 = Instant::now();
    assert_eq!(s.fills_due(t0).len(), 1);
    assert!(s.fills_due(t0 + FILL_MAX / 2).is_empty());
    assert!(s.dumps_due(t0 + FILL_MAX / 2).is_empty());
    assert!(s.fills_due(t0 + FILL_MAX).is_empty());
    assert_eq!(s.stats.stream_fill_failures, 1);
    assert_eq!(s.dumps_due(t0 + FILL_MAX), vec![WorkerId(1)]);
}

/// Worker 1's (generation 1) device dump, through event `last`.
fn dump(s: &mut KvSync, last: u64, blocks: &[u64]) {
    s.dump(KvDump {
        worker_id: WorkerId(1),
        generation: 1,
        last_event_id: EventId(last),
        tier: StorageTier::Device,
        blocks: blocks.iter().map(|b| SequenceHash(*b)).collect(),
    });
}

fn synced(blocks: &[u64], last: u64) -> KvSync {
    let mut s = KvSync::default();
    s.worker_seen(WorkerId(1), 1);
    dump(&mut s, last, blocks);
    s
}

#[test]
fn a_snapshot_restores_and_the_stream_continues_it_without_a_dump() {
    let mut a = synced(&[1, 2], 2);
    assert!(!a.batch(batch(1, vec![stored(3, &[3])])));
    // Worker 2 waits for a dump: it is not in the snapshot.
    let mut w2 = batch(1, vec![stored(5, &[50])]);
    w2.worker_id = WorkerId(2);
    assert!(a.batch(w2));
    let snap = a.snapshot(40, RouterId(9));
    assert_eq!(a.since_snapshot(), 0);
    assert_eq!(snap.workers.len(), 1);
    assert_eq!(snap.workers[0].last_event_id, EventId(3));
    assert_eq!(snap.blocks(), 3);

    let mut b = KvSync::default();
    b.begin_replay();
    b.worker_seen(WorkerId(1), 1);
    b.worker_seen(WorkerId(3), 1);
    // Worker 3 (not registered with that generation) is dropped.
    assert_eq!(b.restore(&snap, |w| (w.0 == 1).then_some(1)).unwrap(), 3);
    assert!(
        b.dumps_due(Instant::now()).is_empty(),
        "dumps wait for the replay"
    );
    // The replay repeats event 3 (a duplicate) and brings event 4.
    assert!(!b.batch(batch(1, vec![stored(3, &[3]), stored(4, &[4])])));
    assert_eq!(b.stats.duplicates, 1);
    // Worker 3's whole history is in the stream: live from it.
    let mut w3 = batch(1, vec![stored(1, &[30]), stored(2, &[31])]);
    w3.worker_id = WorkerId(3);
    b.batch(w3);
    b.end_replay();
    assert!(
        b.dumps_due(Instant::now()).is_empty(),
        "no worker needs a dump"
    );
    assert_eq!(held(&b, &[1, 2, 3, 4]), 4);
    assert_eq!(held(&b, &[30, 31]), 2);
    assert_eq!(b.syncing(), 0);
}

#[test]
fn a_truncated_stream_dumps_every_worker() {
    let mut a = synced(&[1, 2], 2);
    let snap = a.snapshot(10, RouterId(1));
    let mut b = KvSync::default();
    b.begin_replay();
    b.worker_seen(WorkerId(1), 1);
    b.restore(&snap, |_| Some(1)).unwrap();
    b.stream_truncated();
    assert!(!b.batch(batch(1, vec![stored(9, &[9])])));
    b.end_replay();
    assert_eq!(b.dumps_due(Instant::now()), vec![WorkerId(1)]);
    assert_eq!(b.stats.stream_truncated, 1);
}
