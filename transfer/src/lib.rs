//! `dynamo-transfer`: moving KV blocks between workers over libfabric.
//!
//! An [`Agent`] owns one reliable-datagram endpoint (fabric, domain,
//! address vector, completion queue). A [`Region`] is a buffer registered
//! for remote writes; its [`RemoteRegion`] descriptor (key, base, length)
//! is what a peer needs to write into it, and it serializes for the bus.
//! [`Agent::write`] posts a one-sided write and waits for its completion,
//! making progress on the way; the target must call [`Agent::progress`]
//! (the tcp and shm providers progress manually).
//!
//! Invariants: every libfabric object is closed exactly once, in reverse
//! order of creation; a region's memory stays allocated and registered
//! while the region lives; memory-region keys are unique per process; a
//! write either completes, fails with the provider's error, or times out:
//! it never waits forever. Every operation carries a tag of its own (its
//! completion context), so a late completion of an operation its waiter
//! gave up on is never counted for another one; a region such an operation
//! still uses is kept by the agent ([`Agent::bury`]) until that completion
//! arrives, and freed then.

use dynamo_fabric_sys as sys;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use thiserror::Error;

#[cfg(feature = "cuda")]
mod device;
mod progress;
mod region;

#[cfg(feature = "cuda")]
pub use device::{cuda as cuda_error, open_gpu, DeviceRegion};

pub use progress::{Expecting, Progress, IDLE_POLL};
use region::Buffer;
pub use region::{Buffer as HostBuffer, FrozenRegion, Region, Window};

#[derive(Debug, Error, PartialEq)]
pub enum FabricError {
    #[error("libfabric {call} failed: {message} ({code})")]
    Call {
        call: &'static str,
        code: i64,
        message: String,
    },
    #[error("provider {0:?} is not available here")]
    NoProvider(String),
    #[error("write of {len} bytes at offset {offset} does not fit a region of {size} bytes")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    #[error("peer address is malformed ({0} bytes)")]
    BadAddress(usize),
    #[error("write did not complete within {0:?}")]
    Timeout(Duration),
    #[error("write failed on completion: {0}")]
    Completion(String),
    #[error("CUDA {call} failed: {message}")]
    Cuda { call: &'static str, message: String },
}

fn check(call: &'static str, rc: i64) -> Result<(), FabricError> {
    if rc >= 0 {
        return Ok(());
    }
    // SAFETY: fi_strerror returns a static string for any code.
    let message = unsafe { CStr::from_ptr(sys::fi_strerror((-rc) as i32)) }
        .to_string_lossy()
        .into_owned();
    Err(FabricError::Call {
        call,
        code: rc,
        message,
    })
}

/// Gives SIGINT, SIGTERM, SIGQUIT, SIGHUP, SIGABRT and SIGILL back their
/// default dispositions. Debian's libfabric 1.17 links libpsm2 and
/// libpsm_infinipath, whose load-time constructors install handlers for
/// them that write a backtrace file and `exit(1)`; a process that handles
/// SIGTERM itself (graceful shutdown) must call this first thing in
/// `main`, before installing its own handlers, or those chain to psm's and
/// the process exits at once.
pub fn reset_inherited_signal_handlers() {
    for sig in [
        libc::SIGINT,
        libc::SIGTERM,
        libc::SIGQUIT,
        libc::SIGHUP,
        libc::SIGABRT,
        libc::SIGILL,
    ] {
        // SAFETY: restoring a default disposition has no preconditions.
        unsafe {
            libc::signal(sig, libc::SIG_DFL);
        }
    }
}

/// Unique memory-region keys: providers with `mr_mode` 0 take the key we ask for.
static NEXT_KEY: AtomicU64 = AtomicU64::new(1);
/// Unique operation tags (the completion context of each posted operation).
static NEXT_OP: AtomicU64 = AtomicU64::new(1);

/// A peer inserted into this agent's address vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer(sys::fi_addr_t);

/// What a peer needs to write into a [`Region`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteRegion {
    pub key: u64,
    /// Address of offset 0 as the provider expects it (0 unless the
    /// provider uses virtual addresses).
    pub base: u64,
    pub len: u64,
}

