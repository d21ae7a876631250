//! `dynamoctl configure`: the configurator's search from the command line.
//! Prints a table (or JSON), and writes a Pareto plot (SVG) and the node
//! deployment spec of the best deployment when asked (`deployment.yaml`,
//! for `dynamoctl apply` or `dynamoctl render k8s`).
//!
//! Bad input (unknown model or GPU, an SLA nothing meets, too few GPUs for
//! the weights, non-positive numbers) is an error naming the problem; the
//! binary turns it into a message and a non-zero exit.

use dynamo_configurator::online::Load;
use dynamo_configurator::search::KvCharge;
use dynamo_configurator::{
    calib, emit, engines, report, search, Calibration, Catalog, Dtype, Query, StepModel,
};
use std::path::PathBuf;

/// Everything `dynamoctl configure` takes.
#[derive(Clone, Debug, clap::Args)]
pub struct ConfigureSpec {
    /// Model name (see configurator/data/models.toml), e.g. Llama-3.1-70B.
    #[arg(long)]
    pub model: String,
    /// GPU type: H100, H200, B200, A100, L40S.
    #[arg(long)]
    pub gpu: String,
    /// GPUs available in all.
    #[arg(long)]
    pub gpus: u32,
    /// Input (prompt) tokens per request.
    #[arg(long)]
    pub isl: u32,
    /// Output tokens per request.
    #[arg(long)]
    pub osl: u32,
    /// Time-to-first-token target, ms.
    #[arg(long)]
    pub ttft_ms: f64,
    /// Inter-token latency target, ms.
    #[arg(long)]
    pub itl_ms: f64,
    /// Weights: fp8, bf16 or fp4 (MXFP4; KV then stays FP8). Default: fp8
    /// where the GPU has FP8 tensor cores.
    #[arg(long)]
    pub dtype: Option<String>,
    /// Engine profile (configurator/data/engines.toml): current, vllm-0.8,
    /// sglang-0.4, sglang-0.4-ep, trtllm-1.0, trtllm-0.17, trtllm-0.14,
    /// trtllm-0.5.
    #[arg(long, default_value = "current")]
    pub engine: String,
    /// Largest data-parallel-attention, expert-parallel group of an MoE
    /// model; past 8 it spans nodes.
    #[arg(long, default_value_t = 8)]
    pub max_ep: u32,
    /// KV charged per running sequence: expected (isl + osl/2, engines that
    /// admit by free blocks) or worst-case (isl + osl). Engines that reserve
    /// whole sequences (TensorRT-LLM) always use worst-case.
    #[arg(long, default_value = "expected")]
    pub kv_charge: String,
    /// Online mode: requests/s offered to the whole deployment; TTFT and
    /// ITL are predicted at that load, with its queueing.
    #[arg(long, conflicts_with = "concurrency")]
    pub rate: Option<f64>,
    /// Online mode: concurrent closed-loop clients of the whole deployment.
    #[arg(long)]
    pub concurrency: Option<f64>,
    /// Print the step-time breakdown (GEMM, attention, communication,
    /// overhead) of the best deployment for the whole budget.
    #[arg(long)]
    pub explain: bool,
    /// Largest tensor-parallel group (GPUs on one NVLink domain).
    #[arg(long, default_value_t = 8)]
    pub max_tp: u32,
    /// Bandwidth moving KV from prefill to decode replicas, GB/s
    /// (default: the GPU's network bandwidth from the catalog).
    #[arg(long)]
    pub kv_link_gbps: Option<f64>,
    /// Print JSON instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Write the Pareto plot here (SVG).
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// Write node configs of the best deployment (GPU-free, mocker workers
    /// with the model's timing), its summary and the plot here.
    #[arg(long)]
    pub emit_config: Option<PathBuf>,
}

/// A DNS-label deployment name from a model name (`Llama-3.1-8B` → `llama-3-1-8b`).
fn spec_name(model: &str) -> String {
    let mut n: String = model
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    while n.contains("--") {
        n = n.replace("--", "-");
    }
    let n = n.trim_matches('-');
    let n: String = n
        .chars()
        .take(dynamo_cluster_config::spec::MAX_NAME)
        .collect();
    let n = n.trim_end_matches('-').to_string();
    if n.starts_with(|c: char| c.is_ascii_lowercase()) {
        n
    } else {
        format!("m-{n}")
            .chars()
            .take(dynamo_cluster_config::spec::MAX_NAME)
            .collect::<String>()
            .trim_end_matches('-')
            .to_string()
    }
}

