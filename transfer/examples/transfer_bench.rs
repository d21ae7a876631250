//! 64 MiB one-sided write throughput over libfabric providers, against a
//! plain TCP socket on the same machine. The three transports are set up
//! once and their runs interleave (socket, `tcp;ofi_rxm`, `shm`, socket, …),
//! so the machine's noise hits all of them alike.
//!
//! `cargo run --release -p dynamo-transfer --example transfer_bench`

use dynamo_transfer::{Agent, Peer, Progress, Region, RemoteRegion, WriteOp};
use std::io::{Read, Write};
use std::time::{Duration, Instant};

const SIZE: usize = 64 << 20;
const RUNS: usize = 25;

/// One side of a libfabric transfer: initiator, source and the target.
struct Fabric {
    init: Agent,
    src: Region,
    peer: Peer,
    remote: RemoteRegion,
    _dst: Region,
    progress: Progress,
}

impl Fabric {
    fn open(provider: &str) -> Option<Self> {
        let mut target = match Agent::new(provider) {
            Ok(a) => a,
            Err(e) => {
                println!("{provider}: unavailable ({e})");
                return None;
            }
        };
        let dst = target.register(SIZE).expect("register");
        let remote = dst.remote();
        let addr = target.address().expect("address");
        let progress = Progress::spawn(target).expect("progress thread");
        let mut init = Agent::new(provider).expect("agent");
        let peer = init.insert_peer(&addr).expect("peer");
        let mut src = init.register(SIZE).expect("register");
        src.bytes_mut().fill(7);
        Some(Fabric {
            init,
            src,
            peer,
            remote,
            _dst: dst,
            progress,
        })
    }

    /// 64 MiB written as `segments` concurrent writes, in GB/s (the target
    /// polls hard only meanwhile, as a decode worker does during a transfer).
    fn run(&mut self, segments: usize) -> f64 {
        let _spin = self.progress.expect();
        let seg = SIZE / segments;
        let ops: Vec<WriteOp> = (0..segments)
            .map(|i| WriteOp {
                local: &self.src,
                offset: i * seg,
                len: seg,
                peer: self.peer,
                remote: &self.remote,
                remote_offset: (i * seg) as u64,
                notify: None,
            })
            .collect();
        let t0 = Instant::now();
        self.init
            .write_all(&ops, Duration::from_secs(60))
            .expect("write");
        SIZE as f64 / t0.elapsed().as_secs_f64() / 1e9
    }
}

/// A loopback TCP socket whose reader acknowledges every 64 MiB.
struct Socket {
    s: std::net::TcpStream,
    buf: Vec<u8>,
}

impl Socket {
    fn open() -> Self {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = l.local_addr().expect("addr").port();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().expect("accept");
            let mut buf = vec![0u8; SIZE];
            while s.read_exact(&mut buf).is_ok() {
                if s.write_all(&[1]).is_err() {
                    break;
                }
            }
        });
        let s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
        Socket {
            s,
            buf: vec![7u8; SIZE],
        }
    }

    fn run(&mut self) -> f64 {
        let t0 = Instant::now();
        self.s.write_all(&self.buf).expect("write");
        let mut ack = [0u8];
        self.s.read_exact(&mut ack).expect("ack");
        SIZE as f64 / t0.elapsed().as_secs_f64() / 1e9
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn main() {
    println!("64 MiB write, {RUNS} interleaved rounds after a warm-up round");
    let mut socket = Socket::open();
    let mut rxm = Fabric::open("tcp;ofi_rxm");
    let mut shm = Fabric::open("shm");
    let (mut s, mut r, mut m, mut m4) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 0..=RUNS {
        let a = socket.run();
        let b = rxm.as_mut().map(|f| f.run(1)).unwrap_or(0.0);
        let c = shm.as_mut().map(|f| f.run(1)).unwrap_or(0.0);
        let d = shm.as_mut().map(|f| f.run(4)).unwrap_or(0.0);
        if round > 0 {
            s.push(a);
            r.push(b);
            m.push(c);
            m4.push(d);
        }
    }
    for (name, v) in [
        ("tcp socket", &s),
        ("tcp;ofi_rxm", &r),
        ("shm", &m),
        ("shm 4 × 16 MiB", &m4),
    ] {
        println!(
            "{name:<14} median {:5.2} GB/s (runs {v:.2?})",
            median(v.clone())
        );
    }
    // Per round ratios: both sides of a ratio ran back to back.
    let ratio = |x: &[f64]| median(x.iter().zip(&s).map(|(a, b)| a / b).collect());
    println!(
        "vs socket (median of per-round ratios): tcp;ofi_rxm {:.2}x, shm {:.2}x, shm 4 segments {:.2}x",
        ratio(&r),
        ratio(&m),
        ratio(&m4)
    );
}
