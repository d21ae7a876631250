//! Disaggregated serving on a worker: a prefill worker computes a prompt's
//! KV and writes its blocks, one-sided over libfabric, straight into pool
//! blocks the decode worker's engine reserved for them; the decode engine
//! then caches them as if it had computed them, and generates.
//!
//! Invariants:
//! - a decode worker reserves the blocks in its engine before it asks for
//!   a prefill; the engine neither computes with, hands out nor evicts a
//!   reserved block, so nothing else touches the bytes a peer writes;
//! - the prefill worker writes through windows registered for this request
//!   alone (one per run of consecutive blocks), closed before the blocks
//!   are committed or released, so a write that arrives late (after a
//!   timeout or a cancel) is refused instead of landing in reused blocks;
//! - it commits only blocks whose hashes are its own prompt's, in order,
//!   and only once its own completion queue has every written window's
//!   notice (remote CQ data): the data is in place, whatever the bus says;
//! - every failure (prefill worker gone or slow, transfer timeout, bad
//!   reply, no blocks to spare, fenced peer) is returned as a reason: the
//!   caller prefills locally and reports the reason; nothing waits past
//!   `prefill_timeout`, and a write never waits past `write_timeout`;
//! - a prefill worker that fails `fence_after` times in a row is skipped
//!   for `fence_for`.

use dynamo_bus_schema::blocks::{sequence_hashes, SequenceHash};
use dynamo_bus_schema::KvWindow;
use dynamo_bus_schema::{
    decode, unix_ms, CancelReason, CancelRequest, ErrorKind, ErrorReply, FinishReason,
    GenerateDisagg, GenerateRequest, KvTransferTarget, ModelCard, PrefillReply, PrefillRequest,
    RequestId, SamplingParams, TransferStarting, WireError, WorkerId,
};
use dynamo_engine::{
    Engine, EngineEvent, EngineLimits, KvArena, KvBlockData, ReservationId, ValidRequest,
};
use dynamo_runtime::{counters, Bus};
use dynamo_transfer::{Agent, FabricError, Peer, Progress, Region, RemoteRegion, Window, WriteOp};
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// How long a decode worker waits for a write's notice after the writer
/// reported its completion (delivery complete: the data is already here).
const NOTICE_GRACE: Duration = Duration::from_secs(2);

/// KV transfer settings of a prefill or decode worker.
#[derive(Clone, Debug, PartialEq)]
pub struct TransferConfig {
    /// libfabric provider: `tcp;ofi_rxm` (default, any host) or `shm` (same host).
    pub provider: String,
    /// Longest one write of a request's blocks may take before it fails.
    pub write_timeout: Duration,
    /// Longest a decode worker waits for a remote prefill (compute and
    /// transfer) before it prefills locally.
    pub prefill_timeout: Duration,
    /// Consecutive failures after which a prefill worker is fenced.
    pub fence_after: u32,
    /// How long a fenced prefill worker is skipped.
    pub fence_for: Duration,
}

impl Default for TransferConfig {
    fn default() -> Self {
        TransferConfig {
            provider: "tcp;ofi_rxm".into(),
            write_timeout: Duration::from_secs(5),
            prefill_timeout: Duration::from_secs(60),
            fence_after: 2,
            fence_for: Duration::from_secs(30),
        }
    }
}

/// Pool blocks reserved in the decode engine for one remote prefill, and
/// the windows the prefill worker writes them through. Dropped without a
/// commit, it closes the windows first and then frees the blocks, so a
/// late write can never land in blocks handed to someone else.
struct PoolLease<'a> {
    /// Windows are closed with the agent locked, so no incoming write is
    /// being processed (checked against its key, then copied) meanwhile.
    progress: &'a Progress,
    windows: Vec<Window>,
    engine: Arc<dyn Engine>,
    /// `None` once committed.
    id: Option<ReservationId>,
    /// Keeps the pool memory mapped while a window is open over it.
    _arena: Arc<KvArena>,
}

impl PoolLease<'_> {
    fn close_windows(&mut self) {
        if !self.windows.is_empty() {
            let _agent = self.progress.agent();
            self.windows.clear();
        }
    }
}

impl Drop for PoolLease<'_> {
    fn drop(&mut self) {
        self.close_windows();
        if let Some(id) = self.id.take() {
            self.engine.release_blocks(id);
        }
    }
}

