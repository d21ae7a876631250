//! Every environment variable the node and the CLI read, in one place.

/// NATS URL for `dynamoctl` (and nodes whose config says `url = "env"`).
pub const NATS_URL: &str = "DYNAMO_NATS_URL";
/// Namespace for `dynamoctl` when `--namespace` is not given.
pub const NAMESPACE: &str = "DYNAMO_NAMESPACE";
/// Directory where a node with embedded NATS writes `<namespace>.nats-url`.
pub const STATE_DIR: &str = "DYNAMO_STATE_DIR";
/// GGUF file to serve when a worker's `model_path` is `auto`.
pub const MODEL_GGUF: &str = dynamo_model::card::ENV_MODEL_GGUF;
/// Log filter (tracing `EnvFilter` syntax).
pub const LOG: &str = "DYNAMO_LOG";

/// Where embedded-NATS URLs are published for the CLI.
pub fn state_dir() -> std::path::PathBuf {
    std::env::var_os(STATE_DIR)
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("dynamo-state"))
}
