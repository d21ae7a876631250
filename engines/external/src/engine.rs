//! [`ExternalEngine`]: an engine server in another process (llama.cpp,
//! vLLM, SGLang, TensorRT-LLM) behind our engine seam.
//!
//! One driver task owns everything the engine does: the launched process
//! (if any) and its logs, the health and metrics loop, the KV event feed
//! (if the engine publishes one), and one task per request. Dropping the
//! handle aborts the driver, which kills the process. The driver ends, and
//! [`Engine::liveness`] with it, when the process exits, when a ready
//! engine fails `health_failures` checks in a row, when it never becomes
//! healthy within `startup_timeout`, or when the KV feed ends: the worker
//! then restarts with a fresh engine (and a fresh process).
//!
//! Invariants:
//! - at most `max_inflight` requests are open against the server
//!   ([`Admission`]); a request's slot is held by its task;
//! - every request's stream ends with exactly one terminal event: cancel
//!   answers `Finished { Cancelled }` and drops the HTTP stream, which
//!   closes the connection so the server stops generating;
//! - a connection lost or an error answered mid-stream is
//!   [`EngineError::Failed`] (the gateway migrates the request); a 4xx is
//!   [`EngineError::Rejected`]; a 429 or 503 is `Overloaded`;
//! - the one exception: a request whose connection closed before any
//!   response headers came is sent once more, on a new connection, within
//!   the same `response_timeout` (`call.rs`);
//! - health checks and metrics scrapes use a pool of their own, so they
//!   never go out on a connection a stream left behind.
//! - no more than `max_tokens` tokens are handed out, and generation stops
//!   after a stop token id even where the server cannot be told about them.

use crate::call::Call;
use crate::config::{Api, ExternalConfig, PromptForm};
use crate::kv_feed::KvFeed;
use crate::launch::{self, Fill, Launched};
use crate::prom::{self, EngineLoad};
use dynamo_bus_schema::blocks::SequenceHash;
use dynamo_bus_schema::{LoadMetrics, RequestId};
use dynamo_engine::{
    commands, kv_events, liveness, Admission, Alive, Commands, Engine, EngineError, EngineEvent,
    EngineFault, KvArena, KvBlockData, KvEventSink, KvEventStream, KvSnapshot, Liveness, Queued,
    Readiness, ReservationId, ReservationReceiver, ResponseStream, Slot, ValidRequest,
};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// Work commands queued for the driver at most (past it: `Overloaded`).
const COMMAND_QUEUE: usize = 1024;
/// Snapshot requests waiting for the KV feed at most.
const SNAPSHOT_QUEUE: usize = 16;

/// Our tokenizer, for text an engine streamed without all its token ids.
pub type Retokenize = Arc<dyn Fn(&str) -> Option<Vec<u32>> + Send + Sync>;
/// Our detokenizer, special tokens written out: a prompt's text for an
/// engine set to `prompt = "text"`.
pub type Detokenize = Arc<dyn Fn(&[u32]) -> Option<String> + Send + Sync>;

/// What the engine needs to know of the worker's model.
#[derive(Clone)]
pub struct ExternalModel {
    /// Our model's name: sent as `model` unless `served_model` says
    /// otherwise, and the salt of KV block hashes.
    pub name: String,
    pub vocab_size: u32,
    /// Our KV block size (the router's hashing).
    pub block_size: usize,
    /// The model file, for a launch command's `{model_path}`.
    pub model_path: Option<PathBuf>,
    /// The worker this engine serves (for logs).
    pub worker: String,
    /// Our tokenizer: where llama.cpp streams no ids for tokens that split
    /// a UTF-8 character, the chunk's text is encoded again (the same text;
    /// its ids may differ from the engine's). None: such a request fails.
    pub retokenize: Option<Retokenize>,
    /// Our detokenizer, for `prompt = "text"` (which needs both).
    pub detokenize: Option<Detokenize>,
}

#[derive(Clone, Debug, PartialEq)]
enum State {
    Starting,
    Ready,
    Failed(String),
}

