//! Weights in GPU memory (feature `cuda`): a finished, verified load lands
//! on a device, staged as the transfer crate's device regions are.
//!
//! A load verifies every chunk, and the whole file, in host memory: the
//! registered region peers read into, or memory of its own for a load
//! without peers. [`DeviceWeights::land`] then copies those bytes to the GPU chunk
//! by chunk, as the manifest cuts them, with the host memory page-locked
//! for the copy (`cuMemHostRegister`) so that it is DMA at PCIe speed
//! rather than the driver's pageable bounce path. Where the driver refuses
//! to lock it, the copy runs pageable, slower but the same.
//!
//! Invariants:
//! - nothing reaches the device before the whole file's hash matched (a
//!   [`Loaded`] exists only then);
//! - the host memory is locked for no longer than `land` runs: every copy
//!   is complete, and the memory unlocked, before it returns, on success
//!   and on error alike;
//! - [`DeviceWeights::verify`] reads the device copy back and checks it
//!   against the content hash.
//!
//! The driver library is loaded at run time (`cudarc`'s dynamic loading),
//! so a build with the feature needs no CUDA toolkit; a machine without a
//! driver or GPU gets [`FabricError::Cuda`] from [`dynamo_transfer::open_gpu`].

use crate::loader::{LoadError, Loaded};
use crate::manifest::{ContentHash, Manifest};
use cudarc::driver::{sys as cu, CudaContext, CudaSlice, CudaStream};
use dynamo_transfer::FabricError;
use sha2::{Digest, Sha256};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dynamo_transfer::cuda_error as cuda;

/// A model file's verified bytes in GPU memory.
pub struct DeviceWeights {
    manifest: Manifest,
    stream: Arc<CudaStream>,
    device: CudaSlice<u8>,
    /// How long the copy to the device took (not the allocation or the
    /// page-locking).
    pub elapsed: Duration,
    /// Whether the host memory was page-locked for the copy.
    pub pinned: bool,
}

/// Host memory page-locked for as long as this lives; every copy on
/// `stream` completes before it is unlocked.
struct Pinned<'a> {
    bytes: &'a [u8],
    stream: &'a Arc<CudaStream>,
}

impl<'a> Pinned<'a> {
    fn new(bytes: &'a [u8], stream: &'a Arc<CudaStream>) -> Result<Self, FabricError> {
        // SAFETY: `bytes` outlives the guard, which unlocks it in Drop
        // once the stream's copies are done; the driver only reads it.
        unsafe {
            cu::cuMemHostRegister_v2(bytes.as_ptr() as *mut _, bytes.len(), 0)
                .result()
                .map_err(cuda("cuMemHostRegister"))?;
        }
        Ok(Pinned { bytes, stream })
    }
}

impl Drop for Pinned<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.stream.synchronize() {
            tracing::warn!(error = %e, "weights: device copies did not finish cleanly");
        }
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: locked in `new`, and no copy from it is pending.
        if let Err(e) = unsafe { cu::cuMemHostUnregister(self.bytes.as_ptr() as *mut _) }.result() {
            tracing::warn!(error = %e, "weights: cuMemHostUnregister failed");
        }
    }
}

impl DeviceWeights {
    /// Copies a verified load's bytes to `ctx`'s GPU; `progress` gets the
    /// bytes queued for copying so far and the total after each chunk
    /// (all are copied when this returns). A [`Loaded`] is not `Sync`, so
    /// one load is never landed from two threads at once (its memory is
    /// locked once at a time).
    pub fn land(
        loaded: &Loaded,
        ctx: &Arc<CudaContext>,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Self, FabricError> {
        let bytes = loaded.bytes();
        let manifest = loaded.manifest.clone();
        ctx.bind_to_thread().map_err(cuda("cuCtxSetCurrent"))?;
        let stream = ctx.new_stream().map_err(cuda("cuStreamCreate"))?;
        let mut device = stream
            .alloc_zeros::<u8>(bytes.len().max(1))
            .map_err(cuda("cuMemAlloc"))?;
        let pin = match bytes.is_empty() {
            true => None,
            false => match Pinned::new(bytes, &stream) {
                Ok(p) => Some(p),
                Err(e) => {
                    tracing::info!(error = %e, "weights: host memory not page-locked; copying pageable");
                    None
                }
            },
        };
        let t0 = Instant::now();
        let chunk = manifest.chunk_size.max(1) as usize;
        let total = bytes.len() as u64;
        let mut off = 0usize;
        while off < bytes.len() {
            let end = (off + chunk).min(bytes.len());
            let mut dst = device.slice_mut(off..end);
            stream
                .memcpy_htod(&bytes[off..end], &mut dst)
                .map_err(cuda("cuMemcpyHtoDAsync"))?;
            off = end;
            progress(off as u64, total);
        }
        // Copies finish (an error of theirs is returned), then the memory
        // is unlocked (the guard's Drop, on every path).
        stream.synchronize().map_err(cuda("cuStreamSynchronize"))?;
        let elapsed = t0.elapsed();
        let pinned = pin.is_some();
        drop(pin);
        Ok(DeviceWeights {
            manifest,
            stream,
            device,
            elapsed,
            pinned,
        })
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The file's bytes on the device (`len()` of them).
    pub fn device(&self) -> &CudaSlice<u8> {
        &self.device
    }

    /// The device bytes, writable (tests, and engines that transform
    /// weights in place).
    pub fn device_mut(&mut self) -> &mut CudaSlice<u8> {
        &mut self.device
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn len(&self) -> usize {
        self.manifest.size as usize
    }

    pub fn is_empty(&self) -> bool {
        self.manifest.size == 0
    }

    /// Copies the device bytes back to the host.
    pub fn to_host(&self) -> Result<Vec<u8>, FabricError> {
        let mut out = vec![0u8; self.len()];
        if out.is_empty() {
            return Ok(out);
        }
        let src = self.device.slice(0..self.len());
        self.stream
            .memcpy_dtoh(&src, &mut out)
            .map_err(cuda("cuMemcpyDtoHAsync"))?;
        self.stream
            .synchronize()
            .map_err(cuda("cuStreamSynchronize"))?;
        Ok(out)
    }

    /// Reads the device copy back and checks it against the content hash.
    pub fn verify(&self) -> Result<(), LoadError> {
        let got = ContentHash(Sha256::digest(self.to_host()?).into());
        if got != self.manifest.sha256 {
            return Err(LoadError::DeviceMismatch {
                got: got.hex(),
                want: self.manifest.sha256.hex(),
            });
        }
        Ok(())
    }
}
