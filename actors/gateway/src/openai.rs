//! OpenAI request shapes and their validation into [`ValidGenerate`].
//!
//! Parse, don't validate: handlers turn a body into a [`ChatRequest`] or
//! [`CompletionRequest`], then into `ValidGenerate`s (one per prompt); only
//! those reach routing. Unknown fields are ignored (as vLLM does) so clients
//! that send extra OpenAI options keep working, but an OpenAI option this
//! server does not implement and that would change what is generated
//! (`logprobs`, `response_format`, `tools`, penalties, `logit_bias`,
//! `chat_template_kwargs`, …: see [`crate::unsupported`]) is refused with
//! a 400 naming it when set to anything but its default, never silently
//! ignored.
//!
//! Every field has a range (a value outside it is a 400 naming the field):
//!
//! | field | range |
//! |---|---|
//! | `temperature` | 0 – 2 |
//! | `top_p` | (0, 1] |
//! | `top_k` | 0 (off; -1, vLLM's off, also) – the vocabulary size |
//! | `max_tokens`, `max_completion_tokens` | ≥ 1 (a whole number; `5.0` is 5), and prompt + completion ≤ the context length |
//! | `stop` | a string or up to [`MAX_STOP`] strings, each 1 – [`MAX_STOP_BYTES`] bytes |
//! | `n` | 1 |
//! | `messages` | 1 – [`MAX_MESSAGES`] messages |
//! | `prompt` | 1 – [`MAX_PROMPTS`] prompts, each non-empty, token ids inside the vocabulary |
//! | `timeout_ms` | 1 – the gateway's `request_timeout_ms` |
//! | `max_migrations` | 0 – [`MAX_MIGRATIONS`] (capped by the gateway's `max_migrations`) |
//! | `routing.overlap_weight` | 0 – [`MAX_OVERLAP_WEIGHT`] |
//! | `routing.host_hit_cost`, `routing.disk_hit_cost` | 0 – 1 |
//! | `routing.temperature` | 0 – [`MAX_ROUTING_TEMPERATURE`] |

use crate::config::GatewayConfig;
use crate::error::ApiError;
use dynamo_bus_schema::SamplingParams;
use dynamo_model::{ChatMessage, Preprocessor};
use dynamo_router::policy::KvCostWeights;
use serde::Deserialize;
use serde_json::Value;

#[derive(Debug, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Most stop strings per request (OpenAI's limit).
pub const MAX_STOP: usize = 4;
/// Longest stop string, in bytes.
pub const MAX_STOP_BYTES: usize = 1024;
/// Most messages in one chat request.
pub const MAX_MESSAGES: usize = 4096;
/// Most prompts in one completions request.
pub const MAX_PROMPTS: usize = 64;
/// Largest per-request migration limit a request may name.
pub const MAX_MIGRATIONS: u32 = 100;
/// Largest `routing.overlap_weight`.
pub const MAX_OVERLAP_WEIGHT: f64 = 1000.0;
/// Largest `routing.temperature`.
pub const MAX_ROUTING_TEMPERATURE: f64 = 100.0;

/// Options shared by both endpoints.
#[derive(Debug, Deserialize)]
pub struct CommonParams {
    pub model: String,
    #[serde(default, deserialize_with = "whole_number")]
    pub max_tokens: Option<i64>,
    #[serde(default, deserialize_with = "whole_number")]
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// Extension: top-k sampling (0 = off).
    #[serde(default, deserialize_with = "whole_number")]
    pub top_k: Option<i64>,
    pub seed: Option<u64>,
    pub stop: Option<Value>,
    #[serde(default, deserialize_with = "whole_number")]
    pub n: Option<i64>,
    #[serde(default, deserialize_with = "null_as_default")]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    /// An end user's id: checked to be a string, otherwise unused.
    pub user: Option<String>,
    /// Extension: keep generating past end-of-sequence tokens.
    #[serde(default, deserialize_with = "null_as_default")]
    pub ignore_eos: bool,
    /// Extension: end-to-end deadline for this request in milliseconds.
    pub timeout_ms: Option<u64>,
    /// Extension: KV-aware routing weights for this request.
    pub routing: Option<RoutingWeights>,
    /// Extension: most times this request may move to another worker after
    /// a failure (capped by the gateway's `max_migrations`; 0 = never).
    pub max_migrations: Option<u32>,
    /// Every other field: [`crate::unsupported::UNSUPPORTED`] ones are checked, the rest are
    /// ignored. Bounded by the body limit.
    #[serde(flatten)]
    pub other: serde_json::Map<String, Value>,
}

