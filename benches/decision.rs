//! Criterion bench of one full cache_aware routing decision (issue 4): the prompt's key
//! (`prefix::key`), `select` over 4 / 16 / 64 warm targets for an 8 KiB prompt, then
//! `record` (insert into the winner's trie) — what the request path does per request,
//! minus I/O.
//!
//! `cache_aware_decision_long/<KiB>`: the same over 16 warm targets for 32 KiB and 256 KiB
//! prompts (chat histories and agent prompts; issue 26's target is 256 KiB <= 20 µs).
//! `cache_aware_decision_long/read_floor/<KiB>`, its reference in the same run: one XXH3-64
//! pass over the same prompts, cycled alike (they are out of the core's caches by the time
//! each comes round again), what any decision that reads the whole prompt once pays.
//!
//! `decision_concurrent/<targets>`: the same select + record over 2 and 16 targets from 1 thread and from
//! 2 threads sharing the route (one strategy, one set of tries), each thread serving its own
//! growing multi-turn chats (the `trie` bench's `concurrent` workload), so later turns return
//! to their cached target and first turns spread over the fleet: the insert + match load the
//! gateway's worker threads put on the routing core. Tries are capped at 15k nodes so they
//! reach steady-state eviction during setup. Afterwards interleaved A/B rounds print the
//! 2-thread throughput speedup, wall-clock and projected for two dedicated cores (as in the
//! `trie` bench).
//!
//! Run: `cargo bench --bench decision` (`-- decision_concurrent` for the 2-thread part only).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rolter::prefix::{prompt_key, PrefixTrie};
use rolter::routing::{CacheAware, Candidate, Decision, FleetView, RouteInput, Strategy};
use std::hint::black_box;
use std::time::Duration;

mod common;
use common::{run_accounted, Chats, Rng, Split, SYSTEM_BYTES};

/// Prompt size from issue 4's target ("an 8 KiB prompt over 16 targets").
const PROMPT_BYTES: usize = 8 << 10;

/// 64 conversations sharing a 2 KiB system prompt, each `PROMPT_BYTES` long.
fn prompts() -> Vec<Vec<u8>> {
    prompts_of(64, PROMPT_BYTES)
}

/// `n` conversations sharing a 2 KiB system prompt, each `bytes` long.
fn prompts_of(n: usize, bytes: usize) -> Vec<Vec<u8>> {
    let system = b"system\x1fYou are a careful assistant. ".repeat(2048 / 38);
    (0..n)
        .map(|i| {
            let mut p = system.clone();
            while p.len() < bytes {
                p.extend_from_slice(format!("user\x1fconversation {i} turn text ").as_bytes());
            }
            p.truncate(bytes);
            p
        })
        .collect()
}

/// One eligible, weight-1 candidate per trie, `inflight(i)` requests in flight on the i-th.
fn candidates<'a>(
    tries: &'a [PrefixTrie],
    labels: &'a [String],
    inflight: impl Fn(usize) -> u64,
) -> Vec<Candidate<'a>> {
    tries
        .iter()
        .zip(labels)
        .enumerate()
        .map(|(i, (t, l))| Candidate {
            inflight: inflight(i),
            eligible: true,
            weight: 1,
            prefix: Some(t),
            label: l,
            ..Default::default()
        })
        .collect()
}

/// What the request path does per request, minus I/O: the prompt's key, select, then
/// record the winner.
fn decide(strategy: &CacheAware, view: &FleetView, prompt: &[u8]) -> Decision {
    let key = prompt_key(prompt);
    let input = RouteInput {
        prompt,
        prompt_key: &key,
        ..Default::default()
    };
    let d = strategy.select(&input, view).expect("a target");
    strategy.record(&input, view, &d);
    d
}

fn decision(c: &mut Criterion) {
    let prompts = prompts();
    let mut group = c.benchmark_group("cache_aware_decision_8KiB");
    group
        .sample_size(30)
        .measurement_time(Duration::from_secs(3));
    for targets in [4usize, 16, 64] {
        let tries: Vec<PrefixTrie> = (0..targets).map(|_| PrefixTrie::new(1_000_000)).collect();
        let labels: Vec<String> = (0..targets).map(|i| format!("t{i}")).collect();
        let strategy = CacheAware::default();
        // Warm every trie with the conversations the way routing would spread them.
        for (i, p) in prompts.iter().enumerate() {
            tries[i % targets].insert(&prompt_key(p));
        }
        let candidates = candidates(&tries, &labels, |i| (i % 3) as u64);
        let view = FleetView::new(&candidates);
        let mut n = 0usize;
        group.bench_with_input(BenchmarkId::from_parameter(targets), &targets, |b, _| {
            b.iter(|| {
                n = (n + 1) % prompts.len();
                black_box(decide(&strategy, &view, &prompts[n]))
            })
        });
    }
    group.finish();
}

