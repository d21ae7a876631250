//! One process-wide Prometheus registry for the actors that serve no HTTP
//! of their own (the planner's decisions, for now); the gateway's
//! `/metrics` renders it after its own.

use std::sync::OnceLock;

/// The process-wide registry.
pub fn registry() -> &'static prometheus::Registry {
    static R: OnceLock<prometheus::Registry> = OnceLock::new();
    R.get_or_init(prometheus::Registry::new)
}

/// The registry in the text exposition format.
pub fn render() -> String {
    use prometheus::Encoder;
    let mut buf = Vec::new();
    let _ = prometheus::TextEncoder::new().encode(&registry().gather(), &mut buf);
    String::from_utf8(buf).unwrap_or_default()
}
