//! Exponential backoff: the one doubling-with-a-cap schedule the daemon's retries use.
//! Pure arithmetic on durations; it reads no clock, so callers add the delay to their `now`.

use std::time::Duration;

/// `initial` × 2^`failures`, capped at `max` (the exponent stops growing at 16, long after
/// any cap the daemon uses is reached).
pub fn exponential(initial: Duration, max: Duration, failures: u32) -> Duration {
    initial.saturating_mul(1u32 << failures.min(16)).min(max)
}

/// A retry schedule that doubles from `initial` on each failure up to `max`, and starts over
/// after a success.
#[derive(Clone, Debug)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    failures: u32,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration) -> Backoff {
        Backoff {
            initial,
            max,
            failures: 0,
        }
    }

    /// Counts a failure and returns how long to wait before the next attempt.
    pub fn fail(&mut self) -> Duration {
        let d = exponential(self.initial, self.max, self.failures);
        self.failures = self.failures.saturating_add(1);
        d
    }

    /// A success: the next failure waits `initial` again.
    pub fn reset(&mut self) {
        self.failures = 0;
    }

    /// Failures since the last success.
    pub fn failures(&self) -> u32 {
        self.failures
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_from_initial_caps_and_resets() {
        let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
        let waits: Vec<u64> = (0..7).map(|_| b.fail().as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30]);
        assert_eq!(b.failures(), 7);
        b.reset();
        assert_eq!(b.fail(), Duration::from_secs(1));
    }

    #[test]
    fn a_huge_failure_count_stays_at_the_cap() {
        let max = Duration::from_secs(7);
        assert_eq!(exponential(Duration::from_millis(200), max, u32::MAX), max);
        assert_eq!(
            exponential(Duration::from_millis(200), max, 0),
            Duration::from_millis(200)
        );
    }
}
