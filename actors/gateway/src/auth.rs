//! API keys and per-key limits at the gateway.
//!
//! Keys are never stored: the key file holds the SHA-256 of each key (hex),
//! and a request's `Authorization: Bearer <key>` is hashed and looked up.
//! A key may be limited to some models, and has a request rate and a token
//! rate, each a token bucket holding one minute's worth (OpenAI's RPM and
//! TPM). A request is charged one request at once, and its prompt tokens
//! plus `max_tokens` once tokenized (as OpenAI counts its token limits);
//! a bucket may go into debt by one request's worth, and a key with a
//! bucket in debt is refused with 429 and a `Retry-After` of the time the
//! bucket takes to refill.
//!
//! Invariants: with no keys configured every request passes (the open
//! mode, refused by the node's config off loopback unless asked for); a
//! request without a known key gets 401 and is never charged; metrics name
//! a key by its `name` from the file, never by the key or its hash.

use crate::error::ApiError;
use axum::http::{HeaderMap, StatusCode};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use thiserror::Error;

/// One key as configured.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiKey {
    /// Who the key belongs to (the metrics label).
    pub name: String,
    /// SHA-256 of the key.
    pub sha256: [u8; 32],
    /// Models the key may use (`None`: all).
    pub models: Option<Vec<String>>,
    /// Requests per minute (`None`: unlimited).
    pub requests_per_minute: Option<u32>,
    /// Prompt plus `max_tokens` tokens per minute (`None`: unlimited).
    pub tokens_per_minute: Option<u64>,
}

#[derive(Debug, Error, PartialEq)]
pub enum KeyFileError {
    #[error("key {index}: sha256 must be 64 hex digits")]
    BadHash { index: usize },
    #[error("key {index}: name must be 1–64 characters of [A-Za-z0-9_.-]")]
    BadName { index: usize },
    #[error("key {index} ({name}): {field} must be at least 1")]
    ZeroLimit {
        index: usize,
        name: String,
        field: &'static str,
    },
    #[error("keys {first} and {second} have the same {what}")]
    Duplicate {
        first: usize,
        second: usize,
        what: &'static str,
    },
    #[error("the key file is not valid TOML: {0}")]
    Toml(String),
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    #[serde(default)]
    keys: Vec<RawKey>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RawKey {
    name: String,
    sha256: String,
    models: Option<Vec<String>>,
    requests_per_minute: Option<u32>,
    tokens_per_minute: Option<u64>,
}

/// The SHA-256 of a key, as the key file holds it.
pub fn hash_key(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// A key's name (its metrics label): 1-64 characters of `[A-Za-z0-9_.-]`.
pub fn valid_key_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
}

/// Parses a key file:
///
/// ```toml
/// [[keys]]
/// name = "team-a"
/// sha256 = "<64 hex digits: sha256 of the key>"
/// models = ["smollm2-135m-instruct"]   # optional: all models
/// requests_per_minute = 600            # optional: unlimited
/// tokens_per_minute = 200000           # optional: unlimited
/// ```
pub fn parse_key_file(text: &str) -> Result<Vec<ApiKey>, KeyFileError> {
    let raw: RawFile = toml::from_str(text).map_err(|e| KeyFileError::Toml(e.to_string()))?;
    let mut keys: Vec<ApiKey> = Vec::new();
    for (index, k) in raw.keys.into_iter().enumerate() {
        if !valid_key_name(&k.name) {
            return Err(KeyFileError::BadName { index });
        }
        let mut sha256 = [0u8; 32];
        hex::decode_to_slice(k.sha256.trim(), &mut sha256)
            .map_err(|_| KeyFileError::BadHash { index })?;
        for (field, zero) in [
            ("requests_per_minute", k.requests_per_minute == Some(0)),
            ("tokens_per_minute", k.tokens_per_minute == Some(0)),
        ] {
            if zero {
                return Err(KeyFileError::ZeroLimit {
                    index,
                    name: k.name,
                    field,
                });
            }
        }
        for (first, other) in keys.iter().enumerate() {
            let what = if other.sha256 == sha256 {
                "sha256"
            } else if other.name == k.name {
                "name"
            } else {
                continue;
            };
            return Err(KeyFileError::Duplicate {
                first,
                second: index,
                what,
            });
        }
        keys.push(ApiKey {
            name: k.name,
            sha256,
            models: k.models,
            requests_per_minute: k.requests_per_minute,
            tokens_per_minute: k.tokens_per_minute,
        });
    }
    Ok(keys)
}

/// A token bucket holding one minute of its rate.
#[derive(Debug)]
struct Bucket {
    per_minute: f64,
    level: f64,
    at: Instant,
}

impl Bucket {
    fn new(per_minute: f64, now: Instant) -> Self {
        Bucket {
            per_minute,
            level: per_minute,
            at: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.level = (self.level + dt * self.per_minute / 60.0).min(self.per_minute);
        self.at = now;
    }

    /// Time until the level is positive again (zero if it is).
    fn wait(&self) -> Duration {
        if self.level > 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64((-self.level + 1.0) * 60.0 / self.per_minute)
        }
    }
}

struct KeyState {
    key: ApiKey,
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
}

/// A request that passed authentication: whose key it carries.
#[derive(Clone, Debug, PartialEq)]
pub enum Caller {
    /// No keys are configured.
    Open,
    Key(usize),
}

/// The gateway's keys and their buckets.
pub struct Auth {
    by_hash: HashMap<[u8; 32], usize>,
    keys: Vec<Mutex<KeyState>>,
}

impl Auth {
    pub fn new(keys: Vec<ApiKey>, now: Instant) -> Arc<Self> {
        let by_hash = keys
            .iter()
            .enumerate()
            .map(|(i, k)| (k.sha256, i))
            .collect();
        let keys = keys
            .into_iter()
            .map(|key| {
                Mutex::new(KeyState {
                    requests: key.requests_per_minute.map(|r| Bucket::new(r as f64, now)),
                    tokens: key.tokens_per_minute.map(|t| Bucket::new(t as f64, now)),
                    key,
                })
            })
            .collect();
        Arc::new(Auth { by_hash, keys })
    }