/// The best deployment as one deployment spec: a frontend, and the
/// configurator's workers (mocker engines with the model's timing) with
/// their replica counts and GPUs per replica as slots.
fn deployment_spec(
    model: &str,
    best: &dynamo_configurator::Candidate,
    files: &[emit::File],
) -> anyhow::Result<dynamo_cluster_config::spec::DeploymentSpec> {
    use dynamo_cluster_config::spec::{DeploymentSpec, RawService, RawSpec, Resources, Role};
    let table = |name: &str| -> anyhow::Result<serde_json::Value> {
        let f = files
            .iter()
            .find(|f| f.name == name)
            .ok_or_else(|| anyhow::anyhow!("the configurator emitted no {name}"))?;
        let v: toml::Value = toml::from_str(&f.text)?;
        Ok(serde_json::to_value(v)?)
    };
    let gw = table("gateway.toml")?;
    let mut services = std::collections::BTreeMap::new();
    let mut gateway = gw["gateway"].clone();
    if let Some(o) = gateway.as_object_mut() {
        o.remove("listen");
    }
    services.insert(
        "frontend".to_string(),
        RawService {
            role: Role::Frontend,
            replicas: Some(1),
            min_available: None,
            // What a gateway and router take (their resident memory is ~100 MiB).
            resources: Some(Resources {
                slots: 0,
                memory_mib: 512,
            }),
            topology: None,
            starts_after: Vec::new(),
            node_selector: Default::default(),
            worker: None,
            gateway: Some(gateway),
            router: Some(gw["router"].clone()),
        },
    );
    let workers: Vec<(&str, &str, Role, u32)> = match &best.mode {
        dynamo_configurator::Mode::Aggregated { layout, .. } => {
            vec![("workers.toml", "workers", Role::Aggregated, layout.gpus())]
        }
        dynamo_configurator::Mode::Disaggregated {
            prefill, decode, ..
        } => vec![
            ("prefill.toml", "prefill", Role::Prefill, prefill.gpus()),
            ("decode.toml", "decode", Role::Decode, decode.gpus()),
        ],
    };
    for (file, name, role, gpus) in workers {
        let t = table(file)?;
        let mut w = t["workers"][0].clone();
        let o = w
            .as_object_mut()
            .ok_or_else(|| anyhow::anyhow!("{file}: no [[workers]] entry"))?;
        let replicas = o.remove("count").and_then(|c| c.as_u64()).unwrap_or(1) as u32;
        o.remove("role");
        services.insert(
            name.to_string(),
            RawService {
                role,
                replicas: Some(replicas),
                min_available: None,
                resources: Some(Resources {
                    slots: gpus,
                    memory_mib: 0,
                }),
                topology: None,
                starts_after: vec!["frontend".into()],
                node_selector: Default::default(),
                worker: Some(w),
                gateway: None,
                router: None,
            },
        );
    }
    let spec = DeploymentSpec::validate(RawSpec {
        version: 1,
        name: spec_name(model),
        topology: None,
        services,
        groups: Default::default(),
        planner: None,
    })?;
    crate::config::check_spec_settings(&spec)?;
    Ok(spec)
}

