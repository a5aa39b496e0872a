//! `lmcache_aware`: prefer targets whose LMCache controller reports free cache capacity,
//! balanced by in-flight load, behind an overload guard.
//!
//! Pure: the controllers' last answers arrive as [`Candidate::lmcache`] (`None` when the
//! controller is *neutral*: not configured, its last poll failed or was denied, or its
//! last good answer is older than `stale_after_ms` — `lmcache_poll` decides that).
//!
//! ## The decision, exactly
//! Among eligible, not-yet-tried targets:
//! 1. **Free capacity** `free_i`: `1 − occupancy` when the controller reports
//!    `cache_available = true`; `0` when it reports `false` (a cache that cannot take
//!    new entries is worth nothing). A neutral target's `free_i` is the mean `free` of
//!    the eligible targets with a fresh answer — the fleet average, so it neither wins
//!    nor loses on cache grounds; only load separates it from an average target.
//! 2. No eligible target has a fresh answer → least-loaded ([`Reason::Fallback`]).
//! 3. **Score** `free_i / (1 + inflight_i)`. Requests go to the highest score, which
//!    settles in-flight counts roughly in proportion to free capacity instead of
//!    herding every request onto the emptiest cache between two polls. Ties: fewer in
//!    flight, then random.
//! 4. Best score 0 (no free capacity anywhere) → least-loaded ([`Reason::Fallback`]).
//! 5. **Overload guard**: if the winner has more than [`OVERLOAD_ABS`] requests in
//!    flight beyond the least-loaded eligible target *and* more than
//!    [`OVERLOAD_RATIO`] × that target's load, route to the least-loaded target
//!    instead ([`Reason::Overloaded`]). Tighter than the prefix strategies' guard: free
//!    capacity is a soft preference, not a cached prefix that would be lost.
//! 6. Otherwise the winner ([`Reason::CacheCapacity`]).

use super::{Decision, FleetView, Reason, RouteInput, Strategy};

/// Overload guard, absolute part: in flight beyond the least-loaded target.
pub const OVERLOAD_ABS: u64 = 2;
/// Overload guard, relative part: multiple of the least-loaded target's load.
pub const OVERLOAD_RATIO: f64 = 1.5;

/// Whether `inflight` counts as overloaded next to the least-loaded eligible target.
pub fn overloaded(inflight: u64, min_inflight: u64) -> bool {
    inflight > min_inflight + OVERLOAD_ABS && inflight as f64 > OVERLOAD_RATIO * min_inflight as f64
}

/// A controller's fresh answer, as routing sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LmcacheView {
    /// Fraction of the cache in use, in `[0, 1]`.
    pub occupancy: f64,
    /// Whether the cache takes new entries.
    pub cache_available: bool,
}

impl std::fmt::Display for LmcacheView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "occupancy {} cache_available {}",
            self.occupancy, self.cache_available
        )
    }
}

impl LmcacheView {
    /// Free capacity as this strategy values it (0 when the cache is unavailable).
    pub fn free(&self) -> f64 {
        if self.cache_available {
            (1.0 - self.occupancy).clamp(0.0, 1.0)
        } else {
            0.0
        }
    }
}

/// See the module docs.
#[derive(Debug, Default)]
pub struct LmcacheAware;

impl Strategy for LmcacheAware {
    fn name(&self) -> &'static str {
        "lmcache_aware"
    }

    fn uses_prompt(&self) -> bool {
        false
    }

    fn select(&self, _input: &RouteInput, fleet: &FleetView) -> Option<Decision> {
        let c = fleet.candidates;
        let min = fleet.min_inflight()?;
        let least_loaded = |reason| {
            fleet.least_loaded().map(|target| Decision {
                target,
                reason,
                score: None,
                hint: None,
                conversation: None,
                new_work: false,
            })
        };
        let (sum, fresh) = fleet
            .eligible()
            .filter_map(|i| c[i].lmcache.map(|v| v.free()))
            .fold((0.0, 0usize), |(s, n), f| (s + f, n + 1));
        if fresh == 0 {
            return least_loaded(Reason::Fallback);
        }
        let neutral_free = sum / fresh as f64;
        let score = |i: usize| {
            let free = c[i].lmcache.map_or(neutral_free, |v| v.free());
            free / (1.0 + c[i].inflight as f64)
        };
        let best = fleet.eligible().map(score).fold(f64::MIN, f64::max);
        if best <= 0.0 {
            return least_loaded(Reason::Fallback);
        }
        // Ties on score: fewer in flight, then random.
        let tied = || {
            fleet
                .eligible()
                .filter(|&i| score(i) >= best - SCORE_EPSILON)
        };
        let fewest = tied().map(|i| c[i].inflight).min()?;
        let winner = super::pick_random(tied().filter(|&i| c[i].inflight == fewest))?;
        if overloaded(c[winner].inflight, min) {
            return least_loaded(Reason::Overloaded);
        }
        Some(Decision {
            target: winner,
            reason: Reason::CacheCapacity,
            score: None,
            hint: None,
            conversation: None,
            new_work: false,
        })
    }
}

