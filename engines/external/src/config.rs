//! An external engine's configuration: the raw form a node config or a
//! deployment spec holds ([`RawExternal`]), and the checked form
//! ([`ExternalConfig`]) an [`crate::engine::ExternalEngine`] runs with.
//!
//! Invariants of an [`ExternalConfig`]: its `url` is an `http(s)` base URL
//! without a query; every timeout and interval is positive and bounded;
//! a launch command is non-empty and each of its placeholders is known;
//! `max_inflight` is 1..=[`MAX_INFLIGHT`].

use crate::zmq_source::ZmqConfig;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::time::Duration;
use thiserror::Error;

/// Most requests one external engine is sent at once.
pub const MAX_INFLIGHT: u32 = 4096;
/// Longest timeout or interval accepted (one hour).
pub const MAX_WAIT: Duration = Duration::from_secs(3600);

#[derive(Debug, Error, PartialEq)]
pub enum ConfigError {
    #[error("`{field}`: {message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
}

fn invalid(field: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field,
        message: message.into(),
    }
}

/// The HTTP API an engine speaks, which decides how a prompt of token ids
/// goes in and how output token ids come back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// llama.cpp's `llama-server`: `POST /completion` with a token-id
    /// prompt and `return_tokens` (its `/v1/completions` returns only text).
    LlamaCpp,
    /// OpenAI `POST /v1/completions` with a token-id prompt and
    /// `return_token_ids` (vLLM ≥ 0.10.2; TensorRT-LLM's `trtllm-serve`).
    OpenAi,
    /// SGLang's native `POST /generate` with `input_ids` (its streamed
    /// chunks carry `output_ids`).
    Sglang,
}

impl Api {
    pub fn parse(s: &str) -> Option<Api> {
        Some(match s {
            "llamacpp" | "llama.cpp" => Api::LlamaCpp,
            "vllm" | "openai" | "trtllm" => Api::OpenAi,
            "sglang" => Api::Sglang,
            _ => return None,
        })
    }

    /// Default Prometheus path and health path of the engine's server.
    fn default_health(self) -> &'static str {
        match self {
            Api::LlamaCpp | Api::OpenAi | Api::Sglang => "/health",
        }
    }
}

/// `[workers.external]` as written.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RawExternal {
    /// Base URL of the engine's HTTP server (`http://10.0.0.5:8000`). With
    /// `launch`, defaults to `http://127.0.0.1:{port}`.
    pub url: Option<String>,
    /// `llamacpp`, `vllm` (also `openai`, `trtllm`) or `sglang`.
    pub api: Option<String>,
    /// Model name sent to the engine (default: our model's name).
    pub served_model: Option<String>,
    /// Requests sent to the engine at once (default 64); past it the worker
    /// answers `Overloaded` and the gateway tries another worker.
    pub max_inflight: Option<u32>,
    /// TCP connect timeout (default 2000 ms).
    pub connect_timeout_ms: Option<u64>,
    /// Longest wait for a response's headers (default 60000 ms).
    pub response_timeout_ms: Option<u64>,
    /// Longest silence inside a stream before the engine counts as hung
    /// (default 60000 ms).
    pub idle_timeout_ms: Option<u64>,
    /// Health endpoint (default `/health`; 200 means ready).
    pub health_path: Option<String>,
    /// Period of health checks and of metrics scrapes (default 1000 ms).
    pub health_interval_ms: Option<u64>,
    /// Consecutive failed health checks after which a ready engine is
    /// dead and the worker restarts (default 3).
    pub health_failures: Option<u32>,
    /// Prometheus endpoint (default `/metrics`; empty: none).
    pub metrics_path: Option<String>,
    /// Longest wait for the engine to become healthy (default 600000 ms).
    pub startup_timeout_ms: Option<u64>,
    /// Start the engine process here instead of attaching to one.
    pub launch: Option<RawLaunch>,
    /// The engine's KV event publisher (vLLM, SGLang); none: the router
    /// tracks this worker approximately.
    pub kv_events: Option<RawKvEvents>,
    /// `tokens` (default): prompts go as our token ids and output comes
    /// back as the engine's. `text`, for a server that takes or returns
    /// only text: prompts go as our text (special tokens written out), and
    /// output text without ids is encoded again with our tokenizer.
    pub prompt: Option<String>,
}

