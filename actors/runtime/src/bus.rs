//! The bus: a NATS client, JetStream, and typed helpers over the one codec.

use async_nats::jetstream::{self, kv, stream};
use async_nats::Client;
use bytes::Bytes;
use dynamo_bus_schema::chunk::{split, Assembler, ChunkError, MAX_PIECE};
use dynamo_bus_schema::{
    decode, decode_assembled, decode_payload, encode, peek_kind, ChunkedReply, DecodeError,
    ErrorReply, Subjects, WireError, WireMessage, MAX_MESSAGE,
};
use futures::StreamExt;
use std::time::Duration;
use thiserror::Error;

pub use crate::access::BusAccess;

/// A connect error with what to do about it: a certificate the client
/// cannot check wants the cluster's CA; a refused user wants credentials.
fn connect_hint(reason: &str, access: &BusAccess) -> String {
    let l = reason.to_ascii_lowercase();
    if l.contains("certificate") || l.contains("issuer") {
        let ca = match &access.ca_file {
            Some(ca) => format!("the CA file {} did not verify it", ca.display()),
            None => format!(
                "no CA file is configured ([nats] ca_file or ${})",
                crate::access::ENV_NATS_CA
            ),
        };
        format!("{reason} (TLS: the server's certificate could not be verified; {ca})")
    } else if l.contains("tls") {
        format!(
            "{reason} (TLS: a tls:// URL or a CA file needs a server with TLS on; a server with TLS needs a tls:// URL or [nats] ca_file / ${})",
            crate::access::ENV_NATS_CA
        )
    } else if l.contains("authorization") || l.contains("authentication") {
        let who = match access.role() {
            Some(r) => format!("the {r} credential was refused"),
            None => format!(
                "the server requires a user: set [nats] credentials or ${}",
                crate::access::ENV_NATS_CREDENTIALS
            ),
        };
        format!("{reason} ({who})")
    } else {
        reason.to_string()
    }
}

