//! `pipeline`: filter → score → argmax, with session affinity (SPEC §4, issue 5) and a
//! bound on the share of new conversations a busy target takes.
//!
//! 1. **Filter**: only eligible targets (healthy, not cooling down, circuit not open)
//!    that this request has not already tried.
//! 2. **Affinity**: a request with `x-session-id` goes to the target that last served
//!    that session (within the TTL) if it passed the filter and is not truly
//!    overloaded (the placement rule's guard for a conversation's own target: more than
//!    2 × `balance_abs` beyond the least loaded and more than `balance_rel` × its load)
//!    — reason `affinity`.
//! 3. **Score** each remaining target:
//!    `w_weight · key + w_load · load + w_prefix · prefix`, where
//!    - `prefix` = the cache_aware score (longest cached prefix / prompt length), counted
//!      as the placement rule counts it (below `cache_threshold` and under 256 tokens: 0),
//!    - `load` = −`load_cost_tokens` × (inflight − least inflight) / prompt tokens: the
//!      placement rule's queue cost on the same scale as `prefix`, so with the default
//!      weights (1, 1) the score is minus the placement rule's cost per prompt token,
//!    - `key` = u^(1/weight) with u in (0, 1) drawn from a hash of the conversation (its
//!      session id, else its first two messages; its first message while no target holds
//!      any of the prompt, so a new group lands together) and the target's label — the
//!      Efraimidis–Spirakis weighted sampling key made deterministic (weighted
//!      rendezvous hashing): over many conversations a target wins cold ties with
//!      probability weight / Σ weights, so `weight = 2` really means twice the traffic,
//!      while one conversation's choice is the same on every gateway.
//! 4. **Argmax** (exact ties broken by label order) — reason `scored`.
//! 5. **Share bound** (new work only: a prompt no target holds history of beyond its
//!    first message): a winner already given more than `share_bound` × the mean of the
//!    recent new work (the placement rule's cap, [`PlacementRule::share_cap_over`]) and
//!    with at least `ceil(load_bound × mean)` in flight (counting this request, never
//!    below the least loaded + 2) gives way to the argmax among targets within both
//!    bounds whose cache holds the prompt twice (its `kv_cache_tokens`; unknown counts as
//!    big enough), among those holding the prefix or given about the least — reason
//!    `share_bound`. Either bound at 0 turns this step off. A conversation brings its
//!    later turns to where it started, so a target handed more than its share of new
//!    conversations ends up serving more than its share of requests. Both bounds, because
//!    a spill costs the conversation's prefix: a hot prompt's replica a little over its
//!    share but not loaded keeps it (on one hot system prompt at 60% of the traffic, the
//!    share bound alone lost hit rate for no gain in TTFT). Under cache pressure it never
//!    spills: without group homes a holder of the prefix may host another group.
//! 6. **Overload guard**: when the target is truly overloaded (the placement rule's guard,
//!    twice the margin for a conversation's own target), the argmax among targets within
//!    `balance_abs / 2` of the least loaded — reason `overloaded`.
//!
//! When the request is routed, the prompt goes into the winner's trie and the session is
//! pinned to the winner.

use super::cache_aware::{prefix_scores, prompt_key_of};
use super::placement::{
    cache_crowded, has_room_for_a_home, rendezvous, PlacementRule, CONTINUATION_MIN_TOKENS,
};
use super::session::SessionTable;
use super::{Decision, FleetView, Reason, RouteInput, Strategy};
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
    /// Prefix and load on the placement rule's cost scale (weights 1, 1); the static weight
    /// biases among nearly equal targets without overriding a cache hit (its term ≤ 0.2,
    /// while a warm prefix of a long prompt is worth up to 1.0).
    fn default() -> Self {
        PipelineWeights {
            static_weight: 0.2,
            load: 1.0,
            prefix: 1.0,
        }
    }
}

/// Default of `balance_abs` for the pipeline strategy: the placement rule's own default
/// (5) costs pipeline hit rate under cache pressure (`docs/routing.md`, "The placement
/// rule").
pub const DEFAULT_PIPELINE_BALANCE_ABS: u64 = 6;

