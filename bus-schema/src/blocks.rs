//! KV block identity, shared by every engine and the router.
//!
//! - Only full blocks of `block_size` tokens are hashed; a partial tail is not.
//! - `local[i]` = XXH3-64(seed = salt) over block `i`'s token ids as
//!   little-endian `u32` bytes.
//! - `seq[0] = local[0]`, `seq[i] = XXH3-64(seed = salt)(le(seq[i-1]) ++ le(local[i]))`,
//!   so a block's [`SequenceHash`] identifies its whole prefix.
//! - `salt` folds the model name (and, later, an adapter name) into the seed,
//!   so equal tokens under different models never share an identity.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Seed mixed into every salt (Dynamo uses the same constant).
pub const HASH_SEED: u64 = 1337;

/// Identity of one block *including its whole prefix*.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SequenceHash(pub u64);

/// The salt for a model (and optional adapter).
pub fn hash_salt(model: &str, adapter: Option<&str>) -> u64 {
    let mut bytes = model.as_bytes().to_vec();
    if let Some(a) = adapter {
        bytes.push(0);
        bytes.extend_from_slice(a.as_bytes());
    }
    xxh3_64_with_seed(&bytes, HASH_SEED)
}

/// Hash of one block's tokens on its own.
pub fn local_block_hash(tokens: &[u32], salt: u64) -> u64 {
    let mut buf = Vec::with_capacity(tokens.len() * 4);
    for t in tokens {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(&buf, salt)
}

/// Chains a block onto its parent's sequence hash.
pub fn chain(parent: Option<SequenceHash>, local: u64, salt: u64) -> SequenceHash {
    match parent {
        None => SequenceHash(local),
        Some(p) => {
            let mut buf = [0u8; 16];
            buf[..8].copy_from_slice(&p.0.to_le_bytes());
            buf[8..].copy_from_slice(&local.to_le_bytes());
            SequenceHash(xxh3_64_with_seed(&buf, salt))
        }
    }
}

/// Sequence hashes of every full block of `tokens`.
pub fn sequence_hashes(tokens: &[u32], block_size: usize, salt: u64) -> Vec<SequenceHash> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    let mut parent = None;
    for block in tokens.chunks_exact(block_size) {
        let h = chain(parent, local_block_hash(block, salt), salt);
        out.push(h);
        parent = Some(h);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_full_blocks_are_hashed_and_prefixes_share_hashes() {
        let a: Vec<u32> = (0..40).collect();
        let mut b = a.clone();
        b[35] = 999; // differs only in the partial/third block
        let salt = hash_salt("m", None);
        let ha = sequence_hashes(&a, 16, salt);
        let hb = sequence_hashes(&b, 16, salt);
        assert_eq!(ha.len(), 2);
        assert_eq!(ha, hb);
        let mut c = a.clone();
        c[0] = 7; // first block differs → every later hash differs too
        let hc = sequence_hashes(&c, 16, salt);
        assert_ne!(ha[0], hc[0]);
        assert_ne!(ha[1], hc[1]);
    }

    #[test]
    fn salt_separates_models() {
        let t: Vec<u32> = (0..16).collect();
        assert_ne!(
            sequence_hashes(&t, 16, hash_salt("a", None)),
            sequence_hashes(&t, 16, hash_salt("b", None))
        );
        assert_ne!(hash_salt("a", None), hash_salt("a", Some("lora")));
    }
}
