use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use proptest::prelude::*;
use proptest::test_runner::{RngAlgorithm, RngSeed};

use super::*;

fn node(id: &str, zone: &str, rack: &str, host: &str, slots: u32) -> NodeInfo {
    NodeInfo {
        id: id.into(),
        zone: zone.into(),
        rack: rack.into(),
        host: host.into(),
        slots,
        memory_mib: 1 << 20,
        schedulable: true,
        labels: Vec::new(),
    }
}

fn member(key: &str, service: &str, slots: u32) -> Member {
    Member {
        key: key.into(),
        service: service.into(),
        slots,
        memory_mib: 0,
        selector: Vec::new(),
        exclusive: None,
    }
}

fn pack(required: Option<Level>, preferred: Option<Level>) -> Pack {
    Pack {
        required,
        preferred,
    }
}

fn gang(key: &str, members: Vec<Member>, pack: Pack, scopes: Vec<usize>) -> Gang {
    Gang {
        key: key.into(),
        members,
        pack,
        scopes,
    }
}

/// One single-member gang per replica: `<svc>-<i>` with member `<svc>-<i>.0`.
fn replicas(svc: &str, n: usize, slots: u32, scopes: Vec<usize>) -> Vec<Gang> {
    (0..n)
        .map(|i| {
            let k = format!("{svc}-{i}");
            gang(
                &k,
                vec![member(&format!("{k}.0"), svc, slots)],
                Pack::default(),
                scopes.clone(),
            )
        })
        .collect()
}

fn run(
    nodes: &[NodeInfo],
    scopes: &[Scope],
    gangs: &[Gang],
    current: &HashMap<String, String>,
) -> Placement {
    place(&PlacementRequest {
        nodes,
        scopes,
        gangs,
        current,
        reserved: &HashMap::new(),
    })
}

fn as_current(p: &Placement) -> HashMap<String, String> {
    p.assignments
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

fn reason(p: &Placement, gang: &str) -> String {
    p.pending
        .iter()
        .find(|x| x.gang == gang)
        .map(|x| x.reason.clone())
        .unwrap_or_else(|| panic!("{gang} is not pending: {p:?}"))
}

/// 2 zones × 2 racks × 2 hosts, one node per host.
fn grid(slots: u32) -> Vec<NodeInfo> {
    let mut v = Vec::new();
    for z in 0..2 {
        for r in 0..2 {
            for h in 0..2 {
                let id = format!("n{z}{r}{h}");
                v.push(node(
                    &id,
                    &format!("z{z}"),
                    &format!("r{z}{r}"),
                    &format!("h{z}{r}{h}"),
                    slots,
                ));
            }
        }
    }
    v
}

fn node_of<'a>(nodes: &'a [NodeInfo], id: &str) -> &'a NodeInfo {
    nodes
        .iter()
        .find(|n| n.id == id)
        .expect("assigned to a known node")
}

#[test]
fn empty_request_places_nothing() {
    assert_eq!(run(&[], &[], &[], &HashMap::new()), Placement::default());
    assert_eq!(
        run(&grid(4), &[], &[], &HashMap::new()),
        Placement::default()
    );
}

#[test]
fn level_order_and_names() {
    assert!(Level::Host.narrower_or_equal(Level::Rack));
    assert!(Level::Rack.narrower_or_equal(Level::Zone));
    assert!(Level::Rack.narrower_or_equal(Level::Rack));
    assert!(!Level::Zone.narrower_or_equal(Level::Host));
    assert_eq!(Level::Rack.to_string(), "rack");
    assert_eq!(Level::Zone.label(), "zone");
    assert_eq!(
        serde_json::to_string(&Level::Host).ok().as_deref(),
        Some("\"host\"")
    );
}

#[test]
fn reason_no_schedulable_nodes() {
    let mut nodes = grid(4);
    for n in &mut nodes {
        n.schedulable = false;
    }
    let p = run(&nodes, &[], &replicas("a", 1, 1, vec![]), &HashMap::new());
    assert_eq!(reason(&p, "a-0"), "no schedulable nodes");
    assert!(p.assignments.is_empty());
}

#[test]
fn reason_member_too_large() {
    let p = run(&grid(2), &[], &replicas("a", 1, 4, vec![]), &HashMap::new());
    assert_eq!(
        reason(&p, "a-0"),
        "each a replica needs 4 slots and 0 MiB; the most free on one schedulable node is 2 slots; no schedulable node has that much in all, so it waits for a larger node"
    );
}

