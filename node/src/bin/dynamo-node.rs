//! The node daemon.
//!
//! - `dynamo-node --config cluster-config/examples/single-node.toml`: the
//!   actors the TOML names;
//! - `dynamo-node --join nats://… --labels zone=z1,rack=r1,host=h1 --slots 4
//!   [--roles controller]`: a node of a cluster, running what the placement
//!   controller assigns it.

/// mimalloc rather than glibc's malloc: the serving path allocates and
/// frees many small buffers per request (frames, TLS records, JSON), and
/// glibc's malloc took 18–20% of the node's CPU in profiles of the
/// security bench (BENCHMARKS.md, "Serving path").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::Parser;
use dynamo_node::config::{parse_labels, JoinConfig, NodeConfig};
use dynamo_node::{daemon, env};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "dynamo-node",
    version,
    about = "Runs a node's actors (gateway, router, workers) from a TOML config, or joins a cluster and runs what its controller assigns"
)]
struct Args {
    /// The node's TOML config.
    #[arg(long, short, conflicts_with = "join", required_unless_present = "join")]
    config: Option<PathBuf>,
    /// Join a cluster over this NATS URL (`env`: $DYNAMO_NATS_URL) with no
    /// actors of its own.
    #[arg(long)]
    join: Option<String>,
    /// This node's name (default: the config's `node_id`, or the hostname).
    #[arg(long)]
    node_id: Option<String>,
    /// Bus namespace (with --join).
    #[arg(long, env = env::NAMESPACE, default_value = "default")]
    namespace: String,
    /// Topology and other labels, e.g. `zone=z1,rack=r1,host=h1` (with --join).
    #[arg(long, default_value = "")]
    labels: String,
    /// Accelerator slots (GPUs) replicas may take here (with --join).
    #[arg(long, default_value_t = 0)]
    slots: u32,
    /// Memory replicas may take here, MiB (with --join; default 1 TiB).
    #[arg(long, default_value_t = 1 << 20)]
    memory_mib: u64,
    /// Roles besides running assigned replicas (with --join): `controller`
    /// (the placement controller, and the deployments' planners) and
    /// `planner` (the planners only).
    #[arg(long, value_delimiter = ',')]
    roles: Vec<String>,
    /// The planners scale Grove objects in this Kubernetes namespace
    /// instead of the desired state (with --roles planner or controller;
    /// needs a build with the `k8s-client` feature).
    #[arg(long)]
    planner_k8s_namespace: Option<String>,
    /// Address a frontend placed on this node listens on (with --join;
    /// default: the spec's `gateway.listen`).
    #[arg(long)]
    http_listen: Option<std::net::SocketAddr>,
    /// PEM file of the CA that signed the NATS servers' certificates: TLS
    /// is then required (with --config, it overrides `[nats] ca_file`).
    #[arg(long, env = env::NATS_CA)]
    nats_ca: Option<PathBuf>,
    /// Directory of NATS role seeds (`<role>.nk`, from `dynamoctl
    /// nats-auth`): each actor connects as its role (with --config, it
    /// overrides `[nats] credentials`).
    #[arg(long, env = env::NATS_CREDENTIALS)]
    nats_credentials: Option<PathBuf>,
    /// Serve this node's Prometheus metrics on `host:port` (`GET /metrics`);
    /// overrides the config's `[metrics]`. An address other hosts can
    /// reach needs --metrics-token-file or --metrics-allow-unauthenticated.
    #[arg(long)]
    metrics_listen: Option<std::net::SocketAddr>,
    /// File holding the bearer token scrapers must send (with
    /// --metrics-listen).
    #[arg(long, requires = "metrics_listen")]
    metrics_token_file: Option<PathBuf>,
    /// Serve metrics without a token on an address other hosts can reach
    /// (with --metrics-listen).
    #[arg(long, requires = "metrics_listen")]
    metrics_allow_unauthenticated: bool,
}

/// Raises the soft limit on open files towards the hard one, as servers do
/// (every connection is one), to at most 2^20 (children inherit it, and
/// some close every descriptor up to it); returns the limit in force.
fn raise_open_files_limit() -> u64 {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit only writes the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return u64::MAX;
    }
    let want = r.rlim_max.min(1 << 20);
    if r.rlim_cur < want {
        let raised = libc::rlimit {
            rlim_cur: want,
            rlim_max: r.rlim_max,
        };
        // SAFETY: setrlimit only reads the struct; up to the hard limit
        // needs no privilege.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            return raised.rlim_cur;
        }
    }
    r.rlim_cur
}

