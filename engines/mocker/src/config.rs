//! Mocker configuration.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Everything that shapes the simulated engine. Defaults follow Dynamo's mocker.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MockerConfig {
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV blocks in the simulated device pool.
    pub num_blocks: u32,
    /// Most sequences running at once.
    pub max_num_seqs: u32,
    /// Most tokens (prefill chunks + decodes) in one step.
    pub max_num_batched_tokens: u32,
    /// Most requests waiting to be admitted; past it the engine answers
    /// `Overloaded` at once and the router sends work elsewhere.
    pub max_waiting_seqs: u32,
    /// Simulated time runs this many times faster than real time; `0` or
    /// infinity means no delay at all.
    pub speedup: f64,
    /// Reuse cached blocks across requests by block hash.
    pub enable_prefix_caching: bool,
    /// Publish KV events (off simulates an engine without them: routers
    /// then track its cache approximately).
    pub emit_kv_events: bool,
    /// Output token ids are drawn from `[token_lo, token_hi)`.
    pub token_lo: u32,
    /// Upper bound (exclusive) of output token ids; 0 = the model's vocabulary size.
    pub token_hi: u32,
    /// Prefill time in ms for N new tokens: `a·N² + b·N + c`.
    pub prefill_ms: [f64; 3],
    /// Decode step time in ms at KV utilisation u: `a·u² + b·u + c` (floor 1 ms).
    pub decode_ms: [f64; 3],
    /// Bytes of KV one block stands for: an exported block is a buffer of
    /// this size, so moving blocks between workers costs what it would on
    /// a real engine (default 64 KiB).
    pub kv_bytes_per_block: u32,
    /// Blocks kept in a simulated host-memory tier after eviction (0 = none);
    /// each holds a real buffer of `kv_bytes_per_block`, so memory is real.
    pub offload_host_blocks: u32,
    /// Blocks kept on disk after eviction from host memory (0 = none).
    pub offload_disk_blocks: u32,
    /// Directory of the disk tier (needed when `offload_disk_blocks > 0`).
    pub offload_disk_dir: Option<std::path::PathBuf>,
    /// Simulated cold start in ms of real time (model loading): a new
    /// worker starts serving this long after it is asked to start.
    pub startup_ms: u64,
}

impl Default for MockerConfig {
    fn default() -> Self {
        MockerConfig {
            block_size: 16,
            num_blocks: 16384,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_waiting_seqs: 1024,
            speedup: 1.0,
            enable_prefix_caching: true,
            emit_kv_events: true,
            token_lo: 256,
            token_hi: 0,
            prefill_ms: [4.21e-7, 1.518e-2, 16.5],
            decode_ms: [-25.74, 54.01, 5.74],
            kv_bytes_per_block: 64 * 1024,
            offload_host_blocks: 0,
            offload_disk_blocks: 0,
            offload_disk_dir: None,
            startup_ms: 0,
        }
    }
}

#[derive(Debug, Error, PartialEq)]
pub enum ConfigError {
    #[error("mocker.{field} must be at least {min} (got {value})")]
    TooSmall {
        field: &'static str,
        min: u64,
        value: u64,
    },
    #[error("mocker.speedup must be >= 0 (got {0})")]
    BadSpeedup(f64),
    #[error("mocker.token_lo ({lo}) must be below token_hi ({hi})")]
    BadTokenRange { lo: u32, hi: u32 },
    #[error("mocker.{0}")]
    Offload(String),
    #[error("mocker.startup_ms must be at most 3600000 (an hour), got {0}")]
    StartupTooLong(u64),
    #[error("mocker KV pool: {0}")]
    Memory(dynamo_engine::ArenaError),
}

// Not `#[from]`: the message already shows the cause, and a source would
// print it twice in a chain (`{:#}`).
impl From<dynamo_engine::ArenaError> for ConfigError {
    fn from(e: dynamo_engine::ArenaError) -> Self {
        ConfigError::Memory(e)
    }
}

