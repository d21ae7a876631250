//! Server-sent events, as engines stream them: bytes in, whole events out.
//!
//! Invariants: no line longer than [`MAX_LINE`] is buffered (past it the
//! stream is refused); an event is handed out only once the blank line that
//! ends it has arrived, so a chunk split anywhere (inside a UTF-8 character
//! included) decodes the same.

use thiserror::Error;

/// Longest line kept (a chunk's JSON; engines send far less).
pub const MAX_LINE: usize = 4 * 1024 * 1024;

/// One event: its `event:` name (empty for the default) and its data lines
/// joined by `\n`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SseEvent {
    pub event: String,
    pub data: String,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum SseError {
    #[error("a line of the event stream exceeds {MAX_LINE} bytes")]
    LineTooLong,
    #[error("the event stream is not UTF-8")]
    NotUtf8,
}

/// Splits an event stream into events.
#[derive(Debug, Default)]
pub struct SseDecoder {
    buf: Vec<u8>,
    event: String,
    data: Vec<String>,
}

impl SseDecoder {
    /// Feeds bytes; answers the events they completed.
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<SseEvent>, SseError> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        let mut start = 0;
        while let Some(nl) = self.buf[start..].iter().position(|&b| b == b'\n') {
            let mut line = &self.buf[start..start + nl];
            start += nl + 1;
            if line.last() == Some(&b'\r') {
                line = &line[..line.len() - 1];
            }
            let line = std::str::from_utf8(line).map_err(|_| SseError::NotUtf8)?;
            if line.is_empty() {
                if !self.data.is_empty() || !self.event.is_empty() {
                    out.push(SseEvent {
                        event: std::mem::take(&mut self.event),
                        data: std::mem::take(&mut self.data).join("\n"),
                    });
                }
                continue;
            }
            if line.starts_with(':') {
                continue; // a comment (keep-alive)
            }
            let (field, value) = match line.split_once(':') {
                Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
                None => (line, ""),
            };
            match field {
                "data" => self.data.push(value.to_string()),
                "event" => self.event = value.to_string(),
                // Older llama.cpp servers stream an error as its own field.
                "error" => {
                    self.event = "error".into();
                    self.data.push(value.to_string());
                }
                _ => {} // id, retry: not used
            }
        }
        self.buf.drain(..start);
        if self.buf.len() > MAX_LINE {
            return Err(SseError::LineTooLong);
        }
        Ok(out)
    }

    /// The stream ended: an event still open (no blank line after it) is
    /// handed out as it stands.
    pub fn finish(&mut self) -> Option<SseEvent> {
        if !self.buf.is_empty() {
            let rest = std::mem::take(&mut self.buf);
            if let Ok(mut evs) = self.push(&[rest.as_slice(), b"\n"].concat()) {
                if let Some(e) = evs.pop() {
                    return Some(e);
                }
            }
        }
        if self.data.is_empty() {
            return None;
        }
        Some(SseEvent {
            event: std::mem::take(&mut self.event),
            data: std::mem::take(&mut self.data).join("\n"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const STREAM: &str = "data: {\"a\":1}\n\n: keep-alive\n\nevent: error\ndata: {\"b\":\"é\"}\r\n\r\ndata: x\ndata: y\n\nerror: {\"c\":2}\n\ndata: [DONE]\n\n";

    fn all(chunks: &[&[u8]]) -> Vec<SseEvent> {
        let mut d = SseDecoder::default();
        let mut out = Vec::new();
        for c in chunks {
            out.extend(d.push(c).unwrap());
        }
        out.extend(d.finish());
        out
    }

    #[test]
    fn events_and_their_names() {
        let evs = all(&[STREAM.as_bytes()]);
        let data: Vec<&str> = evs.iter().map(|e| e.data.as_str()).collect();
        assert_eq!(
            data,
            ["{\"a\":1}", "{\"b\":\"é\"}", "x\ny", "{\"c\":2}", "[DONE]"]
        );
        assert_eq!(evs[1].event, "error");
        assert_eq!(evs[3].event, "error");
        assert_eq!(evs[0].event, "");
    }

    #[test]
    fn an_unterminated_last_event_still_counts() {
        assert_eq!(all(&[b"data: {\"a\":1}"])[0].data, "{\"a\":1}");
        assert_eq!(all(&[b"data: z\n"])[0].data, "z");
        assert!(all(&[b""]).is_empty());
    }

    #[test]
    fn refuses_an_endless_line() {
        let mut d = SseDecoder::default();
        let big = vec![b'a'; MAX_LINE + 1];
        assert_eq!(d.push(&big), Err(SseError::LineTooLong));
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, rng_seed: proptest::test_runner::RngSeed::Fixed(17), ..ProptestConfig::default() })]
        /// However the bytes are split, the same events come out.
        #[test]
        fn any_split_decodes_the_same(cuts in proptest::collection::vec(0..STREAM.len(), 0..6)) {
            let bytes = STREAM.as_bytes();
            let mut cuts = cuts;
            cuts.sort();
            let mut chunks = Vec::new();
            let mut at = 0;
            for c in cuts {
                chunks.push(&bytes[at..c]);
                at = c;
            }
            chunks.push(&bytes[at..]);
            prop_assert_eq!(all(&chunks), all(&[bytes]));
        }
    }
}
