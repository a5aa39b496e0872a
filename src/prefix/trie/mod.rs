//! Per-target prefix trie: which prompt prefixes a target has served (SPEC §4 cache_aware).
//!
//! Owns the data structure behind the cache-aware score: `match_len` (longest common prefix of
//! a prompt with any stored prompt), `insert`, the node ceiling with least-recently-*inserted*
//! eviction, and the counters the router and metrics read. Must not do I/O, know about
//! targets, routes, pingora or tokio, or spawn threads. One `PrefixTrie` per target; tries share
//! nothing, so no lock spans targets.
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
//! node, 1.71 B per stored prompt byte).
//!
//! # Eviction
//! Every stored prompt is an LRU entry on its end node; inserting it again moves it to the
//! back. An insert links its prompt first, then, while `node_count > max_nodes`, drops the
//! oldest prompt: its end mark is cleared, the run of nodes only it used (up to the first
//! ancestor that is the root, another prompt's end, or a branch point) is unlinked and freed,
//! and a branch point left with one child is merged into it. Nodes on another live prompt's path
//! are never freed, and the new prompt's own path is never a victim. A prompt longer than
//! `max_nodes x 64` bytes is **truncated** to that length (its prefix is what routing scores),
//! so alone it fits exactly; empty prompts are ignored. `set_max_nodes` prunes immediately.
//!
//! The LRU is one list per thread stripe (a thread appends what it inserts, or re-inserts,
//! to its own list), each ordered by an insertion stamp taken under the writer lock, so the
//! global order is exact: the oldest prompt is the list head with the oldest stamp. Which
//! prompt goes: the evicting thread's own oldest, unless another list's head is older by more
//! than `prompt_count / 64` insertions, in which case that (the global oldest) goes. So with
//! one thread inserting (and in every proptest) the order is exactly least-recently-inserted;
//! across threads a victim is never more than 1/64 of the stored prompts (~1.6%) younger than
//! the oldest one, and a thread that stops inserting has its prompts evicted in exact order
//! by the others. (Stamps are 32-bit, compared by wrapping age: exact while the stored prompts
//! span fewer than 2^30 insertions.) Why: with one list, every append wrote the tail entry
//! the other thread had just appended, and both threads' pre-lock `warm` read the same next
//! victims that one of them then rewrote.
//!
//! # Concurrency: why this design
//! Chat prompts share their first kilobytes (role tag, system prompt), so striping by leading
//! bytes puts every request on one stripe; sharding by a deeper hash cannot answer "longest
//! prefix over all stored prompts" without visiting every shard; copy-on-write behind arc-swap
//! copies a ~100-node path per insert; an `RwLock` makes every insert wait for in-flight
//! matches (each ~0.3-1 us) and vice versa. Instead:
//! - **Matchers take no lock and write nothing shared.** Optimistic lock coupling (Leis et al.,
//!   "The ART of Practical Synchronization", 2016): every node has a seqlock version; a walk
//!   reads a child's version before re-validating its parent, and restarts on any change or on
//!   anything it cannot resolve (a torn read, a slot its directory snapshot cannot see).
//!   Slots live in segments that are never freed while the trie lives and every field is an
//!   atomic, so a racing read is stale but memory-safe, and validation rejects it. After 4
//!   failed attempts a walk reads under the writer lock (progress guarantee).
//! - **Writers serialise on one per-trie mutex and keep it short.** Before locking, an insert
//!   walks optimistically to where its prompt leaves the trie, allocates (from its thread's
//!   own free stack, see below) and fills the nodes of its new suffix (private until linked),
//!   and touches the next eviction victims of its own LRU list, the coldest memory in the
//!   trie, so their DRAM misses overlap other threads' work. Under the lock it only checks that
//!   the node it stopped at is unchanged (else re-walks), links the suffix, appends to its own
//!   LRU list (own lines), evicts, and stores the writer's state (counters, stamp, each list's
//!   head stamp) back into atomics on the lock's own cache line, so a write moves one line of
//!   shared writer state between cores. The getters read those atomics and never lock.
//! - Free slots sit on per-thread-stripe stacks, each behind its own lock on its own lines; a
//!   thread allocates from the stack its evictions free to, so in steady state allocation and
//!   freeing touch no line another thread writes. A thread whose stack runs short steals from
//!   the others before the arena grows (under a separate arena lock). Two threads on one trie
//!   steal on ~20% of inserts (counted; ~45% right after a one-thread fill), yet letting a
//!   short stack grow the arena into a slack of `max_nodes / 256` slots first (steals < 1%)
//!   measured worse: projected 2-thread speedup 1.23-1.27x with it vs 1.52x without.
//! - Rules every writer step follows (the concurrent tests caught each one being broken): change
//!   nodes top-down, parent before child, each inside its seqlock (a walk validates a parent
//!   after reading its child's version); any node unlinked gets a new version inside the same
//!   critical section (inserts trust "my node's version is unchanged" to mean "still linked,
//!   same path"); a slot is reused only after that. Eviction frees (slot resets, allocator
//!   hand-back) happen after the lock is released, the nodes being unreachable by then.
//! - The writer lock is `std::sync::Mutex` (futex), entered after up to ~2.6 us of `try_lock`
//!   and pauses: std spins only while the mutex is not marked contended, so after one sleep two
//!   busy threads fell into a convoy (every arrival slept, every unlock issued a futex wake;
//!   rounds alternated between ~1.3x and ~0.55x). parking_lot's slow path calls `sched_yield`
//!   up to seven times, which costs more than the critical section.
//! - Read-mostly fields, the writer line, each free stack and the arena sit on separate cache
//!   lines; a walk over back-to-back full nodes runs in a small loop that steps to the
//!   next slot by address, so it never waits on a pointer load (~2 ns per 64-byte hop).
//!
//! Measured and rejected: flat combining (queueing inserts for the lock holder) was 0.5-0.8x
//! on two threads (the holder could not keep up with the other thread's cache-cold work);
//! spinning longer before sleeping on the writer lock only burned CPU on this shared machine
//! (measured again: try_lock with pauses for up to ~13 us before the futex took the projected
//! two-thread speedup from ~1.5x to ~1.0x under load, spinning on a preempted holder; but see
//! the two phases under Measured: 10x and 100x the pre-spin measured the same here).
//!
//! # Measured
//! `cargo bench --bench trie` on the shared 2-vCPU AMD EPYC (Zen 5) VM, load average 1-5 from
//! other builds during every run, so figures are medians of noisy runs:
//! - `match_len`, 8 KiB prompt, 64 stored prompts: full hit (worst case) 0.31-0.34 us, 90%
//!   shared 0.27-0.42 us, 50% 0.17-0.18 us, 0% 25 ns; 1 KiB hit 69 ns, 64 KiB hit 2.1 us
//!   (~2 ns per 64-byte node). In a trie at the 1M-node cap (chat prompts built over 14 turns,
//!   so a fragmented path): 0.62-0.71 us. A 16-target routing decision is 16 of these.
//! - `insert` at steady state (trie at its cap, so including evictions): 8 KiB prompt with 0 /
//!   50 / 90% already stored 6.1 / 2.9 / 1.7 us; 1 KiB ~1 us; 64 KiB 37 / 22 / 6 us.
//! - Memory at the 1M-node cap: 95.4 MiB (100.1 B per node, 1.71 B per stored prompt byte);
//!   91.6 MiB before the stamp side array.
//! - Two threads: matches scale perfectly (two match-only threads each cost what one does) and
//!   a writer does not slow a concurrent matcher. Two threads each doing match + insert on the
//!   same trie (the 1:1 worst case; a route does ~16 matches per insert; `-- concurrent`) do
//!   not reach the 1.6x target. This machine has two phases, lasting seconds to many minutes
//!   and switching abruptly (once mid-run), in the old code as much as in this one: in the
//!   good one the projected same-trie speedup is 1.38-1.44x with a single LRU list and
//!   1.52-1.54x with the per-stripe lists (full `-- concurrent` runs interleaved in one
//!   sitting); in the bad one every part of a same-trie op, even the read-only match walk,
//!   costs 1.6-2x and 8% of lock acquisitions sleep instead of 1.5%: 0.70-0.79x with one
//!   list, 0.83-0.86x with per-stripe lists. Separate tries: ~1.95x in both phases, so the bad
//!   phase only hurts threads sharing lines (host placement of the vCPUs is the suspect; not
//!   found). Walks never restart (counted).
//! - Where the extra ~0.6 us of an op goes (good phase, mature tries, rdtsc per section, ops
//!   over 10 us dropped; same trie vs separate tries, ~1.65 us an op): match walk +105 ns,
//!   insert walk +0-45, chain prebuild +80, `warm` +127, taking the writer lock +175 (~20% of
//!   inserts find it held: the wait, plus moving the writer line every insert), critical
//!   section +110, deferred frees +12. What still bounces: the writer line; the nodes just
//!   below the system prompt where conversations branch off (every walk passes them, both
//!   threads add and evict conversations under them, eviction climbs end there); slots stolen
//!   from the other thread's free stack (~20% of inserts); metadata lines holding slots of
//!   both threads' chains (4 slots per 16-byte-entry line). Removing the writer line and
//!   the lock wait needs per-node writer locks (the seqlock versions as CAS locks) so inserts
//!   and evictions on different paths proceed in parallel; not done.
//! - Tried and dropped (projected same-trie speedup, interleaved in one sitting): evicting
//!   exactly the oldest list head (no window) 1.36-1.45x vs 1.50-1.59x windowed, as victims
//!   then alternate between the threads' lists; growing the arena into a slack of cap/256
//!   slots before stealing (steals < 1%) 1.23-1.27x vs 1.52x; no `warm` 1.22x vs 1.44x;
//!   `warm` deciding from a flag instead of reading the writer line 1.43-1.46x vs 1.49-1.60x;
//!   10x or 100x longer pre-spin: no change (1.55-1.58x), and the bad phase still comes;
//!   per-CPU stripes (RDTSCP's TSC_AUX) 1.19-1.23x vs 1.06-1.09x in the same (slack) sitting,
//!   but a thread moving between cores would then split its prompts over lists and lose the
//!   exact single-thread order; `warm` also touching the next victims' stamps and the labels
//!   a merge reads: inconclusive (1.23 / 1.45x vs 1.35 / 1.31x); giving a new thread the
//!   stripe of an exited one (the bench replaces its workers every run, so they rotate
//!   through all lists and stacks): 1.46x vs 1.41x in long runs, not clearly better, and it
//!   happened to move `run_chain` so that long matches ran ~15% slower (code placement only).

use parking_lot::Mutex;
use std::alloc::{alloc_zeroed, dealloc, handle_alloc_error, Layout};
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::atomic::{fence, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize};

/// Default node ceiling per trie (SPEC §2 `trie_max_nodes`, SPEC §4).
pub const DEFAULT_MAX_NODES: usize = 1_000_000;

/// Largest accepted node ceiling: slot ids are `u32` with `u32::MAX` reserved, and 2^30 slots
/// (~100 GB) is far beyond any sane per-target budget.
pub const MAX_NODES_LIMIT: usize = 1 << 30;

/// Most edge-label bytes one node holds: one 64-byte cache line, so a node slot is 96 bytes and
/// the 1M-node default stays under the 100 MiB per-target budget of issue 4.
pub const LABEL_BYTES: usize = 64;

/// `LABEL_BYTES` as little-endian `u64` words.
const LABEL_WORDS: usize = LABEL_BYTES / 8;

/// Children held by one overflow child block (12 key bytes + 12 `u32` ids fill a 64-byte label).
const KIDS_PER_BLOCK: usize = 12;

/// A node has at most one child per distinct first byte.
const MAX_FANOUT: usize = 256;

/// Longest overflow block chain a node can have; bounds optimistic readers on torn state.
const MAX_BLOCKS: usize = MAX_FANOUT.div_ceil(KIDS_PER_BLOCK);

/// log2 of slots per arena segment: 1024 slots = 96 KiB per segment, small
/// enough that an idle target's trie costs little, large enough that the directory stays tiny.
const SEG_SHIFT: u32 = 10;
const SEG_SLOTS: usize = 1 << SEG_SHIFT;

/// How many slots ahead the eviction climb prefetches (4 metadata entries share a cache line).
const PREFETCH_AHEAD: u32 = 8;

/// Extra nodes `PrefixTrie::warm` may visit beyond twice the expected chain length.
const WARM_SLACK: usize = 16;

/// Free-slot stacks, one per thread stripe (threads are assigned round-robin): enough that
/// the few threads inserting into one trie at a time rarely share a stack.
const FREE_STRIPES: usize = 4;

/// LRU lists, one per thread stripe: a thread appends the prompts it inserts to its own list.
const LRU_LISTS: usize = FREE_STRIPES;
const _: () = assert!(LRU_LISTS.is_power_of_two());