impl MockerConfig {
    /// Checks the config against a model's vocabulary size and returns the
    /// effective output token range.
    pub fn validate(&self, vocab_size: u32) -> Result<(u32, u32), ConfigError> {
        for (field, value, min) in [
            ("block_size", self.block_size as u64, 1),
            ("kv_bytes_per_block", self.kv_bytes_per_block as u64, 8),
            ("num_blocks", self.num_blocks as u64, 1),
            ("max_num_seqs", self.max_num_seqs as u64, 1),
            (
                "max_num_batched_tokens",
                self.max_num_batched_tokens as u64,
                1,
            ),
            ("max_waiting_seqs", self.max_waiting_seqs as u64, 1),
        ] {
            if value < min {
                return Err(ConfigError::TooSmall { field, min, value });
            }
        }
        if self.speedup.is_nan() || self.speedup < 0.0 {
            return Err(ConfigError::BadSpeedup(self.speedup));
        }
        if self.startup_ms > 3_600_000 {
            return Err(ConfigError::StartupTooLong(self.startup_ms));
        }
        let hi = if self.token_hi == 0 {
            vocab_size
        } else {
            self.token_hi.min(vocab_size)
        };
        if let Err(e) = dynamo_batcher::TierStore::check(&self.offload()) {
            return Err(ConfigError::Offload(e.to_string()));
        }
        if self.token_lo >= hi {
            return Err(ConfigError::BadTokenRange {
                lo: self.token_lo,
                hi,
            });
        }
        Ok((self.token_lo, hi))
    }

    /// The shared scheduler's limits under this config.
    pub fn scheduler(&self) -> dynamo_batcher::SchedulerConfig {
        dynamo_batcher::SchedulerConfig {
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_waiting: self.max_waiting_seqs,
            enable_prefix_caching: self.enable_prefix_caching,
            record_kv_events: self.emit_kv_events,
        }
    }

    /// The offload tiers this config asks for.
    pub fn offload(&self) -> dynamo_batcher::OffloadConfig {
        dynamo_batcher::OffloadConfig {
            host_blocks: self.offload_host_blocks as usize,
            disk_blocks: self.offload_disk_blocks as usize,
            disk_dir: self.offload_disk_dir.clone(),
        }
    }

    /// Simulated duration of a step, before the speedup.
    pub fn step_ms(&self, new_prefill_tokens: u64, decoding: bool, kv_util: f64) -> f64 {
        let mut ms = 0.0;
        if new_prefill_tokens > 0 {
            let n = new_prefill_tokens as f64;
            let [a, b, c] = self.prefill_ms;
            ms += a * n * n + b * n + c;
        }
        if decoding {
            let u = kv_util.clamp(0.0, 1.0);
            let [a, b, c] = self.decode_ms;
            ms += (a * u * u + b * u + c).max(1.0);
        }
        ms
    }

    /// Real time to wait for a simulated duration, or `None` for no delay.
    pub fn real_delay(&self, simulated_ms: f64) -> Option<std::time::Duration> {
        if self.speedup == 0.0 || self.speedup.is_infinite() || simulated_ms <= 0.0 {
            None
        } else {
            Some(std::time::Duration::from_secs_f64(
                simulated_ms / 1000.0 / self.speedup,
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timing_model_matches_the_documented_polynomials() {
        let c = MockerConfig::default();
        let p = c.step_ms(1000, false, 0.0);
        assert!((p - (4.21e-7 * 1e6 + 15.18 + 16.5)).abs() < 1e-9);
        assert!((c.step_ms(0, true, 0.0) - 5.74).abs() < 1e-9);
        assert_eq!(c.step_ms(0, false, 0.5), 0.0);
        assert!(c.real_delay(10.0).is_some());
        let fast = MockerConfig {
            speedup: 0.0,
            ..c.clone()
        };
        assert_eq!(fast.real_delay(10.0), None);
        assert_eq!(c.validate(1000), Ok((256, 1000)));
        assert!(c.validate(100).is_err());
    }
}
