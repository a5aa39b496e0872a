//! Per-target prefix trie: which prompt prefixes a target has served (SPEC §4 cache_aware).
//! It stores byte strings; the routing strategies store prompt keys (`prefix::key`).
//!
//! Owns the data structure behind the cache-aware score: `match_len` (longest common prefix of
//! a string with any stored string), `insert`, the node and byte ceilings with
//! least-recently-*inserted* eviction, and the counters the router and metrics read. Must
//! not do I/O, know about targets, routes, pingora or tokio, or spawn threads. One
//! `PrefixTrie` per target; tries share nothing, so no lock spans targets.
//!
//! This file is the public face: `PrefixTrie`, `MatchHint`, the constructor, the operations
//! and the getters. The machinery sits in submodules, one job each:
//! - `node`: the slot layout (label, reader metadata, writer bookkeeping) and the per-slot
//!   seqlock;
//! - `arena`: where slots live (segments, directory) and the per-thread free stacks;
//! - `walk`: the lock-free read walk that `match_len` and inserts start from;
//! - `writer`: the writer lock, its critical section (`Ctx`), chain prebuild, link and split;
//! - `children`: a node's child list (two inline, then overflow blocks);
//! - `evict`: the LRU lists, the victim choice, eviction and re-compression, cache warming;
//! - `check` (tests only): the structural invariant checker; `tests`: unit, model and
//!   concurrency tests.
//!
//! # Shape
//! A path-compressed byte trie whose edge labels are additionally cut at every multiple of
//! `LABEL_BYTES` (64) along a path, so every node fits one fixed 96-byte slot: a 64-byte label
//! (one cache line), 16 bytes the matchers read (seqlock version, label length, child count,
//! first two child keys, two child ids) and 16 bytes only writers use (parent, LRU links, end
//! depth + end-of-prompt mark), plus a 4-byte insertion stamp in a side array (writers only;
//! see Eviction). A node with more than two children keeps them in overflow
//! blocks of 12 that take slots too. Nodes exist exactly at chunk boundaries, prompt ends and
//! branch points, so the shape is a function of the stored set (the proptests check node
//! count, byte count, LRU order and every `match_len` against a naive model).
//!
//! "Node" in `max_nodes` / `node_count` means such a slot, so the cap bounds memory whatever the
//! prompts look like: at most 100 B x (cap + the chains being inserted) + a directory of 8 B
//! per 1024 slots. At the 1M default that is 95.4 MiB (filled with chat prompts: 100.1 B per
//! node, 1.71 B per stored prompt byte: 58.5 stored bytes per node).
//!
//! # Eviction
//! Every stored prompt is an LRU entry on its end node; inserting it again moves it to the
//! back. An insert links its prompt first, then, while `node_count > max_nodes` or
//! `byte_count > max_bytes`, drops the oldest prompt: its end mark is cleared, the run of
//! nodes only it used (up to the first ancestor that is the root, another prompt's end, or a
//! branch point) is unlinked and freed,
//! and a branch point left with one child is merged into it. Nodes on another live prompt's path
//! are never freed, and the new prompt's own path is never a victim. A prompt longer than
//! `max_nodes x 64` bytes or `max_bytes` is **truncated** to that length (its prefix is what
//! routing scores), so alone it fits exactly; empty prompts are ignored. `set_max_nodes` and
//! `set_max_bytes` prune immediately. The node cap bounds memory; the byte cap, unbounded by
//! default, is what mirrors a replica's KV cache (the bytes stored are the distinct prompt
//! prefixes, which is what a prefix cache holds, whatever the trie's shape).
//! The LRU is one list per thread stripe; the order across them is in `evict`.
//!
//! # Concurrency
//! - **Matchers take no lock and write nothing shared**: optimistic lock coupling (Leis et al.,
//!   "The ART of Practical Synchronization", 2016) over per-slot seqlock versions (`walk`);
//!   after `OPTIMISTIC_ATTEMPTS` failed walks a reader walks under the writer lock.
//! - **Writers serialise on one per-trie mutex and keep it short**: the new suffix is built and
//!   the next victims are touched before locking; the rules every locked step follows are in
//!   `writer`. Counters are published to atomics on the lock's cache line; getters never lock.
//! - Free slots sit on per-thread-stripe stacks (`arena`), so allocation and freeing in steady
//!   state touch no line another thread writes.
//!
//! Measurements, the alternatives tried and rejected, and why this design: `docs/trie.md`.

