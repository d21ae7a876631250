//! An engine's KV event stream over ZMQ, as vLLM and SGLang publish it.
//!
//! - **Live:** a SUB socket on the engine's PUB endpoint. Each message is
//!   multipart `[topic, sequence (8 bytes, big-endian), EventBatch]`.
//! - **Gaps:** a DEALER socket on the engine's ROUTER replay endpoint. We
//!   send `["", start sequence]`; it answers `["", sequence, EventBatch]`
//!   per buffered batch from there, and `["", -1, ""]` at the end.
//! - **Data-parallel ranks** publish on their own ports: the endpoints'
//!   ports plus the rank ([`offset_port`]).
//!
//! The crate is `zeromq`, pure Rust on tokio: it needs no C library on the
//! node (Debian's libzmq would be one more package on every worker), it
//! reconnects a SUB socket whose publisher restarts, and it is what NVIDIA
//! Dynamo uses for the same streams. The tests run it against pyzmq, on
//! libzmq, the library the engines publish with.
//!
//! Invariants: a bad frame (wrong part count, a sequence that is not 8
//! bytes, a payload that does not decode) is counted and logged, never
//! fatal; batches come out in sequence order, each once; a gap is filled
//! from replay when it can be, and otherwise counted as lost; a replay
//! waits at most `replay_timeout` between its messages.

use crate::events::{decode_batch, EngineBatch};
use crate::sequence::{Next, Sequence};
use bytes::Bytes;
use std::time::Duration;
use thiserror::Error;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// Where an engine publishes.
#[derive(Clone, Debug)]
pub struct ZmqConfig {
    /// The engine's PUB endpoint (`tcp://host:5557`).
    pub endpoint: String,
    /// Its ROUTER replay endpoint (`tcp://host:5558`); none: gaps are lost.
    pub replay_endpoint: Option<String>,
    /// Topic prefix subscribed to (vLLM's default is empty: everything).
    pub topic: String,
    /// Data-parallel rank: added to both endpoints' ports.
    pub dp_rank: u16,
    /// Longest wait for the next replayed batch.
    pub replay_timeout: Duration,
}

/// Counters of what came in.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SourceStats {
    pub batches: u64,
    pub bad_frames: u64,
    pub duplicates: u64,
    pub gaps: u64,
    pub replayed: u64,
    /// Batches missed and not replayed.
    pub lost: u64,
}

#[derive(Debug, Error)]
pub enum SourceError {
    #[error("endpoint {endpoint}: {message}")]
    Endpoint { endpoint: String, message: String },
    #[error("zmq: {0}")]
    Zmq(#[from] zeromq::ZmqError),
}

/// `tcp://host:PORT` with `offset` added to the port.
pub fn offset_port(endpoint: &str, offset: u16) -> Result<String, SourceError> {
    let bad = |m: &str| SourceError::Endpoint {
        endpoint: endpoint.to_string(),
        message: m.to_string(),
    };
    if offset == 0 {
        return Ok(endpoint.to_string());
    }
    let (head, port) = endpoint
        .rsplit_once(':')
        .ok_or_else(|| bad("no port to offset"))?;
    let port: u16 = port.parse().map_err(|_| bad("the port is not a number"))?;
    let p = port
        .checked_add(offset)
        .ok_or_else(|| bad("the port plus the rank is past 65535"))?;
    Ok(format!("{head}:{p}"))
}

/// The end-of-replay sequence number (−1 as 8 big-endian bytes).
const END: [u8; 8] = [0xff; 8];

/// One engine rank's event stream.
pub struct ZmqSource {
    cfg: ZmqConfig,
    sub: SubSocket,
    replay: Option<DealerSocket>,
    seq: Sequence,
    pub stats: SourceStats,
}

fn seq_of(b: &Bytes) -> Option<u64> {
    let a: [u8; 8] = b.as_ref().try_into().ok()?;
    Some(u64::from_be_bytes(a))
}

impl ZmqSource {
    /// Connects to the rank's endpoints (a SUB connects before the
    /// publisher is up, and reconnects when it restarts).
    pub async fn connect(cfg: ZmqConfig) -> Result<Self, SourceError> {
        let mut sub = SubSocket::new();
        sub.connect(&offset_port(&cfg.endpoint, cfg.dp_rank)?)
            .await?;
        sub.subscribe(&cfg.topic).await?;
        let replay = match &cfg.replay_endpoint {
            Some(r) => {
                let mut d = DealerSocket::new();
                d.connect(&offset_port(r, cfg.dp_rank)?).await?;
                Some(d)
            }
            None => None,
        };
        Ok(ZmqSource {
            cfg,
            sub,
            replay,
            seq: Sequence::default(),
            stats: SourceStats::default(),
        })
    }

