//! KV events as vLLM and SGLang publish them: a msgpack `EventBatch`
//! holding `BlockStored`, `BlockRemoved` and `AllBlocksCleared` events,
//! decoded tolerantly into [`EngineBatch`].
//!
//! What is accepted, since engines change their encoding between releases:
//! - **Both encodings** of every struct: as an array (msgspec's
//!   `array_like=True`: fields in declaration order, an event's tag first,
//!   trailing default fields left out) and as a map (field names, the tag
//!   under `type`).
//! - **Unknown fields** are ignored: extra array elements past the ones
//!   known, and map keys not known. An unknown event tag is kept as
//!   [`EngineEvent::Unknown`] so the caller can count it.
//! - **Hashes** as signed or unsigned 64-bit integers (an `i64` is read as
//!   the same 64 bits), or as bytes (newer vLLM's SHA-256 block hashes),
//!   which are folded to 64 bits with XXH3.
//! - The batch's rank as `data_parallel_rank` (vLLM) or `attn_dp_rank`
//!   (SGLang).
//! - A hybrid model's KV cache group (vLLM's `group_idx`, and on stores
//!   `kv_cache_spec_kind`), as [`CacheGroup`]; absent for one-group models.
//!   A removal names only the index (vLLM sends no kind on it, and what
//!   some releases put after `group_idx` there, copy counts or a locality
//!   string, is ignored).
//!
//! - A store without tokens (`token_ids` empty, `block_size` 0 or not):
//!   what vLLM's offloading connector publishes when it copies blocks to
//!   CPU or disk, naming them by hashes already stored.
//! - Token ids that do not fill `block_hashes × block_size`: vLLM leaves a
//!   sliding window's null blocks out of the hashes but not out of the
//!   tokens. The translator refuses such a store where it would index it.
//!
//! Invariants: [`decode_batch`] never panics; it refuses a payload over
//! [`MAX_PAYLOAD`], nesting deeper than msgpack's decoder allows, and more
//! than [`MAX_EVENTS`] events; an event that does not decode (over
//! [`MAX_TOKENS`], a block size over [`MAX_BLOCK_SIZE`] or 0 with tokens, a
//! field of the wrong type) becomes [`EngineEvent::Invalid`], and the
//! batch's other events stand.

use rmpv::Value;
use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64;

/// Largest payload decoded (bytes).
pub const MAX_PAYLOAD: usize = 16 * 1024 * 1024;
/// Most events in one batch.
pub const MAX_EVENTS: usize = 65_536;
/// Most token ids in one event.
pub const MAX_TOKENS: usize = 1 << 20;
/// Largest engine block accepted (tokens).
pub const MAX_BLOCK_SIZE: u32 = 1 << 16;

/// An engine's identity for one block (64 bits whatever it sent).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineHash(pub u64);

/// Which of a hybrid model's KV cache groups an event is of: vLLM's
/// `group_idx` and, on stores, `kv_cache_spec_kind` (`full_attention`,
/// `sliding_window`, `mamba`, …). Both are absent for a model with one
/// group, and for SGLang; a removal's `kind` is always `None`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheGroup {
    pub idx: Option<i64>,
    pub kind: Option<String>,
}

/// One event of an engine.
#[derive(Clone, Debug, PartialEq)]
pub enum EngineEvent {
    /// `hashes` were stored after `parent`; `token_ids` holds their tokens,
    /// `block_size` each (none: copies of blocks stored before, on another
    /// medium).
    Stored {
        hashes: Vec<EngineHash>,
        parent: Option<EngineHash>,
        token_ids: Vec<u32>,
        block_size: u32,
        lora_id: Option<i64>,
        lora_name: Option<String>,
        medium: Option<String>,
        group: CacheGroup,
    },
    Removed {
        hashes: Vec<EngineHash>,
        medium: Option<String>,
        group: CacheGroup,
    },
    Cleared,
    /// An event type this build does not know, by its tag.
    Unknown(String),
    /// An event that does not decode, and why (its batch's other events
    /// still count).
    Invalid(String),
}

