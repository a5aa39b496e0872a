//! Bounded, exact index of the KV blocks one target (vLLM replica) holds, fed by its
//! KV events and probed with a request's token ids.
//!
//! Owns per-target block residency and nothing else: no sockets, no clocks, no
//! tokio/zeromq/pingora (it consumes the plain data types of
//! `kv_events::decode`); routing policy lives in `routing/precise.rs`.
//!
//! How tokens find blocks without vLLM's hash: vLLM's block hash is SHA-256 (or
//! Python's `hash()`) over a pickle/CBOR of `(parent hash, tokens, extra keys)`,
//! seeded per process in some releases, so the gateway never recomputes it (llm-d's
//! kv-cache indexer and Dynamo's router do the same). Instead each `BlockStored`
//! teaches the mapping `(parent, token chunk, LoRA) → engine hash`: the index
//! computes its own chained 64-bit hash ([`PrefixChain`]) over the event's token
//! chunks, starting from the parent's own hash (looked up through the engine-hash →
//! own-hash map) or from a LoRA-specific root, and records `engine hash → own hash`.
//! A request's token ids are chained the same way, and its score is the number of
//! leading blocks whose own hash is resident. Blocks whose `extra_keys` carry more
//! than the LoRA name (cache salt, multimodal hashes, prompt embeddings) get a
//! tainted own hash: a request known only by its token ids can never hit them in
//! vLLM either, so they never match.
//!
//! Exactness and idempotence:
//! - Entries are keyed by `(group_idx, engine hash)` and carry a tier set (GPU, CPU,
//!   storage, other). `BlockStored` adds its tier, `BlockRemoved` clears only its own
//!   tier: a CPU-tier removal never drops GPU residency. No medium means GPU (the
//!   releases before `medium` only reported the GPU pool).
//! - Stores are idempotent (vLLM can re-announce cache hits); a re-store refreshes
//!   the entry's age. vLLM may cache two physical copies of one hash and announce a
//!   removal per copy; the index cannot tell copies from re-announcements, so the
//!   first removal wins: it may under-report residency, never over-report it.
//! - Removed entries are remembered (tier set empty) so later stores can still chain
//!   from them as parents; they are the first to go when the index is full.
//! - A store whose parent is unknown (the stream started mid-way, or the mapping was
//!   evicted) cannot be placed in the chain and is skipped (`orphan_stores`); one
//!   whose token count is not `block_size × hashes` (null blocks of sliding-window
//!   groups) is skipped too (`misaligned_stores`). Token-less stores (vLLM's
//!   offloading connector announcing CPU copies) only add a tier to known entries.
//! - The block size is learned from the first store that carries tokens; stores of
//!   another size are skipped (`foreign_block_size_stores`).
//!
//! Cache size: vLLM evicts a cached block to reuse it only once no never-used or uncached
//! free block is left, so the GPU blocks resident when the first GPU removal arrives, and
//! the most resident since, are the replica's cache size less the blocks running requests
//! hold unfinished (and less duplicate copies). [`ResidencyIndex::capacity_tokens`] reports
//! that high-water mark, in tokens, from the first known GPU removal on. A new count starts
//! at every clear and keeps the last size until it has seen a removal: after
//! `AllBlocksCleared` (vLLM reset every block) or a restart ([`ResidencyIndex::restart`])
//! it sees every block and replaces the size; after a gap ([`ResidencyIndex::clear`]) it
//! misses blocks the replica still holds from before and only ever raises it. vLLM also
//! evicts blocks a KV connector failed to load (`BlockPool::evict_blocks`), which would
//! end a count early: with a connector the operator's `kv_cache_tokens` is the size.
//!
//! Bounds: at most `max_entries` entries (resident or remembered; a reload may change
//! the cap, evicting down to it at once); past that the oldest remembered-removed
//! entries go first, then the least recently stored resident ones. Eviction queues are
//! lazily invalidated and compacted, so memory stays O(max_entries).
//!
//! Concurrency: one `RwLock` per target (no lock spans targets). Readers hash the
//! request outside the lock ([`PrefixChain`] is computed once per request and
//! probed against every target with the same block size) and hold the read lock
//! only for the hash-map probes; writers (the target's subscriber) take the write
//! lock once per batch.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

