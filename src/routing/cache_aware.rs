//! `cache_aware`: send a request to the target whose prefix trie already holds the most
//! of its prompt, unless that target is overloaded (SPEC §4).
//!
//! Rule, over eligible targets only (a broken replica's empty queue never makes the
//! others look busy):
//! 1. score = longest stored prefix / prompt length, per target;
//! 2. best score ≥ threshold and the best target not overloaded → pin to it (`cache_hit`);
//! 3. best score ≥ threshold but overloaded → least-loaded (`overloaded`);
//! 4. below threshold → least-loaded; when every load is equal, the least-warmed target
//!    (fewest trie bytes), so cold prompts spread the cache across the fleet
//!    (`below_threshold`);
//! 5. empty prompt → least-loaded (`fallback`).
//!
//! Ties are broken at random. A target is overloaded when it has more than
//! [`OVERLOAD_ABS`] requests in flight beyond the least-loaded eligible target AND more
//! than [`OVERLOAD_RATIO`] × that target's load. After forwarding, the prompt is
//! inserted into the winner's trie ([`Strategy::record`]).

use super::{pick_random, Decision, FleetView, Reason, RouteInput, Strategy};

/// Default minimum prefix score to pin a request to its best-matching target (SPEC §4).
pub const DEFAULT_CACHE_THRESHOLD: f64 = 0.5;
/// Overload guard, absolute part: in flight beyond the least-loaded target (SPEC §4).
pub const OVERLOAD_ABS: u64 = 2;
/// Overload guard, relative part: multiple of the least-loaded target's load (SPEC §4).
pub const OVERLOAD_RATIO: f64 = 1.5;

/// The cache-aware strategy.
#[derive(Debug)]
pub struct CacheAware {
    threshold: f64,
}

impl CacheAware {
    /// A strategy pinning at `threshold` (0..=1).
    pub fn new(threshold: f64) -> Self {
        CacheAware { threshold }
    }
}

impl Default for CacheAware {
    fn default() -> Self {
        CacheAware::new(DEFAULT_CACHE_THRESHOLD)
    }
}

/// Whether `inflight` counts as overloaded next to the least-loaded eligible target.
pub fn overloaded(inflight: u64, min_inflight: u64) -> bool {
    inflight > min_inflight + OVERLOAD_ABS && inflight as f64 > OVERLOAD_RATIO * min_inflight as f64
}

/// Each eligible target's prefix score for `prompt`, as (index, score).
pub fn prefix_scores<'a>(
    prompt: &'a [u8],
    fleet: &'a FleetView<'a>,
) -> impl Iterator<Item = (usize, f64)> + 'a {
    fleet.eligible().map(move |i| {
        let matched = fleet.candidates[i]
            .prefix
            .map_or(0, |t| t.match_len(prompt));
        (i, matched as f64 / prompt.len().max(1) as f64)
    })
}

/// Least-loaded eligible target; among equally loaded ones the least warmed.
pub fn least_loaded_then_coldest(fleet: &FleetView) -> Option<usize> {
    let min = fleet.min_inflight()?;
    let warmth = |i: usize| fleet.candidates[i].prefix.map_or(0, |t| t.byte_count());
    let least: Vec<usize> = fleet
        .eligible()
        .filter(|&i| fleet.candidates[i].inflight == min)
        .collect();
    let coldest = least.iter().map(|&i| warmth(i)).min()?;
    pick_random(least.into_iter().filter(|&i| warmth(i) == coldest))
}

