//! `[metrics]`: the node's own Prometheus listener.
//!
//! Invariant: a listener other hosts can reach either requires a bearer
//! token or was allowed without one explicitly (as the gateway's
//! `allow_unauthenticated`); a loopback listener needs neither.

use super::{invalid, ConfigError};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::Path;

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawMetrics {
    /// `host:port` of the node's `GET /metrics` (e.g. `127.0.0.1:9464`;
    /// port 0 = any free port, logged). None: no listener.
    pub listen: Option<String>,
    /// File holding the bearer token scrapers must send
    /// (`Authorization: Bearer …`, Prometheus's `authorization` or
    /// `bearer_token_file`); `/health` stays open.
    pub token_file: Option<String>,
    /// Serve metrics without a token on an address other hosts can reach.
    #[serde(default)]
    pub allow_unauthenticated: bool,
}

impl RawMetrics {
    pub(super) fn listener(&self) -> Result<Option<MetricsListen>, ConfigError> {
        let Some(l) = self.listen.as_deref() else {
            if self.token_file.is_some() {
                return Err(invalid("metrics.token_file", "needs metrics.listen"));
            }
            return Ok(None);
        };
        let addr = l
            .parse()
            .map_err(|e| invalid("metrics.listen", format!("{l:?}: {e} (host:port)")))?;
        MetricsListen::new(
            addr,
            self.token_file.as_deref().map(Path::new),
            self.allow_unauthenticated,
            (
                "metrics.listen",
                "metrics.token_file",
                "metrics.allow_unauthenticated",
            ),
        )
        .map(Some)
    }
}

/// The node's metrics listener: where, and the bearer token it requires.
#[derive(Clone, PartialEq, Eq)]
pub struct MetricsListen {
    pub addr: SocketAddr,
    /// None: no token asked for (loopback, or allowed explicitly).
    pub token: Option<String>,
}

impl std::fmt::Debug for MetricsListen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsListen")
            .field("addr", &self.addr)
            .field("token", &self.token.as_ref().map(|_| "…"))
            .finish()
    }
}

impl MetricsListen {
    /// Reads the token file (if any) and checks the address: one other
    /// hosts can reach needs a token or `allow_unauthenticated`. `keys`
    /// names the settings in errors: (listen, token file, allow).
    pub fn new(
        addr: SocketAddr,
        token_file: Option<&Path>,
        allow_unauthenticated: bool,
        keys: (&str, &str, &str),
    ) -> Result<Self, ConfigError> {
        let token = match token_file {
            Some(p) => {
                let t = std::fs::read_to_string(p)
                    .map_err(|e| invalid(keys.1, format!("{}: {e}", p.display())))?;
                let t = t.trim().to_string();
                // What an HTTP header can carry as is: visible ASCII.
                let visible = t.bytes().all(|b| (0x21..=0x7e).contains(&b));
                if t.is_empty() || t.len() > 4096 || !visible {
                    return Err(invalid(
                        keys.1,
                        format!(
                            "{}: the token must be 1-4096 visible ASCII characters, no spaces",
                            p.display()
                        ),
                    ));
                }
                Some(t)
            }
            None => None,
        };
        if token.is_none() && !allow_unauthenticated && !addr.ip().is_loopback() {
            return Err(invalid(
                keys.0,
                format!(
                    "{addr} is reachable from other hosts: give a bearer token that scrapers send ({}) or allow it without one ({})",
                    keys.1, keys.2
                ),
            ));
        }
        Ok(MetricsListen { addr, token })
    }
}
