//! The ZMQ source against a real libzmq publisher (pyzmq), framed as vLLM
//! frames its KV events: live batches in order, a gap filled from the
//! replay endpoint, bad frames counted and skipped, and the batches'
//! blocks translated into the gateway's block hashes.

use dynamo_bus_schema::blocks::{hash_salt, sequence_hashes};
use dynamo_engine::KvCacheEventData;
use dynamo_external_engine::kv_feed::KvFeed;
use dynamo_external_engine::translate::Translator;
use dynamo_external_engine::zmq_source::{SourceStats, ZmqConfig, ZmqSource};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

/// The publisher script on two free ports, once it is listening.
fn publisher() -> (std::process::Child, u16, u16) {
    let dir = env!("CARGO_MANIFEST_DIR");
    let (pub_port, replay_port) = (free_port(), free_port());
    let mut child = Command::new("python3")
        .arg(format!("{dir}/tests/zmq_publisher.py"))
        .args([&pub_port.to_string(), &replay_port.to_string()])
        .arg(format!("{dir}/tests/fixtures"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3");
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(
        line.trim(),
        "ready",
        "the publisher needs pyzmq (`make deps` installs it)"
    );
    (child, pub_port, replay_port)
}

fn config(pub_port: u16, replay_port: u16) -> ZmqConfig {
    ZmqConfig {
        endpoint: format!("tcp://127.0.0.1:{pub_port}"),
        replay_endpoint: Some(format!("tcp://127.0.0.1:{replay_port}")),
        topic: "kv".into(),
        dp_rank: 0,
        replay_timeout: Duration::from_secs(5),
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_batches_a_replayed_gap_and_bad_frames_against_libzmq() {
    let (mut child, pub_port, replay_port) = publisher();
    let mut src = ZmqSource::connect(config(pub_port, replay_port))
        .await
        .unwrap();
    let mut got = Vec::new();
    let collect = async {
        while got.last().map(|(s, _)| *s) != Some(7) {
            got.extend(src.next().await.unwrap());
        }
    };
    tokio::time::timeout(Duration::from_secs(30), collect)
        .await
        .expect("batches 0..=7 within 30 s");
    drop(child.stdin.take());
    let _ = child.wait();
    let seqs: Vec<u64> = got.iter().map(|(s, _)| *s).collect();
    // 6 was garbage: skipped, counted; 3 and 4 came from replay.
    assert_eq!(seqs, [0, 1, 2, 3, 4, 5, 7]);
    assert_eq!(
        src.stats,
        SourceStats {
            batches: 3,
            bad_frames: 2,
            duplicates: 0,
            gaps: 1,
            replayed: 4,
            lost: 0,
        }
    );
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
    // Seven batches arrive (live or replayed), each a store and a clear
    // (its removal is of a tier the block is not on: nothing of ours).
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), async {
        while got.len() < 14 {
            got.push(events.recv().await.expect("the feed runs"));
        }
    })
    .await
    .expect("14 events within 30 s");
    drop(child.stdin.take());
    let _ = child.wait();
    let ids: Vec<u64> = got.iter().map(|e| e.event_id).collect();
    assert_eq!(ids, (1..=14).collect::<Vec<_>>());
    assert!(got
        .iter()
        .step_by(2)
        .all(|e| matches!(e.data, KvCacheEventData::Stored { .. })));
    let snap = feed.snapshot().unwrap();
    assert_eq!((snap.last_event_id, snap.blocks.len()), (14, 0));
    let stats = feed.stats();
    assert_eq!((stats.source.gaps, stats.source.bad_frames), (1, 2));
    assert_eq!(stats.tracked, 0);
}
