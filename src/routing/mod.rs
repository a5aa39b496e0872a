//! Pure routing decisions: given a request's [`RouteInput`] and a [`FleetView`] of the
//! route's targets, pick one. No pingora, no sockets, no clocks beyond what callers pass:
//! everything here is unit-testable and benchable on plain data.
//!
//! A strategy is a narrow extension point with defaults, like pingora's `ProxyHttp`:
//! [`Strategy::select`] is required, [`Strategy::record`] (learn from a forwarded
//! request) is optional. Each strategy lives in its own file with its tests.

mod baseline;
pub mod cache_aware;
pub mod explain;
pub mod group_homes;
pub mod lmcache;
pub mod pace;
pub mod pipeline;
pub mod placement;
pub mod precise;
pub mod responses;
pub mod session;

pub use baseline::{LeastLoad, RoundRobin};
pub use cache_aware::CacheAware;
pub use lmcache::{LmcacheAware, LmcacheView};
pub use pipeline::{Pipeline, PipelineWeights};
pub use precise::{KvView, PreciseCacheAware};
pub use responses::ResponseAffinity;
pub use session::SessionTable;

use crate::prefix::PrefixTrie;
use placement::PlacementKeys;

/// What a strategy may look at in a request.
#[derive(Debug, Clone, Copy, Default)]
pub struct RouteInput<'a> {
    /// Prompt bytes (see `prompt`); empty when the gateway gave `facts` instead.
    pub prompt: &'a [u8],
    /// The prompt's key (`prefix::key`), what the prefix tries store, computed once per
    /// request for strategies that say they use it. Empty when not computed: a strategy that
    /// needs it then computes its own (`cache_aware::prompt_key_of`).
    pub prompt_key: &'a [u8],
    /// Token ids from `x-rolter-vllm-token-ids`, if present and well-formed.
    pub token_ids: Option<&'a [u32]>,
    /// `x-session-id`, if present.
    pub session_id: Option<&'a str>,
    /// Now, in ms on the process's monotonic clock (session TTLs).
    pub now_ms: u64,
    /// The prompt's length and placement keys, when the gateway summarised the prompt
    /// instead of keeping its bytes (`prompt` is then empty; see [`RouteInput::prompt_len`]).
    pub facts: Option<PromptFacts>,
}

/// What the strategies read of a prompt besides its key, taken from a
/// [`crate::prompt::PromptSummary`].
#[derive(Debug, Clone, Copy)]
pub struct PromptFacts {
    /// Prompt bytes.
    pub len: usize,
    /// Its placement keys.
    pub keys: PlacementKeys,
    /// Bytes of its first message.
    pub first_len: usize,
}

impl PromptFacts {
    /// The facts of `summary` (kept with [`placement::MAX_KEY_BYTES`]).
    pub fn of(summary: &crate::prompt::PromptSummary) -> Self {
        debug_assert_eq!(
            summary.keep,
            placement::MAX_KEY_BYTES,
            "placement keys' cut"
        );
        PromptFacts {
            len: summary.len,
            keys: PlacementKeys::from_hashes(summary.first_hash, summary.second_hash),
            first_len: summary.first_len,
        }
    }
}

impl RouteInput<'_> {
    /// Prompt bytes: the summary's count, else the bytes given.
    pub fn prompt_len(&self) -> usize {
        self.facts.map_or(self.prompt.len(), |f| f.len)
    }

    /// The prompt's placement keys and the length of its first message.
    pub fn placement(&self) -> (PlacementKeys, usize) {
        match self.facts {
            Some(f) => (f.keys, f.first_len),
            None => PlacementKeys::from_prompt(self.prompt),
        }
    }
}

/// A route target as the strategy sees it at decision time.
#[derive(Clone, Copy, Default)]
pub struct Candidate<'a> {
    /// Requests in flight on this target right now.
    pub inflight: u64,
    /// Healthy, not cooling down, circuit not open.
    pub eligible: bool,
    /// Configured weight (≥ 1).
    pub weight: u32,
    /// Prompts this target has served (cache_aware, pipeline).
    pub prefix: Option<&'a PrefixTrie>,
    /// Stable identity across reloads (`provider/model`), for session affinity.
    pub label: &'a str,
    /// Blocks the replica reported resident via KV events (precise_cache_aware).
    pub kv: Option<KvView<'a>>,
    /// Fresh LMCache controller status; `None` when neutral (none, failed or stale).
    pub lmcache: Option<LmcacheView>,
    /// New work placed on this target in the last `fleet::recent::WINDOW_MS` (estimated),
    /// for the placement rule's `share_bound`.
    pub placed: f64,
    /// The replica's KV-cache capacity in tokens: configured (`kv_cache_tokens`), else as
    /// the replica's metrics report it (`cache_size_poll`); 0 when unknown. For the
    /// placement rule's cache-pressure tests.
    pub cache_tokens: f64,
}

