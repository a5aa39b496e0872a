//! `x-rolter-vllm-token-ids` header parsing (`prompt::parse_token_ids`).
//!
//! Beyond "never panics": accepted ids are bounded in number, and their canonical
//! rendering parses back to the same ids.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rolter::prompt::{parse_token_ids, MAX_TOKEN_IDS};

fuzz_target!(|data: &[u8]| {
    let Some(ids) = parse_token_ids(data) else {
        return;
    };
    assert!(!ids.is_empty() && ids.len() <= MAX_TOKEN_IDS);
    let canonical = ids
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    assert_eq!(parse_token_ids(canonical.as_bytes()), Some(ids));
});
