//! Where slots live: fixed segments of 1024 slots that are never moved or freed while the trie
//! lives (so lock-free readers may hold references into them), the segment directory (replaced
//! when it grows, old ones retired until `Drop`), the per-thread-stripe free stacks, and arena
//! growth (`take_slots`, `give_back`).
//!
//! A thread allocates from the stack its evictions free to, so in steady state allocation and
//! freeing touch no line another thread writes; a short stack steals from the others before the
//! arena grows. Lock order: writer lock, then one stack at a time, then the arena lock.
//!
//! Must not read or change node contents (labels, shapes, children, versions) apart from the
//! free-list link in `WSlot::next`, and must not take the writer lock.

use super::node::{Label, Meta, WSlot, NIL};
use super::PrefixTrie;
use std::alloc::{alloc_zeroed, dealloc, handle_alloc_error, Layout};
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicUsize};

/// log2 of slots per arena segment: 1024 slots = 96 KiB per segment, small
/// enough that an idle target's trie costs little, large enough that the directory stays tiny.
const SEG_SHIFT: u32 = 10;
pub(super) const SEG_SLOTS: usize = 1 << SEG_SHIFT;

/// Free-slot stacks, one per thread stripe (threads are assigned round-robin): enough that
/// the few threads inserting into one trie at a time rarely share a stack.
pub(super) const FREE_STRIPES: usize = 4;

/// A fixed run of slots. Never moved or freed while the trie lives, so readers can hold
/// references into it without locks.
#[repr(C)]
pub(super) struct Segment {
    pub(super) labels: [Label; SEG_SLOTS],
    pub(super) metas: [Meta; SEG_SLOTS],
    pub(super) wm: [WSlot; SEG_SLOTS],
    /// Insertion stamp of each terminal slot (`STAMP_STEP` per insertion, list index in the
    /// low bits); writer-only, like `wm`. A side array: the 96-byte slot has no room left.
    pub(super) stamps: [AtomicU32; SEG_SLOTS],
}

/// Segment directory. Replaced (never mutated in place beyond its slots) when it grows; old
/// directories stay allocated until the trie drops.
pub(super) struct Dir {
    pub(super) segs: Box<[AtomicPtr<Segment>]>,
}

impl Dir {
    pub(super) fn with_len(n: usize) -> Box<Dir> {
        Box::new(Dir {
            segs: (0..n)
                .map(|_| AtomicPtr::new(std::ptr::null_mut()))
                .collect(),
        })
    }

    /// The slot `id`, if its segment exists in this directory.
    #[inline]
    pub(super) fn slot(&self, id: u32) -> Option<(&Meta, &Label)> {
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
    pub(super) fn ws(&self, id: u32) -> Option<&WSlot> {
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
    pub(super) fn stamp(&self, id: u32) -> Option<&AtomicU32> {
        let seg = self.segs.get((id >> SEG_SHIFT) as usize)?.load(Acquire);
        if seg.is_null() {
            return None;
        }
        // SAFETY: as in `slot`.
        let seg = unsafe { &*seg };
        Some(&seg.stamps[id as usize & (SEG_SLOTS - 1)])
    }
}

/// Arena growth: high-water mark, segments and directories. Behind its own lock, taken only
/// when every free stack is short (the fill phase, or a new high-water mark).
pub(super) struct Arena {
    /// Slots ever handed out (the arena's high-water mark).
    pub(super) high: usize,
    pub(super) segments: usize,
    pub(super) dir_len: usize,
    pub(super) retired: Vec<*mut Dir>,
    pub(super) retired_bytes: usize,
}

/// Own cache-line pair (adjacent-line prefetch pairs lines on x86), against false sharing.
#[repr(align(128))]
pub(super) struct Padded<T>(pub(super) T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// This thread's free-slot stripe.
pub(super) fn free_stripe() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static STRIPE: usize = NEXT.fetch_add(1, Relaxed) % FREE_STRIPES;
    }
    STRIPE.with(|s| *s)
}

impl PrefixTrie {
    /// `n` slots from the allocator, linked through `WSlot::next` (NIL-terminated), most
    /// recently freed first (so a run freed together is reused in its original order). Takes
    /// from this thread's stack first, then the others' (so freed slots are always reused
    /// before the arena grows), then fresh slots.
    pub(super) fn take_slots(&self, n: usize) -> u32 {
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
    pub(super) fn give_back(&self, head: u32, tail: u32) {
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

    pub(super) fn slot_at(&self, id: u32) -> (&Meta, &Label) {
        self.dir().slot(id).expect("allocated slot id in range")
    }

    pub(super) fn wslot(&self, id: u32) -> &WSlot {
        self.dir().ws(id).expect("allocated slot id in range")
    }

    pub(super) fn stamp_at(&self, id: u32) -> &AtomicU32 {
        self.dir().stamp(id).expect("allocated slot id in range")
    }

    #[inline]
    pub(super) fn dir(&self) -> &Dir {
        // SAFETY: the pointer is always a live `Dir`; replaced ones are retired, not freed,
        // until `Drop`, which needs `&mut self`.
        unsafe { &*self.dir.load(Acquire) }
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
