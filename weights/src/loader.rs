//! A verified load from an ordered list of sources.
//!
//! Chunks go in windows of [`LoadOptions::window`]. Each chunk goes to the
//! first source in order that is still alive and has not failed it; where
//! that is a peer, the window's chunks are spread over every live peer
//! that has not failed them, and all their reads are in flight at once.
//!
//! Invariants:
//! - a chunk counts as loaded only once its bytes match its hash in the
//!   manifest; a chunk that does not is fetched again from another source
//!   (the source that gave it is not asked for it again);
//! - a source that is gone (a dead peer, a missing file, a file of
//!   another size) is dropped for the rest of the load;
//! - before anything is handed out, the whole file's SHA-256 equals the
//!   manifest's content hash;
//! - chunks are checked on a thread of their own, one window behind the
//!   reads: a source found to give a wrong chunk may still be read in the
//!   next window, planned before the check came back; those chunks are
//!   checked like any other;
//! - with no source left for a chunk, the load fails naming every source
//!   tried and why.

use crate::manifest::{chunk_ok, ContentHash, Manifest};
use crate::source::{ByteSource, PeerSource, SourceError};
use bytes::Bytes;
use dynamo_transfer::{
    Agent, FabricError, FrozenRegion, HostBuffer, Peer, Region, RemoteRegion, WriteOp,
};
use sha2::{Digest, Sha256};
use std::collections::{HashSet, VecDeque};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};
use thiserror::Error;

/// One source of a load.
pub enum Source {
    Peer(PeerSource),
    Bytes(Box<dyn ByteSource>),
}

impl Source {
    pub fn name(&self) -> String {
        match self {
            Source::Peer(p) => format!("peer {}", p.name),
            Source::Bytes(b) => b.name(),
        }
    }
}

/// How a load runs.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// The libfabric provider peers are read over (theirs must match).
    pub provider: String,
    /// Chunks fetched at once.
    pub window: usize,
    /// Longest wait for one window of peer reads.
    pub peer_timeout: Duration,
    /// At most this many bytes a second on average (None: as fast as the
    /// sources go), so a load does not crowd out a serving node's traffic.
    pub max_bytes_per_sec: Option<u64>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            provider: "tcp;ofi_rxm".into(),
            window: 8,
            peer_timeout: Duration::from_secs(30),
            max_bytes_per_sec: None,
        }
    }
}

/// Progress of a load, after each verified chunk.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadProgress {
    pub done: u64,
    pub total: u64,
    /// The source of the chunk just verified.
    pub source: String,
}

/// One source a failed load tried, and why it gave nothing usable.
#[derive(Clone, Debug, PartialEq)]
pub struct Tried {
    pub source: String,
    pub why: String,
}

/// The list of what was tried, for an error message.
pub struct TriedList<'a>(pub &'a [Tried]);

impl fmt::Display for TriedList<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("no source was configured or advertised");
        }
        for (i, t) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{}: {}", t.source, t.why)?;
        }
        Ok(())
    }
}

#[derive(Debug, Error)]
pub enum LoadError {
    #[error("no source could provide {model} (sha256 {sha}): {}", TriedList(.tried))]
    NoSource {
        model: String,
        sha: String,
        tried: Vec<Tried>,
    },
    #[error("the chunks match the manifest but the file's SHA-256 is {got}, not {want}: the manifest is wrong")]
    Mismatch { got: String, want: String },
    #[error("fabric endpoint for peer reads: {0}")]
    Fabric(#[from] FabricError),
    /// The copy on the GPU does not hash to the content hash.
    #[error("the device copy's SHA-256 is {got}, not {want}")]
    DeviceMismatch { got: String, want: String },
    #[error("the manifest: {0}")]
    Manifest(crate::manifest::ManifestError),
    #[error("cannot allocate {bytes} bytes to load into: {why}")]
    Memory { bytes: u64, why: String },
    #[error("a loading thread: {0}")]
    Thread(String),
}

/// Where the bytes land.
enum Dest {
    /// Registered memory (peers can read into it, and it can be served).
    Region(Box<(Agent, Region)>),
    /// Memory of its own (no peer writes into it), on huge pages where
    /// large, as a region's is: touching fresh 4 KiB pages costs more
    /// than the load itself on some machines.
    Heap(HostBuffer),
}

impl Dest {
    fn bytes(&self) -> &[u8] {
        match self {
            Dest::Region(ar) => ar.1.bytes(),
            Dest::Heap(v) => v,
        }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Dest::Region(ar) => ar.1.bytes_mut(),
            Dest::Heap(v) => v,
        }
    }
}