/// The libfabric objects of one agent; regions hold it too, so the domain
/// outlives every memory region registered in it.
struct Inner {
    info: *mut sys::fi_info,
    fabric: *mut sys::fid_fabric,
    domain: *mut sys::fid_domain,
    av: *mut sys::fid_av,
    cq: *mut sys::fid_cq,
    ep: *mut sys::fid_ep,
}

// SAFETY: the domain is opened with FI_THREAD_SAFE; the objects are only
// closed in Drop, when no agent or region refers to them any more.
unsafe impl Send for Inner {}
unsafe impl Sync for Inner {}

/// One write: a range of a local region to an offset of a peer's region.
#[derive(Clone, Copy)]
pub struct WriteOp<'a> {
    pub local: &'a Region,
    pub offset: usize,
    pub len: usize,
    pub peer: Peer,
    pub remote: &'a RemoteRegion,
    pub remote_offset: u64,
    /// Writes only: a notice for the target's completion queue
    /// ([`Agent::take_notice`]), delivered with the data.
    pub notify: Option<u64>,
}

#[derive(Clone, Copy)]
enum Rma {
    Write(Option<u64>),
    Read,
}

/// One endpoint on one provider.
pub struct Agent {
    inner: std::sync::Arc<Inner>,
    virt_addr: bool,
    provider: String,
    /// Notices (remote CQ data of peers' [`WriteOp::notify`] writes) read
    /// from the completion queue and not yet taken.
    notices: std::sync::Arc<std::sync::Mutex<std::collections::HashSet<u64>>>,
    /// Completions of operations a waiter still waits for, by tag.
    completed: HashMap<u64, Result<(), String>>,
    /// Operations whose waiter gave up (timeout, error), by tag, with the
    /// key of the local region each one uses.
    abandoned: HashMap<u64, u64>,
    /// Regions kept (by key) until every abandoned operation on them completes.
    buried: HashMap<u64, Region>,
}

impl Agent {
    /// Opens an RDM endpoint on `provider` (e.g. `tcp;ofi_rxm`, `shm`).
    pub fn new(provider: &str) -> Result<Self, FabricError> {
        // SAFETY: plain libfabric object construction; every pointer is
        // checked and owned by the returned agent (closed in Drop).
        unsafe {
            let hints = sys::dfi_allocinfo();
            if hints.is_null() {
                return Err(FabricError::NoProvider(provider.into()));
            }
            (*hints).caps = (sys::FI_RMA
                | sys::FI_WRITE
                | sys::FI_READ
                | sys::FI_REMOTE_WRITE
                | sys::FI_REMOTE_READ) as u64;
            // Notices ride on writes as 8 bytes of remote CQ data.
            (*(*hints).domain_attr).cq_data_size = 8;
            (*(*hints).ep_attr).type_ = sys::fi_ep_type_FI_EP_RDM;
            (*(*hints).domain_attr).threading = sys::fi_threading_FI_THREAD_SAFE;
            // A write completes only once its data is visible at the target.
            (*(*hints).tx_attr).op_flags = sys::FI_DELIVERY_COMPLETE as u64;
            (*(*hints).domain_attr).mr_mode = (sys::FI_MR_LOCAL
                | sys::FI_MR_VIRT_ADDR
                | sys::FI_MR_ALLOCATED
                | sys::FI_MR_PROV_KEY
                | sys::FI_MR_ENDPOINT) as i32;
            let name =
                CString::new(provider).map_err(|_| FabricError::NoProvider(provider.into()))?;
            (*(*hints).fabric_attr).prov_name = libc::strdup(name.as_ptr());
            let mut info = ptr::null_mut();
            let rc = sys::fi_getinfo(
                sys::dfi_version(),
                ptr::null(),
                ptr::null(),
                0,
                hints,
                &mut info,
            );
            sys::fi_freeinfo(hints);
            if rc != 0 || info.is_null() {
                return Err(FabricError::NoProvider(provider.into()));
            }
            let virt_addr = ((*(*info).domain_attr).mr_mode & sys::FI_MR_VIRT_ADDR as i32) != 0;
            // Dropped (closing whatever was opened) if a step below fails.
            let mut a = Inner {
                info,
                fabric: ptr::null_mut(),
                domain: ptr::null_mut(),
                av: ptr::null_mut(),
                cq: ptr::null_mut(),
                ep: ptr::null_mut(),
            };
            check(
                "fi_fabric",
                sys::fi_fabric((*info).fabric_attr, &mut a.fabric, ptr::null_mut()) as i64,
            )?;
            check(
                "fi_domain",
                sys::dfi_domain(a.fabric, info, &mut a.domain, ptr::null_mut()) as i64,
            )?;
            let mut av_attr = sys::fi_av_attr {
                type_: sys::fi_av_type_FI_AV_TABLE,
                ..Default::default()
            };
            check(
                "fi_av_open",
                sys::dfi_av_open(a.domain, &mut av_attr, &mut a.av, ptr::null_mut()) as i64,
            )?;
            let mut cq_attr = sys::fi_cq_attr {
                format: sys::fi_cq_format_FI_CQ_FORMAT_DATA,
                size: 1024,
                ..Default::default()
            };
            check(
                "fi_cq_open",
                sys::dfi_cq_open(a.domain, &mut cq_attr, &mut a.cq, ptr::null_mut()) as i64,
            )?;
            check(
                "fi_endpoint",
                sys::dfi_endpoint(a.domain, info, &mut a.ep, ptr::null_mut()) as i64,
            )?;
            check(
                "fi_ep_bind(av)",
                sys::dfi_ep_bind(a.ep, &mut (*a.av).fid, 0) as i64,
            )?;
            check(
                "fi_ep_bind(cq)",
                sys::dfi_ep_bind(a.ep, &mut (*a.cq).fid, (sys::FI_SEND | sys::FI_RECV) as u64)
                    as i64,
            )?;
            check("fi_enable", sys::dfi_enable(a.ep) as i64)?;
            Ok(Agent {
                inner: std::sync::Arc::new(a),
                virt_addr,
                provider: provider.into(),
                notices: Default::default(),
                completed: HashMap::new(),
                abandoned: HashMap::new(),
                buried: HashMap::new(),
            })
        }
    }

