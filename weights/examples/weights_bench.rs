//! Loads one weight file from each kind of source and reports the time and
//! GB/s (BENCHMARKS.md, "Weights"):
//! - a local file with a cold page cache (its pages dropped with
//!   `posix_fadvise(DONTNEED)` first);
//! - a peer over `tcp;ofi_rxm` and a peer over `shm`: another process
//!   (this program, `serve` mode) serving the file from registered memory.
//!
//! `cargo run --release -p dynamo-weights --example weights_bench -- [FILE...]`
//! (default: the SmolLM2 GGUF of `$DYNAMO_MODEL_GGUF` or the package, and a
//! 2 GiB synthetic file written to a temporary directory).

use dynamo_weights::source::FileSource;
use dynamo_weights::{load, manifest, LoadOptions, PeerDescriptor, Source, WeightServer};
use std::io::{BufRead, Write};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

fn drop_cache(path: &Path) {
    let f = std::fs::File::open(path).expect("open");
    // SAFETY: an advisory call on an open descriptor.
    unsafe {
        libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
    }
}

fn serve(provider: &str, path: &Path) {
    let m = manifest::of_file(path, "bench", "gguf").expect("manifest");
    let s = WeightServer::from_file(path, m, provider).expect("serve");
    println!("{}", serde_json::to_string(&s.descriptor()).expect("json"));
    std::io::stdout().flush().expect("flush");
    // Serve until the parent closes our stdin.
    let mut line = String::new();
    let _ = std::io::stdin().lock().read_line(&mut line);
}

fn report(what: &str, size: u64, secs: f64) {
    println!(
        "| {what} | {:.0} MB | {:.3} s | {:.2} GB/s |",
        size as f64 / 1e6,
        secs,
        size as f64 / 1e9 / secs
    );
}

fn synthetic(dir: &Path) -> PathBuf {
    let path = dir.join("synthetic.bin");
    let mut f = std::fs::File::create(&path).expect("create");
    let block: Vec<u8> = (0..(1u32 << 20))
        .map(|i| (i.wrapping_mul(2654435761) >> 7) as u8)
        .collect();
    for i in 0..2048u32 {
        let mut b = block.clone();
        b[..4].copy_from_slice(&i.to_le_bytes());
        f.write_all(&b).expect("write");
    }
    f.sync_all().expect("sync");
    path
}

fn from_peer(m: &dynamo_weights::Manifest, path: &Path, provider: &str) {
    let mut child = Command::new(std::env::current_exe().expect("self"))
        .args(["serve", provider, &path.display().to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the serving peer");
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("descriptor");
    let d: PeerDescriptor = serde_json::from_str(&line).expect("descriptor JSON");
    let opts = LoadOptions {
        provider: provider.into(),
        ..LoadOptions::default()
    };
    let peer = || vec![Source::Peer(d.source("peer").expect("address"))];
    // The first load registers memory; the second reuses it.
    let t = Instant::now();
    let got = load(m, peer(), &opts, None, &mut |_| {}).expect("peer load");
    let first = t.elapsed().as_secs_f64();
    let (agent, region, _) = got.into_registered().ok().expect("registered");
    let t = Instant::now();
    let again = load(m, peer(), &opts, Some((agent, region)), &mut |_| {}).expect("peer load");
    let second = t.elapsed().as_secs_f64();
    assert_eq!(again.bytes().len() as u64, m.size);
    report(
        &format!("peer over {provider} (registering)"),
        m.size,
        first,
    );
    report(
        &format!("peer over {provider} (memory reused)"),
        m.size,
        second,
    );
    drop(child.stdin.take());
    let _ = child.wait();
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("serve") {
        return serve(&args[1], Path::new(&args[2]));
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let files: Vec<PathBuf> = if args.is_empty() {
        vec![
            dynamo_model::locate_default_gguf().expect("the SmolLM2 GGUF (make deps)"),
            synthetic(tmp.path()),
        ]
    } else {
        args.iter().map(PathBuf::from).collect()
    };
    println!("| source | size | time | rate |\n|---|---|---|---|");
    for path in &files {
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        let t = Instant::now();
        let m = manifest::of_file(path, "bench", "gguf").expect("manifest");
        report(
            &format!("manifest of {name} (SHA-256, page cache warm)"),
            m.size,
            t.elapsed().as_secs_f64(),
        );
        drop_cache(path);
        let t = Instant::now();
        let got = load(
            &m,
            vec![Source::Bytes(Box::new(FileSource::new(path)))],
            &LoadOptions::default(),
            None,
            &mut |_| {},
        )
        .expect("file load");
        report(
            "local file, cold page cache",
            m.size,
            t.elapsed().as_secs_f64(),
        );
        drop(got);
        for provider in ["tcp;ofi_rxm", "shm"] {
            from_peer(&m, path, provider);
        }
    }
}
