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
//! fatal; a socket error is counted and retried, never fatal; batches come
//! out in sequence order, each once; a gap is filled from replay when it
//! can be, and what replay cannot bring, or a publisher's restart, comes
//! out as an [`Item::Discontinuity`] before the batches after it; a replay
//! reads at most its gap's length, each message within `replay_timeout`.

use crate::events::{decode_batch, EngineBatch};
use crate::sequence::{Next, Sequence};
use bytes::Bytes;
use std::time::Duration;
use thiserror::Error;
use zeromq::{DealerSocket, Socket, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// How long one [`ZmqSource::connect`] tries before it gives up. The
/// caller paces the retries (the worker's feed retries at its health
/// interval), so a publisher that comes up is found within that interval
/// plus about this much (a refused try waits out the rest of it, since
/// `zeromq` waits 1.4 s before its own first retry); `zeromq`'s default
/// is 30 s of tries that back off to 5 s apart.
pub const CONNECT_TRY: Duration = Duration::from_secs(1);

/// Where an engine publishes.
#[derive(Clone, Debug, PartialEq)]
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
    /// Times the publisher started its numbering again.
    pub restarts: u64,
    /// Batches of another data-parallel rank (a port mix-up), skipped.
    pub wrong_rank: u64,
    /// Errors the sockets returned (each followed by a pause and a retry).
    pub socket_errors: u64,
}

/// What the stream gives, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum Item {
    Batch(u64, EngineBatch),
    /// Batches were lost, or the publisher restarted: what was built from
    /// the earlier ones may be stale. The consumer starts again from
    /// nothing (the router then sees only what is stored from here on:
    /// incomplete, never wrong).
    Discontinuity {
        lost: u64,
    },
}

#[derive(Debug, Error)]
pub enum SourceError {
    #[error("endpoint {endpoint}: {message}")]
    Endpoint { endpoint: String, message: String },
    #[error("zmq: {0}")]
    Zmq(zeromq::ZmqError),
}

// Not `#[from]`: the message already shows the cause, and a source would
// print it twice in a chain (`{:#}`).
impl From<zeromq::ZmqError> for SourceError {
    fn from(e: zeromq::ZmqError) -> Self {
        SourceError::Zmq(e)
    }
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
/// Pause after a socket error.
const ERROR_PAUSE: Duration = Duration::from_millis(100);

/// One engine rank's event stream. Not cancel-safe: drop the future of
/// [`ZmqSource::next`] only to drop the source.
pub struct ZmqSource {
    cfg: ZmqConfig,
    sub: SubSocket,
    replay_endpoint: Option<String>,
    /// Connected lazily, and again after any failure (a DEALER does not
    /// reconnect by itself, and one that timed out holds stale replies).
    replay: Option<DealerSocket>,
    seq: Sequence,
    pub stats: SourceStats,
}

fn seq_of(b: &Bytes) -> Option<u64> {
    let a: [u8; 8] = b.as_ref().try_into().ok()?;
    Some(u64::from_be_bytes(a))
}

impl ZmqSource {
    /// Connects to the rank's publisher (the SUB reconnects when it
    /// restarts); the replay endpoint is connected when first needed.
    pub async fn connect(cfg: ZmqConfig) -> Result<Self, SourceError> {
        let mut opts = SocketOptions::default();
        opts.connect_timeout(CONNECT_TRY);
        let mut sub = SubSocket::with_options(opts);
        sub.connect(&offset_port(&cfg.endpoint, cfg.dp_rank)?)
            .await?;
        sub.subscribe(&cfg.topic).await?;
        let replay_endpoint = match &cfg.replay_endpoint {
            Some(r) => Some(offset_port(r, cfg.dp_rank)?),
            None => None,
        };
        Ok(ZmqSource {
            cfg,
            sub,
            replay_endpoint,
            replay: None,
            seq: Sequence::default(),
            stats: SourceStats::default(),
        })
    }

    /// The last sequence number applied.
    pub fn last_seq(&self) -> Option<u64> {
        self.seq.last()
    }

    /// The next items in order: one live batch, after whatever it revealed
    /// to be missing (replayed, or a discontinuity). Socket errors are
    /// counted and retried, never returned: the SUB reconnects by itself.
    pub async fn next(&mut self) -> Vec<Item> {
        loop {
            let msg = match self.sub.recv().await {
                Ok(m) => m,
                Err(e) => {
                    self.stats.socket_errors = self.stats.socket_errors.saturating_add(1);
                    tracing::warn!(error = %e, "KV event socket error; retrying");
                    tokio::time::sleep(ERROR_PAUSE).await;
                    continue;
                }
            };
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
            let next = self.seq.live(seq);
            self.seq.seen_live(seq);
            match next {
                Next::Duplicate => {
                    self.stats.duplicates += 1;
                    continue;
                }
                Next::Apply => {}
                Next::Restart => {
                    self.stats.restarts += 1;
                    tracing::warn!(
                        seq,
                        "KV event publisher restarted; starting again from nothing"
                    );
                    self.seq.reset();
                    self.seq.seen_live(seq);
                    out.push(Item::Discontinuity { lost: 0 });
                    if seq > 0 {
                        self.fill(0, seq - 1, &mut out).await;
                    }
                }
                Next::Gap { from, to } => {
                    self.stats.gaps += 1;
                    self.fill(from, to, &mut out).await;
                }
                Next::Lost { missing } => self.lose(missing, &mut out),
            }
            // Whatever replay did not bring before this batch is lost.
            let want = self.seq.last().map_or(0, |l| l + 1);
            if seq > want {
                self.lose(seq - want, &mut out);
            }
            self.apply(seq, payload, &mut out, false);
            return out;
        }
    }

