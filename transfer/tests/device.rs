//! GPU memory over real libfabric endpoints (feature `cuda`; needs a GPU
//! and its driver: run with `cargo test -p dynamo-transfer --features cuda
//! --test device`). Bytes put on one device region arrive, byte for byte,
//! in another device region through stage → one-sided write → land.

use dynamo_transfer::{Agent, DeviceRegion, FabricError, Progress, WriteOp};
use std::time::{Duration, Instant};

fn gpu() -> std::sync::Arc<cudarc::driver::CudaContext> {
    dynamo_transfer::open_gpu(0).expect("the `cuda` feature's tests need a GPU and its driver")
}

fn device_to_device(provider: &str) {
    const LEN: usize = 8 << 20;
    let ctx = gpu();
    let mut target = Agent::new(provider).expect("provider available");
    let mut dst = DeviceRegion::new(&mut target, &ctx, LEN).unwrap();
    let remote = dst.remote();
    let addr = target.address().unwrap();
    let progress = Progress::spawn(target).unwrap();
    let spin = progress.expect();

    let mut init = Agent::new(provider).unwrap();
    let peer = init.insert_peer(&addr).unwrap();
    let mut src = DeviceRegion::new(&mut init, &ctx, LEN).unwrap();
    let pattern: Vec<u8> = (0..LEN).map(|i| ((i * 31 + 7) % 251) as u8).collect();
    let stream = src.stream().clone();
    stream.memcpy_htod(&pattern, src.device_mut()).unwrap();

    // Two blocks of 1 MiB at different offsets, the second with a notice.
    src.stage(0, 3 << 20).unwrap();
    let op = |offset: usize, len, remote_offset, notify| WriteOp {
        local: src.staging(),
        offset,
        len,
        peer,
        remote: &remote,
        remote_offset,
        notify,
    };
    init.write_all(
        &[
            op(0, 1 << 20, 4 << 20, None),
            op(2 << 20, 1 << 20, 6 << 20, Some(42)),
        ],
        Duration::from_secs(10),
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !progress.take_notice(42) {
        assert!(Instant::now() < deadline, "notice never arrived");
        std::thread::sleep(Duration::from_millis(1));
    }
    dst.land(4 << 20, 1 << 20).unwrap();
    dst.land(6 << 20, 1 << 20).unwrap();
    drop(spin);

    let got = dst.stream().clone_dtoh(dst.device()).unwrap();
    assert_eq!(&got[4 << 20..5 << 20], &pattern[..1 << 20]);
    assert_eq!(&got[6 << 20..7 << 20], &pattern[2 << 20..3 << 20]);
    assert!(
        got[..4 << 20].iter().all(|b| *b == 0),
        "nothing else landed"
    );
    assert!(got[5 << 20..6 << 20].iter().all(|b| *b == 0));

    // Ranges are checked before any copy.
    assert!(matches!(
        dst.land(LEN - 10, 11),
        Err(FabricError::OutOfRange { .. })
    ));
    assert!(matches!(
        src.stage(usize::MAX, 2),
        Err(FabricError::OutOfRange { .. })
    ));
    progress.stop().unwrap();
}

#[test]
fn device_blocks_cross_tcp_rxm() {
    device_to_device("tcp;ofi_rxm");
}

#[test]
fn device_blocks_cross_shm() {
    device_to_device("shm");
}
