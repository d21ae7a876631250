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

    /// Whether connections present users (per-role permissions).
    pub fn has_users(&self) -> bool {
        self.creds.is_some()
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

/// What the CLI presents to the server at `url`: `$DYNAMO_NATS_CA` and
/// `$DYNAMO_NATS_CREDENTIALS` (its `admin.nk`) when set; otherwise, for the
/// URL a local node published, that node's CA and admin credentials.
pub fn cli_access(url: &str, ns: &Namespace) -> anyhow::Result<BusAccess> {
    let (url_file, ca_file, creds_dir) = state_files(ns);
    let local = std::fs::read_to_string(&url_file)
        .map(|u| u.trim() == url.trim())
        .unwrap_or(false);
    let ca = match std::env::var_os(env::NATS_CA) {
        Some(p) => Some(PathBuf::from(p)),
        None if local && ca_file.is_file() => Some(ca_file),
        None => None,
    };
    let creds = match std::env::var_os(env::NATS_CREDENTIALS) {
        Some(p) => Some(Credentials::read(&PathBuf::from(p))?),
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
