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
    /// Heartbeats of the source records, and files being kept.
    tasks: Mutex<JoinSet<()>>,
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

/// The name of chunk `i` of `sha` in the object store.
fn object(sha: &ContentHash, i: usize) -> String {
    format!("{}.{i}", sha.hex())
}

/// Puts `path` in the in-cluster cache, chunk by chunk; `progress` gets
/// the bytes stored so far. Answers its manifest.
pub async fn push(
    bus: &Bus,
    path: &Path,
    model: &str,
    progress: &mut (dyn FnMut(u64, u64) + Send),
) -> anyhow::Result<WeightManifest> {
    let p = path.to_path_buf();
    let m_model = model.to_string();
    let m =
        tokio::task::spawn_blocking(move || dynamo_weights::manifest::of_file(&p, &m_model, GGUF))
            .await??;
    let store = bus.object_store(&bus.subjects.weights_objects()).await?;
    let mut f = tokio::fs::File::open(path).await?;
    let mut done = 0u64;
    for i in 0..m.chunks.len() {
        let (_, len) = m.chunk(i);
        let mut buf = vec![0u8; len];
        f.read_exact(&mut buf).await?;
        if dynamo_weights::manifest::hash(&buf) != m.chunks[i] {
            anyhow::bail!("{} changed while it was read", path.display());
        }
        store
            .put(object(&m.sha256, i).as_str(), &mut buf.as_slice())
            .await
            .map_err(|e| anyhow::anyhow!("storing chunk {i}: {e}"))?;
        done += len as u64;
        progress(done, m.size);
    }
    let kv = bucket(bus).await?;
    put(&kv, &WeightManifest::key(&m.sha256), &m).await?;
    put(&kv, &format!("cache.{}", m.sha256.hex()), &m).await?;
    Ok(m)
}

/// A source that could not be opened, so the load's error names it.
struct Unavailable {
    name: String,
    why: String,
}

impl ByteSource for Unavailable {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn size(&mut self) -> Result<u64, SourceError> {
        Err(SourceError::Gone(self.why.clone()))
    }
    fn read_at(&mut self, _: u64, _: &mut [u8]) -> Result<(), SourceError> {
        Err(SourceError::Gone(self.why.clone()))
    }
}

/// How long reading one chunk from the cache may take: a stalled object
/// store (a server lost mid-read) fails the read and the cache is given up
/// for the rest of the load, which goes on from other sources rather than
/// waiting for ever. 30 s plus the chunk at 10 MB/s.
fn chunk_read_timeout(bytes: usize) -> std::time::Duration {
    std::time::Duration::from_secs(30) + std::time::Duration::from_millis(bytes as u64 / 10_000)
}

/// The in-cluster cache as a loader's source.
struct CacheSource {
    store: async_nats::jetstream::object_store::ObjectStore,
    manifest: WeightManifest,
    cached: bool,
    rt: tokio::runtime::Handle,
}

