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

/// A labelled counter family (`None` if the name or labels are not valid
/// Prometheus names).
pub fn counter_vec(name: &str, help: &str, labels: &[&str]) -> Option<prometheus::IntCounterVec> {
    prometheus::IntCounterVec::new(prometheus::Opts::new(name, help), labels).ok()
}

/// A labelled gauge family (`None` as for [`counter_vec`]).
pub fn gauge_vec(name: &str, help: &str, labels: &[&str]) -> Option<prometheus::IntGaugeVec> {
    prometheus::IntGaugeVec::new(prometheus::Opts::new(name, help), labels).ok()
}

/// Registers families in the process-wide registry; `None` if one of the
/// names is taken already.
pub fn register<const N: usize>(families: [Box<dyn prometheus::core::Collector>; N]) -> Option<()> {
    for f in families {
        registry().register(f).ok()?;
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_register_once_and_render() {
        let c = counter_vec("dynamo_test_things_total", "Things", &["who"]).unwrap();
        let g = gauge_vec("dynamo_test_level", "Level", &["who"]).unwrap();
        assert!(register([Box::new(c.clone()), Box::new(g.clone())]).is_some());
        c.with_label_values(&["a"]).inc_by(3);
        g.with_label_values(&["a"]).set(7);
        let text = render();
        assert!(
            text.contains("dynamo_test_things_total{who=\"a\"} 3"),
            "{text}"
        );
        assert!(text.contains("dynamo_test_level{who=\"a\"} 7"), "{text}");
        // A name taken already is refused, not registered twice.
        assert!(register([Box::new(c)]).is_none());
        assert!(counter_vec("bad name", "x", &[]).is_none());
    }
}
