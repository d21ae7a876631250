//! One request against an external engine's server: the HTTP call, its
//! streamed chunks decoded ([`crate::dialect`]) and handed out as engine
//! events, and its end.
//!
//! Invariants: `Started` goes once, before any token, with the cached
//! prompt tokens the first chunk reports; where a later chunk reports
//! another count (vLLM puts it only in its usage chunk, after the last
//! choice), one `Cached` with the last count goes before the terminal
//! event; after the chunk with which the engine ended the request, an
//! OpenAI-style stream is read on for its usage chunk until `[DONE]`, its
//! end or [`USAGE_GRACE`], never longer, and what goes wrong then (a
//! broken stream, an error event, a cancel) ends only that read, never
//! the finished request; no more than `max_tokens`
//! tokens are handed out; generation ends after a stop token id even where
//! the server cannot be told about them; exactly one terminal event
//! (`Finished` or `Failed`) ends every request; a request is sent at most
//! twice, the second time only when its connection closed before any
//! response headers came, on a client that keeps no idle connection, and
//! both tries within one `response_timeout`.

use crate::config::Api;
use crate::dialect::{self, ChunkError, Decoder};
use crate::engine::{Detokenize, Retokenize};
use crate::sse::SseDecoder;
use dynamo_bus_schema::FinishReason;
use dynamo_engine::{EngineError, EngineEvent, Slot, ValidRequest};
use futures::StreamExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Tries of a request whose connection closed before any answer: the
/// second goes on a new connection.
const SEND_TRIES: u32 = 2;
/// Bytes of an error answer kept for the message.
const MAX_ERROR_BODY: usize = 4096;
/// How long the rest of a finished stream is read, so its connection can
/// be reused.
const DRAIN: Duration = Duration::from_millis(200);
/// Longest an OpenAI-style stream is read after its last choice for the
/// usage chunk that follows it (vLLM sends it, then `[DONE]`, at once).
pub(crate) const USAGE_GRACE: Duration = Duration::from_millis(100);

/// A response body being read.
type Body = std::pin::Pin<Box<dyn futures::Stream<Item = reqwest::Result<bytes::Bytes>> + Send>>;

/// What one request needs to call the server.
pub(crate) struct Call {
    pub(crate) client: reqwest::Client,
    /// Keeps no idle connection: the retry's client.
    pub(crate) fresh: reqwest::Client,
    /// Requests of this engine sent again (logged at 1, 2, 4, 8, …).
    pub(crate) retried: Arc<AtomicU64>,
    pub(crate) base: String,
    pub(crate) api: Api,
    pub(crate) model: String,
    pub(crate) vocab: u32,
    pub(crate) response_timeout: Duration,
    pub(crate) idle_timeout: Duration,
    pub(crate) retokenize: Option<Retokenize>,
    /// `prompt = "text"`: the prompt goes as this detokenizer's text.
    pub(crate) detokenize: Option<Detokenize>,
}

async fn error_body(r: reqwest::Response) -> String {
    let mut body = Vec::new();
    let mut s = r.bytes_stream();
    while let Some(Ok(b)) = s.next().await {
        body.extend_from_slice(&b);
        if body.len() >= MAX_ERROR_BODY {
            body.truncate(MAX_ERROR_BODY);
            break;
        }
    }
    let text = String::from_utf8_lossy(&body).into_owned();
    serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| {
            v.pointer("/error/message")
                .or_else(|| v.get("message"))
                .or_else(|| v.get("detail"))
                .and_then(|m| m.as_str().map(str::to_string))
        })
        .unwrap_or(text)
}