mod arena;
mod children;
mod evict;
mod node;
mod walk;
mod writer;

#[cfg(test)]
mod check;
#[cfg(test)]
mod tests;

use arena::{Arena, Dir, Padded, FREE_STRIPES};
use evict::{LruEnds, LRU_LISTS};
use node::{NIL, ROOT};
use parking_lot::Mutex;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, AtomicUsize};
use walk::Walk;
use writer::{Stats, WriterLine};

/// Default node ceiling per trie (SPEC §2 `trie_max_nodes`, SPEC §4).
pub const DEFAULT_MAX_NODES: usize = 1_000_000;

/// Largest accepted node ceiling: slot ids are `u32` with `u32::MAX` reserved, and 2^30 slots
/// (~100 GB) is far beyond any sane per-target budget.
pub const MAX_NODES_LIMIT: usize = 1 << 30;

/// Most edge-label bytes one node holds: one 64-byte cache line, so a node slot is 96 bytes and
/// the 1M-node default stays under the 100 MiB per-target budget of issue 4.
pub const LABEL_BYTES: usize = 64;

/// Lock-free read attempts before a reader gives up and reads under the writer lock (guarantees
/// progress under a write storm; in practice the first attempt succeeds).
const OPTIMISTIC_ATTEMPTS: usize = 4;

/// Where a `match_hinted` walk stopped (see `PrefixTrie::insert_hinted`). Tied to the trie
/// (by a process-unique id, so a hint outliving its trie never matches another one) and to
/// the prompt slice it was computed for (by address and length: the caller must not change
/// those bytes in between); opaque to callers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MatchHint {
    trie: u64,
    prompt: (usize, usize),
    walk: Walk,
}

impl MatchHint {
    fn new(trie: &PrefixTrie, prompt: &[u8], walk: Walk) -> Self {
        MatchHint {
            trie: trie.id,
            prompt: (prompt.as_ptr() as usize, prompt.len()),
            walk,
        }
    }

    fn is_for(&self, trie: &PrefixTrie, prompt: &[u8]) -> bool {
        self.trie == trie.id && self.prompt == (prompt.as_ptr() as usize, prompt.len())
    }
}

/// Node- and byte-capped, LRU-by-insertion radix trie of byte strings; `Send + Sync`,
/// lock-free reads.
pub struct PrefixTrie {
    // Read-mostly, loaded by every walk: kept off the cache lines the writer dirties.
    dir: AtomicPtr<Dir>,
    /// Chunk size for labels (`LABEL_BYTES` except in tests).
    k: usize,
    max_nodes: AtomicUsize,
    max_bytes: AtomicUsize,
    /// Process-unique, for `MatchHint`.
    id: u64,
    /// The writer lock and the state it guards, on one cache line: each write moves just that
    /// line between cores. Getters read the state lock-free.
    writer: Padded<WriterLine>,
    /// Free-slot stacks (top of each, linked through `WSlot::next`), one per thread stripe,
    /// each behind its own lock on its own lines: a thread allocates from the stack it frees
    /// to, so in steady state it locks a line no other thread touches, and the slots it reuses
    /// are the ones whose lines it last wrote. Lock order: writer, then one stack at a time,
    /// then the arena.
    free: [Padded<Mutex<u32>>; FREE_STRIPES],
    /// Ends of the LRU lists (guarded by the writer lock), one per thread stripe on its own
    /// lines: a thread appends what it inserts to its own list and usually evicts from it, so
    /// the tail link it writes and the head it pops are lines it wrote itself.
    lru: [Padded<LruEnds>; LRU_LISTS],
    arena: Padded<Mutex<Arena>>,
    /// Heap bytes held (changes only when the arena grows).
    mem: AtomicUsize,
}

