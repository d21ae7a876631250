//! The router's view (KV index, load, routing time) in the Prometheus text
//! format, appended to the gateway's `/metrics`.

/// The router's KV index state in the Prometheus text format.
pub fn router_metrics(info: &dynamo_router::KvInfo) -> String {
    use std::fmt::Write;
    let st = &info.stats;
    let mut out = String::new();
    for (name, help, v) in [
        (
            "kv_events_applied_total",
            "KV events applied to the index",
            st.applied,
        ),
        (
            "kv_event_duplicates_total",
            "KV events dropped as duplicates",
            st.duplicates,
        ),
        (
            "kv_event_gaps_total",
            "Gaps detected in a worker's KV event ids",
            st.gaps,
        ),
        (
            "kv_dumps_total",
            "Worker block tables loaded (start-up and gap repair)",
            st.dumps,
        ),
        (
            "kv_events_unknown_total",
            "KV events of a kind or tier this build does not know",
            st.unknown,
        ),
        (
            "kv_batches_ignored_total",
            "KV event batches and dumps dropped: not of a registered worker's generation",
            st.ignored,
        ),
        (
            "kv_batches_replayed_total",
            "KV event batches read back from the KV events stream while catching up",
            st.replayed,
        ),
        (
            "kv_snapshots_taken_total",
            "KV index snapshots this replica took for the object store",
            st.snapshots_taken,
        ),
        (
            "kv_snapshot_blocks_loaded_total",
            "Blocks loaded from a KV index snapshot at start-up",
            st.snapshot_blocks,
        ),
        (
            "kv_stream_truncated_total",
            "Catch-ups whose KV events stream no longer held what followed the snapshot",
            st.stream_truncated,
        ),
        (
            "kv_gaps_filled_from_stream_total",
            "Gaps in a worker's KV events filled from the KV events stream (no dump)",
            st.stream_fills,
        ),
        (
            "kv_gap_fill_failures_total",
            "Gaps the KV events stream could not fill (a dump followed)",
            st.stream_fill_failures,
        ),
        (
            "indexer_restarts_total",
            "Times the router's indexer failed and was replaced with a fresh index",
            info.indexer_restarts,
        ),
    ] {
        let _ = writeln!(out, "# HELP dynamo_router_{name} {help}");
        let _ = writeln!(out, "# TYPE dynamo_router_{name} counter");
        let _ = writeln!(out, "dynamo_router_{name} {v}");
    }
    let _ = writeln!(
        out,
        "# HELP dynamo_router_kv_index_blocks Blocks the router's index holds per worker and tier"
    );
    let _ = writeln!(out, "# TYPE dynamo_router_kv_index_blocks gauge");
    for (w, b) in &info.blocks {
        for (tier, n) in ["device", "host", "disk"].iter().zip(b) {
            let _ = writeln!(
                out,
                "dynamo_router_kv_index_blocks{{worker=\"{w}\",tier=\"{tier}\"}} {n}"
            );
        }
    }
    let _ = writeln!(
        out,
        "# HELP dynamo_router_worker_inflight Requests in flight per worker, all router replicas"
    );
    let _ = writeln!(out, "# TYPE dynamo_router_worker_inflight gauge");
    for (w, l) in &info.load {
        let _ = writeln!(
            out,
            "dynamo_router_worker_inflight{{worker=\"{w}\"}} {}",
            l.inflight
        );
    }
    let _ = writeln!(out, "# HELP dynamo_router_worker_pending_prefill_tokens Uncached prompt tokens not yet prefilled per worker, all replicas");
    let _ = writeln!(
        out,
        "# TYPE dynamo_router_worker_pending_prefill_tokens gauge"
    );
    for (w, l) in &info.load {
        let _ = writeln!(
            out,
            "dynamo_router_worker_pending_prefill_tokens{{worker=\"{w}\"}} {}",
            l.prefill_tokens
        );
    }
    let _ = writeln!(out, "# HELP dynamo_router_kv_config_mismatch Workers whose KV block size or hash salt differ from their model's (excluded from KV scoring)");
    let _ = writeln!(out, "# TYPE dynamo_router_kv_config_mismatch gauge");
    let _ = writeln!(
        out,
        "dynamo_router_kv_config_mismatch {}",
        info.mismatched.len()
    );
    for w in &info.mismatched {
        let _ = writeln!(
            out,
            "dynamo_router_kv_config_mismatch_worker{{worker=\"{w}\"}} 1"
        );
    }
    let t = &info.timings;
    out.push_str(&t.hashing.render(
        "dynamo_router_hashing_seconds",
        "Time to hash a request's blocks (KV-aware policies)",
    ));
    out.push_str(&t.find_matches.render(
        "dynamo_router_find_matches_seconds",
        "Time to query the KV index",
    ));
    out.push_str(&t.total.render(
        "dynamo_router_route_seconds",
        "Time of a whole routing decision",
    ));
    let _ = writeln!(out, "# HELP dynamo_router_info Routing policy in use");
    let _ = writeln!(out, "# TYPE dynamo_router_info gauge");
    let _ = writeln!(out, "dynamo_router_info{{policy=\"{}\"}} 1", info.policy);
    out
}