    fn lose(&mut self, n: u64, out: &mut Vec<Item>) {
        self.stats.lost = self.stats.lost.saturating_add(n);
        tracing::warn!(
            missed = n,
            "KV event batches lost; starting again from nothing"
        );
        out.push(Item::Discontinuity { lost: n });
    }

    /// Applies batch `seq` (decoded, or counted when it does not decode).
    fn apply(&mut self, seq: u64, payload: &[u8], out: &mut Vec<Item>, replayed: bool) {
        self.seq.applied(seq);
        match decode_batch(payload) {
            Ok(b) if b.dp_rank.is_some_and(|r| r != self.cfg.dp_rank as i64) => {
                self.stats.wrong_rank += 1;
                tracing::warn!(seq, rank = ?b.dp_rank, want = self.cfg.dp_rank, "KV event batch of another rank; skipped");
            }
            Ok(b) => {
                if replayed {
                    self.stats.replayed += 1;
                } else {
                    self.stats.batches += 1;
                }
                out.push(Item::Batch(seq, b));
            }
            Err(e) => {
                self.stats.bad_frames += 1;
                tracing::warn!(seq, error = %e, "KV event batch does not decode; skipped");
            }
        }
    }

    /// Replays `from..=to` into `out`, in order, as far as the publisher
    /// still has them. Reads at most the gap's length (plus a few bad
    /// frames), each within `replay_timeout`; a replay that stops early
    /// drops the DEALER, so its stale replies go with it.
    async fn fill(&mut self, from: u64, to: u64, out: &mut Vec<Item>) {
        let Some(endpoint) = self.replay_endpoint.clone() else {
            return;
        };
        let mut r = match self.replay.take() {
            Some(r) => r,
            None => {
                let mut d = DealerSocket::new();
                match tokio::time::timeout(self.cfg.replay_timeout, d.connect(&endpoint)).await {
                    Ok(Ok(())) => d,
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e, endpoint, "KV event replay endpoint unreachable");
                        return;
                    }
                    Err(_) => {
                        tracing::warn!(endpoint, "KV event replay endpoint: connect timed out");
                        return;
                    }
                }
            }
        };
        if self.replay_once(&mut r, from, to, out).await {
            self.replay = Some(r);
        }
    }

    /// One replay request; whether it ended cleanly (at `to` or the end
    /// marker, with nothing left unread but what a fresh DEALER drops).
    async fn replay_once(
        &mut self,
        r: &mut DealerSocket,
        from: u64,
        to: u64,
        out: &mut Vec<Item>,
    ) -> bool {
        let mut ask = ZmqMessage::from(Bytes::new());
        ask.push_back(Bytes::copy_from_slice(&from.to_be_bytes()));
        if let Err(e) = r.send(ask).await {
            tracing::warn!(error = %e, "KV event replay request failed");
            return false;
        }
        let budget = (to - from).saturating_add(17);
        for _ in 0..budget {
            let m = match tokio::time::timeout(self.cfg.replay_timeout, r.recv()).await {
                Ok(Ok(m)) => m.into_vec(),
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "KV event replay failed");
                    return false;
                }
                Err(_) => {
                    tracing::warn!(from, to, "KV event replay timed out");
                    return false;
                }
            };
            // ["", seq, payload]: a DEALER sees the ROUTER's empty delimiter.
            let parts: &[Bytes] = match m.first() {
                Some(d) if d.is_empty() && m.len() == 3 => &m[1..],
                _ if m.len() == 2 => &m[..],
                _ => {
                    self.stats.bad_frames += 1;
                    continue;
                }
            };
            if parts[0].as_ref() == END || parts[1].is_empty() {
                return true;
            }
            let Some(seq) = seq_of(&parts[0]) else {
                self.stats.bad_frames += 1;
                continue;
            };
            match self.seq.last() {
                Some(l) if seq <= l => continue,
                last => {
                    let want = last.map_or(0, |l| l + 1);
                    if seq > want {
                        // The publisher's buffer no longer reaches back that far.
                        self.lose(seq - want, out);
                    }
                }
            }
            if seq > to {
                return false; // past the gap: the rest is stale for us
            }
            let payload = parts[1].clone();
            self.apply(seq, &payload, out, true);
            if seq == to {
                return false; // the rest of the replay is not wanted
            }
        }
        false
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

    /// A publisher that is not up yet fails one connect after
    /// [`CONNECT_TRY`], not zeromq's 30 s, so the caller's retry finds it
    /// soon after it comes up (virtual time: the sockets are real).
    #[tokio::test(start_paused = true)]
    async fn a_publisher_not_up_fails_one_connect_after_its_try() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let cfg = ZmqConfig {
            endpoint: format!("tcp://127.0.0.1:{port}"),
            replay_endpoint: None,
            topic: String::new(),
            dp_rank: 0,
            replay_timeout: Duration::from_secs(2),
        };
        let start = tokio::time::Instant::now();
        let r = ZmqSource::connect(cfg).await;
        assert!(r.is_err(), "nothing listens on {port}");
        assert!(start.elapsed() <= CONNECT_TRY + Duration::from_millis(100));
    }
}