/// One published batch.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineBatch {
    pub ts: f64,
    pub events: Vec<EngineEvent>,
    pub dp_rank: Option<i64>,
}

/// Why a payload was refused.
#[derive(Debug, Error, PartialEq)]
pub enum DecodeError {
    #[error("payload of {0} bytes is over the {MAX_PAYLOAD}-byte limit")]
    TooLarge(usize),
    #[error("not msgpack: {0}")]
    Msgpack(String),
    #[error("{field}: {message}")]
    Shape {
        field: &'static str,
        message: String,
    },
}

fn shape(field: &'static str, message: impl Into<String>) -> DecodeError {
    DecodeError::Shape {
        field,
        message: message.into(),
    }
}

/// Decodes one `EventBatch` payload.
pub fn decode_batch(payload: &[u8]) -> Result<EngineBatch, DecodeError> {
    if payload.len() > MAX_PAYLOAD {
        return Err(DecodeError::TooLarge(payload.len()));
    }
    let mut r = payload;
    let v = rmpv::decode::read_value(&mut r).map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    if !r.is_empty() {
        return Err(DecodeError::Msgpack(format!(
            "{} bytes after the batch",
            r.len()
        )));
    }
    let f = Fields::of(&v, &["ts", "events", "data_parallel_rank"], "batch")?;
    let ts = match f.get(0) {
        Some(v) => float(v).ok_or_else(|| shape("ts", "not a number"))?,
        None => 0.0,
    };
    let events = f
        .get(1)
        .ok_or_else(|| shape("events", "missing"))?
        .as_array()
        .ok_or_else(|| shape("events", "not an array"))?;
    if events.len() > MAX_EVENTS {
        return Err(shape(
            "events",
            format!("{} events, over {MAX_EVENTS}", events.len()),
        ));
    }
    let dp_rank = match f.get(2).or_else(|| f.named("attn_dp_rank")) {
        None | Some(Value::Nil) => None,
        Some(v) => Some(
            v.as_i64()
                .ok_or_else(|| shape("data_parallel_rank", "not an integer"))?,
        ),
    };
    let events = events
        .iter()
        .map(|v| event(v).unwrap_or_else(|e| EngineEvent::Invalid(e.to_string())))
        .collect();
    Ok(EngineBatch {
        ts,
        events,
        dp_rank,
    })
}

/// A struct's fields, from either encoding: by position in `names` (an
/// array, after the tag where there is one) or by name (a map).
struct Fields<'a> {
    array: Option<&'a [Value]>,
    map: Option<&'a [(Value, Value)]>,
    names: &'static [&'static str],
}

impl<'a> Fields<'a> {
    fn of(
        v: &'a Value,
        names: &'static [&'static str],
        what: &'static str,
    ) -> Result<Self, DecodeError> {
        match v {
            Value::Array(a) => Ok(Fields {
                array: Some(a),
                map: None,
                names,
            }),
            Value::Map(m) => Ok(Fields {
                array: None,
                map: Some(m),
                names,
            }),
            _ => Err(shape(what, "neither an array nor a map")),
        }
    }
    /// The `i`-th known field; `None` when absent (a default left out).
    fn get(&self, i: usize) -> Option<&'a Value> {
        if let Some(a) = self.array {
            return a.get(i);
        }
        self.named(self.names.get(i)?)
    }
    /// A field by name (maps only).
    fn named(&self, name: &str) -> Option<&'a Value> {
        self.map?
            .iter()
            .find(|(k, _)| k.as_str() == Some(name))
            .map(|(_, v)| v)
    }
}

const STORED: &[&str] = &[
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
];
const REMOVED: &[&str] = &["block_hashes", "medium", "group_idx"];

