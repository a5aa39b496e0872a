//! `precise_cache_aware`: score each target by the leading token blocks its vLLM replica
//! *reports* resident (the residency index fed by its KV-event stream) plus the blocks of
//! requests just routed there whose events have not arrived yet, then place the request
//! with the shared rule of [`super::placement`] in exact tokens.
//!
//! Token ids come from `x-rolter-vllm-token-ids`. The request's blocks are chained once
//! per block size the targets' indices learned from their events (usually one); only the
//! pending overlay of a replica that has not announced anything yet assumes vLLM's
//! default. Safe fallbacks: no (or malformed) ids → least-load (`fallback`);
//! fewer tokens than one block → nothing cached anywhere (`below_threshold`); a target
//! whose stream is untrusted (gap, stale, restart, no events yet) holds nothing — it is
//! not excluded, it just wins nothing on cache.
//!
//! The pending overlay ([`PendingBlocks`]) is what keeps a burst of requests sharing a
//! new prefix together: the first is noted on its target when routed, and the rest see
//! it there before the replica has computed a block. The placement keys and the
//! conversation test come from the prompt (its bytes, or the gateway's summary of a long
//! one), as for `cache_aware`, and so does the group's home (`group_homes`): under cache
//! pressure exact residency shows a group's prefix wherever one of its conversations
//! spilled, and without homes the group's new conversations spread over those replicas.
//! The replica's cache size tells the share bound where spilled work fits and the group
//! homes when the fleet is under cache pressure, and half of it less the blocks the stream
//! reports resident (all of it, while the stream reports none and this gateway has routed
//! nothing there) is the room the load bound opens new homes in. It is the provider's
//! `kv_cache_tokens` when set, else what the replica publishes on its metrics endpoint
//! (`cache_size_poll`; both arrive as `Candidate::cache_tokens`), else what the replica's
//! own events show once it has evicted a block (the most blocks resident at once,
//! `ResidencyIndex::capacity_tokens`): exact residency needs no cache size from anyone.

use super::cache_aware::{group_home_of, previous_target, remember_target};
use super::group_homes::GroupHomes;
use super::placement::{Ask, Choice, PlacementRule};
use super::{Decision, FleetView, Reason, RouteInput, SessionTable, Strategy};
use crate::prefix::residency::{PrefixChain, ResidencyIndex};
use crate::prefix::PendingBlocks;
use crate::prefix::StreamState;
use std::sync::Arc;

/// What precise routing sees of a target's KV-event state.
#[derive(Clone, Copy)]
pub struct KvView<'a> {
    /// Blocks the replica reported resident.
    pub index: &'a ResidencyIndex,
    /// Whether the stream is in sequence and fresh.
    pub trusted: bool,
    /// The stream's state (atomics only), told when a routed request should make the
    /// replica publish events, so silence after it can be detected as staleness.
    pub stream: Option<&'a StreamState>,
    /// Blocks routed to the replica whose events have not arrived yet.
    pub pending: Option<&'a PendingBlocks>,
}

/// The precise cache-aware strategy.
#[derive(Debug)]
pub struct PreciseCacheAware {
    rule: PlacementRule,
    conversations: Option<Arc<SessionTable>>,
    groups: Option<GroupHomes>,
}

impl PreciseCacheAware {
    /// A strategy placing by `rule`.
    pub fn new(rule: PlacementRule) -> Self {
        PreciseCacheAware {
            rule,
            conversations: None,
            groups: rule.group_homes.then(GroupHomes::default),
        }
    }

    /// This strategy remembering, in `table`, the target each conversation last went to
    /// (see [`CacheAware::remembering`](super::CacheAware::remembering)).
    pub fn remembering(mut self, table: Arc<SessionTable>) -> Self {
        self.conversations = Some(table);
        self
    }
}

impl Default for PreciseCacheAware {
    fn default() -> Self {
        PreciseCacheAware::new(PlacementRule::default())
    }
}

/// Block size of the pending overlay on a replica whose events have not told it yet: vLLM's
/// default (through 0.33). A wrong guess only makes pending blocks miss until the index
/// learns the real size.
pub const DEFAULT_PENDING_BLOCK_SIZE: u32 = 16;

