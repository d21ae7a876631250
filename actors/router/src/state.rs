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
use crate::kv_sync::{KvStats, KvSync};
use crate::policy::{Candidate, KvCostWeights, RouteRequest, RoutingPolicy};
pub use crate::registry::{ModelEntry, WorkerEntry};
use crate::registry::{Registry, Upserted};
use crate::timing::RouteTimings;
use dynamo_bus_schema::blocks::{sequence_hashes, SequenceHash};
use dynamo_bus_schema::{ActiveLoadEvent, KvDumpTiered, KvEventBatch, RequestId, RouterId};
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
            kv: KvSync::default(),
            // Peers heartbeat every second; entries outlive any request deadline.
            active: ActiveLoad::new(id, Duration::from_secs(3600), Duration::from_secs(3)),
            timings: RouteTimings::default(),
            approx: Approx::default(),
            catch_up: CatchUp::done(),
            disagg: DisaggPolicy::default(),
            overload_backoff: DEFAULT_OVERLOAD_BACKOFF,
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
    /// registration says which generation is real.
    pub fn kv_batch(&mut self, b: KvEventBatch) {
        match self.registry.get(b.worker_id) {
            Some(e) if e.reg.generation == b.generation && e.reg.kv_events => {
                self.kv.batch(b);
            }
            _ => self.kv.stats.ignored += 1,
        }
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
    }

    /// A load report arrived; it also counts as a sign of life.
    pub fn load(&mut self, report: LoadReport, now: Instant) {
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
        &self,
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
            });
        }
        self.disagg.pick(uncached, &candidates)
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
mod tests {
    use super::*;
    use crate::policy::{LeastLoaded, RoundRobin};
    use dynamo_bus_schema::*;

    fn route(
        s: &mut RouterState,
        m: &ModelName,
        exclude: &[WorkerId],
        now: Instant,
    ) -> Result<RouteDecision, RouteError> {
        s.route(RequestId::random(), m, &[], exclude, now)
            .map(|(d, _)| d)
    }

    fn reg(id: u64, gen: u64, model: &str) -> WorkerRegistration {
        WorkerRegistration {
            worker_id: WorkerId(id),
            generation: gen,
            node_id: NodeId("n".into()),
            pid: 1,
            role: WorkerRole::Aggregated,
            state: WorkerState::Serving,
            engine: "mocker".into(),
            model: ModelCard {
                name: ModelName(model.into()),
                context_length: 100,
                block_size: 16,
                chat_template: String::new(),
                bos_token: None,
                eos_token: None,
                eos_token_ids: vec![],
                vocab_size: 10,
                tokenizer: ArtifactRef {
                    name: "t".into(),
                    len: 0,
                    sha256: String::new(),
                },
                source: String::new(),
                hash_salt: 0,
            },
            started_unix_ms: 0,
            heartbeat_unix_ms: unix_ms(),
            load: LoadMetrics::default(),
            kv_events: true,
        }
    }

    #[test]
    fn prefill_workers_only_prefill_and_are_named_for_long_uncached_prompts() {
        let t0 = Instant::now();
        let mut s = RouterState::new(Duration::from_secs(3), Box::new(RoundRobin::default()));
        s.set_disagg(DisaggPolicy {
            min_remote_prefill_tokens: 64,
            max_prefill_queue: 2,
        });
        let m = ModelName("a".into());
        let mut p = reg(1, 1, "a");
        p.role = WorkerRole::Prefill;
        s.upsert(p.clone(), t0);
        // A prefill worker alone cannot serve.
        assert!(matches!(
            route(&mut s, &m, &[], t0),
            Err(RouteError::UnknownModel { .. })
        ));
        let mut d = reg(2, 1, "a");
        d.role = WorkerRole::Decode;
        s.upsert(d, t0);
        let long: Vec<u32> = (0..80).collect();
        let pick = |s: &mut RouterState, tokens: &[u32]| {
            s.route(RequestId::random(), &m, tokens, &[], t0)
                .map(|(d, _)| d)
                .unwrap()
        };
        let d1 = pick(&mut s, &long);
        assert_eq!(d1.worker_id, WorkerId(2));
        assert_eq!(d1.prefill_worker, Some(WorkerId(1)));
        // Short prompts stay on the decode worker.
        assert_eq!(pick(&mut s, &long[..40]).prefill_worker, None);
        // A saturated prefill worker is skipped.
        p.load.waiting_seqs = 2;
        s.upsert(p, t0);
        assert_eq!(pick(&mut s, &long).prefill_worker, None);
    }

