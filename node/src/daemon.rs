//! The node daemon's lifecycle: bus (embedded or remote), models, the
//! supervisor, node registration, signals and graceful shutdown.

use crate::config::EngineSpec;
use crate::config::{NatsSpec, NodeConfig};
use crate::embedded_nats::{EmbeddedNats, Security};
use crate::supervisor::GroupModel;
use crate::supervisor::{NodeSupervisor, SupervisorArgs, SupervisorMsg};
use dynamo_bus_schema::access::{Role, User};
use dynamo_bus_schema::{encode, unix_ms, NodeRegistration, Subjects};
use dynamo_cpu_engine::Weights;
use dynamo_model::{locate_default_gguf, LoadedModel};
use dynamo_runtime::{Bus, BusAccess, Credentials};
use ractor::Actor;
use std::sync::Arc;
use std::time::Duration;
use tokio::signal::unix::{signal, SignalKind};

pub async fn run(cfg: NodeConfig) -> anyhow::Result<()> {
    // An embedded server makes its own users: every role of this namespace.
    let generated = match &cfg.nats {
        NatsSpec::Embedded { auth: true, .. } => Some(Credentials::generate()?),
        _ => None,
    };
    let embedded = match &cfg.nats {
        NatsSpec::Embedded { port, tls, .. } => {
            let accounts = generated.as_ref().map(|c| {
                let users: Vec<User> = c
                    .public_keys()
                    .into_iter()
                    .map(|(role, nkey)| User {
                        role,
                        namespace: cfg.namespace.clone(),
                        nkey,
                    })
                    .collect();
                dynamo_bus_schema::access::accounts(&users)
            });
            let security = Security {
                tls: *tls,
                accounts,
            };
            Some(EmbeddedNats::start(*port, security).await?)
        }
        NatsSpec::Url(_) => None,
    };
    let (url, base, creds) = match (&cfg.nats, &embedded) {
        (_, Some(e)) => (
            e.url.clone(),
            BusAccess {
                ca_file: e.ca_file.clone(),
                user: None,
            },
            // The admin seed goes to the CLI's state directory, not to the
            // node's connections.
            generated
                .as_ref()
                .map(|c| c.only(&crate::access::node_roles())),
        ),
        (NatsSpec::Url(u), None) => (
            u.clone(),
            BusAccess {
                ca_file: cfg.nats_access.ca_file.clone(),
                user: None,
            },
            match &cfg.nats_access.credentials {
                Some(dir) => Some(Credentials::read(dir)?),
                None => None,
            },
        ),
        (NatsSpec::Embedded { .. }, None) => unreachable!("embedded server started above"),
    };
    // The CLI finds a local embedded server here: its URL, its CA and the
    // admin credentials (owner-only).
    let (url_file, ca_file, creds_dir) = crate::access::state_files(&cfg.namespace);
    if let Some(e) = &embedded {
        crate::access::create_state_dir()?;
        std::fs::write(&url_file, &url)?;
        let _ = std::fs::remove_file(&ca_file);
        let _ = std::fs::remove_dir_all(&creds_dir);
        if let Some(ca) = &e.ca_file {
            std::fs::copy(ca, &ca_file)?;
        }
        if let Some(c) = &generated {
            c.only(&[Role::Admin]).write(&creds_dir)?;
        }
    }
    let res = serve(&cfg, &url, base, creds).await;
    if embedded.is_some() {
        let _ = std::fs::remove_file(&url_file);
        let _ = std::fs::remove_file(&ca_file);
        let _ = std::fs::remove_dir_all(&creds_dir);
    }
    if let Some(e) = embedded {
        e.stop().await;
    }
    res
}

