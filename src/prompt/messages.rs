//! The Anthropic Messages API (`POST /v1/messages`, which vLLM serves): the body's prompt.
//!
//! Encoded as chat (same tag and separators): `system` (a string, or a list of text
//! blocks) first as a `system` message, then each message as `role US content RS`, text
//! blocks as text and any other block (image, tool_use, tool_result, ...) opaque: its type
//! and a canonical hash of its payload. So the same conversation sent to chat or here
//! encodes alike, and an extended conversation is a byte-extension of its history.
//! Must not: touch sockets or routing state.

use super::{encode_content, encode_message, Content, Message, Sink, RS, US};
use serde::Deserialize;
use serde_json::value::RawValue;

/// The fields of a Messages request that routing reads.
#[derive(Deserialize)]
pub(super) struct MessagesBody<'a> {
    #[serde(borrow)]
    pub model: &'a RawValue,
    #[serde(borrow, default)]
    pub system: Option<Content<'a>>,
    #[serde(borrow)]
    pub messages: Vec<Message<'a>>,
    #[serde(default)]
    pub stream: Option<bool>,
}

/// A Messages request's conversation, borrowed from its body.
pub(super) struct Conversation<'a> {
    system: Option<Content<'a>>,
    messages: Vec<Message<'a>>,
}

impl<'a> Conversation<'a> {
    pub(super) fn new(system: Option<Content<'a>>, messages: Vec<Message<'a>>) -> Self {
        Conversation { system, messages }
    }

    /// Append the prompt bytes (module docs), without the leading tag.
    pub(super) fn encode(&self, out: &mut impl Sink) {
        if let Some(system) = &self.system {
            out.extend_from_slice(b"system");
            out.push(US);
            encode_content(out, Some(system), |kind| kind == "text");
            out.push(RS);
        }
        for m in &self.messages {
            encode_message(out, m);
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::prompt::{Endpoint, RequestBody};

    fn prompt(endpoint: Endpoint, body: &str) -> Vec<u8> {
        RequestBody::parse(endpoint, body.as_bytes())
            .unwrap()
            .prompt()
    }

    #[test]
    fn encodes_like_the_same_chat_conversation() {
        let messages = prompt(
            Endpoint::Messages,
            r#"{"model":"m","max_tokens":5,"system":"Be brief.","messages":[{"role":"user","content":"Hi"}]}"#,
        );
        let chat = prompt(
            Endpoint::Chat,
            r#"{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}]}"#,
        );
        assert_eq!(messages, chat);
        // A list of system text blocks is the same system prompt as a string.
        let blocks = prompt(
            Endpoint::Messages,
            r#"{"model":"m","system":[{"type":"text","text":"Be brief."}],"messages":[{"role":"user","content":[{"type":"text","text":"Hi"}]}]}"#,
        );
        assert_eq!(blocks, chat);
    }

    #[test]
    fn an_extended_conversation_is_a_byte_extension_and_tool_payloads_differ() {
        let turn = |extra: &str| {
            prompt(
                Endpoint::Messages,
                &format!(
                    r#"{{"model":"m","system":"S","messages":[{{"role":"user","content":"Weather?"}}{extra}]}}"#
                ),
            )
        };
        let one = turn("");
        let two = turn(
            r#",{"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"w","input":{"city":"Oslo"}}]}"#,
        );
        let two_b = turn(
            r#",{"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"w","input":{"city":"Rome"}}]}"#,
        );
        assert!(two.starts_with(&one) && two.len() > one.len());
        assert_ne!(two, two_b, "different tool inputs look alike");
    }

    #[test]
    fn malformed_bodies_are_errors() {
        for bad in [
            r#"{"model":"m"}"#,
            r#"{"model":"m","messages":"hi"}"#,
            r#"{"model":"m","messages":[{"content":"no role"}]}"#,
            r#"{"model":"m","system":5,"messages":[]}"#,
            r#"{"model":7,"messages":[]}"#,
            r#"{"model":"m","messages":[{"role":"user","content":[{"text":"no type"}]}]}"#,
            r#"{"model":"m","messages":["#,
        ] {
            assert!(
                RequestBody::parse(Endpoint::Messages, bad.as_bytes()).is_err(),
                "{bad}"
            );
        }
    }
}