fn event(v: &Value) -> Result<EngineEvent, DecodeError> {
    // The tag: an array's first element, or a map's `type`.
    let (tag, body): (&str, Fields<'_>) = match v {
        Value::Array(a) => {
            let tag = a
                .first()
                .and_then(Value::as_str)
                .ok_or_else(|| shape("event", "an array without a tag first"))?;
            let names = names_for(tag);
            (
                tag,
                Fields {
                    array: Some(&a[1..]),
                    map: None,
                    names,
                },
            )
        }
        Value::Map(m) => {
            let tag = m
                .iter()
                .find(|(k, _)| k.as_str() == Some("type"))
                .and_then(|(_, v)| v.as_str())
                .ok_or_else(|| shape("event", "a map without a `type`"))?;
            (
                tag,
                Fields {
                    array: None,
                    map: Some(m),
                    names: names_for(tag),
                },
            )
        }
        _ => return Err(shape("event", "neither an array nor a map")),
    };
    match tag {
        "BlockStored" => {
            let hashes = hash_list(body.get(0), "block_hashes")?;
            let parent = match body.get(1) {
                None | Some(Value::Nil) => None,
                Some(v) => Some(hash(v).ok_or_else(|| shape("parent_block_hash", "not a hash"))?),
            };
            let tokens = body
                .get(2)
                .ok_or_else(|| shape("token_ids", "missing"))?
                .as_array()
                .ok_or_else(|| shape("token_ids", "not an array"))?;
            if tokens.len() > MAX_TOKENS {
                return Err(shape(
                    "token_ids",
                    format!("{} tokens, over {MAX_TOKENS}", tokens.len()),
                ));
            }
            let token_ids = tokens
                .iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| shape("token_ids", "a token id is not a u32"))?;
            let block_size = body
                .get(3)
                .and_then(Value::as_u64)
                .and_then(|b| u32::try_from(b).ok())
                .filter(|b| *b <= MAX_BLOCK_SIZE && (*b > 0 || token_ids.is_empty()))
                .ok_or_else(|| {
                    shape(
                        "block_size",
                        format!("must be 1-{MAX_BLOCK_SIZE} (0 only without tokens)"),
                    )
                })?;
            let lora_id = match body.get(4) {
                None | Some(Value::Nil) => None,
                Some(v) => Some(
                    v.as_i64()
                        .ok_or_else(|| shape("lora_id", "not an integer"))?,
                ),
            };
            Ok(EngineEvent::Stored {
                hashes,
                parent,
                token_ids,
                block_size,
                lora_id,
                medium: text(body.get(5), "medium")?,
                lora_name: text(body.get(6), "lora_name")?,
                group: CacheGroup {
                    idx: group_idx(body.get(8))?,
                    kind: text(body.get(9), "kv_cache_spec_kind")?,
                },
            })
        }
        "BlockRemoved" => Ok(EngineEvent::Removed {
            hashes: hash_list(body.get(0), "block_hashes")?,
            medium: text(body.get(1), "medium")?,
            group: CacheGroup {
                idx: group_idx(body.get(2))?,
                kind: None,
            },
        }),
        "AllBlocksCleared" => Ok(EngineEvent::Cleared),
        other => Ok(EngineEvent::Unknown(other.chars().take(64).collect())),
    }
}

/// How a batch is encoded: msgspec's `array_like` structs, or maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Encoding {
    Array,
    Map,
}

