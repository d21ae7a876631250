//! Security against real parts: a nats-server with TLS and the users
//! `dynamoctl nats-auth` writes, a node whose actors connect each as its
//! role, a gateway serving HTTPS, and the CLI.
//!
//! - a worker credential is refused on gateway, router and desired-state
//!   subjects and on another namespace (the server says so, and nothing it
//!   sent there arrives), while what a worker must do still goes through;
//! - the whole serving path works with every role held to its permissions;
//! - TLS handshakes work on the gateway and on NATS, and a client without
//!   the CA fails with a message that says so.

use dynamo_integration::*;
use futures::StreamExt;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// `dynamoctl nats-auth` for namespaces `it` and `other`, with TLS files
/// for 127.0.0.1.
fn make_auth(dir: &Path) -> PathBuf {
    let out = dir.join("auth");
    let o = std::process::Command::new(bin("dynamoctl"))
        .args(["nats-auth", "--out"])
        .arg(&out)
        .args([
            "--namespace",
            "it",
            "--namespace",
            "other",
            "--tls-names",
            "127.0.0.1,localhost",
        ])
        .output()
        .unwrap();
    assert_success(&o);
    out
}

/// A TLS nats-server whose users are those of `auth`.
fn secure_nats(auth: &Path) -> Nats {
    let tls = auth.join("tls");
    // (`include` paths are relative to the including file: the accounts
    // are pasted in instead.)
    let conf = format!(
        "tls {{ cert_file: {:?}, key_file: {:?}, timeout: 5 }}\n{}\n",
        tls.join("cert.pem").display().to_string(),
        tls.join("key.pem").display().to_string(),
        std::fs::read_to_string(auth.join("auth.conf")).unwrap(),
    );
    Nats::start_with_config(&conf, "tls")
}

fn seed(auth: &Path, ns: &str, role: &str) -> String {
    // The operator's seed is kept apart from the nodes'.
    let dir = if role == "admin" {
        auth.join(format!("{ns}.admin"))
    } else {
        auth.join(ns)
    };
    std::fs::read_to_string(dir.join(format!("{role}.nk")))
        .unwrap()
        .trim()
        .to_string()
}

/// A raw connection as `role` of `ns`, whose server errors (permission
/// violations) arrive on the returned channel.
async fn connect_as(
    nats: &Nats,
    auth: &Path,
    ns: &str,
    role: &str,
) -> (async_nats::Client, tokio::sync::mpsc::Receiver<String>) {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let client = async_nats::ConnectOptions::new()
        .add_root_certificates(auth.join("tls/ca.pem"))
        .require_tls(true)
        .nkey(seed(auth, ns, role))
        .custom_inbox_prefix(format!("_INBOX.{ns}.{role}"))
        .event_callback(move |ev| {
            let tx = tx.clone();
            async move {
                if let async_nats::Event::ServerError(e) = ev {
                    let _ = tx.try_send(e.to_string());
                }
            }
        })
        .connect(&nats.url)
        .await
        .unwrap_or_else(|e| panic!("connect as {role} of {ns}: {e}"));
    (client, rx)
}