/// Runs of consecutive block indices: `(first, count)`, in order.
fn runs(blocks: &[u32]) -> Vec<(u32, usize)> {
    let mut out: Vec<(u32, usize)> = Vec::new();
    for &b in blocks {
        match out.last_mut() {
            Some((first, n)) if *first as u64 + *n as u64 == b as u64 => *n += 1,
            _ => out.push((b, 1)),
        }
    }
    out
}

/// Removes a key from a map when dropped.
struct Forget<'a, V>(&'a Mutex<HashMap<RequestId, V>>, RequestId);

impl<V> Drop for Forget<'_, V> {
    fn drop(&mut self) {
        if let Ok(mut m) = self.0.lock() {
            m.remove(&self.1);
        }
    }
}

struct Fence {
    failures: u32,
    until: Option<Instant>,
}

/// A worker's KV transfer endpoint.
pub struct KvTransfer {
    worker_id: WorkerId,
    cfg: TransferConfig,
    progress: Progress,
    address: Vec<u8>,
    block_bytes: usize,
    /// Base of the next request's notices (each window takes one).
    next_notice: AtomicU64,
    peers: Mutex<HashMap<Vec<u8>, Peer>>,
    fences: Mutex<HashMap<WorkerId, Fence>>,
    /// Source regions of writes that failed or timed out: the provider may
    /// still read them, so they are never freed (fencing bounds how many).
    graveyard: Mutex<Vec<Region>>,
    /// Remote prefills waiting for their writes to start.
    starting: Mutex<HashMap<RequestId, tokio::sync::oneshot::Sender<()>>>,
}

/// The blocks a remote prefill left in this worker's engine.
#[derive(Clone, Debug)]
pub struct RemoteDone {
    pub reply: PrefillReply,
    pub imported: usize,
    /// Windows the blocks were written through (runs of consecutive pool blocks).
    pub windows: usize,
}

impl KvTransfer {
    /// Opens the endpoint of a prefill or decode worker.
    pub fn open(
        worker_id: WorkerId,
        cfg: TransferConfig,
        block_bytes: usize,
    ) -> Result<Self, FabricError> {
        let agent = Agent::new(&cfg.provider)?;
        let address = agent.address()?;
        let progress =
            Progress::spawn(agent).map_err(|e| FabricError::Completion(e.to_string()))?;
        Ok(KvTransfer {
            worker_id,
            cfg,
            progress,
            address,
            block_bytes,
            next_notice: AtomicU64::new(1),
            peers: Mutex::new(HashMap::new()),
            fences: Mutex::new(HashMap::new()),
            graveyard: Mutex::new(Vec::new()),
            starting: Mutex::new(HashMap::new()),
        })
    }

    /// A prefill worker is about to write `id`'s blocks here.
    pub fn transfer_starting(&self, id: RequestId) {
        if let Some(tx) = self.starting.lock().ok().and_then(|mut s| s.remove(&id)) {
            let _ = tx.send(());
        }
    }

    /// Stops polling the endpoint (fault injection: a peer that never polls).
    pub fn stop_progress(&self) {
        self.progress.pause();
    }

    fn fenced(&self, w: WorkerId) -> Option<Duration> {
        let f = self.fences.lock().ok()?;
        let until = f.get(&w)?.until?;
        until.checked_duration_since(Instant::now())
    }

    fn record(&self, w: WorkerId, ok: bool) {
        let Ok(mut f) = self.fences.lock() else {
            return;
        };
        let e = f.entry(w).or_insert(Fence {
            failures: 0,
            until: None,
        });
        if ok {
            e.failures = 0;
            e.until = None;
        } else {
            e.failures += 1;
            if e.failures >= self.cfg.fence_after {
                tracing::warn!(prefill_worker = %w, failures = e.failures, fence_for = ?self.cfg.fence_for, "fencing prefill worker");
                e.until = Some(Instant::now() + self.cfg.fence_for);
                e.failures = 0;
            }
        }
    }

