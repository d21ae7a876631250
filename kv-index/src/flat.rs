//! The flat index: one table per (tier, group of 128 workers) from sequence
//! hash to a 128-bit mask of the workers holding that block. Every block of a
//! query or an event is one random access, so it is slower than
//! [`crate::KvIndex`]; it is kept as the obviously-correct oracle that the
//! property tests and benches hold the run index against.
//!
//! Invariants:
//! - worker slot `s` is bit `s % 128` of group `s / 128`; any number of workers;
//! - a worker's bit is set on a block in a tier iff it holds that block there;
//! - per-worker counts equal the set bits for that worker.

use crate::table::{Mask, MaskTable};
use crate::{IndexEvent, IndexEventData, Overlap, TIERS};
use dynamo_bus_schema::WorkerId;
use std::collections::HashMap;

#[derive(Default)]
pub struct FlatIndex {
    groups: Vec<[MaskTable; 3]>,
    slot_of: HashMap<WorkerId, usize>,
    worker_at: Vec<Option<WorkerId>>,
    counts: Vec<[u64; 3]>,
}

impl FlatIndex {
    pub fn new() -> Self {
        Self::default()
    }

    fn slot(&mut self, w: WorkerId) -> usize {
        if let Some(&s) = self.slot_of.get(&w) {
            return s;
        }
        let s = match self.worker_at.iter().position(Option::is_none) {
            Some(s) => s,
            None => {
                self.worker_at.push(None);
                self.counts.push([0; 3]);
                self.worker_at.len() - 1
            }
        };
        while self.groups.len() <= s / 128 {
            self.groups.push(Default::default());
        }
        self.worker_at[s] = Some(w);
        self.slot_of.insert(w, s);
        s
    }

    pub fn apply(&mut self, ev: &IndexEvent) {
        match &ev.data {
            IndexEventData::Stored { tier, blocks, .. } => {
                let s = self.slot(ev.worker);
                let bit = 1u128 << (s % 128);
                let t = &mut self.groups[s / 128][*tier as usize];
                for b in blocks {
                    if t.update(b.0, |m| Mask::from(m.get() | bit)).get() & bit == 0 {
                        self.counts[s][*tier as usize] += 1;
                    }
                }
            }
            IndexEventData::Removed { tier, blocks } => {
                let Some(&s) = self.slot_of.get(&ev.worker) else {
                    return;
                };
                let bit = 1u128 << (s % 128);
                let t = &mut self.groups[s / 128][*tier as usize];
                for b in blocks {
                    if t.update(b.0, |m| Mask::from(m.get() & !bit)).get() & bit != 0 {
                        self.counts[s][*tier as usize] -= 1;
                    }
                }
            }
            IndexEventData::Cleared => self.clear_worker(ev.worker),
        }
    }

    fn clear_worker(&mut self, w: WorkerId) {
        if let Some(&s) = self.slot_of.get(&w) {
            let bit = 1u128 << (s % 128);
            for t in TIERS {
                self.groups[s / 128][t as usize].map_all(|m| Mask::from(m.get() & !bit));
            }
            self.counts[s] = [0; 3];
        }
    }

    pub fn remove_worker(&mut self, w: WorkerId) {
        self.clear_worker(w);
        if let Some(s) = self.slot_of.remove(&w) {
            self.worker_at[s] = None;
        }
    }

    pub fn blocks_of(&self, w: WorkerId) -> [u64; 3] {
        self.slot_of
            .get(&w)
            .map(|&s| self.counts[s])
            .unwrap_or([0; 3])
    }

    /// Same contract as [`crate::KvIndex::find_matches`].
    pub fn find_matches(
        &self,
        hashes: &[dynamo_bus_schema::blocks::SequenceHash],
    ) -> Vec<(WorkerId, Overlap)> {
        let mut out = Vec::new();
        for (g, tables) in self.groups.iter().enumerate() {
            let mut active = u128::MAX;
            let mut o = [Overlap::default(); 128];
            for h in hashes {
                let m = tables.each_ref().map(|t| t.get(h.0).get());
                let any = m[0] | m[1] | m[2];
                // A worker holding this block: counted in its cheapest tier.
                let mut held = active & any;
                while held != 0 {
                    let b = held.trailing_zeros() as usize;
                    held &= held - 1;
                    let x = &mut o[b];
                    x.blocks += 1;
                    if m[0] >> b & 1 == 1 {
                        x.device += 1;
                    } else if m[1] >> b & 1 == 1 {
                        x.host += 1;
                    } else {
                        x.disk += 1;
                    }
                }
                active &= any;
                if active == 0 {
                    break;
                }
            }
            for (b, x) in o.iter().enumerate() {
                if x.blocks > 0 {
                    if let Some(Some(w)) = self.worker_at.get(g * 128 + b) {
                        out.push((*w, *x));
                    }
                }
            }
        }
        out
    }
}
