//! `dynamo-bus-schema`: every type that crosses NATS, every subject name, and
//! the one codec that turns them into bytes.
//!
//! Invariants:
//! - Every message on the bus is a [`codec::Envelope`]: a magic byte, the
//!   schema version, a message kind tag and a bincode 2.0.1 payload. Nothing
//!   else encodes or decodes bus bytes.
//! - Decoding never panics: malformed bytes, a foreign version or a kind this
//!   build does not know are returned as [`codec::DecodeError`] values (an
//!   unknown kind is kept, with its raw payload, so a receiver can count it
//!   and move on).
//! - Nothing is published as one message past [`codec::MAX_MESSAGE`]:
//!   larger replies travel in [`ChunkedReply`] pieces ([`chunk`]).
//! - Subject names are built only by [`subjects::Subjects`], scoped by a
//!   validated namespace.
//! - The encoded form of every message is pinned by the snapshot test in
//!   `tests/wire_snapshot.rs`; an accidental change to a field, its order or
//!   its type fails that test.

pub mod access;
pub mod blocks;
pub mod chunk;
pub mod cluster;
pub mod codec;
pub mod ids;
pub mod kv_snapshot;
pub mod messages;
pub mod planner;
pub mod subjects;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod weights;

pub use cluster::*;
pub use codec::{
    decode, decode_assembled, decode_payload, encode, peek_kind, DecodeError, MessageKind,
    WireMessage, MAX_MESSAGE,
};
pub use ids::*;
pub use kv_snapshot::*;
pub use messages::*;
pub use planner::*;
pub use subjects::{Namespace, NamespaceError, Subjects};
