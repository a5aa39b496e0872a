//! When a failed attempt may be tried again on another target: the reasons that allow it,
//! the jittered exponential back-off, and the process-wide retry budget.
//!
//! Owns: [`RetryReason`], [`backoff`] and [`RetryBudget`]. The attempt loop that asks
//! them is `proxy::Gateway::forward`; what counts as "nothing reached the client yet" is
//! decided where the failure happens (`proxy::upstream`).
//! Must not: take a lock. The budget is atomics only: one compare-and-swap per request
//! to count it, a scan of the window's buckets only when a retry is considered.
//!
//! ## The budget
//! Retries may add at most `budget_ratio` of the requests of the last `budget_window_s`
//! seconds, plus `budget_min_retries` per window so a quiet gateway can still retry
//! (Linkerd's and Finagle's retry budgets). When every target fails, retries stop at the
//! budget instead of multiplying the load on a fleet that is already down.
//!
//! The window is one bucket per second. A bucket is one `AtomicU64` packing the second it
//! counts (24 bits: wraps after 194 days, checked by equality) with that second's
//! requests and retries (20 bits each, saturating at about a million per second), so a
//! bucket is reset and bumped in one compare-and-swap and never mixes two seconds.

use crate::config::RetryConfig;
use crate::fleet::ms_at;
use rand::Rng;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Why an attempt may be retried: it failed before any response byte reached the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryReason {
    /// The connection could not be made (refused, unreachable, connect timeout).
    Connect,
    /// The connection was closed or reset before the response head arrived.
    Reset,
    /// The upstream answered 502 Bad Gateway.
    Status502,
    /// The upstream answered 503 Service Unavailable.
    Status503,
}

impl RetryReason {
    /// Label in metrics and the access log.
    pub fn as_str(self) -> &'static str {
        match self {
            RetryReason::Connect => "connect",
            RetryReason::Reset => "reset",
            RetryReason::Status502 => "502",
            RetryReason::Status503 => "503",
        }
    }

    /// The reason an upstream answer with `status` may be retried for, if any.
    pub fn for_status(status: u16) -> Option<Self> {
        match status {
            502 => Some(RetryReason::Status502),
            503 => Some(RetryReason::Status503),
            _ => None,
        }
    }
}

/// The back-off before retry number `retry` (1 for the first): `backoff_ms` doubled for
/// each retry before it, capped at `max_backoff_ms`, then jittered uniformly over its
/// upper half (so retries of many requests failed at once do not arrive in step).
pub fn backoff(cfg: &RetryConfig, retry: u32) -> Duration {
    let doubled = cfg
        .backoff_ms
        .saturating_mul(1u64 << retry.saturating_sub(1).min(20));
    let ms = doubled.min(cfg.max_backoff_ms);
    if ms == 0 {
        return Duration::ZERO;
    }
    let micros = ms * 1_000;
    Duration::from_micros(rand::thread_rng().gen_range(micros / 2..=micros))
}

/// Longest window the budget can cover, seconds (`retry.budget_window_s` is at most this).
pub const MAX_WINDOW_S: usize = 300;
const STAMP_BITS: u32 = 24;
const COUNT_BITS: u32 = 20;
const STAMP_MASK: u64 = (1 << STAMP_BITS) - 1;
const COUNT_MAX: u64 = (1 << COUNT_BITS) - 1;

fn pack(stamp: u64, requests: u64, retries: u64) -> u64 {
    (stamp << (2 * COUNT_BITS)) | (requests << COUNT_BITS) | retries
}

fn unpack(v: u64) -> (u64, u64, u64) {
    (
        v >> (2 * COUNT_BITS),
        (v >> COUNT_BITS) & COUNT_MAX,
        v & COUNT_MAX,
    )
}

/// Requests and retries of the last seconds (see the module header).
pub struct RetryBudget {
    buckets: Box<[AtomicU64]>,
}

