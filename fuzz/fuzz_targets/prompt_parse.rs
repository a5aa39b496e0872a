//! Request body → prompt (`prompt::parse_request`, both endpoints) and the model rewrite.
//!
//! Input: the first byte picks the endpoint (even: chat, odd: completions), the rest is the
//! body. Beyond "never panics", a body that parses must rewrite to a body that parses to
//! the same prompt and stream flag with the new model, and the recorded span must hold the
//! model exactly.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rolter::prompt::{parse_request, rewrite_model, Endpoint};

/// Upstream model names to rewrite to: plain, and one that needs JSON escaping.
const UPSTREAM_MODELS: [&str; 2] = ["meta-llama/Llama-3.1-8B-Instruct", "q\"uote\\ \u{1f}\u{e9}"];

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let endpoint = if selector % 2 == 0 {
        Endpoint::Chat
    } else {
        Endpoint::Completions
    };
    let Ok(parsed) = parse_request(endpoint, body) else {
        return;
    };
    let span_text: String = serde_json::from_slice(&body[parsed.model_span.clone()])
        .expect("model_span holds a JSON string");
    assert_eq!(span_text, parsed.model, "model_span holds the model");
    let upstream = UPSTREAM_MODELS[usize::from(selector / 2) % UPSTREAM_MODELS.len()];
    let rewritten = rewrite_model(body, parsed.model_span.clone(), upstream);
    let again = parse_request(endpoint, &rewritten).expect("a rewritten body still parses");
    assert_eq!(again.model, upstream);
    assert_eq!(again.prompt, parsed.prompt, "the rewrite never changes the prompt");
    assert_eq!(again.stream, parsed.stream);
});
