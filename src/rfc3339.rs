//! RFC 3339 text of wall-clock times: the one formatter (seconds, milliseconds, Go's trimmed
//! nanoseconds; always UTC `Z`) and the one parser (any offset), over jiff's calendar.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

// k8s-openapi's own jiff (its `Time` and `MicroTime` wrap `jiff::Timestamp`), so the daemon
// carries one calendar and no direct dependency that could drift from the API types' version.
use k8s_openapi::jiff::Timestamp;

/// The instant as the API types hold it. Times before the epoch (a clock set wrong) and past
/// jiff's range (year 9999) read as the epoch, as the API's clients expect nothing earlier.
pub fn timestamp(t: SystemTime) -> Timestamp {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    i64::try_from(d.as_secs())
        .ok()
        .zip(i32::try_from(d.subsec_nanos()).ok())
        .and_then(|(secs, nanos)| Timestamp::new(secs, nanos).ok())
        .unwrap_or(Timestamp::UNIX_EPOCH)
}

/// The instant an API time names; None only where `SystemTime` cannot hold it.
pub fn system_time(at: Timestamp) -> Option<SystemTime> {
    let nanos = at.as_nanosecond();
    let secs = u64::try_from(nanos.div_euclid(1_000_000_000).unsigned_abs()).ok()?;
    let subsec = u64::try_from(nanos.rem_euclid(1_000_000_000)).ok()?;
    let whole = if nanos >= 0 {
        UNIX_EPOCH.checked_add(Duration::from_secs(secs))
    } else {
        UNIX_EPOCH.checked_sub(Duration::from_secs(secs))
    };
    whole?.checked_add(Duration::from_nanos(subsec))
}

/// The formats here are all valid for an instant, so jiff's error (which `to_string` on its
/// `Display` would turn into a panic) cannot happen; an empty string if it ever did.
fn strftime(format: &str, t: SystemTime) -> String {
    k8s_openapi::jiff::fmt::strtime::format(format, timestamp(t)).unwrap_or_default()
}

/// `2026-08-11T07:12:33Z`: `metav1.Time` on the wire, manifests' `created`.
pub fn seconds(t: SystemTime) -> String {
    strftime("%Y-%m-%dT%H:%M:%SZ", t)
}

/// `2026-08-11T07:12:33.481Z`: log lines.
pub fn millis(t: SystemTime) -> String {
    strftime("%Y-%m-%dT%H:%M:%S%.3fZ", t)
}

/// `2026-08-11T07:12:33.481516Z`: `metav1.MicroTime`, six digits always.
pub fn micros(t: SystemTime) -> String {
    strftime("%Y-%m-%dT%H:%M:%S%.6fZ", t)
}

/// `2026-08-11T07:12:33.481516923Z`: nine digits always (cocoon's JSON times).
pub fn nanos_fixed(t: SystemTime) -> String {
    strftime("%Y-%m-%dT%H:%M:%S%.9fZ", t)
}

/// Go's RFC3339Nano: nanoseconds with trailing zeros trimmed, none when zero
/// (`2026-08-11T07:12:33.12Z`): kubelet log timestamps, snapshot times.
pub fn nanos(t: SystemTime) -> String {
    let at = timestamp(t);
    let whole = strftime("%Y-%m-%dT%H:%M:%S", t);
    match at.subsec_nanosecond() {
        0 => format!("{whole}Z"),
        n => format!("{whole}.{}Z", format!("{n:09}").trim_end_matches('0')),
    }
}

/// `2026-08-01T12:00:00+08:00`, `…Z`, an optional fraction; `T`, `t` or a space between date
/// and time. None for anything else, a calendar date that does not exist included.
pub fn parse(text: &str) -> Option<SystemTime> {
    let (canonical, leap) = canonical(text.trim())?;
    let at = system_time(canonical.parse::<Timestamp>().ok()?)?;
    // A leap second (`:60`) reads as the following second, as most parsers do.
    if leap {
        at.checked_add(Duration::from_secs(1))
    } else {
        Some(at)
    }
}

