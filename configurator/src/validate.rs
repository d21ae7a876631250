//! The configurator against published figures (`data/published.toml`):
//! a fitting set, the only figures engine profiles are fitted on, and a
//! validation set, never fitted on.
//!
//! Every point names its engine profile, layout, lengths and load, what
//! was measured and where it was read. [`predict`] turns one point into
//! the configurator's figure for it: a static batch, offline maximum
//! throughput, an online run at a Poisson rate, a short burst of prompts,
//! or one phase (prefill or decode) measured alone.
//!
//! Invariants: a point names a known source, profile, model and GPU; a
//! profile is never validated on a point it was fitted on ([`check`]
//! refuses it); errors name the point.

use crate::calib::Calibration;
use crate::engines::EngineProfile;
use crate::memory::{plan, Deployment, Dtype};
use crate::online::{self, Load, Workload};
use crate::perf::{Step, StepModel};
use crate::spec::{Catalog, SpecError};
use serde::Deserialize;
use thiserror::Error;

/// The published points, built in.
pub const PUBLISHED_TOML: &str = include_str!("../data/published.toml");

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Source {
    pub id: String,
    pub url: String,
    pub engine: String,
    pub version: String,
    /// What was run and measured.
    pub what: String,
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Set {
    Fit,
    Validate,
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// `batch` prompts prefilled together, then `osl` decode steps.
    Static,
    /// Every request queued at once; in-flight batching.
    MaxThroughput,
    /// Poisson arrivals at `rate` requests/s, in steady state.
    Online,
    /// `prompts` requests arriving at `rate`; the run's totals.
    Burst,
    /// Prefill alone at `tokens_per_gpu` tokens per GPU per step.
    Prefill,
    /// Decode alone at `batch` sequences per GPU and `isl` tokens of KV.
    Decode,
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    OutputTokS,
    InputTokS,
    TtftMs,
    ItlMs,
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Per {
    Total,
    Gpu,
    /// A node of 8 GPUs.
    Node,
}

#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum LayoutKind {
    /// Tensor parallel (experts split by TP).
    #[default]
    Tp,
    /// Tensor-parallel attention, expert-parallel MoE layers.
    TpEp,
    /// Data-parallel attention, expert-parallel MoE layers.
    Dep,
}

fn one() -> u32 {
    1
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Point {
    pub id: String,
    pub set: Set,
    pub source: String,
    pub profile: String,
    pub model: String,
    pub gpu: String,
    pub tp: u32,
    #[serde(default = "one")]
    pub pp: u32,
    #[serde(default)]
    pub layout: LayoutKind,
    pub weights: String,
    pub kv: String,
    pub isl: u32,
    pub osl: u32,
    pub kind: Kind,
    #[serde(default)]
    pub batch: Option<f64>,
    #[serde(default)]
    pub rate: Option<f64>,
    #[serde(default)]
    pub prompts: Option<f64>,
    #[serde(default)]
    pub tokens_per_gpu: Option<f64>,
    /// The run overlapped communication with compute (two-batch overlap).
    #[serde(default)]
    pub overlap: bool,
    /// The run's memory setting where it differs from the engine default.
    #[serde(default)]
    pub memory_fraction: Option<f64>,
    pub metric: Metric,
    pub per: Per,
    pub value: f64,
    pub quote: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    source: Vec<Source>,
    point: Vec<Point>,
}

#[derive(Debug, Error, PartialEq)]
pub enum ValidateError {
    #[error("published.toml: {0}")]
    Bad(String),
    #[error("point {id}: {message}")]
    Point { id: String, message: String },
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error("profile {profile} was fitted on {id}, a validation point")]
    FittedOnValidation { profile: String, id: String },
}

fn bad(p: &Point, message: impl Into<String>) -> ValidateError {
    ValidateError::Point {
        id: p.id.clone(),
        message: message.into(),
    }
}

/// The sources and points, built in.
pub fn published() -> Result<(Vec<Source>, Vec<Point>), ValidateError> {
    parse(PUBLISHED_TOML)
}

/// Sources and points from text in `published.toml`'s format (a user's
/// own measurements, checked with `validate --points FILE`).
pub fn parse(text: &str) -> Result<(Vec<Source>, Vec<Point>), ValidateError> {
    let f: File = toml::from_str(text).map_err(|e| ValidateError::Bad(e.to_string()))?;
    for p in &f.point {
        if !f.source.iter().any(|s| s.id == p.source) {
            return Err(bad(p, format!("unknown source {:?}", p.source)));
        }
        if !(p.value.is_finite() && p.value > 0.0) || p.isl == 0 || p.osl == 0 || p.tp == 0 {
            return Err(bad(p, "value, isl, osl and tp must be positive"));
        }
    }
    let mut ids: Vec<&str> = f.point.iter().map(|p| p.id.as_str()).collect();
    ids.sort_unstable();
    if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
        return Err(ValidateError::Bad(format!("point id {} is repeated", w[0])));
    }
    Ok((f.source, f.point))
}

