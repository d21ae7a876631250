//! Active load shared by router replicas.
//!
//! Every replica records the requests it routes (`own`) and publishes
//! `Added` / `PrefillDone` / `Finished`; it applies its peers' events to
//! `remote`. A worker's load as every replica sees it is the sum of both, so
//! replicas behind one load balancer do not all pick the same "idle" worker.
//!
//! Invariants:
//! - per-worker totals always equal the sum over own + remote entries;
//! - an entry lives until `Finished`, its worker restarts or leaves, its
//!   router stops heartbeating for `peer_ttl`, or it is older than `entry_ttl`;
//! - applying the same event twice changes nothing (idempotent), so a
//!   snapshot and the event tail may overlap;
//! - an own request is *shared* once a peer may hold it: its `Added` was
//!   published, or it went out in a snapshot. Its later events are always
//!   published, so a peer that got it sees it finish (one exception, older
//!   than sharing: a starting replica may apply a `Finished` before the
//!   snapshot that holds its `Added`, and keeps that entry until
//!   `entry_ttl`). One that is not shared is shared as soon as a peer
//!   listens ([`ActiveLoad::has_peers`]: one heard from within `peer_ttl`,
//!   or one that was served a snapshot or answered ours within it): the
//!   actor publishes [`ActiveLoad::share_pending`]. Two replicas that start
//!   together, unheard by each other, share what they routed at their
//!   first heartbeats;
//! - a peer heard for the first time, or again after `peer_ttl` of silence,
//!   is sent every own request again (as `Added`, and `PrefillDone` where
//!   done; peers that hold them ignore the duplicates), so one that lost
//!   them in a gap gets them back;
//! - [`ActiveLoad::share_pending`] gives at most its budget of events a call
//!   (the rest wait for the next call), so it cannot flood the bounded
//!   channel to the bus and crowd out `Finished` events.
//!
//! So a replica alone publishes no per-request event once the requests it
//! shared have finished (the common one-router deployment pays nothing for
//! sharing).

use dynamo_bus_schema::{ActiveLoadEvent, ActiveLoadKind, RequestId, RouterId, WorkerId};
use std::collections::HashMap;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerLoad {
    /// Requests in flight there (all replicas).
    pub inflight: u32,
    /// Uncached prompt tokens not yet prefilled there (all replicas).
    pub prefill_tokens: u64,
    /// KV blocks of the requests in flight there (all replicas).
    pub active_blocks: u64,
    /// Requests in flight there past their prefill (decoding).
    pub decoding: u32,
}

#[derive(Clone, Debug)]
struct Entry {
    worker: WorkerId,
    generation: u64,
    prefill_tokens: u64,
    blocks: u64,
    added: Instant,
    /// Its prefill is done (it counts in `decoding`).
    prefilled: bool,
    /// An own entry a peer may hold (see the module docs).
    shared: bool,
}

pub struct ActiveLoad {
    me: RouterId,
    entries: HashMap<(RouterId, RequestId), Entry>,
    peers: HashMap<RouterId, Instant>,
    per_worker: HashMap<WorkerId, WorkerLoad>,
    entry_ttl: Duration,
    peer_ttl: Duration,
    /// Until when a peer is taken to listen though none has heartbeated:
    /// a snapshot was served to one, or came from one.
    peer_hint: Option<Instant>,
    /// Own entries not shared yet.
    unshared: usize,
    /// Own requests to send again, for a peer new or back from silence.
    resend: Vec<RequestId>,
}

impl ActiveLoad {
    pub fn new(me: RouterId, entry_ttl: Duration, peer_ttl: Duration) -> Self {
        ActiveLoad {
            me,
            entries: HashMap::new(),
            peers: HashMap::new(),
            per_worker: HashMap::new(),
            entry_ttl,
            peer_ttl,
            peer_hint: None,
            unshared: 0,
            resend: Vec::new(),
        }
    }