    pub fn provider(&self) -> &str {
        &self.provider
    }

    /// This endpoint's address, for peers to insert.
    pub fn address(&self) -> Result<Vec<u8>, FabricError> {
        let mut buf = vec![0u8; 256];
        let mut len = buf.len();
        // SAFETY: the buffer is `len` bytes long; the endpoint is open.
        let rc = unsafe {
            sys::dfi_getname(&mut (*self.inner.ep).fid, buf.as_mut_ptr().cast(), &mut len)
        };
        check("fi_getname", rc as i64)?;
        buf.truncate(len);
        Ok(buf)
    }

    /// Makes a peer addressable.
    pub fn insert_peer(&mut self, address: &[u8]) -> Result<Peer, FabricError> {
        if address.is_empty() || address.len() > 256 {
            return Err(FabricError::BadAddress(address.len()));
        }
        let mut out: sys::fi_addr_t = 0;
        // SAFETY: one address of the provider's format; `out` receives its handle.
        let rc = unsafe {
            sys::dfi_av_insert(
                self.inner.av,
                address.as_ptr().cast(),
                1,
                &mut out,
                0,
                ptr::null_mut(),
            )
        };
        if rc != 1 {
            check(
                "fi_av_insert",
                if rc < 0 {
                    rc as i64
                } else {
                    -(libc::EINVAL as i64)
                },
            )?;
        }
        Ok(Peer(out))
    }

    /// Allocates `len` zeroed bytes registered for local and remote access.
    pub fn register(&mut self, len: usize) -> Result<Region, FabricError> {
        let mut buf = Buffer::zeroed(len.max(1))?;
        // SAFETY: the buffer lives in the region, which closes the MR before freeing it.
        let (mr, remote) = unsafe { self.register_raw(buf.as_mut_ptr(), buf.len())? };
        Ok(Region {
            _owner: self.inner.clone(),
            // SAFETY: `mr` was just registered.
            desc: unsafe { sys::dfi_mr_desc(mr) },
            mr,
            buf,
            remote,
        })
    }