#[test]
fn reason_not_enough_slots_in_all() {
    let nodes = vec![node("a", "z", "r", "h1", 2), node("b", "z", "r", "h2", 2)];
    let g = gang(
        "big",
        (0..3)
            .map(|i| member(&format!("big.{i}"), "w", 2))
            .collect(),
        Pack::default(),
        vec![],
    );
    let p = run(&nodes, &[], &[g], &HashMap::new());
    assert_eq!(
        reason(&p, "big"),
        "needs 6 slots in all; 4 are free on schedulable nodes"
    );
}

#[test]
fn reason_required_rack() {
    let nodes = vec![
        node("a", "z", "r1", "h1", 1),
        node("b", "z", "r1", "h2", 1),
        node("c", "z", "r2", "h3", 1),
        node("d", "z", "r2", "h4", 1),
    ];
    let g = gang(
        "g",
        (0..3).map(|i| member(&format!("g.{i}"), "w", 1)).collect(),
        pack(Some(Level::Rack), None),
        vec![],
    );
    let p = run(&nodes, &[], &[g], &HashMap::new());
    assert_eq!(
        reason(&p, "g"),
        "needs 3 slots in one rack; the largest free rack has 2"
    );
}

#[test]
fn reason_scope_fixed_domain() {
    let nodes = vec![
        node("a", "z", "r1", "h1", 1),
        node("b", "z", "r1", "h2", 1),
        node("c", "z", "r2", "h3", 1),
    ];
    let scopes = vec![Scope {
        key: "prefill".into(),
        pack: pack(Some(Level::Rack), None),
    }];
    let mut gangs = replicas("prefill", 1, 1, vec![0]);
    gangs.push(gang(
        "prefill-1",
        vec![member("prefill-1.0", "prefill", 2)],
        Pack::default(),
        vec![0],
    ));
    let p = run(&nodes, &scopes, &gangs, &HashMap::new());
    // The first replica fixes the scope to the rack with most room.
    assert_eq!(node_of(&nodes, &p.assignments["prefill-0.0"]).rack, "r1");
    assert_eq!(
        reason(&p, "prefill-1"),
        "each prefill replica needs 2 slots and 0 MiB; the most free on one schedulable node is 1 slots; no schedulable node has that much in all, so it waits for a larger node"
    );
    // Two 1-slot members: fits in all, not in the scope's rack.
    gangs[1] = gang(
        "prefill-1",
        vec![
            member("prefill-1.0", "prefill", 1),
            member("prefill-1.1", "prefill", 1),
        ],
        Pack::default(),
        vec![0],
    );
    let p = run(&nodes, &scopes, &gangs, &HashMap::new());
    assert_eq!(
        reason(&p, "prefill-1"),
        "service prefill is packed in rack r1 (required), which has 1 free slot; needs 2"
    );
}

#[test]
fn reason_memory() {
    let mut nodes = grid(4);
    for n in &mut nodes {
        n.memory_mib = 1000;
    }
    let mut g = replicas("a", 1, 1, vec![]);
    g[0].members[0].memory_mib = 1500;
    let p = run(&nodes, &[], &g, &HashMap::new());
    assert_eq!(
        reason(&p, "a-0"),
        "each a replica needs 1 slots and 1500 MiB; the most free on one schedulable node is 1000 MiB; no schedulable node has that much in all, so it waits for a larger node"
    );
}

#[test]
fn reason_duplicates_and_bad_scope() {
    let mut gangs = replicas("a", 2, 1, vec![]);
    gangs[1].members[0].key = "a-0.0".into();
    gangs.push(gang(
        "bad",
        vec![member("bad.0", "b", 1)],
        Pack::default(),
        vec![3],
    ));
    let p = run(&grid(4), &[], &gangs, &HashMap::new());
    assert!(p.assignments.contains_key("a-0.0"));
    assert_eq!(
        reason(&p, "a-1"),
        "duplicate member key a-0.0 (already in gang a-0)"
    );
    assert_eq!(
        reason(&p, "bad"),
        "scope index 3 is out of range (the request has 0 scopes)"
    );
}

