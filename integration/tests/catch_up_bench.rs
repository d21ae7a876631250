//! Catch-up time of a new router replica at fleet scale (BENCHMARKS.md):
//! 128 workers and 1M distinct blocks (each held by 2 workers), on a real
//! nats-server with JetStream, through the router's own `KvSync` and
//! `kv_stream` code:
//!
//! - dumps only: the replica asks all 128 workers for their block tables
//!   at once (each answered in pieces by a responder on the bus) and
//!   applies them;
//! - snapshot + replay: it loads the newest index snapshot from the object
//!   store and replays the KV events stream after it (a tail of steady
//!   evict/store events, as arrives between two snapshots);
//! - stream only: no snapshot, the whole stream from its first message.
//!
//! Every way must end with the same index as the replica that watched it
//! all happen. Run: `cargo test --release -p dynamo-integration --test
//! catch_up_bench -- --ignored --nocapture`.

use dynamo_bus_schema::blocks::SequenceHash;
use dynamo_bus_schema::*;
use dynamo_integration::Nats;
use dynamo_kv_index::{workload, IndexEvent, IndexEventData};
use dynamo_router::kv_stream::{self, ReplaySink, Replayed};
use dynamo_router::kv_sync::KvSync;
use dynamo_runtime::Bus;
use std::collections::HashMap;
use std::time::{Duration, Instant};

const WORKERS: u64 = 128;
/// 4096 chains of 256 blocks: 1,048,576 distinct blocks.
const CHAINS: usize = 4096;
const LEN: usize = 256;
/// Evict/store pairs after the snapshot.
const TAIL_PAIRS: usize = 20_000;

/// Turns index events into per-worker batches with consecutive event ids.
fn batches(events: &[IndexEvent], next_id: &mut HashMap<WorkerId, u64>) -> Vec<KvEventBatch> {
    let mut out: Vec<KvEventBatch> = Vec::new();
    for ev in events {
        let id = next_id.entry(ev.worker).or_insert(1);
        let (kind, parent, blocks) = match &ev.data {
            IndexEventData::Stored { parent, blocks, .. } => {
                (KvEventKind::Stored, *parent, blocks.clone())
            }
            IndexEventData::Removed { blocks, .. } => (KvEventKind::Removed, None, blocks.clone()),
            IndexEventData::Cleared => (KvEventKind::Cleared, None, Vec::new()),
        };
        let e = KvEvent {
            event_id: EventId(*id),
            kind,
            tier: StorageTier::Device,
            parent,
            blocks,
        };
        *id += 1;
        match out.last_mut() {
            Some(b) if b.worker_id == ev.worker && b.events.len() < 64 => b.events.push(e),
            _ => out.push(KvEventBatch {
                worker_id: ev.worker,
                generation: 1,
                events: vec![e],
                published_unix_ms: unix_ms(),
            }),
        }
    }
    out
}

/// Publishes into the stream, waiting for every ack (at most 2,000 pending).
async fn publish(bus: &Bus, batches: &[KvEventBatch]) -> u64 {
    let mut pending = Vec::new();
    let mut last = 0;
    for b in batches {
        let ack = bus
            .js
            .publish(
                bus.subjects.kv_events(b.worker_id),
                encode(b).unwrap().into(),
            )
            .await
            .expect("publish");
        pending.push(ack);
        if pending.len() >= 2000 {
            for a in pending.drain(..) {
                last = a.await.expect("stored").sequence;
            }
        }
    }
    for a in pending {
        last = a.await.expect("stored").sequence;
    }
    last
}

/// Replayed batches straight into a `KvSync`.
struct Apply<'a>(&'a mut KvSync);

impl ReplaySink for Apply<'_> {
    async fn take(&mut self, item: Replayed) -> bool {
        match item {
            Replayed::Batch(b) => {
                self.0.batch(b);
            }
            Replayed::Truncated => self.0.stream_truncated(),
        }
        true
    }
}

fn fresh() -> KvSync {
    let mut s = KvSync::default();
    s.begin_replay();
    for w in 0..WORKERS {
        s.worker_seen(WorkerId(w), 1);
    }
    s
}

