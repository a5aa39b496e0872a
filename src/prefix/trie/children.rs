//! A node's child list under the writer lock: up to two children inline in `Meta`, more in a
//! chain of overflow blocks of `KIDS_PER_BLOCK` (keys and ids packed into a block's label),
//! each block a slot of its own. Add, replace and remove keep the list canonical (two inline
//! when there are two), counting blocks in the writer's node count.
//!
//! The caller holds the writer lock and has locked the owner node's seqlock; this module must
//! not touch any other node's label, version or bookkeeping.

use super::node::{
    lock, make_shape, shape_key0, shape_key1, shape_len, shape_nkids, KIDS_PER_BLOCK, MAX_BLOCKS,
    NIL,
};
use super::writer::Ctx;
use std::sync::atomic::Ordering::Relaxed;

/// The overflow blocks of one node.
pub(super) struct BlockList {
    pub(super) ids: [u32; MAX_BLOCKS],
    pub(super) len: usize,
}

impl std::ops::Deref for BlockList {
    type Target = [u32];
    fn deref(&self) -> &[u32] {
        &self.ids[..self.len]
    }
}

impl Ctx<'_> {
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

    pub(super) fn block_count(&self, b: u32) -> usize {
        shape_len(self.shape(b))
    }

    fn set_block_count(&self, b: u32, n: usize) {
        self.meta(b).shape.store(n as u32, Relaxed);
    }

    /// Blocks of a node with more than two children, in chain order (no heap allocation).
    pub(super) fn blocks(&self, n: u32) -> BlockList {
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
    pub(super) fn kids(&self, n: u32) -> Vec<(u8, u32)> {
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

    pub(super) fn kid_add(&mut self, n: u32, key: u8, c: u32) {
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

    pub(super) fn kid_replace(&mut self, n: u32, key: u8, c: u32) {
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
    pub(super) fn kid_remove(&mut self, n: u32, c: u32) {
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
}
