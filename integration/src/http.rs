//! The HTTP side of the harness: a client of one gateway ([`Http`]), its
//! replies, SSE bodies, streamed completions and OpenAI error checks.

use super::*;

pub struct Http {
    pub base: String,
    pub client: reqwest::Client,
}

pub struct Reply {
    pub status: u16,
    pub json: Value,
    pub worker: Option<String>,
    /// The `Retry-After` header, if any.
    pub retry_after: Option<String>,
}

/// A response header as text.
fn header(r: &reqwest::Response, name: &str) -> Option<String> {
    r.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

impl Http {
    /// A two-token completion succeeds (the service is up and serving).
    pub async fn assert_serves(&self) {
        let r = self
            .post(
                "/v1/completions",
                &serde_json::json!({"model": MODEL, "prompt": [5, 6], "max_tokens": 2}),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.json);
    }

    pub fn new(port: u16) -> Self {
        Http {
            base: format!("http://127.0.0.1:{port}"),
            client: reqwest::Client::new(),
        }
    }

    /// Polls `/health` until `workers` workers are registered.
    pub async fn wait_ready(&self, workers: u64, node: &mut Node) {
        let t0 = Instant::now();
        loop {
            if let Ok(r) = self
                .client
                .get(format!("{}/health", self.base))
                .send()
                .await
            {
                if let Ok(v) = r.json::<Value>().await {
                    if v["workers"].as_u64().unwrap_or(0) >= workers {
                        return;
                    }
                }
            }
            assert!(
                node.alive(),
                "node exited during start-up:\n{}",
                node.log_text()
            );
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "cluster not ready:\n{}",
                node.log_text()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn post_raw(&self, path: &str, body: impl Into<reqwest::Body>) -> Reply {
        let r = self
            .client
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .expect("HTTP request");
        let status = r.status().as_u16();
        let worker = header(&r, "x-dynamo-worker");
        let retry_after = header(&r, "retry-after");
        let text = r.text().await.unwrap_or_default();
        let json = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Reply {
            status,
            json,
            worker,
            retry_after,
        }
    }

    /// The whole `/metrics` text (empty if the gateway does not answer).
    pub async fn metrics_text(&self) -> String {
        match self
            .client
            .get(format!("{}/metrics", self.base))
            .send()
            .await
        {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        }
    }

    /// The value of the first `/metrics` line starting with `line_prefix` (0 if absent).
    pub async fn metric(&self, line_prefix: &str) -> u64 {
        let text = self.metrics_text().await;
        text.lines()
            .find(|l| l.starts_with(line_prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }

    pub async fn post(&self, path: &str, body: &Value) -> Reply {
        self.post_raw(path, body.to_string()).await
    }

    /// `/v1/dynamo/overlap`: what each worker holds of `prompt`, by worker id.
    pub async fn overlap(&self, prompt: &[u32]) -> Value {
        self.post(
            "/v1/dynamo/overlap",
            &serde_json::json!({"model": MODEL, "prompt": prompt}),
        )
        .await
        .json["workers"]
            .clone()
    }

    /// A streaming request: the `data:` payloads in order (the last is `[DONE]` when complete).
    pub async fn stream(&self, path: &str, body: &Value) -> (u16, Vec<String>) {
        let r = self.open(path, body).await;
        let status = r.status().as_u16();
        let text = r.text().await.unwrap_or_default();
        (status, sse_data(&text))
    }

    /// Sends a POST and returns the response unread (to read a stream chunk by chunk).
    pub async fn open(&self, path: &str, body: &Value) -> reqwest::Response {
        self.client
            .post(format!("{}{path}", self.base))
            .json(body)
            .send()
            .await
            .expect("HTTP request")
    }
}

/// The `data:` payloads of an SSE body, in order.
pub fn sse_data(raw: &str) -> Vec<String> {
    raw.split("\n\n")
        .filter_map(|ev| {
            ev.lines()
                .find_map(|l| l.strip_prefix("data: "))
                .map(str::to_string)
        })
        .collect()
}

/// Asserts an OpenAI error object with the given status and type.
pub fn assert_error(r: &Reply, status: u16, kind: &str) {
    assert_eq!(r.status, status, "body: {}", r.json);
    let e = &r.json["error"];
    assert!(e.is_object(), "not an OpenAI error object: {}", r.json);
    assert_eq!(e["type"], kind, "body: {}", r.json);
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()));
    for k in ["param", "code"] {
        assert!(e.get(k).is_some(), "error object lacks {k}: {}", r.json);
    }
}

/// One streamed completion: the text, the finish reason, whether `[DONE]`
/// arrived, and the first error object if any.
#[derive(Debug)]
pub struct Streamed {
    pub text: String,
    pub finish: Option<String>,
    pub done: bool,
    pub error: Option<Value>,
    /// The `x-dynamo-worker` header: the worker that started serving it.
    pub worker: Option<String>,
}

/// Streams a completion; bumps `flowing` once its first token arrives.
pub async fn stream_completion(
    port: u16,
    prompt: Vec<u32>,
    max_tokens: u32,
    flowing: std::sync::Arc<std::sync::atomic::AtomicUsize>,
) -> Streamed {
    let http = Http::new(port);
    let body = serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                      "stream": true, "ignore_eos": true});
    let mut r = http.open("/v1/completions", &body).await;
    let status = r.status().as_u16();
    let worker = header(&r, "x-dynamo-worker");
    let mut raw = String::new();
    let mut counted = false;
    while let Ok(Some(chunk)) = r.chunk().await {
        raw.push_str(&String::from_utf8_lossy(&chunk));
        if !counted && raw.contains("\"text\"") {
            counted = true;
            flowing.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
    let events = sse_data(&raw);
    let mut out = Streamed {
        text: String::new(),
        finish: None,
        done: false,
        error: None,
        worker,
    };
    if status != 200 {
        out.error = Some(serde_json::json!({"status": status, "events": events}));
        return out;
    }
    for e in events {
        if e == "[DONE]" {
            out.done = true;
            continue;
        }
        let v: Value = serde_json::from_str(&e).unwrap_or(Value::String(e));
        if !v["error"].is_null() {
            out.error.get_or_insert(v["error"].clone());
            continue;
        }
        if let Some(t) = v["choices"][0]["text"].as_str() {
            out.text.push_str(t);
        }
        if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
            out.finish = Some(f.to_string());
        }
    }
    out
}

/// Concurrent greedy streams (`ignore_eos`, `max_tokens` each), started
/// and under way: every one has its first token when this returns.
pub struct Streams {
    prompts: Vec<Vec<u32>>,
    max_tokens: u32,
    /// Each stream with its index; dropping them ends them.
    tasks: tokio::task::JoinSet<(usize, Streamed)>,
}

impl Streams {
    pub async fn start(port: u16, prompts: Vec<Vec<u32>>, max_tokens: u32) -> Streams {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let flowing = std::sync::Arc::new(AtomicUsize::new(0));
        let mut tasks = tokio::task::JoinSet::new();
        for (i, p) in prompts.iter().enumerate() {
            let s = stream_completion(port, p.clone(), max_tokens, flowing.clone());
            tasks.spawn(async move { (i, s.await) });
        }
        let t0 = Instant::now();
        while flowing.load(Ordering::SeqCst) < prompts.len() {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "streams never started"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Streams {
            prompts,
            max_tokens,
            tasks,
        }
    }

    /// Waits for every stream: each must end with `[DONE]`, finish by
    /// length, and carry exactly the mocker's text for its prompt (what an
    /// undisturbed run produces).
    pub async fn expect_undisturbed(mut self) {
        let mut ended = Vec::new();
        while let Some(r) = self.tasks.join_next().await {
            ended.push(r.expect("stream task"));
        }
        ended.sort_by_key(|(i, _)| *i);
        assert_eq!(ended.len(), self.prompts.len());
        for ((i, s), p) in ended.into_iter().zip(&self.prompts) {
            let (_, want) = expected_text(p, self.max_tokens as usize);
            assert!(s.error.is_none(), "stream {i} failed: {:?}", s.error);
            assert!(s.done, "stream {i} did not end with [DONE]");
            assert_eq!(s.finish.as_deref(), Some("length"), "stream {i}");
            assert_eq!(
                s.text, want,
                "stream {i}: text differs from an undisturbed run"
            );
        }
    }
}

/// The worker a gateway's router counts most requests on, and how many.
pub async fn busiest_worker(http: &Http) -> (String, u64) {
    let metrics = http.metrics_text().await;
    metrics
        .lines()
        .filter_map(|l| l.strip_prefix("dynamo_router_worker_inflight{worker=\""))
        .filter_map(|l| l.split_once("\"} "))
        .filter_map(|(w, n)| Some((n.parse::<u64>().ok()?, w.to_string())))
        .max()
        .map(|(n, w)| (w, n))
        .unwrap_or_else(|| panic!("the router counts no request:\n{metrics}"))
}