/// The targets of one route, in config order, plus those already tried for this request.
#[derive(Clone, Copy)]
pub struct FleetView<'a> {
    /// One entry per route target.
    pub candidates: &'a [Candidate<'a>],
    /// Indices already tried (and failed) for this request; never chosen again.
    pub excluded: &'a [usize],
}

impl<'a> FleetView<'a> {
    /// A view with nothing excluded.
    pub fn new(candidates: &'a [Candidate<'a>]) -> Self {
        FleetView {
            candidates,
            excluded: &[],
        }
    }

    /// Indices a strategy may choose: eligible and not already tried.
    pub fn eligible(&self) -> impl Iterator<Item = usize> + '_ {
        self.candidates
            .iter()
            .enumerate()
            .filter(|(i, c)| c.eligible && !self.excluded.contains(i))
            .map(|(i, _)| i)
    }

    /// The smallest in-flight count among eligible targets.
    pub fn min_inflight(&self) -> Option<u64> {
        self.eligible().map(|i| self.candidates[i].inflight).min()
    }

    /// Among eligible targets with the fewest in flight, one chosen uniformly at random.
    pub fn least_loaded(&self) -> Option<usize> {
        let min = self.min_inflight()?;
        pick_random(
            self.eligible()
                .filter(|&i| self.candidates[i].inflight == min),
        )
    }
}

/// Why a target was chosen (exported as a metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// Next in rotation.
    RoundRobin,
    /// Fewest requests in flight.
    LeastLoad,
    /// The target holding the most of the prompt (its cache counts: see `placement`).
    CacheHit,
    /// No target's cache counts: placed by load and the prompt's group key.
    BelowThreshold,
    /// A target holding more of the prompt was passed over for its load (cost or guard).
    Overloaded,
    /// Nothing to score (empty prompt, no token ids, ...): least-loaded.
    Fallback,
    /// The session's previous target (pipeline).
    Affinity,
    /// Highest pipeline score.
    Scored,
    /// Most free cache capacity for its load (lmcache_aware).
    CacheCapacity,
    /// A new conversation sent to the home every gateway names for its prefix group,
    /// though another target holds more of the prompt, or, under cache pressure, a
    /// conversation sent there from another group's home (see `group_homes`).
    GroupHome,
    /// New work moved off a target already given more than its share of the recent new
    /// work (`share_bound`, see `placement`).
    ShareBound,
}

impl Reason {
    /// Every reason, each at the index `reason as usize`.
    pub const ALL: [Reason; 11] = [
        Reason::RoundRobin,
        Reason::LeastLoad,
        Reason::CacheHit,
        Reason::BelowThreshold,
        Reason::Overloaded,
        Reason::Fallback,
        Reason::Affinity,
        Reason::Scored,
        Reason::CacheCapacity,
        Reason::GroupHome,
        Reason::ShareBound,
    ];

    /// Stable label value for metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::RoundRobin => "round_robin",
            Reason::LeastLoad => "least_load",
            Reason::CacheHit => "cache_hit",
            Reason::BelowThreshold => "below_threshold",
            Reason::Overloaded => "overloaded",
            Reason::Fallback => "fallback",
            Reason::Affinity => "affinity",
            Reason::Scored => "scored",
            Reason::CacheCapacity => "cache_capacity",
            Reason::GroupHome => "group_home",
            Reason::ShareBound => "share_bound",
        }
    }
}

/// A strategy's answer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    /// Index into the route's targets.
    pub target: usize,
    /// Why.
    pub reason: Reason,
    /// Prefix match score of the chosen target in `[0, 1]`, for strategies that score.
    pub score: Option<f64>,
    /// Where the chosen target's trie walk stopped, so `record` need not walk it again.
    pub hint: Option<crate::prefix::MatchHint>,
    /// The conversation's placement key, for strategies that remember where each
    /// conversation went (`record` stores it).
    pub conversation: Option<u64>,
    /// New work (not the continuation of a conversation a target holds): what the
    /// placement rule's `share_bound` counts.
    pub new_work: bool,
}

