//! The async driver: owns a [`MockerCore`], feeds it commands, runs steps,
//! announces the step's admissions, waits out the simulated step time
//! (divided by the speedup) and then delivers the step's tokens and KV
//! events.
//!
//! **Pacing.** A step lasts its simulated time from when it starts, not
//! that time after the driver's own work: the formula is a GPU step's
//! whole time, so the host time the driver spends scheduling and
//! delivering is inside it, not added to it. Steps run back to back keep
//! their cadence: a step that ends up to [`MAX_CARRY`] late (a timer's
//! tick, a busy host) starts the next one from when it should have ended,
//! so lateness does not add up over a stream. Later than that, the next
//! step starts afresh.
//!
//! **What waits for a step's end.** New requests, cancels, snapshots and
//! faults are applied between steps: a snapshot must match the KV events
//! already sent, and those of a step go out when it ends. Pool bookkeeping
//! (reserve, commit, release, export, import) is applied as it arrives,
//! also while a step runs, as a GPU engine's block manager works on the
//! host while the device computes: a step's plan and state change are
//! made when it starts, so its outcome cannot depend on them, and the KV
//! events they make go out with the step's. So a remote prefill's
//! reservation and commit wait for no step; only the request's own
//! admission does, as in a real engine. A pool command that comes after
//! a request in the queue may thus be applied before it: blocks committed
//! for a request that has not joined yet are cached, not pinned, and a
//! reservation in between may evict them under pool pressure (the
//! request then prefills what is gone, as after any eviction).
//!
//! One tokio task per engine, watched through its [`Liveness`]; it
//! ends when the engine handle is dropped, failing whatever is still
//! running with [`EngineError::Stopped`]. If it dies (a panic), every
//! request's stream closes and the liveness fires, so the worker restarts.
//!
//! Bounds: new requests take an [`Admission`] slot (running + waiting,
//! `max_num_seqs + max_waiting_seqs`); work commands queue at most that
//! many plus [`WORK_HEADROOM`]; KV events buffer at most
//! [`dynamo_engine::KV_EVENT_BUFFER`].

