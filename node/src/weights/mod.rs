//! Model weights across the cluster (issue 18): a node that holds a model
//! file serves it to peers from registered memory and advertises it in the
//! weights bucket; a node without the file loads it from peers, then the
//! in-cluster cache (a JetStream object store), then a local file, every
//! path verified against the content hash before the engine reads a byte.
//!
//! Invariants:
//! - a source record is rewritten every [`HEARTBEAT`] while its node
//!   serves; one older than [`STALE`] is reaped by whoever reads it;
//! - a model file written to the local cache directory is complete and
//!   verified (written to a temporary name, then renamed);
//! - the cache holds a file only once `cache.<sha256>` names it, written
//!   after its last chunk.
//!
//! Split by responsibility: this module holds the settings, the catalog
//! and serving; [`fetch`] waits for a source and loads from it, and keeps
//! what it loaded; [`cache`] is the in-cluster cache (a JetStream object
//! store) as a source and `dynamoctl models push`.

mod cache;
mod fetch;

pub use cache::{push, remove};
pub use fetch::{Fetched, ModelFile, Written};

use dynamo_bus_schema::weights::{ContentHash, WeightManifest, WeightSource, WeightSourceState};
use dynamo_bus_schema::{encode, unix_ms, NodeId};
use dynamo_runtime::bus::Bus;
use dynamo_weights::source::{ByteSource, FileSource, SourceError};
use dynamo_weights::{load, LoadOptions, LoadProgress, Source, WeightServer};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::AsyncReadExt;
use tokio::task::JoinSet;

/// How often a serving node rewrites its source record.
pub const HEARTBEAT: Duration = Duration::from_secs(3);
/// A source record not rewritten for this long is no longer read from:
/// its node missed two heartbeats (it may have died; its record is reaped
/// at [`STALE`]).
pub const SILENT: Duration = Duration::from_millis(2 * 3_000 + 1_000);
/// A source record not rewritten for this long is gone.
pub const STALE: Duration = Duration::from_secs(15);
/// The layout every GGUF file is served as.
pub const GGUF: &str = "gguf";
/// How long a node without the model waits for a source by default.
pub const DEFAULT_SOURCE_WAIT: Duration = Duration::from_secs(120);
/// The longest wait for a source `DYNAMO_WEIGHTS_WAIT_S` may ask for.
pub const MAX_SOURCE_WAIT: Duration = Duration::from_secs(3600);
/// How often a waiting node reads the weights bucket again.
const SOURCE_POLL: Duration = Duration::from_secs(1);
/// How often a waiting node says what it waits for.
const SOURCE_WAIT_LOG: Duration = Duration::from_secs(10);
/// Longest read of the weights bucket while waiting for a source.
const CATALOG_READ: Duration = Duration::from_secs(10);

/// Where a node looks for weights, in order (`DYNAMO_WEIGHTS_ORDER`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    Peer,
    Cache,
    File,
}

/// The weights settings of a node, from the environment (names in
/// [`crate::env`]), validated at start.
#[derive(Clone, Debug)]
pub struct WeightsConfig {
    /// Sources in order of preference (default peer, cache, file).
    pub order: Vec<Step>,
    /// The libfabric provider weights are served and read over.
    pub provider: String,
    /// Where loaded files are kept.
    pub cache_dir: PathBuf,
    /// Where manifests of local files are kept, by path, size and
    /// modification time (`DYNAMO_MANIFEST_CACHE`, default
    /// `~/.cache/dynamo/manifests`): machine-wide, so each file is hashed
    /// once.
    pub manifest_dir: PathBuf,
    /// Whether this node serves the weights it holds to peers.
    pub serve: bool,
    /// Longest wait for one window of peer reads before that peer is
    /// given up on (`DYNAMO_WEIGHTS_PEER_TIMEOUT_S`, default 30 s).
    pub peer_timeout: Duration,
    /// A load's rate limit (`DYNAMO_WEIGHTS_MAX_MBPS`, MB/s; none by default).
    pub max_bytes_per_sec: Option<u64>,
    /// Longest wait for a source when none the order names offers the
    /// model yet (`DYNAMO_WEIGHTS_WAIT_S`, default 120 s; 0 fails at once):
    /// in a fleet started at once, the nodes holding the file are still
    /// hashing and registering it.
    pub source_wait: Duration,
}

