//! Prints the validation table of the crate README: the step-time model's
//! predictions against published throughput.
//!
//! `cargo run -p dynamo-configurator --example validate`

use dynamo_configurator::{calib, validate, Calibration, Catalog};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let c = Catalog::builtin()?;
    let cal = Calibration::parse(calib::H200_JSON, c.gpu("H200")?)?;
    let checked = validate::check(&c, &cal)?;
    print!("{}", validate::markdown(&checked));
    let within = checked.iter().filter(|x| x.error().abs() <= 0.15).count();
    let mean = checked.iter().map(|x| x.error().abs()).sum::<f64>() / checked.len() as f64;
    println!(
        "\n{within} of {} points within 15%; mean absolute error {:.1}%",
        checked.len(),
        mean * 100.0
    );
    Ok(())
}
