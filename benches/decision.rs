//! Criterion bench of one full cache_aware routing decision (issue 4): `select` over
//! 4 / 16 / 64 warm targets for an 8 KiB prompt, then `record` (insert into the winner's
//! trie) — what the request path does per request, minus I/O.
//!
//! Run: `cargo bench --bench decision`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use rolter::prefix::PrefixTrie;
use rolter::routing::{CacheAware, Candidate, FleetView, RouteInput, Strategy};
use std::hint::black_box;
use std::time::Duration;

/// Prompt size from issue 4's target ("an 8 KiB prompt over 16 targets").
const PROMPT_BYTES: usize = 8 << 10;

/// 64 conversations sharing a 2 KiB system prompt, each `PROMPT_BYTES` long.
fn prompts() -> Vec<Vec<u8>> {
    let system = b"system\x1fYou are a careful assistant. ".repeat(2048 / 38);
    (0..64)
        .map(|i| {
            let mut p = system.clone();
            while p.len() < PROMPT_BYTES {
                p.extend_from_slice(format!("user\x1fconversation {i} turn text ").as_bytes());
            }
            p.truncate(PROMPT_BYTES);
            p
        })
        .collect()
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
            tries[i % targets].insert(p);
        }
        let candidates: Vec<Candidate> = tries
            .iter()
            .zip(&labels)
            .enumerate()
            .map(|(i, (t, l))| Candidate {
                inflight: (i % 3) as u64,
                eligible: true,
                weight: 1,
                prefix: Some(t),
                label: l,
                ..Default::default()
            })
            .collect();
        let view = FleetView::new(&candidates);
        let mut n = 0usize;
        group.bench_with_input(BenchmarkId::from_parameter(targets), &targets, |b, _| {
            b.iter(|| {
                n = (n + 1) % prompts.len();
                let input = RouteInput {
                    prompt: &prompts[n],
                    ..Default::default()
                };
                let d = strategy.select(&input, &view).expect("a target");
                strategy.record(&input, &view, &d);
                black_box(d)
            })
        });
    }
    group.finish();
}

criterion_group!(benches, decision);
criterion_main!(benches);
