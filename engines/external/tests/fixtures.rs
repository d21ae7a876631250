//! The decoder against byte fixtures written by msgspec from vLLM's and
//! SGLang's published event definitions (`tests/fixtures/make_fixtures.py`),
//! in both encodings, and a round-trip property test.

use dynamo_external_engine::events::{
    decode_batch, encode_batch, CacheGroup, Encoding, EngineBatch, EngineEvent, EngineHash,
};
use proptest::prelude::*;

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");

fn fixture(name: &str) -> EngineBatch {
    let bytes = std::fs::read(format!("{DIR}/{name}.msgpack")).expect("fixture");
    decode_batch(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn every_fixture_decodes_to_what_it_holds() {
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(format!("{DIR}/expected.json")).unwrap())
            .unwrap();
    let cases = expected.as_object().unwrap();
    assert!(
        cases.len() >= 7,
        "fixtures for both encodings and both engines"
    );
    for (name, want) in cases {
        let b = fixture(name);
        assert_eq!(b.ts, want["ts"].as_f64().unwrap(), "{name}");
        assert_eq!(b.dp_rank, want["dp_rank"].as_i64(), "{name}");
        assert_eq!(b.events.len(), 3, "{name}");
        let EngineEvent::Stored {
            hashes,
            parent,
            token_ids,
            block_size,
            medium,
            ..
        } = &b.events[0]
        else {
            panic!("{name}: first event is not BlockStored: {:?}", b.events[0]);
        };
        assert_eq!(hashes.len() as u64, want["stored_hashes"].as_u64().unwrap());
        assert_eq!(token_ids.len() as u64, want["tokens"].as_u64().unwrap());
        assert_eq!((*parent, *block_size), (None, 16), "{name}");
        assert_eq!(token_ids[0], 100);
        if want["signed"].as_bool().unwrap() {
            // -5 as the same 64 bits.
            assert_eq!(hashes[0], EngineHash(-5i64 as u64), "{name}");
        } else if !want["bytes"].as_bool().unwrap() {
            assert_eq!(hashes[..], [EngineHash(11), EngineHash(12)], "{name}");
        } else {
            assert_ne!(hashes[0], hashes[1], "{name}: distinct byte hashes");
        }
        match &b.events[1] {
            EngineEvent::Removed {
                hashes: r,
                medium: m,
                group,
            } => {
                assert_eq!(*group, CacheGroup::default(), "{name}");
                assert_eq!(r[..], hashes[1..], "{name}");
                assert_eq!(m.as_deref(), want["removed_medium"].as_str(), "{name}");
            }
            other => panic!("{name}: {other:?}"),
        }
        if want["removed_medium"].is_string() {
            assert_eq!(medium.as_deref(), Some("GPU"), "{name}");
        }
        assert_eq!(b.events[2], EngineEvent::Cleared, "{name}");
    }
}

#[test]
fn bad_payloads_are_errors_that_name_the_field() {
    assert!(decode_batch(b"").is_err());
    assert!(decode_batch(&[0xc1]).is_err());
    let good = std::fs::read(format!("{DIR}/vllm_array.msgpack")).unwrap();
    // Truncated anywhere: an error, never a panic.
    for n in 0..good.len() {
        assert!(decode_batch(&good[..n]).is_err(), "prefix of {n} bytes");
    }
    let mut trailing = good.clone();
    trailing.push(0);
    assert!(decode_batch(&trailing).is_err());
    // Tokens in blocks of 0.
    let b = EngineBatch {
        ts: 1.0,
        events: vec![EngineEvent::Stored {
            hashes: vec![EngineHash(1)],
            parent: None,
            token_ids: vec![1, 2, 3],
            block_size: 0,
            lora_id: None,
            lora_name: None,
            medium: None,
            group: CacheGroup::default(),
        }],
        dp_rank: None,
    };
    // One bad event is skipped with its reason; the batch stands.
    let mut two = b.clone();
    two.events.push(EngineEvent::Cleared);
    let got = decode_batch(&encode_batch(&two, Encoding::Map)).unwrap();
    match &got.events[..] {
        [EngineEvent::Invalid(why), EngineEvent::Cleared] => {
            assert!(why.contains("block_size"), "{why}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_unknown_event_type_is_kept_by_name() {
    let b = EngineBatch {
        ts: 2.0,
        events: vec![
            EngineEvent::Unknown("BlockPinned".into()),
            EngineEvent::Cleared,
        ],
        dp_rank: Some(3),
    };
    for enc in [Encoding::Array, Encoding::Map] {
        assert_eq!(decode_batch(&encode_batch(&b, enc)).unwrap(), b);
    }
}

fn group() -> impl Strategy<Value = CacheGroup> {
    (
        prop::option::of(0i64..4),
        prop::option::of(prop::sample::select(vec![
            "full_attention",
            "sliding_window",
            "mamba",
        ])),
    )
        .prop_map(|(idx, kind)| CacheGroup {
            idx,
            kind: kind.map(String::from),
        })
}

fn event() -> impl Strategy<Value = EngineEvent> {
    let medium = prop::option::of(prop::sample::select(vec!["GPU", "CPU", "DISK"]))
        .prop_map(|m| m.map(String::from));
    prop_oneof![
        (
            prop::collection::vec(any::<u64>(), 0..5),
            prop::option::of(any::<u64>()),
            1u32..64,
            prop::option::of(0i64..5),
            prop::option::of("[a-z]{1,8}"),
            medium.clone(),
            any::<u32>(),
            group(),
        )
            .prop_map(|(h, parent, bs, lora_id, lora_name, medium, seed, group)| {
                let n = h.len() * bs as usize;
                EngineEvent::Stored {
                    hashes: h.into_iter().map(EngineHash).collect(),
                    parent: parent.map(EngineHash),
                    token_ids: (0..n as u32)
                        .map(|i| i.wrapping_mul(seed) % 50_000)
                        .collect(),
                    block_size: bs,
                    lora_id,
                    lora_name,
                    medium,
                    group,
                }
            }),
        (
            prop::collection::vec(any::<u64>(), 0..5),
            medium,
            prop::option::of(0i64..4)
        )
            .prop_map(|(h, medium, idx)| EngineEvent::Removed {
                hashes: h.into_iter().map(EngineHash).collect(),
                medium,
                // A removal names its group's index only.
                group: CacheGroup { idx, kind: None },
            }),
        Just(EngineEvent::Cleared),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, rng_seed: proptest::test_runner::RngSeed::Fixed(17), ..ProptestConfig::default() })]
    #[test]
    fn both_encodings_round_trip(
        events in prop::collection::vec(event(), 0..8),
        ts in 0.0f64..2e9,
        dp_rank in prop::option::of(0i64..64),
    ) {
        let b = EngineBatch { ts, events, dp_rank };
        for enc in [Encoding::Array, Encoding::Map] {
            prop_assert_eq!(&decode_batch(&encode_batch(&b, enc)).unwrap(), &b);
        }
    }
}

#[test]
fn a_hybrid_models_groups_decode_and_only_full_attention_is_indexed() {
    use dynamo_external_engine::translate::Translator;
    for name in [
        "vllm_hybrid_array",
        "vllm_hybrid_map",
        "vllm_hybrid_copy_counts_array",
        "vllm_hybrid_locality_array",
    ] {
        let b = fixture(name);
        assert_eq!(b.events.len(), 4, "{name}");
        let groups: Vec<CacheGroup> = b
            .events
            .iter()
            .map(|e| match e {
                EngineEvent::Stored { group, .. } | EngineEvent::Removed { group, .. } => {
                    group.clone()
                }
                other => panic!("{name}: {other:?}"),
            })
            .collect();
        let g = |idx, kind: Option<&str>| CacheGroup {
            idx: Some(idx),
            kind: kind.map(String::from),
        };
        assert_eq!(
            groups,
            [
                g(0, Some("sliding_window")),
                g(1, Some("full_attention")),
                // Removals name the index only; what some releases put
                // after it (copy counts, a locality) is not a kind.
                g(0, None),
                g(1, None),
            ],
            "{name}"
        );
        // Translated: the sliding window's store and removal change
        // nothing, though its hashes are full attention's; full
        // attention's store gives our two blocks and its removal takes the
        // second.
        let mut tr = Translator::new("m", 16);
        let out: Vec<_> = b.events.iter().map(|e| tr.translate(e)).collect();
        assert!(out[0].is_empty() && out[2].is_empty(), "{name}");
        assert_eq!((out[1].len(), out[3].len()), (1, 1), "{name}");
        assert_eq!(tr.snapshot().blocks.len(), 1, "{name}");
        assert_eq!(tr.skipped.other_group, 2, "{name}");
    }
}

#[test]
fn vllms_offloading_connector_copies_known_blocks_to_host() {
    use dynamo_engine::KvTier;
    use dynamo_external_engine::translate::Translator;
    let b = fixture("vllm_offload_map");
    let mut tr = Translator::new("m", 16);
    let out: Vec<_> = b.events.iter().map(|e| tr.translate(e)).collect();
    assert_eq!(tr.skipped.total(), 0, "{:?}", tr.skipped);
    // Two blocks of ours on the GPU, the second copied to CPU, then gone
    // from the GPU: one on each tier.
    assert_eq!(out[1].len(), 1);
    assert_eq!(out[1][0].tier, KvTier::Host);
    let snap = tr.snapshot();
    assert_eq!(snap.blocks.len(), 1);
    assert_eq!(snap.offloaded.len(), 1);
    assert_eq!(snap.offloaded[0].0, KvTier::Host);
    assert_eq!(snap.offloaded[0].1.len(), 1);
    assert_ne!(snap.blocks[0], snap.offloaded[0].1[0]);
}
