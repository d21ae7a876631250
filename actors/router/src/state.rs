//! The router's synchronous state: the worker registry, the shared active
//! load, and the policy that picks a worker. It reads the KV index, which
//! the indexer writes (see [`crate::indexer`]), and queues what the
//! indexer must be told ([`ToIndexer`]) in the order the registry changed.
//!
//! Invariants:
//! - a worker is routable only if its registration is `Serving`, serves the
//!   requested model, and was refreshed within the TTL (see
//!   [`crate::registry`]); one that refused a request as overloaded is
//!   avoided while another can take it;
//! - a newer `generation` of a worker resets the router's in-flight count
//!   for it (the old engine and its requests are gone);
//! - `release` never underflows and ignores releases for an older generation;
//! - prefill workers (role `Prefill`) never get whole requests: they are
//!   only named as a decision's `prefill_worker`;
//! - a request's blocks are hashed with each candidate's own block size and
//!   salt (once per distinct configuration), so one misconfigured worker
//!   never spoils the overlap of the others;
//! - a routing decision is total: with an eligible worker, one is returned.

use crate::active::{ActiveLoad, WorkerLoad};
use crate::catch_up::CatchUp;
use crate::disagg::{DisaggPolicy, PrefillCandidate};
use crate::indexer_state::ToIndexer;
use crate::kv_sync::{KvStats, SharedKv};
use crate::policy::{Candidate, KvCostWeights, RouteRequest, RoutingPolicy};
pub use crate::registry::{ModelEntry, WorkerEntry};
use crate::registry::{Registry, Upserted};
use crate::timing::RouteTimings;
use dynamo_bus_schema::blocks::{sequence_hashes, SequenceHash};
use dynamo_bus_schema::{ActiveLoadEvent, RequestId, RouterId};
use dynamo_bus_schema::{LoadReport, ModelName, WorkerId, WorkerRegistration, WorkerRole};
use dynamo_kv_index::Overlap;
use std::collections::HashMap;
use std::time::{Duration, Instant};
use thiserror::Error;

/// Whether a worker of this role runs whole requests (prefill workers only
/// prefill for others).
fn generates(role: WorkerRole) -> bool {
    role != WorkerRole::Prefill
}

/// How long a worker that refused a request as overloaded is avoided.
pub const DEFAULT_OVERLOAD_BACKOFF: Duration = Duration::from_millis(500);

#[derive(Clone, Debug, Error, PartialEq)]
pub enum RouteError {
    #[error("model {model:?} is not served by any registered worker")]
    UnknownModel { model: String },
    #[error("no worker is available for model {model:?} ({registered} registered, none serving and fresh)")]
    NoWorkers { model: String, registered: usize },
    #[error("every worker of model {model:?} is overloaded")]
    Overloaded { model: String },
    #[error("the router is still loading its view of the cluster")]
    CatchingUp,
}

/// A routing decision.
#[derive(Clone, Debug, PartialEq)]
pub struct RouteDecision {
    pub worker_id: WorkerId,
    pub generation: u64,
    /// Prompt tokens the router predicted the worker must compute.
    pub prefill_tokens: u64,
    /// Leading prompt blocks the index says the worker holds.
    pub overlap_blocks: u32,
    /// The prefill worker to prefill on (disaggregated serving), when the
    /// uncached part is long enough and a prefill worker has room.
    pub prefill_worker: Option<WorkerId>,
    /// [`dynamo_bus_schema::ModelCard::digest`] of the chosen worker's card
    /// (a gateway that tokenized with another card does it again).
    pub card_digest: u64,
}

/// Block hashes of one prompt, per (block size, salt): computed once for
/// every candidate that shares the configuration.
#[derive(Default)]
struct Hashed {
    by_config: HashMap<(u32, u64), Vec<SequenceHash>>,
}

impl Hashed {
    fn of(&mut self, token_ids: &[u32], block_size: u32, salt: u64) -> &[SequenceHash] {
        self.by_config
            .entry((block_size, salt))
            .or_insert_with(|| sequence_hashes(token_ids, block_size as usize, salt))
    }
}

