//! `cache_aware`: send a request to the target whose prefix trie holds most of its prompt,
//! unless the queue there costs more than recomputing the prompt elsewhere (SPEC §4).
//!
//! Each target's trie holds the keys (`prefix::key`: a hash per 64-byte chunk) of the
//! prompts routed to it (inserted when the decision is made, so a burst of requests sharing
//! a new prefix sees where the first one went, as the replica does once it starts
//! prefilling). A match counts the prompt's whole chunks a trie holds; scores are turned
//! into cached tokens (`prompt bytes / prompt_bytes_per_token`) and handed to the shared
//! placement rule ([`super::placement`]): cost = uncached tokens + `load_cost_tokens` ×
//! extra queue, deterministic ties, and an overload guard that keeps a conversation on its
//! target longer than it keeps a new one. Only eligible targets are compared (a broken
//! replica's empty queue never makes the others look busy). An empty prompt goes to the
//! least-loaded target (`fallback`). When no trie holds any of a prompt whose group has a
//! home whose trie has no room for the prompt (it forgets), the home is taken to hold the
//! head of the group's first message ([`HOME_HEAD_SHARE`]): the trie forgets whole prompts,
//! the replica frees blocks tail first.

use super::group_homes::GroupHomes;
use super::placement::{Ask, Choice, GroupHome, PlacementKeys, PlacementRule};
use super::{Candidate, Decision, FleetView, Reason, RouteInput, SessionTable, Strategy};
use crate::prefix::key::{self, CHUNK_BYTES, HASH_BYTES};
use crate::prefix::{MatchHint, PrefixTrie};
use std::borrow::Cow;
use std::sync::Arc;

/// Default minimum prefix score to pin a request to its best-matching target (SPEC §4).
pub const DEFAULT_CACHE_THRESHOLD: f64 = 0.5;
/// Share of its group's first message a group's home is taken to hold when no trie holds
/// any of the prompt. A trie sized to its replica's cache forgets whole prompts, oldest
/// first: one other group's long prompt inserted there drops every prompt of the group
/// living there, system prompt included. vLLM frees a finished request's blocks tail first
/// and evicts the least recently freed, so the replica still holds the start of that
/// system prompt (a 3,072-token cache after a 2,070-token foreign prompt: about the first
/// 1,000 of a 2,000-token one). Chosen by measurement (docs/routing.md).
pub const HOME_HEAD_SHARE: f64 = 0.3;

/// Default prompt bytes per token: English text averages about 4 characters per BPE token
/// (OpenAI's rule of thumb); the chat encoding adds a few bytes per message.
pub const DEFAULT_PROMPT_BYTES_PER_TOKEN: f64 = 4.0;
/// Distinct prompt bytes a trie node of prompt keys stands for on average when filled with
/// chat prompts (key bytes per node × `CHUNK_BYTES / HASH_BYTES`; checked by test
/// `a_trie_of_chat_keys_holds_prompt_bytes_per_node_as_stated`). Estimates the room under a
/// trie's node cap.
pub const TRIE_PROMPT_BYTES_PER_NODE: f64 = 388.0;

/// Byte cap of a target's prefix trie so that the prompt chunks it holds match what its
/// replica's KV cache holds (`kv_cache_tokens` × `bytes_per_token` of prompt, in key bytes).
/// The trie's LRU then forgets what the replica's LRU has likely evicted, instead of
/// scoring on prompts long gone from the replica; without a capacity, no byte cap (the
/// node cap, `trie_max_nodes`, still bounds memory).
pub fn trie_bytes_for_kv_cache(kv_cache_tokens: Option<u64>, bytes_per_token: f64) -> usize {
    match kv_cache_tokens {
        Some(tokens) => {
            let chunks = (tokens as f64 * bytes_per_token / CHUNK_BYTES as f64).ceil();
            (chunks as usize).saturating_mul(HASH_BYTES).max(HASH_BYTES)
        }
        None => usize::MAX,
    }
}

/// Prompt bytes `trie` can take before it is half full, by whichever cap is nearer; an
/// empty trie, before it is full: a replica holding nothing evicts no one for a new prefix,
/// however long.
pub fn room_bytes(trie: &PrefixTrie) -> f64 {
    let share = if trie.node_count() == 0 { 1 } else { 2 };
    let nodes = (trie.max_nodes() / share).saturating_sub(trie.node_count()) as f64
        * TRIE_PROMPT_BYTES_PER_NODE;
    let bytes = (trie.max_bytes() / share).saturating_sub(trie.byte_count()) as f64
        * (CHUNK_BYTES / HASH_BYTES) as f64;
    nodes.min(bytes)
}