use crate::config::{ConfigError, MockerConfig};
use crate::core::MockerCore;
use dynamo_bus_schema::blocks::SequenceHash;
use dynamo_bus_schema::{LoadMetrics, RequestId};
use dynamo_engine::{
    Admission, Alive, Commands, Engine, EngineError, EngineEvent, EngineFault, KvArena,
    KvBlockData, KvEventSink, KvEventStream, KvSnapshot, Liveness, Queued, Reservation,
    ReservationId, ReservationReceiver, ResponseStream, Slot, ValidRequest,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;
use tokio::sync::oneshot;

/// Work commands (snapshots, block moves) queued beyond the admitted requests.
pub const WORK_HEADROOM: usize = 256;
/// Lateness of a step that the next one makes up (real time).
pub const MAX_CARRY: std::time::Duration = std::time::Duration::from_millis(5);

/// A request's event sender, holding its admission slot while it runs.
struct Sink {
    tx: mpsc::UnboundedSender<EngineEvent>,
    _slot: Slot,
}

enum Cmd {
    Add(ValidRequest, Sink),
    Cancel(RequestId),
    Snapshot(tokio::sync::oneshot::Sender<KvSnapshot>),
    Export(Vec<SequenceHash>, oneshot::Sender<Vec<KvBlockData>>),
    Import(
        Vec<KvBlockData>,
        oneshot::Sender<Result<usize, EngineError>>,
    ),
    Reserve(usize, oneshot::Sender<Result<Reservation, EngineError>>),
    Commit(
        ReservationId,
        Option<SequenceHash>,
        Vec<SequenceHash>,
        oneshot::Sender<Result<usize, EngineError>>,
    ),
    Release(ReservationId),
    Fault(EngineFault),
}

impl Cmd {
    /// Whether the command waits for the running step to end (see the
    /// module doc); pool bookkeeping does not.
    fn between_steps(&self) -> bool {
        match self {
            Cmd::Add(..) | Cmd::Cancel(_) | Cmd::Snapshot(_) | Cmd::Fault(_) => true,
            Cmd::Export(..)
            | Cmd::Import(..)
            | Cmd::Reserve(..)
            | Cmd::Commit(..)
            | Cmd::Release(_) => false,
        }
    }
}

/// What the mocker needs to know about the model it pretends to run.
#[derive(Clone, Debug)]
pub struct MockerModel {
    pub vocab_size: u32,
    pub eos_token_ids: Vec<u32>,
    /// Block-hash salt (see `dynamo_bus_schema::blocks::hash_salt`).
    pub hash_salt: u64,
}

pub struct MockerEngine {
    cmds: Commands<Cmd>,
    admission: Arc<Admission>,
    load: Arc<Mutex<LoadMetrics>>,
    kv_rx: Mutex<Option<KvEventStream>>,
    block_bytes: usize,
    arena: Arc<KvArena>,
    liveness: Liveness,
}

impl MockerEngine {
    /// Validates the config and starts the engine task on the current tokio runtime.
    pub fn start(cfg: MockerConfig, model: MockerModel) -> Result<Self, ConfigError> {
        let range = cfg.validate(model.vocab_size)?;
        let core = MockerCore::new(
            cfg.clone(),
            model.hash_salt,
            range,
            model.eos_token_ids,
            cfg.emit_kv_events,
        )?;
        let arena = core.arena();
        let capacity = cfg.scheduler().capacity();
        let (cmds, rx) = dynamo_engine::commands(capacity + WORK_HEADROOM);
        let (kv_tx, kv_rx) = dynamo_engine::kv_events();
        let load = Arc::new(Mutex::new(core.load()));
        let emit = cfg.emit_kv_events;
        let block_bytes = cfg.kv_bytes_per_block as usize;
        let (alive, liveness) = dynamo_engine::liveness();
        // Watched through `liveness`: the worker restarts a dead engine.
        tokio::spawn(run(core, cfg, rx, kv_tx, load.clone(), alive));
        Ok(MockerEngine {
            cmds,
            admission: Admission::new(capacity),
            load,
            kv_rx: Mutex::new(emit.then_some(kv_rx)),
            block_bytes,
            arena,
            liveness,
        })
    }
}

impl Engine for MockerEngine {
    fn kind(&self) -> &'static str {
        "mocker"
    }
    fn generate(&self, req: ValidRequest) -> Result<ResponseStream, EngineError> {
        let slot = self.admission.try_admit()?;
        let (tx, rx) = mpsc::unbounded_channel();
        self.cmds.work(Cmd::Add(req, Sink { tx, _slot: slot }))?;
        Ok(rx)
    }
    fn cancel(&self, id: RequestId) {
        // A stopped engine has nothing left to cancel.
        let _ = self.cmds.control(Cmd::Cancel(id));
    }
    fn capacity(&self) -> usize {
        self.admission.capacity()
    }
    fn load(&self) -> LoadMetrics {
        self.load.lock().map(|l| l.clone()).unwrap_or_default()
    }
    fn take_kv_events(&self) -> Option<KvEventStream> {
        self.kv_rx.lock().ok()?.take()
    }
    fn liveness(&self) -> Liveness {
        self.liveness.clone()
    }
    fn inject(&self, fault: EngineFault) -> Result<(), EngineError> {
        Ok(self.cmds.control(Cmd::Fault(fault))?)
    }
    fn kv_snapshot(&self) -> Result<tokio::sync::oneshot::Receiver<KvSnapshot>, EngineError> {
        dynamo_engine::ask(|tx| self.cmds.work(Cmd::Snapshot(tx)).is_ok())
    }
    fn kv_block_bytes(&self) -> usize {
        self.block_bytes
    }
    fn export_blocks(
        &self,
        hashes: Vec<SequenceHash>,
    ) -> Result<oneshot::Receiver<Vec<KvBlockData>>, EngineError> {
        dynamo_engine::ask(|tx| self.cmds.work(Cmd::Export(hashes, tx)).is_ok())
    }
    fn import_blocks(
        &self,
        blocks: Vec<KvBlockData>,
    ) -> Result<oneshot::Receiver<Result<usize, EngineError>>, EngineError> {
        dynamo_engine::ask(|tx| self.cmds.work(Cmd::Import(blocks, tx)).is_ok())
    }
    fn kv_arena(&self) -> Arc<KvArena> {
        self.arena.clone()
    }
    fn reserve_blocks(&self, n: usize) -> Result<ReservationReceiver, EngineError> {
        self.cmds.reserve(n, Cmd::Reserve, Cmd::Release)
    }
    fn commit_blocks(
        &self,
        id: ReservationId,
        parent: Option<SequenceHash>,
        hashes: Vec<SequenceHash>,
    ) -> Result<oneshot::Receiver<Result<usize, EngineError>>, EngineError> {
        dynamo_engine::ask(|tx| self.cmds.work(Cmd::Commit(id, parent, hashes, tx)).is_ok())
    }
    fn release_blocks(&self, id: ReservationId) {
        // A stopped engine holds no reservation any more.
        let _ = self.cmds.control(Cmd::Release(id));
    }
}

