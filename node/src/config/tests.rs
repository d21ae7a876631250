//! Config validation: every key checked, errors naming it.

use super::*;

fn parse(s: &str) -> Result<NodeConfig, ConfigError> {
    NodeConfig::validate(toml::from_str(s).map_err(|e| ConfigError::Parse {
        path: "t".into(),
        message: e.to_string(),
    })?)
}

#[test]
fn example_configs_validate() {
    for f in [
        "../cluster-config/examples/single-node.toml",
        "../cluster-config/examples/mocker.toml",
        "../cluster-config/examples/bench.toml",
        "../cluster-config/examples/llamacpp.toml",
    ] {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join(f);
        NodeConfig::load(&p).unwrap_or_else(|e| panic!("{f}: {e}"));
    }
}

#[test]
fn external_engines_are_checked() {
    let base = "node_id = \"a\"\n[nats]\nurl = \"embedded\"\n[[workers]]\n";
    let c = parse(&format!(
        "{base}engine = \"vllm\"\n[workers.external]\nurl = \"http://10.0.0.5:8000\"\nserved_model = \"m\"\n[workers.external.kv_events]\nendpoint = \"tcp://10.0.0.5:5557\"\nreplay_endpoint = \"tcp://10.0.0.5:5558\"\n"
    ))
    .unwrap();
    match &c.workers[0].engine {
        EngineSpec::External { config, block_size } => {
            assert_eq!(*block_size, 16);
            assert_eq!(config.api, dynamo_external_engine::config::Api::OpenAi);
            assert!(config.kv_events.is_some());
        }
        other => panic!("{other:?}"),
    }
    for (text, key) in [
        (
            "engine = \"llamacpp\"\n[workers.external]\n",
            "workers[0].external.url",
        ),
        (
            "engine = \"llamacpp\"\n[workers.external]\nurl = \"http://h:1\"\napi = \"vllm\"\n",
            "workers[0].external.api",
        ),
        (
            "engine = \"external\"\n[workers.external]\nurl = \"http://h:1\"\n",
            "workers[0].external.api",
        ),
        (
            "engine = \"llamacpp\"\nrole = \"prefill\"\n[workers.external]\nurl = \"http://h:1\"\n",
            "workers[0].role",
        ),
        (
            "engine = \"sglang\"\n[workers.external]\nurl = \"http://h:1\"\nmax_inflight = 0\n",
            "workers[0].external.max_inflight",
        ),
        (
            "engine = \"sglang\"\n[workers.external]\nurl = \"http://h:1\"\nbogus = 1\n",
            "bogus",
        ),
    ] {
        let e = parse(&format!("{base}{text}")).unwrap_err().to_string();
        assert!(e.contains(key), "{text}: {e}");
    }
}