/// Insertion stamps advance by this much; the low bits of an entry's stamp name its list.
const STAMP_STEP: u32 = LRU_LISTS as u32;
const LIST_MASK: u32 = STAMP_STEP - 1;

/// A thread evicts its own list's oldest prompt unless another list's oldest is older by more
/// than `prompt_count / EVICT_WINDOW_DIV` insertions (then that one goes): exact order while a
/// single thread inserts, within ~1.6% of the stored prompts across threads.
const EVICT_WINDOW_DIV: usize = 64;

/// Evicted runs whose freeing can wait until the writer lock is released (more are freed in
/// place): an insert typically evicts one or two prompts.
const DEFERRED_RUNS: usize = 8;

/// Writer-lock attempts (each followed by pauses, ~26 ns each here) before `Mutex::lock`:
/// ~2.6 us, std's own spin budget, but also spent when the mutex is marked contended.
const WRITER_TRIES: usize = 25;
const WRITER_TRY_PAUSES: usize = 4;

/// Lock-free read attempts before a reader gives up and reads under the writer lock (guarantees
/// progress under a write storm; in practice the first attempt succeeds).
const OPTIMISTIC_ATTEMPTS: usize = 4;

const NIL: u32 = u32::MAX;
const ROOT: u32 = 0;
/// Bit in `WSlot::end` marking a node where a stored prompt ends.
const TERMINAL: u32 = 1 << 31;

// `Meta::shape` layout: label length (or a block's entry count), child count, first two keys.
const LEN_MASK: u32 = 0x7f;
const NKIDS_SHIFT: u32 = 7;
const NKIDS_MASK: u32 = 0x1ff;
const KEY0_SHIFT: u32 = 16;
const KEY1_SHIFT: u32 = 24;

#[inline]
fn shape_len(s: u32) -> usize {
    (s & LEN_MASK) as usize
}
#[inline]
fn shape_nkids(s: u32) -> usize {
    ((s >> NKIDS_SHIFT) & NKIDS_MASK) as usize
}
#[inline]
fn shape_key0(s: u32) -> u8 {
    (s >> KEY0_SHIFT) as u8
}
#[inline]
fn shape_key1(s: u32) -> u8 {
    (s >> KEY1_SHIFT) as u8
}
#[inline]
fn make_shape(len: usize, nkids: usize, key0: u8, key1: u8) -> u32 {
    debug_assert!(len <= LABEL_BYTES && nkids <= MAX_FANOUT);
    len as u32
        | (nkids as u32) << NKIDS_SHIFT
        | (key0 as u32) << KEY0_SHIFT
        | (key1 as u32) << KEY1_SHIFT
}

/// Edge label of one node (or the keys and ids of an overflow child block), as atomics so
/// optimistic readers never race non-atomic memory.
#[repr(C, align(64))]
struct Label([AtomicU64; LABEL_WORDS]);

/// The reader-visible part of a node slot.
#[repr(C)]
struct Meta {
    /// Seqlock: odd while the writer changes this slot; bumped on every change and on free.
    ver: AtomicU32,
    /// See `make_shape`.
    shape: AtomicU32,
    /// Up to two children inline; with more, `kid[0]` is the first overflow block.
    kid: [AtomicU32; 2],
}

/// A fixed run of slots. Never moved or freed while the trie lives, so readers can hold
/// references into it without locks.
#[repr(C)]
struct Segment {
    labels: [Label; SEG_SLOTS],
    metas: [Meta; SEG_SLOTS],
    wm: [WSlot; SEG_SLOTS],
    /// Insertion stamp of each terminal slot (`STAMP_STEP` per insertion, list index in the
    /// low bits); writer-only, like `wm`. A side array: the 96-byte slot has no room left.
    stamps: [AtomicU32; SEG_SLOTS],
}

/// Segment directory. Replaced (never mutated in place beyond its slots) when it grows; old
/// directories stay allocated until the trie drops.
struct Dir {
    segs: Box<[AtomicPtr<Segment>]>,
}

impl Dir {
    fn with_len(n: usize) -> Box<Dir> {
        Box::new(Dir {
            segs: (0..n)
                .map(|_| AtomicPtr::new(std::ptr::null_mut()))
                .collect(),
        })
    }

    /// The slot `id`, if its segment exists in this directory.
    #[inline]
    fn slot(&self, id: u32) -> Option<(&Meta, &Label)> {
        let seg = self.segs.get((id >> SEG_SHIFT) as usize)?.load(Acquire);
        if seg.is_null() {
            return None;
        }
        let i = id as usize & (SEG_SLOTS - 1);
        // SAFETY: a non-null entry points to a live, zero-initialised `Segment` that is only
        // deallocated when the trie drops, and `&self` (borrowed from the trie) cannot outlive it.
        let seg = unsafe { &*seg };
        Some((&seg.metas[i], &seg.labels[i]))
    }

    /// The writer bookkeeping of slot `id`, if its segment exists in this directory.
    #[inline]
    fn ws(&self, id: u32) -> Option<&WSlot> {
        let seg = self.segs.get((id >> SEG_SHIFT) as usize)?.load(Acquire);
        if seg.is_null() {
            return None;
        }
        // SAFETY: as in `slot`.
        let seg = unsafe { &*seg };
        Some(&seg.wm[id as usize & (SEG_SLOTS - 1)])
    }

    /// The insertion stamp of slot `id`, if its segment exists in this directory.
    #[inline]
    fn stamp(&self, id: u32) -> Option<&AtomicU32> {
        let seg = self.segs.get((id >> SEG_SHIFT) as usize)?.load(Acquire);
        if seg.is_null() {
            return None;
        }
        // SAFETY: as in `slot`.
        let seg = unsafe { &*seg };
        Some(&seg.stamps[id as usize & (SEG_SLOTS - 1)])
    }
}

/// Writer bookkeeping of one slot, never read by matchers. Stored under the writer lock, or by
/// whoever holds the slot while it is unlinked (allocator, chain prebuild); atomics so that an
/// inserter may read it racily, without the lock, to warm caches (`PrefixTrie::warm`).
#[repr(C)]
struct WSlot {
    parent: AtomicU32,
    /// LRU neighbours for terminal nodes; `next` links the free list for free slots.
    prev: AtomicU32,
    next: AtomicU32,
    /// Depth of the node's last label byte, `TERMINAL` bit if a stored prompt ends here.
    end: AtomicU32,
}

/// The writer's state, copied out of `Stats` when a critical section starts and stored back
/// when it ends.
#[derive(Clone, Copy)]
struct Writer {
    nodes: usize,
    bytes: usize,
    prompts: usize,
    evictions: u64,
    /// Next insertion stamp (a multiple of `STAMP_STEP`).
    stamp: u32,
    /// Bit `l` set if LRU list `l` is non-empty.
    nonempty: u32,
    /// Stamp of each non-empty list's head (its oldest prompt).
    head_stamp: [u32; LRU_LISTS],
}

/// Arena growth: high-water mark, segments and directories. Behind its own lock, taken only
/// when every free stack is short (the fill phase, or a new high-water mark).
struct Arena {
    /// Slots ever handed out (the arena's high-water mark).
    high: usize,
    segments: usize,
    dir_len: usize,
    retired: Vec<*mut Dir>,
    retired_bytes: usize,
}

/// The overflow blocks of one node.
struct BlockList {
    ids: [u32; MAX_BLOCKS],
    len: usize,
}

impl std::ops::Deref for BlockList {
    type Target = [u32];
    fn deref(&self) -> &[u32] {
        &self.ids[..self.len]
    }
}

/// Slots an eviction unlinked, to be freed after the writer lock is released: they are
/// unreachable, so only the version bump (for readers still inside) and the allocator remain.
#[derive(Clone, Copy)]
struct Deferred {
    /// Exclusive runs, as (leaf, top): freed by following `WSlot::parent` from leaf to top.
    runs: [(u32, u32); DEFERRED_RUNS],
    nruns: usize,
    /// Single slots already freed (versions bumped), linked through `WSlot::next`.
    freed_head: u32,
    freed_tail: u32,
}

const DEFERRED_NONE: Deferred = Deferred {
    runs: [(NIL, NIL); DEFERRED_RUNS],
    nruns: 0,
    freed_head: NIL,
    freed_tail: NIL,
};

/// A new chain of nodes, filled but not yet linked into the trie.
struct Chain {
    first: u32,
    last: u32,
    /// Depth of its first byte.
    d: usize,
    nodes: usize,
}

/// Where a walk stopped: `pos` bytes matched, the last `off` of them inside `node`'s label.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Walk {
    pos: usize,
    node: u32,
    ver: u32,
    off: usize,
    len: usize,
}

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

/// Node-capped, LRU-by-insertion radix trie of prompt bytes; `Send + Sync`, lock-free reads.
pub struct PrefixTrie {
    // Read-mostly, loaded by every walk: kept off the cache lines the writer dirties.
    dir: AtomicPtr<Dir>,
    /// Chunk size for labels (`LABEL_BYTES` except in tests).
    k: usize,
    max_nodes: AtomicUsize,
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

/// The writer lock (guarding `stats`, hence `()`) and the writer's state.
#[repr(C)]
struct WriterLine {
    lock: std::sync::Mutex<()>,
    stats: Stats,
}

const _: () = assert!(std::mem::size_of::<WriterLine>() <= 64, "one cache line");

/// The writer's state, stored (only under the writer lock) at the end of each critical section;
/// getters and `warm` load it without locking.
struct Stats {
    nodes: AtomicUsize,
    bytes: AtomicUsize,
    prompts: AtomicUsize,
    evictions: AtomicU64,
    /// `Writer::stamp`, `nonempty`, `head_stamp`: on this line (which moves with the lock
    /// anyway), so choosing the list to evict from reads no other thread's list line.
    stamp: AtomicU32,
    nonempty: AtomicU32,
    head_stamp: [AtomicU32; LRU_LISTS],
}

/// One LRU list: prompts' terminal nodes, linked through `WSlot::prev` / `next`, oldest first
/// (by stamp). Guarded by the writer lock; atomics so `warm` may read them racily.
struct LruEnds {
    head: AtomicU32,
    tail: AtomicU32,
}

/// Own cache-line pair (adjacent-line prefetch pairs lines on x86), against false sharing.
#[repr(align(128))]
struct Padded<T>(T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
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

/// This thread's free-slot stripe.
fn free_stripe() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static STRIPE: usize = NEXT.fetch_add(1, Relaxed) % FREE_STRIPES;
    }
    STRIPE.with(|s| *s)
}

/// The LRU list to evict from next: this thread's own list, unless another non-empty list's
/// head is older by more than `prompts / EVICT_WINDOW_DIV` insertions (then the list with the
/// oldest head). Ages are taken against the next stamp `now`, wrapping, so the order holds
/// while the stored prompts span fewer than 2^30 insertions.
fn victim_list(
    nonempty: u32,
    head_stamp: &[u32; LRU_LISTS],
    now: u32,
    prompts: usize,
) -> Option<usize> {
    let age = |l: usize| u64::from(now.wrapping_sub(head_stamp[l]));
    let oldest = (0..LRU_LISTS)
        .filter(|&l| nonempty >> l & 1 != 0)
        .max_by_key(|&l| age(l))?;
    let own = free_stripe() % LRU_LISTS;
    let window = (prompts / EVICT_WINDOW_DIV) as u64 * u64::from(STAMP_STEP);
    Some(
        if nonempty >> own & 1 != 0 && age(own) + window >= age(oldest) {
            own
        } else {
            oldest
        },
    )
}

#[inline]
fn read_begin(m: &Meta) -> Option<u32> {
    let v = m.ver.load(Acquire);
    (v & 1 == 0).then_some(v)
}

#[inline]
fn read_valid(m: &Meta, v: u32) -> bool {
    fence(Acquire);
    m.ver.load(Relaxed) == v
}

#[inline]
fn lock(m: &Meta) {
    let v = m.ver.load(Relaxed);
    debug_assert!(v & 1 == 0, "slot locked twice");
    m.ver.store(v.wrapping_add(1), Relaxed);
    fence(Release);
}

/// Give an unchanged slot a new version (+2, stays even): invalidates every earlier read.
#[inline]
fn bump(m: &Meta) {
    let v = m.ver.load(Relaxed);
    m.ver.store(v.wrapping_add(2), Release);
}

#[inline]
fn unlock(m: &Meta) {
    let v = m.ver.load(Relaxed);
    m.ver.store(v.wrapping_add(1), Release);
}

/// `shape` bits of a full-label node with exactly one child (the walk's fast path).
const CHAIN_MASK: u32 = LEN_MASK | NKIDS_MASK << NKIDS_SHIFT;
const CHAIN_SHAPE: u32 = LABEL_BYTES as u32 | 1 << NKIDS_SHIFT;