enum Cmd {
    Generate {
        req: ValidRequest,
        tx: mpsc::UnboundedSender<EngineEvent>,
        slot: Slot,
    },
    Cancel(RequestId),
    Snapshot(oneshot::Sender<KvSnapshot>),
    Panic,
}

/// The handle.
pub struct ExternalEngine {
    cfg: Arc<ExternalConfig>,
    admission: Arc<Admission>,
    cmds: Commands<Cmd>,
    load: Arc<Mutex<EngineLoad>>,
    state: watch::Receiver<State>,
    kv_events: Mutex<Option<KvEventStream>>,
    liveness: Liveness,
    arena: Arc<KvArena>,
    /// The driver; dropping the set aborts it.
    _driver: Mutex<JoinSet<()>>,
}

impl ExternalEngine {
    /// Starts the driver (and, with `launch`, the engine's process). Must
    /// be called inside a Tokio runtime.
    pub fn start(cfg: ExternalConfig, model: ExternalModel) -> Result<Self, EngineError> {
        if cfg.prompt == PromptForm::Text
            && (model.detokenize.is_none() || model.retokenize.is_none())
        {
            return Err(EngineError::Internal(
                "`prompt = \"text\"` needs our tokenizer, which this worker has not".into(),
            ));
        }
        let fill = Fill::for_config(&cfg, model.model_path.as_deref())
            .map_err(|e| EngineError::Internal(e.to_string()))?;
        let mut kv = cfg.kv_events.clone();
        if let Some(k) = &mut kv {
            k.endpoint = fill.apply(&k.endpoint);
            k.replay_endpoint = k.replay_endpoint.as_deref().map(|r| fill.apply(r));
        }
        let base = fill.apply(&cfg.url);
        let client = http_client(&cfg, Some(POOL_IDLE))?;
        // For the one retry of a request a closing connection lost
        // (`call.rs`): it keeps no idle connection, so it never reuses one.
        let fresh = http_client(&cfg, None)?;
        let probes = http_client(&cfg, Some(POOL_IDLE))?;
        let arena =
            Arc::new(KvArena::new(1, 4096).map_err(|e| EngineError::Internal(e.to_string()))?);
        let (cmds, rx) = commands(COMMAND_QUEUE);
        let (alive, live) = liveness();
        let (state_tx, state) = watch::channel(State::Starting);
        let load = Arc::new(Mutex::new(EngineLoad::default()));
        let (sink, stream) = kv_events();
        let cfg = Arc::new(cfg);
        let driver = Driver {
            cfg: cfg.clone(),
            model,
            client,
            fresh,
            probes,
            retried: Arc::new(AtomicU64::new(0)),
            base,
            fill,
            kv: kv.map(|k| (k, sink)),
            state: state_tx,
            load: load.clone(),
        };
        let emits = driver.kv.is_some();
        let mut set = JoinSet::new();
        set.spawn(driver.run(rx, alive));
        Ok(ExternalEngine {
            admission: Admission::new(cfg.max_inflight as usize),
            cfg,
            cmds,
            load,
            state,
            kv_events: Mutex::new(emits.then_some(stream)),
            liveness: live,
            arena,
            _driver: Mutex::new(set),
        })
    }

    /// The API the engine is spoken to in.
    pub fn api(&self) -> Api {
        self.cfg.api
    }
}

struct Driver {
    cfg: Arc<ExternalConfig>,
    model: ExternalModel,
    client: reqwest::Client,
    /// A client without idle connections (the retry's).
    fresh: reqwest::Client,
    /// Health checks' and metrics scrapes' own pool.
    probes: reqwest::Client,
    /// Requests sent again after their connection closed unanswered.
    retried: Arc<AtomicU64>,
    base: String,
    fill: Fill,
    kv: Option<(crate::zmq_source::ZmqConfig, KvEventSink)>,
    state: watch::Sender<State>,
    load: Arc<Mutex<EngineLoad>>,
}

