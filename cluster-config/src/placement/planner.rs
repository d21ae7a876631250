//! The planner behind [`super::place`]: per-node and per-domain free
//! capacity and service counts, kept incrementally, so keeping, fitting and
//! spreading cost O(members × nodes) and no more.

use super::{domain_key, Gang, Level, NodeInfo, Pending, Placement, PlacementRequest, Scope};
use std::cmp::{Ordering, Reverse};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

// ---------------------------------------------------------------------------

/// FxHash: the hot maps are keyed by small integers.
#[derive(Default)]
pub(super) struct Fx(u64);

impl Fx {
    pub(super) fn add(&mut self, w: u64) {
        self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

impl Hasher for Fx {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.add(u64::from(b));
        }
    }
    fn write_u32(&mut self, i: u32) {
        self.add(u64::from(i));
    }
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }
}

pub(super) type FxMap<K, V> = HashMap<K, V, BuildHasherDefault<Fx>>;
pub(super) type FxSet<K> = HashSet<K, BuildHasherDefault<Fx>>;

/// A set of nodes: per level, the domain they must be in (None = any).
pub(super) type Cell = [Option<u32>; 3];
pub(super) const ANY: Cell = [None; 3];

pub(super) struct NodeState<'a> {
    pub(super) id: &'a str,
    pub(super) labels: &'a [(String, String)],
    /// Exclusive tags of the members placed here.
    pub(super) excl: Vec<u32>,
    pub(super) free_slots: u64,
    pub(super) free_mem: u64,
    /// What the node has in all (free or not).
    pub(super) slots: u64,
    pub(super) mem: u64,
    /// Domain per level.
    pub(super) doms: [u32; 3],
}

pub(super) struct Dom {
    pub(super) level: Level,
    pub(super) name: String,
    /// Usable nodes, by id.
    pub(super) nodes: Vec<u32>,
    pub(super) free_slots: u64,
    pub(super) free_mem: u64,
}

pub(super) struct MemberInfo<'a> {
    pub(super) key: &'a str,
    /// Its service's name (what a reason names: every replica of it waits
    /// for the same thing).
    pub(super) service: &'a str,
    pub(super) selector: &'a [(String, String)],
    pub(super) excl: Option<u32>,
    pub(super) svc: u32,
    pub(super) slots: u64,
    pub(super) mem: u64,
}

pub(super) struct GangInfo {
    /// Global member indices, in fitting order (slots desc, memory desc, key).
    pub(super) members: Vec<u32>,
    /// Deduplicated scope indices.
    pub(super) scopes: Vec<usize>,
    pub(super) invalid: Option<String>,
}

/// Where a fixed-domain constraint comes from.
#[derive(Clone, Copy, Debug)]
pub(super) enum Src {
    Gang,
    Scope(usize),
    Running,
}

pub(super) struct Filter {
    pub(super) level: Level,
    pub(super) dom: u32,
    pub(super) src: Src,
}

pub(super) struct Cons {
    /// Intersection of the fixed required domains.
    pub(super) base: Cell,
    /// Narrowest first.
    pub(super) filters: Vec<Filter>,
    /// Levels at which the members must share a domain still to be chosen.
    pub(super) split: Vec<Level>,
    /// The narrowest of `split`, and who asks for it.
    pub(super) group: Option<(Level, Src)>,
    /// Preferred domains already chosen (a scope's, the survivors').
    pub(super) fixed_prefs: Vec<(Level, u32)>,
    /// Preferred levels whose domain is still to be chosen.
    pub(super) level_prefs: Vec<Level>,
}

