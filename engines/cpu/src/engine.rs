//! The engine driver: one OS thread owns the scheduler, the KV store and
//! the thread pool, and loops schedule → forward → sample → commit. Commands
//! (new requests, cancels, snapshots, block import/export) are applied
//! between steps; the thread sleeps when there is nothing to do and ends
//! when the engine handle is dropped, failing whatever is still running
//! with [`EngineError::Stopped`].
//!
//! Invariants: every accepted request gets exactly one terminal event; a
//! request whose receiver is dropped is cancelled at the next step; a
//! panic inside a step fails the requests of that step's engine state
//! (all of them, their blocks freed) with an internal error instead of
//! killing the engine; a panic anywhere else kills the thread, which
//! closes every request's stream and fires the engine's [`Liveness`] (the
//! worker then restarts with a fresh engine).
//!
//! Bounds: requests hold an [`Admission`] slot (running + waiting); work
//! commands queue at most that many plus [`WORK_HEADROOM`]; KV events
//! buffer at most [`dynamo_engine::KV_EVENT_BUFFER`].

use crate::kv::{KvCache, KvError};
use crate::model::{Batch, BatchRow, Model};
use crate::pool::ThreadPool;
use crate::sampler::{sample, Rng};
use dynamo_batcher::{OffloadConfig, OffloadStats, Scheduler, SchedulerConfig, TierStore};
use dynamo_bus_schema::blocks::SequenceHash;
use dynamo_bus_schema::{FinishReason, LoadMetrics, RequestId};
pub use dynamo_engine::KvBlockData;
use dynamo_engine::{
    Admission, Alive, Commands, Engine, EngineError, EngineEvent, EngineFault, KvArena,
    KvEventSink, KvEventStream, KvSnapshot, Liveness, Queued, Reservation, ReservationId,
    ReservationReceiver, ResponseStream, Slot, ValidRequest,
};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};
use thiserror::Error;
use tokio::sync::{mpsc, oneshot};

/// Settings of the CPU engine.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CpuEngineConfig {
    /// Threads of the forward pass (the engine thread included).
    pub threads: u32,
    /// KV blocks in the pool (each holds `block_size` tokens of K and V for
    /// every layer: 737 KiB for SmolLM2-135M at 16 tokens). Memory is
    /// touched only as blocks are used.
    pub num_blocks: u32,
    /// Most sequences running at once.
    pub max_num_seqs: u32,
    /// Most tokens (prefill chunks + decodes) in one step.
    pub max_num_batched_tokens: u32,
    /// Most requests waiting to be admitted; past it the engine answers
    /// `Overloaded` at once and the router sends work elsewhere.
    pub max_waiting_seqs: u32,
    /// Reuse cached blocks across requests by block hash.
    pub enable_prefix_caching: bool,
    /// Publish KV events for KV-aware routing.
    pub emit_kv_events: bool,
    /// Blocks kept in host memory after eviction from the pool (0 = no
    /// offloading); a later hit brings them back instead of recomputing.
    pub offload_host_blocks: u32,
    /// Blocks kept on local disk after eviction from host memory (0 = none).
    pub offload_disk_blocks: u32,
    /// Directory of the disk tier (needed when `offload_disk_blocks > 0`).
    pub offload_disk_dir: Option<std::path::PathBuf>,
}

impl Default for CpuEngineConfig {
    fn default() -> Self {
        CpuEngineConfig {
            threads: 2,
            num_blocks: 512,
            max_num_seqs: 16,
            max_num_batched_tokens: 512,
            max_waiting_seqs: 256,
            enable_prefix_caching: true,
            emit_kv_events: true,
            offload_host_blocks: 0,
            offload_disk_blocks: 0,
            offload_disk_dir: None,
        }
    }
}

#[derive(Debug, Error, PartialEq)]
pub enum CpuConfigError {
    #[error("cpu.{field} must be at least {min} (got {value})")]
    TooSmall {
        field: &'static str,
        min: u64,
        value: u64,
    },
    #[error("cpu.threads = {0} is more than 256")]
    TooManyThreads(u32),
    #[error("cpu.{0}")]
    Offload(String),
}

impl CpuEngineConfig {
    pub fn validate(&self) -> Result<(), CpuConfigError> {
        for (field, value, min) in [
            ("threads", self.threads as u64, 1),
            ("num_blocks", self.num_blocks as u64, 1),
            ("max_num_seqs", self.max_num_seqs as u64, 1),
            (
                "max_num_batched_tokens",
                self.max_num_batched_tokens as u64,
                1,
            ),
            ("max_waiting_seqs", self.max_waiting_seqs as u64, 1),
        ] {
            if value < min {
                return Err(CpuConfigError::TooSmall { field, min, value });
            }
        }
        if self.threads > 256 {
            return Err(CpuConfigError::TooManyThreads(self.threads));
        }
        if self.offload_disk_blocks > 0 {
            if self.offload_host_blocks == 0 {
                return Err(CpuConfigError::Offload(
                    "offload_disk_blocks needs offload_host_blocks > 0".into(),
                ));
            }
            if self.offload_disk_dir.is_none() {
                return Err(CpuConfigError::Offload(
                    "offload_disk_blocks needs offload_disk_dir".into(),
                ));
            }
        }
        Ok(())
    }

