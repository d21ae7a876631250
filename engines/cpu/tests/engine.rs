//! The CPU engine behind the `Engine` trait, on the real SmolLM2-135M GGUF.

use dynamo_bus_schema::blocks::sequence_hashes;
use dynamo_bus_schema::{FinishReason, RequestId, SamplingParams};
use dynamo_cpu_engine::{CpuEngine, CpuEngineConfig, CpuModelInfo};
use dynamo_engine::{Engine, EngineEvent, EngineLimits, KvCacheEventData, ValidRequest};

mod common;
use common::{chat, fixture};

fn engine(cfg: CpuEngineConfig) -> CpuEngine {
    let f = fixture();
    let info = CpuModelInfo {
        block_size: 16,
        hash_salt: f.lm.card.hash_salt,
        eos_token_ids: f.lm.card.eos_token_ids.clone(),
    };
    CpuEngine::start(cfg, f.model.clone(), info).unwrap()
}

fn request(id: u128, prompt: Vec<u32>, sampling: SamplingParams) -> ValidRequest {
    let limits = EngineLimits {
        context_length: 8192,
        vocab_size: 49152,
    };
    ValidRequest::from_parts(RequestId(id), prompt, &sampling, limits).unwrap()
}

#[derive(Debug, PartialEq)]
struct Outcome {
    cached: u32,
    tokens: Vec<u32>,
    reason: FinishReason,
}

async fn run(e: &CpuEngine, req: ValidRequest) -> Outcome {
    collect(e.generate(req).unwrap()).await
}

async fn collect(mut rx: dynamo_engine::ResponseStream) -> Outcome {
    let mut out = Outcome {
        cached: u32::MAX,
        tokens: vec![],
        reason: FinishReason::Unknown(0),
    };
    while let Some(ev) = rx.recv().await {
        match ev {
            EngineEvent::Started { cached_tokens } | EngineEvent::Cached { cached_tokens } => {
                out.cached = cached_tokens
            }
            EngineEvent::Tokens(t) => out.tokens.extend(t),
            EngineEvent::Finished { reason } => {
                out.reason = reason;
                return out;
            }
            EngineEvent::Failed(e) => panic!("{e}"),
        }
    }
    panic!("stream ended without a terminal event");
}

fn text(tokens: &[u32]) -> String {
    fixture().tok.decode(tokens).unwrap()
}

#[tokio::test]
async fn greedy_chat_answer_is_stable_across_runs_and_engines() {
    let prompt = chat(None, "What is the capital of France?");
    let a = run(
        &engine(CpuEngineConfig::default()),
        request(1, prompt.clone(), SamplingParams::greedy(24)),
    )
    .await;
    let b = run(
        &engine(CpuEngineConfig::default()),
        request(1, prompt, SamplingParams::greedy(24)),
    )
    .await;
    assert_eq!(a, b);
    assert_eq!(a.reason, FinishReason::Stop, "ends with <|im_end|>");
    assert_eq!(text(&a.tokens), "The capital of France is Paris.");
}

#[tokio::test]
async fn answers_simple_factual_questions() {
    let e = engine(CpuEngineConfig::default());
    for (i, (q, want)) in [
        ("What is the capital of France?", "Paris"),
        ("What is the capital of Japan?", "Tokyo"),
        ("What color is the sky on a clear day?", "blue"),
        ("What is the largest ocean on Earth?", "Pacific"),
        ("What is the chemical symbol for water?", "H2O"),
        ("What language is spoken in Spain?", "Spanish"),
        ("How many days are in a week?", "7"),
    ]
    .into_iter()
    .enumerate()
    {
        let out = run(
            &e,
            request(i as u128, chat(None, q), SamplingParams::greedy(48)),
        )
        .await;
        let answer = text(&out.tokens);
        assert!(
            answer.to_lowercase().contains(&want.to_lowercase()),
            "{q} → {answer:?} (expected {want})"
        );
    }
}

