//! A faster `encode` for the byte-level BPE tokenizers this crate builds
//! (GPT-2's pre-tokenizer, with or without SmolLM's individual digits).
//!
//! The `tokenizers` crate pre-tokenizes with GPT-2's pattern through
//! `fancy_regex` (its `\s+(?!\S)` needs a look-ahead, so the backtracking
//! VM runs), and tracks an alignment per byte of every piece. That was two
//! thirds of the instructions of a chat request in the gateway
//! (BENCHMARKS.md, "Security overhead", counted in instructions). Here:
//! - added tokens are cut out with the same leftmost-longest Aho-Corasick
//!   match the crate uses;
//! - SmolLM's digits are split off one by one (`char::is_numeric`, as the
//!   crate's `Digits` does);
//! - each piece is split with the pattern minus the look-ahead on the
//!   `regex` crate's DFA, and the look-ahead is applied by hand: a run of
//!   two or more whitespace characters followed by a non-space gives up
//!   its last character to what follows, which is exactly what
//!   `\s+(?!\S)` does by backtracking;
//! - each word's bytes are mapped to GPT-2's byte characters and given to
//!   the tokenizer's own BPE model (and its cache).
//!
//! Invariant: for every text, [`FastEncoder::encode`] returns the ids the
//! `tokenizers` crate's `encode_fast(text, false)` returns, with one
//! exception: a single pre-token of a million characters or more (a run of
//! a million letters, spaces or punctuation). There `fancy_regex` runs out
//! of its backtracking stack, and the crate swallows the error and leaves
//! the rest of that piece as one word. This path goes on splitting as the
//! pattern says, as llama.cpp's tokenizer does. It is used only for a
//! tokenizer whose configuration it recognises
//! ([`FastEncoder::for_tokenizer`]); any other falls back to the crate.
//! Checked by seeded property tests and fixed texts against the real
//! SmolLM2 tokenizer and against it with GPT-2's plain pre-tokenizer
//! (tests below).

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use serde_json::{json, Value};
use tokenizers::models::ModelWrapper;
use tokenizers::Model;

/// GPT-2's pre-tokenizer pattern without its look-ahead alternative
/// (`\s+(?!\S)`), which [`FastEncoder`] applies by hand.
const SPLIT: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+";

pub(crate) struct FastEncoder {
    /// Added tokens (special or not): the matcher and each pattern's id.
    added: Option<(AhoCorasick, Vec<u32>)>,
    /// SmolLM: every numeric character is a piece of its own.
    digits: bool,
    split: regex::Regex,
    /// GPT-2's byte → character map.
    bytes_char: [char; 256],
}

impl FastEncoder {
    /// The fast path for `t`, if `t` is configured as this crate builds
    /// tokenizers: byte-level BPE, no normalizer, GPT-2's pre-tokenizer with
    /// no prefix space (optionally after individual digits), added tokens
    /// matched verbatim. `None` otherwise.
    pub(crate) fn for_tokenizer(t: &tokenizers::Tokenizer) -> Option<Self> {
        if t.get_normalizer().is_some()
            || t.get_truncation().is_some()
            || t.get_padding().is_some()
            || t.get_encode_special_tokens()
            || !matches!(t.get_model(), ModelWrapper::BPE(_))
        {
            return None;
        }
        let pre = serde_json::to_value(t.get_pre_tokenizer()?).ok()?;
        let byte_level = |v: &Value| {
            v.get("type") == Some(&json!("ByteLevel"))
                && v.get("add_prefix_space") == Some(&json!(false))
                && v.get("use_regex") == Some(&json!(true))
        };
        let digits = if byte_level(&pre) {
            false
        } else {
            let seq = pre.get("pretokenizers")?.as_array()?;
            let is_digits = seq.len() == 2
                && pre.get("type") == Some(&json!("Sequence"))
                && seq[0] == json!({"type": "Digits", "individual_digits": true})
                && byte_level(&seq[1]);
            if !is_digits {
                return None;
            }
            true
        };
        let mut added: Vec<(u32, String)> = Vec::new();
        for (id, tok) in t.get_added_tokens_decoder() {
            if tok.normalized
                || tok.single_word
                || tok.lstrip
                || tok.rstrip
                || t.token_to_id(&tok.content) != Some(id)
            {
                return None;
            }
            added.push((id, tok.content));
        }
        added.sort();
        let added = if added.is_empty() {
            None
        } else {
            let matcher = AhoCorasickBuilder::new()
                .match_kind(MatchKind::LeftmostLongest)
                .build(added.iter().map(|(_, c)| c.as_str()))
                .ok()?;
            Some((matcher, added.into_iter().map(|(id, _)| id).collect()))
        };
        Some(FastEncoder {
            added,
            digits,
            split: regex::Regex::new(SPLIT).ok()?,
            bytes_char: bytes_char(),
        })
    }

