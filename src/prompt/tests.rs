//! Tests of `prompt`.

use super::*;

fn chat(body: &str) -> Vec<u8> {
    parse_request(Endpoint::Chat, body.as_bytes())
        .unwrap()
        .prompt
}

#[test]
fn same_shape_different_questions_differ() {
    let a = chat(r#"{"model":"m","messages":[{"role":"user","content":"Explain Rust"}]}"#);
    let b = chat(r#"{"model":"m","messages":[{"role":"user","content":"Who wrote Dune?"}]}"#);
    assert_ne!(a, b);
    // They share only the tag and role, not the JSON scaffolding.
    let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    assert!(common <= "Cuser\x1f".len(), "common prefix {common}");
}

#[test]
fn key_order_and_whitespace_do_not_matter() {
    let a = chat(r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}"#);
    let b = chat(
        "{ \"stream\" : true ,\n \"messages\" : [ { \"content\" : \"hi\" ,\"role\":\"user\" } ],\n\t\"model\":\"m\" }",
    );
    assert_eq!(a, b);
}

#[test]
fn extended_history_is_a_byte_prefix_extension() {
    let short = chat(
        r#"{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}]}"#,
    );
    let long = chat(
        r#"{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello!"},{"role":"user","content":"Bye"}]}"#,
    );
    assert!(long.starts_with(&short));
    assert!(long.len() > short.len());
}

#[test]
fn message_boundaries_are_unambiguous() {
    let a = chat(
        r#"{"model":"m","messages":[{"role":"user","content":"a"},{"role":"user","content":"bc"}]}"#,
    );
    let b = chat(
        r#"{"model":"m","messages":[{"role":"user","content":"ab"},{"role":"user","content":"c"}]}"#,
    );
    let c = chat(r#"{"model":"m","messages":[{"role":"user","content":"a\u001euser\u001fbc"}]}"#);
    assert_ne!(a, b);
    assert_ne!(a, c);
}

#[test]
fn separators_are_escaped_wherever_they_are() {
    let mut out = Vec::new();
    escape_into(&mut out, b"a\x1bb\x1dc\x1ed\x1fe");
    assert_eq!(out, b"a\x1b\x1bb\x1b\x1dc\x1b\x1ed\x1b\x1fe");
    let mut out = Vec::new();
    escape_into(&mut out, b"\x1f\x1f");
    assert_eq!(out, b"\x1b\x1f\x1b\x1f");
    let mut out = Vec::new();
    escape_into(&mut out, b"plain text, no separators\n\t");
    assert_eq!(out, b"plain text, no separators\n\t");
}

#[test]
fn roles_matter() {
    let a = chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#);
    let b = chat(r#"{"model":"m","messages":[{"role":"assistant","content":"x"}]}"#);
    assert_ne!(a, b);
}

#[test]
fn array_content_contributes_text_parts_and_distinguishes_images() {
    let s = chat(r#"{"model":"m","messages":[{"role":"user","content":"hello"}]}"#);
    let p = chat(
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hello"}]}]}"#,
    );
    assert_eq!(s, p);
    let img = |url: &str| {
        chat(&format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"text","text":"look"}},{{"type":"image_url","image_url":{{"url":"{url}"}}}}]}}]}}"#
        ))
    };
    assert_ne!(img("data:a"), img("data:b"));
    assert_eq!(img("data:a"), img("data:a"));
    assert!(img("data:a").starts_with(b"Cuser\x1flook\x1dimage_url:"));
}