/// `"routing": {...}` in a request body: overrides the router's KV cost
/// weights for this request (each field optional).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutingWeights {
    pub overlap_weight: Option<f64>,
    pub host_hit_cost: Option<f64>,
    pub disk_hit_cost: Option<f64>,
    pub temperature: Option<f64>,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<InMessage>,
    #[serde(flatten)]
    pub common: CommonParams,
}

#[derive(Debug, Deserialize)]
pub struct InMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Value>,
    /// An assistant turn's tool calls: refused unless empty, since tools
    /// are (see [`crate::unsupported::UNSUPPORTED`]) and dropping them would render another
    /// conversation than the one sent.
    #[serde(default)]
    pub tool_calls: Option<Value>,
    /// The legacy form of `tool_calls`, refused likewise.
    #[serde(default)]
    pub function_call: Option<Value>,
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Value,
    #[serde(flatten)]
    pub common: CommonParams,
    #[serde(default, deserialize_with = "null_as_default")]
    pub echo: bool,
}

/// An integer field that also takes a number with no fraction (`5.0`, as
/// Python clients write a float), as vLLM does; `5.5` is refused.
fn whole_number<'de, D>(d: D) -> Result<Option<i64>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    use serde::de::{Error, Unexpected, Visitor};
    struct Whole;
    impl<'de> Visitor<'de> for Whole {
        type Value = Option<i64>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a whole number")
        }
        fn visit_none<E: Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_unit<E: Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_some<D2: serde::Deserializer<'de>>(self, d: D2) -> Result<Self::Value, D2::Error> {
            d.deserialize_any(self)
        }
        fn visit_i64<E: Error>(self, v: i64) -> Result<Self::Value, E> {
            Ok(Some(v))
        }
        fn visit_u64<E: Error>(self, v: u64) -> Result<Self::Value, E> {
            i64::try_from(v)
                .map(Some)
                .map_err(|_| E::invalid_value(Unexpected::Unsigned(v), &self))
        }
        fn visit_f64<E: Error>(self, v: f64) -> Result<Self::Value, E> {
            if v.fract() == 0.0 && v.abs() < 9.0e15 {
                Ok(Some(v as i64))
            } else {
                Err(E::invalid_value(Unexpected::Float(v), &self))
            }
        }
    }
    d.deserialize_option(Whole)
}

/// An optional field sent as `null` takes its default, as OpenAI's API
/// allows for every optional field.
fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// One prompt, ready to route.
#[derive(Clone, Debug)]
pub struct ValidGenerate {
    pub token_ids: Vec<u32>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// Per-request KV cost weights (the `routing` extension).
    pub routing: Option<KvCostWeights>,
    /// Workers may batch token frames this long (a client that does not
    /// stream; set by the gateway, not the body).
    pub frame_batch: Option<std::time::Duration>,
    /// A later prompt of a batch whose earlier prompts a worker took: it
    /// may wait for room up to a minute, not only the queue's wait,
    /// since those prompts free room as they end (set by the gateway).
    pub patient: bool,
}

/// Request-wide options after validation.
#[derive(Clone, Debug)]
pub struct ValidOptions {
    pub stream: bool,
    pub include_usage: bool,
    pub timeout_ms: Option<u64>,
    pub routing: Option<KvCostWeights>,
    pub max_migrations: Option<u32>,
}

/// Parses a JSON body into `T`, mapping serde's complaint to a 400.
pub fn parse_body<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        let (msg, param) = if e.is_syntax() || e.is_eof() {
            (
                format!("We could not parse the JSON body of your request: {e}"),
                None,
            )
        } else {
            (
                format!("Invalid request body: {e}"),
                field_of::<T>(body, &e),
            )
        };
        ApiError::invalid(param, msg)
    })
}

/// The field a body's type error is about (worked out only on an error,
/// so parsing stays one pass when nothing is wrong): the one a
/// missing-field message names, else the path serde keeps to the bad value
/// (`messages.[0].role`, OpenAI's form). Inside the flattened
/// [`CommonParams`] serde keeps no path, so those fields are read again as
/// [`CommonParams`] alone.
fn field_of<'a, T: Deserialize<'a>>(body: &'a [u8], e: &serde_json::Error) -> Option<String> {
    if e.to_string().starts_with("missing field") {
        return field_in(&e.to_string());
    }
    fn path_of<'a, U: Deserialize<'a>>(body: &'a [u8]) -> Option<String> {
        let de = &mut serde_json::Deserializer::from_slice(body);
        let e = serde_path_to_error::deserialize::<_, U>(de).err()?;
        let path = e.path().to_string();
        (path != ".").then(|| path.replace('[', ".["))
    }
    path_of::<T>(body).or_else(|| path_of::<CommonParams>(body))
}

