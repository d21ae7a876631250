//! Presenting an [`Outcome`]: a text table (frontier and best per budget)
//! and a Pareto plot as a self-contained SVG.

use crate::perf::{Step, StepModel, StepTime};
use crate::search::{Candidate, Layout, Mode, Outcome, Query};
use serde::Serialize;
use std::fmt::Write;

/// One step of the chosen deployment and where its time goes.
#[derive(Clone, Debug, Serialize)]
pub struct Explained {
    /// What the step computes.
    pub step: String,
    pub gemm_ms: f64,
    pub attention_ms: f64,
    pub comm_ms: f64,
    pub other_ms: f64,
    pub total_ms: f64,
}

impl Explained {
    fn new(step: String, t: StepTime) -> Self {
        Explained {
            step,
            gemm_ms: t.gemm / 1e3,
            attention_ms: t.attention / 1e3,
            comm_ms: t.comm / 1e3,
            other_ms: t.other / 1e3,
            total_ms: t.total() / 1e3,
        }
    }
}

/// The step-time breakdown of `c`: its decode step at its batch (with the
/// prompt tokens an aggregated step carries) and a prefill step of its
/// prompts. `sm` builds the step model of a layout.
pub fn explain<'a>(
    c: &Candidate,
    q: &Query,
    sm: impl Fn(&Layout) -> StepModel<'a>,
) -> Vec<Explained> {
    let (isl, osl) = (q.isl as f64, q.osl as f64);
    let ctx = isl + osl / 2.0;
    match &c.mode {
        Mode::Aggregated { layout, batch, .. } => {
            let b = *batch as f64;
            let m = sm(layout);
            vec![
                Explained::new(
                    format!(
                        "average step: {batch} decoding at {ctx:.0} tokens of context, {:.0} prompt tokens",
                        b * isl / osl
                    ),
                    m.step(&Step {
                        decode: b,
                        decode_ctx: ctx,
                        prefill: b * isl / osl,
                        prefill_seqs: b / osl,
                        prefill_past: 0.0,
                    }),
                ),
                Explained::new(
                    format!("prefill of one {isl:.0}-token prompt alone"),
                    m.step(&Step {
                        prefill: isl,
                        prefill_seqs: 1.0,
                        ..Step::default()
                    }),
                ),
            ]
        }
        Mode::Disaggregated {
            prefill,
            prefill_batch,
            decode,
            batch,
            ..
        } => {
            let n = *prefill_batch as f64;
            vec![
                Explained::new(
                    format!("prefill step: {prefill_batch} prompts of {isl:.0} tokens"),
                    sm(prefill).step(&Step {
                        prefill: n * isl,
                        prefill_seqs: n,
                        ..Step::default()
                    }),
                ),
                Explained::new(
                    format!("decode step: {batch} decoding at {ctx:.0} tokens of context"),
                    sm(decode).step(&Step {
                        decode: *batch as f64,
                        decode_ctx: ctx,
                        ..Step::default()
                    }),
                ),
            ]
        }
    }
}

/// The breakdown as text, one block per step with shares.
pub fn explain_table(c: &Candidate, steps: &[Explained]) -> String {
    let mut out = format!(
        "Step time of {}:
",
        c.label()
    );
    for e in steps {
        let _ = writeln!(out, "  {} — {:.2} ms", e.step, e.total_ms);
        for (name, ms) in [
            ("GEMM", e.gemm_ms),
            ("attention", e.attention_ms),
            ("communication", e.comm_ms),
            ("overhead", e.other_ms),
        ] {
            let share = if e.total_ms > 0.0 {
                ms / e.total_ms * 100.0
            } else {
                0.0
            };
            let _ = writeln!(out, "    {name:<14} {ms:>9.2} ms  {share:>5.1}%");
        }
    }
    out
}

fn row(out: &mut String, c: &Candidate) {
    let _ = writeln!(
        out,
        "{:<36} {:>5} {:>9.0} {:>8.1} {:>11.1} {:>10.0}",
        c.label(),
        c.gpus,
        c.ttft_ms,
        c.itl_ms,
        c.tokens_per_s_per_user,
        c.tokens_per_s_per_gpu
    );
}

fn header(out: &mut String) {
    let _ = writeln!(
        out,
        "{:<36} {:>5} {:>9} {:>8} {:>11} {:>10}",
        "deployment", "GPUs", "TTFT ms", "ITL ms", "tok/s/user", "tok/s/GPU"
    );
}