/// Why a driver's helper task ended.
enum Aux {
    Exited(String),
    Unhealthy(String),
    FeedEnded,
}

impl Driver {
    fn fail(&self, why: String) {
        tracing::error!(worker = %self.model.worker, "external engine: {why}");
        self.state.send_replace(State::Failed(why));
    }

    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Queued<Cmd>>, alive: Alive) {
        let _alive = alive;
        let mut aux: JoinSet<Aux> = JoinSet::new();
        let mut logs: JoinSet<()> = JoinSet::new();
        let mut requests: JoinSet<RequestId> = JoinSet::new();
        let mut running: HashMap<RequestId, CancellationToken> = HashMap::new();
        // Which request each task serves (a panicked task names only its id).
        let mut task_of: HashMap<tokio::task::Id, RequestId> = HashMap::new();
        if let Some(l) = &self.cfg.launch {
            match launch::launch(l, &self.fill, &self.model.worker, &mut logs) {
                Ok(p) => {
                    aux.spawn(watch_process(p));
                }
                Err(e) => return self.fail(e.to_string()),
            }
        }
        // Without a feed, nothing to wait for; with one, the engine is ready
        // only once its publisher is connected (else the router would index
        // nothing, quietly).
        let (feed_tx, feed_up) = watch::channel(self.kv.is_none());
        aux.spawn(health(
            self.probes.clone(),
            self.base.clone(),
            self.cfg.clone(),
            self.state.clone(),
            self.load.clone(),
            feed_up,
        ));
        let mut snapshots = None;
        if let Some((zcfg, sink)) = self.kv.take() {
            let (tx, srx) = mpsc::channel(SNAPSHOT_QUEUE);
            snapshots = Some(tx);
            aux.spawn(feed(
                zcfg,
                self.model.name.clone(),
                self.model.block_size,
                self.cfg.health_interval,
                sink,
                srx,
                feed_tx,
            ));
        }
        tracing::info!(worker = %self.model.worker, url = %self.base, api = ?self.cfg.api, "external engine starting");
        loop {
            tokio::select! {
                q = rx.recv() => {
                    let Some(q) = q else { return };
                    match q.cmd {
                        Cmd::Generate { req, tx, slot } => {
                            let id = req.id();
                            if running.contains_key(&id) {
                                let _ = tx.send(EngineEvent::Failed(EngineError::Duplicate(id)));
                                continue;
                            }
                            let cancel = CancellationToken::new();
                            running.insert(id, cancel.clone());
                            let model = self.cfg.served_model.clone().unwrap_or_else(|| self.model.name.clone());
                            let call = Call {
                                client: self.client.clone(),
                                fresh: self.fresh.clone(),
                                retried: self.retried.clone(),
                                base: self.base.clone(),
                                api: self.cfg.api,
                                model,
                                vocab: self.model.vocab_size,
                                response_timeout: self.cfg.response_timeout,
                                idle_timeout: self.cfg.idle_timeout,
                                retokenize: self.model.retokenize.clone(),
                                detokenize: (self.cfg.prompt == PromptForm::Text)
                                    .then(|| self.model.detokenize.clone())
                                    .flatten(),
                            };
                            let h = requests.spawn(async move {
                                call.serve(req, tx, cancel, slot).await;
                                id
                            });
                            task_of.insert(h.id(), id);
                        }
                        Cmd::Cancel(id) => {
                            if let Some(c) = running.get(&id) {
                                c.cancel();
                            }
                        }
                        Cmd::Snapshot(reply) => match &snapshots {
                            Some(s) => {
                                if s.try_send(reply).is_err() {
                                    tracing::warn!(worker = %self.model.worker, "KV snapshot requests are queued too deep; one is refused");
                                }
                            }
                            None => {
                                let _ = reply.send(empty_snapshot());
                            }
                        },
                        Cmd::Panic => panic!("fault injected: the external engine's driver panics"),
                    }
                }
                Some(done) = requests.join_next_with_id(), if !requests.is_empty() => {
                    let task = match done {
                        Ok((task, _)) => task,
                        Err(e) => {
                            tracing::error!(worker = %self.model.worker, error = %e, "a request task failed");
                            e.id()
                        }
                    };
                    if let Some(id) = task_of.remove(&task) {
                        running.remove(&id);
                    }
                }
                Some(end) = aux.join_next() => {
                    let why = match end {
                        Ok(Aux::Exited(why)) | Ok(Aux::Unhealthy(why)) => why,
                        Ok(Aux::FeedEnded) => "its KV event feed ended".to_string(),
                        Err(e) => format!("a helper task failed: {e}"),
                    };
                    return self.fail(why);
                }
            }
        }
    }
}

