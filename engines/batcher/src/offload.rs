//! Offload tiers below the device pool: blocks evicted from the pool go to
//! host memory, blocks pushed out of host memory go to local disk, and a
//! later request that needs them brings them back (onboards) instead of
//! recomputing them.
//!
//! Invariants:
//! - a hash is held by at most one tier at a time; onboarding takes it out;
//! - each tier holds at most its configured number of blocks and evicts
//!   least recently stored first (host → disk → gone);
//! - every store and removal in a tier is announced through the pool's
//!   event sequence with that tier, so routers see exactly what each tier
//!   holds; a disk write that fails drops the block (counted), it never
//!   announces a block that is not there.

use crate::block_pool::BlockPool;
use dynamo_bus_schema::blocks::SequenceHash;
use dynamo_engine::{KvBlockData, KvCacheEventData, KvTier};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use thiserror::Error;

/// Sizes of the offload tiers (zero blocks turns a tier off).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OffloadConfig {
    /// Blocks kept in host memory after eviction from the device pool.
    pub host_blocks: usize,
    /// Blocks kept on local disk after eviction from host memory.
    pub disk_blocks: usize,
    /// Directory of the disk tier (one file per block); required when
    /// `disk_blocks > 0`.
    pub disk_dir: Option<PathBuf>,
}

impl OffloadConfig {
    pub fn enabled(&self) -> bool {
        self.host_blocks > 0
    }
}

#[derive(Debug, Error)]
pub enum OffloadError {
    #[error("offload.disk_blocks > 0 needs offload.disk_dir")]
    NoDiskDir,
    #[error(
        "offload.disk_blocks needs offload.host_blocks > 0 (disk takes what host memory evicts)"
    )]
    DiskWithoutHost,
    #[error("cannot create offload.disk_dir {dir}: {reason}")]
    DiskDir { dir: String, reason: String },
}

/// Counters of what the tiers did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OffloadStats {
    pub host_blocks: usize,
    pub disk_blocks: usize,
    /// Blocks moved down from the device pool.
    pub offloaded: u64,
    /// Blocks brought back to the device pool, by source tier.
    pub onboarded_host: u64,
    pub onboarded_disk: u64,
    /// Disk reads or writes that failed (the block was dropped).
    pub disk_errors: u64,
}

/// A small LRU keyed by block hash.
struct Lru<V> {
    tick: u64,
    order: BTreeMap<u64, SequenceHash>,
    map: HashMap<SequenceHash, (u64, Option<SequenceHash>, V)>,
}

impl<V> Lru<V> {
    fn new() -> Self {
        Lru {
            tick: 0,
            order: BTreeMap::new(),
            map: HashMap::new(),
        }
    }
    fn len(&self) -> usize {
        self.map.len()
    }
    fn insert(&mut self, hash: SequenceHash, parent: Option<SequenceHash>, v: V) {
        self.remove(hash);
        self.tick += 1;
        self.order.insert(self.tick, hash);
        self.map.insert(hash, (self.tick, parent, v));
    }
    fn remove(&mut self, hash: SequenceHash) -> Option<(Option<SequenceHash>, V)> {
        let (t, parent, v) = self.map.remove(&hash)?;
        self.order.remove(&t);
        Some((parent, v))
    }
    fn pop_oldest(&mut self) -> Option<(SequenceHash, Option<SequenceHash>, V)> {
        let (_, hash) = self.order.pop_first()?;
        let (_, parent, v) = self.map.remove(&hash)?;
        Some((hash, parent, v))
    }
}

/// The host and disk tiers of one engine.
pub struct TierStore {
    cfg: OffloadConfig,
    host: Lru<Vec<u8>>,
    disk: Lru<PathBuf>,
    stats: OffloadStats,
}

impl TierStore {
    /// Checks a config without touching the disk.
    pub fn check(cfg: &OffloadConfig) -> Result<(), OffloadError> {
        if cfg.disk_blocks > 0 {
            if cfg.host_blocks == 0 {
                return Err(OffloadError::DiskWithoutHost);
            }
            cfg.disk_dir.as_ref().ok_or(OffloadError::NoDiskDir)?;
        }
        Ok(())
    }

