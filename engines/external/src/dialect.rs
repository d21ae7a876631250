//! What a request looks like to each engine's HTTP API, and what its
//! streamed chunks mean, as pure functions (the engine task does the I/O).
//!
//! A prompt always goes as token ids, and output always comes back as token
//! ids, so our tokenizer and the router's block hashes stay the truth:
//! - llama.cpp: `POST /completion {prompt: [ids], return_tokens: true}`,
//!   chunks `{tokens, stop, stop_type, timings.cache_n}`;
//! - vLLM / TensorRT-LLM: `POST /v1/completions {prompt: [ids],
//!   return_token_ids: true}`, chunks `{choices[0].token_ids,
//!   finish_reason}`, `usage.prompt_tokens_details.cached_tokens`;
//! - SGLang: `POST /generate {input_ids}`, chunks `{output_ids,
//!   meta_info.finish_reason.type, meta_info.cached_tokens}`; its
//!   `output_ids` are cumulative unless the server streams increments,
//!   which `meta_info.completion_tokens` tells apart.
//!
//! With `prompt = "text"` ([`crate::config::PromptForm::Text`]) the prompt
//! goes as our text instead (`prompt: "…"`, SGLang's `text`; vLLM is told
//! `add_special_tokens: false`, since the text already holds them), and a
//! chunk's text without ids is handed to the engine task to encode again.
//!
//! Invariants: every token handed out is inside the vocabulary; with token
//! prompts, a chunk that carries text but no token ids is an error, never
//! re-tokenized.

use crate::config::Api;
use dynamo_bus_schema::FinishReason;
use dynamo_engine::ValidRequest;
use serde_json::{json, Value};
use thiserror::Error;

/// What one chunk said.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Chunk {
    pub tokens: Vec<u32>,
    pub finish: Option<FinishReason>,
    /// Prompt tokens the engine served from its prefix cache.
    pub cached_tokens: Option<u32>,
    /// The stream's end marker (`[DONE]`).
    pub done: bool,
    /// Tokens the engine says it generated so far (llama.cpp's
    /// `tokens_predicted`), to catch ids it did not stream.
    pub generated: Option<usize>,
    /// The text the chunk carries (llama.cpp's `content`).
    pub text: Option<String>,
}

#[derive(Clone, Debug, Error, PartialEq)]
pub enum ChunkError {
    /// The engine reported an error inside the stream.
    #[error("the engine reported: {0}")]
    Engine(String),
    /// The engine gave up on the request itself (vLLM's `abort`).
    #[error("the engine aborted the request")]
    Aborted,
    #[error("unreadable chunk from the engine: {0}")]
    Malformed(String),
}