    /// Decode side: has `plan.prefill_worker` prefill `req`'s prompt and
    /// imports the blocks it wrote. An error is the reason to prefill locally.
    pub async fn remote_prefill(
        &self,
        bus: &Bus,
        engine: &Arc<dyn Engine>,
        card: &ModelCard,
        req: &GenerateRequest,
        plan: &GenerateDisagg,
    ) -> Result<RemoteDone, String> {
        let peer = plan.prefill_worker;
        if let Some(left) = self.fenced(peer) {
            return Err(format!(
                "prefill worker {peer} is fenced for {}s after repeated failures",
                left.as_secs()
            ));
        }
        let hashes = sequence_hashes(&req.token_ids, card.block_size as usize, card.hash_salt);
        let skip = (plan.cached_blocks as usize).min(hashes.len());
        let n = hashes.len() - skip;
        if n == 0 {
            return Err("no uncached full block to transfer".into());
        }
        let mut lease = self.lease(engine, n).await?;
        let notify = self
            .next_notice
            .fetch_add(lease.windows.len() as u64, Ordering::Relaxed);
        let windows: Vec<KvWindow> = lease
            .windows
            .iter()
            .map(|w| {
                let r = w.remote();
                KvWindow {
                    key: r.key,
                    base: r.base,
                    len: r.len,
                }
            })
            .collect();
        let (start_tx, mut start_rx) = tokio::sync::oneshot::channel();
        if let Ok(mut s) = self.starting.lock() {
            s.insert(req.request_id, start_tx);
        }
        // Forgets the start signal however this call ends (also when the
        // caller drops it: a client that left).
        let _starting = Forget(&self.starting, req.request_id);
        let preq = PrefillRequest {
            request_id: req.request_id,
            decode_worker: self.worker_id,
            model: req.model.clone(),
            token_ids: req.token_ids.clone(),
            skip_blocks: skip as u32,
            target: KvTransferTarget {
                provider: self.cfg.provider.clone(),
                address: self.address.clone(),
                block_bytes: self.block_bytes as u64,
                windows,
                notify,
            },
            deadline_unix_ms: unix_ms() + self.cfg.prefill_timeout.as_millis() as u64,
        };
        let subject = bus.subjects.worker_prefill(peer);
        let call = bus.request::<_, PrefillReply>(subject, &preq, self.cfg.prefill_timeout);
        tokio::pin!(call);
        // Poll the endpoint hard only once the writes start (the prefill
        // itself may take seconds, and its engine needs the cores).
        let mut spin = None;
        let answer = loop {
            tokio::select! {
                r = &mut call => break r,
                _ = &mut start_rx, if spin.is_none() => spin = Some(self.progress.expect()),
            }
        };
        let _spin = spin.unwrap_or_else(|| self.progress.expect());
        let reply: PrefillReply = match answer {
            Ok(r) => r,
            Err(e) => {
                self.record(peer, false);
                if matches!(e, dynamo_runtime::BusError::Timeout { .. }) {
                    cancel_prefill(bus, peer, req.request_id, CancelReason::DeadlineExceeded).await;
                }
                return Err(format!("remote prefill on {peer} failed: {e}"));
            }
        };
        let expected = &hashes[skip..];
        let parent = skip.checked_sub(1).map(|i| hashes[i]);
        if reply.blocks.len() > n
            || reply.blocks[..] != expected[..reply.blocks.len()]
            || (!reply.blocks.is_empty() && reply.parent != parent)
        {
            self.record(peer, false);
            return Err(format!(
                "prefill worker {peer} named blocks that are not this prompt's"
            ));
        }
        // The windows the written blocks fill, each with its own notice.
        let mut written = 0;
        for (i, w) in preq.target.windows.iter().enumerate() {
            if written >= reply.blocks.len() {
                break;
            }
            written += (w.len / preq.target.block_bytes) as usize;
            if !self.wait_notice(notify.wrapping_add(i as u64)).await {
                self.record(peer, false);
                return Err(format!(
                    "prefill worker {peer} replied but its writes never landed here (no notice)"
                ));
            }
        }
        // No peer can write the blocks once their windows are closed.
        lease.close_windows();
        let id = lease.id.take().ok_or("reservation already used")?;
        let imported = engine
            .commit_blocks(id, parent, reply.blocks.clone())
            .map_err(|e| e.to_string())?
            .await
            .map_err(|_| "engine stopped during the commit".to_string())?
            .map_err(|e| {
                self.record(peer, false);
                format!("storing the blocks from {peer}: {e}")
            })?;
        self.record(peer, true);
        Ok(RemoteDone {
            reply,
            imported,
            windows: preq.target.windows.len(),
        })
    }

