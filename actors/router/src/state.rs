//! The router's synchronous state: the worker registry, the KV index, the
//! shared active load, and the policy that picks a worker.
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
use crate::approx::Approx;
use crate::catch_up::CatchUp;
use crate::disagg::{DisaggPolicy, PrefillCandidate};
use crate::kv_sync::{GapFill, KvStats, KvSync};

/// A snapshot older than this many intervals (plus one per live replica
/// with a lower id) is written by a replica that is not the elected writer.
pub const STALE_INTERVALS: u32 = 3;
use crate::policy::{Candidate, KvCostWeights, RouteRequest, RoutingPolicy};
pub use crate::registry::{ModelEntry, WorkerEntry};
use crate::registry::{Registry, Upserted};
use crate::timing::RouteTimings;
use dynamo_bus_schema::blocks::{sequence_hashes, SequenceHash};
use dynamo_bus_schema::{
    ActiveLoadEvent, KvDumpTiered, KvEvent, KvEventBatch, RequestId, RouterId,
};
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
    kv: KvSync,
    active: ActiveLoad,
    timings: RouteTimings,
    approx: Approx,
    catch_up: CatchUp,
    disagg: DisaggPolicy,
    /// Prompts sent to each prefill worker since its last load report
    /// (see [`crate::disagg`]); at most one entry per registered worker.
    prefill_sent: HashMap<WorkerId, u32>,
    overload_backoff: Duration,
    /// When this replica last took a snapshot of its KV index.
    last_kv_snapshot: Option<Instant>,
    /// The stream sequence the last snapshot was tagged with.
    last_kv_snapshot_tag: u64,
    /// When this replica first found no snapshot in the store (cleared
    /// once it finds one).
    kv_snapshot_missing_since: Option<Instant>,
}

impl RouterState {
    pub fn new(ttl: Duration, policy: Box<dyn RoutingPolicy>) -> Self {
        Self::with_id(RouterId::random(), ttl, policy)
    }