pub struct RouterState {
    registry: Registry,
    policy: Box<dyn RoutingPolicy>,
    /// The KV index, read here and written by the indexer alone.
    kv: SharedKv,
    /// What the indexer must be told, in order (the actor sends it after
    /// each message).
    to_indexer: Vec<ToIndexer>,
    /// The view last told to the indexer (rank, caught up).
    told_view: Option<(u32, bool)>,
    /// Notices queued for the current indexer since it started (it counts
    /// those it handled in the shared index).
    notices_sent: u64,
    active: ActiveLoad,
    timings: RouteTimings,
    catch_up: CatchUp,
    disagg: DisaggPolicy,
    /// Prompts sent to each prefill worker since its last load report
    /// (see [`crate::disagg`]); at most one entry per registered worker.
    prefill_sent: HashMap<WorkerId, u32>,
    overload_backoff: Duration,
}

impl RouterState {
    pub fn new(ttl: Duration, policy: Box<dyn RoutingPolicy>) -> Self {
        Self::with_id(RouterId::random(), ttl, policy)
    }

    pub fn with_id(id: RouterId, ttl: Duration, policy: Box<dyn RoutingPolicy>) -> Self {
        RouterState {
            registry: Registry::new(ttl),
            policy,
            kv: SharedKv::default(),
            to_indexer: Vec::new(),
            told_view: None,
            notices_sent: 0,
            // Peers heartbeat every second; entries outlive any request deadline.
            active: ActiveLoad::new(id, Duration::from_secs(3600), Duration::from_secs(3)),
            timings: RouteTimings::default(),
            catch_up: CatchUp::done(),
            disagg: DisaggPolicy::default(),
            prefill_sent: HashMap::new(),
            overload_backoff: DEFAULT_OVERLOAD_BACKOFF,
        }
    }

    /// The KV index this router reads (the indexer's to write).
    pub fn kv(&self) -> &SharedKv {
        &self.kv
    }

    /// The indexer was replaced, with a fresh index: it is told the whole
    /// registry again (and the rest of what it was told), in order.
    pub fn indexer_replaced(&mut self, kv: SharedKv) {
        self.kv = kv;
        self.to_indexer.clear();
        self.notices_sent = 0;
        let known: Vec<ToIndexer> = self
            .registry
            .entries()
            .map(|e| ToIndexer::Registered {
                worker: e.reg.worker_id,
                generation: e.reg.generation,
                kv_events: e.reg.kv_events,
            })
            .collect();
        for n in known {
            self.notify(n);
        }
        if self.catch_up.registry_was_loaded() {
            self.notify(ToIndexer::RegistryLoaded);
        }
        self.told_view = None;
    }

    fn notify(&mut self, n: ToIndexer) {
        self.notices_sent += 1;
        self.to_indexer.push(n);
    }

    /// What the indexer must be told now, in order.
    pub fn take_to_indexer(&mut self) -> Vec<ToIndexer> {
        std::mem::take(&mut self.to_indexer)
    }

    /// How many workers wait for a repair, and whether the index is still
    /// replaying the stream or has notices of ours to handle (a worker
    /// registered is syncing only once its notice is handled). An
    /// unreadable index (its writer panicked) counts as still replaying:
    /// the replacement's catch-up, or the cap, decides.
    fn kv_progress(&self) -> (usize, bool) {
        self.kv
            .read()
            .map(|kv| {
                (
                    kv.syncing(),
                    kv.replaying() || kv.notices < self.notices_sent,
                )
            })
            .unwrap_or((0, true))
    }

    /// Whether routing may start (see [`CatchUp`]).
    fn caught_up(&mut self, now: Instant) -> bool {
        let (syncing, replaying) = self.kv_progress();
        self.catch_up.check(syncing, replaying, now)
    }

