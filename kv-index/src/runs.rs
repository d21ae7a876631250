//! The run index behind [`KvIndex`]: blocks are kept in *runs*, sequences of
//! blocks (normally consecutive blocks of one prefix chain) that have exactly
//! the same holders in the same tiers. A table maps each block's sequence
//! hash to its run and position. A query does one random access per run it
//! crosses and compares the rest of the run sequentially; an event touches
//! the table once per block but the holders once per run.
//!
//! Invariants:
//! - every indexed block is in exactly one live run, at `loc[hash]`;
//!   `runs[r].hashes[pos - runs[r].base] == hash`;
//! - every block of a run is held by exactly `runs[r].holders`
//!   (`slot << 3 | tiers`, sorted by slot, tiers ≠ 0); a live run has ≥ 1
//!   holder and ≥ 1 block; a run with no holder is deleted with its blocks;
//! - `prev`/`next` link runs whose blocks were contiguous in one chain when
//!   they were linked (a later fork may append to the tail of a linked run,
//!   so a link is a merge hint that queries never rely on); linked runs with
//!   equal holders are merged, so a chain stored whole by the same workers
//!   stays one run however its events were split, and a `Cleared` worker's
//!   runs merge back where only it told them apart;
//! - splitting and merging never change a block's position, only its run:
//!   a run's `base` moves instead (new runs start at `1 << 31` so that both
//!   directions have room);
//! - `counts[slot][tier]` is the number of blocks the slot holds in that tier.

mod snapshot;
pub use snapshot::SnapshotError;

use crate::table::{Loc, Table};
use crate::{IndexError, IndexEvent, IndexEventData, Overlap, Tier};
use dynamo_bus_schema::blocks::SequenceHash;
use dynamo_bus_schema::WorkerId;
use smallvec::SmallVec;
use std::collections::HashMap;

/// Workers one index can hold by default (slot ids).
pub const MAX_WORKERS: usize = 1 << 16;

const NONE: u32 = u32::MAX;
const BASE: u32 = 1 << 31;

/// Worker ids are already well spread (random u64s); a multiply mixes the
/// rest, and is far cheaper than SipHash on the per-event slot lookup.
#[derive(Default, Clone, Copy)]
struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ *b as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type IdMap<V> = HashMap<WorkerId, V, std::hash::BuildHasherDefault<IdHasher>>;

/// `slot << 3 | tier bits`, sorted.
type Holders = SmallVec<[u32; 4]>;

#[derive(Default)]
struct Run {
    hashes: Vec<u64>,
    base: u32,
    holders: Holders,
    prev: u32,
    next: u32,
}

impl Run {
    #[inline]
    fn end(&self) -> u32 {
        self.base + self.hashes.len() as u32
    }
}

#[inline]
fn tiers_of(h: &[u32], slot: u32) -> u8 {
    match h.binary_search_by_key(&slot, |x| x >> 3) {
        Ok(i) => (h[i] & 7) as u8,
        Err(_) => 0,
    }
}

/// `h` with tier bit `bit` of `slot` turned on or off.
fn with_tier(h: &[u32], slot: u32, bit: u8, on: bool) -> Holders {
    let mut out: Holders = h.iter().copied().filter(|x| x >> 3 != slot).collect();
    let had = tiers_of(h, slot);
    let tiers = if on { had | bit } else { had & !bit };
    if tiers != 0 {
        let v = slot << 3 | tiers as u32;
        let at = out.partition_point(|x| *x < v);
        out.insert(at, v);
    }
    out
}

/// The cheapest tier in a tier mask (device < host < disk).
#[inline]
fn add_cheapest(o: &mut Overlap, tiers: u32, k: u32) {
    o.blocks += k;
    if tiers & 1 != 0 {
        o.device += k;
    } else if tiers & 2 != 0 {
        o.host += k;
    } else {
        o.disk += k;
    }
}

pub struct KvIndex {
    loc: Table<Loc>,
    runs: Vec<Run>,
    free_runs: Vec<u32>,
    slot_of: IdMap<u32>,
    worker_at: Vec<Option<WorkerId>>,
    free_slots: Vec<u32>,
    counts: Vec<[u64; 3]>,
    max_workers: usize,
    orphans: u64,
}

impl Default for KvIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl KvIndex {
    pub fn new() -> Self {
        Self::with_max_workers(MAX_WORKERS)
    }