/// The RFC 3339 grammar checked here, byte by byte, and rewritten as the one spelling jiff's
/// parser takes (`T`, `Z`, at most nine fraction digits, `:59` for a leap second); jiff's own
/// grammar is wider (ISO 8601 basic form, time-zone annotations, minutes without seconds).
/// The second value says the text named a leap second.
fn canonical(text: &str) -> Option<(String, bool)> {
    let b = text.as_bytes();
    let digits = |r: std::ops::Range<usize>| {
        b.get(r)
            .is_some_and(|d| !d.is_empty() && d.iter().all(u8::is_ascii_digit))
    };
    let at = |i: usize, c: &[u8]| b.get(i).is_some_and(|x| c.contains(x));
    let shape = digits(0..4)
        && at(4, b"-")
        && digits(5..7)
        && at(7, b"-")
        && digits(8..10)
        && at(10, b"Tt ")
        && digits(11..13)
        && at(13, b":")
        && digits(14..16)
        && at(16, b":")
        && digits(17..19);
    if !shape {
        return None;
    }
    // Bytes 0..19 are ASCII, so these are char boundaries.
    let leap = &text[17..19] == "60";
    let mut out = format!(
        "{}T{}:{}",
        &text[..10],
        &text[11..16],
        if leap { "59" } else { &text[17..19] }
    );
    let mut rest = &text[19..];
    if let Some(frac) = rest.strip_prefix('.') {
        let n = frac.bytes().take_while(u8::is_ascii_digit).count();
        if n == 0 {
            return None;
        }
        out.push('.');
        out.push_str(&frac[..n.min(9)]);
        rest = &frac[n..];
    }
    let offset = rest.as_bytes();
    match offset {
        b"Z" | b"z" => out.push('Z'),
        [sign, h1, h2, b':', m1, m2]
            if matches!(sign, b'+' | b'-')
                && [h1, h2, m1, m2].iter().all(|d| d.is_ascii_digit()) =>
        {
            out.push_str(rest)
        }
        _ => return None,
    }
    Some((out, leap))
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
    fn parses_rfc3339_spellings_and_nothing_wider() {
        let t = at(1_785_556_800, 0); // 2026-08-01T04:00:00Z
        assert_eq!(parse("2026-08-01t04:00:00z"), Some(t));
        assert_eq!(parse("2026-08-01 04:00:00Z"), Some(t));
        assert_eq!(parse(" 2026-08-01T04:00:00-00:00\n"), Some(t));
        // Past nine digits the fraction is cut, not rounded.
        assert_eq!(
            parse("2026-08-01T04:00:00.1234567899Z"),
            Some(at(1_785_556_800, 123_456_789))
        );
        // A leap second is the next second.
        assert_eq!(parse("2016-12-31T23:59:60Z"), Some(at(1_483_228_800, 0)));
        assert_eq!(
            parse("2016-12-31T23:59:60.5Z"),
            Some(at(1_483_228_800, 500_000_000))
        );
        assert_eq!(
            parse("1969-12-31T23:59:59.5Z"),
            UNIX_EPOCH.checked_sub(Duration::from_millis(500))
        );
        // ISO 8601 forms that jiff alone would take.
        for wider in [
            "20260801T040000Z",
            "2026-08-01T04:00Z",
            "2026-08-01T04:00:00Z[UTC]",
            "2026-08-01T04:00:00,5Z",
            "2026-08-01T04:00:00+0800",
            "2026-08-01T04:00:00+08",
            "+002026-08-01T04:00:00Z",
        ] {
            assert_eq!(parse(wider), None, "{wider:?} is not RFC 3339");
        }
    }

    #[test]
    fn api_instants_round_trip() {
        for t in [UNIX_EPOCH, at(1_785_556_800, 123_456_789)] {
            assert_eq!(system_time(timestamp(t)), Some(t));
        }
        assert_eq!(
            timestamp(UNIX_EPOCH - Duration::from_secs(1)),
            Timestamp::UNIX_EPOCH
        );
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
