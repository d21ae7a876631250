//! Registered memory: a [`Region`] owns its buffer and its registration,
//! a [`Window`] is a second registration over part of a region.
//!
//! Invariants: a region's memory stays allocated and registered while the
//! region lives (the registration is closed before the memory is freed);
//! every registration has a key of its own.

use crate::{sys, FabricError, Inner, RemoteRegion};

/// Zeroed host memory (a region's, or a load's that no peer writes into):
/// a private anonymous mapping of its own.
/// Buffers of 2 MiB or more are 2 MiB aligned and advised to use
/// transparent huge pages *before* any page is touched (a page faulted in
/// first stays a 4 KiB page): the kernel then pins and copies them (shm's
/// cross-memory attach, socket reads) with 512 times fewer page-table
/// entries, which measured 3.6 → 5.0 GB/s for a raw 64 MiB cross-memory
/// copy on the 2-vCPU VM of BENCHMARKS.md.
pub struct Buffer {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
    /// The whole mapping (`ptr` is aligned inside it).
    map: *mut libc::c_void,
    map_len: usize,
}

// SAFETY: the buffer owns its mapping. Outside this crate, shared access
// only reads it and writes need `&mut`; inside, reads posted into a
// region's buffer go through `&Region`, which is not `Sync`, so they never
// race a reader on another thread.
unsafe impl Send for Buffer {}
unsafe impl Sync for Buffer {}

const HUGE: usize = 2 << 20;

impl Buffer {
    /// `len` zeroed bytes (at least one is mapped).
    pub fn zeroed(len: usize) -> Result<Self, FabricError> {
        let align = if len >= HUGE { HUGE } else { 1 };
        let map_len = len
            .max(1)
            .checked_add(align - 1)
            .filter(|&l| l <= isize::MAX as usize)
            .ok_or(FabricError::OutOfRange {
                offset: 0,
                len: len as u64,
                size: isize::MAX as u64,
            })?;
        // SAFETY: a fresh private anonymous mapping (zero-filled on first touch).
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(FabricError::Completion(format!(
                "cannot map {len} bytes: {}",
                std::io::Error::last_os_error()
            )));
        }
        let start = (map as usize).next_multiple_of(align);
        if align == HUGE {
            // SAFETY: advice on memory we own, before any page is touched;
            // failure only loses the hint.
            unsafe {
                libc::madvise(
                    start as *mut libc::c_void,
                    len - len % HUGE,
                    libc::MADV_HUGEPAGE,
                );
            }
        }
        let ptr = std::ptr::NonNull::new(start as *mut u8)
            .ok_or_else(|| FabricError::Completion("null mapping".into()))?;
        Ok(Buffer {
            ptr,
            len,
            map,
            map_len,
        })
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub(crate) fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }
    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl std::ops::Deref for Buffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len` initialised (zeroed) bytes owned by this buffer.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len()) }
    }
}

impl AsRef<[u8]> for Buffer {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl std::ops::DerefMut for Buffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len()) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: mapped in `zeroed` with this length.
        unsafe { libc::munmap(self.map, self.map_len) };
    }
}

/// A second registration of part of a [`Region`] (see [`Agent::window`]);
/// closed when dropped.
pub struct Window {
    pub(crate) _owner: std::sync::Arc<Inner>,
    pub(crate) mr: *mut sys::fid_mr,
    pub(crate) remote: RemoteRegion,
}

// SAFETY: the MR handle is only closed in Drop.
unsafe impl Send for Window {}
unsafe impl Sync for Window {}

impl Window {
    /// The descriptor peers write with (offset 0 is the window's start).
    pub fn remote(&self) -> RemoteRegion {
        self.remote
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        // SAFETY: registered once in `Agent::window`.
        unsafe {
            sys::dfi_close(&mut (*self.mr).fid);
        }
    }
}

/// A registered buffer.
pub struct Region {
    pub(crate) _owner: std::sync::Arc<Inner>,
    pub(crate) mr: *mut sys::fid_mr,
    pub(crate) desc: *mut libc::c_void,
    pub(crate) buf: Buffer,
    pub(crate) remote: RemoteRegion,
}

// SAFETY: the region's memory is owned; the MR handle is only closed in Drop.
// Not `Sync`: reads are posted into it through `&Region` ([`crate::WriteOp`]).
unsafe impl Send for Region {}

impl Region {
    /// The bytes. A read posted into this region (a `WriteOp` naming it
    /// as its local region) writes them: do not hold them across one.
    pub fn bytes(&self) -> &[u8] {
        &self.buf
    }
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.buf
    }
    /// The descriptor peers write with.
    pub fn remote(&self) -> RemoteRegion {
        self.remote
    }
}

/// A region nothing writes any more: registered for remote reads only
/// (see [`crate::Agent::freeze`]), its bytes shared read-only between
/// threads, as weights an engine computes with while peers read them.
pub struct FrozenRegion(pub(crate) Region);

// SAFETY: no operation can be posted into a frozen region (it is never a
// `WriteOp`'s local region) and peers may only read it, so shared access
// only reads its bytes.
unsafe impl Sync for FrozenRegion {}

impl FrozenRegion {
    pub fn bytes(&self) -> &[u8] {
        self.0.bytes()
    }
    /// The descriptor peers read with.
    pub fn remote(&self) -> RemoteRegion {
        self.0.remote
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: registered once in `Agent::register`.
        unsafe {
            sys::dfi_close(&mut (*self.mr).fid);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_zeroed_writable_and_large_ones_huge_page_aligned() {
        for len in [1, 100, 4096, HUGE, 3 * HUGE + 5] {
            let mut b = Buffer::zeroed(len).unwrap();
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 0));
            b.fill(7);
            assert!(b.iter().all(|&x| x == 7));
            let align = if len >= HUGE { HUGE } else { 4096 };
            assert_eq!(b.as_ptr() as usize % align, 0, "len {len}");
        }
    }
}
