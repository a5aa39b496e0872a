//! Unit tests of the trie, the naive `Model` the property tests compare it with, and shared
//! helpers. Property tests are in `model_check`, multi-thread tests in `concurrent`. Tests
//! only: must not be needed by non-test code.

mod concurrent;
mod model_check;

use super::node::KIDS_PER_BLOCK;
use super::{PrefixTrie, DEFAULT_MAX_NODES, LABEL_BYTES};
use std::collections::{BTreeSet, VecDeque};

fn lcp(a: &[u8], b: &[u8]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Naive reference: stored prompts in insertion order, same eviction rule, node count
/// computed from the canonical shape (a node at every chunk boundary, prompt end and
/// branch point; one overflow block per 12 children beyond two).
pub(super) struct Model {
    k: usize,
    cap: usize,
    byte_cap: usize,
    pub(super) live: VecDeque<Vec<u8>>,
}

impl Model {
    pub(super) fn new(cap: usize, k: usize) -> Self {
        Model {
            k,
            cap,
            byte_cap: usize::MAX,
            live: VecDeque::new(),
        }
    }

    pub(super) fn insert(&mut self, p: &[u8]) {
        let p = &p[..p.len().min(self.cap * self.k).min(self.byte_cap)];
        if !p.is_empty() {
            if let Some(i) = self.live.iter().position(|s| s == p) {
                self.live.remove(i);
            }
            self.live.push_back(p.to_vec());
        }
        self.evict();
    }

    pub(super) fn set_cap(&mut self, cap: usize) {
        self.cap = cap;
        self.evict();
    }

    pub(super) fn set_byte_cap(&mut self, cap: usize) {
        self.byte_cap = cap.max(1);
        self.evict();
    }

    fn evict(&mut self) {
        while (self.slots() > self.cap || self.bytes() > self.byte_cap) && !self.live.is_empty() {
            self.live.pop_front();
        }
    }

    pub(super) fn match_len(&self, q: &[u8]) -> usize {
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

pub(super) fn assert_agrees(t: &PrefixTrie, m: &Model, probes: &[Vec<u8>]) {
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

/// Distinct bytes a node slot holds on average in a trie filled to its cap with raw chat
/// prompts (`byte_count / node_count`), as docs/trie.md states it.
const PROMPT_BYTES_PER_NODE: f64 = 58.5;

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
    let bytes_per_node = t.byte_count() as f64 / nodes as f64;
    assert!(
        (bytes_per_node / PROMPT_BYTES_PER_NODE - 1.0).abs() < 0.02,
        "{bytes_per_node:.1} prompt bytes per node: update PROMPT_BYTES_PER_NODE"
    );
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

pub(super) fn prompt(seed: u64, prefix: &[u8], n: usize) -> Vec<u8> {
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
