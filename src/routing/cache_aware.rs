//! `cache_aware`: send a request to the target whose prefix trie already holds the most
//! of its prompt, unless that target is overloaded (SPEC §4).
//!
//! Rule, over eligible targets only (a broken replica's empty queue never makes the
//! others look busy):
//! 1. score = longest stored prefix / prompt length, per target;
//! 2. best score ≥ threshold and the best target not overloaded → pin to it (`cache_hit`);
//!    among targets sharing the best score, the least loaded;
//! 3. best score ≥ threshold but overloaded → least-loaded (`overloaded`); among equally
//!    loaded targets, one that itself scores ≥ threshold (the highest, e.g. one holding the
//!    conversation's system prompt), else the least warmed;
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
use crate::prefix::MatchHint;

/// Default minimum prefix score to pin a request to its best-matching target (SPEC §4).
pub const DEFAULT_CACHE_THRESHOLD: f64 = 0.5;
/// Overload guard, absolute part: in flight beyond the least-loaded target (SPEC §4).
pub const OVERLOAD_ABS: u64 = 2;
/// Overload guard, relative part: multiple of the least-loaded target's load (SPEC §4).
pub const OVERLOAD_RATIO: f64 = 1.5;

/// Default prompt bytes per token: English text averages about 4 characters per BPE token
/// (OpenAI's rule of thumb); the chat encoding adds a few bytes per message.
pub const DEFAULT_PROMPT_BYTES_PER_TOKEN: f64 = 4.0;
/// Distinct prompt bytes a trie node holds on average when filled with chat prompts:
/// `src/prefix/trie.rs` measures 96.1 B of memory per node and 1.64 B per stored byte.
pub const TRIE_PROMPT_BYTES_PER_NODE: f64 = 96.1 / 1.64;

/// Node cap of a target's prefix trie so that it holds about as many distinct prompt bytes
/// as its replica's KV cache holds tokens (`kv_cache_tokens` × `bytes_per_token`), never above
/// `route_cap`. The trie's LRU then forgets what the replica's LRU has likely evicted, instead
/// of scoring on prompts long gone from the replica; without a capacity, `route_cap`.
pub fn trie_nodes_for_kv_cache(
    kv_cache_tokens: Option<u64>,
    bytes_per_token: f64,
    route_cap: usize,
) -> usize {
    match kv_cache_tokens {
        Some(tokens) => {
            let nodes = (tokens as f64 * bytes_per_token / TRIE_PROMPT_BYTES_PER_NODE).ceil();
            (nodes as usize).clamp(2, route_cap.max(2))
        }
        None => route_cap,
    }
}

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
    prefix_scores_hinted(prompt, fleet).map(|(i, score, _)| (i, score))
}

/// `prefix_scores` with each target's trie walk result, for `PrefixTrie::insert_hinted`.
pub fn prefix_scores_hinted<'a>(
    prompt: &'a [u8],
    fleet: &'a FleetView<'a>,
) -> impl Iterator<Item = (usize, f64, Option<MatchHint>)> + 'a {
    fleet.eligible().map(move |i| {
        let (matched, hint) = fleet.candidates[i]
            .prefix
            .map_or((0, None), |t| t.match_hinted(prompt));
        (i, matched as f64 / prompt.len().max(1) as f64, hint)
    })
}

/// Least-loaded eligible target; among equally loaded ones the least warmed.
pub fn least_loaded_then_coldest(fleet: &FleetView) -> Option<usize> {
    let min = fleet.min_inflight()?;
    // Each trie's size read once: other threads insert concurrently, and a second read
    // could leave no target equal to the minimum of the first.
    let least: Vec<(usize, usize)> = fleet
        .eligible()
        .filter(|&i| fleet.candidates[i].inflight == min)
        .map(|i| (i, fleet.candidates[i].prefix.map_or(0, |t| t.byte_count())))
        .collect();
    let coldest = least.iter().map(|&(_, warmth)| warmth).min()?;
    pick_random(
        least
            .into_iter()
            .filter(|&(_, warmth)| warmth == coldest)
            .map(|(i, _)| i),
    )
}

/// Among `scored` targets, one with the fewest in flight, at random.
fn least_loaded_of<'s>(
    fleet: &FleetView,
    scored: impl Iterator<Item = &'s (usize, f64)> + Clone,
) -> Option<usize> {
    let load = |i: usize| fleet.candidates[i].inflight;
    let min = scored.clone().map(|&(i, _)| load(i)).min()?;
    pick_random(scored.filter(|&&(i, _)| load(i) == min).map(|&(i, _)| i))
}