/// The next server error naming `subject`, within 5 s.
async fn violation(rx: &mut tokio::sync::mpsc::Receiver<String>, subject: &str) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(e)) if e.contains(subject) => return e,
            Ok(Some(_)) => continue,
            _ => panic!("no permissions violation for {subject}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_credential_is_refused_on_forbidden_subjects_and_other_namespaces() {
    let dir = tempfile::tempdir().unwrap();
    let auth = make_auth(dir.path());
    let nats = secure_nats(&auth);
    let (admin, _) = connect_as(&nats, &auth, "it", "admin").await;
    let (worker, mut errors) = connect_as(&nats, &auth, "it", "worker").await;

    // The admin listens where a forged message would land.
    let mut watch = admin.subscribe("dynamo.>").await.unwrap();
    let mut kv_watch = admin.subscribe("$KV.>").await.unwrap();
    admin.flush().await.unwrap();

    let forbidden = [
        // A router's subjects: forged load or snapshots.
        "dynamo.it.router.load",
        "dynamo.it.router.snapshot",
        // A gateway's: requests to workers, traffic summaries.
        "dynamo.it.worker.0000000000000001.generate",
        "dynamo.it.metrics.frontend",
        // Desired state.
        "$KV.dynamo_it_deployments.web",
        "$KV.dynamo_it_assignments.n1",
        // Another namespace.
        "dynamo.other.load.0000000000000001",
        "dynamo.other.kv.0000000000000001",
        "$KV.dynamo_other_workers.1",
    ];
    for subject in forbidden {
        worker.publish(subject, "forged".into()).await.unwrap();
        worker.flush().await.unwrap();
        let e = violation(&mut errors, subject).await;
        assert!(
            e.to_lowercase()
                .contains("permissions violation for publish"),
            "{e}"
        );
    }
    // Reading a gateway's frames or another namespace is refused too.
    for subject in [
        "dynamo.it.gateway.*.frames",
        "dynamo.other.>",
        "_INBOX.it.gateway.>",
    ] {
        let _sub = worker.subscribe(subject).await.unwrap();
        worker.flush().await.unwrap();
        let e = violation(&mut errors, subject).await;
        assert!(
            e.to_lowercase()
                .contains("permissions violation for subscription"),
            "{e}"
        );
    }
    // JetStream: nothing of another namespace, and no streams or consumers
    // of its own (a consumer's deliver subject would get round every rule
    // above): the requests go nowhere.
    for subject in [
        "$JS.API.STREAM.INFO.KV_dynamo_other_workers",
        "$JS.API.STREAM.UPDATE.KV_dynamo_it_workers",
        "$JS.API.STREAM.CREATE.KV_dynamo_it_deployments",
        "$JS.API.CONSUMER.CREATE.KV_dynamo_it_workers",
        "$JS.API.DIRECT.GET.KV_dynamo_it_workers",
    ] {
        let r = tokio::time::timeout(Duration::from_secs(2), worker.request(subject, "{}".into()))
            .await;
        assert!(!matches!(r, Ok(Ok(_))), "{subject} answered: {r:?}");
        violation(&mut errors, subject).await;
    }

    // What a worker must do goes through: its load, its KV events, frames
    // to a gateway.
    for subject in [
        "dynamo.it.load.0000000000000001",
        "dynamo.it.kv.0000000000000001",
        "dynamo.it.gateway.00000000000000ab.frames",
    ] {
        worker.publish(subject, "ok".into()).await.unwrap();
    }
    worker.flush().await.unwrap();
    let mut got = Vec::new();
    while got.len() < 3 {
        let m = tokio::time::timeout(Duration::from_secs(5), watch.next())
            .await
            .expect("the allowed messages arrive")
            .unwrap();
        assert_eq!(
            &m.payload[..],
            b"ok",
            "a forged message arrived on {}",
            m.subject
        );
        got.push(m.subject.to_string());
    }
    // None of the forged ones did.
    let late = tokio::time::timeout(Duration::from_millis(300), watch.next()).await;
    assert!(late.is_err(), "a forged message arrived: {late:?}");
    let late = tokio::time::timeout(Duration::from_millis(300), kv_watch.next()).await;
    assert!(late.is_err(), "a forged KV write arrived: {late:?}");

    // A credential of namespace `other` cannot reach `it` either.
    let (other, mut other_errors) = connect_as(&nats, &auth, "other", "worker").await;
    other
        .publish("dynamo.it.load.0000000000000002", "forged".into())
        .await
        .unwrap();
    other.flush().await.unwrap();
    violation(&mut other_errors, "dynamo.it.load.0000000000000002").await;

    // No credential at all is refused at connect.
    let anonymous = async_nats::ConnectOptions::new()
        .add_root_certificates(auth.join("tls/ca.pem"))
        .connect(&nats.url)
        .await;
    let e = anonymous.expect_err("a connection without a user is refused");
    assert!(
        e.to_string().to_lowercase().contains("authorization"),
        "{e}"
    );
}