impl Default for RetryBudget {
    fn default() -> Self {
        RetryBudget {
            buckets: (0..MAX_WINDOW_S).map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

impl RetryBudget {
    fn second(at: Instant) -> u64 {
        ms_at(at) / 1_000
    }

    fn bump(&self, second: u64, requests: u64, retries: u64) {
        let bucket = &self.buckets[(second % MAX_WINDOW_S as u64) as usize];
        let stamp = second & STAMP_MASK;
        let mut current = bucket.load(Ordering::Relaxed);
        loop {
            let (s, rq, rt) = unpack(current);
            let (rq, rt) = if s == stamp { (rq, rt) } else { (0, 0) };
            let next = pack(
                stamp,
                (rq + requests).min(COUNT_MAX),
                (rt + retries).min(COUNT_MAX),
            );
            match bucket.compare_exchange_weak(current, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return,
                Err(seen) => current = seen,
            }
        }
    }

    /// (requests, retries) counted over the `window_s` seconds up to `second`.
    fn totals(&self, second: u64, window_s: u64) -> (u64, u64) {
        let window = window_s.clamp(1, MAX_WINDOW_S as u64);
        let (mut requests, mut retries) = (0, 0);
        for back in 0..window.min(second + 1) {
            let s = second - back;
            let (stamp, rq, rt) =
                unpack(self.buckets[(s % MAX_WINDOW_S as u64) as usize].load(Ordering::Relaxed));
            if stamp == s & STAMP_MASK {
                requests += rq;
                retries += rt;
            }
        }
        (requests, retries)
    }

    /// Count one client request (its first attempt) at `at`.
    pub fn record_request(&self, at: Instant) {
        self.bump(Self::second(at), 1, 0);
    }

    /// Whether a retry at `at` would fit in the budget (nothing is withdrawn).
    pub fn has_room(&self, at: Instant, cfg: &RetryConfig) -> bool {
        let (requests, retries) = self.totals(Self::second(at), cfg.budget_window_s);
        (retries as f64) < cfg.budget_min_retries as f64 + cfg.budget_ratio * requests as f64
    }

    /// Take one retry from the budget at `at`; false (nothing taken) when it is spent.
    /// Requests racing for the last retry may overshoot it by the number racing.
    pub fn try_withdraw(&self, at: Instant, cfg: &RetryConfig) -> bool {
        if !self.has_room(at, cfg) {
            return false;
        }
        self.bump(Self::second(at), 0, 1);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(ratio: f64, min: u64) -> RetryConfig {
        RetryConfig {
            budget_ratio: ratio,
            budget_min_retries: min,
            budget_window_s: 10,
            ..RetryConfig::default()
        }
    }

    #[test]
    fn retries_stop_at_the_ratio_of_the_windows_requests() {
        let budget = RetryBudget::default();
        let cfg = cfg(0.2, 0);
        let now = Instant::now();
        assert!(!budget.try_withdraw(now, &cfg), "no requests, no minimum");
        for _ in 0..50 {
            budget.record_request(now);
        }
        let granted = (0..100).filter(|_| budget.try_withdraw(now, &cfg)).count();
        assert_eq!(granted, 10, "20% of 50 requests");
    }

    #[test]
    fn the_minimum_allows_retries_without_traffic_and_the_window_forgets() {
        let budget = RetryBudget::default();
        let cfg = cfg(0.2, 3);
        let t0 = Instant::now();
        let granted = (0..10).filter(|_| budget.try_withdraw(t0, &cfg)).count();
        assert_eq!(granted, 3);
        // Eleven seconds on, the first second's retries are out of the 10 s window.
        let later = t0 + Duration::from_secs(11);
        assert!(budget.has_room(later, &cfg));
        // A bucket reused 300 s on counts only its new second.
        let reused = t0 + Duration::from_secs(MAX_WINDOW_S as u64);
        budget.record_request(reused);
        assert_eq!(budget.totals(RetryBudget::second(reused), 1), (1, 0));
    }

    #[test]
    fn concurrent_counting_loses_nothing() {
        let budget = std::sync::Arc::new(RetryBudget::default());
        let now = Instant::now();
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let b = budget.clone();
                std::thread::spawn(move || (0..10_000).for_each(|_| b.record_request(now)))
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        assert_eq!(budget.totals(RetryBudget::second(now), 1).0, 40_000);
    }

    #[test]
    fn backoff_doubles_is_capped_and_jittered_within_its_upper_half() {
        let cfg = RetryConfig {
            backoff_ms: 20,
            max_backoff_ms: 100,
            ..RetryConfig::default()
        };
        for (retry, full) in [(1, 20), (2, 40), (3, 80), (4, 100), (30, 100)] {
            for _ in 0..50 {
                let d = backoff(&cfg, retry).as_micros() as u64;
                assert!(
                    (full * 500..=full * 1_000).contains(&d),
                    "retry {retry}: {d} us"
                );
            }
        }
        let none = RetryConfig {
            backoff_ms: 0,
            ..cfg
        };
        assert_eq!(backoff(&none, 1), Duration::ZERO);
    }
}
