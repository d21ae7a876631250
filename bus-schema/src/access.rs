//! Who may publish and read what on the bus: one NATS user per role and
//! namespace, and the subject permissions of each.
//!
//! The matrix is [`permissions`]; [`accounts`] renders it as a nats-server
//! `accounts` block (one account per namespace) naming each user by its
//! nkey, and [`allows`] answers it the way the server would (tests check
//! the two agree against a real server).
//!
//! Invariants:
//! - each namespace is a NATS account of its own: nothing of one namespace
//!   is reachable with a credential of another, the admin's included;
//! - within it, every subject, stream and inbox a non-admin role is
//!   allowed lies in its own namespace (`dynamo.<ns>.…`, `dynamo_<ns>_…`
//!   streams, `_INBOX.<ns>.…`);
//! - a worker may publish neither a request to a worker
//!   (`worker.*.generate`), nor on router subjects (`router.…`), nor the
//!   gateways' traffic summaries, nor into the desired state (deployments,
//!   assignments, controller, planner, pins), nor subscribe to a gateway's
//!   frames, nor make streams or consumers (see [`stream_api`] for why
//!   consumers matter);
//! - only the admin role may delete or purge a stream it does not own.
//!
//! What a static matrix cannot say: workers of one namespace share a user,
//! so one worker may subscribe to another's subjects or overwrite another's
//! registration; and a role that may make consumers (router, gateway,
//! node, controller, planner) may deliver a stream's messages to any
//! subject of its namespace. Per-instance users would need the server
//! reloaded at every scale; the namespace (account) and the role are the
//! boundary here.

use crate::subjects::{Namespace, Subjects};
use std::fmt;
use std::str::FromStr;

/// A kind of process that connects to NATS.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// The OpenAI HTTP edge.
    Gateway,
    /// The KV-aware router beside a gateway.
    Router,
    /// An engine's worker.
    Worker,
    /// The node daemon itself (registration, assignments, weights, faults).
    Node,
    /// The placement controller.
    Controller,
    /// The deployments' planners.
    Planner,
    /// `dynamoctl`: an operator, allowed everything.
    Admin,
}

impl Role {
    pub const ALL: [Role; 7] = [
        Role::Gateway,
        Role::Router,
        Role::Worker,
        Role::Node,
        Role::Controller,
        Role::Planner,
        Role::Admin,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Gateway => "gateway",
            Role::Router => "router",
            Role::Worker => "worker",
            Role::Node => "node",
            Role::Controller => "controller",
            Role::Planner => "planner",
            Role::Admin => "admin",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Role::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| {
                format!(
                    "unknown role {s:?} (roles: {})",
                    Role::ALL.map(|r| r.as_str()).join(", ")
                )
            })
    }
}

/// The inbox prefix a role's connections use (`_INBOX.<ns>.<role>`): its
/// replies come back there, and only it may read them.
pub fn inbox_prefix(role: Role, ns: &Namespace) -> String {
    format!("_INBOX.{}.{}", ns.as_str(), role.as_str())
}

/// Subjects a user may publish to and subscribe to (NATS wildcards).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Permissions {
    pub publish: Vec<String>,
    pub subscribe: Vec<String>,
}

/// How a role uses one JetStream stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Use {
    /// Look it up (stream info) and nothing else.
    Info,
    /// Info, and write KV entries or objects, without reading any.
    Put,
    /// Look up, get messages, make consumers (watch, keys, replay).
    Read,
    /// Read, and create the stream if missing or raise its replicas
    /// (every opener may be first), but write nothing.
    Open,
    /// Open, and write: KV puts and deletes (`$KV.<bucket>.>`), object
    /// puts (`$O.<bucket>.>`, whose replacement purges old chunks).
    Write,
}

impl Use {
    fn reads(self) -> bool {
        matches!(self, Use::Read | Use::Open | Use::Write)
    }
    fn opens(self) -> bool {
        matches!(self, Use::Open | Use::Write)
    }
    fn writes(self) -> bool {
        matches!(self, Use::Put | Use::Write)
    }
}