/// The path and JSON body of a streaming request: the prompt is `text`
/// when given, else the request's token ids.
pub fn request(
    api: Api,
    model: &str,
    req: &ValidRequest,
    text: Option<&str>,
) -> (&'static str, Value) {
    let s = req.sampling();
    let prompt = match text {
        Some(t) => json!(t),
        None => json!(req.prompt()),
    };
    match api {
        Api::LlamaCpp => {
            let mut b = json!({
                "prompt": prompt,
                "n_predict": s.max_tokens,
                "temperature": s.temperature,
                "top_p": s.top_p,
                "top_k": s.top_k,
                // Only what was asked: no min-p cut of llama.cpp's own.
                "min_p": 0.0,
                "stream": true,
                "return_tokens": true,
                "cache_prompt": true,
                // Timings (and `cache_n`) on every chunk, not only the last.
                "timings_per_token": true,
                "ignore_eos": s.ignore_eos,
            });
            if let Some(seed) = s.seed {
                // llama.cpp's seed is 32-bit (0xFFFFFFFF means random).
                b["seed"] = json!((seed % u32::MAX as u64) as u32);
            }
            ("/completion", b)
        }
        Api::OpenAi => {
            let mut b = json!({
                "model": model,
                "prompt": prompt,
                "max_tokens": s.max_tokens,
                "temperature": s.temperature,
                "top_p": s.top_p,
                "stream": true,
                // Usage (and its cached tokens) on every chunk.
                "stream_options": {"include_usage": true, "continuous_usage_stats": true},
                "return_token_ids": true,
                "ignore_eos": s.ignore_eos,
            });
            if s.top_k > 0 {
                b["top_k"] = json!(s.top_k);
            }
            if !s.stop_token_ids.is_empty() {
                b["stop_token_ids"] = json!(s.stop_token_ids);
            }
            if let Some(seed) = s.seed {
                b["seed"] = json!(seed % (i64::MAX as u64));
            }
            if text.is_some() {
                b["add_special_tokens"] = json!(false);
            }
            ("/v1/completions", b)
        }
        Api::Sglang => {
            let mut sp = json!({
                "max_new_tokens": s.max_tokens,
                "temperature": s.temperature,
                "top_p": s.top_p,
                "ignore_eos": s.ignore_eos,
            });
            if s.top_k > 0 {
                sp["top_k"] = json!(s.top_k);
            }
            if !s.stop_token_ids.is_empty() {
                sp["stop_token_ids"] = json!(s.stop_token_ids);
            }
            let mut b = json!({
                "sampling_params": sp,
                "stream": true,
            });
            let key = if text.is_some() { "text" } else { "input_ids" };
            b[key] = prompt;
            if let Some(seed) = s.seed {
                b["sampling_params"]["sampling_seed"] = json!(seed % (i64::MAX as u64));
            }
            ("/generate", b)
        }
    }
}

/// Decodes one request's chunks, in order.
#[derive(Debug)]
pub struct Decoder {
    api: Api,
    vocab: u32,
    /// Output tokens handed out so far.
    seen: usize,
    /// Text without ids is accepted (handed out as `Chunk::text`).
    text_ok: bool,
    /// SGLang's text so far (its `text` is cumulative).
    text_seen: String,
}

fn tokens(v: &Value, vocab: u32) -> Result<Vec<u32>, ChunkError> {
    let Some(a) = v.as_array() else {
        return Err(ChunkError::Malformed("token ids are not an array".into()));
    };
    a.iter()
        .map(|t| match t.as_u64() {
            Some(t) if t < vocab as u64 => Ok(t as u32),
            _ => Err(ChunkError::Malformed(format!(
                "token {t} is outside the vocabulary (size {vocab})"
            ))),
        })
        .collect()
}

/// The token ids of `ids` (absent or null: none); text without them is an
/// error naming `hint`, unless `text_ok`.
fn ids_of(
    ids: Option<&Value>,
    text: Option<&Value>,
    vocab: u32,
    hint: &str,
    text_ok: bool,
) -> Result<Vec<u32>, ChunkError> {
    let toks = match ids {
        None | Some(Value::Null) => Vec::new(),
        Some(t) => tokens(t, vocab)?,
    };
    if !text_ok && toks.is_empty() && text.and_then(Value::as_str).is_some_and(|t| !t.is_empty()) {
        return Err(ChunkError::Malformed(format!(
            "text without token ids: {hint}"
        )));
    }
    Ok(toks)
}

/// An OpenAI-style finish reason (vLLM's, SGLang's).
fn finish_of(reason: Option<&str>) -> Result<Option<FinishReason>, ChunkError> {
    Ok(match reason {
        None => None,
        Some("length") => Some(FinishReason::Length),
        Some("abort") => return Err(ChunkError::Aborted),
        Some(_) => Some(FinishReason::Stop),
    })
}

fn error_message(v: &Value) -> Option<String> {
    let e = v.get("error")?;
    if e.is_null() {
        return None;
    }
    Some(
        e.get("message")
            .and_then(Value::as_str)
            .or_else(|| e.as_str())
            .map(str::to_string)
            .unwrap_or_else(|| e.to_string()),
    )
}

fn cached(v: Option<&Value>) -> Option<u32> {
    v.and_then(Value::as_u64)
        .map(|n| n.min(u32::MAX as u64) as u32)
}

