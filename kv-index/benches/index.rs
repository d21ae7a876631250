//! Criterion benches of the index hot paths. `make bench` also runs the
//! `index_report` example, which prints the percentile and memory figures
//! BENCHMARKS.md quotes.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use dynamo_kv_index::workload::{build, stored_events, Rng};
use dynamo_kv_index::KvIndex;
use std::hint::black_box;

fn bench(c: &mut Criterion) {
    // 1M blocks: 4,096 chains of 256 blocks, each held by 2 of 1,024 workers.
    let w = build(4096, 256, 1024, 2, 7);
    let mut rng = Rng(9);
    c.bench_function("find_matches/256 blocks, full hit, 1M-block index", |b| {
        b.iter(|| {
            let q = &w.chains[(rng.next_u64() % 4096) as usize];
            black_box(w.index.find_matches(q))
        })
    });
    c.bench_function("find_matches/256 blocks, miss", |b| {
        let miss: Vec<_> = (0..256)
            .map(|_| dynamo_bus_schema::blocks::SequenceHash(rng.next_u64()))
            .collect();
        b.iter(|| black_box(w.index.find_matches(&miss)))
    });
    let events = stored_events(10_000, 4, 1024, 3);
    c.bench_function("apply_batch/10k Stored events of 4 blocks", |b| {
        b.iter_batched(
            KvIndex::new,
            |mut idx| {
                for batch in events.chunks(64) {
                    idx.apply_batch(batch).expect("apply");
                }
                idx
            },
            BatchSize::LargeInput,
        )
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = bench
}
criterion_main!(benches);