#[test]
fn spread_over_hosts_then_racks() {
    let nodes = grid(4);
    let p = run(&nodes, &[], &replicas("a", 8, 1, vec![]), &HashMap::new());
    let hosts: BTreeSet<&str> = p
        .assignments
        .values()
        .map(|id| node_of(&nodes, id).host.as_str())
        .collect();
    assert_eq!(hosts.len(), 8);
    // Two replicas: different zones.
    let p = run(&nodes, &[], &replicas("a", 2, 1, vec![]), &HashMap::new());
    let zones: BTreeSet<&str> = p
        .assignments
        .values()
        .map(|id| node_of(&nodes, id).zone.as_str())
        .collect();
    assert_eq!(zones.len(), 2);
}

#[test]
fn new_gang_does_not_move_existing_ones() {
    let nodes = grid(2);
    let mut gangs = replicas("a", 4, 1, vec![]);
    gangs.extend(replicas("b", 4, 1, vec![]));
    let p = run(&nodes, &[], &gangs, &HashMap::new());
    assert!(p.pending.is_empty());
    // A new, high-priority packed gang that would like a whole host.
    let mut more = vec![gang(
        "c-0",
        vec![member("c-0.0", "c", 1), member("c-0.1", "c", 1)],
        pack(Some(Level::Host), None),
        vec![],
    )];
    more.extend(gangs.iter().cloned());
    let q = run(&nodes, &[], &more, &as_current(&p));
    for (k, v) in &p.assignments {
        assert_eq!(q.assignments.get(k), Some(v), "{k} moved");
    }
}

#[test]
fn scaling_one_service_leaves_others_in_place() {
    let nodes = grid(4);
    let mut gangs = replicas("a", 4, 1, vec![]);
    gangs.extend(replicas("b", 5, 2, vec![]));
    let p = run(&nodes, &[], &gangs, &HashMap::new());
    assert!(p.pending.is_empty());
    // Scale a down to 2 ...
    let down: Vec<Gang> = gangs
        .iter()
        .filter(|g| !matches!(g.key.as_str(), "a-2" | "a-3"))
        .cloned()
        .collect();
    let q = run(&nodes, &[], &down, &as_current(&p));
    for (k, v) in &q.assignments {
        assert_eq!(p.assignments.get(k), Some(v));
    }
    assert_eq!(q.assignments.len(), 7);
    // ... and up to 6.
    let mut up = replicas("a", 6, 1, vec![]);
    up.extend(replicas("b", 5, 2, vec![]));
    let r = run(&nodes, &[], &up, &as_current(&q));
    for (k, v) in &q.assignments {
        assert_eq!(r.assignments.get(k), Some(v));
    }
    assert_eq!(r.assignments.len(), 11);
}

#[test]
fn host_packed_gang_moves_whole_after_node_loss() {
    let mut nodes = grid(4);
    let g = vec![gang(
        "g",
        vec![member("g.0", "w", 2), member("g.1", "w", 2)],
        pack(Some(Level::Host), None),
        vec![],
    )];
    let p = run(&nodes, &[], &g, &HashMap::new());
    let first = p.assignments["g.0"].clone();
    assert_eq!(p.assignments["g.1"], first);
    for n in &mut nodes {
        if n.id == first {
            n.schedulable = false;
        }
    }
    let q = run(&nodes, &[], &g, &as_current(&p));
    assert!(q.pending.is_empty());
    assert_ne!(q.assignments["g.0"], first);
    assert_eq!(q.assignments["g.0"], q.assignments["g.1"]);
}

#[test]
fn rack_packed_gang_repairs_beside_its_survivors() {
    let mut nodes = grid(1);
    let g = vec![gang(
        "g",
        vec![member("g.0", "w", 1), member("g.1", "w", 1)],
        pack(Some(Level::Rack), None),
        vec![],
    )];
    let p = run(&nodes, &[], &g, &HashMap::new());
    let (a, b) = (p.assignments["g.0"].clone(), p.assignments["g.1"].clone());
    assert_ne!(a, b);
    let rack = node_of(&nodes, &a).rack.clone();
    assert_eq!(node_of(&nodes, &b).rack, rack);
    for n in &mut nodes {
        if n.id == b {
            n.schedulable = false;
        }
    }
    // The rack has no other node: the whole gang moves to another rack.
    let q = run(&nodes, &[], &g, &as_current(&p));
    assert!(q.pending.is_empty());
    assert_ne!(node_of(&nodes, &q.assignments["g.0"]).rack, rack);
    // With room in the rack, the survivor stays and only g.1 moves.
    nodes.push(node(
        "extra",
        &node_of(&nodes, &a).zone.clone(),
        &rack,
        "hx",
        1,
    ));
    let q = run(&nodes, &[], &g, &as_current(&p));
    assert_eq!(q.assignments["g.0"], a);
    assert_eq!(q.assignments["g.1"], "extra");
}