pub(super) struct Planner<'a> {
    pub(super) scopes: &'a [Scope],
    pub(super) gangs_in: &'a [Gang],
    pub(super) current: &'a HashMap<String, String>,
    pub(super) nodes: Vec<NodeState<'a>>,
    pub(super) all_nodes: Vec<u32>,
    pub(super) node_by_id: HashMap<&'a str, u32>,
    pub(super) doms: Vec<Dom>,
    pub(super) level_doms: [Vec<u32>; 3],
    pub(super) members: Vec<MemberInfo<'a>>,
    pub(super) member_gang: Vec<u32>,
    pub(super) gangs: Vec<GangInfo>,
    pub(super) assign: Vec<Option<u32>>,
    /// (service << 32 | domain) -> members placed there.
    pub(super) counts: FxMap<u64, u32>,
    pub(super) svc_total: Vec<u32>,
    /// Per scope, members per domain at its [required, preferred] level.
    pub(super) scope_counts: Vec<[BTreeMap<u32, u32>; 2]>,
    pub(super) scope_phrase: Vec<String>,
    pub(super) placed: Vec<bool>,
    pub(super) reasons: Vec<Option<String>>,
}

impl<'a> Planner<'a> {
    pub(super) fn new(req: &'a PlacementRequest<'a>) -> Self {
        // Usable nodes: first of their id, schedulable, not over-reserved.
        let mut seen: HashSet<&str> = HashSet::new();
        let mut usable: Vec<(&NodeInfo, u64, u64)> = Vec::new();
        for n in req.nodes {
            if !seen.insert(n.id.as_str()) || !n.schedulable {
                continue;
            }
            let (rs, rm) = req.reserved.get(&n.id).copied().unwrap_or((0, 0));
            if rs > n.slots || rm > n.memory_mib {
                continue;
            }
            usable.push((n, u64::from(n.slots - rs), n.memory_mib - rm));
        }
        usable.sort_by(|a, b| a.0.id.cmp(&b.0.id));

        let mut doms: Vec<Dom> = Vec::new();
        let mut level_doms: [Vec<u32>; 3] = Default::default();
        let mut intern: [HashMap<String, u32>; 3] = Default::default();
        let mut nodes = Vec::with_capacity(usable.len());
        let mut node_by_id = HashMap::new();
        for (i, &(n, fs, fm)) in usable.iter().enumerate() {
            let mut nd = [0u32; 3];
            for l in Level::ALL {
                let next = doms.len() as u32;
                let d = *intern[l.idx()].entry(domain_key(n, l)).or_insert(next);
                if d == next {
                    let label = n.label(l);
                    doms.push(Dom {
                        level: l,
                        name: if label.is_empty() {
                            format!("{} (no {l} label)", n.id)
                        } else {
                            label.to_string()
                        },
                        nodes: Vec::new(),
                        free_slots: 0,
                        free_mem: 0,
                    });
                    level_doms[l.idx()].push(d);
                }
                let dm = &mut doms[d as usize];
                dm.nodes.push(i as u32);
                dm.free_slots = dm.free_slots.saturating_add(fs);
                dm.free_mem = dm.free_mem.saturating_add(fm);
                nd[l.idx()] = d;
            }
            node_by_id.insert(n.id.as_str(), i as u32);
            nodes.push(NodeState {
                id: &n.id,
                labels: &n.labels,
                excl: Vec::new(),
                free_slots: fs,
                free_mem: fm,
                slots: u64::from(n.slots),
                mem: n.memory_mib,
                doms: nd,
            });
        }

        // Gangs: check, intern services, order members for fitting.
        let mut services: HashMap<&str, u32> = HashMap::new();
        let mut tags: HashMap<&str, u32> = HashMap::new();
        let mut owner: HashMap<&str, usize> = HashMap::new();
        let mut members = Vec::new();
        let mut member_gang = Vec::new();
        let mut gangs = Vec::with_capacity(req.gangs.len());
        for (gi, g) in req.gangs.iter().enumerate() {
            let mut invalid = g.scopes.iter().find(|&&s| s >= req.scopes.len()).map(|s| {
                format!(
                    "scope index {s} is out of range (the request has {} scopes)",
                    req.scopes.len()
                )
            });
            if invalid.is_none() {
                let mut local: HashSet<&str> = HashSet::new();
                for m in &g.members {
                    if let Some(&o) = owner.get(m.key.as_str()) {
                        invalid = Some(format!(
                            "duplicate member key {} (already in gang {})",
                            m.key, req.gangs[o].key
                        ));
                        break;
                    }
                    if !local.insert(m.key.as_str()) {
                        invalid = Some(format!("duplicate member key {} within the gang", m.key));
                        break;
                    }
                }
            }
            let mut ms: Vec<u32> = Vec::new();
            if invalid.is_none() {
                for m in &g.members {
                    owner.insert(m.key.as_str(), gi);
                    let next = services.len() as u32;
                    let svc = *services.entry(m.service.as_str()).or_insert(next);
                    ms.push(members.len() as u32);
                    let excl = m.exclusive.as_deref().map(|t| {
                        let next = tags.len() as u32;
                        *tags.entry(t).or_insert(next)
                    });
                    members.push(MemberInfo {
                        key: &m.key,
                        service: &m.service,
                        selector: &m.selector,
                        excl,
                        svc,
                        slots: u64::from(m.slots),
                        mem: m.memory_mib,
                    });
                    member_gang.push(gi as u32);
                }
                ms.sort_by(|&a, &b| {
                    let (a, b) = (&members[a as usize], &members[b as usize]);
                    (Reverse(a.slots), Reverse(a.mem), a.key).cmp(&(
                        Reverse(b.slots),
                        Reverse(b.mem),
                        b.key,
                    ))
                });
            }
            let mut scopes = g.scopes.clone();
            scopes.sort_unstable();
            scopes.dedup();
            gangs.push(GangInfo {
                members: ms,
                scopes,
                invalid,
            });
        }

        // How reasons name a scope: "service x" when it holds one service
        // named like it, "deployment x" when its services are "x/...".
        let mut svc_of_scope: Vec<(bool, bool)> = vec![(true, true); req.scopes.len()];
        for (g, info) in req.gangs.iter().zip(&gangs) {
            if info.invalid.is_some() {
                continue;
            }
            for &s in &info.scopes {
                let key = &req.scopes[s].key;
                for m in &g.members {
                    let e = &mut svc_of_scope[s];
                    e.0 &= m.service == *key;
                    e.1 &= m
                        .service
                        .strip_prefix(key.as_str())
                        .is_some_and(|r| r.starts_with('/'));
                }
            }
        }
        let scope_phrase = req
            .scopes
            .iter()
            .zip(&svc_of_scope)
            .map(|(s, &(svc, dep))| match (s.key.contains(' '), svc, dep) {
                (true, _, _) => s.key.clone(),
                (_, true, _) => format!("service {}", s.key),
                (_, _, true) => format!("deployment {}", s.key),
                _ => format!("scope {}", s.key),
            })
            .collect();

        let n_members = members.len();
        Planner {
            scopes: req.scopes,
            gangs_in: req.gangs,
            current: req.current,
            all_nodes: (0..nodes.len() as u32).collect(),
            nodes,
            node_by_id,
            doms,
            level_doms,
            members,
            member_gang,
            placed: vec![false; gangs.len()],
            reasons: vec![None; gangs.len()],
            gangs,
            assign: vec![None; n_members],
            counts: FxMap::default(),
            svc_total: vec![0; services.len()],
            scope_counts: (0..req.scopes.len()).map(|_| Default::default()).collect(),
            scope_phrase,
        }
    }