use parking_lot::RwLock;

use crate::prefix::event::{BlockHash, BlockRemoved, BlockStored, ExtraKey, KvEvent, Medium};

/// Default cap on entries per target: about 1M blocks, i.e. 16M tokens at vLLM's
/// default block size of 16, more than a single replica's GPU + CPU cache holds.
pub const DEFAULT_MAX_ENTRIES: usize = 1 << 20;

/// Seed of every un-LoRA'd chain (the 64-bit golden ratio; any odd constant works).
const ROOT_SEED: u64 = 0x9E37_79B9_7F4A_7C15;
/// Domain separators so roots, chunks and taints never alias.
const LORA_NAME_TAG: u64 = 0x4C4F_5241_4E41_4D45; // "LORANAME"
const LORA_ID_TAG: u64 = 0x4C4F_5241_5F49_4400; // "LORA_ID"
const TAINT_TAG: u64 = 0x5441_494E_5445_4421; // "TAINTED!"

/// Tier bit of a block's medium.
const TIER_GPU: u8 = 1;
const TIER_CPU: u8 = 2;
const TIER_STORAGE: u8 = 4;
const TIER_OTHER: u8 = 8;

/// Queues may hold this many stale items per live entry before being compacted.
const QUEUE_SLACK: usize = 2;

/// splitmix64's finaliser: a fast 64-bit bijection with good avalanche.
#[inline]
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Own hash of one block: its parent's own hash chained with its token chunk.
#[inline]
fn chain_hash(parent: u64, chunk: &[u32]) -> u64 {
    let mut h = mix(parent ^ chunk.len() as u64);
    let mut pairs = chunk.chunks_exact(2);
    for p in &mut pairs {
        h = mix(h ^ (u64::from(p[0]) | (u64::from(p[1]) << 32)));
    }
    if let [t] = pairs.remainder() {
        h = mix(h ^ u64::from(*t) ^ (1 << 63));
    }
    h
}

fn bytes_digest(seed: u64, bytes: &[u8]) -> u64 {
    let mut h = mix(seed ^ bytes.len() as u64);
    for c in bytes.chunks(8) {
        let mut buf = [0u8; 8];
        buf[..c.len()].copy_from_slice(c);
        h = mix(h ^ u64::from_le_bytes(buf));
    }
    h
}

/// Root of a chain: the base model's, or a LoRA adapter's (by name, else by id).
fn chain_root(lora_name: Option<&str>, lora_id: Option<i64>) -> u64 {
    match (lora_name, lora_id) {
        (Some(name), _) => bytes_digest(ROOT_SEED ^ LORA_NAME_TAG, name.as_bytes()),
        (None, Some(id)) => mix(ROOT_SEED ^ LORA_ID_TAG ^ id as u64),
        (None, None) => ROOT_SEED,
    }
}

/// Digest of a block's extra keys when they hold more than the LoRA name.
fn taint(extra: &[ExtraKey], lora_name: Option<&str>) -> Option<u64> {
    let plain = extra
        .iter()
        .all(|k| matches!(k, ExtraKey::Str(s) if Some(s.as_str()) == lora_name));
    if plain {
        return None;
    }
    let mut h = TAINT_TAG;
    for k in extra {
        h = match k {
            ExtraKey::Str(s) => bytes_digest(h ^ 1, s.as_bytes()),
            ExtraKey::Int(i) => mix(h ^ 2 ^ mix(*i as u64)),
            ExtraKey::Bytes(b) => bytes_digest(h ^ 3, b),
            ExtraKey::Other => mix(h ^ 4),
        };
    }
    Some(h)
}