/// `input`'s prompt key: the one the gateway computed, or computed here if it did not.
pub fn prompt_key_of<'b>(input: &RouteInput<'b>) -> Cow<'b, [u8]> {
    // A summarised prompt has no bytes to key: its strategy must say it uses the key.
    debug_assert!(
        input.facts.is_none() || !input.prompt_key.is_empty() || input.prompt_len() < CHUNK_BYTES,
        "a summarised prompt without its key"
    );
    if input.prompt_key.is_empty() && input.prompt.len() >= CHUNK_BYTES {
        Cow::Owned(key::prompt_key(input.prompt))
    } else {
        Cow::Borrowed(input.prompt_key)
    }
}

/// The cache-aware strategy.
#[derive(Debug)]
pub struct CacheAware {
    rule: PlacementRule,
    bytes_per_token: f64,
    conversations: Option<Arc<SessionTable>>,
    groups: Option<GroupHomes>,
}

impl CacheAware {
    /// A strategy placing by `rule`, estimating tokens as prompt bytes / `bytes_per_token`.
    pub fn new(rule: PlacementRule, bytes_per_token: f64) -> Self {
        CacheAware {
            rule,
            bytes_per_token: bytes_per_token.max(f64::MIN_POSITIVE),
            conversations: None,
            groups: rule.group_homes.then(GroupHomes::default),
        }
    }

    /// This strategy remembering, in `table`, the target each conversation last went to,
    /// so a conversation whose history every trie has forgotten still returns there.
    pub fn remembering(mut self, table: Arc<SessionTable>) -> Self {
        self.conversations = Some(table);
        self
    }
}

impl Default for CacheAware {
    fn default() -> Self {
        CacheAware::new(PlacementRule::default(), DEFAULT_PROMPT_BYTES_PER_TOKEN)
    }
}

/// When no view holds any of the prompt, its group has a known home and the home's trie has
/// no room for the prompt (`room_bytes`: it forgets), credit the home with
/// [`HOME_HEAD_SHARE`] of the group's first message.
fn credit_group_home(choices: &mut [Choice], ask: &Ask) {
    if choices.iter().any(|c| c.cached_tokens > 0.0) {
        return;
    }
    let Some(GroupHome::Known(home)) = ask.group_home else {
        return;
    };
    // Only where the trie has been forgetting: one with room for the prompt (at most half
    // full with it, or empty) has dropped nothing, so its zero is the replica's too.
    if let Some(c) = choices
        .iter_mut()
        .find(|c| c.index == home && c.room_tokens < ask.tokens)
    {
        c.cached_tokens = HOME_HEAD_SHARE * ask.first_message_tokens;
    }
}

/// The target `table` remembers for the conversation `keys` names, if any, and whether a
/// peer's note put it there (the placement rule only considers it if it is among the
/// eligible choices).
pub fn previous_target(
    table: Option<&SessionTable>,
    keys: PlacementKeys,
    input: &RouteInput,
    fleet: &FleetView,
) -> Option<(usize, bool)> {
    let (label, from_peer) = table?.conversation_entry(keys.conversation, input.now_ms)?;
    let index = fleet.candidates.iter().position(|c| c.label == &*label)?;
    Some((index, from_peer))
}

/// With group homes on (`groups`): the home named for `group` among the fleet's targets
/// (noting the sighting; the group is held somewhere when a target holds half its first
/// message of `first_message_tokens`), and in `choices` how many groups live on each and
/// whether they have gone quiet.
pub fn group_home_of(
    groups: Option<&GroupHomes>,
    group: u64,
    first_message_tokens: f64,
    fleet: &FleetView,
    now_ms: u64,
    choices: &mut [Choice],
) -> Option<GroupHome> {
    let groups = groups?;
    let labels: Vec<&str> = fleet.candidates.iter().map(|c| c.label).collect();
    let held = choices
        .iter()
        .any(|c| c.cached_tokens > 0.0 && c.cached_tokens >= first_message_tokens / 2.0);
    let view = groups.note_and_home(group, &labels, held, now_ms)?;
    for c in choices.iter_mut() {
        c.homes = view.homes_on(c.index);
        c.quiet = groups.is_quiet(&view, c.index);
    }
    view.home
}