async fn serve(
    cfg: &NodeConfig,
    url: &str,
    base: BusAccess,
    creds: Option<Credentials>,
) -> anyhow::Result<()> {
    // Before anything loads libfabric: its `shm` provider installs
    // SIGTERM and SIGINT handlers that unlink its files and re-raise with
    // the action they replaced. Installed after ours, they hand the signal
    // on to ours; installed first, ours would chain to theirs, and the
    // node would die at once instead of draining.
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let subjects = Subjects::new(cfg.namespace.clone());
    let buses = crate::access::NodeBuses::connect(
        url,
        &format!("dynamo-node {}", cfg.node_id),
        subjects,
        base,
        creds,
    )
    .await?;
    let bus = buses.node().clone();
    // Two nodes under one id would share worker ids and records, and the
    // second's exit would make the controller move the first's replicas.
    check_node_id_free(&bus, &cfg.node_id).await?;
    // Made by the node: its workers may not make streams.
    crate::access::ensure_worker_streams(&bus).await;

    let weights = crate::weights::NodeWeights::new(
        bus.clone(),
        cfg.node_id.clone(),
        crate::weights::WeightsConfig::from_env()?,
    );
    // Loading may wait for a source and move gigabytes: a signal meanwhile
    // stops the node there.
    let load = async {
        let mut models = Vec::new();
        for group in &cfg.workers {
            models.push(Arc::new(
                load_group_model(group, &weights, weights.source_wait()).await?,
            ));
        }
        Ok::<_, anyhow::Error>(models)
    };
    let models = tokio::select! {
        r = load => r?,
        _ = term.recv() => return stopped_starting(&weights).await,
        _ = int.recv() => return stopped_starting(&weights).await,
    };

    crate::metrics::started(&cfg.node_id.0, cfg.namespace.as_str());
    // Bound before any actor starts: a taken port is a start-up error.
    // Owned by the loop below: the node fails if its listener does.
    let mut metrics_srv = tokio::task::JoinSet::new();
    if let Some(listen) = &cfg.metrics_listen {
        let (addr, srv) = crate::metrics::serve(
            listen.addr,
            listen.token.clone(),
            cfg.node_id.0.clone(),
            bus.clone(),
        )
        .await?;
        tracing::info!(%addr, "metrics on http://{addr}/metrics");
        println!(
            "dynamo-node {} metrics on http://{addr}/metrics",
            cfg.node_id
        );
        metrics_srv.spawn(srv);
    }
    let args = SupervisorArgs {
        bus: bus.clone(),
        buses: buses.clone(),
        config: cfg.clone(),
        models,
        weights: weights.clone(),
    };
    let (sup, sup_handle) =
        Actor::spawn(Some(format!("node-{}", cfg.node_id)), NodeSupervisor, args)
            .await
            .map_err(|e| anyhow::anyhow!("node failed to start: {e}"))?;

    let nodes = bus
        .kv_bucket(
            &bus.subjects.nodes_bucket(),
            dynamo_runtime::bus::REGISTRY_MAX_AGE,
        )
        .await?;
    let mut actors = match sup
        .call(SupervisorMsg::Children, Some(Duration::from_secs(2)))
        .await
    {
        Ok(ractor::rpc::CallResult::Success(c)) => c,
        _ => Vec::new(),
    };
    actors.sort();
    let reg = NodeRegistration {
        node_id: cfg.node_id.clone(),
        pid: std::process::id(),
        hostname: hostname(),
        actors,
        http_addr: cfg.gateway.as_ref().map(|g| g.listen.to_string()),
        started_unix_ms: unix_ms(),
        heartbeat_unix_ms: unix_ms(),
    };
    let node_key = cfg.node_id.0.clone();
    let registrar = NodeRegistrar {
        bus: bus.clone(),
        nodes: nodes.clone(),
        key: node_key.clone(),
    };
    let joined = cfg.join.is_some();
    // A joined node's agent writes its record (with labels and capacity).
    if !joined {
        registrar.put(&reg).await;
    }
    println!(
        "dynamo-node {} ready: nats {}{}",
        cfg.node_id,
        dynamo_runtime::bus::redact_url(url),
        cfg.gateway
            .as_ref()
            .map(|g| format!(", OpenAI API on http://{}", g.listen))
            .unwrap_or_default()
    );

    // The node's record is refreshed by a task of its own, so a slow or
    // absent bus never delays the reaction to a signal.
    // Owned here: if it ever ends (a panic), it is started again. A joined
    // node has none: its agent writes its record.
    let mut heartbeat = tokio::task::JoinSet::new();
    if !joined {
        heartbeat.spawn(registrar.clone().run(reg.clone(), sup.clone()));
    }
    let mut sup_handle = sup_handle;
    let mut bus_gauge = tokio::time::interval(Duration::from_secs(1));
    let died = loop {
        tokio::select! {
            _ = term.recv() => break false,
            _ = int.recv() => break false,
            _ = &mut sup_handle => break true,
            _ = bus_gauge.tick() => crate::metrics::bus_state(&cfg.node_id.0, bus.is_connected()),
            Some(r) = metrics_srv.join_next() => {
                tracing::error!(result = ?r, "the metrics listener ended; stopping the node");
                break true;
            }
            Some(r) = heartbeat.join_next() => {
                tracing::error!(error = ?r.err(), "the node's registration task ended; starting it again");
                heartbeat.spawn(registrar.clone().run(reg.clone(), sup.clone()));
            }
        }
    };
    heartbeat.abort_all();
    metrics_srv.abort_all();
    if died {
        anyhow::bail!("node supervisor stopped unexpectedly");
    }
    // A second signal stops the node at once (this watcher lives until
    // the process exits).
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {},
            _ = int.recv() => {},
        }
        eprintln!("dynamo-node: second signal; stopping now");
        std::process::exit(130);
    });
    tracing::info!("shutting down: draining in-flight requests");
    // Peers stop reading weights from here first.
    if bus.is_connected() {
        let _ = tokio::time::timeout(Duration::from_secs(2), weights.withdraw()).await;
    }
    if let Some(agent) = ractor::registry::where_is(crate::agent::AGENT_NAME) {
        let agent = ractor::ActorRef::<crate::agent::AgentMsg>::from(agent);
        let _ = agent
            .call(crate::agent::AgentMsg::Leave, Some(Duration::from_secs(1)))
            .await;
    }
    let grace = cfg.shutdown_grace + Duration::from_secs(5);
    let _ = sup.call(SupervisorMsg::Shutdown, Some(grace)).await;
    // A file loaded just before, written meanwhile, is kept for the next
    // start (bounded; not served any more).
    weights
        .finish_writes(cfg.shutdown_grace.min(Duration::from_secs(30)))
        .await;
    sup.stop(None);
    let _ = tokio::time::timeout(Duration::from_secs(5), sup_handle).await;
    // Bounded, and skipped without a bus: nothing would answer.
    if bus.is_connected() {
        let _ = tokio::time::timeout(Duration::from_secs(2), nodes.delete(&node_key)).await;
    }
    buses.flush_all().await;
    tracing::info!("node stopped");
    Ok(())
}

