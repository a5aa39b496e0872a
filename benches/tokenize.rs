//! Gateway tokenization cost per request (issue #23): a 16-turn, ~32 KiB chat conversation
//! through the Llama-3-style fixture tokenizer (tests/fixtures/tokenizer/llama3), cold (no
//! cached prefix: parse, render, encode everything) and warm (the previous turn's prefix is
//! cached, as it is for a conversation's next turn: only the new turn is encoded).
//!
//! `cargo bench --bench tokenize`

use std::path::PathBuf;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use rolter::prompt::Endpoint;
use rolter::tokenize::{ModelTokenizer, RouteTokenizer, DEFAULT_CACHE_BYTES};

const TURNS: usize = 16;
/// Target conversation size.
const BODY_BYTES: usize = 32 * 1024;

const WORDS: [&str; 16] = [
    "the", "cache", "block", "prefix", "token", "router", "replica", "fleet", "model", "reply",
    "stream", "batch", "weather", "paris", "question", "answer",
];

/// A conversation body with `turns` user turns (the last unanswered), sized so that
/// `TURNS` turns come to about [`BODY_BYTES`].
fn body(turns: usize) -> Vec<u8> {
    let per_turn = BODY_BYTES / (TURNS * 2 + 1);
    let text = |seed: usize| {
        let mut s = String::new();
        let mut i = seed;
        while s.len() < per_turn {
            i = i.wrapping_mul(2_654_435_761).wrapping_add(12_345);
            s.push_str(WORDS[(i >> 7) % WORDS.len()]);
            s.push(if i.is_multiple_of(11) { '\n' } else { ' ' });
        }
        s
    };
    let mut messages = vec![serde_json::json!({"role": "system", "content": text(0)})];
    for t in 0..turns {
        messages.push(serde_json::json!({"role": "user", "content": text(2 * t + 1)}));
        if t + 1 < turns {
            messages.push(serde_json::json!({"role": "assistant", "content": text(2 * t + 2)}));
        }
    }
    serde_json::to_vec(&serde_json::json!({"model": "m", "messages": messages})).unwrap()
}

fn bench(c: &mut Criterion) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer/llama3");
    let model = Arc::new(ModelTokenizer::load(&dir).unwrap());
    let previous = body(TURNS - 1);
    let current = body(TURNS);
    eprintln!("conversation: {TURNS} turns, {} bytes", current.len());
    let mut g = c.benchmark_group("tokenize_16_turns_32k");
    g.sample_size(20);
    g.bench_function("cold", |b| {
        b.iter_batched(
            || RouteTokenizer::with_model(model.clone(), DEFAULT_CACHE_BYTES),
            |tok| tok.ids_blocking(Endpoint::Chat, &current).unwrap(),
            BatchSize::LargeInput,
        )
    });
    g.bench_function("warm", |b| {
        b.iter_batched(
            || {
                let tok = RouteTokenizer::with_model(model.clone(), DEFAULT_CACHE_BYTES);
                tok.ids_blocking(Endpoint::Chat, &previous).unwrap();
                tok
            },
            |tok| tok.ids_blocking(Endpoint::Chat, &current).unwrap(),
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
