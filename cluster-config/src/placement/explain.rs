//! The reasons a gang stays pending, for people: they name the constraint
//! and the numbers (slots, MiB, zone/rack/host).

use super::planner::{Cell, Cons, Filter, Planner, Src};

impl Planner<'_> {
    pub(super) fn dom_phrase(&self, d: u32) -> String {
        let dm = &self.doms[d as usize];
        format!("{} {}", dm.level, dm.name)
    }

    pub(super) fn filter_desc(&self, f: &Filter) -> String {
        let at = self.dom_phrase(f.dom);
        match f.src {
            Src::Scope(s) => format!("{} is packed in {at} (required)", self.scope_phrase[s]),
            Src::Running => format!(
                "its running members are in {at} (required {} packing)",
                f.level
            ),
            Src::Gang => format!("the gang is packed in {at} (required)"),
        }
    }

    pub(super) fn conflict(&self, filters: &[Filter]) -> String {
        let parts: Vec<String> = filters.iter().map(|f| self.filter_desc(f)).collect();
        format!("{}, which share no schedulable node", parts.join(" and "))
    }

    pub(super) fn inside<'s>(&'s self, c: &'s Cell) -> impl Iterator<Item = u32> + 's {
        self.cell_nodes(c)
            .iter()
            .copied()
            .filter(move |&n| self.in_cell(n, c))
    }

    pub(super) fn free_sum(&self, nodes: impl Iterator<Item = u32>) -> (u64, u64) {
        nodes.fold((0, 0), |(s, m), n| {
            let node = &self.nodes[n as usize];
            (
                s.saturating_add(node.free_slots),
                m.saturating_add(node.free_mem),
            )
        })
    }

    pub(super) fn max_free(&self, nodes: impl Iterator<Item = u32>) -> (u64, u64) {
        nodes.fold((0, 0), |(s, m), n| {
            let node = &self.nodes[n as usize];
            (s.max(node.free_slots), m.max(node.free_mem))
        })
    }

    pub(super) fn explain(&self, ms: &[u32], cons: &Cons) -> String {
        if self.nodes.is_empty() {
            return "no schedulable nodes".to_string();
        }
        let (need_s, need_m) = self.need(ms);
        let (max_s, max_m) = self.max_free(self.all_nodes.iter().copied());
        for &m in ms {
            let mi = &self.members[m as usize];
            let sel: Vec<String> = mi
                .selector
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            let labelled = |n: &u32| {
                mi.selector
                    .iter()
                    .all(|l| self.nodes[*n as usize].labels.contains(l))
            };
            if !self.all_nodes.iter().any(labelled) {
                return format!(
                    "each {} replica needs a node labelled {}; no schedulable node has those labels",
                    mi.service,
                    sel.join(",")
                );
            }
            if !self.all_nodes.iter().any(|&n| self.eligible(m, n)) {
                let on = if sel.is_empty() {
                    String::new()
                } else {
                    format!(" labelled {}", sel.join(","))
                };
                return format!(
                    "each {} replica takes a node of its own (one per node), and every schedulable node{on} has one",
                    mi.service
                );
            }
            if !self.all_nodes.iter().any(|&n| self.fits(m, n)) {
                // Waiting helps only if some node could hold it when empty.
                let never = !self.all_nodes.iter().any(|&n| {
                    let node = &self.nodes[n as usize];
                    node.slots >= mi.slots && node.mem >= mi.mem
                });
                return format!(
                    "each {} replica needs {} slots and {} MiB; the most free on one schedulable node is {}{}",
                    mi.service,
                    mi.slots,
                    mi.mem,
                    most_free(max_s, max_m, mi.slots, mi.mem),
                    if never {
                        "; no schedulable node has that much in all, so it waits for a larger node"
                    } else {
                        ""
                    }
                );
            }
        }
        let (tot_s, tot_m) = self.free_sum(self.all_nodes.iter().copied());
        if need_s > tot_s {
            return format!("needs {need_s} slots in all; {tot_s} are free on schedulable nodes");
        }
        if need_m > tot_m {
            return format!("needs {need_m} MiB in all; {tot_m} MiB are free on schedulable nodes");
        }
        let mut within = String::new();
        if let Some(f) = cons.filters.first() {
            let subject = self.filter_desc(f);
            let inside: Vec<u32> = self.inside(&cons.base).collect();
            let (fs, fm) = self.free_sum(inside.iter().copied());
            if fs < need_s {
                return format!("{subject}, which has {}; needs {need_s}", free_slots(fs));
            }
            if fm < need_m {
                return format!("{subject}, which has {fm} MiB free; needs {need_m} MiB");
            }
            let (bs, bm) = self.max_free(inside.iter().copied());
            for &m in ms {
                let mi = &self.members[m as usize];
                if !inside.iter().any(|&n| self.fits(m, n)) {
                    return format!(
                        "{subject}; each {} replica needs {} slots and {} MiB; the most free on one node there is {}",
                        mi.service,
                        mi.slots,
                        mi.mem,
                        most_free(bs, bm, mi.slots, mi.mem)
                    );
                }
            }
            within = format!(" within {}", self.dom_phrase(f.dom));
        }
        if let Some((gl, src)) = cons.group {
            let cells = self.cells(cons.base, &cons.split, 0, 0);
            let big_s = cells.iter().map(|c| c.1).max().unwrap_or(0);
            let big_m = cells.iter().map(|c| c.2).max().unwrap_or(0);
            let prefix = match src {
                Src::Scope(s) => format!(
                    "{} is packed in one {gl} (required): ",
                    self.scope_phrase[s]
                ),
                _ => String::new(),
            };
            if big_s < need_s {
                return format!("{prefix}needs {need_s} slots in one {gl}; the largest free {gl} has {big_s}{within}");
            }
            if big_m < need_m {
                return format!(
                    "{prefix}needs {need_m} MiB in one {gl}; the largest free {gl} has {big_m} MiB{within}"
                );
            }
            return format!(
                "{prefix}no single {gl}{within} fits all {} members ({need_s} slots, {need_m} MiB): its free slots are split over nodes too small for them",
                ms.len()
            );
        }
        format!(
            "the {} members ({need_s} slots, {need_m} MiB) do not fit together on the free nodes{within}: the free slots are split over nodes too small for them",
            ms.len()
        )
    }
}

fn most_free(max_s: u64, max_m: u64, s: u64, m: u64) -> String {
    match (max_s < s, max_m < m) {
        (true, false) => format!("{max_s} slots"),
        (false, true) => format!("{max_m} MiB"),
        (true, true) => format!("{max_s} slots and {max_m} MiB"),
        (false, false) => format!("{max_s} slots or {max_m} MiB, not both"),
    }
}

fn free_slots(n: u64) -> String {
    if n == 1 {
        "1 free slot".to_string()
    } else {
        format!("{n} free slots")
    }
}