    /// An index refusing more than `max` workers at once (at most [`MAX_WORKERS`]).
    pub fn with_max_workers(max: usize) -> Self {
        KvIndex {
            loc: Table::new(),
            runs: Vec::new(),
            free_runs: Vec::new(),
            slot_of: IdMap::default(),
            worker_at: Vec::new(),
            free_slots: Vec::new(),
            counts: Vec::new(),
            max_workers: max.min(MAX_WORKERS),
            orphans: 0,
        }
    }

    /// Makes room for `blocks` more blocks, so that storing them rehashes
    /// nothing. A table that doubles while events arrive moves every block
    /// at once; an index sized ahead (for a snapshot it loads, or for the
    /// cache its workers advertise) never pauses for that.
    pub fn reserve(&mut self, blocks: usize) {
        self.loc.reserve(blocks);
    }

    fn slot(&mut self, w: WorkerId) -> Result<u32, IndexError> {
        if let Some(&s) = self.slot_of.get(&w) {
            return Ok(s);
        }
        if self.slot_of.len() >= self.max_workers {
            return Err(IndexError::TooManyWorkers {
                worker: w,
                max: self.max_workers,
            });
        }
        let s = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                self.worker_at.push(None);
                self.counts.push([0; 3]);
                (self.worker_at.len() - 1) as u32
            }
        };
        self.worker_at[s as usize] = Some(w);
        self.slot_of.insert(w, s);
        Ok(s)
    }

    /// Applies one event.
    pub fn apply(&mut self, ev: &IndexEvent) -> Result<(), IndexError> {
        match &ev.data {
            IndexEventData::Stored {
                tier,
                parent,
                blocks,
            } => {
                let s = self.slot(ev.worker)?;
                let prev = parent.map(|p| (p.0, self.loc.get(p.0)));
                if let Some((_, l)) = prev {
                    if l.run == NONE || tiers_of(&self.runs[l.run as usize].holders, s) == 0 {
                        self.orphans += 1;
                    }
                }
                self.change(s, *tier, true, blocks, prev);
            }
            IndexEventData::Removed { tier, blocks } => {
                if let Some(&s) = self.slot_of.get(&ev.worker) {
                    self.change(s, *tier, false, blocks, None);
                }
            }
            IndexEventData::Cleared => self.clear_worker(ev.worker),
        }
        Ok(())
    }

    /// Applies events in order, prefetching the table slots of the events
    /// ahead so that their cache misses overlap. Stops at the first error.
    pub fn apply_batch(&mut self, events: &[IndexEvent]) -> Result<(), IndexError> {
        // Events in flight: each prefetches two lines per block (up to 8
        // blocks), so 6 four-block events keep ~48 misses outstanding. On the
        // bench's VM 4–6 measured alike, 8 and 12 slower (more lines evicted
        // before use).
        const AHEAD: usize = 6;
        for e in events.iter().take(AHEAD) {
            self.prefetch_event(e);
        }
        for (i, e) in events.iter().enumerate() {
            if let Some(next) = events.get(i + AHEAD) {
                self.prefetch_event(next);
            }
            self.apply(e)?;
        }
        Ok(())
    }

    #[inline]
    fn prefetch_event(&self, e: &IndexEvent) {
        let blocks = match &e.data {
            IndexEventData::Stored { blocks, parent, .. } => {
                if let Some(p) = parent {
                    self.loc.prefetch(p.0);
                }
                blocks
            }
            IndexEventData::Removed { blocks, .. } => blocks,
            IndexEventData::Cleared => return,
        };
        for b in blocks.iter().take(8) {
            self.loc.prefetch(b.0);
        }
    }

    /// Turns `tier` of `slot` on or off for `blocks` (a chain after `prev`,
    /// given with its location when known).
    fn change(
        &mut self,
        slot: u32,
        tier: Tier,
        on: bool,
        blocks: &[SequenceHash],
        mut prev: Option<(u64, Loc)>,
    ) {
        let bit = 1u8 << tier as u8;
        let me: u32 = slot << 3 | bit as u32;
        let mut i = 0;
        while i < blocks.len() {
            let l = self.loc.get(blocks[i].0);
            if l.run == NONE {
                if !on {
                    i += 1;
                    continue;
                }
                i = self.store_fresh(slot, tier, me, blocks, i, prev);
                prev = None;
                continue;
            }
            let r = l.run as usize;
            let run = &self.runs[r];
            let idx = (l.pos - run.base) as usize;
            let avail = (blocks.len() - i).min(run.hashes.len() - idx);
            let mut k = 1;
            while k < avail && run.hashes[idx + k] == blocks[i + k].0 {
                k += 1;
            }
            // Or backwards (evictions name a tail last block first): the run's
            // blocks [lo, lo + k).
            let mut lo = idx;
            if k == 1 {
                while i + k < blocks.len() && lo > 0 && run.hashes[lo - 1] == blocks[i + k].0 {
                    lo -= 1;
                    k += 1;
                }
            }
            let has = tiers_of(&run.holders, slot) & bit != 0;
            if has != on {
                let holders = with_tier(&run.holders, slot, bit, on);
                let s = self.isolate(l.run, lo, lo + k);
                let c = &mut self.counts[slot as usize][tier as usize];
                if on {
                    *c += k as u64;
                } else {
                    *c -= k as u64;
                }
                if holders.is_empty() {
                    self.delete_run(s);
                } else {
                    self.runs[s as usize].holders = holders;
                    self.merge_around(s);
                }
            }
            prev = None;
            i += k;
        }
    }

    /// Stores the absent blocks from `blocks[i]` on (until one is present),
    /// appending them to the run ending at `prev` when only `me` holds it.
    /// Returns the index after the last stored block.
    fn store_fresh(
        &mut self,
        slot: u32,
        tier: Tier,
        me: u32,
        blocks: &[SequenceHash],
        i: usize,
        prev: Option<(u64, Loc)>,
    ) -> usize {
        // The block before, located (the caller's location may be stale after a split).
        let prev = match prev {
            Some((_, l)) if l.run != NONE => Some(l),
            _ if i > 0 => Some(self.loc.get(blocks[i - 1].0)),
            _ => None,
        };
        // The run ending at the block before, if any.
        let tail_of = prev.and_then(|l| {
            (l.run != NONE && l.pos + 1 == self.runs[l.run as usize].end()).then_some(l.run)
        });
        let r = match tail_of {
            Some(t) if self.runs[t as usize].holders.as_slice() == [me] => t,
            _ => {
                let r = self.new_run(BASE, Holders::from_slice(&[me]));
                if let Some(t) = tail_of {
                    if self.runs[t as usize].next == NONE {
                        self.runs[t as usize].next = r;
                        self.runs[r as usize].prev = t;
                    }
                }
                r
            }
        };
        let mut j = i;
        while j < blocks.len() {
            let pos = self.runs[r as usize].end();
            if !self.loc.insert_new(blocks[j].0, Loc { run: r, pos }) {
                break;
            }
            self.runs[r as usize].hashes.push(blocks[j].0);
            j += 1;
        }
        self.counts[slot as usize][tier as usize] += (j - i) as u64;
        j
    }

    fn new_run(&mut self, base: u32, holders: Holders) -> u32 {
        match self.free_runs.pop() {
            Some(r) => {
                let run = &mut self.runs[r as usize];
                run.base = base;
                run.holders = holders;
                run.prev = NONE;
                run.next = NONE;
                r
            }
            None => {
                self.runs.push(Run {
                    hashes: Vec::new(),
                    base,
                    holders,
                    prev: NONE,
                    next: NONE,
                });
                (self.runs.len() - 1) as u32
            }
        }
    }

    /// Splits run `r` so that its blocks `[lo, hi)` form a run of their own; returns it.
    fn isolate(&mut self, r: u32, lo: usize, hi: usize) -> u32 {
        let mut r = r;
        if hi < self.runs[r as usize].hashes.len() {
            r = self.split(r, hi).0;
        }
        if lo > 0 {
            r = self.split(r, lo).1;
        }
        r
    }

    /// Splits `r` before its block `at` (0 < at < len); returns (head, tail).
    /// The smaller side moves to a new run, so at most half the blocks are rewritten.
    fn split(&mut self, r: u32, at: usize) -> (u32, u32) {
        let len = self.runs[r as usize].hashes.len();
        debug_assert!(0 < at && at < len);
        let holders = self.runs[r as usize].holders.clone();
        let new = self.new_run(0, holders);
        let (ru, nu) = (r as usize, new as usize);
        let mut moved = std::mem::take(&mut self.runs[nu].hashes);
        moved.clear();
        let (head, tail) = if at <= len - at {
            moved.extend(self.runs[ru].hashes.drain(..at));
            let old_prev = self.runs[ru].prev;
            let base = self.runs[ru].base;
            let n = &mut self.runs[nu];
            n.base = base;
            n.prev = old_prev;
            n.next = r;
            self.runs[ru].base += at as u32;
            self.runs[ru].prev = new;
            if old_prev != NONE {
                self.runs[old_prev as usize].next = new;
            }
            (new, r)
        } else {
            moved.extend_from_slice(&self.runs[ru].hashes[at..]);
            self.runs[ru].hashes.truncate(at);
            let old_next = self.runs[ru].next;
            let base = self.runs[ru].base + at as u32;
            let n = &mut self.runs[nu];
            n.base = base;
            n.prev = r;
            n.next = old_next;
            self.runs[ru].next = new;
            if old_next != NONE {
                self.runs[old_next as usize].prev = new;
            }
            (r, new)
        };
        let base = self.runs[nu].base;
        for (j, h) in moved.iter().enumerate() {
            self.loc.replace(
                *h,
                Loc {
                    run: new,
                    pos: base + j as u32,
                },
            );
        }
        self.runs[nu].hashes = moved;
        (head, tail)
    }

    /// Merges `s` with its linked neighbours where their holders are equal.
    fn merge_around(&mut self, mut s: u32) {
        let p = self.runs[s as usize].prev;
        if p != NONE && self.runs[p as usize].holders == self.runs[s as usize].holders {
            s = self.merge(p, s);
        }
        let n = self.runs[s as usize].next;
        if n != NONE && self.runs[n as usize].holders == self.runs[s as usize].holders {
            self.merge(s, n);
        }
    }

    /// Merges `b` (linked after `a`) into one run; returns the survivor.
    /// The smaller run's blocks move.
    fn merge(&mut self, a: u32, b: u32) -> u32 {
        let (au, bu) = (a as usize, b as usize);
        let (la, lb) = (self.runs[au].hashes.len(), self.runs[bu].hashes.len());
        let prepend = la < lb && self.runs[bu].base as usize >= la;
        let (keep, gone) = if prepend { (b, a) } else { (a, b) };
        let moved = std::mem::take(&mut self.runs[gone as usize].hashes);
        let k = keep as usize;
        let start = if prepend {
            self.runs[k].base -= la as u32;
            self.runs[k].hashes.splice(0..0, moved.iter().copied());
            self.runs[k].base
        } else {
            let e = self.runs[k].end();
            self.runs[k].hashes.extend_from_slice(&moved);
            e
        };
        for (j, h) in moved.iter().enumerate() {
            self.loc.replace(
                *h,
                Loc {
                    run: keep,
                    pos: start + j as u32,
                },
            );
        }
        // Relink: a's prev … b's next.
        let (p, n) = (self.runs[au].prev, self.runs[bu].next);
        self.runs[k].prev = p;
        self.runs[k].next = n;
        if p != NONE {
            self.runs[p as usize].next = keep;
        }
        if n != NONE {
            self.runs[n as usize].prev = keep;
        }
        self.free_run(gone);
        keep
    }

    fn free_run(&mut self, r: u32) {
        let run = &mut self.runs[r as usize];
        // Keep a small buffer for the next run; give large ones back.
        if run.hashes.capacity() > 64 {
            run.hashes = Vec::new();
        } else {
            run.hashes.clear();
        }
        run.holders.clear();
        run.prev = NONE;
        run.next = NONE;
        self.free_runs.push(r);
    }

    /// Deletes run `r` and its blocks; its neighbours are no longer contiguous.
    fn delete_run(&mut self, r: u32) {
        let hashes = std::mem::take(&mut self.runs[r as usize].hashes);
        for h in &hashes {
            self.loc.remove(*h);
        }
        self.runs[r as usize].hashes = hashes;
        let (p, n) = (self.runs[r as usize].prev, self.runs[r as usize].next);
        if p != NONE {
            self.runs[p as usize].next = NONE;
        }
        if n != NONE {
            self.runs[n as usize].prev = NONE;
        }
        self.free_run(r);
    }

    fn clear_worker(&mut self, w: WorkerId) {
        let Some(&s) = self.slot_of.get(&w) else {
            return;
        };
        if self.counts[s as usize] == [0; 3] {
            return;
        }
        let mut changed = Vec::new();
        for r in 0..self.runs.len() as u32 {
            let run = &self.runs[r as usize];
            if run.hashes.is_empty() || tiers_of(&run.holders, s) == 0 {
                continue;
            }
            let holders: Holders = run
                .holders
                .iter()
                .copied()
                .filter(|x| x >> 3 != s)
                .collect();
            if holders.is_empty() {
                self.delete_run(r);
            } else {
                self.runs[r as usize].holders = holders;
                changed.push(r);
            }
        }
        // Runs that differed only by this worker are alike now: merge them
        // back along their chains (a run merged into a neighbour is freed,
        // with no blocks, and skipped).
        for r in changed {
            if !self.runs[r as usize].hashes.is_empty() {
                self.merge_around(r);
            }
        }
        self.counts[s as usize] = [0; 3];
    }

    /// Forgets a worker entirely (it died or left).
    pub fn remove_worker(&mut self, w: WorkerId) {
        self.clear_worker(w);
        if let Some(s) = self.slot_of.remove(&w) {
            self.worker_at[s as usize] = None;
            self.free_slots.push(s);
        }
    }

    /// Blocks held by `w` per tier.
    pub fn blocks_of(&self, w: WorkerId) -> [u64; 3] {
        self.slot_of
            .get(&w)
            .map(|&s| self.counts[s as usize])
            .unwrap_or([0; 3])
    }

    /// Workers currently indexed.
    pub fn workers(&self) -> impl Iterator<Item = WorkerId> + '_ {
        self.worker_at.iter().flatten().copied()
    }

    /// Distinct blocks indexed (in any tier).
    pub fn len(&self) -> usize {
        self.loc.len()
    }

    pub fn is_empty(&self) -> bool {
        self.loc.is_empty()
    }

    /// Live runs (a measure of fragmentation: blocks ÷ runs is the mean run length).
    pub fn runs(&self) -> usize {
        self.runs.len() - self.free_runs.len()
    }

    /// `Stored` events whose parent the worker did not hold (out of order or missed).
    pub fn orphans(&self) -> u64 {
        self.orphans
    }

    /// Heap bytes of the table, the runs and their blocks.
    pub fn heap_bytes(&self) -> usize {
        let runs: usize = self
            .runs
            .iter()
            .map(|r| {
                r.hashes.capacity() * 8
                    + if r.holders.spilled() {
                        r.holders.capacity() * 4
                    } else {
                        0
                    }
            })
            .sum();
        self.loc.heap_bytes() + self.runs.capacity() * std::mem::size_of::<Run>() + runs
    }

    /// For each worker holding at least the first block of `hashes`, how
    /// many leading blocks it holds (see [`Overlap`]).
    pub fn find_matches(&self, hashes: &[SequenceHash]) -> Vec<(WorkerId, Overlap)> {
        let mut out = Vec::new();
        let n = hashes.len();
        if n == 0 {
            return out;
        }
        let mut l = self.loc.get(hashes[0].0);
        if l.run == NONE {
            return out;
        }
        // Active workers, sorted by slot, with their overlap so far.
        let mut active: Vec<(u32, Overlap)> = Vec::new();
        let mut i = 0;
        loop {
            let run = &self.runs[l.run as usize];
            let idx = (l.pos - run.base) as usize;
            let avail = (n - i).min(run.hashes.len() - idx);
            let mut k = 1;
            while k < avail && run.hashes[idx + k] == hashes[i + k].0 {
                k += 1;
            }
            if i == 0 {
                active.reserve(run.holders.len());
                for &h in &run.holders {
                    let mut o = Overlap::default();
                    add_cheapest(&mut o, h & 7, k as u32);
                    active.push((h >> 3, o));
                }
            } else {
                // Keep the active workers holding this run; the rest stop here.
                let mut hi = 0;
                let mut kept = 0;
                for a in 0..active.len() {
                    let (slot, mut o) = active[a];
                    while hi < run.holders.len() && run.holders[hi] >> 3 < slot {
                        hi += 1;
                    }
                    if hi < run.holders.len() && run.holders[hi] >> 3 == slot {
                        add_cheapest(&mut o, run.holders[hi] & 7, k as u32);
                        active[kept] = (slot, o);
                        kept += 1;
                    } else if let Some(w) = self.worker_at[slot as usize] {
                        out.push((w, o));
                    }
                }
                active.truncate(kept);
            }
            i += k;
            if i == n || active.is_empty() {
                break;
            }
            l = self.loc.get(hashes[i].0);
            if l.run == NONE {
                break;
            }
        }
        for (slot, o) in active {
            if let Some(w) = self.worker_at[slot as usize] {
                out.push((w, o));
            }
        }
        out
    }
}