/// Long prompts over 16 warm targets: 32 conversations of 32 KiB or 256 KiB.
fn long_prompts(c: &mut Criterion) {
    const TARGETS: usize = 16;
    let mut group = c.benchmark_group("cache_aware_decision_long");
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(3));
    for kib in [32usize, 256] {
        let prompts = prompts_of(32, kib << 10);
        let tries: Vec<PrefixTrie> = (0..TARGETS).map(|_| PrefixTrie::new(1_000_000)).collect();
        let labels: Vec<String> = (0..TARGETS).map(|i| format!("t{i}")).collect();
        let strategy = CacheAware::default();
        for (i, p) in prompts.iter().enumerate() {
            tries[i % TARGETS].insert(&prompt_key(p));
        }
        let candidates = candidates(&tries, &labels, |i| (i % 3) as u64);
        let view = FleetView::new(&candidates);
        let mut n = 0usize;
        group.throughput(Throughput::Bytes((kib << 10) as u64));
        group.bench_with_input(BenchmarkId::from_parameter(kib), &kib, |b, _| {
            b.iter(|| {
                n = (n + 1) % prompts.len();
                black_box(decide(&strategy, &view, &prompts[n]))
            })
        });
        group.bench_with_input(BenchmarkId::new("read_floor", kib), &kib, |b, _| {
            b.iter(|| {
                n = (n + 1) % prompts.len();
                black_box(twox_hash::XxHash3_64::oneshot(&prompts[n]))
            })
        });
    }
    group.finish();
}

/// Fleet sizes of the concurrent route bench: the smallest fleet cache-aware routing has a
/// choice in (each trie takes half the inserts) and issue 4's decision target's 16.
const ROUTE_TARGETS: [usize; 2] = [2, 16];
/// Node cap per trie in the concurrent route bench.
const ROUTE_TRIE_CAP: usize = 15_000;

fn concurrent(c: &mut Criterion) {
    let mut g = c.benchmark_group("decision_concurrent");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    g.throughput(Throughput::Elements(1));
    for targets in ROUTE_TARGETS {
        concurrent_route(&mut g, targets);
    }
    g.finish();
}

fn concurrent_route(
    g: &mut criterion::BenchmarkGroup<criterion::measurement::WallTime>,
    targets: usize,
) {
    let tries: Vec<PrefixTrie> = (0..targets)
        .map(|_| PrefixTrie::new(ROUTE_TRIE_CAP))
        .collect();
    let labels: Vec<String> = (0..targets).map(|i| format!("t{i}")).collect();
    let candidates = candidates(&tries, &labels, |_| 0);
    let view = FleetView::new(&candidates);
    let strategy = CacheAware::default();
    let op = |_: usize, chats: &mut Chats| {
        black_box(decide(&strategy, &view, chats.next()));
    };
    let system = Rng(42).text(SYSTEM_BYTES);
    let mut one: Vec<Chats> = vec![Chats::new(&system, 0)];
    let mut two: Vec<Chats> = vec![Chats::new(&system, 1), Chats::new(&system, 2)];
    // Filled (until every trie evicts: the steady state a long-running gateway is in) by
    // the first bench closure criterion runs, so a filter that skips this group skips it.
    let mut filled = false;
    let mut fill = |one: &mut Vec<Chats>, two: &mut Vec<Chats>| {
        while !filled && tries.iter().any(|t| t.evictions() == 0) {
            run_accounted(one, 10_000, op);
            run_accounted(two, 10_000, op);
        }
        filled = true;
    };

    g.bench_function(BenchmarkId::new("1-thread", targets), |b| {
        fill(&mut one, &mut two);
        b.iter_custom(|n| run_accounted(&mut one, n, op).0)
    });
    g.bench_function(BenchmarkId::new("2-threads", targets), |b| {
        fill(&mut one, &mut two);
        b.iter_custom(|n| run_accounted(&mut two, n, op).0)
    });
    if !filled {
        return;
    }

    let (ops, rounds) = (50_000, 9);
    let (mut wall, mut proj) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let (t1, s1) = run_accounted(&mut one, ops, op);
        let (t2, s2): (Duration, Split) = run_accounted(&mut two, ops, op);
        wall.push(t1.as_secs_f64() / t2.as_secs_f64());
        proj.push(2.0 * s1.cpu as f64 / (s2.cpu + s2.blocked).max(1) as f64);
    }
    for v in [&mut wall, &mut proj] {
        v.sort_by(f64::total_cmp);
    }
    eprintln!(
        "decision_concurrent A/B ({rounds} interleaved rounds of {ops} decisions over \
         {targets} targets), median (min..max): wall-clock 2-thread speedup {:.2}x \
         ({:.2}..{:.2}); projected for 2 dedicated cores {:.2}x ({:.2}..{:.2})",
        wall[rounds / 2],
        wall[0],
        wall[rounds - 1],
        proj[rounds / 2],
        proj[0],
        proj[rounds - 1]
    );
}

criterion_group!(benches, decision, long_prompts, concurrent);
criterion_main!(benches);