fn dtype(p: &Point, s: &str) -> Result<Dtype, ValidateError> {
    Dtype::parse(s).ok_or_else(|| bad(p, format!("unknown dtype {s:?}")))
}

fn need(p: &Point, v: Option<f64>, field: &str) -> Result<f64, ValidateError> {
    v.filter(|x| x.is_finite() && *x > 0.0)
        .ok_or_else(|| bad(p, format!("a {:?} point needs a positive {field}", p.kind)))
}

/// The configurator's figure for `p` with `profile`.
pub fn predict(
    p: &Point,
    catalog: &Catalog,
    calib: &Calibration,
    profile: &EngineProfile,
) -> Result<f64, ValidateError> {
    let model = catalog.model(&p.model)?;
    let gpu = catalog.gpu(&p.gpu)?;
    let mut memory = profile.memory;
    if let Some(f) = p.memory_fraction {
        memory.fraction = f;
    }
    let deployment = Deployment {
        tp: p.tp,
        pp: p.pp,
        weights: dtype(p, &p.weights)?,
        kv: dtype(p, &p.kv)?,
        memory,
        expert_parallel: p.layout == LayoutKind::TpEp,
        dp_attention: p.layout == LayoutKind::Dep,
        overlap: p.overlap,
    };
    let sm = StepModel {
        model,
        gpu,
        deployment,
        calib,
        profile: profile.clone(),
    };
    let gpus = deployment.gpus() as f64;
    let (isl, osl) = (p.isl as f64, p.osl as f64);
    let workload = || -> Result<Workload, ValidateError> {
        let kv = plan(model, gpu, &deployment).map_err(|e| bad(p, e.to_string()))?;
        let live = if profile.reserves_whole_sequence {
            isl + osl
        } else {
            isl + osl / 2.0
        };
        // Each data-parallel attention rank schedules on its own.
        let ranks = if deployment.dp_attention { gpus } else { 1.0 };
        Ok(Workload {
            isl,
            osl,
            max_num_tokens: profile.max_num_tokens as f64 * ranks,
            max_batch: (profile.max_batch as f64 * ranks).min((kv.kv_tokens as f64 / live).floor()),
            serving_ms: profile.serving_ms,
        })
    };
    let service =
        |s: Option<online::Service>| s.ok_or_else(|| bad(p, "the load saturates the replica"));
    // The figure for the whole replica.
    let total = match p.kind {
        Kind::Static => {
            let batch = need(p, p.batch, "batch")?;
            match p.metric {
                Metric::OutputTokS => sm.static_batch_tokens_per_s(batch, isl, osl),
                _ => return Err(bad(p, "a static point measures output_tok_s")),
            }
        }
        Kind::MaxThroughput => match p.metric {
            Metric::OutputTokS => online::max_throughput(&sm, &workload()?),
            _ => return Err(bad(p, "a max_throughput point measures output_tok_s")),
        },
        Kind::Online | Kind::Burst => {
            // A run of `prompts` requests (its totals), or the steady state.
            let w = workload()?;
            let rate = need(p, p.rate, "rate")?;
            let s = match p.prompts {
                Some(n) => service(online::finite(&sm, &w, n, rate))?,
                None if p.kind == Kind::Online => {
                    service(online::serve(&sm, &w, Load::Rate(rate)))?
                }
                None => return Err(bad(p, "a burst point needs prompts")),
            };
            match p.metric {
                Metric::OutputTokS => s.output_tokens_per_s,
                Metric::InputTokS => s.rate * isl,
                Metric::TtftMs => s.ttft_ms,
                Metric::ItlMs => s.itl_ms,
            }
        }
        Kind::Prefill => {
            let per_gpu = need(p, p.tokens_per_gpu, "tokens_per_gpu")?;
            let tokens = per_gpu * gpus;
            let t = sm
                .step(&Step {
                    prefill: tokens,
                    prefill_seqs: tokens / isl,
                    ..Step::default()
                })
                .total();
            match p.metric {
                Metric::InputTokS => tokens / (t * 1e-6),
                _ => return Err(bad(p, "a prefill point measures input_tok_s")),
            }
        }
        Kind::Decode => {
            let batch = need(p, p.batch, "batch")? * gpus;
            let t = sm.decode_us(batch, isl);
            match p.metric {
                Metric::OutputTokS => batch / (t * 1e-6),
                Metric::ItlMs => t / 1e3,
                _ => return Err(bad(p, "a decode point measures output_tok_s or itl_ms")),
            }
        }
    };
    let rate_metric = matches!(p.metric, Metric::OutputTokS | Metric::InputTokS);
    Ok(match (p.per, rate_metric) {
        (_, false) | (Per::Total, true) => total,
        (Per::Gpu, true) => total / gpus,
        (Per::Node, true) => total / gpus * 8.0,
    })
}

