//! One worker's outgoing response frames, coalesced per gateway inbox.
//!
//! Every request's [`crate::forward::Forward`] queues its encoded frames
//! here instead of publishing them; one task publishes them. Frames that
//! are queued while it publishes (the frames of one engine step for every
//! request it advanced, say) leave together: one [`FrameMux`] message per
//! gateway inbox instead of one message per frame. That saves the bus a
//! message (and, with TLS, a record on both sides of the server) per
//! frame, and adds no wait: nothing is held back for a timer.
//!
//! Invariants:
//! - frames leave in the order they were queued (one queue, one
//!   publisher, and grouping keeps the order within each group), so each
//!   request's frames stay in `seq` order;
//! - a frame for an inbox that did not ask for muxing
//!   ([`dynamo_bus_schema::HEADER_FRAME_MUX`]) leaves as its own message;
//!   so does a group of one;
//! - a [`FrameMux`] holds at most [`MAX_MUX_FRAMES`] frames and
//!   [`MUX_BYTES`] bytes of them; a longer group is split, in order;
//! - the queue is bounded ([`QUEUE`] frames): a forward waits for room;
//!   one pass takes at most [`BATCH_BYTES`] (and one frame) off it;
//! - a frame that cannot be encoded or published is logged and counted
//!   (`dynamo_worker_frames_lost_total`); the gateway's liveness checks
//!   then fail or migrate its request;
//! - the publishing task ends when the last [`FrameSink`] is gone (the
//!   actor and every forward), so frames queued during shutdown's grace
//!   still go out; it is dropped at the latest twice
//!   [`dynamo_runtime::tasks::TRANSIENT_GRACE`] after shutdown
//!   ([`dynamo_runtime::Tasks::spawn_draining`]).

use crate::stats::WorkerStats;
use dynamo_bus_schema::{encode, FrameMux, WireMessage, MAX_MUX_FRAMES};
use dynamo_runtime::Bus;
use std::collections::HashMap;
use std::sync::Arc;
use tokio::sync::mpsc;

/// Frames the queue holds before a forward waits for room.
pub const QUEUE: usize = 4096;
/// Most bytes of frames one [`FrameMux`] carries (well under a bus
/// message's limit, with its framing).
pub const MUX_BYTES: usize = 256 * 1024;
/// Most bytes of frames one pass of the publisher takes off the queue.
pub const BATCH_BYTES: usize = 4 * 1024 * 1024;

/// One encoded frame and where it goes.
#[derive(Debug)]
pub struct Outgoing {
    pub subject: String,
    /// A complete envelope.
    pub bytes: Vec<u8>,
    /// The inbox accepts [`FrameMux`] messages.
    pub mux: bool,
}

/// Where a forward queues its frames.
#[derive(Clone, Debug)]
pub struct FrameSink(mpsc::Sender<Outgoing>);

impl FrameSink {
    /// Queues one frame; gives it back if the publisher is gone.
    pub async fn send(&self, o: Outgoing) -> Result<(), Outgoing> {
        self.0.send(o).await.map_err(|e| e.0)
    }

    /// Queues one frame if there is room now (a frame that may be skipped).
    pub fn try_send(&self, o: Outgoing) -> bool {
        self.0.try_send(o).is_ok()
    }
}

/// A sink and the queue [`run`] publishes from.
pub fn channel() -> (FrameSink, mpsc::Receiver<Outgoing>) {
    let (tx, rx) = mpsc::channel(QUEUE);
    (FrameSink(tx), rx)
}

/// One bus message to publish: a frame alone, or a [`FrameMux`] of several.
#[derive(Debug, PartialEq)]
pub struct Message {
    pub subject: String,
    pub name: &'static str,
    /// The envelope, or why it could not be made (its frames are lost).
    pub bytes: Result<Vec<u8>, String>,
    /// Frames inside.
    pub frames: usize,
}

/// Groups a batch of frames into bus messages: the muxable frames of one
/// subject go together (within the bounds), in order; the rest alone.
pub fn group(batch: Vec<Outgoing>) -> Vec<Message> {
    // Groups in the order their first frame came; a group's frames in
    // queue order.
    let mut groups: Vec<(String, Vec<Vec<u8>>)> = Vec::new();
    let mut open: HashMap<String, usize> = HashMap::new();
    for o in batch {
        match o.mux.then(|| open.get(&o.subject).copied()).flatten() {
            Some(i) => groups[i].1.push(o.bytes),
            None => {
                if o.mux {
                    open.insert(o.subject.clone(), groups.len());
                }
                groups.push((o.subject, vec![o.bytes]));
            }
        }
    }
    let mut out = Vec::new();
    for (subject, frames) in groups {
        let mut part: Vec<Vec<u8>> = Vec::new();
        let mut bytes = 0;
        for f in frames {
            if !part.is_empty() && (part.len() == MAX_MUX_FRAMES || bytes + f.len() > MUX_BYTES) {
                out.push(message(&subject, std::mem::take(&mut part)));
                bytes = 0;
            }
            bytes += f.len();
            part.push(f);
        }
        if !part.is_empty() {
            out.push(message(&subject, part));
        }
    }
    out
}

