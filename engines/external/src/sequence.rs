//! The publisher's sequence numbers: each live batch carries one, one more
//! than the last. A jump is a gap to fill from the publisher's replay
//! endpoint; a live number at or below the last live one means the
//! publisher restarted (engines number from 0 again); a number at or below
//! the last applied one, but past the last live one, was already applied
//! from a replay.
//!
//! Invariants: every batch is applied at most once and in order within a
//! publisher's life; a gap is reported once, as the range it misses; a gap
//! longer than [`MAX_GAP`] is not asked for.

/// Largest gap filled by replay (batches).
pub const MAX_GAP: u64 = 100_000;

/// What to do with a live batch of a sequence number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// The next one in order: apply it.
    Apply,
    /// Already applied from a replay: drop it.
    Duplicate,
    /// Batches `from..=to` are missing: replay them, then apply this one.
    Gap { from: u64, to: u64 },
    /// More are missing than replay is asked for: apply it, after telling
    /// the consumer that what it holds may be stale.
    Lost { missing: u64 },
    /// The publisher started again: forget everything, then apply it.
    Restart,
}

/// Where the stream stands.
#[derive(Clone, Copy, Debug, Default)]
pub struct Sequence {
    applied: Option<u64>,
    live: Option<u64>,
}

impl Sequence {
    /// The last sequence number applied.
    pub fn last(&self) -> Option<u64> {
        self.applied
    }

    /// What to do with live batch `seq`. The first batch seen is a gap
    /// from 0 when it is not 0: what the engine cached before we listened.
    pub fn live(&self, seq: u64) -> Next {
        if self.live.is_some_and(|l| seq <= l) {
            return Next::Restart;
        }
        let next = match self.applied {
            Some(a) if seq <= a => return Next::Duplicate,
            Some(a) => a + 1,
            None => 0,
        };
        match seq - next {
            0 => Next::Apply,
            missing if missing > MAX_GAP => Next::Lost { missing },
            _ => Next::Gap {
                from: next,
                to: seq - 1,
            },
        }
    }

    /// Live batch `seq` was seen (whatever was done with it).
    pub fn seen_live(&mut self, seq: u64) {
        self.live = Some(seq);
    }

    /// `seq` was applied.
    pub fn applied(&mut self, seq: u64) {
        self.applied = Some(seq);
    }

    /// The publisher restarted: nothing is applied any more.
    pub fn reset(&mut self) {
        *self = Sequence::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_gaps_duplicates_and_restarts() {
        let s = Sequence::default();
        // Joining late: what came before is a gap from 0.
        assert_eq!(s.live(7), Next::Gap { from: 0, to: 6 });
        let mut s = Sequence::default();
        assert_eq!(s.live(0), Next::Apply);
        s.seen_live(0);
        s.applied(0);
        assert_eq!(s.live(1), Next::Apply);
        s.seen_live(1);
        s.applied(1);
        assert_eq!(s.live(4), Next::Gap { from: 2, to: 3 });
        s.seen_live(4);
        // The replay reached past the live batch: 5 and 6 are applied.
        for q in 2..=6 {
            s.applied(q);
        }
        assert_eq!(s.live(5), Next::Duplicate);
        s.seen_live(5);
        assert_eq!(s.live(7), Next::Apply);
        s.seen_live(7);
        s.applied(7);
        // A live number at or below the last live one: a restart.
        assert_eq!(s.live(0), Next::Restart);
        s.reset();
        assert_eq!(s.live(0), Next::Apply);
        s.seen_live(0);
        s.applied(0);
        assert_eq!(
            s.live(MAX_GAP + 2),
            Next::Lost {
                missing: MAX_GAP + 1
            }
        );
    }
}
