//! One replica's block-level prefix cache, modelled on vLLM's automatic prefix caching (APC).
//!
//! Owns: which blocks a replica holds, their hash chain, reference counts of running requests,
//! LRU eviction, and the logical KV events ([`CacheEvent`]) that every change produces, in the
//! order vLLM's block pool emits them. It knows nothing about time, sockets or encodings.
//!
//! Model (vLLM v1 `BlockPool` / `KVCacheManager`):
//! - A prompt is cut into full blocks of `block_size` tokens; a trailing partial block is never
//!   cached. A block's hash chains its parent's hash and its own tokens, so equal tokens under a
//!   different prefix are a different block. The hash is seeded per replica (vLLM's seed is per
//!   process in many versions), so consumers must not assume two replicas agree on hashes.
//! - A lookup counts the leading blocks present, capped at `num_tokens - 1` tokens: vLLM always
//!   recomputes at least the last prompt token (`max_cache_hit_length = num_tokens - 1`).
//! - Admission pins the hit blocks, then stores the prompt's remaining full blocks (pinned).
//!   Storing needs a free slot: when the cache is full the least-recently-used unpinned block is
//!   evicted (one `BlockRemoved` per evicted block, as vLLM's `_maybe_evict_cached_block`); when
//!   every block is pinned the rest of the prompt is simply not cached (vLLM would preempt).
//!   A batch lists the removals first, then the stores, as they happen inside one vLLM step.
//! - On completion the output's full blocks are stored too; release unpins in reverse order so
//!   a request's tail blocks are evicted before its head (vLLM's `free_blocks` ordering).

use std::collections::{BTreeMap, HashMap};

use crate::tokenizer::splitmix64;

/// vLLM's default KV-cache block size in tokens (through 0.33).
pub const VLLM_DEFAULT_BLOCK_SIZE: usize = 16;

/// A block hash as the simulator computes it; the KV-event encoder may present it signed or as
/// 32 bytes (see `kv_events::encode::HashRepr`).
pub type BlockHash = u64;

/// A change to the cache, before wire encoding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    /// Consecutive new blocks of one chain: `token_ids` is their tokens concatenated.
    Stored {
        block_hashes: Vec<BlockHash>,
        parent_block_hash: Option<BlockHash>,
        token_ids: Vec<u32>,
        block_size: usize,
    },
    /// Evicted blocks.
    Removed { block_hashes: Vec<BlockHash> },
    /// Every block dropped (a prefix-cache reset).
    AllCleared,
}

/// One cached block, for snapshots and equality tests.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CachedBlock {
    pub hash: BlockHash,
    pub parent: Option<BlockHash>,
    pub tokens: Vec<u32>,
}

#[derive(Debug)]
struct Entry {
    parent: Option<BlockHash>,
    tokens: Vec<u32>,
    refs: u32,
    /// Position in the free LRU while `refs == 0`.
    lru_tick: u64,
}

/// Blocks pinned by one running request, in chain order.
#[derive(Debug)]
pub struct Lease {
    held: Vec<BlockHash>,
    epoch: u64,
}

impl Lease {
    /// Number of leading blocks this request holds.
    pub fn blocks(&self) -> usize {
        self.held.len()
    }
}

/// Result of admitting a prompt.
#[derive(Debug)]
pub struct Admission {
    pub lease: Lease,
    /// Prompt tokens served from cache (a multiple of the block size).
    pub hit_tokens: usize,
    /// Events to publish, in order.
    pub events: Vec<CacheEvent>,
}

/// The block cache of one replica.
#[derive(Debug)]
pub struct PrefixCache {
    block_size: usize,
    capacity: usize,
    seed: u64,
    entries: HashMap<BlockHash, Entry>,
    /// Unpinned blocks by last release tick; the first entry is evicted next.
    free_lru: BTreeMap<u64, BlockHash>,
    tick: u64,
    /// Bumped by a reset so that leases from before it release nothing.
    epoch: u64,
    evictions: u64,
}

const FNV64_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV64_PRIME: u64 = 0x0000_0100_0000_01b3;

