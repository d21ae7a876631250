//! Builds a Hugging Face `tokenizer.json` from GGUF tokenizer metadata and
//! wraps the `tokenizers` crate for encoding and incremental decoding.
//! Encoding and decoding take faster paths of our own where the tokenizer's
//! configuration allows (`fast_encode`, `fast_decode`); their output equals
//! the crate's (each module states the invariant and its tests).
//!
//! Supported: `tokenizer.ggml.model = "gpt2"` (byte-level BPE) with the
//! pre-tokenizers llama.cpp calls `gpt2`, `smollm`, `default` and `llama-bpe`
//! approximated by GPT-2's regex (with individual digits for `smollm`).
//! Control tokens (type 3) become special added tokens, user-defined tokens
//! (type 4) plain added tokens. Anything else is a [`TokenizerError`].

use crate::fast_decode::FastDecoder;
use crate::fast_encode::FastEncoder;
use crate::gguf::{GgufMetadata, Value};
use serde_json::{json, Map};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum TokenizerError {
    #[error("GGUF tokenizer field {field}: {reason}")]
    Metadata { field: &'static str, reason: String },
    #[error("tokenizer model {0:?} is not supported (only byte-level BPE, \"gpt2\")")]
    UnsupportedModel(String),
    #[error("cannot build tokenizer: {0}")]
    Build(String),
    #[error("cannot encode text: {0}")]
    Encode(String),
    #[error("cannot decode tokens: {0}")]
    Decode(String),
}

const TOKEN_TYPE_CONTROL: u64 = 3;
const TOKEN_TYPE_USER_DEFINED: u64 = 4;

fn missing(field: &'static str) -> TokenizerError {
    TokenizerError::Metadata {
        field,
        reason: "missing or of the wrong type".into(),
    }
}

/// Serialises an HF `tokenizer.json` for the tokenizer described in `meta`.
pub fn tokenizer_json_from_gguf(meta: &GgufMetadata) -> Result<Vec<u8>, TokenizerError> {
    let model = meta
        .get("tokenizer.ggml.model")
        .and_then(Value::as_str)
        .ok_or(missing("tokenizer.ggml.model"))?;
    if model != "gpt2" {
        return Err(TokenizerError::UnsupportedModel(model.into()));
    }
    let tokens = meta
        .get("tokenizer.ggml.tokens")
        .and_then(Value::as_array)
        .ok_or(missing("tokenizer.ggml.tokens"))?;
    let merges = meta
        .get("tokenizer.ggml.merges")
        .and_then(Value::as_array)
        .ok_or(missing("tokenizer.ggml.merges"))?;
    let types = meta
        .get("tokenizer.ggml.token_type")
        .and_then(Value::as_array);
    let pre = meta
        .get("tokenizer.ggml.pre")
        .and_then(Value::as_str)
        .unwrap_or("default");

    let mut vocab = Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (id, tok) in tokens.iter().enumerate() {
        let tok = tok.as_str().ok_or(TokenizerError::Metadata {
            field: "tokenizer.ggml.tokens",
            reason: format!("entry {id} is not a string"),
        })?;
        vocab.insert(tok.to_string(), json!(id));
        let ty = types
            .and_then(|t| t.get(id))
            .and_then(Value::as_u64)
            .unwrap_or(1);
        if ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED {
            added.push(json!({
                "id": id, "content": tok, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": ty == TOKEN_TYPE_CONTROL,
            }));
        }
    }
    let merges: Vec<&str> = merges.iter().filter_map(Value::as_str).collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let pre_tokenizer = match pre {
        "smollm" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level]}),
        _ => byte_level,
    };
    let doc = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges,
        }
    });
    serde_json::to_vec(&doc).map_err(|e| TokenizerError::Build(e.to_string()))
}

/// A loaded tokenizer.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The same encoding, faster, for the configurations this crate builds.
    fast: Option<FastEncoder>,
    /// The same decoding, faster, for byte-level decoders.
    fast_decode: Option<FastDecoder>,
}

impl Tokenizer {
    /// Loads a tokenizer from `tokenizer.json` bytes.
    pub fn from_json(bytes: &[u8]) -> Result<Self, TokenizerError> {
        let inner = tokenizers::Tokenizer::from_bytes(bytes)
            .map_err(|e| TokenizerError::Build(e.to_string()))?;
        let fast = FastEncoder::for_tokenizer(&inner);
        let fast_decode = FastDecoder::for_tokenizer(&inner);
        Ok(Tokenizer {
            inner,
            fast,
            fast_decode,
        })
    }

    /// Encodes text; special tokens written in the text (e.g. `<|im_start|>`) are recognised.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        if let Some(fast) = &self.fast {
            return fast
                .encode(self.inner.get_model(), text)
                .map_err(TokenizerError::Encode);
        }
        self.inner
            .encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizerError::Encode(e.to_string()))
    }

    /// Decodes ids to text, skipping special tokens.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        if let Some(fast) = &self.fast_decode {
            return Ok(fast.decode(ids, true));
        }
        self.inner
            .decode(ids, true)
            .map_err(|e| TokenizerError::Decode(e.to_string()))
    }

    /// Decodes ids to text, special tokens written out (`<|im_start|>`),
    /// so that [`Tokenizer::encode`] reads them back as special tokens.
    pub fn decode_with_special(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        if let Some(fast) = &self.fast_decode {
            return Ok(fast.decode(ids, false));
        }
        self.inner
            .decode(ids, false)
            .map_err(|e| TokenizerError::Decode(e.to_string()))
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of a token string, if it is in the vocabulary.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// A decoder for one response stream.
    pub fn stream_decoder(&self) -> IncrementalDecoder {
        IncrementalDecoder::default()
    }
}

/// Turns a growing token sequence into text deltas without ever splitting a
/// UTF-8 character: text is only emitted once the bytes decoded so far form
/// complete characters (no trailing U+FFFD).
///
/// Invariant: the concatenation of every delta returned by [`Self::push`]
/// and [`Self::flush`] equals `decode(all ids)` (up to the decoder's
/// treatment of leading spaces in the first window).
#[derive(Debug, Default)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl IncrementalDecoder {
    /// Adds tokens (decoded with `tok`, always the same tokenizer) and returns the newly completed text (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, new_ids: &[u32]) -> Result<String, TokenizerError> {
        self.ids.extend_from_slice(new_ids);
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = tok.decode(&self.ids[self.prefix_offset..])?;
        if full.len() > prefix.len()
            && !full.ends_with('\u{FFFD}')
            && full.is_char_boundary(prefix.len())
        {
            let delta = full[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            Ok(delta)
        } else {
            Ok(String::new())
        }
    }

    /// Emits whatever is still held back (at the end of a stream).
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<String, TokenizerError> {
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = tok.decode(&self.ids[self.prefix_offset..])?;
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        if full.len() > prefix.len() && full.is_char_boundary(prefix.len()) {
            Ok(full[prefix.len()..].to_string())
        } else {
            Ok(String::new())
        }
    }
}