async fn run(
    mut core: MockerCore,
    cfg: MockerConfig,
    mut rx: mpsc::UnboundedReceiver<Queued<Cmd>>,
    mut kv_tx: KvEventSink,
    load: Arc<Mutex<LoadMetrics>>,
    _alive: Alive,
) {
    let mut outs: HashMap<RequestId, Sink> = HashMap::new();
    let apply = |cmd: Cmd, core: &mut MockerCore, outs: &mut HashMap<RequestId, Sink>| {
        match cmd {
            Cmd::Add(req, sink) => {
                let id = req.id();
                match core.add(req) {
                    Ok(()) => {
                        outs.insert(id, sink);
                    }
                    Err(e) => {
                        let _ = sink.tx.send(EngineEvent::Failed(e));
                    }
                }
            }
            Cmd::Fault(EngineFault::PanicDriver) => {
                panic!("fault injected: the mocker engine's driver panics");
            }
            Cmd::Snapshot(tx) => {
                // Events are drained after every step, so the snapshot is
                // consistent with everything already sent.
                let _ = tx.send(core.kv_snapshot());
            }
            Cmd::Export(hashes, tx) => {
                let _ = tx.send(core.export_blocks(&hashes));
            }
            Cmd::Import(blocks, tx) => {
                let _ = tx.send(core.import_blocks(blocks));
            }
            Cmd::Reserve(n, tx) => {
                let r = core.reserve(n);
                publish_load(core, &load);
                // Nobody waits for it any more (the request went away):
                // the blocks go straight back.
                if let Err(Ok(r)) = tx.send(r) {
                    core.release(r.id);
                    publish_load(core, &load);
                }
            }
            Cmd::Commit(id, parent, hashes, tx) => {
                let r = core.commit(id, parent, &hashes);
                publish_load(core, &load);
                let _ = tx.send(r);
            }
            Cmd::Release(id) => core.release(id),
            Cmd::Cancel(id) => {
                if core.cancel(id) {
                    if let Some(sink) = outs.remove(&id) {
                        let _ = sink.tx.send(EngineEvent::Finished {
                            reason: dynamo_bus_schema::FinishReason::Cancelled,
                        });
                    }
                }
            }
        }
    };
    // When the last step should have ended (None: idle since).
    let mut due: Option<tokio::time::Instant> = None;
    // Commands that came while a step ran and wait for its end, in order
    // (bounded like the queue they came from: their tickets still count).
    let mut deferred: std::collections::VecDeque<Queued<Cmd>> = Default::default();
    let mut closed = false;
    'outer: loop {
        for q in deferred.drain(..) {
            apply(q.cmd, &mut core, &mut outs);
        }
        if closed {
            break 'outer;
        }
        if core.is_idle() {
            due = None;
            publish_load(&core, &load);
            match rx.recv().await {
                Some(q) => apply(q.cmd, &mut core, &mut outs),
                None => break 'outer,
            }
        }
        let now = tokio::time::Instant::now();
        let start = match due {
            Some(d) if now <= d + MAX_CARRY => d.min(now),
            _ => now,
        };
        loop {
            match rx.try_recv() {
                Ok(q) => apply(q.cmd, &mut core, &mut outs),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => break 'outer,
            }
        }
        let step = core.step();
        // Admissions are known when the step starts; its tokens exist only
        // once it has run: `Started` goes out now, the rest after the
        // simulated step time, as a GPU engine's outputs would. So TTFT
        // includes the prefill step and `timings.prefill_ms` measures it.
        let (started, rest): (Vec<_>, Vec<_>) = step
            .events
            .into_iter()
            .partition(|(_, ev)| matches!(ev, EngineEvent::Started { .. }));
        deliver(started, &mut outs, &mut core);
        match cfg.real_delay(step.simulated_ms) {
            Some(d) => {
                let end = start + d;
                due = Some(end);
                let sleep = tokio::time::sleep_until(end);
                tokio::pin!(sleep);
                loop {
                    tokio::select! {
                        biased;
                        _ = &mut sleep => break,
                        q = rx.recv(), if !closed => match q {
                            Some(q) if q.cmd.between_steps() => deferred.push_back(q),
                            Some(q) => apply(q.cmd, &mut core, &mut outs),
                            // The handle is gone: finish this step, then stop.
                            None => closed = true,
                        },
                    }
                }
            }
            None => {
                due = None;
                tokio::task::yield_now().await;
            }
        }
        deliver(rest, &mut outs, &mut core);
        for ev in core.drain_kv_events() {
            kv_tx.send(ev);
        }
        publish_load(&core, &load);
    }
    for id in core.abort_all() {
        if let Some(sink) = outs.remove(&id) {
            let _ = sink.tx.send(EngineEvent::Failed(EngineError::Stopped));
        }
    }
    publish_load(&core, &load);
}

