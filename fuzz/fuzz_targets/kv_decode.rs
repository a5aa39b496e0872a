//! vLLM KV-event frames (`kv_events::decode::{decode_message, decode_replay, decode_batch}`)
//! and applying what decodes to a residency index.
//!
//! Input: frames, each a 4-byte big-endian length then that many bytes (the layout of
//! `tests/fixtures/kv_events/*.bin`, which seed the corpus); a length running past the
//! end takes what is left. Every decoded batch is applied to a small index, which must
//! stay within its entry cap and answer prefix lookups.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rolter::kv_events::decode::{decode_batch, decode_message, decode_replay, ReplayReply};
use rolter::prefix::residency::ResidencyIndex;

/// Entry cap of the index under test: small, so eviction paths run.
const MAX_ENTRIES: usize = 64;
/// Most frames taken from one input (ZMQ messages here have 2–4).
const MAX_FRAMES: usize = 8;

fn frames(mut data: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    while data.len() >= 4 && out.len() < MAX_FRAMES {
        let len = u32::from_be_bytes([data[0], data[1], data[2], data[3]]) as usize;
        let rest = &data[4..];
        let take = len.min(rest.len());
        out.push(&rest[..take]);
        data = &rest[take..];
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let frames = frames(data);
    let index = ResidencyIndex::new(MAX_ENTRIES);
    let mut batches = Vec::new();
    if let Ok(m) = decode_message(&frames) {
        batches.push(m.batch);
    }
    if let Ok(ReplayReply::Batch(m)) = decode_replay(&frames) {
        batches.push(m.batch);
    }
    if let Some(last) = frames.last() {
        if let Ok(b) = decode_batch(last) {
            batches.push(b);
        }
    }
    for batch in &batches {
        index.apply(&batch.events);
        assert!(index.entry_count() <= MAX_ENTRIES, "index over its cap");
        let tokens: Vec<u32> = batch
            .events
            .iter()
            .filter_map(|e| match e {
                rolter::kv_events::decode::KvEvent::BlockStored(s) => Some(s.token_ids.clone()),
                _ => None,
            })
            .flatten()
            .take(4096)
            .collect();
        let _ = index.match_prefix(&tokens, None);
        if let Some(bs) = index.block_size() {
            let _ = index.match_blocks(&tokens, bs as usize);
        }
    }
});