/// Whether a request failed because its connection closed before any
/// response headers came back. Mostly this is a kept-alive connection the
/// server closed as the request went out on it (llama.cpp's server closes
/// one after every stream without saying so). The server may have read
/// the request, but none of its output was, and a server that started on
/// it stops when the connection closes, so the request may go again: the
/// worst case is work done twice, never tokens. An engine that died is not
/// hidden: the second try fails to connect.
///
/// `hyper` must be the major version `reqwest` uses, or nothing matches
/// (the tests of `engine_http.rs` would fail).
pub(crate) fn closed_unanswered(e: &reqwest::Error) -> bool {
    if e.is_connect() || e.is_timeout() || e.status().is_some() {
        return false;
    }
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(h) = s.downcast_ref::<hyper::Error>() {
            if h.is_incomplete_message() || h.is_canceled() {
                return true;
            }
        }
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind::*;
            if matches!(io.kind(), ConnectionReset | BrokenPipe | ConnectionAborted) {
                return true;
            }
        }
        source = s.source();
    }
    false
}

impl Call {
    pub(crate) async fn serve(
        self,
        req: ValidRequest,
        tx: mpsc::UnboundedSender<EngineEvent>,
        cancel: CancellationToken,
        slot: Slot,
    ) {
        // How the request finished, once the engine said so: a cancel
        // that comes while its usage chunk is read (the gateway cancels at
        // a stop string) keeps that reason.
        let done = std::sync::Mutex::new(None);
        let out = tokio::select! {
            r = self.stream(&req, &tx, &done) => r,
            _ = cancel.cancelled() => {
                let reason = done.lock().ok().and_then(|d| *d);
                Ok((reason.unwrap_or(FinishReason::Cancelled), None))
            }
        };
        match out {
            Ok((reason, rest)) => {
                let _ = tx.send(EngineEvent::Finished { reason });
                drop(slot);
                // Then read the rest briefly, so the connection can be reused.
                if let Some(mut body) = rest {
                    let _ = tokio::time::timeout(DRAIN, async {
                        while let Some(Ok(_)) = body.next().await {}
                    })
                    .await;
                }
            }
            Err(e) => {
                let _ = tx.send(EngineEvent::Failed(e));
            }
        }
    }