#[tokio::test]
async fn a_prefix_cache_hit_gives_the_same_continuation_as_a_miss() {
    let system = "You are a careful assistant. Answer in one short sentence, \
                  and never add anything the user did not ask for. "
        .repeat(3);
    let prompt = chat(Some(&system), "Which planet is known as the red planet?");
    let e = engine(CpuEngineConfig::default());
    let miss = run(&e, request(1, prompt.clone(), SamplingParams::greedy(16))).await;
    assert_eq!(miss.cached, 0);
    let hit = run(&e, request(2, prompt.clone(), SamplingParams::greedy(16))).await;
    assert_eq!(hit.cached as usize, (prompt.len() - 1) / 16 * 16);
    assert!(hit.cached > 64);
    assert_eq!(hit.tokens, miss.tokens);
    // A different question behind the same system prompt reuses its blocks too.
    let other = chat(Some(&system), "What is two plus two?");
    let partial = run(&e, request(3, other, SamplingParams::greedy(4))).await;
    assert!(partial.cached >= 64, "{}", partial.cached);
}

#[tokio::test]
async fn batched_generation_equals_generating_each_alone() {
    let prompts: Vec<Vec<u32>> = [
        "Write a haiku about the sea.",
        "List three fruits.",
        "What is the boiling point of water?",
        "Say hello in French.",
    ]
    .iter()
    .map(|q| chat(None, q))
    .collect();
    let cfg = CpuEngineConfig {
        enable_prefix_caching: false,
        ..CpuEngineConfig::default()
    };
    let alone_engine = engine(cfg.clone());
    let mut alone = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        alone.push(
            run(
                &alone_engine,
                request(i as u128, p.clone(), SamplingParams::greedy(20)),
            )
            .await,
        );
    }
    // Small token budget: prefills are chunked and interleave with decodes.
    let batched_engine = engine(CpuEngineConfig {
        max_num_batched_tokens: 24,
        ..cfg
    });
    // Every request is queued before the first step runs, so they share steps.
    let streams: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            batched_engine
                .generate(request(
                    10 + i as u128,
                    p.clone(),
                    SamplingParams::greedy(20),
                ))
                .unwrap()
        })
        .collect();
    let mut batched = Vec::new();
    for rx in streams {
        batched.push(collect(rx).await);
    }
    assert_eq!(batched, alone);
}

#[tokio::test]
async fn seeded_sampling_is_reproducible() {
    let prompt = chat(None, "Tell me a short story about a cat.");
    let sampling = |seed| SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        top_k: 40,
        seed: Some(seed),
        ..SamplingParams::greedy(24)
    };
    let e = engine(CpuEngineConfig::default());
    let a = run(&e, request(1, prompt.clone(), sampling(7))).await;
    let b = run(&e, request(2, prompt.clone(), sampling(7))).await;
    let c = run(&e, request(3, prompt, sampling(8))).await;
    assert_eq!(a.tokens, b.tokens);
    assert_ne!(a.tokens, c.tokens);
}

/// `b` announced `hashes` as one stored chain, and serves `prompt` from
/// them with the tokens `first` got by computing it.
async fn stored_then_served(
    b: &CpuEngine,
    events: &mut dynamo_engine::KvEventStream,
    hashes: &[dynamo_bus_schema::blocks::SequenceHash],
    prompt: &[u32],
    first: &Outcome,
) {
    match events.recv().await.unwrap().data {
        KvCacheEventData::Stored { parent, blocks } => {
            assert_eq!(parent, None);
            assert_eq!(blocks, hashes);
        }
        other => panic!("{other:?}"),
    }
    let second = run(b, request(2, prompt.to_vec(), SamplingParams::greedy(12))).await;
    assert_eq!(second.cached as usize, (prompt.len() - 1) / 16 * 16);
    assert_eq!(second.tokens, first.tokens);
}

#[tokio::test]
async fn kv_blocks_move_between_engines_as_bytes() {
    let prompt = chat(Some(&"Be brief. ".repeat(20)), "Name a large animal.");
    let a = engine(CpuEngineConfig::default());
    let first = run(&a, request(1, prompt.clone(), SamplingParams::greedy(12))).await;
    let hashes = sequence_hashes(&prompt, 16, fixture().lm.card.hash_salt);
    let blocks = a.export_blocks(hashes.clone()).unwrap().await.unwrap();
    assert_eq!(blocks.len(), hashes.len());

    let b = engine(CpuEngineConfig::default());
    let mut events = b.take_kv_events().unwrap();
    let stored = b.import_blocks(blocks).unwrap().await.unwrap().unwrap();
    assert_eq!(stored, hashes.len());
    stored_then_served(&b, &mut events, &hashes, &prompt, &first).await;
    // Bad bytes are refused, not stored.
    let bad = dynamo_cpu_engine::KvBlockData {
        hash: dynamo_bus_schema::blocks::SequenceHash(1),
        parent: None,
        bytes: vec![0; 3],
    };
    assert!(b.import_blocks(vec![bad]).unwrap().await.unwrap().is_err());
}