/// Runs the search and writes what was asked; returns what to print.
pub fn run(spec: &ConfigureSpec) -> anyhow::Result<String> {
    let catalog = Catalog::builtin()?;
    let model = catalog.model(&spec.model)?;
    let gpu = catalog.gpu(&spec.gpu)?;
    let calib = Calibration::parse(calib::H200_JSON, catalog.gpu("H200")?)?;
    let profile =
        engines::profile(&spec.engine, &calib).map_err(|e| anyhow::anyhow!("--engine: {e}"))?;
    let mut q = Query::new(
        gpu,
        spec.gpus,
        spec.isl,
        spec.osl,
        spec.ttft_ms,
        spec.itl_ms,
    );
    if let Some(d) = &spec.dtype {
        let d = Dtype::parse(d)
            .ok_or_else(|| anyhow::anyhow!("unknown --dtype {d:?} (known: fp8, bf16, fp4)"))?;
        q.weights = d;
        q.kv = if d == Dtype::Fp4 { Dtype::Fp8 } else { d };
    }
    q.max_tp = spec.max_tp;
    q.max_ep = spec.max_ep;
    q.max_num_tokens = profile.max_num_tokens;
    q.kv_charge = match spec.kv_charge.as_str() {
        "expected" => KvCharge::Expected,
        "worst-case" => KvCharge::WorstCase,
        other => anyhow::bail!("unknown --kv-charge {other:?} (known: expected, worst-case)"),
    };
    q.load = match (spec.rate, spec.concurrency) {
        (Some(r), _) => Some(Load::Rate(r)),
        (None, Some(c)) => Some(Load::Concurrency(c)),
        (None, None) => None,
    };
    if let Some(gbps) = spec.kv_link_gbps {
        q.kv_link_gbps = gbps;
    }
    let outcome = search(model, gpu, &calib, &profile, &q)?;
    let load = match q.load {
        Some(Load::Rate(r)) => format!(", at {r} requests/s"),
        Some(Load::Concurrency(c)) => format!(", at {c} concurrent clients"),
        None => String::new(),
    };
    let title = format!(
        "{} on {} × {} ({}), ISL {} / OSL {}, TTFT ≤ {} ms, ITL ≤ {} ms{load}",
        // The name asked for (an alias names the same shape).
        spec.model,
        spec.gpus,
        gpu.name,
        profile.name,
        spec.isl,
        spec.osl,
        spec.ttft_ms,
        spec.itl_ms
    );
    let step_model = |layout: &dynamo_configurator::Layout| StepModel {
        model,
        gpu,
        deployment: search::deployment(&q, &profile, *layout),
        calib: &calib,
        profile: profile.clone(),
    };
    let explained = match (spec.explain, outcome.best_per_budget.last()) {
        (true, Some((_, best))) => Some((best, report::explain(best, &q, step_model))),
        _ => None,
    };
    let mut written = Vec::new();
    // The plot is drawn only when something will be written.
    let plot = if spec.svg.is_some() || spec.emit_config.is_some() {
        report::svg(&outcome, &title)
    } else {
        String::new()
    };
    if let Some(path) = &spec.svg {
        write(path, &plot)?;
        written.push(path.clone());
    }
    if let Some(dir) = &spec.emit_config {
        std::fs::create_dir_all(dir)
            .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", dir.display()))?;
        let (_, best) = outcome
            .best_per_budget
            .last()
            .ok_or_else(|| anyhow::anyhow!("no deployment fits the budget"))?;
        let summary = format!("{} — {}", title, best.label());
        let files = emit::node_configs(best, &summary, |layout, batch| {
            // Online, a candidate's batch is the average it decodes at the
            // load; the workers take the layout's whole cap.
            let cap = match q.load {
                Some(_) => search::batch_cap(model, gpu, &profile, &q, *layout).unwrap_or(batch),
                None => batch,
            };
            emit::mocker_timing(&step_model(layout), &q, cap)
        })?;
        let spec = deployment_spec(&spec.model, best, &files)?;
        let path = dir.join("deployment.yaml");
        write(
            &path,
            &format!(
                "# Emitted by `dynamoctl configure`: {summary}\n{}",
                spec.to_yaml()?
            ),
        )?;
        written.push(path);
        let path = dir.join("pareto.svg");
        write(&path, &plot)?;
        written.push(path);
        let path = dir.join("deployment.json");
        write(&path, &serde_json::to_string_pretty(best)?)?;
        written.push(path);
    }
    if spec.json {
        return Ok(serde_json::to_string_pretty(&serde_json::json!({
            "query": {
                "model": model.name, "gpu": gpu.name, "gpus": spec.gpus,
                "isl": spec.isl, "osl": spec.osl,
                "ttft_ms": spec.ttft_ms, "itl_ms": spec.itl_ms,
                "engine": profile.name, "load": q.load,
            },
            "explain": explained.as_ref().map(|(_, e)| e),
            "evaluated": outcome.evaluated,
            "frontier": outcome.frontier,
            "best_per_budget": outcome.best_per_budget.iter()
                .map(|(b, c)| serde_json::json!({"budget": b, "deployment": c}))
                .collect::<Vec<_>>(),
            "written": written,
        }))?);
    }
    let mut out = format!("{title}\n\n{}", report::table(&outcome));
    if let Some((best, steps)) = &explained {
        out += &format!("\n{}", report::explain_table(best, steps));
    }
    for p in written {
        out += &format!("wrote {}\n", p.display());
    }
    Ok(out)
}

