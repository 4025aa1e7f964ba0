//! Exponential backoff: the one doubling-with-a-cap schedule the daemon's retries use, and the
//! jitter that keeps a fleet from retrying in step. Pure arithmetic: it reads no clock.

use std::time::Duration;

/// `initial` × 2^`failures`, capped at `max` (the exponent stops growing at 16, long after
/// any cap the daemon uses is reached).
pub fn exponential(initial: Duration, max: Duration, failures: u32) -> Duration {
    initial.saturating_mul(1u32 << failures.min(16)).min(max)
}

/// The exponential delay with jitter: drawn from `[d, 2d)` for `d = exponential(..)` (client-go's
/// jitter factor 1.0), never above `max`. Once `2d` would pass `max` it is drawn from
/// `[max/2, max)` instead of sitting at `max`: nodes that all hit the cap keep retrying at
/// different moments rather than converging on one period. `unit` is a random number in [0, 1).
pub fn jittered(initial: Duration, max: Duration, failures: u32, unit: f64) -> Duration {
    let unit = unit.clamp(0.0, 1.0);
    let d = exponential(initial, max, failures);
    if d.saturating_mul(2) <= max {
        d + d.mul_f64(unit)
    } else {
        let half = max / 2;
        half + (max - half).mul_f64(unit)
    }
}

/// A uniformly random point of `[0, window)`: when a fleet must all do one thing (relist after
/// the API server lost its watch cache), each node waits this long, so that about
/// `1 s / window` of the fleet does it in any one second.
pub fn spread(window: Duration, unit: f64) -> Duration {
    window.mul_f64(unit.clamp(0.0, 1.0))
}

/// A small xorshift generator for jitter: not for secrets, only to decorrelate nodes.
#[derive(Clone, Debug)]
pub struct Jitter {
    state: u64,
}

impl Jitter {
    /// Seeded from `salt` (say, a hash of the node name) and the wall clock's nanoseconds, so
    /// that nodes started at the same instant, or the same node restarted, draw differently.
    pub fn new(salt: u64) -> Jitter {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0x9e37_79b9_7f4a_7c15);
        Jitter::seeded(nanos ^ salt.rotate_left(29))
    }

    /// A fixed sequence (tests).
    pub fn seeded(seed: u64) -> Jitter {
        // splitmix64 of the seed: even close seeds start far apart; the state is never 0.
        let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        Jitter {
            state: (z ^ (z >> 31)) | 1,
        }
    }

    /// The next number of [0, 1).
    pub fn unit(&mut self) -> f64 {
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        (self.state >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// FNV-1a of a name: a jitter salt that differs between nodes.
pub fn salt(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A retry schedule that doubles from `initial` on each failure up to `max`, and starts over
/// after a success; with `jitter`, each wait is drawn as `jittered` says.
#[derive(Clone, Debug)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    failures: u32,
    jitter: Option<Jitter>,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration) -> Backoff {
        Backoff {
            initial,
            max,
            failures: 0,
            jitter: None,
        }
    }

    /// The same schedule with each wait jittered (for calls every node of a fleet makes).
    pub fn with_jitter(mut self, jitter: Jitter) -> Backoff {
        self.jitter = Some(jitter);
        self
    }

    /// Counts a failure and returns how long to wait before the next attempt.
    pub fn fail(&mut self) -> Duration {
        let d = match self.jitter.as_mut() {
            Some(j) => jittered(self.initial, self.max, self.failures, j.unit()),
            None => exponential(self.initial, self.max, self.failures),
        };
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

    #[test]
    fn jittered_stays_within_its_band_and_below_the_cap() {
        let (i, max) = (Duration::from_millis(800), Duration::from_secs(30));
        assert_eq!(jittered(i, max, 0, 0.0), i);
        assert_eq!(jittered(i, max, 0, 0.5), Duration::from_millis(1200));
        assert_eq!(jittered(i, max, 2, 0.0), Duration::from_millis(3200));
        // 12.8 s doubled is 25.6 s, under the cap: [12.8, 25.6).
        assert_eq!(jittered(i, max, 4, 0.999_999).as_millis(), 25_599);
        // 25.6 s would reach 51.2 s: [15, 30) instead, never above the cap.
        assert_eq!(jittered(i, max, 5, 0.0), Duration::from_secs(15));
        assert!(jittered(i, max, 50, 0.999_999) < max);
        assert_eq!(spread(Duration::from_secs(8), 0.25), Duration::from_secs(2));
    }

    /// The spread a fleet gets: 1,000 nodes failing together at each step land all over the
    /// step's band (no tenth of it holds more than twice its share), not on one instant.
    #[test]
    fn a_fleet_of_jittered_backoffs_spreads_over_the_band() {
        let (i, max) = (Duration::from_millis(800), Duration::from_secs(30));
        for failures in [0u32, 3, 8] {
            let mut buckets = [0u32; 10];
            for node in 0..1000u64 {
                let mut j = Jitter::seeded(salt(&format!("node-{node}")));
                let d = jittered(i, max, failures, j.unit());
                let low = exponential(i, max, failures).min(max / 2);
                let width = (exponential(i, max, failures) * 2).min(max) - low;
                assert!(d >= low && d < low + width, "{d:?} out of band");
                let k = ((d - low).as_secs_f64() / width.as_secs_f64() * 10.0) as usize;
                buckets[k.min(9)] += 1;
            }
            assert!(
                buckets.iter().all(|&b| (50..=200).contains(&b)),
                "failures {failures}: {buckets:?}"
            );
        }
    }

    #[test]
    fn a_jittered_backoff_draws_differently_per_node_and_resets() {
        let mk = |n: &str| {
            Backoff::new(Duration::from_millis(200), Duration::from_secs(7))
                .with_jitter(Jitter::seeded(salt(n)))
        };
        let (mut a, mut b) = (mk("a"), mk("b"));
        let wa: Vec<Duration> = (0..4).map(|_| a.fail()).collect();
        let wb: Vec<Duration> = (0..4).map(|_| b.fail()).collect();
        assert_ne!(wa, wb);
        for (k, w) in wa.iter().enumerate() {
            let d = exponential(Duration::from_millis(200), Duration::from_secs(7), k as u32);
            assert!(*w >= d && *w < d * 2, "{k}: {w:?}");
        }
        a.reset();
        assert!(a.fail() < Duration::from_millis(400));
    }
}