/// The field a serde message names (`missing field `model``).
fn field_in(msg: &str) -> Option<String> {
    let start = msg.find('`')? + 1;
    let end = start + msg[start..].find('`')?;
    let f = &msg[start..end];
    f.chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_')
        .then(|| f.to_string())
}

fn stop_strings(v: &Option<Value>) -> Result<Vec<String>, ApiError> {
    let bad = || {
        ApiError::invalid(
            Some("stop".into()),
            format!("`stop` must be a string or an array of at most {MAX_STOP} strings of 1 to {MAX_STOP_BYTES} bytes"),
        )
    };
    let out = match v {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.len() <= MAX_STOP => a
            .iter()
            .map(|x| x.as_str().map(str::to_string).ok_or_else(bad))
            .collect::<Result<Vec<_>, _>>()?,
        _ => return Err(bad()),
    };
    if out.iter().any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES) {
        return Err(bad());
    }
    Ok(out)
}

/// A number that must lie in `lo..=hi`, or a 400 naming `field`.
fn in_range(field: &str, v: f64, lo: f64, hi: f64) -> Result<f64, ApiError> {
    if v.is_finite() && (lo..=hi).contains(&v) {
        Ok(v)
    } else {
        Err(ApiError::invalid(
            Some(field.to_string()),
            format!("{field} = {v} is out of range: it must be between {lo} and {hi}"),
        ))
    }
}

