//! Requests nobody waits for any more: their gateway died (`kill -9`), or
//! it failed them while the bus was down and its cancel was lost. Without
//! this a worker would generate them to the end, for no one.
//!
//! Every [`CHECK_EVERY`], for the requests in flight that long:
//! - each gets a `FrameHeartbeat` (which names this worker): a gateway
//!   that no longer has the request answers it with a cancel;
//! - each gateway inbox they stream to is probed once, with a request
//!   carrying one of those heartbeats. NATS answers "no responders" when
//!   nothing subscribes to the inbox: the gateway is gone.
//!
//! Invariants: an inbox is declared gone only after two probes in a row,
//! [`CHECK_EVERY`] apart, found no responder (a gateway that reconnects
//! subscribes again within milliseconds, so one miss is not enough); then
//! every request streaming to it is cancelled; a probe answered, timed out
//! (a live gateway's inbox answers nothing) or failed otherwise counts as
//! the gateway being there (the bus may be down: it may come back). The
//! state is bounded by the requests in flight. A gateway cut off from the
//! bus for two probes while its workers are not (a partition) loses its
//! requests this way: they were lost to it anyway.

use dynamo_bus_schema::RequestId;
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use tokio::time::Instant;

/// How often requests in flight are checked for a gateway that still wants
/// them (and how long one runs before its first check).
pub const CHECK_EVERY: Duration = Duration::from_secs(5);
/// Longest a probe of a gateway inbox waits.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

struct Stream {
    reply_to: String,
    mux: bool,
    since: Instant,
}

/// What a check asks the worker to send.
#[derive(Debug, Default, PartialEq)]
pub struct Due {
    /// `(request, its gateway inbox, whether the inbox takes muxed frames)`:
    /// a heartbeat frame for each.
    pub heartbeats: Vec<(RequestId, String, bool)>,
    /// `(gateway inbox, a request streaming to it)`: one probe each.
    pub probes: Vec<(String, RequestId)>,
}

/// The requests in flight and the gateway inboxes that did not answer.
#[derive(Default)]
pub struct Orphans {
    streams: HashMap<RequestId, Stream>,
    /// Inboxes whose last probe found no responder.
    silent: HashSet<String>,
}

impl Orphans {
    pub fn started(&mut self, id: RequestId, reply_to: String, mux: bool, now: Instant) {
        self.streams.insert(
            id,
            Stream {
                reply_to,
                mux,
                since: now,
            },
        );
    }

    pub fn ended(&mut self, id: RequestId) {
        self.streams.remove(&id);
    }

    /// What to send now: requests in flight for [`CHECK_EVERY`] or more.
    pub fn due(&mut self, now: Instant) -> Due {
        let mut due = Due::default();
        let mut probed: HashSet<&str> = HashSet::new();
        let mut ids: Vec<_> = self
            .streams
            .iter()
            .filter(|(_, s)| now.saturating_duration_since(s.since) >= CHECK_EVERY)
            .collect();
        ids.sort_by_key(|(id, _)| id.0);
        for (id, s) in ids {
            due.heartbeats.push((*id, s.reply_to.clone(), s.mux));
            if probed.insert(s.reply_to.as_str()) {
                due.probes.push((s.reply_to.clone(), *id));
            }
        }
        // An inbox with nothing left in flight is forgotten.
        let live: HashSet<&str> = self.streams.values().map(|s| s.reply_to.as_str()).collect();
        self.silent.retain(|x| live.contains(x.as_str()));
        due
    }

    /// A probe of `reply_to` found no responder (`gone`) or not: the
    /// requests to cancel, on the second miss in a row.
    pub fn probed(&mut self, reply_to: &str, gone: bool) -> Vec<RequestId> {
        if !gone {
            self.silent.remove(reply_to);
            return Vec::new();
        }
        if self.silent.insert(reply_to.to_string()) {
            return Vec::new();
        }
        self.silent.remove(reply_to);
        let mut ids: Vec<RequestId> = self
            .streams
            .iter()
            .filter(|(_, s)| s.reply_to == reply_to)
            .map(|(id, _)| *id)
            .collect();
        ids.sort_by_key(|id| id.0);
        ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn an_inbox_silent_twice_in_a_row_loses_its_requests() {
        let mut o = Orphans::default();
        let t0 = Instant::now();
        o.started(RequestId(1), "gw-a".into(), true, t0);
        o.started(RequestId(2), "gw-a".into(), true, t0);
        o.started(
            RequestId(3),
            "gw-b".into(),
            false,
            t0 + Duration::from_secs(3),
        );
        // Nothing is due before a request has run a whole period.
        assert_eq!(o.due(t0 + Duration::from_secs(1)), Due::default());
        let d = o.due(t0 + CHECK_EVERY);
        assert_eq!(
            d.heartbeats,
            vec![
                (RequestId(1), "gw-a".to_string(), true),
                (RequestId(2), "gw-a".to_string(), true)
            ]
        );
        assert_eq!(d.probes, vec![("gw-a".to_string(), RequestId(1))]);
        // One miss is not enough; an answer in between resets it.
        assert!(o.probed("gw-a", true).is_empty());
        assert!(o.probed("gw-a", false).is_empty());
        assert!(o.probed("gw-a", true).is_empty());
        assert_eq!(o.probed("gw-a", true), vec![RequestId(1), RequestId(2)]);
        // gw-b's requests are untouched; ended requests are not cancelled.
        o.ended(RequestId(3));
        assert!(o.probed("gw-b", true).is_empty());
        assert!(o.probed("gw-b", true).is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_inbox_with_nothing_in_flight_is_forgotten() {
        let mut o = Orphans::default();
        let t0 = Instant::now();
        o.started(RequestId(1), "gw".into(), true, t0);
        assert!(o.probed("gw", true).is_empty());
        o.ended(RequestId(1));
        o.due(t0 + CHECK_EVERY);
        // A new request to the same inbox starts with a clean slate.
        o.started(RequestId(2), "gw".into(), true, t0 + CHECK_EVERY);
        assert!(o.probed("gw", true).is_empty());
        assert_eq!(o.probed("gw", true), vec![RequestId(2)]);
    }
}
