//! Token bucket for per-link rate limits; time is passed in.

use std::time::{Duration, Instant};

/// A token bucket of bytes.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    /// `rate` bytes per second, holding at most `burst` bytes (starts full).
    pub fn new(rate: u64, burst: u64, now: Instant) -> Self {
        let burst = burst.max(1) as f64;
        TokenBucket {
            rate: rate.max(1) as f64,
            burst,
            tokens: burst,
            last: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.tokens = (self.tokens + dt * self.rate).min(self.burst);
        self.last = now;
    }

    /// Take `n` bytes. Returns how long to wait before sending them (zero if
    /// now); the tokens are taken either way (debt allowed, so frames larger
    /// than the burst still pass at the configured rate).
    pub fn take(&mut self, n: u64, now: Instant) -> Duration {
        self.refill(now);
        self.tokens -= n as f64;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.rate)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paces_to_rate() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(1000, 500, t0);
        assert_eq!(b.take(500, t0), Duration::ZERO);
        assert_eq!(b.take(1000, t0), Duration::from_secs(1));
        // After 1 s the debt is paid; half a second later 500 bytes are available.
        let t1 = t0 + Duration::from_millis(1500);
        assert_eq!(b.take(500, t1), Duration::ZERO);
        assert!(b.take(100, t1) > Duration::ZERO);
    }
}
