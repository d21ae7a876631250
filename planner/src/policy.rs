//! The planner's decisions: how many replicas each target should have.
//!
//! [`PlannerState::evaluate`] is called every fast interval with what was
//! observed since the last call, and every sizing interval with the longer
//! window too. It returns the changes to make (at most one per target) and
//! the numbers behind every target's recommendation.
//!
//! Invariants of a result:
//! - a target's replicas stay within its `min`/`max`, and the targets'
//!   slots together within the budget (when demand asks for more, the
//!   decision says so);
//! - a pinned target (a manual `dynamoctl scale`) is never changed;
//! - nothing shrinks within `scale_down_after` of the target's last
//!   change, and a shrink goes to the largest recommendation of that
//!   window (with the 80% hysteresis band, a constant load never flips the
//!   direction);
//! - pending replicas (desired, not yet ready) count as coming: the burst
//!   rule only adds what desired replicas cannot absorb;
//! - only the idle rule scales a target to zero; any demand wakes it.

use crate::capacity::{
    aggregated_capacity, decode_capacity, decode_tail_utilisation, prefill_capacity,
    utilisation_at, Capacity, EngineTiming, Learned,
};
use crate::predict::{AnyPredictor, Predictor};
use dynamo_cluster_config::planner_spec::{PlannerPolicy, PlannerSpec, TargetLimits};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};

/// A scale-down leaves each replica at most this busy (the hysteresis band).
pub const DOWN_UTILISATION: f64 = 0.8;
/// The largest share of an SLA target the frontend correction takes.
pub const MAX_CORRECTION: f64 = 0.5;
/// A decode sample is learned from only when the model's step at its
/// utilisation is at least this share of the ITL target.
pub const DECODE_LEARN_SHARE: f64 = 0.5;
/// Recommendations kept per target (the scale-down window's history).
const MAX_RECENT: usize = 512;
/// Decisions a worker must report before it is learned from (cold start).
const WARM_WINDOWS: u32 = 2;

/// Which phases a target's replicas run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TargetKind {
    Prefill,
    Decode,
    Aggregated,
    /// A scaling group: per replica of the group, this many replicas of
    /// each kind (scaled together at that ratio).
    Group {
        prefill: u32,
        decode: u32,
        aggregated: u32,
    },
}

/// The phase a worker runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    Prefill,
    Decode,
    Aggregated,
}

/// A target as it stands (the spec, the controller's status, the pins).
#[derive(Clone, Debug)]
pub struct Target {
    pub name: String,
    pub kind: TargetKind,
    /// Replicas the spec asks for now.
    pub desired: u32,
    /// Of those, ready (serving).
    pub ready: u32,
    /// Slots one replica of the target holds (a group: all its members).
    pub slots: u32,
    pub limits: TargetLimits,
    /// Set by a manual `scale`; the planner leaves the target alone.
    pub pinned: bool,
    /// The seed of its workers' capacity model.
    pub timing: EngineTiming,
}

/// One worker's report over a window.
#[derive(Clone, Debug, Default)]
pub struct WorkerSample {
    /// The target it belongs to.
    pub target: String,
    pub phase: Option<Phase>,
    /// Windows this worker has reported since it became ready.
    pub windows: u32,
    pub active: u32,
    pub waiting: u32,
    /// KV blocks in use ÷ total (0–1).
    pub kv_util: f64,
    pub queued_prefill_tokens: u64,
    /// Mean time from accepting a request to its first token (ms).
    pub ttft_ms: Option<f64>,
    /// Mean gap between output tokens (ms).
    pub itl_ms: Option<f64>,
    /// Mean prompt length of the requests it took (tokens).
    pub isl: Option<f64>,
}

/// What the frontends and workers reported over a window.
#[derive(Clone, Debug, Default)]
pub struct Window {
    /// When the window ended (unix ms).
    pub now_ms: u64,
    /// Its length, seconds.
    pub secs: f64,
    /// Requests that arrived at the gateways.
    pub arrivals: u64,
    pub isl_mean: Option<f64>,
    pub osl_mean: Option<f64>,
    /// 90th percentile of the requests' TTFT and mean ITL (ms).
    pub ttft_p90_ms: Option<f64>,
    pub itl_p90_ms: Option<f64>,
    /// Requests waiting at the gateways now (admission and held).
    pub queued: u32,
    /// Of those, held because no worker is up at all.
    pub held: u32,
    /// Requests being served now.
    pub inflight: u32,
    pub workers: Vec<WorkerSample>,
}

