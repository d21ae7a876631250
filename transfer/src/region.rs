//! Registered memory: a [`Region`] owns its buffer and its registration,
//! a [`Window`] is a second registration over part of a region.
//!
//! Invariants: a region's memory stays allocated and registered while the
//! region lives (the registration is closed before the memory is freed);
//! every registration has a key of its own.

use crate::{sys, FabricError, Inner, RemoteRegion};

/// Zeroed memory for a region. Buffers of 2 MiB or more are 2 MiB aligned
/// and advised to use transparent huge pages: the kernel then pins and
/// copies them (shm's cross-memory attach, socket reads) with 512 times
/// fewer page-table entries.
pub(crate) struct Buffer {
    ptr: std::ptr::NonNull<u8>,
    layout: std::alloc::Layout,
}

const HUGE: usize = 2 << 20;

impl Buffer {
    pub(crate) fn zeroed(len: usize) -> Result<Self, FabricError> {
        let align = if len >= HUGE { HUGE } else { 64 };
        let layout = std::alloc::Layout::from_size_align(len, align).map_err(|_| {
            FabricError::OutOfRange {
                offset: 0,
                len: len as u64,
                size: isize::MAX as u64,
            }
        })?;
        // SAFETY: the layout has a non-zero size (callers ask for ≥ 1 byte).
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = std::ptr::NonNull::new(raw)
            .ok_or_else(|| FabricError::Completion(format!("cannot allocate {len} bytes")))?;
        if align == HUGE {
            // SAFETY: advice on memory we own; failure only loses the hint.
            unsafe {
                libc::madvise(raw.cast(), len - len % HUGE, libc::MADV_HUGEPAGE);
            }
        }
        Ok(Buffer { ptr, layout })
    }
    pub(crate) fn len(&self) -> usize {
        self.layout.size()
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

impl std::ops::DerefMut for Buffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len()) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
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
unsafe impl Send for Region {}

impl Region {
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

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: registered once in `Agent::register`.
        unsafe {
            sys::dfi_close(&mut (*self.mr).fid);
        }
    }
}
