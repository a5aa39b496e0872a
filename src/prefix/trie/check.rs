//! Tests only: `PrefixTrie::check`, which verifies every structural invariant under the writer
//! lock (shape, counts, parent links, free stacks, LRU lists and stamps) and returns the stored
//! prompts, least recently inserted first. Must not change the trie.

use super::evict::{LIST_MASK, LRU_LISTS};
use super::node::{shape_len, shape_nkids, KIDS_PER_BLOCK, NIL, ROOT};
use super::walk::find_kid;
use super::writer::{Ctx, DEFERRED_NONE};
use super::PrefixTrie;
use std::sync::atomic::Ordering::Relaxed;

impl PrefixTrie {
    /// Verify every structural invariant under the writer lock; return the stored prompts,
    /// least recently inserted first.
    pub(super) fn check(&self) -> Vec<Vec<u8>> {
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
