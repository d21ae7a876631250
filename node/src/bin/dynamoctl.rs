//! The admin CLI: `dynamoctl status`, `drain`, `bench`, `replay`, and the
//! cluster layer's `apply`, `get`, `describe`, `scale`, `delete`, `render`.

/// mimalloc, as in `dynamo-node`: `bench` and `replay` are load generators
/// that allocate per request, and their CPU shares the machine with the
/// server they measure (BENCHMARKS.md, "Serving path").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::{Parser, Subcommand};
use dynamo_bus_schema::Namespace;
use dynamo_node::{
    bench, calibrate, cluster, configure, drain, env, models_cli, planner_cli, replay, status,
};

#[derive(Parser)]
#[command(
    name = "dynamoctl",
    version,
    about = "Inspect and exercise a dynamo cluster"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

/// Where the cluster is (NATS URL and bus namespace).
#[derive(clap::Args)]
struct Bus {
    /// NATS URL (default: $DYNAMO_NATS_URL, or the local embedded server).
    #[arg(long)]
    nats: Option<String>,
    #[arg(long, env = env::NAMESPACE, default_value = "default")]
    namespace: String,
}

impl Bus {
    fn resolve(&self) -> anyhow::Result<(String, Namespace)> {
        let ns = Namespace::new(&self.namespace)?;
        let url = status::resolve_nats_url(self.nats.clone(), &ns)?;
        Ok((url, ns))
    }
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Kind {
    Deployment,
    Deployments,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum RenderTarget {
    K8s,
}

#[derive(Subcommand)]
enum PlannerCmd {
    /// Each target's desired, ready and recommended replicas with the
    /// reason and numbers, the recent decisions, and the pins.
    Status {
        deployment: Option<String>,
        #[command(flatten)]
        bus: Bus,
        #[arg(long)]
        json: bool,
    },
    /// Unpins a service a manual `scale` pinned.
    Release {
        target: String,
        #[command(flatten)]
        bus: Bus,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum ModelsCmd {
    /// The weight files the cluster knows: content hash, size, whether the
    /// cache holds them, and the nodes serving them.
    Ls {
        #[command(flatten)]
        bus: Bus,
        #[arg(long)]
        json: bool,
    },
    /// Follow weight loads as they go: a progress bar per loading node on
    /// a terminal, a line per start and end otherwise, or with `--json` one
    /// object per change. Runs until interrupted, or with `--until-idle`
    /// until no load is in progress.
    Watch {
        /// Only this node's loads.
        #[arg(long)]
        node: Option<String>,
        #[arg(long)]
        until_idle: bool,
        /// How often to read the weights bucket, in milliseconds.
        #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u64).range(100..=60_000))]
        every_ms: u64,
        #[command(flatten)]
        bus: Bus,
        #[arg(long)]
        json: bool,
    },
    /// Put a model file in the in-cluster cache (a JetStream object store),
    /// for nodes without it.
    Push {
        file: std::path::PathBuf,
        /// The model's served name.
        #[arg(long, default_value = "smollm2-135m-instruct")]
        model: String,
        #[command(flatten)]
        bus: Bus,
        #[arg(long)]
        json: bool,
    },
    /// Take a model file out of the in-cluster cache (needs --yes). Nodes
    /// serving it keep serving it.
    Rm {
        /// The model's name, or its content hash (8 hex digits or more).
        what: String,
        #[arg(long)]
        yes: bool,
        #[command(flatten)]
        bus: Bus,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum KeysCmd {
    /// Makes a new API key: prints the key once (give it to its user) and
    /// the `[[keys]]` entry for the gateway's `api_keys_file`, which holds
    /// only its SHA-256.
    New {
        /// Who the key is for (the metrics label).
        #[arg(long)]
        name: String,
        /// Models the key may use (repeat; default all).
        #[arg(long = "model")]
        models: Vec<String>,
        #[arg(long)]
        requests_per_minute: Option<u32>,
        #[arg(long)]
        tokens_per_minute: Option<u64>,
    },
}

#[derive(Subcommand)]
enum Cmd {
    /// JetStream streams: `streams ls`, `streams info NAME`, `streams purge NAME --yes`.
    Streams {
        #[command(subcommand)]
        cmd: dynamo_node::js_cli::StreamsCmd,
    },
    /// KV buckets and object stores: `buckets ls`, `buckets get BUCKET [KEY]`
    /// (decoded), `buckets watch BUCKET`.
    Buckets {
        #[command(subcommand)]
        cmd: dynamo_node::js_cli::BucketsCmd,
    },
    /// JetStream consumers: `consumers ls`.
    Consumers {
        #[command(subcommand)]
        cmd: dynamo_node::js_cli::ConsumersCmd,
    },
    /// KV events: `events tail [--worker W] [--last N]`, decoded.
    Events {
        #[command(subcommand)]
        cmd: dynamo_node::js_cli::EventsCmd,
    },
    /// The KV index: `index query --text …|--tokens …` shows what each
    /// worker holds of a prompt.
    Index {
        #[command(subcommand)]
        cmd: dynamo_node::index_cli::IndexCmd,
    },
    /// NATS users for servers you run: an account per namespace, one nkey
    /// user per role, each allowed only its own subjects. Writes `auth.conf`
    /// (include it in every server's config), `<namespace>/<role>.nk` seeds
    /// for nodes, `<namespace>.admin/admin.nk` for operators, and with
    /// `--tls-names` a CA and server certificate (`tls/`).
    NatsAuth {
        /// Directory to write into (must not hold an auth.conf).
        #[arg(long)]
        out: std::path::PathBuf,
        /// Namespaces to make users for (repeat).
        #[arg(long = "namespace", required = true)]
        namespaces: Vec<String>,
        /// Also make TLS files for these server names or addresses
        /// (comma-separated).
        #[arg(long, value_delimiter = ',')]
        tls_names: Vec<String>,
    },
    /// Gateway API keys: `keys new --name NAME`.
    Keys {
        #[command(subcommand)]
        cmd: KeysCmd,
    },
    /// Store a deployment spec (YAML) as the cluster's desired state; the
    /// placement controller places it on the joined nodes.
    Apply {
        #[arg(short = 'f', long = "file")]
        file: std::path::PathBuf,
        /// Wait (up to this many seconds) until every replica is ready.
        #[arg(long)]
        wait_secs: Option<u64>,
        /// Only check the spec (and every service's settings); store nothing.
        #[arg(long)]
        dry_run: bool,
        #[command(flatten)]
        bus: Bus,
        #[arg(long)]
        json: bool,
    },
    /// List deployments (`get deployments`).
    Get {
        #[arg(value_enum)]
        kind: Kind,
        #[command(flatten)]
        bus: Bus,
        #[arg(long)]
        json: bool,
    },
    /// Desired, placed and ready replicas per service, why anything is
    /// pending, and recent events (`describe deployment NAME`).
    Describe {
        #[arg(value_enum)]
        kind: Kind,
        name: String,
        #[command(flatten)]
        bus: Bus,
        #[arg(long)]
        json: bool,
    },
    /// The planners: `planner status [DEPLOYMENT]` (the last decisions and
    /// the numbers behind each), `planner release DEPLOYMENT/SERVICE`
    /// (hand a manually scaled service back to its planner).
    Planner {
        #[command(subcommand)]
        cmd: PlannerCmd,
    },
    /// Model weights: `models ls`, `models push FILE`.
    Models {
        #[command(subcommand)]
        cmd: ModelsCmd,
    },
    /// Set the replicas of a service or scaling group:
    /// `scale DEPLOYMENT/SERVICE N`. Only that service's replicas change;
    /// removed ones drain first. It pins the service: the planner leaves
    /// it alone until `planner release`.
    Scale {
        target: String,
        replicas: u32,
        #[command(flatten)]
        bus: Bus,
        #[arg(long)]
        json: bool,
    },
    /// Write the Kubernetes manifests of a spec (`render k8s -f SPEC`):
    /// a Grove PodCliqueSet (one clique per service, a scaling group per
    /// group, topology, start-up order and minAvailable from the spec), and
    /// the ConfigMaps and Services its pods need.
    Render {
        #[arg(value_enum)]
        target: RenderTarget,
        #[arg(short = 'f', long = "file")]
        file: std::path::PathBuf,
        /// Container image with dynamo-node (see the Dockerfile).
        #[arg(long, default_value = "dynamo:latest")]
        image: String,
        /// Kubernetes namespace of the objects.
        #[arg(long, default_value = "default")]
        k8s_namespace: String,
        /// NATS the pods join (default: the official Helm chart's Service).
        #[arg(long, default_value = "nats://nats:4222")]
        nats_url: String,
        /// Bus namespace the pods join.
        #[arg(long, env = env::NAMESPACE, default_value = "default")]
        namespace: String,
        /// Grove ClusterTopology named by topology constraints.
        #[arg(long, default_value = "grove-topology")]
        topology_name: String,
        /// schedulerName of every pod (default: Grove's).
        #[arg(long)]
        scheduler_name: Option<String>,
        /// Write here instead of standard output.
        #[arg(short = 'o', long)]
        output: Option<std::path::PathBuf>,
    },
    /// Remove a deployment (`delete deployment NAME`); its replicas drain and stop.
    Delete {
        #[arg(value_enum)]
        kind: Kind,
        name: String,
        #[command(flatten)]
        bus: Bus,
        #[arg(long)]
        json: bool,
    },
    /// Nodes, workers, models and load.
    Status {
        /// NATS URL (default: $DYNAMO_NATS_URL, or the local embedded server).
        #[arg(long)]
        nats: Option<String>,
        #[arg(long, env = env::NAMESPACE, default_value = "default")]
        namespace: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Stop new work for a worker and wait for its in-flight requests to
    /// finish (graceful scale-down); `--resume` takes it back into service.
    Drain {
        /// Worker id, or an unambiguous prefix (see `dynamoctl status`).
        worker: String,
        /// Take requests again instead.
        #[arg(long)]
        resume: bool,
        /// Seconds to wait for in-flight requests (0 = do not wait).
        #[arg(long, default_value_t = 600)]
        wait_secs: u64,
        /// NATS URL (default: $DYNAMO_NATS_URL, or the local embedded server).
        #[arg(long)]
        nats: Option<String>,
        #[arg(long, env = env::NAMESPACE, default_value = "default")]
        namespace: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Load-test an OpenAI-compatible endpoint.
    Bench {
        #[arg(long, default_value = "http://127.0.0.1:8000")]
        url: String,
        #[arg(long, default_value = "smollm2-135m-instruct")]
        model: String,
        #[arg(long, default_value_t = 8)]
        concurrency: usize,
        #[arg(long, default_value_t = 100)]
        requests: usize,
        #[arg(long, default_value_t = 16)]
        max_tokens: u32,
        /// Vary each request's max_tokens around --max-tokens (¼× to 1¾×),
        /// generating all of them (ignore_eos).
        #[arg(long)]
        vary_output: bool,
        /// Approximate prompt length in tokens (user content).
        #[arg(long, default_value_t = 60)]
        prompt_tokens: usize,
        #[arg(long)]
        stream: bool,
        /// `chat` or `completions`.
        #[arg(long, default_value = "chat")]
        endpoint: String,
        /// Keep sending for this many seconds instead of `--requests`.
        #[arg(long)]
        duration_s: Option<f64>,
        /// Milliseconds a refused client waits when the answer has no Retry-After.
        #[arg(long, default_value_t = 1000)]
        retry_wait_ms: u64,
        /// Seconds over which the clients start (0: all at once).
        #[arg(long, default_value_t = 0.0)]
        ramp_s: f64,
        /// API key for a gateway with keys (sent as a Bearer token).
        #[arg(long, env = "DYNAMO_API_KEY")]
        api_key: Option<String>,
        /// CA (PEM) an `https://` gateway's certificate is checked against.
        #[arg(long)]
        ca_file: Option<std::path::PathBuf>,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Pick a deployment for an SLA without GPUs: TP/PP, aggregated or
    /// disaggregated, replica counts and batch (prints the Pareto frontier
    /// and the best deployment per GPU budget).
    Configure(configure::ConfigureSpec),
    /// Fit the mocker's step-time polynomials to a running engine's
    /// measured timing (e.g. the CPU engine), so a mocker can stand in for it.
    CalibrateMocker(calibrate::CalibrateSpec),
    /// Replay a Mooncake-format JSONL trace against an OpenAI /v1/completions endpoint.
    Replay {
        #[arg(long)]
        trace: std::path::PathBuf,
        #[arg(long, default_value = "http://127.0.0.1:8000")]
        url: String,
        #[arg(long, default_value = "smollm2-135m-instruct")]
        model: String,
        /// Time compression: the trace's clock runs this many times faster.
        #[arg(long, default_value_t = 1.0)]
        speedup: f64,
        #[arg(long)]
        max_requests: Option<usize>,
        /// Cap each request's output tokens.
        #[arg(long)]
        max_output: Option<u32>,
        /// Token ids are drawn from [256, vocab).
        #[arg(long, default_value_t = 49152)]
        vocab: u32,
        /// Divide every length by K: a 512-token trace block becomes 512/K
        /// tokens (K divides 512).
        #[arg(long, default_value_t = 1)]
        token_scale: u32,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
}

/// Prints a load report; fails (non-zero exit) when no request succeeded.
/// Prints `v` as JSON with `--json`, otherwise the sentence `human` makes.
fn print_or(
    v: &serde_json::Value,
    json: bool,
    human: impl FnOnce() -> String,
) -> anyhow::Result<()> {
    if json {
        println!("{v}");
    } else {
        println!("{}", human());
    }
    Ok(())
}

/// A string field of a command's JSON answer ("?" if it has none).
fn str_of<'a>(v: &'a serde_json::Value, key: &str) -> &'a str {
    v[key].as_str().unwrap_or("?")
}

/// Prints a load's report, then fails (a non-zero exit) when any request
/// failed, so a script or CI job sees it: every request, or `errors` of
/// `requests` (requests refused under load, 429 or 503, are counted apart
/// and are not failures).
fn report<R: serde::Serialize>(
    r: &R,
    json: bool,
    human: fn(&R) -> String,
    counts: (usize, usize, usize),
    first_error: Option<&str>,
) -> anyhow::Result<()> {
    let (requests, ok, errors) = counts;
    if json {
        println!("{}", serde_json::to_string(r)?);
    } else {
        print!("{}", human(r));
    }
    dynamo_node::bench::outcome(requests, ok, errors, first_error)
}

fn main() {
    dynamo_transfer::reset_inherited_signal_handlers();
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("dynamoctl: {e}");
            std::process::exit(1);
        }
    };
    let res: anyhow::Result<()> = rt.block_on(async {
        let limit = std::time::Duration::from_secs(15);
        let timed = |url: String| {
            move |_| {
                anyhow::anyhow!(
                    "timed out talking to NATS at {}",
                    dynamo_runtime::bus::redact_url(&url)
                )
            }
        };
        match cli.cmd {
            Cmd::Streams { cmd } => dynamo_node::js_cli::run_streams(cmd).await,
            Cmd::Buckets { cmd } => dynamo_node::js_cli::run_buckets(cmd).await,
            Cmd::Consumers { cmd } => dynamo_node::js_cli::run_consumers(cmd).await,
            Cmd::Events { cmd } => dynamo_node::js_cli::run_events(cmd).await,
            Cmd::Index { cmd } => dynamo_node::index_cli::run(cmd).await,
            Cmd::NatsAuth {
                out,
                namespaces,
                tls_names,
            } => {
                let written = dynamo_node::nats_auth_cli::write(&out, &namespaces, &tls_names)?;
                println!("{written}");
                eprintln!(
                    "servers: `include auth.conf` in their config; nodes: [nats] credentials = \"<dir>/<namespace>\" (or --nats-credentials); dynamoctl: ${}=<dir>/<namespace>.admin",
                    dynamo_node::env::NATS_CREDENTIALS
                );
                Ok(())
            }
            Cmd::Keys {
                cmd:
                    KeysCmd::New {
                        name,
                        models,
                        requests_per_minute,
                        tokens_per_minute,
                    },
            } => {
                let (key, entry) = dynamo_node::keys_cli::new_key(
                    &name,
                    &models,
                    requests_per_minute,
                    tokens_per_minute,
                )?;
                eprintln!("API key for {name} (shown once; the file keeps only its hash):");
                println!("{key}");
                eprintln!("add to the gateway's api_keys_file:");
                println!("{entry}");
                Ok(())
            }
            Cmd::Apply {
                file,
                wait_secs,
                dry_run,
                bus,
                json,
            } => {
                // The spec is checked before anything is contacted.
                let spec = cluster::load_spec(&file)?;
                if dry_run {
                    let replicas = spec.replicas().len();
                    let v = serde_json::json!({
                        "deployment": spec.name, "valid": true,
                        "services": spec.services.len(), "groups": spec.groups.len(),
                        "replicas": replicas,
                    });
                    return print_or(&v, json, || {
                        format!(
                            "deployment {} is valid: {} services, {replicas} replicas",
                            spec.name,
                            spec.services.len()
                        )
                    });
                }
                let (url, ns) = bus.resolve()?;
                let v = tokio::time::timeout(limit, cluster::apply(&url, ns.clone(), &file))
                    .await
                    .map_err(timed(url.clone()))??;
                if json {
                    println!("{v}");
                } else {
                    println!(
                        "deployment {} {} (generation {})",
                        spec.name,
                        if v["changed"].as_bool() == Some(true) {
                            "applied"
                        } else {
                            "unchanged"
                        },
                        v["generation"]
                    );
                }
                if let Some(w) = wait_secs {
                    let d = cluster::wait_ready(
                        &url,
                        ns,
                        &spec.name,
                        std::time::Duration::from_secs(w),
                    )
                    .await?;
                    if !json {
                        print!("{}", cluster::render_describe(&d));
                    }
                }
                Ok(())
            }
            Cmd::Get { kind: _, bus, json } => {
                let (url, ns) = bus.resolve()?;
                let v = tokio::time::timeout(limit, cluster::get(&url, ns))
                    .await
                    .map_err(timed(url.clone()))??;
                if json {
                    println!("{}", serde_json::to_string_pretty(&v)?);
                } else {
                    print!("{}", cluster::render_list(&v));
                }
                Ok(())
            }
            Cmd::Describe {
                kind: _,
                name,
                bus,
                json,
            } => {
                let (url, ns) = bus.resolve()?;
                let v = tokio::time::timeout(limit, cluster::describe(&url, ns, &name))
                    .await
                    .map_err(timed(url.clone()))??;
                if json {
                    println!("{}", serde_json::to_string_pretty(&v)?);
                } else {
                    print!("{}", cluster::render_describe(&v));
                }
                Ok(())
            }
            Cmd::Planner {
                cmd:
                    PlannerCmd::Status {
                        deployment,
                        bus,
                        json,
                    },
            } => {
                let (url, ns) = bus.resolve()?;
                let v = tokio::time::timeout(
                    limit,
                    planner_cli::status(&url, ns, deployment.as_deref()),
                )
                .await
                .map_err(timed(url.clone()))??;
                if json {
                    println!("{}", serde_json::to_string_pretty(&v)?);
                } else {
                    print!("{}", planner_cli::render(&v));
                }
                Ok(())
            }
            Cmd::Models {
                cmd: ModelsCmd::Ls { bus, json },
            } => {
                let (url, ns) = bus.resolve()?;
                let v = tokio::time::timeout(limit, models_cli::ls(&url, ns))
                    .await
                    .map_err(timed(url.clone()))??;
                if json {
                    println!("{}", serde_json::to_string_pretty(&v)?);
                } else {
                    print!("{}", models_cli::render(&v));
                }
                Ok(())
            }
            Cmd::Models {
                cmd:
                    ModelsCmd::Watch {
                        node,
                        until_idle,
                        every_ms,
                        bus,
                        json,
                    },
            } => {
                let (url, ns) = bus.resolve()?;
                // No time limit: it follows loads until they end.
                let args = models_cli::WatchArgs {
                    node,
                    until_idle,
                    json,
                    every: std::time::Duration::from_millis(every_ms),
                };
                models_cli::watch(&url, ns, args).await
            }
            Cmd::Models {
                cmd:
                    ModelsCmd::Push {
                        file,
                        model,
                        bus,
                        json,
                    },
            } => {
                let (url, ns) = bus.resolve()?;
                // No time limit: a large file takes what it takes.
                let v = models_cli::push(&url, ns, &file, &model).await?;
                if json {
                    println!("{}", serde_json::to_string_pretty(&v)?);
                } else {
                    println!(
                        "pushed {} ({} bytes, sha256 {}) in {:.1} s",
                        v["model"].as_str().unwrap_or("?"),
                        v["size"],
                        v["sha256"].as_str().unwrap_or("?"),
                        v["seconds"].as_f64().unwrap_or(0.0)
                    );
                }
                Ok(())
            }
            Cmd::Models {
                cmd:
                    ModelsCmd::Rm {
                        what,
                        yes,
                        bus,
                        json,
                    },
            } => {
                let (url, ns) = bus.resolve()?;
                let v = tokio::time::timeout(limit, models_cli::rm(&url, ns, &what, yes))
                    .await
                    .map_err(timed(url.clone()))??;
                if json {
                    println!("{}", serde_json::to_string_pretty(&v)?);
                } else {
                    let kept = match v["served_by"].as_array() {
                        Some(n) if !n.is_empty() => format!(
                            "; still served by {}",
                            n.iter().filter_map(|x| x.as_str()).collect::<Vec<_>>().join(", ")
                        ),
                        _ => String::new(),
                    };
                    println!(
                        "removed {} ({}) from the cache: {} chunks{kept}",
                        v["model"].as_str().unwrap_or("?"),
                        v["sha256"].as_str().and_then(|h| h.get(..12)).unwrap_or("?"),
                        v["chunks_deleted"]
                    );
                }
                Ok(())
            }
            Cmd::Planner {
                cmd: PlannerCmd::Release { target, bus, json },
            } => {
                let (url, ns) = bus.resolve()?;
                let v = tokio::time::timeout(limit, planner_cli::release(&url, ns, &target))
                    .await
                    .map_err(timed(url.clone()))??;
                print_or(&v, json, || {
                    let then = if v["planner"].as_bool() == Some(true) {
                        "the planner sizes it again"
                    } else {
                        "no planner sizes it, so it stays as it is"
                    };
                    format!(
                        "{}/{} released: {then}",
                        str_of(&v, "deployment"),
                        str_of(&v, "target")
                    )
                })
            }
            Cmd::Scale {
                target,
                replicas,
                bus,
                json,
            } => {
                let (url, ns) = bus.resolve()?;
                let v = tokio::time::timeout(limit, cluster::scale(&url, ns, &target, replicas))
                    .await
                    .map_err(timed(url.clone()))??;
                match v["status_age_ms"].as_u64() {
                    Some(a) if a <= cluster::STALE_STATUS_MS => {}
                    age => eprintln!(
                        "dynamoctl: warning: {}: nothing acts on this until a controller runs",
                        match age {
                            Some(a) => format!("no controller has reported for {} s", a / 1000),
                            None => "no controller has reported on this deployment yet".to_string(),
                        }
                    ),
                }
                print_or(&v, json, || {
                    let (d, t) = (str_of(&v, "deployment"), str_of(&v, "target"));
                    let what = if v["changed"].as_bool() == Some(true) {
                        format!("scaled to {replicas} (generation {})", v["generation"])
                    } else {
                        format!("already at {replicas}")
                    };
                    if v["planner"].as_bool() == Some(true) {
                        format!(
                            "{d}/{t} {what}; pinned: the planner leaves it until `dynamoctl planner release {d}/{t}`"
                        )
                    } else {
                        format!("{d}/{t} {what}")
                    }
                })
            }
            Cmd::Render {
                target: RenderTarget::K8s,
                file,
                image,
                k8s_namespace,
                nats_url,
                namespace,
                topology_name,
                scheduler_name,
                output,
            } => {
                use dynamo_cluster_config::render;
                let spec = cluster::load_spec(&file)?;
                let opts = render::RenderOptions {
                    image,
                    namespace: k8s_namespace,
                    nats_url,
                    dynamo_namespace: namespace,
                    topology_name,
                    scheduler_name,
                };
                let objs = render::render_k8s(&spec, &opts)?;
                let text = render::to_yaml_documents(&objs)?;
                match output {
                    Some(p) => std::fs::write(&p, text)
                        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", p.display()))?,
                    None => print!("{text}"),
                }
                Ok(())
            }
            Cmd::Delete {
                kind: _,
                name,
                bus,
                json,
            } => {
                let (url, ns) = bus.resolve()?;
                let v = tokio::time::timeout(limit, cluster::delete(&url, ns, &name))
                    .await
                    .map_err(timed(url.clone()))??;
                print_or(&v, json, || {
                    format!("deployment {name} deleted: its replicas drain and stop")
                })
            }
            Cmd::Status {
                nats,
                namespace,
                json,
            } => {
                let ns = Namespace::new(&namespace)?;
                let url = status::resolve_nats_url(nats, &ns)?;
                let v = tokio::time::timeout(
                    std::time::Duration::from_secs(15),
                    status::collect(&url, ns),
                )
                .await
                .map_err(|_| {
                    anyhow::anyhow!(
                        "timed out talking to NATS at {}",
                        dynamo_runtime::bus::redact_url(&url)
                    )
                })??;
                if json {
                    println!("{}", serde_json::to_string_pretty(&v)?);
                } else {
                    print!("{}", status::render(&v));
                }
                Ok(())
            }
            Cmd::Drain {
                worker,
                resume,
                wait_secs,
                nats,
                namespace,
                json,
            } => {
                let ns = Namespace::new(&namespace)?;
                let url = status::resolve_nats_url(nats, &ns)?;
                let spec = drain::DrainSpec {
                    worker,
                    resume,
                    wait: std::time::Duration::from_secs(wait_secs),
                };
                let v = drain::run(&url, ns, spec).await?;
                print_or(&v, json, || {
                    let id = str_of(&v, "worker_id");
                    if resume {
                        format!("worker {id} is {}: it takes requests again", str_of(&v, "state"))
                    } else if v["drained"].as_bool() == Some(true) {
                        format!(
                            "worker {id} drained: no request in flight (waited {} ms); it takes no new ones until `dynamoctl drain {id} --resume`",
                            v["waited_ms"]
                        )
                    } else {
                        format!(
                            "worker {id} is {}: {} request(s) still in flight (not waited for)",
                            str_of(&v, "state"),
                            v["inflight"]
                        )
                    }
                })
            }
            Cmd::Bench {
                url,
                model,
                concurrency,
                requests,
                max_tokens,
                vary_output,
                prompt_tokens,
                stream,
                endpoint,
                duration_s,
                retry_wait_ms,
                ramp_s,
                api_key,
                ca_file,
                json,
            } => {
                if !(ramp_s.is_finite() && (0.0..=3600.0).contains(&ramp_s)) {
                    anyhow::bail!("--ramp-s must be between 0 and 3600 (got {ramp_s})");
                }
                let duration = match duration_s {
                    Some(d) if d.is_finite() && d > 0.0 && d < 1e6 => {
                        Some(std::time::Duration::from_secs_f64(d))
                    }
                    Some(d) => {
                        anyhow::bail!("--duration-s must be more than 0 and under 1000000 seconds (got {d})")
                    }
                    None => None,
                };
                let spec = bench::BenchSpec {
                    url,
                    model,
                    concurrency,
                    requests,
                    max_tokens,
                    vary_output,
                    prompt_tokens,
                    stream,
                    endpoint,
                    duration,
                    retry_wait: std::time::Duration::from_millis(retry_wait_ms),
                    ramp: std::time::Duration::from_secs_f64(ramp_s),
                    api_key: api_key.filter(|k| !k.is_empty()),
                    ca_file,
                };
                let r = bench::run(spec).await?;
                let counts = (r.requests, r.ok, r.errors);
                report(&r, json, bench::render, counts, r.first_error.as_deref())
            }
            Cmd::Configure(spec) => {
                print!("{}", configure::run(&spec)?);
                Ok(())
            }
            Cmd::CalibrateMocker(spec) => {
                let c = calibrate::run(&spec).await?;
                if spec.json {
                    println!("{}", serde_json::to_string_pretty(&c)?);
                } else {
                    print!("{}", calibrate::render(&c));
                }
                Ok(())
            }
            Cmd::Replay {
                trace,
                url,
                model,
                speedup,
                max_requests,
                max_output,
                vocab,
                token_scale,
                json,
            } => {
                let spec = replay::ReplaySpec {
                    trace,
                    url,
                    model,
                    speedup,
                    max_requests,
                    max_output,
                    vocab,
                    token_scale,
                };
                let r = replay::run(spec).await?;
                let counts = (r.requests, r.ok, r.errors);
                report(&r, json, replay::render, counts, r.first_error.as_deref())
            }
        }
    });
    if let Err(e) = res {
        eprintln!("dynamoctl: {e:#}");
        std::process::exit(1);
    }
}
