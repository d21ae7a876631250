//! The prefill side of disaggregated serving: compute a prompt's KV,
//! export its blocks, and write them straight into the windows the decode
//! worker opened over its engine's pool.

use super::KvTransfer;
use dynamo_bus_schema::blocks::{sequence_hashes, SequenceHash};
use dynamo_bus_schema::RequestId;
use dynamo_bus_schema::{
    decode, unix_ms, ErrorKind, ErrorReply, FinishReason, KvTransferTarget, ModelCard,
    PrefillReply, PrefillRequest, SamplingParams, TransferStarting, WireError, WorkerId,
};
use dynamo_engine::{Engine, EngineEvent, EngineLimits, KvBlockData, ValidRequest};
use dynamo_runtime::tasks::Spawner;
use dynamo_runtime::{counters, Bus};
use dynamo_transfer::{FabricError, RemoteRegion, WriteOp};
use futures::StreamExt;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

impl KvTransfer {
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
        let stalled = agent.buried_bytes();
        if stalled + total > self.cfg.max_stalled_bytes && stalled > 0 {
            return Err(FabricError::Completion(format!(
                "{stalled} bytes of earlier writes have not completed; refusing more until they do"
            )));
        }
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
            // The provider may still read it: the agent keeps it until the
            // write's late completion, then frees it.
            agent.bury(src);
        }
        res
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
    /// Prefills running at once (the engine's capacity): a request past it
    /// is answered `Overloaded` at once and its decode worker prefills
    /// locally.
    pub slots: Arc<Semaphore>,
    /// Requests prefilling now: only their cancels reach the engine.
    pub active: Arc<Mutex<HashSet<RequestId>>>,
    /// The worker's timings for the planner.
    pub stats: Arc<crate::stats::WorkerStats>,
}

/// Keeps a request in [`PrefillServer::active`] while it prefills.
struct Active<'a>(&'a Mutex<HashSet<RequestId>>, RequestId);

impl Drop for Active<'_> {
    fn drop(&mut self) {
        if let Ok(mut a) = self.0.lock() {
            a.remove(&self.1);
        }
    }
}

impl PrefillServer {
    /// Whether `id` is prefilling here (a cancel for it is worth passing on).
    pub fn is_active(&self, id: RequestId) -> bool {
        self.active.lock().map(|a| a.contains(&id)).unwrap_or(false)
    }

    /// Serves `worker.<id>.prefill` until cancelled, each request in a task
    /// of its own (the engine batches concurrent prefills), at most
    /// [`Self::slots`] at once.
    pub async fn run(
        self,
        mut sub: async_nats::Subscriber,
        spawner: Spawner,
        cancel: CancellationToken,
    ) {
        loop {
            let m = tokio::select! {
                _ = cancel.cancelled() => break,
                m = sub.next() => m,
            };
            let Some(m) = m else { break };
            let Ok(slot) = self.slots.clone().try_acquire_owned() else {
                let error = WireError::new(ErrorKind::Overloaded, "the prefill worker is full");
                self.bus
                    .reply(m.reply.as_ref(), &ErrorReply { error })
                    .await;
                continue;
            };
            let me = self.clone();
            let cancel = cancel.child_token();
            spawner.spawn_transient("prefill", async move {
                let _slot = slot;
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
        if let Ok(mut a) = self.active.lock() {
            if !a.insert(id) {
                return Err(invalid(format!("request {id} is already prefilling here")));
            }
        }
        let _active = Active(&self.active, id);
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
        let prompt = req.token_ids.len() as u32;
        let mut queued = Some(self.stats.queue(prompt));
        let run = async {
            while let Some(ev) = events.recv().await {
                match ev {
                    EngineEvent::Started { .. } => started = Some(Instant::now()),
                    EngineEvent::Cached { .. } => {}
                    EngineEvent::Tokens(_) => {
                        if first.is_none() {
                            drop(queued.take());
                            self.stats.first_token(t0.elapsed(), prompt);
                        }
                        first = first.or(Some(Instant::now()))
                    }
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