/// A node stopped by a signal while it loaded its models: its weight
/// records go (bounded), and nothing else had started.
async fn stopped_starting(weights: &crate::weights::NodeWeights) -> anyhow::Result<()> {
    tracing::info!("stopped by a signal while loading models");
    if tokio::time::timeout(Duration::from_secs(2), weights.withdraw())
        .await
        .is_err()
    {
        tracing::warn!("weights: records not withdrawn within 2 s; they go stale in 15 s");
    }
    weights.finish_writes(Duration::from_secs(10)).await;
    Ok(())
}

/// Writes the node's record in the nodes bucket.
#[derive(Clone)]
struct NodeRegistrar {
    bus: Bus,
    nodes: async_nats::jetstream::kv::Store,
    key: String,
}

impl NodeRegistrar {
    /// One write, bounded; the bus may have restarted without its
    /// JetStream state, so the bucket is created again and the write
    /// retried once.
    async fn put(&self, reg: &NodeRegistration) {
        let b: bytes::Bytes = match encode(reg) {
            Ok(b) => b.into(),
            Err(e) => return tracing::error!(error = %e, "cannot encode node registration"),
        };
        let limit = Duration::from_secs(2);
        if let Ok(Ok(_)) =
            tokio::time::timeout(limit, self.nodes.put(self.key.clone(), b.clone())).await
        {
            return;
        }
        if !self.bus.is_connected() {
            return;
        }
        let again = async {
            let kv = self
                .bus
                .kv_bucket(
                    &self.bus.subjects.nodes_bucket(),
                    dynamo_runtime::bus::REGISTRY_MAX_AGE,
                )
                .await
                .map_err(|e| e.to_string())?;
            // The server lost its JetStream state: the workers' streams too.
            crate::access::ensure_worker_streams(&self.bus).await;
            kv.put(self.key.clone(), b).await.map_err(|e| e.to_string())
        };
        match tokio::time::timeout(limit, again).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "cannot refresh node registration"),
            Err(_) => tracing::warn!("refreshing the node registration timed out"),
        }
    }

    /// Refreshes the record every second with the actors running.
    async fn run(self, mut reg: NodeRegistration, sup: ractor::ActorRef<SupervisorMsg>) {
        let mut beat = tokio::time::interval(Duration::from_secs(1));
        beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        beat.tick().await;
        loop {
            beat.tick().await;
            reg.heartbeat_unix_ms = unix_ms();
            if let Ok(ractor::rpc::CallResult::Success(mut c)) = sup
                .call(SupervisorMsg::Children, Some(Duration::from_secs(1)))
                .await
            {
                c.sort();
                reg.actors = c;
            }
            self.put(&reg).await;
        }
    }
}