fn empty_snapshot() -> KvSnapshot {
    KvSnapshot {
        last_event_id: 0,
        blocks: Vec::new(),
        offloaded: Vec::new(),
    }
}

/// How long an idle connection is kept: under the 5 s keep-alive that
/// llama.cpp's server and uvicorn (vLLM's) announce, so the server is not
/// the one to close it as a request goes out.
const POOL_IDLE: Duration = Duration::from_secs(4);

/// A client for the engine's server; `idle: None` keeps no idle connection.
fn http_client(
    cfg: &ExternalConfig,
    idle: Option<Duration>,
) -> Result<reqwest::Client, EngineError> {
    let b = reqwest::Client::builder()
        .connect_timeout(cfg.connect_timeout)
        .tcp_nodelay(true);
    let b = match idle {
        Some(d) => b.pool_idle_timeout(d),
        None => b.pool_max_idle_per_host(0),
    };
    b.build()
        .map_err(|e| EngineError::Internal(format!("HTTP client: {e}")))
}

async fn watch_process(mut p: Launched) -> Aux {
    let status = p.wait().await;
    let tail = p.tail.lines();
    let status = match status {
        Ok(s) => s.to_string(),
        Err(e) => format!("unknown status ({e})"),
    };
    Aux::Exited(format!(
        "the engine process exited ({status}); its last output: {}",
        if tail.is_empty() {
            "(none)".to_string()
        } else {
            tail.join(" | ")
        }
    ))
}

