//! 64 MiB one-sided write throughput over libfabric providers, against a
//! plain TCP socket on the same machine.
//!
//! `cargo run --release -p dynamo-transfer --example transfer_bench`

use dynamo_transfer::{Agent, Progress, WriteOp};
use std::io::{Read, Write};
use std::time::{Duration, Instant};

const SIZE: usize = 64 << 20;
const RUNS: usize = 5;

fn fabric(provider: &str) -> Vec<f64> {
    let mut target = match Agent::new(provider) {
        Ok(a) => a,
        Err(e) => {
            println!("{provider}: unavailable ({e})");
            return vec![];
        }
    };
    let dst = target.register(SIZE).expect("register");
    let remote = dst.remote();
    let addr = target.address().expect("address");
    let progress = Progress::spawn(target).expect("progress thread");
    let _spin = progress.expect();
    let mut init = Agent::new(provider).expect("agent");
    let peer = init.insert_peer(&addr).expect("peer");
    let mut src = init.register(SIZE).expect("register");
    src.bytes_mut().fill(7);
    let mut out = Vec::new();
    for _ in 0..RUNS + 1 {
        let t0 = Instant::now();
        init.write(
            WriteOp {
                local: &src,
                offset: 0,
                len: SIZE,
                peer,
                remote: &remote,
                remote_offset: 0,
                notify: None,
            },
            Duration::from_secs(60),
        )
        .expect("write");
        out.push(SIZE as f64 / t0.elapsed().as_secs_f64() / 1e9);
    }
    progress.stop().expect("target progress");
    out.remove(0); // warm-up
    out
}

fn tcp_socket() -> Vec<f64> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    let rx = std::thread::spawn(move || {
        let (mut s, _) = l.accept().expect("accept");
        let mut buf = vec![0u8; SIZE];
        for _ in 0..RUNS + 1 {
            s.read_exact(&mut buf).expect("read");
            s.write_all(&[1]).expect("ack");
        }
    });
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    let buf = vec![7u8; SIZE];
    let mut out = Vec::new();
    for _ in 0..RUNS + 1 {
        let t0 = Instant::now();
        s.write_all(&buf).expect("write");
        let mut ack = [0u8];
        s.read_exact(&mut ack).expect("ack");
        out.push(SIZE as f64 / t0.elapsed().as_secs_f64() / 1e9);
    }
    let _ = rx.join();
    out.remove(0);
    out
}

fn show(name: &str, mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let median = v[v.len() / 2];
    println!("{name:<14} median {median:5.2} GB/s (runs {v:.2?})");
    median
}

fn main() {
    println!("64 MiB write, {RUNS} runs after a warm-up");
    let tcp = show("tcp socket", tcp_socket());
    let rxm = show("tcp;ofi_rxm", fabric("tcp;ofi_rxm"));
    let shm = show("shm", fabric("shm"));
    if tcp > 0.0 {
        println!(
            "vs socket: tcp;ofi_rxm {:.2}x, shm {:.2}x",
            rxm / tcp,
            shm / tcp
        );
    }
}
