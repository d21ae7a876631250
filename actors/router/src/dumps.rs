//! Fetching a worker's block table (its KV dump) for the index.
//!
//! A dump can be far larger than one bus message (a worker with offload
//! tiers holds hundreds of thousands of blocks): the worker sends it in
//! pieces and [`dynamo_runtime::Bus::request_large`] puts it back together.
//! A dump that does not arrive whole within [`DUMP_TIMEOUT`] is dropped
//! and asked for again (`kv_sync` retries it from the expiry tick).

use crate::indexer::IndexerMsg;
use dynamo_bus_schema::{
    decode_assembled, decode_payload, peek_kind, KvDump, KvDumpRequest, KvDumpTiered, WireMessage,
    WorkerId,
};
use dynamo_runtime::{counters, Bus};
use ractor::ActorRef;
use std::time::Duration;

/// Longest a whole dump (every piece) may take to arrive.
pub const DUMP_TIMEOUT: Duration = Duration::from_secs(10);

/// Asks a worker for its block table and hands the answer to the indexer.
pub async fn request_dump(bus: Bus, w: WorkerId, indexer: ActorRef<IndexerMsg>) {
    let req = KvDumpRequest {
        reason: "router sync".into(),
    };
    let subject = bus.subjects.worker_kv_dump(w);
    let answer = bus.request_large(subject.clone(), &req, DUMP_TIMEOUT).await;
    // Workers answer with every tier; a device-only dump is accepted too.
    let dump = answer.map(|b| match peek_kind(&b) {
        Ok((k, p)) if k == KvDump::KIND => decode_payload::<KvDump>(p).map(Into::into),
        _ => decode_assembled::<KvDumpTiered>(&b),
    });
    match dump {
        Ok(Ok(d)) if d.worker_id == w => {
            let _ = indexer.cast(IndexerMsg::KvDump(d));
        }
        Ok(Ok(d)) => counters::reject(
            "KvDumpTiered",
            &subject,
            &format!("a dump of worker {} answered for {w}", d.worker_id),
        ),
        Ok(Err(e)) => counters::reject("KvDumpTiered", &subject, &e),
        // Retried from the tick until the worker answers or expires.
        Err(e) => tracing::debug!(worker = %w, error = %e, "KV dump request failed"),
    }
}
