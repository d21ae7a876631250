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
mod fast_encode;
pub mod gguf;
pub mod template;
pub mod tokenizer;

pub use card::{locate_default_gguf, LoadedModel, ModelError, Preprocessor, DEFAULT_MODEL_NAME};
pub use template::ChatMessage;
pub use tokenizer::{IncrementalDecoder, Tokenizer};
