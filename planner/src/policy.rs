//! The planner's decisions: how many replicas each target should have.
//!
//! [`PlannerState::evaluate`] is called every fast interval with what was
//! observed since the last call, and every sizing interval with the longer
//! window too. It returns the changes to make (at most one per target) and
//! the numbers behind every target's recommendation.
//! The burst and load rules live in `rules.rs`, the bounds and the slot
//! budget in `limits.rs`.
//!
//! Invariants of a result:
//! - a target's replicas stay within its `min`/`max`, and the targets'
//!   slots together within the budget (when demand asks for more, the
//!   decision says so);
//! - a pinned target (a manual `dynamoctl scale`) is never changed;
//! - nothing shrinks within `scale_down_after` of the target's last
//!   change, and a shrink goes to the largest recommendation of that
//!   window (with the 80% hysteresis band, a constant load never flips the
//!   direction), and each recent shrink that a growth undid doubles that
//!   window;
//! - pending replicas (desired, not yet ready) count as coming: the burst
//!   rule only adds what desired replicas cannot absorb, and the arrival
//!   rule acts only on the last second's arrivals exceeding what they
//!   carry by [`ARRIVAL_Z`] standard deviations;
//! - only the idle rule scales a target to zero; any demand wakes it.

use crate::capacity::{
    aggregated_capacity, decode_capacity, prefill_capacity, utilisation_at, Capacity, EngineTiming,
    Learned,
};
use crate::demand::{Demand, Seen};
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
/// The most replicas the sizing rule computes (limits cap it further).
const MAX_SIZED: u32 = 4096;
/// Recommendations kept per target (the scale-down window's history).
const MAX_RECENT: usize = 512;
/// Seconds of arrivals the arrival rule looks at (the fast windows of
/// about the last second).
pub const ARRIVAL_SPAN_S: f64 = 1.0;
/// Poisson standard deviations by which the arrivals of that span must
/// exceed what the desired replicas carry before the arrival rule acts.
pub const ARRIVAL_Z: f64 = 3.0;
/// Fast windows kept for the arrival rule, whatever their length.
const MAX_ARRIVAL_WINDOWS: usize = 64;
/// Decisions a worker must report before it is learned from (cold start).
const WARM_WINDOWS: u32 = 2;
/// Shrink windows a new period of demand is watched before anything
/// shrinks: output lengths are known only as requests finish, and the
/// first to finish are the short ones.
const NEW_PERIOD_WINDOWS: u64 = 2;
/// Undone shrinks remembered per target (the shrink window doubles per
/// recent one, so at most 2^this times longer).
const MAX_REVERSALS: usize = 4;
/// An undone shrink counts as recent for this many (base) shrink windows.
const REVERSAL_MEMORY: u64 = 32;

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
    /// Requests whose prompt length the window saw, and their mean.
    pub prompts: u64,
    pub isl_mean: Option<f64>,
    /// Requests that finished in the window, and their mean output length.
    pub finished: u64,
    pub osl_mean: Option<f64>,
    /// 90th percentile of the requests' TTFT (ms).
    pub ttft_p90_ms: Option<f64>,
    /// Median of the requests' mean ITL (ms).
    pub itl_p50_ms: Option<f64>,
    /// Requests waiting at the gateways now (admission and held).
    pub queued: u32,
    /// Of those, held because no worker is up at all.
    pub held: u32,
    /// Requests being served now.
    pub inflight: u32,
    /// Streams open now, and the output tokens they have streamed so far.
    pub streams: u64,
    pub stream_tokens: u64,
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
    /// When a growth followed a shrink (unix ms), newest last: each recent
    /// one doubles the evidence the next shrink needs.
    #[serde(default)]
    pub reversals: VecDeque<u64>,
    /// Unix ms of the last change the shrink rule made (0: none).
    #[serde(default)]
    pub last_shrink_ms: u64,
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
    /// Nothing shrinks within two shrink windows of it: what a new load has
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
    /// The rate and lengths sized for (see [`crate::demand`]).
    #[serde(default)]
    pub demand: Demand,
    /// The fast windows of about the last [`ARRIVAL_SPAN_S`]: (seconds,
    /// arrivals), oldest first.
    #[serde(default)]
    pub recent_arrivals: VecDeque<(f64, u64)>,
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
            demand: Demand::default(),
            recent_arrivals: VecDeque::new(),
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

/// Adds a recommendation to a shrink window's history, one entry (the
/// largest) per sizing interval, so the history spans the longest window
/// (16 × `scale_down_after`) within [`MAX_RECENT`] entries.
fn push_recent(recent: &mut VecDeque<(u64, u32)>, now: u64, r: u32, interval_ms: u64) {
    let bucket = |at: u64| at / interval_ms.max(1);
    match recent.back_mut() {
        Some(last) if bucket(last.0) == bucket(now) => {
            last.0 = now;
            last.1 = last.1.max(r);
        }
        _ => recent.push_back((now, r)),
    }
    while recent.len() > MAX_RECENT {
        recent.pop_front();
    }
}

