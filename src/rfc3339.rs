//! RFC 3339 text of wall-clock times: the one formatter (seconds, milliseconds, Go's trimmed
//! nanoseconds; always UTC `Z`) and the one parser (any offset), over chrono's calendar.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use k8s_openapi::chrono::{DateTime, Utc};

/// Times before the epoch (a clock set wrong) print as the epoch, as the API's clients expect
/// nothing earlier.
fn utc(t: SystemTime) -> DateTime<Utc> {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    i64::try_from(d.as_secs())
        .ok()
        .and_then(|secs| DateTime::from_timestamp(secs, d.subsec_nanos()))
        .unwrap_or_default()
}

/// `2026-08-11T07:12:33Z`: `metav1.Time` on the wire, manifests' `created`.
pub fn seconds(t: SystemTime) -> String {
    utc(t).format("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// `2026-08-11T07:12:33.481Z`: log lines.
pub fn millis(t: SystemTime) -> String {
    utc(t).format("%Y-%m-%dT%H:%M:%S%.3fZ").to_string()
}

/// `2026-08-11T07:12:33.481516Z`: `metav1.MicroTime`, six digits always.
pub fn micros(t: SystemTime) -> String {
    utc(t).format("%Y-%m-%dT%H:%M:%S%.6fZ").to_string()
}

/// `2026-08-11T07:12:33.481516923Z`: nine digits always (cocoon's JSON times).
pub fn nanos_fixed(t: SystemTime) -> String {
    utc(t).format("%Y-%m-%dT%H:%M:%S%.9fZ").to_string()
}

/// Go's RFC3339Nano: nanoseconds with trailing zeros trimmed, none when zero
/// (`2026-08-11T07:12:33.12Z`): kubelet log timestamps, snapshot times.
pub fn nanos(t: SystemTime) -> String {
    let at = utc(t);
    let whole = at.format("%Y-%m-%dT%H:%M:%S").to_string();
    match at.timestamp_subsec_nanos() {
        0 => format!("{whole}Z"),
        n => format!("{whole}.{}Z", format!("{n:09}").trim_end_matches('0')),
    }
}

/// `2026-08-01T12:00:00+08:00`, `…Z`, an optional fraction; `T`, `t` or a space between date
/// and time. None for anything else, a calendar date that does not exist included.
pub fn parse(text: &str) -> Option<SystemTime> {
    let at = DateTime::parse_from_rfc3339(text.trim()).ok()?;
    // A leap second (`:60`) reads as the following second, as most parsers do.
    let (secs, nanos) = (at.timestamp(), at.timestamp_subsec_nanos());
    let since_epoch = Duration::from_secs(secs.unsigned_abs()) + Duration::from_nanos(nanos.into());
    if secs >= 0 {
        UNIX_EPOCH.checked_add(since_epoch)
    } else {
        UNIX_EPOCH
            .checked_sub(Duration::from_secs(secs.unsigned_abs()))?
            .checked_add(Duration::from_nanos(nanos.into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64, nanos: u32) -> SystemTime {
        UNIX_EPOCH + Duration::new(secs, nanos)
    }

    #[test]
    fn formats() {
        assert_eq!(seconds(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        assert_eq!(seconds(at(1_785_556_800, 7)), "2026-08-01T04:00:00Z");
        assert_eq!(
            millis(at(1_709_164_800, 481_516_923)),
            "2024-02-29T00:00:00.481Z"
        );
        assert_eq!(nanos(at(1, 120_000_000)), "1970-01-01T00:00:01.12Z");
        assert_eq!(nanos(at(1, 0)), "1970-01-01T00:00:01Z");
        assert_eq!(nanos(at(1, 1)), "1970-01-01T00:00:01.000000001Z");
        assert_eq!(micros(at(1, 120_000_999)), "1970-01-01T00:00:01.120000Z");
        assert_eq!(
            nanos_fixed(at(1, 120_000_000)),
            "1970-01-01T00:00:01.120000000Z"
        );
        assert_eq!(
            seconds(UNIX_EPOCH - Duration::from_secs(5)),
            "1970-01-01T00:00:00Z"
        );
    }

    #[test]
    fn parses_what_it_prints() {
        for t in [
            UNIX_EPOCH,
            at(1_785_556_800, 250_000_000),
            at(4_102_444_800, 1),
        ] {
            assert_eq!(parse(&nanos(t)), Some(t));
        }
    }

    #[test]
    fn log_line_timestamps() {
        assert_eq!(millis(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let t = UNIX_EPOCH + Duration::from_millis(1_709_210_096_789); // leap day 2024
        assert_eq!(millis(t), "2024-02-29T12:34:56.789Z");
        let t = UNIX_EPOCH + Duration::from_secs(4_102_444_799); // last second of 2099
        assert_eq!(millis(t), "2099-12-31T23:59:59.000Z");
    }
}
