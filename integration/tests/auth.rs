//! Gateway API keys over real HTTP: 401 without a valid key, 403 for a
//! model the key may not use, 429 with `Retry-After` past a key's request
//! or token rate, metrics per key name; and a gateway on an address other
//! hosts can reach refuses to start open unless told to.

use dynamo_integration::*;
use serde_json::{json, Value};
use std::time::Duration;

/// A key-file entry for `key`.
fn entry(name: &str, key: &str, extra: &str) -> String {
    format!(
        "[[keys]]\nname = \"{name}\"\nsha256 = \"{}\"\n{extra}\n",
        hex::encode(dynamo_gateway::auth::hash_key(key))
    )
}

async fn post_with(
    h: &Http,
    key: Option<&str>,
    path: &str,
    body: &Value,
) -> (u16, Value, Option<String>) {
    let mut r = h.client.post(format!("{}{path}", h.base)).json(body);
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    let r = r.send().await.expect("HTTP");
    let status = r.status().as_u16();
    let retry = r
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(String::from);
    (status, r.json().await.unwrap_or(Value::Null), retry)
}

fn code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_required_limited_per_model_and_rate_limited() {
    let nats = Nats::start();
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.toml");
    std::fs::write(
        &keys,
        entry("alpha", "sk-alpha", "requests_per_minute = 3")
            + &entry("beta", "sk-beta", "models = [\"some-other-model\"]")
            + &entry("gamma", "sk-gamma", "tokens_per_minute = 100"),
    )
    .unwrap();
    let port = free_port();
    let cfg = node_config("n", &nats.url, Some(port), 1, "").replace(
        "shutdown_grace_ms = 10000\n",
        &format!(
            "shutdown_grace_ms = 10000\napi_keys_file = \"{}\"\n",
            keys.display()
        ),
    );
    let mut node = Node::start(&cfg);
    let h = Http::new(port);
    h.wait_ready(1, &mut node).await; // /health stays open
    let body = json!({"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 2});

    let (s, v, _) = post_with(&h, None, "/v1/completions", &body).await;
    assert_eq!((s, code(&v)), (401, "invalid_api_key"), "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    let (s, _, _) = post_with(&h, Some("sk-wrong"), "/v1/completions", &body).await;
    assert_eq!(s, 401);
    let r = h
        .client
        .get(format!("{}/v1/models", h.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);

    // alpha: three requests a minute, then 429 with Retry-After.
    for _ in 0..3 {
        let (s, v, _) = post_with(&h, Some("sk-alpha"), "/v1/completions", &body).await;
        assert_eq!(s, 200, "{v}");
    }
    let (s, v, retry) = post_with(&h, Some("sk-alpha"), "/v1/completions", &body).await;
    assert_eq!((s, code(&v)), (429, "rate_limit_requests"), "{v}");
    let retry: u64 = retry.expect("Retry-After").parse().unwrap();
    assert!((1..=20).contains(&retry), "{retry}");

    // beta may use another model only: refused here, and /v1/models shows it nothing.
    let (s, v, _) = post_with(&h, Some("sk-beta"), "/v1/completions", &body).await;
    assert_eq!((s, code(&v)), (403, "model_not_allowed"), "{v}");
    let listed: Value = h
        .client
        .get(format!("{}/v1/models", h.base))
        .bearer_auth("sk-beta")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        listed["data"].as_array().map(|a| a.len()),
        Some(0),
        "{listed}"
    );

    // gamma: 100 tokens a minute; a 4 + 200 token request goes into debt.
    let big = json!({"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 200});
    let (s, v, _) = post_with(&h, Some("sk-gamma"), "/v1/completions", &big).await;
    assert_eq!(s, 200, "{v}");
    let (s, v, retry) = post_with(&h, Some("sk-gamma"), "/v1/completions", &body).await;
    assert_eq!((s, code(&v)), (429, "rate_limit_tokens"), "{v}");
    assert!(retry.is_some());

    // Metrics name keys, models and workers: with keys on, they need one.
    let refused = h
        .client
        .get(format!("{}/metrics", h.base))
        .send()
        .await
        .expect("HTTP");
    assert_eq!(refused.status().as_u16(), 401);
    // Metrics per key name and hashed id, never the key.
    let m = h
        .client
        .get(format!("{}/metrics", h.base))
        .bearer_auth("sk-alpha")
        .send()
        .await
        .expect("HTTP")
        .text()
        .await
        .expect("text");
    let id = |k: &str| hex::encode(&dynamo_gateway::auth::hash_key(k)[..6]);
    let (alpha, gamma) = (id("sk-alpha"), id("sk-gamma"));
    assert!(
        m.contains(&format!(
            "dynamo_gateway_key_requests_total{{key=\"alpha\",key_id=\"{alpha}\",status=\"200\"}} 3"
        )),
        "{m}"
    );
    assert!(m.contains(&format!(
        "dynamo_gateway_key_requests_total{{key=\"alpha\",key_id=\"{alpha}\",status=\"429\"}} 1"
    )));
    assert!(
        m.contains("dynamo_gateway_key_requests_total{key=\"-\",key_id=\"-\",status=\"401\"} 2")
    );
    assert!(m.contains(&format!(
        "dynamo_gateway_key_tokens_total{{key=\"gamma\",key_id=\"{gamma}\"}} 204"
    )));
    assert!(!m.contains("sk-"));
    assert!(node.alive());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_gateway_off_loopback_needs_an_explicit_flag() {
    let nats = Nats::start();
    let port = free_port();
    let open = node_config("n", &nats.url, Some(port), 0, "")
        .replace("listen = \"127.0.0.1:", "listen = \"0.0.0.0:");
    let mut node = Node::start(&open);
    let code = node.wait(Duration::from_secs(20));
    assert!(code.is_some_and(|c| c != 0), "started open on 0.0.0.0");
    let log = node.log_text();
    assert!(
        log.contains("gateway.listen") && log.contains("allow_unauthenticated"),
        "{log}"
    );
    // Told so, it serves.
    let allowed = open.replace(
        "shutdown_grace_ms = 10000\n",
        "shutdown_grace_ms = 10000\nallow_unauthenticated = true\n",
    );
    let mut node = Node::start(&allowed);
    let h = Http::new(port);
    h.wait_ready(0, &mut node).await;
    assert!(node.alive());
}
