//! The paged KV store: for every block, layer by layer, `block_size` K rows
//! then `block_size` V rows of `kv_dim` floats, in one [`KvArena`]. Which
//! block holds what is decided by the shared `dynamo_batcher` pool; this
//! only holds the numbers.
//!
//! Invariants: a block is one contiguous run of the arena (so a peer can
//! write a whole block with one one-sided write, straight into the pool),
//! laid out exactly as [`KvCache::export_block`] returns it:
//! `layers × (K, V) × block_size × kv_dim` little-endian f32s; importing it
//! back restores the block exactly. Memory is reserved, not committed, so
//! resident memory grows with the blocks actually used. Rows are read and
//! written through raw pointers one at a time, never through a reference
//! over the arena: a block reserved for a peer is never touched here.

use dynamo_engine::{ArenaError, KvArena};
use std::sync::Arc;
use thiserror::Error;

// The arena holds native f32s and blocks travel as little-endian bytes.
const _: () = assert!(cfg!(target_endian = "little"));

#[derive(Debug, Error, PartialEq)]
pub enum KvError {
    #[error("block {block} is outside the pool of {blocks}")]
    NoSuchBlock { block: usize, blocks: usize },
    #[error("block data is {got} bytes, expected {expected}")]
    BadLength { got: usize, expected: usize },
}

pub struct KvCache {
    layers: usize,
    blocks: usize,
    block_size: usize,
    kv_dim: usize,
    arena: Arc<KvArena>,
}