/// Encodes a batch as vLLM does (hashes as unsigned integers; every field
/// written, `None` as nil). [`decode_batch`] reads it back unchanged.
pub fn encode_batch(b: &EngineBatch, enc: Encoding) -> Vec<u8> {
    let s = |x: &str| Value::from(x);
    let opt_s = |x: &Option<String>| x.as_deref().map_or(Value::Nil, Value::from);
    let hashes = |h: &[EngineHash]| Value::Array(h.iter().map(|h| Value::from(h.0)).collect());
    let strukt = |tag: Option<&str>, fields: Vec<(&str, Value)>| -> Value {
        match enc {
            Encoding::Array => {
                let mut a: Vec<Value> = tag.map(s).into_iter().collect();
                a.extend(fields.into_iter().map(|(_, v)| v));
                Value::Array(a)
            }
            Encoding::Map => {
                let mut m: Vec<(Value, Value)> =
                    tag.map(|t| (s("type"), s(t))).into_iter().collect();
                m.extend(fields.into_iter().map(|(k, v)| (s(k), v)));
                Value::Map(m)
            }
        }
    };
    let events = b
        .events
        .iter()
        .map(|e| match e {
            EngineEvent::Stored {
                hashes: h,
                parent,
                token_ids,
                block_size,
                lora_id,
                lora_name,
                medium,
                group,
            } => strukt(
                Some("BlockStored"),
                vec![
                    ("block_hashes", hashes(h)),
                    (
                        "parent_block_hash",
                        parent.map_or(Value::Nil, |p| Value::from(p.0)),
                    ),
                    (
                        "token_ids",
                        Value::Array(token_ids.iter().map(|&t| Value::from(t)).collect()),
                    ),
                    ("block_size", Value::from(*block_size)),
                    ("lora_id", lora_id.map_or(Value::Nil, Value::from)),
                    ("medium", opt_s(medium)),
                    ("lora_name", opt_s(lora_name)),
                    ("extra_keys", Value::Nil),
                    ("group_idx", group.idx.map_or(Value::Nil, Value::from)),
                    ("kv_cache_spec_kind", opt_s(&group.kind)),
                ],
            ),
            EngineEvent::Removed {
                hashes: h,
                medium,
                group,
            } => strukt(
                Some("BlockRemoved"),
                vec![
                    ("block_hashes", hashes(h)),
                    ("medium", opt_s(medium)),
                    ("group_idx", group.idx.map_or(Value::Nil, Value::from)),
                ],
            ),
            EngineEvent::Cleared => strukt(Some("AllBlocksCleared"), vec![]),
            EngineEvent::Unknown(tag) | EngineEvent::Invalid(tag) => strukt(Some(tag), vec![]),
        })
        .collect();
    let batch = strukt(
        None,
        vec![
            ("ts", Value::from(b.ts)),
            ("events", Value::Array(events)),
            (
                "data_parallel_rank",
                b.dp_rank.map_or(Value::Nil, Value::from),
            ),
        ],
    );
    let mut out = Vec::new();
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, &batch);
    out
}

fn names_for(tag: &str) -> &'static [&'static str] {
    match tag {
        "BlockStored" => STORED,
        "BlockRemoved" => REMOVED,
        _ => &[],
    }
}

fn float(v: &Value) -> Option<f64> {
    v.as_f64()
        .or_else(|| v.as_i64().map(|i| i as f64))
        .or_else(|| v.as_u64().map(|u| u as f64))
}

fn hash(v: &Value) -> Option<EngineHash> {
    match v {
        Value::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|s| s as u64))
            .map(EngineHash),
        Value::Binary(b) => Some(EngineHash(xxh3_64(b))),
        _ => None,
    }
}

fn hash_list(v: Option<&Value>, field: &'static str) -> Result<Vec<EngineHash>, DecodeError> {
    let a = v
        .ok_or_else(|| shape(field, "missing"))?
        .as_array()
        .ok_or_else(|| shape(field, "not an array"))?;
    if a.len() > MAX_TOKENS {
        return Err(shape(field, format!("{} hashes", a.len())));
    }
    a.iter()
        .map(|h| hash(h).ok_or_else(|| shape(field, "a hash is neither an integer nor bytes")))
        .collect()
}

fn group_idx(v: Option<&Value>) -> Result<Option<i64>, DecodeError> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(v) => v
            .as_i64()
            .map(Some)
            .ok_or_else(|| shape("group_idx", "not an integer")),
    }
}

fn text(v: Option<&Value>, field: &'static str) -> Result<Option<String>, DecodeError> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(Value::String(s)) => s
            .as_str()
            .map(|s| Some(s.chars().take(256).collect()))
            .ok_or_else(|| shape(field, "not UTF-8")),
        Some(_) => Err(shape(field, "not a string")),
    }
}
