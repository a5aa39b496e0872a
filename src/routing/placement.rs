//! The placement rule `cache_aware` and `precise_cache_aware` share: weigh the prefill a
//! target would save against the queue it would add, keep conversations where their
//! history is, and place what is new the same way on every gateway.
//!
//! Owns the cost model, the overload guard and deterministic tie-breaking. It sees each
//! eligible target only as [`Choice`] (in flight, tokens of the prompt it holds, room left
//! in its cache, new work recently given to it, label): where those come from (a prefix
//! trie, a KV residency index, the fleet's counters) is the caller's job. `pipeline`,
//! which scores targets its own way, borrows its overload guard and the load and share
//! bounds (`new_work_bound_over`, `share_cap_over`, `has_room_for_a_home`, `cache_crowded`).
//! No I/O, no clocks, no randomness.
//!
//! The rule, for a prompt of `P` tokens over eligible targets `t` (load `q_t`, the fewest
//! in flight `q_min`):
//! 1. `cached_t` = tokens of the prompt's prefix `t` holds, counted only when it covers at
//!    least `threshold` of the prompt or [`ALWAYS_COUNTED_TOKENS`] (a trivial shared
//!    start, e.g. the chat template, is no reason to pin; a long shared system prompt is,
//!    however long the conversation after it).
//! 2. Expected cost in prefill tokens: `cost_t = (P − cached_t) + λ · (q_t − q_min)`, with
//!    `λ = load_cost_tokens`: the prefill time one more request in flight is worth. TTFT is
//!    queueing plus the prefill of what is not cached; λ turns one into the other.
//! 3. The cheapest target wins. Targets within λ of the cheapest (one request's worth:
//!    the load views of two gateways differ by about that much) count as tied: among them
//!    the one holding the most of the prompt, then the highest rendezvous weight of the
//!    prompt's key on the target's label (see [`PlacementKeys`]). So a new prefix group is
//!    placed, and a new conversation is spread over the targets holding its group's
//!    prefix, identically by every gateway that runs this rule, with no shared state.
//! 4. Overload guard: the winner is *truly overloaded* when it has more than a margin of
//!    requests in flight beyond `q_min` AND more than `balance_rel` × `q_min`. The margin
//!    is `balance_abs`, or, when more, the requests whose queueing (λ each) is worth
//!    [`GUARD_PREFILL_SHARE`] of the prompt's prefix the winner holds: a burst on a long
//!    shared prompt (a 4,000-token tool list) waits longer than one on a short one before
//!    it spreads, as spreading it costs that prompt's prefill on each new target.
//!    A conversation's own target (it holds more than [`CONTINUATION_MIN_TOKENS`] beyond
//!    the prompt's first message, i.e. history nobody else has) gets twice the margin:
//!    its queue must be worth the whole prefix it holds. An overloaded winner is replaced
//!    by the cheapest target within `balance_abs / 2` of `q_min` (reason `overloaded`),
//!    which for a hot system prompt usually opens a second home for its group: later new
//!    conversations then spread over both at the cost of their first user message. New
//!    work whose winner holds its prefix, when that target holds none of it and its cache
//!    holds two prompts (opening a home there costs the whole prefix and keeps costing
//!    the group's later conversations), gets at least [`NEW_HOME_MARGIN`] × `balance_abs`.
//! 5. A conversation whose history no view holds any more is kept by the target that
//!    served its last turn (`Ask::previous`, remembered by the caller), if that target
//!    holds some of the prompt and as much as any (when no view holds any of it, the
//!    conversation is placed as new work). One whose last turn another gateway placed
//!    (`Ask::previous_from_peer`, a peer's note: `peering`) is kept by that target while
//!    this gateway's view of it holds a counted part of the prompt (its group's prefix),
//!    whatever the views show of the history: the peer placed the history there.
//!    Under cache pressure (every target is some group's home, and one prompt fills the
//!    conversation's target's cache), a conversation on a target that is not its group's
//!    home (its group's home moved in a start's burst, or the guard spilled it) goes to
//!    its group's `Known` home when that holds the group's prefix and what the
//!    conversation's target holds beyond what the home holds is worth at most
//!    [`STRANDED_HISTORY_LAMBDAS`] × λ (reason `group_home`): the move costs that
//!    history; staying keeps two groups evicting each other's prompt there. Not for a
//!    peer's placement. The home keeps it as the conversation's own target would.
//! 6. Bounded load (`load_bound`): new work skips targets past `ceil(load_bound × mean)`
//!    in flight (never below `q_min + 2`) when a target within the bound takes it
//!    cheaply: it holds the prefix, or is idle (`Choice::room_tokens`).
//! 7. Group home (`group_homes`): new work whose best target holds nothing beyond the
//!    prompt's first message goes to `Ask::group_home` (the target every gateway names
//!    for the prompt's group, see `group_homes`) when the home has no more in flight
//!    than that target, even if the home must prefill the group's prefix first. A new
//!    group's expected home (`GroupHome::Expected`) counts only while no target holds
//!    the prompt. Under cache pressure (every target is some group's home and that
//!    target's cache holds less than twice the prompt, so one group there evicts the
//!    other) the home takes it busier or not whenever it holds as much of the prompt as
//!    that target, and the share bound below does not move it off: a group's second home
//!    on another group's replica has the two evict each other; only the overload guard
//!    moves it. While some target hosts no group, a group may open a second home.
//! 8. Bounded share (`share_bound`): new work (its group's home included) skips a target
//!    already given more than `share_bound` × the mean of the new work recently placed
//!    on each eligible target (`Choice::placed`; never below the least-given target's
//!    count + the larger of [`SHARE_SLACK`] and [`SHARE_NOISE_SIGMAS`] × √mean; on n > 4
//!    targets the bound's excess over 1 and the 2 shrink by √(4 / n)), going to
//!    the cheapest target within the bound even if it must prefill the prefix, when its
//!    cache holds twice the prompt (`Choice::cache_tokens`): conversations bring their
//!    later turns, so evening out the new ones evens out the requests each target serves.
//!    A target that must prefill the prefix takes the spill only if it was given no more
//!    than the mean and at most [`NEW_HOME_GIVEN_SLACK`] more than the least-given
//!    target able to: a group's second home goes where there is room for it, and does
//!    not push that target's own group over the bound in turn.
//! 9. Quiet homes (`group_homes`): a target whose groups have gone quiet (`Choice::quiet`:
//!    they opened none of the route's last new conversations where their usual share
//!    would have brought a few: a tenant gone idle, a batch ending) hosts no group for
//!    rules 7 and 8, so a busier group may open a second home there and spill onto it
//!    under cache pressure too. Once it holds part of a prompt (the group's prefix) it
//!    takes the request when cheaper by more than λ, even off a conversation's own
//!    target: the move costs the history, and what it evicts belongs to conversations
//!    that are ending.
//!
//! Why not a fixed "pin unless overloaded" rule: the cost of going elsewhere is the
//! prefix that must be recomputed, which ranges from one user message (a new
//! conversation whose group has two homes) to a whole long history; one margin cannot
//! suit both.

use super::Reason;
use twox_hash::XxHash3_64;

/// Default of `load_cost_tokens`: prefill tokens one more request in flight is worth.
/// Chosen by measurement over the loadtest workloads (multi-turn with and without cache
/// pressure, few-shot, 16 replicas; `loadtest/run.sh`, README "Routing quality").
pub const DEFAULT_LOAD_COST_TOKENS: f64 = 200.0;
/// Default of `balance_abs`: requests in flight beyond the least-loaded target before a
/// new conversation's best target counts as truly overloaded (twice that for a
/// conversation's own target).
pub const DEFAULT_BALANCE_ABS: u64 = 5;
/// Default of `balance_rel`: and more than this multiple of the least-loaded target's load.
pub const DEFAULT_BALANCE_REL: f64 = 1.3;
/// Default of `load_bound`: new work goes only to targets that, with it, stay within this
/// multiple of the fleet's mean load (bounded-load placement); 0 turns the bound off.
pub const DEFAULT_LOAD_BOUND: f64 = 1.5;
/// Default of `share_bound`: new work skips targets already given more than this multiple
/// of the eligible targets' mean of recent new work. Chosen by measurement over the
/// loadtest workloads (docs/routing.md, "Bounded share of new work"). On more than
/// [`SHARE_BOUND_FLEET`] eligible targets its excess over the mean shrinks
/// ([`share_fleet_factor`]).
pub const DEFAULT_SHARE_BOUND: f64 = 1.15;
/// New work beyond the least-given target's recent count that any target may take before
/// `share_bound` applies: at low traffic a few conversations are no imbalance.
pub const SHARE_SLACK: f64 = 4.0;
/// The share bound's slack in standard deviations of a fair share, on up to
/// [`SHARE_BOUND_FLEET`] eligible targets: a target's count of `n` conversations dealt at
/// random varies by about √n, so below this many √mean beyond the least-given target an
/// excess is chance, and a spill for it opens a second home (a cold prefix) the traffic
/// does not need.
pub const SHARE_NOISE_SIGMAS: f64 = 2.0;
/// The fleet size `share_bound` and [`SHARE_NOISE_SIGMAS`] are set for. On more eligible
/// targets both the bound's excess over the mean and the √mean allowance shrink by
/// √(`SHARE_BOUND_FLEET` / targets) ([`share_fleet_factor`]): a second home the bound
/// opens costs one prefix out of all the targets' traffic, on sixteen targets a quarter
/// as much of the fleet's hits as on four, while a target let past the mean is as far
/// over its share there as anywhere.
pub const SHARE_BOUND_FLEET: f64 = 4.0;
/// How much more new work than the least-given target able to host it a target that must
/// prefill the prompt's prefix may have been given and still take a share-bound spill.
pub const NEW_HOME_GIVEN_SLACK: f64 = 1.0;
/// The overload margin, in `balance_abs`, for new work that would leave a target holding
/// its prefix for one that holds none of it and has room for it beside another prompt:
/// that move opens a home (the whole prefix, then the group's next conversations there).
pub const NEW_HOME_MARGIN: f64 = 1.5;
/// Share of the winner's cached prefix (in λ-priced requests) below which the overload
/// guard does not move new work, whatever `balance_abs` says: half, so new work spreads
/// before its queue costs the whole prefill it would redo, and a conversation's own
/// target (twice the margin) keeps it until the queue costs all of it.
pub const GUARD_PREFILL_SHARE: f64 = 0.5;
/// Under cache pressure, a conversation left on another group's home moves to its own
/// group's home while what its target holds beyond what the home holds is worth at most
/// this many λ (400 tokens at the default λ, a few turns of chat): its history is lost,
/// but two groups stop evicting each other's prompt on that replica.
pub const STRANDED_HISTORY_LAMBDAS: f64 = 2.0;
/// Default of `group_homes`.
pub const DEFAULT_GROUP_HOMES: bool = true;
/// Tokens a target must hold beyond the prompt's first message for the request to count as
/// the continuation of a conversation that target served (one vLLM block by default).
pub const CONTINUATION_MIN_TOKENS: f64 = 16.0;
/// Cached tokens that count whatever fraction of the prompt they are: far beyond any chat
/// template or one-line system prompt, so only a real shared document, tool list or
/// history reaches it.
pub const ALWAYS_COUNTED_TOKENS: f64 = 256.0;
/// Longest prefix of the prompt hashed into a placement key: the first few KiB of a system
/// prompt tell groups apart; hashing a 1 MiB one whole would cost for nothing.
pub const MAX_KEY_BYTES: usize = 4096;

