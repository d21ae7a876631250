//! NATS connections of a node and of the CLI, each as its role.
//!
//! - [`NodeBuses`]: the node's own connection (the `node` role) and, when
//!   the node has credentials, one connection per role its actors take
//!   (gateway, router, worker, controller, planner), made when the first
//!   actor of that role starts and shared by the rest. Without credentials
//!   every actor shares the node's connection, as before users existed.
//! - [`cli_access`]: what `dynamoctl` presents (the `admin` role): the CA
//!   and credentials from the environment, or those a local node with an
//!   embedded server left in the state directory.
//!
//! Invariant: an actor never connects as a role other than its own, so a
//! credential's permissions bound what a compromised actor can do.

use crate::env;
use dynamo_bus_schema::access::Role;
use dynamo_bus_schema::{Namespace, Subjects};
use dynamo_runtime::{Bus, BusAccess, Credentials};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

/// The roles a node's processes take: every role but admin.
pub fn node_roles() -> Vec<Role> {
    Role::ALL
        .into_iter()
        .filter(|r| *r != Role::Admin)
        .collect()
}

/// The node's connections.
pub struct NodeBuses {
    url: String,
    name: String,
    subjects: Subjects,
    /// CA (and no user): what every connection checks the server with.
    base: BusAccess,
    creds: Option<Credentials>,
    node: Bus,
    roles: tokio::sync::Mutex<HashMap<Role, Bus>>,
}

impl NodeBuses {
    /// Connects the node's own connection (as `node` when credentials are
    /// given).
    pub async fn connect(
        url: &str,
        name: &str,
        subjects: Subjects,
        base: BusAccess,
        creds: Option<Credentials>,
    ) -> anyhow::Result<Arc<Self>> {
        // A node runs no operator: it never holds the admin seed.
        let creds = creds.map(|c| {
            if c.seed(Role::Admin).is_ok() {
                tracing::warn!(
                    dir = ?c.dir,
                    "the node's credentials hold admin.nk: ignored (an operator's seed; keep it off nodes)"
                );
            }
            c.only(&node_roles())
        });
        let access = base.as_role(creds.as_ref(), Role::Node)?;
        let node = Bus::connect(url, name, subjects.clone(), &access).await?;
        Ok(Arc::new(NodeBuses {
            url: url.to_string(),
            name: name.to_string(),
            subjects,
            base,
            creds,
            node,
            roles: Default::default(),
        }))
    }

    /// The node's own connection.
    pub fn node(&self) -> &Bus {
        &self.node
    }

    /// Flushes every connection (bounded), so what actors published last
    /// reaches the server before the process exits.
    pub async fn flush_all(&self) {
        let mut buses = vec![self.node.clone()];
        buses.extend(self.roles.lock().await.values().cloned());
        for b in buses {
            if b.is_connected() {
                let _ =
                    tokio::time::timeout(std::time::Duration::from_secs(2), b.client.flush()).await;
            }
        }
    }

    /// The connection of `role` (made now if it is the first of its role).
    pub async fn role(&self, role: Role) -> anyhow::Result<Bus> {
        let Some(creds) = &self.creds else {
            return Ok(self.node.clone());
        };
        let mut roles = self.roles.lock().await;
        if let Some(b) = roles.get(&role) {
            return Ok(b.clone());
        }
        let access = self.base.as_role(Some(creds), role)?;
        let bus = Bus::connect(
            &self.url,
            &format!("{} ({role})", self.name),
            self.subjects.clone(),
            &access,
        )
        .await?;
        roles.insert(role, bus.clone());
        Ok(bus)
    }
}

/// Makes the streams the node's workers write but may not make (their
/// role has no such right): the workers bucket and the KV event stream.
/// Bounded; a failure is logged (the workers then fail to start, naming
/// it, and are retried). Run at start and whenever the node finds the
/// server lost its JetStream state.
pub async fn ensure_worker_streams(bus: &Bus) {
    let limit = std::time::Duration::from_secs(5);
    let name = bus.subjects.workers_bucket();
    let workers = bus.kv_bucket(&name, dynamo_runtime::bus::REGISTRY_MAX_AGE);
    match tokio::time::timeout(limit, workers).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "cannot make the workers bucket"),
        Err(_) => tracing::warn!("making the workers bucket timed out"),
    }
    match tokio::time::timeout(limit, bus.ensure_kv_events_stream()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "cannot make the KV event stream"),
        Err(_) => tracing::warn!("making the KV event stream timed out"),
    }
}

/// Where a local node with an embedded server leaves, for the CLI, its CA
/// (`<ns>.nats-ca.pem`) and the admin credentials (`<ns>.nats-creds/`).
pub fn state_files(ns: &Namespace) -> (PathBuf, PathBuf, PathBuf) {
    let dir = env::state_dir();
    (
        dir.join(format!("{}.nats-url", ns.as_str())),
        dir.join(format!("{}.nats-ca.pem", ns.as_str())),
        dir.join(format!("{}.nats-creds", ns.as_str())),
    )
}