/// The start of a load's destination, shared by the thread that fetches
/// chunks, the thread that checks them and the thread that hashes the
/// verified prefix; at any time each makes slices of ranges the others do
/// not write (see `fetch_all`: a chunk is pending, in the window being
/// read, or being checked, never two of these at once).
#[derive(Clone, Copy)]
struct Base(*mut u8);

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

/// The whole file's SHA-256, computed on a second thread over the
/// verified prefix as it grows, so hashing the file overlaps fetching and
/// checking the chunks after it.
struct InOrder {
    tx: Option<std::sync::mpsc::SyncSender<(usize, usize)>>,
    verified: Vec<bool>,
    next: usize,
}

impl InOrder {
    /// Marks chunk `c` verified and hands the hasher every chunk now
    /// contiguous with what it has.
    fn verified(&mut self, m: &Manifest, c: usize) {
        self.verified[c] = true;
        while self.next < self.verified.len() && self.verified[self.next] {
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

/// A finished, verified load.
pub struct Loaded {
    pub manifest: Manifest,
    dest: Dest,
    /// Bytes each source gave (verified), in the order of the sources.
    pub by_source: Vec<(String, u64)>,
    /// Chunks fetched again after a wrong or failed read.
    pub refetched: usize,
    pub elapsed: Duration,
}

impl Loaded {
    pub fn bytes(&self) -> &[u8] {
        &self.dest.bytes()[..self.manifest.size as usize]
    }

    /// The endpoint and registered memory the bytes are in, to serve them
    /// ([`crate::WeightServer::new`]); the load back for one without peers,
    /// which landed in memory of its own ([`HostBuffer`]).
    pub fn into_registered(self) -> Result<(Agent, Region, Manifest), Box<Loaded>> {
        match self.dest {
            Dest::Region(ar) => {
                let (a, r) = *ar;
                Ok((a, r, self.manifest))
            }
            dest => Err(Box::new(Loaded { dest, ..self })),
        }
    }

    /// The verified bytes, to be shared without a copy: an engine may keep
    /// them as its weights while they are written to a file and served to
    /// peers. Registered memory is frozen first (peers may read it, never
    /// write it), so nothing changes the bytes once they are shared.
    pub fn into_shared(self) -> Result<SharedLoad, LoadError> {
        let size = self.manifest.size as usize;
        let (bytes, registered) = match self.dest {
            Dest::Region(ar) => {
                let (mut agent, region) = *ar;
                let region = Arc::new(agent.freeze(region)?);
                let bytes = Bytes::from_owner(Held::Region(region.clone()));
                (bytes, Some((agent, region)))
            }
            Dest::Heap(b) => (Bytes::from_owner(Held::Heap(b)), None),
        };
        Ok(SharedLoad {
            manifest: self.manifest,
            bytes: bytes.slice(..size),
            registered,
            by_source: self.by_source,
            refetched: self.refetched,
            elapsed: self.elapsed,
        })
    }
}

/// A verified load's bytes, read-only, shared by whoever holds a clone of
/// [`SharedLoad::bytes`]; the memory is freed (and unregistered) when the
/// last holder, the load or a [`crate::WeightServer`] built from it, goes.
pub struct SharedLoad {
    pub manifest: Manifest,
    bytes: Bytes,
    registered: Option<(Agent, Arc<FrozenRegion>)>,
    /// As in [`Loaded`].
    pub by_source: Vec<(String, u64)>,
    pub refetched: usize,
    pub elapsed: Duration,
}

impl SharedLoad {
    /// Exactly the file's bytes, every one verified.
    pub fn bytes(&self) -> &Bytes {
        &self.bytes
    }

    /// The endpoint and registered memory the bytes are in, to serve them
    /// ([`crate::WeightServer::shared`]); `None` for a load without peers,
    /// which landed in memory no peer can read.
    pub fn into_registered(self) -> Option<(Agent, Arc<FrozenRegion>, Manifest)> {
        let (agent, region) = self.registered?;
        Some((agent, region, self.manifest))
    }
}

/// What shared weight bytes live in.
pub(crate) enum Held {
    Region(Arc<FrozenRegion>),
    Heap(HostBuffer),
}

impl AsRef<[u8]> for Held {
    fn as_ref(&self) -> &[u8] {
        match self {
            Held::Region(r) => r.bytes(),
            Held::Heap(b) => b,
        }
    }
}

/// Loads `manifest`'s file from `sources`, in their order of preference.
///
/// `reuse` is registered memory of an earlier load (its agent and region)
/// to land in again if it is large enough, instead of registering anew.
pub fn load(
    manifest: &Manifest,
    mut sources: Vec<Source>,
    opts: &LoadOptions,
    reuse: Option<(Agent, Region)>,
    progress: &mut dyn FnMut(&LoadProgress),
) -> Result<Loaded, LoadError> {
    let t0 = Instant::now();
    // A manifest off the bus is untrusted: its chunks must cover its size.
    manifest.validate().map_err(LoadError::Manifest)?;
    let n = manifest.chunks.len();
    let size = manifest.size as usize;
    let mut why: Vec<Vec<String>> = vec![Vec::new(); sources.len()];
    let mut dead = vec![false; sources.len()];
    // A byte source holding something of another size is not this file.
    for (i, s) in sources.iter_mut().enumerate() {
        if let Source::Bytes(b) = s {
            match b.size() {
                Ok(len) if len == manifest.size => {}
                Ok(len) => {
                    dead[i] = true;
                    why[i].push(format!(
                        "holds {len} bytes, not the {} of sha256 {}",
                        manifest.size,
                        manifest.sha256.short()
                    ));
                }
                Err(e) => {
                    dead[i] = true;
                    why[i].push(e.to_string());
                }
            }
        }
    }
    let has_peers = sources.iter().any(|s| matches!(s, Source::Peer(_)));
    let mut dest = match reuse {
        Some((a, r)) if r.bytes().len() >= size && a.provider() == opts.provider => {
            Dest::Region(Box::new((a, r)))
        }
        other => {
            drop(other);
            if has_peers {
                let mut a = Agent::new(&opts.provider)?;
                let r = a.register(size)?;
                Dest::Region(Box::new((a, r)))
            } else {
                Dest::Heap(HostBuffer::zeroed(size).map_err(|e| LoadError::Memory {
                    bytes: size as u64,
                    why: e.to_string(),
                })?)
            }
        }
    };
    // Peers in the endpoint's address vector (one that cannot be is gone).
    let mut peers: Vec<Option<Peer>> = vec![None; sources.len()];
    if let Dest::Region(ar) = &mut dest {
        let a = &mut ar.0;
        for (i, s) in sources.iter().enumerate() {
            if let Source::Peer(p) = s {
                if p.region.len < manifest.size {
                    dead[i] = true;
                    why[i].push(format!(
                        "advertises {} bytes, not {}",
                        p.region.len, manifest.size
                    ));
                    continue;
                }
                match a.insert_peer(&p.address) {
                    Ok(h) => peers[i] = Some(h),
                    Err(e) => {
                        dead[i] = true;
                        why[i].push(e.to_string());
                    }
                }
            }
        }
    }
    let base = Base(dest.bytes_mut().as_mut_ptr());
    let (tx, rx) = std::sync::mpsc::sync_channel::<(usize, usize)>(n.max(1));
    // A panic (in a progress callback, or a thread) gives the memory up as
    // an error does, then goes on unwinding.
    let scoped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        std::thread::scope(|sc| {
            // The hasher's sender lives in the scope's body, so the hasher ends
            // however the body does, a panic included.
            let mut whole = InOrder {
                tx: Some(tx),
                verified: vec![false; n],
                next: 0,
            };
            let hasher = thread("weights-hash").spawn_scoped(sc, move || {
                let mut h = Sha256::new();
                let mut upto = 0usize;
                for (off, len) in rx {
                    // SAFETY: a verified chunk, which nothing writes again
                    // while the hasher runs (a load whose reads were given up
                    // on stops feeding it).
                    h.update(unsafe { base.slice(off, len) });
                    upto = off + len;
                }
                (upto, ContentHash(h.finalize().into()))
            });
            let hasher =
                hasher.map_err(|e| LoadError::Thread(format!("the file's hasher: {e}")))?;
            let r = fetch_all(
                manifest,
                &mut sources,
                opts,
                &mut dest,
                &peers,
                &mut dead,
                &mut why,
                base,
                &mut whole,
                progress,
                t0,
            );
            whole.tx = None;
            let hashed = hasher.join();
            r.map(|(g, rf)| {
                let streamed = match hashed {
                    Ok((upto, h)) if upto == size && whole.next == n => Some(h),
                    _ => None,
                };
                (g, rf, streamed)
            })
        })
    }));
    let (given, refetched, streamed) = match scoped {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            give_up(dest);
            return Err(e);
        }
        Err(panic) => {
            give_up(dest);
            std::panic::resume_unwind(panic);
        }
    };
    // Reads given up on may still land: wait for them, and if some never
    // complete, move the verified bytes to fresh memory and leave the old
    // region to the agent until they do, so nothing writes under them.
    if let Dest::Region(ar) = &mut dest {
        if let Err(e) = drain(ar, size, opts.peer_timeout) {
            give_up(dest);
            return Err(e.into());
        }
    }
    // The hash streamed during the load, else (reads were given up on, or
    // the hasher did not finish) one pass now, over the final bytes.
    let got = match streamed {
        Some(h) => h,
        None => ContentHash(Sha256::digest(&dest.bytes()[..size]).into()),
    };
    if got != manifest.sha256 {
        return Err(LoadError::Mismatch {
            got: got.hex(),
            want: manifest.sha256.hex(),
        });
    }
    Ok(Loaded {
        manifest: manifest.clone(),
        dest,
        by_source: sources.iter().map(Source::name).zip(given).collect(),
        refetched,
        elapsed: t0.elapsed(),
    })
}

