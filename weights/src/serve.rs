//! Weights held in registered memory, readable by peers.
//!
//! Invariants: the region holds exactly the manifest's bytes (checked
//! against its content hash when built from a file); it stays registered,
//! and its endpoint progressed, for as long as the server lives, so an
//! advertised descriptor is readable until the server is dropped.

use crate::loader::Held;
use crate::manifest::{hash, Manifest};
use crate::source::PeerSource;
use dynamo_transfer::{Agent, FabricError, FrozenRegion, Progress, Region, RemoteRegion};
use serde::{Deserialize, Serialize};
use std::io::Read;
use std::path::Path;
use std::sync::Arc;

/// What a peer needs to read served weights: the wire form of a
/// [`PeerSource`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerDescriptor {
    /// The libfabric provider (`tcp;ofi_rxm`, `shm`): a reader needs an
    /// endpoint on the same one.
    pub provider: String,
    /// The endpoint address, hex.
    pub address: String,
    pub region: RemoteRegion,
}

impl PeerDescriptor {
    /// The source for a loader, named `name`; `None` if the address is
    /// not hex.
    pub fn source(&self, name: &str) -> Option<PeerSource> {
        Some(PeerSource {
            name: name.to_string(),
            address: hex::decode(&self.address).ok()?,
            region: self.region,
        })
    }
}

/// A file read into memory registered for peers, frozen, and not served
/// yet: its bytes can be shared at once (an engine computes with them)
/// while the file's manifest is found, and [`SharedFile::serve`] then
/// serves that same memory, so a node holds one copy of the file.
pub struct SharedFile {
    agent: Agent,
    region: Arc<FrozenRegion>,
    bytes: bytes::Bytes,
    meta: std::fs::Metadata,
}

impl SharedFile {
    /// Reads `path` whole. Fails if the file changes while it is read, or
    /// if the path names another file afterwards (its size, modification
    /// or change time, device or inode differ), since a manifest of it
    /// would then describe other bytes.
    pub fn read(path: &Path, provider: &str) -> Result<Self, ServeError> {
        let io = |e: std::io::Error| ServeError::Io {
            path: path.display().to_string(),
            message: e.to_string(),
        };
        let mut f = std::fs::File::open(path).map_err(io)?;
        let before = f.metadata().map_err(io)?;
        let len = usize::try_from(before.len()).map_err(|_| ServeError::Io {
            path: path.display().to_string(),
            message: format!("{} bytes do not fit in memory", before.len()),
        })?;
        let mut agent = Agent::new(provider)?;
        let mut region = agent.register(len)?;
        f.read_exact(&mut region.bytes_mut()[..len]).map_err(io)?;
        let after = std::fs::metadata(path).map_err(io)?;
        let id = |m: &std::fs::Metadata| {
            use std::os::unix::fs::MetadataExt;
            (
                m.dev(),
                m.ino(),
                m.len(),
                m.mtime(),
                m.mtime_nsec(),
                m.ctime(),
                m.ctime_nsec(),
            )
        };
        if id(&after) != id(&before) {
            return Err(ServeError::Io {
                path: path.display().to_string(),
                message: "the file changed while it was read".into(),
            });
        }
        let region = Arc::new(agent.freeze(region)?);
        let bytes = bytes::Bytes::from_owner(Held::Region(region.clone())).slice(..len);
        Ok(SharedFile {
            agent,
            region,
            bytes,
            meta: before,
        })
    }

    /// The file's bytes; a clone shares them.
    pub fn bytes(&self) -> &bytes::Bytes {
        &self.bytes
    }

    /// The file's metadata when it was read (for
    /// [`crate::manifest::of_bytes_cached`]).
    pub fn metadata(&self) -> &std::fs::Metadata {
        &self.meta
    }

    /// Serves the memory as `manifest`'s file (its size is checked; its
    /// hash is trusted, as [`WeightServer::from_known_file`] trusts it).
    pub fn serve(self, manifest: Manifest) -> Result<WeightServer, ServeError> {
        if manifest.size != self.bytes.len() as u64 {
            return Err(ServeError::Mismatch {
                path: "the file read".into(),
                got: format!("{} bytes", self.bytes.len()),
                want: format!("{} bytes", manifest.size),
            });
        }
        WeightServer::shared(self.agent, self.region, manifest)
    }
}