/// A validated position of a walk: `m`/`label` is slot `id`, read at version `v`, and the
/// first `pos` prompt bytes matched up to the start of its label.
#[derive(Clone, Copy)]
struct Cursor<'d> {
    pos: usize,
    id: u32,
    m: &'d Meta,
    label: &'d Label,
    v: u32,
}

/// Follow full-label single-child nodes stored back to back; `Some(true)` if it advanced,
/// `None` if a concurrent write was seen.
#[inline(never)]
fn run_chain(prompt: &[u8], st: &mut Cursor<'_>) -> Option<bool> {
    // Locals, written back once: the validation fences would otherwise force `st` to memory.
    let Cursor {
        mut pos,
        mut id,
        mut m,
        mut label,
        mut v,
    } = *st;
    let start = pos;
    loop {
        let shape = m.shape.load(Relaxed);
        if shape & CHAIN_MASK != CHAIN_SHAPE {
            break;
        }
        let Some(chunk) = prompt.get(pos..pos + LABEL_BYTES + 1) else {
            break;
        };
        let c = m.kid[0].load(Relaxed);
        if shape_key0(shape) != chunk[LABEL_BYTES]
            || c != id.wrapping_add(1)
            || c as usize & (SEG_SLOTS - 1) == 0
            || !label_eq(label, chunk)
        {
            break;
        }
        // SAFETY: `m`/`label` are entry `id & (SEG_SLOTS-1)` of their segment's arrays and
        // `c = id + 1` has a non-zero index, so entry + 1 is in bounds of the same arrays.
        let (cm, cl) = unsafe {
            (
                &*(m as *const Meta).add(1),
                &*(label as *const Label).add(1),
            )
        };
        let cv = read_begin(cm)?;
        if !read_valid(m, v) {
            return None;
        }
        pos += LABEL_BYTES;
        (id, m, label, v) = (c, cm, cl, cv);
    }
    *st = Cursor {
        pos,
        id,
        m,
        label,
        v,
    };
    Some(pos != start)
}

/// Whether a full label equals the first `LABEL_BYTES` of `chunk`.
#[inline(always)]
fn label_eq(label: &Label, chunk: &[u8]) -> bool {
    let chunk: &[u8; LABEL_BYTES] = chunk[..LABEL_BYTES].try_into().expect("full chunk");
    let word = |i: usize| u64::from_le_bytes(chunk[i * 8..i * 8 + 8].try_into().expect("8"));
    // Two halves keep register pressure low (atomic loads are not reordered by the compiler).
    for half in [0..LABEL_WORDS / 2, LABEL_WORDS / 2..LABEL_WORDS] {
        let mut diff = 0u64;
        for i in half {
            diff |= label.0[i].load(Relaxed) ^ word(i);
        }
        if diff != 0 {
            return false;
        }
    }
    true
}

