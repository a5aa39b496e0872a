//! Baseline strategies: `round_robin` and `least_load`. They ignore the prompt and are
//! the yardsticks cache-aware routing is measured against.

use super::{Decision, FleetView, Reason, RouteInput, Strategy};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Rotate through the eligible targets.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl Strategy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn uses_prompt(&self) -> bool {
        false
    }

    fn select(&self, _input: &RouteInput, fleet: &FleetView) -> Option<Decision> {
        // Rotate over the eligible set itself, so an ineligible target's turn is spread
        // evenly instead of all landing on its neighbour.
        let n = fleet.eligible().count();
        if n == 0 {
            return None;
        }
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        fleet.eligible().nth(turn % n).map(|target| Decision {
            target,
            reason: Reason::RoundRobin,
            score: None,
            hint: None,
            conversation: None,
            new_work: false,
        })
    }
}

/// Fewest requests in flight among eligible targets; ties broken at random.
#[derive(Debug, Default)]
pub struct LeastLoad;

impl Strategy for LeastLoad {
    fn name(&self) -> &'static str {
        "least_load"
    }

    fn uses_prompt(&self) -> bool {
        false
    }

    fn select(&self, _input: &RouteInput, fleet: &FleetView) -> Option<Decision> {
        fleet.least_loaded().map(|target| Decision {
            target,
            reason: Reason::LeastLoad,
            score: None,
            hint: None,
            conversation: None,
            new_work: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::Candidate;

    fn c(inflight: u64, eligible: bool) -> Candidate<'static> {
        Candidate {
            inflight,
            eligible,
            weight: 1,
            prefix: None,
            label: "",
            kv: None,
            lmcache: None,
            placed: 0.0,
            cache_tokens: 0.0,
        }
    }

    #[test]
    fn round_robin_alternates_and_skips_ineligible() {
        let rr = RoundRobin::default();
        let fleet = [c(0, true), c(0, false), c(0, true)];
        let view = FleetView::new(&fleet);
        let picks: Vec<usize> = (0..6)
            .map(|_| rr.select(&RouteInput::default(), &view).unwrap().target)
            .collect();
        assert!(!picks.contains(&1));
        assert_eq!(picks.iter().filter(|&&p| p == 0).count(), 3, "{picks:?}");
    }

    #[test]
    fn round_robin_respects_exclusions_and_empty() {
        let rr = RoundRobin::default();
        let fleet = [c(0, true), c(0, true)];
        let view = FleetView {
            candidates: &fleet,
            excluded: &[0],
        };
        for _ in 0..4 {
            assert_eq!(rr.select(&RouteInput::default(), &view).unwrap().target, 1);
        }
        let none = [c(0, false)];
        assert!(rr
            .select(&RouteInput::default(), &FleetView::new(&none))
            .is_none());
    }

    #[test]
    fn least_load_picks_min_and_breaks_ties_randomly() {
        let fleet = [c(3, true), c(1, true), c(1, true), c(0, false)];
        let view = FleetView::new(&fleet);
        let mut seen = [0; 4];
        for _ in 0..200 {
            seen[LeastLoad
                .select(&RouteInput::default(), &view)
                .unwrap()
                .target] += 1;
        }
        assert_eq!(seen[0], 0);
        assert_eq!(seen[3], 0, "ineligible target with zero load must not win");
        assert!(seen[1] > 0 && seen[2] > 0, "{seen:?}");
    }
}