    pub fn with_id(id: RouterId, ttl: Duration, policy: Box<dyn RoutingPolicy>) -> Self {
        RouterState {
            registry: Registry::new(ttl),
            policy,
            kv: KvSync::default(),
            // Peers heartbeat every second; entries outlive any request deadline.
            active: ActiveLoad::new(id, Duration::from_secs(3600), Duration::from_secs(3)),
            timings: RouteTimings::default(),
            approx: Approx::default(),
            catch_up: CatchUp::done(),
            disagg: DisaggPolicy::default(),
            prefill_sent: HashMap::new(),
            overload_backoff: DEFAULT_OVERLOAD_BACKOFF,
            last_kv_snapshot: None,
            last_kv_snapshot_tag: 0,
            kv_snapshot_missing_since: None,
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
        self.kv.begin_replay();
    }

    /// Loads a KV index snapshot (while catching up, before the stream is
    /// replayed from its sequence); returns the blocks loaded.
    pub fn kv_restore(
        &mut self,
        snap: &dynamo_bus_schema::KvIndexSnapshot,
    ) -> Result<u64, dynamo_kv_index::SnapshotError> {
        if !self.kv.replaying() {
            // Too late: the replay was ended (overdue) and dumps went out.
            tracing::warn!("a KV index snapshot arrived after catch-up; ignored");
            return Ok(0);
        }
        let registry = &self.registry;
        self.kv.restore(snap, |w| {
            registry
                .get(w)
                .filter(|e| e.reg.kv_events)
                .map(|e| e.reg.generation)
        })
    }

    /// The stream lost messages after the snapshot: dump every worker.
    pub fn kv_stream_truncated(&mut self) {
        if !self.kv.replaying() {
            return;
        }
        self.kv.stream_truncated();
    }

    /// A batch read back from the stream while catching up.
    pub fn kv_replayed(&mut self, b: KvEventBatch) {
        self.kv.stats.replayed += 1;
        self.kv_batch(b);
    }

    /// The stream replay is over (or could not run): dumps may go out.
    pub fn kv_replay_done(&mut self) {
        if self.kv.replaying() {
            self.kv.end_replay();
        }
        self.catch_up.kv_replayed();
    }

    /// Ends a replay that has run past `max` since the catch-up began (its
    /// feed is stuck): the workers it did not cover are dumped.
    pub fn kv_replay_overdue(&mut self, now: Instant, max: Duration) -> bool {
        if self.kv.replaying() && self.catch_up.waited(now) >= max {
            tracing::warn!("the KV events replay is overdue; syncing workers from dumps");
            self.kv_replay_done();
            return true;
        }
        false
    }

    /// A snapshot of the KV index, if this replica should write one now:
    /// it routes (caught up), `cfg.events` were applied or `cfg.interval`
    /// passed since its last, and it is the writer: the live replica with
    /// the lowest id, or, when the store's newest snapshot is stale (the
    /// elected writer does not write: snapshots off, writes failing), any
    /// replica, the `k`-th lowest once it is `STALE_INTERVALS + k`
    /// intervals old (missing counts from when this replica first saw it
    /// missing), so that they do not all write at once.
    /// `stream_seq`: every stream message up to it is applied.
    pub fn kv_snapshot(
        &mut self,
        stream_seq: u64,
        stored: crate::kv_stream::StoredSnapshot,
        cfg: &crate::kv_stream::KvSnapshotConfig,
        now: Instant,
    ) -> Option<dynamo_bus_schema::KvIndexSnapshot> {
        use crate::kv_stream::StoredSnapshot;
        let me = self.router_id();
        let rank = self.active.peers().filter(|p| p.0 < me.0).count() as u32;
        let age = match stored {
            StoredSnapshot::Age(a) => {
                self.kv_snapshot_missing_since = None;
                Some(a)
            }
            StoredSnapshot::Missing => {
                let since = *self.kv_snapshot_missing_since.get_or_insert(now);
                Some(now.duration_since(since))
            }
            StoredSnapshot::Unknown => None,
        };
        let stale_after = cfg.interval * (STALE_INTERVALS + rank);
        let lowest = rank == 0 || age.is_some_and(|a| a >= stale_after);
        let changed = self.kv.since_snapshot();
        let interval_over = self
            .last_kv_snapshot
            .is_none_or(|t| now.duration_since(t) >= cfg.interval);
        // Quiet since the last snapshot, which was tagged a period behind
        // the stream: nothing was applied since, so everything up to the
        // stream's sequence now is in it; write it again with that tag, so
        // that a replica loading it replays nothing it holds.
        let retag = changed == 0
            && self.last_kv_snapshot.is_some()
            && stream_seq > self.last_kv_snapshot_tag;
        let due = changed >= cfg.events || ((changed > 0 || retag) && interval_over);
        // A replica that routes nothing still finishes catching up here.
        let caught_up = self.catch_up.check(self.kv.syncing(), now);
        if !cfg.enabled || !lowest || !due || !caught_up || self.kv.replaying() {
            return None;
        }
        self.last_kv_snapshot = Some(now);
        self.last_kv_snapshot_tag = stream_seq;
        Some(self.kv.snapshot(stream_seq, me))
    }

    /// The last snapshot taken was not stored: the next interval takes one
    /// again (as a re-tag if nothing was applied meanwhile).
    pub fn kv_snapshot_not_written(&mut self) {
        self.last_kv_snapshot_tag = 0;
    }

    /// The registry's history has been read.
    pub fn registry_loaded(&mut self) {
        self.catch_up.registry_loaded();
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

    /// The active load, for a peer that starts late.
    pub fn active_snapshot(&self) -> Vec<ActiveLoadEvent> {
        self.active.snapshot()
    }

    /// A worker's load as all replicas together see it.
    pub fn worker_load(&self, w: WorkerId) -> WorkerLoad {
        self.active.load_of(w)
    }

    /// The first token of an own request came back; returns the event to publish.
    pub fn prefill_done(&mut self, id: RequestId) -> Option<ActiveLoadEvent> {
        self.active.prefill_done_own(id)
    }

    /// A batch of KV events arrived. Only a registered worker's batches of
    /// its registered generation are applied: anything else (a worker not
    /// registered yet, a stale or bogus generation) is dropped and counted,
    /// and the gap it may leave is repaired from a dump once the worker's
    /// registration says which generation is real. Returns true when the
    /// worker now needs a repair (a gap, or a worker first seen).
    pub fn kv_batch(&mut self, b: KvEventBatch) -> bool {
        match self.registry.get(b.worker_id) {
            Some(e) if e.reg.generation == b.generation && e.reg.kv_events => self.kv.batch(b),
            _ => {
                self.kv.stats.ignored += 1;
                false
            }
        }
    }

    /// Gaps to fill from the KV events stream now.
    pub fn kv_fills_due(&mut self, now: Instant) -> Vec<GapFill> {
        self.kv.fills_due(now)
    }

    /// The stream's answer to a gap fill.
    pub fn kv_filled(&mut self, fill: &GapFill, found: Result<Vec<KvEvent>, String>) {
        self.kv.filled(fill, found)
    }

    /// A worker's block table arrived (applied only for its registered generation).
    pub fn kv_dump(&mut self, d: KvDumpTiered) {
        match self.registry.get(d.worker_id) {
            Some(e) if e.reg.generation == d.generation => self.kv.dump(d),
            _ => self.kv.stats.ignored += 1,
        }
    }

    /// Workers whose block table must be (re)requested now.
    pub fn kv_dumps_due(&mut self, now: Instant) -> Vec<WorkerId> {
        self.kv.dumps_due(now)
    }

    pub fn kv_stats(&self) -> KvStats {
        self.kv.stats
    }

    /// Blocks the index holds for `w` (device, host, disk).
    pub fn kv_blocks_of(&self, w: WorkerId) -> [u64; 3] {
        self.kv.index.blocks_of(w)
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
                if kv_events {
                    self.kv.worker_seen(id, generation);
                }
            }
            Upserted::Restarted => {
                tracing::info!(worker = %id, generation, "worker restarted");
                self.active.worker_changed(id, generation);
                self.approx.forget(id);
                if kv_events {
                    self.kv.worker_seen(id, generation);
                } else {
                    self.kv.worker_gone(id);
                }
            }
            Upserted::Refreshed | Upserted::Stale => {}
        }
    }

