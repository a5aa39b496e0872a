//! `precise_cache_aware`: score each target by the leading token blocks its vLLM replica
//! *reports* resident (the residency index fed by its KV-event stream) plus the blocks of
//! requests just routed there whose events have not arrived yet, then place the request
//! with the shared rule of [`super::placement`] in exact tokens.
//!
//! Token ids come from `x-rolter-vllm-token-ids`. The request's blocks are chained once
//! per block size the targets' indices learned from their events (usually one), never
//! an assumed size. Safe fallbacks: no (or malformed) ids → least-load (`fallback`);
//! fewer tokens than one block → nothing cached anywhere (`below_threshold`); a target
//! whose stream is untrusted (gap, stale, restart, no events yet) holds nothing — it is
//! not excluded, it just wins nothing on cache.
//!
//! The pending overlay ([`PendingBlocks`]) is what keeps a burst of requests sharing a
//! new prefix together: the first is noted on its target when routed, and the rest see
//! it there before the replica has computed a block. The placement keys and the
//! conversation test come from the prompt bytes, as for `cache_aware`.

use super::placement::{Ask, Choice, PlacementKeys, PlacementRule};
use super::{Decision, FleetView, Reason, RouteInput, Strategy};
use crate::kv_events::sequence::StreamState;
use crate::prefix::residency::{PrefixChain, ResidencyIndex};
use crate::prefix::PendingBlocks;

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
#[derive(Debug, Default)]
pub struct PreciseCacheAware {
    rule: PlacementRule,
}

impl PreciseCacheAware {
    /// A strategy placing by `rule`.
    pub fn new(rule: PlacementRule) -> Self {
        PreciseCacheAware { rule }
    }
}

/// The request's block chains, one per block size the trusted targets use.
fn chains_for(tokens: &[u32], fleet: &FleetView) -> Vec<PrefixChain> {
    let mut chains: Vec<PrefixChain> = Vec::new();
    for i in fleet.eligible() {
        let Some(bs) = fleet.candidates[i]
            .kv
            .filter(|kv| kv.trusted)
            .and_then(|kv| kv.index.block_size())
        else {
            continue;
        };
        if chains.iter().all(|c| c.block_size() != bs) {
            chains.push(PrefixChain::new(tokens, bs, None));
        }
    }
    chains
}

/// Leading blocks of `chain` resident on `kv`'s replica, and those pending after them.
fn held_blocks(kv: &KvView, chain: &PrefixChain, now_ms: u64) -> (usize, usize) {
    let resident = kv.index.match_chain(chain).gpu_blocks;
    let pending = kv
        .pending
        .map_or(0, |p| p.run_from(chain, resident, now_ms));
    (resident, pending)
}

/// Tokens of the request each eligible target holds (resident or pending), as (index,
/// tokens); untrusted targets and those without a learned block size hold none.
pub fn held_tokens(tokens: &[u32], fleet: &FleetView, now_ms: u64) -> Vec<(usize, f64)> {
    let chains = chains_for(tokens, fleet);
    fleet
        .eligible()
        .map(|i| {
            let held = fleet.candidates[i]
                .kv
                .filter(|kv| kv.trusted)
                .and_then(|kv| {
                    let bs = kv.index.block_size()?;
                    let chain = chains.iter().find(|c| c.block_size() == bs)?;
                    let (resident, pending) = held_blocks(&kv, chain, now_ms);
                    Some(((resident + pending) * bs as usize) as f64)
                })
                .unwrap_or(0.0);
            (i, held)
        })
        .collect()
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
            });
        };
        let choices: Vec<Choice> = held_tokens(tokens, fleet, input.now_ms)
            .into_iter()
            .map(|(i, held)| Choice {
                index: i,
                inflight: fleet.candidates[i].inflight,
                cached_tokens: held,
                label: fleet.candidates[i].label,
            })
            .collect();
        let n = tokens.len() as f64;
        let (keys, first_len) = PlacementKeys::from_prompt(input.prompt);
        let first_message_tokens = if input.prompt.is_empty() {
            n
        } else {
            n * first_len as f64 / input.prompt.len() as f64
        };
        let ask = Ask {
            tokens: n,
            first_message_tokens,
            keys,
        };
        let placed = self.rule.place(&ask, &choices)?;
        Some(Decision {
            target: placed.index,
            reason: placed.reason,
            score: Some(placed.score),
            hint: None,
        })
    }

    /// Called when the request is routed: its blocks beyond what the replica holds become
    /// pending there, and since the replica must now store some, events must follow
    /// (`StreamState::note_routed` starts the staleness clock).
    fn record(&self, input: &RouteInput, fleet: &FleetView, decision: &Decision) {
        let (Some(tokens), Some(c)) = (input.token_ids, fleet.candidates.get(decision.target))
        else {
            return;
        };
        let Some(kv) = c.kv else { return };
        let Some(bs) = kv.index.block_size() else {
            return;
        };
        let chain = PrefixChain::new(tokens, bs, None);
        let resident = kv.index.match_chain(&chain).gpu_blocks;
        if chain.len() > resident {
            if let Some(pending) = kv.pending {
                pending.note(&chain, resident, input.now_ms);
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
    use crate::kv_events::decode::{BlockHash, BlockStored, KvEvent};
    use crate::routing::Candidate;

    const BS: u32 = 4;

    /// Index holding the first `blocks` blocks of `tokens` as one chain.
    fn index_with(tokens: &[u32], blocks: usize) -> ResidencyIndex {
        let idx = ResidencyIndex::new(1_000);
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

    fn cands<'a>(idx: &'a [ResidencyIndex], loads: &[u64], trusted: &[bool]) -> Vec<Candidate<'a>> {
        idx.iter()
            .enumerate()
            .map(|(i, index)| Candidate {
                inflight: loads[i],
                eligible: true,
                weight: 1,
                prefix: None,
                label: "",
                kv: Some(KvView {
                    index,
                    trusted: trusted[i],
                    stream: None,
                    pending: None,
                }),
                lmcache: None,
            })
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
        let idx = [index_with(&tokens, 8), index_with(&[], 0)];
        // The untrusted holder is the less loaded: it gets the request on load alone.
        let c = cands(&idx, &[0, 2], &[false, true]);
        let d = PreciseCacheAware::default()
            .select(&input(&tokens), &FleetView::new(&c))
            .unwrap();
        assert_eq!((d.target, d.reason), (0, Reason::BelowThreshold));
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
}