/// The tunable part of the rule (per route).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlacementRule {
    /// Minimum fraction of the prompt a target must hold for its cache to count.
    pub threshold: f64,
    /// λ: prefill tokens one more request in flight is worth.
    pub load_cost_tokens: f64,
    /// Absolute part of the overload guard (requests beyond the least loaded).
    pub balance_abs: u64,
    /// Relative part of the overload guard (multiple of the least loaded's load).
    pub balance_rel: f64,
    /// Bound on new work: a target takes a new prompt only while its load with it stays
    /// within this multiple of the fleet's mean (with it), or it is the least loaded.
    /// 0 = no bound.
    pub load_bound: f64,
    /// Send a new conversation to its group's home (`Ask::group_home`) when the home has
    /// no more in flight than the target the cost rule picked.
    pub group_homes: bool,
    /// Bound on a target's share of recent new work: new work skips a target already given
    /// more than this multiple of the mean while another is within it. 0 = no bound.
    pub share_bound: f64,
}

impl Default for PlacementRule {
    fn default() -> Self {
        PlacementRule {
            threshold: super::cache_aware::DEFAULT_CACHE_THRESHOLD,
            load_cost_tokens: DEFAULT_LOAD_COST_TOKENS,
            balance_abs: DEFAULT_BALANCE_ABS,
            balance_rel: DEFAULT_BALANCE_REL,
            load_bound: DEFAULT_LOAD_BOUND,
            group_homes: DEFAULT_GROUP_HOMES,
            share_bound: DEFAULT_SHARE_BOUND,
        }
    }
}

/// Deterministic keys of a prompt for tie-breaking (the same on every gateway).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PlacementKeys {
    /// The prompt's group: its first message (a system prompt, a few-shot template).
    pub group: u64,
    /// The conversation: its first two messages, or the client's session id.
    pub conversation: u64,
}

impl PlacementKeys {
    /// Keys of prompt bytes in `prompt`'s encoding (messages end with an unescaped RS).
    /// Returns the keys and the length of the first message in bytes (the whole prompt
    /// when it has no message boundary, e.g. a completion).
    pub fn from_prompt(prompt: &[u8]) -> (PlacementKeys, usize) {
        let (first, second) = crate::prompt::first_two_message_ends(prompt);
        let first = first.unwrap_or(prompt.len());
        let second = second.unwrap_or(prompt.len());
        let second_message = &prompt[first..second.min(first.saturating_add(MAX_KEY_BYTES))];
        let keys = PlacementKeys::from_hashes(
            XxHash3_64::oneshot(&prompt[..first.min(MAX_KEY_BYTES)]),
            XxHash3_64::oneshot(second_message),
        );
        (keys, first)
    }

    /// Keys from the XXH3-64 hashes of a prompt's first two messages, each cut to
    /// [`MAX_KEY_BYTES`] (what [`crate::prompt::PromptSummary`] holds). The second message
    /// is hashed on its own, so a first message longer than the key's bytes does not make
    /// every conversation of a group look alike.
    pub fn from_hashes(first: u64, second: u64) -> PlacementKeys {
        PlacementKeys {
            group: first,
            conversation: splitmix64(first ^ second),
        }
    }

    /// These keys with the conversation taken from a client session id.
    pub fn with_session(self, session_id: Option<&str>) -> PlacementKeys {
        match session_id {
            Some(id) => PlacementKeys {
                conversation: XxHash3_64::oneshot(id.as_bytes()) ^ 0x5e55_1011,
                ..self
            },
            None => self,
        }
    }
}

/// One eligible target as the rule sees it.
#[derive(Debug, Clone, Copy)]
pub struct Choice<'a> {
    /// Index into the route's targets.
    pub index: usize,
    /// Requests in flight.
    pub inflight: u64,
    /// Tokens of the prompt's prefix the target holds.
    pub cached_tokens: f64,
    /// Stable identity (`provider/model`), the same on every gateway.
    pub label: &'a str,
    /// Tokens the target can take while its cache stays at most half full, or its whole
    /// cache when it holds nothing, as far as the caller knows (0 when unknown; infinite
    /// for a target known to hold nothing whose size is unknown): a target with that much
    /// room holds little enough that a new home there evicts nothing another group needs.
    pub room_tokens: f64,
    /// Tokens the target's cache holds in all, as far as the caller knows (0 when unknown).
    pub cache_tokens: f64,
    /// New work placed on the target recently (`fleet::recent`): conversations it was given,
    /// which bring their later turns with them.
    pub placed: f64,
    /// Prefix groups whose home (`group_homes`) the target is (0 when homes are off).
    pub homes: usize,
    /// The groups whose home the target is have gone quiet (`group_homes`: they opened
    /// none of the route's last new conversations where their share would have brought
    /// several).
    pub quiet: bool,
}

/// The request as the rule sees it.
#[derive(Debug, Clone, Copy)]
pub struct Ask {
    /// Prompt length in tokens (> 0).
    pub tokens: f64,
    /// Tokens of the prompt's first message.
    pub first_message_tokens: f64,
    /// Tie-breaking keys.
    pub keys: PlacementKeys,
    /// The target that served this conversation's previous turn, if the caller remembers
    /// one (index into the route's targets).
    pub previous: Option<usize>,
    /// `previous` is what another gateway told this one it placed the conversation's last
    /// turn on (`peering`), not a decision of this gateway.
    pub previous_from_peer: bool,
    /// The home every gateway names for the prompt's group (`group_homes`), if any.
    pub group_home: Option<GroupHome>,
}

/// A prompt group's home (index into the route's targets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupHome {
    /// The group is known (seen before): every gateway that knows it names this target.
    Known(usize),
    /// The group is new: the target it would get on joining the set (named only when that
    /// is also its rendezvous choice). Counts only while no target holds the prompt (a
    /// group forgotten, e.g. after a reload, stays where it is).
    Expected(usize),
}

/// The rule's answer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Placed {
    /// Index into the route's targets.
    pub index: usize,
    /// Why: `cache_hit`, `overloaded`, `group_home` or `below_threshold`.
    pub reason: Reason,
    /// Fraction of the prompt the chosen target holds (0 below the threshold).
    pub score: f64,
    /// Placed as new work (no target held the conversation's history).
    pub new_work: bool,
}