/// Scores closer than this are equal (they come from the same arithmetic on the same
/// inputs, so only rounding separates true ties).
const SCORE_EPSILON: f64 = 1e-12;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::Candidate;

    fn fresh(inflight: u64, occupancy: f64) -> Candidate<'static> {
        Candidate {
            inflight,
            eligible: true,
            weight: 1,
            lmcache: Some(LmcacheView {
                occupancy,
                cache_available: true,
            }),
            ..Default::default()
        }
    }

    fn unavailable(inflight: u64) -> Candidate<'static> {
        Candidate {
            lmcache: Some(LmcacheView {
                occupancy: 0.0,
                cache_available: false,
            }),
            ..fresh(inflight, 0.0)
        }
    }

    fn neutral(inflight: u64) -> Candidate<'static> {
        Candidate {
            lmcache: None,
            ..fresh(inflight, 0.0)
        }
    }

    fn pick(fleet: &[Candidate]) -> Decision {
        LmcacheAware
            .select(&RouteInput::default(), &FleetView::new(fleet))
            .expect("a target")
    }

    fn tally(fleet: &[Candidate], n: usize) -> Vec<usize> {
        let mut seen = vec![0; fleet.len()];
        for _ in 0..n {
            seen[pick(fleet).target] += 1;
        }
        seen
    }

    #[test]
    fn more_free_capacity_wins_at_equal_load() {
        let d = pick(&[fresh(0, 0.9), fresh(0, 0.2), fresh(0, 0.5)]);
        assert_eq!(d.target, 1);
        assert_eq!(d.reason, Reason::CacheCapacity);
        assert_eq!(d.reason.as_str(), "cache_capacity");
    }

    #[test]
    fn unavailable_cache_loses_to_any_free_capacity() {
        let d = pick(&[unavailable(0), fresh(0, 0.99)]);
        assert_eq!(d.target, 1);
    }

    #[test]
    fn load_balances_against_capacity() {
        // 0.8 / (1 + 3) = 0.2 < 0.5 / (1 + 0) = 0.5.
        assert_eq!(pick(&[fresh(3, 0.2), fresh(0, 0.5)]).target, 1);
        // 0.8 / (1 + 1) = 0.4 > 0.3 / (1 + 0).
        assert_eq!(pick(&[fresh(1, 0.2), fresh(0, 0.7)]).target, 0);
    }

    #[test]
    fn score_ties_go_to_fewer_in_flight_then_random() {
        // 0.6 / 2 == 0.3 / 1: the idle one wins.
        assert_eq!(pick(&[fresh(1, 0.4), fresh(0, 0.7)]).target, 1);
        let seen = tally(&[fresh(0, 0.5), fresh(0, 0.5)], 200);
        assert!(seen[0] > 0 && seen[1] > 0, "{seen:?}");
    }

    #[test]
    fn neutral_counts_as_the_fleet_average() {
        // Fresh free capacities 0.8 and 0.2: a neutral target counts as 0.5.
        let fleet = [fresh(0, 0.2), fresh(0, 0.8), neutral(0)];
        assert_eq!(pick(&fleet).target, 0, "above average beats neutral");
        // Neutral beats the below-average target at equal load...
        let fleet = [fresh(5, 0.2), fresh(0, 0.8), neutral(0)];
        assert_eq!(pick(&fleet).target, 2);
        // ...and is not excluded: with less load it beats the above-average one.
        let fleet = [fresh(1, 0.2), fresh(0, 0.8), neutral(0)];
        assert_eq!(pick(&fleet).target, 2, "0.4 < 0.5");
        // A lone fresh target equals the neutral ones' value: load decides.
        let fleet = [neutral(2), fresh(1, 0.5), neutral(0)];
        assert_eq!(pick(&fleet).target, 2);
    }

    #[test]
    fn all_neutral_falls_back_to_least_load() {
        let d = pick(&[neutral(3), neutral(1), neutral(2)]);
        assert_eq!(d.target, 1);
        assert_eq!(d.reason, Reason::Fallback);
    }

    #[test]
    fn no_free_capacity_anywhere_falls_back_to_least_load() {
        let d = pick(&[fresh(2, 1.0), unavailable(1), fresh(4, 1.0)]);
        assert_eq!(d.target, 1);
        assert_eq!(d.reason, Reason::Fallback);
    }

    #[test]
    fn overloaded_winner_yields_to_the_least_loaded() {
        // 1.0 / 7 beats 0, but 6 > 0 + 2 and 6 > 1.5 × 0.
        let d = pick(&[fresh(6, 0.0), unavailable(0)]);
        assert_eq!(d.target, 1);
        assert_eq!(d.reason, Reason::Overloaded);
    }

    #[test]
    fn overload_needs_both_margin_and_factor() {
        assert!(!overloaded(2, 0), "margin: 2 is not more than 0 + 2");
        assert!(overloaded(3, 0));
        assert!(!overloaded(15, 10), "factor: 15 is not more than 1.5 × 10");
        assert!(overloaded(16, 10));
        assert!(!overloaded(4, 2), "margin: 4 is not more than 2 + 2");
        // In a decision: winner at 15 next to a least-loaded 10 stays.
        let d = pick(&[fresh(15, 0.0), fresh(10, 0.99)]);
        assert_eq!((d.target, d.reason), (0, Reason::CacheCapacity));
    }

    #[test]
    fn ineligible_and_tried_targets_are_never_chosen() {
        let mut fleet = [fresh(0, 0.0), fresh(0, 0.9), fresh(0, 0.5)];
        fleet[0].eligible = false;
        let view = FleetView {
            candidates: &fleet,
            excluded: &[2],
        };
        for _ in 0..20 {
            let d = LmcacheAware.select(&RouteInput::default(), &view).unwrap();
            assert_eq!(d.target, 1);
        }
        // The broken target's fresh answer does not shift the neutral average, and its
        // empty queue does not make others look overloaded.
        let mut fleet = [fresh(0, 0.0), fresh(3, 0.5), neutral(3)];
        fleet[0].eligible = false;
        let d = pick(&fleet);
        assert_eq!(d.reason, Reason::CacheCapacity);
        let none = [neutral(0)];
        let view = FleetView {
            candidates: &none,
            excluded: &[0],
        };
        assert!(LmcacheAware.select(&RouteInput::default(), &view).is_none());
    }
}