impl WeightsConfig {
    pub fn from_env() -> anyhow::Result<Self> {
        let order = match std::env::var(crate::env::WEIGHTS_ORDER) {
            Err(_) => vec![Step::Peer, Step::Cache, Step::File],
            Ok(s) => s
                .split(',')
                .map(|p| match p.trim() {
                    "peer" => Ok(Step::Peer),
                    "cache" => Ok(Step::Cache),
                    "file" => Ok(Step::File),
                    o => Err(anyhow::anyhow!(
                        "${}: unknown source {o:?} (peer, cache, file)",
                        crate::env::WEIGHTS_ORDER
                    )),
                })
                .collect::<anyhow::Result<_>>()?,
        };
        let serve = match std::env::var(crate::env::WEIGHTS_SERVE).as_deref() {
            Err(_) | Ok("1") | Ok("true") => true,
            Ok("0") | Ok("false") => false,
            Ok(o) => anyhow::bail!("${}: {o:?} is not 0 or 1", crate::env::WEIGHTS_SERVE),
        };
        Ok(WeightsConfig {
            order,
            provider: std::env::var(crate::env::WEIGHTS_PROVIDER)
                .unwrap_or_else(|_| "tcp;ofi_rxm".into()),
            cache_dir: std::env::var_os(crate::env::WEIGHTS_DIR)
                .map(PathBuf::from)
                .unwrap_or_else(|| crate::env::state_dir().join("weights")),
            manifest_dir: std::env::var_os(crate::env::MANIFEST_CACHE)
                .map(PathBuf::from)
                .or_else(|| {
                    std::env::var_os("XDG_CACHE_HOME")
                        .map(PathBuf::from)
                        .or_else(|| {
                            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache"))
                        })
                        .map(|c| c.join("dynamo").join("manifests"))
                })
                .unwrap_or_else(|| crate::env::state_dir().join("manifests")),
            serve,
            peer_timeout: match std::env::var(crate::env::WEIGHTS_PEER_TIMEOUT_S) {
                Err(_) => Duration::from_secs(30),
                Ok(v) => match v.trim().parse::<u64>() {
                    Ok(n @ 1..=600) => Duration::from_secs(n),
                    _ => anyhow::bail!(
                        "${}: {v:?} is not a number of seconds from 1 to 600",
                        crate::env::WEIGHTS_PEER_TIMEOUT_S
                    ),
                },
            },
            max_bytes_per_sec: match std::env::var(crate::env::WEIGHTS_MAX_MBPS) {
                Err(_) => None,
                Ok(v) => match v.parse::<u64>() {
                    Ok(n) if n > 0 => Some(n * 1_000_000),
                    _ => anyhow::bail!(
                        "${}: {v:?} is not a positive number of MB/s",
                        crate::env::WEIGHTS_MAX_MBPS
                    ),
                },
            },
            source_wait: match std::env::var(crate::env::WEIGHTS_WAIT_S) {
                Err(_) => DEFAULT_SOURCE_WAIT,
                Ok(v) => match v.trim().parse::<u64>() {
                    Ok(n) if n <= MAX_SOURCE_WAIT.as_secs() => Duration::from_secs(n),
                    _ => anyhow::bail!(
                        "${}: {v:?} is not a number of seconds from 0 to {}",
                        crate::env::WEIGHTS_WAIT_S,
                        MAX_SOURCE_WAIT.as_secs()
                    ),
                },
            },
        })
    }
}

/// A node's weights: what it serves, and how it finds what it lacks.
pub struct NodeWeights {
    bus: Bus,
    node: NodeId,
    cfg: WeightsConfig,
    /// Served files by content hash (kept alive while the node runs).
    served: Mutex<BTreeMap<ContentHash, WeightServer>>,
    /// Files being or already served, so a second group on the same file
    /// does not hash and register it again.
    serving: Mutex<std::collections::BTreeSet<PathBuf>>,
    /// Heartbeats of the source records, and serving in the background.
    tasks: Mutex<JoinSet<()>>,
    /// Files being kept (written, then served): not stopped by
    /// [`Self::withdraw`], so a stopping node finishes writing them.
    keeping: Mutex<JoinSet<()>>,
    /// Set by [`Self::withdraw`]: nothing is advertised from then on.
    stopping: std::sync::atomic::AtomicBool,
    /// Files loaded from the cluster being written, by content hash: a
    /// second group of the same model waits for the file, not loads it again.
    writing: Mutex<BTreeMap<ContentHash, Written>>,
    /// Loads whose `loading` record is up (withdrawn with the served ones).
    loading: Mutex<std::collections::BTreeSet<ContentHash>>,
}

