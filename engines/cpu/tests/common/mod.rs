//! The real SmolLM2-135M-Instruct model, loaded once per test binary.

use dynamo_cpu_engine::{Model, Weights};
use dynamo_model::{ChatMessage, LoadedModel, Preprocessor, Tokenizer};
use std::sync::{Arc, OnceLock};

pub struct Fixture {
    pub model: Arc<Model>,
    pub pre: Preprocessor,
    #[allow(dead_code)] // the forward test does not decode
    pub tok: Tokenizer,
    #[allow(dead_code)] // the forward test needs no model card
    pub lm: LoadedModel,
}

pub fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let path = dynamo_model::locate_default_gguf().expect("model installed (make deps)");
        let lm = LoadedModel::from_gguf(&path, "smollm2", 16).unwrap();
        Fixture {
            model: Arc::new(Model::new(Weights::load(&path).unwrap())),
            pre: Preprocessor::new(lm.card.clone(), &lm.tokenizer_json).unwrap(),
            tok: Tokenizer::from_json(&lm.tokenizer_json).unwrap(),
            lm,
        }
    })
}

/// Token ids of a chat: an optional system message, then one user message.
pub fn chat(system: Option<&str>, text: &str) -> Vec<u32> {
    let mut m = Vec::new();
    if let Some(s) = system {
        m.push(ChatMessage {
            role: "system".into(),
            content: s.into(),
        });
    }
    m.push(ChatMessage {
        role: "user".into(),
        content: text.into(),
    });
    fixture().pre.chat_prompt(&m).unwrap()
}
