//! The live cluster page (`/dashboard`) in a real browser: Debian's
//! headless Chromium loads it from a running node (gateway, router, two
//! mocker workers, real NATS) and the DOM it renders shows the cluster,
//! its KV hit rate and a migration that happened; a screenshot is taken
//! (`DYNAMO_SCREENSHOT` names where to keep it).

use dynamo_integration::*;
use serde_json::json;
use std::process::Command;

fn chromium() -> String {
    for c in ["chromium", "chromium-browser", "google-chrome"] {
        if Command::new(c)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
        {
            return c.to_string();
        }
    }
    panic!("no headless Chromium found: `make deps` installs Debian's chromium");
}

fn headless(browser: &str, extra: &[&str], url: &str) -> std::process::Output {
    let profile = tempfile::tempdir().expect("profile dir");
    let mut args = vec![
        "--headless".to_string(),
        "--no-sandbox".to_string(),
        "--disable-gpu".to_string(),
        "--disable-dev-shm-usage".to_string(),
        "--hide-scrollbars".to_string(),
        format!("--user-data-dir={}", profile.path().display()),
        "--virtual-time-budget=8000".to_string(),
        "--window-size=1280,900".to_string(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    args.push(url.to_string());
    Command::new(browser)
        .args(&args)
        .output()
        .expect("chromium runs")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_page_shows_nodes_workers_load_and_hit_rate_in_chromium() {
    let browser = chromium();
    let nats = Nats::start();
    let port = free_port();
    // Real-time mockers (streams last long enough to be interrupted) and
    // fault injection (to make a migration happen).
    let faults = "[supervision]\nrestart_base_ms = 50\nfault_injection = true\n";
    let mut node = Node::start(
        &node_config("n1", &nats.url, Some(port), 2, faults)
            .replace("speedup = 0.0", "speedup = 1.0"),
    );
    let http = Http::new(port);
    http.wait_ready(2, &mut node).await;
    // Traffic with a repeated prompt: some of it is served from cache.
    let prompt: Vec<u32> = (1000..1200).collect();
    for _ in 0..4 {
        let r = http
            .post(
                "/v1/completions",
                &json!({"model": MODEL, "prompt": prompt, "max_tokens": 4}),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.json);
    }
    // A worker's engine dies under streams: they migrate, and the page
    // lists the migration.
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|i| (0..40).map(|k| 3000 + (i * 131 + k * 7) as u32).collect())
        .collect();
    let streams = Streams::start(port, prompts, 100).await;
    let (busiest, _) = busiest_worker(&http).await;
    let victim = registrations(&nats.url)
        .await
        .into_iter()
        .find(|r| r.worker_id.to_string() == busiest)
        .expect("registered");
    let ack = inject(
        &nats.url,
        "n1",
        &dynamo_bus_schema::FaultInjection {
            worker_id: victim.worker_id,
            fault: dynamo_bus_schema::FaultKind::PanicEngine,
        },
    )
    .await;
    assert!(ack.applied, "{}", ack.message);
    streams.expect_undisturbed().await;
    http.wait_ready(2, &mut node).await;

    // The JSON behind the page.
    let c: serde_json::Value = reqwest::get(format!("http://127.0.0.1:{port}/v1/dynamo/cluster"))
        .await
        .expect("cluster view")
        .json()
        .await
        .expect("JSON");
    let workers = c["workers"].as_array().expect("workers");
    assert_eq!(workers.len(), 2, "{c}");
    assert_eq!(c["nodes"][0]["node"], "n1", "{c}");
    assert_eq!(c["nodes"][0]["workers"], 2, "{c}");
    assert!(c["prompt_tokens"].as_u64() >= Some(800), "{c}");
    let hit = c["kv_hit_rate"].as_f64().expect("a hit rate");
    let cached = c["cached_tokens"].as_f64().unwrap();
    assert!(cached > 0.0 && hit <= 1.0, "{c}");
    assert_eq!(hit, cached / c["prompt_tokens"].as_f64().unwrap(), "{c}");
    assert!(
        workers
            .iter()
            .all(|w| w["kv_total_blocks"].as_u64() > Some(0)),
        "{c}"
    );
    let migration = c["events"]
        .as_array()
        .expect("events")
        .iter()
        .find(|e| e["kind"] == "migration")
        .unwrap_or_else(|| panic!("no migration event: {c}"));
    let migration_text = migration["message"].as_str().expect("message").to_string();

    // The page in Chromium: the DOM it renders after its first poll.
    let url = format!("http://127.0.0.1:{port}/dashboard");
    let out = headless(&browser, &["--dump-dom"], &url);
    let dom = String::from_utf8_lossy(&out.stdout);
    assert!(
        dom.contains("data-loaded=\"true\""),
        "the page did not load the cluster view: {}\n{dom}",
        String::from_utf8_lossy(&out.stderr)
    );
    for w in workers {
        let id = w["worker_id"].as_str().unwrap();
        assert!(dom.contains(id), "worker {id} not on the page:\n{dom}");
    }
    assert!(dom.contains("<td>n1</td>"), "{dom}");
    let shown = format!("{:.1}%", 100.0 * hit);
    assert!(dom.contains(&shown), "hit rate {shown} not shown:\n{dom}");
    assert!(
        dom.contains("<td>migration</td>") && dom.contains(&html_escaped(&migration_text)),
        "the migration ({migration_text}) is not listed:\n{dom}"
    );

    // A screenshot of the running cluster.
    let dir = tempfile::tempdir().expect("dir");
    let shot = std::env::var("DYNAMO_SCREENSHOT")
        .unwrap_or_else(|_| dir.path().join("dashboard.png").display().to_string());
    let out = headless(&browser, &[&format!("--screenshot={shot}")], &url);
    let png = std::fs::read(&shot).unwrap_or_else(|e| {
        panic!(
            "no screenshot at {shot} ({e}): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "{} bytes",
        png.len()
    );
}

/// `text` as the page's DOM shows it (text content escaped).
fn html_escaped(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