fn tier_bit(medium: Option<&Medium>) -> u8 {
    match medium {
        None | Some(Medium::Gpu) => TIER_GPU,
        Some(Medium::Cpu) => TIER_CPU,
        Some(Medium::Storage) => TIER_STORAGE,
        Some(Medium::Other(_)) => TIER_OTHER,
    }
}

/// A request's blocks as own hashes: compute once, probe every target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixChain {
    block_size: u32,
    hashes: Vec<u64>,
}

impl PrefixChain {
    /// Chain the full blocks of `token_ids` (a trailing partial block is ignored).
    /// `lora` is the adapter name the request runs under, `None` for the base model.
    pub fn new(token_ids: &[u32], block_size: u32, lora: Option<&str>) -> Self {
        let mut hashes = Vec::new();
        if block_size > 0 {
            hashes.reserve(token_ids.len() / block_size as usize);
            let mut parent = chain_root(lora, None);
            for chunk in token_ids.chunks_exact(block_size as usize) {
                parent = chain_hash(parent, chunk);
                hashes.push(parent);
            }
        }
        PrefixChain { block_size, hashes }
    }

    /// Tokens per block the chain was cut with.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Number of full blocks.
    pub fn len(&self) -> usize {
        self.hashes.len()
    }

    /// True when the request has no full block.
    pub fn is_empty(&self) -> bool {
        self.hashes.is_empty()
    }

    /// The own hash of each full block, in order.
    pub fn hashes(&self) -> &[u64] {
        &self.hashes
    }
}

/// How much of a request's prefix a target holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BlockMatch {
    /// Leading blocks resident in GPU memory.
    pub gpu_blocks: usize,
    /// Leading blocks resident in any tier (GPU or offloaded); ≥ `gpu_blocks`.
    pub any_tier_blocks: usize,
    /// Full blocks in the request (0 when the block sizes differ or none is known).
    pub total_blocks: usize,
}

impl BlockMatch {
    /// Fraction of the request's full blocks resident on GPU (0 when there are none).
    pub fn gpu_score(&self) -> f64 {
        if self.total_blocks == 0 {
            0.0
        } else {
            self.gpu_blocks as f64 / self.total_blocks as f64
        }
    }
}

/// Tiers an entry is resident in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Tiers(u8);

impl Tiers {
    /// Resident in GPU memory.
    pub fn gpu(self) -> bool {
        self.0 & TIER_GPU != 0
    }
    /// Resident in some tier.
    pub fn any(self) -> bool {
        self.0 != 0
    }
    /// Resident in the tier of `medium`.
    pub fn contains(self, medium: &Medium) -> bool {
        self.0 & tier_bit(Some(medium)) != 0
    }
}

/// What one [`ResidencyIndex::apply`] call did (added to the subscriber's counters).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ApplyStats {
    /// Blocks stored (including idempotent re-stores and tier-only stores).
    pub blocks_stored: u64,
    /// Blocks whose tier was removed.
    pub blocks_removed: u64,
    /// Removals of blocks (or tiers) the index did not hold.
    pub unknown_removals: u64,
    /// `AllBlocksCleared` events applied.
    pub clears: u64,
    /// Stores skipped because their parent hash is unknown.
    pub orphan_stores: u64,
    /// Stores skipped because token count ≠ block_size × hashes.
    pub misaligned_stores: u64,
    /// Stores skipped because their block size differs from the learned one.
    pub foreign_block_size_stores: u64,
    /// Entries evicted to stay under the cap.
    pub evictions: u64,
}

/// Hasher for keys that are (or contain) 64-bit hashes: one splitmix round per word.
#[derive(Default)]
struct MixHasher(u64);

impl Hasher for MixHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        self.0 = bytes_digest(self.0, bytes);
    }
    fn write_u32(&mut self, v: u32) {
        self.0 = mix(self.0 ^ u64::from(v) ^ (1 << 40));
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = mix(self.0 ^ v);
    }
}