impl CommonParams {
    /// The request-wide options, checked against their ranges and the
    /// gateway's limits.
    pub fn options(&self, cfg: &GatewayConfig) -> Result<ValidOptions, ApiError> {
        crate::unsupported::check(self)?;
        if let Some(n) = self.n {
            if n != 1 {
                return Err(ApiError::invalid(
                    Some("n".into()),
                    format!("n = {n} is not supported: only n = 1 is"),
                ));
            }
        }
        let max_timeout = cfg.request_timeout.as_millis() as u64;
        if let Some(t) = self.timeout_ms {
            if t == 0 || t > max_timeout {
                return Err(ApiError::invalid(
                    Some("timeout_ms".into()),
                    format!(
                        "timeout_ms = {t} is out of range: it must be between 1 and {max_timeout}"
                    ),
                ));
            }
        }
        if let Some(m) = self.max_migrations {
            if m > MAX_MIGRATIONS {
                return Err(ApiError::invalid(
                    Some("max_migrations".into()),
                    format!("max_migrations = {m} is out of range: it must be between 0 and {MAX_MIGRATIONS}"),
                ));
            }
        }
        let routing = match &self.routing {
            None => None,
            Some(r) => {
                let mut w = KvCostWeights::default();
                for (name, v, slot, hi) in [
                    (
                        "overlap_weight",
                        r.overlap_weight,
                        &mut w.overlap_weight,
                        MAX_OVERLAP_WEIGHT,
                    ),
                    ("host_hit_cost", r.host_hit_cost, &mut w.host_hit_cost, 1.0),
                    ("disk_hit_cost", r.disk_hit_cost, &mut w.disk_hit_cost, 1.0),
                    (
                        "temperature",
                        r.temperature,
                        &mut w.temperature,
                        MAX_ROUTING_TEMPERATURE,
                    ),
                ] {
                    if let Some(v) = v {
                        *slot = in_range(&format!("routing.{name}"), v, 0.0, hi)?;
                    }
                }
                Some(w)
            }
        };
        if self.stream_options.is_some() && !self.stream {
            return Err(ApiError::invalid(
                Some("stream_options".into()),
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            ));
        }
        Ok(ValidOptions {
            stream: self.stream,
            include_usage: self
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage),
            timeout_ms: self.timeout_ms,
            routing,
            max_migrations: self.max_migrations.map(|m| m.min(cfg.max_migrations)),
        })
    }

    /// Validates sampling for a prompt of `prompt_len` tokens under `pre`'s limits.
    fn validate(
        &self,
        pre: &Preprocessor,
        token_ids: Vec<u32>,
        prompt_param: &str,
        default_max: Option<u32>,
    ) -> Result<ValidGenerate, ApiError> {
        let temperature = in_range("temperature", self.temperature.unwrap_or(1.0), 0.0, 2.0)?;
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid(
                Some("top_p".into()),
                format!("top_p = {top_p} is out of range: it must be in (0, 1]"),
            ));
        }
        // -1 is vLLM's "off", which its clients send.
        let top_k = match self.top_k.unwrap_or(0) {
            -1 => 0,
            k => k,
        };
        let vocab = pre.card.vocab_size;
        if !(0..=vocab as i64).contains(&top_k) {
            return Err(ApiError::invalid(
                Some("top_k".into()),
                format!("top_k = {top_k} is out of range: it must be between 0 (off; -1 also) and {vocab}"),
            ));
        }
        let (param, requested) = match (self.max_completion_tokens, self.max_tokens) {
            (Some(m), _) => ("max_completion_tokens", Some(m)),
            (None, m) => ("max_tokens", m),
        };
        if let Some(m) = requested {
            if m < 1 {
                return Err(ApiError::invalid(
                    Some(param.into()),
                    format!("{param} = {m} is invalid: it must be at least 1"),
                ));
            }
        }
        if token_ids.is_empty() {
            return Err(ApiError::invalid(
                Some(prompt_param.into()),
                "The prompt is empty.",
            ));
        }
        if let Some(bad) = token_ids.iter().find(|&&t| t >= vocab) {
            return Err(ApiError::invalid(
                Some(prompt_param.into()),
                format!("Token id {bad} is outside the vocabulary (size {vocab})."),
            ));
        }
        let ctx = pre.card.context_length as u64;
        let prompt = token_ids.len() as u64;
        let max_tokens = match requested {
            Some(m) => m as u64,
            None => match default_max {
                Some(d) => (d as u64).min(ctx.saturating_sub(prompt)),
                None => ctx.saturating_sub(prompt),
            },
        };
        if prompt + max_tokens.max(1) > ctx {
            // With no room left (and no max_tokens asked), at least one
            // token is needed.
            let completion = max_tokens.max(1);
            return Err(ApiError::invalid(
                Some(prompt_param.into()),
                format!("This model's maximum context length is {ctx} tokens. However, you requested {} tokens ({prompt} in the prompt, {completion} for the completion). Please reduce the length of the prompt or the completion.", prompt + completion),
            ).with_code("context_length_exceeded"));
        }
        Ok(ValidGenerate {
            token_ids,
            sampling: SamplingParams {
                max_tokens: max_tokens as u32,
                temperature: temperature as f32,
                top_p: top_p as f32,
                top_k: top_k as u32,
                seed: self.seed,
                // The worker adds the model's EOS ids unless ignore_eos.
                stop_token_ids: Vec::new(),
                ignore_eos: self.ignore_eos,
            },
            stop: stop_strings(&self.stop)?,
            routing: None,
            frame_batch: None,
            patient: false,
        })
    }
}

fn message_text(m: &InMessage, i: usize) -> Result<String, ApiError> {
    let param = || Some(format!("messages.[{i}].content"));
    match &m.content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for p in parts {
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => out.push_str(t),
                    _ => {
                        return Err(ApiError::invalid(
                            param(),
                            "Only text content parts are supported.",
                        ))
                    }
                }
            }
            Ok(out)
        }
        Some(_) => Err(ApiError::invalid(
            param(),
            "Message content must be a string or an array of text parts.",
        )),
    }
}

