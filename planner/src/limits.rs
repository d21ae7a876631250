//! The limits every recommendation passes through: waking from zero, the
//! idle rule, a target's `min`/`max`, and the slot budget.
//!
//! Invariant: what leaves here is within every target's bounds and, with
//! the other targets, within the budget; when demand asks for more, the
//! reason says so. The one exception is a budget below what cannot be
//! trimmed (the targets' minimums and pins: spec validation refuses the
//! first, but on Kubernetes every target's floor is 1, and a pin is the
//! operator's); the reason then says it is over.

use crate::policy::{Note, PlannerState, Target, Window};

impl PlannerState {
    /// Waking from zero, the idle rule, and the target's bounds.
    pub(crate) fn edges(
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
    pub(crate) fn budget(
        &self,
        targets: &[Target],
        want: &mut [(u32, String, String)],
        notes: &mut [Note],
    ) {
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
        // What cannot be trimmed (minimums, pins, and on Kubernetes a floor
        // of one replica each) may itself hold more than the budget.
        let over = if got > budget as u64 {
            format!("; over the budget: minimums and pins hold {got} slots")
        } else {
            String::new()
        };
        for (i, t) in targets.iter().enumerate() {
            let msg = format!(
                "slot budget {budget}: demand asks for {wanted} slots; {} gets {} ({got} slots in all{over})",
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