    /// Runs the request, sending its tokens; answers how it finished, and
    /// the rest of the body when it finished before the body ended.
    async fn stream(
        &self,
        req: &ValidRequest,
        tx: &mpsc::UnboundedSender<EngineEvent>,
        done: &std::sync::Mutex<Option<FinishReason>>,
    ) -> Result<(FinishReason, Option<Body>), EngineError> {
        let text = match &self.detokenize {
            None => None,
            Some(d) => Some(d(req.prompt()).ok_or_else(|| {
                EngineError::Internal("the prompt's token ids do not detokenize".into())
            })?),
        };
        let (path, body) = dialect::request(self.api, &self.model, req, text.as_deref());
        let url = format!("{}{path}", self.base);
        let mut tries = 0;
        let deadline = tokio::time::Instant::now() + self.response_timeout;
        let resp = loop {
            tries += 1;
            let client = if tries == 1 {
                &self.client
            } else {
                &self.fresh
            };
            let send = client.post(&url).json(&body).send();
            match tokio::time::timeout_at(deadline, send).await {
                Err(_) => {
                    return Err(EngineError::Failed(format!(
                        "no answer from {url} within {} ms",
                        self.response_timeout.as_millis()
                    )))
                }
                Ok(Err(e)) if tries < SEND_TRIES && closed_unanswered(&e) => {
                    let n = self.retried.fetch_add(1, Ordering::Relaxed) + 1;
                    if n.is_power_of_two() {
                        tracing::info!(url = %url, error = %e, requests = n, "a connection closed before any answer; its request goes once more on a new one (this many so far)");
                    } else {
                        tracing::debug!(url = %url, error = %e, "a connection closed before any answer; trying once more on a new one");
                    }
                }
                Ok(Err(e)) => return Err(EngineError::Failed(format!("{url}: {e}"))),
                Ok(Ok(r)) => break r,
            }
        };
        let status = resp.status();
        if !status.is_success() {
            let msg = error_body(resp).await;
            let msg = format!("{status}: {msg}");
            return Err(match status.as_u16() {
                429 | 503 => EngineError::Overloaded(msg),
                // A wrong path or model name: this worker's setup, not the
                // request (another worker may be set up right).
                404 => EngineError::Failed(format!(
                    "{url} answered {msg} (are `api` and `served_model` right?)"
                )),
                400..=499 => EngineError::Rejected(msg),
                _ => EngineError::Failed(msg),
            });
        }
        // Started goes with the first chunk, which says how much of the
        // prompt the engine's prefix cache served (llama.cpp's
        // `timings_per_token`, vLLM's `continuous_usage_stats`, SGLang's
        // `meta_info`).
        let mut started = false;
        // The cached prompt tokens `Started` said, and the last count a
        // chunk gave.
        let prompt_len = req.prompt().len() as u32;
        let (mut reported, mut latest) = (0u32, None::<u32>);
        let mut usage_until = None;
        let s = req.sampling();
        let max = s.max_tokens as usize;
        let mut sent = 0usize;
        // Tokens the engine counted so far (it may count more than it sent).
        let mut counted = 0usize;
        let mut decoder = Decoder::new(self.api, self.vocab, text.is_some());
        let mut sse = SseDecoder::default();
        let mut body: Body = Box::pin(resp.bytes_stream());
        let mut finish: Option<FinishReason> = None;
        'read: loop {
            let now = tokio::time::Instant::now();
            let wait = match usage_until {
                Some(t) if now >= t => break 'read,
                Some(t) => t - now,
                None => self.idle_timeout,
            };
            let next = match tokio::time::timeout(wait, body.next()).await {
                // The request is done; its usage chunk did not come.
                Err(_) if finish.is_some() => break 'read,
                Err(_) => {
                    return Err(EngineError::Failed(format!(
                        "the engine sent nothing for {} ms",
                        self.idle_timeout.as_millis()
                    )))
                }
                Ok(n) => n,
            };
            // After the last choice, a broken stream costs only the usage
            // chunk: the request is done.
            if finish.is_some() && matches!(next, Some(Err(_))) {
                break 'read;
            }
            let events = match next {
                Some(Ok(bytes)) => match sse.push(&bytes) {
                    Ok(events) => events,
                    Err(e) if finish.is_some() => {
                        tracing::debug!(error = %e, "the stream after the last choice did not decode");
                        break 'read;
                    }
                    Err(e) => return Err(EngineError::Failed(e.to_string())),
                },
                Some(Err(e)) => {
                    return Err(EngineError::Failed(format!(
                        "the engine's stream broke: {e}"
                    )))
                }
                None => {
                    let last = sse.finish();
                    if last.is_none() {
                        break 'read;
                    }
                    last.into_iter().collect()
                }
            };
            for ev in events {
                if finish.is_some() && ev.event == "error" {
                    tracing::debug!(error = %ev.data, "the engine reported an error after the last choice");
                    break 'read;
                }
                if ev.event == "error" {
                    return Err(EngineError::Failed(format!(
                        "the engine reported: {}",
                        ev.data
                    )));
                }
                if finish.is_some() {
                    // After the last choice: only the usage matters, and
                    // a chunk that does not decode costs it, nothing else.
                    match decoder.chunk(&ev.data) {
                        Ok(c) => {
                            if let Some(n) = c.cached_tokens {
                                latest = Some(n.min(prompt_len));
                            }
                            if c.done {
                                break 'read;
                            }
                        }
                        Err(e) => {
                            tracing::debug!(error = %e, "a chunk after the last choice did not decode");
                        }
                    }
                    continue;
                }
                let c = match decoder.chunk(&ev.data) {
                    Ok(c) => c,
                    Err(ChunkError::Malformed(m)) => return Err(EngineError::Failed(m)),
                    Err(e) => return Err(EngineError::Failed(e.to_string())),
                };
                if let Some(n) = c.cached_tokens {
                    latest = Some(n.min(prompt_len));
                }
                if !started {
                    started = true;
                    reported = latest.unwrap_or(0);
                    let _ = tx.send(EngineEvent::Started {
                        cached_tokens: reported,
                    });
                }
                let mut toks = c.tokens;
                if toks.is_empty() && text.is_some() {
                    // A server that streams only text: our ids for it.
                    if let Some(t) = c.text.as_deref().filter(|t| !t.is_empty()) {
                        toks = self
                            .retokenize
                            .as_ref()
                            .and_then(|re| re(t))
                            .filter(|ids| ids.iter().all(|&i| i < self.vocab))
                            .ok_or_else(|| {
                                EngineError::Internal(format!(
                                    "the engine's text {t:?} does not encode in our vocabulary"
                                ))
                            })?;
                    }
                }
                if let Some(n) = c.generated {
                    if n > counted + toks.len() {
                        // llama.cpp streams no id for a token that ends
                        // inside a UTF-8 character; the chunk's text holds
                        // it and the token that completed the character.
                        let again = match (&self.retokenize, &c.text) {
                            (Some(re), Some(text)) => re(text).filter(|ids| {
                                !ids.is_empty() && ids.iter().all(|&t| t < self.vocab)
                            }),
                            _ => None,
                        };
                        match again {
                            Some(ids) => toks = ids,
                            None => {
                                return Err(EngineError::Internal(format!(
                                    "the engine generated {n} tokens but streamed the ids of {} (llama.cpp sends none for a token that splits a UTF-8 character)",
                                    counted + toks.len()
                                )))
                            }
                        }
                    }
                    counted = n;
                }
                let mut stop_token = None;
                if let Some(i) = toks.iter().position(|t| s.stop_token_ids.contains(t)) {
                    toks.truncate(i + 1);
                    stop_token = Some(FinishReason::Stop);
                }
                let full = sent + toks.len() >= max;
                toks.truncate(max - sent);
                if !toks.is_empty() {
                    sent += toks.len();
                    let _ = tx.send(EngineEvent::Tokens(toks));
                }
                // A stop token, else the engine's own reason (it may come on
                // the chunk of the last allowed token), else the limit.
                let engine_finished = c.finish.is_some();
                let end = stop_token
                    .or(c.finish)
                    .or(full.then_some(FinishReason::Length));
                if let Some(r) = end {
                    if let Ok(mut d) = done.lock() {
                        *d = Some(r);
                    }
                    finish = Some(r);
                    // Only a stream the engine itself ended has its usage
                    // chunk next (one we ended at a stop id goes on).
                    if self.api != Api::OpenAi || !engine_finished {
                        break 'read;
                    }
                    // Its usage chunk follows the last choice.
                    usage_until = Some(tokio::time::Instant::now() + USAGE_GRACE);
                    continue;
                }
                if c.done {
                    break 'read;
                }
            }
        }
        match finish {
            Some(r) => {
                if let Some(n) = latest.filter(|n| *n != reported) {
                    let _ = tx.send(EngineEvent::Cached { cached_tokens: n });
                }
                Ok((r, Some(body)))
            }
            None => Err(EngineError::Failed(
                "the engine's stream ended before the request finished".into(),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::closed_unanswered;

    #[tokio::test]
    async fn a_refused_connection_is_not_a_closed_one() {
        // A port nothing listens on: the engine is down, so no second try.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        drop(l);
        let e = reqwest::Client::new()
            .post(format!("http://127.0.0.1:{port}/completion"))
            .body("{}")
            .send()
            .await
            .expect_err("nothing listens");
        assert!(e.is_connect(), "{e:?}");
        assert!(!closed_unanswered(&e));
    }

    #[tokio::test]
    async fn a_connection_closed_after_reading_the_request_is() {
        use tokio::io::AsyncReadExt;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let mut server = tokio::task::JoinSet::new();
        server.spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut b = [0u8; 1024];
            let _ = s.read(&mut b).await;
            // Closed, unanswered.
        });
        let e = reqwest::Client::new()
            .post(format!("http://127.0.0.1:{port}/completion"))
            .body("{}")
            .send()
            .await
            .expect_err("closed unanswered");
        assert!(closed_unanswered(&e), "{e:?}");
        server.join_next().await.expect("the server task").unwrap();
    }
}
