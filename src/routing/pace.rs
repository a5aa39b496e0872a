//! The pace of one kind of event on one target, on a clock the caller keeps: when the last
//! event came and the typical gap between events (an exponentially weighted mean), so the
//! caller can tell events that have stopped from a gap that is only long. The clock is a
//! count, not wall time (`group_homes` keeps one pace per target beside each route's count
//! of new conversations, so a pace only ever sees one clock): a burst then is many events,
//! not many events in no time, and a silence means something only while the rest of the
//! route keeps the clock moving. A clock that starts again makes the last event look
//! recent, never long past.
//!
//! Owns three atomics; no clocks, no locks. Concurrent notes may each see the other's gap:
//! the mean is an estimate either way.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Weight of the newest gap in the mean: about the last eight gaps count.
const NEWEST_GAP_WEIGHT: f64 = 0.125;

/// Gaps that must have been seen before the events can count as stopped: with fewer the
/// mean says little.
pub const MIN_GAPS: u64 = 8;

/// Events of one kind on one target: the last one's time and the mean gap between them.
#[derive(Debug, Default)]
pub struct Pace {
    /// Clock reading of the last event plus one (0 = none yet).
    last: AtomicU64,
    /// Mean gap, as `f64` bits.
    mean_gap: AtomicU64,
    /// Gaps seen, saturating.
    gaps: AtomicU64,
}

impl Pace {
    /// Count one event at clock reading `now`.
    pub fn note(&self, now: u64) {
        let previous = self.last.swap(now.saturating_add(1), Relaxed);
        if previous == 0 {
            return;
        }
        let gap = now.saturating_sub(previous - 1) as f64;
        let seen = self
            .gaps
            .fetch_update(Relaxed, Relaxed, |g| Some(g.saturating_add(1)))
            .unwrap_or(u64::MAX);
        let _ = self.mean_gap.fetch_update(Relaxed, Relaxed, |bits| {
            let mean = f64::from_bits(bits);
            let next = if seen == 0 {
                gap
            } else {
                mean + NEWEST_GAP_WEIGHT * (gap - mean)
            };
            Some(next.to_bits())
        });
    }

    /// Whether no event has come for more than `gaps` mean gaps before clock reading `now`
    /// (false until [`MIN_GAPS`] gaps were seen).
    pub fn stopped(&self, now: u64, gaps: f64) -> bool {
        if self.gaps.load(Relaxed) < MIN_GAPS {
            return false;
        }
        let last = self.last.load(Relaxed).saturating_sub(1);
        let mean = f64::from_bits(self.mean_gap.load(Relaxed)).max(1.0);
        now.saturating_sub(last) as f64 > gaps * mean
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_stop_only_after_many_of_their_own_gaps() {
        let every_fifth = Pace::default();
        for t in 0..20 {
            every_fifth.note(t * 5);
        }
        let last = 19 * 5;
        assert!(!every_fifth.stopped(last + 20, 4.0));
        assert!(every_fifth.stopped(last + 21, 4.0));
        // Rarer events need a longer silence.
        let rare = Pace::default();
        for t in 0..20 {
            rare.note(t * 100);
        }
        assert!(!rare.stopped(1_900 + 400, 4.0));
        assert!(rare.stopped(1_900 + 401, 4.0));
    }

    #[test]
    fn the_mean_follows_the_recent_gaps() {
        let p = Pace::default();
        for t in 0..20 {
            p.note(t * 100);
        }
        // The events come faster: the silence that counts shrinks towards the new gaps.
        for t in 1..=30 {
            p.note(1_900 + t * 10);
        }
        let last = 1_900 + 300;
        assert!(p.stopped(last + 60, 4.0));
        assert!(!p.stopped(last + 30, 4.0));
    }

    #[test]
    fn too_few_events_say_nothing() {
        let p = Pace::default();
        for t in 0..MIN_GAPS {
            p.note(t * 10);
        }
        assert!(!p.stopped(1_000_000, 4.0));
        p.note(MIN_GAPS * 10);
        assert!(p.stopped(1_000_000, 4.0));
    }

    #[test]
    fn an_event_ends_the_silence() {
        let p = Pace::default();
        for t in 0..20 {
            p.note(t * 10);
        }
        assert!(p.stopped(1_000, 4.0));
        p.note(1_000);
        assert!(!p.stopped(1_001, 4.0));
    }
}