/// The Pareto frontier (fastest per user first) and the best deployment
/// for each GPU budget.
pub fn table(o: &Outcome) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} deployments evaluated, {} meet the SLA.\n\nPareto frontier (tokens/s per user against tokens/s per GPU):",
        o.evaluated,
        o.feasible.len()
    );
    header(&mut out);
    for c in &o.frontier {
        row(&mut out, c);
    }
    let _ = writeln!(
        out,
        "\nBest deployment per GPU budget (most tokens/s within the budget):"
    );
    let _ = writeln!(out, "{:>6}  {:>10}  deployment", "budget", "tok/s");
    for (b, c) in &o.best_per_budget {
        let _ = writeln!(out, "{b:>6}  {:>10.0}  {}", c.tokens_per_s(), c.label());
    }
    out
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A round step for about `n` ticks over `[0, max]`.
fn tick_step(max: f64, n: f64) -> f64 {
    let raw = (max / n).max(f64::MIN_POSITIVE);
    let mag = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag)
}

/// About 8 round tick values over `[0, max]` (multiples of the step, so
/// labels carry no accumulated rounding).
fn ticks(max: f64) -> impl Iterator<Item = f64> {
    let step = tick_step(max, 8.0);
    (0..)
        .map(move |i| i as f64 * step)
        .take_while(move |v| *v <= max)
}