/// Length of the common prefix of `label` (first `len` bytes) and `rest`.
#[inline(always)]
fn common_prefix(label: &Label, rest: &[u8], len: usize) -> usize {
    let max = len.min(rest.len());
    if max == LABEL_BYTES {
        // Hot path: a full label against at least as many prompt bytes.
        let mut diff = 0u64;
        for (i, w) in label.0.iter().enumerate() {
            diff |= w.load(Relaxed) ^ load_word(rest, i * 8);
        }
        if diff == 0 {
            return LABEL_BYTES;
        }
    }
    let mut i = 0;
    while i + 8 <= max {
        let x = label.0[i / 8].load(Relaxed) ^ load_word(rest, i);
        if x != 0 {
            return i + (x.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    if i < max {
        let mut buf = [0u8; 8];
        buf[..max - i].copy_from_slice(&rest[i..max]);
        let x = label.0[i / 8].load(Relaxed) ^ u64::from_le_bytes(buf);
        let x = x & (u64::MAX >> (64 - 8 * (max - i)));
        if x != 0 {
            return i + (x.trailing_zeros() / 8) as usize;
        }
    }
    max
}

/// Store `bytes` (at most `LABEL_BYTES`) as a label, zero-padded.
fn store_label(l: &Label, bytes: &[u8]) {
    let mut buf = [0u8; LABEL_BYTES];
    buf[..bytes.len()].copy_from_slice(bytes);
    for (i, w) in l.0.iter().enumerate() {
        w.store(load_word(&buf, i * 8), Relaxed);
    }
}

#[inline(always)]
fn load_word(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Child of a node for first byte `key`: `Some(NIL)` if it has none, `None` if the read could
/// not be completed (torn state, or a block in a segment newer than the reader's directory
/// snapshot) and the walk must restart. May return garbage on torn reads; the caller validates
/// the node's version before trusting the answer.
#[inline]
fn find_kid(dir: &Dir, m: &Meta, shape: u32, key: u8) -> Option<u32> {
    Some(match shape_nkids(shape) {
        0 => NIL,
        1 => {
            if shape_key0(shape) == key {
                m.kid[0].load(Relaxed)
            } else {
                NIL
            }
        }
        2 => {
            if shape_key0(shape) == key {
                m.kid[0].load(Relaxed)
            } else if shape_key1(shape) == key {
                m.kid[1].load(Relaxed)
            } else {
                NIL
            }
        }
        _ => {
            let mut b = m.kid[0].load(Relaxed);
            for _ in 0..MAX_BLOCKS {
                // A block this directory cannot see is not an absent child: retry.
                let (bm, bl) = dir.slot(b)?;
                let count = shape_len(bm.shape.load(Relaxed));
                if count > KIDS_PER_BLOCK {
                    return None;
                }
                let keys = [bl.0[0].load(Relaxed), bl.0[1].load(Relaxed)];
                for i in 0..count {
                    if (keys[i / 8] >> (8 * (i % 8))) as u8 == key {
                        return Some((bl.0[2 + i / 2].load(Relaxed) >> (32 * (i % 2))) as u32);
                    }
                }
                b = bm.kid[0].load(Relaxed);
                if b == NIL {
                    return Some(NIL);
                }
            }
            return None;
        }
    })
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
    /// until the node count is within the cap.
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
        let prompt = &prompt[..prompt.len().min(cap.saturating_mul(self.k))];
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
        if let Some(c) = &chain {
            self.warm(c.nodes);
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
            cx.evict_to(cx.t.max_nodes());
        });
    }

    /// The writer lock. `std::sync::Mutex`, not parking_lot: on contention it spins briefly
    /// and then sleeps on a futex, while parking_lot calls `sched_yield` up to seven times
    /// first, and those syscalls cost more CPU than the critical section they wait for.
    /// Poisoning is ignored: a panic mid-update cannot leave a reader-visible inconsistency
    /// (readers validate versions), only leaked slots.
    fn lock_writer(&self) -> std::sync::MutexGuard<'_, ()> {
        use std::sync::TryLockError;
        for _ in 0..WRITER_TRIES {
            match self.writer.lock.try_lock() {
                Ok(g) => return g,
                Err(TryLockError::Poisoned(e)) => return e.into_inner(),
                Err(TryLockError::WouldBlock) => {
                    for _ in 0..WRITER_TRY_PAUSES {
                        std::hint::spin_loop();
                    }
                }
            }
        }
        self.writer.lock.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The writer's state; call with the writer lock held.
    fn load_writer(&self) -> Writer {
        let st = &self.writer.stats;
        Writer {
            nodes: st.nodes.load(Relaxed),
            bytes: st.bytes.load(Relaxed),
            prompts: st.prompts.load(Relaxed),
            evictions: st.evictions.load(Relaxed),
            stamp: st.stamp.load(Relaxed),
            nonempty: st.nonempty.load(Relaxed),
            head_stamp: std::array::from_fn(|l| st.head_stamp[l].load(Relaxed)),
        }
    }

    /// Run `f` under the writer lock, publish the counters, then free what it unlinked.
    fn with_writer(&self, f: impl FnOnce(&mut Ctx<'_>)) {
        let deferred = {
            let _g = self.lock_writer();
            let mut cx = Ctx {
                t: self,
                w: self.load_writer(),
                d: DEFERRED_NONE,
            };
            f(&mut cx);
            cx.publish();
            cx.d
        };
        self.release(deferred);
    }

    /// Free what a critical section unlinked (already re-versioned under the lock): reset the
    /// slots and hand them all to the allocator in one go.
    fn release(&self, mut d: Deferred) {
        for i in 0..d.nruns {
            let (leaf, top) = d.runs[i];
            self.free_run(leaf, top, &mut d);
        }
        if d.freed_head != NIL {
            self.give_back(d.freed_head, d.freed_tail);
        }
    }

    /// Free an unlinked run, leaf first, so its top ends on top of the free list and a later
    /// chain reuses the run in its original (ascending) order.
    fn free_run(&self, leaf: u32, top: u32, d: &mut Deferred) {
        let mut cur = leaf;
        loop {
            let w = self.wslot(cur);
            let parent = w.parent.load(Relaxed);
            let m = self.slot_at(cur).0;
            lock(m);
            m.shape.store(0, Relaxed);
            unlock(m);
            w.parent.store(NIL, Relaxed);
            w.end.store(0, Relaxed);
            w.next.store(d.freed_head, Relaxed);
            if d.freed_head == NIL {
                d.freed_tail = cur;
            }
            d.freed_head = cur;
            if cur == top {
                return;
            }
            cur = parent;
        }
    }

    /// Allocate and fill the chain for `bytes`, which start at depth `d`.
    fn prebuild(&self, bytes: &[u8], d: usize) -> Chain {
        let head = self.take_slots(self.chain_len(d, bytes.len()));
        self.fill_chain(bytes, d, head)
    }

    /// Nodes needed for `n` bytes starting at depth `d` (cut at multiples of `k`).
    fn chain_len(&self, d: usize, n: usize) -> usize {
        let first_end = (d + n).min((d / self.k + 1) * self.k);
        1 + (d + n - first_end).div_ceil(self.k)
    }

    /// Write the chain for `bytes` (from depth `d`) into the slot list at `head` (exactly
    /// `chain_len` slots linked through `WSlot::next`). The nodes stay unreachable until linked.
    fn fill_chain(&self, bytes: &[u8], d: usize, head: u32) -> Chain {
        let k = self.k;
        let end_all = d + bytes.len();
        let (mut id, mut parent, mut depth, mut nodes) = (head, NIL, d, 0);
        loop {
            let end = end_all.min((depth / k + 1) * k);
            let chunk = &bytes[depth - d..end - d];
            let w = self.wslot(id);
            let next = w.next.load(Relaxed);
            let last = end == end_all;
            debug_assert_eq!(last, next == NIL, "slot list length");
            let (m, l) = self.slot_at(id);
            store_label(l, chunk);
            let (nk, key) = if last { (0, 0) } else { (1, bytes[end - d]) };
            m.shape.store(make_shape(chunk.len(), nk, key, 0), Relaxed);
            m.kid[0].store(next, Relaxed);
            m.kid[1].store(NIL, Relaxed);
            w.parent.store(parent, Relaxed);
            w.prev.store(NIL, Relaxed);
            w.next.store(NIL, Relaxed);
            w.end.store(end as u32, Relaxed);
            nodes += 1;
            if last {
                return Chain {
                    first: head,
                    last: id,
                    d,
                    nodes,
                };
            }
            (parent, id, depth) = (id, next, end);
        }
    }

    /// `n` slots from the allocator, linked through `WSlot::next` (NIL-terminated), most
    /// recently freed first (so a run freed together is reused in its original order). Takes
    /// from this thread's stack first, then the others' (so freed slots are always reused
    /// before the arena grows), then fresh slots.
    fn take_slots(&self, n: usize) -> u32 {
        debug_assert!(n > 0);
        let mine = free_stripe();
        let (mut head, mut tail, mut got) = (NIL, NIL, 0);
        for i in 0..FREE_STRIPES {
            if got == n {
                break;
            }
            let mut free = self.free[(mine + i) % FREE_STRIPES].lock();
            let top = *free;
            if top == NIL {
                continue;
            }
            // Cut the first `n - got` slots off this stack and append them to the list.
            let mut last = top;
            got += 1;
            while got < n {
                let nx = self.wslot(last).next.load(Relaxed);
                if nx == NIL {
                    break;
                }
                (last, got) = (nx, got + 1);
            }
            *free = self.wslot(last).next.load(Relaxed);
            drop(free);
            self.wslot(last).next.store(NIL, Relaxed);
            if head == NIL {
                head = top;
            } else {
                self.wslot(tail).next.store(top, Relaxed);
            }
            tail = last;
        }
        if got == n {
            return head;
        }
        let mut a = self.arena.lock();
        while got < n {
            let id = self.fresh_slot(&mut a);
            self.wslot(id).next.store(NIL, Relaxed);
            if head == NIL {
                head = id;
            } else {
                self.wslot(tail).next.store(id, Relaxed);
            }
            (tail, got) = (id, got + 1);
        }
        head
    }

    /// Push a list of slots (`head`..`tail` through `WSlot::next`) on this thread's stack.
    fn give_back(&self, head: u32, tail: u32) {
        let mut free = self.free[free_stripe()].lock();
        self.wslot(tail).next.store(*free, Relaxed);
        *free = head;
    }

    fn fresh_slot(&self, a: &mut Arena) -> u32 {
        let id = a.high;
        assert!(id < NIL as usize, "trie slot ids exhausted");
        if id.is_multiple_of(SEG_SLOTS) {
            self.add_segment(a, id >> SEG_SHIFT);
        }
        a.high += 1;
        id as u32
    }

    fn add_segment(&self, a: &mut Arena, seg: usize) {
        let cur = self.dir.load(Relaxed);
        // SAFETY: only the arena (under its lock) replaces the directory; `cur` is live.
        let cur_ref = unsafe { &*cur };
        if seg >= cur_ref.segs.len() {
            let grown = Dir::with_len((cur_ref.segs.len() * 2).max(seg + 1));
            for (x, y) in cur_ref.segs.iter().zip(grown.segs.iter()) {
                y.store(x.load(Relaxed), Relaxed);
            }
            a.dir_len = grown.segs.len();
            self.dir.store(Box::into_raw(grown), Release);
            a.retired_bytes += cur_ref.segs.len() * std::mem::size_of::<AtomicPtr<Segment>>()
                + std::mem::size_of::<Dir>();
            a.retired.push(cur);
        }
        let layout = Layout::new::<Segment>();
        // SAFETY: `Segment` has non-zero size; all-zero bytes are a valid `Segment` (atomics).
        let p = unsafe { alloc_zeroed(layout) }.cast::<Segment>();
        if p.is_null() {
            handle_alloc_error(layout);
        }
        self.dir().segs[seg].store(p, Release);
        a.segments += 1;
        let mem = std::mem::size_of::<PrefixTrie>()
            + a.segments * std::mem::size_of::<Segment>()
            + a.dir_len * std::mem::size_of::<AtomicPtr<Segment>>()
            + a.retired_bytes
            + a.retired.capacity() * std::mem::size_of::<*mut Dir>();
        self.mem.store(mem, Relaxed);
    }

    fn slot_at(&self, id: u32) -> (&Meta, &Label) {
        self.dir().slot(id).expect("allocated slot id in range")
    }

    fn wslot(&self, id: u32) -> &WSlot {
        self.dir().ws(id).expect("allocated slot id in range")
    }

    fn stamp_at(&self, id: u32) -> &AtomicU32 {
        self.dir().stamp(id).expect("allocated slot id in range")
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

    /// Prompts pruned by the node cap since creation.
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
        self.with_writer(|cx| cx.evict_to(n));
    }

    /// Heap bytes held by the trie (segments, directories, writer bookkeeping).
    pub fn memory_bytes(&self) -> usize {
        self.mem.load(Relaxed)
    }

    /// Before taking the writer lock: touch the cold lines the locked section is about to use
    /// (the runs of the next eviction victims, the oldest and so coldest memory in the trie),
    /// so their cache misses overlap other threads' work instead of lengthening the critical
    /// section. Follows racy hints and only reads atomics: it can slow nothing but
    /// itself and never affects correctness.
    fn warm(&self, new_slots: usize) {
        let dir = self.dir();
        if self.writer.stats.nodes.load(Relaxed) + new_slots <= self.max_nodes() {
            return;
        }
        // Visit about as many nodes as the insert will need freed, plus slack for prompts
        // whose eviction frees nothing (their path is shared with a newer prompt).
        let mut budget = 2 * new_slots + WARM_SLACK;
        let st = &self.writer.stats;
        let Some(l) = victim_list(
            st.nonempty.load(Relaxed),
            &std::array::from_fn(|l| st.head_stamp[l].load(Relaxed)),
            st.stamp.load(Relaxed),
            st.prompts.load(Relaxed),
        ) else {
            return;
        };
        let mut victim = self.lru[l].head.load(Relaxed);
        while budget > 0 {
            let Some(vw) = dir.ws(victim) else {
                return;
            };
            let mut a = victim;
            while budget > 0 {
                let (Some((m, _)), Some(w)) = (dir.slot(a), dir.ws(a)) else {
                    return;
                };
                budget -= 1;
                let parent = w.parent.load(Relaxed);
                let branching = shape_nkids(m.shape.load(Relaxed)) > 1;
                let terminal = a != victim && w.end.load(Relaxed) & TERMINAL != 0;
                if a == ROOT || branching || terminal {
                    break;
                }
                a = parent;
            }
            victim = vw.next.load(Relaxed);
        }
    }

    #[inline]
    fn dir(&self) -> &Dir {
        // SAFETY: the pointer is always a live `Dir`; replaced ones are retired, not freed,
        // until `Drop`, which needs `&mut self`.
        unsafe { &*self.dir.load(Acquire) }
    }

    /// One optimistic walk: `None` if a concurrent write got in the way.
    #[inline]
    fn walk(&self, prompt: &[u8]) -> Option<Walk> {
        let dir = self.dir();
        let mut id = ROOT;
        let (mut m, mut label) = dir.slot(ROOT)?;
        let mut v = read_begin(m)?;
        let mut pos = 0usize;
        loop {
            let shape = m.shape.load(Relaxed);
            // Fast path, most hops of a long prompt: full labels whose only child sits in the
            // next slot of the same segment. A separate small loop, so it keeps its state in
            // registers.
            if shape & CHAIN_MASK == CHAIN_SHAPE {
                let mut st = Cursor {
                    pos,
                    id,
                    m,
                    label,
                    v,
                };
                if run_chain(prompt, &mut st)? {
                    Cursor {
                        pos,
                        id,
                        m,
                        label,
                        v,
                    } = st;
                    continue;
                }
            }
            let len = shape_len(shape);
            if len > LABEL_BYTES || (len == 0 && id != ROOT) {
                return None;
            }
            let n = common_prefix(label, &prompt[pos..], len);
            if n < len || pos + n == prompt.len() {
                return read_valid(m, v).then_some(Walk {
                    pos: pos + n,
                    node: id,
                    ver: v,
                    off: n,
                    len,
                });
            }
            pos += len;
            let key = prompt[pos];
            let (c, cm, cl);
            if shape_nkids(shape) == 1 && shape_key0(shape) == key {
                c = m.kid[0].load(Relaxed);
                if c == id.wrapping_add(1) && c as usize & (SEG_SLOTS - 1) != 0 {
                    // Chain nodes are usually allocated back to back: step to the next slot of
                    // the same segment by address, so the next hop's loads need not wait for
                    // this `kid` load (the CPU predicts the branch and runs ahead).
                    // SAFETY: `m`/`label` are entry `id & (SEG_SLOTS-1)` of their segment's
                    // arrays and `c`'s index (that + 1) is non-zero, so `id`'s index is below
                    // SEG_SLOTS - 1 and the next entry is in bounds of the same array.
                    unsafe {
                        cm = &*(m as *const Meta).add(1);
                        cl = &*(label as *const Label).add(1);
                    }
                } else {
                    (cm, cl) = dir.slot(c)?;
                }
            } else {
                c = find_kid(dir, m, shape, key)?;
                if c == NIL {
                    return read_valid(m, v).then_some(Walk {
                        pos,
                        node: id,
                        ver: v,
                        off: len,
                        len,
                    });
                }
                (cm, cl) = dir.slot(c)?;
            }
            let cv = read_begin(cm)?;
            if !read_valid(m, v) {
                return None;
            }
            (id, m, label, v) = (c, cm, cl, cv);
        }
    }
}

impl Drop for PrefixTrie {
    fn drop(&mut self) {
        let a = self.arena.0.get_mut();
        let dir = *self.dir.get_mut();
        // SAFETY: `&mut self`: no readers or writers remain. Every segment pointer in the
        // current directory was allocated in `add_segment` and appears once there
        // (retired directories share pointers with it, so only their boxes are freed).
        unsafe {
            let d = Box::from_raw(dir);
            for s in d.segs.iter() {
                let p = s.load(Relaxed);
                if !p.is_null() {
                    dealloc(p.cast(), Layout::new::<Segment>());
                }
            }
            for &r in &a.retired {
                drop(Box::from_raw(r));
            }
        }
    }
}

/// The writer's view: the trie plus its locked bookkeeping.
struct Ctx<'a> {
    t: &'a PrefixTrie,
    /// The writer's state, loaded when the lock was taken; `publish` stores it back.
    w: Writer,
    /// Slots freed by this critical section, handed to the allocator after it ends.
    d: Deferred,
}

impl<'a> Ctx<'a> {
    fn slot(&self, id: u32) -> (&'a Meta, &'a Label) {
        self.t.slot_at(id)
    }

    fn meta(&self, id: u32) -> &'a Meta {
        self.slot(id).0
    }

    fn shape(&self, id: u32) -> u32 {
        self.meta(id).shape.load(Relaxed)
    }

    fn ws(&self, id: u32) -> &'a WSlot {
        self.t.wslot(id)
    }

    fn parent(&self, id: u32) -> u32 {
        self.ws(id).parent.load(Relaxed)
    }

    fn set_parent(&self, id: u32, p: u32) {
        self.ws(id).parent.store(p, Relaxed);
    }

    fn end(&self, id: u32) -> usize {
        (self.ws(id).end.load(Relaxed) & !TERMINAL) as usize
    }

    fn is_terminal(&self, id: u32) -> bool {
        self.ws(id).end.load(Relaxed) & TERMINAL != 0
    }

    /// Reset the bookkeeping of a newly placed node.
    fn init_ws(&self, id: u32, parent: u32, end: usize) {
        let w = self.ws(id);
        w.parent.store(parent, Relaxed);
        w.prev.store(NIL, Relaxed);
        w.next.store(NIL, Relaxed);
        w.end.store(end as u32, Relaxed);
    }

    fn read_label(&self, id: u32) -> ([u8; LABEL_BYTES], usize) {
        let (m, l) = self.slot(id);
        let mut out = [0u8; LABEL_BYTES];
        for (i, w) in l.0.iter().enumerate() {
            out[i * 8..i * 8 + 8].copy_from_slice(&w.load(Relaxed).to_le_bytes());
        }
        (out, shape_len(m.shape.load(Relaxed)))
    }

    fn write_label(&self, id: u32, bytes: &[u8]) {
        store_label(self.slot(id).1, bytes);
    }

    /// Store the writer's state back (on the lock's cache line) for lock-free getters and the
    /// next critical section.
    fn publish(&mut self) {
        let st = &self.t.writer.stats;
        st.nodes.store(self.w.nodes, Relaxed);
        st.bytes.store(self.w.bytes, Relaxed);
        st.prompts.store(self.w.prompts, Relaxed);
        st.evictions.store(self.w.evictions, Relaxed);
        st.stamp.store(self.w.stamp, Relaxed);
        st.nonempty.store(self.w.nonempty, Relaxed);
        for (a, &v) in st.head_stamp.iter().zip(&self.w.head_stamp) {
            a.store(v, Relaxed);
        }
    }

    // ---- slots -------------------------------------------------------------------------

    fn alloc(&mut self) -> u32 {
        self.t.take_slots(1)
    }

    /// Free a slot that the caller has already locked (it is reused after this section).
    fn free_locked(&mut self, id: u32) {
        let m = self.meta(id);
        m.shape.store(0, Relaxed);
        unlock(m);
        self.init_ws(id, NIL, 0);
        self.push_freed(id);
    }

    /// Queue `id` for the allocator, on top of the slots freed earlier in this section.
    fn push_freed(&mut self, id: u32) {
        let d = &mut self.d;
        self.t.wslot(id).next.store(d.freed_head, Relaxed);
        if d.freed_head == NIL {
            d.freed_tail = id;
        }
        d.freed_head = id;
    }

    /// Return an unpublished chain's slots (its walk went stale and it cannot be used).
    fn discard(&mut self, c: Chain) {
        let mut id = c.first;
        loop {
            let next = self.meta(id).kid[0].load(Relaxed);
            self.meta(id).shape.store(0, Relaxed);
            self.init_ws(id, NIL, 0);
            self.push_freed(id);
            if id == c.last {
                return;
            }
            id = next;
        }
    }

    fn alloc_block(&mut self) -> u32 {
        let b = self.alloc();
        let (m, l) = self.slot(b);
        m.shape.store(0, Relaxed);
        m.kid[0].store(NIL, Relaxed);
        for w in l.0.iter() {
            w.store(0, Relaxed);
        }
        self.w.nodes += 1;
        b
    }

    // ---- overflow child blocks (the owner node is locked by the caller) -----------------

    fn block_get(&self, b: u32, i: usize) -> (u8, u32) {
        let l = self.slot(b).1;
        let key = (l.0[i / 8].load(Relaxed) >> (8 * (i % 8))) as u8;
        let id = (l.0[2 + i / 2].load(Relaxed) >> (32 * (i % 2))) as u32;
        (key, id)
    }

    fn block_set(&self, b: u32, i: usize, key: u8, id: u32) {
        let l = self.slot(b).1;
        let kw = &l.0[i / 8];
        let ks = 8 * (i % 8);
        kw.store(
            (kw.load(Relaxed) & !(0xff << ks)) | (key as u64) << ks,
            Relaxed,
        );
        let iw = &l.0[2 + i / 2];
        let is = 32 * (i % 2);
        iw.store(
            (iw.load(Relaxed) & !(0xffff_ffff << is)) | (id as u64) << is,
            Relaxed,
        );
    }

    fn block_count(&self, b: u32) -> usize {
        shape_len(self.shape(b))
    }

    fn set_block_count(&self, b: u32, n: usize) {
        self.meta(b).shape.store(n as u32, Relaxed);
    }

    /// Blocks of a node with more than two children, in chain order (no heap allocation).
    fn blocks(&self, n: u32) -> BlockList {
        let mut out = BlockList {
            ids: [NIL; MAX_BLOCKS],
            len: 0,
        };
        let mut b = self.meta(n).kid[0].load(Relaxed);
        while b != NIL {
            out.ids[out.len] = b;
            out.len += 1;
            b = self.meta(b).kid[0].load(Relaxed);
        }
        out
    }

    /// All `(key, child)` pairs of `n`.
    fn kids(&self, n: u32) -> Vec<(u8, u32)> {
        let m = self.meta(n);
        let s = m.shape.load(Relaxed);
        match shape_nkids(s) {
            0 => vec![],
            1 => vec![(shape_key0(s), m.kid[0].load(Relaxed))],
            2 => vec![
                (shape_key0(s), m.kid[0].load(Relaxed)),
                (shape_key1(s), m.kid[1].load(Relaxed)),
            ],
            _ => self
                .blocks(n)
                .iter()
                .flat_map(|&b| (0..self.block_count(b)).map(move |i| (b, i)))
                .map(|(b, i)| self.block_get(b, i))
                .collect(),
        }
    }

    fn kid_add(&mut self, n: u32, key: u8, c: u32) {
        let s = self.shape(n);
        let f = shape_nkids(s);
        let len = shape_len(s);
        let m = self.meta(n);
        match f {
            0 => {
                m.kid[0].store(c, Relaxed);
                m.shape.store(make_shape(len, 1, key, 0), Relaxed);
            }
            1 => {
                m.kid[1].store(c, Relaxed);
                m.shape
                    .store(make_shape(len, 2, shape_key0(s), key), Relaxed);
            }
            2 => {
                let (k0, c0) = (shape_key0(s), m.kid[0].load(Relaxed));
                let (k1, c1) = (shape_key1(s), m.kid[1].load(Relaxed));
                let b = self.alloc_block();
                self.block_set(b, 0, k0, c0);
                self.block_set(b, 1, k1, c1);
                self.block_set(b, 2, key, c);
                self.set_block_count(b, 3);
                let m = self.meta(n);
                m.kid[0].store(b, Relaxed);
                m.kid[1].store(NIL, Relaxed);
                m.shape.store(make_shape(len, 3, 0, 0), Relaxed);
            }
            _ => {
                let last = *self.blocks(n).last().expect("node with >2 kids has blocks");
                let cnt = self.block_count(last);
                if cnt < KIDS_PER_BLOCK {
                    self.block_set(last, cnt, key, c);
                    self.set_block_count(last, cnt + 1);
                } else {
                    let b = self.alloc_block();
                    self.block_set(b, 0, key, c);
                    self.set_block_count(b, 1);
                    self.meta(last).kid[0].store(b, Relaxed);
                }
                self.meta(n)
                    .shape
                    .store(make_shape(len, f + 1, 0, 0), Relaxed);
            }
        }
    }

    fn kid_replace(&mut self, n: u32, key: u8, c: u32) {
        let m = self.meta(n);
        let s = m.shape.load(Relaxed);
        match shape_nkids(s) {
            0 => unreachable!("replace on a leaf"),
            1 | 2 => {
                let i = if shape_key0(s) == key { 0 } else { 1 };
                debug_assert!(i == 0 || shape_key1(s) == key);
                m.kid[i].store(c, Relaxed);
            }
            _ => {
                for &b in self.blocks(n).iter() {
                    for i in 0..self.block_count(b) {
                        if self.block_get(b, i).0 == key {
                            self.block_set(b, i, key, c);
                            return;
                        }
                    }
                }
                unreachable!("replace of a missing child");
            }
        }
    }

    /// Remove child `c` (found by id, so the child's own cold label line is never read).
    fn kid_remove(&mut self, n: u32, c: u32) {
        let s = self.shape(n);
        let f = shape_nkids(s);
        let len = shape_len(s);
        let m = self.meta(n);
        match f {
            0 => unreachable!("remove on a leaf"),
            1 => {
                debug_assert_eq!(m.kid[0].load(Relaxed), c);
                m.shape.store(make_shape(len, 0, 0, 0), Relaxed);
            }
            2 => {
                if m.kid[0].load(Relaxed) == c {
                    m.kid[0].store(m.kid[1].load(Relaxed), Relaxed);
                    m.shape.store(make_shape(len, 1, shape_key1(s), 0), Relaxed);
                } else {
                    debug_assert_eq!(m.kid[1].load(Relaxed), c);
                    m.shape.store(make_shape(len, 1, shape_key0(s), 0), Relaxed);
                }
                m.kid[1].store(NIL, Relaxed);
            }
            3 => {
                let b = m.kid[0].load(Relaxed);
                let rest: Vec<(u8, u32)> = self
                    .kids(n)
                    .into_iter()
                    .filter(|&(_, id)| id != c)
                    .collect();
                debug_assert_eq!(rest.len(), 2);
                m.kid[0].store(rest[0].1, Relaxed);
                m.kid[1].store(rest[1].1, Relaxed);
                m.shape
                    .store(make_shape(len, 2, rest[0].0, rest[1].0), Relaxed);
                lock(self.meta(b));
                self.free_locked(b);
                self.w.nodes -= 1;
            }
            _ => {
                let chain = self.blocks(n);
                let last = *chain.last().expect("blocks");
                let lcnt = self.block_count(last);
                let (lk, lc) = self.block_get(last, lcnt - 1);
                'found: for &b in chain.iter() {
                    for i in 0..self.block_count(b) {
                        if self.block_get(b, i).1 == c {
                            self.block_set(b, i, lk, lc);
                            break 'found;
                        }
                    }
                }
                if lcnt == 1 {
                    let prev = chain[chain.len() - 2];
                    self.meta(prev).kid[0].store(NIL, Relaxed);
                    lock(self.meta(last));
                    self.free_locked(last);
                    self.w.nodes -= 1;
                } else {
                    self.set_block_count(last, lcnt - 1);
                }
                m.shape.store(make_shape(len, f - 1, 0, 0), Relaxed);
            }
        }
    }

    // ---- LRU by insertion ----------------------------------------------------------------

    /// Append `id` to this thread's list with the next stamp.
    fn lru_push_back(&mut self, id: u32) {
        let l = free_stripe() % LRU_LISTS;
        let stamp = self.w.stamp | l as u32;
        self.w.stamp = self.w.stamp.wrapping_add(STAMP_STEP);
        self.t.stamp_at(id).store(stamp, Relaxed);
        let ends = &self.t.lru[l];
        let tail = ends.tail.load(Relaxed);
        let e = self.ws(id);
        e.prev.store(tail, Relaxed);
        e.next.store(NIL, Relaxed);
        if tail == NIL {
            ends.head.store(id, Relaxed);
            self.w.head_stamp[l] = stamp;
            self.w.nonempty |= 1 << l;
        } else {
            self.ws(tail).next.store(id, Relaxed);
        }
        ends.tail.store(id, Relaxed);
    }

    /// Unlink `id` from its list (named by its stamp's low bits).
    fn lru_remove(&mut self, id: u32) {
        let l = (self.t.stamp_at(id).load(Relaxed) & LIST_MASK) as usize;
        let ends = &self.t.lru[l];
        let e = self.ws(id);
        let (prev, next) = (e.prev.load(Relaxed), e.next.load(Relaxed));
        if prev == NIL {
            ends.head.store(next, Relaxed);
            if next == NIL {
                self.w.nonempty &= !(1 << l);
            } else {
                self.w.head_stamp[l] = self.t.stamp_at(next).load(Relaxed);
            }
        } else {
            self.ws(prev).next.store(next, Relaxed);
        }
        if next == NIL {
            ends.tail.store(prev, Relaxed);
        } else {
            self.ws(next).prev.store(prev, Relaxed);
        }
    }

    fn mark_terminal(&mut self, id: u32) {
        if self.is_terminal(id) {
            if self.t.lru[free_stripe() % LRU_LISTS].tail.load(Relaxed) != id {
                self.lru_remove(id);
                self.lru_push_back(id);
            }
        } else {
            self.ws(id).end.fetch_or(TERMINAL, Relaxed);
            self.lru_push_back(id);
            self.w.prompts += 1;
        }
    }

    // ---- insert ----------------------------------------------------------------------------

    fn apply(&mut self, prompt: &[u8], wk: Walk, chain: Option<Chain>) {
        let Walk {
            pos: d,
            node: x,
            off,
            len,
            ..
        } = wk;
        if d == prompt.len() {
            if let Some(c) = chain {
                self.discard(c); // someone stored the rest of this prompt meanwhile
            }
            if off == len {
                self.mark_terminal(x);
            } else {
                let u = self.split(x, off, None);
                self.mark_terminal(u);
            }
            return;
        }
        let c = match chain {
            Some(c) if c.d == d => c,
            stale => {
                if let Some(c) = stale {
                    self.discard(c);
                }
                self.t.prebuild(&prompt[d..], d)
            }
        };
        self.w.nodes += c.nodes;
        self.w.bytes += prompt.len() - d;
        let key = prompt[d];
        if off == len {
            let m = self.meta(x);
            lock(m);
            self.kid_add(x, key, c.first);
            unlock(self.meta(x));
            self.set_parent(c.first, x);
        } else {
            let u = self.split(x, off, Some((key, c.first)));
            self.set_parent(c.first, u);
        }
        self.mark_terminal(c.last);
    }

    /// Cut `x` after `off` label bytes: a new upper node takes `x`'s place under its parent
    /// (`x` keeps its id, end depth and subtree). `extra` becomes the upper node's second child.
    fn split(&mut self, x: u32, off: usize, extra: Option<(u8, u32)>) -> u32 {
        let (lab, len) = self.read_label(x);
        let p = self.parent(x);
        let u = self.alloc();
        self.write_label(u, &lab[..off]);
        let (nk, k1, c1) = extra.map_or((1, 0, NIL), |(k, c)| (2, k, c));
        let mu = self.meta(u);
        mu.shape.store(make_shape(off, nk, lab[off], k1), Relaxed);
        mu.kid[0].store(x, Relaxed);
        mu.kid[1].store(c1, Relaxed);
        self.init_ws(u, p, self.end(x) - (len - off));
        let (mp, mx) = (self.meta(p), self.meta(x));
        lock(mp);
        lock(mx);
        self.kid_replace(p, lab[0], u);
        self.write_label(x, &lab[off..len]);
        let sx = self.shape(x);
        self.meta(x)
            .shape
            .store((sx & !LEN_MASK) | (len - off) as u32, Relaxed);
        unlock(self.meta(x));
        unlock(self.meta(p));
        self.set_parent(x, u);
        self.w.nodes += 1;
        u
    }

    // ---- eviction ----------------------------------------------------------------------------

    fn evict_to(&mut self, cap: usize) {
        while self.w.nodes > cap && self.w.nonempty != 0 {
            self.evict_oldest();
        }
    }

    /// Drop the least-recently-inserted prompt (of the list `victim_list` picks) and the nodes
    /// only it used; re-compress.
    fn evict_oldest(&mut self) {
        let w = &self.w;
        let l = victim_list(w.nonempty, &w.head_stamp, w.stamp, w.prompts).expect("non-empty");
        let t = self.t.lru[l].head.load(Relaxed);
        self.lru_remove(t);
        self.ws(t).end.fetch_and(!TERMINAL, Relaxed);
        self.w.prompts -= 1;
        self.w.evictions += 1;
        // The next victim's lines are cold (it is the oldest prompt): fetch them now so the
        // next eviction does not start with a chain of DRAM misses.
        self.prefetch_slot(self.t.lru[l].head.load(Relaxed), 0);
        if shape_nkids(self.shape(t)) > 0 {
            self.compress(t);
            return;
        }
        // `t` is a leaf: climb its exclusive run (non-terminal single-child ancestors) up to
        // the first ancestor `a` another prompt still needs (root, terminal, or branching).
        let (mut top, mut nodes, mut bytes) = (t, 1, shape_len(self.shape(t)));
        let mut a = self.parent(t);
        while a != ROOT && !self.is_terminal(a) && shape_nkids(self.shape(a)) == 1 {
            // Chains are allocated back to back, so the climb usually walks down the slots.
            self.prefetch_slot(a, PREFETCH_AHEAD);
            (top, nodes, bytes) = (a, nodes + 1, bytes + shape_len(self.shape(a)));
            a = self.parent(a);
        }
        lock(self.meta(a));
        self.kid_remove(a, top);
        unlock(self.meta(a));
        // Then give every node of the run a new version, inside the critical section, after
        // the unlink and top-down (parent before child, as lock coupling requires): a walk
        // validates a parent after reading its child's version, so whoever reads a new version
        // here then sees the parent (ultimately `a`) changed and restarts. No unlinked node may
        // keep its old version past the lock either: inserts validate "the node my walk
        // stopped at is unchanged" by its version.
        let mut cur = top;
        loop {
            bump(self.meta(cur));
            if cur == t {
                break;
            }
            cur = self.meta(cur).kid[0].load(Relaxed);
        }
        self.w.nodes -= nodes;
        self.w.bytes -= bytes;
        // The run is unreachable now; free it after the lock is released if there is room.
        let d = &mut self.d;
        if d.nruns < DEFERRED_RUNS {
            d.runs[d.nruns] = (t, top);
            d.nruns += 1;
        } else {
            self.t.free_run(t, top, &mut self.d);
        }
        if a != ROOT && !self.is_terminal(a) {
            self.compress(a);
        }
    }

    /// Merge non-terminal `n` into its only child if nothing requires a node boundary there.
    fn compress(&mut self, n: u32) {
        if shape_nkids(self.shape(n)) == 1 && !self.end(n).is_multiple_of(self.t.k) {
            self.merge_into_child(n);
        }
    }

    /// Hint the CPU to fetch the writer and reader metadata of slots `id - ahead ..= id`.
    fn prefetch_slot(&self, id: u32, ahead: u32) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            if id == NIL {
                return;
            }
            let id = id.saturating_sub(ahead);
            if let Some((m, _)) = self.t.dir().slot(id) {
                // SAFETY: prefetching has no memory effects; both addresses are in bounds.
                unsafe {
                    _mm_prefetch::<_MM_HINT_T0>((m as *const Meta).cast());
                    if let Some(w) = self.t.dir().ws(id) {
                        _mm_prefetch::<_MM_HINT_T0>((w as *const WSlot).cast());
                    }
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (id, ahead);
    }

    /// Fold non-branching, non-terminal `n` into its only child (the child keeps its id).
    fn merge_into_child(&mut self, n: u32) {
        let c = self.meta(n).kid[0].load(Relaxed);
        let p = self.parent(n);
        let (nl, nlen) = self.read_label(n);
        let (cl, clen) = self.read_label(c);
        debug_assert!(nlen + clen <= self.t.k);
        let mut buf = [0u8; 2 * LABEL_BYTES];
        buf[..nlen].copy_from_slice(&nl[..nlen]);
        buf[nlen..nlen + clen].copy_from_slice(&cl[..clen]);
        lock(self.meta(p));
        lock(self.meta(n));
        lock(self.meta(c));
        self.write_label(c, &buf[..nlen + clen]);
        let sc = self.shape(c);
        self.meta(c)
            .shape
            .store((sc & !LEN_MASK) | (nlen + clen) as u32, Relaxed);
        self.kid_replace(p, nl[0], c);
        unlock(self.meta(c));
        self.free_locked(n);
        unlock(self.meta(p));
        self.set_parent(c, p);
        self.w.nodes -= 1;
    }
}

