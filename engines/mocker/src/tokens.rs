//! Deterministic output tokens.
//!
//! The next token is a pure function of the last [`WINDOW`] tokens of the
//! context (prompt + everything generated so far) and the request's seed.
//! So the output is a function of prompt and position, tests can predict it
//! with [`predict`], and a request resent with its generated tokens appended
//! (migration) continues with exactly the tokens it would have produced.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Context tokens that determine the next one.
pub const WINDOW: usize = 8;

/// The token that follows `context`, in `[lo, hi)`.
pub fn next_token(context: &[u32], seed: u64, lo: u32, hi: u32) -> u32 {
    let start = context.len().saturating_sub(WINDOW);
    let mut buf = [0u8; WINDOW * 4 + 8];
    let mut n = 0;
    for t in &context[start..] {
        buf[n..n + 4].copy_from_slice(&t.to_le_bytes());
        n += 4;
    }
    buf[n..n + 8].copy_from_slice(&(context.len() as u64).to_le_bytes());
    n += 8;
    let h = xxh3_64_with_seed(&buf[..n], seed);
    lo + (h % (hi - lo) as u64) as u32
}

/// The first `n` tokens the mocker generates for `prompt`.
pub fn predict(prompt: &[u32], n: usize, seed: u64, lo: u32, hi: u32) -> Vec<u32> {
    let mut ctx = prompt.to_vec();
    for _ in 0..n {
        let t = next_token(&ctx, seed, lo, hi);
        ctx.push(t);
    }
    ctx.split_off(prompt.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn continuation_from_a_resent_prefix_is_identical() {
        let prompt: Vec<u32> = (300..340).collect();
        let all = predict(&prompt, 20, 7, 256, 49152);
        let mut resent = prompt.clone();
        resent.extend_from_slice(&all[..9]);
        assert_eq!(predict(&resent, 11, 7, 256, 49152), all[9..].to_vec());
        assert!(all.iter().all(|&t| (256..49152).contains(&t)));
        assert_ne!(predict(&prompt, 5, 8, 256, 49152), all[..5].to_vec());
    }
}
