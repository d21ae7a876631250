//! Pins the encoded bytes of every bus message. If this fails you changed the
//! wire format: if that was deliberate, bump `SCHEMA_VERSION` (or add a new
//! message kind) and regenerate with `UPDATE_SNAPSHOTS=1 cargo test -p dynamo-bus-schema`.

use dynamo_bus_schema::blocks::SequenceHash;
use dynamo_bus_schema::*;
use proptest::prelude::*;

fn card() -> ModelCard {
    ModelCard {
        name: ModelName("smollm2-135m-instruct".into()),
        context_length: 8192,
        block_size: 16,
        chat_template: "{{ messages }}".into(),
        bos_token: Some("<|im_start|>".into()),
        eos_token: Some("<|im_end|>".into()),
        eos_token_ids: vec![2],
        vocab_size: 49152,
        tokenizer: ArtifactRef {
            name: "tokenizer.json".into(),
            len: 1234,
            sha256: "ab".repeat(32),
        },
        source: "model.gguf".into(),
        hash_salt: 1337,
    }
}

fn load() -> LoadMetrics {
    LoadMetrics {
        active_seqs: 3,
        waiting_seqs: 1,
        kv_used_blocks: 100,
        kv_total_blocks: 16384,
        inflight_requests: 4,
    }
}

