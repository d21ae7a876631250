//! Placement speed: 1,000 single-member replicas (1 slot each, 10 services,
//! some in scopes) over 1,000 nodes (10 zones × 10 racks × 10 hosts, 4 slots
//! each), placed 20 times from scratch and 20 times from the previous
//! result. Exits non-zero when the p50 from scratch is over 100 ms.
//!
//! `cargo run --release -p dynamo-cluster-config --example placement_bench`

use std::collections::HashMap;
use std::process::ExitCode;
use std::time::Instant;

use dynamo_cluster_config::placement::{
    place, Gang, Level, Member, NodeInfo, Pack, Placement, PlacementRequest, Scope,
};

const RUNS: usize = 20;
const LIMIT_MS: f64 = 100.0;

fn main() -> ExitCode {
    let mut nodes = Vec::new();
    for z in 0..10 {
        for r in 0..10 {
            for h in 0..10 {
                nodes.push(NodeInfo {
                    id: format!("node-{z}-{r}-{h}"),
                    zone: format!("z{z}"),
                    rack: format!("z{z}-r{r}"),
                    host: format!("z{z}-r{r}-h{h}"),
                    slots: 4,
                    memory_mib: 81_920,
                    schedulable: true,
                    labels: Vec::new(),
                });
            }
        }
    }
    let pack = |required, preferred| Pack {
        required,
        preferred,
    };
    let scopes = vec![
        Scope {
            key: "svc0".into(),
            pack: pack(Some(Level::Zone), None),
        },
        Scope {
            key: "svc1".into(),
            pack: pack(None, Some(Level::Rack)),
        },
        Scope {
            key: "svc2".into(),
            pack: pack(Some(Level::Rack), None),
        },
        Scope {
            key: "bench".into(),
            pack: pack(None, Some(Level::Zone)),
        },
    ];
    let gangs: Vec<Gang> = (0..1000)
        .map(|i| {
            let svc = i % 10;
            let scopes = match svc {
                0..=2 => vec![svc],
                3 | 4 => vec![3],
                _ => vec![],
            };
            Gang {
                key: format!("svc{svc}-{i}"),
                members: vec![Member {
                    key: format!("svc{svc}-{i}.0"),
                    service: format!("svc{svc}"),
                    slots: 1,
                    memory_mib: 4096,
                    selector: Vec::new(),
                    exclusive: None,
                }],
                pack: Pack::default(),
                scopes,
            }
        })
        .collect();
    let reserved = HashMap::new();
    let run = |current: &HashMap<String, String>| -> (f64, Placement) {
        let req = PlacementRequest {
            nodes: &nodes,
            scopes: &scopes,
            gangs: &gangs,
            current,
            reserved: &reserved,
        };
        let t = Instant::now();
        let p = place(&req);
        (t.elapsed().as_secs_f64() * 1e3, p)
    };
    let stats = |mut ms: Vec<f64>| {
        ms.sort_by(f64::total_cmp);
        (ms[0], ms[ms.len() / 2], ms[ms.len() - 1])
    };

    let empty = HashMap::new();
    let mut times = Vec::new();
    let mut last = Placement::default();
    for _ in 0..RUNS {
        let (ms, p) = run(&empty);
        times.push(ms);
        last = p;
    }
    let (min, p50, max) = stats(times);
    let current: HashMap<String, String> = last.assignments.clone().into_iter().collect();
    let mut again = Vec::new();
    for _ in 0..RUNS {
        let (ms, p) = run(&current);
        again.push(ms);
        if p != last {
            eprintln!("placement: placing the result again changed it");
            return ExitCode::FAILURE;
        }
    }
    let (amin, ap50, amax) = stats(again);
    println!(
        "from scratch: min {min:.2} ms, p50 {p50:.2} ms, max {max:.2} ms; placed {}, pending {}",
        last.assignments.len(),
        last.pending.len()
    );
    if let Some(p) = last.pending.first() {
        println!("  e.g. {} pending: {}", p.gang, p.reason);
    }
    println!("from the previous result: min {amin:.2} ms, p50 {ap50:.2} ms, max {amax:.2} ms");
    println!(
        "placement: {} replicas over {} nodes: p50 {p50:.2} ms, max {max:.2} ms",
        gangs.len(),
        nodes.len()
    );
    if p50 > LIMIT_MS {
        eprintln!("placement: p50 {p50:.2} ms is over {LIMIT_MS} ms");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
