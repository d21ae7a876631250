//! Presenting an [`Outcome`]: a text table (frontier and best per budget)
//! and a Pareto plot as a self-contained SVG.

use crate::search::{Candidate, Outcome};
use std::fmt::Write;

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
    fn ticks_are_round() {
        assert_eq!(tick_step(1000.0, 8.0), 200.0);
        assert_eq!(tick_step(73.0, 8.0), 10.0);
        assert_eq!(tick_step(0.9, 8.0), 0.2);
    }
}
