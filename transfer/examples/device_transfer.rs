//! 64 MiB from one GPU buffer to another through libfabric (feature
//! `cuda`; needs a GPU): device → page-locked staging → one-sided write →
//! staging → device, timed phase by phase, against the GPU's own
//! device-to-device copy. Debian's libfabric has no CUDA support, so the
//! staged path is what a worker here gets.
//!
//! `cargo run --release -p dynamo-transfer --features cuda --example device_transfer`

use dynamo_transfer::{Agent, DeviceRegion, Progress, WriteOp};
use std::time::{Duration, Instant};

const SIZE: usize = 64 << 20;
const RUNS: usize = 7;

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let ctx = match dynamo_transfer::open_gpu(0) {
        Ok(ctx) => ctx,
        Err(e) => {
            eprintln!("device_transfer needs a GPU: {e}");
            std::process::exit(1);
        }
    };
    println!("GPU: {}", ctx.name().unwrap_or_default());

    // Baseline: the GPU copying within itself.
    let stream = ctx.new_stream().unwrap();
    let a = stream.alloc_zeros::<u8>(SIZE).unwrap();
    let mut b = stream.alloc_zeros::<u8>(SIZE).unwrap();
    let mut d2d = Vec::new();
    for _ in 0..RUNS {
        let t = Instant::now();
        stream.memcpy_dtod(&a, &mut b).unwrap();
        stream.synchronize().unwrap();
        d2d.push(t.elapsed());
    }
    println!(
        "device-to-device copy (no fabric): {:.1} GB/s",
        gbps(SIZE, median(d2d))
    );

    println!("| provider | stage GB/s | write GB/s | land GB/s | end to end GB/s |");
    println!("|---|---|---|---|---|");
    for provider in ["tcp;ofi_rxm", "shm"] {
        let mut target = Agent::new(provider).expect("provider");
        let mut dst = DeviceRegion::new(&mut target, &ctx, SIZE).unwrap();
        let remote = dst.remote();
        let addr = target.address().unwrap();
        let progress = Progress::spawn(target).unwrap();
        let mut init = Agent::new(provider).unwrap();
        let peer = init.insert_peer(&addr).unwrap();
        let mut src = DeviceRegion::new(&mut init, &ctx, SIZE).unwrap();
        let (mut st, mut wr, mut la, mut all) = (vec![], vec![], vec![], vec![]);
        for run in 0..RUNS as u64 {
            let _spin = progress.expect();
            let t0 = Instant::now();
            src.stage(0, SIZE).unwrap();
            let t1 = Instant::now();
            let seg = SIZE / 4;
            let ops: Vec<WriteOp> = (0..4)
                .map(|i| WriteOp {
                    local: src.staging(),
                    offset: i * seg,
                    len: seg,
                    peer,
                    remote: &remote,
                    remote_offset: (i * seg) as u64,
                    notify: (i == 3).then_some(run + 1),
                })
                .collect();
            init.write_all(&ops, Duration::from_secs(30)).unwrap();
            while !progress.take_notice(run + 1) {
                std::hint::spin_loop();
            }
            let t2 = Instant::now();
            dst.land(0, SIZE).unwrap();
            let t3 = Instant::now();
            st.push(t1 - t0);
            wr.push(t2 - t1);
            la.push(t3 - t2);
            all.push(t3 - t0);
        }
        println!(
            "| `{provider}` | {:.1} | {:.1} | {:.1} | {:.1} |",
            gbps(SIZE, median(st)),
            gbps(SIZE, median(wr)),
            gbps(SIZE, median(la)),
            gbps(SIZE, median(all)),
        );
        progress.stop().unwrap();
    }
}