/// Waits up to `timeout` for reads given up on to land; if some never do,
/// moves the bytes to fresh memory and buries the old region with the
/// agent, so nothing writes under them.
fn drain(ar: &mut (Agent, Region), size: usize, timeout: Duration) -> Result<(), FabricError> {
    let deadline = Instant::now() + timeout;
    while ar.0.abandoned_ops() > 0 && Instant::now() < deadline {
        ar.0.progress()?;
        std::thread::sleep(Duration::from_millis(1));
    }
    if ar.0.abandoned_ops() > 0 {
        tracing::warn!(
            pending = ar.0.abandoned_ops(),
            "weights: reads given up on never completed; copying to fresh memory"
        );
        let mut fresh = ar.0.register(size)?;
        fresh.bytes_mut()[..size].copy_from_slice(&ar.1.bytes()[..size]);
        let old = std::mem::replace(&mut ar.1, fresh);
        ar.0.bury(old);
    }
    Ok(())
}

/// Drops a failed load's memory, except registered memory that reads
/// given up on may still write: that stays with its endpoint, which never
/// frees it ([`Agent::bury`]).
fn give_up(dest: Dest) {
    if let Dest::Region(ar) = dest {
        let (mut agent, region) = *ar;
        agent.bury(region);
    }
}

fn thread(name: &str) -> std::thread::Builder {
    std::thread::Builder::new().name(name.into())
}