    pub fn timings(&self) -> &RouteTimings {
        &self.timings
    }

    /// This router's view of its index, for `dynamoctl status`.
    pub fn info(&self) -> dynamo_bus_schema::RouterInfo {
        let st = self.kv.stats;
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
                        blocks: self.kv.index.blocks_of(w),
                        event_lag_ms: self.kv.lag_ms(w),
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
        self.kv.worker_gone(id);
        self.active.worker_changed(id, u64::MAX);
        self.approx.forget(id);
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
            self.kv.worker_gone(*id);
            self.active.worker_changed(*id, u64::MAX);
            self.approx.forget(*id);
            self.prefill_sent.remove(id);
        }
        self.active.expire(now);
        self.approx.expire(&mut self.kv.index, now);
        dead
    }

    /// Picks a worker for request `id`, skipping `exclude`; returns the
    /// decision and the load event to publish to the other replicas.
    pub fn route(
        &mut self,
        id: RequestId,
        model: &ModelName,
        token_ids: &[u32],
        exclude: &[WorkerId],
        now: Instant,
    ) -> Result<(RouteDecision, ActiveLoadEvent), RouteError> {
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
    ) -> Result<(RouteDecision, ActiveLoadEvent), RouteError> {
        if !self.catch_up.check(self.kv.syncing(), now) {
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
            // for the candidates hashed that way.
            for (cfg, h) in &hashed.by_config {
                let matches: HashMap<WorkerId, Overlap> =
                    self.kv.index.find_matches(h).into_iter().collect();
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
            self.approx.record(&mut self.kv.index, wid, &h, now);
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
                .index
                .find_matches(h)
                .into_iter()
                .find(|(w, _)| *w == e.reg.worker_id)
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
            if let Some(m) = self
                .kv
                .index
                .find_matches(h)
                .into_iter()
                .find(|(w, _)| *w == e.reg.worker_id)
            {
                out.push(m);
            }
        }
        out
    }

    /// An own request finished (in any way); returns the event to publish.
    pub fn release(&mut self, id: RequestId) -> Option<ActiveLoadEvent> {
        self.active.finish_own(id)
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