/// One change the planner asks for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Change {
    pub target: String,
    pub from: u32,
    pub to: u32,
    /// Which rule asked for it: `sla`, `burst`, `shrink`, `wake`, `idle`,
    /// `budget`, `load_rule`, `limits`.
    pub rule: String,
    pub reason: String,
}

/// A target's recommendation with the numbers behind it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Note {
    pub target: String,
    pub desired: u32,
    pub ready: u32,
    pub recommended: u32,
    pub pinned: bool,
    pub reason: String,
    pub numbers: BTreeMap<String, f64>,
}

/// What one evaluation decided.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Evaluation {
    pub changes: Vec<Change>,
    pub notes: Vec<Note>,
}

/// Per-target memory (adopted by a successor planner).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct TargetMemory {
    /// Unix ms of the last change the planner (or anyone) made.
    pub last_change_ms: u64,
    /// +1 up, −1 down, 0 none yet.
    pub last_direction: i8,
    /// (unix ms, replicas) the sizing rule recommended, newest last.
    pub recent: VecDeque<(u64, u32)>,
    /// A scale-up waiting for its replicas: (since unix ms, to replicas).
    pub pending_up: Option<(u64, u32)>,
    /// Desired replicas at the last evaluation (to see outside changes).
    pub seen_desired: Option<u32>,
    pub learned: Learned,
}

/// Everything the planner remembers between evaluations; stored with its
/// status, so a planner that takes over continues instead of restarting.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Memory {
    pub rate: AnyPredictor,
    pub isl: AnyPredictor,
    pub osl: AnyPredictor,
    /// Measured scale-up → ready time (ms), averaged.
    pub lead_ms: f64,
    pub lead_samples: u64,
    /// Last unix ms with any demand.
    pub last_busy_ms: u64,
    /// Unix ms the current period of demand began (after an idle one).
    /// Nothing shrinks within a shrink window of it: what a new load has
    /// shown so far is biased (short requests finish first, rates are
    /// still ramping).
    #[serde(default)]
    pub busy_since_ms: u64,
    /// Observed − predicted 90th-percentile TTFT and ITL at the frontends
    /// (ms), averaged: the time the workers' own timings do not see.
    pub ttft_correction_ms: f64,
    pub itl_correction_ms: f64,
    pub targets: BTreeMap<String, TargetMemory>,
    /// Changes decided so far (a successor continues the count).
    pub decisions: u64,
}

impl Memory {
    pub fn new(spec: &PlannerSpec) -> Self {
        Memory {
            rate: AnyPredictor::new(spec.predictor),
            isl: AnyPredictor::new(spec.predictor),
            osl: AnyPredictor::new(spec.predictor),
            lead_ms: spec.cold_start.as_millis() as f64,
            lead_samples: 0,
            last_busy_ms: 0,
            busy_since_ms: 0,
            ttft_correction_ms: 0.0,
            itl_correction_ms: 0.0,
            targets: BTreeMap::new(),
            decisions: 0,
        }
    }
}

/// The planner of one deployment.
pub struct PlannerState {
    pub spec: PlannerSpec,
    pub memory: Memory,
}

fn ewma(old: f64, x: f64, w: f64) -> f64 {
    if x.is_finite() {
        old * (1.0 - w) + x * w
    } else {
        old
    }
}

fn ceil_u32(x: f64) -> u32 {
    if x.is_finite() && x > 0.0 {
        x.ceil().min(u32::MAX as f64) as u32
    } else {
        0
    }
}

/// Capacity of one replica of a target, per phase it runs.
struct TargetCapacity {
    prefill: Capacity,
    decode: Capacity,
    /// Sequences one decode-capable replica holds at the KV utilisation
    /// where a step meets the ITL target.
    decode_seqs: f64,
}

impl PlannerState {
    pub fn new(spec: PlannerSpec) -> Self {
        let memory = Memory::new(&spec);
        PlannerState { spec, memory }
    }

    /// Continues from a predecessor's memory (its status).
    pub fn adopt(spec: PlannerSpec, memory: Memory) -> Self {
        PlannerState { spec, memory }
    }

