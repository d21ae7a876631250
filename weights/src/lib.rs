//! `dynamo-weights`: getting a model's weights onto a node that lacks them,
//! and handing them on.
//!
//! - [`manifest`]: a file named by its content (the SHA-256 of its bytes),
//!   cut into chunks each with a hash of its own, so a torn or wrong chunk
//!   is found and fetched again without reading the rest twice.
//! - [`source`]: where chunks come from: a peer's registered memory read
//!   over libfabric, or any byte source (a local file, a cache).
//! - [`loader`]: a load in the configured order of sources, in parallel
//!   across peers, the whole file verified before a byte is handed out
//!   (and, where it fails, each chunk, to fetch the wrong ones again); a
//!   source that fails is dropped and the rest carry on.
//! - [`serve`]: weights held in registered memory that peers may read.
//! - `device` (feature `cuda`): a verified load copied to GPU memory.
//!
//! NATS-free: the node advertises sources and finds them on the bus.

#[cfg(feature = "cuda")]
pub mod device;
pub mod loader;
pub mod manifest;
pub mod serve;
pub mod source;

pub use dynamo_bus_schema::weights::{WeightSource, WeightSourceState};
pub use loader::{load, LoadError, LoadOptions, LoadProgress, Loaded, SharedLoad, Source, Tried};
pub use manifest::{ContentHash, Manifest, ManifestError};
pub use serve::{PeerDescriptor, ServeError, SharedFile, WeightServer};
pub use source::{ByteSource, FileSource, PeerSource, SourceError};

#[cfg(feature = "cuda")]
pub use device::DeviceWeights;