    /// Freezes `region` (registered by this agent): it is registered again
    /// for remote reads only, under a new key, and the old registration
    /// (which let peers write) is closed, so from then on nothing writes
    /// its bytes (a [`Window`] over it must not outlive the freeze).
    /// Whether a peer's write through the new key is refused is the
    /// provider's check of the access flags: `tcp;ofi_rxm` and `shm`
    /// refuse it (`transfer/tests/loopback.rs`); other providers are
    /// not tested here. Fails if the region is another agent's (it is then
    /// dropped: only its owner knows what is pending on it), if an
    /// operation given up on may still write it (it is then buried), if
    /// the new registration fails (the region is dropped), or if the old
    /// one cannot be closed (its memory is then leaked, never freed under
    /// a registration that may still be live).
    pub fn freeze(&mut self, mut region: Region) -> Result<FrozenRegion, FabricError> {
        if !std::sync::Arc::ptr_eq(&region._owner, &self.inner) {
            return Err(FabricError::Completion(
                "a region is frozen by the agent that registered it".into(),
            ));
        }
        if self.abandoned.values().any(|k| *k == region.remote.key) {
            self.bury(region);
            return Err(FabricError::Completion(
                "a region with operations still pending cannot be frozen".into(),
            ));
        }
        // Peers may read it; nothing local reads into it any more.
        let access = sys::FI_REMOTE_READ as u64;
        let len = region.buf.len();
        // SAFETY: the buffer lives in the region, which closes the MR
        // before freeing it.
        let (mr, remote) = unsafe { self.register_access(region.buf.as_mut_ptr(), len, access)? };
        // SAFETY: the old registration was opened once, and nothing is
        // pending on it (checked above).
        let closed = unsafe { sys::dfi_close(&mut (*region.mr).fid) };
        if closed != 0 {
            // SAFETY: registered just above, and used by nothing.
            unsafe { sys::dfi_close(&mut (*mr).fid) };
            // The writable registration may still be live: its memory is
            // never freed.
            std::mem::forget(region);
            return Err(FabricError::Completion(format!(
                "closing the writable registration failed: error {closed}"
            )));
        }
        region.mr = mr;
        // SAFETY: `mr` was just registered.
        region.desc = unsafe { sys::dfi_mr_desc(mr) };
        region.remote = remote;
        Ok(FrozenRegion(region))
    }

    /// Registers `region[offset..offset + len]` once more, under a key of
    /// its own: a peer can write there through the returned window's
    /// descriptor only while the window lives. Closing a window fences off
    /// late writes (a peer that timed out and wrote anyway) from whatever
    /// the bytes are reused for next.
    ///
    /// # Safety
    /// `region` must outlive the window, and is not frozen
    /// ([`Self::freeze`]) while the window lives.
    pub unsafe fn window(
        &mut self,
        region: &mut Region,
        offset: usize,
        len: usize,
    ) -> Result<Window, FabricError> {
        if len == 0 || offset + len > region.buf.len() {
            return Err(FabricError::OutOfRange {
                offset: offset as u64,
                len: len as u64,
                size: region.buf.len() as u64,
            });
        }
        // SAFETY: the range is inside the region, which the caller keeps alive.
        unsafe { self.window_at(region.buf.as_mut_ptr().add(offset), len) }
    }

    /// Registers `len` bytes of memory owned elsewhere (an engine's KV
    /// pool) as a window of its own, as [`Self::window`] does for part of a
    /// region: peers write there only while the window lives.
    ///
    /// # Safety
    /// The `len` bytes at `ptr` must stay allocated until the window is
    /// dropped, and nothing may read or write them while a peer can.
    pub unsafe fn window_at(&mut self, ptr: *mut u8, len: usize) -> Result<Window, FabricError> {
        if len == 0 || ptr.is_null() {
            return Err(FabricError::OutOfRange {
                offset: ptr as u64,
                len: len as u64,
                size: 0,
            });
        }
        // SAFETY: per this function's contract.
        let (mr, remote) = unsafe { self.register_raw(ptr, len)? };
        Ok(Window {
            _owner: self.inner.clone(),
            mr,
            remote,
        })
    }