    pub(super) fn run(&mut self) {
        // Phase 1: keep what runs, then repair the gangs that lost members.
        let running = self.keep_running();
        let mut was_running = vec![false; self.gangs.len()];
        for (g, kept) in running {
            was_running[g] = true;
            let all = self.gangs[g].members.clone();
            if kept.len() == all.len() {
                self.placed[g] = true;
                continue;
            }
            if !kept.is_empty() {
                let missing: Vec<u32> = all
                    .iter()
                    .copied()
                    .filter(|&m| self.assign[m as usize].is_none())
                    .collect();
                if self.try_place(g, &missing, &kept).is_ok() {
                    self.placed[g] = true;
                    continue;
                }
                for &m in &kept {
                    self.take(m);
                }
            }
            self.place_whole(g);
        }
        // Phase 2: new gangs, in priority order.
        for (g, was) in was_running.into_iter().enumerate() {
            if !was && self.gangs[g].invalid.is_none() {
                self.place_whole(g);
            }
        }
        // Pending gangs again against the final state, until nothing changes,
        // so reasons describe the final state and placing the result again
        // gives the same result.
        loop {
            let mut changed = false;
            for g in 0..self.gangs.len() {
                if !self.placed[g] && self.gangs[g].invalid.is_none() {
                    changed |= self.place_whole(g);
                }
            }
            if !changed {
                break;
            }
        }
    }