/// A target-selection policy for one route.
pub trait Strategy: Send + Sync {
    /// The strategy's name as in the routing file.
    fn name(&self) -> &'static str;

    /// Pick an eligible target, or `None` if there is none.
    fn select(&self, input: &RouteInput, fleet: &FleetView) -> Option<Decision>;

    /// Whether `select`/`record` read the prompt (`RouteInput::prompt`, or for a long one
    /// `RouteInput::facts`). A strategy that does not says so, and the gateway then skips
    /// encoding it and passes an empty prompt and no facts.
    fn uses_prompt(&self) -> bool {
        true
    }

    /// Whether `select`/`record` read `RouteInput::prompt_key` (else the gateway does not
    /// compute it, a pass over the prompt).
    fn uses_prompt_key(&self) -> bool {
        false
    }

    /// Whether `select`/`record` read `RouteInput::token_ids` (else the gateway does not
    /// parse the header).
    fn uses_token_ids(&self) -> bool {
        false
    }

    /// Whether `select`/`record` read `RouteInput::session_id` (else the gateway does not
    /// look the header up).
    fn uses_session_id(&self) -> bool {
        false
    }

    /// Whether this strategy keeps a conversation where another gateway placed its last turn
    /// (`[peering]` notes, in its session table as a peer's): for strategies that know a
    /// replica's cache only from what this gateway routed there. Default: no (the gateway
    /// neither sends nor applies notes for the route).
    fn hears_peers(&self) -> bool {
        false
    }

    /// Whether a failed attempt may go to another target. A strategy bound to one target
    /// (a stored response's replica) says no, so its failures are not held back for a
    /// retry that could not happen. Default: yes.
    fn fails_over(&self) -> bool {
        true
    }

    /// Learn from a request routed to `decision.target`; called once the decision is made,
    /// before the request is sent (the replica starts computing the prefix as soon as it
    /// admits the request, and the next request must already see that). Default: nothing.
    fn record(&self, _input: &RouteInput, _fleet: &FleetView, _decision: &Decision) {}
}