    #[test]
    fn routes_only_to_fresh_serving_workers_of_the_model() {
        let t0 = Instant::now();
        let mut s = RouterState::new(Duration::from_secs(3), Box::new(RoundRobin::default()));
        let m = ModelName("a".into());
        assert_eq!(
            route(&mut s, &m, &[], t0),
            Err(RouteError::UnknownModel { model: "a".into() })
        );
        s.upsert(reg(1, 1, "a"), t0);
        s.upsert(reg(2, 1, "b"), t0);
        let mut draining = reg(3, 1, "a");
        draining.state = WorkerState::Draining;
        s.upsert(draining, t0);
        for _ in 0..3 {
            assert_eq!(route(&mut s, &m, &[], t0).unwrap().worker_id, WorkerId(1));
        }
        assert!(matches!(
            route(&mut s, &m, &[WorkerId(1)], t0),
            Err(RouteError::NoWorkers { registered: 2, .. })
        ));
        // Stale → not routable, then expired.
        let late = t0 + Duration::from_secs(4);
        assert!(route(&mut s, &m, &[], late).is_err());
        assert_eq!(s.expire(late).len(), 3);
        assert!(s.models().is_empty());
    }

    #[test]
    fn a_replayed_record_of_a_dead_worker_is_not_routable() {
        let t0 = Instant::now() + Duration::from_secs(10);
        let mut s = RouterState::new(Duration::from_secs(3), Box::new(RoundRobin::default()));
        let mut old = reg(1, 1, "a");
        old.heartbeat_unix_ms = unix_ms() - 60_000;
        s.upsert(old, t0);
        assert!(route(&mut s, &ModelName("a".into()), &[], t0).is_err());
    }

    #[test]
    fn workers_without_kv_events_are_tracked_approximately() {
        let t0 = Instant::now();
        let policy =
            crate::policy::build(crate::policy::PolicyKind::KvAware(KvCostWeights::default()));
        let mut s = RouterState::new(Duration::from_secs(3), policy);
        let m = ModelName("a".into());
        for id in [1, 2] {
            let mut r = reg(id, 1, "a");
            r.kv_events = false;
            s.upsert(r, t0);
        }
        let prompt: Vec<u32> = (0..64).collect();
        let first = s.route(RequestId(1), &m, &prompt, &[], t0).unwrap().0;
        s.release(RequestId(1));
        assert_eq!(
            s.overlap(&m, &prompt),
            vec![(
                first.worker_id,
                dynamo_kv_index::Overlap {
                    blocks: 4,
                    device: 4,
                    host: 0,
                    disk: 0
                }
            )]
        );
        // The same prompt follows its recorded blocks.
        let again = s.route(RequestId(2), &m, &prompt, &[], t0).unwrap().0;
        assert_eq!(again.worker_id, first.worker_id);
        assert_eq!(again.overlap_blocks, 4);
        s.release(RequestId(2));
        // Records expire with their TTL (checked on the expiry tick).
        let later = t0 + crate::approx::DEFAULT_TTL + Duration::from_secs(1);
        for id in [1, 2] {
            let mut r = reg(id, 1, "a");
            r.kv_events = false;
            s.upsert(r, later);
        }
        s.expire(later);
        assert!(s.overlap(&m, &prompt).is_empty());
    }

