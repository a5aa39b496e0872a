//! Multi-thread tests: concurrent inserts, evictions, splits and merges against lock-free
//! readers, free-stack stealing and cross-thread LRU order; each ends with `check`.

use super::{assert_agrees, prompt, Model};
use crate::prefix::trie::arena::{free_stripe, FREE_STRIPES};
use crate::prefix::trie::PrefixTrie;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

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