    pub(super) fn finish(self) -> Placement {
        let mut out = Placement::default();
        for (g, info) in self.gangs.iter().enumerate() {
            if self.placed[g] {
                for &m in &info.members {
                    if let Some(n) = self.assign[m as usize] {
                        out.assignments.insert(
                            self.members[m as usize].key.to_string(),
                            self.nodes[n as usize].id.to_string(),
                        );
                    }
                }
            } else {
                let reason = info.invalid.clone().or_else(|| self.reasons[g].clone());
                out.pending.push(Pending {
                    gang: self.gangs_in[g].key.clone(),
                    reason: reason.unwrap_or_else(|| "not placed".to_string()),
                });
            }
        }
        out
    }

    pub(super) fn current_node(&self, m: u32) -> Option<u32> {
        let id = self.current.get(self.members[m as usize].key)?;
        self.node_by_id.get(id.as_str()).copied()
    }

    /// Commits the members that may stay, gang by gang in priority order;
    /// returns the gangs with any current member and the members kept.
    pub(super) fn keep_running(&mut self) -> Vec<(usize, Vec<u32>)> {
        // A required scope's domain: the one holding most current members.
        let mut votes: Vec<BTreeMap<u32, u32>> = vec![BTreeMap::new(); self.scopes.len()];
        for info in self.gangs.iter().filter(|i| i.invalid.is_none()) {
            for &s in &info.scopes {
                if let Some(l) = self.scopes[s].pack.required {
                    for &m in &info.members {
                        if let Some(n) = self.current_node(m) {
                            *votes[s]
                                .entry(self.nodes[n as usize].doms[l.idx()])
                                .or_insert(0) += 1;
                        }
                    }
                }
            }
        }
        let scope_dom: Vec<Option<u32>> = votes.iter().map(|v| self.majority(v)).collect();

        let mut out = Vec::new();
        for g in 0..self.gangs.len() {
            let info = &self.gangs[g];
            if info.invalid.is_some()
                || !info
                    .members
                    .iter()
                    .any(|&m| self.current.contains_key(self.members[m as usize].key))
            {
                continue;
            }
            let mut surv: Vec<(u32, u32)> = info
                .members
                .iter()
                .filter_map(|&m| self.current_node(m).map(|n| (m, n)))
                .filter(|&(_, n)| {
                    info.scopes.iter().all(|&s| {
                        match (self.scopes[s].pack.required, scope_dom[s]) {
                            (Some(l), Some(d)) => self.nodes[n as usize].doms[l.idx()] == d,
                            _ => true,
                        }
                    })
                })
                .collect();
            if let Some(l) = self.gangs_in[g].pack.required {
                let mut v = BTreeMap::new();
                for &(_, n) in &surv {
                    *v.entry(self.nodes[n as usize].doms[l.idx()]).or_insert(0) += 1;
                }
                let best = self.majority(&v);
                surv.retain(|&(_, n)| Some(self.nodes[n as usize].doms[l.idx()]) == best);
            }
            out.push((g, surv));
        }
        out.into_iter()
            .map(|(g, surv)| {
                let mut kept = Vec::new();
                for (m, n) in surv {
                    if self.fits(m, n) {
                        self.put(m, n);
                        kept.push(m);
                    }
                }
                (g, kept)
            })
            .collect()
    }

    /// The domain with most members (ties: name, then index).
    pub(super) fn majority(&self, votes: &BTreeMap<u32, u32>) -> Option<u32> {
        let mut best: Option<(u32, u32)> = None;
        for (&d, &c) in votes {
            if c == 0 {
                continue;
            }
            best = match best {
                Some((bd, bc))
                    if bc > c
                        || (bc == c
                            && self.doms[bd as usize].name <= self.doms[d as usize].name) =>
                {
                    Some((bd, bc))
                }
                _ => Some((d, c)),
            };
        }
        best.map(|(d, _)| d)
    }

