//! Replies too large for one bus message, in pieces.
//!
//! A responder encodes its whole reply as usual; if the envelope is larger
//! than [`MAX_MESSAGE`] it [`split`]s it into [`ChunkedReply`] pieces of at
//! most `max_piece` data bytes, all sent to the request's reply subject.
//! The requester feeds what arrives to an [`Assembler`], which hands back
//! the original envelope once every piece is in.
//!
//! Invariants: pieces of one reply share a random `stream` id; an
//! assembler accepts only pieces of the stream it saw first, each index
//! once, with one `count` throughout; it never holds more than
//! [`MAX_ASSEMBLED`] bytes; a reply that fits is never split.

use crate::codec::{MAX_ASSEMBLED, MAX_MESSAGE};
use crate::messages::ChunkedReply;
use thiserror::Error;

/// Data bytes per piece that keep a [`ChunkedReply`]'s envelope under
/// [`MAX_MESSAGE`] (the envelope adds a header and a few varints).
pub const MAX_PIECE: usize = MAX_MESSAGE - 64;
/// Smallest piece [`split`] makes (but the last), which bounds how many
/// pieces one reply can claim to have.
pub const MIN_PIECE: usize = 4096;
/// Most pieces of one reply.
pub const MAX_PIECES: u32 = (MAX_ASSEMBLED / MIN_PIECE) as u32;

/// Splits an encoded reply into pieces of at most `max_piece` data bytes;
/// `None` when it fits in one message and goes as it is.
pub fn split(encoded: &[u8], max_piece: usize, stream: u64) -> Option<Vec<ChunkedReply>> {
    if encoded.len() <= MAX_MESSAGE {
        return None;
    }
    let max_piece = max_piece.clamp(MIN_PIECE, MAX_PIECE);
    let count = encoded.len().div_ceil(max_piece) as u32;
    Some(
        encoded
            .chunks(max_piece)
            .enumerate()
            .map(|(i, data)| ChunkedReply {
                stream,
                index: i as u32,
                count,
                data: data.to_vec(),
            })
            .collect(),
    )
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ChunkError {
    #[error("piece {index} of a reply of {count} pieces is out of range")]
    BadIndex { index: u32, count: u32 },
    #[error("a piece says the reply has {got} pieces, an earlier one said {want}")]
    CountChanged { want: u32, got: u32 },
    #[error("piece {0} arrived twice")]
    Duplicate(u32),
    #[error("the reply would exceed {MAX_ASSEMBLED} bytes")]
    TooLarge,
    #[error("a reply of fewer than 2 pieces is never split")]
    TooFewPieces,
}

/// Puts one split reply back together.
#[derive(Debug, Default)]
pub struct Assembler {
    stream: Option<u64>,
    count: u32,
    pieces: Vec<Option<Vec<u8>>>,
    have: u32,
    bytes: usize,
}

impl Assembler {
    /// Takes one piece; returns the whole envelope once the last one is in.
    /// Pieces of another stream (a late reply to an earlier request) are
    /// ignored.
    pub fn push(&mut self, piece: ChunkedReply) -> Result<Option<Vec<u8>>, ChunkError> {
        match self.stream {
            Some(s) if s != piece.stream => return Ok(None),
            Some(_) => {
                if piece.count != self.count {
                    return Err(ChunkError::CountChanged {
                        want: self.count,
                        got: piece.count,
                    });
                }
            }
            None => {
                if piece.count < 2 {
                    return Err(ChunkError::TooFewPieces);
                }
                if piece.count > MAX_PIECES {
                    return Err(ChunkError::TooLarge);
                }
                self.stream = Some(piece.stream);
                self.count = piece.count;
                self.pieces = vec![None; piece.count as usize];
            }
        }
        let i = piece.index as usize;
        if i >= self.pieces.len() {
            return Err(ChunkError::BadIndex {
                index: piece.index,
                count: self.count,
            });
        }
        if self.pieces[i].is_some() {
            return Err(ChunkError::Duplicate(piece.index));
        }
        self.bytes += piece.data.len();
        if self.bytes > MAX_ASSEMBLED {
            return Err(ChunkError::TooLarge);
        }
        self.pieces[i] = Some(piece.data);
        self.have += 1;
        if self.have < self.count {
            return Ok(None);
        }
        let mut out = Vec::with_capacity(self.bytes);
        for p in self.pieces.drain(..).flatten() {
            out.extend_from_slice(&p);
        }
        Ok(Some(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_reply_that_fits_is_not_split() {
        assert!(split(&[1, 2, 3], 2, 1).is_none());
        assert!(split(&vec![0; MAX_MESSAGE], 1000, 1).is_none());
    }

    #[test]
    fn bad_pieces_are_errors_not_panics() {
        let big: Vec<u8> = (0..MAX_MESSAGE + 10).map(|i| i as u8).collect();
        let pieces = split(&big, MAX_PIECE, 7).unwrap();
        assert_eq!(pieces.len(), 2);
        let mut a = Assembler::default();
        assert_eq!(a.push(pieces[1].clone()), Ok(None));
        assert_eq!(
            a.push(pieces[1].clone()),
            Err(ChunkError::Duplicate(1)),
            "twice"
        );
        let mut other = pieces[0].clone();
        other.stream = 8;
        assert_eq!(a.push(other), Ok(None), "another stream is ignored");
        let mut bad = pieces[0].clone();
        bad.count = 3;
        assert!(matches!(a.push(bad), Err(ChunkError::CountChanged { .. })));
        assert_eq!(a.push(pieces[0].clone()), Ok(Some(big)));
        let mut a = Assembler::default();
        let mut lone = pieces[0].clone();
        lone.count = 1;
        assert_eq!(a.push(lone), Err(ChunkError::TooFewPieces));
        let mut a = Assembler::default();
        let mut far = pieces[0].clone();
        far.index = 9;
        assert!(matches!(a.push(far), Err(ChunkError::BadIndex { .. })));
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, rng_seed: proptest::test_runner::RngSeed::Fixed(3), ..ProptestConfig::default() })]
        #[test]
        fn pieces_in_any_order_reassemble(extra in 1usize..5000, piece in 4096usize..200_000, seed in any::<u64>()) {
            let big: Vec<u8> = (0..MAX_MESSAGE + extra).map(|i| (i * 31) as u8).collect();
            let mut pieces = split(&big, piece, seed).unwrap();
            // A deterministic shuffle from the seed.
            let n = pieces.len();
            for i in 0..n {
                let j = (seed as usize).wrapping_mul(i + 7) % n;
                pieces.swap(i, j);
            }
            let mut a = Assembler::default();
            let mut out = None;
            for p in pieces {
                prop_assert!(out.is_none());
                out = a.push(p).unwrap();
            }
            prop_assert_eq!(out, Some(big));
        }
    }
}