    fn ttft_ms(&self) -> f64 {
        self.spec.ttft.as_secs_f64() * 1000.0
    }
    fn itl_ms(&self) -> f64 {
        self.spec.itl.as_secs_f64() * 1000.0
    }

    fn capacity(&self, t: &Target, isl: f64, osl: f64) -> TargetCapacity {
        let m = self.memory.targets.get(&t.name);
        let l = m.map(|m| m.learned.clone()).unwrap_or_default();
        // What the model does not see comes off the targets.
        let ttft = self.ttft_ms() - self.memory.ttft_correction_ms;
        let itl = self.itl_ms() - self.memory.itl_correction_ms;
        let prefill = prefill_capacity(&t.timing, &l, isl, ttft);
        let decode = decode_capacity(&t.timing, &l, isl, osl, itl);
        // The sequences a replica holds at the occupancy limit: the burst
        // rule counts the sequences running now, a realised count, so no
        // margin for the spread about a mean applies.
        let live = isl.max(1.0) + osl.max(1.0) / 2.0;
        let decode_seqs = (utilisation_at(&t.timing, l.decode, itl).max(0.02) * t.timing.kv_tokens
            / live)
            .clamp(1.0, t.timing.max_seqs.max(1.0) * 0.9);
        TargetCapacity {
            prefill,
            decode,
            decode_seqs,
        }
    }

    /// One evaluation. `fast` is the window since the last call; `slow`,
    /// on sizing intervals, the window since the last sizing.
    pub fn evaluate(
        &mut self,
        targets: &[Target],
        fast: &Window,
        slow: Option<&Window>,
    ) -> Evaluation {
        let now = fast.now_ms;
        let busy = fast.arrivals > 0
            || fast.inflight > 0
            || fast.queued > 0
            || fast.workers.iter().any(|w| w.active > 0 || w.waiting > 0);
        if busy {
            // The first demand seen, or demand after a whole shrink window
            // without any: a new period (gaps between requests of a light
            // load are not).
            let idle_ms = self.spec.scale_down_after.as_millis() as u64;
            if self.memory.busy_since_ms == 0
                || now.saturating_sub(self.memory.last_busy_ms) > idle_ms
            {
                self.memory.busy_since_ms = now;
            }
        }
        if busy || self.memory.last_busy_ms == 0 {
            self.memory.last_busy_ms = now;
        }
        self.track(targets, now);
        if let Some(slow) = slow {
            self.learn(targets, slow);
        }
        let mut notes = Vec::new();
        let mut want: Vec<(u32, String, String)> = Vec::new();
        for t in targets {
            let (n, rule, reason, numbers) = match self.spec.policy {
                PlannerPolicy::Sla => self.sla(t, fast, slow),
                // Dynamo's rule runs on its own period (the sizing interval).
                PlannerPolicy::Load => match slow {
                    Some(w) => self.load_rule(t, w),
                    None => (
                        t.desired,
                        "hold".into(),
                        "between load-rule periods".into(),
                        BTreeMap::new(),
                    ),
                },
            };
            let (n, rule, reason) = self.edges(t, fast, n, rule, reason);
            let (n, rule, reason) = if t.pinned {
                (
                    t.desired,
                    "pinned".to_string(),
                    format!(
                        "pinned at {} by a manual scale (dynamoctl planner release to hand it back); would be {n}: {reason}",
                        t.desired
                    ),
                )
            } else {
                (n, rule, reason)
            };
            notes.push(Note {
                target: t.name.clone(),
                desired: t.desired,
                ready: t.ready,
                recommended: n,
                pinned: t.pinned,
                reason: reason.clone(),
                numbers,
            });
            want.push((n, rule, reason));
        }
        self.budget(targets, &mut want, &mut notes);
        let mut changes = Vec::new();
        for (t, (n, rule, reason)) in targets.iter().zip(want) {
            if n == t.desired || t.pinned {
                continue;
            }
            let m = self.memory.targets.entry(t.name.clone()).or_default();
            m.last_change_ms = now;
            m.last_direction = if n > t.desired { 1 } else { -1 };
            m.seen_desired = Some(n);
            if n > t.desired {
                m.pending_up = Some((now, n));
            } else {
                m.pending_up = None;
            }
            self.memory.decisions += 1;
            changes.push(Change {
                target: t.name.clone(),
                from: t.desired,
                to: n,
                rule,
                reason,
            });
        }
        Evaluation { changes, notes }
    }