/// The pipeline strategy.
#[derive(Debug)]
pub struct Pipeline {
    weights: PipelineWeights,
    sessions: Arc<SessionTable>,
    guard: PlacementRule,
    bytes_per_token: f64,
}

impl Pipeline {
    /// A pipeline with these term weights, this (reload-surviving) session table, the
    /// threshold, load cost and overload guard of `guard`, estimating tokens as prompt
    /// bytes / `bytes_per_token`.
    pub fn new(
        weights: PipelineWeights,
        sessions: Arc<SessionTable>,
        guard: PlacementRule,
        bytes_per_token: f64,
    ) -> Self {
        Pipeline {
            weights,
            sessions,
            guard,
            bytes_per_token: bytes_per_token.max(f64::MIN_POSITIVE),
        }
    }

    fn affinity(&self, input: &RouteInput, fleet: &FleetView, min: u64) -> Option<usize> {
        let pinned = self.sessions.get(input.session_id?, input.now_ms)?;
        let margin = self.guard.balance_abs.saturating_mul(2);
        fleet
            .eligible()
            .find(|&i| fleet.candidates[i].label == &*pinned)
            .filter(|&i| {
                !self
                    .guard
                    .overloaded(fleet.candidates[i].inflight, min, margin)
            })
    }

    /// Where new work goes instead of `winner` when `winner` was given more than the share
    /// bound's cap of the recent new work ([`PlacementRule::share_cap_over`]) and has at
    /// least the load bound's count in flight ([`PlacementRule::new_work_bound_over`]:
    /// `ceil(load_bound × mean)` counting this request, never below the least loaded + 2):
    /// the best-scored target within both bounds whose cache holds the prompt beside
    /// another of its size, among those holding the prompt's prefix or given no more than
    /// the mean and about as little as any (the placement rule's rule 8). None to keep
    /// `winner`, and always with either bound off (0). Under cache pressure (no cache holds
    /// two such prompts) there is no spill: without group homes a holder of the prefix may
    /// be another group's replica, and a second group there has the two evict each other.
    fn share_spill(
        &self,
        fleet: &FleetView,
        scored: &[Scored],
        winner: usize,
        (tokens, min): (f64, u64),
        argmax: &Argmax,
    ) -> Option<Scored> {
        let placed = |i: usize| fleet.candidates[i].placed;
        let inflight = |i: usize| fleet.candidates[i].inflight;
        let all = scored.iter().map(|s| placed(s.0));
        let cap = self.guard.share_cap_over(all.clone());
        let bound = self
            .guard
            .new_work_bound_over(scored.iter().map(|s| inflight(s.0)), min);
        if placed(winner) <= cap || inflight(winner) < bound {
            return None;
        }
        let can_take = |s: &&Scored| {
            placed(s.0) <= cap
                && inflight(s.0) < bound
                && !cache_crowded(fleet.candidates[s.0].cache_tokens, tokens)
        };
        let mean = all.sum::<f64>() / scored.len() as f64;
        let least = scored
            .iter()
            .filter(can_take)
            .map(|s| placed(s.0))
            .fold(f64::INFINITY, f64::min);
        argmax(
            &mut scored
                .iter()
                .filter(can_take)
                .filter(|s| s.2 > 0.0 || has_room_for_a_home(placed(s.0), mean, least)),
        )
    }
}

/// A scored target: (index, score, counted prefix fraction).
type Scored = (usize, f64, f64);

/// The best of some scored targets (exact ties broken by label order).
type Argmax<'a> = dyn Fn(&mut dyn Iterator<Item = &Scored>) -> Option<Scored> + 'a;