async fn bucket(bus: &Bus) -> anyhow::Result<async_nats::jetstream::kv::Store> {
    Ok(bus
        .kv_bucket_durable(&bus.subjects.weights_bucket())
        .await?)
}

/// Every manifest, cache entry and live source, by content hash.
#[derive(Debug, Default)]
pub struct Catalog {
    pub manifests: BTreeMap<ContentHash, WeightManifest>,
    pub cached: std::collections::BTreeSet<ContentHash>,
    pub sources: BTreeMap<ContentHash, Vec<WeightSource>>,
}

impl Catalog {
    /// Leaves out sources whose node has gone [`SILENT`] at `now_ms`, so a
    /// load does not wait on a peer that died but is not reaped yet.
    fn without_silent(mut self, now_ms: u64) -> Self {
        for v in self.sources.values_mut() {
            v.retain(|s| now_ms.saturating_sub(s.updated_unix_ms) <= SILENT.as_millis() as u64);
        }
        self
    }
}

/// Reads the weights bucket, reaping stale sources.
pub async fn catalog(bus: &Bus) -> anyhow::Result<Catalog> {
    let kv = bucket(bus).await?;
    let mut c = Catalog::default();
    for (k, m) in dynamo_controller::read_all::<WeightManifest>(&kv)
        .await
        .map_err(|e| anyhow::anyhow!("weights bucket: {e}"))?
    {
        if m.validate().is_err() {
            tracing::warn!(key = %k, "weights: an invalid manifest is ignored");
            continue;
        }
        if k.starts_with("cache.") {
            c.cached.insert(m.sha256);
        }
        c.manifests.insert(m.sha256, m);
    }
    let now = unix_ms();
    for (k, s) in dynamo_controller::read_all::<WeightSource>(&kv)
        .await
        .map_err(|e| anyhow::anyhow!("weights bucket: {e}"))?
    {
        if now.saturating_sub(s.updated_unix_ms) > STALE.as_millis() as u64 {
            tracing::info!(key = %k, "weights: reaping a stale source");
            let _ = kv.purge(&k).await;
            continue;
        }
        if s.validate().is_ok() {
            c.sources.entry(s.sha256).or_default().push(s);
        }
    }
    Ok(c)
}

async fn put<T: dynamo_bus_schema::WireMessage>(
    kv: &async_nats::jetstream::kv::Store,
    key: &str,
    v: &T,
) -> anyhow::Result<()> {
    kv.put(key, encode(v)?.into())
        .await
        .map_err(|e| anyhow::anyhow!("writing {key}: {e}"))?;
    Ok(())
}

impl NodeWeights {
    pub fn new(bus: Bus, node: NodeId, cfg: WeightsConfig) -> Arc<Self> {
        Arc::new(NodeWeights {
            bus,
            node,
            cfg,
            served: Mutex::new(BTreeMap::new()),
            serving: Mutex::new(Default::default()),
            tasks: Mutex::new(JoinSet::new()),
            keeping: Mutex::new(JoinSet::new()),
            stopping: Default::default(),
            writing: Mutex::new(BTreeMap::new()),
            loading: Mutex::new(Default::default()),
        })
    }

