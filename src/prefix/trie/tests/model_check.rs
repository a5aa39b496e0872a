//! Property tests: random insert / extend / re-insert / hinted-insert / node- and byte-cap
//! change sequences, checked after every step against the naive `Model` (stored set, LRU
//! order, node and byte counts, every `match_len`).

use super::{assert_agrees, Model};
use crate::prefix::trie::{PrefixTrie, LABEL_BYTES};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Insert(Vec<u8>),
    /// Re-insert a prefix of an earlier prompt extended by new bytes (a conversation turn).
    Extend(usize, usize, Vec<u8>),
    /// Re-insert an earlier prompt exactly (refreshes its LRU position).
    Reinsert(usize),
    Match(Vec<u8>),
    SetCap(usize),
    SetByteCap(usize),
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
        1 => (1..=max_cap * max_len.max(4)).prop_map(Op::SetByteCap),
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
            Op::SetByteCap(c) => {
                t.set_max_bytes(c);
                m.set_byte_cap(c);
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