fn fail(e: impl std::fmt::Display) -> ! {
    eprintln!("dynamo-node: {e}");
    std::process::exit(2);
}

fn main() {
    dynamo_transfer::reset_inherited_signal_handlers();
    let matches = <Args as clap::CommandFactory>::command().get_matches();
    let args =
        <Args as clap::FromArgMatches>::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    // Given as a flag (not only by the environment, which a config's own
    // keys outrank).
    let flag = |id: &str| matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine);
    let filter = tracing_subscriber::EnvFilter::try_from_env(env::LOG)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,async_nats=warn"));
    // Colours only on a terminal: a log file or journal gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .init();
    let cfg = match (&args.config, &args.join) {
        (Some(path), _) => {
            // --nats-ca and --nats-credentials outrank the config's keys,
            // and are checked in their place (before the config's files,
            // which may not exist here).
            let ca = args.nats_ca.clone().filter(|_| flag("nats_ca"));
            let creds = args
                .nats_credentials
                .clone()
                .filter(|_| flag("nats_credentials"));
            let mut c = NodeConfig::load_with(path, |raw| {
                if let Some(p) = &ca {
                    raw.nats.ca_file = Some(p.display().to_string());
                }
                if let Some(p) = &creds {
                    raw.nats.credentials = Some(p.display().to_string());
                }
            })
            .map_err(|e| match e {
                dynamo_node::config::ConfigError::Invalid { key, message }
                    if key == "nats.ca_file" && ca.is_some() =>
                {
                    format!("--nats-ca: {message}")
                }
                dynamo_node::config::ConfigError::Invalid { key, message }
                    if key == "nats.credentials" && creds.is_some() =>
                {
                    format!("--nats-credentials: {message}")
                }
                e => e.to_string(),
            })
            .unwrap_or_else(|e| fail(e));
            if let Some(id) = &args.node_id {
                if id.is_empty() || id.len() > 64 {
                    fail("--node-id must be 1-64 characters");
                }
                c.node_id = dynamo_bus_schema::NodeId(id.clone());
            }
            c
        }
        (None, Some(url)) => {
            let labels = parse_labels(&args.labels).unwrap_or_else(|e| fail(e));
            for r in &args.roles {
                if r != "controller" && r != "planner" {
                    fail(format!(
                        "--roles: unknown role {r:?} (available: controller, planner)"
                    ));
                }
            }
            let node_id = args
                .node_id
                .clone()
                .unwrap_or_else(dynamo_node::daemon::hostname);
            let join = JoinConfig {
                labels,
                slots: args.slots,
                memory_mib: args.memory_mib,
                http_listen: args.http_listen,
            };
            let access = dynamo_node::config::NatsAccess {
                ca_file: args.nats_ca.clone(),
                credentials: args.nats_credentials.clone(),
            };
            let mut c = NodeConfig::joined(
                &node_id,
                &args.namespace,
                url,
                access,
                join,
                args.roles.iter().any(|r| r == "controller"),
                args.roles.iter().any(|r| r == "planner"),
            )
            .unwrap_or_else(|e| fail(e));
            if let Some(ns) = &args.planner_k8s_namespace {
                match c.planner.as_mut() {
                    Some(p) => p.kubernetes_namespace = Some(ns.clone()),
                    None => fail("--planner-k8s-namespace needs --roles planner (or controller)"),
                }
            }
            c
        }
        (None, None) => fail("give --config FILE or --join NATS_URL"),
    };
    let mut cfg = cfg;
    let files = raise_open_files_limit();
    if let Some(g) = &cfg.gateway {
        if (g.max_connections as u64).saturating_add(256) > files {
            tracing::warn!(
                open_files = files,
                max_connections = g.max_connections,
                "the open-files limit is below gateway.max_connections (+256 for the rest): raise it (ulimit -n) or lower max_connections"
            );
        }
    }
    if let Some(addr) = args.metrics_listen {
        let listen = dynamo_node::config::MetricsListen::new(
            addr,
            args.metrics_token_file.as_deref(),
            args.metrics_allow_unauthenticated,
            (
                "--metrics-listen",
                "--metrics-token-file",
                "--metrics-allow-unauthenticated",
            ),
        )
        .unwrap_or_else(|e| fail(e));
        cfg.metrics_listen = Some(listen);
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("dynamo-node: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    let res = rt.block_on(daemon::run(cfg));
    // A weight load still running on a blocking thread (the node was
    // stopped while loading) does not hold the exit.
    rt.shutdown_timeout(std::time::Duration::from_secs(1));
    if let Err(e) = res {
        eprintln!("dynamo-node: {e:#}");
        std::process::exit(1);
    }
}