    /// Registers `len` bytes at `ptr` for local and remote access under a
    /// fresh key (binding it to the endpoint where the provider asks).
    ///
    /// # Safety
    /// The memory must stay valid until the returned MR is closed.
    unsafe fn register_raw(
        &mut self,
        ptr: *mut u8,
        len: usize,
    ) -> Result<(*mut sys::fid_mr, RemoteRegion), FabricError> {
        let access =
            (sys::FI_READ | sys::FI_WRITE | sys::FI_REMOTE_READ | sys::FI_REMOTE_WRITE) as u64;
        // SAFETY: per this function's contract.
        unsafe { self.register_access(ptr, len, access) }
    }

    /// [`Self::register_raw`] with the given access flags.
    ///
    /// # Safety
    /// As [`Self::register_raw`].
    unsafe fn register_access(
        &mut self,
        ptr: *mut u8,
        len: usize,
        access: u64,
    ) -> Result<(*mut sys::fid_mr, RemoteRegion), FabricError> {
        let key = NEXT_KEY.fetch_add(1, Ordering::Relaxed);
        let mut mr = ptr::null_mut();
        // SAFETY: per this function's contract; the MR is closed on failure.
        unsafe {
            check(
                "fi_mr_reg",
                sys::dfi_mr_reg(
                    self.inner.domain,
                    ptr.cast(),
                    len,
                    access,
                    0,
                    key,
                    0,
                    &mut mr,
                    ptr::null_mut(),
                ) as i64,
            )?;
            let mode = (*(*self.inner.info).domain_attr).mr_mode;
            if mode & sys::FI_MR_ENDPOINT as i32 != 0 {
                let bound = check(
                    "fi_mr_bind",
                    sys::dfi_mr_bind(mr, &mut (*self.inner.ep).fid, 0) as i64,
                )
                .and_then(|_| check("fi_mr_enable", sys::dfi_mr_enable(mr) as i64));
                if let Err(e) = bound {
                    sys::dfi_close(&mut (*mr).fid);
                    return Err(e);
                }
            }
            let remote = RemoteRegion {
                key: sys::dfi_mr_key(mr),
                base: if self.virt_addr { ptr as u64 } else { 0 },
                len: len as u64,
            };
            Ok((mr, remote))
        }
    }

    /// Reads completions (the target of writes must call this: manual progress).
    /// Returns how many of this agent's own operations completed; notices
    /// from peers' writes are kept for [`Self::take_notice`]. A failed
    /// operation is its waiter's error, not this call's: only a broken
    /// completion queue is.
    pub fn progress(&mut self) -> Result<usize, FabricError> {
        let mut entries = [sys::fi_cq_data_entry::default(); 16];
        let mut done = 0;
        loop {
            // SAFETY: the array holds 16 entries of the CQ's format.
            let rc = unsafe {
                sys::dfi_cq_read(self.inner.cq, entries.as_mut_ptr().cast(), entries.len())
            };
            if rc > 0 {
                for e in &entries[..rc as usize] {
                    if e.flags & sys::FI_REMOTE_CQ_DATA as u64 != 0 {
                        if let Ok(mut n) = self.notices.lock() {
                            n.insert(e.data);
                        }
                    } else {
                        done += 1;
                        self.complete(e.op_context as u64, Ok(()));
                    }
                }
                continue;
            }
            if rc == -(libc::EAGAIN as isize) {
                return Ok(done);
            }
            if rc == -(sys::FI_EAVAIL as isize) {
                let mut err = sys::fi_cq_err_entry::default();
                // SAFETY: one error entry.
                let n = unsafe { sys::dfi_cq_readerr(self.inner.cq, &mut err, 0) };
                if n <= 0 {
                    check("fi_cq_readerr", n as i64)?;
                    continue;
                }
                done += 1;
                self.complete(
                    err.op_context as u64,
                    Err(format!("error {} (provider {})", err.err, err.prov_errno)),
                );
                continue;
            }
            check("fi_cq_read", rc as i64)?;
        }
    }

    /// Records the completion of operation `tag`: its waiter's, or, for an
    /// abandoned one, the end of its claim on a buried region.
    fn complete(&mut self, tag: u64, result: Result<(), String>) {
        match self.abandoned.remove(&tag) {
            Some(key) => {
                if !self.abandoned.values().any(|k| *k == key) {
                    // Nothing reads or writes it any more.
                    self.buried.remove(&key);
                }
            }
            None => {
                self.completed.insert(tag, result);
            }
        }
    }