    /// Stores `prompt`'s blocks for worker `w` in the index, as its KV
    /// events would (hashed with its own block size and salt).
    fn store(s: &mut RouterState, w: u64, prompt: &[u32], block_size: usize, salt: u64) {
        let blocks = sequence_hashes(prompt, block_size, salt);
        s.kv.dump(KvDumpTiered {
            worker_id: WorkerId(w),
            generation: 1,
            last_event_id: EventId(0),
            tiers: vec![KvTierBlocks {
                tier: StorageTier::Device,
                blocks,
            }],
        });
    }

    #[test]
    fn a_misconfigured_lowest_id_worker_does_not_spoil_overlap_for_the_others() {
        let t0 = Instant::now();
        let policy =
            crate::policy::build(crate::policy::PolicyKind::KvAware(KvCostWeights::default()));
        let mut s = RouterState::new(Duration::from_secs(3), policy);
        let m = ModelName("a".into());
        // Worker 1 (lowest id, first candidate) uses 32-token blocks and
        // another salt; workers 2 and 3 use the model's 16 and salt 0.
        let mut odd = reg(1, 1, "a");
        odd.model.block_size = 32;
        odd.model.hash_salt = 99;
        odd.started_unix_ms = 5;
        s.upsert(reg(2, 1, "a"), t0);
        s.upsert(reg(3, 1, "a"), t0);
        s.upsert(odd, t0);
        assert_eq!(s.kv_mismatches(), vec![WorkerId(1)]);
        let prompt: Vec<u32> = (0..96).collect();
        store(&mut s, 3, &prompt, 16, 0);
        store(&mut s, 1, &prompt[..64], 32, 99);
        let d = s.route(RequestId(1), &m, &prompt, &[], t0).unwrap().0;
        assert_eq!(
            d.worker_id,
            WorkerId(3),
            "the worker holding the prompt wins"
        );
        assert_eq!(d.overlap_blocks, 6);
        // The odd worker's own overlap is exact too, in its own blocks.
        let o: HashMap<WorkerId, Overlap> = s.overlap(&m, &prompt).into_iter().collect();
        assert_eq!(o[&WorkerId(3)].device, 6);
        assert_eq!(o[&WorkerId(1)].device, 2);
        assert!(!o.contains_key(&WorkerId(2)));
        let d = s
            .route(RequestId(2), &m, &prompt, &[WorkerId(3)], t0)
            .unwrap()
            .0;
        assert_eq!((d.worker_id, d.overlap_blocks), (WorkerId(1), 2));
    }

    #[test]
    fn a_bogus_batch_does_not_blind_the_index() {
        let t0 = Instant::now();
        let mut s = RouterState::new(Duration::from_secs(3), Box::new(RoundRobin::default()));
        s.upsert(reg(1, 5, "a"), t0);
        store_gen(&mut s, 1, 5, &[10]);
        let batch = |generation, id, block| KvEventBatch {
            worker_id: WorkerId(1),
            generation,
            events: vec![KvEvent {
                event_id: EventId(id),
                kind: KvEventKind::Stored,
                tier: StorageTier::Device,
                parent: None,
                blocks: vec![SequenceHash(block)],
            }],
            published_unix_ms: unix_ms(),
        };
        // A far-future generation and an unknown worker's batch are dropped…
        s.kv_batch(batch(u64::MAX, 1, 66));
        let mut stranger = batch(5, 1, 77);
        stranger.worker_id = WorkerId(9);
        s.kv_batch(stranger);
        assert_eq!(s.kv_stats().ignored, 2);
        // …and the real events still apply.
        s.kv_batch(batch(5, 1, 11));
        assert_eq!(s.kv_blocks_of(WorkerId(1)), [2, 0, 0]);
    }

    fn store_gen(s: &mut RouterState, w: u64, generation: u64, blocks: &[u64]) {
        s.kv_dump(KvDumpTiered {
            worker_id: WorkerId(w),
            generation,
            last_event_id: EventId(0),
            tiers: vec![KvTierBlocks {
                tier: StorageTier::Device,
                blocks: blocks.iter().map(|b| SequenceHash(*b)).collect(),
            }],
        });
    }