impl PlacementRule {
    /// Place `ask` on one of `choices` (the eligible targets); `None` if there are none.
    pub fn place(&self, ask: &Ask, choices: &[Choice]) -> Option<Placed> {
        let q_min = choices.iter().map(|c| c.inflight).min()?;
        let tokens = ask.tokens.max(1.0);
        let counted = |c: &Choice| self.counted(c.cached_tokens, tokens);
        let lambda = self.load_cost_tokens;
        let cost = |c: &Choice| (tokens - counted(c)) + lambda * (c.inflight - q_min) as f64;
        let best_cached = choices.iter().map(counted).fold(0.0, f64::max);

        // A conversation's own target: it holds history beyond the first message, more
        // than any other target does. It keeps the conversation until truly overloaded;
        // the cost model only places what is new (and a history two targets hold alike).
        let runner_up = |home: &Choice| {
            choices
                .iter()
                .filter(|c| c.index != home.index)
                .map(counted)
                .fold(0.0, f64::max)
        };
        // Where a peer placed the conversation's last turn (this gateway's views show none of
        // the history its turns left there), while this gateway's view of that target still
        // holds part of the prompt (the group's prefix): the views forget what a replica has
        // likely evicted, and a conversation the peer moved onto a replica caching another
        // group loses its history there about as soon as the peer's own view would forget it.
        let peer_home = ask
            .previous
            .filter(|_| ask.previous_from_peer)
            .and_then(|p| choices.iter().find(|c| c.index == p))
            .filter(|c| counted(c) > 0.0);
        let holder = choices
            .iter()
            .find(|c| best_cached > 0.0 && counted(c) >= best_cached)
            .filter(|c| counted(c) - ask.first_message_tokens > CONTINUATION_MIN_TOKENS)
            .filter(|c| counted(c) - runner_up(c) > CONTINUATION_MIN_TOKENS);
        let home = peer_home
            .or(holder)
            // The history may be gone from every view while the target that served the
            // last turn still holds some of it: among the targets holding the most of the
            // prompt, that one is the conversation's own.
            .or_else(|| {
                choices
                    .iter()
                    .find(|c| Some(c.index) == ask.previous)
                    .filter(|c| best_cached > 0.0 && counted(c) >= best_cached)
            });
        // Under cache pressure (every target is some group's home), a conversation left on
        // another group's home, where one prompt fills the cache, goes to its own group's
        // home once that holds part of the prompt (the group's prefix), while what its
        // target holds beyond the home's part is worth at most STRANDED_HISTORY_LAMBDAS × λ:
        // the move costs that history; staying keeps two groups' prompts evicting each
        // other on one replica for the rest of the conversation.
        let every_target_hosts = choices.iter().all(|c| c.homes > 0 && !c.quiet);
        let rehomed = home
            .filter(|t| peer_home.is_none() && every_target_hosts && crowded(t, tokens))
            .and_then(|t| {
                let Some(GroupHome::Known(home_index)) =
                    ask.group_home.filter(|_| self.group_homes)
                else {
                    return None;
                };
                choices.iter().find(|c| c.index == home_index).filter(|h| {
                    h.index != t.index
                        && counted(h) > 0.0
                        && counted(t) - counted(h) <= STRANDED_HISTORY_LAMBDAS * lambda
                })
            });
        let home = rehomed.or(home);
        let new_work = home.is_none();
        // `moved`: the rule that moved the request off the cost rule's pick (or, for a
        // conversation, off its own target), if one did.
        let (mut pick, doubled, moved) = match home {
            Some(home) => (home, true, rehomed.map(|_| Reason::GroupHome)),
            None => {
                // Bounded load: new work skips targets past the bound, but only for targets
                // that take it cheaply (they hold its prefix, or their cache stays at most
                // half full with it, or holds nothing): spilling a new prefix onto a replica
                // busy with another group evicts that group or adds a home the fleet's
                // balance did not need.
                let bound = self.new_work_bound(choices, q_min);
                let takes = |c: &&Choice| {
                    c.inflight < bound && (counted(c) > 0.0 || c.room_tokens >= tokens)
                };
                let pick = if choices.iter().any(|c| takes(&c)) {
                    self.cheapest(ask, choices.iter().filter(takes), &cost, &counted)?
                } else {
                    self.cheapest(ask, choices.iter(), &cost, &counted)?
                };
                // A new conversation goes to its group's home when the home is no busier
                // than the pick, even if it must first prefill the group's prefix there:
                // every gateway names the same home, so a group two gateways placed apart
                // in a burst comes back together.
                let group_home = match ask.group_home.filter(|_| self.group_homes) {
                    Some(GroupHome::Known(h)) => Some(h),
                    Some(GroupHome::Expected(h)) if best_cached == 0.0 => Some(h),
                    _ => None,
                };
                // Under cache pressure, when every target is some group's home, a home
                // holding the group's prefix is kept however busy (the overload guard
                // aside): the pick's cache cannot hold both groups. While some target
                // hosts no group, that one can be the group's second home.
                let pinned = |h: &Choice| {
                    pick.index != h.index
                        && every_target_hosts
                        && crowded(pick, tokens)
                        && counted(h) >= counted(pick)
                };
                let group_home = group_home
                    .and_then(|h| choices.iter().find(|c| c.index == h))
                    .filter(|h| {
                        (h.inflight <= pick.inflight || pinned(h))
                            && counted(pick) <= ask.first_message_tokens + CONTINUATION_MIN_TOKENS
                    });
                let pinned_home = group_home.is_some_and(pinned);
                let (pick, went_home) = match group_home {
                    Some(h) => (h, true),
                    None => (pick, false),
                };
                // Bounded share: a target given more than its share of the recent new work
                // takes no more while another within the bound can take it, even where the
                // group's prefix must be prefilled first: otherwise a group's homes take its
                // conversations as they come, and the busiest group's homes stay busiest
                // (the bound then opens another home for that group). Only on a target
                // whose cache holds the prompt beside another of its size: where one system
                // prompt fills half a cache, a second home evicts the group living there.
                // The cost rule weighs their loads; preferring those within `load_bound`
                // lost hit rate under cache pressure.
                let share_cap = self.share_cap(choices);
                let own_home = match ask.group_home {
                    Some(GroupHome::Known(h) | GroupHome::Expected(h)) => Some(h),
                    None => None,
                };
                let spill = || {
                    let can_take = |c: &&Choice| {
                        c.placed <= share_cap && self.can_host(c, tokens, &counted, own_home)
                    };
                    // A target that must prefill the prefix takes the spill only where there
                    // is room: given no more than the mean, and about as little as any that
                    // can.
                    let mean_given = mean_placed(choices);
                    let least_given = choices
                        .iter()
                        .filter(can_take)
                        .map(|c| c.placed)
                        .fold(f64::INFINITY, f64::min);
                    let hosts = |c: &&Choice| {
                        can_take(c)
                            && (counted(c) > 0.0
                                || has_room_for_a_home(c.placed, mean_given, least_given))
                    };
                    self.cheapest(ask, choices.iter().filter(hosts), &cost, &counted)
                };
                let other = (pick.placed > share_cap && !pinned_home)
                    .then(spill)
                    .flatten();
                match other {
                    Some(other) => (other, false, Some(Reason::ShareBound)),
                    None => (pick, false, went_home.then_some(Reason::GroupHome)),
                }
            }
        };
        let mut reason = if let Some(Reason::ShareBound) = moved {
            Reason::ShareBound
        } else if peer_home.is_some_and(|p| p.index == pick.index) {
            // The history is there (the peer's views show it): a hit, whatever ours show.
            Reason::CacheHit
        } else if best_cached == 0.0 {
            Reason::BelowThreshold
        } else if counted(pick) >= best_cached {
            Reason::CacheHit
        } else if let Some(why) = moved {
            why
        } else {
            Reason::Overloaded
        };
        let margin = self
            .overload_margin(counted(pick))
            .saturating_mul(if doubled { 2 } else { 1 });
        // A target whose groups have gone quiet and that holds part of the prompt takes it
        // when cheaper by more than λ, even from the conversation's own target: with the
        // group's prefix there, the move costs the history, and what it evicts belongs to
        // conversations that are ending.
        let to_quiet = self
            .cheapest(
                ask,
                choices
                    .iter()
                    .filter(|c| c.quiet && counted(c) > 0.0 && cost(c) + lambda < cost(pick)),
                &cost,
                &counted,
            )
            .filter(|_| !pick.quiet);
        if let Some(quiet) = to_quiet {
            pick = quiet;
            reason = Reason::Overloaded;
        } else if self.overloaded(pick.inflight, q_min, margin) {
            let light = q_min + self.balance_abs / 2;
            let other = self.cheapest(
                ask,
                choices.iter().filter(|c| c.inflight <= light),
                &cost,
                &counted,
            )?;
            // New work leaving its prefix for a target with room for it beside another
            // prompt opens a home there: a wider margin. Where the cache cannot hold two
            // prompts the plain one: there the hottest group's home is the busiest
            // replica, and a longer wait on it cost more TTFT than the hits it kept.
            let opens_home =
                new_work && counted(pick) > 0.0 && counted(other) == 0.0 && !crowded(other, tokens);
            let wide = (self.balance_abs as f64 * NEW_HOME_MARGIN) as u64;
            if !opens_home || self.overloaded(pick.inflight, q_min, wide.max(margin)) {
                pick = other;
                if best_cached > 0.0 {
                    reason = Reason::Overloaded;
                }
            }
        }
        Some(Placed {
            index: pick.index,
            reason,
            score: counted(pick) / tokens,
            new_work,
        })
    }

    /// The cached tokens that count for a prompt of `tokens`: all of them when they cover
    /// `threshold` of it or [`ALWAYS_COUNTED_TOKENS`], else none.
    pub fn counted(&self, cached: f64, tokens: f64) -> f64 {
        if cached / tokens.max(1.0) >= self.threshold || cached >= ALWAYS_COUNTED_TOKENS {
            cached.min(tokens)
        } else {
            0.0
        }
    }

    /// New work goes only to targets with fewer than this many in flight: those whose load
    /// with the new request stays within `ceil(load_bound × mean)`, the mean counting it
    /// (consistent hashing with bounded loads), and always those at most one beyond the
    /// least loaded: at low load one request is no imbalance, and a gateway that sees only
    /// its share of the traffic (several gateways) must not spill on a difference of one.
    /// A group whose homes are all past the bound opens a new home instead of queueing.
    pub fn new_work_bound(&self, choices: &[Choice], q_min: u64) -> u64 {
        self.new_work_bound_over(choices.iter().map(|c| c.inflight), q_min)
    }

    /// [`Self::new_work_bound`] over the eligible targets' in-flight counts.
    pub fn new_work_bound_over(
        &self,
        inflight: impl ExactSizeIterator<Item = u64>,
        q_min: u64,
    ) -> u64 {
        if self.load_bound <= 0.0 {
            return u64::MAX;
        }
        let targets = inflight.len();
        let total: u64 = inflight.sum();
        let mean = (total + 1) as f64 / targets.max(1) as f64;
        let cap = (self.load_bound * mean).ceil() as u64;
        cap.max(q_min + 2)
    }

    /// Whether `c` can take a prompt of `tokens` as new work past another target's share: its
    /// cache (if known) holds the prompt twice (the group living there and this one), or it
    /// holds the prompt's prefix and is no other group's home. Under cache pressure a
    /// replica still holds the head of a group's prompt a while after a conversation of it
    /// was moved there (exact residency shows it); where another group lives, sending that
    /// group's new conversations after it has the two groups evict each other.
    fn can_host(
        &self,
        c: &Choice,
        tokens: f64,
        counted: &impl Fn(&Choice) -> f64,
        own_home: Option<usize>,
    ) -> bool {
        c.quiet
            || !crowded(c, tokens)
            || (counted(c) > 0.0 && (c.homes == 0 || Some(c.index) == own_home))
    }