pub(crate) fn ceil_u32(x: f64) -> u32 {
    if x.is_finite() && x > 0.0 {
        x.ceil().min(u32::MAX as f64) as u32
    } else {
        0
    }
}

/// Capacity of one replica of a target, per phase it runs.
pub(crate) struct TargetCapacity {
    pub(crate) prefill: Capacity,
    pub(crate) decode: Capacity,
    /// Sequences one decode-capable replica holds at the KV utilisation
    /// where a step meets the ITL target.
    pub(crate) decode_seqs: f64,
    /// That utilisation.
    pub(crate) decode_util: f64,
}

impl PlannerState {
    pub fn new(spec: PlannerSpec) -> Self {
        let memory = Memory::new(&spec);
        PlannerState { spec, memory }
    }

    /// Continues from a predecessor's memory (its status).
    pub fn adopt(spec: PlannerSpec, mut memory: Memory) -> Self {
        // Arrivals counted before the handover are not the last second's.
        memory.recent_arrivals.clear();
        PlannerState { spec, memory }
    }

    pub(crate) fn ttft_ms(&self) -> f64 {
        self.spec.ttft.as_secs_f64() * 1000.0
    }
    pub(crate) fn itl_ms(&self) -> f64 {
        self.spec.itl.as_secs_f64() * 1000.0
    }

    /// The decode fleet `replicas` replicas of a target make: their
    /// decode-capable members (a prefill target, which has none, counts
    /// its replicas; its decode capacity is never used).
    fn decode_members(kind: TargetKind, replicas: u32) -> f64 {
        let per = match kind {
            TargetKind::Prefill => 0,
            TargetKind::Decode | TargetKind::Aggregated => 1,
            TargetKind::Group {
                decode, aggregated, ..
            } => decode + aggregated,
        };
        (replicas.max(1) as f64 * per.max(1) as f64).max(1.0)
    }

    /// One replica's capacity when the target has `replicas` of them.
    fn capacity(&self, t: &Target, isl: f64, osl: f64, replicas: u32) -> TargetCapacity {
        let m = self.memory.targets.get(&t.name);
        let l = m.map(|m| m.learned.clone()).unwrap_or_default();
        // What the model does not see comes off the targets.
        let ttft = self.ttft_ms() - self.memory.ttft_correction_ms;
        let itl = self.itl_ms() - self.memory.itl_correction_ms;
        let fleet = Self::decode_members(t.kind, replicas);
        let prefill = prefill_capacity(&t.timing, &l, isl, ttft);
        let decode = decode_capacity(&t.timing, &l, isl, osl, itl, fleet);
        // The sequences a replica holds at the occupancy limit: the burst
        // rule counts the sequences running now, a realised count, so no
        // margin for the spread about a mean applies.
        let live = crate::capacity::live_tokens(isl, osl);
        let decode_util = utilisation_at(&t.timing, l.decode, itl).max(0.02);
        let decode_seqs =
            (decode_util * t.timing.kv_tokens / live).clamp(1.0, t.timing.max_seqs.max(1.0) * 0.9);
        TargetCapacity {
            prefill,
            decode,
            decode_seqs,
            decode_util,
        }
    }

