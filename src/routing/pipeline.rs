//! `pipeline`: filter → score → argmax, with session affinity (SPEC §4, issue 5).
//!
//! 1. **Filter**: only eligible targets (healthy, not cooling down, circuit not open)
//!    that this request has not already tried.
//! 2. **Affinity**: a request with `x-session-id` goes to the target that last served
//!    that session (within the TTL) if it passed the filter and is not overloaded
//!    (the cache_aware overload rule) — reason `affinity`.
//! 3. **Score** each remaining target:
//!    `w_weight · key + w_load · load + w_prefix · prefix`, where
//!    - `prefix` = the cache_aware score (longest cached prefix / prompt length),
//!    - `load` = 1 − inflight / (max inflight among the filtered targets), 1 when all are idle,
//!    - `key` = u^(1/weight) for u uniform in (0, 1) — the Efraimidis–Spirakis weighted
//!      sampling key, in [0, 1): when the other terms tie (cold caches, equal load) the
//!      argmax picks a target with probability weight / Σ weights, so `weight = 2`
//!      really means twice the traffic, while a deterministic weight term would send
//!      *all* cold traffic to the heaviest target.
//! 4. **Argmax** (exact ties broken at random) — reason `scored`.
//!
//! After forwarding, the prompt goes into the winner's trie and the session is pinned
//! to the winner.

use super::cache_aware::{overloaded, prefix_scores};
use super::session::SessionTable;
use super::{pick_random, Decision, FleetView, Reason, RouteInput, Strategy};
use rand::Rng;
use std::sync::Arc;

/// Term weights of the pipeline score.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PipelineWeights {
    /// Weight of the (randomised) static-weight term.
    pub static_weight: f64,
    /// Weight of the load term.
    pub load: f64,
    /// Weight of the prefix-affinity term.
    pub prefix: f64,
}

impl Default for PipelineWeights {
    /// Prefix reuse matters most; load spreads cold traffic; the static weight biases
    /// among otherwise equal targets without overriding a cache hit (its term ≤ 0.2,
    /// while a warm prefix of a long prompt is worth up to 1.0).
    fn default() -> Self {
        PipelineWeights {
            static_weight: 0.2,
            load: 0.5,
            prefix: 1.0,
        }
    }
}

/// The pipeline strategy.
#[derive(Debug)]
pub struct Pipeline {
    weights: PipelineWeights,
    sessions: Arc<SessionTable>,
}

impl Pipeline {
    /// A pipeline with these term weights and this (reload-surviving) session table.
    pub fn new(weights: PipelineWeights, sessions: Arc<SessionTable>) -> Self {
        Pipeline { weights, sessions }
    }

    fn affinity(&self, input: &RouteInput, fleet: &FleetView, min: u64) -> Option<usize> {
        let pinned = self.sessions.get(input.session_id?, input.now_ms)?;
        fleet
            .eligible()
            .find(|&i| fleet.candidates[i].label == &*pinned)
            .filter(|&i| !overloaded(fleet.candidates[i].inflight, min))
    }
}