    /// Cold starts (scale-up → ready) and changes made by others.
    fn track(&mut self, targets: &[Target], now: u64) {
        for t in targets {
            // A target first seen now has just "changed": nothing shrinks
            // before it has been watched for a whole window.
            let m = self
                .memory
                .targets
                .entry(t.name.clone())
                .or_insert_with(|| TargetMemory {
                    last_change_ms: now,
                    ..TargetMemory::default()
                });
            if m.seen_desired.is_some_and(|d| d != t.desired) {
                // Someone else changed it (a manual scale, a predecessor):
                // it counts as a change for the shrink delay.
                m.last_change_ms = now;
                m.pending_up = None;
            }
            m.seen_desired = Some(t.desired);
            if let Some((since, to)) = m.pending_up {
                if t.ready >= to {
                    let took = now.saturating_sub(since) as f64;
                    self.memory.lead_ms = if self.memory.lead_samples == 0 {
                        took
                    } else {
                        ewma(self.memory.lead_ms, took, 0.3)
                    };
                    self.memory.lead_samples += 1;
                    m.pending_up = None;
                } else if t.desired < to {
                    m.pending_up = None;
                }
            }
        }
        let names: std::collections::BTreeSet<&str> =
            targets.iter().map(|t| t.name.as_str()).collect();
        self.memory
            .targets
            .retain(|k, _| names.contains(k.as_str()));
    }

    /// Feeds the predictors and learns capacity from warm workers.
    fn learn(&mut self, targets: &[Target], w: &Window) {
        if w.secs > 0.0 {
            self.memory.rate.observe(w.arrivals as f64 / w.secs);
        }
        if let Some(x) = w.isl_mean {
            self.memory.isl.observe(x);
        }
        if let Some(x) = w.osl_mean {
            self.memory.osl.observe(x);
        }
        self.correct(targets, w);
        let itl_target = self.itl_ms();
        for t in targets {
            let timing = t.timing.clone();
            let Some(m) = self.memory.targets.get_mut(&t.name) else {
                continue;
            };
            for s in w.workers.iter().filter(|s| s.target == t.name) {
                if s.windows < WARM_WINDOWS {
                    continue; // cold-start samples never inflate the model
                }
                let prefills = matches!(s.phase, Some(Phase::Prefill) | Some(Phase::Aggregated));
                let decodes = matches!(s.phase, Some(Phase::Decode) | Some(Phase::Aggregated));
                // An idle-enough prefill worker's TTFT is its prefill time.
                if prefills && s.waiting == 0 && s.queued_prefill_tokens == 0 {
                    if let (Some(ttft), Some(isl)) = (s.ttft_ms, s.isl) {
                        m.learned.prefill_sample(&timing, isl, ttft);
                    }
                }
                // A decode sample teaches only near the loads sizing is
                // for: at a nearly empty cache a step is short and fixed
                // costs (timers, delivery) dominate the ratio, which would
                // then scale the whole curve.
                if decodes && timing.step(s.kv_util) >= DECODE_LEARN_SHARE * itl_target {
                    if let Some(itl) = s.itl_ms {
                        m.learned.decode_sample(&timing, s.kv_util, itl);
                    }
                }
            }
        }
    }