fn write(path: &std::path::Path, text: &str) -> anyhow::Result<()> {
    std::fs::write(path, text).map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(model: &str, gpu: &str, gpus: u32, ttft: f64, itl: f64) -> ConfigureSpec {
        ConfigureSpec {
            model: model.into(),
            gpu: gpu.into(),
            gpus,
            isl: 2000,
            osl: 300,
            ttft_ms: ttft,
            itl_ms: itl,
            dtype: None,
            engine: "current".into(),
            max_ep: 8,
            kv_charge: "expected".into(),
            rate: None,
            concurrency: None,
            explain: false,
            max_tp: 8,
            kv_link_gbps: None,
            json: false,
            svg: None,
            emit_config: None,
        }
    }

    #[test]
    fn emitted_configs_are_valid_node_configs() {
        let dir = tempfile::tempdir().unwrap();
        for (gpus, ttft) in [(8, 3000.0), (32, 400.0)] {
            let mut s = spec("Llama-3.1-70B", "H200", gpus, ttft, 40.0);
            let out_dir = dir.path().join(format!("g{gpus}"));
            s.emit_config = Some(out_dir.clone());
            let out = run(&s).unwrap();
            assert!(out.contains("Pareto frontier"), "{out}");
            let spec = crate::cluster::load_spec(&out_dir.join("deployment.yaml")).unwrap();
            assert!(spec.services.len() >= 2, "{out}");
            assert_eq!(spec.name, "llama-3-1-70b");
            let used: u32 = spec
                .services
                .iter()
                .map(|s| s.resources.slots * s.replicas)
                .sum();
            assert!(used >= 1 && used <= gpus, "{out}");
            assert!(out_dir.join("pareto.svg").exists());
            let d: serde_json::Value = serde_json::from_str(
                &std::fs::read_to_string(out_dir.join("deployment.json")).unwrap(),
            )
            .unwrap();
            assert!(d["gpus"].as_u64().unwrap() <= gpus as u64);
        }
    }

    #[test]
    fn bad_input_names_the_problem() {
        let msg = |s: ConfigureSpec| run(&s).unwrap_err().to_string();
        assert!(msg(spec("Llama-9", "H200", 8, 1000.0, 50.0)).contains("unknown model"));
        assert!(msg(spec("Llama-3.1-8B", "H900", 8, 1000.0, 50.0)).contains("unknown GPU"));
        assert!(msg(spec("Llama-3.1-8B", "H200", 8, 1.0, 0.1)).contains("meets TTFT"));
        assert!(msg(spec("DeepSeek-V3", "A100", 4, 5000.0, 100.0)).contains("cannot hold"));
        let mut s = spec("Llama-3.1-8B", "H200", 8, 1000.0, 50.0);
        s.engine = "tgi".into();
        let m = msg(s);
        assert!(m.contains("--engine") && m.contains("vllm-0.8"), "{m}");
        let mut s = spec("Llama-3.1-8B", "H200", 8, 1000.0, 50.0);
        s.kv_charge = "some".into();
        assert!(msg(s).contains("--kv-charge"));
        let mut s = spec("Llama-3.1-8B", "H200", 8, 1000.0, 50.0);
        s.rate = Some(-1.0);
        assert!(msg(s).contains("must be positive"));
        let mut s = spec("Llama-3.1-70B", "H100", 2, 1000.0, 50.0);
        s.rate = Some(1e6);
        assert!(msg(s).contains("saturates"));
    }

    #[test]
    fn engines_online_loads_and_the_explanation_are_printed() {
        let mut s = spec("Llama-3.1-70B", "H200", 8, 2000.0, 60.0);
        s.engine = "vllm-0.8".into();
        s.rate = Some(4.0);
        s.explain = true;
        let out = run(&s).unwrap();
        assert!(
            out.contains("vllm-0.8") && out.contains("at 4 requests/s"),
            "{out}"
        );
        for part in [
            "Step time of",
            "GEMM",
            "attention",
            "communication",
            "overhead",
        ] {
            assert!(out.contains(part), "{part}: {out}");
        }
        s.json = true;
        let v: serde_json::Value = serde_json::from_str(&run(&s).unwrap()).unwrap();
        assert_eq!(v["query"]["engine"], "vllm-0.8");
        assert!(v["explain"][0]["total_ms"].as_f64().unwrap() > 0.0);
        // MXFP4 weights let gpt-oss-120b fit one H100.
        let mut s = spec("gpt-oss-120b", "H100", 1, 3000.0, 60.0);
        s.dtype = Some("fp4".into());
        assert!(run(&s).is_ok());
        // Wide expert parallelism across nodes for DeepSeek-R1.
        let mut s = spec("DeepSeek-R1", "H200", 32, 5000.0, 100.0);
        s.max_ep = 32;
        s.engine = "sglang-0.4-ep".into();
        assert!(run(&s).unwrap().contains("dep"));
    }
}
