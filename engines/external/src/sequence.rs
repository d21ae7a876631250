//! The publisher's sequence numbers: each batch carries one, one more than
//! the last. A jump is a gap to fill from the publisher's replay endpoint;
//! a number at or below the last is a duplicate (a replayed batch already
//! seen, or a publisher that restarted).
//!
//! Invariants: every batch is applied at most once and in order; a gap is
//! reported once, as the range it misses; a replay longer than
//! [`MAX_GAP`] is not asked for (the caller resynchronises instead).

/// Largest gap filled by replay (batches); past it, resynchronise.
pub const MAX_GAP: u64 = 100_000;

/// What to do with a batch of a sequence number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// The next one in order: apply it.
    Apply,
    /// Already applied: drop it.
    Duplicate,
    /// Batches `from..=to` are missing: replay them, then apply this one.
    Gap { from: u64, to: u64 },
    /// More are missing than replay is asked for: the publisher restarted
    /// or we fell far behind. Apply it and resynchronise.
    Lost { missing: u64 },
}

/// The last sequence number applied.
#[derive(Clone, Copy, Debug, Default)]
pub struct Sequence {
    last: Option<u64>,
}

impl Sequence {
    pub fn last(&self) -> Option<u64> {
        self.last
    }

    /// What to do with batch `seq`, seen live.
    pub fn live(&self, seq: u64) -> Next {
        match self.last {
            None => Next::Apply,
            Some(l) if seq <= l => Next::Duplicate,
            Some(l) if seq == l + 1 => Next::Apply,
            Some(l) if seq - l - 1 > MAX_GAP => Next::Lost {
                missing: seq - l - 1,
            },
            Some(l) => Next::Gap {
                from: l + 1,
                to: seq - 1,
            },
        }
    }

    /// `seq` was applied.
    pub fn applied(&mut self, seq: u64) {
        self.last = Some(seq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_gaps_and_duplicates() {
        let mut s = Sequence::default();
        assert_eq!(s.live(7), Next::Apply);
        s.applied(7);
        assert_eq!(s.live(8), Next::Apply);
        s.applied(8);
        assert_eq!(s.live(8), Next::Duplicate);
        assert_eq!(s.live(3), Next::Duplicate);
        assert_eq!(s.live(12), Next::Gap { from: 9, to: 11 });
        s.applied(9);
        assert_eq!(
            s.live(9 + MAX_GAP + 2),
            Next::Lost {
                missing: MAX_GAP + 1
            }
        );
    }
}
