//! [`ExternalEngine`]'s edge cases over real HTTP: a server answering in
//! llama.cpp's wire format, scripted to do what a real engine does only on
//! a bad day (refuse, shed load, drop a stream mid-way, overrun
//! `max_tokens`, keep generating after the client left), which a real
//! server cannot be made to do on demand. The real llama.cpp server is
//! tested in `integration/tests/external_engine.rs` (`make test-engines`).
//!
//! Scripts by the prompt's first token: 1 finishes normally, 2 is refused
//! (400), 3 is shed (503), 4 breaks off after two tokens, 5 streams without
//! end, 6 streams a stop token id mid-chunk, 7 skips a token's id; a text
//! prompt is answered in text alone. A raw HTTP/1.1 server closes
//! kept-alive connections under requests, as llama.cpp's does after a
//! stream.

use axum::body::Body;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use dynamo_bus_schema::{ErrorKind, FinishReason, RequestId, SamplingParams};
use dynamo_engine::{Engine, EngineError, EngineEvent, EngineLimits, Readiness, ValidRequest};
use dynamo_external_engine::config::RawExternal;
use dynamo_external_engine::engine::{ExternalEngine, ExternalModel};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[derive(Default)]
struct Script {
    healthy: AtomicBool,
    /// Streams the server is still writing.
    open: AtomicUsize,
    /// The last text prompt received.
    text: std::sync::Mutex<Option<String>>,
}

struct Open(Arc<Script>);
impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

fn chunk(tokens: &[u32], stop: Option<&str>) -> String {
    let v = match stop {
        None => json!({"content": "x", "tokens": tokens, "stop": false,
                       "timings": {"cache_n": 2, "prompt_n": 1}}),
        Some(t) => json!({"content": "", "tokens": [], "stop": true, "stop_type": t,
                          "timings": {"cache_n": 3}}),
    };
    format!("data: {v}\n\n")
}

async fn health(State(s): State<Arc<Script>>) -> StatusCode {
    if s.healthy.load(Ordering::SeqCst) {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

async fn completion(State(s): State<Arc<Script>>, Json(b): Json<Value>) -> Response {
    let first = b["prompt"][0].as_u64().unwrap_or(0);
    if let Some(t) = b["prompt"].as_str() {
        *s.text.lock().unwrap() = Some(t.to_string());
    }
    let first = if b["prompt"].is_string() { 8 } else { first };
    let frames: Vec<String> = match first {
        // Text in, text out (a server that returns no ids).
        8 => ["H\u{e9}", "llo", ""]
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let v = json!({"content": t, "stop": i == 2, "stop_type": "eos"});
                format!("data: {v}\n\n")
            })
            .collect(),
        2 => {
            return (
                StatusCode::BAD_REQUEST,
                Json(json!({"error": {"code": 400, "message": "context too long"}})),
            )
                .into_response()
        }
        3 => return (StatusCode::SERVICE_UNAVAILABLE, "busy").into_response(),
        1 => (10..15)
            .map(|t| chunk(&[t], None))
            .chain([chunk(&[], Some("eos"))])
            .collect(),
        4 => vec![chunk(&[10], None), chunk(&[11], None)],
        6 => vec![chunk(&[10, 99, 12], None), chunk(&[13], None)],
        // llama.cpp's own counter says a token went by without its id.
        7 => vec![
            "data: {\"content\":\"a\",\"tokens\":[10],\"stop\":false,\"tokens_predicted\":1}\n\n".into(),
            "data: {\"content\":\"\u{e9}\",\"tokens\":[12],\"stop\":false,\"tokens_predicted\":3}\n\n".into(),
        ],
        _ => Vec::new(), // 5: endless
    };
    s.open.fetch_add(1, Ordering::SeqCst);
    let guard = Open(s.clone());
    let endless = first == 5;
    let stream = futures::stream::unfold(
        (frames.into_iter(), guard, 0u32),
        move |(mut it, g, n)| async move {
            let next = match it.next() {
                Some(f) => f,
                None if endless => {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    chunk(&[20 + n % 50], None)
                }
                None => return None,
            };
            Some((Ok::<_, std::io::Error>(next), (it, g, n + 1)))
        },
    );
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(stream))
        .unwrap()
}