impl Strategy for CacheAware {
    fn name(&self) -> &'static str {
        "cache_aware"
    }

    fn select(&self, input: &RouteInput, fleet: &FleetView) -> Option<Decision> {
        let min = fleet.min_inflight()?;
        if input.prompt.is_empty() {
            return fleet.least_loaded().map(|target| Decision {
                target,
                reason: Reason::Fallback,
                score: None,
            });
        }
        // Best score, with a uniform random pick among exact ties (reservoir).
        let mut best: Option<(usize, f64)> = None;
        let mut ties = 0usize;
        for (i, score) in prefix_scores(input.prompt, fleet) {
            match best {
                Some((_, b)) if score < b => {}
                Some((_, b)) if score == b => {
                    ties += 1;
                    if rand::Rng::gen_range(&mut rand::thread_rng(), 0..ties) == 0 {
                        best = Some((i, score));
                    }
                }
                _ => {
                    best = Some((i, score));
                    ties = 1;
                }
            }
        }
        let (best, score) = best?;
        let (target, reason) = if score >= self.threshold {
            if overloaded(fleet.candidates[best].inflight, min) {
                (fleet.least_loaded()?, Reason::Overloaded)
            } else {
                (best, Reason::CacheHit)
            }
        } else {
            (least_loaded_then_coldest(fleet)?, Reason::BelowThreshold)
        };
        Some(Decision {
            target,
            reason,
            score: Some(score),
        })
    }

    fn record(&self, input: &RouteInput, fleet: &FleetView, target: usize) {
        if let Some(trie) = fleet.candidates.get(target).and_then(|c| c.prefix) {
            trie.insert(input.prompt);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix::PrefixTrie;
    use crate::routing::Candidate;

    fn fleet<'a>(tries: &'a [PrefixTrie], loads: &[u64], eligible: &[bool]) -> Vec<Candidate<'a>> {
        tries
            .iter()
            .zip(loads)
            .zip(eligible)
            .map(|((t, &inflight), &eligible)| Candidate {
                inflight,
                eligible,
                weight: 1,
                prefix: Some(t),
                label: "",
                kv: None,
                lmcache: None,
            })
            .collect()
    }

    fn input(p: &[u8]) -> RouteInput<'_> {
        RouteInput {
            prompt: p,
            ..Default::default()
        }
    }

    fn tries(n: usize) -> Vec<PrefixTrie> {
        (0..n).map(|_| PrefixTrie::new(10_000)).collect()
    }

    #[test]
    fn overload_rule_matches_the_spec() {
        assert!(!overloaded(2, 0), "2 beyond 0 is not more than 2");
        assert!(overloaded(3, 0));
        assert!(!overloaded(6, 4), "needs more than 2 beyond");
        assert!(!overloaded(15, 10), "15 is not more than 1.5 × 10");
        assert!(overloaded(16, 10));
    }

    #[test]
    fn cache_hit_pins_to_the_warm_target() {
        let t = tries(3);
        t[1].insert(b"system: long shared prompt. user: hi");
        let c = fleet(&t, &[0, 1, 0], &[true; 3]);
        let d = CacheAware::default()
            .select(
                &input(b"system: long shared prompt. user: hello"),
                &FleetView::new(&c),
            )
            .unwrap();
        assert_eq!((d.target, d.reason), (1, Reason::CacheHit));
        assert!(d.score.unwrap() > 0.8);
    }

    #[test]
    fn below_threshold_goes_least_loaded_then_least_warmed() {
        let t = tries(3);
        t[0].insert(b"abc");
        t[1].insert(&[b'q'; 100]);
        let c = fleet(&t, &[0, 0, 1], &[true; 3]);
        let cs = CacheAware::default();
        for _ in 0..20 {
            let d = cs
                .select(&input(b"abzzzzzzzzzzzz"), &FleetView::new(&c))
                .unwrap();
            assert_eq!(d.reason, Reason::BelowThreshold);
            assert_eq!(d.target, 0, "0 and 1 are least loaded; 0 holds fewer bytes");
        }
    }

    #[test]
    fn overloaded_best_target_falls_back_to_least_loaded() {
        let t = tries(2);
        t[0].insert(b"shared prefix and more");
        let c = fleet(&t, &[5, 1], &[true, true]);
        let d = CacheAware::default()
            .select(&input(b"shared prefix and more!"), &FleetView::new(&c))
            .unwrap();
        assert_eq!((d.target, d.reason), (1, Reason::Overloaded));
    }

    #[test]
    fn an_unhealthy_idle_target_does_not_make_others_look_overloaded() {
        let t = tries(3);
        t[0].insert(b"shared prefix and more");
        // Target 2 is broken with zero load; among eligible targets the minimum is 3.
        let c = fleet(&t, &[5, 3, 0], &[true, true, false]);
        let d = CacheAware::default()
            .select(&input(b"shared prefix and more!"), &FleetView::new(&c))
            .unwrap();
        assert_eq!((d.target, d.reason), (0, Reason::CacheHit));
    }

    #[test]
    fn empty_prompt_and_no_eligible_target() {
        let t = tries(2);
        let c = fleet(&t, &[1, 0], &[true, true]);
        let d = CacheAware::default()
            .select(&input(b""), &FleetView::new(&c))
            .unwrap();
        assert_eq!((d.target, d.reason), (1, Reason::Fallback));
        let none = fleet(&t, &[0, 0], &[false, false]);
        assert!(CacheAware::default()
            .select(&input(b"x"), &FleetView::new(&none))
            .is_none());
    }

    #[test]
    fn ties_are_broken_at_random() {
        let t = tries(2);
        t[0].insert(b"same prefix here");
        t[1].insert(b"same prefix here");
        let c = fleet(&t, &[0, 0], &[true, true]);
        let mut seen = [0; 2];
        for _ in 0..200 {
            let d = CacheAware::default()
                .select(&input(b"same prefix here too"), &FleetView::new(&c))
                .unwrap();
            seen[d.target] += 1;
        }
        assert!(seen[0] > 20 && seen[1] > 20, "{seen:?}");
    }

    /// A burst of new conversations sharing one system prompt spreads across the fleet
    /// (overload guard), while each conversation's later turns return to the target that
    /// served its earlier turns.
    #[test]
    fn burst_sharing_a_system_prompt_spreads_but_conversations_stick() {
        let t = tries(4);
        let cs = CacheAware::default();
        let system = "S".repeat(2000);
        let mut load = [0u64; 4];
        let mut home = Vec::new();
        // 16 conversations arrive at once (none finishes): turn 1.
        for conv in 0..16 {
            let prompt = format!("{system}|user {conv}: first question");
            let c = fleet(&t, &load, &[true; 4]);
            let view = FleetView::new(&c);
            let d = cs.select(&input(prompt.as_bytes()), &view).unwrap();
            cs.record(&input(prompt.as_bytes()), &view, d.target);
            load[d.target] += 1;
            home.push(d.target);
        }
        assert!(load.iter().all(|&l| l >= 2), "burst not spread: {load:?}");
        assert!(
            load.iter().max().unwrap() - load.iter().min().unwrap() <= 3,
            "{load:?}"
        );
        // Everyone finishes; later turns extend each conversation and go home.
        let load = [0u64; 4];
        for (conv, &h) in home.iter().enumerate() {
            let prompt =
                format!("{system}|user {conv}: first question|assistant: answer|user: follow-up");
            let c = fleet(&t, &load, &[true; 4]);
            let d = cs
                .select(&input(prompt.as_bytes()), &FleetView::new(&c))
                .unwrap();
            assert_eq!(d.reason, Reason::CacheHit);
            assert_eq!(d.target, h, "conversation {conv} left its cached target");
        }
    }
}
