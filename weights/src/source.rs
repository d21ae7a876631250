//! Where a load's chunks come from.
//!
//! A [`PeerSource`] is a node serving the weights from registered memory:
//! the loader reads it one-sided over its own libfabric endpoint, straight
//! into its destination. A [`ByteSource`] is anything that can copy a
//! range into a buffer (a local file, the in-cluster cache); the node
//! implements the cache's on its bus client.
//!
//! Invariant: a source never hands out bytes it did not read for that
//! range; whether they are the right bytes is the loader's check.

use dynamo_transfer::RemoteRegion;
use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;
use thiserror::Error;

#[derive(Clone, Debug, Error, PartialEq)]
pub enum SourceError {
    /// The source is not there (any more): skip it for the rest.
    #[error("{0}")]
    Gone(String),
    /// It answered, but not with these weights (another size).
    #[error("{0}")]
    Refused(String),
    /// This read failed; another may not.
    #[error("{0}")]
    Io(String),
}

/// A source that copies byte ranges.
pub trait ByteSource: Send {
    /// How it is named in progress, logs and errors.
    fn name(&self) -> String;
    /// The size of what it holds (checked against the manifest first).
    fn size(&mut self) -> Result<u64, SourceError>;
    /// Fills `out` with the bytes at `offset`.
    fn read_at(&mut self, offset: u64, out: &mut [u8]) -> Result<(), SourceError>;
}

/// A file on this node (`DYNAMO_MODEL_GGUF`, the package, a cache file).
pub struct FileSource {
    path: PathBuf,
    file: Option<std::fs::File>,
}

impl FileSource {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        FileSource {
            path: path.into(),
            file: None,
        }
    }

    fn file(&mut self) -> Result<&mut std::fs::File, SourceError> {
        if self.file.is_none() {
            let f = std::fs::File::open(&self.path)
                .map_err(|e| SourceError::Gone(format!("cannot open: {e}")))?;
            self.file = Some(f);
        }
        Ok(self.file.as_mut().expect("opened above"))
    }
}

impl ByteSource for FileSource {
    fn name(&self) -> String {
        format!("file {}", self.path.display())
    }
    fn size(&mut self) -> Result<u64, SourceError> {
        self.file()?
            .metadata()
            .map(|m| m.len())
            .map_err(|e| SourceError::Gone(e.to_string()))
    }
    fn read_at(&mut self, offset: u64, out: &mut [u8]) -> Result<(), SourceError> {
        let f = self.file()?;
        f.seek(SeekFrom::Start(offset))
            .and_then(|_| f.read_exact(out))
            .map_err(|e| SourceError::Io(format!("read at {offset}: {e}")))
    }
}

/// A peer's registered weights, as its advertisement gives them.
#[derive(Clone, Debug, PartialEq)]
pub struct PeerSource {
    /// The peer's name (its node), for progress and errors.
    pub name: String,
    /// Its libfabric endpoint address.
    pub address: Vec<u8>,
    /// The region holding the file's bytes from offset 0.
    pub region: RemoteRegion,
}