impl KvCache {
    pub fn new(
        layers: usize,
        blocks: usize,
        block_size: usize,
        kv_dim: usize,
    ) -> Result<Self, ArenaError> {
        let block_bytes = layers * 2 * block_size * kv_dim * 4;
        Ok(KvCache {
            layers,
            blocks,
            block_size,
            kv_dim,
            arena: Arc::new(KvArena::new(blocks, block_bytes)?),
        })
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Bytes of one block across all layers (K and V).
    pub fn block_bytes(&self) -> usize {
        self.arena.block_bytes()
    }

    /// The memory the blocks live in (for peers to write reserved blocks).
    pub fn arena(&self) -> Arc<KvArena> {
        self.arena.clone()
    }

    /// Offset, in floats, of the K row of `slot` in `layer` (its V row is
    /// `block_size` rows further).
    #[inline]
    fn at(&self, layer: usize, slot: usize) -> usize {
        let (block, off) = (slot / self.block_size, slot % self.block_size);
        assert!(
            block < self.blocks && layer < self.layers,
            "KV slot out of range"
        );
        ((block * self.layers + layer) * 2 * self.block_size + off) * self.kv_dim
    }

    #[inline]
    fn row(&self, at: usize) -> &[f32] {
        // SAFETY: `at` comes from `at()`, so the row is inside the arena,
        // which is page-aligned (f32-aligned); the slot belongs to a block
        // the scheduler handed to a sequence, which no peer writes.
        unsafe {
            std::slice::from_raw_parts(self.arena.as_ptr().cast::<f32>().add(at), self.kv_dim)
        }
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }

    /// The K rows (then, `block_size` rows on, the V rows) of `block` in
    /// `layer`: `2 × block_size × kv_dim` contiguous floats.
    #[inline]
    pub fn block_rows(&self, layer: usize, block: usize) -> &[f32] {
        assert!(
            block < self.blocks && layer < self.layers,
            "KV block out of range"
        );
        let at = (block * self.layers + layer) * 2 * self.block_size * self.kv_dim;
        // SAFETY: inside the arena (checked above), f32-aligned; the block
        // belongs to a sequence, so no peer writes it (see `row`).
        unsafe {
            std::slice::from_raw_parts(
                self.arena.as_ptr().cast::<f32>().add(at),
                2 * self.block_size * self.kv_dim,
            )
        }
    }

    #[inline]
    pub fn k(&self, layer: usize, slot: usize) -> &[f32] {
        self.row(self.at(layer, slot))
    }

    #[inline]
    pub fn v(&self, layer: usize, slot: usize) -> &[f32] {
        self.row(self.at(layer, slot) + self.block_size * self.kv_dim)
    }

    pub fn write(&mut self, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        let o = self.at(layer, slot);
        let n = self.kv_dim.min(k.len()).min(v.len());
        let base = self.arena.as_ptr().cast::<f32>();
        // SAFETY: both rows are inside the arena (see `row`); `&mut self`
        // means no row of this cache is borrowed meanwhile.
        unsafe {
            std::ptr::copy_nonoverlapping(k.as_ptr(), base.add(o), n);
            std::ptr::copy_nonoverlapping(
                v.as_ptr(),
                base.add(o + self.block_size * self.kv_dim),
                n,
            );
        }
    }

    fn check(&self, block: usize) -> Result<(), KvError> {
        if block >= self.blocks {
            return Err(KvError::NoSuchBlock {
                block,
                blocks: self.blocks,
            });
        }
        Ok(())
    }

    /// The block's K and V for every layer, as bytes.
    pub fn export_block(&self, block: usize) -> Result<Vec<u8>, KvError> {
        // SAFETY: only reserved blocks are written by peers, and the engine
        // exports cached blocks only.
        unsafe { self.arena.read_block(block) }.ok_or(KvError::NoSuchBlock {
            block,
            blocks: self.blocks,
        })
    }

    /// Overwrites the block with bytes from [`Self::export_block`].
    pub fn import_block(&mut self, block: usize, bytes: &[u8]) -> Result<(), KvError> {
        self.check(block)?;
        if bytes.len() != self.block_bytes() {
            return Err(KvError::BadLength {
                got: bytes.len(),
                expected: self.block_bytes(),
            });
        }
        // SAFETY: `&mut self`, and the engine imports into blocks it just
        // allocated (never a reserved one).
        unsafe { self.arena.write_block(block, bytes) };
        Ok(())
    }
}

impl dynamo_batcher::BlockData for KvCache {
    fn read(&mut self, idx: dynamo_batcher::BlockIdx) -> Option<Vec<u8>> {
        self.export_block(idx.0 as usize).ok()
    }
    fn write(&mut self, idx: dynamo_batcher::BlockIdx, bytes: &[u8]) -> bool {
        self.import_block(idx.0 as usize, bytes).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_round_trip_as_bytes_and_bad_input_is_refused() {
        let mut a = KvCache::new(2, 3, 4, 6).unwrap();
        for l in 0..2 {
            for s in 4..8 {
                let k: Vec<f32> = (0..6).map(|i| (l * 100 + s * 10 + i) as f32).collect();
                let v: Vec<f32> = k.iter().map(|x| -x).collect();
                a.write(l, s, &k, &v);
            }
        }
        let bytes = a.export_block(1).unwrap();
        assert_eq!(bytes.len(), a.block_bytes());
        // Layout: per layer, the block's K rows then its V rows.
        let f = |i: usize| f32::from_le_bytes(bytes[i * 4..i * 4 + 4].try_into().unwrap());
        let row = |r: usize| (0..6).map(|i| f(r * 6 + i)).collect::<Vec<f32>>();
        assert_eq!(row(0), a.k(0, 4));
        assert_eq!(row(3), a.k(0, 7));
        assert_eq!(row(4), a.v(0, 4));
        assert_eq!(row(8), a.k(1, 4));
        assert_eq!(row(15), a.v(1, 7));
        let mut b = KvCache::new(2, 3, 4, 6).unwrap();
        b.import_block(2, &bytes).unwrap();
        for l in 0..2 {
            for s in 0..4 {
                assert_eq!(a.k(l, 4 + s), b.k(l, 8 + s));
                assert_eq!(a.v(l, 4 + s), b.v(l, 8 + s));
            }
        }
        assert_eq!(b.export_block(2).unwrap(), bytes);
        assert!(matches!(
            b.import_block(3, &bytes),
            Err(KvError::NoSuchBlock { .. })
        ));
        assert!(matches!(
            b.import_block(0, &bytes[1..]),
            Err(KvError::BadLength { .. })
        ));
    }
}
