//! Tests of `prompt::responses`.

use super::*;
use crate::prompt::{Endpoint, RequestBody};
use proptest::prelude::*;

fn prompt(endpoint: Endpoint, body: &str) -> Vec<u8> {
    RequestBody::parse(endpoint, body.as_bytes())
        .unwrap()
        .prompt()
}

#[test]
fn instructions_and_a_string_input_encode_like_chat() {
    let r = prompt(
        Endpoint::Responses,
        r#"{"model":"m","instructions":"Be brief.","input":"Hi"}"#,
    );
    let chat = prompt(
        Endpoint::Chat,
        r#"{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}]}"#,
    );
    assert_eq!(r, chat);
    let items = prompt(
        Endpoint::Responses,
        r#"{"model":"m","instructions":"Be brief.","input":[{"role":"user","content":[{"type":"input_text","text":"Hi"}]}]}"#,
    );
    assert_eq!(items, chat);
}

#[test]
fn a_longer_conversation_is_a_byte_extension_and_keeps_order() {
    let base = r#"{"type":"message","role":"user","content":"What is the weather?"}"#;
    let call = r#"{"type":"function_call","call_id":"c1","name":"weather","arguments":"{\"city\":\"Oslo\"}"}"#;
    let out = r#"{"type":"function_call_output","call_id":"c1","output":"rain"}"#;
    let answer = r#"{"type":"message","role":"assistant","content":[{"type":"output_text","text":"It rains.","annotations":[]}]}"#;
    let body = |items: &[&str]| {
        format!(
            r#"{{"model":"m","instructions":"S","input":[{}]}}"#,
            items.join(",")
        )
    };
    let p1 = prompt(Endpoint::Responses, &body(&[base]));
    let p2 = prompt(Endpoint::Responses, &body(&[base, call]));
    let p3 = prompt(Endpoint::Responses, &body(&[base, call, out, answer]));
    assert!(p2.starts_with(&p1) && p2.len() > p1.len());
    assert!(p3.starts_with(&p2) && p3.len() > p2.len());
    let swapped = prompt(Endpoint::Responses, &body(&[base, out, call, answer]));
    assert_ne!(p3, swapped, "order must matter");
    // Roles and text, never raw JSON.
    let text = String::from_utf8_lossy(&p3);
    assert!(text.contains("weather") && text.contains("rain") && text.contains("It rains."));
    assert!(!text.contains("function_call_output") && !text.contains("call_id"));
}

#[test]
fn previous_response_id_is_read_and_bad_bodies_are_errors() {
    let r = RequestBody::parse(
        Endpoint::Responses,
        br#"{"model":"m","input":"x","previous_response_id":"resp_1","stream":true}"#,
    )
    .unwrap();
    assert_eq!(r.previous_response_id.as_deref(), Some("resp_1"));
    assert!(r.stream && r.model_is_json);
    for bad in [
        r#"{"input":"x"}"#,
        r#"{"model":1,"input":"x"}"#,
        r#"{"model":"m","input":5}"#,
        r#"{"model":"m","input":[5]}"#,
        r#"{"model":"m","input":"x","previous_response_id":3}"#,
        r#"{"model":"m","instructions":["x"],"input":"x"}"#,
        r#"{"model":"m","input":[{"role":"user","content":[{"text":"no type"}]}]}"#,
        r#"{"model":"m","input":"#,
    ] {
        assert!(
            RequestBody::parse(Endpoint::Responses, bad.as_bytes()).is_err(),
            "{bad}"
        );
    }
}

fn sniff(stream: bool, chunks: &[&[u8]]) -> Option<String> {
    let mut s = ResponseIdSniffer::new(stream);
    let mut found = None;
    for c in chunks {
        if let Some(id) = s.feed(c) {
            assert!(found.is_none(), "reported twice");
            found = Some(id);
        }
    }
    found
}

#[test]
fn the_id_is_found_in_json_bodies_at_the_top_level_only() {
    let body = br#"{"output":[{"id":"msg_1","content":[{"id":"x"}]}],"id":"resp_\u0041b","status":"completed"}"#;
    assert_eq!(sniff(false, &[body]).as_deref(), Some("resp_Ab"));
    // Byte by byte, the same.
    let bytes: Vec<&[u8]> = body.chunks(1).collect();
    assert_eq!(sniff(false, &bytes).as_deref(), Some("resp_Ab"));
    assert_eq!(
        sniff(false, &[br#"{"object":"response","output":[]}"#]),
        None
    );
    assert_eq!(sniff(false, &[br#"{"id":5,"x":"id"}"#]), None);
    assert_eq!(sniff(false, &[br#"[{"id":"a"}]"#]), None);
    assert_eq!(sniff(false, &[br#"{"a":{"id":"nested"}}"#]), None);
    let long = format!(r#"{{"id":"{}"}}"#, "x".repeat(MAX_ID_BYTES + 1));
    assert_eq!(sniff(false, &[long.as_bytes()]), None);
}

#[test]
fn the_id_is_found_in_the_first_sse_event_carrying_a_response() {
    let stream = b"event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"output\":[],\"id\":\"resp_9\",\"status\":\"in_progress\"}}\n\nevent: response.completed\ndata: {\"response\":{\"id\":\"resp_other\"}}\n\n";
    assert_eq!(sniff(true, &[stream]).as_deref(), Some("resp_9"));
    for split in 1..stream.len() {
        let (a, b) = stream.split_at(split);
        assert_eq!(sniff(true, &[a, b]).as_deref(), Some("resp_9"), "{split}");
    }
    assert_eq!(
        sniff(true, &[b"data: {\"id\":\"top\"}\n\ndata: [DONE]\n\n"]),
        None
    );
    assert_eq!(
        sniff(
            true,
            &[b": comment data: {\"response\":{\"id\":\"no\"}}\ndata: {\"response\":{\"id\":\"yes\"}}\n"]
        )
        .as_deref(),
        Some("yes")
    );
}

proptest! {
    /// Arbitrary bytes never panic, and how they are cut into chunks never changes what
    /// is found.
    #[test]
    fn sniffing_arbitrary_bytes_never_panics_nor_depends_on_chunking(
        bytes in proptest::collection::vec(any::<u8>(), 0..600),
        cut in 0usize..600,
        stream in any::<bool>(),
    ) {
        let (a, b) = bytes.split_at(cut.min(bytes.len()));
        prop_assert_eq!(sniff(stream, &[a, b]), sniff(stream, &[&bytes]));
    }

    /// Well-formed answers with arbitrary ids and filler, cut anywhere: the id is found.
    #[test]
    fn ids_are_found_in_any_chunking(
        id in "[a-zA-Z0-9_\\-]{1,60}",
        filler in "[a-z \\\"{}\\[\\],:]{0,40}",
        cut in 0usize..400,
        stream in any::<bool>(),
    ) {
        let filler = serde_json::to_string(&filler).unwrap();
        let body = if stream {
            format!("event: response.created\ndata: {{\"type\":\"response.created\",\"x\":{filler},\"response\":{{\"output\":[{{\"id\":\"no\"}}],\"id\":\"{id}\"}}}}\n\n")
        } else {
            format!("{{\"object\":{filler},\"output\":[{{\"id\":\"no\",\"k\":{{\"id\":\"no\"}}}}],\"id\":\"{id}\"}}")
        };
        let (a, b) = body.as_bytes().split_at(cut.min(body.len()));
        prop_assert_eq!(sniff(stream, &[a, b]), Some(id));
    }
}