/// One point and what the model predicts for it.
#[derive(Clone, Debug, PartialEq)]
pub struct Checked {
    pub point: Point,
    pub predicted: f64,
}

impl Checked {
    /// Signed relative error of the prediction.
    pub fn error(&self) -> f64 {
        self.predicted / self.point.value - 1.0
    }
}

/// Predicts every built-in point with its profile from `profiles`;
/// refuses a profile fitted on a validation point.
pub fn check(
    catalog: &Catalog,
    calib: &Calibration,
    profiles: &[EngineProfile],
) -> Result<Vec<Checked>, ValidateError> {
    check_points(published()?.1, catalog, calib, profiles)
}

/// [`check`] for any points.
pub fn check_points(
    points: Vec<Point>,
    catalog: &Catalog,
    calib: &Calibration,
    profiles: &[EngineProfile],
) -> Result<Vec<Checked>, ValidateError> {
    let mut out = Vec::new();
    for point in points {
        let profile = profiles
            .iter()
            .find(|x| x.name == point.profile)
            .ok_or_else(|| bad(&point, format!("unknown profile {:?}", point.profile)))?;
        if point.set == Set::Validate && profile.fitted_on.contains(&point.id) {
            return Err(ValidateError::FittedOnValidation {
                profile: profile.name.clone(),
                id: point.id,
            });
        }
        let predicted = predict(&point, catalog, calib, profile)?;
        out.push(Checked { point, predicted });
    }
    Ok(out)
}

/// Median absolute error and the share within 15% of `checked`.
pub fn summary(checked: &[&Checked]) -> (f64, f64) {
    if checked.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let mut e: Vec<f64> = checked.iter().map(|c| c.error().abs()).collect();
    e.sort_by(f64::total_cmp);
    let median = if e.len() % 2 == 1 {
        e[e.len() / 2]
    } else {
        (e[e.len() / 2 - 1] + e[e.len() / 2]) / 2.0
    };
    let within = e.iter().filter(|x| **x <= 0.15).count() as f64 / e.len() as f64;
    (median, within)
}

fn kind_name(k: Kind) -> &'static str {
    match k {
        Kind::Static => "static",
        Kind::MaxThroughput => "offline max",
        Kind::Online => "online",
        Kind::Burst => "burst",
        Kind::Prefill => "prefill",
        Kind::Decode => "decode",
    }
}

fn metric_name(m: Metric) -> &'static str {
    match m {
        Metric::OutputTokS => "output tok/s",
        Metric::InputTokS => "input tok/s",
        Metric::TtftMs => "TTFT ms",
        Metric::ItlMs => "ITL ms",
    }
}