/// `[workers.external.launch]`.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RawLaunch {
    /// Program and arguments. Placeholders: `{port}` (a free port, the HTTP
    /// server's), `{model_path}` (the group's GGUF file), `{kv_port}` and
    /// `{replay_port}` (free ports for the KV event publisher).
    pub command: Vec<String>,
    /// Extra environment for the process.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

/// `[workers.external.kv_events]`.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RawKvEvents {
    /// The engine's PUB endpoint (`tcp://host:5557`; `{kv_port}` with launch).
    pub endpoint: String,
    /// Its ROUTER replay endpoint (`tcp://host:5558`; `{replay_port}`).
    pub replay_endpoint: Option<String>,
    /// Topic prefix (default empty: everything).
    pub topic: Option<String>,
    /// Data-parallel rank, added to both ports (default 0).
    pub dp_rank: Option<u16>,
    /// Longest wait for a replayed batch (default 2000 ms).
    pub replay_timeout_ms: Option<u64>,
}

/// A launch command, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    pub command: Vec<String>,
    pub env: BTreeMap<String, String>,
}

/// How a prompt goes to the engine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PromptForm {
    /// Our token ids; output as the engine's token ids.
    #[default]
    Tokens,
    /// Our detokenized text; output ids where the engine streams them,
    /// else its text encoded with our tokenizer.
    Text,
}

/// The checked configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct ExternalConfig {
    /// Base URL (may hold `{port}` when launched).
    pub url: String,
    pub api: Api,
    /// The engine's name as registered and shown (`llamacpp`, `vllm`,
    /// `sglang`, `trtllm`, `openai`).
    pub kind: &'static str,
    /// Model name sent to the engine; `None`: our model's name.
    pub served_model: Option<String>,
    pub max_inflight: u32,
    pub connect_timeout: Duration,
    pub response_timeout: Duration,
    pub idle_timeout: Duration,
    pub health_path: String,
    pub health_interval: Duration,
    pub health_failures: u32,
    /// `None`: the engine exports no metrics; load is the in-flight count.
    pub metrics_path: Option<String>,
    pub startup_timeout: Duration,
    pub launch: Option<Launch>,
    /// Endpoints may hold `{kv_port}` / `{replay_port}` when launched.
    pub kv_events: Option<ZmqConfig>,
    pub prompt: PromptForm,
}

const PLACEHOLDERS: [&str; 4] = ["{port}", "{model_path}", "{kv_port}", "{replay_port}"];

fn ms(
    field: &'static str,
    v: Option<u64>,
    default: u64,
    min: Duration,
) -> Result<Duration, ConfigError> {
    let d = Duration::from_millis(v.unwrap_or(default));
    if d < min || d > MAX_WAIT {
        return Err(invalid(
            field,
            format!(
                "must be between {} and {} ms",
                min.as_millis(),
                MAX_WAIT.as_millis()
            ),
        ));
    }
    Ok(d)
}

fn path(field: &'static str, p: &str) -> Result<String, ConfigError> {
    if !p.starts_with('/') || p.chars().any(|c| c.is_whitespace() || c == '?') {
        return Err(invalid(field, "must be a path starting with `/`"));
    }
    Ok(p.to_string())
}

/// Checks placeholders: only known ones, and only where they can be
/// filled. A placeholder is `{name}` with a lowercase name; other braces
/// (the JSON of `--kv-events-config`) are left alone.
fn check_placeholders(field: &'static str, s: &str, launched: bool) -> Result<(), ConfigError> {
    let mut rest = s;
    while let Some(i) = rest.find('{') {
        let tail = &rest[i + 1..];
        let name_len = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
            .unwrap_or(tail.len());
        if name_len == 0 || !tail[name_len..].starts_with('}') {
            rest = tail;
            continue;
        }
        let p = &rest[i..i + name_len + 2];
        if !PLACEHOLDERS.contains(&p) {
            return Err(invalid(
                field,
                format!(
                    "unknown placeholder {p} in {s:?} (known: {})",
                    PLACEHOLDERS.join(", ")
                ),
            ));
        }
        if !launched {
            return Err(invalid(field, format!("{p} is filled only with `launch`")));
        }
        rest = &tail[name_len + 1..];
    }
    Ok(())
}

