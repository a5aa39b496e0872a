//! Request body → prompt (`prompt::RequestBody::parse_with`, every endpoint) and the model
//! rewrite.
//!
//! Input: the first byte picks the endpoint (`Endpoint::ALL[byte % len]`; multipart
//! endpoints get `Content-Type: multipart/form-data; boundary=XyZ`) and the upstream model,
//! the rest is the body. Beyond "never panics", a body that parses must rewrite to a body
//! that parses to the same prompt and stream flag with the new model, and the recorded
//! span must hold the model exactly.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rolter::prompt::{quote_model, rewrite_model_into, Endpoint, RequestBody};

/// Upstream model names to rewrite to: plain, and one that needs JSON escaping.
const UPSTREAM_MODELS: [&str; 2] = ["meta-llama/Llama-3.1-8B-Instruct", "q\"uote\\ \u{1f}\u{e9}"];
/// The `Content-Type` of multipart endpoints' bodies.
const FORM: &[u8] = b"multipart/form-data; boundary=XyZ";

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let endpoint = Endpoint::ALL[usize::from(selector) % Endpoint::ALL.len()];
    let content_type = endpoint.is_form().then_some(FORM);
    let Ok(parsed) = RequestBody::parse_with(endpoint, body, content_type) else {
        return;
    };
    let span = parsed.model_span.clone();
    let span_text: String = if parsed.model_is_json {
        serde_json::from_slice(&body[span.clone()]).expect("model_span holds a JSON string")
    } else {
        String::from_utf8(body[span.clone()].to_vec()).expect("a form model is UTF-8")
    };
    assert_eq!(span_text, parsed.model, "model_span holds the model");
    let upstream = UPSTREAM_MODELS[usize::from(selector / 32) % UPSTREAM_MODELS.len()];
    let replacement = if parsed.model_is_json {
        quote_model(upstream)
    } else {
        upstream.to_string()
    };
    let mut rewritten = Vec::new();
    rewrite_model_into(&mut rewritten, body, span, replacement.as_bytes());
    let again = RequestBody::parse_with(endpoint, &rewritten, content_type)
        .expect("a rewritten body still parses");
    assert_eq!(again.model, upstream);
    assert_eq!(again.prompt(), parsed.prompt(), "the rewrite never changes the prompt");
    assert_eq!(again.stream, parsed.stream);
    assert_eq!(again.previous_response_id, parsed.previous_response_id);
});