fn message(subject: &str, mut frames: Vec<Vec<u8>>) -> Message {
    let n = frames.len();
    if n == 1 {
        return Message {
            subject: subject.to_string(),
            name: "frame",
            bytes: frames.pop().ok_or_else(|| "no frame".to_string()),
            frames: 1,
        };
    }
    Message {
        subject: subject.to_string(),
        name: FrameMux::NAME,
        bytes: encode(&FrameMux { frames }).map_err(|e| e.to_string()),
        frames: n,
    }
}

/// Publishes what the sinks queue until every sink is gone.
pub async fn run(bus: Bus, mut queue: mpsc::Receiver<Outgoing>, stats: Arc<WorkerStats>) {
    let mut batch = Vec::new();
    while let Some(first) = queue.recv().await {
        let mut bytes = first.bytes.len();
        batch.push(first);
        // Usually, the other forwards woken by the same engine step queue
        // theirs before this one looks.
        tokio::task::yield_now().await;
        while batch.len() < QUEUE && bytes < BATCH_BYTES {
            match queue.try_recv() {
                Ok(o) => {
                    bytes += o.bytes.len();
                    batch.push(o);
                }
                Err(_) => break,
            }
        }
        for m in group(std::mem::take(&mut batch)) {
            let sent = match m.bytes {
                Ok(b) => bus
                    .publish_encoded(m.subject, m.name, b)
                    .await
                    .map_err(|e| e.to_string()),
                Err(e) => Err(e),
            };
            if let Err(e) = &sent {
                // The gateway's liveness checks turn a lost frame into an error.
                tracing::warn!(error = %e, frames = m.frames, "cannot publish frames");
            }
            stats.frames_sent(m.frames, sent.is_ok());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dynamo_bus_schema::{decode, peek_kind};

    fn out(subject: &str, tag: u8, mux: bool) -> Outgoing {
        Outgoing {
            subject: subject.into(),
            bytes: vec![tag; 3],
            mux,
        }
    }

    fn inner(m: &Message) -> Vec<u8> {
        let b = m.bytes.as_ref().unwrap();
        match peek_kind(b) {
            Ok((k, _)) if k == FrameMux::KIND => decode::<FrameMux>(b)
                .unwrap()
                .frames
                .iter()
                .map(|f| f[0])
                .collect(),
            _ => vec![b[0]],
        }
    }

    #[test]
    fn frames_of_one_inbox_go_together_in_order_and_others_alone() {
        let batch = vec![
            out("g1", 1, true),
            out("g2", 2, true),
            out("old", 3, false),
            out("g1", 4, true),
            out("old", 5, false),
            out("g1", 6, true),
        ];
        let msgs = group(batch);
        let got: Vec<(&str, Vec<u8>)> = msgs
            .iter()
            .map(|m| (m.subject.as_str(), inner(m)))
            .collect();
        assert_eq!(
            got,
            vec![
                ("g1", vec![1, 4, 6]),
                ("g2", vec![2]),
                ("old", vec![3]),
                ("old", vec![5]),
            ]
        );
        // A group of one is the frame itself, not a mux of one.
        assert_eq!(msgs[1].bytes, Ok(vec![2; 3]));
        assert_eq!(msgs[0].frames, 3);
        assert_eq!(msgs[0].name, "FrameMux");
    }

    #[test]
    fn a_long_group_is_split_in_order_within_the_bounds() {
        let n = MAX_MUX_FRAMES * 2 + 5;
        let batch: Vec<_> = (0..n)
            .map(|i| Outgoing {
                subject: "g".into(),
                bytes: (i as u32).to_le_bytes().to_vec(),
                mux: true,
            })
            .collect();
        let msgs = group(batch);
        assert_eq!(
            msgs.iter().map(|m| m.frames).collect::<Vec<_>>(),
            vec![MAX_MUX_FRAMES, MAX_MUX_FRAMES, 5]
        );
        let all: Vec<u32> = msgs
            .iter()
            .flat_map(|m| {
                decode::<FrameMux>(m.bytes.as_ref().unwrap())
                    .unwrap()
                    .frames
            })
            .map(|f| u32::from_le_bytes(f[..4].try_into().unwrap()))
            .collect();
        assert_eq!(all, (0..n as u32).collect::<Vec<_>>());

        // By bytes: frames of 100 KiB, at most two fit.
        let big: Vec<_> = (0..5u8)
            .map(|i| Outgoing {
                subject: "g".into(),
                bytes: vec![i; 100 * 1024],
                mux: true,
            })
            .collect();
        let msgs = group(big);
        assert_eq!(
            msgs.iter().map(|m| m.frames).collect::<Vec<_>>(),
            vec![2, 2, 1]
        );
        assert!(msgs
            .iter()
            .all(|m| m.bytes.as_ref().unwrap().len() <= dynamo_bus_schema::MAX_MESSAGE));
    }
}