    /// Most new work a target may have been given recently and still take more:
    /// `share_bound` × the eligible targets' mean, and never below the least-given target's
    /// count plus the larger of [`SHARE_SLACK`] and [`SHARE_NOISE_SIGMAS`] × √mean; on more
    /// than [`SHARE_BOUND_FLEET`] targets, `share_bound`'s excess over 1 and the
    /// [`SHARE_NOISE_SIGMAS`] are scaled by [`share_fleet_factor`]. Infinite when the bound
    /// is off.
    pub fn share_cap(&self, choices: &[Choice]) -> f64 {
        self.share_cap_over(choices.iter().map(|c| c.placed))
    }

    /// [`Self::share_cap`] over the eligible targets' counts of recent new work.
    pub fn share_cap_over(&self, placed: impl ExactSizeIterator<Item = f64> + Clone) -> f64 {
        let targets = placed.len();
        if self.share_bound <= 0.0 || targets == 0 {
            return f64::INFINITY;
        }
        let least = placed.clone().fold(f64::INFINITY, f64::min);
        let mean = placed.sum::<f64>() / targets as f64;
        let fleet = share_fleet_factor(targets);
        let bound = 1.0 + (self.share_bound - 1.0) * fleet;
        let slack = SHARE_SLACK.max(SHARE_NOISE_SIGMAS * fleet * mean.sqrt());
        (bound * mean).max(least + slack)
    }

    /// The overload guard's margin for new work whose pick holds `prefix_tokens` of it:
    /// `balance_abs`, or the requests whose queueing is worth [`GUARD_PREFILL_SHARE`] of
    /// that prefix at λ each, whichever is more.
    pub fn overload_margin(&self, prefix_tokens: f64) -> u64 {
        if self.load_cost_tokens <= 0.0 {
            return self.balance_abs;
        }
        let by_cost = (GUARD_PREFILL_SHARE * prefix_tokens / self.load_cost_tokens).floor();
        // `as` saturates: a huge prefix gives u64::MAX, never a wrap.
        self.balance_abs.max(by_cost as u64)
    }

    /// Whether `inflight` is more than `margin` beyond `q_min` and more than
    /// `balance_rel` × `q_min`.
    pub fn overloaded(&self, inflight: u64, q_min: u64, margin: u64) -> bool {
        inflight > q_min.saturating_add(margin) && inflight as f64 > self.balance_rel * q_min as f64
    }

    /// The cheapest of `choices`; within λ of it, the one holding the most of the prompt,
    /// then the highest rendezvous weight (conversation key if it holds any of the
    /// prompt, else the group key).
    fn cheapest<'c, 'l: 'c>(
        &self,
        ask: &Ask,
        choices: impl Iterator<Item = &'c Choice<'l>> + Clone,
        cost: &impl Fn(&Choice) -> f64,
        counted: &impl Fn(&Choice) -> f64,
    ) -> Option<&'c Choice<'l>> {
        let min_cost = choices.clone().map(cost).fold(f64::INFINITY, f64::min);
        let band = min_cost + self.load_cost_tokens.max(0.0);
        let near = choices.filter(|c| cost(c) <= band);
        let most_cached = near.clone().map(counted).fold(f64::NEG_INFINITY, f64::max);
        let key = if most_cached > 0.0 {
            ask.keys.conversation
        } else {
            ask.keys.group
        };
        near.filter(|c| counted(c) >= most_cached)
            .max_by_key(|c| rendezvous(key, c.label))
    }
}

/// How much of `share_bound`'s excess over the mean and of [`SHARE_NOISE_SIGMAS`] applies
/// on `targets` eligible targets: all of it up to [`SHARE_BOUND_FLEET`], then
/// √(`SHARE_BOUND_FLEET` / targets) (half on sixteen).
pub fn share_fleet_factor(targets: usize) -> f64 {
    (SHARE_BOUND_FLEET / targets.max(1) as f64).sqrt().min(1.0)
}

/// The mean of the new work recently placed on each of `choices` (non-empty).
fn mean_placed(choices: &[Choice]) -> f64 {
    choices.iter().map(|c| c.placed).sum::<f64>() / choices.len() as f64
}

/// Whether `c`'s cache (if known) holds less than twice a prompt of `tokens`: a second
/// group's prompt there evicts the first's.
fn crowded(c: &Choice, tokens: f64) -> bool {
    cache_crowded(c.cache_tokens, tokens)
}

/// Whether a cache of `cache_tokens` (0: unknown) holds less than twice a prompt of
/// `tokens`.
pub fn cache_crowded(cache_tokens: f64, tokens: f64) -> bool {
    cache_tokens > 0.0 && cache_tokens < 2.0 * tokens
}

/// Whether a target given `placed` new work recently, which must prefill the prompt's
/// prefix, may take new work the share bound moved off another target: given no more than
/// the mean (`mean_given`) and at most [`NEW_HOME_GIVEN_SLACK`] more than the least-given
/// target able to take it (`least_given`). A second home goes where there is room for it.
pub fn has_room_for_a_home(placed: f64, mean_given: f64, least_given: f64) -> bool {
    placed <= mean_given && placed <= least_given + NEW_HOME_GIVEN_SLACK
}

/// Rendezvous (highest-random-weight) weight of `key` on the target `label`.
pub fn rendezvous(key: u64, label: &str) -> u64 {
    rendezvous_hashed(key, fnv1a(label.as_bytes()))
}

/// `rendezvous(key, label)` given `fnv1a(label)`, for callers weighing many keys.
pub fn rendezvous_hashed(key: u64, label_hash: u64) -> u64 {
    splitmix64(key ^ label_hash)
}

/// FNV-1a, 64-bit: stable across processes and releases, unlike std's `DefaultHasher`,
/// so two gateways (even of different versions) place a prompt alike.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    bytes
        .iter()
        .fold(OFFSET, |h, &b| (h ^ u64::from(b)).wrapping_mul(PRIME))
}