impl ByteSource for CacheSource {
    fn name(&self) -> String {
        "cache (object store)".into()
    }
    fn size(&mut self) -> Result<u64, SourceError> {
        if self.cached {
            Ok(self.manifest.size)
        } else {
            Err(SourceError::Gone("does not hold this file".into()))
        }
    }
    fn read_at(&mut self, offset: u64, out: &mut [u8]) -> Result<(), SourceError> {
        let i = (offset / self.manifest.chunk_size) as usize;
        let name = object(&self.manifest.sha256, i);
        let store = self.store.clone();
        let want = out.len();
        let limit = chunk_read_timeout(want);
        let read = async move {
            let o = store
                .get(name.as_str())
                .await
                .map_err(|e| SourceError::Io(format!("{name}: {e}")))?;
            // At most one byte more than the chunk: a longer object is
            // refused below without reading it all.
            let mut v = Vec::with_capacity(want);
            o.take(want as u64 + 1)
                .read_to_end(&mut v)
                .await
                .map_err(|e| SourceError::Io(format!("{name}: {e}")))?;
            Ok::<_, SourceError>(v)
        };
        let bytes = self
            .rt
            .block_on(async move { tokio::time::timeout(limit, read).await })
            // A store that stalls on one chunk would stall on the next:
            // give the cache up, so the rest comes from other sources.
            .map_err(|_| {
                SourceError::Gone(format!(
                    "chunk {i} not read within {} s; the cache is given up for this load",
                    limit.as_secs()
                ))
            })??;
        if bytes.len() != out.len() {
            return Err(SourceError::Io(format!(
                "chunk {i} has {} bytes, not {}",
                bytes.len(),
                out.len()
            )));
        }
        out.copy_from_slice(&bytes);
        Ok(())
    }
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
            writing: Mutex::new(BTreeMap::new()),
            loading: Mutex::new(Default::default()),
        })
    }

    /// The file of `model`: `local` if it is there (served to peers from
    /// then on), else loaded from the cluster into the cache directory,
    /// waiting up to `wait` for a source to offer it. With `pin`, a file of
    /// any other content is refused.
    pub async fn model_file(
        self: &Arc<Self>,
        model: &str,
        local: Result<PathBuf, String>,
        pin: Option<ContentHash>,
        wait: Duration,
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
                self.serve_local(&p, model);
                Ok(ModelFile::Local(p))
            }
            Err(why) => self.fetch(model, why, pin, wait).await,
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

    /// Serves a local file to peers, in the background (hashing and
    /// registering it is off the worker's start), once per path.
    fn serve_local(self: &Arc<Self>, p: &Path, model: &str) {
        let first = {
            let mut serving = self.serving.lock().expect("serving lock");
            // A file [`Self::keep`] wrote is served from memory already.
            !serving.contains(p)
                & serving.insert(p.canonicalize().unwrap_or_else(|_| p.to_path_buf()))
        };
        if self.cfg.serve && first {
            let (me, file, model) = (self.clone(), p.to_path_buf(), model.to_string());
            self.tasks.lock().expect("tasks lock").spawn(async move {
                if let Err(e) = me.serve_file(&file, &model).await {
                    tracing::warn!(error = %e, file = %file.display(), "weights: not served to peers");
                }
            });
        }
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
        tracing::info!(model = %m.model, sha256 = %m.sha256.short(), provider = %d.provider, "weights: serving to peers");
        let mut tasks = self.tasks.lock().expect("tasks lock");
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
        self.tasks.lock().expect("tasks lock").abort_all();
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

    /// Writes a `loading` source record with the bytes verified so far,
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

    /// How long a node's start waits for a source ([`WeightsConfig::source_wait`]).
    pub fn source_wait(&self) -> Duration {
        self.cfg.source_wait
    }

    /// The catalog once a source this node would read offers `model`, or
    /// once `wait` has passed (the load then fails naming each source); the
    /// wait that ran out, if one did.
    async fn wait_for_source(
        &self,
        model: &str,
        local_why: &str,
        pin: Option<ContentHash>,
        wait: Duration,
    ) -> anyhow::Result<(Catalog, Option<Duration>)> {
        let start = tokio::time::Instant::now();
        let deadline = start + wait;
        let mut next_log = start;
        let mut last = None;
        loop {
            // One read, bounded; while the wait lasts, a bus error is one
            // more reason to wait (a fleet starting at once loads the bus).
            let read = tokio::time::timeout(CATALOG_READ, catalog(&self.bus))
                .await
                .unwrap_or_else(|_| {
                    Err(anyhow::anyhow!(
                        "reading the weights bucket took over {} s",
                        CATALOG_READ.as_secs()
                    ))
                });
            let read = read.map(|c| c.without_silent(unix_ms()));
            let now = tokio::time::Instant::now();
            let why = match read {
                Ok(cat) => match readable(&cat, model, pin, &self.node, &self.cfg) {
                    Ok(()) => return Ok((cat, None)),
                    Err(why) => {
                        last = Some(cat);
                        why
                    }
                },
                Err(e) => e.to_string(),
            };
            if now >= deadline {
                if !wait.is_zero() {
                    tracing::warn!(model, "weights: no source before the wait ran out ({why})");
                }
                return match last {
                    Some(cat) => Ok((cat, Some(wait))),
                    None => Err(anyhow::anyhow!("weights bucket: {why}")),
                };
            }
            if now >= next_log {
                next_log = now + SOURCE_WAIT_LOG;
                tracing::info!(
                    model,
                    local = local_why,
                    waited_s = (now - start).as_secs(),
                    left_s = (deadline - now).as_secs(),
                    "weights: no source yet ({why}); waiting for one"
                );
            }
            tokio::time::sleep(SOURCE_POLL.min(deadline - now)).await;
        }
    }

    /// What a failure message adds about a wait for a source that ran
    /// out.
    fn waited(&self, waited: Option<Duration>) -> String {
        match waited {
            Some(w) if !w.is_zero() => format!(
                " (after waiting {} s for one; ${} sets how long)",
                w.as_secs(),
                crate::env::WEIGHTS_WAIT_S
            ),
            _ => String::new(),
        }
    }

    /// Loads `model` from the cluster; `local_why` says why there is no
    /// local file.
    async fn fetch(
        self: &Arc<Self>,
        model: &str,
        local_why: String,
        pin: Option<ContentHash>,
        wait: Duration,
    ) -> anyhow::Result<ModelFile> {
        // A verified copy from an earlier start comes first.
        if let Some(sha) = &pin {
            if let Some(p) = self.local_copy(model, sha).await {
                tracing::info!(model, file = %p.display(), "weights: using the verified local copy");
                self.serve_local(&p, model);
                return Ok(ModelFile::Local(p));
            }
        }
        // A load that fails while wait time is left (its sources died, or
        // a dead peer's record has not gone stale yet) waits again.
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.fetch_once(model, &local_why, pin, left, wait).await {
                Err(e) if retryable(&e) && tokio::time::Instant::now() + SOURCE_POLL < deadline => {
                    tracing::warn!(model, error = %format!("{e:#}"), "weights: the load failed; waiting for a source again");
                    tokio::time::sleep(SOURCE_POLL).await;
                }
                r => return r,
            }
        }
    }

    /// One wait for a source, then one load from what offers it.
    /// `wait` is what is left of the `total` wait.
    async fn fetch_once(
        self: &Arc<Self>,
        model: &str,
        local_why: &str,
        pin: Option<ContentHash>,
        wait: Duration,
        total: Duration,
    ) -> anyhow::Result<ModelFile> {
        let (cat, waited) = self.wait_for_source(model, local_why, pin, wait).await?;
        let waited = waited.map(|_| total);
        // The content most nodes serve, else any cached one.
        let mut candidates: Vec<&WeightManifest> = cat
            .manifests
            .values()
            .filter(|m| m.model == model && m.layout == GGUF)
            .filter(|m| pin.is_none_or(|p| p == m.sha256))
            .collect();
        // Ranked by what this node can read: ready peers on its provider,
        // and the cache, where its order names them (as the wait counts).
        let peers = self.cfg.order.contains(&Step::Peer);
        let cache = self.cfg.order.contains(&Step::Cache);
        let ready = |m: &WeightManifest| {
            cat.sources.get(&m.sha256).map_or(0, |v| {
                v.iter()
                    .filter(|s| {
                        peers
                            && s.state == WeightSourceState::Ready
                            && s.node != self.node
                            && s.provider == self.cfg.provider
                    })
                    .count()
            })
        };
        candidates.sort_by_key(|m| {
            std::cmp::Reverse((ready(m), (cache && cat.cached.contains(&m.sha256)) as usize))
        });
        let Some(m) = candidates.first().map(|m| (*m).clone()) else {
            let pinned = pin.map_or(String::new(), |p| {
                format!(" with the pinned sha256 {}", p.hex())
            });
            anyhow::bail!(
                "no source for model {model}{pinned}: file: {local_why}; peer: none advertises it; cache: does not hold it{}",
                self.waited(waited)
            );
        };
        if pin.is_none() {
            if let Some(p) = self.local_copy(model, &m.sha256).await {
                tracing::info!(model, file = %p.display(), "weights: using the verified local copy");
                self.serve_local(&p, model);
                return Ok(ModelFile::Local(p));
            }
        }
        let path = self.cfg.cache_dir.join(format!("{}.gguf", m.sha256.hex()));
        let mut sources = Vec::new();
        for step in &self.cfg.order {
            match step {
                Step::Peer => {
                    for s in cat.sources.get(&m.sha256).into_iter().flatten() {
                        if s.state != WeightSourceState::Ready
                            || s.node == self.node
                            || s.provider != self.cfg.provider
                        {
                            continue;
                        }
                        sources.push(Source::Peer(dynamo_weights::source::PeerSource {
                            name: s.node.0.clone(),
                            address: s.address.clone(),
                            region: dynamo_transfer::RemoteRegion {
                                key: s.region_key,
                                base: s.region_base,
                                len: s.size,
                            },
                        }));
                    }
                }
                Step::Cache => match self
                    .bus
                    .object_store(&self.bus.subjects.weights_objects())
                    .await
                {
                    Ok(store) => sources.push(Source::Bytes(Box::new(CacheSource {
                        store,
                        manifest: m.clone(),
                        cached: cat.cached.contains(&m.sha256),
                        rt: tokio::runtime::Handle::current(),
                    }))),
                    Err(e) => sources.push(Source::Bytes(Box::new(Unavailable {
                        name: "cache (object store)".into(),
                        why: e.to_string(),
                    }))),
                },
                Step::File => sources.push(Source::Bytes(Box::new(FileSource::new(&path)))),
            }
        }
        tracing::info!(model, sha256 = %m.sha256.short(), sources = sources.len(), "weights: loading from the cluster");
        let opts = LoadOptions {
            provider: self.cfg.provider.clone(),
            window: 8,
            peer_timeout: self.cfg.peer_timeout,
            max_bytes_per_sec: self.cfg.max_bytes_per_sec,
        };
        let m2 = m.clone();
        // Progress on the bus while it loads (`dynamoctl models ls`,
        // `status`): a `loading` record, rewritten every second.
        let (done_tx, done_rx) = tokio::sync::watch::channel(0u64);
        self.loading.lock().expect("loading lock").insert(m.sha256);
        let mut reporter = JoinSet::new();
        reporter.spawn(self.clone().report_loading(m.clone(), done_rx));
        let loaded = tokio::task::spawn_blocking(move || {
            let mut last = 0u64;
            let mut log = |p: &LoadProgress| {
                done_tx.send_replace(p.done);
                let pct = p.done * 100 / p.total.max(1);
                if pct >= last + 10 || p.done == p.total {
                    last = pct;
                    tracing::info!(done = p.done, total = p.total, source = %p.source, "weights: {pct}% loaded");
                }
            };
            let loaded = load(&m2, sources, &opts, None, &mut log);
            (done_tx, loaded)
        })
        .await;
        let failed: anyhow::Error = match loaded {
            Ok((progress, Ok(loaded))) => {
                return self.fetched(model, path, m, loaded, progress, reporter);
            }
            // The load's sender goes first: the reporter ends on it.
            Ok((progress, Err(e))) => {
                drop(progress);
                e.into()
            }
            Err(e) => e.into(),
        };
        // No `loading` record outlives a failed load.
        self.end_loading(&m.sha256, &mut reporter).await;
        Err(failed)
    }

    /// A load that succeeded, as [`ModelFile::Fetched`].
    fn fetched(
        &self,
        model: &str,
        path: PathBuf,
        m: WeightManifest,
        loaded: dynamo_weights::Loaded,
        progress: tokio::sync::watch::Sender<u64>,
        reporter: JoinSet<()>,
    ) -> anyhow::Result<ModelFile> {
        tracing::info!(
            model,
            ms = loaded.elapsed.as_millis() as u64,
            by_source = ?loaded.by_source,
            refetched = loaded.refetched,
            "weights: loaded and verified"
        );
        // The `loading` record stays fresh (at 100%) until the node serves
        // the file or drops it.
        Ok(ModelFile::Fetched(Box::new(Fetched {
            path,
            model: model.to_string(),
            manifest: m,
            loaded,
            progress,
            reporter,
        })))
    }

    /// Stops reporting a load and removes its `loading` record.
    async fn end_loading(&self, sha: &ContentHash, reporter: &mut JoinSet<()>) {
        // Its sender dropped, the reporter ends; awaited, so no late
        // write of the record follows its removal.
        while let Some(r) = reporter.join_next().await {
            if let Err(e) = r {
                tracing::warn!(error = %e, "weights: the progress reporter failed");
            }
        }
        if let Ok(kv) = bucket(&self.bus).await {
            let key = WeightSource::key_of(sha, &self.node);
            if let Err(e) = kv.purge(&key).await {
                tracing::warn!(key, error = %e, "weights: loading record not removed");
            }
        }
        self.loading.lock().expect("loading lock").remove(sha);
    }

    /// Keeps a fetched model, in the background (off the worker's start):
    /// writes it to its path, its manifest remembered (every byte was just
    /// verified, so it is not hashed again at the next start), then serves
    /// it to peers from the memory it landed in. Answers when the file is
    /// written, for what reads the file itself (an engine server).
    pub fn keep(self: &Arc<Self>, f: Box<Fetched>) -> Written {
        let (tx, rx) = tokio::sync::watch::channel(None);
        let sha = f.manifest.sha256;
        // Served from memory below: a group that finds the written file
        // does not serve it again.
        self.serving
            .lock()
            .expect("serving lock")
            .insert(f.path.clone());
        self.writing
            .lock()
            .expect("writing lock")
            .insert(sha, Written(rx.clone()));
        let me = self.clone();
        self.tasks.lock().expect("tasks lock").spawn(async move {
            let (path, model) = (f.path.clone(), f.model.clone());
            let manifests = me.cfg.manifest_dir.clone();
            let written = tokio::task::spawn_blocking(move || {
                let res = write_verified(&f.path, &manifests, &f.manifest, f.loaded.bytes());
                (f, res)
            })
            .await;
            let f = match written {
                Ok((f, Ok(()))) => {
                    tracing::info!(model, file = %path.display(), "weights: the loaded file is kept");
                    tx.send_replace(Some(Ok(())));
                    Some(f)
                }
                Ok((f, Err(e))) => {
                    tracing::warn!(model, file = %path.display(), error = %e, "weights: the loaded file is not kept; the next start loads it again");
                    tx.send_replace(Some(Err(e.to_string())));
                    Some(f)
                }
                Err(e) => {
                    tracing::warn!(model, file = %path.display(), error = %e, "weights: writing the loaded file failed");
                    tx.send_replace(Some(Err(e.to_string())));
                    None
                }
            };
            me.writing.lock().expect("writing lock").remove(&sha);
            let Some(f) = f else {
                return;
            };
            let Fetched {
                loaded,
                progress,
                mut reporter,
                ..
            } = *f;
            drop(progress);
            if !me.cfg.serve {
                me.end_loading(&sha, &mut reporter).await;
                return;
            }
            // The reporter stops before the record turns `ready`.
            while reporter.join_next().await.is_some() {}
            let served = match loaded.into_registered() {
                Ok((agent, region, manifest)) => {
                    match tokio::task::spawn_blocking(move || {
                        WeightServer::new(agent, region, manifest)
                    })
                    .await
                    {
                        Ok(Ok(server)) => me.advertise(server).await,
                        Ok(Err(e)) => Err(e.into()),
                        Err(e) => Err(e.into()),
                    }
                }
                Err(_) => me.serve_file(&path, &model).await,
            };
            match served {
                // The record says `ready` now.
                Ok(()) => {
                    me.loading.lock().expect("loading lock").remove(&sha);
                }
                Err(e) => {
                    tracing::warn!(model, error = %e, "weights: not served to peers");
                    me.end_loading(&sha, &mut JoinSet::new()).await;
                }
            }
        });
        Written(rx)
    }
}