impl Decoder {
    /// `text_ok`: the request went as text, and output text without ids
    /// is handed out to be encoded again.
    pub fn new(api: Api, vocab: u32, text_ok: bool) -> Self {
        Decoder {
            api,
            vocab,
            seen: 0,
            text_ok,
            text_seen: String::new(),
        }
    }

    /// Decodes one event's data.
    pub fn chunk(&mut self, data: &str) -> Result<Chunk, ChunkError> {
        if data.trim() == "[DONE]" {
            return Ok(Chunk {
                done: true,
                ..Default::default()
            });
        }
        let v: Value = serde_json::from_str(data)
            .map_err(|e| ChunkError::Malformed(format!("not JSON: {e}")))?;
        if let Some(m) = error_message(&v) {
            return Err(ChunkError::Engine(m));
        }
        let c = match self.api {
            Api::LlamaCpp => self.llamacpp(&v)?,
            Api::OpenAi => self.openai(&v)?,
            Api::Sglang => self.sglang(&v)?,
        };
        self.seen += c.tokens.len();
        Ok(c)
    }

    fn llamacpp(&self, v: &Value) -> Result<Chunk, ChunkError> {
        let toks = ids_of(
            v.get("tokens"),
            v.get("content"),
            self.vocab,
            "the server ignored return_tokens",
            self.text_ok,
        )?;
        let stop = v.get("stop").and_then(Value::as_bool).unwrap_or(false);
        let finish = stop.then(|| match v.get("stop_type").and_then(Value::as_str) {
            Some("eos") | Some("word") => FinishReason::Stop,
            _ => FinishReason::Length,
        });
        Ok(Chunk {
            tokens: toks,
            finish,
            cached_tokens: cached(v.pointer("/timings/cache_n")),
            done: false,
            // The final chunk counts the end-of-sequence token it may not send.
            text: v.get("content").and_then(Value::as_str).map(str::to_string),
            generated: if stop {
                None
            } else {
                v.get("tokens_predicted")
                    .and_then(Value::as_u64)
                    .map(|n| n as usize)
            },
        })
    }

    fn openai(&self, v: &Value) -> Result<Chunk, ChunkError> {
        let cached_tokens = cached(v.pointer("/usage/prompt_tokens_details/cached_tokens"));
        let Some(choice) = v.get("choices").and_then(|c| c.get(0)) else {
            // The usage chunk after the last choice.
            return Ok(Chunk {
                cached_tokens,
                ..Default::default()
            });
        };
        let toks = ids_of(
            choice.get("token_ids"),
            choice.get("text"),
            self.vocab,
            "the server needs return_token_ids (vLLM >= 0.10.2), or `prompt = \"text\"`",
            self.text_ok,
        )?;
        let finish = finish_of(choice.get("finish_reason").and_then(Value::as_str))?;
        Ok(Chunk {
            tokens: toks,
            finish,
            cached_tokens,
            done: false,
            generated: None,
            text: choice
                .get("text")
                .and_then(Value::as_str)
                .map(str::to_string),
        })
    }