/// A node record older than this (by its writer's clock) is a node long
/// gone; a younger one is watched for [`NODE_WATCH`] to see if it changes.
const NODE_GONE_MS: u64 = 30_000;
/// How long a younger record is watched: a live node rewrites it every
/// second, so two and a half heartbeats.
const NODE_WATCH: Duration = Duration::from_millis(2_500);

/// Fails when another live node holds `id`: its record in the nodes bucket
/// is rewritten while this node watches it. Records a live node cannot
/// have written are let go at once: one older than [`NODE_GONE_MS`], or
/// one of this host whose process is gone (a crash and a quick restart).
/// Liveness is judged by the record changing, not by timestamps, so a
/// writer's skewed clock or a new hostname cannot hold an id.
async fn check_node_id_free(bus: &Bus, id: &dynamo_bus_schema::NodeId) -> anyhow::Result<()> {
    let limit = Duration::from_secs(5);
    let kv = match tokio::time::timeout(
        limit,
        bus.kv_bucket(
            &bus.subjects.nodes_bucket(),
            dynamo_runtime::bus::REGISTRY_MAX_AGE,
        ),
    )
    .await
    {
        Ok(Ok(kv)) => kv,
        // Not readable now: nothing to compare with (the bus's own
        // errors surface where the node uses it).
        _ => return Ok(()),
    };
    let read = || async {
        match tokio::time::timeout(limit, kv.entry(&id.0)).await {
            Ok(Ok(Some(e))) if e.operation == async_nats::jetstream::kv::Operation::Put => Some(e),
            _ => None,
        }
    };
    let Some(first) = read().await else {
        return Ok(());
    };
    let bytes = &first.value;
    let reg = match dynamo_bus_schema::peek_kind(bytes) {
        Ok((k, _))
            if k == <dynamo_bus_schema::NodeInventory as dynamo_bus_schema::WireMessage>::KIND =>
        {
            dynamo_bus_schema::decode::<dynamo_bus_schema::NodeInventory>(bytes)
                .ok()
                .map(|i| i.registration)
        }
        _ => dynamo_bus_schema::decode::<NodeRegistration>(bytes).ok(),
    };
    let Some(reg) = reg else { return Ok(()) };
    let age = unix_ms().saturating_sub(reg.heartbeat_unix_ms);
    let ours_gone = reg.hostname == hostname() && !pid_alive(reg.pid);
    if age > NODE_GONE_MS || ours_gone {
        return Ok(());
    }
    let t0 = tokio::time::Instant::now();
    while t0.elapsed() < NODE_WATCH {
        tokio::time::sleep(Duration::from_millis(250)).await;
        match read().await {
            Some(e) if e.revision != first.revision => anyhow::bail!(
                "node id {:?} is taken: a node on {} (pid {}) holds it and is writing its record; give this node another --node-id (or node_id), or stop that one first",
                id.0,
                reg.hostname,
                reg.pid
            ),
            // Deleted (it stopped) or unchanged so far.
            None => return Ok(()),
            Some(_) => {}
        }
    }
    Ok(())
}

/// Whether process `pid` of this host is running (a zombie, killed and not
/// yet reaped by its parent, is not).
fn pid_alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // `pid (comm) S ...`: the state follows the last ')'.
    let state = stat
        .rfind(')')
        .and_then(|i| stat[i + 1..].trim_start().chars().next());
    !matches!(state, Some('Z' | 'X') | None)
}

pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// A file's bytes in memory of their own, on huge pages where large (see
/// [`dynamo_transfer::HostBuffer`]): on some machines faulting in fresh
/// 4 KiB pages costs more than reading the file.
fn read_to_host(path: &std::path::Path) -> anyhow::Result<bytes::Bytes> {
    use std::io::Read;
    let mut f = std::fs::File::open(path)
        .map_err(|e| anyhow::anyhow!("cannot open {}: {e}", path.display()))?;
    let len = f.metadata()?.len();
    let len = usize::try_from(len)
        .map_err(|_| anyhow::anyhow!("{} is too large ({len} bytes)", path.display()))?;
    let mut buf = dynamo_transfer::HostBuffer::zeroed(len)?;
    f.read_exact(&mut buf[..len])
        .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
    Ok(bytes::Bytes::from_owner(buf).slice(..len))
}