    pub(super) fn fits(&self, m: u32, n: u32) -> bool {
        let (mi, node) = (&self.members[m as usize], &self.nodes[n as usize]);
        node.free_slots >= mi.slots && node.free_mem >= mi.mem && self.eligible(m, n)
    }

    /// The node has the member's labels and no member of its exclusive tag.
    pub(super) fn eligible(&self, m: u32, n: u32) -> bool {
        let (mi, node) = (&self.members[m as usize], &self.nodes[n as usize]);
        mi.selector.iter().all(|l| node.labels.contains(l))
            && mi.excl.is_none_or(|t| !node.excl.contains(&t))
    }

    pub(super) fn put(&mut self, m: u32, n: u32) {
        self.adjust(m, n, true);
        self.assign[m as usize] = Some(n);
    }

    pub(super) fn take(&mut self, m: u32) {
        if let Some(n) = self.assign[m as usize].take() {
            self.adjust(m, n, false);
        }
    }

    pub(super) fn adjust(&mut self, m: u32, n: u32, add: bool) {
        let mi = &self.members[m as usize];
        let (svc, slots, mem) = (mi.svc, mi.slots, mi.mem);
        let excl = mi.excl;
        let node = &mut self.nodes[n as usize];
        if let Some(t) = excl {
            if add {
                node.excl.push(t);
            } else if let Some(i) = node.excl.iter().position(|&x| x == t) {
                node.excl.swap_remove(i);
            }
        }
        let doms = node.doms;
        let change = |v: &mut u64, by: u64| {
            *v = if add {
                v.saturating_sub(by)
            } else {
                v.saturating_add(by)
            }
        };
        change(&mut node.free_slots, slots);
        change(&mut node.free_mem, mem);
        for d in doms {
            let dm = &mut self.doms[d as usize];
            change(&mut dm.free_slots, slots);
            change(&mut dm.free_mem, mem);
            bump(
                self.counts
                    .entry(u64::from(svc) << 32 | u64::from(d))
                    .or_insert(0),
                add,
            );
        }
        bump(&mut self.svc_total[svc as usize], add);
        let g = self.member_gang[m as usize] as usize;
        for &s in &self.gangs[g].scopes {
            let pack = self.scopes[s].pack;
            for (i, l) in [pack.required, pack.preferred].into_iter().enumerate() {
                if let Some(l) = l {
                    bump(
                        self.scope_counts[s][i].entry(doms[l.idx()]).or_insert(0),
                        add,
                    );
                }
            }
        }
    }

    pub(super) fn count(&self, svc: u32, d: u32) -> u32 {
        self.counts
            .get(&(u64::from(svc) << 32 | u64::from(d)))
            .copied()
            .unwrap_or(0)
    }

    pub(super) fn place_whole(&mut self, g: usize) -> bool {
        let ms = self.gangs[g].members.clone();
        match self.try_place(g, &ms, &[]) {
            Ok(()) => {
                self.placed[g] = true;
                self.reasons[g] = None;
                true
            }
            Err(r) => {
                self.reasons[g] = Some(r);
                false
            }
        }
    }

    /// Places `ms` (members of gang `g`) beside the placed `survivors`, or
    /// explains why not (leaving the state as it was).
    pub(super) fn try_place(
        &mut self,
        g: usize,
        ms: &[u32],
        survivors: &[u32],
    ) -> Result<(), String> {
        if ms.is_empty() {
            return Ok(());
        }
        let cons = self.constraints(g, ms.len(), survivors)?;
        let (need_s, need_m) = self.need(ms);
        let mut containers: Vec<Cell> = Vec::new();
        for &(l, d) in &cons.fixed_prefs {
            // A level already fixed leaves nothing to prefer.
            if cons.base[l.idx()].is_none() {
                let mut c = cons.base;
                c[l.idx()] = Some(d);
                if !containers.contains(&c) {
                    containers.push(c);
                }
            }
        }
        if !containers.contains(&cons.base) {
            containers.push(cons.base);
        }
        let mut tried: FxSet<Cell> = FxSet::default();
        for c in containers {
            let fixed = Level::ALL.into_iter().filter(|l| c[l.idx()].is_some());
            let narrowest = fixed.chain(cons.split.iter().copied()).max();
            for &p in &cons.level_prefs {
                if c[p.idx()].is_some() || narrowest.is_some_and(|n| p <= n) {
                    continue;
                }
                let mut levels = cons.split.clone();
                levels.push(p);
                for (r, _, _) in self.cells(c, &levels, need_s, need_m) {
                    if tried.insert(r) && self.fit(ms, &r) {
                        return Ok(());
                    }
                }
            }
            let regions = if cons.split.is_empty() {
                vec![c]
            } else {
                self.cells(c, &cons.split, need_s, need_m)
                    .into_iter()
                    .map(|x| x.0)
                    .collect()
            };
            for r in regions {
                if tried.insert(r) && self.fit(ms, &r) {
                    return Ok(());
                }
            }
        }
        Err(self.explain(ms, &cons))
    }