    /// Takes the notice `data` if a peer's write carrying it has landed here.
    pub fn take_notice(&self, data: u64) -> bool {
        self.notices
            .lock()
            .map(|mut n| n.remove(&data))
            .unwrap_or(false)
    }

    /// Writes `op.local[offset..offset+len]` to `op.remote` at
    /// `remote_offset` on `op.peer` and waits for the completion (at most
    /// `timeout`). With `op.notify`, the target's completion queue gets the
    /// notice once the data is in place. On an error, a caller that wants
    /// to drop the source region hands it to [`Self::bury`] instead.
    pub fn write(&mut self, op: WriteOp<'_>, timeout: Duration) -> Result<(), FabricError> {
        self.rma(Rma::Write(op.notify), op, timeout)
    }

    /// Reads `op.len` bytes at `op.remote_offset` of `op.remote` on
    /// `op.peer` into `op.local[offset..]` and waits for the completion.
    pub fn read(&mut self, op: WriteOp<'_>, timeout: Duration) -> Result<(), FabricError> {
        self.rma(Rma::Read, op, timeout)
    }

    fn rma(&mut self, kind: Rma, op: WriteOp<'_>, timeout: Duration) -> Result<(), FabricError> {
        let deadline = Instant::now() + timeout;
        let tag = self.post(kind, &op, timeout, deadline)?;
        self.wait(&[(tag, op.local.remote.key)], timeout, deadline)
    }

