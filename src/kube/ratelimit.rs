//! Client-side token bucket shared by every request of one Client (QPS / burst, like client-go's).
//! Pure arithmetic on caller-supplied instants; the blocking wait lives in the client.

use std::time::{Duration, Instant};

/// A token bucket: `qps` tokens per second, at most `burst` stored. qps <= 0 disables limiting.
#[derive(Clone, Debug)]
pub struct TokenBucket {
    qps: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    pub fn new(qps: f64, burst: u32, now: Instant) -> TokenBucket {
        let burst = f64::from(burst.max(1));
        TokenBucket {
            qps,
            burst,
            tokens: burst,
            last: now,
        }
    }

    pub fn disabled(&self) -> bool {
        self.qps <= 0.0 || !self.qps.is_finite()
    }

    /// Take one token only if one is available now (no debt): for drop-when-over-rate filters.
    pub fn try_take(&mut self, now: Instant) -> bool {
        if self.disabled() {
            return true;
        }
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now.max(self.last);
        self.tokens = (self.tokens + elapsed * self.qps).min(self.burst);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }

    /// Take one token now, going up to `credit` tokens into debt when none is there: for the
    /// few writes that must not wait behind a backlog (a dead VM's status). The debt is paid
    /// by everyone after it (`next_token_at` moves out), so the average rate stays `qps`.
    pub fn try_take_on_credit(&mut self, now: Instant, credit: f64) -> bool {
        if self.disabled() {
            return true;
        }
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now.max(self.last);
        self.tokens = (self.tokens + elapsed * self.qps).min(self.burst);
        if self.tokens - 1.0 >= -credit.max(0.0) {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }

    /// When `try_take_on_credit` with this `credit` will next succeed.
    pub fn next_credit_at(&self, now: Instant, credit: f64) -> Instant {
        if self.disabled() {
            return now;
        }
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        let tokens = (self.tokens + elapsed * self.qps).min(self.burst) + credit.max(0.0);
        if tokens >= 1.0 {
            now
        } else {
            now + Duration::from_secs_f64((1.0 - tokens) / self.qps) + Duration::from_micros(1)
        }
    }

    /// When `try_take` will next succeed: `now` when a token is there (or limiting is off).
    /// Lets a caller arm a timer for the next token instead of sleeping for it.
    pub fn next_token_at(&self, now: Instant) -> Instant {
        if self.disabled() {
            return now;
        }
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        let tokens = (self.tokens + elapsed * self.qps).min(self.burst);
        if tokens >= 1.0 {
            now
        } else {
            // One microsecond past the exact instant: float rounding must not leave the token
            // a hair short there (a caller would wake, find none, and wake again at once).
            now + Duration::from_secs_f64((1.0 - tokens) / self.qps) + Duration::from_micros(1)
        }
    }

    /// Take one token. Returns how long the caller must wait before sending (zero = go now).
    /// The token is reserved either way, so concurrent callers queue fairly.
    pub fn reserve(&mut self, now: Instant) -> Duration {
        if self.disabled() {
            return Duration::ZERO;
        }
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now.max(self.last);
        self.tokens = (self.tokens + elapsed * self.qps).min(self.burst);
        self.tokens -= 1.0;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.qps)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_then_paced_at_qps() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(10.0, 3, t0);
        for _ in 0..3 {
            assert_eq!(b.reserve(t0), Duration::ZERO);
        }
        let w = b.reserve(t0);
        assert!((w.as_secs_f64() - 0.1).abs() < 1e-6, "{w:?}");
        let w = b.reserve(t0);
        assert!((w.as_secs_f64() - 0.2).abs() < 1e-6, "{w:?}");
        // After a second the bucket refills to burst only.
        let t1 = t0 + Duration::from_secs(10);
        for _ in 0..3 {
            assert_eq!(b.reserve(t1), Duration::ZERO);
        }
        assert!(b.reserve(t1) > Duration::ZERO);
    }

    #[test]
    fn try_take_never_goes_into_debt() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(1.0, 2, t0);
        assert!(b.try_take(t0) && b.try_take(t0));
        for _ in 0..100 {
            assert!(!b.try_take(t0));
        }
        assert!(b.try_take(t0 + Duration::from_millis(1001)));
    }

    #[test]
    fn next_token_at_is_when_try_take_succeeds() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(10.0, 1, t0);
        assert_eq!(b.next_token_at(t0), t0);
        assert!(b.try_take(t0));
        let at = b.next_token_at(t0);
        assert!((at - t0).as_secs_f64() > 0.099 && (at - t0).as_secs_f64() < 0.101);
        assert!(!b.try_take(at - Duration::from_millis(2)));
        assert!(b.try_take(at + Duration::from_micros(10)));
        // A reservation in debt (another thread's blocking call) pushes the next token out.
        let t1 = t0 + Duration::from_secs(5);
        assert!(b.reserve(t1).is_zero());
        assert!(b.reserve(t1) > Duration::ZERO);
        assert!(b.next_token_at(t1) >= t1 + Duration::from_millis(199));
    }

    #[test]
    fn credit_lets_a_take_go_into_bounded_debt_that_later_takes_pay() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(10.0, 1, t0);
        assert!(b.try_take(t0));
        assert!(!b.try_take(t0), "the bucket is empty");
        assert!(b.try_take_on_credit(t0, 2.0) && b.try_take_on_credit(t0, 2.0));
        assert!(!b.try_take_on_credit(t0, 2.0), "two tokens of debt at most");
        assert!(b.next_credit_at(t0, 2.0) > t0);
        // The debt is paid before anyone without credit gets a token: 3 tokens at 10/s.
        let next = b.next_token_at(t0);
        assert!((next - t0).as_secs_f64() > 0.299, "{:?}", next - t0);
        assert!(!b.try_take(t0 + Duration::from_millis(290)));
        assert!(b.try_take(next));
    }

    #[test]
    fn zero_qps_disables() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(0.0, 1, t0);
        for _ in 0..1000 {
            assert_eq!(b.reserve(t0), Duration::ZERO);
        }
    }
}