type MixBuild = BuildHasherDefault<MixHasher>;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct EngineKey {
    group: u32,
    hash: u64,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    own: u64,
    tiers: u8,
    /// Stamp of this entry's one live queue item.
    stamp: u64,
}

/// How many entries with a given own hash are resident, per kind of residency.
#[derive(Debug, Clone, Copy, Default)]
struct OwnRefs {
    gpu: u32,
    any: u32,
}

#[derive(Default)]
struct Inner {
    block_size: Option<u32>,
    entries: HashMap<EngineKey, Entry, MixBuild>,
    own: HashMap<u64, OwnRefs, MixBuild>,
    /// Resident entries, least recently stored first.
    resident_q: VecDeque<(EngineKey, u64)>,
    /// Remembered (removed) entries, oldest removal first.
    removed_q: VecDeque<(EngineKey, u64)>,
    next_stamp: u64,
    gpu_entries: usize,
    /// Own hashes that went from resident to not resident → the stamp of that removal,
    /// bounded by [`MAX_GONE`] (oldest first): what the replica said it no longer holds,
    /// for [`ResidencyIndex::with_evictions`].
    gone: HashMap<u64, u64, MixBuild>,
    gone_q: VecDeque<(u64, u64)>,
    /// Most entries resident on GPU at once since this count started.
    gpu_high_water: usize,
    /// A known GPU-resident block was removed since this count started: the replica's cache
    /// has been full.
    gpu_evicted: bool,
    /// This count started after a gap: it misses blocks the replica held before, so it may
    /// only raise the size learned before it.
    undercounts: bool,
}

/// Most evicted own hashes remembered for [`ResidencyIndex::with_evictions`]: the pending
/// overlay it guards lives a few seconds, far less than it takes to evict this many.
const MAX_GONE: usize = 1 << 16;

impl Inner {
    fn clear_blocks(&mut self) {
        let block_size = self.block_size;
        *self = Inner {
            block_size,
            ..Inner::default()
        };
    }

    /// The replica's cache size in tokens this count has shown, if it has seen an eviction.
    fn counted_capacity(&self) -> Option<usize> {
        let bs = self.block_size? as usize;
        self.gpu_evicted
            .then(|| self.gpu_high_water.saturating_mul(bs))
    }

    fn stamp(&mut self) -> u64 {
        self.next_stamp += 1;
        self.next_stamp
    }

    /// Account for an own hash's entry going from tier set `was` to `now`.
    fn retier(&mut self, own: u64, was: u8, now: u8) {
        let gpu_delta = i64::from(now & TIER_GPU != 0) - i64::from(was & TIER_GPU != 0);
        let any_delta = i64::from(now != 0) - i64::from(was != 0);
        if gpu_delta == 0 && any_delta == 0 {
            return;
        }
        self.gpu_entries = (self.gpu_entries as i64 + gpu_delta) as usize;
        let refs = self.own.entry(own).or_default();
        refs.gpu = (i64::from(refs.gpu) + gpu_delta) as u32;
        refs.any = (i64::from(refs.any) + any_delta) as u32;
        if refs.any == 0 {
            self.own.remove(&own);
            let stamp = self.stamp();
            self.gone.insert(own, stamp);
            self.gone_q.push_back((own, stamp));
            while self.gone_q.len() > MAX_GONE {
                if let Some((old, at)) = self.gone_q.pop_front() {
                    if self.gone.get(&old) == Some(&at) {
                        self.gone.remove(&old);
                    }
                }
            }
        }
    }