    pub(super) fn need(&self, ms: &[u32]) -> (u64, u64) {
        ms.iter().fold((0, 0), |(s, m), &i| {
            let mi = &self.members[i as usize];
            (s.saturating_add(mi.slots), m.saturating_add(mi.mem))
        })
    }

    pub(super) fn constraints(
        &self,
        g: usize,
        n: usize,
        survivors: &[u32],
    ) -> Result<Cons, String> {
        let pack = self.gangs_in[g].pack;
        let mut filters = Vec::new();
        let mut groups: Vec<(Level, Src)> = Vec::new();
        let mut fixed_prefs = Vec::new();
        let mut level_prefs = Vec::new();
        let surv_node = |m: u32| self.assign[m as usize];
        if let Some(l) = pack.preferred {
            let mut v = BTreeMap::new();
            for n in survivors.iter().filter_map(|&m| surv_node(m)) {
                *v.entry(self.nodes[n as usize].doms[l.idx()]).or_insert(0) += 1;
            }
            match self.majority(&v) {
                Some(d) => fixed_prefs.push((l, d)),
                None if n > 1 => level_prefs.push(l),
                None => {}
            }
        }
        if let Some(l) = pack.required {
            match survivors.iter().find_map(|&m| surv_node(m)) {
                Some(node) => filters.push(Filter {
                    level: l,
                    dom: self.nodes[node as usize].doms[l.idx()],
                    src: Src::Running,
                }),
                None if n > 1 => groups.push((l, Src::Gang)),
                None => {}
            }
        }
        for &s in &self.gangs[g].scopes {
            let sp = self.scopes[s].pack;
            if let Some(l) = sp.required {
                match self.majority(&self.scope_counts[s][0]) {
                    Some(d) => filters.push(Filter {
                        level: l,
                        dom: d,
                        src: Src::Scope(s),
                    }),
                    None => groups.push((l, Src::Scope(s))),
                }
            }
            if let Some(l) = sp.preferred {
                match self.majority(&self.scope_counts[s][1]) {
                    Some(d) => fixed_prefs.push((l, d)),
                    None => level_prefs.push(l),
                }
            }
        }
        filters.sort_by_key(|f| Reverse(f.level));
        let mut base = ANY;
        for f in &filters {
            match base[f.level.idx()] {
                Some(d) if d != f.dom => return Err(self.conflict(&filters)),
                _ => base[f.level.idx()] = Some(f.dom),
            }
        }
        if filters.len() > 1 && self.inside(&base).next().is_none() {
            return Err(self.conflict(&filters));
        }
        let mut split: Vec<Level> = groups
            .iter()
            .map(|g| g.0)
            .filter(|l| base[l.idx()].is_none())
            .collect();
        split.sort_unstable();
        split.dedup();
        let group = groups
            .iter()
            .filter(|g| base[g.0.idx()].is_none())
            .max_by_key(|g| (g.0, matches!(g.1, Src::Scope(_))))
            .copied();
        level_prefs.sort_unstable();
        level_prefs.dedup();
        Ok(Cons {
            base,
            filters,
            split,
            group,
            fixed_prefs,
            level_prefs,
        })
    }

