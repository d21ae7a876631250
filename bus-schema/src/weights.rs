//! Wire types of weight loading: the manifest of a weight file (named by
//! its content), and the record of a node that serves it.
//!
//! Invariants of a [`WeightManifest`] that passed
//! [`WeightManifest::validate`]: `chunk_size` is within
//! [`MIN_CHUNK`]..=[`MAX_CHUNK`]; there are exactly
//! `ceil(size / chunk_size)` chunk hashes, at most [`MAX_CHUNKS`], so a
//! manifest fits one message; only the last chunk may be short. A
//! [`WeightSource`]'s address is at most [`MAX_FABRIC_ADDRESS`] bytes.

use crate::codec::{MessageKind, WireMessage};
use crate::ids::NodeId;
use serde::{Deserialize, Serialize};
use std::fmt;
use thiserror::Error;

/// Smallest chunk (1 MiB).
pub const MIN_CHUNK: u64 = 1 << 20;
/// Default chunk (4 MiB): enough reads in flight to fill a link, few
/// enough hashes to keep the manifest small.
pub const DEFAULT_CHUNK: u64 = 4 << 20;
/// Largest chunk (1 GiB).
pub const MAX_CHUNK: u64 = 1 << 30;
/// Most chunks in one manifest (a 4 TiB file at 1 GiB chunks; 270 KB as
/// hex).
pub const MAX_CHUNKS: usize = 4096;
/// Longest libfabric endpoint address carried.
pub const MAX_FABRIC_ADDRESS: usize = 256;

macro_rules! wire {
    ($ty:ident = $kind:literal) => {
        impl WireMessage for $ty {
            const KIND: MessageKind = MessageKind($kind);
            const NAME: &'static str = stringify!($ty);
        }
    };
}

#[derive(Debug, Error, PartialEq)]
pub enum ManifestError {
    #[error("`{field}`: {message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
}

fn invalid(field: &'static str, message: impl Into<String>) -> ManifestError {
    ManifestError::Invalid {
        field,
        message: message.into(),
    }
}

/// A SHA-256, shown and carried as 64 lowercase hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContentHash(pub [u8; 32]);

impl ContentHash {
    pub fn parse(s: &str) -> Result<Self, ManifestError> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out)
            .map_err(|e| invalid("sha256", format!("{s:?} is not 64 hex digits: {e}")))?;
        Ok(ContentHash(out))
    }
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }
    /// The first 12 hex digits, for logs and tables.
    pub fn short(&self) -> String {
        self.hex()[..12].to_string()
    }
}

impl fmt::Display for ContentHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.hex())
    }
}

impl fmt::Debug for ContentHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ContentHash({})", self.short())
    }
}

impl Serialize for ContentHash {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.hex())
    }
}

impl<'de> Deserialize<'de> for ContentHash {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        ContentHash::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// What a loader needs to know of a file before it has any of it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightManifest {
    /// The model's served name (`smollm2-135m-instruct`).
    pub model: String,
    /// The SHA-256 of the whole file: its identity.
    pub sha256: ContentHash,
    /// How the bytes are laid out (`gguf`).
    pub layout: String,
    pub size: u64,
    pub chunk_size: u64,
    /// The SHA-256 of each chunk, in order.
    pub chunks: Vec<ContentHash>,
}
wire!(WeightManifest = 120);

/// The chunk size for a file of `size` bytes: [`DEFAULT_CHUNK`], or larger
/// (a power of two) where that would make more than [`MAX_CHUNKS`].
pub fn chunk_size_for(size: u64) -> u64 {
    let mut c = DEFAULT_CHUNK;
    while c < MAX_CHUNK && size.div_ceil(c) > MAX_CHUNKS as u64 {
        c *= 2;
    }
    c
}

impl WeightManifest {
    /// Checks the invariants (a manifest read off the bus is untrusted).
    pub fn validate(&self) -> Result<(), ManifestError> {
        if self.model.is_empty() || self.model.len() > 256 {
            return Err(invalid("model", "must be 1-256 bytes"));
        }
        if self.layout.is_empty() || self.layout.len() > 64 {
            return Err(invalid("layout", "must be 1-64 bytes"));
        }
        if !(MIN_CHUNK..=MAX_CHUNK).contains(&self.chunk_size) {
            return Err(invalid(
                "chunk_size",
                format!("{} is outside {MIN_CHUNK}..={MAX_CHUNK}", self.chunk_size),
            ));
        }
        let want = self.size.div_ceil(self.chunk_size);
        if want > MAX_CHUNKS as u64 {
            return Err(invalid(
                "size",
                format!(
                    "{} bytes make {want} chunks (at most {MAX_CHUNKS})",
                    self.size
                ),
            ));
        }
        if self.chunks.len() as u64 != want {
            return Err(invalid(
                "chunks",
                format!(
                    "{} hashes for {} bytes in chunks of {} ({want} expected)",
                    self.chunks.len(),
                    self.size,
                    self.chunk_size
                ),
            ));
        }
        Ok(())
    }

    /// Offset and length of chunk `i` (`i` < the number of chunks).
    pub fn chunk(&self, i: usize) -> (u64, usize) {
        let off = i as u64 * self.chunk_size;
        (off, self.chunk_size.min(self.size - off) as usize)
    }

    /// The key of a manifest in the weights bucket.
    pub fn key(sha256: &ContentHash) -> String {
        format!("manifest.{}", sha256.hex())
    }
}

/// Where a node is with the weights it advertises.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum WeightSourceState {
    /// Loading them (not readable yet).
    Loading,
    /// Holding them, verified, in memory peers may read.
    Ready,
    /// A state this build does not know.
    #[serde(other)]
    Unknown,
}

/// A node's advertisement of weights it serves (key
/// `source.<sha256>.<node>` in the weights bucket, rewritten every
/// heartbeat; a reader reaps a record that stopped being rewritten, and a
/// node that stops withdraws its records).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightSource {
    pub node: NodeId,
    pub model: String,
    pub sha256: ContentHash,
    pub layout: String,
    pub size: u64,
    pub state: WeightSourceState,
    /// Bytes loaded so far, verified once all are (`size` once ready).
    pub loaded_bytes: u64,
    /// The libfabric provider its endpoint is on.
    pub provider: String,
    /// Its endpoint address.
    pub address: Vec<u8>,
    /// The registered region holding the file from offset 0.
    pub region_key: u64,
    pub region_base: u64,
    /// When it was written (Unix ms).
    pub updated_unix_ms: u64,
}
wire!(WeightSource = 121);

impl WeightSource {
    /// Its key in the weights bucket.
    pub fn key(&self) -> String {
        Self::key_of(&self.sha256, &self.node)
    }

    /// The key of `node`'s record for `sha256`.
    pub fn key_of(sha256: &ContentHash, node: &NodeId) -> String {
        format!(
            "source.{}.{}",
            sha256.hex(),
            crate::subjects::subject_token(&node.0)
        )
    }

    /// Checks what a receiver relies on.
    pub fn validate(&self) -> Result<(), ManifestError> {
        // A loading node has no readable region yet, so no address.
        let need = self.state == WeightSourceState::Ready;
        if (need && self.address.is_empty()) || self.address.len() > MAX_FABRIC_ADDRESS {
            return Err(invalid(
                "address",
                format!("{} bytes (1-{MAX_FABRIC_ADDRESS})", self.address.len()),
            ));
        }
        if (need && self.provider.is_empty()) || self.provider.len() > 64 {
            return Err(invalid("provider", "must be 1-64 bytes"));
        }
        Ok(())
    }
}