#[tokio::test]
async fn blocks_written_into_reserved_pool_blocks_serve_like_computed_ones() {
    let prompt = chat(Some(&"Be brief. ".repeat(20)), "Name a large animal.");
    let a = engine(CpuEngineConfig::default());
    let first = run(&a, request(1, prompt.clone(), SamplingParams::greedy(12))).await;
    let hashes = sequence_hashes(&prompt, 16, fixture().lm.card.hash_salt);
    let blocks = a.export_blocks(hashes.clone()).unwrap().await.unwrap();

    let b = engine(CpuEngineConfig::default());
    let mut events = b.take_kv_events().unwrap();
    let r = b
        .reserve_blocks(hashes.len())
        .unwrap()
        .await
        .unwrap()
        .unwrap();
    assert_eq!(r.blocks.len(), hashes.len());
    assert_eq!(b.load().kv_used_blocks as usize, hashes.len());
    // A peer's writes: each block's bytes straight into its pool block.
    let arena = b.kv_arena();
    assert_eq!(arena.block_bytes(), b.kv_block_bytes());
    for (blk, data) in r.blocks.iter().zip(&blocks) {
        // SAFETY: the blocks are reserved for this test, which writes them
        // before committing.
        assert!(unsafe { arena.write_block(*blk as usize, &data.bytes) });
    }
    let stored = b
        .commit_blocks(r.id, None, hashes.clone())
        .unwrap()
        .await
        .unwrap()
        .unwrap();
    assert_eq!(stored, hashes.len());
    stored_then_served(&b, &mut events, &hashes, &prompt, &first).await;
    // The committed blocks are the pool's own: exporting them gives the bytes written.
    let back = b.export_blocks(hashes.clone()).unwrap().await.unwrap();
    assert_eq!(back, blocks);

    // A released reservation frees its blocks and stores nothing.
    let r = b.reserve_blocks(2).unwrap().await.unwrap().unwrap();
    b.release_blocks(r.id);
    assert!(b
        .commit_blocks(r.id, None, vec![])
        .unwrap()
        .await
        .unwrap()
        .is_err());
    assert_eq!(b.load().kv_used_blocks, 0);
    // More blocks than the pool has are refused.
    let too_many = CpuEngineConfig::default().num_blocks as usize + 1;
    assert!(matches!(
        b.reserve_blocks(too_many).unwrap().await.unwrap(),
        Err(dynamo_engine::EngineError::Overloaded(_))
    ));
    // A reservation nobody waits for any more is given back at once.
    drop(b.reserve_blocks(3).unwrap());
    let r = b.reserve_blocks(1).unwrap().await.unwrap().unwrap();
    assert_eq!(b.load().kv_used_blocks, 1);
    b.release_blocks(r.id);
}

#[tokio::test]
async fn cancel_and_drop_free_blocks_and_stop_fails_the_rest() {
    let e = engine(CpuEngineConfig::default());
    let mut rx = e
        .generate(request(
            1,
            chat(None, "Count to one hundred."),
            SamplingParams::greedy(200),
        ))
        .unwrap();
    assert!(matches!(rx.recv().await, Some(EngineEvent::Started { .. })));
    assert!(matches!(rx.recv().await, Some(EngineEvent::Tokens(_))));
    e.cancel(RequestId(1));
    let mut last = None;
    while let Some(ev) = rx.recv().await {
        last = Some(ev);
    }
    assert_eq!(
        last,
        Some(EngineEvent::Finished {
            reason: FinishReason::Cancelled
        })
    );
    let snapshot = e.kv_snapshot().unwrap().await.unwrap();
    assert!(!snapshot.blocks.is_empty(), "prompt blocks stay cached");
    assert_eq!(e.load().kv_used_blocks, 0);

    let mut rx = e
        .generate(request(
            2,
            chat(None, "Count to ten."),
            SamplingParams::greedy(200),
        ))
        .unwrap();
    assert!(matches!(rx.recv().await, Some(EngineEvent::Started { .. })));
    drop(e);
    let mut last = None;
    while let Some(ev) = rx.recv().await {
        last = Some(ev);
    }
    assert!(matches!(last, Some(EngineEvent::Failed(_))), "{last:?}");
}