    fn upsert(
        &mut self,
        key: EngineKey,
        own: u64,
        tier: u8,
        max_entries: usize,
        stats: &mut ApplyStats,
    ) {
        let stamp = self.stamp();
        let (old_own, was) = match self.entries.get(&key) {
            Some(e) => (Some(e.own), e.tiers),
            None => (None, 0),
        };
        match old_own {
            // The hash now chains from different content (a restart we missed, or a
            // collision): the engine still holds a block under this hash in the same
            // tiers, so move its residency to the newly learned own hash.
            Some(o) if o != own => {
                self.retier(o, was, 0);
                self.retier(own, 0, was | tier);
                self.entries.insert(
                    key,
                    Entry {
                        own,
                        tiers: was | tier,
                        stamp,
                    },
                );
            }
            _ => {
                self.retier(own, was, was | tier);
                self.entries.insert(
                    key,
                    Entry {
                        own,
                        tiers: was | tier,
                        stamp,
                    },
                );
            }
        }
        self.resident_q.push_back((key, stamp));
        stats.blocks_stored += 1;
        if old_own.is_none() {
            self.enforce_cap(max_entries, stats);
        }
        self.gpu_high_water = self.gpu_high_water.max(self.gpu_entries);
        self.maybe_compact();
    }

    fn add_tier(&mut self, key: EngineKey, tier: u8, stats: &mut ApplyStats) -> bool {
        let Some(e) = self.entries.get(&key).copied() else {
            return false;
        };
        let stamp = self.stamp();
        self.retier(e.own, e.tiers, e.tiers | tier);
        self.entries.insert(
            key,
            Entry {
                tiers: e.tiers | tier,
                stamp,
                ..e
            },
        );
        self.resident_q.push_back((key, stamp));
        stats.blocks_stored += 1;
        self.gpu_high_water = self.gpu_high_water.max(self.gpu_entries);
        self.maybe_compact();
        true
    }

    fn remove(&mut self, key: EngineKey, tier: u8, stats: &mut ApplyStats) {
        let Some(e) = self.entries.get(&key).copied() else {
            stats.unknown_removals += 1;
            return;
        };
        if e.tiers & tier == 0 {
            stats.unknown_removals += 1;
            return;
        }
        let now = e.tiers & !tier;
        self.gpu_evicted |= tier & TIER_GPU != 0;
        self.retier(e.own, e.tiers, now);
        let stamp = if now == 0 {
            // Remember the mapping for parent lookups; evictable first.
            let s = self.stamp();
            self.removed_q.push_back((key, s));
            s
        } else {
            e.stamp
        };
        self.entries.insert(
            key,
            Entry {
                tiers: now,
                stamp,
                ..e
            },
        );
        stats.blocks_removed += 1;
        self.maybe_compact();
    }

    fn enforce_cap(&mut self, max_entries: usize, stats: &mut ApplyStats) {
        while self.entries.len() > max_entries {
            let victim = Self::pop_live(&mut self.removed_q, &self.entries)
                .or_else(|| Self::pop_live(&mut self.resident_q, &self.entries));
            let Some(key) = victim else { break };
            if let Some(e) = self.entries.remove(&key) {
                self.retier(e.own, e.tiers, 0);
                stats.evictions += 1;
            }
        }
    }

    fn pop_live(
        q: &mut VecDeque<(EngineKey, u64)>,
        entries: &HashMap<EngineKey, Entry, MixBuild>,
    ) -> Option<EngineKey> {
        while let Some((key, stamp)) = q.pop_front() {
            if entries.get(&key).is_some_and(|e| e.stamp == stamp) {
                return Some(key);
            }
        }
        None
    }

    fn maybe_compact(&mut self) {
        let limit = QUEUE_SLACK * self.entries.len() + 64;
        if self.resident_q.len() + self.removed_q.len() <= limit {
            return;
        }
        let entries = &self.entries;
        let live =
            |(key, stamp): &(EngineKey, u64)| entries.get(key).is_some_and(|e| e.stamp == *stamp);
        self.resident_q.retain(live);
        self.removed_q.retain(live);
    }