    /// The ids of `text`, as the tokenizer's own `encode_fast(text, false)`.
    pub(crate) fn encode(&self, model: &ModelWrapper, text: &str) -> Result<Vec<u32>, String> {
        let mut out = Out {
            ids: Vec::with_capacity(text.len() / 3 + 1),
            word: String::new(),
        };
        let mut start = 0;
        if let Some((matcher, ids)) = &self.added {
            for m in matcher.find_iter(text) {
                self.plain(model, &text[start..m.start()], &mut out)?;
                out.ids.push(ids[m.pattern().as_usize()]);
                start = m.end();
            }
        }
        self.plain(model, &text[start..], &mut out)?;
        Ok(out.ids)
    }

    /// Text without added tokens: digits split off, then the pieces.
    fn plain(&self, model: &ModelWrapper, text: &str, out: &mut Out) -> Result<(), String> {
        if !self.digits {
            return self.piece(model, text, out);
        }
        let mut run = 0;
        for (i, c) in text.char_indices() {
            if c.is_numeric() {
                let end = i + c.len_utf8();
                self.piece(model, &text[run..i], out)?;
                self.piece(model, &text[i..end], out)?;
                run = end;
            }
        }
        self.piece(model, &text[run..], out)
    }

    /// One pre-tokenizer piece, split into words by GPT-2's pattern.
    fn piece(&self, model: &ModelWrapper, piece: &str, out: &mut Out) -> Result<(), String> {
        let mut pos = 0;
        while pos < piece.len() {
            let Some(m) = self.split.find_at(piece, pos) else {
                // Unreachable (every character matches an alternative);
                // the crate's split keeps unmatched text as a word too.
                return self.word(model, &piece[pos..], out);
            };
            if m.start() > pos {
                self.word(model, &piece[pos..m.start()], out)?;
            }
            let mut end = m.end();
            // `\s+(?!\S)`: a whitespace run of two or more characters that a
            // non-space follows leaves its last character to the next word.
            // Only the `\s+` alternative ends in whitespace.
            if end < piece.len() {
                let mut chars = piece[m.start()..end].chars();
                if let (Some(last), Some(_)) = (chars.next_back(), chars.next_back()) {
                    if last.is_whitespace() {
                        end -= last.len_utf8();
                    }
                }
            }
            self.word(model, &piece[m.start()..end], out)?;
            pos = end;
        }
        Ok(())
    }

    /// One word: its bytes as GPT-2's byte characters, through BPE.
    fn word(&self, model: &ModelWrapper, word: &str, out: &mut Out) -> Result<(), String> {
        if word.is_empty() {
            return Ok(());
        }
        out.word.clear();
        out.word
            .extend(word.bytes().map(|b| self.bytes_char[b as usize]));
        let tokens = model.tokenize(&out.word).map_err(|e| e.to_string())?;
        out.ids.extend(tokens.iter().map(|t| t.id));
        Ok(())
    }
}

/// What an encode builds: the ids, and a reused buffer for each word.
struct Out {
    ids: Vec<u32>,
    word: String,
}