    /// The frontends' latency against what the learned model predicts at
    /// the load of the window: observed − predicted, averaged (the
    /// correction for what the workers' own timings do not see: routing,
    /// transfer, the first decode step, HTTP, the tail). It comes off the
    /// targets the capacity is sized for, at most [`MAX_CORRECTION`] of them.
    fn correct(&mut self, targets: &[Target], w: &Window) {
        const MIN_REQUESTS: u64 = 20;
        if w.arrivals < MIN_REQUESTS || w.secs <= 0.0 {
            return;
        }
        let rate = w.arrivals as f64 / w.secs;
        let isl = w.isl_mean.unwrap_or(1.0).max(1.0);
        let mut ttft_pred: Option<f64> = None;
        let mut itl_pred: Option<f64> = None;
        for t in targets.iter().filter(|t| t.ready > 0) {
            let l = self
                .memory
                .targets
                .get(&t.name)
                .map(|m| m.learned.clone())
                .unwrap_or_default();
            let (pf, dc) = match t.kind {
                TargetKind::Prefill => (1, 0),
                TargetKind::Decode => (0, 1),
                TargetKind::Aggregated => (1, 1),
                TargetKind::Group {
                    prefill,
                    decode,
                    aggregated,
                } => (prefill + aggregated, decode + aggregated),
            };
            if pf > 0 {
                let s = t.timing.prefill(isl) * l.prefill;
                let servers = (t.ready * pf) as f64;
                let rho = (rate * s / 1000.0 / servers).min(0.95);
                let p = s * (1.0 + 2.0 * rho / (2.0 * (1.0 - rho)));
                ttft_pred = Some(ttft_pred.map_or(p, |x: f64| x.max(p)));
            }
            if dc > 0 {
                let us: Vec<f64> = w
                    .workers
                    .iter()
                    .filter(|s| s.target == t.name && s.itl_ms.is_some())
                    .map(|s| s.kv_util)
                    .collect();
                if !us.is_empty() {
                    // The frontends report a 90th percentile: compare it
                    // with the step at the occupancy's (as sizing does).
                    let u = us.iter().sum::<f64>() / us.len() as f64;
                    let osl = w.osl_mean.unwrap_or(1.0).max(1.0);
                    let u = decode_tail_utilisation(&t.timing, u, isl + osl / 2.0);
                    let p = t.timing.step(u) * l.decode;
                    itl_pred = Some(itl_pred.map_or(p, |x: f64| x.max(p)));
                }
            }
        }
        let (ttft, itl) = (self.ttft_ms(), self.itl_ms());
        if let (Some(obs), Some(pred)) = (w.ttft_p90_ms, ttft_pred) {
            let c = ewma(self.memory.ttft_correction_ms, obs - pred, 0.2);
            self.memory.ttft_correction_ms = c.clamp(0.0, MAX_CORRECTION * ttft);
        }
        if let (Some(obs), Some(pred)) = (w.itl_p90_ms, itl_pred) {
            let c = ewma(self.memory.itl_correction_ms, obs - pred, 0.2);
            self.memory.itl_correction_ms = c.clamp(0.0, MAX_CORRECTION * itl);
        }
    }