/// Checks chunk `c` (given by source `s`) against its hash.
fn check(manifest: &Manifest, base: Base, (c, s): (usize, usize)) -> (usize, usize, bool) {
    let (off, len) = manifest.chunk(c);
    // SAFETY: nothing writes chunk `c` while it is checked (see
    // `fetch_all`).
    let bytes = unsafe { base.slice(off as usize, len) };
    (c, s, chunk_ok(manifest, c, bytes))
}

/// Fetches and checks every chunk (the body of [`load`]); answers the
/// bytes each source gave and the chunks fetched again.
#[allow(clippy::too_many_arguments)]
fn fetch_all(
    manifest: &Manifest,
    sources: &mut [Source],
    opts: &LoadOptions,
    dest: &mut Dest,
    peers: &[Option<Peer>],
    dead: &mut [bool],
    why: &mut [Vec<String>],
    base: Base,
    whole: &mut InOrder,
    progress: &mut dyn FnMut(&LoadProgress),
    t0: Instant,
) -> Result<(Vec<u64>, usize), LoadError> {
    let n = manifest.chunks.len();
    let mut failed: Vec<HashSet<usize>> = vec![HashSet::new(); n];
    let mut given = vec![0u64; sources.len()];
    let mut pending: VecDeque<usize> = (0..n).collect();
    let mut done_bytes = 0u64;
    let mut refetched = 0usize;
    // Chunks are checked on a thread of their own, one window behind the
    // fetching, so the next window's reads overlap the last one's hashing.
    // A window's chunks are neither pending nor written while checked:
    // one that fails goes back to `pending` only once its check is back.
    // Once a read was given up on, it may land during any later progress
    // call, even in a chunk fetched again since: from then on chunks are
    // checked here, between progress calls, and the file is hashed again
    // at the end (see `load`).
    let (job_tx, job_rx) = std::sync::mpsc::sync_channel::<Vec<(usize, usize)>>(1);
    let (res_tx, res_rx) = std::sync::mpsc::sync_channel::<Vec<(usize, usize, bool)>>(1);
    std::thread::scope(|sc| {
        // Owned by the scope's body, so the checker ends when the body does.
        let (job_tx, res_rx) = (job_tx, res_rx);
        let checker = thread("weights-check")
            .spawn_scoped(sc, move || {
                for batch in job_rx {
                    let checked = batch
                        .into_iter()
                        .map(|j| check(manifest, base, j))
                        .collect();
                    if res_tx.send(checked).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| LoadError::Thread(format!("the chunk checker: {e}")))?;
        let stopped = || LoadError::Thread("the chunk checker stopped".into());
        let mut gave_up = false;
        let mut checking = false;
        let run = (|| -> Result<(), LoadError> {
            while !pending.is_empty() || checking {
                if let Some(rate) = opts.max_bytes_per_sec.filter(|r| *r > 0) {
                    let due = Duration::from_secs_f64(done_bytes as f64 / rate as f64);
                    if let Some(wait) = due.checked_sub(t0.elapsed()) {
                        std::thread::sleep(wait);
                    }
                }
                let window: Vec<usize> = (0..opts.window.max(1))
                    .map_while(|_| pending.pop_front())
                    .collect();
                // Assign each chunk a source.
                let mut plan: Vec<(usize, usize)> = Vec::with_capacity(window.len());
                for &c in &window {
                    let ok = |i: usize| !dead[i] && !failed[c].contains(&i);
                    let Some(first) = (0..sources.len()).find(|&i| ok(i)) else {
                        return Err(no_source(manifest, sources, why));
                    };
                    let s = if matches!(sources[first], Source::Peer(_)) {
                        let live: Vec<usize> = (0..sources.len())
                            .filter(|&i| ok(i) && matches!(sources[i], Source::Peer(_)))
                            .collect();
                        live[c % live.len()]
                    } else {
                        first
                    };
                    plan.push((c, s));
                }
                // Peer reads, all in flight at once.
                let reads: Vec<(usize, usize)> = plan
                    .iter()
                    .copied()
                    .filter(|&(_, s)| peers[s].is_some())
                    .collect();
                let mut fetched: Vec<(usize, usize)> = Vec::new();
                if !reads.is_empty() {
                    let Dest::Region(ar) = dest else {
                        unreachable!("peers are inserted only with registered memory");
                    };
                    let (agent, region) = &mut **ar;
                    let op = |&(c, s): &(usize, usize)| {
                        let Source::Peer(p) = &sources[s] else {
                            unreachable!("only peers have handles")
                        };
                        let (off, len) = manifest.chunk(c);
                        (off, len, peers[s].expect("a peer's handle"), p.region)
                    };
                    let specs: Vec<_> = reads.iter().map(op).collect();
                    let region: &Region = region;
                    let ops: Vec<WriteOp<'_>> =
                        specs.iter().map(|sp| read_op(region, sp)).collect();
                    // The window's budget grows with its bytes (at 50 MB/s).
                    let bytes: usize = specs.iter().map(|sp| sp.1).sum();
                    let budget = opts
                        .peer_timeout
                        .max(Duration::from_secs_f64(bytes as f64 / 50e6));
                    let all = agent.read_all(&ops, budget);
                    drop(ops);
                    match all {
                        Ok(()) => fetched.extend(reads.iter().copied()),
                        Err(_) => {
                            // Reads given up on may land later, over bytes
                            // already handed to the hasher: the file is hashed
                            // again at the end instead.
                            whole.tx = None;
                            gave_up = true;
                            // One at a time, to find who failed.
                            for (&(c, s), spec) in reads.iter().zip(&specs) {
                                if dead[s] {
                                    pending.push_front(c);
                                    continue;
                                }
                                let budget = opts
                                    .peer_timeout
                                    .max(Duration::from_secs_f64(spec.1 as f64 / 50e6));
                                match agent.read(read_op(region, spec), budget) {
                                    Ok(()) => fetched.push((c, s)),
                                    Err(e) => {
                                        tracing::warn!(source = %sources[s].name(), chunk = c, error = %e, "weights: a peer read failed; trying another source");
                                        dead[s] = true;
                                        why[s].push(format!("read of chunk {c} failed: {e}"));
                                        pending.push_front(c);
                                        refetched += 1;
                                    }
                                }
                            }
                        }
                    }
                }
                // Byte sources, in turn.
                for &(c, s) in plan.iter().filter(|&&(_, s)| peers[s].is_none()) {
                    let (off, len) = manifest.chunk(c);
                    let Source::Bytes(b) = &mut sources[s] else {
                        unreachable!("a peer without a handle is dead");
                    };
                    // SAFETY: chunk `c` is not verified, so the hasher never reads it.
                    let out = unsafe { base.slice_mut(off as usize, len) };
                    match b.read_at(off, out) {
                        Ok(()) => fetched.push((c, s)),
                        Err(e) => {
                            tracing::warn!(source = %b.name(), chunk = c, error = %e, "weights: a read failed; trying another source");
                            match e {
                                SourceError::Io(_) => {
                                    failed[c].insert(s);
                                }
                                _ => dead[s] = true,
                            }
                            why[s].push(format!("chunk {c}: {e}"));
                            pending.push_front(c);
                            refetched += 1;
                        }
                    }
                }
                // The last window's checks, then this one's handed over.
                let mut checked = if checking {
                    checking = false;
                    res_rx.recv().map_err(|_| stopped())?
                } else {
                    Vec::new()
                };
                fetched.sort_unstable();
                if gave_up {
                    checked.extend(fetched.into_iter().map(|j| check(manifest, base, j)));
                } else if !fetched.is_empty() {
                    job_tx.send(fetched).map_err(|_| stopped())?;
                    checking = true;
                }
                for (c, s, ok) in checked {
                    let len = manifest.chunk(c).1;
                    if ok {
                        whole.verified(manifest, c);
                        given[s] += len as u64;
                        done_bytes += len as u64;
                        progress(&LoadProgress {
                            done: done_bytes,
                            total: manifest.size,
                            source: sources[s].name(),
                        });
                    } else {
                        // A source that gave wrong bytes is not trusted again.
                        tracing::warn!(source = %sources[s].name(), chunk = c, "weights: a chunk does not match its hash; fetching it again elsewhere");
                        failed[c].insert(s);
                        dead[s] = true;
                        why[s].push(format!("chunk {c} does not match its SHA-256"));
                        pending.push_front(c);
                        refetched += 1;
                    }
                }
            }
            Ok(())
        })();
        // The checker ends with its queue, and one that panicked is an
        // error (however the loop ended), not a second panic.
        drop(job_tx);
        drop(res_rx);
        if checker.join().is_err() {
            return Err(LoadError::Thread("the chunk checker panicked".into()));
        }
        run.map(|()| (given, refetched))
    })
}

/// The read of one chunk (`offset`, `len`, `peer`, `remote`) into the same
/// offset of `region`.
fn read_op<'a>(region: &'a Region, spec: &'a (u64, usize, Peer, RemoteRegion)) -> WriteOp<'a> {
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

fn no_source(manifest: &Manifest, sources: &[Source], why: &[Vec<String>]) -> LoadError {
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
