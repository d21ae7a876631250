//! Weights in GPU memory (feature `cuda`; needs a GPU and its driver: run
//! with `cargo test -p dynamo-weights --features cuda --test gpu_weights`, or
//! through `scripts/gpu_checks.sh`). A load from a peer over a real
//! libfabric endpoint, and one from a file, land on the device byte for
//! byte; the device copy is verified against the content hash.

use dynamo_weights::source::FileSource;
use dynamo_weights::{load, DeviceWeights, LoadOptions, Source, WeightServer};
use std::io::Write;
use std::time::Duration;

fn gpu() -> std::sync::Arc<cudarc::driver::CudaContext> {
    dynamo_transfer::open_gpu(0).expect("the `cuda` feature's tests need a GPU and its driver")
}

fn content(n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| ((i as u64 * 2654435761) >> 11) as u8)
        .collect()
}

fn opts() -> LoadOptions {
    LoadOptions {
        provider: "tcp;ofi_rxm".into(),
        window: 4,
        peer_timeout: Duration::from_secs(5),
        max_bytes_per_sec: None,
    }
}

#[test]
fn a_peer_load_lands_on_the_device_byte_for_byte() {
    let ctx = gpu();
    // Not a whole number of chunks, so the last copy is a short one.
    let b = content((21 << 20) + 4099);
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(&b).unwrap();
    f.flush().unwrap();
    let m = dynamo_weights::manifest::of_file(f.path(), "m", "gguf").unwrap();
    let server = WeightServer::from_file(f.path(), m.clone(), "tcp;ofi_rxm").unwrap();
    let peer = Source::Peer(server.descriptor().source("a").expect("hex address"));
    let loaded = load(&m, vec![peer], &opts(), None, &mut |_| {}).unwrap();
    let mut seen = Vec::new();
    let d =
        DeviceWeights::land(&loaded, &ctx, &mut |done, total| seen.push((done, total))).unwrap();
    assert_eq!(d.len(), b.len());
    // Registered memory is page-aligned: it is locked for the copy.
    assert!(d.pinned, "the copy ran pageable");
    assert!(d.to_host().unwrap() == b, "the device copy differs");
    d.verify().unwrap();
    // Unlocked again: landing it a second time locks it anew.
    let d2 = DeviceWeights::land(&loaded, &ctx, &mut |_, _| {}).unwrap();
    assert!(d2.pinned, "the memory stayed locked after the first copy");
    d2.verify().unwrap();
    drop(d2);
    // Progress per chunk, ending at the whole file.
    assert_eq!(seen.len(), m.chunks.len());
    assert_eq!(seen.last(), Some(&(b.len() as u64, b.len() as u64)));
    // The load's host memory is still registered, and served on.
    let (agent, region, m2) = loaded.into_registered().ok().expect("registered");
    let next = WeightServer::new(agent, region, m2).unwrap();
    let again = load(
        &m,
        vec![Source::Peer(next.descriptor().source("next").unwrap())],
        &opts(),
        None,
        &mut |_| {},
    )
    .unwrap();
    assert!(again.bytes() == &b[..]);
}

#[test]
fn a_file_load_lands_on_the_device_and_a_changed_device_copy_fails_verification() {
    let ctx = gpu();
    let b = content(9 << 20);
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(&b).unwrap();
    f.flush().unwrap();
    let m = dynamo_weights::manifest::of_file(f.path(), "m", "gguf").unwrap();
    let loaded = load(
        &m,
        vec![Source::Bytes(Box::new(FileSource::new(f.path())))],
        &opts(),
        None,
        &mut |_| {},
    )
    .unwrap();
    let mut d = DeviceWeights::land(&loaded, &ctx, &mut |_, _| {}).unwrap();
    d.verify().unwrap();
    // One byte changed on the device: verification says so.
    let stream = d.stream().clone();
    let mut one = d.device_mut().slice_mut(1000..1001);
    stream.memcpy_htod(&[b[1000] ^ 0xff][..], &mut one).unwrap();
    stream.synchronize().unwrap();
    let e = d.verify().unwrap_err().to_string();
    assert!(e.contains("the device copy's SHA-256"), "{e}");
}
