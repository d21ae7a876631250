//! Placement: a pure, deterministic function that puts the replicas of
//! deployments on labelled nodes with gang and topology semantics (after
//! Grove's PodGang and topology constraints). No I/O, no NATS.
//!
//! A [`Gang`] (a scaling-group replica, or one replica of a standalone
//! service) is placed whole or not at all. Packing ([`Pack`]) applies to a
//! gang's own members and to [`Scope`]s shared by several gangs ("all of
//! prefill in one rack", "the whole deployment in one zone"). Topology
//! domains come from the node labels `zone` > `rack` > `host`; a domain is
//! named by its label and the labels above it ([`domain_key`]), so `r1` in
//! `z1` and `r1` in `z2` are two racks; a missing label is a domain of that
//! node alone.
//!
//! Invariants (checked by the property tests):
//! 1. Gang: every member of a gang is assigned, or none is and the gang is
//!    pending with a reason.
//! 2. Capacity: per node, assigned slots + reserved slots ≤ slots, the same
//!    for memory; members go only to schedulable nodes. A node whose
//!    reservations already exceed its size takes nothing.
//! 3. Required packing: the members of a gang with `required = L` share one
//!    domain at `L`, and so do all placed members of a scope with
//!    `required = L`. A scope's domain is the one its placed members use
//!    (including kept ones); when current members disagree, the domain with
//!    the most of them wins and the others are placed again.
//! 4. Stability: members that run on a schedulable node with room, within
//!    their constraints, stay; all such members are kept before anything new
//!    is placed, so adding a gang never moves one. A gang that lost members
//!    first gets only those placed beside its survivors, else is placed again
//!    whole, else is pending (its survivors are not assigned). Placing again
//!    with `current` = the result gives the same result.
//! 5. Preferred packing is honoured when a domain can hold the gang (for a
//!    scope: the domain most of its members use, while it has room).
//! 6. Spread: a member goes to the node minimising (same-service members on
//!    its host, rack, zone), then most free slots, then node id.
//! 7. Reasons name the constraint and the numbers (slots, MiB, zone/rack/host).
//! 8. Deterministic, never panics; duplicate member keys and bad scope
//!    indices make a gang pending. Duplicate node ids: the first one counts.
//!
//! Layout: the types and [`place`] here; the planner (keeping, fitting,
//! spreading) in `planner.rs`; the reasons for people in `explain.rs`.
//!
//! Cost: about O(members × nodes) for unpacked gangs; packed gangs try the
//! candidate domains of their level, each over that domain's nodes only.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use serde::{Deserialize, Serialize};

/// A topology level, widest first. Node labels `zone`, `rack`, `host`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    Zone,
    Rack,
    Host,
}

impl Level {
    /// Every level, widest first.
    pub const ALL: [Level; 3] = [Level::Zone, Level::Rack, Level::Host];

    /// The node label for this level.
    pub fn label(&self) -> &'static str {
        match self {
            Level::Zone => "zone",
            Level::Rack => "rack",
            Level::Host => "host",
        }
    }

    /// Host is narrower than rack, which is narrower than zone.
    pub fn narrower_or_equal(self, other: Level) -> bool {
        self >= other
    }

    fn idx(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// Packing: every member under it must share one domain at `required`;
/// `preferred` is honoured when possible.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pack {
    pub required: Option<Level>,
    pub preferred: Option<Level>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeInfo {
    pub id: String,
    /// Topology labels; "" is a domain of this node alone at that level.
    pub zone: String,
    pub rack: String,
    pub host: String,
    /// Total slots (GPUs).
    pub slots: u32,
    /// Total memory.
    pub memory_mib: u64,
    /// false = lost or cordoned: nothing new goes there and current members
    /// there are placed again.
    pub schedulable: bool,
    /// Every label of the node (what a member's `selector` matches).
    pub labels: Vec<(String, String)>,
}

impl NodeInfo {
    /// The label of this node at `level`.
    pub fn label(&self, level: Level) -> &str {
        match level {
            Level::Zone => &self.zone,
            Level::Rack => &self.rack,
            Level::Host => &self.host,
        }
    }
}

/// The opaque identity of `node`'s domain at `level`: its labels from zone
/// down to `level`, a missing label standing for the node alone. Two nodes
/// share a domain at `level` exactly when their keys are equal.
pub fn domain_key(node: &NodeInfo, level: Level) -> String {
    let mut key = String::new();
    for l in Level::ALL {
        if l > level {
            break;
        }
        if l != Level::Zone {
            key.push('\u{1f}');
        }
        let label = node.label(l);
        if label.is_empty() && l == level {
            key.push('\u{0}');
            key.push_str(&node.id);
        } else {
            key.push_str(label);
        }
    }
    key
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// Unique across the request.
    pub key: String,
    pub service: String,
    pub slots: u32,
    pub memory_mib: u64,
    /// Labels the member's node must have.
    pub selector: Vec<(String, String)>,
    /// At most one member with this tag per node (e.g. a frontend, which
    /// owns its node's HTTP port).
    pub exclusive: Option<String>,
}

/// What is placed whole or not at all: a scaling-group replica (several
/// members) or one replica of a standalone service (one member).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gang {
    pub key: String,
    pub members: Vec<Member>,
    /// Packing of all members of this gang.
    pub pack: Pack,
    /// Indices into [`PlacementRequest::scopes`].
    pub scopes: Vec<usize>,
}

/// A packing shared by several gangs: e.g. "all replicas of service prefill
/// in one rack" or "the whole deployment in one zone".
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scope {
    pub key: String,
    pub pack: Pack,
}

pub struct PlacementRequest<'a> {
    pub nodes: &'a [NodeInfo],
    pub scopes: &'a [Scope],
    /// In priority order.
    pub gangs: &'a [Gang],
    /// Where members run now (member key -> node id). Members not in any
    /// gang are ignored (they are being removed).
    pub current: &'a HashMap<String, String>,
    /// Capacity already used on nodes by things outside this request:
    /// node id -> (slots, memory_mib).
    pub reserved: &'a HashMap<String, (u32, u64)>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    /// member key -> node id, for every member of every placed gang.
    pub assignments: BTreeMap<String, String>,
    /// Gangs that could not be placed, with a reason for people, in
    /// priority order.
    pub pending: Vec<Pending>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pending {
    pub gang: String,
    pub reason: String,
}

/// Places the gangs of `req`; see the module documentation for the rules.
pub fn place(req: &PlacementRequest) -> Placement {
    let mut p = Planner::new(req);
    p.run();
    p.finish()
}

mod explain;
mod planner;

use planner::Planner;

#[cfg(test)]
mod tests;