    /// Tells the indexer this replica's place among the live ones and
    /// whether it routes, when either changed (for snapshot election).
    /// A replica that routes nothing still finishes catching up here.
    pub fn tell_view(&mut self, now: Instant) {
        let me = self.router_id();
        let rank = self.active.peers().filter(|p| p.0 < me.0).count() as u32;
        let view = (rank, self.caught_up(now));
        if self.told_view != Some(view) {
            self.told_view = Some(view);
            self.notify(ToIndexer::View {
                rank: view.0,
                caught_up: view.1,
            });
        }
    }

    /// Sets when prefill moves to prefill workers.
    pub fn set_disagg(&mut self, policy: DisaggPolicy) {
        self.disagg = policy;
    }

    /// Sets how long a worker that refused as overloaded is avoided.
    pub fn set_overload_backoff(&mut self, backoff: Duration) {
        self.overload_backoff = backoff;
    }

    /// Holds routing until this replica's view is whole (see `catch_up`).
    pub fn begin_catch_up(&mut self, now: Instant) {
        self.catch_up = CatchUp::begin(now);
    }

    /// The registry's history has been read.
    pub fn registry_loaded(&mut self) {
        self.catch_up.registry_loaded();
        self.notify(ToIndexer::RegistryLoaded);
    }

    /// A peer's load snapshot was loaded, or none answered.
    pub fn snapshot_done(&mut self) {
        self.catch_up.snapshot_done();
    }

    pub fn router_id(&self) -> RouterId {
        self.active.me()
    }

    /// A peer router's load event.
    pub fn remote_load(&mut self, ev: &ActiveLoadEvent, now: Instant) {
        self.active.remote(ev, now);
    }

    /// A peer router is alive.
    pub fn peer_heartbeat(&mut self, peer: RouterId, now: Instant) {
        self.active.heartbeat(peer, now);
    }

    /// A peer's snapshot of the active load (at start-up).
    pub fn load_snapshot(&mut self, entries: &[ActiveLoadEvent], now: Instant) {
        self.active.load_snapshot(entries, now);
    }

    /// The active load, for a peer that starts late (which listens from
    /// now on).
    pub fn active_snapshot(&mut self, now: Instant) -> Vec<ActiveLoadEvent> {
        self.active.peer_starting(now);
        self.active.snapshot()
    }

    /// While a peer listens: own requests it may not hold, to publish, at
    /// most `budget` events (see [`ActiveLoad::share_pending`]).
    pub fn share_pending(&mut self, now: Instant, budget: usize) -> Vec<ActiveLoadEvent> {
        self.active.share_pending(now, budget)
    }

    /// A worker's load as all replicas together see it.
    pub fn worker_load(&self, w: WorkerId) -> WorkerLoad {
        self.active.load_of(w)
    }

    /// The first token of an own request came back; returns the events to
    /// publish.
    pub fn prefill_done(&mut self, id: RequestId, now: Instant) -> Vec<ActiveLoadEvent> {
        self.active.prefill_done_own(id, now)
    }

    pub fn kv_stats(&self) -> KvStats {
        self.kv.stats()
    }

    /// Blocks the index holds for `w` (device, host, disk).
    pub fn kv_blocks_of(&self, w: WorkerId) -> [u64; 3] {
        self.kv
            .read()
            .map(|kv| kv.index.blocks_of(w))
            .unwrap_or_default()
    }

    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    /// A registration or heartbeat arrived.
    pub fn upsert(&mut self, reg: WorkerRegistration, now: Instant) {
        let (id, generation, kv_events) = (reg.worker_id, reg.generation, reg.kv_events);
        let (node, model) = (reg.node_id.clone(), reg.model.name.clone());
        match self.registry.upsert(reg, now) {
            Upserted::New => {
                tracing::info!(worker = %id, node = %node, model = %model, kv_events, "worker registered");
            }
            Upserted::Restarted => {
                tracing::info!(worker = %id, generation, "worker restarted");
                self.active.worker_changed(id, generation);
            }
            Upserted::Refreshed | Upserted::Stale => return,
        }
        self.notify(ToIndexer::Registered {
            worker: id,
            generation,
            kv_events,
        });
    }

    pub fn timings(&self) -> &RouteTimings {
        &self.timings
    }

