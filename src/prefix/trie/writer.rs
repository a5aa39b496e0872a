//! The writer side: the per-trie writer lock (`std::sync::Mutex`, entered after a short
//! `try_lock` spin), its critical section `Ctx` (the writer's state loaded at lock and published
//! back to atomics on the lock's cache line), chain prebuild before locking, and linking a new
//! suffix (`apply`, `split`).
//!
//! Rules every locked step follows: change nodes top-down, parent before child, each inside its
//! seqlock (a walk validates a parent after reading its child's version); any node unlinked gets
//! a new version inside the same critical section (inserts trust "my node's version is
//! unchanged" to mean "still linked, same path"); a slot is reused only after that. Frees of
//! evicted runs (slot resets, allocator hand-back) happen after the lock is released, the
//! nodes being unreachable by then.
//!
//! Must not be entered from the read path except as `match_hinted`'s locked fallback, and must
//! not free a slot that is still reachable.

use super::evict::LRU_LISTS;
use super::node::{
    lock, make_shape, shape_len, store_label, unlock, Label, Meta, WSlot, LEN_MASK, NIL, TERMINAL,
};
use super::walk::Walk;
use super::{PrefixTrie, LABEL_BYTES};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize};

/// Evicted runs whose freeing can wait until the writer lock is released (more are freed in
/// place): an insert typically evicts one or two prompts.
pub(super) const DEFERRED_RUNS: usize = 8;

/// Writer-lock attempts (each followed by pauses, ~26 ns each here) before `Mutex::lock`:
/// ~2.6 us, std's own spin budget, but also spent when the mutex is marked contended.
const WRITER_TRIES: usize = 25;
const WRITER_TRY_PAUSES: usize = 4;

/// The writer's state, copied out of `Stats` when a critical section starts and stored back
/// when it ends.
#[derive(Clone, Copy)]
pub(super) struct Writer {
    pub(super) nodes: usize,
    pub(super) bytes: usize,
    pub(super) prompts: usize,
    pub(super) evictions: u64,
    /// Next insertion stamp (a multiple of `STAMP_STEP`).
    pub(super) stamp: u32,
    /// Bit `l` set if LRU list `l` is non-empty.
    pub(super) nonempty: u32,
    /// Stamp of each non-empty list's head (its oldest prompt).
    pub(super) head_stamp: [u32; LRU_LISTS],
}

/// Slots an eviction unlinked, to be freed after the writer lock is released: they are
/// unreachable, so only the version bump (for readers still inside) and the allocator remain.
#[derive(Clone, Copy)]
pub(super) struct Deferred {
    /// Exclusive runs, as (leaf, top): freed by following `WSlot::parent` from leaf to top.
    pub(super) runs: [(u32, u32); DEFERRED_RUNS],
    pub(super) nruns: usize,
    /// Single slots already freed (versions bumped), linked through `WSlot::next`.
    pub(super) freed_head: u32,
    pub(super) freed_tail: u32,
}

pub(super) const DEFERRED_NONE: Deferred = Deferred {
    runs: [(NIL, NIL); DEFERRED_RUNS],
    nruns: 0,
    freed_head: NIL,
    freed_tail: NIL,
};

/// A new chain of nodes, filled but not yet linked into the trie.
pub(super) struct Chain {
    pub(super) first: u32,
    pub(super) last: u32,
    /// Depth of its first byte.
    pub(super) d: usize,
    pub(super) nodes: usize,
}

/// The writer lock (guarding `stats`, hence `()`) and the writer's state.
#[repr(C)]
pub(super) struct WriterLine {
    pub(super) lock: std::sync::Mutex<()>,
    pub(super) stats: Stats,
}

const _: () = assert!(std::mem::size_of::<WriterLine>() <= 64, "one cache line");

/// The writer's state, stored (only under the writer lock) at the end of each critical section;
/// getters and `warm` load it without locking.
pub(super) struct Stats {
    pub(super) nodes: AtomicUsize,
    pub(super) bytes: AtomicUsize,
    pub(super) prompts: AtomicUsize,
    pub(super) evictions: AtomicU64,
    /// `Writer::stamp`, `nonempty`, `head_stamp`: on this line (which moves with the lock
    /// anyway), so choosing the list to evict from reads no other thread's list line.
    pub(super) stamp: AtomicU32,
    pub(super) nonempty: AtomicU32,
    pub(super) head_stamp: [AtomicU32; LRU_LISTS],
}

impl PrefixTrie {
    /// The writer lock. `std::sync::Mutex`, not parking_lot: on contention it spins briefly
    /// and then sleeps on a futex, while parking_lot calls `sched_yield` up to seven times
    /// first, and those syscalls cost more CPU than the critical section they wait for.
    /// Poisoning is ignored: a panic mid-update cannot leave a reader-visible inconsistency
    /// (readers validate versions), only leaked slots.
    pub(super) fn lock_writer(&self) -> std::sync::MutexGuard<'_, ()> {
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
    pub(super) fn load_writer(&self) -> Writer {
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
    pub(super) fn with_writer(&self, f: impl FnOnce(&mut Ctx<'_>)) {
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
    pub(super) fn free_run(&self, leaf: u32, top: u32, d: &mut Deferred) {
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
    pub(super) fn prebuild(&self, bytes: &[u8], d: usize) -> Chain {
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
}

/// The writer's view: the trie plus its locked bookkeeping.
pub(super) struct Ctx<'a> {
    pub(super) t: &'a PrefixTrie,
    /// The writer's state, loaded when the lock was taken; `publish` stores it back.
    pub(super) w: Writer,
    /// Slots freed by this critical section, handed to the allocator after it ends.
    pub(super) d: Deferred,
}

impl<'a> Ctx<'a> {
    pub(super) fn slot(&self, id: u32) -> (&'a Meta, &'a Label) {
        self.t.slot_at(id)
    }

    pub(super) fn meta(&self, id: u32) -> &'a Meta {
        self.slot(id).0
    }

    pub(super) fn shape(&self, id: u32) -> u32 {
        self.meta(id).shape.load(Relaxed)
    }

    pub(super) fn ws(&self, id: u32) -> &'a WSlot {
        self.t.wslot(id)
    }

    pub(super) fn parent(&self, id: u32) -> u32 {
        self.ws(id).parent.load(Relaxed)
    }

    pub(super) fn set_parent(&self, id: u32, p: u32) {
        self.ws(id).parent.store(p, Relaxed);
    }

    pub(super) fn end(&self, id: u32) -> usize {
        (self.ws(id).end.load(Relaxed) & !TERMINAL) as usize
    }

    pub(super) fn is_terminal(&self, id: u32) -> bool {
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

    pub(super) fn read_label(&self, id: u32) -> ([u8; LABEL_BYTES], usize) {
        let (m, l) = self.slot(id);
        let mut out = [0u8; LABEL_BYTES];
        for (i, w) in l.0.iter().enumerate() {
            out[i * 8..i * 8 + 8].copy_from_slice(&w.load(Relaxed).to_le_bytes());
        }
        (out, shape_len(m.shape.load(Relaxed)))
    }

    pub(super) fn write_label(&self, id: u32, bytes: &[u8]) {
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

    pub(super) fn alloc(&mut self) -> u32 {
        self.t.take_slots(1)
    }

    /// Free a slot that the caller has already locked (it is reused after this section).
    pub(super) fn free_locked(&mut self, id: u32) {
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

    pub(super) fn alloc_block(&mut self) -> u32 {
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

    // ---- insert ----------------------------------------------------------------------------

    pub(super) fn apply(&mut self, prompt: &[u8], wk: Walk, chain: Option<Chain>) {
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
}
