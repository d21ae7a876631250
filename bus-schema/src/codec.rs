//! The one codec for bus bytes.
//!
//! Layout of every message (the envelope):
//!
//! | bytes | field |
//! |---|---|
//! | 1 | magic `0xD7` |
//! | 1 | schema version ([`SCHEMA_VERSION`]) |
//! | 2 | message kind, little-endian ([`MessageKind`]) |
//! | n | payload: bincode 2.0.1 (`standard()` config, varint ints) of the serde type |
//!
//! Invariants: [`decode`] never panics, rejects trailing bytes, and bounds
//! allocations by [`MAX_PAYLOAD`] ([`decode_assembled`], for replies put
//! back together from pieces, by [`MAX_ASSEMBLED`]); nothing is published
//! as one message past [`MAX_MESSAGE`]. Compatibility rule: a field may only be
//! added by introducing a new message kind or bumping [`SCHEMA_VERSION`]
//! (bincode is not self-describing, so `#[serde(default)]` cannot make an
//! added field readable by an old peer); receivers report a foreign version
//! or an unknown kind as an error value they can count and skip.

use serde::{de::DeserializeOwned, Serialize};
use thiserror::Error;

/// First byte of every envelope.
pub const MAGIC: u8 = 0xD7;
/// Version of the wire schema this build speaks.
pub const SCHEMA_VERSION: u8 = 1;
/// Largest payload we agree to decode (bytes). NATS itself caps messages at 1 MiB by default.
pub const MAX_PAYLOAD: usize = 8 * 1024 * 1024;
/// Largest message a process publishes as one bus message (bytes, the
/// envelope included): well under NATS's default 1 MiB payload limit, so a
/// message never fails for its size. Larger replies travel in pieces
/// ([`crate::chunk`]).
pub const MAX_MESSAGE: usize = 512 * 1024;
/// Largest reply we agree to reassemble from pieces (bytes).
pub const MAX_ASSEMBLED: usize = 256 * 1024 * 1024;
const HEADER: usize = 4;

/// Tag naming the type inside an envelope. Values are part of the wire
/// format: never renumber, only add.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MessageKind(pub u16);

/// A type that travels on the bus.
pub trait WireMessage: Serialize + DeserializeOwned {
    const KIND: MessageKind;
    /// Human name used in logs and error messages.
    const NAME: &'static str;
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("message too short: {len} bytes, the envelope needs {HEADER}")]
    TooShort { len: usize },
    #[error("bad magic byte {found:#04x} (expected {MAGIC:#04x}): not a dynamo bus message")]
    BadMagic { found: u8 },
    #[error("schema version {found} is not supported (this build speaks {SCHEMA_VERSION})")]
    UnsupportedVersion { found: u8 },
    #[error("expected message kind {expected} ({name}), found kind {found}")]
    UnexpectedKind {
        expected: u16,
        found: u16,
        name: &'static str,
    },
    #[error("payload of {len} bytes exceeds the {limit}-byte limit")]
    TooLarge { len: usize, limit: usize },
    #[error("malformed {name} payload: {reason}")]
    Malformed { name: &'static str, reason: String },
}

#[derive(Debug, Error)]
#[error("cannot encode {name}: {reason}")]
pub struct EncodeError {
    pub name: &'static str,
    pub reason: String,
}

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_PAYLOAD>()
}

/// Encoding may build a reply up to [`MAX_ASSEMBLED`] bytes (sent in pieces).
fn encode_config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_ASSEMBLED>()
}

/// Encodes `msg` into a complete envelope.
pub fn encode<T: WireMessage>(msg: &T) -> Result<Vec<u8>, EncodeError> {
    let mut out = Vec::with_capacity(64);
    out.push(MAGIC);
    out.push(SCHEMA_VERSION);
    out.extend_from_slice(&T::KIND.0.to_le_bytes());
    bincode::serde::encode_into_std_write(msg, &mut out, encode_config()).map_err(|e| {
        EncodeError {
            name: T::NAME,
            reason: e.to_string(),
        }
    })?;
    Ok(out)
}

/// Reads the envelope header and returns the message kind and payload.
pub fn peek_kind(bytes: &[u8]) -> Result<(MessageKind, &[u8]), DecodeError> {
    if bytes.len() < HEADER {
        return Err(DecodeError::TooShort { len: bytes.len() });
    }
    if bytes[0] != MAGIC {
        return Err(DecodeError::BadMagic { found: bytes[0] });
    }
    if bytes[1] != SCHEMA_VERSION {
        return Err(DecodeError::UnsupportedVersion { found: bytes[1] });
    }
    let payload = &bytes[HEADER..];
    if payload.len() > MAX_ASSEMBLED {
        return Err(DecodeError::TooLarge {
            len: payload.len(),
            limit: MAX_ASSEMBLED,
        });
    }
    Ok((
        MessageKind(u16::from_le_bytes([bytes[2], bytes[3]])),
        payload,
    ))
}

/// Decodes an envelope that must hold a `T` (one bus message: at most
/// [`MAX_PAYLOAD`] bytes of payload).
pub fn decode<T: WireMessage>(bytes: &[u8]) -> Result<T, DecodeError> {
    decode_payload(payload_of::<T>(bytes)?)
}

/// The payload of an envelope that must hold a `T`.
fn payload_of<T: WireMessage>(bytes: &[u8]) -> Result<&[u8], DecodeError> {
    let (kind, payload) = peek_kind(bytes)?;
    if kind != T::KIND {
        return Err(DecodeError::UnexpectedKind {
            expected: T::KIND.0,
            found: kind.0,
            name: T::NAME,
        });
    }
    Ok(payload)
}

/// Decodes a payload whose kind the caller already checked with [`peek_kind`].
pub fn decode_payload<T: WireMessage>(payload: &[u8]) -> Result<T, DecodeError> {
    if payload.len() > MAX_PAYLOAD {
        return Err(DecodeError::TooLarge {
            len: payload.len(),
            limit: MAX_PAYLOAD,
        });
    }
    decode_with(payload, config())
}

/// Decodes an envelope reassembled from [`crate::ChunkedReply`] pieces
/// (up to [`MAX_ASSEMBLED`] bytes).
pub fn decode_assembled<T: WireMessage>(bytes: &[u8]) -> Result<T, DecodeError> {
    let payload = payload_of::<T>(bytes)?;
    decode_with(
        payload,
        bincode::config::standard().with_limit::<MAX_ASSEMBLED>(),
    )
}

fn decode_with<T: WireMessage>(
    payload: &[u8],
    config: impl bincode::config::Config,
) -> Result<T, DecodeError> {
    let (value, used) =
        bincode::serde::decode_from_slice::<T, _>(payload, config).map_err(|e| {
            DecodeError::Malformed {
                name: T::NAME,
                reason: e.to_string(),
            }
        })?;
    if used != payload.len() {
        return Err(DecodeError::Malformed {
            name: T::NAME,
            reason: format!("{} trailing bytes", payload.len() - used),
        });
    }
    Ok(value)
}