    /// Our policy for one target: sizing, burst, then shrink.
    fn sla(
        &mut self,
        t: &Target,
        fast: &Window,
        slow: Option<&Window>,
    ) -> (u32, String, String, BTreeMap<String, f64>) {
        let now = fast.now_ms;
        let mut nums = BTreeMap::new();
        // Lengths from the smoothed series (one short window's mean is
        // noise), or from the fast window before there is any.
        let smoothed = |p: &AnyPredictor, now: Option<f64>| {
            let v = p.predict(1.0);
            if v > 0.0 {
                v
            } else {
                now.unwrap_or(1.0).max(1.0)
            }
        };
        let isl = smoothed(&self.memory.isl, fast.isl_mean);
        let osl = smoothed(&self.memory.osl, fast.osl_mean);
        let cap = self.capacity(t, isl, osl);
        let per = match t.kind {
            TargetKind::Prefill => cap.prefill.per_replica,
            TargetKind::Decode => cap.decode.per_replica,
            TargetKind::Aggregated => aggregated_capacity(&cap.prefill, &cap.decode).per_replica,
            TargetKind::Group {
                prefill,
                decode,
                aggregated,
            } => {
                // A group replica serves what its weakest phase allows.
                let agg = aggregated_capacity(&cap.prefill, &cap.decode).per_replica;
                let mut best = f64::INFINITY;
                let mut any = false;
                for (n, c) in [
                    (prefill, cap.prefill.per_replica),
                    (decode, cap.decode.per_replica),
                ] {
                    if n > 0 {
                        best = best.min(n as f64 * c);
                        any = true;
                    }
                }
                let mut per = if any { best } else { 0.0 };
                per += aggregated as f64 * agg;
                per
            }
        };
        let interval_s = self.spec.interval.as_secs_f64().max(1e-3);
        let lead_steps = self.memory.lead_ms / 1000.0 / interval_s;
        let rate_now = slow
            .filter(|w| w.secs > 0.0)
            .map(|w| w.arrivals as f64 / w.secs)
            .unwrap_or_else(|| self.memory.rate.predict(0.0));
        let rate_ahead = self.memory.rate.predict(lead_steps.max(1.0));
        let rate_up = rate_now.max(rate_ahead);
        nums.insert("rate".into(), rate_now);
        nums.insert("rate_ahead".into(), rate_ahead);
        nums.insert("isl".into(), isl);
        nums.insert("osl".into(), osl);
        nums.insert("capacity_per_replica".into(), per);
        nums.insert("lead_s".into(), self.memory.lead_ms / 1000.0);
        nums.insert("prefill_ms".into(), cap.prefill.service_ms);
        nums.insert("step_ms".into(), cap.decode.service_ms);
        let m = self.memory.targets.entry(t.name.clone()).or_default();
        nums.insert("learned_prefill".into(), m.learned.prefill);
        nums.insert("learned_decode".into(), m.learned.decode);
        nums.insert("ttft_correction_ms".into(), self.memory.ttft_correction_ms);
        nums.insert("itl_correction_ms".into(), self.memory.itl_correction_ms);
        let mut n = t.desired;
        let mut rule = "hold".to_string();
        let mut reason = format!("{} replicas carry the load", t.desired);
        // Sizing: enough replicas for the demand expected once a new one
        // would be ready; a shrink only within the hysteresis band.
        if slow.is_some() {
            let need_up = ceil_u32(rate_up / per).max(1);
            // The shrink looks at the same forecast the growth did, so a
            // noisy forecast that grew a target keeps it while it recurs.
            let down_to = ceil_u32(rate_up / (per * DOWN_UTILISATION)).max(1);
            nums.insert("need".into(), need_up as f64);
            m.recent.push_back((now, down_to));
            while m.recent.len() > MAX_RECENT {
                m.recent.pop_front();
            }
            if need_up > n {
                n = need_up;
                rule = "sla".into();
                reason = format!(
                    "{rate_up:.2} req/s expected within {:.0} s (ISL {isl:.0}, OSL {osl:.0}); one replica carries {per:.2} req/s within TTFT {:.0} ms / ITL {:.0} ms",
                    self.memory.lead_ms / 1000.0,
                    self.ttft_ms(),
                    self.itl_ms()
                );
                let why = [&cap.prefill.infeasible, &cap.decode.infeasible]
                    .iter()
                    .filter(|s| !s.is_empty())
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join("; ");
                if !why.is_empty() {
                    reason.push_str(&format!(" (SLA not reachable: {why})"));
                }
            }
        }
        // Burst: queues the prediction did not see, against every desired
        // replica (pending ones count as coming).
        let (burst, why) = self.burst(t, fast, &cap, isl);
        nums.insert("need_burst".into(), burst as f64);
        if burst > 0 {
            // What the queues asked for counts in the shrink window too, so
            // a lasting queue does not shrink and burst back in turns.
            let m = self.memory.targets.entry(t.name.clone()).or_default();
            m.recent.push_back((now, burst));
            while m.recent.len() > MAX_RECENT {
                m.recent.pop_front();
            }
        }
        if burst > n {
            n = burst;
            rule = "burst".into();
            reason = why;
        }
        // Shrink: the largest recommendation of the last window, and not
        // within the window of the last change.
        let m = self.memory.targets.entry(t.name.clone()).or_default();
        let window_ms = self.spec.scale_down_after.as_millis() as u64;
        if n == t.desired
            && slow.is_some()
            && now.saturating_sub(m.last_change_ms) >= window_ms
            && now.saturating_sub(self.memory.busy_since_ms) >= window_ms
            && t.ready >= t.desired
        {
            let since = now.saturating_sub(window_ms);
            let highest = m
                .recent
                .iter()
                .filter(|(at, _)| *at >= since)
                .map(|(_, r)| *r)
                .max()
                .unwrap_or(t.desired);
            if highest < t.desired {
                n = highest;
                rule = "shrink".into();
                reason = format!(
                    "{highest} replicas carry {rate_up:.2} req/s at ≤{:.0}% of {per:.2} req/s each, for the last {:.0} s",
                    DOWN_UTILISATION * 100.0,
                    window_ms as f64 / 1000.0
                );
            }
        }
        (n, rule, reason, nums)
    }

