//! `[gateway]` authentication: the API key file (hashed keys and their
//! limits) and the rule that a gateway reachable from other hosts is not
//! left open by accident.

use super::{invalid, ConfigError};
use dynamo_gateway::auth::{parse_key_file, ApiKey};
use std::net::SocketAddr;

/// The keys a gateway checks: from `api_keys_file` (or, with `read_env`,
/// the file named by `DYNAMO_API_KEYS_FILE`); none = open, which is
/// refused on an address other hosts can reach unless
/// `allow_unauthenticated` says so.
pub(super) fn api_keys(
    file: Option<&str>,
    allow_unauthenticated: bool,
    listen: SocketAddr,
    read_env: bool,
) -> Result<Vec<ApiKey>, ConfigError> {
    let env = read_env
        .then(|| std::env::var(crate::env::API_KEYS_FILE).ok())
        .flatten();
    let path = file.map(str::to_string).or(env.filter(|p| !p.is_empty()));
    let keys = match &path {
        None => Vec::new(),
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .map_err(|e| invalid("gateway.api_keys_file", format!("cannot read {p}: {e}")))?;
            let keys = parse_key_file(&text)
                .map_err(|e| invalid("gateway.api_keys_file", format!("{p}: {e}")))?;
            if keys.is_empty() {
                return Err(invalid(
                    "gateway.api_keys_file",
                    format!("{p} holds no [[keys]]: every request would be refused"),
                ));
            }
            keys
        }
    };
    if keys.is_empty() && !listen.ip().is_loopback() && !allow_unauthenticated {
        return Err(invalid(
            "gateway.listen",
            format!(
                "{listen} is reachable from other hosts and no API keys are configured \
                 (gateway.api_keys_file or {}); set gateway.allow_unauthenticated = true \
                 to serve it open anyway",
                crate::env::API_KEYS_FILE
            ),
        ));
    }
    Ok(keys)
}