/// An HTTPS client trusting only `ca`.
fn https_client(ca: &Path) -> reqwest::Client {
    let pem = std::fs::read(ca).unwrap();
    reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(&pem).unwrap())
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_of_roles_serves_https_over_tls_nats_and_a_client_without_the_ca_is_told() {
    let dir = tempfile::tempdir().unwrap();
    let auth = make_auth(dir.path());
    let nats = secure_nats(&auth);
    let tls = auth.join("tls");
    let port = free_port();
    // Every actor connects as its role; the gateway serves HTTPS.
    let config = node_config("n1", &nats.url, Some(port), 2, "")
        .replace(
            "[nats]\n",
            &format!(
                "[nats]\nca_file = {:?}\ncredentials = {:?}\n",
                tls.join("ca.pem").display().to_string(),
                auth.join("it").display().to_string()
            ),
        )
        .replace(
            "max_body_bytes = 65536\n",
            &format!(
                "max_body_bytes = 65536\ntls_cert = {:?}\ntls_key = {:?}\n",
                tls.join("cert.pem").display().to_string(),
                tls.join("key.pem").display().to_string()
            ),
        );
    let mut node = Node::start(&config);
    let base = format!("https://127.0.0.1:{port}");
    let client = https_client(&tls.join("ca.pem"));
    let t0 = std::time::Instant::now();
    loop {
        let ready = match client.get(format!("{base}/health")).send().await {
            Ok(r) => r.json::<serde_json::Value>().await.ok(),
            Err(_) => None,
        };
        if ready.is_some_and(|v| v["workers"].as_u64() == Some(2)) {
            break;
        }
        assert!(node.alive(), "node exited:\n{}", node.log_text());
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "not ready:\n{}",
            node.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The serving path, streamed and not, with every role held to its
    // permissions (gateway → worker requests, frames back, KV events to the
    // router).
    for stream in [false, true] {
        let r = client
            .post(format!("{base}/v1/completions"))
            .json(&json!({"model": MODEL, "prompt": vec![5u32; 40], "max_tokens": 6, "stream": stream}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let text = r.text().await.unwrap();
        assert!(
            text.contains("\"finish_reason\":\"length\""),
            "stream={stream}: {text}"
        );
    }
    // The router indexed the prompt from the worker's KV events.
    let t0 = std::time::Instant::now();
    loop {
        let overlap: serde_json::Value = client
            .post(format!("{base}/v1/dynamo/overlap"))
            .json(&json!({"model": MODEL, "prompt": vec![5u32; 40]}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if overlap.to_string().contains("\"blocks\":2") {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the router did not index the prompt: {overlap}\n{}",
            node.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A client without the CA is refused, and says why.
    let plain = reqwest::Client::builder()
        .tls_built_in_root_certs(false)
        .build()
        .unwrap();
    let e = plain
        .get(format!("{base}/health"))
        .send()
        .await
        .unwrap_err();
    let chain = format!("{e:?}");
    assert!(
        chain.contains("UnknownIssuer") || chain.contains("certificate"),
        "{chain}"
    );
    // The server counts the failed handshake when its side of it ends,
    // which may be just after the client gave up: read until it shows.
    let t0 = std::time::Instant::now();
    loop {
        let metrics = client
            .get(format!("{base}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let failures: u64 = metrics
            .lines()
            .find_map(|l| l.strip_prefix("dynamo_gateway_tls_handshake_failures_total "))
            .expect("handshake failures are exported")
            .trim()
            .parse()
            .unwrap();
        if failures >= 1 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the refused handshake was not counted"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The CLI as admin, with the CA and the credentials: it reads the
    // cluster. Without the CA it fails, naming the CA setting.
    let ctl = |env: &[(&str, PathBuf)]| {
        let mut c = std::process::Command::new(bin("dynamoctl"));
        c.args(["status", "--json", "--nats", &nats.url, "--namespace", "it"])
            .env_remove("DYNAMO_NATS_CA")
            .env_remove("DYNAMO_NATS_CREDENTIALS");
        for (k, v) in env {
            c.env(k, v);
        }
        c.output().unwrap()
    };
    let ok = ctl(&[
        ("DYNAMO_NATS_CA", tls.join("ca.pem")),
        ("DYNAMO_NATS_CREDENTIALS", auth.join("it.admin")),
    ]);
    assert_success(&ok);
    let status: serde_json::Value = serde_json::from_slice(&ok.stdout).unwrap();
    assert_eq!(
        status["workers"].as_array().map(Vec::len),
        Some(2),
        "{status}"
    );
    let no_ca = ctl(&[("DYNAMO_NATS_CREDENTIALS", auth.join("it.admin"))]);
    assert!(!no_ca.status.success());
    let err = String::from_utf8_lossy(&no_ca.stderr);
    assert!(
        err.contains("certificate") && err.contains("DYNAMO_NATS_CA"),
        "{err}"
    );
    // A worker's credential is not an operator's: the CLI as a worker is
    // refused what only the admin may read.
    let as_worker = dir.path().join("worker-only");
    std::fs::create_dir(&as_worker).unwrap();
    std::fs::copy(auth.join("it/worker.nk"), as_worker.join("admin.nk")).unwrap();
    let refused = ctl(&[
        ("DYNAMO_NATS_CA", tls.join("ca.pem")),
        ("DYNAMO_NATS_CREDENTIALS", as_worker),
    ]);
    assert!(!refused.status.success(), "a worker seed read the cluster");

    // Nothing any actor did was refused by the server.
    let log = node.log_text();
    assert!(!log.contains("Permissions Violation"), "{log}");
}