#[cfg(test)]
impl PrefixTrie {
    /// Verify every structural invariant under the writer lock; return the stored prompts,
    /// least recently inserted first.
    fn check(&self) -> Vec<Vec<u8>> {
        use std::collections::{HashMap, HashSet};
        let _g = self.lock_writer();
        let cx = Ctx {
            t: self,
            w: self.load_writer(),
            d: DEFERRED_NONE,
        };
        let k = self.k;
        let (mut nodes, mut bytes, mut terminals) = (0usize, 0usize, 0usize);
        let mut paths: HashMap<u32, Vec<u8>> = HashMap::new();
        let mut seen: HashSet<u32> = HashSet::new();
        // (id, path to its end)
        let mut stack = vec![(ROOT, Vec::new())];
        while let Some((id, path)) = stack.pop() {
            assert!(seen.insert(id), "slot {id} reachable twice");
            let m = cx.meta(id);
            assert_eq!(m.ver.load(Relaxed) & 1, 0, "slot {id} left locked");
            let s = m.shape.load(Relaxed);
            let f = shape_nkids(s);
            let end = cx.end(id);
            assert_eq!(end, path.len(), "end depth of {id}");
            let term = cx.is_terminal(id);
            if id != ROOT {
                let len = shape_len(s);
                assert!((1..=k).contains(&len), "label length {len} of {id}");
                let start = end - len;
                assert_eq!(
                    start / k,
                    (end - 1) / k,
                    "label of {id} crosses a chunk boundary"
                );
                nodes += 1;
                bytes += len;
                if term {
                    terminals += 1;
                    paths.insert(id, path.clone());
                } else {
                    assert!(
                        f >= 2 || (f == 1 && end.is_multiple_of(k)),
                        "redundant node {id}"
                    );
                }
            } else {
                assert_eq!(shape_len(s), 0);
                assert!(!term);
            }
            if f > 2 {
                let blocks = cx.blocks(id);
                assert_eq!(blocks.len(), f.div_ceil(KIDS_PER_BLOCK), "blocks of {id}");
                for (i, &b) in blocks.iter().enumerate() {
                    assert!(seen.insert(b), "block {b} shared");
                    assert_eq!(cx.meta(b).ver.load(Relaxed) & 1, 0);
                    let want = if i + 1 == blocks.len() {
                        f - KIDS_PER_BLOCK * i
                    } else {
                        KIDS_PER_BLOCK
                    };
                    assert_eq!(cx.block_count(b), want);
                    nodes += 1;
                }
            }
            let kids = cx.kids(id);
            assert_eq!(kids.len(), f);
            let keys: HashSet<u8> = kids.iter().map(|&(k, _)| k).collect();
            assert_eq!(keys.len(), f, "duplicate child keys under {id}");
            for (key, c) in kids {
                assert_eq!(cx.parent(c), id, "parent of {c}");
                let (lab, len) = cx.read_label(c);
                assert_eq!(lab[0], key, "key of {c}");
                // Through the reader's lookup as well.
                let d = self.dir();
                assert_eq!(find_kid(d, m, s, key), Some(c));
                let mut p = path.clone();
                p.extend_from_slice(&lab[..len]);
                stack.push((c, p));
            }
        }
        assert_eq!(nodes, cx.w.nodes, "node count");
        assert_eq!(bytes, cx.w.bytes, "byte count");
        assert_eq!(terminals, cx.w.prompts, "prompt count");
        let mut free = 0;
        for stack in &self.free {
            let mut f = *stack.lock();
            while f != NIL {
                assert!(!seen.contains(&f), "free slot {f} reachable");
                free += 1;
                f = cx.ws(f).next.load(Relaxed);
            }
        }
        assert_eq!(free + seen.len(), self.arena.lock().high, "slots leaked");
        // Every list: linked both ways, its own entries only, stamps increasing, its cached
        // head stamp and non-empty bit right. Stored prompts are returned oldest first (merged
        // by stamp age, which is exact insertion order).
        let mut entries = Vec::new();
        let age = |s: u32| cx.w.stamp.wrapping_sub(s);
        for l in 0..LRU_LISTS {
            let ends = &self.lru[l];
            let (mut cur, mut prev) = (ends.head.load(Relaxed), NIL);
            assert_eq!(
                cx.w.nonempty >> l & 1 != 0,
                cur != NIL,
                "non-empty bit of list {l}"
            );
            if cur != NIL {
                assert_eq!(
                    cx.w.head_stamp[l],
                    self.stamp_at(cur).load(Relaxed),
                    "head stamp"
                );
            }
            while cur != NIL {
                assert_eq!(cx.ws(cur).prev.load(Relaxed), prev, "lru back link");
                let s = self.stamp_at(cur).load(Relaxed);
                assert_eq!((s & LIST_MASK) as usize, l, "stamp names its list");
                if prev != NIL {
                    assert!(
                        age(s) < age(self.stamp_at(prev).load(Relaxed)),
                        "list order"
                    );
                }
                entries.push((
                    age(s),
                    paths.remove(&cur).expect("lru entry is a live terminal"),
                ));
                (prev, cur) = (cur, cx.ws(cur).next.load(Relaxed));
            }
            assert_eq!(prev, ends.tail.load(Relaxed), "tail of list {l}");
        }
        assert!(paths.is_empty(), "terminal missing from lru");
        entries.sort_by_key(|e| std::cmp::Reverse(e.0));
        let out: Vec<Vec<u8>> = entries.into_iter().map(|(_, p)| p).collect();
        assert_eq!(self.node_count(), nodes);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeSet, VecDeque};
    use std::sync::Arc;