    /// Posts every write of `ops` before waiting for any, then waits for
    /// all their completions (at most `timeout` in all): segments of one
    /// transfer move concurrently. On an error, a caller that wants to drop
    /// the source regions hands them to [`Self::bury`] instead (the
    /// provider may still read them).
    pub fn write_all(&mut self, ops: &[WriteOp<'_>], timeout: Duration) -> Result<(), FabricError> {
        self.rma_all(false, ops, timeout)
    }

    /// Posts every read of `ops` (from any peers) before waiting for any,
    /// then waits for all their completions (at most `timeout` in all).
    /// On an error, the local regions may still be written by reads that
    /// were abandoned: a caller that drops them hands them to
    /// [`Self::bury`].
    pub fn read_all(&mut self, ops: &[WriteOp<'_>], timeout: Duration) -> Result<(), FabricError> {
        self.rma_all(true, ops, timeout)
    }

    fn rma_all(
        &mut self,
        read: bool,
        ops: &[WriteOp<'_>],
        timeout: Duration,
    ) -> Result<(), FabricError> {
        let deadline = Instant::now() + timeout;
        let mut tags = Vec::with_capacity(ops.len());
        for op in ops {
            let kind = if read {
                Rma::Read
            } else {
                Rma::Write(op.notify)
            };
            match self.post(kind, op, timeout, deadline) {
                Ok(tag) => tags.push((tag, op.local.remote.key)),
                Err(e) => {
                    self.abandon(&tags);
                    return Err(e);
                }
            }
        }
        self.wait(&tags, timeout, deadline)
    }

    /// Keeps `region` until every operation on it that its waiter gave up
    /// on has completed (or frees it now if there is none). The memory a
    /// provider may still read or write is never freed under it.
    pub fn bury(&mut self, region: Region) {
        let key = region.remote.key;
        if self.abandoned.values().any(|k| *k == key) {
            self.buried.insert(key, region);
        }
    }

    /// Bytes of regions kept for operations that have not completed yet.
    pub fn buried_bytes(&self) -> usize {
        self.buried.values().map(|r| r.buf.len()).sum()
    }

    /// Operations given up on whose completion has not arrived yet.
    pub fn abandoned_ops(&self) -> usize {
        self.abandoned.len()
    }

    /// Operations given up on that may still write `region` (others, on
    /// regions of earlier loads, do not touch it).
    pub fn abandoned_on(&self, region: &Region) -> usize {
        self.abandoned
            .values()
            .filter(|k| **k == region.remote.key)
            .count()
    }

    /// Gives up on `tags`: their completions, when they come, only free
    /// what they held.
    fn abandon(&mut self, tags: &[(u64, u64)]) {
        for &(tag, key) in tags {
            if self.completed.remove(&tag).is_none() {
                self.abandoned.insert(tag, key);
            }
        }
    }

    fn wait(
        &mut self,
        tags: &[(u64, u64)],
        timeout: Duration,
        deadline: Instant,
    ) -> Result<(), FabricError> {
        loop {
            if let Err(e) = self.progress() {
                self.abandon(tags);
                return Err(e);
            }
            let mut all = true;
            let mut failed = None;
            for (tag, _) in tags {
                match self.completed.get(tag) {
                    None => all = false,
                    Some(Err(e)) => failed = Some(e.clone()),
                    Some(Ok(())) => {}
                }
            }
            if let Some(e) = failed {
                self.abandon(tags);
                return Err(FabricError::Completion(e));
            }
            if all {
                for (tag, _) in tags {
                    self.completed.remove(tag);
                }
                return Ok(());
            }
            if Instant::now() >= deadline {
                self.abandon(tags);
                return Err(FabricError::Timeout(timeout));
            }
            std::thread::yield_now();
        }
    }

    /// Posts one operation (retrying while the provider is busy); returns
    /// its tag.
    fn post(
        &mut self,
        kind: Rma,
        op: &WriteOp<'_>,
        timeout: Duration,
        deadline: Instant,
    ) -> Result<u64, FabricError> {
        let &WriteOp {
            local,
            offset,
            len,
            peer,
            remote,
            remote_offset,
            notify: _,
        } = op;
        if offset + len > local.buf.len() {
            return Err(FabricError::OutOfRange {
                offset: offset as u64,
                len: len as u64,
                size: local.buf.len() as u64,
            });
        }
        if remote_offset + len as u64 > remote.len {
            return Err(FabricError::OutOfRange {
                offset: remote_offset,
                len: len as u64,
                size: remote.len,
            });
        }
        let tag = NEXT_OP.fetch_add(1, Ordering::Relaxed);
        // The tag rides as the completion context; it is never dereferenced.
        let context = tag as usize as *mut libc::c_void;
        loop {
            // SAFETY: the local range is inside a registered region that
            // outlives the call (we wait for the completion below; a caller
            // that gives up buries the region until it completes).
            let buf = local.buf.as_ptr().wrapping_add(offset);
            let addr = remote.base + remote_offset;
            let rc = unsafe {
                match kind {
                    Rma::Write(None) => sys::dfi_write(
                        self.inner.ep,
                        buf.cast(),
                        len,
                        local.desc,
                        peer.0,
                        addr,
                        remote.key,
                        context,
                    ),
                    Rma::Write(Some(data)) => sys::dfi_writedata(
                        self.inner.ep,
                        buf.cast(),
                        len,
                        local.desc,
                        data,
                        peer.0,
                        addr,
                        remote.key,
                        context,
                    ),
                    Rma::Read => sys::dfi_read(
                        self.inner.ep,
                        buf as *mut libc::c_void,
                        len,
                        local.desc,
                        peer.0,
                        addr,
                        remote.key,
                        context,
                    ),
                }
            };
            if rc == 0 {
                return Ok(tag);
            }
            if rc != -(libc::EAGAIN as isize) {
                check("fi_write", rc as i64)?;
            }
            self.progress()?;
            if Instant::now() >= deadline {
                return Err(FabricError::Timeout(timeout));
            }
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // The endpoint lives on while any region of this agent does, and an
        // abandoned operation may still touch a buried region: leak those
        // rather than free memory the provider may use (a prefill worker
        // bounds how much it buries).
        for (_, r) in self.buried.drain() {
            std::mem::forget(r);
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // SAFETY: each object was opened once by this agent; close in reverse order.
        unsafe {
            for fid in [
                (!self.ep.is_null()).then(|| &mut (*self.ep).fid as *mut sys::fid),
                (!self.cq.is_null()).then(|| &mut (*self.cq).fid as *mut sys::fid),
                (!self.av.is_null()).then(|| &mut (*self.av).fid as *mut sys::fid),
                (!self.domain.is_null()).then(|| &mut (*self.domain).fid as *mut sys::fid),
                (!self.fabric.is_null()).then(|| &mut (*self.fabric).fid as *mut sys::fid),
            ]
            .into_iter()
            .flatten()
            {
                sys::dfi_close(fid);
            }
            sys::fi_freeinfo(self.info);
        }
    }
}
