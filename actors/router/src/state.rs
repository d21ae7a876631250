//! The router's synchronous state: the worker registry and the policy.
//!
//! Invariants:
//! - a worker is routable only if its registration is `Serving`, serves the
//!   requested model, and was refreshed within the TTL;
//! - a newer `generation` of a worker resets the router's in-flight count
//!   for it (the old engine and its requests are gone);
//! - `release` never underflows and ignores releases for an older generation;
//! - prefill workers (role `Prefill`) never get whole requests: they are
//!   only named as a decision's `prefill_worker`.

use crate::active::{ActiveLoad, WorkerLoad};
use crate::approx::Approx;
use crate::catch_up::CatchUp;
use crate::disagg::{DisaggPolicy, PrefillCandidate};
use crate::kv_sync::{KvStats, KvSync};
use crate::policy::{Candidate, KvCostWeights, RouteRequest, RoutingPolicy};
use crate::timing::RouteTimings;
use dynamo_bus_schema::blocks::{sequence_hashes, SequenceHash};
use dynamo_bus_schema::{
    unix_ms, LoadReport, ModelCard, ModelName, WorkerId, WorkerRegistration, WorkerRole,
    WorkerState,
};
use dynamo_bus_schema::{ActiveLoadEvent, KvDumpTiered, KvEventBatch, RequestId, RouterId};
use dynamo_kv_index::Overlap;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use thiserror::Error;

/// Whether a worker of this role runs whole requests (prefill workers only
/// prefill for others).
fn generates(role: WorkerRole) -> bool {
    role != WorkerRole::Prefill
}

#[derive(Clone, Debug, Error, PartialEq)]
pub enum RouteError {
    #[error("model {model:?} is not served by any registered worker")]
    UnknownModel { model: String },
    #[error("no worker is available for model {model:?} ({registered} registered, none serving and fresh)")]
    NoWorkers { model: String, registered: usize },
    #[error("the router is still loading its view of the cluster")]
    CatchingUp,
}

#[derive(Clone, Debug)]
pub struct WorkerEntry {
    pub reg: WorkerRegistration,
    pub last_seen: Instant,
    /// Its block size or hash salt differs from its model's other workers.
    pub kv_mismatch: bool,
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
}

/// A served model and the workers serving it.
#[derive(Clone, Debug)]
pub struct ModelEntry {
    pub card: ModelCard,
    pub workers: Vec<WorkerId>,
}

pub struct RouterState {
    ttl: Duration,
    workers: BTreeMap<WorkerId, WorkerEntry>,
    policy: Box<dyn RoutingPolicy>,
    kv: KvSync,
    active: ActiveLoad,
    timings: RouteTimings,
    approx: Approx,
    catch_up: CatchUp,
    disagg: DisaggPolicy,
}

impl RouterState {
    pub fn new(ttl: Duration, policy: Box<dyn RoutingPolicy>) -> Self {
        Self::with_id(RouterId::random(), ttl, policy)
    }

    pub fn with_id(id: RouterId, ttl: Duration, policy: Box<dyn RoutingPolicy>) -> Self {
        RouterState {
            ttl,
            workers: BTreeMap::new(),
            policy,
            kv: KvSync::default(),
            // Peers heartbeat every second; entries outlive any request deadline.
            active: ActiveLoad::new(id, Duration::from_secs(3600), Duration::from_secs(3)),
            timings: RouteTimings::default(),
            approx: Approx::default(),
            catch_up: CatchUp::done(),
            disagg: DisaggPolicy::default(),
        }
    }

