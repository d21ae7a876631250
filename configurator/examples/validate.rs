//! Prints the validation tables of the crate README: the sources, the
//! fitting set and the validation set of published figures, each with the
//! configurator's prediction, and the validation set's summary.
//!
//! `cargo run -p dynamo-configurator --example validate [-- --points FILE]`
//!
//! With `--points FILE` (figures in `data/published.toml`'s format, for
//! example your own measurements), prints those figures' predictions and
//! their summary instead.

use dynamo_configurator::validate::{self, Set};
use dynamo_configurator::{calib, engines, Calibration, Catalog};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let c = Catalog::builtin()?;
    let cal = Calibration::parse(calib::H200_JSON, c.gpu("H200")?)?;
    let profiles = engines::profiles(&cal)?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(i) = args.iter().position(|a| a == "--points") {
        let path = args.get(i + 1).ok_or("--points needs a file")?;
        let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
        let (_, points) = validate::parse(&text)?;
        let checked = validate::check_points(points, &c, &cal, &profiles)?;
        let rows: Vec<_> = checked.iter().collect();
        let (median, within) = validate::summary(&rows);
        println!("{}", validate::markdown(&rows));
        println!(
            "{} figures: median absolute error {:.1}%, {:.0}% within 15%",
            rows.len(),
            median * 100.0,
            within * 100.0
        );
        return Ok(());
    }
    let checked = validate::check(&c, &cal, &profiles)?;
    println!("### Sources\n\n{}", validate::sources_markdown()?);
    for (set, title) in [(Set::Fit, "Fitting set"), (Set::Validate, "Validation set")] {
        let rows: Vec<_> = checked.iter().filter(|x| x.point.set == set).collect();
        let (median, within) = validate::summary(&rows);
        println!(
            "### {title} ({} figures)\n\n{}",
            rows.len(),
            validate::markdown(&rows)
        );
        println!(
            "{title}: median absolute error {:.1}%, {:.0}% of figures within 15%\n",
            median * 100.0,
            within * 100.0
        );
        if set == Set::Validate {
            // Without the TensorRT-LLM 0.5.0 tables the configurator was
            // first built against.
            let newer: Vec<_> = rows
                .iter()
                .copied()
                .filter(|x| x.point.profile != "trtllm-0.5")
                .collect();
            let (median, within) = validate::summary(&newer);
            println!(
                "{title} without the TensorRT-LLM 0.5.0 figures ({}): median absolute error {:.1}%, {:.0}% within 15%\n",
                newer.len(),
                median * 100.0,
                within * 100.0
            );
        }
    }
    Ok(())
}
