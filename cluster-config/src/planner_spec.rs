//! The `planner:` section of a deployment spec: the SLA the planner keeps
//! and the bounds it scales within.
//!
//! ```yaml
//! planner:
//!   policy: sla              # sla (ours) | load (Dynamo's load-mode rule)
//!   ttft_ms: 500             # SLA: time to first token, per request
//!   itl_ms: 50               # SLA: inter-token latency, per request
//!   interval_ms: 10000       # sizing loop (prediction and capacity), and the load rule's period
//!   fast_interval_ms: 1000   # burst loop (queues)
//!   scale_down_after_ms: 60000   # a shrink waits this long after any change
//!   idle_to_zero_ms: 0       # 0: never; else scale to zero after this idle time
//!   cold_start_ms: 30000     # first guess of scale-up → ready (then measured)
//!   slot_budget: 16          # most slots the scaled services hold together
//!   predictor: holt          # holt (level + trend) | constant
//!   services:                # what the planner scales: services or groups
//!     prefill: {min: 1, max: 8}
//!     decode:  {min: 1, max: 8}
//! ```
//!
//! Invariants of a [`PlannerSpec`]: every duration and bound is within the
//! limits below; `min ≤ max`; each target names a worker service outside
//! any group, or a group, of the same deployment (checked by the spec).

use crate::spec::SpecError;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

/// Longest accepted duration in the section (a day).
pub const MAX_PLANNER_MS: u64 = 86_400_000;

/// Which rule sizes the services.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum PlannerPolicy {
    /// Predicted demand against learned per-replica capacity at the SLA,
    /// with a burst loop, cold-start lead and hysteresis.
    #[default]
    Sla,
    /// Dynamo's published load mode: +1 when every engine is over its
    /// target, −1 when every engine is under 80% of it (the baseline).
    Load,
}

/// Which time-series predictor forecasts rate, ISL and OSL.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum PredictorKind {
    /// The last interval's value.
    Constant,
    /// Holt's linear trend (double exponential smoothing), damped.
    #[default]
    Holt,
}

/// Bounds of one scaled target.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetLimits {
    /// Fewest replicas (0 allows scaling to zero).
    #[serde(default)]
    pub min: u32,
    /// Most replicas.
    pub max: u32,
}

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPlanner {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<PlannerPolicy>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub itl_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fast_interval_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_down_after_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_to_zero_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cold_start_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot_budget: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predictor: Option<PredictorKind>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_osl: Option<u32>,
    pub services: BTreeMap<String, TargetLimits>,
}

/// A checked `planner:` section.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannerSpec {
    pub policy: PlannerPolicy,
    /// SLA: time to first token.
    pub ttft: Duration,
    /// SLA: inter-token latency.
    pub itl: Duration,
    /// Period of the sizing loop (and of the load rule).
    pub interval: Duration,
    /// Period of the burst loop.
    pub fast_interval: Duration,
    /// A shrink waits this long after the target's last change.
    pub scale_down_after: Duration,
    /// Idle time before scaling to zero (None: never).
    pub idle_to_zero: Option<Duration>,
    /// First guess of the time from a scale-up to the replica being ready.
    pub cold_start: Duration,
    /// Most slots the scaled targets hold together (None: no budget).
    pub slot_budget: Option<u32>,
    pub predictor: PredictorKind,
    /// The mean output length (tokens) the deployment was planned for, as
    /// given to the configurator: sized for at least while a period of
    /// traffic is too young to show its own, since output lengths are known
    /// only as requests finish and the short ones finish first (None: the
    /// traffic's alone).
    pub expected_osl: Option<u32>,
    /// Target (service or group name) → bounds, sorted by name.
    pub targets: BTreeMap<String, TargetLimits>,
}

/// Largest `expected_osl` accepted (tokens).
pub const MAX_EXPECTED_OSL: u32 = 1 << 20;

fn invalid(field: impl Into<String>, message: impl Into<String>) -> SpecError {
    SpecError::Invalid {
        field: field.into(),
        message: message.into(),
    }
}

fn ms(field: &str, v: Option<u64>, default: u64, lo: u64) -> Result<Duration, SpecError> {
    let v = v.unwrap_or(default);
    if !(lo..=MAX_PLANNER_MS).contains(&v) {
        return Err(invalid(
            format!("planner.{field}"),
            format!("must be {lo}-{MAX_PLANNER_MS}"),
        ));
    }
    Ok(Duration::from_millis(v))
}

