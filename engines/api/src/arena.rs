//! The memory an engine keeps its KV blocks in, shared with the transfer
//! layer so a peer can write blocks straight into reserved pool blocks
//! (disaggregated prefill) instead of into a buffer the engine copies from.
//!
//! Invariants:
//! - block `b` is bytes `b·block_bytes .. (b+1)·block_bytes`; the arena
//!   never moves or shrinks while any `Arc<KvArena>` lives, so a
//!   registration over it stays valid as long as its holder keeps a clone;
//! - memory is reserved, not committed: pages are zero until written and
//!   count towards the process only once touched (a mocker's arena of many
//!   gigabytes costs nothing until blocks land in it);
//! - no Rust reference ever spans the whole arena: the engine reads and
//!   writes through [`KvArena::as_ptr`] one row or block at a time, so a
//!   peer writing a *reserved* block concurrently never aliases anything
//!   the engine holds (the engine touches a reserved block only after the
//!   reservation is committed).

use thiserror::Error;

#[derive(Debug, Error, PartialEq)]
pub enum ArenaError {
    #[error("a KV arena of {blocks} blocks × {block_bytes} bytes is empty or too large")]
    BadSize { blocks: usize, block_bytes: usize },
    #[error("cannot reserve {bytes} bytes for the KV arena: {reason}")]
    Map { bytes: usize, reason: String },
}

/// Zeroed, page-aligned memory of `blocks × block_bytes` bytes.
pub struct KvArena {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
    blocks: usize,
    block_bytes: usize,
}

// SAFETY: the arena is plain memory; who may touch which block when is the
// engine's reservation protocol (see the module invariants), and every
// access goes through raw pointers.
unsafe impl Send for KvArena {}
unsafe impl Sync for KvArena {}

const PAGE: usize = 4096;

impl KvArena {
    pub fn new(blocks: usize, block_bytes: usize) -> Result<Self, ArenaError> {
        let len = blocks
            .checked_mul(block_bytes)
            .filter(|&l| l > 0 && l <= isize::MAX as usize)
            .ok_or(ArenaError::BadSize {
                blocks,
                block_bytes,
            })?;
        // SAFETY: a fresh private anonymous mapping; NORESERVE because
        // pages are committed only when touched (the pool of a mocker or a
        // large context may exceed what the machine would ever touch).
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(ArenaError::Map {
                bytes: len,
                reason: std::io::Error::last_os_error().to_string(),
            });
        }
        // SAFETY: advice on the mapping we own; failure only loses the hint
        // (huge pages: a peer's write pins and copies 512× fewer pages).
        unsafe { libc::madvise(raw, len, libc::MADV_HUGEPAGE) };
        let ptr = std::ptr::NonNull::new(raw.cast::<u8>()).ok_or(ArenaError::Map {
            bytes: len,
            reason: "null mapping".into(),
        })?;
        Ok(KvArena {
            ptr,
            len,
            blocks,
            block_bytes,
        })
    }

    /// Start of the arena (page-aligned).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn blocks(&self) -> usize {
        self.blocks
    }
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Byte range of block `b`, or `None` outside the arena.
    pub fn block_range(&self, b: usize) -> Option<std::ops::Range<usize>> {
        (b < self.blocks).then(|| b * self.block_bytes..(b + 1) * self.block_bytes)
    }

    /// Copies block `b` out.
    ///
    /// # Safety
    /// Nobody may write block `b` meanwhile (it is not reserved for a peer).
    pub unsafe fn read_block(&self, b: usize) -> Option<Vec<u8>> {
        let r = self.block_range(b)?;
        // SAFETY: in bounds; no concurrent writer per the contract.
        Some(unsafe { std::slice::from_raw_parts(self.as_ptr().add(r.start), r.len()) }.to_vec())
    }

    /// Overwrites block `b` with `bytes` (exactly one block).
    ///
    /// # Safety
    /// Nobody may read or write block `b` meanwhile.
    pub unsafe fn write_block(&self, b: usize, bytes: &[u8]) -> bool {
        match self.block_range(b) {
            Some(r) if bytes.len() == r.len() => {
                // SAFETY: in bounds, exclusive per the contract.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        bytes.as_ptr(),
                        self.as_ptr().add(r.start),
                        r.len(),
                    )
                };
                true
            }
            _ => false,
        }
    }

    /// Gives the whole pages inside block `b` back to the system (they read
    /// as zeros afterwards): for an engine that keeps no data in its blocks
    /// once it has checked them (the mocker).
    ///
    /// # Safety
    /// Nobody may read or write block `b` meanwhile, and no peer may still
    /// write it (its registration is closed).
    pub unsafe fn discard_block(&self, b: usize) {
        let Some(r) = self.block_range(b) else {
            return;
        };
        let start = r.start.next_multiple_of(PAGE);
        let end = r.end - r.end % PAGE;
        if end > start {
            // SAFETY: whole pages of our mapping, unused per the contract.
            unsafe {
                libc::madvise(
                    self.as_ptr().add(start).cast(),
                    end - start,
                    libc::MADV_DONTNEED,
                )
            };
        }
    }
}

impl Drop for KvArena {
    fn drop(&mut self) {
        // SAFETY: mapped in `new` with this length; no Arc clone is left.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

impl std::fmt::Debug for KvArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvArena")
            .field("blocks", &self.blocks)
            .field("block_bytes", &self.block_bytes)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_zeroed_writable_discardable_and_bounded() {
        let a = KvArena::new(3, 3 * PAGE + 100).unwrap();
        assert_eq!(a.as_ptr() as usize % PAGE, 0);
        assert_eq!(a.len(), 3 * (3 * PAGE + 100));
        // SAFETY: this test is the only user of the arena.
        unsafe {
            assert!(a.read_block(1).unwrap().iter().all(|&x| x == 0));
            let data: Vec<u8> = (0..a.block_bytes()).map(|i| (i % 251) as u8).collect();
            assert!(a.write_block(1, &data));
            assert_eq!(a.read_block(1).unwrap(), data);
            assert!(a.read_block(0).unwrap().iter().all(|&x| x == 0));
            assert!(a.read_block(2).unwrap().iter().all(|&x| x == 0));
            assert!(!a.write_block(1, &data[1..]));
            assert!(!a.write_block(3, &data));
            assert!(a.read_block(3).is_none());
            a.discard_block(1);
            // Whole pages inside the block read as zeros again; the bytes
            // sharing a page with a neighbour are kept.
            let after = a.read_block(1).unwrap();
            let head = PAGE - a.block_bytes() % PAGE;
            assert_eq!(after[..head], data[..head]);
            assert!(after[head..head + 2 * PAGE].iter().all(|&x| x == 0));
        }
        assert!(matches!(
            KvArena::new(0, 10),
            Err(ArenaError::BadSize { .. })
        ));
        assert!(matches!(
            KvArena::new(usize::MAX, 2),
            Err(ArenaError::BadSize { .. })
        ));
    }
}
