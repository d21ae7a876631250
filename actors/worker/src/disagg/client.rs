//! The decode side of disaggregated serving: reserve pool blocks in the
//! engine, open a window over each run of them, ask a prefill worker to
//! write them, wait for every window's notice, close the windows and
//! commit. Every failure is a reason to prefill locally.

use super::KvTransfer;
use dynamo_bus_schema::blocks::sequence_hashes;
use dynamo_bus_schema::KvWindow;
use dynamo_bus_schema::{
    unix_ms, CancelReason, CancelRequest, GenerateDisagg, GenerateRequest, KvTransferTarget,
    ModelCard, PrefillReply, PrefillRequest, RequestId, WorkerId,
};
use dynamo_engine::{Engine, EngineEvent, KvArena, ReservationId, ValidRequest};
use dynamo_runtime::Bus;
use dynamo_transfer::{Progress, Window};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// How long a decode worker waits for a write's notice after the writer
/// reported its completion (delivery complete: the data is already here).
const NOTICE_GRACE: Duration = Duration::from_secs(2);
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
/// The blocks a remote prefill left in this worker's engine.
#[derive(Clone, Debug)]
pub struct RemoteDone {
    pub reply: PrefillReply,
    pub imported: usize,
    /// Windows the blocks were written through (runs of consecutive pool blocks).
    pub windows: usize,
}
impl KvTransfer {
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

/// Remote prefill, then the engine's own events, into one stream: what a
/// decode worker runs for a request the router planned disaggregated.
pub struct RemotePrefillPipe {
    pub bus: Bus,
    pub engine: Arc<dyn Engine>,
    pub transfer: Arc<KvTransfer>,
    pub card: ModelCard,
    pub req: GenerateRequest,
    pub plan: GenerateDisagg,
    pub valid: ValidRequest,
    pub outcome: Arc<Mutex<crate::forward::PrefillOutcome>>,
}

impl RemotePrefillPipe {
    /// Sends the request's events to `tx` (its channel holds at most the
    /// request's `max_tokens + 2` events, like the engine's own stream).
    pub async fn run(
        self,
        tx: tokio::sync::mpsc::UnboundedSender<EngineEvent>,
        cancel: CancellationToken,
    ) {
        let id = self.req.request_id;
        let remote = tokio::select! {
            r = self.transfer.remote_prefill(&self.bus, &self.engine, &self.card, &self.req, &self.plan) => r,
            _ = cancel.cancelled() => {
                let why = CancelReason::ClientDisconnected;
                cancel_prefill(&self.bus, self.plan.prefill_worker, id, why).await;
                let _ = tx.send(EngineEvent::Finished { reason: dynamo_bus_schema::FinishReason::Cancelled });
                return;
            }
        };
        if let Ok(mut o) = self.outcome.lock() {
            match remote {
                Ok(done) => {
                    tracing::debug!(request = %id, prefill_worker = %done.reply.worker_id, blocks = done.imported, windows = done.windows, "remote prefill done");
                    o.remote = Some(done.reply);
                }
                Err(why) => {
                    tracing::warn!(request = %id, reason = %why, "remote prefill not used; prefilling locally");
                    o.fallback = Some(why);
                }
            }
        }
        if tx.is_closed() {
            return;
        }
        let mut events = match self.engine.generate(self.valid) {
            Ok(ev) => ev,
            Err(e) => {
                let _ = tx.send(EngineEvent::Failed(e));
                return;
            }
        };
        while let Some(ev) = events.recv().await {
            if tx.send(ev).is_err() {
                self.engine.cancel(id);
                return;
            }
        }
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
}