    /// This router's view of its index, for `dynamoctl status`.
    pub fn info(&self) -> dynamo_bus_schema::RouterInfo {
        // Counters first: a second read lock taken while holding one can
        // deadlock behind a waiting writer.
        let st = self.kv.stats();
        let kv = self.kv.read();
        dynamo_bus_schema::RouterInfo {
            router_id: self.router_id(),
            policy: self.policy_name().to_string(),
            workers: self
                .registry
                .entries()
                .map(|e| {
                    let w = e.reg.worker_id;
                    dynamo_bus_schema::IndexedWorker {
                        worker_id: w,
                        blocks: kv
                            .as_ref()
                            .map(|kv| kv.index.blocks_of(w))
                            .unwrap_or_default(),
                        event_lag_ms: kv.as_ref().map(|kv| kv.lag_ms(w)).unwrap_or(0),
                        inflight: self.active.load_of(w).inflight,
                        kv_config_mismatch: e.kv_mismatch,
                    }
                })
                .collect(),
            events_applied: st.applied,
            event_gaps: st.gaps,
            event_duplicates: st.duplicates,
            dumps: st.dumps,
        }
    }

    /// Workers whose KV block configuration disagrees with their model's.
    pub fn kv_mismatches(&self) -> Vec<WorkerId> {
        self.registry.kv_mismatches()
    }

    /// A worker's registration was deleted (graceful shutdown).
    pub fn remove(&mut self, id: WorkerId) {
        if self.registry.remove(id) {
            tracing::info!(worker = %id, "worker deregistered");
        }
        self.notify(ToIndexer::Gone(id));
        self.active.worker_changed(id, u64::MAX);
        self.prefill_sent.remove(&id);
    }

    /// A load report arrived; it also counts as a sign of life.
    pub fn load(&mut self, report: LoadReport, now: Instant) {
        self.prefill_sent.remove(&report.worker_id);
        self.registry.load(report, now);
    }

    /// A worker refused a request as overloaded: avoid it for a while.
    pub fn overloaded(&mut self, w: WorkerId, now: Instant) {
        self.registry.mark_overloaded(w, now, self.overload_backoff);
    }

    /// Drops workers not heard from within the TTL; returns them.
    pub fn expire(&mut self, now: Instant) -> Vec<WorkerId> {
        let dead = self.registry.expire(now);
        for id in &dead {
            self.notify(ToIndexer::Gone(*id));
            self.active.worker_changed(*id, u64::MAX);
            self.prefill_sent.remove(id);
        }
        self.active.expire(now);
        self.tell_view(now);
        dead
    }

    /// Picks a worker for request `id`, skipping `exclude`; returns the
    /// decision and the load event to publish to the other replicas (none
    /// while no peer listens).
    pub fn route(
        &mut self,
        id: RequestId,
        model: &ModelName,
        token_ids: &[u32],
        exclude: &[WorkerId],
        now: Instant,
    ) -> Result<(RouteDecision, Option<ActiveLoadEvent>), RouteError> {
        self.route_with(id, model, token_ids, exclude, None, now)
    }

