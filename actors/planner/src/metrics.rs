//! The planner's decisions as Prometheus metrics (in the process-wide
//! registry, rendered by a co-located gateway's `/metrics`):
//! `dynamo_planner_decisions_total{deployment,target,rule,direction,applied}`
//! and, per target, `dynamo_planner_{desired,recommended,ready}_replicas`.

use dynamo_runtime::metrics::{counter_vec, gauge_vec, register};
use prometheus::{IntCounterVec, IntGaugeVec};
use std::sync::OnceLock;

struct M {
    decisions: IntCounterVec,
    desired: IntGaugeVec,
    recommended: IntGaugeVec,
    ready: IntGaugeVec,
}

fn m() -> Option<&'static M> {
    static CELL: OnceLock<Option<M>> = OnceLock::new();
    CELL.get_or_init(|| {
        let gauge = |name: &str, help: &str| gauge_vec(name, help, &["deployment", "target"]);
        let m = M {
            decisions: counter_vec(
                "dynamo_planner_decisions_total",
                "Scaling decisions of the planner",
                &["deployment", "target", "rule", "direction", "applied"],
            )?,
            desired: gauge(
                "dynamo_planner_desired_replicas",
                "Replicas the spec asks for",
            )?,
            recommended: gauge(
                "dynamo_planner_recommended_replicas",
                "Replicas the planner recommends",
            )?,
            ready: gauge("dynamo_planner_ready_replicas", "Replicas ready")?,
        };
        register([
            Box::new(m.decisions.clone()),
            Box::new(m.desired.clone()),
            Box::new(m.recommended.clone()),
            Box::new(m.ready.clone()),
        ])?;
        Some(m)
    })
    .as_ref()
}

pub fn decided(deployment: &str, target: &str, rule: &str, up: bool, applied: bool) {
    if let Some(m) = m() {
        m.decisions
            .with_label_values(&[
                deployment,
                target,
                rule,
                if up { "up" } else { "down" },
                if applied { "true" } else { "false" },
            ])
            .inc();
    }
}

pub fn recommended(deployment: &str, target: &str, desired: u32, recommended: u32, ready: u32) {
    if let Some(m) = m() {
        let l = [deployment, target];
        m.desired.with_label_values(&l).set(desired as i64);
        m.recommended.with_label_values(&l).set(recommended as i64);
        m.ready.with_label_values(&l).set(ready as i64);
    }
}