impl RawExternal {
    pub fn validate(&self) -> Result<ExternalConfig, ConfigError> {
        let (api, kind) = match self.api.as_deref() {
            None => return Err(invalid("api", "is required: llamacpp, vllm or sglang")),
            Some(a) => {
                let api = Api::parse(a).ok_or_else(|| {
                    invalid(
                        "api",
                        format!("unknown api {a:?} (llamacpp, vllm, openai, trtllm or sglang)"),
                    )
                })?;
                let kind = match a {
                    "trtllm" => "trtllm",
                    "openai" => "openai",
                    _ => match api {
                        Api::LlamaCpp => "llamacpp",
                        Api::OpenAi => "vllm",
                        Api::Sglang => "sglang",
                    },
                };
                (api, kind)
            }
        };
        let launch = match &self.launch {
            None => None,
            Some(l) => {
                if l.command.is_empty() || l.command[0].trim().is_empty() {
                    return Err(invalid("launch.command", "must name a program"));
                }
                for a in &l.command {
                    check_placeholders("launch.command", a, true)?;
                }
                Some(Launch {
                    command: l.command.clone(),
                    env: l.env.clone(),
                })
            }
        };
        let launched = launch.is_some();
        let url = match (&self.url, launched) {
            (Some(u), _) => u.trim_end_matches('/').to_string(),
            (None, true) => "http://127.0.0.1:{port}".to_string(),
            (None, false) => {
                return Err(invalid(
                    "url",
                    "is required to attach to a running engine (or give `launch`)",
                ))
            }
        };
        check_placeholders("url", &url, launched)?;
        let probe = url.replace("{port}", "1");
        match reqwest::Url::parse(&probe) {
            Ok(u) if (u.scheme() == "http" || u.scheme() == "https") && u.query().is_none() => {}
            _ => {
                return Err(invalid(
                    "url",
                    format!("{url:?} is not an http(s) base URL"),
                ))
            }
        }
        let max_inflight = self.max_inflight.unwrap_or(64);
        if max_inflight == 0 || max_inflight > MAX_INFLIGHT {
            return Err(invalid("max_inflight", format!("must be 1-{MAX_INFLIGHT}")));
        }
        let health_failures = self.health_failures.unwrap_or(3);
        if health_failures == 0 || health_failures > 1000 {
            return Err(invalid("health_failures", "must be 1-1000"));
        }
        let metrics_path = match self.metrics_path.as_deref() {
            None => Some("/metrics".to_string()),
            Some("") => None,
            Some(p) => Some(path("metrics_path", p)?),
        };
        let kv_events = match &self.kv_events {
            None => None,
            Some(k) => {
                check_placeholders("kv_events.endpoint", &k.endpoint, launched)?;
                if !k.endpoint.starts_with("tcp://") {
                    return Err(invalid("kv_events.endpoint", "must be tcp://host:port"));
                }
                if let Some(r) = &k.replay_endpoint {
                    check_placeholders("kv_events.replay_endpoint", r, launched)?;
                    if !r.starts_with("tcp://") {
                        return Err(invalid(
                            "kv_events.replay_endpoint",
                            "must be tcp://host:port",
                        ));
                    }
                }
                Some(ZmqConfig {
                    endpoint: k.endpoint.clone(),
                    replay_endpoint: k.replay_endpoint.clone(),
                    topic: k.topic.clone().unwrap_or_default(),
                    dp_rank: k.dp_rank.unwrap_or(0),
                    replay_timeout: ms(
                        "kv_events.replay_timeout_ms",
                        k.replay_timeout_ms,
                        2000,
                        Duration::from_millis(10),
                    )?,
                })
            }
        };
        Ok(ExternalConfig {
            url,
            api,
            kind,
            served_model: self.served_model.clone().filter(|s| !s.is_empty()),
            max_inflight,
            connect_timeout: ms(
                "connect_timeout_ms",
                self.connect_timeout_ms,
                2000,
                Duration::from_millis(10),
            )?,
            response_timeout: ms(
                "response_timeout_ms",
                self.response_timeout_ms,
                60_000,
                Duration::from_millis(10),
            )?,
            idle_timeout: ms(
                "idle_timeout_ms",
                self.idle_timeout_ms,
                60_000,
                Duration::from_millis(10),
            )?,
            health_path: path(
                "health_path",
                self.health_path.as_deref().unwrap_or(api.default_health()),
            )?,
            health_interval: ms(
                "health_interval_ms",
                self.health_interval_ms,
                1000,
                Duration::from_millis(10),
            )?,
            health_failures,
            metrics_path,
            startup_timeout: ms(
                "startup_timeout_ms",
                self.startup_timeout_ms,
                600_000,
                Duration::from_millis(10),
            )?,
            launch,
            kv_events,
            prompt: match self.prompt.as_deref() {
                None | Some("tokens") => PromptForm::Tokens,
                Some("text") => PromptForm::Text,
                Some(o) => {
                    return Err(invalid(
                        "prompt",
                        format!("unknown prompt form {o:?} (tokens or text)"),
                    ))
                }
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attach(url: &str) -> RawExternal {
        RawExternal {
            url: Some(url.into()),
            api: Some("llamacpp".into()),
            ..Default::default()
        }
    }

    #[test]
    fn the_prompt_goes_as_tokens_unless_text_is_asked_for() {
        let c = attach("http://h:1").validate().unwrap();
        assert_eq!(c.prompt, PromptForm::Tokens);
        let mut r = attach("http://h:1");
        r.prompt = Some("text".into());
        assert_eq!(r.validate().unwrap().prompt, PromptForm::Text);
        r.prompt = Some("words".into());
        let e = r.validate().unwrap_err().to_string();
        assert!(e.contains("`prompt`") && e.contains("words"), "{e}");
    }

    #[test]
    fn attach_needs_a_url_and_an_api() {
        let c = attach("http://127.0.0.1:8080/").validate().unwrap();
        assert_eq!(c.url, "http://127.0.0.1:8080");
        assert_eq!(c.api, Api::LlamaCpp);
        assert_eq!(c.max_inflight, 64);
        assert_eq!(c.metrics_path.as_deref(), Some("/metrics"));
        let mut r = attach("x");
        r.url = None;
        assert!(matches!(
            r.validate(),
            Err(ConfigError::Invalid { field: "url", .. })
        ));
        let mut r = attach("http://h:1");
        r.api = Some("tgi".into());
        assert!(matches!(
            r.validate(),
            Err(ConfigError::Invalid { field: "api", .. })
        ));
        r.api = None;
        assert!(matches!(
            r.validate(),
            Err(ConfigError::Invalid { field: "api", .. })
        ));
        for bad in ["ftp://h:1", "h:1", "http://h:1/?a=b", "http://{port}"] {
            assert!(attach(bad).validate().is_err(), "{bad}");
        }
    }

    #[test]
    fn bounds_are_checked() {
        let mut r = attach("http://h:1");
        r.max_inflight = Some(0);
        assert!(r.validate().is_err());
        r.max_inflight = Some(MAX_INFLIGHT + 1);
        assert!(r.validate().is_err());
        let mut r = attach("http://h:1");
        r.health_interval_ms = Some(0);
        assert!(r.validate().is_err());
        let mut r = attach("http://h:1");
        r.idle_timeout_ms = Some(u64::MAX);
        assert!(r.validate().is_err());
        let mut r = attach("http://h:1");
        r.health_path = Some("health".into());
        assert!(r.validate().is_err());
        let mut r = attach("http://h:1");
        r.metrics_path = Some(String::new());
        assert_eq!(r.validate().unwrap().metrics_path, None);
    }

    #[test]
    fn launch_fills_placeholders_only_it_knows() {
        let r = RawExternal {
            api: Some("vllm".into()),
            launch: Some(RawLaunch {
                command: vec![
                    "vllm".into(),
                    "serve".into(),
                    "--port".into(),
                    "{port}".into(),
                ],
                env: BTreeMap::new(),
            }),
            kv_events: Some(RawKvEvents {
                endpoint: "tcp://127.0.0.1:{kv_port}".into(),
                replay_endpoint: Some("tcp://127.0.0.1:{replay_port}".into()),
                ..Default::default()
            }),
            ..Default::default()
        };
        let c = r.validate().unwrap();
        assert_eq!(c.url, "http://127.0.0.1:{port}");
        assert_eq!(c.api, Api::OpenAi);
        assert!(c.kv_events.is_some());
        let mut bad = r.clone();
        bad.launch.as_mut().unwrap().command.push("{gpu}".into());
        assert!(bad.validate().is_err());
        // JSON braces are not placeholders.
        let mut json = r.clone();
        json.launch
            .as_mut()
            .unwrap()
            .command
            .push(r#"{"enable_kv_cache_events": true, "endpoint": "tcp://*:{kv_port}"}"#.into());
        assert!(json.validate().is_ok());
        let mut bad = r.clone();
        bad.launch.as_mut().unwrap().command = vec![];
        assert!(bad.validate().is_err());
        // Without launch, nothing fills a placeholder.
        let mut bad = attach("http://h:1");
        bad.kv_events = r.kv_events.clone();
        assert!(bad.validate().is_err());
    }
}