    #[test]
    fn an_overloaded_worker_is_avoided_while_another_can_take_it() {
        let t0 = Instant::now();
        let mut s = RouterState::new(Duration::from_secs(3), Box::new(RoundRobin::default()));
        let m = ModelName("a".into());
        s.upsert(reg(1, 1, "a"), t0);
        s.upsert(reg(2, 1, "a"), t0);
        s.overloaded(WorkerId(1), t0);
        for _ in 0..4 {
            assert_eq!(route(&mut s, &m, &[], t0).unwrap().worker_id, WorkerId(2));
        }
        s.overloaded(WorkerId(2), t0);
        assert!(matches!(
            route(&mut s, &m, &[], t0),
            Err(RouteError::Overloaded { .. })
        ));
        // The marks expire.
        let later = t0 + DEFAULT_OVERLOAD_BACKOFF + Duration::from_millis(1);
        s.upsert(reg(1, 1, "a"), later);
        s.upsert(reg(2, 1, "a"), later);
        s.expire(later);
        assert!(route(&mut s, &m, &[], later).is_ok());
    }

    #[test]
    fn a_models_card_is_its_newest_workers_with_the_routed_digest() {
        let t0 = Instant::now();
        let mut s = RouterState::new(Duration::from_secs(3), Box::new(RoundRobin::default()));
        let m = ModelName("a".into());
        let old = reg(1, 1, "a");
        let mut new = reg(2, 1, "a");
        new.started_unix_ms = 10;
        new.model.context_length = 200;
        s.upsert(old.clone(), t0);
        s.upsert(new.clone(), t0);
        let models = s.models();
        assert_eq!(models.len(), 1);
        assert_eq!(models[0].card.context_length, 200);
        assert_eq!(models[0].card_digest, new.model.digest());
        assert_ne!(old.model.digest(), new.model.digest());
        let d = route(&mut s, &m, &[], t0).unwrap();
        let want = if d.worker_id == WorkerId(1) {
            &old
        } else {
            &new
        };
        assert_eq!(d.card_digest, want.model.digest());
    }

    #[test]
    fn a_worker_with_another_block_config_is_flagged() {
        let t0 = Instant::now();
        let mut s = RouterState::new(Duration::from_secs(3), Box::new(RoundRobin::default()));
        s.upsert(reg(1, 1, "a"), t0);
        let mut odd = reg(2, 1, "a");
        odd.started_unix_ms = 5;
        odd.model.block_size = 32;
        s.upsert(odd, t0);
        s.upsert(reg(3, 1, "b"), t0); // another model: no comparison
        assert_eq!(s.kv_mismatches(), vec![WorkerId(2)]);
    }

    #[test]
    fn inflight_tracks_routes_and_resets_on_restart() {
        let t0 = Instant::now();
        let mut s = RouterState::new(Duration::from_secs(3), Box::new(LeastLoaded::default()));
        let m = ModelName("a".into());
        s.upsert(reg(1, 1, "a"), t0);
        s.upsert(reg(2, 1, "a"), t0);
        let ids: Vec<RequestId> = (0..4).map(RequestId).collect();
        let d: Vec<RouteDecision> = ids
            .iter()
            .map(|id| s.route(*id, &m, &[], &[], t0).unwrap().0)
            .collect();
        let on1 = d.iter().filter(|x| x.worker_id == WorkerId(1)).count();
        assert_eq!(on1, 2, "least-loaded shares evenly");
        assert_eq!(s.worker_load(WorkerId(1)).inflight, 2);
        s.upsert(reg(1, 2, "a"), t0); // worker 1 restarted: its requests are gone
        assert_eq!(s.worker_load(WorkerId(1)).inflight, 0);
        for id in &ids {
            s.release(*id); // no underflow for the voided ones
        }
        assert_eq!(s.worker_load(WorkerId(2)).inflight, 0);
        s.upsert(reg(1, 1, "a"), t0); // stale record ignored
        let w1 = s
            .workers()
            .into_iter()
            .find(|w| w.reg.worker_id == WorkerId(1))
            .unwrap();
        assert_eq!(w1.reg.generation, 2);
    }
}
