//! Node slot layout: the 64-byte label, the reader-visible `Meta` (seqlock version, packed
//! shape, two inline child ids), the writer-only `WSlot`, the `shape` bit packing, and the
//! per-slot seqlock protocol (`read_begin` / `read_valid` for readers, `lock` / `bump` /
//! `unlock` for the writer).
//!
//! Must not allocate, walk, or know about any lock but the per-slot seqlock: it defines what a
//! slot is, not where slots live (`arena`) or who may change them (`writer`).

use super::LABEL_BYTES;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::atomic::{fence, AtomicU32, AtomicU64};

/// `LABEL_BYTES` as little-endian `u64` words.
pub(super) const LABEL_WORDS: usize = LABEL_BYTES / 8;

/// Children held by one overflow child block (12 key bytes + 12 `u32` ids fill a 64-byte label).
pub(super) const KIDS_PER_BLOCK: usize = 12;

/// A node has at most one child per distinct first byte.
const MAX_FANOUT: usize = 256;

/// Longest overflow block chain a node can have; bounds optimistic readers on torn state.
pub(super) const MAX_BLOCKS: usize = MAX_FANOUT.div_ceil(KIDS_PER_BLOCK);

pub(super) const NIL: u32 = u32::MAX;
pub(super) const ROOT: u32 = 0;
/// Bit in `WSlot::end` marking a node where a stored prompt ends.
pub(super) const TERMINAL: u32 = 1 << 31;

// `Meta::shape` layout: label length (or a block's entry count), child count, first two keys.
pub(super) const LEN_MASK: u32 = 0x7f;
pub(super) const NKIDS_SHIFT: u32 = 7;
pub(super) const NKIDS_MASK: u32 = 0x1ff;
const KEY0_SHIFT: u32 = 16;
const KEY1_SHIFT: u32 = 24;

#[inline]
pub(super) fn shape_len(s: u32) -> usize {
    (s & LEN_MASK) as usize
}
#[inline]
pub(super) fn shape_nkids(s: u32) -> usize {
    ((s >> NKIDS_SHIFT) & NKIDS_MASK) as usize
}
#[inline]
pub(super) fn shape_key0(s: u32) -> u8 {
    (s >> KEY0_SHIFT) as u8
}
#[inline]
pub(super) fn shape_key1(s: u32) -> u8 {
    (s >> KEY1_SHIFT) as u8
}
#[inline]
pub(super) fn make_shape(len: usize, nkids: usize, key0: u8, key1: u8) -> u32 {
    debug_assert!(len <= LABEL_BYTES && nkids <= MAX_FANOUT);
    len as u32
        | (nkids as u32) << NKIDS_SHIFT
        | (key0 as u32) << KEY0_SHIFT
        | (key1 as u32) << KEY1_SHIFT
}

/// Edge label of one node (or the keys and ids of an overflow child block), as atomics so
/// optimistic readers never race non-atomic memory.
#[repr(C, align(64))]
pub(super) struct Label(pub(super) [AtomicU64; LABEL_WORDS]);

/// The reader-visible part of a node slot.
#[repr(C)]
pub(super) struct Meta {
    /// Seqlock: odd while the writer changes this slot; bumped on every change and on free.
    pub(super) ver: AtomicU32,
    /// See `make_shape`.
    pub(super) shape: AtomicU32,
    /// Up to two children inline; with more, `kid[0]` is the first overflow block.
    pub(super) kid: [AtomicU32; 2],
}

/// Writer bookkeeping of one slot, never read by matchers. Stored under the writer lock, or by
/// whoever holds the slot while it is unlinked (allocator, chain prebuild); atomics so that an
/// inserter may read it racily, without the lock, to warm caches (`PrefixTrie::warm`).
#[repr(C)]
pub(super) struct WSlot {
    pub(super) parent: AtomicU32,
    /// LRU neighbours for terminal nodes; `next` links the free list for free slots.
    pub(super) prev: AtomicU32,
    pub(super) next: AtomicU32,
    /// Depth of the node's last label byte, `TERMINAL` bit if a stored prompt ends here.
    pub(super) end: AtomicU32,
}

#[inline]
pub(super) fn read_begin(m: &Meta) -> Option<u32> {
    let v = m.ver.load(Acquire);
    (v & 1 == 0).then_some(v)
}

#[inline]
pub(super) fn read_valid(m: &Meta, v: u32) -> bool {
    fence(Acquire);
    m.ver.load(Relaxed) == v
}

#[inline]
pub(super) fn lock(m: &Meta) {
    let v = m.ver.load(Relaxed);
    debug_assert!(v & 1 == 0, "slot locked twice");
    m.ver.store(v.wrapping_add(1), Relaxed);
    fence(Release);
}

/// Give an unchanged slot a new version (+2, stays even): invalidates every earlier read.
#[inline]
pub(super) fn bump(m: &Meta) {
    let v = m.ver.load(Relaxed);
    m.ver.store(v.wrapping_add(2), Release);
}

#[inline]
pub(super) fn unlock(m: &Meta) {
    let v = m.ver.load(Relaxed);
    m.ver.store(v.wrapping_add(1), Release);
}

/// Store `bytes` (at most `LABEL_BYTES`) as a label, zero-padded.
pub(super) fn store_label(l: &Label, bytes: &[u8]) {
    let mut buf = [0u8; LABEL_BYTES];
    buf[..bytes.len()].copy_from_slice(bytes);
    for (i, w) in l.0.iter().enumerate() {
        w.store(load_word(&buf, i * 8), Relaxed);
    }
}

#[inline(always)]
pub(super) fn load_word(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}