#[tokio::test]
async fn preempted_sequences_recompute_to_the_same_tokens() {
    let prompts: Vec<Vec<u32>> = [
        "Describe a forest.",
        "Describe a desert.",
        "Describe a city.",
    ]
    .iter()
    .map(|q| chat(None, q))
    .collect();
    let sampling = || {
        let mut s = SamplingParams::greedy(40);
        s.ignore_eos = true;
        s
    };
    let roomy = engine(CpuEngineConfig::default());
    let mut alone = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        alone.push(run(&roomy, request(i as u128, p.clone(), sampling())).await);
    }
    // Each request needs 5 blocks of 16 by its end; 12 blocks cannot hold all three.
    let tight = engine(CpuEngineConfig {
        num_blocks: 12,
        enable_prefix_caching: false,
        ..CpuEngineConfig::default()
    });
    let streams: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            tight
                .generate(request(10 + i as u128, p.clone(), sampling()))
                .unwrap()
        })
        .collect();
    let mut squeezed = Vec::new();
    for rx in streams {
        squeezed.push(collect(rx).await);
    }
    for (a, b) in alone.iter().zip(&squeezed) {
        assert_eq!(a.tokens, b.tokens);
    }
    assert_eq!(tight.load().kv_used_blocks, 0);
}

/// Runs prompt A, then enough other prompts to evict A's blocks from the
/// pool, then A again; returns the two runs of A and the engine's stats
/// around the second one.
async fn evict_and_ask_again(
    cfg: CpuEngineConfig,
) -> (
    Outcome,
    Outcome,
    dynamo_cpu_engine::CpuStats,
    dynamo_cpu_engine::CpuStats,
) {
    let e = engine(cfg);
    let a = chat(Some(&"Be precise and calm. ".repeat(30)), "Name a planet.");
    let first = run(&e, request(1, a.clone(), SamplingParams::greedy(8))).await;
    for (i, topic) in ["Name a river.", "Name a colour."].iter().enumerate() {
        let other = chat(Some(&format!("{topic} Use one word. ").repeat(30)), topic);
        run(
            &e,
            request(10 + i as u128, other, SamplingParams::greedy(2)),
        )
        .await;
    }
    let before = e.stats().unwrap().await.unwrap();
    let second = run(&e, request(2, a.clone(), SamplingParams::greedy(8))).await;
    let after = e.stats().unwrap().await.unwrap();
    (first, second, before, after)
}

#[tokio::test]
async fn a_prompt_evicted_to_host_memory_is_onboarded_not_recomputed() {
    let cfg = CpuEngineConfig {
        num_blocks: 24,
        offload_host_blocks: 64,
        ..CpuEngineConfig::default()
    };
    let (first, second, before, after) = evict_and_ask_again(cfg).await;
    let host = after.offload.expect("tiers configured");
    // A's blocks were evicted to host memory and came back from there.
    assert!(before.offload.unwrap().offloaded > 0);
    assert!(host.onboarded_host > 0, "{host:?}");
    assert!(
        second.cached >= 16 * host.onboarded_host as u32,
        "cached {}",
        second.cached
    );
    // Only the uncached tail and the decode steps were computed.
    let computed = after.computed_tokens - before.computed_tokens;
    assert!(
        computed <= 16 + 8,
        "computed {computed} positions for a prompt served from host memory"
    );
    assert_eq!(second.tokens, first.tokens);
}

#[tokio::test]
async fn host_memory_spills_to_disk_and_disk_blocks_come_back_too() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = CpuEngineConfig {
        num_blocks: 24,
        offload_host_blocks: 4,
        offload_disk_blocks: 128,
        offload_disk_dir: Some(dir.path().to_path_buf()),
        ..CpuEngineConfig::default()
    };
    let (first, second, before, after) = evict_and_ask_again(cfg).await;
    let tiers = after.offload.expect("tiers configured");
    assert!(tiers.onboarded_disk > 0, "{tiers:?}");
    assert_eq!(tiers.disk_errors, 0);
    assert!(after.computed_tokens - before.computed_tokens <= 16 + 8);
    assert_eq!(second.tokens, first.tokens);
}
