//! The gateway's frame inbox: one subscription on `gateway.<id>.frames`,
//! demultiplexed by request id to the waiting generation.
//!
//! A message holds one frame, or a [`FrameMux`] of frames (of several
//! requests) in the order the worker made them, delivered in that order.
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
    decode_payload, peek_kind, FrameError, FrameFinished, FrameHeartbeat, FrameMux, FrameStarted,
    FrameTimings, FrameTokens, FrameUsage, RequestId, WireMessage, WorkerId, MAX_MUX_FRAMES,
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
    /// Cached prompt tokens reported late (not numbered).
    Usage(FrameUsage),
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
            Frame::Usage(f) => f.request_id,
        }
    }
    /// The frame's place in its stream (`None` for heartbeats).
    pub fn seq(&self) -> Option<u32> {
        match self {
            Frame::Started(f) => Some(f.seq.0),
            Frame::Tokens(f) => Some(f.seq.0),
            Frame::Finished(f) => Some(f.seq.0),
            Frame::Error(f) => Some(f.seq.0),
            Frame::Heartbeat(_) | Frame::Timings(_) | Frame::Usage(_) => None,
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

    /// Hands `frame` to its request; a heartbeat of a request this gateway
    /// does not have gives back its worker, to be told to stop it.
    fn deliver(&self, frame: Frame) -> Option<(WorkerId, RequestId)> {
        let id = frame.request_id();
        let Ok(mut w) = self.waiting.lock() else {
            return None;
        };
        let Some(tx) = w.get(&id) else {
            tracing::debug!(request = %id, "frame for a request that is gone");
            return match frame {
                Frame::Heartbeat(h) => Some((h.worker_id, id)),
                _ => None,
            };
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
        None
    }

    /// Decodes one bus message into its frame (or, for a [`FrameMux`],
    /// its frames in order) and delivers them; answers the requests it
    /// heard of that this gateway does not have, with their workers.
    pub fn on_message(&self, subject: &str, payload: &[u8]) -> Vec<(WorkerId, RequestId)> {
        let mut orphans = Vec::new();
        match peek_kind(payload) {
            Ok((k, p)) if k == FrameMux::KIND => match decode_payload::<FrameMux>(p) {
                Ok(m) if m.frames.len() > MAX_MUX_FRAMES => counters::reject(
                    "frame",
                    subject,
                    &format!(
                        "FrameMux of {} frames (at most {MAX_MUX_FRAMES})",
                        m.frames.len()
                    ),
                ),
                Ok(m) => {
                    for f in &m.frames {
                        orphans.extend(self.on_frame(subject, f));
                    }
                }
                Err(e) => counters::reject("frame", subject, &e),
            },
            _ => orphans.extend(self.on_frame(subject, payload)),
        }
        orphans
    }

    /// Decodes one frame (never a [`FrameMux`]) and delivers it.
    fn on_frame(&self, subject: &str, payload: &[u8]) -> Option<(WorkerId, RequestId)> {
        let frame = match peek_kind(payload) {
            Ok((k, p)) if k == FrameTokens::KIND => decode_payload(p).map(Frame::Tokens),
            Ok((k, p)) if k == FrameStarted::KIND => decode_payload(p).map(Frame::Started),
            Ok((k, p)) if k == FrameFinished::KIND => decode_payload(p).map(Frame::Finished),
            Ok((k, p)) if k == FrameError::KIND => decode_payload(p).map(Frame::Error),
            Ok((k, p)) if k == FrameHeartbeat::KIND => decode_payload(p).map(Frame::Heartbeat),
            Ok((k, p)) if k == FrameTimings::KIND => decode_payload(p).map(Frame::Timings),
            Ok((k, p)) if k == FrameUsage::KIND => decode_payload(p).map(Frame::Usage),
            Ok((k, _)) => {
                counters::reject("frame", subject, &format!("unknown message kind {}", k.0));
                return None;
            }
            Err(e) => Err(e),
        };
        match frame {
            Ok(f) => self.deliver(f),
            Err(e) => {
                counters::reject("frame", subject, &e);
                None
            }
        }
    }

    /// Runs the subscription until it ends; `orphan` hears of each request
    /// a worker still runs for this gateway that it does not have (it
    /// failed it, say, while the bus was down and its cancel was lost).
    pub async fn run(&self, mut sub: async_nats::Subscriber, orphan: impl Fn(WorkerId, RequestId)) {
        while let Some(m) = sub.next().await {
            for (w, id) in self.on_message(m.subject.as_str(), &m.payload) {
                orphan(w, id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dynamo_bus_schema::{encode, FrameSeq, WorkerId};

    fn tokens(id: u128, seq: u32, t: u32) -> Vec<u8> {
        encode(&FrameTokens {
            request_id: RequestId(id),
            seq: FrameSeq(seq),
            token_ids: vec![t],
        })
        .unwrap()
    }

    fn got(rx: &mut mpsc::Receiver<Frame>) -> Vec<(u32, u32)> {
        let mut v = Vec::new();
        while let Ok(Frame::Tokens(f)) = rx.try_recv() {
            v.push((f.seq.0, f.token_ids[0]));
        }
        v
    }

    #[test]
    fn a_mux_delivers_each_requests_frames_in_order_and_nothing_nested() {
        let inbox = Inbox::default();
        let (mut a, mut b) = (inbox.register(RequestId(1)), inbox.register(RequestId(2)));
        let mux = FrameMux {
            frames: vec![tokens(1, 0, 10), tokens(2, 0, 20), tokens(1, 1, 11)],
        };
        inbox.on_message("s", &encode(&mux).unwrap());
        // A lone frame still works.
        inbox.on_message("s", &tokens(2, 1, 21));
        assert_eq!(got(&mut a), vec![(0, 10), (1, 11)]);
        assert_eq!(got(&mut b), vec![(0, 20), (1, 21)]);

        let before = counters::rejected_total();
        // A mux inside a mux is refused (its frames are not delivered),
        // the frames beside it are.
        let nested = FrameMux {
            frames: vec![encode(&mux).unwrap(), tokens(1, 2, 12)],
        };
        inbox.on_message("s", &encode(&nested).unwrap());
        assert_eq!(got(&mut a), vec![(2, 12)]);
        assert!(got(&mut b).is_empty());
        // More frames than a mux may hold: refused whole.
        let big = FrameMux {
            frames: vec![tokens(1, 3, 13); MAX_MUX_FRAMES + 1],
        };
        inbox.on_message("s", &encode(&big).unwrap());
        assert!(got(&mut a).is_empty());
        // Garbage is refused, not delivered.
        let heartbeat = encode(&FrameHeartbeat {
            request_id: RequestId(1),
            worker_id: WorkerId(1),
        })
        .unwrap();
        inbox.on_message("s", &heartbeat[..3]);
        assert!(counters::rejected_total() >= before + 3);
    }

    #[test]
    fn a_heartbeat_of_a_request_this_gateway_lacks_names_its_worker() {
        let inbox = Inbox::default();
        let _a = inbox.register(RequestId(1));
        let beat = |id: u128| {
            encode(&FrameHeartbeat {
                request_id: RequestId(id),
                worker_id: WorkerId(7),
            })
            .unwrap()
        };
        assert!(
            inbox.on_message("s", &beat(1)).is_empty(),
            "a request it has"
        );
        assert_eq!(
            inbox.on_message("s", &beat(2)),
            vec![(WorkerId(7), RequestId(2))]
        );
        // Other frames of a request it lacks carry no worker: dropped.
        assert!(inbox.on_message("s", &tokens(2, 0, 5)).is_empty());
        let mux = FrameMux {
            frames: vec![beat(1), beat(3), tokens(1, 0, 9)],
        };
        assert_eq!(
            inbox.on_message("s", &encode(&mux).unwrap()),
            vec![(WorkerId(7), RequestId(3))]
        );
    }
}
