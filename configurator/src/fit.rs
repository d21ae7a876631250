//! Fitting an engine profile's constants to its fitting-set figures.
//!
//! The fitted constants are the fixed cost of a step, the synchronisation
//! cost of a collective, the GEMM and attention time scales, the rate of
//! decode attention's arithmetic, and the serving overhead of an online
//! request. The objective is the mean squared log error over the
//! profile's `set = "fit"` points plus a prior that keeps each constant
//! near its unfitted value (scales near 1, costs near a typical size)
//! unless the figures pull it away. The prior weighs as one figure's
//! error of 10% per unit of its width: divided by the number of figures,
//! so that more figures pull harder, as in a maximum a posteriori fit
//! with a fixed noise per figure. And no more constants
//! are freed than the figures can pin (one fewer than the figures, in a
//! fixed order), the rest keeping their unfitted values. With a handful of
//! figures and eight constants, an unpenalised fit would match them
//! exactly with nonsense. The search is a coordinate descent with shrinking steps,
//! in physical ranges, from the unfitted values (and, for the decode-attention
//! arithmetic bound, which is flat at 0, from two further values). Deterministic: the same
//! data give the same constants.
//!
//! Invariants: only fit points of the profile are read; every constant
//! stays in the range `engines` accepts.

use crate::calib::Calibration;
use crate::engines::EngineProfile;
use crate::spec::Catalog;
use crate::validate::{predict, published, Point, Set, ValidateError};

/// A fitted profile and how well it fits.
#[derive(Clone, Debug)]
pub struct Fitted {
    pub profile: EngineProfile,
    pub points: Vec<String>,
    /// The constants fitted (the others keep their unfitted values).
    pub free: Vec<String>,
    /// Root-mean-square log error before and after.
    pub before: f64,
    pub after: f64,
}

type Get = fn(&EngineProfile) -> f64;
type Put = fn(&mut EngineProfile, f64);

/// The fitted constants: name, getter, setter, range, and the prior's
/// centre and width (a scale's or ratio's width in log units, a cost's in
/// its unit).
const PARAMS: [(&str, Get, Put, f64, f64, f64, f64); 10] = [
    ("skew", |p| p.skew, |p, v| p.skew = v, 0.0, 0.5, 0.0, 0.05),
    (
        "step_us",
        |p| p.step_us,
        |p, v| p.step_us = v,
        0.0,
        2000.0,
        150.0,
        500.0,
    ),
    (
        "seq_us",
        |p| p.seq_us,
        |p, v| p.seq_us = v,
        0.0,
        50.0,
        0.0,
        5.0,
    ),
    (
        "sync_us",
        |p| p.sync_us,
        |p, v| p.sync_us = v,
        0.0,
        50.0,
        0.0,
        20.0,
    ),
    (
        "gemm_scale",
        |p| p.gemm_scale,
        |p, v| p.gemm_scale = v,
        0.5,
        2.0,
        1.0,
        0.2,
    ),
    (
        "gemm_bw_ratio",
        |p| p.gemm_bw_ratio,
        |p, v| p.gemm_bw_ratio = v,
        0.5,
        2.0,
        1.0,
        0.2,
    ),
    (
        "moe_scale",
        |p| p.moe_scale,
        |p, v| p.moe_scale = v,
        0.5,
        3.0,
        1.0,
        1.0,
    ),
    (
        "attention_scale",
        |p| p.attention_scale,
        |p, v| p.attention_scale = v,
        0.5,
        3.0,
        1.0,
        0.3,
    ),
    (
        "decode_attention_fp32",
        |p| p.decode_attention_fp32,
        |p, v| p.decode_attention_fp32 = v,
        0.0,
        10.0,
        0.0,
        5.0,
    ),
    (
        "serving_ms",
        |p| p.serving_ms,
        |p, v| p.serving_ms = v,
        0.0,
        300.0,
        10.0,
        30.0,
    ),
];

/// The constants in the order they are freed as figures allow.
const ORDER: [&str; 10] = [
    "serving_ms",
    "gemm_scale",
    "moe_scale",
    "step_us",
    "attention_scale",
    "decode_attention_fp32",
    "seq_us",
    "sync_us",
    "skew",
    "gemm_bw_ratio",
];

