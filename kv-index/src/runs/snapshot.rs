//! Writing the run index out as its runs, and building an index from them
//! (a router replica's snapshot, [`dynamo_bus_schema::KvIndexSnapshot`]).
//!
//! Invariants: `from_runs(export_runs(|_| true))` answers every query and
//! every per-worker count exactly as the exported index did; a set of runs
//! that breaks the snapshot's rules (a block twice, a run with no block or
//! no holder, a holder twice, tier bits outside `1..=7`, more workers than
//! the limit) is refused whole with the rule it broke, never half-loaded.

use super::{Holders, KvIndex, BASE};
use crate::table::Loc;
use dynamo_bus_schema::{KvSnapshotHolder, KvSnapshotRun, WorkerId};
use thiserror::Error;

#[derive(Debug, Error, PartialEq)]
pub enum SnapshotError {
    #[error("run {run} has no blocks")]
    EmptyRun { run: usize },
    #[error("run {run} has no holder")]
    NoHolder { run: usize },
    #[error("run {run}: worker {worker} has tier bits {tiers:#05b} (must be 1..=7)")]
    BadTiers {
        run: usize,
        worker: WorkerId,
        tiers: u8,
    },
    #[error("run {run}: worker {worker} is a holder twice")]
    DuplicateHolder { run: usize, worker: WorkerId },
    #[error("run {run}: block {block:#x} is already in an earlier run")]
    DuplicateBlock { run: usize, block: u64 },
    #[error("run {run}: a run may hold at most {max} blocks")]
    RunTooLong { run: usize, max: usize },
    #[error("the snapshot names more than the index's limit of {max} workers")]
    TooManyWorkers { max: usize },
}

/// Most blocks one run may hold (positions are `u32`s from `BASE`).
const MAX_RUN: usize = (u32::MAX - BASE) as usize / 2;

impl KvIndex {
    /// Every run, with only the holders `keep` accepts (a run left without
    /// holders is left out).
    pub fn export_runs(&self, keep: impl Fn(WorkerId) -> bool) -> Vec<KvSnapshotRun> {
        let mut out = Vec::with_capacity(self.runs());
        for run in &self.runs {
            if run.hashes.is_empty() {
                continue; // a free run
            }
            let holders: Vec<KvSnapshotHolder> = run
                .holders
                .iter()
                .filter_map(|h| {
                    let w = self.worker_at[(h >> 3) as usize]?;
                    keep(w).then_some(KvSnapshotHolder {
                        worker_id: w,
                        tiers: (h & 7) as u8,
                    })
                })
                .collect();
            if holders.is_empty() {
                continue;
            }
            out.push(KvSnapshotRun {
                blocks: run
                    .hashes
                    .iter()
                    .map(|h| dynamo_bus_schema::blocks::SequenceHash(*h))
                    .collect(),
                holders,
            });
        }
        out
    }