/// With group homes on: count `placed` if it is a new conversation of a known group (in
/// its home's pace of new conversations too).
pub fn note_conversation(
    groups: Option<&GroupHomes>,
    ask: &Ask,
    placed: &super::placement::Placed,
    fleet: &FleetView,
) {
    if let (Some(groups), true, Some(GroupHome::Known(h))) =
        (groups, placed.new_work, ask.group_home)
    {
        if let Some(home) = fleet.candidates.get(h) {
            groups.note_conversation(h, home.label);
        }
    }
}

/// Store in `table` that the decision's conversation went to `target`.
pub fn remember_target(
    table: Option<&SessionTable>,
    input: &RouteInput,
    target: &Candidate,
    decision: &Decision,
) {
    if let (Some(table), Some(conversation)) = (table, decision.conversation) {
        table.put_conversation(conversation, target.label, input.now_ms);
    }
}

/// Each eligible target's prefix score for a prompt of `prompt_len` bytes whose key is
/// `key`, as (index, score).
pub fn prefix_scores<'a>(
    prompt_len: usize,
    key: &'a [u8],
    fleet: &'a FleetView<'a>,
) -> impl Iterator<Item = (usize, f64)> + 'a {
    prefix_scores_hinted(prompt_len, key, fleet).map(|(i, score, _)| (i, score))
}

/// `prefix_scores` with each target's trie walk result, for `PrefixTrie::insert_hinted`.
pub fn prefix_scores_hinted<'a>(
    prompt_len: usize,
    key: &'a [u8],
    fleet: &'a FleetView<'a>,
) -> impl Iterator<Item = (usize, f64, Option<MatchHint>)> + 'a {
    fleet.eligible().map(move |i| {
        let (matched, hint) = fleet.candidates[i]
            .prefix
            .map_or((0, None), |t| t.match_hinted(key));
        let matched = key::matched_prompt_bytes(matched);
        (i, matched as f64 / prompt_len.max(1) as f64, hint)
    })
}