/// Uniform choice from an iterator without collecting (reservoir sampling).
pub fn pick_random(items: impl Iterator<Item = usize>) -> Option<usize> {
    use rand::Rng;
    let mut rng = rand::thread_rng();
    let mut chosen = None;
    for (n, item) in items.enumerate() {
        if rng.gen_range(0..=n) == 0 {
            chosen = Some(item);
        }
    }
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pipeline strategy weighing prefix affinity most.
    fn pipeline() -> Box<dyn Strategy> {
        let w = PipelineWeights {
            static_weight: 0.0,
            load: 0.1,
            prefix: 1.0,
        };
        Box::new(Pipeline::new(
            w,
            std::sync::Arc::new(SessionTable::new(10, 100)),
            placement::PlacementRule::default(),
            4.0,
        ))
    }

    /// The gateway gives strategies a prompt's summary instead of its bytes: they must
    /// read the same length, key and placement keys from it, and so decide the same.
    #[test]
    fn a_summarised_prompt_routes_as_its_bytes_do() {
        use crate::prompt::{Endpoint, RequestBody};
        let system = "You are a careful assistant. ".repeat(300); // past MAX_KEY_BYTES
        let body = serde_json::json!({"model": "m", "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "question one ".repeat(40)},
            {"role": "assistant", "content": "answer"},
            {"role": "user", "content": "next"}]})
        .to_string();
        let parsed = RequestBody::parse(Endpoint::Chat, body.as_bytes()).unwrap();
        let prompt = parsed.prompt();
        let summary = parsed.summary(placement::MAX_KEY_BYTES, true);
        let key = crate::prefix::prompt_key(&prompt);
        assert_eq!(summary.key, key);
        let facts = PromptFacts::of(&summary);
        assert_eq!(
            (facts.keys, facts.first_len),
            PlacementKeys::from_prompt(&prompt)
        );
        assert_eq!(facts.len, prompt.len());
        // Target 0 holds the prompt's first half, target 1 a third of it.
        let tries = [PrefixTrie::default(), PrefixTrie::default()];
        tries[0].insert(&key[..key.len() / 2]);
        tries[1].insert(&key[..key.len() / 3]);
        let c: Vec<Candidate> = tries
            .iter()
            .zip([2u64, 0])
            .map(|(t, inflight)| Candidate {
                inflight,
                eligible: true,
                weight: 1,
                prefix: Some(t),
                label: "t",
                ..Default::default()
            })
            .collect();
        let bytes = RouteInput {
            prompt: &prompt,
            ..Default::default()
        };
        let summarised = RouteInput {
            prompt_key: &summary.key,
            facts: Some(facts),
            ..Default::default()
        };
        // A strategy each: a first sighting of the prompt's group is state.
        type Make = fn() -> Box<dyn Strategy>;
        let strategies: [Make; 2] = [
            || Box::new(CacheAware::new(placement::PlacementRule::default(), 4.0)),
            pipeline,
        ];
        for make in strategies {
            let (a, b) = (
                make().select(&bytes, &FleetView::new(&c)).unwrap(),
                make().select(&summarised, &FleetView::new(&c)).unwrap(),
            );
            assert_eq!((a.target, a.reason, a.score), (b.target, b.reason, b.score));
            assert_eq!(a.conversation, b.conversation);
        }
    }

    /// The gateway hands an empty prompt to a strategy whose `uses_prompt()` is false, so
    /// such a strategy must decide exactly as it would with the prompt. The fleet makes
    /// the prompt matter (target 0 holds it, target 1 is the least loaded), which the
    /// strategies that read it show by deciding differently.
    #[test]
    fn a_strategy_that_skips_the_prompt_decides_the_same_without_it() {
        let prompt = b"Csystem\x1fYou are a careful assistant.\x1euser\x1fhello\x1e".repeat(8);
        type Make = fn() -> Box<dyn Strategy>;
        let strategies: [(&str, Make); 6] = [
            ("round_robin", || Box::new(RoundRobin::default())),
            ("least_load", || Box::new(LeastLoad)),
            ("cache_aware", || Box::new(CacheAware::default())),
            ("pipeline", pipeline),
            ("precise_cache_aware", || {
                Box::new(PreciseCacheAware::default())
            }),
            ("lmcache_aware", || Box::new(LmcacheAware)),
        ];
        for (name, make) in strategies {
            let tries: Vec<PrefixTrie> = (0..3).map(|_| PrefixTrie::new(10_000)).collect();
            tries[0].insert(&crate::prefix::prompt_key(&prompt));
            let candidates: Vec<Candidate> = tries
                .iter()
                .zip([2u64, 1, 3])
                .map(|(t, inflight)| Candidate {
                    inflight,
                    eligible: true,
                    weight: 1,
                    prefix: Some(t),
                    ..Default::default()
                })
                .collect();
            let view = FleetView {
                candidates: &candidates,
                excluded: &[],
            };
            let decide = |p: &[u8]| {
                let input = RouteInput {
                    prompt: p,
                    ..Default::default()
                };
                make().select(&input, &view).map(|d| d.target)
            };
            let (with, without) = (decide(&prompt), decide(&[]));
            assert!(with.is_some(), "{name}: no decision");
            if name == "precise_cache_aware" {
                // Reads the prompt only for placement keys, and only with token ids,
                // which this input lacks: nothing to show here.
                assert!(make().uses_prompt());
            } else if make().uses_prompt() {
                assert_ne!(
                    with, without,
                    "{name} reads the prompt; this fleet should show it"
                );
            } else {
                assert_eq!(
                    with, without,
                    "{name} says it ignores the prompt but does not"
                );
            }
        }
    }

    #[test]
    fn every_reason_sits_at_its_own_index_with_its_own_label() {
        // Exhaustive: a new variant fails to compile here until it is added to `ALL`.
        let listed = |r: Reason| match r {
            Reason::RoundRobin
            | Reason::LeastLoad
            | Reason::CacheHit
            | Reason::BelowThreshold
            | Reason::Overloaded
            | Reason::Fallback
            | Reason::Affinity
            | Reason::Scored
            | Reason::CacheCapacity
            | Reason::GroupHome
            | Reason::ShareBound => Reason::ALL.contains(&r),
        };
        assert!(Reason::ALL.iter().all(|&r| listed(r)));
        let mut labels = std::collections::HashSet::new();
        for (i, r) in Reason::ALL.iter().enumerate() {
            assert_eq!(*r as usize, i, "{r:?}");
            assert!(labels.insert(r.as_str()), "duplicate label {}", r.as_str());
        }
    }
}