/// Where a request goes when its best target is overloaded: the least-loaded eligible
/// target; among equally loaded ones, one that itself holds at least `threshold` of the
/// prompt (the highest score, e.g. the conversation's system prompt), else the least warmed.
/// Returns the target and its score.
fn overflow_target(
    fleet: &FleetView,
    scored: &[(usize, f64)],
    threshold: f64,
) -> Option<(usize, f64)> {
    let min = fleet.min_inflight()?;
    let warm: Vec<(usize, f64)> = scored
        .iter()
        .copied()
        .filter(|&(i, s)| fleet.candidates[i].inflight == min && s >= threshold)
        .collect();
    let top = warm
        .iter()
        .map(|&(_, s)| s)
        .fold(f64::NEG_INFINITY, f64::max);
    let target = match pick_random(warm.iter().filter(|&&(_, s)| s == top).map(|&(i, _)| i)) {
        Some(t) => t,
        None => least_loaded_then_coldest(fleet)?,
    };
    let score = scored
        .iter()
        .find(|&&(i, _)| i == target)
        .map_or(0.0, |&(_, s)| s);
    Some((target, score))
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
                hint: None,
            });
        }
        let mut hints = Vec::with_capacity(fleet.candidates.len());
        let scored: Vec<(usize, f64)> = prefix_scores_hinted(input.prompt, fleet)
            .map(|(i, score, hint)| {
                hints.push((i, hint));
                (i, score)
            })
            .collect();
        // The chosen target's walk, handed to `record` so its insert starts where it stopped.
        let hint_for = |target: usize| hints.iter().find(|&&(i, _)| i == target)?.1;
        let best_score = scored
            .iter()
            .map(|&(_, s)| s)
            .fold(f64::NEG_INFINITY, f64::max);
        let (target, reason, score) = if best_score < self.threshold {
            // Cold (or only trivially shared, e.g. the chat template) prompts spread the cache.
            (
                least_loaded_then_coldest(fleet)?,
                Reason::BelowThreshold,
                best_score,
            )
        } else {
            // Among targets sharing the best score, the least loaded (then at random).
            let best = least_loaded_of(fleet, scored.iter().filter(|&&(_, s)| s == best_score))?;
            if overloaded(fleet.candidates[best].inflight, min) {
                let (target, score) = overflow_target(fleet, &scored, self.threshold)?;
                (target, Reason::Overloaded, score)
            } else {
                (best, Reason::CacheHit, best_score)
            }
        };
        Some(Decision {
            target,
            reason,
            score: Some(score),
            hint: hint_for(target),
        })
    }

    fn record(&self, input: &RouteInput, fleet: &FleetView, decision: &Decision) {
        if let Some(trie) = fleet.candidates.get(decision.target).and_then(|c| c.prefix) {
            trie.insert_hinted(input.prompt, decision.hint);
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

    #[test]
    fn equally_warm_targets_prefer_the_least_loaded() {
        let t = tries(3);
        t[0].insert(b"same prefix here");
        t[1].insert(b"same prefix here");
        // 0 and 1 tie on score; 1 has fewer in flight; 2 is idle but cold.
        let c = fleet(&t, &[2, 1, 0], &[true; 3]);
        for _ in 0..50 {
            let d = CacheAware::default()
                .select(&input(b"same prefix here too"), &FleetView::new(&c))
                .unwrap();
            assert_eq!((d.target, d.reason), (1, Reason::CacheHit));
        }
    }

    #[test]
    fn overloaded_goes_to_the_least_loaded_target_holding_most_of_the_prompt() {
        let t = tries(3);
        let system = "S".repeat(200);
        let conversation = format!("{system}|user 1: hello|assistant: hi|user 1: more");
        t[0].insert(conversation.as_bytes());
        t[1].insert(format!("{system}|user 2: other question").as_bytes());
        t[2].insert(b"unrelated");
        // 0 is overloaded (5 > 1 + 2 and 5 > 1.5); 1 and 2 are equally least loaded and 1
        // holds the system prompt.
        let c = fleet(&t, &[5, 1, 1], &[true; 3]);
        let prompt = format!("{conversation}|assistant: ok|user 1: again");
        for _ in 0..50 {
            let d = CacheAware::default()
                .select(&input(prompt.as_bytes()), &FleetView::new(&c))
                .unwrap();
            assert_eq!((d.target, d.reason), (1, Reason::Overloaded));
            assert!(d.score.unwrap() > 0.5, "{d:?}");
        }
        // Load still comes first: a less loaded cold target beats a warmer busier one.
        let c = fleet(&t, &[5, 2, 1], &[true; 3]);
        let d = CacheAware::default()
            .select(&input(prompt.as_bytes()), &FleetView::new(&c))
            .unwrap();
        assert_eq!((d.target, d.reason), (2, Reason::Overloaded));
    }

    /// Chat prompts all share a few template bytes: a trivial partial match must not
    /// pull every cold conversation onto the warmest target.
    #[test]
    fn below_threshold_ignores_a_trivial_partial_match() {
        let t = tries(3);
        t[0].insert(format!("You are assistant 0. {}", "x".repeat(500)).as_bytes());
        let prompt = format!("You are assistant 1. {}", "y".repeat(500));
        let c = fleet(&t, &[0, 0, 0], &[true; 3]);
        for _ in 0..50 {
            let d = CacheAware::default()
                .select(&input(prompt.as_bytes()), &FleetView::new(&c))
                .unwrap();
            assert_eq!(d.reason, Reason::BelowThreshold);
            assert_ne!(d.target, 0, "the warm target took a cold conversation");
        }
    }

    #[test]
    fn overloaded_with_no_other_warm_target_goes_least_warmed() {
        let t = tries(3);
        let system = "S".repeat(200);
        t[0].insert(format!("{system}|user 1").as_bytes());
        t[1].insert(&[b'S'; 60]);
        t[2].insert(b"z");
        // 1 shares 60 of ~210 bytes (below threshold): no better than the colder 2.
        let c = fleet(&t, &[5, 1, 1], &[true; 3]);
        for _ in 0..30 {
            let d = CacheAware::default()
                .select(
                    &input(format!("{system}|user 1 again").as_bytes()),
                    &FleetView::new(&c),
                )
                .unwrap();
            assert_eq!((d.target, d.reason), (2, Reason::Overloaded));
        }
    }

    #[test]
    fn trie_cap_follows_the_replica_kv_cache() {
        // No capacity known: the route's cap.
        assert_eq!(trie_nodes_for_kv_cache(None, 4.0, 1_000_000), 1_000_000);
        // 8,192 tokens × 6 B ≈ 49 KB of prompt ≈ 839 nodes of ~58.6 B.
        let n = trie_nodes_for_kv_cache(Some(8192), 6.0, 1_000_000);
        assert!((830..=850).contains(&n), "{n}");
        // Twice the cache, twice the nodes; never above the route's cap, never below 2.
        let n2 = trie_nodes_for_kv_cache(Some(16384), 6.0, 1_000_000);
        assert!(n2.abs_diff(2 * n) <= 1, "{n} {n2}");
        assert_eq!(trie_nodes_for_kv_cache(Some(1 << 40), 4.0, 5000), 5000);
        assert_eq!(trie_nodes_for_kv_cache(Some(0), 4.0, 5000), 2);
    }

    /// A trie sized to its replica's cache forgets the oldest conversations as the replica
    /// would, so a prompt seen long ago no longer pins a request there.
    #[test]
    fn a_trie_sized_to_the_cache_forgets_old_prompts() {
        let cap = trie_nodes_for_kv_cache(Some(512), 4.0, 1_000_000);
        let t = PrefixTrie::new(cap);
        let old = format!("old {}", "o".repeat(1000));
        t.insert(old.as_bytes());
        assert_eq!(t.match_len(old.as_bytes()), old.len());
        for i in 0..8 {
            t.insert(format!("new {i} {}", "n".repeat(1000)).as_bytes());
        }
        assert_eq!(
            t.match_len(old.as_bytes()),
            0,
            "8 KB of newer prompts evicted it"
        );
        assert!(t.node_count() <= cap);
        // An unsized trie still holds it.
        let big = PrefixTrie::new(trie_nodes_for_kv_cache(None, 4.0, 1_000_000));
        big.insert(old.as_bytes());
        for i in 0..8 {
            big.insert(format!("new {i} {}", "n".repeat(1000)).as_bytes());
        }
        assert_eq!(big.match_len(old.as_bytes()), old.len());
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
            cs.record(&input(prompt.as_bytes()), &view, &d);
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

    /// Other threads insert into (and evict from) the tries while a cold prompt is routed:
    /// every decision still names a target. (Reading a trie's byte count once for the
    /// minimum and again to filter let a concurrent insert leave no target at the minimum,
    /// and the gateway answered 503 "no eligible target".)
    #[test]
    fn concurrent_inserts_never_leave_a_cold_prompt_without_a_target() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::time::{Duration, Instant};
        let t: Vec<PrefixTrie> = (0..2).map(|_| PrefixTrie::new(200)).collect();
        let c = fleet(&t, &[0, 0], &[true, true]);
        let view = FleetView::new(&c);
        let cs = CacheAware::default();
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let p = format!("writer {n} {}", "w".repeat((n % 7 * 40) as usize));
                    t[(n % 2) as usize].insert(p.as_bytes());
                }
            });
            let deadline = Instant::now() + Duration::from_secs(2);
            let mut decisions = 0u64;
            while Instant::now() < deadline && decisions < 2_000_000 {
                decisions += 1;
                let d = cs.select(&input(b"a cold prompt nobody has sent"), &view);
                if d.is_none() {
                    stop.store(true, Ordering::Relaxed);
                    panic!("decision {decisions}: no target while the tries changed");
                }
            }
            stop.store(true, Ordering::Relaxed);
        });
    }
}
