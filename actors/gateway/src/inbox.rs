//! The gateway's frame inbox: one subscription on `gateway.<id>.frames`,
//! demultiplexed by request id to the waiting generation.
//!
//! Invariant: an entry exists from just before a request is sent until its
//! generation is dropped; frames for unknown ids (late frames after a
//! cancel) are dropped and counted at debug level; undecodable frames are
//! rejected and counted.

use dynamo_bus_schema::{
    decode_payload, peek_kind, FrameError, FrameFinished, FrameHeartbeat, FrameStarted,
    FrameTimings, FrameTokens, RequestId, WireMessage,
};
use dynamo_runtime::counters;
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::Mutex;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

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

#[derive(Default)]
pub struct Inbox {
    waiting: Mutex<HashMap<RequestId, mpsc::UnboundedSender<Frame>>>,
}

impl Inbox {
    pub fn register(&self, id: RequestId) -> mpsc::UnboundedReceiver<Frame> {
        let (tx, rx) = mpsc::unbounded_channel();
        if let Ok(mut w) = self.waiting.lock() {
            w.insert(id, tx);
        }
        rx
    }

    pub fn unregister(&self, id: RequestId) {
        if let Ok(mut w) = self.waiting.lock() {
            w.remove(&id);
        }
    }

    fn deliver(&self, frame: Frame) {
        let id = frame.request_id();
        let tx = self.waiting.lock().ok().and_then(|w| w.get(&id).cloned());
        match tx {
            Some(tx) => {
                let _ = tx.send(frame);
            }
            None => tracing::debug!(request = %id, "frame for a request that is gone"),
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

    /// Runs the subscription until cancelled.
    pub async fn run(&self, mut sub: async_nats::Subscriber, cancel: CancellationToken) {
        loop {
            let m = tokio::select! {
                _ = cancel.cancelled() => break,
                m = sub.next() => m,
            };
            let Some(m) = m else { break };
            self.on_message(m.subject.as_str(), &m.payload);
        }
    }
}