// SAFETY: all shared state is atomics or behind the mutexes; the raw `Dir`/`Segment` pointers
// are owned by the trie, replaced only under the arena lock and freed only in `Drop`.
unsafe impl Send for PrefixTrie {}
// SAFETY: as above; readers only load atomics through `&self`.
unsafe impl Sync for PrefixTrie {}

impl Default for PrefixTrie {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_NODES)
    }
}

impl std::fmt::Debug for PrefixTrie {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixTrie")
            .field("max_nodes", &self.max_nodes())
            .field("nodes", &self.node_count())
            .field("bytes", &self.byte_count())
            .field("prompts", &self.prompt_count())
            .field("evictions", &self.evictions())
            .finish()
    }
}

impl PrefixTrie {
    /// An empty trie holding at most `max_nodes` node slots.
    pub fn new(max_nodes: usize) -> Self {
        Self::with_label_bytes(max_nodes, LABEL_BYTES)
    }

    /// An empty trie whose labels are chunked at `k` bytes (tests use tiny `k`).
    fn with_label_bytes(max_nodes: usize, k: usize) -> Self {
        assert!((1..=LABEL_BYTES).contains(&k), "label chunk must be 1..=64");
        let dir = Box::into_raw(Dir::with_len(1));
        let t = PrefixTrie {
            dir: AtomicPtr::new(dir),
            writer: Padded(WriterLine {
                lock: std::sync::Mutex::new(()),
                stats: Stats {
                    nodes: AtomicUsize::new(0),
                    bytes: AtomicUsize::new(0),
                    prompts: AtomicUsize::new(0),
                    evictions: AtomicU64::new(0),
                    stamp: AtomicU32::new(0),
                    nonempty: AtomicU32::new(0),
                    head_stamp: std::array::from_fn(|_| AtomicU32::new(0)),
                },
            }),
            free: std::array::from_fn(|_| Padded(Mutex::new(NIL))),
            lru: std::array::from_fn(|_| {
                Padded(LruEnds {
                    head: AtomicU32::new(NIL),
                    tail: AtomicU32::new(NIL),
                })
            }),
            arena: Padded(Mutex::new(Arena {
                high: 0,
                segments: 0,
                dir_len: 1,
                retired: Vec::new(),
                retired_bytes: 0,
            })),
            k,
            max_nodes: AtomicUsize::new(max_nodes.min(MAX_NODES_LIMIT)),
            max_bytes: AtomicUsize::new(usize::MAX),
            id: {
                static NEXT_ID: AtomicU64 = AtomicU64::new(0);
                NEXT_ID.fetch_add(1, Relaxed)
            },
            mem: AtomicUsize::new(0),
        };
        let root = t.take_slots(1);
        debug_assert_eq!(root, ROOT);
        let w = t.wslot(ROOT);
        w.parent.store(NIL, Relaxed);
        w.next.store(NIL, Relaxed);
        t
    }

    /// Length of the longest common prefix of `prompt` with any stored prompt.
    pub fn match_len(&self, prompt: &[u8]) -> usize {
        self.match_hinted(prompt).0
    }

    /// `match_len`, plus where the walk stopped, so that inserting the same prompt into this
    /// trie later (`insert_hinted`, e.g. after the request was answered) can skip its own walk
    /// when nothing on that spot changed meanwhile.
    pub fn match_hinted(&self, prompt: &[u8]) -> (usize, Option<MatchHint>) {
        if prompt.is_empty() {
            return (0, None);
        }
        for _ in 0..OPTIMISTIC_ATTEMPTS {
            if let Some(w) = self.walk(prompt) {
                return (w.pos, Some(MatchHint::new(self, prompt, w)));
            }
        }
        let _g = self.lock_writer();
        self.walk(prompt).map_or((0, None), |w| (w.pos, None))
    }