    /// The offload tiers this config asks for.
    pub fn offload(&self) -> OffloadConfig {
        OffloadConfig {
            host_blocks: self.offload_host_blocks as usize,
            disk_blocks: self.offload_disk_blocks as usize,
            disk_dir: self.offload_disk_dir.clone(),
        }
    }
}

/// What an engine did so far (for tests and metrics).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CpuStats {
    /// Positions whose KV the forward pass computed (prompt and output).
    pub computed_tokens: u64,
    /// Offload tiers, when configured.
    pub offload: Option<OffloadStats>,
}

/// What the engine needs besides weights: the model card's block identity.
#[derive(Clone, Debug)]
pub struct CpuModelInfo {
    pub block_size: u32,
    /// Block-hash salt (see `dynamo_bus_schema::blocks::hash_salt`).
    pub hash_salt: u64,
    pub eos_token_ids: Vec<u32>,
}

#[derive(Debug, Error, PartialEq)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] CpuConfigError),
    #[error("cannot start engine threads: {0}")]
    Threads(String),
    #[error("cannot reserve the KV pool: {0}")]
    Memory(dynamo_engine::ArenaError),
}

// Not `#[from]`: the message already shows the cause, and a source would
// print it twice in a chain (`{:#}`).
impl From<dynamo_engine::ArenaError> for StartError {
    fn from(e: dynamo_engine::ArenaError) -> Self {
        StartError::Memory(e)
    }
}

/// Work commands (snapshots, block moves) queued beyond the admitted requests.
pub const WORK_HEADROOM: usize = 256;

/// A request's event sender, holding its admission slot while it runs.
struct Sink {
    tx: mpsc::UnboundedSender<EngineEvent>,
    _slot: Slot,
}

enum Cmd {
    Add(ValidRequest, Sink),
    Cancel(RequestId),
    Snapshot(oneshot::Sender<KvSnapshot>),
    Export(Vec<SequenceHash>, oneshot::Sender<Vec<KvBlockData>>),
    Import(
        Vec<KvBlockData>,
        oneshot::Sender<Result<usize, EngineError>>,
    ),
    Stats(oneshot::Sender<CpuStats>),
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

pub struct CpuEngine {
    cmds: Commands<Cmd>,
    admission: Arc<Admission>,
    load: Arc<Mutex<LoadMetrics>>,
    kv_rx: Mutex<Option<KvEventStream>>,
    block_bytes: usize,
    arena: Arc<KvArena>,
    liveness: Liveness,
}

impl CpuEngine {
    /// Starts an engine over shared weights.
    pub fn start(
        cfg: CpuEngineConfig,
        model: Arc<Model>,
        info: CpuModelInfo,
    ) -> Result<Self, StartError> {
        cfg.validate()?;
        let sc = SchedulerConfig {
            block_size: info.block_size,
            num_blocks: cfg.num_blocks,
            max_num_seqs: cfg.max_num_seqs,
            max_num_batched_tokens: cfg.max_num_batched_tokens,
            max_waiting: cfg.max_waiting_seqs,
            enable_prefix_caching: cfg.enable_prefix_caching,
            record_kv_events: cfg.emit_kv_events,
        };
        let capacity = sc.capacity();
        let mut sched = Scheduler::new(sc, info.hash_salt, info.eos_token_ids.clone());
        let offload = cfg.offload();
        if offload.enabled() {
            let tiers = TierStore::new(offload)
                .map_err(|e| StartError::Config(CpuConfigError::Offload(e.to_string())))?;
            sched = sched.with_offload(tiers);
        }
        let (cmds, rx) = dynamo_engine::commands(capacity + WORK_HEADROOM);
        let (kv_tx, kv_rx) = dynamo_engine::kv_events();
        let (alive, liveness) = dynamo_engine::liveness();
        let load = Arc::new(Mutex::new(sched.load()));
        let pool = ThreadPool::new(cfg.threads as usize)
            .map_err(|e| StartError::Threads(e.to_string()))?;
        let c = &model.w.cfg;
        let kv = KvCache::new(
            c.n_layers,
            cfg.num_blocks as usize,
            info.block_size as usize,
            c.kv_dim(),
        )?;
        let block_bytes = kv.block_bytes();
        let arena = kv.arena();
        let mut driver = Driver {
            model,
            pool,
            kv,
            sched,
            computed_tokens: 0,
            outs: HashMap::new(),
            rngs: HashMap::new(),
            kv_tx,
            load: load.clone(),
        };
        // Watched through `liveness`: the worker restarts a dead engine.
        std::thread::Builder::new()
            .name("cpu-engine".into())
            .spawn(move || {
                let _alive: Alive = alive;
                driver.run(rx)
            })
            .map_err(|e| StartError::Threads(e.to_string()))?;
        Ok(CpuEngine {
            cmds,
            admission: Admission::new(capacity),
            load,
            kv_rx: Mutex::new(cfg.emit_kv_events.then_some(kv_rx)),
            block_bytes,
            arena,
            liveness,
        })
    }