/// The JetStream API subjects for one stream.
///
/// Making consumers is a read right, but a strong one: a consumer's
/// deliver subject is not checked against its maker's publish rights
/// (nats-server#8274), so whoever may make consumers on a stream can
/// deliver its messages to any subject of the account. Roles that need no
/// reads (workers) get none.
fn stream_api(stream: &str, how: Use, p: &mut Permissions) {
    let api = |verb: &str| format!("$JS.API.{verb}.{stream}");
    p.publish.push(api("STREAM.INFO"));
    if how.reads() {
        for verb in [
            "STREAM.MSG.GET",
            "DIRECT.GET",
            "CONSUMER.CREATE",
            "CONSUMER.DURABLE.CREATE",
        ] {
            p.publish.push(api(verb));
        }
        for verb in [
            "DIRECT.GET",
            "CONSUMER.CREATE",
            "CONSUMER.DURABLE.CREATE",
            "CONSUMER.INFO",
            "CONSUMER.DELETE",
            "CONSUMER.MSG.NEXT",
        ] {
            p.publish.push(format!("{}.>", api(verb)));
        }
        p.publish.push(format!("$JS.ACK.{stream}.>"));
        p.publish.push(format!("$JS.FC.{stream}.>"));
    }
    if how.opens() {
        p.publish.push(api("STREAM.CREATE"));
        p.publish.push(api("STREAM.UPDATE"));
    }
}

fn kv(bucket: &str, how: Use, p: &mut Permissions) {
    stream_api(&format!("KV_{bucket}"), how, p);
    if how.writes() {
        p.publish.push(format!("$KV.{bucket}.>"));
    }
}

fn objects(bucket: &str, how: Use, p: &mut Permissions) {
    let stream = format!("OBJ_{bucket}");
    stream_api(&stream, how, p);
    if how.writes() {
        p.publish.push(format!("$O.{bucket}.>"));
        p.publish.push(format!("$JS.API.STREAM.PURGE.{stream}"));
    }
}

/// The permissions of `role` in the namespace of `s`.
pub fn permissions(role: Role, s: &Subjects) -> Permissions {
    let ns = s.namespace().as_str();
    let base = format!("dynamo.{ns}");
    let mut p = Permissions::default();
    if role == Role::Admin {
        // The operator's CLI: every stream, bucket and event of its
        // namespace (its account: nothing of another).
        p.publish.push(">".into());
        p.subscribe.push(">".into());
        return p;
    }
    // Every role: its own inbox, replies into the namespace's inboxes, and
    // JetStream's account and API info.
    p.subscribe
        .push(format!("{}.>", inbox_prefix(role, s.namespace())));
    p.publish.push(format!("_INBOX.{ns}.>"));
    p.publish.push("$JS.API.INFO".into());
    let w = "*";
    match role {
        Role::Gateway => {
            p.publish.push(format!("{base}.worker.{w}.generate"));
            p.publish.push(format!("{base}.worker.{w}.cancel"));
            p.publish.push(format!("{base}.worker.{w}.artifact"));
            p.publish.push(s.frontend_metrics());
            p.subscribe.push(format!("{base}.gateway.{w}.frames"));
            // The cluster page reads planner decisions.
            kv(&s.planner_bucket(), Use::Read, &mut p);
        }
        Role::Router => {
            p.publish.push(format!("{base}.router.>"));
            p.publish.push(format!("{base}.worker.{w}.kv_dump"));
            p.subscribe.push(format!("{base}.router.>"));
            p.subscribe.push(s.load_all());
            p.subscribe.push(s.kv_events_all());
            kv(&s.workers_bucket(), Use::Open, &mut p);
            stream_api(&s.kv_events_stream(), Use::Open, &mut p);
            objects(&s.router_state_objects(), Use::Write, &mut p);
        }
        Role::Worker => {
            // Frames go where the request said, which must be a gateway.
            p.publish.push(format!("{base}.gateway.{w}.frames"));
            p.publish.push(format!("{base}.load.{w}"));
            p.publish.push(format!("{base}.kv.{w}"));
            p.publish.push(s.worker_metrics());
            // Disaggregation: a decode worker asks a prefill worker, which
            // tells the decode worker its blocks are written.
            p.publish.push(format!("{base}.worker.{w}.prefill"));
            p.publish.push(format!("{base}.worker.{w}.transfer"));
            p.publish.push(format!("{base}.worker.{w}.cancel"));
            p.subscribe.push(format!("{base}.worker.{w}.*"));
            // Its registration, written blind; the node makes the bucket
            // and the event stream before any worker starts.
            kv(&s.workers_bucket(), Use::Put, &mut p);
            stream_api(&s.kv_events_stream(), Use::Info, &mut p);
        }
        Role::Node => {
            p.subscribe.push(format!("{base}.node.{w}.fault"));
            p.subscribe.push(format!("{base}.node.{w}.presence"));
            // Made here for its workers, which may not make streams.
            kv(&s.workers_bucket(), Use::Open, &mut p);
            stream_api(&s.kv_events_stream(), Use::Open, &mut p);
            kv(&s.nodes_bucket(), Use::Write, &mut p);
            kv(&s.assignments_bucket(), Use::Open, &mut p);
            kv(&s.weights_bucket(), Use::Write, &mut p);
            objects(&s.weights_objects(), Use::Open, &mut p);
        }
        Role::Controller => {
            p.publish.push(format!("{base}.node.{w}.presence"));
            for b in [
                s.assignments_bucket(),
                s.controller_bucket(),
                s.deploy_status_bucket(),
            ] {
                kv(&b, Use::Write, &mut p);
            }
            kv(&s.deployments_bucket(), Use::Open, &mut p);
            kv(&s.nodes_bucket(), Use::Open, &mut p);
        }
        Role::Planner => {
            p.subscribe.push(s.frontend_metrics());
            p.subscribe.push(s.worker_metrics());
            // It scales through the desired state, as `dynamoctl scale` does.
            kv(&s.deployments_bucket(), Use::Write, &mut p);
            kv(&s.planner_bucket(), Use::Write, &mut p);
            kv(&s.deploy_status_bucket(), Use::Open, &mut p);
            kv(&s.assignments_bucket(), Use::Open, &mut p);
            kv(&s.pins_bucket(), Use::Open, &mut p);
            // On Kubernetes its workers are known by their pods' names.
            kv(&s.workers_bucket(), Use::Open, &mut p);
        }
        Role::Admin => unreachable!("returned above"),
    }
    p.publish.sort();
    p.publish.dedup();
    p.subscribe.sort();
    p.subscribe.dedup();
    p
}