    /// Whether a peer listens to this replica's events (only then is a new
    /// request published).
    pub fn has_peers(&self, now: Instant) -> bool {
        self.peer_hint.is_some_and(|t| now < t)
            || self
                .peers
                .values()
                .any(|t| now.saturating_duration_since(*t) <= self.peer_ttl)
    }

    /// A peer is starting (it asked for our snapshot, or answered ours):
    /// it listens from now on, before its first heartbeat.
    pub fn peer_starting(&mut self, now: Instant) {
        self.peer_hint = Some(now + self.peer_ttl);
    }

    /// Peers heard from recently.
    pub fn peers(&self) -> impl Iterator<Item = RouterId> + '_ {
        self.peers.keys().copied()
    }

    pub fn me(&self) -> RouterId {
        self.me
    }

    pub fn load_of(&self, w: WorkerId) -> WorkerLoad {
        self.per_worker.get(&w).copied().unwrap_or_default()
    }

    fn insert(&mut self, key: (RouterId, RequestId), e: Entry) {
        if self.entries.contains_key(&key) {
            return;
        }
        if key.0 == self.me && !e.shared {
            self.unshared += 1;
        }
        let l = self.per_worker.entry(e.worker).or_default();
        // Saturating: a peer's event is input, and may claim anything.
        l.inflight = l.inflight.saturating_add(1);
        l.prefill_tokens = l.prefill_tokens.saturating_add(e.prefill_tokens);
        l.active_blocks = l.active_blocks.saturating_add(e.blocks);
        self.entries.insert(key, e);
    }

    fn remove(&mut self, key: &(RouterId, RequestId)) -> Option<Entry> {
        let e = self.entries.remove(key)?;
        if key.0 == self.me && !e.shared {
            self.unshared = self.unshared.saturating_sub(1);
        }
        if let Some(l) = self.per_worker.get_mut(&e.worker) {
            l.inflight = l.inflight.saturating_sub(1);
            l.prefill_tokens = l.prefill_tokens.saturating_sub(e.prefill_tokens);
            l.active_blocks = l.active_blocks.saturating_sub(e.blocks);
            if e.prefilled {
                l.decoding = l.decoding.saturating_sub(1);
            }
        }
        Some(e)
    }

    fn prefill_done(&mut self, key: &(RouterId, RequestId)) -> Option<&Entry> {
        let e = self.entries.get_mut(key)?;
        if let Some(l) = self.per_worker.get_mut(&e.worker) {
            l.prefill_tokens = l.prefill_tokens.saturating_sub(e.prefill_tokens);
            if !e.prefilled {
                l.decoding = l.decoding.saturating_add(1);
            }
        }
        e.prefill_tokens = 0;
        e.prefilled = true;
        Some(e)
    }

    fn event(&self, id: RequestId, e: &Entry, kind: ActiveLoadKind) -> ActiveLoadEvent {
        ActiveLoadEvent {
            router_id: self.me,
            request_id: id,
            worker_id: e.worker,
            generation: e.generation,
            kind,
            prefill_tokens: e.prefill_tokens,
            blocks: e.blocks,
        }
    }

    /// This router routed a request; returns the event to publish, if a
    /// peer listens.
    pub fn add_own(
        &mut self,
        id: RequestId,
        worker: WorkerId,
        generation: u64,
        (prefill_tokens, blocks): (u64, u64),
        now: Instant,
    ) -> Option<ActiveLoadEvent> {
        if self.entries.contains_key(&(self.me, id)) {
            // Routed again without a release (callers release first): the
            // entry stands as it is.
            tracing::debug!(request = ?id, "routed twice; the first entry stands");
            return None;
        }
        let shared = self.has_peers(now);
        let e = Entry {
            worker,
            generation,
            prefill_tokens,
            blocks,
            added: now,
            prefilled: false,
            shared,
        };
        let ev = self.event(id, &e, ActiveLoadKind::Added);
        self.insert((self.me, id), e);
        shared.then_some(ev)
    }

    /// An own request's first token came back; returns the events to
    /// publish: its `PrefillDone` if it is shared, or the whole request if
    /// a peer listens now and it was not.
    pub fn prefill_done_own(&mut self, id: RequestId, now: Instant) -> Vec<ActiveLoadEvent> {
        let key = (self.me, id);
        let Some(e) = self.prefill_done(&key).cloned() else {
            return Vec::new();
        };
        if e.shared {
            return vec![self.event(id, &e, ActiveLoadKind::PrefillDone)];
        }
        if !self.has_peers(now) {
            return Vec::new();
        }
        self.mark_shared(&key);
        vec![
            self.event(id, &e, ActiveLoadKind::Added),
            self.event(id, &e, ActiveLoadKind::PrefillDone),
        ]
    }

    /// The worker an own request was routed to.
    pub fn worker_of_own(&self, id: RequestId) -> Option<WorkerId> {
        self.entries.get(&(self.me, id)).map(|e| e.worker)
    }

    /// An own request finished; returns its `Finished` if a peer may hold
    /// it (whether or not one listens now).
    pub fn finish_own(&mut self, id: RequestId) -> Option<ActiveLoadEvent> {
        let e = self.remove(&(self.me, id))?;
        e.shared
            .then(|| self.event(id, &e, ActiveLoadKind::Finished))
    }

    fn mark_shared(&mut self, key: &(RouterId, RequestId)) {
        if let Some(e) = self.entries.get_mut(key) {
            if !e.shared {
                e.shared = true;
                self.unshared = self.unshared.saturating_sub(1);
            }
        }
    }

    /// While a peer listens: own requests to send again for a peer new or
    /// back, and those not shared yet (now shared), as `Added` (and
    /// `PrefillDone` where done): at most `budget` events, the rest at the
    /// next call. Nothing to do, and no work, in the steady state.
    pub fn share_pending(&mut self, now: Instant, budget: usize) -> Vec<ActiveLoadEvent> {
        if (self.unshared == 0 && self.resend.is_empty()) || !self.has_peers(now) {
            return Vec::new();
        }
        let mut out = Vec::new();
        let emit = |me: &ActiveLoad, id: RequestId, e: &Entry, out: &mut Vec<ActiveLoadEvent>| {
            out.push(me.event(id, e, ActiveLoadKind::Added));
            if e.prefilled {
                out.push(me.event(id, e, ActiveLoadKind::PrefillDone));
            }
        };
        while out.len() + 2 <= budget {
            let Some(id) = self.resend.pop() else { break };
            // Finished since: its `Finished` went out already.
            if let Some(e) = self.entries.get(&(self.me, id)) {
                emit(self, id, e, &mut out);
            }
        }
        if self.unshared > 0 && out.len() + 2 <= budget {
            let me = self.me;
            let room = (budget - out.len()) / 2;
            let keys: Vec<(RouterId, RequestId)> = self
                .entries
                .iter()
                .filter(|((r, _), e)| *r == me && !e.shared)
                .map(|(k, _)| *k)
                .take(room)
                .collect();
            for k in keys {
                self.mark_shared(&k);
                if let Some(e) = self.entries.get(&k) {
                    emit(self, k.1, e, &mut out);
                }
            }
        }
        out
    }

    /// Recounts what the counters say (tests).
    #[cfg(test)]
    fn check(&self) {
        let me = self.me;
        let unshared = self
            .entries
            .iter()
            .filter(|((r, _), e)| *r == me && !e.shared)
            .count();
        assert_eq!(unshared, self.unshared, "unshared count drifted");
    }

    /// Whether this router holds `id` as its own.
    pub fn is_own(&self, id: RequestId) -> bool {
        self.entries.contains_key(&(self.me, id))
    }

    /// A peer's event (own events echoed back are ignored).
    pub fn remote(&mut self, ev: &ActiveLoadEvent, now: Instant) {
        if ev.router_id == self.me {
            return;
        }
        self.heard(ev.router_id, now);
        let key = (ev.router_id, ev.request_id);
        match ev.kind {
            ActiveLoadKind::Added => self.insert(
                key,
                Entry {
                    worker: ev.worker_id,
                    generation: ev.generation,
                    prefill_tokens: ev.prefill_tokens,
                    blocks: ev.blocks,
                    added: now,
                    prefilled: false,
                    shared: true,
                },
            ),
            ActiveLoadKind::PrefillDone => {
                self.prefill_done(&key);
            }
            ActiveLoadKind::Finished => {
                self.remove(&key);
            }
            ActiveLoadKind::Unknown(_) => {}
        }
    }

    pub fn heartbeat(&mut self, peer: RouterId, now: Instant) {
        if peer != self.me {
            self.heard(peer, now);
        }
    }

    /// A peer was heard: one new, or back after `peer_ttl` of silence, may
    /// hold none of the own requests, so they are all sent again.
    fn heard(&mut self, peer: RouterId, now: Instant) {
        let back = self
            .peers
            .insert(peer, now)
            .is_none_or(|t| now.saturating_duration_since(t) > self.peer_ttl);
        if back {
            let me = self.me;
            self.resend = self
                .entries
                .iter()
                .filter(|((r, _), e)| *r == me && e.shared)
                .map(|((_, id), _)| *id)
                .collect();
        }
    }

    /// Drops entries of silent peers, too-old entries, and entries for `alive` workers' older generations.
    pub fn expire(&mut self, now: Instant) {
        let peer_ttl = self.peer_ttl;
        let dead: Vec<RouterId> = self
            .peers
            .iter()
            .filter(|(_, t)| now.duration_since(**t) > peer_ttl)
            .map(|(p, _)| *p)
            .collect();
        for p in &dead {
            self.peers.remove(p);
        }
        let me = self.me;
        let ttl = self.entry_ttl;
        let stale: Vec<(RouterId, RequestId)> = self
            .entries
            .iter()
            .filter(|((r, _), e)| {
                (*r != me && !self.peers.contains_key(r)) || now.duration_since(e.added) > ttl
            })
            .map(|(k, _)| *k)
            .collect();
        for k in stale {
            self.remove(&k);
        }
    }

    /// A worker restarted (entries of older generations are void) or left (`generation = u64::MAX`).
    pub fn worker_changed(&mut self, w: WorkerId, generation: u64) {
        let stale: Vec<(RouterId, RequestId)> = self
            .entries
            .iter()
            .filter(|(_, e)| e.worker == w && e.generation < generation)
            .map(|(k, _)| *k)
            .collect();
        for k in stale {
            self.remove(&k);
        }
    }

    /// Everything active, as `Added` events (for a replica that starts late).
    /// Own entries in it are shared from now on: the peer it goes to holds
    /// them.
    pub fn snapshot(&mut self) -> Vec<ActiveLoadEvent> {
        for e in self.entries.values_mut() {
            e.shared = true;
        }
        self.unshared = 0;
        self.entries
            .iter()
            .flat_map(|((r, id), e)| {
                let ev = |kind| ActiveLoadEvent {
                    router_id: *r,
                    request_id: *id,
                    worker_id: e.worker,
                    generation: e.generation,
                    kind,
                    prefill_tokens: e.prefill_tokens,
                    blocks: e.blocks,
                };
                // A prefilled entry is sent as added, then prefilled.
                let done = e.prefilled.then(|| ev(ActiveLoadKind::PrefillDone));
                std::iter::once(ev(ActiveLoadKind::Added)).chain(done)
            })
            .collect()
    }

    /// Loads a peer's snapshot (entries of routers other than this one).
    pub fn load_snapshot(&mut self, entries: &[ActiveLoadEvent], now: Instant) {
        self.peer_starting(now);
        for e in entries {
            self.remote(e, now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_events_are_shared_only_while_a_peer_listens() {
        let (a, b) = (RouterId(1), RouterId(2));
        let ttl = Duration::from_secs(3);
        let t0 = Instant::now();
        let mut ra = ActiveLoad::new(a, Duration::from_secs(600), ttl);
        assert!(!ra.has_peers(t0), "alone");
        // Its own heartbeat echoed back is not a peer.
        ra.heartbeat(a, t0);
        assert!(!ra.has_peers(t0));
        // A peer starting asks for a snapshot before it heartbeats.
        ra.peer_starting(t0);
        assert!(ra.has_peers(t0 + Duration::from_secs(2)));
        assert!(
            !ra.has_peers(t0 + Duration::from_secs(4)),
            "it never heartbeated"
        );
        ra.heartbeat(b, t0 + Duration::from_secs(4));
        assert!(ra.has_peers(t0 + Duration::from_secs(6)));
        assert!(!ra.has_peers(t0 + Duration::from_secs(8)), "it went silent");
        // A snapshot from a peer says one listens.
        let mut rc = ActiveLoad::new(RouterId(3), Duration::from_secs(600), ttl);
        rc.load_snapshot(&[], t0);
        assert!(rc.has_peers(t0));
    }

    #[test]
    fn a_shared_request_always_finishes_at_its_peers_and_others_are_shared_late() {
        let (a, b) = (RouterId(1), RouterId(2));
        let ttl = Duration::from_secs(3);
        let t0 = Instant::now();
        let mut ra = ActiveLoad::new(a, Duration::from_secs(600), ttl);
        let mut rb = ActiveLoad::new(b, Duration::from_secs(600), ttl);
        let w = WorkerId(9);
        // Alone: nothing to publish, nothing pending to share.
        assert!(ra.add_own(RequestId(1), w, 1, (100, 4), t0).is_none());
        assert!(ra.prefill_done_own(RequestId(1), t0).is_empty());
        assert!(ra.add_own(RequestId(2), w, 1, (50, 2), t0).is_none());
        assert!(ra.share_pending(t0, 1000).is_empty());
        // A peer is heard: the two requests go out, the prefilled one as
        // added then prefilled, and only once.
        ra.heartbeat(b, t0);
        let out = ra.share_pending(t0, 1000);
        assert_eq!(out.len(), 3, "{out:?}");
        assert!(ra.share_pending(t0, 1000).is_empty());
        for ev in &out {
            rb.remote(ev, t0);
        }
        assert_eq!(rb.load_of(w).inflight, 2);
        assert_eq!(rb.load_of(w).decoding, 1);
        // The peer goes quiet past peer_ttl (a blip): a shared request's
        // later events still go out, so the peer, if it kept it, drops it.
        let later = t0 + Duration::from_secs(5);
        assert!(!ra.has_peers(later));
        assert_eq!(ra.prefill_done_own(RequestId(2), later).len(), 1);
        let fin = ra
            .finish_own(RequestId(1))
            .expect("shared: finished at peers");
        rb.remote(&fin, later);
        assert_eq!(rb.load_of(w).inflight, 1);
        // A request routed during the silence is not shared, and its end
        // is not published; shared late if the peer comes back.
        assert!(ra.add_own(RequestId(3), w, 1, (10, 1), later).is_none());
        assert!(ra.finish_own(RequestId(3)).is_none());
        assert!(ra.add_own(RequestId(4), w, 1, (10, 1), later).is_none());
        // The peer is back after the silence: it may have dropped what it
        // held, so request 2 (shared, prefilled) goes again, and request 4
        // for the first time.
        ra.heartbeat(b, later);
        let late = ra.share_pending(later, 1000);
        let ids: Vec<(RequestId, ActiveLoadKind)> =
            late.iter().map(|e| (e.request_id, e.kind)).collect();
        assert_eq!(ids.len(), 3, "{ids:?}");
        assert!(ids.contains(&(RequestId(2), ActiveLoadKind::Added)));
        assert!(ids.contains(&(RequestId(2), ActiveLoadKind::PrefillDone)));
        assert!(ids.contains(&(RequestId(4), ActiveLoadKind::Added)));
        assert!(ra.share_pending(later, 1000).is_empty());
        ra.check();
        // Entries that go out in a snapshot are shared too.
        assert!(ra
            .add_own(RequestId(5), w, 1, (10, 1), t0 + Duration::from_secs(20))
            .is_none());
        let snap = ra.snapshot();
        assert!(snap.iter().any(|e| e.request_id == RequestId(5)));
        assert!(ra.finish_own(RequestId(5)).is_some());
        ra.check();
    }

    #[test]
    fn sharing_a_backlog_keeps_to_its_budget_and_the_count_stays_exact() {
        let (a, b) = (RouterId(1), RouterId(2));
        let t0 = Instant::now();
        let mut ra = ActiveLoad::new(a, Duration::from_secs(600), Duration::from_secs(3));
        let w = WorkerId(9);
        for i in 0..10 {
            assert!(ra.add_own(RequestId(i), w, 1, (10, 1), t0).is_none());
        }
        // Routed twice without a release: the first entry stands.
        assert!(ra.add_own(RequestId(0), w, 1, (99, 9), t0).is_none());
        ra.check();
        ra.heartbeat(b, t0);
        // At most five events a call: two requests (room is kept for an
        // added and its prefill-done together).
        let mut sent = 0;
        for _ in 0..5 {
            let out = ra.share_pending(t0, 5);
            assert!(out.len() <= 5);
            sent += out.len();
            ra.check();
        }
        assert_eq!(sent, 10);
        assert!(ra.share_pending(t0, 5).is_empty());
        // Removal paths keep the count exact.
        ra.add_own(RequestId(20), w, 1, (10, 1), t0 + Duration::from_secs(10));
        ra.add_own(RequestId(21), w, 2, (10, 1), t0 + Duration::from_secs(10));
        ra.worker_changed(w, 2);
        ra.check();
        ra.expire(t0 + Duration::from_secs(700));
        ra.check();
        assert_eq!(ra.load_of(w), WorkerLoad::default());
    }

    #[test]
    fn replicas_converge_and_stale_entries_expire() {
        let t0 = Instant::now();
        let (a, b) = (RouterId(1), RouterId(2));
        let mut ra = ActiveLoad::new(a, Duration::from_secs(600), Duration::from_secs(3));
        let mut rb = ActiveLoad::new(b, Duration::from_secs(600), Duration::from_secs(3));
        let w = WorkerId(9);
        ra.heartbeat(b, t0);
        let ev = ra
            .add_own(RequestId(1), w, 1, (500, 40), t0)
            .expect("a peer listens");
        rb.remote(&ev, t0);
        rb.remote(&ev, t0); // duplicate: no double count
        assert_eq!(
            rb.load_of(w),
            WorkerLoad {
                inflight: 1,
                prefill_tokens: 500,
                active_blocks: 40,
                decoding: 0,
            }
        );
        let ev = ra.prefill_done_own(RequestId(1), t0);
        assert_eq!(ev.len(), 1);
        rb.remote(&ev[0], t0);
        assert_eq!(
            rb.load_of(w),
            WorkerLoad {
                inflight: 1,
                prefill_tokens: 0,
                active_blocks: 40,
                decoding: 1,
            }
        );
        // A late replica C loads B's snapshot and agrees.
        let mut rc = ActiveLoad::new(
            RouterId(3),
            Duration::from_secs(600),
            Duration::from_secs(3),
        );
        rc.load_snapshot(&rb.snapshot(), t0);
        assert_eq!(rc.load_of(w), rb.load_of(w));
        let ev = ra.finish_own(RequestId(1)).unwrap();
        rb.remote(&ev, t0);
        rc.remote(&ev, t0);
        assert_eq!(rb.load_of(w), WorkerLoad::default());
        assert_eq!(rc.load_of(w), WorkerLoad::default());
        // A replica that goes silent loses its entries.
        let ev = ra.add_own(RequestId(2), w, 1, (10, 1), t0).unwrap();
        rb.remote(&ev, t0);
        rb.expire(t0 + Duration::from_secs(2));
        assert_eq!(rb.load_of(w).inflight, 1);
        rb.expire(t0 + Duration::from_secs(4));
        assert_eq!(rb.load_of(w).inflight, 0);
        // A restarted worker voids older generations.
        ra.worker_changed(w, 2);
        assert_eq!(ra.load_of(w).inflight, 0);
    }
}