    fn store(&mut self, ev: &BlockStored, max_entries: usize, stats: &mut ApplyStats) {
        let group = ev.group_idx.unwrap_or(0);
        let tier = tier_bit(ev.medium.as_ref());
        if ev.token_ids.is_empty() {
            // Tier-only announcement (offloading connector): no tokens to chain.
            for h in &ev.block_hashes {
                if !self.add_tier(EngineKey { group, hash: h.0 }, tier, stats) {
                    stats.orphan_stores += 1;
                }
            }
            return;
        }
        let bs = ev.block_size;
        match self.block_size {
            Some(known) if known != bs => {
                stats.foreign_block_size_stores += 1;
                return;
            }
            _ => {}
        }
        if bs == 0 || ev.token_ids.len() as u64 != ev.block_hashes.len() as u64 * u64::from(bs) {
            stats.misaligned_stores += 1;
            return;
        }
        let mut parent = match ev.parent_block_hash {
            None => chain_root(ev.lora_name.as_deref(), ev.lora_id),
            Some(p) => match self.entries.get(&EngineKey { group, hash: p.0 }) {
                Some(e) => e.own,
                None => {
                    stats.orphan_stores += 1;
                    return;
                }
            },
        };
        self.block_size = Some(bs);
        let extras = ev.extra_keys.as_deref().unwrap_or(&[]);
        for (i, (h, chunk)) in ev
            .block_hashes
            .iter()
            .zip(ev.token_ids.chunks_exact(bs as usize))
            .enumerate()
        {
            let mut own = chain_hash(parent, chunk);
            if let Some(Some(extra)) = extras.get(i) {
                if let Some(t) = taint(extra, ev.lora_name.as_deref()) {
                    own = mix(own ^ t);
                }
            }
            self.upsert(
                EngineKey { group, hash: h.0 },
                own,
                tier,
                max_entries,
                stats,
            );
            parent = own;
        }
    }

    fn remove_event(&mut self, ev: &BlockRemoved, stats: &mut ApplyStats) {
        let group = ev.group_idx.unwrap_or(0);
        let tier = tier_bit(ev.medium.as_ref());
        for h in &ev.block_hashes {
            self.remove(EngineKey { group, hash: h.0 }, tier, stats);
        }
    }
}

/// One target's block residency (see the module header).
pub struct ResidencyIndex {
    inner: RwLock<Inner>,
    /// The cap; changed only under the write lock ([`set_max_entries`](Self::set_max_entries)).
    max_entries: AtomicUsize,
    /// Learned block size for lock-free reads (0 = none yet).
    block_size: AtomicU32,
    /// `Inner::gpu_entries` for lock-free reads, stored under the write lock.
    gpu_blocks: AtomicUsize,
    /// The learned cache size in tokens (0 = not yet; see the module header).
    capacity_tokens: AtomicUsize,
}

impl Default for ResidencyIndex {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_ENTRIES)
    }
}

impl ResidencyIndex {
    /// An empty index holding at most `max_entries` entries (at least 1).
    pub fn new(max_entries: usize) -> Self {
        ResidencyIndex {
            inner: RwLock::new(Inner::default()),
            max_entries: AtomicUsize::new(max_entries.max(1)),
            block_size: AtomicU32::new(0),
            gpu_blocks: AtomicUsize::new(0),
            capacity_tokens: AtomicUsize::new(0),
        }
    }

    /// Change the cap (at least 1; a config reload), evicting down to it at once the
    /// same way a store past the cap does. Returns the entries evicted.
    pub fn set_max_entries(&self, max_entries: usize) -> u64 {
        let max_entries = max_entries.max(1);
        let mut inner = self.inner.write();
        self.max_entries.store(max_entries, Ordering::Relaxed);
        let mut stats = ApplyStats::default();
        inner.enforce_cap(max_entries, &mut stats);
        inner.maybe_compact();
        self.gpu_blocks.store(inner.gpu_entries, Ordering::Relaxed);
        stats.evictions
    }