    /// The last sequence number applied.
    pub fn last_seq(&self) -> Option<u64> {
        self.seq.last()
    }

    /// The next batches in order: one live batch, after any it revealed to
    /// be missing and replay could fill. Only a socket failure is an error.
    pub async fn next(&mut self) -> Result<Vec<(u64, EngineBatch)>, SourceError> {
        loop {
            let msg = self.sub.recv().await?;
            let parts = msg.into_vec();
            let (Some(seq), Some(payload), 3) =
                (parts.get(1).and_then(seq_of), parts.get(2), parts.len())
            else {
                self.stats.bad_frames += 1;
                tracing::warn!(
                    parts = parts.len(),
                    "KV event message is not [topic, seq, batch]; skipped"
                );
                continue;
            };
            let mut out = Vec::new();
            match self.seq.live(seq) {
                Next::Duplicate => {
                    self.stats.duplicates += 1;
                    continue;
                }
                Next::Apply => {}
                Next::Gap { from, to } => {
                    self.stats.gaps += 1;
                    self.fill(from, &mut out).await;
                    let next = self.seq.last().map_or(from, |l| l + 1);
                    if next > seq {
                        // The replay reached past this batch: it is in `out`.
                        return Ok(out);
                    }
                    let still = seq - next;
                    if still > 0 {
                        self.stats.lost += still;
                        tracing::warn!(
                            from,
                            to,
                            missed = still,
                            "KV event batches lost (replay did not cover them)"
                        );
                    }
                }
                Next::Lost { missing } => {
                    self.stats.lost += missing;
                    tracing::warn!(missing, seq, "KV event stream jumped; the index may be stale until blocks are stored or removed again");
                }
            }
            self.seq.applied(seq);
            match decode_batch(payload) {
                Ok(b) => {
                    self.stats.batches += 1;
                    out.push((seq, b));
                }
                Err(e) => {
                    self.stats.bad_frames += 1;
                    tracing::warn!(seq, error = %e, "KV event batch does not decode; skipped");
                }
            }
            return Ok(out);
        }
    }

    /// Replays from `from` into `out`, in order, as far as the publisher
    /// still has, to its end marker.
    async fn fill(&mut self, from: u64, out: &mut Vec<(u64, EngineBatch)>) {
        let Some(r) = self.replay.as_mut() else {
            return;
        };
        let mut ask = ZmqMessage::from(Bytes::new());
        ask.push_back(Bytes::copy_from_slice(&from.to_be_bytes()));
        if let Err(e) = r.send(ask).await {
            tracing::warn!(error = %e, "KV event replay request failed");
            return;
        }
        loop {
            let m = match tokio::time::timeout(self.cfg.replay_timeout, r.recv()).await {
                Ok(Ok(m)) => m.into_vec(),
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "KV event replay failed");
                    return;
                }
                Err(_) => {
                    tracing::warn!(from, "KV event replay timed out");
                    return;
                }
            };
            // ["", seq, payload]; a DEALER sees the ROUTER's empty delimiter.
            let parts: &[Bytes] = match m.first() {
                Some(d) if d.is_empty() && m.len() == 3 => &m[1..],
                _ if m.len() == 2 => &m[..],
                _ => {
                    self.stats.bad_frames += 1;
                    continue;
                }
            };
            if parts[0].as_ref() == END || parts[1].is_empty() {
                return;
            }
            let Some(seq) = seq_of(&parts[0]) else {
                self.stats.bad_frames += 1;
                continue;
            };
            match self.seq.last() {
                Some(l) if seq <= l => continue,
                Some(l) if seq > l + 1 => {
                    // The publisher's buffer no longer reaches back that far.
                    self.stats.lost += seq - l - 1;
                }
                _ => {}
            }
            self.seq.applied(seq);
            match decode_batch(&parts[1]) {
                Ok(b) => {
                    self.stats.replayed += 1;
                    out.push((seq, b));
                }
                Err(e) => {
                    self.stats.bad_frames += 1;
                    tracing::warn!(seq, error = %e, "replayed KV event batch does not decode; skipped");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_offset_the_port() {
        assert_eq!(offset_port("tcp://h:5557", 0).unwrap(), "tcp://h:5557");
        assert_eq!(offset_port("tcp://h:5557", 2).unwrap(), "tcp://h:5559");
        assert!(offset_port("tcp://h", 1).is_err());
        assert!(offset_port("tcp://h:65535", 1).is_err());
    }
}