impl Strategy for CacheAware {
    fn name(&self) -> &'static str {
        "cache_aware"
    }

    fn uses_prompt_key(&self) -> bool {
        true
    }

    fn hears_peers(&self) -> bool {
        self.conversations.is_some()
    }

    fn select(&self, input: &RouteInput, fleet: &FleetView) -> Option<Decision> {
        if input.prompt_len() == 0 {
            return fleet.least_loaded().map(|target| Decision {
                target,
                reason: Reason::Fallback,
                score: None,
                hint: None,
                conversation: None,
                new_work: false,
            });
        }
        let len = input.prompt_len() as f64;
        let key = prompt_key_of(input);
        let mut hints = Vec::with_capacity(fleet.candidates.len());
        let mut choices: Vec<Choice> = prefix_scores_hinted(input.prompt_len(), &key, fleet)
            .map(|(i, score, hint)| {
                hints.push((i, hint));
                let c = &fleet.candidates[i];
                Choice {
                    index: i,
                    inflight: c.inflight,
                    cached_tokens: score * len / self.bytes_per_token,
                    room_tokens: c.prefix.map_or(0.0, room_bytes) / self.bytes_per_token,
                    cache_tokens: c.cache_tokens,
                    placed: c.placed,
                    label: c.label,
                    homes: 0,
                    quiet: false,
                }
            })
            .collect();
        let (keys, first_len) = input.placement();
        let keys = keys.with_session(input.session_id);
        let previous = previous_target(self.conversations.as_deref(), keys, input, fleet);
        let first_message_tokens = first_len as f64 / self.bytes_per_token;
        let ask = Ask {
            tokens: len / self.bytes_per_token,
            first_message_tokens,
            keys,
            previous: previous.map(|(i, _)| i),
            previous_from_peer: previous.is_some_and(|(_, peer)| peer),
            group_home: group_home_of(
                self.groups.as_ref(),
                keys.group,
                first_message_tokens,
                fleet,
                input.now_ms,
                &mut choices,
            ),
        };
        credit_group_home(&mut choices, &ask);
        let placed = self.rule.place(&ask, &choices)?;
        note_conversation(self.groups.as_ref(), &ask, &placed, fleet);
        super::explain::log_decision(&ask, &choices, &placed);
        // The chosen target's walk, handed to `record` so its insert starts where it stopped:
        // only for the caller's key, which `record` sees again (a key computed here is gone).
        let hint = hints.iter().find(|&&(i, _)| i == placed.index)?.1;
        let hint = hint.filter(|_| matches!(key, Cow::Borrowed(_)));
        Some(Decision {
            target: placed.index,
            reason: placed.reason,
            score: Some(placed.score),
            hint,
            conversation: Some(keys.conversation),
            new_work: placed.new_work,
        })
    }

    fn record(&self, input: &RouteInput, fleet: &FleetView, decision: &Decision) {
        let Some(target) = fleet.candidates.get(decision.target) else {
            return;
        };
        let key = prompt_key_of(input);
        if let (Some(trie), false) = (target.prefix, key.is_empty()) {
            trie.insert_hinted(&key, decision.hint);
        }
        remember_target(self.conversations.as_deref(), input, target, decision);
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
            .enumerate()
            .map(|(i, ((t, &inflight), &eligible))| Candidate {
                inflight,
                eligible,
                weight: 1,
                prefix: Some(t),
                label: ["t0", "t1", "t2", "t3"][i],
                kv: None,
                lmcache: None,
                placed: 0.0,
                cache_tokens: 0.0,
            })
            .collect()
    }

    fn input(p: &[u8]) -> RouteInput<'_> {
        RouteInput {
            prompt: p,
            ..Default::default()
        }
    }

    /// Store `p` in `t` as the strategy does: by its key.
    fn store(t: &PrefixTrie, p: &[u8]) {
        t.insert(&crate::prefix::prompt_key(p));
    }

    fn tries(n: usize) -> Vec<PrefixTrie> {
        (0..n).map(|_| PrefixTrie::new(10_000)).collect()
    }

    #[test]
    fn cold_prompts_are_placed_by_their_group_among_the_least_loaded() {
        let t = tries(4);
        // Group homes off: this is the placement of a group no gateway has a home for.
        let rule = PlacementRule {
            group_homes: false,
            ..Default::default()
        };
        let cs = CacheAware::new(rule, DEFAULT_PROMPT_BYTES_PER_TOKEN);
        let c = fleet(&t, &[0, 0, 0, 5], &[true; 4]);
        let mut seen = [0usize; 4];
        for g in 0..200 {
            let system = format!("Csystem\x1fsystem prompt {g} {}", "s".repeat(400));
            let first = cs
                .select(
                    &input(format!("{system}\x1euser 1").as_bytes()),
                    &FleetView::new(&c),
                )
                .unwrap();
            assert_eq!(first.reason, Reason::BelowThreshold);
            // Another conversation of the same group, same choice (nothing recorded).
            let second = cs
                .select(
                    &input(format!("{system}\x1euser 2").as_bytes()),
                    &FleetView::new(&c),
                )
                .unwrap();
            assert_eq!(first.target, second.target, "group {g}");
            seen[first.target] += 1;
        }
        assert_eq!(
            seen[3], 0,
            "5 in flight is more than one request's worth: {seen:?}"
        );
        assert!(seen[..3].iter().all(|&n| n > 40), "{seen:?}");
    }

    /// A new conversation whose group's holder is past the load bound opens a home on an
    /// idle target whose cache would take it without evicting another group: one at most
    /// half full with it, or an empty one, whose whole cache counts.
    #[test]
    fn past_the_load_bound_a_new_conversation_opens_a_home_on_an_empty_target() {
        let prompt = |group: &str, n: usize| {
            format!(
                "C{group}\x1f{}\x1euser\x1fquestion {n}\x1e",
                "You are a careful assistant. ".repeat(270)
            )
        };
        // Tries capped as for a 3,072-token cache: half of it cannot take a 2,000-token
        // prompt.
        let t = tries(3);
        for trie in &t {
            trie.set_max_bytes(trie_bytes_for_kv_cache(
                Some(3072),
                DEFAULT_PROMPT_BYTES_PER_TOKEN,
            ));
        }
        store(&t[0], prompt("a", 0).as_bytes());
        store(&t[1], prompt("b", 0).as_bytes());
        let c = fleet(&t, &[4, 0, 0], &[true; 3]);
        let d = CacheAware::default()
            .select(&input(prompt("a", 1).as_bytes()), &FleetView::new(&c))
            .unwrap();
        assert_eq!((d.target, d.reason), (2, Reason::Overloaded));
        // Once the empty target holds something, if only a short prompt, only half its
        // cache counts: no target within the bound takes the prompt cheaply, and the holder
        // keeps it.
        store(
            &t[2],
            format!("Cc\x1f{}\x1e", "Brief. ".repeat(30)).as_bytes(),
        );
        let d = CacheAware::default()
            .select(&input(prompt("a", 1).as_bytes()), &FleetView::new(&c))
            .unwrap();
        assert_eq!((d.target, d.reason), (0, Reason::CacheHit));
    }

    /// A group every trie has forgotten (another group's prompts pushed it out) still
    /// counts on its home for the head of its first message, as the replica still holds it.
    #[test]
    fn a_group_home_forgotten_by_every_trie_still_counts_for_the_head_of_its_prompt() {
        // About 1,000 tokens of system prompt: 30% of it is past the 256 always counted.
        let system = format!("Csystem\x1f{}", "You are a careful assistant. ".repeat(140));
        let turn = |n: usize| format!("{system}\x1euser\x1fquestion {n}\x1e");
        // Tries capped as for a 1,500-token cache holding another group's prompt (half of it
        // is less than the prompt: they forget), then uncapped ones (room for the prompt: a
        // zero there is the replica's), then capped empty ones (they forgot nothing).
        for (capped, homes, forgotten, credited) in [
            (true, true, true, true),
            (true, false, true, false),
            (false, true, true, false),
            (true, true, false, false),
        ] {
            let t = tries(4);
            if capped {
                for trie in &t {
                    trie.set_max_bytes(trie_bytes_for_kv_cache(
                        Some(1500),
                        DEFAULT_PROMPT_BYTES_PER_TOKEN,
                    ));
                }
            }
            // Another group's prompt is what every trie holds now.
            if forgotten {
                let other = format!("Cother\x1f{}", "Another group's prompt. ".repeat(160));
                t.iter().for_each(|trie| store(trie, other.as_bytes()));
            }
            let idle = fleet(&t, &[0; 4], &[true; 4]);
            let cs = CacheAware::new(
                PlacementRule {
                    group_homes: homes,
                    ..Default::default()
                },
                DEFAULT_PROMPT_BYTES_PER_TOKEN,
            );
            // Two sightings make the group known; none of its prompts is recorded anywhere.
            for n in 0..2 {
                cs.select(&input(turn(n).as_bytes()), &FleetView::new(&idle))
                    .unwrap();
            }
            let d = cs
                .select(&input(turn(2).as_bytes()), &FleetView::new(&idle))
                .unwrap();
            let case = format!("capped {capped}, group homes {homes}, forgotten {forgotten}");
            if !credited {
                assert_eq!(d.reason, Reason::BelowThreshold, "{case}");
                continue;
            }
            assert_eq!(d.reason, Reason::CacheHit, "{case}");
            let home = d.target;
            // One more in flight there than anywhere else: the head is worth more.
            let mut loads = [0; 4];
            loads[home] = 1;
            let busy = fleet(&t, &loads, &[true; 4]);
            let d = cs
                .select(&input(turn(3).as_bytes()), &FleetView::new(&busy))
                .unwrap();
            assert_eq!((d.target, d.reason), (home, Reason::CacheHit), "{case}");
        }
    }

    /// Two gateways that placed one group on different targets (each one's trie shows only
    /// its own) both send the group's next new conversations to its home.
    #[test]
    fn two_gateways_that_split_a_group_bring_it_back_to_one_home() {
        let system = format!("Csystem\x1f{}", "You are a careful assistant. ".repeat(80));
        let conversation =
            |n: usize| format!("{system}\x1euser\x1fquestion {n} {}\x1e", "q".repeat(64));
        let (ta, tb) = (tries(4), tries(4));
        store(&ta[0], conversation(0).as_bytes());
        store(&tb[1], conversation(1).as_bytes());
        let (a, b) = (CacheAware::default(), CacheAware::default());
        let (ca, cb) = (
            fleet(&ta, &[0; 4], &[true; 4]),
            fleet(&tb, &[0; 4], &[true; 4]),
        );
        let pick = |s: &CacheAware, c: &[Candidate], n: usize| {
            let p = conversation(n);
            let d = s.select(&input(p.as_bytes()), &FleetView::new(c)).unwrap();
            s.record(&input(p.as_bytes()), &FleetView::new(c), &d);
            d
        };
        // First sight of the group on each gateway: its own holder.
        assert_eq!(pick(&a, &ca, 2).target, 0);
        assert_eq!(pick(&b, &cb, 3).target, 1);
        // From the second on, both name the same home.
        for n in 4..10 {
            let (da, db) = (pick(&a, &ca, n), pick(&b, &cb, n + 100));
            assert_eq!(da.target, db.target, "conversation {n}");
        }
    }

    /// Loads are compared among eligible targets only: a broken replica's empty queue must
    /// not make a healthy warm target look overloaded.
    #[test]
    fn an_unhealthy_idle_target_does_not_make_others_look_overloaded() {
        let t = tries(3);
        let system = "S".repeat(4000);
        store(&t[0], system.as_bytes());
        // Target 2 is broken with zero load; among eligible targets the minimum is 7.
        let c = fleet(&t, &[9, 7, 0], &[true, true, false]);
        let d = CacheAware::default()
            .select(&input(format!("{system}!").as_bytes()), &FleetView::new(&c))
            .unwrap();
        assert_eq!((d.target, d.reason), (0, Reason::CacheHit));
    }

    #[test]
    fn a_conversation_moves_to_the_least_loaded_holder_of_its_system_prompt() {
        let t = tries(3);
        let system = "S".repeat(4000);
        let conversation = format!(
            "{system}\x1euser 1: hello\x1eassistant: hi {}\x1e",
            "h".repeat(80)
        );
        store(&t[0], conversation.as_bytes());
        store(
            &t[1],
            format!("{system}\x1euser 2: other question\x1e").as_bytes(),
        );
        store(&t[2], b"unrelated");
        let prompt = format!("{conversation}user 1: again\x1e");
        // 0 holds the conversation but 8 more in flight cost more than its short history.
        let c = fleet(&t, &[9, 1, 1], &[true; 3]);
        let d = CacheAware::default()
            .select(&input(prompt.as_bytes()), &FleetView::new(&c))
            .unwrap();
        assert_eq!((d.target, d.reason), (1, Reason::Overloaded));
        assert!(d.score.unwrap() > 0.5, "{d:?}");
        // One request busier is worth keeping the system prompt: 1, not the idle cold 2.
        let c = fleet(&t, &[9, 2, 1], &[true; 3]);
        let d = CacheAware::default()
            .select(&input(prompt.as_bytes()), &FleetView::new(&c))
            .unwrap();
        assert_eq!(d.target, 1);
        // Without the extra load the conversation stays home.
        let c = fleet(&t, &[1, 1, 1], &[true; 3]);
        let d = CacheAware::default()
            .select(&input(prompt.as_bytes()), &FleetView::new(&c))
            .unwrap();
        assert_eq!((d.target, d.reason), (0, Reason::CacheHit));
    }

    /// A conversation's first turn is new work (what `share_bound` counts); a turn whose
    /// history its target holds is not.
    #[test]
    fn a_first_turn_is_new_work_and_its_next_turn_is_not() {
        let t = tries(4);
        let c = fleet(&t, &[0; 4], &[true; 4]);
        let s = CacheAware::default();
        let system = format!("Csystem\x1f{}", "You are a careful assistant. ".repeat(80));
        let turn1 = format!("{system}\x1euser\x1f{}\x1e", "first question ".repeat(8));
        let d1 = s
            .select(&input(turn1.as_bytes()), &FleetView::new(&c))
            .unwrap();
        assert!(d1.new_work, "{d1:?}");
        s.record(&input(turn1.as_bytes()), &FleetView::new(&c), &d1);
        let turn2 = format!(
            "{turn1}assistant\x1f{}\x1euser\x1fmore\x1e",
            "answer ".repeat(20)
        );
        let d2 = s
            .select(&input(turn2.as_bytes()), &FleetView::new(&c))
            .unwrap();
        assert_eq!((d2.target, d2.new_work), (d1.target, false), "{d2:?}");
    }

    /// The decision is deterministic: two gateways (two strategy values over tries that saw
    /// the same requests) route a request alike, also when targets tie on cache.
    #[test]
    fn equally_warm_targets_are_chosen_the_same_way_by_every_gateway() {
        let (a, b) = (tries(2), tries(2));
        let prefix = "same prefix here. ".repeat(8);
        for t in a.iter().chain(&b) {
            store(t, prefix.as_bytes());
        }
        let (ca, cb) = (
            fleet(&a, &[0, 0], &[true; 2]),
            fleet(&b, &[0, 0], &[true; 2]),
        );
        let mut seen = [0; 2];
        for i in 0..200 {
            let p = format!("{prefix}\x1e{i}\x1e");
            let da = CacheAware::default().select(&input(p.as_bytes()), &FleetView::new(&ca));
            let db = CacheAware::default().select(&input(p.as_bytes()), &FleetView::new(&cb));
            assert_eq!(da.unwrap().target, db.unwrap().target);
            seen[da.unwrap().target] += 1;
        }
        assert!(seen[0] > 40 && seen[1] > 40, "{seen:?}");
    }

    /// A conversation's later turn returns to the target that served the last one, even
    /// when no trie holds its history any more (forgotten, or learned by another gateway)
    /// and another holder of its system prompt is less loaded; without the memory the
    /// cost rule sends it to the less-loaded holder.
    #[test]
    fn a_remembered_conversation_returns_to_its_target_after_its_history_is_forgotten() {
        let system = format!("Csystem\x1f{}\x1e", "shared tool list ".repeat(200));
        let turn1 = format!("{system}user\x1fquestion one\x1e");
        let turn2 = format!("{turn1}assistant\x1fanswer\x1euser\x1fand then?\x1e");
        let memory = Arc::new(SessionTable::new(300, 1_000));
        let remembering = CacheAware::default().remembering(memory);
        let forgetful = CacheAware::default();
        for (loads, busy) in [([3, 0], 0), ([0, 3], 1)] {
            // Both targets hold only the system prompt; turn 1 went to the busy one.
            let t = tries(2);
            store(&t[0], system.as_bytes());
            store(&t[1], system.as_bytes());
            let c = fleet(&t, &[0, 0], &[true; 2]);
            let d = Decision {
                target: busy,
                reason: Reason::CacheHit,
                score: None,
                hint: None,
                conversation: Some(PlacementKeys::from_prompt(turn1.as_bytes()).0.conversation),
                new_work: false,
            };
            remembering.record(&input(turn1.as_bytes()), &FleetView::new(&c), &d);
            let t = tries(2);
            store(&t[0], system.as_bytes());
            store(&t[1], system.as_bytes());
            let c = fleet(&t, &loads, &[true; 2]);
            let view = FleetView::new(&c);
            let d = remembering.select(&input(turn2.as_bytes()), &view).unwrap();
            assert_eq!((d.target, d.reason), (busy, Reason::CacheHit));
            let d = forgetful.select(&input(turn2.as_bytes()), &view).unwrap();
            assert_eq!(d.target, 1 - busy);
        }
    }

    #[test]
    fn cache_hit_pins_to_the_warm_target() {
        let t = tries(3);
        let system = "system: long shared prompt. ".repeat(10);
        store(&t[1], format!("{system}user: hi").as_bytes());
        let c = fleet(&t, &[1, 1, 1], &[true; 3]);
        let d = CacheAware::default()
            .select(
                &input(format!("{system}user: hello").as_bytes()),
                &FleetView::new(&c),
            )
            .unwrap();
        assert_eq!((d.target, d.reason), (1, Reason::CacheHit));
        assert!(d.score.unwrap() > 0.8);
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
    fn below_threshold_ignores_a_trivial_partial_match() {
        let t = tries(3);
        let start = "You are an assistant. ".repeat(3);
        store(&t[0], format!("{start}0 {}", "x".repeat(500)).as_bytes());
        let c = fleet(&t, &[0, 0, 0], &[true; 3]);
        // The one shared chunk (64 of ~570 bytes) is no reason to go to 0: cold prompts
        // spread as if it were as cold as the others.
        let mut seen = [0usize; 3];
        for i in 1..=300 {
            let prompt = format!("{start}{i} {}", "y".repeat(500));
            let d = CacheAware::default()
                .select(&input(prompt.as_bytes()), &FleetView::new(&c))
                .unwrap();
            assert_eq!(d.reason, Reason::BelowThreshold);
            seen[d.target] += 1;
        }
        assert!(seen.iter().all(|&n| (60..=140).contains(&n)), "{seen:?}");
    }

    #[test]
    fn a_trivially_shared_start_is_no_better_than_cold() {
        let t = tries(3);
        let system = "S".repeat(200);
        store(&t[0], format!("{system}|user 1").as_bytes());
        store(&t[1], &[b'S'; 64]);
        store(&t[2], &[b'z'; 64]);
        // 1 shares 64 of ~210 bytes (below threshold, 16 tokens): it ties with the cold 2,
        // and the tie goes by the prompt's key, the same way every time.
        let c = fleet(&t, &[5, 1, 1], &[true; 3]);
        let prompt = format!("{system}|user 1 again");
        let first = CacheAware::default()
            .select(&input(prompt.as_bytes()), &FleetView::new(&c))
            .unwrap();
        assert_ne!(first.target, 0);
        assert_eq!(first.reason, Reason::Overloaded);
        for _ in 0..30 {
            let d = CacheAware::default()
                .select(&input(prompt.as_bytes()), &FleetView::new(&c))
                .unwrap();
            assert_eq!(d, first);
        }
    }

    #[test]
    fn a_trie_of_chat_keys_holds_prompt_bytes_per_node_as_stated() {
        // The fill of the trie's own memory test: a shared 2 KiB system prompt, then
        // conversations growing by ~600-byte turns, each turn stored, past the cap.
        use crate::prefix::key::tests::text;
        let t = PrefixTrie::new(20_000);
        let sys = text(2048, 11);
        let mut conv = 0u64;
        while t.evictions() < 200 {
            conv += 1;
            let mut p = sys.clone();
            p.extend_from_slice(&conv.to_le_bytes());
            for turn in 0..8 {
                p.extend_from_slice(&text(600, conv * 8 + turn));
                t.insert(&key::prompt_key(&p));
            }
        }
        let per_node =
            t.byte_count() as f64 / t.node_count() as f64 * (CHUNK_BYTES / HASH_BYTES) as f64;
        assert!(
            (per_node / TRIE_PROMPT_BYTES_PER_NODE - 1.0).abs() < 0.05,
            "{per_node:.0} prompt bytes per node: update TRIE_PROMPT_BYTES_PER_NODE"
        );
    }

    #[test]
    fn trie_cap_follows_the_replica_kv_cache() {
        // No capacity known: no byte cap.
        assert_eq!(trie_bytes_for_kv_cache(None, 4.0), usize::MAX);
        // 8,192 tokens × 6 B = 48 KiB of prompt = 768 chunks of 64 B = 3072 key bytes.
        assert_eq!(trie_bytes_for_kv_cache(Some(8192), 6.0), 768 * HASH_BYTES);
        // Twice the cache, twice the bytes; never below one chunk.
        assert_eq!(trie_bytes_for_kv_cache(Some(16384), 6.0), 1536 * HASH_BYTES);
        assert_eq!(trie_bytes_for_kv_cache(Some(0), 4.0), HASH_BYTES);
    }

    /// A trie sized to its replica's cache forgets the oldest conversations as the replica
    /// would, so a prompt seen long ago no longer pins a request there, and reports the room
    /// left by its byte cap.
    #[test]
    fn a_trie_sized_to_the_cache_forgets_old_prompts() {
        // 512 tokens × 4 B: 2 KiB of prompt.
        let t = PrefixTrie::new(1_000_000);
        t.set_max_bytes(trie_bytes_for_kv_cache(Some(512), 4.0));
        // Empty: the whole cache; holding anything: what is left of its first half.
        assert_eq!(room_bytes(&t), 2048.0);
        let old = key::prompt_key(format!("old {}", "o".repeat(1000)).as_bytes());
        t.insert(&old);
        assert_eq!(t.match_len(&old), old.len());
        assert_eq!(room_bytes(&t), 1024.0 - 960.0);
        t.insert(&key::prompt_key(
            format!("new {}", "n".repeat(1000)).as_bytes(),
        ));
        assert_eq!(t.match_len(&old), old.len(), "2 KiB hold both");
        assert_eq!(room_bytes(&t), 0.0);
        t.insert(&key::prompt_key(
            format!("newer {}", "m".repeat(1000)).as_bytes(),
        ));
        assert_eq!(
            key::matched_prompt_bytes(t.match_len(&old)),
            0,
            "the third KiB evicted the oldest"
        );
        assert!(t.byte_count() <= t.max_bytes());
        // A trie without a byte cap still holds it.
        let big = PrefixTrie::new(1_000_000);
        big.insert(&old);
        for i in 0..8 {
            big.insert(&key::prompt_key(
                format!("new {i} {}", "n".repeat(1000)).as_bytes(),
            ));
        }
        assert_eq!(big.match_len(&old), old.len());
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
            let prompt = format!("{system}|user {conv}: first question {}", "q".repeat(64));
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
            let prompt = format!(
                "{system}|user {conv}: first question {}|assistant: answer|user: follow-up",
                "q".repeat(64)
            );
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
                    store(&t[(n % 2) as usize], p.as_bytes());
                }
            });
            let deadline = Instant::now() + Duration::from_secs(2);
            let mut decisions = 0u64;
            while Instant::now() < deadline && decisions < 2_000_000 {
                decisions += 1;
                let d = cs.select(&input(&[b'c'; 200]), &view);
                if d.is_none() {
                    stop.store(true, Ordering::Relaxed);
                    panic!("decision {decisions}: no target while the tries changed");
                }
            }
            stop.store(true, Ordering::Relaxed);
        });
    }
}
