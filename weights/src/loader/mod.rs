//! A verified load from an ordered list of sources.
//!
//! Chunks go in windows of [`LoadOptions::window`]. Each chunk goes to the
//! first source in order that is still alive and has not failed it; where
//! that is a peer, the window's chunks are spread over every live peer
//! that has not failed them, and all their reads are in flight at once.
//!
//! Verification costs one SHA-256 pass over the file when nothing is
//! wrong. The file's hash is its identity, so it alone decides; each
//! chunk's own hash in the manifest serves to find a fault, not to prove
//! the file. A pass that checked every chunk as well would hash every
//! byte twice, and on a machine with few cores hashing is what a load
//! waits for.
//!
//! Invariants:
//! - nothing is handed out before the whole file's SHA-256 equals the
//!   manifest's content hash;
//! - the first pass takes chunks as they land, and a second thread hashes
//!   the landed prefix as it grows;
//! - where the file's hash differs, every chunk is checked against its own
//!   hash (on up to 8 cores); a chunk that does not match is fetched again
//!   from another source and checked as it lands, and the source that gave
//!   it is dropped; then the file is hashed again. Chunks that all match
//!   under a different file hash mean the manifest is wrong
//!   ([`LoadError::Mismatch`]);
//! - a source that is gone (a dead peer, a missing file, a file of
//!   another size) is dropped for the rest of the load;
//! - reads given up on are waited for (or the bytes moved away from them)
//!   before the bytes are judged;
//! - with no source left for a chunk, the load fails naming every source
//!   tried and why.

mod fetch;

use crate::manifest::Manifest;
use crate::source::{ByteSource, PeerSource};
use bytes::Bytes;
use dynamo_transfer::{Agent, FabricError, FrozenRegion, HostBuffer, Peer, Region};
use fetch::Fetch;
use std::collections::HashSet;
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

/// Progress of a load, after each chunk lands. `done` counts bytes landed,
/// not verified: the file is verified once every chunk has landed, and
/// where that finds wrong chunks, `done` goes back down by their bytes
/// and up again as they are fetched again.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadProgress {
    pub done: u64,
    pub total: u64,
    /// The source of the chunk that just landed.
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
    /// Chunks kept going wrong after they were fetched again and checked
    /// (reads given up on that land late).
    #[error("the file's SHA-256 still differs from its content hash after {repairs} repairs ({chunks} chunks wrong in the last check)")]
    Unsettled { repairs: usize, chunks: usize },
    #[error("fabric endpoint for peer reads: {0}")]
    Fabric(FabricError),
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

// Not `#[from]`: the message already shows the cause, and a source would
// print it twice in a chain (`{:#}`).
impl From<FabricError> for LoadError {
    fn from(e: FabricError) -> Self {
        LoadError::Fabric(e)
    }
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
    let mut f = Fetch {
        manifest,
        opts,
        peers: &peers,
        dead,
        why,
        failed: vec![HashSet::new(); n],
        from: vec![None; n],
        late: HashSet::new(),
        given: vec![0; sources.len()],
        done_bytes: 0,
        refetched: 0,
    };
    // A panic (in a progress callback, or a thread) gives the memory up as
    // an error does, then goes on unwinding.
    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        f.run(&mut sources, &mut dest, progress, t0)
    }));
    match run {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            give_up(dest);
            return Err(e);
        }
        Err(panic) => {
            give_up(dest);
            std::panic::resume_unwind(panic);
        }
    }
    Ok(Loaded {
        manifest: manifest.clone(),
        dest,
        by_source: sources.iter().map(Source::name).zip(f.given).collect(),
        refetched: f.refetched,
        elapsed: t0.elapsed(),
    })
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