    /// Whether any key is configured (off: every request passes).
    pub fn enabled(&self) -> bool {
        !self.keys.is_empty()
    }

    /// The name of a caller's key (`"-"` in the open mode).
    pub fn name(&self, c: &Caller) -> String {
        match c {
            Caller::Open => "-".into(),
            Caller::Key(i) => self.keys[*i]
                .lock()
                .map(|k| k.key.name.clone())
                .unwrap_or_default(),
        }
    }

    /// A caller's key as metrics name it: its name and its hashed id (the
    /// first 12 hex digits of its SHA-256; `"-"` for none).
    pub fn label(&self, c: &Caller) -> (String, String) {
        match c {
            Caller::Open => ("-".into(), "-".into()),
            Caller::Key(i) => self.keys[*i]
                .lock()
                .map(|k| (k.key.name.clone(), hex::encode(&k.key.sha256[..6])))
                .unwrap_or_default(),
        }
    }

    /// The names of every key (for the metrics).
    pub fn names(&self) -> Vec<String> {
        (0..self.keys.len())
            .map(|i| self.name(&Caller::Key(i)))
            .collect()
    }

    /// Checks the request's key (401 without a known one).
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Caller, ApiError> {
        if !self.enabled() {
            return Ok(Caller::Open);
        }
        let presented = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                v.strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
            })
            .map(str::trim);
        let Some(key) = presented.filter(|k| !k.is_empty()) else {
            return Err(unauthorized(
                "You didn't provide an API key. Send it as `Authorization: Bearer <key>`.",
            ));
        };
        match self.by_hash.get(&hash_key(key)) {
            Some(&i) => Ok(Caller::Key(i)),
            None => Err(unauthorized("Incorrect API key provided.")),
        }
    }

    /// Charges the caller one request, or refuses it (429) while either of
    /// its buckets is empty.
    pub fn admit(&self, c: &Caller, now: Instant) -> Result<(), ApiError> {
        let Caller::Key(i) = c else { return Ok(()) };
        let mut st = self.keys[*i]
            .lock()
            .map_err(|_| ApiError::internal("key state"))?;
        let KeyState {
            requests, tokens, ..
        } = &mut *st;
        if let Some(b) = tokens.as_mut() {
            b.refill(now);
            if b.level <= 0.0 {
                return Err(rate_limited("tokens", b.wait()));
            }
        }
        if let Some(b) = requests.as_mut() {
            b.refill(now);
            if b.level < 1.0 {
                let missing = 1.0 - b.level;
                return Err(rate_limited(
                    "requests",
                    Duration::from_secs_f64(missing * 60.0 / b.per_minute),
                ));
            }
            b.level -= 1.0;
        }
        Ok(())
    }

    /// Refuses a model the caller's key may not use.
    pub fn allow_model(&self, c: &Caller, model: &str) -> Result<(), ApiError> {
        let Caller::Key(i) = c else { return Ok(()) };
        let st = self.keys[*i]
            .lock()
            .map_err(|_| ApiError::internal("key state"))?;
        match &st.key.models {
            Some(m) if !m.iter().any(|x| x == model) => Err(ApiError {
                status: StatusCode::FORBIDDEN,
                message: format!("This API key may not use the model `{model}`."),
                kind: "invalid_request_error",
                param: Some("model".into()),
                code: Some("model_not_allowed"),
                retry_after: None,
            }),
            _ => Ok(()),
        }
    }

    /// Whether the caller may use every model (no keys, or a key without a
    /// model list).
    pub fn all_models(&self, c: &Caller) -> bool {
        let Caller::Key(i) = c else { return true };
        self.keys[*i]
            .lock()
            .map(|st| st.key.models.is_none())
            .unwrap_or(false)
    }

    /// Charges the request's tokens (prompt plus `max_tokens`), checked
    /// and taken under one lock: a bucket already in debt refuses the
    /// request (429, nothing charged), so concurrent requests admitted
    /// together cannot overdraw it by more than one request's worth.
    pub fn charge_tokens(&self, c: &Caller, tokens: u64, now: Instant) -> Result<(), ApiError> {
        let Caller::Key(i) = c else { return Ok(()) };
        let mut st = self.keys[*i]
            .lock()
            .map_err(|_| ApiError::internal("key state"))?;
        if let Some(b) = st.tokens.as_mut() {
            b.refill(now);
            if b.level <= 0.0 {
                return Err(rate_limited("tokens", b.wait()));
            }
            b.level -= tokens as f64;
        }
        Ok(())
    }
}

