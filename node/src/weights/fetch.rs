//! Loading a model from the cluster: waiting (bounded) for a source to
//! offer it, one verified load from what offers it (again while time is
//! left), and keeping what it loaded: the file written in the background,
//! then served to peers from memory.

use super::cache::{CacheSource, Unavailable};
use super::*;

impl NodeWeights {
    /// How long a node's start waits for a source ([`WeightsConfig::source_wait`]).
    pub fn source_wait(&self) -> Duration {
        self.cfg.source_wait
    }

    /// The catalog once a source this node would read offers `model`, or
    /// once `wait` has passed (the load then fails naming each source); the
    /// reason the wait ran out, if it did.
    async fn wait_for_source(
        &self,
        model: &str,
        local_why: &str,
        pin: Option<ContentHash>,
        wait: Duration,
    ) -> anyhow::Result<(Catalog, Option<String>)> {
        let start = tokio::time::Instant::now();
        let deadline = start + wait;
        let mut next_log = start;
        let mut last = None;
        loop {
            // One read, bounded; while the wait lasts, a bus error is one
            // more reason to wait (a fleet starting at once loads the bus).
            // Silence is judged from before the read, so a slow read does
            // not make live peers look silent.
            let before_read = unix_ms();
            let read = tokio::time::timeout(CATALOG_READ, catalog(&self.bus))
                .await
                .unwrap_or_else(|_| {
                    Err(anyhow::anyhow!(
                        "reading the weights bucket took over {} s",
                        CATALOG_READ.as_secs()
                    ))
                });
            let read = read.map(|c| c.without_silent(before_read));
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
                    Some(cat) => Ok((cat, Some(why))),
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
    pub(super) async fn fetch(
        self: &Arc<Self>,
        model: &str,
        local_why: String,
        pin: Option<ContentHash>,
        wait: Duration,
        engine_reads: bool,
    ) -> anyhow::Result<ModelFile> {
        // A verified copy from an earlier start comes first.
        if let Some(sha) = &pin {
            if let Some(p) = self.local_copy(model, sha).await {
                tracing::info!(model, file = %p.display(), "weights: using the verified local copy");
                return self.local(p, model, engine_reads, pin).await;
            }
        }
        // A load that fails while wait time is left (its sources died, or
        // a dead peer's record has not gone stale yet) waits again.
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self
                .fetch_once(model, &local_why, pin, left, wait, engine_reads)
                .await
            {
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
        engine_reads: bool,
    ) -> anyhow::Result<ModelFile> {
        let (cat, waited) = self.wait_for_source(model, local_why, pin, wait).await?;
        let (waited, ran_out) = match waited {
            Some(why) => (Some(total), Some(why)),
            None => (None, None),
        };
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
                    .filter(|s| peers && readable_peer(s, &self.node, &self.cfg))
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
                return self.local(p, model, engine_reads, Some(m.sha256)).await;
            }
        }
        let path = self.cfg.cache_dir.join(format!("{}.gguf", m.sha256.hex()));
        let mut sources = Vec::new();
        for step in &self.cfg.order {
            match step {
                Step::Peer => {
                    for s in cat.sources.get(&m.sha256).into_iter().flatten() {
                        if !readable_peer(s, &self.node, &self.cfg) {
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
                    Ok(store) => sources.push(Source::Bytes(Box::new(CacheSource::new(
                        store,
                        m.clone(),
                        cat.cached.contains(&m.sha256),
                    )))),
                    Err(e) => sources.push(Source::Bytes(Box::new(Unavailable {
                        name: "cache (object store)".into(),
                        why: e.to_string(),
                    }))),
                },
                Step::File => sources.push(Source::Bytes(Box::new(FileSource::new(&path)))),
            }
        }
        if sources.is_empty() {
            // Nothing to try (the wait ran out on peers this node cannot
            // read): say why, not that no source was configured.
            let why = ran_out.unwrap_or_else(|| "no source in the order offers it".into());
            anyhow::bail!("no source for model {model}: {why}{}", self.waited(waited));
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
            // Shared (its memory frozen) here: a failure is a failed load.
            let loaded = load(&m2, sources, &opts, None, &mut log).and_then(|l| l.into_shared());
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
        loaded: dynamo_weights::SharedLoad,
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
        self.keeping.lock().expect("keeping lock").spawn(async move {
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
                // The load's reporter went with it: its record goes too.
                me.end_loading(&sha, &mut JoinSet::new()).await;
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
                Some((agent, region, manifest)) => {
                    match tokio::task::spawn_blocking(move || {
                        WeightServer::shared(agent, region, manifest)
                    })
                    .await
                    {
                        Ok(Ok(server)) => me.advertise(server).await,
                        Ok(Err(e)) => Err(e.into()),
                        Err(e) => Err(e.into()),
                    }
                }
                None => me.serve_file(&path, &model).await,
            };
            match served {
                // The record says `ready` now.
                Ok(()) => {
                    me.loading.lock().expect("loading lock").remove(&sha);
                }
                Err(e) => {
                    if me.stopping.load(std::sync::atomic::Ordering::SeqCst) {
                        tracing::info!(model, "weights: the node stops; the kept file is not served");
                    } else {
                        tracing::warn!(model, error = %e, "weights: not served to peers");
                    }
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
    /// A file on this node, read into the memory it is served to peers
    /// from; the engine shares these bytes rather than reading its own.
    Shared { path: PathBuf, bytes: bytes::Bytes },
}

/// A model loaded from the cluster, verified, in memory.
pub struct Fetched {
    /// Where [`NodeWeights::keep`] writes it.
    pub path: PathBuf,
    model: String,
    manifest: WeightManifest,
    /// Shared with the CPU engine's weights, the write and the server.
    loaded: dynamo_weights::SharedLoad,
    /// The load's progress, reported while this lives.
    progress: tokio::sync::watch::Sender<u64>,
    reporter: JoinSet<()>,
}

impl Fetched {
    /// The file's bytes, every one verified against its content hash;
    /// a clone shares them.
    pub fn bytes(&self) -> &bytes::Bytes {
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

/// Whether this node can read from `s`: another node's `ready` record, on
/// this node's provider (the wait, the ranking and the load agree on it).
fn readable_peer(s: &WeightSource, me: &NodeId, cfg: &WeightsConfig) -> bool {
    s.state == WeightSourceState::Ready && s.node != *me && s.provider == cfg.provider
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
                _ if readable_peer(s, me, cfg) => {
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
