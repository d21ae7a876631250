//! The body of a load ([`super::load`]): fetching chunks in windows,
//! hashing the landed prefix, and finding and fetching again what the
//! file's hash refuses. The invariants are the parent module's.

use super::{Dest, LoadError, LoadOptions, LoadProgress, Source, Tried};
use crate::manifest::{chunk_ok, hash, ContentHash, Manifest};
use crate::source::SourceError;
use dynamo_transfer::{Agent, FabricError, Peer, Region, RemoteRegion, WriteOp};
use sha2::{Digest, Sha256};
use std::collections::{HashSet, VecDeque};
use std::time::{Duration, Instant};

/// The start of a load's destination, shared by the thread that fetches
/// chunks, the thread that hashes the landed prefix and the threads that
/// check chunks after a failed file hash; at any time each makes slices of
/// ranges the others do not write (see [`Fetch`]: a chunk is waiting, being
/// read, or landed, and only a waiting one is written).
#[derive(Clone, Copy)]
pub(super) struct Base(*mut u8);

// SAFETY: a plain address; no range is written while another thread reads
// it (see above) and the memory outlives every thread.
unsafe impl Send for Base {}

impl Base {
    /// # Safety
    /// `off + len` is within the destination, and no other thread uses
    /// the range while the slice lives.
    unsafe fn slice<'a>(self, off: usize, len: usize) -> &'a [u8] {
        std::slice::from_raw_parts(self.0.add(off), len)
    }
    /// # Safety
    /// As [`Base::slice`], and nothing else reads the range meanwhile.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice_mut<'a>(self, off: usize, len: usize) -> &'a mut [u8] {
        std::slice::from_raw_parts_mut(self.0.add(off), len)
    }
}

/// The whole file's SHA-256, computed on a second thread over the landed
/// prefix as it grows, so hashing the file overlaps fetching the chunks
/// after it.
pub(super) struct InOrder {
    tx: Option<std::sync::mpsc::SyncSender<(usize, usize)>>,
    landed: Vec<bool>,
    next: usize,
}

impl InOrder {
    /// One that feeds no hasher (the file is hashed in one pass at the end).
    pub(super) fn idle(n: usize) -> Self {
        InOrder {
            tx: None,
            landed: vec![false; n],
            next: 0,
        }
    }

    /// Marks chunk `c` landed and hands the hasher every chunk now
    /// contiguous with what it has.
    fn landed(&mut self, m: &Manifest, c: usize) {
        self.landed[c] = true;
        while self.next < self.landed.len() && self.landed[self.next] {
            let (off, len) = m.chunk(self.next);
            if let Some(tx) = &self.tx {
                // A hasher that ended early only costs the final pass.
                if tx.send((off as usize, len)).is_err() {
                    self.tx = None;
                }
            }
            self.next += 1;
        }
    }
}

/// Waits up to `timeout` for reads given up on to land; if some never do,
/// moves the bytes to fresh memory and buries the old region with the
/// agent, so nothing writes under them.
pub(super) fn drain(
    ar: &mut (Agent, Region),
    size: usize,
    timeout: Duration,
) -> Result<(), FabricError> {
    let deadline = Instant::now() + timeout;
    // Only reads into this region count: a reused agent may still wait on
    // reads an earlier load gave up on, into memory it buried.
    while ar.0.abandoned_on(&ar.1) > 0 && Instant::now() < deadline {
        ar.0.progress()?;
        std::thread::sleep(Duration::from_millis(1));
    }
    if ar.0.abandoned_on(&ar.1) > 0 {
        tracing::warn!(
            pending = ar.0.abandoned_on(&ar.1),
            "weights: reads given up on never completed; copying to fresh memory"
        );
        let mut fresh = ar.0.register(size)?;
        fresh.bytes_mut()[..size].copy_from_slice(&ar.1.bytes()[..size]);
        let old = std::mem::replace(&mut ar.1, fresh);
        ar.0.bury(old);
    }
    Ok(())
}

pub(super) fn thread(name: &str) -> std::thread::Builder {
    std::thread::Builder::new().name(name.into())
}