    /// Replicas the queues ask for now (0 when they ask for nothing).
    fn burst(&self, t: &Target, w: &Window, cap: &TargetCapacity, isl: f64) -> (u32, String) {
        let mine: Vec<&WorkerSample> = w.workers.iter().filter(|s| s.target == t.name).collect();
        let (pf, dc, per_group) = match t.kind {
            TargetKind::Prefill => (true, false, (1, 0)),
            TargetKind::Decode => (false, true, (0, 1)),
            TargetKind::Aggregated => (true, true, (1, 1)),
            TargetKind::Group {
                prefill,
                decode,
                aggregated,
            } => (
                prefill + aggregated > 0,
                decode + aggregated > 0,
                (prefill + aggregated, decode + aggregated),
            ),
        };
        let mut best = (0, String::new());
        let ttft = self.ttft_ms();
        if pf && per_group.0 > 0 {
            let queued: u64 = mine
                .iter()
                .filter(|s| matches!(s.phase, Some(Phase::Prefill) | Some(Phase::Aggregated)))
                .map(|s| s.queued_prefill_tokens)
                .fold(0u64, u64::saturating_add)
                .saturating_add((w.queued as f64 * isl) as u64);
            // The learned cost of a prefill (per token and per batch).
            let factor = cap.prefill.service_ms / t.timing.prefill(isl.max(1.0));
            let batch = t.timing.max_batch_tokens.max(1.0);
            let drain_ms = |q: f64| {
                if q <= 0.0 {
                    return 0.0;
                }
                (q / batch).ceil() * t.timing.prefill(q.min(batch)) * factor
            };
            // A new arrival waits for the queue ahead of it, then its own.
            let budget = ttft - cap.prefill.service_ms;
            let q = queued as f64;
            if queued > 0 && budget > 0.0 && drain_ms(q / t.desired.max(1) as f64) > budget {
                let mut n = t.desired.max(1);
                while n < 4096 && drain_ms(q / n as f64) > budget {
                    n += 1;
                }
                let n = n.div_ceil(per_group.0);
                if n > best.0 {
                    best = (
                        n,
                        format!(
                            "{queued} prompt tokens queued: {n} replicas prefill them within TTFT {ttft:.0} ms ({:.0} ms for a {batch:.0}-token batch)",
                            t.timing.prefill(batch) * factor
                        ),
                    );
                }
            }
        }
        if dc && per_group.1 > 0 {
            let seqs: u32 = mine
                .iter()
                .filter(|s| matches!(s.phase, Some(Phase::Decode) | Some(Phase::Aggregated)))
                .map(|s| s.active.saturating_add(s.waiting))
                .fold(0u32, u32::saturating_add);
            let per = cap.decode_seqs.max(1.0);
            let n = ceil_u32(seqs as f64 / per).div_ceil(per_group.1);
            if n > best.0 && seqs > 0 {
                best = (
                    n,
                    format!(
                        "{seqs} sequences decoding or waiting: {n} replicas keep ITL within {:.0} ms ({per:.0} sequences each)",
                        self.itl_ms()
                    ),
                );
            }
        }
        best
    }