    pub fn new(cfg: OffloadConfig) -> Result<Self, OffloadError> {
        Self::check(&cfg)?;
        if let Some(dir) = cfg.disk_dir.as_ref().filter(|_| cfg.disk_blocks > 0) {
            std::fs::create_dir_all(dir).map_err(|e| OffloadError::DiskDir {
                dir: dir.display().to_string(),
                reason: e.to_string(),
            })?;
        }
        Ok(TierStore {
            cfg,
            host: Lru::new(),
            disk: Lru::new(),
            stats: OffloadStats::default(),
        })
    }

    pub fn stats(&self) -> OffloadStats {
        OffloadStats {
            host_blocks: self.host.len(),
            disk_blocks: self.disk.len(),
            ..self.stats
        }
    }

    /// Which tier holds `hash`, if any.
    pub fn tier_of(&self, hash: SequenceHash) -> Option<KvTier> {
        if self.host.map.contains_key(&hash) {
            Some(KvTier::Host)
        } else if self.disk.map.contains_key(&hash) {
            Some(KvTier::Disk)
        } else {
            None
        }
    }

    /// Every hash held, by tier (for block-table dumps).
    pub fn hashes(&self, tier: KvTier) -> Vec<SequenceHash> {
        match tier {
            KvTier::Host => self.host.map.keys().copied().collect(),
            KvTier::Disk => self.disk.map.keys().copied().collect(),
            KvTier::Device => Vec::new(),
        }
    }

    /// Stores a block evicted from the device pool in host memory, pushing
    /// the oldest host block to disk (or out) when host memory is full.
    pub fn offload(&mut self, block: KvBlockData, pool: &mut BlockPool) {
        if self.cfg.host_blocks == 0 || self.tier_of(block.hash).is_some() {
            return;
        }
        while self.host.len() >= self.cfg.host_blocks {
            let Some((hash, parent, bytes)) = self.host.pop_oldest() else {
                break;
            };
            pool.emit_tier(KvTier::Host, removed(hash));
            self.spill(hash, parent, &bytes, pool);
        }
        pool.emit_tier(
            KvTier::Host,
            KvCacheEventData::Stored {
                parent: block.parent,
                blocks: vec![block.hash],
            },
        );
        self.host.insert(block.hash, block.parent, block.bytes);
        self.stats.offloaded += 1;
    }

    fn spill(
        &mut self,
        hash: SequenceHash,
        parent: Option<SequenceHash>,
        bytes: &[u8],
        pool: &mut BlockPool,
    ) {
        let Some(dir) = self
            .cfg
            .disk_dir
            .as_ref()
            .filter(|_| self.cfg.disk_blocks > 0)
        else {
            return;
        };
        while self.disk.len() >= self.cfg.disk_blocks {
            let Some((old, _, path)) = self.disk.pop_oldest() else {
                break;
            };
            let _ = std::fs::remove_file(path);
            pool.emit_tier(KvTier::Disk, removed(old));
        }
        let path = dir.join(format!("{:016x}.kv", hash.0));
        if std::fs::write(&path, bytes).is_err() {
            self.stats.disk_errors += 1;
            return;
        }
        pool.emit_tier(
            KvTier::Disk,
            KvCacheEventData::Stored {
                parent,
                blocks: vec![hash],
            },
        );
        self.disk.insert(hash, parent, path);
    }

    /// Takes `hash` out of whichever tier holds it, with its KV bytes.
    pub fn take(
        &mut self,
        hash: SequenceHash,
        pool: &mut BlockPool,
    ) -> Option<(KvBlockData, KvTier)> {
        if let Some((parent, bytes)) = self.host.remove(hash) {
            pool.emit_tier(KvTier::Host, removed(hash));
            self.stats.onboarded_host += 1;
            return Some((
                KvBlockData {
                    hash,
                    parent,
                    bytes,
                },
                KvTier::Host,
            ));
        }
        let (parent, path) = self.disk.remove(hash)?;
        pool.emit_tier(KvTier::Disk, removed(hash));
        let read = std::fs::read(&path);
        let _ = std::fs::remove_file(&path);
        match read {
            Ok(bytes) => {
                self.stats.onboarded_disk += 1;
                Some((
                    KvBlockData {
                        hash,
                        parent,
                        bytes,
                    },
                    KvTier::Disk,
                ))
            }
            Err(_) => {
                self.stats.disk_errors += 1;
                None
            }
        }
    }
}

