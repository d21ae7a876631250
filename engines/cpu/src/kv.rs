//! The paged KV store: for every layer, K and V rows of `kv_dim` floats in
//! slots; block `b` owns slots `b·block_size .. (b+1)·block_size`. Which
//! block holds what is decided by the shared `dynamo_batcher` pool; this
//! only holds the numbers.
//!
//! Invariants: memory is allocated zeroed and lazily touched, so resident
//! memory grows with the blocks actually used; an exported block is
//! `layers × (K, V) × block_size × kv_dim` little-endian f32s, and
//! importing it back restores the block exactly.

use thiserror::Error;

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
    /// `[layer][slot][kv_dim]`
    k: Vec<f32>,
    v: Vec<f32>,
}

impl KvCache {
    pub fn new(layers: usize, blocks: usize, block_size: usize, kv_dim: usize) -> Self {
        let n = layers * blocks * block_size * kv_dim;
        KvCache {
            layers,
            blocks,
            block_size,
            kv_dim,
            k: vec![0.0; n],
            v: vec![0.0; n],
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Bytes of one block across all layers (K and V).
    pub fn block_bytes(&self) -> usize {
        self.layers * 2 * self.block_size * self.kv_dim * 4
    }

    #[inline]
    fn at(&self, layer: usize, slot: usize) -> usize {
        (layer * self.blocks * self.block_size + slot) * self.kv_dim
    }

    #[inline]
    pub fn k(&self, layer: usize, slot: usize) -> &[f32] {
        let o = self.at(layer, slot);
        &self.k[o..o + self.kv_dim]
    }

    #[inline]
    pub fn v(&self, layer: usize, slot: usize) -> &[f32] {
        let o = self.at(layer, slot);
        &self.v[o..o + self.kv_dim]
    }

    pub fn write(&mut self, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        let o = self.at(layer, slot);
        self.k[o..o + self.kv_dim].copy_from_slice(k);
        self.v[o..o + self.kv_dim].copy_from_slice(v);
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
        self.check(block)?;
        let mut out = Vec::with_capacity(self.block_bytes());
        let n = self.block_size * self.kv_dim;
        for l in 0..self.layers {
            let o = self.at(l, block * self.block_size);
            for x in self.k[o..o + n].iter().chain(&self.v[o..o + n]) {
                out.extend_from_slice(&x.to_le_bytes());
            }
        }
        Ok(out)
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
        let n = self.block_size * self.kv_dim;
        let mut vals = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        for l in 0..self.layers {
            let o = self.at(l, block * self.block_size);
            for x in self.k[o..o + n].iter_mut() {
                *x = vals.next().unwrap_or_default();
            }
            for x in self.v[o..o + n].iter_mut() {
                *x = vals.next().unwrap_or_default();
            }
        }
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
        let mut a = KvCache::new(2, 3, 4, 6);
        for l in 0..2 {
            for s in 4..8 {
                let k: Vec<f32> = (0..6).map(|i| (l * 100 + s * 10 + i) as f32).collect();
                let v: Vec<f32> = k.iter().map(|x| -x).collect();
                a.write(l, s, &k, &v);
            }
        }
        let bytes = a.export_block(1).unwrap();
        assert_eq!(bytes.len(), a.block_bytes());
        let mut b = KvCache::new(2, 3, 4, 6);
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
