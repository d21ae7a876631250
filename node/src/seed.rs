//! The planner's capacity seed: an engine's step timing from a worker
//! service's settings in a deployment spec. The mocker's is its own
//! configuration (formulas, KV size, speedup); other engines start from
//! Dynamo's mocker defaults, which the planner corrects online from what
//! the workers measure.

use dynamo_mocker::MockerConfig;
use dynamo_planner::EngineTiming;

/// The seed function the planners use.
pub fn seed() -> dynamo_planner_actor::Seed {
    std::sync::Arc::new(timing)
}

/// Step timing of a worker service's settings (`worker:` in the spec).
pub fn timing(settings: &serde_json::Value) -> EngineTiming {
    let engine = settings
        .get("engine")
        .and_then(|e| e.as_str())
        .unwrap_or("");
    if engine != "mocker" {
        return EngineTiming::mocker_default();
    }
    let cfg: MockerConfig = settings
        .get("mocker")
        .and_then(|m| serde_json::from_value(m.clone()).ok())
        .unwrap_or_default();
    EngineTiming {
        prefill_ms: cfg.prefill_ms,
        decode_ms: cfg.decode_ms,
        kv_tokens: cfg.num_blocks as f64 * cfg.block_size as f64,
        max_seqs: cfg.max_num_seqs as f64,
        max_batch_tokens: cfg.max_num_batched_tokens as f64,
        speedup: if cfg.speedup == 0.0 || cfg.speedup.is_infinite() {
            1e6
        } else {
            cfg.speedup
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mocker_service_seeds_its_own_timing() {
        let t = timing(&serde_json::json!({
            "engine": "mocker",
            "mocker": {"speedup": 4.0, "num_blocks": 1000, "block_size": 32, "max_num_seqs": 64}
        }));
        assert_eq!((t.speedup, t.kv_tokens, t.max_seqs), (4.0, 32_000.0, 64.0));
        assert_eq!(t.prefill_ms, MockerConfig::default().prefill_ms);
        assert_eq!(
            timing(&serde_json::json!({"engine": "cpu"})),
            EngineTiming::mocker_default()
        );
    }
}