    /// An index holding exactly `runs`, refusing more than `max_workers`.
    pub fn from_runs(runs: &[KvSnapshotRun], max_workers: usize) -> Result<KvIndex, SnapshotError> {
        let mut idx = KvIndex::with_max_workers(max_workers);
        let blocks: usize = runs.iter().map(|r| r.blocks.len()).sum();
        idx.reserve(blocks);
        idx.runs.reserve(runs.len());
        for (i, r) in runs.iter().enumerate() {
            if r.blocks.is_empty() {
                return Err(SnapshotError::EmptyRun { run: i });
            }
            if r.blocks.len() > MAX_RUN {
                return Err(SnapshotError::RunTooLong {
                    run: i,
                    max: MAX_RUN,
                });
            }
            if r.holders.is_empty() {
                return Err(SnapshotError::NoHolder { run: i });
            }
            let mut holders = Holders::new();
            for h in &r.holders {
                if h.tiers == 0 || h.tiers > 7 {
                    return Err(SnapshotError::BadTiers {
                        run: i,
                        worker: h.worker_id,
                        tiers: h.tiers,
                    });
                }
                let slot = idx
                    .slot(h.worker_id)
                    .map_err(|_| SnapshotError::TooManyWorkers {
                        max: idx.max_workers,
                    })?;
                holders.push(slot << 3 | h.tiers as u32);
            }
            holders.sort_unstable();
            if let Some(w) = holders.windows(2).find(|p| p[0] >> 3 == p[1] >> 3) {
                let worker = idx.worker_at[(w[0] >> 3) as usize].unwrap_or(WorkerId(0));
                return Err(SnapshotError::DuplicateHolder { run: i, worker });
            }
            let run = idx.new_run(BASE, holders);
            for b in &r.blocks {
                let pos = idx.runs[run as usize].end();
                if !idx.loc.insert_new(b.0, Loc { run, pos }) {
                    return Err(SnapshotError::DuplicateBlock { run: i, block: b.0 });
                }
                idx.runs[run as usize].hashes.push(b.0);
            }
            let n = r.blocks.len() as u64;
            for h in idx.runs[run as usize].holders.clone() {
                for t in 0..3 {
                    if h & (1 << t) != 0 {
                        idx.counts[(h >> 3) as usize][t] += n;
                    }
                }
            }
        }
        Ok(idx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{IndexEvent, IndexEventData, Tier};
    use dynamo_bus_schema::blocks::SequenceHash;

    fn hashes(v: &[u64]) -> Vec<SequenceHash> {
        v.iter().map(|h| SequenceHash(*h)).collect()
    }

    #[test]
    fn bad_runs_are_refused_with_the_rule_they_break() {
        let run = |blocks: &[u64], holders: &[(u64, u8)]| KvSnapshotRun {
            blocks: hashes(blocks),
            holders: holders
                .iter()
                .map(|(w, t)| KvSnapshotHolder {
                    worker_id: WorkerId(*w),
                    tiers: *t,
                })
                .collect(),
        };
        let err = |runs: &[KvSnapshotRun]| KvIndex::from_runs(runs, 4).err();
        assert_eq!(
            err(&[run(&[], &[(1, 1)])]),
            Some(SnapshotError::EmptyRun { run: 0 })
        );
        assert_eq!(
            err(&[run(&[1], &[])]),
            Some(SnapshotError::NoHolder { run: 0 })
        );
        assert!(matches!(
            err(&[run(&[1], &[(1, 8)])]),
            Some(SnapshotError::BadTiers { tiers: 8, .. })
        ));
        assert!(matches!(
            err(&[run(&[1], &[(1, 1), (1, 2)])]),
            Some(SnapshotError::DuplicateHolder { run: 0, .. })
        ));
        assert_eq!(
            err(&[run(&[1, 2], &[(1, 1)]), run(&[3, 2], &[(2, 1)])]),
            Some(SnapshotError::DuplicateBlock { run: 1, block: 2 })
        );
        let many: Vec<(u64, u8)> = (0..5).map(|w| (w, 1)).collect();
        assert_eq!(
            err(&[run(&[1], &many)]),
            Some(SnapshotError::TooManyWorkers { max: 4 })
        );
        let ok = KvIndex::from_runs(&[run(&[1, 2], &[(1, 0b011), (2, 0b100)])], 4).unwrap();
        assert_eq!(ok.blocks_of(WorkerId(1)), [2, 2, 0]);
        assert_eq!(ok.blocks_of(WorkerId(2)), [0, 0, 2]);
        assert_eq!(ok.find_matches(&hashes(&[1, 2, 9])).len(), 2);
    }

    #[test]
    fn an_imported_index_keeps_taking_events() {
        let mut idx = KvIndex::new();
        let stored = |w: u64, parent: Option<u64>, b: &[u64]| IndexEvent {
            worker: WorkerId(w),
            data: IndexEventData::Stored {
                tier: Tier::Device,
                parent: parent.map(SequenceHash),
                blocks: hashes(b),
            },
        };
        idx.apply(&stored(1, None, &[1, 2, 3])).unwrap();
        idx.apply(&stored(2, None, &[1, 2])).unwrap();
        let mut back = KvIndex::from_runs(&idx.export_runs(|_| true), 16).unwrap();
        back.apply(&stored(2, Some(2), &[3, 4])).unwrap();
        back.apply(&IndexEvent {
            worker: WorkerId(1),
            data: IndexEventData::Removed {
                tier: Tier::Device,
                blocks: hashes(&[3]),
            },
        })
        .unwrap();
        let got = back.find_matches(&hashes(&[1, 2, 3, 4]));
        let of = |w: u64| got.iter().find(|(x, _)| x.0 == w).map(|(_, o)| o.blocks);
        assert_eq!((of(1), of(2)), (Some(2), Some(4)));
        // Keeping only worker 1 drops runs only worker 2 holds.
        let only1 = KvIndex::from_runs(&back.export_runs(|w| w.0 == 1), 16).unwrap();
        assert_eq!(only1.blocks_of(WorkerId(1)), [2, 0, 0]);
        assert_eq!(only1.blocks_of(WorkerId(2)), [0, 0, 0]);
        assert_eq!(only1.len(), 2);
    }
}