    /// The file of `model`: `local` if it is there (served to peers from
    /// then on), else loaded from the cluster into the cache directory,
    /// waiting up to `wait` for a source to offer it. With `pin`, a file of
    /// any other content is refused. Where the engine computes with the
    /// file's bytes (`engine_reads`), a local file is read once, into the
    /// memory peers are served from ([`ModelFile::Shared`]).
    pub async fn model_file(
        self: &Arc<Self>,
        model: &str,
        local: Result<PathBuf, String>,
        pin: Option<ContentHash>,
        wait: Duration,
        engine_reads: bool,
    ) -> anyhow::Result<ModelFile> {
        match local {
            Ok(p) => {
                if let Some(want) = pin {
                    let got = self.manifest_of(&p, model).await?.sha256;
                    if got != want {
                        anyhow::bail!(
                            "model file {} refused: its sha256 is {}, not the pinned {} (model_sha256)",
                            p.display(),
                            got.hex(),
                            want.hex()
                        );
                    }
                }
                self.local(p, model, engine_reads, pin).await
            }
            Err(why) => self.fetch(model, why, pin, wait, engine_reads).await,
        }
    }

    /// The manifest of a local file (from the machine's manifest cache
    /// when it has one).
    async fn manifest_of(&self, path: &Path, model: &str) -> anyhow::Result<WeightManifest> {
        let (dir, p, model) = (
            self.cfg.manifest_dir.clone(),
            path.to_path_buf(),
            model.to_string(),
        );
        Ok(tokio::task::spawn_blocking(move || {
            dynamo_weights::manifest::of_file_cached(&dir, &p, &model, GGUF)
        })
        .await??)
    }

    /// A local file, served to peers from now on (see [`Self::model_file`]).
    /// With `pin`, bytes read into served memory are checked against it
    /// (the file may have changed since the caller checked it).
    pub(super) async fn local(
        self: &Arc<Self>,
        p: PathBuf,
        model: &str,
        engine_reads: bool,
        pin: Option<ContentHash>,
    ) -> anyhow::Result<ModelFile> {
        if !engine_reads || !self.cfg.serve {
            self.serve_local(&p, model);
            return Ok(ModelFile::Local(p));
        }
        if !self.claim(&p) {
            // Served already, from other memory: the engine reads its own.
            return Ok(ModelFile::Local(p));
        }
        let (path, provider) = (p.clone(), self.cfg.provider.clone());
        let read =
            tokio::task::spawn_blocking(move || dynamo_weights::SharedFile::read(&path, &provider))
                .await;
        let read = read.map_err(anyhow::Error::from).and_then(|r| Ok(r?));
        let mut file = match read {
            Ok(file) => file,
            Err(e) => {
                // The engine reads the file itself; it is served apart.
                tracing::warn!(file = %p.display(), error = %e, "weights: cannot read the file into served memory; the engine reads its own copy");
                self.spawn_serve_file(&p, model);
                return Ok(ModelFile::Local(p));
            }
        };
        // The manifest of the bytes read (cached by the metadata they were
        // read under, else hashed from memory), not of the file now.
        let (dir, path, name) = (self.cfg.manifest_dir.clone(), p.clone(), model.to_string());
        let manifest = move |file: dynamo_weights::SharedFile| {
            tokio::task::spawn_blocking(move || {
                let m = dynamo_weights::manifest::of_bytes_cached(
                    &dir,
                    &path,
                    file.metadata(),
                    file.bytes(),
                    &name,
                    GGUF,
                );
                (file, m)
            })
        };
        if let Some(want) = pin {
            let (f, m) = manifest.clone()(file).await?;
            let got = m?.sha256;
            if got != want {
                anyhow::bail!(
                    "model file {} refused: the bytes read have sha256 {}, not the pinned {} (model_sha256); it changed while it was checked",
                    p.display(),
                    got.hex(),
                    want.hex()
                );
            }
            file = f;
        }
        let bytes = file.bytes().clone();
        tracing::info!(model, file = %p.display(), "weights: the engine and peers share one copy of the file");
        // Hashing (or the cached manifest) and advertising are off the
        // worker's start.
        let (me, path) = (self.clone(), p.clone());
        self.tasks.lock().expect("tasks lock").spawn(async move {
            let served = async {
                let (file, m) = manifest(file).await?;
                let m = m?;
                let server = tokio::task::spawn_blocking(move || file.serve(m)).await??;
                me.advertise(server).await
            };
            if let Err(e) = served.await {
                tracing::warn!(error = %e, file = %path.display(), "weights: not served to peers");
            }
        });
        Ok(ModelFile::Shared { path: p, bytes })
    }