#[test]
fn errors_name_the_key() {
    let base = "node_id = \"a\"\n[nats]\nurl = \"embedded\"\n";
    let e = parse(&format!("{base}[gateway]\nlisten = \"nope\"\n"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("gateway.listen"), "{e}");
    let e = parse(&format!("{base}[[workers]]\nengine = \"tgi\"\n"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("workers[0].engine"), "{e}");
    let e = parse(&format!("{base}[[workers]]\nengine = \"vllm\"\n"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("workers[0].external"), "{e}");
    let e = parse(&format!(
        "{base}[[workers]]\nengine = \"mocker\"\n[workers.mocker]\nspeedup = -1.0\n"
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("workers[0].mocker"), "{e}");
    let e = parse(&format!(
        "{base}[[workers]]\nengine = \"cpu\"\n[workers.cpu]\nthreads = 0\n"
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("workers[0].cpu"), "{e}");
    let e = parse(&format!(
        "{base}[[workers]]\nengine = \"cpu\"\nblock_size = 0\n"
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("workers[0].block_size"), "{e}");
    let e = parse(base).unwrap_err().to_string();
    assert!(e.contains("gateway/workers"), "{e}");
    let e = parse("node_id = \"a\"\nnamespace = \"a.b\"\n[nats]\nurl = \"embedded\"\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("namespace"), "{e}");
    assert!(parse(&format!("{base}bogus = 1\n")).is_err());
    let e = parse(&format!(
        "{base}[[workers]]\nengine = \"cpu\"\nrole = \"decode\"\n[workers.transfer]\nfence_after = 0\n"
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("workers[0].transfer.fence_after"), "{e}");
}

#[test]
fn the_retired_landing_region_size_still_loads() {
    let c = parse(
        "node_id = \"a\"\n[nats]\nurl = \"embedded\"\n[[workers]]\nengine = \"cpu\"\n\
         role = \"decode\"\n[workers.transfer]\nlanding_blocks = 256\n",
    )
    .unwrap();
    assert_eq!(c.workers[0].role, WorkerRole::Decode);
    assert_eq!(c.workers[0].transfer, TransferConfig::default());
}

#[test]
fn a_pinned_model_hash_is_64_hex_digits() {
    let base = "node_id = \"a\"\n[nats]\nurl = \"embedded\"\n[[workers]]\nengine = \"mocker\"\n";
    let sha = "ab".repeat(32);
    let c = parse(&format!("{base}model_sha256 = \"{sha}\"\n")).unwrap();
    assert_eq!(c.workers[0].model_sha256.map(|h| h.hex()), Some(sha));
    assert_eq!(parse(base).unwrap().workers[0].model_sha256, None);
    let e = parse(&format!("{base}model_sha256 = \"abc\"\n"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("workers[0].model_sha256"), "{e}");
}

#[test]
fn the_router_timing_model_is_checked() {
    let base =
        "node_id = \"a\"\n[nats]\nurl = \"embedded\"\n[gateway]\nlisten = \"127.0.0.1:1\"\n[router]\n";
    let c = parse(&format!(
        "{base}policy = \"kv_aware\"\nprefill_ms = [0.0, 0.02, 10.0]\nmax_batched_tokens = 4096\noverlap_weight = 2.0\n"
    ))
    .unwrap();
    match c.router.policy {
        dynamo_router::PolicyKind::KvAware(w, t) => {
            assert_eq!(t.prefill_ms, [0.0, 0.02, 10.0]);
            assert_eq!(
                t.decode_ms,
                dynamo_router::policy::StepTiming::default().decode_ms
            );
            assert_eq!(t.max_batched_tokens, 4096);
            assert_eq!(w.overlap_weight, 2.0);
        }
        other => panic!("{other:?}"),
    }
    let blocks = parse(&format!(
        "{base}policy = \"kv_aware_blocks\"\noverlap_weight = 3.0\n"
    ))
    .unwrap();
    assert!(matches!(
        blocks.router.policy,
        dynamo_router::PolicyKind::KvAwareBlocks(w) if w.overlap_weight == 3.0
    ));
    for (text, key) in [
        (
            "policy = \"kv_aware\"\nprefill_ms = [1e9, 0, 0]\n",
            "router.prefill_ms",
        ),
        (
            "policy = \"kv_aware\"\ndecode_ms = [0, nan, 0]\n",
            "router.decode_ms",
        ),
        (
            "policy = \"kv_aware\"\nmax_batched_tokens = 0\n",
            "router.max_batched_tokens",
        ),
        (
            "policy = \"kv_aware_blocks\"\nprefill_ms = [0, 1, 0]\n",
            "router.policy",
        ),
        (
            "policy = \"round_robin\"\noverlap_weight = 1.0\n",
            "router.policy",
        ),
        (
            "policy = \"kv_aware\"\ntemperature = -1.0\n",
            "router.temperature",
        ),
    ] {
        match parse(&format!("{base}{text}")) {
            Err(ConfigError::Invalid { key: k, .. }) => assert_eq!(k, key, "{text}"),
            other => panic!("{text}: {other:?}"),
        }
    }
}

#[test]
fn nats_and_gateway_security_settings_are_checked() {
    let gw = "[gateway]\nlisten = \"127.0.0.1:1\"\n";
    // An embedded server is secured by default.
    let c = parse(&format!(
        "node_id = \"a\"\n[nats]\nurl = \"embedded\"\n{gw}"
    ))
    .unwrap();
    assert_eq!(
        c.nats,
        NatsSpec::Embedded {
            port: 0,
            tls: true,
            auth: true
        }
    );
    let c = parse(&format!(
        "node_id = \"a\"\n[nats]\nurl = \"embedded\"\ntls = false\nauth = false\n{gw}"
    ))
    .unwrap();
    assert!(matches!(
        c.nats,
        NatsSpec::Embedded {
            tls: false,
            auth: false,
            ..
        }
    ));
    // tls:// URLs are servers given by URL.
    let c = parse(&format!(
        "node_id = \"a\"\n[nats]\nurl = \"tls://h1:4222,tls://h2:4222\"\n{gw}"
    ))
    .unwrap();
    assert_eq!(c.nats, NatsSpec::Url("tls://h1:4222,tls://h2:4222".into()));

    let dir = tempfile::tempdir().unwrap();
    let pki = dynamo_runtime::tls::Pki::generate("t", &["127.0.0.1"]).unwrap();
    let f = pki.write(dir.path()).unwrap();
    let creds = dir.path().join("creds");
    dynamo_runtime::Credentials::generate()
        .unwrap()
        .write(&creds)
        .unwrap();
    let ok = parse(&format!(
        "node_id = \"a\"\n[nats]\nurl = \"tls://h:1\"\nca_file = {:?}\ncredentials = {:?}\n[gateway]\nlisten = \"127.0.0.1:1\"\ntls_cert = {:?}\ntls_key = {:?}\n",
        f.ca.display().to_string(),
        creds.display().to_string(),
        f.cert.display().to_string(),
        f.key.display().to_string()
    ))
    .unwrap();
    assert_eq!(ok.nats_access.ca_file.as_deref(), Some(f.ca.as_path()));
    assert!(ok.gateway.unwrap().tls.is_some());

    let missing = dir.path().join("missing.pem").display().to_string();
    for (text, key) in [
        (
            "[nats]\nurl = \"embedded\"\nca_file = \"x\"\n",
            "nats.ca_file",
        ),
        ("[nats]\nurl = \"nats://h:1\"\ntls = true\n", "nats.tls"),
        ("[nats]\nurl = \"nats://h:1\"\nauth = true\n", "nats.auth"),
        (
            "[nats]\nurl = \"embedded\"\ncredentials = \"x\"\n",
            "nats.credentials",
        ),
        (
            &*format!("[nats]\nurl = \"nats://h:1\"\nca_file = {missing:?}\n"),
            "nats.ca_file",
        ),
        (
            &*format!(
                "[nats]\nurl = \"nats://h:1\"\ncredentials = {:?}\n",
                dir.path().join("empty").display().to_string()
            ),
            "nats.credentials",
        ),
        ("[nats]\nurl = \"http://h:1\"\n", "nats.url"),
    ] {
        let e = parse(&format!("node_id = \"a\"\n{text}{gw}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains(key), "{text}: {e}");
    }
    for (text, key) in [
        (
            format!("tls_cert = {:?}\n", f.cert.display().to_string()),
            "gateway.tls_key",
        ),
        (
            format!("tls_key = {:?}\n", f.key.display().to_string()),
            "gateway.tls_cert",
        ),
        (
            format!("tls_cert = {missing:?}\ntls_key = {missing:?}\n"),
            "gateway.tls_cert",
        ),
        (
            format!(
                "tls_cert = {:?}\ntls_key = {missing:?}\n",
                f.cert.display().to_string()
            ),
            "gateway.tls_key",
        ),
    ] {
        let e = parse(&format!(
            "node_id = \"a\"\n[nats]\nurl = \"embedded\"\n{gw}{text}"
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains(key), "{text}: {e}");
    }
}

/// `dynamoctl apply` checks a frontend's settings without reading the
/// files it names: they are on the node that will run it.
#[test]
fn a_spec_names_tls_and_key_files_that_only_its_node_has() {
    let spec = |gateway: &str| {
        dynamo_cluster_config::spec::DeploymentSpec::parse(&format!(
            "version: 1\nname: d\nservices:\n  frontend:\n    role: frontend\n    gateway: {{{gateway}}}\n"
        ))
        .expect("the spec parses")
    };
    let absent = "/nonexistent/on/the/operators/machine";
    check_spec_settings(&spec(&format!(
        "listen: \"0.0.0.0:8443\", tls_cert: \"{absent}/c.pem\", tls_key: \"{absent}/k.pem\", api_keys_file: \"{absent}/keys.toml\""
    )))
    .expect("the files are read where the frontend runs");
    // Pairing is still checked, and so is a listen address open without keys.
    let e = check_spec_settings(&spec(&format!("tls_cert: \"{absent}/c.pem\"")))
        .expect_err("a certificate without its key");
    assert!(e.to_string().contains("tls_key"), "{e}");
    let e = check_spec_settings(&spec("listen: \"0.0.0.0:8000\""))
        .expect_err("open to other hosts without keys");
    assert!(
        e.to_string().contains("allow_unauthenticated") || e.to_string().contains("api_keys"),
        "{e}"
    );
}

/// The node's metrics listener: loopback needs nothing; an address other
/// hosts can reach needs a bearer token or an explicit allowance.
#[test]
fn a_metrics_listener_other_hosts_reach_needs_a_token_or_an_allowance() {
    let base = "node_id = \"a\"\n[nats]\nurl = \"nats://h:1\"\n[[workers]]\ncount = 1\nengine = \"mocker\"\nmodel = \"m\"\n";
    let with = |metrics: &str| parse(&format!("{base}[metrics]\n{metrics}"));
    let m = with("listen = \"127.0.0.1:9464\"\n")
        .unwrap()
        .metrics_listen
        .unwrap();
    assert_eq!((m.addr.port(), m.token), (9464, None));
    let e = with("listen = \"0.0.0.0:9464\"\n").unwrap_err();
    assert!(
        e.to_string().contains("metrics.listen") && e.to_string().contains("metrics.token_file"),
        "{e}"
    );
    assert!(with("listen = \"0.0.0.0:9464\"\nallow_unauthenticated = true\n").is_ok());
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cret\n").unwrap();
    let m = with(&format!(
        "listen = \"0.0.0.0:9464\"\ntoken_file = {:?}\n",
        token.display().to_string()
    ))
    .unwrap()
    .metrics_listen
    .unwrap();
    assert_eq!(m.token.as_deref(), Some("s3cret"));
    assert!(
        !format!("{m:?}").contains("s3cret"),
        "the token is not printed"
    );
    std::fs::write(&token, "\n").unwrap();
    let e = with(&format!(
        "listen = \"0.0.0.0:9464\"\ntoken_file = {:?}\n",
        token.display().to_string()
    ))
    .unwrap_err();
    assert!(e.to_string().contains("metrics.token_file"), "{e}");
    let e = with(&format!("token_file = {:?}\n", token.display().to_string())).unwrap_err();
    assert!(e.to_string().contains("needs metrics.listen"), "{e}");
}

/// A wrong value in a spec's service settings names its field, down to the
/// key, not only the service.
#[test]
fn a_wrong_value_in_a_spec_names_its_field() {
    for (yaml, key) in [
        (
            "frontend:\n    role: frontend\n    gateway: {max_migrations: -1}",
            "config key `services.frontend.gateway.max_migrations`",
        ),
        (
            "frontend:\n    role: frontend\n    router: {worker_ttl_ms: \"soon\"}",
            "config key `services.frontend.router.worker_ttl_ms`",
        ),
        (
            "w:\n    role: aggregated\n    worker: {engine: cpu, model: smollm2-135m-instruct, cpu: {threads: -2}}",
            "config key `services.w.worker.cpu.threads`",
        ),
    ] {
        let spec = dynamo_cluster_config::spec::DeploymentSpec::parse(&format!(
            "version: 1\nname: d\nservices:\n  {yaml}\n"
        ))
        .expect("the spec parses");
        let e = check_spec_settings(&spec).expect_err(yaml).to_string();
        assert!(e.starts_with(key), "{yaml}: {e}");
        assert!(e.contains("invalid"), "{yaml}: {e}");
    }
}

/// A config that cannot be read names its path and the cause, once: the
/// cause is in the message, not also a source that `{:#}` would print again.
#[test]
fn a_missing_config_names_its_cause_once() {
    let e = NodeConfig::load(std::path::Path::new("/nonexistent/node.toml")).unwrap_err();
    let chain = format!("{:#}", anyhow::Error::from(e));
    assert!(
        chain.starts_with("cannot read config /nonexistent/node.toml: "),
        "{chain}"
    );
    assert_eq!(
        chain.matches("No such file or directory").count(),
        1,
        "{chain}"
    );
}

#[test]
fn labels_are_key_value_pairs_with_no_empty_entry() {
    use crate::config::parse_labels;
    assert_eq!(parse_labels("").unwrap(), vec![]);
    assert_eq!(
        parse_labels("zone=z1, rack=r1").unwrap(),
        vec![("rack".into(), "r1".into()), ("zone".into(), "z1".into())]
    );
    for bad in [
        "zone=z1,,rack=r1",
        "zone=z1,",
        "zone",
        "zone=z1,zone=z2",
        "a b=c",
    ] {
        let e = parse_labels(bad).unwrap_err().to_string();
        assert!(e.contains("--labels"), "{bad}: {e}");
    }
}