/// Creates the state directory owner-only (an existing one is kept as it
/// is: [`cli_access`] checks it before trusting what it holds).
pub fn create_state_dir() -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(env::state_dir())
}

/// Refuses a state file or directory another user could have planted or
/// changed: it must be ours, and writable by no one else (a credentials
/// directory: readable by no one else either).
fn check_ours(path: &std::path::Path, private: bool) -> anyhow::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path)?;
    // SAFETY: geteuid cannot fail.
    let me = unsafe { libc::geteuid() };
    let open = if private { 0o077 } else { 0o022 };
    if m.uid() != me || m.mode() & open != 0 {
        anyhow::bail!(
            "{} is not trusted (owner uid {}, mode {:o}): it must be yours and {}; remove it, or set ${} and ${}",
            path.display(),
            m.uid(),
            m.mode() & 0o777,
            if private { "owner-only" } else { "writable only by you" },
            env::NATS_CA,
            env::NATS_CREDENTIALS,
        );
    }
    Ok(())
}

/// What the CLI presents to the server at `url`: `$DYNAMO_NATS_CA` and
/// `$DYNAMO_NATS_CREDENTIALS` (its `admin.nk`) when set; otherwise, for the
/// URL a local node published, that node's CA and admin credentials.
pub fn cli_access(url: &str, ns: &Namespace) -> anyhow::Result<BusAccess> {
    let (url_file, ca_file, creds_dir) = state_files(ns);
    let local = std::fs::read_to_string(&url_file)
        .map(|u| u.trim() == url.trim())
        .unwrap_or(false);
    if local && (ca_file.is_file() || creds_dir.is_dir()) {
        check_ours(&env::state_dir(), false)?;
        if ca_file.is_file() {
            check_ours(&ca_file, false)?;
        }
        if creds_dir.is_dir() {
            check_ours(&creds_dir, true)?;
        }
    }
    let ca = match std::env::var_os(env::NATS_CA) {
        Some(p) => Some(PathBuf::from(p)),
        None if local && ca_file.is_file() => Some(ca_file),
        None => None,
    };
    let creds = match std::env::var_os(env::NATS_CREDENTIALS) {
        Some(p) => {
            let c = Credentials::read(&PathBuf::from(p))?;
            // The CLI logs nothing by default: say it on stderr.
            for f in &c.exposed {
                eprintln!(
                    "dynamoctl: warning: {} is readable by other users: a NATS seed is a secret (chmod 600 it)",
                    f.display()
                );
            }
            Some(c)
        }
        None if local && creds_dir.is_dir() => Some(Credentials::read(&creds_dir)?),
        None => None,
    };
    Ok(BusAccess {
        ca_file: ca,
        user: None,
    }
    .as_role(creds.as_ref(), Role::Admin)?)
}

/// The CLI's connection to `url`, as the admin role.
pub async fn cli_connect(url: &str, ns: Namespace) -> anyhow::Result<Bus> {
    let access = cli_access(url, &ns)?;
    Ok(Bus::connect(url, "dynamoctl", Subjects::new(ns), &access).await?)
}

/// [`cli_connect`] for a command about what exists (status, get, models,
/// planner): fails when the namespace has nothing on this server, a
/// mistyped `--namespace`, instead of creating its buckets and printing
/// nothing.
pub async fn cli_connect_existing(url: &str, ns: Namespace) -> anyhow::Result<Bus> {
    use async_nats::jetstream::context::GetStreamErrorKind;
    use async_nats::jetstream::ErrorCode;
    let bus = cli_connect(url, ns.clone()).await?;
    let s = &bus.subjects;
    // Any of these says the namespace is in use (the weights cache may be
    // filled before a node starts).
    let streams = [
        format!("KV_{}", s.nodes_bucket()),
        format!("KV_{}", s.workers_bucket()),
        format!("KV_{}", s.deployments_bucket()),
        format!("KV_{}", s.weights_bucket()),
        format!("OBJ_{}", s.weights_objects()),
    ];
    for name in streams {
        match bus.js.get_stream(&name).await {
            Ok(_) => return Ok(bus),
            Err(e) => match e.kind() {
                GetStreamErrorKind::JetStream(j)
                    if j.error_code() == ErrorCode::STREAM_NOT_FOUND => {}
                // Not an absence (a timeout, a server electing its leader,
                // a refused credential): say what it was.
                _ => anyhow::bail!("cannot read stream {name}: {e}"),
            },
        }
    }
    anyhow::bail!(
        "namespace {:?} has nothing on this NATS server (no nodes, workers, deployments or cached models): check --namespace",
        ns.as_str()
    )
}
