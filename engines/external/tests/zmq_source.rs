//! The ZMQ source against a real libzmq publisher (pyzmq), framed as vLLM
//! frames its KV events: live batches in order, a gap filled from the
//! replay endpoint, bad frames counted and skipped, and the batches'
//! blocks translated into the gateway's block hashes.

use dynamo_bus_schema::blocks::{hash_salt, sequence_hashes};
use dynamo_engine::KvCacheEventData;
use dynamo_external_engine::kv_feed::KvFeed;
use dynamo_external_engine::translate::Translator;
use dynamo_external_engine::zmq_source::Item;
use dynamo_external_engine::zmq_source::{SourceStats, ZmqSource};
mod common;
use common::{config, publisher};
use std::io::Write;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_batches_a_replayed_gap_and_bad_frames_against_libzmq() {
    let (mut child, pub_port, replay_port) = publisher();
    let mut src = ZmqSource::connect(config(pub_port, replay_port))
        .await
        .unwrap();
    let mut got = Vec::new();
    let upto = |got: &Vec<Item>, want: u64| {
        got.iter()
            .any(|i| matches!(i, Item::Batch(s, _) if *s == want))
    };
    tokio::time::timeout(Duration::from_secs(30), async {
        while !upto(&got, 7) {
            got.extend(src.next().await);
        }
    })
    .await
    .expect("batches 0..=7 within 30 s");
    let seqs: Vec<u64> = got
        .iter()
        .map(|i| match i {
            Item::Batch(s, _) => *s,
            other => panic!("{other:?}"),
        })
        .collect();
    // 6 was garbage: skipped, counted; 3 and 4 came from replay.
    assert_eq!(seqs, [0, 1, 2, 3, 4, 5, 7]);
    assert_eq!(
        src.stats,
        SourceStats {
            batches: 5,
            bad_frames: 2,
            gaps: 1,
            replayed: 2,
            ..SourceStats::default()
        }
    );
    // The engine restarts and numbers from 0 again: a discontinuity, then
    // its batches.
    writeln!(child.stdin.as_mut().unwrap(), "restart").unwrap();
    let mut again = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), async {
        while !upto(&again, 1) {
            again.extend(src.next().await);
        }
    })
    .await
    .expect("the restarted publisher's batches within 30 s");
    assert!(
        matches!(again[0], Item::Discontinuity { lost: 0 }),
        "{again:?}"
    );
    assert!(matches!(again[1], Item::Batch(0, _)) && matches!(again[2], Item::Batch(1, _)));
    assert_eq!(src.stats.restarts, 1);
    drop(child.stdin.take());
    let _ = child.wait();
    let got: Vec<(u64, _)> = got
        .into_iter()
        .filter_map(|i| match i {
            Item::Batch(s, b) => Some((s, b)),
            _ => None,
        })
        .collect();
    // Every batch stores the same two blocks of tokens 100..132: in our
    // hashing, the gateway's two block hashes.
    let want = sequence_hashes(&(100..132).collect::<Vec<u32>>(), 16, hash_salt("m", None));
    let mut tr = Translator::new("m", 16);
    for (_, b) in &got {
        let ours: Vec<_> = b.events.iter().flat_map(|e| tr.translate(e)).collect();
        assert_eq!(
            ours[0].data,
            KvCacheEventData::Stored {
                parent: None,
                blocks: want.clone()
            }
        );
        assert_eq!(ours.last().unwrap().data, KvCacheEventData::Cleared);
    }
    assert_eq!(tr.skipped, Default::default());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_feed_streams_translated_events_and_snapshots_the_table() {
    let (mut child, pub_port, replay_port) = publisher();
    let (feed, mut events) = KvFeed::start(config(pub_port, replay_port), "m", 16)
        .await
        .unwrap();
    // Seven batches arrive (live or replayed), each a store, perhaps a
    // removal (one of the device tier), and a clear.
    let mut got = Vec::new();
    let clears = |got: &Vec<dynamo_engine::KvCacheEvent>| {
        got.iter()
            .filter(|e| e.data == KvCacheEventData::Cleared)
            .count()
    };
    tokio::time::timeout(Duration::from_secs(30), async {
        while clears(&got) < 7 {
            got.push(events.recv().await.expect("the feed runs"));
        }
    })
    .await
    .expect("seven batches' events within 30 s");
    drop(child.stdin.take());
    let _ = child.wait();
    let ids: Vec<u64> = got.iter().map(|e| e.event_id).collect();
    assert_eq!(ids, (1..=got.len() as u64).collect::<Vec<_>>());
    for batch in got.split_inclusive(|e| e.data == KvCacheEventData::Cleared) {
        assert!(
            matches!(batch[0].data, KvCacheEventData::Stored { .. }),
            "{batch:?}"
        );
        assert!(batch.len() <= 3);
    }
    let last = got.len() as u64;
    let snap = feed.snapshot().unwrap();
    assert_eq!((snap.last_event_id, snap.blocks.len()), (last, 0));
    let stats = feed.stats();
    assert_eq!((stats.source.gaps, stats.source.bad_frames), (1, 2));
    assert_eq!(stats.tracked, 0);
}
