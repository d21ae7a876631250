//! Weights held in registered memory, readable by peers.
//!
//! Invariants: the region holds exactly the manifest's bytes (checked
//! against its content hash when built from a file); it stays registered,
//! and its endpoint progressed, for as long as the server lives, so an
//! advertised descriptor is readable until the server is dropped.

use crate::manifest::{hash, Manifest};
use crate::source::PeerSource;
use dynamo_transfer::{Agent, FabricError, Progress, Region, RemoteRegion};
use serde::{Deserialize, Serialize};
use std::io::Read;
use std::path::Path;

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

/// Serves one file's bytes to peers.
pub struct WeightServer {
    manifest: Manifest,
    region: Region,
    provider: String,
    address: Vec<u8>,
    progress: Progress,
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("fabric: {0}")]
    Fabric(#[from] FabricError),
    #[error("reading {path}: {message}")]
    Io { path: String, message: String },
    #[error("{path} is not the manifest's file: SHA-256 {got}, expected {want}")]
    Mismatch {
        path: String,
        got: String,
        want: String,
    },
    #[error("the progress thread: {0}")]
    Thread(String),
}

impl WeightServer {
    /// Registers memory for `path`, reads the file into it and checks it
    /// against `manifest`.
    pub fn from_file(path: &Path, manifest: Manifest, provider: &str) -> Result<Self, ServeError> {
        let io = |e: std::io::Error| ServeError::Io {
            path: path.display().to_string(),
            message: e.to_string(),
        };
        let mut agent = Agent::new(provider)?;
        let mut region = agent.register(manifest.size as usize)?;
        let mut f = std::fs::File::open(path).map_err(io)?;
        let len = f.metadata().map_err(io)?.len();
        if len != manifest.size {
            return Err(ServeError::Mismatch {
                path: path.display().to_string(),
                got: format!("{len} bytes"),
                want: format!("{} bytes", manifest.size),
            });
        }
        f.read_exact(&mut region.bytes_mut()[..len as usize])
            .map_err(io)?;
        let got = hash(&region.bytes()[..len as usize]);
        if got != manifest.sha256 {
            return Err(ServeError::Mismatch {
                path: path.display().to_string(),
                got: got.hex(),
                want: manifest.sha256.hex(),
            });
        }
        Self::new(agent, region, manifest)
    }

    /// Serves `region` (holding `manifest`'s verified bytes), registered on
    /// `agent`.
    pub fn new(agent: Agent, region: Region, manifest: Manifest) -> Result<Self, ServeError> {
        let provider = agent.provider().to_string();
        let address = agent.address()?;
        let progress = Progress::spawn(agent).map_err(|e| ServeError::Thread(e.to_string()))?;
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

    /// Stops serving (the region is closed after the endpoint stops).
    pub fn stop(self) -> Result<(), FabricError> {
        let WeightServer {
            progress, region, ..
        } = self;
        let r = progress.stop();
        drop(region);
        r
    }
}
