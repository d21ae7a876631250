//! The gateway's frame inbox: one subscription on `gateway.<id>.frames`,
//! demultiplexed by request id to the waiting generation.
//!
//! Invariant: an entry exists from just before a request is sent until its
//! generation is dropped; frames for unknown ids (late frames after a
//! cancel) are dropped and counted at debug level; undecodable frames are
//! rejected and counted. Each request's channel holds at most
//! [`FRAME_BACKLOG`] frames: a request whose client stops reading its
//! stream for that long loses its entry (its channel closes, and the
//! generation fails the request, which cancels it on the worker) instead
//! of holding the gateway's memory.

use dynamo_bus_schema::{
    decode_payload, peek_kind, FrameError, FrameFinished, FrameHeartbeat, FrameStarted,
    FrameTimings, FrameTokens, RequestId, WireMessage,
};
use dynamo_runtime::counters;
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::Mutex;
use tokio::sync::mpsc;

#[derive(Debug)]
pub enum Frame {
    Started(FrameStarted),
    Tokens(FrameTokens),
    Finished(FrameFinished),
    Error(FrameError),
    /// The worker is alive; not part of the numbered sequence.
    Heartbeat(FrameHeartbeat),
    /// The phase breakdown, just before the terminal frame (not numbered).
    Timings(FrameTimings),
}

impl Frame {
    pub fn request_id(&self) -> RequestId {
        match self {
            Frame::Started(f) => f.request_id,
            Frame::Tokens(f) => f.request_id,
            Frame::Finished(f) => f.request_id,
            Frame::Error(f) => f.request_id,
            Frame::Heartbeat(f) => f.request_id,
            Frame::Timings(f) => f.request_id,
        }
    }
    /// The frame's place in its stream (`None` for heartbeats).
    pub fn seq(&self) -> Option<u32> {
        match self {
            Frame::Started(f) => Some(f.seq.0),
            Frame::Tokens(f) => Some(f.seq.0),
            Frame::Finished(f) => Some(f.seq.0),
            Frame::Error(f) => Some(f.seq.0),
            Frame::Heartbeat(_) | Frame::Timings(_) => None,
        }
    }
}

/// Frames one request's channel holds before its client is declared too
/// slow (about 20 s of a fast stream: one frame per engine step).
pub const FRAME_BACKLOG: usize = 2048;

#[derive(Default)]
pub struct Inbox {
    waiting: Mutex<HashMap<RequestId, mpsc::Sender<Frame>>>,
    /// Requests dropped because their channel was full.
    overflows: std::sync::atomic::AtomicU64,
}

impl Inbox {
    pub fn register(&self, id: RequestId) -> mpsc::Receiver<Frame> {
        let (tx, rx) = mpsc::channel(FRAME_BACKLOG);
        if let Ok(mut w) = self.waiting.lock() {
            w.insert(id, tx);
        }
        rx
    }

    /// Requests whose frames overflowed their channel so far.
    pub fn overflows(&self) -> u64 {
        self.overflows.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn unregister(&self, id: RequestId) {
        if let Ok(mut w) = self.waiting.lock() {
            w.remove(&id);
        }
    }

    fn deliver(&self, frame: Frame) {
        let id = frame.request_id();
        let Ok(mut w) = self.waiting.lock() else {
            return;
        };
        let Some(tx) = w.get(&id) else {
            tracing::debug!(request = %id, "frame for a request that is gone");
            return;
        };
        match tx.try_send(frame) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                // The client stopped reading: its generation sees the
                // channel close and fails (and cancels) the request.
                w.remove(&id);
                self.overflows
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tracing::warn!(request = %id, backlog = FRAME_BACKLOG, "client too slow; dropping its request");
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                w.remove(&id);
            }
        }
    }

    /// Decodes one bus message into a frame and delivers it.
    pub fn on_message(&self, subject: &str, payload: &[u8]) {
        let frame = match peek_kind(payload) {
            Ok((k, p)) if k == FrameTokens::KIND => decode_payload(p).map(Frame::Tokens),
            Ok((k, p)) if k == FrameStarted::KIND => decode_payload(p).map(Frame::Started),
            Ok((k, p)) if k == FrameFinished::KIND => decode_payload(p).map(Frame::Finished),
            Ok((k, p)) if k == FrameError::KIND => decode_payload(p).map(Frame::Error),
            Ok((k, p)) if k == FrameHeartbeat::KIND => decode_payload(p).map(Frame::Heartbeat),
            Ok((k, p)) if k == FrameTimings::KIND => decode_payload(p).map(Frame::Timings),
            Ok((k, _)) => {
                counters::reject("frame", subject, &format!("unknown message kind {}", k.0));
                return;
            }
            Err(e) => Err(e),
        };
        match frame {
            Ok(f) => self.deliver(f),
            Err(e) => counters::reject("frame", subject, &e),
        }
    }

    /// Runs the subscription until it ends.
    pub async fn run(&self, mut sub: async_nats::Subscriber) {
        while let Some(m) = sub.next().await {
            self.on_message(m.subject.as_str(), &m.payload);
        }
    }
}
