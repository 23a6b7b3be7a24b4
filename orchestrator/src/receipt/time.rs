//! RFC 3339 UTC timestamps, the one format for every time the daemon writes (receipts,
//! the audit log, the event log). Formatting is `humantime`'s.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The last instant a four-digit RFC 3339 year can show (9999-12-31T23:59:59.999Z).
const LAST_SHOWABLE: Duration = Duration::from_millis(253_402_300_799_999);

/// The current time as RFC 3339 UTC with millisecond precision.
pub fn now_rfc3339() -> String {
    rfc3339(SystemTime::now())
}

/// `t` as RFC 3339 UTC with millisecond precision, e.g. `2026-11-30T14:34:52.123Z`. A clock
/// set outside 1970..=9999 shows the nearest end of that range.
pub fn rfc3339(t: SystemTime) -> String {
    let t = t.clamp(UNIX_EPOCH, UNIX_EPOCH + LAST_SHOWABLE);
    humantime::format_rfc3339_millis(t).to_string()
}

/// Milliseconds since the epoch (as stored in the event table) as RFC 3339 UTC.
pub fn rfc3339_from_millis(ms: i64) -> String {
    rfc3339(UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_known_instants() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let t = UNIX_EPOCH + Duration::from_millis(1_796_049_292_123);
        assert_eq!(rfc3339(t), "2026-11-30T14:34:52.123Z");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(rfc3339(leap), "2000-02-29T00:00:00.000Z");
        assert_eq!(
            rfc3339_from_millis(1_796_051_003_092),
            "2026-11-30T15:03:23.092Z"
        );
    }

    #[test]
    fn clocks_outside_the_showable_range_are_clamped_not_panics() {
        let before = UNIX_EPOCH - Duration::from_secs(1);
        assert_eq!(rfc3339(before), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339_from_millis(-5), "1970-01-01T00:00:00.000Z");
        let after = UNIX_EPOCH + Duration::from_secs(300_000_000_000);
        assert_eq!(rfc3339(after), "9999-12-31T23:59:59.999Z");
    }
}