/// Whether chunks are checked against their own hashes as they land.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Checks {
    /// No: the whole file's hash decides, and only a file that fails it
    /// has its chunks checked (the first pass over every chunk).
    Deferred,
    /// Yes, each as it lands (passes that fetch chunks found wrong).
    Each,
}

/// Whether chunk `c` of the destination matches its hash.
pub(super) fn check(manifest: &Manifest, base: Base, c: usize) -> bool {
    let (off, len) = manifest.chunk(c);
    // SAFETY: nothing writes chunk `c` while it is checked (see `Fetch`;
    // a read given up on may still land, which the file's hash after the
    // drain catches).
    let bytes = unsafe { base.slice(off as usize, len) };
    chunk_ok(manifest, c, bytes)
}

/// The chunks `t`, `t + k`, `t + 2k`, … that do not match their hashes.
pub(super) fn wrong_in(manifest: &Manifest, base: Base, t: usize, k: usize) -> Vec<usize> {
    (t..manifest.chunks.len())
        .step_by(k)
        .filter(|&c| !check(manifest, base, c))
        .collect()
}

/// One load's bookkeeping: which sources are left, which failed which
/// chunk, where each chunk came from, and what each gave.
///
/// The destination is written through two paths, peer reads into the
/// registered region and [`Base`] slices for byte sources; at any time a
/// chunk is either waiting, being read, or landed, and only a waiting
/// chunk is written (a read given up on excepted: it is waited for before
/// the file is hashed, and a chunk it may have changed is not held
/// against its source).
pub(super) struct Fetch<'a> {
    pub(super) manifest: &'a Manifest,
    pub(super) opts: &'a LoadOptions,
    /// Each peer source's handle in the endpoint's address vector.
    pub(super) peers: &'a [Option<Peer>],
    /// Sources dropped for the rest of the load.
    pub(super) dead: Vec<bool>,
    /// Why each source gave nothing usable, for the error message.
    pub(super) why: Vec<Vec<String>>,
    /// The sources each chunk is not asked for again.
    pub(super) failed: Vec<HashSet<usize>>,
    /// The source each landed chunk came from.
    pub(super) from: Vec<Option<usize>>,
    /// Chunks a read given up on was aimed at: such a read may land late,
    /// over bytes another source gave, so a wrong chunk here does not
    /// blame the source it came from.
    pub(super) late: HashSet<usize>,
    /// Bytes each source gave.
    pub(super) given: Vec<u64>,
    pub(super) done_bytes: u64,
    pub(super) refetched: usize,
}