/// Health checks and metrics scrapes, every `health_interval`.
async fn health(
    client: reqwest::Client,
    base: String,
    cfg: Arc<ExternalConfig>,
    state: watch::Sender<State>,
    load: Arc<Mutex<EngineLoad>>,
    feed_up: watch::Receiver<bool>,
) -> Aux {
    let started = Instant::now();
    let mut fails = 0u32;
    let mut tick = tokio::time::interval(cfg.health_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let timeout = cfg.health_interval.max(Duration::from_millis(500));
    loop {
        tick.tick().await;
        let res = client
            .get(format!("{base}{}", cfg.health_path))
            .timeout(timeout)
            .send()
            .await;
        let ok = match res {
            Ok(r) if r.status().is_success() => Ok(()),
            Ok(r) => Err(format!("health check answered {}", r.status())),
            Err(e) => Err(format!("health check failed: {e}")),
        };
        let ready = *state.borrow() == State::Ready;
        let ok = match ok {
            Ok(()) if !ready && !*feed_up.borrow() => {
                Err("its KV event publisher is not connected yet".to_string())
            }
            ok => ok,
        };
        match ok {
            Ok(()) => {
                fails = 0;
                if !ready {
                    tracing::info!(url = %base, ms = started.elapsed().as_millis() as u64, "external engine ready");
                    state.send_replace(State::Ready);
                }
            }
            Err(why) if ready => {
                fails += 1;
                tracing::warn!(url = %base, fails, "{why}");
                if fails >= cfg.health_failures {
                    return Aux::Unhealthy(format!("{why} ({fails} times in a row)"));
                }
            }
            Err(why) => {
                if started.elapsed() > cfg.startup_timeout {
                    return Aux::Unhealthy(format!(
                        "not healthy within {} ms: {why}",
                        cfg.startup_timeout.as_millis()
                    ));
                }
            }
        }
        let ready = *state.borrow() == State::Ready;
        if let (Some(p), true) = (&cfg.metrics_path, ready) {
            if let Ok(r) = client
                .get(format!("{base}{p}"))
                .timeout(timeout)
                .send()
                .await
            {
                if r.status().is_success() {
                    if let Ok(text) = r.text().await {
                        let l = prom::parse(&text);
                        if let Ok(mut g) = load.lock() {
                            *g = l;
                        }
                    }
                }
            }
        }
    }
}

/// How often what a KV event feed dropped is logged (when it rose).
const FEED_REPORT: Duration = Duration::from_secs(30);

/// The KV event feed: connects (retrying while the engine starts), then
/// forwards events and answers snapshots.
async fn feed(
    cfg: crate::zmq_source::ZmqConfig,
    model: String,
    block_size: usize,
    retry: Duration,
    mut sink: KvEventSink,
    mut snapshots: mpsc::Receiver<oneshot::Sender<KvSnapshot>>,
    up: watch::Sender<bool>,
) -> Aux {
    let started = Instant::now();
    let mut warned = Duration::ZERO;
    let (mut feed, mut events) = loop {
        tokio::select! {
            r = KvFeed::start(cfg.clone(), &model, block_size) => match r {
                Ok(f) => break f,
                Err(e) => {
                    // Loud every 30 s: the worker stays `Starting` meanwhile.
                    if started.elapsed() >= warned + Duration::from_secs(30) {
                        warned = started.elapsed();
                        tracing::warn!(endpoint = %cfg.endpoint, error = %e, secs = warned.as_secs(), "KV event publisher not reachable");
                    }
                    tokio::time::sleep(retry).await;
                }
            },
            Some(reply) = snapshots.recv() => {
                let _ = reply.send(empty_snapshot());
            }
        }
    };
    tracing::info!(endpoint = %cfg.endpoint, "KV event feed connected");
    up.send_replace(true);
    // What the feed dropped is logged at most once per period, when it rose.
    let mut report = tokio::time::interval(FEED_REPORT);
    report.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut reported = crate::kv_feed::FeedStats::default();
    loop {
        tokio::select! {
            e = events.recv() => match e {
                Some(e) => sink.send(e),
                None => break,
            },
            _ = report.tick() => {
                let now = feed.stats();
                let dropped = now.dropped_since(&reported);
                if !dropped.is_empty() {
                    let what = dropped
                        .iter()
                        .map(|(k, n)| format!("{k} +{n}"))
                        .collect::<Vec<_>>()
                        .join(", ");
                    // Expected, once blocks are indexed: a hybrid model's
                    // other cache groups, and removals of blocks stored
                    // before the feed connected or a discontinuity.
                    // Anything else, or nothing indexed at all (a prefix
                    // group whose kind is not known), means the router
                    // misses blocks.
                    let expected = now.tracked > 0
                        && dropped
                            .iter()
                            .all(|(k, _)| matches!(*k, "other_group" | "unknown_block"));
                    if expected {
                        tracing::info!(endpoint = %cfg.endpoint, dropped = %what, tracked = now.tracked, "KV events of other cache groups or of blocks not tracked skipped");
                    } else {
                        tracing::warn!(
                            endpoint = %cfg.endpoint,
                            dropped = %what,
                            skipped_total = now.skipped.total(),
                            batches = now.source.batches,
                            "KV events skipped or lost"
                        );
                    }
                }
                reported = now;
            }
            Some(reply) = snapshots.recv() => {
                let _ = reply.send(feed.snapshot().unwrap_or_else(empty_snapshot));
            }
            _ = feed.ended() => break,
        }
    }
    Aux::FeedEnded
}

impl Engine for ExternalEngine {
    fn kind(&self) -> &'static str {
        self.cfg.kind
    }

    fn ready(&self) -> Readiness {
        let mut rx = self.state.clone();
        if *rx.borrow() == State::Ready {
            return Readiness::Now;
        }
        Readiness::Later(Box::pin(async move {
            loop {
                let now = rx.borrow_and_update().clone();
                match now {
                    State::Ready => return Ok(()),
                    State::Failed(why) => return Err(EngineError::Failed(why)),
                    State::Starting => {}
                }
                if rx.changed().await.is_err() {
                    return Err(EngineError::Stopped);
                }
            }
        }))
    }

    fn generate(&self, req: ValidRequest) -> Result<ResponseStream, EngineError> {
        match &*self.state.borrow() {
            State::Ready => {}
            State::Starting => {
                return Err(EngineError::Overloaded(
                    "the engine's server is starting".into(),
                ))
            }
            State::Failed(_) => return Err(EngineError::Stopped),
        }
        let slot = self.admission.try_admit()?;
        // Unbounded by the seam's type (`ResponseStream`): the request task
        // sends at most `max_tokens` (it truncates to it) + 2 events.
        let (tx, rx) = mpsc::unbounded_channel();
        self.cmds.work(Cmd::Generate { req, tx, slot })?;
        Ok(rx)
    }

    fn cancel(&self, id: RequestId) {
        let _ = self.cmds.control(Cmd::Cancel(id));
    }

    fn capacity(&self) -> usize {
        self.admission.capacity()
    }

    fn load(&self) -> LoadMetrics {
        let l = self.load.lock().map(|g| *g).unwrap_or_default();
        let inflight = self.admission.held() as u32;
        let (used, total) = match l.kv_usage {
            Some(u) => ((u * 1000.0).round() as u32, 1000),
            None => (0, 0),
        };
        LoadMetrics {
            active_seqs: l.running.unwrap_or(inflight),
            waiting_seqs: l.waiting.unwrap_or(0),
            kv_used_blocks: used,
            kv_total_blocks: total,
            inflight_requests: inflight,
        }
    }

    fn take_kv_events(&self) -> Option<KvEventStream> {
        self.kv_events.lock().ok()?.take()
    }

    fn liveness(&self) -> Liveness {
        self.liveness.clone()
    }

    fn inject(&self, fault: EngineFault) -> Result<(), EngineError> {
        match fault {
            EngineFault::PanicDriver => Ok(self.cmds.control(Cmd::Panic)?),
        }
    }

    fn kv_snapshot(&self) -> Result<oneshot::Receiver<KvSnapshot>, EngineError> {
        dynamo_engine::ask(|tx| self.cmds.control(Cmd::Snapshot(tx)).is_ok())
    }

    fn kv_block_bytes(&self) -> usize {
        0
    }

    fn export_blocks(
        &self,
        _hashes: Vec<SequenceHash>,
    ) -> Result<oneshot::Receiver<Vec<KvBlockData>>, EngineError> {
        // The engine's KV stays in its own process: nothing to export.
        dynamo_engine::ask(|tx| tx.send(Vec::new()).is_ok())
    }

    fn import_blocks(
        &self,
        _blocks: Vec<KvBlockData>,
    ) -> Result<oneshot::Receiver<Result<usize, EngineError>>, EngineError> {
        Err(unsupported())
    }

    fn kv_arena(&self) -> Arc<KvArena> {
        self.arena.clone()
    }

    fn reserve_blocks(&self, _n: usize) -> Result<ReservationReceiver, EngineError> {
        Err(unsupported())
    }

    fn commit_blocks(
        &self,
        _id: ReservationId,
        _parent: Option<SequenceHash>,
        _hashes: Vec<SequenceHash>,
    ) -> Result<oneshot::Receiver<Result<usize, EngineError>>, EngineError> {
        Err(unsupported())
    }

    fn release_blocks(&self, _id: ReservationId) {}
}

fn unsupported() -> EngineError {
    EngineError::Internal(
        "an external engine keeps its KV in its own process (disaggregate with the engine's own connector)"
            .into(),
    )
}