#[test]
fn strict_gang_survivors_not_assigned_when_pending() {
    let mut nodes = vec![node("a", "z", "r", "h1", 1), node("b", "z", "r", "h2", 1)];
    let g = vec![gang(
        "g",
        vec![member("g.0", "w", 1), member("g.1", "w", 1)],
        Pack::default(),
        vec![],
    )];
    let p = run(&nodes, &[], &g, &HashMap::new());
    assert_eq!(p.assignments.len(), 2);
    nodes[1].schedulable = false;
    let q = run(&nodes, &[], &g, &as_current(&p));
    assert!(q.assignments.is_empty());
    assert_eq!(
        reason(&q, "g"),
        "needs 2 slots in all; 1 are free on schedulable nodes"
    );
}

#[test]
fn scope_domain_is_sticky() {
    let nodes = grid(2);
    let scopes = vec![
        Scope {
            key: "a".into(),
            pack: pack(Some(Level::Rack), None),
        },
        Scope {
            key: "b".into(),
            pack: pack(None, Some(Level::Zone)),
        },
    ];
    let mut gangs = replicas("a", 3, 1, vec![0]);
    gangs.extend(replicas("b", 3, 1, vec![1]));
    let p = run(&nodes, &scopes, &gangs, &HashMap::new());
    assert!(p.pending.is_empty());
    let racks: BTreeSet<String> = (0..3)
        .map(|i| {
            node_of(&nodes, &p.assignments[&format!("a-{i}.0")])
                .rack
                .clone()
        })
        .collect();
    assert_eq!(racks.len(), 1);
    let zones: BTreeSet<String> = (0..3)
        .map(|i| {
            node_of(&nodes, &p.assignments[&format!("b-{i}.0")])
                .zone
                .clone()
        })
        .collect();
    assert_eq!(zones.len(), 1);
    // A fourth a goes to the same rack (1 slot left there); a fifth has none.
    let mut more = gangs.clone();
    more.extend(replicas("a", 5, 1, vec![0]).into_iter().skip(3));
    let q = run(&nodes, &scopes, &more, &as_current(&p));
    let rack = racks.iter().next().cloned().unwrap_or_default();
    assert_eq!(node_of(&nodes, &q.assignments["a-3.0"]).rack, rack);
    assert_eq!(
        reason(&q, "a-4"),
        format!("service a is packed in rack {rack} (required), which has 0 free slots; needs 1")
    );
    // Preferred: a fourth b joins the zone while it has room.
    let mut more = gangs.clone();
    more.extend(replicas("b", 4, 1, vec![1]).into_iter().skip(3));
    let q = run(&nodes, &scopes, &more, &as_current(&p));
    let zone = zones.iter().next().cloned().unwrap_or_default();
    assert_eq!(node_of(&nodes, &q.assignments["b-3.0"]).zone, zone);
}

