//! Newtypes for every identifier that crosses the bus.
//!
//! Ids are plain integers on the wire; their `Display` form (lower-case hex
//! for random ids) is what logs, subjects and the CLI show.

use serde::{Deserialize, Serialize};
use std::fmt;

macro_rules! hex_id {
    ($(#[$doc:meta])* $name:ident($inner:ty), $width:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        pub struct $name(pub $inner);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!("{:0", $width, "x}"), self.0)
            }
        }

        impl std::str::FromStr for $name {
            type Err = std::num::ParseIntError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                <$inner>::from_str_radix(s, 16).map($name)
            }
        }
    };
}

hex_id!(
    /// One worker (an engine behind a worker actor). Stable across restarts
    /// of the actor in the same node slot; see [`crate::WorkerRegistration::generation`].
    WorkerId(u64), 16
);
hex_id!(
    /// One request, unique across the fleet: a UUID v7 (time-ordered).
    RequestId(u128), 32
);
hex_id!(
    /// One gateway process-actor; its inbox subject is derived from it.
    GatewayId(u64), 16
);
hex_id!(
    /// One router replica.
    RouterId(u64), 16
);

/// A node daemon, named in its config (e.g. `node-a`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NodeId(pub String);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A served model's public name (what clients put in `"model"`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ModelName(pub String);

impl fmt::Display for ModelName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Position of a frame in one response stream (0, 1, 2, …). Receivers use it
/// to detect a lost or reordered frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct FrameSeq(pub u32);

/// Per-worker monotonically increasing KV event id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct EventId(pub u64);

impl RequestId {
    /// A fresh random request id.
    pub fn random() -> Self {
        RequestId(random_u128())
    }
}

impl GatewayId {
    pub fn random() -> Self {
        GatewayId(random_u64())
    }
}

impl RouterId {
    pub fn random() -> Self {
        RouterId(random_u64())
    }
}

/// A UUID v7: 48 bits of unix milliseconds, then a counter and random bits
/// (uuid's per-thread generator, a CSPRNG seeded from the OS), so ids sort
/// by creation time and logs of one request line up.
fn random_u128() -> u128 {
    uuid::Uuid::now_v7().as_u128()
}

/// 64 bits of an instance id: the low half of a UUID v7 (its variant, the
/// low 30 bits of uuid's counter, reseeded at random each millisecond and
/// stepped within it, and 32 random bits), so replicas started in the same
/// millisecond still differ.
fn random_u64() -> u64 {
    random_u128() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_through_display() {
        let w = WorkerId(0xabc);
        assert_eq!(w.to_string(), "0000000000000abc");
        assert_eq!("0000000000000abc".parse::<WorkerId>().unwrap(), w);
        let r = RequestId::random();
        assert_eq!(r.to_string().parse::<RequestId>().unwrap(), r);
        assert_ne!(RequestId::random(), RequestId::random());
        // UUID v7: version 7, RFC 4122 variant, time-ordered.
        let u = uuid::Uuid::from_u128(r.0);
        assert_eq!(u.get_version_num(), 7);
        assert_eq!(u.get_variant(), uuid::Variant::RFC4122);
        assert!(RequestId::random().0 >> 80 >= r.0 >> 80);
        assert_ne!(GatewayId::random(), GatewayId::random());
    }
}