/// Hash of a block: FNV-1a-64 over the parent hash (or the seed for a first block) and the
/// block's tokens (little-endian), finished with SplitMix64 so hashes spread over all 64 bits.
pub fn block_hash(seed: u64, parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
    let mut h = FNV64_OFFSET;
    let mut feed = |bytes: &[u8]| {
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(FNV64_PRIME);
        }
    };
    match parent {
        Some(p) => {
            feed(&[1]);
            feed(&p.to_le_bytes());
        }
        None => {
            feed(&[0]);
            feed(&seed.to_le_bytes());
        }
    }
    for t in tokens {
        feed(&t.to_le_bytes());
    }
    splitmix64(h)
}

impl PrefixCache {
    /// A cache of `capacity` blocks of `block_size` tokens whose hashes use `seed`.
    pub fn new(block_size: usize, capacity: usize, seed: u64) -> Self {
        assert!(block_size > 0, "block size must be positive");
        Self {
            block_size,
            capacity,
            seed,
            entries: HashMap::new(),
            free_lru: BTreeMap::new(),
            tick: 0,
            epoch: 0,
            evictions: 0,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Blocks currently cached.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Blocks evicted so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Chained hashes of the full blocks of `tokens`.
    pub fn chain_hashes(&self, tokens: &[u32]) -> Vec<BlockHash> {
        let mut parent = None;
        tokens
            .chunks_exact(self.block_size)
            .map(|chunk| {
                let h = block_hash(self.seed, parent, chunk);
                parent = Some(h);
                h
            })
            .collect()
    }

    /// Leading full blocks of `tokens` present in the cache (no vLLM cap).
    pub fn match_blocks(&self, tokens: &[u32]) -> usize {
        self.chain_hashes(tokens)
            .iter()
            .take_while(|h| self.entries.contains_key(h))
            .count()
    }

    /// Tokens vLLM would serve from cache for this prompt: leading cached blocks, at most
    /// `len - 1` tokens.
    pub fn hit_tokens(&self, tokens: &[u32]) -> usize {
        let cap_blocks = tokens.len().saturating_sub(1) / self.block_size;
        self.match_blocks(tokens).min(cap_blocks) * self.block_size
    }

    /// Admit a prompt: count hits, pin them, store the remaining full blocks.
    pub fn admit(&mut self, tokens: &[u32]) -> Admission {
        let cap_blocks = tokens.len().saturating_sub(1) / self.block_size;
        let hashes = self.chain_hashes(tokens);
        let hit_blocks = hashes
            .iter()
            .take(cap_blocks)
            .take_while(|h| self.entries.contains_key(h))
            .count();
        let mut lease = Lease {
            held: Vec::with_capacity(hashes.len()),
            epoch: self.epoch,
        };
        for &h in &hashes[..hit_blocks] {
            self.pin(h);
            lease.held.push(h);
        }
        let events = self.store_from(&mut lease, tokens, &hashes);
        Admission {
            lease,
            hit_tokens: hit_blocks * self.block_size,
            events,
        }
    }

    /// Store the full blocks of `all_tokens` (prompt + output) beyond those the lease holds.
    pub fn extend(&mut self, lease: &mut Lease, all_tokens: &[u32]) -> Vec<CacheEvent> {
        if lease.epoch != self.epoch {
            return Vec::new();
        }
        let hashes = self.chain_hashes(all_tokens);
        self.store_from(lease, all_tokens, &hashes)
    }

    /// Unpin a request's blocks, tail first, making them evictable.
    pub fn release(&mut self, lease: Lease) {
        if lease.epoch != self.epoch {
            return;
        }
        for h in lease.held.into_iter().rev() {
            if let Some(e) = self.entries.get_mut(&h) {
                e.refs = e.refs.saturating_sub(1);
                if e.refs == 0 {
                    self.tick += 1;
                    e.lru_tick = self.tick;
                    self.free_lru.insert(self.tick, h);
                }
            }
        }
    }

    /// Drop every block and report it (vLLM's `reset_prefix_cache`).
    pub fn clear(&mut self) -> Vec<CacheEvent> {
        self.reset();
        vec![CacheEvent::AllCleared]
    }

    /// Drop every block without an event (what a restarted process looks like).
    pub fn reset(&mut self) {
        self.entries.clear();
        self.free_lru.clear();
        self.epoch += 1;
    }

    /// Every cached block.
    pub fn snapshot(&self) -> Vec<CachedBlock> {
        self.entries
            .iter()
            .map(|(&hash, e)| CachedBlock {
                hash,
                parent: e.parent,
                tokens: e.tokens.clone(),
            })
            .collect()
    }

    /// Whether a block is cached.
    pub fn contains(&self, hash: BlockHash) -> bool {
        self.entries.contains_key(&hash)
    }

    fn pin(&mut self, h: BlockHash) {
        if let Some(e) = self.entries.get_mut(&h) {
            if e.refs == 0 {
                self.free_lru.remove(&e.lru_tick);
            }
            e.refs += 1;
        }
    }

    /// Store blocks `lease.held.len()..` of `tokens`; returns removals then stores.
    fn store_from(
        &mut self,
        lease: &mut Lease,
        tokens: &[u32],
        hashes: &[BlockHash],
    ) -> Vec<CacheEvent> {
        let bs = self.block_size;
        let mut removed = Vec::new();
        let mut stored = Vec::new();
        // The run of new blocks being collected into one BlockStored.
        let mut run: Option<(Option<BlockHash>, Vec<BlockHash>, Vec<u32>)> = None;
        let flush = |run: &mut Option<(Option<BlockHash>, Vec<BlockHash>, Vec<u32>)>,
                     stored: &mut Vec<CacheEvent>| {
            if let Some((parent, block_hashes, token_ids)) = run.take() {
                stored.push(CacheEvent::Stored {
                    block_hashes,
                    parent_block_hash: parent,
                    token_ids,
                    block_size: bs,
                });
            }
        };
        for i in lease.held.len()..hashes.len() {
            let h = hashes[i];
            let parent = if i == 0 { None } else { Some(hashes[i - 1]) };
            if self.entries.contains_key(&h) {
                // Already cached (stored by a concurrent request): share it.
                flush(&mut run, &mut stored);
                self.pin(h);
                lease.held.push(h);
                continue;
            }
            if self.entries.len() >= self.capacity {
                match self.free_lru.pop_first() {
                    Some((_, victim)) => {
                        self.entries.remove(&victim);
                        self.evictions += 1;
                        removed.push(CacheEvent::Removed {
                            block_hashes: vec![victim],
                        });
                    }
                    None => break, // every block is pinned: the rest stays uncached
                }
            }
            let chunk = &tokens[i * bs..(i + 1) * bs];
            self.entries.insert(
                h,
                Entry {
                    parent,
                    tokens: chunk.to_vec(),
                    refs: 1,
                    lru_tick: 0,
                },
            );
            lease.held.push(h);
            let r = run.get_or_insert_with(|| (parent, Vec::new(), Vec::new()));
            r.1.push(h);
            r.2.extend_from_slice(chunk);
        }
        flush(&mut run, &mut stored);
        removed.extend(stored);
        removed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(ev: &CacheEvent) -> (&[BlockHash], Option<BlockHash>, &[u32]) {
        match ev {
            CacheEvent::Stored {
                block_hashes,
                parent_block_hash,
                token_ids,
                ..
            } => (block_hashes, *parent_block_hash, token_ids),
            other => panic!("expected Stored, got {other:?}"),
        }
    }

    #[test]
    fn hashes_chain_through_parents() {
        let c = PrefixCache::new(4, 10, 7);
        let a = c.chain_hashes(&[1, 2, 3, 4, 5, 6, 7, 8]);
        let b = c.chain_hashes(&[9, 9, 9, 9, 5, 6, 7, 8]);
        assert_eq!(a.len(), 2);
        // Same tokens in block 1, different parent: different hash.
        assert_ne!(a[1], b[1]);
        assert_eq!(a[1], block_hash(7, Some(a[0]), &[5, 6, 7, 8]));
        assert_eq!(a[0], block_hash(7, None, &[1, 2, 3, 4]));
        // A partial trailing block is not hashed.
        assert_eq!(c.chain_hashes(&[1, 2, 3, 4, 5]).len(), 1);
        // The seed changes every hash.
        let other = PrefixCache::new(4, 10, 8);
        assert_ne!(other.chain_hashes(&[1, 2, 3, 4])[0], a[0]);
    }

    /// The hand-worked example: block size 4, capacity 4 blocks.
    #[test]
    fn hand_worked_hits_misses_and_evictions() {
        let mut c = PrefixCache::new(4, 4, 0);
        let a_tokens: Vec<u32> = (1..=9).collect();
        let ah = c.chain_hashes(&a_tokens); // a0 = [1..4], a1 = [5..8]

        // A: 9 tokens, 2 full blocks, cold: 0 hits, stores a0 a1 in one event.
        let adm = c.admit(&a_tokens);
        assert_eq!(adm.hit_tokens, 0);
        assert_eq!(adm.events.len(), 1);
        let (hs, parent, toks) = stored(&adm.events[0]);
        assert_eq!(hs, &ah[..]);
        assert_eq!(parent, None);
        assert_eq!(toks, &(1..=8).collect::<Vec<u32>>()[..]);
        c.release(adm.lease); // free LRU: a1 (tick 1), a0 (tick 2)

        // B: exactly [1..8]: both blocks cached but vLLM recomputes the last token, so the
        // hit is capped at (8 - 1) / 4 = 1 block. a1 is shared, not stored again.
        let b: Vec<u32> = (1..=8).collect();
        let adm = c.admit(&b);
        assert_eq!(adm.hit_tokens, 4);
        assert!(adm.events.is_empty());
        c.release(adm.lease); // a1 (tick 3), a0 (tick 4)

        // C: shares a0, then two new blocks chained under a0.
        let c_tokens = vec![1, 2, 3, 4, 20, 21, 22, 23, 24, 25, 26, 27, 28];
        let ch = c.chain_hashes(&c_tokens);
        let adm = c.admit(&c_tokens);
        assert_eq!(adm.hit_tokens, 4);
        assert_eq!(adm.events.len(), 1);
        let (hs, parent, toks) = stored(&adm.events[0]);
        assert_eq!(hs, &ch[1..]);
        assert_eq!(parent, Some(ah[0]));
        assert_eq!(toks, &[20, 21, 22, 23, 24, 25, 26, 27]);
        assert_eq!(c.len(), 4);
        c.release(adm.lease); // c2 (5), c1 (6), a0 (7)

        // D: unrelated, 2 blocks into a full cache: evicts the two least recently released
        // blocks, a1 (tick 3) then c2 (tick 5); removals precede the store in the batch.
        let d_tokens = vec![9, 9, 9, 9, 8, 8, 8, 8, 7];
        let dh = c.chain_hashes(&d_tokens);
        let adm = c.admit(&d_tokens);
        assert_eq!(adm.hit_tokens, 0);
        assert_eq!(
            adm.events[0],
            CacheEvent::Removed {
                block_hashes: vec![ah[1]]
            }
        );
        assert_eq!(
            adm.events[1],
            CacheEvent::Removed {
                block_hashes: vec![ch[2]]
            }
        );
        assert_eq!(stored(&adm.events[2]).0, &dh[..]);
        assert_eq!(c.evictions(), 2);
        c.release(adm.lease);

        // A again: a0 survived, a1 was evicted: 4 hit tokens.
        assert_eq!(c.hit_tokens(&a_tokens), 4);
        let mut left: Vec<BlockHash> = c.snapshot().iter().map(|b| b.hash).collect();
        left.sort();
        let mut want = vec![ah[0], ch[1], dh[0], dh[1]];
        want.sort();
        assert_eq!(left, want);
    }

    #[test]
    fn pinned_blocks_are_not_evicted() {
        let mut c = PrefixCache::new(2, 2, 0);
        let a = c.admit(&[1, 2, 3, 4, 5]); // stores 2 blocks, pinned
        let b = c.admit(&[7, 7, 8, 8, 9]); // no free slot: nothing stored
        assert!(b.events.is_empty());
        assert_eq!(b.lease.blocks(), 0);
        c.release(a.lease);
        let b2 = c.admit(&[7, 7, 8, 8, 9]);
        assert_eq!(b2.events.len(), 3); // two removals, one store
    }

    #[test]
    fn extend_stores_output_blocks_and_chains() {
        let mut c = PrefixCache::new(4, 100, 0);
        let prompt = vec![1, 2, 3, 4, 5, 6];
        let mut adm = c.admit(&prompt);
        assert_eq!(adm.lease.blocks(), 1);
        let all = vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10];
        let ev = c.extend(&mut adm.lease, &all);
        let h = c.chain_hashes(&all);
        assert_eq!(ev.len(), 1);
        let (hs, parent, toks) = stored(&ev[0]);
        assert_eq!(hs, &h[1..2]);
        assert_eq!(parent, Some(h[0]));
        assert_eq!(toks, &[5, 6, 7, 8]);
        c.release(adm.lease);
        assert_eq!(c.hit_tokens(&[1, 2, 3, 4, 5, 6, 7, 8, 99]), 8);
    }

    #[test]
    fn clear_drops_everything_and_old_leases_are_inert() {
        let mut c = PrefixCache::new(4, 100, 0);
        let adm = c.admit(&[1, 2, 3, 4, 5]);
        assert_eq!(c.clear(), vec![CacheEvent::AllCleared]);
        assert!(c.is_empty());
        let adm2 = c.admit(&[1, 2, 3, 4, 5]);
        c.release(adm.lease); // from before the clear: must not unpin adm2's block
        let b = c.admit(&[9, 9, 9, 9, 1]);
        c.release(b.lease);
        assert_eq!(c.len(), 2);
        c.release(adm2.lease);
    }

    mod props {
        use super::*;
        use proptest::prelude::*;
        use std::collections::HashMap;

        #[derive(Debug, Clone)]
        enum Op {
            /// Admit a prompt built from `len` tokens of a small alphabet (so prefixes repeat).
            Admit(Vec<u32>),
            /// Extend the oldest open lease with `n` more tokens, then release it.
            Finish(usize),
            Clear,
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                6 => proptest::collection::vec(0u32..3, 0..40).prop_map(Op::Admit),
                3 => (0usize..20).prop_map(Op::Finish),
                1 => Just(Op::Clear),
            ]
        }

        /// Apply events to a map the way a KV-event consumer would.
        fn apply(state: &mut HashMap<BlockHash, Vec<u32>>, events: &[CacheEvent]) {
            for e in events {
                match e {
                    CacheEvent::Stored {
                        block_hashes,
                        parent_block_hash,
                        token_ids,
                        block_size,
                    } => {
                        if let Some(p) = parent_block_hash {
                            assert!(state.contains_key(p), "a store's parent is cached");
                        }
                        assert_eq!(token_ids.len(), block_hashes.len() * block_size);
                        for (h, chunk) in block_hashes.iter().zip(token_ids.chunks(*block_size)) {
                            assert!(state.insert(*h, chunk.to_vec()).is_none(), "stored twice");
                        }
                    }
                    CacheEvent::Removed { block_hashes } => {
                        for h in block_hashes {
                            assert!(state.remove(h).is_some(), "removed an unknown block");
                        }
                    }
                    CacheEvent::AllCleared => state.clear(),
                }
            }
        }

        proptest! {
            /// Capacity is never exceeded, pinned blocks are never evicted, and the event
            /// stream always describes the cache exactly.
            #[test]
            fn events_mirror_the_cache(ops in proptest::collection::vec(op(), 1..60),
                                       capacity in 0usize..12) {
                let mut c = PrefixCache::new(4, capacity, 9);
                let mut state = HashMap::new();
                let mut open: Vec<(Lease, Vec<u32>)> = Vec::new();
                for op in ops {
                    match op {
                        Op::Admit(tokens) => {
                            let adm = c.admit(&tokens);
                            prop_assert!(adm.hit_tokens.is_multiple_of(4));
                            prop_assert!(adm.hit_tokens < tokens.len().max(1));
                            apply(&mut state, &adm.events);
                            open.push((adm.lease, tokens));
                        }
                        Op::Finish(n) => {
                            if !open.is_empty() {
                                let (mut lease, mut tokens) = open.remove(0);
                                tokens.extend((0..n as u32).map(|i| i % 3));
                                let ev = c.extend(&mut lease, &tokens);
                                apply(&mut state, &ev);
                                c.release(lease);
                            }
                        }
                        Op::Clear => apply(&mut state, &c.clear()),
                    }
                    prop_assert!(c.len() <= capacity);
                    for (lease, _) in &open {
                        if lease.epoch == c.epoch {
                            for h in &lease.held {
                                prop_assert!(c.contains(*h), "a pinned block was evicted");
                            }
                        }
                    }
                    let snap: HashMap<BlockHash, Vec<u32>> =
                        c.snapshot().into_iter().map(|b| (b.hash, b.tokens)).collect();
                    prop_assert_eq!(&snap, &state);
                }
            }
        }
    }
}