fn samples() -> Vec<(&'static str, Vec<u8>)> {
    let rid = RequestId(0x0123_4567_89ab_cdef_0011_2233_4455_6677);
    let wid = WorkerId(0xfeed);
    let enc = |r: Result<Vec<u8>, _>| -> Vec<u8> { r.expect("encode") };
    vec![
        (
            "GenerateRequest",
            enc(encode(&GenerateRequest {
                request_id: rid,
                model: ModelName("m".into()),
                token_ids: vec![1, 2, 300, 70000],
                sampling: SamplingParams {
                    max_tokens: 16,
                    temperature: 0.5,
                    top_p: 0.9,
                    top_k: 0,
                    seed: Some(42),
                    stop_token_ids: vec![2],
                    ignore_eos: false,
                },
                reply_to: "dynamo.t.gateway.1.frames".into(),
                deadline_unix_ms: 1_700_000_000_000,
            })),
        ),
        (
            "GenerateAck",
            enc(encode(&GenerateAck {
                request_id: rid,
                worker_id: wid,
                rejected: Some(WireError::new(ErrorKind::Overloaded, "full")),
            })),
        ),
        (
            "ErrorReply",
            enc(encode(&ErrorReply {
                error: WireError::new(ErrorKind::BadMessage, "x"),
            })),
        ),
        (
            "FrameStarted",
            enc(encode(&FrameStarted {
                request_id: rid,
                seq: FrameSeq(0),
                worker_id: wid,
                prompt_tokens: 60,
                cached_tokens: 48,
            })),
        ),
        (
            "FrameTokens",
            enc(encode(&FrameTokens {
                request_id: rid,
                seq: FrameSeq(1),
                token_ids: vec![5, 6, 7],
            })),
        ),
        (
            "FrameFinished",
            enc(encode(&FrameFinished {
                request_id: rid,
                seq: FrameSeq(2),
                reason: FinishReason::Length,
                completion_tokens: 3,
            })),
        ),
        (
            "FrameError",
            enc(encode(&FrameError {
                request_id: rid,
                seq: FrameSeq(2),
                error: WireError::new(ErrorKind::EngineFailed, "gone"),
            })),
        ),
        (
            "FrameHeartbeat",
            enc(encode(&FrameHeartbeat {
                request_id: rid,
                worker_id: wid,
            })),
        ),
        ("DrainRequest", enc(encode(&DrainRequest { resume: true }))),
        (
            "DrainReply",
            enc(encode(&DrainReply {
                worker_id: wid,
                state: WorkerState::Draining,
                inflight: 3,
            })),
        ),
        (
            "CancelRequest",
            enc(encode(&CancelRequest {
                request_id: rid,
                reason: CancelReason::ClientDisconnected,
            })),
        ),
        (
            "LoadReport",
            enc(encode(&LoadReport {
                worker_id: wid,
                generation: 2,
                load: load(),
            })),
        ),
        (
            "WorkerRegistration",
            enc(encode(&WorkerRegistration {
                worker_id: wid,
                generation: 1,
                node_id: NodeId("node-a".into()),
                pid: 4242,
                role: WorkerRole::Aggregated,
                state: WorkerState::Serving,
                engine: "mocker".into(),
                model: card(),
                started_unix_ms: 1,
                heartbeat_unix_ms: 2,
                load: load(),
                kv_events: true,
            })),
        ),
        (
            "NodeRegistration",
            enc(encode(&NodeRegistration {
                node_id: NodeId("node-a".into()),
                pid: 1,
                hostname: "h".into(),
                actors: vec!["gateway".into(), "worker-0".into()],
                http_addr: Some("127.0.0.1:8000".into()),
                started_unix_ms: 1,
                heartbeat_unix_ms: 2,
            })),
        ),
        (
            "ArtifactRequest",
            enc(encode(&ArtifactRequest {
                name: "tokenizer.json".into(),
                offset: 10,
                max_len: 65536,
            })),
        ),
        (
            "ArtifactChunk",
            enc(encode(&ArtifactChunk {
                name: "tokenizer.json".into(),
                total_len: 3,
                offset: 0,
                data: vec![1, 2, 3],
            })),
        ),
        (
            "FaultInjection",
            enc(encode(&FaultInjection {
                worker_id: wid,
                fault: FaultKind::PanicActor,
            })),
        ),
        (
            "KvEventBatch",
            enc(encode(&KvEventBatch {
                worker_id: wid,
                generation: 3,
                events: vec![
                    KvEvent {
                        event_id: EventId(7),
                        kind: KvEventKind::Stored,
                        tier: StorageTier::Device,
                        parent: Some(blocks::SequenceHash(11)),
                        blocks: vec![blocks::SequenceHash(12), blocks::SequenceHash(13)],
                    },
                    KvEvent {
                        event_id: EventId(8),
                        kind: KvEventKind::Cleared,
                        tier: StorageTier::Host,
                        parent: None,
                        blocks: vec![],
                    },
                ],
                published_unix_ms: 1_700_000_000_123,
            })),
        ),
        (
            "KvDumpRequest",
            enc(encode(&KvDumpRequest {
                reason: "gap".into(),
            })),
        ),
        (
            "KvDump",
            enc(encode(&KvDump {
                worker_id: wid,
                generation: 3,
                last_event_id: EventId(8),
                tier: StorageTier::Device,
                blocks: vec![blocks::SequenceHash(12)],
            })),
        ),
        (
            "ActiveLoadEvent",
            enc(encode(&ActiveLoadEvent {
                router_id: RouterId(5),
                request_id: rid,
                worker_id: wid,
                generation: 2,
                kind: ActiveLoadKind::Added,
                prefill_tokens: 900,
                blocks: 57,
            })),
        ),
        (
            "RouterHeartbeat",
            enc(encode(&RouterHeartbeat {
                router_id: RouterId(5),
            })),
        ),
        (
            "ActiveLoadSnapshotRequest",
            enc(encode(&ActiveLoadSnapshotRequest {
                router_id: RouterId(5),
            })),
        ),
        (
            "ActiveLoadSnapshot",
            enc(encode(&ActiveLoadSnapshot { entries: vec![] })),
        ),
        ("RouterInfoRequest", enc(encode(&RouterInfoRequest {}))),
        (
            "RouterInfo",
            enc(encode(&RouterInfo {
                router_id: RouterId(5),
                policy: "kv_aware".into(),
                workers: vec![IndexedWorker {
                    worker_id: wid,
                    blocks: [10, 2, 0],
                    event_lag_ms: 3,
                    inflight: 1,
                    kv_config_mismatch: false,
                }],
                events_applied: 100,
                event_gaps: 1,
                event_duplicates: 2,
                dumps: 3,
            })),
        ),
        (
            "FaultAck",
            enc(encode(&FaultAck {
                applied: true,
                message: "ok".into(),
            })),
        ),
        (
            "GenerateDisagg",
            enc(encode(&GenerateDisagg {
                request: GenerateRequest {
                    request_id: rid,
                    model: ModelName("m".into()),
                    token_ids: vec![1, 2],
                    sampling: SamplingParams::greedy(4),
                    reply_to: "r".into(),
                    deadline_unix_ms: 0,
                },
                prefill_worker: WorkerId(7),
                cached_blocks: 1,
            })),
        ),
        (
            "FrameMux",
            enc(encode(&FrameMux {
                frames: vec![
                    encode(&FrameHeartbeat {
                        request_id: rid,
                        worker_id: wid,
                    })
                    .unwrap(),
                    vec![0xd7, 1, 2, 0, 9],
                ],
            })),
        ),
        (
            "FrameTimings",
            enc(encode(&FrameTimings {
                request_id: rid,
                timings: PhaseTimings {
                    queue_ms: 1.5,
                    prefill_ms: 20.0,
                    transfer_ms: 3.25,
                    first_token_ms: 30.0,
                    prefill_worker: Some(WorkerId(7)),
                    decode_worker: wid,
                    fallback: None,
                },
            })),
        ),
        (
            "FrameUsage",
            enc(encode(&FrameUsage {
                request_id: rid,
                cached_tokens: 48,
            })),
        ),
        (
            "PrefillRequest",
            enc(encode(&PrefillRequest {
                request_id: rid,
                decode_worker: wid,
                model: ModelName("m".into()),
                token_ids: vec![1, 2, 3],
                skip_blocks: 0,
                target: KvTransferTarget {
                    provider: "tcp;ofi_rxm".into(),
                    address: vec![1, 2, 3, 4],
                    block_bytes: 1024,
                    windows: vec![
                        KvWindow {
                            key: 9,
                            base: 0,
                            len: 2048,
                        },
                        KvWindow {
                            key: 10,
                            base: 0x7f00_0000_0000,
                            len: 1024,
                        },
                    ],
                    notify: 0x1234,
                },
                deadline_unix_ms: 1_700_000_000_000,
            })),
        ),
        (
            "PrefillReply",
            enc(encode(&PrefillReply {
                request_id: rid,
                worker_id: WorkerId(7),
                parent: None,
                blocks: vec![SequenceHash(5), SequenceHash(6)],
                queue_ms: 0.5,
                prefill_ms: 10.0,
                transfer_ms: 1.0,
            })),
        ),
        (
            "KvDumpTiered",
            enc(encode(&KvDumpTiered {
                worker_id: wid,
                generation: 3,
                last_event_id: EventId(9),
                tiers: vec![
                    KvTierBlocks {
                        tier: StorageTier::Device,
                        blocks: vec![SequenceHash(1)],
                    },
                    KvTierBlocks {
                        tier: StorageTier::Host,
                        blocks: vec![SequenceHash(2), SequenceHash(3)],
                    },
                ],
            })),
        ),
        (
            "KvIndexSnapshot",
            enc(encode(&KvIndexSnapshot {
                stream_seq: 4242,
                taken_unix_ms: 1_700_000_000_000,
                router_id: RouterId(5),
                workers: vec![KvSnapshotWorker {
                    worker_id: wid,
                    generation: 2,
                    last_event_id: EventId(77),
                }],
                runs: vec![KvSnapshotRun {
                    blocks: vec![SequenceHash(1), SequenceHash(2)],
                    holders: vec![KvSnapshotHolder {
                        worker_id: wid,
                        tiers: 0b101,
                    }],
                }],
            })),
        ),
        (
            "TransferStarting",
            enc(encode(&TransferStarting { request_id: rid })),
        ),
        (
            "ActorFault",
            enc(encode(&ActorFault {
                actor: "router".into(),
                fault: FaultKind::EndTask,
                task: "kv-events".into(),
            })),
        ),
        (
            "ChunkedReply",
            enc(encode(&ChunkedReply {
                stream: 0xabcdef,
                index: 1,
                count: 3,
                data: vec![0xD7, 1, 63, 0],
            })),
        ),
        (
            "DeploymentRecord",
            enc(encode(&DeploymentRecord {
                name: "disagg".into(),
                spec_yaml: "version: 1\n".into(),
                generation: 2,
                updated_unix_ms: 3,
            })),
        ),
        (
            "NodeInventory",
            enc(encode(&NodeInventory {
                registration: NodeRegistration {
                    node_id: NodeId("n1".into()),
                    pid: 1,
                    hostname: "h".into(),
                    actors: vec!["worker-0-0".into()],
                    http_addr: None,
                    started_unix_ms: 1,
                    heartbeat_unix_ms: 2,
                },
                labels: vec![("rack".into(), "r1".into())],
                slots: 4,
                free_slots: 3,
                memory_mib: 1024,
                free_memory_mib: 512,
                controller: true,
                health: "healthy".into(),
                replicas: vec![RunningReplica {
                    key: "d/decode-0".into(),
                    ready: true,
                    stopping: false,
                    generation: 9,
                    error: String::new(),
                    slots: 1,
                    memory_mib: 0,
                }],
            })),
        ),
        (
            "NodeAssignment",
            enc(encode(&NodeAssignment {
                node_id: NodeId("n1".into()),
                epoch: 3,
                replicas: vec![AssignedReplica {
                    key: "d/decode-0".into(),
                    deployment: "d".into(),
                    service: "decode".into(),
                    role: "decode".into(),
                    settings: "{}".into(),
                    slots: 1,
                    memory_mib: 0,
                }],
            })),
        ),
        (
            "ControllerLease",
            enc(encode(&ControllerLease {
                holder: NodeId("n1".into()),
                epoch: 4,
                renewed_unix_ms: 5,
                ttl_ms: 3000,
            })),
        ),
        ("PresenceProbe", enc(encode(&PresenceProbe {}))),
        (
            "DeploymentStatus",
            enc(encode(&DeploymentStatus {
                name: "d".into(),
                generation: 2,
                services: vec![ServiceStatus {
                    name: "decode".into(),
                    role: "decode".into(),
                    desired: 2,
                    placed: 1,
                    ready: 1,
                    pending: vec!["needs 1 slot".into()],
                    placements: vec![("d/decode-0".into(), "n1".into())],
                }],
                events: vec![ClusterEvent {
                    unix_ms: 6,
                    message: "placed".into(),
                }],
                controller: NodeId("n1".into()),
                updated_unix_ms: 7,
            })),
        ),
        (
            "FrontendMetrics",
            enc(encode(&FrontendMetrics {
                gateway: "n1:8000".into(),
                model: ModelName("m".into()),
                unix_ms: 8,
                interval_ms: 1000,
                arrivals: 3,
                finished: 2,
                failed: 1,
                prompts: 3,
                isl_sum: 300,
                osl_sum: 40,
                ttft: vec![0, 1, 2],
                itl: vec![3],
                queue_ms_sum: 9,
                queued_now: 1,
                held_now: 0,
                inflight_now: 2,
                streams_now: 2,
                stream_tokens_now: 30,
            })),
        ),
        (
            "WorkerMetrics",
            enc(encode(&WorkerMetrics {
                worker_id: WorkerId(5),
                generation: 2,
                role: WorkerRole::Decode,
                model: ModelName("m".into()),
                unix_ms: 9,
                interval_ms: 1000,
                active_seqs: 4,
                waiting_seqs: 1,
                kv_used_blocks: 10,
                kv_total_blocks: 100,
                queued_prefill_tokens: 64,
                first_tokens: 2,
                ttft_us_sum: 5000,
                prompt_tokens: 128,
                token_gaps: 30,
                itl_us_sum: 60000,
            })),
        ),
        (
            "PlannerStatus",
            enc(encode(&PlannerStatus {
                deployment: "d".into(),
                holder: NodeId("n1".into()),
                epoch: 2,
                policy: "sla".into(),
                updated_unix_ms: 10,
                targets: vec![PlannerTarget {
                    name: "decode".into(),
                    desired: 2,
                    ready: 1,
                    recommended: 3,
                    pinned: false,
                    reason: "r".into(),
                    numbers: vec![("rate".into(), 1.5)],
                }],
                decisions: vec![PlannerDecision {
                    seq: 1,
                    unix_ms: 11,
                    target: "decode".into(),
                    from: 2,
                    to: 3,
                    rule: "sla".into(),
                    reason: "r".into(),
                    applied: true,
                }],
                memory_json: "{}".into(),
            })),
        ),
        (
            "PlannerPin",
            enc(encode(&PlannerPin {
                deployment: "d".into(),
                target: "decode".into(),
                replicas: 2,
                unix_ms: 12,
            })),
        ),
        (
            "WeightManifest",
            enc(encode(&weights::WeightManifest {
                model: "m".into(),
                sha256: weights::ContentHash([7; 32]),
                layout: "gguf".into(),
                size: 5 << 20,
                chunk_size: 4 << 20,
                chunks: vec![weights::ContentHash([1; 32]), weights::ContentHash([2; 32])],
            })),
        ),
        (
            "WeightSource",
            enc(encode(&weights::WeightSource {
                node: NodeId("n1".into()),
                model: "m".into(),
                sha256: weights::ContentHash([7; 32]),
                layout: "gguf".into(),
                size: 5 << 20,
                state: weights::WeightSourceState::Ready,
                loaded_bytes: 5 << 20,
                provider: "tcp;ofi_rxm".into(),
                address: vec![1, 2, 3],
                region_key: 9,
                region_base: 0,
                updated_unix_ms: 12,
            })),
        ),
    ]
}

