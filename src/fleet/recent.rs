//! Events on one target over the last [`WINDOW_MS`]; the fleet counts the new work (new
//! conversations, one-off prompts) placed on each target, the share the placement rule's
//! `share_bound` compares. In-flight counts say how busy a replica is this instant; a
//! conversation placed now brings its later turns for a while, so the share of new work
//! given out is what evens out the requests a replica serves over minutes.
//!
//! Owns one packed atomic word per counter: the current window's number (24 bits, wrapping
//! after five years), the previous window's count and the current one's (20 bits each,
//! saturating at a million per window). The estimate is the sliding-window approximation
//! rate limiters use: the current window's count plus the previous one's, weighted by how
//! much of it the sliding window still covers. Time is passed in (ms on the process's
//! monotonic clock); no clocks, no locks.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Length of the window the share is counted over.
pub const WINDOW_MS: u64 = 10_000;

const COUNT_BITS: u32 = 20;
/// Windows a note may be stamped late (its clock read before another thread's note moved
/// the word on) and still count: a request's time is read once, before its retries.
const LATE_WINDOWS: u32 = 16;
const WINDOW_MASK: u32 = (1 << 24) - 1;
const COUNT_MAX: u64 = (1 << COUNT_BITS) - 1;

/// Events on one target, recently.
#[derive(Debug, Default)]
pub struct RecentCount(AtomicU64);

/// (window number, previous window's count, current window's count).
fn unpack(word: u64) -> (u32, u64, u64) {
    (
        (word >> (2 * COUNT_BITS)) as u32 & WINDOW_MASK,
        (word >> COUNT_BITS) & COUNT_MAX,
        word & COUNT_MAX,
    )
}

fn pack(window: u32, previous: u64, current: u64) -> u64 {
    (u64::from(window) << (2 * COUNT_BITS)) | (previous << COUNT_BITS) | current
}

/// The counts as of window `now` for a word last written in window `then`. A `now` at most
/// [`LATE_WINDOWS`] before `then` (another thread read the clock later and wrote first)
/// keeps the counts; any other gap is time passing.
fn roll(then: u32, previous: u64, current: u64, now: u32) -> (u32, u64, u64) {
    match now.wrapping_sub(then) & WINDOW_MASK {
        0 => (then, previous, current),
        1 => (now, current, 0),
        d if d >= WINDOW_MASK + 1 - LATE_WINDOWS => (then, previous, current),
        _ => (now, 0, 0),
    }
}

fn window_of(now_ms: u64) -> u32 {
    (now_ms / WINDOW_MS) as u32 & WINDOW_MASK
}

impl RecentCount {
    /// Count one event at `now_ms`.
    pub fn note(&self, now_ms: u64) {
        let now = window_of(now_ms);
        let _ = self.0.fetch_update(Relaxed, Relaxed, |word| {
            let (then, previous, current) = unpack(word);
            let (window, previous, current) = roll(then, previous, current, now);
            Some(pack(window, previous, (current + 1).min(COUNT_MAX)))
        });
    }

    /// Events in the [`WINDOW_MS`] before `now_ms` (estimated: the previous window's are
    /// taken as evenly spread over it).
    pub fn estimate(&self, now_ms: u64) -> f64 {
        let (then, previous, current) = unpack(self.0.load(Relaxed));
        let (window, previous, current) = roll(then, previous, current, window_of(now_ms));
        let into = if window == window_of(now_ms) {
            (now_ms % WINDOW_MS) as f64 / WINDOW_MS as f64
        } else {
            0.0
        };
        current as f64 + previous as f64 * (1.0 - into)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_the_current_window_and_a_fading_share_of_the_previous_one() {
        let r = RecentCount::default();
        for _ in 0..10 {
            r.note(1_000);
        }
        assert_eq!(r.estimate(1_000), 10.0);
        assert_eq!(r.estimate(WINDOW_MS - 1), 10.0);
        // A quarter into the next window, three quarters of the previous one still count.
        r.note(WINDOW_MS + 100);
        assert_eq!(r.estimate(WINDOW_MS + WINDOW_MS / 4), 1.0 + 7.5);
        // Two windows on, nothing counts.
        assert_eq!(r.estimate(3 * WINDOW_MS), 0.0);
        r.note(3 * WINDOW_MS);
        assert_eq!(r.estimate(3 * WINDOW_MS), 1.0);
    }

    #[test]
    fn a_note_stamped_a_window_late_keeps_the_counts() {
        let r = RecentCount::default();
        r.note(WINDOW_MS);
        r.note(WINDOW_MS - 1);
        assert_eq!(r.estimate(WINDOW_MS), 2.0);
    }

    #[test]
    fn counts_from_long_ago_are_gone_however_long_ago() {
        for windows in [
            2,
            1000,
            40_000,
            1 << 23,
            (1 << 24) - LATE_WINDOWS as u64 - 1,
        ] {
            let r = RecentCount::default();
            r.note(0);
            assert_eq!(r.estimate(windows * WINDOW_MS), 0.0, "{windows} windows on");
            r.note(windows * WINDOW_MS);
            assert_eq!(r.estimate(windows * WINDOW_MS), 1.0, "{windows} windows on");
        }
    }

    #[test]
    fn the_window_number_wraps_without_losing_or_inventing_requests() {
        let r = RecentCount::default();
        let last = u64::from(WINDOW_MASK) * WINDOW_MS;
        r.note(last);
        r.note(last + WINDOW_MS);
        assert_eq!(r.estimate(last + WINDOW_MS), 2.0);
        assert_eq!(r.estimate(last + 3 * WINDOW_MS), 0.0);
    }

    #[test]
    fn counts_from_many_threads_add_up() {
        let r = std::sync::Arc::new(RecentCount::default());
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let r = r.clone();
                std::thread::spawn(move || (0..1000).for_each(|_| r.note(5)))
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        assert_eq!(r.estimate(5), 4000.0);
    }
}
