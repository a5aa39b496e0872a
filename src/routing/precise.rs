//! `precise_cache_aware`: score each target by the fraction of the request's leading
//! token blocks that its vLLM replica *reports* resident (the residency index fed by
//! its KV-event stream), then apply cache_aware's threshold + overload rule.
//!
//! Token ids come from `x-rolter-vllm-token-ids`. The request's blocks are chained once
//! per block size the targets' indices learned from their events (usually one), never
//! an assumed size. Safe fallbacks: no (or malformed) ids, or fewer tokens than one
//! block → least-load (`fallback`); a target whose stream is untrusted (gap, stale,
//! restart, no events yet) scores 0 — it is not excluded, it just wins nothing on cache.

use super::cache_aware::{least_loaded_then_coldest, overloaded, DEFAULT_CACHE_THRESHOLD};
use super::{pick_random, Decision, FleetView, Reason, RouteInput, Strategy};
use crate::kv_events::sequence::StreamState;
use crate::prefix::residency::{PrefixChain, ResidencyIndex};

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
}

/// The precise cache-aware strategy.
#[derive(Debug)]
pub struct PreciseCacheAware {
    threshold: f64,
}

impl PreciseCacheAware {
    /// A strategy pinning at `threshold`.
    pub fn new(threshold: f64) -> Self {
        PreciseCacheAware { threshold }
    }
}

impl Default for PreciseCacheAware {
    fn default() -> Self {
        PreciseCacheAware::new(DEFAULT_CACHE_THRESHOLD)
    }
}

/// Each eligible target's resident-prefix score for `tokens`, as (index, score).
pub fn residency_scores(tokens: &[u32], fleet: &FleetView) -> Vec<(usize, f64)> {
    let mut chains: Vec<PrefixChain> = Vec::new();
    fleet
        .eligible()
        .map(|i| {
            let score = match fleet.candidates[i].kv {
                Some(kv) if kv.trusted => match kv.index.block_size() {
                    Some(bs) => {
                        let chain = match chains.iter().position(|c| c.block_size() == bs) {
                            Some(p) => &chains[p],
                            None => {
                                chains.push(PrefixChain::new(tokens, bs, None));
                                chains.last().expect("just pushed")
                            }
                        };
                        kv.index.match_chain(chain).gpu_score()
                    }
                    None => 0.0,
                },
                _ => 0.0,
            };
            (i, score)
        })
        .collect()
}

impl Strategy for PreciseCacheAware {
    fn name(&self) -> &'static str {
        "precise_cache_aware"
    }

    fn uses_prompt(&self) -> bool {
        false
    }

    fn select(&self, input: &RouteInput, fleet: &FleetView) -> Option<Decision> {
        let min = fleet.min_inflight()?;
        let fallback = || {
            fleet.least_loaded().map(|target| Decision {
                target,
                reason: Reason::Fallback,
                score: None,
                hint: None,
            })
        };
        let Some(tokens) = input.token_ids.filter(|t| !t.is_empty()) else {
            return fallback();
        };
        let scores = residency_scores(tokens, fleet);
        let best = scores.iter().map(|s| s.1).fold(f64::NEG_INFINITY, f64::max);
        if best <= 0.0 {
            // No trusted target holds even the first block: spread like cache_aware
            // does below threshold (least-loaded, then least-warmed).
            return least_loaded_then_coldest(fleet).map(|target| Decision {
                target,
                reason: Reason::BelowThreshold,
                score: Some(0.0),
                hint: None,
            });
        }
        let top = pick_random(scores.iter().filter(|s| s.1 == best).map(|s| s.0))?;
        let (target, reason) = if best >= self.threshold {
            if overloaded(fleet.candidates[top].inflight, min) {
                (fleet.least_loaded()?, Reason::Overloaded)
            } else {
                (top, Reason::CacheHit)
            }
        } else {
            (least_loaded_then_coldest(fleet)?, Reason::BelowThreshold)
        };
        Some(Decision {
            target,
            reason,
            score: Some(best),
            hint: None,
        })
    }

    fn uses_token_ids(&self) -> bool {
        true
    }

    fn record(&self, input: &RouteInput, fleet: &FleetView, decision: &Decision) {
        let target = decision.target;
        // A request with more full blocks than the replica holds makes it store some:
        // events must follow, or the stream is stale (`StreamState::note_routed`).
        let (Some(tokens), Some(c)) = (input.token_ids, fleet.candidates.get(target)) else {
            return;
        };
        let Some(kv) = c.kv else { return };
        let Some(bs) = kv.index.block_size() else {
            return;
        };
        let chain = PrefixChain::new(tokens, bs, None);
        let m = kv.index.match_chain(&chain);
        if m.total_blocks > m.gpu_blocks {
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
        let c = cands(&idx, &[0, 0], &[false, true]);
        let view = FleetView::new(&c);
        let mut seen = [0; 2];
        for _ in 0..100 {
            let d = PreciseCacheAware::default()
                .select(&input(&tokens), &view)
                .unwrap();
            assert_eq!(d.reason, Reason::BelowThreshold);
            seen[d.target] += 1;
        }
        assert!(
            seen[0] > 0,
            "untrusted target must still get load-based traffic"
        );
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