#[test]
fn wire_format_matches_snapshot() {
    let rendered: String = samples()
        .into_iter()
        .map(|(name, bytes)| format!("{name} {}\n", hex::encode(bytes)))
        .collect();
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/snapshots/wire_v1.txt");
    if std::env::var_os("UPDATE_SNAPSHOTS").is_some() {
        std::fs::write(path, &rendered).expect("write snapshot");
    }
    let expected = std::fs::read_to_string(path).expect("snapshot file exists");
    for (want, got) in expected.lines().zip(rendered.lines()) {
        assert_eq!(
            want, got,
            "wire format changed; see the module doc for what to do"
        );
    }
    assert_eq!(expected.lines().count(), rendered.lines().count());
}

#[test]
fn every_sample_round_trips() {
    let s = samples();
    let req: GenerateRequest = decode(&s[0].1).unwrap();
    assert_eq!(req.token_ids, vec![1, 2, 300, 70000]);
    let reg_bytes = &s
        .iter()
        .find(|(n, _)| *n == "WorkerRegistration")
        .unwrap()
        .1;
    let reg: WorkerRegistration = decode(reg_bytes).unwrap();
    assert_eq!(reg.model, card());
    // Decoding as the wrong type is an error value, not a panic.
    let err = decode::<FrameTokens>(&s[0].1).unwrap_err();
    assert!(matches!(
        err,
        DecodeError::UnexpectedKind {
            expected: 11,
            found: 1,
            ..
        }
    ));
}