impl ChatRequest {
    pub fn validate(&self, pre: &Preprocessor) -> Result<ValidGenerate, ApiError> {
        if self.messages.is_empty() || self.messages.len() > MAX_MESSAGES {
            return Err(ApiError::invalid(
                Some("messages".into()),
                format!("`messages` must contain 1 to {MAX_MESSAGES} messages."),
            ));
        }
        let mut msgs = Vec::with_capacity(self.messages.len());
        for (i, m) in self.messages.iter().enumerate() {
            if !matches!(
                m.role.as_str(),
                "system" | "user" | "assistant" | "developer" | "tool"
            ) {
                return Err(ApiError::invalid(
                    Some(format!("messages.[{i}].role")),
                    format!("Invalid role {:?}.", m.role),
                ));
            }
            for (name, v) in [
                ("tool_calls", &m.tool_calls),
                ("function_call", &m.function_call),
            ] {
                let empty = match v {
                    None | Some(Value::Null) => true,
                    Some(Value::Array(a)) => a.is_empty(),
                    Some(_) => false,
                };
                if !empty {
                    return Err(ApiError::invalid(
                        Some(format!("messages.[{i}].{name}")),
                        format!("`{name}` in messages is not supported by this server (it does not implement tools)."),
                    ));
                }
            }
            let no_content = match &m.content {
                None | Some(Value::Null) => true,
                Some(Value::Array(a)) => a.is_empty(),
                Some(_) => false,
            };
            // Only an assistant turn may come without content (OpenAI's rule).
            if no_content && m.role != "assistant" {
                return Err(ApiError::invalid(
                    Some(format!("messages.[{i}].content")),
                    format!(
                        "A {} message needs content (a string or a non-empty array of text parts).",
                        m.role
                    ),
                ));
            }
            let role = if m.role == "developer" {
                "system".to_string()
            } else {
                m.role.clone()
            };
            msgs.push(ChatMessage {
                role,
                content: message_text(m, i)?,
            });
        }
        let ids = pre.chat_prompt(&msgs).map_err(|e| {
            ApiError::invalid(
                Some("messages".into()),
                format!("Cannot apply the chat template: {e}"),
            )
        })?;
        self.common.validate(pre, ids, "messages", None)
    }
}

/// Default `max_tokens` for `/v1/completions` (OpenAI's default).
pub const COMPLETIONS_DEFAULT_MAX_TOKENS: u32 = 16;

impl CompletionRequest {
    /// One `ValidGenerate` per prompt.
    pub fn validate(&self, pre: &Preprocessor) -> Result<Vec<ValidGenerate>, ApiError> {
        if self.echo {
            return Err(ApiError::invalid(
                Some("echo".into()),
                "echo is not supported.",
            ));
        }
        let bad = || {
            ApiError::invalid(Some("prompt".into()), "`prompt` must be a string, an array of strings, an array of token ids, or an array of arrays of token ids.")
        };
        let token = |v: &Value| -> Result<u32, ApiError> {
            v.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(bad)
        };
        let encode = |s: &str| -> Result<Vec<u32>, ApiError> {
            pre.tokenizer
                .encode(s)
                .map_err(|e| ApiError::invalid(Some("prompt".into()), e.to_string()))
        };
        let prompts: Vec<Vec<u32>> = match &self.prompt {
            Value::String(s) => vec![encode(s)?],
            Value::Array(items) if items.is_empty() => return Err(bad()),
            Value::Array(items) => match &items[0] {
                Value::String(_) => items
                    .iter()
                    .map(|v| v.as_str().ok_or_else(bad).and_then(encode))
                    .collect::<Result<_, _>>()?,
                Value::Number(_) => vec![items.iter().map(token).collect::<Result<_, _>>()?],
                Value::Array(_) => items
                    .iter()
                    .map(|v| {
                        v.as_array()
                            .ok_or_else(bad)?
                            .iter()
                            .map(token)
                            .collect::<Result<Vec<u32>, _>>()
                    })
                    .collect::<Result<_, _>>()?,
                _ => return Err(bad()),
            },
            _ => return Err(bad()),
        };
        if prompts.len() > MAX_PROMPTS {
            return Err(ApiError::invalid(
                Some("prompt".into()),
                format!("At most {MAX_PROMPTS} prompts per request."),
            ));
        }
        prompts
            .into_iter()
            .map(|ids| {
                self.common
                    .validate(pre, ids, "prompt", Some(COMPLETIONS_DEFAULT_MAX_TOKENS))
            })
            .collect()
    }
}

/// A parsed body of either endpoint.
#[derive(Debug)]
pub enum Parsed {
    Chat(ChatRequest),
    Completions(CompletionRequest),
}

impl Parsed {
    pub fn common(&self) -> &CommonParams {
        match self {
            Parsed::Chat(r) => &r.common,
            Parsed::Completions(r) => &r.common,
        }
    }

    /// One `ValidGenerate` per prompt (templating and tokenizing).
    pub fn validate(&self, pre: &Preprocessor) -> Result<Vec<ValidGenerate>, ApiError> {
        match self {
            Parsed::Chat(r) => r.validate(pre).map(|v| vec![v]),
            Parsed::Completions(r) => r.validate(pre),
        }
    }
}

#[cfg(test)]
#[path = "openai_tests.rs"]
mod tests;