impl PlannerSpec {
    /// Checks the section's own fields; the spec checks the targets.
    pub fn validate(raw: RawPlanner) -> Result<Self, SpecError> {
        let ttft = ms("ttft_ms", raw.ttft_ms, 500, 1)?;
        let itl = ms("itl_ms", raw.itl_ms, 50, 1)?;
        let interval = ms("interval_ms", raw.interval_ms, 10_000, 100)?;
        let fast_interval = ms("fast_interval_ms", raw.fast_interval_ms, 1_000, 100)?;
        if fast_interval > interval {
            return Err(invalid(
                "planner.fast_interval_ms",
                "must be at most interval_ms",
            ));
        }
        let scale_down_after = ms("scale_down_after_ms", raw.scale_down_after_ms, 60_000, 0)?;
        let idle = ms("idle_to_zero_ms", raw.idle_to_zero_ms, 0, 0)?;
        let cold_start = ms("cold_start_ms", raw.cold_start_ms, 30_000, 0)?;
        if raw.slot_budget.is_some_and(|b| b > 1 << 20) {
            return Err(invalid("planner.slot_budget", "must be 0-1048576"));
        }
        if raw
            .expected_osl
            .is_some_and(|n| !(1..=MAX_EXPECTED_OSL).contains(&n))
        {
            return Err(invalid(
                "planner.expected_osl",
                format!("must be 1-{MAX_EXPECTED_OSL} tokens"),
            ));
        }
        if raw.services.is_empty() {
            return Err(invalid(
                "planner.services",
                "name at least one service or group to scale",
            ));
        }
        for (name, l) in &raw.services {
            let f = format!("planner.services.{name}");
            if l.max > crate::spec::MAX_REPLICAS {
                return Err(invalid(
                    format!("{f}.max"),
                    format!("must be 0-{}", crate::spec::MAX_REPLICAS),
                ));
            }
            if l.min > l.max {
                return Err(invalid(
                    format!("{f}.min"),
                    format!("{} is more than max {}", l.min, l.max),
                ));
            }
        }

        Ok(PlannerSpec {
            policy: raw.policy.unwrap_or_default(),
            ttft,
            itl,
            interval,
            fast_interval,
            scale_down_after,
            idle_to_zero: (!idle.is_zero()).then_some(idle),
            cold_start,
            slot_budget: raw.slot_budget,
            predictor: raw.predictor.unwrap_or_default(),
            expected_osl: raw.expected_osl,
            targets: raw.services,
        })
    }

    /// Rules for a section being applied, beyond what a stored spec must
    /// meet (added after specs were stored: a stored spec that breaks one
    /// still loads): settings that cannot work.
    pub fn check_for_apply(&self) -> Result<(), SpecError> {
        if self.slot_budget == Some(0) {
            return Err(invalid(
                "planner.slot_budget",
                "must be at least 1 (leave it out for no budget)",
            ));
        }
        for (name, l) in &self.targets {
            if l.max == 0 {
                return Err(invalid(
                    format!("planner.services.{name}.max"),
                    "must be at least 1 (a target the planner may never start is not one)",
                ));
            }
        }
        if self.idle_to_zero.is_some() && self.targets.values().all(|l| l.min > 0) {
            return Err(invalid(
                "planner.idle_to_zero_ms",
                "no target may go to zero: give one `min: 0`, or leave idle_to_zero_ms out",
            ));
        }
        Ok(())
    }

    /// The section back in its file's shape.
    pub fn to_raw(&self) -> RawPlanner {
        let ms = |d: Duration| Some(d.as_millis() as u64);
        RawPlanner {
            policy: Some(self.policy),
            ttft_ms: ms(self.ttft),
            itl_ms: ms(self.itl),
            interval_ms: ms(self.interval),
            fast_interval_ms: ms(self.fast_interval),
            scale_down_after_ms: ms(self.scale_down_after),
            idle_to_zero_ms: Some(self.idle_to_zero.map(|d| d.as_millis() as u64).unwrap_or(0)),
            cold_start_ms: ms(self.cold_start),
            slot_budget: self.slot_budget,
            predictor: Some(self.predictor),
            expected_osl: self.expected_osl,
            services: self.targets.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(yaml: &str) -> RawPlanner {
        serde_yaml_ng::from_str(yaml).unwrap()
    }

    #[test]
    fn defaults_are_dynamos_sla() {
        let p = PlannerSpec::validate(raw("services: {decode: {max: 4}}")).unwrap();
        assert_eq!(p.ttft, Duration::from_millis(500));
        assert_eq!(p.itl, Duration::from_millis(50));
        assert_eq!(p.policy, PlannerPolicy::Sla);
        assert_eq!(p.idle_to_zero, None);
        assert_eq!(p.expected_osl, None);
        assert_eq!(p.targets["decode"], TargetLimits { min: 0, max: 4 });
        let back = PlannerSpec::validate(p.to_raw()).unwrap();
        assert_eq!(back, p);
    }

    #[test]
    fn errors_name_the_field() {
        let e = |y: &str| PlannerSpec::validate(raw(y)).unwrap_err().to_string();
        assert!(e("services: {decode: {min: 5, max: 4}}").contains("planner.services.decode.min"));
        assert!(e("ttft_ms: 0\nservices: {d: {max: 1}}").contains("planner.ttft_ms"));
        assert!(e("services: {}").contains("planner.services"));

        assert!(e("expected_osl: 0\nservices: {d: {max: 1}}").contains("planner.expected_osl"));
        let p = PlannerSpec::validate(raw("expected_osl: 200\nservices: {d: {max: 1}}")).unwrap();
        assert_eq!(p.expected_osl, Some(200));
        assert_eq!(PlannerSpec::validate(p.to_raw()).unwrap(), p);
        assert!(
            e("interval_ms: 1000\nfast_interval_ms: 5000\nservices: {d: {max: 1}}")
                .contains("planner.fast_interval_ms")
        );
        assert!(serde_yaml_ng::from_str::<RawPlanner>("bogus: 1\nservices: {}").is_err());
    }
}