/// Weight of the prior against the summed squared log error: (10%)², the
/// noise assumed of one published figure.
const PRIOR: f64 = 0.01;

fn prior(p: &EngineProfile) -> f64 {
    PARAMS
        .iter()
        .map(|(name, get, _, _, _, centre, width)| {
            let v = get(p);
            let z = if name.ends_with("scale") || name.ends_with("ratio") {
                (v / centre).ln() / width
            } else {
                (v - centre) / width
            };
            z * z
        })
        .sum::<f64>()
        * PRIOR
}

fn loss(
    c: &Catalog,
    cal: &Calibration,
    p: &EngineProfile,
    points: &[Point],
) -> Result<f64, ValidateError> {
    let mut sum = 0.0;
    for pt in points {
        // A saturated prediction counts as a large miss, not an error:
        // the search moves away from it.
        let e = match predict(pt, c, cal, p) {
            Ok(v) => (v / pt.value).ln(),
            Err(ValidateError::Point { .. }) => 3.0,
            Err(e) => return Err(e),
        };
        sum += e * e;
    }
    Ok((sum / points.len() as f64).sqrt())
}

fn objective(
    c: &Catalog,
    cal: &Calibration,
    p: &EngineProfile,
    points: &[Point],
) -> Result<f64, ValidateError> {
    let l = loss(c, cal, p, points)?;
    // Σe²/n + prior/n: the prior against the summed error, scaled by n.
    Ok(l * l + prior(p) / points.len() as f64)
}

/// Fits `profile` to its fitting set; None when it has no fit points.
pub fn fit(
    c: &Catalog,
    cal: &Calibration,
    profile: &EngineProfile,
) -> Result<Option<Fitted>, ValidateError> {
    let (_, all) = published()?;
    let points: Vec<Point> = all
        .into_iter()
        .filter(|p| p.set == Set::Fit && p.profile == profile.name)
        .collect();
    if points.is_empty() {
        return Ok(None);
    }
    // Online overhead is visible only in TTFT figures, the MoE scale only
    // on MoE models.
    let has_ttft = points
        .iter()
        .any(|p| p.metric == crate::validate::Metric::TtftMs);
    let has_moe = points
        .iter()
        .any(|p| c.model(&p.model).is_ok_and(|m| m.moe.is_some()));
    // Start from the unfitted values.
    let mut best = profile.clone();
    for (_, _, put, _, _, centre, _) in PARAMS {
        put(&mut best, centre);
    }
    // No more constants than the figures can pin (one fewer than there
    // are figures, at least one), in order of how broadly they act; the
    // rest stay at their unfitted values.
    let free: Vec<&str> = ORDER
        .iter()
        .copied()
        .filter(|n| (*n != "serving_ms" || has_ttft) && (*n != "moe_scale" || has_moe))
        .take(points.len().saturating_sub(1).max(1))
        .collect();
    let before = loss(c, cal, &best, &points)?;
    // The arithmetic bound of decode attention changes nothing until it
    // passes the KV read, so a descent from 0 never sees it: where it is
    // free, the descent also starts from two values past that point, and
    // the best end wins.
    let mut starts = vec![best.clone()];
    if free.contains(&"decode_attention_fp32") {
        for v in ARITHMETIC_STARTS {
            let mut s = best.clone();
            s.decode_attention_fp32 = v;
            starts.push(s);
        }
    }
    let mut best_obj = f64::INFINITY;
    for start in starts {
        let (p, o) = descend(c, cal, start, &points, &free)?;
        if o < best_obj - 1e-12 {
            best = p;
            best_obj = o;
        }
    }
    let ids: Vec<String> = points.iter().map(|p| p.id.clone()).collect();
    best.fitted_on = ids.clone();
    let after = loss(c, cal, &best, &points)?;
    Ok(Some(Fitted {
        profile: best,
        points: ids,
        free: free.iter().map(|s| s.to_string()).collect(),
        before,
        after,
    }))
}

/// Further starts of the decode-attention arithmetic bound (see [`fit`]).
const ARITHMETIC_STARTS: [f64; 2] = [1.5, 3.0];