    /// What the engine computed so far and what its offload tiers did.
    pub fn stats(&self) -> Result<oneshot::Receiver<CpuStats>, EngineError> {
        dynamo_engine::ask(|tx| self.cmds.work(Cmd::Stats(tx)).is_ok())
    }
}

impl Engine for CpuEngine {
    fn kind(&self) -> &'static str {
        "cpu"
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
    fn kv_snapshot(&self) -> Result<oneshot::Receiver<KvSnapshot>, EngineError> {
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

struct Driver {
    model: Arc<Model>,
    pool: ThreadPool,
    kv: KvCache,
    sched: Scheduler,
    outs: HashMap<RequestId, Sink>,
    rngs: HashMap<RequestId, Rng>,
    kv_tx: KvEventSink,
    load: Arc<Mutex<LoadMetrics>>,
    computed_tokens: u64,
}

impl Driver {
    fn run(&mut self, mut rx: mpsc::UnboundedReceiver<Queued<Cmd>>) {
        'outer: loop {
            if self.sched.is_idle() {
                self.publish();
                match rx.blocking_recv() {
                    Some(q) => self.apply(q.cmd),
                    None => break 'outer,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(q) => self.apply(q.cmd),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => break 'outer,
                }
            }
            if self.sched.is_idle() {
                continue;
            }
            if catch_unwind(AssertUnwindSafe(|| self.step())).is_err() {
                tracing::error!("cpu engine step panicked; failing its requests");
                for id in self.sched.abort_all() {
                    self.rngs.remove(&id);
                    if let Some(sink) = self.outs.remove(&id) {
                        let _ = sink.tx.send(EngineEvent::Failed(EngineError::Internal(
                            "engine step failed".into(),
                        )));
                    }
                }
            }
            self.flush_kv_events();
            self.publish();
        }
        for id in self.sched.abort_all() {
            if let Some(sink) = self.outs.remove(&id) {
                let _ = sink.tx.send(EngineEvent::Failed(EngineError::Stopped));
            }
        }
        self.publish();
    }

    fn apply(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Fault(EngineFault::PanicDriver) => {
                panic!("fault injected: the cpu engine's driver thread panics");
            }
            Cmd::Add(req, sink) => {
                let id = req.id();
                let seed = req.sampling().seed.unwrap_or_else(|| {
                    (id.0 as u64) ^ (id.0 >> 64) as u64 ^ std::process::id() as u64
                });
                // Blocks of this prompt in an offload tier come back first,
                // so admission finds them cached.
                let (host, disk) = self.sched.onboard(req.prompt(), &mut self.kv);
                if host + disk > 0 {
                    tracing::debug!(request = %id, host, disk, "onboarded offloaded blocks");
                    self.flush_kv_events();
                }
                match self.sched.add(req) {
                    Ok(()) => {
                        self.outs.insert(id, sink);
                        self.rngs.insert(id, Rng::new(seed));
                    }
                    Err(e) => {
                        let _ = sink.tx.send(EngineEvent::Failed(e));
                    }
                }
            }
            Cmd::Cancel(id) => {
                if self.sched.cancel(id) {
                    self.rngs.remove(&id);
                    if let Some(sink) = self.outs.remove(&id) {
                        let _ = sink.tx.send(EngineEvent::Finished {
                            reason: FinishReason::Cancelled,
                        });
                    }
                }
            }
            Cmd::Snapshot(tx) => {
                // Events are drained after every step, so the snapshot is
                // consistent with everything already sent.
                self.flush_kv_events();
                let _ = tx.send(self.sched.kv_snapshot());
            }
            Cmd::Export(hashes, tx) => {
                let mut out = Vec::new();
                let mut parent = None;
                for h in hashes {
                    let Some(b) = self.sched.cached_block(h) else {
                        break;
                    };
                    let Ok(bytes) = self.kv.export_block(b.0 as usize) else {
                        break;
                    };
                    out.push(KvBlockData {
                        hash: h,
                        parent,
                        bytes,
                    });
                    parent = Some(h);
                }
                let _ = tx.send(out);
            }
            Cmd::Import(blocks, tx) => {
                let result = self
                    .import(blocks)
                    .map_err(|e| EngineError::BadKvData(e.to_string()));
                self.flush_kv_events();
                let _ = tx.send(result);
            }
            Cmd::Stats(tx) => {
                let _ = tx.send(CpuStats {
                    computed_tokens: self.computed_tokens,
                    offload: self.sched.offload_stats(),
                });
            }
            Cmd::Reserve(n, tx) => {
                let r = self.sched.reserve(n, &mut self.kv);
                self.flush_kv_events();
                self.publish();
                // Nobody waits for it any more (the request went away):
                // the blocks go straight back (and `apply` publishes that).
                if let Err(Ok(r)) = tx.send(r) {
                    self.sched.release_reserved(r.id);
                }
            }
            Cmd::Commit(id, parent, hashes, tx) => {
                let r = self.sched.commit_reserved(id, parent, &hashes);
                self.flush_kv_events();
                self.publish();
                let _ = tx.send(r);
            }
            Cmd::Release(id) => {
                self.sched.release_reserved(id);
            }
        }
        self.publish();
    }

