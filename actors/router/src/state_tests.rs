//! Unit tests of [`super::RouterState`] (routing, registry, KV scoring).
use super::*;
use crate::indexer_state::{IndexerState, STALE_INTERVALS};
use crate::kv_stream::StoredSnapshot;
use crate::policy::{LeastLoaded, RoundRobin};
use dynamo_bus_schema::*;

/// The router's indexer, filling the index the router reads (as the
/// actors wire them); `replay`: it starts by replaying the stream.
fn indexer_of(s: &RouterState, replay: bool, now: Instant) -> IndexerState {
    if replay {
        IndexerState::new(s.router_id(), s.kv().clone(), now)
    } else {
        IndexerState::live(s.router_id(), s.kv().clone(), now)
    }
}

/// Hands the indexer what the router told it, as the router actor does
/// after every message.
fn pump(s: &mut RouterState, i: &mut IndexerState, now: Instant) {
    for n in s.take_to_indexer() {
        i.notice(n, now);
    }
}

/// A snapshot just written (the elected writer is at work).
const FRESH: StoredSnapshot = StoredSnapshot::Age(std::time::Duration::ZERO);

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
    let mut r = dynamo_bus_schema::testing::registration(
        id,
        "n",
        model,
        WorkerRole::Aggregated,
        WorkerState::Serving,
        unix_ms(),
    );
    r.generation = gen;
    r
}

/// A router that prefills remotely from 64 uncached tokens.
fn disagg_state(max_prefill_queue: u32) -> RouterState {
    let mut s = RouterState::new(Duration::from_secs(3), Box::new(RoundRobin::default()));
    s.set_disagg(DisaggPolicy {
        min_remote_prefill_tokens: 64,
        max_prefill_queue,
    });
    s
}

/// A worker of model `a` in `role`.
fn role_reg(id: u64, role: WorkerRole) -> WorkerRegistration {
    let mut r = reg(id, 1, "a");
    r.role = role;
    r
}

