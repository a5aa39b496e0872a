//! The lock-free read walk: from the root along `prompt`, comparing labels a word at a time,
//! with a fast loop over full single-child nodes stored back to back (`run_chain`, ~2 ns per
//! 64-byte hop, never waiting on a pointer load). Optimistic lock coupling: a child's version
//! is read before its parent is re-validated, and any change, torn read or slot the directory
//! snapshot cannot see ends the attempt with `None` (the caller retries, then walks locked).
//!
//! Must not write anything shared (no stores, no locks) nor trust a value before validating
//! the version it was read under.

use super::arena::{Dir, SEG_SLOTS};
use super::node::{
    load_word, read_begin, read_valid, shape_key0, shape_key1, shape_len, shape_nkids, Label, Meta,
    KIDS_PER_BLOCK, LABEL_WORDS, LEN_MASK, MAX_BLOCKS, NIL, NKIDS_MASK, NKIDS_SHIFT, ROOT,
};
use super::{PrefixTrie, LABEL_BYTES};
use std::sync::atomic::Ordering::Relaxed;

/// Where a walk stopped: `pos` bytes matched, the last `off` of them inside `node`'s label.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Walk {
    pub(super) pos: usize,
    pub(super) node: u32,
    pub(super) ver: u32,
    pub(super) off: usize,
    pub(super) len: usize,
}

/// `shape` bits of a full-label node with exactly one child (the walk's fast path).
const CHAIN_MASK: u32 = LEN_MASK | NKIDS_MASK << NKIDS_SHIFT;
const CHAIN_SHAPE: u32 = LABEL_BYTES as u32 | 1 << NKIDS_SHIFT;

/// A validated position of a walk: `m`/`label` is slot `id`, read at version `v`, and the
/// first `pos` prompt bytes matched up to the start of its label.
#[derive(Clone, Copy)]
struct Cursor<'d> {
    pub(super) pos: usize,
    pub(super) id: u32,
    pub(super) m: &'d Meta,
    pub(super) label: &'d Label,
    pub(super) v: u32,
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

/// Child of a node for first byte `key`: `Some(NIL)` if it has none, `None` if the read could
/// not be completed (torn state, or a block in a segment newer than the reader's directory
/// snapshot) and the walk must restart. May return garbage on torn reads; the caller validates
/// the node's version before trusting the answer.
#[inline]
pub(super) fn find_kid(dir: &Dir, m: &Meta, shape: u32, key: u8) -> Option<u32> {
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
    /// One optimistic walk: `None` if a concurrent write got in the way.
    #[inline]
    pub(super) fn walk(&self, prompt: &[u8]) -> Option<Walk> {
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
