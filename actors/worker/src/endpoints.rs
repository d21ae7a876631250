//! A worker's request/reply endpoints besides generation: its block table
//! (`kv_dump`, for routers), its artifacts (the tokenizer, for gateways)
//! and drain (for admins).
//!
//! Invariants: a dump is consistent with the worker's KV events up to its
//! `last_event_id`; however large, it is sent whole or in pieces
//! (`Bus::reply` splits what does not fit one message), never refused for
//! its size; an artifact chunk is at most [`ARTIFACT_CHUNK`] bytes.

use crate::kv_events::wire_tier;
use dynamo_bus_schema::{
    ArtifactChunk, ArtifactRequest, ErrorKind, EventId, KvDumpTiered, KvTierBlocks, StorageTier,
    WireError, WorkerId,
};
use dynamo_engine::Engine;
use std::collections::HashMap;
use std::sync::Arc;

/// The engine's block table in every tier, consistent with its events so far.
pub async fn kv_dump(
    engine: Arc<dyn Engine>,
    worker_id: WorkerId,
    generation: u64,
) -> Result<KvDumpTiered, WireError> {
    let stopped = || WireError::new(ErrorKind::EngineFailed, "engine stopped");
    let snap = engine
        .kv_snapshot()
        .map_err(|e| e.to_wire())?
        .await
        .map_err(|_| stopped())?;
    let mut tiers = vec![KvTierBlocks {
        tier: StorageTier::Device,
        blocks: snap.blocks,
    }];
    for (tier, blocks) in snap.offloaded {
        tiers.push(KvTierBlocks {
            tier: wire_tier(tier),
            blocks,
        });
    }
    Ok(KvDumpTiered {
        worker_id,
        generation,
        last_event_id: EventId(snap.last_event_id),
        tiers,
    })
}

/// Largest chunk served per artifact request (NATS caps messages at 1 MiB).
pub const ARTIFACT_CHUNK: u32 = 256 * 1024;

/// One byte range of a named artifact.
pub fn artifact_chunk(
    artifacts: &HashMap<String, Arc<Vec<u8>>>,
    req: ArtifactRequest,
) -> Result<ArtifactChunk, WireError> {
    match artifacts.get(&req.name) {
        Some(data) if req.offset <= data.len() as u64 => {
            let start = req.offset as usize;
            let len = (req.max_len.min(ARTIFACT_CHUNK) as usize).min(data.len() - start);
            Ok(ArtifactChunk {
                name: req.name,
                total_len: data.len() as u64,
                offset: req.offset,
                data: data[start..start + len].to_vec(),
            })
        }
        _ => Err(WireError::new(
            ErrorKind::InvalidRequest,
            format!(
                "no artifact {:?} at offset {}",
                req.name.chars().take(64).collect::<String>(),
                req.offset
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn artifact_chunks_are_bounded_and_bad_ranges_refused() {
        let mut a = HashMap::new();
        a.insert("t".to_string(), Arc::new(vec![7u8; 600 * 1024]));
        let c = artifact_chunk(
            &a,
            ArtifactRequest {
                name: "t".into(),
                offset: 0,
                max_len: u32::MAX,
            },
        )
        .unwrap();
        assert_eq!(c.data.len(), ARTIFACT_CHUNK as usize);
        let end = artifact_chunk(
            &a,
            ArtifactRequest {
                name: "t".into(),
                offset: 600 * 1024,
                max_len: 10,
            },
        )
        .unwrap();
        assert!(end.data.is_empty());
        for (name, offset) in [("t", u64::MAX), ("nope", 0)] {
            let e = artifact_chunk(
                &a,
                ArtifactRequest {
                    name: name.into(),
                    offset,
                    max_len: 1,
                },
            )
            .unwrap_err();
            assert_eq!(e.kind, ErrorKind::InvalidRequest);
        }
    }
}