#[test]
fn prefill_workers_only_prefill_and_are_named_for_long_uncached_prompts() {
    let t0 = Instant::now();
    let mut s = disagg_state(2);
    let m = ModelName("a".into());
    let mut p = role_reg(1, WorkerRole::Prefill);
    s.upsert(p.clone(), t0);
    // A prefill worker alone cannot serve.
    assert!(matches!(
        route(&mut s, &m, &[], t0),
        Err(RouteError::UnknownModel { .. })
    ));
    s.upsert(role_reg(2, WorkerRole::Decode), t0);
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
fn a_burst_spreads_over_prefill_workers_between_their_load_reports() {
    let t0 = Instant::now();
    let mut s = disagg_state(8);
    let m = ModelName("a".into());
    for id in [1, 2] {
        s.upsert(role_reg(id, WorkerRole::Prefill), t0);
    }
    s.upsert(role_reg(3, WorkerRole::Decode), t0);
    // Distinct prompts: no prefix decides.
    let prefill_of = |s: &mut RouterState, n: u32| {
        let prompt: Vec<u32> = (0..80).map(|t| n * 1000 + t).collect();
        s.route(RequestId::random(), &m, &prompt, &[], t0)
            .map(|(d, _)| d.prefill_worker)
            .unwrap()
    };
    let mut picked = std::collections::BTreeMap::new();
    for n in 0..6u32 {
        *picked.entry(prefill_of(&mut s, n).unwrap()).or_insert(0) += 1;
    }
    assert_eq!(picked.get(&WorkerId(1)), Some(&3), "{picked:?}");
    assert_eq!(picked.get(&WorkerId(2)), Some(&3), "{picked:?}");
    // A fresh report replaces what was counted: worker 2 reports three
    // prompts running, worker 1 reports none.
    for (id, active) in [(1, 0), (2, 3)] {
        s.load(
            LoadReport {
                worker_id: WorkerId(id),
                generation: 1,
                load: LoadMetrics {
                    active_seqs: active,
                    ..LoadMetrics::default()
                },
            },
            t0,
        );
    }
    assert_eq!(prefill_of(&mut s, 99), Some(WorkerId(1)));
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
    let policy = crate::policy::build("kv_aware".parse().expect("policy"));
    let mut s = RouterState::new(Duration::from_secs(3), policy);
    let mut i = indexer_of(&s, false, t0);
    let m = ModelName("a".into());
    for id in [1, 2] {
        let mut r = reg(id, 1, "a");
        r.kv_events = false;
        s.upsert(r, t0);
    }
    let prompt: Vec<u32> = (0..64).collect();
    let first = s.route(RequestId(1), &m, &prompt, &[], t0).unwrap().0;
    s.release(RequestId(1));
    pump(&mut s, &mut i, t0);
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
    pump(&mut s, &mut i, t0);
    // Records expire with their TTL (checked on the indexer's tick).
    let later = t0 + crate::approx::DEFAULT_TTL + Duration::from_secs(1);
    i.expire(later);
    assert!(s.overlap(&m, &prompt).is_empty());
    // A restarted worker's records go with its old engine.
    for id in [1, 2] {
        let mut r = reg(id, 1, "a");
        r.kv_events = false;
        s.upsert(r, later);
    }
    s.route(RequestId(3), &m, &prompt, &[], later).unwrap();
    pump(&mut s, &mut i, later);
    assert_eq!(s.overlap(&m, &prompt).len(), 1);
    for id in [1, 2] {
        let mut r = reg(id, 2, "a");
        r.kv_events = false;
        s.upsert(r, later);
    }
    pump(&mut s, &mut i, later);
    assert!(s.overlap(&m, &prompt).is_empty());
    // The new engine's records count from nothing: routed again, the
    // prompt is recorded again (its old reference counts were forgotten).
    let d = s.route(RequestId(4), &m, &prompt, &[], later).unwrap().0;
    pump(&mut s, &mut i, later);
    assert_eq!(
        s.overlap(&m, &prompt)
            .into_iter()
            .map(|(w, o)| (w, o.blocks))
            .collect::<Vec<_>>(),
        vec![(d.worker_id, 4)]
    );
}

/// Worker `w`'s generation-1 events `ids`, each storing one block.
fn stored(w: u64, ids: std::ops::RangeInclusive<u64>) -> KvEventBatch {
    KvEventBatch {
        worker_id: WorkerId(w),
        generation: 1,
        events: ids
            .map(|i| KvEvent {
                event_id: EventId(i),
                kind: KvEventKind::Stored,
                tier: StorageTier::Device,
                parent: None,
                blocks: vec![blocks::SequenceHash(100 * w + i)],
            })
            .collect(),
        published_unix_ms: unix_ms(),
    }
}

/// A router catching up with a worker without KV events (no dump is ever
/// waited for), its registry and peers' load read.
fn catching_up(t0: Instant) -> (RouterState, IndexerState) {
    let mut s = RouterState::new(Duration::from_secs(3), Box::new(RoundRobin::default()));
    s.begin_catch_up(t0);
    let i = indexer_of(&s, true, t0);
    let mut r = reg(1, 1, "a");
    r.kv_events = false;
    s.upsert(r, t0);
    s.registry_loaded();
    s.snapshot_done();
    (s, i)
}

#[test]
fn the_router_holds_routing_until_its_indexer_has_handled_its_notices() {
    let t0 = Instant::now();
    let m = ModelName("a".into());
    let (mut s, mut i) = catching_up(t0);
    i.replay_done(t0);
    assert_eq!(
        route(&mut s, &m, &[], t0),
        Err(RouteError::CatchingUp),
        "the indexer has not handled the router's notices"
    );
    pump(&mut s, &mut i, t0);
    assert!(route(&mut s, &m, &[], t0).is_ok());
    // Caught up stays caught up: a later worker's notice holds nothing.
    s.upsert(reg(2, 1, "a"), t0);
    assert!(route(&mut s, &m, &[], t0).is_ok());
}

#[test]
fn the_router_holds_routing_while_its_indexer_replays() {
    let t0 = Instant::now();
    let m = ModelName("a".into());
    let (mut s, mut i) = catching_up(t0);
    pump(&mut s, &mut i, t0);
    assert_eq!(
        route(&mut s, &m, &[], t0),
        Err(RouteError::CatchingUp),
        "the indexer still replays the stream"
    );
    i.replay_done(t0);
    assert!(route(&mut s, &m, &[], t0).is_ok());
}

#[test]
fn a_restarted_indexer_snapshots_only_once_its_workers_are_synced() {
    let cfg = crate::kv_stream::KvSnapshotConfig {
        enabled: true,
        interval: Duration::from_secs(10),
        events: 1,
    };
    let t0 = Instant::now();
    let mut s = RouterState::new(Duration::from_secs(3), Box::new(RoundRobin::default()));
    // The router routes already (the indexer was replaced).
    let mut i = indexer_of(&s, true, t0);
    s.upsert(reg(1, 1, "a"), t0);
    s.upsert(reg(2, 1, "a"), t0);
    s.registry_loaded();
    s.tell_view(t0);
    pump(&mut s, &mut i, t0);
    // The stream holds worker 1's history, not worker 2's.
    i.replayed(stored(1, 1..=3));
    i.replayed(stored(2, 5..=6));
    assert!(i.snapshot(9, FRESH, &cfg, t0).is_none(), "still replaying");
    // Replay over at t1: worker 2 waits for its dump.
    let t1 = t0 + Duration::from_secs(20);
    i.replay_done(t1);
    assert_eq!(i.dumps_due(t1), vec![WorkerId(2)]);
    assert!(
        i.snapshot(9, FRESH, &cfg, t1 + Duration::from_secs(1))
            .is_none(),
        "a worker still syncing would be left out"
    );
    // Its dump arrives: whole.
    store_gen(&mut i, 2, 1, &[205, 206]);
    let snap = i
        .snapshot(9, FRESH, &cfg, t1 + Duration::from_secs(2))
        .expect("whole now");
    assert_eq!(snap.workers.len(), 2);

    // A worker that never answers holds snapshots up for 5 s after the
    // replay, not for good.
    let mut s = RouterState::new(Duration::from_secs(3), Box::new(RoundRobin::default()));
    let mut i = indexer_of(&s, true, t0);
    s.upsert(reg(1, 1, "a"), t0);
    s.upsert(reg(2, 1, "a"), t0);
    s.tell_view(t0);
    pump(&mut s, &mut i, t0);
    i.replayed(stored(1, 1..=3));
    i.replay_done(t1);
    assert!(i.snapshot(9, FRESH, &cfg, t1).is_none());
    let snap = i
        .snapshot(9, FRESH, &cfg, t1 + crate::catch_up::CATCH_UP_MAX)
        .expect("past the cap");
    assert_eq!(snap.workers.len(), 1, "the silent worker is left out");
}

/// Stores `prompt`'s blocks for worker `w` in the index, as its KV
/// events would (hashed with its own block size and salt).
fn store(s: &mut RouterState, w: u64, prompt: &[u32], block_size: usize, salt: u64) {
    let blocks = sequence_hashes(prompt, block_size, salt);
    s.kv().write().dump(KvDumpTiered {
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
    let policy = crate::policy::build("kv_aware".parse().expect("policy"));
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
    let mut i = indexer_of(&s, false, t0);
    s.upsert(reg(1, 5, "a"), t0);
    pump(&mut s, &mut i, t0);
    store_gen(&mut i, 1, 5, &[10]);
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
    i.batch(batch(u64::MAX, 1, 66));
    let mut stranger = batch(5, 1, 77);
    stranger.worker_id = WorkerId(9);
    i.batch(stranger);
    assert_eq!(s.kv_stats().ignored, 2);
    // …and the real events still apply.
    i.batch(batch(5, 1, 11));
    assert_eq!(s.kv_blocks_of(WorkerId(1)), [2, 0, 0]);
    // A dump of a generation not registered is dropped too.
    store_gen(&mut i, 1, 4, &[12, 13, 14]);
    assert_eq!(s.kv_stats().ignored, 3);
    assert_eq!(s.kv_blocks_of(WorkerId(1)), [2, 0, 0]);
    // Once the worker leaves, its blocks go and its batches are dropped.
    s.remove(WorkerId(1));
    pump(&mut s, &mut i, t0);
    assert_eq!(s.kv_blocks_of(WorkerId(1)), [0, 0, 0]);
    i.batch(batch(5, 2, 15));
    assert_eq!(s.kv_stats().ignored, 4);
}

fn store_gen(i: &mut IndexerState, w: u64, generation: u64, blocks: &[u64]) {
    i.dump(KvDumpTiered {
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

fn inflight(s: &mut RouterState, id: u64, n: u32, now: Instant) {
    s.load(
        LoadReport {
            worker_id: WorkerId(id),
            generation: 1,
            load: LoadMetrics {
                inflight_requests: n,
                ..LoadMetrics::default()
            },
        },
        now,
    );
}

#[test]
fn an_overloaded_worker_is_routed_again_once_it_shows_a_place() {
    let t0 = Instant::now();
    let mut s = RouterState::new(Duration::from_secs(3), Box::new(RoundRobin::default()));
    let m = ModelName("a".into());
    s.upsert(reg(1, 1, "a"), t0);
    let overloaded =
        |s: &mut RouterState| matches!(route(s, &m, &[], t0), Err(RouteError::Overloaded { .. }));
    // Reports since the mark that never fall below their highest keep it.
    inflight(&mut s, 1, 3, t0);
    s.overloaded(WorkerId(1), t0);
    for n in [3, 4, 4] {
        inflight(&mut s, 1, n, t0);
        assert!(overloaded(&mut s), "{n} in flight");
    }
    // One fewer than the most since the mark: a request ended there.
    inflight(&mut s, 1, 3, t0);
    assert!(!overloaded(&mut s));

    // A route given back without the worker keeping it (the refused
    // request itself) does not end the mark; a request it had taken
    // ending does.
    let kept = s
        .route(RequestId(7), &m, &[], &[], t0)
        .map(|(d, _)| d)
        .unwrap();
    assert_eq!(kept.worker_id, WorkerId(1));
    let refused = RequestId(8);
    s.route(refused, &m, &[], &[], t0).unwrap();
    s.overloaded(WorkerId(1), t0);
    let _ = s.release(refused);
    assert!(overloaded(&mut s));
    let _ = s.finished(RequestId(7));
    assert!(!overloaded(&mut s));
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

#[test]
fn only_the_lowest_live_replica_snapshots_once_caught_up_and_when_due() {
    let cfg = crate::kv_stream::KvSnapshotConfig {
        enabled: true,
        interval: Duration::from_secs(10),
        events: 3,
    };
    let t0 = Instant::now();
    let mut s = RouterState::with_id(
        RouterId(5),
        Duration::from_secs(3),
        Box::new(RoundRobin::default()),
    );
    s.begin_catch_up(t0);
    let mut i = indexer_of(&s, true, t0);
    s.upsert(reg(1, 1, "a"), t0);
    s.registry_loaded();
    s.snapshot_done();
    pump(&mut s, &mut i, t0);
    let batch = |ids| stored(1, ids);
    // The replay brings worker 1's events from id 1: no dump needed.
    i.replayed(batch(1..=2));
    assert!(
        route(&mut s, &ModelName("a".into()), &[], t0).is_err(),
        "the router holds routing while the indexer replays"
    );
    s.tell_view(t0);
    pump(&mut s, &mut i, t0);
    i.replay_done(t0);
    assert!(i.dumps_due(t0).is_empty());
    assert_eq!(s.kv_blocks_of(WorkerId(1)), [2, 0, 0]);
    assert!(
        i.snapshot(7, FRESH, &cfg, t0).is_none(),
        "the router has not said it is caught up"
    );
    let _ = route(&mut s, &ModelName("a".into()), &[], t0); // caught up now
    s.tell_view(t0);
    pump(&mut s, &mut i, t0);
    let snap = i
        .snapshot(7, FRESH, &cfg, t0)
        .expect("due: events since start");
    assert_eq!((snap.stream_seq, snap.blocks()), (7, 2));
    assert!(
        i.snapshot(7, FRESH, &cfg, t0 + cfg.interval).is_none(),
        "nothing changed, and the tag is the stream's"
    );
    // Quiet, but the stream moved past the tag (what was applied before
    // the snapshot): written again with the newer tag, once.
    assert!(
        i.snapshot(8, FRESH, &cfg, t0).is_none(),
        "within the interval"
    );
    let retag = i
        .snapshot(8, FRESH, &cfg, t0 + cfg.interval)
        .expect("re-tagged");
    assert_eq!((retag.stream_seq, retag.blocks()), (8, 2));
    assert!(i.snapshot(8, FRESH, &cfg, t0 + 2 * cfg.interval).is_none());
    // Taken but not stored: taken again at the next interval.
    i.snapshot_not_written();
    let again = i
        .snapshot(8, FRESH, &cfg, t0 + 2 * cfg.interval)
        .expect("taken again");
    assert_eq!(again.stream_seq, 8);
    assert!(i.snapshot(8, FRESH, &cfg, t0 + 3 * cfg.interval).is_none());
    // From that snapshot on.
    let t0 = t0 + 2 * cfg.interval;
    i.batch(batch(3..=3));
    assert!(
        i.snapshot(8, FRESH, &cfg, t0).is_none(),
        "1 event, interval not over"
    );
    assert!(i.snapshot(8, FRESH, &cfg, t0 + cfg.interval).is_some());
    // A live peer with a lower id writes them instead.
    i.batch(batch(4..=7));
    s.peer_heartbeat(RouterId(2), t0);
    s.tell_view(t0);
    pump(&mut s, &mut i, t0);
    assert!(i.snapshot(9, FRESH, &cfg, t0 + cfg.interval).is_none());
    // Unless the store's newest is stale (that peer does not write): past
    // STALE_INTERVALS intervals plus one for the one peer below us.
    let old = |k: u32| StoredSnapshot::Age(cfg.interval * k);
    let t1 = t0 + cfg.interval;
    assert!(i.snapshot(9, old(STALE_INTERVALS), &cfg, t1).is_none());
    assert!(i.snapshot(9, old(STALE_INTERVALS + 1), &cfg, t1).is_some());
    // None in the store: counted from when it was first seen missing.
    i.batch(batch(8..=8));
    let t2 = t1 + 2 * cfg.interval;
    assert!(i.snapshot(10, StoredSnapshot::Missing, &cfg, t2).is_none());
    let t3 = t2 + cfg.interval * (STALE_INTERVALS + 1);
    assert!(i.snapshot(10, StoredSnapshot::Missing, &cfg, t3).is_some());
    // A store that cannot be read elects no one else.
    i.batch(batch(9..=9));
    let t4 = t3 + cfg.interval * 10;
    assert!(i.snapshot(11, StoredSnapshot::Unknown, &cfg, t4).is_none());
    i.batch(batch(10..=10));
    s.peer_heartbeat(RouterId(9), t0);
    let mut off = cfg.clone();
    off.enabled = false;
    assert!(
        i.snapshot(11, old(100), &off, t4 + cfg.interval).is_none(),
        "never with snapshots off"
    );
}