/// vLLM's `/v1/completions` stream, with `continuous_usage_stats`: usage
/// on every chunk, the cached tokens only in the usage chunk after the
/// last choice (`--enable-prompt-tokens-details`). Scripts by the prompt's
/// first token: 1 ends as vLLM does (usage chunk, then `[DONE]`); 9 sends
/// its last choice and then nothing, keeping the stream open; 3 sends an
/// error event after its last choice.
async fn openai_completions(State(s): State<Arc<Script>>, Json(b): Json<Value>) -> Response {
    let first = b["prompt"][0].as_u64().unwrap_or(0);
    let usage = |n: u32| json!({"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n});
    let choice = |t: u32, n: u32, finish: Option<&str>| {
        let v = json!({"choices": [{"index": 0, "text": "x", "token_ids": [t], "finish_reason": finish}],
                       "usage": usage(n)});
        format!("data: {v}\n\n")
    };
    let mut frames = vec![choice(10, 1, None), choice(11, 2, Some("length"))];
    if first == 1 {
        let mut u = usage(2);
        u["prompt_tokens_details"] = json!({"cached_tokens": 2});
        frames.push(format!("data: {}\n\n", json!({"choices": [], "usage": u})));
        frames.push("data: [DONE]\n\n".into());
    }
    if first == 3 {
        frames.push("event: error\ndata: {\"error\": \"engine core died\"}\n\n".into());
    }
    s.open.fetch_add(1, Ordering::SeqCst);
    let guard = Open(s.clone());
    let stream = futures::stream::unfold((frames.into_iter(), guard), |(mut it, g)| async move {
        match it.next() {
            Some(f) => Some((Ok::<_, std::io::Error>(f), (it, g))),
            // Open, silent.
            None => {
                std::future::pending::<()>().await;
                None
            }
        }
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(stream))
        .unwrap()
}

/// The server, its script, and its task (aborted when the set drops).
async fn server() -> (u16, Arc<Script>, tokio::task::JoinSet<()>) {
    let s = Arc::new(Script::default());
    let app = Router::new()
        .route("/health", get(health))
        .route("/completion", post(completion))
        .route("/v1/completions", post(openai_completions))
        .with_state(s.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let mut task = tokio::task::JoinSet::new();
    task.spawn(async move {
        axum::serve(l, app).await.expect("the scripted server runs");
    });
    (port, s, task)
}

mod common;

fn engine(port: u16) -> ExternalEngine {
    engine_with(port, None, None)
}

fn engine_with(
    port: u16,
    retokenize: Option<dynamo_external_engine::engine::Retokenize>,
    kv: Option<dynamo_external_engine::config::RawKvEvents>,
) -> ExternalEngine {
    engine_full(port, retokenize, None, kv)
}

fn engine_full(
    port: u16,
    retokenize: Option<dynamo_external_engine::engine::Retokenize>,
    detokenize: Option<dynamo_external_engine::engine::Detokenize>,
    kv: Option<dynamo_external_engine::config::RawKvEvents>,
) -> ExternalEngine {
    engine_api(port, "llamacpp", 2000, retokenize, detokenize, kv)
}

fn engine_api(
    port: u16,
    api: &str,
    idle_timeout_ms: u64,
    retokenize: Option<dynamo_external_engine::engine::Retokenize>,
    detokenize: Option<dynamo_external_engine::engine::Detokenize>,
    kv: Option<dynamo_external_engine::config::RawKvEvents>,
) -> ExternalEngine {
    let cfg = RawExternal {
        url: Some(format!("http://127.0.0.1:{port}")),
        api: Some(api.into()),
        max_inflight: Some(2),
        health_interval_ms: Some(20),
        health_failures: Some(2),
        metrics_path: Some(String::new()),
        idle_timeout_ms: Some(idle_timeout_ms),
        kv_events: kv,
        prompt: detokenize.is_some().then(|| "text".into()),
        ..Default::default()
    }
    .validate()
    .unwrap();
    ExternalEngine::start(
        cfg,
        ExternalModel {
            name: "m".into(),
            vocab_size: 1000,
            block_size: 16,
            model_path: None,
            worker: "w".into(),
            retokenize,
            detokenize,
        },
    )
    .unwrap()
}

fn req(id: u128, first: u32, max_tokens: u32, stop: Vec<u32>) -> ValidRequest {
    let mut s = SamplingParams::greedy(max_tokens);
    s.stop_token_ids = stop;
    ValidRequest::from_parts(
        RequestId(id),
        vec![first, 7, 7],
        &s,
        EngineLimits {
            context_length: 100_000,
            vocab_size: 1000,
        },
    )
    .unwrap()
}

/// Every event of a request, up to its terminal one.
async fn events(e: &ExternalEngine, r: ValidRequest) -> (Vec<u32>, EngineEvent) {
    let (_, toks, end) = events_started(e, r).await;
    (toks, end)
}

/// Every event of a request, and the cached tokens its `Started` said,
/// which comes once and before any token.
async fn events_started(
    e: &ExternalEngine,
    r: ValidRequest,
) -> (Option<u32>, Vec<u32>, EngineEvent) {
    let (started, _, toks, end) = events_all(e, r).await;
    (started, toks, end)
}

/// Every event of a request: the cached tokens its `Started` said (once,
/// before any token), the later count of a `Cached` (at most once, after
/// the tokens), the tokens, and the terminal event.
async fn events_all(
    e: &ExternalEngine,
    r: ValidRequest,
) -> (Option<u32>, Option<u32>, Vec<u32>, EngineEvent) {
    let mut rx = e.generate(r).expect("admitted");
    let mut toks = Vec::new();
    let mut started = None;
    let mut late = None;
    loop {
        match tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("no event in 10 s")
            .expect("stream ended without a terminal event")
        {
            EngineEvent::Started { cached_tokens } => {
                assert!(started.is_none(), "Started twice");
                started = Some(cached_tokens);
            }
            EngineEvent::Tokens(t) => {
                assert!(started.is_some(), "tokens before Started");
                assert!(late.is_none(), "tokens after Cached");
                toks.extend(t)
            }
            EngineEvent::Cached { cached_tokens } => {
                assert!(started.is_some(), "Cached before Started");
                assert!(late.is_none(), "Cached twice");
                late = Some(cached_tokens);
            }
            end => return (started, late, toks, end),
        }
    }
}

async fn ready(e: &ExternalEngine) {
    if let Readiness::Later(f) = e.ready() {
        tokio::time::timeout(Duration::from_secs(10), f)
            .await
            .expect("ready in time")
            .expect("ready");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_ready_until_healthy_then_serves() {
    let (port, s, _server) = server().await;
    let e = engine(port);
    assert!(matches!(e.ready(), Readiness::Later(_)));
    assert!(matches!(
        e.generate(req(1, 1, 10, vec![])),
        Err(EngineError::Overloaded(_))
    ));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        matches!(e.ready(), Readiness::Later(_)),
        "ready while the server says 503"
    );
    s.healthy.store(true, Ordering::SeqCst);
    ready(&e).await;
    assert_eq!(e.kind(), "llamacpp");
    let (cached, late, toks, end) = events_all(&e, req(1, 1, 10, vec![])).await;
    assert_eq!(toks, vec![10, 11, 12, 13, 14]);
    // What the engine's prefix cache served, from its first chunk, and the
    // other count its last chunk gave.
    assert_eq!(cached, Some(2));
    assert_eq!(late, Some(3));
    assert_eq!(
        end,
        EngineEvent::Finished {
            reason: FinishReason::Stop
        }
    );
    assert!(!e.liveness().is_stopped());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_tokens_reported_after_the_last_choice_are_read_and_passed_on() {
    let (port, s, _server) = server().await;
    s.healthy.store(true, Ordering::SeqCst);
    // An idle timeout far past the grace (100 ms), so a read that waited
    // for it instead would show.
    let e = engine_api(port, "vllm", 60_000, None, None, None);
    ready(&e).await;
    // vLLM: no count with the first chunk, the count in the usage chunk.
    let (cached, late, toks, end) = events_all(&e, req(1, 1, 10, vec![])).await;
    assert_eq!(toks, vec![10, 11]);
    assert_eq!((cached, late), (Some(0), Some(2)));
    let length = EngineEvent::Finished {
        reason: FinishReason::Length,
    };
    assert_eq!(end, length);
    // A server that sends no usage chunk and leaves its stream open: the
    // request still ends, within the grace, and nothing is made up.
    let t0 = std::time::Instant::now();
    let (cached, late, toks, end) = events_all(&e, req(2, 9, 10, vec![])).await;
    assert_eq!(
        (cached, late, toks, end),
        (Some(0), None, vec![10, 11], length.clone())
    );
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
    // A stream that breaks off with an error after its last choice: the
    // request finished, and stays finished (not failed, not migrated).
    let (cached, late, toks, end) = events_all(&e, req(3, 3, 10, vec![])).await;
    assert_eq!(
        (cached, late, toks, end),
        (Some(0), None, vec![10, 11], length)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_map_onto_our_error_kinds() {
    let (port, s, _server) = server().await;
    s.healthy.store(true, Ordering::SeqCst);
    let e = engine(port);
    ready(&e).await;
    let kind = |end: EngineEvent| match end {
        EngineEvent::Failed(err) => err.to_wire().kind,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        kind(events(&e, req(2, 2, 10, vec![])).await.1),
        ErrorKind::InvalidRequest
    );
    assert_eq!(
        kind(events(&e, req(3, 3, 10, vec![])).await.1),
        ErrorKind::Overloaded
    );
    // Broken off mid-stream: the tokens so far, then a failure to migrate.
    let (toks, end) = events(&e, req(4, 4, 10, vec![])).await;
    assert_eq!(toks, vec![10, 11]);
    assert_eq!(kind(end), ErrorKind::EngineFailed);
    // Token ids missing from the stream: an error, never wrong output.
    let (toks, end) = events(&e, req(5, 7, 10, vec![])).await;
    assert_eq!(toks, vec![10]);
    assert_eq!(kind(end), ErrorKind::Internal);
    // With our tokenizer, the chunk's text is encoded again instead.
    let e = engine_with(
        port,
        Some(Arc::new(|t: &str| (t == "é").then(|| vec![500, 501]))),
        None,
    );
    ready(&e).await;
    let (toks, end) = events(&e, req(6, 7, 10, vec![])).await;
    assert_eq!(toks, vec![10, 500, 501]);
    assert_eq!(
        kind(end),
        ErrorKind::EngineFailed,
        "then the stream breaks off"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_stops_and_cancellation_close_the_stream() {
    let (port, s, _server) = server().await;
    s.healthy.store(true, Ordering::SeqCst);
    let e = engine(port);
    ready(&e).await;
    // More than max_tokens offered: exactly max_tokens kept.
    let (toks, end) = events(&e, req(5, 5, 7, vec![])).await;
    assert_eq!(toks.len(), 7);
    assert_eq!(
        end,
        EngineEvent::Finished {
            reason: FinishReason::Length
        }
    );
    // A stop token id the server was not told about ends it, kept.
    let (toks, end) = events(&e, req(6, 6, 50, vec![99])).await;
    assert_eq!(toks, vec![10, 99]);
    assert_eq!(
        end,
        EngineEvent::Finished {
            reason: FinishReason::Stop
        }
    );
    // Cancel: one terminal event, and the server sees its stream closed.
    let mut rx = e.generate(req(7, 5, 10_000, vec![])).unwrap();
    let mut got = 0;
    while got < 3 {
        match rx.recv().await {
            Some(EngineEvent::Tokens(t)) => got += t.len(),
            Some(EngineEvent::Started { .. }) => {}
            other => panic!("the stream ended early: {other:?}"),
        }
    }
    e.cancel(RequestId(7));
    let mut terminal = Vec::new();
    while let Some(ev) = rx.recv().await {
        if !matches!(ev, EngineEvent::Tokens(_)) {
            terminal.push(ev);
        }
    }
    assert_eq!(
        terminal,
        vec![EngineEvent::Finished {
            reason: FinishReason::Cancelled
        }]
    );
    for _ in 0..100 {
        if s.open.load(Ordering::SeqCst) == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(s.open.load(Ordering::SeqCst), 0, "the server still streams");
    // Admission: two at once, the third is refused at once.
    let _a = e.generate(req(8, 5, 10_000, vec![])).unwrap();
    let _b = e.generate(req(9, 5, 10_000, vec![])).unwrap();
    assert!(matches!(
        e.generate(req(10, 5, 10, vec![])),
        Err(EngineError::Overloaded(_))
    ));
    assert_eq!(e.load().inflight_requests, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_goes_away_ends_the_engine() {
    let (port, s, _server) = server().await;
    s.healthy.store(true, Ordering::SeqCst);
    let e = engine(port);
    ready(&e).await;
    s.healthy.store(false, Ordering::SeqCst);
    tokio::time::timeout(Duration::from_secs(10), e.liveness().stopped())
        .await
        .expect("the engine noticed its server is gone");
    assert!(matches!(
        e.generate(req(1, 1, 10, vec![])),
        Err(EngineError::Stopped)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_kv_events_it_is_ready_once_its_publisher_is_connected() {
    let (port, s, _server) = server().await;
    s.healthy.store(true, Ordering::SeqCst);
    // Healthy, but nothing publishes where it is told to listen.
    let nobody = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    // The tests' publisher config, as a worker config's `kv_events`.
    let kv = |pub_port: u16, replay: u16| {
        let z = common::config(pub_port, replay);
        dynamo_external_engine::config::RawKvEvents {
            endpoint: z.endpoint,
            replay_endpoint: z.replay_endpoint,
            topic: Some(z.topic),
            ..Default::default()
        }
    };
    let lonely = engine_with(port, None, Some(kv(nobody, nobody)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        matches!(lonely.ready(), Readiness::Later(_)),
        "ready without its KV event publisher"
    );
    drop(lonely);
    // The real libzmq publisher: ready, and its events come out translated.
    let (mut child, pub_port, replay_port) = common::publisher();
    let e = engine_with(port, None, Some(kv(pub_port, replay_port)));
    let mut events = e
        .take_kv_events()
        .expect("an engine with kv_events emits them");
    ready(&e).await;
    let first = tokio::time::timeout(Duration::from_secs(30), events.recv())
        .await
        .expect("an event within 30 s")
        .expect("the feed runs");
    assert_eq!(first.event_id, 1);
    assert!(
        matches!(first.data, dynamo_engine::KvCacheEventData::Stored { .. }),
        "{first:?}"
    );
    let snap = tokio::time::timeout(Duration::from_secs(5), e.kv_snapshot().unwrap())
        .await
        .expect("a snapshot in time")
        .expect("answered");
    assert!(snap.last_event_id >= 1);
    drop(child.stdin.take());
    let _ = child.wait();
}

/// `prompt = "text"`: the prompt goes as our text (special tokens written
/// out), and a server that answers only in text has its text encoded with
/// our tokenizer (here one id per character).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_text_prompt_goes_as_text_and_text_output_comes_back_as_our_ids() {
    let (port, s, _server) = server().await;
    s.healthy.store(true, Ordering::SeqCst);
    let re: dynamo_external_engine::engine::Retokenize =
        Arc::new(|t: &str| Some(t.chars().map(|c| c as u32).collect()));
    let de: dynamo_external_engine::engine::Detokenize = Arc::new(|ids: &[u32]| {
        ids.iter()
            .map(|&i| char::from_u32(i + 64))
            .collect::<Option<String>>()
    });
    let e = engine_full(port, Some(re), Some(de), None);
    ready(&e).await;
    let (toks, end) = events(&e, req(1, 1, 10, vec![])).await;
    assert_eq!(s.text.lock().unwrap().as_deref(), Some("AGG"));
    let text: String = toks.iter().map(|&t| char::from_u32(t).unwrap()).collect();
    assert_eq!(text, "H\u{e9}llo");
    assert_eq!(
        end,
        EngineEvent::Finished {
            reason: FinishReason::Stop
        }
    );
    // Without our tokenizer, text is refused at start, not mid-request.
    let cfg = RawExternal {
        url: Some(format!("http://127.0.0.1:{port}")),
        api: Some("llamacpp".into()),
        prompt: Some("text".into()),
        ..Default::default()
    }
    .validate()
    .unwrap();
    let model = ExternalModel {
        name: "m".into(),
        vocab_size: 1000,
        block_size: 16,
        model_path: None,
        worker: "w".into(),
        retokenize: None,
        detokenize: None,
    };
    let err = ExternalEngine::start(cfg, model).err().expect("refused");
    assert!(err.to_string().contains("tokenizer"), "{err}");
}

/// A raw HTTP/1.1 server that does what llama.cpp's does after a stream:
/// it keeps the connection open (and says `Keep-Alive`), then closes it,
/// unanswered, when the next request comes on it. With `always`, it closes
/// every request unanswered. Counts the requests it closed.
async fn closing_server(always: bool) -> (u16, Arc<AtomicUsize>, tokio::task::JoinSet<()>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let closed = Arc::new(AtomicUsize::new(0));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let mut task = tokio::task::JoinSet::new();
    let count = closed.clone();
    task.spawn(async move {
        let mut conns = tokio::task::JoinSet::new();
        while let Ok((mut sock, _)) = l.accept().await {
            let count = count.clone();
            conns.spawn(async move {
                let mut streamed = false;
                let mut buf = Vec::new();
                loop {
                    // One request: its head, then a body of Content-Length.
                    let head_end = loop {
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                        let mut b = [0u8; 4096];
                        match sock.read(&mut b).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&b[..n]),
                        }
                    };
                    let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0);
                    while buf.len() < head_end + len {
                        let mut b = [0u8; 4096];
                        match sock.read(&mut b).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&b[..n]),
                        }
                    }
                    buf.drain(..head_end + len);
                    if head.starts_with("get /health") {
                        let ok = "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                        if sock.write_all(ok.as_bytes()).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    if always || streamed {
                        count.fetch_add(1, Ordering::SeqCst);
                        return; // closed, unanswered
                    }
                    let mut out = String::from(
                        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                         transfer-encoding: chunked\r\nkeep-alive: timeout=5, max=100\r\n\r\n",
                    );
                    let frames = (10..15)
                        .map(|t| chunk(&[t], None))
                        .chain([chunk(&[], Some("eos"))]);
                    for f in frames {
                        out.push_str(&format!("{:x}\r\n{f}\r\n", f.len()));
                    }
                    out.push_str("0\r\n\r\n");
                    if sock.write_all(out.as_bytes()).await.is_err() {
                        return;
                    }
                    streamed = true;
                }
            });
        }
    });
    (port, closed, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_lost_to_a_closing_kept_alive_connection_goes_again_on_a_new_one() {
    let (port, closed, _server) = closing_server(false).await;
    let e = engine(port);
    ready(&e).await;
    for id in 1..=4 {
        // Time for the finished stream's connection to go back to the pool.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let (toks, end) = events(&e, req(id, 1, 10, vec![])).await;
        assert_eq!(toks, vec![10, 11, 12, 13, 14], "request {id}");
        assert!(
            matches!(
                end,
                EngineEvent::Finished {
                    reason: FinishReason::Stop
                }
            ),
            "request {id} ended {end:?}"
        );
    }
    // The server did close kept-alive connections under requests, and each
    // of those requests was answered on a new connection.
    assert!(
        closed.load(Ordering::SeqCst) >= 1,
        "no connection was closed under a request"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_never_answers_is_tried_twice_and_the_request_fails() {
    let (port, closed, _server) = closing_server(true).await;
    let e = engine(port);
    ready(&e).await;
    let (toks, end) = events(&e, req(1, 1, 10, vec![])).await;
    assert!(toks.is_empty());
    match end {
        EngineEvent::Failed(err) => assert_eq!(err.to_wire().kind, ErrorKind::EngineFailed),
        other => panic!("expected a failure, got {other:?}"),
    }
    assert_eq!(closed.load(Ordering::SeqCst), 2, "one request, two tries");
}