/// A uniform draw in (0, 1) from a 64-bit hash.
fn unit(h: u64) -> f64 {
    ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64
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
                conversation: None,
                new_work: false,
            });
        }
        let (keys, first_len) = input.placement();
        let tokens = (input.prompt_len() as f64 / self.bytes_per_token).max(1.0);
        let first_tokens = first_len as f64 / self.bytes_per_token;
        let w = self.weights;
        let lambda = self.guard.load_cost_tokens;
        // (index, counted prefix fraction)
        let key = prompt_key_of(input);
        let prefixes: Vec<(usize, f64)> = prefix_scores(input.prompt_len(), &key, fleet)
            .map(|(i, prefix)| (i, self.guard.counted(prefix * tokens, tokens) / tokens))
            .collect();
        // The weight key draws from the conversation once some target holds the prompt, and
        // from the group while none does: the conversations of a new system prompt (a burst
        // whose first request is still being sent) then land together, not scattered.
        let key_of = if prefixes.iter().any(|&(_, p)| p > 0.0) {
            keys.with_session(input.session_id).conversation
        } else {
            keys.group
        };
        let scored: Vec<Scored> = prefixes
            .into_iter()
            .map(|(i, prefix)| {
                let c = &fleet.candidates[i];
                let load = -lambda * (c.inflight - min) as f64 / tokens;
                let u = unit(rendezvous(key_of, c.label));
                let key = u.powf(1.0 / f64::from(c.weight.max(1)));
                (
                    i,
                    w.static_weight * key + w.load * load + w.prefix * prefix,
                    prefix,
                )
            })
            .collect();
        let argmax = |among: &mut dyn Iterator<Item = &Scored>| {
            among
                .max_by(|a, b| {
                    a.1.total_cmp(&b.1)
                        .then_with(|| fleet.candidates[a.0].label.cmp(fleet.candidates[b.0].label))
                })
                .copied()
        };
        let (mut target, _, mut prefix) = argmax(&mut scored.iter())?;
        let mut reason = Reason::Scored;
        let history = |prefix: f64| prefix * tokens - first_tokens > CONTINUATION_MIN_TOKENS;
        let continuation = history(prefix);
        // New work: a prompt no target holds history of beyond its first message (not a
        // pass-through request either: it has no prompt and brings no later turns).
        let new_work =
            input.prompt_len() > 0 && !scored.iter().any(|&(_, _, prefix)| history(prefix));
        if new_work {
            if let Some(other) = self.share_spill(fleet, &scored, target, (tokens, min), &argmax) {
                (target, _, prefix) = other;
                reason = Reason::ShareBound;
            }
        }
        let margin = self
            .guard
            .balance_abs
            .saturating_mul(if continuation { 2 } else { 1 });
        if self
            .guard
            .overloaded(fleet.candidates[target].inflight, min, margin)
        {
            let light = min + self.guard.balance_abs / 2;
            (target, _, prefix) = argmax(
                &mut scored
                    .iter()
                    .filter(|s| fleet.candidates[s.0].inflight <= light),
            )?;
            reason = Reason::Overloaded;
        }
        Some(Decision {
            target,
            reason,
            score: Some(prefix),
            hint: None,
            conversation: None,
            new_work,
        })
    }

    fn uses_session_id(&self) -> bool {
        true
    }

    fn uses_prompt_key(&self) -> bool {
        true
    }

    fn record(&self, input: &RouteInput, fleet: &FleetView, decision: &Decision) {
        let target = decision.target;
        let Some(c) = fleet.candidates.get(target) else {
            return;
        };
        // A pass-through request (embeddings, ...) or a prompt under one chunk keeps its
        // session with no key to store.
        let key = prompt_key_of(input);
        if let (Some(trie), false) = (c.prefix, key.is_empty()) {
            trie.insert(&key);
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
                placed: 0.0,
                cache_tokens: 0.0,
            })
            .collect()
    }

    /// Store `p` in `t` as the strategy does: by its key.
    fn store(t: &PrefixTrie, p: &[u8]) {
        t.insert(&crate::prefix::prompt_key(p));
    }

    fn tries(n: usize) -> Vec<PrefixTrie> {
        (0..n).map(|_| PrefixTrie::new(10_000)).collect()
    }

    fn pipeline() -> Pipeline {
        Pipeline::new(
            PipelineWeights::default(),
            Arc::new(SessionTable::new(10, 1000)),
            PlacementRule {
                balance_abs: DEFAULT_PIPELINE_BALANCE_ABS,
                ..Default::default()
            },
            4.0,
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
        let system = "a long shared system prompt. ".repeat(8);
        store(&t[1], format!("{system}then the question").as_bytes());
        let c = fleet(&t, &[0, 0], &[1, 1], &[true, true]);
        let d = pipeline()
            .select(
                &input(format!("{system}then another question").as_bytes(), None, 0),
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
            conversation: None,
            new_work: false,
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

        // A truly overloaded pinned target (more than 2 × balance_abs beyond the least
        // loaded) loses the session too; 12 beyond is not yet.
        let p12 = fleet(&t, &[0, 0, 12], &[1, 1, 1], &[true; 3]);
        p.record(&input(b"x", Some("s3"), 0), &view, &chose(2));
        let d = p
            .select(&input(b"x", Some("s3"), 1), &FleetView::new(&p12))
            .unwrap();
        assert_eq!((d.target, d.reason), (2, Reason::Affinity));
        let busy = fleet(&t, &[0, 0, 13], &[1, 1, 1], &[true; 3]);
        p.record(&input(b"x", Some("s3"), 0), &view, &chose(2));
        let d = p
            .select(&input(b"x", Some("s3"), 1), &FleetView::new(&busy))
            .unwrap();
        assert_ne!(d.target, 2);
    }

    /// Exact ties (no static weight term) are broken by label, not at random: every
    /// gateway makes the same choice.
    #[test]
    fn exact_ties_are_broken_the_same_way_every_time() {
        let t = tries(2);
        let p = Pipeline::new(
            PipelineWeights {
                static_weight: 0.0,
                ..Default::default()
            },
            Arc::new(SessionTable::new(10, 10)),
            PlacementRule::default(),
            4.0,
        );
        let c = fleet(&t, &[0, 0], &[1, 1], &[true, true]);
        for i in 0..50 {
            let prompt = format!("q {i}");
            let d = p
                .select(&input(prompt.as_bytes(), None, 0), &FleetView::new(&c))
                .unwrap();
            assert_eq!(d.target, 1, "the higher label wins an exact tie");
        }
    }

    /// The weight key is a hash of the conversation and the target: one conversation
    /// always draws the same keys (the same choice on every gateway), a session id
    /// replaces the prompt as the conversation.
    #[test]
    fn a_conversation_draws_the_same_weight_keys_everywhere() {
        // Every target holds the system prompt: warm, so the conversation key decides.
        let system = format!("Csystem\x1f{}\x1e", "S".repeat(400));
        let t = tries(4);
        for trie in &t {
            store(trie, system.as_bytes());
        }
        let c = fleet(&t, &[0, 0, 0, 0], &[1, 1, 1, 1], &[true; 4]);
        let (p1, p2) = (pipeline(), pipeline());
        let mut targets = std::collections::HashSet::new();
        for i in 0..40 {
            let prompt = format!("{system}user\x1fquestion {i}\x1e");
            let a = p1.select(&input(prompt.as_bytes(), None, 0), &FleetView::new(&c));
            let b = p2.select(&input(prompt.as_bytes(), None, 0), &FleetView::new(&c));
            assert_eq!(a.unwrap().target, b.unwrap().target);
            targets.insert(a.unwrap().target);
            let one = format!("{system}user\x1fone\x1e");
            let two = format!("{system}user\x1ftwo\x1e");
            let s1 = p1.select(
                &input(one.as_bytes(), Some(&prompt), 0),
                &FleetView::new(&c),
            );
            let s2 = p2.select(
                &input(two.as_bytes(), Some(&prompt), 0),
                &FleetView::new(&c),
            );
            assert_eq!(s1.unwrap().target, s2.unwrap().target, "same session id");
        }
        assert!(targets.len() >= 3, "conversations spread: {targets:?}");
    }

    /// While no target holds a prompt, its conversations draw from the group (the first
    /// message): a burst of new conversations of one system prompt lands together.
    #[test]
    fn new_conversations_of_a_cold_group_land_together() {
        let t = tries(4);
        let c = fleet(&t, &[0, 0, 0, 0], &[1, 1, 1, 1], &[true; 4]);
        let p = pipeline();
        let system = format!("Csystem\x1f{}\x1e", "G".repeat(400));
        let home = |i: usize| {
            let prompt = format!("{system}user\x1fquestion {i}\x1e");
            let session = format!("session-{i}");
            p.select(
                &input(prompt.as_bytes(), Some(&session), 0),
                &FleetView::new(&c),
            )
            .unwrap()
            .target
        };
        let first = home(0);
        assert!((1..40).all(|i| home(i) == first));
    }

    /// Bounded share: a target given more than the share bound's cap of the recent new
    /// work, and past the load bound now, passes new conversations on to one within the cap
    /// (rule 8 of `placement`), even where the prefix must be prefilled first, when that
    /// target's cache holds the prompt beside another; a conversation's later turns stay on
    /// their history.
    #[test]
    fn a_busy_target_past_its_share_of_new_work_passes_new_conversations_on() {
        let t = tries(4);
        // About 2,000 tokens: one request in flight is worth a tenth of the prompt.
        let system = format!("Csystem\x1f{}\x1e", "S".repeat(8000));
        let history = format!("{system}user\x1fq\x1eassistant\x1f{}\x1e", "A".repeat(400));
        store(&t[0], format!("{system}user\x1fearlier\x1e").as_bytes());
        store(&t[0], history.as_bytes());
        let new = |i: usize| format!("{system}user\x1fnew question {i}\x1e");
        let next = format!("{history}user\x1fand then\x1e");
        let decide = |prompt: &str, loads: [u64; 4], placed: [f64; 4], cache_tokens: f64| {
            let mut c = fleet(&t, &loads, &[1, 1, 1, 1], &[true; 4]);
            for (c, p) in c.iter_mut().zip(placed) {
                c.placed = p;
                c.cache_tokens = cache_tokens;
            }
            let d = pipeline()
                .select(&input(prompt.as_bytes(), None, 0), &FleetView::new(&c))
                .unwrap();
            (d.target, d.reason, d.new_work)
        };
        // Load bound: ceil(1.5 × (2 + 1) / 4) = 2, the least loaded + 2 = 2: t0 is at it.
        let busy = [2, 0, 0, 0];
        // Share cap: the least given (0) + the slack of 4. Within it t0 keeps new work.
        assert_eq!(
            decide(&new(0), busy, [4.0, 0.0, 0.0, 0.0], 0.0),
            (0, Reason::Scored, true)
        );
        let (target, reason, new_work) = decide(&new(0), busy, [4.5, 0.0, 0.0, 0.0], 0.0);
        assert!(target != 0 && reason == Reason::ShareBound && new_work);
        // Past its share but below the load bound: it keeps it.
        assert_eq!(
            decide(&new(0), [1, 0, 0, 0], [10.0, 0.0, 0.0, 0.0], 0.0),
            (0, Reason::Scored, true)
        );
        // Cold targets take the spill only when given at most one more than the least given
        // that can take it: of t1..t3 (given 3, 1, 3) only t2, whatever the weight keys say.
        for i in 0..20 {
            assert_eq!(
                decide(&new(i), busy, [10.0, 3.0, 1.0, 3.0], 0.0),
                (2, Reason::ShareBound, true)
            );
        }
        // Caches that cannot hold a second prompt of this size: no spill.
        let tokens = new(0).len() as f64 / 4.0;
        assert_eq!(
            decide(&new(0), busy, [10.0, 0.0, 0.0, 0.0], 1.5 * tokens),
            (0, Reason::Scored, true)
        );
        // A conversation's next turn is not new work: it stays with its history.
        assert_eq!(
            decide(&next, busy, [10.0, 0.0, 0.0, 0.0], 0.0),
            (0, Reason::Scored, false)
        );
        // Nor is a pass-through request (no prompt).
        assert!(!decide("", busy, [0.0; 4], 0.0).2);
        // A holder of the prefix (t1: the first half of the system prompt) takes it though
        // given more than a cold target could be (3 against the least given 0).
        store(&t[1], format!("Csystem\x1f{}", "S".repeat(4000)).as_bytes());
        for i in 0..20 {
            assert_eq!(
                decide(&new(i), busy, [10.0, 3.0, 0.0, 0.0], 0.0),
                (1, Reason::ShareBound, true)
            );
        }
        // Unless it is past the load bound itself.
        let (target, reason, _) = decide(&new(0), [2, 2, 0, 0], [10.0, 3.0, 0.0, 0.0], 0.0);
        assert!(target >= 2 && reason == Reason::ShareBound);
    }
}
