//! Fixtures for tests in other crates (feature `testing`, or this crate's
//! own tests): well-formed wire values whose fields a test rarely cares
//! about are filled in, so each test names only the ones it does.
//!
//! Invariant: nothing here is compiled into a build without the feature.

use crate::{
    ArtifactRef, LoadMetrics, ModelCard, ModelName, NodeId, WorkerId, WorkerRegistration,
    WorkerRole, WorkerState,
};

/// A small model card for `model`: context 100, blocks of 16 tokens,
/// a vocabulary of 10, no template.
pub fn model_card(model: &str) -> ModelCard {
    ModelCard {
        name: ModelName(model.into()),
        context_length: 100,
        block_size: 16,
        chat_template: String::new(),
        bos_token: None,
        eos_token: None,
        eos_token_ids: vec![],
        vocab_size: 10,
        tokenizer: ArtifactRef {
            name: "t".into(),
            len: 0,
            sha256: String::new(),
        },
        source: String::new(),
        hash_salt: 0,
    }
}

/// Worker `id` on node `node`, serving [`model_card`]`(model)` as a mocker
/// in `role` and `state`, generation 1, heartbeat at `heartbeat_unix_ms`,
/// with KV events and no load.
pub fn registration(
    id: u64,
    node: &str,
    model: &str,
    role: WorkerRole,
    state: WorkerState,
    heartbeat_unix_ms: u64,
) -> WorkerRegistration {
    WorkerRegistration {
        worker_id: WorkerId(id),
        generation: 1,
        node_id: NodeId(node.into()),
        pid: 1,
        role,
        state,
        engine: "mocker".into(),
        model: model_card(model),
        started_unix_ms: 0,
        heartbeat_unix_ms,
        load: LoadMetrics::default(),
        kv_events: true,
    }
}