fn unauthorized(message: &str) -> ApiError {
    ApiError {
        status: StatusCode::UNAUTHORIZED,
        message: message.into(),
        kind: "invalid_request_error",
        param: None,
        code: Some("invalid_api_key"),
        retry_after: None,
    }
}

fn rate_limited(what: &str, wait: Duration) -> ApiError {
    let s = wait.as_secs_f64().ceil().max(1.0).min(u32::MAX as f64) as u32;
    ApiError {
        status: StatusCode::TOO_MANY_REQUESTS,
        message: format!("Rate limit reached for this API key: {what} per minute. Retry in {s} s."),
        kind: "rate_limit_error",
        param: None,
        code: Some(if what == "tokens" {
            "rate_limit_tokens"
        } else {
            "rate_limit_requests"
        }),
        retry_after: Some(s),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(keys: &[(&str, &str, &str)]) -> String {
        keys.iter()
            .map(|(name, key, extra)| {
                format!(
                    "[[keys]]\nname = \"{name}\"\nsha256 = \"{}\"\n{extra}\n",
                    hex::encode(hash_key(key))
                )
            })
            .collect()
    }

    fn bearer(key: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            axum::http::header::AUTHORIZATION,
            format!("Bearer {key}").parse().unwrap(),
        );
        h
    }

    #[test]
    fn keys_limits_and_models() {
        let t0 = Instant::now();
        let keys = parse_key_file(&file(&[
            ("a", "sk-a", "requests_per_minute = 2\nmodels = [\"m1\"]"),
            ("b", "sk-b", "tokens_per_minute = 600"),
        ]))
        .unwrap();
        let auth = Auth::new(keys, t0);
        assert!(auth.enabled());
        let e = auth.authenticate(&HeaderMap::new()).unwrap_err();
        assert_eq!((e.status.as_u16(), e.code), (401, Some("invalid_api_key")));
        let e = auth.authenticate(&bearer("sk-x")).unwrap_err();
        assert_eq!(e.status.as_u16(), 401);
        // Key a: two requests a minute, then 429 with the refill time.
        let a = auth.authenticate(&bearer("sk-a")).unwrap();
        assert_eq!(auth.name(&a), "a");
        auth.admit(&a, t0).unwrap();
        auth.admit(&a, t0).unwrap();
        let e = auth.admit(&a, t0).unwrap_err();
        assert_eq!((e.status.as_u16(), e.retry_after), (429, Some(30)));
        assert!(auth.admit(&a, t0 + Duration::from_secs(30)).is_ok());
        // …and only model m1.
        assert!(auth.allow_model(&a, "m1").is_ok());
        assert_eq!(auth.allow_model(&a, "m2").unwrap_err().status.as_u16(), 403);
        // Key b: 600 tokens a minute; a 900-token request goes into debt.
        let b = auth.authenticate(&bearer("sk-b")).unwrap();
        assert!(auth.allow_model(&b, "m2").is_ok());
        auth.admit(&b, t0).unwrap();
        // Admitted together (before either is charged), then charged: the
        // first goes into debt, the second is refused and not charged.
        auth.admit(&b, t0).unwrap();
        auth.charge_tokens(&b, 900, t0).unwrap();
        let e = auth.charge_tokens(&b, 900, t0).unwrap_err();
        assert_eq!(e.code, Some("rate_limit_tokens"));
        let e = auth.admit(&b, t0).unwrap_err();
        assert_eq!(e.code, Some("rate_limit_tokens"));
        assert_eq!(e.retry_after, Some(31)); // 301 tokens at 10 a second
        assert!(auth.admit(&b, t0 + Duration::from_secs(31)).is_ok());
        // No keys: open.
        let open = Auth::new(Vec::new(), t0);
        assert_eq!(open.authenticate(&HeaderMap::new()), Ok(Caller::Open));
        assert!(open.admit(&Caller::Open, t0).is_ok());
    }

    #[test]
    fn bad_key_files_name_the_key_and_field() {
        assert_eq!(
            parse_key_file("[[keys]]\nname = \"a\"\nsha256 = \"zz\"\n"),
            Err(KeyFileError::BadHash { index: 0 })
        );
        assert_eq!(
            parse_key_file(&file(&[("a b", "k", "")])),
            Err(KeyFileError::BadName { index: 0 })
        );
        assert!(matches!(
            parse_key_file(&file(&[("a", "k", "requests_per_minute = 0")])),
            Err(KeyFileError::ZeroLimit {
                field: "requests_per_minute",
                ..
            })
        ));
        assert_eq!(
            parse_key_file(&file(&[("a", "k", ""), ("b", "k", "")])),
            Err(KeyFileError::Duplicate {
                first: 0,
                second: 1,
                what: "sha256"
            })
        );
        assert!(matches!(
            parse_key_file("[[keys]]\nnam = 1"),
            Err(KeyFileError::Toml(_))
        ));
        assert_eq!(parse_key_file(""), Ok(Vec::new()));
    }
}
