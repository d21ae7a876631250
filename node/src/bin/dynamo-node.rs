//! The node daemon. Usage: `dynamo-node --config cluster-config/examples/single-node.toml`.

use clap::Parser;
use dynamo_node::{config::NodeConfig, daemon, env};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "dynamo-node",
    version,
    about = "Runs a node's actors (gateway, router, workers) from a TOML config"
)]
struct Args {
    /// The node's TOML config.
    #[arg(long, short)]
    config: PathBuf,
}

fn main() {
    dynamo_transfer::reset_inherited_signal_handlers();
    let args = Args::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_env(env::LOG)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,async_nats=warn"));
    // Colours only on a terminal: a log file or journal gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .init();
    let cfg = match NodeConfig::load(&args.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("dynamo-node: {e}");
            std::process::exit(2);
        }
    };
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
    if let Err(e) = rt.block_on(daemon::run(cfg)) {
        eprintln!("dynamo-node: {e:#}");
        std::process::exit(1);
    }
}