/// The block size `kv`'s blocks are chained with: the learned one, else the default.
fn block_size_of(kv: &KvView) -> u32 {
    kv.index.block_size().unwrap_or(DEFAULT_PENDING_BLOCK_SIZE)
}

/// Tokens of the request each eligible target holds, as (index, tokens): the leading
/// blocks its replica reported resident (trusted streams only), then those routed there
/// since (the gateway's own knowledge, trusted or not) unless the replica has reported
/// evicting them after they were routed.
pub fn held_tokens(tokens: &[u32], fleet: &FleetView, now_ms: u64) -> Vec<(usize, f64)> {
    let mut chains: Vec<PrefixChain> = Vec::new();
    for i in fleet.eligible() {
        if let Some(kv) = fleet.candidates[i].kv {
            let bs = block_size_of(&kv);
            if chains.iter().all(|c| c.block_size() != bs) {
                chains.push(PrefixChain::new(tokens, bs, None));
            }
        }
    }
    fleet
        .eligible()
        .map(|i| {
            let held = fleet.candidates[i].kv.map_or(0.0, |kv| {
                let bs = block_size_of(&kv);
                let Some(chain) = chains.iter().find(|c| c.block_size() == bs) else {
                    return 0.0;
                };
                let resident = if kv.trusted {
                    kv.index.match_chain(chain).gpu_blocks
                } else {
                    0
                };
                let pending = kv
                    .pending
                    .map_or(0, |p| p.run_from(chain, resident, now_ms, kv.index));
                ((resident + pending) * bs as usize) as f64
            });
            (i, held)
        })
        .collect()
}

/// Tokens `c`'s replica's KV cache holds: its configured `kv_cache_tokens` or the size its
/// metrics report (`Candidate::cache_tokens`), else the size its events have shown ([`ResidencyIndex::capacity_tokens`]: the most blocks resident once it
/// has evicted one); 0 while unknown.
fn cache_tokens(c: &super::Candidate) -> f64 {
    if c.cache_tokens > 0.0 {
        return c.cache_tokens;
    }
    c.kv.and_then(|kv| kv.index.capacity_tokens())
        .map_or(0.0, |tokens| tokens as f64)
}

/// Tokens `c`'s replica can take while its cache stays at most half full: half its
/// cache size ([`cache_tokens`]) less the blocks its trusted stream reports resident; its
/// whole size, or without a known size no limit, when it reports none and this gateway has
/// routed nothing there (a replica holding nothing evicts no one for a new prefix, however
/// long); otherwise 0 while the size or the residency is unknown.
fn room_tokens(c: &super::Candidate) -> f64 {
    let size = cache_tokens(c);
    match c.kv {
        Some(kv) if kv.trusted => {
            let blocks = kv.index.block_count();
            if blocks == 0 && kv.pending.is_none_or(|p| !p.noted_since_clear()) {
                return if size > 0.0 { size } else { f64::INFINITY };
            }
            let held = blocks as f64 * f64::from(block_size_of(&kv));
            (size / 2.0 - held).max(0.0)
        }
        _ => 0.0,
    }
}