/// Sends each event to its request's stream; a terminal event closes the
/// stream, and a stream nobody reads any more cancels its request.
fn deliver(
    events: Vec<(RequestId, EngineEvent)>,
    outs: &mut HashMap<RequestId, Sink>,
    core: &mut MockerCore,
) {
    for (id, ev) in events {
        let terminal = matches!(ev, EngineEvent::Finished { .. } | EngineEvent::Failed(_));
        let gone = match outs.get(&id) {
            Some(sink) => sink.tx.send(ev).is_err(),
            None => false,
        };
        if terminal {
            outs.remove(&id);
        } else if gone {
            // The receiver went away: nobody wants the rest.
            outs.remove(&id);
            core.cancel(id);
        }
    }
}

fn publish_load(core: &MockerCore, load: &Mutex<LoadMetrics>) {
    if let Ok(mut l) = load.lock() {
        *l = core.load();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::predict;
    use dynamo_bus_schema::{FinishReason, SamplingParams};
    use dynamo_engine::EngineLimits;

    fn req(id: u128, prompt: Vec<u32>, max_tokens: u32) -> ValidRequest {
        let mut sampling = SamplingParams::greedy(max_tokens);
        sampling.seed = Some(3);
        let limits = EngineLimits {
            context_length: 4096,
            vocab_size: 1000,
        };
        ValidRequest::from_parts(RequestId(id), prompt, &sampling, limits).unwrap()
    }

    fn model() -> MockerModel {
        MockerModel {
            vocab_size: 1000,
            eos_token_ids: vec![2],
            hash_salt: 9,
        }
    }

    async fn collect(mut rx: ResponseStream) -> (Vec<u32>, Option<EngineEvent>) {
        let mut toks = vec![];
        while let Some(ev) = rx.recv().await {
            match ev {
                EngineEvent::Tokens(t) => toks.extend(t),
                EngineEvent::Started { .. } => {}
                other => return (toks, Some(other)),
            }
        }
        (toks, None)
    }

    #[tokio::test(start_paused = true)]
    async fn simulated_time_follows_the_timing_model() {
        let cfg = MockerConfig {
            token_lo: 100,
            ..MockerConfig::default()
        };
        let e = MockerEngine::start(cfg.clone(), model()).unwrap();
        let prompt: Vec<u32> = (100..1100).map(|t| t % 1000).collect();
        let t0 = tokio::time::Instant::now();
        let (toks, end) = collect(e.generate(req(1, prompt.clone(), 4)).unwrap()).await;
        let elapsed = t0.elapsed().as_secs_f64() * 1000.0;
        assert_eq!(toks, predict(&prompt, 4, 3, 100, 1000));
        assert_eq!(
            end,
            Some(EngineEvent::Finished {
                reason: FinishReason::Length
            })
        );
        // One 1000-token prefill step plus three decode steps.
        let want = cfg.step_ms(1000, false, 0.0);
        assert!(elapsed >= want, "{elapsed} < {want}");
        assert!(elapsed < want + 3.0 * 10.0, "{elapsed}");
    }

    #[tokio::test(start_paused = true)]
    async fn cancel_and_drop_end_requests() {
        let cfg = MockerConfig {
            token_lo: 100,
            ..MockerConfig::default()
        };
        let e = MockerEngine::start(cfg, model()).unwrap();
        let mut rx = e.generate(req(1, (100..200).collect(), 1000)).unwrap();
        assert!(matches!(rx.recv().await, Some(EngineEvent::Started { .. })));
        assert!(matches!(rx.recv().await, Some(EngineEvent::Tokens(_))));
        e.cancel(RequestId(1));
        let (_, end) = collect(rx).await;
        assert_eq!(
            end,
            Some(EngineEvent::Finished {
                reason: FinishReason::Cancelled
            })
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert_eq!(e.load().kv_used_blocks, 0);
        assert_eq!(e.load().inflight_requests, 0);

        let rx = e.generate(req(2, (100..200).collect(), 1000)).unwrap();
        drop(e);
        let (_, end) = collect(rx).await;
        assert_eq!(end, Some(EngineEvent::Failed(EngineError::Stopped)));
    }

    #[tokio::test(start_paused = true)]
    async fn blocks_move_between_mockers_as_buffers_of_the_configured_size() {
        let cfg = MockerConfig {
            kv_bytes_per_block: 4096,
            ..MockerConfig::default()
        };
        let a = MockerEngine::start(cfg.clone(), model()).unwrap();
        let prompt: Vec<u32> = (100..164).collect();
        collect(a.generate(req(1, prompt.clone(), 2)).unwrap()).await;
        let hashes = dynamo_bus_schema::blocks::sequence_hashes(&prompt, 16, 9);
        let blocks = a.export_blocks(hashes.clone()).unwrap().await.unwrap();
        assert_eq!(blocks.len(), 4);
        assert!(blocks.iter().all(|b| b.bytes.len() == 4096));
        assert_eq!(a.kv_block_bytes(), 4096);

        let b = MockerEngine::start(cfg, model()).unwrap();
        let mut torn = blocks[0].clone();
        torn.bytes[0] ^= 1;
        let err = b.import_blocks(vec![torn]).unwrap().await.unwrap();
        assert!(matches!(err, Err(EngineError::BadKvData(_))));
        assert_eq!(b.import_blocks(blocks).unwrap().await.unwrap(), Ok(4));
        let mut rx = b.generate(req(2, prompt, 2)).unwrap();
        // All but the last block come from the imported cache (the last
        // prompt token is always computed).
        assert_eq!(
            rx.recv().await,
            Some(EngineEvent::Started { cached_tokens: 48 })
        );
    }

    #[tokio::test(start_paused = true)]
    async fn blocks_written_into_reserved_pool_blocks_are_checked_then_cached() {
        let cfg = MockerConfig {
            kv_bytes_per_block: 3 * 4096,
            ..MockerConfig::default()
        };
        let a = MockerEngine::start(cfg.clone(), model()).unwrap();
        let prompt: Vec<u32> = (100..164).collect();
        collect(a.generate(req(1, prompt.clone(), 2)).unwrap()).await;
        let hashes = dynamo_bus_schema::blocks::sequence_hashes(&prompt, 16, 9);
        let blocks = a.export_blocks(hashes.clone()).unwrap().await.unwrap();

        let b = MockerEngine::start(cfg, model()).unwrap();
        let arena = b.kv_arena();
        let write = |r: &Reservation, torn: bool| {
            for (i, (blk, data)) in r.blocks.iter().zip(&blocks).enumerate() {
                let mut bytes = data.bytes.clone();
                if torn && i == 2 {
                    bytes[0] ^= 1;
                }
                // SAFETY: reserved for this test, written before the commit.
                assert!(unsafe { arena.write_block(*blk as usize, &bytes) });
            }
        };
        // A torn block: refused, nothing stored, the blocks are freed.
        let r = b.reserve_blocks(4).unwrap().await.unwrap().unwrap();
        assert_eq!(b.load().kv_used_blocks, 4);
        write(&r, true);
        let err = b
            .commit_blocks(r.id, None, hashes.clone())
            .unwrap()
            .await
            .unwrap();
        assert!(matches!(err, Err(EngineError::BadKvData(_))));
        assert_eq!(b.load().kv_used_blocks, 0);
        // Committed blocks are given back to the system (they read as zeros).
        // SAFETY: no reservation holds the block any more.
        let block = unsafe { arena.read_block(r.blocks[0] as usize) }.unwrap();
        assert!(block.iter().all(|&x| x == 0));

        let r = b.reserve_blocks(4).unwrap().await.unwrap().unwrap();
        write(&r, false);
        let stored = b
            .commit_blocks(r.id, None, hashes.clone())
            .unwrap()
            .await
            .unwrap();
        assert_eq!(stored, Ok(4));
        let mut rx = b.generate(req(2, prompt, 2)).unwrap();
        assert_eq!(
            rx.recv().await,
            Some(EngineEvent::Started { cached_tokens: 48 })
        );
        // A released reservation can no longer be committed.
        let r = b.reserve_blocks(1).unwrap().await.unwrap().unwrap();
        b.release_blocks(r.id);
        assert!(b
            .commit_blocks(r.id, None, vec![])
            .unwrap()
            .await
            .unwrap()
            .is_err());
        // A reservation nobody waits for any more is given back at once.
        let used = b.load().kv_used_blocks;
        drop(b.reserve_blocks(3).unwrap());
        let r = b.reserve_blocks(1).unwrap().await.unwrap().unwrap();
        assert_eq!(b.load().kv_used_blocks, used + 1);
        b.release_blocks(r.id);
    }

    #[tokio::test(start_paused = true)]
    async fn pool_commands_are_answered_while_a_step_runs_and_requests_wait_for_its_end() {
        // Every decode step takes 200 ms.
        let step = std::time::Duration::from_millis(200);
        let cfg = MockerConfig {
            token_lo: 100,
            decode_ms: [0.0, 0.0, 200.0],
            ..MockerConfig::default()
        };
        let e = MockerEngine::start(cfg, model()).unwrap();
        let prompt: Vec<u32> = (100..148).collect();
        let mut a = e.generate(req(1, prompt.clone(), 1000)).unwrap();
        assert!(matches!(a.recv().await, Some(EngineEvent::Started { .. })));
        assert!(matches!(a.recv().await, Some(EngineEvent::Tokens(_))));
        // The first decode step started as the prefill's token went out.
        let t0 = tokio::time::Instant::now();
        let r = e.reserve_blocks(2).unwrap().await.unwrap().unwrap();
        assert_eq!(r.blocks.len(), 2);
        assert!(t0.elapsed() < step, "the reservation waited for the step");
        let exported = e.export_blocks(vec![]).unwrap().await.unwrap();
        assert!(exported.is_empty());
        e.release_blocks(r.id);
        assert!(t0.elapsed() < step, "the export waited for the step");
        // A new request is admitted at the step's end, not before.
        let mut b = e.generate(req(2, prompt, 1)).unwrap();
        assert!(matches!(b.recv().await, Some(EngineEvent::Started { .. })));
        assert!(t0.elapsed() >= step, "a request joined a running step");
        // Request 1 kept its cadence meanwhile.
        assert!(matches!(a.recv().await, Some(EngineEvent::Tokens(_))));
    }
}
