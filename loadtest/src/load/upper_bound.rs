//! The theoretical best prefix-cache hit rate of a workload: one replica with an unbounded cache
//! serving the whole trace.
//!
//! Owns only arithmetic over the simulator's own cache model, so it counts exactly what the
//! replicas' `vllm:prefix_cache_*` counters would (same block size, same `len - 1` cap, output
//! blocks cached). Replies are the deterministic ones every replica generates, so the trace is
//! the one the driver sends.

use crate::cache::PrefixCache;
use crate::load::workload::Session;
use crate::tokenizer;

/// Prompt tokens looked up and served from cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HitCount {
    pub queries: u64,
    pub hits: u64,
}

impl HitCount {
    /// hits / queries (0 when nothing was queried).
    pub fn rate(&self) -> f64 {
        if self.queries == 0 {
            0.0
        } else {
            self.hits as f64 / self.queries as f64
        }
    }
}

/// Hit count of the sessions on one replica with unbounded cache, sessions in order.
pub fn upper_bound(sessions: &[Session], block_size: usize) -> HitCount {
    let mut cache = PrefixCache::new(block_size, usize::MAX, 0);
    let mut count = HitCount::default();
    for s in sessions {
        let mut replies = Vec::with_capacity(s.user_turns.len());
        for t in 0..s.user_turns.len() {
            let mut first_reply = None;
            for call in 0..s.calls_at(t) {
                let prompt = tokenizer::chat_tokens(&s.call_messages(t, call, &replies));
                let mut adm = cache.admit(&prompt);
                count.queries += prompt.len() as u64;
                count.hits += adm.hit_tokens as u64;
                let (text, out) = tokenizer::reply(&prompt, s.max_tokens.max(1));
                let mut all = prompt;
                all.extend_from_slice(&out);
                cache.extend(&mut adm.lease, &all);
                cache.release(adm.lease);
                first_reply.get_or_insert(text);
            }
            replies.push(first_reply.unwrap_or_default());
        }
    }
    count
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::workload::{generate, WorkloadKind, WorkloadSpec};

    #[test]
    fn unique_prompts_share_almost_nothing_multi_turn_shares_a_lot() {
        let unique = generate(&WorkloadSpec {
            workload: WorkloadKind::Unique,
            requests: 20,
            user_tokens: 100,
            ..WorkloadSpec::default()
        });
        assert_eq!(upper_bound(&unique, 16).hits, 0);

        let mt = generate(&WorkloadSpec {
            sessions: 8,
            turns: 3,
            prefixes: 2,
            prefix_tokens: 320,
            user_tokens: 20,
            ..WorkloadSpec::default()
        });
        let ub = upper_bound(&mt, 16);
        assert!(ub.rate() > 0.8, "{ub:?}");
        assert!(ub.rate() < 1.0);
    }
}