/// One set's table in Markdown (the crate README carries its output).
pub fn markdown(checked: &[&Checked]) -> String {
    let mut s = String::from(
        "| id | source | engine | model | GPU | layout | ISL/OSL | kind | load | metric | published | predicted | error |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for c in checked {
        let p = &c.point;
        let layout = match p.layout {
            LayoutKind::Tp => format!("tp{}", p.tp),
            LayoutKind::TpEp => format!("tp{}ep", p.tp),
            LayoutKind::Dep => format!("dep{}", p.tp),
        };
        let load = match p.kind {
            Kind::Static | Kind::Decode => format!("b{}", p.batch.unwrap_or(0.0)),
            Kind::Online => format!("{} req/s", p.rate.unwrap_or(0.0)),
            Kind::Burst => format!(
                "{} at {} req/s",
                p.prompts.unwrap_or(0.0),
                p.rate.unwrap_or(0.0)
            ),
            Kind::Prefill => format!("{} tok/GPU", p.tokens_per_gpu.unwrap_or(0.0)),
            Kind::MaxThroughput => "all at once".into(),
        };
        let per = match p.per {
            Per::Total => "",
            Per::Gpu => " per GPU",
            Per::Node => " per node",
        };
        s += &format!(
            "| {} | {} | {} | {} | {} | {} {} | {}/{} | {} | {} | {}{} | {} | {} | {:+.0}% |\n",
            p.id,
            p.source,
            p.profile,
            p.model,
            p.gpu,
            layout,
            p.weights,
            p.isl,
            p.osl,
            kind_name(p.kind),
            load,
            metric_name(p.metric),
            per,
            fmt(p.value),
            fmt(c.predicted),
            c.error() * 100.0
        );
    }
    s
}