impl Drop for TierStore {
    fn drop(&mut self) {
        for (_, (_, _, path)) in self.disk.map.drain() {
            let _ = std::fs::remove_file(path);
        }
    }
}

fn removed(hash: SequenceHash) -> KvCacheEventData {
    KvCacheEventData::Removed { blocks: vec![hash] }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(h: u64) -> KvBlockData {
        KvBlockData {
            hash: SequenceHash(h),
            parent: (h > 1).then(|| SequenceHash(h - 1)),
            bytes: vec![h as u8; 8],
        }
    }

    #[test]
    fn blocks_move_host_then_disk_then_out_and_come_back_intact() {
        let dir = std::env::temp_dir().join(format!("dynamo-offload-{}", std::process::id()));
        let mut pool = BlockPool::new(1, true);
        let mut t = TierStore::new(OffloadConfig {
            host_blocks: 2,
            disk_blocks: 1,
            disk_dir: Some(dir.clone()),
        })
        .unwrap();
        for h in 1..=4 {
            t.offload(block(h), &mut pool);
        }
        // Host holds 3 and 4; 2 went to disk after 1, which fell out.
        assert_eq!(t.tier_of(SequenceHash(4)), Some(KvTier::Host));
        assert_eq!(t.tier_of(SequenceHash(3)), Some(KvTier::Host));
        assert_eq!(t.tier_of(SequenceHash(2)), Some(KvTier::Disk));
        assert_eq!(t.tier_of(SequenceHash(1)), None);
        let (b, tier) = t.take(SequenceHash(2), &mut pool).unwrap();
        assert_eq!((b, tier), (block(2), KvTier::Disk));
        let (b, tier) = t.take(SequenceHash(3), &mut pool).unwrap();
        assert_eq!((b, tier), (block(3), KvTier::Host));
        assert!(t.take(SequenceHash(3), &mut pool).is_none());
        let s = t.stats();
        assert_eq!((s.host_blocks, s.disk_blocks, s.offloaded), (1, 0, 4));
        assert_eq!((s.onboarded_host, s.onboarded_disk), (1, 1));
        // Events replay to exactly what the tiers hold.
        let mut host = std::collections::HashSet::new();
        let mut disk = std::collections::HashSet::new();
        for ev in pool.drain_events() {
            let set = match ev.tier {
                KvTier::Host => &mut host,
                KvTier::Disk => &mut disk,
                KvTier::Device => unreachable!("no device events here"),
            };
            match ev.data {
                KvCacheEventData::Stored { blocks, .. } => set.extend(blocks),
                KvCacheEventData::Removed { blocks } => {
                    for b in blocks {
                        assert!(set.remove(&b));
                    }
                }
                KvCacheEventData::Cleared => set.clear(),
            }
        }
        assert_eq!(host, [SequenceHash(4)].into_iter().collect());
        assert!(disk.is_empty());
        drop(t);
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        let _ = std::fs::remove_dir(&dir);
    }

    #[test]
    fn a_disk_tier_needs_a_directory_and_a_host_tier() {
        let cfg = OffloadConfig {
            host_blocks: 1,
            disk_blocks: 1,
            disk_dir: None,
        };
        assert!(matches!(TierStore::new(cfg), Err(OffloadError::NoDiskDir)));
        let cfg = OffloadConfig {
            host_blocks: 0,
            disk_blocks: 1,
            disk_dir: Some("/tmp".into()),
        };
        assert!(matches!(
            TierStore::new(cfg),
            Err(OffloadError::DiskWithoutHost)
        ));
    }
}