/// Coordinate descent with shrinking steps over the `free` constants from
/// `start`; the constants reached and their objective.
fn descend(
    c: &Catalog,
    cal: &Calibration,
    start: EngineProfile,
    points: &[Point],
    free: &[&str],
) -> Result<(EngineProfile, f64), ValidateError> {
    let mut best_obj = objective(c, cal, &start, points)?;
    let mut best = start;
    for round in 0..6 {
        let step = 0.5f64.powi(round);
        let mut improved = true;
        while improved {
            improved = false;
            for (name, get, put, lo, hi, _, _) in PARAMS {
                if !free.contains(&name) {
                    continue;
                }
                let v = get(&best);
                let span = (hi - lo) * 0.1 * step;
                for cand in [
                    v - span,
                    v + span,
                    v * (1.0 - 0.3 * step),
                    v * (1.0 + 0.3 * step),
                ] {
                    let cand = cand.clamp(lo, hi);
                    if cand == v {
                        continue;
                    }
                    let mut trial = best.clone();
                    put(&mut trial, cand);
                    let o = objective(c, cal, &trial, points)?;
                    if o < best_obj - 1e-9 {
                        best = trial;
                        best_obj = o;
                        improved = true;
                    }
                }
            }
        }
    }
    Ok((best, best_obj))
}

/// The fitted constants as `engines.toml` lines.
pub fn toml_lines(f: &Fitted) -> String {
    let p = &f.profile;
    let ids = f
        .points
        .iter()
        .map(|i| format!("\"{i}\""))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "skew = {:.3}\nsync_us = {:.1}\nstep_us = {:.0}\nseq_us = {:.2}\ngemm_scale = {:.3}\ngemm_bw_ratio = {:.3}\nmoe_scale = {:.3}\nattention_scale = {:.3}\ndecode_attention_fp32 = {:.3}\nserving_ms = {:.1}\nfitted_on = [{ids}]",
        p.skew, p.sync_us, p.step_us, p.seq_us, p.gemm_scale, p.gemm_bw_ratio, p.moe_scale, p.attention_scale, p.decode_attention_fp32, p.serving_ms
    )
}

/// `engines.toml` text with `f`'s constants written into its profile's
/// block: right after its `name` line, every fitted key (`fitted_on`
/// included), and the block's older lines of those keys dropped.
pub fn rewrite(text: &str, f: &Fitted) -> String {
    let lines = toml_lines(f);
    let key = |l: &str| l.split('=').next().unwrap_or("").trim().to_string();
    let fitted: Vec<String> = lines.lines().map(key).collect();
    let mut out = String::new();
    let mut in_block = false;
    for line in text.lines() {
        if line.starts_with("[[engine]]") {
            in_block = false;
        }
        if line.trim() == format!("name = \"{}\"", f.profile.name) {
            in_block = true;
            out += line;
            out.push('\n');
            out += &lines;
            out.push('\n');
            continue;
        }
        if in_block && fitted.contains(&key(line)) {
            continue;
        }
        out += line;
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calib::H200_JSON;
    use crate::engines;

    #[test]
    fn fitting_lowers_the_error_and_touches_only_its_profile() {
        let c = Catalog::builtin().unwrap();
        let cal = Calibration::parse(H200_JSON, c.gpu("H200").unwrap()).unwrap();
        let p = engines::profile("trtllm-1.0", &cal).unwrap();
        let f = fit(&c, &cal, &p).unwrap().unwrap();
        assert!(f.after < f.before, "{} → {}", f.before, f.after);
        assert!(
            f.points.iter().all(|id| id.starts_with("t10-")),
            "{:?}",
            f.points
        );
        let text = rewrite(engines::ENGINES_TOML, &f);
        let again = engines::parse(&text, &cal).unwrap();
        let q = again.iter().find(|x| x.name == "trtllm-1.0").unwrap();
        assert_eq!(q.fitted_on, f.points);
        assert!((q.step_us - f.profile.step_us).abs() < 1.0);
        let untouched = again.iter().find(|x| x.name == "current").unwrap();
        assert_eq!(untouched, &engines::profile("current", &cal).unwrap());
        // No validation point is ever fitted on.
        assert!(
            fit(&c, &cal, &engines::profile("trtllm-0.5", &cal).unwrap())
                .unwrap()
                .is_none()
        );
    }
}
