//! `[nats]`: where the bus is (an embedded server, `env`, or `nats://` /
//! `tls://` URLs) and how this node's connections check the servers and
//! prove who they are (a CA, role seeds).

use super::{invalid, ConfigError};
use serde::Deserialize;
use std::path::PathBuf;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawNats {
    /// `nats://host:port`, or `embedded` to run a nats-server child.
    pub url: String,
    /// Port for the embedded server (0 = any free port).
    #[serde(default)]
    pub port: u16,
    /// Embedded server: TLS with certificates generated at start (default
    /// true; the CLI finds the CA in the state directory).
    pub tls: Option<bool>,
    /// Embedded server: one NATS user per role, each allowed only its own
    /// subjects in this namespace (default true).
    pub auth: Option<bool>,
    /// PEM file of the CA that signed the servers' certificates: TLS is
    /// then required (with `nats://` or `tls://` URLs). Default:
    /// `$DYNAMO_NATS_CA`.
    pub ca_file: Option<String>,
    /// Directory of role seeds (`<role>.nk`, from `dynamoctl nats-auth`):
    /// each actor connects as its role's user. Default:
    /// `$DYNAMO_NATS_CREDENTIALS`.
    pub credentials: Option<String>,
}

/// Where the bus is.
#[derive(Clone, Debug, PartialEq)]
pub enum NatsSpec {
    Url(String),
    /// A nats-server child on `port` (0: any free port), with TLS from
    /// certificates made at start and/or one user per role.
    Embedded {
        port: u16,
        tls: bool,
        auth: bool,
    },
}

/// How this node's connections check the servers and prove who they are
/// (for a server given by URL; an embedded server makes its own).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NatsAccess {
    /// The CA that signed the servers' certificates (TLS required).
    pub ca_file: Option<PathBuf>,
    /// Directory of role seeds (`<role>.nk`).
    pub credentials: Option<PathBuf>,
}

impl NatsAccess {
    /// Checks the files exist now, naming the key that names them.
    pub fn validate(&self, ca_key: &str, creds_key: &str) -> Result<(), ConfigError> {
        if let Some(ca) = &self.ca_file {
            dynamo_runtime::tls::read_certs(ca).map_err(|e| invalid(ca_key, e.to_string()))?;
        }
        if let Some(dir) = &self.credentials {
            dynamo_runtime::Credentials::read(dir)
                .map_err(|e| invalid(creds_key, e.to_string()))?;
        }
        Ok(())
    }
}

/// One `nats://` URL, or several comma-separated (every server of a cluster).
pub(super) fn urls_ok(s: &str) -> bool {
    s.split(',').all(|u| {
        let u = u.trim();
        u.strip_prefix("nats://")
            .or_else(|| u.strip_prefix("tls://"))
            .is_some_and(|h| !h.is_empty())
    })
}

/// Checks `[nats]`: the bus, and the CA and credentials for a server given
/// by URL.
pub(super) fn parse(raw: &RawNats) -> Result<(NatsSpec, NatsAccess), ConfigError> {
    let embedded = raw.url == "embedded";
    if !embedded && (raw.tls.is_some() || raw.auth.is_some()) {
        return Err(invalid(
            if raw.tls.is_some() {
                "nats.tls"
            } else {
                "nats.auth"
            },
            "`tls` and `auth` configure an embedded server; for a server given by URL use `ca_file` and `credentials`",
        ));
    }
    if embedded && (raw.ca_file.is_some() || raw.credentials.is_some()) {
        return Err(invalid(
            if raw.ca_file.is_some() {
                "nats.ca_file"
            } else {
                "nats.credentials"
            },
            "an embedded server makes its own CA and credentials; `ca_file` and `credentials` are for a server given by URL",
        ));
    }
    // A server given by URL: the config's files, else the environment's
    // (a Kubernetes pod mounts a Secret and names it there).
    let from_env = |k: &str| {
        (!embedded)
            .then(|| std::env::var_os(k).map(PathBuf::from))
            .flatten()
    };
    let nats_access = NatsAccess {
        ca_file: raw
            .ca_file
            .as_ref()
            .map(PathBuf::from)
            .or_else(|| from_env(crate::env::NATS_CA)),
        credentials: raw
            .credentials
            .as_ref()
            .map(PathBuf::from)
            .or_else(|| from_env(crate::env::NATS_CREDENTIALS)),
    };
    nats_access.validate("nats.ca_file", "nats.credentials")?;
    let nats = if embedded {
        NatsSpec::Embedded {
            port: raw.port,
            tls: raw.tls.unwrap_or(true),
            auth: raw.auth.unwrap_or(true),
        }
    } else if urls_ok(&raw.url) {
        NatsSpec::Url(raw.url.clone())
    } else if raw.url == "env" {
        NatsSpec::Url(std::env::var(crate::env::NATS_URL).map_err(|_| {
            invalid(
                "nats.url",
                format!("is `env` but ${} is not set", crate::env::NATS_URL),
            )
        })?)
    } else {
        return Err(invalid(
            "nats.url",
            "must be `embedded`, `env` or nats:// or tls:// URLs (comma-separated for a cluster)",
        ));
    };
    Ok((nats, nats_access))
}
