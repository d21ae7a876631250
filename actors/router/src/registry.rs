//! The workers a router knows: their registrations as the bus last said,
//! when each was last heard from, and what the router learned about them
//! (a KV block configuration that differs from their model's, a recent
//! `Overloaded` refusal).
//!
//! Invariants:
//! - a worker is routable only if its registration is `Serving` and it
//!   was heard from within the TTL (its record's own heartbeat time
//!   counts, so a record replayed for a long-dead worker is not taken as
//!   a sign of life);
//! - a record of an older generation never replaces a newer one;
//! - a model's card is the one of its most recently started worker (what
//!   a rolling upgrade brings in), with its digest;
//! - a worker marked overloaded is avoided until the mark expires or the
//!   worker shows a place again: one of this router's requests on it
//!   ended, or it reports fewer requests in flight than the most it
//!   reported since the mark (its last report before the mark included).

use dynamo_bus_schema::{
    unix_ms, LoadReport, ModelCard, ModelName, WorkerId, WorkerRegistration, WorkerState,
};
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct WorkerEntry {
    pub reg: WorkerRegistration,
    pub last_seen: Instant,
    /// Its block size or hash salt differs from its model's other workers.
    pub kv_mismatch: bool,
    /// [`ModelCard::digest`] of its card.
    pub card_digest: u64,
}

/// A served model and the workers serving it.
#[derive(Clone, Debug)]
pub struct ModelEntry {
    /// The card of the model's most recently started worker.
    pub card: ModelCard,
    pub card_digest: u64,
    pub workers: Vec<WorkerId>,
}

/// What a registration did to the registry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Upserted {
    /// A worker never seen (or forgotten) before.
    New,
    /// A newer generation: the worker's engine restarted.
    Restarted,
    /// A heartbeat of the generation already known.
    Refreshed,
    /// A record from before a restart, ignored.
    Stale,
}

pub struct Registry {
    ttl: Duration,
    workers: BTreeMap<WorkerId, WorkerEntry>,
    /// Workers that refused a request as overloaded: until when to avoid
    /// them, and the most requests each has reported in flight since.
    overloaded: HashMap<WorkerId, Overload>,
}

/// An overload mark (see [`Registry::mark_overloaded`]).
#[derive(Clone, Copy, Debug)]
struct Overload {
    until: Instant,
    /// The highest `inflight_requests` the worker reported since the mark
    /// (starting from its last report before it): a report below it means
    /// a request ended there, so it has a place again.
    peak: u32,
}

impl Registry {
    pub fn new(ttl: Duration) -> Self {
        Registry {
            ttl,
            workers: BTreeMap::new(),
            overloaded: HashMap::new(),
        }
    }

    pub fn get(&self, id: WorkerId) -> Option<&WorkerEntry> {
        self.workers.get(&id)
    }

    pub fn entries(&self) -> impl Iterator<Item = &WorkerEntry> {
        self.workers.values()
    }

    /// Serving and heard from within the TTL.
    pub fn routable(&self, e: &WorkerEntry, now: Instant) -> bool {
        e.reg.state == WorkerState::Serving && now.duration_since(e.last_seen) <= self.ttl
    }

    /// A registration or heartbeat arrived.
    pub fn upsert(&mut self, reg: WorkerRegistration, now: Instant) -> Upserted {
        let age = Duration::from_millis(unix_ms().saturating_sub(reg.heartbeat_unix_ms));
        let seen = now
            .checked_sub(age.min(self.ttl + Duration::from_secs(1)))
            .unwrap_or(now);
        let id = reg.worker_id;
        let digest = reg.model.digest();
        let out = match self.workers.get_mut(&id) {
            Some(e) if reg.generation < e.reg.generation => return Upserted::Stale,
            Some(e) => {
                let out = if reg.generation > e.reg.generation {
                    self.overloaded.remove(&id);
                    Upserted::Restarted
                } else {
                    Upserted::Refreshed
                };
                e.reg = reg;
                e.last_seen = seen;
                e.card_digest = digest;
                out
            }
            None => {
                self.workers.insert(
                    id,
                    WorkerEntry {
                        reg,
                        last_seen: seen,
                        kv_mismatch: false,
                        card_digest: digest,
                    },
                );
                Upserted::New
            }
        };
        self.check_kv_config(id);
        out
    }

