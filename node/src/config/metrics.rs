//! `[metrics]`: the node's own Prometheus listener.

use super::{invalid, ConfigError};
use serde::Deserialize;
use std::net::SocketAddr;

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawMetrics {
    /// `host:port` of the node's `GET /metrics` (e.g. `127.0.0.1:9464`;
    /// port 0 = any free port, logged). None: no listener.
    pub listen: Option<String>,
}

impl RawMetrics {
    pub(super) fn listen(&self) -> Result<Option<SocketAddr>, ConfigError> {
        self.listen
            .as_deref()
            .map(|l| {
                l.parse()
                    .map_err(|e| invalid("metrics.listen", format!("{l:?}: {e} (host:port)")))
            })
            .transpose()
    }
}
