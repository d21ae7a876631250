//! The forward pass on the real SmolLM2-135M-Instruct GGUF.

use dynamo_batcher::BlockIdx;
use dynamo_cpu_engine::kv::KvCache;
use dynamo_cpu_engine::model::{Batch, BatchRow};
use dynamo_cpu_engine::pool::ThreadPool;
use dynamo_cpu_engine::reference::ReferenceRun;

mod common;
use common::{chat, fixture};

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

#[test]
fn paged_forward_matches_the_contiguous_reference() {
    let f = fixture();
    let pool = ThreadPool::new(2).unwrap();
    let prompt = chat(None, "Name three primary colours.");
    let n = prompt.len();
    // Blocks deliberately out of order.
    let table: Vec<BlockIdx> = [5u32, 2, 7, 0, 3, 1, 4, 6]
        .iter()
        .map(|&b| BlockIdx(b))
        .collect();
    let mut kv = KvCache::new(f.model.w.cfg.n_layers, 8, 16, f.model.w.cfg.kv_dim()).unwrap();
    let split = 19;
    let mut paged = Vec::new();
    for (lo, hi) in [(0, split), (split, n)] {
        let batch = Batch {
            rows: (lo..hi)
                .map(|p| BatchRow {
                    token: prompt[p],
                    pos: p,
                    seq: 0,
                })
                .collect(),
            tables: vec![&table],
            logits_for: (0..hi - lo).collect(),
        };
        paged.extend(f.model.forward(&pool, &mut kv, &batch));
    }
    let vocab = f.model.w.cfg.vocab;
    let mut reference = ReferenceRun::new(&f.model);
    for (p, &t) in prompt.iter().enumerate() {
        let want = reference.push(t);
        let got = &paged[p * vocab..(p + 1) * vocab];
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = want
            .iter()
            .zip(got)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            diff <= 1e-3 * scale,
            "position {p}: max diff {diff} (scale {scale})"
        );
        assert_eq!(argmax(&want), argmax(got), "position {p}");
    }
}

#[test]
fn weights_from_the_files_bytes_give_the_same_logits() {
    use dynamo_cpu_engine::{Model, Weights};
    let path = dynamo_model::locate_default_gguf().expect("model installed (make deps)");
    let bytes = bytes::Bytes::from(std::fs::read(&path).unwrap());
    let w = Weights::from_gguf_bytes(bytes.clone(), "in memory").unwrap();
    let f = fixture();
    assert_eq!(w.cfg, f.model.w.cfg);
    assert_eq!(w.bytes(), f.model.w.bytes());
    // The weights are the given bytes, not a copy of them.
    let held = bytes.as_ptr_range();
    for m in [&w.embed, &w.output, &w.layers[0].wq] {
        let row = w.row(m, m.rows - 1).as_ptr_range();
        assert!(held.start <= row.start && row.end <= held.end);
    }
    let m = Model::new(w);
    let (mut a, mut b) = (ReferenceRun::new(&m), ReferenceRun::new(&f.model));
    for &t in &chat(None, "Hi")[..4] {
        assert_eq!(a.push(t), b.push(t));
    }
    // Torn copies are errors, not panics.
    for cut in [0, 100, 4096, bytes.len() / 2] {
        assert!(
            Weights::from_gguf_bytes(bytes.slice(..cut), "torn").is_err(),
            "{cut}"
        );
    }
}
