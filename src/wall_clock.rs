//! The daemon's one wall clock: every time the API or a file needs (Event and status times, the
//! Lease's renewTime, lease-file and certificate expiry, TLS checks) is read here. Durations,
//! timeouts, cooldowns and cadences use `Instant`, never this clock.
//!
//! A test-only hook, `VK_TEST_WALL_CLOCK_OFFSET_FILE`, names a file holding signed seconds
//! that are added to the system clock (re-read every 100 ms): process tests step the daemon's
//! wall clock by an hour without stepping the shared machine's. Hosts never set it.

use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Seconds added to the system clock (the test hook; 0 on a host).
static OFFSET_SECS: AtomicI64 = AtomicI64::new(0);
static WATCHING: OnceLock<PathBuf> = OnceLock::new();
const REREAD: Duration = Duration::from_millis(100);

/// The wall clock.
pub fn now() -> SystemTime {
    let offset = OFFSET_SECS.load(Ordering::Relaxed);
    let base = SystemTime::now();
    let step = Duration::from_secs(offset.unsigned_abs());
    let shifted = if offset >= 0 {
        base.checked_add(step)
    } else {
        base.checked_sub(step)
    };
    shifted.unwrap_or(base)
}

/// Test hook: from now on the offset is the signed number of seconds in `file` (a missing or
/// unreadable file means 0), re-read on a thread of its own. Only the first call counts.
pub fn follow_offset_file(file: PathBuf) {
    if WATCHING.set(file.clone()).is_err() {
        return;
    }
    log::warn!(
        "VK_TEST_WALL_CLOCK_OFFSET_FILE={}: the wall clock follows a test's offset",
        file.display()
    );
    read_offset(&file);
    let spawned = std::thread::Builder::new()
        .name("vk-test-clock".into())
        .spawn(move || loop {
            std::thread::sleep(REREAD);
            read_offset(&file);
        });
    if let Err(e) = spawned {
        log::warn!("test clock offset: no thread: {e}");
    }
}

fn read_offset(file: &std::path::Path) {
    let secs = std::fs::read_to_string(file)
        .ok()
        .and_then(|s| s.trim().parse::<i64>().ok())
        .unwrap_or(0);
    OFFSET_SECS.store(secs, Ordering::Relaxed);
}

/// A step of the wall clock larger than this (against the monotonic clock) is reported.
const STEP_REPORTED: Duration = Duration::from_secs(5);

/// Notices the wall clock stepping (NTP, an operator, a VM resume) against the monotonic one.
#[derive(Debug, Default)]
pub struct StepWatch {
    last: Option<(Instant, SystemTime)>,
}

impl StepWatch {
    /// The step in whole seconds since the last look, when the wall clock moved more than
    /// `STEP_REPORTED` away from the monotonic clock.
    pub fn look(&mut self, mono: Instant, wall: SystemTime) -> Option<i64> {
        let (last_mono, last_wall) = self.last.replace((mono, wall))?;
        let ran = mono.saturating_duration_since(last_mono).as_secs_f64();
        let moved = match wall.duration_since(last_wall) {
            Ok(d) => d.as_secs_f64(),
            Err(e) => -e.duration().as_secs_f64(),
        };
        let step = moved - ran;
        (step.abs() > STEP_REPORTED.as_secs_f64()).then_some(step.round() as i64)
    }
}

/// rustls' clock for certificate validity: this wall clock.
#[derive(Debug)]
pub struct TlsClock;

impl rustls::time_provider::TimeProvider for TlsClock {
    fn current_time(&self) -> Option<rustls::pki_types::UnixTime> {
        let since = now().duration_since(UNIX_EPOCH).ok()?;
        Some(rustls::pki_types::UnixTime::since_unix_epoch(since))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_is_seen_once_and_steady_time_is_not() {
        let mut w = StepWatch::default();
        let (m, t) = (Instant::now(), SystemTime::now());
        assert_eq!(w.look(m, t), None);
        let s10 = Duration::from_secs(10);
        assert_eq!(w.look(m + s10, t + s10), None);
        let hour = Duration::from_secs(3600);
        assert_eq!(w.look(m + 2 * s10, t + 2 * s10 + hour), Some(3600));
        assert_eq!(w.look(m + 3 * s10, t + 3 * s10 + hour), None);
        assert_eq!(w.look(m + 4 * s10, t + 4 * s10 - hour), Some(-7200));
    }

    #[test]
    fn without_the_hook_it_is_the_system_clock() {
        let before = SystemTime::now();
        let t = now();
        let after = SystemTime::now();
        assert!(before <= t && t <= after);
    }
}