#[derive(Debug, Error)]
pub enum BusError {
    #[error("cannot connect to NATS at {url}: {reason}")]
    Connect { url: String, reason: String },
    #[error("cannot publish to {subject}: {reason}")]
    Publish { subject: String, reason: String },
    #[error("no worker is listening on {subject}")]
    NoResponders { subject: String },
    #[error("request to {subject} timed out after {timeout:?}")]
    Timeout { subject: String, timeout: Duration },
    #[error("request to {subject} failed: {reason}")]
    Request { subject: String, reason: String },
    #[error("reply from {subject} could not be decoded: {cause}")]
    Decode { subject: String, cause: DecodeError },
    #[error("{subject} answered with an error: {error}")]
    Remote { subject: String, error: WireError },
    #[error("JetStream bucket {bucket}: {reason}")]
    Bucket { bucket: String, reason: String },
    #[error("cannot encode: {0}")]
    Encode(String),
    #[error("{name} of {len} bytes is larger than one bus message may be ({MAX_MESSAGE} bytes)")]
    TooLarge { name: &'static str, len: usize },
    #[error("reply from {subject} came in bad pieces: {cause}")]
    Pieces { subject: String, cause: ChunkError },
}

/// Registry buckets (workers, nodes) drop a record this long after its last
/// write, so crashed processes do not linger; live ones rewrite every second.
pub const REGISTRY_MAX_AGE: Duration = Duration::from_secs(60);

/// Messages a subscription buffers before the client drops the newest
/// (NATS "slow consumer"): a subscriber that falls this far behind loses
/// messages rather than memory. Every input is numbered or re-sent
/// (frames, KV events, heartbeats), so a loss is detected and repaired.
pub const SUBSCRIPTION_CAPACITY: usize = 8192;

/// One process's connection to the bus.
#[derive(Clone)]
pub struct Bus {
    pub client: Client,
    pub js: jetstream::Context,
    pub subjects: Subjects,
    /// Replicas of every stream and bucket this process creates: 3 on a
    /// NATS cluster of three or more servers (given as URLs, or advertised
    /// by the server it reached), else 1. Where the servers cannot place
    /// that many, a stream is created with one (see `create_stream`).
    pub replicas: usize,
    /// When the connection last went down or came back ([`mono_ms`]; 0:
    /// never), so a silence can be told from the bus's own outage.
    last_outage_ms: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

/// Milliseconds on a monotonic clock since the process first asked, plus
/// one (so 0 means never): outage times do not move with the wall clock.
fn mono_ms() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as u64
        + 1
}

/// `url` (one or several comma-separated servers) with any password or
/// token in it replaced by `***`, for messages and status output. A part
/// without a scheme (`user:pass@host:4222`) is read as the client reads it.
pub fn redact_url(url: &str) -> String {
    url.split(',')
        .map(|part| {
            let scheme_end = part.find("://").map(|i| i + 3).unwrap_or(0);
            let rest = &part[scheme_end..];
            // The userinfo ends at the last '@' (a password may hold '/').
            match rest.rfind('@') {
                None => part.to_string(),
                Some(at) => {
                    let user = match rest[..at].split_once(':') {
                        Some((u, _)) => format!("{u}:***"),
                        None => "***".to_string(),
                    };
                    format!("{}{user}{}", &part[..scheme_end], &rest[at..])
                }
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// The servers of a comma-separated URL list (async-nats parses one URL per
/// string, so a list is split here).
pub fn server_addrs(url: &str) -> Result<Vec<async_nats::ServerAddr>, String> {
    url.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|u| {
            u.parse()
                .map_err(|e| format!("bad server URL {:?}: {e}", redact_url(u)))
        })
        .collect::<Result<Vec<_>, _>>()
        .and_then(|v| {
            if v.is_empty() {
                Err("no server URL".into())
            } else {
                Ok(v)
            }
        })
}

/// Stream replicas for a comma-separated server list: R3 on a cluster of
/// three or more servers (survives losing one), R1 on a single server.
pub fn replicas_for(url: &str) -> usize {
    let servers = url
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect::<std::collections::BTreeSet<_>>()
        .len();
    if servers >= 3 {
        3
    } else {
        1
    }
}

impl Bus {
    /// Connects (retrying in the background if the server is briefly away).
    /// `url` may list several servers, comma-separated: the client fails
    /// over between them, and streams are created with [`replicas_for`] it.
    ///
    /// `access` says how the server is checked (a CA: TLS required) and
    /// who this connection is (a role's nkey, whose permissions bound what
    /// it may publish and read).
    pub async fn connect(
        url: &str,
        name: &str,
        subjects: Subjects,
        access: &BusAccess,
    ) -> Result<Self, BusError> {
        let servers = server_addrs(url).map_err(|reason| BusError::Connect {
            url: redact_url(url),
            reason,
        })?;
        let last_outage_ms = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let outage = last_outage_ms.clone();
        let opts = async_nats::ConnectOptions::new()
            .name(name)
            .subscription_capacity(SUBSCRIPTION_CAPACITY)
            .connection_timeout(Duration::from_secs(5))
            .request_timeout(Some(Duration::from_secs(10)))
            // A refused publish or subscribe (permissions) is logged with
            // the subject: the server says so only asynchronously.
            .event_callback(move |ev| {
                let outage = outage.clone();
                async move {
                    match ev {
                        async_nats::Event::Disconnected => {
                            outage.store(mono_ms(), std::sync::atomic::Ordering::Relaxed);
                        }
                        // Back after an outage (the first connection is none).
                        async_nats::Event::Connected => {
                            let _ = outage.fetch_update(
                                std::sync::atomic::Ordering::Relaxed,
                                std::sync::atomic::Ordering::Relaxed,
                                |at| (at != 0).then(mono_ms),
                            );
                        }
                        async_nats::Event::ServerError(e) => {
                            tracing::warn!(error = %e, "NATS server error");
                        }
                        async_nats::Event::ClientError(e) => {
                            tracing::warn!(error = %e, "NATS client error");
                        }
                        _ => {}
                    }
                }
            });
        let client = access
            .apply(opts, subjects.namespace())
            .connect(servers)
            .await
            .map_err(|e| BusError::Connect {
                url: redact_url(url),
                reason: connect_hint(&e.to_string(), access),
            })?;
        let js = jetstream::new(client.clone());
        // The servers the cluster itself advertises count too: a node given
        // one seed URL of a three-server cluster still replicates.
        let advertised = client.server_info().connect_urls.len();
        let replicas = replicas_for(url).max(if advertised >= 3 { 3 } else { 1 });
        Ok(Bus {
            client,
            js,
            subjects,
            replicas,
            last_outage_ms,
        })
    }

    /// Whether the connection to the server is up right now.
    pub fn is_connected(&self) -> bool {
        self.client.connection_state() == async_nats::connection::State::Connected
    }

    /// Whether the connection is down, or went down or came back within
    /// `within`: a silence that long may be the bus's, not a peer's.
    pub fn outage_within(&self, within: Duration) -> bool {
        if !self.is_connected() {
            return true;
        }
        let at = self
            .last_outage_ms
            .load(std::sync::atomic::Ordering::Relaxed);
        at != 0 && mono_ms().saturating_sub(at) < within.as_millis() as u64
    }

    /// Encodes and publishes a message (refused past [`MAX_MESSAGE`] bytes).
    pub async fn publish<T: WireMessage>(&self, subject: String, msg: &T) -> Result<(), BusError> {
        let bytes = encode_bounded(msg)?;
        self.publish_bytes(subject, bytes).await
    }

    /// Publishes an envelope encoded already (refused past [`MAX_MESSAGE`]
    /// bytes, like [`Self::publish`]).
    pub async fn publish_encoded(
        &self,
        subject: String,
        name: &'static str,
        bytes: Vec<u8>,
    ) -> Result<(), BusError> {
        if bytes.len() > MAX_MESSAGE {
            return Err(BusError::TooLarge {
                name,
                len: bytes.len(),
            });
        }
        self.publish_bytes(subject, bytes).await
    }

    async fn publish_bytes(&self, subject: String, bytes: Vec<u8>) -> Result<(), BusError> {
        self.client
            .publish(subject.clone(), Bytes::from(bytes))
            .await
            .map_err(|e| BusError::Publish {
                subject,
                reason: e.to_string(),
            })
    }

    /// Request/reply with a typed answer. An [`ErrorReply`] becomes [`BusError::Remote`].
    pub async fn request<T: WireMessage, R: WireMessage>(
        &self,
        subject: String,
        msg: &T,
        timeout: Duration,
    ) -> Result<R, BusError> {
        let payload = self.request_bytes(subject.clone(), msg, timeout).await?;
        decode(&payload).map_err(|source| BusError::Decode {
            subject,
            cause: source,
        })
    }

    /// Request/reply whose answer may be one of several kinds: the raw
    /// envelope, for the caller to `peek_kind`. An [`ErrorReply`] becomes
    /// [`BusError::Remote`].
    pub async fn request_bytes<T: WireMessage>(
        &self,
        subject: String,
        msg: &T,
        timeout: Duration,
    ) -> Result<Bytes, BusError> {
        self.request_bytes_with(subject, msg, None, timeout).await
    }

    /// [`Self::request`] with NATS headers on the request.
    pub async fn request_with<T: WireMessage, R: WireMessage>(
        &self,
        subject: String,
        msg: &T,
        headers: Option<async_nats::HeaderMap>,
        timeout: Duration,
    ) -> Result<R, BusError> {
        let payload = self
            .request_bytes_with(subject.clone(), msg, headers, timeout)
            .await?;
        decode(&payload).map_err(|source| BusError::Decode {
            subject,
            cause: source,
        })
    }

    async fn request_bytes_with<T: WireMessage>(
        &self,
        subject: String,
        msg: &T,
        headers: Option<async_nats::HeaderMap>,
        timeout: Duration,
    ) -> Result<Bytes, BusError> {
        let bytes = encode_bounded(msg)?;
        // The client's own request timeout (10 s by default) must not cut
        // a longer wait short: the request carries ours.
        let mut req = async_nats::client::Request::new()
            .payload(Bytes::from(bytes))
            .timeout(Some(timeout));
        if let Some(h) = headers {
            req = req.headers(h);
        }
        let fut = self.client.send_request(subject.clone(), req);
        let reply = match tokio::time::timeout(timeout, fut).await {
            Err(_) => return Err(BusError::Timeout { subject, timeout }),
            Ok(Err(e)) => {
                return Err(match e.kind() {
                    async_nats::client::RequestErrorKind::NoResponders => {
                        BusError::NoResponders { subject }
                    }
                    async_nats::client::RequestErrorKind::TimedOut => {
                        BusError::Timeout { subject, timeout }
                    }
                    _ => BusError::Request {
                        subject,
                        reason: e.to_string(),
                    },
                })
            }
            Ok(Ok(m)) => m,
        };
        match peek_kind(&reply.payload) {
            Ok((kind, _)) if kind == ErrorReply::KIND => {
                let err: ErrorReply =
                    decode(&reply.payload).map_err(|source| BusError::Decode {
                        subject: subject.clone(),
                        cause: source,
                    })?;
                Err(BusError::Remote {
                    subject,
                    error: err.error,
                })
            }
            _ => Ok(reply.payload),
        }
    }

    /// Request/reply whose answer may be larger than one message: the
    /// responder ([`Self::reply`]) sends it whole or in [`ChunkedReply`]
    /// pieces, which are put back together here. The answer is the raw
    /// envelope (any kind, for the caller to `peek_kind`; see
    /// [`decode_assembled`]); an [`ErrorReply`] becomes [`BusError::Remote`].
    /// `timeout` covers every piece.
    pub async fn request_large<T: WireMessage>(
        &self,
        subject: String,
        msg: &T,
        timeout: Duration,
    ) -> Result<Vec<u8>, BusError> {
        let bytes = encode_bounded(msg)?;
        let inbox = self.client.new_inbox();
        let request_err = |e: &dyn std::fmt::Display| BusError::Request {
            subject: subject.clone(),
            reason: e.to_string(),
        };
        let mut sub = self
            .client
            .subscribe(inbox.clone())
            .await
            .map_err(|e| request_err(&e))?;
        self.client
            .publish_with_reply(subject.clone(), inbox, Bytes::from(bytes))
            .await
            .map_err(|e| request_err(&e))?;
        let deadline = tokio::time::Instant::now() + timeout;
        let mut pieces = Assembler::default();
        loop {
            let m = match tokio::time::timeout_at(deadline, sub.next()).await {
                Err(_) => return Err(BusError::Timeout { subject, timeout }),
                Ok(None) => return Err(request_err(&"subscription closed")),
                Ok(Some(m)) => m,
            };
            if m.status == Some(async_nats::StatusCode::NO_RESPONDERS) {
                return Err(BusError::NoResponders { subject });
            }
            let whole = match peek_kind(&m.payload) {
                Ok((k, p)) if k == ChunkedReply::KIND => {
                    let piece: ChunkedReply =
                        decode_payload(p).map_err(|source| BusError::Decode {
                            subject: subject.clone(),
                            cause: source,
                        })?;
                    match pieces.push(piece) {
                        Ok(Some(whole)) => whole,
                        Ok(None) => continue,
                        Err(source) => {
                            return Err(BusError::Pieces {
                                subject,
                                cause: source,
                            })
                        }
                    }
                }
                _ => m.payload.to_vec(),
            };
            return match peek_kind(&whole) {
                Ok((k, _)) if k == ErrorReply::KIND => {
                    let e: ErrorReply =
                        decode_assembled(&whole).map_err(|source| BusError::Decode {
                            subject: subject.clone(),
                            cause: source,
                        })?;
                    Err(BusError::Remote {
                        subject,
                        error: e.error,
                    })
                }
                _ => Ok(whole),
            };
        }
    }

    /// Opens (creating if needed) a KV bucket whose entries expire `max_age`
    /// after their last write (zero = never).
    ///
    /// nats-server 2.9.10 and async-nats 0.51 disagree on account info, so
    /// `create_key_value` fails there: we create the bucket's backing stream
    /// `KV_<bucket>` ourselves with the settings a KV bucket has, then open it
    /// with `get_key_value`.
    pub async fn kv_bucket(&self, bucket: &str, max_age: Duration) -> Result<kv::Store, BusError> {
        self.kv_bucket_stored(bucket, max_age, stream::StorageType::Memory)
            .await
    }

    /// A KV bucket kept on the server's disk (desired state: deployments,
    /// assignments), which survives a restart of the NATS server.
    pub async fn kv_bucket_durable(&self, bucket: &str) -> Result<kv::Store, BusError> {
        self.kv_bucket_stored(bucket, Duration::ZERO, stream::StorageType::File)
            .await
    }

    async fn kv_bucket_stored(
        &self,
        bucket: &str,
        max_age: Duration,
        storage: stream::StorageType,
    ) -> Result<kv::Store, BusError> {
        let err = |reason: String| BusError::Bucket {
            bucket: bucket.into(),
            reason,
        };
        let stream_name = format!("KV_{bucket}");
        if self.js.get_stream(&stream_name).await.is_err() {
            let cfg = stream::Config {
                name: stream_name.clone(),
                subjects: vec![format!("$KV.{bucket}.>")],
                max_messages_per_subject: 1,
                max_age,
                allow_rollup: true,
                deny_delete: true,
                allow_direct: true,
                discard: stream::DiscardPolicy::New,
                storage,
                num_replicas: self.replicas,
                duplicate_window: Duration::from_secs(2).min(if max_age.is_zero() {
                    Duration::from_secs(120)
                } else {
                    max_age
                }),
                ..Default::default()
            };
            if let Err(e) = self.create_stream(cfg).await {
                // Another process may have created it first.
                if self.js.get_stream(&stream_name).await.is_err() {
                    return Err(err(e));
                }
            }
        }
        self.await_leader(&stream_name).await;
        self.js
            .get_key_value(bucket)
            .await
            .map_err(|e| err(e.to_string()))
    }

    /// Opens (creating if needed) an object store kept on the server's
    /// disk. As with KV buckets, `create_object_store` fails against
    /// nats-server 2.9.10, so its backing stream `OBJ_<bucket>` is created
    /// here with the settings an object store has.
    pub async fn object_store(
        &self,
        bucket: &str,
    ) -> Result<async_nats::jetstream::object_store::ObjectStore, BusError> {
        let err = |reason: String| BusError::Bucket {
            bucket: bucket.into(),
            reason,
        };
        let stream_name = format!("OBJ_{bucket}");
        if self.js.get_stream(&stream_name).await.is_err() {
            let cfg = stream::Config {
                name: stream_name.clone(),
                subjects: vec![format!("$O.{bucket}.C.>"), format!("$O.{bucket}.M.>")],
                allow_rollup: true,
                allow_direct: true,
                discard: stream::DiscardPolicy::New,
                storage: stream::StorageType::File,
                num_replicas: self.replicas,
                ..Default::default()
            };
            if let Err(e) = self.create_stream(cfg).await {
                if self.js.get_stream(&stream_name).await.is_err() {
                    return Err(err(e));
                }
            }
        }
        self.await_leader(&stream_name).await;
        self.js
            .get_object_store(bucket)
            .await
            .map_err(|e| err(e.to_string()))
    }

    /// Creates a stream with [`Self::replicas`]; where the servers say they
    /// cannot place that many (fewer than three in the cluster, say a
    /// two-server cluster named by three URLs, or one of three down just
    /// then), it is created with one replica instead, and that is logged: a
    /// bus that works unreplicated beats one that does not start. The next
    /// process to open it with three servers up scales it back up
    /// (`await_leader`).
    async fn create_stream(&self, cfg: stream::Config) -> Result<(), String> {
        let name = cfg.name.clone();
        use async_nats::jetstream::{context::CreateStreamErrorKind, ErrorCode};
        let replicated = match self.js.create_stream(cfg.clone()).await {
            Ok(_) => return Ok(()),
            // Only where the servers say they cannot place the replicas;
            // a timeout or a lost leader is an error like any other.
            Err(e)
                if cfg.num_replicas > 1
                    && matches!(e.kind(), CreateStreamErrorKind::JetStream(j)
                        if [ErrorCode::CLUSTER_NO_PEERS, ErrorCode::INSUFFICIENT_RESOURCES, ErrorCode(10074)]
                            .contains(&j.error_code())) =>
            {
                e
            }
            Err(e) => return Err(e.to_string()),
        };
        if self.js.get_stream(&name).await.is_ok() {
            // Another process created it meanwhile.
            return Ok(());
        }
        tracing::warn!(
            stream = name,
            replicas = cfg.num_replicas,
            error = %replicated,
            "the servers cannot replicate the stream; creating it with one replica (are fewer than three NATS servers in the cluster?)"
        );
        let one = stream::Config {
            num_replicas: 1,
            ..cfg
        };
        self.js
            .create_stream(one)
            .await
            .map(|_| ())
            .map_err(|e| format!("{e} (and with {} replicas: {replicated})", self.replicas))
    }

    /// Settles a stream this process uses: one created with fewer replicas
    /// than this process would give it (by a process that saw a single
    /// server) is scaled up, and on a cluster it waits (up to 10 s) until
    /// the stream has a leader — a stream just created or scaled takes a
    /// moment to elect one, and a publish before that is refused.
    async fn await_leader(&self, name: &str) {
        if self.replicas <= 1 {
            return;
        }
        if let Ok(mut s) = self.js.get_stream(name).await {
            if let Ok(info) = s.info().await {
                if info.config.num_replicas < self.replicas {
                    let mut cfg = info.config.clone();
                    cfg.num_replicas = self.replicas;
                    match self.js.update_stream(cfg).await {
                        Ok(_) => tracing::info!(
                            stream = name,
                            replicas = self.replicas,
                            "scaled up the replicas of a stream"
                        ),
                        Err(e) => tracing::warn!(
                            stream = name,
                            error = %e,
                            "cannot scale up the replicas of a stream"
                        ),
                    }
                }
            }
        }
        let t0 = std::time::Instant::now();
        while t0.elapsed() < Duration::from_secs(10) {
            if let Ok(mut s) = self.js.get_stream(name).await {
                if let Ok(info) = s.info().await {
                    // A single server's streams need no election.
                    if info.cluster.as_ref().is_none_or(|c| c.leader.is_some()) {
                        return;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tracing::warn!(
            stream = name,
            "no leader for the stream after 10 s; its first writes may be refused"
        );
    }

    /// Makes sure the stream capturing every worker's KV events exists
    /// (memory storage, bounded by age and size, oldest dropped first).
    pub async fn ensure_kv_events_stream(&self) -> Result<(), BusError> {
        let name = self.subjects.kv_events_stream();
        if self.js.get_stream(&name).await.is_ok() {
            self.await_leader(&name).await;
            return Ok(());
        }
        let cfg = stream::Config {
            name: name.clone(),
            subjects: vec![self.subjects.kv_events_all()],
            max_age: Duration::from_secs(600),
            max_bytes: 256 * 1024 * 1024,
            discard: stream::DiscardPolicy::Old,
            storage: stream::StorageType::Memory,
            num_replicas: self.replicas,
            ..Default::default()
        };
        if let Err(e) = self.create_stream(cfg).await {
            if self.js.get_stream(&name).await.is_err() {
                return Err(BusError::Bucket {
                    bucket: name,
                    reason: e,
                });
            }
        }
        self.await_leader(&name).await;
        Ok(())
    }

    /// Serves request/reply on `sub` until `cancel` fires or the subscription
    /// ends: each request is decoded as `Req` and answered with the handler's
    /// message, or an [`ErrorReply`] carrying its error. An undecodable request
    /// is counted, logged and answered with a `BadMessage` error, never dropped
    /// silently.
    pub async fn serve<Req, Resp, F, Fut>(
        &self,
        mut sub: async_nats::Subscriber,
        cancel: tokio_util::sync::CancellationToken,
        mut handler: F,
    ) where
        Req: WireMessage,
        Resp: WireMessage,
        F: FnMut(Req) -> Fut,
        Fut: std::future::Future<Output = Result<Resp, WireError>>,
    {
        loop {
            let m = tokio::select! {
                _ = cancel.cancelled() => break,
                m = sub.next() => m,
            };
            let Some(m) = m else { break };
            let answer = match decode::<Req>(&m.payload) {
                Ok(req) => handler(req).await,
                Err(e) => {
                    crate::counters::reject(Req::NAME, m.subject.as_str(), &e);
                    Err(WireError::new(
                        dynamo_bus_schema::ErrorKind::BadMessage,
                        e.to_string(),
                    ))
                }
            };
            match answer {
                Ok(resp) => self.reply(m.reply.as_ref(), &resp).await,
                Err(error) => self.reply(m.reply.as_ref(), &ErrorReply { error }).await,
            }
        }
        let _ = sub.unsubscribe().await;
    }

    /// Replies to a request message with a typed message (no-op without a
    /// reply subject); a reply larger than one message goes in
    /// [`ChunkedReply`] pieces (requesters read it with [`Self::request_large`]).
    pub async fn reply<T: WireMessage>(&self, reply_to: Option<&async_nats::Subject>, msg: &T) {
        let Some(r) = reply_to else { return };
        if let Err(e) = self.reply_to(r.to_string(), msg).await {
            tracing::warn!(error = %e, "cannot send reply");
        }
    }

    async fn reply_to<T: WireMessage>(&self, subject: String, msg: &T) -> Result<(), BusError> {
        let bytes = encode(msg).map_err(|e| BusError::Encode(e.to_string()))?;
        let Some(pieces) = split(&bytes, MAX_PIECE, random_stream_id()) else {
            return self.publish_bytes(subject, bytes).await;
        };
        tracing::debug!(
            what = T::NAME,
            bytes = bytes.len(),
            pieces = pieces.len(),
            "reply sent in pieces"
        );
        for p in &pieces {
            self.publish(subject.clone(), p).await?;
        }
        Ok(())
    }
}

/// Encodes a message that must fit in one bus message.
fn encode_bounded<T: WireMessage>(msg: &T) -> Result<Vec<u8>, BusError> {
    let bytes = encode(msg).map_err(|e| BusError::Encode(e.to_string()))?;
    if bytes.len() > MAX_MESSAGE {
        return Err(BusError::TooLarge {
            name: T::NAME,
            len: bytes.len(),
        });
    }
    Ok(bytes)
}

/// A fresh id for the pieces of one reply.
fn random_stream_id() -> u64 {
    dynamo_bus_schema::RequestId::random().0 as u64
}

#[cfg(test)]
mod url_tests {
    use super::*;

    #[test]
    fn passwords_and_tokens_in_urls_are_not_shown() {
        assert_eq!(
            redact_url("nats://user:s3cret@127.0.0.1:4222"),
            "nats://user:***@127.0.0.1:4222"
        );
        assert_eq!(redact_url("tls://tok@h:4222"), "tls://***@h:4222");
        assert_eq!(
            redact_url("nats://a:b@h1:1,nats://h2:2"),
            "nats://a:***@h1:1,nats://h2:2"
        );
        assert_eq!(redact_url("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
        assert_eq!(redact_url("127.0.0.1:4222"), "127.0.0.1:4222");
        assert_eq!(redact_url("u:p@127.0.0.1:4222"), "u:***@127.0.0.1:4222");
        assert_eq!(redact_url("nats://u:p/q@h:1"), "nats://u:***@h:1");
    }

    #[test]
    fn a_server_list_is_split_and_a_cluster_gets_three_replicas() {
        assert_eq!(server_addrs("nats://a:1, nats://b:2").unwrap().len(), 2);
        assert!(server_addrs("").is_err());
        assert!(server_addrs("nats://a:notaport").is_err());
        assert_eq!(replicas_for("nats://a:1"), 1);
        assert_eq!(replicas_for("nats://a:1,nats://b:1"), 1);
        assert_eq!(replicas_for("nats://a:1,nats://b:1,nats://c:1"), 3);
        assert_eq!(replicas_for("nats://a:1,nats://a:1,nats://a:1"), 1);
    }
}