/// SplitMix64's finaliser: spreads FNV's weak low bits over the whole word.
fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LABELS: [&str; 16] = [
        "a/m", "b/m", "c/m", "d/m", "e/m", "f/m", "g/m", "h/m", "i/m", "j/m", "k/m", "l/m", "m/m",
        "n/m", "o/m", "p/m",
    ];

    /// The default rule with λ = 300, the value these cases are worked out for.
    fn rule() -> PlacementRule {
        PlacementRule {
            load_cost_tokens: 300.0,
            ..Default::default()
        }
    }

    fn choices(loads: &[u64], cached: &[f64]) -> Vec<Choice<'static>> {
        loads
            .iter()
            .zip(cached)
            .enumerate()
            .map(|(i, (&inflight, &cached_tokens))| Choice {
                index: i,
                inflight,
                cached_tokens,
                label: LABELS[i],
                room_tokens: 0.0,
                cache_tokens: 0.0,
                placed: 0.0,
                homes: 0,
                quiet: false,
            })
            .collect()
    }

    fn ask(tokens: f64, first: f64, key: u64) -> Ask {
        Ask {
            tokens,
            first_message_tokens: first,
            keys: PlacementKeys {
                group: key,
                conversation: key.wrapping_add(1),
            },
            previous: None,
            previous_from_peer: false,
            group_home: None,
        }
    }

    #[test]
    fn the_warm_target_wins_until_its_queue_costs_more_than_the_prefill() {
        let rule = rule();
        // A 2,000-token prompt cached on 0 only: 0 keeps it while 2,000 tokens of prefill
        // outweigh λ × the extra queue. Moving would open a home for the prompt on a target
        // with room for it (caches unknown count as big): the guard's margin is
        // NEW_HOME_MARGIN × `balance_abs` = 7.
        let a = ask(2000.0, 1995.0, 7);
        for extra in 0..=7 {
            let c = choices(&[extra, 0, 0, 0], &[2000.0, 0.0, 0.0, 0.0]);
            let p = rule.place(&a, &c).unwrap();
            assert_eq!((p.index, p.reason), (0, Reason::CacheHit), "extra {extra}");
        }
        let c = choices(&[8, 0, 0, 0], &[2000.0, 0.0, 0.0, 0.0]);
        let p = rule.place(&a, &c).unwrap();
        assert_ne!(p.index, 0);
        assert_eq!(p.reason, Reason::Overloaded);
        // Where the others' caches cannot hold a second 2,000-token prompt, the plain
        // margin (`balance_abs` 5): 6 beyond the least loaded moves it.
        let crowded = |extra: u64| {
            let mut c = choices(&[extra, 0, 0, 0], &[2000.0, 0.0, 0.0, 0.0]);
            c.iter_mut().for_each(|c| c.cache_tokens = 3000.0);
            c
        };
        assert_eq!(rule.place(&a, &crowded(5)).unwrap().index, 0);
        let p = rule.place(&a, &crowded(6)).unwrap();
        assert_ne!(p.index, 0);
        assert_eq!(p.reason, Reason::Overloaded);
    }

    #[test]
    fn a_short_cached_prefix_is_worth_less_than_a_queue() {
        let rule = rule();
        // 400 cached tokens vs 3 more in flight (900 tokens of queue, more than the
        // 400 saved plus the band's one request): go elsewhere.
        // (A new conversation: the cached part is within its first message.)
        let c = choices(&[3, 0], &[400.0, 0.0]);
        let p = rule.place(&ask(500.0, 450.0, 1), &c).unwrap();
        assert_eq!((p.index, p.reason), (1, Reason::Overloaded));
    }

    #[test]
    fn a_conversation_keeps_its_target_longer_than_a_new_one() {
        let rule = rule();
        // Target 0 holds the system prompt (1,000) plus 4,000 tokens of this
        // conversation's history; 10 beyond the least loaded is within 2 × 5.
        let c = choices(&[10, 0, 0, 0], &[5000.0, 1000.0, 0.0, 0.0]);
        let p = rule.place(&ask(5100.0, 1000.0, 3), &c).unwrap();
        assert_eq!((p.index, p.reason), (0, Reason::CacheHit));
        // The same load for a new conversation (it holds only the first message): moves,
        // to the least-loaded target holding the system prompt.
        let c = choices(&[10, 0, 0, 0], &[1000.0, 1000.0, 0.0, 0.0]);
        let p = rule.place(&ask(1050.0, 1000.0, 3), &c).unwrap();
        assert_eq!((p.index, p.reason), (1, Reason::CacheHit));
        // Past twice the margin the conversation moves too. For its 5,000 held tokens the
        // margin is the queue worth half of them (8 requests at this rule's λ = 300), so
        // twice that: 16 beyond the least loaded, as its queue must be worth its history.
        let c = choices(&[16, 0, 0, 0], &[5000.0, 1000.0, 0.0, 0.0]);
        let p = rule.place(&ask(5100.0, 1000.0, 3), &c).unwrap();
        assert_eq!((p.index, p.reason), (0, Reason::CacheHit));
        let c = choices(&[17, 0, 0, 0], &[5000.0, 1000.0, 0.0, 0.0]);
        let p = rule.place(&ask(5100.0, 1000.0, 3), &c).unwrap();
        assert_eq!((p.index, p.reason), (1, Reason::Overloaded));
        // A short history keeps the plain doubled margin: 2 × `balance_abs`.
        let c = choices(&[11, 0, 0, 0], &[1400.0, 1000.0, 0.0, 0.0]);
        let p = rule.place(&ask(1500.0, 1000.0, 3), &c).unwrap();
        assert_eq!((p.index, p.reason), (1, Reason::Overloaded));
    }

    #[test]
    fn a_burst_on_a_long_shared_prompt_spreads_once_its_queue_costs_half_the_prompt() {
        let rule = PlacementRule::default();
        assert_eq!(rule.load_cost_tokens, 200.0);
        // New calls sharing a 4,000-token tool list cached on 0 only, the other caches too
        // small for a second copy (so the plain margin applies, not the new-home one).
        // Spreading one costs 4,000 tokens of prefill elsewhere: the guard waits until the
        // extra queue is worth half of it, 10 requests at λ = 200 (`balance_abs` is 5).
        let a = ask(4100.0, 4000.0, 11);
        let burst = |extra: u64| {
            let mut c = choices(&[extra, 0, 0, 0], &[4000.0, 0.0, 0.0, 0.0]);
            c.iter_mut().for_each(|c| c.cache_tokens = 6000.0);
            c
        };
        for extra in [6, 10] {
            let p = rule.place(&a, &burst(extra)).unwrap();
            assert_eq!((p.index, p.reason), (0, Reason::CacheHit), "extra {extra}");
        }
        let p = rule.place(&a, &burst(11)).unwrap();
        assert_ne!(p.index, 0);
        assert_eq!(p.reason, Reason::Overloaded);
        // The margin: never below `balance_abs`, half the prefix in λ-priced requests above it.
        assert_eq!(rule.overload_margin(0.0), 5);
        assert_eq!(rule.overload_margin(2005.0), 5);
        assert_eq!(rule.overload_margin(2400.0), 6);
        assert_eq!(rule.overload_margin(4000.0), 10);
        assert_eq!(rule.overload_margin(f64::MAX), u64::MAX);
        let no_price = PlacementRule {
            load_cost_tokens: 0.0,
            ..rule
        };
        assert_eq!(no_price.overload_margin(4000.0), 5);
    }

    #[test]
    fn a_history_two_targets_hold_alike_goes_by_cost() {
        let rule = rule();
        // Both hold the same 1,600 tokens (a shared multi-message prefix): no one's own
        // conversation, so 10 more in flight on 0 send it to 1, whatever the key.
        for key in 0..50 {
            let c = choices(&[10, 0], &[1600.0, 1600.0]);
            let p = rule.place(&ask(1650.0, 1000.0, key), &c).unwrap();
            assert_eq!((p.index, p.reason), (1, Reason::CacheHit), "key {key}");
        }
    }

    #[test]
    fn the_relative_guard_holds_at_high_load() {
        let rule = rule();
        // 20 vs 16: more than 6 beyond? no. 30 vs 22: 8 beyond but not > 1.3 × 22.
        assert!(!rule.overloaded(20, 16, 6));
        assert!(!rule.overloaded(28, 22, 6));
        assert!(rule.overloaded(29, 22, 6));
        assert!(rule.overloaded(7, 0, 6));
        assert!(!rule.overloaded(6, 0, 6));
    }

    #[test]
    fn a_trivial_shared_start_does_not_pin() {
        let rule = rule();
        // 40 of 1,000 tokens (the chat template) is below the 0.5 threshold.
        let c = choices(&[0, 0, 0], &[40.0, 0.0, 0.0]);
        let p = rule.place(&ask(1000.0, 500.0, 9), &c).unwrap();
        assert_eq!(p.reason, Reason::BelowThreshold);
        assert_eq!(p.score, 0.0);
    }

    #[test]
    fn cold_placement_is_deterministic_by_the_group_key_and_spreads_groups() {
        let rule = rule();
        let c = choices(&[0, 0, 0, 0], &[0.0; 4]);
        let mut homes = [0usize; 4];
        for group in 0..400u64 {
            let a = ask(2000.0, 1900.0, group.wrapping_mul(0x9e37_79b9));
            let first = rule.place(&a, &c).unwrap();
            // The same group lands on the same target every time, whatever the
            // conversation key.
            for conv in 0..5 {
                let mut b = a;
                b.keys.conversation = conv;
                assert_eq!(rule.place(&b, &c).unwrap().index, first.index);
            }
            homes[first.index] += 1;
        }
        assert!(homes.iter().all(|&n| n > 60), "{homes:?}");
    }

    #[test]
    fn conversations_spread_over_the_targets_holding_their_group() {
        let rule = rule();
        // 0 and 1 hold the 2,000-token system prompt, 2 and 3 do not.
        let c = choices(&[3, 3, 0, 0], &[2000.0, 2000.0, 0.0, 0.0]);
        let mut seen = [0usize; 4];
        for conv in 0..200u64 {
            let a = Ask {
                tokens: 2060.0,
                first_message_tokens: 2000.0,
                keys: PlacementKeys {
                    group: 42,
                    conversation: conv.wrapping_mul(0x2545_f491),
                },
                previous: None,
                previous_from_peer: false,
                group_home: None,
            };
            seen[rule.place(&a, &c).unwrap().index] += 1;
        }
        assert_eq!(seen[2] + seen[3], 0, "{seen:?}");
        assert!(seen[0] > 60 && seen[1] > 60, "{seen:?}");
    }

    #[test]
    fn within_the_band_the_target_holding_more_history_wins() {
        let rule = rule();
        // 1 holds 100 more tokens (a short history) and has one more in flight: the band
        // (λ = 300) ties them, and the history decides, whatever the key.
        let c = choices(&[0, 1], &[2000.0, 2100.0]);
        for key in 0..50 {
            let p = rule.place(&ask(2150.0, 2000.0, key), &c).unwrap();
            assert_eq!(p.index, 1, "key {key}");
        }
    }

    fn with_room(mut c: Vec<Choice<'static>>, room: &[f64]) -> Vec<Choice<'static>> {
        for (c, &r) in c.iter_mut().zip(room) {
            c.room_tokens = r;
        }
        c
    }

    #[test]
    fn a_new_conversation_past_the_load_bound_opens_a_home_on_a_target_with_room() {
        let rule = PlacementRule {
            load_bound: 1.5,
            ..rule()
        };
        // 0 holds the group's 2,000-token prompt and has 4 in flight; the mean counting
        // this request is 6/4, so a target may reach ceil(1.5 × 1.5) = 3 with it: 0 is
        // past that, and the other targets have room for the whole prompt.
        let loads = [4, 0, 1, 0];
        let cached = [2000.0, 0.0, 0.0, 0.0];
        let c = with_room(choices(&loads, &cached), &[0.0, 8000.0, 8000.0, 8000.0]);
        for key in 0..50 {
            let p = rule.place(&ask(2060.0, 2000.0, key), &c).unwrap();
            assert_ne!(p.index, 0, "key {key}");
            assert_eq!(p.reason, Reason::Overloaded);
        }
        // A full fleet (no room anywhere): spilling would evict another group's prompt,
        // so the cost rule keeps it home (4 × λ = 1,200 < 2,000 tokens of prefill).
        let c = choices(&loads, &cached);
        let p = rule.place(&ask(2060.0, 2000.0, 5), &c).unwrap();
        assert_eq!((p.index, p.reason), (0, Reason::CacheHit));
        // No bound (0): home too, room or not.
        let off = PlacementRule {
            load_bound: 0.0,
            ..rule
        };
        let c = with_room(choices(&loads, &cached), &[0.0, 8000.0, 8000.0, 8000.0]);
        let p = off.place(&ask(2060.0, 2000.0, 5), &c).unwrap();
        assert_eq!(p.index, 0);
    }

    #[test]
    fn the_load_bound_never_moves_a_conversation_off_its_history() {
        let rule = PlacementRule {
            load_bound: 1.5,
            ..rule()
        };
        // 0 holds this conversation's 3,000 tokens of history: past the bound but within
        // twice the overload margin, it stays.
        let c = with_room(
            choices(&[5, 0, 0, 0], &[5000.0, 2000.0, 0.0, 0.0]),
            &[0.0, 8000.0, 8000.0, 8000.0],
        );
        let p = rule.place(&ask(5100.0, 2000.0, 5), &c).unwrap();
        assert_eq!((p.index, p.reason), (0, Reason::CacheHit));
    }

    fn with_placed(mut c: Vec<Choice<'static>>, placed: &[f64]) -> Vec<Choice<'static>> {
        for (c, &p) in c.iter_mut().zip(placed) {
            c.placed = p;
        }
        c
    }

    #[test]
    fn a_target_given_more_than_its_share_of_new_work_takes_no_more() {
        let rule = PlacementRule {
            share_bound: 1.15,
            ..rule()
        };
        // 0 holds the group's prompt and is its home. New work given so far: mean 32.5, so
        // a target may have been given 1.15 × 32.5 = 37.4, or the least given (31) plus
        // 2 × √32.5 = 42.4, and still take more.
        let cached = [2000.0, 0.0, 0.0, 0.0];
        let mut a = ask(2060.0, 2000.0, 9);
        a.group_home = Some(GroupHome::Known(0));
        let within = with_placed(choices(&[0, 0, 0, 0], &cached), &[37.0, 31.0, 31.0, 31.0]);
        let p = rule.place(&a, &within).unwrap();
        assert_eq!((p.index, p.reason, p.new_work), (0, Reason::CacheHit, true));
        // Past it, the new conversation opens a home elsewhere though it must prefill the
        // group's prompt there: the cheapest target within the bound (the least loaded).
        let given = [48.0, 30.0, 30.0, 30.0];
        let past = with_placed(choices(&[0, 2, 0, 2], &cached), &given);
        for key in 0..50 {
            let mut a = ask(2060.0, 2000.0, key);
            a.group_home = Some(GroupHome::Known(0));
            let p = rule.place(&a, &past).unwrap();
            assert_eq!((p.index, p.reason), (2, Reason::ShareBound), "key {key}");
        }
        // A second home that holds the prompt takes it without a prefill.
        let second = with_placed(choices(&[0, 2, 0, 2], &[2000.0, 2000.0, 0.0, 0.0]), &given);
        let p = rule.place(&a, &second).unwrap();
        assert_eq!((p.index, p.reason), (1, Reason::ShareBound));
        // No bound (0): home, whatever it was given.
        let off = PlacementRule {
            share_bound: 0.0,
            ..rule
        };
        assert_eq!(off.place(&a, &past).unwrap().index, 0);
    }

    #[test]
    fn a_cold_prompt_skips_an_idle_target_past_its_share() {
        let rule = PlacementRule {
            share_bound: 1.15,
            load_bound: 0.0,
            ..rule()
        };
        // Nobody holds the prompt; 1 and 2 are idle, 0 and 3 busy. 2 was given far more new
        // work than its share: the pick is 1 whatever the key (without the bound, the
        // group key splits them).
        let c = with_placed(choices(&[9, 0, 0, 9], &[0.0; 4]), &[10.0, 10.0, 40.0, 10.0]);
        for key in 0..50 {
            let p = rule.place(&ask(500.0, 400.0, key), &c).unwrap();
            assert_eq!(p.index, 1, "key {key}");
        }
        let off = PlacementRule {
            share_bound: 0.0,
            ..rule
        };
        assert!((0..50).any(|key| off.place(&ask(500.0, 400.0, key), &c).unwrap().index == 2));
    }

    #[test]
    fn the_share_bound_opens_no_home_where_the_cache_cannot_hold_two_prompts() {
        let rule = PlacementRule {
            share_bound: 1.15,
            ..rule()
        };
        // 0 is the group's home and past its share; the others hold other groups. With
        // caches of 3,000 tokens a second 2,060-token prompt would evict the group living
        // there: the prompt stays home. With 8,000 it spills.
        let given = [48.0, 30.0, 30.0, 30.0];
        let cached = [2000.0, 0.0, 0.0, 0.0];
        let with_cache = |tokens: f64| {
            let mut c = with_placed(choices(&[0, 0, 0, 0], &cached), &given);
            c.iter_mut().for_each(|c| c.cache_tokens = tokens);
            c
        };
        for key in 0..50 {
            let a = ask(2060.0, 2000.0, key);
            assert_eq!(rule.place(&a, &with_cache(3000.0)).unwrap().index, 0);
            let p = rule.place(&a, &with_cache(8000.0)).unwrap();
            assert_eq!(p.reason, Reason::ShareBound, "key {key}");
        }
        // 1 still holds the group's prompt (a conversation of it was moved there) but is
        // another group's home: with 3,000-token caches the prompt stays home all the same.
        // A target hosting no group that holds the prompt takes it.
        let held = |one_hosts_a_group: bool| {
            let mut c = with_cache(3000.0);
            c[1].cached_tokens = 2000.0;
            for (i, c) in c.iter_mut().enumerate() {
                c.homes = usize::from(i != 1 || one_hosts_a_group);
            }
            c
        };
        for key in 0..50 {
            let mut a = ask(2060.0, 2000.0, key);
            a.group_home = Some(GroupHome::Known(0));
            assert_eq!(rule.place(&a, &held(true)).unwrap().index, 0, "key {key}");
            let p = rule.place(&a, &held(false)).unwrap();
            assert_eq!((p.index, p.reason), (1, Reason::ShareBound), "key {key}");
        }
    }

    #[test]
    fn the_share_bound_waits_for_a_few_conversations_of_difference() {
        let rule = PlacementRule {
            share_bound: 1.15,
            ..rule()
        };
        // At low traffic the mean is tiny: 0 may take SHARE_SLACK more than the least
        // given before the bound moves anything.
        let cached = [2000.0, 0.0, 0.0, 0.0];
        let a = ask(2060.0, 2000.0, 4);
        let slack = SHARE_SLACK;
        let at = with_placed(choices(&[0, 0, 0, 0], &cached), &[slack, 0.0, 0.0, 0.0]);
        assert_eq!(rule.place(&a, &at).unwrap().index, 0);
        let past = with_placed(
            choices(&[0, 0, 0, 0], &cached),
            &[slack + 1.0, 0.0, 0.0, 0.0],
        );
        assert_ne!(rule.place(&a, &past).unwrap().index, 0);
    }

    /// The rule with the share bound's default on.
    fn share_bounded() -> PlacementRule {
        PlacementRule {
            share_bound: DEFAULT_SHARE_BOUND,
            ..rule()
        }
    }

    /// A new conversation (2,060 tokens, a 2,000-token first message) of the group whose
    /// home is `home`.
    fn new_conversation_of(home: usize, key: u64) -> Ask {
        let mut a = ask(2060.0, 2000.0, key);
        a.group_home = Some(GroupHome::Known(home));
        a
    }

    #[test]
    fn an_excess_within_chance_opens_no_second_home() {
        let rule = share_bounded();
        // Traced on multi-turn (seed 42): 47 conversations in, the home of a group with a
        // quarter of the traffic had been given 14 and the others 12, 9 and 12. Past
        // 1.15 × the mean (13.5) and the least given + 4, but within 2 × √11.75 = 6.9 of
        // the least given: chance, not a share the group needs more homes for.
        let cached = [2000.0, 0.0, 0.0, 0.0];
        let a = new_conversation_of(0, 5);
        let early = with_placed(choices(&[0, 0, 0, 0], &cached), &[14.0, 12.0, 9.0, 12.0]);
        assert_eq!(rule.place(&a, &early).unwrap().index, 0);
        // 17 is past 9 + 2 × √12.5 = 16.1: it spills.
        let past = with_placed(choices(&[0, 0, 0, 0], &cached), &[17.0, 12.0, 9.0, 12.0]);
        assert_eq!(rule.place(&a, &past).unwrap().reason, Reason::ShareBound);
    }

    #[test]
    fn on_sixteen_targets_a_smaller_excess_spills() {
        let rule = share_bounded();
        // The group's home was given 27 new conversations, every other target 20. On four
        // targets that is within 2 × √21.75 = 9.3 of the least given: chance, it stays home.
        // On sixteen the bound is 1 + 0.15 × √(4 / 16) = 1.075 × the mean (22.0) and the
        // slack 2 × √(4 / 16) × √20.4 = 4.5, so the cap is max(22.0, 20 + 4.5) = 24.5 < 27:
        // it spills (unscaled, max(23.5, 20 + 9.0) = 29.0: it would stay home).
        let spills = |targets: usize| {
            let mut cached = vec![0.0; targets];
            cached[0] = 2000.0;
            let mut given = vec![20.0; targets];
            given[0] = 27.0;
            let c = with_placed(choices(&vec![0; targets], &cached), &given);
            rule.place(&new_conversation_of(0, 5), &c).unwrap().reason == Reason::ShareBound
        };
        assert!(!spills(4));
        assert!(spills(16));
        assert_eq!(share_fleet_factor(2), 1.0);
        assert_eq!(share_fleet_factor(4), 1.0);
        assert_eq!(share_fleet_factor(16), 0.5);
        // Where the bound, not the slack, sets the cap (10,000 given each, √mean = 100):
        // 1.15 × the mean on four targets, 1.075 × on sixteen.
        let cap = |targets: usize| {
            let c = with_placed(
                choices(&vec![0; targets], &vec![0.0; targets]),
                &vec![1e4; targets],
            );
            rule.share_cap(&c)
        };
        assert!((cap(4) - 11_500.0).abs() < 1e-6, "{}", cap(4));
        assert!((cap(16) - 10_750.0).abs() < 1e-6, "{}", cap(16));
    }

    #[test]
    fn a_share_bound_spill_opens_a_home_where_least_was_given() {
        let rule = share_bounded();
        // 3 is the busiest group's home, past its share; no other target holds its prompt.
        // 0 is within the bound but above the mean (18.5), 1 below it but more than one
        // beyond the least given: the group's second home opens on 2, whatever the key,
        // and does not push 0's or 1's own group past the bound in turn.
        let given = [20.0, 17.0, 11.0, 26.0];
        let mut cached = [0.0, 0.0, 0.0, 2000.0];
        for key in 0..50 {
            let c = with_placed(choices(&[0, 0, 0, 0], &cached), &given);
            let p = rule.place(&new_conversation_of(3, key), &c).unwrap();
            assert_eq!((p.index, p.reason), (2, Reason::ShareBound), "key {key}");
        }
        // A target already holding the prompt (its second home) takes it without a prefill,
        // though it was given more.
        cached[1] = 2000.0;
        let c = with_placed(choices(&[0, 0, 0, 0], &cached), &given);
        let p = rule.place(&new_conversation_of(3, 3), &c).unwrap();
        assert_eq!((p.index, p.reason), (1, Reason::ShareBound));
    }

    #[test]
    fn the_share_bound_never_moves_a_conversation_off_its_history() {
        let rule = PlacementRule {
            share_bound: 1.15,
            ..rule()
        };
        // 0 holds this conversation's history and was given far more than its share.
        let c = with_placed(
            choices(&[0, 0, 0, 0], &[5000.0, 2000.0, 0.0, 0.0]),
            &[40.0, 10.0, 10.0, 10.0],
        );
        let p = rule.place(&ask(5100.0, 2000.0, 5), &c).unwrap();
        assert_eq!(
            (p.index, p.reason, p.new_work),
            (0, Reason::CacheHit, false)
        );
    }

    #[test]
    fn a_forgotten_history_returns_to_the_target_that_served_the_last_turn() {
        let rule = rule();
        // Two targets hold the group's prompt alike and no view holds the history: the
        // previous target wins, whatever the key, though it has 3 more in flight (the cost
        // rule alone would move the turn: 3 × λ is past the one-request band).
        for key in 0..50 {
            for previous in [0, 1] {
                let mut loads = [0, 0, 0, 0];
                loads[previous] = 3;
                let c = choices(&loads, &[2000.0, 2000.0, 0.0, 0.0]);
                let mut a = ask(2400.0, 2000.0, key);
                assert_eq!(rule.place(&a, &c).unwrap().index, 1 - previous, "key {key}");
                a.previous = Some(previous);
                let p = rule.place(&a, &c).unwrap();
                assert_eq!(
                    (p.index, p.reason),
                    (previous, Reason::CacheHit),
                    "key {key}"
                );
            }
        }
        // A previous target that no longer holds the group's prompt is no home: the cost
        // rule places the turn among the targets that do.
        let c = choices(&[0, 0, 0, 0], &[2000.0, 0.0, 0.0, 0.0]);
        let mut a = ask(2400.0, 2000.0, 3);
        a.previous = Some(2);
        assert_eq!(rule.place(&a, &c).unwrap().index, 0);
        // When no view holds any of the prompt, the turn is new work: placed by the cost
        // rule, so a previous target 3 beyond the least loaded does not get it back.
        let c = choices(&[0, 0, 3, 0], &[0.0, 0.0, 0.0, 0.0]);
        let p = rule.place(&a, &c).unwrap();
        assert_ne!(p.index, 2);
        assert!(p.new_work);
    }

    /// A turn whose last turn another gateway placed goes where the peer put it, even where
    /// this gateway's views hold only the group's prefix there and another target holds
    /// older history, until that target is truly overloaded; not where this gateway's view
    /// holds nothing of the prompt (the replica has likely evicted it).
    #[test]
    fn a_peers_placement_keeps_the_conversation_while_the_target_holds_its_group() {
        let rule = rule();
        for key in 0..50 {
            // Target 0 holds older history of the conversation here; the peer placed the
            // last turn on 3, which holds the system prompt in this gateway's views.
            let c = choices(&[0, 0, 0, 2], &[2300.0, 2000.0, 0.0, 2000.0]);
            let mut a = ask(2600.0, 2000.0, key);
            a.previous = Some(3);
            assert_eq!(rule.place(&a, &c).unwrap().index, 0, "key {key}");
            a.previous_from_peer = true;
            let p = rule.place(&a, &c).unwrap();
            assert_eq!((p.index, p.reason), (3, Reason::CacheHit), "key {key}");
            assert!(!p.new_work, "a continuation is not new work");
            // Past twice `balance_abs` beyond the least loaded (and `balance_rel`), the
            // overload guard moves it as it would any conversation.
            let busy = choices(&[1, 1, 1, 12], &[2300.0, 2000.0, 0.0, 2000.0]);
            assert_ne!(rule.place(&a, &busy).unwrap().index, 3, "key {key}");
            // Holding nothing of the prompt here, 3 is no home: the history is placed by
            // this gateway's views.
            let gone = choices(&[0, 0, 0, 2], &[2300.0, 2000.0, 0.0, 0.0]);
            assert_eq!(rule.place(&a, &gone).unwrap().index, 0, "key {key}");
        }
        // A peer's target that is not eligible here (not among the choices) is no home.
        let c = choices(&[0, 0, 0], &[2300.0, 2000.0, 0.0]);
        let mut a = ask(2600.0, 2000.0, 1);
        a.previous = Some(3);
        a.previous_from_peer = true;
        assert_eq!(rule.place(&a, &c).unwrap().index, 0);
    }

    #[test]
    fn no_choices_no_placement() {
        assert!(PlacementRule::default()
            .place(&ask(10.0, 5.0, 1), &[])
            .is_none());
    }

    #[test]
    fn keys_follow_message_boundaries() {
        let conv_a = b"Csystem\x1fS\x1euser\x1fhello\x1eassistant\x1fhi\x1e";
        let conv_a_later = b"Csystem\x1fS\x1euser\x1fhello\x1eassistant\x1fhi\x1euser\x1fmore\x1e";
        let conv_b = b"Csystem\x1fS\x1euser\x1fother\x1e";
        let (a, first) = PlacementKeys::from_prompt(conv_a);
        let (a2, _) = PlacementKeys::from_prompt(conv_a_later);
        let (b, _) = PlacementKeys::from_prompt(conv_b);
        assert_eq!(first, b"Csystem\x1fS\x1e".len());
        assert_eq!(a, a2, "a conversation keeps its keys as it grows");
        assert_eq!(a.group, b.group, "same system prompt, same group");
        assert_ne!(a.conversation, b.conversation);
        // An escaped RS inside a message is not a boundary.
        let (_, first) = PlacementKeys::from_prompt(b"Csystem\x1fS\x1b\x1eS\x1euser\x1fx\x1e");
        assert_eq!(first, b"Csystem\x1fS\x1b\x1eS\x1e".len());
        // A session id replaces the conversation key only.
        let s = a.with_session(Some("sess-1"));
        assert_eq!(s.group, a.group);
        assert_ne!(s.conversation, a.conversation);
        assert_eq!(a.with_session(None), a);
    }

    #[test]
    fn conversation_keys_differ_behind_a_long_system_prompt() {
        let system = "s".repeat(3 * MAX_KEY_BYTES);
        let a = format!("Csystem\x1f{system}\x1euser\x1fone\x1e");
        let b = format!("Csystem\x1f{system}\x1euser\x1ftwo\x1e");
        let (ka, _) = PlacementKeys::from_prompt(a.as_bytes());
        let (kb, _) = PlacementKeys::from_prompt(b.as_bytes());
        assert_eq!(ka.group, kb.group);
        assert_ne!(ka.conversation, kb.conversation);
    }

    #[test]
    fn completion_prompts_have_no_message_boundaries() {
        // Token ids are raw big-endian bytes: 30 is an RS byte, 27 an ESC byte.
        let mut p = vec![b'P'];
        for id in [1u32, 30, 2000, 27, 5] {
            p.extend(id.to_be_bytes());
        }
        let (_, first) = PlacementKeys::from_prompt(&p);
        assert_eq!(first, p.len());
        assert_eq!(crate::prompt::first_two_message_ends(&p), (None, None));
    }

    #[test]
    fn a_new_conversation_goes_to_its_group_home_when_it_is_no_busier() {
        let rule = rule();
        // Target 0 holds the group's 2,000-token system prompt; the home is 2.
        let with_home = |home| Ask {
            group_home: Some(GroupHome::Known(home)),
            ..ask(2100.0, 2000.0, 7)
        };
        let c = choices(&[1, 0, 0, 0], &[2000.0, 0.0, 0.0, 0.0]);
        let without = rule.place(&ask(2100.0, 2000.0, 7), &c).unwrap();
        assert_eq!((without.index, without.reason), (0, Reason::CacheHit));
        let p = rule.place(&with_home(2), &c).unwrap();
        assert_eq!((p.index, p.reason), (2, Reason::GroupHome));
        // Equal loads still go home; a busier home does not take it.
        let c = choices(&[1, 0, 1, 0], &[2000.0, 0.0, 0.0, 0.0]);
        assert_eq!(rule.place(&with_home(2), &c).unwrap().index, 2);
        let c = choices(&[1, 0, 2, 0], &[2000.0, 0.0, 0.0, 0.0]);
        assert_eq!(rule.place(&with_home(2), &c).unwrap().index, 0);
        // A home holding the prefix is a plain cache hit.
        let c = choices(&[1, 0, 0, 0], &[2000.0, 0.0, 2000.0, 0.0]);
        let p = rule.place(&with_home(2), &c).unwrap();
        assert_eq!((p.index, p.reason), (2, Reason::CacheHit));
        // Off: the rule ignores the home.
        let off = PlacementRule {
            group_homes: false,
            ..rule
        };
        let c = choices(&[1, 0, 0, 0], &[2000.0, 0.0, 0.0, 0.0]);
        assert_eq!(off.place(&with_home(2), &c).unwrap().index, 0);
    }

    #[test]
    fn under_cache_pressure_a_group_home_holding_the_prefix_keeps_its_new_conversations() {
        let rule = rule();
        let a = Ask {
            group_home: Some(GroupHome::Known(0)),
            ..ask(2100.0, 2000.0, 7)
        };
        // Every target is some group's home.
        let with_cache = |mut c: Vec<Choice<'static>>, cache: f64| {
            c.iter_mut()
                .for_each(|c| (c.cache_tokens, c.homes) = (cache, 1));
            c
        };
        // The home (0) and another group's home (1, where one of this group's
        // conversations spilled) both hold the group's prompt; 1 is less busy.
        let loads = [3, 1, 2, 2];
        let cached = [2000.0, 2000.0, 0.0, 0.0];
        let keys_to_1 = (0..50)
            .filter(|&k| {
                let a = Ask {
                    keys: PlacementKeys {
                        group: k,
                        conversation: k + 1,
                    },
                    ..a
                };
                // Caches that hold two prompts: the home, being busier, loses to 1.
                let roomy = with_cache(choices(&loads, &cached), 8192.0);
                let p = rule.place(&a, &roomy).unwrap().index;
                // Caches that hold one prompt (3,072 tokens): the home keeps it.
                let tight = with_cache(choices(&loads, &cached), 3072.0);
                assert_eq!(rule.place(&a, &tight).unwrap().index, 0, "key {k}");
                p == 1
            })
            .count();
        assert_eq!(keys_to_1, 50);
        // Pinned, the share bound does not move it off the home, however much new work
        // the home was given.
        let mut tight = with_cache(choices(&loads, &cached), 3072.0);
        tight[0].placed = 20.0;
        assert_eq!(rule.place(&a, &tight).unwrap().index, 0);
        // While some target hosts no group, a group may open a second home.
        let mut tight = with_cache(choices(&loads, &cached), 3072.0);
        tight[3].homes = 0;
        assert_eq!(rule.place(&a, &tight).unwrap().index, 1);
        // A home holding less of the prompt than the pick is not pinned: busier, it
        // loses.
        let tight = with_cache(choices(&loads, &[0.0, 2000.0, 0.0, 0.0]), 3072.0);
        assert_eq!(rule.place(&a, &tight).unwrap().index, 1);
        // The overload guard still moves it: the home 6 beyond the least loaded.
        let tight = with_cache(choices(&[7, 1, 2, 2], &cached), 3072.0);
        let p = rule.place(&a, &tight).unwrap();
        assert_ne!(p.index, 0);
    }

    #[test]
    fn under_cache_pressure_a_conversation_on_another_groups_home_goes_to_its_own() {
        let rule = rule();
        // The conversation's turns were on 1, another group's home; its own group's home is
        // 0. A 2,000-token system prompt, `history` tokens of it held on 1.
        let a = |history: f64| Ask {
            group_home: Some(GroupHome::Known(0)),
            previous: Some(1),
            ..ask(2100.0 + history, 2000.0, 7)
        };
        let fleet = |loads: &[u64], cached: &[f64], cache: f64| {
            let mut c = choices(loads, cached);
            c.iter_mut()
                .for_each(|c| (c.cache_tokens, c.homes) = (cache, 1));
            c
        };
        let on_1 = |history: f64| [2000.0, 2000.0 + history, 0.0, 0.0];
        // One prompt fills a cache (3,072 tokens): 200 tokens of history (less than
        // 2 λ = 600) are not worth the two groups evicting each other on 1.
        let p = rule
            .place(&a(200.0), &fleet(&[2, 2, 2, 2], &on_1(200.0), 3072.0))
            .unwrap();
        assert_eq!(
            (p.index, p.reason, p.new_work),
            (0, Reason::GroupHome, false)
        );
        // 700 tokens of history are: it stays.
        let p = rule
            .place(&a(700.0), &fleet(&[2, 2, 2, 2], &on_1(700.0), 3072.0))
            .unwrap();
        assert_eq!((p.index, p.reason), (1, Reason::CacheHit));
        // Where a cache holds two prompts, the groups do not evict each other: it stays.
        let p = rule
            .place(&a(200.0), &fleet(&[2, 2, 2, 2], &on_1(200.0), 8192.0))
            .unwrap();
        assert_eq!(p.index, 1);
        // Nor while some target hosts no group.
        let mut c = fleet(&[2, 2, 2, 2], &on_1(200.0), 3072.0);
        c[3].homes = 0;
        assert_eq!(rule.place(&a(200.0), &c).unwrap().index, 1);
        // Nor to a home that holds none of the prompt yet: a 300-token system prompt and
        // 200 tokens of history on 1 (caches of 1,024 tokens hold one such prompt).
        let short = Ask {
            group_home: Some(GroupHome::Known(0)),
            previous: Some(1),
            ..ask(700.0, 300.0, 7)
        };
        let c = fleet(&[2, 2, 2, 2], &[300.0, 500.0, 0.0, 0.0], 1024.0);
        assert_eq!(rule.place(&short, &c).unwrap().index, 0);
        let c = fleet(&[2, 2, 2, 2], &[0.0, 500.0, 0.0, 0.0], 1024.0);
        assert_eq!(rule.place(&short, &c).unwrap().index, 1);
        // A peer placed it there: the peer's homes are the same, and it moved it on purpose.
        let from_peer = Ask {
            previous_from_peer: true,
            ..a(200.0)
        };
        let c = fleet(&[2, 2, 2, 2], &on_1(200.0), 3072.0);
        assert_eq!(rule.place(&from_peer, &c).unwrap().index, 1);
        // The home keeps it as the conversation's own target would: 8 beyond the least
        // loaded is within a conversation's margin (10)...
        let p = rule
            .place(&a(200.0), &fleet(&[9, 1, 2, 2], &on_1(200.0), 3072.0))
            .unwrap();
        assert_eq!((p.index, p.reason), (0, Reason::GroupHome));
        // ...12 beyond it is not: the guard sends it to the target holding its history.
        let p = rule
            .place(&a(200.0), &fleet(&[13, 1, 2, 2], &on_1(200.0), 3072.0))
            .unwrap();
        assert_eq!((p.index, p.reason), (1, Reason::Overloaded));
    }

    #[test]
    fn under_cache_pressure_a_target_whose_groups_went_quiet_takes_a_busy_groups_new_work() {
        let rule = share_bounded();
        // Every target is some group's home and no cache holds two prompts; 0, this
        // group's home, was given more than its share (mean 26: cap 30.2).
        let tight = |quiet_one: bool| {
            let mut c = with_placed(
                choices(&[3, 1, 2, 2], &[2000.0, 0.0, 0.0, 0.0]),
                &[34.0, 20.0, 25.0, 25.0],
            );
            c.iter_mut()
                .for_each(|c| (c.cache_tokens, c.homes) = (3072.0, 1));
            c[1].quiet = quiet_one;
            c
        };
        for key in 0..50 {
            let a = new_conversation_of(0, key);
            // 1's group is still opening conversations: the home keeps the prompt.
            assert_eq!(rule.place(&a, &tight(false)).unwrap().index, 0, "key {key}");
            // 1's group has gone quiet: 1 hosts no group that needs its cache.
            let p = rule.place(&a, &tight(true)).unwrap();
            assert_eq!((p.index, p.reason), (1, Reason::ShareBound), "key {key}");
        }
    }

    #[test]
    fn a_target_whose_groups_went_quiet_takes_a_conversation_once_it_holds_the_group_prefix() {
        let rule = rule();
        // The conversation's history (400 tokens past a 2,000-token system prompt) is on 0,
        // its group's home; 1 holds the system prompt.
        let a = Ask {
            group_home: Some(GroupHome::Known(0)),
            ..ask(2400.0, 2000.0, 7)
        };
        let with = |loads: &[u64], cached: &[f64], quiet_one: bool| {
            let mut c = choices(loads, cached);
            c[1].quiet = quiet_one;
            c
        };
        let held = [2400.0, 2000.0, 0.0, 0.0];
        // 5 beyond 1: not overloaded (a conversation's margin is 10), so it stays home...
        let p = rule.place(&a, &with(&[6, 1, 3, 3], &held, false)).unwrap();
        assert_eq!((p.index, p.reason), (0, Reason::CacheHit));
        // ...unless 1's groups have gone quiet: there it costs 400 + 0 against 0's
        // λ × 5 = 1,500.
        let p = rule.place(&a, &with(&[6, 1, 3, 3], &held, true)).unwrap();
        assert_eq!((p.index, p.reason), (1, Reason::Overloaded));
        // Not when the saving is within λ (400 + 300 against 600)...
        let p = rule.place(&a, &with(&[3, 1, 3, 3], &held, true)).unwrap();
        assert_eq!(p.index, 0);
        // ...nor when 1 holds none of the prompt (the whole prefill against 1,500).
        let p = rule
            .place(&a, &with(&[6, 1, 3, 3], &[2400.0, 0.0, 0.0, 0.0], true))
            .unwrap();
        assert_eq!(p.index, 0);
    }

    #[test]
    fn a_conversation_with_history_is_not_sent_to_its_group_home() {
        let rule = rule();
        // Target 0 holds 600 tokens of history beyond the system prompt.
        let c = choices(&[0, 0, 0, 0], &[2600.0, 2000.0, 0.0, 0.0]);
        let a = Ask {
            group_home: Some(GroupHome::Known(2)),
            ..ask(2700.0, 2000.0, 7)
        };
        let p = rule.place(&a, &c).unwrap();
        assert_eq!((p.index, p.reason), (0, Reason::CacheHit));
        // The same history held alike by two targets is placed between them, not at home.
        let c = choices(&[0, 0, 0, 0], &[2600.0, 2600.0, 0.0, 0.0]);
        assert!(rule.place(&a, &c).unwrap().index < 2);
    }

    #[test]
    fn placement_keys_are_the_same_in_every_version() {
        // Gateways of two versions behind one balancer must key a prompt alike (XXH3-64 of
        // the first message's first 4 KiB; of the second message, mixed with it): a change
        // of the key function fails here. Values from the reference implementation (Python
        // `xxhash.xxh3_64_intdigest`, then SplitMix64 of the XOR).
        let (keys, first) = PlacementKeys::from_prompt(b"Csystem\x1fbe brief\x1euser\x1fhi\x1e");
        assert_eq!(first, 17);
        assert_eq!(keys.group, 0x6899_9927_f000_b668, "{:#x}", keys.group);
        assert_eq!(
            keys.conversation, 0xaa11_8857_4ded_21e4,
            "{:#x}",
            keys.conversation
        );
    }

    #[test]
    fn fnv1a_matches_the_reference_vectors() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
    }
}