/// One user of the server's configuration.
#[derive(Clone, Debug)]
pub struct User {
    pub role: Role,
    pub namespace: Namespace,
    /// Its public nkey (`U…`).
    pub nkey: String,
}

/// The name of a namespace's NATS account.
pub fn account_name(ns: &Namespace) -> String {
    format!("dynamo_{}", ns.as_str())
}

/// A nats-server `accounts { ... }` block for these users: one account
/// per namespace, with JetStream, holding its users, each with its role's
/// permissions. An account is a wall: no subject, stream or consumer of
/// one namespace is reachable from another, whatever a role's rights.
pub fn accounts(users: &[User]) -> String {
    let list = |v: &[String]| {
        v.iter()
            .map(|x| format!("{x:?}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut namespaces: Vec<&Namespace> = users.iter().map(|u| &u.namespace).collect();
    namespaces.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    namespaces.dedup_by(|a, b| a.as_str() == b.as_str());
    let mut out = String::from("accounts {\n");
    for ns in namespaces {
        out.push_str(&format!(
            "  {:?}: {{\n    jetstream: enabled\n    users: [\n",
            account_name(ns)
        ));
        for u in users.iter().filter(|u| u.namespace.as_str() == ns.as_str()) {
            let p = permissions(u.role, &Subjects::new(u.namespace.clone()));
            out.push_str(&format!(
                "      # {}\n      {{ nkey: {:?}, permissions: {{ publish: {{ allow: [{}] }}, subscribe: {{ allow: [{}] }} }} }}\n",
                u.role,
                u.nkey,
                list(&p.publish),
                list(&p.subscribe),
            ));
        }
        out.push_str("    ]\n  }\n");
    }
    out.push_str("}\n");
    out
}

/// Whether a NATS subject pattern (`*` one token, `>` the rest) matches a
/// concrete subject.
pub fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut p = pattern.split('.');
    let mut s = subject.split('.');
    loop {
        match (p.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// Whether `role` may publish (`publish`) or subscribe to `subject`, as the
/// server would decide from [`permissions`].
pub fn allows(role: Role, s: &Subjects, subject: &str, publish: bool) -> bool {
    let p = permissions(role, s);
    let list = if publish { &p.publish } else { &p.subscribe };
    list.iter().any(|pat| subject_matches(pat, subject))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::WorkerId;

    fn subjects(ns: &str) -> Subjects {
        Subjects::new(Namespace::new(ns).unwrap())
    }

    #[test]
    fn wildcards_match_as_nats_does() {
        assert!(subject_matches("a.*.c", "a.b.c"));
        assert!(!subject_matches("a.*.c", "a.b.d"));
        assert!(!subject_matches("a.*", "a.b.c"));
        assert!(subject_matches("a.>", "a.b.c"));
        assert!(!subject_matches("a.>", "a"));
        assert!(subject_matches(">", "x"));
    }

    #[test]
    fn a_worker_is_kept_off_gateway_router_and_desired_state_subjects() {
        let s = subjects("t1");
        let w = WorkerId(7);
        let pubs = |subj: &str| allows(Role::Worker, &s, subj, true);
        // What it needs.
        assert!(pubs("dynamo.t1.gateway.00ab.frames"));
        assert!(pubs(&s.load(w)));
        assert!(pubs(&s.kv_events(w)));
        assert!(pubs("$KV.dynamo_t1_workers.7"));
        // What it must not do.
        assert!(!pubs(&s.worker_generate(w)), "requests are the gateway's");
        assert!(!pubs(&s.router_load()));
        assert!(!pubs(&s.router_snapshot()));
        assert!(!pubs(&s.frontend_metrics()));
        for b in [
            s.deployments_bucket(),
            s.assignments_bucket(),
            s.controller_bucket(),
            s.planner_bucket(),
            s.pins_bucket(),
        ] {
            assert!(!pubs(&format!("$KV.{b}.x")), "{b}");
            assert!(!pubs(&format!("$JS.API.STREAM.DELETE.KV_{b}")), "{b}");
        }
        assert!(!pubs("$JS.API.STREAM.PURGE.KV_dynamo_t1_workers"));
        // No streams or consumers of its own (a consumer's deliver subject
        // would get round every rule above).
        for api in [
            "STREAM.CREATE.KV_dynamo_t1_workers",
            "STREAM.UPDATE.KV_dynamo_t1_workers",
            "STREAM.UPDATE.dynamo_t1_kv_events",
            "CONSUMER.CREATE.KV_dynamo_t1_workers",
            "CONSUMER.CREATE.dynamo_t1_kv_events.x.y",
            "DIRECT.GET.KV_dynamo_t1_workers",
        ] {
            assert!(!pubs(&format!("$JS.API.{api}")), "{api}");
        }
        assert!(pubs("$JS.API.STREAM.INFO.KV_dynamo_t1_workers"));
        assert!(!allows(
            Role::Worker,
            &s,
            "dynamo.t1.gateway.00ab.frames",
            false
        ));
    }

    #[test]
    fn the_planner_reads_the_worker_registry_but_never_writes_it() {
        let s = subjects("t1");
        let pubs = |subj: &str| allows(Role::Planner, &s, subj, true);
        // Watching the registry (Kubernetes: workers by pod name).
        assert!(pubs("$JS.API.CONSUMER.CREATE.KV_dynamo_t1_workers"));
        assert!(pubs("$JS.API.STREAM.INFO.KV_dynamo_t1_workers"));
        // Registering or deregistering a worker is not its business.
        assert!(!pubs("$KV.dynamo_t1_workers.0000000000000001"));
        assert!(!pubs("$JS.API.STREAM.PURGE.KV_dynamo_t1_workers"));
    }

    #[test]
    fn no_role_but_admin_reaches_another_namespace() {
        let s = subjects("t1");
        let other = subjects("t2");
        let w = WorkerId(1);
        for role in Role::ALL.into_iter().filter(|r| *r != Role::Admin) {
            let p = permissions(role, &s);
            for pat in p.publish.iter().chain(&p.subscribe) {
                let ours = pat.starts_with("dynamo.t1.")
                    || pat.starts_with("_INBOX.t1.")
                    || pat.contains("dynamo_t1_")
                    || pat == "$JS.API.INFO";
                assert!(ours, "{role}: {pat} is outside namespace t1");
            }
            for subj in [
                other.worker_generate(w),
                other.kv_events(w),
                other.load(w),
                format!("$KV.{}.x", other.workers_bucket()),
                format!("$JS.API.STREAM.INFO.KV_{}", other.workers_bucket()),
                "_INBOX.t2.gateway.abc".to_string(),
            ] {
                assert!(!allows(role, &s, &subj, true), "{role} publishes {subj}");
                assert!(!allows(role, &s, &subj, false), "{role} reads {subj}");
            }
        }
        assert!(allows(Role::Admin, &s, &other.worker_generate(w), true));
    }

    #[test]
    fn roles_parse_and_render() {
        for r in Role::ALL {
            assert_eq!(r.to_string().parse::<Role>().unwrap(), r);
        }
        assert!("janitor".parse::<Role>().unwrap_err().contains("roles:"));
        let u = User {
            role: Role::Worker,
            namespace: Namespace::new("t1").unwrap(),
            nkey: "UABC".into(),
        };
        let conf = accounts(&[u]);
        assert!(conf.contains("nkey: \"UABC\""), "{conf}");
        assert!(conf.contains("\"dynamo.t1.load.*\""), "{conf}");
        assert!(conf.contains("\"dynamo_t1\": {"), "{conf}");
        assert!(conf.contains("jetstream: enabled"), "{conf}");
    }
}