    /// Store `prompt` (or refresh it if stored), then prune least-recently-inserted prompts
    /// until the node and byte counts are within their caps.
    pub fn insert(&self, prompt: &[u8]) {
        self.insert_hinted(prompt, None)
    }

    /// `insert`, starting from `hint` (from `match_hinted` on this trie with this very
    /// slice) instead of walking again. A hint for another trie or another slice is ignored;
    /// a stale one costs nothing but the walk it was meant to save, because the writer
    /// re-walks whenever the node the walk stopped at changed version since.
    pub fn insert_hinted(&self, prompt: &[u8], hint: Option<MatchHint>) {
        let cap = self.max_nodes();
        let full = prompt;
        let fits = cap.saturating_mul(self.k).min(self.max_bytes());
        let prompt = &prompt[..prompt.len().min(fits)];
        let mut seen = hint
            .filter(|h| prompt.len() == full.len() && h.is_for(self, full))
            .map(|h| h.walk);
        if !prompt.is_empty() && seen.is_none() {
            for _ in 0..OPTIMISTIC_ATTEMPTS {
                seen = self.walk(prompt);
                if seen.is_some() {
                    break;
                }
            }
        }
        // Build the new suffix before taking the writer lock: it is private until linked.
        let chain = seen
            .filter(|w| w.pos < prompt.len())
            .map(|w| self.prebuild(&prompt[w.pos..], w.pos));
        if let (Some(c), Some(w)) = (&chain, seen) {
            self.warm(c.nodes, prompt.len() - w.pos);
        }
        self.with_writer(|cx| {
            if !prompt.is_empty() {
                let walk = match seen {
                    Some(w) if cx.meta(w.node).ver.load(Relaxed) == w.ver => w,
                    _ => {
                        cx.t.walk(prompt)
                            .expect("no concurrent writer under the lock")
                    }
                };
                cx.apply(prompt, walk, chain);
            }
            cx.evict_to(cx.t.max_nodes(), cx.t.max_bytes());
        });
    }

    /// Node slots in use: trie nodes plus overflow child blocks of nodes with > 2 children.
    pub fn node_count(&self) -> usize {
        self.writer.stats.nodes.load(Relaxed)
    }

    /// Bytes of edge labels stored (= distinct non-empty prefixes of the stored prompts).
    pub fn byte_count(&self) -> usize {
        self.writer.stats.bytes.load(Relaxed)
    }

    /// Distinct prompts stored.
    pub fn prompt_count(&self) -> usize {
        self.writer.stats.prompts.load(Relaxed)
    }

    /// Prompts pruned by the node or byte cap since creation.
    pub fn evictions(&self) -> u64 {
        self.writer.stats.evictions.load(Relaxed)
    }

    /// Current node ceiling.
    pub fn max_nodes(&self) -> usize {
        self.max_nodes.load(Relaxed)
    }

    /// Change the node ceiling (clamped to `MAX_NODES_LIMIT`); shrinking prunes immediately.
    pub fn set_max_nodes(&self, n: usize) {
        let n = n.min(MAX_NODES_LIMIT);
        self.max_nodes.store(n, Relaxed);
        self.with_writer(|cx| cx.evict_to(n, cx.t.max_bytes()));
    }

    /// Current byte ceiling (`usize::MAX`: none).
    pub fn max_bytes(&self) -> usize {
        self.max_bytes.load(Relaxed)
    }

    /// Change the byte ceiling (at least 1); shrinking prunes immediately.
    pub fn set_max_bytes(&self, n: usize) {
        let n = n.max(1);
        self.max_bytes.store(n, Relaxed);
        self.with_writer(|cx| cx.evict_to(cx.t.max_nodes(), n));
    }

    /// Heap bytes held by the trie (segments, directories, writer bookkeeping).
    pub fn memory_bytes(&self) -> usize {
        self.mem.load(Relaxed)
    }
}
