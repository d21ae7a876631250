//! Times shown to people: RFC 3339 in UTC with milliseconds (the form the
//! logs use too), from the unix milliseconds the wire carries.

use chrono::{DateTime, SecondsFormat, Utc};

/// `2026-12-03T18:00:00.123Z`; an out-of-range value prints as the raw
/// number of milliseconds.
pub fn rfc3339(unix_ms: u64) -> String {
    i64::try_from(unix_ms)
        .ok()
        .and_then(DateTime::<Utc>::from_timestamp_millis)
        .map(|t| t.to_rfc3339_opts(SecondsFormat::Millis, true))
        .unwrap_or_else(|| format!("{unix_ms} ms"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unix_milliseconds_print_as_rfc3339_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_796_316_267_946), "2026-12-03T16:44:27.946Z");
        assert_eq!(rfc3339(u64::MAX), format!("{} ms", u64::MAX));
    }
}
