//! Seeded property tests against a naive reference model.

use super::*;
use proptest::prelude::*;
use std::collections::{BTreeMap, HashSet};

/// The obviously-correct model: a set of (worker, tier, block).
#[derive(Default)]
struct Naive {
    held: HashSet<(u64, usize, u64)>,
}

impl Naive {
    fn apply(&mut self, ev: &IndexEvent) {
        let w = ev.worker.0;
        match &ev.data {
            IndexEventData::Stored { tier, blocks, .. } => {
                for b in blocks {
                    self.held.insert((w, *tier as usize, b.0));
                }
            }
            IndexEventData::Removed { tier, blocks } => {
                for b in blocks {
                    self.held.remove(&(w, *tier as usize, b.0));
                }
            }
            IndexEventData::Cleared => self.held.retain(|(x, _, _)| *x != w),
        }
    }
    fn find(&self, q: &[SequenceHash], workers: &[u64]) -> BTreeMap<u64, Overlap> {
        let mut out = BTreeMap::new();
        for &w in workers {
            let mut o = Overlap::default();
            for h in q {
                let tier = (0..3).find(|t| self.held.contains(&(w, *t, h.0)));
                match tier {
                    None => break,
                    Some(0) => o.device += 1,
                    Some(1) => o.host += 1,
                    Some(_) => o.disk += 1,
                }
                o.blocks += 1;
            }
            if o.blocks > 0 {
                out.insert(w, o);
            }
        }
        out
    }
}

fn chain(len: usize, branch: u64) -> Vec<SequenceHash> {
    // Prefix-sharing chains: blocks 0..len of branch b; branch 0 and 1 share their first half.
    (0..len as u64)
        .map(|i| {
            SequenceHash(if i < len as u64 / 2 {
                1000 + i
            } else {
                branch * 100_000 + i
            })
        })
        .collect()
}

fn event() -> impl Strategy<Value = IndexEvent> {
    let tier = prop_oneof![4 => Just(Tier::Device), 1 => Just(Tier::Host), 1 => Just(Tier::Disk)];
    let worker = 0u64..6;
    let blocks = (0u64..4, 0usize..12, 1usize..8)
        .prop_map(|(branch, start, n)| chain(start + n, branch)[start..].to_vec());
    prop_oneof![
        8 => (worker.clone(), tier.clone(), blocks.clone()).prop_map(|(w, tier, blocks)| IndexEvent {
            worker: WorkerId(w), data: IndexEventData::Stored { tier, parent: None, blocks } }),
        4 => (worker.clone(), tier, blocks).prop_map(|(w, tier, blocks)| IndexEvent {
            worker: WorkerId(w), data: IndexEventData::Removed { tier, blocks } }),
        1 => worker.prop_map(|w| IndexEvent { worker: WorkerId(w), data: IndexEventData::Cleared }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, rng_seed: proptest::test_runner::RngSeed::Fixed(3), ..ProptestConfig::default() })]
    #[test]
    fn matches_agree_with_the_naive_model(events in proptest::collection::vec(event(), 1..60),
                                         queries in proptest::collection::vec((0u64..4, 1usize..20), 1..8)) {
        let mut idx = KvIndex::new();
        let mut naive = Naive::default();
        for ev in &events {
            idx.apply(ev).unwrap();
            naive.apply(ev);
            // Every query after every event.
            for (branch, len) in &queries {
                let q = chain(*len, *branch);
                let got: BTreeMap<u64, Overlap> = idx.find_matches(&q).into_iter().map(|(w, o)| (w.0, o)).collect();
                prop_assert_eq!(got, naive.find(&q, &[0, 1, 2, 3, 4, 5]));
            }
            for w in 0..6u64 {
                let mut want = [0u64; 3];
                for (x, t, _) in &naive.held { if *x == w { want[*t] += 1; } }
                prop_assert_eq!(idx.blocks_of(WorkerId(w)), want);
            }
        }
    }
}

#[test]
fn removing_a_worker_frees_its_slot_and_blocks() {
    let mut idx = KvIndex::new();
    for w in 0..MAX_WORKERS as u64 {
        idx.apply(&IndexEvent {
            worker: WorkerId(w),
            data: IndexEventData::Stored {
                tier: Tier::Device,
                parent: None,
                blocks: chain(4, w),
            },
        })
        .unwrap();
    }
    let extra = IndexEvent {
        worker: WorkerId(999),
        data: IndexEventData::Stored {
            tier: Tier::Device,
            parent: None,
            blocks: chain(2, 0),
        },
    };
    assert_eq!(
        idx.apply(&extra),
        Err(IndexError::TooManyWorkers(WorkerId(999)))
    );
    // All 128 share the first half (2 blocks) of every chain.
    assert_eq!(idx.find_matches(&chain(4, 0)).len(), MAX_WORKERS);
    idx.remove_worker(WorkerId(5));
    assert!(idx
        .find_matches(&chain(4, 5))
        .iter()
        .all(|(w, _)| *w != WorkerId(5)));
    assert_eq!(idx.blocks_of(WorkerId(5)), [0, 0, 0]);
    idx.apply(&extra).unwrap();
    assert_eq!(idx.find_matches(&chain(2, 0)).len(), MAX_WORKERS);
}

#[test]
fn an_event_whose_parent_is_unknown_is_counted() {
    let mut idx = KvIndex::new();
    let c = chain(4, 0);
    idx.apply(&IndexEvent {
        worker: WorkerId(1),
        data: IndexEventData::Stored {
            tier: Tier::Device,
            parent: Some(c[1]),
            blocks: c[2..].to_vec(),
        },
    })
    .unwrap();
    assert_eq!(idx.orphans(), 1);
    // A query from the root does not match a worker lacking the first block.
    assert!(idx.find_matches(&c).is_empty());
}
