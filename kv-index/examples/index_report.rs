//! Prints the KV index figures quoted in BENCHMARKS.md as JSON:
//! `cargo run --release -p dynamo-kv-index --example index_report`.
//!
//! - find_matches latency (p50/p99/max) for 256-block queries against an
//!   index of 1M blocks (4,096 chains × 256) held by 2 of 128 workers each,
//!   one thread, full hits (the worst case: every block is probed);
//! - apply throughput: Stored events of 4 blocks into an empty index, and a
//!   steady state of Stored + Removed at 1M blocks;
//! - heap bytes per indexed block.

use dynamo_bus_schema::blocks::SequenceHash;
use dynamo_kv_index::workload::{build, stored_events, Rng};
use dynamo_kv_index::{IndexEvent, IndexEventData, KvIndex, Tier};
use std::hint::black_box;
use std::time::Instant;

fn pct(v: &mut [u64], p: f64) -> u64 {
    v.sort_unstable();
    v[((v.len() - 1) as f64 * p) as usize]
}

fn main() {
    let t = Instant::now();
    let mut w = build(4096, 256, 128, 2, 7);
    let build_s = t.elapsed().as_secs_f64();
    let blocks = w.index.len();
    let bytes_per_block = w.index.heap_bytes() as f64 / blocks as f64;

    let mut rng = Rng(1);
    let mut lat = Vec::with_capacity(200_000);
    for _ in 0..200_000 {
        let q = &w.chains[(rng.next_u64() % 4096) as usize];
        let t = Instant::now();
        let m = black_box(w.index.find_matches(q));
        lat.push(t.elapsed().as_nanos() as u64);
        assert!(!m.is_empty());
    }
    let (p50, p99, max) = (pct(&mut lat, 0.5), pct(&mut lat, 0.99), pct(&mut lat, 1.0));

    let events = stored_events(1_000_000, 4, 128, 3);
    let mut idx = KvIndex::new();
    let t = Instant::now();
    for e in &events {
        idx.apply(e).expect("apply");
    }
    let fresh_eps = events.len() as f64 / t.elapsed().as_secs_f64();
    drop(idx);

    // Steady state: evict the oldest 4 blocks of a chain, store 4 new ones.
    let mut steady = Vec::with_capacity(1_000_000);
    for i in 0..500_000u64 {
        let c = &w.chains[(i % 4096) as usize];
        let off = ((i / 4096) as usize * 4) % 256;
        let worker = dynamo_bus_schema::WorkerId(i % 128);
        steady.push(IndexEvent {
            worker,
            data: IndexEventData::Removed {
                tier: Tier::Device,
                blocks: c[off..off + 4].to_vec(),
            },
        });
        steady.push(IndexEvent {
            worker,
            data: IndexEventData::Stored {
                tier: Tier::Device,
                parent: None,
                blocks: (0..4).map(|_| SequenceHash(rng.next_u64())).collect(),
            },
        });
    }
    let t = Instant::now();
    for e in &steady {
        w.index.apply(e).expect("apply");
    }
    let steady_eps = steady.len() as f64 / t.elapsed().as_secs_f64();

    println!(
        "{{\"indexed_blocks\":{blocks},\"workers\":128,\"build_s\":{build_s:.2},\"heap_bytes_per_block\":{bytes_per_block:.1},\
\"find_matches_256_p50_ns\":{p50},\"find_matches_256_p99_ns\":{p99},\"find_matches_256_max_ns\":{max},\
\"apply_events_per_s_fresh_4_blocks\":{fresh_eps:.0},\"apply_events_per_s_steady_1m\":{steady_eps:.0}}}"
    );
}
