//! The placement controller's Prometheus metrics, in the process-wide
//! registry (rendered by the node's metrics listener and a co-located
//! gateway's `/metrics`):
//! - `dynamo_controller_active{node}`: 1 while this node holds the lease;
//! - `dynamo_controller_lease_epoch{node}`: the epoch it last held;
//! - `dynamo_controller_reconciles_total{node,result}`: `ok` or `error`,
//!   counted only while active;
//! - `dynamo_controller_events_total{deployment}`: cluster events recorded
//!   (placements, lost nodes, pending gangs); removed with the deployment.

use dynamo_runtime::metrics::{counter_vec, gauge_vec, register};
use prometheus::{IntCounterVec, IntGaugeVec};
use std::sync::OnceLock;

struct M {
    active: IntGaugeVec,
    epoch: IntGaugeVec,
    reconciles: IntCounterVec,
    events: IntCounterVec,
}

fn m() -> Option<&'static M> {
    static CELL: OnceLock<Option<M>> = OnceLock::new();
    CELL.get_or_init(|| {
        let m = M {
            active: gauge_vec(
                "dynamo_controller_active",
                "1 while this node's controller holds the lease",
                &["node"],
            )?,
            epoch: gauge_vec(
                "dynamo_controller_lease_epoch",
                "Lease epoch this controller last held",
                &["node"],
            )?,
            reconciles: counter_vec(
                "dynamo_controller_reconciles_total",
                "Reconciliations of the active controller, by result",
                &["node", "result"],
            )?,
            events: counter_vec(
                "dynamo_controller_events_total",
                "Cluster events recorded, per deployment",
                &["deployment"],
            )?,
        };
        register([
            Box::new(m.active.clone()),
            Box::new(m.epoch.clone()),
            Box::new(m.reconciles.clone()),
            Box::new(m.events.clone()),
        ])?;
        Some(m)
    })
    .as_ref()
}

/// After a tick: whether this controller is active, its epoch, and (when
/// active) whether the reconciliation succeeded.
pub fn ticked(node: &str, active: bool, epoch: u64, ok: bool) {
    if let Some(m) = m() {
        m.active.with_label_values(&[node]).set(active as i64);
        m.epoch.with_label_values(&[node]).set(epoch as i64);
        let result = if ok { "ok" } else { "error" };
        let c = m.reconciles.with_label_values(&[node, result]);
        if active {
            c.inc();
        }
        // Both results exist from the first tick on.
        m.reconciles
            .with_label_values(&[node, if ok { "error" } else { "ok" }]);
    }
}

pub fn event(deployment: &str) {
    if let Some(m) = m() {
        m.events.with_label_values(&[deployment]).inc();
    }
}

/// A deployment was deleted: its event series goes with it.
pub fn deployment_gone(deployment: &str) {
    if let Some(m) = m() {
        let _ = m.events.remove_label_values(&[deployment]);
    }
}