    fn lcp(a: &[u8], b: &[u8]) -> usize {
        a.iter().zip(b).take_while(|(x, y)| x == y).count()
    }

    /// Naive reference: stored prompts in insertion order, same eviction rule, node count
    /// computed from the canonical shape (a node at every chunk boundary, prompt end and
    /// branch point; one overflow block per 12 children beyond two).
    struct Model {
        k: usize,
        cap: usize,
        live: VecDeque<Vec<u8>>,
    }

    impl Model {
        fn new(cap: usize, k: usize) -> Self {
            Model {
                k,
                cap,
                live: VecDeque::new(),
            }
        }

        fn insert(&mut self, p: &[u8]) {
            let p = &p[..p.len().min(self.cap * self.k)];
            if !p.is_empty() {
                if let Some(i) = self.live.iter().position(|s| s == p) {
                    self.live.remove(i);
                }
                self.live.push_back(p.to_vec());
            }
            self.evict();
        }

        fn set_cap(&mut self, cap: usize) {
            self.cap = cap;
            self.evict();
        }

        fn evict(&mut self) {
            while self.slots() > self.cap && !self.live.is_empty() {
                self.live.pop_front();
            }
        }

        fn match_len(&self, q: &[u8]) -> usize {
            self.live.iter().map(|s| lcp(s, q)).max().unwrap_or(0)
        }

        fn node_strings(&self) -> BTreeSet<Vec<u8>> {
            let mut set = BTreeSet::new();
            for s in &self.live {
                for l in (self.k..=s.len()).step_by(self.k) {
                    set.insert(s[..l].to_vec());
                }
                set.insert(s.clone());
            }
            let sorted: BTreeSet<&Vec<u8>> = self.live.iter().collect();
            let sorted: Vec<_> = sorted.into_iter().collect();
            for w in sorted.windows(2) {
                let l = lcp(w[0], w[1]);
                if l > 0 && l < w[0].len() && l < w[1].len() {
                    set.insert(w[0][..l].to_vec());
                }
            }
            set
        }

        fn slots(&self) -> usize {
            let nodes = self.node_strings();
            let mut total = nodes.len();
            for x in nodes.iter().map(|v| v.as_slice()).chain([&[][..]]) {
                let f = self
                    .live
                    .iter()
                    .filter(|s| s.len() > x.len() && s.starts_with(x))
                    .map(|s| s[x.len()])
                    .collect::<BTreeSet<u8>>()
                    .len();
                if f > 2 {
                    total += f.div_ceil(KIDS_PER_BLOCK);
                }
            }
            total
        }

        fn bytes(&self) -> usize {
            let mut set = BTreeSet::new();
            for s in &self.live {
                for l in 1..=s.len() {
                    set.insert(&s[..l]);
                }
            }
            set.len()
        }
    }

    fn assert_agrees(t: &PrefixTrie, m: &Model, probes: &[Vec<u8>]) {
        let stored = t.check();
        assert_eq!(
            stored,
            Vec::from(m.live.clone()),
            "stored prompts / LRU order"
        );
        assert_eq!(t.node_count(), m.slots(), "node count");
        assert_eq!(t.byte_count(), m.bytes(), "byte count");
        assert_eq!(t.prompt_count(), m.live.len());
        assert!(t.node_count() <= t.max_nodes(), "cap exceeded");
        for s in &m.live {
            assert_eq!(t.match_len(s), s.len(), "live prompt lost bytes");
        }
        for q in probes {
            assert_eq!(t.match_len(q), m.match_len(q), "match_len({q:?})");
        }
    }