/// A model file as [`NodeWeights::model_file`] found it.
pub enum ModelFile {
    /// A file on this node: given, or kept by an earlier load.
    Local(PathBuf),
    /// Loaded from the cluster and verified, in memory: hand it to
    /// [`NodeWeights::keep`] once read.
    Fetched(Box<Fetched>),
}

/// A model loaded from the cluster, verified, in memory.
pub struct Fetched {
    /// Where [`NodeWeights::keep`] writes it.
    pub path: PathBuf,
    model: String,
    manifest: WeightManifest,
    loaded: dynamo_weights::Loaded,
    /// The load's progress, reported while this lives.
    progress: tokio::sync::watch::Sender<u64>,
    reporter: JoinSet<()>,
}

impl Fetched {
    /// The file's bytes, every one verified against its content hash.
    pub fn bytes(&self) -> &[u8] {
        self.loaded.bytes()
    }
}

/// Whether a kept file is written: `Ok` once it is, the error if it could
/// not be.
#[derive(Clone)]
pub struct Written(tokio::sync::watch::Receiver<Option<Result<(), String>>>);

impl Written {
    pub async fn wait(mut self) -> Result<(), String> {
        match self.0.wait_for(Option::is_some).await {
            Ok(r) => r.clone().unwrap_or(Ok(())),
            Err(_) => Err("the node stopped before the file was written".into()),
        }
    }
}