impl Strategy for PreciseCacheAware {
    fn name(&self) -> &'static str {
        "precise_cache_aware"
    }

    fn uses_token_ids(&self) -> bool {
        true
    }

    fn select(&self, input: &RouteInput, fleet: &FleetView) -> Option<Decision> {
        let Some(tokens) = input.token_ids.filter(|t| !t.is_empty()) else {
            return fleet.least_loaded().map(|target| Decision {
                target,
                reason: Reason::Fallback,
                score: None,
                hint: None,
                conversation: None,
                new_work: false,
            });
        };
        let mut choices: Vec<Choice> = held_tokens(tokens, fleet, input.now_ms)
            .into_iter()
            .map(|(i, held)| Choice {
                index: i,
                inflight: fleet.candidates[i].inflight,
                cached_tokens: held,
                room_tokens: room_tokens(&fleet.candidates[i]),
                cache_tokens: cache_tokens(&fleet.candidates[i]),
                placed: fleet.candidates[i].placed,
                label: fleet.candidates[i].label,
                homes: 0,
                quiet: false,
            })
            .collect();
        let n = tokens.len() as f64;
        let (keys, first_len) = input.placement();
        let first_message_tokens = match input.prompt_len() {
            0 => n,
            len => n * first_len as f64 / len as f64,
        };
        let keys = keys.with_session(input.session_id);
        let previous = previous_target(self.conversations.as_deref(), keys, input, fleet);
        let ask = Ask {
            tokens: n,
            first_message_tokens,
            keys,
            previous: previous.map(|(i, _)| i),
            // Residency comes from the replica's own events; peers' notes are cache_aware's.
            previous_from_peer: false,
            group_home: group_home_of(
                self.groups.as_ref(),
                keys.group,
                first_message_tokens,
                fleet,
                input.now_ms,
                &mut choices,
            ),
        };
        let placed = self.rule.place(&ask, &choices)?;
        super::cache_aware::note_conversation(self.groups.as_ref(), &ask, &placed, fleet);
        super::explain::log_decision(&ask, &choices, &placed);
        Some(Decision {
            target: placed.index,
            reason: placed.reason,
            score: Some(placed.score),
            hint: None,
            conversation: Some(keys.conversation),
            new_work: placed.new_work,
        })
    }

    /// Called when the request is routed: its blocks beyond what the replica holds become
    /// pending there, and since the replica must now store some, events must follow
    /// (`StreamState::note_routed` starts the staleness clock).
    fn record(&self, input: &RouteInput, fleet: &FleetView, decision: &Decision) {
        let Some(c) = fleet.candidates.get(decision.target) else {
            return;
        };
        remember_target(self.conversations.as_deref(), input, c, decision);
        let Some(tokens) = input.token_ids else {
            return;
        };
        let Some(kv) = c.kv else { return };
        let chain = PrefixChain::new(tokens, block_size_of(&kv), None);
        // An untrusted index counts nothing when scoring, so note from the start.
        let resident = if kv.trusted {
            kv.index.match_chain(&chain).gpu_blocks
        } else {
            0
        };
        if chain.len() > resident {
            if let Some(pending) = kv.pending {
                pending.note(&chain, resident, input.now_ms, kv.index.stamp());
            }
            // Only a replica whose events have shown its block size can be expected to
            // announce these blocks.
            if kv.index.block_size().is_none() {
                return;
            }
            if let Some(stream) = kv.stream {
                stream.note_routed();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_events::decode::{BlockHash, BlockRemoved, BlockStored, KvEvent};
    use crate::routing::Candidate;

    const BS: u32 = 4;

    /// Index holding the first `blocks` blocks of `tokens` as one chain.
    fn index_with(tokens: &[u32], blocks: usize) -> ResidencyIndex {
        index_with_cap(tokens, blocks, 1_000)
    }

    /// [`index_with`] in an index of at most `cap` entries.
    fn index_with_cap(tokens: &[u32], blocks: usize, cap: usize) -> ResidencyIndex {
        let idx = ResidencyIndex::new(cap);
        let mut parent = None;
        let mut events = Vec::new();
        for (b, chunk) in tokens.chunks_exact(BS as usize).take(blocks).enumerate() {
            let h = BlockHash(1000 + b as u64);
            events.push(KvEvent::BlockStored(BlockStored {
                block_hashes: vec![h],
                parent_block_hash: parent,
                token_ids: chunk.to_vec(),
                block_size: BS,
                lora_id: None,
                medium: None,
                lora_name: None,
                extra_keys: None,
                group_idx: None,
            }));
            parent = Some(h);
        }
        idx.apply(&events);
        idx
    }

    /// An eligible target seen through `index` (and `pending`), with `inflight` requests.
    fn kv_candidate<'a>(
        index: &'a ResidencyIndex,
        pending: Option<&'a PendingBlocks>,
        trusted: bool,
        inflight: u64,
        label: &'a str,
    ) -> Candidate<'a> {
        Candidate {
            inflight,
            eligible: true,
            weight: 1,
            prefix: None,
            label,
            kv: Some(KvView {
                index,
                trusted,
                stream: None,
                pending,
            }),
            lmcache: None,
            placed: 0.0,
            cache_tokens: 0.0,
        }
    }

    fn cands<'a>(idx: &'a [ResidencyIndex], loads: &[u64], trusted: &[bool]) -> Vec<Candidate<'a>> {
        idx.iter()
            .enumerate()
            .map(|(i, index)| kv_candidate(index, None, trusted[i], loads[i], ""))
            .collect()
    }

    fn input(tokens: &[u32]) -> RouteInput<'_> {
        RouteInput {
            token_ids: Some(tokens),
            ..Default::default()
        }
    }

    #[test]
    fn request_goes_where_its_blocks_live() {
        let tokens: Vec<u32> = (0..32).collect();
        let idx = [
            index_with(&tokens, 1),
            index_with(&tokens, 6),
            index_with(&[9; 32], 8),
        ];
        let c = cands(&idx, &[0, 0, 0], &[true; 3]);
        let d = PreciseCacheAware::default()
            .select(&input(&tokens), &FleetView::new(&c))
            .unwrap();
        assert_eq!((d.target, d.reason), (1, Reason::CacheHit));
        assert_eq!(d.score, Some(6.0 / 8.0));
    }

    #[test]
    fn untrusted_target_scores_zero_but_stays_eligible() {
        let tokens: Vec<u32> = (0..32).collect();
        let idx = [index_with(&tokens, 8), index_with(&[9; 32], 8)];
        // The untrusted holder is the less loaded: it gets the request on load alone.
        let c = cands(&idx, &[0, 2], &[false, true]);
        let d = PreciseCacheAware::default()
            .select(&input(&tokens), &FleetView::new(&c))
            .unwrap();
        assert_eq!((d.target, d.reason), (0, Reason::BelowThreshold));
        // A trusted replica that holds nothing (size unknown) is room for new work within
        // the load bound: it takes it from the untrusted one, which shows nothing held.
        let empty = [index_with(&tokens, 8), ResidencyIndex::new(10)];
        let c = cands(&empty, &[0, 2], &[false, true]);
        let d = PreciseCacheAware::default()
            .select(&input(&tokens), &FleetView::new(&c))
            .unwrap();
        assert_eq!((d.target, d.reason), (1, Reason::BelowThreshold));
    }

    #[test]
    fn missing_or_short_ids_fall_back_to_least_load() {
        let tokens: Vec<u32> = (0..32).collect();
        let idx = [index_with(&tokens, 8), index_with(&tokens, 8)];
        let c = cands(&idx, &[3, 1], &[true, true]);
        let none = RouteInput::default();
        let d = PreciseCacheAware::default()
            .select(&none, &FleetView::new(&c))
            .unwrap();
        assert_eq!((d.target, d.reason), (1, Reason::Fallback));
        let empty: [u32; 0] = [];
        let d = PreciseCacheAware::default()
            .select(&input(&empty), &FleetView::new(&c))
            .unwrap();
        assert_eq!(d.reason, Reason::Fallback);
        // Fewer tokens than a block: nothing to score.
        let d = PreciseCacheAware::default()
            .select(&input(&tokens[..3]), &FleetView::new(&c))
            .unwrap();
        assert_eq!((d.target, d.reason), (1, Reason::BelowThreshold));
    }

    #[test]
    fn overloaded_holder_sheds_to_least_loaded() {
        let tokens: Vec<u32> = (0..32).collect();
        let idx = [index_with(&tokens, 8), index_with(&[], 0)];
        let c = cands(&idx, &[6, 1], &[true, true]);
        let d = PreciseCacheAware::default()
            .select(&input(&tokens), &FleetView::new(&c))
            .unwrap();
        assert_eq!((d.target, d.reason), (1, Reason::Overloaded));
    }

    /// A group's 2,000-token system prompt, and a new conversation's 2,040-token prompt on it.
    fn new_conversation() -> (Vec<u32>, Vec<u32>) {
        let shared: Vec<u32> = (0..2000).collect();
        let mut tokens = shared.clone();
        tokens.extend(50_000..50_040);
        (shared, tokens)
    }

    /// The share bound moves new work off a target given more than its share only to a
    /// replica whose cache (as configured) holds the prompt twice, or whose size is unknown.
    #[test]
    fn the_share_bound_spills_only_to_a_cache_that_holds_the_prompt_twice() {
        let (shared, tokens) = new_conversation();
        let idx = [
            index_with(&shared, shared.len() / BS as usize),
            ResidencyIndex::new(100),
        ];
        let route = |cache_tokens: f64| {
            let mut c = cands(&idx, &[1, 1], &[true, true]);
            c[0].placed = 20.0;
            c[1].cache_tokens = cache_tokens;
            PreciseCacheAware::default()
                .select(&input(&tokens), &FleetView::new(&c))
                .unwrap()
        };
        // 3,000 tokens cannot hold a second 2,040-token prompt beside its own group's.
        let d = route(3_000.0);
        assert_eq!((d.target, d.new_work), (0, true));
        let d = route(8_192.0);
        assert_eq!((d.target, d.reason), (1, Reason::ShareBound));
        let d = route(0.0);
        assert_eq!((d.target, d.reason), (1, Reason::ShareBound));
    }

    /// Without a configured `kv_cache_tokens`, a replica's cache size is what its events
    /// showed once it evicted a block: the share bound then spills to it only where that
    /// cache holds the prompt twice, as with the size configured. A configured size wins.
    #[test]
    fn without_a_configured_size_the_cache_size_comes_from_the_replicas_evictions() {
        let (shared, tokens) = new_conversation();
        // The spill target held `blocks` blocks of another prompt, then evicted one.
        let evicted = |blocks: usize| {
            let other: Vec<u32> = (90_000..90_000 + blocks as u32 * BS).collect();
            let idx = index_with_cap(&other, blocks, 10_000);
            idx.apply(&[KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![BlockHash(1000 + blocks as u64 - 1)],
                medium: None,
                group_idx: None,
            })]);
            idx
        };
        let route = |spill_to: ResidencyIndex, configured: f64| {
            let idx = [index_with(&shared, shared.len() / BS as usize), spill_to];
            let mut c = cands(&idx, &[1, 1], &[true, true]);
            c[0].placed = 20.0;
            c[1].cache_tokens = configured;
            let size = cache_tokens(&c[1]);
            let d = PreciseCacheAware::default()
                .select(&input(&tokens), &FleetView::new(&c))
                .unwrap();
            (size, d.target, d.reason)
        };
        // 750 blocks of 4 tokens: 3,000 tokens cannot hold a second 2,040-token prompt.
        assert_eq!(route(evicted(750), 0.0), (3_000.0, 0, Reason::CacheHit));
        // 2,048 blocks: 8,192 tokens can.
        assert_eq!(route(evicted(2_048), 0.0), (8_192.0, 1, Reason::ShareBound));
        // Before any eviction the size is unknown (the replica is still filling): no
        // pressure is assumed, as with no size configured.
        let filling = index_with(&(90_000..93_000).collect::<Vec<u32>>(), 750);
        assert_eq!(route(filling, 0.0), (0.0, 1, Reason::ShareBound));
        // The operator's figure wins over the events'.
        assert_eq!(
            route(evicted(750), 8_192.0),
            (8_192.0, 1, Reason::ShareBound)
        );
    }

    /// A new conversation whose group's holder is past the load bound opens a home on an
    /// idle replica only when that replica's cache (configured size less what its stream
    /// reports resident) has room for it.
    #[test]
    fn a_new_conversation_past_the_load_bound_opens_a_home_where_the_cache_has_room() {
        let (shared, tokens) = new_conversation();
        let other: Vec<u32> = (90_000..93_000).collect();
        let block = BS as usize;
        let idx = [
            index_with(&shared, shared.len() / block),
            ResidencyIndex::new(1_000),
            index_with(&other, other.len() / block),
        ];
        let route = |cache_tokens: f64| {
            let mut c = cands(&idx, &[4, 0, 0], &[true; 3]);
            c.iter_mut().for_each(|c| c.cache_tokens = cache_tokens);
            PreciseCacheAware::default()
                .select(&input(&tokens), &FleetView::new(&c))
                .unwrap()
        };
        // 8,192 tokens: the empty replica has room, the one holding 3,000 other tokens not.
        let d = route(8_192.0);
        assert_eq!((d.target, d.reason), (1, Reason::Overloaded));
        // 3,072 tokens: half of it cannot take 2,040 tokens, but the empty replica evicts
        // no one, so its whole cache counts; the one holding 3,000 other tokens has none.
        let d = route(3_072.0);
        assert_eq!((d.target, d.reason), (1, Reason::Overloaded));
        // Sizes unknown: the empty replica still evicts no one, so it takes it; the one
        // holding 3,000 other tokens has no room known.
        let d = route(0.0);
        assert_eq!((d.target, d.reason), (1, Reason::Overloaded));
        let mut c = cands(&idx, &[4, 0, 0], &[true; 3]);
        assert_eq!(room_tokens(&c[1]), f64::INFINITY);
        assert_eq!(room_tokens(&c[2]), 0.0);
        // Without the empty replica, no room is known anywhere: the holder keeps it.
        c[1].eligible = false;
        let d = PreciseCacheAware::default()
            .select(&input(&tokens), &FleetView::new(&c))
            .unwrap();
        assert_eq!((d.target, d.reason), (0, Reason::CacheHit));
        // An untrusted stream's residency is unknown: no room either, empty or not.
        let mut c = cands(&idx, &[4, 0, 0], &[true, false, true]);
        c.iter_mut().for_each(|c| c.cache_tokens = 8_192.0);
        assert_eq!(room_tokens(&c[1]), 0.0);
        assert_eq!(room_tokens(&c[0]), 4_096.0 - 2_000.0);
        // More resident than half the cache: none, not less than none.
        c[2].cache_tokens = 4_000.0;
        assert_eq!(room_tokens(&c[2]), 0.0);
        // An empty index whose replica was sent another prompt (its events not in yet, or
        // lost) is not an empty replica: half its cache counts, too little for this one.
        let pending = PendingBlocks::default();
        let empty = |pending| kv_candidate(&idx[1], pending, true, 0, "b");
        let with_cache = |mut c: Candidate<'_>| {
            c.cache_tokens = 3_072.0;
            room_tokens(&c)
        };
        assert_eq!(with_cache(empty(Some(&pending))), 3_072.0);
        let chain = PrefixChain::new(&other, BS, None);
        pending.note(&chain, 0, 1_000, idx[1].stamp());
        assert_eq!(with_cache(empty(None)), 3_072.0);
        assert_eq!(with_cache(empty(Some(&pending))), 1_536.0);
        let mut c = cands(&idx, &[4, 0, 0], &[true; 3]);
        c.iter_mut().for_each(|c| c.cache_tokens = 3_072.0);
        c[1].kv = Some(KvView {
            pending: Some(&pending),
            ..c[1].kv.unwrap()
        });
        let d = PreciseCacheAware::default()
            .select(&input(&tokens), &FleetView::new(&c))
            .unwrap();
        assert_eq!((d.target, d.reason), (0, Reason::CacheHit));
    }

    /// Under cache pressure a group's new conversations go to its home, not to another
    /// group's home that holds the group's prefix because one conversation spilled there.
    #[test]
    fn under_cache_pressure_new_conversations_stay_on_their_group_home() {
        let system = |g: u32| {
            format!(
                "Csystem\x1f{g} {}",
                "You are a careful assistant. ".repeat(60)
            )
        };
        let prompt = |n: u32| format!("{}\x1euser\x1fquestion {n}\x1e", system(0));
        let tokens =
            |n: u32| -> Vec<u32> { (0..2000).chain(9_000 + n * 40..9_040 + n * 40).collect() };
        let labels = ["a", "b", "c", "d"];
        let fleet = |idx: &'static [ResidencyIndex], loads: [u64; 4]| -> Vec<Candidate<'static>> {
            (0..4)
                .map(|i| Candidate {
                    // A cache of 3,072 tokens: less than two 2,040-token prompts.
                    cache_tokens: 3072.0,
                    ..kv_candidate(&idx[i], None, true, loads[i], labels[i])
                })
                .collect()
        };
        let select = |s: &PreciseCacheAware, c: &[Candidate], n: u32, now_ms: u64| {
            let (p, t) = (prompt(n), tokens(n));
            let input = RouteInput {
                prompt: p.as_bytes(),
                token_ids: Some(&t),
                now_ms,
                ..Default::default()
            };
            s.select(&input, &FleetView::new(c)).unwrap().target
        };
        let empty: &'static [ResidencyIndex] =
            Box::leak((0..4).map(|_| ResidencyIndex::new(1_000)).collect());
        let homes = PreciseCacheAware::default();
        // Three other groups, seen twice each: with this one, a home on every target.
        for g in 1..4 {
            for n in 0..2 {
                let p = format!("{}\x1euser\x1fquestion {n}\x1e", system(g));
                let input = RouteInput {
                    prompt: p.as_bytes(),
                    token_ids: Some(&[7; 64]),
                    now_ms: 900,
                    ..Default::default()
                };
                homes.select(&input, &FleetView::new(&fleet(empty, [0; 4])));
            }
        }
        // Seen twice, the group has a home; a cold conversation at equal loads goes there.
        select(&homes, &fleet(empty, [0; 4]), 0, 1_000);
        select(&homes, &fleet(empty, [0; 4]), 1, 1_001);
        let home = select(&homes, &fleet(empty, [0; 4]), 2, 1_002);
        assert_eq!(select(&homes, &fleet(empty, [0; 4]), 3, 1_003), home);
        // The home and another replica (where one conversation spilled) hold the prefix;
        // the other is less busy.
        let other = (home + 1) % 4;
        let held: &'static [ResidencyIndex] = Box::leak(
            (0..4)
                .map(|i| {
                    let blocks = if i == home || i == other { 500 } else { 0 };
                    index_with(&tokens(0), blocks)
                })
                .collect(),
        );
        let mut loads = [2; 4];
        loads[home] = 3;
        loads[other] = 1;
        assert_eq!(select(&homes, &fleet(held, loads), 4, 1_004), home);
        // Without group homes the less busy holder takes it.
        let no_homes = PreciseCacheAware::new(PlacementRule {
            group_homes: false,
            ..Default::default()
        });
        assert_eq!(select(&no_homes, &fleet(held, loads), 4, 1_004), other);
    }

    /// Before any replica has announced a block, a burst of requests sharing a prefix
    /// follows the first one (the pending overlay), until the guard spreads it.
    #[test]
    fn a_burst_sharing_a_new_prefix_follows_the_first_request() {
        let idx: Vec<ResidencyIndex> = (0..3).map(|_| ResidencyIndex::new(100)).collect();
        let pending: Vec<PendingBlocks> = (0..3).map(|_| PendingBlocks::default()).collect();
        let labels = ["a", "b", "c"];
        let shared: Vec<u32> = (0..2000).collect();
        let mut loads = [0u64; 3];
        let strategy = PreciseCacheAware::default();
        let mut homes = Vec::new();
        for user in 0..12u32 {
            let mut tokens = shared.clone();
            tokens.extend(10_000 + user * 100..10_000 + user * 100 + 40);
            let c: Vec<Candidate> = (0..3)
                .map(|i| kv_candidate(&idx[i], Some(&pending[i]), false, loads[i], labels[i]))
                .collect();
            let view = FleetView::new(&c);
            let input = RouteInput {
                token_ids: Some(&tokens),
                now_ms: 1_000 + u64::from(user),
                ..Default::default()
            };
            let d = strategy.select(&input, &view).unwrap();
            strategy.record(&input, &view, &d);
            loads[d.target] += 1;
            homes.push(d.target);
        }
        // The first 8 share a home (a new conversation leaving its prefix for a target
        // with room moves past NEW_HOME_MARGIN × `balance_abs` = 7 beyond the least
        // loaded); then the group opens a second one.
        assert!(homes[..8].iter().all(|&h| h == homes[0]), "{homes:?}");
        assert_ne!(homes[8], homes[0], "{homes:?}");
    }
}