    /// Requests/s one replica of a target of this kind carries.
    fn per_replica(kind: TargetKind, cap: &TargetCapacity) -> f64 {
        match kind {
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
        // The arrivals of about the last second (the oldest window goes
        // once the newer ones cover the span).
        let recent = &mut self.memory.recent_arrivals;
        if fast.secs.is_finite() && fast.secs > 0.0 {
            recent.push_back((fast.secs, fast.arrivals));
        }
        while recent.len() > MAX_ARRIVAL_WINDOWS
            || (recent.len() > 1
                && recent.iter().skip(1).map(|w| w.0).sum::<f64>() >= ARRIVAL_SPAN_S)
        {
            recent.pop_front();
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
            let direction = if n > t.desired { 1 } else { -1 };
            // A growth after a shrink (by the shrink rule, recently) says
            // the shrink was early; a shrink after a growth is just a burst
            // passing, and idle, budget and limits cuts are not guesses.
            let memory_ms =
                REVERSAL_MEMORY.saturating_mul(self.spec.scale_down_after.as_millis() as u64);
            if direction == 1
                && m.last_shrink_ms > 0
                && now.saturating_sub(m.last_shrink_ms) < memory_ms
            {
                // One undone shrink counts once, however many steps the
                // growth takes.
                m.last_shrink_ms = 0;
                m.reversals.push_back(now);
                while m.reversals.len() > MAX_REVERSALS {
                    m.reversals.pop_front();
                }
            }
            if direction == -1 && rule == "shrink" {
                m.last_shrink_ms = now;
            }
            m.last_change_ms = now;
            m.last_direction = direction;
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

    /// Feeds the demand estimates and the predictors, and learns capacity
    /// from warm workers.
    fn learn(&mut self, targets: &[Target], w: &Window) {
        let d = &mut self.memory.demand;
        d.observe(Seen {
            secs: w.secs,
            arrivals: w.arrivals,
            prompts: w.prompts,
            isl: w.isl_mean,
            finished: w.finished,
            osl: w.osl_mean,
            streams: w.streams,
            stream_tokens: w.stream_tokens,
        });
        // The predictors forecast the estimates, not one window's noise.
        if let Some(r) = d.rate() {
            self.memory.rate.observe(r);
        }
        if let Some(x) = d.isl.mean() {
            self.memory.isl.observe(x);
        }
        if let Some(x) = d.osl_estimate(self.spec.expected_osl.map(f64::from)) {
            self.memory.osl.observe(x);
        }
        self.correct(targets, w);
        let itl_target = self.itl_ms();
        for t in targets {
            let timing = t.timing.clone();
            let Some(m) = self.memory.targets.get_mut(&t.name) else {
                continue;
            };
            // One sample per phase per window, from all its warm workers
            // together: blending each worker in turn would let the last few
            // workers' noise replace what was learned.
            let (mut prefill, mut decode) = (Vec::new(), Vec::new());
            for s in w.workers.iter().filter(|s| s.target == t.name) {
                if s.windows < WARM_WINDOWS {
                    continue; // cold-start samples never inflate the model
                }
                let prefills = matches!(s.phase, Some(Phase::Prefill) | Some(Phase::Aggregated));
                let decodes = matches!(s.phase, Some(Phase::Decode) | Some(Phase::Aggregated));
                // An idle-enough prefill worker's TTFT is its prefill time.
                if prefills && s.waiting == 0 && s.queued_prefill_tokens == 0 {
                    if let (Some(ttft), Some(isl)) = (s.ttft_ms, s.isl) {
                        prefill.push((isl, ttft));
                    }
                }
                // A decode sample teaches only near the loads sizing is
                // for: at a nearly empty cache a step is short and fixed
                // costs (timers, delivery) dominate the ratio, which would
                // then scale the whole curve.
                if decodes && timing.step(s.kv_util) >= DECODE_LEARN_SHARE * itl_target {
                    if let Some(itl) = s.itl_ms {
                        decode.push((s.kv_util, itl));
                    }
                }
            }
            m.learned.prefill_window(&timing, &prefill);
            m.learned.decode_window(&timing, &decode);
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
                    // The median request's mean gap against the step at the
                    // mean occupancy: like with like, so what the tail
                    // model gets wrong is not taken for time the workers
                    // do not see (on a flat stretch of the step curve a
                    // few milliseconds move the occupancy limit far).
                    let u = us.iter().sum::<f64>() / us.len() as f64;
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
        if let (Some(obs), Some(pred)) = (w.itl_p50_ms, itl_pred) {
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
        // Lengths from the forecast of the request-weighted means (one
        // short window's mean is noise), or from the fast window before
        // there is any.
        let smoothed = |p: &AnyPredictor, now: Option<f64>| {
            let v = p.predict(1.0);
            if v > 0.0 {
                v
            } else {
                now.unwrap_or(1.0).max(1.0)
            }
        };
        let isl = smoothed(&self.memory.isl, fast.isl_mean);
        let first = self
            .memory
            .demand
            .osl_estimate(self.spec.expected_osl.map(f64::from));
        let osl = smoothed(&self.memory.osl, first.or(fast.osl_mean));
        let cap = self.capacity(t, isl, osl, t.desired);
        let per = Self::per_replica(t.kind, &cap);
        // Replicas for a rate: the fewest n whose n replicas carry it (a
        // replica carries more in a larger fleet, so n·per(n) rises with n).
        let need = |rate: f64| -> u32 {
            if !(rate.is_finite() && rate > 0.0) {
                return 1;
            }
            let carries =
                |n: u32| n as f64 * Self::per_replica(t.kind, &self.capacity(t, isl, osl, n));
            let (mut lo, mut hi) = (1u32, 1u32);
            while hi < MAX_SIZED && carries(hi) < rate {
                lo = hi + 1;
                hi = (hi * 2).min(MAX_SIZED);
            }
            while lo < hi {
                let mid = lo + (hi - lo) / 2;
                if carries(mid) >= rate {
                    hi = mid;
                } else {
                    lo = mid + 1;
                }
            }
            hi
        };
        let interval_s = self.spec.interval.as_secs_f64().max(1e-3);
        let interval_ms = self.spec.interval.as_millis() as u64;
        let lead_steps = self.memory.lead_ms / 1000.0 / interval_s;
        // The rate over the last sizing windows with an allowance for its
        // noise, or the forecast for when a new replica would be ready.
        let rate_now = self
            .memory
            .demand
            .rate()
            .unwrap_or_else(|| self.memory.rate.predict(0.0));
        let rate_upper = self.memory.demand.rate_upper().unwrap_or(rate_now);
        let rate_ahead = self.memory.rate.predict(lead_steps.max(1.0));
        let rate_up = rate_upper.max(rate_ahead);
        // Sizing: enough replicas for the demand expected once a new one
        // would be ready. The shrink looks at the same forecast the growth
        // did, so a noisy forecast that grew a target keeps it while it
        // recurs.
        let sized = slow
            .is_some()
            .then(|| (need(rate_up), need(rate_up / DOWN_UTILISATION)));
        // Arrivals: a rise that queues show only once it has filled them
        // (decode's only after prefill), and the rate windows only after
        // seconds. It acts when the last second's arrivals exceed what the
        // desired replicas carry by ARRIVAL_Z standard deviations of a
        // Poisson count, and sizes for the rate one deviation below what
        // was seen: a count that high is rarely noise, and the rate sized
        // for is more likely under the true one than over it.
        let (span, seen) = self
            .memory
            .recent_arrivals
            .iter()
            .fold((0.0, 0u64), |(s, a), w| (s + w.0, a + w.1));
        let carried = t.desired as f64 * per;
        let expected = carried * span;
        let arrival = (t.desired > 0
            && span >= ARRIVAL_SPAN_S / 2.0
            && seen as f64 > expected + ARRIVAL_Z * expected.max(1.0).sqrt())
        .then(|| {
            let rate = (seen as f64 - (seen as f64).sqrt()) / span;
            (need(rate), rate)
        });
        nums.insert("rate".into(), rate_now);
        nums.insert("rate_upper".into(), rate_upper);
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
        // A shrink only within the hysteresis band.
        if let Some((need_up, down_to)) = sized {
            nums.insert("need".into(), need_up as f64);
            push_recent(&mut m.recent, now, down_to, interval_ms);
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
        let (burst, why) = self.burst(t, fast, &cap, isl, 1.0);
        nums.insert("need_burst".into(), burst as f64);
        // What the queues would ask for with every replica below the band
        // counts in the shrink window, so a lasting queue does not shrink a
        // target and burst it back in turns (the same hysteresis as the
        // sizing's `down_to`).
        let (keep, _) = self.burst(t, fast, &cap, isl, DOWN_UTILISATION);
        nums.insert("burst_keeps".into(), keep as f64);
        if keep > 0 {
            let m = self.memory.targets.entry(t.name.clone()).or_default();
            push_recent(&mut m.recent, now, keep.max(burst), interval_ms);
        }
        if burst > n {
            n = burst;
            rule = "burst".into();
            reason = why;
        }
        if let Some((want, rate)) = arrival {
            nums.insert("need_arrivals".into(), want as f64);
            // Not held in the shrink window: a burst that lasts shows in
            // the sizing rule's rate window, which holds it; one that
            // passes shrinks a window after its growth (holding it cost
            // 4% more worker-seconds on the benchmark's diurnal shape and
            // kept no more requests within the SLA).
            if want > n {
                n = want;
                rule = "burst".into();
                reason = format!(
                    "{seen} arrivals in the last {span:.1} s, over the {carried:.2} req/s {} replicas carry by more than {ARRIVAL_Z:.0} standard deviations: {want} replicas carry {rate:.2} req/s",
                    t.desired
                );
            }
        }
        // Shrink: the largest recommendation of the last window, and not
        // within the window of the last change. Each shrink that a growth
        // undid in the last few windows doubles the window, so noise that
        // crosses the band now and then cannot keep a target going up and
        // down.
        let m = self.memory.targets.entry(t.name.clone()).or_default();
        let base_ms = self.spec.scale_down_after.as_millis() as u64;
        let turns = m
            .reversals
            .iter()
            .filter(|at| now.saturating_sub(**at) < REVERSAL_MEMORY.saturating_mul(base_ms))
            .count()
            .min(MAX_REVERSALS) as u32;
        let window_ms = base_ms.saturating_mul(1u64 << turns);
        nums.insert("shrink_window_s".into(), window_ms as f64 / 1000.0);
        if n == t.desired
            && slow.is_some()
            && now.saturating_sub(m.last_change_ms) >= window_ms
            && now.saturating_sub(self.memory.busy_since_ms)
                >= NEW_PERIOD_WINDOWS.saturating_mul(base_ms)
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
}
