//! `dynamoctl configure` end to end, with real processes: bad input exits
//! non-zero with a message naming the problem, and the deployment it emits
//! (mocker workers timed by the configurator's model) starts on real nodes
//! over a real NATS and serves requests. And `dynamoctl calibrate-mocker`
//! recovers an engine's timing from what it measures over HTTP.

use dynamo_integration::{
    assert_success, bin, dynamoctl, free_port, node_config, registrations, Http, Nats, Node, MODEL,
};
use serde_json::{json, Value};
use std::process::Command;

fn configure(args: &[&str]) -> std::process::Output {
    Command::new(bin("dynamoctl"))
        .arg("configure")
        .args(args)
        .output()
        .expect("run dynamoctl")
}

#[test]
fn bad_input_exits_non_zero_with_a_message() {
    let base = ["--isl", "2000", "--osl", "200"];
    // (model, gpu, gpus, ttft ms, itl ms) and what stderr must say.
    for (spec, want) in [
        (
            ["Llama-9", "H200", "8", "1000", "50"],
            "unknown model \"Llama-9\" (known: Llama-3.1-8B",
        ),
        (
            ["Llama-3.1-8B", "H900", "8", "1000", "50"],
            "unknown GPU \"H900\"",
        ),
        (
            ["Llama-3.1-70B", "H100", "8", "1", "0.5"],
            "no deployment of Llama-3.1-70B on 8 × H100 meets",
        ),
        (
            ["DeepSeek-V3", "H100", "4", "1000", "50"],
            "4 × H100 cannot hold DeepSeek-V3",
        ),
        (
            ["Llama-3.1-8B", "H100", "0", "1000", "50"],
            "gpus must be positive",
        ),
    ] {
        let flags = ["--model", "--gpu", "--gpus", "--ttft-ms", "--itl-ms"];
        let mut args: Vec<&str> = flags.iter().zip(spec).flat_map(|(f, v)| [*f, v]).collect();
        args.extend(base);
        let out = configure(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
    // Options of the engine profiles and the online mode.
    let common = [
        "--model",
        "Llama-3.1-8B",
        "--gpu",
        "H100",
        "--gpus",
        "2",
        "--isl",
        "1000",
        "--osl",
        "200",
        "--ttft-ms",
        "1000",
        "--itl-ms",
        "50",
    ];
    for (extra, want) in [
        (
            vec!["--engine", "tgi"],
            "unknown engine profile \"tgi\" (known: current",
        ),
        (vec!["--rate", "0"], "rate or concurrency must be positive"),
        (vec!["--rate", "1000000"], "saturates every deployment"),
        (
            vec!["--rate", "1", "--concurrency", "4"],
            "cannot be used with",
        ),
        (vec!["--dtype", "int3"], "unknown --dtype \"int3\""),
    ] {
        let mut args = common.to_vec();
        args.extend(extra.iter().copied());
        let out = configure(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_ne!(out.status.code(), Some(0), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

#[test]
fn an_online_query_with_an_engine_profile_explains_its_choice() {
    let out = configure(&[
        "--model",
        "Llama-3.1-70B",
        "--gpu",
        "H200",
        "--gpus",
        "8",
        "--isl",
        "2000",
        "--osl",
        "300",
        "--ttft-ms",
        "2000",
        "--itl-ms",
        "60",
        "--engine",
        "trtllm-1.0",
        "--rate",
        "3",
        "--explain",
        "--json",
    ]);
    assert_success(&out);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["query"]["engine"], "trtllm-1.0");
    assert_eq!(v["query"]["load"]["rate"], 3.0);
    // At a fixed rate every deployment serves the same tokens/s.
    for d in v["best_per_budget"].as_array().unwrap() {
        let c = &d["deployment"];
        let tokens = c["tokens_per_s_per_gpu"].as_f64().unwrap() * c["gpus"].as_f64().unwrap();
        assert!((tokens - 900.0).abs() < 1.0, "{c}");
    }
    let steps = v["explain"].as_array().unwrap();
    assert_eq!(steps.len(), 2, "{v}");
    for s in steps {
        let parts: f64 = ["gemm_ms", "attention_ms", "comm_ms", "other_ms"]
            .iter()
            .map(|k| s[k].as_f64().unwrap())
            .sum();
        assert!(
            (parts - s["total_ms"].as_f64().unwrap()).abs() < 1e-6,
            "{s}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_emitted_deployment_runs_and_serves() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("deploy");
    let out = configure(&[
        "--model",
        "Llama-3.1-8B",
        "--gpu",
        "H100",
        "--gpus",
        "2",
        "--isl",
        "500",
        "--osl",
        "50",
        "--ttft-ms",
        "2000",
        "--itl-ms",
        "50",
        "--json",
        "--emit-config",
        out_dir.to_str().unwrap(),
    ]);
    assert_success(&out);
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(report["evaluated"].as_u64().unwrap() > 10, "{report}");
    assert!(!report["frontier"].as_array().unwrap().is_empty());
    let best: Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("deployment.json")).unwrap())
            .unwrap();
    assert!(best["gpus"].as_u64().unwrap() <= 2, "{best}");
    assert!(best["ttft_ms"].as_f64().unwrap() <= 2000.0);
    assert!(best["itl_ms"].as_f64().unwrap() <= 50.0);
    let workers = match best["mode"].as_str().unwrap() {
        "aggregated" => best["replicas"].as_u64().unwrap(),
        "disaggregated" => {
            best["prefill_replicas"].as_u64().unwrap() + best["decode_replicas"].as_u64().unwrap()
        }
        other => panic!("mode {other}"),
    };
    assert!(std::fs::read_to_string(out_dir.join("pareto.svg"))
        .unwrap()
        .contains("<polyline"));

    // The emitted spec, applied to a cluster of joined nodes with the GPUs
    // of the budget as slots, is placed and serves.
    let spec = std::fs::read_to_string(out_dir.join("deployment.yaml")).unwrap();
    assert!(spec.contains("engine: mocker"), "{spec}");
    let nats = Nats::start();
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let _nodes: Vec<Node> = (1..=2)
        .map(|i| {
            let id = format!("n{i}");
            let labels = format!("zone=z1,rack=r1,host=h{i}");
            let mut args = vec![
                "--node-id",
                id.as_str(),
                "--labels",
                labels.as_str(),
                "--slots",
                "2",
            ];
            if i == 1 {
                args.extend(["--roles", "controller", "--http-listen", listen.as_str()]);
            } else {
                // Only n1 may take the frontend (it owns the test's port).
                args.extend(["--memory-mib", "0"]);
            }
            Node::join(&nats.url, &args)
        })
        .collect();
    let out = dynamoctl(
        &nats.url,
        &[
            "apply",
            "-f",
            out_dir.join("deployment.yaml").to_str().unwrap(),
            "--wait-secs",
            "60",
        ],
    );
    assert_success(&out);
    let http = Http::new(port);
    let t0 = std::time::Instant::now();
    while registrations(&nats.url).await.len() < workers as usize {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(60),
            "workers never registered"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    for i in 0..3 {
        let body = json!({"model": MODEL, "max_tokens": 8,
            "messages": [{"role": "user", "content": format!("plan number {i}")}]});
        let r = http.post("/v1/chat/completions", &body).await;
        assert_eq!(r.status, 200, "{}", r.json);
        assert_eq!(r.json["usage"]["completion_tokens"], 8, "{}", r.json);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calibrate_mocker_recovers_an_engines_timing() {
    // An engine with known timing: a mocker whose steps take
    // 5 + 0.05·n ms to prefill n tokens and 4 + 40·u ms to decode at KV
    // utilisation u, on a pool of 128 blocks of 16 tokens.
    let nats = Nats::start();
    let port = free_port();
    let cfg = node_config("n1", &nats.url, Some(port), 0, "")
        + &format!(
            "[[workers]]\ncount = 1\nengine = \"mocker\"\nmodel = \"{MODEL}\"\nheartbeat_ms = 500\n\n\
             [workers.mocker]\nspeedup = 1.0\nnum_blocks = 128\nblock_size = 16\n\
             prefill_ms = [0.0, 0.05, 5.0]\ndecode_ms = [0.0, 40.0, 4.0]\n"
        );
    let mut node = Node::start(&cfg);
    let http = Http::new(port);
    http.wait_ready(1, &mut node).await;
    let out = tokio::task::spawn_blocking(move || {
        Command::new(bin("dynamoctl"))
            .args([
                "calibrate-mocker",
                "--url",
                &format!("http://127.0.0.1:{port}"),
                "--lengths",
                "128,512,1024,1536",
                "--decode-tokens",
                "8",
                // Best of four: one slow repeat on a loaded CI host
                // (other tests of this binary run beside it) is not the
                // engine's timing.
                "--repeats",
                "4",
                "--kv-tokens",
                "2048",
                "--json",
            ])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert_success(&out);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["points"].as_array().unwrap().len(), 4, "{v}");
    let poly = |k: &str, x: f64| {
        let p: Vec<f64> = v[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_f64().unwrap())
            .collect();
        p[0] * x * x + p[1] * x + p[2]
    };
    // Measured through the real gateway, router and worker: within 20%.
    for n in [256.0, 1024.0] {
        let (got, want) = (poly("prefill_ms", n), 5.0 + 0.05 * n);
        assert!(
            (got / want - 1.0).abs() < 0.2,
            "prefill {n}: {got} vs {want}: {v}"
        );
    }
    for u in [0.25, 0.6] {
        let (got, want) = (poly("decode_ms", u), 4.0 + 40.0 * u);
        assert!(
            (got / want - 1.0).abs() < 0.2,
            "decode {u}: {got} vs {want}: {v}"
        );
    }
}