    /// Apply a batch's events in order under one write lock.
    pub fn apply(&self, events: &[KvEvent]) -> ApplyStats {
        let mut stats = ApplyStats::default();
        let mut inner = self.inner.write();
        let max_entries = self.max_entries.load(Ordering::Relaxed);
        for ev in events {
            match ev {
                KvEvent::BlockStored(s) => inner.store(s, max_entries, &mut stats),
                KvEvent::BlockRemoved(r) => inner.remove_event(r, &mut stats),
                KvEvent::AllBlocksCleared => {
                    self.publish_capacity(&inner);
                    inner.clear_blocks();
                    stats.clears += 1;
                }
            }
        }
        self.block_size
            .store(inner.block_size.unwrap_or(0), Ordering::Relaxed);
        self.gpu_blocks.store(inner.gpu_entries, Ordering::Relaxed);
        self.publish_capacity(&inner);
        stats
    }

    /// Publish the size `inner`'s count has shown, if any (see the module header).
    fn publish_capacity(&self, inner: &Inner) {
        let Some(tokens) = inner.counted_capacity() else {
            return;
        };
        if inner.undercounts {
            self.capacity_tokens.fetch_max(tokens, Ordering::Relaxed);
        } else {
            self.capacity_tokens.store(tokens, Ordering::Relaxed);
        }
    }

    /// Forget every block and the block size (the stream missed events and is rebuilt
    /// from new ones). The learned cache size stays, and the next count may only raise
    /// it: the replica still holds blocks announced before the gap.
    pub fn clear(&self) {
        self.reset(true);
    }

    /// [`Self::clear`] for a replica that restarted (or another one behind the endpoint):
    /// its cache starts empty, so the next count sees every block and replaces the size,
    /// which may have changed.
    pub fn restart(&self) {
        self.reset(false);
    }

    /// Empty the index; the next count of the cache size `undercounts` or not. The size
    /// already learned stays published (every `apply` published its count's).
    fn reset(&self, undercounts: bool) {
        let mut inner = self.inner.write();
        *inner = Inner {
            undercounts,
            ..Inner::default()
        };
        self.block_size.store(0, Ordering::Relaxed);
        self.gpu_blocks.store(0, Ordering::Relaxed);
    }

    /// Block size learned from the events, if any store carried tokens yet.
    pub fn block_size(&self) -> Option<u32> {
        match self.block_size.load(Ordering::Relaxed) {
            0 => None,
            n => Some(n),
        }
    }

    /// Leading blocks of `chain` this target holds. Zero if the chain was cut with a
    /// block size other than the learned one.
    pub fn match_chain(&self, chain: &PrefixChain) -> BlockMatch {
        if self.block_size() != Some(chain.block_size) {
            return BlockMatch::default();
        }
        let inner = self.inner.read();
        let mut m = BlockMatch {
            total_blocks: chain.len(),
            ..BlockMatch::default()
        };
        let mut gpu_run = true;
        for h in &chain.hashes {
            match inner.own.get(h) {
                Some(refs) if refs.any > 0 => {
                    m.any_tier_blocks += 1;
                    if gpu_run && refs.gpu > 0 {
                        m.gpu_blocks += 1;
                    } else {
                        gpu_run = false;
                    }
                }
                _ => break,
            }
        }
        m
    }

    /// The index's logical clock: it advances with every store and removal. A caller that
    /// notes something at stamp `t` can later ask whether a block was evicted after it.
    pub fn stamp(&self) -> u64 {
        self.inner.read().next_stamp
    }

    /// Run `f` with a lookup of when an own hash was last evicted (its stamp, if still
    /// remembered), under one read lock. `prefix::pending` uses it so that a block the
    /// gateway routed does not count as held once the replica has said it evicted it.
    pub fn with_evictions<R>(&self, f: impl FnOnce(&dyn Fn(u64) -> Option<u64>) -> R) -> R {
        let inner = self.inner.read();
        f(&|h| inner.gone.get(&h).copied())
    }