/// Loads what a worker group's engines share: the model card and
/// tokenizer, and for the CPU engine the weights.
///
/// Without the file here, it comes from the cluster ([`crate::weights`]),
/// waiting up to `source_wait` for a source to offer it; a file here is
/// served to peers.
pub async fn load_group_model(
    group: &crate::config::WorkerGroup,
    weights: &Arc<crate::weights::NodeWeights>,
    source_wait: std::time::Duration,
) -> anyhow::Result<GroupModel> {
    let local = match &group.model_path {
        Some(p) if p.is_file() => Ok(p.clone()),
        Some(p) => Err(format!("{} is not a file", p.display())),
        None => locate_default_gguf().map_err(|e| e.to_string()),
    };
    let cpu = matches!(group.engine, EngineSpec::Cpu { .. });
    let file = weights
        .model_file(&group.model, local, group.model_sha256, source_wait, cpu)
        .await?;
    let (name, bs) = (group.model.clone(), group.engine.block_size());
    let started = std::time::Instant::now();
    // The card (and the CPU engine's weights) from the file, from the bytes
    // of a local file read once into served memory, or from the bytes of
    // a load from the cluster, which is kept on disk meanwhile.
    let (mut m, cpu_weights) = match file {
        crate::weights::ModelFile::Local(p) => {
            tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
                let m = LoadedModel::from_gguf(&p, &name, bs)?;
                let w = if cpu {
                    Some(Weights::from_gguf_bytes(
                        read_to_host(&p)?,
                        &p.display().to_string(),
                    )?)
                } else {
                    None
                };
                Ok((m, w))
            })
            .await??
        }
        crate::weights::ModelFile::Shared { path, bytes } => {
            tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
                let m = LoadedModel::from_gguf_bytes(&bytes, &path, &name, bs)?;
                let w = if cpu {
                    Some(Weights::from_gguf_bytes(
                        bytes,
                        &path.display().to_string(),
                    )?)
                } else {
                    None
                };
                Ok((m, w))
            })
            .await??
        }
        crate::weights::ModelFile::Fetched(f) => {
            let (m, w, f) = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
                let m = LoadedModel::from_gguf_bytes(f.bytes(), &f.path, &name, bs)?;
                let w = if cpu {
                    Some(Weights::from_gguf_bytes(
                        f.bytes().clone(),
                        &f.path.display().to_string(),
                    )?)
                } else {
                    None
                };
                Ok((m, w, f))
            })
            .await??;
            let written = weights.keep(f);
            // An engine server reads the file itself.
            if matches!(group.engine, EngineSpec::External { .. }) {
                written.wait().await.map_err(|e| {
                    anyhow::anyhow!("model file {} not written: {e}", m.path.display())
                })?;
            }
            (m, w)
        }
    };
    if let Some(ctx) = group.context_length {
        m.card.context_length = ctx;
    }
    let weights = match &group.engine {
        EngineSpec::Mocker(mocker) => {
            mocker
                .validate(m.card.vocab_size)
                .map_err(|e| anyhow::anyhow!("mocker config: {e}"))?;
            None
        }
        // The engine server loads its own weights.
        EngineSpec::External { .. } => None,
        EngineSpec::Cpu { .. } => {
            let w = cpu_weights.ok_or_else(|| anyhow::anyhow!("cpu engine weights not loaded"))?;
            tracing::info!(
                bytes = w.bytes(),
                ms = started.elapsed().as_millis() as u64,
                "cpu engine weights loaded"
            );
            let model = dynamo_cpu_engine::Model::new(w);
            if model.w.cfg.vocab as u32 != m.card.vocab_size {
                anyhow::bail!(
                    "{}: embedding has {} rows but the tokenizer {} tokens",
                    m.path.display(),
                    model.w.cfg.vocab,
                    m.card.vocab_size
                );
            }
            Some(Arc::new(model))
        }
    };
    tracing::info!(model = %m.card.name, file = %m.path.display(), "model card loaded");
    Ok(GroupModel { loaded: m, weights })
}

#[cfg(test)]
mod tests {
    use super::pid_alive;
    use std::time::{Duration, Instant};

    #[test]
    fn a_process_that_exited_is_not_alive_even_before_it_is_reaped() {
        assert!(pid_alive(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().expect("spawn");
        let pid = child.id();
        // Exited and not reaped yet (a zombie) reads as gone.
        let t0 = Instant::now();
        while pid_alive(pid) {
            assert!(t0.elapsed() < Duration::from_secs(10), "still alive");
            std::thread::sleep(Duration::from_millis(10));
        }
        child.wait().expect("reap");
        assert!(!pid_alive(pid));
    }
}