/// GPT-2's `bytes_to_unicode`: printable bytes stand for themselves, the
/// rest for the characters from U+0100 on, in byte order.
pub(crate) fn bytes_char() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        map[b as usize] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(next).expect("U+0100..U+0143 are characters");
            next += 1;
            c
        };
    }
    map
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::smollm2_tokenizer;
    use proptest::prelude::*;
    use std::sync::LazyLock;

    /// The real SmolLM2 tokenizer (installed by `make deps`), and its fast
    /// path.
    static SMOLLM2: LazyLock<(tokenizers::Tokenizer, FastEncoder)> = LazyLock::new(|| {
        let t = smollm2_tokenizer();
        let fast = FastEncoder::for_tokenizer(&t).expect("SmolLM2's tokenizer takes the fast path");
        assert!(fast.digits, "SmolLM2 splits digits");
        (t, fast)
    });

    /// The same tokenizer with GPT-2's plain pre-tokenizer (llama.cpp's
    /// `gpt2`, `default` and `llama-bpe`): no digit split.
    static PLAIN: LazyLock<(tokenizers::Tokenizer, FastEncoder)> = LazyLock::new(|| {
        let mut t = SMOLLM2.0.clone();
        t.with_pre_tokenizer(Some(
            tokenizers::pre_tokenizers::byte_level::ByteLevel::new(false, true, true),
        ));
        let fast =
            FastEncoder::for_tokenizer(&t).expect("GPT-2's pre-tokenizer takes the fast path");
        assert!(!fast.digits);
        (t, fast)
    });

    fn both_with(which: &(tokenizers::Tokenizer, FastEncoder), text: &str) -> (Vec<u32>, Vec<u32>) {
        let (t, fast) = which;
        let slow = t
            .encode_fast(text, false)
            .expect("encodes")
            .get_ids()
            .to_vec();
        (fast.encode(t.get_model(), text).expect("encodes"), slow)
    }

    fn both(text: &str) -> (Vec<u32>, Vec<u32>) {
        both_with(&SMOLLM2, text)
    }

    #[test]
    fn the_byte_map_is_gpt2s() {
        let m = bytes_char();
        assert_eq!(
            (m[b'!' as usize], m[b' ' as usize], m[b'\n' as usize]),
            ('!', 'Ġ', 'Ċ')
        );
        assert_eq!((m[0], m[0xAD], m[0xFF]), ('Ā', 'Ń', 'ÿ'));
        let mut all: Vec<char> = m.to_vec();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 256, "one character per byte");
        let alphabet = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet();
        assert!(m.iter().all(|c| alphabet.contains(c)));
    }

    #[test]
    fn fixed_texts_encode_as_the_tokenizers_crate_does() {
        let texts = [
            "",
            " ",
            "Hello world! 12345 café — ünïcödé 日本語",
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
            "a  b   c\n\n\nd \n e\t\tf  ",
            "  leading and trailing  ",
            "\n\nHello\n \nWorld\r\n\r\nx",
            "it's they're we've I'm you'll he'd IT'S 'S ''s",
            "x = 1,234.56e-7; y=\u{0663}\u{0664} ½ Ⅻ 3rd",
            "tabs\tand\u{00a0}nbsp\u{2003}em\u{3000}ideographic\u{2028}sep",
            "emoji 🎉🎉 👩‍👩‍👧 flags 🇫🇷 and e\u{0301} combining",
            "<|im_start|><|im_end|><|im_start|>",
            "text<|im_start|>text<|im_end|>",
            "<|im_start <|im_end|>|> <|endoftext|>",
            "code: fn main() { println!(\"{}\", 42); } // done",
            "   \n",
            "\u{200b}zero width\u{feff}bom",
        ];
        let long = [
            // Long runs, well under fancy_regex's stack (see the module doc).
            format!("{}x", " ".repeat(5_000)),
            format!("{}\nend", "\n".repeat(3_001)),
            format!("a {} b", "z".repeat(20_000)),
            format!("{}!", "1".repeat(2_000)),
            "?!.".repeat(3_000),
            // This file, a long mixed text.
            include_str!("fast_encode.rs").to_string(),
        ];
        for which in [&*SMOLLM2, &*PLAIN] {
            for text in texts.iter().copied().chain(long.iter().map(String::as_str)) {
                let (fast, slow) = both_with(which, text);
                assert_eq!(fast, slow, "{:?}", &text[..text.len().min(80)]);
            }
        }
    }

    /// Characters where the pattern's alternatives meet: spaces of several
    /// kinds, letters, numbers of each category, marks, punctuation,
    /// apostrophes, special-token fragments.
    fn interesting() -> impl Strategy<Value = String> {
        let pieces = prop::sample::select(vec![
            " ",
            " ",
            "  ",
            "\n",
            "\t",
            "\r\n",
            "\u{a0}",
            "\u{2003}",
            "\u{3000}",
            "a",
            "Z",
            "é",
            "ß",
            "日",
            "語",
            "Ω",
            "1",
            "7",
            "0",
            "\u{0663}",
            "½",
            "Ⅻ",
            "²",
            "'",
            "'s",
            "'t",
            "'re",
            "'ll",
            "'d",
            "'m",
            "'ve",
            "'S",
            ".",
            ",",
            "!",
            "?",
            "-",
            "—",
            "(",
            ")",
            "{",
            "_",
            "\u{0301}",
            "🎉",
            "\u{200d}",
            "<|im_start|>",
            "<|im_end|>",
            "<|",
            "|>",
            "im_end",
            "hello",
            "The",
            " the",
            "123",
            "\u{feff}",
            "\u{85}",
            "\u{b}",
            "\u{c}",
            "\u{2028}",
            "\u{200b}",
        ]);
        prop::collection::vec(pieces, 0..40).prop_map(|v| v.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 2048,
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x70_6b_e2),
            ..ProptestConfig::default()
        })]

        #[test]
        fn any_text_encodes_as_the_tokenizers_crate_does(text in interesting()) {
            let (fast, slow) = both(&text);
            prop_assert_eq!(fast, slow, "{:?}", text);
            let (fast, slow) = both_with(&PLAIN, &text);
            prop_assert_eq!(fast, slow, "plain: {:?}", text);
        }

        /// Any characters at all, controls and format characters included.
        #[test]
        fn any_unicode_encodes_as_the_tokenizers_crate_does(
            chars in prop::collection::vec(any::<char>(), 0..48)
        ) {
            let text: String = chars.into_iter().collect();
            let (fast, slow) = both(&text);
            prop_assert_eq!(fast, slow, "{:?}", text);
            let (fast, slow) = both_with(&PLAIN, &text);
            prop_assert_eq!(fast, slow, "plain: {:?}", text);
        }
    }

    #[test]
    fn other_configurations_fall_back() {
        let (t, _) = &*SMOLLM2;
        let mut other = t.clone();
        other.with_pre_tokenizer(Some(
            tokenizers::pre_tokenizers::byte_level::ByteLevel::new(true, true, true),
        ));
        assert!(
            FastEncoder::for_tokenizer(&other).is_none(),
            "a prefix space"
        );
        let mut other = t.clone();
        other.with_normalizer(Some(tokenizers::normalizers::Lowercase));
        assert!(FastEncoder::for_tokenizer(&other).is_none(), "a normalizer");
        let mut other = t.clone();
        other.set_encode_special_tokens(true);
        assert!(
            FastEncoder::for_tokenizer(&other).is_none(),
            "special tokens as text"
        );
        let mut other = t.clone();
        other.with_pre_tokenizer(Some(tokenizers::pre_tokenizers::sequence::Sequence::new(
            vec![
                tokenizers::pre_tokenizers::digits::Digits::new(false).into(),
                tokenizers::pre_tokenizers::byte_level::ByteLevel::new(false, true, true).into(),
            ],
        )));
        assert!(
            FastEncoder::for_tokenizer(&other).is_none(),
            "contiguous digits"
        );
        let mut other = t.clone();
        other
            .with_truncation(Some(tokenizers::TruncationParams {
                max_length: 8,
                ..Default::default()
            }))
            .expect("truncation");
        assert!(FastEncoder::for_tokenizer(&other).is_none(), "truncation");
    }
}