#[test]
fn scope_disagreement_keeps_the_majority_domain() {
    let nodes = grid(2);
    let scopes = vec![Scope {
        key: "a".into(),
        pack: pack(Some(Level::Rack), None),
    }];
    let gangs = replicas("a", 3, 1, vec![0]);
    let current: HashMap<String, String> =
        [("a-0.0", "n000"), ("a-1.0", "n001"), ("a-2.0", "n110")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
    let p = run(&nodes, &scopes, &gangs, &current);
    assert!(p.pending.is_empty());
    assert_eq!(p.assignments["a-0.0"], "n000");
    assert_eq!(p.assignments["a-1.0"], "n001");
    assert_eq!(node_of(&nodes, &p.assignments["a-2.0"]).rack, "r00");
}

#[test]
fn preferred_packing_is_honoured() {
    let nodes = grid(2);
    let g = vec![gang(
        "g",
        (0..4).map(|i| member(&format!("g.{i}"), "w", 1)).collect(),
        pack(None, Some(Level::Rack)),
        vec![],
    )];
    let p = run(&nodes, &[], &g, &HashMap::new());
    let racks: BTreeSet<&str> = p
        .assignments
        .values()
        .map(|id| node_of(&nodes, id).rack.as_str())
        .collect();
    assert_eq!(racks.len(), 1);
    // Too big for one rack: placed anyway, spread.
    let g = vec![gang(
        "g",
        (0..6).map(|i| member(&format!("g.{i}"), "w", 1)).collect(),
        pack(None, Some(Level::Rack)),
        vec![],
    )];
    let p = run(&nodes, &[], &g, &HashMap::new());
    assert_eq!(p.assignments.len(), 6);
}

#[test]
fn odd_inputs_do_not_panic() {
    let mut nodes = grid(2);
    nodes.push(node("n000", "zz", "rr", "hh", 100)); // duplicate id: ignored
    nodes.push(node("bare", "", "", "", 3));
    let reserved: HashMap<String, (u32, u64)> =
        [("n001".to_string(), (5, 0)), ("ghost".to_string(), (1, 1))]
            .into_iter()
            .collect();
    let current: HashMap<String, String> =
        [("a-0.0", "ghost"), ("nobody", "n000"), ("a-1.0", "n001")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
    let mut gangs = replicas("a", 12, 1, vec![]);
    gangs.push(gang("empty", vec![], pack(Some(Level::Host), None), vec![]));
    let req = PlacementRequest {
        nodes: &nodes,
        scopes: &[],
        gangs: &gangs,
        current: &current,
        reserved: &reserved,
    };
    let p = place(&req);
    assert_eq!(p, place(&req));
    assert!(!p.assignments.values().any(|n| n == "n001"));
    assert!(p.assignments.values().filter(|n| *n == "n000").count() <= 2);
    assert_eq!(p.assignments.len(), 12);
    assert!(!p.pending.iter().any(|x| x.gang == "empty"));
}

// --- property tests --------------------------------------------------------

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 256,
        rng_algorithm: RngAlgorithm::ChaCha,
        rng_seed: RngSeed::Fixed(0x5eed_91ace),
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

#[derive(Clone, Debug)]
struct Case {
    nodes: Vec<NodeInfo>,
    scopes: Vec<Scope>,
    gangs: Vec<Gang>,
    current: HashMap<String, String>,
    reserved: HashMap<String, (u32, u64)>,
    /// Nodes to lose in the second round of a test.
    lost: Vec<bool>,
}

impl Case {
    fn req<'a>(&'a self, current: &'a HashMap<String, String>) -> PlacementRequest<'a> {
        PlacementRequest {
            nodes: &self.nodes,
            scopes: &self.scopes,
            gangs: &self.gangs,
            current,
            reserved: &self.reserved,
        }
    }
}

fn level() -> impl Strategy<Value = Option<Level>> {
    prop_oneof![
        3 => Just(None),
        1 => Just(Some(Level::Zone)),
        1 => Just(Some(Level::Rack)),
        1 => Just(Some(Level::Host)),
    ]
}

const MEM: [u64; 4] = [0, 1024, 4096, 16384];

fn case() -> impl Strategy<Value = Case> {
    let nodes = prop::collection::vec(
        (
            0..4usize,
            0..4usize,
            0..4usize,
            0..=8u32,
            0..4usize,
            prop::bool::weighted(0.85),
        ),
        1..=40,
    );
    let reserved = prop::collection::vec((0..40usize, 0..4u32, 0..3u64), 0..5);
    let scopes = prop::collection::vec((level(), level()), 0..=3);
    let member = (0..3usize, 0..=4u32, 0..3u64);
    let gangs = prop::collection::vec(
        (
            prop::collection::vec(member, 1..=4),
            (level(), level()),
            prop::collection::vec(0..16usize, 0..=2),
            prop::bool::weighted(0.05),
        ),
        0..=12,
    );
    let current = prop::collection::vec((0..60usize, 0..45usize), 0..30);
    let lost = prop::collection::vec(prop::bool::weighted(0.2), 40);
    (nodes, reserved, scopes, gangs, current, lost).prop_map(|(ns, rs, ss, gs, cs, lost)| {
        let labels = |p: &str, i: usize| {
            if i == 0 {
                String::new()
            } else {
                format!("{p}{i}")
            }
        };
        let nodes: Vec<NodeInfo> = ns
            .iter()
            .enumerate()
            .map(|(i, &(z, r, h, slots, mem, sched))| NodeInfo {
                id: format!("n{i}"),
                zone: labels("z", z),
                rack: labels("r", r),
                host: labels("h", h),
                slots,
                memory_mib: MEM[mem] * 2,
                schedulable: sched,
                labels: Vec::new(),
            })
            .collect();
        let reserved = rs
            .iter()
            .map(|&(n, s, m)| (format!("n{n}"), (s, MEM[m as usize])))
            .collect();
        let scopes = ss
            .iter()
            .enumerate()
            .map(|(i, &(required, preferred))| Scope {
                key: format!("s{i}"),
                pack: Pack {
                    required,
                    preferred,
                },
            })
            .collect();
        let mut keys: Vec<String> = Vec::new();
        let gangs = gs
            .iter()
            .enumerate()
            .map(|(gi, (ms, (required, preferred), sc, dup))| {
                let members = ms
                    .iter()
                    .enumerate()
                    .map(|(mi, &(svc, slots, mem))| {
                        let key = match keys.first() {
                            Some(k) if *dup && mi == 0 => k.clone(),
                            _ => format!("g{gi}.{mi}"),
                        };
                        keys.push(key.clone());
                        Member {
                            key,
                            service: ["a", "b", "c"][svc].to_string(),
                            slots,
                            memory_mib: MEM[mem as usize] / 2,
                            selector: Vec::new(),
                            exclusive: None,
                        }
                    })
                    .collect();
                Gang {
                    key: format!("g{gi}"),
                    members,
                    pack: Pack {
                        required: *required,
                        preferred: *preferred,
                    },
                    // Mostly valid indices; 15 is out of range.
                    scopes: sc
                        .iter()
                        .map(|&i| {
                            if i == 15 || ss.is_empty() {
                                i
                            } else {
                                i % ss.len()
                            }
                        })
                        .collect(),
                }
            })
            .collect();
        let current = cs
            .iter()
            .map(|&(m, n)| {
                let key = keys.get(m).cloned().unwrap_or_else(|| format!("ghost{m}"));
                (key, format!("n{n}"))
            })
            .collect();
        Case {
            nodes,
            scopes,
            gangs,
            current,
            reserved,
            lost,
        }
    })
}

/// Invariants 1 (gang), 2 (capacity), 3 (required packing) and reasons.
fn check(c: &Case, p: &Placement) -> Result<(), TestCaseError> {
    let mut by_id: HashMap<&str, &NodeInfo> = HashMap::new();
    for n in &c.nodes {
        by_id.entry(n.id.as_str()).or_insert(n);
    }
    let pending: BTreeMap<&str, &str> = p
        .pending
        .iter()
        .map(|x| (x.gang.as_str(), x.reason.as_str()))
        .collect();
    prop_assert_eq!(pending.len(), p.pending.len(), "a gang is pending twice");
    prop_assert!(pending.values().all(|r| !r.is_empty()));
    let mut owner: HashMap<&str, &Member> = HashMap::new();
    for g in &c.gangs {
        if pending.contains_key(g.key.as_str()) {
            continue;
        }
        for m in &g.members {
            prop_assert!(
                owner.insert(m.key.as_str(), m).is_none(),
                "{} placed twice",
                m.key
            );
            prop_assert!(
                p.assignments.contains_key(&m.key),
                "gang {} placed without {}",
                g.key,
                m.key
            );
        }
        let dom = |m: &Member, l: Level| {
            p.assignments
                .get(&m.key)
                .and_then(|id| by_id.get(id.as_str()))
                .map(|n| domain_key(n, l))
        };
        if let Some(l) = g.pack.required {
            let ds: BTreeSet<_> = g.members.iter().map(|m| dom(m, l)).collect();
            prop_assert!(ds.len() <= 1, "gang {} spans {} {l}s", g.key, ds.len());
        }
    }
    prop_assert!(
        p.assignments.keys().all(|k| owner.contains_key(k.as_str())),
        "stray assignment"
    );
    let mut used: HashMap<&str, (u64, u64)> = HashMap::new();
    for (k, id) in &p.assignments {
        let n = by_id.get(id.as_str()).copied();
        prop_assert!(
            n.is_some_and(|n| n.schedulable),
            "{k} on unschedulable {id}"
        );
        let m = owner[k.as_str()];
        let e = used.entry(id.as_str()).or_default();
        e.0 += u64::from(m.slots);
        e.1 += m.memory_mib;
    }
    for (id, (s, m)) in used {
        let n = by_id[id];
        let (rs, rm) = c.reserved.get(id).copied().unwrap_or((0, 0));
        prop_assert!(
            s + u64::from(rs) <= u64::from(n.slots),
            "slots exceeded on {id}"
        );
        prop_assert!(m + rm <= n.memory_mib, "memory exceeded on {id}");
    }
    for (si, s) in c.scopes.iter().enumerate() {
        if let Some(l) = s.pack.required {
            let ds: BTreeSet<String> = c
                .gangs
                .iter()
                .filter(|g| g.scopes.contains(&si) && !pending.contains_key(g.key.as_str()))
                .flat_map(|g| g.members.iter())
                .filter_map(|m| p.assignments.get(&m.key))
                .filter_map(|id| by_id.get(id.as_str()))
                .map(|n| domain_key(n, l))
                .collect();
            prop_assert!(ds.len() <= 1, "scope {} spans {} {l}s", s.key, ds.len());
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn prop_invariants_determinism_idempotence(c in case()) {
        let p = place(&c.req(&c.current));
        check(&c, &p)?;
        prop_assert_eq!(&p, &place(&c.req(&c.current)), "not deterministic");
        // Placing again from the result changes nothing (reasons included).
        let cur = as_current(&p);
        let q = place(&c.req(&cur));
        prop_assert_eq!(&p, &q, "not idempotent");

        // Lose some nodes: gangs wholly on the others stay where they are.
        let mut after = c.clone();
        for (n, &lost) in after.nodes.iter_mut().zip(&c.lost) {
            n.schedulable &= !lost;
        }
        let r = place(&after.req(&cur));
        check(&after, &r)?;
        let alive = |id: &String| after.nodes.iter().find(|n| &n.id == id).is_some_and(|n| n.schedulable);
        for g in &c.gangs {
            let on: Vec<Option<&String>> = g.members.iter().map(|m| p.assignments.get(&m.key)).collect();
            if !p.pending.iter().any(|x| x.gang == g.key) && on.iter().all(|n| n.is_some_and(alive)) {
                for m in &g.members {
                    prop_assert_eq!(r.assignments.get(&m.key), p.assignments.get(&m.key), "{} moved", m.key);
                }
            }
        }
        prop_assert_eq!(&r, &place(&after.req(&as_current(&r))), "not idempotent after a loss");
    }

    #[test]
    fn prop_adding_or_removing_a_gang_moves_nobody(c in case(), slots in 0..=3u32) {
        let p = place(&c.req(&c.current));
        let cur = as_current(&p);
        let mut more = c.clone();
        more.gangs.push(gang("new", vec![member("new.0", "a", slots), member("new.1", "b", 1)], Pack::default(), vec![0]));
        let q = place(&more.req(&cur));
        check(&more, &q)?;
        for (k, v) in &p.assignments {
            prop_assert_eq!(q.assignments.get(k), Some(v), "{} moved when a gang was added", k);
        }
        if let Some(i) = c.gangs.iter().position(|g| !p.pending.iter().any(|x| x.gang == g.key)) {
            let mut less = c.clone();
            let gone = less.gangs.remove(i);
            // (A duplicate of a removed key would take over its place.)
            let reused = less.gangs.iter().any(|g| g.members.iter().any(|m| gone.members.iter().any(|x| x.key == m.key)));
            let r = place(&less.req(&cur));
            check(&less, &r)?;
            for (k, v) in &p.assignments {
                if !reused && !gone.members.iter().any(|m| &m.key == k) && less.gangs.iter().any(|g| g.members.iter().any(|m| &m.key == k)) {
                    prop_assert_eq!(r.assignments.get(k), Some(v), "{} moved when a gang was removed", k);
                }
            }
        }
    }

    #[test]
    fn prop_spread_over_distinct_hosts(
        hosts in prop::collection::vec((0..3usize, 0..2usize, 1..=4u32), 1..=20),
        frac in 0.0..=1.0f64,
    ) {
        let nodes: Vec<NodeInfo> = hosts
            .iter()
            .enumerate()
            .map(|(i, &(r, z, s))| node(&format!("n{i}"), &format!("z{z}"), &format!("r{r}"), &format!("h{i}"), s))
            .collect();
        let n = ((hosts.len() as f64 * frac).ceil() as usize).clamp(1, hosts.len());
        let p = run(&nodes, &[], &replicas("a", n, 1, vec![]), &HashMap::new());
        prop_assert!(p.pending.is_empty());
        let distinct: BTreeSet<&String> = p.assignments.values().collect();
        prop_assert_eq!(distinct.len(), n);
    }

    #[test]
    fn prop_preferred_packing_when_a_domain_can_hold_it(
        ns in prop::collection::vec((0..3usize, 0..3usize, 0..3usize, 0..=4u32), 1..=24),
        k in 1..=6usize,
        lvl in prop_oneof![Just(Level::Zone), Just(Level::Rack), Just(Level::Host)],
    ) {
        let nodes: Vec<NodeInfo> = ns
            .iter()
            .enumerate()
            .map(|(i, &(z, r, h, s))| node(&format!("n{i}"), &format!("z{z}"), &format!("r{r}"), &format!("h{h}"), s))
            .collect();
        let mut free: BTreeMap<String, u64> = BTreeMap::new();
        for n in &nodes {
            *free.entry(domain_key(n, lvl)).or_default() += u64::from(n.slots);
        }
        let g = vec![gang("g", (0..k).map(|i| member(&format!("g.{i}"), "w", 1)).collect(), pack(None, Some(lvl)), vec![])];
        let p = run(&nodes, &[], &g, &HashMap::new());
        if free.values().any(|&f| f >= k as u64) {
            prop_assert!(p.pending.is_empty());
            let ds: BTreeSet<String> = p.assignments.values().map(|id| domain_key(node_of(&nodes, id), lvl)).collect();
            prop_assert_eq!(ds.len(), 1);
        }
    }
}

#[test]
fn huge_numbers_do_not_overflow() {
    let mut nodes = grid(u32::MAX);
    for n in &mut nodes {
        n.memory_mib = u64::MAX;
    }
    let mut gangs = replicas("a", 3, u32::MAX, vec![]);
    gangs[0].members[0].memory_mib = u64::MAX;
    gangs.push(gang(
        "g",
        (0..3)
            .map(|i| member(&format!("g.{i}"), "w", u32::MAX))
            .collect(),
        pack(Some(Level::Rack), Some(Level::Host)),
        vec![],
    ));
    let p = run(&nodes, &[], &gangs, &HashMap::new());
    assert_eq!(p.assignments.len(), 3);
    assert!(reason(&p, "g").starts_with("needs 12884901885 slots in one rack"));
}

#[test]
fn reason_scopes_that_do_not_overlap() {
    let nodes = grid(2);
    let scopes = vec![
        Scope {
            key: "a".into(),
            pack: pack(Some(Level::Rack), None),
        },
        Scope {
            key: "b".into(),
            pack: pack(Some(Level::Rack), None),
        },
    ];
    let mut gangs = replicas("a", 1, 1, vec![0]);
    gangs.extend(replicas("b", 1, 1, vec![1]));
    let current: HashMap<String, String> = [("a-0.0", "n000"), ("b-0.0", "n110")]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    gangs.push(gang(
        "both",
        vec![member("both.0", "c", 1)],
        Pack::default(),
        vec![0, 1],
    ));
    let p = run(&nodes, &scopes, &gangs, &current);
    assert_eq!(
        reason(&p, "both"),
        "scope a is packed in rack r00 (required) and scope b is packed in rack r11 (required), \
         which share no schedulable node"
    );
}

#[test]
fn selectors_pick_labelled_nodes_and_say_when_none_is() {
    let mut nodes = grid(4);
    nodes[5].labels = vec![("gpu".into(), "h200".into())];
    let mut gangs = replicas("a", 2, 1, vec![]);
    for g in &mut gangs {
        g.members[0].selector = vec![("gpu".into(), "h200".into())];
    }
    let p = run(&nodes, &[], &gangs, &HashMap::new());
    assert!(p.pending.is_empty(), "{p:?}");
    assert!(p.assignments.values().all(|n| *n == nodes[5].id), "{p:?}");
    gangs[0].members[0].selector = vec![("gpu".into(), "b200".into())];
    let p = run(&nodes, &[], &gangs, &HashMap::new());
    assert_eq!(
        reason(&p, "a-0"),
        "each a replica needs a node labelled gpu=b200; no schedulable node has those labels"
    );
}

#[test]
fn exclusive_members_take_a_node_each() {
    let nodes: Vec<NodeInfo> = grid(4).into_iter().take(2).collect();
    let mut gangs = replicas("fe", 3, 0, vec![]);
    for g in &mut gangs {
        g.members[0].exclusive = Some("frontend".into());
    }
    let p = run(&nodes, &[], &gangs, &HashMap::new());
    let used: HashSet<&String> = p.assignments.values().collect();
    assert_eq!((p.assignments.len(), used.len()), (2, 2), "{p:?}");
    assert!(
        reason(&p, "fe-2").contains("takes a node of its own"),
        "{p:?}"
    );
    // Kept where they run, and stable when placed again.
    let again = run(&nodes, &[], &gangs, &as_current(&p));
    assert_eq!(again, p);
}