/// Writes verified bytes to `path` (a temporary name, then renamed, so the
/// file is whole or absent) and remembers its manifest.
fn write_verified(
    path: &Path,
    manifests: &Path,
    manifest: &WeightManifest,
    bytes: &[u8],
) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("gguf.part");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)?;
    if let Err(e) = dynamo_weights::manifest::remember(manifests, path, manifest) {
        tracing::debug!(error = %e, "weights: manifest of the loaded file not kept");
    }
    Ok(())
}

/// Whether a load of `model` could start now: some content of it (the
/// pinned one, if any) is offered by a source in this node's order, a
/// ready peer on its provider or the cache. Otherwise, what is missing.
fn readable(
    cat: &Catalog,
    model: &str,
    pin: Option<ContentHash>,
    me: &NodeId,
    cfg: &WeightsConfig,
) -> Result<(), String> {
    let mut missing = Vec::new();
    let candidates = cat
        .manifests
        .values()
        .filter(|m| m.model == model && m.layout == GGUF)
        .filter(|m| pin.is_none_or(|p| p == m.sha256));
    for m in candidates {
        if cfg.order.contains(&Step::Cache) && cat.cached.contains(&m.sha256) {
            return Ok(());
        }
        for s in cat.sources.get(&m.sha256).into_iter().flatten() {
            if s.node == *me {
                continue;
            }
            match s.state {
                WeightSourceState::Ready if s.provider == cfg.provider => {
                    if cfg.order.contains(&Step::Peer) {
                        return Ok(());
                    }
                    missing.push(format!(
                        "{} serves it but peers are not in the order",
                        s.node.0
                    ));
                }
                WeightSourceState::Ready => missing.push(format!(
                    "{} serves it over {}, not {}",
                    s.node.0, s.provider, cfg.provider
                )),
                WeightSourceState::Loading => missing.push(format!(
                    "{} is loading it ({}%)",
                    s.node.0,
                    (u128::from(s.loaded_bytes) * 100 / u128::from(s.size.max(1))).min(100)
                )),
                WeightSourceState::Unknown => {}
            }
        }
    }
    if missing.is_empty() {
        let pinned = pin.map_or(String::new(), |p| format!(" with sha256 {}", p.short()));
        return Err(format!("no node advertises {model}{pinned}"));
    }
    Err(missing.join("; "))
}