#[test]
fn malformed_messages_are_errors() {
    assert_eq!(
        decode::<FrameTokens>(&[]).unwrap_err(),
        DecodeError::TooShort { len: 0 }
    );
    assert!(matches!(
        decode::<FrameTokens>(b"{\"json\":1}").unwrap_err(),
        DecodeError::BadMagic { .. }
    ));
    let mut future = samples()[4].1.clone();
    future[1] = 99;
    assert_eq!(
        decode::<FrameTokens>(&future).unwrap_err(),
        DecodeError::UnsupportedVersion { found: 99 }
    );
    let mut truncated = samples()[4].1.clone();
    truncated.truncate(truncated.len() - 1);
    assert!(matches!(
        decode::<FrameTokens>(&truncated).unwrap_err(),
        DecodeError::Malformed { .. }
    ));
    let mut trailing = samples()[4].1.clone();
    trailing.push(0);
    assert!(matches!(
        decode::<FrameTokens>(&trailing).unwrap_err(),
        DecodeError::Malformed { .. }
    ));
}

#[test]
fn unknown_enum_values_are_kept() {
    let mut bytes = encode(&FrameFinished {
        request_id: RequestId(1),
        seq: FrameSeq(0),
        reason: FinishReason::Stop,
        completion_tokens: 0,
    })
    .unwrap();
    // The reason is the varint byte after the 1-byte request id and 1-byte seq.
    let pos = 4 + 1 + 1;
    assert_eq!(bytes[pos], 2);
    bytes[pos] = 77;
    let f: FrameFinished = decode(&bytes).unwrap();
    assert_eq!(f.reason, FinishReason::Unknown(77));
}

