//! Time to land a model file in GPU memory (feature `cuda`; BENCHMARKS.md,
//! "Weights"): a verified load from a peer over `tcp;ofi_rxm` into
//! registered host memory, then the copy to the device, for a 98 MB and a
//! 2 GiB file of pseudo-random bytes. `scripts/gpu_checks.sh` runs it on a
//! GPU machine.
//!
//! `cargo run --release -p dynamo-weights --features cuda --example device_weights`

use dynamo_weights::{load, manifest, DeviceWeights, LoadOptions, Source, WeightServer};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

fn synthetic(dir: &Path, bytes: usize) -> PathBuf {
    let path = dir.join(format!("synthetic-{bytes}.bin"));
    let mut f = std::fs::File::create(&path).expect("create");
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut block = vec![0u8; 1 << 20];
    let mut left = bytes;
    while left > 0 {
        for w in block.chunks_exact_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            w.copy_from_slice(&x.to_le_bytes());
        }
        let n = left.min(block.len());
        f.write_all(&block[..n]).expect("write");
        left -= n;
    }
    f.sync_all().expect("sync");
    path
}

fn report(what: &str, size: u64, secs: f64) {
    println!(
        "| {:.0} MB | {what} | {secs:.3} s | {:.2} GB/s |",
        size as f64 / 1e6,
        size as f64 / 1e9 / secs
    );
}

fn main() {
    let ctx = dynamo_transfer::open_gpu(0).unwrap_or_else(|e| {
        eprintln!("device_weights: {e}");
        std::process::exit(1);
    });
    let tmp = tempfile::tempdir().expect("tempdir");
    let provider = "tcp;ofi_rxm";
    println!("| size | step | time | rate |\n|---|---|---|---|");
    for bytes in [98_362_432usize, 2 << 30] {
        let path = synthetic(tmp.path(), bytes);
        let m = manifest::of_file(&path, "bench", "gguf").expect("manifest");
        let server = WeightServer::from_file(&path, m.clone(), provider).expect("serve");
        let opts = LoadOptions {
            provider: provider.into(),
            ..LoadOptions::default()
        };
        let peer = vec![Source::Peer(
            server.descriptor().source("peer").expect("address"),
        )];
        let t = Instant::now();
        let loaded = load(&m, peer, &opts, None, &mut |_| {}).expect("peer load");
        let host = t.elapsed().as_secs_f64();
        let d = DeviceWeights::land(&loaded, &ctx, &mut |_, _| {}).expect("land");
        let total = t.elapsed().as_secs_f64();
        d.verify().expect("the device copy matches its hash");
        report(
            &format!("peer over `{provider}` → host memory, verified"),
            m.size,
            host,
        );
        report(
            &format!(
                "host → device ({})",
                if d.pinned { "page-locked" } else { "pageable" }
            ),
            m.size,
            d.elapsed.as_secs_f64(),
        );
        report("peer → device, in all", m.size, total);
    }
}