fn fmt(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// The sources in Markdown: id, engine and version, what, link.
pub fn sources_markdown() -> Result<String, ValidateError> {
    let (sources, _) = published()?;
    let mut s = String::from("| source | engine | what | link |\n|---|---|---|---|\n");
    for x in sources {
        s += &format!(
            "| {} | {} {} | {} | {} |\n",
            x.id, x.engine, x.version, x.what, x.url
        );
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calib::H200_JSON;
    use crate::engines;

    fn run() -> Vec<Checked> {
        let c = Catalog::builtin().unwrap();
        let cal = Calibration::parse(H200_JSON, c.gpu("H200").unwrap()).unwrap();
        let profiles = engines::profiles(&cal).unwrap();
        check(&c, &cal, &profiles).unwrap()
    }

    #[test]
    fn every_point_is_predicted_and_the_sets_never_overlap() {
        let checked = run();
        let (sources, points) = published().unwrap();
        assert_eq!(checked.len(), points.len());
        assert!(checked
            .iter()
            .all(|c| c.predicted.is_finite() && c.predicted > 0.0));
        // Every source is used, and every fitted-on id is a fit point.
        for s in &sources {
            assert!(points.iter().any(|p| p.source == s.id), "{}", s.id);
        }
        let c = Catalog::builtin().unwrap();
        let cal = Calibration::parse(H200_JSON, c.gpu("H200").unwrap()).unwrap();
        for prof in engines::profiles(&cal).unwrap() {
            for id in &prof.fitted_on {
                let p = points.iter().find(|p| &p.id == id).expect(id);
                assert_eq!(p.set, Set::Fit, "{id}");
                assert_eq!(p.profile, prof.name, "{id}");
            }
        }
    }

    #[test]
    fn the_validation_set_spans_engines_gpus_and_modes_within_its_errors() {
        let checked = run();
        let v: Vec<&Checked> = checked
            .iter()
            .filter(|c| c.point.set == Set::Validate)
            .collect();
        assert!(v.len() >= 20, "{}", v.len());
        let c = Catalog::builtin().unwrap();
        let (sources, _) = published().unwrap();
        let engine = |x: &Checked| {
            sources
                .iter()
                .find(|s| s.id == x.point.source)
                .unwrap()
                .engine
                .clone()
        };
        for e in ["trtllm", "vllm", "sglang"] {
            assert!(v.iter().any(|x| engine(x) == e), "{e}");
        }
        for g in ["H100", "H200"] {
            assert!(v.iter().any(|x| x.point.gpu == g), "{g}");
        }
        let moe = |x: &&Checked| c.model(&x.point.model).unwrap().moe.is_some();
        assert!(v.iter().any(moe) && !v.iter().all(moe));
        let online = |x: &&Checked| matches!(x.point.kind, Kind::Online | Kind::Burst);
        assert!(v.iter().any(online) && !v.iter().all(online));
        // The errors the README states (`--example validate`): median
        // within 10% (the target, met; 7.5%); 80% of figures within
        // 15% (41 of 51), the target, met with no margin (see the
        // README's "Where it misses").
        let (median, within) = summary(&v);
        assert!(median <= 0.10, "{median}\n{}", markdown(&v));
        assert!(within >= 0.80, "{within}\n{}", markdown(&v));
    }

    #[test]
    fn the_readme_carries_every_row_as_predicted_now() {
        let readme = include_str!("../README.md");
        for c in run() {
            let table = markdown(&[&c]);
            let row = table.lines().nth(2).unwrap();
            assert!(
                readme.contains(row),
                "README is stale: rerun `cargo run -p dynamo-configurator --example validate`; missing {row}"
            );
        }
    }

    /// Median absolute error and share within 15% of `points`, predicted
    /// with the built-in profiles.
    fn summary_of(points: Vec<Point>) -> (f64, f64) {
        let c = Catalog::builtin().unwrap();
        let cal = Calibration::parse(H200_JSON, c.gpu("H200").unwrap()).unwrap();
        let profiles = engines::profiles(&cal).unwrap();
        let checked = check_points(points, &c, &cal, &profiles).unwrap();
        summary(&checked.iter().collect::<Vec<_>>())
    }

    #[test]
    fn the_whole_trtllm_0_17_table_holds_its_floor() {
        // All 187 H100/H200 rows of the table the `t17-*` figures come
        // from (README, "The whole TensorRT-LLM 0.17 table"); its 11
        // fitting rows among them.
        let (_, points) = parse(include_str!("../data/trtllm-0.17-table.toml")).unwrap();
        assert_eq!(points.len(), 187);
        let (median, within) = summary_of(points);
        // Now 5.3% and 92%; before the decode-attention arithmetic bound,
        // the measured bus bandwidth at TP 2 and 4, and the prior weighed
        // against the summed error, 8.0% and 79%.
        assert!(median <= 0.06 && within >= 0.90, "{median} {within}");
    }

    #[test]
    fn the_blind_trtllm_1_0_rows_hold_their_floor() {
        // The 64 rows of TensorRT-LLM 1.0's table that were never used
        // before their first prediction (README, "A blind check"): 89%
        // within 15%, median 5.2%, when added. The other 13 are the
        // `t10-*` figures, `t10t-01` … `t10t-14` here.
        let (_, points) = parse(include_str!("../data/trtllm-1.0-table.toml")).unwrap();
        assert_eq!(points.len(), 77);
        let published = |p: &Point| {
            let rest = p.id.trim_start_matches("t10t-");
            rest.len() == 2 && rest.chars().all(|c| c.is_ascii_digit())
        };
        let blind: Vec<Point> = points.into_iter().filter(|p| !published(p)).collect();
        assert_eq!(blind.len(), 64);
        let (median, within) = summary_of(blind);
        assert!(median <= 0.06 && within >= 0.85, "{median} {within}");
    }

    #[test]
    fn a_profile_fitted_on_a_validation_point_is_refused() {
        let c = Catalog::builtin().unwrap();
        let cal = Calibration::parse(H200_JSON, c.gpu("H200").unwrap()).unwrap();
        let mut profiles = engines::profiles(&cal).unwrap();
        let (_, points) = published().unwrap();
        let v = points.iter().find(|p| p.set == Set::Validate).unwrap();
        let prof = profiles.iter_mut().find(|x| x.name == v.profile).unwrap();
        prof.fitted_on.push(v.id.clone());
        let e = check(&c, &cal, &profiles).unwrap_err();
        assert!(matches!(e, ValidateError::FittedOnValidation { .. }), "{e}");
    }
}