    /// [`Self::route`] with per-request KV cost weights.
    pub fn route_with(
        &mut self,
        id: RequestId,
        model: &ModelName,
        token_ids: &[u32],
        exclude: &[WorkerId],
        weights: Option<KvCostWeights>,
        now: Instant,
    ) -> Result<(RouteDecision, Option<ActiveLoadEvent>), RouteError> {
        if !self.caught_up(now) {
            return Err(RouteError::CatchingUp);
        }
        let t0 = Instant::now();
        let mut registered = 0;
        let mut eligible: Vec<&WorkerEntry> = self
            .registry
            .entries()
            .filter(|e| &e.reg.model.name == model && generates(e.reg.role))
            .inspect(|_| registered += 1)
            .filter(|e| self.registry.routable(e, now) && !exclude.contains(&e.reg.worker_id))
            .collect();
        if eligible.is_empty() {
            return Err(if registered == 0 {
                RouteError::UnknownModel {
                    model: model.0.clone(),
                }
            } else {
                RouteError::NoWorkers {
                    model: model.0.clone(),
                    registered,
                }
            });
        }
        // Workers that just refused as overloaded are avoided while another can take it.
        let fresh: Vec<&WorkerEntry> = eligible
            .iter()
            .copied()
            .filter(|e| !self.registry.is_overloaded(e.reg.worker_id, now))
            .collect();
        if fresh.is_empty() {
            return Err(RouteError::Overloaded {
                model: model.0.clone(),
            });
        }
        eligible = fresh;
        let mut candidates: Vec<Candidate> = eligible
            .iter()
            .map(|e| {
                let l = self.active.load_of(e.reg.worker_id);
                Candidate {
                    worker_id: e.reg.worker_id,
                    router_inflight: l.inflight,
                    reported: e.reg.load.clone(),
                    overlap: Overlap::default(),
                    pending_prefill_tokens: l.prefill_tokens,
                    active_blocks: l.active_blocks,
                    decoding: l.decoding,
                    block_size: e.reg.model.block_size,
                }
            })
            .collect();
        let configs: Vec<(u32, u64)> = eligible
            .iter()
            .map(|e| (e.reg.model.block_size, e.reg.model.hash_salt))
            .collect();
        let mut hashed = Hashed::default();
        if self.policy.needs_overlap() {
            let th = Instant::now();
            for &(bs, salt) in &configs {
                hashed.of(token_ids, bs, salt);
            }
            let t1 = Instant::now();
            self.timings.hashing.observe(t1 - th);
            // One index query per distinct configuration, each read only
            // for the candidates hashed that way (none while the index
            // cannot be read: routing goes by load).
            let kv = self.kv.read();
            for (cfg, h) in kv.iter().flat_map(|kv| {
                hashed
                    .by_config
                    .iter()
                    .map(move |(cfg, h)| (cfg, kv.index.find_matches(h)))
            }) {
                let matches: HashMap<WorkerId, Overlap> = h.into_iter().collect();
                for (c, _) in candidates
                    .iter_mut()
                    .zip(&configs)
                    .filter(|(_, c)| *c == cfg)
                {
                    if let Some(o) = matches.get(&c.worker_id) {
                        c.overlap = *o;
                    }
                }
            }
            self.timings.find_matches.observe(t1.elapsed());
        }
        let picked = self.policy.select(
            &RouteRequest {
                model,
                token_ids,
                weights,
            },
            &candidates,
        );
        // A policy returns one of the candidates; were it not to, the first
        // one is taken rather than failing the request.
        let chosen_at = candidates
            .iter()
            .position(|c| c.worker_id == picked)
            .unwrap_or(0);
        let chosen = &candidates[chosen_at];
        let entry = eligible[chosen_at];
        let wid = chosen.worker_id;
        let overlap_blocks = chosen.overlap.blocks;
        if tracing::enabled!(tracing::Level::DEBUG) {
            // Why a request did not go to the worker holding the most of it.
            let best = candidates
                .iter()
                .max_by_key(|c| c.overlap.blocks)
                .unwrap_or(chosen);
            tracing::debug!(
                request = %id, worker = %wid, overlap = overlap_blocks,
                pending = chosen.pending_prefill_tokens, inflight = chosen.router_inflight,
                decoding = chosen.decoding, best_decoding = best.decoding,
                best_worker = %best.worker_id, best_overlap = best.overlap.blocks,
                best_pending = best.pending_prefill_tokens, best_inflight = best.router_inflight,
                prompt_tokens = token_ids.len(), "routed"
            );
        }
        let prefill_tokens = (token_ids.len() as u64)
            .saturating_sub(overlap_blocks as u64 * chosen.block_size as u64);
        let (generation, card_digest, kv_events) =
            (entry.reg.generation, entry.card_digest, entry.reg.kv_events);
        let (bs, salt) = configs[chosen_at];
        let blocks = (token_ids.len() as u64).div_ceil(chosen.block_size.max(1) as u64);
        if !kv_events && self.policy.needs_overlap() {
            // No events will tell us what it caches: assume it keeps this prompt.
            let h = hashed.of(token_ids, bs, salt).to_vec();
            self.notify(ToIndexer::Routed(wid, h));
        }
        let prefill_worker =
            self.pick_prefill(model, token_ids, &mut hashed, prefill_tokens, exclude, now);
        let ev = self
            .active
            .add_own(id, wid, generation, (prefill_tokens, blocks), now);
        self.timings.total.observe(t0.elapsed());
        Ok((
            RouteDecision {
                worker_id: wid,
                generation,
                prefill_tokens,
                overlap_blocks,
                prefill_worker,
                card_digest,
            },
            ev,
        ))
    }