    /// Takes serving `p` for this caller: false if it is served already
    /// (by an earlier group, or from the memory [`Self::keep`] kept).
    fn claim(&self, p: &Path) -> bool {
        let mut serving = self.serving.lock().expect("serving lock");
        !serving.contains(p) & serving.insert(p.canonicalize().unwrap_or_else(|_| p.to_path_buf()))
    }

    /// Serves a local file to peers, in the background (hashing and
    /// registering it is off the worker's start), once per path.
    fn serve_local(self: &Arc<Self>, p: &Path, model: &str) {
        if self.claim(p) && self.cfg.serve {
            self.spawn_serve_file(p, model);
        }
    }

    /// Serves `p` from memory of its own, in the background.
    fn spawn_serve_file(self: &Arc<Self>, p: &Path, model: &str) {
        let (me, file, model) = (self.clone(), p.to_path_buf(), model.to_string());
        self.tasks.lock().expect("tasks lock").spawn(async move {
            if let Err(e) = me.serve_file(&file, &model).await {
                tracing::warn!(error = %e, file = %file.display(), "weights: not served to peers");
            }
        });
    }

    /// The copy of `sha` an earlier load left in the cache directory, if
    /// it is there and still has that content.
    async fn local_copy(&self, model: &str, sha: &ContentHash) -> Option<PathBuf> {
        let writing = self.writing.lock().expect("writing lock").get(sha).cloned();
        if let Some(w) = writing {
            tracing::info!(
                model,
                "weights: waiting for the file an earlier load is writing"
            );
            if let Err(e) = w.wait().await {
                tracing::warn!(model, error = %e, "weights: the earlier load's file was not written; loading again");
            }
        }
        let path = self.cfg.cache_dir.join(format!("{}.gguf", sha.hex()));
        if !path.is_file() {
            return None;
        }
        match self.manifest_of(&path, model).await {
            Ok(m) if m.sha256 == *sha => Some(path),
            Ok(m) => {
                tracing::warn!(file = %path.display(), sha256 = %m.sha256.short(), "weights: a local copy has other content; loading again");
                None
            }
            Err(e) => {
                tracing::warn!(file = %path.display(), error = %e, "weights: a local copy is unreadable; loading again");
                None
            }
        }
    }

    async fn serve_file(self: &Arc<Self>, path: &Path, model: &str) -> anyhow::Result<()> {
        let (p, name, provider) = (
            path.to_path_buf(),
            model.to_string(),
            self.cfg.provider.clone(),
        );
        let dir = self.cfg.manifest_dir.clone();
        let server = tokio::task::spawn_blocking(move || {
            let m = dynamo_weights::manifest::of_file_cached(&dir, &p, &name, GGUF)?;
            Ok::<_, anyhow::Error>(WeightServer::from_known_file(&p, m, &provider)?)
        })
        .await??;
        self.advertise(server).await
    }

    /// Publishes the manifest and keeps the source record fresh.
    async fn advertise(self: &Arc<Self>, server: WeightServer) -> anyhow::Result<()> {
        let m = server.manifest().clone();
        let d = server.descriptor();
        {
            // Checked and taken under one lock: two paths serving the same
            // file never both publish it.
            let mut served = self.served.lock().expect("served lock");
            if served.contains_key(&m.sha256) {
                // Already served (and heartbeated) from other memory.
                return Ok(());
            }
            served.insert(m.sha256, server);
        }
        match self.publish(&m, &d).await {
            Ok(()) => Ok(()),
            Err(e) => {
                // Not advertised: not served either.
                self.served.lock().expect("served lock").remove(&m.sha256);
                Err(e)
            }
        }
    }

