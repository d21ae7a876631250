//! A weight file's manifest: its content hash, its size and the hash of
//! each fixed-size chunk.
//!
//! Invariants of a [`Manifest`] that passed [`Manifest::validate`]: the
//! content hash and every chunk hash are 32 bytes; `chunk_size` is within
//! [`MIN_CHUNK`]..=[`MAX_CHUNK`]; there are exactly
//! `ceil(size / chunk_size)` chunks (at most [`MAX_CHUNKS`], so a manifest
//! stays small enough for one bus message); only the last chunk may be
//! short.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fmt;
use std::io::Read;
use std::path::Path;
use thiserror::Error;

/// Smallest chunk (1 MiB).
pub const MIN_CHUNK: u64 = 1 << 20;
/// Default chunk (4 MiB): enough reads in flight to fill a link, few
/// enough hashes to keep the manifest small.
pub const DEFAULT_CHUNK: u64 = 4 << 20;
/// Largest chunk (1 GiB).
pub const MAX_CHUNK: u64 = 1 << 30;
/// Most chunks in one manifest (a 4 TiB file at 1 GiB chunks).
pub const MAX_CHUNKS: usize = 4096;

#[derive(Debug, Error)]
pub enum ManifestError {
    #[error("`{field}`: {message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
    #[error("reading {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
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
    pub fn of(bytes: &[u8]) -> Self {
        ContentHash(Sha256::digest(bytes).into())
    }
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
pub struct Manifest {
    /// The model's served name (`smollm2-135m-instruct`).
    pub model: String,
    /// The SHA-256 of the whole file: its identity.
    pub sha256: ContentHash,
    /// How the bytes are laid out (`gguf`): sources of one content hash
    /// but another layout are other weights.
    pub layout: String,
    pub size: u64,
    pub chunk_size: u64,
    /// The SHA-256 of each chunk, in order.
    pub chunks: Vec<ContentHash>,
}

/// The chunk size for a file of `size` bytes: [`DEFAULT_CHUNK`], or larger
/// (a power of two) where that would make more than [`MAX_CHUNKS`].
pub fn chunk_size_for(size: u64) -> u64 {
    let mut c = DEFAULT_CHUNK;
    while c < MAX_CHUNK && size.div_ceil(c) > MAX_CHUNKS as u64 {
        c *= 2;
    }
    c
}

impl Manifest {
    /// The manifest of a file, read once.
    pub fn of_file(path: &Path, model: &str, layout: &str) -> Result<Self, ManifestError> {
        let io = |source| ManifestError::Io {
            path: path.display().to_string(),
            source,
        };
        let mut f = std::fs::File::open(path).map_err(io)?;
        let size = f.metadata().map_err(io)?.len();
        let chunk_size = chunk_size_for(size);
        let mut whole = Sha256::new();
        let mut chunks = Vec::new();
        let mut buf = vec![0u8; chunk_size.min(size.max(1)) as usize];
        let mut left = size;
        while left > 0 {
            let n = left.min(chunk_size) as usize;
            f.read_exact(&mut buf[..n]).map_err(io)?;
            whole.update(&buf[..n]);
            chunks.push(ContentHash::of(&buf[..n]));
            left -= n as u64;
        }
        let m = Manifest {
            model: model.to_string(),
            sha256: ContentHash(whole.finalize().into()),
            layout: layout.to_string(),
            size,
            chunk_size,
            chunks,
        };
        m.validate()?;
        Ok(m)
    }

    /// The manifest of bytes in memory.
    pub fn of_bytes(bytes: &[u8], model: &str, layout: &str) -> Self {
        let chunk_size = chunk_size_for(bytes.len() as u64);
        Manifest {
            model: model.to_string(),
            sha256: ContentHash::of(bytes),
            layout: layout.to_string(),
            size: bytes.len() as u64,
            chunk_size,
            chunks: bytes
                .chunks(chunk_size as usize)
                .map(ContentHash::of)
                .collect(),
        }
    }

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

    /// Offset and length of chunk `i`.
    pub fn chunk(&self, i: usize) -> (u64, usize) {
        let off = i as u64 * self.chunk_size;
        (off, self.chunk_size.min(self.size - off) as usize)
    }

    pub fn chunk_ok(&self, i: usize, bytes: &[u8]) -> bool {
        self.chunks.get(i) == Some(&ContentHash::of(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn bytes(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 31 % 251) as u8).collect()
    }

    #[test]
    fn a_file_and_its_bytes_give_one_manifest() {
        let b = bytes(9 << 20);
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&b).unwrap();
        let m = Manifest::of_file(f.path(), "m", "gguf").unwrap();
        assert_eq!(m, Manifest::of_bytes(&b, "m", "gguf"));
        assert_eq!((m.chunk_size, m.chunks.len()), (DEFAULT_CHUNK, 3));
        assert_eq!(m.chunk(2), (8 << 20, 1 << 20));
        assert!(m.chunk_ok(2, &b[8 << 20..]));
        assert!(!m.chunk_ok(1, &b[8 << 20..]));
        assert_eq!(m.sha256, ContentHash::of(&b));
        let j = serde_json::to_string(&m).unwrap();
        assert!(j.contains(&m.sha256.hex()));
        assert_eq!(serde_json::from_str::<Manifest>(&j).unwrap(), m);
    }

    #[test]
    fn large_files_get_larger_chunks_and_bad_manifests_are_refused() {
        assert_eq!(chunk_size_for(0), DEFAULT_CHUNK);
        let big = 64u64 << 30;
        let c = chunk_size_for(big);
        assert!(big.div_ceil(c) <= MAX_CHUNKS as u64 && c > DEFAULT_CHUNK);
        let mut m = Manifest::of_bytes(&bytes(5 << 20), "m", "gguf");
        m.validate().unwrap();
        m.chunks.pop();
        let e = m.validate().unwrap_err().to_string();
        assert!(e.contains("`chunks`"), "{e}");
        m.chunk_size = 10;
        assert!(m.validate().unwrap_err().to_string().contains("chunk_size"));
        assert!(ContentHash::parse("xyz").is_err());
        assert!(serde_json::from_str::<ContentHash>("\"00\"").is_err());
    }
}
