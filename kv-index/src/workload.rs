//! A synthetic workload at the scale of the targets, shared by the
//! criterion bench and the `index_report` example: `chains` prefix chains of
//! `len` blocks (all distinct hashes), each stored by `holders` workers out of
//! `workers`, in events of 64 blocks that carry their parent, as engines send
//! them.

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
    /// The workers holding each chain.
    pub holders: Vec<Vec<WorkerId>>,
    /// The events that built it, in order.
    pub events: Vec<IndexEvent>,
    pub index: KvIndex,
}

fn stored(w: WorkerId, parent: Option<SequenceHash>, blocks: &[SequenceHash]) -> IndexEvent {
    IndexEvent {
        worker: w,
        data: IndexEventData::Stored {
            tier: Tier::Device,
            parent,
            blocks: blocks.to_vec(),
        },
    }
}

/// Builds the index with `chains × len` blocks.
pub fn build(chains: usize, len: usize, workers: u64, holders: usize, seed: u64) -> Workload {
    let mut rng = Rng(seed);
    let mut index = KvIndex::new();
    let mut all = Vec::with_capacity(chains);
    let mut who = Vec::with_capacity(chains);
    let mut events = Vec::new();
    for _ in 0..chains {
        let chain: Vec<SequenceHash> = (0..len).map(|_| SequenceHash(rng.next_u64())).collect();
        let mut ws = Vec::new();
        for _ in 0..holders {
            let w = WorkerId(rng.next_u64() % workers);
            ws.push(w);
            let mut parent = None;
            for part in chain.chunks(64) {
                let ev = stored(w, parent, part);
                index.apply(&ev).expect("within the worker limit");
                events.push(ev);
                parent = part.last().copied();
            }
        }
        all.push(chain);
        who.push(ws);
    }
    Workload {
        chains: all,
        holders: who,
        events,
        index,
    }
}

/// `n` events of `blocks_per_event` fresh blocks each (Stored), round-robin
/// over workers; each worker grows its own sequence (the parent is its
/// previous event's last block) and starts a new one every 256 blocks.
pub fn stored_events(
    n: usize,
    blocks_per_event: usize,
    workers: u64,
    seed: u64,
) -> Vec<IndexEvent> {
    let mut rng = Rng(seed);
    let mut last: Vec<(Option<SequenceHash>, usize)> = vec![(None, 0); workers as usize];
    (0..n)
        .map(|i| {
            let w = i % workers as usize;
            let blocks: Vec<SequenceHash> = (0..blocks_per_event)
                .map(|_| SequenceHash(rng.next_u64()))
                .collect();
            let (parent, grown) = last[w];
            let ev = stored(WorkerId(w as u64), parent, &blocks);
            last[w] = if grown + blocks_per_event >= 256 {
                (None, 0)
            } else {
                (blocks.last().copied(), grown + blocks_per_event)
            };
            ev
        })
        .collect()
}

/// A steady state over `w`: `pairs` times, a chain's first holder evicts the
/// chain's last 4 blocks (tails go first) and stores 4 new blocks in their
/// place, a new branch from the same parent.
pub fn steady_events(w: &Workload, pairs: usize, seed: u64) -> Vec<IndexEvent> {
    let mut rng = Rng(seed);
    let mut chains = w.chains.clone();
    let mut out = Vec::with_capacity(pairs * 2);
    for i in 0..pairs {
        let c = i % chains.len();
        let h = w.holders[c][0];
        let chain = &mut chains[c];
        let tail: Vec<SequenceHash> = chain.split_off(chain.len() - 4);
        out.push(IndexEvent {
            worker: h,
            data: IndexEventData::Removed {
                tier: Tier::Device,
                blocks: tail.into_iter().rev().collect(),
            },
        });
        let new: Vec<SequenceHash> = (0..4).map(|_| SequenceHash(rng.next_u64())).collect();
        out.push(stored(h, chain.last().copied(), &new));
        chain.extend(new);
    }
    out
}
