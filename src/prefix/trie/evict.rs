//! LRU by insertion and eviction: one LRU list per thread stripe (a thread appends what it
//! inserts, or re-inserts, to its own list), each ordered by an insertion stamp taken under the
//! writer lock, so the global order is exact: the oldest prompt is the list head with the
//! oldest stamp. Which prompt goes (`victim_list`): the evicting thread's own oldest, unless
//! another list's head is older by more than `prompt_count / 64` insertions, in which case that
//! (the global oldest) goes. So with one thread inserting (and in every proptest) the order is
//! exactly least-recently-inserted; across threads a victim is never more than 1/64 of the
//! stored prompts (~1.6%) younger than the oldest one, and a thread that stops inserting has its
//! prompts evicted in exact order by the others. (Stamps are 32-bit, compared by wrapping age:
//! exact while the stored prompts span fewer than 2^30 insertions.)
//!
//! Also here: `warm`, which before the writer lock touches the next victims' runs (racy, reads
//! only), and re-compression of a branch point left with one child.
//!
//! Must not free an evicted run's slots before it is unlinked and re-versioned (deferred past
//! the lock when there is room), nor evict a node on another live prompt's path.

use super::arena::{free_stripe, FREE_STRIPES};
use super::node::{
    bump, lock, shape_len, shape_nkids, unlock, Meta, WSlot, LEN_MASK, NIL, ROOT, TERMINAL,
};
use super::writer::{Ctx, DEFERRED_RUNS};
use super::{PrefixTrie, LABEL_BYTES};
use std::sync::atomic::AtomicU32;
use std::sync::atomic::Ordering::Relaxed;

/// How many slots ahead the eviction climb prefetches (4 metadata entries share a cache line).
const PREFETCH_AHEAD: u32 = 8;

/// Extra nodes `PrefixTrie::warm` may visit beyond twice the expected chain length.
const WARM_SLACK: usize = 16;

/// LRU lists, one per thread stripe: a thread appends the prompts it inserts to its own list.
pub(super) const LRU_LISTS: usize = FREE_STRIPES;
const _: () = assert!(LRU_LISTS.is_power_of_two());

/// Insertion stamps advance by this much; the low bits of an entry's stamp name its list.
const STAMP_STEP: u32 = LRU_LISTS as u32;
pub(super) const LIST_MASK: u32 = STAMP_STEP - 1;

/// A thread evicts its own list's oldest prompt unless another list's oldest is older by more
/// than `prompt_count / EVICT_WINDOW_DIV` insertions (then that one goes): exact order while a
/// single thread inserts, within ~1.6% of the stored prompts across threads.
const EVICT_WINDOW_DIV: usize = 64;

/// One LRU list: prompts' terminal nodes, linked through `WSlot::prev` / `next`, oldest first
/// (by stamp). Guarded by the writer lock; atomics so `warm` may read them racily.
pub(super) struct LruEnds {
    pub(super) head: AtomicU32,
    pub(super) tail: AtomicU32,
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

impl PrefixTrie {
    /// Before taking the writer lock: touch the cold lines the locked section is about to use
    /// (the runs of the next eviction victims, the oldest and so coldest memory in the trie),
    /// so their cache misses overlap other threads' work instead of lengthening the critical
    /// section. Follows racy hints and only reads atomics: it can slow nothing but
    /// itself and never affects correctness.
    pub(super) fn warm(&self, new_slots: usize, new_bytes: usize) {
        let dir = self.dir();
        let st = &self.writer.stats;
        if st.nodes.load(Relaxed) + new_slots <= self.max_nodes()
            && st.bytes.load(Relaxed).saturating_add(new_bytes) <= self.max_bytes()
        {
            return;
        }
        // Visit about as many nodes as the insert will need freed, plus slack for prompts
        // whose eviction frees nothing (their path is shared with a newer prompt).
        let mut budget = 2 * new_slots + WARM_SLACK;
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
}

impl Ctx<'_> {
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

    pub(super) fn mark_terminal(&mut self, id: u32) {
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

    // ---- eviction ----------------------------------------------------------------------------

    pub(super) fn evict_to(&mut self, cap: usize, byte_cap: usize) {
        while (self.w.nodes > cap || self.w.bytes > byte_cap) && self.w.nonempty != 0 {
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
