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

use tokenizers::decoders::DecoderWrapper;

pub(crate) struct FastDecoder {
    /// The bytes of every id, one after another (with the offsets and
    /// flags, about 0.55 MB for a 49k vocabulary).
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
        if !matches!(t.get_decoder(), Some(DecoderWrapper::ByteLevel(_))) {
            return None;
        }
        let char_bytes: std::collections::HashMap<char, u8> = crate::fast_encode::bytes_char()
            .into_iter()
            .enumerate()
            .map(|(b, c)| (c, b as u8))
            .collect();
        // One past the highest id: a vocabulary may have holes (a GGUF that
        // repeats a token string keeps its last id), so not its size.
        let n = t
            .get_vocab(true)
            .into_values()
            .chain(t.get_added_tokens_decoder().into_keys())
            .max()
            .map_or(0, |m| m as usize + 1);
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
                // The crate's own rule: by content, as ever added special.
                special.push(t.get_added_vocabulary().is_special_token(&token));
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
    use crate::test_support::smollm2_tokenizer;
    use proptest::prelude::*;
    use std::sync::LazyLock;

    static SMOLLM2: LazyLock<(tokenizers::Tokenizer, FastDecoder)> = LazyLock::new(|| {
        let t = smollm2_tokenizer();
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

    /// A vocabulary with a hole and its highest id past its size, and a
    /// content added special then again not special: as the crate.
    #[test]
    fn holes_and_twice_added_tokens_decode_as_the_crate_does() {
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [
                {"id": 5, "content": "<s>", "single_word": false, "lstrip": false,
                 "rstrip": false, "normalized": false, "special": true},
                {"id": 5, "content": "<s>", "single_word": false, "lstrip": false,
                 "rstrip": false, "normalized": false, "special": false},
            ],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                        "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                      "continuing_subword_prefix": null, "end_of_word_suffix": null,
                      "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": {"a": 0, "Ġb": 2, "c": 7, "<s>": 5}, "merges": []},
        });
        let t = tokenizers::Tokenizer::from_bytes(json.to_string().as_bytes()).expect("parses");
        let fast = FastDecoder::for_tokenizer(&t).expect("fast path");
        let ids = [0, 1, 2, 3, 4, 5, 6, 7, 8, 7, 0];
        for skip in [true, false] {
            assert_eq!(
                fast.decode(&ids, skip),
                t.decode(&ids, skip).unwrap(),
                "skip {skip}"
            );
        }
        assert_eq!(
            fast.decode(&[7], true),
            "c",
            "the id past the vocabulary's size"
        );
        assert_eq!(fast.decode(&[5], true), "", "special once, special always");
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
