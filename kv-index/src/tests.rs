//! Seeded property tests of the run index against the flat oracle
//! ([`flat::FlatIndex`]) and a naive set model, with more than 128 workers.

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

/// Workers 0..6 are the ones events are about; 6..6+FILLERS share the first
/// blocks of every branch, so that slots past 128 are in use.
const FILLERS: u64 = 200;
const WATCHED: [u64; 6] = [0, 1, 2, 3, 4, 3 * FILLERS];

fn fillers() -> Vec<IndexEvent> {
    (6..6 + FILLERS)
        .map(|w| IndexEvent {
            worker: WorkerId(w),
            data: IndexEventData::Stored {
                tier: if w % 3 == 0 { Tier::Host } else { Tier::Device },
                parent: None,
                blocks: chain(2 + (w % 3) as usize, w % 4),
            },
        })
        .collect()
}

fn event() -> impl Strategy<Value = IndexEvent> {
    let tier = prop_oneof![4 => Just(Tier::Device), 1 => Just(Tier::Host), 1 => Just(Tier::Disk)];
    let worker = (0usize..6).prop_map(|i| WATCHED[i]);
    // With its parent (the chain's previous block) or without, as engines may send either.
    let blocks = (0u64..4, 0usize..12, 1usize..8, any::<bool>()).prop_map(
        |(branch, start, n, with_parent)| {
            let c = chain(start + n, branch);
            (
                c[start..].to_vec(),
                (with_parent && start > 0).then(|| c[start - 1]),
            )
        },
    );
    prop_oneof![
        8 => (worker.clone(), tier.clone(), blocks.clone()).prop_map(|(w, tier, (blocks, parent))| IndexEvent {
            worker: WorkerId(w), data: IndexEventData::Stored { tier, parent, blocks } }),
        4 => (worker.clone(), tier, blocks).prop_map(|(w, tier, (blocks, _))| IndexEvent {
            worker: WorkerId(w), data: IndexEventData::Removed { tier, blocks } }),
        1 => worker.prop_map(|w| IndexEvent { worker: WorkerId(w), data: IndexEventData::Cleared }),
    ]
}

fn sorted(v: Vec<(WorkerId, Overlap)>) -> BTreeMap<u64, Overlap> {
    v.into_iter().map(|(w, o)| (w.0, o)).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, rng_seed: proptest::test_runner::RngSeed::Fixed(3), ..ProptestConfig::default() })]
    #[test]
    fn matches_agree_with_the_naive_model(events in proptest::collection::vec(event(), 1..60),
                                         queries in proptest::collection::vec((0u64..4, 1usize..20), 1..8)) {
        let mut idx = KvIndex::new();
        let mut flat = flat::FlatIndex::new();
        let mut naive = Naive::default();
        for ev in &fillers() {
            idx.apply(ev).unwrap();
            flat.apply(ev);
            naive.apply(ev);
        }
        for ev in &events {
            idx.apply(ev).unwrap();
            flat.apply(ev);
            naive.apply(ev);
            // Every query after every event.
            for (branch, len) in &queries {
                let q = chain(*len, *branch);
                let got = sorted(idx.find_matches(&q));
                prop_assert_eq!(&got, &sorted(flat.find_matches(&q)));
                let watched: BTreeMap<u64, Overlap> = got.into_iter().filter(|(w, _)| WATCHED.contains(w)).collect();
                prop_assert_eq!(watched, naive.find(&q, &WATCHED));
            }
            for w in WATCHED {
                let mut want = [0u64; 3];
                for (x, t, _) in &naive.held { if *x == w { want[*t] += 1; } }
                prop_assert_eq!(idx.blocks_of(WorkerId(w)), want);
                prop_assert_eq!(flat.blocks_of(WorkerId(w)), want);
            }
        }
        // Its runs, loaded back (a router's snapshot), answer the same, and
        // take further events the same.
        let mut back = KvIndex::from_runs(&idx.export_runs(|_| true), MAX_WORKERS).unwrap();
        for ev in events.iter().rev().take(5) {
            back.apply(ev).unwrap();
            idx.apply(ev).unwrap();
        }
        for (branch, len) in &queries {
            let q = chain(*len, *branch);
            prop_assert_eq!(sorted(back.find_matches(&q)), sorted(idx.find_matches(&q)));
        }
        for w in WATCHED {
            prop_assert_eq!(back.blocks_of(WorkerId(w)), idx.blocks_of(WorkerId(w)));
        }
        prop_assert_eq!(back.len(), idx.len());
    }
}