    /// Marks a worker whose block size or hash salt differs from the first
    /// registered worker of the same model, and says so loudly: such a
    /// misconfiguration usually means its blocks are not what the operator
    /// meant (it is still hashed with its own settings, so routing stays
    /// exact for it and for the others).
    fn check_kv_config(&mut self, id: WorkerId) {
        let Some(me) = self.workers.get(&id) else {
            return;
        };
        let (model, mine) = (
            me.reg.model.name.clone(),
            (me.reg.model.block_size, me.reg.model.hash_salt),
        );
        let reference = self
            .workers
            .values()
            .filter(|e| e.reg.model.name == model && e.reg.worker_id != id && !e.kv_mismatch)
            .min_by_key(|e| (e.reg.started_unix_ms, e.reg.worker_id))
            .map(|e| {
                (
                    e.reg.worker_id,
                    e.reg.model.block_size,
                    e.reg.model.hash_salt,
                )
            });
        let mismatch = matches!(reference, Some((_, bs, salt)) if (bs, salt) != mine);
        let Some(e) = self.workers.get_mut(&id) else {
            return;
        };
        if let (true, false, Some((rw, bs, salt))) = (mismatch, e.kv_mismatch, reference) {
            tracing::error!(
                worker = %id, model = %model, block_size = mine.0, hash_salt = mine.1,
                reference_worker = %rw, reference_block_size = bs, reference_hash_salt = salt,
                "KV block configuration mismatch: this worker's blocks can never be shared with its model's other workers"
            );
        }
        e.kv_mismatch = mismatch;
    }

    /// Workers whose KV block configuration disagrees with their model's.
    pub fn kv_mismatches(&self) -> Vec<WorkerId> {
        self.workers
            .values()
            .filter(|e| e.kv_mismatch)
            .map(|e| e.reg.worker_id)
            .collect()
    }

    /// A worker's registration was deleted; true if it was known.
    pub fn remove(&mut self, id: WorkerId) -> bool {
        self.overloaded.remove(&id);
        self.workers.remove(&id).is_some()
    }

    /// A load report arrived; it also counts as a sign of life.
    pub fn load(&mut self, report: LoadReport, now: Instant) {
        if let Some(e) = self.workers.get_mut(&report.worker_id) {
            if report.generation == e.reg.generation {
                let inflight = report.load.inflight_requests;
                if let Some(m) = self.overloaded.get_mut(&report.worker_id) {
                    if inflight < m.peak {
                        // A request ended there since it refused: room again.
                        self.overloaded.remove(&report.worker_id);
                    } else {
                        m.peak = inflight;
                    }
                }
                e.reg.load = report.load;
                e.last_seen = now;
            }
        }
    }

    /// Drops workers not heard from within the TTL, and expired overload
    /// marks; returns the dropped workers.
    pub fn expire(&mut self, now: Instant) -> Vec<WorkerId> {
        let ttl = self.ttl;
        let dead: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(_, e)| now.duration_since(e.last_seen) > ttl)
            .map(|(id, _)| *id)
            .collect();
        for id in &dead {
            tracing::warn!(worker = %id, "worker expired (no heartbeat within TTL)");
            self.remove(*id);
        }
        self.overloaded.retain(|_, m| m.until > now);
        dead
    }

    /// The worker refused a request as overloaded: avoid it for `backoff`,
    /// or until it has a place again: one of this router's requests on it
    /// ended ([`Self::room_freed`]), or it reports fewer requests in flight
    /// than at any time since the mark.
    pub fn mark_overloaded(&mut self, id: WorkerId, now: Instant, backoff: Duration) {
        if let Some(e) = self.workers.get(&id) {
            let peak = e.reg.load.inflight_requests;
            self.overloaded.insert(
                id,
                Overload {
                    until: now + backoff,
                    peak,
                },
            );
        }
    }

    /// A request the worker had taken ended: it has a place again.
    pub fn room_freed(&mut self, id: WorkerId) {
        self.overloaded.remove(&id);
    }

    pub fn is_overloaded(&self, id: WorkerId, now: Instant) -> bool {
        self.overloaded.get(&id).is_some_and(|m| m.until > now)
    }

    /// Every served model with its workers (any state), each with its
    /// newest worker's card.
    pub fn models(&self) -> Vec<ModelEntry> {
        let mut out: BTreeMap<&ModelName, (ModelEntry, (u64, u64))> = BTreeMap::new();
        for e in self.workers.values() {
            let age = (e.reg.started_unix_ms, e.reg.generation);
            let (entry, newest) = out.entry(&e.reg.model.name).or_insert_with(|| {
                (
                    ModelEntry {
                        card: e.reg.model.clone(),
                        card_digest: e.card_digest,
                        workers: Vec::new(),
                    },
                    age,
                )
            });
            if age > *newest {
                entry.card = e.reg.model.clone();
                entry.card_digest = e.card_digest;
                *newest = age;
            }
            entry.workers.push(e.reg.worker_id);
        }
        out.into_values().map(|(m, _)| m).collect()
    }
}
