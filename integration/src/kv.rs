//! The KV index seen from outside: what a router indexes for a worker, what
//! the worker itself holds, and the KV events stream.

use crate::Http;
use std::time::Duration;

/// Blocks a gateway's router indexes for `worker`: device, host, disk.
pub async fn indexed(h: &Http, worker: &str) -> [u64; 3] {
    let text = h.metrics_text().await;
    let mut got = [0u64; 3];
    for (i, tier) in ["device", "host", "disk"].iter().enumerate() {
        let key = format!("dynamo_router_kv_index_blocks{{worker=\"{worker}\",tier=\"{tier}\"}} ");
        got[i] = text
            .lines()
            .find_map(|l| l.strip_prefix(&key)?.parse().ok())
            .unwrap_or(0);
    }
    got
}

/// Blocks `worker` itself holds (its dump, which may come in pieces): device, host, disk.
pub async fn held(nats_url: &str, worker: &str) -> [u64; 3] {
    held_dump(nats_url, worker).await.0
}

/// [`held`], and the dump's size in bytes.
pub async fn held_dump(nats_url: &str, worker: &str) -> ([u64; 3], usize) {
    let bus = crate::it_bus(nats_url, "test").await;
    let bytes = bus
        .request_large(
            format!("dynamo.it.worker.{worker}.kv_dump"),
            &dynamo_bus_schema::KvDumpRequest {
                reason: "test".into(),
            },
            Duration::from_secs(20),
        )
        .await
        .expect("the dump arrives whole");
    let size = bytes.len();
    let d: dynamo_bus_schema::KvDumpTiered =
        dynamo_bus_schema::decode_assembled(&bytes).expect("a tiered dump");
    let mut by_tier = [0u64; 3];
    for t in d.tiers {
        let i = match t.tier {
            dynamo_bus_schema::StorageTier::Device => 0,
            dynamo_bus_schema::StorageTier::Host => 1,
            _ => 2,
        };
        by_tier[i] += t.blocks.len() as u64;
    }
    (by_tier, size)
}

/// Empties the `it` namespace's KV events stream (what a stream past its
/// retention looks like to a replica that starts); returns the messages purged.
pub async fn purge_kv_events(nats_url: &str) -> u64 {
    let client = async_nats::connect(nats_url).await.expect("connect");
    let js = async_nats::jetstream::new(client);
    let stream = js
        .get_stream("dynamo_it_kv_events")
        .await
        .expect("the KV events stream exists");
    stream.purge().await.expect("purge").purged
}