    pub(super) fn cell_nodes(&self, c: &Cell) -> &[u32] {
        match c.iter().rev().flatten().next() {
            Some(&d) => &self.doms[d as usize].nodes,
            None => &self.all_nodes,
        }
    }

    pub(super) fn in_cell(&self, n: u32, c: &Cell) -> bool {
        let doms = &self.nodes[n as usize].doms;
        c.iter()
            .zip(doms)
            .all(|(want, have)| want.is_none_or(|w| w == *have))
    }

    /// The sub-cells of `c` splitting it by the domains at `levels`, with at
    /// least the given free capacity, most free slots first, then by name.
    pub(super) fn cells(
        &self,
        c: Cell,
        levels: &[Level],
        need_s: u64,
        need_m: u64,
    ) -> Vec<(Cell, u64, u64)> {
        let mut found: Vec<(Cell, u64, u64)> = Vec::new();
        if c == ANY && levels.len() == 1 {
            for &d in &self.level_doms[levels[0].idx()] {
                let dm = &self.doms[d as usize];
                let mut k = ANY;
                k[levels[0].idx()] = Some(d);
                found.push((k, dm.free_slots, dm.free_mem));
            }
        } else {
            let mut map: BTreeMap<Cell, (u64, u64)> = BTreeMap::new();
            for n in self.inside(&c) {
                let node = &self.nodes[n as usize];
                let mut k = c;
                for l in levels {
                    k[l.idx()] = Some(node.doms[l.idx()]);
                }
                let e = map.entry(k).or_default();
                *e = (
                    e.0.saturating_add(node.free_slots),
                    e.1.saturating_add(node.free_mem),
                );
            }
            found.extend(map.into_iter().map(|(k, (s, m))| (k, s, m)));
        }
        found.retain(|&(_, s, m)| s >= need_s && m >= need_m);
        found.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| self.cmp_cells(&a.0, &b.0)));
        found
    }

    pub(super) fn cmp_cells(&self, a: &Cell, b: &Cell) -> Ordering {
        let name = |d: &Option<u32>| d.map(|d| self.doms[d as usize].name.as_str());
        a.iter()
            .map(name)
            .cmp(b.iter().map(name))
            .then_with(|| a.cmp(b))
    }

    /// First fit of `ms` (in order) into cell `c`, each on its best node by
    /// the spread key; all or nothing.
    pub(super) fn fit(&mut self, ms: &[u32], c: &Cell) -> bool {
        for (i, &m) in ms.iter().enumerate() {
            match self.best_node(m, c) {
                Some(n) => self.put(m, n),
                None => {
                    for &p in &ms[..i] {
                        self.take(p);
                    }
                    return false;
                }
            }
        }
        true
    }

    pub(super) fn best_node(&self, m: u32, c: &Cell) -> Option<u32> {
        let mi = &self.members[m as usize];
        let spread = self.svc_total[mi.svc as usize] > 0;
        // (host, rack, zone counts), free slots, node.
        let mut best: Option<([u32; 3], u64, u32)> = None;
        for &n in self.cell_nodes(c) {
            let node = &self.nodes[n as usize];
            if node.free_slots < mi.slots
                || node.free_mem < mi.mem
                || !self.in_cell(n, c)
                || !self.eligible(m, n)
            {
                continue;
            }
            let mut k = [0u32; 3];
            if spread {
                let mut worse = false;
                for (i, l) in [2usize, 1, 0].into_iter().enumerate() {
                    k[i] = self.count(mi.svc, node.doms[l]);
                    if let Some((bk, _, _)) = &best {
                        if k[..=i] > bk[..=i] {
                            worse = true;
                            break;
                        }
                    }
                }
                if worse {
                    continue;
                }
            }
            let cand = (k, node.free_slots, n);
            let better = match &best {
                None => true,
                Some(b) => (cand.0, Reverse(cand.1), cand.2) < (b.0, Reverse(b.1), b.2),
            };
            if better {
                best = Some(cand);
            }
        }
        best.map(|b| b.2)
    }
}

pub(super) fn bump(v: &mut u32, add: bool) {
    *v = if add { *v + 1 } else { v.saturating_sub(1) };
}
