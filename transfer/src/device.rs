//! KV blocks in GPU memory (feature `cuda`): a [`DeviceRegion`] is device
//! memory that peers write into, and that this side sends from.
//!
//! The provider must either take the device pointer itself (`FI_HMEM`
//! with `FI_HMEM_CUDA`, GPUDirect RDMA) or see host memory. Debian's
//! libfabric 1.17 is built without CUDA support (no `cu*` symbol in the
//! library, and its tcp and shm providers do not offer `FI_HMEM`), so a
//! device region here moves bytes through a *staging* region: host memory
//! registered with libfabric and page-locked with the CUDA driver
//! (`cuMemHostRegister`), so that the copies to and from the GPU are DMA
//! at PCIe speed rather than the driver's pageable bounce path.
//!
//! Flow: the sender calls [`DeviceRegion::stage`] (device → staging) and
//! writes from [`DeviceRegion::staging`]; the receiver hands out
//! [`DeviceRegion::remote`], waits for the write's notice, and calls
//! [`DeviceRegion::land`] (staging → device).
//!
//! Invariants: the staging memory is page-locked for exactly as long as
//! the region lives (unlocked before it is deregistered and freed); every
//! copy is complete when `stage` or `land` returns; ranges are checked
//! before any copy.
//!
//! The driver library is loaded at run time (`cudarc`'s dynamic loading):
//! a build with the feature needs no CUDA toolkit, and fails with
//! [`FabricError::Cuda`] where no driver or GPU is found.

use crate::{Agent, FabricError, Region, RemoteRegion};
use cudarc::driver::{sys as cu, CudaContext, CudaSlice, CudaStream};
use std::sync::Arc;

/// Maps a CUDA driver error of `call` onto [`FabricError::Cuda`] (for
/// `map_err`).
pub fn cuda(call: &'static str) -> impl Fn(cudarc::driver::DriverError) -> FabricError {
    move |e| FabricError::Cuda {
        call,
        message: e.to_string(),
    }
}

/// Opens GPU `ordinal`'s primary context, or says why not: no driver
/// library (checked with `dlopen` first, since the loader in `cudarc`
/// panics when it finds none), no such GPU, or a driver error.
pub fn open_gpu(ordinal: usize) -> Result<Arc<CudaContext>, FabricError> {
    let found = ["libcuda.so.1", "libcuda.so"].iter().any(|name| {
        let name = std::ffi::CString::new(*name).expect("no NUL in a literal");
        // SAFETY: dlopen with a valid C string; the handle is released at once
        // (cudarc opens the library again itself).
        unsafe {
            let h = libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
            if h.is_null() {
                false
            } else {
                libc::dlclose(h);
                true
            }
        }
    });
    if !found {
        return Err(FabricError::Cuda {
            call: "dlopen(libcuda.so.1)",
            message: "no CUDA driver library on this machine".into(),
        });
    }
    std::panic::catch_unwind(|| CudaContext::new(ordinal))
        .map_err(|_| FabricError::Cuda {
            call: "cuInit",
            message: "the CUDA driver could not be loaded".into(),
        })?
        .map_err(cuda("cuDevicePrimaryCtxRetain"))
}

/// Device memory reachable by peers through a page-locked staging region.
pub struct DeviceRegion {
    stream: Arc<CudaStream>,
    device: CudaSlice<u8>,
    staging: Region,
}

impl DeviceRegion {
    /// `len` zeroed bytes on `ctx`'s GPU, plus their registered staging
    /// region on `agent`.
    pub fn new(agent: &mut Agent, ctx: &Arc<CudaContext>, len: usize) -> Result<Self, FabricError> {
        let stream = ctx.new_stream().map_err(cuda("cuStreamCreate"))?;
        let device = stream
            .alloc_zeros::<u8>(len.max(1))
            .map_err(cuda("cuMemAlloc"))?;
        let mut staging = agent.register(len.max(1))?;
        ctx.bind_to_thread().map_err(cuda("cuCtxSetCurrent"))?;
        let bytes = staging.bytes_mut();
        // SAFETY: the staging buffer is owned by `staging`, which this
        // region keeps, and is unregistered in Drop before it is freed.
        unsafe {
            cu::cuMemHostRegister_v2(bytes.as_mut_ptr().cast(), bytes.len(), 0)
                .result()
                .map_err(cuda("cuMemHostRegister"))?;
        }
        Ok(DeviceRegion {
            stream,
            device,
            staging,
        })
    }

    pub fn len(&self) -> usize {
        self.device.len()
    }

    pub fn is_empty(&self) -> bool {
        self.device.is_empty()
    }

    /// What a peer writes into (the staging region's descriptor).
    pub fn remote(&self) -> RemoteRegion {
        self.staging.remote()
    }

    /// The registered host side, the `local` of writes sent from here.
    pub fn staging(&self) -> &Region {
        &self.staging
    }

    /// The GPU memory, for kernels and tests.
    pub fn device(&self) -> &CudaSlice<u8> {
        &self.device
    }

    pub fn device_mut(&mut self) -> &mut CudaSlice<u8> {
        &mut self.device
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), FabricError> {
        if offset.checked_add(len).is_none_or(|end| end > self.len()) {
            return Err(FabricError::OutOfRange {
                offset: offset as u64,
                len: len as u64,
                size: self.len() as u64,
            });
        }
        Ok(())
    }

    /// Copies `device[offset..offset + len]` to the staging region, ready
    /// to be written to a peer; complete on return.
    pub fn stage(&mut self, offset: usize, len: usize) -> Result<(), FabricError> {
        self.check(offset, len)?;
        let src = self.device.slice(offset..offset + len);
        let dst = &mut self.staging.bytes_mut()[offset..offset + len];
        self.stream
            .memcpy_dtoh(&src, dst)
            .map_err(cuda("cuMemcpyDtoHAsync"))?;
        self.stream
            .synchronize()
            .map_err(cuda("cuStreamSynchronize"))
    }

    /// Copies `staging[offset..offset + len]` (what a peer wrote) into the
    /// device memory; complete on return.
    pub fn land(&mut self, offset: usize, len: usize) -> Result<(), FabricError> {
        self.check(offset, len)?;
        let src = &self.staging.bytes()[offset..offset + len];
        let mut dst = self.device.slice_mut(offset..offset + len);
        self.stream
            .memcpy_htod(src, &mut dst)
            .map_err(cuda("cuMemcpyHtoDAsync"))?;
        self.stream
            .synchronize()
            .map_err(cuda("cuStreamSynchronize"))
    }
}

impl Drop for DeviceRegion {
    fn drop(&mut self) {
        // Pending copies finish before the memory is unlocked; a failure
        // here leaves nothing to recover, so it is only ignored.
        let _ = self.stream.synchronize();
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: locked once in `new`; `staging` is dropped after this.
        unsafe {
            let _ = cu::cuMemHostUnregister(self.staging.bytes_mut().as_mut_ptr().cast());
        }
    }
}