#[test]
fn a_part_payload_is_hashed_whatever_its_key_order_and_spacing() {
    let part = |p: &str| {
        chat(&format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{p}]}}]}}"#
        ))
    };
    let a = part(r#"{"type":"image_url","image_url":{"url":"data:a","detail":"high"}}"#);
    let b =
        part(r#"{ "image_url" : { "detail" : "high", "url" : "data:a" }, "type" : "image_url" }"#);
    assert_eq!(a, b);
    // Every member and value counts: a changed detail, a changed type, an extra member,
    // array order, or the same values under other keys make another prompt.
    for other in [
        r#"{"type":"image_url","image_url":{"url":"data:a","detail":"low"}}"#,
        r#"{"type":"input_image","image_url":{"url":"data:a","detail":"high"}}"#,
        r#"{"type":"image_url","image_url":{"url":"data:a","detail":"high"},"x":null}"#,
        r#"{"type":"image_url","image_url":{"detail":"data:a","url":"high"}}"#,
    ] {
        assert_ne!(a, part(other), "{other}");
    }
    let arr = |v: &str| part(&format!(r#"{{"type":"input_audio","data":{v}}}"#));
    assert_ne!(arr("[1,2]"), arr("[2,1]"));
    assert_ne!(arr("[1]"), arr("[[1]]"));
    assert_ne!(arr(r#""1""#), arr("1"));
    assert_eq!(arr("[1, 2.5, true, null]"), arr("[1,2.5,true,null]"));
    // `type` is required and single; `text: null` is no text.
    for bad in [
        r#"{"image_url":{"url":"x"}}"#,
        r#"{"type":"text","type":"image_url"}"#,
        r#"{"type":7}"#,
    ] {
        let body = format!(r#"{{"model":"m","messages":[{{"role":"user","content":[{bad}]}}]}}"#);
        assert!(
            parse_request(Endpoint::Chat, body.as_bytes()).is_err(),
            "{bad}"
        );
    }
    assert_eq!(
        part(r#"{"type":"text","text":null}"#),
        part(r#"{"type":"text"}"#)
    );
}

#[test]
fn completions_prompts() {
    let p = |b: &str| {
        parse_request(Endpoint::Completions, b.as_bytes())
            .unwrap()
            .prompt
    };
    assert_eq!(p(r#"{"model":"m","prompt":"abc"}"#), b"Pabc");
    assert_eq!(
        p(r#"{"model":"m","prompt":[1,2]}"#),
        b"P\0\0\0\x01\0\0\0\x02"
    );
    assert!(
        p(r#"{"model":"m","prompt":[1,2,3]}"#).starts_with(&p(r#"{"model":"m","prompt":[1,2]}"#))
    );
    assert_ne!(
        p(r#"{"model":"m","prompt":["a","b"]}"#),
        p(r#"{"model":"m","prompt":["ab"]}"#)
    );
    // Each prompt shape encodes as documented, and escaped text is still escaped.
    assert_eq!(
        p(r#"{"model":"m","prompt":["a","b\u001e"]}"#),
        b"Pa\x1eb\x1b\x1e\x1e"
    );
    assert_eq!(
        p(r#"{"model":"m","prompt":[[1],[2,3]]}"#),
        b"P\0\0\0\x01\x1e\0\0\0\x02\0\0\0\x03\x1e"
    );
    assert_eq!(p(r#"{"model":"m","prompt":[]}"#), b"P");
    for bad in [
        r#"{"model":"m","prompt":[1,"a"]}"#,
        r#"{"model":"m","prompt":["a",1]}"#,
        r#"{"model":"m","prompt":[[1],2]}"#,
        r#"{"model":"m","prompt":[4294967296]}"#,
        r#"{"model":"m","prompt":[-1]}"#,
        r#"{"model":"m","prompt":5}"#,
        r#"{"model":"m","prompt":{"a":1}}"#,
    ] {
        assert!(
            parse_request(Endpoint::Completions, bad.as_bytes()).is_err(),
            "{bad}"
        );
    }
    // A completion and a chat never share bytes beyond nothing.
    assert_ne!(
        p(r#"{"model":"m","prompt":"x"}"#)[0],
        chat(r#"{"model":"m","messages":[]}"#)[0]
    );
}

#[test]
fn model_span_rewrite_keeps_everything_else() {
    let body = br#"{ "messages": [{"role":"user","content":"hi"}], "model" : "llama", "temperature": 0.5 }"#;
    let r = parse_request(Endpoint::Chat, body).unwrap();
    assert_eq!(r.model, "llama");
    let out = rewrite_model(body, r.model_span, "meta/Llama \"3\"");
    assert_eq!(
        std::str::from_utf8(&out).unwrap(),
        r#"{ "messages": [{"role":"user","content":"hi"}], "model" : "meta/Llama \"3\"", "temperature": 0.5 }"#
    );
}

#[test]
fn bad_bodies_are_errors() {
    for body in [
        "",
        "{",
        r#"{"model":"m"}"#,
        r#"{"model":"m","messages":"hi"}"#,
        r#"{"model":"m","messages":[{"role":"user","content":5}]}"#,
        r#"{"model":"m","model":"n","messages":[]}"#,
        // A raw (unescaped) separator byte: JSON forbids control characters in strings,
        // which is what lets `push_text` copy borrowed strings without escaping them.
        "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"a\x1eb\"}]}",
        "{\"model\":\"m\",\"messages\":[{\"role\":\"us\x1fer\",\"content\":\"ab\"}]}",
    ] {
        assert!(
            parse_request(Endpoint::Chat, body.as_bytes()).is_err(),
            "{body}"
        );
    }
    assert!(matches!(
        parse_request(Endpoint::Chat, br#"{"model":5,"messages":[]}"#),
        Err(PromptError::ModelNotString)
    ));
    let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
    assert!(parse_request(Endpoint::Chat, deep.as_bytes()).is_err());
    assert!(parse_request(Endpoint::Chat, b"{\"model\":\"\xff\",\"messages\":[]}").is_err());
}

#[test]
fn token_ids_header() {
    assert_eq!(parse_token_ids(b"1,2, 3"), Some(vec![1, 2, 3]));
    assert_eq!(parse_token_ids(b""), None);
    assert_eq!(parse_token_ids(b"1,x"), None);
    assert_eq!(parse_token_ids(b"1,,2"), None);
    assert_eq!(parse_token_ids(b"-1"), None);
    assert_eq!(parse_token_ids(b"4294967296"), None);
}