    /// Stores blocks in the prefix cache (blocks already cached are
    /// skipped); stops at the first block of the wrong size.
    fn import(&mut self, blocks: Vec<KvBlockData>) -> Result<usize, KvError> {
        let mut stored = 0;
        for b in blocks {
            if b.bytes.len() != self.kv.block_bytes() {
                return Err(KvError::BadLength {
                    got: b.bytes.len(),
                    expected: self.kv.block_bytes(),
                });
            }
            if let Some(idx) = self.sched.import_block(b.hash, b.parent) {
                self.sched.offload_evicted(&mut self.kv);
                // Length checked above, and the index comes from the pool.
                self.kv.import_block(idx.0 as usize, &b.bytes)?;
                stored += 1;
            }
        }
        Ok(stored)
    }

    fn step(&mut self) {
        let mut plan = self.sched.schedule();
        // Evicted blocks go to the host tier before the forward overwrites them.
        self.sched.offload_evicted(&mut self.kv);
        // Admissions are news now, not after the forward pass: clients
        // (and the phase breakdown) see queueing end when prefill begins.
        let admitted = std::mem::take(&mut plan.events);
        self.deliver(admitted);
        self.computed_tokens += plan.tokens() as u64;
        let mut rows = Vec::with_capacity(plan.tokens());
        let mut tables = Vec::with_capacity(plan.items.len());
        let mut logits_for = Vec::new();
        for (s, item) in plan.items.iter().enumerate() {
            let seq = self.sched.seq(item.id).expect("planned seq exists");
            for p in item.start..item.start + item.len {
                rows.push(BatchRow {
                    token: seq.tokens[p],
                    pos: p,
                    seq: s,
                });
            }
            tables.push(seq.blocks.as_slice());
            if item.sample {
                logits_for.push(rows.len() - 1);
            }
        }
        let batch = Batch {
            rows,
            tables,
            logits_for,
        };
        let logits = if batch.rows.is_empty() {
            Vec::new()
        } else {
            self.model.forward(&self.pool, &mut self.kv, &batch)
        };
        drop(batch);
        let vocab = self.model.w.cfg.vocab;
        let mut k = 0;
        let sampled: Vec<Option<u32>> = plan
            .items
            .iter()
            .map(|item| {
                if !item.sample {
                    return None;
                }
                let row = &logits[k * vocab..(k + 1) * vocab];
                k += 1;
                let seq = self.sched.seq(item.id).expect("planned seq exists");
                let rng = self.rngs.entry(item.id).or_insert_with(|| Rng::new(0));
                Some(sample(row, &seq.sampling, rng))
            })
            .collect();
        let events = self.sched.commit(plan, &sampled);
        // Load first: whoever sees a request finish must see its blocks freed.
        self.publish();
        self.deliver(events);
    }

    /// Sends events to their requests; a request whose receiver is gone is
    /// cancelled.
    fn deliver(&mut self, events: Vec<(RequestId, EngineEvent)>) {
        for (id, ev) in events {
            let terminal = matches!(ev, EngineEvent::Finished { .. } | EngineEvent::Failed(_));
            let gone = match self.outs.get(&id) {
                Some(sink) => sink.tx.send(ev).is_err(),
                None => false,
            };
            if terminal {
                self.outs.remove(&id);
                self.rngs.remove(&id);
            } else if gone {
                // The receiver went away: nobody wants the rest.
                self.outs.remove(&id);
                self.rngs.remove(&id);
                self.sched.cancel(id);
            }
        }
    }

    fn flush_kv_events(&mut self) {
        for ev in self.sched.drain_kv_events() {
            self.kv_tx.send(ev);
        }
    }

    fn publish(&self) {
        if let Ok(mut l) = self.load.lock() {
            *l = self.sched.load();
        }
    }
}