    /// Reserves `n` blocks in the engine's pool and opens a window over
    /// each run of consecutive ones.
    async fn lease(&self, engine: &Arc<dyn Engine>, n: usize) -> Result<PoolLease<'_>, String> {
        let arena = engine.kv_arena();
        if arena.block_bytes() != self.block_bytes {
            return Err(format!(
                "the engine's pool blocks are {} bytes, transfers move {}",
                arena.block_bytes(),
                self.block_bytes
            ));
        }
        let reservation = engine
            .reserve_blocks(n)
            .map_err(|e| e.to_string())?
            .await
            .map_err(|_| "engine stopped during the reservation".to_string())?
            .map_err(|e| format!("cannot reserve {n} KV blocks for the transfer: {e}"))?;
        let mut lease = PoolLease {
            progress: &self.progress,
            windows: Vec::new(),
            engine: engine.clone(),
            id: Some(reservation.id),
            _arena: arena.clone(),
        };
        for (first, count) in runs(&reservation.blocks) {
            if first as usize + count > arena.blocks() {
                return Err(format!(
                    "the engine reserved blocks past its pool ({first}+{count})"
                ));
            }
            // SAFETY: the blocks are inside the arena, which the lease keeps
            // mapped; they are reserved, so the engine does not touch them
            // until the lease commits or releases them, after closing this
            // window.
            // (The agent's lock is held for this statement only: dropping
            // the lease on an error takes it again.)
            let window = unsafe {
                self.progress.agent().window_at(
                    arena.as_ptr().add(first as usize * self.block_bytes),
                    count * self.block_bytes,
                )
            }
            .map_err(|e| format!("cannot open a window over the pool: {e}"))?;
            lease.windows.push(window);
        }
        Ok(lease)
    }

    /// Waits (briefly: the notice is read by the spinning progress thread
    /// and arrives with the data, before the writer's completion) for the
    /// notice of a peer's last write.
    async fn wait_notice(&self, notify: u64) -> bool {
        let t0 = Instant::now();
        loop {
            if self.progress.take_notice(notify) {
                return true;
            }
            if t0.elapsed() > NOTICE_GRACE {
                return false;
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
    }

    /// Prefill side: writes `blocks` into the target's windows, in order
    /// (one write per window, carrying its notice), and waits for the
    /// completions (blocking; run it off the async executor).
    fn write_blocks(
        &self,
        target: &KvTransferTarget,
        blocks: &[KvBlockData],
    ) -> Result<(), FabricError> {
        let bb = self.block_bytes;
        let total = blocks.len() * bb;
        let mut agent = self.progress.agent();
        let cached = self
            .peers
            .lock()
            .ok()
            .and_then(|p| p.get(&target.address).copied());
        let peer = match cached {
            Some(p) => p,
            None => {
                let p = agent.insert_peer(&target.address)?;
                if let Ok(mut peers) = self.peers.lock() {
                    peers.insert(target.address.clone(), p);
                }
                p
            }
        };
        let mut src = agent.register(total)?;
        for (i, b) in blocks.iter().enumerate() {
            src.bytes_mut()[i * bb..(i + 1) * bb].copy_from_slice(&b.bytes);
        }
        // Window i takes the next `len / block_bytes` blocks.
        let mut plan = Vec::new();
        let mut next = 0;
        for (i, w) in target.windows.iter().enumerate() {
            if next == blocks.len() {
                break;
            }
            let k = (w.len as usize / bb).min(blocks.len() - next);
            let remote = RemoteRegion {
                key: w.key,
                base: w.base,
                len: w.len,
            };
            plan.push((next, k, remote, target.notify.wrapping_add(i as u64)));
            next += k;
        }
        let ops: Vec<WriteOp> = plan
            .iter()
            .map(|(first, k, remote, notice)| WriteOp {
                local: &src,
                offset: first * bb,
                len: k * bb,
                peer,
                remote,
                remote_offset: 0,
                notify: Some(*notice),
            })
            .collect();
        let res = if next < blocks.len() {
            Err(FabricError::OutOfRange {
                offset: 0,
                len: total as u64,
                size: (next * bb) as u64,
            })
        } else {
            agent.write_all(&ops, self.cfg.write_timeout)
        };
        drop(ops);
        if res.is_err() {
            match self.graveyard.lock() {
                Ok(mut g) => g.push(src),
                Err(_) => std::mem::forget(src),
            }
        }
        res
    }
}

/// Asks a prefill worker to stop prefilling `id` (its decode worker gave up
/// on it): the engine frees the work instead of finishing it for nobody.
pub async fn cancel_prefill(
    bus: &Bus,
    prefill_worker: WorkerId,
    id: RequestId,
    reason: CancelReason,
) {
    let c = CancelRequest {
        request_id: id,
        reason,
    };
    if let Err(e) = bus
        .publish(bus.subjects.worker_cancel(prefill_worker), &c)
        .await
    {
        tracing::warn!(error = %e, "cannot cancel the remote prefill");
    }
}

/// What a prefill worker needs to serve prefill requests.
#[derive(Clone)]
pub struct PrefillServer {
    pub bus: Bus,
    pub engine: Arc<dyn Engine>,
    pub transfer: Arc<KvTransfer>,
    pub card: ModelCard,
    pub limits: EngineLimits,
    pub worker_id: WorkerId,
}

impl PrefillServer {
    /// Serves `worker.<id>.prefill` until cancelled, each request in a task
    /// of its own (the engine batches concurrent prefills).
    pub async fn run(self, mut sub: async_nats::Subscriber, cancel: CancellationToken) {
        loop {
            let m = tokio::select! {
                _ = cancel.cancelled() => break,
                m = sub.next() => m,
            };
            let Some(m) = m else { break };
            let me = self.clone();
            let cancel = cancel.child_token();
            tokio::spawn(async move {
                let answer = match decode::<PrefillRequest>(&m.payload) {
                    Ok(req) => tokio::select! {
                        a = me.prefill(req) => a,
                        _ = cancel.cancelled() => Err(WireError::new(ErrorKind::Unavailable, "prefill worker is shutting down")),
                    },
                    Err(e) => {
                        counters::reject("PrefillRequest", m.subject.as_str(), &e);
                        Err(WireError::new(ErrorKind::BadMessage, e.to_string()))
                    }
                };
                match answer {
                    Ok(r) => me.bus.reply(m.reply.as_ref(), &r).await,
                    Err(error) => {
                        tracing::warn!(error = %error.message, "prefill request failed");
                        me.bus.reply(m.reply.as_ref(), &ErrorReply { error }).await
                    }
                }
            });
        }
        let _ = sub.unsubscribe().await;
    }

    async fn prefill(&self, req: PrefillRequest) -> Result<PrefillReply, WireError> {
        let t0 = Instant::now();
        let invalid = |m: String| WireError::new(ErrorKind::InvalidRequest, m);
        let t = &req.target;
        if t.block_bytes != self.transfer.block_bytes as u64 {
            return Err(invalid(format!(
                "target blocks are {} bytes, this engine's are {}",
                t.block_bytes, self.transfer.block_bytes
            )));
        }
        if t.windows.is_empty()
            || t.windows
                .iter()
                .any(|w| w.len == 0 || w.len % self.transfer.block_bytes as u64 != 0)
        {
            return Err(invalid(
                "target windows must be non-empty and hold whole blocks".into(),
            ));
        }
        if t.provider != self.transfer.cfg.provider {
            return Err(invalid(format!(
                "target speaks {:?}, this worker {:?}",
                t.provider, self.transfer.cfg.provider
            )));
        }
        if req.model != self.card.name {
            return Err(invalid(format!("this worker serves {}", self.card.name)));
        }
        // The decode worker's id for the request: a cancel it sends here
        // (`worker.<id>.cancel`) stops this prefill too.
        let id = req.request_id;
        let valid = ValidRequest::from_parts(
            id,
            req.token_ids.clone(),
            &SamplingParams::greedy(1),
            self.limits,
        )
        .map_err(|e| invalid(e.to_string()))?;
        let left = match req.deadline_unix_ms {
            0 => Duration::from_secs(3600),
            d => Duration::from_millis(d.saturating_sub(unix_ms())),
        };
        let mut events = self.engine.generate(valid).map_err(|e| e.to_wire())?;
        let (mut started, mut first) = (None, None);
        let run = async {
            while let Some(ev) = events.recv().await {
                match ev {
                    EngineEvent::Started { .. } => started = Some(Instant::now()),
                    EngineEvent::Tokens(_) => first = first.or(Some(Instant::now())),
                    EngineEvent::Finished {
                        reason: FinishReason::Cancelled,
                    } => {
                        return Err(WireError::new(
                            ErrorKind::Cancelled,
                            "the decode worker cancelled the prefill",
                        ))
                    }
                    EngineEvent::Finished { .. } => return Ok(()),
                    EngineEvent::Failed(e) => return Err(e.to_wire()),
                }
            }
            Err(WireError::new(
                ErrorKind::EngineFailed,
                "engine dropped the prefill",
            ))
        };
        match tokio::time::timeout(left, run).await {
            Ok(r) => r?,
            Err(_) => {
                self.engine.cancel(id);
                return Err(WireError::new(
                    ErrorKind::DeadlineExceeded,
                    "prefill deadline passed",
                ));
            }
        }
        let hashes = sequence_hashes(
            &req.token_ids,
            self.card.block_size as usize,
            self.card.hash_salt,
        );
        let skip = (req.skip_blocks as usize).min(hashes.len());
        let stopped = || WireError::new(ErrorKind::EngineFailed, "engine stopped");
        let exported = self
            .engine
            .export_blocks(hashes.clone())
            .map_err(|_| stopped())?
            .await
            .map_err(|_| stopped())?;
        let blocks: Vec<KvBlockData> = exported
            .into_iter()
            .skip(skip)
            .take(t.blocks() as usize)
            .collect();
        let t_tx = Instant::now();
        if !blocks.is_empty() {
            let start = TransferStarting {
                request_id: req.request_id,
            };
            let subject = self.bus.subjects.worker_transfer(req.decode_worker);
            if let Err(e) = self.bus.publish(subject, &start).await {
                tracing::warn!(error = %e, "cannot announce the transfer; writing anyway");
            }
            let (transfer, target, b) = (self.transfer.clone(), t.clone(), blocks.clone());
            tokio::task::spawn_blocking(move || transfer.write_blocks(&target, &b))
                .await
                .map_err(|_| WireError::new(ErrorKind::Internal, "transfer task failed"))?
                .map_err(|e| {
                    WireError::new(
                        ErrorKind::Unavailable,
                        format!("KV transfer to the decode worker failed: {e}"),
                    )
                })?;
        }
        let ms = |d: Duration| d.as_secs_f32() * 1000.0;
        let started = started.unwrap_or(t0);
        let first = first.unwrap_or(t_tx);
        Ok(PrefillReply {
            request_id: req.request_id,
            worker_id: self.worker_id,
            parent: skip.checked_sub(1).map(|i| hashes[i]),
            blocks: blocks.iter().map(|b| b.hash).collect::<Vec<SequenceHash>>(),
            queue_ms: ms(started - t0),
            prefill_ms: ms(first.saturating_duration_since(started)),
            transfer_ms: ms(t_tx.elapsed()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserved_blocks_split_into_runs_of_consecutive_indices() {
        assert_eq!(runs(&[]), vec![]);
        assert_eq!(runs(&[4]), vec![(4, 1)]);
        assert_eq!(
            runs(&[0, 1, 2, 7, 8, 3, 9]),
            vec![(0, 3), (7, 2), (3, 1), (9, 1)]
        );
        assert_eq!(runs(&[5, 4]), vec![(5, 1), (4, 1)]);
        assert_eq!(runs(&[u32::MAX, 0]), vec![(u32::MAX, 1), (0, 1)]);
    }

    #[test]
    fn repeated_failures_fence_a_peer_and_success_clears_it() {
        let t = KvTransfer::open(WorkerId(1), TransferConfig::default(), 64)
            .expect("tcp;ofi_rxm endpoint");
        let w = WorkerId(9);
        t.record(w, false);
        assert!(t.fenced(w).is_none());
        t.record(w, false);
        assert!(t.fenced(w).is_some());
        t.record(w, true);
        assert!(t.fenced(w).is_none());
    }
}