    /// Sets when prefill moves to prefill workers.
    pub fn set_disagg(&mut self, policy: DisaggPolicy) {
        self.disagg = policy;
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

    /// A batch of KV events arrived.
    pub fn kv_batch(&mut self, b: KvEventBatch) {
        self.kv.batch(b);
    }

    /// A worker's block table arrived.
    pub fn kv_dump(&mut self, d: KvDumpTiered) {
        self.kv.dump(d);
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

    /// A registration or heartbeat arrived. Its own heartbeat time counts:
    /// a record replayed from the bucket for a worker that died long ago is
    /// not taken as a sign of life.
    pub fn upsert(&mut self, reg: WorkerRegistration, now: Instant) {
        let id = reg.worker_id;
        self.upsert_inner(reg, now);
        self.check_kv_config(id);
    }

    fn upsert_inner(&mut self, reg: WorkerRegistration, now: Instant) {
        let age = Duration::from_millis(unix_ms().saturating_sub(reg.heartbeat_unix_ms));
        let now = now
            .checked_sub(age.min(self.ttl + Duration::from_secs(1)))
            .unwrap_or(now);
        match self.workers.get_mut(&reg.worker_id) {
            Some(e) => {
                if reg.generation > e.reg.generation {
                    tracing::info!(worker = %reg.worker_id, generation = reg.generation, "worker restarted");
                    self.active.worker_changed(reg.worker_id, reg.generation);
                    self.approx.forget(reg.worker_id);
                    if reg.kv_events {
                        self.kv.worker_seen(reg.worker_id, reg.generation);
                    } else {
                        self.kv.worker_gone(reg.worker_id);
                    }
                } else if reg.generation < e.reg.generation {
                    return; // stale record from before a restart
                }
                e.reg = reg;
                e.last_seen = now;
            }
            None => {
                tracing::info!(worker = %reg.worker_id, node = %reg.node_id, model = %reg.model.name, kv_events = reg.kv_events, "worker registered");
                if reg.kv_events {
                    self.kv.worker_seen(reg.worker_id, reg.generation);
                }
                self.workers.insert(
                    reg.worker_id,
                    WorkerEntry {
                        reg,
                        last_seen: now,
                        kv_mismatch: false,
                    },
                );
            }
        }
    }

    /// Marks a worker whose block size or hash salt differs from the first
    /// registered worker of the same model, and says so loudly: the router
    /// could never match its blocks and would route as if it had none.
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
            .min_by_key(|e| e.reg.started_unix_ms)
            .map(|e| {
                (
                    e.reg.worker_id,
                    e.reg.model.block_size,
                    e.reg.model.hash_salt,
                )
            });
        let mismatch = matches!(reference, Some((_, bs, salt)) if (bs, salt) != mine);
        let e = self.workers.get_mut(&id).expect("present");
        if mismatch && !e.kv_mismatch {
            let (rw, bs, salt) = reference.expect("mismatch has a reference");
            tracing::error!(
                worker = %id, model = %model, block_size = mine.0, hash_salt = mine.1,
                reference_worker = %rw, reference_block_size = bs, reference_hash_salt = salt,
                "KV block configuration mismatch: this worker's blocks can never match the router's hashes; it is excluded from KV-aware scoring"
            );
        }
        e.kv_mismatch = mismatch;
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
                .workers
                .values()
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
        self.workers
            .values()
            .filter(|e| e.kv_mismatch)
            .map(|e| e.reg.worker_id)
            .collect()
    }

    /// A worker's registration was deleted (graceful shutdown).
    pub fn remove(&mut self, id: WorkerId) {
        if self.workers.remove(&id).is_some() {
            tracing::info!(worker = %id, "worker deregistered");
        }
        self.kv.worker_gone(id);
        self.active.worker_changed(id, u64::MAX);
        self.approx.forget(id);
    }

    /// A load report arrived; it also counts as a sign of life.
    pub fn load(&mut self, report: LoadReport, now: Instant) {
        if let Some(e) = self.workers.get_mut(&report.worker_id) {
            if report.generation == e.reg.generation {
                e.reg.load = report.load;
                e.last_seen = now;
            }
        }
    }

    /// Drops workers not heard from within the TTL; returns them.
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
            self.workers.remove(id);
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
        let ttl = self.ttl;
        let mut registered = 0;
        let candidates: Vec<Candidate> = self
            .workers
            .values()
            .filter(|e| &e.reg.model.name == model && generates(e.reg.role))
            .inspect(|_| registered += 1)
            .filter(|e| {
                e.reg.state == WorkerState::Serving
                    && now.duration_since(e.last_seen) <= ttl
                    && !exclude.contains(&e.reg.worker_id)
            })
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
        if candidates.is_empty() {
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
        let mut candidates = candidates;
        let mut hashes = None;
        if self.policy.needs_overlap() {
            // Every candidate serves `model`; they share its block size and salt.
            let card = &self.workers[&candidates[0].worker_id].reg.model;
            let th = Instant::now();
            let h = sequence_hashes(token_ids, card.block_size as usize, card.hash_salt);
            let t1 = Instant::now();
            let matches = self.kv.index.find_matches(&h);
            hashes = Some(h);
            self.timings.hashing.observe(t1 - th);
            self.timings.find_matches.observe(t1.elapsed());
            for c in &mut candidates {
                if self.workers[&c.worker_id].kv_mismatch {
                    continue;
                }
                if let Some((_, o)) = matches.iter().find(|(w, _)| *w == c.worker_id) {
                    c.overlap = *o;
                }
            }
        }
        let wid = self.policy.select(
            &RouteRequest {
                model,
                token_ids,
                weights,
            },
            &candidates,
        );
        let chosen = candidates
            .iter()
            .find(|c| c.worker_id == wid)
            .expect("policy picked a candidate");
        let overlap_blocks = chosen.overlap.blocks;
        let prefill_tokens = (token_ids.len() as u64)
            .saturating_sub(overlap_blocks as u64 * chosen.block_size as u64);
        let generation = self.workers[&wid].reg.generation;
        if let Some(h) = &hashes {
            if !self.workers[&wid].reg.kv_events {
                // No events will tell us what it caches: assume it keeps this prompt.
                self.approx.record(&mut self.kv.index, wid, h, now);
            }
        }
        let prefill_worker = self.pick_prefill(
            model,
            token_ids,
            hashes.as_deref(),
            prefill_tokens,
            exclude,
            now,
        );
        let blocks = (token_ids.len() as u64).div_ceil(chosen.block_size.max(1) as u64);
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
        hashes: Option<&[SequenceHash]>,
        uncached: u64,
        exclude: &[WorkerId],
        now: Instant,
    ) -> Option<WorkerId> {
        let candidates: Vec<PrefillCandidate> = self
            .workers
            .values()
            .filter(|e| {
                &e.reg.model.name == model
                    && e.reg.role == WorkerRole::Prefill
                    && e.reg.state == WorkerState::Serving
                    && now.duration_since(e.last_seen) <= self.ttl
                    && !exclude.contains(&e.reg.worker_id)
            })
            .map(|e| PrefillCandidate {
                worker_id: e.reg.worker_id,
                overlap_blocks: 0,
                reported: e.reg.load.clone(),
            })
            .collect();
        if candidates.is_empty() {
            return None;
        }
        let mut candidates = candidates;
        let card = &self.workers[&candidates[0].worker_id].reg.model;
        let computed;
        let h = match hashes {
            Some(h) => h,
            None => {
                computed = sequence_hashes(token_ids, card.block_size as usize, card.hash_salt);
                &computed
            }
        };
        {
            let matches = self.kv.index.find_matches(h);
            for c in &mut candidates {
                if let Some((_, o)) = matches.iter().find(|(w, _)| *w == c.worker_id) {
                    c.overlap_blocks = o.blocks;
                }
            }
        }
        self.disagg.pick(uncached, &candidates)
    }

    /// What each worker serving `model` holds of `token_ids` (for debugging routing).
    pub fn overlap(&self, model: &ModelName, token_ids: &[u32]) -> Vec<(WorkerId, Overlap)> {
        let Some(card) = self
            .workers
            .values()
            .find(|e| &e.reg.model.name == model)
            .map(|e| &e.reg.model)
        else {
            return Vec::new();
        };
        let hashes = sequence_hashes(token_ids, card.block_size as usize, card.hash_salt);
        self.kv.index.find_matches(&hashes)
    }

    /// An own request finished (in any way); returns the event to publish.
    pub fn release(&mut self, id: RequestId) -> Option<ActiveLoadEvent> {
        self.active.finish_own(id)
    }

    /// Every served model with its workers (any state).
    pub fn models(&self) -> Vec<ModelEntry> {
        let mut out: BTreeMap<&ModelName, ModelEntry> = BTreeMap::new();
        for e in self.workers.values() {
            out.entry(&e.reg.model.name)
                .or_insert_with(|| ModelEntry {
                    card: e.reg.model.clone(),
                    workers: Vec::new(),
                })
                .workers
                .push(e.reg.worker_id);
        }
        out.into_values().collect()
    }

    pub fn workers(&self) -> Vec<WorkerEntry> {
        self.workers.values().cloned().collect()
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