    #[test]
    fn empty_trie_matches_nothing() {
        let t = PrefixTrie::new(10);
        assert_eq!(t.match_len(b""), 0);
        assert_eq!(t.match_len(b"hello"), 0);
        assert_eq!(
            (t.node_count(), t.byte_count(), t.prompt_count()),
            (0, 0, 0)
        );
        t.insert(b"");
        assert_eq!(t.prompt_count(), 0, "empty prompts are not stored");
        t.check();
    }

    #[test]
    fn default_uses_spec_cap() {
        assert_eq!(PrefixTrie::default().max_nodes(), DEFAULT_MAX_NODES);
        fn send_sync<T: Send + Sync>() {}
        send_sync::<PrefixTrie>();
    }

    #[test]
    fn match_is_longest_common_prefix() {
        let t = PrefixTrie::new(100);
        t.insert(b"system: be nice\x1euser: hi");
        t.insert(b"system: be nice\x1euser: bye");
        assert_eq!(t.match_len(b"system: be nice\x1euser: hi"), 24);
        assert_eq!(t.match_len(b"system: be nice\x1euser: hi there"), 24);
        assert_eq!(t.match_len(b"system: be nice\x1euser: b"), 23);
        assert_eq!(t.match_len(b"system: be rude"), 11);
        assert_eq!(t.match_len(b"x"), 0);
        // root -> "system: be nice\x1euser: " -> {"hi", "bye"}
        assert_eq!(t.node_count(), 3);
        assert_eq!(t.byte_count(), 22 + 2 + 3);
        t.check();
    }

    #[test]
    fn prompt_ending_inside_a_label_splits_it() {
        let t = PrefixTrie::new(100);
        t.insert(b"abcdef");
        t.insert(b"abc");
        assert_eq!(t.node_count(), 2);
        assert_eq!(t.prompt_count(), 2);
        assert_eq!(t.check(), vec![b"abcdef".to_vec(), b"abc".to_vec()]);
        // Evicting "abcdef" leaves "abc" alone in one node.
        t.set_max_nodes(1);
        assert_eq!(t.check(), vec![b"abc".to_vec()]);
        assert_eq!(t.match_len(b"abcdef"), 3);
        assert_eq!((t.node_count(), t.evictions()), (1, 1));
    }

    #[test]
    fn long_prompts_are_chunked_at_label_bytes() {
        let t = PrefixTrie::new(1000);
        let p: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
        t.insert(&p);
        assert_eq!(t.node_count(), 1000usize.div_ceil(LABEL_BYTES));
        assert_eq!(t.byte_count(), 1000);
        assert_eq!(t.match_len(&p), 1000);
        let mut q = p.clone();
        q[777] ^= 1;
        assert_eq!(t.match_len(&q), 777);
        t.insert(&q);
        // One split at 777 (inside the chunk 768..832) plus the new tail 777..832, 832..1000.
        assert_eq!(t.node_count(), 16 + 1 + 1 + 3);
        t.check();
    }

    #[test]
    fn reinsert_refreshes_lru_order() {
        let t = PrefixTrie::with_label_bytes(2, 64);
        t.insert(b"a1");
        t.insert(b"b1");
        t.insert(b"a1"); // refresh: now b1 is the oldest
                         // Root would need a third child plus its overflow block (4 slots): b1, now the oldest,
                         // goes; a1 and c1 fit inline again.
        t.insert(b"c1");
        assert_eq!(t.check(), vec![b"a1".to_vec(), b"c1".to_vec()]);
        let t = PrefixTrie::with_label_bytes(3, 64);
        t.insert(b"xa");
        t.insert(b"xb");
        t.insert(b"xa");
        t.insert(b"xc"); // "x" + 3 kids + block = 5 > 3: b is oldest, goes first
        assert_eq!(t.check(), vec![b"xa".to_vec(), b"xc".to_vec()]);
        assert_eq!(t.evictions(), 1);
    }

    #[test]
    fn eviction_keeps_shared_prefix_of_live_prompts() {
        let sys = b"<|system|>You are a helpful assistant. ".repeat(20);
        let t = PrefixTrie::new(40);
        let conv = |c: u8, turns: usize| {
            let mut p = sys.clone();
            for i in 0..turns {
                p.extend_from_slice(format!("<|user|>conversation {c} turn {i} ").as_bytes());
                p.extend_from_slice(&[b'a' + c; 100]);
            }
            p
        };
        for turn in 1..=4 {
            for c in 0..6 {
                t.insert(&conv(c, turn));
                assert!(t.node_count() <= 40);
                assert_eq!(t.match_len(&conv(c, turn)), conv(c, turn).len());
            }
        }
        assert!(t.evictions() > 0);
        let live = t.check();
        for p in &live {
            assert_eq!(t.match_len(p), p.len());
        }
        // The system prompt is shared by everything live and survives every eviction.
        assert_eq!(t.match_len(&sys), sys.len());
    }

    #[test]
    fn oversized_prompt_is_truncated_to_fit_alone() {
        let t = PrefixTrie::new(3);
        let p: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
        t.insert(b"something else");
        t.insert(&p);
        assert_eq!(t.check(), vec![p[..3 * LABEL_BYTES].to_vec()]);
        assert_eq!(t.match_len(&p), 3 * LABEL_BYTES);
        assert_eq!(t.node_count(), 3);
        let t = PrefixTrie::new(0);
        t.insert(&p);
        assert_eq!((t.node_count(), t.match_len(&p)), (0, 0));
    }