    /// [`Self::match_chain`] with the learned block size; `lora` as in [`PrefixChain::new`].
    pub fn match_prefix(&self, token_ids: &[u32], lora: Option<&str>) -> BlockMatch {
        match self.block_size() {
            Some(bs) => self.match_chain(&PrefixChain::new(token_ids, bs, lora)),
            None => BlockMatch::default(),
        }
    }

    /// Number of leading full blocks of `token_ids` (base model) resident on GPU, cut
    /// at `block_size`; 0 when that is not the block size the events use.
    pub fn match_blocks(&self, token_ids: &[u32], block_size: usize) -> usize {
        match u32::try_from(block_size) {
            Ok(bs) => {
                self.match_chain(&PrefixChain::new(token_ids, bs, None))
                    .gpu_blocks
            }
            Err(_) => 0,
        }
    }

    /// Blocks resident on GPU (entries with the GPU tier), without taking the lock.
    pub fn block_count(&self) -> usize {
        self.gpu_blocks.load(Ordering::Relaxed)
    }

    /// The replica's GPU cache size in tokens as its events show it: the most blocks
    /// resident at once, once it has evicted one (see the module header). `None` until then.
    pub fn capacity_tokens(&self) -> Option<usize> {
        match self.capacity_tokens.load(Ordering::Relaxed) {
            0 => None,
            n => Some(n),
        }
    }

    /// Entries held, resident or remembered for parent lookups (≤ the cap).
    pub fn entry_count(&self) -> usize {
        self.inner.read().entries.len()
    }

    /// The cap on entries.
    pub fn max_entries(&self) -> usize {
        self.max_entries.load(Ordering::Relaxed)
    }

    /// Tiers the block `(group, hash)` is resident in.
    pub fn tiers(&self, group: u32, hash: BlockHash) -> Tiers {
        let inner = self.inner.read();
        Tiers(
            inner
                .entries
                .get(&EngineKey {
                    group,
                    hash: hash.0,
                })
                .map_or(0, |e| e.tiers),
        )
    }

    /// Engine hashes of every GPU-resident block (any group), sorted: for comparing
    /// the index with a replica's real cache in end-to-end tests.
    pub fn gpu_block_hashes(&self) -> Vec<BlockHash> {
        let inner = self.inner.read();
        let mut v: Vec<BlockHash> = inner
            .entries
            .iter()
            .filter(|(_, e)| e.tiers & TIER_GPU != 0)
            .map(|(k, _)| BlockHash(k.hash))
            .collect();
        v.sort_unstable();
        v
    }

    #[cfg(test)]
    fn check_invariants(&self) {
        let inner = self.inner.read();
        assert!(inner.entries.len() <= self.max_entries(), "cap exceeded");
        let mut refs: HashMap<u64, (u32, u32)> = HashMap::new();
        let mut gpu = 0;
        for e in inner.entries.values() {
            if e.tiers != 0 {
                let r = refs.entry(e.own).or_default();
                r.1 += 1;
                if e.tiers & TIER_GPU != 0 {
                    r.0 += 1;
                    gpu += 1;
                }
            }
        }
        assert_eq!(gpu, inner.gpu_entries, "gpu entry count");
        assert_eq!(self.block_count(), gpu, "lock-free gpu block count");
        assert_eq!(refs.len(), inner.own.len(), "own map size");
        for (own, (g, a)) in refs {
            let r = inner.own[&own];
            assert_eq!((r.gpu, r.any), (g, a), "own refs");
        }
        let limit = QUEUE_SLACK * inner.entries.len() + 64 + 1;
        assert!(
            inner.resident_q.len() + inner.removed_q.len() <= limit,
            "queues bounded"
        );
    }
}

#[cfg(test)]
mod tests;