/// Cases per fuzz property: `DYNAMO_FUZZ_CASES` (`make fuzz` sets a large
/// number), else `default` (a short bounded run in `make test`).
fn fuzz_cases(default: u32) -> u32 {
    std::env::var("DYNAMO_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Decodes `bytes` as every wire type (the fuzz tests' one call), and as
/// pieces of a large reply.
fn decode_all(bytes: &[u8]) {
    macro_rules! all {
        ($($t:ty),* $(,)?) => { $( let _ = decode::<$t>(bytes); let _ = decode_assembled::<$t>(bytes); )* };
    }
    all!(
        GenerateRequest,
        GenerateAck,
        ErrorReply,
        FrameStarted,
        FrameTokens,
        FrameFinished,
        FrameError,
        FrameHeartbeat,
        FrameTimings,
        FrameUsage,
        FrameMux,
        CancelRequest,
        LoadReport,
        WorkerRegistration,
        NodeRegistration,
        DrainRequest,
        DrainReply,
        ArtifactRequest,
        ArtifactChunk,
        FaultInjection,
        FaultAck,
        ActorFault,
        GenerateDisagg,
        PrefillRequest,
        PrefillReply,
        TransferStarting,
        KvEventBatch,
        KvDumpRequest,
        KvDump,
        KvDumpTiered,
        KvIndexSnapshot,
        ActiveLoadEvent,
        RouterHeartbeat,
        ActiveLoadSnapshotRequest,
        ActiveLoadSnapshot,
        RouterInfoRequest,
        RouterInfo,
        ChunkedReply,
        DeploymentRecord,
        NodeInventory,
        NodeAssignment,
        ControllerLease,
        DeploymentStatus,
        PresenceProbe,
        FrontendMetrics,
        WorkerMetrics,
        PlannerStatus,
        PlannerPin,
    );
    if let Ok(piece) = decode::<ChunkedReply>(bytes) {
        let mut a = dynamo_bus_schema::chunk::Assembler::default();
        let _ = a.push(piece);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: fuzz_cases(2000), rng_seed: proptest::test_runner::RngSeed::Fixed(7), ..ProptestConfig::default() })]
    #[test]
    fn random_bytes_never_panic(mut bytes in proptest::collection::vec(any::<u8>(), 0..256), kind in 0u16..120) {
        if bytes.len() >= 4 { bytes[0] = 0xD7; bytes[1] = 1; bytes[2..4].copy_from_slice(&kind.to_le_bytes()); }
        decode_all(&bytes);
    }

    /// Every sample with bytes flipped, cut or appended: never a panic, and
    /// whatever decodes is a value of the right kind.
    #[test]
    fn mutated_messages_never_panic(which in 0usize..64, edits in proptest::collection::vec((any::<usize>(), any::<u8>(), 0u8..3), 1..8)) {
        let s = samples();
        let mut bytes = s[which % s.len()].1.clone();
        for (pos, b, op) in edits {
            match op {
                0 if !bytes.is_empty() => { let i = pos % bytes.len(); bytes[i] ^= b | 1; }
                1 if !bytes.is_empty() => bytes.truncate(pos % bytes.len()),
                _ => bytes.push(b),
            }
        }
        decode_all(&bytes);
    }
}