    #[test]
    fn wide_fanout_uses_overflow_blocks_and_shrinks_back() {
        let t = PrefixTrie::with_label_bytes(10_000, 64);
        let all: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b'p', b, b'z']).collect();
        for p in &all {
            t.insert(p);
        }
        // "p" + 256 leaves + ceil(256 / 12) blocks
        assert_eq!(t.node_count(), 1 + 256 + 22);
        for p in &all {
            assert_eq!(t.match_len(p), 3);
        }
        t.check();
        for (i, cap) in [200, 100, 40, 5, 3, 2, 1].into_iter().enumerate() {
            t.set_max_nodes(cap);
            let live = t.check();
            assert!(t.node_count() <= cap, "step {i}");
            for p in &live {
                assert_eq!(t.match_len(p), 3);
            }
        }
        assert_eq!(t.check(), vec![b"p\xffz".to_vec()]);
    }

    #[test]
    fn byte_trie_degenerate_chunk_of_one() {
        let t = PrefixTrie::with_label_bytes(100, 1);
        t.insert(b"hello");
        t.insert(b"help");
        assert_eq!(t.node_count(), 6);
        assert_eq!(t.match_len(b"helium"), 3);
        t.check();
    }

    #[test]
    fn fill_to_default_cap_stays_under_100_mib() {
        // Realistic fill: a shared 2 KiB system prompt, then 64 KiB of conversations growing by
        // ~600-byte turns, unique per conversation. Keeps inserting past the cap.
        let t = PrefixTrie::default();
        let sys: Vec<u8> = (0..2048u32)
            .map(|i| b"abcdefghij klmnopq"[i as usize % 18])
            .collect();
        let mut stored = 0usize;
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut conv = 0u64;
        while t.evictions() < 200 {
            conv += 1;
            let mut p = sys.clone();
            p.extend_from_slice(&conv.to_le_bytes());
            for _ in 0..8 {
                for _ in 0..600 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    p.push(b'a' + (x % 26) as u8);
                }
                t.insert(&p);
                stored += 1;
            }
        }
        let mem = t.memory_bytes();
        let nodes = t.node_count();
        let per_node = mem as f64 / nodes as f64;
        let per_byte = mem as f64 / t.byte_count() as f64;
        eprintln!(
            "fill to cap: {nodes} nodes, {} label bytes, {} prompts ({stored} inserted), \
             {mem} B = {:.1} MiB, {per_node:.1} B/node, {per_byte:.2} B/stored byte",
            t.byte_count(),
            t.prompt_count(),
            mem as f64 / (1 << 20) as f64
        );
        assert!(nodes <= DEFAULT_MAX_NODES && nodes > DEFAULT_MAX_NODES - 20_000);
        assert!(mem < 100 << 20, "{mem} bytes at the 1M-node cap");
    }

    #[derive(Clone, Debug)]
    enum Op {
        Insert(Vec<u8>),
        /// Re-insert a prefix of an earlier prompt extended by new bytes (a conversation turn).
        Extend(usize, usize, Vec<u8>),
        /// Re-insert an earlier prompt exactly (refreshes its LRU position).
        Reinsert(usize),
        Match(Vec<u8>),
        SetCap(usize),
        /// Like `Extend`, but inserted through `insert_hinted` with the hint of a
        /// `match_hinted` taken first; if the second part is set, a prompt that shares a
        /// prefix of it (cut at `.0`, then `.1`) is inserted in between, so the hint is often
        /// stale (the node it names split, extended or evicted).
        Hinted(usize, usize, Vec<u8>, Option<(usize, Vec<u8>)>),
    }

    fn op(alpha: &'static [u8], max_len: usize, max_cap: usize) -> impl Strategy<Value = Op> {
        let s = move || prop::collection::vec(prop::sample::select(alpha), 0..max_len);
        prop_oneof![
            4 => s().prop_map(Op::Insert),
            4 => (any::<usize>(), any::<usize>(), s()).prop_map(|(i, l, x)| Op::Extend(i, l, x)),
            3 => any::<usize>().prop_map(Op::Reinsert),
            3 => s().prop_map(Op::Match),
            1 => (0..=max_cap).prop_map(Op::SetCap),
            4 => (any::<usize>(), any::<usize>(), s(), prop::option::of((any::<usize>(), s())))
                .prop_map(|(i, l, x, q)| Op::Hinted(i, l, x, q)),
        ]
    }

    /// A stored (or once stored) prompt cut at `l` and extended with `x`: shares a prefix.
    fn derived(history: &[Vec<u8>], i: usize, l: usize, x: &[u8]) -> Vec<u8> {
        let mut p = history
            .get(i % history.len().max(1))
            .cloned()
            .unwrap_or_default();
        p.truncate(l % (p.len() + 1));
        p.extend_from_slice(x);
        p
    }

    fn run(k: usize, cap: usize, ops: Vec<Op>) {
        let t = PrefixTrie::with_label_bytes(cap, k);
        let mut m = Model::new(cap, k);
        let mut history: Vec<Vec<u8>> = Vec::new();
        let mut probes: Vec<Vec<u8>> = Vec::new();
        for op in ops {
            match op {
                Op::Insert(p) => {
                    t.insert(&p);
                    m.insert(&p);
                    history.push(p);
                }
                Op::Extend(i, l, x) => {
                    let p = derived(&history, i, l, &x);
                    let before: Vec<(Vec<u8>, usize)> =
                        m.live.iter().map(|s| (s.clone(), t.match_len(s))).collect();
                    t.insert(&p);
                    m.insert(&p);
                    // Evicting one prompt never shortens another live prompt's match.
                    for (s, n) in before {
                        if m.live.contains(&s) {
                            assert!(t.match_len(&s) >= n);
                        }
                    }
                    history.push(p);
                }
                Op::Reinsert(i) => {
                    if let Some(p) = history.get(i % history.len().max(1)).cloned() {
                        t.insert(&p);
                        m.insert(&p);
                    }
                }
                Op::Match(q) => probes.push(q),
                Op::SetCap(c) => {
                    t.set_max_nodes(c);
                    m.set_cap(c);
                }
                Op::Hinted(i, l, x, between) => {
                    let p = derived(&history, i, l, &x);
                    let (n, hint) = t.match_hinted(&p);
                    assert_eq!(n, t.match_len(&p));
                    if let Some((cut, y)) = between {
                        let mut q = p[..cut % (p.len() + 1)].to_vec();
                        q.extend_from_slice(&y);
                        t.insert(&q);
                        m.insert(&q);
                        history.push(q);
                    }
                    t.insert_hinted(&p, hint);
                    m.insert(&p);
                    history.push(p);
                }
            }
            let mut all = probes.clone();
            all.extend(history.iter().cloned());
            assert_agrees(&t, &m, &all);
        }
    }

    #[test]
    fn a_hint_for_another_trie_or_another_slice_is_ignored() {
        let a = PrefixTrie::with_label_bytes(100, 4);
        let b = PrefixTrie::with_label_bytes(100, 4);
        a.insert(b"hello world");
        b.insert(b"goodbye");
        let p = b"hello there".to_vec();
        let (n, hint) = a.match_hinted(&p);
        assert_eq!(n, 6);
        // The hint names a node of `a`; used on `b`, it must not be followed.
        b.insert_hinted(&p, hint);
        assert_eq!(b.match_len(&p), p.len());
        assert_eq!(b.match_len(b"goodbye"), 7);
        assert_eq!(b.prompt_count(), 2);
        // Same trie, another slice (same length, other bytes): walked afresh.
        let q = b"hello thyme".to_vec();
        a.insert_hinted(&q, hint);
        assert_eq!(a.match_len(&q), q.len());
        assert_eq!(a.match_len(&p), 8);
        assert_eq!(a.match_len(b"hello world"), 11);
        // The right slice: stored as by `insert`.
        let (_, hint) = a.match_hinted(&p);
        a.insert_hinted(&p, hint);
        assert_eq!(a.match_len(&p), p.len());
        assert_eq!(a.prompt_count(), 3);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

        #[test]
        fn agrees_with_model_small_chunks(
            k in prop::sample::select(vec![1usize, 2, 3, 8]),
            cap in 1usize..30,
            ops in prop::collection::vec(op(b"ab", 24, 30), 1..40),
        ) {
            run(k, cap, ops);
        }

        #[test]
        fn agrees_with_model_full_chunks(
            cap in 1usize..12,
            ops in prop::collection::vec(op(b"abc", 300, 12), 1..30),
        ) {
            run(LABEL_BYTES, cap, ops);
        }

        #[test]
        fn agrees_with_model_wide_fanout(
            cap in 1usize..60,
            ops in prop::collection::vec(op(b"abcdefghijklmnopqrstuvwxyz0123", 5, 60), 1..60),
        ) {
            run(4, cap, ops);
        }
    }

    fn prompt(seed: u64, prefix: &[u8], n: usize) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut p = prefix.to_vec();
        p.extend((0..n).map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            b'a' + (x % 4) as u8
        }));
        p
    }

    #[test]
    fn concurrent_inserts_are_visible_to_their_writer() {
        let t = Arc::new(PrefixTrie::with_label_bytes(1 << 20, 8));
        let sys = b"shared system prompt ".repeat(10);
        let handles: Vec<_> = (0..4u64)
            .map(|th| {
                let (t, sys) = (t.clone(), sys.clone());
                std::thread::spawn(move || {
                    let mut mine = Vec::new();
                    for i in 0..300u64 {
                        let p = prompt(th * 1000 + i, &sys, 20 + (i as usize % 50));
                        t.insert(&p);
                        assert_eq!(t.match_len(&p), p.len());
                        assert!(t.match_len(&sys) == sys.len());
                        mine.push(p);
                    }
                    mine
                })
            })
            .collect();
        let all: Vec<Vec<u8>> = handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect();
        for p in &all {
            assert_eq!(t.match_len(p), p.len());
        }
        let mut stored = t.check();
        let mut want = all.clone();
        stored.sort();
        want.sort();
        want.dedup();
        assert_eq!(stored, want);
    }

    #[test]
    fn optimistic_reads_never_validate_a_short_match() {
        // Regression: a child block in a segment allocated after a reader's directory snapshot
        // was reported as an absent child, and the (unchanged) parent validated the short match.
        // Many fresh segments (label chunk 8) and wide fan-out make that window common.
        for round in 0..12u64 {
            let t = Arc::new(PrefixTrie::with_label_bytes(1 << 20, 8));
            let sys = b"shared system prompt ".repeat(10);
            let handles: Vec<_> = (0..4u64)
                .map(|th| {
                    let (t, sys) = (t.clone(), sys.clone());
                    std::thread::spawn(move || {
                        for i in 0..300u64 {
                            let seed = round * 100_000 + th * 1000 + i;
                            let p = prompt(seed, &sys, 20 + (i as usize % 50));
                            t.insert(&p);
                            let n = t.match_len(&p);
                            if n != p.len() {
                                let locked = {
                                    let _g = t.lock_writer();
                                    t.walk(&p).map(|w| w.pos)
                                };
                                panic!("round {round}: saw {n} of {}, locked {locked:?}", p.len());
                            }
                        }
                    })
                })
                .collect();
            for h in handles {
                h.join().unwrap();
            }
            t.check();
        }
    }

    /// `threads` threads each re-insert `ops` prompts drawn at random (xorshift seeded from
    /// `seed` and the thread number) from `pool` into `t`, checking every match stays within
    /// its prompt; `every_op(i, x)` runs after each insert with the op number and the random
    /// state. Returns once all have joined.
    fn reinsert_from_pool(
        t: &Arc<PrefixTrie>,
        pool: &Arc<Vec<Vec<u8>>>,
        threads: u64,
        ops: usize,
        seed: u64,
        every_op: fn(&PrefixTrie, usize, u64),
    ) {
        let handles: Vec<_> = (0..threads)
            .map(|th| {
                let (t, pool) = (t.clone(), pool.clone());
                std::thread::spawn(move || {
                    let mut x = (seed * threads + th + 1) * 0x9e37_79b9;
                    for i in 0..ops {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let p = &pool[(x % pool.len() as u64) as usize];
                        t.insert(p);
                        assert!(t.match_len(p) <= p.len());
                        every_op(&t, i, x);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    }

    #[test]
    fn inserts_never_attach_to_a_run_another_thread_just_evicted() {
        // Regression: an insert validated its walk by the version of the node it stopped at,
        // but an eviction running concurrently had unlinked that node without bumping its
        // version yet (freeing was deferred past the lock), so the insert attached its new
        // chain to an unreachable node. Two writers re-inserting a small shared pool under a
        // tiny cap make "the node I stopped at was just evicted" the common case.
        let pool: Arc<Vec<Vec<u8>>> = Arc::new(
            (0..24u64)
                .map(|i| prompt(i % 6, b"sys:", 16 + 8 * (i as usize / 6)))
                .collect(),
        );
        for round in 0..6u64 {
            let t = Arc::new(PrefixTrie::with_label_bytes(24, 4));
            reinsert_from_pool(&t, &pool, 2, 4000, round, |_, _, _| {});
            for p in t.check() {
                assert_eq!(t.match_len(&p), p.len());
            }
        }
    }

    #[test]
    fn free_stacks_shared_and_stolen_concurrently_never_leak_or_double_hand_out() {
        // More threads than stripes (two share each stack) and uneven prompt lengths, so stacks
        // run dry and threads steal from each other's while those push: `check` finds every
        // slot either reachable or free exactly once, and the arena stays near the cap (freed
        // slots are reused before it grows).
        const THREADS: u64 = 2 * FREE_STRIPES as u64;
        let cap = 200;
        let t = Arc::new(PrefixTrie::with_label_bytes(cap, 4));
        let handles: Vec<_> = (0..THREADS)
            .map(|th| {
                let t = t.clone();
                std::thread::spawn(move || {
                    for i in 0..1500u64 {
                        let len = if th % 2 == 0 { 40 } else { (i % 7) as usize };
                        t.insert(&prompt(th * 1_000_000 + i, b"sys:", len));
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        t.check();
        // Each thread holds at most one unlinked chain (<= 12 slots here, plus a split and a
        // block) and one eviction's freed slots between the lock and the hand-back.
        let high = t.arena.lock().high;
        assert!(
            high <= cap + 1 + THREADS as usize * 64,
            "arena grew to {high}"
        );
    }

    /// Run `f` on a new thread whose stripe differs from this thread's (so it appends to
    /// another LRU list and frees to another stack).
    fn on_other_stripe<T: Send + 'static>(f: impl Fn() -> T + Send + Clone + 'static) -> T {
        let mine = free_stripe();
        loop {
            let f = f.clone();
            let r = std::thread::spawn(move || (free_stripe() != mine).then(f))
                .join()
                .unwrap();
            if let Some(r) = r {
                return r;
            }
        }
    }

    #[test]
    fn eviction_takes_the_oldest_prompt_whichever_thread_inserted_it() {
        // This thread's prompts sit on its LRU list, the other thread's on another one; with
        // fewer than EVICT_WINDOW_DIV prompts stored the window is zero, so the victim must be
        // the oldest head by stamp: the model's order exactly, across threads and refreshes.
        let (cap, k) = (40, 4);
        let t = Arc::new(PrefixTrie::with_label_bytes(cap, k));
        let mut m = Model::new(cap, k);
        let mine: Vec<Vec<u8>> = (0..12).map(|i| prompt(i, b"a:", 6)).collect();
        let theirs: Vec<Vec<u8>> = (0..30).map(|i| prompt(100 + i, b"b:", 6)).collect();
        for p in &mine {
            t.insert(p);
            m.insert(p);
        }
        // Refresh a few of this thread's prompts from the other thread (they move lists).
        let moved: Vec<Vec<u8>> = mine[..3].to_vec();
        let t2 = t.clone();
        let mv = moved.clone();
        on_other_stripe(move || mv.iter().for_each(|p| t2.insert(p)));
        moved.iter().for_each(|p| m.insert(p));
        assert_agrees(&t, &m, &mine);
        // The other thread now inserts enough to evict: this thread's untouched prompts are the
        // oldest and must go first, then the moved ones, then the other thread's own.
        let t2 = t.clone();
        let th = theirs.clone();
        on_other_stripe(move || th.iter().for_each(|p| t2.insert(p)));
        theirs.iter().for_each(|p| m.insert(p));
        assert!(t.evictions() > 12, "evicted {}", t.evictions());
        assert_agrees(&t, &m, &theirs);
        // And this thread evicting (its own list now empty or young) takes the other's oldest.
        for i in 0..10 {
            let p = prompt(500 + i, b"c:", 6);
            t.insert(&p);
            m.insert(&p);
        }
        assert_agrees(&t, &m, &theirs);
    }

    #[test]
    fn lru_lists_stay_sound_when_threads_refresh_each_others_prompts() {
        // Four threads (four lists) re-insert prompts from one pool under a small cap, so
        // prompts keep moving between lists, heads are evicted from lists other threads
        // append to, and lists run empty and refill. `check` verifies every list's links,
        // stamps, cached head stamp and non-empty bit.
        let pool: Arc<Vec<Vec<u8>>> = Arc::new(
            (0..48u64)
                .map(|i| prompt(i % 8, b"s:", 4 + 4 * (i as usize / 8)))
                .collect(),
        );
        for round in 0..4u64 {
            let t = Arc::new(PrefixTrie::with_label_bytes(60, 4));
            reinsert_from_pool(&t, &pool, 4, 3000, round, |t, i, x| {
                if i % 1000 == 999 {
                    t.set_max_nodes(30 + (x % 40) as usize);
                }
            });
            let live = t.check();
            assert_eq!(live.len(), t.prompt_count());
            for p in live {
                assert_eq!(t.match_len(&p), p.len());
            }
        }
    }

    #[test]
    fn concurrent_eviction_keeps_the_structure_sound() {
        let t = Arc::new(PrefixTrie::with_label_bytes(300, 4));
        let handles: Vec<_> = (0..4u64)
            .map(|th| {
                let t = t.clone();
                std::thread::spawn(move || {
                    for i in 0..2000u64 {
                        let p = prompt(th * 100_000 + i % 97, b"sys:", i as usize % 40);
                        t.insert(&p);
                        let n = t.match_len(&p);
                        assert!(n <= p.len());
                        assert!(t.node_count() <= 300);
                        if i % 500 == 0 {
                            t.set_max_nodes(300 - (i as usize / 10));
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        for p in t.check() {
            assert_eq!(t.match_len(&p), p.len());
        }
    }

    #[test]
    fn readers_never_see_a_live_prompt_shrink_during_splits_and_merges() {
        // One writer splits the anchor's path by inserting branches off it, then shrinks the cap
        // so the branches are evicted and the path re-merges; readers must always see the
        // anchor whole.
        let k = 8;
        let anchor = prompt(7, b"", 400);
        let t = Arc::new(PrefixTrie::with_label_bytes(1 << 16, k));
        t.insert(&anchor);
        let alone = t.node_count();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let started = Arc::new(AtomicUsize::new(0));
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (t, a, stop) = (t.clone(), anchor.clone(), stop.clone());
                let started = started.clone();
                std::thread::spawn(move || {
                    let mut bent = a.clone();
                    *bent.last_mut().unwrap() ^= 0x80;
                    started.fetch_add(1, Relaxed);
                    let mut n = 0u64;
                    while !stop.load(Relaxed) {
                        assert_eq!(t.match_len(&a), a.len());
                        assert_eq!(t.match_len(&bent), a.len() - 1);
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        while started.load(Relaxed) < 2 {
            std::thread::yield_now();
        }
        for round in 0..300usize {
            for j in 0..12usize {
                let at = (round * 31 + j * 17) % anchor.len();
                let mut b = anchor[..at].to_vec();
                b.push(anchor[at] ^ (1 + j as u8));
                b.extend_from_slice(&prompt(round as u64 * 13 + j as u64, b"", 5));
                t.insert(&b);
            }
            t.insert(&anchor);
            t.set_max_nodes(alone);
            assert_eq!(t.node_count(), alone);
            t.set_max_nodes(1 << 16);
        }
        stop.store(true, Relaxed);
        for r in readers {
            assert!(r.join().unwrap() > 0);
        }
        assert_eq!(t.check(), vec![anchor]);
    }
}