/// Serves one file's bytes to peers.
///
/// Fields drop in order: the progress thread (and with it the endpoint's
/// service) stops before the server lets go of the region. The region is
/// frozen (peers may read it, never write it); it is closed and freed once
/// its last holder, the server or an engine sharing the bytes, is gone.
pub struct WeightServer {
    progress: Progress,
    /// Frozen: peers may read it, never write it. Shared where an engine
    /// keeps the same bytes as its weights.
    region: Arc<FrozenRegion>,
    manifest: Manifest,
    provider: String,
    address: Vec<u8>,
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("fabric: {0}")]
    Fabric(FabricError),
    #[error("reading {path}: {message}")]
    Io { path: String, message: String },
    #[error("{path} is not the manifest's file: SHA-256 {got}, expected {want}")]
    Mismatch {
        path: String,
        got: String,
        want: String,
    },
    #[error("the progress thread did not start: {message}")]
    Thread { message: String },
}

// Not `#[from]`: the message already shows the cause, and a source would
// print it twice in a chain (`{:#}`).
impl From<FabricError> for ServeError {
    fn from(e: FabricError) -> Self {
        ServeError::Fabric(e)
    }
}

impl WeightServer {
    /// Registers memory for `path`, reads the file into it and checks it
    /// against `manifest`.
    pub fn from_file(path: &Path, manifest: Manifest, provider: &str) -> Result<Self, ServeError> {
        Self::read_file(path, manifest, provider, true)
    }

    /// The same for a manifest known to describe this very file (computed
    /// from it, or cached for its path, size and modification time): its
    /// size is checked, its bytes are not hashed again. Readers verify
    /// every chunk whatever the server holds.
    pub fn from_known_file(
        path: &Path,
        manifest: Manifest,
        provider: &str,
    ) -> Result<Self, ServeError> {
        Self::read_file(path, manifest, provider, false)
    }

    fn read_file(
        path: &Path,
        manifest: Manifest,
        provider: &str,
        check: bool,
    ) -> Result<Self, ServeError> {
        let file = SharedFile::read(path, provider)?;
        let len = file.bytes().len() as u64;
        if len != manifest.size {
            return Err(ServeError::Mismatch {
                path: path.display().to_string(),
                got: format!("{len} bytes"),
                want: format!("{} bytes", manifest.size),
            });
        }
        let got = if check {
            hash(file.bytes())
        } else {
            manifest.sha256
        };
        if got != manifest.sha256 {
            return Err(ServeError::Mismatch {
                path: path.display().to_string(),
                got: got.hex(),
                want: manifest.sha256.hex(),
            });
        }
        file.serve(manifest)
    }

    /// Serves `region` (holding `manifest`'s verified bytes), registered on
    /// `agent`; it is frozen first, so peers may read it and never write it.
    pub fn new(mut agent: Agent, region: Region, manifest: Manifest) -> Result<Self, ServeError> {
        let region = Arc::new(agent.freeze(region)?);
        Self::shared(agent, region, manifest)
    }

    /// Serves a frozen region registered on `agent` (one that others, an
    /// engine, may read too; see [`crate::SharedLoad`]).
    pub fn shared(
        agent: Agent,
        region: Arc<FrozenRegion>,
        manifest: Manifest,
    ) -> Result<Self, ServeError> {
        let provider = agent.provider().to_string();
        let address = agent.address()?;
        let progress = Progress::spawn_read_target(agent).map_err(|e| ServeError::Thread {
            message: e.to_string(),
        })?;
        Ok(WeightServer {
            manifest,
            region,
            provider,
            address,
            progress,
        })
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The file's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.region.bytes()[..self.manifest.size as usize]
    }

    pub fn descriptor(&self) -> PeerDescriptor {
        let mut region = self.region.remote();
        region.len = self.manifest.size;
        PeerDescriptor {
            provider: self.provider.clone(),
            address: hex::encode(&self.address),
            region,
        }
    }

    /// Stops serving (the region is closed after the endpoint stops, or
    /// once its other holders are gone where it is shared).
    pub fn stop(self) -> Result<(), FabricError> {
        let WeightServer {
            progress, region, ..
        } = self;
        let r = progress.stop();
        drop(region);
        r
    }
}
