//! A synthetic workload at the scale of the targets, shared by the
//! criterion bench and the `index_report` example: `chains` prefix chains of
//! `len` blocks (all distinct hashes), each stored by `holders` workers out of
//! `workers`.

use crate::{IndexEvent, IndexEventData, KvIndex, Tier};
use dynamo_bus_schema::blocks::SequenceHash;
use dynamo_bus_schema::WorkerId;

/// Deterministic pseudo-random numbers (SplitMix64).
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

pub struct Workload {
    pub chains: Vec<Vec<SequenceHash>>,
    pub index: KvIndex,
}

/// Builds the index with `chains × len` blocks.
pub fn build(chains: usize, len: usize, workers: u64, holders: usize, seed: u64) -> Workload {
    let mut rng = Rng(seed);
    let mut index = KvIndex::new();
    let mut all = Vec::with_capacity(chains);
    for _ in 0..chains {
        let chain: Vec<SequenceHash> = (0..len).map(|_| SequenceHash(rng.next_u64())).collect();
        for _ in 0..holders {
            let w = WorkerId(rng.next_u64() % workers);
            for part in chain.chunks(64) {
                let ev = IndexEvent {
                    worker: w,
                    data: IndexEventData::Stored {
                        tier: Tier::Device,
                        parent: None,
                        blocks: part.to_vec(),
                    },
                };
                index.apply(&ev).expect("≤ 128 workers");
            }
        }
        all.push(chain);
    }
    Workload { chains: all, index }
}

/// `n` events of `blocks_per_event` fresh blocks each (Stored), round-robin over workers.
pub fn stored_events(
    n: usize,
    blocks_per_event: usize,
    workers: u64,
    seed: u64,
) -> Vec<IndexEvent> {
    let mut rng = Rng(seed);
    (0..n)
        .map(|i| IndexEvent {
            worker: WorkerId(i as u64 % workers),
            data: IndexEventData::Stored {
                tier: Tier::Device,
                parent: None,
                blocks: (0..blocks_per_event)
                    .map(|_| SequenceHash(rng.next_u64()))
                    .collect(),
            },
        })
        .collect()
}