/// Whether a failed load may succeed if tried again: its sources failed
/// (a peer died, a read broke), not the content.
fn retryable(e: &anyhow::Error) -> bool {
    matches!(
        e.downcast_ref::<dynamo_weights::LoadError>(),
        Some(dynamo_weights::LoadError::NoSource { .. })
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(order: Vec<Step>) -> WeightsConfig {
        WeightsConfig {
            order,
            provider: "tcp;ofi_rxm".into(),
            cache_dir: PathBuf::from("/nonexistent"),
            manifest_dir: PathBuf::from("/nonexistent"),
            serve: true,
            peer_timeout: Duration::from_secs(1),
            max_bytes_per_sec: None,
            source_wait: DEFAULT_SOURCE_WAIT,
        }
    }

    fn manifest(model: &str, byte: u8) -> WeightManifest {
        WeightManifest {
            model: model.into(),
            sha256: ContentHash([byte; 32]),
            layout: GGUF.into(),
            size: 100,
            chunk_size: 100,
            chunks: vec![ContentHash([byte; 32])],
        }
    }

    fn source(
        m: &WeightManifest,
        node: &str,
        state: WeightSourceState,
        provider: &str,
    ) -> WeightSource {
        WeightSource {
            node: NodeId(node.into()),
            model: m.model.clone(),
            sha256: m.sha256,
            layout: GGUF.into(),
            size: m.size,
            state,
            loaded_bytes: 40,
            provider: provider.into(),
            address: vec![1],
            region_key: 1,
            region_base: 0,
            updated_unix_ms: 0,
        }
    }

    fn catalog_of(m: &WeightManifest, sources: Vec<WeightSource>, cached: bool) -> Catalog {
        let mut c = Catalog::default();
        c.manifests.insert(m.sha256, m.clone());
        if cached {
            c.cached.insert(m.sha256);
        }
        if !sources.is_empty() {
            c.sources.insert(m.sha256, sources);
        }
        c
    }

    #[test]
    fn a_load_waits_until_a_source_in_the_order_offers_the_model() {
        let me = NodeId("b".into());
        let all = cfg(vec![Step::Peer, Step::Cache, Step::File]);
        let m = manifest("smol", 1);
        let rxm = "tcp;ofi_rxm";

        // Nothing advertised yet.
        let why = readable(&Catalog::default(), "smol", None, &me, &all).unwrap_err();
        assert_eq!(why, "no node advertises smol");

        // A peer still loading it, and this node's own record, are not sources.
        let c = catalog_of(
            &m,
            vec![
                source(&m, "a", WeightSourceState::Loading, rxm),
                source(&m, "b", WeightSourceState::Ready, rxm),
            ],
            false,
        );
        assert_eq!(
            readable(&c, "smol", None, &me, &all).unwrap_err(),
            "a is loading it (40%)"
        );

        // A ready peer on another provider is named, and not read.
        let c = catalog_of(
            &m,
            vec![source(&m, "a", WeightSourceState::Ready, "shm")],
            false,
        );
        assert_eq!(
            readable(&c, "smol", None, &me, &all).unwrap_err(),
            "a serves it over shm, not tcp;ofi_rxm"
        );

        // A ready peer on this provider is a source, unless peers are left out.
        let c = catalog_of(
            &m,
            vec![source(&m, "a", WeightSourceState::Ready, rxm)],
            false,
        );
        assert_eq!(readable(&c, "smol", None, &me, &all), Ok(()));
        let cache_only = cfg(vec![Step::Cache]);
        assert!(readable(&c, "smol", None, &me, &cache_only).is_err());

        // The cache is a source when the order names it.
        let c = catalog_of(&m, vec![], true);
        assert_eq!(readable(&c, "smol", None, &me, &cache_only), Ok(()));
        assert!(readable(&c, "smol", None, &me, &cfg(vec![Step::Peer, Step::File])).is_err());

        // Another model, or other content than the pinned, is no source.
        assert!(readable(&c, "other", None, &me, &all).is_err());
        let why = readable(&c, "smol", Some(ContentHash([2; 32])), &me, &all).unwrap_err();
        assert!(
            why.starts_with("no node advertises smol with sha256 "),
            "{why}"
        );
        assert_eq!(readable(&c, "smol", Some(m.sha256), &me, &all), Ok(()));
    }
}