impl Fetch<'_> {
    /// Fetches every chunk, then, until the file hashes to its content
    /// hash, finds the chunks that are wrong and fetches them again.
    pub(super) fn run(
        &mut self,
        sources: &mut [Source],
        dest: &mut Dest,
        progress: &mut dyn FnMut(&LoadProgress),
        t0: Instant,
    ) -> Result<(), LoadError> {
        let size = self.manifest.size as usize;
        let n = self.manifest.chunks.len();
        let mut streamed = self.first_pass(sources, dest, progress, t0)?;
        let mut repairs = 0;
        loop {
            // Reads given up on may still land: they are waited for before
            // the bytes are judged (and if some never land, the bytes move
            // to fresh memory).
            if let Dest::Region(ar) = dest {
                drain(ar, size, self.opts.peer_timeout)?;
            }
            let got = match streamed.take() {
                Some(h) => h,
                None => hash(&dest.bytes()[..size]),
            };
            if got == self.manifest.sha256 {
                return Ok(());
            }
            tracing::warn!(
                got = %got.short(),
                want = %self.manifest.sha256.short(),
                "weights: the file's SHA-256 is not its content hash; checking each chunk"
            );
            let base = Base(dest.bytes_mut().as_mut_ptr());
            let wrong = self.sweep(sources, base);
            if wrong.is_empty() {
                return Err(LoadError::Mismatch {
                    got: got.hex(),
                    want: self.manifest.sha256.hex(),
                });
            }
            // Each repair drops the sources that gave a wrong chunk, so
            // this ends; the bound is for chunks that go wrong after they
            // were checked (a late read given up on).
            repairs += 1;
            if repairs > sources.len() + 1 {
                return Err(LoadError::Unsettled {
                    repairs: repairs - 1,
                    chunks: wrong.len(),
                });
            }
            let mut none = InOrder::idle(n);
            self.pass(
                sources,
                dest,
                base,
                wrong.into(),
                &mut none,
                progress,
                t0,
                Checks::Each,
            )?;
        }
    }

    /// Fetches every chunk, unchecked, while a second thread hashes the
    /// landed prefix as it grows; answers the whole file's hash where the
    /// hasher saw every byte in their final state.
    fn first_pass(
        &mut self,
        sources: &mut [Source],
        dest: &mut Dest,
        progress: &mut dyn FnMut(&LoadProgress),
        t0: Instant,
    ) -> Result<Option<ContentHash>, LoadError> {
        let n = self.manifest.chunks.len();
        let size = self.manifest.size as usize;
        let base = Base(dest.bytes_mut().as_mut_ptr());
        // Bounded by the chunk count: each chunk is sent at most once.
        let (tx, rx) = std::sync::mpsc::sync_channel::<(usize, usize)>(n.max(1));
        std::thread::scope(|sc| {
            // The hasher's sender lives in the scope's body, so the hasher
            // ends however the body does, a panic included.
            let mut whole = InOrder {
                tx: Some(tx),
                landed: vec![false; n],
                next: 0,
            };
            let hasher = thread("weights-hash")
                .spawn_scoped(sc, move || {
                    let mut h = Sha256::new();
                    let mut upto = 0usize;
                    for (off, len) in rx {
                        // SAFETY: a landed chunk, which nothing writes again
                        // while the hasher runs (a load whose reads were
                        // given up on stops feeding it).
                        h.update(unsafe { base.slice(off, len) });
                        upto = off + len;
                    }
                    (upto, ContentHash(h.finalize().into()))
                })
                .map_err(|e| LoadError::Thread(format!("the file's hasher: {e}")))?;
            let all = (0..n).collect();
            let r = self.pass(
                sources,
                dest,
                base,
                all,
                &mut whole,
                progress,
                t0,
                Checks::Deferred,
            );
            whole.tx = None;
            let hashed = hasher.join();
            r?;
            Ok(match hashed {
                Ok((upto, h)) if upto == size && whole.next == n => Some(h),
                _ => None,
            })
        })
    }

    /// Fetches `pending` in windows until every chunk has landed.
    #[allow(clippy::too_many_arguments)]
    fn pass(
        &mut self,
        sources: &mut [Source],
        dest: &mut Dest,
        base: Base,
        mut pending: VecDeque<usize>,
        whole: &mut InOrder,
        progress: &mut dyn FnMut(&LoadProgress),
        t0: Instant,
        checks: Checks,
    ) -> Result<(), LoadError> {
        while !pending.is_empty() {
            self.pace(t0);
            let window: Vec<usize> = (0..self.opts.window.max(1))
                .map_while(|_| pending.pop_front())
                .collect();
            let plan = self.plan(sources, &window)?;
            let mut landed = self.read_peers(sources, dest, &plan, &mut pending, whole);
            landed.extend(self.read_bytes(sources, base, &plan, &mut pending));
            landed.sort_unstable();
            for (c, s) in landed {
                if checks == Checks::Each && !check(self.manifest, base, c) {
                    self.blame(sources, c, s);
                    pending.push_front(c);
                    continue;
                }
                let len = self.manifest.chunk(c).1 as u64;
                self.from[c] = Some(s);
                whole.landed(self.manifest, c);
                self.given[s] += len;
                self.done_bytes += len;
                progress(&LoadProgress {
                    done: self.done_bytes,
                    total: self.manifest.size,
                    source: sources[s].name(),
                });
            }
        }
        Ok(())
    }

    /// Sleeps while the load is ahead of its byte rate.
    fn pace(&self, t0: Instant) {
        if let Some(rate) = self.opts.max_bytes_per_sec.filter(|r| *r > 0) {
            let due = Duration::from_secs_f64(self.done_bytes as f64 / rate as f64);
            if let Some(wait) = due.checked_sub(t0.elapsed()) {
                std::thread::sleep(wait);
            }
        }
    }

    /// A source for each chunk of `window`: the first live one that has
    /// not failed it, or, where that is a peer, the window's chunks spread
    /// over every such peer.
    fn plan(&self, sources: &[Source], window: &[usize]) -> Result<Vec<(usize, usize)>, LoadError> {
        let is_peer = |i: usize| matches!(sources[i], Source::Peer(_));
        window
            .iter()
            .map(|&c| {
                let ok = |i: usize| !self.dead[i] && !self.failed[c].contains(&i);
                let Some(first) = (0..sources.len()).find(|&i| ok(i)) else {
                    return Err(no_source(self.manifest, sources, &self.why));
                };
                if !is_peer(first) {
                    return Ok((c, first));
                }
                let live: Vec<usize> = (0..sources.len())
                    .filter(|&i| ok(i) && is_peer(i))
                    .collect();
                Ok((c, live[c % live.len()]))
            })
            .collect()
    }

    /// Reads the plan's peer chunks, all in flight at once, and on a
    /// failure again one at a time, to find who failed. Answers what
    /// landed; what did not goes back to `pending`.
    fn read_peers(
        &mut self,
        sources: &[Source],
        dest: &mut Dest,
        plan: &[(usize, usize)],
        pending: &mut VecDeque<usize>,
        whole: &mut InOrder,
    ) -> Vec<(usize, usize)> {
        let reads: Vec<(usize, usize)> = plan
            .iter()
            .copied()
            .filter(|&(_, s)| self.peers[s].is_some())
            .collect();
        if reads.is_empty() {
            return reads;
        }
        let Dest::Region(ar) = dest else {
            unreachable!("peers are inserted only with registered memory");
        };
        let (agent, region) = &mut **ar;
        let specs: Vec<_> = reads
            .iter()
            .map(|&(c, s)| {
                let Source::Peer(p) = &sources[s] else {
                    unreachable!("only peers have handles")
                };
                let (off, len) = self.manifest.chunk(c);
                (off, len, self.peers[s].expect("a peer's handle"), p.region)
            })
            .collect();
        let region: &Region = region;
        // A read's budget grows with its bytes (at 50 MB/s).
        let timeout = self.opts.peer_timeout;
        let budget = |bytes: usize| timeout.max(Duration::from_secs_f64(bytes as f64 / 50e6));
        let ops: Vec<WriteOp<'_>> = specs.iter().map(|sp| read_op(region, sp)).collect();
        let all = agent.read_all(&ops, budget(specs.iter().map(|sp| sp.1).sum()));
        drop(ops);
        if all.is_ok() {
            return reads;
        }
        // Reads given up on may land later, over bytes already handed to
        // the hasher: the file is hashed again at the end instead.
        whole.tx = None;
        self.late.extend(reads.iter().map(|&(c, _)| c));
        let mut landed = Vec::new();
        for (&(c, s), spec) in reads.iter().zip(&specs) {
            if self.dead[s] {
                pending.push_front(c);
                continue;
            }
            match agent.read(read_op(region, spec), budget(spec.1)) {
                Ok(()) => landed.push((c, s)),
                Err(e) => {
                    tracing::warn!(source = %sources[s].name(), chunk = c, error = %e, "weights: a peer read failed; trying another source");
                    self.dead[s] = true;
                    self.why[s].push(format!("read of chunk {c} failed: {e}"));
                    pending.push_front(c);
                    self.refetched += 1;
                }
            }
        }
        landed
    }

    /// Reads the plan's chunks from byte sources, in turn. Answers what
    /// landed; what did not goes back to `pending`.
    fn read_bytes(
        &mut self,
        sources: &mut [Source],
        base: Base,
        plan: &[(usize, usize)],
        pending: &mut VecDeque<usize>,
    ) -> Vec<(usize, usize)> {
        let mut landed = Vec::new();
        for &(c, s) in plan.iter().filter(|&&(_, s)| self.peers[s].is_none()) {
            let (off, len) = self.manifest.chunk(c);
            let Source::Bytes(b) = &mut sources[s] else {
                unreachable!("a peer without a handle is dead");
            };
            // SAFETY: chunk `c` has not landed, so the hasher never reads
            // it, and nothing else writes it (a peer read given up on
            // excepted, which the file's hash after the drain catches).
            let out = unsafe { base.slice_mut(off as usize, len) };
            match b.read_at(off, out) {
                Ok(()) => landed.push((c, s)),
                Err(e) => {
                    tracing::warn!(source = %b.name(), chunk = c, error = %e, "weights: a read failed; trying another source");
                    match e {
                        SourceError::Io(_) => {
                            self.failed[c].insert(s);
                        }
                        _ => self.dead[s] = true,
                    }
                    self.why[s].push(format!("chunk {c}: {e}"));
                    pending.push_front(c);
                    self.refetched += 1;
                }
            }
        }
        landed
    }

    /// Chunk `c`, from source `s`, does not match its hash: it is fetched
    /// again elsewhere, and a source that gave wrong bytes is not trusted
    /// again. Where a read given up on was aimed at the chunk, that read
    /// may have landed over the source's bytes, so the source is only not
    /// asked for this chunk again.
    fn blame(&mut self, sources: &[Source], c: usize, s: usize) {
        self.failed[c].insert(s);
        self.refetched += 1;
        if self.late.contains(&c) {
            tracing::warn!(source = %sources[s].name(), chunk = c, "weights: a chunk a late read may have landed on does not match its hash; fetching it again elsewhere");
            self.why[s].push(format!(
                "chunk {c} does not match its SHA-256 (a read given up on may have landed on it)"
            ));
            return;
        }
        tracing::warn!(source = %sources[s].name(), chunk = c, "weights: a chunk does not match its hash; fetching it again elsewhere");
        self.dead[s] = true;
        self.why[s].push(format!("chunk {c} does not match its SHA-256"));
    }

    /// Checks every landed chunk against its own hash, on up to 8 cores;
    /// answers those that do not match, no longer counted as landed and
    /// their sources blamed.
    fn sweep(&mut self, sources: &[Source], base: Base) -> Vec<usize> {
        let m = self.manifest;
        let n = m.chunks.len();
        let k = std::thread::available_parallelism()
            .map_or(1, |p| p.get())
            .clamp(1, 8)
            .min(n.max(1));
        // SAFETY (of the checks' slices): every read has landed or was
        // drained, so nothing writes the destination meanwhile.
        let mut wrong: Vec<usize> = std::thread::scope(|sc| {
            let helpers: Vec<_> = (1..k)
                .map(|t| {
                    let h =
                        thread("weights-sweep").spawn_scoped(sc, move || wrong_in(m, base, t, k));
                    (t, h)
                })
                .collect();
            let mut wrong = wrong_in(m, base, 0, k);
            for (t, h) in helpers {
                wrong.extend(match h {
                    Ok(h) => h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)),
                    // No thread: this one checks that share too.
                    Err(_) => wrong_in(m, base, t, k),
                });
            }
            wrong
        });
        wrong.sort_unstable();
        for &c in &wrong {
            let Some(s) = self.from[c].take() else {
                continue;
            };
            let len = m.chunk(c).1 as u64;
            self.given[s] -= len;
            self.done_bytes -= len;
            self.blame(sources, c, s);
        }
        wrong
    }
}

/// The read of one chunk (`offset`, `len`, `peer`, `remote`) into the same
/// offset of `region`.
pub(super) fn read_op<'a>(
    region: &'a Region,
    spec: &'a (u64, usize, Peer, RemoteRegion),
) -> WriteOp<'a> {
    let (off, len, peer, remote) = spec;
    WriteOp {
        local: region,
        offset: *off as usize,
        len: *len,
        peer: *peer,
        remote,
        remote_offset: *off,
        notify: None,
    }
}

pub(super) fn no_source(manifest: &Manifest, sources: &[Source], why: &[Vec<String>]) -> LoadError {
    LoadError::NoSource {
        model: manifest.model.clone(),
        sha: manifest.sha256.short(),
        tried: sources
            .iter()
            .zip(why)
            .map(|(s, w)| Tried {
                source: s.name(),
                why: if w.is_empty() {
                    "gave nothing".into()
                } else {
                    let mut w = w.clone();
                    w.dedup();
                    w.truncate(3);
                    w.join(", ")
                },
            })
            .collect(),
    }
}