impl Strategy for Pipeline {
    fn name(&self) -> &'static str {
        "pipeline"
    }

    fn select(&self, input: &RouteInput, fleet: &FleetView) -> Option<Decision> {
        let min = fleet.min_inflight()?;
        if let Some(target) = self.affinity(input, fleet, min) {
            return Some(Decision {
                target,
                reason: Reason::Affinity,
                score: None,
                hint: None,
            });
        }
        let max_load = fleet
            .eligible()
            .map(|i| fleet.candidates[i].inflight)
            .max()
            .unwrap_or(0);
        let mut rng = rand::thread_rng();
        let w = self.weights;
        let scored: Vec<(usize, f64, f64)> = prefix_scores(input.prompt, fleet)
            .map(|(i, prefix)| {
                let c = &fleet.candidates[i];
                let load = if max_load == 0 {
                    1.0
                } else {
                    1.0 - c.inflight as f64 / max_load as f64
                };
                let u: f64 = rng.gen_range(f64::MIN_POSITIVE..1.0);
                let key = u.powf(1.0 / f64::from(c.weight.max(1)));
                (
                    i,
                    w.static_weight * key + w.load * load + w.prefix * prefix,
                    prefix,
                )
            })
            .collect();
        let best = scored.iter().map(|s| s.1).fold(f64::NEG_INFINITY, f64::max);
        let target = pick_random(scored.iter().filter(|s| s.1 == best).map(|s| s.0))?;
        let prefix = scored.iter().find(|s| s.0 == target).map(|s| s.2);
        Some(Decision {
            target,
            reason: Reason::Scored,
            score: prefix,
            hint: None,
        })
    }

    fn uses_session_id(&self) -> bool {
        true
    }

    fn record(&self, input: &RouteInput, fleet: &FleetView, decision: &Decision) {
        let target = decision.target;
        let Some(c) = fleet.candidates.get(target) else {
            return;
        };
        if let Some(trie) = c.prefix {
            trie.insert(input.prompt);
        }
        if let Some(session) = input.session_id {
            self.sessions.put(session, c.label, input.now_ms);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix::PrefixTrie;
    use crate::routing::Candidate;

    const LABELS: [&str; 4] = ["t0", "t1", "t2", "t3"];

    fn fleet<'a>(
        tries: &'a [PrefixTrie],
        loads: &[u64],
        weights: &[u32],
        eligible: &[bool],
    ) -> Vec<Candidate<'a>> {
        (0..tries.len())
            .map(|i| Candidate {
                inflight: loads[i],
                eligible: eligible[i],
                weight: weights[i],
                prefix: Some(&tries[i]),
                label: LABELS[i],
                kv: None,
                lmcache: None,
            })
            .collect()
    }

    fn tries(n: usize) -> Vec<PrefixTrie> {
        (0..n).map(|_| PrefixTrie::new(10_000)).collect()
    }

    fn pipeline() -> Pipeline {
        Pipeline::new(
            PipelineWeights::default(),
            Arc::new(SessionTable::new(10, 1000)),
        )
    }

    fn input<'a>(prompt: &'a [u8], session: Option<&'a str>, now_ms: u64) -> RouteInput<'a> {
        RouteInput {
            prompt,
            session_id: session,
            now_ms,
            ..Default::default()
        }
    }

    /// 3,000 cold, equal-load decisions: a weight-2 target gets 2/3 ± 0.04 (the
    /// binomial standard deviation is 0.0086, so this is over 4.5 σ).
    #[test]
    fn weight_two_gets_about_two_thirds_of_cold_equal_load_traffic() {
        let t = tries(2);
        let c = fleet(&t, &[0, 0], &[2, 1], &[true, true]);
        let p = pipeline();
        let n = 3_000;
        let heavy = (0..n)
            .filter(|i| {
                let prompt = format!("unique prompt {i}");
                p.select(&input(prompt.as_bytes(), None, 0), &FleetView::new(&c))
                    .unwrap()
                    .target
                    == 0
            })
            .count();
        let share = heavy as f64 / n as f64;
        assert!((share - 2.0 / 3.0).abs() < 0.04, "weight-2 share {share}");
    }

    #[test]
    fn load_term_moves_traffic_away_from_a_busy_target() {
        let t = tries(2);
        let c = fleet(&t, &[8, 1], &[1, 1], &[true, true]);
        let p = pipeline();
        let busy = (0..500)
            .filter(|_| {
                p.select(&input(b"cold", None, 0), &FleetView::new(&c))
                    .unwrap()
                    .target
                    == 0
            })
            .count();
        assert_eq!(
            busy, 0,
            "load term 0.5·(1−1/8) beats any weight-key difference (≤ 0.2)"
        );
    }

    #[test]
    fn prefix_term_prefers_the_warm_target() {
        let t = tries(2);
        t[1].insert(b"a long shared system prompt, then the question");
        let c = fleet(&t, &[0, 0], &[1, 1], &[true, true]);
        let d = pipeline()
            .select(
                &input(
                    b"a long shared system prompt, then another question",
                    None,
                    0,
                ),
                &FleetView::new(&c),
            )
            .unwrap();
        assert_eq!((d.target, d.reason), (1, Reason::Scored));
        assert!(d.score.unwrap() > 0.5);
    }

    /// A decision for `target`, as `record` receives it.
    fn chose(target: usize) -> Decision {
        Decision {
            target,
            reason: Reason::Scored,
            score: None,
            hint: None,
        }
    }

    #[test]
    fn affinity_holds_within_ttl_and_breaks_after_it_or_when_ineligible() {
        let t = tries(3);
        let p = pipeline();
        let all = fleet(&t, &[0, 0, 0], &[1, 1, 1], &[true; 3]);
        let view = FleetView::new(&all);
        p.record(&input(b"x", Some("s1"), 0), &view, &chose(2));
        for now in [1, 5_000, 9_999] {
            let d = p
                .select(&input(b"anything", Some("s1"), now), &view)
                .unwrap();
            assert_eq!((d.target, d.reason), (2, Reason::Affinity));
        }
        let d = p
            .select(&input(b"anything", Some("s1"), 10_000), &view)
            .unwrap();
        assert_eq!(d.reason, Reason::Scored, "TTL of 10 s passed");

        p.record(&input(b"x", Some("s2"), 0), &view, &chose(1));
        let sick = fleet(&t, &[0, 0, 0], &[1, 1, 1], &[true, false, true]);
        let d = p
            .select(&input(b"x", Some("s2"), 1), &FleetView::new(&sick))
            .unwrap();
        assert_eq!(d.reason, Reason::Scored);
        assert_ne!(d.target, 1);
        // The session moves with the new choice.
        p.record(&input(b"x", Some("s2"), 1), &FleetView::new(&sick), &d);
        let d2 = p.select(&input(b"x", Some("s2"), 2), &view).unwrap();
        assert_eq!((d2.target, d2.reason), (d.target, Reason::Affinity));

        // An overloaded pinned target loses the session too.
        let busy = fleet(&t, &[0, 0, 9], &[1, 1, 1], &[true; 3]);
        p.record(&input(b"x", Some("s3"), 0), &view, &chose(2));
        let d = p
            .select(&input(b"x", Some("s3"), 1), &FleetView::new(&busy))
            .unwrap();
        assert_ne!(d.target, 2);
    }

    #[test]
    fn exact_ties_are_broken_at_random() {
        let t = tries(2);
        // Zero static weight: both targets score exactly the same.
        let p = Pipeline::new(
            PipelineWeights {
                static_weight: 0.0,
                ..Default::default()
            },
            Arc::new(SessionTable::new(10, 10)),
        );
        let c = fleet(&t, &[0, 0], &[1, 1], &[true, true]);
        let mut seen = [0; 2];
        for _ in 0..200 {
            seen[p
                .select(&input(b"q", None, 0), &FleetView::new(&c))
                .unwrap()
                .target] += 1;
        }
        assert!(seen[0] > 20 && seen[1] > 20, "{seen:?}");
    }
}
