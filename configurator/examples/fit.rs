//! Fits each engine profile's constants to its fitting-set figures
//! (`set = "fit"` in `data/published.toml`) and prints them as
//! `data/engines.toml` lines, with the figures they were fitted on.
//!
//! `cargo run --release -p dynamo-configurator --example fit [--write] [PROFILE…]`
//!
//! `--write` puts the fitted constants into `configurator/data/engines.toml`.

use dynamo_configurator::{calib, engines, fit, Calibration, Catalog};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let c = Catalog::builtin()?;
    let cal = Calibration::parse(calib::H200_JSON, c.gpu("H200")?)?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let write = args.iter().any(|a| a == "--write");
    let only: Vec<&String> = args.iter().filter(|a| *a != "--write").collect();
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/data/engines.toml");
    let mut text = std::fs::read_to_string(path)?;
    for profile in engines::profiles(&cal)? {
        if !only.is_empty() && !only.contains(&&profile.name) {
            continue;
        }
        let Some(f) = fit::fit(&c, &cal, &profile)? else {
            continue;
        };
        println!(
            "# {}: {} figures, RMS log error {:.3} → {:.3}, fitted: {}",
            profile.name,
            f.points.len(),
            f.before,
            f.after,
            f.free.join(", ")
        );
        println!("{}", fit::toml_lines(&f));
        text = fit::rewrite(&text, &f);
    }
    if write {
        std::fs::write(path, text)?;
        println!("wrote {path}");
    }
    Ok(())
}
