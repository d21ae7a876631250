//! What a spec places: its replicas, with stable keys, and the gangs and
//! scopes the placement engine takes.

use super::*;

impl DeploymentSpec {
    /// Every replica the spec asks for, with its stable key: `svc-i` for a
    /// standalone service, `group-j.svc-i` for a group member.
    pub fn replicas(&self) -> Vec<Replica> {
        let mut out = Vec::new();
        for s in &self.services {
            match &s.group {
                None => {
                    for i in 0..s.replicas {
                        out.push(Replica {
                            key: format!("{}-{i}", s.name),
                            service: s.name.clone(),
                            gang: format!("{}-{i}", s.name),
                        });
                    }
                }
                Some(g) => {
                    let n = self.group(g).map(|g| g.replicas).unwrap_or(0);
                    for j in 0..n {
                        for i in 0..s.replicas {
                            out.push(Replica {
                                key: format!("{g}-{j}.{}-{i}", s.name),
                                service: s.name.clone(),
                                gang: format!("{g}-{j}"),
                            });
                        }
                    }
                }
            }
        }
        out
    }

    /// The placement problem for this spec: one gang per standalone
    /// replica or group replica, scopes for the deployment's packing and
    /// each service's. Member keys are `<deployment>/<replica key>`.
    /// `startable` filters the services whose replicas are placed now
    /// (those whose `starts_after` are available).
    pub fn gangs(&self, startable: &dyn Fn(&str) -> bool) -> (Vec<Scope>, Vec<Gang>) {
        let mut scopes = Vec::new();
        let dep_scope = (self.pack != Pack::default()).then(|| {
            scopes.push(Scope {
                key: self.name.clone(),
                pack: self.pack,
            });
            scopes.len() - 1
        });
        let mut svc_scope: BTreeMap<&str, usize> = BTreeMap::new();
        for s in &self.services {
            if s.group.is_none() && s.pack != Pack::default() {
                scopes.push(Scope {
                    key: format!("{}/{}", self.name, s.name),
                    pack: s.pack,
                });
                svc_scope.insert(&s.name, scopes.len() - 1);
            }
        }
        let mut gangs: Vec<Gang> = Vec::new();
        let mut by_gang: BTreeMap<String, usize> = BTreeMap::new();
        // A group's replica starts whole: only when every member may start.
        let may_start = |s: &ServiceSpec| match &s.group {
            None => startable(&s.name),
            Some(g) => self
                .group(g)
                .is_some_and(|g| g.services.iter().all(|m| startable(m))),
        };
        for r in self.replicas() {
            let Some(s) = self.service(&r.service) else {
                continue;
            };
            if !may_start(s) {
                continue;
            }
            let member = Member {
                key: format!("{}/{}", self.name, r.key),
                service: format!("{}/{}", self.name, s.name),
                slots: s.resources.slots,
                memory_mib: s.resources.memory_mib,
                selector: s.node_selector.clone(),
                // A frontend owns its node's HTTP port and router name.
                exclusive: (s.role == Role::Frontend).then(|| "frontend".to_string()),
            };
            let gi = *by_gang.entry(r.gang.clone()).or_insert_with(|| {
                let mut sc: Vec<usize> = dep_scope.into_iter().collect();
                if let Some(i) = svc_scope.get(s.name.as_str()) {
                    sc.push(*i);
                }
                let pack = match &s.group {
                    Some(g) => self.group(g).map(|g| g.pack).unwrap_or_default(),
                    None => Pack::default(),
                };
                gangs.push(Gang {
                    key: format!("{}/{}", self.name, r.gang),
                    members: Vec::new(),
                    pack,
                    scopes: sc,
                });
                gangs.len() - 1
            });
            gangs[gi].members.push(member);
        }
        // A group member's own packing narrows its group's: the gang takes
        // the narrowest required level of its members (validated to narrow).
        for g in &mut gangs {
            for m in &g.members {
                let svc = m.service.rsplit('/').next().unwrap_or_default();
                if let Some(s) = self.service(svc) {
                    if s.group.is_some() {
                        g.pack.required = narrowest(g.pack.required, s.pack.required);
                        g.pack.preferred = narrowest(g.pack.preferred, s.pack.preferred);
                    }
                }
            }
        }
        (scopes, gangs)
    }
}

fn narrowest(a: Option<Level>, b: Option<Level>) -> Option<Level> {
    match (a, b) {
        (Some(x), Some(y)) => Some(if y.narrower_or_equal(x) { y } else { x }),
        (x, None) => x,
        (None, y) => y,
    }
}

/// One replica a spec asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Replica {
    /// Stable within the deployment: `svc-i` or `group-j.svc-i`.
    pub key: String,
    pub service: String,
    /// The gang it is placed with (itself, or its group replica).
    pub gang: String,
}