#[test]
fn removing_a_worker_frees_its_slot_and_blocks() {
    const MAX: usize = 200;
    let mut idx = KvIndex::with_max_workers(MAX);
    for w in 0..MAX as u64 {
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
        Err(IndexError::TooManyWorkers {
            worker: WorkerId(999),
            max: MAX
        })
    );
    // All of them share the first half (2 blocks) of every chain.
    assert_eq!(idx.find_matches(&chain(4, 0)).len(), MAX);
    idx.remove_worker(WorkerId(5));
    assert!(idx
        .find_matches(&chain(4, 5))
        .iter()
        .all(|(w, _)| *w != WorkerId(5)));
    assert_eq!(idx.blocks_of(WorkerId(5)), [0, 0, 0]);
    idx.apply(&extra).unwrap();
    assert_eq!(idx.find_matches(&chain(2, 0)).len(), MAX);
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

/// A long seeded run at fleet scale: 1,024 workers storing and evicting
/// branching chains (with parents, tails evicted first, some host offload),
/// checked against the flat oracle on the way.
#[test]
fn a_thousand_workers_agree_with_the_flat_oracle() {
    use crate::workload::Rng;
    let mut rng = Rng(42);
    let mut idx = KvIndex::new();
    let mut flat = flat::FlatIndex::new();
    // 64 conversations of up to 96 blocks; branch points shared between them.
    let convs: Vec<Vec<SequenceHash>> = (0..64u64)
        .map(|c| {
            (0..96u64)
                .map(|i| {
                    SequenceHash(if i < 8 {
                        7 + i
                    } else {
                        c / 4 * 1_000 + (c % 4) * 100_000_000 + i
                    })
                })
                .collect()
        })
        .collect();
    let mut held: Vec<(u64, usize, usize)> = Vec::new(); // (worker, conv, len)
    for step in 0..6_000u64 {
        let w = rng.next_u64() % 1_024;
        let c = (rng.next_u64() % 64) as usize;
        let ev = match rng.next_u64() % 10 {
            0..=5 => {
                let start = (rng.next_u64() % 64) as usize;
                let n = 1 + (rng.next_u64() % 32) as usize;
                held.push((w, c, start + n));
                IndexEvent {
                    worker: WorkerId(w),
                    data: IndexEventData::Stored {
                        tier: if rng.next_u64().is_multiple_of(8) {
                            Tier::Host
                        } else {
                            Tier::Device
                        },
                        parent: (start > 0).then(|| convs[c][start - 1]),
                        blocks: convs[c][start..start + n].to_vec(),
                    },
                }
            }
            6..=8 if !held.is_empty() => {
                // Evict a tail.
                let (w, c, len) = held.swap_remove((rng.next_u64() % held.len() as u64) as usize);
                let from = (rng.next_u64() % len as u64) as usize;
                IndexEvent {
                    worker: WorkerId(w),
                    data: IndexEventData::Removed {
                        tier: Tier::Device,
                        blocks: convs[c][from..len].iter().rev().copied().collect(),
                    },
                }
            }
            _ => IndexEvent {
                worker: WorkerId(w),
                data: IndexEventData::Cleared,
            },
        };
        idx.apply(&ev).unwrap();
        flat.apply(&ev);
        if step % 50 == 0 {
            for q in convs.iter().step_by(7) {
                assert_eq!(
                    sorted(idx.find_matches(q)),
                    sorted(flat.find_matches(q)),
                    "step {step}"
                );
            }
            for w in (0..1_024).step_by(97) {
                assert_eq!(idx.blocks_of(WorkerId(w)), flat.blocks_of(WorkerId(w)));
            }
        }
    }
    assert!(
        idx.workers().count() > 128,
        "the test should exercise more than 128 workers"
    );
}

#[test]
fn a_chain_stored_whole_by_the_same_workers_is_one_run_however_it_was_split() {
    let c: Vec<SequenceHash> = (0..256u64).map(|i| SequenceHash(i * 7 + 1)).collect();
    let mut idx = KvIndex::new();
    let store = |idx: &mut KvIndex, w: u64, from: usize, to: usize| {
        idx.apply(&IndexEvent {
            worker: WorkerId(w),
            data: IndexEventData::Stored {
                tier: Tier::Device,
                parent: (from > 0).then(|| c[from - 1]),
                blocks: c[from..to].to_vec(),
            },
        })
        .unwrap()
    };
    // Worker 1 in chunks of 64, worker 2 in uneven chunks.
    for k in 0..4 {
        store(&mut idx, 1, k * 64, k * 64 + 64);
    }
    assert_eq!(idx.runs(), 1);
    for (from, to) in [(0, 10), (10, 100), (100, 101), (101, 256)] {
        store(&mut idx, 2, from, to);
    }
    assert_eq!(idx.runs(), 1, "equal holders along the chain merge back");
    // Worker 2 evicts its tail: two runs, {1,2} then {1}.
    idx.apply(&IndexEvent {
        worker: WorkerId(2),
        data: IndexEventData::Removed {
            tier: Tier::Device,
            blocks: c[200..].to_vec(),
        },
    })
    .unwrap();
    assert_eq!(idx.runs(), 2);
    let m = sorted(idx.find_matches(&c));
    assert_eq!(m[&1].blocks, 256);
    assert_eq!(m[&2].blocks, 200);
    // And stores it again: one run.
    store(&mut idx, 2, 200, 256);
    assert_eq!(idx.runs(), 1);
    // Worker 2 evicts its tail again, then is cleared (its engine
    // restarted): worker 1's chain is one run again.
    idx.apply(&IndexEvent {
        worker: WorkerId(2),
        data: IndexEventData::Removed {
            tier: Tier::Device,
            blocks: c[100..].to_vec(),
        },
    })
    .unwrap();
    assert_eq!(idx.runs(), 2);
    idx.apply(&IndexEvent {
        worker: WorkerId(2),
        data: IndexEventData::Cleared,
    })
    .unwrap();
    assert_eq!(idx.runs(), 1, "runs only worker 2 told apart merge back");
    let m = sorted(idx.find_matches(&c));
    assert_eq!(m[&1].blocks, 256);
    assert!(!m.contains_key(&2));
}