    /// Writes the manifest and this node's `ready` record of a served file,
    /// and keeps the record fresh.
    async fn publish(
        &self,
        m: &WeightManifest,
        d: &dynamo_weights::PeerDescriptor,
    ) -> anyhow::Result<()> {
        let kv = bucket(&self.bus).await?;
        put(&kv, &WeightManifest::key(&m.sha256), m).await?;
        let address = hex::decode(&d.address)?;
        let rec = WeightSource {
            node: self.node.clone(),
            model: m.model.clone(),
            sha256: m.sha256,
            layout: m.layout.clone(),
            size: m.size,
            state: WeightSourceState::Ready,
            loaded_bytes: m.size,
            provider: d.provider.clone(),
            address,
            region_key: d.region.key,
            region_base: d.region.base,
            updated_unix_ms: unix_ms(),
        };
        put(&kv, &rec.key(), &rec).await?;
        let mut tasks = self.tasks.lock().expect("tasks lock");
        // Checked under the lock `withdraw` stops heartbeats under: a
        // record published as the node stops is taken back, not kept fresh.
        if self.stopping.load(std::sync::atomic::Ordering::SeqCst) {
            drop(tasks);
            if let Err(e) = kv.purge(&rec.key()).await {
                tracing::warn!(error = %e, "weights: source record not withdrawn");
            }
            anyhow::bail!("the node is stopping");
        }
        tracing::info!(model = %m.model, sha256 = %m.sha256.short(), provider = %d.provider, "weights: serving to peers");
        tasks.spawn(async move {
            let mut beat = tokio::time::interval(HEARTBEAT);
            beat.tick().await;
            loop {
                beat.tick().await;
                let mut r = rec.clone();
                r.updated_unix_ms = unix_ms();
                if let Err(e) = put(&kv, &r.key(), &r).await {
                    tracing::warn!(error = %e, "weights: source heartbeat failed");
                }
            }
        });
        Ok(())
    }

    /// Waits, up to `limit`, for loaded files still being written, so a
    /// node stopped soon after a load keeps its file for the next start.
    pub async fn finish_writes(&self, limit: Duration) {
        let writing: Vec<Written> = self
            .writing
            .lock()
            .expect("writing lock")
            .values()
            .cloned()
            .collect();
        if writing.is_empty() {
            return;
        }
        tracing::info!(
            files = writing.len(),
            "weights: finishing the write of loaded files"
        );
        let all = futures::future::join_all(writing.into_iter().map(Written::wait));
        if tokio::time::timeout(limit, all).await.is_err() {
            tracing::warn!(
                limit_s = limit.as_secs(),
                "weights: a loaded file was not written in time; the next start loads it again"
            );
        }
    }

    /// Stops serving: the heartbeats end and the source records go, so
    /// peers stop reading from here (before the node exits).
    pub async fn withdraw(&self) {
        {
            let mut tasks = self.tasks.lock().expect("tasks lock");
            self.stopping
                .store(true, std::sync::atomic::Ordering::SeqCst);
            tasks.abort_all();
        }
        // Served files, and loads not finished or not yet served.
        let mut served: std::collections::BTreeSet<ContentHash> = self
            .served
            .lock()
            .expect("served lock")
            .keys()
            .copied()
            .collect();
        served.extend(self.loading.lock().expect("loading lock").iter().copied());
        let Ok(kv) = bucket(&self.bus).await else {
            return;
        };
        for sha in served {
            let key = WeightSource::key_of(&sha, &self.node);
            if let Err(e) = kv.purge(&key).await {
                tracing::warn!(key, error = %e, "weights: source record not withdrawn");
            }
        }
    }

    /// Writes a `loading` source record with the bytes loaded so far,
    /// every second until `done` closes (the load ended either way).
    async fn report_loading(
        self: Arc<Self>,
        m: WeightManifest,
        mut done: tokio::sync::watch::Receiver<u64>,
    ) {
        let Ok(kv) = bucket(&self.bus).await else {
            return;
        };
        let mut rec = WeightSource {
            node: self.node.clone(),
            model: m.model.clone(),
            sha256: m.sha256,
            layout: m.layout.clone(),
            size: m.size,
            state: WeightSourceState::Loading,
            loaded_bytes: 0,
            provider: self.cfg.provider.clone(),
            address: Vec::new(),
            region_key: 0,
            region_base: 0,
            updated_unix_ms: unix_ms(),
        };
        let mut beat = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = beat.tick() => {}
                r = done.changed() => if r.is_err() { return },
            }
            rec.loaded_bytes = *done.borrow();
            rec.updated_unix_ms = unix_ms();
            if let Err(e) = put(&kv, &rec.key(), &rec).await {
                tracing::debug!(error = %e, "weights: progress record not written");
            }
        }
    }
}