    /// A prefill worker for a request that leaves `uncached` prompt tokens
    /// to its decode worker (see [`DisaggPolicy`]).
    fn pick_prefill(
        &mut self,
        model: &ModelName,
        token_ids: &[u32],
        hashed: &mut Hashed,
        uncached: u64,
        exclude: &[WorkerId],
        now: Instant,
    ) -> Option<WorkerId> {
        let prefill: Vec<&WorkerEntry> = self
            .registry
            .entries()
            .filter(|e| {
                &e.reg.model.name == model
                    && e.reg.role == WorkerRole::Prefill
                    && self.registry.routable(e, now)
                    && !self.registry.is_overloaded(e.reg.worker_id, now)
                    && !exclude.contains(&e.reg.worker_id)
            })
            .collect();
        if prefill.is_empty() || uncached < self.disagg.min_remote_prefill_tokens {
            return None;
        }
        let mut candidates = Vec::with_capacity(prefill.len());
        for e in prefill {
            let h = hashed.of(token_ids, e.reg.model.block_size, e.reg.model.hash_salt);
            let overlap_blocks = self
                .kv
                .read()
                .and_then(|kv| {
                    kv.index
                        .find_matches(h)
                        .into_iter()
                        .find(|(w, _)| *w == e.reg.worker_id)
                })
                .map(|(_, o)| o.blocks)
                .unwrap_or(0);
            candidates.push(PrefillCandidate {
                worker_id: e.reg.worker_id,
                overlap_blocks,
                reported: e.reg.load.clone(),
                assigned: self
                    .prefill_sent
                    .get(&e.reg.worker_id)
                    .copied()
                    .unwrap_or(0),
            });
        }
        let picked = self.disagg.pick(uncached, &candidates);
        if let Some(w) = picked {
            *self.prefill_sent.entry(w).or_default() += 1;
        }
        picked
    }

    /// What each worker serving `model` holds of `token_ids`, each hashed
    /// with its own block configuration (for debugging routing).
    pub fn overlap(&self, model: &ModelName, token_ids: &[u32]) -> Vec<(WorkerId, Overlap)> {
        let mut hashed = Hashed::default();
        let mut out = Vec::new();
        for e in self
            .registry
            .entries()
            .filter(|e| &e.reg.model.name == model)
        {
            let h = hashed.of(token_ids, e.reg.model.block_size, e.reg.model.hash_salt);
            if let Some(m) = self.kv.read().and_then(|kv| {
                kv.index
                    .find_matches(h)
                    .into_iter()
                    .find(|(w, _)| *w == e.reg.worker_id)
            }) {
                out.push(m);
            }
        }
        out
    }

    /// An own request finished (in any way); returns the event to publish
    /// (only if a peer may hold it).
    pub fn release(&mut self, id: RequestId) -> Option<ActiveLoadEvent> {
        self.active.finish_own(id)
    }

    /// An own request its worker had taken ended: released, and that
    /// worker has a place again (an overload mark on it ends).
    pub fn finished(&mut self, id: RequestId) -> Option<ActiveLoadEvent> {
        if let Some(w) = self.active.worker_of_own(id) {
            self.registry.room_freed(w);
        }
        self.release(id)
    }

    /// Every served model with its workers (any state).
    pub fn models(&self) -> Vec<ModelEntry> {
        self.registry.models()
    }

    pub fn workers(&self) -> Vec<WorkerEntry> {
        self.registry.entries().cloned().collect()
    }
}

#[cfg(test)]
#[path = "state_tests.rs"]
mod tests;