    /// Dynamo's load rule (the baseline): +1 when every engine is over its
    /// target, −1 when every engine is under 80% of it.
    fn load_rule(&self, t: &Target, w: &Window) -> (u32, String, String, BTreeMap<String, f64>) {
        let (ttft, itl) = (self.ttft_ms(), self.itl_ms());
        let mine: Vec<&WorkerSample> = w.workers.iter().filter(|s| s.target == t.name).collect();
        let mut nums = BTreeMap::new();
        nums.insert("engines".into(), mine.len() as f64);
        // An engine's load against its target: the worse of its phases
        // (None: it measured nothing in the period, so it says nothing).
        let ratio = |s: &WorkerSample| -> Option<f64> {
            let p = s.ttft_ms.map(|x| x / ttft);
            let d = s.itl_ms.map(|x| x / itl);
            match s.phase {
                Some(Phase::Prefill) => p,
                Some(Phase::Decode) => d,
                _ => match (p, d) {
                    (Some(a), Some(b)) => Some(a.max(b)),
                    (a, b) => a.or(b),
                },
            }
        };
        if mine.is_empty() {
            return (t.desired, "hold".into(), "no engine reports".into(), nums);
        }
        let ratios: Vec<f64> = mine.iter().filter_map(|s| ratio(s)).collect();
        if ratios.is_empty() {
            return (
                t.desired,
                "hold".into(),
                "no engine measured anything in the period".into(),
                nums,
            );
        }
        let max = ratios.iter().cloned().fold(0.0, f64::max);
        let min = ratios.iter().cloned().fold(f64::INFINITY, f64::min);
        nums.insert("highest_load".into(), max);
        nums.insert("lowest_load".into(), min);
        if min > 1.0 {
            (
                t.desired + 1,
                "load_rule".into(),
                format!(
                    "every engine over its target (lowest at {:.0}%)",
                    min * 100.0
                ),
                nums,
            )
        } else if max < 0.8 && t.desired > 1 {
            (
                t.desired - 1,
                "load_rule".into(),
                format!(
                    "every engine under 80% of its target (highest at {:.0}%)",
                    max * 100.0
                ),
                nums,
            )
        } else {
            (t.desired, "hold".into(), "within the band".into(), nums)
        }
    }

    /// Waking from zero, the idle rule, and the target's bounds.
    fn edges(
        &self,
        t: &Target,
        w: &Window,
        n: u32,
        rule: String,
        reason: String,
    ) -> (u32, String, String) {
        let (mut n, mut rule, mut reason) = (n, rule, reason);
        let demand = w.arrivals > 0 || w.queued > 0 || w.held > 0;
        if t.desired == 0 && demand {
            n = n.max(1);
            rule = "wake".into();
            reason = format!(
                "{} request(s) waiting with no replica up: waking to {n} ({reason})",
                w.queued.max(w.held).max(1)
            );
        }
        if let Some(idle) = self.spec.idle_to_zero {
            let idle_ms = idle.as_millis() as u64;
            let quiet = w.now_ms.saturating_sub(self.memory.last_busy_ms);
            if !demand && quiet >= idle_ms && t.limits.min == 0 && n > 0 {
                n = 0;
                rule = "idle".into();
                reason = format!("idle for {:.0} s: scaled to zero", quiet as f64 / 1000.0);
            }
        }
        if n > t.limits.max {
            reason = format!("{reason}; held at max {} (wanted {n})", t.limits.max);
            rule = "limits".into();
            n = t.limits.max;
        } else if n < t.limits.min {
            n = t.limits.min;
        }
        (n, rule, reason)
    }

    /// Keeps the targets' slots within the budget, trimming growth first.
    fn budget(&self, targets: &[Target], want: &mut [(u32, String, String)], notes: &mut [Note]) {
        let Some(budget) = self.spec.slot_budget else {
            return;
        };
        let slots = |want: &[(u32, String, String)]| -> u64 {
            targets
                .iter()
                .zip(want.iter())
                .map(|(t, w)| w.0 as u64 * t.slots as u64)
                .sum()
        };
        let wanted = slots(want);
        if wanted <= budget as u64 {
            return;
        }
        loop {
            if slots(want) <= budget as u64 {
                break;
            }
            // The target grown most past what it has, else the largest.
            let pick = targets
                .iter()
                .enumerate()
                .filter(|(i, t)| !t.pinned && want[*i].0 > t.limits.min && t.slots > 0)
                .max_by_key(|(i, t)| {
                    (
                        want[*i].0 as i64 - t.desired as i64,
                        want[*i].0 as u64 * t.slots as u64,
                    )
                })
                .map(|(i, _)| i);
            match pick {
                Some(i) => want[i].0 -= 1,
                None => break,
            }
        }
        let got = slots(want);
        for (i, t) in targets.iter().enumerate() {
            let msg = format!(
                "slot budget {budget}: demand asks for {wanted} slots; {} gets {} ({got} slots in all)",
                t.name, want[i].0
            );
            if notes[i].recommended != want[i].0 {
                want[i].1 = "budget".into();
                want[i].2 = format!("{msg}; {}", want[i].2);
            }
            notes[i].reason = format!("{msg}; {}", notes[i].reason);
            notes[i].recommended = want[i].0;
            notes[i]
                .numbers
                .insert("budget_wanted_slots".into(), wanted as f64);
        }
    }
}
