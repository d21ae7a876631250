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
    /// One request, unique across the fleet (random 128 bits).
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
        GatewayId(random_u128() as u64)
    }
}

impl RouterId {
    pub fn random() -> Self {
        RouterId(random_u128() as u64)
    }
}

/// Random bits without pulling a RNG crate into the schema: std's
/// `RandomState` is seeded from the OS per instance.
fn random_u128() -> u128 {
    use std::hash::{BuildHasher, Hasher};
    let mut out = 0u128;
    for i in 0..2u64 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(i);
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0),
        );
        out = (out << 64) | h.finish() as u128;
    }
    out
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
    }
}