fn assert_same(a: &KvSync, b: &KvSync, w: &workload::Workload, how: &str) {
    for wk in 0..WORKERS {
        assert_eq!(
            a.index.blocks_of(WorkerId(wk)),
            b.index.blocks_of(WorkerId(wk)),
            "{how}: worker {wk}"
        );
    }
    for c in w.chains.iter().step_by(97) {
        let mut x = a.index.find_matches(c);
        let mut y = b.index.find_matches(c);
        x.sort_by_key(|(w, _)| w.0);
        y.sort_by_key(|(w, _)| w.0);
        assert_eq!(x, y, "{how}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn catch_up_bench() {
    let nats = Nats::start();
    let subjects = Subjects::new(Namespace::new("it").unwrap());
    let bus = Bus::connect(&nats.url, "bench", subjects, &Default::default())
        .await
        .unwrap();
    bus.ensure_kv_events_stream().await.unwrap();
    let w = workload::build(CHAINS, LEN, WORKERS, 2, 7);
    let mut ids = HashMap::new();
    let history = batches(&w.events, &mut ids);
    let tail = batches(&workload::steady_events(&w, TAIL_PAIRS, 9), &mut ids);

    // The replica that watched it all: it takes the snapshot after the history.
    let mut watcher = fresh();
    for b in &history {
        watcher.batch(b.clone());
    }
    watcher.end_replay();
    let snap_seq = publish(&bus, &history).await;
    let snap = watcher.snapshot(snap_seq, RouterId(1));
    let snap_bytes = encode(&snap).unwrap().len();
    assert!(kv_stream::write(&bus, &bus.subjects.router_state_objects(), &snap).await);
    publish(&bus, &tail).await;
    for b in &tail {
        watcher.batch(b.clone());
    }
    assert_eq!(watcher.syncing(), 0);

    // Snapshot + replay.
    let t0 = Instant::now();
    let loaded = kv_stream::load_snapshot(&bus).await.expect("a snapshot");
    let t_load = t0.elapsed();
    let mut s = fresh();
    s.restore(&loaded, |_| Some(1)).unwrap();
    let t_restore = t0.elapsed();
    let n = kv_stream::replay(&bus, loaded.stream_seq, &mut Apply(&mut s))
        .await
        .unwrap();
    s.end_replay();
    let t_snap = t0.elapsed();
    assert_eq!(n as usize, tail.len());
    assert!(s.dumps_due(Instant::now()).is_empty(), "no dump needed");
    assert_same(&watcher, &s, &w, "snapshot + replay");

    // Stream only.
    let t0 = Instant::now();
    let mut s = fresh();
    let n = kv_stream::replay(&bus, 0, &mut Apply(&mut s))
        .await
        .unwrap();
    s.end_replay();
    let t_stream = t0.elapsed();
    assert_eq!(n as usize, history.len() + tail.len());
    assert_same(&watcher, &s, &w, "stream only");

    // Dumps only: every worker answers with its table (as a worker does).
    let mut tables: HashMap<WorkerId, Vec<SequenceHash>> = HashMap::new();
    for r in watcher.index.export_runs(|_| true) {
        for h in &r.holders {
            tables
                .entry(h.worker_id)
                .or_default()
                .extend(r.blocks.iter().copied());
        }
    }
    let cancel = tokio_util::sync::CancellationToken::new();
    // Owned here and watched while the dumps are asked for: a responder
    // that ends early fails the bench at once.
    let mut responders = tokio::task::JoinSet::new();
    for wk in 0..WORKERS {
        let wid = WorkerId(wk);
        let dump = KvDumpTiered {
            worker_id: wid,
            generation: 1,
            last_event_id: EventId(ids[&wid] - 1),
            tiers: vec![KvTierBlocks {
                tier: StorageTier::Device,
                blocks: tables.remove(&wid).unwrap_or_default(),
            }],
        };
        let sub = bus
            .client
            .subscribe(bus.subjects.worker_kv_dump(wid))
            .await
            .unwrap();
        let (b, c) = (bus.clone(), cancel.clone());
        responders.spawn(async move {
            b.serve(sub, c, move |_: KvDumpRequest| {
                let d = dump.clone();
                async move { Ok::<_, WireError>(d) }
            })
            .await
        });
    }
    bus.client.flush().await.unwrap();
    let t0 = Instant::now();
    let mut s = fresh();
    s.end_replay();
    let due = s.dumps_due(Instant::now());
    assert_eq!(due.len(), WORKERS as usize);
    let asked = futures::future::join_all(due.iter().map(|wid| {
        let bus = bus.clone();
        let wid = *wid;
        async move {
            let req = KvDumpRequest {
                reason: "bench".into(),
            };
            let bytes = bus
                .request_large(
                    bus.subjects.worker_kv_dump(wid),
                    &req,
                    Duration::from_secs(60),
                )
                .await
                .expect("a dump");
            decode_assembled::<KvDumpTiered>(&bytes).expect("decodes")
        }
    }));
    let answers = tokio::select! {
        a = asked => a,
        ended = responders.join_next() => panic!("a dump responder ended before it was cancelled: {ended:?}"),
    };
    let dump_bytes: usize = answers.iter().map(|d| encode(d).unwrap().len()).sum();
    for d in answers {
        s.dump(d);
    }
    let t_dumps = t0.elapsed();
    cancel.cancel();
    // Every responder served until cancelled (none died on the way).
    while let Some(r) = responders.join_next().await {
        r.expect("a dump responder panicked");
    }
    assert_same(&watcher, &s, &w, "dumps only");

    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "catch-up of a new router replica: {WORKERS} workers, {} distinct blocks ({} held), \
         snapshot {:.1} MB at seq {snap_seq}, tail {} batches",
        watcher.index.len(),
        (0..WORKERS)
            .map(|k| watcher.index.blocks_of(WorkerId(k)).iter().sum::<u64>())
            .sum::<u64>(),
        snap_bytes as f64 / 1e6,
        tail.len()
    );
    println!("| way | time (ms) |");
    println!("|---|---|");
    println!(
        "| dumps only ({WORKERS} dumps at once, {:.1} MB) | {:.0} |",
        dump_bytes as f64 / 1e6,
        ms(t_dumps)
    );
    println!(
        "| snapshot + replay (load {:.0}, restore {:.0}, replay {:.0}) | {:.0} |",
        ms(t_load),
        ms(t_restore - t_load),
        ms(t_snap - t_restore),
        ms(t_snap)
    );
    println!(
        "| stream only ({} batches) | {:.0} |",
        history.len() + tail.len(),
        ms(t_stream)
    );
}