    fn sglang(&mut self, v: &Value) -> Result<Chunk, ChunkError> {
        let meta = v.get("meta_info");
        let ids = ids_of(
            v.get("output_ids"),
            v.get("text"),
            self.vocab,
            "SGLang's /generate sent no output_ids",
            self.text_ok,
        )?;
        // Its text is the whole output so far, unless it streams increments.
        let text = v.get("text").and_then(Value::as_str).map(|t| {
            let new = t
                .strip_prefix(self.text_seen.as_str())
                .unwrap_or(t)
                .to_string();
            self.text_seen = t.to_string();
            new
        });
        let total = meta
            .and_then(|m| m.get("completion_tokens"))
            .and_then(Value::as_u64);
        // Cumulative: the whole output so far; incremental: only what is new.
        let toks = match total {
            Some(n) if n as usize == ids.len() && ids.len() >= self.seen => {
                ids[self.seen..].to_vec()
            }
            _ => ids,
        };
        let finish = finish_of(
            meta.and_then(|m| m.get("finish_reason"))
                .and_then(|f| f.get("type"))
                .and_then(Value::as_str),
        )?;
        Ok(Chunk {
            tokens: toks,
            finish,
            cached_tokens: cached(meta.and_then(|m| m.get("cached_tokens"))),
            done: false,
            generated: None,
            text,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dynamo_bus_schema::{RequestId, SamplingParams};
    use dynamo_engine::EngineLimits;

    fn req() -> ValidRequest {
        let mut s = SamplingParams::greedy(5);
        s.seed = Some(u64::MAX);
        s.stop_token_ids = vec![7];
        s.top_k = 3;
        ValidRequest::from_parts(
            RequestId(1),
            vec![1, 2, 3],
            &s,
            EngineLimits {
                context_length: 100,
                vocab_size: 100,
            },
        )
        .unwrap()
    }

    #[test]
    fn bodies_carry_token_ids_and_sampling() {
        let (p, b) = request(Api::LlamaCpp, "m", &req(), None);
        assert_eq!(p, "/completion");
        assert_eq!(b["prompt"], json!([1, 2, 3]));
        assert_eq!(b["n_predict"], 5);
        assert_eq!(b["return_tokens"], true);
        assert!(b["seed"].as_u64().unwrap() < u32::MAX as u64);
        let (p, b) = request(Api::OpenAi, "m", &req(), None);
        assert_eq!(p, "/v1/completions");
        assert_eq!(b["model"], "m");
        assert_eq!(b["prompt"], json!([1, 2, 3]));
        assert_eq!(b["stop_token_ids"], json!([7]));
        assert_eq!(b["top_k"], 3);
        assert_eq!(b["return_token_ids"], true);
        let (p, b) = request(Api::Sglang, "m", &req(), None);
        assert_eq!(p, "/generate");
        assert_eq!(b["input_ids"], json!([1, 2, 3]));
        assert_eq!(b["sampling_params"]["max_new_tokens"], 5);
    }

    #[test]
    fn llamacpp_chunks() {
        let mut d = Decoder::new(Api::LlamaCpp, 100, false);
        let c = d
            .chunk(r#"{"index":0,"content":"Hi","tokens":[42],"stop":false,"id_slot":0,"tokens_predicted":1}"#)
            .unwrap();
        assert_eq!((c.tokens, c.finish), (vec![42], None));
        let c = d
            .chunk(r#"{"content":"","tokens":[],"stop":true,"stop_type":"limit","timings":{"cache_n":16,"prompt_n":3}}"#)
            .unwrap();
        assert_eq!(c.finish, Some(FinishReason::Length));
        assert_eq!(c.cached_tokens, Some(16));
        let c = d
            .chunk(r#"{"content":"","stop":true,"stop_type":"eos"}"#)
            .unwrap();
        assert_eq!(c.finish, Some(FinishReason::Stop));
        assert!(matches!(
            d.chunk(r#"{"content":"text","stop":false}"#),
            Err(ChunkError::Malformed(_))
        ));
        assert!(matches!(
            d.chunk(r#"{"tokens":[100],"stop":false}"#),
            Err(ChunkError::Malformed(_))
        ));
        assert_eq!(
            d.chunk(r#"{"error":{"code":500,"message":"boom","type":"server_error"}}"#),
            Err(ChunkError::Engine("boom".into()))
        );
        assert!(matches!(d.chunk("not json"), Err(ChunkError::Malformed(_))));
    }

    #[test]
    fn openai_chunks() {
        let mut d = Decoder::new(Api::OpenAi, 100, false);
        let c = d
            .chunk(r#"{"id":"c","object":"text_completion","choices":[{"index":0,"text":"Hi","token_ids":[5,6],"finish_reason":null}]}"#)
            .unwrap();
        assert_eq!((c.tokens, c.finish), (vec![5, 6], None));
        let c = d
            .chunk(r#"{"choices":[{"index":0,"text":"","token_ids":[],"finish_reason":"length"}]}"#)
            .unwrap();
        assert_eq!(c.finish, Some(FinishReason::Length));
        let c = d
            .chunk(r#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":2}}}"#)
            .unwrap();
        assert_eq!(c.cached_tokens, Some(2));
        assert!(d.chunk("[DONE]").unwrap().done);
        assert_eq!(
            d.chunk(r#"{"choices":[{"text":"","finish_reason":"abort"}]}"#),
            Err(ChunkError::Aborted)
        );
        assert!(matches!(
            d.chunk(r#"{"choices":[{"text":"Hi","finish_reason":null}]}"#),
            Err(ChunkError::Malformed(_))
        ));
        assert_eq!(
            d.chunk(r#"{"object":"error","error":{"message":"bad"}}"#),
            Err(ChunkError::Engine("bad".into()))
        );
    }

    #[test]
    fn sglang_cumulative_and_incremental_output() {
        let mut d = Decoder::new(Api::Sglang, 100, false);
        let a = d
            .chunk(r#"{"text":"a","output_ids":[1],"meta_info":{"completion_tokens":1,"finish_reason":null}}"#)
            .unwrap();
        let b = d
            .chunk(r#"{"text":"ab","output_ids":[1,2,3],"meta_info":{"completion_tokens":3,"cached_tokens":4,"finish_reason":{"type":"stop","matched":2}}}"#)
            .unwrap();
        assert_eq!(a.tokens, vec![1]);
        assert_eq!(b.tokens, vec![2, 3]);
        assert_eq!(
            (b.finish, b.cached_tokens),
            (Some(FinishReason::Stop), Some(4))
        );
        let mut d = Decoder::new(Api::Sglang, 100, false);
        d.chunk(r#"{"output_ids":[1,2],"meta_info":{"completion_tokens":2}}"#)
            .unwrap();
        let c = d
            .chunk(r#"{"output_ids":[3],"meta_info":{"completion_tokens":3,"finish_reason":{"type":"length"}}}"#)
            .unwrap();
        assert_eq!((c.tokens, c.finish), (vec![3], Some(FinishReason::Length)));
    }

    #[test]
    fn a_text_prompt_goes_as_text_and_text_output_is_handed_out() {
        let (_, b) = request(Api::LlamaCpp, "m", &req(), Some("<|im_start|>hi"));
        assert_eq!(b["prompt"], "<|im_start|>hi");
        let (_, b) = request(Api::OpenAi, "m", &req(), Some("hi"));
        assert_eq!(
            (&b["prompt"], &b["add_special_tokens"]),
            (&json!("hi"), &json!(false))
        );
        let (_, b) = request(Api::Sglang, "m", &req(), Some("hi"));
        assert_eq!(b["text"], "hi");
        assert!(b.get("input_ids").is_none());
        // A server that returns only text: the text is handed out.
        let mut d = Decoder::new(Api::OpenAi, 100, true);
        let c = d
            .chunk(r#"{"choices":[{"text":"Hi","finish_reason":null}]}"#)
            .unwrap();
        assert_eq!((c.tokens.len(), c.text.as_deref()), (0, Some("Hi")));
        // SGLang's cumulative text, as increments.
        let mut d = Decoder::new(Api::Sglang, 100, true);
        let a = d.chunk(r#"{"text":"He","meta_info":{}}"#).unwrap();
        let b = d.chunk(r#"{"text":"Hello","meta_info":{}}"#).unwrap();
        assert_eq!(
            (a.text.as_deref(), b.text.as_deref()),
            (Some("He"), Some("llo"))
        );
        // Ids, where they come, are still the engine's.
        let mut d = Decoder::new(Api::LlamaCpp, 100, true);
        let c = d
            .chunk(r#"{"content":"x","tokens":[9],"stop":false}"#)
            .unwrap();
        assert_eq!(c.tokens, vec![9]);
    }
}