/// Feasible deployments as points (aggregated and disaggregated in two
/// colours) with the frontier drawn through its points and labelled.
pub fn svg(o: &Outcome, title: &str) -> String {
    let (w, h, l, r, t, b) = (820.0, 560.0, 80.0, 30.0, 50.0, 60.0);
    let xmax = o
        .feasible
        .iter()
        .map(|c| c.tokens_per_s_per_user)
        .fold(1.0, f64::max)
        * 1.05;
    let ymax = o
        .feasible
        .iter()
        .map(|c| c.tokens_per_s_per_gpu)
        .fold(1.0, f64::max)
        * 1.1;
    let x = |v: f64| l + v / xmax * (w - l - r);
    let y = |v: f64| h - b - v / ymax * (h - t - b);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="24" text-anchor="middle" font-size="15">{}</text>"#,
        w / 2.0,
        esc(title)
    );
    // Axes and ticks.
    let _ = writeln!(
        s,
        r#"<line x1="{l}" y1="{}" x2="{}" y2="{}" stroke="black"/><line x1="{l}" y1="{t}" x2="{l}" y2="{}" stroke="black"/>"#,
        h - b,
        w - r,
        h - b,
        h - b
    );
    for v in ticks(xmax) {
        let _ = writeln!(
            s,
            r##"<line x1="{0}" y1="{1}" x2="{0}" y2="{2}" stroke="#ddd"/><text x="{0}" y="{3}" text-anchor="middle">{4}</text>"##,
            x(v),
            t,
            h - b,
            h - b + 16.0,
            v
        );
    }
    for v in ticks(ymax) {
        let _ = writeln!(
            s,
            r##"<line x1="{0}" y1="{1}" x2="{2}" y2="{1}" stroke="#ddd"/><text x="{3}" y="{4}" text-anchor="end">{5}</text>"##,
            l,
            y(v),
            w - r,
            l - 6.0,
            y(v) + 4.0,
            v
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">output tokens/s per user (1000 / ITL ms)</text>"#,
        (l + w - r) / 2.0,
        h - 18.0
    );
    let _ = writeln!(
        s,
        r#"<text x="18" y="{0}" text-anchor="middle" transform="rotate(-90 18 {0})">output tokens/s per GPU</text>"#,
        (t + h - b) / 2.0
    );
    // Points.
    for c in &o.feasible {
        let colour = match c.mode {
            crate::search::Mode::Aggregated { .. } => "#1f77b4",
            crate::search::Mode::Disaggregated { .. } => "#ff7f0e",
        };
        let _ = writeln!(
            s,
            r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{colour}" fill-opacity="0.45"><title>{}</title></circle>"#,
            x(c.tokens_per_s_per_user),
            y(c.tokens_per_s_per_gpu),
            esc(&c.label())
        );
    }
    // Frontier.
    let pts: Vec<String> = o
        .frontier
        .iter()
        .map(|c| {
            format!(
                "{:.1},{:.1}",
                x(c.tokens_per_s_per_user),
                y(c.tokens_per_s_per_gpu)
            )
        })
        .collect();
    let _ = writeln!(
        s,
        r#"<polyline points="{}" fill="none" stroke="black" stroke-width="1.5"/>"#,
        pts.join(" ")
    );
    for c in &o.frontier {
        // Labels sit right of their point, or left of it near the right edge.
        let (cx, cy) = (x(c.tokens_per_s_per_user), y(c.tokens_per_s_per_gpu));
        let (lx, anchor) = if cx > l + 0.6 * (w - l - r) {
            (cx - 6.0, "end")
        } else {
            (cx + 6.0, "start")
        };
        let _ = writeln!(
            s,
            r#"<circle cx="{cx:.1}" cy="{cy:.1}" r="4" fill="black"/><text x="{lx:.1}" y="{:.1}" font-size="10" text-anchor="{anchor}">{}</text>"#,
            cy - 6.0,
            esc(&c.label())
        );
    }
    let _ = writeln!(
        s,
        r##"<circle cx="{0}" cy="{1}" r="4" fill="#1f77b4"/><text x="{2}" y="{3}">aggregated</text><circle cx="{0}" cy="{4}" r="4" fill="#ff7f0e"/><text x="{2}" y="{5}">disaggregated</text>"##,
        l + 14.0,
        h - b - 34.0,
        l + 24.0,
        h - b - 30.0,
        h - b - 16.0,
        h - b - 12.0
    );
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calib::{Calibration, H200_JSON};
    use crate::search::{search, Query};
    use crate::{Catalog, EngineProfile};

    #[test]
    fn table_and_plot_show_the_frontier() {
        let c = Catalog::builtin().unwrap();
        let g = c.gpu("H100").unwrap();
        let cal = Calibration::parse(H200_JSON, c.gpu("H200").unwrap()).unwrap();
        let q = Query::new(g, 8, 1000, 200, 1000.0, 30.0);
        let o = search(
            c.model("Llama-3.1-8B").unwrap(),
            g,
            &cal,
            &EngineProfile::current(&cal),
            &q,
        )
        .unwrap();
        let t = table(&o);
        assert!(t.contains("Pareto frontier"));
        assert!(t.contains(&o.frontier[0].label()), "{t}");
        assert_eq!(t.matches("\n     8  ").count(), 1, "{t}");
        let s = svg(&o, "Llama-3.1-8B on 8 × H100");
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        assert_eq!(s.matches("<polyline").count(), 1);
        assert_eq!(s.matches(r#"r="3""#).count(), o.feasible.len());
        assert!(s.contains("8 × H100"));
    }

    #[test]
    fn explain_breaks_the_chosen_steps_into_their_parts() {
        let c = Catalog::builtin().unwrap();
        let g = c.gpu("H200").unwrap();
        let cal = Calibration::parse(H200_JSON, g).unwrap();
        let prof = EngineProfile::current(&cal);
        let m = c.model("Llama-3.1-70B").unwrap();
        let q = Query::new(g, 8, 2000, 500, 2000.0, 40.0);
        let o = search(m, g, &cal, &prof, &q).unwrap();
        for (_, best) in &o.best_per_budget {
            let steps = explain(best, &q, |l| StepModel {
                model: m,
                gpu: g,
                deployment: crate::memory::Deployment {
                    tp: l.tp,
                    pp: l.pp,
                    weights: q.weights,
                    kv: q.kv,
                    memory: prof.memory,
                    expert_parallel: l.ep,
                    dp_attention: l.dpa,
                    overlap: l.dpa,
                },
                calib: &cal,
                profile: prof.clone(),
            });
            assert_eq!(steps.len(), 2);
            for e in &steps {
                let parts = e.gemm_ms + e.attention_ms + e.comm_ms + e.other_ms;
                assert!(
                    (parts - e.total_ms).abs() < 1e-9 && e.total_ms > 0.0,
                    "{e:?}"
                );
                assert!(e.gemm_ms > 0.0);
            }
            // The decode step the table reports is the one explained.
            let decode = match &best.mode {
                Mode::Aggregated { .. } => &steps[0],
                Mode::Disaggregated { .. } => &steps[1],
            };
            assert!(
                (decode.total_ms - best.itl_ms).abs() < 1e-6 * best.itl_ms.max(1.0),
                "{decode:?} vs {best:?}"
            );
            let text = explain_table(best, &steps);
            assert!(
                text.contains("communication") && text.contains(&best.label()),
                "{text}"
            );
        }
    }

    #[test]
    fn ticks_are_round() {
        assert_eq!(tick_step(1000.0, 8.0), 200.0);
        assert_eq!(tick_step(73.0, 8.0), 10.0);
        assert_eq!(tick_step(0.9, 8.0), 0.2);
    }
}
